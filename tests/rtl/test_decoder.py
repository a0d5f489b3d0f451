"""Instruction decoder RTL against dfvg_hw.spec.isa.decode: legality and the named field."""

from __future__ import annotations

import numpy as np

from dfvg_hw.decoder import IllegalField, InstructionDecoder
from dfvg_hw.spec.isa import FIELDS, Cond, IllegalInstruction, Instruction, MatmulMode, Op, decode, encode
from dfvg_hw.spec.isa import opcode_rules
from dfvg_hw.verilog import to_verilog
from sim.lint import verilator_lint
from sim.testbench import run_simulation

WIDTH = {name: width for name, _, width in FIELDS}
LSB = {name: lsb for name, lsb, _ in FIELDS}


def random_legal(rng) -> int:
    """A random legal word: every used field random, flags a legal combination."""
    op = Op(int(rng.choice([int(o) for o in Op])))
    used, legal_flags, needs_rows = opcode_rules(op)
    values = {}
    for name in used - {"flags"}:
        values[name] = int(rng.integers(0, 1 << WIDTH[name]))
    if needs_rows and values.get("rows", 0) == 0:
        values["rows"] = 1
    if "flags" in used:
        if op == Op.BRANCH:
            values["flags"] = int(rng.choice([int(c) for c in Cond]))
        else:
            flags = int(rng.integers(0, 256)) & legal_flags
            if op == Op.MATMUL and ((flags >> 1) & 3) not in [int(m) for m in MatmulMode]:
                flags &= ~0x04
            values["flags"] = flags
    return encode(Instruction(op, **values))


def mutate(rng, word: int) -> int:
    """Flip a few bits of one field, or set a single high/low bit: near-legal words."""
    name = str(rng.choice([n for n, _, _ in FIELDS]))
    bits = rng.integers(0, WIDTH[name], int(rng.integers(1, 3)))
    for b in bits:
        word ^= 1 << (LSB[name] + int(b))
    return word


def reference(word: int):
    try:
        decode(word)
    except IllegalInstruction as exc:
        return 1, IllegalField[exc.field.upper()]
    return 0, IllegalField.NONE


def test_decoder_matches_isa_decode():
    rng = np.random.default_rng(0)
    words = [random_legal(rng) for _ in range(600)]
    words += [mutate(rng, random_legal(rng)) for _ in range(900)]
    words += [int.from_bytes(rng.bytes(16), "little") for _ in range(100)]
    words += [0, (1 << 128) - 1, int(Op.HALT), int(Op.MATMUL) | 0x06 << 8 | 1 << 16,   # mode 3 (INT32)
              int(Op.BRANCH) | 2 << 8, int(Op.EMBED),                                 # bad cond, rows 0
              int(Op.MATMUL) | 0x06 << 8, int(Op.RMSNORM) | 0x80 << 8,               # flags before rows
              int(Op.HALT) | 1 << 24 | 1 << 8, int(Op.NOP) | 1 << 120 | 1 << 40,     # reserved; first unused
              0xFF | 1 << 24]                                                         # opcode first
    dut = InstructionDecoder()
    got = []

    async def tb(ctx):
        for w in words:
            ctx.set(dut.word, w)
            got.append((ctx.get(dut.illegal), ctx.get(dut.field), int(ctx.get(dut.fields.as_value()))))

    run_simulation(dut, tb)
    expected = [reference(w) for w in words]
    by_field = {}
    for w, (ill, field, value), (e_ill, e_field) in zip(words, got, expected):
        assert (ill, field) == (e_ill, e_field), f"word 0x{w:032x}: got {field}, decode says {e_field}"
        assert value == w                      # the fields are the word, bit for bit
        by_field[e_field] = by_field.get(e_field, 0) + 1
    # every outcome was exercised, legal words included
    assert set(by_field) == set(IllegalField), sorted(set(IllegalField) - set(by_field))
    assert by_field[IllegalField.NONE] >= 600


def test_every_isa_field_has_a_name():
    assert [f.name.lower() for f in IllegalField][1:] == [name for name, _, _ in FIELDS]


def test_lint_clean():
    clean, output = verilator_lint(to_verilog(InstructionDecoder(), "decoder"), "decoder")
    assert clean, output
