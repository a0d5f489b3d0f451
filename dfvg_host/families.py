"""The model families the compiler lowers: what the engine runs for each, and where each
family keeps the parts of its decoder (module paths, which are also state-dict keys).

Every supported family compiles to the same program shape: an embedding, a layer loop of
norm → attention → residual add → norm → MLP → residual add, a final norm and the LM
head. What differs is named here and handled by the compiler:

* Llama, Qwen2 and Qwen3 use RMSNorm; Qwen2 has q/k/v biases (MATMUL ``BIAS``), Qwen3
  normalises q and k per head (MATMUL ``INT32`` and RMSNORM segments).
* OPT uses LayerNorm, which the engine runs as RMSNorm: every write into the residual
  stream (the embeddings, ``out_proj``, ``fc2``) is centred over the channels offline, so
  the stream's mean is 0 and LayerNorm's mean subtraction has nothing to do; LayerNorm's
  bias is folded into the next linear layer's bias (SliceGPT's observation). Its MLP has
  no gate (ACTMUL ``UNGATED``) and its positions are a learned table (EMBED ``POSITION``
  into a row that an identity MATMUL adds to the residual).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

__all__ = ["FAMILIES", "NOT_YET", "FamilyLayout", "layout_of"]

#: What the engine runs of each model family it compiles (``dfvg families`` lists these).
FAMILIES = {
    "llama": "RMSNorm, RoPE, GQA, a gated MLP with any activation, optional biases on any "
             "linear layer (attention_bias, mlp_bias), tied or separate lm_head",
    "qwen2": "as llama, with the biases of q, k and v (Qwen2, Qwen2.5); full attention only",
    "qwen3": "as llama, with QK-norm (RMSNorm of q and k per head before RoPE) and heads × "
             "head_dim other than hidden (Qwen3); full attention only",
    "opt": "pre-norm OPT: LayerNorm (run as RMSNorm over a centred residual stream), biases "
           "on every linear layer, an ungated ReLU MLP, learned position embeddings; not "
           "post-norm (do_layer_norm_before=False) nor an embedding projection (OPT-350M)",
}
#: Families the engine does not run yet, and what they need that it lacks.
NOT_YET = {
    "gpt2": "fused Conv1D projections (c_attn) and GPT-2's weight layout; its LayerNorm, GELU "
            "MLP and learned positions are OPT's",
}


@dataclass(frozen=True)
class FamilyLayout:
    """Where a family keeps its parts: module paths from the causal LM (state-dict keys
    are these plus ``.weight``/``.bias``); a layer's parts are relative to the layer.

    Members
    -------
    layers, embed, final_norm : str
        The layer list, the token embedding, the norm before the LM head.
    positions : str or None
        A learned position table (OPT), with ``position_offset`` rows before position 0.
    norm1, norm2 : str
        The norms before attention and before the MLP.
    q, k, v, o : str
        The attention projections; ``q_norm``, ``k_norm`` Qwen3's per-head norms.
    gate, up, down : str or None
        The MLP's linear layers; an ungated MLP has ``up`` None and its first layer as ``gate``.
    layer_norm : bool
        LayerNorm (mean and bias) instead of RMSNorm.
    qk_norm : bool
        q and k normalised per head before RoPE (Qwen3).
    """
    layers: str
    embed: str
    final_norm: str
    norm1: str
    norm2: str
    q: str
    k: str
    v: str
    o: str
    gate: str
    up: str | None
    down: str
    positions: str | None = None
    position_offset: int = 0
    q_norm: str = "self_attn.q_norm"
    k_norm: str = "self_attn.k_norm"
    layer_norm: bool = False
    qk_norm: bool = False

    @property
    def gated(self) -> bool:
        return self.up is not None

    @property
    def rope(self) -> bool:
        """Rotary positions (else a learned position table)."""
        return self.positions is None


_LLAMA = FamilyLayout(layers="model.layers", embed="model.embed_tokens", final_norm="model.norm",
                      norm1="input_layernorm", norm2="post_attention_layernorm",
                      q="self_attn.q_proj", k="self_attn.k_proj", v="self_attn.v_proj", o="self_attn.o_proj",
                      gate="mlp.gate_proj", up="mlp.up_proj", down="mlp.down_proj")
_OPT = FamilyLayout(layers="model.decoder.layers", embed="model.decoder.embed_tokens",
                    final_norm="model.decoder.final_layer_norm",
                    norm1="self_attn_layer_norm", norm2="final_layer_norm",
                    q="self_attn.q_proj", k="self_attn.k_proj", v="self_attn.v_proj", o="self_attn.out_proj",
                    gate="fc1", up=None, down="fc2",
                    positions="model.decoder.embed_positions", position_offset=2, layer_norm=True)

_LAYOUTS = {"llama": _LLAMA, "qwen2": _LLAMA, "qwen3": replace(_LLAMA, qk_norm=True), "opt": _OPT}


def layout_of(model_type: str) -> FamilyLayout:
    """The layout of a supported family."""
    return _LAYOUTS[model_type]
