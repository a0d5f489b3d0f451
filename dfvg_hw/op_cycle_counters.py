"""The per-unit busy counters (``OP_CYCLES``, :data:`~dfvg_hw.spec.regmap.OP_CYCLE_BUCKETS`):
every busy cycle of a request is counted against the unit it is spent in.

An instruction's fetch and decode cycles go to its opcode (as the cycle model's ISSUE
does: the decode cycle adds both), then every cycle until it retires; all other busy
cycles — the request's header and token scan, a fetch that ends the request, the fetch
and decode of an illegal word (whatever its opcode byte: it is no instruction of that
opcode), the result write — are the ``REQUEST`` bucket's.
"""

from __future__ import annotations

from amaranth import Module, Signal, unsigned
from amaranth.lib import data, wiring
from amaranth.lib.wiring import In, Out

from dfvg_hw.spec import timing
from dfvg_hw.spec.isa import Op
from dfvg_hw.spec.regmap import OP_CYCLE_BUCKETS

__all__ = ["OpCycleCounters"]


class OpCycleCounters(wiring.Component):
    """The ``OP_CYCLES`` counters and the bucket the current cycle goes to.

    Members
    -------
    start : In(1)
        A request starts: all counters zero, the bucket is ``REQUEST``.
    clear : In(1)
        Soft reset: all counters zero.
    busy : In(1)
        A request runs: this cycle is counted.
    decode : In(1)
        The cycle decodes an instruction of ``opcode``: its bucket from now on, and two
        cycles (the fetch and this one).
    opcode : In(8)
        The decoded opcode (a value outside :class:`~dfvg_hw.spec.isa.Op` counts as
        ``REQUEST``).
    illegal : In(1)
        The decoded word is illegal (the decoder's ``illegal``): ``REQUEST``, whatever
        ``opcode`` is.
    fetch : In(1)
        A fetch cycle: counted with the decode that follows, unless ``fetch_ends``.
    fetch_ends : In(1)
        This fetch ends the request (a fault, HALT, the program's end, the watchdog).
    finish : In(1)
        The request's finish cycle: ``REQUEST`` from now on.
    op_cycles : Out(ArrayLayout(unsigned(32), len(OP_CYCLE_BUCKETS)))
        The counters, in :data:`~dfvg_hw.spec.regmap.OP_CYCLE_BUCKETS` order.
    """

    def __init__(self):
        super().__init__(wiring.Signature({
            "start": In(1),
            "clear": In(1),
            "busy": In(1),
            "decode": In(1),
            "opcode": In(8),
            "illegal": In(1),
            "fetch": In(1),
            "fetch_ends": In(1),
            "finish": In(1),
            "op_cycles": Out(data.ArrayLayout(unsigned(32), len(OP_CYCLE_BUCKETS))),
        }))

    def elaborate(self, platform):
        m = Module()
        request_bucket = OP_CYCLE_BUCKETS.index("REQUEST")
        bucket = Signal(range(len(OP_CYCLE_BUCKETS)), init=request_bucket)
        decoded = Signal.like(bucket)
        with m.Switch(self.opcode):
            for op in Op:
                with m.Case(op):
                    m.d.comb += decoded.eq(OP_CYCLE_BUCKETS.index(op.name))
            with m.Default():
                m.d.comb += decoded.eq(request_bucket)
        with m.If(self.illegal):
            m.d.comb += decoded.eq(request_bucket)
        counters = self.op_cycles
        with m.If(self.start):
            m.d.sync += [counters.as_value().eq(0), bucket.eq(request_bucket)]
        with m.Elif(self.busy):
            with m.If(self.decode):
                m.d.sync += [bucket.eq(decoded), counters[decoded].eq(counters[decoded] + timing.ISSUE)]
            with m.Elif(self.fetch):
                with m.If(self.fetch_ends):
                    m.d.sync += counters[request_bucket].eq(counters[request_bucket] + 1)
            with m.Elif(self.finish):
                m.d.sync += [bucket.eq(request_bucket),
                             counters[request_bucket].eq(counters[request_bucket] + 1)]
            with m.Else():
                m.d.sync += counters[bucket].eq(counters[bucket] + 1)
        with m.If(self.clear):
            m.d.sync += counters.as_value().eq(0)
        return m
