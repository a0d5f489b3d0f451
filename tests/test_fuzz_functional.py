"""Random programs on random images through the sim device (sim.fuzz): every run completes
or stops with an ErrorCode, never another exception, never past its time bound. Plus one
regression test per fault the fuzzer found at its cause."""

import numpy as np
import pytest

from dfvg_hw.spec.config import get_preset
from dfvg_hw.spec.descriptors import DraftRequest, ErrorCode
from dfvg_hw.spec.image import NORM_PARAM_BYTES
from dfvg_hw.spec.isa import Instruction, MatmulMode, Op, encode
from sim.fuzz import FuzzCase, random_case, run_case
from sim.session import FunctionalSession

TINY = get_preset("tiny")
SEEDS, PER_SEED = 5, 250          # 1,250 programs (~25 s); the script runs longer samples


@pytest.mark.parametrize("seed", range(SEEDS))
def test_random_programs_fault_only_with_error_codes(seed):
    rng = np.random.default_rng(seed)
    seen = set()
    for _ in range(PER_SEED):
        seen.add(run_case(TINY, random_case(rng, TINY), time_limit_s=5.0).error)
    assert ErrorCode.OK in seen and ErrorCode.PROGRAM in seen


def program(*ins):
    return [encode(i) for i in ins] + [encode(Instruction(Op.HALT))]


def session(*ins, image=bytes(4096)):
    return FunctionalSession(TINY, image, program(*ins))


REQUEST = DraftRequest([3], start_pos=0, n_draft=0)


@pytest.mark.parametrize("eps", [0, 7])
def test_rmsnorm_of_zero_row(eps):
    """An all-zero row (VMEM starts zeroed) with eps = 0 used to raise a bare ValueError."""
    image = bytearray(4096)
    image[0:4] = eps.to_bytes(4, "little")
    image[NORM_PARAM_BYTES:NORM_PARAM_BYTES + 64] = b"\x10\x00" * 32
    s = session(Instruction(Op.RMSNORM, rows=1, dst=8, src=0, n=32, addr=0), image=bytes(image))
    s.engine.vmem[128:192] = 0xAA
    assert s.run(REQUEST).status == ErrorCode.OK
    assert not s.engine.vmem[128:160].any()


def test_huge_matmul_faults_before_the_cycle_model():
    """n = k = 65535 is refused by its operand checks; it used to run the cycle model for
    a minute first. The faulting instruction is charged its issue only."""
    import time
    t = time.perf_counter()
    s = session(Instruction(Op.MATMUL, rows=1, dst=0, src=0, n=65535, k=65535, addr=0))
    r = s.run(REQUEST)
    assert r.status == ErrorCode.BAD_ADDRESS and time.perf_counter() - t < 2
    assert s.engine.counts.by_op["MATMUL"] == 4


@pytest.mark.parametrize("mode, code", [(MatmulMode.LOGITS, ErrorCode.PROGRAM),
                                        (MatmulMode.INT8, ErrorCode.BAD_ADDRESS)])
def test_matmul_check_order(mode, code):
    """LOGITS n > vocab_max is PROGRAM after the source span, before the destination's."""
    s = session(Instruction(Op.MATMUL, flags=int(mode) << 1, rows=1, dst=0xFFFF, src=0,
                            n=TINY.vocab_max + 1, k=8, addr=0))
    assert s.run(REQUEST).status == code


@pytest.mark.parametrize("offset, code", [(0, ErrorCode.OK), (2, ErrorCode.BAD_ADDRESS),
                                          (8, ErrorCode.BAD_ADDRESS)])
def test_embed_row_must_be_beat_aligned(offset, code):
    """EMBED reads its row with one memory command, which the memory port refuses unless it
    starts on a beat (docs/isa.md §3.2); the model used to read it anyway."""
    s = session(Instruction(Op.EMBED, rows=1, dst=0, n=8, addr=0x100 + offset))
    r = s.run(REQUEST)
    assert r.status == code
    if code:
        assert r.error_pc == 0 and s.engine.counts.by_op["EMBED"] == 4


def test_embed_alignment_counts_the_token():
    """The row address includes TOKEN · 4n (int32 rows): token 3 with n = 2 is 24 bytes in."""
    s = session(Instruction(Op.EMBED, rows=1, dst=0, n=2, addr=0x100))
    assert s.run(DraftRequest([3], start_pos=0, n_draft=0)).status == ErrorCode.BAD_ADDRESS
    assert s.run(DraftRequest([2], start_pos=0, n_draft=0)).status == ErrorCode.OK


@pytest.mark.parametrize("k, code", [(TINY.head_dim, ErrorCode.OK),
                                     (TINY.head_dim + 2, ErrorCode.PROGRAM)])
def test_rope_beyond_head_dim(k, code):
    """The ROPE unit rotates one head per beat of head_dim (docs/isa.md §3.5): a larger
    even k faults PROGRAM, as the RTL does; the model used to rotate it."""
    s = session(Instruction(Op.ROPE, rows=1, dst=0, src=0, n=1, k=k, addr=0))
    assert s.run(REQUEST).status == code


def test_rope_kv_overflow_before_head_dim():
    """The RTL's order: odd k, then POS, then k > head_dim."""
    s = session(Instruction(Op.ROPE, rows=1, dst=0, src=0, n=1, k=TINY.head_dim + 2, addr=0))
    r = s.run(DraftRequest([3], start_pos=TINY.kv_positions, n_draft=0))
    assert r.status == ErrorCode.KV_OVERFLOW


def test_sample_over_an_empty_logit_vector():
    """A LOGITS matmul of n = 0 leaves the buffer empty; SAMPLE n=0 then faults PROGRAM as
    the RTL does (it tests the buffer's length), where the model raised a bare ValueError."""
    s = session(Instruction(Op.MATMUL, flags=int(MatmulMode.LOGITS) << 1, rows=1, n=0, k=8, addr=0),
                Instruction(Op.SAMPLE, n=0))
    r = s.run(DraftRequest([3], start_pos=0, n_draft=1, topk=4))
    assert r.status == ErrorCode.PROGRAM and r.error_pc == 1 and not r.tokens
