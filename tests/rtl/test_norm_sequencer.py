"""NormSequencer against the functional model's RMSNORM (sim/op_bench.py)."""

from __future__ import annotations

import numpy as np

from dfvg_hw.spec.descriptors import ErrorCode
from dfvg_hw.spec.image import NORM_PARAM_BYTES, pack_norm_params
from dfvg_hw.spec.isa import Op
from dfvg_hw.norm_sequencer import NormSequencer
from sim.memory import DeviceMemory
from dfvg_hw.verilog import to_verilog
# the row-job harness shared with the other row sequencer's tests (tests/rtl/)
from sim.lint import verilator_lint
# the row-job harness shared with the other row sequencer's tests (tests/rtl/)
from sequencer_cases import (MAX_N, TINY, L, check_random_row_jobs, check_row_jobs,
                             check_wide_lanes, row_job)

#: parameter blocks: bus-aligned, odd (the head and gamma at every byte offset), 8 mod 16
BLOCKS = (0x1000, 0x2003, 0x3008, 0x400D)
#: a block whose gamma_shift is 17 (> GAMMA_SHIFT_MAX: PROGRAM)
BAD_SHIFT = 0x5000
#: a head inside memory whose gamma of more than 5 elements is not (BAD_ADDRESS after the head)
GAMMA_PAST_END = TINY.mem_bytes - NORM_PARAM_BYTES - 10
#: a head past the end of memory (BAD_ADDRESS from the head read)
HEAD_PAST_END = TINY.mem_bytes - 20


def _memory(rng) -> DeviceMemory:
    memory = DeviceMemory(TINY.mem_bytes)
    for addr, shift in zip(BLOCKS, (5, 7, 3, 16)):     # spread, small, saturating, WIDE-only
        gamma = rng.integers(-32768, 32768, MAX_N).astype(np.int16)
        eps = int(rng.integers(0, 1 << 32))
        memory.write(addr, pack_norm_params(eps, gamma, shift))
    memory.write(BAD_SHIFT, pack_norm_params(5, np.ones(MAX_N, np.int16), 17))
    memory.write(GAMMA_PAST_END, pack_norm_params(7, np.full(5, 300, np.int16), 9))
    return memory


def _norm(rows, n, src, dst, addr=BLOCKS[0], wide=False):
    return row_job(Op.RMSNORM, rows, n, src, dst, addr=addr, wide=wide)


def _check(rng, jobs, data_width=128, config=TINY):
    """The jobs against the functional model, and each that completes against the cycle
    model's cycles."""
    return check_row_jobs(rng, NormSequencer, _memory, jobs, data_width, config, timed=True)


def test_rows_widths_alignments_and_in_place():
    rng = np.random.default_rng(1)
    jobs = [_norm(1, 16, 10, 40), _norm(2, 20, 60, 60, addr=BLOCKS[1], wide=True),
            _norm(2, 7, 100, 100, addr=BLOCKS[2]), _norm(1, 1, 3, 5, addr=BLOCKS[3], wide=True),
            _norm(2, 64, 120, 20, addr=BLOCKS[1])]
    assert _check(rng, jobs) == [ErrorCode.OK] * len(jobs)


def test_errors_in_the_functional_models_order():
    rng = np.random.default_rng(2)
    last_line = TINY.vmem_bytes // L - 1
    jobs = [
        _norm(3, 8, 0, 40),                                   # rows > config.rows: PROGRAM
        _norm(1, 8, 0, 40, addr=HEAD_PAST_END),               # head past memory
        _norm(1, 8, 0, 40, addr=BAD_SHIFT),                   # gamma_shift 17: PROGRAM ...
        _norm(1, 8, last_line + 5, 40, addr=BAD_SHIFT),       # ... before the VMEM checks
        _norm(1, 6, 0, 40, addr=GAMMA_PAST_END),              # gamma past memory
        _norm(1, 5, 0, 40, addr=GAMMA_PAST_END),              # gamma ends with memory: OK
        _norm(2, 16, last_line - 2, 40),                      # src's second row outside VMEM
        _norm(1, 16, 0, last_line, wide=True),                # wide dst outside VMEM
        _norm(1, 16, 0, last_line),                           # the same, narrow: inside
        _norm(2, 0, last_line, last_line),                    # n = 0: nothing moves
        _norm(1, 0, last_line + 1, 0),                        # n = 0 just past VMEM
        _norm(1, 12, 30, 31, addr=BLOCKS[1]),                 # and the engine still works
    ]
    errors = _check(rng, jobs)
    assert ErrorCode.PROGRAM in errors and ErrorCode.BAD_ADDRESS in errors
    assert errors[-1] == ErrorCode.OK


def test_random_jobs():
    check_random_row_jobs(np.random.default_rng(3), NormSequencer, _memory, Op.RMSNORM, BLOCKS,
                          timed=True)


def test_wide_bus():
    """A 256-bit bus: the 16-byte-aligned blocks are misaligned for the port."""
    rng = np.random.default_rng(4)
    jobs = [_norm(2, 40, 10, 50, addr=BLOCKS[0] + 16), _norm(1, 33, 5, 5, addr=BLOCKS[1], wide=True),
            _norm(1, 8, 0, 40, addr=BAD_SHIFT)]
    assert _check(rng, jobs, data_width=256) == [ErrorCode.OK, ErrorCode.OK, ErrorCode.PROGRAM]


def test_wide_lanes():
    """64 lanes: rows packed into beats wider than a line (see check_wide_lanes)."""
    check_wide_lanes(np.random.default_rng(5), NormSequencer, _memory, Op.RMSNORM, BLOCKS,
                     timed=True)


def test_lint():
    ok, log = verilator_lint(to_verilog(NormSequencer(TINY, 128), "norm_sequencer"), "norm_sequencer")
    assert ok, log


#: rows of many 64-lane beats (gamma's Gearbox and the writer pace pass 2), in place too
LONG_ROWS = [_norm(1, 200, 0, 60, wide=True), _norm(2, 130, 90, 160, addr=BLOCKS[1]),
             _norm(1, 300, 0, 80, addr=BLOCKS[2], wide=True),
             _norm(2, 77, 0, 200, addr=BLOCKS[3], wide=True), _norm(1, 256, 100, 100)]


def test_row_buffer_replays_long_rows():
    """Rows that fit the row buffer are read from VMEM once (passes 1 and 2 replay the
    buffer a beat a cycle): results and cycles (the cycle model's) at 64 lanes."""
    config = TINY.with_changes(lanes=64)
    from dfvg_hw.spec import timing
    assert all(job["n"] <= 64 * timing.norm_row_buffer_beats(64) for job in LONG_ROWS)
    assert _check(np.random.default_rng(6), LONG_ROWS, 256, config) == [ErrorCode.OK] * 5


def test_rows_longer_than_the_buffer_read_vmem_three_times(monkeypatch):
    """With a 64-byte row buffer (one 64-lane beat, four 4-lane beats) most rows do not
    fit and take three VMEM passes; the ones that do still replay: every job's cycles are
    the cycle model's, which must tell the two apart."""
    from dfvg_hw.spec import timing
    monkeypatch.setattr(timing, "NORM_ROW_BUFFER_BYTES", 64)
    rng = np.random.default_rng(7)
    jobs = [_norm(1, 16, 10, 40), _norm(2, 20, 60, 60, addr=BLOCKS[1], wide=True),
            _norm(1, 4, 3, 5, addr=BLOCKS[3], wide=True)]
    assert _check(rng, jobs) == [ErrorCode.OK] * 3
    assert _check(rng, jobs + LONG_ROWS[:2], 256, TINY.with_changes(lanes=64)) == [ErrorCode.OK] * 5
