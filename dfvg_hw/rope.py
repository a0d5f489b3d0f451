"""Rotary position embedding: a lane-parallel pair rotator, bit-exact with numerics.rope."""

from __future__ import annotations

from amaranth import Module, Signal, signed
from amaranth.lib import data, stream, wiring
from amaranth.lib.wiring import In, Out

from dfvg_hw.spec import numerics as nx
from dfvg_hw.spec import timing
from dfvg_hw.spec.config import EngineConfig
from dfvg_hw.elementwise import saturate

__all__ = ["Rope", "RopeInput", "RopeOutput"]


class RopeInput(data.StructLayout):
    """``pairs`` RoPE pairs: ``a = x_i``, ``b = x_{i + D/2}`` and their Q1.14 (cos, sin)."""

    def __init__(self, pairs: int):
        vec8 = data.ArrayLayout(signed(nx.ACT_BITS), pairs)
        vec16 = data.ArrayLayout(signed(16), pairs)
        super().__init__({"a": vec8, "b": vec8, "cos": vec16, "sin": vec16})


class RopeOutput(data.StructLayout):
    """The rotated pairs ``a'``, ``b'``."""

    def __init__(self, pairs: int):
        vec8 = data.ArrayLayout(signed(nx.ACT_BITS), pairs)
        super().__init__({"a": vec8, "b": vec8})


class Rope(wiring.Component):
    """RoPE pair rotator, bit-exact with :func:`dfvg_hw.spec.numerics.rope`.

    Per pair ``(a, b) = (x_i, x_{i+D/2})`` with the Q1.14 entry ``(c, s)`` of (POS, i)::

        a' = sat8(round_shift(a·c − b·s, 14))
        b' = sat8(round_shift(b·c + a·s, 14))

    Three stages: four 8 × 16 products, the two sums with the rounding constant 2^13,
    then the (wired) shift by 14 and the clamp. Initiation interval 1.

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
        m.d.comb += [adv.eq(~self.o.valid | self.o.ready), self.i.ready.eq(adv)]
        with m.If(adv):
            m.d.sync += [v1.eq(self.i.valid), v2.eq(v1), self.o.valid.eq(v2)]
        half = 1 << (nx.ROPE_FRAC - 1)
        p = self.i.payload
        for j in range(self.pairs):
            a, b, c, s = p.a[j], p.b[j], p.cos[j], p.sin[j]
            ac, bs, bc, as_ = (Signal(signed(24), name=f"{n}{j}") for n in ("ac", "bs", "bc", "as"))
            ta, tb = Signal(signed(26), name=f"ta{j}"), Signal(signed(26), name=f"tb{j}")
            with m.If(adv):
                m.d.sync += [ac.eq(a * c), bs.eq(b * s), bc.eq(b * c), as_.eq(a * s),
                             ta.eq(ac - bs + half), tb.eq(bc + as_ + half),
                             self.o.payload.a[j].eq(saturate(ta >> nx.ROPE_FRAC, nx.ACT_BITS)),
                             self.o.payload.b[j].eq(saturate(tb >> nx.ROPE_FRAC, nx.ACT_BITS))]
        return m
