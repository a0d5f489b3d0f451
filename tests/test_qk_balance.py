"""Query/key balancing (dfvg_host.qk_balance): the float model's scores are unchanged, and
the key pairs' spread shrinks by the exponent alpha."""

import numpy as np

from dfvg_host.qk_balance import balance_factors, balanced_maxima, row_factors


def _rope(x, pos, theta=10000.0):
    """Llama's rotate_half RoPE of heads x[..., D] at position pos."""
    half = x.shape[-1] // 2
    ang = pos * theta ** (-np.arange(half) / half)
    a, b = x[..., :half], x[..., half:]
    return np.concatenate([a * np.cos(ang) - b * np.sin(ang), b * np.cos(ang) + a * np.sin(ang)], -1)


def test_scores_are_unchanged_at_every_position_pair():
    rng = np.random.default_rng(0)
    heads, kv_heads, d, hidden = 6, 2, 8, 24
    w_q, w_k = rng.normal(size=(heads * d, hidden)), rng.normal(size=(kv_heads * d, hidden))
    w_k[3] *= 40.0                                  # one large key pair (rows 3 and 3 + d/2)
    w_k[3 + d // 2] *= 40.0
    k_pairs = rng.uniform(0.1, 50.0, (kv_heads, d // 2))
    c = balance_factors(k_pairs)
    q_rows, k_rows = row_factors(c, heads)
    x = rng.normal(size=(5, hidden))
    group = heads // kv_heads
    assert not np.allclose(q_rows, 1.0)

    def scores(w_q, w_k, m, n):
        q = _rope((x @ w_q.T).reshape(5, heads, d), m)
        k = _rope((x @ w_k.T).reshape(5, kv_heads, d), n)
        return np.einsum("thd,shd->tsh", q, np.repeat(k, group, axis=1))

    for m, n in ((0, 0), (3, 1), (7, 11)):
        np.testing.assert_allclose(scores(w_q * q_rows[:, None], w_k * k_rows[:, None], m, n),
                                   scores(w_q, w_k, m, n), rtol=1e-10, atol=1e-9)


def test_factors_shrink_the_key_pairs_spread_by_alpha():
    k_pairs = np.array([[1.0, 4.0, 64.0], [0.0, 16.0, 2.0]])
    q_pairs = np.ones((4, 3))
    c = balance_factors(k_pairs, alpha=0.5)
    assert c.max() == 1.0 and c[0, 2] == 1.0
    balanced = k_pairs / c
    # a pair at 1/64 of the largest moves to 1/8 of it; a pair never seen stays finite
    np.testing.assert_allclose(balanced[0], [8.0, 16.0, 64.0])
    assert np.isfinite(c).all() and c[1, 0] > 0
    q_max, k_max = balanced_maxima(q_pairs, k_pairs, c)
    assert k_max == 64.0 and q_max == 1.0
    np.testing.assert_array_equal(balance_factors(k_pairs, alpha=0.0), np.ones_like(k_pairs))
