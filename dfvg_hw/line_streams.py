"""Line-stream building blocks shared by the unit-instruction sequencers (RMSNORM, ACTMUL).

The sequencers move operands as streams of VMEM lines (:class:`ByteBeat` of
``L = vmem_line_bytes`` bytes, ``last`` on a stream's final line). Three things they all
need sit here, so each exists once:

* :class:`LineAligner` — the lines of a byte stream that starts ``skip`` bytes into
  another line stream: a parameter block at an address that is not bus-aligned, or the
  ``up`` half of an ACTMUL row, which starts ``n`` bytes into the row.
* :class:`UnalignedReader` — device-memory reads from *any* byte address: the memory
  port accepts bus-aligned addresses only (the image aligns blocks to 16 bytes, a
  256-bit bus needs 32, and RMSNORM's gamma sits at ``addr + 40``), so the reader asks
  for the enclosing aligned range and drops the leading bytes.
* :class:`RowWriter` — a unit's result beats (``lanes`` int16 values, ``last`` per row)
  as the exact lines VMEM's span writer counts: int8 or int16 bytes, packed into lines,
  and lines past the row's ``ceil(row_bytes / L)`` dropped (vmem.py: the writer counts
  lines, and a split of wide beats overshoots a partial row).

:class:`~dfvg_hw.operand_access.BlockReader` fetches a small block into a register;
:class:`UnalignedReader` streams blocks of any length (a 512-byte table, ``2n`` bytes of
gamma) a line per cycle.
"""

from __future__ import annotations

from amaranth import Cat, Const, Module, Mux, Signal, signed, unsigned
from amaranth.lib import data, stream, wiring
from amaranth.lib.wiring import In, Out
from amaranth.utils import exact_log2

from dfvg_hw.spec.config import EngineConfig
from dfvg_hw.memory_port import MemoryCommand, ReadBeat
from dfvg_hw.vmem import ByteBeat, Gearbox, VmemWriteBeat

__all__ = ["lines_of", "LineAlignSetup", "LineAligner", "ReadRequest",
           "UnalignedReader", "UnitRowBeat", "RowWriter", "read_request", "span_request",
           "RowWriteProgress"]

#: widest skip a LineAligner takes: a 16-bit element count (ACTMUL's up half starts n bytes in)
SKIP_BITS = 16
#: widest line count: a row of 2·65535 bytes is 8192 lines of 16 bytes
LINE_COUNT_BITS = 16


def lines_of(nbytes, line_bytes: int):
    """``ceil(nbytes / line_bytes)``: the VMEM lines a row of ``nbytes`` bytes occupies
    (an expression; ``line_bytes`` a power of two)."""
    return (nbytes + line_bytes - 1) >> exact_log2(line_bytes)



class LineAlignSetup(data.StructLayout):
    """What :class:`LineAligner` makes of its next input stream: drop the first ``skip``
    bytes, then emit ``lines`` lines."""

    def __init__(self):
        super().__init__({"skip": unsigned(SKIP_BITS), "lines": unsigned(LINE_COUNT_BITS)})


class LineAligner(wiring.Component):
    """Re-cuts a line stream so that it starts ``skip`` bytes in.

    For each ``setup`` the aligner consumes one input stream up to and including its line
    with ``last``, and emits exactly ``setup.lines`` lines: output line ``j`` is bytes
    ``[skip + Lj, skip + Lj + L)`` of the input stream, zero past the input's end;
    ``last`` on the final one. Input lines after those it needs are consumed and dropped,
    so the input may be longer than the output (a memory read split from a wider bus).

    Each output line is the held previous input line and the current one through a
    byte shifter, so a line moves per cycle; the final line(s) are flushed with zeros
    after the input's ``last``. ``setup`` is ready when the previous input stream is fully
    consumed (its last output line may still wait on ``o``). ``lines ≥ 1``.

    Parameters
    ----------
    line_bytes : int
        ``L``, bytes of a line (a power of two, at least 16).

    Members
    -------
    setup : In(stream.Signature(LineAlignSetup()))
        The next stream's ``skip`` and output line count.
    i : In(stream.Signature(ByteBeat(line_bytes)))
        Input lines, ``last`` on the stream's final one.
    o : Out(stream.Signature(ByteBeat(line_bytes)))
        Aligned lines, ``last`` on the final one.
    """

    def __init__(self, line_bytes: int):
        self.line_bytes = L = line_bytes
        super().__init__(wiring.Signature({
            "setup": In(stream.Signature(LineAlignSetup())),
            "i": In(stream.Signature(ByteBeat(L))),
            "o": Out(stream.Signature(ByteBeat(L))),
        }))

    def elaborate(self, platform):
        m = Module()
        L = self.line_bytes
        offset_bits = exact_log2(L)
        drop_lines = Signal(SKIP_BITS - offset_bits)  # whole input lines before the first byte
        shift = Signal(offset_bits)                   # byte offset of the first byte in its line
        lines_left = Signal(LINE_COUNT_BITS)
        input_done = Signal(init=1)                 # the input's last line is consumed
        held = Signal(8 * L)
        have_held = Signal()
        take = Signal()
        emit = Signal()

        # the input's next line (zeros once the input has ended) behind the held one
        window = Cat(held, Mux(input_done, 0, self.i.p.data.as_value()))
        aligned = (window >> Cat(Const(0, 3), shift))[:8 * L]
        can_emit = ~self.o.valid | self.o.ready
        m.d.comb += [
            self.setup.ready.eq((lines_left == 0) & input_done),
            take.eq(self.i.valid & self.i.ready),
        ]

        with m.If(self.o.valid & self.o.ready):
            m.d.sync += self.o.valid.eq(0)
        with m.If(take):
            m.d.sync += input_done.eq(self.i.p.last)

        with m.If(self.setup.valid & self.setup.ready):
            m.d.sync += [drop_lines.eq(self.setup.p.skip >> offset_bits),
                         shift.eq(self.setup.p.skip[:offset_bits]),
                         lines_left.eq(self.setup.p.lines), input_done.eq(0), held.eq(0),
                         have_held.eq(0)]
        with m.Elif((drop_lines != 0) & ~input_done):
            m.d.comb += self.i.ready.eq(1)
            with m.If(take):
                m.d.sync += drop_lines.eq(drop_lines - 1)
        with m.Elif(lines_left == 0):               # everything emitted: drain the rest
            m.d.comb += self.i.ready.eq(~input_done)
        with m.Elif(input_done):                    # flush: the held line and zeros
            m.d.comb += emit.eq(can_emit)
            with m.If(emit):
                m.d.sync += held.eq(0)
        with m.Elif(~have_held):
            m.d.comb += self.i.ready.eq(1)
            with m.If(take):
                m.d.sync += [held.eq(self.i.p.data), have_held.eq(1)]
        with m.Else():
            m.d.comb += [self.i.ready.eq(can_emit), emit.eq(take)]
            with m.If(take):
                m.d.sync += held.eq(self.i.p.data)

        with m.If(emit):
            m.d.sync += [self.o.valid.eq(1), self.o.p.data.eq(aligned),
                         self.o.p.last.eq(lines_left == 1), lines_left.eq(lines_left - 1)]
        return m


class ReadRequest(data.StructLayout):
    """``length`` (≥ 1) bytes of device memory from byte address ``addr`` (any alignment),
    delivered as ``lines`` VMEM lines (fewer than ``ceil(length/L)`` drops the rest;
    more pads with zeros)."""

    def __init__(self, config: EngineConfig):
        super().__init__({"addr": unsigned(64), "length": range(config.mem_bytes + 1),
                          "lines": unsigned(LINE_COUNT_BITS)})


class UnalignedReader(wiring.Component):
    """Device-memory reads from any byte address, as VMEM lines (``vmem_line_bytes``).

    A request becomes one memory-port command for the enclosing bus-aligned range —
    ``addr − addr mod B`` for ``length + addr mod B`` bytes, ``B = data_width/8`` — which
    ends exactly where the request does, so the port's range check (``BAD_ADDRESS``)
    refuses what the functional model's ``_dram`` refuses. Its beats are split into lines
    (:class:`~dfvg_hw.vmem.Gearbox`) and re-cut by a :class:`LineAligner` that drops the
    ``addr mod B`` leading bytes. Bytes past ``length`` are zero (the port zeroes the
    final beat's tail). One request at a time: ``cmd`` is ready once the previous
    request's beats are all consumed.

    Parameters
    ----------
    config : EngineConfig
        ``mem_bytes`` (the length field), ``vmem_line_bytes``.
    data_width : int
        Memory bus width in bits, at least a line (a bus beat holds whole lines).
    line_bytes : int or None
        Bytes of the lines it delivers: ``vmem_line_bytes`` by default; a parameter block
        laid out in 16-byte words (ACTMUL's table) asks for 16.

    Members
    -------
    cmd : In(stream.Signature(ReadRequest(config)))
        Requests.
    read_cmd : Out(stream.Signature(MemoryCommand(config)))
    read_data : In(stream.Signature(ReadBeat(data_width)))
        The memory port's read side.
    o : Out(stream.Signature(ByteBeat(line_bytes)))
        Each request's lines, ``last`` on its final one.
    """

    def __init__(self, config: EngineConfig, data_width: int, line_bytes: int | None = None):
        self.line_bytes = L = config.vmem_line_bytes if line_bytes is None else line_bytes
        if data_width < 8 * L:
            raise ValueError(f"UnalignedReader needs a bus of at least {8 * L} bits, got {data_width}")
        self.config, self.data_width = config, data_width
        super().__init__(wiring.Signature({
            "cmd": In(stream.Signature(ReadRequest(config))),
            "read_cmd": Out(stream.Signature(MemoryCommand(config))),
            "read_data": In(stream.Signature(ReadBeat(data_width))),
            "o": Out(stream.Signature(ByteBeat(L))),
        }))

    def elaborate(self, platform):
        m = Module()
        beat_bytes = self.data_width // 8
        L = self.line_bytes
        to_lines = m.submodules.to_lines = Gearbox(beat_bytes, L)
        aligner = m.submodules.aligner = LineAligner(L)
        skip = self.cmd.p.addr[:(beat_bytes - 1).bit_length()]
        # the command is held until the port takes it; the aligner is set up at once, as
        # it cannot see data before the command is out
        m.d.comb += self.cmd.ready.eq(~self.read_cmd.valid & aligner.setup.ready)
        with m.If(self.cmd.valid & self.cmd.ready):
            m.d.sync += [self.read_cmd.valid.eq(1), self.read_cmd.p.addr.eq(self.cmd.p.addr - skip),
                         self.read_cmd.p.length.eq(self.cmd.p.length + skip)]
        with m.Elif(self.read_cmd.ready):
            m.d.sync += self.read_cmd.valid.eq(0)
        m.d.comb += [
            aligner.setup.valid.eq(self.cmd.valid & self.cmd.ready),
            aligner.setup.p.skip.eq(skip),
            aligner.setup.p.lines.eq(self.cmd.p.lines),
            to_lines.i.valid.eq(self.read_data.valid),
            to_lines.i.p.data.eq(self.read_data.p.data),
            to_lines.i.p.last.eq(self.read_data.p.last),
            self.read_data.ready.eq(to_lines.i.ready),
        ]
        wiring.connect(m, to_lines.o, aligner.i)
        wiring.connect(m, aligner.o, wiring.flipped(self.o))
        return m


class UnitRowBeat(data.StructLayout):
    """A unit's result beat: ``lanes`` values (int8 results sign-extended), ``last`` on a
    row's final beat."""

    def __init__(self, lanes: int):
        super().__init__({"y": data.ArrayLayout(signed(16), lanes), "last": unsigned(1)})


class RowWriter(wiring.Component):
    """Result beats to the lines VMEM's span writer takes.

    Each beat's values become bytes — the low byte of each (int8 rows) or both (``wide``,
    int16 rows) — and are packed into VMEM lines by a :class:`~dfvg_hw.vmem.Gearbox`
    per width, rows kept apart by ``last``. Of each row only its first ``row_lines``
    lines (``ceil(row_bytes/L)``) go on: the rest hold only lanes past ``n``, and the
    writer counts lines. One line per cycle.

    Parameters
    ----------
    config : EngineConfig
        ``lanes``, ``vmem_line_bytes``.

    Members
    -------
    i : In(stream.Signature(UnitRowBeat(lanes)))
        Result beats.
    wide : In(1)
        int16 results (stable while a job's beats flow).
    row_lines : In(16)
        Lines each output row occupies (stable likewise).
    o : Out(stream.Signature(VmemWriteBeat(vmem_line_bytes)))
        Lines for ``VectorMemory.wr``.
    row_done : Out(1)
        One-cycle pulse: a row's final line has left (written or dropped). A job is over
        when all its rows are done *and* VMEM's ``wr_done`` has come: the writer's
        ``wr_done`` alone can come while dropped lines of the last row still wait here,
        and they would be taken for the next job's lines.
    """

    def __init__(self, config: EngineConfig):
        self.lanes, self.line_bytes = config.lanes, config.vmem_line_bytes
        super().__init__(wiring.Signature({
            "i": In(stream.Signature(UnitRowBeat(self.lanes))),
            "wide": In(1),
            "row_lines": In(LINE_COUNT_BITS),
            "o": Out(stream.Signature(VmemWriteBeat(self.line_bytes))),
            "row_done": Out(1),
        }))

    def elaborate(self, platform):
        m = Module()
        lanes, L = self.lanes, self.line_bytes
        pack8 = m.submodules.pack_int8 = Gearbox(lanes, L)
        pack16 = m.submodules.pack_int16 = Gearbox(2 * lanes, L)
        y = self.i.p.y
        m.d.comb += [
            pack8.i.p.data.eq(Cat(*(y[j][:8] for j in range(lanes)))),
            pack16.i.p.data.eq(Cat(*(y[j] for j in range(lanes)))),
            pack8.i.p.last.eq(self.i.p.last), pack16.i.p.last.eq(self.i.p.last),
            pack8.i.valid.eq(self.i.valid & ~self.wide), pack16.i.valid.eq(self.i.valid & self.wide),
            self.i.ready.eq(Mux(self.wide, pack16.i.ready, pack8.i.ready)),
        ]
        line_valid = Mux(self.wide, pack16.o.valid, pack8.o.valid)
        line_last = Mux(self.wide, pack16.o.p.last, pack8.o.p.last)
        line_taken = Signal()
        sent = Signal(LINE_COUNT_BITS)              # lines of the current row so far
        keep = sent < self.row_lines
        m.d.comb += [
            self.o.valid.eq(line_valid & keep),
            self.o.p.data.eq(Mux(self.wide, pack16.o.p.data, pack8.o.p.data)),
            line_taken.eq(line_valid & (self.o.ready | ~keep)),
            pack8.o.ready.eq(~self.wide & (self.o.ready | ~keep)),
            pack16.o.ready.eq(self.wide & (self.o.ready | ~keep)),
            self.row_done.eq(line_taken & line_last),
        ]
        with m.If(line_taken):
            m.d.sync += sent.eq(Mux(line_last, 0, sent + 1))
        return m


def read_request(reader: UnalignedReader, addr, length, lines):
    """Comb statements that ask ``reader`` for ``length`` bytes at ``addr``, as ``lines``
    lines (see :class:`ReadRequest`); the caller moves on when ``reader.cmd.ready`` is
    high."""
    return [reader.cmd.valid.eq(1), reader.cmd.p.addr.eq(addr), reader.cmd.p.length.eq(length),
            reader.cmd.p.lines.eq(lines)]


def span_request(port, line, rows, row_bytes):
    """Comb statements that offer one VMEM span on a span-command ``port``.

    Parameters
    ----------
    port : stream interface of :class:`~dfvg_hw.vmem.VmemSpan`
        VMEM's ``rd_cmd`` or ``wr_cmd`` as the sequencer sees it.
    line, rows, row_bytes : Value
        The span: ``rows`` rows of ``row_bytes`` bytes from VMEM line ``line``.

    Returns
    -------
    list of Assign
        For ``m.d.comb``; the caller moves on when ``port.ready`` is high.
    """
    return [port.valid.eq(1), port.p.line.eq(line), port.p.rows.eq(rows),
            port.p.row_bytes.eq(row_bytes)]


class RowWriteProgress:
    """A :class:`RowWriter` wired to VMEM's span writer, and the count that tells when a
    job's rows have all reached VMEM.

    Not a component: it adds its logic to the sequencer's module ``m``, so the writer
    stays the sequencer's own submodule. Create it before the sequencer's FSM, so that
    :meth:`restart` (issued from the FSM) wins over the counting in the same cycle.

    Parameters
    ----------
    m : Module
        The sequencer's module.
    writer : RowWriter
        The sequencer's result writer.
    vmem_wr : stream interface of :class:`~dfvg_hw.vmem.VmemWriteBeat`
        VMEM's ``wr`` as the sequencer sees it.
    vmem_wr_done : Value
        VMEM's ``wr_done``: the job's write span has taken its last line.
    wide : Value
        int16 results (stable while a job runs).
    row_bytes : Value
        Bytes of each output row (stable likewise).

    Attributes
    ----------
    rows_written : Signal(8)
        Rows that have left the writer (written or their surplus lines dropped).
    writes_done : Signal(1)
        ``vmem_wr_done`` has come for this job's span.
    """

    def __init__(self, m, writer: RowWriter, vmem_wr, vmem_wr_done, *, wide, row_bytes):
        self.rows_written = Signal(8, name="rows_written")
        self.writes_done = Signal(name="writes_done")
        m.d.comb += [
            writer.wide.eq(wide), writer.row_lines.eq(lines_of(row_bytes, writer.line_bytes)),
            vmem_wr.valid.eq(writer.o.valid), vmem_wr.p.eq(writer.o.p),
            writer.o.ready.eq(vmem_wr.ready),
        ]
        with m.If(vmem_wr_done):
            m.d.sync += self.writes_done.eq(1)
        with m.If(writer.row_done):
            m.d.sync += self.rows_written.eq(self.rows_written + 1)

    def restart(self):
        """Sync statements that start counting a new job."""
        return [self.writes_done.eq(0), self.rows_written.eq(0)]

    def finished(self, rows):
        """Whether all ``rows`` rows have left the writer *and* VMEM has confirmed the span
        (see :class:`RowWriter`: either alone can come first)."""
        return self.writes_done & (self.rows_written == rows)

    def end_row(self, m, row, rows, next_row_state: str):
        """In the FSM state where a source row's last input is taken: count ``row`` on, and
        go to ``next_row_state`` for the next row or to ``FINISH`` after the last one."""
        m.d.sync += row.eq(row + 1)
        with m.If(row + 1 == rows):
            m.next = "FINISH"
        with m.Else():
            m.next = next_row_state

    def add_finish_states(self, m, rows, done):
        """Add the FSM's last two states: ``FINISH`` waits until the ``rows`` rows have
        reached VMEM (the sequencer's inputs are drained well before its writes), then
        ``DONE`` pulses ``done`` for a cycle and returns to ``IDLE``."""
        with m.State("FINISH"):
            with m.If(self.finished(rows)):
                m.next = "DONE"
        with m.State("DONE"):
            m.d.comb += done.eq(1)
            m.next = "IDLE"
