"""Layout of the weights image in device memory, shared by the compiler and the engine.

The image is one contiguous, relocatable block; every address in a program is a byte
offset from its base. It starts with a 256-byte header (little-endian 32-bit words, see
:class:`ImageHeader`). Operand blocks follow, each 16-byte aligned:

* **Matrix weights** for an ``N × K`` matmul: int8, padded to ``Np × Kp`` (multiples of
  the engine's lanes and reduce), stored tile by tile — ``[Np/lanes][Kp/reduce][lanes]
  [reduce]`` — so the matrix unit reads one contiguous ``lanes·reduce`` burst per cycle;
  then ``Np`` requantisation words ``mult | shift << 16``. A ``BLOCKS`` block puts a
  scale tile (the u16 block multipliers of the next ``reduce/2`` tiles) before every run
  of ``reduce/2`` tiles of a group (:func:`tile_weights` with ``scales``).
* **RMSNORM parameters**: word ``eps``, word ``gamma_shift``, 8 zero words, then
  ``gamma`` as int16 ``[N]``.
* **ATTN parameters**: word ``mult | shift << 16``, word ``n_kv_heads``, 2 zero words.
* **ACTMUL parameters** (one block per channel segment, consecutive): word
  ``mult | shift << 16``, word ``first`` (the segment's first channel; ignored in the
  first block), 2 zero words, then the int16 activation LUT ``[256]`` indexed by
  ``gate + 128``.
* **Embedding table**: int32 ``[vocab][hidden]`` at the residual scale (EMBED copies a row
  into the int32 residual stream).
* **RoPE table**: int16 ``[positions][head_dim/2][cos, sin]`` (Q1.14).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, fields

import numpy as np

from dfvg_hw.spec.numerics import ROW_EXP_MAX

__all__ = [
    "IMAGE_MAGIC", "IMAGE_VERSION", "HEADER_BYTES", "ALIGN", "ImageHeader",
    "padded", "embed_row_stride", "tile_weights", "untile_weights", "matmul_bytes", "pack_qparams",
    "scale_run_tiles", "group_tiles", "weight_area_bytes", "untile_scales",
    "unpack_qparams", "requant_record_bytes", "pack_requant_records", "unpack_requant_records", "NORM_PARAM_BYTES", "ATTN_PARAM_BYTES", "ACT_PARAM_BYTES",
    "pack_norm_params", "pack_attn_params", "pack_act_params", "align",
]

IMAGE_MAGIC = 0x47564644  # "DFVG"
IMAGE_VERSION = 2       #: 2: int32 residual stream and embedding table (issue #13)
HEADER_BYTES = 256
ALIGN = 16
NORM_PARAM_BYTES = 40     # + 2·N gamma bytes
ATTN_PARAM_BYTES = 16
ACT_PARAM_BYTES = 16 + 512


def align(x: int, a: int = ALIGN) -> int:
    return (x + a - 1) // a * a


def padded(x: int, multiple: int) -> int:
    return (x + multiple - 1) // multiple * multiple


def embed_row_stride(n: int, beat_bytes: int) -> int:
    """Bytes between consecutive rows of an EMBED table of ``n`` int32 entries a row: the
    row padded to whole engine beats (``EngineConfig.mem_beat_bytes``), so every row
    starts on a beat whatever the width (docs/isa.md §3.2)."""
    return padded(4 * n, beat_bytes)


@dataclass
class ImageHeader:
    """The image header: the model's shape and where each block lives.

    The engine never reads it (programs carry every address); the host reads it to check
    that an image, its program and the engine belong together.
    """
    lanes: int
    reduce: int
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    rope_positions: int
    layer_stride: int
    layers_base: int
    embed_addr: int
    rope_addr: int
    final_norm_addr: int
    lm_head_addr: int
    image_bytes: int
    magic: int = IMAGE_MAGIC
    version: int = IMAGE_VERSION

    _ORDER = ("magic", "version", "lanes", "reduce", "hidden", "layers", "heads", "kv_heads",
              "head_dim", "intermediate", "vocab", "rope_positions", "layer_stride",
              "layers_base", "embed_addr", "rope_addr", "final_norm_addr", "lm_head_addr",
              "image_bytes")

    def pack(self) -> bytes:
        words = [getattr(self, name) for name in self._ORDER]
        return struct.pack(f"<{len(words)}I", *words).ljust(HEADER_BYTES, b"\0")

    @classmethod
    def unpack(cls, data: bytes) -> "ImageHeader":
        n = len(cls._ORDER)
        if len(data) < 4 * n:
            raise ValueError("image is shorter than its header")
        values = dict(zip(cls._ORDER, struct.unpack(f"<{n}I", data[:4 * n])))
        if values["magic"] != IMAGE_MAGIC:
            raise ValueError(f"not a DFVG image (magic 0x{values['magic']:08x})")
        if values["version"] != IMAGE_VERSION:
            raise ValueError(f"image format version {values['version']}, this tool reads "
                             f"{IMAGE_VERSION}; recompile the draft")
        return cls(**values)


def scale_run_tiles(reduce: int) -> int:
    """Weight tiles that share one scale tile in a ``BLOCKS`` block: ``reduce / 2``, so
    that their ``lanes`` u16 multipliers each (``reduce/2 · lanes · 2`` bytes) fill exactly
    one tile (``lanes · reduce`` bytes), and a scale tile is whole bus beats wherever a
    weight tile is."""
    return reduce // 2


def group_tiles(k_tiles: int, reduce: int, blocks: bool) -> int:
    """Tiles (``lanes·reduce`` bytes each) one output group occupies: its ``k_tiles``
    weight tiles, and with ``blocks`` one scale tile before every run of
    :func:`scale_run_tiles` of them."""
    t = scale_run_tiles(reduce)
    return k_tiles + (-(-k_tiles // t) if blocks else 0)


def weight_area_bytes(n: int, k: int, lanes: int, reduce: int, blocks: bool = False) -> int:
    """Bytes of a matmul block before its requantisation records: ``Np·Kp``, and with
    ``blocks`` the scale tiles too."""
    npad, k_tiles = padded(n, lanes), padded(k, reduce) // reduce
    return npad // lanes * group_tiles(k_tiles, reduce, blocks) * lanes * reduce


def tile_weights(w: np.ndarray, lanes: int, reduce: int, scales: np.ndarray | None = None) -> np.ndarray:
    """int8 ``[N, K]`` → zero-padded tile-major bytes (see the module docstring).

    With ``scales`` (the u16 block multipliers ``[N, ceil(K/reduce)]``, docs/isa.md §4.2)
    each group's tiles are cut into runs of :func:`scale_run_tiles`, and each run is
    preceded by a scale tile: multiplier ``m[i, t]`` of the run's ``u``-th tile at byte
    ``2·(u·lanes + i mod lanes)`` (little-endian), entries past ``N`` or past the last
    tile zero."""
    n, k = w.shape
    npad, kpad = padded(n, lanes), padded(k, reduce)
    full = np.zeros((npad, kpad), dtype=np.int8)
    full[:n, :k] = w
    tiles = full.reshape(npad // lanes, lanes, kpad // reduce, reduce).transpose(0, 2, 1, 3)
    if scales is None:
        return np.ascontiguousarray(tiles).reshape(-1)
    groups, k_tiles, t = npad // lanes, kpad // reduce, scale_run_tiles(reduce)
    runs = -(-k_tiles // t)
    m = np.zeros((npad, runs * t), dtype="<u2")
    m[:n, :k_tiles] = scales
    # [group][run][u][lane] u16 → one lanes·reduce-byte tile per (group, run)
    m = m.reshape(groups, lanes, runs, t).transpose(0, 2, 3, 1)
    scale_tiles = np.ascontiguousarray(m).view(np.int8).reshape(groups, runs, lanes * reduce)
    out = []
    for g in range(groups):
        for r in range(runs):
            out.append(scale_tiles[g, r])
            out.append(tiles[g, r * t:(r + 1) * t].reshape(-1))
    return np.concatenate(out)


def _weight_tiles(data: np.ndarray, n: int, k: int, lanes: int, reduce: int, blocks: bool) -> np.ndarray:
    """The block's tiles as ``[groups][group_tiles][lanes·reduce]`` int8 (scale tiles kept)."""
    npad, k_tiles = padded(n, lanes), padded(k, reduce) // reduce
    per_group = group_tiles(k_tiles, reduce, blocks)
    return np.asarray(data, dtype=np.int8)[:npad // lanes * per_group * lanes * reduce].reshape(
        npad // lanes, per_group, lanes * reduce)


def _is_scale_tile(k_tiles: int, reduce: int) -> np.ndarray:
    t = scale_run_tiles(reduce)
    return np.arange(group_tiles(k_tiles, reduce, True)) % (t + 1) == 0


def untile_weights(data: np.ndarray, n: int, k: int, lanes: int, reduce: int,
                   blocks: bool = False) -> np.ndarray:
    """Inverse of :func:`tile_weights`: the ``[N, K]`` int8 matrix (``blocks``: of a block
    with scale tiles, which are skipped)."""
    npad, kpad = padded(n, lanes), padded(k, reduce)
    tiles = _weight_tiles(data, n, k, lanes, reduce, blocks)
    if blocks:
        tiles = tiles[:, ~_is_scale_tile(kpad // reduce, reduce)]
    tiles = tiles.reshape(npad // lanes, kpad // reduce, lanes, reduce)
    return tiles.transpose(0, 2, 1, 3).reshape(npad, kpad)[:n, :k]


def untile_scales(data: np.ndarray, n: int, k: int, lanes: int, reduce: int) -> np.ndarray:
    """The block multipliers ``[N, ceil(K/reduce)]`` (int64) of a ``BLOCKS`` block."""
    npad, k_tiles = padded(n, lanes), padded(k, reduce) // reduce
    t = scale_run_tiles(reduce)
    tiles = _weight_tiles(data, n, k, lanes, reduce, True)[:, _is_scale_tile(k_tiles, reduce)]
    groups, runs = tiles.shape[:2]
    m = np.ascontiguousarray(tiles).view("<u2").reshape(groups, runs, t, lanes)
    m = m.transpose(0, 3, 1, 2).reshape(npad, runs * t)
    return m[:n, :k_tiles].astype(np.int64)


def requant_record_bytes(lanes: int, bias: bool) -> int:
    """Bytes of one output group's requantisation record after the tiles: its ``lanes``
    requant words, then (``BIAS``) its ``lanes`` int32 biases."""
    return (8 if bias else 4) * lanes


def matmul_bytes(n: int, k: int, lanes: int, reduce: int, bias: bool = False,
                 blocks: bool = False) -> int:
    """Bytes of one matmul operand block: tiles (with ``blocks`` their scale tiles) plus
    requantisation records."""
    return align(weight_area_bytes(n, k, lanes, reduce, blocks)
                 + requant_record_bytes(lanes, bias) * (padded(n, lanes) // lanes))


def pack_requant_records(mult: np.ndarray, shift: np.ndarray, bias: np.ndarray | None,
                         n_padded: int, lanes: int) -> bytes:
    """The requantisation records of a matmul block (isa.md §4.2): without a bias the
    ``n_padded`` requant words; with one, per group of ``lanes`` channels its words and
    then its int32 biases."""
    words = pack_qparams(mult, shift, n_padded)
    if bias is None:
        return words.tobytes()
    b = np.zeros(n_padded, dtype="<i4")
    b[:len(bias)] = bias
    groups = n_padded // lanes
    return np.stack([words.view("<i4").reshape(groups, lanes), b.reshape(groups, lanes)],
                    axis=1).tobytes()


def unpack_requant_records(data: np.ndarray, n: int, lanes: int, bias: bool
                           ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(mult, shift, bias)`` of the first ``n`` channels from a block's records (``data``:
    the bytes after the tiles); the bias is 0 without ``BIAS``."""
    records = np.asarray(data, dtype=np.uint8).view("<u4")
    if not bias:
        mult, shift = unpack_qparams(records[:n])
        return mult, shift, np.zeros(n, dtype=np.int64)
    groups = -(-n // lanes)
    rec = records[:2 * lanes * groups].reshape(groups, 2, lanes)
    mult, shift = unpack_qparams(rec[:, 0].reshape(-1)[:n])
    return mult, shift, rec[:, 1].reshape(-1)[:n].view("<i4").astype(np.int64)


def pack_qparams(mult: np.ndarray, shift: np.ndarray, n_padded: int) -> np.ndarray:
    words = np.zeros(n_padded, dtype="<u4")
    words[:len(mult)] = (np.asarray(mult, np.uint32) & 0xFFFF) | (np.asarray(shift, np.uint32) << 16)
    return words


def unpack_qparams(words: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    words = np.asarray(words, dtype=np.int64)
    return words & 0xFFFF, (words >> 16) & 0x3F


def pack_norm_params(eps: int, gamma: np.ndarray, gamma_shift: int) -> bytes:
    head = struct.pack("<2I", eps, gamma_shift).ljust(NORM_PARAM_BYTES, b"\0")
    return head + np.asarray(gamma, dtype="<i2").tobytes()


def pack_attn_params(mult: int, shift: int, kv_heads: int) -> bytes:
    return struct.pack("<2I", (mult & 0xFFFF) | (shift << 16), kv_heads).ljust(ATTN_PARAM_BYTES, b"\0")


def pack_act_params(mult: int, shift: int, lut: np.ndarray, first: int = 0, exp_max: int = 0) -> bytes:
    """One ACTMUL segment's block: ``mult | shift << 16``, then ``first | exp_max << 16``
    (the row exponent budget of an ACTMUL with ``ROWEXP``, read from the first segment's
    block only; docs/isa.md §3.8),
    then the 256-entry int16 table."""
    assert len(lut) == 256 and 0 <= first < 1 << 16 and 0 <= exp_max <= ROW_EXP_MAX
    head = struct.pack("<2I", (mult & 0xFFFF) | (shift << 16), first | exp_max << 16).ljust(16, b"\0")
    return head + np.asarray(lut, dtype="<i2").tobytes()
