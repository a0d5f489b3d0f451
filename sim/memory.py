"""Device memory (HBM/DDR) as the engine and the DMA engines see it."""

from __future__ import annotations

import numpy as np

__all__ = ["DeviceMemory", "MemoryError_"]


class MemoryError_(IndexError):
    """An access outside device memory."""


class DeviceMemory:
    """Byte-addressed device memory of ``size`` bytes, allocated as it is touched.

    Backing storage grows to the highest address written, so a 16 GiB HBM model costs
    only what an image uses. Unwritten bytes read as zero.

    Members
    -------
    size : int
        Capacity in bytes; accesses at or beyond it raise :class:`MemoryError_`.
    """

    def __init__(self, size: int):
        self.size = size
        self._buf = np.zeros(0, dtype=np.uint8)
        self._write_listeners = []

    def _check(self, addr: int, n: int):
        if addr < 0 or n < 0 or addr + n > self.size:
            raise MemoryError_(f"device-memory access [0x{addr:x}, 0x{addr + n:x}) outside "
                               f"the {self.size}-byte memory")

    def write(self, addr: int, data) -> None:
        data = np.frombuffer(bytes(data), dtype=np.uint8) if not isinstance(data, np.ndarray) \
            else np.ascontiguousarray(data).view(np.uint8).reshape(-1)
        self._check(addr, data.size)
        end = addr + data.size
        if end > self._buf.size:
            grown = np.zeros(max(end, min(self.size, 2 * self._buf.size)), dtype=np.uint8)
            grown[:self._buf.size] = self._buf
            self._buf = grown
        self._buf[addr:end] = data
        for listener in self._write_listeners:
            listener(addr, data.size)

    def view(self, addr: int, n: int) -> np.ndarray:
        """Read-only uint8 view of ``n`` bytes (zeros past the written part)."""
        self._check(addr, n)
        if addr + n <= self._buf.size:
            v = self._buf[addr:addr + n]
            v = v.view()
            v.flags.writeable = False
            return v
        out = np.zeros(n, dtype=np.uint8)
        have = max(0, min(self._buf.size - addr, n))
        if have:
            out[:have] = self._buf[addr:addr + have]
        return out

    def read(self, addr: int, n: int) -> bytes:
        return self.view(addr, n).tobytes()

    def on_write(self, listener) -> None:
        """Call ``listener(addr, nbytes)`` after every write (used to drop decoded caches)."""
        self._write_listeners.append(listener)
