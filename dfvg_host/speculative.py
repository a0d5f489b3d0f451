"""Synchronous chain speculative decoding: draft γ on the device, verify on the target.

Faults and recovery
-------------------
A draft request that fails — a :class:`~dfvg_host.driver.DeviceLinkError` (a transport
error that outlived the driver's retries), :class:`~dfvg_host.driver.DeviceTimeout`,
:class:`~dfvg_host.driver.DeviceFault`, :class:`~dfvg_host.driver.MalformedResult` —
does not end the generation. The decoder resets the device (soft reset, identity check,
image and program reloaded: :meth:`~dfvg_host.driver.DraftDevice.reset`) and replays
the request, feeding the whole committed sequence again since the reset emptied the
engine's KV. At most ``max_recoveries`` resets are tried per generation; when they are
spent, when a reset cannot help (an error code the request itself provokes, or a token
the draft cannot take), the device is given up and generation goes on with the target
alone (plain decoding, a verifier round with no drafts), with a warning on the
``dfvg_host.speculative`` logger, ``GenerationOutput.degraded`` set and the fallback
counted in the metrics. With ``fallback=False`` it stops instead (``"device_error"``).
An exception in the verifier ends the generation with ``"verifier_error"`` and returns
the tokens generated before it.

What is guaranteed, whatever the device does:

* Greedy: the output is exactly the target's greedy decoding, token for token. Drafts
  only decide how many target tokens one forward pass yields, never which.
* Sampling: the output is distributed exactly as the target's sampling distribution.
  The driver refuses any draft whose q(token) is 0 or whose top-k is not a distribution
  (:class:`~dfvg_host.driver.MalformedResult`), and rejection sampling is lossless for
  any drafts as long as q is what the engine sampled from. When every fault is recovered
  by a replay, the output is moreover *identical* to the fault-free run with the same
  seed: the engine is deterministic, its RNG is counter based, the replay uses the same
  counter, and the verifier draws nothing for a failed request. After a fallback the
  target samples on its own, so the tokens differ from the fault-free run's (same
  distribution).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from dfvg_hw.spec.regmap import MemoryMap
from dfvg_host.acceptance import SamplingParams, Verdict, verify_round
from dfvg_host.driver import (ContextFull, DeviceFault, DeviceLinkError, DeviceTimeout, DraftDevice,
                              DraftDeviceError, DraftOutput, EngineMismatch, MalformedResult)
from dfvg_host.metrics import SpecDecodeMetrics
from dfvg_host.verifier import Verifier

__all__ = ["SpeculativeDecoder", "GenerationOutput", "DraftCursor", "STOP_REASONS", "fault_kind"]

log = logging.getLogger(__name__)

#: Why a generation ends (``GenerationOutput.stop_reason``).
STOP_REASONS = ("eos", "max_new_tokens", "context_limit", "device_error", "verifier_error")

_FAULT_KINDS = ((DeviceLinkError, "link"), (DeviceTimeout, "timeout"), (DeviceFault, "error_status"),
                (MalformedResult, "malformed"), (EngineMismatch, "mismatch"), (ContextFull, "context"))


def fault_kind(exc: BaseException) -> str:
    """The metrics' name for a draft-device failure (``SpecDecodeMetrics.device_faults_by_kind``)."""
    return next((name for cls, name in _FAULT_KINDS if isinstance(exc, cls)), "other")


@dataclass
class GenerationOutput:
    """Generated token ids (prompt excluded), why generation stopped, and the metrics.

    Members
    -------
    tokens : list of int
        Every token generated, including those before a fault or a verifier error.
    stop_reason : str
        Why generation ended (:data:`STOP_REASONS`): ``"eos"``, ``"max_new_tokens"``,
        ``"context_limit"`` (the draft engine's context is full; never once degraded, as
        the target alone is not bound by it), ``"device_error"`` (the draft device was
        given up and the decoder has ``fallback=False``) or ``"verifier_error"`` (the
        target raised; ``error`` holds the exception).
    metrics : SpecDecodeMetrics
    message : str
        For the user, with ``"context_limit"``, ``"device_error"`` and
        ``"verifier_error"``; empty otherwise.
    degraded : bool
        The draft device was given up during this generation: the tokens from then on
        come from the target alone (``metrics.fallback_tokens``). The output is still
        exactly what the decoding rule gives (see the module docstring).
    fallback_reason : str
        Why the device was given up (its last error and the recoveries tried); empty when
        not degraded.
    faults : list of str
        Every draft-device failure met in this generation, recovered or not, in order.
    error : Exception or None
        The verifier's exception, with ``"verifier_error"``.
    """
    tokens: list[int]
    stop_reason: str
    metrics: SpecDecodeMetrics
    message: str = ""
    degraded: bool = False
    fallback_reason: str = ""
    faults: list[str] = field(default_factory=list)
    error: Exception | None = None


@dataclass
class DraftCursor:
    """Where one sequence stands on the draft engine: the tokens it has not consumed yet
    and the RNG counter of its next draft (the engine's RNG is counter based).

    Members
    -------
    inputs : list of int
        Committed tokens the engine holds no KV for yet; the next request feeds them.
    counter : int
    """
    inputs: list[int] = field(default_factory=list)
    counter: int = 0

    def propose(self, device: DraftDevice, n: int, sampling: SamplingParams,
                metrics: SpecDecodeMetrics, *,
                max_input_tokens: int = MemoryMap.MAX_INPUT_TOKENS) -> DraftOutput:
        """Feed :attr:`inputs` and draft ``n`` tokens; inputs longer than
        ``max_input_tokens`` (a replay after a reset feeds the whole sequence) go first in
        requests that draft nothing."""
        limit = max_input_tokens
        while len(self.inputs) > limit:
            head = device.draft(self.inputs[:limit], 0)
            metrics.device_cycles += head.cycles
            self.inputs = self.inputs[limit:]
        greedy = sampling.greedy
        out = device.draft(self.inputs, n, sample=not greedy,
                           temperature=1.0 if greedy else sampling.temperature,
                           topk=1 if greedy else (sampling.top_k or device.topk_max),
                           seed=sampling.seed, counter=self.counter)
        self.counter += n
        return out

    def advance(self, device: DraftDevice, n: int, drafts: list[int], verdict: Verdict) -> None:
        """After a round that drafted ``n`` tokens (0: none), keep the KV of what the
        target accepted and queue what the engine has not seen."""
        if n > 0:
            # The engine holds KV for its inputs and all drafts but the last.
            device.rollback(device.kv_length - (n - 1) + min(verdict.accepted, n - 1))
            self.inputs = ([drafts[-1]] if verdict.accepted == n else []) + [verdict.next_token]
        else:
            self.inputs = self.inputs + [verdict.next_token]


@dataclass
class _Run:
    """One generation's account of device faults."""
    metrics: SpecDecodeMetrics
    faults: list[str] = field(default_factory=list)
    recoveries: int = 0
    fallback_reason: str = ""


class SpeculativeDecoder:
    """Chain speculative decoding with a fixed γ, surviving draft-device faults.

    Members
    -------
    draft : DraftDevice
    verifier : Verifier
    gamma : int
    sampling : SamplingParams
    eos_token_id : int or None
    max_recoveries : int
        Device resets (each followed by a replay) tried per generation before the device
        is given up.
    fallback : bool
        Whether generation goes on with the target alone once the device is given up
        (else it stops with ``"device_error"``; a benchmark that must not measure the
        target alone may want that).
    max_input_tokens : int
        Most tokens fed per request; longer inputs (a replay after a reset feeds the
        whole sequence) go in several requests that draft nothing but the last.
    """

    max_input_tokens = MemoryMap.MAX_INPUT_TOKENS

    def __init__(self, draft: DraftDevice, verifier: Verifier, *, gamma: int = 4,
                 sampling: SamplingParams = SamplingParams(), eos_token_id: int | None = None,
                 max_recoveries: int = 2, fallback: bool = True):
        if gamma < 1:
            raise ValueError(f"gamma must be at least 1, got {gamma}")
        if max_recoveries < 0:
            raise ValueError(f"max_recoveries must be >= 0, got {max_recoveries}")
        if draft.compiled.shape.vocab > verifier.vocab_size:
            raise ValueError(f"the draft's vocabulary ({draft.compiled.shape.vocab}) is larger than "
                             f"the target's ({verifier.vocab_size}); they must share a tokenizer")
        self.draft = draft
        self.verifier = verifier
        self.gamma = gamma
        self.sampling = sampling.validate()
        self.eos_token_id = eos_token_id
        self.max_recoveries = max_recoveries
        self.fallback = fallback
        # Set when a generation gave the device up: the next one resets it first.
        self._device_suspect = False
        # The verifier's own rejection-sampling stream, independent of the device's seed.
        self._generator = torch.Generator().manual_seed(sampling.seed ^ 0x5EED)

    # -- the draft side ------------------------------------------------------------------
    def _fault(self, run: _Run, exc: DraftDeviceError, what: str) -> None:
        run.metrics.record_fault(fault_kind(exc))
        run.faults.append(f"{what}: {exc}")
        log.info("draft device fault (%s): %s", what, exc)

    def _give_up(self, run: _Run, reason: str, *, device_suspect: bool = True) -> None:
        run.fallback_reason = reason
        self._device_suspect = self._device_suspect or device_suspect
        if self.fallback:
            log.warning("the draft device is given up for this generation: %s; generation goes on "
                        "with the target alone (plain decoding, same output)", reason)

    def _recover(self, run: _Run, state: DraftCursor, seq: list[int], cause: str) -> bool:
        """Reset the device and point ``state`` at the whole committed sequence, within
        the generation's budget; False (and the device given up) when it is spent."""
        while run.recoveries < self.max_recoveries:
            run.recoveries += 1
            run.metrics.device_resets += 1
            try:
                self.draft.reset()
            except DraftDeviceError as exc:
                self._fault(run, exc, "reset")
                cause = f"the reset failed: {exc}"
                continue
            state.inputs = list(seq)
            self._device_suspect = False
            return True
        self._give_up(run, f"{cause} (after {run.recoveries} reset(s) of {self.max_recoveries} "
                           "allowed per generation)")
        return False

    def _draft_or_give_up(self, run: _Run, state: DraftCursor, seq: list[int],
                          n: int) -> DraftOutput | None:
        """Draft ``n`` tokens after ``seq``, recovering from device faults; None when the
        device was given up."""
        vocab = self.draft.compiled.shape.vocab
        outside = next((t for t in state.inputs if not 0 <= t < vocab), None)
        if outside is not None:
            self._give_up(run, f"the target chose token {outside}, outside the draft's vocabulary "
                               f"of {vocab}", device_suspect=False)
            return None
        while True:
            try:
                return state.propose(self.draft, n, self.sampling, run.metrics,
                                     max_input_tokens=self.max_input_tokens)
            except DraftDeviceError as exc:
                self._fault(run, exc, "draft request")
                if isinstance(exc, ContextFull) or (isinstance(exc, DeviceFault) and exc.request_caused):
                    self._give_up(run, f"{exc} (a reset cannot help: the engine would refuse the "
                                       "same request again)")
                    return None
                if not self._recover(run, state, seq, str(exc)):
                    return None

    # -- a generation --------------------------------------------------------------------
    def generate(self, prompt: list[int], max_new_tokens: int,
                 on_tokens: Callable[[list[int]], None] | None = None) -> GenerationOutput:
        """Generate up to ``max_new_tokens`` after ``prompt``; ``on_tokens`` streams each round.

        Raises ``ValueError`` for an empty prompt or one that does not fit the draft's
        context; everything else the device or the target does ends up in the returned
        :class:`GenerationOutput` with the tokens generated so far (module docstring).
        """
        t_start = time.perf_counter()
        m = SpecDecodeMetrics(gamma=self.gamma, device_clock_hz=self.draft.clock_hz,
                              device_cycle_source=getattr(self.draft, "cycle_source",
                                                          "measured: engine counters"),
                              prefill_tokens=len(prompt))
        link0 = self.draft.transport.stats.snapshot()
        retries0 = self.draft.transport_retries
        verifier_s0, forwards0 = self.verifier.seconds, self.verifier.forwards
        limit = self.draft.compiled.context_limit
        if not prompt:
            raise ValueError("the prompt must contain at least one token")
        if len(prompt) >= limit:
            raise ValueError(f"the prompt has {len(prompt)} tokens; the draft's context limit is "
                             f"{limit}. Shorten the prompt or use a preset with more kv_positions")
        run = _Run(m)
        out: list[int] = []
        seq = list(prompt)                     # the committed sequence: prompt + out
        state = DraftCursor(inputs=list(prompt))
        stop, message, error = "max_new_tokens", "", None
        sim_s = 0.0
        use_device = True
        try:
            self.verifier.prefill(prompt)
        except Exception as exc:             # noqa: BLE001 - returned, not lost
            stop, message, error = "verifier_error", _verifier_message(exc, 0), exc
            max_new_tokens = 0
        if max_new_tokens > 0:
            t0 = time.perf_counter()
            if self._device_suspect:
                use_device = self._recover(run, state, seq, "the device was given up in the last "
                                           "generation and does not come back")
            else:
                self.draft.rollback(0)
            sim_s += time.perf_counter() - t0
        while len(out) < max_new_tokens:
            remaining = max_new_tokens - len(out)
            n = 0
            if use_device:
                room = limit - (self.draft.committed + len(state.inputs)) + 1
                if room < 1:
                    stop = "context_limit"
                    message = (f"stopped at the draft engine's context limit of {limit} positions; "
                               "use a preset with more kv_positions for longer generations")
                    break
                n = min(self.gamma, remaining - 1, room)
            d = None
            if n > 0:
                t0 = time.perf_counter()
                d = self._draft_or_give_up(run, state, seq, n)
                sim_s += time.perf_counter() - t0
                if d is None:
                    use_device, n = False, 0
            if not use_device and not self.fallback:
                stop, message = "device_error", run.fallback_reason
                break
            drafts, q_tokens = (d.ids, d.tokens) if d is not None else ([], [])
            if d is not None:
                m.device_cycles += d.cycles
            try:
                verdict = verify_round(self.verifier.score(drafts), drafts, q_tokens, self.sampling,
                                       self._generator)
                self.verifier.commit(verdict.accepted, len(drafts), verdict.next_token)
            except Exception as exc:         # noqa: BLE001 - returned, not lost
                stop, message, error = "verifier_error", _verifier_message(exc, len(out)), exc
                break
            if verdict.invalid_q:
                m.record_fault("malformed")
                run.faults.append(f"verification: draft {verdict.accepted} has q(token) = 0; the "
                                  "round ended there with a token from the target")
            new = drafts[:verdict.accepted] + [verdict.next_token]
            if use_device:
                state.advance(self.draft, n, drafts, verdict)
            m.record_round(n, verdict.accepted, len(new))
            if self.eos_token_id is not None and self.eos_token_id in new:
                new = new[:new.index(self.eos_token_id) + 1]
                stop = "eos"
            new = new[:remaining]
            out += new
            seq += new
            if not use_device:
                m.fallback_rounds += 1
                m.fallback_tokens += len(new)
            if on_tokens:
                on_tokens(new)
            if stop == "eos":
                break
        m.emitted_tokens = len(out)
        m.verifier_seconds = self.verifier.seconds - verifier_s0
        m.target_forward_passes = self.verifier.forwards - forwards0
        link = self.draft.transport.stats.since(link0)
        m.pcie_bytes, m.pcie_transfers, m.pcie_seconds = link.bytes, link.dma_transfers, link.seconds
        m.transport_retries = self.draft.transport_retries - retries0
        m.simulator_seconds = sim_s
        m.host_seconds = max(0.0, time.perf_counter() - t_start - m.verifier_seconds - sim_s)
        return GenerationOutput(out, stop, m, message, degraded=bool(run.fallback_reason),
                                fallback_reason=run.fallback_reason, faults=run.faults, error=error)


def _verifier_message(exc: Exception, kept: int) -> str:
    return (f"the target model failed ({type(exc).__name__}: {exc}); the {kept} tokens generated "
            "before it are kept")
