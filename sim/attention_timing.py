"""Cycle model of KVAPPEND and ATTN (kv_sequencer.py and the attention unit).

Part of :mod:`sim.cycle_model`, in a file of its own because the KV buffer's banking
changes these formulas and nothing else. ``port`` is the cycle model's memory path
(``latency``, ``bus_bytes``, ``beats_per_cycle``). All figures are *modelled*.
"""

from __future__ import annotations

from math import ceil

from dfvg_hw.spec import kv_timing as kvt
from dfvg_hw.spec import timing as tm
from dfvg_hw.spec.config import EngineConfig
from dfvg_hw.spec.image import ATTN_PARAM_BYTES
from sim.head_stream_timing import head_end_line
from sim.timing_common import PortTiming, window_cycles

__all__ = ["kvappend_cycles", "attn_cycles", "attn_job_cycles", "compaction_cycles"]

UNIT_OVERHEAD = tm.UNIT_OVERHEAD
READ_OVERHEAD = tm.MEM_READ_OVERHEAD


def _kv_words(config: EngineConfig) -> int:
    """KV buffer words per head entry (one word a cycle on its port): ``D / gcd(ρ, D)``
    with one bank, 1 (a whole row) with ``kv_banks ≥ 2``."""
    return kvt.kv_words(config.reduce, config.head_dim, config.kv_banks)


def compaction_cycles(config: EngineConfig, levels: int, slots: int) -> int:
    """Cycles of a request's compaction (docs/isa.md §9.3), from the KV sequencer taking it
    to ``compact_done``: per level a ROLLBACK to its destination, then per slot a KV
    buffer COPY of the entry's ``W`` words (K and V side by side); nothing but the start
    without a level or a slot."""
    if not levels or not slots:
        return tm.COMPACT_START
    copy = tm.KV_COPY_STATES + _kv_words(config)
    return tm.COMPACT_START + levels * (tm.COMPACT_LEVEL_STATES + slots * copy)


def kvappend_cycles(config: EngineConfig, n: int, k: int, src: int, wide: bool = False) -> int:
    """kv_sequencer.py: CHECK starts two head cutters (K from the row's first byte, V from
    byte ``n·k·e``, heads of ``k·e`` bytes: ``e = 2`` with WIDE's int16 k and v); SET_POS; then per head an APPEND of its K and V words (the KV buffer's
    setup, then 2W words, into the one bank that holds ``POS``), the next APPEND in the
    cycle after the last word. The cutters peek a head ahead of the one appended (K's
    lines, then V's, from the cycle its predecessor left them), so a head's APPEND waits
    for them only when its lines take longer than the APPEND before it."""
    if n == 0:
        return UNIT_OVERHEAD + tm.KVAPPEND_STATES
    w = _kv_words(config)
    line = config.vmem_line_bytes
    per_append = tm.KVAPPEND_HEAD_STATES + 2 * w
    k = 2 * k if wide else k                       # a head's bytes
    skips = (0, n * k % line)                      # the K half's and the V half's
    peeks = tm.KVAPPEND_CHECK + 1                  # SET_POS: the cutters' first peeks
    append = peeks + 1                             # the first APPEND state
    ends = [-1, -1]                                # the line each half's last head ended in
    for h in range(n):
        lines = 0
        for half, skip in enumerate(skips):
            end = head_end_line(h, k, line, skip)
            lines, ends[half] = lines + end - ends[half], end
        ready = peeks + lines + (tm.HEAD_CUTTER_LATENCY - 1 if lines else 1)
        append = max(append, ready) if h == 0 else max(append + per_append, ready)
        peeks = append                             # the heads leave: the next ones' peeks
    return UNIT_OVERHEAD + append + per_append - 1         # done with the last word


def attn_cycles(port: PortTiming, config: EngineConfig, n: int, k: int, src: int, dst: int, pos: int,
          wide: bool, addr: int, in16: bool = False) -> int:
    """A chain's ATTN at ``POS = pos``: :func:`attn_job_cycles` over positions ``0 … pos``
    (``prefix = pos + 1``), no path."""
    return attn_job_cycles(port, config, n, k, src, dst, pos + 1, 0, wide, addr, in16)


def attn_job_cycles(port: PortTiming, config: EngineConfig, n: int, k: int, src: int, dst: int,
                    prefix: int, path_len: int, wide: bool, addr: int, in16: bool = False) -> int:
    """One ATTN job (a chain's, or one row of a tree forward's: ``prefix = P0``,
    ``path_len = d``, ``src``/``dst`` the row's lines), from the job's hand-over to
    ``done`` plus the unit overhead. In cycles from CHECK (0), which sends the parameter
    block's read: SET_POS and head 0's q gather run during the read; PARAMS_WAIT is left
    at the later of the block's ``done`` and the gather's end; DIVIDE (G's checks, ``n /
    G`` from ``n``'s leading one, the remainder and the spans) follows, then head 0's
    QUERY and the heads (:func:`_overlapped_heads`), ``done`` in the last scatter's final
    cycle (without a head, DONE after DIVIDE). A head streams ``G`` groups of K (one KV
    word a cycle: ``W`` words a row with one bank, through the gearbox; with ``B =
    kv_banks ≥ 2`` a group of B rows a cycle, ``G = ceil(prefix / B) + path_len``, each path
    entry a group of its own; one bank: ``G = prefix + path_len`` rows) and ``G`` of V, on
    the KV buffer's two channels, so head h + 1's K pass runs during head h's V pass.
    ``in16``: a head's q is ``2k`` bytes (ATTN IN16) and its gather reads them."""
    w = _kv_words(config)
    banks = config.kv_banks
    g = kvt.kv_groups(prefix, banks) + path_len
    out_bytes = 2 * k if wide else k
    beats = ceil((addr % port.bus_bytes + ATTN_PARAM_BYTES) / port.bus_bytes)
    params_done = (kvt.ATTN_PARAMS_DONE + READ_OVERHEAD + port.latency
                   + port.at(addr).beat_offset(beats - 1))
    line = config.vmem_line_bytes
    q_bytes = 2 * k if in16 else k
    gathers = [window_cycles(src * line + h * q_bytes, q_bytes, line) for h in range(n)]
    scatters = [window_cycles(dst * line + h * out_bytes, out_bytes, line) for h in range(n)]
    params_wait = kvt.ATTN_CHECK + kvt.ATTN_SET_POS + (gathers[0] if n else 0)
    leave = max(params_done, params_wait)           # PARAMS_WAIT's last cycle
    query = leave + 1 + kvt.gqa_divide_steps(n)     # head 0's QUERY
    if n == 0:
        return UNIT_OVERHEAD + query + kvt.ATTN_DONE
    return UNIT_OVERHEAD + _overlapped_heads(config, g, w, gathers, scatters, query)


def _overlapped_heads(config: EngineConfig, g: int, w: int, gathers: list[int],
                      scatters: list[int], first_query: int) -> int:
    """The cycle after the last scatter of the ATTN loop of kv_sequencer.py over
    ``len(gathers)`` heads of ``g`` groups (``w`` KV words each), head 0's QUERY in cycle
    ``first_query`` (its q gathered before). Per head ``h``, in cycles (a step happens at
    the end of its cycle):

    * ``query``: the attention unit takes q[h] once the sequencer has gathered it, the
      cycle after the unit has taken head h − 1's last K row (``last_k[h − 1] + 1``), and
      the cycle after the weights pass has issued the last score read of head h − 3 (the
      score buffer head h uses, of three);
    * ``read_k``: the K request, the cycle after, once the K channel is idle and head
      h − 2's V request is out (the sequencer owes at most two V requests); its ``w·g``
      words stream at one a cycle, the attention unit takes each row as it comes
      (``kvt.row_packing``: the one-bank gearbox), and the scores are complete
      ``kvt.ATTN_SCORES_DONE`` after the last (the dot-product tree, the B-lane max tree);
    * ``read_v``: the V request, once the K channel has ended this head's read and the V
      channel has issued head h − 1's last address (a cycle before that head's last V row
      is taken with one bank, the cycle it is taken when banked);
    * ``start``: the weights pass takes the head at the latest of its scores being done,
      head h − 1's last weight meeting V (``last_join[h − 1]``) and head h − 2's ``E``
      going to the reciprocal (``hand[h − 2]``: the accumulator set it frees); its first
      weight meets V ``kvt.ATTN_START_TO_JOIN`` later or when the first V row is there,
      then a group every ``w`` cycles (V comes at one word a cycle, prefetched). Its score
      reads issue one a cycle while the exp path (``kvt.ATTN_READ_SLOTS`` groups from read
      to V) has room: read ``i`` at the later of ``start + 1 + i`` and group
      ``i − ATTN_READ_SLOTS`` meeting V;
    * ``hand``: E goes to the reciprocal ``kvt.ATTN_JOIN_TO_DIV`` after the last join,
      or when the reciprocal is free (``kvt.ATTN_RECIP_BUSY`` after the previous);
    * the output is valid ``kvt.ATTN_RECIP_TO_OUT`` after ``hand``.

    The sequencer takes head h − 2's output after head h's K request (the outputs
    trail by two heads, so q[h + 1] is not held up by the reciprocal), scatters it and
    gathers q[h + 1]; after the last K request it takes the remaining outputs.
    """
    n = len(gathers)
    if n == 0:
        return 0
    levels = kvt.bank_tree_levels(config.kv_banks)
    pack = kvt.row_packing(config.kv_banks)
    words = w * g                                   # KV beats of a head's K (and V) read
    last_row = kvt.READ_TO_LAST_ROW + words + pack  # K request → its last row taken
    scores_done = last_row + tm.ceil_log2(config.head_dim) + kvt.ATTN_SCORES_DONE + levels
    first_v = kvt.READ_TO_FIRST_ROW + (w - 1) + pack
    slots = kvt.ATTN_READ_SLOTS
    read_k, read_v, last_k, last_issue, last_join, hand = [], [], [], [], [], []
    out = []
    t, outs = 0, 0                                  # GATHER_Q(h); outputs taken
    for h in range(n):
        query = first_query if h == 0 else t + gathers[h]
        if h:
            query = max(query, last_k[h - 1] + 1)
        if h >= kvt.ATTN_SCORE_BUFFERS:
            query = max(query, last_issue[h - kvt.ATTN_SCORE_BUFFERS] + 1)
        rk = query + 1
        if h:
            rk = max(rk, read_k[h - 1] + kvt.READ_CHANNEL_BUSY + words)
        if h >= 2:
            rk = max(rk, read_v[h - 2] + 1)
        k_idle = rk + kvt.READ_CHANNEL_BUSY + words
        rv = k_idle if h == 0 else max(k_idle, read_v[h - 1] + kvt.READ_CHANNEL_BUSY + words,
                                       last_join[h - 1] - pack)
        start = rk + scores_done
        if h:
            start = max(start, last_join[h - 1])
        if h >= 2:
            start = max(start, hand[h - 2])
        first_join = max(start + kvt.ATTN_START_TO_JOIN, rv + first_v)
        read_k.append(rk)
        read_v.append(rv)
        last_k.append(rk + last_row)
        last_join.append(first_join + (g - 1) * w)
        last_issue.append(start + g if g <= slots else
                          max(start + g, first_join + (g - 1 - slots) * w))
        hand.append(last_join[h] + kvt.ATTN_JOIN_TO_DIV + levels if h == 0 else
                    max(last_join[h] + kvt.ATTN_JOIN_TO_DIV + levels,
                        hand[h - 1] + kvt.ATTN_RECIP_BUSY))
        out.append(hand[h] + kvt.ATTN_RECIP_TO_OUT)
        t = rk + 1
        if h >= 2 or h == n - 1:                    # ATTEND: head h − 2's output, or all
            while True:
                t = max(t, out[outs]) + 1 + scatters[outs]
                outs += 1
                if outs == n:
                    return t
                if h < n - 1:
                    break
