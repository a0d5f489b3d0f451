"""EmbedSequencer against the functional model's EMBED (sim/op_bench.py): the row into
VMEM (int32 rows of ``4n`` bytes), its BAD_ADDRESS refusals, and the input token read from
``token_addr`` (0 in the bench: device address 0). Token ``t``'s row is at ``addr + t·S``
with ``S = embed_row_stride(n, beat)`` (rows padded to whole memory beats); a table off the
beat is refused by the memory port, as the functional model refuses it.

With ``POSITION`` (OPT's learned position embeddings) the row is the job's ``pos``: random
positions up to the last, KV_OVERFLOW past it before any other check, the same refusals,
no token read (each job's cycles are the cycle model's), and a tree forward's rows, one job
each, all at the level's POS."""

from __future__ import annotations

import numpy as np
import pytest

from dfvg_hw.embed_sequencer import EmbedSequencer
from dfvg_hw.spec.config import get_preset
from dfvg_hw.spec.descriptors import ErrorCode
from dfvg_hw.spec.image import embed_row_stride
from dfvg_hw.spec.isa import Flag, Op
from dfvg_hw.verilog import to_verilog
from sim.lint import verilator_lint
from sim.memory import DeviceMemory
from sim.op_bench import compare_with_reference, reference_jobs, run_jobs
from sim.tree_state import TreeState
from sequencer_cases import WIDE_LINES, wide_line

TINY = get_preset("tiny")
TABLE = 0x1000
#: the widest row of the POSITION tests
MAX_N = 40


def _memory(token: int) -> DeviceMemory:
    memory = DeviceMemory(TINY.mem_bytes)
    memory.write(0, token.to_bytes(4, "little"))       # the bench's input token
    rng = np.random.default_rng(3)
    memory.write(TABLE, rng.integers(0, 256, 8 * 1024, dtype=np.uint8).tobytes())
    return memory


def _embed(n, dst, addr=TABLE):
    return dict(opcode=Op.EMBED, rows=1, n=n, dst=dst, addr=addr)


def _embed_position(n, dst, pos, addr=TABLE):
    return dict(opcode=Op.EMBED, flags=Flag.POSITION, rows=1, n=n, dst=dst, addr=addr, pos=pos)


def _position_memory(rng, config) -> DeviceMemory:
    """A random int32 table at ``TABLE`` with a padded row for every position (the widest
    row the tests use), another at the very end of device memory, and input token 7 at
    address 0, whose row differs from every position's."""
    memory = DeviceMemory(config.mem_bytes)
    memory.write(0, (7).to_bytes(4, "little"))
    span = config.kv_positions * embed_row_stride(MAX_N, config.mem_beat_bytes) + 1024
    memory.write(TABLE, rng.integers(-(1 << 31), 1 << 31, span // 4).astype("<i4").tobytes())
    memory.write(config.mem_bytes - span,
                 rng.integers(-(1 << 31), 1 << 31, span // 4).astype("<i4").tobytes())
    return memory


def _check_timed(config, data_width, vmem, memory, jobs, rtl_jobs=None):
    """Run ``rtl_jobs`` (default ``jobs``) on the sequencer and ``jobs`` on the functional
    model; assert the same errors and VMEM, that every OK job takes the cycle model's
    cycles and every KV_OVERFLOW one cycle (the unit overhead the model charges a refused
    job: ``done`` in the job's first cycle); return the error codes."""
    from sequencer_cases import model_cycles
    rtl_jobs = jobs if rtl_jobs is None else rtl_jobs
    cycles = []
    after, errors = run_jobs(config, EmbedSequencer(config, data_width), vmem, memory, rtl_jobs,
                             data_width=data_width, cycles=cycles)
    want, want_errors = reference_jobs(config, vmem, memory, jobs)
    if rtl_jobs is jobs:
        assert errors == want_errors
    np.testing.assert_array_equal(after, want)
    for job, got, error in zip(rtl_jobs, cycles, errors):
        if error == ErrorCode.OK:
            assert got == model_cycles(config, data_width, job), job
        elif error == ErrorCode.KV_OVERFLOW:
            assert got == 1, job
    return errors, want_errors


def test_rows_and_refusals_as_the_functional_model():
    vmem = np.random.default_rng(4).integers(0, 256, TINY.vmem_bytes, dtype=np.uint8)
    last_line = TINY.vmem_bytes // 16 - 1
    # rows must be bus-aligned (the memory port's reads are): token 0 at aligned tables
    jobs = [_embed(16, 3), _embed(5, 40, TABLE + 64), _embed(24, 7, TABLE + 128),
            _embed(16, last_line),                              # past VMEM's end
            _embed(16, 0, TINY.mem_bytes - 8)]                  # past device memory
    errors = compare_with_reference(TINY, EmbedSequencer(TINY, 128), vmem, _memory(0), jobs)
    assert errors == [ErrorCode.OK] * 3 + [ErrorCode.BAD_ADDRESS] * 2
    errors = compare_with_reference(TINY, EmbedSequencer(TINY, 256), vmem, _memory(0),
                                    jobs[:3], data_width=256)
    assert errors == [ErrorCode.OK] * 3


def test_a_row_longer_than_the_span_field_is_refused():
    """``4n`` wider than VMEM's span byte field saturates instead of wrapping into a short
    row that fits (a case the engine fuzz found: the RTL wrote 1728 bytes and said OK)."""
    vmem = np.zeros(TINY.vmem_bytes, dtype=np.uint8)
    for job in (_embed(61872, 78, TABLE + 64), dict(_embed(61872, 78), flags=Flag.POSITION, pos=0)):
        errors = compare_with_reference(TINY, EmbedSequencer(TINY, 128), vmem, _memory(0), [job])
        assert errors == [ErrorCode.BAD_ADDRESS]


def test_the_input_token_selects_the_row():
    """Token 3 at ``TABLE`` is the functional model's token 0 three rows on."""
    vmem = np.zeros(TINY.vmem_bytes, np.uint8)
    n = 16
    got, errors = run_jobs(TINY, EmbedSequencer(TINY, 128), vmem, _memory(3), [_embed(n, 2)])
    want, _ = reference_jobs(TINY, vmem, _memory(3), [_embed(n, 2, TABLE + 3 * 4 * n)])
    assert errors == [ErrorCode.OK]
    np.testing.assert_array_equal(got, want)


def test_random_rows_and_the_row_alignment():
    """Over 1000 random int32 table entries (random bytes) in rows of 1 … 40 at aligned
    tables; then token 1 with ``4n`` a multiple of the beat or not: the row one padded row
    on (the functional model's token 0 at ``TABLE + S``), and a table off the beat
    refused."""
    rng = np.random.default_rng(6)
    vmem = rng.integers(0, 256, TINY.vmem_bytes, dtype=np.uint8)
    jobs, values = [], 0
    while values < 1000:
        n = int(rng.integers(1, 41))
        jobs.append(_embed(n, int(rng.integers(0, TINY.vmem_bytes // 16 - 10)),
                           TABLE + 16 * int(rng.integers(0, 256))))
        values += n
    errors = compare_with_reference(TINY, EmbedSequencer(TINY, 128), vmem, _memory(0), jobs)
    assert errors == [ErrorCode.OK] * len(jobs)
    # (the reference's token is 0: token 1's table starts one padded row on for it)
    jobs = [_embed(3, 5), _embed(4, 5), _embed(6, 9), _embed(8, 9), _embed(4, 9, TABLE + 8)]
    got, errors = run_jobs(TINY, EmbedSequencer(TINY, 128), vmem, _memory(1), jobs)
    want, want_errors = reference_jobs(
        TINY, vmem, _memory(1), [_embed(j["n"], j["dst"], j["addr"] + embed_row_stride(j["n"], 16))
                                 for j in jobs])
    assert errors == want_errors == [ErrorCode.OK] * 4 + [ErrorCode.BAD_ADDRESS]
    np.testing.assert_array_equal(got, want)


def test_rows_at_the_multichannel_engine_beat():
    """tiny-hbm's engine beat is 64 bytes (four 128-bit channels), and EMBED reads through
    the beat narrower at one channel's 16: random rows of 1 … 40 entries for tokens 0 … 3,
    each at ``TABLE + t · embed_row_stride(n, 64)`` (rows padded to the engine beat), from
    tables on any 16-byte boundary, as the functional model reads them; a table off the
    narrow beat is refused by both (the bench's one 128-bit port stands for the narrower,
    which has its timing)."""
    hbm = get_preset("tiny-hbm")
    narrow = hbm.mem_port_bits
    rng = np.random.default_rng(8)
    vmem = rng.integers(0, 256, hbm.vmem_bytes, dtype=np.uint8)
    for token in range(4):
        jobs = [_embed(int(rng.integers(1, 41)), int(rng.integers(0, hbm.vmem_bytes // 16 - 10)),
                       TABLE + 16 * int(rng.integers(0, 64))) for _ in range(5)]
        jobs.append(_embed(4, 9, TABLE + 8))                   # a table off the narrow beat
        got, errors = run_jobs(hbm, EmbedSequencer(hbm, narrow, row_beat_bits=hbm.mem_beat_bytes * 8),
                               vmem, _memory(token), jobs, data_width=narrow)
        # the reference's token is 0: token t's row is t padded rows on
        want, want_errors = reference_jobs(
            hbm, vmem, _memory(token),
            [_embed(j["n"], j["dst"], j["addr"] + token * embed_row_stride(j["n"], 64)) for j in jobs])
        assert errors == want_errors == [ErrorCode.OK] * 5 + [ErrorCode.BAD_ADDRESS]
        np.testing.assert_array_equal(got, want)


def test_position_rows_as_the_functional_model():
    """Over 1000 random int32 table entries copied by POSITION jobs at random positions
    (0 and the last among them), rows of 1 … 40 at random beat-aligned tables; then the
    faults in the model's order: KV_OVERFLOW at and past ``kv_positions`` before a table
    off the beat and a row past VMEM, BAD_ADDRESS for each of those alone, and the last
    row of device memory read and one past it refused. Every OK job takes the cycle
    model's cycles (no token read)."""
    rng = np.random.default_rng(40)
    memory = _position_memory(rng, TINY)
    vmem = rng.integers(0, 256, TINY.vmem_bytes, dtype=np.uint8)
    last_line, last_pos = TINY.vmem_bytes // 16 - 1, TINY.kv_positions - 1
    jobs, values = [_embed_position(MAX_N, 0, 0), _embed_position(MAX_N, 20, last_pos)], 2 * MAX_N
    while values < 1000:
        n = int(rng.integers(1, MAX_N + 1))
        jobs.append(_embed_position(n, int(rng.integers(0, last_line - 10)),
                                    int(rng.integers(0, TINY.kv_positions)),
                                    TABLE + 16 * int(rng.integers(0, 64))))
        values += n
    errors, _ = _check_timed(TINY, 128, vmem, memory, jobs)
    assert errors == [ErrorCode.OK] * len(jobs)
    stride = embed_row_stride(16, TINY.mem_beat_bytes)
    at_end = TINY.mem_bytes - TINY.kv_positions // 2 * stride      # rows 0 … 31 in memory
    # (the row past VMEM last: VMEM's refusal is sticky until the request ends, which the
    # bench does not model)
    faults = [_embed_position(16, 3, TINY.kv_positions), _embed_position(16, 3, 0xFFFF),
              _embed_position(16, last_line, TINY.kv_positions, TABLE + 4),
              _embed_position(16, 3, 5, TABLE + 4),
              _embed_position(16, 3, TINY.kv_positions // 2 - 1, at_end),
              _embed_position(16, 3, TINY.kv_positions // 2, at_end),
              _embed_position(16, last_line, 5)]
    errors, _ = _check_timed(TINY, 128, vmem, memory, faults)
    assert errors == [ErrorCode.KV_OVERFLOW] * 3 + [ErrorCode.BAD_ADDRESS, ErrorCode.OK] \
        + [ErrorCode.BAD_ADDRESS] * 2


def test_position_rows_at_wider_beats():
    """POSITION rows on a 256- and a 512-bit bus (rows padded to 32- and 64-byte beats):
    random rows and positions, the table off the beat refused, cycles the model's."""
    for data_width in (256, 512):
        config = TINY.with_changes(mem_port_bits=data_width)
        rng = np.random.default_rng(41 + data_width)
        memory = _position_memory(rng, config)
        vmem = rng.integers(0, 256, config.vmem_bytes, dtype=np.uint8)
        beat = data_width // 8
        jobs = [_embed_position(int(rng.integers(1, MAX_N + 1)),
                                int(rng.integers(0, config.vmem_bytes // 16 - 10)),
                                int(rng.integers(0, config.kv_positions)),
                                TABLE + beat * int(rng.integers(0, 16))) for _ in range(6)]
        jobs.append(_embed_position(4, 9, 3, TABLE + 16))
        errors, _ = _check_timed(config, data_width, vmem, memory, jobs)
        assert errors == [ErrorCode.OK] * 6 + [ErrorCode.BAD_ADDRESS]


@pytest.mark.parametrize("line", WIDE_LINES)
def test_wider_lines(line):
    """VMEM lines of 32 and 64 bytes, on a port one line wide: POSITION rows (the token
    rows' path from the table on) split into the wider lines, a row's last line partial,
    as the functional model, in the cycle model's cycles."""
    config, data_width = wide_line(line)
    rng = np.random.default_rng(44 + line)
    memory = _position_memory(rng, config)
    vmem = rng.integers(0, 256, config.vmem_bytes, dtype=np.uint8)
    lines = config.vmem_bytes // line
    jobs = [_embed_position(int(rng.integers(1, MAX_N + 1)), int(rng.integers(0, lines - 10)),
                            int(rng.integers(0, config.kv_positions)),
                            TABLE + line * int(rng.integers(0, 16))) for _ in range(6)]
    errors, _ = _check_timed(config, data_width, vmem, memory, jobs)
    assert errors == [ErrorCode.OK] * len(jobs)


def test_a_tree_levels_rows_all_embed_pos():
    """A tree forward's POSITION EMBED of W rows (the controller's one job per row, the
    last first, ``r · pitch`` lines on, each with the level's POS) against the model's
    tree EMBED: every row holds POS's row, whatever its node's token; a level past the KV
    positions overflows in its first job."""
    rng = np.random.default_rng(43)
    memory = _position_memory(rng, TINY)
    vmem = rng.integers(0, 256, TINY.vmem_bytes, dtype=np.uint8)
    width, pitch, n = TINY.rows, 12, 33
    for base, level in ((5, 1), (20, 3), (TINY.kv_positions - 2, 2), (TINY.kv_positions - 1, 2)):
        pos, dst = base + level - 1, int(rng.integers(0, 100))
        tree = TreeState(width, base, level, tokens=[int(t) for t in rng.integers(0, 1000, width)])
        job = _embed_position(n, dst, pos) | {"rows": width}
        rtl_jobs = [job | {"rows": 1, "dst": dst + r * pitch} for r in reversed(range(width))]
        errors, want_errors = _check_timed(TINY, 128, vmem, memory, [job | {"pitch": pitch, "tree": tree}],
                                           rtl_jobs)
        if pos < TINY.kv_positions:
            assert errors == [ErrorCode.OK] * width and want_errors == [ErrorCode.OK]
        else:
            assert errors[0] == want_errors[0] == ErrorCode.KV_OVERFLOW


def test_lint():
    ok, log = verilator_lint(to_verilog(EmbedSequencer(TINY, 128), "embed_sequencer"),
                             "embed_sequencer")
    assert ok, log
