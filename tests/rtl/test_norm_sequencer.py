"""NormSequencer against the functional model's RMSNORM (sim/op_bench.py)."""

from __future__ import annotations

import numpy as np

from dfvg_hw.config import VMEM_LINE_BYTES, get_preset
from dfvg_hw.descriptors import ErrorCode
from dfvg_hw.image import NORM_PARAM_BYTES, pack_norm_params
from dfvg_hw.isa import Flag, Instruction, Op
from dfvg_hw.norm_sequencer import NormSequencer
from sim.functional import FunctionalEngine
from sim.memory import DeviceMemory
from sim.op_bench import functional_reference, run_jobs
from sim.rtl_tools import to_verilog, verilator_lint

TINY = get_preset("tiny")
L = VMEM_LINE_BYTES
MAX_N = 64
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


def _reference(vmem, memory, jobs, config=TINY):
    engine = FunctionalEngine(config, memory)
    engine.vmem[:] = vmem
    errors = []
    for job in jobs:
        ins = Instruction(Op.RMSNORM, flags=job["flags"], rows=job["rows"], dst=job["dst"],
                          src=job["src"], n=job["n"], addr=job["addr"])
        errors.append(functional_reference(engine, ins))
    return engine.vmem, errors


def _norm(rows, n, src, dst, addr=BLOCKS[0], wide=False):
    return dict(opcode=Op.RMSNORM, flags=Flag.WIDE if wide else 0, rows=rows, n=n, src=src,
                dst=dst, addr=addr)


def _check(rng, jobs, data_width=128, config=TINY):
    vmem = rng.integers(0, 256, config.vmem_bytes, dtype=np.uint8)
    memory = _memory(rng)
    after, errors = run_jobs(config, NormSequencer(config, data_width), vmem, memory, jobs,
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
    return _norm(rows, n, src, dst, addr=BLOCKS[int(rng.integers(len(BLOCKS)))], wide=wide)


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
    rng = np.random.default_rng(3)
    jobs = [_random_job(rng) for _ in range(24)]
    _check(rng, jobs)
    elements = sum(j["rows"] * j["n"] for j in jobs)
    assert elements >= 1000, elements


def test_wide_bus():
    """A 256-bit bus: the 16-byte-aligned blocks are misaligned for the port."""
    rng = np.random.default_rng(4)
    jobs = [_norm(2, 40, 10, 50, addr=BLOCKS[0] + 16), _norm(1, 33, 5, 5, addr=BLOCKS[1], wide=True),
            _norm(1, 8, 0, 40, addr=BAD_SHIFT)]
    assert _check(rng, jobs, data_width=256) == [ErrorCode.OK, ErrorCode.OK, ErrorCode.PROGRAM]


def test_wide_lanes():
    """64 lanes (the Alveo presets'): unit beats wider than a line, so rows are packed
    into beats and results split into lines, with surplus lines past a row's end; each
    job starts only after the previous one's surplus has left."""
    rng = np.random.default_rng(5)
    blocks = BLOCKS
    jobs = [_norm(2, 20, 60, 60, addr=blocks[1], wide=True), _norm(1, 100, 10, 40, addr=blocks[0]),
            _norm(2, 9, 100, 100, addr=blocks[2], wide=True), _norm(1, 70, 150, 200, addr=blocks[3], wide=True),
            _norm(2, 33, 80, 30, addr=blocks[0])]
    errors = _check(rng, jobs, data_width=256, config=TINY.with_changes(lanes=64))
    assert errors == [ErrorCode.OK] * len(jobs)


def test_lint():
    ok, log = verilator_lint(to_verilog(NormSequencer(TINY, 128), "norm_sequencer"), "norm_sequencer")
    assert ok, log
