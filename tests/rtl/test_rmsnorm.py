"""RMSNorm and rsqrt RTL against numerics.rmsnorm / rsqrt_fixed, bit for bit."""

import numpy as np
import pytest

from dfvg_hw.spec import numerics as nx
from dfvg_hw.spec.config import get_preset
from dfvg_hw.rmsnorm import RMSNorm, Rsqrt, sumsq_bits
from sim import lint as rtl_lint
from dfvg_hw.verilog import to_verilog
from sim.lint import verilator_lint
from sim.testbench import first_valid_after_accept, run_simulation, stream_get, stream_put, stream_through

TINY = get_preset("tiny")
CONFIGS = [TINY, TINY.with_changes(name="tiny-l8", lanes=8)]
IDS = [f"lanes{c.lanes}" for c in CONFIGS]


def ints(v):
    return [int(x) for x in v]


# -- rsqrt ------------------------------------------------------------------------------
@pytest.mark.parametrize("bits", [42, 62])
def test_rsqrt_random_and_edges(bits):
    rng = np.random.default_rng(bits)
    e = rng.integers(0, bits, 1200)
    s = np.array([int(rng.integers(1 << int(k), 1 << (int(k) + 1))) for k in e], dtype=np.int64)
    edges = [0, 1, 2, 3, 4, 255, 256, 257, 1023, 1024, 1025, (1 << bits) - 1, 1 << (bits - 1),
             (1 << (bits - 2)) + 1, 0x5555_5555 & ((1 << bits) - 1)]
    s[:len(edges)] = edges
    got = [(p.r, p.k) for p in stream_through(Rsqrt(bits), [int(v) for v in s], ready=(1, 0, 1))]
    r, k = nx.rsqrt_fixed(s)
    np.testing.assert_array_equal(np.array(got), np.stack([r, k], axis=1))


def test_rsqrt_latency():
    dut = Rsqrt(42)
    assert first_valid_after_accept(dut, dut.i, dut.o, 12345) == Rsqrt.LATENCY == 4


# -- RMSNorm ---------------------------------------------------------------------------
def simulate_rows(dut, rows, ready=(1, 1, 0, 1)):
    """rows: list of (x, gamma, gamma_shift, eps, wide). Returns the rows the RTL wrote."""
    lanes = dut.lanes
    got = []

    def beats(x, gamma, with_gamma):
        pad = -len(x) % lanes
        x = np.concatenate([x, np.zeros(pad, np.int64)])
        g = np.concatenate([gamma, np.zeros(pad, np.int64)])
        nb = len(x) // lanes
        return [{"x": ints(x[b * lanes:(b + 1) * lanes]),
                 "gamma": ints(g[b * lanes:(b + 1) * lanes]) if with_gamma else [0] * lanes,
                 "last": int(b == nb - 1)} for b in range(nb)]

    async def put(ctx):
        for x, gamma, gs, eps, wide in rows:
            ctx.set(dut.eps, int(eps))
            ctx.set(dut.gamma_shift, int(gs))
            ctx.set(dut.wide, int(wide))
            for beat in beats(x, gamma, False):
                await stream_put(ctx, dut.i, beat)
            for beat in beats(x, gamma, True):
                await stream_put(ctx, dut.i, beat)

    async def get(ctx):
        k = 0
        for x, *_ in rows:
            out, nb = [], -(-len(x) // lanes)
            for b in range(nb):
                if not ready[k % len(ready)]:
                    await ctx.tick()
                k += 1
                p = await stream_get(ctx, dut.o)
                assert p.last == (b == nb - 1)
                out += list(p.y)
            got.append(np.array(out[:len(x)]))

    run_simulation(dut, put, get)
    return got


def random_rows(rng, count, lo=16, hi=64):
    rows = []
    for _ in range(count):
        n = int(rng.integers(lo, hi + 1))
        mag = 1 << int(rng.integers(4, 16))
        x = rng.integers(-mag, mag, n)
        gs = int(rng.integers(0, nx.GAMMA_SHIFT_MAX + 1))
        gamma = rng.integers(-2 ** 15, 2 ** 15, n)
        eps = int(rng.integers(0, 2 ** 32)) if rng.random() < 0.5 else int(rng.integers(0, 1000))
        rows.append((x, gamma, gs, eps, bool(rng.random() < 0.5)))
    return rows


def edge_rows(n):
    """The edge rows, each once as int8 and once as wide (int16) output."""
    return [row + (wide,) for wide in (False, True) for row in _edge_rows(n)]


def _edge_rows(n):
    full = np.full(n, -32768)
    ramp = np.arange(n) * 2047 - 32768
    return [
        (np.zeros(n, np.int64), np.full(n, 1000), 4, 12345),        # zero row, eps > 0
        (np.zeros(n, np.int64), np.full(n, 1000), 4, 0),            # zero row, eps = 0: rsqrt(0)
        (np.zeros(n, np.int64), np.full(n, -32768), nx.GAMMA_SHIFT_MAX, 0),
        (np.zeros(n, np.int64), np.full(n, 32767), 0, 2 ** 32 - 1),  # zero row, largest eps
        (np.full(n, 1234), np.full(n, 20000), 8, 0),                # all equal
        (full, full, 0, 0),                                          # +saturation
        (full, -full - 1, 0, 0),                                     # -saturation
        (np.full(n, 32767), np.full(n, 32767), nx.GAMMA_SHIFT_MAX, 2 ** 32 - 1),  # largest shift
        (ramp, np.full(n, -32768), 0, 2 ** 32 - 1),
        (np.array([1] + [0] * (n - 1)), np.full(n, 32767), 0, 0),   # one nonzero: smallest Σx²
    ]


def check(rows, got):
    for (x, gamma, gs, eps, wide), y in zip(rows, got):
        np.testing.assert_array_equal(y, nx.rmsnorm(x, gamma, gs, eps, 16 if wide else 8))
        if not np.any(x):
            assert not np.any(y)                                     # a zero row, any eps


@pytest.mark.parametrize("cfg", CONFIGS, ids=IDS)
def test_rmsnorm_random_rows(cfg):
    """≥ 1000 elements over rows of 16–64 (some not a multiple of lanes) plus edge rows."""
    rng = np.random.default_rng(cfg.lanes)
    rows = edge_rows(24) + random_rows(rng, 30)
    assert sum(len(r[0]) for r in rows) >= 1000
    got = simulate_rows(RMSNorm(cfg), rows)
    check(rows, got)
    for wide, (lo, hi) in ((False, (-128, 127)), (True, (-32768, 32767))):
        y = np.concatenate([g for g, r in zip(got, rows) if r[4] == wide])
        assert (y == hi).any() and (y == lo).any()


def test_rmsnorm_short_rows_and_wide_accumulator():
    """Rows shorter than one beat, and a long row that needs the full accumulator."""
    rng = np.random.default_rng(5)
    rows = [(rng.integers(-2 ** 15, 2 ** 15, n), rng.integers(-2 ** 15, 2 ** 15, n), 3, 7, n % 2)
            for n in (1, 2, 3, 5)]
    rows.append((np.full(256, -32768), rng.integers(-2 ** 15, 2 ** 15, 256), 16, 2 ** 32 - 1, 1))
    dut = RMSNorm(TINY, max_len=256)
    assert dut.acc_bits == sumsq_bits(256) == 39
    check(rows, simulate_rows(dut, rows, ready=(1,)))


def test_rmsnorm_timing():
    """Pass-1 last beat → first pass-2 accept is TURNAROUND; pass-2 beat → output is LATENCY."""
    dut = RMSNorm(TINY)
    times = {}

    async def tb(ctx):
        ctx.set(dut.o.ready, 1)
        ctx.set(dut.eps, 1)
        beat = {"x": [3, 4, 0, 0], "gamma": [100, 100, 0, 0], "last": 1}
        ctx.set(dut.i.payload, beat)
        ctx.set(dut.i.valid, 1)
        await ctx.tick().until(dut.i.ready)                          # pass 1 (one beat)
        assert ctx.get(dut.busy)
        n = 1
        while not ctx.get(dut.i.ready):
            await ctx.tick()
            n += 1
        times["turnaround"] = n
        await ctx.tick()                                             # pass 2 accepted
        ctx.set(dut.i.valid, 0)
        n = 1
        while not ctx.get(dut.o.valid):
            await ctx.tick()
            n += 1
        times["latency"] = n
        assert not ctx.get(dut.busy)

    run_simulation(dut, tb)
    assert times == {"turnaround": dut.TURNAROUND, "latency": RMSNorm.LATENCY}
    assert dut.TURNAROUND == 2 + 2 + 4 and RMSNorm.LATENCY == 4


def test_rmsnorm_row_cycles():
    """A row of b beats, streamed back to back, takes 2·b + TURNAROUND − 1 + LATENCY edges."""
    dut, lanes, nb = RMSNorm(TINY), 4, 8
    rng = np.random.default_rng(9)
    x = rng.integers(-3000, 3000, lanes * nb)
    count = []

    async def tb(ctx):
        ctx.set(dut.o.ready, 1)
        ctx.set(dut.eps, 0)
        ctx.set(dut.gamma_shift, 0)
        t, sent, outs = 0, 0, 0
        while outs < nb:
            if sent < 2 * nb:
                b = sent % nb
                ctx.set(dut.i.valid, 1)
                ctx.set(dut.i.payload, {"x": ints(x[b * lanes:(b + 1) * lanes]),
                                        "gamma": [1] * lanes, "last": int(b == nb - 1)})
            else:
                ctx.set(dut.i.valid, 0)
            *_, ready, ovalid = await ctx.tick().sample(dut.i.ready, dut.o.valid)
            t += 1
            sent += int(ready and sent < 2 * nb)
            outs += int(ovalid)
        count.append(t)

    run_simulation(dut, tb)
    # last output sampled one edge after it became valid
    assert count[0] == 2 * nb + dut.TURNAROUND - 1 + RMSNorm.LATENCY


@pytest.mark.parametrize("make", [lambda: Rsqrt(42), lambda: RMSNorm(TINY)], ids=["rsqrt", "rmsnorm"])
def test_lint_clean(make, monkeypatch):
    monkeypatch.setitem(rtl_lint.VERILATOR_WAIVERS, "DECLFILENAME",
                        "Amaranth emits every submodule into the top module's file")
    dut = make()
    name = type(dut).__name__.lower()
    clean, output = verilator_lint(to_verilog(dut, name), name)
    assert clean, output
