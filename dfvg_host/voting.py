"""Smurfs' weighted-majority voting over several drafters' drafts.

Every round each drafter drafts a chain of tokens after the committed sequence. The
drafts are merged into a prefix tree (:func:`merge_drafts`): drafters that agree on a
prefix share its nodes, and each node carries the summed weight of the drafters whose
draft passes through it. :func:`heaviest_path` walks down from the root to the heaviest
child at each level; where it stops (a node with no child) some drafter's draft ends, so
the path chosen is always one real drafter's whole draft, never a splice of two.

After the target has verified the round, each drafter is judged by how much of its own
draft the committed tokens confirm (:func:`~dfvg_host.speculative.matched_prefix`), as a share of the part of its
draft they cover, and
:class:`WeightedMajority` raises the weight of a drafter at or above the acceptance
threshold and lowers it below, within bounds: weights follow which drafter is currently
right, and a drafter that is rarely right stops outvoting the others.

Losslessness
------------
Choosing a draft *after seeing the drafts* makes the verified chain's law depend on the
samples of every drafter, which rejection sampling with one drafter's q does not
correct: voting is exact under greedy decoding only (the drafts never change the
output, only how many tokens a forward yields). At temperature > 0,
:mod:`dfvg_host.multi_draft` either chooses the drafter *before* it drafts
(``merge="select"``, from past weights only) or verifies every drafter's chain as
branches of one tree with multi-draft speculative sampling (``merge="tree"``), both
lossless.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from dfvg_host.tree import ROOT, DraftTree

__all__ = ["WeightedMajority", "MergedDrafts", "merge_drafts", "heaviest_path"]


@dataclass
class WeightedMajority:
    """Per-drafter voting weights, adapted round by round against an acceptance threshold.

    Members
    -------
    weights : list of float
        The current weight of each drafter (all ``initial`` at first).
    threshold : float
        A drafter whose matched share of its draft (:func:`~dfvg_host.speculative.matched_prefix` over the part
        of its draft the round's committed tokens cover) is at least this has its weight multiplied by ``raise_by``, else by ``lower_by``.
    raise_by, lower_by : float
        The multiplicative steps (``raise_by ≥ 1 ≥ lower_by > 0``).
    floor, ceiling : float
        Bounds that keep a weight from vanishing (a drafter can recover) or growing
        without limit (a long good run does not silence every other drafter forever).
    history : list of list of float
        The weights after each :meth:`update`, one row per round (for metrics).
    """
    weights: list[float]
    threshold: float = 0.5
    raise_by: float = 1.25
    lower_by: float = 0.8
    floor: float = 0.05
    ceiling: float = 20.0
    history: list[list[float]] = field(default_factory=list)

    @classmethod
    def uniform(cls, drafters: int, initial: float = 1.0, **kwargs) -> "WeightedMajority":
        if drafters < 1:
            raise ValueError(f"voting needs at least one drafter, got {drafters}")
        return cls([float(initial)] * drafters, **kwargs)

    def __post_init__(self):
        if not 0.0 <= self.threshold <= 1.0:
            raise ValueError(f"threshold must be in [0, 1], got {self.threshold}")
        if not (self.raise_by >= 1.0 >= self.lower_by > 0.0):
            raise ValueError(f"need raise_by >= 1 >= lower_by > 0, got {self.raise_by} and {self.lower_by}")
        if not 0.0 < self.floor <= self.ceiling:
            raise ValueError(f"need 0 < floor <= ceiling, got {self.floor} and {self.ceiling}")

    def leader(self, among: list[int] | None = None) -> int:
        """The heaviest drafter (of ``among``, default all); the lowest index on a tie."""
        candidates = range(len(self.weights)) if among is None else among
        return max(candidates, key=lambda i: (self.weights[i], -i))

    def update(self, shares: dict[int, float]) -> None:
        """After a round: ``shares[i]`` is drafter i's matched share of its draft (drafters
        absent from ``shares`` drafted nothing this round and keep their weight)."""
        for i, share in shares.items():
            step = self.raise_by if share >= self.threshold else self.lower_by
            self.weights[i] = min(self.ceiling, max(self.floor, self.weights[i] * step))
        self.history.append(list(self.weights))


@dataclass
class MergedDrafts:
    """Several drafters' drafts as one prefix tree.

    Members
    -------
    tree : DraftTree
        One node per distinct prefix; children in the order their first drafter comes.
    weight : list of float
        Per node, the summed weight of the drafters whose draft passes through it.
    drafters : list of list of int
        Per node, the drafters whose draft passes through it, in drafter order.
    ends : dict of int to int
        Drafter → the node its draft ends at (drafters with an empty draft are absent).
    """
    tree: DraftTree
    weight: list[float]
    drafters: list[list[int]]
    ends: dict[int, int]


def merge_drafts(drafts: dict[int, list[int]], weights: list[float]) -> MergedDrafts:
    """Merge ``drafts`` (drafter → its chain of tokens) into a prefix tree whose nodes sum
    the ``weights`` of the drafters through them."""
    tree = DraftTree()
    weight: list[float] = []
    through: list[list[int]] = []
    ends: dict[int, int] = {}
    for i in sorted(drafts):
        node = ROOT
        for token in drafts[i]:
            child = next((c for c in tree.children(node) if tree.nodes[c].token == token), None)
            if child is None:
                child = tree.add(token, node)
                weight.append(0.0)
                through.append([])
            weight[child] += weights[i]
            through[child].append(i)
            node = child
        if node != ROOT:
            ends[i] = node
    return MergedDrafts(tree, weight, through, ends)


def heaviest_path(merged: MergedDrafts) -> tuple[list[int], int | None]:
    """The vote: from the root, the heaviest child at each level (the first added on a
    tie) down to a node with no child. Returns (the path's node indices, a drafter whose
    whole draft it is — the first of those ending there; their drafts are the same), or
    ``([], None)`` for an empty tree."""
    tree, path, node = merged.tree, [], ROOT
    while True:
        children = tree.children(node)
        if not children:
            break
        node = max(children, key=lambda c: (merged.weight[c], -c))
        path.append(node)
    if not path:
        return [], None
    # A node with no child is where every draft through it ends, so it has an owner.
    return path, min(i for i, end in merged.ends.items() if end == path[-1])
