"""What a transport is: the :class:`Transport` protocol every draft device offers, and
:class:`TransportError`, the error of a device that cannot be opened or of an access to
it that failed.

Kept apart from :mod:`dfvg_host.transport` (which opens devices by URL and so imports
each transport) so that a transport such as :mod:`dfvg_host.xdma` can derive its errors
from :class:`TransportError` without importing its own opener.
"""

from __future__ import annotations

from typing import Protocol

__all__ = ["Transport", "TransportError"]


class TransportError(RuntimeError):
    """A device URL that cannot be opened, or a register access, DMA or interrupt wait
    that failed (:class:`~dfvg_host.xdma.XdmaError` derives from it).

    A failed access may be transient (a dropped or timed-out PCIe transaction): the
    driver retries it a bounded number of times (:class:`~dfvg_host.transport.
    RetryingTransport`) before it gives up on the device.
    """


class Transport(Protocol):
    """What the driver needs from a device, and nothing more."""

    def read32(self, offset: int) -> int: ...
    def write32(self, offset: int, value: int) -> None: ...
    def dma_write(self, addr: int, data: bytes) -> None: ...
    def dma_read(self, addr: int, nbytes: int) -> bytes: ...
    def wait_irq(self, timeout_s: float) -> bool: ...
    def close(self) -> None: ...
