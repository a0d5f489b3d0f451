"""Requantiser: ``sat(round_shift(acc · mult, shift))`` as a pipelined datapath block."""

from __future__ import annotations

from amaranth import Const, Module, Mux, Signal, signed, unsigned
from amaranth.lib import data, stream, wiring
from amaranth.lib.wiring import In, Out

from dfvg_hw.spec import numerics as nx
from dfvg_hw.spec import timing

__all__ = ["Requantizer", "RequantInput"]


class RequantInput(data.StructLayout):
    """One requantisation: an accumulator and its (per-channel or per-tensor) parameters."""

    def __init__(self, acc_bits: int = 32):
        super().__init__({
            "acc": signed(acc_bits),
            "mult": unsigned(nx.MULT_BITS),
            "shift": unsigned(6),
        })


class Requantizer(wiring.Component):
    """Pipelined requantiser, bit-exact with :func:`dfvg_hw.spec.numerics.requant`.

    Three stages — multiply, add the rounding half and shift, saturate — at initiation
    interval 1. Backpressure stalls the whole pipeline.

    Parameters
    ----------
    out_bits : int
        Signed output width (8 for activations, 16 for residual and logits).
    acc_bits : int
        Signed accumulator width.

    Members
    -------
    i : In(stream.Signature(RequantInput))
        Accumulator, multiplier and shift.
    o : Out(stream.Signature(signed(out_bits)))
        The saturated result.
    """

    LATENCY = timing.REQUANT_LATENCY

    def __init__(self, out_bits: int = nx.ACT_BITS, acc_bits: int = 32):
        self.out_bits = out_bits
        self.acc_bits = acc_bits
        super().__init__({
            "i": In(stream.Signature(RequantInput(acc_bits))),
            "o": Out(stream.Signature(signed(out_bits))),
        })

    def elaborate(self, platform):
        m = Module()
        prod_bits = self.acc_bits + nx.MULT_BITS + 1
        advance = Signal()
        m.d.comb += [advance.eq(~self.o.valid | self.o.ready), self.i.ready.eq(advance)]

        # |acc · mult| < 2^(prod_bits - 2), so every shift ≥ prod_bits - 1 rounds to 0
        # exactly like prod_bits - 1 does: clamping keeps the rounding adder narrow.
        max_shift = prod_bits - 1
        valid1, prod, shift1 = Signal(), Signal(signed(prod_bits)), Signal(range(max_shift + 1))
        valid2, shifted = Signal(), Signal(signed(prod_bits))                    # stage 2
        half = Signal(unsigned(prod_bits))
        m.d.comb += half.eq((Const(1, unsigned(prod_bits + 1)) << shift1) >> 1)   # 2^(shift-1), 0 for shift 0
        lo, hi = -(1 << (self.out_bits - 1)), (1 << (self.out_bits - 1)) - 1
        with m.If(advance):
            m.d.sync += [
                valid1.eq(self.i.valid),
                prod.eq(self.i.payload.acc * self.i.payload.mult),
                shift1.eq(Mux(self.i.payload.shift > max_shift, max_shift, self.i.payload.shift)),
                valid2.eq(valid1),
                shifted.eq((prod + half) >> shift1),
                self.o.valid.eq(valid2),
                self.o.payload.eq(Mux(shifted > hi, hi, Mux(shifted < lo, lo, shifted))),
            ]
        return m
