"""RopeSequencer against the functional model's ROPE (sim/op_bench.py): many heads and
rows at every byte offset, in place and not, table rows at every bus offset, and the
faults in the model's order; heads streamed over 16-, 32- and 64-byte lines, heads of
several lines and rows ending inside a line, in the cycle model's cycles; int16 heads
(``WIDE``) among int8 ones."""

from __future__ import annotations

import numpy as np
import pytest

from dfvg_hw.spec.config import VMEM_LINE_BYTES, get_preset
from dfvg_hw.spec.descriptors import ErrorCode
from dfvg_hw.spec.isa import Flag, Instruction, Op
from dfvg_hw.rope_sequencer import RopeSequencer
from sim.functional import FunctionalEngine
from sim.memory import DeviceMemory
from sim.op_bench import functional_reference, run_jobs
from dfvg_hw.verilog import to_verilog
from sim.lint import verilator_lint
from sequencer_cases import WIDE_LINES, wide_line

TINY = get_preset("tiny")
L = VMEM_LINE_BYTES
OK, PROGRAM, KV_OVERFLOW, BAD_ADDRESS = (ErrorCode.OK, ErrorCode.PROGRAM, ErrorCode.KV_OVERFLOW,
                                         ErrorCode.BAD_ADDRESS)
#: the RoPE table's base: not bus-aligned, so table rows start at many byte offsets
TABLE = 0x2000 + 6


def _memory(rng, config=TINY) -> DeviceMemory:
    memory = DeviceMemory(config.mem_bytes)
    span = config.kv_positions * 2 * config.head_dim + 64
    memory.write(TABLE, rng.integers(0, 256, span, dtype=np.uint8).tobytes())
    return memory


def _rope(rows, n, k, src, dst, pos, addr=TABLE, flags=0):
    return dict(opcode=Op.ROPE, flags=flags, rows=rows, n=n, k=k, src=src, dst=dst, pos=pos, addr=addr)


def _run(rng, jobs, *, data_width=128, config=TINY, cycles=None):
    """Run ``jobs`` on the RTL and on the functional model; compare errors and VMEM."""
    vmem = rng.integers(0, 256, config.vmem_bytes, dtype=np.uint8)
    memory = _memory(rng, config)
    after, errors = run_jobs(config, RopeSequencer(config, data_width), vmem, memory, jobs,
                             data_width=data_width, cycles=cycles)
    engine = FunctionalEngine(config, memory)
    engine.vmem[:] = vmem
    expected = [functional_reference(engine, Instruction(Op.ROPE, flags=j["flags"], rows=j["rows"],
                                                         dst=j["dst"], src=j["src"], n=j["n"],
                                                         k=j["k"], addr=j["addr"]), pos=j["pos"])
                for j in jobs]
    assert errors == expected
    np.testing.assert_array_equal(after, engine.vmem)
    return errors


def _random_jobs(rng, count, config=TINY):
    """ROPEs of 1–2 rows, 1–8 heads of even k ≤ head_dim at any position; half in place,
    the rest into a disjoint region (the model reads all rows before writing any)."""
    jobs = []
    for _ in range(count):
        rows, n = int(rng.integers(1, config.rows + 1)), int(rng.integers(1, 9))
        k = 2 * int(rng.integers(1, config.head_dim // 2 + 1))
        src = int(rng.integers(0, 100))
        dst = src if rng.random() < 0.5 else int(rng.integers(128, 240))
        jobs.append(_rope(rows, n, k, src, dst, int(rng.integers(0, config.kv_positions))))
    return jobs


@pytest.mark.parametrize("data_width", [128, 256])
def test_heads_rows_in_place_and_table_offsets(data_width):
    rng = np.random.default_rng(20 + data_width)
    jobs = _random_jobs(rng, 30 if data_width == 128 else 12)
    errors = _run(rng, jobs, data_width=data_width)
    assert errors == [OK] * len(jobs)
    if data_width == 128:
        assert sum(j["rows"] * j["n"] * j["k"] for j in jobs) >= 1000


def test_faults_in_the_functional_models_order():
    rng = np.random.default_rng(30)
    last = TINY.vmem_bytes // L - 1
    past_end = TINY.mem_bytes - 2 * TINY.head_dim + 4
    jobs = [_rope(1, 2, 16, 0, 0, 5),
            # PROGRAM: rows > cfg.rows before an odd k before the position
            _rope(3, 2, 16, 0, 0, 64), _rope(1, 2, 7, 0, 0, 64), _rope(2, 1, 15, last, 0, 1),
            # KV_OVERFLOW before the table and the spans
            _rope(1, 2, 16, last, last, 64, addr=past_end),
            # BAD_ADDRESS: the table row past device memory (the port refuses; the bench
            # resets the sequencer), then src, then dst
            _rope(1, 2, 16, 0, 0, 0, addr=past_end), _rope(1, 2, 16, 0, 0, 1),
            _rope(1, 2, 16, last, 0, 3), _rope(2, 1, 16, last, 0, 3), _rope(1, 4, 8, 0, last, 3),
            _rope(1, 1, 16, last, last, 3),
            # n = 0 or k = 0 rotate nothing
            _rope(1, 0, 16, 0, 0, 2), _rope(2, 3, 0, 0, 0, 2), _rope(2, 3, 10, 7, 7, 63)]
    errors = _run(rng, jobs)
    assert errors == [OK] + [PROGRAM] * 3 + [KV_OVERFLOW] + [BAD_ADDRESS, OK] \
        + [BAD_ADDRESS] * 3 + [OK] * 4


def test_head_beyond_head_dim_is_refused():
    """The documented limit: an even k > head_dim (which the model would rotate) faults
    PROGRAM rather than computing something else."""
    rng = np.random.default_rng(31)
    vmem = rng.integers(0, 256, TINY.vmem_bytes, dtype=np.uint8)
    after, errors = run_jobs(TINY, RopeSequencer(TINY, 128), vmem, _memory(rng),
                             [_rope(1, 1, TINY.head_dim + 2, 0, 0, 1)])
    assert errors == [PROGRAM]
    np.testing.assert_array_equal(after, vmem)


def test_lint_clean():
    clean, output = verilator_lint(to_verilog(RopeSequencer(TINY, 128), "rope_sequencer"),
                                   "rope_sequencer")
    assert clean, output


def test_cycles_equal_the_model():
    """Heads overlap (the next gather hides the Rope's latency): every job's cycles are
    the cycle model's, for a lone head, one row, several rows, heads over line ends, and
    on a 128- and 512-bit bus."""
    from sequencer_cases import model_cycles
    jobs = [_rope(1, 1, 16, 0, 0, 5), _rope(1, 4, 16, 10, 10, 7), _rope(2, 3, 10, 7, 7, 63),
            _rope(2, 1, 16, 20, 150, 9), _rope(1, 8, 6, 3, 3, 60)]
    for data_width in (128, 512):
        rng = np.random.default_rng(32)
        vmem = rng.integers(0, 256, TINY.vmem_bytes, dtype=np.uint8)
        cycles = []
        _, errors = run_jobs(TINY, RopeSequencer(TINY, data_width), vmem, _memory(rng), jobs,
                             data_width=data_width, cycles=cycles)
        assert errors == [OK] * len(jobs)
        assert cycles == [model_cycles(TINY, data_width, job) for job in jobs]


@pytest.mark.parametrize("line", WIDE_LINES)
def test_wider_lines(line):
    """VMEM lines of 32 and 64 bytes: heads gathered and scattered over the wider lines
    (any byte offset), as the functional model, in the cycle model's cycles."""
    from sequencer_cases import model_cycles
    config, data_width = wide_line(line)
    rng = np.random.default_rng(40 + line)
    jobs = _random_jobs(rng, 8, config)
    cycles = []
    assert _run(rng, jobs, data_width=data_width, config=config, cycles=cycles) == [OK] * len(jobs)
    assert cycles == [model_cycles(config, data_width, job) for job in jobs]


def _stream_jobs(rng, count, config, wide_share=0.0):
    """ROPEs of up to ``config.rows`` rows (half of them ≥ 2) of up to 24 heads of any
    even ``k ≤ head_dim`` (so rows often end inside a line), at any position; in place,
    or into lines that do not overlap the source; ``wide_share`` of them int16 (WIDE)."""
    L, lines = config.vmem_line_bytes, config.vmem_bytes // config.vmem_line_bytes
    jobs = []
    while len(jobs) < count:
        rows = int(rng.integers(2, config.rows + 1)) if len(jobs) % 2 else 1
        n = int(rng.integers(1, 25))
        k = 2 * int(rng.integers(1, config.head_dim // 2 + 1))
        wide = rng.random() < wide_share
        span = rows * -(-n * k * (2 if wide else 1) // L)
        if 2 * span > lines:
            continue
        src = int(rng.integers(0, lines - span + 1))
        dst = src
        if rng.random() < 0.5:                  # apart: before or after the source
            free = [d for d in (int(rng.integers(0, lines - span + 1)) for _ in range(8))
                    if d + span <= src or src + span <= d]
            dst = free[0] if free else src
        jobs.append(_rope(rows, n, k, src, dst, int(rng.integers(0, config.kv_positions)),
                          flags=Flag.WIDE if wide else 0))
    return jobs


@pytest.mark.parametrize("line, head_dim", [(16, 64), (32, 64), (64, 64)])
def test_streamed_heads(line, head_dim):
    """Heads streamed through the cutter, the Rope and the packer: 16-byte lines under
    heads of up to four lines, 32-byte lines, and 64-byte lines (alveo-u55c's) with up
    to 24 heads a row and 4 rows, rows ending inside a line; VMEM as the functional
    model's, every job in the cycle model's cycles (the cutter held up by its queue until
    the table row is in, then by its lines)."""
    from sequencer_cases import model_cycles
    config, data_width = wide_line(line, TINY.with_changes(rows=4, head_dim=head_dim))
    rng = np.random.default_rng(50 + line)
    jobs = _stream_jobs(rng, 6, config)
    cycles = []
    assert _run(rng, jobs, data_width=data_width, config=config, cycles=cycles) == [OK] * len(jobs)
    assert cycles == [model_cycles(config, data_width, job) for job in jobs]
    assert sum(j["rows"] * j["n"] * j["k"] for j in jobs) >= 1000


@pytest.mark.parametrize("line", [16, 64])
def test_wide_heads(line):
    """int16 heads (ROPE WIDE: 2k bytes a head, results saturated to 16 bits) among int8
    ones, over 16- and 64-byte lines, in place and not: VMEM as the functional model's,
    every job in the cycle model's cycles."""
    from sequencer_cases import model_cycles
    config, data_width = wide_line(line, TINY.with_changes(rows=4, head_dim=64))
    rng = np.random.default_rng(70 + line)
    jobs = _stream_jobs(rng, 8, config, wide_share=0.6)
    cycles = []
    assert _run(rng, jobs, data_width=data_width, config=config, cycles=cycles) == [OK] * len(jobs)
    assert cycles == [model_cycles(config, data_width, job) for job in jobs]
    assert sum(j["rows"] * j["n"] * j["k"] for j in jobs if j["flags"]) >= 1000


def test_wide_spans_are_twice_as_long():
    """A WIDE row is 2·n·k bytes: a row that fits VMEM's last lines as int8 faults
    BAD_ADDRESS as int16, in src and in dst, before anything is written."""
    rng = np.random.default_rng(33)
    last = TINY.vmem_bytes // L - 1
    jobs = [_rope(1, 1, 16, last, 0, 3), _rope(1, 1, 16, last, 0, 3, flags=Flag.WIDE),
            _rope(1, 1, 16, 0, last, 3, flags=Flag.WIDE), _rope(1, 1, 16, last - 1, last - 1, 3, flags=Flag.WIDE),
            _rope(1, 1, 18, 0, 0, 3, flags=Flag.WIDE), _rope(1, 3, 0, 0, 0, 2, flags=Flag.WIDE)]
    assert _run(rng, jobs) == [OK, BAD_ADDRESS, BAD_ADDRESS, OK, PROGRAM, OK]
