"""Speculative decoding: exact greedy, lossless sampling (and that the test can fail)."""

from collections import Counter

import numpy as np
import pytest
import torch

import dfvg_host.speculative as speculative
from conftest import make_tiny_llama
from dfvg_hw.config import get_preset
from dfvg_host.acceptance import SamplingParams, target_distribution
from dfvg_host.compiler import compile_draft, load_model
from dfvg_host.driver import DraftDevice
from dfvg_host.speculative import SpeculativeDecoder
from dfvg_host.verifier import Verifier

VOCAB = 8


@pytest.fixture(scope="module")
def small_vocab_pair(tmp_path_factory):
    """A random target and a different random draft over an 8-token vocabulary."""
    root = tmp_path_factory.mktemp("small-vocab")
    target = make_tiny_llama(root / "target", vocab=VOCAB, seed=10, weight_scale=3.0)
    draft = make_tiny_llama(root / "draft", vocab=VOCAB, seed=11, weight_scale=3.0)
    return draft, target


def make_decoder(draft_dir, target_dir, sampling, gamma=2):
    engine = get_preset("tiny")
    device = DraftDevice.open("sim://tiny", compile_draft(draft_dir, engine))
    verifier = Verifier(load_model(target_dir), torch.device("cpu"))
    return SpeculativeDecoder(device, verifier, gamma=gamma, sampling=sampling)


def first_two_distribution(target_dir, prompt, params):
    """Exact target distribution of the first two sampled tokens (64 cells)."""
    model = load_model(target_dir)
    with torch.no_grad():
        p1 = target_distribution(model(torch.tensor([prompt])).logits[0, -1], params)
        batch = torch.tensor([prompt + [x] for x in range(VOCAB)])
        p2 = target_distribution(model(batch).logits[:, -1], params)
    return (p1[:, None] * p2).numpy()


def chi_square_p(counts: Counter, expected: np.ndarray, n: int) -> float:
    """Pearson chi-square p-value; cells expecting < 5 samples are pooled."""
    exp = expected.reshape(-1) * n
    obs = np.array([counts.get(divmod(i, VOCAB), 0) for i in range(VOCAB * VOCAB)], dtype=float)
    small = exp < 5
    exp = np.append(exp[~small], exp[small].sum())
    obs = np.append(obs[~small], obs[small].sum())
    if exp[-1] == 0:
        exp, obs = exp[:-1], obs[:-1]
    stat = float(((obs - exp) ** 2 / exp).sum())
    dof = len(exp) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64),
                                         torch.tensor(stat / 2, dtype=torch.float64)))


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
    n = 20000
    counts = sample_first_two(decoder, PROMPT, n, PARAMS)
    expected = first_two_distribution(target, PROMPT, PARAMS)
    p = chi_square_p(counts, expected, n)
    assert p > 0.01, f"speculative samples differ from the target distribution (p = {p:.2e})"


def test_wrong_q_is_detected(small_vocab_pair, monkeypatch):
    draft, target = small_vocab_pair
    uniform = lambda token, vocab: torch.full((vocab,), 1.0 / vocab, dtype=torch.float64)
    monkeypatch.setattr(speculative, "draft_distribution", uniform)
    decoder = make_decoder(draft, target, PARAMS)
    n = 6000
    counts = sample_first_two(decoder, PROMPT, n, PARAMS)
    p = chi_square_p(counts, first_two_distribution(target, PROMPT, PARAMS), n)
    assert p < 0.01, f"a uniform q went undetected (p = {p:.3f})"
