"""`dfvg compile` and the CLI's error contract: one line on stderr, exit code 2."""

import json
import os
import subprocess
import sys
import tempfile

import pytest

from conftest import make_tiny_llama

from dfvg_hw.spec.config import get_preset


CACHE = tempfile.mkdtemp(prefix="dfvg-cli-cache-")   # compiled drafts, shared by these tests


def dfvg(*args, timeout=600):
    env = dict(os.environ, XDG_CACHE_HOME=CACHE)
    return subprocess.run([sys.executable, "-m", "dfvg_host.cli", *map(str, args)],
                          capture_output=True, text=True, timeout=timeout, env=env)


def error_line(proc):
    lines = [l for l in proc.stderr.splitlines() if l.startswith("dfvg: error:")]
    assert proc.returncode == 2, proc.stderr
    assert len(lines) == 1, proc.stderr
    return lines[0]


def test_compile_writes_image_program_and_report(tiny_draft_dir, tmp_path):
    out = tmp_path / "out"
    proc = dfvg("compile", "--draft", tiny_draft_dir, "--preset", "tiny", "-o", out, "--random-weights")
    assert proc.returncode == 0, proc.stderr
    for name in ("image.bin", "program.bin", "program.s", "manifest.json", "report.json", "report.txt"):
        assert (out / name).is_file()
    report = json.loads((out / "report.json").read_text())
    assert report["program_words"] == (out / "program.bin").stat().st_size // 16
    assert report["cycles_per_token"] > 0 and report["bytes_per_token"] > 0
    assert report["tokens_per_s"] == pytest.approx(100e6 / report["cycles_per_token"])
    assert "[modelled" in proc.stdout and "tokens/s" in proc.stdout


def test_row_exponents_are_an_option_of_compile_and_of_a_compiled_drafts_use(tiny_draft_dir, tmp_path):
    """``--row-exponents`` (the default for a model without down-projection biases) compiles
    ACTMUL and the down MATMUL with ROWEXP, ``--no-row-exponents`` does not;
    ``--row-exponents`` of generate or accuracy on a draft compiled without them is refused
    naming the compile option (the CLI prints it as one line, exit 2)."""
    from dfvg_hw.spec.isa import assemble
    runs = {}
    for name, extra in (("plain", ["--no-row-exponents"]), ("rowexp", ["--row-exponents"]),
                        ("default", [])):
        out = tmp_path / name
        proc = dfvg("compile", "--draft", tiny_draft_dir, "--preset", "tiny", "-o", out, "--random-weights", *extra)
        assert proc.returncode == 0, proc.stderr
        runs[name] = (out, [w >> 8 & 0x20 and w & 0xFF for w in assemble((out / "program.s").read_text())])
    assert not any(runs["plain"][1]) and sorted(set(runs["rowexp"][1]) - {0}) == [0x12, 0x16]
    assert runs["default"][1] == runs["rowexp"][1]
    from dfvg_host.cli import CliError, _compile_source, _resolve_draft
    source = _resolve_draft(str(runs["plain"][0]), get_preset("tiny"))
    with pytest.raises(CliError, match=r"compiled draft without row exponents; compile it with "
                                       r"`dfvg compile --row-exponents`"):
        _compile_source(source, get_preset("tiny"), None, print, row_exponents=True)
    assert _compile_source(_resolve_draft(str(runs["rowexp"][0]), get_preset("tiny")), get_preset("tiny"),
                           None, print, row_exponents=True).manifest["layout"]["row_exponents"]


def test_unsupported_architecture(tmp_path):
    from transformers import GPT2Config
    GPT2Config(n_layer=1, n_embd=32, n_head=2).save_pretrained(tmp_path)
    line = error_line(dfvg("compile", "--draft", tmp_path, "-o", tmp_path / "o"))
    assert "model_type 'gpt2' is not supported" in line


def test_model_that_does_not_fit_names_the_limit(tmp_path):
    make_tiny_llama(tmp_path / "m", layers=3)
    line = error_line(dfvg("compile", "--draft", tmp_path / "m", "--preset", "tiny", "-o",
                           tmp_path / "o", "--random-weights"))
    assert ("model needs 3 layers × 2 KV heads = 6 KV slots; the 'tiny' preset has "
            "kv_slots = 4") in line


def test_weight_blocks_on_a_preset_without_block_multipliers(tiny_draft_dir, tmp_path, monkeypatch,
                                                             capsys):
    """``--weight-blocks`` for a preset built without block multipliers: one line naming the
    preset and the option, exit 2, before the draft is read; the compiler refuses it too."""
    from dfvg_hw.spec import config
    from dfvg_host import cli
    from dfvg_host.compiler import CompileError, compile_draft
    plain = config.PRESETS["tiny"].with_changes(name="tiny-plain", weight_blocks=False)
    monkeypatch.setitem(config.PRESETS, plain.name, plain)
    message = ("--weight-blocks: the 'tiny-plain' preset is built without block multipliers "
               "(weight_blocks = False); compile without --weight-blocks")
    code = cli.main(["compile", "--draft", str(tmp_path / "absent"), "--preset", "tiny-plain",
                     "-o", str(tmp_path / "o"), "--weight-blocks"])
    assert (code, capsys.readouterr().err.splitlines()) == (2, [f"dfvg: error: {message}"])
    with pytest.raises(CompileError, match="'tiny-plain' preset is built without"):
        compile_draft(tiny_draft_dir, plain, random_weights=True, weight_blocks=True)
    # without the option the preset compiles
    assert cli.main(["compile", "--draft", str(tiny_draft_dir), "--preset", "tiny-plain",
                     "-o", str(tmp_path / "o"), "--random-weights"]) == 0


def test_embedding_rows_of_any_width_are_padded_to_engine_beats(tmp_path):
    """EMBED rows are padded to whole engine beats (docs/isa.md §3.2): a 36-wide draft (a
    144-byte int32 row) compiles for alveo-u55c, whose engine beat is 32 channels x 64 bytes
    (four heads of 16: q and k whole 64-byte VMEM lines)."""
    from transformers import LlamaConfig

    from dfvg_hw.spec.image import ImageHeader, embed_row_stride

    LlamaConfig(hidden_size=36, head_dim=16, num_hidden_layers=1, num_attention_heads=4,
                num_key_value_heads=4, intermediate_size=64, vocab_size=256,
                max_position_embeddings=128).save_pretrained(tmp_path / "m")
    proc = dfvg("compile", "--draft", tmp_path / "m", "--preset", "alveo-u55c", "-o", tmp_path / "o",
                "--random-weights")
    assert proc.returncode == 0, proc.stderr
    beat = get_preset("alveo-u55c").mem_beat_bytes
    assert beat == 2048 and embed_row_stride(36, beat) == 2048
    header = ImageHeader.unpack((tmp_path / "o" / "image.bin").read_bytes()[:256])
    assert header.embed_addr % beat == 0 and header.rope_addr - header.embed_addr >= 256 * 2048


@pytest.mark.parametrize("args, message", [
    (["compile", "--draft", "/no/such/dir", "-o", "x"], "is not a directory"),
    (["compile", "--draft", ".", "--preset", "v80", "-o", "x"], "unknown engine preset 'v80'"),
    (["compile", "--draft", ".", "-o", "x"], "has no config.json"),
])
def test_bad_arguments(args, message):
    assert message in error_line(dfvg(*args))


def test_accuracy_of_the_demo_draft(demo_pair):
    proc = dfvg("accuracy", "--positions", 48, "--segment", 24, "--json")
    assert proc.returncode == 0, proc.stderr
    figures = json.loads(proc.stdout[proc.stdout.index("{"):])
    assert figures["positions"] == 48 and figures["segment"] == 24
    assert figures["top1"] >= 0.9 and figures["mean_cosine"] >= 0.99


@pytest.mark.parametrize("args, message", [
    (["accuracy", "--text", "/no/such/file"], "--text /no/such/file is not a file"),
    (["accuracy", "--positions", 100000], "fewer than the 100000 positions"),
    (["import-gguf", "-o", "x"], "give a GGUF file or --package NAME"),
    (["import-gguf", "/no/such.gguf", "-o", "x"], "no such GGUF file"),
    (["import-gguf", "--package", "llm-nothing", "-o", "x"], "unknown package 'llm-nothing'"),
])
def test_accuracy_and_import_errors(args, message):
    assert message in error_line(dfvg(*args))


def test_argparse_errors_exit_2():
    assert dfvg("compile").returncode == 2
    assert dfvg("demo", "--gamma", "0").returncode == 2
    assert dfvg("generate", "--schedule", "tree", "--prompt", "a").returncode == 2
    for bad in (["--gamma", "fast"], ["--gamma", "auto", "--gamma-max", "0"],
                ["--gamma", "auto", "--gamma-max", "64"]):
        assert dfvg("generate", "--prompt", "a", *bad).returncode == 2


def test_strategy_takes_chain_or_tree_and_tree_takes_one_drafter():
    assert dfvg("generate", "--strategy", "forest", "--prompt", "a").returncode == 2
    line = error_line(dfvg("generate", "--prompt", "a", "--strategy", "tree",
                           "--device", "sim://alveo-u55c", "--device", "sim://alveo-u55c"))
    assert "--strategy tree drafts with one engine's token trees" in line and "--merge tree" in line


@pytest.mark.parametrize("args, message", [
    (["--tree-budget", 8], "--tree-budget caps the nodes of the engine's token trees the target "
                           "verifies per round: give it with --strategy tree"),
    (["--tree-budget", 8, "--strategy", "chain", "--schedule", "pipelined"], "give it with --strategy tree"),
])
def test_tree_budget_needs_strategy_tree(args, message):
    assert message in error_line(dfvg("generate", "--prompt", "a", *args))


def test_tree_budget_is_at_least_one():
    proc = dfvg("generate", "--prompt", "a", "--strategy", "tree", "--tree-budget", 0)
    assert proc.returncode == 2 and "--tree-budget must be at least 1" in proc.stderr.splitlines()[-1]


def test_generate_pipelined_tree_with_a_budget_is_the_targets_greedy_decoding(demo_pair):
    """--strategy tree --schedule pipelined --tree-budget: the pipelined tree decoder, at
    most the budget's nodes verified per round, the target's greedy tokens."""
    import torch
    from transformers import AutoTokenizer

    from dfvg_host.compiler import load_model

    _, target_dir, _ = demo_pair
    prompt = "import os\n\ndef main():\n"
    proc = dfvg("generate", "--prompt", prompt, "--max-new-tokens", 12, "--gamma", 3, "--strategy", "tree",
                "--schedule", "pipelined", "--tree-budget", 5, "--json")
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    m = out["metrics"]
    assert out["strategy"] == "tree" and out["schedule"] == m["schedule"] == "pipelined"
    assert out["tree_budget"] == m["tree_budget"] == 5 and out["depth"] == 3 and out["tree_width"] == 4
    drafted_rounds = sum(1 for g in m["gamma_per_round"] if g)
    assert 0 < m["tree_nodes"] <= 5 * drafted_rounds and m["mean_tree_nodes"] <= 5
    assert m["labels"]["projected_seconds"].endswith("pipelined: overlap counted once")
    assert m["pipeline_hits"] + m["pipeline_misses"] <= m["rounds"] and 0 <= m["hidden_draft_share"] <= 1
    ids = torch.tensor([AutoTokenizer.from_pretrained(target_dir)(prompt)["input_ids"]])
    with torch.no_grad():
        ref = load_model(target_dir).generate(ids, max_new_tokens=12, do_sample=False,
                                              attention_mask=torch.ones_like(ids))[0, ids.shape[1]:]
    assert len(out["token_ids"]) == 12 and out["token_ids"] == ref.tolist()


def test_gamma_max_needs_gamma_auto():
    assert "give it with --gamma auto" in error_line(dfvg("generate", "--prompt", "a", "--gamma-max", 8))


def test_generate_adaptive_gamma_json(demo_pair):
    proc = dfvg("generate", "--prompt", "import os\n\ndef main():\n", "--max-new-tokens", 24,
                "--gamma", "auto", "--gamma-max", 8, "--json")
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    m = out["metrics"]
    assert out["gamma"] == "auto" and out["adaptive"]["choices"] >= 1 and len(out["adaptive"]["acceptance"]) == 8
    assert m["gamma_mode"] == "auto" and len(m["gamma_per_round"]) == m["rounds"]
    assert all(0 <= g <= 8 for g in m["gamma_per_round"]) and sum(m["gamma_per_round"]) == m["drafted_tokens"]
    assert m["mean_gamma"] > 0 and m["labels"]["verifier_seconds"] == "measured"


def test_generate_json_on_the_demo_pair(demo_pair):
    proc = dfvg("generate", "--prompt", "import os\n\ndef main():\n", "--max-new-tokens", 24,
                "--gamma", 3, "--json")
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    m = out["metrics"]
    assert len(out["token_ids"]) == 24 or out["stop_reason"] == "eos"
    assert m["emitted_tokens"] == len(out["token_ids"])
    assert 0 <= m["acceptance_rate"] <= 1 and m["drafted_tokens"] >= m["accepted_tokens"]
    assert m["device_cycles"] > 0 and m["pcie_bytes"] > 0
    assert m["labels"]["device_seconds"].startswith("modelled")
    assert m["labels"]["verifier_seconds"] == "measured"


def test_generate_pipelined_json_and_trace(demo_pair, tmp_path):
    trace = tmp_path / "trace.json"
    proc = dfvg("generate", "--prompt", "import os\n\ndef main():\n", "--max-new-tokens", 24,
                "--gamma", 3, "--schedule", "pipelined", "--trace", trace, "--json")
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    m = out["metrics"]
    assert out["schedule"] == m["schedule"] == "pipelined" and out["trace"] == str(trace)
    assert m["labels"]["projected_seconds"].endswith("pipelined: overlap counted once")
    assert 0 <= m["hidden_draft_share"] <= 1 and m["pipeline_hits"] + m["pipeline_misses"] <= m["rounds"]
    assert m["verifier_seconds"] <= m["projected_seconds"]
    events = json.loads(trace.read_text())["traceEvents"]
    lanes = {e["args"]["name"] for e in events if e["name"] == "thread_name"}
    assert lanes == {"engine", "pcie", "target", "host"}
    assert any(e["ph"] == "X" and e["args"]["lane"] == "engine" for e in events)


def test_generate_streams_text_and_labels_figures(demo_pair):
    proc = dfvg("generate", "--prompt", "def f(x):\n", "--max-new-tokens", 12, "--temperature", 0.8,
                "--top-k", 20, "--seed", 3)
    assert proc.returncode == 0, proc.stderr
    header, text = proc.stdout.split("\n\n", 1)
    assert "sim://alveo-u55c" in header and text.startswith("def f(x):\n")
    for label in ("[measured]", "[modelled: cycle model", "[modelled: link model"):
        assert label in proc.stdout


@pytest.mark.parametrize("args, message", [
    (["generate", "--device", "bogus://x", "--prompt", "a"], "unknown scheme"),
    (["generate", "--device", "rtl://alveo-v80", "--prompt", "a"], "unknown engine preset"),
    (["generate", "--target", "/no/such", "--draft", "/no/such", "--prompt", "a"], "not a Hugging Face model"),
    (["generate", "--target", "models/demo-target", "--prompt", "a"], "give both --draft and --target"),
    (["generate", "--prompt", "a", "--trace", "/no/such/dir/t.json"], "does not exist"),
])
def test_generate_bad_arguments(args, message):
    assert message in error_line(dfvg(*args))


# -- calibration without the draft's own tokenizer -------------------------------------
def _weights_without_tokenizer(path):
    """The demo draft's config and weights alone, as a checkpoint shipped without tokenizer."""
    import shutil
    from dfvg_host.demo import DEMO_DRAFT
    path.mkdir()
    for name in ("config.json", "model.safetensors"):
        shutil.copy(DEMO_DRAFT / name, path / name)
    return path


def test_draft_without_tokenizer_says_what_to_pass(tiny_draft_dir, tmp_path):
    line = error_line(dfvg("compile", "--draft", tiny_draft_dir, "--preset", "tiny", "-o", tmp_path / "o"))
    assert "has no tokenizer files" in line
    for option in ("--tokenizer DIR", "--calibration-tokens FILE", "--random-weights"):
        assert option in line


def test_calibration_token_file(tiny_draft_dir, tmp_path):
    (tmp_path / "ids.txt").write_text(" ".join(str(i * 7 % 256) for i in range(300)))
    proc = dfvg("compile", "--draft", tiny_draft_dir, "--preset", "tiny", "-o", tmp_path / "o",
                "--calibration-tokens", tmp_path / "ids.txt")
    assert proc.returncode == 0, proc.stderr
    calibration = json.loads((tmp_path / "o" / "manifest.json").read_text())["calibration"]
    assert calibration == {"tokens": 300, "source": "tokens"}


@pytest.mark.parametrize("content, message", [
    ("1 2 x", "is not a calibration token file"),
    ("5", "calibration needs at least 2 tokens"),
    ("1 2 256", "calibration token id 256 from the calibration token file is outside the draft's "
                "vocabulary of 256"),
])
def test_bad_calibration_token_file(tiny_draft_dir, tmp_path, content, message):
    (tmp_path / "ids.txt").write_text(content)
    assert message in error_line(dfvg("compile", "--draft", tiny_draft_dir, "--preset", "tiny", "-o",
                                      tmp_path / "o", "--calibration-tokens", tmp_path / "ids.txt"))


def test_tokenizer_of_another_model_is_refused(tiny_draft_dir, tmp_path):
    """The demo tokenizer's ids run past the tiny draft's 256-entry vocabulary."""
    from dfvg_host.demo import DEMO_DRAFT
    line = error_line(dfvg("compile", "--draft", tiny_draft_dir, "--preset", "tiny", "-o", tmp_path / "o",
                           "--tokenizer", DEMO_DRAFT))
    assert "outside the draft's vocabulary of 256" in line and "does not belong to this draft" in line


def test_tokenizer_from_another_directory(tmp_path):
    from dfvg_host.demo import DEMO_DRAFT
    draft = _weights_without_tokenizer(tmp_path / "draft")
    proc = dfvg("compile", "--draft", draft, "-o", tmp_path / "o", "--tokenizer", DEMO_DRAFT)
    assert proc.returncode == 0, proc.stderr
    assert json.loads((tmp_path / "o" / "manifest.json").read_text())["calibration"]["source"] == "text"


def test_generate_calibrates_a_tokenizerless_draft_with_the_targets_tokenizer(tmp_path):
    from dfvg_host.demo import DEMO_TARGET
    draft = _weights_without_tokenizer(tmp_path / "draft")
    proc = dfvg("generate", "--draft", draft, "--target", DEMO_TARGET, "--prompt", "import os\n",
                "--max-new-tokens", 4, "--json")
    assert proc.returncode == 0, proc.stderr
    assert len(json.loads(proc.stdout)["token_ids"]) == 4
