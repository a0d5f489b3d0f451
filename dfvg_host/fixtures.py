"""Small inputs shared by the tests and the benchmarks, so neither reaches into the other.

* :func:`make_tiny_llama` — a randomly initialised Llama (or Qwen2, Qwen3, OPT: ``family``) that fits the ``tiny`` preset,
  built and saved in seconds (torch and transformers are imported when it is called);
* :func:`tiny_image` and :data:`TINY_FORWARD` — a register-level image and program for the
  ``tiny`` engine (one embed / up / down / logits / sample forward), what
  ``tests/test_rtl_device.py`` and ``benchmarks/rtl_sim_speed.py`` run on every device.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from dfvg_hw.spec.config import get_preset
from dfvg_hw.spec.image import pack_norm_params, pack_qparams, padded, tile_weights

__all__ = ["make_tiny_llama", "TINY_FAMILY_SHAPES", "TINY", "TINY_EMBED", "TINY_WEIGHTS", "tiny_image", "TINY_FORWARD"]


def make_tiny_llama(path: Path, *, hidden=32, layers=2, heads=2, kv_heads=2, intermediate=64,
                    vocab=256, seed=0, tie=False, weight_scale=6.0, eos=1, family="llama",
                    head_dim=None, bias_scale=1.0) -> Path:
    """Save a randomly initialised causal LM of ``family`` (llama, qwen2, qwen3 or opt) that
    fits the ``tiny`` preset. Biases are drawn at ``bias_scale`` (an initialised model has
    zero biases, which would not exercise them); norm gains (Qwen3's QK-norm, OPT's
    LayerNorms) around 1."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig, OPTConfig, Qwen2Config, Qwen3Config

    torch.manual_seed(seed)
    common = dict(hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                  num_key_value_heads=kv_heads, intermediate_size=intermediate,
                  vocab_size=vocab, max_position_embeddings=128, tie_word_embeddings=tie,
                  bos_token_id=0, eos_token_id=eos, pad_token_id=2)
    if head_dim is not None:
        common["head_dim"] = head_dim
    if family == "opt":
        common = dict(hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                      ffn_dim=intermediate, vocab_size=vocab, max_position_embeddings=128,
                      word_embed_proj_dim=hidden, tie_word_embeddings=tie, bos_token_id=0,
                      eos_token_id=eos, pad_token_id=2)
    config = {"llama": LlamaConfig, "qwen2": Qwen2Config, "qwen3": Qwen3Config,
              "opt": OPTConfig}[family](**common)
    model = AutoModelForCausalLM.from_config(config)
    # Random init gives near-uniform logits; larger weights make argmax decisions clear,
    # as in a trained model.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2:
                p.mul_(weight_scale)
            elif name.endswith(".bias"):
                p.copy_(torch.randn_like(p) * bias_scale)
            elif name.endswith(("q_norm.weight", "k_norm.weight", "layer_norm.weight")):
                p.copy_(1.0 + 0.5 * torch.randn_like(p))
    model.save_pretrained(path)
    return path


#: A shape of each family beyond Llama that fits ``tiny`` (:func:`make_tiny_llama` keyword
#: arguments): Qwen2 with GQA, Qwen3 with heads × head_dim (64) twice hidden, as Qwen3-0.6B.
TINY_FAMILY_SHAPES = {
    "qwen2": dict(family="qwen2", hidden=64, heads=4, kv_heads=2, intermediate=96, tie=True),
    "qwen3": dict(family="qwen3", hidden=32, heads=4, kv_heads=2, head_dim=16, intermediate=64, tie=True),
    "opt": dict(family="opt", hidden=32, heads=2, intermediate=64, tie=True),
}

TINY = get_preset("tiny")
#: elements per embedding row of :func:`tiny_image` (int32: 64 bytes, four VMEM lines)
TINY_EMBED = 16
_TABLE_BYTES = TINY.vocab_max * 4 * TINY_EMBED
#: weight blocks of :func:`tiny_image`: name → (offset, n, k, typical shift)
TINY_WEIGHTS = {"logits": (_TABLE_BYTES, 40, 16, 27), "up": (_TABLE_BYTES + 0x1000, 24, 16, 27),
                "down": (_TABLE_BYTES + 0x2000, 16, 24, 13)}
#: the RMSNORM parameter block of :func:`tiny_image` (n = TINY_EMBED)
TINY_NORM = _TABLE_BYTES + 0x3000


def tiny_image() -> bytes:
    """A small image: an embedding table of TINY.vocab_max int32 rows at offset 0, the
    weight blocks of TINY_WEIGHTS (tiles, then per-channel requant words) and an RMSNORM
    block at TINY_NORM, as the compiler lays them out."""
    rng = np.random.default_rng(0)
    data = bytearray(TINY_NORM + 0x100)
    # rows of every magnitude, so that RMSNORM's row shift takes many values
    bits = rng.integers(0, 31, (TINY.vocab_max, 1))
    table = (rng.integers(-(1 << 30), 1 << 30, (TINY.vocab_max, TINY_EMBED)) >> (30 - bits))
    data[:_TABLE_BYTES] = table.astype("<i4").tobytes()
    for offset, n, k, shift in TINY_WEIGHTS.values():
        w = rng.integers(-128, 128, (n, k)).astype(np.int8)
        tiles = tile_weights(w, TINY.lanes, TINY.reduce).tobytes()
        mult = rng.integers(1 << 14, 1 << 16, n)
        shifts = np.clip(shift + rng.integers(-2, 3, n), 0, 63)
        words = pack_qparams(mult, shifts, padded(n, TINY.lanes)).tobytes()
        data[offset:offset + len(tiles) + len(words)] = tiles + words
    norm = pack_norm_params(1000, rng.integers(8000, 32768, TINY_EMBED), 2)
    data[TINY_NORM:TINY_NORM + len(norm)] = norm
    return bytes(data)


def _tiny_addr(name: str) -> str:
    return hex(TINY_WEIGHTS[name][0])


#: A forward over :func:`tiny_image`: embed the token (an int32 residual row at line 0),
#: normalise it (wide), up-project (INT8 out), down-project as a residual update (RESADD),
#: normalise again, logits; sample while the draft loop wants.
TINY_FORWARD = f"""
    embed rows=1, dst=0, n=16, addr=0
    rmsnorm rows=1, dst=4, src=0, n=16, addr={hex(TINY_NORM)}, wide
    matmul rows=1, dst=8, src=4, n=24, k=16, addr={_tiny_addr("up")}, mode=int8, wide
    matmul rows=1, dst=0, src=8, n=16, k=24, addr={_tiny_addr("down")}, mode=resadd
    rmsnorm rows=1, dst=4, src=0, n=16, addr={hex(TINY_NORM)}, wide
    matmul rows=1, dst=0, src=4, n=40, k=16, addr={_tiny_addr("logits")}, mode=logits, wide
    branch cond=no_sample, n=8
    sample n=40
    next n=0
    halt"""
