"""Instruction set of the draft engine: encoding, decoding, assembler, disassembler.

Every instruction is one 128-bit word with the same field layout (see ``docs/isa.md``)::

    bits    field   width  meaning
    0-7     opcode    8    operation
    8-15    flags     8    per-opcode modifiers (layer-relative addressing, output mode)
    16-23   rows      8    draft rows processed at once (1..M); 0 where unused
    24-31   (zero)    8    reserved, must be 0
    32-47   dst      16    VMEM destination, in lines (vmem_line_bytes, docs/isa.md §1.3)
    48-63   src      16    VMEM source, in lines (vmem_line_bytes, docs/isa.md §1.3)
    64-79   n        16    element / channel / head count, loop count or branch target
    80-95   k        16    reduction length or head dimension
    96-127  addr     32    device-memory byte offset from the image base

A field an opcode does not use must be zero; :func:`decode` rejects anything else with
an :class:`IllegalInstruction` that names the field, exactly as the controller sets the
ILLEGAL_INSTRUCTION error.
"""

from __future__ import annotations

import enum
import re
from dataclasses import dataclass, fields

__all__ = [
    "Op", "CONTROL_OPS", "Flag", "MatmulMode", "Cond", "Instruction", "IllegalInstruction", "AsmError",
    "output_element_bytes", "matmul_output_bytes", "actmul_source_bytes",
    "FIELDS", "FLAG_FIELDS", "flag_field", "INSTRUCTION_BITS", "INSTRUCTION_BYTES",
    "encode", "decode", "assemble", "disassemble", "to_bytes", "from_bytes", "opcode_rules",
    "ACTMUL_SEGMENTS",
]

INSTRUCTION_BITS = 128

#: The most channel segments one ACTMUL takes (its ``k``; 0 and 1 are one segment): each
#: has its own parameter block and table, all held at once in the unit (docs/isa.md §3.8).
#: More faults ``PROGRAM`` when the instruction runs.
ACTMUL_SEGMENTS = 8

INSTRUCTION_BYTES = 16

#: (name, lsb, width) of every field, in bit order.
FIELDS: tuple[tuple[str, int, int], ...] = (
    ("opcode", 0, 8), ("flags", 8, 8), ("rows", 16, 8), ("reserved", 24, 8),
    ("dst", 32, 16), ("src", 48, 16), ("n", 64, 16), ("k", 80, 16), ("addr", 96, 32),
)
_FIELD = {name: (lsb, width) for name, lsb, width in FIELDS}


class Op(enum.IntEnum):
    """Opcodes. See docs/isa.md for exact semantics."""
    NOP = 0x00
    HALT = 0x01
    LOOP = 0x02      # n = trip count, addr = LSTRIDE; LAYER := 0; body runs until ENDLOOP
    ENDLOOP = 0x03   # LAYER += 1; back to the body while LAYER < count
    BRANCH = 0x04    # if cond(flags): pc := n
    NEXT = 0x05      # end of one forward step: POS += 1; next token; pc := n or fall through
    EMBED = 0x10     # dst(int32)[n] := table(addr)[TOKEN], or [POS] with POSITION
    RMSNORM = 0x11   # dst(int8)[k·n] := rmsnorm of each of k segments of src(int32)[k·n]; params at addr
    MATMUL = 0x12    # dst[n] := W(addr)[n, k] · src(int8)[k], output per flags.mode
    ROPE = 0x13      # dst(int8)[n heads × k] := rope(src; table(addr)[POS])
    KVAPPEND = 0x14  # KV[LAYER][h][POS] := src (K: n heads × k), then V right after K
    ATTN = 0x15      # dst(int8)[n heads × k] := attention(src q; KV[LAYER][:, 0..POS])
    ACTMUL = 0x16    # dst(int8)[n] := act(src[n]) · src[n + n bytes] (UNGATED: act(src[n])); k segments' params at addr
    SAMPLE = 0x17    # token sampler over the n logits of the last LOGITS matmul


#: Control instructions: they only move the controller's registers (pc, loop, position,
#: token) and retire at once; every other opcode runs on a unit. The functional model,
#: the cycle model's walk and the RTL controller's decode all test membership here.
CONTROL_OPS = frozenset({Op.HALT, Op.LOOP, Op.ENDLOOP, Op.BRANCH, Op.NEXT})


#: (name, lsb, width) of the sub-fields of a unit instruction's ``flags`` field, in bit
#: order (BRANCH reads the whole field as its :class:`Cond`). :class:`Flag`, the
#: :class:`Instruction` accessors and the RTL's ``InstructionFlags`` layout derive from it.
#: Bits 4–6 have a name per opcode that uses them: bit 4 MATMUL's ``bias`` and ACTMUL's and
#: ATTN's ``in16``, bit 5 EMBED's ``position`` and ACTMUL's and MATMUL's ``row_exponent``, bit 6
#: ACTMUL's ``ungated`` and MATMUL's ``out16``.
FLAG_FIELDS: tuple[tuple[str, int, int], ...] = (
    ("layer_relative", 0, 1), ("mode", 1, 2), ("wide", 3, 1), ("bias", 4, 1), ("in16", 4, 1),
    ("position", 5, 1), ("row_exponent", 5, 1), ("ungated", 6, 1), ("out16", 6, 1), ("blocks", 7, 1),
)
_FLAG_FIELD = {name: (lsb, width) for name, lsb, width in FLAG_FIELDS}
#: The opcodes that read each flag named per opcode (the bits 4–7 above): the same bit
#: under another name is another flag.
_FLAG_READERS: dict[str, frozenset] = {
    "bias": frozenset({Op.MATMUL}), "blocks": frozenset({Op.MATMUL}),
    "position": frozenset({Op.EMBED}), "row_exponent": frozenset({Op.MATMUL, Op.ACTMUL}),
    "ungated": frozenset({Op.ACTMUL}), "in16": frozenset({Op.ACTMUL, Op.ATTN}),
    "out16": frozenset({Op.MATMUL}),
}


def flag_field(flags: int, name: str) -> int:
    """The sub-field ``name`` of :data:`FLAG_FIELDS` in a ``flags`` value."""
    lsb, width = _FLAG_FIELD[name]
    return (flags >> lsb) & ((1 << width) - 1)


class Flag(enum.IntFlag):
    """Flag bits (the ``flags`` field), placed by :data:`FLAG_FIELDS`."""
    LREL = 1 << _FLAG_FIELD["layer_relative"][0]   #: address += LAYER · LSTRIDE (set by LOOP)
    MODE0 = 1 << _FLAG_FIELD["mode"][0]            #: MATMUL output mode (see MatmulMode)
    MODE1 = 2 << _FLAG_FIELD["mode"][0]
    #: Wide activations (int16): MATMUL reads an int16 src (the matrix unit takes it as
    #: two int8 digit rows sharing each weight tile); RMSNORM, ACTMUL and ATTN write an
    #: int16 dst with 8 more fractional bits; ROPE rotates int16 heads (src and dst);
    #: KVAPPEND reads int16 k and v, saturated to the KV cache's ``cfg.kv_bits``.
    WIDE = 1 << _FLAG_FIELD["wide"][0]
    #: MATMUL adds a per-output-channel int32 bias to the accumulator before requantising:
    #: the weight block holds a bias word beside each requant word (docs/isa.md §4.2).
    BIAS = 1 << _FLAG_FIELD["bias"][0]
    #: EMBED indexes its table by the position POS instead of the token: OPT's learned
    #: position embeddings (docs/isa.md §3.2).
    POSITION = 1 << _FLAG_FIELD["position"][0]
    #: ACTMUL without an up operand: ``h = act(gate)`` (an ungated MLP's ReLU or GELU).
    UNGATED = 1 << _FLAG_FIELD["ungated"][0]
    #: MATMUL with block-scaled weights: every (output channel, k-tile of ``reduce``
    #: inputs) has its own unsigned 16-bit multiplier, stored in the weight block's scale
    #: tiles (docs/isa.md §4.2, numerics.block_matmul).
    BLOCKS = 1 << _FLAG_FIELD["blocks"][0]
    #: Row exponents (docs/isa.md §3.4, §3.8). ACTMUL measures each row's exponent ``e_r``
    #: (numerics.act_row_exponent, two passes over the row), writes the row at it and
    #: keeps it in the engine's row exponent registers; MATMUL requantises input row ``r``
    #: with shift ``max(shift − e_r, 0)`` (numerics.row_shift). The same bit as POSITION,
    #: which only EMBED reads.
    ROWEXP = 1 << _FLAG_FIELD["row_exponent"][0]
    #: ACTMUL with int16 gate and up (docs/isa.md §3.8, numerics.act_mul_wide): the source
    #: row is ``[gate | up]`` of 2n int16 (UNGATED: n int16 gates), the table 128
    #: interpolated knots. ATTN with an int16 query (§3.7, numerics.attention_query: read
    #: as 11 bits over an int8 KV cache, 16 over a wider one). The same bit as BIAS, which
    #: only MATMUL reads.
    IN16 = 1 << _FLAG_FIELD["in16"][0]
    #: MATMUL in INT8 mode writes int16 (``requant(acc, 16)``, docs/isa.md §3.4): the rows
    #: an ACTMUL IN16 reads; the other modes ignore it. The same bit as UNGATED, which only
    #: ACTMUL reads.
    OUT16 = 1 << _FLAG_FIELD["out16"][0]


class MatmulMode(enum.IntEnum):
    """MATMUL output mode, the ``mode`` sub-field of ``flags``."""
    INT8 = 0       #: dst(int8) := requant(acc)
    RESADD = 1     #: dst(int32) := sat32(dst + requant32(acc)) — residual update
    LOGITS = 2     #: logits(int16, Q7.8) := requant16(acc) into the sampler's buffer
    INT32 = 3      #: dst(int32) := requant32(acc) — an int32 row for RMSNORM (QK-norm)


class Cond(enum.IntEnum):
    """BRANCH condition, the ``flags`` field."""
    ALWAYS = 0
    NO_SAMPLE = 1  #: this forward samples no token: an input other than the last, or all drafts made


#: Which fields each opcode uses (all others must be zero) and the legal flag bits.
_USES: dict[Op, tuple[frozenset[str], int]] = {
    Op.NOP: (frozenset(), 0),
    Op.HALT: (frozenset(), 0),
    Op.LOOP: (frozenset({"n", "addr"}), 0),
    Op.ENDLOOP: (frozenset(), 0),
    Op.BRANCH: (frozenset({"flags", "n"}), 0xFF),
    Op.NEXT: (frozenset({"n"}), 0),
    Op.EMBED: (frozenset({"flags", "rows", "dst", "n", "addr"}), Flag.POSITION),
    Op.RMSNORM: (frozenset({"flags", "rows", "dst", "src", "n", "k", "addr"}), Flag.LREL | Flag.WIDE),
    Op.MATMUL: (frozenset({"flags", "rows", "dst", "src", "n", "k", "addr"}),
                Flag.LREL | Flag.MODE0 | Flag.MODE1 | Flag.WIDE | Flag.BIAS | Flag.BLOCKS | Flag.ROWEXP
                | Flag.OUT16),
    Op.ROPE: (frozenset({"flags", "rows", "dst", "src", "n", "k", "addr"}), Flag.WIDE),
    Op.KVAPPEND: (frozenset({"flags", "rows", "src", "n", "k"}), Flag.WIDE),
    Op.ATTN: (frozenset({"flags", "rows", "dst", "src", "n", "k", "addr"}), Flag.LREL | Flag.WIDE | Flag.IN16),
    Op.ACTMUL: (frozenset({"flags", "rows", "dst", "src", "n", "k", "addr"}),
                Flag.LREL | Flag.WIDE | Flag.UNGATED | Flag.ROWEXP | Flag.IN16),
    Op.SAMPLE: (frozenset({"n"}), 0),
}
#: Opcodes that process ``rows`` rows; rows must be ≥ 1 for them.
_ROW_OPS = frozenset(op for op, (used, _) in _USES.items() if "rows" in used)


def opcode_rules(op: Op) -> tuple[frozenset[str], int, bool]:
    """What makes an instruction with opcode ``op`` legal: the fields it uses (all others
    must be 0), its legal flag bits, and whether it needs ``rows ≥ 1``. The RTL decoder
    builds its checks from this."""
    used, legal_flags = _USES[op]
    return used, int(legal_flags), op in _ROW_OPS


class IllegalInstruction(ValueError):
    """An instruction word the engine does not execute. ``field`` names the culprit."""

    def __init__(self, field: str, message: str, word: int | None = None):
        self.field = field
        self.word = word
        where = f" in word 0x{word:032x}" if word is not None else ""
        super().__init__(f"illegal instruction{where}: field '{field}': {message}")


class AsmError(ValueError):
    """A line of assembly that cannot be assembled; the message gives the line number."""


@dataclass(frozen=True)
class Instruction:
    """One decoded instruction; field meanings per opcode are in docs/isa.md."""
    opcode: Op
    flags: int = 0
    rows: int = 0
    dst: int = 0
    src: int = 0
    n: int = 0
    k: int = 0
    addr: int = 0

    @property
    def mode(self) -> MatmulMode:
        return MatmulMode(flag_field(self.flags, "mode"))

    @property
    def layer_relative(self) -> bool:
        return bool(flag_field(self.flags, "layer_relative"))

    @property
    def wide(self) -> bool:
        return self.opcode != Op.BRANCH and bool(flag_field(self.flags, "wide"))

    def _named_flag(self, name: str) -> bool:
        """The flag ``name`` of :data:`FLAG_FIELDS`, set and read by this opcode
        (:data:`_FLAG_READERS`): a bit shared by several names means each only to its own
        opcodes."""
        return self.opcode in _FLAG_READERS[name] and bool(flag_field(self.flags, name))

    @property
    def bias(self) -> bool:
        return self._named_flag("bias")

    @property
    def blocks(self) -> bool:
        return self._named_flag("blocks")

    @property
    def position(self) -> bool:
        return self._named_flag("position")

    @property
    def rowexp(self) -> bool:
        return self._named_flag("row_exponent")

    @property
    def ungated(self) -> bool:
        return self._named_flag("ungated")

    @property
    def in16(self) -> bool:
        return self._named_flag("in16")

    @property
    def out16(self) -> bool:
        return self._named_flag("out16")

    def validate(self, word: int | None = None) -> "Instruction":
        """Raise :class:`IllegalInstruction` unless every field is legal for the opcode."""
        used, legal_flags = _USES[self.opcode]
        for f in fields(self):
            if f.name == "opcode":
                continue
            value = getattr(self, f.name)
            lsb, width = _FIELD[f.name]
            if not 0 <= value < (1 << width):
                raise IllegalInstruction(f.name, f"{value} does not fit in {width} bits", word)
            if f.name not in used and value != 0:
                raise IllegalInstruction(f.name, f"{self.opcode.name} does not use this field "
                                         f"and it must be 0 (is {value})", word)
        undefined = self.flags & ~int(legal_flags) & 0xFF   # int(): ~ of an IntFlag stays inside the enum
        if undefined:
            raise IllegalInstruction("flags", f"bits 0x{undefined:02x} "
                                     f"are not defined for {self.opcode.name}", word)
        if self.opcode == Op.MATMUL and flag_field(self.flags, "mode") not in MatmulMode._value2member_map_:
            raise IllegalInstruction("flags", f"MATMUL mode {flag_field(self.flags, 'mode')} is undefined", word)
        if self.opcode == Op.BRANCH and self.flags not in Cond._value2member_map_:
            raise IllegalInstruction("flags", f"BRANCH condition {self.flags} is undefined", word)
        if self.opcode in _ROW_OPS and self.rows == 0:
            raise IllegalInstruction("rows", f"{self.opcode.name} needs rows >= 1", word)
        return self


def output_element_bytes(mode: int, out16: bool = False) -> int:
    """Bytes of each output element of a MATMUL in ``mode``: 1 in INT8 (2 with OUT16), 4 in
    RESADD and INT32 (LOGITS writes the logit buffer, not VMEM: 2)."""
    if mode == MatmulMode.INT8:
        return 2 if out16 else 1
    return 2 if mode == MatmulMode.LOGITS else 4


def matmul_output_bytes(ins: Instruction) -> int:
    """:func:`output_element_bytes` of a MATMUL instruction."""
    return output_element_bytes(ins.mode, ins.out16)


def actmul_source_bytes(ins: Instruction) -> int:
    """Bytes of an ACTMUL's source row: ``[gate | up]`` of ``n`` channels each (UNGATED: the
    ``n`` gates alone), int8, or int16 with IN16."""
    return (1 if ins.ungated else 2) * ins.n * (2 if ins.in16 else 1)


def encode(ins: Instruction) -> int:
    """The 128-bit word of a (validated) instruction."""
    ins.validate()
    word = int(ins.opcode)
    for name in ("flags", "rows", "dst", "src", "n", "k", "addr"):
        word |= getattr(ins, name) << _FIELD[name][0]
    return word


def decode(word: int) -> Instruction:
    """Decode a 128-bit word; raises :class:`IllegalInstruction` naming the bad field."""
    if not 0 <= word < (1 << INSTRUCTION_BITS):
        raise IllegalInstruction("opcode", "word is not a 128-bit value", None)

    def get(name):
        lsb, width = _FIELD[name]
        return (word >> lsb) & ((1 << width) - 1)

    opcode = get("opcode")
    if opcode not in Op._value2member_map_:
        raise IllegalInstruction("opcode", f"0x{opcode:02x} is not an opcode", word)
    if get("reserved"):
        raise IllegalInstruction("reserved", f"bits 24-31 must be 0 (are 0x{get('reserved'):02x})", word)
    ins = Instruction(Op(opcode), **{n: get(n) for n in ("flags", "rows", "dst", "src", "n", "k", "addr")})
    return ins.validate(word)


def to_bytes(words: list[int]) -> bytes:
    """Little-endian program image: 16 bytes per instruction."""
    return b"".join(w.to_bytes(INSTRUCTION_BYTES, "little") for w in words)


def from_bytes(data: bytes) -> list[int]:
    if len(data) % INSTRUCTION_BYTES:
        raise ValueError(f"program image of {len(data)} bytes is not a whole number of "
                         f"{INSTRUCTION_BYTES}-byte instructions")
    return [int.from_bytes(data[i:i + INSTRUCTION_BYTES], "little")
            for i in range(0, len(data), INSTRUCTION_BYTES)]


# -- assembly text ------------------------------------------------------------------
# One instruction per line: ``mnemonic key=value, key=value ...``; MATMUL's mode and
# BRANCH's condition are written by name (mode=resadd, cond=no_sample), the flag bits as
# bare words (``lrel``, ``wide``, ``bias``, ``position``, ``rowexp``, ``ungated``, ``blocks``,
# ``in16``, ``out16``). Numbers may be decimal or 0x-hex. ``;`` starts a comment;
# ``label:`` defines a label that n= of BRANCH/NEXT may name.

#: Flags written as bare words, in this order.
_BARE_FLAGS = {"lrel": Flag.LREL, "wide": Flag.WIDE, "bias": Flag.BIAS, "position": Flag.POSITION,
               "rowexp": Flag.ROWEXP, "ungated": Flag.UNGATED, "blocks": Flag.BLOCKS,
               "in16": Flag.IN16, "out16": Flag.OUT16}


def _format(ins: Instruction) -> str:
    parts = []
    used, _ = _USES[ins.opcode]
    if ins.opcode == Op.MATMUL:
        parts.append(f"mode={ins.mode.name.lower()}")
    if ins.opcode == Op.BRANCH:
        parts.append(f"cond={Cond(ins.flags).name.lower()}")
    for name in ("rows", "dst", "src", "n", "k"):
        if name in used:
            parts.append(f"{name}={getattr(ins, name)}")
    if "addr" in used:
        parts.append(f"addr=0x{ins.addr:x}")
    if ins.opcode != Op.BRANCH and ins.layer_relative:
        parts.append("lrel")
    parts += [name for name in _BARE_FLAGS if name != "lrel" and getattr(ins, name)]
    text = ins.opcode.name.lower()
    return f"{text} {', '.join(parts)}" if parts else text


def disassemble(words: list[int], *, addresses: bool = False) -> str:
    """Assembly text for program words (decoding each, so illegal words raise)."""
    lines = []
    for pc, w in enumerate(words):
        text = _format(decode(w))
        lines.append(f"{pc:5d}:  {text}" if addresses else text)
    return "\n".join(lines) + "\n"


_LINE = re.compile(r"^\s*(?:(?P<label>[A-Za-z_]\w*)\s*:)?\s*(?P<body>[^;]*?)\s*(?:;.*)?$")


def assemble(text: str) -> list[int]:
    """Assemble text (the disassembler's syntax) into 128-bit words."""
    lines = text.splitlines()
    labels: dict[str, int] = {}
    bodies: list[tuple[int, str]] = []
    for lineno, line in enumerate(lines, 1):
        m = _LINE.match(line)
        if m is None:
            raise AsmError(f"line {lineno}: cannot parse {line!r}")
        if m.group("label"):
            labels[m.group("label")] = len(bodies)
        body = m.group("body")
        numbered = re.match(r"^\d+:\s*(.*)$", body)   # disassembly printed with addresses
        if numbered:
            body = numbered.group(1)
        if body:
            bodies.append((lineno, body))
    words = []
    for lineno, body in bodies:
        try:
            words.append(encode(_parse(body, labels)))
        except (IllegalInstruction, ValueError, KeyError) as exc:
            raise AsmError(f"line {lineno}: {exc}") from None
    return words


def _parse(body: str, labels: dict[str, int]) -> Instruction:
    mnemonic, _, rest = body.partition(" ")
    try:
        op = Op[mnemonic.strip().upper()]
    except KeyError:
        raise ValueError(f"unknown mnemonic {mnemonic!r}") from None
    values: dict[str, int] = {}
    flags = 0
    for item in filter(None, (p.strip() for p in rest.split(","))):
        if item in _BARE_FLAGS:
            flags |= _BARE_FLAGS[item]
            continue
        key, eq, value = item.partition("=")
        key, value = key.strip(), value.strip()
        if not eq:
            raise ValueError(f"expected key=value, got {item!r}")
        if key == "mode":
            flags |= MatmulMode[value.upper()] << 1
        elif key == "cond":
            flags |= Cond[value.upper()]
        elif key in ("rows", "dst", "src", "n", "k", "addr", "flags"):
            values[key] = labels[value] if value in labels else int(value, 0)
        else:
            raise ValueError(f"unknown field {key!r}")
    values["flags"] = values.get("flags", 0) | flags
    return Instruction(op, **values)
