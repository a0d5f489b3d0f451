"""`dfvg bench` smoke tests: a tiny run on the demo pair, the efficiency table, the CLI.

These assert correctness (equal outputs, consistent counts and ratios, labelled
figures, rooflines that agree with an independent count), never timing.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from dfvg_hw.spec.config import get_preset
from dfvg_host.bench import (ALL_TASKS, DEFAULT_PROMPT_SET, BenchError, BenchRunner, BenchSettings,
                             load_prompt_set, pick_prompts, run_benchmark)
from dfvg_host.bench_report import format_result
from dfvg_host.cli import main
from dfvg_host.driver import DraftDevice
from dfvg_host.efficiency import DraftShape, engine_efficiency

NEW_TOKENS = 8
GAMMAS = (2, 3)


@pytest.fixture(scope="module")
def tiny_run(demo_pair, demo_compiled):
    """One prompt per task x 8 new tokens x γ in {2, 3}, on the demo pair and sim://alveo-u55c."""
    draft_dir, target_dir, _ = demo_pair
    settings = BenchSettings(gammas=GAMMAS, max_new_tokens=NEW_TOKENS, per_task=1, warmup_tokens=2)
    prompts = pick_prompts(load_prompt_set(DEFAULT_PROMPT_SET), settings.per_task)
    device = DraftDevice.open("sim://alveo-u55c", demo_compiled)
    result = run_benchmark(target_dir=target_dir, draft_dir=draft_dir, device=device,
                           device_url="sim://alveo-u55c", prompts=prompts, settings=settings,
                           prompt_set=DEFAULT_PROMPT_SET, verifier_device="cpu")
    return result, result.to_dict()


def test_speculative_outputs_equal_target_only_greedy(demo_pair, demo_compiled):
    """Checked directly, not through the bench's own bookkeeping."""
    from transformers import AutoTokenizer

    from dfvg_host.compiler import load_model
    from dfvg_host.verifier import Verifier

    draft_dir, target_dir, _ = demo_pair
    tok = AutoTokenizer.from_pretrained(target_dir)
    runner = BenchRunner(Verifier(load_model(target_dir), torch.device("cpu")), load_model(draft_dir),
                         DraftDevice.open("sim://alveo-u55c", demo_compiled))
    prompt = tok(load_prompt_set(DEFAULT_PROMPT_SET)[0].text)["input_ids"]
    with torch.no_grad():
        logits_ref = []
        ids = list(prompt)
        for _ in range(NEW_TOKENS):     # teacher-forced greedy argmax, EOS not special
            logits_ref.append(int(runner.target(torch.tensor([ids])).logits[0, -1].argmax()))
            ids.append(logits_ref[-1])
    reference, tally = runner.target_only(prompt, NEW_TOKENS)
    assert reference == logits_ref and tally.tokens == NEW_TOKENS
    for gamma in GAMMAS:
        assert runner.dfvg(prompt, NEW_TOKENS, gamma)[0] == reference
        assert runner.assisted(prompt, NEW_TOKENS, gamma)[0] == reference
    assert runner.assisted(prompt, NEW_TOKENS, None)[0] == reference


def test_every_method_matches_and_counts_add_up(tiny_run):
    result, data = tiny_run
    rows = {r["key"]: r for r in data["rows"]}
    assert set(rows) == {"target-only", "assisted (HF defaults)", "dfvg-adaptive γ=auto"} | {
        f"{m} γ={g}" for m in ("assisted", "dfvg", "dfvg-pipelined") for g in GAMMAS}
    prompts = data["setup"]["prompts"]
    assert prompts == 3 and set(data["by_task"]) == {"code", "prose", "dialogue"}
    for r in data["rows"]:
        assert r["tokens"] == prompts * NEW_TOKENS
        assert r["matches_target_only"] == prompts, r["key"]
        if r["method"] != "target-only":
            assert 0.0 <= r["acceptance_rate"] <= 1.0
            # every round commits its accepted drafts plus one token
            assert r["accepted"] + r["rounds"] == r["tokens"]
        if r["gamma"] is not None:
            assert r["drafted"] <= r["gamma"] * r["rounds"]
    for g in GAMMAS:
        d = rows[f"dfvg γ={g}"]
        assert len(d["acceptance_per_position"]) == g
        assert all(0.0 <= a <= 1.0 for a in d["acceptance_per_position"])
        assert sum(d["accepted_per_position"]) == d["accepted"]
        assert sum(d["drafted_per_position"]) == d["drafted"]
        assert d["draft_s"] > 0 and d["pcie_s"] > 0
        assert d["seconds"] == pytest.approx(d["target_s"] + d["host_s"] + d["draft_s"] + d["pcie_s"])
        p = rows[f"dfvg-pipelined γ={g}"]         # greedy: the same rounds as serial DFVG
        assert (p["rounds"], p["accepted_per_position"]) == (d["rounds"], d["accepted_per_position"])
        assert p["pipeline_hits"] + p["pipeline_misses"] <= p["rounds"]
        assert 0 <= p["hidden_s"] <= p["draft_s"] + p["pcie_s"] and 0 <= p["hidden_share"] <= 1
        assert p["seconds"] == pytest.approx(p["target_s"] + p["host_s"] + p["draft_s"] + p["pcie_s"]
                                             - p["hidden_s"])
        assert p["seconds"] >= p["target_s"] and d["hidden_s"] == 0 and d["hidden_share"] is None
    a = rows["dfvg-adaptive γ=auto"]          # one controller over the run; exact all the same
    hist = {int(g): n for g, n in a["gamma_histogram"].items()}
    assert a["gamma"] is None and sum(hist.values()) <= a["rounds"]     # a last round drafts nothing
    assert sum(g * n for g, n in hist.items()) == a["drafted"]
    assert a["mean_gamma"] == pytest.approx(a["drafted"] / sum(hist.values()))
    assert max(hist) <= 16 and a["hidden_s"] == 0 and a["draft_s"] > 0
    assert a["speedup_over_assisted_same_gamma"] is None
    assert data["setup"]["adaptive_gamma_max"] == 16
    # per-task tallies add up to the whole
    for key, r in rows.items():
        parts = [next(x for x in data["by_task"][t] if x["key"] == key) for t in data["by_task"]]
        assert sum(p["tokens"] for p in parts) == r["tokens"]
        assert sum(p["accepted"] for p in parts) == r["accepted"]


def test_speedups_are_ratios_within_the_run(tiny_run):
    result, data = tiny_run
    base = next(r for r in data["rows"] if r["method"] == "target-only")
    for r in data["rows"]:
        assert r["speedup_over_target_only"] == pytest.approx(r["tokens_per_s"] / base["tokens_per_s"])
        if r["method"] == "dfvg":
            same = next(x for x in data["rows"] if x["key"] == f"assisted γ={r['gamma']}")
            assert r["speedup_over_assisted_same_gamma"] == pytest.approx(
                r["tokens_per_s"] / same["tokens_per_s"])
    h = data["headline"]
    best = max((r for r in data["rows"] if r["method"] == "dfvg"), key=lambda r: r["tokens_per_s"])
    assert h["best_dfvg"] == best["key"]
    assert h["dfvg_over_target_only"] == pytest.approx(best["speedup_over_target_only"])
    piped = max((r for r in data["rows"] if r["method"] == "dfvg-pipelined"), key=lambda r: r["tokens_per_s"])
    assert h["best_dfvg_pipelined"] == piped["key"]
    assert h["dfvg_pipelined_over_target_only"] == pytest.approx(piped["speedup_over_target_only"])
    adaptive = next(r for r in data["rows"] if r["method"] == "dfvg-adaptive")
    assert h["dfvg_adaptive"] == adaptive["key"] and h["dfvg_adaptive_mean_gamma"] == adaptive["mean_gamma"]
    assert h["dfvg_adaptive_over_target_only"] == pytest.approx(adaptive["speedup_over_target_only"])
    assert h["dfvg_adaptive_over_best_fixed"] == pytest.approx(
        adaptive["tokens_per_s"] / best["tokens_per_s"]) == adaptive["speedup_over_best_fixed_dfvg"]


def test_every_figure_is_labelled(tiny_run):
    result, data = tiny_run
    for r in data["rows"]:
        labels = r["labels"]
        assert "measured" in labels["target_s"] and "measured" in labels["host_s"]
        if r["method"] == "dfvg-pipelined":
            assert "overlap counted once" in labels["tokens_per_s"] and "modelled" in labels["hidden_s"]
        if r["method"] == "dfvg-adaptive":
            assert labels["tokens_per_s"].endswith("unpipelined")
        if r["method"].startswith("dfvg"):
            assert "modelled" in labels["draft_s"] and "modelled" in labels["pcie_s"]
            assert "modelled" in labels["tokens_per_s"] and "measured" in labels["tokens_per_s"]
        if r["method"] == "assisted":
            assert "measured" in labels["draft_s"]
    text = format_result(result)
    for needle in ("measured", "modelled", "dfvg γ=3", "assisted γ=2", "target-only", "Headline",
                   "dfvg-pipelined γ=3", "Pipelined DFVG", "overlap modelled",
                   "dfvg-adaptive γ=auto", "Adaptive DFVG", "rounds by γ", "x best",
                   "code", "prose", "dialogue", "Every method's output equals target-only"):
        assert needle in text
    json.dumps(data)                  # serialisable as printed by --json


def test_plots_are_written(tiny_run, tmp_path):
    pytest.importorskip("matplotlib")
    from dfvg_host.bench_plots import plot_results

    paths = plot_results(tiny_run[1], tmp_path)
    assert [p.name for p in paths] == ["acceptance_vs_gamma.png", "speedup_vs_gamma.png",
                                       "acceptance_per_position.png"]
    for p in paths:
        assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and p.stat().st_size > 10_000


def demo_bench(demo_pair, demo_compiled, settings: BenchSettings):
    """``settings`` run on the demo pair, one prompt per task, the draft on sim://alveo-u55c."""
    draft_dir, target_dir, _ = demo_pair
    return run_benchmark(target_dir=target_dir, draft_dir=draft_dir,
                         device=DraftDevice.open("sim://alveo-u55c", demo_compiled),
                         device_url="sim://alveo-u55c",
                         prompts=pick_prompts(load_prompt_set(DEFAULT_PROMPT_SET), 1), settings=settings,
                         prompt_set=DEFAULT_PROMPT_SET, verifier_device="cpu")


def test_engine_trees_serial_and_pipelined_with_a_budget(demo_pair, demo_compiled, tmp_path):
    """dfvg-engine-tree and dfvg-engine-tree-pipelined at the same depths, at most
    tree_budget nodes verified per forward; the strategies x schedules headline."""
    from dfvg_host.bench import ENGINE_TREE, ENGINE_TREE_PIPELINED

    budget = 3
    settings = BenchSettings(gammas=(1, 3), max_new_tokens=6, per_task=1, warmup_tokens=2,
                             assisted_hf_defaults=False, adaptive=False, engine_tree=True,
                             tree_budget=budget)
    result = demo_bench(demo_pair, demo_compiled, settings)
    data = result.to_dict()
    rows = {r["key"]: r for r in data["rows"]}
    assert set(rows) == {"target-only"} | {f"{m} γ={g}" for g in (1, 3) for m in (
        "assisted", "dfvg", "dfvg-pipelined", ENGINE_TREE, ENGINE_TREE_PIPELINED)}
    assert data["setup"]["engine_tree_budget"] == budget and data["setup"]["engine_tree_width"] == 4
    for r in data["rows"]:
        assert r["matches_target_only"] == 3 and r["tokens"] == 18, r["key"]
    for g in (1, 3):
        for method in (ENGINE_TREE, ENGINE_TREE_PIPELINED):
            t = rows[f"{method} γ={g}"]
            # a drafted round verifies min(budget, depth x width) nodes (fewer near the end)
            assert 0 < t["verified_per_forward"] <= min(budget, 4 * g) and t["tree_nodes"] > 0
            assert "§9.5" in t["labels"]["draft_s"] and "tree level" in t["labels"]["acceptance"]
        p = rows[f"{ENGINE_TREE_PIPELINED} γ={g}"]
        assert p["pipeline_hits"] + p["pipeline_misses"] <= p["rounds"]
        assert 0 <= p["hidden_s"] <= p["draft_s"] + p["pcie_s"] and 0 <= p["hidden_share"] <= 1
        assert p["seconds"] == pytest.approx(p["target_s"] + p["host_s"] + p["draft_s"] + p["pcie_s"]
                                             - p["hidden_s"])
        assert "overlap counted once" in p["labels"]["tokens_per_s"] and "modelled" in p["labels"]["hidden_s"]
        assert rows[f"{ENGINE_TREE} γ={g}"]["hidden_share"] is None
        # the budget, not depth x width, sets the chain at as many verified tokens
        assert p["dfvg_pipelined_same_verified"] == "dfvg-pipelined γ=3"
        assert rows[f"{ENGINE_TREE} γ={g}"]["dfvg_same_verified"] == "dfvg γ=3"
        assert p["speedup_over_engine_tree_same_gamma"] == pytest.approx(
            p["tokens_per_s"] / rows[f"{ENGINE_TREE} γ={g}"]["tokens_per_s"])
    h = data["headline"]
    strategies = h["strategies"]
    assert [(v["strategy"], v["schedule"]) for v in strategies.values()] == [
        ("chain", "serial"), ("tree", "serial"), ("chain", "pipelined"), ("tree", "pipelined")]
    for method, v in strategies.items():
        best = max((r for r in data["rows"] if r["method"] == method), key=lambda r: r["tokens_per_s"])
        assert v["key"] == best["key"] and v["over_target_only"] == pytest.approx(best["speedup_over_target_only"])
    assert h["best_strategy"] == max(strategies.values(), key=lambda v: v["tokens_per_s"])["key"]
    assert h["dfvg_engine_tree_pipelined"]["key"] == strategies[ENGINE_TREE_PIPELINED]["key"]
    text = format_result(result)
    for needle in ("Engine token trees", f"at most {budget} of its nodes", "dfvg-engine-tree-pipelined γ=3",
                   "Strategies and schedules at their best γ, x target-only: chain serial",
                   "tree pipelined", "Pipelined engine trees at their best", "Engine trees at their best",
                   "overlap modelled, counted once"):
        assert needle in text, needle
    json.dumps(data)
    if __import__("importlib").util.find_spec("matplotlib"):
        from dfvg_host.bench_plots import plot_results
        assert len(plot_results(data, tmp_path)) == 3


SMALL = DraftShape("small-test", hidden=256, layers=2, heads=4, intermediate=512, vocab=4096)


def test_efficiency_agrees_with_compile_and_an_independent_count(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    engines = [get_preset("alveo-u55c"), get_preset("alveo-u250")]
    ctx = 128
    rows = engine_efficiency(engines, (SMALL,), context=ctx)
    assert [(r.shape, r.report.preset) for r in rows] == [("small-test", "alveo-u55c"),
                                                           ("small-test", "alveo-u250")]
    h, i, L, V = SMALL.hidden, SMALL.intermediate, SMALL.layers, SMALL.vocab
    weights = L * (4 * h * h + 3 * h * i) + h * V            # int8 parameters read per token
    macs = L * (4 * h * h + 3 * h * i + 2 * h * ctx) + h * V   # matmuls + attention over ctx keys
    shape_dir = tmp_path / "cache" / "dfvg" / "efficiency" / "shapes" / "small-test"
    for row, engine in zip(rows, engines):
        r = row.report
        assert 0 < r.efficiency <= 1
        assert r.macs_per_token == macs
        assert r.bytes_per_token >= weights
        assert r.roofline_compute_tokens_per_s == pytest.approx(
            engine.clock_mhz * 1e6 * engine.lanes * engine.reduce / macs)
        assert r.roofline_ports_tokens_per_s == pytest.approx(engine.engine_bandwidth_gbps * 1e9 / r.bytes_per_token)
        assert r.roofline_theoretical_tokens_per_s == pytest.approx(engine.mem_bandwidth_gbps * 1e9 / r.bytes_per_token)
        achievable = engine.achievable_bandwidth_gbps * 1e9 / r.bytes_per_token
        assert r.roofline_achievable_tokens_per_s == pytest.approx(achievable)
        # efficiency is against the card's roofline, never the ports'
        assert r.efficiency == pytest.approx(r.tokens_per_s / min(achievable, r.roofline_compute_tokens_per_s))
        assert row.bound in ("memory", "compute")
        # the same figures as `dfvg compile --random-weights` for that shape and preset
        assert main(["compile", "--draft", str(shape_dir), "--random-weights", "--preset", engine.name,
                     "--context", str(ctx), "-o", str(tmp_path / engine.name), "--json"]) == 0
        report = json.loads(capsys.readouterr().out)
        for k in ("tokens_per_s", "roofline_achievable_tokens_per_s", "roofline_theoretical_tokens_per_s",
                  "roofline_ports_tokens_per_s", "roofline_compute_tokens_per_s", "efficiency",
                  "fraction_of_theoretical", "cycles_per_token"):
            assert row.to_dict()[k] == pytest.approx(report[k]), k
    # a second call comes from the cache and agrees
    again = engine_efficiency(engines, (SMALL,), context=ctx)
    assert [a.to_dict() for a in again] == [r.to_dict() for r in rows]


def test_prompt_set_is_multitask_and_documented():
    path = DEFAULT_PROMPT_SET
    assert path.stat().st_size < 1_000_000
    prompts = load_prompt_set(path)
    tasks = {q.task for q in prompts}
    assert tasks == {"code", "prose", "dialogue"}
    assert all(sum(q.task == t for q in prompts) >= 8 for t in tasks)
    raw = json.loads(path.read_text())["prompts"]
    assert all(p["source"] and p["licence"] for p in raw)
    assert (path.parent / "SOURCES.md").is_file()
    assert [q.task for q in pick_prompts(prompts, 1)] == ["code", "prose", "dialogue"]


def test_bad_prompt_set_is_a_clear_error(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text('{"prompts": [{"task": "code"}]}')
    with pytest.raises(BenchError, match="task, source, text"):
        load_prompt_set(bad)
    with pytest.raises(BenchError, match="does not exist"):
        load_prompt_set(tmp_path / "missing.json")


@pytest.mark.parametrize("argv, message", [
    (["--gammas", "0"], "each γ must be in"),
    (["--gammas", "2,x"], "comma-separated integers"),
    (["--per-task", "0"], "--per-task must be at least 1"),
    (["--gamma-max", "4", "--no-adaptive"], "no use with --no-adaptive"),
    (["--gamma-max", "0"], "--gamma-max must be at least 1"),
    (["--tree-budget", "0"], "--tree-budget must be at least 1"),
    (["--tree-budget", "8", "--no-engine-tree"], "no use with --no-engine-tree"),
    (["--max-new-tokens", "0"], "--max-new-tokens must be at least 1"),
    (["--prompts", "/nonexistent/prompts.json"], "does not exist"),
    (["--draft", "models/demo-draft"], "give both --draft and --target"),
    (["--device", "sim://nope"], "unknown engine preset"),
    (["--efficiency-presets", "alveo-u55c,nope"], "unknown engine preset"),
    (["--contexts", "256,x"], "positive integers separated by commas"),
    (["--contexts", "0"], "positive integers separated by commas"),
])
def test_bad_bench_arguments_are_one_line_errors(argv, message, capsys):
    try:
        code = main(["bench", *argv])
    except SystemExit as exc:         # argparse-level checks exit from parser.error
        code = exc.code
    assert code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert message in err[-1] and err[-1].startswith("dfvg")
