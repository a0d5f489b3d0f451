"""Cycle model of RMSNORM, ACTMUL and ROPE (norm_sequencer.py, actmul_sequencer.py,
rope_sequencer.py and their row writers).

Their reads go through the controller's narrow path (``port`` is
:meth:`~sim.timing_common.PortTiming.for_units` in the engine): each read takes the timing
of its own address (:meth:`~sim.timing_common.PortTiming.at`).

Part of :mod:`sim.cycle_model`, in a file of its own so that these units' timing can
change apart from the others'. All figures are *modelled*.
"""

from __future__ import annotations

from math import ceil

from dfvg_hw.spec import timing as tm
from dfvg_hw.spec.image import ACT_PARAM_BYTES, NORM_PARAM_BYTES
from sim.head_stream_timing import streamed_heads
from sim.timing_common import NEVER, READ_OVERHEAD, RES_BYTES, UNIT_OVERHEAD, PortTiming, ReadCredit

__all__ = ["rmsnorm_cycles", "rmsnorm_gamma_reads", "rmsnorm_gamma_taken", "actmul_cycles",
           "rope_cycles"]


def _writer_tail(row_bytes: int, beats_per_row: int, lanes: int, wide: bool,
                 line: int) -> tuple[int, int]:
    """(lines per result beat, lines of a row's last beat the RowWriter drops), lines of
    ``line`` bytes."""
    beat_bytes = lanes * (2 if wide else 1)
    if beat_bytes <= line:
        return 1, 0
    s = beat_bytes // line
    return s, beats_per_row * s - ceil(row_bytes / line)


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


def _cutting(nbytes: int, beat_bytes: int, line: int):
    """(lines, beats per line or None, lines per beat or None, beats) of a row of
    ``nbytes`` bytes in lines of ``line`` bytes cut into (or packed into) beats of
    ``beat_bytes``."""
    lines = ceil(nbytes / line)
    if beat_bytes <= line:                         # beats cut from lines ...
        return lines, line // beat_bytes, None, lines * (line // beat_bytes)
    pack = beat_bytes // line                      # ... or packed from several lines
    return lines, None, pack, ceil(lines / pack)


def _norm_gamma_kept(lanes: int, n: int, line: int) -> bool:
    """Whether an RMSNORM's rows of ``n`` fit the row buffer and their gamma beats the
    gamma buffer: the job reads gamma once, in its first row."""
    beats = _cutting(RES_BYTES * n, RES_BYTES * lanes, line)[3]
    return beats <= min(tm.norm_row_buffer_beats(lanes), tm.norm_gamma_buffer_beats(lanes))


def rmsnorm_gamma_reads(lanes: int, n: int, rows: int, line: int) -> int:
    """The gamma reads of an RMSNORM of ``rows`` rows (segments) of ``n`` (VMEM lines of
    ``line`` bytes): one when the gamma buffer keeps it, else one per row."""
    return 1 if _norm_gamma_kept(lanes, n, line) else rows


def rmsnorm_cycles(port: PortTiming, lanes: int, n: int, rows: int, wide: bool, addr: int) -> int:
    """Cycles of an RMSNORM job (:func:`_rmsnorm`)."""
    return _rmsnorm(port, lanes, n, rows, wide, addr)[0]


def rmsnorm_gamma_taken(port: PortTiming, lanes: int, n: int, wide: bool, addr: int) -> int | None:
    """The cycle (from the job's hand-over) the gamma Gearbox takes the last gamma line of a
    one-row RMSNORM whose row fits the row buffer and whose gamma beats are whole lines
    or packed from them (``2·lanes ≥ line``); None for any other job."""
    return _rmsnorm(port, lanes, n, 1, wide, addr)[1]


def _rmsnorm(port: PortTiming, lanes: int, n: int, rows: int, wide: bool, addr: int):
    """(cycles, :func:`rmsnorm_gamma_taken`) of norm_sequencer.py, a job that completes (an early start): the head read, row 0's
    pass 0 and its gamma read start together, row 0's pass 1 waits for the head's line
    (``tm.NORM_HEAD_CHECK``); per row, pass 0 over x (the row's shift) and pass 1 (sum
    of squares, then rsqrt) race the gamma read, requested at the row's start and issued
    once gamma's reader has emptied its previous read; pass 2 streams x and gamma through the scaler. A row of at most
    ``tm.norm_row_buffer_beats(lanes)`` x beats is read from VMEM once: passes 1 and 2
    replay the row buffer a beat a cycle (:func:`_norm_replay_pass2`). When its gamma
    beats also fit the gamma buffer (``tm.norm_gamma_buffer_beats``), only the first row
    reads gamma; the later rows (an RMSNORM's segments are rows) replay it in pass 2, a
    beat every ``tm.norm_gamma_replay_pace(lanes)`` cycles.

    x is the int32 row, ``4n`` bytes cut into beats of ``4·lanes``; gamma ``2n`` bytes cut
    into beats of ``2·lanes``: below 8 lanes gamma can have beats past x's last (padding,
    emptied as the next row starts), so pass 2 ends with the gamma beat of x's last.

    On a port slower than a line a cycle a replayed pass 2 catches up with the gamma read,
    which then comes at the port's rate from where it was held back (:class:`_GammaLines`):
    the reader holds only a few lines, so a long row's gamma cannot run ahead during
    passes 0 and 1."""
    L, B, line = port.latency, port.bus_bytes, port.line
    head_port, gamma_port = port.at(addr), port.at(addr + NORM_PARAM_BYTES)

    ell, cut, pack, beats = _cutting(RES_BYTES * n, RES_BYTES * lanes, line)
    g_ell, g_cut, g_pack, _ = _cutting(2 * n, 2 * lanes, line)
    stream = max(beats, ell)                       # cycles of one pass over x
    turnaround = tm.rmsnorm_turnaround(lanes)
    first = tm.PARAM_CMD + READ_OVERHEAD + L
    skip = addr % B
    head_out = head_port.emit(0, first, skip, NORM_PARAM_BYTES) + tm.LINE_ALIGNER_LATENCY
    head_lines = ceil((NORM_PARAM_BYTES + skip) / B) * port.lines_per_beat
    gamma_cmd = max(head_out + tm.NORM_HEAD_TO_GAMMA,
                    head_port.arrival(head_lines - 1, first) + tm.LINE_ALIGNER_LATENCY)
    if n == 0:                                     # CHECK goes to DONE: nothing to read
        check = gamma_cmd - tm.NORM_HEAD_TO_GAMMA + 1
        return UNIT_OVERHEAD + check + tm.ROW_JOB_DONE, None
    gamma_skip = (addr + NORM_PARAM_BYTES) % B
    s, dropped = _writer_tail((2 if wide else 1) * n, beats, lanes, wide, line)

    buffered = beats <= tm.norm_row_buffer_beats(lanes)
    # the first row's gamma beats stay in the gamma buffer when they fit it: the later rows
    # read no gamma, their pass 2 replays it a beat every `pace` cycles
    kept = _norm_gamma_kept(lanes, n, line)
    pace = tm.norm_gamma_replay_pace(lanes, line)
    # row 0's PASS0_CMD follows HEAD_CMD (an early start: the head is read meanwhile, and
    # checked before pass 1); a row's gamma read is issued once gamma's reader has emptied
    # the last row's gamma, meanwhile
    g = tm.NORM_EARLY_PASS0 - 1                                # the cycle before PASS0_CMD
    # the head's check: row 0's pass 1 (a replayed beat taken, or PASS1_CMD) comes no
    # earlier than NORM_HEAD_CHECK cycles after the head's line
    checked = head_out + tm.NORM_HEAD_CHECK
    reader_free = 0                    # gamma's reader: the head has a reader of its own
    g_lines_in = ceil((2 * n + gamma_skip) / B) * port.lines_per_beat
    gamma_taken = None                 # a one-row job's last gamma line into the Gearbox
    for row in range(rows):
        if kept and row:
            last1 = (g + tm.NORM_PASS_START + stream - 1 + tm.RMSNORM_SHIFT_TURNAROUND
                     + beats - 1)
            end = last1 + turnaround + (beats - 1) * pace
            gap = pace if beats > 1 else 1
            g = end
            continue
        gamma_at = max(g + 1, reader_free)                     # the read's command taken
        gamma_first = gamma_at + tm.READER_CMD_REGISTER + READ_OVERHEAD + L
        gamma = _GammaLines(gamma_port, gamma_first, gamma_skip, 2 * n,
                            held=buffered and g_pack is not None)
        reader_free = gamma_port.arrival(g_lines_in - 1, gamma_first) + tm.LINE_ALIGNER_LATENCY
        last0 = g + tm.NORM_PASS_START + stream - 1            # pass 0's last beat
        gamma_line = gamma.line
        if row == 0:        # pass 1's first replayed beat, or its PASS1_CMD, waits for the check
            last0 = max(last0, checked - (tm.RMSNORM_SHIFT_TURNAROUND if buffered else 1))
        if buffered:                               # passes 1 and 2 replay the row buffer
            last1 = last0 + tm.RMSNORM_SHIFT_TURNAROUND + beats - 1
            u = last1 + turnaround
            end, gap = _norm_replay_pass2(u, beats, gamma, g_cut, g_pack, g_ell)
            if rows == 1 and (g_pack is not None or g_cut == 1):
                gamma_taken = gamma.taken[-1]
            reader_free = max(reader_free, gamma.last_in())
            g = end
            continue
        if g_cut is not None:                      # the gamma beat of x's last beat
            g_last = gamma_line((beats - 1) // g_cut) + 1 + (beats - 1) % g_cut
        else:
            g_last = gamma_line(g_ell - 1) + 1
        pass2 = last0 + tm.NORM_PASS_START + stream            # PASS2_CMD
        u = pass2 + turnaround - 1
        if pack is None:
            end, gap = max(u + beats - 1, gamma_line(0) + beats, g_last), 1
        else:
            g_first = (gamma_line(0) + 1 if g_pack is None
                       else gamma_line(min(g_pack, g_ell) - 1) + 1)
            tail = ell - pack if beats > 1 else 0
            end = max(pass2 + 3 + ell, g_last, max(u, g_first) + tail)
            gap = ell - pack * (beats - 1)
        g = end
    last_out = end + tm.RMSNORM_LATENCY + (max(0, s - gap) if beats > 1 else 0)
    return UNIT_OVERHEAD + _done_after(last_out, s, dropped), gamma_taken


def _norm_replay_pass2(u, beats, gamma, g_cut, g_pack, g_ell):
    """RMSNORM pass 2 from the row buffer: x beats one a cycle from ``u`` (the first
    cycle the scaler takes one), each meeting its gamma beat. Gamma lines wait in the
    reader until the gamma Gearbox takes them: a packing Gearbox (``g_pack`` lines a
    beat) takes the first line of beat ``k`` no earlier than beat ``k − 1`` leaves, then a
    line a cycle. Returns (cycle of the last take, cycles between the last two takes)."""
    t_prev = t = None
    line_at = None                                 # the cycle the previous line was taken
    for k in range(beats):
        if g_cut is not None:                      # gamma beats cut from lines
            gk = gamma.line(k // g_cut) + 1 + k % g_cut
            if k % g_cut == 0:     # the line is taken once the last one's beats are out
                gamma.take(max(gamma.line(k // g_cut), -1 if t is None else t))
        else:                                      # or packed from g_pack lines
            for j in range(g_pack * k, min(g_pack * (k + 1), g_ell)):
                a = gamma.line(j)
                if line_at is not None:
                    a = max(a, line_at + 1)
                if j == g_pack * k and t is not None:
                    a = max(a, t)
                line_at = a
                gamma.take(a)
            gk = line_at + 1
        t_prev, t = t, max(u + k, gk, -1 if t is None else t + 1)
    return t, (t - t_prev if beats > 1 else 1)


class _GammaLines:
    """A row's gamma read as the gamma Gearbox can take its lines (``line(j)``: output
    line ``j`` of the UnalignedReader, a cycle after its LineAligner emits it).

    On a port that delivers a line a cycle or more the read streams freely
    (:meth:`~sim.timing_common.PortTiming.emit`): whatever pass 2 holds back, the lines
    behind it come a cycle apart once it goes on. On a slower port (``held``: one line a
    beat, one piece an engine beat) the reader holds ``tm.NORM_GAMMA_HELD_LINES`` lines,
    then holds the memory back, whose read credit caps at ``READ_CREDIT`` beats
    (:class:`~sim.timing_common.ReadCredit`): memory beat ``i`` leaves no earlier than
    ``tm.NORM_GAMMA_RELEASE`` cycles after the Gearbox took line
    ``i − tm.NORM_GAMMA_HELD_LINES`` (``take``, in order), and the lines after it come at
    the port's rate from there, not on the free-running schedule. Held to the RTL where
    a memory beat is one line and no BeatNarrower splits it (the op bench's ports); a
    slower port of several lines a beat, or behind the narrower, is taken to stream
    freely, as are the gamma reads of rows longer than the row buffer."""

    def __init__(self, port: PortTiming, first: int, skip: int, length: int, held: bool):
        self.port, self.first, self.skip, self.length = port, first, skip, length
        self.held = (held and port.beats_per_cycle < 1 and port.pieces == 1
                     and port.lines_per_beat == 1)
        self.lines_in = ceil((length + skip) / port.bus_bytes) * port.lines_per_beat
        self.credit = ReadCredit(port.beats_per_cycle)
        self.left: list[int] = []                  # the cycle each memory beat left
        self.taken: list[int] = []                 # the cycle the Gearbox took each line

    def _beat(self, i: int) -> int:
        while len(self.left) <= i:
            k = len(self.left)
            prev = self.left[-1] if self.left else NEVER
            offered = self.credit.offer(max(self.first, prev + 1), self.first, prev)
            depth = tm.NORM_GAMMA_HELD_LINES
            room = self.taken[k - depth] + tm.NORM_GAMMA_RELEASE if k >= depth else NEVER
            self.left.append(max(offered, room))
        return self.left[i]

    def line(self, j: int) -> int:
        if not self.held:
            return self.port.emit(j, self.first, self.skip, self.length) + tm.LINE_ALIGNER_LATENCY
        # the aligner emits a line as the next comes in, the last a cycle after it
        i = min(j + 1, self.lines_in - 1)
        flush = tm.LINE_ALIGNER_LATENCY if j + 1 >= self.lines_in else 0
        return self._beat(i) + tm.GEARBOX_LATENCY + flush + tm.LINE_ALIGNER_LATENCY

    def take(self, t: int):
        self.taken.append(t)

    def last_in(self) -> int:
        """The cycle the reader has taken the read's last line in (it takes the next
        command after it)."""
        if not self.held:
            return self.port.arrival(self.lines_in - 1, self.first) + tm.LINE_ALIGNER_LATENCY
        return self._beat(self.lines_in - 1) + tm.GEARBOX_LATENCY + tm.LINE_ALIGNER_LATENCY


def _actmul_rows(a: int, rows: int, n: int, lanes: int, s: int, ungated: bool, line: int,
                 rowexp: bool = False, in16: bool = False):
    """ACTMUL's row loop from the first ROW_ALIGN in cycle ``a`` (VMEM lines of ``line``
    bytes): (cycle the writer takes the last beat, beats per row). With ``rowexp`` each
    row is a measure pass, then a write pass once the measure pass's last beat has left
    ActMul (MEASURED), which reads a gated row's up half alone (its gates are buffered:
    no lines dropped first), and the next row's measure pass waits until the write pass's
    last beat is with the writer (DRAIN). With ``in16`` gate and up are int16: a line
    holds ``line/2`` of them and a beat is ``2·lanes`` bytes of each."""
    eb = 2 if in16 else 1                          # bytes of a gate (and an up) element
    g_lines = ceil(eb * n / line)
    d = 0 if ungated else eb * n // line           # lines the up-half aligner drops
    r = max(1, line // (eb * lanes))               # cycles per (gate, up) line pair
    q = max(1, eb * lanes // line)                 # lines per ActMul beat when packing
    if eb * lanes <= line:
        beats, last_lines, spacing = r * g_lines, 1, 1
    else:
        beats = ceil(g_lines / q)
        last_lines, spacing = g_lines - q * (beats - 1), q
    m = beats - 1
    w_last = None
    lat = tm.ACTMUL_LATENCY

    def pairs(a, d=d):
        """(first pair's cycle, last pair's, first beat into ActMul, last but one, last)."""
        f0 = a + tm.ACTMUL_ROW_START + d
        f_last = f0 + r * (g_lines - 1)
        if eb * lanes <= line:
            return f0, f_last, f0 + 1, f0 + beats - 1, f0 + beats
        return f0, f_last, f0 + min(q, g_lines), f_last + 1 - last_lines, f_last + 1

    for row in range(rows):
        if rowexp:
            if row:                                # DRAIN: the last write beat is taken
                a = max(a, w_last + 1) + 1
            _, f_last, _, _, in_last = pairs(a)
            a = max(f_last + 1, in_last + lat + 1) + 1     # MEASURED, then the write pass
        f0, f_last, in0, in_prev, in_last = pairs(a, 0 if rowexp else d)
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


def actmul_cycles(port: PortTiming, lanes: int, n: int, rows: int, wide: bool, addr: int,
                  ungated: bool = False, segments: int = 1, rowexp: bool = False,
                  in16: bool = False) -> int:
    """actmul_sequencer.py: each of the ``segments`` parameter blocks' head and SiLU table
    (256 entries, every instruction), all in one read of lines of
    :func:`~dfvg_hw.spec.timing.actmul_param_line` (``L/2`` entries a cycle, at most
    32), then per row the gate and up halves
    read from VMEM in pairs through ActMul and the RowWriter. An ``ungated`` row is its
    ``n`` gate bytes alone, which go through the up half's aligner from byte 0: it drops
    no lines before the first pair, and each row reads ``ceil(n/L)`` lines instead of
    ``ceil(2n/L)`` (the pairs, not the reads, set a row's pace either way). Where the segments end
    does not change the rows' timing (they stream as one row). With ``rowexp`` each row
    is read twice (:func:`_actmul_rows`). With ``in16`` gate and up are int16: twice the
    lines, cut into beats of ``2·lanes`` bytes."""
    line = port.line
    port = port.at(addr).with_line(tm.actmul_param_line(line, port.bus_bytes))
    first = tm.PARAM_CMD + READ_OVERHEAD + port.latency
    skip = addr % port.bus_bytes
    # every block's 33 chunks of 16 bytes, a line of them a cycle, each line taken as the
    # reader emits it; the last line's write
    nbytes = segments * ACT_PARAM_BYTES
    last_line = ceil(nbytes / port.line) - 1
    last_table_line = port.emit(last_line, first, skip, nbytes) + tm.ACTMUL_TABLE_WRITE
    a = last_table_line + 1 + tm.ACTMUL_TABLE_TO_ROWS
    if n == 0:                # CHECK goes to DONE in WRITE_CMD's cycle, before ROW_ALIGN's a
        return UNIT_OVERHEAD + a - 1
    beat_bytes = lanes * (2 if wide else 1)
    s = max(1, beat_bytes // line)
    w_last, beats = _actmul_rows(a, rows, n, lanes, s, ungated, line, rowexp, in16)
    _, dropped = _writer_tail((2 if wide else 1) * n, beats, lanes, wide, line)
    if beat_bytes <= line and wide:
        # the writer packs a row's beats into lines: those past the row's end are dropped
        dropped = ceil(beats * beat_bytes / line) - ceil(2 * n / line)
    return UNIT_OVERHEAD + _done_after(w_last, s, dropped)


def rope_cycles(port: PortTiming, n: int, k: int, rows: int, addr: int, pos: int,
                wide: bool = False) -> int:
    """rope_sequencer.py: CHECK starts the table row's read of ``POS`` (whole beats) and
    the operand's stream together; the heads (``k`` bytes, ``2k`` with ``wide``) go
    cutter → Rope → packer a line a cycle once the table row is in
    (:func:`~sim.head_stream_timing.streamed_heads`), and the job is done a cycle after
    the last line is poked."""
    if k == 0:
        # an empty table row is done without a read (BlockReader: IDLE, then DONE at once)
        table = tm.ROPE_CHECK + 1
    else:
        row_addr = addr + pos * 2 * k
        beats = ceil((row_addr % port.bus_bytes + 2 * k) / port.bus_bytes)
        table = (tm.ROPE_CHECK + READ_OVERHEAD + port.latency
                 + port.at(row_addr).beat_offset(beats - 1) + tm.BLOCK_READ_DONE)
    if n * k == 0:                                 # nothing to rotate once the table is in
        return UNIT_OVERHEAD + table + tm.ROPE_DONE
    last = streamed_heads(n, k * (2 if wide else 1), rows, port.line, tm.ROPE_CHECK + 1, table)
    return UNIT_OVERHEAD + last + tm.ROPE_DONE
