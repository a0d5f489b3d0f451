"""Request and result descriptors: what the host and the engine exchange in device memory.

The host writes a request descriptor, starts the engine, and reads a result descriptor
back; both are little-endian 32-bit words. The layouts are defined here once and used by
the functional model, the RTL tests and the host driver. See ``docs/isa.md``.
"""

from __future__ import annotations

import enum
import struct
from dataclasses import dataclass, field

import numpy as np

__all__ = [
    "ErrorCode", "RequestFlag", "DraftRequest", "DraftedToken", "DraftResult",
    "REQUEST_HEADER_WORDS", "RESULT_HEADER_WORDS", "MAX_DRAFT", "RESULT_CHECK_SALT",
    "request_bytes", "result_bytes", "record_words",
    "REQUEST_FIELDS", "REQUEST_FLAG_FIELDS", "RESULT_FIELDS", "pack_fields", "unpack_fields",
    "WATCHDOG_PER_INSTRUCTION", "watchdog_budget", "TREE_FIELDS", "COMPACT_ROW_BITS",
    "MAX_COMPACT", "PARENT_LSB", "Compaction",
]

REQUEST_HEADER_WORDS = 16
RESULT_HEADER_WORDS = 16
#: Most tokens one request may draft (bounds the result buffer).
MAX_DRAFT = 64
RESULT_CHECK_SALT = 0xDF76C0DE

#: (name, word, lsb, width) of every request-header field, in bit order (a field may span
#: words: ``seed`` is words 7-8, ``compact_rows`` words 14-15; ``kv_slot_base`` is the
#: first KV slot of the request's sequence; the tree and compaction fields are
#: docs/isa.md §9's). :class:`DraftRequest`'s
#: pack/unpack, the functional model's checks and the RTL's ``RequestHeader`` layout
#: (``dfvg_hw.layouts``) derive from it. Word 1 is :data:`REQUEST_FLAG_FIELDS`.
REQUEST_FIELDS: tuple[tuple[str, int, int, int], ...] = (
    ("seq", 0, 0, 32), ("flags", 1, 0, 32), ("start_pos", 2, 0, 32), ("n_in", 3, 0, 32),
    ("n_draft", 4, 0, 32), ("topk", 5, 0, 32), ("t_mult", 6, 0, 16), ("t_shift", 6, 16, 16),
    ("seed", 7, 0, 64), ("counter", 9, 0, 32), ("kv_slot_base", 10, 0, 16),
    ("tree_width", 10, 16, 8), ("compact_len", 10, 24, 8),
    ("tree_pc", 11, 0, 16), ("row_pitch", 11, 16, 16),
    ("compact_from", 12, 0, 16), ("compact_slots", 12, 16, 16),
    ("compact_width", 13, 0, 8), ("reserved", 13, 8, 24),
    ("compact_rows", 14, 0, 64),
)
#: The request fields of tree drafting and compaction (docs/isa.md §9): an engine that
#: drafts chains only (``P_TREE_WIDTH`` = 0) refuses a request where any is not 0.
TREE_FIELDS = ("tree_width", "compact_len", "tree_pc", "row_pitch", "compact_from",
               "compact_width", "compact_slots", "compact_rows")
#: Record word 0 holds the token below this bit and, in a tree request, the parent's
#: record index + 1 from it (token ids are 16-bit: ``EngineConfig.vocab_max`` ≤ 65535).
PARENT_LSB = 16
#: Bits per level in ``compact_rows``, and so the most levels one request compacts.
COMPACT_ROW_BITS = 4
MAX_COMPACT = 64 // COMPACT_ROW_BITS
#: (name, lsb, width) of the request's ``flags`` word; ``reserved`` must be zero.
REQUEST_FLAG_FIELDS: tuple[tuple[str, int, int], ...] = (("sample", 0, 1), ("reserved", 1, 31))
#: (name, word, lsb, width) of every result-header field, in bit order. ``check`` is the
#: last word (see :class:`DraftResult`).
RESULT_FIELDS: tuple[tuple[str, int, int, int], ...] = (
    ("seq", 0, 0, 32), ("status", 1, 0, 32), ("n_drafted", 2, 0, 32), ("end_pos", 3, 0, 32),
    ("cycles", 4, 0, 64), ("n_forward", 6, 0, 32), ("error_pc", 7, 0, 32), ("topk", 8, 0, 32),
    ("reserved", 9, 0, 32 * (RESULT_HEADER_WORDS - 10)), ("check", RESULT_HEADER_WORDS - 1, 0, 32),
)

#: Instructions a request may execute per program word and per forward (+1) before it
#: faults ``WATCHDOG``.
WATCHDOG_PER_INSTRUCTION = 256


def watchdog_budget(n_in, n_draft, program_len):
    """The instruction budget of a request: ``(n_in + n_draft + 1) · program_len · 256``
    (:data:`WATCHDOG_PER_INSTRUCTION`). Plain arithmetic, so it takes ints or the RTL's
    values alike."""
    return (n_in + n_draft + 1) * program_len * WATCHDOG_PER_INSTRUCTION


def pack_fields(fields, n_words: int, values: dict) -> list[int]:
    """``n_words`` 32-bit words holding ``values`` placed by a (name, word, lsb, width)
    table; fields not in ``values`` are zero. Raises ``ValueError`` for a value that is
    negative or wider than its field."""
    bits = 0
    for name, word, lsb, width in fields:
        value = int(values.get(name, 0))
        if not 0 <= value < 1 << width:
            raise ValueError(f"{name} = {value} does not fit its {width}-bit field")
        bits |= value << (32 * word + lsb)
    return [(bits >> (32 * i)) & 0xFFFFFFFF for i in range(n_words)]


def unpack_fields(fields, words) -> dict:
    """The fields of a (name, word, lsb, width) table, as ints, from 32-bit ``words``."""
    bits = sum(int(w) << (32 * i) for i, w in enumerate(words))
    return {name: (bits >> (32 * word + lsb)) & ((1 << width) - 1)
            for name, word, lsb, width in fields}


def _flag_field(flags: int, name: str) -> int:
    lsb, width = next((lsb, width) for n, lsb, width in REQUEST_FLAG_FIELDS if n == name)
    return (flags >> lsb) & ((1 << width) - 1)


class ErrorCode(enum.IntEnum):
    """Engine error codes (result ``status`` word and the ERROR register)."""
    OK = 0
    ILLEGAL_INSTRUCTION = 1   #: an instruction word failed to decode
    KV_OVERFLOW = 2           #: a KV append or RoPE at a position ≥ kv_positions
    BAD_ADDRESS = 3           #: a device-memory or VMEM access outside its memory
    BAD_REQUEST = 4           #: a request descriptor field out of range
    PROGRAM = 5               #: a malformed program (see docs/isa.md), or one larger than
                              #: instruction memory
    WATCHDOG = 6              #: the instruction budget ran out (a program that never halts)
    ABORTED = 7               #: the host wrote CONTROL.ABORT; stopped before the next instruction

    def describe(self) -> str:
        return {
            ErrorCode.OK: "no error",
            ErrorCode.ILLEGAL_INSTRUCTION: "the engine fetched an illegal instruction; the "
                "program does not match this engine version — recompile the draft",
            ErrorCode.KV_OVERFLOW: "the context exceeds the engine's KV capacity; shorten "
                "the prompt or generation, or use a preset with more kv_positions",
            ErrorCode.BAD_ADDRESS: "an access fell outside device memory or VMEM; the "
                "image or program is corrupt or was compiled for another preset",
            ErrorCode.BAD_REQUEST: "the request descriptor is out of range (token id, topk, "
                "n_in or n_draft)",
            ErrorCode.PROGRAM: "the program is malformed or larger than instruction memory, or "
                "no program is loaded; recompile the draft for this engine",
            ErrorCode.WATCHDOG: "the engine's instruction budget ran out; the program "
                "does not halt",
            ErrorCode.ABORTED: "the host aborted the request (CONTROL.ABORT, the driver's timeout "
                "path); the tokens drafted before it are kept",
        }[self]


class RequestFlag(enum.IntFlag):
    """Bits of the request's ``flags`` word, placed by :data:`REQUEST_FLAG_FIELDS`."""
    SAMPLE = 1 << REQUEST_FLAG_FIELDS[0][1]  #: sample from the top-k distribution (else greedy)


@dataclass(frozen=True)
class Compaction:
    """Moves an accepted tree path's KV to its logical positions (docs/isa.md §9.3).

    Members
    -------
    base : int
        ``P0`` of the tree: the position after its request's last input.
    width : int
        The tree's width ``W``.
    rows : tuple of int
        Row ``r_d`` of the path's node at level ``d = 1 … c``; ``c ≤`` :data:`MAX_COMPACT`.
    slots : int
        KV slots of the sequence (``layers · G``), from the request's ``kv_slot_base``.
    """
    base: int
    width: int
    rows: tuple[int, ...]
    slots: int

    def fields(self) -> dict:
        """The request-header fields this compaction sets."""
        if len(self.rows) > MAX_COMPACT:
            raise ValueError(f"a request compacts at most {MAX_COMPACT} levels, not {len(self.rows)}")
        if any(not 0 <= r < self.width for r in self.rows):
            raise ValueError(f"compaction rows {list(self.rows)} must lie in 0 … {self.width - 1}")
        packed = sum(r << (COMPACT_ROW_BITS * d) for d, r in enumerate(self.rows))
        return dict(compact_len=len(self.rows), compact_from=self.base, compact_width=self.width,
                    compact_slots=self.slots, compact_rows=packed)

    def moves(self) -> list[tuple[int, int]]:
        """(source, destination) KV positions, in the order the engine copies them."""
        return [(self.base + d * self.width + r, self.base + d) for d, r in enumerate(self.rows)]

    @classmethod
    def from_header(cls, h: dict) -> "Compaction":
        c = h["compact_len"]
        rows = tuple((h["compact_rows"] >> (COMPACT_ROW_BITS * d)) & ((1 << COMPACT_ROW_BITS) - 1)
                     for d in range(c))
        return cls(h["compact_from"], h["compact_width"], rows, h["compact_slots"])


@dataclass
class DraftRequest:
    """One draft request: feed ``tokens`` from ``start_pos``, then draft ``n_draft``.

    Word layout (:data:`REQUEST_FIELDS`): 0 seq, 1 flags, 2 start_pos, 3 n_in, 4 n_draft,
    5 topk, 6 t_mult | t_shift << 16, 7 seed_lo, 8 seed_hi, 9 counter, 10 kv_slot_base
    (bits 0-15; bits 16-31 zero), 11-15 zero, 16.. one token id per word.

    ``start_pos`` is the committed KV length: setting it below the engine's current
    length is the O(1) rollback. The engine appends KV for every input and for every
    drafted token but the last, so after a request the KV length is
    ``start_pos + n_in + max(n_draft - 1, 0)``.

    ``kv_slot_base`` is the first KV slot of the request's sequence: KV head ``h`` of
    layer ``LAYER`` is slot ``kv_slot_base + LAYER·G + h`` (docs/isa.md §1.4), so several
    sequences can keep their KV in one engine, each in its own slot range (0: the
    whole buffer from slot 0, as before the field existed).

    ``tree_width`` ≥ 1 makes it a tree request (docs/isa.md §9.2): ``n_draft`` levels of
    ``tree_width`` nodes, the tree forwards starting at ``tree_pc`` with VMEM rows
    ``row_pitch`` lines apart (both from the compiled program's manifest).
    ``compaction`` first moves the previous tree's accepted path into place (§9.3).
    """
    tokens: list[int]
    start_pos: int
    n_draft: int
    topk: int = 1
    sample: bool = False
    t_mult: int = 0
    t_shift: int = 0
    seed: int = 0
    counter: int = 0
    seq: int = 0
    kv_slot_base: int = 0
    tree_width: int = 0
    tree_pc: int = 0
    row_pitch: int = 0
    compaction: Compaction | None = None

    @property
    def n_records(self) -> int:
        """Records a complete result holds: ``n_draft`` tokens, or levels × width nodes."""
        return self.n_draft * max(self.tree_width, 1)

    def pack(self) -> bytes:
        words = pack_fields(REQUEST_FIELDS, REQUEST_HEADER_WORDS, dict(
            seq=self.seq, flags=int(RequestFlag.SAMPLE) if self.sample else 0,
            start_pos=self.start_pos, n_in=len(self.tokens), n_draft=self.n_draft,
            topk=self.topk, t_mult=self.t_mult & 0xFFFF, t_shift=self.t_shift,
            seed=self.seed & (2 ** 64 - 1), counter=self.counter & 0xFFFFFFFF,
            kv_slot_base=self.kv_slot_base, tree_width=self.tree_width, tree_pc=self.tree_pc,
            row_pitch=self.row_pitch, **(self.compaction.fields() if self.compaction else {})))
        words += [int(t) for t in self.tokens]
        return struct.pack(f"<{len(words)}I", *words)

    @classmethod
    def unpack_header(cls, data: bytes) -> dict:
        """The :data:`REQUEST_FIELDS` of a request's header, plus ``sample`` (the flag)
        and ``flags_reserved`` (the flag bits that must be zero)."""
        w = struct.unpack(f"<{REQUEST_HEADER_WORDS}I", data[:4 * REQUEST_HEADER_WORDS])
        h = unpack_fields(REQUEST_FIELDS, w)
        h["sample"] = bool(_flag_field(h["flags"], "sample"))
        h["flags_reserved"] = _flag_field(h["flags"], "reserved")
        return h


def request_bytes(n_in: int) -> int:
    return 4 * (REQUEST_HEADER_WORDS + n_in)


def record_words(topk_max: int) -> int:
    """Words per drafted-token record: token, prob, then topk_max (id, prob) pairs."""
    return 2 + 2 * topk_max


def result_bytes(topk_max: int, n_draft: int = MAX_DRAFT) -> int:
    return 4 * (RESULT_HEADER_WORDS + n_draft * record_words(topk_max))


@dataclass
class DraftedToken:
    """A drafted token with its exact draft probability and the top-k it was drawn from.

    Probabilities are integers in units of 2^-24 (``numerics.PROB_BITS``): the sampled
    distribution q is exactly ``topk_probs / 2^24`` on ``topk_ids`` and 0 elsewhere.
    """
    token: int
    prob: int
    topk_ids: list[int]
    topk_probs: list[int]
    #: In a tree request's result, the parent's record index, or -1 for the root (the
    #: last input token); a chain's records leave it -1 (each continues the one before).
    parent: int = -1

    def record(self, topk_max: int) -> list[int]:
        """The :func:`record_words` words of this token in a result buffer: token (bits
        0–15) and parent + 1 (bits 16–23), prob, then ``topk_max`` (id, prob) pairs, zero
        past the list's end."""
        pairs = []
        for i in range(topk_max):
            pairs += [self.topk_ids[i], self.topk_probs[i]] if i < len(self.topk_ids) else [0, 0]
        return [self.token | ((self.parent + 1) << PARENT_LSB), self.prob] + pairs


@dataclass
class DraftResult:
    """Result descriptor.

    Word layout (:data:`RESULT_FIELDS`): 0 seq (echo of the request), 1 status (:class:`ErrorCode`), 2 n_drafted,
    3 end_pos (KV length after the request), 4 cycles_lo, 5 cycles_hi, 6 n_forward,
    7 error_pc, 8 topk (list length per record), 9-14 zero, 15 check; then n_drafted
    records of :func:`record_words` words. ``check`` is the 32-bit wrapping sum of every
    other header word and record word, plus ``RESULT_CHECK_SALT``.
    """
    seq: int
    status: ErrorCode
    end_pos: int
    cycles: int
    n_forward: int
    error_pc: int = 0
    tokens: list[DraftedToken] = field(default_factory=list)
    topk: int = 0

    def pack(self, topk_max: int) -> bytes:
        records = [word for t in self.tokens for word in t.record(topk_max)]
        header = pack_fields(RESULT_FIELDS, RESULT_HEADER_WORDS, dict(
            seq=self.seq, status=int(self.status), n_drafted=len(self.tokens),
            end_pos=self.end_pos, cycles=self.cycles & (2 ** 64 - 1), n_forward=self.n_forward,
            error_pc=self.error_pc, topk=self.topk))
        header[-1] = (sum(header) + sum(records) + RESULT_CHECK_SALT) & 0xFFFFFFFF
        words = header + records
        return struct.pack(f"<{len(words)}I", *words)

    @staticmethod
    def checksum(words: np.ndarray) -> int:
        """The check word the engine computes over header words 0-14 and the records."""
        body = np.concatenate([words[:RESULT_HEADER_WORDS - 1], words[RESULT_HEADER_WORDS:]])
        return int((int(np.sum(body.astype(np.uint64))) + RESULT_CHECK_SALT) & 0xFFFFFFFF)

    @classmethod
    def unpack(cls, data: bytes, topk_max: int) -> "DraftResult":
        """Parse a result buffer; raises ``ValueError`` if it is truncated or corrupt."""
        if len(data) < 4 * RESULT_HEADER_WORDS:
            raise ValueError(f"result buffer has {len(data)} bytes, fewer than its header")
        header = unpack_fields(RESULT_FIELDS, struct.unpack(f"<{RESULT_HEADER_WORDS}I",
                                                            data[:4 * RESULT_HEADER_WORDS]))
        n = header["n_drafted"]
        if n > MAX_DRAFT:
            raise ValueError(f"result claims {n} drafted tokens, more than MAX_DRAFT={MAX_DRAFT}")
        rw = record_words(topk_max)
        need = 4 * (RESULT_HEADER_WORDS + n * rw)
        if len(data) < need:
            raise ValueError(f"result buffer has {len(data)} bytes, its header needs {need}")
        words = np.frombuffer(data[:need], dtype="<u4")
        if cls.checksum(words) != header["check"]:
            raise ValueError("result buffer check word does not match its contents "
                             "(corrupted or partially written result)")
        try:
            status = ErrorCode(header["status"])
        except ValueError:
            raise ValueError(f"result status {header['status']} is not an engine error code") from None
        topk = header["topk"]
        tokens = []
        for i in range(n):
            r = words[RESULT_HEADER_WORDS + i * rw: RESULT_HEADER_WORDS + (i + 1) * rw]
            pairs = r[2:].reshape(-1, 2)[:topk]
            head = int(r[0])
            tokens.append(DraftedToken(head & ((1 << PARENT_LSB) - 1), int(r[1]),
                                       [int(x) for x in pairs[:, 0]], [int(x) for x in pairs[:, 1]],
                                       parent=(head >> PARENT_LSB) - 1))
        return cls(seq=header["seq"], status=status, end_pos=header["end_pos"],
                   cycles=header["cycles"], n_forward=header["n_forward"],
                   error_pc=header["error_pc"], tokens=tokens, topk=topk)
