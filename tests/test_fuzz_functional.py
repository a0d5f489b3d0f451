"""Random programs on random images through the sim device (sim.fuzz): every run completes
or stops with an ErrorCode, never another exception, never past its time bound. Plus one
regression test per fault the fuzzer found at its cause (the RTL halves of the cycle-count
ones are in tests/rtl/test_fuzz_rtl.py), and tests of the comparison itself."""

import time

import numpy as np
import pytest

from dfvg_hw.spec.config import get_preset
from dfvg_hw.spec.descriptors import DraftRequest, ErrorCode
from dfvg_hw.spec.image import NORM_PARAM_BYTES, embed_row_stride
from dfvg_hw.spec.isa import IllegalInstruction, Instruction, MatmulMode, Op, decode, encode
from dfvg_hw.spec.regmap import OP_CYCLE_BUCKETS, Control, Reg
from sim.cycle_model import BEFORE_FINISH, ISSUE, CycleModel
from sim.device import SimDevice
from sim.head_stream_timing import head_end_line, head_end_lines, run_lines
from sim.fuzz import DeviceRunner, FuzzCase, Outcome, Tally, compare, fuzz_rtl, random_case, run_case
from sim.session import FunctionalSession

TINY = get_preset("tiny")
#: 800 programs, half of them model-shaped (~20 s on one loaded core); the script runs
#: longer samples. A case's bound is 30 s: a watchdog case runs up to ~40 000 instructions
#: of real work, ~5 s.
SEEDS, PER_SEED = 5, 160


@pytest.mark.parametrize("seed", range(SEEDS))
def test_random_programs_fault_only_with_error_codes(seed):
    rng = np.random.default_rng(seed)
    tally = Tally()
    for _ in range(PER_SEED):
        case = random_case(rng, TINY)
        tally.add(case, run_case(TINY, case, time_limit_s=30.0))
    # (30 to 51 of 160 complete, over the seeds: the model-shaped half, less its mutations)
    assert tally.ends["OK"] >= PER_SEED // 6 and tally.ends["PROGRAM"]
    # the model-shaped half reaches every unit in runs that complete
    assert [op.name for op in Op if op != Op.NOP and not tally.ran[op.name]] == []


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


def test_huge_kvappend_is_priced_without_listing_its_lines():
    """n = 59099 heads of k = 65535 bytes (fuzz seed 10, case 12 at tiny): the cycle model
    prices it before the unit faults it, and used to list the row's 242 million VMEM lines
    first (seconds and gigabytes); the head ends are now in closed form."""
    t = time.perf_counter()
    s = session(Instruction(Op.KVAPPEND, rows=1, dst=0, src=0, n=59099, k=65535, addr=0))
    assert s.run(REQUEST).status == ErrorCode.PROGRAM and time.perf_counter() - t < 2


def test_head_ends_in_closed_form_are_the_listed_ones():
    """:func:`~sim.head_stream_timing.head_end_line` (KVAPPEND's price) against the line
    list it replaced, on random rows: any head width, line and first-line offset."""
    rng = np.random.default_rng(5)
    for _ in range(2000):
        k, n = int(rng.integers(0, 300)), int(rng.integers(0, 40))
        line = int(rng.choice([16, 32, 64]))
        skip = int(rng.integers(0, line))
        listed = head_end_lines(run_lines(n * k, 1, line, skip), k, n)
        assert [head_end_line(h, k, line, skip) for h in range(n)] == listed


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


def test_embed_rows_are_padded_to_the_beat():
    """Row t is at addr + t · embed_row_stride(n, beat) (docs/isa.md §3.2): every row of a
    beat-aligned table is aligned whatever n and the token, and a table off the beat
    faults whatever the token."""
    assert embed_row_stride(2, TINY.mem_beat_bytes) == TINY.mem_beat_bytes
    s = session(Instruction(Op.EMBED, rows=1, dst=0, n=2, addr=0x100))
    for token in (0, 2, 3):
        assert s.run(DraftRequest([token], start_pos=0, n_draft=0)).status == ErrorCode.OK
    s = session(Instruction(Op.EMBED, rows=1, dst=0, n=2, addr=0x108))
    for token in (0, 3):
        assert s.run(DraftRequest([token], start_pos=0, n_draft=0)).status == ErrorCode.BAD_ADDRESS


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


# -- cycle counts the RTL comparison (sim.fuzz.fuzz_rtl, tests/test_fuzz_rtl.py) found off --

def _request_cycles(model, n_in, n_records=0, *, header_only=False, final_fetch=True):
    """The REQUEST bucket: the header (and the token scan), the result write, and the
    FETCH that finds the request over where the request has one."""
    start = model.request_header()[0] if header_only else model.request_start(n_in)[0]
    return start + model.request_finish(n_records)[0] - (0 if final_fetch else BEFORE_FINISH)


@pytest.mark.parametrize("tokens, n_draft, cycles", [([3], 0, 20), ([3], 2, 20 + 7)])
def test_embed_of_an_empty_row(tokens, n_draft, cycles):
    """EMBED n = 0 reads no row (a zero-length read is a no-op for the memory port): the
    RTL takes 20 cycles at ``tiny`` with the input token (7 with a drafted one); the model
    charged the row read's latency, 33."""
    image = bytearray(4096)
    image[0x200:0x200 + 8] = b"\x10\x00" * 4                # a LOGITS block for the draft
    s = session(Instruction(Op.EMBED, rows=1, dst=0, n=0, addr=0x100),
                Instruction(Op.BRANCH, flags=1, n=4),
                Instruction(Op.MATMUL, flags=int(MatmulMode.LOGITS) << 1, rows=1, n=4, k=8, addr=0x200),
                Instruction(Op.SAMPLE, n=4), Instruction(Op.NEXT, n=0), image=bytes(image))
    r = s.run(DraftRequest(tokens, start_pos=0, n_draft=n_draft))
    assert r.status == ErrorCode.OK and len(r.tokens) == n_draft
    assert s.engine.counts.by_op["EMBED"] == cycles


@pytest.mark.parametrize("word", [0xEE, encode(Instruction(Op.MATMUL, rows=1, n=8, k=8)) | 1 << 24])
def test_an_illegal_word_is_charged_to_request(word):
    """Whatever its opcode byte, an illegal word's fetch and decode (ISSUE) are REQUEST's,
    and the request ends at that decode (no further FETCH), as the RTL counts them; the
    model charged nothing for them, the RTL a legal opcode byte's bucket."""
    s = FunctionalSession(TINY, bytes(256), [encode(Instruction(Op.NOP)), word])
    r = s.run(REQUEST)
    assert r.status == ErrorCode.ILLEGAL_INSTRUCTION and r.error_pc == 1
    model = CycleModel(TINY)
    assert s.engine.counts.by_op == {"REQUEST": _request_cycles(model, 1, final_fetch=False) + ISSUE,
                                     "NOP": ISSUE}


@pytest.mark.parametrize("request_, header_only", [
    (DraftRequest([3], start_pos=0, n_draft=0, topk=0), True),        # a header field
    (DraftRequest([3, TINY.vocab_max], start_pos=0, n_draft=0), False),  # a token
])
def test_a_refused_request_costs_what_it_read(request_, header_only):
    """A header that fails its checks is refused before the token scan, and a refused
    request has no FETCH before FINISH; the model charged both."""
    s = session()
    assert s.run(request_).status == ErrorCode.BAD_REQUEST
    assert s.engine.counts.by_op == {"REQUEST": _request_cycles(CycleModel(TINY), len(request_.tokens),
                                                                header_only=header_only,
                                                                final_fetch=False)}


@pytest.mark.parametrize("ins, final_fetch", [
    (Instruction(Op.ROPE, rows=1, dst=0, src=0, n=1, k=3, addr=0), False),    # a unit's fault
    (Instruction(Op.SAMPLE, n=4), False),                                       # SAMPLE's, at decode
    (Instruction(Op.ENDLOOP), True),               # the program flow's: seen at the next FETCH
    (Instruction(Op.NOP), True),                   # HALT
])
def test_the_fetch_that_ends_a_request(ins, final_fetch):
    """A request that ends at a FETCH (HALT, a control instruction's fault) spends it
    before FINISH; one that a unit or SAMPLE stops goes to FINISH at once."""
    s = session(ins)
    r = s.run(REQUEST)
    assert (r.status == ErrorCode.OK) == (ins.opcode == Op.NOP)
    assert s.engine.counts.by_op["REQUEST"] == _request_cycles(CycleModel(TINY), 1, final_fetch=final_fetch)


@pytest.mark.parametrize("rows, n, addr", [(1, 3, 0), (2, 65535, 0), (1, 1, 0xFFFF_FFF0)])
def test_rope_of_an_empty_head(rows, n, addr):
    """ROPE k = 0 reads no table row (wherever it would be: the last case lies past device
    memory) and rotates no head: 7 cycles whatever n, as the RTL takes them (9 before ROPE
    streamed its heads and checked its spans before the table read); the model once
    charged the table read and 11 cycles a head, and refused the address."""
    s = session(Instruction(Op.ROPE, rows=rows, dst=0, src=0, n=n, k=0, addr=addr))
    assert s.run(REQUEST).status == ErrorCode.OK
    assert s.engine.counts.by_op["ROPE"] == 7


@pytest.mark.parametrize("rows", [1, 2])
def test_actmul_of_empty_rows(rows):
    """ACTMUL n = 0 loads its parameters and table (a line a cycle) and stops (47 + L
    cycles, docs/isa.md §8); the model's row loop once went one row short of nothing."""
    s = session(Instruction(Op.ACTMUL, rows=rows, dst=0, src=0, n=0, addr=0x100))
    assert s.run(REQUEST).status == ErrorCode.OK
    assert s.engine.counts.by_op["ACTMUL"] == 47 + TINY.mem_latency_cycles


# -- the comparison itself (sim.fuzz.compare, DeviceRunner): it must be able to fail --------

class _Silent(SimDevice):
    """An engine whose requests never raise the interrupt."""

    def wait_irq(self, timeout_s):
        return False


class _Stuck(SimDevice):
    """A register access after START that never returns."""

    started = False

    def write32(self, offset, value):
        super().write32(offset, value)
        self.started |= offset == Reg.CONTROL and bool(value & Control.START)

    def read32(self, offset):
        while self.started:
            time.sleep(1)
        return super().read32(offset)


@pytest.mark.parametrize("device", [_Silent, _Stuck])
def test_a_device_that_hangs_is_a_hang_and_is_replaced(device):
    rng = np.random.default_rng(0)
    cases = [(i, random_case(rng, TINY, forward_p=1.0)) for i in range(2)]
    runner = DeviceRunner(TINY, device, timeout_s=0.3, grace_s=0.3)
    rtl, ref, bad, _ = fuzz_rtl(TINY, cases, runner, log=lambda line: None)
    runner.close()
    assert rtl.hangs == 2 and not ref.hangs and runner.made == 2
    assert [what.startswith("rtl hang | sim ") for _, what in bad] == [True, True]


def test_a_device_that_raises_is_a_bare_exception():
    class Broken(SimDevice):
        def dma_read(self, addr, nbytes):
            raise RuntimeError("the harness exited")
    rng = np.random.default_rng(0)
    runner = DeviceRunner(TINY, Broken)
    rtl, ref, bad, _ = fuzz_rtl(TINY, [(0, random_case(rng, TINY, forward_p=1.0))], runner,
                                log=lambda line: None)
    assert list(rtl.bare) and "the harness exited" in list(rtl.bare)[0] and len(bad) == 1
    # and the sim device against itself agrees
    rtl, ref, bad, _ = fuzz_rtl(TINY, [(0, random_case(rng, TINY, forward_p=1.0))],
                                DeviceRunner(TINY, SimDevice), log=lambda line: None)
    assert not bad and rtl.ends == ref.ends


def _outcome(error=ErrorCode.OK, pc=0, **units):
    full = dict.fromkeys(OP_CYCLE_BUCKETS, 0) | units
    return Outcome(error, [], sum(full.values()), pc, full)


ROPE_THEN_HALT = FuzzCase(program(Instruction(Op.ROPE, rows=1, dst=0, src=0, n=1, k=2, addr=0)),
                          bytes(16), b"", 0)


BA, PR = ErrorCode.BAD_ADDRESS, ErrorCode.PROGRAM


@pytest.mark.parametrize("rtl, ref, same", [
    (_outcome(ROPE=30, REQUEST=100), _outcome(ROPE=30, REQUEST=100), True),
    (_outcome(ROPE=30, REQUEST=100), _outcome(ROPE=31, REQUEST=100), False),   # completed: exact
    (_outcome(ROPE=30, REQUEST=101), _outcome(ROPE=30, REQUEST=100), False),
    # a fault that stops the ROPE: its bucket counted on both, REQUEST no shorter
    (_outcome(BA, ROPE=9, REQUEST=120), _outcome(BA, ROPE=4, REQUEST=100), True),
    (_outcome(BA, ROPE=9, REQUEST=99), _outcome(BA, ROPE=4, REQUEST=100), False),
    (_outcome(BA, REQUEST=100), _outcome(BA, ROPE=4, REQUEST=100), False),
    (_outcome(BA, ROPE=4, NOP=2, REQUEST=100), _outcome(BA, ROPE=4, REQUEST=100), False),
    # the error PC, the code
    (_outcome(BA, 1, ROPE=4), _outcome(BA, 0, ROPE=4), False),
    (_outcome(PR, ROPE=4), _outcome(BA, ROPE=4), False),
    # a fault at a fetch (past the program's end: pc 2) stops no instruction: exact
    (_outcome(PR, 2, ROPE=30, REQUEST=101), _outcome(PR, 2, ROPE=30, REQUEST=100), False),
])
def test_compare(rtl, ref, same):
    assert (compare(ROPE_THEN_HALT, rtl, ref) is None) == same


def test_forward_cases_draw_kv_slot_bases_that_fit_and_that_fault():
    """The model-shaped cases' kv_slot_base (docs/isa.md §1.4): some nonzero bases run
    to the end, some one slot past the program's slots fault PROGRAM (the RTL sample of
    tests/rtl/test_fuzz_rtl.py compares both to the RTL)."""
    from sim.fuzz import random_forward_case
    rng = np.random.default_rng(3)
    ends = {}
    for _ in range(120):
        case = random_forward_case(rng, TINY, mutations=0)
        base = DraftRequest.unpack_header(case.request)["kv_slot_base"]
        if base:
            outcome = run_case(TINY, case, time_limit_s=30.0)
            ends.setdefault(outcome.error.name, set()).add(base)
    assert len(ends.get("OK", ())) >= 2 and ends.get("PROGRAM")


def _unit_instructions(case: FuzzCase) -> list[Instruction]:
    """The case's program words that decode (the illegal ones are skipped)."""
    out = []
    for word in case.program:
        try:
            out.append(decode(word))
        except IllegalInstruction:
            pass
    return out


def test_cases_draw_bias_int32_and_rmsnorm_segments():
    """The generators reach issue #17's operations (the random sample above runs them):
    MATMUL with and without BIAS in each of the four modes, RMSNORM of k = 0 … 3 segments
    whose n is a multiple of 16 or not, and model-shaped forwards with biased q/k/v and a
    per-head QK-norm that run to the end."""
    from sim.fuzz import random_forward_case
    rng = np.random.default_rng(17)
    matmuls, norms, qk_ends = set(), set(), set()
    for _ in range(300):
        for ins in _unit_instructions(random_case(rng, TINY, forward_p=0.0)):
            if ins.opcode == Op.MATMUL:
                matmuls.add((int(ins.mode), ins.bias))
            elif ins.opcode == Op.RMSNORM:
                norms.add((ins.k, ins.n % 16 == 0))
    assert matmuls == {(mode, bias) for mode in range(4) for bias in (False, True)}
    assert norms == {(k, whole) for k in range(4) for whole in (False, True)}
    for _ in range(400):
        case = random_forward_case(rng, TINY, mutations=0)
        program = _unit_instructions(case)
        if any(i.opcode == Op.RMSNORM and i.k > 1 for i in program) and \
                any(i.opcode == Op.MATMUL and i.bias for i in program):
            qk_ends.add(run_case(TINY, case, time_limit_s=30.0).error.name)
            if "OK" in qk_ends:
                break
    assert "OK" in qk_ends
