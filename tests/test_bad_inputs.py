"""The CLI on a corpus of bad inputs: every one is a one-line ``dfvg: error:`` with exit
code 2 that says what is wrong, found before any slow work where it can be.

The cases run ``dfvg_host.cli.main`` in this process, so an exception that escapes it — a
traceback for a user — fails the test. Cases marked ``before_slow_work`` run with the
draft compiler, the target loader and the RTL devices replaced by functions that fail
the test: their error must come from the argument and input checks alone.
"""

from __future__ import annotations

import io
import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import pytest

from conftest import make_tiny_llama
from dfvg_host.cli import main
from dfvg_host.demo import DEMO_DRAFT, DEMO_TARGET

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def _copy(src: Path, dst: Path, names=None) -> Path:
    dst.mkdir(parents=True)
    for f in src.iterdir():
        if names is None or f.name in names:
            shutil.copy(f, dst / f.name)
    return dst


def _other_tokenizer_target(path: Path) -> Path:
    """A GPT-2 of random weights with a byte-level BPE tokenizer trained here: another
    vocabulary, other special tokens."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import GPT2Config, GPT2LMHeadModel, PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel()
    bpe.train_from_iterator([(DEMO_DRAFT.parent / "demo-data" / "heldout.txt").read_text()[:20000]],
                            trainers.BpeTrainer(vocab_size=400, special_tokens=["<|endoftext|>"]))
    tok = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<|endoftext|>",
                                  bos_token="<|endoftext|>")
    torch.manual_seed(0)
    GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=len(tok),
                               n_positions=256)).save_pretrained(path)
    tok.save_pretrained(path)
    return path


def _bert_target(path: Path) -> Path:
    """A masked LM (BERT) with the demo tokenizer: not a causal LM."""
    from transformers import BertConfig, BertForMaskedLM
    BertForMaskedLM(BertConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                               intermediate_size=64, vocab_size=4096)).save_pretrained(path)
    for name in TOKENIZER_FILES:
        shutil.copy(DEMO_TARGET / name, path / name)
    return path


@pytest.fixture(scope="module")
def corpus(tmp_path_factory, tiny_compiled) -> dict[str, Path]:
    """Broken and mismatched inputs, built once."""
    root = tmp_path_factory.mktemp("bad-inputs")
    paths = {}
    trunc = paths["truncated_draft"] = _copy(DEMO_DRAFT, root / "truncated-draft")
    weights = trunc / "model.safetensors"
    os.truncate(weights, weights.stat().st_size // 2)
    small = paths["small_vocab_draft"] = make_tiny_llama(root / "small-vocab-draft")
    for name in TOKENIZER_FILES:
        shutil.copy(DEMO_DRAFT / name, small / name)
    paths["no_tokenizer_draft"] = _copy(DEMO_DRAFT, root / "no-tokenizer", ("config.json", "model.safetensors"))
    paths["no_tokenizer_target"] = _copy(DEMO_TARGET, root / "no-tokenizer-target",
                                         ("config.json", "model.safetensors"))
    broken = paths["broken_config_target"] = _copy(DEMO_TARGET, root / "broken-config")
    (broken / "config.json").write_text('{"model_type": "llama", "hidden_size": ')
    paths["gpt2_target"] = _other_tokenizer_target(root / "gpt2")
    paths["bert_target"] = _bert_target(root / "bert")
    good = paths["compiled"] = tiny_compiled.save(root / "compiled")
    for name, damage in {
        "manifest_not_json": lambda d: (d / "manifest.json").write_text("{not json"),
        "manifest_without_context_limit": lambda d: (d / "manifest.json").write_text(json.dumps(
            {k: v for k, v in json.loads((d / "manifest.json").read_text()).items() if k != "context_limit"})),
        "program_truncated": lambda d: (d / "program.bin").write_bytes((d / "program.bin").read_bytes()[:-7]),
        "image_empty": lambda d: (d / "image.bin").write_bytes(b""),
        "image_corrupt": lambda d: (d / "image.bin").write_bytes(bytes(len((d / "image.bin").read_bytes()))),
    }.items():
        paths[name] = shutil.copytree(good, root / name)
        damage(paths[name])
    (root / "latin1.txt").write_bytes("caf\xe9 au lait\n".encode("latin-1") * 20)
    paths["latin1"] = root / "latin1.txt"
    return paths


@dataclass
class Case:
    """One bad invocation: the argument list (``{name}`` placeholders are corpus paths),
    what standard input holds, and a fragment of the expected error line."""
    argv: list[str]
    message: str
    stdin: bytes = b""
    before_slow_work: bool = True
    setup: Callable | None = None


def _no_cuda(monkeypatch):
    import torch
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)


GEN = ["generate", "--prompt", "def f(x):\n"]
ON_TINY = ["--target", str(DEMO_TARGET), "--device", "sim://tiny"]

CASES = {
    # the model files
    "compile_truncated_weights": Case(["compile", "--draft", "{truncated_draft}", "-o", "{out}"],
                                      "damaged or incomplete", before_slow_work=False),
    "generate_truncated_weights": Case([*GEN, "--draft", "{truncated_draft}", "--target", str(DEMO_TARGET)],
                                       "damaged or incomplete", before_slow_work=False),
    "compile_vocab_smaller_than_tokenizer": Case(["compile", "--draft", "{small_vocab_draft}", "--preset",
                                                  "tiny", "-o", "{out}"], "outside the draft's vocabulary",
                                                 before_slow_work=False),
    "generate_vocab_smaller_than_tokenizer": Case(
        [*GEN, "--draft", "{small_vocab_draft}", *ON_TINY],
        "produces ids up to 4095, but the draft has a vocabulary of 256"),
    "draft_vocab_smaller_than_tokenizer": Case(
        ["draft", "--draft", "{small_vocab_draft}", "--device", "sim://tiny", "--max-new-tokens", "4"],
        "past the draft's vocabulary of 256"),
    "draft_without_tokenizer": Case(["draft", "--draft", "{no_tokenizer_draft}"], "has no tokenizer files"),
    "target_without_tokenizer": Case([*GEN, "--draft", str(DEMO_DRAFT), "--target", "{no_tokenizer_target}"],
                                     "has no tokenizer files"),
    "target_config_not_json": Case([*GEN, "--draft", str(DEMO_DRAFT), "--target", "{broken_config_target}"],
                                   "cannot read config.json"),
    "model_too_big_for_the_preset": Case([*GEN, "--draft", str(DEMO_DRAFT), *ON_TINY], "exceeds"),
    # the pair
    "target_with_another_tokenizer": Case([*GEN, "--draft", str(DEMO_DRAFT), "--target", "{gpt2_target}"],
                                          "is not the target's"),
    "target_not_a_causal_lm": Case([*GEN, "--draft", str(DEMO_DRAFT), "--target", "{bert_target}"],
                                   "BertForMaskedLM, not a causal language model"),
    # the compile output
    "manifest_not_json": Case([*GEN, "--draft", "{manifest_not_json}", *ON_TINY], "is not valid JSON"),
    "manifest_without_a_key": Case([*GEN, "--draft", "{manifest_without_context_limit}", *ON_TINY],
                                   "lacks context_limit"),
    "program_truncated": Case([*GEN, "--draft", "{program_truncated}", *ON_TINY],
                              "the file is truncated"),
    "image_empty": Case([*GEN, "--draft", "{image_empty}", *ON_TINY], "image.bin has 0 bytes"),
    "image_corrupt": Case([*GEN, "--draft", "{image_corrupt}", *ON_TINY], "does not match the SHA-256"),
    "compiled_for_another_preset": Case([*GEN, "--draft", "{compiled}", "--target", str(DEMO_TARGET)],
                                        "was compiled for preset 'tiny'"),
    # the text
    "stdin_not_utf8": Case(["generate"], "standard input is not UTF-8", stdin=b"caf\xe9\n"),
    "empty_prompt": Case(["generate"], "empty prompt"),
    "prompt_past_the_context_limit": Case(["generate"], "the draft's context limit is",
                                          stdin=b"x = [1, 2, 3]\n" * 200),
    "accuracy_text_not_utf8": Case(["accuracy", "--text", "{latin1}"], "is not UTF-8 text"),
    "calibration_not_utf8": Case(["compile", "--draft", str(DEMO_DRAFT), "--calibration", "{latin1}",
                                  "-o", "{out}"], "is not UTF-8 text"),
    # the options
    "verifier_device_cuda_without_cuda": Case([*GEN, "--verifier-device", "cuda"], "no CUDA device",
                                              setup=_no_cuda),
    "verifier_device_unknown": Case([*GEN, "--verifier-device", "banana"], "is not a torch device"),
    "dtype_unknown": Case([*GEN, "--dtype", "int3"], "unknown dtype 'int3'"),
    "draft_gamma_past_the_engine": Case(["draft", "--gamma", "100"], "at most 64"),
    "generate_gamma_past_the_engine": Case([*GEN, "--gamma", "65"], "at most 64"),
    "gamma_zero": Case([*GEN, "--gamma", "0"], "--gamma must be at least 1"),
    "negative_temperature": Case([*GEN, "--temperature", "-1"], "must be >= 0"),
    "unknown_device_scheme": Case([*GEN, "--device", "pcie://0"], "unknown scheme"),
    "rtl_device_of_a_card_preset": Case([*GEN, "--device", "rtl+verilator://alveo-u55c-1ch"],
                                        "rtl+verilator://alveo-u55c-1ch?large=1 to simulate it anyway"),
    "rtl_device_option_unknown": Case([*GEN, "--device", "rtl://tiny?fast=1"], "unknown option 'fast'"),
    # the server
    "serve_port_out_of_range": Case(["serve", "--port", "70000"], "a TCP port is 0..65535"),
    "serve_max_num_seqs_zero": Case(["serve", "--max-num-seqs", "0"], "--max-num-seqs must be at least 1"),
    "serve_tensor_parallel_outside_torchrun": Case(["serve", "--tensor-parallel"],
                                                   "shards the target over the processes of torchrun"),
    "serve_device_map_and_a_device": Case(["serve", "--device-map", "auto", "--verifier-device", "cpu"],
                                          "not both"),
    "serve_chat_template_not_utf8": Case(["serve", "--chat-template", "{latin1}"], "is not UTF-8 text"),
    "serve_target_without_tokenizer": Case(["serve", "--draft", str(DEMO_DRAFT), "--target",
                                            "{no_tokenizer_target}"], "has no tokenizer files"),
    "serve_target_only_with_a_draft": Case(["serve", "--target-only", "--draft", str(DEMO_DRAFT)],
                                           "drop --draft"),
    "bench_serve_concurrency_not_numbers": Case(["bench-serve", "--concurrency", "1,x"],
                                                "positive integers separated by commas"),
    "unknown_preset": Case(["compile", "--draft", str(DEMO_DRAFT), "--preset", "v80", "-o", "{out}"],
                           "unknown engine preset 'v80'"),
}


def _fail_if_called(what):
    def fail(*args, **kwargs):
        raise AssertionError(f"{what} ran before the bad input was reported")
    return fail


@pytest.mark.parametrize("name", CASES)
def test_bad_input_is_one_line_and_exit_2(name, corpus, tmp_path, monkeypatch, capsys):
    case = CASES[name]
    argv = [a.format(out=tmp_path / "out", **corpus) for a in case.argv]
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setattr("sys.stdin", io.TextIOWrapper(io.BytesIO(case.stdin)))
    if case.before_slow_work:
        monkeypatch.setattr("dfvg_host.demo.compile_cached", _fail_if_called("the draft compiler"))
        monkeypatch.setattr("dfvg_host.compiler.compile_draft", _fail_if_called("the draft compiler"))
        monkeypatch.setattr("dfvg_host.verifier.Verifier.from_pretrained", _fail_if_called("the target load"))
        monkeypatch.setattr("dfvg_host.batch_verifier.BatchVerifier.from_pretrained",
                            _fail_if_called("the target load"))
        monkeypatch.setattr("sim.verilator_device.VerilatorDevice", _fail_if_called("the Verilator build"))
        monkeypatch.setattr("sim.rtl_device.RtlDevice", _fail_if_called("the RTL simulator"))
    if case.setup:
        case.setup(monkeypatch)
    try:
        code = main(argv)
    except SystemExit as exc:                    # argparse's own errors
        code = exc.code
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if "error:" in line]
    assert code == 2, err
    assert len(lines) == 1 and case.message in lines[0], err
    assert "Traceback" not in err
