"""OpCycleCounters: where each busy cycle goes (regmap.OP_CYCLE_BUCKETS), on a made-up
request: fetch + decode to the opcode, its cycles until it retires, a fetch that ends the
request and the finish to REQUEST; idle cycles are not counted. An illegal word's fetch and
decode are REQUEST's whatever its opcode byte."""

from __future__ import annotations

from dfvg_hw.op_cycle_counters import OpCycleCounters
from dfvg_hw.spec.isa import Op
from dfvg_hw.spec.regmap import OP_CYCLE_BUCKETS
from dfvg_hw.verilog import to_verilog
from sim.lint import verilator_lint
from sim.testbench import run_simulation


def test_cycles_go_to_the_unit_they_are_spent_in():
    dut = OpCycleCounters()
    got = {}

    async def tb(ctx):
        async def cycles(n=1, **inputs):
            for name, value in inputs.items():
                ctx.set(getattr(dut, name), value)
            for _ in range(n):
                await ctx.tick()
            for name in inputs:
                ctx.set(getattr(dut, name), 0)

        await cycles(3)                                   # idle: not counted
        await cycles(start=1)
        ctx.set(dut.busy, 1)
        await cycles(5)                                   # header and scan: REQUEST
        await cycles(fetch=1)                             # counted with the decode
        await cycles(decode=1, opcode=Op.MATMUL)
        await cycles(7)                                   # the MATMUL runs
        await cycles(fetch=1)
        await cycles(decode=1, opcode=Op.HALT)
        await cycles(fetch=1, fetch_ends=1)               # the request ends: REQUEST
        await cycles(finish=1)
        await cycles(4)                                   # the result: REQUEST
        ctx.set(dut.busy, 0)
        await cycles(2)
        got["before_clear"] = [ctx.get(dut.op_cycles[i]) for i in range(len(OP_CYCLE_BUCKETS))]
        await cycles(clear=1)
        got["after_clear"] = [ctx.get(dut.op_cycles[i]) for i in range(len(OP_CYCLE_BUCKETS))]
        # an illegal word with an opcode's byte: its fetch and decode are REQUEST's
        await cycles(start=1)
        ctx.set(dut.busy, 1)
        await cycles(fetch=1)
        await cycles(decode=1, opcode=Op.NOP)
        await cycles(fetch=1)
        await cycles(decode=1, opcode=Op.MATMUL, illegal=1)
        await cycles(finish=1)
        ctx.set(dut.busy, 0)
        await cycles(1)
        got["illegal"] = [ctx.get(dut.op_cycles[i]) for i in range(len(OP_CYCLE_BUCKETS))]

    run_simulation(dut, tb)
    want = [0] * len(OP_CYCLE_BUCKETS)
    want[OP_CYCLE_BUCKETS.index("REQUEST")] = 5 + 1 + 1 + 4
    want[OP_CYCLE_BUCKETS.index("MATMUL")] = 2 + 7
    want[OP_CYCLE_BUCKETS.index("HALT")] = 2
    assert got["before_clear"] == want
    assert got["after_clear"] == [0] * len(OP_CYCLE_BUCKETS)
    want = [0] * len(OP_CYCLE_BUCKETS)
    want[OP_CYCLE_BUCKETS.index("NOP")] = 2
    want[OP_CYCLE_BUCKETS.index("REQUEST")] = 2 + 1
    assert got["illegal"] == want


def test_lint():
    ok, log = verilator_lint(to_verilog(OpCycleCounters(), "op_cycle_counters"), "op_cycle_counters")
    assert ok, log
