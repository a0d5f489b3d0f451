"""Pipelined tree speculative decoding: the engine drafts round n+1's token tree while the
target verifies round n's.

Scheme
------
After round n's tree comes back, and before the target verifies it, the decoder picks the
*anchor*: of the nodes the target will verify, the leaf whose path is the most likely to
be accepted (greedy, by the acceptance learnt per rank, :class:`~dfvg_host.tree_drafting.
RankAcceptance`; sampled, by the draft's q). It commits that optimistic path on the
engine (:meth:`~dfvg_host.driver.DraftDevice.commit_tree_path` of all but its last node,
so the request that follows compacts their KV into place) and submits a *continuation*:
a tree request that feeds the rest of the path and drafts ``D' + 1`` levels, level 1
being ``W`` guesses of the target's next token and levels 2 … ``D' + 1`` the next round's
tree. Then the target verifies round n, then the decoder collects the continuation.

* **Hit** — the target accepted exactly the anchor's path and its next token is one of
  level 1's tokens, at row ``r`` (the first such row), with nodes below it (a greedy
  level 2 may put all of its rows under other guesses): round n+1's tree is the
  continuation's nodes below ``(1, r)`` (:class:`~dfvg_host.tree_drafting.SubTree`),
  drafted already, cut to the budget as any round's. The engine then holds exactly what
  a serial round n+1 would have compacted and fed, and ``(1, r)``'s KV in the tree's
  slots: its commit compacts from there.
* **Miss** — another path, or a next token level 1 does not hold: the continuation is
  discarded, the engine keeps the longest common prefix of the accepted and the
  optimistic paths (in logical order already) and round n+1 drafts serially, feeding the
  rest of the accepted path and the target's token.

Greedy output is the target's greedy decoding token for token: drafts decide how many
tokens a forward yields, never which.

Sampling stays lossless
-----------------------
As for :mod:`dfvg_host.pipelined`: the continuation takes its own RNG counters (``(D' +
1)·W`` of them, node ``(d, r)`` drawing with ``counter + (d − 1)·W + r``) and the cursor
moves past them hit or miss, so no uniform is ever used twice. Sampled trees continue
each row's branch, so the nodes below ``(1, r)`` are row ``r``'s: drawn with uniforms that
neither the hit event (round n's verdict, with the verifier's own generator, and level
1's tokens) nor the choice of ``r`` (level 1's tokens and the target's token) looked at.
Given the hit and ``r``, they are distributed as a serial tree after the target's token
would be (a chain of one row: a sampled hit verifies one branch), each with the q it
reports. The anchor is chosen from round n's drafts, before the verifier draws anything.

Faults
------
A continuation that fails (submit or collect) is counted; the round's verdict stands
(the target verified it alone), and the device is reset and fed the whole committed
sequence before the next round (within ``max_recoveries``, then the target goes on
alone). No replay: the next round drafts serially, so the output is the decoding rule's
either way (identical in greedy; same distribution when sampling).

Time
----
As :mod:`dfvg_host.pipelined`: on ``sim://`` every request runs synchronously in wall
time and the overlap is *modelled*: a round takes ``T_verify + max(0, T_continuation −
T_verify)``, ``min(T_continuation, T_verify)`` being counted once
(``SpecDecodeMetrics.hidden_draft_seconds``); the engine's cycles are the cycle model's
tree request (docs/isa.md §9.5, exact against the RTL) and PCIe the link model's.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from dfvg_hw.spec.descriptors import MAX_DRAFT
from dfvg_host.driver import DraftDeviceError
from dfvg_host.pipelined import Continuation, PipelinedDecoder
from dfvg_host.speculative import DraftCursor, GenerationRun, matched_prefix
from dfvg_host.tree_drafting import SubTree, TreeCursor, TreeDecoder, record_path, split_round

__all__ = ["PipelinedTreeDecoder", "TreeContinuation"]


@dataclass
class TreeContinuation(Continuation):
    """A continuation tree (:class:`~dfvg_host.pipelined.Continuation`; ``n_next`` is the
    next round's depth, the request drafts ``n_next + 1`` levels).

    Members
    -------
    path : list of int
        The optimistic path: record indices, in the round's request, from level 1 down to
        the anchor.
    base : int
        Where the round's tree's KV begins (its request's ``P0``): the optimistic path's
        first node sits there once compacted.
    """
    path: list[int] = field(default_factory=list)
    base: int = 0


class PipelinedTreeDecoder(TreeDecoder, PipelinedDecoder):
    """Tree speculative decoding that drafts the next round's tree during verification.

    The constructor, members and :meth:`generate` of
    :class:`~dfvg_host.tree_drafting.TreeDecoder` (``depth``, ``budget``); the round loop,
    time accounting and metrics (``schedule = "pipelined"``, hits, misses, hidden
    drafting) of :class:`~dfvg_host.pipelined.PipelinedDecoder`. Module docstring for the
    scheme, losslessness and faults.
    """

    schedule = "pipelined"

    def _anchor(self, d, root: int, records: list[int]) -> int:
        """Of ``records`` (the nodes to verify below ``root``), the leaf whose path from
        ``root`` is the most likely to be accepted; ties to the lower record."""
        chance = dict(zip(records, self._step_chances(d, records)))
        parents = d.parents
        path_chance: dict[int, float] = {root: 1.0}
        for i in records:
            path_chance[i] = path_chance[parents[i]] * chance[i]
        has_child = {parents[i] for i in records}
        leaves = [i for i in records if i not in has_child]
        return max(leaves, key=lambda i: (path_chance[i], -i))

    def _submit_continuation(self, run: GenerationRun, state: DraftCursor, seq: list[int], d,
                             remaining: int) -> TreeContinuation | None:
        """Commit the optimistic path and start the next round's tree from it, or None when
        a hit would leave nothing to draft (the round then commits as a serial one)."""
        output, root = split_round(d)
        records = self._verified_records(output, root)
        if not records:
            return None
        prefix = record_path(output.parents, root)
        path = record_path(output.parents, self._anchor(output, root, records))
        base = self.draft.tree.base
        width = self.width
        # After a full hit: the engine holds the path's KV from base on, and the next round
        # emits at most its depth + 1 tokens; level d < levels of the continuation takes W
        # slots; a request holds 64 nodes, so the deepest trees continue one level shallower.
        room_levels = (self.draft.compiled.context_limit - (base + len(path))) // width + 1
        after_hit = remaining - (len(path) - len(prefix) + 1)
        n_next = min(self._choose_gamma(), after_hit - 1, room_levels - 1, MAX_DRAFT // width - 1)
        if n_next < 1:
            return None
        c = TreeContinuation(counter=state.counter, n_next=n_next, end=0,
                             optimistic=seq + [output.ids[i] for i in path[len(prefix):]], path=path,
                             base=base)
        state.counter += (n_next + 1) * width       # consumed, hit or miss (module docstring)
        try:
            kept = self.draft.commit_tree_path(path[:-1])
            inputs = [output.ids[i] for i in path[kept:]]
            c.pending = self._timed_device(run, c, lambda: self.draft.submit_tree(
                inputs, n_next + 1, counter=c.counter, **TreeCursor.tree_options(self.draft, self.sampling)))
        except DraftDeviceError as exc:
            self._continuation_fault(run, c, exc)
        return c

    @staticmethod
    def _ready_drafts(ready: SubTree) -> int:
        return ready.levels

    def _settle(self, run: GenerationRun, state: DraftCursor, seq: list[int], c: TreeContinuation,
                n: int, d, verdict, going_on: bool, use_device: bool,
                round_no: int) -> tuple[SubTree | None, bool]:
        """A hit makes the next round's tree of the continuation's nodes below the level-1
        node holding the target's token; a miss keeps the engine's KV of the accepted path's
        common prefix with the optimistic one (module docstring)."""
        m = run.metrics
        output, root = split_round(d)
        accepted = record_path(output.parents, root) + verdict.path
        if c.output is not None and going_on and accepted == c.path:
            level1 = c.output.tokens[:c.output.tree_width]
            row = next((r for r, t in enumerate(level1) if t.token == verdict.next_token), None)
            # A greedy level 2 may hold nothing below that guess: nothing drafted, a miss.
            if row is not None and row in c.output.parents:
                m.pipeline_hits += 1
                state.inputs = []
                return SubTree(c.output, row, c.output.levels - 1), use_device
        m.pipeline_misses += 1
        if use_device and going_on:
            if c.fault is not None:
                return None, self._reset_after(run, state, seq, c.fault, round_no)
            kept = matched_prefix(c.path, accepted)
            self.draft.rollback(c.base + kept)
            state.inputs = [output.ids[i] for i in accepted[kept:]] + [verdict.next_token]
        return None, use_device

