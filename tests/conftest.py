"""Shared fixtures: tiny Llama drafts built in seconds, compiled by the real compiler."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from dfvg_hw.spec.config import get_preset

# The test models are tiny: one thread beats two threads spinning on the 2-core CI machine.
torch.set_num_threads(1)


def make_tiny_llama(path: Path, *, hidden=32, layers=2, heads=2, kv_heads=2, intermediate=64,
                    vocab=256, seed=0, tie=False, weight_scale=6.0, eos=1) -> Path:
    """Save a randomly initialised Llama that fits the ``tiny`` preset."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                      num_key_value_heads=kv_heads, intermediate_size=intermediate,
                      vocab_size=vocab, max_position_embeddings=128, tie_word_embeddings=tie,
                      bos_token_id=0, eos_token_id=eos, pad_token_id=2)
    model = LlamaForCausalLM(cfg)
    # Random init gives near-uniform logits; larger weights make argmax decisions clear,
    # as in a trained model.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2:
                p.mul_(weight_scale)
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def tiny_engine():
    return get_preset("tiny")


@pytest.fixture(scope="session")
def tiny_draft_dir(tmp_path_factory) -> Path:
    return make_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def tiny_gqa_dir(tmp_path_factory) -> Path:
    return make_tiny_llama(tmp_path_factory.mktemp("tiny-gqa"), hidden=64, heads=4, kv_heads=2,
                           intermediate=96, tie=True, seed=1)


@pytest.fixture(scope="session")
def tiny_compiled(tiny_draft_dir, tiny_engine):
    from dfvg_host.compiler import compile_draft
    return compile_draft(tiny_draft_dir, tiny_engine)


@pytest.fixture(scope="session")
def demo_pair():
    """(draft dir, target dir, data dir) of the shipped demo pair."""
    from dfvg_host.demo import DEMO_DATA, demo_paths
    draft, target = demo_paths()
    return draft, target, DEMO_DATA


@pytest.fixture(scope="session")
def demo_compiled(demo_pair):
    """The demo draft compiled for alveo-u55c by the real compiler."""
    from dfvg_host.compiler import compile_draft
    draft, _, data = demo_pair
    return compile_draft(draft, get_preset("alveo-u55c"),
                         calibration_text=(data / "calibration.txt").read_text())


def pytest_addoption(parser):
    parser.addoption("--vcd", metavar="DIR", help="write a VCD waveform of every RTL simulation into DIR")


def pytest_configure(config):
    import os
    if config.getoption("--vcd"):
        os.environ["DFVG_VCD"] = config.getoption("--vcd")
