"""The shared testbench helpers catch what they promise to catch."""

import pytest
from amaranth import Module, Signal
from amaranth.lib import stream, wiring
from amaranth.lib.wiring import In, Out

from sim.testbench import stream_through


class _Echo(wiring.Component):
    """Passes each input beat on after a register; with ``twice``, offers it two times."""

    i: In(stream.Signature(8))
    o: Out(stream.Signature(8))

    def __init__(self, twice: bool = False):
        self.twice = twice
        super().__init__()

    def elaborate(self, platform):
        m = Module()
        left = Signal(2)                        # times the held beat is still to be offered
        m.d.comb += [self.i.ready.eq(left == 0), self.o.valid.eq(left != 0)]
        with m.If(self.o.valid & self.o.ready):
            m.d.sync += left.eq(left - 1)
        with m.If(self.i.valid & self.i.ready):
            m.d.sync += [self.o.payload.eq(self.i.payload), left.eq(2 if self.twice else 1)]
        return m


def test_stream_through_returns_one_beat_per_input():
    assert stream_through(_Echo(), [3, 1, 4, 1, 5], ready=(1, 0)) == [3, 1, 4, 1, 5]


def test_stream_through_fails_on_a_beat_past_the_expected_ones():
    """A unit that answers one input with two beats fails, though the beats taken match
    in number: the last input's second beat is offered after the last expected one."""
    with pytest.raises(AssertionError, match="a beat past the 1 expected"):
        stream_through(_Echo(twice=True), [7])
