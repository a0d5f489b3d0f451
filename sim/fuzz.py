"""Random programs on random images through the devices' register interface.

The functional model's contract under fuzzing: whatever program, image and request it is
given, a run either completes or stops with an :class:`~dfvg_hw.spec.descriptors.ErrorCode`
in the ERROR register and the result; it never raises anything else and never runs for
long (the watchdog and the legality checks come before any costly work). The RTL's: the
same error code, error PC, tokens and cycle counters as the functional model, and no
hang. ``tests/test_fuzz_functional.py`` runs a seeded sample on the ``sim`` device in CI,
``tests/test_fuzz_rtl.py`` a smaller one on ``rtl+verilator`` against it, and
``scripts/fuzz_functional.py`` longer runs of both.

A case is a program, a random image, a random request (sometimes with out-of-range
header fields; its ``kv_slot_base`` mostly 0, often one that fits the program's KV
slots, sometimes one slot past them or any 16-bit value) and the device addresses. Programs come in two kinds, half each:

* **random**: random 128-bit words mixed with random *legal* instructions of every
  opcode, fields drawn around the engine's limits (most stop at their first unit
  instruction, which is the point: the legality checks); MATMUL in all four modes, with
  and without ``BIAS`` and ``BLOCKS`` (on an engine without block multipliers a tenth of
  what would have it, each meeting its ``PROGRAM`` fault); RMSNORM of ``k`` ∈ {0, 1, 2,
  3} segments, mostly of a multiple of 16 elements (else ``PROGRAM`` when ``k ≥ 2``);
* **forward**: a model-shaped program (EMBED, RMSNORM, the QKV matmul, ROPE, KVAPPEND,
  ATTN, RESADD, ACTMUL in an optional layer loop, then BRANCH NO_SAMPLE over the final
  norm, the LOGITS matmul and SAMPLE, NEXT, HALT) with random shapes and VMEM places that
  fit, over an image with valid parameter blocks, then a few mutations (an instruction
  replaced, dropped, swapped or a field nudged, a random word put in) so that faults
  also come mid-request, after real work. The q/k/v matmuls now and then have biases
  (Qwen2), every matrix now and then block-scaled weights (``BLOCKS``, where the engine has
  them), and q is now and then an INT32 row normalised per head (RMSNORM of ``k =``
  heads segments, Qwen3's QK-norm) before ROPE. Half of them run the gated activation
  on int16 gate and up (the gate/up MATMUL ``OUT16``, the ACTMUL ``IN16``), as compiled
  gated MLPs do. A third (without QK-norm) write q, k and v as int16 (``OUT16``) and
  rotate them with ROPE ``WIDE``; ATTN reads that q as int16 (``IN16``), KVAPPEND the
  int16 k and v rows' bytes as int8, which is defined, only not what a compiler emits.

:func:`run_case` executes a case on a fresh :class:`~sim.device.SimDevice` the way the host
driver does (DMA writes, base registers, ``LOAD_PROGRAM``, ``START``); :class:`DeviceRunner`
runs cases one after another on one device (the Verilator one), :func:`compare` holds two
outcomes to each other and :class:`Tally` counts how runs end.
"""

from __future__ import annotations

import collections
import dataclasses
import signal
import struct
import traceback
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from dfvg_hw.spec.config import EngineConfig
from dfvg_hw.spec.descriptors import (MAX_DRAFT, REQUEST_FIELDS, REQUEST_HEADER_WORDS, DraftResult,
                                      ErrorCode,
                                      pack_fields, result_bytes)
from dfvg_hw.spec.image import (ACT_PARAM_BYTES, NORM_PARAM_BYTES, pack_attn_params,
                                pack_norm_params, pack_requant_records, padded, tile_weights,
                                untile_weights)
from dfvg_hw.spec.isa import (INSTRUCTION_BITS, Cond, Flag, IllegalInstruction, Instruction,
                              MatmulMode, Op, decode, encode, opcode_rules, to_bytes)
from dfvg_hw.spec.numerics import GAMMA_SHIFT_MAX, ROW_EXP_MAX
from dfvg_hw.spec.regmap import OP_CYCLE_BUCKETS, Control, Reg, Status, op_cycles_offset
from sim.device import SimDevice
from sim.program_flow import CONTROL_OPS

__all__ = ["FuzzCase", "Outcome", "random_case", "random_forward_case", "run_case", "Hang",
           "DeviceRunner", "compare", "fault_site", "faulting_bucket", "Tally", "fuzz_sim", "fuzz_rtl"]

PROGRAM_ADDR = 0x0000_0000
REQUEST_ADDR = 0x0001_0000
RESULT_ADDR = 0x0002_0000
IMAGE_ADDR = 0x0010_0000


@dataclass
class FuzzCase:
    program: list[int]
    image: bytes
    request: bytes          # header words and tokens, as the host writes them
    n_draft: int            # what the result buffer is sized for


@dataclass
class Outcome:
    """``error`` is the ERROR register's code; ``tokens`` the drafted ids; ``cycles`` the
    CYCLES register; ``units`` the ``OP_CYCLES`` counters by bucket name."""
    error: ErrorCode
    tokens: list[int]
    cycles: int
    error_pc: int
    units: dict = field(default_factory=dict)


class Hang(Exception):
    """A run took longer than its time bound."""


def _pick(rng, small, limit, big_p=0.1):
    """Mostly a value below ``small``, sometimes anything below ``limit``, sometimes an
    edge: 0, 1, ``small`` ± 1, ``limit − 1``."""
    u = rng.random()
    if u < 0.15:
        return int(rng.choice([0, 1, max(small - 1, 0), small, small + 1, limit - 1])) % limit
    return int(rng.integers(0, limit)) if u < 0.15 + big_p else int(rng.integers(0, small))


def random_instruction(rng, c: EngineConfig, prog_len: int, image_len: int) -> int:
    """A legal instruction word of a random opcode with random fields near the limits."""
    op = Op(int(rng.choice([int(o) for o in Op])))
    used, legal_flags, needs_rows = opcode_rules(op)
    lines = c.vmem_bytes // c.vmem_line_bytes
    f = {}
    if "flags" in used:
        if op == Op.BRANCH:
            f["flags"] = int(rng.choice([int(x) for x in Cond]))
        else:
            f["flags"] = int(rng.integers(0, 256)) & legal_flags
            if op == Op.MATMUL and not c.weight_blocks and rng.random() < 0.9:
                # mostly what the engine has; now and then the PROGRAM fault of BLOCKS
                f["flags"] &= ~int(Flag.BLOCKS)
    if "rows" in used:
        f["rows"] = 1 if rng.random() < 0.6 else int(rng.integers(1, c.rows + 2)) if rng.random() < 0.9 \
            else int(rng.integers(1, 256))
    for name in ("dst", "src"):
        if name in used:
            f[name] = _pick(rng, lines + 4, 1 << 16)
    if "n" in used:
        if op in (Op.BRANCH, Op.NEXT):
            f["n"] = _pick(rng, prog_len + 2, 1 << 16, 0.05)
        elif op == Op.LOOP:
            f["n"] = _pick(rng, 4, 1 << 16, 0.05)
        elif op == Op.SAMPLE:
            f["n"] = _pick(rng, c.vocab_max + 2, 1 << 16)
        elif op == Op.RMSNORM and rng.random() < 0.7:     # whole VMEM lines: segments allowed
            f["n"] = c.vmem_line_bytes * int(rng.integers(1, 5))
        else:
            f["n"] = _pick(rng, 80, 1 << 16)
    if "k" in used:
        if op in (Op.RMSNORM, Op.ACTMUL):       # segments (0 and 1: one)
            f["k"] = int(rng.integers(0, 4))
        else:
            f["k"] = _pick(rng, 2 * c.head_dim + 2, 1 << 16)
    if "addr" in used:
        f["addr"] = _pick(rng, image_len, 1 << 32, 0.1)
        if rng.random() < 0.5:
            # the image's block alignment; a MATMUL block's, the engine beat (docs/isa.md §3.4)
            f["addr"] &= ~(c.mem_beat_bytes - 1 if op == Op.MATMUL else 15)
    if needs_rows and not f.get("rows"):
        f["rows"] = 1
    return encode(Instruction(op, **f))


def random_program(rng, c: EngineConfig, image_len: int, max_len: int = 16) -> list[int]:
    n = int(rng.integers(1, max_len + 1))
    words = []
    for _ in range(n):
        u = rng.random()
        if u < 0.1:
            words.append(int.from_bytes(rng.bytes(16), "little") % (1 << INSTRUCTION_BITS))
        else:
            words.append(random_instruction(rng, c, n, image_len))
    # a SAMPLE often reads the length the last LOGITS matmul wrote (n = 0 included)
    logits_n = None
    for i, w in enumerate(words):
        op, n = w & 0xFF, (w >> 64) & 0xFFFF
        if op == Op.MATMUL and (w >> 9) & 3 == MatmulMode.LOGITS:
            logits_n = n
        elif op == Op.SAMPLE and logits_n is not None and rng.random() < 0.7:
            words[i] = encode(Instruction(Op.SAMPLE, n=logits_n))
    if rng.random() < 0.7:
        words.append(encode(Instruction(Op.HALT)))
    return words


def random_image(rng, c: EngineConfig) -> bytes:
    """Random bytes; the words a parameter block reads first (eps, gamma_shift, the ATTN
    KV-head count) are often small so those checks pass and the units run."""
    size = int(rng.integers(1, 64)) * 256
    img = bytearray(rng.bytes(size))
    for _ in range(size // 64):
        at = int(rng.integers(0, size // 16)) * 16
        words = [int(rng.integers(0, 3)) if rng.random() < 0.3 else int(rng.integers(0, 1 << 20)),
                 int(rng.integers(0, GAMMA_SHIFT_MAX + 2)), int(rng.integers(0, 3))]
        img[at:at + 12] = struct.pack("<3I", *words)
    if rng.random() < 0.2:                      # zero blocks: all-zero RMSNorm rows, eps 0
        at = int(rng.integers(0, size // 16)) * 16
        img[at:at + NORM_PARAM_BYTES + 256] = bytes(len(img[at:at + NORM_PARAM_BYTES + 256]))
    return bytes(img)


def random_request(rng, c: EngineConfig) -> tuple[bytes, int]:
    n_in = int(rng.integers(1, 4))
    n_draft = int(rng.integers(0, 4))
    fields = dict(seq=int(rng.integers(1, 1 << 32)), flags=int(rng.integers(0, 2)),
                  start_pos=int(rng.integers(0, c.kv_positions + 2)), n_in=n_in, n_draft=n_draft,
                  topk=int(rng.integers(1, c.topk_max + 1)), t_mult=int(rng.integers(1, 1 << 16)),
                  t_shift=int(rng.integers(0, 24)), seed_lo=int(rng.integers(0, 1 << 32)),
                  seed_hi=int(rng.integers(0, 1 << 32)), counter=int(rng.integers(0, 1 << 32)))
    fields["kv_slot_base"] = _slot_base(rng, c, 1)
    tokens = [int(rng.integers(0, c.vocab_max)) for _ in range(n_in)]
    if rng.random() < 0.1:                      # a header field out of range
        name, width = [(n, w) for n, _, _, w in REQUEST_FIELDS][int(rng.integers(0, len(REQUEST_FIELDS)))]
        fields[name] = int(rng.integers(0, 1 << min(width, 16)))
        fields["n_in"] = min(fields["n_in"], 8)
        fields["n_draft"] = min(fields["n_draft"], MAX_DRAFT + 1)
        tokens = (tokens * 8)[:fields["n_in"]] + [0] * (fields["n_in"] - len(tokens))
    if rng.random() < 0.05:
        tokens[0] = int(rng.integers(c.vocab_max, 1 << 32))
    words = pack_fields(REQUEST_FIELDS, REQUEST_HEADER_WORDS, fields)
    if rng.random() < 0.03:                     # a reserved word not 0
        words[-1] = 1
    return struct.pack(f"<{len(words) + len(tokens)}I", *words, *tokens), min(fields["n_draft"], MAX_DRAFT)


def _slot_base(rng, c: EngineConfig, need: int) -> int:
    """A request's ``kv_slot_base`` for a program whose layers take ``need`` KV slots:
    mostly 0, often one that fits (up to ``kv_slots − need``, the last slots exactly
    included), sometimes one slot past that (PROGRAM at the last layer's KVAPPEND or
    ATTN), now and then any 16-bit value."""
    u, fits = rng.random(), max(c.kv_slots - need, 0)
    if u < 0.5:
        return 0
    if u < 0.8:
        return int(rng.integers(0, fits + 1))
    if u < 0.9:
        return fits + 1
    return int(rng.integers(0, 1 << 16))


def random_case(rng, c: EngineConfig, forward_p: float = 0.5) -> FuzzCase:
    """A random-words program (see the module docstring) or, with probability
    ``forward_p``, a mutated model-shaped one (:func:`random_forward_case`)."""
    if rng.random() < forward_p:
        return random_forward_case(rng, c)
    image = random_image(rng, c)
    program = random_program(rng, c, len(image))
    request, n_draft = random_request(rng, c)
    return FuzzCase(program, image, request, n_draft)


# -- model-shaped programs --------------------------------------------------------------

class _Vmem:
    """Places operands in VMEM one after another (a line or two apart), and now and then
    anywhere they fit, over others (in-place and overlapping operands are legal)."""

    def __init__(self, rng, c: EngineConfig):
        self.rng, self.line = rng, c.vmem_line_bytes
        self.size, self.next = c.vmem_bytes // self.line, 0

    def place(self, rows: int, row_bytes: int) -> int:
        need = max(rows * -(-row_bytes // self.line), 1)
        if self.rng.random() < 0.1 or self.next + need > self.size:
            return int(self.rng.integers(0, max(self.size - need, 0) + 1))
        at, self.next = self.next, self.next + need + int(self.rng.integers(0, 3))
        return at


class _Image:
    """An image built block by block, 16-byte aligned; weight blocks on a memory beat, as
    MATMUL needs (docs/isa.md §4), now and then a beat further on. (Random instructions,
    the other half of the cases, put MATMULs off the beat too.)"""

    def __init__(self, rng):
        self.rng, self.data = rng, bytearray(rng.bytes(256))

    def put(self, block: bytes, alignment: int = 16, skip: int = 0) -> int:
        """``block`` at the next multiple of ``alignment``, plus ``skip`` bytes."""
        at = padded(len(self.data), alignment) + skip
        self.data += bytes(at - len(self.data)) + block
        self.data += bytes(-len(self.data) % 16)
        return at

    def _weight_skip(self, c: EngineConfig) -> int:
        """Bytes past the next beat a weight block starts: one time in ten a beat."""
        if self.rng.random() < 0.1:
            # (a draw kept from when these blocks sat at random byte offsets, so that each
            # seed keeps its cases)
            self.rng.integers(1, 16)
            return c.mem_beat_bytes
        return 0

    def weights(self, n: int, k: int, c: EngineConfig, bias: bool = False, scales=None) -> int:
        """An ``n × k`` int8 block: random tiles, then requant records: words with shifts
        that keep some outputs off the rails and (``bias``) int32 biases of random
        magnitudes. With ``scales`` (a generator: MATMUL ``BLOCKS``) the same tiles with
        scale tiles of random block multipliers from it among them."""
        npad, kpad = padded(n, c.lanes), padded(k, c.reduce)
        mult = self.rng.integers(1, 1 << 16, npad)
        shift = self.rng.integers(12, 36, npad)
        biases = (self.rng.integers(-(1 << 31), 1 << 31, npad) >> self.rng.integers(0, 32, npad)
                  if bias else None)
        tiles = self.rng.bytes(npad * kpad)
        if scales is not None:
            w = untile_weights(np.frombuffer(tiles, np.int8), npad, kpad, c.lanes, c.reduce)
            m = scales.integers(0, 1 << 16, (npad, kpad // c.reduce))
            tiles = tile_weights(w, c.lanes, c.reduce, m).tobytes()
        return self.put(tiles + pack_requant_records(mult, shift, biases, npad, c.lanes),
                        c.mem_beat_bytes, self._weight_skip(c))

    def norm(self, n: int) -> int:
        eps = 0 if self.rng.random() < 0.2 else int(self.rng.integers(0, 1 << 20))
        shift = int(self.rng.integers(0, GAMMA_SHIFT_MAX + 1)) if self.rng.random() < 0.95 \
            else GAMMA_SHIFT_MAX + 1
        gamma = self.rng.integers(-1 << 15, 1 << 15, n).astype("<i2")
        return self.put(pack_norm_params(eps, gamma, shift))

    def attn(self, kv_heads: int) -> int:
        return self.put(pack_attn_params(int(self.rng.integers(1, 1 << 16)),
                                         int(self.rng.integers(8, 40)), kv_heads))

    def act(self) -> int:
        word = int(self.rng.integers(1, 1 << 16)) | int(self.rng.integers(4, 24)) << 16
        # the row exponent budget from the multiplier's low bits: no draw of its own, so a
        # seed keeps its cases
        exp_max = word & ROW_EXP_MAX
        return self.put(struct.pack("<2I", word, exp_max << 16).ljust(16, b"\0")
                        + self.rng.bytes(ACT_PARAM_BYTES - 16))


def _mutate(rng, c: EngineConfig, words: list[int], image_len: int) -> list[int]:
    """One random change: an instruction replaced by a random legal one, dropped, two
    swapped, a random word put in, or one used field nudged (± 1, or an edge value)."""
    words = list(words)
    i = int(rng.integers(0, len(words)))
    u = rng.random()
    if u < 0.2:
        words[i] = random_instruction(rng, c, len(words), image_len)
    elif u < 0.35 and len(words) > 1:
        del words[i]
    elif u < 0.5:
        j = int(rng.integers(0, len(words)))
        words[i], words[j] = words[j], words[i]
    elif u < 0.6:
        words.insert(i, int.from_bytes(rng.bytes(16), "little"))
    else:
        try:
            ins = decode(words[i])
        except IllegalInstruction:
            return words
        # (not a branch target: one moved back loops a forward of real work until the
        # watchdog, tens of thousands of instructions; the random kind has cheap loops)
        used = [f for f in ("rows", "dst", "src", "n", "k", "addr")
                if f in opcode_rules(ins.opcode)[0]
                and not (f == "n" and ins.opcode in (Op.BRANCH, Op.NEXT))]
        if not used:
            return words
        name = used[int(rng.integers(0, len(used)))]
        width = 32 if name == "addr" else 8 if name == "rows" else 16
        old = getattr(ins, name)
        new = int(rng.choice([old + 1, old - 1, old + 2, 0, (1 << width) - 1, old * 2])) % (1 << width)
        try:
            words[i] = encode(dataclasses.replace(ins, **{name: new}))
        except IllegalInstruction:
            pass
    return words


def random_forward_case(rng, c: EngineConfig, mutations: int | None = None) -> FuzzCase:
    """A model-shaped program (see the module docstring) on an image that holds its
    blocks, and a request that mostly fits the KV buffer; ``mutations`` changes (0 to 3
    by default: half the cases none)."""
    img, vm = _Image(rng), _Vmem(rng, c)
    h = int(rng.choice([4, 8, 12, 16, 24, 32]))
    hd = int(rng.choice([x for x in (2, 4, 8, 16, 32) if x <= c.head_dim] or [2]))
    nh = int(rng.choice([1, 2, 4]))
    layers = int(rng.choice([0, 1, 2]))              # 0: no layer loop
    g_ok = [g for g in (1, 2, 4) if nh % g == 0 and max(layers, 1) * g <= c.kv_slots] or [1]
    g = int(rng.choice(g_ok))
    inter = int(rng.choice([4, 8, 16, 24, 32]))
    vocab = int(rng.choice([4, 16, 40, 64, 128, c.vocab_max])) if rng.random() < 0.95 \
        else int(rng.integers(1, c.vocab_max + 1))
    r = 1 if rng.random() < 0.6 else int(rng.integers(1, c.rows + 1))
    wide = lambda: int(Flag.WIDE) if rng.random() < 0.3 else 0      # noqa: E731
    in_loop = layers > 0
    # Qwen2's q/k/v biases; Qwen3's QK-norm: q as an int32 row, each head normalised on its
    # own (RMSNORM segments start on VMEM lines: whole-line heads)
    bias_q, bias_kv = (int(Flag.BIAS) if rng.random() < 0.3 else 0 for _ in range(2))
    # block-scaled weights (MATMUL BLOCKS) where the engine has the block multipliers, from
    # a stream of their own: every other draw is what the same seed gave before BLOCKS was
    # drawn, so seeded samples keep their cases
    brng = rng.spawn(1)[0]
    bq, bkv, bo, bgu, bd, bhead = (int(Flag.BLOCKS) if c.weight_blocks and brng.random() < 0.3 else 0
                                   for _ in range(6))
    qk_norm = hd % c.vmem_line_bytes == 0 and rng.random() < 0.4
    # h's row exponents: the ACTMUL measures them, the down MATMUL reads them
    rowexp = int(Flag.ROWEXP) if brng.random() < 0.5 else 0
    # int16 gate and up (the gate/up MATMUL's OUT16, the ACTMUL's IN16), as the compiler's
    in16 = brng.random() < 0.5
    # int16 q, k and v (their MATMULs' OUT16), rotated by ROPE WIDE
    qkv16 = brng.random() < 0.33 and not qk_norm
    qkv_bytes = 2 if qkv16 else 1
    # ... and appended as int16 (KVAPPEND WIDE, saturated to the engine's kv_bits)
    kv_wide = int(Flag.WIDE) if qkv16 and brng.random() < 0.7 else 0

    def scales(blocks_flag):
        return brng if blocks_flag else None

    def lrel():
        return int(Flag.LREL) if in_loop and rng.random() < 0.8 else 0

    # embedding table: a few rows of int32 (tokens past them read what follows)
    table = img.put(rng.bytes(4 * h * int(rng.integers(1, 9))))
    rope = img.put(rng.bytes(2 * hd * c.kv_positions))
    # VMEM: the int32 residual x, the norm output xn, q, k|v, the attention output, gate|up, act
    x = vm.place(r, 4 * h)
    xn = vm.place(r, 2 * h)
    q = vm.place(r, nh * hd * qkv_bytes)
    q32 = vm.place(r, 4 * nh * hd) if qk_norm else q
    kv = vm.place(r, 2 * g * hd * qkv_bytes)
    att = vm.place(1, 2 * nh * hd)
    gu = vm.place(r, 2 * inter * (2 if in16 else 1))
    act = vm.place(r, 2 * inter)

    # the layer's blocks; layers after the first are copies at LSTRIDE (LREL reaches them)
    start = len(img.data)
    b = dict(norm1=img.norm(h), wq=img.weights(nh * hd, h, c, bool(bias_q), scales(bq)),
             wkv=img.weights(2 * g * hd, h, c, bool(bias_kv), scales(bkv)), qnorm=img.norm(hd),
             attn=img.attn(g), wo=img.weights(h, nh * hd, c, scales=scales(bo)), norm2=img.norm(h),
             wgu=img.weights(2 * inter, h, c, scales=scales(bgu)), act=img.act(),
             wd=img.weights(h, inter, c, scales=scales(bd)))
    # (whole beats: the copies' weight blocks stay on a beat, as MATMUL needs)
    img.data += bytes(-(len(img.data) - start) % c.mem_beat_bytes)
    stride = len(img.data) - start
    img.data += bytes(img.data[start:]) * (max(layers, 1) - 1)
    final_norm, lm_head = img.norm(h), img.weights(vocab, h, c, scales=scales(bhead))

    w1, w2, w3 = wide(), wide(), wide()
    M = lambda mode: int(mode) << 1                                        # noqa: E731
    out16, rope_wide = (int(Flag.OUT16), int(Flag.WIDE)) if qkv16 else (0, 0)
    body = [
        Instruction(Op.RMSNORM, flags=lrel() | w1, rows=r, dst=xn, src=x, n=h, addr=b["norm1"]),
        Instruction(Op.MATMUL, flags=lrel() | w1 | bias_q | bq
                    | M(MatmulMode.INT32 if qk_norm else MatmulMode.INT8) | out16,
                    rows=r, dst=q32, src=xn, n=nh * hd, k=h, addr=b["wq"]),
        *([Instruction(Op.RMSNORM, flags=lrel(), rows=r, dst=q, src=q32, n=hd, k=nh,
                       addr=b["qnorm"])] if qk_norm else []),
        Instruction(Op.MATMUL, flags=lrel() | w1 | bias_kv | bkv | M(MatmulMode.INT8) | out16, rows=r,
                    dst=kv, src=xn, n=2 * g * hd, k=h, addr=b["wkv"]),
        Instruction(Op.ROPE, flags=rope_wide, rows=r, dst=q, src=q, n=nh, k=hd, addr=rope),
        Instruction(Op.ROPE, flags=rope_wide, rows=r, dst=kv, src=kv, n=g, k=hd, addr=rope),
        Instruction(Op.KVAPPEND, flags=kv_wide, rows=1, src=kv, n=g, k=hd),
        Instruction(Op.ATTN, flags=lrel() | w2 | (int(Flag.IN16) if qkv16 else 0), rows=1, dst=att, src=q,
                    n=nh, k=hd, addr=b["attn"]),
        Instruction(Op.MATMUL, flags=lrel() | w2 | bo | M(MatmulMode.RESADD), rows=1, dst=x, src=att,
                    n=h, k=nh * hd, addr=b["wo"]),
        Instruction(Op.RMSNORM, flags=lrel(), rows=r, dst=xn, src=x, n=h, addr=b["norm2"]),
        Instruction(Op.MATMUL, flags=lrel() | bgu | M(MatmulMode.INT8) | (int(Flag.OUT16) if in16 else 0),
                    rows=r, dst=gu, src=xn, n=2 * inter, k=h, addr=b["wgu"]),
        Instruction(Op.ACTMUL, flags=lrel() | w3 | rowexp | (int(Flag.IN16) if in16 else 0), rows=r,
                    dst=act, src=gu, n=inter, addr=b["act"]),
        Instruction(Op.MATMUL, flags=lrel() | w3 | bd | rowexp | M(MatmulMode.RESADD), rows=r, dst=x, src=act,
                    n=h, k=inter, addr=b["wd"]),
    ]
    if rng.random() < 0.3:                            # drop a few, as a smaller model might
        body = [ins for ins in body if rng.random() < 0.8]
    prog = [Instruction(Op.EMBED, rows=1, dst=x, n=h, addr=table)]
    if in_loop:
        prog += [Instruction(Op.LOOP, n=layers, addr=stride)] + body + [Instruction(Op.ENDLOOP)]
    else:
        prog += body
    w4 = wide()
    tail = [Instruction(Op.RMSNORM, flags=w4, rows=1, dst=xn, src=x, n=h, addr=final_norm),
            Instruction(Op.MATMUL, flags=w4 | bhead | M(MatmulMode.LOGITS), rows=1, src=xn, n=vocab, k=h,
                        addr=lm_head),
            Instruction(Op.SAMPLE, n=vocab)]
    after = len(prog) + 1 + len(tail)
    prog += [Instruction(Op.BRANCH, flags=int(Cond.NO_SAMPLE), n=after)] + tail
    prog += [Instruction(Op.NEXT, n=0), Instruction(Op.HALT)]
    words = [encode(ins) for ins in prog]
    count = mutations if mutations is not None else int(rng.choice([0, 0, 0, 1, 1, 2, 3]))
    for _ in range(count):
        words = _mutate(rng, c, words, len(img.data))

    n_in = int(rng.integers(1, 4))
    n_draft = int(rng.integers(0, 5))
    forwards = n_in + max(n_draft - 1, 0)
    start_pos = int(rng.integers(0, max(c.kv_positions - forwards, 0) + 1)) if rng.random() < 0.9 \
        else int(rng.integers(c.kv_positions - forwards, c.kv_positions + 1))
    sample = rng.random() < 0.5
    header = dict(seq=int(rng.integers(1, 1 << 32)), flags=int(sample), start_pos=start_pos,
                  n_in=n_in, n_draft=n_draft, topk=int(rng.integers(1, c.topk_max + 1)),
                  t_mult=int(rng.integers(1, 1 << 16)), t_shift=int(rng.integers(0, 24)),
                  seed_lo=int(rng.integers(0, 1 << 32)), seed_hi=int(rng.integers(0, 1 << 32)),
                  counter=int(rng.integers(0, 1 << 32)),
                  kv_slot_base=_slot_base(rng, c, max(layers, 1) * g))
    tokens = [int(rng.integers(0, 8)) if rng.random() < 0.8 else int(rng.integers(0, c.vocab_max))
              for _ in range(n_in)]
    request = pack_fields(REQUEST_FIELDS, REQUEST_HEADER_WORDS, header)
    return FuzzCase(words, bytes(img.data), struct.pack(f"<{len(request) + n_in}I", *request, *tokens),
                    n_draft)


@contextmanager
def time_bound(seconds: float):
    """Raise :class:`Hang` if the block runs longer than ``seconds`` (main thread only)."""
    def alarm(signum, frame):
        raise Hang(f"ran longer than {seconds} s")
    old = signal.signal(signal.SIGALRM, alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def load_case(dev, case: FuzzCase) -> None:
    """Write the case into a device the way the host driver does and load the program
    (returns once STATUS is no longer BUSY). ``dev`` offers the transport operations
    (:class:`SimDevice`, the RTL devices)."""
    dev.dma_write(IMAGE_ADDR, case.image)
    dev.dma_write(PROGRAM_ADDR, to_bytes(case.program))
    dev.dma_write(REQUEST_ADDR, case.request)
    for lo, value in ((Reg.IMAGE_BASE_LO, IMAGE_ADDR), (Reg.PROG_BASE_LO, PROGRAM_ADDR),
                      (Reg.REQ0_LO, REQUEST_ADDR), (Reg.RES0_LO, RESULT_ADDR)):
        dev.write32(lo, value & 0xFFFFFFFF)
        dev.write32(lo + 4, value >> 32)
    dev.write32(Reg.PROG_LEN, len(case.program))
    dev.write32(Reg.IRQ_ENABLE, 1)
    dev.write32(Reg.CONTROL, Control.LOAD_PROGRAM)
    wait_idle(dev, "LOAD_PROGRAM")


def wait_idle(dev, what: str) -> None:
    """Poll STATUS until BUSY clears, as the driver does after a command other than START
    (a soft reset, a program load: the RTL takes cycles over them and raises no
    interrupt); a device that runs by the clock runs 256 cycles between polls."""
    for _ in range(100_000):
        if not dev.read32(Reg.STATUS) & Status.BUSY:
            return
        if hasattr(dev, "run_cycles"):
            dev.run_cycles(256)
    raise Hang(f"{what} does not finish")


def read_units(dev) -> dict:
    """The ``OP_CYCLES`` counters by bucket name."""
    return {b: dev.read32(op_cycles_offset(b)) for b in OP_CYCLE_BUCKETS}


def start_case(dev, case: FuzzCase, timeout_s: float = 60.0, max_cycles: int | None = None) -> Outcome:
    """START the loaded request and read the outcome from the registers and result.
    ``max_cycles``: on a device that runs by the clock (``run_cycles``), the request must
    interrupt within that many cycles, else :class:`Hang` (a bound that does not depend
    on the machine's load, as ``timeout_s`` does)."""
    dev.write32(Reg.CONTROL, Control.START)
    if max_cycles is not None and hasattr(dev, "run_cycles"):
        ran = 0
        while not dev.run_cycles(min(200_000, max_cycles - ran)):
            ran += min(200_000, max_cycles - ran)
            if ran >= max_cycles:
                raise Hang(f"no completion interrupt within {max_cycles} cycles")
    elif not dev.wait_irq(timeout_s):
        raise Hang("no completion interrupt")
    status = dev.read32(Reg.STATUS)
    assert status & Status.DONE and not status & Status.BUSY, f"STATUS 0x{status:x}"
    error = ErrorCode(dev.read32(Reg.ERROR))
    cycles = dev.read32(Reg.CYCLES_LO) | dev.read32(Reg.CYCLES_HI) << 32
    result = DraftResult.unpack(dev.dma_read(RESULT_ADDR, result_bytes(dev.config.topk_max, case.n_draft)),
                                dev.config.topk_max)
    assert result.status == error, f"result status {result.status!r}, ERROR register {error!r}"
    return Outcome(error, [t.token for t in result.tokens], cycles, dev.read32(Reg.ERROR_PC),
                   read_units(dev))


def run_case(c: EngineConfig, case: FuzzCase, time_limit_s: float = 5.0, *,
             tree_width: int | None = None) -> Outcome:
    """Run one case on a fresh :class:`SimDevice` (drafting trees up to ``tree_width``,
    by default ``c.rows``); raises :class:`Hang` past the bound and lets any exception
    other than an engine fault through (that is the finding)."""
    dev = SimDevice(c, tree_width=tree_width)
    with time_bound(time_limit_s):
        load_case(dev, case)
        if not dev.read32(Reg.STATUS) & Status.PROGRAM_LOADED:
            return Outcome(ErrorCode(dev.read32(Reg.ERROR)), [], 0, 0, read_units(dev))
        return start_case(dev, case)


class DeviceRunner:
    """Runs cases one after another on one device of ``factory(config)`` (the Verilator
    one: it generates the engine's Verilog to find its build, seconds, so it is made once
    and reused): before each case a soft reset and zeros over what the previous case
    wrote, so that the device starts as a fresh sim device does. A run past ``timeout_s``
    (the engine never interrupts), or past ``timeout_s + grace_s`` in all (a register
    access never returns), raises :class:`Hang`; after that, or after any exception, the
    device is thrown away and the next case gets a new one. ``close`` when done."""

    def __init__(self, config: EngineConfig, factory, timeout_s: float = 60.0, grace_s: float = 10.0):
        self.config, self.factory, self.timeout_s, self.grace_s = config, factory, timeout_s, grace_s
        self.dev, self._dirty = None, []
        self.made = 0                                #: devices made so far

    def _device(self):
        if self.dev is None:                         # (a build may take minutes: no bound)
            self.dev, self._dirty = self.factory(self.config), []
            self.made += 1
        return self.dev

    def tree_width(self) -> int:
        """The widest tree the device drafts (its ``P_TREE_WIDTH`` register)."""
        return self._device().read32(Reg.P_TREE_WIDTH)

    def run(self, case: FuzzCase, max_cycles: int | None = None) -> Outcome:
        self._device()
        try:
            # the run's own bound, and grace_s for the register traffic around it
            with time_bound(self.timeout_s + self.grace_s):
                dev = self.dev
                dev.write32(Reg.CONTROL, Control.SOFT_RESET)
                wait_idle(dev, "SOFT_RESET")
                for addr, n in self._dirty:
                    dev.dma_write(addr, bytes(n))
                self._dirty = [(IMAGE_ADDR, len(case.image)), (PROGRAM_ADDR, 16 * len(case.program)),
                               (REQUEST_ADDR, len(case.request)),
                               (RESULT_ADDR, result_bytes(self.config.topk_max, MAX_DRAFT))]
                load_case(dev, case)
                if not dev.read32(Reg.STATUS) & Status.PROGRAM_LOADED:
                    return Outcome(ErrorCode(dev.read32(Reg.ERROR)), [], 0, 0, read_units(dev))
                return start_case(dev, case, self.timeout_s, max_cycles)
        except BaseException:
            self.discard()
            raise

    def discard(self) -> None:
        """Close the device (a stuck one is killed when its last reference goes)."""
        dev, self.dev = self.dev, None
        if dev is not None:
            try:
                with time_bound(10):
                    dev.close()
            except Exception:                       # noqa: BLE001 - a stuck harness
                pass

    close = discard


def fault_site(case: FuzzCase, out: Outcome) -> str | None:
    """The opcode at the error PC of a fault that came from an instruction, or None (a
    request field, an illegal word, a fetch past the program or over the budget)."""
    if out.error in (ErrorCode.OK, ErrorCode.ILLEGAL_INSTRUCTION, ErrorCode.BAD_REQUEST,
                     ErrorCode.WATCHDOG) or out.error_pc >= len(case.program):
        return None
    try:
        return decode(case.program[out.error_pc]).opcode.name
    except IllegalInstruction:
        return None


def faulting_bucket(case: FuzzCase, out: Outcome) -> str | None:
    """The ``OP_CYCLES`` bucket of the instruction a fault stopped part-way, or None where
    it stopped none: :func:`fault_site`, but None for a control instruction (it faults in
    its ISSUE cycles, which the model charges in full)."""
    site = fault_site(case, out)
    return None if site is None or Op[site] in CONTROL_OPS else site


def compare(case: FuzzCase, rtl: Outcome, ref: Outcome) -> str | None:
    """How ``rtl`` differs from ``ref`` (the sim device's outcome of ``case``), or None.

    The error code, error PC and tokens must be equal. On a run that completes, every
    cycle counter too. On a fault that stops no instruction part-way (a request field,
    an illegal word, a fetch past the program or over the budget, a control
    instruction's), every counter and CYCLES too. On a fault that stops an instruction
    (:func:`faulting_bucket`), every counter but two: that instruction's bucket, which
    must be counted on both or neither (the RTL stops part-way through it, the model
    charges its unit overhead or all of it, docs/isa.md §8), and ``REQUEST``, which the
    RTL may make longer, never shorter, draining a read the faulting unit had in flight.
    """
    got = (rtl.error.name, rtl.error_pc, rtl.tokens)
    want = (ref.error.name, ref.error_pc, ref.tokens)
    if got != want:
        return f"rtl {got} | sim {want}"
    skip = faulting_bucket(case, ref)
    diff = {}
    for b in OP_CYCLE_BUCKETS:
        r, f = rtl.units.get(b, 0), ref.units.get(b, 0)
        if skip is None or (b != skip and b != "REQUEST"):
            ok = r == f
        elif b == skip:
            ok = bool(r) == bool(f)
        else:
            ok = r >= f
        if not ok:
            diff[b] = (r, f)
    if skip is None and rtl.cycles != ref.cycles:
        diff["CYCLES"] = (rtl.cycles, ref.cycles)
    if diff:
        return f"{ref.error.name} pc {ref.error_pc}: (rtl, sim) " + \
            ", ".join(f"{b} {r}/{f}" for b, (r, f) in diff.items())
    return None


def exception_key(exc: BaseException) -> str:
    """One line naming an exception and where it was raised."""
    where = traceback.extract_tb(exc.__traceback__)[-1] if exc.__traceback__ else None
    at = f" at {Path(where.filename).name}:{where.lineno}" if where else ""
    return f"{type(exc).__name__}: {exc}{at}"


@dataclass
class Tally:
    """How the runs of one device ended: ``ends`` by error-code name, ``bare``
    exceptions by :func:`exception_key`, ``hangs``; ``ran`` counts, per opcode, the
    completed runs that spent cycles in it; ``stopped_in`` the faults by the opcode at
    the error PC (``-`` for faults outside an instruction)."""
    programs: int = 0
    ends: collections.Counter = field(default_factory=collections.Counter)
    bare: collections.Counter = field(default_factory=collections.Counter)
    hangs: int = 0
    ran: collections.Counter = field(default_factory=collections.Counter)
    stopped_in: collections.Counter = field(default_factory=collections.Counter)

    def add(self, case: FuzzCase, out: Outcome) -> None:
        self.programs += 1
        self.ends[out.error.name] += 1
        if out.error == ErrorCode.OK:
            self.ran.update(b for b, n in out.units.items() if n and b != "REQUEST")
        else:
            self.stopped_in[fault_site(case, out) or "-"] += 1

    def add_hang(self) -> None:
        self.programs += 1
        self.hangs += 1

    def add_bare(self, exc: BaseException) -> str:
        """Count ``exc``; returns its key."""
        self.programs += 1
        key = exception_key(exc)
        self.bare[key] += 1
        return key

    def lines(self) -> list[str]:
        ends = collections.Counter(self.ends)
        done = ends.pop("OK", 0)
        return [f"programs {self.programs}, completed {done}, hangs {self.hangs}, "
                f"bare exceptions {sum(self.bare.values())}",
                "faults " + (", ".join(f"{k} {v}" for k, v in ends.most_common()) or "none"),
                "  stopped in " + ", ".join(f"{k} {v}" for k, v in self.stopped_in.most_common()),
                "opcodes run on completed programs " +
                ", ".join(f"{op.name} {self.ran[op.name]}" for op in Op)] + \
            [f"  {v} x {k}" for k, v in self.bare.items()]


def fuzz_sim(config: EngineConfig, rng, count: int, time_limit_s: float = 10.0, log=print,
             keep: int = 0) -> tuple[Tally, list[tuple[int, FuzzCase]]]:
    """``count`` random cases on the sim device; the tally and the first ``keep`` cases
    (with their indices) for :func:`fuzz_rtl`. Each bare exception and hang is logged
    once with its case index."""
    tally, kept = Tally(), []
    for i in range(count):
        case = random_case(rng, config)
        if i < keep:
            kept.append((i, case))
        try:
            tally.add(case, run_case(config, case, time_limit_s))
        except Hang:
            tally.add_hang()
            log(f"case {i}: sim hang")
        except Exception as exc:                     # noqa: BLE001 - what we are looking for
            before = len(tally.bare)
            key = tally.add_bare(exc)
            if len(tally.bare) > before:
                log(f"case {i}: sim {key}")
    return tally, kept


def rtl_cycle_bound(ref: Outcome) -> int:
    """The cycles an RTL run may take before it counts as a hang: twice the sim device's
    count and 100 000 more (a fault stops the RTL part-way, within the model's count)."""
    return 2 * ref.cycles + 100_000


def fuzz_rtl(config: EngineConfig, cases, runner: DeviceRunner, log=print,
             max_model_cycles: int | None = None) -> tuple[Tally, Tally, list[tuple[int, str]], int]:
    """Run ``cases`` (index, case) on the sim device and on ``runner``'s device; the
    tallies of both, the disagreements (index, what differs, from :func:`compare`) and
    how many cases were skipped: those whose sim run takes more than ``max_model_cycles``
    cycles (None: no limit). The RTL run must interrupt within :func:`rtl_cycle_bound`
    cycles and the runner's ``timeout_s``, else it is a hang. A hang or a bare exception
    on one device is a disagreement unless the other has the same."""
    rtl, ref, bad, skipped = Tally(), Tally(), [], 0
    for i, case in cases:
        try:
            # the reference drafts trees exactly as wide as the RTL does (P_TREE_WIDTH)
            s = run_case(config, case, runner.timeout_s, tree_width=runner.tree_width())
        except Hang:
            s = "hang"
        except Exception as exc:                     # noqa: BLE001
            s = exc
        if isinstance(s, Outcome) and max_model_cycles is not None and s.cycles > max_model_cycles:
            skipped += 1
            continue
        if isinstance(s, Outcome):
            ref.add(case, s)
        elif s == "hang":
            ref.add_hang()
        else:
            s = ref.add_bare(s)
        try:
            r = runner.run(case, rtl_cycle_bound(s) if isinstance(s, Outcome) else None)
            rtl.add(case, r)
        except Hang:
            rtl.add_hang()
            r = "hang"
        except Exception as exc:                     # noqa: BLE001
            r = rtl.add_bare(exc)
        if isinstance(s, Outcome) and isinstance(r, Outcome):
            what = compare(case, r, s)
        else:
            what = None if r == s == "hang" else f"rtl {r} | sim {s}"
        if what:
            bad.append((i, what))
            log(f"case {i}: {what}")
    return rtl, ref, bad, skipped
