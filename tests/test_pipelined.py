"""Pipelined speculative decoding: the engine drafts round n+1 while the target verifies n.

Exact greedy output (demo pair, tiny pair, with injected faults), the same rounds as the
serial decoder in greedy mode (so the drafts ready on a hit are the ones a serial round
would draft), lossless sampling by chi-square (and that the test can fail), the time
accounting and the Chrome trace.
"""

import json
from collections import Counter

import numpy as np
import pytest
import torch

import dfvg_host.acceptance as acceptance
from conftest import make_tiny_llama
from test_fault_injection import CASES, EOS, NEW, PROMPTS, TIMEOUT_S, reference, target  # noqa: F401
from test_speculative import VOCAB, chi_square_p, heldout_prompts
from dfvg_hw.spec.config import get_preset
from dfvg_host.acceptance import SamplingParams, target_distribution
from dfvg_host.compiler import compile_draft, load_model
from dfvg_host.driver import DraftDevice
from dfvg_host.fault_injection import FaultInjectingTransport
from dfvg_host.pipelined import PipelinedDecoder
from dfvg_host.speculative import SpeculativeDecoder
from dfvg_host.timeline import LANES
from dfvg_host.verifier import Verifier
from sim.device import SimDevice


# -- greedy: exact, and the same rounds as serial ----------------------------------------
def test_greedy_is_exact_on_the_demo_pair(demo_pair, demo_compiled):
    """10 held-out prompts x 64 tokens: pipelined == transformers' greedy generate(), with
    the serial decoder's rounds, drafts and acceptances, and hits among them."""
    from transformers import AutoTokenizer
    _, target_dir, data_dir = demo_pair
    tok = AutoTokenizer.from_pretrained(target_dir)
    model = load_model(target_dir)
    device = DraftDevice.open("sim://alveo-u55c", demo_compiled)
    verifier = Verifier(model, torch.device("cpu"))
    serial = SpeculativeDecoder(device, verifier, gamma=4, eos_token_id=tok.eos_token_id)
    pipelined = PipelinedDecoder(device, verifier, gamma=4, eos_token_id=tok.eos_token_id)
    hits = 0
    for prompt in heldout_prompts(data_dir, tok, count=10):
        got = pipelined.generate(prompt, 64)
        with torch.no_grad():
            ref = model.generate(torch.tensor([prompt]), max_new_tokens=64,
                                 do_sample=False)[0, len(prompt):].tolist()
        assert got.tokens == ref
        want = serial.generate(prompt, 64).metrics
        m = got.metrics
        assert (m.rounds, m.drafted_per_position, m.accepted_per_position) == \
               (want.rounds, want.drafted_per_position, want.accepted_per_position)
        assert m.pipeline_hits + m.pipeline_misses <= m.rounds
        hits += m.pipeline_hits
    assert hits >= 20, "the continuation was hardly ever used: the hit path is untested"


@pytest.fixture(scope="module")
def self_draft(tiny_draft_dir, tiny_compiled, tiny_engine):
    """The tiny Llama drafting for itself: high acceptance, so most rounds are hits."""
    model = load_model(tiny_draft_dir)
    def make(decoder_class=PipelinedDecoder, gamma=4, transport=None, **kwargs):
        transport = transport or SimDevice(tiny_engine)
        device = DraftDevice(transport, tiny_compiled, timeout_s=TIMEOUT_S, retry_backoff_s=0.0)
        return decoder_class(device, Verifier(model, torch.device("cpu")), gamma=gamma,
                             eos_token_id=EOS, **kwargs)
    return make


@pytest.mark.parametrize("gamma", [1, 3, 4])
def test_greedy_is_exact_on_the_tiny_pair(self_draft, reference, gamma):
    decoder, serial = self_draft(gamma=gamma), self_draft(SpeculativeDecoder, gamma=gamma)
    hits = 0
    for p in PROMPTS:
        out = decoder.generate(p, NEW)
        assert out.tokens == reference[tuple(p)]
        assert out.metrics.accepted_per_position == serial.generate(p, NEW).metrics.accepted_per_position
        hits += out.metrics.pipeline_hits
    assert hits >= len(PROMPTS)


def test_context_limit_and_short_generations(self_draft, reference):
    """Near max_new_tokens and the context limit the continuation drafts fewer or none."""
    decoder = self_draft()
    p = PROMPTS[0]
    for n in (1, 2, 3, 5, 6, 7):
        assert decoder.generate(p, n).tokens == reference[tuple(p)][:n]
    decoder.eos_token_id = None
    long = decoder.generate(p, 200)
    serial = self_draft(SpeculativeDecoder)
    serial.eos_token_id = None
    want = serial.generate(p, 200)
    assert long.stop_reason == want.stop_reason == "context_limit"
    assert long.tokens == want.tokens


# -- faults --------------------------------------------------------------------------------
@pytest.mark.parametrize("plan", [c[1] for c in CASES], ids=[c[0] for c in CASES])
def test_faults_keep_greedy_exact(self_draft, tiny_engine, reference, plan):
    inj = FaultInjectingTransport(SimDevice(tiny_engine), armed=False)
    decoder = self_draft(transport=inj)
    inj.arm(plan)
    for p in PROMPTS[:2]:
        out = decoder.generate(p, NEW)
        assert out.tokens == reference[tuple(p)] and out.stop_reason == "max_new_tokens"
    assert inj.injected


def test_random_fault_campaign(self_draft, tiny_engine, reference):
    resets = degraded = 0
    for seed in range(16):
        inj = FaultInjectingTransport(SimDevice(tiny_engine), armed=False)
        decoder = self_draft(transport=inj)
        inj.arm(rate=0.04, seed=seed)
        p = PROMPTS[seed % len(PROMPTS)]
        out = decoder.generate(p, 16)
        assert out.tokens == reference[tuple(p)][:16], (seed, inj.injected, out.faults)
        resets += out.metrics.device_resets
        degraded += out.degraded
    assert resets >= 4


def test_recovered_faults_change_no_sampled_token(self_draft, tiny_engine):
    """A failed continuation is replayed with the same counter: same tokens as no fault."""
    from dfvg_host.fault_injection import Fault, FaultKind
    sampling = SamplingParams(temperature=1.0, top_k=4, seed=7)
    for at in (2, 3, 5, 8):      # start ops: serial drafts and continuations alike
        clean = self_draft(sampling=sampling)     # fresh: the verifier's generator runs on
        inj = FaultInjectingTransport(SimDevice(tiny_engine), armed=False)
        faulty = self_draft(transport=inj, sampling=sampling, max_recoveries=3)
        inj.arm([Fault(FaultKind.ERROR, "start", at=at)])
        for p in PROMPTS[:2]:
            want, got = clean.generate(p, NEW), faulty.generate(p, NEW)
            assert got.tokens == want.tokens and not got.degraded
        assert faulty.draft.resets >= 1


# -- sampling: lossless, and the test can fail ------------------------------------------------
PARAMS = SamplingParams(temperature=0.5, top_k=0)
PROMPT = [1, 4, 6, 3]


@pytest.fixture(scope="module")
def self_drafting_small_vocab(tmp_path_factory):
    """A random target over 8 tokens drafting for itself (no EOS): the pipeline hits often
    enough (about one continuation in five at T = 0.5) for its path to be tested."""
    root = tmp_path_factory.mktemp("small-vocab-self")
    target = make_tiny_llama(root / "target", vocab=VOCAB, seed=10, weight_scale=3.0, eos=None)
    return target


def second_third_distribution(target_dir, prompt, params):
    """Exact target distribution of the 2nd and 3rd sampled tokens (the 1st summed out)."""
    model = load_model(target_dir)
    with torch.no_grad():
        p1 = target_distribution(model(torch.tensor([prompt])).logits[0, -1], params)
        p2 = target_distribution(model(torch.tensor([prompt + [x] for x in range(VOCAB)])).logits[:, -1],
                                 params)
        batch = torch.tensor([prompt + [x, y] for x in range(VOCAB) for y in range(VOCAB)])
        p3 = target_distribution(model(batch).logits[:, -1], params).reshape(VOCAB, VOCAB, VOCAB)
    return torch.einsum("a,ab,abc->bc", p1, p2, p3).numpy()


def sample_second_third(target_dir, n, make=lambda device, verifier: PipelinedDecoder(device, verifier, gamma=1)):
    """γ = 1, 4 tokens: round 1 emits 1 or 2 tokens and submits a continuation (e1, e2);
    on a hit round 2's draft is e2, so tokens 2 and 3 come through the hit path. ``make``
    builds the decoder from the device and the verifier; (the counts of tokens 2 and 3,
    the pipeline's hits)."""
    device = DraftDevice.open("sim://tiny", compile_draft(target_dir, get_preset("tiny")))
    decoder = make(device, Verifier(load_model(target_dir), torch.device("cpu")))
    counts, hits = Counter(), 0
    for seed in range(n):
        decoder.sampling = SamplingParams(PARAMS.temperature, PARAMS.top_k, seed)
        decoder._generator.manual_seed(seed ^ 0x5EED)
        out = decoder.generate(PROMPT, 4)
        counts[tuple(out.tokens[1:3])] += 1
        hits += out.metrics.pipeline_hits
    return counts, hits


def test_sampling_is_lossless(self_drafting_small_vocab):
    target = self_drafting_small_vocab
    n = 1500       # ~30 ms each; p = 0.60 here (333 hits), a uniform q gives p = 2e-30 from 600
    counts, hits = sample_second_third(target, n)
    assert hits > n // 10, f"only {hits} hits in {n} generations"
    p = chi_square_p(counts, second_third_distribution(target, PROMPT, PARAMS), n)
    assert p > 0.01, f"pipelined samples differ from the target distribution (p = {p:.2e})"


def test_wrong_q_is_detected(self_drafting_small_vocab, monkeypatch):
    target = self_drafting_small_vocab
    uniform = lambda token, vocab: torch.full((vocab,), 1.0 / vocab, dtype=torch.float64)
    monkeypatch.setattr(acceptance, "draft_distribution", uniform)
    n = 600
    counts, _ = sample_second_third(target, n)
    p = chi_square_p(counts, second_third_distribution(target, PROMPT, PARAMS), n)
    assert p < 0.01, f"a uniform q went undetected (p = {p:.3f})"


# -- time accounting and the timeline ---------------------------------------------------------
def test_overlap_is_counted_once(self_draft):
    p = PROMPTS[1]
    serial = self_draft(SpeculativeDecoder).generate(p, NEW).metrics
    out = self_draft().generate(p, NEW)
    m = out.metrics
    assert serial.schedule == "serial" and serial.hidden_draft_seconds == 0
    assert serial.projected_seconds == pytest.approx(
        serial.verifier_seconds + serial.host_seconds + serial.device_seconds + serial.pcie_seconds)
    assert m.schedule == "pipelined" and m.pipeline_hits > 0
    unpipelined = m.verifier_seconds + m.host_seconds + m.device_seconds + m.pcie_seconds
    assert m.verifier_seconds + m.host_seconds <= m.projected_seconds < unpipelined
    assert 0 < m.hidden_draft_seconds <= m.draft_seconds and 0 < m.hidden_draft_share <= 1
    d = m.to_dict()
    assert d["labels"]["projected_seconds"].endswith("pipelined: overlap counted once")
    assert d["hidden_draft_share"] == m.hidden_draft_share and d["pipeline_hits"] == m.pipeline_hits
    assert "pipeline " in m.summary() and "pipelined: overlap counted once" in m.summary()
    # The timeline runs on the projected clock.
    assert out.timeline.end == pytest.approx(m.projected_seconds, rel=1e-6, abs=1e-9)


def test_trace_file_opens_as_a_chrome_trace(self_draft, tmp_path):
    for decoder in (self_draft(SpeculativeDecoder), self_draft()):
        out = decoder.generate(PROMPTS[0], NEW)
        path = tmp_path / f"{decoder.schedule}.json"
        out.timeline.write(path)
        trace = json.loads(path.read_text())
        spans = [e for e in trace["traceEvents"] if e["ph"] == "X"]
        names = {e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "thread_name"}
        assert names == set(LANES)
        assert {e["args"]["lane"] for e in spans} == set(LANES)
        assert all(e["dur"] >= 0 and e["ts"] >= 0 and {"name", "pid", "tid"} <= set(e) for e in spans)
        assert {e["args"]["source"] for e in spans} == {"measured", "modelled"}
        total = max(e["ts"] + e["dur"] for e in spans) / 1e6
        assert total == pytest.approx(out.metrics.projected_seconds, rel=1e-6)
        engine = [e for e in spans if e["args"]["lane"] == "engine"]
        target_spans = [e for e in spans if e["args"]["lane"] == "target"]
        overlapping = [e for e in engine
                       if any(min(t["ts"] + t["dur"], e["ts"] + e["dur"]) - max(t["ts"], e["ts"]) > 1e-3
                              for t in target_spans)]           # µs: more than rounding
        # Serial: the engine idles while the target verifies; pipelined: it drafts then.
        assert bool(overlapping) == (decoder.schedule == "pipelined")
