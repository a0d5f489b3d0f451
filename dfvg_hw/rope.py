"""Rotary position embedding: a lane-parallel pair rotator, bit-exact with numerics.rope."""

from __future__ import annotations

from amaranth import Module, Signal, signed
from amaranth.lib import data, stream, wiring
from amaranth.lib.wiring import In, Out

from dfvg_hw.spec import numerics as nx
from dfvg_hw.spec import timing
from dfvg_hw.spec.config import EngineConfig
from dfvg_hw.elementwise import narrow_unless_wide, saturate

__all__ = ["Rope", "RopeInput", "RopeOutput"]


class RopeInput(data.StructLayout):
    """``pairs`` RoPE pairs: ``a = x_i``, ``b = x_{i + D/2}`` (int16 lanes; int8 elements
    sign-extended), their Q1.14 (cos, sin), and ``wide``: the elements are int16 (ROPE
    ``WIDE``), so the results saturate to 16 bits instead of 8."""

    def __init__(self, pairs: int):
        vec16 = data.ArrayLayout(signed(16), pairs)
        super().__init__({"a": vec16, "b": vec16, "cos": vec16, "sin": vec16, "wide": 1})


class RopeOutput(data.StructLayout):
    """The rotated pairs ``a'``, ``b'``: int16 lanes, int8 results sign-extended."""

    def __init__(self, pairs: int):
        vec16 = data.ArrayLayout(signed(16), pairs)
        super().__init__({"a": vec16, "b": vec16})


class Rope(wiring.Component):
    """RoPE pair rotator, bit-exact with :func:`dfvg_hw.spec.numerics.rope`.

    Per pair ``(a, b) = (x_i, x_{i+D/2})`` with the Q1.14 entry ``(c, s)`` of (POS, i)::

        a' = sat(round_shift(a·c − b·s, 14))
        b' = sat(round_shift(b·c + a·s, 14))

    saturated to 8 bits, or to 16 with the beat's ``wide`` (int16 heads, ROPE ``WIDE``).
    Three stages: four 16 × 16 products (one DSP48E2 each, as the 8 × 16 products of
    int8 heads were), the two sums with the rounding constant 2^13 (33 bits: ``|a·c ±
    b·s| ≤ 2^31``), then the (wired) shift by 14 and the clamp. Initiation interval 1.

    The unit works on pairs, not on heads, so it serves any head dimension: a head of
    dimension ``k`` is ``k/2`` pairs, presented ``pairs`` at a time. With the default
    ``pairs = head_dim / 2`` one beat carries a whole ``head_dim`` head: ``a`` is the
    first half of the head, ``b`` the second, ``cos``/``sin`` the table row for POS (the
    same row for every head and row of an instruction; it travels with the beat so that
    per-row positions, reserved for tree drafting, need no change here). A smaller head
    leaves trailing pairs unused; a larger one takes ``ceil(k / (2·pairs))`` beats.

    Parameters
    ----------
    config : EngineConfig
        ``head_dim`` sets the default width.
    pairs : int, optional
        Pairs per beat (default ``config.head_dim // 2``).

    Members
    -------
    i : In(stream.Signature(RopeInput(pairs)))
        Pairs to rotate with their cos/sin.
    o : Out(stream.Signature(RopeOutput(pairs)))
        Rotated pairs.
    """

    LATENCY = timing.ROPE_LATENCY

    def __init__(self, config: EngineConfig, pairs: int | None = None):
        self.pairs = config.head_dim // 2 if pairs is None else pairs
        if self.pairs < 1:
            raise ValueError(f"RoPE needs at least one pair per beat, got {self.pairs}")
        super().__init__({
            "i": In(stream.Signature(RopeInput(self.pairs))),
            "o": Out(stream.Signature(RopeOutput(self.pairs))),
        })

    def elaborate(self, platform):
        m = Module()
        adv, v1, v2 = Signal(), Signal(), Signal()
        w1, w2 = Signal(), Signal()             # the beat's wide, beside its data
        m.d.comb += [adv.eq(~self.o.valid | self.o.ready), self.i.ready.eq(adv)]
        with m.If(adv):
            m.d.sync += [v1.eq(self.i.valid), v2.eq(v1), self.o.valid.eq(v2),
                         w1.eq(self.i.payload.wide), w2.eq(w1)]
        half = 1 << (nx.ROPE_FRAC - 1)
        p = self.i.payload

        def clamp(t):
            return narrow_unless_wide(saturate(t >> nx.ROPE_FRAC, 16), w2)

        for j in range(self.pairs):
            a, b, c, s = p.a[j], p.b[j], p.cos[j], p.sin[j]
            ac, bs, bc, as_ = (Signal(signed(32), name=f"{n}{j}") for n in ("ac", "bs", "bc", "as"))
            ta, tb = Signal(signed(33), name=f"ta{j}"), Signal(signed(33), name=f"tb{j}")
            with m.If(adv):
                m.d.sync += [ac.eq(a * c), bs.eq(b * s), bc.eq(b * c), as_.eq(a * s),
                             ta.eq(ac - bs + half), tb.eq(bc + as_ + half),
                             self.o.payload.a[j].eq(clamp(ta)), self.o.payload.b[j].eq(clamp(tb))]
        return m
