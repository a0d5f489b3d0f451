"""VMEM, the activation scratchpad (docs/isa.md §1.3), and the width converters that move
its rows to and from the compute units.

A VMEM line is ``L = config.vmem_line_bytes`` bytes (16 for the small presets, 64 for the
512-bit Alveo ones). :class:`VectorMemory` is ``vmem_bytes / L`` lines with one reader
and one writer. Each takes an operand as a :class:`VmemSpan` — ``rows`` rows of
``row_bytes`` bytes starting at line ``line``, row ``r`` at byte ``line·L + r·stride``
with ``stride = ceil(row_bytes / L)·L`` — exactly the functional model's ``_vspan``
(sim/functional.py). Because the stride is whole lines, a span is one run of consecutive
lines, ``rows · ceil(row_bytes / L)`` of them, so both ports walk a single incrementing
line address; only the last line of each row is partial.

:class:`Gearbox` converts between the line stream and a unit's beat
(``lanes`` elements of 1 or 2 bytes), splitting or packing; rows are the unit of
``last`` on both sides, so a row that does not fill its last beat ends cleanly.

Typical operand paths (lanes = 4, the ``tiny`` preset, L = 16)::

    RMSNORM src (int16):  VectorMemory.rd ─► Gearbox(16, 8)  ─► unit (4 × int16 per beat)
    RMSNORM dst (int8):   unit (4 × int8)  ─► Gearbox(4, 16)  ─► VectorMemory.wr

The writer counts lines, it does not look for ``last``: each row must arrive as exactly
``ceil(row_bytes / L)`` lines. Packing (unit beats ≤ L bytes) gives that whenever the
unit's row is at most that many lines. Splitting a unit beat wider than a line always
yields ``beat / L`` lines, so a row whose last beat is partial (64-lane int8 beats and
16-byte lines: a 100-byte row → 8 lines, not 7) has surplus lines the controller must
drop before ``wr``.
"""

from __future__ import annotations

from amaranth import Cat, Module, Mux, Signal, unsigned
from amaranth.lib import data, enum, stream, wiring
from amaranth.lib.memory import Memory
from amaranth.lib.wiring import In, Out
from amaranth.utils import ceil_log2

from dfvg_hw.spec import timing
from dfvg_hw.spec.config import EngineConfig

__all__ = ["VmemSpan", "VmemReadBeat", "VmemWriteBeat", "ByteBeat", "VectorMemory", "Gearbox",
           "line_layout"]


def line_layout(line_bytes: int) -> data.ArrayLayout:
    """One VMEM line of ``line_bytes`` bytes (byte ``b`` at bits ``8b``: little-endian, as
    the ISA stores elements)."""
    return data.ArrayLayout(unsigned(8), line_bytes)


class VmemSpan(data.StructLayout):
    """A VMEM operand (docs/isa.md §1.3): ``rows`` rows (≥ 1) of ``row_bytes`` bytes from
    line ``line``.

    ``row_bytes`` has ``vmem_bytes.bit_length()`` bits: enough for any row that fits.
    A controller whose byte count is wider (``n·k`` of ROPE/ATTN, ``2n`` of a WIDE
    operand) saturates it to the field's maximum, which always exceeds ``vmem_bytes``
    and so is refused like the functional model's BAD_ADDRESS.
    """

    def __init__(self, config: EngineConfig):
        super().__init__({
            "line": unsigned(16),
            "rows": unsigned(8),
            "row_bytes": unsigned(config.vmem_bytes.bit_length()),
        })


class VmemReadBeat(data.StructLayout):
    """One line read from VMEM: ``data`` (``line_bytes`` bytes, those past the row's end
    zero), ``row_last`` on each row's final line and ``last`` on the span's final line."""

    def __init__(self, line_bytes: int):
        super().__init__({"data": line_layout(line_bytes), "row_last": unsigned(1),
                          "last": unsigned(1)})


class VmemWriteBeat(data.StructLayout):
    """One line to write to VMEM: ``data`` (``line_bytes`` bytes; those past the row's end
    are ignored)."""

    def __init__(self, line_bytes: int):
        super().__init__({"data": line_layout(line_bytes)})


class ByteBeat(data.StructLayout):
    """A beat of ``n_bytes`` bytes with ``last`` on a row's final beat."""

    def __init__(self, n_bytes: int):
        super().__init__({"data": data.ArrayLayout(unsigned(8), n_bytes), "last": unsigned(1)})


class _SpanState(enum.Enum, shape=2):
    IDLE = 0
    CHECK = 1
    RUN = 2


class _SpanSequencer(wiring.Component):
    """Walks the lines of one :class:`VmemSpan` at a time: the address side shared by the
    reader and the writer of :class:`VectorMemory`.

    A command is taken in IDLE, bounds-checked in the next cycle (CHECK, from registers,
    so the multiply stays off the stream's path) and then walked in RUN, one line per
    cycle in which ``step`` is high. A refused span, or one of no lines, returns to IDLE
    from CHECK.

    Parameters
    ----------
    config : EngineConfig
        ``vmem_bytes``, ``vmem_line_bytes``.

    Members
    -------
    cmd : In(stream.Signature(VmemSpan(config)))
        Spans; ready exactly when idle.
    cancel : In(1)
        Drops the current span; idle from the next cycle (nothing steps meanwhile).
    step : In(1)
        The current line is moved this cycle (only while ``active``).
    active : Out(1)
        A line is waiting to be moved: ``line``, ``row_last``, ``last``, ``byte_mask``
        describe it.
    line : Out(16)
        Its line address.
    row_last, last : Out(1)
        It is the final line of its row / of the span.
    byte_mask : Out(vmem_line_bytes)
        Its bytes that lie inside the row (all, except on a row's final line).
    refused : Out(1)
        One-cycle pulse: the span being checked lies (partly) outside VMEM, or has no rows.
    done : Out(1)
        One-cycle pulse, the cycle after the span's final line stepped (or after the check
        of a span of no lines).
    """

    def __init__(self, config: EngineConfig):
        self.config = config
        super().__init__(wiring.Signature({
            "cmd": In(stream.Signature(VmemSpan(config))),
            "cancel": In(1),
            "step": In(1),
            "active": Out(1),
            "line": Out(16),
            "row_last": Out(1),
            "last": Out(1),
            "byte_mask": Out(config.vmem_line_bytes),
            "refused": Out(1),
            "done": Out(1),
        }))

    def elaborate(self, platform):
        m = Module()
        L = self.config.vmem_line_bytes
        span = Signal(VmemSpan(self.config))
        max_row_lines = -(-((1 << len(span.row_bytes)) - 1) // L)
        row_lines = Signal(range(max_row_lines + 1))
        rows_left = Signal.like(span.rows)          # rows after the current one
        row_lines_left = Signal.like(row_lines)     # lines of the current row after this one
        state = Signal(_SpanState)

        # docs/isa.md §1.3: [line·L, line·L + (rows−1)·stride + row_bytes) ⊆ VMEM.
        end = Signal(range(((1 << 16) + 255 * max_row_lines) * L + (1 << len(span.row_bytes))))
        bad = Signal()
        # index of the row's final byte within its last line (row_bytes ≥ 1 when walking)
        final_byte = Signal(ceil_log2(L))
        m.d.comb += [
            end.eq((span.line + (span.rows - 1) * row_lines) * L + span.row_bytes),
            bad.eq((span.rows == 0) | (end > self.config.vmem_bytes)),
            self.active.eq((state == _SpanState.RUN) & ~self.cancel),
            self.row_last.eq(row_lines_left == 0),
            self.last.eq(self.row_last & (rows_left == 0)),
            final_byte.eq(span.row_bytes - 1),
            self.byte_mask.eq(Mux(self.row_last, (2 << final_byte) - 1, (1 << L) - 1)),
        ]

        m.d.sync += self.done.eq(0)
        with m.Switch(state):
            with m.Case(_SpanState.IDLE):
                m.d.comb += self.cmd.ready.eq(~self.cancel)
                with m.If(self.cmd.valid & ~self.cancel):
                    m.d.sync += [span.eq(self.cmd.p),
                                 row_lines.eq((self.cmd.p.row_bytes + L - 1) >> ceil_log2(L)),
                                 state.eq(_SpanState.CHECK)]
            with m.Case(_SpanState.CHECK):
                m.d.comb += self.refused.eq(bad & ~self.cancel)
                m.d.sync += [self.line.eq(span.line), rows_left.eq(span.rows - 1),
                             row_lines_left.eq(row_lines - 1)]
                with m.If(bad | (row_lines == 0)):
                    m.d.sync += [self.done.eq(~bad & ~self.cancel), state.eq(_SpanState.IDLE)]
                with m.Else():
                    m.d.sync += state.eq(_SpanState.RUN)
            with m.Case(_SpanState.RUN):
                with m.If(self.active & self.step):
                    m.d.sync += self.line.eq(self.line + 1)
                    with m.If(self.last):
                        m.d.sync += [self.done.eq(1), state.eq(_SpanState.IDLE)]
                    with m.Elif(self.row_last):
                        m.d.sync += [row_lines_left.eq(row_lines - 1), rows_left.eq(rows_left - 1)]
                    with m.Else():
                        m.d.sync += row_lines_left.eq(row_lines_left - 1)
            with m.Default():                       # the unused encoding: recover
                m.d.sync += state.eq(_SpanState.IDLE)
        with m.If(self.cancel):
            m.d.sync += state.eq(_SpanState.IDLE)
        return m


class VectorMemory(wiring.Component):
    """The engine's VMEM: ``vmem_bytes / L`` lines of ``L = vmem_line_bytes`` bytes, one
    span reader and one span writer working concurrently.

    Storage is one :class:`~amaranth.lib.memory.Memory` of ``8·L``-bit words (one line each)
    with a byte-granular write port — so a row's final, partial line is written without
    disturbing the bytes after the row — and one synchronous read port.

    **Reader.** A span on ``rd_cmd`` streams its ``rows · ceil(row_bytes/L)`` lines on
    ``rd``, row by row, one line per cycle while ``rd`` is ready. Bytes past a row's end
    are zero (VMEM may hold anything there). The read port's own data register is the
    output register: it is enabled only while ``rd`` can advance, so a stall holds the
    line and nothing is lost or duplicated. The first line is valid :attr:`READ_LATENCY`
    cycles after the command's transfer.

    **Writer.** A span on ``wr_cmd`` takes exactly ``rows · ceil(row_bytes/L)`` lines from
    ``wr`` and writes them in order, one per cycle, each line in the cycle it is
    transferred; only the first ``row_bytes`` bytes of each row are written (byte
    enables), the rest of a row's last line keeps its contents. ``wr`` is ready from
    :attr:`CHECK_LATENCY` cycles after the command's transfer. ``wr_done`` pulses in the
    cycle after the span's last line was transferred, when the memory already holds it.

    **Ordering.** The two ports are independent and may run at the same time. A read and
    a write of the same line in the same cycle return the line's *old* contents
    (read-first: the read port is not transparent). A read command transferred in or
    after the cycle ``wr_done`` pulses sees the whole written span. In-place operands
    (source = destination) are safe as long as every row is read before it is written,
    which any unit that computes a row from that row guarantees.

    **Bounds.** A span with ``line·L + (rows−1)·stride + row_bytes > vmem_bytes``, or with
    ``rows = 0``, is refused: nothing is read, written, emitted or taken, the port is idle
    again and ``error`` is set, :attr:`CHECK_LATENCY` cycles after the command's transfer
    (the controller's BAD_ADDRESS). A span with ``row_bytes = 0`` inside VMEM moves no
    lines (the writer still pulses ``wr_done``; the reader emits nothing).

    Each ``*_cmd.ready`` is high exactly while its port is idle. Clearing VMEM (soft reset)
    needs nothing extra: write one span of ``vmem_bytes`` bytes of zeros.

    Parameters
    ----------
    config : EngineConfig
        ``vmem_bytes``, ``vmem_line_bytes``.

    Members
    -------
    rd_cmd : In(stream.Signature(VmemSpan(config)))
        Spans to read.
    rd : Out(stream.Signature(VmemReadBeat(vmem_line_bytes)))
        Their lines: ``data``, ``row_last``, ``last``.
    wr_cmd : In(stream.Signature(VmemSpan(config)))
        Spans to write.
    wr : In(stream.Signature(VmemWriteBeat(vmem_line_bytes)))
        Their lines: ``data``.
    wr_done : Out(1)
        One-cycle pulse: a write span is complete.
    error : Out(1)
        Sticky: a span was refused (outside VMEM).
    clear_error : In(1)
        Clears ``error`` (a refusal in the same cycle still sets it).
    cancel : In(1)
        Drops both ports' spans (after a fault): idle from the next cycle, ``rd`` empty,
        nothing further read or written; lines already written stay written.
    peek_addr, peek_data : In(16), Out(8 · vmem_line_bytes)
        Random line reads while no span read is active: ``peek_data`` is the line at the
        ``peek_addr`` of the previous cycle (read-first, like the span reader).
    poke_en, poke_addr, poke_data : In(vmem_line_bytes), In(16), In(8 · vmem_line_bytes)
        Random line writes with a byte mask (``poke_en``), while no span write is active:
        the MATMUL write-back puts each result row where it belongs in its line.
    """

    #: cycles from a read command's transfer to its first valid ``rd`` line
    READ_LATENCY = timing.VMEM_READ_LATENCY
    #: cycles from a command's transfer to ``error`` (refused) or ``wr`` ready (accepted)
    CHECK_LATENCY = timing.VMEM_CHECK_LATENCY

    def __init__(self, config: EngineConfig):
        self.config = config
        L = config.vmem_line_bytes
        self.depth = config.vmem_bytes // L
        super().__init__(wiring.Signature({
            "rd_cmd": In(stream.Signature(VmemSpan(config))),
            "rd": Out(stream.Signature(VmemReadBeat(L))),
            "wr_cmd": In(stream.Signature(VmemSpan(config))),
            "wr": In(stream.Signature(VmemWriteBeat(L))),
            "wr_done": Out(1),
            "error": Out(1),
            "clear_error": In(1),
            "cancel": In(1),
            "peek_addr": In(16),
            "peek_data": Out(8 * L),
            "poke_en": In(L),
            "poke_addr": In(16),
            "poke_data": In(8 * L),
        }))

    def elaborate(self, platform):
        m = Module()
        L = self.config.vmem_line_bytes
        m.submodules.lines = lines = Memory(shape=unsigned(8 * L), depth=self.depth, init=[])
        rd_port = lines.read_port()                       # not transparent: read-first
        wr_port = lines.write_port(granularity=8)
        m.submodules.reader = reader = _SpanSequencer(self.config)
        m.submodules.writer = writer = _SpanSequencer(self.config)
        wiring.connect(m, wiring.flipped(self.rd_cmd), reader.cmd)
        wiring.connect(m, wiring.flipped(self.wr_cmd), writer.cmd)
        m.d.comb += [reader.cancel.eq(self.cancel), writer.cancel.eq(self.cancel)]

        # Reader: address → read port (its data register is the output) → rd.
        advance = Signal()
        mask = Signal(L)                                  # bytes of the line on rd inside its row
        m.d.comb += [
            advance.eq(~self.rd.valid | self.rd.ready),
            reader.step.eq(advance),
            # a peek reads only when no span line waits on rd (the port register holds it)
            rd_port.en.eq(advance | (~reader.active & ~self.rd.valid)),
            rd_port.addr.eq(Mux(reader.active, reader.line, self.peek_addr)[:len(rd_port.addr)]),
            self.peek_data.eq(rd_port.data),
            self.rd.p.data.eq(rd_port.data & Cat(bit.replicate(8) for bit in mask)),
        ]
        with m.If(advance):
            m.d.sync += [self.rd.valid.eq(reader.active), self.rd.p.row_last.eq(reader.row_last),
                         self.rd.p.last.eq(reader.last), mask.eq(reader.byte_mask)]
        with m.If(self.cancel):
            m.d.sync += self.rd.valid.eq(0)

        # Writer: each transferred line is written in the same cycle.
        m.d.comb += [
            self.wr.ready.eq(writer.active),
            writer.step.eq(self.wr.valid),
            wr_port.addr.eq(Mux(writer.active, writer.line, self.poke_addr)[:len(wr_port.addr)]),
            wr_port.data.eq(Mux(writer.active, self.wr.p.data, self.poke_data)),
            wr_port.en.eq(Mux(writer.active, Mux(self.wr.valid, writer.byte_mask, 0), self.poke_en)),
            self.wr_done.eq(writer.done),
        ]

        with m.If(self.clear_error):
            m.d.sync += self.error.eq(0)
        with m.If(reader.refused | writer.refused):
            m.d.sync += self.error.eq(1)
        return m


def _check_beat_bytes(name: str, n: int) -> None:
    if not (isinstance(n, int) and 1 <= n <= 256 and n & (n - 1) == 0):
        raise ValueError(f"Gearbox {name} = {n!r}: must be a power of two from 1 to 256")


class Gearbox(wiring.Component):
    """Width converter between byte streams whose widths are powers of two.

    Rows are the unit of ``last``: the source marks each row's final beat, and so does
    the output.

    * **Splitting** (``in_bytes ≥ out_bytes``): each input beat becomes
      ``in_bytes / out_bytes`` output beats, lowest bytes first, ``last`` on the final one
      if the input beat had it. A row's final line therefore always yields the full
      ratio of beats; the reader zeroes the bytes past the row's end, so the extra beats
      carry zeros. One output beat per cycle.
    * **Packing** (``in_bytes < out_bytes``): ``out_bytes / in_bytes`` input beats become one
      output beat, the first in the lowest bytes. A beat with ``last`` ends the output
      beat early: the rest of it is zero, and it carries ``last`` — so a row of ``n``
      elements that is not a multiple of the lane count still ends on its own beat and
      the next row starts a fresh one. One input beat per cycle.

    Both have an output register (the output beat is valid :attr:`LATENCY` cycle after the
    input beat that completes it) and are backpressure-safe. With equal widths the
    gearbox is one register stage.

    Parameters
    ----------
    in_bytes, out_bytes : int
        Beat widths, powers of two from 1 to 256.

    Members
    -------
    i : In(stream.Signature(ByteBeat(in_bytes)))
        Input beats.
    o : Out(stream.Signature(ByteBeat(out_bytes)))
        Output beats.
    """

    #: cycles from the transfer of the input beat that completes an output beat to the
    #: cycle that output beat is valid
    LATENCY = timing.GEARBOX_LATENCY

    def __init__(self, in_bytes: int, out_bytes: int):
        _check_beat_bytes("in_bytes", in_bytes)
        _check_beat_bytes("out_bytes", out_bytes)
        self.in_bytes, self.out_bytes = in_bytes, out_bytes
        super().__init__(wiring.Signature({
            "i": In(stream.Signature(ByteBeat(in_bytes))),
            "o": Out(stream.Signature(ByteBeat(out_bytes))),
        }))

    def elaborate(self, platform):
        m = Module()
        if self.in_bytes >= self.out_bytes:
            self._split(m, self.in_bytes // self.out_bytes)
        else:
            self._pack(m, self.out_bytes // self.in_bytes)
        return m

    def _split(self, m: Module, ratio: int):
        # The input beat is held in a register that shifts down by one output beat per
        # transfer, so the output is always its lowest bytes (no ratio-wide multiplexer).
        held = Signal(8 * self.in_bytes)
        held_last = Signal()
        final = Signal()                                  # the held beat's last piece is out
        take = Signal()
        give = Signal()
        m.d.comb += [
            self.o.p.data.eq(held[:8 * self.out_bytes]),
            self.o.p.last.eq(held_last & final),
            # a new beat may enter as the held one's final piece leaves
            self.i.ready.eq(~self.o.valid | (self.o.ready & final)),
            take.eq(self.i.valid & self.i.ready),
            give.eq(self.o.valid & self.o.ready),
        ]
        if ratio == 1:                                    # a plain register stage
            m.d.comb += final.eq(1)
        else:
            remaining = Signal(range(ratio))              # output beats after this one
            m.d.comb += final.eq(remaining == 0)
            with m.If(take):
                m.d.sync += remaining.eq(ratio - 1)
            with m.Elif(give):
                m.d.sync += remaining.eq(remaining - 1)
        with m.If(take):
            m.d.sync += [held.eq(self.i.p.data), held_last.eq(self.i.p.last), self.o.valid.eq(1)]
        with m.Elif(give):
            m.d.sync += held.eq(held >> (8 * self.out_bytes))
            with m.If(final):
                m.d.sync += self.o.valid.eq(0)

    def _pack(self, m: Module, ratio: int):
        # The output register is filled slot by slot in place. Emitting a beat clears every
        # slot not written in the same cycle, so the slots after an early ``last`` are zero.
        slots = Signal(data.ArrayLayout(unsigned(8 * self.in_bytes), ratio))
        slot = Signal(range(ratio))                       # where the next input beat goes
        accept = Signal()
        emitted = Signal()
        completes = Signal()
        m.d.comb += [
            self.o.p.data.eq(slots),
            self.i.ready.eq(~self.o.valid | self.o.ready),
            accept.eq(self.i.valid & self.i.ready),
            emitted.eq(self.o.valid & self.o.ready),
            completes.eq(self.i.p.last | (slot == ratio - 1)),
        ]
        for j in range(ratio):
            with m.If(accept & (slot == j)):
                m.d.sync += slots[j].eq(self.i.p.data)
            with m.Elif(emitted):
                m.d.sync += slots[j].eq(0)
        with m.If(emitted):
            m.d.sync += self.o.valid.eq(0)
        with m.If(accept):
            m.d.sync += slot.eq(Mux(completes, 0, slot + 1))
            with m.If(completes):
                m.d.sync += [self.o.valid.eq(1), self.o.p.last.eq(self.i.p.last)]
