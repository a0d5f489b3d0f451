"""Query/key balancing per RoPE pair, folded into ``q_proj`` and ``k_proj`` (issue #13).

A score is ``q · k``. Scaling key pair ``(i, i + D/2)`` of KV head ``h`` by ``1/c`` and the
same pair of every query head that reads ``h`` by ``c`` leaves every score unchanged, and
RoPE rotates a pair as a whole, so it commutes with the factor: the float model is the
same. On the engine the key is int8 at one scale per layer (the KV cache) while the query
is read with 11 bits (ATTN ``IN16``): a real checkpoint's keys have a few pairs far larger
than the rest (SmolLM2-135M: pair norms over two orders of magnitude), which set the int8
scale alone. Balancing moves part of that range into the query, which has the bits::

    c[h, i] = (K[h, i] / max K) ** alpha,   K[h, i] = the calibrated maximum norm of pair i of KV head h

so a key pair's range grows by ``1/c`` towards the largest and the query's shrinks by ``c``.
Measured on SmolLM2-135M (docs/numerics.md §13.7): alpha 0.5 and 1 gave the same top-1,
0.5 the better worst-position cosine.
"""

from __future__ import annotations

import numpy as np

__all__ = ["QK_BALANCE_ALPHA", "balance_factors", "balanced_maxima", "row_factors"]

#: How far the key pairs move towards the largest: 0 leaves them, 1 equalises them.
QK_BALANCE_ALPHA = 0.5


def balance_factors(k_pairs: np.ndarray, alpha: float = QK_BALANCE_ALPHA) -> np.ndarray:
    """``c[h, i]`` (≤ 1) from the keys' calibrated pair-norm maxima ``k_pairs[h, i]``; a
    pair never seen (0) gets the factor of the smallest seen one's floor, so it is not
    scaled without bound."""
    k_pairs = np.asarray(k_pairs, np.float64)
    top = float(k_pairs.max())
    if top <= 0:
        return np.ones_like(k_pairs)
    return (np.maximum(k_pairs, top * 1e-6) / top) ** alpha


def balanced_maxima(q_pairs: np.ndarray, k_pairs: np.ndarray, c: np.ndarray) -> tuple[float, float]:
    """The query's and the key's largest pair norms after balancing (each pair's norm scales
    by its factor exactly): ``q_pairs[heads, D/2]``, ``k_pairs[kv_heads, D/2]``."""
    group = len(q_pairs) // len(k_pairs)
    return (float((q_pairs * np.repeat(c, group, axis=0)).max()),
            float((k_pairs / c).max()))


def row_factors(c: np.ndarray, heads: int) -> tuple[np.ndarray, np.ndarray]:
    """Per output row of ``q_proj`` (``heads · D``) and ``k_proj`` (``kv_heads · D``): the
    factor the row (and its bias) is multiplied by, ``c`` and ``1/c``, pair ``i`` being
    elements ``i`` and ``i + D/2`` of a head."""
    per_kv_row = np.concatenate([c, c], axis=1)
    group = heads // len(c)
    return np.repeat(per_kv_row, group, axis=0).reshape(-1), (1.0 / per_kv_row).reshape(-1)
