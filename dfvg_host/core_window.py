"""One draft core of a card with several (``EngineConfig.draft_cores``, ``DraftCores``).

A card built with several cores has one register space per core, side by side — core
``i``'s register map at ``i << register_space_bits()`` (docs/registers.md) — one device
memory that every core reads and writes, and one interrupt line per core. The host drives
each core as a draft device of its own: :class:`CoreWindow` is the
:class:`~dfvg_host.transport_base.Transport` of one core (its registers, the card's
memory), and :func:`core_memory_base` gives each core its own slice of device memory, so
that the driver of each (``DraftDevice(…, memory_base=…)``) places its image, program and
request and result buffers where no other core's driver does. The image could be shared
between cores running the same draft; each gets its own copy here, which keeps every core
independent of what the others load.
"""

from __future__ import annotations

import time

from dfvg_hw.spec.regmap import MemoryMap, Reg, register_space_bits
from dfvg_host.transport_base import Transport

__all__ = ["CoreWindow", "core_memory_base", "core_memory_bytes"]


def core_memory_bytes(mem_bytes: int, cores: int) -> int:
    """Bytes of device memory each of ``cores`` cores gets: an equal share, rounded down
    to the driver's 4 KiB alignment."""
    return (mem_bytes // cores) & ~0xFFF


def core_memory_base(mem_bytes: int, cores: int, core: int) -> int:
    """Where core ``core``'s slice of device memory starts."""
    return core * core_memory_bytes(mem_bytes, cores)


class CoreWindow:
    """The transport of core ``core`` of a multi-core card.

    Register offsets are the core's (its window added); DMA goes to the card's memory, and
    an access outside the core's slice raises ``IndexError`` (as an access past a device's
    memory does), so one core's driver cannot overwrite another core's buffers.

    Members
    -------
    card : Transport
        The whole card: the register spaces of every core side by side, and the memory.
    core : int
    memory_base, memory_bytes : int
        The core's slice of device memory.
    """

    #: how often :meth:`wait_irq` looks at the core's interrupt status when the card
    #: cannot wait on one core's line
    POLL_S = 50e-6

    def __init__(self, card: Transport, core: int, cores: int, mem_bytes: int):
        if not 0 <= core < cores:
            raise ValueError(f"core {core} of a card with {cores} cores")
        self.card = card
        self.core = core
        self.window = core << register_space_bits()
        self.memory_bytes = core_memory_bytes(mem_bytes, cores)
        self.memory_base = core * self.memory_bytes
        if self.memory_bytes <= MemoryMap.IMAGE:
            raise ValueError(f"{cores} cores leave each {self.memory_bytes} bytes of device memory, "
                             f"less than the driver's buffers ({MemoryMap.IMAGE} bytes)")

    def _check(self, addr: int, nbytes: int) -> None:
        if not (self.memory_base <= addr and addr + nbytes <= self.memory_base + self.memory_bytes):
            raise IndexError(f"device-memory access [0x{addr:x}, 0x{addr + nbytes:x}) outside core "
                             f"{self.core}'s slice [0x{self.memory_base:x}, "
                             f"0x{self.memory_base + self.memory_bytes:x})")

    def read32(self, offset: int) -> int:
        return self.card.read32(self.window + offset)

    def write32(self, offset: int, value: int) -> None:
        self.card.write32(self.window + offset, value)

    def dma_write(self, addr: int, data: bytes) -> None:
        self._check(addr, len(data))
        self.card.dma_write(addr, data)

    def dma_read(self, addr: int, nbytes: int) -> bytes:
        self._check(addr, nbytes)
        return self.card.dma_read(addr, nbytes)

    def wait_irq(self, timeout_s: float) -> bool:
        """Wait for this core's interrupt: on its own line where the card has one
        (``wait_core_irq``), else by watching its ``IRQ_STATUS`` register."""
        wait_core = getattr(self.card, "wait_core_irq", None)
        if wait_core is not None:
            return wait_core(self.core, timeout_s)
        deadline = time.monotonic() + timeout_s
        while True:
            if self.read32(Reg.IRQ_STATUS) & self.read32(Reg.IRQ_ENABLE):
                return True
            if time.monotonic() >= deadline:
                return False
            time.sleep(self.POLL_S)

    def close(self) -> None:
        """Nothing: the card is closed by whoever opened it, once for all its cores."""
