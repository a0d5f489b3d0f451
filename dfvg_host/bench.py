"""``dfvg bench``: three ways to decode the same prompts, measured in one run.

1. **target-only** — autoregressive greedy decoding, transformers ``generate``;
2. **assisted** — Hugging Face assisted generation (``assistant_model=``) with the same
   float draft on the verifier's device: speculative decoding on the GPU alone;
3. **dfvg** — chain speculative decoding with the compiled draft on a draft device
   (``sim://PRESET``), over a sweep of γ;
4. **dfvg-pipelined** — the same, with the engine drafting round n+1 while the target
   verifies round n (:class:`~dfvg_host.pipelined.PipelinedDecoder`), same γ sweep;
5. **dfvg-adaptive** — serial DFVG with γ chosen per round
   (:class:`~dfvg_host.adaptive.AdaptiveLength`, ``gamma="auto"``, γ in 1..16). One
   controller serves the whole run (warm-up included), as a server would keep one, so it
   carries what it learnt from prompt to prompt. Its speedup is reported over target-only
   and over the best fixed γ of serial DFVG in the same run.
6. **dfvg-engine-tree** — the engine drafts a token tree per round (docs/isa.md §9: γ
   levels of the preset's rows, 4 wide on the Alveo presets) and the target verifies it
   in one forward (:class:`~dfvg_host.tree_drafting.TreeDecoder`), at every γ (= depth)
   whose tree fits a request; skipped when the device or the program drafts no trees.
   Its rows carry the tokens verified per target forward (the tree's nodes) next to the
   tokens committed per forward, to set against the chain at as many verified tokens.
   With a budget (``BenchSettings.tree_budget``, ``dfvg bench --tree-budget N``) the
   target verifies at most N of each tree's nodes (the likeliest accepted, greedy).
   **dfvg-engine-tree-pipelined** — the same trees with the engine drafting round n+1's
   tree while the target verifies round n's
   (:class:`~dfvg_host.pipelined_tree.PipelinedTreeDecoder`), at the same depths, when
   pipelined DFVG runs too; its overlap is modelled as dfvg-pipelined's.
7. With several drafters (``--draft`` given more than once; Smurfs,
   :mod:`dfvg_host.multi_draft`): **dfvg[NAME]**, each further drafter alone (``dfvg`` is
   the first), **dfvg-vote** (weighted-majority voting) and **dfvg-tree** (every draft
   verified as one tree) at every γ, and **dfvg-vote-adaptive** (voting with γ chosen per
   round) once. Each multi-drafter method keeps one decoder, and so its weights, over the
   whole run; the drafters draft at once, and a round's drafting costs the slowest one
   (modelled).

What is measured and what is modelled
-------------------------------------
*measured* is wall time on this host: the target's forward passes (the verifier), the
host's own work around them, and, for assisted generation, the float draft's forward
passes. *modelled* is the draft engine's time (cycle model at the preset clock) and
PCIe (link model). DFVG tokens/s adds the four parts sequentially, as ``dfvg generate``
projects it; pipelined DFVG (chains and trees) takes the modelled overlap of drafting with verification once
(``hidden_s``: per round min(continuation engine+PCIe, verify), modelled — the sim device
runs synchronously, so the overlap is not observed). The functional model's own wall time
stands in for the FPGA and is reported but not counted. Speedups are ratios between methods run on the
same prompts in the same process, interleaved prompt by prompt so that load from other
processes falls on every method alike.

Every method decodes greedily and ignores EOS (like ``ignore_eos`` in vLLM's
benchmarks), so each generates exactly the same number of tokens, and each prompt's
output is checked against target-only decoding.
"""

from __future__ import annotations

import copy
import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from dfvg_hw.spec.descriptors import MAX_DRAFT
from dfvg_host.adaptive import AdaptiveLength
from dfvg_host.demo import REPO_ROOT
from dfvg_host.driver import DraftDevice
from dfvg_host.efficiency import EfficiencyRow
from dfvg_host.multi_draft import MultiDraftDecoder
from dfvg_host.pipelined import PipelinedDecoder
from dfvg_host.speculative import SpeculativeDecoder
from dfvg_host.tree_drafting import TreeDecoder
from dfvg_host.verifier import Verifier

__all__ = ["ENGINE_TREE", "ENGINE_TREE_PIPELINED", "BenchError", "BenchPrompt", "BenchSettings", "QUICK", "FULL", "DEFAULT_PROMPT_SET",
           "Tally", "BenchResult", "ForwardClock", "BenchRunner", "load_prompt_set", "pick_prompts"]

DEFAULT_PROMPT_SET = REPO_ROOT / "benchmarks" / "prompts" / "multitask.json"
ALL_TASKS = "all"
#: Methods of several drafters at once, by merge rule (dfvg_host.multi_draft).
MULTI_METHODS = {"dfvg-vote": "vote", "dfvg-tree": "tree", "dfvg-vote-adaptive": "vote"}
#: Methods whose γ is chosen per round.
ADAPTIVE_METHODS = ("dfvg-adaptive", "dfvg-vote-adaptive")
#: The engine's token trees (dfvg_host.tree_drafting): γ is the tree's depth in levels.
ENGINE_TREE = "dfvg-engine-tree"
#: The same trees, pipelined (dfvg_host.pipelined_tree).
ENGINE_TREE_PIPELINED = "dfvg-engine-tree-pipelined"
#: The engine's trees, serial and pipelined.
ENGINE_TREE_METHODS = (ENGINE_TREE, ENGINE_TREE_PIPELINED)
#: Methods whose engine drafts round n+1 while the target verifies round n (overlap modelled).
PIPELINED_METHODS = ("dfvg-pipelined", ENGINE_TREE_PIPELINED)
#: The headline's strategies x schedules, each at its best γ: (method, strategy, schedule).
STRATEGY_SCHEDULES = (("dfvg", "chain", "serial"), (ENGINE_TREE, "tree", "serial"),
                      ("dfvg-pipelined", "chain", "pipelined"), (ENGINE_TREE_PIPELINED, "tree", "pipelined"))


class BenchError(ValueError):
    """A benchmark that cannot run as asked; the message says why and what to do."""


# -- prompts -------------------------------------------------------------------------------
@dataclass(frozen=True)
class BenchPrompt:
    """One prompt of a multi-task prompt set."""
    task: str
    source: str
    text: str


def load_prompt_set(path: str | Path) -> list[BenchPrompt]:
    """Read a prompt set: a JSON object whose ``prompts`` list holds ``{task, source, text}``."""
    p = Path(path)
    try:
        data = json.loads(p.read_text(encoding="utf-8"))
        prompts = [BenchPrompt(str(d["task"]), str(d["source"]), str(d["text"])) for d in data["prompts"]]
    except FileNotFoundError:
        raise BenchError(f"prompt set {p} does not exist") from None
    except (ValueError, KeyError, TypeError) as exc:
        raise BenchError(f"prompt set {p} is not a JSON object with a 'prompts' list of "
                         f"{{task, source, text}} ({type(exc).__name__}: {exc})") from None
    if not prompts or any(not q.text for q in prompts):
        raise BenchError(f"prompt set {p} has no prompts, or an empty one")
    return prompts


def pick_prompts(prompts: list[BenchPrompt], per_task: int) -> list[BenchPrompt]:
    """The first ``per_task`` prompts of each task, tasks in order of first appearance."""
    by_task: dict[str, list[BenchPrompt]] = {}
    for q in prompts:
        by_task.setdefault(q.task, []).append(q)
    return [q for qs in by_task.values() for q in qs[:per_task]]


# -- settings ------------------------------------------------------------------------------
@dataclass(frozen=True)
class BenchSettings:
    """What one benchmark run decodes.

    Attributes
    ----------
    gammas : tuple of int
        Draft lengths swept for assisted generation and DFVG.
    max_new_tokens : int
        Tokens generated per prompt (EOS ignored).
    per_task : int
        Prompts taken from each task of the prompt set.
    assisted_hf_defaults : bool
        Also run assisted generation with transformers' own draft-length settings.
    warmup_tokens : int
        Tokens of an unmeasured first run of every method (lazy initialisation).
    pipelined : bool
        Also run pipelined DFVG (``dfvg-pipelined``) at every γ.
    adaptive : bool
        Also run serial DFVG with an adaptive γ (``dfvg-adaptive``).
    adaptive_gamma_max : int
        The largest γ the adaptive controller tries.
    several : bool
        With several drafters, also run each alone, voting, the merged tree and voting
        with an adaptive γ.
    engine_tree : bool
        Also run the engine's token trees (``dfvg-engine-tree``) at every γ (the depth)
        whose tree fits a request, when the device drafts trees. On in :data:`FULL` and
        :data:`QUICK` (``dfvg bench``; ``--no-engine-tree`` leaves it out), off in a bare
        ``BenchSettings()`` so that a caller's set of rows stays what it was. With
        :attr:`pipelined` also pipelined (``dfvg-engine-tree-pipelined``), at the same depths.
    tree_budget : int or None
        Nodes the engine trees' target forward verifies at most (None: the whole tree of
        γ levels x the device's width).
    """
    gammas: tuple[int, ...] = (1, 2, 3, 4, 6, 8)
    max_new_tokens: int = 128
    per_task: int = 8
    assisted_hf_defaults: bool = True
    warmup_tokens: int = 8
    pipelined: bool = True
    adaptive: bool = True
    adaptive_gamma_max: int = 16
    several: bool = True
    engine_tree: bool = False
    tree_budget: int | None = None


FULL = BenchSettings(engine_tree=True)
QUICK = BenchSettings(gammas=(1, 2, 3, 4, 6), max_new_tokens=64, per_task=2, engine_tree=True)


# -- measuring -----------------------------------------------------------------------------
class ForwardClock:
    """Measured wall time and count of a model's forward passes, through module hooks.

    Synchronises before and after each pass on cuda, so that asynchronous kernels are
    charged to the pass that launched them.
    """

    def __init__(self, model: torch.nn.Module):
        self.model = model
        self.seconds = 0.0
        self.calls = 0
        self._t0 = 0.0
        self._handles: list = []
        self._cuda = next(model.parameters()).device.type == "cuda"

    def _sync(self) -> None:
        if self._cuda:
            torch.cuda.synchronize()

    def _before(self, *_):
        self._sync()
        self._t0 = time.perf_counter()

    def _after(self, *_):
        self._sync()
        self.seconds += time.perf_counter() - self._t0
        self.calls += 1

    def __enter__(self) -> "ForwardClock":
        self._handles = [self.model.register_forward_pre_hook(self._before),
                         self.model.register_forward_hook(self._after)]
        return self

    def __exit__(self, *exc) -> None:
        for h in self._handles:
            h.remove()


@dataclass
class Tally:
    """Counts and times of one method (at one γ) over a set of prompts.

    ``target_s`` and ``host_s`` are measured. ``draft_s`` is measured for assisted
    generation (float draft forward passes) and modelled for DFVG (cycle model);
    ``pcie_s`` is modelled (link model); ``simulator_s`` is the functional model's
    measured wall time, which stands in for the FPGA and is not part of ``seconds``.
    ``hidden_s`` (dfvg-pipelined) is the modelled drafting that overlapped verification,
    taken out of ``seconds`` once.
    """
    method: str                       # "target-only", "assisted", "dfvg", "dfvg-pipelined", "dfvg-adaptive"
    gamma: int | None                 # None: target-only, assisted with HF's own settings, dfvg-adaptive
    task: str = ALL_TASKS
    prompts: int = 0
    tokens: int = 0
    rounds: int = 0                   # target forward passes that committed tokens
    drafted: int = 0
    accepted: int = 0
    drafted_per_position: list[int] = field(default_factory=list)
    accepted_per_position: list[int] = field(default_factory=list)
    target_s: float = 0.0
    host_s: float = 0.0
    draft_s: float = 0.0
    pcie_s: float = 0.0
    simulator_s: float = 0.0
    matches_target_only: int = 0      # prompts whose output equals target-only greedy
    hidden_s: float = 0.0             # modelled overlap (dfvg-pipelined)
    pipeline_hits: int = 0
    pipeline_misses: int = 0
    gamma_histogram: dict[int, int] = field(default_factory=dict)   # γ -> rounds (DFVG)
    drafters: dict[str, list[int]] = field(default_factory=dict)  # name -> [judged, matched, chosen]
    tree_nodes: int = 0               # tokens verified as tree nodes (engine trees, dfvg-tree)

    @property
    def key(self) -> str:
        if self.method == "target-only":
            return self.method
        if self.method in ADAPTIVE_METHODS:
            return f"{self.method} γ=auto"
        return f"{self.method} γ={self.gamma}" if self.gamma is not None else f"{self.method} (HF defaults)"

    def add(self, other: "Tally") -> None:
        for name in ("prompts", "tokens", "rounds", "drafted", "accepted", "target_s", "host_s",
                     "draft_s", "pcie_s", "simulator_s", "matches_target_only", "hidden_s",
                     "pipeline_hits", "pipeline_misses", "tree_nodes"):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        for mine, theirs in ((self.drafted_per_position, other.drafted_per_position),
                             (self.accepted_per_position, other.accepted_per_position)):
            mine.extend([0] * (len(theirs) - len(mine)))
            for i, n in enumerate(theirs):
                mine[i] += n
        for g, n in other.gamma_histogram.items():
            self.gamma_histogram[g] = self.gamma_histogram.get(g, 0) + n
        for name, counts in other.drafters.items():
            mine = self.drafters.setdefault(name, [0, 0, 0])
            for i, n in enumerate(counts):
                mine[i] += n

    @property
    def mean_gamma(self) -> float | None:
        """Drafts per round over the rounds that drafted (DFVG)."""
        rounds = sum(self.gamma_histogram.values())
        return sum(g * n for g, n in self.gamma_histogram.items()) / rounds if rounds else None

    @property
    def verified_per_forward(self) -> float | None:
        """Draft tokens each target forward that verified drafts checked: a tree's nodes,
        a chain's γ (DFVG)."""
        rounds = sum(self.gamma_histogram.values())
        return (self.tree_nodes or self.drafted) / rounds if rounds else None

    @property
    def seconds(self) -> float:
        """Time the tokens/s is computed from: measured parts plus modelled parts, less
        the modelled overlap of a pipelined run."""
        return self.target_s + self.host_s + self.draft_s + self.pcie_s - self.hidden_s

    @property
    def is_dfvg(self) -> bool:
        return self.method.startswith("dfvg")

    @property
    def hidden_share(self) -> float | None:
        """Share of the engine + PCIe time hidden behind verification (pipelined)."""
        total = self.draft_s + self.pcie_s
        return min(1.0, self.hidden_s / total) if self.method in PIPELINED_METHODS and total else None

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0

    @property
    def acceptance_rate(self) -> float | None:
        return self.accepted / self.drafted if self.drafted else None

    @property
    def mean_accepted_length(self) -> float:
        """Tokens committed per target forward: accepted drafts plus the bonus token."""
        return (self.accepted + self.rounds) / self.rounds if self.rounds else 0.0

    @property
    def acceptance_per_position(self) -> list[float]:
        return [a / d if d else 0.0 for a, d in zip(self.accepted_per_position, self.drafted_per_position)]

    @property
    def host_us_per_round(self) -> float:
        return 1e6 * self.host_s / self.rounds if self.rounds else 0.0

    @property
    def host_share(self) -> float:
        """Host time as a fraction of the (measured + modelled) time."""
        return self.host_s / self.seconds if self.seconds else 0.0

    def labels(self, verifier_device: str) -> dict:
        draft = {"target-only": "none",
                 "assisted": f"measured (float draft forward passes on {verifier_device})",
                 }.get(self.method, "modelled (cycle model at the preset clock)"
                       + ("; per round the slowest of the drafters, which draft at once"
                          if self.method in MULTI_METHODS else "")
                       + ("; a tree request's cycles (docs/isa.md §9.5, exact against the RTL)"
                          if self.method in ENGINE_TREE_METHODS else ""))
        return dict(target_s="measured (target forward passes)",
                    host_s="measured (wall time outside the target and draft forward passes)",
                    draft_s=draft, pcie_s="modelled (link model)" if self.is_dfvg else "none",
                    simulator_s="measured wall of the functional model; not counted",
                    hidden_s=("modelled: per round min(continuation engine+PCIe, verify)"
                              if self.method in PIPELINED_METHODS else "none"),
                    tokens_per_s=("measured" if not self.is_dfvg else
                                  "measured target+host + modelled FPGA+PCIe, unpipelined"
                                  if self.method not in PIPELINED_METHODS else
                                  "measured target+host + modelled FPGA+PCIe; pipelined: overlap "
                                  "counted once"),
                    acceptance=("derived from forward-pass counts" if self.method == "assisted"
                                else f"counted per round; per tree level for {self.method}"
                                if self.method in ENGINE_TREE_METHODS else "counted per round"))

    def to_dict(self, verifier_device: str) -> dict:
        return dict(key=self.key, method=self.method, gamma=self.gamma, task=self.task,
                    prompts=self.prompts, tokens=self.tokens, rounds=self.rounds,
                    drafted=self.drafted, accepted=self.accepted,
                    acceptance_rate=self.acceptance_rate, mean_accepted_length=self.mean_accepted_length,
                    acceptance_per_position=self.acceptance_per_position if self.drafted_per_position else None,
                    drafted_per_position=self.drafted_per_position or None,
                    accepted_per_position=self.accepted_per_position or None,
                    target_s=self.target_s, host_s=self.host_s, draft_s=self.draft_s,
                    pcie_s=self.pcie_s, simulator_s=self.simulator_s, seconds=self.seconds,
                    tokens_per_s=self.tokens_per_s, host_us_per_round=self.host_us_per_round,
                    host_share=self.host_share, matches_target_only=self.matches_target_only,
                    hidden_s=self.hidden_s, hidden_share=self.hidden_share,
                    pipeline_hits=self.pipeline_hits, pipeline_misses=self.pipeline_misses,
                    mean_gamma=self.mean_gamma, tree_nodes=self.tree_nodes,
                    verified_per_forward=self.verified_per_forward,
                    tokens_per_forward=self.mean_accepted_length,
                    gamma_histogram={str(g): n for g, n in sorted(self.gamma_histogram.items())} or None,
                    drafters={name: dict(judged=j, matched=m, match_rate=m / j if j else None, chosen=c)
                              for name, (j, m, c) in self.drafters.items()} or None,
                    labels=self.labels(verifier_device))


# -- running -------------------------------------------------------------------------------
class BenchRunner:
    """Runs every method on one prompt at a time, sharing one target model.

    Members
    -------
    verifier : Verifier
        Holds the target model (used by all three methods) and its device.
    draft_model : transformers.PreTrainedModel
        The float draft, on the verifier's device, for assisted generation.
    device : DraftDevice
        The draft device with the compiled draft loaded, for DFVG.
    extra_drafters : list of (str, DraftDevice)
        Further drafters by name, each on its own device, for the methods of several
        drafters (:data:`MULTI_METHODS`); empty for one.
    """

    def __init__(self, verifier: Verifier, draft_model, device: DraftDevice,
                 extra_drafters: list[tuple[str, DraftDevice]] = (), main_name: str = "draft"):
        self.verifier = verifier
        self.target = verifier.model
        self.draft_model = draft_model.to(verifier.device).eval()
        self.device = device
        self.extra_drafters = list(extra_drafters)
        self.main_name = main_name
        self.adaptive: AdaptiveLength | None = None     # dfvg-adaptive's, made on first use
        # one decoder per multi-drafter method and γ, made on first use: its weights (and
        # adaptive controller) learn over the whole run, as a server's would
        self._multi: dict[tuple[str, int | None], MultiDraftDecoder] = {}
        self._tree_decoders: dict[tuple[str, int, int | None], TreeDecoder] = {}
        # What transformers would use for the assistant when told nothing.
        self._assistant_defaults = copy.deepcopy(self.draft_model.generation_config)

    def _greedy_config(self, max_new_tokens: int):
        gc = copy.deepcopy(self.target.generation_config)
        gc.do_sample = False
        gc.max_new_tokens = max_new_tokens
        gc.min_new_tokens = None
        gc.eos_token_id = None       # ignore EOS: every method generates the same count
        if gc.pad_token_id is None:
            gc.pad_token_id = 0
        return gc

    def _generate(self, prompt: list[int], max_new_tokens: int, **kwargs) -> list[int]:
        ids = torch.tensor([prompt], device=self.verifier.device)
        with torch.no_grad():
            out = self.target.generate(ids, generation_config=self._greedy_config(max_new_tokens),
                                       attention_mask=torch.ones_like(ids), **kwargs)
        return out[0, len(prompt):].tolist()

    def target_only(self, prompt: list[int], max_new_tokens: int) -> tuple[list[int], Tally]:
        t0 = time.perf_counter()
        with ForwardClock(self.target) as target:
            tokens = self._generate(prompt, max_new_tokens)
        wall = time.perf_counter() - t0
        return tokens, Tally("target-only", None, prompts=1, tokens=len(tokens), rounds=target.calls,
                             target_s=target.seconds, host_s=max(0.0, wall - target.seconds))

    def _configure_assistant(self, gamma: int | None) -> None:
        gc = self.draft_model.generation_config
        if gamma is None:
            for name in ("num_assistant_tokens", "num_assistant_tokens_schedule",
                         "assistant_confidence_threshold"):
                setattr(gc, name, getattr(self._assistant_defaults, name))
        else:
            # Exactly γ drafts per round, as DFVG's chain scheduler drafts: a constant
            # schedule and no early stop on the draft's confidence.
            gc.num_assistant_tokens = gamma
            gc.num_assistant_tokens_schedule = "constant"
            gc.assistant_confidence_threshold = 0.0

    def assisted(self, prompt: list[int], max_new_tokens: int, gamma: int | None) -> tuple[list[int], Tally]:
        self._configure_assistant(gamma)
        t0 = time.perf_counter()
        with ForwardClock(self.target) as target, ForwardClock(self.draft_model) as draft:
            tokens = self._generate(prompt, max_new_tokens, assistant_model=self.draft_model)
        wall = time.perf_counter() - t0
        # transformers does not report acceptance; each target forward verifies one round
        # and commits its accepted drafts plus one token, and each draft forward drafts one.
        rounds = target.calls
        return tokens, Tally("assisted", gamma, prompts=1, tokens=len(tokens), rounds=rounds,
                             drafted=draft.calls, accepted=len(tokens) - rounds,
                             target_s=target.seconds, draft_s=draft.seconds,
                             host_s=max(0.0, wall - target.seconds - draft.seconds))

    def dfvg(self, prompt: list[int], max_new_tokens: int, gamma: int | str,
             pipelined: bool = False, gamma_max: int = AdaptiveLength.DEFAULT_GAMMA_MAX,
             device: DraftDevice | None = None, method: str | None = None) -> tuple[list[int], Tally]:
        """DFVG at a fixed γ, or ``gamma="auto"``: serial with :attr:`adaptive`, one
        controller for every prompt of the run. ``device`` (default :attr:`device`) and
        ``method`` name another drafter's run."""
        adaptive = None
        if gamma == "auto":
            if self.adaptive is None or self.adaptive.gamma_max != gamma_max:
                self.adaptive = AdaptiveLength(gamma_max=gamma_max)
            adaptive = self.adaptive
        # A device given up would leave the target decoding alone under DFVG's name.
        decoder = (PipelinedDecoder if pipelined else SpeculativeDecoder)(
            device or self.device, self.verifier, gamma=gamma, eos_token_id=None, fallback=False,
            adaptive=adaptive)
        out = decoder.generate(prompt, max_new_tokens)
        if out.stop_reason != "max_new_tokens":
            raise BenchError(f"DFVG stopped early at γ={gamma} ({out.stop_reason}): {out.message}")
        method = method or ("dfvg-adaptive" if adaptive is not None else
                            "dfvg-pipelined" if pipelined else "dfvg")
        return out.tokens, self._dfvg_tally(out.metrics, method, None if adaptive is not None else gamma)

    def several(self, prompt: list[int], max_new_tokens: int, method: str, gamma: int | None,
                gamma_max: int = AdaptiveLength.DEFAULT_GAMMA_MAX) -> tuple[list[int], Tally]:
        """Every drafter at once under ``method``'s merge rule (:data:`MULTI_METHODS`)."""
        key = (method, gamma)
        if key not in self._multi:
            names = [self.main_name] + [name for name, _ in self.extra_drafters]
            devices = [self.device] + [d for _, d in self.extra_drafters]
            adaptive = AdaptiveLength(gamma_max=gamma_max) if method in ADAPTIVE_METHODS else None
            self._multi[key] = MultiDraftDecoder(devices, self.verifier, merge=MULTI_METHODS[method],
                                                 gamma=gamma or "auto", names=names, eos_token_id=None,
                                                 fallback=False, adaptive=adaptive)
        out = self._multi[key].generate(prompt, max_new_tokens)
        if out.stop_reason != "max_new_tokens":
            raise BenchError(f"{method} stopped early at γ={gamma} ({out.stop_reason}): {out.message}")
        tally = self._dfvg_tally(out.metrics, method, gamma)
        tally.drafters = {d.name: [d.judged, d.matched, d.chosen] for d in out.drafters}
        tally.tree_nodes = out.tree_nodes
        return out.tokens, tally

    def engine_tree(self, prompt: list[int], max_new_tokens: int, depth: int, pipelined: bool = False,
                    budget: int | None = None) -> tuple[list[int], Tally]:
        """The engine's token trees, ``depth`` levels of the device's width per round, at
        most ``budget`` nodes verified (None: all), serially or ``pipelined``."""
        if pipelined:
            from dfvg_host.pipelined_tree import PipelinedTreeDecoder as decoder_class
        else:
            decoder_class = TreeDecoder
        method = ENGINE_TREE_PIPELINED if pipelined else ENGINE_TREE
        key = (method, depth, budget)
        if key not in self._tree_decoders:
            # One decoder per row for the whole run: a budgeted tree's acceptance model
            # learns from prompt to prompt, as a server's would.
            self._tree_decoders[key] = decoder_class(self.device, self.verifier, depth=depth, budget=budget,
                                                     eos_token_id=None, fallback=False)
        out = self._tree_decoders[key].generate(prompt, max_new_tokens)
        if out.stop_reason != "max_new_tokens":
            raise BenchError(f"{method} stopped early at depth {depth} ({out.stop_reason}): "
                             f"{out.message}")
        return out.tokens, self._dfvg_tally(out.metrics, method, depth)

    def tree_depths(self, settings: BenchSettings) -> tuple[int, ...]:
        """The γ (depths) the engine's trees run at: none when the device drafts no trees."""
        width = self.device.tree_width if settings.engine_tree else 0
        return tuple(g for g in settings.gammas if width and g * width <= MAX_DRAFT)

    @staticmethod
    def _dfvg_tally(m, method: str, gamma: int | None) -> Tally:
        """A DFVG method's tally from its generation's metrics."""
        return Tally(method, gamma, prompts=1, tokens=m.emitted_tokens, rounds=m.rounds,
                     drafted=m.drafted_tokens, accepted=m.accepted_tokens,
                     drafted_per_position=list(m.drafted_per_position),
                     accepted_per_position=list(m.accepted_per_position),
                     target_s=m.verifier_seconds, host_s=m.host_seconds,
                     draft_s=m.device_seconds, pcie_s=m.pcie_seconds,
                     simulator_s=m.simulator_seconds,
                     hidden_s=min(m.hidden_draft_seconds, m.draft_seconds),
                     pipeline_hits=m.pipeline_hits, pipeline_misses=m.pipeline_misses,
                     gamma_histogram=m.gamma_histogram, tree_nodes=m.tree_nodes)

    def methods(self, settings: BenchSettings) -> list[tuple[str, int | None]]:
        """(method, γ) in the order each prompt runs them."""
        runs: list[tuple[str, int | None]] = [("target-only", None)]
        if settings.assisted_hf_defaults:
            runs.append(("assisted", None))
        several = settings.several and self.extra_drafters
        depths = self.tree_depths(settings)
        for g in settings.gammas:
            runs += [("assisted", g), ("dfvg", g)] + ([("dfvg-pipelined", g)] if settings.pipelined else [])
            runs += [(ENGINE_TREE, g)] if g in depths else []
            runs += [(ENGINE_TREE_PIPELINED, g)] if g in depths and settings.pipelined else []
            if several:
                runs += [(f"dfvg[{name}]", g) for name, _ in self.extra_drafters]
                runs += [("dfvg-vote", g), ("dfvg-tree", g)]
        if settings.adaptive:
            runs.append(("dfvg-adaptive", None))
            if several:
                runs.append(("dfvg-vote-adaptive", None))
        return runs

    def run_one(self, method: str, gamma: int | None, prompt: list[int], n: int,
                settings: BenchSettings | None = None) -> tuple[list[int], Tally]:
        settings = settings or BenchSettings()
        gamma_max = settings.adaptive_gamma_max
        if method == "target-only":
            return self.target_only(prompt, n)
        if method == "assisted":
            return self.assisted(prompt, n, gamma)
        if method == "dfvg-adaptive":
            return self.dfvg(prompt, n, "auto", gamma_max=gamma_max)
        if method in MULTI_METHODS:
            return self.several(prompt, n, method, gamma, gamma_max)
        if method in ENGINE_TREE_METHODS:
            return self.engine_tree(prompt, n, gamma, pipelined=method == ENGINE_TREE_PIPELINED,
                                    budget=settings.tree_budget)
        if method.startswith("dfvg["):
            device = dict(self.extra_drafters)[method[len("dfvg["):-1]]
            return self.dfvg(prompt, n, gamma, device=device, method=method)
        return self.dfvg(prompt, n, gamma, pipelined=method == "dfvg-pipelined")

    def run(self, prompts: list[tuple[BenchPrompt, list[int]]], settings: BenchSettings,
            log: Callable[[str], None] = lambda _: None) -> dict[tuple[str, str, int | None], Tally]:
        """Run every method on every prompt; tallies keyed by (task, method, γ), task "all" included."""
        limit = self.device.compiled.context_limit
        for q, ids in prompts:
            need = len(ids) + settings.max_new_tokens + max(settings.gammas)
            if need > limit:
                raise BenchError(f"a {q.task} prompt ({len(ids)} tokens) plus {settings.max_new_tokens} "
                                 f"new tokens and γ={max(settings.gammas)} needs {need} positions, the "
                                 f"draft's context limit is {limit}; lower --max-new-tokens")
        plan = self.methods(settings)
        for method, gamma in plan:          # unmeasured: lazy initialisation, allocator warm-up
            self.run_one(method, gamma, prompts[0][1], settings.warmup_tokens, settings)
        tallies: dict[tuple[str, str, int | None], Tally] = {}
        t_start = time.perf_counter()
        for i, (q, ids) in enumerate(prompts, 1):
            reference: list[int] | None = None
            line = []
            for method, gamma in plan:
                tokens, tally = self.run_one(method, gamma, ids, settings.max_new_tokens, settings)
                if reference is None:
                    reference = tokens
                tally.matches_target_only = int(tokens == reference)
                for task in (ALL_TASKS, q.task):
                    key = (task, method, gamma)
                    if key not in tallies:
                        tallies[key] = Tally(method, gamma, task=task)
                    tallies[key].add(tally)
                if method != "assisted" or gamma is None:
                    line.append(f"{tally.key} {tally.tokens_per_s:.0f}")
            log(f"[bench {i}/{len(prompts)}, {time.perf_counter() - t_start:.0f} s] {q.task}: "
                + ", ".join(line) + " tok/s")
        return tallies


# -- results -------------------------------------------------------------------------------
@dataclass
class BenchResult:
    """Everything one ``dfvg bench`` run produced.

    Members
    -------
    setup : dict
        What ran where: models, devices, prompt set, settings.
    tallies : dict
        (task, method, γ) → :class:`Tally`; task ``"all"`` covers every prompt.
    efficiency : list of EfficiencyRow
        The engine-efficiency table (empty when not computed).
    """
    setup: dict
    tallies: dict[tuple[str, str, int | None], Tally]
    efficiency: list[EfficiencyRow] = field(default_factory=list)

    @property
    def tasks(self) -> list[str]:
        seen = []
        for task, _, _ in self.tallies:
            if task != ALL_TASKS and task not in seen:
                seen.append(task)
        return seen

    def rows(self, task: str = ALL_TASKS, method: str | None = None) -> list[Tally]:
        return [t for (k, m, _), t in self.tallies.items() if k == task and (method is None or m == method)]

    def get(self, method: str, gamma: int | None, task: str = ALL_TASKS) -> Tally | None:
        return self.tallies.get((task, method, gamma))

    def baseline(self, task: str = ALL_TASKS) -> Tally:
        return self.tallies[(task, "target-only", None)]

    def speedup(self, row: Tally, over: Tally | None) -> float | None:
        """``row``'s tokens/s over ``over``'s, both from this run."""
        if over is None or not over.tokens_per_s:
            return None
        return row.tokens_per_s / over.tokens_per_s

    def best(self, method: str, task: str = ALL_TASKS) -> Tally | None:
        rows = self.rows(task, method)
        return max(rows, key=lambda t: t.tokens_per_s) if rows else None

    def headline(self) -> dict:
        """DFVG at its best γ against target-only and against assisted generation,
        pipelined DFVG at its best γ against target-only and serial DFVG, and adaptive
        DFVG against target-only and serial DFVG at its best fixed γ."""
        dfvg, assisted = self.best("dfvg"), self.best("assisted")
        same_gamma = self.get("assisted", dfvg.gamma) if dfvg else None
        piped = self.best("dfvg-pipelined")
        adaptive = self.get("dfvg-adaptive", None)
        return dict(best_dfvg=dfvg.key if dfvg else None, best_assisted=assisted.key if assisted else None,
                    best_dfvg_pipelined=piped.key if piped else None,
                    dfvg_pipelined_over_target_only=self.speedup(piped, self.baseline()) if piped else None,
                    dfvg_pipelined_over_dfvg=self.speedup(piped, dfvg) if piped else None,
                    dfvg_over_target_only=self.speedup(dfvg, self.baseline()) if dfvg else None,
                    dfvg_over_best_assisted=self.speedup(dfvg, assisted) if dfvg else None,
                    dfvg_over_assisted_same_gamma=self.speedup(dfvg, same_gamma) if dfvg else None,
                    best_assisted_over_target_only=(self.speedup(assisted, self.baseline())
                                                    if assisted else None),
                    dfvg_adaptive=adaptive.key if adaptive else None,
                    dfvg_adaptive_mean_gamma=adaptive.mean_gamma if adaptive else None,
                    dfvg_adaptive_over_target_only=(self.speedup(adaptive, self.baseline())
                                                    if adaptive else None),
                    dfvg_adaptive_over_best_fixed=(self.speedup(adaptive, dfvg)
                                                   if adaptive and dfvg else None),
                    **self.several_headline(), **self.engine_tree_headline(),
                    **self.strategies_headline(),
                    label="ratios of tokens/s within this run; DFVG's is projected (measured "
                          "target+host + modelled FPGA+PCIe), the others' measured")

    def best_single_drafter(self, task: str = ALL_TASKS) -> Tally | None:
        """The fastest serial run of one drafter alone (``dfvg`` or ``dfvg[NAME]``), any γ."""
        rows = [t for t in self.rows(task) if t.method == "dfvg" or t.method.startswith("dfvg[")]
        return max(rows, key=lambda t: t.tokens_per_s) if rows else None

    def several_headline(self) -> dict:
        """The methods of several drafters at their best against target-only and against
        the best drafter alone (empty with one drafter)."""
        single = self.best_single_drafter()
        out = {}
        for method in MULTI_METHODS:
            best = self.best(method)
            if best is None:
                continue
            out[method.replace("-", "_")] = dict(
                key=best.key, mean_accepted_length=best.mean_accepted_length,
                over_target_only=self.speedup(best, self.baseline()),
                over_best_single_drafter=self.speedup(best, single),
                best_single_drafter=single.key if single else None)
        return out

    def engine_tree_headline(self) -> dict:
        """The engine's trees at their best γ (depth) against target-only and the best
        chain; the pipelined trees against those and the best pipelined chain (empty when
        they did not run)."""
        best = self.best(ENGINE_TREE)
        if best is None:
            return {}
        chain = self.best("dfvg")
        out = dict(dfvg_engine_tree=dict(
            key=best.key, mean_accepted_length=best.mean_accepted_length,
            verified_per_forward=best.verified_per_forward,
            over_target_only=self.speedup(best, self.baseline()),
            over_best_dfvg=self.speedup(best, chain), best_dfvg=chain.key if chain else None))
        piped = self.best(ENGINE_TREE_PIPELINED)
        if piped is not None:
            piped_chain = self.best("dfvg-pipelined")
            out["dfvg_engine_tree_pipelined"] = dict(
                key=piped.key, mean_accepted_length=piped.mean_accepted_length,
                verified_per_forward=piped.verified_per_forward, hidden_share=piped.hidden_share,
                over_target_only=self.speedup(piped, self.baseline()),
                over_best_engine_tree=self.speedup(piped, best),
                over_best_dfvg_pipelined=self.speedup(piped, piped_chain),
                best_dfvg_pipelined=piped_chain.key if piped_chain else None)
        return out

    def strategies_headline(self) -> dict:
        """Chain and tree, serial and pipelined (:data:`STRATEGY_SCHEDULES`), each at its
        best γ, against target-only, and the fastest of them (empty when no chain ran)."""
        rows = {}
        for method, strategy, schedule in STRATEGY_SCHEDULES:
            best = self.best(method)
            if best is not None:
                rows[method] = dict(strategy=strategy, schedule=schedule, key=best.key,
                                    tokens_per_s=best.tokens_per_s,
                                    over_target_only=self.speedup(best, self.baseline()))
        if not rows:
            return {}
        fastest = max(rows, key=lambda m: rows[m]["tokens_per_s"])
        return dict(strategies=rows, best_strategy=rows[fastest]["key"])

    def chain_at_nodes(self, tree: Tally, chain: str = "dfvg") -> Tally | None:
        """The chain row (``chain``: ``dfvg`` or ``dfvg-pipelined``) that verifies as many
        draft tokens per forward as the engine tree row ``tree`` (γ = depth × width, or the
        tree budget when smaller), if the sweep ran it."""
        width = self.setup.get("engine_tree_width") or 0
        if not (width and tree.gamma):
            return None
        nodes = tree.gamma * width
        budget = self.setup.get("engine_tree_budget")
        return self.get(chain, min(nodes, budget) if budget else nodes, tree.task)

    def to_dict(self) -> dict:
        dev = self.setup.get("verifier_device", "?")
        base = {task: self.baseline(task) for task in [ALL_TASKS] + self.tasks}

        def row(t: Tally) -> dict:
            d = t.to_dict(dev)
            d["speedup_over_target_only"] = self.speedup(t, base[t.task])
            same = self.get("assisted", t.gamma, t.task) if t.is_dfvg and t.gamma is not None else None
            d["speedup_over_assisted_same_gamma"] = self.speedup(t, same)
            if t.method == "dfvg-adaptive":
                d["speedup_over_best_fixed_dfvg"] = self.speedup(t, self.best("dfvg", t.task))
            if t.method in MULTI_METHODS:
                d["speedup_over_best_single_drafter"] = self.speedup(t, self.best_single_drafter(t.task))
            if t.method == ENGINE_TREE:
                d["speedup_over_dfvg_same_gamma"] = self.speedup(t, self.get("dfvg", t.gamma, t.task))
                same = self.chain_at_nodes(t)
                d["dfvg_same_verified"] = same.key if same else None
                d["speedup_over_dfvg_same_verified"] = self.speedup(t, same)
            if t.method == ENGINE_TREE_PIPELINED:
                d["speedup_over_engine_tree_same_gamma"] = self.speedup(
                    t, self.get(ENGINE_TREE, t.gamma, t.task))
                d["speedup_over_dfvg_pipelined_same_gamma"] = self.speedup(
                    t, self.get("dfvg-pipelined", t.gamma, t.task))
                same = self.chain_at_nodes(t, "dfvg-pipelined")
                d["dfvg_pipelined_same_verified"] = same.key if same else None
                d["speedup_over_dfvg_pipelined_same_verified"] = self.speedup(t, same)
            return d

        return dict(setup=self.setup, headline=self.headline(),
                    rows=[row(t) for t in self.rows(ALL_TASKS)],
                    by_task={task: [row(t) for t in self.rows(task)] for task in self.tasks},
                    efficiency=[r.to_dict() for r in self.efficiency])


def _describe_path(path: Path) -> str:
    """A path relative to the checkout when inside it (results stay machine-independent)."""
    try:
        return str(Path(path).resolve().relative_to(REPO_ROOT))
    except ValueError:
        return str(path)


def run_benchmark(*, target_dir: Path, draft_dir: Path, device: DraftDevice, device_url: str,
                  prompts: list[BenchPrompt], settings: BenchSettings, prompt_set: Path,
                  verifier_device: str | None = None, dtype: str | None = None,
                  extra_drafters: list[tuple[str, DraftDevice]] = (),
                  log: Callable[[str], None] = lambda _: None) -> BenchResult:
    """Load the pair, tokenise the prompts and run every method on them.

    Parameters
    ----------
    target_dir, draft_dir : Path
        Local Hugging Face directories of the target and the (float) draft.
    device : DraftDevice
        The draft device, with the compiled draft loaded.
    device_url : str
        Its URL, for the report.
    prompts : list of BenchPrompt
        The prompts to run (already picked per task).
    settings : BenchSettings
    prompt_set : Path
        Where the prompts came from, for the report.
    verifier_device, dtype : str, optional
        Torch device and dtype of the target and of the float draft.
    extra_drafters : list of (str, DraftDevice)
        Further drafters by name (their compiled drafts loaded), for the methods of
        several drafters; the first drafter is ``draft_dir`` on ``device``.
    log : callable
        Progress messages.
    """
    import platform

    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from dfvg_host.verifier import parse_dtype

    # transformers' progress bars and its notes about generate() arguments would bury the
    # benchmark's own progress lines on stderr.
    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    tok = AutoTokenizer.from_pretrained(target_dir, local_files_only=True)
    verifier = Verifier.from_pretrained(target_dir, device=verifier_device, dtype=dtype)
    draft = AutoModelForCausalLM.from_pretrained(draft_dir, dtype=parse_dtype(dtype), local_files_only=True)
    encoded = [(q, tok(q.text)["input_ids"]) for q in prompts]
    if any(not ids for _, ids in encoded):
        raise BenchError("a prompt tokenises to nothing")
    runner = BenchRunner(verifier, draft, device, extra_drafters, main_name=Path(draft_dir).name)
    mix: dict[str, int] = {}
    for q in prompts:
        mix[q.task] = mix.get(q.task, 0) + 1
    setup = dict(target=_describe_path(target_dir), draft=_describe_path(draft_dir), device=device_url,
                 extra_drafters=[name for name, _ in extra_drafters],
                 verifier_device=str(verifier.device), dtype=dtype or "float32",
                 prompt_set=_describe_path(prompt_set), prompts=len(prompts),
                 prompt_mix=", ".join(f"{task} {n}" for task, n in mix.items()),
                 prompt_tokens=[len(ids) for _, ids in encoded],
                 max_new_tokens=settings.max_new_tokens, gammas=list(settings.gammas),
                 engine_tree_width=device.tree_width if runner.tree_depths(settings) else 0,
                 engine_tree_depths=list(runner.tree_depths(settings)),
                 engine_tree_budget=settings.tree_budget if runner.tree_depths(settings) else None,
                 adaptive_gamma_max=settings.adaptive_gamma_max if settings.adaptive else None,
                 per_task=settings.per_task, torch=torch.__version__,
                 transformers=transformers.__version__, torch_threads=torch.get_num_threads(),
                 host=f"{platform.machine()} {platform.processor() or ''}".strip(),
                 cuda_device=(torch.cuda.get_device_name(verifier.device)
                              if verifier.device.type == "cuda" else None),
                 date=time.strftime("%Y-%m-%d %H:%M"))
    log(f"bench: {len(prompts)} prompts x {settings.max_new_tokens} tokens; methods: "
        + ", ".join(f"{m}{'' if g is None else f' γ={g}'}" for m, g in runner.methods(settings)))
    return BenchResult(setup, runner.run(encoded, settings, log))
