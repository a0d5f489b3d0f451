"""The engine's token trees end to end on the host: the driver's tree requests and path
compaction, the tree decoder (exact greedy, lossless sampling, faults), the CLI and bench.

The drafts are tiny Llamas on ``sim://tiny`` (trees 2 wide: the preset's rows); the
functional model drafts the trees (docs/isa.md §9).
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections import Counter

import pytest
import torch

import dfvg_host.tree as tree_module
import sampling_checks
from conftest import make_tiny_llama
from sampling_checks import chi_square_p
from dfvg_hw.spec.config import get_preset
from dfvg_hw.spec.descriptors import DraftResult
from dfvg_hw.spec.regmap import MemoryMap
from dfvg_host.acceptance import SamplingParams
from dfvg_host.cli import main
from dfvg_host.compiler import compile_draft, load_model
from dfvg_host.driver import ContextFull, DraftDevice, MalformedResult
from dfvg_host.fault_injection import Fault, FaultInjectingTransport, FaultKind
from dfvg_host.speculative import SpeculativeDecoder
from dfvg_host.tree_drafting import TreeDecoder
from dfvg_host.verifier import Verifier
from sim.device import SimDevice

PROMPT = [5, 17, 99, 3, 42, 7]
PROMPTS = [PROMPT, [100, 4, 61, 9], [33, 200, 12, 77, 150]]
NEW = 24


def fresh(compiled) -> DraftDevice:
    return DraftDevice.open("sim://tiny", compiled)


def path_to(parents: list[int], node: int) -> list[int]:
    path = []
    while node != -1:
        path.append(node)
        node = parents[node]
    return path[::-1]


def same_drafts(a, b) -> bool:
    """The same tokens, parents and top-k distributions."""
    return [(t.token, t.parent, t.topk_ids, t.topk_probs) for t in a.tokens] == \
           [(t.token, t.parent, t.topk_ids, t.topk_probs) for t in b.tokens]


# -- the driver ------------------------------------------------------------------------------
def test_tree_request_round_trip_and_path_compaction(tiny_compiled):
    dev = fresh(tiny_compiled)
    width = tiny_compiled.tree.width
    assert dev.tree_width == width == 2 and dev.engine_tree_width == get_preset("tiny").rows
    pending = dev.submit_tree(PROMPT, 4)
    r = pending.request
    assert (r.tree_width, r.tree_pc, r.row_pitch) == (width, tiny_compiled.tree.pc, tiny_compiled.tree.row_pitch)
    assert r.topk >= width and r.compaction is None and r.n_records == 8
    out = dev.collect(pending)
    p0 = len(PROMPT)
    assert out.tree_width == width and out.levels == 4 and len(out.tokens) == 8
    assert out.end_pos == p0 + 3 and dev.committed == dev.kv_length == p0 and dev.tree is not None
    # every node's distribution is the chain's after its path
    for i in range(len(out.tokens)):
        path = [out.ids[j] for j in path_to(out.parents, i)]
        chain = fresh(tiny_compiled).draft(PROMPT + path[:-1], 1, topk=r.topk)
        assert chain.tokens[0].topk_probs == out.tokens[i].topk_probs, i
    # a path of two of the four levels: compacted by the next request, which then drafts
    # exactly what a fresh engine drafts after the whole sequence
    path = path_to(out.parents, 5)[:2]
    assert dev.commit_tree_path(path) == 2 and dev.committed == p0 + 2 and dev.tree is None
    tokens = [out.ids[j] for j in path]
    nxt = dev.submit(tokens[2:] + [77], 5)
    assert nxt.request.compaction.rows == tuple(j % width for j in path)
    assert same_drafts(dev.collect(nxt), fresh(tiny_compiled).draft(PROMPT + tokens + [77], 5))
    # every level accepted: the last has no KV, so 3 are compacted and it is fed again
    dev.rollback(0)
    out = dev.draft_tree(PROMPT, 4, sample=True, temperature=1.0, seed=5, counter=9)
    path = path_to(out.parents, 7)
    tokens = [out.ids[j] for j in path]
    assert dev.commit_tree_path(path) == 3
    after = dev.draft_tree(tokens[3:] + [9], 3)
    assert same_drafts(after, fresh(tiny_compiled).draft_tree(PROMPT + tokens + [9], 3))
    # a sampled tree is reproducible from its counter
    again = fresh(tiny_compiled).draft_tree(PROMPT, 4, sample=True, temperature=1.0, seed=5, counter=9)
    assert same_drafts(out, again)


def test_rollback_trims_a_pending_compaction_and_forgets_a_tree(tiny_compiled):
    dev = fresh(tiny_compiled)
    out = dev.draft_tree(PROMPT, 4)
    path = path_to(out.parents, 6)
    tokens = [out.ids[j] for j in path]
    assert dev.commit_tree_path(path) == 3
    dev.rollback(len(PROMPT) + 1)               # keep one level of the path
    got = dev.draft(tokens[1:2] + [3], 4)
    assert same_drafts(got, fresh(tiny_compiled).draft(PROMPT + tokens[:2] + [3], 4))
    dev.rollback(0)
    dev.draft_tree(PROMPT, 2)
    dev.rollback(len(PROMPT))
    with pytest.raises(ValueError, match="no tree to commit"):
        dev.commit_tree_path([0])
    dev.draft_tree([1], 2)
    dev.draft([2], 1)                           # a request overwrites the uncommitted tree
    assert dev.tree is None


def test_tree_requests_are_checked_on_the_host(tiny_compiled):
    dev = fresh(tiny_compiled)
    for levels in (0, 33, True):
        with pytest.raises(ValueError, match="1..32 levels"):
            dev.submit_tree(PROMPT, levels)
    with pytest.raises(ValueError, match="vocabulary"):
        dev.submit_tree([300], 2)
    # storage: committed + inputs + (levels - 1) x width must fit the 64 positions
    dev.draft(list(range(2, 50)), 0)
    with pytest.raises(ContextFull, match=r"up to position 68 \(9 level\(s\) of 2"):
        dev.submit_tree([5, 6], 10)
    assert len(dev.draft_tree([5, 6], 8).tokens) == 16     # 48 + 2 + 7 x 2 = 64 fits
    with pytest.raises(ValueError, match="not a root-to-node path"):
        dev.commit_tree_path([1, 0])


def test_a_chain_only_device_is_refused_on_the_host(tiny_engine, tiny_compiled, target):
    dev = DraftDevice(SimDevice(tiny_engine, tree_width=0), tiny_compiled)
    assert dev.tree_width == 0
    with pytest.raises(ValueError) as info:
        dev.submit_tree(PROMPT, 2)
    message = str(info.value)
    assert "drafts chains only" in message and "sim://" in message and "\n" not in message
    assert dev.pending is None and dev.draft(PROMPT, 3).ids         # chains still draft
    with pytest.raises(ValueError, match="drafts chains only"):
        TreeDecoder(dev, Verifier(target, torch.device("cpu")))
    old = dataclasses.replace(tiny_compiled, manifest={k: v for k, v in tiny_compiled.manifest.items()
                                                       if k != "tree"})
    no_tree = fresh(old)
    assert no_tree.tree_width == 0 and "no tree forward" in no_tree.tree_unavailable()


def _rewrite_result(dev: DraftDevice, pending, change) -> None:
    """Change the records of ``pending``'s result in the sim device's memory, with a
    consistent check word (what a check word cannot catch)."""
    sim = dev.transport.inner
    addr = MemoryMap.RESULT[pending.buffer]
    size = 4 * 16 + 4 * pending.request.n_records * (2 + 2 * dev.topk_max)
    result = DraftResult.unpack(sim.dma_read(addr, size), dev.topk_max)
    change(result.tokens)
    sim.dma_write(addr, result.pack(dev.topk_max))


def _another_list(tokens) -> None:
    """Node 1 (a sibling at level 1) reports its list with two entries other than its own
    token swapped: a consistent record, but not its siblings' q."""
    d = tokens[1]
    a, b = [k for k in range(len(d.topk_ids)) if d.topk_ids[k] != d.token][:2]
    for values in (d.topk_ids, d.topk_probs):
        values[a], values[b] = values[b], values[a]


@pytest.mark.parametrize("sample, change, message", [
    (False, lambda t: setattr(t[2], "parent", -1), "parent -1, not a node of level 1"),
    (False, lambda t: t.__setitem__(slice(2, 4), t[3:1:-1]), "greedy level 2"),
    (True, _another_list, "another top-k than its siblings"),
    (True, lambda t: setattr(t[3], "parent", 0), "not its row's node 1"),
])
def test_tree_results_that_break_the_contract_are_malformed(tiny_compiled, sample, change, message):
    dev = fresh(tiny_compiled)
    pending = dev.submit_tree(PROMPT, 3, sample=sample, temperature=1.0, seed=1)
    _rewrite_result(dev, pending, change)
    with pytest.raises(MalformedResult, match=message):
        dev.collect(pending)
    assert dev.committed == 0 and dev.tree is None


# -- decoding ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def target(tiny_draft_dir):
    return load_model(tiny_draft_dir)


@pytest.fixture(scope="module")
def random_draft(tmp_path_factory):
    return compile_draft(make_tiny_llama(tmp_path_factory.mktemp("tree-random") / "d", seed=21),
                         get_preset("tiny"))


@pytest.fixture(scope="module")
def reference(target):
    with torch.no_grad():
        return {tuple(p): target.generate(torch.tensor([p]), max_new_tokens=NEW, do_sample=False,
                                          eos_token_id=1, pad_token_id=2)[0, len(p):].tolist()
                for p in PROMPTS}


def tree_decoder(compiled, target, transport=None, **kwargs) -> TreeDecoder:
    dev = DraftDevice(transport, compiled, timeout_s=0.1, retry_backoff_s=0.0) if transport else fresh(compiled)
    return TreeDecoder(dev, Verifier(target, torch.device("cpu")), eos_token_id=1, **kwargs)


@pytest.mark.parametrize("depth", [1, 3, "auto"])
def test_greedy_tree_decoding_is_the_targets(tiny_compiled, random_draft, target, reference, depth):
    for compiled in (tiny_compiled, random_draft):     # the target itself, and a poor drafter
        decoder = tree_decoder(compiled, target, depth=depth)
        for prompt in PROMPTS:
            out = decoder.generate(prompt, NEW)
            m = out.metrics
            assert out.tokens == reference[tuple(prompt)] and not out.faults
            assert m.tree_width == 2 and m.tree_nodes == 2 * m.drafted_tokens
            assert m.accepted_tokens + m.rounds == len(out.tokens) or out.stop_reason == "eos"
            assert all(0 < g <= (16 if depth == "auto" else depth) for g in m.gamma_per_round[:-1])
            assert m.device_cycles > 0 and any(l.startswith("tree ") for l in m.summary().splitlines())
    assert m.mean_tree_nodes == 2 * m.mean_gamma


def test_the_tree_decoder_checks_its_depth(tiny_compiled, target):
    for depth in (0, 33, "deep"):
        with pytest.raises(ValueError, match="depth"):
            tree_decoder(tiny_compiled, target, depth=depth)


#: A device whose link is dead for good.
DEAD = [Fault(FaultKind.DROP, op, repeat=math.inf) for op in ("read32", "write32", "start", "dma_write")]


@pytest.mark.parametrize("plan", [[Fault(FaultKind.CORRUPT, "dma_read", at=4)],
                                  [Fault(FaultKind.ERROR, "start", at=3)], DEAD],
                         ids=["corrupt-result", "error-status", "dead"])
def test_faults_keep_greedy_exact(tiny_engine, tiny_compiled, target, reference, plan):
    inj = FaultInjectingTransport(SimDevice(tiny_engine), armed=False)
    decoder = tree_decoder(tiny_compiled, target, transport=inj, depth=3)
    inj.arm(plan)
    out = decoder.generate(PROMPTS[1], NEW)
    assert out.tokens == reference[tuple(PROMPTS[1])] and out.stop_reason == "max_new_tokens"
    assert inj.injected and out.metrics.device_faults >= 1
    assert out.degraded == (plan is DEAD) and out.metrics.device_resets >= 1


def test_recovered_faults_change_no_sampled_token(tiny_engine, tiny_compiled, target):
    """A failed tree request is replayed after a reset with the same RNG counter: the same
    tokens as without the fault."""
    sampling = SamplingParams(temperature=1.0, top_k=4, seed=7)
    clean = tree_decoder(tiny_compiled, target, depth=3, sampling=sampling)
    inj = FaultInjectingTransport(SimDevice(tiny_engine), armed=False)
    faulty = tree_decoder(tiny_compiled, target, transport=inj, depth=3, sampling=sampling)
    inj.arm([Fault(FaultKind.ERROR, "start", at=3)])
    want, got = clean.generate(PROMPT, NEW), faulty.generate(PROMPT, NEW)
    assert got.tokens == want.tokens and not got.degraded and faulty.draft.resets == 1


# -- sampling: lossless, and the test can fail ---------------------------------------------------
VOCAB = 8
SMALL_PROMPT = [1, 4, 6, 3]
PARAMS = SamplingParams(temperature=1.0)


@pytest.fixture(scope="module")
def small_vocab(tmp_path_factory):
    """A target and a different draft over an 8-token vocabulary, no EOS."""
    root = tmp_path_factory.mktemp("tree-small-vocab")
    target = make_tiny_llama(root / "target", vocab=VOCAB, seed=10, weight_scale=3.0, eos=None)
    draft = make_tiny_llama(root / "draft", vocab=VOCAB, seed=11, weight_scale=3.0, eos=None)
    return target, compile_draft(draft, get_preset("tiny"))


def sample_first_two(target_dir, compiled, n):
    decoder = TreeDecoder(fresh(compiled), Verifier(load_model(target_dir), torch.device("cpu")),
                          depth=2, sampling=PARAMS)
    counts = Counter()
    for seed in range(n):
        decoder.sampling = SamplingParams(PARAMS.temperature, PARAMS.top_k, seed)
        decoder._generator.manual_seed(seed ^ 0x5EED)
        counts[tuple(decoder.generate(SMALL_PROMPT, 3).tokens[:2])] += 1
    return counts


def tree_chi_square(small_vocab, n: int) -> float:
    """Chi-square p of the first two tokens of ``n`` tree generations against the target."""
    target_dir, compiled = small_vocab
    counts = sample_first_two(target_dir, compiled, n)
    expected = sampling_checks.first_two_distribution(load_model(target_dir), SMALL_PROMPT, PARAMS, VOCAB)
    return chi_square_p(counts, expected, n)


def test_sampling_is_lossless(small_vocab):
    p = tree_chi_square(small_vocab, 1000)
    print(f"engine trees: chi-square p = {p:.3g} from 1000 samples")
    assert p > 0.01, f"tree samples differ from the target distribution (p = {p:.2e})"


def test_wrong_q_is_detected(small_vocab, monkeypatch):
    uniform = lambda token, vocab: torch.full((vocab,), 1.0 / vocab, dtype=torch.float64)
    monkeypatch.setattr(tree_module, "draft_distribution", uniform)
    p = tree_chi_square(small_vocab, 300)
    print(f"engine trees with a uniform q: chi-square p = {p:.3g} from 300 samples")
    assert p < 0.01, f"a uniform q went undetected (p = {p:.3f})"


# -- the command line and the bench -------------------------------------------------------------
def run_cli(argv, capsys) -> tuple[int, str, str]:
    try:
        code = main(argv)
    except SystemExit as exc:
        code = exc.code
    out, err = capsys.readouterr()
    return code, out, err


def test_generate_tree_json_on_the_demo_pair(demo_pair, capsys):
    _, target_dir, _ = demo_pair
    prompt = "import os\n\ndef main():\n"
    code, out, err = run_cli(["generate", "--prompt", prompt, "--max-new-tokens", "16", "--gamma", "2",
                              "--strategy", "tree", "--json"], capsys)
    assert code == 0, err
    data = json.loads(out)
    m = data["metrics"]
    assert data["strategy"] == "tree" and data["tree_width"] == m["tree_width"] == 4 and data["depth"] == 2
    assert data["tree_nodes"] == m["tree_nodes"] == 4 * m["drafted_tokens"] > 0
    assert data["mean_accepted_length"] == m["mean_accepted_length"] >= 1
    assert m["labels"]["device_seconds"].startswith("modelled") and m["device_cycles"] > 0
    from transformers import AutoTokenizer
    ids = torch.tensor([AutoTokenizer.from_pretrained(target_dir)(prompt)["input_ids"]])
    with torch.no_grad():
        ref = load_model(target_dir).generate(ids, max_new_tokens=16, do_sample=False,
                                              attention_mask=torch.ones_like(ids))[0, ids.shape[1]:]
    assert data["token_ids"] == ref.tolist()[:len(data["token_ids"])]


def test_generate_tree_on_a_chain_only_device_is_one_line(monkeypatch, capsys):
    import dfvg_host.transport as transport
    real = transport.open_transport

    def chains_only(url):
        _, config = real(url)
        return SimDevice(config, tree_width=0), config

    monkeypatch.setattr(transport, "open_transport", chains_only)
    monkeypatch.setattr("dfvg_host.verifier.Verifier.from_pretrained",
                        lambda *a, **k: pytest.fail("the target was loaded before the error"))
    code, _, err = run_cli(["generate", "--prompt", "x", "--strategy", "tree"], capsys)
    lines = err.strip().splitlines()
    assert code == 2 and lines[-1].startswith("dfvg: error: --strategy tree on sim://alveo-u55c: the draft "
                                               "device drafts chains only"), err
    assert "sim://" in lines[-1] and "--strategy chain" in lines[-1]


def test_generate_tree_with_a_program_without_trees_is_one_line(demo_compiled, tmp_path, monkeypatch, capsys):
    old = dataclasses.replace(demo_compiled, manifest={k: v for k, v in demo_compiled.manifest.items()
                                                       if k != "tree"})
    old.save(tmp_path / "old")
    monkeypatch.setattr("dfvg_host.verifier.Verifier.from_pretrained",
                        lambda *a, **k: pytest.fail("the target was loaded before the error"))
    code, _, err = run_cli(["generate", "--prompt", "x", "--strategy", "tree", "--draft", str(tmp_path / "old"),
                            "--target", "models/demo-target"], capsys)
    assert code == 2 and "no tree forward" in err.strip().splitlines()[-1]
    assert "rows >= 2" in err


@pytest.mark.parametrize("argv, message", [
    (["--device", "sim://alveo-u55c", "--device", "sim://alveo-u55c"], "several drafters merge"),
    (["--gamma", "17"], "a tree 4 wide has at most 16 levels"),
    (["--gamma", "auto", "--gamma-max", "20"], "--gamma-max 20"),
])
def test_bad_tree_arguments_are_one_line_errors(argv, message, capsys):
    code, _, err = run_cli(["generate", "--prompt", "x", "--strategy", "tree", *argv], capsys)
    last = err.strip().splitlines()[-1]
    assert code == 2 and last.startswith("dfvg: error:") and message in last, err


def test_bench_runs_the_engine_trees_next_to_the_chains(demo_pair, demo_compiled):
    from dfvg_host.bench import BenchSettings
    from dfvg_host.bench_report import format_result
    from test_bench import demo_bench

    settings = BenchSettings(gammas=(1, 4), max_new_tokens=6, per_task=1, warmup_tokens=2,
                             assisted_hf_defaults=False, pipelined=False, adaptive=False, engine_tree=True)
    result = demo_bench(demo_pair, demo_compiled, settings)
    data = result.to_dict()
    rows = {r["key"]: r for r in data["rows"]}
    assert set(rows) == {"target-only", "assisted γ=1", "assisted γ=4", "dfvg γ=1", "dfvg γ=4",
                         "dfvg-engine-tree γ=1", "dfvg-engine-tree γ=4"}
    for r in rows.values():
        assert r["matches_target_only"] == 3 and r["tokens"] == 18, r["key"]
    tree = rows["dfvg-engine-tree γ=1"]
    assert tree["verified_per_forward"] == 4.0 and tree["tree_nodes"] == 4 * tree["drafted"]
    assert tree["dfvg_same_verified"] == "dfvg γ=4" and tree["speedup_over_dfvg_same_verified"] > 0
    assert rows["dfvg γ=4"]["verified_per_forward"] <= 4 and "§9.5" in tree["labels"]["draft_s"]
    assert data["setup"]["engine_tree_width"] == 4 and data["headline"]["dfvg_engine_tree"]["key"]
    text = format_result(result)
    assert "Engine token trees" in text and "Engine trees at their best" in text
