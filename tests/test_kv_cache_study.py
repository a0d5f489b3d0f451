"""scripts/kv_cache_study.py: its rounding keeps its bounds, and on a small Llama the study
leaves the float model alone at ``float`` and orders the KV formats as their bits say."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent


def _load_study():
    spec = importlib.util.spec_from_file_location("kv_cache_study", ROOT / "scripts/kv_cache_study.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


study = _load_study()


@pytest.mark.parametrize("bits", [4, 8, 12])
def test_static_and_row_formats_round_within_half_a_step(bits):
    torch.manual_seed(0)
    t = torch.randn(3, 5, 64) * torch.logspace(-2, 0, 5)[None, :, None]   # rows of very different size
    absmax = float(t.abs().max())
    limit = 2 ** (bits - 1) - 1
    static = study.quantise_static(t, absmax, bits)
    assert torch.all((t - static).abs() <= absmax / limit / 2 + 1e-7)
    assert len(torch.unique(static)) <= 2 * limit + 1
    rows = study.quantise_row_pow2(t, absmax, bits)
    # each row's step: a power of two times the 16-bit step, fine enough for its own maximum
    row_max = t.abs().amax(-1, keepdim=True)
    base = absmax / 32767
    step = base * 2 ** torch.clamp(torch.ceil(torch.log2(row_max / (limit * base))), min=0)
    assert torch.all((t - rows).abs() <= step / 2 + 1e-7)
    # a small row keeps more of its precision than the one static scale gives it
    small = (row_max < absmax / 8).expand_as(t)
    assert (t - rows)[small].abs().max() < (t - static)[small].abs().max()


def test_unknown_format_is_refused():
    with pytest.raises(ValueError, match="unknown KV format 'x8'"):
        study.kv_format("x8")


def test_the_study_orders_formats_by_their_bits(tmp_path):
    """float/float reproduces the float model; 4-bit K and V follow it less closely than
    12-bit ones, and the rounding of a 12-bit cache is within a hair of float."""
    from dfvg_host.compiler import load_model
    from dfvg_host.fixtures import make_tiny_llama

    path = make_tiny_llama(tmp_path / "m", hidden=64, layers=2, heads=4, kv_heads=2, intermediate=128,
                           vocab=256, seed=3)
    model = load_model(path)
    rng = np.random.default_rng(0)
    kv = study.KvStudy(model, alpha=0.5, query_bits=16)
    try:
        kv.calibrate([rng.integers(3, 256, 64).tolist() for _ in range(4)])
        held_out = [rng.integers(3, 256, 48).tolist() for _ in range(3)]
        exact = kv.agreement(held_out, "float", "float")
        twelve = kv.agreement(held_out, "s12", "s12")
        four = kv.agreement(held_out, "s4", "s4")
        token = kv.agreement(held_out, "t4", "t4")
    finally:
        kv.close()
    assert exact[0] >= 0.99 and exact[2] > 0.9999
    assert twelve[1] > 0.9999 and twelve[1] > four[1] and twelve[0] >= four[0]
    assert four[1] < 0.9999 and token[1] < twelve[1]
