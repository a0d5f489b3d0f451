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


def kvappend_cycles(config: EngineConfig, n: int, k: int, src: int) -> int:
    """kv_sequencer.py: per head, gather K and V from VMEM, then append 2W words (into the
    one bank that holds ``POS``)."""
    w = _kv_words(config)
    line = config.vmem_line_bytes
    base = src * line
    heads = sum(window_cycles(base + h * k, k, line) + window_cycles(base + n * k + h * k, k, line)
                + tm.KVAPPEND_HEAD_STATES + 2 * w for h in range(n))
    return UNIT_OVERHEAD + tm.KVAPPEND_STATES + heads


def attn_cycles(port: PortTiming, config: EngineConfig, n: int, k: int, src: int, dst: int, pos: int,
          wide: bool, addr: int) -> int:
    """A chain's ATTN at ``POS = pos``: :func:`attn_job_cycles` over positions ``0 … pos``
    (``prefix = pos + 1``), no path."""
    return attn_job_cycles(port, config, n, k, src, dst, pos + 1, 0, wide, addr)


def attn_job_cycles(port: PortTiming, config: EngineConfig, n: int, k: int, src: int, dst: int,
                    prefix: int, path_len: int, wide: bool, addr: int) -> int:
    """One ATTN job (a chain's, or one row of a tree forward's: ``prefix = P0``,
    ``path_len = d``, ``src``/``dst`` the row's lines), from the job's hand-over to
    ``done`` plus the unit overhead. kv_sequencer.py + attention.Attention, heads
    overlapped (:func:`_overlapped_heads`): per head the K rows stream at one KV word a
    cycle (W·T) — with ``B = kv_banks ≥ 2`` a group of B rows a cycle (``ceil(prefix /
    B)`` groups), and each path entry a group of its own (``G = ceil(prefix / B) +
    path_len``; one bank: ``T = prefix + path_len`` rows) — the scores go through the dot-product
    tree (and the B-lane max tree) and exp, the V rows stream again (the gearbox holds
    one row, so V cannot be fetched ahead), then the B-lane column sums, reciprocal and
    normaliser. Banked, the beats skip the gearbox (``row_packing``): a cycle less a
    head. ``ATTN_HEAD_TAIL`` counts the one-bank gearbox among its hand-offs.
    ``per_head_kv`` is one head alone, q to its output taken."""
    w = _kv_words(config)
    banks = config.kv_banks
    g = kvt.kv_groups(prefix, banks) + path_len
    levels = kvt.bank_tree_levels(banks)
    out_bytes = 2 * k if wide else k
    beats = ceil((addr % port.bus_bytes + ATTN_PARAM_BYTES) / port.bus_bytes)
    params = (tm.ATTN_PARAMS + READ_OVERHEAD + port.latency
              + port.at(addr).beat_offset(beats - 1))
    score_to_v = tm.ceil_log2(config.head_dim) + tm.ATTN_SCORE_TO_V + levels
    per_head_kv = (2 * w * g - w + max(score_to_v, w) + tm.ATTN_HEAD_TAIL + levels
                   + kvt.row_packing(banks) - kvt.row_packing(1))
    line = config.vmem_line_bytes
    gathers = [window_cycles(src * line + h * k, k, line) for h in range(n)]
    scatters = [window_cycles(dst * line + h * out_bytes, out_bytes, line) for h in range(n)]
    return (UNIT_OVERHEAD + tm.ATTN_CHECK + params + tm.ATTN_GROUPS + tm.GQA_DIVIDE_STEPS
            + tm.ATTN_END_STATES + _overlapped_heads(n, per_head_kv, gathers, scatters))


def _overlapped_heads(n: int, per_head_kv: int, gathers: list[int], scatters: list[int]) -> int:
    """Cycles of ``n`` overlapped heads (kv_sequencer.py's ATTN loop), from the first
    GATHER_Q to the end of the last scatter. Times are cycles; per head ``h``:

    * ``query[h]``: the attention unit takes q[h], at the later of the sequencer reaching
      QUERY and the unit handing head h − 1 to its reciprocal (``recip[h − 1] + 1``);
    * ``recip[h]``: the reciprocal takes head h's ``E``: ``per_head_kv −
      kvt.ATTN_RECIP_TO_OUT`` after q with a free reciprocal, else when the previous quotient leaves
      (``recip[h − 1] + kvt.ATTN_RECIP_BUSY``);
    * the output is valid ``kvt.ATTN_RECIP_TO_OUT`` after ``recip[h]``; the sequencer
      takes head h − 1's output after head h's READ_KV (head 0: gathers q[1] first), then
      scatters it and gathers q[h + 1].

    A single head is the sequential ``gather + per_head_kv + 1 + scatter``.
    """
    if n == 0:
        return 0
    to_recip = per_head_kv - kvt.ATTN_RECIP_TO_OUT
    recip_prev = None
    t = gathers[0]                      # QUERY reached, head 0
    out_time = []                       # the cycle each output is valid
    seq = 0                             # the sequencer's next free cycle after a scatter
    for h in range(n):
        q = t if recip_prev is None else max(t, recip_prev + 1)
        r = q + to_recip if recip_prev is None else max(q + to_recip,
                                                        recip_prev + kvt.ATTN_RECIP_BUSY)
        out_time.append(r + kvt.ATTN_RECIP_TO_OUT)
        recip_prev = r
        after_read = q + 2              # QUERY, READ_KV
        if h == 0:
            seq = after_read
        else:                           # ATTEND head h − 1, scatter it
            seq = max(after_read, out_time[h - 1]) + 1 + scatters[h - 1]
        if h + 1 < n:
            t = seq + gathers[h + 1]
    end = max(seq, out_time[n - 1]) + 1 + scatters[n - 1]
    return end
