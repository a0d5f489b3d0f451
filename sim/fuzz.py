"""Random programs on random images through the ``sim`` device's register interface.

The functional model's contract under fuzzing: whatever program, image and request it is
given, a run either completes or stops with an :class:`~dfvg_hw.spec.descriptors.ErrorCode`
in the ERROR register and the result; it never raises anything else and never runs for
long (the watchdog and the legality checks come before any costly work).
``tests/test_fuzz_functional.py`` runs a small seeded sample in CI,
``scripts/fuzz_functional.py`` longer runs.

A case is a program (random 128-bit words mixed with random *legal* instructions of every
opcode, fields drawn around the engine's limits), a random image, a random request
(sometimes with out-of-range header fields) and the device addresses; :func:`run_case`
executes it on a fresh :class:`~sim.device.SimDevice` the way the host driver does:
DMA writes, base registers, ``LOAD_PROGRAM``, ``START``.
"""

from __future__ import annotations

import signal
import struct
import time
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np

from dfvg_hw.spec.config import VMEM_LINE_BYTES, EngineConfig
from dfvg_hw.spec.descriptors import (MAX_DRAFT, REQUEST_FIELDS, REQUEST_HEADER_WORDS, DraftResult,
                                      ErrorCode,
                                      pack_fields, result_bytes)
from dfvg_hw.spec.image import NORM_PARAM_BYTES
from dfvg_hw.spec.isa import (INSTRUCTION_BITS, Cond, Flag, Instruction, MatmulMode, Op,
                              encode, opcode_rules, to_bytes)
from dfvg_hw.spec.numerics import GAMMA_SHIFT_MAX
from dfvg_hw.spec.regmap import Control, Reg, Status
from sim.device import SimDevice

__all__ = ["FuzzCase", "Outcome", "random_case", "run_case", "Hang"]

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
    CYCLES register."""
    error: ErrorCode
    tokens: list[int]
    cycles: int
    error_pc: int


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
    lines = c.vmem_bytes // VMEM_LINE_BYTES
    f = {}
    if "flags" in used:
        if op == Op.BRANCH:
            f["flags"] = int(rng.choice([int(x) for x in Cond]))
        else:
            flags = int(rng.integers(0, 256)) & legal_flags
            if op == Op.MATMUL and (flags >> 1) & 3 == 3:
                flags &= ~int(Flag.MODE0)
            f["flags"] = flags
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
        else:
            f["n"] = _pick(rng, 80, 1 << 16)
    if "k" in used:
        f["k"] = _pick(rng, 2 * c.head_dim + 2, 1 << 16)
    if "addr" in used:
        f["addr"] = _pick(rng, image_len, 1 << 32, 0.1)
        if rng.random() < 0.5:
            f["addr"] &= ~(VMEM_LINE_BYTES - 1)
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


def random_case(rng, c: EngineConfig) -> FuzzCase:
    image = random_image(rng, c)
    program = random_program(rng, c, len(image))
    request, n_draft = random_request(rng, c)
    return FuzzCase(program, image, request, n_draft)


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
    """Write the case into a device the way the host driver does and load the program.
    ``dev`` offers the transport operations (:class:`SimDevice`, the RTL devices)."""
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


def start_case(dev, case: FuzzCase, timeout_s: float = 60.0) -> Outcome:
    """START the loaded request and read the outcome from the registers and result."""
    dev.write32(Reg.CONTROL, Control.START)
    if not dev.wait_irq(timeout_s):
        raise Hang("no completion interrupt")
    status = dev.read32(Reg.STATUS)
    assert status & Status.DONE and not status & Status.BUSY, f"STATUS 0x{status:x}"
    error = ErrorCode(dev.read32(Reg.ERROR))
    cycles = dev.read32(Reg.CYCLES_LO) | dev.read32(Reg.CYCLES_HI) << 32
    result = DraftResult.unpack(dev.dma_read(RESULT_ADDR, result_bytes(dev.config.topk_max, case.n_draft)),
                                dev.config.topk_max)
    assert result.status == error, f"result status {result.status!r}, ERROR register {error!r}"
    return Outcome(error, [t.token for t in result.tokens], cycles, dev.read32(Reg.ERROR_PC))


def run_case(c: EngineConfig, case: FuzzCase, time_limit_s: float = 5.0) -> Outcome:
    """Run one case on a fresh :class:`SimDevice`; raises :class:`Hang` past the bound and
    lets any exception other than an engine fault through (that is the finding)."""
    dev = SimDevice(c)
    with time_bound(time_limit_s):
        load_case(dev, case)
        if not dev.read32(Reg.STATUS) & Status.PROGRAM_LOADED:
            return Outcome(ErrorCode(dev.read32(Reg.ERROR)), [], 0, 0)
        return start_case(dev, case)
