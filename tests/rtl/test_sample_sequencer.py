"""Logit buffer + sampler RTL against the functional model's SAMPLE: the record words of
every drafted token, bit for bit (FunctionalEngine._sample and DraftedToken.record); a tree
request's levels (FunctionalEngine.sample with a TreeState) with their new nodes and each
SAMPLE's cycles against the cycle model."""

from __future__ import annotations

import numpy as np
import pytest

from dfvg_hw.spec import numerics as nx
from dfvg_hw.spec.config import get_preset
from dfvg_hw.spec.descriptors import ErrorCode
from dfvg_hw.spec.isa import Instruction, Op
from dfvg_hw.spec.timing import ISSUE, RETIRE
from dfvg_hw.sample_sequencer import SampleSequencer
from sim.cycle_model import CycleModel, TreeTiming
from sim.functional import EngineFault, FunctionalEngine
from dfvg_hw.verilog import to_verilog
from sim.lint import verilator_lint
from sim.testbench import run_simulation, stream_get, stream_put, watchdog
from sim.tree_state import TreeState

TINY = get_preset("tiny")


def reference(engine: FunctionalEngine, logits, h, index):
    engine.logit_rows = np.asarray(logits, dtype=np.int16)[None, :]
    engine.logits = engine.logit_rows[0]
    token, = engine.sample(len(logits), h, index)
    return token.record(TINY.topk_max), len(token.topk_ids)


def random_case(rng):
    n = int(rng.choice([1, 2, 3, TINY.lanes, TINY.lanes + 1, int(rng.integers(1, TINY.vocab_max + 1)),
                        TINY.vocab_max]))
    if rng.random() < 0.3:      # ties: a few distinct values only
        logits = rng.choice(np.array([-32768, 0, 5, 32767]), n)
    else:
        logits = rng.integers(-3000, 3000, n)
    sample = bool(rng.random() < 0.6)
    t_mult, t_shift = nx.host_temperature(float(rng.choice([0.5, 1.0, 1.7]))) if sample else (0, 0)
    h = {"topk": int(rng.integers(1, TINY.topk_max + 1)), "sample": sample, "t_mult": t_mult,
         "t_shift": t_shift, "seed": int(rng.integers(0, 1 << 63)), "counter": int(rng.integers(0, 1 << 31))}
    return logits, h, int(rng.integers(0, 8))


def test_records_match_the_functional_model():
    rng = np.random.default_rng(4)
    cases = [random_case(rng) for _ in range(40)]
    engine = FunctionalEngine(TINY)
    expected = [reference(engine, *c) for c in cases]
    dut = SampleSequencer(TINY)
    got = []

    async def tb(ctx):
        ctx.set(dut.clear, 1)
        await ctx.tick()
        ctx.set(dut.clear, 0)
        assert ctx.get(dut.n_logits) == 0
        for (logits, h, index), _ in zip(cases, expected):
            # the LOGITS matmul: begin, then its tiles (padded lanes are junk on purpose)
            ctx.set(dut.begin, 1)
            ctx.set(dut.begin_n, len(logits))
            await ctx.tick()
            ctx.set(dut.begin, 0)
            padded = np.concatenate([logits, rng.integers(-32768, 32768, -len(logits) % TINY.lanes)])
            for t in range(len(padded) // TINY.lanes):
                if rng.random() < 0.3:
                    await ctx.tick()
                await stream_put(ctx, dut.logits, {"data": [int(v) for v in padded[t * 4:(t + 1) * 4]]})
            assert ctx.get(dut.n_logits) == len(logits)
            await stream_put(ctx, dut.req, {
                "k": h["topk"], "t_mult": h["t_mult"], "t_shift": h["t_shift"], "sample": int(h["sample"]),
                "seed": h["seed"], "counter": h["counter"] + index})
            words, ks = [], set()
            while True:
                if rng.random() < 0.2:
                    await ctx.tick()
                beat = await stream_get(ctx, dut.record)
                words.append(beat.word)
                ks.add(beat.k)
                if beat.last:
                    break
            got.append((words, ks.pop() if len(ks) == 1 else ks))

    run_simulation(dut, tb, watchdog(400_000, lambda: len(got) == len(cases)))
    for i, ((words, k), (want, want_k)) in enumerate(zip(got, expected)):
        assert words == want, f"case {i}: {words} != {want}"
        assert k == want_k


# -- tree requests -----------------------------------------------------------------------
def random_tree(rng, cfg):
    """A tree request's SAMPLEs: (header, W, [(n, logit rows) per level])."""
    sampled = bool(rng.random() < 0.45)
    width = int(rng.integers(1, cfg.rows + 1))
    # greedy requests have topk ≥ W (isa.md §5.1), but a level of short rows still has
    # fewer than W candidates (k' = min(topk, n)): a few ask for it outright
    low = 1 if sampled or rng.random() < 0.2 else width
    topk = int(rng.integers(min(low, cfg.topk_max), cfg.topk_max + 1))
    t_mult, t_shift = nx.host_temperature(float(rng.choice([0.6, 1.0, 1.5]))) if sampled \
        else (0, 0) if rng.random() < 0.5 else nx.host_temperature(0.8)
    h = {"topk": topk, "sample": sampled, "t_mult": t_mult, "t_shift": t_shift,
         "seed": int(rng.integers(0, 1 << 63)), "counter": int(rng.integers(0, 1 << 32))}
    levels = []
    for level in range(int(rng.integers(1, min(4, 64 // width) + 1))):
        # now and then rows shorter than W: k' = n < W
        n = int(rng.integers(1, 4)) if rng.random() < 0.1 else \
            int(rng.choice([cfg.lanes + 1, int(rng.integers(4, 48))]))
        # a tree forward without a LOGITS of its own leaves the last one's single row
        # (greedy only: sim.functional has no sampled rule for it yet)
        sources = 1 if level == 0 or (not sampled and rng.random() < 0.1) else width
        if rng.random() < 0.4:       # ties: a few distinct values, equal path scores
            rows = rng.choice(np.array([-40, 0, 0, 200, 200]), (sources, n))
        else:
            rows = rng.integers(-1500, 1500, (sources, n))
        levels.append((n, rows))
    return h, width, levels


def tree_reference(cfg, h, width, levels):
    """Per SAMPLE: (record words, (row, source, token) nodes, cycles) or (None, None,
    cycles) where the functional model faults PROGRAM (the request ends there)."""
    engine, model = FunctionalEngine(cfg), CycleModel(cfg)
    engine.tree = TreeState(width, 0)
    out = []
    for level, (n, rows) in enumerate(levels):
        engine.logit_rows = np.asarray(rows, dtype=np.int16)
        engine.logits = engine.logit_rows[0]
        timing = TreeTiming(width, level, 0, 0, len(rows), h["sample"])
        cycles, _ = model.instruction(Instruction(Op.SAMPLE, n=n), topk=h["topk"], tree=timing)
        try:
            records = engine.sample(n, h, level)
        except EngineFault as fault:
            assert fault.code == ErrorCode.PROGRAM
            out.append((None, None, cycles))
            break
        nodes = [(r, 0 if level == 0 else rec.parent - (level - 1) * width, rec.token)
                 for r, rec in enumerate(records)]
        out.append(([w for rec in records for w in rec.record(cfg.topk_max)], nodes, cycles))
    return out


async def write_logits(ctx, dut, rng, rows, lanes):
    """A LOGITS matmul of ``rows``: begin, then every row's tiles in order, the rows
    interleaved at random (padded lanes are junk on purpose)."""
    rows = np.asarray(rows)
    ctx.set(dut.begin, 1)
    ctx.set(dut.begin_n, rows.shape[1])
    ctx.set(dut.begin_rows, rows.shape[0])
    await ctx.tick()
    ctx.set(dut.begin, 0)
    tiles = -(-rows.shape[1] // lanes)
    padded = np.concatenate([rows, rng.integers(-32768, 32768, (rows.shape[0], tiles * lanes - rows.shape[1]))], 1)
    order = rng.permutation(np.repeat(np.arange(rows.shape[0]), tiles))
    sent = [0] * rows.shape[0]
    for r in order:
        t = sent[r]
        sent[r] += 1
        await stream_put(ctx, dut.logits, {"data": [int(v) for v in padded[r, t * lanes:(t + 1) * lanes]],
                                           "row": int(r)})


async def run_sample(ctx, dut, request):
    """One SAMPLE as the controller runs it: the request (its cycle is the first counted),
    then the record words, always taken, until the final one or ``error``. Returns (words,
    nodes, cycles charged: FETCH + DECODE, these cycles, RETIRE; or None, None, cycles on
    error, where the controller faults in the cycle that sees it)."""
    await stream_put(ctx, dut.req, request)
    ctx.set(dut.record.ready, 1)
    words, nodes, cycles = [], [], 1
    while True:
        if ctx.get(dut.error):
            return None, None, ISSUE + cycles + 1
        valid, rec = ctx.get(dut.record.valid), ctx.get(dut.record.payload)
        if ctx.get(dut.expansion.valid):
            node = ctx.get(dut.expansion.payload)
            nodes.append((node.row, node.source, node.token))
        await ctx.tick()
        cycles += 1
        if valid:
            words.append(rec.word)
            if rec.final:
                ctx.set(dut.record.ready, 0)
                return words, nodes, ISSUE + cycles + RETIRE


@pytest.mark.parametrize("rows, topk_max, trees", [(TINY.rows, TINY.topk_max, 100), (4, 5, 60)])
def test_tree_levels_match_the_models(rows, topk_max, trees):
    """Whole trees, level after level (the path scores live in the unit), greedy and
    sampled, ties, short levels (PROGRAM): records, nodes and cycles."""
    cfg = TINY.with_changes(rows=rows, topk_max=topk_max)
    rng = np.random.default_rng(7 * rows + topk_max)
    cases = [random_tree(rng, cfg) for _ in range(trees)]
    want = [tree_reference(cfg, *case) for case in cases]
    assert any(w[-1][0] is None for w in want) and sum(len(w) for w in want) > trees
    dut = SampleSequencer(cfg)
    got = []

    async def tb(ctx):
        for (h, width, levels), expected in zip(cases, want):
            ctx.set(dut.clear, 1)            # a new request
            await ctx.tick()
            ctx.set(dut.clear, 0)
            tree = []
            for level, (n, rows) in enumerate(levels[:len(expected)]):
                await write_logits(ctx, dut, rng, rows, cfg.lanes)
                tree.append(await run_sample(ctx, dut, {
                    "k": h["topk"], "t_mult": h["t_mult"], "t_shift": h["t_shift"],
                    "sample": int(h["sample"]), "seed": h["seed"], "counter": h["counter"],
                    "n_drafted": level, "tree_width": width}))
            got.append(tree)

    run_simulation(dut, tb, watchdog(2_000_000, lambda: len(got) == len(cases)))
    for i, (g, w) in enumerate(zip(got, want)):
        assert g == w, f"tree {i}: {cases[i][0]}, W={cases[i][1]}"


def test_chain_cycles_match_the_model():
    """A chain SAMPLE, counted as the controller does, is the cycle model's SAMPLE."""
    rng = np.random.default_rng(11)
    cases = [random_case(rng) for _ in range(12)]
    engine, model = FunctionalEngine(TINY), CycleModel(TINY)
    want = [(reference(engine, logits, h, index)[0], model.instruction(
        Instruction(Op.SAMPLE, n=len(logits)), topk=h["topk"])[0]) for logits, h, index in cases]
    dut = SampleSequencer(TINY)
    got = []

    async def tb(ctx):
        for logits, h, index in cases:
            await write_logits(ctx, dut, rng, [logits], TINY.lanes)
            words, nodes, cycles = await run_sample(ctx, dut, {
                "k": h["topk"], "t_mult": h["t_mult"], "t_shift": h["t_shift"], "sample": int(h["sample"]),
                "seed": h["seed"], "counter": h["counter"], "n_drafted": index})
            assert nodes == []
            got.append((words, cycles))

    run_simulation(dut, tb, watchdog(100_000, lambda: len(got) == len(cases)))
    assert got == want


def test_lint_clean():
    clean, output = verilator_lint(to_verilog(SampleSequencer(TINY), "sample_unit"), "sample_unit")
    assert clean, output
