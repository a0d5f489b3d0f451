"""scripts/fake_quant_study.py: its rounding helpers keep their error bounds, and the study
runs end to end on the shipped demo draft with figures that only hold if the formats are
applied as documented."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent


def _load_study():
    spec = importlib.util.spec_from_file_location("fake_quant_study", ROOT / "scripts/fake_quant_study.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module        # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


study = _load_study()


@pytest.mark.parametrize("block", [None, 32, 64, 100])
def test_weights_round_within_half_a_step_of_their_own_scale(block):
    torch.manual_seed(0)
    w = torch.randn(48, 200) * torch.logspace(-3, 1, 200)      # columns of very different size
    q = study.quantise_weight(w, block)
    step = w.abs().amax(1, keepdim=True) / 127
    if block is not None:
        k = w.shape[1]
        pad = -(-k // block) * block - k
        blocks = torch.nn.functional.pad(w.abs(), (0, pad)).reshape(48, -1, block)
        step = (blocks.amax(2, keepdim=True) / 127).expand(-1, -1, block).reshape(48, -1)[:, :k]
    assert torch.all((w - q).abs() <= step / 2 + 1e-7)
    # at most 255 distinct values in each row (block): an 8-bit grid
    assert len(torch.unique(q[0, : block or 200])) <= 255


def test_blocks_cut_the_error_of_rows_with_uneven_columns():
    w = torch.randn(16, 256) * torch.logspace(-2, 2, 256)
    row_err = (w - study.quantise_weight(w, None)).abs().mean()
    block_err = (w - study.quantise_weight(w, 32)).abs().mean()
    assert block_err < row_err / 2


def test_pow2_scale_fits_the_row_without_clipping():
    x = torch.tensor([[0.5, -3.0, 2.0], [1e-3, 0.0, -7e-4]])
    s = study.pow2_scale(x, 16)
    assert torch.all(torch.log2(s) == torch.round(torch.log2(s)))
    assert torch.all(x.abs().amax(-1, keepdim=True) / s <= 32767)
    assert torch.all(x.abs().amax(-1, keepdim=True) / s > 32767 / 2)


def test_study_runs_on_the_demo_draft(capsys):
    torch.set_num_threads(1)
    demo = ROOT / "models/demo-draft"
    s = study.Study(demo, (ROOT / "models/demo-data/heldout.txt").read_text(),
                    (ROOT / "models/demo-data/calibration.txt").read_text(), 256)
    by_name = {scheme.name: s.run(scheme) for scheme in study.SCHEMES}
    # int8 weights of a 1M-parameter draft, activations float: nearly every token kept
    assert by_name["int8 W per 32-block, float activations"][0] > 0.95
    # static int8 inputs lose far more than per-token int16 ones (the table's point)
    assert by_name["float W, inputs int8 static"][1] < by_name["int8 W per 32-block, inputs int16 pow2 per token"][1]
    # a per-input row applies its power of two: h's alone already differs from all static
    static = by_name["int8 W per 32-block, inputs int16 static"]
    assert by_name["int8 W per 32-block, h pow2, others static"] != static
    for agree, mean_cos, min_cos in by_name.values():
        assert 0 <= agree <= 1 and -1 <= min_cos <= mean_cos <= 1
