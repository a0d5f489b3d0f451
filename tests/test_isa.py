import random

import pytest

from dfvg_hw.spec.isa import (FIELDS, AsmError, Cond, Flag, IllegalInstruction, Instruction,
                         MatmulMode, Op, _USES, assemble, decode, disassemble, encode,
                         from_bytes, to_bytes)


def random_instruction(rng: random.Random) -> Instruction:
    op = rng.choice(list(Op))
    used, legal = _USES[op]
    widths = {name: width for name, _, width in FIELDS}
    values = {}
    for name in ("rows", "dst", "src", "n", "k", "addr"):
        if name in used:
            values[name] = rng.randrange(1 if name == "rows" else 0, 1 << widths[name])
    if op == Op.MATMUL:
        values["flags"] = ((rng.choice(list(MatmulMode)) << 1) | rng.choice([0, Flag.LREL])
                           | rng.choice([0, Flag.BIAS]) | rng.choice([0, Flag.WIDE])
                           | rng.choice([0, Flag.BLOCKS]))
    elif op == Op.BRANCH:
        values["flags"] = rng.choice(list(Cond))
    elif "flags" in used:
        values["flags"] = rng.choice([0, int(legal)])
    return Instruction(op, **values)


def test_encode_decode_round_trip():
    rng = random.Random(0)
    for _ in range(5000):
        ins = random_instruction(rng)
        word = encode(ins)
        assert 0 <= word < 1 << 128
        assert decode(word) == ins


def test_assemble_disassemble_round_trip():
    rng = random.Random(1)
    words = [encode(random_instruction(rng)) for _ in range(500)]
    text = disassemble(words)
    assert assemble(text) == words
    assert assemble(disassemble(words, addresses=True)) == words
    assert from_bytes(to_bytes(words)) == words


def test_assembler_labels_and_comments():
    words = assemble("""
    top:  embed rows=1, dst=0, n=32, addr=0x100   ; the token's row
          branch cond=no_sample, n=skip
          sample n=256
    skip: next n=top
          halt
    """)
    assert decode(words[1]) == Instruction(Op.BRANCH, flags=Cond.NO_SAMPLE, n=3)
    assert decode(words[3]) == Instruction(Op.NEXT, n=0)


@pytest.mark.parametrize("word, field", [
    (0x3F, "opcode"),                                              # no such opcode
    (encode(Instruction(Op.HALT)) | (0x5A << 24), "reserved"),
    (encode(Instruction(Op.HALT)) | (7 << 64), "n"),              # HALT does not use n
    (encode(Instruction(Op.EMBED, rows=1, n=4)) | (1 << 80), "k"),
    (encode(Instruction(Op.EMBED, rows=1, n=4)) & ~(0xFF << 16), "rows"),  # rows = 0
    (encode(Instruction(Op.ACTMUL, rows=1, n=4)) | (0x02 << 8), "flags"),  # MATMUL's mode bit
    (encode(Instruction(Op.ATTN, rows=1, n=4, k=4)) | (Flag.OUT16 << 8), "flags"),  # MATMUL's
    (encode(Instruction(Op.RMSNORM, rows=1, n=4)) | (Flag.IN16 << 8), "flags"),  # ACTMUL's, ATTN's
    (encode(Instruction(Op.ROPE, rows=1, n=4, k=4)) | (Flag.LREL << 8), "flags"),  # one table for all layers
    (encode(Instruction(Op.RMSNORM, rows=1, n=4)) | (Flag.ROWEXP << 8), "flags"),  # ACTMUL's
    (encode(Instruction(Op.EMBED, rows=1, n=4)) | (Flag.UNGATED << 8), "flags"),  # ACTMUL's
    (encode(Instruction(Op.RMSNORM, rows=1, n=4)) | (0x80 << 8), "flags"),   # undefined bit
    (encode(Instruction(Op.BRANCH, n=1)) | (9 << 8), "flags"),     # undefined condition
])
def test_illegal_words_name_the_field(word, field):
    with pytest.raises(IllegalInstruction) as info:
        decode(word)
    assert info.value.field == field
    assert f"field '{field}'" in str(info.value)


def test_assembler_errors_give_the_line():
    with pytest.raises(AsmError, match="line 2: unknown mnemonic 'frobnicate'"):
        assemble("halt\nfrobnicate n=1\n")
    with pytest.raises(AsmError, match="line 1: .*field 'k'"):
        assemble("embed rows=1, n=4, k=2")


def test_blocks_is_a_matmul_flag():
    """BLOCKS is bit 7 of a MATMUL's flags, written ``blocks``; on any other opcode the
    bit stays undefined."""
    word = assemble("matmul mode=resadd, rows=1, dst=2, src=3, n=64, k=64, addr=0x100, wide, blocks")[0]
    ins = decode(word)
    assert ins.blocks and ins.wide and ins.flags == Flag.BLOCKS | Flag.WIDE | MatmulMode.RESADD << 1
    assert disassemble([word]).strip().endswith("wide, blocks")
    assert not decode(encode(Instruction(Op.MATMUL, rows=1, n=4, k=4))).blocks
    for op in (Op.RMSNORM, Op.ACTMUL, Op.ATTN):
        with pytest.raises(IllegalInstruction) as e:
            decode(encode(Instruction(op, rows=1, n=16)) | (int(Flag.BLOCKS) << 8))
        assert e.value.field == "flags"


def test_the_documented_demo_program_is_what_the_compiler_emits(demo_compiled):
    """docs/isa.md §10 lists the demo draft's program: it is assembled here (labels and
    comments included) and must equal the compiler's words, so the listing cannot go stale
    when the compiler or the line width changes."""
    from pathlib import Path
    doc = (Path(__file__).parents[1] / "docs" / "isa.md").read_text()
    section = doc[doc.index("## 10. Assembler syntax"):]
    listing = section.split("```\n", 2)[1]
    assert assemble(listing) == demo_compiled.program
