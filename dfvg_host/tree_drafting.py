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

from dfvg_hw.spec.descriptors import MAX_DRAFT
from dfvg_host.acceptance import SamplingParams, TreeVerdict, Verdict, verify_tree
from dfvg_host.adaptive import AdaptiveLength
from dfvg_host.driver import DraftDevice, DraftOutput, PendingDraft
from dfvg_host.speculative import DraftCursor, GenerationRun, SpeculativeDecoder
from dfvg_host.tree import DraftTree
from dfvg_host.verifier import Verifier

__all__ = ["TreeCursor", "TreeDecoder", "STRATEGIES"]

#: What ``dfvg generate --strategy`` drafts: the engine's chains, or its token trees.
STRATEGIES = ("chain", "tree")


class TreeCursor(DraftCursor):
    """A :class:`~dfvg_host.speculative.DraftCursor` whose requests draft token trees
    (``n`` is the depth in levels) and whose rounds end by committing the accepted path."""

    def _request(self, device: DraftDevice, n: int, sampling: SamplingParams) -> PendingDraft:
        options = self.request_options(device, sampling)
        if not options["sample"]:
            options["topk"] = device.tree_width     # the greedy expansion's W per source
        return device.submit_tree(self.inputs, n, counter=self.counter, **options)

    def commit(self, device: DraftDevice, tree: DraftOutput, path: list[int], next_token: int) -> None:
        """After the target accepted ``path`` (record indices) of ``tree`` and chose
        ``next_token``: the engine keeps the path's KV (compacted by the next request)
        and the next request feeds what it holds no KV for."""
        kept = device.commit_tree_path(path)
        self.inputs = [tree.tokens[i].token for i in path[kept:]] + [next_token]


class TreeDecoder(SpeculativeDecoder):
    """Speculative decoding with the engine's token trees (module docstring); the
    constructor and :meth:`generate` of :class:`~dfvg_host.speculative.SpeculativeDecoder`,
    with ``depth`` (levels per tree, or ``"auto"``) in place of γ.

    Members
    -------
    width : int
        The trees' width: the device's :attr:`~dfvg_host.driver.DraftDevice.tree_width`.
    depth : int
        Levels per tree; with an adaptive depth its upper bound.
    """

    cursor_class = TreeCursor

    def __init__(self, draft: DraftDevice, verifier: Verifier, *, depth: int | str = 4,
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
        super().__init__(draft, verifier, gamma=depth, sampling=sampling, eos_token_id=eos_token_id,
                         max_recoveries=max_recoveries, fallback=fallback, adaptive=adaptive)
        self.width = width

    @property
    def depth(self) -> int:
        return self.gamma

    def _begin(self, prompt: list[int]) -> GenerationRun:
        run = super()._begin(prompt)
        run.metrics.tree_width = self.width
        return run

    def _room(self, state: DraftCursor) -> int:
        """Levels the engine's context has room for after ``state``'s inputs: level ``d <
        depth`` takes ``W`` positions above them."""
        free = self.draft.compiled.context_limit - (self.draft.committed + len(state.inputs))
        return free // self.width + 1 if free >= 0 else 0

    def _verify_output(self, run: GenerationRun, d: DraftOutput | None,
                       round_no: int) -> tuple[list[int], Verdict | TreeVerdict, float]:
        """Score the round's tree in one target forward, accept a path, keep its KV: (the
        path's tokens, the verdict, the measured seconds). A round without a tree (the
        target alone) verifies as the chain decoder's."""
        if d is None:
            return super()._verify_output(run, d, round_no)
        tree = DraftTree.from_parents(d.ids, d.parents, None if self.sampling.greedy else d.tokens,
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
        return [tree.nodes[i].token for i in verdict.path], verdict, seconds

    def _advance(self, state: DraftCursor, n: int, d: DraftOutput | None, drafts: list[int],
                 verdict: Verdict | TreeVerdict) -> None:
        if d is None:
            super()._advance(state, n, d, drafts, verdict)
        else:
            state.commit(self.draft, d, verdict.path, verdict.next_token)
