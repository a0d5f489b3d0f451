"""Latencies of the banked KV path (``kv_banks``), written once for the RTL and the cycle
model (:mod:`sim.attention_timing`); the common ones live in :mod:`dfvg_hw.spec.timing`.

With ``B = kv_banks`` banks the attention unit takes ``B`` K rows (then ``B`` V rows) a
cycle: ``G = ceil(t / B)`` groups per pass instead of ``t`` rows, and two reduction trees
over the ``B`` lanes that one bank does not have (``ceil(log2 B)`` registered levels each,
0 for one bank): the group's score maximum, and the ``Σ_b e_b·V_b`` column sums ahead of
the accumulators. numpy/stdlib only, like the rest of :mod:`dfvg_hw.spec`.
"""

from __future__ import annotations

from math import gcd

from dfvg_hw.spec import timing as tm

__all__ = ["kv_groups", "kv_words", "bank_tree_levels", "row_packing", "attention_head_cycles",
           "gqa_divide_steps"]


# -- KvSequencer, ATTN: the states around the heads -----------------------------------------
#: CHECK, whose last cycle hands the parameter block's read to the BlockReader once the
#: checks before it have passed.
ATTN_CHECK = 1
#: The BlockReader from taking the command (on CHECK's edge) to ``done``, beyond the port's
#: read overhead, the memory's latency and the block's beats: ISSUE, the block register.
ATTN_PARAMS_DONE = tm.BLOCK_READ_DONE
#: SET_POS (the buffer's POS), beside the parameter read; head 0's q gather follows it.
ATTN_SET_POS = 1
#: Bits of ``n``, the dividend of the GQA group size ``n / G`` (the divider's width).
GQA_DIVIDE_BITS = 16
#: DONE, where a job ends without a head (``n = 0``); a job with heads signals ``done`` in
#: its last scatter's final cycle.
ATTN_DONE = 1


#: Attention: from the reciprocal taking a head's ``E`` to its output valid on ``o``
#: (the reciprocal, the normaliser).
ATTN_RECIP_TO_OUT = tm.ATTN_RECIP_LATENCY + tm.NORMALIZER_LATENCY
#: Attention: the reciprocal takes the next ``E`` this many cycles after the previous one
#: (its latency; the normaliser takes the quotient on the cycle it is valid).
ATTN_RECIP_BUSY = tm.ATTN_RECIP_LATENCY
#: Attention: from the weights pass taking a head to its first weight meeting V: the
#: first score read issued (1), read (1), the exp path.
ATTN_START_TO_JOIN = 1 + 1 + tm.SOFTMAX_EXP_LATENCY
#: Attention: the score groups between a read and its weight meeting V (the read stage, the
#: exp path): the weights pass issues a read only while one of these is free.
ATTN_READ_SLOTS = 1 + tm.SOFTMAX_EXP_LATENCY
#: Attention: score buffers (Attention.SCORE_BUFFERS): heads take them in turn.
ATTN_SCORE_BUFFERS = 3
#: Attention: from a head's last weight meeting V to its ``E`` offered to the reciprocal,
#: beyond the column-sum tree: the product register (1), the accumulator (1).
ATTN_JOIN_TO_DIV = 2
#: Attention: from the last K row taken to the scores complete, beyond the dot-product
#: tree and the B-lane max tree: the product register.
ATTN_SCORES_DONE = 1
#: KVBuffer read channel: from a request's transfer to the channel idle again, beyond its
#: beats (the setup cycle, then an address a cycle; the consumer keeping up).
READ_CHANNEL_BUSY = 2
#: KVBuffer read channel: from a request's transfer to the cycle its last beat is taken,
#: beyond the beats (1 less: the first is valid ``KV_READ_LATENCY`` after the transfer).
READ_TO_LAST_ROW = tm.KV_READ_LATENCY - 1
#: ... and to its first beat valid.
READ_TO_FIRST_ROW = tm.KV_READ_LATENCY


def kv_groups(t: int, banks: int) -> int:
    """Groups of ``banks`` positions that cover positions ``0 … t − 1`` (a READ beat each)."""
    return -(-t // banks)


def gqa_divide_steps(n: int) -> int:
    """KvSequencer, ATTN: cycles of DIVIDE, ``n / G`` by a restoring divider that starts at
    ``n``'s leading one (the quotient bits above it are 0): one a bit of ``n``, at least
    one (the cycle that also checks ``G``)."""
    return max(n.bit_length(), 1)


def kv_words(reduce: int, head_dim: int, banks: int) -> int:
    """KV buffer words per entry: ``head_dim / gcd(reduce, head_dim)`` with one bank (a
    word is one K-slice), 1 with ``banks ≥ 2`` (a bank word is a whole row)."""
    return head_dim // gcd(reduce, head_dim) if banks == 1 else 1


def bank_tree_levels(banks: int) -> int:
    """Registered levels of a reduction over the ``banks`` lanes (0 for one bank)."""
    return tm.ceil_log2(banks)


def row_packing(banks: int) -> int:
    """KvSequencer: registers between the KV buffer's ``rdata`` and the attention unit: the
    gearbox that packs ``W`` words into a row with one bank; none with ``banks ≥ 2`` (a
    beat is already ``banks`` whole rows)."""
    return tm.GEARBOX_LATENCY if banks == 1 else 0


def attention_head_cycles(head_dim: int, t: int, banks: int = 1) -> int:
    """Attention: edges from accepting ``q`` to a valid output over ``t`` positions, the
    streams ready (a group of ``banks`` K or V rows a cycle). ``banks = 1`` is
    :func:`dfvg_hw.spec.timing.attention_head_cycles`."""
    g = kv_groups(t, banks)
    return tm.attention_head_cycles(head_dim, g) + 2 * bank_tree_levels(banks)
