"""Token sampler RTL against the numerics (topk_select, sampler_probs, rng32, sample_index).

The reference mirrors the functional model's ``SAMPLE`` (sim/functional.py ``_sample``):
``k = min(topk, n)``, ``(T1_MULT, T1_SHIFT)`` when ``t_mult = 0``, a draw
``rng32(seed, counter) >> 8`` only in sample mode. Every comparison is bit for bit: token,
its probability, its rank, k, and the whole top-k list of ids and probabilities.
"""

import numpy as np
import pytest

from dfvg_hw.spec import numerics as nx
from dfvg_hw.spec.config import get_preset
from dfvg_hw.token_sampler import Rng32, TokenSampler
from dfvg_hw.verilog import to_verilog
from sim.lint import verilator_lint
from sim.testbench import run_simulation, stream_get, stream_put

TINY = get_preset("tiny")


# -- reference -------------------------------------------------------------------------
def reference(logits, *, k, t_mult, t_shift, sample, seed, counter, topk_max):
    logits = np.asarray(logits, dtype=np.int64)
    k = min(k, logits.shape[0])
    top = nx.topk_select(logits, k)
    tm, ts = (t_mult, t_shift) if t_mult else (nx.T1_MULT, nx.T1_SHIFT)
    probs = nx.sampler_probs(logits[top], tm, ts)
    j = 0
    if sample:
        j = nx.sample_index(probs, nx.rng32(seed, counter) >> (32 - nx.PROB_BITS))
    pad = topk_max - k
    return {"token": int(top[j]), "prob": int(probs[j]), "rank": j, "k": k,
            "ids": [int(t) for t in top] + [0] * pad, "probs": [int(p) for p in probs] + [0] * pad}


def unpack(res, topk_max):
    return {"token": int(res.token), "prob": int(res.prob), "rank": int(res.rank), "k": int(res.k),
            "ids": [int(res.ids[i]) for i in range(topk_max)],
            "probs": [int(res.probs[i]) for i in range(topk_max)]}


# -- stimulus --------------------------------------------------------------------------
def random_logits(rng, n):
    kind = rng.integers(0, 5)
    if kind == 0:                               # few distinct values: many ties
        return rng.integers(-3, 3, n) * int(rng.choice([1, 64, 256]))
    if kind == 1:                               # full int16 range, saturated ends included
        x = rng.integers(-2 ** 15, 2 ** 15, n)
        x[rng.random(n) < 0.2] = rng.choice([-2 ** 15, 2 ** 15 - 1])
        return x
    if kind == 2:                               # realistic: a few nats of spread
        return np.clip(np.round(rng.normal(0, 3 * 256, n)), -2 ** 15, 2 ** 15 - 1).astype(np.int64)
    if kind == 3:                               # a clear winner among near-equal values
        x = rng.integers(-40, 40, n)
        x[rng.integers(0, n)] += int(rng.integers(0, 2000))
        return x
    return np.full(n, int(rng.integers(-2 ** 15, 2 ** 15)))   # all equal


def random_request(rng, topk_max):
    kind = rng.integers(0, 4)
    if kind == 0:
        t_mult, t_shift = 0, int(rng.integers(0, 64))            # T = 1 substitution
    elif kind == 1:
        t_mult, t_shift = nx.host_temperature(float(np.exp(rng.uniform(np.log(0.05), np.log(20)))))
    elif kind == 2:
        t_mult, t_shift = int(rng.integers(1, 2 ** 16)), int(rng.integers(0, 64))
    else:
        t_mult, t_shift = int(rng.integers(1, 2 ** 16)), int(rng.integers(10, 24))
    return {"k": int(rng.integers(1, topk_max + 1)), "t_mult": t_mult, "t_shift": t_shift,
            "sample": int(rng.random() < 0.7), "seed": int(rng.integers(0, 2 ** 63)) * 2 + int(rng.integers(0, 2)),
            "counter": int(rng.integers(0, 2 ** 32))}


def beats_of(rng, logits, lanes, ragged):
    """Split a vector into (data, count, last) beats; ragged adds partial and empty beats."""
    out, i, n = [], 0, len(logits)
    while i < n:
        c = lanes
        if ragged and rng.random() < 0.3:
            c = int(rng.integers(0, lanes + 1))
        c = min(c, n - i)
        data = [int(v) for v in rng.integers(-2 ** 15, 2 ** 15, lanes)]   # junk beyond count
        data[:c] = [int(v) for v in logits[i:i + c]]
        out.append((data, c, 0))
        i += c
    if ragged and rng.random() < 0.2:
        out.append(([0] * lanes, 0, 0))
    data, c, _ = out[-1]
    out[-1] = (data, c, 1)
    return out


def simulate(dut, jobs, *, rng, ragged=True, backpressure=True):
    """Run every (logits, request) job through one simulation; return the results."""
    got = []

    async def produce(ctx):
        for logits, req in jobs:
            beats = beats_of(rng, logits, dut.lanes, ragged)
            where = int(rng.integers(0, len(beats) + 1))   # request before, during or after
            for b in range(len(beats) + 1):
                if b == where:
                    await stream_put(ctx, dut.req, req)
                if b < len(beats):
                    data, count, last = beats[b]
                    await stream_put(ctx, dut.logits, {"data": data, "count": count, "last": last})

    async def consume(ctx):
        for _ in jobs:
            if backpressure:
                for _ in range(int(rng.integers(0, 3))):
                    await ctx.tick()
            got.append(unpack(await stream_get(ctx, dut.o), dut.topk_max))

    run_simulation(dut, produce, consume)
    return got


def check(got, jobs, topk_max):
    assert len(got) == len(jobs)
    for i, ((logits, req), res) in enumerate(zip(jobs, got)):
        ref = reference(logits, topk_max=topk_max, **req)
        assert res == ref, f"vector {i}: logits={list(logits)} req={req}\n got {res}\n ref {ref}"


def _unxorshift(y, s):
    x = y
    for _ in range(32 // s + 1):
        x = y ^ (x >> s)
    return x


def _mix32_inverse(y):
    m = 0xFFFFFFFF
    y = _unxorshift(y, 15)
    y = (y * pow(0x735A2D97, -1, 1 << 32)) & m
    y = _unxorshift(y, 15)
    y = (y * pow(0x21F0AAAD, -1, 1 << 32)) & m
    return _unxorshift(y, 16)


def counter_for(seed, word):
    """The counter with ``rng32(seed, counter) == word`` (rng32 is a bijection of counters)."""
    c = (_mix32_inverse(_mix32_inverse(word) ^ (seed >> 32)) - (seed & 0xFFFFFFFF)) & 0xFFFFFFFF
    assert nx.rng32(seed, c) == word
    return c


# -- RNG -------------------------------------------------------------------------------
def test_rng32_random_vectors():
    rng = np.random.default_rng(32)
    n = 1200
    seeds = [int(s) for s in rng.integers(0, 2 ** 63, n) * 2 + rng.integers(0, 2, n)]
    counters = [int(c) for c in rng.integers(0, 2 ** 32, n)]
    seeds[:6] = [0, 0, 2 ** 64 - 1, 2 ** 32, 2 ** 32 - 1, 0x0123456789ABCDEF]
    counters[:6] = [0, 2 ** 32 - 1, 2 ** 32 - 1, 0, 1, 0xFFFFFFF0]   # wrap of counter + seed_lo
    dut, got = Rng32(), []

    async def put(ctx):
        for s, c in zip(seeds, counters):
            await stream_put(ctx, dut.i, {"seed": s, "counter": c})

    async def get(ctx):
        for i in range(n):
            if i % 7 in (3, 5):
                await ctx.tick()                     # backpressure
            got.append(int(await stream_get(ctx, dut.o)))

    run_simulation(dut, put, get)
    assert got[0] == 0                               # rng32(0, 0) = mix32(0) = 0
    assert got == [nx.rng32(s, c) for s, c in zip(seeds, counters)]


# -- randomised sampler ----------------------------------------------------------------
@pytest.mark.parametrize("topk_max, lanes, vectors", [
    (TINY.topk_max, TINY.lanes, 1000),   # the tiny preset as built: 4 lanes, top-4
    (8, 1, 200),                         # second top-k size, one logit per cycle (no merge)
    (8, 2, 200),                         # second top-k size, merged lane lists
    (16, 4, 100),                        # the Alveo presets' top-16
])
def test_random_vectors(topk_max, lanes, vectors):
    cfg = TINY.with_changes(topk_max=topk_max)
    rng = np.random.default_rng(1000 * topk_max + lanes)
    jobs = [(random_logits(rng, int(rng.integers(1, 65))), random_request(rng, topk_max))
            for _ in range(vectors)]
    dut = TokenSampler(cfg, lanes=lanes)
    check(simulate(dut, jobs, rng=rng), jobs, topk_max)


# -- edge cases ------------------------------------------------------------------------
def edge_jobs(topk_max):
    K = topk_max
    greedy = {"t_mult": 0, "t_shift": 0, "sample": 0, "seed": 0, "counter": 0}
    T1 = dict(zip(("t_mult", "t_shift"), nx.host_temperature(1.0)))
    jobs = []
    ramp = np.arange(24)
    for k in (1, K):
        jobs += [
            (np.array([5, 9, 9, 1, 9, 0]), {**greedy, "k": k}),             # argmax tie → index 1
            (np.full(17, 7), {**greedy, "k": k}),                             # all equal
            (np.full(17, 7), {**T1, "k": k, "sample": 1, "seed": 3, "counter": 9}),
            (np.full(9, -2 ** 15), {**greedy, "k": k}),                       # all saturated low
            (np.array([-2 ** 15, 2 ** 15 - 1, -2 ** 15, 2 ** 15 - 1]),      # saturated extremes
             {**T1, "k": k, "sample": 1, "seed": 1, "counter": 2}),
            (np.array([2 ** 15 - 1] + [-2 ** 15] * 10), {"k": k, "t_mult": 65535, "t_shift": 0,
                                                          "sample": 1, "seed": 5, "counter": 5}),
            (ramp, {**greedy, "k": k}),                                       # best is the last
            (ramp[::-1].copy(), {**greedy, "k": k}),                          # best is the first
        ]
    # vocabulary shorter than k (k = min(topk, n)), a single logit, 2 logits
    jobs += [(np.array([3, -4, 3][:n]), {**T1, "k": K, "sample": 1, "seed": 77, "counter": n})
             for n in (1, 2, 3)]
    # greedy vs sampled on the same vector and temperature: same probabilities, other token
    flat = np.array([10, 12, 11, 12, 9, 12, 8, 12, 10])
    for c in range(8):
        for s in (0, 1):
            jobs.append((flat, {"k": K, "t_mult": 47274, "t_shift": 13, "sample": s,
                                "seed": 0xDEADBEEF_0BADF00D, "counter": c}))
    # temperature shifts from sharp (0: one-hot) to flat (≥ 33: every u rounds to 0)
    jobs += [(flat, {"k": K, "t_mult": 65535, "t_shift": s, "sample": 1, "seed": 9, "counter": s})
             for s in (0, 31, 32, 33, 63)]
    # the largest gap (65535 · 65535 ≥ 2^31) around the shifts where rounding stops mattering
    sat = np.array([-2 ** 15, 2 ** 15 - 1, 0, 2 ** 15 - 1, -2 ** 15])
    jobs += [(sat, {"k": K, "t_mult": 65535, "t_shift": s, "sample": 1, "seed": 4, "counter": s})
             for s in (16, 31, 32, 33, 34, 63)]
    # a whole-vocabulary vector: the largest id, vocab_max − 1, wins
    full = np.random.default_rng(5).integers(-1000, 1000, TINY.vocab_max)
    full[-1], full[3] = 2001, 2000
    jobs.append((full, {**greedy, "k": K}))
    # counter + seed_lo wraps mod 2^32; seed_hi all ones
    jobs.append((flat, {"k": K, "t_mult": 0, "t_shift": 0, "sample": 1,
                        "seed": 2 ** 64 - 1, "counter": 2 ** 32 - 1}))
    return jobs


@pytest.mark.parametrize("topk_max, lanes", [(TINY.topk_max, TINY.lanes), (8, 1)])
def test_edge_cases(topk_max, lanes):
    jobs = edge_jobs(topk_max)
    rng = np.random.default_rng(7)
    got = simulate(TokenSampler(TINY.with_changes(topk_max=topk_max), lanes=lanes), jobs, rng=rng)
    check(got, jobs, topk_max)
    # spot checks of the intent, beyond bit-exactness
    assert got[0]["token"] == 1 and got[0]["prob"] == 1 << nx.PROB_BITS
    kk = min(topk_max, 6)
    assert got[8]["ids"][:kk] == [1, 2, 4, 0, 3, 5][:kk]               # ties: lower index first
    flat_runs = [g for g, (_, r) in zip(got, jobs) if r.get("seed") == 0xDEADBEEF_0BADF00D]
    greedy_runs, sampled_runs = flat_runs[0::2], flat_runs[1::2]
    assert all(g["token"] == 1 and g["rank"] == 0 for g in greedy_runs)
    assert all(s["probs"] == g["probs"] for s, g in zip(sampled_runs, greedy_runs))
    assert len({s["rank"] for s in sampled_runs}) > 1                  # draws do vary
    whole = [g for g, (logits, _) in zip(got, jobs) if len(logits) == TINY.vocab_max]
    assert [g["ids"][:2] for g in whole] == [[TINY.vocab_max - 1, 3]]


def test_request_clamps_and_empty_vector():
    """k = 0 is taken as 1 and k > topk_max as topk_max; an empty vector gives k = 0."""
    cfg = TINY.with_changes(topk_max=5)                  # k field is 3 bits: 6, 7 are > topk_max
    dut = TokenSampler(cfg, lanes=2)
    logits = np.array([4, 8, 1, 8, 3, 9, 2])
    base = {"t_mult": 0, "t_shift": 0, "sample": 0, "seed": 0, "counter": 0}
    got = []

    async def produce(ctx):
        for k in (0, 7):
            await stream_put(ctx, dut.req, {**base, "k": k})
            for i in range(0, len(logits), 2):
                chunk = [int(v) for v in logits[i:i + 2]]
                await stream_put(ctx, dut.logits, {"data": chunk + [0] * (2 - len(chunk)),
                                                   "count": len(chunk), "last": i + 2 >= len(logits)})
        await stream_put(ctx, dut.req, {**base, "k": 3})
        await stream_put(ctx, dut.logits, {"data": [1, 2], "count": 0, "last": 1})

    async def consume(ctx):
        for _ in range(3):
            got.append(unpack(await stream_get(ctx, dut.o), 5))

    run_simulation(dut, produce, consume)
    ref = lambda k: reference(logits, k=k, topk_max=5, **base)
    assert got[0] == ref(1) and got[1] == ref(5)
    assert got[2] == {"token": 0, "prob": 0, "rank": 0, "k": 0, "ids": [0] * 5, "probs": [0] * 5}


def test_draw_boundaries():
    """r24 exactly on, and one below, every cumulative probability; r24 = 0 and 2^24 − 1.

    The counter that gives a chosen draw is found by inverting rng32.
    """
    K = TINY.topk_max
    rng = np.random.default_rng(24)
    jobs = []
    for logits, t in [(np.array([300, 100, 250, 200, 50]), (47274, 15)),
                      (np.array([7, 7, 7, 7]), (47274, 15)),
                      (np.array([2 ** 15 - 1, -2 ** 15, 0, 2 ** 15 - 2]), (47274, 22)),
                      (rng.integers(-600, 600, 40), (47274, 14))]:
        seed = int(rng.integers(0, 2 ** 63)) * 2 + 1
        req = {"k": K, "t_mult": t[0], "t_shift": t[1], "sample": 1, "seed": seed}
        probs = reference(logits, counter=0, topk_max=K, **req)["probs"]
        cums = np.cumsum(probs)
        r24s = {0, (1 << nx.PROB_BITS) - 1} | {int(c) for c in cums if c < 1 << nx.PROB_BITS} \
            | {int(c) - 1 for c in cums if c > 0}
        for r24 in sorted(r24s):
            word = (r24 << 8) | int(rng.integers(0, 256))
            jobs.append((logits, {**req, "counter": counter_for(seed, word)}))
    got = simulate(TokenSampler(TINY), jobs, rng=rng)
    check(got, jobs, K)
    assert len({g["rank"] for g in got}) == K                 # every rank drawn at some boundary


# -- timing ----------------------------------------------------------------------------
@pytest.mark.parametrize("lanes", [1, TINY.lanes])
def test_latency_and_throughput(lanes):
    """Beats are taken one per cycle; the result follows after exactly ``latency()`` cycles."""
    dut = TokenSampler(TINY, lanes=lanes)
    cases = [(1, 16), (2, 16), (TINY.topk_max, 16), (TINY.topk_max, 2), (TINY.topk_max, 1)]
    measured = []

    async def bench(ctx):
        rng = np.random.default_rng(0)
        for k, n in cases:
            logits = rng.integers(-500, 500, n)
            await stream_put(ctx, dut.req, {"k": k, "t_mult": 0, "t_shift": 0, "sample": 1,
                                            "seed": 1, "counter": 2})
            beats = beats_of(rng, logits, lanes, ragged=False)
            ctx.set(dut.logits.valid, 1)
            for b, (data, count, last) in enumerate(beats):
                ctx.set(dut.logits.payload, {"data": data, "count": count, "last": last})
                assert ctx.get(dut.logits.ready), "the sampler stalled the logit stream"
                await ctx.tick()
            ctx.set(dut.logits.valid, 0)
            cycles = 0
            while not ctx.get(dut.o.valid):
                await ctx.tick()
                cycles += 1
            measured.append(cycles)
            ref = reference(logits, k=k, t_mult=0, t_shift=0, sample=1, seed=1, counter=2,
                            topk_max=TINY.topk_max)
            res = await stream_get(ctx, dut.o)
            assert unpack(res, TINY.topk_max) == ref

    run_simulation(dut, bench)
    assert measured == [dut.latency(k, n) for k, n in cases]
    # lanes·k merge + (k + 4) exp + 25 divide + (k + 1) probabilities + 1
    assert dut.latency(4) == (4 * lanes if lanes > 1 else 0) + 8 + 25 + 5 + 1


# -- lint ------------------------------------------------------------------------------
@pytest.mark.parametrize("lanes", [1, TINY.lanes])
def test_lint_clean(lanes):
    clean, output = verilator_lint(to_verilog(TokenSampler(TINY, lanes=lanes), "sampler"), "sampler")
    assert clean, output


def test_rng_lint_clean():
    clean, output = verilator_lint(to_verilog(Rng32(), "rng32"), "rng32")
    assert clean, output
