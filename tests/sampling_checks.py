"""Helpers for the tests that check a sampler against an exact distribution: the target's
exact law of the first two sampled tokens and Pearson's chi-square p-value.

Shared by the chain (tests/test_speculative.py, tests/test_pipelined.py) and tree
(tests/test_tree.py) sampling tests; any vocabulary size.
"""

from __future__ import annotations

from collections import Counter

import numpy as np
import torch

from dfvg_host.acceptance import SamplingParams, target_distribution


def first_two_distribution(model, prompt: list[int], params: SamplingParams, vocab: int) -> np.ndarray:
    """Exact target distribution ``[vocab, vocab]`` of the first two sampled tokens after
    ``prompt`` (``model`` a loaded causal LM)."""
    with torch.no_grad():
        p1 = target_distribution(model(torch.tensor([prompt])).logits[0, -1], params)
        batch = torch.tensor([prompt + [x] for x in range(vocab)])
        p2 = target_distribution(model(batch).logits[:, -1], params)
    return (p1[:, None] * p2).numpy()


def chi_square_p(counts: Counter, expected: np.ndarray, n: int) -> float:
    """Pearson chi-square p-value of ``counts`` (``(a, b) -> count``) against ``expected``
    (``[V, V]`` probabilities) for ``n`` samples; cells expecting < 5 samples are pooled."""
    vocab = expected.shape[-1]
    exp = expected.reshape(-1) * n
    obs = np.array([counts.get(divmod(i, vocab), 0) for i in range(vocab * vocab)], dtype=float)
    small = exp < 5
    exp = np.append(exp[~small], exp[small].sum())
    obs = np.append(obs[~small], obs[small].sum())
    if exp[-1] == 0:
        exp, obs = exp[:-1], obs[:-1]
    stat = float(((obs - exp) ** 2 / exp).sum())
    dof = len(exp) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64),
                                         torch.tensor(stat / 2, dtype=torch.float64)))
