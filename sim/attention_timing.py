"""Cycle model of KVAPPEND and ATTN (kv_sequencer.py and the attention unit).

Part of :mod:`sim.cycle_model`, in a file of its own because the KV buffer's banking
changes these formulas and nothing else. ``port`` is the cycle model's memory path
(``latency``, ``bus_bytes``, ``beats_per_cycle``). All figures are *modelled*.
"""

from __future__ import annotations

from math import ceil, gcd

from dfvg_hw.spec import timing as tm
from dfvg_hw.spec.config import EngineConfig
from dfvg_hw.spec.image import ATTN_PARAM_BYTES
from sim.timing_common import LINE, _window

__all__ = ["kvappend_cycles", "attn_cycles"]

UNIT_OVERHEAD = tm.UNIT_OVERHEAD
READ_OVERHEAD = tm.MEM_READ_OVERHEAD


def _kv_words(config: EngineConfig) -> int:
    """KV buffer words per head entry (one word a cycle on its port)."""
    return config.head_dim // gcd(config.reduce, config.head_dim)


def kvappend_cycles(config: EngineConfig, n: int, k: int, src: int) -> int:
    """kv_sequencer.py: per head, gather K and V from VMEM, then append 2W words."""
    w = _kv_words(config)
    base = src * LINE
    heads = sum(_window(base + h * k, k) + _window(base + n * k + h * k, k)
                + tm.KVAPPEND_HEAD_STATES + 2 * w for h in range(n))
    return UNIT_OVERHEAD + tm.KVAPPEND_STATES + heads


def attn_cycles(port: _Port, config: EngineConfig, n: int, k: int, src: int, dst: int, pos: int,
          wide: bool, addr: int) -> int:
    """kv_sequencer.py + softmax.Attention, heads strictly one after another: per head the
    K rows stream at one KV word a cycle (W·T), the scores go through the dot-product
    tree and exp, the V rows stream again (the gearbox holds one row, so V cannot be
    fetched ahead), then reciprocal and normaliser."""
    w = _kv_words(config)
    t = pos + 1
    out_bytes = 2 * k if wide else k
    beats = ceil((addr % port.bus_bytes + ATTN_PARAM_BYTES) / port.bus_bytes)
    params = (tm.ATTN_PARAMS + READ_OVERHEAD + port.latency
              + (beats - 1) * ceil(1 / port.beats_per_cycle))
    score_to_v = tm.ceil_log2(config.head_dim) + tm.ATTN_SCORE_TO_V
    per_head_kv = 2 * w * t - w + max(score_to_v, w) + tm.ATTN_HEAD_TAIL
    heads = sum(_window(src * LINE + h * k, k) + per_head_kv + _window(dst * LINE + h * out_bytes, out_bytes)
                for h in range(n))
    return (UNIT_OVERHEAD + tm.ATTN_CHECK + params + tm.ATTN_GROUPS + tm.GQA_DIVIDE_STEPS
            + tm.ATTN_END_STATES + heads)
