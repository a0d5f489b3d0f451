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
from sim.timing_common import LINE, _Port, _window

__all__ = ["kvappend_cycles", "attn_cycles"]

UNIT_OVERHEAD = tm.UNIT_OVERHEAD
READ_OVERHEAD = tm.MEM_READ_OVERHEAD


def _kv_words(config: EngineConfig) -> int:
    """KV buffer words per head entry (one word a cycle on its port): ``D / gcd(ρ, D)``
    with one bank, 1 (a whole row) with ``kv_banks ≥ 2``."""
    return kvt.kv_words(config.reduce, config.head_dim, config.kv_banks)


def kvappend_cycles(config: EngineConfig, n: int, k: int, src: int) -> int:
    """kv_sequencer.py: per head, gather K and V from VMEM, then append 2W words (into the
    one bank that holds ``POS``)."""
    w = _kv_words(config)
    base = src * LINE
    heads = sum(_window(base + h * k, k) + _window(base + n * k + h * k, k)
                + tm.KVAPPEND_HEAD_STATES + 2 * w for h in range(n))
    return UNIT_OVERHEAD + tm.KVAPPEND_STATES + heads


def attn_cycles(port: _Port, config: EngineConfig, n: int, k: int, src: int, dst: int, pos: int,
          wide: bool, addr: int) -> int:
    """kv_sequencer.py + attention.Attention, heads strictly one after another: per head
    the K rows stream at one KV word a cycle (W·T) — with ``B = kv_banks ≥ 2`` a group of
    B rows a cycle (``G = ceil(T / B)`` groups) — the scores go through the dot-product
    tree (and the B-lane max tree) and exp, the V rows stream again (the gearbox holds
    one row, so V cannot be fetched ahead), then the B-lane column sums, reciprocal and
    normaliser. Banked, the beats skip the gearbox (``row_packing``): a cycle less a
    head. ``ATTN_HEAD_TAIL`` counts the one-bank gearbox among its hand-offs."""
    w = _kv_words(config)
    t = pos + 1
    banks = config.kv_banks
    g = kvt.kv_groups(t, banks)
    levels = kvt.bank_tree_levels(banks)
    out_bytes = 2 * k if wide else k
    beats = ceil((addr % port.bus_bytes + ATTN_PARAM_BYTES) / port.bus_bytes)
    params = (tm.ATTN_PARAMS + READ_OVERHEAD + port.latency
              + (beats - 1) * ceil(1 / port.beats_per_cycle))
    score_to_v = tm.ceil_log2(config.head_dim) + tm.ATTN_SCORE_TO_V + levels
    per_head_kv = (2 * w * g - w + max(score_to_v, w) + tm.ATTN_HEAD_TAIL + levels
                   + kvt.row_packing(banks) - kvt.row_packing(1))
    heads = sum(_window(src * LINE + h * k, k) + per_head_kv + _window(dst * LINE + h * out_bytes, out_bytes)
                for h in range(n))
    return (UNIT_OVERHEAD + tm.ATTN_CHECK + params + tm.ATTN_GROUPS + tm.GQA_DIVIDE_STEPS
            + tm.ATTN_END_STATES + heads)
