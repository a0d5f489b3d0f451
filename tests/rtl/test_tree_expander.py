"""Tree expander RTL against the functional model's expansion (sim.tree_state.TreeState.expand,
numerics.tree_expand_greedy): whole trees level by level, greedy and sampled, with many
tied path scores, the records and the new nodes bit for bit, under stalls on both sides."""

from __future__ import annotations

import numpy as np
import pytest

from dfvg_hw.spec import numerics as nx
from dfvg_hw.spec.config import get_preset
from dfvg_hw.tree_expander import TreeExpander
from dfvg_hw.verilog import to_verilog
from sim.lint import verilator_lint
from sim.testbench import run_simulation, stream_put, watchdog
from sim.tree_state import SampledRow, TreeState

TINY = get_preset("tiny")


def sampled_row(rng, length: int) -> SampledRow:
    """A top-``length`` list as the sampler makes it; logits from a few values, so
    probabilities (and the path scores built from them) tie often."""
    n = length + int(rng.integers(0, 8))
    logits = rng.choice(np.array([-300, 0, 0, 90, 256, 256]), n) if rng.random() < 0.6 \
        else rng.integers(-2000, 2000, n)
    top = nx.topk_select(logits, length)
    probs = nx.sampler_probs(logits[top], nx.T1_MULT, nx.T1_SHIFT)
    return SampledRow([int(t) for t in top], [int(p) for p in probs])


def random_tree(rng, rows: int, topk_max: int):
    """(W, sampled, levels): per level its source lists and its passes' (row, rank)."""
    sampled = bool(rng.random() < 0.4)
    # a greedy tree needs topk ≥ W (a request check, isa.md §5.1)
    width = int(rng.integers(1, (rows if sampled else min(rows, topk_max)) + 1))
    levels = []
    for level in range(int(rng.integers(1, 5))):
        n_sources = 1 if level == 0 else width
        # a level's lists have one length, k' = min(topk, n); greedy needs W candidates
        shortest = 1 if sampled else -(-width // n_sources)
        length = int(rng.integers(shortest, topk_max + 1))
        sources = [sampled_row(rng, length) for _ in range(n_sources)]
        if sampled:
            passes = [(0 if level == 0 else r, int(rng.integers(0, length))) for r in range(width)]
        else:
            passes = [(s, 0) for s in range(n_sources)]
        levels.append((sources, passes))
    return width, sampled, levels


def expected(width: int, sampled: bool, levels, topk_max: int):
    """Per level: the record words and the (row, source, token) nodes."""
    tree, out = TreeState(width, 0), []
    for level, (sources, passes) in enumerate(levels):
        draws = [rank for _, rank in passes] if sampled else None
        records = tree.expand(sources, draws)
        nodes = []
        for r, rec in enumerate(records):
            source = 0 if level == 0 else rec.parent - (level - 1) * width
            nodes.append((r, source, rec.token))
        out.append(([w for rec in records for w in rec.record(topk_max)], nodes))
    return out


def payload(sources, passes, p, topk_max):
    row, rank = passes[p]
    src = sources[row]
    pad = topk_max - len(src.ids)
    return {"result": {"token": src.ids[rank], "prob": src.probs[rank], "rank": rank,
                       "k": len(src.ids), "ids": src.ids + [0] * pad, "probs": src.probs + [0] * pad},
            "row": row, "last": int(p == len(passes) - 1)}


@pytest.mark.parametrize("rows, topk_max, trees", [(TINY.rows, TINY.topk_max, 60), (4, 4, 60), (8, 5, 30)])
def test_levels_match_the_functional_model(rows, topk_max, trees):
    cfg = TINY.with_changes(rows=rows, topk_max=topk_max)
    rng = np.random.default_rng(100 * rows + topk_max)
    cases = [random_tree(rng, rows, topk_max) for _ in range(trees)]
    want = [expected(*case, topk_max) for case in cases]
    dut = TreeExpander(cfg)
    got = []

    async def produce(ctx):
        for width, sampled, levels in cases:
            for level, (sources, passes) in enumerate(levels):
                first = level * width
                await stream_put(ctx, dut.level, {"width": width, "first": first, "sampled": int(sampled)})
                for p in range(len(passes)):
                    if rng.random() < 0.2:
                        await ctx.tick()
                    await stream_put(ctx, dut.source, payload(sources, passes, p, topk_max))

    async def consume(ctx):
        for width, _, levels in cases:
            tree = []
            for _ in levels:
                words, nodes = [], []
                while True:
                    stall = rng.random() < 0.2
                    ctx.set(dut.record.ready, 0 if stall else 1)
                    valid, rec, node_valid, node = (ctx.get(s) for s in (
                        dut.record.valid, dut.record.payload, dut.expansion.valid, dut.expansion.payload))
                    await ctx.tick()
                    if node_valid:
                        nodes.append((node.row, node.source, node.token))
                    if valid and not stall:
                        words.append(rec.word)
                        if rec.final:
                            break
                tree.append((words, nodes))
            got.append(tree)

    run_simulation(dut, produce, consume, watchdog(200_000, lambda: len(got) == len(cases)))
    for i, (g, w) in enumerate(zip(got, want)):
        assert g == w, f"tree {i}: {cases[i][:2]}"


def test_lint_clean():
    clean, output = verilator_lint(to_verilog(TreeExpander(TINY), "tree_expander"), "tree_expander")
    assert clean, output
