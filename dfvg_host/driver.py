"""Draft-device driver: the host side of the engine's register and memory map.

It is the code that would run against a card: it checks the engine's identity and
parameters, DMAs the image and program, writes request descriptors into the ping-pong
buffers, starts the engine through CONTROL, waits for the interrupt, and validates what
comes back. It knows devices only through :class:`~dfvg_host.transport.Transport`.

Faults: every register access and DMA goes through a
:class:`~dfvg_host.transport.RetryingTransport`, so a transient :class:`TransportError`
(an :class:`~dfvg_host.xdma.XdmaError` included) is retried a bounded number of times;
one that persists becomes a :class:`DeviceLinkError`. Every result is checked against
the descriptor contract (check word, ``seq``, ``end_pos``, the ``ERROR`` register, and
each record: its token among its top-k, with the probability it reports and q > 0, the
top-k summing to exactly 2^24) and a result that breaks it raises
:class:`MalformedResult`. :meth:`DraftDevice.reset` brings a failed device back: soft
reset, identity check, image and program reloaded. Deciding when to reset and what to
replay is the caller's (:class:`~dfvg_host.speculative.SpeculativeDecoder`).

Asynchronous use: :meth:`DraftDevice.submit` writes a request into the next ping-pong
buffer, starts it and returns a :class:`PendingDraft` without waiting;
:meth:`DraftDevice.collect` waits for its interrupt and reads and checks its result.
:meth:`~DraftDevice.draft` is the two in a row. One request is in flight at a time (the
engine runs one at a time; the two buffers let the host write the next request while
one runs), so the host can verify round n on the target while the engine drafts round
n + 1 (:class:`~dfvg_host.pipelined.PipelinedDecoder`).

Token trees (docs/isa.md §9): :meth:`DraftDevice.submit_tree` (or :meth:`~DraftDevice.draft_tree`)
drafts a tree of ``levels`` levels of :attr:`DraftDevice.tree_width` nodes in one request,
on a device and a compiled program that draft trees (:attr:`~DraftDevice.tree_width` > 0;
a chain-only engine, ``P_TREE_WIDTH`` = 0, is refused on the host). After it the
committed, logically ordered KV ends at the tree's ``P0`` (the position after its inputs)
and the driver remembers the tree; :meth:`~DraftDevice.commit_tree_path` takes the path
the target accepted, and the next request of the sequence carries the
:class:`~dfvg_hw.spec.descriptors.Compaction` that moves the path's KV into place
(``committed = P0 + c``). Chain requests are unchanged.

Sequences: one engine holds the KV of :attr:`DraftDevice.max_sequences` sequences at once
(``kv_slots // (layers · KV heads)``), sequence ``i`` in KV slots ``i · slots_per_sequence``
onwards (the request's ``kv_slot_base``, docs/isa.md §1.4). :meth:`DraftDevice.select_sequence`
makes one current; ``kv_length``, ``committed``, :meth:`~DraftDevice.rollback` and
:meth:`~DraftDevice.draft` act on the current one, so a server can interleave requests of
many sequences on one engine. A caller that never selects one uses sequence 0, the
whole engine as before. The engine's KV position register is shared, but every request
names its own ``start_pos``, so interleaving needs no save or restore.
"""

from __future__ import annotations

import functools
import operator
import time
from dataclasses import dataclass, replace

from dfvg_hw.spec.descriptors import (MAX_COMPACT, MAX_DRAFT, Compaction, DraftedToken, DraftRequest,
                                      DraftResult, ErrorCode, result_bytes)
from dfvg_hw.spec.numerics import PROB_BITS, TREE_SCORE_ROOT, host_temperature, tree_expand_greedy
from dfvg_hw.spec.regmap import (ENGINE_ID, ENGINE_VERSION, PARAM_REGS, Control, Irq, MemoryMap, Reg,
                            Status)
from dfvg_host.compiler import CompiledDraft
from dfvg_host.transport import (LinkedTransport, RetryingTransport, Transport, TransportError,
                                 open_transport)

__all__ = ["DraftDevice", "DraftOutput", "PendingDraft", "CYCLE_SOURCES", "cycle_source", "read_tree_width",
           "tree_unavailable", "DraftDeviceError", "DeviceTimeout", "DeviceFault",
           "EngineMismatch", "MalformedResult", "ContextFull", "DeviceLinkError"]


#: What a device's cycle counters are, by URL scheme: the sim device reports the cycle
#: model's count, the RTL devices count the engine's clock in simulation, a card counts
#: its own.
CYCLE_SOURCES = {"sim": "modelled: cycle model",
                 "rtl": "measured: RTL simulation",
                 "rtl+verilator": "measured: RTL simulation",
                 "xdma": "measured: engine counters"}


def cycle_source(url: str) -> str:
    """What the cycle counts of the device at ``url`` are (:data:`CYCLE_SOURCES`)."""
    return CYCLE_SOURCES.get(url.split("://", 1)[0], "measured: engine counters")


class DraftDeviceError(RuntimeError):
    """Base class: every message says what happened and what to do."""


class DeviceTimeout(DraftDeviceError):
    """The engine did not finish in time. ``tokens`` holds what it drafted before the
    driver aborted it (empty when the abort did not land either)."""

    def __init__(self, message: str, tokens: list[DraftedToken] | None = None):
        self.tokens = tokens or []
        super().__init__(message)


class EngineMismatch(DraftDeviceError):
    pass


class MalformedResult(DraftDeviceError):
    pass


class ContextFull(DraftDeviceError):
    pass


class DeviceFault(DraftDeviceError):
    """The engine stopped with an error status. ``tokens`` holds what it drafted before."""

    #: Codes that the request itself provokes: the same request on a freshly reset
    #: engine is refused again, so a reset cannot help.
    REQUEST_CAUSED = frozenset({ErrorCode.KV_OVERFLOW, ErrorCode.BAD_REQUEST})

    def __init__(self, code: ErrorCode, pc: int, tokens: list[DraftedToken]):
        self.code = code
        self.pc = pc
        self.tokens = tokens
        super().__init__(f"draft engine error {code.name} at pc {pc}: {code.describe()}")

    @property
    def request_caused(self) -> bool:
        """Whether the code is one the request provokes (:data:`REQUEST_CAUSED`): the
        driver checked the request on the host, so the engine's limits differ from the
        manifest's and replaying it would fail the same way."""
        return self.code in self.REQUEST_CAUSED


class DeviceLinkError(DraftDeviceError, TransportError):
    """A register access, DMA or interrupt wait failed on every try (the transport's
    error, retried :attr:`DraftDevice.retries` times). Also a :class:`TransportError`."""


def _link_errors(method):
    """Turn a :class:`TransportError` that outlived the retries into :class:`DeviceLinkError`."""
    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        try:
            return method(self, *args, **kwargs)
        except DraftDeviceError:
            raise
        except TransportError as exc:
            raise DeviceLinkError(f"{exc} (failed {self.retries + 1} times in a row); the card or its "
                                  "link is unreliable: check dmesg and the card, then reset the "
                                  "device") from exc
    return wrapper


@dataclass
class DraftOutput:
    """What one draft request returned. A tree request's (``tree_width`` > 0) tokens are
    its ``levels · tree_width`` nodes in record order, each with its ``parent`` (record
    index, -1 for the root)."""
    tokens: list[DraftedToken]
    cycles: int
    end_pos: int
    n_forward: int
    tree_width: int = 0

    @property
    def ids(self) -> list[int]:
        return [t.token for t in self.tokens]

    @property
    def parents(self) -> list[int]:
        return [t.parent for t in self.tokens]

    @property
    def levels(self) -> int:
        """A tree's levels (a chain's tokens)."""
        return len(self.tokens) // max(self.tree_width, 1)


@dataclass(frozen=True)
class _Tree:
    """A tree drafted for a sequence whose accepted path is not committed yet."""
    base: int                     # P0: the position after the request's inputs
    width: int
    levels: int
    parents: tuple[int, ...]


#: Engine version minor that introduced tree requests and ``P_TREE_WIDTH`` (regmap).
_TREE_VERSION_MINOR = 4


def read_tree_width(transport: Transport) -> int:
    """The widest token tree the engine behind ``transport`` drafts (``P_TREE_WIDTH``; 0:
    chains only, as an engine built with ``tree_width=0`` and engines older than trees)."""
    if transport.read32(Reg.VERSION) & 0xFFFF < _TREE_VERSION_MINOR:
        return 0                        # no P_TREE_WIDTH register before trees
    return transport.read32(Reg.P_TREE_WIDTH)


def tree_unavailable(engine_width: int, compiled: CompiledDraft) -> str:
    """Why an engine drafting trees up to ``engine_width`` wide cannot draft trees with
    ``compiled`` (one line, with what to do instead), or ``""`` when it can."""
    program = compiled.tree.width
    if engine_width == 0:
        return ("the draft device drafts chains only (P_TREE_WIDTH = 0: an engine or card "
                "built without trees); draft trees on a device that reports its rows (sim://, "
                "rtl://, or a card built with trees) or draft chains (--strategy chain)")
    if program == 0:
        return (f"the compiled draft has no tree forward (preset '{compiled.manifest['engine']['name']}' "
                "has one row, its VMEM cannot hold a row per branch, or the draft was compiled "
                "before trees); compile it for a preset with rows >= 2, e.g. alveo-u55c, or draft "
                "chains (--strategy chain)")
    if engine_width < program:
        return (f"the engine drafts trees up to {engine_width} wide, the draft was compiled for trees "
                f"{program} wide; recompile the draft with the device's preset")
    return ""


@dataclass(eq=False)
class PendingDraft:
    """A draft request submitted and not collected yet (:meth:`DraftDevice.submit`).

    Members
    -------
    request : DraftRequest
        The descriptor written into the request buffer.
    buffer : int
        The ping-pong buffer (0 or 1) it was written into; its result comes back in the
        result buffer of the same index.
    sequence : int
        The sequence it drafts for (``kv_length`` and ``committed`` of that one change on
        :meth:`DraftDevice.collect`).
    resets : int
        :attr:`DraftDevice.resets` when it was submitted (a reset loses it).
    """
    request: DraftRequest
    buffer: int
    sequence: int
    resets: int


class DraftDevice:
    """A draft engine with a compiled draft loaded.

    Members
    -------
    transport : LinkedTransport
        The device's transport, counting PCIe traffic for the link model.
    io : RetryingTransport
        ``transport`` with bounded retries; every access of the driver goes through it
        (a retried access is counted again by the link model, as it costs again).
    retries : int
        Extra tries of a failed access before :class:`DeviceLinkError`.
    resets : int
        Times :meth:`reset` was called. A reset empties every sequence's KV: a caller
        that keeps sequences compares this count to know they were lost.
    compiled : CompiledDraft
    clock_hz : float
        The engine clock, read from its parameter register.
    slots_per_sequence : int
        KV slots one sequence takes: the compiled draft's layers × KV heads.
    memory_base : int
        Where this engine's part of device memory starts: every :class:`MemoryMap` address
        the driver uses is offset by it (0 for a card with one engine; core ``i`` of a card
        whose cores share its memory gets its own slice, :func:`dfvg_host.core_window.
        core_memory_base`).
    max_sequences : int
        Sequences whose KV the engine holds at once: ``kv_slots // slots_per_sequence``
        (``kv_slots`` of the engine the draft was compiled for, which :meth:`check_engine`
        holds the device to), at least 1.
    current_sequence : int
        The sequence that ``kv_length``, ``committed``, :meth:`rollback` and :meth:`draft`
        act on (:meth:`select_sequence`); 0 at first.
    kv_length : int
        KV entries the engine holds for the current sequence (after its last request).
    committed : int
        KV entries the host has accepted for the current sequence; its next request
        starts here. Setting it below ``kv_length`` (``rollback``) is O(1): nothing moves
        on the device.
    tree_width : int
        Width of the token trees :meth:`submit_tree` drafts (docs/isa.md §9); 0 when the
        engine (``P_TREE_WIDTH``) or the compiled program drafts chains only.
    tree
        The current sequence's last tree until :meth:`commit_tree_path` commits its
        accepted path (then the next request compacts that path's KV), or None.
    """

    ABORT_GRACE_S = 1.0   #: how long a timed-out request may take to stop after ABORT

    def __init__(self, transport: Transport, compiled: CompiledDraft, *, timeout_s: float = 30.0,
                 cycle_source: str = "measured: engine counters", retries: int = 2,
                 retry_backoff_s: float = 1e-3, memory_base: int = 0):
        self.transport = transport if isinstance(transport, LinkedTransport) else LinkedTransport(transport)
        self.memory_base = memory_base
        self.io = RetryingTransport(self.transport, retries=retries, backoff_s=retry_backoff_s)
        self.resets = 0
        #: where the engine's cycle counts come from, as every printed figure says
        self.cycle_source = cycle_source
        self.compiled = compiled
        #: the engine's token ids are a draft vocabulary's (dfvg compile --draft-vocab), or None
        self._vocabulary = compiled.vocabulary
        self.timeout_s = timeout_s
        self.topk_max = compiled.manifest["engine"]["topk_max"]
        shape = compiled.shape
        self.slots_per_sequence = max(shape.layers * shape.kv_heads, 1)
        self.max_sequences = max(compiled.manifest["engine"]["kv_slots"] // self.slots_per_sequence, 1)
        self._seq = 0
        self._buf = 0
        self._current = 0
        self._pending: PendingDraft | None = None
        self._forget_sequences()
        self._engine_tree_width: int | None = None      # P_TREE_WIDTH, read on first use
        self.clock_hz = 0.0
        self.check_engine()
        self.load()

    # -- sequences -----------------------------------------------------------------------
    @property
    def current_sequence(self) -> int:
        return self._current

    def select_sequence(self, index: int) -> None:
        """Make sequence ``index`` (``0 ≤ index < max_sequences``) the one that
        ``kv_length``, ``committed``, :meth:`rollback` and :meth:`draft` act on; each
        sequence keeps its own KV in its own slots, so selecting one costs nothing on the
        device. Raises ``ValueError`` for an index outside the range."""
        try:
            number = None if isinstance(index, bool) else operator.index(index)
        except TypeError:
            number = None
        if number is None or not 0 <= number < self.max_sequences:
            raise ValueError(f"sequence {index!r} does not exist: this engine holds "
                             f"{self.max_sequences} sequence(s) of {self.slots_per_sequence} KV "
                             f"slots (0..{self.max_sequences - 1})")
        self._current = number

    @property
    def kv_length(self) -> int:
        return self._kv_lengths[self._current]

    @kv_length.setter
    def kv_length(self, value: int) -> None:
        self._kv_lengths[self._current] = value

    @property
    def committed(self) -> int:
        return self._committed[self._current]

    @committed.setter
    def committed(self, value: int) -> None:
        self._committed[self._current] = value

    def _forget_sequences(self) -> None:
        """Every sequence's KV is gone (a soft reset empties the engine's KV)."""
        self._kv_lengths = [0] * self.max_sequences
        self._committed = [0] * self.max_sequences
        self._trees: list[_Tree | None] = [None] * self.max_sequences
        self._compactions: list[Compaction | None] = [None] * self.max_sequences
        self._pending = None

    @property
    def retries(self) -> int:
        return self.io.retries

    @property
    def transport_retries(self) -> int:
        """Accesses retried so far (each after a transient :class:`TransportError`)."""
        return self.io.retried

    # -- token trees: the capability -------------------------------------------------------
    @property
    def engine_tree_width(self) -> int:
        """The widest tree the engine drafts (``P_TREE_WIDTH``; 0: chains only, as an engine
        built without trees and engines older than trees). Read from the device on first use, so
        a caller that drafts chains only sends exactly the register accesses it always did."""
        if self._engine_tree_width is None:
            self._engine_tree_width = self._read_tree_width()
        return self._engine_tree_width

    @_link_errors
    def _read_tree_width(self) -> int:
        return read_tree_width(self.io)

    @property
    def tree_width(self) -> int:
        """Width of the token trees this device drafts with the loaded program (docs/isa.md
        §9): the compiled program's tree width (``compiled.tree.width``) when the engine
        drafts trees that wide (:attr:`engine_tree_width`), else 0 (chains only). A
        request's width must be the program's, so the engine's width caps it and the two
        are never mixed."""
        program = self.compiled.tree.width
        return program if program and self.engine_tree_width >= program else 0

    def tree_unavailable(self) -> str:
        """Why this device drafts no trees (one line, with what to do instead), or ``""``
        (:func:`tree_unavailable`)."""
        return tree_unavailable(self.engine_tree_width, self.compiled)

    @classmethod
    def open(cls, url: str, compiled: CompiledDraft, **kwargs) -> "DraftDevice":
        transport, _ = open_transport(url)
        kwargs.setdefault("cycle_source", cycle_source(url))
        return cls(transport, compiled, **kwargs)

    # -- bring-up ------------------------------------------------------------------------
    @_link_errors
    def check_engine(self) -> None:
        t = self.io
        ident, version = t.read32(Reg.ID), t.read32(Reg.VERSION)
        if ident != ENGINE_ID:
            raise EngineMismatch(f"no DFVG engine at this device (ID register reads 0x{ident:08x}, "
                                 f"expected 0x{ENGINE_ID:08x}); check the device URL and bitstream")
        if version >> 16 != ENGINE_VERSION >> 16:
            raise EngineMismatch(f"engine version {version >> 16}.{version & 0xFFFF} does not match "
                                 f"this host's {ENGINE_VERSION >> 16}.x; rebuild the bitstream or "
                                 "update dfvg")
        compiled_for = self.compiled.manifest.get("engine_version", ENGINE_VERSION)
        if version & 0xFFFF < compiled_for & 0xFFFF:
            # a newer compiler may use instructions an older bitstream lacks (minor 5: BIAS, INT32,
            # RMSNORM segments, POSITION, UNGATED); by policy every draft names the minor of
            # the host that compiled it, not the least its program needs
            raise EngineMismatch(f"engine version {version >> 16}.{version & 0xFFFF} is older than "
                                 f"the {compiled_for >> 16}.{compiled_for & 0xFFFF} the draft was "
                                 "compiled for; rebuild the bitstream")
        want = self.compiled.manifest["engine"]
        for reg, name in PARAM_REGS.items():
            have = t.read32(reg)
            if name not in want:
                raise EngineMismatch(f"the draft's manifest has no engine parameter {name} (it was "
                                     "compiled by an older dfvg); recompile it")
            if have != int(want[name]):
                raise EngineMismatch(f"engine parameter {name} is {have}, the draft was compiled for "
                                     f"{int(want[name])} (preset '{want['name']}'); recompile with the "
                                     "device's preset")
        self.clock_hz = t.read32(Reg.P_CLOCK_KHZ) * 1e3

    def _at(self, addr: int) -> int:
        """A :class:`MemoryMap` address in this engine's part of device memory."""
        return self.memory_base + addr

    def _write_addr(self, lo: Reg, addr: int) -> None:
        self.io.write32(lo, addr & 0xFFFFFFFF)
        self.io.write32(lo + 4, addr >> 32)

    @_link_errors
    def load(self) -> None:
        """DMA the image and program, point the engine at its buffers, load the program."""
        t, c = self.io, self.compiled
        t.write32(Reg.CONTROL, Control.SOFT_RESET)
        try:
            t.dma_write(self._at(MemoryMap.IMAGE), c.image)
            t.dma_write(self._at(MemoryMap.PROGRAM), b"".join(w.to_bytes(16, "little") for w in c.program))
        except IndexError as exc:
            raise EngineMismatch(f"the compiled draft does not fit the device's memory ({exc}); "
                                 "recompile for the device's preset") from None
        self._write_addr(Reg.IMAGE_BASE_LO, self._at(MemoryMap.IMAGE))
        self._write_addr(Reg.PROG_BASE_LO, self._at(MemoryMap.PROGRAM))
        t.write32(Reg.PROG_LEN, len(c.program))
        for i in range(2):
            self._write_addr((Reg.REQ0_LO, Reg.REQ1_LO)[i], self._at(MemoryMap.REQUEST[i]))
            self._write_addr((Reg.RES0_LO, Reg.RES1_LO)[i], self._at(MemoryMap.RESULT[i]))
        t.write32(Reg.IRQ_ENABLE, Irq.DONE)
        t.write32(Reg.CONTROL, Control.LOAD_PROGRAM)
        status = self._wait_idle("the soft reset and program load")
        if not status & Status.PROGRAM_LOADED:
            # ERROR = 0 with the program not loaded: the command never arrived.
            code = self._error_code(t.read32(Reg.ERROR), "after LOAD_PROGRAM") or ErrorCode.PROGRAM
            raise DeviceFault(code, 0, [])
        self._forget_sequences()

    @_link_errors
    def reset(self) -> None:
        """Bring the device back after a failure: soft reset (which stops a request still
        running), check the engine's identity and parameters again, DMA the image and the
        program again and load the program.

        The engine's KV is lost, every sequence's: ``kv_length = committed = 0`` for all
        of them (the current sequence stays selected), so the caller feeds every committed
        token again; :attr:`resets` counts up. Raises what :meth:`check_engine` and
        :meth:`load` raise when the device does not come back.
        """
        self.resets += 1
        self._forget_sequences()
        self.io.write32(Reg.CONTROL, Control.SOFT_RESET)
        self.check_engine()
        self.load()

    @staticmethod
    def _error_code(value: int, where: str) -> ErrorCode:
        try:
            return ErrorCode(value)
        except ValueError:
            raise MalformedResult(f"the ERROR register reads {value} {where}, not an engine error "
                                  "code; the device or the link is misbehaving — reset the device") from None

    # -- drafting ------------------------------------------------------------------------
    def rollback(self, length: int) -> None:
        """Commit the first ``length`` KV entries of the current sequence and discard the
        rest (O(1))."""
        if self._pending is not None and self._pending.sequence == self._current:
            raise RuntimeError("cannot roll back while a draft request of this sequence is in "
                               "flight: collect() it first")
        if not 0 <= length <= self.kv_length:
            raise ValueError(f"cannot commit {length} KV entries: the engine holds {self.kv_length}")
        self.committed = length
        # An uncommitted tree is forgotten; a path compaction still to come keeps only the
        # levels below the new length.
        i = self._current
        self._trees[i] = None
        comp = self._compactions[i]
        if comp is not None and length < comp.base + len(comp.rows):
            keep = comp.rows[:max(0, length - comp.base)]
            self._compactions[i] = Compaction(comp.base, comp.width, keep, comp.slots) if keep else None

    commit = rollback

    def draft(self, tokens: list[int], n_draft: int, *, sample: bool = False,
              temperature: float = 1.0, topk: int = 1, seed: int = 0, counter: int = 0) -> DraftOutput:
        """Feed ``tokens`` after the current sequence's committed KV and draft ``n_draft``
        tokens in one request (its ``kv_slot_base`` is ``current_sequence ·
        slots_per_sequence``): :meth:`submit` then :meth:`collect`.

        Raises :class:`ContextFull` or ``ValueError`` (checked on the host, nothing sent),
        or, with the committed KV unchanged: :class:`DeviceTimeout`,
        :class:`DeviceFault` (an error status in the result or the ``ERROR`` register),
        :class:`MalformedResult` (a result that breaks the descriptor contract) or
        :class:`DeviceLinkError`. After any of the last four the device should be
        :meth:`reset` before it is trusted again.
        """
        return self.collect(self.submit(tokens, n_draft, sample=sample, temperature=temperature,
                                        topk=topk, seed=seed, counter=counter))

    @property
    def pending(self) -> "PendingDraft | None":
        """The request submitted and not collected yet, or None."""
        return self._pending

    @_link_errors
    def submit(self, tokens: list[int], n_draft: int, *, sample: bool = False,
               temperature: float = 1.0, topk: int = 1, seed: int = 0,
               counter: int = 0) -> "PendingDraft":
        """Start a draft request and return without waiting for it: check it on the host,
        write its descriptor into the next ping-pong request buffer, write ``START``.
        :meth:`collect` waits for it and reads its result. Arguments as :meth:`draft`.

        At most one request is in flight: the engine runs one request at a time, and the
        two ping-pong buffers let the host write the next request (and read the last
        result) while one runs, not queue several. A second :meth:`submit`, a
        :meth:`draft` or a :meth:`rollback` of the sequence in flight before
        :meth:`collect` raises ``RuntimeError``. The committed KV is unchanged until
        :meth:`collect` succeeds.

        Raises :class:`ContextFull` or ``ValueError`` (nothing sent), or
        :class:`DeviceLinkError` (the descriptor or ``START`` did not get through; reset
        the device).
        """
        self._check_idle()
        limit = self.compiled.context_limit
        need = self.committed + len(tokens) + max(n_draft - 1, 0)
        if need > limit:
            raise ContextFull(f"this request needs {need} KV positions, the draft's context limit "
                              f"is {limit}; shorten the prompt or --max-new-tokens, or use a preset "
                              "with more kv_positions")
        if not tokens or len(tokens) > MemoryMap.MAX_INPUT_TOKENS or not 0 <= n_draft <= MAX_DRAFT:
            raise ValueError(f"a request takes 1..{MemoryMap.MAX_INPUT_TOKENS} input tokens and "
                             f"0..{MAX_DRAFT} drafts (got {len(tokens)} and {n_draft})")
        self._check_tokens(tokens)
        return self._start(tokens, n_draft, sample=sample, temperature=temperature, topk=topk,
                           seed=seed, counter=counter)

    def _check_idle(self) -> None:
        if self._pending is not None:
            raise RuntimeError("a draft request is already in flight: collect() it before "
                               "submitting another (the engine runs one request at a time)")

    def _check_tokens(self, tokens: list[int]) -> None:
        vocab = self.compiled.shape.vocab
        if any(not 0 <= t < vocab for t in tokens):
            raise ValueError(f"token ids must be in 0..{vocab - 1} (the draft's vocabulary)")

    def _start(self, tokens: list[int], n_draft: int, *, sample: bool, temperature: float, topk: int,
               seed: int, counter: int, **tree) -> "PendingDraft":
        """Write the request (with the sequence's pending path compaction, if any) into the
        next ping-pong buffer and start it. A tree not committed by now is forgotten: the
        request overwrites its nodes' KV."""
        self._trees[self._current] = None
        t_mult, t_shift = host_temperature(temperature)
        self._seq = (self._seq + 1) & 0xFFFFFFFF or 1
        if self._vocabulary is not None:
            tokens = self._vocabulary.to_engine(tokens)
        request = DraftRequest(tokens=list(tokens), start_pos=self.committed, n_draft=n_draft,
                               topk=min(max(topk, 1), self.topk_max), sample=sample,
                               t_mult=t_mult, t_shift=t_shift, seed=seed, counter=counter, seq=self._seq,
                               kv_slot_base=self._current * self.slots_per_sequence,
                               compaction=self._compactions[self._current], **tree)
        buf = self._buf
        self._buf ^= 1
        t = self.io
        t.dma_write(self._at(MemoryMap.REQUEST[buf]), request.pack())
        t.write32(Reg.IRQ_STATUS, Irq.DONE)
        t.write32(Reg.CONTROL, Control.START | (Control.BUF if buf else 0))
        self._pending = PendingDraft(request, buf, self._current, self.resets)
        return self._pending

    # -- token trees (docs/isa.md §9) -------------------------------------------------------
    def draft_tree(self, tokens: list[int], levels: int, *, sample: bool = False,
                   temperature: float = 1.0, topk: int | None = None, seed: int = 0,
                   counter: int = 0) -> DraftOutput:
        """Feed ``tokens`` after the committed KV and draft a token tree of ``levels`` levels
        of :attr:`tree_width` nodes in one request: :meth:`submit_tree` then :meth:`collect`.
        Raises what :meth:`draft` raises."""
        return self.collect(self.submit_tree(tokens, levels, sample=sample, temperature=temperature,
                                             topk=topk, seed=seed, counter=counter))

    @_link_errors
    def submit_tree(self, tokens: list[int], levels: int, *, sample: bool = False,
                    temperature: float = 1.0, topk: int | None = None, seed: int = 0,
                    counter: int = 0) -> "PendingDraft":
        """Start a tree request (docs/isa.md §9.2) and return without waiting, as
        :meth:`submit`: ``levels`` levels (``n_draft``) of :attr:`tree_width` nodes, node
        ``(d, r)`` drawn with RNG counter ``counter + (d − 1)·W + r``. Greedy (``sample``
        false) expands by path score and needs ``topk ≥`` the width (default: the width,
        which the expansion needs no more than); sampled trees draw level 1 as ``W``
        i.i.d. samples and continue each row's branch (default ``topk``: ``topk_max``).

        Checked on the host, nothing sent: ``ValueError`` when the device or the program
        drafts no trees (:meth:`tree_unavailable`), for ``levels`` outside ``1 …
        64 // W`` and for bad inputs; :class:`ContextFull` when the tree's KV would reach
        past the draft's context limit (``committed + len(tokens) + (levels − 1)·W``
        positions: level ``d < levels`` is stored ``W`` wide above ``P0``).
        """
        reason = self.tree_unavailable()
        if reason:
            raise ValueError(f"cannot draft a token tree: {reason}")
        self._check_idle()
        width, program = self.tree_width, self.compiled.tree
        most = MAX_DRAFT // width
        if isinstance(levels, bool) or not isinstance(levels, int) or not 1 <= levels <= most:
            raise ValueError(f"a tree {width} wide has 1..{most} levels ({MAX_DRAFT} nodes per request), "
                             f"got {levels!r}")
        if not tokens or len(tokens) > MemoryMap.MAX_INPUT_TOKENS:
            raise ValueError(f"a request takes 1..{MemoryMap.MAX_INPUT_TOKENS} input tokens (got "
                             f"{len(tokens)})")
        limit = self.compiled.context_limit
        need = self.committed + len(tokens) + (levels - 1) * width
        if need > limit:
            raise ContextFull(f"this tree request stores KV up to position {need} ({levels - 1} "
                              f"level(s) of {width} nodes above its inputs), the draft's context "
                              f"limit is {limit}; draft a shallower tree, shorten the prompt or "
                              "--max-new-tokens, or use a preset with more kv_positions")
        self._check_tokens(tokens)
        if topk is None:
            topk = self.topk_max if sample else width
        if not sample:
            topk = max(topk, width)     # the greedy expansion needs W candidates per source
        return self._start(tokens, levels, sample=sample, temperature=temperature, topk=topk,
                           seed=seed, counter=counter, tree_width=width, tree_pc=program.pc,
                           row_pitch=program.row_pitch)

    @property
    def tree(self) -> "_Tree | None":
        """The current sequence's last tree, while its accepted path is not committed."""
        return self._trees[self._current]

    def commit_tree_path(self, path: list[int]) -> int:
        """Commit the accepted path of the current sequence's last tree: ``path`` holds the
        record indices of its nodes from level 1 down (possibly empty). The first ``c =
        min(len(path), levels − 1, 16)`` of them have KV on the engine (level ``levels`` has
        none; a request compacts at most 16 levels); the next request of this sequence
        carries the :class:`~dfvg_hw.spec.descriptors.Compaction` that moves their KV to
        ``P0 … P0 + c − 1``, and ``committed = kv_length = P0 + c`` from now. Returns
        ``c``: the caller feeds ``path[c:]``'s tokens (and what follows) as the next
        request's inputs. ``ValueError`` for a path that is not one of the tree's, or with
        no tree to commit."""
        tree = self._trees[self._current]
        if tree is None:
            raise ValueError("no tree to commit a path of: draft_tree() first (a tree's path is "
                             "committed once, and a rollback forgets the tree)")
        if self._pending is not None and self._pending.sequence == self._current:
            raise RuntimeError("cannot commit a path while a draft request of this sequence is in "
                               "flight: collect() it first")
        parent = -1
        for level, node in enumerate(path):
            if not (level * tree.width <= node < (level + 1) * tree.width and node < len(tree.parents)
                    and tree.parents[node] == parent):
                raise ValueError(f"{list(path)} is not a root-to-node path of the tree (parents "
                                 f"{list(tree.parents)})")
            parent = node
        c = min(len(path), tree.levels - 1, MAX_COMPACT)
        rows = tuple(node - level * tree.width for level, node in enumerate(path[:c]))
        i = self._current
        self._trees[i] = None
        self._compactions[i] = Compaction(tree.base, tree.width, rows, self.slots_per_sequence) if c else None
        self._kv_lengths[i] = self._committed[i] = tree.base + c
        return c

    @_link_errors
    def poll(self, pending: "PendingDraft") -> bool:
        """Whether ``pending`` has finished, so that :meth:`collect` returns without waiting:
        one ``STATUS`` read (``DONE``, which ``START`` clears), nothing waited for and
        nothing committed. A host overlapping drafting with verification polls between
        its own work; ``RuntimeError`` for a request that is not in flight."""
        if pending is not self._pending or pending.resets != self.resets:
            raise RuntimeError("this draft request is not in flight (collected already, or the "
                               "device was reset since it was submitted)")
        return bool(self.io.read32(Reg.STATUS) & Status.DONE)

    @_link_errors
    def collect(self, pending: "PendingDraft") -> DraftOutput:
        """Wait for the interrupt of ``pending`` (what :meth:`submit` returned), read its
        result, check it against the descriptor contract, and commit its KV
        (``kv_length = committed = end_pos`` of the request's sequence). Raises what
        :meth:`draft` raises, with the committed KV unchanged, and ``RuntimeError`` for a
        request that is not the one in flight (collected already, or lost to a
        :meth:`reset`). Either way the request is no longer in flight afterwards."""
        if pending is not self._pending or pending.resets != self.resets:
            raise RuntimeError("this draft request is not in flight (collected already, or the "
                               "device was reset since it was submitted)")
        try:
            return self._collect(pending)
        except BaseException:
            self._failed(pending)
            raise
        finally:
            self._pending = None

    def _failed(self, pending: "PendingDraft") -> None:
        """After a tree request or a path compaction failed: only what the engine surely
        holds stays committed. A tree request leaves no logically ordered KV past its inputs;
        a compaction may or may not have run, so the path's levels fall back to ``P0``
        (a chain request without compaction changes nothing here)."""
        request, i = pending.request, pending.sequence
        if request.tree_width:
            self._kv_lengths[i] = min(self._kv_lengths[i], request.start_pos + len(request.tokens))
        comp = request.compaction
        if comp is not None:
            self._compactions[i] = None
            self._kv_lengths[i] = min(self._kv_lengths[i], comp.base)
            self._committed[i] = min(self._committed[i], comp.base)

    def _collect(self, pending: "PendingDraft") -> DraftOutput:
        request, buf, n_draft, index = pending.request, pending.buffer, pending.request.n_records, pending.sequence
        t = self.io
        try:
            self._wait()
        except DeviceTimeout as exc:
            raise DeviceTimeout(str(exc), self._aborted_tokens(buf, n_draft, index)) from None
        t.write32(Reg.IRQ_STATUS, Irq.DONE)
        error = self._error_code(t.read32(Reg.ERROR), "after the request")
        try:
            result = self._read_result(buf, n_draft)
        except MalformedResult:
            if error:   # the engine refused before writing a result (no program, bad request)
                raise DeviceFault(error, t.read32(Reg.ERROR_PC), []) from None
            raise
        if result.status != ErrorCode.OK:
            self._kv_lengths[index] = result.end_pos
            # Drafted tokens stay in the exception; the committed KV is unchanged.
            raise DeviceFault(result.status, result.error_pc, result.tokens)
        if error:
            # The result says OK, the register says otherwise: one of them is wrong.
            raise DeviceFault(error, t.read32(Reg.ERROR_PC), [])
        if len(result.tokens) != n_draft:
            what = (f"{n_draft} nodes ({request.n_draft} levels of {request.tree_width})"
                    if request.tree_width else f"{n_draft}")
            raise MalformedResult(f"the engine drafted {len(result.tokens)} tokens for a request of "
                                  f"{what} without an error status; the device is misbehaving")
        self._check_records(result, request, buf)
        self._compactions[index] = None
        if request.tree_width:
            base = request.start_pos + len(request.tokens)
            self._check_tree(result, request, buf)
            self._kv_lengths[index] = self._committed[index] = base
            self._trees[index] = _Tree(base, request.tree_width, request.n_draft,
                                       tuple(t.parent for t in result.tokens))
        else:
            self._kv_lengths[index] = self._committed[index] = result.end_pos
        return DraftOutput(result.tokens, result.cycles, result.end_pos, result.n_forward,
                           request.tree_width)

    def _check_records(self, result: DraftResult, request: DraftRequest, buf: int) -> None:
        """Hold a result with status OK to the descriptor contract (docs/isa.md §5.2).

        The check word catches a corrupted buffer; this catches what would pass it (a
        device or link that writes a consistent but wrong result). Above all, each drafted
        token must have q(token) > 0 under the top-k it reports: rejection sampling is
        lossless only when q is the distribution the token was drawn from.
        """
        def bad(why: str) -> MalformedResult:
            return MalformedResult(f"result buffer {buf} breaks the result contract: {why}; the "
                                   "device or the PCIe link corrupted it — reset the device")

        want_end = request.start_pos + len(request.tokens) + max(request.n_draft - 1, 0)
        if result.end_pos != want_end:
            raise bad(f"end_pos is {result.end_pos}, the request ends at {want_end}")
        if result.tokens and not 1 <= result.topk <= min(request.topk, self.topk_max):
            raise bad(f"top-k lists of {result.topk} for a request of topk {request.topk}")
        vocab = self.compiled.shape.vocab
        for i, d in enumerate(result.tokens):
            ids, probs = d.topk_ids, d.topk_probs
            if len(ids) != result.topk or len(set(ids)) != len(ids) or not all(0 <= x < vocab for x in ids):
                raise bad(f"draft {i}'s top-k ids {ids} are not {result.topk} distinct ids of the "
                          f"vocabulary of {vocab}")
            if sum(probs) != 1 << PROB_BITS:
                raise bad(f"draft {i}'s top-k probabilities sum to {sum(probs)}, not 2^{PROB_BITS}")
            if d.token not in ids:
                raise bad(f"draft {i} is token {d.token}, outside its top-k {ids} (q(token) = 0)")
            j = ids.index(d.token)
            if probs[j] == 0 or probs[j] != d.prob:
                raise bad(f"draft {i} (token {d.token}) reports probability {d.prob}, its top-k "
                          f"{probs[j]} (q(token) must be > 0 and equal)")
            if not request.sample and j != 0 and not request.tree_width:
                raise bad(f"greedy draft {i} is candidate {j} of its top-k, not the argmax")

    def _check_tree(self, result: DraftResult, request: DraftRequest, buf: int) -> None:
        """Hold a tree result (its records already checked one by one) to docs/isa.md §9.2:
        level 1's parent is the root and level d's parents lie in level d − 1; nodes with one
        parent carry its one top-k list (siblings come from one q, which the lossless rule
        needs); a sampled row continues its own branch; a greedy level is exactly the
        expansion of its parents' lists by path score (:func:`~dfvg_hw.spec.numerics.
        tree_expand_greedy`, over the parents whose lists the records show)."""
        def bad(why: str) -> MalformedResult:
            return MalformedResult(f"result buffer {buf} breaks the tree contract: {why}; the "
                                   "device or the PCIe link corrupted it — reset the device")

        width, nodes = request.tree_width, result.tokens
        lists: dict[int, tuple] = {}                 # parent -> the top-k its children came from
        for i, d in enumerate(nodes):
            level, row = divmod(i, width)
            first = (level - 1) * width
            if level == 0 and d.parent != -1 or level > 0 and not first <= d.parent < first + width:
                raise bad(f"node {i} (level {level + 1}, row {row}) has parent {d.parent}, "
                          + ("not the root" if level == 0 else f"not a node of level {level}"))
            if request.sample and level > 0 and d.parent != first + row:
                raise bad(f"sampled node {i} has parent {d.parent}, not its row's node {first + row}")
            source = (tuple(d.topk_ids), tuple(d.topk_probs))
            if lists.setdefault(d.parent, source) != source:
                raise bad(f"node {i} reports another top-k than its siblings under parent {d.parent}")
        if request.sample:
            return
        scores = {-1: TREE_SCORE_ROOT}
        for level in range(len(nodes) // width):
            sources = [-1] if level == 0 else list(range((level - 1) * width, level * width))
            probs = [list(lists[s][1]) if s in lists else [] for s in sources]
            rows = nodes[level * width:(level + 1) * width]
            try:
                want = tree_expand_greedy([scores[s] for s in sources], probs, width)
            except ValueError as exc:
                raise bad(f"level {level + 1}: {exc}") from None
            got = [(sources.index(d.parent), lists[d.parent][0].index(d.token)) for d in rows]
            if got != [(s, j) for s, j, _ in want]:
                raise bad(f"greedy level {level + 1} is (source, candidate) {got}, the expansion by "
                          f"path score gives {[(s, j) for s, j, _ in want]}")
            for r, (_, _, score) in enumerate(want):
                scores[level * width + r] = score

    def _wait_idle(self, what: str) -> int:
        """Poll STATUS until BUSY clears (commands other than START raise no interrupt on
        success); returns the final STATUS."""
        deadline = time.monotonic() + self.timeout_s
        while (status := self.io.read32(Reg.STATUS)) & Status.BUSY:
            if time.monotonic() >= deadline:
                raise DeviceTimeout(f"{what} did not finish within {self.timeout_s:g} s "
                                    f"(STATUS=0x{status:x}); check the device")
        return status

    def _wait(self) -> None:
        deadline = time.monotonic() + self.timeout_s
        while not self.io.wait_irq(max(0.0, deadline - time.monotonic())):
            status = self.io.read32(Reg.STATUS)
            if status & Status.DONE:
                return                  # finished; the interrupt was lost or is disabled
            if time.monotonic() >= deadline:
                self.io.write32(Reg.CONTROL, Control.ABORT)
                raise DeviceTimeout(f"the draft engine did not finish within {self.timeout_s:g} s "
                                    f"(STATUS=0x{status:x}); it was aborted. Check the device, or "
                                    "raise the timeout for slow simulators")

    def _aborted_tokens(self, buf: int, n_draft: int, index: int) -> list[DraftedToken]:
        """After an ABORT: the tokens of the result the engine writes when the abort lands
        (it stops before its next instruction), or none if it does not within
        :attr:`ABORT_GRACE_S`."""
        deadline = time.monotonic() + self.ABORT_GRACE_S
        while not self.io.read32(Reg.STATUS) & Status.DONE:
            if time.monotonic() >= deadline:
                return []
        try:
            result = self._read_result(buf, n_draft)
        except MalformedResult:
            return []
        self._kv_lengths[index] = result.end_pos
        return result.tokens

    def _read_result(self, buf: int, n_draft: int) -> DraftResult:
        raw = self.io.dma_read(self._at(MemoryMap.RESULT[buf]), result_bytes(self.topk_max, n_draft))
        try:
            result = DraftResult.unpack(raw, self.topk_max)
        except ValueError as exc:
            raise MalformedResult(f"result buffer {buf} is malformed: {exc}; the device or the PCIe "
                                  "link corrupted it — reset the device") from None
        if result.seq != self._seq:
            raise MalformedResult(f"result buffer {buf} is stale: it answers request {result.seq}, "
                                  f"not {self._seq}; the engine did not run the request — reset the "
                                  "device")
        if self._vocabulary is not None:
            result.tokens = [self._to_model(t, buf) for t in result.tokens]
        return result

    def _to_model(self, drafted: DraftedToken, buf: int) -> DraftedToken:
        """A drafted token with the engine's ids (a draft vocabulary's) as model ids."""
        try:
            token, *ids = self._vocabulary.to_model([drafted.token, *drafted.topk_ids])
        except IndexError as exc:
            raise MalformedResult(f"result buffer {buf} breaks the result contract: {exc}; the device "
                                  "or the PCIe link corrupted it — reset the device") from None
        return replace(drafted, token=token, topk_ids=ids)

    @_link_errors
    def cycles(self) -> tuple[int, int]:
        """(cycles of the last request, busy cycles since reset), from the counters."""
        t = self.io
        last = t.read32(Reg.CYCLES_LO) | (t.read32(Reg.CYCLES_HI) << 32)
        busy = t.read32(Reg.BUSY_CYCLES_LO) | (t.read32(Reg.BUSY_CYCLES_HI) << 32)
        return last, busy

    def close(self) -> None:
        self.transport.close()
