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
from dfvg_host.adaptive import AdaptiveLength, RoundFacts
from dfvg_host.driver import (ContextFull, DeviceFault, DeviceLinkError, DeviceTimeout, DraftDevice,
                              DraftDeviceError, DraftOutput, EngineMismatch, MalformedResult,
                              PendingDraft)
from dfvg_host.metrics import SpecDecodeMetrics
from dfvg_host.timeline import Timeline
from dfvg_host.verifier import Verifier

__all__ = ["SpeculativeDecoder", "GenerationOutput", "GenerationRun", "DraftCursor", "STOP_REASONS", "fault_kind",
           "verifier_message", "tokens_to_emit", "matched_prefix"]

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
    timeline : Timeline or None
        The generation's spans on the projected clock (:mod:`dfvg_host.timeline`).
    """
    tokens: list[int]
    stop_reason: str
    metrics: SpecDecodeMetrics
    message: str = ""
    degraded: bool = False
    fallback_reason: str = ""
    faults: list[str] = field(default_factory=list)
    error: Exception | None = None
    timeline: Timeline | None = None


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

    @staticmethod
    def request_options(device: DraftDevice, sampling: SamplingParams) -> dict:
        """The sampling options of a draft request (``sample``, ``temperature``, ``topk``,
        ``seed``) for ``sampling``."""
        greedy = sampling.greedy
        return dict(sample=not greedy, temperature=1.0 if greedy else sampling.temperature,
                    topk=1 if greedy else (sampling.top_k or device.topk_max), seed=sampling.seed)

    def propose(self, device: DraftDevice, n: int, sampling: SamplingParams,
                metrics: SpecDecodeMetrics, *,
                max_input_tokens: int = MemoryMap.MAX_INPUT_TOKENS) -> DraftOutput:
        """Feed :attr:`inputs` and draft ``n`` tokens: :meth:`submit`, then :meth:`collect`."""
        return self.collect(device, self.submit(device, n, sampling, metrics,
                                                max_input_tokens=max_input_tokens))

    def submit(self, device: DraftDevice, n: int, sampling: SamplingParams,
               metrics: SpecDecodeMetrics, *,
               max_input_tokens: int = MemoryMap.MAX_INPUT_TOKENS) -> PendingDraft:
        """Start the request that feeds :attr:`inputs` and drafts ``n`` tokens; inputs
        longer than ``max_input_tokens`` (a replay after a reset feeds the whole
        sequence) go first, waited for, in requests that draft nothing."""
        limit = max_input_tokens
        while len(self.inputs) > limit:
            head = device.draft(self.inputs[:limit], 0)
            metrics.device_cycles += head.cycles
            self.inputs = self.inputs[limit:]
        return self._request(device, n, sampling)

    def _request(self, device: DraftDevice, n: int, sampling: SamplingParams) -> PendingDraft:
        """Start the request that feeds :attr:`inputs` (short enough) and drafts ``n``."""
        return device.submit(self.inputs, n, counter=self.counter,
                             **self.request_options(device, sampling))

    def collect(self, device: DraftDevice, pending: PendingDraft) -> DraftOutput:
        """Wait for ``pending`` (what :meth:`submit` started); the RNG counter moves past
        its drafts (a tree's nodes) only when it succeeds, so a replay draws the same tokens."""
        out = device.collect(pending)
        self.counter += pending.request.n_records
        return out

    def advance(self, device: DraftDevice, n: int, drafts: list[int], verdict: Verdict, *,
                end: int | None = None) -> None:
        """After a round that drafted ``n`` tokens (0: none), keep the KV of what the
        target accepted and queue what the engine has not seen. ``end`` is the engine's
        KV length right after the round's drafts (default ``kv_length``: nothing ran
        since)."""
        self.follow(device, n, drafts, drafts[:verdict.accepted] + [verdict.next_token], end=end)

    def follow(self, device: DraftDevice, n: int, drafts: list[int], committed: list[int], *,
               end: int | None = None) -> None:
        """After a round in which this sequence drafted ``drafts`` (``n`` of them; 0: none)
        and the target committed ``committed`` (whatever drafts it accepted — this
        cursor's or another drafter's — then its own token): keep the KV of the drafts
        that ``committed`` begins with and queue the committed tokens the engine has not
        seen. ``end`` as in :meth:`advance`."""
        if n > 0:
            # The engine holds KV for its inputs and all drafts but the last; the last
            # committed token is fed again whatever it holds: the next draft starts from
            # its logits.
            kept = min(matched_prefix(drafts, committed), n - 1, len(committed) - 1)
            end = device.kv_length if end is None else end
            device.rollback(end - (n - 1) + kept)
            self.inputs = list(committed[kept:])
        else:
            self.inputs = self.inputs + list(committed)


@dataclass
class GenerationRun:
    """One generation's account: its metrics, the device faults, the timeline, and the
    counters' values when it began."""
    metrics: SpecDecodeMetrics
    faults: list[str] = field(default_factory=list)
    recoveries: int = 0
    fallback_reason: str = ""
    timeline: Timeline = field(default_factory=Timeline)
    t_start: float = 0.0
    link0: object = None
    retries0: int = 0
    verifier_s0: float = 0.0
    forwards0: int = 0
    sim_s: float = 0.0
    last_device_s: float = 0.0       # modelled PCIe + engine of the last device step


class SpeculativeDecoder:
    """Chain speculative decoding with a fixed or adaptive γ, surviving draft-device faults.

    Members
    -------
    draft : DraftDevice
    verifier : Verifier
    gamma : int
        Drafts per round; with an adaptive γ, its upper bound (``adaptive.gamma_max``).
    adaptive : AdaptiveLength or None
        The controller choosing γ per round (:mod:`dfvg_host.adaptive`), given as
        ``gamma="auto"`` (a default :class:`~dfvg_host.adaptive.AdaptiveLength`) or
        ``adaptive=``; None: a fixed γ. It persists across :meth:`generate` calls (it
        learns over them) and depends on past rounds only, so decoding stays exact:
        greedy output is the target's greedy decoding and sampling stays lossless (γ is
        fixed before the round's drafts and the verifier's draws).
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

    def __init__(self, draft: DraftDevice, verifier: Verifier, *, gamma: int | str = 4,
                 sampling: SamplingParams = SamplingParams(), eos_token_id: int | None = None,
                 max_recoveries: int = 2, fallback: bool = True,
                 adaptive: AdaptiveLength | None = None):
        if gamma == "auto" and adaptive is None:
            adaptive = AdaptiveLength()
        if adaptive is not None:
            adaptive.pipelined = self.schedule == "pipelined"
            gamma = adaptive.gamma_max
        if not isinstance(gamma, int) or gamma < 1:
            raise ValueError(f"gamma must be an integer of at least 1 or 'auto', got {gamma!r}")
        if max_recoveries < 0:
            raise ValueError(f"max_recoveries must be >= 0, got {max_recoveries}")
        if draft.compiled.shape.vocab > verifier.vocab_size:
            raise ValueError(f"the draft's vocabulary ({draft.compiled.shape.vocab}) is larger than "
                             f"the target's ({verifier.vocab_size}); they must share a tokenizer")
        self.draft = draft
        self.verifier = verifier
        self.gamma = gamma
        self.adaptive = adaptive
        self.sampling = sampling.validate()
        self.eos_token_id = eos_token_id
        self.max_recoveries = max_recoveries
        self.fallback = fallback
        # Set when a generation gave the device up: the next one resets it first.
        self._device_suspect = False
        # The verifier's own rejection-sampling stream, independent of the device's seed.
        self._generator = torch.Generator().manual_seed(sampling.seed ^ 0x5EED)

    # -- the draft side ------------------------------------------------------------------
    def _fault(self, run: GenerationRun, exc: DraftDeviceError, what: str) -> None:
        run.metrics.record_fault(fault_kind(exc))
        run.faults.append(f"{what}: {exc}")
        log.info("draft device fault (%s): %s", what, exc)

    def _give_up(self, run: GenerationRun, reason: str, *, device_suspect: bool = True) -> None:
        run.fallback_reason = reason
        self._device_suspect = self._device_suspect or device_suspect
        if self.fallback:
            log.warning("the draft device is given up for this generation: %s; generation goes on "
                        "with the target alone (plain decoding, same output)", reason)

    def _recover(self, run: GenerationRun, state: DraftCursor, seq: list[int], cause: str) -> bool:
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

    def _draft_or_give_up(self, run: GenerationRun, state: DraftCursor, seq: list[int],
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

    # -- the parts of a generation, shared with PipelinedDecoder ------------------------
    #: The schedule this decoder's metrics and timeline report.
    schedule = "serial"
    #: Where a sequence stands on the engine (a subclass drafting otherwise brings its own).
    cursor_class = DraftCursor

    def _begin(self, prompt: list[int]) -> GenerationRun:
        """Check the prompt, start the metrics, timeline and the counters' snapshots."""
        t_start = time.perf_counter()
        adaptive = self.adaptive is not None
        m = SpecDecodeMetrics(gamma=0 if adaptive else self.gamma,
                              gamma_mode="auto" if adaptive else "fixed",
                              device_clock_hz=self.draft.clock_hz,
                              device_cycle_source=getattr(self.draft, "cycle_source",
                                                          "measured: engine counters"),
                              prefill_tokens=len(prompt), schedule=self.schedule)
        run = GenerationRun(m, timeline=Timeline(self.schedule), t_start=t_start,
                   link0=self.draft.transport.stats.snapshot(),
                   retries0=self.draft.transport_retries, verifier_s0=self.verifier.seconds,
                   forwards0=self.verifier.forwards)
        limit = self.draft.compiled.context_limit
        if not prompt:
            raise ValueError("the prompt must contain at least one token")
        if len(prompt) >= limit:
            raise ValueError(f"the prompt has {len(prompt)} tokens; the draft's context limit is "
                             f"{limit}. Shorten the prompt or use a preset with more kv_positions")
        return run

    def _open(self, run: GenerationRun, prompt: list[int], state: DraftCursor,
              max_new_tokens: int) -> tuple[bool, tuple[str, str, Exception | None] | None]:
        """Prefill the target and ready the device: (use the device, the stop triple of a
        verifier error or None)."""
        v0 = self.verifier.seconds
        try:
            self.verifier.prefill(prompt)
        except Exception as exc:             # noqa: BLE001 - returned, not lost
            return True, ("verifier_error", verifier_message(exc, 0), exc)
        finally:
            run.timeline.then("target", "prefill", self.verifier.seconds - v0, "measured",
                              tokens=len(prompt))
        use_device = True
        if max_new_tokens > 0:
            def ready():
                if self._device_suspect:
                    return self._recover(run, state, list(prompt), "the device was given up in "
                                         "the last generation and does not come back")
                if self.draft.pending is not None:      # left in flight by a verifier error
                    self._settle_pending(run)
                self.draft.rollback(0)
                return True
            use_device = self._device_step(run, "reset" if self._device_suspect else "rollback", ready)
        return use_device, None

    def _settle_pending(self, run: GenerationRun) -> None:
        """Collect a request left in flight; a failure marks the device suspect."""
        try:
            self.draft.collect(self.draft.pending)
        except DraftDeviceError as exc:
            self._fault(run, exc, "a request left in flight")
            self._device_suspect = True

    def _device_step(self, run: GenerationRun, name: str, fn, *, start: float | None = None, **args):
        """Run ``fn`` (draft-device work), timing its wall as the simulator's; add its
        modelled PCIe and engine time to the timeline, one after the other from ``start``
        (default: ``now``, and ``now`` moves past them). Returns what ``fn`` returns."""
        m = run.metrics
        link_s0, cycles0 = self.draft.transport.stats.seconds, m.device_cycles
        t0 = time.perf_counter()
        try:
            return fn()
        finally:
            run.sim_s += time.perf_counter() - t0
            pcie = self.draft.transport.stats.seconds - link_s0
            engine = (m.device_cycles - cycles0) / m.device_clock_hz if m.device_clock_hz else 0.0
            at = run.timeline.now if start is None else start
            run.timeline.add("pcie", name, at, pcie, "modelled", **args)
            run.timeline.add("engine", name, at + pcie, engine, "modelled", **args)
            run.last_device_s = pcie + engine
            if start is None:
                run.timeline.now = at + pcie + engine

    def _draft_counted(self, run: GenerationRun, state: DraftCursor, seq: list[int], n: int) -> DraftOutput | None:
        d = self._draft_or_give_up(run, state, seq, n)
        if d is not None:
            run.metrics.device_cycles += d.cycles
        return d

    def _verify(self, run: GenerationRun, drafts: list[int], q_tokens, *, start: float | None = None,
                round_no: int = 0) -> tuple[Verdict, float]:
        """Score ``drafts`` on the target, judge them and commit the target's KV: (the
        verdict, the measured seconds). Its span starts at ``start`` (default ``now``,
        and ``now`` moves past it). Raises what the target raises."""
        v0 = self.verifier.seconds
        try:
            verdict = verify_round(self.verifier.score(drafts), drafts, q_tokens, self.sampling,
                                   self._generator)
            self.verifier.commit(verdict.accepted, len(drafts), verdict.next_token)
        finally:
            seconds = self.verifier.seconds - v0
            at = run.timeline.now if start is None else start
            run.timeline.add("target", f"verify round {round_no}", at, seconds, "measured",
                             round=round_no, drafts=len(drafts))
            if start is None:
                run.timeline.now = at + seconds
        self._note_invalid_q(run, verdict)
        return verdict, seconds

    @staticmethod
    def _note_invalid_q(run: GenerationRun, verdict) -> None:
        """Count a round that ended at a draft with q(token) = 0 as a malformed result."""
        if verdict.invalid_q:
            run.metrics.record_fault("malformed")
            run.faults.append(f"verification: draft {verdict.accepted} has q(token) = 0; the "
                              "round ended there with a token from the target")

    def _verify_output(self, run: GenerationRun, d: DraftOutput | None,
                       round_no: int) -> tuple[list[int], Verdict, float]:
        """Verify what the round drafted (``None``: nothing) and commit the target's KV:
        (the drafted tokens in the order the verdict counts them, the verdict, the
        measured seconds). Raises what the target raises."""
        drafts, q_tokens = (d.ids, d.tokens) if d is not None else ([], [])
        verdict, seconds = self._verify(run, drafts, q_tokens, round_no=round_no)
        return drafts, verdict, seconds

    def _advance(self, state: DraftCursor, n: int, d: DraftOutput | None, drafts: list[int],
                 verdict: Verdict) -> None:
        """Keep the engine's KV of what the target accepted; queue the rest."""
        state.advance(self.draft, n, drafts, verdict)

    def _emit(self, run: GenerationRun, out: list[int], seq: list[int], n: int, drafts: list[int],
              verdict: Verdict, remaining: int, use_device: bool,
              on_tokens: Callable[[list[int]], None] | None) -> bool:
        """Append the round's tokens to ``out`` and ``seq`` and count them; True at EOS."""
        m = run.metrics
        new = drafts[:verdict.accepted] + [verdict.next_token]
        m.record_round(n, verdict.accepted, len(new))
        new, eos = tokens_to_emit(new, self.eos_token_id, remaining)
        out += new
        seq += new
        if not use_device:
            m.fallback_rounds += 1
            m.fallback_tokens += len(new)
        if on_tokens:
            on_tokens(new)
        return eos

    def _host_span(self, run: GenerationRun, t_round: float, sim0: float, verifier0: float,
                   round_no: int) -> float:
        """The round's measured host time (its wall less target and simulator) on the
        timeline; returns it."""
        wall = time.perf_counter() - t_round
        host = wall - (self.verifier.seconds - verifier0) - (run.sim_s - sim0)
        run.timeline.then("host", f"host round {round_no}", host, "measured", round=round_no)
        return host

    # -- adaptive γ ------------------------------------------------------------------------
    def _choose_gamma(self) -> int:
        """γ for the next round: fixed, or the controller's choice from past rounds only."""
        return self.gamma if self.adaptive is None else self.adaptive.choose()

    def _draft_timed(self, run: GenerationRun, state: DraftCursor, seq: list[int], n: int,
                     round_no: int) -> tuple[DraftOutput | None, tuple[tuple[int, float], ...]]:
        """The round's draft request on the device: (its output, the (tokens, modelled
        seconds) the adaptive controller may learn the draft time from — empty when the
        request fed more than two tokens or met a fault)."""
        fed, faults = len(state.inputs), run.metrics.device_faults
        d = self._device_step(run, f"draft round {round_no}",
                              lambda: self._draft_counted(run, state, seq, n),
                              round=round_no, drafts=n)
        clean = d is not None and fed <= 2 and run.metrics.device_faults == faults
        return d, ((n, run.last_device_s),) if clean else ()

    def _observe(self, drafted: int, verdict: Verdict, verify_s: float, host_s: float,
                 draft_requests: tuple[tuple[int, float], ...]) -> None:
        """Tell the adaptive controller (if any) how the round went."""
        if self.adaptive is not None:
            self.adaptive.observe(RoundFacts(drafted, min(verdict.accepted, drafted), verify_s,
                                             host_s, draft_requests))

    def _room(self, state: DraftCursor) -> int:
        """Drafts the engine's context has room for after ``state``'s inputs."""
        return self.draft.compiled.context_limit - (self.draft.committed + len(state.inputs)) + 1

    def _finish(self, run: GenerationRun, out: list[int], stop: str, message: str,
                error: Exception | None) -> GenerationOutput:
        m = run.metrics
        m.emitted_tokens = len(out)
        m.verifier_seconds = self.verifier.seconds - run.verifier_s0
        m.target_forward_passes = self.verifier.forwards - run.forwards0
        link = self.draft.transport.stats.since(run.link0)
        m.pcie_bytes, m.pcie_transfers, m.pcie_seconds = link.bytes, link.dma_transfers, link.seconds
        m.transport_retries = self.draft.transport_retries - run.retries0
        m.simulator_seconds = run.sim_s
        m.host_seconds = max(0.0, time.perf_counter() - run.t_start - m.verifier_seconds - run.sim_s)
        # Host work outside the rounds (setup, the end of the last round).
        timed = sum(s.duration for s in run.timeline.spans if s.lane == "host")
        run.timeline.then("host", "host outside rounds", m.host_seconds - timed, "measured")
        return GenerationOutput(out, stop, m, message, degraded=bool(run.fallback_reason),
                                fallback_reason=run.fallback_reason, faults=run.faults, error=error,
                                timeline=run.timeline)

    # -- a generation --------------------------------------------------------------------
    def generate(self, prompt: list[int], max_new_tokens: int,
                 on_tokens: Callable[[list[int]], None] | None = None) -> GenerationOutput:
        """Generate up to ``max_new_tokens`` after ``prompt``; ``on_tokens`` streams each round.

        Raises ``ValueError`` for an empty prompt or one that does not fit the draft's
        context; everything else the device or the target does ends up in the returned
        :class:`GenerationOutput` with the tokens generated so far (module docstring).
        """
        run = self._begin(prompt)
        limit = self.draft.compiled.context_limit
        out: list[int] = []
        seq = list(prompt)                     # the committed sequence: prompt + out
        state = self.cursor_class(inputs=list(prompt))
        stop, message, error = "max_new_tokens", "", None
        use_device, failed = self._open(run, prompt, state, max_new_tokens)
        if failed:
            (stop, message, error), max_new_tokens = failed, 0
        while len(out) < max_new_tokens:
            t_round, sim0, verifier0 = time.perf_counter(), run.sim_s, self.verifier.seconds
            round_no = run.metrics.rounds + 1
            remaining = max_new_tokens - len(out)
            n = 0
            if use_device:
                room = self._room(state)
                if room < 1:
                    stop = "context_limit"
                    message = (f"stopped at the draft engine's context limit of {limit} positions; "
                               "use a preset with more kv_positions for longer generations")
                    break
                n = min(self._choose_gamma(), remaining - 1, room)
            d, requests = None, ()
            if n > 0:
                d, requests = self._draft_timed(run, state, seq, n, round_no)
                if d is None:
                    use_device, n = False, 0
            if not use_device and not self.fallback:
                stop, message = "device_error", run.fallback_reason
                break
            try:
                drafts, verdict, t_verify = self._verify_output(run, d, round_no)
            except Exception as exc:         # noqa: BLE001 - returned, not lost
                stop, message, error = "verifier_error", verifier_message(exc, len(out)), exc
                break
            if use_device:
                self._advance(state, n, d, drafts, verdict)
            eos = self._emit(run, out, seq, n, drafts, verdict, remaining, use_device, on_tokens)
            host = self._host_span(run, t_round, sim0, verifier0, round_no)
            if use_device:
                self._observe(n, verdict, t_verify, host, requests)
            if eos:
                stop = "eos"
                break
        return self._finish(run, out, stop, message, error)


def matched_prefix(draft: list[int], committed: list[int]) -> int:
    """How many leading tokens of ``draft`` the round committed: the length of the common
    prefix of ``draft`` and the committed tokens (accepted drafts, then the target's own
    token)."""
    n = 0
    for a, b in zip(draft, committed):
        if a != b:
            break
        n += 1
    return n


def tokens_to_emit(new: list[int], eos_token_id: int | None, remaining: int) -> tuple[list[int], bool]:
    """What a round that committed ``new`` emits: up to and including EOS, at most
    ``remaining`` tokens; and whether EOS was reached."""
    eos = eos_token_id is not None and eos_token_id in new
    if eos:
        new = new[:new.index(eos_token_id) + 1]
    return new[:remaining], eos


def verifier_message(exc: Exception, kept: int) -> str:
    """The message of a generation ended by the target's exception."""
    return (f"the target model failed ({type(exc).__name__}: {exc}); the {kept} tokens generated "
            "before it are kept")
