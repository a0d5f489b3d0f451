"""RMSNorm and rsqrt RTL against numerics.rmsnorm / rsqrt_fixed, bit for bit: int32 rows
of every magnitude (norm_input_shift), and a wrong design the comparison must catch."""

import numpy as np
import pytest
from amaranth import Mux

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
    """rows: list of (x, gamma, gamma_shift, eps, wide). Streams each row three times (pass
    0, 1, 2) and returns the rows the RTL wrote; ``o.ready`` follows the ``ready`` pattern.
    One process drives and samples both streams, a cycle per await (the simulator's
    per-process cost dominates a 1000-row run)."""
    lanes = dut.lanes
    beats, params, out_counts = [], [], []
    for x, gamma, gs, eps, wide in rows:
        pad = -len(x) % lanes
        xp = np.concatenate([np.asarray(x, np.int64), np.zeros(pad, np.int64)])
        gp = np.concatenate([np.asarray(gamma, np.int64), np.zeros(pad, np.int64)])
        nb = len(xp) // lanes
        out_counts.append(nb)
        for with_gamma in (False, False, True):
            for b in range(nb):
                beats.append({"x": ints(xp[b * lanes:(b + 1) * lanes]),
                              "gamma": ints(gp[b * lanes:(b + 1) * lanes]) if with_gamma
                              else [0] * lanes, "last": int(b == nb - 1)})
                params.append((int(eps), int(gs), int(wide)))
    ends = np.cumsum(out_counts)
    outs = []

    async def tb(ctx):
        sent, t = 0, 0
        while len(outs) < ends[-1]:
            if sent < len(beats):
                eps, gs, wide = params[sent]
                ctx.set(dut.eps, eps)
                ctx.set(dut.gamma_shift, gs)
                ctx.set(dut.wide, wide)
                ctx.set(dut.i.payload, beats[sent])
            ctx.set(dut.i.valid, sent < len(beats))
            ctx.set(dut.o.ready, ready[t % len(ready)])
            t += 1
            *_, i_ready, o_valid, o_ready, o_payload = await ctx.tick().sample(
                dut.i.ready, dut.o.valid, dut.o.ready, dut.o.payload)
            if i_ready and sent < len(beats):
                sent += 1
            if o_valid and o_ready:
                outs.append((list(o_payload.y), o_payload.last))

    run_simulation(dut, tb)
    got, k = [], 0
    for (x, *_), nb in zip(rows, out_counts):
        row = outs[k:k + nb]
        assert [last for _, last in row] == [0] * (nb - 1) + [1]
        got.append(np.array(sum((y for y, _ in row), []))[:len(x)])
        k += nb
    return got


def random_rows(rng, count, lo=16, hi=64):
    """int16-range rows (the datapath after a shift of 0) of 16–64 elements."""
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


def magnitude_rows(rng, count, hi=12):
    """Short int32 rows of wildly different magnitudes: each row's elements are random
    with a random bit width 0 … 32 (so p runs over 0 … 16), a quarter of the rows with one
    massive channel far above the rest; eps anywhere in u32."""
    rows = []
    for _ in range(count):
        n = int(rng.integers(1, hi + 1))
        bits = int(rng.integers(0, 33))
        x = rng.integers(-(1 << bits) // 2 if bits else 0, ((1 << bits) // 2 if bits else 0) + 1, n)
        x = np.clip(x, -2 ** 31, 2 ** 31 - 1)
        if rng.random() < 0.25:                                  # a massive-activation channel
            x[int(rng.integers(n))] = int(rng.choice([-1, 1])) * int(rng.integers(1 << 20, 1 << 31))
        gs = int(rng.integers(0, nx.GAMMA_SHIFT_MAX + 1))
        gamma = rng.integers(-2 ** 15, 2 ** 15, n)
        eps = int(rng.integers(0, 2 ** 32)) >> int(rng.integers(0, 33))
        rows.append((x, gamma, gs, eps, bool(rng.random() < 0.5)))
    return rows


def edge_rows(n):
    """The edge rows, each once as int8 and once as wide (int16) output."""
    return [row + (wide,) for wide in (False, True) for row in _edge_rows(n)]


def _edge_rows(n):
    full = np.full(n, -32768)
    ramp = np.arange(n) * 2047 - 32768
    lo32, hi32 = -2 ** 31, 2 ** 31 - 1
    one_hot = lambda v: np.array([v] + [0] * (n - 1))            # noqa: E731
    return [
        (np.zeros(n, np.int64), np.full(n, 1000), 4, 12345),        # zero row, eps > 0
        (np.zeros(n, np.int64), np.full(n, 1000), 4, 0),            # zero row, eps = 0: rsqrt(0)
        (np.zeros(n, np.int64), np.full(n, -32768), nx.GAMMA_SHIFT_MAX, 0),
        (np.zeros(n, np.int64), np.full(n, 32767), 0, 2 ** 32 - 1),  # zero row, largest eps
        (np.full(n, 1234), np.full(n, 20000), 8, 0),                # all equal
        (full, full, 0, 0),                                          # +saturation, p = 0
        (full, -full - 1, 0, 0),                                     # -saturation, p = 0
        (np.full(n, 32767), np.full(n, 32767), nx.GAMMA_SHIFT_MAX, 2 ** 32 - 1),  # p = 0
        (ramp, np.full(n, -32768), 0, 2 ** 32 - 1),
        (one_hot(1), np.full(n, 32767), 0, 0),                       # smallest Σx²
        (one_hot(2 ** 15), np.full(n, 32767), 3, 2 ** 32 - 1),       # 2^15: p = 1
        (one_hot(-2 ** 15 - 1), np.full(n, -32768), 0, 3),           # -2^15 - 1: p = 1
        (np.full(n, lo32), np.full(n, 32767), 0, 2 ** 32 - 1),       # -2^31: p = 16
        (np.full(n, hi32), np.full(n, -32768), 0, 0),                # 2^31 - 1: p = 16
        (np.array([lo32, hi32] * n)[:n], np.full(n, 32767), 5, 7),   # both extremes
        (np.array([hi32] + [1] * (n - 1)), np.full(n, 32767), 16, 0),  # the small ones vanish
        (np.array([-25_800 << 12] + [300] * (n - 1)), np.full(n, 20000), 9, 2 ** 20),  # massive
    ]


def check(rows, got):
    for (x, gamma, gs, eps, wide), y in zip(rows, got):
        np.testing.assert_array_equal(y, nx.rmsnorm(x, gamma, gs, eps, 16 if wide else 8))
        if not np.any(x):
            assert not np.any(y)                                     # a zero row, any eps


def test_edge_rows_cover_every_shift_edge():
    """The edge rows need p = 0, 1 and the largest shift, 16 (an int32 row never needs more)."""
    shifts = {int(nx.norm_input_shift(np.asarray(r[0]))[0]) for r in edge_rows(8)}
    assert {0, 1, nx.RES_BITS - nx.NORM_IN_BITS} <= shifts
    assert max(shifts) == 16


@pytest.mark.parametrize("cfg", CONFIGS, ids=IDS)
def test_rmsnorm_random_rows(cfg):
    """int16-range rows of 16–64 (some not a multiple of lanes) plus edge rows."""
    rng = np.random.default_rng(cfg.lanes)
    rows = edge_rows(24) + random_rows(rng, 12)
    got = simulate_rows(RMSNorm(cfg), rows)
    check(rows, got)
    for wide, (lo, hi) in ((False, (-128, 127)), (True, (-32768, 32767))):
        y = np.concatenate([g for g, r in zip(got, rows) if r[4] == wide])
        assert (y == hi).any() and (y == lo).any()


def test_rmsnorm_rows_of_every_magnitude():
    """Short int32 rows of random bit widths 0 … 32 (every shift 0 … 16), over 1000
    elements, and the edge rows, in one simulation (about 9 s of CPU: the Amaranth
    simulator takes ~1 k cycles a second on this unit, so 1000 whole rows would cost 25 s)."""
    rng = np.random.default_rng(13)
    rows = edge_rows(5) + magnitude_rows(rng, 300)
    shifts = [int(nx.norm_input_shift(np.asarray(r[0]))[0]) for r in rows]
    assert set(shifts) == set(range(17))
    assert sum(len(r[0]) for r in rows) >= 1000
    check(rows, simulate_rows(RMSNorm(TINY), rows, ready=(1, 1, 1, 0)))


class _ShiftOneShort(RMSNorm):
    """A wrong design: cuts the row by p − 1 (its int16 squares then wrap)."""

    def shift_of(self, m, mag):
        p = super().shift_of(m, mag)
        return Mux(p > 0, p - 1, 0)


def test_the_comparison_catches_a_shift_one_short():
    """The same check fails on a design that shifts by p − 1."""
    rows = [row for row in edge_rows(4) if nx.norm_input_shift(np.asarray(row[0]))[0] >= 1]
    rows += magnitude_rows(np.random.default_rng(14), 20)
    with pytest.raises(AssertionError):
        check(rows, simulate_rows(_ShiftOneShort(TINY), rows, ready=(1,)))


def test_rmsnorm_short_rows_and_wide_accumulator():
    """Rows shorter than one beat, and a long row that needs the full accumulator."""
    rng = np.random.default_rng(5)
    rows = [(rng.integers(-2 ** 31, 2 ** 31, n), rng.integers(-2 ** 15, 2 ** 15, n), 3, 7, n % 2)
            for n in (1, 2, 3, 5)]
    rows.append((np.full(256, -32768), rng.integers(-2 ** 15, 2 ** 15, 256), 16, 2 ** 32 - 1, 1))
    dut = RMSNorm(TINY, max_len=256)
    assert dut.acc_bits == sumsq_bits(256) == 39
    check(rows, simulate_rows(dut, rows, ready=(1,)))


def test_rmsnorm_timing():
    """Pass-0 last beat → first pass-1 accept is SHIFT_TURNAROUND; pass-1 last beat → first
    pass-2 accept is TURNAROUND; pass-2 beat → output is LATENCY."""
    dut = RMSNorm(TINY)
    times = {}

    async def wait_ready(ctx):
        n = 1
        while not ctx.get(dut.i.ready):
            await ctx.tick()
            n += 1
        return n

    async def tb(ctx):
        ctx.set(dut.o.ready, 1)
        ctx.set(dut.eps, 1)
        beat = {"x": [3 << 20, 4, 0, 0], "gamma": [100, 100, 0, 0], "last": 1}
        ctx.set(dut.i.payload, beat)
        ctx.set(dut.i.valid, 1)
        await ctx.tick().until(dut.i.ready)                          # pass 0 (one beat)
        assert ctx.get(dut.busy)
        times["shift"] = await wait_ready(ctx)
        await ctx.tick()                                             # pass 1 accepted
        times["turnaround"] = await wait_ready(ctx)
        await ctx.tick()                                             # pass 2 accepted
        ctx.set(dut.i.valid, 0)
        n = 1
        while not ctx.get(dut.o.valid):
            await ctx.tick()
            n += 1
        times["latency"] = n
        assert not ctx.get(dut.busy)

    run_simulation(dut, tb)
    assert times == {"shift": RMSNorm.SHIFT_TURNAROUND, "turnaround": dut.TURNAROUND,
                     "latency": RMSNorm.LATENCY}
    assert (RMSNorm.SHIFT_TURNAROUND, dut.TURNAROUND, RMSNorm.LATENCY) == (2, 3 + 2 + 4, 5)


def test_rmsnorm_row_cycles():
    """A row of b beats, streamed back to back, takes
    3·b + SHIFT_TURNAROUND − 1 + TURNAROUND − 1 + LATENCY edges."""
    dut, lanes, nb = RMSNorm(TINY), 4, 8
    rng = np.random.default_rng(9)
    x = rng.integers(-3000 << 10, 3000 << 10, lanes * nb)
    count = []

    async def tb(ctx):
        ctx.set(dut.o.ready, 1)
        ctx.set(dut.eps, 0)
        ctx.set(dut.gamma_shift, 0)
        t, sent, outs = 0, 0, 0
        while outs < nb:
            if sent < 3 * nb:
                b = sent % nb
                ctx.set(dut.i.valid, 1)
                ctx.set(dut.i.payload, {"x": ints(x[b * lanes:(b + 1) * lanes]),
                                        "gamma": [1] * lanes, "last": int(b == nb - 1)})
            else:
                ctx.set(dut.i.valid, 0)
            *_, ready, ovalid = await ctx.tick().sample(dut.i.ready, dut.o.valid)
            t += 1
            sent += int(ready and sent < 3 * nb)
            outs += int(ovalid)
        count.append(t)

    run_simulation(dut, tb)
    # last output sampled one edge after it became valid
    assert count[0] == (3 * nb + RMSNorm.SHIFT_TURNAROUND - 1 + dut.TURNAROUND - 1
                        + RMSNorm.LATENCY)


@pytest.mark.parametrize("make", [lambda: Rsqrt(42), lambda: RMSNorm(TINY)], ids=["rsqrt", "rmsnorm"])
def test_lint_clean(make, monkeypatch):
    monkeypatch.setitem(rtl_lint.VERILATOR_WAIVERS, "DECLFILENAME",
                        "Amaranth emits every submodule into the top module's file")
    dut = make()
    name = type(dut).__name__.lower()
    clean, output = verilator_lint(to_verilog(dut, name), name)
    assert clean, output
