"""An engine built without block multipliers (``EngineConfig.weight_blocks=False``) against
the functional model at the same configuration (sim.fuzz.compare: error code, error PC,
tokens and cycle counters):

* a ``BLOCKS`` MATMUL faults ``PROGRAM`` at its PC in both, after a plain MATMUL that ran
  (before its weight block's address is checked), on the whole engine in Amaranth's
  simulator;
* a model-shaped forward (the fuzzer's, which draws no ``BLOCKS`` on such an engine)
  completes bit-exact and in the cycle model's cycles;
* on the functional model, a seeded fuzz sample at that configuration ends only in error
  codes, and the random programs meet the ``BLOCKS`` refusal.
"""

from __future__ import annotations

import numpy as np
import pytest

from dfvg_hw.spec.config import get_preset
from dfvg_hw.spec.descriptors import DraftRequest, ErrorCode
from dfvg_hw.spec.isa import Flag, IllegalInstruction, Instruction as I, MatmulMode, Op, decode, encode
from sim import fuzz
from sim.rtl_device import RtlDevice

NO_BLOCKS = get_preset("tiny").with_changes(weight_blocks=False)
#: the functional sample: its seed and size (~2 s)
SEED, CASES = 5, 200


@pytest.fixture(scope="module")
def runner():
    r = fuzz.DeviceRunner(NO_BLOCKS, RtlDevice, timeout_s=300)
    yield r
    r.close()


def _case(*ins, image=None, request=DraftRequest([3], start_pos=0, n_draft=0)):
    words = [encode(i) for i in ins] + [encode(I(Op.HALT))]
    image = image if image is not None else np.random.default_rng(1).bytes(4096)
    return fuzz.FuzzCase(words, image, request.pack(), request.n_draft)


def _agree(runner, case, error: str):
    want = fuzz.run_case(NO_BLOCKS, case)
    got = runner.run(case)
    assert want.error.name == error
    assert fuzz.compare(case, got, want) is None


def test_blocks_faults_program_in_rtl_and_model(runner):
    plain = I(Op.MATMUL, rows=1, dst=40, src=0, n=8, k=8, addr=0x100)
    # its weight block would end past device memory: BLOCKS is refused first
    blocks = I(Op.MATMUL, flags=int(Flag.BLOCKS | Flag.BIAS) | int(MatmulMode.LOGITS) << 1, rows=1,
               n=8, k=8, addr=NO_BLOCKS.mem_bytes - 8)
    _agree(runner, _case(plain, blocks), "PROGRAM")


def test_a_forward_runs_as_the_model_says(runner):
    # (a forward that drafts a token: ~4200 cycles, 1700 of them MATMUL's)
    case = fuzz.random_forward_case(np.random.default_rng(0), NO_BLOCKS, mutations=0)
    _agree(runner, case, "OK")


def test_functional_fuzz_sample_meets_the_refusal():
    rng = np.random.default_rng(SEED)
    refused = 0
    for _ in range(CASES):
        case = fuzz.random_case(rng, NO_BLOCKS)
        out = fuzz.run_case(NO_BLOCKS, case, time_limit_s=30.0)
        if out.error == ErrorCode.PROGRAM and out.error_pc < len(case.program):
            try:
                ins = decode(case.program[out.error_pc])
            except IllegalInstruction:
                continue
            refused += ins.opcode == Op.MATMUL and ins.blocks
    assert refused
