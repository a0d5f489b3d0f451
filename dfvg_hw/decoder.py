"""Instruction decoder: a 128-bit instruction word → its fields, or the illegal field.

The legality rules are not written here a second time: the masks come from
:mod:`dfvg_hw.spec.isa` (``FIELDS`` and each opcode's used fields and legal flags), so the
decoder rejects exactly the words :func:`dfvg_hw.spec.isa.decode` rejects and names the same
field, in the same order of precedence:

1. ``opcode`` — not an opcode;
2. ``reserved`` — bits 24–31 not zero;
3. the first field, in bit order, that the opcode does not use but is not zero;
4. ``flags`` — a flag bit the opcode does not define, or a BRANCH condition that does not
   exist (every MATMUL mode is defined: mode 3 is INT32);
5. ``rows`` — zero for an opcode that processes rows.

The controller latches :attr:`InstructionDecoder.illegal` and :attr:`field` into the
ERROR and ERROR_PC registers (ILLEGAL_INSTRUCTION) and stops.
"""

from __future__ import annotations

from amaranth import Module, Mux
from amaranth.lib import data, enum, wiring
from amaranth.lib.wiring import In, Out

from dfvg_hw.layouts import flags_view
from dfvg_hw.spec.isa import FIELDS, INSTRUCTION_BITS, Cond, MatmulMode, Op, opcode_rules

__all__ = ["InstructionDecoder", "InstructionFields", "IllegalField"]


class InstructionFields(data.StructLayout):
    """The fields of an instruction word, at their positions in the word (``isa.FIELDS``),
    so a 128-bit word can be viewed as this layout directly."""

    def __init__(self):
        super().__init__({name: width for name, _, width in FIELDS})


class IllegalField(enum.Enum, shape=4):
    """Which field made a word illegal (``NONE`` for a legal word); one member per
    ``isa.FIELDS`` entry, named as ``IllegalInstruction.field`` names it."""
    NONE = 0
    OPCODE = 1
    FLAGS = 2
    ROWS = 3
    RESERVED = 4
    DST = 5
    SRC = 6
    N = 7
    K = 8
    ADDR = 9


def _order():
    """The fields checked for 'unused but not zero', in bit order (opcode and reserved
    are checked before them)."""
    return [name for name, _, _ in FIELDS if name not in ("opcode", "reserved")]


class InstructionDecoder(wiring.Component):
    """Combinational decoder and legality check, bit-exact with :func:`dfvg_hw.spec.isa.decode`.

    Members
    -------
    word : In(128)
        The instruction word (bit 0 = opcode bit 0, as in the program image).
    fields : Out(InstructionFields())
        The word's fields (valid whatever ``illegal`` says).
    illegal : Out(1)
        The word is not an instruction the engine executes.
    field : Out(IllegalField)
        The field :func:`~dfvg_hw.spec.isa.decode` names in its ``IllegalInstruction``;
        ``NONE`` when the word is legal.
    """

    def __init__(self):
        super().__init__(wiring.Signature({
            "word": In(INSTRUCTION_BITS),
            "fields": Out(InstructionFields()),
            "illegal": Out(1),
            "field": Out(IllegalField),
        }))

    def elaborate(self, platform):
        m = Module()
        f = self.fields
        m.d.comb += f.eq(self.word)
        opcode = f.opcode

        # Per-opcode facts from the ISA tables, as constants selected by the opcode.
        known = 0
        unused_nonzero = {name: 0 for name in _order()}     # name → OR of (op match & value != 0)
        bad_flags = 0
        rows_zero = 0
        for op in Op:
            used, legal_flags, needs_rows = opcode_rules(op)
            is_op = opcode == op
            known = known | is_op
            for name in _order():
                if name not in used:
                    unused_nonzero[name] = unused_nonzero[name] | (is_op & (getattr(f, name) != 0))
            flag_bad = (f.flags & (~legal_flags & 0xFF)) != 0
            if op == Op.MATMUL:
                mode = flags_view(f.flags).mode
                flag_bad = flag_bad | ~_member_of(mode, MatmulMode)
            if op == Op.BRANCH:
                flag_bad = flag_bad | ~_member_of(f.flags, Cond)
            bad_flags = bad_flags | (is_op & flag_bad)
            if needs_rows:
                rows_zero = rows_zero | (is_op & (f.rows == 0))

        # Priority encoder in decode()'s order: the first true check names the field.
        checks = ([(~known, IllegalField.OPCODE), (f.reserved != 0, IllegalField.RESERVED)]
                  + [(unused_nonzero[name], IllegalField[name.upper()]) for name in _order()]
                  + [(bad_flags, IllegalField.FLAGS), (rows_zero, IllegalField.ROWS)])
        field = IllegalField.NONE
        for cond, name in reversed(checks):
            field = Mux(cond, name, field)
        m.d.comb += [self.field.eq(field), self.illegal.eq(self.field != IllegalField.NONE)]
        return m


def _member_of(value, enum_cls):
    """``value`` is one of ``enum_cls``'s values (an expression)."""
    hit = 0
    for member in enum_cls:
        hit = hit | (value == int(member))
    return hit
