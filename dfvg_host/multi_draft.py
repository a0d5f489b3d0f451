"""Speculative decoding with several drafters at once (Smurfs): voting, merged trees, selection.

Each drafter is a draft device with its compiled draft (``--device`` and ``--draft`` given
more than once): a different model, or the same one sampling with another seed or
temperature. Every round, each live drafter drafts γ tokens after the committed sequence;
the requests are all submitted before any is collected, so separate devices (or cores)
draft at the same time, and the round's drafting costs the slowest of them. How the
drafts become one verification is the ``merge`` rule:

``vote`` (greedy only)
    Weighted-majority voting (:mod:`dfvg_host.voting`): the drafts merged into a prefix
    tree whose nodes sum the weights of the drafters through them, the heaviest path (one
    real drafter's draft) verified as a chain.
``select`` (greedy and sampling)
    The heaviest drafter, chosen from the weights of past rounds *before* anything is
    drafted, has its chain verified with its own q. The choice ignores this round's
    samples, so rejection sampling stays lossless.
``tree`` (greedy and sampling)
    Every draft verified in one target forward as a token tree
    (:meth:`~dfvg_host.verifier.Verifier.score_tree`). Greedy: the drafts merged by
    prefix, the longest path the target agrees with accepted. Sampling: one branch per
    drafter, unmerged, each node with the q its drafter drew it from, judged by recursive
    rejection over siblings (:func:`~dfvg_host.acceptance.accept_tree_rejection`): the
    drafters draw independently, so each sibling's q is its law given the earlier
    siblings, which is what that rule needs to be exact.

After each round every drafter is judged by how much of its own draft the committed
tokens confirm, and the weights follow (:class:`~dfvg_host.voting.WeightedMajority`);
each drafter's engine keeps the KV of its confirmed prefix
(:meth:`~dfvg_host.speculative.DraftCursor.follow`). With ``gamma="auto"`` γ is chosen per
round from past rounds (:class:`~dfvg_host.adaptive.AdaptiveLength`), which keeps every
rule exact.

Time: the target and the host are measured; each drafter's engine (cycle model or
counters) and PCIe (link model) are modelled. A round's drafting is the slowest engine
plus the busiest link's transfers: engines run at once, while the transfers of drafters
on one link (the cores of one card, :mod:`dfvg_host.core_window`) queue. A core's cycles
are what it takes alone, a lower bound when the cores of a card contend for its memory
(docs/architecture.md §9). A drafter whose device fails is reset
and replayed up to ``max_recoveries`` times per generation, then dropped; the others go
on, and with none left the target decodes alone (or the generation stops with
``"device_error"`` when ``fallback`` is off). Tokens already generated are never lost.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from dfvg_host.acceptance import SamplingParams, Verdict, verify_round, verify_tree
from dfvg_host.adaptive import AdaptiveLength, RoundFacts
from dfvg_host.driver import ContextFull, DeviceFault, DraftDevice, DraftDeviceError, DraftOutput
from dfvg_host.metrics import SpecDecodeMetrics
from dfvg_host.speculative import (DraftCursor, GenerationOutput, fault_kind, matched_prefix, tokens_to_emit,
                                   verifier_message)
from dfvg_host.timeline import Timeline
from dfvg_host.tree import ROOT, DraftTree
from dfvg_host.verifier import Verifier
from dfvg_host.voting import WeightedMajority, heaviest_path, merge_drafts

__all__ = ["MERGE_RULES", "DrafterStats", "Drafter", "MultiDraftOutput", "MultiDraftDecoder"]

log = logging.getLogger(__name__)

#: How several drafts become one verification (module docstring).
MERGE_RULES = ("vote", "select", "tree")


def shared_link(device: DraftDevice) -> int:
    """An id of the PCIe link ``device`` talks over: the card's for a core of a card with
    several (:class:`~dfvg_host.core_window.CoreWindow`), else the device's own."""
    inner = device.transport.inner
    return id(getattr(inner, "card", inner))


@dataclass
class DrafterStats:
    """One drafter's account over a generation.

    Members
    -------
    name : str
    rounds : int
        Rounds it drafted in.
    drafted : int
        Tokens it drafted.
    judged : int
        Of those, the tokens a round's committed tokens could confirm or refute: per round
        ``min(γ, committed)`` (when another drafter's chain was verified and rejected early,
        the target committed fewer tokens than this drafter drafted, and the rest of its
        draft is neither right nor wrong).
    matched : int
        The tokens the committed output confirmed (a leading run of its draft).
    chosen : int
        Rounds whose verified chain was its draft (``vote``, ``select``), or whose
        accepted path ran through its draft (``tree``, at least one token).
    engine_cycles : int
        Its engine's cycles (``cycle_source`` of its device).
    pcie_seconds : float
        Its link's modelled time.
    faults : int
    given_up : str
        Why it was dropped during the generation; empty while it drafts.
    weights : list of float
        Its voting weight after each round.
    """
    name: str
    rounds: int = 0
    drafted: int = 0
    judged: int = 0
    matched: int = 0
    chosen: int = 0
    engine_cycles: int = 0
    pcie_seconds: float = 0.0
    faults: int = 0
    given_up: str = ""
    weights: list[float] = field(default_factory=list)

    @property
    def match_rate(self) -> float:
        """Its own acceptance: matched / judged."""
        return self.matched / self.judged if self.judged else 0.0

    def to_dict(self) -> dict:
        return dict(name=self.name, rounds=self.rounds, drafted=self.drafted, judged=self.judged,
                    matched=self.matched,
                    match_rate=self.match_rate, chosen=self.chosen, engine_cycles=self.engine_cycles,
                    pcie_seconds=self.pcie_seconds, faults=self.faults, given_up=self.given_up,
                    final_weight=self.weights[-1] if self.weights else None, weights=list(self.weights))


@dataclass
class Drafter:
    """A draft device in the ensemble, with the options it drafts with.

    Members
    -------
    device : DraftDevice
    sampling : SamplingParams
        How it draws its drafts (its own seed, and temperature when it samples under a
        greedy target); its engine reports the q it drew from, which is what a lossless
        rule needs.
    cursor : DraftCursor
    stats : DrafterStats
    recoveries : int
        Resets spent in the current generation.
    """
    device: DraftDevice
    sampling: SamplingParams
    cursor: DraftCursor = field(default_factory=DraftCursor)
    stats: DrafterStats = field(default_factory=lambda: DrafterStats(""))
    recoveries: int = 0

    @property
    def alive(self) -> bool:
        return not self.stats.given_up


@dataclass
class MultiDraftOutput(GenerationOutput):
    """:class:`~dfvg_host.speculative.GenerationOutput` with each drafter's account.

    Members
    -------
    drafters : list of DrafterStats
    merge : str
        The merge rule (:data:`MERGE_RULES`).
    tree_nodes : int
        Tokens verified as tree nodes over the generation (``tree``; 0 otherwise).
    """
    drafters: list[DrafterStats] = field(default_factory=list)
    merge: str = "vote"
    tree_nodes: int = 0


@dataclass
class _Round:
    """What one round drafted and what was verified of it."""
    outputs: dict[int, DraftOutput]
    verified: list[int]                 # the verified chain's tokens (vote, select)
    owner: int | None = None            # whose draft that chain is
    tree: DraftTree | None = None
    branch_of: list[int] = field(default_factory=list)    # tree node -> drafters through it


class MultiDraftDecoder:
    """Speculative decoding over several drafters (module docstring).

    Members
    -------
    drafters : list of Drafter
    verifier : Verifier
    merge : str
    gamma : int
        Drafts per drafter per round; with an adaptive γ its upper bound.
    adaptive : AdaptiveLength or None
    weights : WeightedMajority
        Kept across :meth:`generate` calls: what a drafter earnt carries over.
    sampling : SamplingParams
        The target's decoding rule.
    """

    def __init__(self, devices: list[DraftDevice], verifier: Verifier, *, merge: str = "vote",
                 gamma: int | str = 4, sampling: SamplingParams = SamplingParams(),
                 draft_temperatures: list[float | None] | None = None,
                 names: list[str] | None = None, eos_token_id: int | None = None,
                 max_recoveries: int = 1, fallback: bool = True,
                 weights: WeightedMajority | None = None, adaptive: AdaptiveLength | None = None):
        if not devices:
            raise ValueError("give at least one draft device")
        if merge not in MERGE_RULES:
            raise ValueError(f"merge must be one of {', '.join(MERGE_RULES)}, got {merge!r}")
        self.sampling = sampling.validate()
        if merge == "vote" and not self.sampling.greedy:
            raise ValueError("voting picks a draft after seeing every drafter's samples, which is "
                             "exact under greedy decoding only; at temperature > 0 use merge "
                             "'select' (the drafter chosen before it drafts) or 'tree' (every "
                             "draft verified with multi-draft speculative sampling)")
        if gamma == "auto" and adaptive is None:
            adaptive = AdaptiveLength()
        if adaptive is not None:
            gamma = adaptive.gamma_max
        if not isinstance(gamma, int) or gamma < 1:
            raise ValueError(f"gamma must be an integer of at least 1 or 'auto', got {gamma!r}")
        temps = list(draft_temperatures or [None] * len(devices))
        names = list(names or [f"drafter{i}" for i in range(len(devices))])
        if len(temps) != len(devices) or len(names) != len(devices):
            raise ValueError(f"{len(devices)} devices need as many draft temperatures and names "
                             f"(got {len(temps)} and {len(names)})")
        clocks = {d.clock_hz for d in devices}
        if len(clocks) > 1:
            raise ValueError(f"the draft devices run at different clocks ({sorted(clocks)} Hz); "
                             "give devices of one engine preset")
        for d in devices:
            if d.compiled.shape.vocab > verifier.vocab_size:
                raise ValueError(f"a draft's vocabulary ({d.compiled.shape.vocab}) is larger than the "
                                 f"target's ({verifier.vocab_size}); they must share a tokenizer")
        self.drafters = [Drafter(d, self._drafter_sampling(i, t), stats=DrafterStats(name))
                         for i, (d, t, name) in enumerate(zip(devices, temps, names))]
        self.verifier = verifier
        self.merge = merge
        self.gamma = gamma
        self.adaptive = adaptive
        self.weights = weights or WeightedMajority.uniform(len(devices))
        if len(self.weights.weights) != len(devices):
            raise ValueError(f"{len(self.weights.weights)} weights for {len(devices)} drafters")
        self.eos_token_id = eos_token_id
        self.max_recoveries = max_recoveries
        self.fallback = fallback
        self._generator = torch.Generator().manual_seed(sampling.seed ^ 0x5EED)

    def _drafter_sampling(self, index: int, temperature: float | None) -> SamplingParams:
        """Drafter ``index`` draws with the target's rule, or samples at ``temperature``,
        with its own seed (drafter 0 keeps the target's, as a single-drafter decoder would)."""
        t = self.sampling.temperature if temperature is None else temperature
        return SamplingParams(temperature=t, top_k=self.sampling.top_k,
                              seed=self.sampling.seed + index).validate()

    @property
    def context_limit(self) -> int:
        return min(d.device.compiled.context_limit for d in self.drafters)

    def _live(self) -> list[int]:
        return [i for i, d in enumerate(self.drafters) if d.alive]

    # -- faults --------------------------------------------------------------------------
    def _fault(self, metrics: SpecDecodeMetrics, faults: list[str], i: int, exc: DraftDeviceError,
               seq: list[int]) -> None:
        """Drafter ``i`` failed: reset it and point it at ``seq`` (replayed next round),
        or drop it when its resets are spent or a reset cannot help."""
        d = self.drafters[i]
        metrics.record_fault(fault_kind(exc))
        d.stats.faults += 1
        faults.append(f"{d.stats.name}: {exc}")
        log.info("drafter %s failed: %s", d.stats.name, exc)
        if isinstance(exc, ContextFull) or (isinstance(exc, DeviceFault) and exc.request_caused):
            d.stats.given_up = f"{exc} (a reset cannot help)"
            return
        while d.recoveries < self.max_recoveries:
            d.recoveries += 1
            metrics.device_resets += 1
            try:
                d.device.reset()
            except DraftDeviceError as again:
                metrics.record_fault(fault_kind(again))
                faults.append(f"{d.stats.name} reset: {again}")
                continue
            d.cursor.inputs = list(seq)
            return
        d.stats.given_up = f"{exc} (after {d.recoveries} reset(s))"
        log.warning("drafter %s is dropped for this generation: %s", d.stats.name, d.stats.given_up)

    # -- a round -------------------------------------------------------------------------
    def _draft(self, metrics: SpecDecodeMetrics, faults: list[str], timeline: Timeline, n: int,
               seq: list[int], round_no: int) -> dict[int, DraftOutput]:
        """Every live drafter drafts ``n`` tokens, all submitted before any is collected;
        each drafter's modelled PCIe and engine time go on the timeline from ``now``, and
        ``now`` moves past the slowest (they run at once)."""
        live = self._live()
        link_s0 = {i: self.drafters[i].device.transport.stats.seconds for i in live}
        feeds = {i: SpecDecodeMetrics() for i in live}      # replays' feed-only requests
        pending, outputs = {}, {}
        for i in live:
            d = self.drafters[i]
            try:
                pending[i] = d.cursor.submit(d.device, n, d.sampling, feeds[i])
            except DraftDeviceError as exc:
                self._fault(metrics, faults, i, exc, seq)
        for i, request in pending.items():
            d = self.drafters[i]
            try:
                outputs[i] = d.cursor.collect(d.device, request)
            except DraftDeviceError as exc:
                self._fault(metrics, faults, i, exc, seq)
        clock = self.drafters[0].device.clock_hz
        engine_s, link_s = 0.0, {}          # the slowest engine; PCIe seconds per link
        for i in live:
            d = self.drafters[i]
            cycles = feeds[i].device_cycles + (outputs[i].cycles if i in outputs else 0)
            pcie = d.device.transport.stats.seconds - link_s0[i]
            engine = cycles / clock if clock else 0.0
            d.stats.engine_cycles += cycles
            d.stats.pcie_seconds += pcie
            engine_s = max(engine_s, engine)
            link = shared_link(d.device)
            link_s[link] = link_s.get(link, 0.0) + pcie
            name = f"draft round {round_no} [{d.stats.name}]"
            timeline.add("pcie", name, timeline.now, pcie, "modelled", round=round_no, drafter=d.stats.name)
            timeline.add("engine", name, timeline.now + pcie, engine, "modelled", round=round_no,
                         drafter=d.stats.name, cycles=cycles)
        # Engines run at once; transfers over one link (the cores of one card) queue.
        pcie_s = max(link_s.values(), default=0.0)
        metrics.device_cycles += round(engine_s * clock)
        metrics.pcie_seconds += pcie_s
        timeline.now += pcie_s + engine_s
        return outputs

    def _choose(self, outputs: dict[int, DraftOutput], selected: int | None) -> _Round:
        """The verification this round's drafts make under :attr:`merge`."""
        drafts = {i: o.ids for i, o in outputs.items()}
        if not drafts:
            return _Round(outputs, [])
        if self.merge == "select":
            owner = selected if selected in drafts else self.weights.leader(sorted(drafts))
            return _Round(outputs, drafts[owner], owner)
        if self.merge == "vote":
            merged = merge_drafts(drafts, self.weights.weights)
            _, owner = heaviest_path(merged)
            return _Round(outputs, drafts[owner], owner)
        vocab = self.verifier.vocab_size
        if self.sampling.greedy:
            merged = merge_drafts(drafts, self.weights.weights)
            return _Round(outputs, [], tree=merged.tree, branch_of=merged.drafters)
        tree, branch_of = DraftTree(vocab), []
        for i in sorted(outputs):           # one unmerged branch per drafter, drafter order
            parent = ROOT
            for record in outputs[i].tokens:
                parent = tree.add(record.token, parent, record)
                branch_of.append([i])
        return _Round(outputs, [], tree=tree, branch_of=branch_of)

    def _verify(self, r: _Round) -> tuple[list[int], int, bool]:
        """Verify the round: (accepted tokens, the target's next token, invalid q)."""
        if r.tree is not None and len(r.tree):
            verdict = verify_tree(self.verifier.score_tree(r.tree), r.tree, self.sampling, self._generator)
            self.verifier.commit_path(verdict.path, verdict.next_token)
            for node in verdict.path[-1:]:
                for i in r.branch_of[node]:
                    self.drafters[i].stats.chosen += 1
            return [r.tree.nodes[k].token for k in verdict.path], verdict.next_token, verdict.invalid_q
        q = r.outputs[r.owner].tokens if r.owner is not None else []
        verdict: Verdict = verify_round(self.verifier.score(r.verified), r.verified, q, self.sampling,
                                        self._generator)
        self.verifier.commit(verdict.accepted, len(r.verified), verdict.next_token)
        if r.owner is not None:
            self.drafters[r.owner].stats.chosen += 1
        return r.verified[:verdict.accepted], verdict.next_token, verdict.invalid_q

    def _follow(self, outputs: dict[int, DraftOutput], n: int, committed: list[int]) -> None:
        """Each drafter keeps the KV its draft shares with ``committed``, is judged on the
        part of its draft that ``committed`` covers, and the weights follow."""
        shares = {}
        for i, d in enumerate(self.drafters):
            if not d.alive:
                continue
            if i in outputs:
                drafts = outputs[i].ids
                matched = matched_prefix(drafts, committed)
                d.stats.rounds += 1
                judged = min(n, len(committed))
                d.stats.drafted += n
                d.stats.judged += judged
                d.stats.matched += matched
                shares[i] = matched / judged
                d.cursor.follow(d.device, n, drafts, committed)
            else:                           # reset this round (or drafted nothing): feed all
                d.cursor.follow(d.device, 0, [], committed)
        if shares:
            self.weights.update(shares)
        for i, d in enumerate(self.drafters):
            d.stats.weights.append(self.weights.weights[i])

    # -- a generation --------------------------------------------------------------------
    def _start(self, prompt: list[int], run: "_Run") -> None:
        """Every drafter ready at the start of a sequence: a request left in flight by an
        earlier generation collected, the KV rolled back, the prompt queued."""
        for i, d in enumerate(self.drafters):
            d.stats = DrafterStats(d.stats.name)
            d.recoveries = 0
            d.cursor = DraftCursor(inputs=list(prompt))
            try:
                if d.device.pending is not None:
                    d.device.collect(d.device.pending)
                d.device.rollback(0)
            except DraftDeviceError as exc:
                self._fault(run.metrics, run.faults, i, exc, list(prompt))

    def _gamma(self, live: list[int], remaining: int) -> int | None:
        """Drafts per drafter this round (0: none), or None when the drafts' context is full."""
        if not live:
            return 0
        room = min(self.drafters[i].device.compiled.context_limit
                   - (self.drafters[i].device.committed + len(self.drafters[i].cursor.inputs)) + 1
                   for i in live)
        if room < 1:
            return None
        return min(self.adaptive.choose() if self.adaptive is not None else self.gamma, remaining - 1, room)

    def _round(self, run: "_Run", seq: list[int], remaining: int) -> tuple[int, list[int], list[int]] | None:
        """Draft, merge, verify and follow one round: (drafted per drafter, accepted
        drafts, committed tokens), or None at the context limit. Raises what the target
        raises."""
        round_no = run.metrics.rounds + 1
        live = self._live()
        n = self._gamma(live, remaining)
        if n is None:
            return None
        # select's choice comes from past rounds only, before anything is drafted
        selected = self.weights.leader(live) if live and self.merge == "select" else None
        outputs: dict[int, DraftOutput] = {}
        draft_start, t_sim = run.timeline.now, time.perf_counter()
        if n > 0:
            outputs = self._draft(run.metrics, run.faults, run.timeline, n, seq, round_no)
        run.sim_s += time.perf_counter() - t_sim
        draft_s = run.timeline.now - draft_start
        chosen = self._choose(outputs, selected)
        run.tree_nodes += len(chosen.tree) if chosen.tree is not None else 0
        v0 = self.verifier.seconds
        try:
            accepted, next_token, invalid_q = self._verify(chosen)
        finally:
            run.timeline.then("target", f"verify round {round_no}", self.verifier.seconds - v0,
                              "measured", round=round_no)
        if invalid_q:
            run.metrics.record_fault("malformed")
            run.faults.append(f"round {round_no}: a draft with q(token) = 0 ended the round there")
        committed = accepted + [next_token]
        t_sim = time.perf_counter()
        self._follow(outputs, n, committed)
        run.sim_s += time.perf_counter() - t_sim
        drafted = n if outputs else 0
        if self.adaptive is not None and drafted:
            clean = len(outputs) == len(live)
            self.adaptive.observe(RoundFacts(drafted, len(accepted), self.verifier.seconds - v0, None,
                                             ((drafted, draft_s),) if clean else ()))
        return drafted, accepted, committed

    def generate(self, prompt: list[int], max_new_tokens: int,
                 on_tokens: Callable[[list[int]], None] | None = None) -> MultiDraftOutput:
        """Generate up to ``max_new_tokens`` after ``prompt``; ``on_tokens`` streams each round.
        Raises ``ValueError`` for a prompt that is empty or does not fit the drafts'
        context; everything else ends up in the output with the tokens generated so far."""
        if not prompt:
            raise ValueError("the prompt must contain at least one token")
        limit = self.context_limit
        if len(prompt) >= limit:
            raise ValueError(f"the prompt has {len(prompt)} tokens; the drafts' context limit is "
                             f"{limit}. Shorten the prompt or use a preset with more kv_positions")
        run = _Run.begin(self, prompt)
        out: list[int] = []
        stop, message, error = "max_new_tokens", "", None
        t_sim = time.perf_counter()
        self._start(prompt, run)
        run.sim_s += time.perf_counter() - t_sim
        try:
            self.verifier.prefill(prompt)
        except Exception as exc:            # noqa: BLE001 - returned, not lost
            stop, message, error, max_new_tokens = "verifier_error", verifier_message(exc, 0), exc, 0
        run.timeline.then("target", "prefill", self.verifier.seconds - run.verifier_s0, "measured",
                          tokens=len(prompt))
        seq = list(prompt)
        while len(out) < max_new_tokens:
            t_round, v_round, sim_round = time.perf_counter(), self.verifier.seconds, run.sim_s
            remaining = max_new_tokens - len(out)
            if not self._live() and not self.fallback:
                stop, message = "device_error", "every drafter was given up: " + run.dropped()
                break
            try:
                step = self._round(run, seq, remaining)
            except Exception as exc:        # noqa: BLE001 - returned, not lost
                stop, message, error = "verifier_error", verifier_message(exc, len(out)), exc
                break
            if step is None:
                stop = "context_limit"
                message = (f"stopped at the draft engine's context limit of {limit} positions; "
                           "use a preset with more kv_positions for longer generations")
                break
            drafted, accepted, new = step
            run.metrics.record_round(drafted, len(accepted), len(new))
            if not self._live():            # the target alone: no drafter is left
                run.metrics.fallback_rounds += 1
                run.metrics.fallback_tokens += len(new)
            new, eos = tokens_to_emit(new, self.eos_token_id, remaining)
            out += new
            seq += new
            if on_tokens:
                on_tokens(new)
            host = (time.perf_counter() - t_round) - (self.verifier.seconds - v_round) - (run.sim_s - sim_round)
            run.timeline.then("host", f"host round {run.metrics.rounds}", host, "measured")
            if eos:
                stop = "eos"
                break
        return run.finish(self, out, stop, message, error)


@dataclass
class _Run:
    """One generation's account across its rounds."""
    metrics: SpecDecodeMetrics
    timeline: Timeline
    links0: list
    t_start: float
    verifier_s0: float
    forwards0: int
    faults: list[str] = field(default_factory=list)
    sim_s: float = 0.0
    tree_nodes: int = 0
    drafters: list[Drafter] = field(default_factory=list)
    retries0: int = 0

    @classmethod
    def begin(cls, decoder: MultiDraftDecoder, prompt: list[int]) -> "_Run":
        adaptive = decoder.adaptive is not None
        first = decoder.drafters[0].device
        m = SpecDecodeMetrics(gamma=0 if adaptive else decoder.gamma,
                              gamma_mode="auto" if adaptive else "fixed",
                              device_clock_hz=first.clock_hz,
                              device_cycle_source=f"{first.cycle_source}; per round the slowest of "
                                                  f"{len(decoder.drafters)} concurrent drafters"
                                                  + ("" if len({shared_link(d.device) for d in decoder.drafters})
                                                     == len(decoder.drafters) else
                                                     " (cores of one card: each as if alone, a lower "
                                                     "bound under memory contention)"),
                              prefill_tokens=len(prompt))
        return cls(m, Timeline("serial"), [d.device.transport.stats.snapshot() for d in decoder.drafters],
                   time.perf_counter(), decoder.verifier.seconds, decoder.verifier.forwards,
                   drafters=decoder.drafters,
                   retries0=sum(d.device.transport_retries for d in decoder.drafters))

    def dropped(self) -> str:
        return "; ".join(f"{d.stats.name}: {d.stats.given_up}" for d in self.drafters if d.stats.given_up)

    def finish(self, decoder: MultiDraftDecoder, out: list[int], stop: str, message: str,
               error: Exception | None) -> MultiDraftOutput:
        m, verifier = self.metrics, decoder.verifier
        m.emitted_tokens = len(out)
        m.verifier_seconds = verifier.seconds - self.verifier_s0
        m.target_forward_passes = verifier.forwards - self.forwards0
        links = [d.device.transport.stats.since(l0) for d, l0 in zip(self.drafters, self.links0)]
        m.pcie_bytes = sum(link.bytes for link in links)
        m.pcie_transfers = sum(link.dma_transfers for link in links)
        m.transport_retries = sum(d.device.transport_retries for d in self.drafters) - self.retries0
        m.simulator_seconds = self.sim_s
        m.host_seconds = max(0.0, time.perf_counter() - self.t_start - m.verifier_seconds - self.sim_s)
        return MultiDraftOutput(out, stop, m, message, degraded=not any(d.alive for d in self.drafters),
                                fallback_reason=self.dropped(), faults=self.faults, error=error,
                                timeline=self.timeline, drafters=[d.stats for d in self.drafters],
                                merge=decoder.merge, tree_nodes=self.tree_nodes)
