"""Requantiser RTL against numerics.requant, bit for bit."""

import numpy as np
import pytest

from dfvg_hw.spec import numerics as nx
from dfvg_hw.requant import Requantizer
from dfvg_hw.verilog import to_verilog
from sim.lint import verilator_lint
from sim.testbench import stream_through


def simulate(bits, acc, mult, shift, ready_pattern=None, acc_bits=32):
    beats = [{"acc": int(a), "mult": int(mu), "shift": int(s)} for a, mu, s in zip(acc, mult, shift)]
    return np.array(stream_through(Requantizer(bits, acc_bits), beats, ready=ready_pattern))


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


def test_matrix_units_width():
    """The matrix unit's requantisers: 41-bit accumulators (a wide row's
    ``256·acc_hi + acc_lo`` plus an int32 bias, |acc| < 2^40) to int32 (RESADD, INT32),
    the products up to 2^56 exact: random magnitudes, the ends of the range, and the
    values just past int32 that a 32-bit adder would wrap."""
    rng = np.random.default_rng(41)
    n = 1200
    acc = rng.integers(-2 ** 40, 2 ** 40, n) >> rng.integers(0, 40, n)
    mult = rng.integers(0, 2 ** 16, n)
    shift = rng.integers(0, 64, n)
    acc[:8] = [2 ** 40 - 1, -2 ** 40, 2 ** 31, -2 ** 31 - 1, 2 ** 31 + 2 ** 20, -2 ** 32, 3, -3]
    mult[:8] = [65535, 65535, 1, 1, 1, 65535, 1, 1]
    shift[:8] = [0, 0, 0, 0, 1, 32, 1, 1]
    got = simulate(32, acc, mult, shift, ready_pattern=[1, 0, 1], acc_bits=41)
    np.testing.assert_array_equal(got, nx.requant(acc, mult, shift, 32))


def test_lint_clean():
    clean, output = verilator_lint(to_verilog(Requantizer(8), "requant"), "requant")
    assert clean, output
