"""Pipelined chain speculative decoding: the engine drafts round n+1 while the target
verifies round n.

Scheme
------
After round n's drafts d1..dγ come back, and before the target verifies them, the
decoder submits a *continuation* on the engine (:meth:`~dfvg_host.driver.DraftDevice.submit`)
from the optimistic path — every draft accepted: it feeds dγ and drafts γ' + 1 tokens
e1..e_{γ'+1}, where e1 is the engine's guess of the target's bonus token and γ' is what
round n+1 would draft after a full acceptance (γ, or fewer near ``max_new_tokens`` or the
context limit). Then the target verifies round n, then the decoder collects the
continuation (:meth:`~dfvg_host.driver.DraftDevice.collect`).

* **Hit** — all γ drafts accepted and the target's next token is e1: round n+1's drafts
  are e2..e_{γ'+1}, drafted already. The engine holds KV for the sequence, dγ, e1 = the
  bonus token and e2..e_{γ'}: exactly what a serial round n+1 (feeding dγ and the bonus)
  would have left, so nothing is rolled back.
* **Miss** — a rejection, or another bonus token: the continuation is discarded, the
  engine's KV is rolled back to the accepted prefix (O(1), as after any round) and round
  n+1 drafts serially.

Greedy output is the target's greedy decoding token for token, as with
:class:`~dfvg_host.speculative.SpeculativeDecoder` (drafts decide how many tokens a
forward yields, never which); in greedy mode the rounds are even the same as the serial
decoder's, since the engine drafts e2.. from the same KV a serial request would build.

Sampling stays lossless
-----------------------
Rejection sampling is exact when each draft was drawn from the q it reports, given the
committed prefix, with randomness independent of the verifier's. The engine's RNG is
counter based (draft i of a request uses ``rng(seed, counter + i)``, independent
uniforms). The continuation takes counters c..c+γ' (c = the round's counter + γ) and the
cursor's counter moves past them *whether it hits or misses*:

* On a hit, e2..e_{γ'+1} were drawn from q given the prefix, d1..dγ and e1, with
  counters c+1.. that nothing else used. The hit event (all accepted, bonus == e1)
  depends on e1's counter c and the verifier's generator, not on them, so given the
  bonus b == e1 they are distributed as a serial draft after b would be: q given the
  prefix and b. Conditioning on b == e1 does not bias them.
* On a miss the counters c..c+γ' are skipped, never reused. Reusing c for the serial
  re-draft would draw it from the uniform that decided e1, which the miss event (bonus
  ≠ e1) conditions: that draft would no longer be distributed as the q it reports.

The verifier's own generator draws the same as in a serial round. ``tests/test_pipelined.py``
checks the joint distribution of the first three tokens by chi-square.

With an adaptive γ (``gamma="auto"``, :mod:`dfvg_host.adaptive`) the continuation's γ' is
chosen when it is submitted, from the rounds before n (round n is not verified yet); the
serial re-draft after a miss chooses again, after round n has been observed. Either way
γ is fixed before the drafts it governs and the verifier's draws of their round, so the
argument above is unchanged.

Faults
------
As :class:`~dfvg_host.speculative.SpeculativeDecoder`: a continuation that fails
(submit or collect) is counted; when the round accepted every draft, the device is reset
and the continuation replayed synchronously from the optimistic path with the same
counter, so a recovered fault changes nothing in the output; otherwise the device is
reset and the next round drafts serially from the whole committed sequence. Resets are
within ``max_recoveries``; after that the target goes on alone (``fallback``).

Time
----
The ``sim`` device runs each request synchronously in wall time, so the overlap is
*modelled*: a round takes ``T_verify + max(0, T_continuation − T_verify)`` (plus the
serial draft after a miss), ``T_continuation`` being the continuation's modelled engine
and PCIe time and ``T_verify`` the measured target time; ``min(T_continuation,
T_verify)`` per round is ``SpecDecodeMetrics.hidden_draft_seconds``, counted once in
``projected_seconds``. On a card the continuation runs while the target verifies.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

from dfvg_host.driver import ContextFull, DeviceFault, DraftDeviceError, DraftOutput, PendingDraft
from dfvg_host.speculative import (DraftCursor, GenerationOutput, SpeculativeDecoder, GenerationRun,
                                   verifier_message)

__all__ = ["PipelinedDecoder", "Continuation", "unrecoverable"]


@dataclass
class Continuation:
    """A speculative continuation: submitted before verification, collected after.

    Members
    -------
    counter : int
        RNG counter of e1 (e_i uses ``counter + i - 1``).
    n_next : int
        Drafts of the next round on a hit (γ'); it drafts ``n_next + 1`` tokens.
    end : int
        The engine's KV length after the round's drafts, before the continuation.
    optimistic : list of int
        The committed sequence plus the round's drafts: what it continues.
    """
    counter: int
    n_next: int
    end: int
    optimistic: list[int]
    pending: PendingDraft | None = None
    output: DraftOutput | None = None
    fault: DraftDeviceError | None = None
    pcie_s: float = 0.0
    engine_s: float = 0.0
    replayed: bool = field(default=False)


def unrecoverable(exc: DraftDeviceError) -> bool:
    return isinstance(exc, ContextFull) or (isinstance(exc, DeviceFault) and exc.request_caused)


class PipelinedDecoder(SpeculativeDecoder):
    """Chain speculative decoding that drafts the next round during verification.

    Same constructor, members and :meth:`generate` contract as
    :class:`~dfvg_host.speculative.SpeculativeDecoder` (module docstring for the scheme,
    losslessness, faults and the time accounting); its metrics have ``schedule =
    "pipelined"`` with the pipeline's hits, misses and hidden drafting.
    """

    schedule = "pipelined"

    # -- the continuation ----------------------------------------------------------------
    def _timed_device(self, run: GenerationRun, c: Continuation, fn):
        stats = self.draft.transport.stats
        link0, t0 = stats.seconds, time.perf_counter()
        try:
            return fn()
        finally:
            run.sim_s += time.perf_counter() - t0
            c.pcie_s += stats.seconds - link0

    def _submit_continuation(self, run: GenerationRun, state: DraftCursor, seq: list[int], d: DraftOutput,
                             remaining: int) -> Continuation | None:
        """Start the next round's drafts from the optimistic path, or None when a hit
        would leave nothing to draft."""
        drafts = d.ids
        n = len(drafts)
        # What the next round drafts after a full acceptance (γ + 1 tokens emitted), by the
        # serial rule: the engine then holds KV up to d_{γ-1} and is fed dγ and the bonus.
        room = self.draft.compiled.context_limit - (self.draft.committed + 2) + 1
        n_next = min(self._choose_gamma(), remaining - (n + 1) - 1, room)
        if n_next < 1:
            return None
        c = Continuation(counter=state.counter, n_next=n_next, end=self.draft.committed,
                          optimistic=seq + drafts)
        state.counter += n_next + 1          # consumed, hit or miss (module docstring)
        try:
            c.pending = self._timed_device(run, c, lambda: self.draft.submit(
                [drafts[-1]], n_next + 1, counter=c.counter,
                **DraftCursor.request_options(self.draft, self.sampling)))
        except DraftDeviceError as exc:
            self._continuation_fault(run, c, exc)
        return c

    def _continuation_fault(self, run: GenerationRun, c: Continuation, exc: DraftDeviceError) -> None:
        self._fault(run, exc, "continuation")
        c.fault = exc
        self._device_suspect = True          # untrusted until a reset

    def _collect_continuation(self, run: GenerationRun, c: Continuation) -> None:
        if c.pending is None:
            return
        try:
            c.output = self._timed_device(run, c, lambda: self.draft.collect(c.pending))
        except DraftDeviceError as exc:
            self._continuation_fault(run, c, exc)
            return
        finally:
            c.pending = None
        run.metrics.device_cycles += c.output.cycles
        hz = run.metrics.device_clock_hz
        c.engine_s = c.output.cycles / hz if hz else 0.0

    def _replay_continuation(self, run: GenerationRun, c: Continuation, round_no: int) -> DraftOutput | None:
        """After a failed continuation in a round that accepted everything: reset and draft
        it again synchronously, same counter; None when the device is given up."""
        exc = c.fault
        if unrecoverable(exc):
            self._give_up(run, f"{exc} (a reset cannot help: the engine would refuse the same "
                               "request again)")
            return None
        cursor = DraftCursor(counter=c.counter)

        def replay():
            if not self._recover(run, cursor, c.optimistic, str(exc)):
                return None
            return self._draft_counted(run, cursor, c.optimistic, c.n_next + 1)
        c.replayed = True
        return self._device_step(run, f"replay continuation {round_no}", replay, round=round_no)

    # -- a generation --------------------------------------------------------------------
    def generate(self, prompt: list[int], max_new_tokens: int,
                 on_tokens: Callable[[list[int]], None] | None = None) -> GenerationOutput:
        """Generate up to ``max_new_tokens`` after ``prompt``, as
        :meth:`SpeculativeDecoder.generate <dfvg_host.speculative.SpeculativeDecoder.generate>`."""
        run = self._begin(prompt)
        m = run.metrics
        limit = self.draft.compiled.context_limit
        out: list[int] = []
        seq = list(prompt)
        state = self.cursor_class(inputs=list(prompt))
        stop, message, error = "max_new_tokens", "", None
        use_device, failed = self._open(run, prompt, state, max_new_tokens)
        if failed:
            (stop, message, error), max_new_tokens = failed, 0
        ready = None                         # this round's drafts, drafted during the last verify
        while len(out) < max_new_tokens:
            t_round, sim0, verifier0 = time.perf_counter(), run.sim_s, self.verifier.seconds
            round_no = m.rounds + 1
            remaining = max_new_tokens - len(out)
            n, d, requests = 0, None, ()
            if ready is not None:
                d, ready = ready, None
                n = self._ready_drafts(d)
            else:
                if use_device:
                    room = self._room(state)
                    if room < 1:
                        stop = "context_limit"
                        message = (f"stopped at the draft engine's context limit of {limit} "
                                   "positions; use a preset with more kv_positions for longer "
                                   "generations")
                        break
                    n = min(self._choose_gamma(), remaining - 1, room)
                if n > 0:
                    d, requests = self._draft_timed(run, state, seq, n, round_no)
                    if d is None:
                        use_device, n = False, 0
            if not use_device and not self.fallback:
                stop, message = "device_error", run.fallback_reason
                break
            c = self._submit_continuation(run, state, seq, d, remaining) if d is not None else None
            t0 = run.timeline.now
            try:
                drafts, verdict, t_verify = self._verify_output(run, d, round_no)
            except Exception as exc:         # noqa: BLE001 - returned, not lost
                if c is not None:            # leave no request in flight
                    self._collect_continuation(run, c)
                stop, message, error = "verifier_error", verifier_message(exc, len(out)), exc
                break
            if c is None:
                run.timeline.now = t0 + t_verify
            else:
                self._collect_continuation(run, c)
                t_cont = c.pcie_s + c.engine_s
                if c.fault is None:
                    requests += ((c.n_next + 1, t_cont),)
                m.hidden_draft_seconds += min(t_cont, t_verify)
                run.timeline.add("pcie", f"continuation {round_no}", t0, c.pcie_s, "modelled",
                                 round=round_no, drafts=c.n_next + 1)
                run.timeline.add("engine", f"continuation {round_no}", t0 + c.pcie_s, c.engine_s,
                                 "modelled", round=round_no, drafts=c.n_next + 1)
                run.timeline.now = t0 + max(t_verify, t_cont)
            eos = self._emit(run, out, seq, n, drafts, verdict, remaining, use_device, on_tokens)
            going_on = not eos and len(out) < max_new_tokens
            if c is not None:
                ready, use_device = self._settle(run, state, seq, c, n, d, verdict, going_on,
                                                 use_device, round_no)
            elif use_device:
                self._advance(state, n, d, drafts, verdict)
            host = self._host_span(run, t_round, sim0, verifier0, round_no)
            if d is not None or (use_device and n == 0):
                self._observe(n, verdict, t_verify, host, requests)
            if eos:
                stop = "eos"
                break
        return self._finish(run, out, stop, message, error)

    # -- hooks of the round loop (a tree decoder overrides them) ---------------------------
    @staticmethod
    def _ready_drafts(ready: DraftOutput) -> int:
        """Drafts of a round whose drafts the last continuation made."""
        return len(ready.tokens)

    def _settle(self, run: GenerationRun, state: DraftCursor, seq: list[int], c: Continuation,
                n: int, d: DraftOutput, verdict, going_on: bool, use_device: bool,
                round_no: int) -> tuple[DraftOutput | None, bool]:
        """After round ``round_no`` is verified and emitted: a hit makes the next round's
        drafts of the continuation, a miss discards it and keeps the engine's KV of what
        the target accepted (or resets a faulted device). Returns (the next round's
        drafts on a hit, else None; whether the device is still used)."""
        m = run.metrics
        drafts = d.ids
        all_accepted = verdict.accepted == n
        if c.fault is not None and all_accepted and going_on:
            c.output = self._replay_continuation(run, c, round_no)
            if c.output is None:
                use_device = False
        if (c.output is not None and all_accepted and going_on
                and verdict.next_token == c.output.tokens[0].token):
            m.pipeline_hits += 1
            state.inputs = []
            return DraftOutput(c.output.tokens[1:], 0, c.output.end_pos, c.output.n_forward), use_device
        m.pipeline_misses += 1
        if use_device and going_on:
            if c.fault is not None and not c.replayed:
                use_device = self._reset_after(run, state, seq, c.fault, round_no)
            else:
                state.advance(self.draft, n, drafts, verdict, end=c.end)
        return None, use_device

    def _reset_after(self, run: GenerationRun, state: DraftCursor, seq: list[int],
                     fault: DraftDeviceError, round_no: int) -> bool:
        """After a continuation failed: reset the device and point ``state`` at the whole
        committed sequence, or give the device up when a reset cannot help; whether the
        device is still used."""
        if unrecoverable(fault):
            self._give_up(run, f"{fault} (a reset cannot help: the engine would refuse the same "
                               "request again)")
            return False
        return self._device_step(run, f"reset {round_no}",
                                 lambda: self._recover(run, state, seq, str(fault)))
