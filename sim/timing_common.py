"""Timing primitives the cycle model's parts share: VMEM lines and window accesses."""

from __future__ import annotations

from dfvg_hw.spec import timing as tm
from dfvg_hw.spec.config import VMEM_LINE_BYTES

__all__ = ["LINE"]

LINE = VMEM_LINE_BYTES


def _lines(byte_addr: int, nbytes: int) -> int:
    """VMEM lines that ``nbytes`` at VMEM byte ``byte_addr`` touch."""
    return (byte_addr % LINE + nbytes + LINE - 1) // LINE if nbytes else 0


def _window(byte_addr: int, nbytes: int) -> int:
    """A gather or scatter through ``VmemWindow``: the request state, then lines + 2."""
    return _lines(byte_addr, nbytes) + tm.WINDOW_ACCESS
