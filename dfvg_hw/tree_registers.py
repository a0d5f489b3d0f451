"""The controller's tree registers (docs/isa.md §9.2): what a tree request adds to the
controller's state, the RTL twin of :class:`sim.tree_state.TreeState` less the path
scores (the sampler keeps those).

For the level a tree forward feeds, each row's token (EMBED's) and its path: the row of
its ancestor at every level, from level 1 down to itself. From them and ``P0`` (the
position after the request's last input) come the KV positions of tree drafting:

* node ``(d, r)``'s storage ``S(d, r) = P0 + (d − 1)·W + r``, where KVAPPEND row ``r``
  writes (``storage``), and whether the level's last node lies past the KV buffer
  (``level_overflow``: KVAPPEND and ATTN fault ``KV_OVERFLOW`` before any row);
* ATTN row ``r``'s path port: entry ``j`` (level ``j + 1``) of its path is at KV position
  ``P0 + j·W + a(j + 1)`` (``path_pos`` answers ``path_index`` in the same cycle).

A SAMPLE makes the next level: the sampler sends one
:class:`~dfvg_hw.tree_expander.TreeNode` per new row ``r``
(its source row ``s`` and its token), and row ``r``'s path becomes source ``s``'s path
with entry ``expand_level`` (the level being fed, 0 at the root) set to ``r``. The new
paths are built beside the old ones, since a later node may still read the source that an
earlier one replaces, and take over on ``commit``.
"""

from __future__ import annotations

from amaranth import Module, Signal, unsigned
from amaranth.lib import data, stream, wiring
from amaranth.lib.wiring import In, Out

from dfvg_hw.spec.config import EngineConfig
from dfvg_hw.spec.descriptors import MAX_DRAFT
from dfvg_hw.tree_expander import TreeNode

__all__ = ["TreeRegisters", "POSITION_BITS"]

#: Bits of a KV position the registers compute in: a ``P0`` or a storage position past
#: 16 bits only has to compare as past the buffer (``kv_positions`` ≤ 2^16).
POSITION_BITS = 17


class TreeRegisters(wiring.Component):
    """Tokens and paths of the level being fed, and the KV positions they give (see the
    module docstring).

    Parameters
    ----------
    config : EngineConfig
        ``rows`` (the widest tree) and ``kv_positions``.

    Members
    -------
    start : In(1)
        A tree request starts: ``width`` and ``base`` are taken.
    width : In(8)
        The request's ``W``.
    base : In(POSITION_BITS)
        Its ``P0`` (saturated: a value past 16 bits only needs to overflow).
    p0 : Out(POSITION_BITS)
        The running request's ``P0``: ATTN's committed context in a tree forward.
    row : In(range(rows))
        The row a tree forward's job runs: ``token``, ``storage`` and the path port are
        that row's.
    level : In(range(MAX_DRAFT + 1))
        TREE_LEVEL ``d`` of the forward (≥ 1 for ``storage`` and ``level_overflow``).
    token : Out(16)
        Row ``row``'s token.
    storage : Out(POSITION_BITS)
        ``S(level, row)``.
    level_overflow : Out(1)
        ``S(level, W − 1) ≥ kv_positions``.
    path_index : In(range(MAX_DRAFT))
    path_pos : Out(16)
        The KV position of entry ``path_index`` of row ``row``'s path (combinational).
    expand : In(stream.Signature(TreeNode(rows)))
        The nodes of the level a SAMPLE makes (always ready).
    expand_level : In(range(MAX_DRAFT + 1))
        The level fed when they are made (0: the root's children).
    commit : In(1)
        The new level is complete: its paths replace the old.
    """

    def __init__(self, config: EngineConfig):
        self.config = config
        rows = config.rows
        super().__init__(wiring.Signature({
            "start": In(1),
            "width": In(8),
            "base": In(POSITION_BITS),
            "p0": Out(POSITION_BITS),
            "row": In(range(rows)),
            "level": In(range(MAX_DRAFT + 1)),
            "token": Out(16),
            "storage": Out(POSITION_BITS),
            "level_overflow": Out(1),
            "path_index": In(range(MAX_DRAFT)),
            "path_pos": Out(16),
            "expand": In(stream.Signature(TreeNode(rows))),
            "expand_level": In(range(MAX_DRAFT + 1)),
            "commit": In(1),
        }))

    def elaborate(self, platform):
        m = Module()
        c = self.config
        row_shape = TreeNode(c.rows)["row"].shape
        # paths[r][j]: the row of row r's ancestor at level j + 1
        path_layout = data.ArrayLayout(data.ArrayLayout(row_shape, MAX_DRAFT), c.rows)
        paths, new_paths = Signal(path_layout), Signal(path_layout)
        tokens = Signal(data.ArrayLayout(unsigned(16), c.rows))
        width, base = Signal(8), Signal(POSITION_BITS)

        with m.If(self.start):
            m.d.sync += [width.eq(self.width), base.eq(self.base)]

        m.d.comb += [
            self.p0.eq(base),
            self.token.eq(tokens[self.row]),
            self.storage.eq(base + (self.level - 1) * width + self.row),
            self.level_overflow.eq(base + self.level * width > c.kv_positions),
            self.path_pos.eq(base + self.path_index * width + paths[self.row][self.path_index]),
        ]

        node = self.expand.payload
        m.d.comb += self.expand.ready.eq(1)
        with m.If(self.expand.valid):
            m.d.sync += [new_paths[node.row].eq(paths[node.source]),
                         new_paths[node.row][self.expand_level].eq(node.row),
                         tokens[node.row].eq(node.token)]
        with m.If(self.commit):
            m.d.sync += paths.eq(new_paths)
        return m
