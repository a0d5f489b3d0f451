"""The controller's tree-drafting state: the nodes of the level being fed, their paths and
their scores (docs/isa.md §9.2).

:class:`TreeState` is what a tree request adds to the controller's registers: for each
row of the current level its token, the rows of its ancestors level by level (which
selects the KV positions ``ATTN`` reads) and its greedy path score. The functional model
keeps one per tree request and advances it at every ``SAMPLE``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from dfvg_hw.spec import numerics as nx
from dfvg_hw.spec.descriptors import DraftedToken

__all__ = ["TreeState", "SampledRow"]


@dataclass(frozen=True)
class SampledRow:
    """What the sampler reads off one source row of the logit buffer.

    Members
    -------
    ids, probs : list of int
        The row's top-k list (largest logit first) and its probabilities (units of 2^-24).
    """
    ids: list[int]
    probs: list[int]


@dataclass
class TreeState:
    """One tree request's nodes (docs/isa.md §9.2).

    Members
    -------
    width : int
        ``W``: nodes per level, rows per tree forward.
    base : int
        ``P0``: the position after the last input; node ``(d, r)``'s KV is stored at
        :meth:`storage` ``(d, r)``.
    level : int
        The last level made (0 before the last input's SAMPLE).
    tokens : list of int
        The tokens of level ``level``'s rows.
    paths : list of list of int
        ``paths[r][j - 1]``: the row of row ``r``'s ancestor at level ``j`` (the last is
        ``r``).
    scores : list of int
        Greedy path scores of level ``level``'s rows (:func:`numerics.path_score`).
    """
    width: int
    base: int
    level: int = 0
    tokens: list[int] = field(default_factory=list)
    paths: list[list[int]] = field(default_factory=lambda: [[]])
    scores: list[int] = field(default_factory=lambda: [nx.TREE_SCORE_ROOT])

    def storage(self, level: int, row: int) -> int:
        """KV position of node ``(level, row)``: ``P0 + (level − 1) · W + row``."""
        return self.base + (level - 1) * self.width + row

    def attended(self, row: int) -> list[int]:
        """The KV positions row ``row`` of the level being fed attends to, in order: the
        committed context, then its path from level 1 down to itself."""
        path = self.paths[row]
        return list(range(self.base)) + [self.storage(j + 1, r) for j, r in enumerate(path)]

    def record_index(self, level: int, row: int) -> int:
        return (level - 1) * self.width + row

    def expand(self, sources: list[SampledRow], draws: list[int] | None) -> list[DraftedToken]:
        """Make the next level from the sampled source rows (one per row of the level being
        fed, or the root's one row): greedy by path score when ``draws`` is None, else row
        ``r`` takes entry ``draws[r]`` of source ``r`` (source 0 when there is one). Returns the
        new nodes' records in row order."""
        parent_level = self.level
        if draws is None:
            picks = nx.tree_expand_greedy(self.scores, [s.probs for s in sources], self.width)
        else:
            # row r continues source row r; every row draws from the one row there is at the
            # root (or after a tree forward whose program computed no logits of its own)
            picks = [(r if len(sources) > 1 else 0, draws[r], 0) for r in range(self.width)]
        records, paths, tokens, scores = [], [], [], []
        for s, j, score in picks:
            source = sources[s]
            parent = -1 if parent_level == 0 else self.record_index(parent_level, s)
            records.append(DraftedToken(source.ids[j], source.probs[j], list(source.ids),
                                        list(source.probs), parent=parent))
            tokens.append(source.ids[j])
            paths.append(self.paths[s] + [len(paths)])
            scores.append(score)
        self.level, self.tokens, self.paths, self.scores = parent_level + 1, tokens, paths, scores
        return records
