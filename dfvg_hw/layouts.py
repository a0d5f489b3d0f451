"""Amaranth layouts derived from the contract's field tables (:mod:`dfvg_hw.spec`).

A packed field of the contract is declared once, as a table in ``spec``; the RTL views it
through the layouts here instead of slicing bits by hand.
"""

from __future__ import annotations

from amaranth import unsigned
from amaranth.lib import data

from dfvg_hw.spec.descriptors import (REQUEST_FIELDS, REQUEST_FLAG_FIELDS, REQUEST_HEADER_WORDS,
                                      RESULT_FIELDS, RESULT_HEADER_WORDS)
from dfvg_hw.spec.isa import FLAG_FIELDS

__all__ = ["InstructionFlags", "flags_view", "RequestFlags", "RequestHeader", "ResultHeader", "CompactJob"]


def _packed(fields, total_bits: int, nested: dict | None = None) -> dict:
    """Struct members of a (name, [word,] lsb, width) table whose fields tile ``total_bits``
    bits in order, as a :class:`~amaranth.lib.data.StructLayout` packs them."""
    members, offset = {}, 0
    for name, *place, width in fields:
        lsb = place[-1] + (32 * place[0] if len(place) == 2 else 0)
        assert lsb == offset, f"field {name} at bit {lsb}, expected {offset}"
        members[name] = (nested or {}).get(name, unsigned(width))
        offset += width
    assert offset == total_bits, (offset, total_bits)
    return members


class InstructionFlags(data.FlexibleLayout):
    """A unit instruction's ``flags`` field, its sub-fields from
    :data:`~dfvg_hw.spec.isa.FLAG_FIELDS` (``layer_relative``, ``mode``, ``wide``, …); a
    bit that opcodes read differently has a field per name (bit 5: ``position``,
    ``row_exponent``)."""

    def __init__(self):
        super().__init__(8, {name: data.Field(unsigned(width), lsb) for name, lsb, width in FLAG_FIELDS})


def flags_view(flags) -> data.View:
    """An 8-bit ``flags`` value (an instruction's or a job's) viewed as :class:`InstructionFlags`."""
    return data.View(InstructionFlags(), flags)


class RequestFlags(data.StructLayout):
    """The request's ``flags`` word, from :data:`~dfvg_hw.spec.descriptors.REQUEST_FLAG_FIELDS`
    (``sample``, ``reserved``)."""

    def __init__(self):
        super().__init__(_packed(REQUEST_FLAG_FIELDS, 32))


class RequestHeader(data.StructLayout):
    """The request descriptor's header (``REQUEST_HEADER_WORDS`` words, little-endian: word
    ``i`` is bits ``32i..32i+31``), its fields from
    :data:`~dfvg_hw.spec.descriptors.REQUEST_FIELDS`; ``flags`` is :class:`RequestFlags`."""

    def __init__(self):
        super().__init__(_packed(REQUEST_FIELDS, 32 * REQUEST_HEADER_WORDS,
                                 {"flags": RequestFlags()}))


class ResultHeader(data.StructLayout):
    """The result descriptor's header (``RESULT_HEADER_WORDS`` words), its fields from
    :data:`~dfvg_hw.spec.descriptors.RESULT_FIELDS`."""

    def __init__(self):
        super().__init__(_packed(RESULT_FIELDS, 32 * RESULT_HEADER_WORDS))


class CompactJob(data.StructLayout):
    """A request's compaction (isa.md §9.3), from its header: for ``d < count`` and every
    slot ``slot_base … slot_base + slots − 1``, KV position ``base + d·width + rows[d]``
    (``rows`` 4 bits a level) is copied to ``base + d``, in order of ``d``."""

    def __init__(self):
        super().__init__({"base": unsigned(16), "width": unsigned(8), "count": unsigned(8),
                          "rows": unsigned(64), "slot_base": unsigned(16), "slots": unsigned(16)})
