"""The numerics module against float references and its own exactness claims."""

import math

import numpy as np
import pytest

from dfvg_hw.spec import numerics as nx


def test_requant_rounds_half_up_and_saturates():
    assert nx.requant([3], 1, 1).tolist() == [2]        # 1.5 -> 2
    assert nx.requant([-3], 1, 1).tolist() == [-1]      # -1.5 -> -1 (half up)
    assert nx.requant([10**9], 1 << 15, 0).tolist() == [127]
    assert nx.requant([-10**9], 1 << 15, 0).tolist() == [-128]
    assert nx.requant([100], 3, 0, bits=16).tolist() == [300]


def test_round_shift_of_one_shift_equals_per_element_shifts():
    x = np.random.default_rng(0).integers(-2**50, 2**50, size=300)
    for shift in (0, 1, 7, 31, 62, 63):
        want = [(int(v) + (1 << shift >> 1)) >> shift for v in x]
        assert nx.round_shift(x, shift).tolist() == want
        assert nx.round_shift(x, np.full(x.shape, shift)).tolist() == want
        assert nx.round_shift(x, np.int64(shift)).tolist() == want


@pytest.mark.parametrize("size", [1, 32, 33, 1000])
def test_bit_length_is_exact_on_both_sides_of_every_power_of_two(size):
    edges = [0] + [v for e in range(63) for v in ((1 << e) - 1, 1 << e, (1 << e) + 1)] + [2**63 - 1]
    rng = np.random.default_rng(size)
    x = np.array(rng.choice(edges, size=size), dtype=np.int64).reshape(-1, 1)
    assert nx.bit_length(x).tolist() == [[int(v).bit_length()] for v in x[:, 0]]


def test_wide_digits_reconstruct_every_int16():
    x = np.arange(-32768, 32768)
    hi, lo = nx.wide_digits(x)
    assert np.array_equal(256 * hi + lo, x)
    assert lo.min() == -128 and lo.max() == 127
    assert hi.min() == -128 and hi.max() == 128            # the 9-bit digit
    assert np.array_equal(x[hi == 128], np.arange(32640, 32768))


def test_host_multiplier_is_accurate():
    real = np.geomspace(1e-6, 3e4, 500)
    m, s = nx.host_multiplier(real)
    assert np.all((m >= 1 << 15) & (m < 1 << 16))
    np.testing.assert_allclose(m / np.exp2(s), real, rtol=2 ** -15)


def test_rsqrt_within_lut_precision():
    rng = np.random.default_rng(0)
    s = np.concatenate([np.arange(1, 5000), rng.integers(1, 1 << 60, 5000)])
    r, k = nx.rsqrt_fixed(s)
    approx = r * np.exp2(-(15.0 + k))
    rel = np.abs(approx * np.sqrt(s.astype(np.float64)) - 1)
    assert rel.max() < 2 ** -8          # truncated 8-bit mantissa index
    with pytest.raises(ValueError):
        nx.rsqrt_fixed([-1])


def test_rsqrt_of_zero_is_that_of_one():
    """s = 0 (an all-zero RMSNorm row with eps = 0) is defined: the LUT's first entry, k = 0."""
    r, k = nx.rsqrt_fixed([0, 1])
    assert r.tolist() == [1 << nx.RSQRT_BITS] * 2 and k.tolist() == [0, 0]


@pytest.mark.parametrize("eps", [0, 1, 12345, 2 ** 32 - 1])
@pytest.mark.parametrize("out_bits", [8, 16])
def test_rmsnorm_of_zero_rows_is_zero(eps, out_bits):
    """An all-zero row normalises to zeros for any eps (no exception at eps = 0), and the
    other rows of the same call are unaffected."""
    rng = np.random.default_rng(eps)
    x = rng.integers(-3000, 3000, (3, 32))
    x[1] = 0
    gamma = rng.integers(-2 ** 15, 2 ** 15, 32)
    y = nx.rmsnorm(x, gamma, 4, eps, out_bits)
    assert not y[1].any()
    for row in (0, 2):
        np.testing.assert_array_equal(y[row], nx.rmsnorm(x[row], gamma, 4, eps, out_bits))


def test_rmsnorm_matches_float():
    rng = np.random.default_rng(1)
    x = rng.integers(-3000, 3000, (50, 96))
    g = rng.uniform(0.5, 1.5, 96)
    s_out = 4.0 / 127
    real = math.sqrt(96) * g / s_out
    shift = int(math.floor(math.log2(32767 / real.max())))
    gm = np.round(real * 2 ** shift).astype(np.int64)
    y = nx.rmsnorm(x, gm, shift, 0)
    ref = x / np.sqrt(np.mean(x.astype(float) ** 2, axis=1, keepdims=True)) * g / s_out
    assert np.abs(y - np.clip(ref, -128, 127)).max() <= 1.5


def test_norm_input_shift_is_the_least_shift_into_int16():
    """x >> p fits int16 for every element and p - 1 would not (for p > 0): no bits are
    dropped that int16 could keep, and none are kept that would overflow the squarer."""
    rng = np.random.default_rng(2)
    widths = rng.integers(0, 33, (2000, 1))
    x = rng.integers(-(1 << 31), 1 << 31, (2000, 24)) >> (32 - widths)
    edges = np.array([[-(1 << 31)] * 24, [(1 << 31) - 1] * 24, [-(1 << 15)] * 24, [1 << 15] * 24,
                      [(1 << 15) - 1] * 24, [0] * 24, [-1] * 24])
    x = np.concatenate([x, edges])
    p = nx.norm_input_shift(x)
    assert p.shape == (len(x), 1) and p.min() == 0 and p.max() == 16
    fits = lambda v: (v >= -(1 << 15)) & (v < (1 << 15))
    assert np.all(fits(x >> p))
    shifted = p[:, 0] > 0
    assert not np.any(np.all(fits(x[shifted] >> (p[shifted] - 1)), axis=1))
    assert p[-7:, 0].tolist() == [16, 16, 0, 1, 0, 0, 0]


def test_rmsnorm_is_the_same_at_every_magnitude():
    """The row shift cancels: a row scaled by 2^j (j up to 16) normalises to the same
    output as the row itself, as long as the row already fills its 15 bits."""
    rng = np.random.default_rng(3)
    x = rng.integers(-(1 << 15), 1 << 15, (200, 64))
    x[:, 0] = -(1 << 15)                                 # every row uses all 15 bits
    gamma = rng.integers(1 << 13, 1 << 15, 64)
    y = nx.rmsnorm(x, gamma, 3, 1000, 16)
    for j in (1, 7, 16):
        np.testing.assert_array_equal(nx.rmsnorm(x << j, gamma, 3, 1000 << (2 * j), 16), y)


def test_rmsnorm_of_a_massive_activation_row_matches_float():
    """One channel at 2^30 and the rest at a few thousand: the big channel's output is
    exact; the others fall below the row's 15 significant bits (x >> 16 is 0 or, floored,
    -1), one output LSB from float at most."""
    rng = np.random.default_rng(4)
    x = rng.integers(-3000, 3000, (20, 96))
    x[:, 5] = 1 << 30
    gm = np.full(96, 64)
    y = nx.rmsnorm(x, gm, 0, 0, 16)
    # y = x / sqrt(Σx²) · gamma · 2^-15 · 2^15 · 2^8 for a 16-bit output
    ref = x / np.sqrt(np.sum(x.astype(float) ** 2, axis=1, keepdims=True)) * 64 * 256
    assert np.abs(y - ref).max() <= 1.5
    assert np.all(np.abs(y[:, 5] - ref[:, 5]) <= 0.5)


def test_residual_add_is_int32_and_saturates():
    top = (1 << 31) - 1
    assert nx.residual_add([top - 5], [10], 1, 0).tolist() == [top]
    assert nx.residual_add([-top], [-10], 1, 0).tolist() == [-(1 << 31)]
    assert nx.residual_add([1 << 20], [3], 1 << 15, 15).tolist() == [(1 << 20) + 3]
    assert nx.residual_add([0], [1 << 38], (1 << 16) - 1, 0).tolist() == [top]


def test_exp2_lut_and_softmax():
    u = np.arange(0, 20 * 256)
    e = nx.exp2_neg(u)
    ref = 65536 * np.exp2(-u / 256)
    assert np.abs(e - ref).max() <= 1.0 + 1e-9 and e[0] == 65536
    assert np.all(nx.exp2_neg([17 * 256, 40 * 256]) == 0)


def test_attention_matches_float_softmax():
    rng = np.random.default_rng(2)
    q = rng.integers(-60, 60, 16)
    k = rng.integers(-60, 60, (20, 16))
    v = rng.integers(-100, 100, (20, 16))
    scale = 0.02 * 0.02 / 4
    m, s = nx.host_multiplier(scale * math.log2(math.e) * 256)
    out = nx.attention(q, k, v, int(m), int(s))
    z = (k @ q) * scale
    p = np.exp(z - z.max())
    ref = (p / p.sum()) @ v
    assert np.abs(out - ref).max() <= 1.5


def test_rope_matches_float_rotation():
    rng = np.random.default_rng(3)
    x = rng.integers(-100, 100, (3, 16))
    ang = rng.uniform(0, 2 * np.pi, 8)
    tab = nx.host_rope_table(np.cos(ang), np.sin(ang)).astype(np.int64)
    y = nx.rope(x, tab[:, 0], tab[:, 1])
    a, b = x[:, :8], x[:, 8:]
    ref = np.concatenate([a * np.cos(ang) - b * np.sin(ang), b * np.cos(ang) + a * np.sin(ang)], 1)
    assert np.abs(y - np.clip(ref, -128, 127)).max() <= 1.0


def test_wide_rope_matches_float_rotation_and_saturates_to_int16():
    rng = np.random.default_rng(4)
    x = rng.integers(-30000, 30000, (3, 16))
    ang = rng.uniform(0, 2 * np.pi, 8)
    ang[0], x[0, 0], x[0, 8] = np.pi / 4, 30000, 30000    # pair norm 42,426: b' saturates
    tab = nx.host_rope_table(np.cos(ang), np.sin(ang)).astype(np.int64)
    y = nx.rope(x, tab[:, 0], tab[:, 1], 16)
    a, b = x[:, :8], x[:, 8:]
    ref = np.concatenate([a * np.cos(ang) - b * np.sin(ang), b * np.cos(ang) + a * np.sin(ang)], 1)
    clipped = np.clip(ref, -32768, 32767)
    # the Q1.14 table's rounding: at most 2^-15 relative per term, so a few units at 2^15
    assert np.abs(y - clipped).max() <= 4.0
    assert y[0, 8] == 32767
    np.testing.assert_array_equal(nx.rope(x.clip(-128, 127), tab[:, 0], tab[:, 1]),
                                  nx.rope(x.clip(-128, 127), tab[:, 0], tab[:, 1], 8))


def test_topk_breaks_ties_to_lower_index():
    logits = np.array([5, 9, 9, 1, 9, 2])
    assert nx.topk_select(logits, 3).tolist() == [1, 2, 4]
    assert nx.topk_select(np.zeros(8, int), 1).tolist() == [0]


def test_sampler_probabilities_are_exact():
    rng = np.random.default_rng(4)
    for temp in (0.3, 1.0, 2.5):
        tm, ts = nx.host_temperature(temp)
        for _ in range(200):
            top = np.sort(rng.integers(-3000, 3000, rng.integers(1, 17)))[::-1]
            p = nx.sampler_probs(top, tm, ts)
            assert p.sum() == 1 << nx.PROB_BITS and np.all(p >= 0)
            ref = np.exp((top - top[0]) / 256 / temp)
            assert np.abs(p / 2 ** 24 - ref / ref.sum()).max() < 0.01


def test_sample_index_realises_the_reported_probabilities_exactly():
    p = np.array([1 << 23, 1 << 22, (1 << 22) - 5, 5])
    # Each r24 picks the first j whose cumulative sum exceeds it: count the r's per j.
    edges = np.concatenate([[0], np.cumsum(p)])
    for j in range(len(p)):
        assert nx.sample_index(p, edges[j]) == j
        assert nx.sample_index(p, edges[j + 1] - 1) == j


def test_rng_is_counter_based_and_uniform():
    seed = 0x1234_5678_9ABC_DEF0
    a = [nx.rng32(seed, c) for c in range(20000)]
    assert a[:50] == [nx.rng32(seed, c) for c in range(50)]
    assert nx.rng32(seed + 1, 0) != a[0]
    bits = np.array(a, dtype=np.uint64)
    hist = np.bincount((bits >> np.uint64(28)).astype(int), minlength=16)
    chi2 = ((hist - 1250) ** 2 / 1250).sum()
    assert chi2 < 40          # 15 degrees of freedom; p ≈ 5e-4 at 40


def test_temperature_rejects_nonsense():
    for bad in (0, -1, float("inf"), float("nan")):
        with pytest.raises(ValueError):
            nx.host_temperature(bad)


def test_block_matmul_is_the_rounded_sum_of_scaled_tile_dots():
    """numerics.block_matmul against a plain loop written from its definition: per k-tile
    dot products, each times its multiplier, summed exactly, rounded once by 2^16; at the
    bounds (int16 x = -32768, w = -128, m = 65535, k = 65535) it stays in int64 and below
    2^38."""
    rng = np.random.default_rng(21)
    for reduce, n, k, wide in ((8, 5, 37, False), (32, 3, 100, True), (4, 7, 4, True)):
        x = rng.integers(-32768, 32768, (2, k)) if wide else rng.integers(-128, 128, (2, k))
        w = rng.integers(-128, 128, (n, k))
        m = rng.integers(0, 1 << 16, (n, -(-k // reduce)))
        m[0, 0], m[-1, -1] = 0, (1 << 16) - 1
        got = nx.block_matmul(x, w, m, reduce)
        for r in range(2):
            for i in range(n):
                total = sum(int(m[i, t]) * sum(int(x[r, j]) * int(w[i, j])
                                                for j in range(t * reduce, min(k, (t + 1) * reduce)))
                            for t in range(m.shape[1]))
                assert got[r, i] == (total + (1 << 15)) >> 16
    k = 65535
    big = nx.block_matmul(np.full((1, k), -32768), np.full((1, k), -128),
                          np.full((1, -(-k // 32)), 65535), 32)
    assert big[0, 0] == (k * 32768 * 128 * 65535 + (1 << 15)) >> 16 and big[0, 0] < 1 << 38
    # multipliers of 2^16 would be the identity; 65535 is the largest a u16 holds
    assert nx.block_round(np.int64(3 << 16)) == 3 and nx.block_round(np.int64(-(1 << 15))) == 0


@pytest.mark.parametrize("out_bits", [8, 16])
def test_row_exponent_is_the_least_that_fits_the_row(out_bits):
    """ACTMUL ROWEXP's exponent: at ``e < E`` a row fits ``out_bits`` (within a unit of
    rounding at the edge); at ``e − 1`` its largest value passes half the range, so ``e``
    is at most one more than the least that fits (the coarse values are rounded), wherever
    the coarse measurement resolves it (an int8 row's exponent is at least ``E − 7``); a
    row of zeros, or an empty one, gets 0 (int16)."""
    rng = np.random.default_rng(3 + out_bits)
    lut = rng.integers(-32768, 32768, 256)
    hi = (1 << (out_bits - 1)) - 1
    seen = set()
    for _ in range(400):
        n = int(rng.integers(1, 40))
        gate, up = rng.integers(-128, 128, (2, n))
        up = up >> int(rng.integers(0, 8))               # rows of every magnitude
        mult, shift = int(rng.integers(1 << 15, 1 << 16)), int(rng.integers(0, 40))
        E = int(rng.integers(0, nx.ROW_EXP_MAX + 1))
        e = int(nx.act_row_exponent(nx.act_mul(gate, up, lut, mult, shift, out_bits, E), E, out_bits))
        seen.add(e)
        assert max(0, E - (out_bits - 1)) <= e <= E

        def peak(x):                                     # the row's largest |value| at exponent x
            return np.abs(nx.round_shift(lut[gate + 128] * up * mult, min(shift + x, 63))).max()
        if e < E:
            assert peak(e) <= hi + 1
        if e > max(0, E - (out_bits - 1)):
            assert peak(e - 1) > hi // 2, (e, E)
        row = nx.act_mul(gate, up, lut, mult, shift, out_bits, e)
        assert np.array_equal(row, nx.saturate(nx.round_shift(lut[gate + 128] * up * mult,
                                                              min(shift + e, 63)), out_bits))
    assert len(seen) >= 10
    # the rounding's spare bit: a row whose largest value at exponent 0 is 2^14 gets 1
    assert nx.act_row_exponent(np.array([[1, 0]]), 15, 16).tolist() == [1]
    assert nx.act_row_exponent(np.zeros((3, 0), np.int64), 15, 16).tolist() == [0, 0, 0]
    assert nx.act_row_exponent(np.zeros((2, 5), np.int64), 15, 16).tolist() == [0, 0]


def test_row_shift_and_act_mul_shift_clamp():
    assert nx.row_shift(np.array([20, 3, 0]), np.array([[5], [15]])).tolist() == [[15, 0, 0], [5, 0, 0]]
    assert nx.act_mul_shift(60, 15) == 63 and nx.act_mul_shift(40, 3) == 43
    # a shift past 63 rounds every product to 0, as 63 does
    lut = np.full(256, -32768)
    assert nx.act_mul(np.array([0]), np.array([-128]), lut, 65535, 63, 16, 15).tolist() == [0]


def test_interpolated_knots_are_exact_at_the_knots_and_follow_silu_between():
    """ACTMUL IN16's table: at a knot the value itself; between knots the rounded linear
    step (checked against exact rationals); the bounds the RTL's widths rely on; and
    host_act_knots' SiLU within 6e-4 of the float function at every int16 gate, an int8
    gate's table 40 times coarser."""
    from fractions import Fraction
    rng = np.random.default_rng(7)
    table = rng.integers(-2 ** 15, 2 ** 15, 256)
    table[254:256] = 32767
    knots = (np.arange(128) - 64) * 512
    assert np.array_equal(nx.act_interpolate(knots, table), table[0::2])
    gate = rng.integers(-2 ** 15, 2 ** 15, 5000)
    gate[:2] = (-32768, 32767)
    got = nx.act_interpolate(gate, table)
    for g, a in zip(gate[:500], got[:500]):
        i, f = (int(g) >> 9) + 64, int(g) & 511
        exact = table[2 * i] + Fraction(int(table[2 * i + 1]) * f, 512)
        assert a == int(np.floor(exact + Fraction(1, 2)))       # round half up
    assert np.abs(got).max() < 2 ** 16
    assert nx.act_interpolate(np.array([32767]), table)[0] == 32767 + round(32767 * 511 / 512)
    # the whole product stays inside int32 before the multiplier
    up = np.array([-32768, 32767])
    assert np.abs(nx.act_interpolate(np.array([32767]), table) * up).max() < 2 ** 31

    def silu(x):
        return x / (1 + np.exp(-x))
    scale = 5 / 32767
    t16, s16 = nx.host_act_knots(silu, scale)
    g = np.arange(-32768, 32768)
    err16 = np.abs(nx.act_interpolate(g, t16) * s16 - silu(g * scale)).max()
    t8, s8 = nx.host_act_lut(silu, scale * 256)
    g8 = np.clip(np.round(g / 256), -128, 127).astype(np.int64)
    err8 = np.abs(t8[g8 + 128] * s8 - silu(g * scale)).max()
    assert err16 < 6e-4 and err8 > 40 * err16, (err16, err8)
    assert np.array_equal(nx.act_mul_wide(gate, np.full(gate.shape, 3), table, 40000, 20, 16),
                          nx.requant(got * 3, 40000, 20, 16))


def test_an_int16_query_is_read_as_11_symmetric_bits():
    """ATTN IN16: an int16 query saturates to ±1023 before the scores; inside that range
    the attention is the same as with the query as given."""
    q = np.array([-32768, -1024, -1023, -5, 0, 7, 1023, 1024, 32767])
    assert nx.attention_query(q, True).tolist() == [-1023, -1023, -1023, -5, 0, 7, 1023, 1023, 1023]
    assert nx.attention_query(q[3:6]).tolist() == [-5, 0, 7]
    rng = np.random.default_rng(9)
    k, v = rng.integers(-128, 128, (6, 9)), rng.integers(-128, 128, (6, 9))
    np.testing.assert_array_equal(nx.attention(q, k, v, 3000, 24, 16, in16=True),
                                  nx.attention(nx.attention_query(q, True), k, v, 3000, 24, 16))
    small = rng.integers(-1023, 1024, 9)
    np.testing.assert_array_equal(nx.attention(small, k, v, 3000, 24, 16, in16=True),
                                  nx.attention(small, k, v, 3000, 24, 16))
