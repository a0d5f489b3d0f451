"""Two int8 products in one DSP48E2 multiplier: operands that meet the same multiplicand.

A DSP48E2 multiplies 27 × 18 bits. Two narrow operands ``hi`` and ``lo`` in ``[−128, 128]``
(int8 values, or the matrix unit's 9-bit digits) that are multiplied by the same int8 ``w``
pack into its 27-bit port as ``a = hi · 2^18 + lo`` (:func:`packed_operand`; ``|a| ≤ 2^25 +
2^7 < 2^26``), and one product ``p = a · w = hi·w · 2^18 + lo·w`` carries both: ``|lo·w| ≤
2^14 < 2^17``, so the low 18 bits of ``p`` are ``lo·w`` in two's complement, and ``hi·w =
(p >> 18) + p[17]`` (the floor of the high part borrowed one when ``lo·w`` is negative). :func:`unpacked_products`
returns the three pieces; a caller summing many ``hi`` products may add the borrow bits as
a popcount inside its adder tree instead of one adder per product.

Used by the matrix unit (rows ``2i`` and ``2i + 1`` of a tile meet the same weight) and the
attention unit's score pass (two banks' K rows meet the same query element). The query
is up to 11 bits there (ATTN ``IN16``, saturated to ``±1023``), which still packs:
``|lo·w| ≤ 128 · 1023 < 2^17``. K elements wider than int8 (``cfg.kv_bits > 8``) do not
pack, and the attention unit multiplies them one product a DSP.
"""

from __future__ import annotations

from amaranth import Value

__all__ = ["PACK_SHIFT", "PACKED_BITS", "packed_operand", "unpacked_products"]

#: where ``hi`` sits in the packed operand: 18 bits hold ``lo·w`` with its sign
PACK_SHIFT = 18
#: width of the signed packed operand: the DSP48E2's 27-bit multiplier port
PACKED_BITS = 9 + PACK_SHIFT


def packed_operand(hi, lo) -> Value:
    """``hi · 2^PACK_SHIFT + lo``, as a ``PACKED_BITS``-wide signed value."""
    return ((Value.cast(hi) << PACK_SHIFT) + lo)[:PACKED_BITS].as_signed()


def unpacked_products(p) -> tuple[Value, Value, Value]:
    """``(hi_floor, borrow, lo_product)`` of a packed product ``p = (hi·2^18 + lo) · w``:
    ``hi·w = hi_floor + borrow`` and ``lo·w = lo_product`` (18-bit signed)."""
    p = Value.cast(p)
    return p >> PACK_SHIFT, p[PACK_SHIFT - 1], p[:PACK_SHIFT].as_signed()
