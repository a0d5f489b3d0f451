"""Cycles of a tree request's SAMPLE (docs/isa.md §9.2, §9.5): every source row of the
logit buffer through the token sampler, the level's expansion, a record per node.

Modelled: the sampler's RTL for trees is not built yet, so the formula is the plan; the
single-row SAMPLE's exact count is :meth:`sim.cycle_model.CycleModel._sample`.
"""

from __future__ import annotations

from math import ceil

from dfvg_hw.spec import timing as tm
from dfvg_hw.spec.config import EngineConfig
from dfvg_hw.spec.descriptors import record_words

__all__ = ["tree_sample_cycles"]


def tree_sample_cycles(config: EngineConfig, n: int, topk: int, sources: int, width: int,
                       sampled: bool) -> int:
    """One top-k pass per source row of ``n`` logits, the expansion (``width`` passes over
    the candidates when greedy, one draw a row when sampled) and ``width`` records."""
    k = min(max(topk, 1), config.topk_max, n)
    per_source = ceil(n / config.lanes) + tm.SAMPLE_START + tm.sampler_latency(config.lanes, k, k)
    expansion = width * (1 if sampled else sources * k)
    return (tm.ISSUE + sources * per_source + expansion + width * record_words(config.topk_max)
            + tm.RETIRE)
