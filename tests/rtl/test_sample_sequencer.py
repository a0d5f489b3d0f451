"""Logit buffer + sampler RTL against the functional model's SAMPLE: the record words of
every drafted token, bit for bit (FunctionalEngine._sample and DraftedToken.record)."""

from __future__ import annotations

import numpy as np

from dfvg_hw.spec import numerics as nx
from dfvg_hw.spec.config import get_preset
from dfvg_hw.sample_sequencer import SampleSequencer
from sim.functional import FunctionalEngine
from dfvg_hw.verilog import to_verilog
from sim.lint import verilator_lint
from sim.testbench import run_simulation, stream_get, stream_put, watchdog

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


def test_lint_clean():
    clean, output = verilator_lint(to_verilog(SampleSequencer(TINY), "sample_unit"), "sample_unit")
    assert clean, output
