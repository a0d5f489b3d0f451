"""Fixed-point numerics of the draft engine — the single definition both sides use.

Every function here is what the hardware computes, bit for bit: integer-only, with
lookup tables and shifts an RTL datapath implements directly. The functional model in
``sim`` calls these functions; the RTL tests compare against them. Floats appear only
in the compile-time helpers at the bottom (prefixed ``host_``), which build tables and
multipliers on the host.

All array functions take and return ``numpy`` integer arrays and compute in int64; the
bounds in each docstring guarantee int64 never overflows. Right shifts are arithmetic
(floor), rounding is "add half then floor" (round half up). See ``docs/numerics.md``.
"""

from __future__ import annotations

import math

import numpy as np

__all__ = [
    "ACT_BITS", "RES_BITS", "LOGIT_BITS", "LOGIT_FRAC", "PROB_BITS",
    "MULT_BITS", "EXP_FRAC", "RSQRT_INDEX_BITS", "RSQRT_BITS", "ROPE_FRAC", "RECIP_BITS",
    "GAMMA_SHIFT_MAX", "T1_MULT", "T1_SHIFT", "NORM_IN_BITS", "saturate", "round_shift", "requant", "add_bias",
    "BLOCK_MULT_BITS", "BLOCK_SHIFT", "block_matmul", "block_round",
    "residual_add", "bit_length", "rsqrt_fixed", "norm_input_shift", "rmsnorm", "exp2_neg", "softmax_weights",
    "ATTN_Q_BITS", "attention_query_bits", "attention_query", "KV_BITS_MAX", "kv_entry", "attention",
    "rope", "act_mul", "ACT_KNOTS", "ACT_KNOT_FRAC", "act_interpolate", "act_mul_wide", "ROW_EXP_BITS", "ROW_EXP_MAX", "act_mul_shift", "act_row_exponent", "row_shift",
    "topk_select", "sampler_probs", "sample_index",
    "path_score", "TREE_SCORE_ROOT", "tree_expand_greedy",
    "mix32", "rng32",
    "host_multiplier", "host_rope_table", "host_act_lut", "host_act_knots", "host_temperature",
    "RSQRT_LUT", "EXP2_LUT",
]

# -- formats ------------------------------------------------------------------------------
ACT_BITS = 8          #: activations and weights: signed int8
RES_BITS = 32         #: residual stream and embedding table: signed int32
NORM_IN_BITS = 16     #: RMSNORM squares and scales its row cut to signed int16 (norm_input_shift)
LOGIT_BITS = 16       #: logits streamed into the sampler: signed int16 ...
LOGIT_FRAC = 8        #: ... in natural-log units with 8 fractional bits (Q7.8)
PROB_BITS = 24        #: sampler probabilities: unsigned, sum exactly 2^24
MULT_BITS = 16        #: requantisation multipliers: unsigned 16-bit
BLOCK_MULT_BITS = 16  #: MATMUL BLOCKS: one unsigned 16-bit multiplier per (channel, k-tile) ...
BLOCK_SHIFT = 16      #: ... and the scaled sum is round_shift by 16 (m / 2^16 in [0, 1))
EXP_FRAC = 8          #: exp2 argument: unsigned fixed point, 8 fractional bits
RSQRT_INDEX_BITS = 8  #: fractional bits of the rsqrt LUT index
RSQRT_BITS = 15       #: rsqrt LUT values are Q1.15 (in (2^14, 2^15])
ROPE_FRAC = 14        #: cos/sin table entries are Q1.14 int16
RECIP_BITS = 32       #: attention normaliser: floor(2^32 / sum)
#: ATTN IN16's query over an int8 KV cache: an int16 q is saturated to ±(2^10 − 1), 11 bits,
#: as the score pass reads it, so that a K element times it fits 18 bits and two banks'
#: products still share one DSP48E2 (dfvg_hw/dsp_pack.py): |k · q| ≤ 128 · 1023 < 2^17
#: (over a wider cache all 16 bits: attention_query_bits)
ATTN_Q_BITS = 11
#: widest KV cache element (``cfg.kv_bits``): a KVAPPEND WIDE source is int16
KV_BITS_MAX = 16
EXP_ONE = 1 << 16     #: exp2_neg(0): weights are Q0.16 (17-bit unsigned)
GAMMA_SHIFT_MAX = 16  #: RMSNORM gamma shift bound: 15 + k (≤ 31) + 16 keeps every shift < 63
T1_MULT, T1_SHIFT = 47274, 15  #: sampler multiplier at temperature 1 (= host_temperature(1.0))
ROW_EXP_BITS = 4      #: row exponents (ACTMUL → MATMUL ROWEXP): unsigned 4-bit ...
ROW_EXP_MAX = (1 << ROW_EXP_BITS) - 1   #: ... at most 15
ACT_KNOTS = 128       #: ACTMUL IN16: the table's 128 (value, slope) knots over the int16 gate ...
ACT_KNOT_FRAC = 9     #: ... 2^9 gate steps apart: the gate's low 9 bits interpolate

_I64 = np.int64


def _as_i64(x) -> np.ndarray:
    return np.asarray(x, dtype=_I64)


def saturate(x, bits: int) -> np.ndarray:
    """Clamp to the signed *bits*-bit range."""
    lo, hi = -(1 << (bits - 1)), (1 << (bits - 1)) - 1
    # np.clip's dtype checks cost more than the clamp on the functional model's short rows
    return np.minimum(np.maximum(_as_i64(x), lo), hi)


def round_shift(x, shift) -> np.ndarray:
    """``floor((x + 2^(shift-1)) / 2^shift)`` — round half up; ``shift`` ≥ 0 (0 is a no-op)."""
    x = _as_i64(x)
    if np.ndim(shift) == 0 and shift >= 0:      # one shift for all: Python ints, no masks
        shift = int(shift)
        return np.right_shift(x + ((1 << shift) >> 1), shift)
    shift = _as_i64(shift)
    half = np.where(shift > 0, np.left_shift(_I64(1), np.maximum(shift - 1, 0)), 0)
    return np.right_shift(x + half, shift)


def requant(acc, mult, shift, bits: int = ACT_BITS) -> np.ndarray:
    """Requantise: ``sat_bits(round_shift(acc * mult, shift))``.

    ``acc`` is int32 (|acc| < 2^31), ``mult`` an unsigned 16-bit multiplier, ``shift`` in
    [0, 63]; both broadcast (per output channel or per tensor). |acc·mult| < 2^47.
    """
    return saturate(round_shift(_as_i64(acc) * _as_i64(mult), shift), bits)


def add_bias(acc, bias) -> np.ndarray:
    """A MATMUL with ``BIAS``: the per-output-channel int32 ``bias`` joins the accumulator
    exactly, before requantisation (no saturation: |acc| < 2^38 with int16 inputs, so
    |acc + bias| < 2^38 + 2^31 < 2^39 and |(acc + bias)·mult| < 2^55)."""
    return _as_i64(acc) + _as_i64(bias)


def block_round(raw) -> np.ndarray:
    """The ``BLOCKS`` accumulator from its unrounded sum ``Σ_t m_t · dot_t``:
    ``round_shift(raw, BLOCK_SHIFT)``, once, after the last tile."""
    return round_shift(raw, BLOCK_SHIFT)


def block_matmul(x, w, m, reduce: int) -> np.ndarray:
    """The accumulator of a MATMUL with ``BLOCKS`` (block-scaled int8 weights).

    ``x[..., K]`` int8 or int16 rows, ``w[N, K]`` int8, ``m[N, T]`` the unsigned 16-bit
    multipliers of each output channel's ``T = ceil(K / reduce)`` k-tiles. With
    ``dot_t[i] = Σ_{j in tile t} x_j · w_ij`` (the matrix unit's per-tile dot product):
    ``acc[i] = round_shift(Σ_t m[i, t] · dot_t[i], 16)`` (:func:`block_round`), an exact
    sum rounded once. Bounds (k < 2^16): |x_j·w_ij| ≤ 2^22 (int16 x), so the unrounded
    sum is below 2^54 and ``acc`` below 2^38, as an unscaled wide accumulator; with int8
    x below 2^46 and 2^30. BIAS, the requantisation and every output mode then take
    ``acc`` unchanged. This reference computes in int64 (exact); see numerics.md §3.
    """
    x, w, m = _as_i64(x), _as_i64(w), _as_i64(m)
    k = w.shape[1]
    tiles = -(-k // reduce)
    pad = tiles * reduce - k
    xp = np.concatenate([x, np.zeros(x.shape[:-1] + (pad,), _I64)], axis=-1)
    wp = np.concatenate([w, np.zeros((w.shape[0], pad), _I64)], axis=-1)
    dots = np.einsum("...tj,ntj->...nt", xp.reshape(x.shape[:-1] + (tiles, reduce)),
                     wp.reshape(w.shape[0], tiles, reduce))
    return block_round(np.sum(dots * m, axis=-1))


def wide_digits(x) -> tuple[np.ndarray, np.ndarray]:
    """Split int16 values into the two digits the int8 matrix unit multiplies:
    ``x = 256·hi + lo`` with ``lo ∈ [-128, 127]`` and ``hi = (x + 128) >> 8 ∈ [-128, 128]``
    (a 9-bit digit: 128 for ``x ≥ 32640``). See numerics.md §3."""
    x = _as_i64(x)
    hi = np.right_shift(x + 128, 8)
    return hi, x - 256 * hi


def residual_add(x, acc, mult, shift) -> np.ndarray:
    """Residual update: ``sat32(x + requant(acc, mult, shift, 32))`` (x is int32).

    |acc| < 2^39 (int16 inputs) and mult < 2^16, so |acc·mult| < 2^55."""
    return saturate(_as_i64(x) + requant(acc, mult, shift, RES_BITS), RES_BITS)


def bit_length(x) -> np.ndarray:
    """Each non-negative int64 element's bit length (0 for 0), exactly: a leading-one
    detector in hardware; no floats here, whose rounding would be off by one near 2^53+."""
    x = _as_i64(x)
    if x.size <= 32:        # a row's norm or a head's sum: one Python call beats 18 ufuncs
        return np.array([int(v).bit_length() for v in x.flat], dtype=_I64).reshape(x.shape)
    length = np.zeros_like(x)
    for step in (32, 16, 8, 4, 2, 1):      # binary search: how far each element shifts to 1
        big = x >= (_I64(1) << step)
        length = length + np.where(big, step, 0)
        x = np.where(big, x >> step, x)
    return length + (x > 0)


# -- reciprocal square root -------------------------------------------------------------
def _build_rsqrt_lut() -> np.ndarray:
    lo, hi = 1 << RSQRT_INDEX_BITS, 4 << RSQRT_INDEX_BITS
    u = np.arange(lo, hi, dtype=np.float64) / (1 << RSQRT_INDEX_BITS)
    return np.round((1 << RSQRT_BITS) / np.sqrt(u)).astype(_I64)


#: RSQRT_LUT[u - 2^8] = round(2^15 / sqrt(u / 2^8)) for u in [2^8, 2^10): 768 entries.
RSQRT_LUT = _build_rsqrt_lut()


def rsqrt_fixed(s) -> tuple[np.ndarray, np.ndarray]:
    """Reciprocal square root of a non-negative integer ``s`` (< 2^62).

    Returns ``(r, k)`` with ``1/sqrt(s) ≈ r · 2^-(15 + k)``: ``k = floor(log2(s) / 2)``,
    ``u = s · 2^(8 - 2k)`` truncated to an integer in [2^8, 2^10), ``r = RSQRT_LUT[u - 2^8]``.
    ``s = 0`` is taken as 1 (``r = 2^15, k = 0``): its only source is an all-zero RMSNorm
    row with ``eps = 0``, whose output is 0 whatever ``r`` is.
    Hardware: a leading-one detector, a barrel shifter and a 768-entry ROM.
    """
    s = _as_i64(s)
    if np.any(s < 0):
        raise ValueError("rsqrt_fixed needs a non-negative argument")
    s = np.maximum(s, 1)
    k = (bit_length(s) - 1) // 2
    sh = 2 * k - RSQRT_INDEX_BITS
    u = np.where(sh >= 0, s >> np.maximum(sh, 0), s << np.maximum(-sh, 0))
    return RSQRT_LUT[u - (1 << RSQRT_INDEX_BITS)], k


def norm_input_shift(x) -> np.ndarray:
    """The right shift ``p`` that brings every element of an int32 row into int16.

    ``m = OR_i (x_i XOR sign(x_i))`` (each element's one's-complement magnitude, so no
    negation is needed), ``p = max(0, bitlen(m) - 15)``, per row (shape ``[..., 1]``).
    Then ``x_i >> p`` lies in [-2^15, 2^15) for every i: the row keeps its 15 leading
    significant bits whatever its magnitude. Hardware: an OR-reduce over the row and a
    leading-one detector.
    """
    x = _as_i64(x)
    m = np.bitwise_or.reduce(np.where(x < 0, ~x, x), axis=-1, keepdims=True)
    return np.maximum(bit_length(m) - (NORM_IN_BITS - 1), 0)


def rmsnorm(x, gamma, gamma_shift: int, eps: int, out_bits: int = ACT_BITS) -> np.ndarray:
    """RMSNorm of int32 rows ``x[..., H]`` to int8 (or int16 with ``out_bits=16``).

    The row is first cut to int16 by its own shift (:func:`norm_input_shift`):
    ``p = norm_input_shift(x)``, ``x' = x >> p``, ``eps' = eps >> 2p``. Then
    ``sumsq = Σ x'² + eps'``; ``(r, k) = rsqrt_fixed(sumsq)``;
    ``y = sat(round_shift(x' · r · gamma, 15 + k + gamma_shift - (out_bits - 8)))``: a
    16-bit output keeps 8 more fractional bits. The shift cancels (``y`` depends on
    ``x / sqrt(Σx² + eps)`` only), so a residual stream of any magnitude normalises with
    16-bit squares and multipliers. An all-zero row gives ``y = 0`` for any ``eps``.
    ``gamma`` is a signed 16-bit per-channel multiplier with √H·g/s_out folded in (so the
    scale of x cancels); ``eps`` the unsigned 32-bit integer ε·H/s_x². Bounds:
    |x'·r·gamma| < 2^46, sumsq < H·2^30 + 2^32.
    """
    x = _as_i64(x)
    p = norm_input_shift(x)
    xs = np.right_shift(x, p)
    sumsq = np.sum(xs * xs, axis=-1, keepdims=True) + np.right_shift(_I64(eps), 2 * p)
    r, k = rsqrt_fixed(sumsq)
    shift = RSQRT_BITS + k + gamma_shift - (out_bits - ACT_BITS)
    return saturate(round_shift(xs * r * _as_i64(gamma), shift), out_bits)


# -- exponentials and softmax ---------------------------------------------------------
#: EXP2_LUT[f] = round(2^16 · 2^(-f/256)), f in [0, 256): values in (2^15, 2^16].
EXP2_LUT = np.round(65536.0 * np.exp2(-np.arange(256) / 256.0)).astype(_I64)


def exp2_neg(u) -> np.ndarray:
    """``2^(-u / 2^8)`` in Q0.16 for unsigned fixed-point ``u``: ``EXP2_LUT[u & 255] >> (u >> 8)``.

    Arguments with an integer part ≥ 17 give exactly 0.
    """
    u = _as_i64(u)
    n = u >> EXP_FRAC
    v = EXP2_LUT[u & ((1 << EXP_FRAC) - 1)]
    return np.where(n >= 17, 0, v >> np.minimum(n, 17))


def softmax_weights(scores, mult: int, shift: int) -> np.ndarray:
    """Unnormalised softmax weights (Q0.16) along the last axis of int32 ``scores``.

    ``u = round_shift((max - s) · mult, shift)`` turns the score gap into log2 units with
    8 fractional bits (mult/2^shift ≈ scale · log2(e) · 2^8); then ``exp2_neg(u)``. The
    maximum always gets exactly 2^16. |max - s| < 2^32 and mult < 2^16, so the product
    stays below 2^48.
    """
    s = _as_i64(scores)
    d = np.max(s, axis=-1, keepdims=True) - s
    return exp2_neg(round_shift(d * _I64(mult), shift))


def attention_query_bits(kv_bits: int = ACT_BITS) -> int:
    """Bits of an int16 query (``ATTN IN16``) the score pass reads: :data:`ATTN_Q_BITS`
    (11) over an int8 KV cache, where a K element times it must fit the packed DSP48E2
    product's 18-bit field; all 16 over a wider one, whose products are one DSP each
    (a 16-bit query on the 27-bit port, K on the 18-bit one)."""
    return ATTN_Q_BITS if kv_bits == ACT_BITS else 16


def attention_query(q, in16: bool = False, kv_bits: int = ACT_BITS) -> np.ndarray:
    """The query as the score pass reads it: int8 as is; an int16 one (``ATTN IN16``)
    saturated to the symmetric range of :func:`attention_query_bits` bits, ``±(2^(b−1) −
    1)`` (int8 KV: ``±1023``)."""
    q = _as_i64(q)
    limit = (1 << (attention_query_bits(kv_bits) - 1)) - 1
    return np.clip(q, -limit, limit) if in16 else q


def kv_entry(x, kv_bits: int = ACT_BITS, wide: bool = False) -> np.ndarray:
    """A KV cache element of ``kv_bits`` bits (``cfg.kv_bits``, 8 to 16) from a KVAPPEND
    source element: an int16 one (KVAPPEND ``WIDE``) saturated to ``kv_bits``; an int8 one
    placed in the element's top 8 bits, ``x · 2^(kv_bits − 8)``, so that the cache holds
    every entry at one scale and ATTN's output shift does not depend on the program."""
    x = _as_i64(x)
    return saturate(x, kv_bits) if wide else x << (kv_bits - ACT_BITS)


def attention(q, k, v, mult: int, shift: int, out_bits: int = ACT_BITS, in16: bool = False,
              kv_bits: int = ACT_BITS) -> np.ndarray:
    """Attention of one query ``q[D]`` over keys/values ``k, v[T, D]`` of ``kv_bits`` bits
    (the KV cache's elements, :func:`kv_entry`); the query is int8, or with ``in16`` int16
    read as :func:`attention_query` (11 bits over int8 K, 16 over wider K), so a score is
    at most ``D · 2^(kv_bits + b − 2)`` for a ``b``-bit query.

    ``s = k·q``; ``e = softmax_weights(s)``; ``E = Σ e`` (≥ 2^16);
    ``num = Σ_t e_t v_t`` (|num| ≤ 2^16 · 2^(kv_bits − 1) · T); ``R = floor(2^32 / E)``
    (one sequential divider per head); ``o = sat(round_shift(num · R, 32 − (out_bits −
    kv_bits)))``, a convex combination of V's rows at ``out_bits``: its scale is V's
    times ``2^(kv_bits − out_bits)`` (int8 KV: V's scale, or V's / 2^8 at 16 bits).
    """
    q, k, v = attention_query(q, in16, kv_bits), _as_i64(k), _as_i64(v)
    e = softmax_weights(k @ q, mult, shift)
    recip = (_I64(1) << RECIP_BITS) // np.sum(e)
    num = e @ v
    return saturate(round_shift(num * recip, RECIP_BITS - (out_bits - kv_bits)), out_bits)


# -- RoPE, activation ----------------------------------------------------------------
def rope(x, cos, sin, bits: int = ACT_BITS) -> np.ndarray:
    """Rotate heads ``x[..., D]`` of ``bits``-bit integers (int8, or int16 for ROPE
    ``WIDE``), halves paired as in Llama's rotate_half.

    ``cos, sin`` are Q1.14 int16 ``[D/2]``; for i < D/2 with a = x_i, b = x_{i+D/2}:
    ``a' = sat(round_shift(a·c - b·s, 14))``, ``b' = sat(round_shift(b·c + a·s, 14))``,
    saturated to ``bits``. int16: ``|a·c ± b·s| ≤ 2^31``, so the sums need 33 bits.
    """
    x = _as_i64(x)
    h = x.shape[-1] // 2
    a, b = x[..., :h], x[..., h:]
    c, s = _as_i64(cos), _as_i64(sin)
    return np.concatenate([saturate(round_shift(a * c - b * s, ROPE_FRAC), bits),
                           saturate(round_shift(b * c + a * s, ROPE_FRAC), bits)], axis=-1)


def act_mul_shift(shift, extra) -> np.ndarray:
    """ACTMUL's shift with a row exponent added: ``min(shift + extra, 63)`` (a product
    ``|lut · up · mult| < 2^38`` rounds to 0 alike at every shift from 39 on)."""
    return np.minimum(_as_i64(shift) + _as_i64(extra), 63)


def act_mul(gate, up, lut, mult: int, shift: int, out_bits: int = ACT_BITS, extra=0) -> np.ndarray:
    """Gated activation: ``sat(round_shift(lut[gate + 128] · up · mult, shift + extra))``.

    ``lut`` is a 256-entry int16 table of the activation (SiLU, GELU, …) of every int8
    gate value, at a scale chosen by the compiler; the product with int8 ``up`` is
    requantised with ``(mult, act_mul_shift(shift, extra))`` to ``out_bits``. ``extra``
    is the row's exponent (0, or per row broadcast against the channels:
    :func:`act_row_exponent`).
    """
    a = _as_i64(lut)[_as_i64(gate) + 128]
    return requant(a * _as_i64(up), mult, act_mul_shift(shift, extra), out_bits)


def act_interpolate(gate, table) -> np.ndarray:
    """The activation of an int16 ``gate`` from a table of :data:`ACT_KNOTS` knots (ACTMUL
    ``IN16``): entries ``2i`` and ``2i + 1`` of the 256-entry int16 ``table`` are knot
    ``i``'s value and slope (the value change to the next knot), knot ``i`` at gate
    ``(i − 64) · 2^9``. With ``i = (gate >> 9) + 64`` and ``f = gate & 511``::

        a = value_i + round_shift(slope_i · f, 9)

    ``|a| < 2^16`` (17 bits signed). The table stays 256 int16 entries in the same 528-byte
    block; a knot's value and slope lie in one table word, so one read serves both.
    """
    g, t = _as_i64(gate), _as_i64(table)
    knot = 2 * ((g >> ACT_KNOT_FRAC) + ACT_KNOTS // 2)
    frac = g & ((1 << ACT_KNOT_FRAC) - 1)
    return t[knot] + round_shift(t[knot + 1] * frac, ACT_KNOT_FRAC)


def act_mul_wide(gate, up, table, mult: int, shift: int, out_bits: int = ACT_BITS, extra=0) -> np.ndarray:
    """Gated activation of int16 ``gate`` and int16 ``up`` (ACTMUL ``IN16``):
    ``sat(round_shift(act_interpolate(gate, table) · up · mult, shift + extra))``.
    ``|a · up| < 2^31``, times the 16-bit ``mult`` below 2^47."""
    a = act_interpolate(gate, table)
    return requant(a * _as_i64(up), mult, act_mul_shift(shift, extra), out_bits)


def act_row_exponent(coarse, exp_max: int, out_bits: int) -> np.ndarray:
    """Each row's exponent ``e`` for an ACTMUL with an exponent budget ``E = exp_max``.

    ``coarse[..., n]`` is the row's ACTMUL output at the coarsest exponent, ``act_mul(...,
    extra=E)`` (saturated to ``out_bits``). The row's largest magnitude there has
    ``b = bit_length(max |coarse|)`` bits, so at exponent ``e`` it needs ``b + E − e``:
    ``e = clamp(b + E − (out_bits − 1), 0, E)``, the smallest exponent that fits the row
    as far as the coarse values tell (a row right at the edge saturates by at most one
    unit). The coarse values are rounded, so ``e`` may be one more than the smallest that
    fits (a row whose largest value at exponent 0 is in ``[2^14, 2^15)`` gets 1); an int8
    row's is at least ``E − 7``. With int16 rows and ``E ≤ 15`` a row of zeros (or an empty
    one) has ``e = 0``. A row that does not fit even at ``E`` has ``e = E`` and saturates.
    """
    coarse = _as_i64(coarse)
    peak = np.abs(coarse).max(axis=-1) if coarse.shape[-1] else np.zeros(coarse.shape[:-1], _I64)
    return np.clip(bit_length(peak) + exp_max - (out_bits - 1), 0, exp_max)


def row_shift(shift, exp) -> np.ndarray:
    """A MATMUL with ``ROWEXP``: requantisation shift ``max(shift − e, 0)`` for an input
    row of exponent ``e`` (its values are ``2^e`` times coarser, so the accumulator is
    too). The compiler keeps every such shift at least ``ROW_EXP_MAX``."""
    return np.maximum(_as_i64(shift) - _as_i64(exp), 0)


# -- token sampler ------------------------------------------------------------------
def topk_select(logits, k: int) -> np.ndarray:
    """Indices of the k largest int16 logits, largest first; ties go to the lower index.

    This is also the greedy argmax (k = 1). Hardware: a k-deep insertion list fed one
    logit per cycle in index order, where a new value displaces only strictly smaller ones.
    """
    logits = _as_i64(logits)
    order = np.lexsort((np.arange(logits.shape[0]), -logits))
    return order[:k]


def sampler_probs(top_logits, t_mult: int, t_shift: int) -> np.ndarray:
    """Exact probabilities (units of 2^-24, summing to exactly 2^24) of the top-k.

    ``top_logits`` are the top-k int16 logits, largest first. ``u_j = round_shift((l_0 -
    l_j)·t_mult, t_shift)`` (t_mult/2^t_shift ≈ log2(e)/T · 2^8 / 2^8, see
    :func:`host_temperature`), ``e_j = exp2_neg(u_j)``, ``R = floor(2^40 / Σe)``,
    ``p_j = (e_j · R) >> 16``; the rounding remainder goes to the first (largest) entry.
    These are exactly the probabilities :func:`sample_index` samples with.
    """
    e = softmax_weights(_as_i64(top_logits), t_mult, t_shift)
    recip = (_I64(1) << (PROB_BITS + 16)) // np.sum(e)
    p = (e * recip) >> 16
    p[0] += (1 << PROB_BITS) - np.sum(p)
    return p


def sample_index(probs, r24: int) -> int:
    """First j with ``Σ_{i≤j} p_i > r24`` for a uniform 24-bit ``r24``: P(j) = p_j / 2^24."""
    return int(np.argmax(np.cumsum(_as_i64(probs)) > int(r24)))


def path_score(score: int, prob: int) -> int:
    """A tree node's path score from its parent's and its own probability, both in units
    of 2^-24: ``(score · prob) >> 24`` (floor; :data:`TREE_SCORE_ROOT` is 1.0)."""
    return (int(score) * int(prob)) >> PROB_BITS


#: The root's path score: probability 1 in units of 2^-24.
TREE_SCORE_ROOT = 1 << PROB_BITS


def tree_expand_greedy(scores, probs, width: int) -> list[tuple[int, int, int]]:
    """The greedy expansion of a tree level (docs/isa.md §9.2): ``(s, j, score)`` of the
    ``width`` candidates of highest :func:`path_score` over source rows ``s`` (path
    score ``scores[s]``) and their top-k entries ``j`` (probability ``probs[s][j]``), ties
    to the lower ``s`` then the lower ``j``; in that order, which is the next level's
    row order. Raises ``ValueError`` when there are fewer candidates than ``width``."""
    candidates = [(path_score(scores[s], p), s, j)
                  for s, row in enumerate(probs) for j, p in enumerate(row)]
    if len(candidates) < width:
        raise ValueError(f"{len(candidates)} candidates cannot fill {width} tree rows")
    candidates.sort(key=lambda c: (-c[0], c[1], c[2]))
    return [(s, j, score) for score, s, j in candidates[:width]]


_M32 = 0xFFFFFFFF


def mix32(x: int) -> int:
    """A 32-bit avalanche mixer: xorshift-multiply, two 32×32 multiplies."""
    x &= _M32
    x ^= x >> 16
    x = (x * 0x21F0AAAD) & _M32
    x ^= x >> 15
    x = (x * 0x735A2D97) & _M32
    x ^= x >> 15
    return x


def rng32(seed: int, counter: int) -> int:
    """Counter-based RNG: ``mix32(mix32((counter + seed_lo) mod 2^32) ^ seed_hi)``.

    ``seed`` is the host's 64-bit seed; ``counter`` is the request's counter base plus the
    draft step. The same (seed, counter) always gives the same word, in any order.
    """
    lo, hi = seed & _M32, (seed >> 32) & _M32
    return mix32(mix32((counter + lo) & _M32) ^ hi)


# -- host-side (compile-time) helpers: floats allowed here ---------------------------
def host_multiplier(real, max_shift: int = 63) -> tuple[np.ndarray, np.ndarray]:
    """Fixed-point (mult, shift) with mult/2^shift ≈ real > 0, mult in [2^15, 2^16).

    Works elementwise on arrays. A real too small for ``max_shift`` gets the largest
    shift and a smaller multiplier; zero gives (0, 0).
    """
    real = np.asarray(real, dtype=np.float64)
    if np.any(real < 0) or not np.all(np.isfinite(real)):
        raise ValueError("requantisation scales must be finite and non-negative")
    mult = np.zeros(real.shape, dtype=_I64)
    shift = np.zeros(real.shape, dtype=_I64)
    nz = real > 0
    e = np.floor(np.log2(real[nz])).astype(_I64)          # real = m · 2^e, m in [1, 2)
    sh = np.minimum((MULT_BITS - 1) - e, max_shift)       # mult = real · 2^sh in [2^15, 2^16)
    m = np.round(real[nz] * np.exp2(sh)).astype(_I64)
    over = m >= (1 << MULT_BITS)                          # rounding up to 2^16
    m = np.where(over, m >> 1, m)
    sh = np.where(over, sh - 1, sh)
    if np.any(sh < 0):
        raise ValueError("requantisation scale too large for a 16-bit multiplier and shift ≥ 0")
    mult[nz], shift[nz] = m, sh
    return mult, shift


def host_rope_table(cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """Q1.14 int16 (cos, sin) pairs ``[P, D/2, 2]`` from float tables ``[P, D/2]``."""
    q = lambda t: np.clip(np.round(np.asarray(t, np.float64) * (1 << ROPE_FRAC)), -32768, 32767)
    return np.stack([q(cos), q(sin)], axis=-1).astype(np.int16)


def host_act_lut(fn, in_scale: float) -> tuple[np.ndarray, float]:
    """256-entry int16 LUT of ``fn(g · in_scale)`` for every int8 g, and the LUT's scale."""
    g = np.arange(-128, 128, dtype=np.float64) * in_scale
    y = np.asarray(fn(g), dtype=np.float64)
    scale = max(float(np.max(np.abs(y))), 1e-12) / 32767.0
    return np.clip(np.round(y / scale), -32768, 32767).astype(np.int16), scale


def host_act_knots(fn, in_scale: float) -> tuple[np.ndarray, float]:
    """The 256-entry int16 table of an ACTMUL ``IN16`` (:func:`act_interpolate`): knot
    ``i``'s value ``fn(g_i · in_scale)`` at ``g_i = (i − 64) · 2^9`` and its slope to the
    next knot (the last one's to ``g = 2^15``), interleaved, and the table's scale."""
    g = (np.arange(ACT_KNOTS + 1, dtype=np.float64) - ACT_KNOTS // 2) * (1 << ACT_KNOT_FRAC) * in_scale
    y = np.asarray(fn(g), dtype=np.float64)
    scale = max(float(np.max(np.abs(y))), 1e-12) / 32767.0
    q = np.clip(np.round(y / scale), -32767, 32767).astype(np.int64)
    table = np.empty(2 * ACT_KNOTS, np.int64)
    table[0::2], table[1::2] = q[:-1], np.clip(q[1:] - q[:-1], -32768, 32767)
    return table.astype(np.int16), scale


def host_temperature(temperature: float) -> tuple[int, int]:
    """Sampler (t_mult, t_shift) for a temperature: Q7.8 logit gaps → log2 units Q.8."""
    if not (temperature > 0 and math.isfinite(temperature)):
        raise ValueError(f"temperature must be a positive finite number, got {temperature}")
    real = math.log2(math.e) / temperature * (1 << EXP_FRAC) / (1 << LOGIT_FRAC)
    m, s = host_multiplier(real, max_shift=31)
    if m == 0:
        raise ValueError(f"temperature {temperature} is too high for the sampler's fixed point")
    return int(m), int(s)
