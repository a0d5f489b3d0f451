"""Striped memory port: one engine beat across ``mem_ports`` memory channels in lockstep.

The engine's logical address space is striped over its memory channels
(:mod:`dfvg_hw.spec.striping`): engine beat ``b`` (``B = mem_ports · P`` bytes) is the port
beats ``b`` of every channel side by side, port 0 in the low bytes. So a logical command
``(addr, length)`` is the *same* command on every channel — ``ceil(length / B)`` port beats
from physical ``p · C + (addr / B) · P`` — and this component is ``mem_ports``
:class:`~dfvg_hw.memory_port.MemoryPort` s, one per channel (each addressing and
range-checking its own channel), behind the one controller-side interface a single port
has, ``B`` bytes wide::

                    ┌─► MemoryPort(channel 0) ─► m00_axi_*  ─┐
    read_cmd  ──────┼─► MemoryPort(channel 1) ─► m01_axi_*   ├─ read_data: beats joined
    write_cmd ──────┘   …                                    ┘  (port 0 lowest)
    write_data ─ split into P-byte slices, one per port

Lockstep rules:

* **Commands.** A command goes to every port in the same cycle, when every port can take
  it (``read_cmd.ready`` is the AND of the ports'); a port never takes one alone.
* **Read data.** An engine beat leaves when every port has its beat (``read_data.valid``
  is the AND of the ports'), and every port's beat is taken in that cycle; ``last`` is
  port 0's (every port ends each command on the same beat).
* **Write data.** A beat is taken when every port can take its slice, in one cycle.
* **Completion.** ``write_done`` pulses when every port has finished the command (each
  port's pulses are counted until all have one); ``read_idle``/``write_idle`` are the
  AND of the ports', ``error`` the OR, ``clear_error`` goes to all.

Nothing here adds a register: with channels whose memories answer alike (the simulated
memories, which all see the same bursts with the same latency and rate) the striped port
has exactly the timing of one :class:`~dfvg_hw.memory_port.MemoryPort` of ``B`` bytes
whose memory delivers ``EngineConfig.port_beats_per_cycle`` beats a cycle — which is what
the cycle model assumes — and 4 KiB AXI pages are each channel's, i.e. logical pages of
``4096 · mem_ports`` bytes. Channels that drift apart (a real HBM stack refreshes its
pseudo-channels independently) only slow the stream to the slowest port; the data stay
in order. With one port the component is the :class:`MemoryPort` itself, wired through.
"""

from __future__ import annotations

from amaranth import Cat, Module, Signal
from amaranth.lib import wiring
from amaranth.lib.wiring import Out

from dfvg_hw.axi4 import AXI4Signature
from dfvg_hw.memory_port import MemoryPort, port_members
from dfvg_hw.spec import timing
from dfvg_hw.spec.config import EngineConfig

__all__ = ["StripedMemoryPort"]


class StripedMemoryPort(wiring.Component):
    """``ports`` :class:`~dfvg_hw.memory_port.MemoryPort` s in lockstep behind one engine-beat
    wide interface (see the module docstring).

    Parameters
    ----------
    config : EngineConfig
        ``mem_bytes`` bounds the commands; ``mem_ports`` and ``mem_port_bits`` are the
        defaults of ``ports`` and ``port_width``.
    port_width : int, optional
        AXI data width of each port in bits.
    ports : int, optional
        Memory channels (a power of two); channel ``p`` is physical
        ``[p · mem_bytes/ports, (p+1) · mem_bytes/ports)``.
    max_outstanding : int
        Bursts in flight per direction and port (:class:`MemoryPort`).

    Members
    -------
    read_cmd : In(stream.Signature(MemoryCommand(config)))
        Logical commands: ``addr`` a multiple of the engine beat ``ports · port_width/8``.
    read_data : Out(stream.Signature(ReadBeat(ports · port_width)))
        Engine beats; port ``p``'s beat at bits ``[p · port_width, (p+1) · port_width)``.
    write_cmd : In(stream.Signature(MemoryCommand(config)))
    write_data : In(stream.Signature(unsigned(ports · port_width)))
        ``ceil(length / engine beat)`` beats per write command, in order.
    write_done : Out(1)
        Pulses when every port has finished a write command.
    read_idle, write_idle : Out(1)
        Every port is idle in that direction.
    error : Out(MemoryPortError())
        The OR of the ports' sticky flags.
    clear_error : In(1)
    read_bytes, write_bytes : Out(64)
        Bytes delivered / written, all ports together (trimmed tails not counted).
    busy_cycles : Out(64)
        Cycles in which some port was not idle.
    clear_counters : In(1)
    axi : Out(AXI4Signature(port_width, 64)).array(ports)
        One AXI4 master per channel (flat names: :func:`dfvg_hw.axi4.master_prefix`).
    """

    def __init__(self, config: EngineConfig, *, port_width: int | None = None,
                 ports: int | None = None, max_outstanding: int = timing.MEM_MAX_OUTSTANDING):
        self.config = config
        self.port_width = port_width = port_width or config.mem_port_bits
        self.ports = ports = ports or config.mem_ports
        self.max_outstanding = max_outstanding
        self.data_width = ports * port_width
        self.bytes_per_beat = self.data_width // 8
        #: the channels' ports, port ``p`` on channel ``p``
        self.channels = [MemoryPort(config, data_width=port_width, max_outstanding=max_outstanding,
                                    channel=p, channels=ports) for p in range(ports)]
        super().__init__({**port_members(config, self.data_width),
                          "axi": Out(AXI4Signature(port_width, 64)).array(ports)})

    def elaborate(self, platform):
        m = Module()
        ports = self.channels
        for p, port in enumerate(ports):
            m.submodules[f"channel{p}"] = port
            wiring.connect(m, wiring.flipped(self.axi[p]), port.axi)

        def all_of(signals):
            return Cat(*signals).all()

        # Commands: to every port at once, when every port takes them.
        for name in ("read_cmd", "write_cmd"):
            outer = getattr(self, name)
            ready = all_of(getattr(port, name).ready for port in ports)
            m.d.comb += outer.ready.eq(ready)
            for port in ports:
                inner = getattr(port, name)
                m.d.comb += [inner.valid.eq(outer.valid & ready), inner.payload.eq(outer.payload)]

        # Read data: an engine beat when every port has its beat.
        valid = all_of(port.read_data.valid for port in ports)
        m.d.comb += [
            self.read_data.valid.eq(valid),
            self.read_data.payload.data.eq(Cat(*(port.read_data.payload.data for port in ports))),
            self.read_data.payload.last.eq(ports[0].read_data.payload.last),
        ]
        for port in ports:
            m.d.comb += port.read_data.ready.eq(self.read_data.ready & valid)

        # Write data: each port its slice, all in one cycle.
        ready = all_of(port.write_data.ready for port in ports)
        m.d.comb += self.write_data.ready.eq(ready)
        for p, port in enumerate(ports):
            m.d.comb += [port.write_data.valid.eq(self.write_data.valid & ready),
                         port.write_data.payload.eq(
                             self.write_data.payload.word_select(p, self.port_width))]

        # Write completion: a port's pulses wait (counted) until every port has had one.
        if len(ports) == 1:
            m.d.comb += self.write_done.eq(ports[0].write_done)
        else:
            # A port runs at most max_outstanding commands (a burst each, at least) ahead.
            waiting = [Signal(range(self.max_outstanding + 2), name=f"done_waiting{p}")
                       for p in range(len(ports))]
            have = [w + port.write_done for w, port in zip(waiting, ports)]
            done = all_of(h != 0 for h in have)
            m.d.comb += self.write_done.eq(done)
            for w, h in zip(waiting, have):
                m.d.sync += w.eq(h - done)

        m.d.comb += [
            self.read_idle.eq(all_of(port.read_idle for port in ports)),
            self.write_idle.eq(all_of(port.write_idle for port in ports)),
        ]
        for flag in ("range", "misaligned", "response"):
            m.d.comb += getattr(self.error, flag).eq(
                Cat(*(getattr(port.error, flag) for port in ports)).any())
        for port in ports:
            m.d.comb += [port.clear_error.eq(self.clear_error),
                         port.clear_counters.eq(self.clear_counters)]
        m.d.comb += [self.read_bytes.eq(sum(port.read_bytes for port in ports)),
                     self.write_bytes.eq(sum(port.write_bytes for port in ports))]
        with m.If(self.clear_counters):
            m.d.sync += self.busy_cycles.eq(0)
        with m.Elif(~(self.read_idle & self.write_idle)):
            m.d.sync += self.busy_cycles.eq(self.busy_cycles + 1)
        return m
