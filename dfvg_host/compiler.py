"""Draft compiler: a Hugging Face causal LM → weights image + program for the draft engine.

Stages, each a small function:

1. :func:`describe_model` — read the HF config; unsupported architectures fail here.
2. :func:`check_fits` — the model against the engine preset's limits.
3. :func:`calibrate` — run the float model on sample text, record activation ranges.
4. :class:`ImageBuilder` / :func:`build_image` — quantise (int8 weights per output
   channel, calibrated per-tensor activation scales, int32 residual stream) and lay out
   the image exactly as :mod:`dfvg_hw.spec.image` defines it.
5. :func:`emit_program` — the instruction stream for one forward + sample, with the layer
   loop and the draft loop on the device.

Floats are used here, on the host, to compute scales and tables; the device path is
integer-only (:mod:`dfvg_hw.spec.numerics`).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from dfvg_hw.spec import numerics as nx
from dfvg_hw.spec.config import VMEM_LINE_BYTES, EngineConfig
from dfvg_hw.spec.image import (ACT_PARAM_BYTES, ALIGN, ATTN_PARAM_BYTES, HEADER_BYTES, NORM_PARAM_BYTES,
                           ImageHeader, align, embed_row_stride, matmul_bytes, pack_act_params, pack_attn_params,
                           pack_norm_params, pack_requant_records, padded, tile_weights)
from dfvg_hw.spec.regmap import MemoryMap
from dfvg_hw.spec.isa import ACTMUL_SEGMENTS, Cond, Flag, Instruction, MatmulMode, Op, encode
from dfvg_host.checkpoints import TOKENIZER_FILES, has_tokenizer
from dfvg_host.compiled_draft import CompiledDraft, ModelShape
from dfvg_host.draft_vocab import DraftVocabulary, choose_draft_vocabulary
from dfvg_host.qk_balance import balance_factors, balanced_maxima, row_factors
from dfvg_host.families import FAMILIES, NOT_YET, FamilyLayout, layout_of

__all__ = ["CompileError", "UnsupportedModel", "DoesNotFit", "ModelShape", "CompiledDraft",
           "describe_model", "check_fits", "check_weight_blocks", "resolve_weight_blocks", "calibrate", "compile_draft",
           "emit_program"]

SUPPORTED = tuple(FAMILIES)


class CompileError(Exception):
    """A draft that cannot be compiled; the message is one line naming the limit."""


class UnsupportedModel(CompileError):
    pass


class DoesNotFit(CompileError):
    pass


def describe_model(hf_config) -> ModelShape:
    """The shape of a supported HF config; anything else raises :class:`UnsupportedModel`
    naming what the engine lacks for it."""
    mt = getattr(hf_config, "model_type", "?")
    if mt not in FAMILIES:
        lacks = f": the engine lacks {NOT_YET[mt]}" if mt in NOT_YET else ""
        raise UnsupportedModel(f"model_type '{mt}' is not supported{lacks} (supported: "
                               f"{', '.join(SUPPORTED)})")
    if getattr(hf_config, "use_sliding_window", False):
        raise UnsupportedModel(f"{mt} with use_sliding_window=True is not supported: the engine "
                               f"attends to the whole context")
    if mt == "opt":
        if not hf_config.do_layer_norm_before or getattr(hf_config, "_remove_final_layer_norm", False):
            raise UnsupportedModel("a post-norm OPT (do_layer_norm_before=False, as OPT-350M) is not "
                                   "supported: the engine runs pre-norm decoders")
        if not getattr(hf_config, "layer_norm_elementwise_affine", True):
            raise UnsupportedModel("OPT with layer_norm_elementwise_affine=False is not supported: "
                                   "the engine's norms take their gains from the checkpoint")
        if hf_config.word_embed_proj_dim != hf_config.hidden_size:
            raise UnsupportedModel(f"OPT's embedding projection (word_embed_proj_dim "
                                   f"{hf_config.word_embed_proj_dim} ≠ hidden {hf_config.hidden_size}) "
                                   f"is not supported")
    heads = hf_config.num_attention_heads
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // heads
    return ModelShape(
        model_type=mt, hidden=hf_config.hidden_size, layers=hf_config.num_hidden_layers,
        heads=heads, kv_heads=getattr(hf_config, "num_key_value_heads", None) or heads,
        head_dim=head_dim,
        intermediate=getattr(hf_config, "intermediate_size", None) or hf_config.ffn_dim,
        vocab=hf_config.vocab_size, max_positions=hf_config.max_position_embeddings,
        # OPT's LayerNorms keep torch's default eps
        rms_norm_eps=float(getattr(hf_config, "rms_norm_eps", None) or 1e-5),
        hidden_act=getattr(hf_config, "hidden_act", None) or hf_config.activation_function,
        tied_embeddings=bool(getattr(hf_config, "tie_word_embeddings", False)))


def resolve_weight_blocks(engine: EngineConfig, weight_blocks: bool | None) -> bool:
    """Whether to compile block-scaled weights: as asked, or by default wherever the engine
    has the block multipliers (``EngineConfig.weight_blocks``); asked of an engine without
    them, a :class:`CompileError`."""
    if weight_blocks is None:
        return engine.weight_blocks
    check_weight_blocks(engine, weight_blocks)
    return weight_blocks


def check_weight_blocks(engine: EngineConfig, weight_blocks: bool | None) -> None:
    """Raise :class:`CompileError` if block-scaled weights are asked of an engine built
    without block multipliers (``EngineConfig.weight_blocks``: its MATMUL BLOCKS faults)."""
    if weight_blocks and not engine.weight_blocks:
        raise CompileError(f"--weight-blocks: the '{engine.name}' preset is built without block "
                           "multipliers (weight_blocks = False); compile without --weight-blocks")


def check_fits(shape: ModelShape, engine: EngineConfig, draft_vocab: int | None = None) -> None:
    """Raise :class:`DoesNotFit` naming the first engine limit the model exceeds (with
    ``draft_vocab``, the engine holds that many of the model's tokens, :mod:`draft_vocab`)."""
    slots = shape.layers * shape.kv_heads
    if slots > engine.kv_slots:
        # one KV slot per (layer, KV head) pair (docs/isa.md §1.4)
        raise DoesNotFit(f"model needs {shape.layers} layers × {shape.kv_heads} KV heads = "
                         f"{slots} KV slots; the '{engine.name}' preset has kv_slots = "
                         f"{engine.kv_slots}")
    if shape.head_dim > engine.head_dim:
        raise DoesNotFit(f"model head_dim {shape.head_dim} exceeds the '{engine.name}' preset's "
                         f"head_dim = {engine.head_dim}")
    if draft_vocab is not None:
        if not 2 <= draft_vocab <= min(shape.vocab - 1, engine.vocab_max):
            raise DoesNotFit(f"--draft-vocab {draft_vocab}: it must be 2..{min(shape.vocab - 1, engine.vocab_max)} "
                             f"(fewer than the model's {shape.vocab} tokens, at most the '{engine.name}' "
                             f"preset's vocab_max {engine.vocab_max})")
    elif shape.vocab > engine.vocab_max:
        raise DoesNotFit(f"model vocab {shape.vocab} exceeds the '{engine.name}' preset's vocab_max = "
                         f"{engine.vocab_max} (16-bit token ids): compile it with `dfvg compile --draft-vocab "
                         f"{engine.vocab_max}` to draft over {engine.vocab_max - 1} of its tokens (the "
                         f"target still verifies every token)")
    line, hd = engine.vmem_line_bytes, shape.head_dim
    if hd % VMEM_LINE_BYTES:
        raise DoesNotFit(f"head_dim {hd} is not a multiple of {VMEM_LINE_BYTES}")
    # k and v start on VMEM lines after q in the qkv row (KVAPPEND's and ROPE's src)
    if shape.heads * hd % line or shape.kv_heads * hd % line:
        raise DoesNotFit(f"{shape.heads} query heads and {shape.kv_heads} KV heads of {hd}: q and "
                         f"k must each be whole {line}-byte VMEM lines of the '{engine.name}' preset")
    if shape.qk_norm and hd % line:
        raise DoesNotFit(f"head_dim {hd} with QK-norm: each head is an RMSNORM segment, which "
                         f"starts on a {line}-byte VMEM line of the '{engine.name}' preset")
    if shape.heads % shape.kv_heads:
        raise DoesNotFit(f"{shape.heads} heads are not a multiple of {shape.kv_heads} KV heads")


# -- calibration ------------------------------------------------------------------------
@dataclass
class Calibration:
    """Absolute maxima of every activation the engine quantises, from sample text: per
    tensor, and per channel for ``gate``, ``up`` and ``down_in`` (the ACTMUL groups and the
    up→down smoothing need them)."""
    residual: float = 0.0
    layers: list[dict] = field(default_factory=list)
    final_norm: float = 0.0
    tokens: int = 0


def calibrate(model, token_ids: list[list[int]], shape: ModelShape) -> Calibration:
    """Run the float model on ``token_ids`` sequences and record activation ranges."""
    import torch

    hd = shape.head_dim
    cal = Calibration(layers=[dict(norm1=0.0, q=0.0, k=0.0, v=0.0, q32=0.0, k32=0.0, norm2=0.0,
                                   gate=np.zeros(shape.intermediate), up=np.zeros(shape.intermediate),
                                   down_in=np.zeros(shape.intermediate),
                                   q_pairs=np.zeros((shape.heads, hd // 2)),
                                   k_pairs=np.zeros((shape.kv_heads, hd // 2)))
                              for _ in range(shape.layers)])

    def amax(t) -> float:
        return float(t.detach().abs().max())

    def pair_norm_max(t) -> float:
        # RoPE rotates (i, i + hd/2) pairs; their norm bounds every rotated element.
        t = t.detach().reshape(-1, 2, hd // 2)
        return float(torch.sqrt((t ** 2).sum(dim=-2)).max())

    def bump_pairs(d, name, t, heads):
        # each (head, pair)'s largest norm, the query/key balancing's input (qk_balance);
        # their maximum is the tensor's (pair_norm_max)
        t = t.detach().double().reshape(-1, heads, 2, hd // 2)
        pairs = f"{name}_pairs"
        d[pairs] = np.maximum(d[pairs], torch.sqrt((t ** 2).sum(dim=-2)).amax(0).numpy())
        d[name] = float(d[pairs].max())

    hooks = []

    def on(module, fn):
        def hook(_module, inputs, output):
            fn(inputs[0], output)       # returns None: the forward pass is not altered
        hooks.append(module.register_forward_hook(hook))

    def bump(d, key, value):
        d[key] = max(d[key], value)

    def bump_channels(d, key, t):
        d[key] = np.maximum(d[key], t.detach().abs().reshape(-1, t.shape[-1]).amax(0).double().numpy())

    fam = layout_of(shape.model_type)

    def normed(module, o):
        # the engine's norm output: a LayerNorm's bias is folded into the next layer
        return o - module.bias if fam.layer_norm and module.bias is not None else o

    def residual(i):
        # the engine's residual is centred over the channels where the norm is a LayerNorm
        return i - i.mean(dim=-1, keepdim=True) if fam.layer_norm else i

    def on_norm(module, fn):
        on(module, lambda i, o: (setattr(cal, "residual", max(cal.residual, amax(residual(i)))),
                                 fn(amax(normed(module, o)))))

    for li, layer in enumerate(model.get_submodule(fam.layers)):
        st = cal.layers[li]
        part = layer.get_submodule
        on_norm(part(fam.norm1), lambda a, st=st: bump(st, "norm1", a))
        on_norm(part(fam.norm2), lambda a, st=st: bump(st, "norm2", a))
        # RoPE rotates (i, i + hd/2) pairs, so q and k scales come from the pair norms
        rotated = pair_norm_max if shape.rope else amax
        if shape.qk_norm:       # RoPE rotates the norms' outputs; the int32 rows hold the inputs
            on(part(fam.q_norm), lambda i, o, st=st: (bump(st, "q", rotated(o)), bump(st, "q32", amax(i))))
            on(part(fam.k_norm), lambda i, o, st=st: (bump(st, "k", rotated(o)), bump(st, "k32", amax(i))))
        elif shape.rope:
            on(part(fam.q), lambda i, o, st=st: bump_pairs(st, "q", o, shape.heads))
            on(part(fam.k), lambda i, o, st=st: bump_pairs(st, "k", o, shape.kv_heads))
        else:
            on(part(fam.q), lambda i, o, st=st: bump(st, "q", amax(o)))
            on(part(fam.k), lambda i, o, st=st: bump(st, "k", amax(o)))
        on(part(fam.v), lambda i, o, st=st: bump(st, "v", amax(o)))
        on(part(fam.gate), lambda i, o, st=st: bump_channels(st, "gate", o))
        if fam.gated:
            on(part(fam.up), lambda i, o, st=st: bump_channels(st, "up", o))
        on(part(fam.down), lambda i, o, st=st: bump_channels(st, "down_in", i))
    on_norm(model.get_submodule(fam.final_norm),
            lambda a: setattr(cal, "final_norm", max(cal.final_norm, a)))
    by_length: dict[int, list[list[int]]] = {}
    for ids in token_ids:
        by_length.setdefault(len(ids), []).append(ids)
    try:
        with torch.no_grad():
            for length, batch in by_length.items():
                model(torch.tensor(batch))
                cal.tokens += length * len(batch)
    finally:
        for h in hooks:
            h.remove()
    return cal


# -- quantisation and layout ------------------------------------------------------------
def _weight_int8(w: np.ndarray, floor: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Symmetric int8 per output channel: (int8 weights, per-row scale), the scale at least
    ``floor`` (per row) where one is given.

    An all-zero row gets scale 0 (without a floor): its requantisation multiplier is then 0."""
    scale = np.abs(w).max(axis=1) / 127.0
    if floor is not None:
        scale = np.maximum(scale, floor)
    safe = np.where(scale > 0, scale, 1.0)
    return np.clip(np.round(w / safe[:, None]), -127, 127).astype(np.int8), scale


#: The largest bias the compiler writes, in accumulator units (the BIAS word is int32).
BIAS_LIMIT = 2 ** 30


def block_multipliers(w: np.ndarray, sw: np.ndarray, reduce: int) -> np.ndarray:
    """The ``BLOCKS`` multipliers ``[N, ceil(K/reduce)]`` of a matrix whose rows have the
    scale ``sw``: each block of ``reduce`` inputs gets
    ``m = clip(round(2^16 · s_block / sw), 1, 65535)``, ``s_block = max|w_block| / 127``
    (numerics.md §13.2): the block's int8 weights then step by ``sw · m / 2^16``. A row
    whose scale is 0 (all zero) gets 1s."""
    n, k = w.shape
    tiles = -(-k // reduce)
    a = np.zeros((n, tiles * reduce))
    a[:, :k] = np.abs(w)
    s_block = a.reshape(n, tiles, reduce).max(axis=2) / 127.0
    safe = np.where(sw > 0, sw, 1.0)[:, None]
    return np.clip(np.round(s_block / safe * (1 << nx.BLOCK_SHIFT)), 1, (1 << nx.BLOCK_MULT_BITS) - 1
                   ).astype(np.int64)


def _linear_block(w: np.ndarray, s_in: float, s_out, engine: EngineConfig,
                  bias: np.ndarray | None = None, blocks: bool = False) -> bytes:
    """The MATMUL block of ``y = W·x (+ bias)``: int8 weights per output row, each row
    requantised from its accumulator (units ``s_in·s_w``) to ``s_out`` (a scalar or one per
    row), and the bias in accumulator units (docs/isa.md §4.2). A row whose bias would not
    fit ``BIAS_LIMIT`` gets a coarser weight scale, so that every bias is exact to half an
    accumulator unit. With ``blocks`` (``BLOCKS``) each block of ``reduce`` inputs of a row
    is quantised at its own scale ``s_w · m / 2^16`` (:func:`block_multipliers`); the
    accumulator keeps the row's units, so the requantisation and the bias are unchanged."""
    floor = None if bias is None else np.abs(bias) / (s_in * BIAS_LIMIT)
    w8, sw = _weight_int8(w, floor)
    scales = None
    if blocks:
        scales = block_multipliers(w, sw, engine.reduce)
        step = np.repeat(scales, engine.reduce, axis=1)[:, :w.shape[1]] / float(1 << nx.BLOCK_SHIFT)
        step = step * np.where(sw > 0, sw, 1.0)[:, None]
        w8 = np.clip(np.round(w / step), -127, 127).astype(np.int8)
    mult, shift = nx.host_multiplier(s_in * sw / s_out)
    npad = padded(w8.shape[0], engine.lanes)
    bias_int = None
    if bias is not None:
        safe = np.where(sw > 0, sw, 1.0)
        bias_int = np.where(sw > 0, np.round(bias / (s_in * safe)), 0).astype(np.int64)
    records = pack_requant_records(mult, shift, bias_int, npad, engine.lanes)
    block = tile_weights(w8, engine.lanes, engine.reduce, scales).tobytes() + records
    return block.ljust(matmul_bytes(*w8.shape, engine.lanes, engine.reduce, bias is not None, blocks),
                       b"\0")


def _act_scale(absmax: float, bits: int = 8) -> float:
    return max(absmax, 1e-8) / ((1 << (bits - 1)) - 1)


#: Bits of headroom the int32 residual keeps above its calibrated maximum: text from
#: another domain than the calibration text may drive it further.
RESIDUAL_HEADROOM_BITS = 2


def _residual_scale(sd: dict, cal: Calibration, layer_scales: list["LayerScales"], fam: FamilyLayout) -> float:
    """The int32 residual stream's scale.

    Real checkpoints carry a few "massive activation" channels (10^4 against a typical
    10^-1) in the residual stream, so it is int32, with RESIDUAL_HEADROOM_BITS above the
    calibrated maximum. RMSNORM cuts each row to int16 by its own shift, so only the
    updates' resolution depends on this scale. It is never finer than 2^-15 of a residual
    writer's (o_proj, down_proj) output step: the requantisation multiplier must stay
    below 2^16 with a shift ≥ 0, and a finer residual would hold no information.
    """
    s_x = _act_scale(cal.residual * 1.05 * 2 ** RESIDUAL_HEADROOM_BITS, nx.RES_BITS)
    finest = 0.0
    for li, ls in enumerate(layer_scales):
        p = f"{fam.layers}.{li}."
        w_down = sd[f"{p}{fam.down}.weight"][:, ls.order] * ls.u
        # a row of exponent e steps by s_h · 2^e: the coarsest must keep shift ≥ e
        for s_in, w in ((ls.o, sd[f"{p}{fam.o}.weight"]), (ls.h * 2 ** ls.h_exp, w_down)):
            finest = max(finest, s_in * float(np.abs(w).max()) / 127.0)
    return max(s_x, finest / 2 ** 15)


#: Exponent of the up→down smoothing (SmoothQuant's alpha), chosen by measurement
#: (docs/numerics.md §13.5).
UP_SMOOTHING_ALPHA = 0.5


def up_down_smoothing(up_max: np.ndarray, w_down: np.ndarray, alpha: float = UP_SMOOTHING_ALPHA) -> np.ndarray:
    """Per intermediate channel j, the factor ``u_j`` that up_proj's row j is divided by
    and down_proj's column j multiplied by: ``h_j = act(gate_j) · up_j`` scales with up_j,
    so the model is unchanged. ``u_j = max|up_j|^alpha / max|W_down[:, j]|^(1 - alpha)``,
    normalised to median 1: it evens out int8 up's channels (a few reach 50–80 where
    most stay below 3 on real checkpoints), moving part of the range into down's weight
    columns, which int8 per output row absorbs better."""
    x = np.maximum(np.asarray(up_max, np.float64), 1e-6)
    w = np.maximum(np.abs(w_down).max(axis=0), 1e-6)
    u = x ** alpha / w ** (1.0 - alpha)
    return u / np.median(u)


#: Channel counts of the gated activation's groups, largest gate first (the last group
#: takes the rest): each group has its own gate and up scales and LUT, a segment of the
#: layer's one ACTMUL (a segment may end at any channel, whatever the VMEM line). With
#: the rest, at most ACTMUL_SEGMENTS groups.
ACT_GROUP_SIZES = (8, 8, 16, 32, 64, 128)
assert len(ACT_GROUP_SIZES) < ACTMUL_SEGMENTS


def act_groups(intermediate: int) -> list[int]:
    """The ACTMUL groups (segments) of an MLP of ``intermediate`` channels: ACT_GROUP_SIZES
    while at least 8 channels are left for the rest, or one group when ``intermediate`` is
    not a multiple of 8 (docs/numerics.md §13.2)."""
    if intermediate % 8:
        return [intermediate]
    groups, rest = [], intermediate
    for size in ACT_GROUP_SIZES:
        if rest - size < 8:
            break
        groups.append(size)
        rest -= size
    return groups + [rest]


def _balance_qk(sd: dict, q_weight: str, k_weight: str, shape: ModelShape, stats: dict) -> dict:
    """Fold one layer's query/key balancing (:mod:`dfvg_host.qk_balance`) into the state
    dict's q and k projections (weights and biases) and return its calibration statistics
    with the balanced q and k maxima."""
    c = balance_factors(stats["k_pairs"])
    q_rows, k_rows = row_factors(c, shape.heads)
    for name, rows in ((q_weight, q_rows), (k_weight, k_rows)):
        sd[name] = sd[name] * rows[:, None]
        bias = name.removesuffix("weight") + "bias"
        if bias in sd:
            sd[bias] = sd[bias] * rows
    q_max, k_max = balanced_maxima(stats["q_pairs"], stats["k_pairs"], c)
    return dict(stats, q=q_max, k=k_max)


def _group_bounds(groups) -> list[tuple[int, int]]:
    """(first, end) channel of each group."""
    bounds = np.cumsum([0] + list(groups))
    return [(int(a), int(b)) for a, b in zip(bounds, bounds[1:])]


@dataclass(frozen=True)
class LayerScales:
    """One layer's activation scales, its gated activation's channel order and groups, and
    its up→down smoothing factors ``u`` (in the permuted order).

    The MLP's intermediate channels are permuted by decreasing calibrated gate maximum
    (``order``) and cut into ``groups``: a real checkpoint's few gate/up channels that
    reach 50–80 (against under 3 for most) then set the int8 scales of a group of 8,
    not of all channels. ``gate[i]``, ``up[i]`` are group i's scales.
    """
    n1: float
    q: float
    k: float
    v: float
    o: float
    n2: float
    order: np.ndarray
    groups: tuple[int, ...]
    gate: tuple[float, ...]
    up: tuple[float, ...]
    h: float
    u: np.ndarray
    #: the int32 q and k rows before QK-norm (0 without): RMSNORM cuts each head by its own
    #: shift, so 24 bits for the calibrated maximum only set the eps's resolution
    q32: float = 0.0
    k32: float = 0.0
    #: h's row exponent budget (ACTMUL's E, down's ROWEXP); 0: one static scale
    h_exp: int = 0
    #: the KV cache holds k and v at their VMEM scale / 2^kv_shift: an int8 k and v fill
    #: the top 8 bits of a wider element (numerics.kv_entry), an int16 one is the element
    kv_shift: int = 0

    @classmethod
    def calibrated(cls, c: dict, w_down: np.ndarray, gated: bool = True,
                   row_exponents: bool = False, q_bits: int = nx.ATTN_Q_BITS,
                   kv_bits: int = nx.ACT_BITS, kv_source_bits: int = nx.ACT_BITS) -> "LayerScales":
        # Matmul inputs are wide (int16); k and v are written with ``kv_source_bits`` bits
        # used (int8, or of an int16 for KVAPPEND WIDE) into a KV cache of ``kv_bits``, q is
        # int16 with ``q_bits`` = 11 bits used (ATTN IN16; QK-norm models: int8, 8). A gated
        # MLP's gate and up are int16 (ACTMUL IN16), an ungated one's gate int8 (OPT, no up: u = 1).
        order = np.argsort(-c["gate"], kind="stable")
        gate_max, h_max = c["gate"][order], c["down_in"][order]
        up_max = c["up"][order] if gated else np.ones(len(order))
        u = up_down_smoothing(up_max, w_down[:, order]) if gated else np.ones(len(order))
        groups = tuple(act_groups(len(order)))
        spans = _group_bounds(groups)
        gate_up_bits = gate_up_width(gated)
        s_v = _act_scale(c["v"], kv_source_bits)
        return cls(n1=_act_scale(c["norm1"], 16), q=_act_scale(c["q"], q_bits),
                   k=_act_scale(c["k"], kv_source_bits), v=s_v,
                   # the wide attention output: the cache's V scale / 2^(16 − kv_bits)
                   o=s_v / 2 ** (16 - kv_source_bits), kv_shift=kv_bits - kv_source_bits,
                   n2=_act_scale(c["norm2"], 16), order=order, groups=groups,
                   gate=tuple(_act_scale(float(gate_max[a:b].max()), gate_up_bits) for a, b in spans),
                   up=tuple(_act_scale(float((up_max / u)[a:b].max()), gate_up_bits) for a, b in spans),
                   h=_act_scale(float(np.max(h_max / u)), 16) / 2 ** (H_FINE_BITS if row_exponents else 0),
                   u=u, q32=c["q32"] / 2 ** QK_ROW_BITS, k32=c["k32"] / 2 ** QK_ROW_BITS,
                   h_exp=nx.ROW_EXP_MAX if row_exponents else 0)

    def to_dict(self) -> dict:
        qk = dict(q32=self.q32, k32=self.k32) if self.q32 else {}
        return dict(norm1=self.n1, q=self.q, k=self.k, v=self.v, norm2=self.n2, gate=list(self.gate),
                    up=list(self.up), down_in=self.h, act_groups=list(self.groups), **qk)


def query_bits(shape: ModelShape, engine: EngineConfig) -> int:
    """Bits of the query ATTN reads: of an int16 (``ATTN IN16``, its q written by a MATMUL
    ``OUT16``) 11 over an int8 KV cache, measured on SmolLM2-135M together with the
    query/key balancing (numerics.md §13.7), all 16 over a wider one
    (numerics.attention_query_bits); int8 where QK-norm writes q (Qwen3: the RMSNORM
    segments' int8 output, unchanged)."""
    return nx.ACT_BITS if shape.qk_norm else nx.attention_query_bits(engine.kv_bits)


def kv_source_bits(shape: ModelShape, engine: EngineConfig) -> int:
    """Bits of the k and v that KVAPPEND reads: the engine's ``kv_bits`` of an int16 (the
    k/v MATMUL ``OUT16``, KVAPPEND ``WIDE``) where the KV cache is wider than int8 and a
    matmul writes k; int8 where it is not, or where QK-norm writes k (RMSNORM's int8)."""
    return engine.kv_bits if engine.kv_bits > nx.ACT_BITS and not shape.qk_norm else nx.ACT_BITS


def kv_source_bytes(shape: ModelShape, engine: EngineConfig) -> int:
    """Bytes of a k or v element in VMEM (:func:`kv_source_bits`: int16 or int8)."""
    return 2 if kv_source_bits(shape, engine) > nx.ACT_BITS else 1


def query_bytes(shape: ModelShape) -> int:
    """Bytes of a query element in VMEM (:func:`query_bits`: int16 or int8)."""
    return 1 if shape.qk_norm else 2


def gate_up_width(gated: bool) -> int:
    """Bits of the gated activation's inputs: a gated MLP's gate and up are int16 (the
    gate/up MATMUL ``OUT16``, ACTMUL ``IN16``: +0.8 points of top-1 on SmolLM2-135M over
    4096 positions, numerics.md §13.7), an ungated MLP's gate int8 (its table is indexed
    by it)."""
    return 16 if gated else nx.ACT_BITS


#: Bits of the int32 q/k rows (before QK-norm) below their calibrated maximum.
QK_ROW_BITS = 24

#: With row exponents, h's base scale is this many bits finer than its calibrated maximum
#: needs: a row down to 2^-8 of the calibrated maximum keeps all 15 bits (exponent 0), and
#: with ROW_EXP_MAX = 15 a row up to 2^7 times the maximum fits (numerics.md §13.2).
H_FINE_BITS = 8


def _norm_block(gamma: np.ndarray, hidden: int, eps: float, s_x: float, s_out: float,
                out_bits: int = 16) -> bytes:
    """RMSNORM parameters for a wide (int16) output at scale ``s_out`` (int8 with
    ``out_bits=8``); ``hidden`` is the normalised length (a head's for QK-norm)."""
    # numerics.rmsnorm keeps 8 more fractional bits for an int16 output: take them out of gamma.
    real = math.sqrt(hidden) * gamma.astype(np.float64) / s_out / 2 ** (out_bits - nx.ACT_BITS)
    peak = float(np.abs(real).max()) or 1.0
    shift = min(int(math.floor(math.log2(32767.0 / peak))), nx.GAMMA_SHIFT_MAX)
    if shift < 0:
        raise DoesNotFit("an RMSNorm gain is too large for the int16 gamma multiplier")
    g = np.clip(np.round(real * 2.0 ** shift), -32768, 32767).astype(np.int16)
    eps_int = min(int(round(eps * hidden / (s_x * s_x))), 0xFFFFFFFF)
    return pack_norm_params(eps_int, g, shift)


class ImageBuilder:
    """Appends blocks, each at the start of an engine beat (``mem_beat_bytes``: every port's
    beat side by side), and remembers where each went. Beat-aligned blocks start every
    weight stream on every memory channel at once, and no reader has to re-cut a first
    beat."""

    def __init__(self, beat_bytes: int):
        self.beat = max(beat_bytes, ALIGN)
        self.data = bytearray(HEADER_BYTES)

    def place(self, block: bytes) -> int:
        addr = align(len(self.data), self.beat)
        self.data.extend(b"\0" * (addr - len(self.data)))
        self.data.extend(block)
        return addr


def _joined(*linears) -> np.ndarray | None:
    """The bias of a fused matmul of ``(weight, bias)`` parts: their biases end to end
    (zeros for a part without one), or None if no part has one."""
    if all(b is None for _, b in linears):
        return None
    return np.concatenate([np.zeros(w.shape[0]) if b is None else b for w, b in linears])


@dataclass
class Layout:
    """Addresses (image offsets) of every block, and the VMEM map (in lines of ``line``
    bytes, the engine's ``vmem_line_bytes``)."""
    embed: int = 0
    rope: int = 0
    layers_base: int = 0
    layer_stride: int = 0
    sub: dict = field(default_factory=dict)     # offsets within a layer block
    final_norm: int = 0
    lm_head: int = 0
    vmem: dict = field(default_factory=dict)
    biased: list = field(default_factory=list)  # layer blocks whose MATMUL adds a bias (BIAS)
    blocks: bool = False                        # every MATMUL's weights block-scaled (BLOCKS)
    row_exponents: bool = False                 # ACTMUL measures h's row exponents, down reads them (ROWEXP)
    logits: int = 0                             # LOGITS/SAMPLE length: the drafted tokens
    act_groups: list = field(default_factory=list)  # channels of each ACTMUL's group
    positions: int = 0                          # learned position table (int16 rows)
    position_add: int = 0                       # the identity matmul that adds a position row
    line: int = VMEM_LINE_BYTES                 # bytes of a VMEM line
    kv_wide: bool = False                       # k and v int16 in VMEM (KVAPPEND WIDE)


def _mlp_blocks(parts: dict, linear, sd: dict, key, li: int, fam: FamilyLayout, ls: "LayerScales",
                s_x: float, act) -> None:
    """The MLP's blocks: the first matmul (gated: ``[gate_0; gate_1; ...; up_0; up_1; ...]``;
    ungated: ``[gate_0; gate_1; ...]``, channels permuted by ``ls.order``, up and its bias
    divided by the smoothing factors ``u``), the ACTMUL blocks, one per channel group (a
    segment of the layer's one ACTMUL, its first channel in the block), and down."""
    def permuted(part, divide=None):
        w, bias = sd[key(li, part)][ls.order], sd.get(key(li, part, "bias"))
        bias = None if bias is None else bias[ls.order]
        if divide is not None:
            w, bias = w / divide[:, None], None if bias is None else bias / divide
        return w, bias

    spans = _group_bounds(ls.groups)
    streams = [permuted(fam.gate)] + ([permuted(fam.up, ls.u)] if fam.gated else [])
    # the row is [gate | up] over all channels: ACTMUL's gate and up halves
    scale_of = [ls.gate, ls.up] if fam.gated else [ls.gate]
    s_out = np.concatenate([np.repeat(s[i], b - a) for s in scale_of for i, (a, b) in enumerate(spans)])
    linear("gateup", np.concatenate([w for w, _ in streams]), ls.n2, s_out, _joined(*streams))
    # the groups' blocks one after the other, in one part: the ACTMUL reads them in one go
    blocks = []
    for i, (a, _) in enumerate(spans):
        lut, s_lut = (nx.host_act_knots if fam.gated else nx.host_act_lut)(act, ls.gate[i])
        m, sh = nx.host_multiplier(s_lut * (ls.up[i] if fam.gated else 1.0) / ls.h)
        blocks.append(pack_act_params(int(m), int(sh), lut, first=a, exp_max=ls.h_exp if i == 0 else 0))
    parts["act"] = b"".join(blocks)
    linear("down", sd[key(li, fam.down)][:, ls.order] * ls.u, ls.h, s_x, sd.get(key(li, fam.down, "bias")))


def decoder_state(model, shape: ModelShape) -> dict:
    """The model's parameters as float64 arrays keyed by state-dict name, with a tied LM
    head given its own ``lm_head.weight``; a LayerNorm family's (OPT) rewritten so that an
    RMSNorm computes the same model (:mod:`dfvg_host.families`): the residual writers'
    outputs centred over the channels, each LayerNorm's bias folded into the biases of the
    linear layers that read it."""
    import torch

    fam = layout_of(shape.model_type)
    sd = {k: v.detach().to(torch.float64).numpy() for k, v in model.state_dict().items()}
    sd.setdefault("lm_head.weight", sd[f"{fam.embed}.weight"])
    if not fam.layer_norm:
        return sd

    def fold(norm: str, readers: list[str]):
        beta = sd.pop(f"{norm}.bias", None)
        if beta is None:                         # a LayerNorm without a bias
            return
        for r in readers:
            sd[f"{r}.bias"] = sd.get(f"{r}.bias", 0.0) + sd[f"{r}.weight"] @ beta

    def centre_rows(key: str):                   # each row's mean over the channels
        sd[key] = sd[key] - sd[key].mean(axis=1, keepdims=True)

    def centre_outputs(linear: str):             # every output vector's mean over the channels
        sd[f"{linear}.weight"] = sd[f"{linear}.weight"] - sd[f"{linear}.weight"].mean(axis=0, keepdims=True)
        if f"{linear}.bias" in sd:
            sd[f"{linear}.bias"] = sd[f"{linear}.bias"] - sd[f"{linear}.bias"].mean()

    centre_rows(f"{fam.embed}.weight")
    centre_rows(f"{fam.positions}.weight")
    for li in range(shape.layers):
        p = f"{fam.layers}.{li}."
        fold(p + fam.norm1, [p + fam.q, p + fam.k, p + fam.v])
        fold(p + fam.norm2, [p + fam.gate])
        centre_outputs(p + fam.o)
        centre_outputs(p + fam.down)
    fold(fam.final_norm, ["lm_head"])
    return sd


def build_image(model, shape: ModelShape, cal: Calibration, engine: EngineConfig,
                vocabulary: DraftVocabulary | None = None, weight_blocks: bool = False,
                row_exponents: bool | None = False):
    """Quantise the model and lay out the image; returns (bytes, Layout, scales). With a
    ``vocabulary`` the embedding holds its kept rows and one shared row (the mean of the
    others), and the LM head its kept rows. With ``weight_blocks`` every matrix has a
    scale per block of ``reduce`` inputs (``BLOCKS``, numerics.md §13.2). With
    ``row_exponents`` each row of ``h`` gets its own power of two (``ROWEXP``): a
    :class:`CompileError` where a down projection has a bias; ``None``: wherever none has."""
    import torch
    from transformers.activations import ACT2FN

    fam = layout_of(shape.model_type)
    sd = decoder_state(model, shape)
    key = lambda li, part, what="weight": f"{fam.layers}.{li}.{part}.{what}"
    # a bias joins the accumulator in the units of exponent 0: row exponents only for
    # bias-free down projections (OPT's fc2 has one)
    down_biased = any(key(li, fam.down, "bias") in sd for li in range(shape.layers))
    if row_exponents is None:
        row_exponents = not down_biased
    if row_exponents and down_biased:
        raise CompileError(f"--row-exponents: the model's {fam.down} has a bias, which joins the "
                           "accumulator at exponent 0; row exponents need bias-free down "
                           "projections: compile without --row-exponents")
    # query/key balancing per RoPE pair (qk_balance), folded into q_proj and k_proj; QK-norm
    # models normalise each head after the projection, so a factor there would not survive
    stats = [_balance_qk(sd, key(li, fam.q), key(li, fam.k), shape, c) for li, c in enumerate(cal.layers)] \
        if shape.rope and not shape.qk_norm else cal.layers
    layer_scales = [LayerScales.calibrated(c, sd[key(li, fam.down)], fam.gated, row_exponents,
                                           query_bits(shape, engine), engine.kv_bits,
                                           kv_source_bits(shape, engine))
                    for li, c in enumerate(stats)]
    s_x = _residual_scale(sd, cal, layer_scales, fam)
    b = ImageBuilder(engine.mem_beat_bytes)
    lay = Layout(blocks=weight_blocks, row_exponents=row_exponents, line=engine.vmem_line_bytes,
                 kv_wide=kv_source_bytes(shape, engine) == 2)
    scales = dict(residual=s_x, layers=[])

    emb = sd[f"{fam.embed}.weight"]
    lm, lm_bias = sd["lm_head.weight"], sd.get("lm_head.bias")
    lay.logits = shape.vocab
    if vocabulary is not None:
        dropped = np.ones(len(emb), bool)
        dropped[vocabulary.kept] = False
        shared = emb[dropped].mean(axis=0) if dropped.any() else np.zeros(emb.shape[1])
        emb = np.vstack([emb[vocabulary.kept], shared])
        lm, lm_bias = lm[vocabulary.kept], None if lm_bias is None else lm_bias[vocabulary.kept]
        lay.logits = len(vocabulary.kept)
    # EMBED rows are padded to whole engine beats (embed_row_stride), so each starts on one.
    table = np.zeros((emb.shape[0], embed_row_stride(shape.hidden, engine.mem_beat_bytes) // 4), "<i4")
    table[:, :shape.hidden] = np.clip(np.round(emb / s_x), -(1 << 31), (1 << 31) - 1).astype("<i4")
    lay.embed = b.place(table.tobytes())

    if shape.rope:
        rotary = model.model.rotary_emb
        positions = torch.arange(engine.kv_positions)[None, :]
        cos, sin = rotary(torch.zeros(1, dtype=torch.float64), positions)
        half = shape.head_dim // 2
        lay.rope = b.place(nx.host_rope_table(cos[0, :, :half].double().numpy(),
                                              sin[0, :, :half].double().numpy()).astype("<i2").tobytes())
    else:
        # learned positions: int16 rows that EMBED POSITION copies (two a 32-bit element)
        # and an identity matmul adds into the residual
        pe = sd[f"{fam.positions}.weight"][fam.position_offset:][:engine.kv_positions]
        s_pe = _act_scale(float(np.abs(pe).max()), 16)
        rows = np.zeros((engine.kv_positions, embed_row_stride(shape.hidden // 2, engine.mem_beat_bytes) // 2), "<i2")
        rows[:len(pe), :shape.hidden] = np.clip(np.round(pe / s_pe), -32767, 32767)
        lay.positions = b.place(rows.tobytes())
        lay.position_add = b.place(_linear_block(np.eye(shape.hidden), s_pe, s_x, engine,
                                                 blocks=weight_blocks))
        scales["positions"] = s_pe

    act_fn = ACT2FN[shape.hidden_act]
    attention = model.get_submodule(fam.layers)[0].get_submodule(fam.q.rsplit(".", 1)[0])
    scaling = float(getattr(attention, "scaling", shape.head_dim ** -0.5))
    blocks = []
    for li in range(shape.layers):
        ls = layer_scales[li]
        qd, kd = shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
        parts = {}
        # RMSNorm gains stay in the int16 gamma (folded into the weight columns, a few large
        # gains set each int8 row's range: measured 1.2 points of top-1 on SmolLM2-135M).
        parts["norm1"] = _norm_block(sd[key(li, fam.norm1)], shape.hidden, shape.rms_norm_eps, s_x, ls.n1)
        attn = {name: (sd[key(li, getattr(fam, name))], sd.get(key(li, getattr(fam, name), "bias")))
                for name in "qkvo"}

        def linear(name, w, s_in, s_out, bias):
            parts[name] = _linear_block(w, s_in, s_out, engine, bias, weight_blocks)
            if bias is not None and name not in lay.biased:
                lay.biased.append(name)

        if shape.qk_norm:
            # q and k as int32 rows, each head normalised alone (RMSNORM segments), then int8
            # (one scale per tensor, as a head is normalised as a whole; never finer than 2^-15
            # of the accumulator's step, so that every multiplier fits 16 bits)
            s32 = {name: max(scale, ls.n1 * float(np.abs(attn[name][0]).max()) / 127.0 / 2 ** 15)
                   for name, scale in (("q", ls.q32), ("k", ls.k32))}
            linear("qk", np.concatenate([attn["q"][0], attn["k"][0]]), ls.n1,
                   np.concatenate([np.full(qd, s32["q"]), np.full(kd, s32["k"])]),
                   _joined(attn["q"], attn["k"]))
            linear("v", attn["v"][0], ls.n1, ls.v, attn["v"][1])
            for name, s_out in (("q", ls.q), ("k", ls.k)):
                parts[f"{name}norm"] = _norm_block(sd[key(li, getattr(fam, f"{name}_norm"))], shape.head_dim,
                                                   shape.rms_norm_eps, s32[name], s_out, nx.ACT_BITS)
        else:
            # q as int16 (its MATMUL OUT16), k and v int8 or int16 for the KV cache
            linear("q", attn["q"][0], ls.n1, ls.q, attn["q"][1])
            linear("kv", np.concatenate([attn["k"][0], attn["v"][0]]), ls.n1,
                   np.concatenate([np.full(kd, ls.k), np.full(kd, ls.v)]), _joined(attn["k"], attn["v"]))
        am, ash = nx.host_multiplier(ls.q * ls.k / 2 ** ls.kv_shift * scaling * math.log2(math.e)
                                     * (1 << nx.EXP_FRAC))
        parts["attn"] = pack_attn_params(int(am), int(ash), shape.kv_heads)
        linear("o", attn["o"][0], ls.o, s_x, attn["o"][1])
        parts["norm2"] = _norm_block(sd[key(li, fam.norm2)], shape.hidden, shape.rms_norm_eps, s_x, ls.n2)
        _mlp_blocks(parts, linear, sd, key, li, fam, ls, s_x,
                    lambda g: act_fn(torch.from_numpy(g)).numpy())
        blocks.append(parts)
        scales["layers"].append(ls.to_dict())
    lay.act_groups = list(layer_scales[0].groups)       # one width, so every layer's groups

    # Every layer block has the same internal layout, so one stride serves the LOOP.
    offset = 0
    for name, data in blocks[0].items():
        lay.sub[name] = offset
        offset = align(offset + len(data), b.beat)
    lay.layer_stride = offset
    lay.layers_base = align(len(b.data), b.beat)
    for parts in blocks:
        block = bytearray(lay.layer_stride)
        for name, data in parts.items():
            block[lay.sub[name]:lay.sub[name] + len(data)] = data
        b.place(bytes(block))

    s_fn = _act_scale(cal.final_norm, 16)
    lay.final_norm = b.place(_norm_block(sd[f"{fam.final_norm}.weight"], shape.hidden,
                                         shape.rms_norm_eps, s_x, s_fn))
    lay.lm_head = b.place(_linear_block(lm, s_fn, 2.0 ** -nx.LOGIT_FRAC, engine, lm_bias,
                                        weight_blocks))
    if lm_bias is not None:
        lay.biased.append("lm_head")
    scales["final_norm"] = s_fn

    header = ImageHeader(
        lanes=engine.lanes, reduce=engine.reduce, hidden=shape.hidden, layers=shape.layers,
        heads=shape.heads, kv_heads=shape.kv_heads, head_dim=shape.head_dim,
        intermediate=shape.intermediate, vocab=len(emb), rope_positions=engine.kv_positions,
        layer_stride=lay.layer_stride, layers_base=lay.layers_base, embed_addr=lay.embed,
        rope_addr=lay.rope, final_norm_addr=lay.final_norm, lm_head_addr=lay.lm_head,
        image_bytes=align(len(b.data), b.beat))
    image = bytearray(b.data.ljust(header.image_bytes, b"\0"))
    image[:HEADER_BYTES] = header.pack()
    return bytes(image), lay, scales


# -- program ------------------------------------------------------------------------------
def allocate_vmem(shape: ModelShape, engine: EngineConfig) -> dict:
    """VMEM regions (in lines of the preset's ``vmem_line_bytes``) for one draft row;
    ``row_lines`` is the row's whole span, the row pitch of a tree forward (docs/isa.md
    §9.2)."""
    sizes = dict(x=4 * shape.hidden, xn=2 * shape.hidden,
                 qkv=(query_bytes(shape) * shape.heads
                      + 2 * kv_source_bytes(shape, engine) * shape.kv_heads) * shape.head_dim,
                 attn=2 * shape.heads * shape.head_dim,
                 gateup=2 * shape.intermediate * gate_up_width(layout_of(shape.model_type).gated) // 8,
                 h=2 * shape.intermediate)
    if shape.qk_norm:
        sizes["qk32"] = 4 * shape.qk_out
    if not shape.rope:
        sizes["pe"] = 2 * shape.hidden
    vmem, line, line_bytes = {}, 0, engine.vmem_line_bytes
    for name, nbytes in sizes.items():
        vmem[name] = line
        line += padded(nbytes, line_bytes) // line_bytes
    if line * line_bytes > engine.vmem_bytes:
        raise DoesNotFit(f"activations need {line * line_bytes} bytes of VMEM, the "
                         f"'{engine.name}' preset has vmem_bytes = {engine.vmem_bytes}")
    vmem["row_lines"] = line
    return vmem


def tree_width(vmem: dict, engine: EngineConfig) -> int:
    """The widest tree the program drafts: the engine's rows, as many as VMEM holds rows
    of activations ``row_lines`` apart (0 below two: a one-row tree is a chain)."""
    fits = min(engine.rows, engine.vmem_bytes // (engine.vmem_line_bytes * vmem["row_lines"]))
    return fits if fits >= 2 else 0


def emit_program(shape: ModelShape, lay: Layout, width: int = 0) -> tuple[list[int], int]:
    """The program and its tree entry: one forward per token (layer loop on the device),
    sampling when the controller says this forward drafts, and NEXT looping until the
    request is done; then, for a tree of ``width`` ≥ 1 rows, the same forward over the
    ``width`` nodes of a tree level, which NEXT enters at the tree entry (docs/isa.md
    §9.2; 0 when there is none)."""
    chain = _forward(shape, lay, 1)
    tail_start = len(chain) + 1
    tail = _head(shape, lay, 1)
    next_pc = tail_start + len(tail)
    program = chain + [Instruction(Op.BRANCH, flags=Cond.NO_SAMPLE, n=next_pc)] + tail + [
        Instruction(Op.NEXT, n=0), Instruction(Op.HALT)]
    tree_pc = 0
    if width:
        # every tree forward samples its level, so the head needs no branch
        tree_pc = len(program)
        program += _forward(shape, lay, width) + _head(shape, lay, width) + [
            Instruction(Op.NEXT, n=tree_pc), Instruction(Op.HALT)]
    return [encode(i) for i in program], tree_pc


def _head(shape: ModelShape, lay: Layout, rows: int) -> list[Instruction]:
    """The final norm, the logits and the sampler."""
    v, s = lay.vmem, shape
    to_logits = MatmulMode.LOGITS << 1 | Flag.WIDE
    return [
        Instruction(Op.RMSNORM, flags=Flag.WIDE, rows=rows, dst=v["xn"], src=v["x"], n=s.hidden,
                    addr=lay.final_norm),
        Instruction(Op.MATMUL, flags=to_logits | _bias_flag(lay, "lm_head") | _blocks_flag(lay), rows=rows,
                    src=v["xn"], n=lay.logits, k=s.hidden, addr=lay.lm_head),
        Instruction(Op.SAMPLE, n=lay.logits),
    ]


def _forward(shape: ModelShape, lay: Layout, rows: int) -> list[Instruction]:
    """The embedding and the layer loop over ``rows`` rows."""
    v, s, hd = lay.vmem, shape, shape.head_dim
    k_line = _k_line(s, lay)
    in16 = Flag.IN16 if query_bytes(s) == 2 else 0       # ATTN reads an int16 query
    L = lambda name: lay.layers_base + lay.sub[name]
    wide = Flag.WIDE
    to_int8, to_residual = MatmulMode.INT8 << 1 | wide, MatmulMode.RESADD << 1 | wide
    lrel = Flag.LREL
    bias = lambda name: _bias_flag(lay, name) | _blocks_flag(lay)
    # learned positions (OPT): the position's int16 row, added by an identity matmul
    positions = [] if s.rope else [
        Instruction(Op.EMBED, flags=Flag.POSITION, rows=rows, dst=v["pe"], n=s.hidden // 2,
                    addr=lay.positions),
        Instruction(Op.MATMUL, flags=to_residual | _blocks_flag(lay), rows=rows, dst=v["x"], src=v["pe"], n=s.hidden,
                    k=s.hidden, addr=lay.position_add)]
    # q and k lie side by side ([q | k | v], heads of whole lines) and rotate by the same
    # table row: one ROPE over both pays the unit's start (the table read) once, where both
    # are int8 or both int16 (ROPE WIDE); an int16 q over an int8 k rotates on its own
    kv_wide = Flag.WIDE if lay.kv_wide else 0
    rope = ([
        Instruction(Op.ROPE, flags=Flag.WIDE, rows=rows, dst=v["qkv"], src=v["qkv"], n=s.heads + s.kv_heads,
                    k=hd, addr=lay.rope),
    ] if kv_wide else [
        Instruction(Op.ROPE, flags=Flag.WIDE, rows=rows, dst=v["qkv"], src=v["qkv"], n=s.heads, k=hd,
                    addr=lay.rope),
        Instruction(Op.ROPE, rows=rows, dst=k_line, src=k_line, n=s.kv_heads, k=hd, addr=lay.rope),
    ] if in16 else [
        Instruction(Op.ROPE, rows=rows, dst=v["qkv"], src=v["qkv"], n=s.heads + s.kv_heads, k=hd,
                    addr=lay.rope),
    ]) if s.rope else []
    # one ACTMUL reads [gate | up] (int16; ungated the int8 gate alone) and writes int16 h, each
    # channel group a segment with its own block (one after the other in "act")
    gated = layout_of(s.model_type).gated
    segments = len(lay.act_groups)
    # h's rows at their own exponents: ACTMUL measures them, down reads them
    row_exp = Flag.ROWEXP if lay.row_exponents else 0
    streams = 2 if gated else 1
    return [
        Instruction(Op.EMBED, rows=rows, dst=v["x"], n=s.hidden, addr=lay.embed),
        *positions,
        Instruction(Op.LOOP, n=s.layers, addr=lay.layer_stride),
        Instruction(Op.RMSNORM, flags=lrel | wide, rows=rows, dst=v["xn"], src=v["x"], n=s.hidden,
                    addr=L("norm1")),
        *_qkv(shape, lay, rows),
        *rope,
        Instruction(Op.KVAPPEND, flags=kv_wide, rows=rows, src=k_line, n=s.kv_heads, k=hd),
        Instruction(Op.ATTN, flags=lrel | wide | in16, rows=rows, dst=v["attn"], src=v["qkv"], n=s.heads, k=hd,
                    addr=L("attn")),
        Instruction(Op.MATMUL, flags=lrel | to_residual | bias("o"), rows=rows, dst=v["x"], src=v["attn"],
                    n=s.hidden, k=s.heads * hd, addr=L("o")),
        Instruction(Op.RMSNORM, flags=lrel | wide, rows=rows, dst=v["xn"], src=v["x"], n=s.hidden,
                    addr=L("norm2")),
        Instruction(Op.MATMUL, flags=lrel | to_int8 | bias("gateup") | (Flag.OUT16 if gated else 0),
                    rows=rows, dst=v["gateup"], src=v["xn"], n=streams * s.intermediate, k=s.hidden,
                    addr=L("gateup")),
        Instruction(Op.ACTMUL, flags=lrel | wide | (Flag.IN16 if gated else Flag.UNGATED) | row_exp, rows=rows,
                    dst=v["h"], src=v["gateup"], n=s.intermediate, k=segments if segments > 1 else 0,
                    addr=L("act")),
        Instruction(Op.MATMUL, flags=lrel | to_residual | bias("down") | row_exp,
                    rows=rows, dst=v["x"], src=v["h"],
                    n=s.hidden, k=s.intermediate, addr=L("down")),
        Instruction(Op.ENDLOOP),
    ]


def _bias_flag(lay: Layout, name: str) -> int:
    """``BIAS`` for a MATMUL whose block carries biases."""
    return Flag.BIAS if name in lay.biased else 0


def _blocks_flag(lay: Layout) -> int:
    """``BLOCKS`` when the image's matrices carry block multipliers."""
    return Flag.BLOCKS if lay.blocks else 0


def _k_line(shape: ModelShape, lay: Layout) -> int:
    """The VMEM line of k in the ``qkv`` region: after q's heads (int16 or int8)."""
    return lay.vmem["qkv"] + query_bytes(shape) * shape.heads * shape.head_dim // lay.line


def _qkv(shape: ModelShape, lay: Layout, rows: int) -> list[Instruction]:
    """q, k and v from the normed row into the ``qkv`` region (``[q | k | v]``): an int16 q
    (MATMUL ``OUT16``) and ``[k | v]`` int8 or int16 (``OUT16``: KVAPPEND WIDE), or with QK-norm an int32 ``[q | k]`` row whose
    heads RMSNORM normalises one by one (segments) to int8, and v on its own."""
    v, s, hd = lay.vmem, shape, shape.head_dim
    L = lambda name: lay.layers_base + lay.sub[name]
    flags = lambda mode, name: Flag.LREL | Flag.WIDE | mode << 1 | _bias_flag(lay, name) | _blocks_flag(lay)
    k_line = _k_line(s, lay)
    if not s.qk_norm:
        # q (int16: OUT16), then k and v on the lines after it
        out16 = Flag.OUT16 if query_bytes(s) == 2 else 0
        kv_out16 = Flag.OUT16 if lay.kv_wide else 0
        return [Instruction(Op.MATMUL, flags=flags(MatmulMode.INT8, "q") | out16, rows=rows,
                            dst=v["qkv"], src=v["xn"], n=s.heads * hd, k=s.hidden, addr=L("q")),
                Instruction(Op.MATMUL, flags=flags(MatmulMode.INT8, "kv") | kv_out16, rows=rows, dst=k_line,
                            src=v["xn"], n=2 * s.kv_heads * hd, k=s.hidden, addr=L("kv"))]
    v_line = k_line + s.kv_heads * hd // lay.line
    k32_line = v["qk32"] + 4 * s.heads * hd // lay.line
    return [
        Instruction(Op.MATMUL, flags=flags(MatmulMode.INT32, "qk"), rows=rows, dst=v["qk32"], src=v["xn"],
                    n=s.qk_out, k=s.hidden, addr=L("qk")),
        Instruction(Op.MATMUL, flags=flags(MatmulMode.INT8, "v"), rows=rows, dst=v_line, src=v["xn"],
                    n=s.kv_heads * hd, k=s.hidden, addr=L("v")),
        Instruction(Op.RMSNORM, flags=Flag.LREL, rows=rows, dst=v["qkv"], src=v["qk32"], n=hd, k=s.heads,
                    addr=L("qnorm")),
        Instruction(Op.RMSNORM, flags=Flag.LREL, rows=rows, dst=k_line, src=k32_line, n=hd, k=s.kv_heads,
                    addr=L("knorm")),
    ]


# -- the whole compile ----------------------------------------------------------------------
def load_config(model_dir: str | Path):
    """The HF config of the draft in a local directory, checked to be one the compiler
    supports (cheap: no weights are read)."""
    from dfvg_host.checkpoints import CheckpointError, load_checkpoint_config

    path = Path(model_dir)
    if not (path / "config.json").is_file():
        raise CompileError(f"{path} has no config.json: pass a local Hugging Face model directory")
    try:
        hf_config = load_checkpoint_config(path, "the draft")
    except CheckpointError as exc:
        raise CompileError(str(exc)) from None
    describe_model(hf_config)
    return hf_config


def load_model(model_dir: str | Path, *, random_weights: bool = False, seed: int = 0):
    """Load a float32 HF causal LM from a local directory (no hub access)."""
    import torch
    from transformers import AutoModelForCausalLM

    from dfvg_host.checkpoints import CheckpointError, load_causal_lm

    path = Path(model_dir)
    hf_config = load_config(path)
    if random_weights:
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32)
    else:
        try:
            model = load_causal_lm(path, torch.float32, "draft")
        except CheckpointError as exc:
            raise CompileError(str(exc)) from None
    return model.eval()


#: What a user can pass instead when a draft has no tokenizer of its own.
_TOKENIZER_HELP = ("pass --tokenizer DIR (a directory holding the draft's tokenizer), "
                   "--calibration-tokens FILE (calibration token ids, whitespace-separated) "
                   "or --random-weights (random weights, for sizing only)")


def require_tokenizer(tokenizer_dir: Path) -> None:
    """A :class:`CompileError` that says what to pass instead unless ``tokenizer_dir`` holds
    tokenizer files; cheap, so a caller checks before any slow work."""
    if not has_tokenizer(tokenizer_dir):
        raise CompileError(f"{tokenizer_dir} has no tokenizer files ({', '.join(TOKENIZER_FILES)}) "
                           f"to tokenise the calibration text: {_TOKENIZER_HELP}")


def load_tokenizer(tokenizer_dir: Path):
    """The tokenizer in ``tokenizer_dir`` for the calibration text; a :class:`CompileError`
    that says what to pass instead when there is none."""
    from dfvg_host.checkpoints import CheckpointError, load_tokenizer as load_checked
    require_tokenizer(tokenizer_dir)
    try:
        return load_checked(tokenizer_dir, "calibration")
    except CheckpointError as exc:
        raise CompileError(f"{exc}; or {_TOKENIZER_HELP}") from None


def read_token_ids(path: Path) -> list[int]:
    """Calibration token ids from a text file of whitespace-separated integers."""
    try:
        return [int(w) for w in path.read_text().split()]
    except ValueError as exc:
        raise CompileError(f"{path} is not a calibration token file (whitespace-separated "
                           f"integer token ids): {exc}") from None


def calibration_sequences(model_dir: Path, text: str | None, vocab: int, *,
                          token_ids: list[int] | None = None, tokenizer_dir: Path | None = None,
                          seq_len: int = 128, max_tokens: int = 4096,
                          seed: int = 0) -> list[list[int]]:
    """Token sequences for calibration: ``token_ids``, else the text tokenised by the
    tokenizer in ``tokenizer_dir`` (default ``model_dir``), else random ids."""
    if token_ids is not None:
        ids = list(token_ids)[:max_tokens]
        source = "the calibration token file"
    elif text:
        tokenizer_dir = Path(tokenizer_dir or model_dir)
        ids = load_tokenizer(tokenizer_dir)(text)["input_ids"][:max_tokens]
        source = f"the tokenizer in {tokenizer_dir}"
    else:
        ids = np.random.default_rng(seed).integers(0, vocab, max_tokens).tolist()
        source = "random ids"
    bad = [i for i in ids if not 0 <= i < vocab]
    if bad:
        raise CompileError(f"calibration token id {bad[0]} from {source} is outside the draft's "
                           f"vocabulary of {vocab}: the tokenizer does not belong to this draft; "
                           f"{_TOKENIZER_HELP}")
    if len(ids) < 2:
        raise CompileError(f"calibration needs at least 2 tokens, {source} gave {len(ids)}")
    return [ids[i:i + seq_len] for i in range(0, len(ids), seq_len) if len(ids[i:i + seq_len]) > 1]


def compile_draft(model_dir: str | Path, engine: EngineConfig, *, calibration_text: str | None = None,
                  calibration_tokens: list[int] | None = None, tokenizer_dir: str | Path | None = None,
                  random_weights: bool = False, model=None, draft_vocab: int | None = None,
                  weight_blocks: bool | None = None, row_exponents: bool | None = None) -> CompiledDraft:
    """Compile the draft at ``model_dir`` for ``engine``, calibrating its activation scales
    on ``calibration_tokens``, else ``calibration_text`` (tokenised by the tokenizer in
    ``tokenizer_dir``, default ``model_dir``), else random ids. ``draft_vocab``: the engine
    drafts over that many of the model's tokens (:mod:`dfvg_host.draft_vocab`).
    ``weight_blocks``: block-scaled int8 weights, one scale per ``reduce`` inputs of a row
    (MATMUL ``BLOCKS``, numerics.md §13.2), for an engine that has them; ``None`` (the
    default): wherever it has (:func:`resolve_weight_blocks`). ``row_exponents``: ``h`` at
    a power-of-two scale per row (``ROWEXP``, numerics.md §13.2), for a model whose down
    projections have no bias (else :class:`CompileError`); ``None`` (the default): wherever
    they have none (OPT's fc2 has one: one static scale). Both together with a KV cache
    wider than int8 are what takes SmolLM2-135M past 97 % (numerics.md §13.7)."""
    weight_blocks = resolve_weight_blocks(engine, weight_blocks)
    model_dir = Path(model_dir)
    model = model if model is not None else load_model(model_dir, random_weights=random_weights)
    shape = describe_model(model.config)
    check_fits(shape, engine, draft_vocab)
    seqs = calibration_sequences(model_dir, calibration_text, shape.vocab, token_ids=calibration_tokens,
                                 tokenizer_dir=tokenizer_dir)
    cal = calibrate(model, seqs, shape)
    vocabulary = None
    if draft_vocab is not None:
        counts = np.bincount(np.concatenate(seqs), minlength=shape.vocab)
        frequent = [int(t) for t in np.argsort(-counts, kind="stable") if counts[t]]
        vocabulary = choose_draft_vocabulary(shape.vocab, draft_vocab, special=_special_ids(model.config),
                                             frequent=frequent)
    image, lay, scales = build_image(model, shape, cal, engine, vocabulary, weight_blocks, row_exponents)
    room = engine.mem_bytes - MemoryMap.IMAGE
    if len(image) > room:
        raise DoesNotFit(f"image of {len(image)} bytes exceeds the {room} bytes of device memory "
                         f"the '{engine.name}' preset leaves for it (mem_bytes = {engine.mem_bytes})")
    lay.vmem = allocate_vmem(shape, engine)
    width = tree_width(lay.vmem, engine)
    program, tree_pc = emit_program(shape, lay, width)
    if len(program) > engine.imem_words:
        raise DoesNotFit(f"program of {len(program)} instructions exceeds imem_words = "
                         f"{engine.imem_words}")
    manifest = dict(
        engine=engine.to_dict(), model=asdict(shape),
        model_dir=str(model_dir.resolve()), random_weights=random_weights,
        context_limit=min(engine.kv_positions, shape.max_positions),
        image_bytes=len(image), program_words=len(program),
        calibration=dict(tokens=cal.tokens, source="tokens" if calibration_tokens is not None
                         else "text" if calibration_text else "random ids"),
        layout=asdict(lay), scales=scales,
        tree=dict(width=width, pc=tree_pc, row_pitch=lay.vmem["row_lines"] if width else 0),
    )
    if vocabulary is not None:
        manifest["draft_vocab"] = vocabulary.to_dict()
    return CompiledDraft(image, program, manifest)


def _special_ids(hf_config) -> list[int]:
    """BOS, EOS and PAD ids the config names (EOS may be a list)."""
    ids = []
    for name in ("bos_token_id", "eos_token_id", "pad_token_id"):
        value = getattr(hf_config, name, None)
        ids += value if isinstance(value, list) else [] if value is None else [value]
    return [int(i) for i in ids]
