"""The serving scheduler without HTTP: many sequences interleaved on one engine (each in
its own KV slots), one batched target forward per round, and device faults survived.
Every greedy output must equal the target's own greedy decoding."""

from __future__ import annotations

import dataclasses
import threading

import pytest
import torch

from conftest import make_tiny_llama
from dfvg_hw.spec.config import get_preset
from dfvg_host.acceptance import SamplingParams
from dfvg_host.batch_verifier import BatchVerifier
from dfvg_host.compiler import compile_draft, load_model
from dfvg_host.driver import DraftDevice
from dfvg_host.fault_injection import Fault, FaultInjectingTransport, FaultKind
from dfvg_host.serving.scheduler import Overloaded, Scheduler
from dfvg_host.speculative import SpeculativeDecoder
from dfvg_host.verifier import Verifier
from sim.device import SimDevice

PROMPTS = [[5, 17, 99, 3, 42, 7], [100, 4, 61, 9], [33, 200, 12, 77, 150], [8, 250, 19],
           [60, 61, 62], [7, 7, 7, 7, 7, 7, 7, 7, 7, 7]]
NEW = 20
EOS = 1                # make_tiny_llama's EOS


@pytest.fixture(scope="module")
def engine():
    """The tiny engine with room for four sequences of the tiny draft."""
    return dataclasses.replace(get_preset("tiny"), name="tiny-4seq", kv_slots=16)


@pytest.fixture(scope="module")
def draft_dir(tmp_path_factory):
    return make_tiny_llama(tmp_path_factory.mktemp("sched-draft"))


@pytest.fixture(scope="module")
def compiled(draft_dir, engine):
    return compile_draft(draft_dir, engine)


@pytest.fixture(scope="module")
def target(draft_dir):
    return load_model(draft_dir)


@pytest.fixture(scope="module")
def reference(target):
    with torch.no_grad():
        return [target.generate(torch.tensor([p]), max_new_tokens=NEW, do_sample=False, eos_token_id=EOS,
                                pad_token_id=2)[0, len(p):].tolist() for p in PROMPTS]


def compile_draft_for(compiled, engine):
    return compile_draft(compiled.manifest["model_dir"], engine)


def run_all(scheduler: Scheduler, prompts=PROMPTS, sampling=SamplingParams(), new=NEW):
    """Submit every prompt at once and wait; the streamed tokens of each, and the sequences."""
    streamed = {i: [] for i in range(len(prompts))}
    seqs = []
    for i, p in enumerate(prompts):
        seqs.append(scheduler.submit(p, new, sampling,
                                     lambda seq, toks, fin, i=i: streamed[i].extend(toks)))
    for s in seqs:
        assert s.done.wait(120), "a sequence never finished"
    return [streamed[i] for i in range(len(prompts))], seqs


def make_scheduler(compiled, engine, target, *, plan=(), rate=0.0, device=True, **kwargs):
    inj = FaultInjectingTransport(SimDevice(engine), armed=False)
    dev = DraftDevice(inj, compiled, timeout_s=0.1, retry_backoff_s=0.0) if device else None
    inj.arm(plan, rate=rate, seed=3)
    kwargs.setdefault("max_num_seqs", 4)
    return Scheduler(BatchVerifier(target, torch.device("cpu")), dev, gamma=4, eos_token_id=EOS,
                     **kwargs).start(), inj


def test_interleaved_sequences_equal_target_only(compiled, engine, target, reference):
    scheduler, _ = make_scheduler(compiled, engine, target)
    try:
        assert scheduler.capacity == 4 and scheduler.device.max_sequences == 4
        streamed, seqs = run_all(scheduler)
    finally:
        scheduler.stop()
    for ref, got, seq in zip(reference, streamed, seqs):
        assert got == ref and seq.tokens == ref
        assert seq.finish_reason == ("stop" if ref[-1] == EOS else "length")
    # Each sequence drafted exactly what it drafts alone: its KV stayed in its own slots.
    alone = SpeculativeDecoder(DraftDevice(SimDevice(engine), compiled), Verifier(target, torch.device("cpu")),
                               gamma=4, eos_token_id=EOS)
    for prompt, seq in zip(PROMPTS, seqs):
        single = alone.generate(prompt, NEW).metrics
        assert (seq.metrics.drafted_tokens, seq.metrics.accepted_tokens) == \
            (single.drafted_tokens, single.accepted_tokens)
    m = scheduler.metrics
    assert m.accepted_tokens > 0 and m.device_cycles > 0
    # 6 sequences, 4 at a time: rounds were shared, so there were fewer forwards than rounds
    assert scheduler.verifier.forwards < m.rounds
    assert scheduler.finished["length"] + scheduler.finished["stop"] == len(PROMPTS)


def test_more_sequences_than_slots_reprefill_and_stay_exact(compiled, engine, target, reference):
    two_slots = dataclasses.replace(engine, name="tiny-2seq", kv_slots=8)
    scheduler, _ = make_scheduler(compile_draft_for(compiled, two_slots), two_slots, target, max_num_seqs=4)
    try:
        assert scheduler.device.max_sequences == 2 and scheduler.capacity == 4
        streamed, seqs = run_all(scheduler)
    finally:
        scheduler.stop()
    assert streamed == reference
    # Sequences 3 and 4 decoded with the target alone until slots freed, then re-fed the engine.
    assert scheduler.reprefills > 0 and scheduler.reprefill_tokens > scheduler.reprefills
    assert all(seq.metrics.drafted_tokens > 0 for seq in seqs)
    # The draft is the target's own int8 copy: with its KV right, most drafts are accepted
    # (an engine re-fed only part of the sequence drafts from the wrong context).
    print("acceptance per sequence:", [round(seq.metrics.acceptance_rate, 2) for seq in seqs])
    assert min(seq.metrics.acceptance_rate for seq in seqs) >= 0.5


def test_target_only_scheduler_equals_target_only(compiled, engine, target, reference):
    scheduler, _ = make_scheduler(compiled, engine, target, device=False)
    try:
        streamed, _ = run_all(scheduler)
    finally:
        scheduler.stop()
    assert streamed == reference and scheduler.metrics.drafted_tokens == 0


def test_device_faults_are_survived(compiled, engine, target, reference):
    scheduler, inj = make_scheduler(compiled, engine, target, rate=0.03)
    try:
        streamed, _ = run_all(scheduler)
    finally:
        scheduler.stop()
    assert streamed == reference
    assert inj.injected
    assert scheduler.metrics.device_resets > 0, "no fault reached the scheduler; raise the rate"


def test_a_dead_device_is_given_up_and_the_target_goes_on(compiled, engine, target, reference):
    dead = [Fault(FaultKind.DROP, "start", at=3, repeat=10 ** 6)]
    scheduler, _ = make_scheduler(compiled, engine, target, plan=dead)
    try:
        streamed, _ = run_all(scheduler)
    finally:
        scheduler.stop()
    assert streamed == reference
    assert scheduler.device_given_up and scheduler.metrics.fallback_tokens > 0


def test_cancel_frees_the_place_and_backpressure(compiled, engine, target):
    scheduler, _ = make_scheduler(compiled, engine, target, max_num_seqs=1, max_waiting=1)
    try:
        gate = threading.Event()
        first = scheduler.submit(PROMPTS[0], 50, SamplingParams(), lambda s, t, f: gate.set())
        second = scheduler.submit(PROMPTS[1], 4, SamplingParams(), lambda s, t, f: None)
        with pytest.raises(Overloaded):
            scheduler.submit(PROMPTS[2], 4, SamplingParams(), lambda s, t, f: None)
        assert gate.wait(60)
        first.cancel()
        assert first.done.wait(60) and first.finish_reason == "cancelled"
        assert second.done.wait(60) and second.finish_reason in ("length", "stop")
    finally:
        scheduler.stop()


def test_an_unexpected_failure_ends_the_round_and_the_scheduler_goes_on(compiled, engine, target,
                                                                        reference, monkeypatch):
    scheduler, _ = make_scheduler(compiled, engine, target)
    real_commit = scheduler.verifier.commit
    calls = []

    def commit_failing_once(*args):
        calls.append(args)
        if len(calls) == 3:
            raise RuntimeError("injected")
        return real_commit(*args)

    monkeypatch.setattr(scheduler.verifier, "commit", commit_failing_once)
    try:
        streamed, seqs = run_all(scheduler, PROMPTS[:2])
        assert [s.finish_reason for s in seqs] == ["error", "error"]
        assert "injected" in seqs[0].message and scheduler.alive
        for got, ref in zip(streamed, reference):
            assert got == ref[:len(got)]           # what was streamed before is kept, and right
        again, _ = run_all(scheduler, PROMPTS[:1])
        assert again[0] == reference[0]
    finally:
        scheduler.stop()


def test_a_request_past_the_context_is_refused(compiled, engine, target):
    scheduler, _ = make_scheduler(compiled, engine, target)
    try:
        with pytest.raises(ValueError, match="Lower max_tokens to at most"):
            scheduler.submit(PROMPTS[0], scheduler.context_limit, SamplingParams(), lambda *a: None)
    finally:
        scheduler.stop()


def test_sampled_sequences_keep_their_seed_whatever_runs_beside(compiled, engine, target):
    sampling = SamplingParams(temperature=1.0, top_p=0.9, seed=21)
    scheduler, _ = make_scheduler(compiled, engine, target)
    try:
        alone, _ = run_all(scheduler, PROMPTS[:1], sampling)
        together, _ = run_all(scheduler, PROMPTS[:4], sampling)
    finally:
        scheduler.stop()
    assert together[0] == alone[0]
