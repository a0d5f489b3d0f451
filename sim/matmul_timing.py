"""Cycle model of MATMUL (matmul_sequencer.py, the matrix unit and its write-back).

Part of :mod:`sim.cycle_model`, in a file of its own so that the matrix path's timing can
change apart from the other units'. All figures are *modelled*.
"""

from __future__ import annotations

from functools import lru_cache
from math import ceil

from dfvg_hw.spec import timing as tm
from dfvg_hw.spec.image import group_tiles, padded, requant_record_bytes, scale_run_tiles, weight_area_bytes
from dfvg_hw.spec.isa import MatmulMode, output_element_bytes
from sim.timing_common import NEVER, RES_BYTES, UNIT_OVERHEAD, axi_bursts, PortTiming, ReadCredit

__all__ = ["matmul_cycles", "ReadPath"]




class _Stalls:
    """The cycles in which a pipeline that advances as one (every stage or none) stands
    still: disjoint intervals ``[start, end)``, added in time order."""

    def __init__(self):
        self.intervals: list[tuple[int, int]] = []

    @property
    def last_end(self) -> int:
        """The end of the latest stall."""
        return self.intervals[-1][1] if self.intervals else NEVER

    def add(self, start: int, end: int):
        if end > start:
            self.intervals.append((start, end))

    def moves(self, x: int) -> int:
        """The first cycle ``>= x`` in which the pipeline advances."""
        for start, end in reversed(self.intervals):
            if end <= x:
                break
            if start <= x:
                # stalls never touch: the item behind a stalled one reaches the stalled
                # register a cycle after it leaves
                return end
        return x

    def passes(self, x: int, stages: int) -> int:
        """The cycle an item that enters the pipeline's first register in cycle ``x`` (it
        is there from ``x + 1``) is in register ``stages`` (``stages`` advances later)."""
        for _ in range(stages):
            x = self.moves(x + 1)
        return x + 1


class ReadPath:
    """The MATMUL sequencer's reads, one after another, through :class:`~dfvg_hw.memory_port.
    MemoryPort` (command splitter, burst-track FIFO, ``read_data`` register); every read
    starts on a beat (a MATMUL block is beat-aligned, docs/isa.md §4).

    The sequencer offers its next command as soon as the splitter is free: a command costs
    a cycle to accept and one per burst issued, and a burst waits while
    :data:`~dfvg_hw.spec.timing.MEM_MAX_OUTSTANDING` bursts await their last beat. Burst data is due ``L`` cycles
    after its address (one cycle after its issue) and the memory offers ``p`` beats a
    cycle; a beat enters ``read_data`` when that register is empty or being emptied.
    """

    def __init__(self, port: PortTiming):
        self.latency, self.bus_bytes, self.page = port.latency, port.bus_bytes, port.page
        self.bucket = ReadCredit(port.beats_per_cycle)
        self.issued = -1                #: cycle the last burst was issued (command accepted at 0)
        self.pops: list[int] = []       #: per burst: the cycle its last beat entered read_data
        self.entered = NEVER            #: the last beat's cycle into read_data
        self.left = NEVER               #: ... and out of it

    def read(self, addr: int, nbytes: int, consumer) -> int:
        """Issue a read of ``nbytes`` at device byte ``addr`` (a multiple of the beat) and
        stream it to ``consumer`` (:class:`_Accumulate` or :class:`_Words`), whose
        ``beat(i, t)`` returns the cycle it takes beat ``i`` offered from cycle ``t``.
        Returns the cycle it takes the last one."""
        assert addr % self.bus_bytes == 0, "MATMUL reads start on a beat"
        j = 0                                           # beats so far
        for i, beats in enumerate(axi_bursts(addr, nbytes, self.bus_bytes, self.page)):
            # accepting the command is the cycle before its first burst
            issue = self.issued + (2 if i == 0 else 1)
            if len(self.pops) >= tm.MEM_MAX_OUTSTANDING:    # the track FIFO is full
                issue = max(issue, self.pops[-tm.MEM_MAX_OUTSTANDING] + 1)
            self.issued = issue
            b = 0
            while b < beats:
                due = issue + 1 + self.latency
                offered = self.bucket.offer(max(due, self.entered + 1), due, self.entered)
                self.entered = max(offered, self.left)
                arrives = self.entered + 1
                self.left = taken = consumer.beat(j, arrives)
                b, j = b + 1, j + 1
                rest = beats - b
                if (rest and self.left == arrives
                        and self.bucket.p >= 1 and consumer.free(arrives + 1)):
                    # nothing held this beat up and nothing will hold the rest of the burst
                    # (its data is due, the memory keeps up: p = 1 leaves the bucket
                    # unused): a beat a cycle, the loop's sums in closed form
                    consumer.skip(j, rest, arrives + 1)
                    self.entered += rest
                    self.left = taken = arrives + rest
                    b, j = beats, j + rest
            self.pops.append(self.entered)
        return taken


class _Words:
    """The requant-word register: a group's first word beat waits until the previous
    group's words are used (``free_from``); the others are taken as they come."""

    def __init__(self, free_from: int):
        self.free_from = free_from

    def beat(self, i: int, t: int) -> int:
        return max(t, self.free_from) if i == 0 else t

    def free(self, t: int) -> bool:
        """Whether beats offered one a cycle from ``t`` are all taken as they come."""
        return t >= self.free_from

    @staticmethod
    def skip(i: int, count: int, t: int):
        """Beats ``i …`` taken one a cycle from ``t`` (nothing to record)."""


class _Accumulate:
    """The matrix unit's accumulate side and the :class:`~dfvg_hw.matmul_sequencer.
    TilePacker` in front of it.

    The packer takes a beat a cycle and holds a complete tile until the matrix unit takes
    it (its next tile's first beat enters at that take at the earliest); the tile is
    offered the cycle after its last beat. The matrix unit takes a tile in any cycle its
    pipeline advances; a tile is :data:`~dfvg_hw.spec.timing.MATRIX_ACC_STAGES` advances from its take to the last
    stage, where a group's last tile moves its sums into the write-back bank, or, while
    the bank still holds the previous group, stops the whole pipeline until the cycle
    after that group's last row has entered the requantisers.

    With ``BLOCKS`` every ``scale_period``-th tile of a group's read, from its first, is a
    scale tile: the sequencer takes it into its multiplier register the cycle it is
    complete, whether the pipeline advances or not.

    The reads start with the row pass, ahead of the x load: while :attr:`x_ready` is set (a
    pass's first group) the matrix unit takes weight tile ``kt`` no earlier than
    ``x_ready[kt]``, once its x-buffer entry is written; k = 0's zero tiles come from the
    stream's first cycle ``start``.
    """

    def __init__(self, beats_per_tile: int, scale_period: int = 0, start: int = 0):
        self.beats_per_tile = beats_per_tile
        self.scale_period = scale_period
        self.start = start
        self.x_ready: list[int] | None = None
        self.stalls = _Stalls()
        self.tile_taken = NEVER         #: cycle the matrix unit took the latest tile

    def beat(self, i: int, t: int) -> int:
        """The packer takes beat ``i`` of a group's tiles, offered in cycle ``t``."""
        if i % self.beats_per_tile == 0:                # a new tile: the last one must be gone
            t = max(t, self.tile_taken)
        if i % self.beats_per_tile == self.beats_per_tile - 1:
            tile = i // self.beats_per_tile
            scale = self.scale_period and tile % self.scale_period == 0
            if scale:
                self.tile_taken = t + 1
            else:
                x = NEVER
                if self.x_ready is not None:
                    kt = tile - tile // self.scale_period - 1 if self.scale_period else tile
                    x = self.x_ready[kt]
                self.tile_taken = self.stalls.moves(max(t + 1, x))
        return t

    def free(self, t: int) -> bool:
        """Whether beats offered one a cycle from ``t`` are all taken as they come: the
        latest tile is taken and the pipeline does not stop from ``t`` on (a stall
        starts with a group's last tile, after its beats) or waits for its x entry."""
        return (self.tile_taken <= t and self.stalls.last_end <= t
                and (self.x_ready is None or self.x_ready[-1] <= t))

    def skip(self, i: int, count: int, t: int):
        """Beats ``i … i + count − 1`` taken in cycles ``t …`` (see :meth:`free`)."""
        last = (i + count) // self.beats_per_tile * self.beats_per_tile - 1   # last tile's end
        if last >= i:
            self.tile_taken = t + (last - i) + 1

    def zero_tile(self) -> int:
        """k = 0: the sequencer offers one zero tile per group from the stream's start."""
        self.tile_taken = self.stalls.moves(max(self.start, self.tile_taken + 1))
        return self.tile_taken

    def bank(self, prev_done: int) -> int:
        """The cycle the latest tile (a group's last) loads the write-back bank, the bank
        being free from ``prev_done + 1`` (the previous group's last row entered the
        requantisers in ``prev_done``)."""
        at_last_stage = self.stalls.passes(self.tile_taken, tm.MATRIX_ACC_STAGES - 1)
        load = max(at_last_stage, prev_done + 1)
        self.stalls.add(at_last_stage, load)
        return load


class _WriteBack:
    """The matrix unit's write-back and the sequencer's result path, row by row.

    A row enters the requantisers once the group's sums are in the bank (the cycle after
    the load), its requant words are in (the cycle after their last beat) and the row
    before it has entered; the three requantiser stages and the row's entry stand still
    while the row in the last stage waits for the output register. That register takes a
    row when the previous one has been held for ``hold`` cycles: the result row's VMEM
    lines are written one a cycle (INT8: ``max(1, N/16)``, RESADD: ``R = max(1, 4N/16)``)
    or it goes to the logit buffer (1). A RESADD row also needs its residual: its ``R``
    lines are peeked one a cycle from the cycle after the previous row's transfer and
    arrive a cycle later, one line sooner when its first line is the previous row's last
    (the line is already on the peek port). No row enters before STREAM's first cycle
    ``start`` (the requant words are shown from it), and the pass's first residual is
    peeked from it.
    """

    def __init__(self, hold: int, residual_lines: int, line_of=None, start: int = 0):
        self.hold, self.residual_lines, self.line_of = hold, residual_lines, line_of
        self.start = start              #: STREAM's first cycle: requant words shown, peeks start
        self.stalls = _Stalls()
        self.entered = NEVER            #: the latest row's cycle into the requantisers
        self.out = NEVER                #: ... and into the output register
        self.peeked = None              #: VMEM line on the peek port after the latest residual

    def group(self, g: int, bank: int, words_in: int, rows: int) -> int:
        """Write back group ``g``: bank loaded in ``bank``, requant words complete in
        ``words_in``. Returns the cycle its last row entered the requantisers."""
        for r in range(rows):
            self.entered = self.stalls.moves(max(bank + 1, words_in + 1, self.entered + 1,
                                                 self.start))
            at_end = self.stalls.passes(self.entered, tm.REQUANT_LATENCY - 1)
            out = max(at_end, self.out + self.hold)
            if self.line_of is not None:                # RESADD: the residual's lines
                first = self.line_of(g, r)
                # (the pass's first residual is peeked from the stream's first cycle)
                peek_from = max(self.out + 1, self.start)
                out = max(out, peek_from + self.residual_lines - (first == self.peeked))
                self.peeked = first + self.residual_lines - 1
            self.stalls.add(at_end, out)
            self.out = out
        return self.entered

    def end(self) -> int:
        """STREAM's last cycle: the last row's last line written."""
        return self.out + self.hold


def _matmul_stream(port: PortTiming, lanes: int, reduce: int, groups: int, k_tiles: int,
                   pass_rows: int, hold: int, addr: int, q_addr: int, line_of,
                   bias: bool = False, blocks: bool = False, start: int = 0,
                   x_ready: list[int] | None = None, head: int = 0) -> int:
    """Cycles of one row pass of the MATMUL sequencer (matmul_sequencer.py) from PASS, where
    the pass's first read command is offered, to the end of its STREAM state, which starts
    in cycle ``start`` (after the x load); ``x_ready[kt]`` is the first cycle the matrix unit
    can take a weight tile against x-buffer entry ``kt`` (None when k = 0); with ``head``
    the first read command was offered that many cycles before PASS (a prefetch).

    Reads, per group ``g``: its tiles (``lanes·k_tiles·reduce`` bytes from ``addr``, none
    when ``k = 0``: a zero tile is offered instead) and then its requant record
    (``R = 4·lanes`` bytes from ``q_addr``, ``8·lanes`` with ``bias``: the words, then the
    biases), through :class:`ReadPath`; when a beat holds the records of several groups
    (:func:`~dfvg_hw.spec.timing.matmul_records_per_beat`) only every ``batch``-th group reads, one beat of its batch's
    records, and the other groups' records are in the register from the cycle after the
    previous group's were used. Tile beats go through
    :class:`_Accumulate`; the first requant beat of group ``g`` waits until group
    ``g − 1``'s words are used (its last row entered the requantisers). A group is
    written back (:class:`_WriteBack`) once its successor's last tile needs the bank.
    ``hold`` is the cycles a result row holds the output register, ``line_of(g, r)`` the
    first VMEM line of the residual of group ``g``'s row ``r`` (RESADD; otherwise None).
    With ``blocks`` a group's read also holds its scale tiles (one before every run of
    ``reduce/2`` tiles, :func:`~dfvg_hw.spec.image.group_tiles`), a tile's beats each.
    """
    B = port.bus_bytes
    reads = ReadPath(port)
    reads.issued -= head        # a prefetched pass: its first command offered `head` cycles before PASS
    acc = _Accumulate(lanes * reduce // B, scale_run_tiles(reduce) + 1 if blocks else 0, start)
    wb = _WriteBack(hold, max(1, RES_BYTES * lanes // port.line), line_of, start)
    tile_bytes = lanes * reduce * group_tiles(k_tiles, reduce, blocks)
    q_bytes = requant_record_bytes(lanes, bias)
    batch = tm.matmul_records_per_beat(B, lanes, bias)
    prev, prev_done = None, NEVER                       # the group awaiting write-back
    for g in range(groups):
        if k_tiles:
            acc.x_ready = x_ready if g == 0 else None       # later groups find x loaded
            reads.read(addr + g * tile_bytes, tile_bytes, acc)
        else:
            acc.zero_tile()
        if prev is not None:
            prev_done = wb.group(g - 1, *prev, pass_rows)
        bank = acc.bank(prev_done)
        if g % batch == 0:
            words_in = reads.read(q_addr + g * q_bytes, q_bytes * min(batch, groups - g),
                                  _Words(prev_done + 1))
        else:                   # in the register since group g - 1's words were used
            words_in = prev_done
        prev = (bank, words_in)
    wb.group(groups - 1, *prev, pass_rows)
    return wb.end() + 1


def _slice_cycle(kt: int, slice_bytes: int, line: int, row_lines: int) -> int:
    """Cycles from a source row's first x slice to its slice ``kt`` in the x buffer: one
    slice a cycle when a line holds several, else the slice's last line (one a cycle)."""
    if slice_bytes <= line:
        return kt
    return min((kt + 1) * (slice_bytes // line), row_lines) - 1


@lru_cache(maxsize=4096)
def matmul_cycles(port: PortTiming, lanes: int, reduce: int, rows_per_pass: int, n: int, k: int,
                   rows: int, mode: int, wide: bool, page_offset: int, dst: int,
                   pitch: int = 0, bias: bool = False, blocks: bool = False, head: int = 0,
                   out16: bool = False) -> int:
    """Cycles of a MATMUL from the controller's FETCH to its RETIRE (matmul_sequencer.py):
    :data:`UNIT_OVERHEAD`, RANGE and DONE, then per row pass PASS, X_CMD, the x load (none
    when ``k = 0``), CHECK, STREAM (none when ``n = 0``: CHECK goes to DONE) and NEXT_PASS.
    The pass's weight and requant reads start with PASS and run during the x load; the first
    group's tile ``kt`` enters the matrix unit once the pass's last row has written x slice
    ``kt`` (:data:`~dfvg_hw.spec.timing.MATMUL_X_TO_TILE` later), beats that come earlier
    waiting in the packer and the memory port; requant words, residuals and
    results wait for STREAM.

    The x load: VMEM's read latency, then one x slice a cycle (a VMEM line cut into
    ``line / slice`` slices, the padding slices of a row's last line included) or, for
    slices wider than a line, one line a cycle. ``page_offset`` is the weight block's
    address within its page (``port.page``), ``dst`` the destination line (RESADD only),
    ``bias`` the ``BIAS`` flag (each group's requant record ``8·lanes`` bytes instead of
    ``4·lanes``; the bias itself costs no cycle in the matrix unit). INT32 writes its
    int32 rows as RESADD does, without the residual reads. ``blocks`` (``BLOCKS``) adds
    the scale tiles to each group's read (a tile's beats each; the multiply itself costs
    no cycle, it is the accumulate stage's).

    ``pitch`` (bytes; 0: each operand's own stride) places row ``r`` of the source and the
    destination ``r·pitch`` bytes after row 0 when ``rows ≥ 2`` (a tree forward, isa.md
    §9.2). Where that is not the source rows' own stride they are not one run of lines, so
    each row is loaded as a span of its own: X_CMD again and VMEM's read latency per row
    after the pass's first (:data:`~dfvg_hw.spec.timing.MATMUL_ROW_SPAN`).

    ``head`` is a prefetched MATMUL's head start (controller.py, the MATMUL prefetch): its
    first pass's first read command was offered ``head`` cycles before its PASS, during
    the unit instruction before it, whose cycles these are not; the pass's beats wait for
    their x as ever (:meth:`~sim.cycle_model.CycleModel.prefetch_head`).

    ``out16`` (``OUT16``): an INT8 MATMUL writes int16, ``2·lanes`` bytes a group row.
    """
    line = port.line                                # the VMEM line
    npad, kpad = padded(n, lanes), padded(k, reduce)
    groups, k_tiles = npad // lanes, kpad // reduce
    per_pass = rows_per_pass // 2 if wide else rows_per_pass
    slice_bytes = 2 * reduce if wide else reduce
    in_bytes = k * (2 if wide else 1)
    row_lines = ceil(in_bytes / line)
    slices_per_row = row_lines * max(1, line // slice_bytes)
    out_bytes = output_element_bytes(mode, out16)
    pitched = pitch and rows > 1
    row_stride = pitch if pitched else padded(n * out_bytes, line)
    row_spans = pitched and pitch != padded(in_bytes, line)
    hold = 1 if mode == MatmulMode.LOGITS else max(1, lanes * out_bytes // line)
    total = UNIT_OVERHEAD + tm.MATMUL_STATES
    first = 0
    while first < rows:
        pass_rows = min(per_pass, rows - first)
        x_load = tm.VMEM_READ_LATENCY + pass_rows * slices_per_row if k else 0
        if k and row_spans:
            x_load += (pass_rows - 1) * tm.MATMUL_ROW_SPAN
        # the weight reads start with PASS; the stream with the cycle after CHECK
        start = tm.MATMUL_PASS_STATES + x_load
        x_ready = None
        if k:       # each x entry: its slice of the pass's last row, then MATMUL_X_TO_TILE
            last_row = (pass_rows - 1) * (slices_per_row
                                          + (tm.MATMUL_ROW_SPAN if row_spans else 0))
            x_from = tm.MATMUL_X_LOAD_FROM + last_row + tm.MATMUL_X_TO_TILE
            x_ready = [x_from + _slice_cycle(kt, slice_bytes, line, row_lines)
                       for kt in range(k_tiles)]
        if not groups:                              # nothing to compute: CHECK ends the MATMUL
            total += start
            break
        def line_of(g, r, first=first):         # residual row of group g, row r: first line
            return dst + ((first + r) * row_stride + g * RES_BYTES * lanes) // line
        total += tm.MATMUL_NEXT_PASS + _matmul_stream(port, lanes, reduce, groups, k_tiles, pass_rows, hold,
                                    page_offset, page_offset + weight_area_bytes(n, k, lanes, reduce, blocks),
                                    line_of if mode == MatmulMode.RESADD else None, bias, blocks,
                                    start, x_ready, head if first == 0 else 0)
        first += pass_rows
    return total
