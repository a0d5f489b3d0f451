"""Token trees for speculative decoding: the drafted tree, its masks, positions and TreeSort.

A round of tree speculative decoding drafts a *tree* of tokens after the pending token (the
last committed token, whose KV the target has not cached yet): the pending token is the
root, each node one drafted token whose parent is the node (or the root) it continues.
The target scores ``[pending] + nodes`` in one forward pass in which every node attends to
the committed cache, the pending token, its ancestors and itself — never to a sibling or a
cousin — at position ``start + depth`` (``start`` is the pending token's position), so the
logits of a node are exactly those of its root-to-node path decoded as a chain
(:meth:`dfvg_host.verifier.Verifier.score_tree`). The acceptance rules
(:func:`dfvg_host.acceptance.accept_tree_greedy`,
:func:`dfvg_host.acceptance.accept_tree_rejection`) then choose one root-to-node path,
and the target's KV is compacted to it (:meth:`dfvg_host.verifier.Verifier.commit_path`).

Node order
----------
Nodes are numbered in the order they are added, and a node's parent is always added
before it (``parent < index``): the ancestor mask is lower-triangular in that order.
The children of a node are taken in the order they were added — the order they were
drawn in, which the lossless rule needs (see ``accept_tree_rejection``).

``q`` of a node
---------------
For sampling, each node keeps the exact distribution its token was drawn from *given
everything drawn before it* (its path and its earlier siblings): a dense float64 row, or
the engine's top-k record (:class:`~dfvg_hw.spec.descriptors.DraftedToken`) converted
with :func:`dfvg_host.acceptance.draft_distribution`. Siblings drawn i.i.d. from one q all
carry that q; siblings drawn without replacement carry q with the earlier siblings'
tokens removed and renormalised. Greedy trees need no q.

TreeSort
--------
:meth:`DraftTree.tree_sort` reorders the nodes in depth-first preorder (children in
their order) and cuts the order into *blocks*: a block starts at a node whose parent is
not the node just before it, so each block is a chain (every node's parent is its
predecessor) that ends at a leaf — the part of one root-to-leaf branch not shared with an
earlier branch. In that order the ancestor mask is block lower-triangular: each diagonal
block is exactly causal (lower-triangular ones), blocks above the diagonal are zero, and
each block below the diagonal is either zero or the *same* row for every node of the
block — a run of ones over a prefix of an earlier block (the part of that branch the
block descends from). What it buys: every block verifies as an ordinary causal
attention over ``[cache, pending, its ancestors' prefix, the block]`` — the same GEMMs as a
chain, with the ancestors gathered as a dense prefix and no per-element mask — so the
target (or a kernel that knows no tree) runs one causal chain per block. The mask
transformers gets from :meth:`~dfvg_host.verifier.Verifier.score_tree` is the same
relation whatever the order, and the logits of a node do not depend on it; TreeSort
keeps each node's children in their order, so acceptance on the sorted tree is the same
rule.
"""

from __future__ import annotations

from dataclasses import dataclass

import math

import torch

from dfvg_hw.spec.descriptors import DraftedToken
from dfvg_host.acceptance import draft_distribution

__all__ = ["ROOT", "TreeNode", "DraftTree", "TreeSort", "most_probable_nodes", "descendants", "subtree"]

#: The parent index of a node that continues the pending token (the tree's root).
ROOT = -1


@dataclass(frozen=True)
class TreeNode:
    """One drafted token.

    Members
    -------
    token : int
    parent : int
        Index of the parent node, or :data:`ROOT` (the pending token).
    depth : int
        1 for a child of the root, parent's depth + 1 otherwise.
    q : torch.Tensor or None
        The float64 distribution ``[V]`` this token was drawn from, given its path and its
        earlier siblings; None for greedy trees.
    """
    token: int
    parent: int
    depth: int
    q: torch.Tensor | None = None


@dataclass(frozen=True)
class TreeSort:
    """A TreeSort ordering of a tree (:meth:`DraftTree.tree_sort`).

    Members
    -------
    order : list of int
        ``order[k]`` is the original index of the node placed at position ``k``.
    blocks : list of (int, int)
        ``[start, stop)`` position ranges, in order, covering ``0 .. n``; each is a chain
        that ends at a leaf.
    """
    order: list[int]
    blocks: list[tuple[int, int]]


class DraftTree:
    """A drafted token tree rooted at the pending token.

    ``vocab`` is needed only to convert an engine record (``DraftedToken``) into a q row.
    """

    def __init__(self, vocab: int | None = None):
        self.vocab = vocab
        self.nodes: list[TreeNode] = []
        self._children: dict[int, list[int]] = {ROOT: []}

    # -- building ------------------------------------------------------------------------
    def add(self, token: int, parent: int = ROOT,
            q: torch.Tensor | DraftedToken | None = None) -> int:
        """Add a node under ``parent`` (a node index or :data:`ROOT`); its index."""
        if not (parent == ROOT or 0 <= parent < len(self.nodes)):
            raise ValueError(f"parent {parent} is not ROOT ({ROOT}) or a node already in the tree "
                             f"(0 .. {len(self.nodes) - 1})")
        token = int(token)
        if token < 0 or (self.vocab is not None and token >= self.vocab):
            raise ValueError(f"token {token} is outside the vocabulary of {self.vocab}")
        if isinstance(q, DraftedToken):
            if self.vocab is None:
                raise ValueError("converting an engine record to q needs the tree's vocab")
            q = draft_distribution(q, self.vocab)
        elif q is not None:
            q = torch.as_tensor(q, dtype=torch.float64)
            if q.dim() != 1 or (self.vocab is not None and q.shape[0] != self.vocab):
                raise ValueError(f"q must be one row of {self.vocab or 'V'} probabilities, got shape "
                                 f"{tuple(q.shape)}")
        depth = 1 if parent == ROOT else self.nodes[parent].depth + 1
        self.nodes.append(TreeNode(token, parent, depth, q))
        index = len(self.nodes) - 1
        self._children[parent].append(index)
        self._children[index] = []
        return index

    @classmethod
    def from_parents(cls, tokens: list[int], parents: list[int], q=None,
                     vocab: int | None = None) -> "DraftTree":
        """A tree from parallel lists: ``parents[i]`` is :data:`ROOT` or an index ``< i``;
        ``q`` is None or one q (row or ``DraftedToken``) per node."""
        if len(tokens) != len(parents) or (q is not None and len(q) != len(tokens)):
            raise ValueError("tokens, parents (and q) must have one entry per node")
        tree = cls(vocab)
        for i, (token, parent) in enumerate(zip(tokens, parents)):
            if parent >= i:
                raise ValueError(f"node {i}'s parent {parent} must come before it")
            tree.add(token, parent, None if q is None else q[i])
        return tree

    @classmethod
    def chain(cls, tokens: list[int], q=None, vocab: int | None = None) -> "DraftTree":
        """A chain as a tree (node i's parent is node i - 1)."""
        return cls.from_parents(tokens, [i - 1 for i in range(len(tokens))], q, vocab)

    # -- reading -------------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self.nodes)

    @property
    def tokens(self) -> list[int]:
        return [n.token for n in self.nodes]

    @property
    def parents(self) -> list[int]:
        return [n.parent for n in self.nodes]

    @property
    def depths(self) -> list[int]:
        return [n.depth for n in self.nodes]

    @property
    def depth(self) -> int:
        """The deepest node's depth (0 for an empty tree)."""
        return max(self.depths, default=0)

    def q(self, index: int) -> torch.Tensor | None:
        return self.nodes[index].q

    def children(self, index: int = ROOT) -> list[int]:
        """The children of ``index`` (a node or :data:`ROOT`), in the order they were added."""
        return list(self._children[index])

    def leaves(self) -> list[int]:
        return [i for i in range(len(self)) if not self._children[i]]

    def path(self, index: int) -> list[int]:
        """Node indices from the root's child down to ``index`` (``[]`` for :data:`ROOT`)."""
        out = []
        while index != ROOT:
            out.append(index)
            index = self.nodes[index].parent
        return out[::-1]

    def path_tokens(self, index: int) -> list[int]:
        return [self.nodes[i].token for i in self.path(index)]

    def is_path(self, nodes: list[int]) -> bool:
        """Whether ``nodes`` goes down from the root one parent at a time."""
        parent = ROOT
        for i in nodes:
            if not 0 <= i < len(self) or self.nodes[i].parent != parent:
                return False
            parent = i
        return True

    # -- masks and positions -------------------------------------------------------------
    def ancestor_mask(self) -> torch.Tensor:
        """Bool ``[n, n]``: ``[i, j]`` is True when node j is node i or one of its ancestors."""
        n = len(self)
        mask = torch.zeros(n, n, dtype=torch.bool)
        for i, node in enumerate(self.nodes):      # parents come first: their rows are done
            if node.parent != ROOT:
                mask[i] = mask[node.parent]
            mask[i, i] = True
        return mask

    def attention_mask(self) -> torch.Tensor:
        """Bool ``[1 + n, 1 + n]`` over ``[pending] + nodes``: who attends to whom among the
        tokens of this round (every row also attends to the whole committed cache)."""
        n = len(self)
        mask = torch.zeros(n + 1, n + 1, dtype=torch.bool)
        mask[:, 0] = True
        mask[1:, 1:] = self.ancestor_mask()
        return mask

    def position_ids(self, start: int) -> torch.Tensor:
        """Long ``[1 + n]``: the pending token at ``start`` (the committed length before it),
        each node at ``start + depth``."""
        return torch.tensor([start] + [start + d for d in self.depths], dtype=torch.long)

    # -- TreeSort ------------------------------------------------------------------------
    def tree_sort(self) -> TreeSort:
        """Depth-first preorder cut into chains (module docstring, "TreeSort")."""
        order: list[int] = []
        stack = self.children(ROOT)[::-1]
        while stack:
            i = stack.pop()
            order.append(i)
            stack.extend(self._children[i][::-1])
        blocks, start = [], 0
        for k in range(1, len(order)):
            if self.nodes[order[k]].parent != order[k - 1]:
                blocks.append((start, k))
                start = k
        if order:
            blocks.append((start, len(order)))
        return TreeSort(order, blocks)

    def permute(self, order: list[int]) -> "DraftTree":
        """The same tree with node ``order[k]`` at index ``k``; ``order`` must put parents
        before children (a :meth:`tree_sort` order does, and keeps siblings' order)."""
        if sorted(order) != list(range(len(self))):
            raise ValueError("order must be a permutation of the node indices")
        where = {old: new for new, old in enumerate(order)}
        tree = DraftTree(self.vocab)
        for old in order:
            node = self.nodes[old]
            parent = ROOT if node.parent == ROOT else where[node.parent]
            if parent >= len(tree):
                raise ValueError(f"order puts node {old} before its parent {node.parent}")
            tree.add(node.token, parent, node.q)
        return tree

    def __repr__(self) -> str:
        return f"DraftTree(tokens={self.tokens}, parents={self.parents})"


def most_probable_nodes(parents: list[int], probs: list[float], budget: int) -> list[int]:
    """The ``budget`` nodes whose root-to-node paths are the most probable, ascending.

    A path's probability is the product of its tokens' draft probabilities ``probs``
    (each in ``0 … 1``); ties go to the lower index. ``parents`` as in
    :meth:`DraftTree.from_parents`. What comes back is ancestor-closed: a node's path is
    never more probable than its parent's, and the parent's index is the lower, so a node
    is chosen only after its parent. This is the re-ranking of EAGLE-2: draft a tree
    wider and deeper than the target will verify, then verify the ``budget`` nodes most
    likely to be accepted — a deep chain where the draft is sure, branches where it is not.
    Greedy decoding only: which siblings survive depends on their tokens, which breaks
    the i.i.d. draws lossless tree sampling needs.
    """
    log_path: list[float] = []
    for i, (parent, p) in enumerate(zip(parents, probs)):
        if parent >= i:
            raise ValueError(f"node {i}'s parent {parent} must come before it")
        here = math.log(p) if p > 0 else -math.inf
        log_path.append(here + (log_path[parent] if parent != ROOT else 0.0))
    ranked = sorted(range(len(parents)), key=lambda i: (-log_path[i], i))
    return sorted(ranked[:max(budget, 0)])


def descendants(parents: list[int], root: int = ROOT) -> list[int]:
    """The nodes below ``root`` (a node index or :data:`ROOT`: all of them), ascending."""
    inside, out = {root}, []
    for i, parent in enumerate(parents):
        if parent in inside:
            inside.add(i)
            out.append(i)
    return out


def subtree(parents: list[int], keep: list[int], root: int = ROOT) -> list[int]:
    """The parents of the nodes ``keep`` (ascending indices into ``parents``, closed under
    ancestors up to ``root``) renumbered as a tree of their own: ``keep[i]`` becomes node
    ``i`` and ``root``'s children the new tree's level 1. ``ValueError`` when a kept node's
    parent is neither kept nor ``root``."""
    where = {old: new for new, old in enumerate(keep)}
    out = []
    for old in keep:
        parent = parents[old]
        if parent == root:
            out.append(ROOT)
        elif parent in where:
            out.append(where[parent])
        else:
            raise ValueError(f"node {old} is kept without its parent {parent}")
    return out
