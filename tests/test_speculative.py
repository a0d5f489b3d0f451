"""Speculative decoding: exact greedy, lossless sampling (and that the test can fail)."""

from collections import Counter

import numpy as np
import pytest
import torch

import dfvg_host.acceptance as acceptance
import sampling_checks
from conftest import make_tiny_llama
from sampling_checks import chi_square_p
from dfvg_hw.spec.config import get_preset
from dfvg_host.acceptance import SamplingParams
from dfvg_host.compiler import compile_draft, load_model
from dfvg_host.driver import DraftDevice
from dfvg_host.speculative import SpeculativeDecoder
from dfvg_host.verifier import Verifier

VOCAB = 8


@pytest.fixture(scope="module")
def small_vocab_pair(tmp_path_factory):
    """A random target and a different random draft over an 8-token vocabulary, no EOS."""
    root = tmp_path_factory.mktemp("small-vocab")
    target = make_tiny_llama(root / "target", vocab=VOCAB, seed=10, weight_scale=3.0, eos=None)
    draft = make_tiny_llama(root / "draft", vocab=VOCAB, seed=11, weight_scale=3.0, eos=None)
    return draft, target


def make_decoder(draft_dir, target_dir, sampling, gamma=2):
    engine = get_preset("tiny")
    device = DraftDevice.open("sim://tiny", compile_draft(draft_dir, engine))
    verifier = Verifier(load_model(target_dir), torch.device("cpu"))
    return SpeculativeDecoder(device, verifier, gamma=gamma, sampling=sampling)


def first_two_distribution(target_dir, prompt, params):
    """Exact target distribution of the first two sampled tokens (64 cells)."""
    return sampling_checks.first_two_distribution(load_model(target_dir), prompt, params, VOCAB)


def sample_first_two(decoder, prompt, n, params):
    counts = Counter()
    for seed in range(n):
        decoder.sampling = SamplingParams(params.temperature, params.top_k, seed)
        decoder._generator.manual_seed(seed ^ 0x5EED)
        out = decoder.generate(prompt, 3)
        counts[tuple(out.tokens[:2])] += 1
    return counts


PARAMS = SamplingParams(temperature=1.0, top_k=0)
PROMPT = [1, 4, 6, 3]


def test_sampling_is_lossless(small_vocab_pair):
    draft, target = small_vocab_pair
    decoder = make_decoder(draft, target, PARAMS)
    # 3 000 samples (~30 ms each, mostly the functional model) give p = 0.83 here; a
    # uniform q gives p = 0.0 (float64) from 1 000 samples on (test_wrong_q_is_detected).
    n = 3000
    counts = sample_first_two(decoder, PROMPT, n, PARAMS)
    expected = first_two_distribution(target, PROMPT, PARAMS)
    p = chi_square_p(counts, expected, n)
    print(f"chi-square p = {p:.3g} from {n} samples")
    assert p > 0.01, f"speculative samples differ from the target distribution (p = {p:.2e})"


def test_wrong_q_is_detected(small_vocab_pair, monkeypatch):
    draft, target = small_vocab_pair
    uniform = lambda token, vocab: torch.full((vocab,), 1.0 / vocab, dtype=torch.float64)
    monkeypatch.setattr(acceptance, "draft_distribution", uniform)
    decoder = make_decoder(draft, target, PARAMS)
    n = 1500
    counts = sample_first_two(decoder, PROMPT, n, PARAMS)
    p = chi_square_p(counts, first_two_distribution(target, PROMPT, PARAMS), n)
    assert p < 0.01, f"a uniform q went undetected (p = {p:.3f})"


def heldout_prompts(data_dir, tokenizer, count=50, length=24, stride=300):
    ids = tokenizer((data_dir / "heldout.txt").read_text())["input_ids"]
    assert len(ids) >= count * stride, "heldout.txt is too short for the prompt set"
    return [ids[i * stride: i * stride + length] for i in range(count)]


def test_greedy_is_exact_on_the_demo_pair(demo_pair, demo_compiled):
    """24 prompts x 128 new tokens: speculative output == target-only greedy generate()."""
    from transformers import AutoTokenizer
    draft_dir, target_dir, data_dir = demo_pair
    tok = AutoTokenizer.from_pretrained(target_dir)
    target = load_model(target_dir)
    device = DraftDevice.open("sim://alveo-u55c", demo_compiled)
    decoder = SpeculativeDecoder(device, Verifier(target, torch.device("cpu")), gamma=4,
                                 eos_token_id=tok.eos_token_id)
    accepted = drafted = 0
    for prompt in heldout_prompts(data_dir, tok, count=24):
        out = decoder.generate(prompt, 128)
        with torch.no_grad():     # generate() also stops after EOS, and includes it
            ref = target.generate(torch.tensor([prompt]), max_new_tokens=128,
                                  do_sample=False)[0, len(prompt):].tolist()
        assert out.tokens == ref
        accepted += out.metrics.accepted_tokens
        drafted += out.metrics.drafted_tokens
    # The distilled draft must actually be useful, or exactness proves little.
    assert accepted / drafted > 0.4


def test_eos_stops_generation(demo_pair, demo_compiled):
    from transformers import AutoTokenizer
    draft_dir, target_dir, data_dir = demo_pair
    tok = AutoTokenizer.from_pretrained(target_dir)
    target = load_model(target_dir)
    prompt = heldout_prompts(data_dir, tok, count=1)[0]
    with torch.no_grad():
        ref = target.generate(torch.tensor([prompt]), max_new_tokens=40, min_new_tokens=40,
                              do_sample=False)[0, len(prompt):].tolist()
    eos = ref[17]           # pretend this token ends the text
    device = DraftDevice.open("sim://alveo-u55c", demo_compiled)
    decoder = SpeculativeDecoder(device, Verifier(target, torch.device("cpu")), gamma=4, eos_token_id=eos)
    out = decoder.generate(prompt, 40)
    assert out.stop_reason == "eos" and out.tokens == ref[:ref.index(eos) + 1]


def test_context_limit_stops_and_keeps_tokens(small_vocab_pair):
    draft, target = small_vocab_pair
    decoder = make_decoder(draft, target, SamplingParams(), gamma=4)
    prompt = [1, 2, 3, 4, 5]
    out = decoder.generate(prompt, 200)
    limit = get_preset("tiny").kv_positions
    assert out.stop_reason == "context_limit" and "context limit of 64" in out.message
    assert len(prompt) + len(out.tokens) >= limit - 1 and len(out.tokens) < 200
    # What came out is the target's greedy continuation. This random target has logit
    # near-ties that float rounding decides differently in generate(); check each token
    # against the teacher-forced argmax up to such ties.
    model = load_model(target)
    seq = prompt + out.tokens
    with torch.no_grad():
        logits = model(torch.tensor([seq])).logits[0, len(prompt) - 1:-1]
    chosen = logits[torch.arange(len(out.tokens)), torch.tensor(out.tokens)]
    assert torch.all(chosen >= logits.max(dim=-1).values - 1e-2)


def test_a_draft_with_q_zero_ends_the_round_losslessly():
    """q(x) = 0: x was not drawn from q. The drafts before it are judged as usual and the
    next token comes from the target's own distribution at x's position."""
    from dfvg_host.acceptance import accept_rejection
    p = torch.tensor([[0.0, 1.0, 0.0, 0.0], [0.1, 0.2, 0.3, 0.4], [0.25] * 4], dtype=torch.float64)
    q_ok = torch.tensor([0.0, 1.0, 0.0, 0.0], dtype=torch.float64)
    q_bad = torch.tensor([0.5, 0.5, 0.0, 0.0], dtype=torch.float64)       # the draft says 3
    gen = torch.Generator().manual_seed(0)
    counts = Counter()
    for _ in range(4000):
        v = accept_rejection(p, [1, 3], [q_ok, q_bad], gen)
        assert v.accepted == 1 and v.invalid_q
        counts[v.next_token] += 1
    freq = np.array([counts[i] for i in range(4)]) / 4000
    assert np.abs(freq - p[1].numpy()).max() < 0.03
