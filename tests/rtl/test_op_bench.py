"""The sequencer test bench itself: VMEM fill and readback, jobs, memory reads."""

from __future__ import annotations

import numpy as np
from amaranth import Module, Signal
from amaranth.lib import wiring

from dfvg_hw.spec.config import get_preset
from dfvg_hw.spec.descriptors import ErrorCode
from dfvg_hw.op_port import OpSequencerSignature
from sim.memory import DeviceMemory
from sim.op_bench import run_jobs

TINY = get_preset("tiny")


class LineCopy(wiring.Component):
    """A stand-in sequencer for the bench's own test: copies device-memory line ``addr``
    into VMEM line ``dst``; an address past memory is refused by the port."""

    def __init__(self):
        super().__init__(OpSequencerSignature(TINY, 128))

    def elaborate(self, platform):
        m = Module()
        job = Signal.like(self.job.payload)
        with m.FSM():
            with m.State("IDLE"):
                m.d.comb += self.job.ready.eq(1)
                with m.If(self.job.valid):
                    m.d.sync += job.eq(self.job.payload)
                    m.next = "CMD"
            with m.State("CMD"):
                m.d.comb += [self.read_cmd.valid.eq(1), self.read_cmd.payload.addr.eq(job.addr),
                             self.read_cmd.payload.length.eq(16)]
                with m.If(self.read_cmd.ready):
                    m.next = "DATA"
            with m.State("DATA"):
                m.d.comb += [self.read_data.ready.eq(1), self.poke_addr.eq(job.dst),
                             self.poke_data.eq(self.read_data.payload.data),
                             self.poke_en.eq(0xFFFF * self.read_data.valid)]
                with m.If(self.read_data.valid):
                    m.next = "DONE"
            with m.State("DONE"):
                m.d.comb += [self.done.eq(1), self.error.eq(ErrorCode.OK)]
                m.next = "IDLE"
        return m


def test_bench_fills_runs_and_reads_back():
    rng = np.random.default_rng(0)
    vmem = rng.integers(0, 256, TINY.vmem_bytes, dtype=np.uint8)
    memory = DeviceMemory(TINY.mem_bytes)
    memory.write(0x1000, bytes(range(16)))
    after, errors = run_jobs(TINY, LineCopy(), vmem, memory,
                             [{"addr": 0x1000, "dst": 3}, {"addr": TINY.mem_bytes, "dst": 4}])
    expected = vmem.copy()
    expected[48:64] = np.arange(16)
    assert errors == [ErrorCode.OK, ErrorCode.BAD_ADDRESS]
    np.testing.assert_array_equal(after, expected)
