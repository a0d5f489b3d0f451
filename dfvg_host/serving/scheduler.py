"""Continuous batching of speculative decoding: many sequences, one engine, one forward.

A round, for every running sequence at once::

    draft engine:  select sequence s → feed its new tokens, draft γ   (one request each,
                   each sequence in its own KV slots: DraftDevice.select_sequence)
    target:        score [pending + drafts] of every sequence          (ONE batched forward,
                   BatchVerifier: per-sequence KV, padding and masks)
    host:          accept per sequence (greedy or lossless rejection sampling), crop the
                   target's and the engine's KV to what was accepted, stream the tokens

Sequences join between rounds (their prompt prefilled on the target, fed to the engine
by their first draft request) and leave when done or cancelled, freeing their slots. At
most ``capacity`` sequences run; up to ``max_waiting`` more wait; beyond that
:meth:`Scheduler.submit` raises :class:`Overloaded` (the server's 429).

When more sequences run than the engine's KV slots hold (``DraftDevice.max_sequences``),
the first ones in keep a slot until they end; the others decode with the target alone
(one token per round, in the same batched forward) until a slot frees, and then re-feed
their whole committed sequence to the engine: a re-prefill, whose engine cycles are
counted like any other (:attr:`Scheduler.reprefills`, :attr:`Scheduler.reprefill_tokens`).
A slot never changes hands while its sequence runs, so nothing thrashes.

Each sequence decodes exactly as alone: greedy output is the target's greedy decoding,
sampled output follows the target's distribution, with a rejection-sampling generator and
an engine RNG counter of its own (so a seed gives the same tokens whatever runs beside it,
up to the float rounding of a batched forward).

Device faults: a failed request resets the engine (which empties every sequence's KV: all
of them are fed again from their committed tokens) within ``max_recoveries`` resets in a
row; then the engine is given up and every sequence goes on with the target alone (plain
decoding, same output). With no device at all (``device=None``) the scheduler is
target-only serving with the same batching: the baseline the benchmarks compare with.

Time: the draft engine's time is modelled (cycle model or the engine's counters), the
simulator that stands in for it takes real wall time. Every sequence's latency is
therefore given twice: measured wall, and *projected* = wall − simulator wall + modelled
engine and PCIe time over the rounds it lived through (:attr:`Sequence.projected_latency`).
"""

from __future__ import annotations

import collections
import itertools
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from dfvg_host.acceptance import SamplingParams, verify_round
from dfvg_host.driver import ContextFull, DeviceFault, DraftDevice, DraftDeviceError
from dfvg_host.metrics import SpecDecodeMetrics
from dfvg_host.speculative import DraftCursor, fault_kind

__all__ = ["Scheduler", "Sequence", "Overloaded", "FINISH_REASONS"]

log = logging.getLogger(__name__)

#: Why a sequence ends: ``stop`` (end-of-sequence token, or the server found a stop
#: string), ``length`` (max_tokens), ``cancelled`` (the client went away), ``error`` (the
#: target failed; the tokens before it are kept).
FINISH_REASONS = ("stop", "length", "cancelled", "error")


class Overloaded(Exception):
    """Every running place and every waiting place is taken; try again in
    ``retry_after_s`` seconds."""

    def __init__(self, message: str, retry_after_s: int):
        super().__init__(message)
        self.retry_after_s = retry_after_s


#: (sequence, new tokens, finish reason or None); called on the scheduler's thread.
EventCallback = Callable[["Sequence", list[int], "str | None"], None]


@dataclass(eq=False)
class Sequence:
    """One request being decoded.

    Members
    -------
    id : int
    prompt : list of int
    max_tokens : int
    sampling : SamplingParams
    tokens : list of int
        Generated so far (prompt excluded); streamed through ``on_event`` as they come.
    finish_reason : str or None
        :data:`FINISH_REASONS`, once finished.
    message : str
        With ``"error"``: what failed.
    metrics : SpecDecodeMetrics
        This sequence's rounds, drafts and acceptances.
    slot : int or None
        The engine sequence (KV slots) it holds, if any: a running sequence without one
        decodes with the target alone until one frees.
    """
    id: int
    prompt: list[int]
    max_tokens: int
    sampling: SamplingParams
    on_event: EventCallback
    tokens: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    message: str = ""
    metrics: SpecDecodeMetrics = field(default_factory=SpecDecodeMetrics)
    slot: int | None = None
    cursor: DraftCursor = field(default_factory=DraftCursor)
    use_device: bool = True
    submitted_at: float = 0.0
    first_token_at: float | None = None
    finished_at: float | None = None
    offset_submitted: float = 0.0
    offset_first_token: float = 0.0
    offset_finished: float = 0.0
    done: threading.Event = field(default_factory=threading.Event)
    cancel_requested: bool = False
    cancel_reason: str = "cancelled"
    generator: torch.Generator | None = None

    def cancel(self, reason: str = "cancelled") -> None:
        """Stop decoding at the next round boundary and free the slot (thread safe)."""
        self.cancel_reason = reason
        self.cancel_requested = True

    @property
    def committed(self) -> list[int]:
        return self.prompt + self.tokens

    @property
    def latency(self) -> float:
        """Measured wall seconds from submission to the end."""
        return (self.finished_at or time.perf_counter()) - self.submitted_at

    @property
    def projected_latency(self) -> float:
        """:attr:`latency` with the simulator's wall replaced by modelled engine + PCIe time."""
        return self.latency - (self.offset_finished - self.offset_submitted)

    @property
    def projected_ttft(self) -> float | None:
        """Projected seconds to the first token (None before it)."""
        if self.first_token_at is None:
            return None
        return (self.first_token_at - self.submitted_at) - (self.offset_first_token - self.offset_submitted)


class Scheduler:
    """Runs rounds of speculative decoding over every admitted sequence, on its own thread.

    Members
    -------
    verifier : BatchVerifier
    device : DraftDevice or None
        None: target-only serving (no drafts), with the same batching.
    gamma : int
    capacity : int
        Sequences decoded at once (``max_num_seqs``); those beyond the engine's
        ``max_sequences`` (its KV slots) wait for a slot to draft.
    max_waiting : int
    context_limit : int
        Most positions a sequence may reach (prompt + max_tokens): the draft's context
        limit and the target's ``max_position_embeddings``, whichever is smaller.
    metrics : SpecDecodeMetrics
        Every round of every sequence, and the engine's cycles, faults and resets.
    finished : collections.Counter
        Sequences ended, by finish reason.
    reprefills, reprefill_tokens : int
        Sequences that got a slot after decoding without one, and the committed tokens
        they fed the engine again.
    projection_offset : float
        Simulator wall − modelled engine and PCIe seconds, summed over every device call
        so far (what a sequence's projected latency subtracts).
    """

    def __init__(self, verifier, device: DraftDevice | None, *, gamma: int = 4, max_num_seqs: int = 16,
                 max_waiting: int | None = None, eos_token_id: int | None = None,
                 max_recoveries: int = 2):
        if gamma < 0 or max_num_seqs < 1:
            raise ValueError("gamma must be >= 0 and max_num_seqs >= 1")
        self.verifier = verifier
        self.device = device
        self.gamma = gamma if device is not None else 0
        self.capacity = max_num_seqs
        self.max_waiting = self.capacity if max_waiting is None else max_waiting
        self.eos_token_id = eos_token_id
        self.max_recoveries = max_recoveries
        target_limit = getattr(verifier.model.config.get_text_config(), "max_position_embeddings",
                               None) or 1 << 30
        draft_limit = device.compiled.context_limit if device is not None else 1 << 30
        self.context_limit = min(target_limit, draft_limit)
        self.metrics = SpecDecodeMetrics(gamma=self.gamma,
                                         device_clock_hz=device.clock_hz if device else 0.0,
                                         device_cycle_source=getattr(device, "cycle_source", ""))
        self.finished: collections.Counter = collections.Counter()
        self.projection_offset = 0.0
        self.device_given_up = ""
        self.reprefills = 0
        self.reprefill_tokens = 0
        self._ids = itertools.count(1)
        self._waiting: collections.deque[Sequence] = collections.deque()
        self._running: list[Sequence] = []
        self._free_slots = list(range(device.max_sequences)) if device is not None else []
        self._lock = threading.Condition()
        self._thread: threading.Thread | None = None
        self._stop = False
        self._failed_in_a_row = 0

    # -- the caller's side (any thread) ----------------------------------------------------
    @property
    def running(self) -> int:
        return len(self._running)

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def check_request(self, prompt_tokens: int, max_tokens: int) -> None:
        """A ``ValueError`` that says what to change when the prompt and ``max_tokens``
        do not fit the context."""
        if prompt_tokens >= self.context_limit:
            raise ValueError(f"the prompt has {prompt_tokens} tokens; the context holds "
                             f"{self.context_limit} positions. Shorten the prompt")
        if prompt_tokens + max_tokens > self.context_limit:
            raise ValueError(f"max_tokens {max_tokens} with a prompt of {prompt_tokens} tokens needs "
                             f"{prompt_tokens + max_tokens} positions; the context holds "
                             f"{self.context_limit}. Lower max_tokens to at most "
                             f"{self.context_limit - prompt_tokens}")

    def submit(self, prompt: list[int], max_tokens: int, sampling: SamplingParams,
               on_event: EventCallback) -> Sequence:
        """Queue a request; raises ``ValueError`` (it does not fit the context) or
        :class:`Overloaded`."""
        self.check_request(len(prompt), max_tokens)
        sampling.validate()
        with self._lock:
            if len(self._running) + len(self._waiting) >= self.capacity + self.max_waiting:
                raise Overloaded(f"the server is decoding {len(self._running)} sequences with "
                                 f"{len(self._waiting)} waiting, its limit; retry shortly",
                                 retry_after_s=1)
            seq = Sequence(next(self._ids), list(prompt), max_tokens, sampling, on_event,
                           metrics=SpecDecodeMetrics(gamma=self.gamma),
                           submitted_at=time.perf_counter(), offset_submitted=self.projection_offset)
            seq.generator = torch.Generator().manual_seed(sampling.seed ^ 0x5EED)
            self._waiting.append(seq)
            self._lock.notify()
        return seq

    def end(self, seq: Sequence, reason: str) -> None:
        """End ``seq`` now for the caller (a stop string it found): its latency ends here,
        its place is freed at the next round boundary."""
        if seq.finished_at is None:
            seq.finished_at = time.perf_counter()
            seq.offset_finished = self.projection_offset
        seq.cancel(reason)

    def start(self) -> "Scheduler":
        self._thread = threading.Thread(target=self._loop, name="dfvg-scheduler", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        with self._lock:
            self._stop = True
            self._lock.notify()
        if self._thread is not None:
            self._thread.join()

    # -- the scheduler's thread ------------------------------------------------------------
    def _loop(self) -> None:
        while True:
            with self._lock:
                while not self._stop and not self._waiting and not self._running:
                    self._lock.wait()
                if self._stop:
                    break
            try:
                self._drop_cancelled()
                self._admit()
                if self._running:
                    self.step()
            except Exception as exc:         # noqa: BLE001 - the server keeps serving
                self._fail_running(exc)
        for seq in self._running + list(self._waiting):
            self._finish(seq, "cancelled")

    def _fail_running(self, exc: Exception) -> None:
        """A round failed where nothing expected it: end the running sequences with their
        tokens (``"error"``) and go on with the next requests."""
        log.exception("a scheduler round failed; its sequences end with the tokens they have")
        for seq in list(self._running):
            if seq.id in self.verifier:
                try:
                    self.verifier.remove(seq.id)
                except Exception:            # noqa: BLE001 - the sequence ends either way
                    pass
            self._finish(seq, "error", f"internal error ({type(exc).__name__}: {exc}); the "
                         f"{len(seq.tokens)} tokens generated before it are kept")

    def _admit(self) -> None:
        while True:
            with self._lock:
                if not self._waiting or len(self._running) >= self.capacity:
                    return
                seq = self._waiting.popleft()
            if seq.cancel_requested:
                self._finish(seq, seq.cancel_reason)
                continue
            try:
                self.verifier.add(seq.id, seq.prompt)
            except Exception as exc:         # noqa: BLE001 - ends this sequence, not the server
                self._finish(seq, "error", f"the target failed on the prompt: {exc}")
                continue
            seq.cursor = DraftCursor(inputs=list(seq.prompt))
            self._running.append(seq)

    def _give_slots(self) -> None:
        """Free slots to the running sequences without one, first in first served; one that
        has generated tokens already re-feeds them all (a re-prefill)."""
        if self.device is None or self.device_given_up:
            return
        for seq in self._running:
            if not self._free_slots:
                return
            if seq.slot is not None:
                continue
            seq.slot = self._free_slots.pop(0)
            self.device.select_sequence(seq.slot)
            self.device.rollback(0)
            if seq.tokens:
                self.reprefills += 1
                self.reprefill_tokens += len(seq.committed)
            # The RNG counter goes on: a draw is never made twice with one counter.
            seq.cursor = DraftCursor(inputs=list(seq.committed), counter=seq.cursor.counter)

    def _drop_cancelled(self) -> None:
        for seq in [s for s in self._running if s.cancel_requested]:
            self._finish(seq, seq.cancel_reason)

    def _finish(self, seq: Sequence, reason: str, message: str = "") -> None:
        seq.finish_reason, seq.message = reason, message
        if seq.finished_at is None:
            seq.finished_at = time.perf_counter()
            seq.offset_finished = self.projection_offset
        if seq in self._running:
            self._running.remove(seq)
            if seq.id in self.verifier:
                self.verifier.remove(seq.id)
        if seq.slot is not None:
            self._free_slots.append(seq.slot)
            seq.slot = None
        self.finished[reason] += 1
        seq.done.set()
        seq.on_event(seq, [], reason)

    def _draft_count(self, seq: Sequence) -> int:
        if self.device is None or not seq.use_device or self.device_given_up or seq.slot is None:
            return 0
        remaining = seq.max_tokens - len(seq.tokens)
        room = self.context_limit - (self.device.committed + len(seq.cursor.inputs)) + 1
        return max(0, min(self.gamma, remaining - 1, room))

    def _draft(self, seq: Sequence, n: int):
        """Seq's drafts (None: this round it has none), recovering from device faults."""
        dev = self.device
        while not self.device_given_up:
            dev.select_sequence(seq.slot)
            before = dev.transport.stats.snapshot()
            t0 = time.perf_counter()
            try:
                out = seq.cursor.propose(dev, n, seq.sampling, seq.metrics)
            except DraftDeviceError as exc:
                self._account_device(time.perf_counter() - t0, 0, dev.transport.stats.since(before))
                self.metrics.record_fault(fault_kind(exc))
                log.info("draft device fault on sequence %d: %s", seq.id, exc)
                if isinstance(exc, ContextFull) or (isinstance(exc, DeviceFault) and exc.request_caused):
                    seq.use_device = False          # this sequence goes on with the target alone
                    return None
                self._reset_device(str(exc))
                continue
            self._failed_in_a_row = 0
            self._account_device(time.perf_counter() - t0, out.cycles, dev.transport.stats.since(before))
            return out
        return None

    def _account_device(self, wall_s: float, cycles: int, link) -> None:
        self.metrics.device_cycles += cycles
        self.metrics.pcie_bytes += link.bytes
        self.metrics.pcie_transfers += link.dma_transfers
        self.metrics.pcie_seconds += link.seconds
        self.metrics.simulator_seconds += wall_s
        modelled = cycles / self.device.clock_hz if self.device.clock_hz else 0.0
        self.projection_offset += wall_s - modelled - link.seconds

    def _reset_device(self, cause: str) -> None:
        """Reset the engine and feed every running sequence again; give it up when the
        resets in a row are spent."""
        while self._failed_in_a_row < self.max_recoveries:
            self._failed_in_a_row += 1
            self.metrics.device_resets += 1
            try:
                self.device.reset()
            except DraftDeviceError as exc:
                self.metrics.record_fault(fault_kind(exc))
                cause = f"the reset failed: {exc}"
                continue
            for seq in self._running:
                seq.cursor.inputs = list(seq.committed)
            return
        self.device_given_up = (f"{cause} (after {self._failed_in_a_row} resets in a row); every "
                                "sequence goes on with the target alone")
        log.warning("the draft device is given up: %s", self.device_given_up)

    def step(self) -> None:
        """One round over every running sequence."""
        self._give_slots()
        plan = []
        for seq in self._running:
            n = self._draft_count(seq)
            out = self._draft(seq, n) if n > 0 else None
            if out is None:
                plan.append((seq, 0, [], [], 0))
            else:
                seq.metrics.device_cycles += out.cycles
                plan.append((seq, n, out.ids, out.tokens, self.device.resets))
        try:
            logits = self.verifier.score({seq.id: drafts for seq, _, drafts, _, _ in plan})
        except Exception as exc:             # noqa: BLE001 - ends these sequences, not the server
            for seq, *_ in plan:
                self._finish(seq, "error", f"the target failed ({type(exc).__name__}: {exc}); the "
                             f"{len(seq.tokens)} tokens generated before it are kept")
            return
        for seq, n, drafts, q_tokens, resets in plan:
            # A reset after this sequence drafted emptied the KV its drafts went into.
            lost = n > 0 and resets != self.device.resets
            self._conclude(seq, n, drafts, q_tokens, logits[seq.id], kv_lost=lost)

    def _conclude(self, seq: Sequence, n: int, drafts: list[int], q_tokens, logits, *,
                  kv_lost: bool) -> None:
        verdict = verify_round(logits, drafts, q_tokens, seq.sampling, seq.generator)
        self.verifier.commit(seq.id, verdict.accepted, len(drafts), verdict.next_token)
        new = drafts[:verdict.accepted] + [verdict.next_token]
        finish = None
        if self.eos_token_id is not None and self.eos_token_id in new:
            new = new[:new.index(self.eos_token_id) + 1]
            finish = "stop"
        new = new[:seq.max_tokens - len(seq.tokens)]
        if self.device is not None and not self.device_given_up and seq.slot is not None:
            if kv_lost:
                seq.cursor.inputs = seq.committed + new
            else:
                self.device.select_sequence(seq.slot)
                seq.cursor.advance(self.device, n, drafts, verdict)
        seq.tokens += new
        for m in (seq.metrics, self.metrics):
            m.record_round(n, verdict.accepted, len(new))
            if self.device_given_up:
                m.fallback_rounds += 1
                m.fallback_tokens += len(new)
        if finish is None and len(seq.tokens) >= seq.max_tokens:
            finish = "length"
        if seq.first_token_at is None:
            seq.first_token_at = time.perf_counter()
            seq.offset_first_token = self.projection_offset
        seq.on_event(seq, new, None)
        if finish:
            self._finish(seq, finish)
