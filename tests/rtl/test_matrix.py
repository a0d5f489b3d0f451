"""Matrix unit RTL against numerics.requant / residual_add on random matmuls, bit for bit.

Every test streams whole MATMUL instructions the way the engine does: the weight bursts
come from ``image.tile_weights`` and the requant words and biases from
``image.pack_requant_records``, so the layouts are checked along with the arithmetic. The
reference is ``x @ W.T`` in int64 (``numerics.block_matmul`` for a ``BLOCKS`` matmul,
whose tiles carry random block multipliers, 0 and 65535 among them), the bias added
(``numerics.add_bias``, half the MATMULs have one), followed by the functional model's
numerics in each of the four modes.

A unit built without block multipliers (``weight_blocks=False``: no ``scale`` on its tiles,
no ``blocks`` in its parameters) runs the same plain matmuls to the same results.
"""

from __future__ import annotations

import re

import numpy as np
import pytest

from dfvg_hw.spec import numerics as nx
from dfvg_hw.spec.config import get_preset
from dfvg_hw.spec.image import pack_requant_records, padded, tile_weights
from dfvg_hw.spec.isa import MatmulMode
from dfvg_hw.matrix import MatrixUnit
from dfvg_hw.requant import Requantizer
from dfvg_hw.verilog import to_verilog
from sim.lint import verilator_lint
from sim.testbench import run_simulation, stream_get, stream_put, watchdog

TINY = get_preset("tiny")
CONFIGS = {
    "tiny": (TINY, True),                                        # M=2 (one packed pair), N=4, K=8
    "tiny-unpacked": (TINY, False),
    "m3n2k4": (TINY.with_changes(rows=3, lanes=2, reduce=4), True),   # a pair and an odd row
    "m5n8k4": (TINY.with_changes(rows=5, lanes=8, reduce=4), True),   # two pairs and an odd row
    # without block multipliers: plain matmuls only
    "tiny-no-blocks": (TINY.with_changes(weight_blocks=False), True),
    "m5n8k4-no-blocks": (TINY.with_changes(rows=5, lanes=8, reduce=4, weight_blocks=False), True),
}


class Matmul:
    """One MATMUL: operands, the streams the unit sees, and the expected output rows."""

    def __init__(self, rng, cfg, *, n, k, rows, mode, wide=False, extreme=False, bias=False,
                 blocks=False, exps=None):
        M, N, K = cfg.rows, cfg.lanes, cfg.reduce
        self.mode, self.rows = mode, rows
        self.n_values = rows * n           # real (unpadded) outputs checked
        # a wide group's x rows are int16; the unit sees them as M // 2 digit-row pairs
        x_rows, x_bits = (M // 2, 16) if wide else (M, 8)
        x_lo, x_hi = -(1 << (x_bits - 1)), (1 << (x_bits - 1)) - 1
        if extreme:   # products at both ends of the input ranges (32767: the 9-bit hi digit)
            W = rng.choice(np.array([-128, 127, -127], np.int64), (n, k))
            x = rng.choice(np.array([x_lo, x_hi], np.int64), (x_rows, k))
        else:
            W = rng.integers(-128, 128, (n, k))
            x = rng.integers(x_lo, x_hi + 1, (x_rows, k))
        np_, kp = padded(n, N), padded(k, K)
        # block multipliers: random, with 0 and the largest, 65535, common (1: no BLOCKS)
        scales = np.ones((np_, kp // K), np.int64)
        if blocks:
            scales = rng.integers(0, 1 << 16, (np_, kp // K))
            edge = rng.random(scales.shape)
            scales[edge < 0.15] = 0
            scales[edge > 0.7 if extreme else edge > 0.85] = (1 << 16) - 1
        mult = rng.integers(0, 1 << 16, n)
        # shifts around the useful range, plus arbitrary ones (0 … 63)
        out_bits = {MatmulMode.INT8: 8, MatmulMode.INT32: 32}.get(mode, 16)
        typical = int(np.log2(K * (k // K + 1) * 4096)) + 16 - (out_bits + 1) + (8 if wide else 0)
        shift = np.where(rng.random(n) < 0.8, np.clip(typical + rng.integers(-4, 5, n), 0, 63),
                         rng.integers(0, 64, n))
        if extreme:
            shift = rng.choice(np.array([0, 1, 63]), n)
        # int32 biases of a random magnitude each, or (extreme) the int32 edges and 0
        biases = np.zeros(np_, np.int64)
        if bias:
            biases[:n] = rng.integers(-(1 << 31), 1 << 31, n) >> rng.integers(0, 32, n)
            if extreme:
                biases[:n] = rng.choice(np.array([(1 << 31) - 1, -(1 << 31), 0]), n)
        records = np.frombuffer(pack_requant_records(mult, shift, biases, np_, N), "<u4")
        records = records.reshape(np_ // N, 2, N).astype(np.int64)
        words = records[:, 0].reshape(-1)
        words |= rng.integers(0, 1 << 10, np_) << 22           # bits 22-31 are ignored
        tiles = tile_weights(W.astype(np.int8), N, K).reshape(np_ // N, kp // K, N, K)
        xp = np.zeros((x_rows, kp), np.int64)
        xp[:, :k] = x
        digits = np.zeros((M, kp), np.int64)      # the rows the unit multiplies
        if wide:
            digits[0:2 * x_rows:2], digits[1:2 * x_rows:2] = nx.wide_digits(xp)
        else:
            digits[:] = xp
        # a unit without block multipliers has no scale / blocks fields (nor BLOCKS matmuls)
        assert cfg.weight_blocks or not blocks
        self.tiles = []                  # (w payload, x payload)
        for nt in range(np_ // N):
            for kt in range(kp // K):
                w = {"data": tiles[nt, kt].astype(np.int64).tolist(), "last": int(kt == kp // K - 1)}
                if cfg.weight_blocks:
                    w["scale"] = scales[nt * N:(nt + 1) * N, kt].tolist()
                self.tiles.append((w, digits[:, kt * K:(kt + 1) * K].tolist()))
        self.qbeats = [{"words": [{"mult": int(wd) & 0xFFFF, "shift": (int(wd) >> 16) & 0x3F,
                                   "reserved": int(wd) >> 22} for wd in words[nt * N:(nt + 1) * N]],
                        "bias": records[nt, 1].astype(np.uint32).view(np.int32).tolist(),
                        "mode": int(mode), "wide": int(wide),
                        "rows": rows if rows < x_rows or rng.random() < 0.5 else 0}
                       for nt in range(np_ // N)]
        if cfg.weight_blocks:
            for q in self.qbeats:
                q["blocks"] = int(blocks)
        Wp = np.zeros((np_, kp), np.int64)
        Wp[:n, :k] = W
        # [x_rows, Np], exact in int64
        acc = nx.add_bias(nx.block_matmul(xp, Wp, scales, K) if blocks else xp @ Wp.T, biases)
        mult_p, shift_p = words & 0xFFFF, (words >> 16) & 0x3F
        # row exponents (MATMUL ROWEXP): each row's shift less its exponent, not below 0
        if exps is None:
            exps = rng.integers(0, nx.ROW_EXP_MAX + 1, M) if rng.random() < 0.5 else np.zeros(M, np.int64)
        for q in self.qbeats:
            q["exps"] = [int(e) for e in exps]
        shift_p = nx.row_shift(shift_p[None, :], np.asarray(exps)[:x_rows, None])
        # int32 residuals of a random bit width per row (a massive channel among small ones)
        bits = rng.integers(1, 33, (x_rows, 1))
        self.res = rng.integers(-(1 << 31), 1 << 31, (x_rows, np_)) >> (32 - bits)
        if extreme:
            self.res = rng.choice(np.array([-(1 << 31), (1 << 31) - 1, -32768, 32767, 0]),
                                  (x_rows, np_))
        if mode == MatmulMode.INT8:
            ref = nx.requant(acc, mult_p, shift_p, nx.ACT_BITS)
        elif mode == MatmulMode.RESADD:
            ref = nx.residual_add(self.res, acc, mult_p, shift_p)
        elif mode == MatmulMode.INT32:
            ref = nx.requant(acc, mult_p, shift_p, nx.RES_BITS)
        else:
            ref = nx.requant(acc, mult_p, shift_p, nx.LOGIT_BITS)
        self.expected = []               # (row, last, lanes) per output beat, in order
        self.res_beats = []
        for nt in range(np_ // N):
            for r in range(rows):
                self.expected.append((r, int(r == rows - 1), ref[r, nt * N:(nt + 1) * N].tolist()))
                if mode == MatmulMode.RESADD:
                    self.res_beats.append(self.res[r, nt * N:(nt + 1) * N].tolist())


def simulate(dut, matmuls, rng, *, gaps=0.3, backpressure=0.3):
    """Stream ``matmuls`` through ``dut`` with random input gaps and output backpressure;
    return the received beats as (row, last, lanes)."""
    tiles = [t for mm in matmuls for t in mm.tiles]
    qbeats = [q for mm in matmuls for q in mm.qbeats]
    res_beats = [r for mm in matmuls for r in mm.res_beats]
    n_out = sum(len(mm.expected) for mm in matmuls)
    wgap, xgap, ogap = (rng.random(len(tiles)) < gaps, rng.random(len(tiles)) < gaps,
                        rng.random(n_out) < backpressure)
    got = []

    async def put_w(ctx):
        for i, (w, _) in enumerate(tiles):
            if wgap[i]:
                await ctx.tick()
            await stream_put(ctx, dut.w, w)

    async def put_x(ctx):
        for i, (_, x) in enumerate(tiles):
            if xgap[i]:
                await ctx.tick()
            await stream_put(ctx, dut.x, x)

    async def put_q(ctx):
        for q in qbeats:
            await stream_put(ctx, dut.q, q)

    async def put_res(ctx):
        for r in res_beats:
            await stream_put(ctx, dut.res, r)

    async def get(ctx):
        for i in range(n_out):
            if ogap[i]:
                await ctx.tick()
            beat = await stream_get(ctx, dut.o)
            got.append((int(beat.row), int(beat.last), [int(v) for v in beat.data]))

    run_simulation(dut, put_w, put_x, put_q, put_res, get,
                   watchdog(8 * (len(tiles) + n_out) + 100, lambda: len(got) == n_out))
    return got


def random_matmuls(rng, cfg, count, *, min_values=0, blocks=None, **kw):
    """``count`` random MATMULs, more if needed to reach ``min_values`` real outputs;
    ``blocks``: all with ``BLOCKS`` (True), none (False) or a random half (None: none
    where the unit has no block multipliers)."""
    M, N, K = cfg.rows, cfg.lanes, cfg.reduce
    if not cfg.weight_blocks:
        blocks = False
    out = []
    while len(out) < count or sum(mm.n_values for mm in out) < min_values:
        wide = bool(rng.random() < 0.4)
        out.append(Matmul(rng, cfg, n=int(rng.integers(1, 2 * N + 1)), k=int(rng.integers(1, 3 * K + 1)),
                          rows=int(rng.integers(1, (M // 2 if wide else M) + 1)), wide=wide,
                          mode=MatmulMode(int(rng.integers(0, 4))), bias=bool(rng.random() < 0.5),
                          blocks=bool(rng.random() < 0.5) if blocks is None else blocks, **kw))
    return out


def check(got, matmuls):
    expected = [e for mm in matmuls for e in mm.expected]
    assert len(got) == len(expected)
    for i, (g, e) in enumerate(zip(got, expected)):
        assert g == e, f"beat {i}: got {g}, expected {e}"
    return sum(mm.n_values for mm in matmuls)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_random_matmuls(name):
    cfg, pack = CONFIGS[name]
    rng = np.random.default_rng(sum(map(ord, name)))
    matmuls = random_matmuls(rng, cfg, 100, min_values=1200)
    values = check(simulate(MatrixUnit(cfg, pack_rows=pack), matmuls, rng), matmuls)
    assert values >= 1000


@pytest.mark.parametrize("name", ["tiny", "m5n8k4"])
def test_random_block_matmuls(name):
    """``BLOCKS`` alone: ≥ 1000 output values of block-scaled matmuls (int8 and wide rows,
    every mode, with and without a bias) equal numerics.block_matmul's."""
    cfg, pack = CONFIGS[name]
    rng = np.random.default_rng(13 + sum(map(ord, name)))
    matmuls = random_matmuls(rng, cfg, 60, min_values=1100, blocks=True)
    assert {mm.mode for mm in matmuls} == set(MatmulMode)
    values = check(simulate(MatrixUnit(cfg, pack_rows=pack), matmuls, rng), matmuls)
    assert values >= 1000


class _TruncatedBlocks(MatrixUnit):
    """A wrong design: floors the block-scaled sum instead of rounding it (half up)."""
    BLOCK_HALF = 0


def test_the_comparison_catches_truncated_blocks():
    """The block check fails on a unit that drops BLOCK_SHIFT's rounding constant."""
    cfg, pack = CONFIGS["tiny"]
    rng = np.random.default_rng(9)
    matmuls = random_matmuls(rng, cfg, 12, blocks=True)
    with pytest.raises(AssertionError):
        check(simulate(_TruncatedBlocks(cfg, pack_rows=pack), matmuls, rng), matmuls)


@pytest.mark.parametrize("name", ["tiny", "m3n2k4"])
def test_saturation_extremes(name):
    """Products of ±128/127 (and of ±32768/32767 in wide groups), biases ±2^31 and 0
    and shifts 0, 1, 63: saturation at both ends of int8 / int16 / int32 (the residual add,
    INT32), in every mode."""
    cfg, pack = CONFIGS[name]
    rng = np.random.default_rng(7)
    matmuls = random_matmuls(rng, cfg, 24, extreme=True)
    got = simulate(MatrixUnit(cfg, pack_rows=pack), matmuls, rng)
    check(got, matmuls)
    values = np.array([v for g in got for v in g[2]])
    for lo, hi in ((-128, 127), (-32768, 32767), (-(1 << 31), (1 << 31) - 1)):
        assert (values == lo).any() and (values == hi).any()


class _Residual16(MatrixUnit):
    """A wrong design: saturates the residual sum at 16 bits (the pre-issue-#13 width)."""
    RES_SAT_BITS = 16


def test_the_comparison_catches_a_16_bit_residual():
    """The same check fails on a unit whose RESADD saturates at int16."""
    cfg, pack = CONFIGS["tiny"]
    rng = np.random.default_rng(8)
    matmuls = [Matmul(rng, cfg, n=cfg.lanes, k=cfg.reduce, rows=cfg.rows, mode=MatmulMode.RESADD)
               for _ in range(4)]
    with pytest.raises(AssertionError):
        check(simulate(_Residual16(cfg, pack_rows=pack), matmuls, rng), matmuls)


def test_full_throughput_and_stall_on_backpressure():
    """With every stream ready, long groups run at one tile per cycle; a stalled output
    stalls the inputs without losing or duplicating a row."""
    cfg, _ = CONFIGS["tiny"]
    rng = np.random.default_rng(3)
    matmuls = [Matmul(rng, cfg, n=2 * cfg.lanes, k=4 * cfg.reduce, rows=cfg.rows, mode=MatmulMode.INT8)
               for _ in range(3)]
    dut = MatrixUnit(cfg)
    # no gaps, no backpressure: count the cycles the tiles take
    n_tiles = sum(len(mm.tiles) for mm in matmuls)
    tiles = [t for mm in matmuls for t in mm.tiles]
    qbeats = [q for mm in matmuls for q in mm.qbeats]
    n_out = sum(len(mm.expected) for mm in matmuls)
    got, accepted = [], []

    async def put_wx(ctx):
        for w, x in tiles:
            ctx.set(dut.w.payload, w)
            ctx.set(dut.x.payload, x)
            ctx.set(dut.w.valid, 1)
            ctx.set(dut.x.valid, 1)
            await ctx.tick().until(dut.w.ready)
        ctx.set(dut.w.valid, 0)
        ctx.set(dut.x.valid, 0)

    async def count(ctx):
        c = 0
        while len(accepted) < n_tiles:
            _, _, ready, valid = await ctx.tick().sample(dut.w.ready, dut.w.valid)
            c += 1
            if ready and valid:
                accepted.append(c)

    async def put_q(ctx):
        for q in qbeats:
            await stream_put(ctx, dut.q, q)

    async def get(ctx):
        for _ in range(n_out):
            beat = await stream_get(ctx, dut.o)
            got.append((int(beat.row), int(beat.last), [int(v) for v in beat.data]))

    run_simulation(dut, put_wx, count, put_q, get, watchdog(1000, lambda: len(got) == n_out))
    check(got, matmuls)
    assert accepted[-1] - accepted[0] == n_tiles - 1        # II = 1, no stall
    # and once more with heavy output backpressure
    check(simulate(MatrixUnit(cfg), matmuls, rng, gaps=0.0, backpressure=0.8), matmuls)


@pytest.mark.parametrize("name", ["tiny", "m3n2k4"])
def test_latency(name):
    """A one-tile group transferred in cycle c gives its first row in cycle c + LATENCY."""
    cfg, pack = CONFIGS[name]
    assert MatrixUnit.LATENCY == 2 + MatrixUnit.TREE_STAGES + 1 + Requantizer.LATENCY + 1 == 10
    rng = np.random.default_rng(1)
    mm = Matmul(rng, cfg, n=cfg.lanes, k=cfg.reduce, rows=cfg.rows, mode=MatmulMode.LOGITS)
    dut = MatrixUnit(cfg, pack_rows=pack)
    seen = {}

    async def tb(ctx):
        (w, x), q = mm.tiles[0], mm.qbeats[0]
        ctx.set(dut.w.payload, w)
        ctx.set(dut.x.payload, x)
        ctx.set(dut.q.payload, q)
        for s in (dut.w.valid, dut.x.valid, dut.q.valid, dut.o.ready):
            ctx.set(s, 1)
        assert ctx.get(dut.w.ready) and ctx.get(dut.idle)     # transferred in cycle 0
        await ctx.tick()
        ctx.set(dut.w.valid, 0)
        ctx.set(dut.x.valid, 0)
        cycle = 1
        while not ctx.get(dut.o.valid):
            assert not ctx.get(dut.idle)
            await ctx.tick()
            cycle += 1
        seen["latency"] = cycle
        rows = []
        while ctx.get(dut.o.valid):
            rows.append((ctx.get(dut.o.p.row), ctx.get(dut.o.p.last), list(ctx.get(dut.o.p.data))))
            await ctx.tick()
        seen["rows"] = rows
        assert ctx.get(dut.idle)

    run_simulation(dut, tb)
    assert seen["latency"] == MatrixUnit.LATENCY
    assert [(r, l, [int(v) for v in d]) for r, l, d in seen["rows"]] == mm.expected


def test_no_block_multipliers_without_weight_blocks():
    """Without ``weight_blocks`` the tiles carry no multipliers, the parameters no
    ``blocks``, and the accumulators are ``acc_bits`` wide, not 16 bits wider."""
    for cfg, fields, acc_bits in ((TINY, {"scale", "blocks"}, 48),
                                  (CONFIGS["tiny-no-blocks"][0], set(), 32)):
        dut = MatrixUnit(cfg)
        members = set(dut.w.p.shape().members) | set(dut.q.p.shape().members)
        assert members & {"scale", "blocks"} == fields
        v = to_verilog(dut, "matrix")
        assert re.findall(r"reg (?:signed )?\[(\d+):0\] acc_0_0\b", v) == [str(acc_bits - 1)]


@pytest.mark.parametrize("name", ["tiny", "tiny-no-blocks"])
def test_lint_clean(name):
    v = to_verilog(MatrixUnit(CONFIGS[name][0]), "matrix")
    # The requantisers are submodules; Verilator's DECLFILENAME (one module per file) is a
    # file-naming style rule that no multi-module Amaranth output can meet.
    clean, output = verilator_lint("/* verilator lint_off DECLFILENAME */\n" + v, "matrix")
    assert clean, output


@pytest.mark.parametrize("old, new", [
    ("row_exp = self.q.p.exps[row]", "row_exp = self.q.p.exps[0]"),          # one row's for all
    ("Mux(shift > row_exp, shift - row_exp, 0)", "(shift - row_exp)[:6]"),   # wraps below 0
], ids=["first-row-exponent", "no-floor"])
def test_row_exponent_mutations_are_caught(old, new):
    """The row exponent check can fail: a unit that takes row 0's exponent for every row,
    or lets the shift wrap where an exponent passes it, gives other results."""
    import dfvg_hw.matrix as matrix_module
    from sequencer_cases import mutant
    cfg, pack = CONFIGS["m5n8k4"]
    rng = np.random.default_rng(17)
    matmuls = random_matmuls(rng, cfg, 30, min_values=500)
    assert any(len(set(mm.qbeats[0]["exps"])) > 1 for mm in matmuls)
    bad = mutant(matrix_module, old, new, shared=()).MatrixUnit
    with pytest.raises(AssertionError):
        check(simulate(bad(cfg, pack_rows=pack), matmuls, rng), matmuls)
