"""Memory port: the engine's AXI4 master into device memory, a read and a write DMA engine.

The controller asks for byte ranges of device memory — weight tiles, parameter blocks,
program words and request descriptors to read, result buffers to write — as commands
``(addr, length)``; the port cuts each command into AXI4 INCR bursts and streams the data.

Read engine::

    read_cmd ─► burst splitter ─► AR register ─► m_axi ar
                      │ burst track (beats, last-of-command, bytes kept of the last beat)
                      ▼
                  track FIFO (max_outstanding bursts) ─► R counter ─► read_data register

Write engine::

    write_cmd ─► burst splitter ─► AW register ─► m_axi aw
                      │ burst track
                      ├─► W track FIFO ─► W counter ─┐
                      │        write_data ───────────┴─► W register ─► m_axi w
                      └─► B track FIFO ─► B counter ◄─ m_axi b ─► write_done, error

Rules the controller relies on:

* **Alignment.** ``addr`` must be a multiple of the bus width in bytes (``data_width/8``;
  the memory map and the image layout are 4 KiB- and tile-aligned). ``length`` may be any
  byte count: the final beat of a read has the bytes past ``length`` zeroed, the final beat
  of a write has them masked off with ``wstrb``. A misaligned ``addr`` is refused.
* **Range.** A command with ``addr + length > config.mem_bytes`` is refused.
* **Channels.** One port of a striped engine (``channels`` > 1, see
  :class:`~dfvg_hw.striped_memory_port.StripedMemoryPort` and :mod:`dfvg_hw.spec.striping`)
  takes the engine's *logical* commands: ``addr`` must be a multiple of the engine beat
  (``channels · data_width/8`` bytes), a command of ``length`` bytes is ``ceil(length /
  engine beat)`` beats on every channel, issued from physical ``channel · C + (addr /
  engine beat) · data_width/8`` (``C`` = ``mem_bytes / channels``), and the bytes of the
  final beat past ``length`` (possibly all of this channel's) are zeroed or masked. The
  range rule is then the channel's own: every beat stays in ``[channel · C, (channel+1) ·
  C)``. With one channel (the default) logical and physical addresses are the same.
* **Refusal.** A refused command is accepted and dropped: nothing goes on the bus, a read
  streams no beats and a write consumes no data; ``error`` says why from the next cycle
  on. The controller must watch ``error`` rather than wait for data (``read_idle`` and
  ``write_idle`` are true again right away). A zero-length command is a no-op.
* **Bursts.** INCR, full-width beats, at most 256 beats, never crossing a 4 KiB boundary.
  Up to ``max_outstanding`` bursts per direction are in flight, so a long read streams one
  beat per cycle once the first beat arrives (the burst addresses run ahead of the data).
  No IDs: the slave returns read data and write responses in order.
* **Read data order.** Beats leave in address order, commands in command order;
  ``last`` marks each command's final beat.
* **Write completion.** ``write_done`` pulses once per write command that moved data, the
  cycle after its last burst's B response; ``write_idle`` is true when every accepted write
  has been answered — what the controller waits for before it raises DONE.
* **Timing.** A read's first beat leaves ``READ_OVERHEAD`` + L edges after the command is
  accepted (L: the memory's AR-to-R latency), then one beat per cycle while neither the
  memory nor the consumer stalls; a write's beats go out one per cycle from
  ``WRITE_OVERHEAD`` edges after the command while the data and the memory keep up.
* **Bandwidth.** One port moves at most ``data_width/8`` bytes a cycle: 64 B at 512 bits,
  19.2 GB/s at 300 MHz, more than one HBM pseudo-channel's ~13 GB/s. The card's bandwidth
  takes one port per channel: :class:`~dfvg_hw.striped_memory_port.StripedMemoryPort`
  drives ``mem_ports`` of them in lockstep.
* **Errors.** An error response (``rresp``/``bresp`` ≠ OKAY) sets ``error.response``; the
  data still flows (AXI returns every beat of a failed read), so streams stay framed.
  Flags are sticky until ``clear_error``. ``rlast`` is not used: the port counts each
  burst's beats itself, so a slave cannot desynchronise command framing.
"""

from __future__ import annotations

from amaranth import Cat, Const, Module, Mux, Signal, unsigned
from amaranth.lib import data, stream, wiring
from amaranth.lib.fifo import SyncFIFOBuffered
from amaranth.lib.wiring import In, Out
from amaranth.utils import exact_log2

from dfvg_hw.axi4 import AXI4Signature, BOUNDARY_BYTES, Burst, MAX_BURST_BEATS, Resp
from dfvg_hw.spec import timing
from dfvg_hw.spec.config import EngineConfig

__all__ = ["MemoryPort", "MemoryCommand", "ReadBeat", "MemoryPortError", "port_members"]

#: width of the byte and cycle counters (the engine's 64-bit LO/HI registers)
COUNTER_BITS = 64


class MemoryCommand(data.StructLayout):
    """A read or write of ``length`` bytes of device memory from byte address ``addr``
    (64-bit, so the port, not a truncation, decides what is out of range)."""

    def __init__(self, config: EngineConfig):
        super().__init__({"addr": unsigned(64), "length": range(config.mem_bytes + 1)})


class ReadBeat(data.StructLayout):
    """One read beat: ``data`` (byte ``i`` at bits ``8i``), ``last`` on a command's final beat."""

    def __init__(self, data_width: int):
        super().__init__({"data": unsigned(data_width), "last": unsigned(1)})


class MemoryPortError(data.StructLayout):
    """Sticky error flags (each one is the engine's BAD_ADDRESS): ``range`` — a command
    beyond ``mem_bytes`` was refused; ``misaligned`` — a command whose address is not a
    multiple of the bus width was refused; ``response`` — the memory answered SLVERR or
    DECERR (or EXOKAY, which a normal access never gets)."""

    def __init__(self):
        super().__init__({"range": unsigned(1), "misaligned": unsigned(1), "response": unsigned(1)})


class _BurstTrack(data.StructLayout):
    """What the data side needs to know of a burst the address side issued: ``len``
    (beats − 1), ``ends_command`` and ``keep`` (valid bytes in the command's final beat,
    0 … bytes per beat; 0 only on a channel the command's tail does not reach)."""

    def __init__(self, bytes_per_beat: int):
        super().__init__({"len": unsigned(8), "ends_command": unsigned(1),
                          "keep": range(bytes_per_beat + 1)})


class _Burst(data.StructLayout):
    def __init__(self, addr_bits: int, bytes_per_beat: int):
        super().__init__({"addr": unsigned(addr_bits), "track": _BurstTrack(bytes_per_beat)})


class _BurstSplitter(wiring.Component):
    """Checks a command and cuts it into legal AXI4 bursts, one per cycle.

    A burst ends at the command's end, after 256 beats or at a 4 KiB boundary, whichever
    comes first. Shared by the read and the write engine. Commands are logical (engine
    beats of ``channels · bytes_per_beat`` bytes); bursts are physical, in channel
    ``channel`` (the identity with one channel).

    Members
    -------
    cmd : In(stream.Signature(MemoryCommand(config)))
    burst : Out(stream.Signature(_Burst))
        Bursts in address order; the payload is stable while ``valid``.
    refused : Out(MemoryPortError())
        ``range`` / ``misaligned`` during the cycle a refused command is accepted.
    busy : Out(1)
        A command has bursts left to issue.
    """

    def __init__(self, config: EngineConfig, bytes_per_beat: int, channel: int = 0,
                 channels: int = 1):
        self.config = config
        self.bytes_per_beat = bytes_per_beat
        self.channel, self.channels = channel, channels
        self.offset_bits = exact_log2(bytes_per_beat)
        # Wide enough for a 4 KiB page offset and for the address one past the memory.
        self.addr_bits = max(exact_log2(BOUNDARY_BYTES), config.mem_bytes.bit_length())
        super().__init__({
            "cmd": In(stream.Signature(MemoryCommand(config))),
            "burst": Out(stream.Signature(_Burst(self.addr_bits, bytes_per_beat))),
            "refused": Out(MemoryPortError()),
            "busy": Out(1),
        })

    def elaborate(self, platform):
        m = Module()
        bpb, ob = self.bytes_per_beat, self.offset_bits
        page_beats = BOUNDARY_BYTES // bpb
        max_beats = min(MAX_BURST_BEATS, page_beats)
        # the engine beat: this port's beat and the other channels' beside it
        engine_bytes = bpb * self.channels
        eb = exact_log2(engine_bytes)
        base = self.channel * (self.config.mem_bytes // self.channels)

        addr = Signal(self.addr_bits)
        beats_left = Signal(range(self.config.mem_bytes // bpb + 1))
        keep = Signal(range(bpb + 1))

        cmd = self.cmd.payload
        misaligned = cmd.addr[:eb] != 0
        # A logical command inside the memory is, beat for beat, inside every channel:
        # this is the channel's own range check.
        out_of_range = cmd.addr + cmd.length > self.config.mem_bytes
        # Valid bytes of this channel's part of the command's final engine beat.
        tail = cmd.length[:eb]
        low = self.channel * bpb                      # this channel's first byte in a beat
        keep_value = Signal(range(bpb + 1))
        if self.channels == 1:
            m.d.comb += keep_value.eq(Mux(tail == 0, bpb, tail))
        else:
            clipped = Mux(tail >= low + bpb, bpb, tail - low) if low + bpb < engine_bytes \
                else tail - low
            m.d.comb += keep_value.eq(Mux(tail == 0, bpb,
                                          clipped if low == 0 else Mux(tail <= low, 0, clipped)))
        m.d.comb += self.cmd.ready.eq(~self.busy)
        with m.If(self.cmd.valid & self.cmd.ready):
            m.d.comb += [self.refused.misaligned.eq(misaligned),
                         self.refused.range.eq(out_of_range)]
            with m.If(~misaligned & ~out_of_range & (cmd.length != 0)):
                m.d.sync += [
                    self.busy.eq(1),
                    addr.eq(base + ((cmd.addr >> eb) << ob)),
                    beats_left.eq((cmd.length + (engine_bytes - 1)) >> eb),
                    keep.eq(keep_value),
                ]

        # Beats this burst may take: up to the 4 KiB page end, at most 256.
        to_page_end = Signal(range(page_beats + 1))
        limit = Signal(range(max_beats + 1))
        m.d.comb += [
            to_page_end.eq(page_beats - addr[ob:exact_log2(BOUNDARY_BYTES)]),
            limit.eq(Mux(to_page_end < max_beats, to_page_end, max_beats)),
        ]
        ends_command = beats_left <= limit
        beats = Mux(ends_command, beats_left, limit)

        out = self.burst.payload
        m.d.comb += [
            self.burst.valid.eq(self.busy),
            out.addr.eq(addr),
            out.track.len.eq(beats - 1),
            out.track.ends_command.eq(ends_command),
            out.track.keep.eq(keep),
        ]
        with m.If(self.burst.valid & self.burst.ready):
            m.d.sync += [addr.eq(addr + (beats << ob)), beats_left.eq(beats_left - beats)]
            with m.If(ends_command):
                m.d.sync += self.busy.eq(0)
        return m


def port_members(config: EngineConfig, data_width: int) -> dict[str, wiring.Member]:
    """The controller-side members of a memory port of ``data_width``-bit beats (all but
    its AXI master), shared by :class:`MemoryPort` and the striped port."""
    return {
        "read_cmd": In(stream.Signature(MemoryCommand(config))),
        "read_data": Out(stream.Signature(ReadBeat(data_width))),
        "write_cmd": In(stream.Signature(MemoryCommand(config))),
        "write_data": In(stream.Signature(unsigned(data_width))),
        "write_done": Out(1),
        "read_idle": Out(1),
        "write_idle": Out(1),
        "error": Out(MemoryPortError()),
        "clear_error": In(1),
        "read_bytes": Out(COUNTER_BITS),
        "write_bytes": Out(COUNTER_BITS),
        "busy_cycles": Out(COUNTER_BITS),
        "clear_counters": In(1),
    }


class MemoryPort(wiring.Component):
    """The engine's AXI4 master: a read DMA engine and a write DMA engine (see the module
    docstring for the rules commands follow).

    Parameters
    ----------
    config : EngineConfig
        ``mem_bytes`` bounds the commands.
    data_width : int
        AXI data width in bits (256 on the Alveo presets; tests use 64 or 128).
    max_outstanding : int
        Bursts in flight per direction (the depth of the burst-track FIFOs). Enough to
        cover the memory latency: a read streams at one beat per cycle when
        ``max_outstanding · burst beats ≥ latency + burst beats``.
    channel, channels : int
        This port is channel ``channel`` of ``channels`` of a striped engine (see the
        module docstring's *Channels*); by default the only one, addressing all memory.

    Members
    -------
    read_cmd : In(stream.Signature(MemoryCommand(config)))
    read_data : Out(stream.Signature(ReadBeat(data_width)))
    write_cmd : In(stream.Signature(MemoryCommand(config)))
    write_data : In(stream.Signature(unsigned(data_width)))
        Exactly ``ceil(length / (data_width/8))`` beats per write command, in order.
    write_done : Out(1)
        Pulses when a write command's last B response has arrived.
    read_idle, write_idle : Out(1)
        No command is being split, no burst is in flight and (read) no beat waits in
        ``read_data``.
    error : Out(MemoryPortError())
        Sticky error flags, raised the cycle after the cause.
    clear_error : In(1)
        Clears ``error`` (a cause in the same cycle still sets its flag).
    read_bytes, write_bytes : Out(64)
        Bytes delivered on ``read_data`` / written to memory (trimmed tails not counted),
        since reset or ``clear_counters``.
    busy_cycles : Out(64)
        Cycles in which either engine was not idle.
    clear_counters : In(1)
    axi : Out(AXI4Signature(data_width, 64))
        The AXI4 master (see :func:`dfvg_hw.axi4.connect_flat` for ``m_axi_*`` top ports).
    """

    #: Edges from the edge that accepts a read command to the edge that transfers its first
    #: ``read_data`` beat, beyond the memory's own AR-to-R latency L (splitter register, AR
    #: register, read_data register): with neither side stalling, beat ``k`` of a command on
    #: an idle port transfers ``READ_OVERHEAD + L + k`` edges after the command.
    READ_OVERHEAD = timing.MEM_READ_OVERHEAD
    #: Edges from the edge that accepts a write command to the first W transfer (splitter
    #: register, AW register and track, track FIFO output register, W register), with its
    #: data ready: the last burst's B response transfers ``WRITE_OVERHEAD + beats − 1 + L``
    #: edges after the command (L: the memory's last-W-to-B latency), ``write_done`` one later.
    WRITE_OVERHEAD = timing.MEM_WRITE_OVERHEAD

    def __init__(self, config: EngineConfig, *, data_width: int = 256,
                 max_outstanding: int = timing.MEM_MAX_OUTSTANDING, channel: int = 0,
                 channels: int = 1):
        axi = AXI4Signature(data_width, 64)
        if channels < 1 or channels & (channels - 1) or not 0 <= channel < channels:
            raise ValueError(f"channel {channel} of {channels}: need a power-of-two number "
                             f"of channels and 0 <= channel < channels")
        if config.mem_bytes % axi.bytes_per_beat:
            raise ValueError(f"mem_bytes = {config.mem_bytes} is not a multiple of the "
                             f"{axi.bytes_per_beat}-byte bus width")
        if channels > 1 and config.mem_bytes % (channels * BOUNDARY_BYTES):
            raise ValueError(f"mem_bytes = {config.mem_bytes} does not split into {channels} "
                             f"channels of whole 4 KiB pages")
        if max_outstanding < 2:
            raise ValueError("max_outstanding must be at least 2 (one burst in flight would "
                             "stall the bus for the memory latency between bursts)")
        self.config = config
        self.data_width = data_width
        self.bytes_per_beat = axi.bytes_per_beat
        self.max_outstanding = max_outstanding
        self.channel, self.channels = channel, channels
        super().__init__({**port_members(config, data_width), "axi": Out(axi)})

    # -- shared pieces ----------------------------------------------------------------------
    def _address_channel(self, m, burst, valid, addr, length, size, burst_type, ready, fifos):
        """Register bursts onto an AR/AW channel, tracking each in ``fifos`` as it is
        issued; a burst waits while the channel holds one or a FIFO is full (which
        bounds the bursts in flight)."""
        room = Const(1)
        for fifo in fifos:
            room &= fifo.w_rdy
        free = ~valid | ready
        m.d.comb += [
            burst.ready.eq(free & room),
            size.eq(exact_log2(self.bytes_per_beat)),
            burst_type.eq(Burst.INCR),
        ]
        for fifo in fifos:
            m.d.comb += [fifo.w_en.eq(burst.valid & burst.ready),
                         fifo.w_data.eq(burst.payload.track)]
        with m.If(burst.valid & burst.ready):
            m.d.sync += [valid.eq(1), addr.eq(burst.payload.addr), length.eq(burst.payload.track.len)]
        with m.Elif(ready):
            m.d.sync += valid.eq(0)

    def _beat_bytes(self, m, track, command_end):
        """Byte enables of a beat and its byte count: all bytes, except those at and past
        ``keep`` on a command's final beat. Both are signals: as expressions each of the
        ``bytes_per_beat`` uses would carry its own copy of the comparisons (a 512-bit
        channel's Verilog was 1.7 MB of them)."""
        trimmed = Signal()
        enables = Signal(self.bytes_per_beat)
        m.d.comb += trimmed.eq(command_end & (track.keep != self.bytes_per_beat))
        # A trimmed beat keeps bytes 0 … keep-1, where keep < bytes_per_beat: the top byte
        # never; byte 0 always on a lone port (keep ≥ 1 there), else unless keep = 0
        # (written out, as comparisons with a constant result are what Verilator's
        # CMPCONST warns about).
        first = Const(1) if self.channels == 1 else ~trimmed | (track.keep != 0)
        m.d.comb += enables.eq(Cat(first, *[~trimmed | (track.keep > i)
                                            for i in range(1, self.bytes_per_beat - 1)], ~trimmed))
        count = Mux(trimmed, track.keep, self.bytes_per_beat)
        return enables, count

    def _track_fifo(self):
        return SyncFIFOBuffered(width=_BurstTrack(self.bytes_per_beat).size,
                                depth=self.max_outstanding)

    # -- engines ----------------------------------------------------------------------------
    def _read_engine(self, m, count_bytes):
        axi, out = self.axi, self.read_data
        m.submodules.read_splitter = split = _BurstSplitter(self.config, self.bytes_per_beat,
                                                                  self.channel, self.channels)
        m.submodules.read_tracks = tracks = self._track_fifo()
        wiring.connect(m, wiring.flipped(self.read_cmd), split.cmd)
        self._address_channel(m, split.burst, axi.arvalid, axi.araddr, axi.arlen, axi.arsize,
                              axi.arburst, axi.arready, [tracks])

        track = data.View(_BurstTrack(self.bytes_per_beat), tracks.r_data)
        beat = Signal(8)
        burst_end = beat == track.len
        command_end = burst_end & track.ends_command
        # One output register: R advances whenever it is empty or being emptied, so a
        # consumer that is always ready takes a beat every cycle.
        m.d.comb += axi.rready.eq(tracks.r_rdy & (~out.valid | out.ready))
        take = axi.rvalid & axi.rready
        enables, nbytes = self._beat_bytes(m, track, command_end)
        with m.If(take):
            m.d.comb += tracks.r_en.eq(burst_end)
            m.d.sync += [
                beat.eq(Mux(burst_end, 0, beat + 1)),
                out.valid.eq(1),
                out.payload.data.eq(Cat(*[Mux(enables[i], axi.rdata.word_select(i, 8), 0)
                                          for i in range(self.bytes_per_beat)])),
                out.payload.last.eq(command_end),
            ]
            count_bytes(self.read_bytes, nbytes)
        with m.Elif(out.ready):
            m.d.sync += out.valid.eq(0)

        m.d.comb += self.read_idle.eq(~split.busy & (tracks.level == 0) & ~out.valid)
        return split, take & (axi.rresp != Resp.OKAY)

    def _write_engine(self, m, count_bytes):
        axi, inp = self.axi, self.write_data
        m.submodules.write_splitter = split = _BurstSplitter(self.config, self.bytes_per_beat,
                                                                  self.channel, self.channels)
        m.submodules.write_tracks = w_tracks = self._track_fifo()
        m.submodules.response_tracks = b_tracks = self._track_fifo()
        wiring.connect(m, wiring.flipped(self.write_cmd), split.cmd)
        self._address_channel(m, split.burst, axi.awvalid, axi.awaddr, axi.awlen, axi.awsize,
                              axi.awburst, axi.awready, [w_tracks, b_tracks])

        # W: data beats go through one register so the W channel holds its payload while
        # valid whatever the producer does, at one beat per cycle.
        track = data.View(_BurstTrack(self.bytes_per_beat), w_tracks.r_data)
        beat = Signal(8)
        burst_end = beat == track.len
        command_end = burst_end & track.ends_command
        m.d.comb += inp.ready.eq(w_tracks.r_rdy & (~axi.wvalid | axi.wready))
        enables, nbytes = self._beat_bytes(m, track, command_end)
        with m.If(inp.valid & inp.ready):
            m.d.comb += w_tracks.r_en.eq(burst_end)
            m.d.sync += [
                beat.eq(Mux(burst_end, 0, beat + 1)),
                axi.wvalid.eq(1),
                axi.wdata.eq(inp.payload),
                axi.wstrb.eq(enables),
                axi.wlast.eq(burst_end),
            ]
            count_bytes(self.write_bytes, nbytes)
        with m.Elif(axi.wready):
            m.d.sync += axi.wvalid.eq(0)

        # B: one response per burst, in order; the command is complete at its last burst's.
        response = data.View(_BurstTrack(self.bytes_per_beat), b_tracks.r_data)
        m.d.comb += axi.bready.eq(b_tracks.r_rdy)
        answered = axi.bvalid & axi.bready
        m.d.comb += b_tracks.r_en.eq(answered)
        m.d.sync += self.write_done.eq(answered & response.ends_command)

        # Every issued burst stays in b_tracks until its response: that covers W too.
        m.d.comb += self.write_idle.eq(~split.busy & (b_tracks.level == 0))
        return split, answered & (axi.bresp != Resp.OKAY)

    def elaborate(self, platform):
        m = Module()

        def count_bytes(counter, nbytes):
            # clear_counters, below, takes precedence (later statements win)
            m.d.sync += counter.eq(counter + nbytes)

        read_split, read_failed = self._read_engine(m, count_bytes)
        write_split, write_failed = self._write_engine(m, count_bytes)

        with m.If(self.clear_counters):
            m.d.sync += [self.read_bytes.eq(0), self.write_bytes.eq(0), self.busy_cycles.eq(0)]
        with m.Elif(~(self.read_idle & self.write_idle)):
            m.d.sync += self.busy_cycles.eq(self.busy_cycles + 1)

        with m.If(self.clear_error):
            m.d.sync += self.error.eq(0)
        for split in (read_split, write_split):
            with m.If(split.refused.range):
                m.d.sync += self.error.range.eq(1)
            with m.If(split.refused.misaligned):
                m.d.sync += self.error.misaligned.eq(1)
        with m.If(read_failed | write_failed):
            m.d.sync += self.error.response.eq(1)
        return m
