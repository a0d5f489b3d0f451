"""ActMulSequencer against the functional model's ACTMUL (sim/op_bench.py)."""

from __future__ import annotations

import struct

import numpy as np
import pytest

from dfvg_hw.spec.config import ConfigError
from dfvg_hw.spec.descriptors import ErrorCode
from dfvg_hw.spec.image import ACT_PARAM_BYTES
from dfvg_hw.spec.isa import Flag, Instruction, Op
from dfvg_hw.actmul_sequencer import ActMulSequencer
from sim.memory import DeviceMemory
from dfvg_hw.verilog import to_verilog
from sim.cycle_model import CycleModel
# the row-job harness shared with the other row sequencer's tests (tests/rtl/)
from sim.lint import verilator_lint
# the row-job harness shared with the other row sequencer's tests (tests/rtl/)
from sequencer_cases import (TINY, L, check_random_row_jobs, check_row_jobs, check_wide_lanes,
                             row_job)

#: parameter blocks (bus-aligned, odd, 8 mod 16, 13 mod 16) and their head words: int8
#: results spread, int16 results spread, saturating, and a word with bits above the shift
#: field set (the model masks them off)
BLOCKS = {0x1000: 40000 | 29 << 16, 0x2003: 30000 | 21 << 16, 0x3008: 65535,
          0x400D: 0xFFC0_0000 | 27 << 16 | 12345}
#: the block's table runs past the end of memory (BAD_ADDRESS)
PAST_END = TINY.mem_bytes - ACT_PARAM_BYTES + 1


def _memory(rng) -> DeviceMemory:
    memory = DeviceMemory(TINY.mem_bytes)
    for addr, word in BLOCKS.items():
        table = rng.integers(-32768, 32768, 256).astype("<i2")
        memory.write(addr, struct.pack("<I", word).ljust(16, b"\xAA") + table.tobytes())
    return memory


def _actmul(rows, n, src, dst, addr=0x1000, wide=False):
    return row_job(Op.ACTMUL, rows, n, src, dst, addr=addr, wide=wide)


def _check(rng, jobs, data_width=128, config=TINY):
    return check_row_jobs(rng, ActMulSequencer, _memory, jobs, data_width, config)


def test_rows_widths_alignments_and_in_place():
    rng = np.random.default_rng(11)
    jobs = [_actmul(1, 16, 10, 40), _actmul(2, 20, 60, 60, addr=0x2003, wide=True),
            _actmul(2, 7, 100, 100, addr=0x3008), _actmul(1, 1, 3, 5, addr=0x400D, wide=True),
            _actmul(2, 64, 120, 20), _actmul(2, 9, 150, 150, addr=0x2003, wide=True),
            # wide rows of n mod 16 ≤ 8 leave a surplus line per row; the narrow job after
            # must not see it, nor the wide one after that
            _actmul(2, 5, 170, 180, wide=True), _actmul(1, 5, 170, 190), _actmul(1, 3, 170, 200, wide=True)]
    assert _check(rng, jobs) == [ErrorCode.OK] * len(jobs)


def test_errors():
    rng = np.random.default_rng(12)
    last_line = TINY.vmem_bytes // L - 1
    jobs = [
        _actmul(3, 8, 0, 40),                                 # rows > config.rows: PROGRAM
        _actmul(1, 8, 0, 40, addr=PAST_END),                  # table past memory
        _actmul(1, 8, 0, 40, addr=PAST_END - 1),              # block ends with memory: OK
        _actmul(2, 8, last_line, 40),                         # src's second row outside VMEM
        _actmul(1, 16, last_line - 1, 40),                    # src row ends with VMEM: OK
        _actmul(1, 16, 0, last_line, wide=True),              # wide dst outside VMEM
        _actmul(1, 16, 0, last_line),                         # the same, narrow: inside
        _actmul(2, 0, last_line, last_line),                  # n = 0: nothing moves
        _actmul(1, 12, 30, 31, addr=0x2003),                  # and the engine still works
    ]
    errors = _check(rng, jobs)
    assert errors[:3] == [ErrorCode.PROGRAM, ErrorCode.BAD_ADDRESS, ErrorCode.OK]
    assert errors[-1] == ErrorCode.OK


def test_random_jobs():
    check_random_row_jobs(np.random.default_rng(13), ActMulSequencer, _memory, Op.ACTMUL, list(BLOCKS))


def test_wide_bus():
    """A 256-bit bus: the 16-byte-aligned blocks are misaligned for the port."""
    rng = np.random.default_rng(14)
    jobs = [_actmul(2, 40, 10, 50, addr=0x1000), _actmul(1, 33, 5, 5, addr=0x400D, wide=True),
            _actmul(1, 8, 0, 40, addr=PAST_END)]
    assert _check(rng, jobs, data_width=256) == [ErrorCode.OK, ErrorCode.OK, ErrorCode.BAD_ADDRESS]


def test_wide_lanes():
    """64 lanes: rows packed into beats wider than a line (see check_wide_lanes)."""
    check_wide_lanes(np.random.default_rng(5), ActMulSequencer, _memory, Op.ACTMUL, list(BLOCKS))


def test_lint():
    ok, log = verilator_lint(to_verilog(ActMulSequencer(TINY, 128), "actmul_sequencer"),
                             "actmul_sequencer")
    assert ok, log


def test_cycle_model_refuses_an_underived_writer_stall():
    """The cycle model's ACTMUL writer-stall lag is derived for 16, 32 and 64 lanes only: a
    job the writer paces at another lane count is an error naming it, not a bound dropped."""
    ins = Instruction(Op.ACTMUL, flags=Flag.WIDE, rows=1, dst=40, src=0, n=256, addr=0x1000)
    CycleModel(TINY.with_changes(lanes=64, mem_port_bits=256)).instruction(ins)
    with pytest.raises(ConfigError, match=r"lanes = 128.*\[16, 32, 64\]"):
        CycleModel(TINY.with_changes(lanes=128, mem_port_bits=256)).instruction(ins)


def test_cycles_equal_the_model():
    """The table loads a line (8 entries) a cycle: every job's cycles, n = 0 included and
    on 128- and 512-bit buses and at 64 lanes, are the cycle model's."""
    rng = np.random.default_rng(15)
    jobs = [_actmul(1, 16, 10, 40), _actmul(2, 20, 60, 60, addr=0x2003, wide=True),
            _actmul(2, 0, 10, 10, addr=0x3008), _actmul(1, 5, 170, 190, addr=0x400D)]
    for data_width in (128, 512):
        assert check_row_jobs(rng, ActMulSequencer, _memory, jobs, data_width,
                              timed=True) == [ErrorCode.OK] * len(jobs)
    check_wide_lanes(rng, ActMulSequencer, _memory, Op.ACTMUL, list(BLOCKS), timed=True)
