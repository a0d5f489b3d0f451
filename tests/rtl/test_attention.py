"""Softmax and attention RTL against numerics.softmax_weights / attention, bit for bit."""

import math

import numpy as np
import pytest

from dfvg_hw.spec import kv_timing, timing
from dfvg_hw.spec import numerics as nx
from dfvg_hw.spec.config import get_preset
from dfvg_hw.attention import Attention, Normalizer, Reciprocal, SoftmaxExp, SoftmaxWeights
from sim import lint as rtl_lint
from dfvg_hw.verilog import to_verilog
from sim.lint import verilator_lint
from sim.testbench import first_valid_after_accept, run_simulation, stream_get, stream_put, stream_through

TINY = get_preset("tiny")
CONFIGS = [TINY, TINY.with_changes(name="tiny-l8-hd32", lanes=8, head_dim=32)]
IDS = ["tiny", "l8-hd32"]
#: banked: B K (V) rows a cycle, one from each KV bank
BANKED = [TINY.with_changes(kv_banks=2), TINY.with_changes(kv_banks=4),
          TINY.with_changes(kv_banks=8, kv_positions=40)]
BANKED_IDS = ["b2", "b4", "b8"]
#: the board presets' 16 banks: K products packed in pairs, banks 8 … 15's e·V products
#: shift-and-add logic
B16 = TINY.with_changes(kv_banks=16)
I32 = (-2 ** 31, 2 ** 31 - 1)


def ints(v):
    return [int(x) for x in v]


# -- exp path ----------------------------------------------------------------------------
def test_softmax_exp_random():
    rng = np.random.default_rng(1)
    lanes, n = 4, 300
    mx = rng.integers(*I32, n, endpoint=True)
    d = rng.integers(0, 2 ** 32, (n, lanes)) >> rng.integers(0, 32, (n, lanes))
    s = mx[:, None] - d
    ok = s >= I32[0]
    s = np.where(ok, s, I32[0])
    mult = rng.integers(0, 2 ** 16, n)
    shift = rng.integers(0, 64, n)
    keep = rng.integers(0, 16, n)
    keep[:n // 2] = 15
    # edges: d = 0 (exactly 2^16), d = 2^32 - 1, shift 0 / 63, mult 0, u = 17·256 - 1 / 17·256
    mx[0], s[0], mult[0], shift[0] = I32[1], [I32[1], I32[0], 0, -1], 65535, 0
    mx[1], s[1], mult[1], shift[1] = I32[1], [I32[1], I32[0], 0, -1], 65535, 63
    mx[2], s[2], mult[2], shift[2] = 0, [0, -1, -17 * 256 + 1, -17 * 256], 1, 0
    mx[3], s[3], mult[3], shift[3] = 5, [5, 4, 3, I32[0]], 0, 7
    dut, got = SoftmaxExp(lanes, 32), []
    beats = [{"s": ints(s[k]), "keep": int(keep[k]), "max": int(mx[k]), "mult": int(mult[k]),
              "shift": int(shift[k]), "last": k % 5 == 4} for k in range(n)]

    async def put(ctx):
        for b in beats:
            await stream_put(ctx, dut.i, b)

    async def get(ctx):
        for k in range(n):
            if k % 4 == 3:
                await ctx.tick()
            p = await stream_get(ctx, dut.o)
            assert p.last == (k % 5 == 4)
            got.append(list(p.e))

    run_simulation(dut, put, get)
    want = nx.exp2_neg(nx.round_shift((mx[:, None] - s) * mult[:, None], shift[:, None]))
    mask = (keep[:, None] >> np.arange(lanes)) & 1
    np.testing.assert_array_equal(np.array(got), np.where(mask == 1, want, 0))
    assert got[0][0] == nx.EXP_ONE


def test_softmax_exp_latency():
    dut = SoftmaxExp(4, 32)
    beat = {"s": [0] * 4, "keep": 15, "max": 0, "mult": 1, "shift": 0, "last": 1}
    assert first_valid_after_accept(dut, dut.i, dut.o, beat) == SoftmaxExp.LATENCY == 4


# -- softmax weights ----------------------------------------------------------------------
def simulate_weights(dut, vectors, ready=(1, 1, 0, 1, 1, 0, 0)):
    """vectors: list of (scores, mult, shift) → list of (weights, total)."""
    lanes = dut.lanes
    got_e, got_t = [], []

    async def put(ctx):
        for s, mult, shift in vectors:
            ctx.set(dut.mult, int(mult))
            ctx.set(dut.shift, int(shift))
            nb = -(-len(s) // lanes)
            for b in range(nb):
                chunk = ints(s[b * lanes:(b + 1) * lanes])
                await stream_put(ctx, dut.i, {"s": chunk + [0] * (lanes - len(chunk)),
                                              "keep": (1 << len(chunk)) - 1,
                                              "last": int(b == nb - 1)})

    async def get(ctx):
        k = 0
        for s, *_ in vectors:
            nb, out = -(-len(s) // lanes), []
            for b in range(nb):
                if not ready[k % len(ready)]:
                    await ctx.tick()
                k += 1
                p = await stream_get(ctx, dut.o)
                assert p.last == (b == nb - 1)
                out += list(p.e)
            assert all(v == 0 for v in out[len(s):])                  # lanes not kept
            got_e.append(np.array(out[:len(s)]))

    async def get_total(ctx):
        for _ in vectors:
            if len(got_t) % 2:
                await ctx.tick()
            got_t.append(await stream_get(ctx, dut.total))

    run_simulation(dut, put, get, get_total)
    return got_e, got_t


def random_vectors(rng, count, lo=1, hi=64):
    vectors = []
    for _ in range(count):
        n = int(rng.integers(lo, hi + 1))
        mag = 1 << int(rng.integers(0, 32))
        centre = int(rng.integers(I32[0] + mag, I32[1] - mag + 1)) if mag < 2 ** 31 else 0
        s = np.clip(centre + rng.integers(-mag, mag, n), *I32)
        real = math.log2(math.e) * 2 ** 8 * 10.0 ** rng.uniform(-9, 0)
        mult, shift = (int(v) for v in nx.host_multiplier(real))
        vectors.append((s, mult, shift))
    return vectors


@pytest.mark.parametrize("cfg", CONFIGS, ids=IDS)
def test_softmax_weights_random(cfg):
    rng = np.random.default_rng(cfg.lanes)
    vectors = [
        (np.full(13, 12345), 47274, 15),                       # all equal: every e = 2^16
        (np.array([I32[1], I32[0], 0, I32[1]]), 65535, 0),     # widest gap, no shift
        (np.array([I32[1], I32[0], 0, -1, 1]), 65535, 63),     # largest shift: all 2^16
        (np.array([7]), 1, 0),                                 # one element
        (np.arange(64) * 16, 256, 8),                          # gaps of 1/16 ... whole octaves
        (np.arange(40) - 2 ** 31, 65535, 0),                   # max at the end; zeros
    ] + random_vectors(rng, 36)
    assert sum(len(v[0]) for v in vectors) >= 1000
    got_e, got_t = simulate_weights(SoftmaxWeights(cfg, max_len=64), vectors)
    for (s, mult, shift), e, t in zip(vectors, got_e, got_t):
        want = nx.softmax_weights(s, mult, shift)
        np.testing.assert_array_equal(e, want)
        assert t == int(want.sum())


def test_softmax_weights_timing():
    dut = SoftmaxWeights(TINY, max_len=64)

    async def before(ctx):
        ctx.set(dut.total.ready, 1)
        await stream_put(ctx, dut.i, {"s": [1, 2, 3, 4], "keep": 15, "last": 0})

    beat = {"s": [5, 6, 7, 8], "keep": 15, "last": 1}
    assert first_valid_after_accept(dut, dut.i, dut.o, beat, before=before) \
        == dut.LOAD_TO_EMIT == 3 + 2 + 4


# -- reciprocal and normaliser -------------------------------------------------------------
def test_reciprocal_random_and_edges():
    rng = np.random.default_rng(3)
    bits = 23
    e = rng.integers(1 << 16, 1 << bits, 400)
    e[:6] = [1 << 16, (1 << 16) + 1, (1 << bits) - 1, 1, 2, 3]
    got = stream_through(Reciprocal(bits), [int(v) for v in e], ready=(1, 0))
    np.testing.assert_array_equal(np.array(got), (1 << 32) // e)


def test_reciprocal_latency():
    dut = Reciprocal(23)
    assert first_valid_after_accept(dut, dut.i, dut.o, 100000) == dut.LATENCY == 34


def test_reciprocal_skips_the_quotient_bits_a_large_divisor_zeroes():
    """Attention's E ≥ 2^16: the divider starts 16 steps in (remainder 2^15, quotient
    bits 32 … 17 zero) and gives the full divider's quotient, 16 cycles sooner."""
    rng = np.random.default_rng(4)
    bits = 23
    e = rng.integers(1 << 16, 1 << bits, 400)
    e[:5] = [1 << 16, (1 << 16) + 1, (1 << 17) - 1, 1 << 17, (1 << bits) - 1]
    got = stream_through(Reciprocal(bits, min_divisor_log2=16), [int(v) for v in e],
                         ready=(1, 0))
    np.testing.assert_array_equal(np.array(got), (1 << 32) // e)
    dut = Reciprocal(bits, min_divisor_log2=16)
    assert first_valid_after_accept(dut, dut.i, dut.o, 1 << 16) == dut.LATENCY == 18
    assert dut.LATENCY == timing.ATTN_RECIP_LATENCY


@pytest.mark.parametrize("lanes", [4, 8])
def test_normalizer_random(lanes):
    rng = np.random.default_rng(lanes)
    num_bits = 31
    n = math.ceil(1200 / lanes)
    e_sum = rng.integers(1 << 16, 1 << 22, n)
    e_sum[:3] = [1 << 16, (1 << 16) + 1, (1 << 22) - 1]         # R = 2^16, 2^16 - 1, …
    recip = (1 << 32) // e_sum
    num = rng.integers(-(1 << 30), 1 << 30, (n, lanes)) >> rng.integers(0, 28, (n, lanes))
    num[0, :2] = [(1 << 30) - 1, -(1 << 30)]                     # saturation both ends
    num[1, :2] = [1 << 15, -(1 << 15)]                           # rounding ties at R = 2^16 - 1
    num[0, 2:4] = [1 << 15, -(1 << 15)]                          # ties at R = 2^16: ±0.5
    wide = rng.random(n) < 0.5
    wide[:3] = False
    wide[3:6], num[3:6], recip[3:6] = True, num[:3], recip[:3]    # the same edges, int16 out
    dut, got = Normalizer(lanes, num_bits), []

    async def put(ctx):
        for k in range(n):
            await stream_put(ctx, dut.i, {"num": ints(num[k]), "recip": int(recip[k]),
                                          "wide": int(wide[k])})

    async def get(ctx):
        for k in range(n):
            if k % 3 == 2:
                await ctx.tick()
            got.append(list(await stream_get(ctx, dut.o)))

    run_simulation(dut, put, get)
    want = np.where(wide[:, None], nx.saturate(nx.round_shift(num * recip[:, None], 24), 16),
                    nx.saturate(nx.round_shift(num * recip[:, None], 32), 8))
    np.testing.assert_array_equal(np.array(got), want)


# -- attention --------------------------------------------------------------------------
def groups(rows, banks, rng, path=0):
    """K or V rows in groups of ``banks`` (one per KV bank): (rows, keep) per group, the
    rows past the end random (stale KV that the keep mask must hide); the last ``path``
    rows (a tree row's path) a group each, in lane 0."""
    out = []
    prefix, stale = len(rows) - path, lambda: ints(rng.integers(-128, 128, len(rows[0])))
    for g in range(0, prefix, banks):
        chunk = [ints(r) for r in rows[g:min(g + banks, prefix)]]
        keep = (1 << len(chunk)) - 1
        chunk += [stale() for _ in range(banks - len(chunk))]
        out.append((chunk, keep))
    out += [([ints(r)] + [stale() for _ in range(banks - 1)], 1) for r in rows[prefix:]]
    return out


def simulate_attention(dut, heads, v_stall=(1,), o_stall=(1,), seed=0, paths=None, trace=None):
    """heads: list of (q, k, v, mult, shift, wide) → list of outputs (int16 when wide).
    With ``dut.banks ≥ 2`` the rows go in groups, stale rows past the end; ``paths[i]``
    of head ``i``'s last rows go a group each (a tree row's path). ``trace``, a dict,
    gets the cycles the K and the V groups are taken (``"k"``, ``"v"``) and each head's
    group count (``"groups"``)."""
    got = []
    B = dut.banks
    rng = np.random.default_rng(seed)
    k_beats, v_beats = [], []
    for i, (q, k, v, *_) in enumerate(heads):
        if B == 1:
            k_beats.append([{"row": ints(k[t]), "last": int(t == len(k) - 1)}
                            for t in range(len(k))])
            v_beats.append([ints(row) for row in v])
        else:
            path = paths[i] if paths else 0
            kg, vg = groups(k, B, rng, path), groups(v, B, rng, path)
            k_beats.append([{"rows": rows, "keep": keep, "last": int(i == len(kg) - 1)}
                            for i, (rows, keep) in enumerate(kg)])
            v_beats.append([rows for rows, _ in vg])

    async def put_q(ctx):
        for q, k, v, mult, shift, wide in heads:
            await stream_put(ctx, dut.q, {"q": ints(q), "mult": int(mult), "shift": int(shift),
                                          "wide": int(wide)})

    async def put_k(ctx):
        for beats in k_beats:
            for beat in beats:
                await stream_put(ctx, dut.k, beat)

    async def put_v(ctx):
        c = 0
        for beats in v_beats:
            for beat in beats:
                if not v_stall[c % len(v_stall)]:
                    await ctx.tick()
                c += 1
                await stream_put(ctx, dut.v, beat)

    async def get(ctx):
        for c in range(len(heads)):
            if not o_stall[c % len(o_stall)]:
                for _ in range(3):
                    await ctx.tick()
            got.append(np.array(list(await stream_get(ctx, dut.o))))

    async def monitor(ctx):
        cycle = 0
        while len(got) < len(heads):
            _, _, kv, kr, vv, vr = await ctx.tick().sample(dut.k.valid, dut.k.ready,
                                                          dut.v.valid, dut.v.ready)
            for name, taken in (("k", kv and kr), ("v", vv and vr)):
                if taken:
                    trace[name].append(cycle)
            cycle += 1

    if trace is not None:
        trace.update(k=[], v=[], groups=[len(beats) for beats in k_beats])
    run_simulation(dut, put_q, put_k, put_v, get, *([monitor] if trace is not None else []))
    return got


def random_heads(rng, count, d, max_t):
    heads = []
    for _ in range(count):
        t = int(rng.integers(1, max_t + 1))
        amp = int(rng.integers(1, 129))
        q = rng.integers(-amp, amp, d)
        k = rng.integers(-amp, amp, (t, d))
        v = rng.integers(-128, 128, (t, d))
        real = (amp / 127) ** -2 * 0.01 * d ** -0.5 * math.log2(math.e) * 2 ** 8 \
            * 10.0 ** rng.uniform(-1.5, 1.5)
        real = min(real, 65535.0)                # tiny amplitudes: the largest legal scale
        mult, shift = (int(x) for x in nx.host_multiplier(real))
        heads.append((q, k, v, mult, shift, bool(rng.random() < 0.5)))
    return heads


def edge_heads(rng, d):
    """The edge heads, each once with an int8 and once with a wide (int16) output."""
    return [head + (wide,) for wide in (False, True) for head in _edge_heads(rng, d)]


def _edge_heads(rng, d):
    full = np.full(d, -128)
    return [
        (rng.integers(-128, 128, d), rng.integers(-128, 128, (1, d)),
         rng.integers(-128, 128, (1, d)), 40000, 20),                      # T = 1: R = 2^16
        (full, np.full((8, d), -128), np.full((8, d), 127), 65535, 0),     # all equal, +sat edge
        (full, np.full((8, d), -128), np.full((8, d), -128), 65535, 0),    # all equal, -128
        (full, np.tile([[-128], [127]], (4, d)), rng.integers(-128, 128, (8, d)), 65535, 0),
        (full, rng.integers(-128, 128, (9, d)), rng.integers(-128, 128, (9, d)), 65535, 63),
        (np.zeros(d, np.int64), rng.integers(-128, 128, (5, d)),
         rng.integers(-128, 128, (5, d)), 12345, 9),                       # zero query
    ]


@pytest.mark.parametrize("cfg", CONFIGS, ids=IDS)
def test_attention_random(cfg):
    rng = np.random.default_rng(cfg.head_dim)
    d = cfg.head_dim
    heads = edge_heads(rng, d) + random_heads(rng, math.ceil(1000 / d), d, 40)
    got = simulate_attention(Attention(cfg), heads, v_stall=(1, 1, 1, 0), o_stall=(1, 0))
    for (q, k, v, mult, shift, wide), o in zip(heads, got):
        np.testing.assert_array_equal(o, nx.attention(q, k, v, mult, shift, 16 if wide else 8))
    assert sum(len(o) for o in got) >= 1000
    # a wide output is V's scale / 2^8: |o| ≤ 128·2^8, so int16 saturates only at -32768
    for w, (lo, hi) in ((False, (-128, 127)), (True, (-32768, 127 << 8))):
        outs = np.concatenate([o for o, h in zip(got, heads) if h[5] == w])
        assert (outs == hi).any() and (outs == lo).any()


def eleven_bit_heads(rng, count, d, max_t):
    """Heads with 11-bit queries (ATTN IN16's, already saturated to ±1023), scores up to
    2^3 times an int8 query's, and softmax scales spread around their range; the first
    ones at the edges: q ±1023 against K −128 and 127, every product at its extreme."""
    heads = []
    for i in range(count):
        t = int(rng.integers(1, max_t + 1))
        q_amp = 1023 if i < 4 else int(rng.integers(1, 1024))
        q = rng.integers(-q_amp, q_amp + 1, d)
        k = rng.integers(-128, 128, (t, d))
        if i < 4:
            q = np.full(d, 1023 if i % 2 else -1023)
            k = np.tile([[-128], [127]], (-(-t // 2), d))[:t] if t > 1 else np.full((1, d), -128)
        v = rng.integers(-128, 128, (t, d))
        spread = max(1, int(np.ptp(k @ q)))
        real = min(8 * 2 ** 8 / spread * 10.0 ** rng.uniform(-1, 1), 65535.0)
        mult, shift = (int(x) for x in nx.host_multiplier(real))
        heads.append((q, k, v, mult, shift, bool(rng.random() < 0.5)))
    return heads


@pytest.mark.parametrize("cfg", [TINY, B16], ids=["b1", "b16"])
def test_attention_11_bit_queries(cfg):
    """Queries of 11 bits (ATTN IN16) against numerics.attention(in16=True): one bank's
    plain products and 16 banks' packed ones (two banks' K times one query element in one
    DSP product), ≥ 1000 outputs, mixed with int8 queries in one stream."""
    rng = np.random.default_rng(200 + cfg.kv_banks)
    d = cfg.head_dim
    eleven = eleven_bit_heads(rng, math.ceil(1000 / d) + 4, d, min(cfg.kv_positions, 40))
    heads = eleven + random_heads(rng, 6, d, 20)
    in16 = [True] * len(eleven) + [False] * 6
    got = simulate_attention(Attention(cfg), heads, v_stall=(1, 1, 0), o_stall=(1, 0), seed=3)
    for (q, k, v, mult, shift, wide), o, wide_q in zip(heads, got, in16):
        np.testing.assert_array_equal(o, nx.attention(q, k, v, mult, shift, 16 if wide else 8, wide_q))
    assert sum(len(o) for o, w in zip(got, in16) if w) >= 1000


def wide_kv_heads(rng, count, d, max_t, kv_bits):
    """Heads over K and V of ``kv_bits``-bit elements (a wider KV cache,
    numerics.kv_entry), 16-bit (IN16, already saturated to ±32767) or int8 queries,
    softmax scales spread around their range; the first ones at the edges: every K
    element at its most negative or largest value against q ±32767, and V all at one
    extreme."""
    lo, hi = -(1 << (kv_bits - 1)), (1 << (kv_bits - 1)) - 1
    q_limit = (1 << (nx.attention_query_bits(kv_bits) - 1)) - 1
    heads = []
    for i in range(count):
        t = int(rng.integers(1, max_t + 1))
        q = rng.integers(-q_limit, q_limit + 1, d) if i % 3 else rng.integers(-128, 128, d)
        k, v = rng.integers(lo, hi + 1, (t, d)), rng.integers(lo, hi + 1, (t, d))
        if i < 4:
            q = np.full(d, q_limit if i % 2 else -q_limit)
            k = np.tile([[lo], [hi]], (-(-t // 2), d))[:t]
            v = np.full((t, d), hi if i % 2 else lo)
        spread = max(1, int(np.ptp(k @ q)))
        real = min(8 * 2 ** 8 / spread * 10.0 ** rng.uniform(-1, 1), 65535.0)
        mult, shift = (int(x) for x in nx.host_multiplier(real))
        heads.append((q, k, v, mult, shift, i < 4 or bool(rng.random() < 0.5)))
    return heads


@pytest.mark.parametrize("cfg", [TINY.with_changes(kv_banks=2, kv_bits=12),
                                 TINY.with_changes(kv_banks=16, kv_bits=12),
                                 TINY.with_changes(kv_banks=4, kv_bits=16)],
                         ids=["b2kv12", "b16kv12", "b4kv16"])
def test_attention_wide_kv_elements(cfg):
    """K and V elements wider than int8 (``kv_bits``: plain, unpacked score products, wider
    e·V products on DSPs and in logic, the output shifted by ``kv_bits − 8``) against
    numerics.attention(kv_bits=…): edges, then random heads, ≥ 1000 outputs, int8 and
    int16 outputs in one stream."""
    rng = np.random.default_rng(300 + cfg.kv_bits + cfg.kv_banks)
    d = cfg.head_dim
    heads = wide_kv_heads(rng, math.ceil(1000 / d) + 4, d, min(cfg.kv_positions, 40), cfg.kv_bits)
    got = simulate_attention(Attention(cfg), heads, v_stall=(1, 1, 0), o_stall=(1, 0), seed=4)
    outs = []
    for i, ((q, k, v, mult, shift, wide), o) in enumerate(zip(heads, got)):
        want = nx.attention(q, k, v, mult, shift, 16 if wide else 8, i % 3 != 0, cfg.kv_bits)
        np.testing.assert_array_equal(o, want, err_msg=f"head {i}")
        outs.append(o)
    assert sum(map(len, outs)) >= 1000
    # the edge heads' V extremes come out near the int16 output's ends (V's scale ·
    # 2^(kv_bits − 16); the reciprocal's floor takes a little off)
    wide_outs = np.concatenate([o for o, h in zip(outs, heads) if h[5]])
    assert wide_outs.max() > 0.99 * 32767 and wide_outs.min() < -0.99 * 32768


def test_a_wide_kv_output_shift_mutation_is_caught():
    """The Normalizer without the ``kv_bits − 8`` output shift fails the wide-KV check."""
    import dfvg_hw.attention as attention_module
    from sequencer_cases import mutant
    bad = mutant(attention_module, "+ (self.kv_bits - nx.ACT_BITS)", "+ 0", shared=())
    cfg = TINY.with_changes(kv_banks=2, kv_bits=12)
    rng = np.random.default_rng(5)
    heads = wide_kv_heads(rng, 6, cfg.head_dim, 12, cfg.kv_bits)
    got = simulate_attention(bad.Attention(cfg), heads)
    assert any(not np.array_equal(o, nx.attention(q, k, v, mult, shift, 16 if wide else 8,
                                                  i % 3 != 0, cfg.kv_bits))
               for i, ((q, k, v, mult, shift, wide), o) in enumerate(zip(heads, got)))


def test_attention_full_kv_buffer():
    """T = kv_positions (the score buffer full) with the largest sums."""
    cfg = TINY
    rng = np.random.default_rng(11)
    t, d = cfg.kv_positions, cfg.head_dim
    heads = [(np.full(d, -128), np.full((t, d), -128), np.full((t, d), -128), 65535, 63, False),
             (rng.integers(-128, 128, d), rng.integers(-128, 128, (t, d)),
              rng.integers(-128, 128, (t, d)), 50000, 24, True)]
    got = simulate_attention(Attention(cfg), heads)
    for (q, k, v, mult, shift, wide), o in zip(heads, got):
        np.testing.assert_array_equal(o, nx.attention(q, k, v, mult, shift, 16 if wide else 8))


def banked_edge_heads(rng, d, banks, max_t):
    """Lengths at the bank edges: t = 1, t mod B = 0, t mod B = B − 1, t = kv_positions;
    a saturating head (every score equal and extreme) and the largest max-to-score gap."""
    heads = []
    for t in sorted({1, banks, banks - 1 or 1, banks + 1, 2 * banks, 2 * banks - 1, max_t}):
        heads.append((rng.integers(-128, 128, d), rng.integers(-128, 128, (t, d)),
                      rng.integers(-128, 128, (t, d)), 50000, 24, bool(t % 2)))
    full = np.full(d, -128)
    heads += [(full, np.full((banks + 1, d), -128), np.full((banks + 1, d), 127), 65535, 0, False),
              (full, np.tile([[-128], [127]], (banks + 1, d)),
               rng.integers(-128, 128, (2 * banks + 2, d)), 65535, 0, True)]
    return heads


@pytest.mark.parametrize("cfg", BANKED + [B16], ids=BANKED_IDS + ["b16"])
def test_banked_attention_random(cfg):
    """B rows a cycle against numerics.attention: the edge lengths, then random heads;
    the rows past T in the last group are random, as stale KV would be."""
    rng = np.random.default_rng(100 + cfg.kv_banks)
    d, B = cfg.head_dim, cfg.kv_banks
    heads = banked_edge_heads(rng, d, B, cfg.kv_positions) \
        + random_heads(rng, math.ceil(400 / d), d, cfg.kv_positions)
    got = simulate_attention(Attention(cfg), heads, v_stall=(1, 1, 0), o_stall=(1, 0), seed=B)
    for (q, k, v, mult, shift, wide), o in zip(heads, got):
        np.testing.assert_array_equal(o, nx.attention(q, k, v, mult, shift, 16 if wide else 8))
    assert sum(len(o) for o in got) >= 400


@pytest.mark.parametrize("cfg", BANKED[1:] + [B16], ids=BANKED_IDS[1:] + ["b16"])
def test_banked_attention_with_paths(cfg):
    """A tree row's heads (docs/isa.md §9.2): the prefix's groups, then each path row a
    group of its own in lane 0 (stale rows beside it); up to the fullest score buffer,
    ``kv_positions − L`` positions and the longest path ``L`` the unit is built for."""
    rng = np.random.default_rng(200 + cfg.kv_banks)
    d, B, P, L = cfg.head_dim, cfg.kv_banks, cfg.kv_positions, 12
    dut = Attention(cfg, path_entries=L)
    assert dut.depth == -(-P // B) + L
    lengths = [(1, 1), (B, 3), (B + 1, 1), (2 * B - 1, L), (P - L, L), (P - 5, 5), (3, 0)]
    heads, paths = [], []
    for prefix, path in lengths:
        t = prefix + path
        heads.append((rng.integers(-128, 128, d), rng.integers(-128, 128, (t, d)),
                      rng.integers(-128, 128, (t, d)), int(rng.integers(20000, 60000)),
                      int(rng.integers(18, 26)), bool(rng.random() < 0.5)))
        paths.append(path)
    got = simulate_attention(dut, heads, v_stall=(1, 0), o_stall=(1, 0), seed=B, paths=paths)
    for (q, k, v, mult, shift, wide), o in zip(heads, got):
        np.testing.assert_array_equal(o, nx.attention(q, k, v, mult, shift, 16 if wide else 8))


def test_banked_attention_mutation_is_caught(monkeypatch):
    """The banked check can fail: a group maximum that also takes the lanes past T (stale
    rows) gives other outputs; so does a normaliser reading the accumulators instead of
    the held numerators while the next head runs."""
    import dfvg_hw.attention as attention_module
    from sequencer_cases import mutant
    cfg = BANKED[1]
    rng = np.random.default_rng(7)
    d = cfg.head_dim
    heads = [(rng.integers(-128, 128, d), rng.integers(-128, 128, (t, d)),
              rng.integers(-128, 128, (t, d)), 50000, 24, False) for t in (1, 5, 6, 7)]
    want = [nx.attention(q, k, v, mult, shift, 8) for q, k, v, mult, shift, _ in heads]
    bad = mutant(attention_module, "[Mux(s_keep[b], bank_scores[b], lo_score)\n",
                 "[bank_scores[b] if 1 else lo_score\n", shared=()).Attention(cfg)
    got = simulate_attention(bad, heads, seed=1)
    assert any((o != w).any() for o, w in zip(got, want))
    # heads overlap: the normaliser must read the held numerators, not the accumulators
    # that the next head has already cleared
    bad = mutant(attention_module, "nm.i.payload.num[j].eq(num_hold[j])",
                 "nm.i.payload.num[j].eq(num[0][j])", shared=()).Attention(cfg)
    got = simulate_attention(bad, heads, seed=1)
    assert any((o != w).any() for o, w in zip(got, want))
    got = simulate_attention(Attention(cfg), heads, seed=1)
    assert all((o == w).all() for o, w in zip(got, want))


def test_packed_products_exact():
    """dsp_pack: two products in one multiplier, ``(hi·2^18 + lo)·w`` split back into
    ``hi·w`` and ``lo·w`` exactly: every int8 edge pair, then random operands (and the
    matrix unit's 9-bit digit 128)."""
    edges = [-128, -127, -1, 0, 1, 127]
    rng = np.random.default_rng(11)
    vectors = [(h, l, w) for h in edges + [128] for l in edges + [128] for w in edges]
    vectors += [tuple(int(x) for x in rng.integers(-128, 128, 3)) for _ in range(1500)]
    _check_packed_products(vectors, operand_bits=9, w_bits=8, product_bits=18)
    assert len(vectors) > 1700


def test_packed_products_with_11_bit_multiplicands():
    """The attention unit's packed score products: K elements (int8) times an 11-bit query
    element (ATTN IN16, |w| ≤ 1023) still split exactly: every edge, then random."""
    edges, w_edges = [-128, -127, -1, 0, 1, 127], [-1023, -1022, -129, -1, 0, 1, 128, 1022, 1023]
    rng = np.random.default_rng(12)
    vectors = [(h, l, w) for h in edges for l in edges for w in w_edges]
    vectors += [(int(h), int(l), int(w)) for h, l, w in zip(rng.integers(-128, 128, 1500),
                                                            rng.integers(-128, 128, 1500),
                                                            rng.integers(-1023, 1024, 1500))]
    _check_packed_products(vectors, operand_bits=8, w_bits=nx.ATTN_Q_BITS,
                           product_bits=nx.ACT_BITS + nx.ATTN_Q_BITS - 1)     # int8 K's
    assert len(vectors) > 1800


def _check_packed_products(vectors, *, operand_bits: int, w_bits: int, product_bits: int):
    """Simulate ``packed_operand(hi, lo) · w`` split by ``unpacked_products`` for every
    ``(hi, lo, w)`` and assert both products exact."""
    from amaranth import Module, Signal, signed
    from amaranth.sim import Simulator
    from dfvg_hw.dsp_pack import packed_operand, unpacked_products
    hi, lo, w = Signal(signed(operand_bits)), Signal(signed(operand_bits)), Signal(signed(w_bits))
    hi_w, lo_w = Signal(signed(product_bits)), Signal(signed(product_bits))
    m = Module()
    hi_floor, borrow, lo_prod = unpacked_products(packed_operand(hi, lo) * w)
    m.d.comb += [hi_w.eq(hi_floor + borrow), lo_w.eq(lo_prod)]

    async def tb(ctx):
        for h, l, x in vectors:
            ctx.set(hi, h), ctx.set(lo, l), ctx.set(w, x)
            assert (ctx.get(hi_w), ctx.get(lo_w)) == (h * x, l * x), (h, l, x)

    sim = Simulator(m)
    sim.add_testbench(tb)
    sim.run()


@pytest.mark.parametrize("old, new", [
    ("p >> PACK_SHIFT, p[PACK_SHIFT - 1]", "p >> PACK_SHIFT, 0 * p[PACK_SHIFT - 1]"),
    ("terms.append(-Mux(", "terms.append(Mux("),
], ids=["packed-K-without-borrow", "shift-add-V-unsigned"])
def test_a_16_bank_mutation_is_caught(old, new):
    """The 16-bank checks can fail: packed K products that drop the borrow of a negative
    low product, or shift-and-add e·V products (banks 8 … 15) that take V's sign bit as
    +128, give other outputs."""
    import dfvg_hw.attention as attention_module
    import dfvg_hw.dsp_pack as pack_module
    from sequencer_cases import mutant
    rng = np.random.default_rng(17)
    d = B16.head_dim
    # K rows a few units apart: scores within a few hundred, so that many rows share the
    # weight and a score a few units off moves the output
    base = rng.integers(-120, 121, d)
    heads = [(rng.integers(-128, 128, d), base + rng.integers(-3, 4, (t, d)),
              rng.integers(-128, 128, (t, d)), 65535, 16, False) for t in (16, 23, 40)]
    want = [nx.attention(q, k, v, mult, shift, 8) for q, k, v, mult, shift, _ in heads]
    if "PACK_SHIFT" in old:                 # a copy of the unit that uses a mutant helper
        bad_module = mutant(attention_module, "V_DSP_BANKS = 8", "V_DSP_BANKS = 8", shared=())
        bad_module.unpacked_products = mutant(pack_module, old, new, shared=()).unpacked_products
    else:
        bad_module = mutant(attention_module, old, new, shared=())
    got = simulate_attention(bad_module.Attention(B16), heads, seed=1)
    assert any((o != w).any() for o, w in zip(got, want))
    got = simulate_attention(Attention(B16), heads, seed=1)
    assert all((o == w).all() for o, w in zip(got, want))


@pytest.mark.parametrize("cfg, t", [(TINY, 1), (TINY, 7), (BANKED[0], 1), (BANKED[0], 7),
                                    (BANKED[1], 8), (BANKED[2], 13)],
                         ids=["b1-t1", "b1-t7", "b2-t1", "b2-t7", "b4-t8", "b8-t13"])
def test_attention_cycles(cfg, t):
    dut = Attention(cfg)
    d, B = cfg.head_dim, cfg.kv_banks
    G = -(-t // B)
    result = []

    async def tb(ctx):
        ctx.set(dut.o.ready, 1)
        ctx.set(dut.k.valid, 1)
        ctx.set(dut.v.valid, 1)
        row = (lambda last: {"row": [1] * d, "last": last}) if B == 1 else \
            (lambda last: {"rows": [[1] * d] * B, "keep": (1 << B) - 1, "last": last})
        ctx.set(dut.k.payload, row(0))
        ctx.set(dut.v.payload, [3] * d if B == 1 else [[3] * d] * B)
        ctx.set(dut.q.payload, {"q": [1] * d, "mult": 1000, "shift": 10, "wide": 0})
        ctx.set(dut.q.valid, 1)
        await ctx.tick().until(dut.q.ready)
        ctx.set(dut.q.valid, 0)
        n, rows = 1, 0
        while not ctx.get(dut.o.valid):
            ctx.set(dut.k.payload, row(int(rows == G - 1)))
            ctx.set(dut.k.valid, rows < G)
            *_, kr = await ctx.tick().sample(dut.k.ready)
            rows += int(kr and rows < G)
            n += 1
        result.append(n)
        assert list(ctx.get(dut.o.payload)) == [3] * d

    run_simulation(dut, tb)
    levels = (B - 1).bit_length()
    # 11 besides the reciprocal (18: E ≥ 2^16 skips 16 of its steps) and the K and V groups
    assert result[0] == dut.cycles(t) == 2 * G + 4 + 2 * levels + 11 + 18


def heads_in_flight(rng, cfg, count):
    """Heads for two-heads-in-flight runs, and their path lengths (banked): the edges T =
    1 and T = kv_positions (with and without a path), then random lengths; every other
    head a GQA partner, a new q over the previous head's K and V."""
    d, P, B = cfg.head_dim, cfg.kv_positions, cfg.kv_banks
    heads, paths = [], []
    lengths = [(1, 0), (P, 0), (1, 1), (P - 3, 3), (2, 0)] if B > 1 else [(1, 0), (P, 0), (2, 0)]
    while len(lengths) < count:
        t = int(rng.integers(1, P + 1))
        path = int(rng.integers(0, min(4, t))) if B > 1 else 0
        lengths.append((t - path, path))
    for i, (prefix, path) in enumerate(lengths):
        t = prefix + path
        if i % 2 and len(heads[-1][1]) == t:                # GQA: the same K and V
            k, v = heads[-1][1], heads[-1][2]
        else:
            amp = int(rng.integers(16, 129))
            k, v = rng.integers(-amp, amp, (t, d)), rng.integers(-128, 128, (t, d))
        heads.append((rng.integers(-128, 128, d), k, v, int(rng.integers(20000, 60000)),
                      int(rng.integers(18, 26)), bool(rng.random() < 0.5)))
        paths.append(path)
    return heads, paths


def overlapped(trace) -> int:
    """Heads whose successor's first K group was taken before their own last V group:
    the score pass and the weights pass on two heads at once."""
    k_end = np.cumsum(trace["groups"])
    first_k = [trace["k"][e] for e in k_end[:-1]]           # head h + 1's first K group
    last_v = [trace["v"][e - 1] for e in k_end[:-1]]        # head h's last V group
    return sum(f < l for f, l in zip(first_k, last_v))


IN_FLIGHT = {"b1": TINY, "b2": BANKED[0], "b16": B16}


@pytest.mark.parametrize("name", list(IN_FLIGHT))
def test_two_heads_in_flight(name):
    """Heads back to back, the K and V streams always offered: head h + 1's K groups go
    in while head h's V groups do (three score buffers: the score pass of one head beside
    the weights pass of an earlier one), and every output is numerics.attention's:
    T = 1, T = kv_positions, GQA partners, tree rows with path entries (banked), random
    lengths; at least 400 output values each, 1200 over the three."""
    cfg = IN_FLIGHT[name]
    d, B = cfg.head_dim, cfg.kv_banks
    rng = np.random.default_rng(300 + B)
    heads, paths = heads_in_flight(rng, cfg, math.ceil(400 / d))
    trace = {}
    dut = Attention(cfg, path_entries=3 if B > 1 else 0)
    got = simulate_attention(dut, heads, seed=B, paths=paths if B > 1 else None, trace=trace)
    for (q, k, v, mult, shift, wide), o in zip(heads, got):
        np.testing.assert_array_equal(o, nx.attention(q, k, v, mult, shift, 16 if wide else 8))
    assert sum(len(o) for o in got) >= 400
    assert overlapped(trace) >= len(heads) // 2, overlapped(trace)


@pytest.mark.parametrize("old, new", [
    ("wp.addr.eq(buf_base[s_buf] + row)", "wp.addr.eq(buf_base[k_buf] + row)"),
], ids=["scores-to-the-next-heads-buffer"])
def test_an_in_flight_mutation_is_caught(old, new):
    """The heads-in-flight check can fail: a draining head's last scores written to the
    buffer of the head whose q came after it give other outputs."""
    import dfvg_hw.attention as attention_module
    from sequencer_cases import mutant
    cfg = BANKED[0]
    heads, paths = heads_in_flight(np.random.default_rng(5), cfg, 12)
    want = [nx.attention(q, k, v, mult, shift, 16 if wide else 8)
            for q, k, v, mult, shift, wide in heads]
    bad = mutant(attention_module, old, new, shared=()).Attention(cfg, path_entries=3)
    trace = {}
    got = simulate_attention(bad, heads, seed=2, paths=paths, trace=trace)
    assert any((o != w).any() for o, w in zip(got, want)) or overlapped(trace) == 0
    trace = {}
    got = simulate_attention(Attention(cfg, path_entries=3), heads, seed=2, paths=paths,
                             trace=trace)
    assert all((o == w).all() for o, w in zip(got, want)) and overlapped(trace) >= 6


#: long heads (G = 64 groups): the weights pass keeps up with the reciprocal's 34 cycles
RUN_AHEAD = TINY.with_changes(kv_banks=2, kv_positions=128)


def head_gaps(cfg, mutation=None) -> tuple[list[int], list[int]]:
    """Cycles between a head's last K group and the next head's first, and the same for
    the V groups: heads of ``kv_positions`` rows back to back with every stream offered
    (outputs checked)."""
    import dfvg_hw.attention as attention_module
    from sequencer_cases import mutant
    rng = np.random.default_rng(19)
    d, t = cfg.head_dim, cfg.kv_positions
    heads = [(rng.integers(-128, 128, d), rng.integers(-128, 128, (t, d)),
              rng.integers(-128, 128, (t, d)), 40000, 22, False) for _ in range(6)]
    module = mutant(attention_module, *mutation, shared=()) if mutation else attention_module
    trace = {}
    got = simulate_attention(module.Attention(cfg), heads, trace=trace)
    for (q, k, v, mult, shift, wide), o in zip(heads, got):
        np.testing.assert_array_equal(o, nx.attention(q, k, v, mult, shift, 8))
    ends = np.cumsum(trace["groups"])
    return tuple([trace[side][e] - trace[side][e - 1] for e in ends[:-1]] for side in "kv")


def test_score_pass_runs_ahead():
    """The next head's K groups follow the last of a head's after two cycles (the q beat
    between): the score pass takes q while the head's scores are still in the trees (a
    third score buffer); and the weights pass takes a head on the edge the one before
    meets its last V group (two accumulator sets: it does not wait for that head's E to
    reach the reciprocal), so its first V group follows the exp path's latency later."""
    assert head_gaps(RUN_AHEAD) == ([2] * 5, [kv_timing.ATTN_START_TO_JOIN] * 5)


@pytest.mark.parametrize("old, new", [
    ("SCORE_BUFFERS = kv_timing.ATTN_SCORE_BUFFERS", "SCORE_BUFFERS = 2"),
    ("self.q.ready.eq(~k_open & ~in_use.bit_select(alloc, 1))",
     "self.q.ready.eq(~k_open & (in_use == 0))"),
    ("set_free.eq(~set_busy.bit_select(v_set, 1)", "set_free.eq((set_busy == 0)"),
], ids=["two-score-buffers", "one-head-at-a-time", "one-accumulator-set"])
def test_a_run_ahead_mutation_is_caught(old, new):
    """The run-ahead check can fail: with two score buffers, or a q taken only once every
    buffer has been read, the next head's K waits for the weights pass; with the weights
    pass waiting for the previous head's E to reach the reciprocal the V groups wait."""
    k, v = head_gaps(RUN_AHEAD, (old, new))
    assert max(k) > 2 or max(v) > kv_timing.ATTN_START_TO_JOIN


# -- lint ----------------------------------------------------------------------------------
@pytest.mark.parametrize("make", [
    lambda: SoftmaxExp(TINY.lanes, 32), lambda: SoftmaxWeights(TINY), lambda: Reciprocal(23),
    lambda: Normalizer(TINY.lanes, 31), lambda: Attention(TINY), lambda: Attention(BANKED[0]),
], ids=["exp", "weights", "reciprocal", "normalizer", "attention", "attention-b2"])
def test_lint_clean(make, monkeypatch):
    monkeypatch.setitem(rtl_lint.VERILATOR_WAIVERS, "DECLFILENAME",
                        "Amaranth emits every submodule into the top module's file")
    dut = make()
    name = type(dut).__name__.lower()
    clean, output = verilator_lint(to_verilog(dut, name), name)
    assert clean, output
