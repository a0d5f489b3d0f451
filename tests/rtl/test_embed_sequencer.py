"""EmbedSequencer against the functional model's EMBED (sim/op_bench.py): the row into
VMEM, its BAD_ADDRESS refusals, and the input token read from ``token_addr`` (0 in the
bench: device address 0). The row's address must be bus-aligned (a row at an unaligned
address is refused by the memory port, as it was before EMBED became a sequencer)."""

from __future__ import annotations

import numpy as np

from dfvg_hw.embed_sequencer import EmbedSequencer
from dfvg_hw.spec.config import get_preset
from dfvg_hw.spec.descriptors import ErrorCode
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
    want, _ = reference_jobs(TINY, vmem, _memory(3), [_embed(n, 2, TABLE + 3 * 2 * n)])
    assert errors == [ErrorCode.OK]
    np.testing.assert_array_equal(got, want)


def test_lint():
    ok, log = verilator_lint(to_verilog(EmbedSequencer(TINY, 128), "embed_sequencer"),
                             "embed_sequencer")
    assert ok, log
