"""Tensor parallelism on cpu: two torchrun ranks on gloo decode as the target alone."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dfvg_host.batch_verifier import BatchVerifier
from dfvg_host.compiler import load_model
from dfvg_host.tensor_parallel import greedy_decode, lookup_drafts, main, single_process_tokens

ROOT = Path(__file__).resolve().parents[1]
TARGET = ROOT / "models" / "demo-target"
TORCHRUN = Path(sys.executable).parent / "torchrun"


def test_lookup_drafts_copy_what_followed_the_last_token():
    assert lookup_drafts([5, 6, 7, 8, 5], 2) == [6, 7]
    assert lookup_drafts([5, 6, 5, 9, 5], 3) == [9, 5]       # the latest earlier occurrence
    assert lookup_drafts([1, 2, 3], 4) == []
    assert lookup_drafts([4, 4], 0) == []


def test_greedy_decode_equals_generate_in_one_process():
    """The decoding loop the torchrun check runs, on one process: the target alone's tokens,
    with fewer forward passes than tokens (prompt-lookup drafts were accepted)."""
    prompts = [[0, 5, 6, 7, 8], [0], [0, 300, 301, 302]]
    bv = BatchVerifier(load_model(TARGET), torch.device("cpu"))
    got = greedy_decode(bv, prompts, 20, gamma=3, eos=1)
    assert got == single_process_tokens(TARGET, prompts, 20, None)
    assert bv.forwards - 2 < max(len(g) for g in got)       # two prefills, then fewer rounds than tokens


def test_outside_torchrun_it_says_how_to_run_it(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(SystemExit, match="run it under torchrun"):
        main(["--target", str(TARGET), "--device", "cpu"])


@pytest.mark.skipif(not TORCHRUN.exists(), reason="torchrun is not installed next to this Python")
def test_two_ranks_on_gloo_decode_as_the_single_process_model():
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    run = subprocess.run([str(TORCHRUN), "--standalone", "--nproc-per-node", "2", "-m", "dfvg_host.tensor_parallel",
                          "--target", str(TARGET), "--device", "cpu", "--max-new-tokens", "16"],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=180)
    assert run.returncode == 0, run.stdout + run.stderr[-4000:]
    assert "tensor parallel: 2 ranks (gloo, cpu), tp_size 2, 4 prompts x 16 tokens" in run.stdout
    assert "identical to the single-process model" in run.stdout
