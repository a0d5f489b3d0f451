"""ActMulSequencer against the functional model's ACTMUL (sim/op_bench.py)."""

from __future__ import annotations

import struct

import numpy as np

from dfvg_hw.config import VMEM_LINE_BYTES, get_preset
from dfvg_hw.descriptors import ErrorCode
from dfvg_hw.image import ACT_PARAM_BYTES
from dfvg_hw.isa import Flag, Instruction, Op
from dfvg_hw.actmul_sequencer import ActMulSequencer
from sim.functional import FunctionalEngine
from sim.memory import DeviceMemory
from sim.op_bench import functional_reference, run_jobs
from sim.rtl_tools import to_verilog, verilator_lint

TINY = get_preset("tiny")
L = VMEM_LINE_BYTES
MAX_N = 64
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


def _reference(vmem, memory, jobs, config=TINY):
    engine = FunctionalEngine(config, memory)
    engine.vmem[:] = vmem
    errors = []
    for job in jobs:
        ins = Instruction(Op.ACTMUL, flags=job["flags"], rows=job["rows"], dst=job["dst"],
                          src=job["src"], n=job["n"], addr=job["addr"])
        errors.append(functional_reference(engine, ins))
    return engine.vmem, errors


def _actmul(rows, n, src, dst, addr=0x1000, wide=False):
    return dict(opcode=Op.ACTMUL, flags=Flag.WIDE if wide else 0, rows=rows, n=n, src=src,
                dst=dst, addr=addr)


def _check(rng, jobs, data_width=128, config=TINY):
    vmem = rng.integers(0, 256, config.vmem_bytes, dtype=np.uint8)
    memory = _memory(rng)
    after, errors = run_jobs(config, ActMulSequencer(config, data_width), vmem, memory, jobs,
                             data_width=data_width)
    expected, expected_errors = _reference(vmem, memory, jobs, config)
    assert errors == expected_errors
    np.testing.assert_array_equal(after, expected)
    return errors


def _random_job(rng):
    n = int(rng.integers(1, MAX_N + 1))
    rows = int(rng.integers(1, TINY.rows + 1))
    wide = bool(rng.integers(2))
    lines = TINY.vmem_bytes // L
    src_lines = rows * -(-2 * n // L)
    dst_lines = rows * -(-(2 if wide else 1) * n // L)
    src = int(rng.integers(0, lines - src_lines))
    dst = src
    while rng.random() >= 0.25 and dst == src:
        # in place or apart: a partly overlapping destination is not supported
        candidate = int(rng.integers(0, lines - dst_lines))
        if candidate + dst_lines <= src or src + src_lines <= candidate:
            dst = candidate
    return _actmul(rows, n, src, dst, addr=list(BLOCKS)[int(rng.integers(len(BLOCKS)))], wide=wide)


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
    rng = np.random.default_rng(13)
    jobs = [_random_job(rng) for _ in range(24)]
    _check(rng, jobs)
    elements = sum(j["rows"] * j["n"] for j in jobs)
    assert elements >= 1000, elements


def test_wide_bus():
    """A 256-bit bus: the 16-byte-aligned blocks are misaligned for the port."""
    rng = np.random.default_rng(14)
    jobs = [_actmul(2, 40, 10, 50, addr=0x1000), _actmul(1, 33, 5, 5, addr=0x400D, wide=True),
            _actmul(1, 8, 0, 40, addr=PAST_END)]
    assert _check(rng, jobs, data_width=256) == [ErrorCode.OK, ErrorCode.OK, ErrorCode.BAD_ADDRESS]


def test_wide_lanes():
    """64 lanes (the Alveo presets'): unit beats wider than a line, so rows are packed
    into beats and results split into lines, with surplus lines past a row's end; each
    job starts only after the previous one's surplus has left."""
    rng = np.random.default_rng(5)
    blocks = list(BLOCKS)
    jobs = [_actmul(2, 20, 60, 60, addr=blocks[1], wide=True), _actmul(1, 100, 10, 40, addr=blocks[0]),
            _actmul(2, 9, 100, 100, addr=blocks[2], wide=True), _actmul(1, 70, 150, 200, addr=blocks[3], wide=True),
            _actmul(2, 33, 80, 30, addr=blocks[0])]
    errors = _check(rng, jobs, data_width=256, config=TINY.with_changes(lanes=64))
    assert errors == [ErrorCode.OK] * len(jobs)


def test_lint():
    ok, log = verilator_lint(to_verilog(ActMulSequencer(TINY, 128), "actmul_sequencer"),
                             "actmul_sequencer")
    assert ok, log
