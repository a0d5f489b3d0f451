"""RoPE RTL against numerics.rope, bit for bit."""

import numpy as np
import pytest

from dfvg_hw.spec import numerics as nx
from dfvg_hw.spec.config import get_preset
from dfvg_hw.rope import Rope
from sim import lint as rtl_lint
from dfvg_hw.verilog import to_verilog
from sim.lint import verilator_lint
from sim.testbench import first_valid_after_accept, stream_through

TINY = get_preset("tiny")
CONFIGS = [TINY, TINY.with_changes(name="tiny-hd32", head_dim=32)]
IDS = [f"head_dim{c.head_dim}" for c in CONFIGS]
READY = [1, 0, 1, 1, 0]


def ints(v):
    return [int(x) for x in v]


def simulate(dut, beats, ready=READY):
    return [(list(p.a), list(p.b)) for p in stream_through(dut, beats, ready=ready)]


def rope_tables(rng, n, half):
    """Table rows: real angles (host_rope_table) for most, raw int16 extremes for some."""
    pos = rng.integers(0, 4096, n)
    inv = 10000.0 ** (-np.arange(half) / half)
    ang = pos[:, None] * inv[None, :]
    tab = nx.host_rope_table(np.cos(ang), np.sin(ang)).astype(np.int64)
    cos, sin = tab[..., 0], tab[..., 1]
    raw = rng.random(n) < 0.25
    cos[raw] = rng.integers(-2 ** 15, 2 ** 15, (raw.sum(), half))
    sin[raw] = rng.integers(-2 ** 15, 2 ** 15, (raw.sum(), half))
    return cos, sin


@pytest.mark.parametrize("cfg", CONFIGS, ids=IDS)
def test_random_heads(cfg):
    """One head per beat (pairs = head_dim / 2), ≥ 1000 elements, with edge cases."""
    rng = np.random.default_rng(cfg.head_dim)
    d, half = cfg.head_dim, cfg.head_dim // 2
    n = -(-1200 // d)
    x = rng.integers(-128, 128, (n, d))
    cos, sin = rope_tables(rng, n, half)
    # edges: +/- saturation (pair norm > 127.5), all-equal inputs, zero head, extreme table
    x[0], cos[0], sin[0] = 127, 11585, 11585              # 45°, norm 179: a' ≈ 0, b' → +127
    x[1], cos[1], sin[1] = -128, 11585, 11585              # b' → -128
    x[2], cos[2], sin[2] = -128, -32768, -32768            # largest products
    x[3], cos[3], sin[3] = 127, 32767, -32768
    x[4], cos[4], sin[4] = 0, 16384, 0                     # zero head
    x[5], cos[5], sin[5] = 77, 16384, 0                    # identity rotation
    x[6, :half], x[6, half:], cos[6], sin[6] = 1, 0, 8192, 8192   # round half up: 0.5 → 1
    x[7, :half], x[7, half:], cos[7], sin[7] = -1, 0, 8192, 8192  # -0.5 → 0
    beats = [{"a": ints(x[k, :half]), "b": ints(x[k, half:]), "cos": ints(cos[k]),
              "sin": ints(sin[k]), "wide": 0} for k in range(n)]
    got = simulate(Rope(cfg), beats)
    rtl = np.array([a + b for a, b in got])
    want = np.stack([nx.rope(x[k], cos[k], sin[k]) for k in range(n)])
    np.testing.assert_array_equal(rtl, want)
    assert (want == 127).any() and (want == -128).any()


def test_heads_larger_and_smaller_than_a_beat():
    """A 32-dim head on 8 pairs per beat takes 2 beats; a 10-dim head uses 5 of 8 pairs."""
    rng = np.random.default_rng(7)
    dut = Rope(TINY)                                        # 8 pairs per beat
    p = dut.pairs
    beats, checks = [], []
    for d in (32, 10, 32, 16):
        half = d // 2
        x = rng.integers(-128, 128, d)
        cos, sin = rope_tables(rng, 1, half)
        cos, sin = cos[0], sin[0]
        want = nx.rope(x, cos, sin)
        for j0 in range(0, half, p):
            idx = np.arange(j0, min(j0 + p, half))
            pad = p - len(idx)
            beats.append({"a": ints(x[idx]) + [0] * pad, "b": ints(x[idx + half]) + [0] * pad,
                          "cos": ints(cos[idx]) + [0] * pad, "sin": ints(sin[idx]) + [0] * pad,
                          "wide": 0})
            checks.append((idx, half, want))
    got = simulate(dut, beats)
    for (a, b), (idx, half, want) in zip(got, checks):
        n = len(idx)
        np.testing.assert_array_equal(a[:n], want[idx])
        np.testing.assert_array_equal(b[:n], want[idx + half])


@pytest.mark.parametrize("cfg", CONFIGS, ids=IDS)
def test_random_wide_heads_between_int8_ones(cfg):
    """int16 heads (ROPE WIDE), ≥ 1000 elements, interleaved at random with int8 heads in
    one stream under back-pressure, so each beat's width travels with its data: int16
    saturation both ways, the largest products, rounding at ±0.5."""
    rng = np.random.default_rng(100 + cfg.head_dim)
    d, half = cfg.head_dim, cfg.head_dim // 2
    n = -(-2400 // d)
    wide = rng.random(n) < 0.6
    wide[:6] = True
    x = np.where(wide[:, None], rng.integers(-2 ** 15, 2 ** 15, (n, d)), rng.integers(-128, 128, (n, d)))
    cos, sin = rope_tables(rng, n, half)
    x[0], cos[0], sin[0] = 32767, 11585, 11585            # a' ≈ 0, b' → +32767
    x[1], cos[1], sin[1] = -32768, 11585, 11585           # b' → -32768
    x[2], cos[2], sin[2] = -32768, -32768, -32768         # |a·c ± b·s| = 2^31: the sums' top
    x[3], cos[3], sin[3] = 32767, 32767, -32768
    x[4, :half], x[4, half:], cos[4], sin[4] = 1, 0, 8192, 8192   # 0.5 → 1
    x[5, :half], x[5, half:], cos[5], sin[5] = -1, 0, 8192, 8192  # -0.5 → 0
    beats = [{"a": ints(x[k, :half]), "b": ints(x[k, half:]), "cos": ints(cos[k]),
              "sin": ints(sin[k]), "wide": int(wide[k])} for k in range(n)]
    got = simulate(Rope(cfg), beats, ready=[1, 1, 0, 1, 0, 0, 1])
    rtl = np.array([a + b for a, b in got])
    want = np.stack([nx.rope(x[k], cos[k], sin[k], 16 if wide[k] else 8) for k in range(n)])
    np.testing.assert_array_equal(rtl, want)
    assert (want[wide] == 32767).any() and (want[wide] == -32768).any()
    assert (want[~wide] == 127).any() and (np.abs(want[wide]) > 127).mean() > 0.5
    assert int(wide.sum()) * d >= 1000


def test_latency():
    beat = {"a": [1] * 8, "b": [2] * 8, "cos": [16384] * 8, "sin": [0] * 8, "wide": 0}
    dut = Rope(TINY)
    assert first_valid_after_accept(dut, dut.i, dut.o, beat) == Rope.LATENCY == 3


def test_lint_clean(monkeypatch):
    monkeypatch.setitem(rtl_lint.VERILATOR_WAIVERS, "DECLFILENAME",
                        "Amaranth emits every submodule into the top module's file")
    clean, output = verilator_lint(to_verilog(Rope(TINY), "rope"), "rope")
    assert clean, output
