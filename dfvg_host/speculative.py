"""Synchronous chain speculative decoding: draft γ on the device, verify on the target."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from dfvg_host.acceptance import (SamplingParams, Verdict, accept_greedy, accept_rejection,
                                  draft_distribution, target_distribution)
from dfvg_host.driver import DraftDevice, DraftDeviceError
from dfvg_host.metrics import SpecDecodeMetrics
from dfvg_host.verifier import Verifier

__all__ = ["SpeculativeDecoder", "GenerationOutput"]


@dataclass
class GenerationOutput:
    """Generated token ids (prompt excluded), why generation stopped, and the metrics."""
    tokens: list[int]
    stop_reason: str                 # "eos", "max_new_tokens", "context_limit", "device_error"
    metrics: SpecDecodeMetrics
    message: str = ""


@dataclass
class _DraftState:
    """Tokens the draft engine has not consumed yet, and the RNG counter."""
    inputs: list[int] = field(default_factory=list)
    counter: int = 0


class SpeculativeDecoder:
    """Chain speculative decoding with a fixed γ.

    Members
    -------
    draft : DraftDevice
    verifier : Verifier
    gamma : int
    sampling : SamplingParams
    eos_token_id : int or None
    """

    def __init__(self, draft: DraftDevice, verifier: Verifier, *, gamma: int = 4,
                 sampling: SamplingParams = SamplingParams(), eos_token_id: int | None = None):
        if gamma < 1:
            raise ValueError(f"gamma must be at least 1, got {gamma}")
        if draft.compiled.shape.vocab > verifier.vocab_size:
            raise ValueError(f"the draft's vocabulary ({draft.compiled.shape.vocab}) is larger than "
                             f"the target's ({verifier.vocab_size}); they must share a tokenizer")
        self.draft = draft
        self.verifier = verifier
        self.gamma = gamma
        self.sampling = sampling.validate()
        self.eos_token_id = eos_token_id
        # The verifier's own rejection-sampling stream, independent of the device's seed.
        self._generator = torch.Generator().manual_seed(sampling.seed ^ 0x5EED)

    def _propose(self, state: _DraftState, n: int):
        s = self.sampling
        out = self.draft.draft(state.inputs, n, sample=not s.greedy,
                               temperature=s.temperature if not s.greedy else 1.0,
                               topk=(s.top_k or self.draft.topk_max) if not s.greedy else 1,
                               seed=s.seed, counter=state.counter)
        state.counter += n
        return out

    def _verify(self, drafts: list[int], q_tokens) -> Verdict:
        logits = self.verifier.score(drafts)
        if self.sampling.greedy:
            return accept_greedy(logits, drafts)
        p = target_distribution(logits, self.sampling)
        q = [draft_distribution(t, p.shape[-1]) for t in q_tokens]
        return accept_rejection(p, drafts, q, self._generator)

    def generate(self, prompt: list[int], max_new_tokens: int,
                 on_tokens: Callable[[list[int]], None] | None = None) -> GenerationOutput:
        """Generate up to ``max_new_tokens`` after ``prompt``; ``on_tokens`` streams each round."""
        t_start = time.perf_counter()
        m = SpecDecodeMetrics(gamma=self.gamma, device_clock_hz=self.draft.clock_hz,
                              device_cycle_source=getattr(self.draft, "cycle_source",
                                                          "measured: engine counters"),
                              prefill_tokens=len(prompt))
        link0 = self.draft.transport.stats.snapshot()
        verifier_s0, forwards0 = self.verifier.seconds, self.verifier.forwards
        limit = self.draft.compiled.context_limit
        if len(prompt) >= limit:
            raise ValueError(f"the prompt has {len(prompt)} tokens; the draft's context limit is "
                             f"{limit}. Shorten the prompt or use a preset with more kv_positions")
        self.verifier.prefill(prompt)
        self.draft.rollback(0)
        state = _DraftState(inputs=list(prompt))
        out: list[int] = []
        stop, message = "max_new_tokens", ""
        sim_s = 0.0
        while len(out) < max_new_tokens:
            remaining = max_new_tokens - len(out)
            room = limit - (self.draft.committed + len(state.inputs)) + 1
            n = min(self.gamma, remaining - 1, room)
            if room < 1:
                stop = "context_limit"
                message = (f"stopped at the draft engine's context limit of {limit} positions; "
                           "use a preset with more kv_positions for longer generations")
                break
            drafts, q_tokens = [], []
            if n > 0:
                t0 = time.perf_counter()
                try:
                    d = self._propose(state, n)
                except DraftDeviceError as exc:
                    stop, message = "device_error", str(exc)
                    break
                finally:
                    sim_s += time.perf_counter() - t0
                drafts, q_tokens = d.ids, d.tokens
                m.device_cycles += d.cycles
            verdict = self._verify(drafts, q_tokens)
            self.verifier.commit(verdict.accepted, len(drafts), verdict.next_token)
            new = drafts[:verdict.accepted] + [verdict.next_token]
            if n > 0:
                # The engine holds KV for its inputs and all drafts but the last.
                kept = self.draft.kv_length - (n - 1) + min(verdict.accepted, n - 1)
                self.draft.rollback(kept)
                state.inputs = ([drafts[-1]] if verdict.accepted == n else []) + [verdict.next_token]
            else:
                state.inputs = state.inputs + [verdict.next_token]
            m.record_round(n, verdict.accepted, len(new))
            if self.eos_token_id is not None and self.eos_token_id in new:
                new = new[:new.index(self.eos_token_id) + 1]
                stop = "eos"
            new = new[:remaining]
            out += new
            if on_tokens:
                on_tokens(new)
            if stop == "eos":
                break
        m.emitted_tokens = len(out)
        m.verifier_seconds = self.verifier.seconds - verifier_s0
        m.target_forward_passes = self.verifier.forwards - forwards0
        link = self.draft.transport.stats.since(link0)
        m.pcie_bytes, m.pcie_transfers, m.pcie_seconds = link.bytes, link.dma_transfers, link.seconds
        m.simulator_seconds = sim_s
        m.host_seconds = max(0.0, time.perf_counter() - t_start - m.verifier_seconds - sim_s)
        return GenerationOutput(out, stop, m, message)
