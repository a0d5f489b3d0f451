"""Cycles of a tree request's SAMPLE (docs/isa.md §9.2, §9.5): passes of the token sampler
over the logit buffer's rows, the level's expansion and a record per node, as
:class:`~dfvg_hw.sample_sequencer.SampleSequencer` and
:class:`~dfvg_hw.tree_expander.TreeExpander` run them (tests/rtl/test_sample_sequencer.py
holds the RTL to it). The chain's SAMPLE is :meth:`sim.cycle_model.CycleModel._sample`.
"""

from __future__ import annotations

from math import ceil

from dfvg_hw.spec import timing as tm
from dfvg_hw.spec.config import EngineConfig
from dfvg_hw.spec.descriptors import record_words

__all__ = ["tree_sample_cycles"]


def tree_sample_cycles(config: EngineConfig, n: int, topk: int, sources: int, width: int,
                       sampled: bool) -> int:
    """A tree SAMPLE over ``sources`` logit-buffer rows of ``n`` logits making a level of
    ``width`` rows: FETCH + DECODE, the request, then a pass of the sampler per source row
    (greedy) or per new row (sampled), each its row's tiles a cycle each, the sampler's
    latency and ``k'`` cycles for the expander to store its list; the last candidate's
    settling, ``width`` records a word a cycle, RETIRE. A greedy level with fewer than
    ``width`` candidates is refused after the request."""
    k = min(max(topk, 1), config.topk_max)
    k_eff = min(k, n)
    if not sampled and k_eff * sources < width:
        return tm.ISSUE + tm.TREE_SAMPLE_REFUSED
    passes = width if sampled else sources
    per_pass = tm.SAMPLE_START + ceil(n / config.lanes) + tm.sampler_latency(config.lanes, k, k_eff) + k_eff
    return (tm.ISSUE + tm.TREE_SAMPLE_ACCEPT + passes * per_pass + tm.TREE_PICK_SETTLE
            + width * record_words(config.topk_max) + tm.RETIRE)
