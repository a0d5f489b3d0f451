"""The functional model running compiled tiny drafts: draft loop, KV, sampler, errors."""

import numpy as np
import pytest
import torch

from dfvg_hw.spec.descriptors import DraftRequest, DraftResult, ErrorCode, result_bytes
from dfvg_hw.spec.isa import Instruction, Op, encode
from dfvg_hw.spec.numerics import PROB_BITS, host_temperature
from dfvg_host.compiler import compile_draft, load_model
from sim.cycle_model import estimate_request
from sim.session import IMAGE_ADDR, RESULT_ADDR, FunctionalSession


def prompt(n, seed=0, vocab=256):
    return np.random.default_rng(seed).integers(3, vocab, n).tolist()


@pytest.fixture
def session(tiny_engine, tiny_compiled):
    return FunctionalSession(tiny_engine, tiny_compiled.image, tiny_compiled.program)


def drafted(result):
    assert result.status == ErrorCode.OK, result.status.describe()
    return [t.token for t in result.tokens]


def test_on_device_draft_loop_equals_one_token_per_request(session, tiny_engine, tiny_compiled):
    p = prompt(10)
    many = drafted(session.run(DraftRequest(tokens=p, start_pos=0, n_draft=8)))
    other = FunctionalSession(tiny_engine, tiny_compiled.image, tiny_compiled.program)
    one = drafted(other.run(DraftRequest(tokens=p, start_pos=0, n_draft=1)))
    pos = len(p)
    while len(one) < 8:
        one += drafted(other.run(DraftRequest(tokens=[one[-1]], start_pos=pos, n_draft=1)))
        pos += 1
    assert many == one


def test_greedy_follows_the_float_model(tiny_draft_dir, session):
    # The draft's own greedy continuation, teacher-forced: the int8 engine should agree
    # with float argmax on most positions of this random model (small logit gaps).
    model = load_model(tiny_draft_dir)
    ids = prompt(48, seed=3)
    with torch.no_grad():
        ref = model(torch.tensor([ids])).logits[0].numpy()
    agree, cos = 0, []
    for pos, t in enumerate(ids):
        r = session.run(DraftRequest(tokens=[t], start_pos=pos, n_draft=1))
        agree += drafted(r)[0] == int(ref[pos].argmax())
        lg = session.engine.logits / 256.0
        cos.append(lg @ ref[pos] / np.linalg.norm(lg) / np.linalg.norm(ref[pos]))
    assert agree / len(ids) >= 0.75
    assert np.mean(cos) >= 0.99


def test_rollback_then_redraft_reproduces_tokens(session):
    p = prompt(12, seed=1)
    first = session.run(DraftRequest(tokens=p, start_pos=0, n_draft=8))
    assert first.end_pos == len(p) + 7
    again = session.run(DraftRequest(tokens=p[-1:], start_pos=len(p) - 1, n_draft=8))
    assert drafted(again) == drafted(first)
    # Keep 3 drafts, roll back past the rest, and continue: the continuation is the
    # same as drafting straight through.
    keep = drafted(first)[:3]
    cont = session.run(DraftRequest(tokens=[keep[-1]], start_pos=len(p) + 2, n_draft=5))
    assert keep + drafted(cont) == drafted(first)


def test_gqa_and_tied_embeddings(tiny_gqa_dir, tiny_engine):
    compiled = compile_draft(tiny_gqa_dir, tiny_engine)
    s = FunctionalSession(tiny_engine, compiled.image, compiled.program)
    model = load_model(tiny_gqa_dir)
    ids = prompt(32, seed=2)
    with torch.no_grad():
        ref = model(torch.tensor([ids])).logits[0].numpy().argmax(-1)
    got = [drafted(s.run(DraftRequest(tokens=[t], start_pos=i, n_draft=1)))[0] for i, t in enumerate(ids)]
    assert np.mean(np.array(got) == ref) >= 0.75


def test_sampling_is_seeded_and_reports_exact_topk(session, tiny_engine):
    tm, ts = host_temperature(0.8)
    req = lambda seed: DraftRequest(tokens=prompt(6, 4), start_pos=0, n_draft=8, topk=4,
                                    sample=True, t_mult=tm, t_shift=ts, seed=seed, counter=100)
    a, b, c = session.run(req(7)), session.run(req(7)), session.run(req(8))
    assert drafted(a) == drafted(b)
    assert drafted(a) != drafted(c)
    for t in a.tokens:
        assert len(t.topk_ids) == 4 and sum(t.topk_probs) == 1 << PROB_BITS
        assert t.token in t.topk_ids and t.prob == t.topk_probs[t.topk_ids.index(t.token)]
        assert t.topk_probs == sorted(t.topk_probs, reverse=True) or len(set(t.topk_probs)) < 4


def test_greedy_topk_one_edge(session):
    r = session.run(DraftRequest(tokens=prompt(4), start_pos=0, n_draft=2, topk=1))
    assert all(t.prob == 1 << PROB_BITS and t.topk_ids == [t.token] for t in r.tokens)


def test_kv_overflow_is_reported_and_keeps_drafted_tokens(session, tiny_engine):
    cap = tiny_engine.kv_positions
    r = session.run(DraftRequest(tokens=prompt(4), start_pos=cap - 6, n_draft=8))
    assert r.status == ErrorCode.KV_OVERFLOW
    # forwards at cap-6 .. cap-1 fit: 4 inputs + 2 drafts fed back -> 3 drafted tokens
    assert len(r.tokens) == 3 and r.end_pos == cap
    full = session.run(DraftRequest(tokens=prompt(4), start_pos=cap - 4, n_draft=1))
    assert full.status == ErrorCode.OK and full.end_pos == cap


def test_illegal_instruction_stops_with_status(tiny_engine, tiny_compiled):
    program = list(tiny_compiled.program)
    program[3] |= 0x77 << 24          # reserved bits
    s = FunctionalSession(tiny_engine, tiny_compiled.image, program)
    r = s.run(DraftRequest(tokens=prompt(3), start_pos=0, n_draft=2))
    assert r.status == ErrorCode.ILLEGAL_INSTRUCTION and r.error_pc == 3
    assert "reserved" in str(s.engine.last_fault)


def test_program_that_never_halts_hits_the_watchdog(tiny_engine, tiny_compiled):
    spin = [encode(Instruction(Op.NOP)), encode(Instruction(Op.BRANCH, n=0))]
    s = FunctionalSession(tiny_engine, tiny_compiled.image, spin)
    assert s.run(DraftRequest(tokens=[1], start_pos=0, n_draft=1)).status == ErrorCode.WATCHDOG


def test_bad_requests(session, tiny_engine):
    assert session.run(DraftRequest(tokens=[tiny_engine.vocab_max], start_pos=0, n_draft=1)).status \
        == ErrorCode.BAD_REQUEST
    assert session.run(DraftRequest(tokens=[1], start_pos=0, n_draft=1, topk=99)).status \
        == ErrorCode.BAD_REQUEST


def test_result_buffer_corruption_is_detected(session, tiny_engine):
    session.run(DraftRequest(tokens=prompt(3), start_pos=0, n_draft=3, topk=2))
    raw = bytearray(session.engine.memory.read(RESULT_ADDR, result_bytes(tiny_engine.topk_max, 3)))
    DraftResult.unpack(bytes(raw), tiny_engine.topk_max)       # intact: parses
    raw[4 * 16 + 4] ^= 0x01                                    # flip a bit of a probability
    with pytest.raises(ValueError, match="check word"):
        DraftResult.unpack(bytes(raw), tiny_engine.topk_max)


def test_cycle_estimate_equals_functional_count(session, tiny_engine, tiny_compiled):
    r = session.run(DraftRequest(tokens=prompt(5), start_pos=3, n_draft=4, topk=2))
    est = estimate_request(tiny_engine, tiny_compiled.program, n_in=5, n_draft=4, start_pos=3, topk=2,
                           image_base=IMAGE_ADDR)
    assert session.engine.counts.by_op == est.by_op
    assert session.engine.counts.total == est.total > r.cycles > 0
    assert r.n_forward == 5 + 3


def run_program(tiny_engine, tiny_compiled, program, request):
    s = FunctionalSession(tiny_engine, tiny_compiled.image, program)
    return s.run(request), s.engine.last_fault


def _replace(program: list[int], op: Op, new: Instruction) -> list[int]:
    """``program`` with its first ``op`` instruction replaced by ``new``."""
    from dfvg_hw.spec.isa import decode
    at = next(i for i, word in enumerate(program) if decode(word).opcode == op)
    return program[:at] + [encode(new)] + program[at + 1:]


@pytest.mark.parametrize("mutate, message", [
    # drop the BRANCH that skips sampling for prefill forwards: SAMPLE runs unasked
    (lambda p: _replace(p, Op.BRANCH, Instruction(Op.NOP)), "SAMPLE in a forward that drafts no token"),
    # drop the SAMPLE itself: NEXT would continue the draft loop with no token
    (lambda p: _replace(p, Op.SAMPLE, Instruction(Op.NOP)), "no SAMPLE ran"),
    # ROPE over an odd head dimension
    (lambda p: _replace(p, Op.ROPE, Instruction(Op.ROPE, rows=1, n=2, k=15)), "odd head dimension"),
    # KVAPPEND of 3 KV heads: layer 0 fills slots 0 … 2, layer 1 would need 3 … 5 of 4
    (lambda p: _replace(p, Op.KVAPPEND, Instruction(Op.KVAPPEND, rows=1, src=10, n=3, k=16)),
     "KVAPPEND at layer 1 with 3 KV heads × 16 exceeds the KV buffer (4 slots"),
])
def test_malformed_programs_fault_cleanly(tiny_engine, tiny_compiled, mutate, message):
    program = list(tiny_compiled.program)
    r, fault = run_program(tiny_engine, tiny_compiled, mutate(program),
                           DraftRequest(tokens=prompt(3), start_pos=0, n_draft=2))
    assert r.status == ErrorCode.PROGRAM and message in str(fault)


def test_sample_without_logits_of_this_request(tiny_engine, tiny_compiled):
    from dfvg_hw.spec.isa import Cond
    program = [encode(Instruction(Op.SAMPLE, n=256)), encode(Instruction(Op.NEXT)),
               encode(Instruction(Op.HALT))]
    r, fault = run_program(tiny_engine, tiny_compiled, program, DraftRequest(tokens=[1], start_pos=0, n_draft=1))
    assert r.status == ErrorCode.PROGRAM and "logit buffer holds 0" in str(fault)


def test_request_checks(session, tiny_engine):
    from sim.session import REQUEST_ADDR
    eng = session.engine
    raw = bytearray(DraftRequest(tokens=[1], start_pos=0, n_draft=1).pack())
    raw[4] |= 0x80                                  # undefined request flag bit
    eng.memory.write(REQUEST_ADDR, bytes(raw))
    r = eng.run(image_base=0x10_0000, request_addr=REQUEST_ADDR, result_addr=RESULT_ADDR)
    assert r.status == ErrorCode.BAD_REQUEST
    r = eng.run(image_base=0x10_0000, request_addr=tiny_engine.mem_bytes - 8, result_addr=RESULT_ADDR)
    assert r.status == ErrorCode.BAD_ADDRESS



# -- several sequences in one engine: the request's kv_slot_base (docs/isa.md §1.4) --------

@pytest.fixture(scope="module")
def two_sequences(tmp_path_factory, tiny_engine):
    """A draft of 2 layers × 1 KV head (2 KV slots), compiled for tiny (4 slots): two
    sequences fit, in slots 0-1 and 2-3."""
    from dfvg_host.fixtures import make_tiny_llama
    model = make_tiny_llama(tmp_path_factory.mktemp("two-sequences"), layers=2, heads=2,
                            kv_heads=1, seed=5)
    return compile_draft(model, tiny_engine)


def _script(seed):
    """A sequence's requests: a prompt with drafts, a rollback into the drafts, a sampled
    request, a rollback into the prompt (start_pos, tokens, n_draft, sampled)."""
    p = prompt(7, seed=seed)
    return [(0, p, 4, False), (len(p) + 1, [11 + seed], 3, True), (3, p[3:5], 2, False),
            (5, [42], 5, True)]


def _request(step, base):
    start, tokens, n_draft, sampled = step
    tm, ts = host_temperature(0.8)
    return DraftRequest(tokens=tokens, start_pos=start, n_draft=n_draft, topk=3, sample=sampled,
                        t_mult=tm if sampled else 0, t_shift=ts if sampled else 0, seed=7,
                        counter=start, kv_slot_base=base)


def test_interleaved_sequences_equal_each_alone(tiny_engine, two_sequences):
    """Sequence A in slots 0-1, B in slots 2-3, their requests interleaved on one engine
    (the KV position register shared, each request naming its start_pos): every result
    equals that of the sequence run alone from slot 0, and each sequence's KV is in its
    own slots, bit for bit what it is alone."""
    c = two_sequences
    alone = {}
    for name, seed in (("A", 1), ("B", 2)):
        s = FunctionalSession(tiny_engine, c.image, c.program)
        alone[name] = ([s.run(_request(step, 0)) for step in _script(seed)],
                       s.engine.kv_k.copy(), s.engine.kv_v.copy())
    s = FunctionalSession(tiny_engine, c.image, c.program)
    got = {"A": [], "B": []}
    for a, b in zip(_script(1), _script(2)):
        got["B"].append(s.run(_request(b, 2)))
        got["A"].append(s.run(_request(a, 0)))
    for name, slots in (("A", slice(0, 2)), ("B", slice(2, 4))):
        results, kv_k, kv_v = alone[name]
        assert [r.status for r in got[name]] == [ErrorCode.OK] * 4
        for mine, theirs in zip(got[name], results):
            assert (mine.tokens, mine.end_pos, mine.n_forward, mine.cycles) == \
                (theirs.tokens, theirs.end_pos, theirs.n_forward, theirs.cycles)
        np.testing.assert_array_equal(s.engine.kv_k[slots], kv_k[:2])
        np.testing.assert_array_equal(s.engine.kv_v[slots], kv_v[:2])
        assert kv_k[:2].any() and not kv_k[2:].any()
    assert drafted(got["A"][0]) != drafted(got["B"][0])


@pytest.mark.parametrize("base, status, written", [
    (2, ErrorCode.OK, [2, 3]),          # the last two slots exactly
    (3, ErrorCode.PROGRAM, [3]),        # layer 0 fits (slot 3), layer 1 would be slot 4
    (4, ErrorCode.PROGRAM, []),         # layer 0 already past the buffer
    (0xFFFF, ErrorCode.PROGRAM, []),
])
def test_slot_base_at_the_boundary(tiny_engine, two_sequences, base, status, written):
    """kv_slot_base + (LAYER + 1)·G > kv_slots faults PROGRAM at that layer's KVAPPEND,
    before it writes: only the layers before it have their KV."""
    c = two_sequences
    s = FunctionalSession(tiny_engine, c.image, c.program)
    r = s.run(DraftRequest(tokens=prompt(3), start_pos=0, n_draft=2, kv_slot_base=base))
    assert r.status == status
    if status:
        assert "exceeds the KV buffer" in str(s.engine.last_fault)
        assert f"from slot {base}" in str(s.engine.last_fault) and not r.tokens
    assert [slot for slot in range(4) if s.engine.kv_k[slot].any()] == written
