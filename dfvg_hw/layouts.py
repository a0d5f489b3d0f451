"""Amaranth layouts derived from the contract's field tables (:mod:`dfvg_hw.spec`).

A packed field of the contract is declared once, as a table in ``spec``; the RTL views it
through the layouts here instead of slicing bits by hand.
"""

from __future__ import annotations

from amaranth import unsigned
from amaranth.lib import data

from dfvg_hw.spec.isa import FLAG_FIELDS

__all__ = ["InstructionFlags", "flags_view"]


class InstructionFlags(data.StructLayout):
    """A unit instruction's ``flags`` field, its sub-fields from
    :data:`~dfvg_hw.spec.isa.FLAG_FIELDS` (``layer_relative``, ``mode``, ``wide``)."""

    def __init__(self):
        assert [lsb for _, lsb, _ in FLAG_FIELDS] == [sum(w for _, _, w in FLAG_FIELDS[:i])
                                                     for i in range(len(FLAG_FIELDS))]
        super().__init__({name: unsigned(width) for name, _, width in FLAG_FIELDS})


def flags_view(flags) -> data.View:
    """An 8-bit ``flags`` value (an instruction's or a job's) viewed as :class:`InstructionFlags`."""
    return data.View(InstructionFlags(), flags)
