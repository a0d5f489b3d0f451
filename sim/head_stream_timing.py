"""Cycle model of the head streams (dfvg_hw/head_stream.py) that ROPE and KVAPPEND read
and write their heads through.

An operand is ``rows`` rows of ``row_bytes`` bytes (whole heads of ``k``), each from
byte ``skip`` of its first VMEM line; its lines are peeked in order, and line ``j``
carries ``amounts[j]`` of its bytes. The functions here give what the sequencers'
formulas need: the lines, the line each head ends in, and the recurrence of a
:class:`~dfvg_hw.head_stream.HeadCutter` that reads a line ahead feeding a pipeline
that takes a head a cycle. All figures are *modelled*.
"""

from __future__ import annotations

from bisect import bisect_left
from functools import lru_cache
from itertools import accumulate

from dfvg_hw.spec import timing as tm

__all__ = ["run_lines", "head_end_lines", "head_end_line", "streamed_heads"]


def run_lines(row_bytes: int, rows: int, line: int, skip: int = 0) -> list[int]:
    """Bytes of the operand in each line the cutter (or packer) visits, in order."""
    lines = []
    for _ in range(rows if row_bytes else 0):
        left, room = row_bytes, line - skip
        while left:
            lines.append(min(left, room))
            left -= lines[-1]
            room = line
    return lines


def head_end_lines(amounts: list[int], k: int, heads: int) -> list[int]:
    """For each head (``k`` bytes, back to back over ``amounts``), the index of the line
    its last byte is in (-1 for an empty head)."""
    ends = list(accumulate(amounts))
    return [bisect_left(ends, (h + 1) * k) if k else -1 for h in range(heads)]


def head_end_line(h: int, k: int, line: int, skip: int = 0) -> int:
    """:func:`head_end_lines` of one row, in closed form: the line head ``h`` of ``k``
    bytes ends in, the row starting ``skip`` bytes into its first line (-1 for an empty
    head). KVAPPEND's row can be ``65535 · 65535`` bytes, whose line list is 4 GiB."""
    return ((h + 1) * k + skip - 1) // line if k else -1


@lru_cache(maxsize=4096)
def streamed_heads(n: int, k: int, rows: int, line: int, start: int, ready: int) -> int:
    """The cycle the :class:`~dfvg_hw.head_stream.HeadPacker` pokes the last line of a
    ROPE of ``rows × n`` heads of ``k`` bytes (rows from a line's first byte) streamed
    cutter → Rope → packer, when the cutter peeks from cycle ``start`` and the Rope takes
    heads from cycle ``ready`` (the table row). Per line ``j`` and head ``h``:

    * the cutter peeks line ``j`` a cycle after line ``j − 1``, once the bytes it holds
      and has peeked (``B_j``), less the heads taken by then, are fewer than ``k + L``
      (a line ahead): once head ``m_j − 1`` is taken, ``m_j = ⌊(B_j − L)/k⌋``;
    * head ``h`` enters the Rope a cycle after head ``h − 1``, from ``ready``, and
      ``tm.HEAD_CUTTER_LATENCY`` after the peek of the line it ends in;
    * the Rope's output joins the packer ``tm.ROPE_LATENCY`` later, and output line
      ``j`` (the same layout) is poked a cycle after the head its last byte is in has
      joined (``tm.HEAD_PACKER_LATENCY``), a cycle after line ``j − 1``.

    The packer's queue (``head_dim + L`` bytes) never holds a head back here: it takes
    heads no faster than a head a cycle and gives up a line a cycle, and the cutter
    delivers lines no faster than it takes them."""
    amounts = run_lines(n * k, rows, line)
    before = [0, *accumulate(amounts)]             # B_j: bytes of the lines before line j
    ends = head_end_lines(amounts, k, rows * n)
    peeks: list[int] = []
    taken: list[int] = []

    def take(h: int) -> None:
        at = max(ready, peeks[ends[h]] + tm.HEAD_CUTTER_LATENCY)
        taken.append(at if h == 0 else max(at, taken[-1] + 1))

    for j in range(len(amounts)):
        m = max(0, (before[j] - line) // k)
        while len(taken) < m:
            take(len(taken))
        peeks.append(max(start if j == 0 else peeks[-1] + 1, taken[m - 1] if m else start))
    while len(taken) < rows * n:
        take(len(taken))
    poked = None
    for j in range(len(amounts)):
        joined = taken[(before[j + 1] - 1) // k] + tm.ROPE_LATENCY + tm.HEAD_PACKER_LATENCY
        poked = joined if poked is None else max(joined, poked + 1)
    return poked
