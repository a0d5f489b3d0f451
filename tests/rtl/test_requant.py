"""Requantiser RTL against numerics.requant, bit for bit."""

import numpy as np
import pytest

from dfvg_hw.spec import numerics as nx
from dfvg_hw.requant import Requantizer
from dfvg_hw.verilog import to_verilog
from sim.lint import verilator_lint
from sim.testbench import stream_through


def simulate(bits, acc, mult, shift, ready_pattern=None):
    beats = [{"acc": int(a), "mult": int(mu), "shift": int(s)} for a, mu, s in zip(acc, mult, shift)]
    return np.array(stream_through(Requantizer(bits), beats, ready=ready_pattern))


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
