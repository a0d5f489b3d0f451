"""Small inputs shared by the tests and the benchmarks, so neither reaches into the other.

* :func:`make_tiny_llama` — a randomly initialised Llama that fits the ``tiny`` preset,
  built and saved in seconds (torch and transformers are imported when it is called);
* :func:`tiny_image` and :data:`TINY_FORWARD` — a register-level image and program for the
  ``tiny`` engine (one embed / up / down / logits / sample forward), what
  ``tests/test_rtl_device.py`` and ``benchmarks/rtl_sim_speed.py`` run on every device.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from dfvg_hw.spec.config import get_preset
from dfvg_hw.spec.image import pack_qparams, padded, tile_weights

__all__ = ["make_tiny_llama", "TINY", "TINY_EMBED", "TINY_WEIGHTS", "tiny_image", "TINY_FORWARD"]


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


TINY = get_preset("tiny")
#: elements per embedding row of :func:`tiny_image` (32 bytes: two VMEM lines)
TINY_EMBED = 16
#: weight blocks of :func:`tiny_image`: name → (offset, n, k, typical shift)
TINY_WEIGHTS = {"logits": (0x4000, 40, 16, 27), "up": (0x5000, 24, 16, 27), "down": (0x6000, 16, 24, 13)}


def tiny_image() -> bytes:
    """A small image: an embedding table of TINY.vocab_max int16 rows at offset 0, and the
    weight blocks of TINY_WEIGHTS (tiles, then per-channel requant words), as the compiler
    lays them out."""
    rng = np.random.default_rng(0)
    data = bytearray(0x7000)
    table = rng.integers(-32768, 32768, (TINY.vocab_max, TINY_EMBED)).astype("<i2").tobytes()
    data[:len(table)] = table
    for offset, n, k, shift in TINY_WEIGHTS.values():
        w = rng.integers(-128, 128, (n, k)).astype(np.int8)
        tiles = tile_weights(w, TINY.lanes, TINY.reduce).tobytes()
        mult = rng.integers(1 << 14, 1 << 16, n)
        shifts = np.clip(shift + rng.integers(-2, 3, n), 0, 63)
        words = pack_qparams(mult, shifts, padded(n, TINY.lanes)).tobytes()
        data[offset:offset + len(tiles) + len(words)] = tiles + words
    return bytes(data)


#: A forward over :func:`tiny_image`: embed the token (int16), up-project (INT8 out),
#: down-project as a residual update (RESADD), logits from the residual (wide input),
#: sample while the draft loop wants.
TINY_FORWARD = """
    embed rows=1, dst=0, n=16, addr=0
    matmul rows=1, dst=8, src=0, n=24, k=16, addr=0x5000, mode=int8, wide
    matmul rows=1, dst=0, src=8, n=16, k=24, addr=0x6000, mode=resadd
    matmul rows=1, dst=0, src=0, n=40, k=16, addr=0x4000, mode=logits, wide
    branch cond=no_sample, n=6
    sample n=40
    next n=0
    halt"""
