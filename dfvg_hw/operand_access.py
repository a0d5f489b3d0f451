"""Operand access for the sequencers that work one head at a time (ATTN; ROPE and KVAPPEND
stream theirs through :mod:`dfvg_hw.head_stream`).

Their operands are short runs of bytes at arbitrary byte offsets — head ``h`` of a row
starts at byte ``h·k``, and ``k`` need not be a multiple of anything — in VMEM and in
device memory. Three helpers serve them:

* :class:`BlockReader` fetches a small block (a RoPE table row, an ATTN parameter block)
  from any byte address through the bus-aligned memory port, by reading the aligned span
  around it and shifting.
* :class:`VmemWindow` gathers up to ``max_bytes`` bytes from any VMEM byte address with
  the line peek port, or scatters them with the byte-masked poke port, touching nothing
  outside the run — so an in-place operand (``src == dst``) stays correct as long as a
  head is gathered before it is scattered.
* :func:`vmem_span_outside` is the functional model's ``_vspan`` bounds rule, so a
  sequencer can refuse an operand *before* it changes anything (the model checks whole
  operands before it writes; peek and poke do not check).
"""

from __future__ import annotations

from amaranth import Cat, Module, Signal, unsigned
from amaranth.lib import data, stream, wiring
from amaranth.lib.wiring import In, Out
from amaranth.utils import ceil_log2, exact_log2

from dfvg_hw.spec.config import EngineConfig
from dfvg_hw.memory_port import MemoryCommand, ReadBeat

__all__ = ["BlockRead", "BlockReader", "WindowAccess", "VmemWindow", "vmem_span_outside",
           "job_spans_outside", "window_request", "byte_mask"]


def vmem_span_outside(config: EngineConfig, line, rows, row_bytes):
    """Whether the VMEM operand ``rows × row_bytes`` at ``line`` lies (partly) outside VMEM:
    ``line·L + (rows − 1)·stride + row_bytes > vmem_bytes`` with ``stride = row_bytes``
    rounded up to whole lines of ``L = vmem_line_bytes`` (docs/isa.md §1.3). ``rows`` must
    be ≥ 1."""
    L = config.vmem_line_bytes
    stride = (row_bytes + L - 1) // L * L
    return line * L + (rows - 1) * stride + row_bytes > config.vmem_bytes


def job_spans_outside(config: EngineConfig, job, src_row_bytes, dst_row_bytes):
    """Whether a row job's source or destination (``job.rows`` rows from ``job.src`` and
    ``job.dst``, of ``src_row_bytes`` and ``dst_row_bytes`` bytes) lies outside VMEM:
    :func:`vmem_span_outside` for both operands, the ``BAD_ADDRESS`` check every row
    sequencer makes before it writes anything."""
    return (vmem_span_outside(config, job.src, job.rows, src_row_bytes)
            | vmem_span_outside(config, job.dst, job.rows, dst_row_bytes))


def byte_mask(count, n_bytes: int):
    """A bit mask of ``8·n_bytes`` bits with the bytes below ``count`` set."""
    return Cat((i < count).replicate(8) for i in range(n_bytes))


class BlockRead(data.StructLayout):
    """A device-memory block to fetch: ``length`` (≤ ``max_bytes``) bytes at any ``addr``."""

    def __init__(self, max_bytes: int):
        super().__init__({"addr": unsigned(64), "length": range(max_bytes + 1)})


class BlockReader(wiring.Component):
    """Fetches a block of up to ``max_bytes`` bytes from any device-memory byte address.

    The memory port takes bus-aligned addresses only, so the reader asks for the aligned
    run ``[addr − addr mod B, addr + length)`` (``B = data_width / 8``) and drops the
    ``addr mod B`` leading bytes. The port's range check sees exactly the block's end, so
    a block past device memory is refused as the functional model's read would be; the
    port then streams nothing and the reader waits (the owner is reset on a memory error,
    docs in :mod:`dfvg_hw.op_port`). A block of length 0 is done without a read.

    Parameters
    ----------
    config : EngineConfig
        ``mem_bytes`` (for the command layout).
    data_width : int
        Memory bus width in bits.
    max_bytes : int
        Longest block.

    Members
    -------
    cmd : In(stream.Signature(BlockRead(max_bytes)))
        Blocks to fetch, one at a time (ready while idle).
    read_cmd : Out(stream.Signature(MemoryCommand(config)))
    read_data : In(stream.Signature(ReadBeat(data_width)))
        The memory port's read side.
    done : Out(1)
        One-cycle pulse: ``data`` holds the block.
    data : Out(8 · max_bytes)
        The block, byte ``i`` at bits ``8i``; bytes past ``length`` are zero. Held until
        the next command is taken.
    """

    def __init__(self, config: EngineConfig, data_width: int, max_bytes: int):
        self.data_width, self.max_bytes = data_width, max_bytes
        beat = data_width // 8
        # the leading offset is < one beat, so the aligned run spans at most this many beats
        self.max_beats = -(-(beat - 1 + max_bytes) // beat)
        super().__init__(wiring.Signature({
            "cmd": In(stream.Signature(BlockRead(max_bytes))),
            "read_cmd": Out(stream.Signature(MemoryCommand(config))),
            "read_data": In(stream.Signature(ReadBeat(data_width))),
            "done": Out(1),
            "data": Out(8 * max_bytes),
        }))

    def elaborate(self, platform):
        m = Module()
        DW = self.data_width
        beat = DW // 8
        offset_bits = exact_log2(beat)
        raw = Signal(self.max_beats * DW)
        offset = Signal(range(beat))
        aligned = Signal(64)
        total = Signal(range(beat + self.max_bytes))
        beats = Signal(range(self.max_beats + 1))
        m.d.comb += self.data.eq(raw >> (offset << 3))    # offset whole bytes

        with m.FSM(name="block"):
            with m.State("IDLE"):
                m.d.comb += self.cmd.ready.eq(1)
                with m.If(self.cmd.valid):
                    p = self.cmd.payload
                    m.d.sync += [offset.eq(p.addr[:offset_bits]),
                                 aligned.eq(p.addr & ((1 << 64) - beat)),
                                 total.eq(p.addr[:offset_bits] + p.length),
                                 raw.eq(0), beats.eq(0)]
                    # the port treats a zero-length command as a no-op with no beats
                    with m.If(p.length == 0):
                        m.next = "DONE"
                    with m.Else():
                        m.next = "ISSUE"
            with m.State("ISSUE"):
                m.d.comb += [self.read_cmd.valid.eq(1), self.read_cmd.payload.addr.eq(aligned),
                             self.read_cmd.payload.length.eq(total)]
                with m.If(self.read_cmd.ready):
                    m.next = "RECEIVE"
            with m.State("RECEIVE"):
                m.d.comb += self.read_data.ready.eq(1)
                with m.If(self.read_data.valid):
                    m.d.sync += [raw.word_select(beats, DW).eq(self.read_data.payload.data),
                                 beats.eq(beats + 1)]
                    with m.If(self.read_data.payload.last):
                        m.next = "DONE"
            with m.State("DONE"):
                m.d.comb += self.done.eq(1)
                m.next = "IDLE"
        return m


class WindowAccess(data.StructLayout):
    """One VMEM window access: gather (``write`` = 0) or scatter (``write`` = 1) of
    ``count`` bytes at VMEM byte address ``addr``; ``data`` is what a scatter writes."""

    def __init__(self, config: EngineConfig, max_bytes: int):
        super().__init__({
            "write": unsigned(1),
            "addr": unsigned(ceil_log2(config.vmem_bytes) + 1),
            "count": range(max_bytes + 1),
            "data": unsigned(8 * max_bytes),
        })


def window_request(window: "VmemWindow", addr, count, data=None):
    """Comb statements that offer one access on ``window.cmd``: gather ``count`` bytes at
    VMEM byte ``addr``, or, given ``data``, scatter its low ``count`` bytes there. The
    caller moves on when ``window.cmd.ready`` is high and waits for ``window.done``."""
    statements = [window.cmd.valid.eq(1), window.cmd.payload.write.eq(data is not None),
                  window.cmd.payload.addr.eq(addr), window.cmd.payload.count.eq(count)]
    if data is not None:
        statements.append(window.cmd.payload.data.eq(data))
    return statements


class VmemWindow(wiring.Component):
    """Gathers or scatters a run of up to ``max_bytes`` bytes at any VMEM byte address.

    The run covers ``ceil((addr mod L + count) / L)`` lines (``L = vmem_line_bytes``) (at most
    :attr:`max_lines`). A gather peeks them one per cycle into a line register and
    shifts the run down to byte 0 (``data``, bytes past ``count`` zero); a scatter shifts
    ``data`` up into that register and pokes the lines with a byte mask of exactly the run.
    ``done`` pulses ``lines + 2`` cycles after the command's transfer (a gather's last
    line arrives the cycle after its peek). Callers check operand bounds
    first (:func:`vmem_span_outside`): peek and poke do not.

    Parameters
    ----------
    config : EngineConfig
        ``vmem_bytes`` (address width), ``vmem_line_bytes``.
    max_bytes : int
        Longest run.

    Members
    -------
    cmd : In(stream.Signature(WindowAccess(config, max_bytes)))
        Accesses, one at a time (ready while idle).
    done : Out(1)
        One-cycle pulse: the access is complete (a scatter's lines are written).
    data : Out(8 · max_bytes)
        The last gather's bytes, held until the next command is taken.
    peek_addr : Out(16)
    peek_data : In(8 · vmem_line_bytes)
    poke_en : Out(vmem_line_bytes)
    poke_addr : Out(16)
    poke_data : Out(8 · vmem_line_bytes)
        VMEM's random line ports (:class:`~dfvg_hw.vmem.VectorMemory`).
    """

    def __init__(self, config: EngineConfig, max_bytes: int):
        self.config, self.max_bytes = config, max_bytes
        L = config.vmem_line_bytes
        self.max_lines = -(-(L - 1 + max_bytes) // L)
        super().__init__(wiring.Signature({
            "cmd": In(stream.Signature(WindowAccess(config, max_bytes))),
            "done": Out(1),
            "data": Out(8 * max_bytes),
            "peek_addr": Out(16),
            "peek_data": In(8 * L),
            "poke_en": Out(L),
            "poke_addr": Out(16),
            "poke_data": Out(8 * L),
        }))

    def elaborate(self, platform):
        m = Module()
        W = self.max_lines
        L = self.config.vmem_line_bytes
        line_bits = 8 * L
        lines_held = Signal(W * line_bits)
        run_mask = Signal(W * L)                # scatter: the run's bytes
        first = Signal(16)
        shift = Signal(range(L))
        count = Signal(range(self.max_bytes + 1))
        lines = Signal(range(W + 1))
        step = Signal(range(W + 1))                 # lines peeked or poked so far
        captured = Signal()                         # the line peeked last cycle is on peek_data
        write = Signal()
        m.d.comb += self.data.eq((lines_held >> (shift << 3))[:8 * self.max_bytes]
                                 & byte_mask(count, self.max_bytes))

        p = self.cmd.payload
        with m.FSM(name="window"):
            with m.State("IDLE"):
                m.d.comb += self.cmd.ready.eq(1)
                with m.If(self.cmd.valid):
                    low = p.addr[:exact_log2(L)]
                    m.d.sync += [
                        first.eq(p.addr[exact_log2(L):]), shift.eq(low), count.eq(p.count),
                        lines.eq((low + p.count + L - 1) >> exact_log2(L)),
                        write.eq(p.write), step.eq(0), captured.eq(0),
                        lines_held.eq((p.data & byte_mask(p.count, self.max_bytes))
                                  << (low << 3)),
                        run_mask.eq(Cat((i < p.count) for i in range(self.max_bytes)) << low),
                    ]
                    m.next = "RUN"
            with m.State("RUN"):
                m.d.comb += self.peek_addr.eq(first + step)
                with m.If(write):
                    with m.If(step < lines):
                        m.d.comb += [self.poke_addr.eq(first + step),
                                     self.poke_data.eq(lines_held.word_select(step, line_bits)),
                                     self.poke_en.eq(run_mask.word_select(step, L))]
                        m.d.sync += step.eq(step + 1)
                    with m.Else():
                        m.next = "DONE"
                with m.Else():
                    m.d.sync += captured.eq(step < lines)
                    with m.If(captured):
                        previous = (step - 1)[:len(step)]
                        m.d.sync += lines_held.word_select(previous, line_bits).eq(self.peek_data)
                    with m.If(step < lines):
                        m.d.sync += step.eq(step + 1)
                    with m.Else():                  # the last peeked line is captured now
                        m.next = "DONE"
            with m.State("DONE"):
                m.d.comb += self.done.eq(1)
                m.next = "IDLE"
        return m
