"""Requantiser RTL against numerics.requant, bit for bit."""

import numpy as np
import pytest

from dfvg_hw import numerics as nx
from dfvg_hw.requant import Requantizer
from sim.rtl_tools import to_verilog, verilator_lint
from sim.testbench import run_simulation, stream_get, stream_put


def simulate(bits, acc, mult, shift, ready_pattern=None):
    dut, got = Requantizer(bits), []

    async def put(ctx):
        for a, mu, s in zip(acc, mult, shift):
            await stream_put(ctx, dut.i, {"acc": int(a), "mult": int(mu), "shift": int(s)})

    async def get(ctx):
        for i in range(len(acc)):
            if ready_pattern is not None and not ready_pattern[i % len(ready_pattern)]:
                await ctx.tick()                     # backpressure: a cycle not ready
            got.append(await stream_get(ctx, dut.o))

    run_simulation(dut, put, get)
    return np.array(got)


@pytest.mark.parametrize("bits", [8, 16])
def test_random_vectors_with_edges(bits):
    rng = np.random.default_rng(bits)
    n = 1200
    acc = rng.integers(-2 ** 31, 2 ** 31, n)
    mult = rng.integers(0, 2 ** 16, n)
    shift = rng.integers(0, 64, n)
    # edges: saturation at both ends, zero shift, the largest shift, rounding ties
    acc[:8] = [2 ** 31 - 1, -2 ** 31, 2 ** 31 - 1, -2 ** 31, 3, -3, 0, -1]
    mult[:8] = [65535, 65535, 1, 1, 1, 1, 65535, 65535]
    shift[:8] = [0, 0, 63, 63, 1, 1, 5, 0]
    got = simulate(bits, acc, mult, shift, ready_pattern=[1, 1, 0, 1, 0])
    np.testing.assert_array_equal(got, nx.requant(acc, mult, shift, bits))


def test_lint_clean():
    clean, output = verilator_lint(to_verilog(Requantizer(8), "requant"), "requant")
    assert clean, output
