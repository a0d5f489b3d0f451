"""Cycle model of the draft engine: the cycles the RTL takes, per instruction and per request.

The model is the timing contract for the RTL, and it is exact: each formula follows the
structure of one sequencer (its states, its per-row, per-head and per-beat loops, the
pipeline latencies of its units) and of the memory path (:class:`~dfvg_hw.memory_port.
MemoryPort` and the simulated memory of :mod:`sim.axi_memory`). The co-simulation tests
hold it to the RTL's per-unit ``OP_CYCLES`` counters cycle for cycle.

What a count covers is what the controller charges to a counter: ``FETCH`` + ``DECODE``
(2, :data:`ISSUE`), then every cycle until the next ``FETCH``; a unit instruction adds its
job hand-over and ``RETIRE`` (:data:`UNIT_OVERHEAD` in all). The ``"REQUEST"`` bucket is
the request's own work: the header and the token scan before the first instruction, and
after ``HALT`` the result descriptor assembled on chip and written out.

Memory symbols used below: ``L`` = ``mem_latency_cycles``, ``B`` = bytes per engine beat
(``mem_beat_bytes``: a beat of each of the ``mem_ports`` channels side by side), ``p`` =
beats per cycle each channel's memory delivers (``port_beats_per_cycle``). The channels
run in lockstep (:class:`~dfvg_hw.striped_memory_port.StripedMemoryPort`): the same
bursts, the same latency and rate on each, so the memory path is one port of ``B`` bytes
whose AXI 4 KiB pages are each channel's, i.e. logical pages of ``4096 · mem_ports``
bytes. A read command accepted in cycle ``c`` has its first beat in cycle
``c + READ_OVERHEAD + L``. Timing does not depend on data, only on
instruction fields, addresses and the KV position. All figures it produces are
*modelled*.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache
from math import ceil

from dfvg_hw.spec import numerics as nx
from dfvg_hw.spec import timing as tm
from dfvg_hw.spec.config import EngineConfig, VMEM_LINE_BYTES
from dfvg_hw.spec.descriptors import REQUEST_HEADER_WORDS, RESULT_HEADER_WORDS, record_words, watchdog_budget
from dfvg_hw.spec.image import ACT_PARAM_BYTES, ATTN_PARAM_BYTES, NORM_PARAM_BYTES, padded
from dfvg_hw.spec.isa import Instruction, MatmulMode, Op
from sim.attention_timing import attn_cycles, kvappend_cycles
from sim.timing_common import LINE, _lines, _window

__all__ = ["CycleModel", "CycleCounts", "estimate_request", "BEFORE_FINISH", "ISSUE"]

#: The latencies and fixed overheads below are the RTL's own (:mod:`dfvg_hw.spec.timing`).
ISSUE, UNIT_OVERHEAD, BEFORE_FINISH = tm.ISSUE, tm.UNIT_OVERHEAD, tm.BEFORE_FINISH
READ_OVERHEAD = tm.MEM_READ_OVERHEAD
PAGE = tm.AXI_BOUNDARY_BYTES
#: Bytes of a residual-stream element (int32): EMBED rows, RMSNORM sources, RESADD rows.
RES_BYTES = nx.RES_BITS // 8


@dataclass
class CycleCounts:
    """Cycles of one run, in total and per unit (what the engine's counters report)."""
    total: int = 0
    by_op: dict = field(default_factory=dict)
    mem_bytes: int = 0
    macs: int = 0

    def add(self, op: Op | str, cycles: int, nbytes: int = 0, macs: int = 0):
        """Count ``cycles`` for an opcode, or for the bucket ``"REQUEST"`` (the request's own
        overhead), as the engine's per-unit counters do (``regmap.OP_CYCLE_BUCKETS``)."""
        name = op if isinstance(op, str) else op.name
        self.total += cycles
        self.by_op[name] = self.by_op.get(name, 0) + cycles
        self.mem_bytes += nbytes
        self.macs += macs


# -- the memory path ---------------------------------------------------------------------------
@dataclass(frozen=True)
class _Port:
    latency: int        #: L
    bus_bytes: int      #: B
    beats_per_cycle: float  #: p
    page: int = PAGE    #: logical bytes of an AXI page: 4 KiB of each channel

    @classmethod
    def for_config(cls, config: EngineConfig) -> "_Port":
        return cls(config.mem_latency_cycles, config.mem_beat_bytes,
                   config.port_beats_per_cycle, PAGE * config.mem_ports)

    @property
    def lines_per_beat(self) -> int:
        return self.bus_bytes // LINE

    def beat_offset(self, i: int) -> int:
        """Cycles from a read's first beat to its beat ``i`` (the memory's token bucket
        full at the start, refilled ``p`` a cycle)."""
        return ceil(i / self.beats_per_cycle - 1e-9)

    def arrival(self, i: int, first: int) -> int:
        """Cycle a LineAligner takes input line ``i`` of a read whose first beat is on the
        port in cycle ``first`` (the beat-to-lines Gearbox adds a register and passes one
        line a cycle)."""
        lpb = self.lines_per_beat
        return first + tm.GEARBOX_LATENCY + max(i, self.beat_offset(i // lpb) + i % lpb)

    def emit(self, j: int, first: int, skip: int, length: int) -> int:
        """Cycle the LineAligner of an UnalignedReader emits output line ``j`` of a read of
        ``length`` bytes starting ``skip`` bytes into its first beat: it drops
        ``skip // 16`` lines, holds one, and emits when the next line arrives (or one
        cycle after the last)."""
        d = skip // LINE
        n_in = ceil((length + skip) / self.bus_bytes) * self.lines_per_beat
        if d + j + 1 < n_in:
            return self.arrival(d + j + 1, first)
        return self.arrival(n_in - 1, first) + tm.LINE_ALIGNER_LATENCY


def _bursts(addr: int, nbytes: int, bus_bytes: int, page: int = PAGE) -> list[int]:
    """Beats of each burst the memory port splits a read into (``page``: 4 KiB of each
    channel; 256 beats); a block that does not start on a beat is read from the beat it
    starts in."""
    skip = addr % bus_bytes
    addr -= skip
    beats, out = ceil((skip + nbytes) / bus_bytes), []
    while beats:
        b = min(beats, (page - addr % page) // bus_bytes, tm.AXI_MAX_BURST_BEATS)
        out.append(b)
        beats -= b
        addr += b * bus_bytes
    return out


class _TokenBucket:
    """The simulated memory's rate limit: ``p`` beats a cycle, at most one banked."""

    def __init__(self, p: float):
        self.p, self.last, self.tokens = p, -10 ** 9, 1.0

    def offer(self, t: int) -> int:
        """The first cycle ``>= t`` a beat can be offered; spends its token."""
        if self.tokens + self.p * (t - self.last) < 1:
            t = self.last + ceil((1 - self.tokens) / self.p - 1e-9)
        self.tokens = min(1.0, self.tokens + self.p * (t - self.last)) - 1
        self.last = t
        return t


# -- MATMUL ------------------------------------------------------------------------------------
NEVER = -10 ** 9     #: "long before": a time that constrains nothing


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


class _ReadPath:
    """The MATMUL sequencer's reads, one after another: :class:`~dfvg_hw.memory_port.
    MemoryPort` (command splitter, burst-track FIFO, ``read_data`` register) and the
    sequencer's :class:`~dfvg_hw.matmul_sequencer.BeatAligner`.

    The sequencer offers its next command as soon as the splitter is free: a command costs
    a cycle to accept and one per burst issued, and a burst waits while
    :data:`~dfvg_hw.spec.timing.MEM_MAX_OUTSTANDING` bursts await their last beat. Burst data is due ``L`` cycles
    after its address (one cycle after its issue) and the memory offers ``p`` beats a
    cycle; a beat enters ``read_data`` when that register is empty or being emptied.

    A read at a byte address off the bus alignment is issued from the beat it starts in
    (``skip`` bytes in) and the aligner re-cuts it: the read's first beat is held
    (taken from ``read_data`` the cycle after it arrives, whatever the consumer does),
    output beat ``i`` leaves with input beat ``i + 1``; when the read has no more input
    beats than output beats, its last output beat is flushed from the held one the cycle
    after the last input beat, and the aligner takes nothing in that cycle.
    """

    def __init__(self, port: _Port):
        self.latency, self.bus_bytes, self.page = port.latency, port.bus_bytes, port.page
        self.bucket = _TokenBucket(port.beats_per_cycle)
        self.issued = -1                #: cycle the last burst was issued (command accepted at 0)
        self.pops: list[int] = []       #: per burst: the cycle its last beat entered read_data
        self.entered = NEVER            #: the last beat's cycle into read_data
        self.left = NEVER               #: ... and out of it
        self.aligner_free = NEVER       #: first cycle the aligner takes a beat after a flush

    def read(self, addr: int, nbytes: int, consumer) -> int:
        """Issue a read of ``nbytes`` at device byte ``addr`` and stream it to
        ``consumer`` (:class:`_Accumulate` or :class:`_Words`), whose ``beat(i, t)``
        returns the cycle it takes output beat ``i`` offered from cycle ``t``. Returns the
        cycle it takes the last one."""
        skip = addr % self.bus_bytes
        n_out = ceil(nbytes / self.bus_bytes)
        j = 0                                           # input beats so far
        for i, beats in enumerate(_bursts(addr, nbytes, self.bus_bytes, self.page)):
            # accepting the command is the cycle before its first burst
            issue = self.issued + (2 if i == 0 else 1)
            if len(self.pops) >= tm.MEM_MAX_OUTSTANDING:    # the track FIFO is full
                issue = max(issue, self.pops[-tm.MEM_MAX_OUTSTANDING] + 1)
            self.issued = issue
            b = 0
            while b < beats:
                offered = self.bucket.offer(max(issue + 1 + self.latency, self.entered + 1))
                self.entered = max(offered, self.left)
                arrives = max(self.entered + 1, self.aligner_free)
                if skip and j == 0:
                    self.left = arrives                 # held by the aligner
                else:
                    self.left = taken = consumer.beat(j - (1 if skip else 0), arrives)
                b, j = b + 1, j + 1
                rest = beats - b
                if (rest and self.left == arrives == self.entered + 1
                        and self.bucket.p >= 1 and consumer.free(arrives + 1)):
                    # nothing held this beat up and nothing will hold the rest of the burst
                    # (its data is due, the memory keeps up: p = 1 leaves the bucket
                    # unused): a beat a cycle, the loop's sums in closed form
                    consumer.skip(j - (1 if skip else 0), rest, arrives + 1)
                    self.entered += rest
                    self.left = taken = arrives + rest
                    b, j = beats, j + rest
            self.pops.append(self.entered)
        if skip and j == n_out:                         # the last output beat is flushed
            taken = consumer.beat(n_out - 1, self.left + 1)
            self.aligner_free = taken + 1
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


class _LineSplitter:
    """EMBED's beat-to-line gearbox: it takes a beat when the previous beat's last line
    has left, and passes one line a cycle."""

    def __init__(self, lines_per_beat: int):
        self.split, self.taken = lines_per_beat, NEVER

    def beat(self, i: int, t: int) -> int:
        self.taken = max(t, self.taken + self.split)
        return self.taken

    def free(self, t: int) -> bool:
        """Whether beats offered one a cycle from ``t`` are taken as they come."""
        return self.split == 1 and t > self.taken

    def skip(self, i: int, count: int, t: int):
        """Beats ``i …`` taken one a cycle from ``t``."""
        self.taken = t + count - 1


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
    """

    def __init__(self, beats_per_tile: int):
        self.beats_per_tile = beats_per_tile
        self.stalls = _Stalls()
        self.tile_taken = NEVER         #: cycle the matrix unit took the latest tile

    def beat(self, i: int, t: int) -> int:
        """The packer takes beat ``i`` of a group's tiles, offered in cycle ``t``."""
        if i % self.beats_per_tile == 0:                # a new tile: the last one must be gone
            t = max(t, self.tile_taken)
        if i % self.beats_per_tile == self.beats_per_tile - 1:
            self.tile_taken = self.stalls.moves(t + 1)
        return t

    def free(self, t: int) -> bool:
        """Whether beats offered one a cycle from ``t`` are all taken as they come: the
        latest tile is taken and the pipeline does not stop from ``t`` on (a stall
        starts with a group's last tile, after its beats)."""
        return self.tile_taken <= t and self.stalls.last_end <= t

    def skip(self, i: int, count: int, t: int):
        """Beats ``i … i + count − 1`` taken in cycles ``t …`` (see :meth:`free`)."""
        last = (i + count) // self.beats_per_tile * self.beats_per_tile - 1   # last tile's end
        if last >= i:
            self.tile_taken = t + (last - i) + 1

    def zero_tile(self) -> int:
        """k = 0: the sequencer offers one zero tile per group from the stream's start."""
        self.tile_taken = self.stalls.moves(max(0, self.tile_taken + 1))
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
    (the line is already on the peek port).
    """

    def __init__(self, hold: int, residual_lines: int, line_of=None):
        self.hold, self.residual_lines, self.line_of = hold, residual_lines, line_of
        self.stalls = _Stalls()
        self.entered = NEVER            #: the latest row's cycle into the requantisers
        self.out = NEVER                #: ... and into the output register
        self.peeked = None              #: VMEM line on the peek port after the latest residual

    def group(self, g: int, bank: int, words_in: int, rows: int) -> int:
        """Write back group ``g``: bank loaded in ``bank``, requant words complete in
        ``words_in``. Returns the cycle its last row entered the requantisers."""
        for r in range(rows):
            self.entered = self.stalls.moves(max(bank + 1, words_in + 1, self.entered + 1))
            at_end = self.stalls.passes(self.entered, tm.REQUANT_LATENCY - 1)
            out = max(at_end, self.out + self.hold)
            if self.line_of is not None:                # RESADD: the residual's lines
                first = self.line_of(g, r)
                out = max(out, self.out + 1 + self.residual_lines - (first == self.peeked))
                self.peeked = first + self.residual_lines - 1
            self.stalls.add(at_end, out)
            self.out = out
        return self.entered

    def end(self) -> int:
        """STREAM's last cycle: the last row's last line written."""
        return self.out + self.hold


def _matmul_stream(port: _Port, lanes: int, reduce: int, groups: int, k_tiles: int,
                   pass_rows: int, hold: int, addr: int, q_addr: int, line_of) -> int:
    """Cycles of the MATMUL sequencer's STREAM state for one row pass (matmul_sequencer.py),
    counted from the state's first cycle (its first read command).

    Reads, per group ``g``: its tiles (``lanes·k_tiles·reduce`` bytes from ``addr``, none
    when ``k = 0``: a zero tile is offered instead) and then its requant words
    (``4·lanes`` bytes from ``q_addr``), through :class:`_ReadPath`. Tile beats go through
    :class:`_Accumulate`; the first requant beat of group ``g`` waits until group
    ``g − 1``'s words are used (its last row entered the requantisers). A group is
    written back (:class:`_WriteBack`) once its successor's last tile needs the bank.
    ``hold`` is the cycles a result row holds the output register, ``line_of(g, r)`` the
    first VMEM line of the residual of group ``g``'s row ``r`` (RESADD; otherwise None).
    """
    B = port.bus_bytes
    reads = _ReadPath(port)
    acc = _Accumulate(lanes * reduce // B)
    wb = _WriteBack(hold, max(1, RES_BYTES * lanes // LINE), line_of)
    tile_bytes, q_bytes = lanes * k_tiles * reduce, 4 * lanes
    prev, prev_done = None, NEVER                       # the group awaiting write-back
    for g in range(groups):
        if k_tiles:
            reads.read(addr + g * tile_bytes, tile_bytes, acc)
        else:
            acc.zero_tile()
        if prev is not None:
            prev_done = wb.group(g - 1, *prev, pass_rows)
        bank = acc.bank(prev_done)
        words_in = reads.read(q_addr + g * q_bytes, q_bytes, _Words(prev_done + 1))
        prev = (bank, words_in)
    wb.group(groups - 1, *prev, pass_rows)
    return wb.end() + 1


@lru_cache(maxsize=4096)
def _matmul_cycles(port: _Port, lanes: int, reduce: int, rows_per_pass: int, n: int, k: int,
                   rows: int, mode: int, wide: bool, page_offset: int, dst: int) -> int:
    """Cycles of a MATMUL from the controller's FETCH to its RETIRE (matmul_sequencer.py):
    :data:`UNIT_OVERHEAD`, RANGE and DONE, then per row pass PASS, X_CMD, the x load (none
    when ``k = 0``), CHECK, STREAM (none when ``n = 0``: CHECK goes to DONE) and NEXT_PASS.

    The x load: VMEM's read latency, then one x slice a cycle (a VMEM line cut into
    ``16 / slice`` slices, the padding slices of a row's last line included) or, for
    slices wider than a line, one line a cycle. ``page_offset`` is the weight block's
    address within its page (``port.page``), ``dst`` the destination line (RESADD only).
    """
    npad, kpad = padded(n, lanes), padded(k, reduce)
    groups, k_tiles = npad // lanes, kpad // reduce
    per_pass = rows_per_pass // 2 if wide else rows_per_pass
    slice_bytes = 2 * reduce if wide else reduce
    slices_per_row = ceil(k * (2 if wide else 1) / LINE) * max(1, LINE // slice_bytes)
    out_bytes = 1 if mode == MatmulMode.INT8 else RES_BYTES
    row_stride = padded(n * out_bytes, LINE)
    hold = 1 if mode == MatmulMode.LOGITS else max(1, lanes * out_bytes // LINE)
    total = UNIT_OVERHEAD + tm.MATMUL_STATES
    first = 0
    while first < rows:
        pass_rows = min(per_pass, rows - first)
        x_load = tm.VMEM_READ_LATENCY + pass_rows * slices_per_row if k else 0
        total += tm.MATMUL_PASS_STATES + x_load
        if not groups:                              # nothing to compute: CHECK ends the MATMUL
            break
        def line_of(g, r, first=first):         # residual row of group g, row r: first line
            return dst + ((first + r) * row_stride + g * RES_BYTES * lanes) // LINE
        total += tm.MATMUL_NEXT_PASS + _matmul_stream(port, lanes, reduce, groups, k_tiles, pass_rows, hold,
                                    page_offset, page_offset + npad * kpad,
                                    line_of if mode == MatmulMode.RESADD else None)
        first += pass_rows
    return total


# -- RMSNORM, ACTMUL, ROPE ---------------------------------------------------------------------
def _writer_tail(row_bytes: int, beats_per_row: int, lanes: int, wide: bool) -> tuple[int, int]:
    """(lines per result beat, lines of a row's last beat the RowWriter drops)."""
    beat_bytes = lanes * (2 if wide else 1)
    if beat_bytes <= LINE:
        return 1, 0
    s = beat_bytes // LINE
    return s, beats_per_row * s - ceil(row_bytes / LINE)


def _done_after(last_beat_out: int, s: int, dropped: int) -> int:
    """The DONE cycle of a row job whose last result beat leaves its unit in
    ``last_beat_out`` (RowWriteProgress: the rows count and VMEM's wr_done, registered)."""
    last_line = last_beat_out + s
    return max(last_line + 1, last_line - dropped + 2) + tm.ROW_JOB_DONE


def _writer_last_take(in0: int, in_prev: int, in_last: int, beats: int, s: int) -> int:
    """The cycle the RowWriter takes a row's last beat when it takes one every ``s``
    cycles at most."""
    if beats == 1:
        return in0
    return max(in_last, in_prev + s, in0 + (beats - 1) * s)


def _rmsnorm(port: _Port, lanes: int, n: int, rows: int, wide: bool, addr: int) -> int:
    """norm_sequencer.py: read the parameter head; per row, pass 0 over x (the row's
    shift) and pass 1 (sum of squares, then rsqrt) race the gamma read issued at the row's
    start; pass 2 streams x and gamma through the scaler.

    x is the int32 row, ``4n`` bytes cut into beats of ``4·lanes``; gamma ``2n`` bytes cut
    into beats of ``2·lanes``: below 8 lanes gamma can have beats past x's last (padding,
    emptied as the next row starts), so pass 2 ends with the gamma beat of x's last."""
    L, B = port.latency, port.bus_bytes

    def cutting(nbytes: int, beat_bytes: int):
        """(lines, beats per line or None, lines per beat or None, beats) of a row."""
        lines = ceil(nbytes / LINE)
        if beat_bytes <= LINE:                     # beats cut from lines ...
            return lines, LINE // beat_bytes, None, lines * (LINE // beat_bytes)
        pack = beat_bytes // LINE                  # ... or packed from several lines
        return lines, None, pack, ceil(lines / pack)

    ell, cut, pack, beats = cutting(RES_BYTES * n, RES_BYTES * lanes)
    g_ell, g_cut, g_pack, _ = cutting(2 * n, 2 * lanes)
    stream = max(beats, ell)                       # cycles of one pass over x
    turnaround = tm.rmsnorm_turnaround(lanes)
    first = tm.PARAM_CMD + READ_OVERHEAD + L
    skip = addr % B
    head_out = port.emit(0, first, skip, NORM_PARAM_BYTES) + tm.LINE_ALIGNER_LATENCY
    head_lines = ceil((NORM_PARAM_BYTES + skip) / B) * port.lines_per_beat
    gamma_cmd = max(head_out + tm.NORM_HEAD_TO_GAMMA,
                    port.arrival(head_lines - 1, first) + tm.LINE_ALIGNER_LATENCY)
    if n == 0:                                     # CHECK goes to DONE: nothing to read
        check = gamma_cmd - tm.NORM_HEAD_TO_GAMMA + 1
        return UNIT_OVERHEAD + check + tm.ROW_JOB_DONE
    gamma_skip = (addr + NORM_PARAM_BYTES) % B
    s, dropped = _writer_tail((2 if wide else 1) * n, beats, lanes, wide)

    g = gamma_cmd
    for _ in range(rows):
        gamma_first = g + tm.READER_CMD_REGISTER + READ_OVERHEAD + L
        last0 = g + tm.NORM_PASS_START + stream - 1            # pass 0's last beat
        pass2 = last0 + tm.NORM_PASS_START + stream            # PASS2_CMD
        u = pass2 + turnaround - 1
        gamma_line = lambda j: port.emit(j, gamma_first, gamma_skip, 2 * n) + tm.LINE_ALIGNER_LATENCY
        if g_cut is not None:                      # the gamma beat of x's last beat
            g_last = gamma_line((beats - 1) // g_cut) + 1 + (beats - 1) % g_cut
        else:
            g_last = gamma_line(g_ell - 1) + 1
        if pack is None:
            end, gap = max(u + beats - 1, gamma_line(0) + beats, g_last), 1
        else:
            g_first = (gamma_line(0) + 1 if g_pack is None
                       else gamma_line(min(g_pack, g_ell) - 1) + 1)
            tail = ell - pack if beats > 1 else 0
            end = max(pass2 + 3 + ell, g_last, max(u, g_first) + tail)
            gap = ell - pack * (beats - 1)
        g = end + 1
    last_out = end + tm.RMSNORM_LATENCY + (max(0, s - gap) if beats > 1 else 0)
    return UNIT_OVERHEAD + _done_after(last_out, s, dropped)


def _actmul_rows(a: int, rows: int, n: int, lanes: int, s: int):
    """ACTMUL's row loop from the first ROW_ALIGN in cycle ``a``: (cycle the writer takes
    the last beat, beats per row)."""
    g_lines = ceil(n / LINE)
    d = n // LINE                                  # lines the up-half aligner drops
    r = max(1, LINE // lanes)                      # cycles per (gate, up) line pair
    q = max(1, lanes // LINE)                      # lines per ActMul beat when packing
    if lanes <= LINE:
        beats, last_lines, spacing = r * g_lines, 1, 1
    else:
        beats = ceil(g_lines / q)
        last_lines, spacing = g_lines - q * (beats - 1), q
    m = beats - 1
    w_last = None
    for _ in range(rows):
        f0 = a + tm.ACTMUL_ROW_START + d
        f_last = f0 + r * (g_lines - 1)
        if lanes <= LINE:
            in0, in_prev, in_last = f0 + 1, f0 + beats - 1, f0 + beats
        else:
            in0 = f0 + min(q, g_lines)
            in_prev, in_last = f_last + 1 - last_lines, f_last + 1
        lat = tm.ACTMUL_LATENCY
        w0 = in0 + lat if w_last is None else max(in0 + lat, w_last + s)
        w_last = _writer_last_take(w0, in_prev + lat, in_last + lat, beats, s)
        last_pair = f_last
        if s > spacing:                            # the writer is the bottleneck
            stall = tm.actmul_writer_lag(lanes)
            bounds = []
            if m >= stall:
                bounds.append(w0 + (m - stall) * s)
            pack = tm.ACTMUL_PACK_LAG.get(lanes)
            if pack is not None and m >= pack:
                bounds.append(w0 + s + (m - pack) * q)
            if bounds:
                last_pair = max(last_pair, max(bounds) + last_lines - 1)
        a = last_pair + 1
    return w_last, beats


def _actmul(port: _Port, lanes: int, n: int, rows: int, wide: bool, addr: int) -> int:
    """actmul_sequencer.py: the parameter head and the SiLU table (256 entries, one a
    cycle into the unit's LUT, every instruction), then per row the gate and up halves
    read from VMEM in pairs through ActMul and the RowWriter."""
    first = tm.PARAM_CMD + READ_OVERHEAD + port.latency
    skip = addr % port.bus_bytes
    head_out = port.emit(0, first, skip, ACT_PARAM_BYTES) + tm.LINE_ALIGNER_LATENCY
    first_table_line = max(head_out, port.emit(1, first, skip, ACT_PARAM_BYTES))
    a = first_table_line + tm.ACTMUL_TABLE_START + tm.ACTMUL_LUT_DEPTH + tm.ACTMUL_TABLE_TO_ROWS
    if n == 0:                # CHECK goes to DONE in WRITE_CMD's cycle, before ROW_ALIGN's a
        return UNIT_OVERHEAD + a - 1
    beat_bytes = lanes * (2 if wide else 1)
    s = max(1, beat_bytes // LINE)
    w_last, beats = _actmul_rows(a, rows, n, lanes, s)
    _, dropped = _writer_tail((2 if wide else 1) * n, beats, lanes, wide)
    if beat_bytes <= LINE and wide:
        dropped = 2 * ceil(n / LINE) - ceil(2 * n / LINE)
    return UNIT_OVERHEAD + _done_after(w_last, s, dropped)


def _rope(port: _Port, n: int, k: int, rows: int, addr: int, pos: int) -> int:
    """rope_sequencer.py: the table row of ``POS`` (whole beats), then head by head: gather
    (lines + 3), rotate (Rope.LATENCY 3 + 2), scatter (lines + 3), next."""
    if k == 0:
        # An empty table row is done without a read (BlockReader: IDLE, then DONE at once)
        # and SPANS finds nothing to rotate, whatever n.
        return UNIT_OVERHEAD + tm.ROPE_SETUP_STATES + 1 + tm.ROPE_DONE
    row_addr = addr + pos * 2 * k
    beats = ceil((row_addr % port.bus_bytes + 2 * k) / port.bus_bytes)
    spans = (tm.ROPE_SETUP_STATES + READ_OVERHEAD + port.latency + port.beat_offset(beats - 1)
             + tm.BLOCK_READ_DONE)
    per_head = tm.ROPE_LATENCY + tm.ROPE_HEAD_STATES
    per_row = sum(_window(h * k, k) + per_head + _window(h * k, k) for h in range(n))
    return UNIT_OVERHEAD + spans + rows * per_row + tm.ROPE_DONE


# -- the model ---------------------------------------------------------------------------------
class CycleModel:
    """Cycles per instruction and per request for one :class:`EngineConfig`.

    Members
    -------
    config : EngineConfig
    port : the memory path's timing (latency, bytes per beat, beats per cycle)
    """

    def __init__(self, config: EngineConfig):
        self.config = config
        self.port = _Port.for_config(config)

    def _read(self, beats: int) -> int:
        """A read state pair (command, data) of ``beats`` beats, consumed as they come."""
        return (tm.REQUEST_READ_CMD + READ_OVERHEAD + self.port.latency
                + ceil((beats - 1) / self.port.beats_per_cycle))

    def instruction(self, ins: Instruction, *, pos: int = 0, topk: int = 1, addr: int | None = None,
                    token_from_request: bool = True) -> tuple[int, int]:
        """(cycles, device-memory bytes read) of one instruction.

        ``pos`` is the KV position, ``addr`` the resolved device address of the
        instruction's block (image base + ``addr`` + the layer offset; by default
        ``ins.addr``, i.e. an image at a 4 KiB-aligned base), ``token_from_request``
        whether EMBED's token comes from the request (read from memory) rather than from
        the sampler.
        """
        c, port = self.config, self.port
        op = ins.opcode
        addr = ins.addr if addr is None else addr
        rows = max(ins.rows, 1)
        if op == Op.MATMUL:
            npad, kpad = padded(ins.n, c.lanes), padded(ins.k, c.reduce)
            cycles = _matmul_cycles(port, c.lanes, c.reduce, c.rows, ins.n, ins.k, rows,
                                    int(ins.mode), bool(ins.wide), addr % port.page,
                                    ins.dst if ins.mode == MatmulMode.RESADD else 0)
            return cycles, npad * kpad + 4 * npad
        if op == Op.RMSNORM:
            return (_rmsnorm(port, c.lanes, ins.n, rows, bool(ins.wide), addr),
                    NORM_PARAM_BYTES + rows * 2 * ins.n)
        if op == Op.ROPE:
            return _rope(port, ins.n, ins.k, rows, addr, pos), 2 * ins.k
        if op == Op.KVAPPEND:
            return kvappend_cycles(c, ins.n, ins.k, ins.src), 0
        if op == Op.ATTN:
            return (attn_cycles(port, c, ins.n, ins.k, ins.src, ins.dst, pos, bool(ins.wide), addr),
                    ATTN_PARAM_BYTES)
        if op == Op.ACTMUL:
            return _actmul(port, c.lanes, ins.n, rows, bool(ins.wide), addr), ACT_PARAM_BYTES
        if op == Op.EMBED:
            return self._embed(ins.n, token_from_request)
        if op == Op.SAMPLE:
            return self._sample(ins.n, topk), 0
        return ISSUE, 0      # NOP, HALT, LOOP, ENDLOOP, BRANCH, NEXT

    def _embed(self, n: int, token_from_request: bool) -> tuple[int, int]:
        """controller.py EMBED_*: read the token (one beat) if it comes from the request,
        open the VMEM span, read the row and write it a line a cycle. Rows start on a
        beat (``embed_row_stride``), so the row's timing does not depend on the token (a
        page boundary inside the row splits its burst, which costs nothing: the next
        burst is issued long before its data is due)."""
        port = self.port
        row = RES_BYTES * n                         # an int32 row
        lines = ceil(row / LINE)
        token = tm.EMBED_TOKEN + (READ_OVERHEAD + port.latency if token_from_request else 0)
        if n == 0:
            # An empty row: the zero-length read is a no-op (memory_port.py) and the
            # empty span's wr_done, VMEM_CHECK_LATENCY after EMBED_CMD, ends ROW.
            data = max(1, tm.VMEM_CHECK_LATENCY + 1 - tm.EMBED_COMMANDS)
        elif port.beats_per_cycle >= 1:
            data = READ_OVERHEAD + port.latency + tm.GEARBOX_LATENCY + lines
        else:
            splitter = _LineSplitter(port.lines_per_beat)
            last_beat = _ReadPath(port).read(0, row, splitter)
            data = last_beat + tm.GEARBOX_LATENCY + (lines - 1) % port.lines_per_beat + 1
        nbytes = row + (port.bus_bytes if token_from_request else 0)
        # FETCH + DECODE, the token, EMBED_CMD, EMBED_READ, the row, RETIRE
        return ISSUE + token + tm.EMBED_COMMANDS + data + tm.RETIRE, nbytes

    def _sample(self, n: int, topk: int) -> int:
        """sample_sequencer.py + token_sampler.py: the logit buffer streams a tile a cycle into the
        lanes' top-k lists, which merge one candidate a cycle; then exp, the divider and
        the probabilities over the k winners, and the record a word a cycle into the
        result RAM."""
        c = self.config
        k = min(max(topk, 1), c.topk_max)
        k_eff = min(k, n)
        return (ISSUE + tm.SAMPLE_START + ceil(n / c.lanes) + tm.sampler_latency(c.lanes, k, k_eff)
                + record_words(c.topk_max) + tm.RETIRE)

    def request_start(self, n_in: int) -> tuple[int, int]:
        """(cycles, bytes) before the first instruction: the header and the token scan."""
        (c0, b0), (c1, b1) = self.request_header(), self.request_scan(n_in)
        return c0 + c1, b0 + b1

    def request_header(self) -> tuple[int, int]:
        """(cycles, bytes) of the header's read and check (all a request refused for a
        header field costs before its result: request_front_end.py scans no tokens)."""
        header = 4 * REQUEST_HEADER_WORDS
        return self._read(ceil(header / self.port.bus_bytes)) + tm.REQUEST_READ_DONE, header

    def request_scan(self, n_in: int) -> tuple[int, int]:
        """(cycles, bytes) of the token scan, after a header that passed its checks."""
        scan = 4 * n_in
        return self._read(ceil(scan / self.port.bus_bytes)) + tm.REQUEST_READ_DONE, scan

    def request_finish(self, n_records: int) -> tuple[int, int]:
        """(cycles, bytes) after HALT: the result header assembled a word a cycle, every
        word read from the result RAM and packed (2 cycles), sent a beat a cycle, then the
        write response. The result's own cycle count stops :data:`BEFORE_FINISH` cycles
        in; the counters take all of them."""
        words = RESULT_HEADER_WORDS + n_records * record_words(self.config.topk_max)
        per_beat = self.port.bus_bytes // 4
        cycles = (tm.RESULT_PRELUDE + RESULT_HEADER_WORDS + tm.RESULT_CMD
                  + tm.RESULT_WORD_CYCLES * words + ceil(words / per_beat) + tm.RESULT_DATA_EXIT
                  + self.port.latency + tm.RESULT_WAIT)
        return cycles, 4 * words

    @staticmethod
    def macs(ins: Instruction, *, pos: int = 0) -> int:
        """Multiply-accumulates of one instruction (matmuls and attention)."""
        if ins.opcode == Op.MATMUL:
            return max(ins.rows, 1) * ins.n * ins.k
        if ins.opcode == Op.ATTN:
            return 2 * max(ins.rows, 1) * ins.n * ins.k * (pos + 1)
        return 0


def estimate_request(config: EngineConfig, program: list[int], *, n_in: int, n_draft: int,
                     start_pos: int, topk: int = 1, image_base: int = 0) -> CycleCounts:
    """Modelled cycles of one request, walking the program's control flow without data.

    Timing does not depend on token values, so this equals the functional model's count
    for the same request shape (a test checks it).
    """
    from dfvg_hw.spec.isa import decode
    from sim.program_flow import CONTROL_OPS, ProgramFlow

    model = CycleModel(config)
    counts = CycleCounts()
    counts.add("REQUEST", *model.request_start(n_in))
    seq = ProgramFlow([0] * n_in, start_pos, n_draft)
    budget = watchdog_budget(n_in, n_draft, len(program))
    while not seq.halted and budget:
        budget -= 1
        ins = decode(program[seq.pc])
        counts.add(ins.opcode, *model.instruction(ins, pos=seq.pos, topk=topk,
                                                  addr=seq.block_address(ins, image_base),
                                                  token_from_request=not seq.token_is_drafted),
                   macs=model.macs(ins, pos=seq.pos))
        if ins.opcode in CONTROL_OPS:
            seq.control(ins)
            continue
        if ins.opcode == Op.SAMPLE:
            seq.drafted(0)
        seq.pc += 1
    if not seq.halted:
        raise ValueError("program does not halt within the watchdog budget")
    counts.add("REQUEST", *model.request_finish(seq.n_drafted))
    return counts
