"""The ``rtl+verilator`` device against the ``sim`` device on fuzz cases (sim.fuzz): the
same error code, error PC, tokens and cycle counters (sim.fuzz.compare), no hang and no
exception but the engine's faults, on

* every disagreement the fuzzer found, as an explicit case (the cause is in each case's
  comment; the sim-side halves are in tests/test_fuzz_functional.py), and
* a bounded seeded sample of random cases at ``tiny`` (``scripts/fuzz_functional.py
  --rtl N`` runs longer ones), and the explicit cases and a smaller sample at
  ``tiny-hbm``, whose four channels put the beat narrower in front of every unit but
  MATMUL (reads off the engine beat, faults that leave a narrow read in flight to drain),
  and
* a seeded sample at tiny-hbm with 32-byte VMEM lines on 256-bit channels (issue #14:
  the line is a generator parameter; every unit's VMEM streams, windows and spans at
  the wider line, behind the narrower), and
* model-shaped programs as trees of width 1 (NEXT re-enters the program as its tree
  forward, docs/isa.md §9.2): the tree's KV positions and paths, and the row pitch that
  splits RMSNORM, ROPE and ACTMUL of two rows into single-row jobs.

One Verilator device serves the module: making one generates the engine's Verilog (to
find its cached build), which costs more than the cases themselves.

The random cases draw MATMUL's four modes with and without ``BIAS``, RMSNORMs of
``k`` = 0 … 3 segments, and forwards with biased q/k/v and a per-head QK-norm.
"""

from __future__ import annotations

import struct

import numpy as np
import pytest

from dfvg_hw.spec.config import get_preset
from dfvg_hw.spec.descriptors import (REQUEST_FIELDS, REQUEST_HEADER_WORDS, DraftRequest, pack_fields,
                                      unpack_fields)
from dfvg_hw.spec.isa import Cond, Instruction as I, MatmulMode, Op, encode
from sim import fuzz
from sim.verilator_device import VerilatorDevice

TINY = get_preset("tiny")
HBM = get_preset("tiny-hbm")
#: the tiny-hbm sample (the tiny-hbm Verilator build is the multi-channel driver tests')
HBM_SEED, HBM_CASES = 17, 40
#: tiny-hbm with 32-byte VMEM lines (a 256-bit channel's beat; head_dim whole lines; 16
#: lanes, so a weight tile is a whole 128-byte engine beat), each channel at a beat a
#: cycle: below that the cycle model under-counts RMSNORM rows longer than a few beats
#: (its gamma read's backpressure; at 16-byte lines too, not this test's subject), and
#: its sample
WIDE_LINE = HBM.with_changes(name="tiny-hbm-line32", mem_port_bits=256, vmem_line_bytes=32,
                             head_dim=32, lanes=16, mem_bandwidth_gbps=12.8,
                             mem_achievable_gbps=0.0)
WIDE_LINE_SEED, WIDE_LINE_CASES = 23, 60
#: the random sample: its seed, its size, and the longest case it runs (model cycles;
#: a watchdog case runs millions, minutes on Verilator). ~20 s on one loaded core.
SEED, CASES, MAX_MODEL_CYCLES = 16, 150, 20_000


@pytest.fixture(scope="module")
def runner():
    r = fuzz.DeviceRunner(TINY, VerilatorDevice, timeout_s=300)
    yield r
    r.close()


def _case(*ins, request=DraftRequest([3], start_pos=0, n_draft=0), halt=True, image=None):
    words = [i if isinstance(i, int) else encode(i) for i in ins]
    words += [encode(I(Op.HALT))] if halt else []
    image = image if image is not None else np.random.default_rng(1).bytes(4096)
    return fuzz.FuzzCase(words, image, request.pack(), request.n_draft)


def _drafting(embed_n):
    """EMBED then the logits and SAMPLE of a forward that drafts, NEXT back to 0."""
    return (I(Op.EMBED, rows=1, dst=0, n=embed_n, addr=0x100),
            I(Op.BRANCH, flags=int(Cond.NO_SAMPLE), n=4),
            I(Op.MATMUL, flags=int(MatmulMode.LOGITS) << 1, rows=1, n=4, k=8, addr=0x200),
            I(Op.SAMPLE, n=4), I(Op.NEXT, n=0))


REGRESSIONS = {
    # EMBED n = 0 reads no row (a zero-length read is a no-op); the cycle model charged the
    # row read's latency (seed 7 case 224 of scripts/fuzz_functional.py: 124 vs 137)
    "embed_empty_row": (_case(I(Op.EMBED, rows=1, dst=53, n=0, addr=7152)), "OK"),
    "embed_empty_row_drafted": (_case(*_drafting(0), request=DraftRequest([3], start_pos=0, n_draft=3)),
                                "OK"),
    # ROPE k = 0 reads no table row (not even one past memory) and rotates no head; the
    # model charged both and refused the address (seed 7 case 399: 9 vs 720907 cycles)
    "rope_of_an_empty_head": (_case(I(Op.ROPE, rows=2, dst=0, src=0, n=65535, k=0, addr=0xFFFF_FFF0)), "OK"),
    # ACTMUL n = 0 stops after its table; the model's row loop ran (seed 7 case 797)
    "actmul_of_empty_rows": (_case(I(Op.ACTMUL, rows=2, dst=112, src=0, n=0, addr=0x100)), "OK"),
    # an illegal word's fetch and decode are REQUEST's whatever its opcode byte: the RTL
    # charged a legal opcode byte's bucket, the model nothing at all
    "illegal_with_an_opcode_byte": (_case(I(Op.NOP), encode(I(Op.MATMUL, rows=1, n=8, k=8)) | 1 << 24),
                                    "ILLEGAL_INSTRUCTION"),
    "illegal_opcode_byte": (_case(I(Op.NOP), 0xEE), "ILLEGAL_INSTRUCTION"),
    # a header refused scans no tokens; a refused request has no FETCH before FINISH
    "header_refused": (_case(request=DraftRequest([3, 4], start_pos=0, n_draft=0, topk=0)), "BAD_REQUEST"),
    "token_refused": (_case(request=DraftRequest([3, TINY.vocab_max], start_pos=0, n_draft=0)),
                      "BAD_REQUEST"),
    # a unit's or SAMPLE's fault goes to FINISH at once; a control instruction's is seen
    # at the next FETCH (the model charged that FETCH to all of them)
    "unit_fault": (_case(I(Op.NOP), I(Op.ROPE, rows=1, dst=0, src=0, n=1, k=3, addr=0)), "PROGRAM"),
    "sample_fault": (_case(I(Op.SAMPLE, n=4)), "PROGRAM"),
    "control_fault": (_case(I(Op.NOP), I(Op.ENDLOOP)), "PROGRAM"),
    "past_the_end": (_case(I(Op.NOP), halt=False), "PROGRAM"),
    # an EMBED refused by VMEM has issued its row read, which the RTL drains after FINISH
    # (REQUEST, longer than the model's: allowed on a fault that stops an instruction)
    "embed_outside_vmem": (_case(I(Op.EMBED, rows=1, dst=54131, n=16, addr=160)), "BAD_ADDRESS"),
    # earlier findings (issue #16), where the model disagreed with the RTL on the code:
    # an EMBED table off the memory beat is BAD_ADDRESS,
    "embed_table_off_the_beat": (_case(I(Op.EMBED, rows=1, dst=0, n=2, addr=0x108)), "BAD_ADDRESS"),
    # ROPE with k > head_dim is PROGRAM,
    "rope_beyond_head_dim": (_case(I(Op.ROPE, rows=1, dst=0, src=0, n=1, k=TINY.head_dim + 2, addr=0)),
                             "PROGRAM"),
    # an all-zero row with eps 0 normalises to zeros (the model raised),
    "rmsnorm_of_a_zero_row": (_case(I(Op.RMSNORM, rows=1, dst=8, src=0, n=32, addr=0),
                                    I(Op.MATMUL, flags=int(MatmulMode.LOGITS) << 1, rows=1, src=8, n=16,
                                      k=32, addr=0x400),
                                    I(Op.SAMPLE, n=16),
                                    request=DraftRequest([3], start_pos=0, n_draft=1, topk=4),
                                    image=bytes(0x400) + np.random.default_rng(2).bytes(0x400)), "OK"),
    # and n = k = 65535 is refused before any work (the model priced it for a minute first)
    "huge_matmul": (_case(I(Op.MATMUL, rows=1, dst=0, src=0, n=65535, k=65535, addr=0)), "BAD_ADDRESS"),
}


@pytest.fixture(scope="module")
def hbm_runner():
    r = fuzz.DeviceRunner(HBM, VerilatorDevice, timeout_s=300)
    yield r
    r.close()


def _check_regressions(config, runner):
    names = list(REGRESSIONS)
    rtl, ref, bad, skipped = fuzz.fuzz_rtl(config, [(i, REGRESSIONS[n][0]) for i, n in enumerate(names)],
                                           runner, log=lambda line: None)
    assert [(names[i], what) for i, what in bad] == []
    assert not (rtl.hangs or rtl.bare or ref.hangs or ref.bare or skipped)
    want = {}
    for _, code in REGRESSIONS.values():
        want[code] = want.get(code, 0) + 1
    assert dict(ref.ends) == dict(rtl.ends) == want


def test_regressions(runner):
    _check_regressions(TINY, runner)


def _agreeing_sample(config, runner, seed: int, count: int):
    """``count`` seeded random cases at ``config``: the RTL and the model agree on every
    one, nothing hangs or raises, few are skipped and a fifth complete; the RTL's tally."""
    rng = np.random.default_rng(seed)
    cases = [(i, fuzz.random_case(rng, config)) for i in range(count)]
    rtl, ref, bad, skipped = fuzz.fuzz_rtl(config, cases, runner, log=lambda line: None,
                                           max_model_cycles=MAX_MODEL_CYCLES)
    assert bad == []
    assert not (rtl.hangs or rtl.bare or ref.hangs or ref.bare)
    assert rtl.ends == ref.ends and skipped < count // 10
    assert rtl.ends["OK"] >= count // 5
    return rtl


def test_regressions_and_a_sample_at_tiny_hbm(hbm_runner):
    """The explicit cases and a seeded sample on the narrow path (tiny-hbm): a drain
    that did not flush the narrower's reads in flight hangs a later request here."""
    _check_regressions(HBM, hbm_runner)
    _agreeing_sample(HBM, hbm_runner, HBM_SEED, HBM_CASES)


def test_a_sample_at_a_wider_vmem_line():
    """A seeded sample at :data:`WIDE_LINE`: results bit for bit and every cycle counter
    the cycle model's, with every unit opcode run among the cases."""
    r = fuzz.DeviceRunner(WIDE_LINE, VerilatorDevice, timeout_s=300)
    try:
        rtl = _agreeing_sample(WIDE_LINE, r, WIDE_LINE_SEED, WIDE_LINE_CASES)
    finally:
        r.close()
    assert [op.name for op in Op if op != Op.NOP and not rtl.ran[op.name]] == []


def test_random_cases(runner):
    """A seeded sample: nothing but agreement, and the sample reaches the engine (runs
    that complete, every unit opcode among them, faults of several codes)."""
    rtl = _agreeing_sample(TINY, runner, SEED, CASES)
    assert len(rtl.ends) >= 5
    assert [op.name for op in Op if op != Op.NOP and not rtl.ran[op.name]] == []


def _as_tree(case: fuzz.FuzzCase, row_pitch: int) -> fuzz.FuzzCase:
    """``case`` with a request for a tree of width 1 entered at PC 0, rows ``row_pitch``
    lines apart."""
    words = list(struct.unpack(f"<{len(case.request) // 4}I", case.request))
    header = unpack_fields(REQUEST_FIELDS, words[:REQUEST_HEADER_WORDS])
    header.update(tree_width=1, tree_pc=0, row_pitch=row_pitch)
    words[:REQUEST_HEADER_WORDS] = pack_fields(REQUEST_FIELDS, REQUEST_HEADER_WORDS, header)
    return fuzz.FuzzCase(case.program, case.image, struct.pack(f"<{len(words)}I", *words), case.n_draft)


def test_random_trees_of_width_one(runner):
    """Model-shaped programs drafting trees of width 1: every drafted forward is a tree
    forward, its KV stored at S(d, 0) and attended through its path. Row pitches of 0
    (several rows keep their own stride) and of more lines than any row here: rows that
    overlap are not held to the functional model, which reads every row of an operand
    before it writes one, where the RTL's jobs go a row at a time."""
    assert runner.tree_width() == TINY.rows
    rng = np.random.default_rng(3)
    cases = [(i, _as_tree(fuzz.random_forward_case(rng, TINY, mutations=int(rng.choice([0, 0, 1]))),
                          int(rng.choice([0, 40, 200]))))
             for i in range(60)]
    rtl, ref, bad, skipped = fuzz.fuzz_rtl(TINY, cases, runner, log=lambda line: None,
                                           max_model_cycles=40_000)
    assert bad == [] and skipped < 6
    assert rtl.ends == ref.ends and rtl.ends["OK"] >= 20 and rtl.ran["SAMPLE"] >= 10
