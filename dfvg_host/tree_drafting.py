"""Speculative decoding with the draft engine's token trees: one tree per round, verified
in one target forward.

Each round the engine drafts a token tree in one request (docs/isa.md §9): ``depth``
levels of ``W`` nodes, ``W`` the width the draft was compiled for (the preset's rows:
4 on the Alveo presets, 2 on ``tiny``) — greedy, the ``W`` most probable paths' nodes
level by level (path score, row 0 the most probable path); sampled, ``W`` i.i.d. draws
from the root's q, each continuing its own branch. The target scores every node in one
forward (:meth:`~dfvg_host.verifier.Verifier.score_tree`, the tree's ancestor mask) and
accepts one root-to-node path (:func:`~dfvg_host.acceptance.verify_tree`): greedy, the
longest path the target's argmax follows, so the output is exactly the target's greedy
decoding; sampled, recursive rejection over siblings (SpecInfer), which is lossless
because siblings are drawn i.i.d. from the one q each record reports. The target's KV
keeps the path (:meth:`~dfvg_host.verifier.Verifier.commit_path`), the engine's is
compacted to it by the next request (:meth:`~dfvg_host.driver.DraftDevice.
commit_tree_path`), which feeds the rest of the path and the target's token.

Everything else is :class:`~dfvg_host.speculative.SpeculativeDecoder`'s: the round loop,
the metrics (``gamma``, drafted and accepted counted in *levels*; plus ``tree_width``
and ``tree_nodes``), the timeline, ``depth="auto"`` (:class:`~dfvg_host.adaptive.
AdaptiveLength` choosing the depth from past rounds: the acceptance per level, the
verify time against the depth, the modelled tree request's time) and the fault rules —
a failed request resets the device and replays, with the same RNG counter (a request
takes ``depth · W`` counters), then the target goes on alone; no token is lost.

Time: the target and the host are measured; the engine's tree request (its cycles from
the device: the cycle model on ``sim://``, docs/isa.md §9.5, exact against the RTL) and
PCIe (link model) are modelled.
"""

from __future__ import annotations

from dataclasses import dataclass

from dfvg_hw.spec.descriptors import MAX_DRAFT
from dfvg_hw.spec.numerics import PROB_BITS
from dfvg_host.acceptance import SamplingParams, TreeVerdict, Verdict, verify_tree
from dfvg_host.adaptive import AdaptiveLength
from dfvg_host.driver import DraftDevice, DraftOutput, PendingDraft
from dfvg_host.speculative import DraftCursor, GenerationRun, SpeculativeDecoder
from dfvg_host.tree import ROOT, DraftTree, descendants, most_probable_nodes, subtree
from dfvg_host.verifier import Verifier

__all__ = ["TreeCursor", "TreeDecoder", "RankAcceptance", "SubTree", "VerifiedTree", "record_path",
           "verified_levels", "STRATEGIES"]

#: What ``dfvg generate --strategy`` drafts: the engine's chains, or its token trees.
STRATEGIES = ("chain", "tree")


@dataclass(frozen=True)
class SubTree:
    """The records of a tree request below one of its nodes, ``root``: a round's tree that
    an earlier request drafted (a pipelined hit, :mod:`dfvg_host.pipelined_tree`).

    Members
    -------
    output : DraftOutput
        The tree request's result.
    root : int
        The record whose descendants are this round's tree (its token is committed).
    levels : int
        Levels below ``root``.
    """
    output: DraftOutput
    root: int
    levels: int


def split_round(d: DraftOutput | SubTree) -> tuple[DraftOutput, int]:
    """A round's tree as (the request's records, the record it hangs from or ROOT)."""
    return (d.output, d.root) if isinstance(d, SubTree) else (d, ROOT)


def record_path(parents: list[int], node: int) -> list[int]:
    """Record indices from level 1 down to ``node`` (``[]`` for :data:`~dfvg_host.tree.ROOT`)."""
    out = []
    while node != ROOT:
        out.append(node)
        node = parents[node]
    return out[::-1]


@dataclass
class VerifiedTree(TreeVerdict):
    """A tree round's verdict (the path as record indices of the request) and the levels
    of the tree the target verified: what the metrics and the adaptive depth count as
    drafted — a budget, or a pipelined round's subtree, may verify fewer levels than were
    requested."""
    levels: int = 0


def verified_levels(n: int, verdict) -> int:
    """Levels a round drafted for the metrics: the verified tree's, or ``n`` (chains)."""
    return verdict.levels if isinstance(verdict, VerifiedTree) else n


class TreeCursor(DraftCursor):
    """A :class:`~dfvg_host.speculative.DraftCursor` whose requests draft token trees
    (``n`` is the depth in levels) and whose rounds end by committing the accepted path."""

    @classmethod
    def tree_options(cls, device: DraftDevice, sampling: SamplingParams) -> dict:
        """The sampling options of a tree request for ``sampling``."""
        options = cls.request_options(device, sampling)
        if not options["sample"]:
            options["topk"] = device.tree_width     # the greedy expansion's W per source
        return options

    def _request(self, device: DraftDevice, n: int, sampling: SamplingParams) -> PendingDraft:
        return device.submit_tree(self.inputs, n, counter=self.counter,
                                  **self.tree_options(device, sampling))

    def commit(self, device: DraftDevice, tree: DraftOutput, path: list[int], next_token: int) -> None:
        """After the target accepted ``path`` (record indices) of ``tree`` and chose
        ``next_token``: the engine keeps the path's KV (compacted by the next request)
        and the next request feeds what it holds no KV for."""
        kept = device.commit_tree_path(path)
        self.inputs = [tree.tokens[i].token for i in path[kept:]] + [next_token]


class RankAcceptance:
    """How often the target's greedy token is the draft's k-th most probable one, by how
    sure the draft was, learnt from verified rounds: the chance that a greedy tree's node
    is accepted once its parent is.

    The draft's own probability is a poor guide to greedy acceptance: a draft distilled at
    temperature 1 may give its argmax a q of 0.3 where the target agrees with it 80 % of
    the time. What the budget ranks nodes by is measured instead, in cells of (the node's
    rank among its parent's candidates, its q in :attr:`BUCKETS` equal bins).

    Members
    -------
    hits : dict
        ``(rank, bin)`` → steps at which the target chose the candidate of that cell.
    trials : dict
        ``(rank, bin)`` → steps at which that cell's candidate was on offer.
    """

    #: Prior chance of acceptance by rank, worth ``PRIOR_WEIGHT`` steps in each cell.
    PRIOR = (0.6, 0.15, 0.06, 0.03)
    PRIOR_WEIGHT = 4.0
    BUCKETS = 8

    def __init__(self):
        self.hits: dict[tuple[int, int], int] = {}
        self.trials: dict[tuple[int, int], int] = {}

    def _cell(self, rank: int, q: float) -> tuple[int, int]:
        return min(rank, len(self.PRIOR) - 1), min(int(q * self.BUCKETS), self.BUCKETS - 1)

    def probability(self, rank: int, q: float) -> float:
        """Estimated chance that a node of ``rank`` (0: its parent's argmax) and draft
        probability ``q`` is accepted after its parent."""
        cell = self._cell(rank, q)
        prior = self.PRIOR[cell[0]]
        return ((self.hits.get(cell, 0) + prior * self.PRIOR_WEIGHT)
                / (self.trials.get(cell, 0) + self.PRIOR_WEIGHT))

    def observe(self, candidates: list[int], probs: list[float], token: int) -> None:
        """The target chose ``token`` where the draft offered ``candidates`` (most probable
        first) with probabilities ``probs``."""
        for rank, (candidate, q) in enumerate(zip(candidates, probs)):
            cell = self._cell(rank, q)
            self.trials[cell] = self.trials.get(cell, 0) + 1
            self.hits[cell] = self.hits.get(cell, 0) + (candidate == token)


class TreeDecoder(SpeculativeDecoder):
    """Speculative decoding with the engine's token trees (module docstring); the
    constructor and :meth:`generate` of :class:`~dfvg_host.speculative.SpeculativeDecoder`,
    with ``depth`` (levels per tree, or ``"auto"``) in place of γ.

    Members
    -------
    width : int
        The trees' width: the device's :attr:`~dfvg_host.driver.DraftDevice.tree_width`.
    depth : int
        Levels per tree; with an adaptive depth its upper bound. The metrics count the
        levels of the tree verified (:class:`VerifiedTree`), which a budget may make fewer.
    ranks : RankAcceptance
        The greedy acceptance model a budget ranks nodes by; it learns over generations.
    budget : int or None
        Nodes the target verifies per round (None: the whole tree). Greedy, the ``budget``
        nodes whose paths are the most likely to be accepted
        (:func:`~dfvg_host.tree.most_probable_nodes` of the chances :attr:`ranks` learnt):
        the engine drafts wider and deeper than the target verifies, and the verified tree
        takes the draft's confidence's shape. Sampled, the first ``budget`` records (whole
        levels, then the first rows of the next): a choice that does not look at the drawn
        tokens, which keeps recursive rejection lossless.
    """

    cursor_class = TreeCursor

    def __init__(self, draft: DraftDevice, verifier: Verifier, *, depth: int | str = 4,
                 budget: int | None = None,
                 sampling: SamplingParams = SamplingParams(), eos_token_id: int | None = None,
                 max_recoveries: int = 2, fallback: bool = True,
                 adaptive: AdaptiveLength | None = None):
        reason = draft.tree_unavailable()
        if reason:
            raise ValueError(f"tree drafting needs a device that drafts token trees: {reason}")
        if depth != "auto" and (isinstance(depth, bool) or not isinstance(depth, int) or depth < 1):
            raise ValueError(f"depth must be an integer of at least 1 or 'auto', got {depth!r}")
        width = draft.tree_width
        most = MAX_DRAFT // width
        if depth == "auto" and adaptive is None:
            adaptive = AdaptiveLength(gamma_max=min(AdaptiveLength.DEFAULT_GAMMA_MAX, most))
        deepest = adaptive.gamma_max if adaptive is not None else depth
        if isinstance(deepest, int) and not isinstance(deepest, bool) and deepest > most:
            raise ValueError(f"a tree {width} wide has at most {most} levels ({MAX_DRAFT} nodes per "
                             f"request), got depth {deepest}")
        if budget is not None and (isinstance(budget, bool) or not isinstance(budget, int) or budget < 1):
            raise ValueError(f"budget must be a positive number of nodes or None, got {budget!r}")
        super().__init__(draft, verifier, gamma=depth, sampling=sampling, eos_token_id=eos_token_id,
                         max_recoveries=max_recoveries, fallback=fallback, adaptive=adaptive)
        self.width = width
        self.budget = budget
        self.ranks = RankAcceptance()

    @property
    def depth(self) -> int:
        return self.gamma

    def _begin(self, prompt: list[int]) -> GenerationRun:
        run = super()._begin(prompt)
        run.metrics.tree_width = self.width
        run.metrics.tree_budget = self.budget or 0
        return run

    def _room(self, state: DraftCursor) -> int:
        """Levels the engine's context has room for after ``state``'s inputs: level ``d <
        depth`` takes ``W`` positions above them."""
        free = self.draft.compiled.context_limit - (self.draft.committed + len(state.inputs))
        return free // self.width + 1 if free >= 0 else 0

    def _step_chances(self, d: DraftOutput, records: list[int]) -> list[float]:
        """Each record's chance of acceptance once its parent is accepted: greedy, what
        :attr:`ranks` learnt; sampled, the draft's q of its token."""
        if not self.sampling.greedy:
            return [d.tokens[i].prob / (1 << PROB_BITS) for i in records]
        return [self.ranks.probability(d.tokens[i].topk_ids.index(d.ids[i]),
                                       d.tokens[i].prob / (1 << PROB_BITS)) for i in records]

    def _verified_records(self, d: DraftOutput, root: int = ROOT) -> list[int]:
        """The records the target verifies this round: the nodes below ``root`` (a record
        index, or :data:`~dfvg_host.tree.ROOT` for the whole tree), cut to :attr:`budget`."""
        below = descendants(d.parents, root)
        if self.budget is None or len(below) <= self.budget:
            return below
        if not self.sampling.greedy:
            return below[:self.budget]
        chosen = most_probable_nodes(subtree(d.parents, below, root), self._step_chances(d, below),
                                     self.budget)
        return [below[i] for i in chosen]

    def _verify_tree(self, run: GenerationRun, d: DraftOutput, root: int,
                     round_no: int) -> tuple[list[int], TreeVerdict, float]:
        """Score the records below ``root`` (:meth:`_verified_records`) in one target forward,
        accept a path, keep its KV on the target: (the path's tokens, the verdict with the
        path as record indices, the measured seconds)."""
        records = self._verified_records(d, root)
        greedy = self.sampling.greedy
        tree = DraftTree.from_parents([d.ids[i] for i in records], subtree(d.parents, records, root),
                                      None if greedy else [d.tokens[i] for i in records],
                                      vocab=self.verifier.vocab_size)
        v0 = self.verifier.seconds
        try:
            verdict = verify_tree(self.verifier.score_tree(tree), tree, self.sampling, self._generator)
            self.verifier.commit_path(verdict.path, verdict.next_token)
        finally:
            seconds = self.verifier.seconds - v0
            run.timeline.then("target", f"verify round {round_no}", seconds, "measured",
                              round=round_no, drafts=len(tree))
        run.metrics.tree_nodes += len(tree)
        self._note_invalid_q(run, verdict)
        path = [records[i] for i in verdict.path]
        if greedy:
            self._learn_ranks(d, root, path, verdict.next_token)
        return ([d.ids[i] for i in path],
                VerifiedTree(path, verdict.next_token, verdict.invalid_q, levels=tree.depth), seconds)

    def _emit(self, run, out, seq, n, drafts, verdict, remaining, use_device, on_tokens) -> bool:
        return super()._emit(run, out, seq, verified_levels(n, verdict), drafts, verdict, remaining,
                             use_device, on_tokens)

    def _observe(self, drafted, verdict, verify_s, host_s, draft_requests) -> None:
        super()._observe(verified_levels(drafted, verdict), verdict, verify_s, host_s, draft_requests)

    def _learn_ranks(self, d: DraftOutput, root: int, path: list[int], next_token: int) -> None:
        """Tell :attr:`ranks` where the target's tokens stood among the draft's candidates
        along the accepted path (where the tree holds the candidates)."""
        chosen = [d.ids[i] for i in path] + [next_token]
        first_child: dict[int, int] = {}
        for i, p in enumerate(d.parents):
            first_child.setdefault(p, i)
        for parent, token in zip([root] + path, chosen):
            child = first_child.get(parent)
            if child is None:
                break
            record = d.tokens[child]
            self.ranks.observe(record.topk_ids, [p / (1 << PROB_BITS) for p in record.topk_probs], token)

    def _verify_output(self, run: GenerationRun, d: DraftOutput | None,
                       round_no: int) -> tuple[list[int], Verdict | TreeVerdict, float]:
        """Score the round's tree in one target forward, accept a path, keep its KV: (the
        path's tokens, the verdict, the measured seconds). A round without a tree (the
        target alone) verifies as the chain decoder's."""
        if d is None:
            return super()._verify_output(run, d, round_no)
        return self._verify_tree(run, *split_round(d), round_no)

    def _advance(self, state: DraftCursor, n: int, d: DraftOutput | SubTree | None, drafts: list[int],
                 verdict: Verdict | TreeVerdict) -> None:
        if d is None:
            super()._advance(state, n, d, drafts, verdict)
        else:
            output, root = split_round(d)
            state.commit(self.draft, output, record_path(output.parents, root) + verdict.path,
                         verdict.next_token)
