"""Verification rules: the target's sampling distribution, greedy and lossless acceptance.

Rejection sampling (Leviathan et al.; Chen et al.) keeps the target's distribution
exactly as long as ``q`` is exactly the distribution each draft token was sampled from —
here, the draft engine's reported top-k probabilities (integers over 2^24).

A draft token with q(token) = 0 cannot have been drawn from q, so the rule cannot be
applied to it. :func:`accept_rejection` then ends the round there: the drafts before it
are judged as usual, and the next token is drawn from the target's own distribution at
that position, which is exactly the target's conditional — lossless whatever the device
sent from that position on. The driver refuses such a result before it gets here
(:class:`~dfvg_host.driver.MalformedResult`); this is the last line of defence.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dfvg_hw.spec.descriptors import DraftedToken
from dfvg_hw.spec.numerics import PROB_BITS

__all__ = ["SamplingParams", "target_distribution", "draft_distribution", "accept_greedy",
           "accept_rejection", "verify_round", "Verdict", "TreeVerdict", "accept_tree_greedy",
           "accept_tree_rejection", "verify_tree"]


@dataclass(frozen=True)
class SamplingParams:
    """How tokens are chosen. ``temperature == 0`` is greedy.

    ``top_k == 0`` keeps the whole vocabulary for the target; the draft engine then
    samples from its largest top-k (``topk_max``), which stays lossless. ``top_p < 1``
    keeps the target's nucleus (the most likely tokens whose probabilities reach
    ``top_p``). Both shape the *target's* distribution, which rejection sampling
    reproduces exactly whatever the draft proposed, so they are honoured exactly.
    """
    temperature: float = 0.0
    top_k: int = 0
    seed: int = 0
    top_p: float = 1.0

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def validate(self) -> "SamplingParams":
        if self.temperature < 0 or self.temperature != self.temperature:
            raise ValueError(f"temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 = no limit), got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        return self


@dataclass
class Verdict:
    """Outcome of verifying one round: how many drafts were accepted, then the next token.

    ``invalid_q`` is set when the round ended at a draft whose q(token) is 0 (see the
    module docstring): the device's q was wrong there.
    """
    accepted: int
    next_token: int
    invalid_q: bool = False


def target_distribution(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Row-wise target probabilities (float64) after temperature, top-k, then top-p."""
    z = logits.to(torch.float64) / params.temperature
    if params.top_k and params.top_k < z.shape[-1]:
        kth = torch.topk(z, params.top_k, dim=-1).values[..., -1:]
        z = z.masked_fill(z < kth, float("-inf"))
    p = torch.softmax(z, dim=-1)
    if params.top_p < 1:
        sorted_p, order = torch.sort(p, dim=-1, descending=True)
        # A token stays when the mass before it is still short of top_p: the smallest
        # prefix that reaches top_p, and always the most likely token.
        before = torch.cumsum(sorted_p, dim=-1) - sorted_p
        keep_sorted = before < params.top_p
        keep = torch.zeros_like(keep_sorted).scatter(-1, order, keep_sorted)
        p = p * keep
        p = p / p.sum(dim=-1, keepdim=True)
    return p


def draft_distribution(token: DraftedToken, vocab: int) -> torch.Tensor:
    """The exact distribution the engine sampled ``token`` from, as a dense float64 row."""
    q = torch.zeros(vocab, dtype=torch.float64)
    ids = torch.tensor(token.topk_ids, dtype=torch.long)
    q.index_add_(0, ids, torch.tensor(token.topk_probs, dtype=torch.float64) / (1 << PROB_BITS))
    return q


def accept_greedy(logits: torch.Tensor, drafts: list[int]) -> Verdict:
    """Accept drafts while they equal the target's argmax; the next token is its argmax."""
    best = torch.argmax(logits, dim=-1).tolist()
    n = 0
    while n < len(drafts) and drafts[n] == best[n]:
        n += 1
    return Verdict(n, best[n])


def accept_rejection(p: torch.Tensor, drafts: list[int], q: list[torch.Tensor],
                     generator: torch.Generator) -> Verdict:
    """Lossless speculative sampling over a chain.

    ``p`` is ``[len(drafts) + 1, V]`` target probabilities; ``q[i]`` the draft's
    distribution for ``drafts[i]``. Draft i is accepted with probability
    ``min(1, p_i(x) / q_i(x))``; on the first rejection the next token is drawn from
    ``norm(max(0, p_i - q_i))``; if all are accepted, the bonus token comes from ``p_n``.

    A draft with ``q_i(x) = 0`` was not drawn from ``q_i``: the round ends there, with the
    next token drawn from ``p_i`` itself (lossless) and ``Verdict.invalid_q`` set.
    """
    for i, x in enumerate(drafts):
        qx = float(q[i][x])
        if not qx > 0:
            return Verdict(i, int(torch.multinomial(p[i], 1, generator=generator)), invalid_q=True)
        ratio = float(p[i, x]) / qx
        if ratio >= 1 or float(torch.rand((), generator=generator, dtype=torch.float64)) < ratio:
            continue
        residual = torch.clamp(p[i] - q[i], min=0)
        total = float(residual.sum())
        dist = residual / total if total > 0 else p[i]
        return Verdict(i, int(torch.multinomial(dist, 1, generator=generator)))
    return Verdict(len(drafts), int(torch.multinomial(p[len(drafts)], 1, generator=generator)))


def verify_round(logits: torch.Tensor, drafts: list[int], q_tokens: list[DraftedToken],
                 params: SamplingParams, generator: torch.Generator) -> Verdict:
    """One round's verdict: greedy when ``params`` is greedy, else rejection sampling of
    the target's distribution against the engine's reported ``q`` (``q_tokens``)."""
    if params.greedy:
        return accept_greedy(logits, drafts)
    p = target_distribution(logits, params)
    q = [draft_distribution(t, p.shape[-1]) for t in q_tokens]
    return accept_rejection(p, drafts, q, generator)


# -- token trees (dfvg_host.tree) ---------------------------------------------------------

@dataclass
class TreeVerdict:
    """Outcome of verifying one token tree: the accepted root-to-node path (node indices
    of the tree, possibly empty), then the next token.

    ``invalid_q`` is set when the round ended at a node whose q(token) is 0 (see
    :func:`accept_tree_rejection`).
    """
    path: list[int]
    next_token: int
    invalid_q: bool = False

    @property
    def accepted(self) -> int:
        return len(self.path)


def accept_tree_greedy(logits: torch.Tensor, tree) -> TreeVerdict:
    """The longest root-to-node path of ``tree`` whose every token is the target's argmax
    after its parent, then the target's argmax after the path's last node.

    ``logits`` is ``[1 + len(tree), V]`` (:meth:`~dfvg_host.verifier.Verifier.score_tree`):
    row 0 after the pending token, row ``1 + i`` after node ``i``. At most one child of a
    node can match (the argmax is one token); should a tree hold the same token twice under
    one parent, the first is taken. The output is the target's greedy decoding whatever
    the tree holds.
    """
    best = torch.argmax(logits, dim=-1).tolist()
    path: list[int] = []
    node = -1                                   # the root: the pending token, row 0
    while True:
        want = best[node + 1]
        child = next((c for c in tree.children(node) if tree.nodes[c].token == want), None)
        if child is None:
            return TreeVerdict(path, want)
        path.append(child)
        node = child


def accept_tree_rejection(p: torch.Tensor, tree, generator: torch.Generator) -> TreeVerdict:
    """Lossless multi-draft speculative sampling over a token tree: recursive rejection
    over siblings (SpecInfer's multi-step speculative sampling; the same rule as the
    recursive rejection sampling of Recursive Speculative Decoding, Jeon et al. 2024, when
    siblings are drawn without replacement).

    ``p`` is ``[1 + len(tree), V]`` target probabilities (row 0 after the pending token,
    row ``1 + i`` after node ``i``). Each node carries ``q`` (``tree.q(i)``): the exact
    distribution its token was drawn from *given its path and its earlier siblings*.

    The rule, starting at the root with ``r := p[root]``. Let the current node's
    children, in the order they were drawn, be ``x_1 .. x_k`` with distributions
    ``q_1 .. q_k``. For ``j = 1 .. k``:

    * accept ``x_j`` with probability ``min(1, r(x_j) / q_j(x_j))``: it joins the path,
      the walk moves to it and starts over with ``r := p[x_j]`` and its children;
    * else ``r := norm(max(0, r - q_j))`` and try ``x_{j+1}``.

    When every child is rejected (or the node has none), the next token is drawn from
    ``r`` and the round ends.

    Why it is exact. Write ``S(r, h)`` for the procedure at one node with target ``r``
    after the drawing history ``h``, which proposes ``x ~ q(. | h)``. Its output law is,
    by induction on the children left (the base case, no child, samples ``r`` itself)::

        P(y) = q(y|h) min(1, r(y)/q(y|h)) + sum_x q(x|h) (1 - min(1, r(x)/q(x|h))) P_{S(r', h+x)}(y)
             = min(q, r)(y) + (1 - sum min(q, r)) r'(y)          (S(r', h+x) ~ r' for every x)
             = r(y),                                               r' = norm(max(0, r - q)).

    The induction needs ``q_j`` to be the law of ``x_j`` given the earlier siblings
    (whatever they were), nothing more. Siblings drawn i.i.d. from one q therefore all
    carry that same q (SpecInfer); siblings drawn without replacement carry
    ``q_j = norm(q with x_1 .. x_{j-1} zeroed)`` (so a rejected token is never proposed
    again, though ``r`` may still return it). An accepted node's subtree was drawn after
    it, independently of its siblings, so the walk restarts below it from ``p`` there;
    the output is distributed exactly as the target's sampling, node after node.

    A child with ``q_j(x_j) = 0`` cannot have been drawn from ``q_j``: the round ends
    there, with the next token drawn from the current ``r`` (the law the remaining
    siblings had to produce, so still exact) and ``TreeVerdict.invalid_q`` set. A residual
    with no mass left (``r <= q_j`` everywhere: numerically, ``r == q_j``) means
    ``x_j`` was accepted with probability 1, so it is never used; ``r`` is kept then.
    """
    path: list[int] = []
    node = -1
    r = p[0]
    while True:
        for child in tree.children(node):
            x = tree.nodes[child].token
            q = tree.q(child)
            if q is None:
                raise ValueError(f"node {child} has no q: sampling needs the distribution each "
                                 "node was drawn from")
            qx = float(q[x])
            if not qx > 0:
                return TreeVerdict(path, int(torch.multinomial(r, 1, generator=generator)),
                                   invalid_q=True)
            ratio = float(r[x]) / qx
            if ratio >= 1 or float(torch.rand((), generator=generator, dtype=torch.float64)) < ratio:
                path.append(child)
                node = child
                r = p[child + 1]
                break
            residual = torch.clamp(r - q.to(r.dtype), min=0)
            total = float(residual.sum())
            if total > 0:
                r = residual / total
        else:
            return TreeVerdict(path, int(torch.multinomial(r, 1, generator=generator)))


def verify_tree(logits: torch.Tensor, tree, params: SamplingParams,
                generator: torch.Generator) -> TreeVerdict:
    """One tree round's verdict: :func:`accept_tree_greedy` when ``params`` is greedy, else
    :func:`accept_tree_rejection` of the target's sampling distribution (temperature,
    top-k, top-p: :func:`target_distribution`) against each node's q."""
    if params.greedy:
        return accept_tree_greedy(logits, tree)
    return accept_tree_rejection(target_distribution(logits, params), tree, generator)
