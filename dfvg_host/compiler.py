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
                           pack_norm_params, pack_qparams, padded, tile_weights)
from dfvg_hw.spec.regmap import MemoryMap
from dfvg_hw.spec.isa import Cond, Flag, Instruction, MatmulMode, Op, encode
from dfvg_host.checkpoints import TOKENIZER_FILES, has_tokenizer
from dfvg_host.compiled_draft import CompiledDraft, ModelShape

__all__ = ["CompileError", "UnsupportedModel", "DoesNotFit", "ModelShape", "CompiledDraft",
           "describe_model", "check_fits", "calibrate", "compile_draft", "emit_program"]

SUPPORTED = ("llama",)


class CompileError(Exception):
    """A draft that cannot be compiled; the message is one line naming the limit."""


class UnsupportedModel(CompileError):
    pass


class DoesNotFit(CompileError):
    pass


def describe_model(hf_config) -> ModelShape:
    """The shape of a supported HF config; anything else raises :class:`UnsupportedModel`."""
    mt = getattr(hf_config, "model_type", "?")
    if mt not in SUPPORTED:
        raise UnsupportedModel(f"model_type '{mt}' is not supported (supported: "
                               f"{', '.join(SUPPORTED)})")
    for attr in ("attention_bias", "mlp_bias"):
        if getattr(hf_config, attr, False):
            raise UnsupportedModel(f"{attr}=True is not supported: the engine's matmuls have no bias")
    heads = hf_config.num_attention_heads
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // heads
    return ModelShape(
        model_type=mt, hidden=hf_config.hidden_size, layers=hf_config.num_hidden_layers,
        heads=heads, kv_heads=getattr(hf_config, "num_key_value_heads", None) or heads,
        head_dim=head_dim, intermediate=hf_config.intermediate_size,
        vocab=hf_config.vocab_size, max_positions=hf_config.max_position_embeddings,
        rms_norm_eps=float(hf_config.rms_norm_eps), hidden_act=hf_config.hidden_act,
        tied_embeddings=bool(getattr(hf_config, "tie_word_embeddings", False)))


def check_fits(shape: ModelShape, engine: EngineConfig) -> None:
    """Raise :class:`DoesNotFit` naming the first engine limit the model exceeds."""
    slots = shape.layers * shape.kv_heads
    if slots > engine.kv_slots:
        # one KV slot per (layer, KV head) pair (docs/isa.md §1.4)
        raise DoesNotFit(f"model needs {shape.layers} layers × {shape.kv_heads} KV heads = "
                         f"{slots} KV slots; the '{engine.name}' preset has kv_slots = "
                         f"{engine.kv_slots}")
    limits = [
        (shape.head_dim, engine.head_dim, "head_dim", "head_dim"),
        (shape.vocab, engine.vocab_max, "vocab", "vocab_max"),
    ]
    for have, cap, what, param in limits:
        if have > cap:
            raise DoesNotFit(f"model {what} {have} exceeds the '{engine.name}' preset's "
                             f"{param} = {cap}")
    if shape.head_dim % VMEM_LINE_BYTES:
        raise DoesNotFit(f"head_dim {shape.head_dim} is not a multiple of {VMEM_LINE_BYTES}")
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

    cal = Calibration(layers=[dict(norm1=0.0, q=0.0, k=0.0, v=0.0, norm2=0.0, gate=np.zeros(shape.intermediate),
                                   up=np.zeros(shape.intermediate), down_in=np.zeros(shape.intermediate))
                              for _ in range(shape.layers)])
    hd = shape.head_dim

    def amax(t) -> float:
        return float(t.detach().abs().max())

    def pair_norm_max(t, heads) -> float:
        # RoPE rotates (i, i + hd/2) pairs; their norm bounds every rotated element.
        t = t.detach().reshape(*t.shape[:-1], heads, 2, hd // 2)
        return float(torch.sqrt((t ** 2).sum(dim=-2)).max())

    hooks = []

    def on(module, fn):
        def hook(_module, inputs, output):
            fn(inputs[0], output)       # returns None: the forward pass is not altered
        hooks.append(module.register_forward_hook(hook))

    def bump(d, key, value):
        d[key] = max(d[key], value)

    def bump_channels(d, key, t):
        d[key] = np.maximum(d[key], t.detach().abs().reshape(-1, t.shape[-1]).amax(0).double().numpy())

    for li, layer in enumerate(model.model.layers):
        st = cal.layers[li]
        on(layer.input_layernorm, lambda i, o, st=st: (setattr(cal, "residual", max(cal.residual, amax(i))),
                                                       bump(st, "norm1", amax(o))))
        on(layer.post_attention_layernorm, lambda i, o, st=st: (
            setattr(cal, "residual", max(cal.residual, amax(i))), bump(st, "norm2", amax(o))))
        att, mlp = layer.self_attn, layer.mlp
        on(att.q_proj, lambda i, o, st=st: bump(st, "q", pair_norm_max(o, shape.heads)))
        on(att.k_proj, lambda i, o, st=st: bump(st, "k", pair_norm_max(o, shape.kv_heads)))
        on(att.v_proj, lambda i, o, st=st: bump(st, "v", amax(o)))
        on(mlp.gate_proj, lambda i, o, st=st: bump_channels(st, "gate", o))
        on(mlp.up_proj, lambda i, o, st=st: bump_channels(st, "up", o))
        on(mlp.down_proj, lambda i, o, st=st: bump_channels(st, "down_in", i))
    on(model.model.norm, lambda i, o: (setattr(cal, "residual", max(cal.residual, amax(i))),
                                       setattr(cal, "final_norm", max(cal.final_norm, amax(o)))))
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
def _weight_int8(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Symmetric int8 per output channel: (int8 weights, per-row scale).

    An all-zero row gets scale 0: its requantisation multiplier is then 0 as well."""
    scale = np.abs(w).max(axis=1) / 127.0
    safe = np.where(scale > 0, scale, 1.0)
    return np.clip(np.round(w / safe[:, None]), -127, 127).astype(np.int8), scale


def _act_scale(absmax: float, bits: int = 8) -> float:
    return max(absmax, 1e-8) / ((1 << (bits - 1)) - 1)


#: Bits of headroom the int32 residual keeps above its calibrated maximum: text from
#: another domain than the calibration text may drive it further.
RESIDUAL_HEADROOM_BITS = 2


def _residual_scale(sd: dict, cal: Calibration, layer_scales: list["LayerScales"]) -> float:
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
        p = f"model.layers.{li}."
        w_down = sd[p + "mlp.down_proj.weight"][:, ls.order] * ls.u
        for s_in, w in ((ls.o, sd[p + "self_attn.o_proj.weight"]), (ls.h, w_down)):
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
#: takes the rest): each group has its own gate and up scales, LUT and ACTMUL. Multiples
#: of 8, so that every group starts on a VMEM line in gate/up (int8) and in h (int16).
ACT_GROUP_SIZES = (8, 8, 16, 32, 64, 128)


def act_groups(intermediate: int) -> list[int]:
    """The ACTMUL groups of an MLP of ``intermediate`` channels (one group if it is not a
    multiple of 8)."""
    if intermediate % 8:
        return [intermediate]
    groups, rest = [], intermediate
    for size in ACT_GROUP_SIZES:
        if rest - size < 8:
            break
        groups.append(size)
        rest -= size
    return groups + [rest]


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

    @classmethod
    def calibrated(cls, c: dict, w_down: np.ndarray) -> "LayerScales":
        # Matmul inputs are wide (int16); q, k, v (the KV cache), gate and up stay int8.
        order = np.argsort(-c["gate"], kind="stable")
        gate_max, up_max, h_max = c["gate"][order], c["up"][order], c["down_in"][order]
        u = up_down_smoothing(up_max, w_down[:, order])
        groups = tuple(act_groups(len(order)))
        spans = _group_bounds(groups)
        s_v = _act_scale(c["v"])
        return cls(n1=_act_scale(c["norm1"], 16), q=_act_scale(c["q"]), k=_act_scale(c["k"]), v=s_v,
                   o=s_v / 2 ** (16 - nx.ACT_BITS),       # wide attention output: V's scale / 2^8
                   n2=_act_scale(c["norm2"], 16), order=order, groups=groups,
                   gate=tuple(_act_scale(float(gate_max[a:b].max())) for a, b in spans),
                   up=tuple(_act_scale(float((up_max / u)[a:b].max())) for a, b in spans),
                   h=_act_scale(float(np.max(h_max / u)), 16), u=u)

    def to_dict(self) -> dict:
        return dict(norm1=self.n1, q=self.q, k=self.k, v=self.v, norm2=self.n2, gate=list(self.gate),
                    up=list(self.up), down_in=self.h, act_groups=list(self.groups))


def _norm_block(gamma: np.ndarray, hidden: int, eps: float, s_x: float, s_out: float) -> bytes:
    """RMSNORM parameters for a wide (int16) output at scale ``s_out``."""
    # numerics.rmsnorm keeps 8 more fractional bits for an int16 output: take them out of gamma.
    real = math.sqrt(hidden) * gamma.astype(np.float64) / s_out / 2 ** (16 - nx.ACT_BITS)
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


def _matmul_block(w_int8: np.ndarray, requant_real: np.ndarray, engine: EngineConfig) -> bytes:
    n, k = w_int8.shape
    mult, shift = nx.host_multiplier(requant_real)
    tiles = tile_weights(w_int8, engine.lanes, engine.reduce).tobytes()
    block = tiles + pack_qparams(mult, shift, padded(n, engine.lanes)).tobytes()
    return block.ljust(matmul_bytes(n, k, engine.lanes, engine.reduce), b"\0")


@dataclass
class Layout:
    """Addresses (image offsets) of every block, and the VMEM map (in lines)."""
    embed: int = 0
    rope: int = 0
    layers_base: int = 0
    layer_stride: int = 0
    sub: dict = field(default_factory=dict)     # offsets within a layer block
    final_norm: int = 0
    lm_head: int = 0
    vmem: dict = field(default_factory=dict)


def build_image(model, shape: ModelShape, cal: Calibration, engine: EngineConfig):
    """Quantise the model and lay out the image; returns (bytes, Layout, scales)."""
    import torch
    from transformers.activations import ACT2FN

    sd = {k: v.detach().to(torch.float64).numpy() for k, v in model.state_dict().items()}
    layer_scales = [LayerScales.calibrated(c, sd[f"model.layers.{li}.mlp.down_proj.weight"])
                    for li, c in enumerate(cal.layers)]
    s_x = _residual_scale(sd, cal, layer_scales)
    b = ImageBuilder(engine.mem_beat_bytes)
    lay = Layout()
    scales = dict(residual=s_x, layers=[])

    emb = sd["model.embed_tokens.weight"]
    # EMBED rows are padded to whole engine beats (embed_row_stride), so each starts on one.
    table = np.zeros((emb.shape[0], embed_row_stride(shape.hidden, engine.mem_beat_bytes) // 4), "<i4")
    table[:, :shape.hidden] = np.clip(np.round(emb / s_x), -(1 << 31), (1 << 31) - 1).astype("<i4")
    lay.embed = b.place(table.tobytes())

    rotary = model.model.rotary_emb
    positions = torch.arange(engine.kv_positions)[None, :]
    cos, sin = rotary(torch.zeros(1, dtype=torch.float64), positions)
    half = shape.head_dim // 2
    lay.rope = b.place(nx.host_rope_table(cos[0, :, :half].double().numpy(),
                                          sin[0, :, :half].double().numpy()).astype("<i2").tobytes())

    act_fn = ACT2FN[shape.hidden_act]
    scaling = float(getattr(model.model.layers[0].self_attn, "scaling", shape.head_dim ** -0.5))
    blocks = []
    for li in range(shape.layers):
        p = f"model.layers.{li}."
        c = cal.layers[li]
        ls = layer_scales[li]
        qd, kd = shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
        parts = {}
        # RMSNorm gains stay in the int16 gamma (folded into the weight columns, a few large
        # gains set each int8 row's range: measured 1.2 points of top-1 on SmolLM2-135M).
        parts["norm1"] = _norm_block(sd[p + "input_layernorm.weight"], shape.hidden,
                                     shape.rms_norm_eps, s_x, ls.n1)
        wqkv = np.concatenate([sd[p + "self_attn.q_proj.weight"], sd[p + "self_attn.k_proj.weight"],
                               sd[p + "self_attn.v_proj.weight"]])
        w8, sw = _weight_int8(wqkv)
        s_out = np.concatenate([np.full(qd, ls.q), np.full(kd, ls.k), np.full(kd, ls.v)])
        parts["qkv"] = _matmul_block(w8, ls.n1 * sw / s_out, engine)
        am, ash = nx.host_multiplier(ls.q * ls.k * scaling * math.log2(math.e) * (1 << nx.EXP_FRAC))
        parts["attn"] = pack_attn_params(int(am), int(ash), shape.kv_heads)
        w8, sw = _weight_int8(sd[p + "self_attn.o_proj.weight"])
        parts["o"] = _matmul_block(w8, ls.o * sw / s_x, engine)
        parts["norm2"] = _norm_block(sd[p + "post_attention_layernorm.weight"], shape.hidden,
                                     shape.rms_norm_eps, s_x, ls.n2)
        # gate/up rows in groups, [gate_0; up_0; gate_1; up_1; ...], channels permuted by ls.order
        w_gate = sd[p + "mlp.gate_proj.weight"][ls.order]
        w_up = sd[p + "mlp.up_proj.weight"][ls.order] / ls.u[:, None]
        spans = _group_bounds(ls.groups)
        w8, sw = _weight_int8(np.concatenate([w for a, b in spans for w in (w_gate[a:b], w_up[a:b])]))
        s_out = np.concatenate([np.repeat([ls.gate[i], ls.up[i]], b - a) for i, (a, b) in enumerate(spans)])
        parts["gateup"] = _matmul_block(w8, ls.n2 * sw / s_out, engine)
        for i in range(len(spans)):
            lut, s_lut = nx.host_act_lut(lambda g: act_fn(torch.from_numpy(g)).numpy(), ls.gate[i])
            m, sh = nx.host_multiplier(s_lut * ls.up[i] / ls.h)
            parts[f"act{i}"] = pack_act_params(int(m), int(sh), lut)
        w8, sw = _weight_int8(sd[p + "mlp.down_proj.weight"][:, ls.order] * ls.u)
        parts["down"] = _matmul_block(w8, ls.h * sw / s_x, engine)
        blocks.append(parts)
        scales["layers"].append(ls.to_dict())

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
    lay.final_norm = b.place(_norm_block(sd["model.norm.weight"], shape.hidden,
                                         shape.rms_norm_eps, s_x, s_fn))
    # A tied lm_head has no entry of its own: quantise the embedding matrix per row.
    lm = sd.get("lm_head.weight", sd["model.embed_tokens.weight"])
    w8, sw = _weight_int8(lm)
    lay.lm_head = b.place(_matmul_block(w8, s_fn * sw * (1 << nx.LOGIT_FRAC), engine))
    scales["final_norm"] = s_fn

    header = ImageHeader(
        lanes=engine.lanes, reduce=engine.reduce, hidden=shape.hidden, layers=shape.layers,
        heads=shape.heads, kv_heads=shape.kv_heads, head_dim=shape.head_dim,
        intermediate=shape.intermediate, vocab=shape.vocab, rope_positions=engine.kv_positions,
        layer_stride=lay.layer_stride, layers_base=lay.layers_base, embed_addr=lay.embed,
        rope_addr=lay.rope, final_norm_addr=lay.final_norm, lm_head_addr=lay.lm_head,
        image_bytes=align(len(b.data), b.beat))
    image = bytearray(b.data.ljust(header.image_bytes, b"\0"))
    image[:HEADER_BYTES] = header.pack()
    return bytes(image), lay, scales


# -- program ------------------------------------------------------------------------------
def allocate_vmem(shape: ModelShape, engine: EngineConfig) -> dict:
    """VMEM regions (in 16-byte lines) for one draft row; ``row_lines`` is the row's whole
    span, the row pitch of a tree forward (docs/isa.md §9.2)."""
    sizes = dict(x=4 * shape.hidden, xn=2 * shape.hidden, qkv=shape.qkv_out,
                 attn=2 * shape.heads * shape.head_dim, gateup=2 * shape.intermediate,
                 h=2 * shape.intermediate)
    vmem, line = {}, 0
    for name, nbytes in sizes.items():
        vmem[name] = line
        line += padded(nbytes, VMEM_LINE_BYTES) // VMEM_LINE_BYTES
    if line * VMEM_LINE_BYTES > engine.vmem_bytes:
        raise DoesNotFit(f"activations need {line * VMEM_LINE_BYTES} bytes of VMEM, the "
                         f"'{engine.name}' preset has vmem_bytes = {engine.vmem_bytes}")
    vmem["row_lines"] = line
    return vmem


def tree_width(vmem: dict, engine: EngineConfig) -> int:
    """The widest tree the program drafts: the engine's rows, as many as VMEM holds rows
    of activations ``row_lines`` apart (0 below two: a one-row tree is a chain)."""
    fits = min(engine.rows, engine.vmem_bytes // (VMEM_LINE_BYTES * vmem["row_lines"]))
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
        Instruction(Op.MATMUL, flags=to_logits, rows=rows, src=v["xn"], n=s.vocab, k=s.hidden,
                    addr=lay.lm_head),
        Instruction(Op.SAMPLE, n=s.vocab),
    ]


def _forward(shape: ModelShape, lay: Layout, rows: int) -> list[Instruction]:
    """The embedding and the layer loop over ``rows`` rows."""
    v, s, hd = lay.vmem, shape, shape.head_dim
    q_lines = s.heads * hd // VMEM_LINE_BYTES
    k_line = v["qkv"] + q_lines
    L = lambda name: lay.layers_base + lay.sub[name]
    wide = Flag.WIDE
    to_int8, to_residual = MatmulMode.INT8 << 1 | wide, MatmulMode.RESADD << 1 | wide
    lrel = Flag.LREL
    return [
        Instruction(Op.EMBED, rows=rows, dst=v["x"], n=s.hidden, addr=lay.embed),
        Instruction(Op.LOOP, n=s.layers, addr=lay.layer_stride),
        Instruction(Op.RMSNORM, flags=lrel | wide, rows=rows, dst=v["xn"], src=v["x"], n=s.hidden,
                    addr=L("norm1")),
        Instruction(Op.MATMUL, flags=lrel | to_int8, rows=rows, dst=v["qkv"], src=v["xn"], n=s.qkv_out,
                    k=s.hidden, addr=L("qkv")),
        Instruction(Op.ROPE, rows=rows, dst=v["qkv"], src=v["qkv"], n=s.heads, k=hd, addr=lay.rope),
        Instruction(Op.ROPE, rows=rows, dst=k_line, src=k_line, n=s.kv_heads, k=hd, addr=lay.rope),
        Instruction(Op.KVAPPEND, rows=rows, src=k_line, n=s.kv_heads, k=hd),
        Instruction(Op.ATTN, flags=lrel | wide, rows=rows, dst=v["attn"], src=v["qkv"], n=s.heads, k=hd,
                    addr=L("attn")),
        Instruction(Op.MATMUL, flags=lrel | to_residual, rows=rows, dst=v["x"], src=v["attn"], n=s.hidden,
                    k=s.heads * hd, addr=L("o")),
        Instruction(Op.RMSNORM, flags=lrel | wide, rows=rows, dst=v["xn"], src=v["x"], n=s.hidden,
                    addr=L("norm2")),
        Instruction(Op.MATMUL, flags=lrel | to_int8, rows=rows, dst=v["gateup"], src=v["xn"],
                    n=2 * s.intermediate, k=s.hidden, addr=L("gateup")),
        *[Instruction(Op.ACTMUL, flags=lrel | wide, rows=rows, dst=v["h"] + 2 * a // VMEM_LINE_BYTES,
                      src=v["gateup"] + 2 * a // VMEM_LINE_BYTES, n=b - a, addr=L(f"act{i}"))
          for i, (a, b) in enumerate(_group_bounds(act_groups(s.intermediate)))],
        Instruction(Op.MATMUL, flags=lrel | to_residual, rows=rows, dst=v["x"], src=v["h"], n=s.hidden,
                    k=s.intermediate, addr=L("down")),
        Instruction(Op.ENDLOOP),
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
                  random_weights: bool = False, model=None) -> CompiledDraft:
    """Compile the draft at ``model_dir`` for ``engine``, calibrating its activation scales
    on ``calibration_tokens``, else ``calibration_text`` (tokenised by the tokenizer in
    ``tokenizer_dir``, default ``model_dir``), else random ids."""
    model_dir = Path(model_dir)
    model = model if model is not None else load_model(model_dir, random_weights=random_weights)
    shape = describe_model(model.config)
    check_fits(shape, engine)
    seqs = calibration_sequences(model_dir, calibration_text, shape.vocab, token_ids=calibration_tokens,
                                 tokenizer_dir=tokenizer_dir)
    cal = calibrate(model, seqs, shape)
    image, lay, scales = build_image(model, shape, cal, engine)
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
    return CompiledDraft(image, program, manifest)
