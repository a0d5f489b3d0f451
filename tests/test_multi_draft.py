"""Several drafters (Smurfs): voting, merged trees, selection — exact greedy, lossless sampling.

The drafters are tiny Llamas on ``sim://tiny`` devices: the target itself (int8 on the
engine: high acceptance), and random models that mostly disagree with it, so that voting
has something to choose between and the weights have something to learn.
"""

from __future__ import annotations

import json
import math
import random
from collections import Counter

import pytest
import torch

import dfvg_host.acceptance as acceptance
import sampling_checks
from conftest import make_tiny_llama
from sampling_checks import chi_square_p
from dfvg_hw.spec.config import get_preset
from dfvg_hw.spec.regmap import MemoryMap, Reg
from dfvg_host.acceptance import SamplingParams
from dfvg_host.cli import main
from dfvg_host.compiler import compile_draft, load_model
from dfvg_host.driver import DraftDevice
from dfvg_host.fault_injection import Fault, FaultInjectingTransport, FaultKind
from dfvg_host.multi_draft import MERGE_RULES, MultiDraftDecoder
from dfvg_host.speculative import SpeculativeDecoder, matched_prefix
from dfvg_host.verifier import Verifier
from dfvg_host.voting import WeightedMajority, heaviest_path, merge_drafts
from sim.device import SimDevice

VOCAB = 8
NEW = 24
PROMPTS = [[5, 17, 99, 3, 42, 7], [100, 4, 61, 9], [33, 200, 12, 77, 150]]


# -- voting, on its own -----------------------------------------------------------------------
def test_merged_tree_shares_prefixes_and_sums_weights():
    merged = merge_drafts({0: [5, 6, 7], 1: [5, 6, 9], 2: [4, 1, 1]}, [1.0, 2.0, 0.5])
    tree = merged.tree
    assert tree.tokens == [5, 6, 7, 9, 4, 1, 1] and tree.parents == [-1, 0, 1, 1, -1, 4, 5]
    assert merged.weight == [3.0, 3.0, 1.0, 2.0, 0.5, 0.5, 0.5]
    assert merged.drafters[0] == [0, 1] and merged.drafters[3] == [1]
    assert merged.ends == {0: 2, 1: 3, 2: 6}
    path, owner = heaviest_path(merged)
    assert path == [0, 1, 3] and owner == 1          # the heavier branch below the shared prefix


def test_the_vote_is_always_one_drafters_whole_draft():
    rng = random.Random(0)
    for _ in range(500):
        k = rng.randint(1, 5)
        drafts = {i: [rng.randrange(3) for _ in range(rng.randint(1, 5))] for i in range(k)}
        weights = [rng.choice([0.1, 1.0, 1.0, 2.5]) for _ in range(k)]
        merged = merge_drafts(drafts, weights)
        path, owner = heaviest_path(merged)
        assert merged.tree.path_tokens(path[-1]) == drafts[owner]
        assert all(merged.weight[n] == pytest.approx(sum(weights[i] for i in merged.drafters[n]))
                   for n in range(len(merged.tree)))
        # at every level the vote took a heaviest child
        parent = -1
        for node in path:
            assert merged.weight[node] == max(merged.weight[c] for c in merged.tree.children(parent))
            parent = node


def test_weights_rise_and_fall_against_the_threshold_within_bounds():
    w = WeightedMajority.uniform(3, threshold=0.5, raise_by=2.0, lower_by=0.5, floor=0.25, ceiling=4.0)
    w.update({0: 1.0, 1: 0.0, 2: 0.5})
    assert w.weights == [2.0, 0.5, 2.0]
    for _ in range(5):
        w.update({0: 1.0, 1: 0.0})
    assert w.weights == [4.0, 0.25, 2.0] and len(w.history) == 6
    assert w.leader() == 0 and w.leader([1, 2]) == 2
    assert matched_prefix([1, 2, 3], [1, 2, 4, 5]) == 2 and matched_prefix([], [1]) == 0
    with pytest.raises(ValueError, match="threshold"):
        WeightedMajority.uniform(2, threshold=1.5)
    with pytest.raises(ValueError, match="raise_by"):
        WeightedMajority.uniform(2, raise_by=0.9)


# -- decoding --------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def drafters(tiny_draft_dir, tmp_path_factory):
    """Compiled drafts for the tiny target: two random models and the target itself."""
    root = tmp_path_factory.mktemp("drafters")
    engine = get_preset("tiny")
    dirs = [make_tiny_llama(root / f"random{s}", seed=s) for s in (21, 22)] + [tiny_draft_dir]
    return [compile_draft(d, engine) for d in dirs]


@pytest.fixture(scope="module")
def target(tiny_draft_dir):
    return load_model(tiny_draft_dir)


def greedy_reference(target, prompt: list[int], n: int) -> list[int]:
    """The target's own greedy continuation of ``prompt``, ``n`` tokens."""
    with torch.no_grad():
        return target.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False,
                               eos_token_id=1, pad_token_id=2)[0, len(prompt):].tolist()


@pytest.fixture(scope="module")
def reference(target):
    return {tuple(p): greedy_reference(target, p, NEW) for p in PROMPTS}


def decoder_for(compiled, target, **kwargs) -> MultiDraftDecoder:
    devices = [DraftDevice.open("sim://tiny", c) for c in compiled]
    return MultiDraftDecoder(devices, Verifier(target, torch.device("cpu")), eos_token_id=1, **kwargs)


@pytest.mark.parametrize("merge", MERGE_RULES)
def test_greedy_output_is_the_targets_and_the_weights_learn(drafters, target, reference, merge):
    decoder = decoder_for(drafters, target, merge=merge, gamma=3, names=["r21", "r22", "self"])
    for prompt in PROMPTS:
        out = decoder.generate(prompt, NEW)
        assert out.tokens == reference[tuple(prompt)], merge
        assert out.stop_reason in ("max_new_tokens", "eos") and not out.faults
        stats = {d.name: d for d in out.drafters}
        m = out.metrics
        drafting_rounds = sum(1 for g in m.gamma_per_round if g > 0)
        if merge != "tree":             # one drafter's chain verified per round that drafted
            assert sum(d.chosen for d in out.drafters) == drafting_rounds
        assert all(d.judged <= d.drafted and d.matched <= d.judged for d in out.drafters)
        assert len(stats["self"].weights) == m.rounds
    # the drafter that is the target matches most and ends up heaviest
    assert stats["self"].match_rate > max(stats["r21"].match_rate, stats["r22"].match_rate)
    assert decoder.weights.leader() == 2
    assert m.accepted_tokens + m.rounds == len(out.tokens) or out.stop_reason == "eos"
    if merge == "tree":
        assert out.tree_nodes >= m.drafted_tokens
    else:
        assert out.tree_nodes == 0


def test_the_round_costs_the_slowest_drafter(drafters, target):
    decoder = decoder_for(drafters, target, merge="vote", gamma=3)
    out = decoder.generate(PROMPTS[0], NEW)
    m, clock = out.metrics, decoder.drafters[0].device.clock_hz
    each = [d.engine_cycles for d in out.drafters]
    # per round the slowest one: at least any drafter's total, at most all of them added
    assert max(each) <= m.device_cycles <= sum(each)
    assert "slowest of 3 concurrent drafters" in m.device_cycle_source
    engine = [s for s in out.timeline.spans if s.lane == "engine"]
    assert {s.args["drafter"] for s in engine} == {"drafter0", "drafter1", "drafter2"}
    assert m.device_seconds == pytest.approx(m.device_cycles / clock)


def test_one_drafter_decodes_as_the_chain_decoder(drafters, target):
    """One drafter under ``select``: the same requests, the same RNG counters and the same
    verifier stream as SpeculativeDecoder, so the same tokens, greedy and sampled."""
    for sampling in (SamplingParams(), SamplingParams(temperature=1.0, seed=7)):
        chain = SpeculativeDecoder(DraftDevice.open("sim://tiny", drafters[2]),
                                   Verifier(target, torch.device("cpu")), gamma=3, sampling=sampling,
                                   eos_token_id=1)
        multi = decoder_for(drafters[2:], target, merge="select", gamma=3, sampling=sampling)
        for prompt in PROMPTS[:2]:
            a, b = chain.generate(prompt, NEW), multi.generate(prompt, NEW)
            assert a.tokens == b.tokens
            assert a.metrics.accepted_per_position == b.metrics.accepted_per_position


def test_vote_refuses_sampling_and_bad_setups(drafters, target):
    with pytest.raises(ValueError, match="exact under greedy decoding only"):
        decoder_for(drafters[:2], target, merge="vote", sampling=SamplingParams(temperature=0.7))
    with pytest.raises(ValueError, match="merge must be one of"):
        decoder_for(drafters[:2], target, merge="majority")
    with pytest.raises(ValueError, match="at least one draft device"):
        MultiDraftDecoder([], Verifier(target, torch.device("cpu")))
    with pytest.raises(ValueError, match="as many draft temperatures"):
        decoder_for(drafters[:2], target, draft_temperatures=[0.5])


def test_sampling_drafters_under_a_greedy_target_stay_exact(drafters, target, reference):
    """Drafters that sample (each with its own seed) give different drafts; greedy
    verification keeps the output the target's whatever they draw."""
    decoder = decoder_for([drafters[2]] * 2, target, merge="tree", gamma=3, draft_temperatures=[0.7, 1.5])
    for prompt in PROMPTS[:2]:
        out = decoder.generate(prompt, NEW)
        assert out.tokens == reference[tuple(prompt)]
    assert out.tree_nodes > out.metrics.drafted_tokens       # the two drafts differed somewhere


# -- faults -------------------------------------------------------------------------------------
def faulty_decoder(drafters, target, plans, **kwargs):
    devices, injectors = [], []
    for compiled, plan in zip(drafters, plans):
        inj = FaultInjectingTransport(SimDevice(get_preset("tiny")), armed=False)
        devices.append(DraftDevice(inj, compiled, timeout_s=0.1, retry_backoff_s=0.0))
        inj.arm(plan)
        injectors.append(inj)
    return MultiDraftDecoder(devices, Verifier(target, torch.device("cpu")), eos_token_id=1, gamma=3,
                             **kwargs), injectors


#: A device whose link is dead for good.
DEAD = [Fault(FaultKind.DROP, op, repeat=math.inf) for op in ("read32", "write32", "start", "dma_write")]


def test_a_dead_drafter_is_dropped_and_the_others_go_on(drafters, target, reference):
    decoder, _ = faulty_decoder(drafters[1:], target, [DEAD, []], merge="vote")
    out = decoder.generate(PROMPTS[0], NEW)
    assert out.tokens == reference[tuple(PROMPTS[0])] and out.stop_reason == "max_new_tokens"
    dead, alive = out.drafters
    assert dead.given_up and "reset" in dead.given_up and dead.drafted == 0
    assert not alive.given_up and alive.chosen > 0 and not out.degraded
    assert out.metrics.device_faults >= 1 and out.metrics.device_resets == decoder.max_recoveries
    assert out.metrics.fallback_tokens == 0


def test_a_transient_fault_is_replayed(drafters, target, reference):
    plan = [Fault(FaultKind.CORRUPT, "dma_read", at=5)]
    decoder, injectors = faulty_decoder(drafters[1:], target, [[], plan], merge="tree")
    out = decoder.generate(PROMPTS[1], NEW)
    assert out.tokens == reference[tuple(PROMPTS[1])]
    assert injectors[1].injected and out.metrics.device_resets == 1
    assert not any(d.given_up for d in out.drafters) and out.drafters[1].faults == 1


def test_with_every_drafter_dead(drafters, target, reference):
    decoder, _ = faulty_decoder(drafters[1:], target, [DEAD, DEAD], merge="select")
    out = decoder.generate(PROMPTS[0], NEW)
    assert out.tokens == reference[tuple(PROMPTS[0])] and out.degraded
    assert out.metrics.fallback_tokens == len(out.tokens) and out.metrics.drafted_tokens == 0
    decoder, _ = faulty_decoder(drafters[1:], target, [DEAD, DEAD], merge="select", fallback=False)
    out = decoder.generate(PROMPTS[0], NEW)
    assert out.stop_reason == "device_error" and "every drafter was given up" in out.message


# -- sampling -----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def small_vocab(tmp_path_factory):
    """A target and two different drafts over an 8-token vocabulary, no EOS."""
    root = tmp_path_factory.mktemp("multi-small-vocab")
    target = make_tiny_llama(root / "target", vocab=VOCAB, seed=10, weight_scale=3.0, eos=None)
    drafts = [make_tiny_llama(root / f"d{s}", vocab=VOCAB, seed=s, weight_scale=3.0, eos=None) for s in (11, 12)]
    engine = get_preset("tiny")
    return target, [compile_draft(d, engine) for d in drafts]


SMALL_PROMPT = [1, 4, 6, 3]
PARAMS = SamplingParams(temperature=1.0)


def sample_first_two(target_dir, compiled, merge, n):
    decoder = decoder_for(compiled, load_model(target_dir), merge=merge, gamma=2, sampling=PARAMS)
    decoder.eos_token_id = None
    counts = Counter()
    for seed in range(n):
        decoder.sampling = SamplingParams(PARAMS.temperature, PARAMS.top_k, seed)
        for i, d in enumerate(decoder.drafters):
            d.sampling = SamplingParams(PARAMS.temperature, PARAMS.top_k, seed + 100_003 * i)
        decoder._generator.manual_seed(seed ^ 0x5EED)
        counts[tuple(decoder.generate(SMALL_PROMPT, 3).tokens[:2])] += 1
    return counts


@pytest.mark.parametrize("merge", ["select", "tree"])
def test_sampling_is_lossless(small_vocab, merge):
    target_dir, compiled = small_vocab
    n = 1000
    counts = sample_first_two(target_dir, compiled, merge, n)
    expected = sampling_checks.first_two_distribution(load_model(target_dir), SMALL_PROMPT, PARAMS, VOCAB)
    p = chi_square_p(counts, expected, n)
    print(f"{merge}: chi-square p = {p:.3g} from {n} samples")
    assert p > 0.01, f"{merge}: samples differ from the target distribution (p = {p:.2e})"


def test_wrong_q_is_detected(small_vocab, monkeypatch):
    target_dir, compiled = small_vocab
    uniform = lambda token, vocab: torch.full((vocab,), 1.0 / vocab, dtype=torch.float64)
    monkeypatch.setattr(acceptance, "draft_distribution", uniform)
    import dfvg_host.tree as tree_module
    monkeypatch.setattr(tree_module, "draft_distribution", uniform)
    n = 600
    counts = sample_first_two(target_dir, compiled, "tree", n)
    expected = sampling_checks.first_two_distribution(load_model(target_dir), SMALL_PROMPT, PARAMS, VOCAB)
    p = chi_square_p(counts, expected, n)
    print(f"tree with a uniform q: chi-square p = {p:.3g} from {n} samples")
    assert p < 0.01, f"a uniform q went undetected (p = {p:.3f})"


# -- the command line -----------------------------------------------------------------------------
@pytest.mark.parametrize("argv, message", [
    (["--device", "sim://tiny", "--device", "sim://tiny", "--merge", "vote", "--temperature", "0.8"],
     "exact under greedy decoding only"),
    (["--draft", "models/demo-draft", "--draft", "models/demo-draft", "--draft", "models/demo-draft",
      "--target", "models/demo-target", "--device", "sim://tiny", "--device", "sim://tiny"],
     "give one --device per --draft"),
    (["--merge", "tree"], "give --draft or --device more than once"),
    (["--draft-temperature", "0.5"], "give --draft or --device more than once"),
    (["--device", "sim://tiny", "--device", "sim://tiny", "--schedule", "pipelined"],
     "--schedule pipelined runs one drafter"),
    (["--device", "sim://tiny", "--device", "sim://tiny", "--device", "sim://tiny",
      "--draft-temperature", "0.5", "--draft-temperature", "0.7"], "given 2 times for 3 drafters"),
    (["--device", "sim://alveo-u55c", "--device", "sim://nope"], "unknown engine preset"),
])
def test_bad_arguments_of_several_drafters_are_one_line_errors(argv, message, capsys):
    try:
        code = main(["generate", "--prompt", "x", *argv])
    except SystemExit as exc:
        code = exc.code
    assert code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert message in err[-1] and err[-1].startswith("dfvg: error:"), err


def test_generate_with_two_drafters_json(demo_pair, capsys):
    """The demo draft twice, each sampling its drafts with its own seed under a greedy
    target: the output is the target's greedy decoding (checked against generate)."""
    _, target_dir, _ = demo_pair
    prompt = "import os\n\ndef main():\n"
    code = main(["generate", "--prompt", prompt, "--max-new-tokens", "16", "--gamma", "3",
                 "--device", "sim://alveo-u55c", "--device", "sim://alveo-u55c",
                 "--draft-temperature", "0.6", "--merge", "tree", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert code == 0 and out["merge"] == "tree" and len(out["drafters"]) == 2
    assert out["device"] == ["sim://alveo-u55c"] * 2
    assert {d["name"] for d in out["drafters"]} == {"0:demo-draft", "1:demo-draft"}
    assert all(d["drafted"] > 0 and len(d["weights"]) == out["metrics"]["rounds"] for d in out["drafters"])
    assert out["metrics"]["labels"]["device_seconds"].endswith("concurrent drafters")
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(target_dir)
    ids = torch.tensor([tok(prompt)["input_ids"]])
    with torch.no_grad():
        ref = load_model(target_dir).generate(ids, max_new_tokens=16, do_sample=False,
                                              attention_mask=torch.ones_like(ids))[0, ids.shape[1]:]
    assert out["token_ids"] == ref.tolist()[:len(out["token_ids"])]
    assert len(out["token_ids"]) == 16 or out["stop_reason"] == "eos"


def test_bench_runs_each_drafter_alone_voting_trees_and_adaptive(demo_pair, demo_compiled):
    from dfvg_host.bench import DEFAULT_PROMPT_SET, BenchSettings, load_prompt_set, pick_prompts, run_benchmark
    from dfvg_host.bench_report import format_result

    draft_dir, target_dir, _ = demo_pair
    settings = BenchSettings(gammas=(2,), max_new_tokens=8, per_task=1, warmup_tokens=2,
                             assisted_hf_defaults=False, pipelined=False)
    extra = [("again", DraftDevice.open("sim://alveo-u55c", demo_compiled))]
    result = run_benchmark(target_dir=target_dir, draft_dir=draft_dir,
                           device=DraftDevice.open("sim://alveo-u55c", demo_compiled),
                           device_url="sim://alveo-u55c", prompts=pick_prompts(load_prompt_set(DEFAULT_PROMPT_SET), 1),
                           settings=settings, prompt_set=DEFAULT_PROMPT_SET, verifier_device="cpu",
                           extra_drafters=extra)
    data = result.to_dict()
    rows = {r["key"]: r for r in data["rows"]}
    assert set(rows) == {"target-only", "assisted γ=2", "dfvg γ=2", "dfvg[again] γ=2", "dfvg-vote γ=2",
                         "dfvg-tree γ=2", "dfvg-adaptive γ=auto", "dfvg-vote-adaptive γ=auto"}
    for r in rows.values():
        assert r["matches_target_only"] == 3 and r["tokens"] == 24, r["key"]
    # the same draft twice, greedy: every method drafts what dfvg drafts
    assert rows["dfvg-vote γ=2"]["accepted"] == rows["dfvg γ=2"]["accepted"] == rows["dfvg[again] γ=2"]["accepted"]
    vote = rows["dfvg-vote γ=2"]
    assert set(vote["drafters"]) == {"demo-draft", "again"}
    # one drafter's chain verified per round that drafted
    assert vote["drafters"]["demo-draft"]["chosen"] + vote["drafters"]["again"]["chosen"] == sum(
        vote["gamma_histogram"].values())
    assert vote["speedup_over_best_single_drafter"] > 0 and "slowest of the drafters" in vote["labels"]["draft_s"]
    assert rows["dfvg-vote-adaptive γ=auto"]["gamma_histogram"]
    h = data["headline"]
    assert {"dfvg_vote", "dfvg_tree", "dfvg_vote_adaptive"} <= set(h)
    assert h["dfvg_vote"]["best_single_drafter"] in ("dfvg γ=2", "dfvg[again] γ=2")
    text = format_result(result)
    assert "Several drafters" in text and "dfvg-tree γ=2" in text and "the best drafter alone" in text


@pytest.mark.parametrize("merge", ["vote", "tree"])
def test_greedy_is_exact_with_the_two_demo_drafters(demo_pair, demo_compiled, merge):
    """8 held-out prompts x 64 tokens with demo-draft and demo-draft-small against the
    demo target (``benchmarks/multi_draft_exactness.py`` runs 50 x 128 and every merge)."""
    from transformers import AutoTokenizer

    from dfvg_host.demo import DEMO_DATA, compile_cached
    from test_speculative import heldout_prompts

    draft_dir, target_dir, data_dir = demo_pair
    small = compile_cached(draft_dir.parent / "demo-draft-small", get_preset("alveo-u55c"),
                           DEMO_DATA / "calibration.txt", log=lambda *_: None)
    tok = AutoTokenizer.from_pretrained(target_dir)
    target = load_model(target_dir)
    devices = [DraftDevice.open("sim://alveo-u55c", c) for c in (demo_compiled, small)]
    decoder = MultiDraftDecoder(devices, Verifier(target, torch.device("cpu")), merge=merge, gamma=4,
                                names=["demo-draft", "demo-draft-small"], eos_token_id=tok.eos_token_id)
    accepted = rounds = 0
    matched, judged = [0, 0], [0, 0]
    for prompt in heldout_prompts(data_dir, tok, count=8):
        out = decoder.generate(prompt, 64)
        with torch.no_grad():
            ref = target.generate(torch.tensor([prompt]), max_new_tokens=64, do_sample=False)[0, len(prompt):]
        assert out.tokens == ref.tolist()
        accepted, rounds = accepted + out.metrics.accepted_tokens, rounds + out.metrics.rounds
        for i, d in enumerate(out.drafters):
            matched[i] += d.matched
            judged[i] += d.judged
    # both drafters are useful, the bigger one more so
    assert (accepted + rounds) / rounds > 2.5
    assert matched[0] / judged[0] > matched[1] / judged[1] > 0.3


# -- the cores of one card ------------------------------------------------------------------------
def test_two_cores_of_one_card_draft_for_two_drafters(drafters, target, reference):
    """``sim://tiny?cores=2``: each drafter drives its own core through the core's register
    window, in its own slice of the card's memory; the output is exact and the two cores'
    transfers queue on the card's one link."""
    from dfvg_host.core_window import CoreWindow
    from dfvg_host.transport import open_transport

    card, engine = open_transport("sim://tiny?cores=2")
    windows = [CoreWindow(card, i, 2, engine.mem_bytes) for i in range(2)]
    devices = [DraftDevice(w, c, memory_base=w.memory_base) for w, c in zip(windows, drafters[1:])]
    assert windows[1].memory_base == engine.mem_bytes // 2
    decoder = MultiDraftDecoder(devices, Verifier(target, torch.device("cpu")), merge="tree", gamma=3,
                                eos_token_id=1)
    out = decoder.generate(PROMPTS[0], NEW)
    assert out.tokens == reference[tuple(PROMPTS[0])] and not out.faults
    assert all(d.drafted > 0 for d in out.drafters)
    # each core ran its own program on its own requests: its counters are its own
    assert all(c.engine.counts.total > 0 for c in card.cores)
    bases = [w.read32(Reg.IMAGE_BASE_LO) | w.read32(Reg.IMAGE_BASE_HI) << 32 for w in windows]
    assert bases == [MemoryMap.IMAGE, windows[1].memory_base + MemoryMap.IMAGE]
    m = out.metrics
    assert m.pcie_seconds == pytest.approx(sum(d.pcie_seconds for d in out.drafters), rel=1e-6)
    assert "cores of one card" in m.device_cycle_source
    # a core's driver cannot reach another core's slice
    with pytest.raises(IndexError, match="outside core 0's slice"):
        windows[0].dma_read(windows[1].memory_base, 4)
    assert card.read32(5 << 9) == 0      # past the last core's window: nothing answers


def test_generate_on_a_card_with_two_cores(demo_pair, capsys):
    code = main(["generate", "--prompt", "def f(x):\n", "--max-new-tokens", "12", "--gamma", "3",
                 "--draft", "models/demo-draft", "--draft", "models/demo-draft-small",
                 "--target", "models/demo-target", "--device", "sim://alveo-u55c?cores=2", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert code == 0 and out["device"] == ["sim://alveo-u55c?cores=2#core0", "sim://alveo-u55c?cores=2#core1"]
    assert [d["name"] for d in out["drafters"]] == ["0:demo-draft", "1:demo-draft-small"]
    code = main(["generate", "--prompt", "x", "--draft", "models/demo-draft", "--draft", "models/demo-draft",
                 "--draft", "models/demo-draft", "--target", "models/demo-target",
                 "--device", "sim://alveo-u55c?cores=2"])
    assert code == 2 and "card with 2 draft cores; 3 drafters were given it" in capsys.readouterr().err


def test_two_rtl_cores_of_one_card_draft_for_two_drafters(drafters, target):
    """``rtl://tiny?cores=2``: the generated DraftCores in simulation, each core driven
    by its drafter's driver through its window; the output is exact and each core's
    cycles are at least what the cycle model gives it alone (they share the memory port)."""
    from dfvg_host.core_window import CoreWindow
    from dfvg_host.transport import open_transport

    card, engine = open_transport("rtl://tiny?cores=2")
    windows = [CoreWindow(card, i, 2, engine.mem_bytes) for i in range(2)]
    devices = [DraftDevice(w, c, memory_base=w.memory_base, timeout_s=600) for w, c in zip(windows, drafters[1:])]
    decoder = MultiDraftDecoder(devices, Verifier(target, torch.device("cpu")), merge="tree", gamma=2,
                                eos_token_id=1)
    # Two prompt tokens: each core's prefill and a full draft of gamma = 2 are ~9,300 cycles
    # (PROMPTS[1]'s four, 14,500), which the Amaranth simulator runs at ~150 cycles/s.
    prompt = PROMPTS[1][:2]
    out = decoder.generate(prompt, 3)
    assert out.tokens == greedy_reference(target, prompt, 3) and not out.faults
    sim_cards = [DraftDevice.open("sim://tiny", c) for c in drafters[1:]]
    model = MultiDraftDecoder(sim_cards, Verifier(target, torch.device("cpu")), merge="tree", gamma=2,
                              eos_token_id=1).generate(prompt, 3)
    assert model.tokens == out.tokens
    for rtl, modelled in zip(out.drafters, model.drafters):
        assert rtl.drafted == modelled.drafted and rtl.matched == modelled.matched
        assert rtl.engine_cycles >= modelled.engine_cycles > 0
