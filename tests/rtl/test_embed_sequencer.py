"""EmbedSequencer against the functional model's EMBED (sim/op_bench.py): the row into
VMEM (int32 rows of ``4n`` bytes), its BAD_ADDRESS refusals, and the input token read from
``token_addr`` (0 in the bench: device address 0). Token ``t``'s row is at ``addr + t·S``
with ``S = embed_row_stride(n, beat)`` (rows padded to whole memory beats); a table off the
beat is refused by the memory port, as the functional model refuses it."""

from __future__ import annotations

import numpy as np

from dfvg_hw.embed_sequencer import EmbedSequencer
from dfvg_hw.spec.config import get_preset
from dfvg_hw.spec.descriptors import ErrorCode
from dfvg_hw.spec.image import embed_row_stride
from dfvg_hw.spec.isa import Op
from dfvg_hw.verilog import to_verilog
from sim.lint import verilator_lint
from sim.memory import DeviceMemory
from sim.op_bench import compare_with_reference, reference_jobs, run_jobs

TINY = get_preset("tiny")
TABLE = 0x1000


def _memory(token: int) -> DeviceMemory:
    memory = DeviceMemory(TINY.mem_bytes)
    memory.write(0, token.to_bytes(4, "little"))       # the bench's input token
    rng = np.random.default_rng(3)
    memory.write(TABLE, rng.integers(0, 256, 8 * 1024, dtype=np.uint8).tobytes())
    return memory


def _embed(n, dst, addr=TABLE):
    return dict(opcode=Op.EMBED, rows=1, n=n, dst=dst, addr=addr)


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
    """tiny-hbm's engine beat is 64 bytes (four 128-bit channels): random rows of 1 … 40
    entries for tokens 0 … 3, each at ``TABLE + t · embed_row_stride(n, 64)``, as the
    functional model reads them (the bench's one 512-bit port stands for the striped
    port, which has its timing)."""
    hbm = get_preset("tiny-hbm")
    rng = np.random.default_rng(8)
    vmem = rng.integers(0, 256, hbm.vmem_bytes, dtype=np.uint8)
    for token in range(4):
        jobs = [_embed(int(rng.integers(1, 41)), int(rng.integers(0, hbm.vmem_bytes // 16 - 10)),
                       TABLE + 64 * int(rng.integers(0, 16))) for _ in range(5)]
        jobs.append(_embed(4, 9, TABLE + 16))                  # a table off the beat
        got, errors = run_jobs(hbm, EmbedSequencer(hbm, 512), vmem, _memory(token), jobs,
                               data_width=512)
        # the reference's token is 0: token t's row is t padded rows on
        want, want_errors = reference_jobs(
            hbm, vmem, _memory(token),
            [_embed(j["n"], j["dst"], j["addr"] + token * embed_row_stride(j["n"], 64)) for j in jobs])
        assert errors == want_errors == [ErrorCode.OK] * 5 + [ErrorCode.BAD_ADDRESS]
        np.testing.assert_array_equal(got, want)


def test_lint():
    ok, log = verilator_lint(to_verilog(EmbedSequencer(TINY, 128), "embed_sequencer"),
                             "embed_sequencer")
    assert ok, log
