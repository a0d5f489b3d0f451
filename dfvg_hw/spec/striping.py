"""Striping: how the engine's one address space lies across its memory channels.

The engine addresses device memory as one *logical* byte space of ``mem_bytes`` bytes
(every address in an instruction, a descriptor or a register is logical). The space is cut
into engine beats of ``B = mem_ports · P`` bytes (``P`` = ``mem_port_bits / 8``), and engine
beat ``b`` is stored as ``mem_ports`` port beats side by side: bytes ``[p·P, (p+1)·P)`` of
it are port ``p``'s beat ``b``, at *physical* address ``p · C + b · P`` (``C`` =
``mem_channel_bytes``, the channel behind port ``p`` starting at ``p · C``)::

    logical   | beat 0: port0 port1 … | beat 1: port0 port1 … | …
    channel p | port p's slice of beat 0 | of beat 1 | …        (contiguous)

So every matrix tile, weight stream and table the compiler lays out is spread over all
channels, and a read of ``n`` consecutive engine beats is the same read of ``n`` port beats
on every channel at once. With one port the map is the identity.

Only what moves data between the host and a card's physical memory needs this map: the
XDMA transport, and the simulated memories behind the RTL's ports. Everything above them
(the compiler, the functional and cycle models, the driver) sees the logical space.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from dfvg_hw.spec.config import EngineConfig

__all__ = ["Striping"]


@dataclass(frozen=True)
class Striping:
    """The logical-to-physical map of one engine configuration.

    Members
    -------
    ports : int
        Memory channels (``mem_ports``).
    port_bytes : int
        ``P``: bytes per port beat.
    channel_bytes : int
        ``C``: bytes of each channel; channel ``p`` is physical ``[p·C, (p+1)·C)``.
    """

    ports: int
    port_bytes: int
    channel_bytes: int

    @classmethod
    def for_config(cls, config: EngineConfig) -> "Striping":
        return cls(config.mem_ports, config.port_bytes, config.mem_channel_bytes)

    @property
    def beat_bytes(self) -> int:
        """``B``: bytes of one engine beat."""
        return self.ports * self.port_bytes

    @property
    def size(self) -> int:
        return self.ports * self.channel_bytes

    def physical(self, logical: int) -> int:
        """The physical address of one logical byte."""
        beat, offset = divmod(logical, self.beat_bytes)
        port, byte = divmod(offset, self.port_bytes)
        return port * self.channel_bytes + beat * self.port_bytes + byte

    def logical(self, physical: int) -> int:
        """The logical address of one physical byte (the inverse of :meth:`physical`)."""
        port, rest = divmod(physical, self.channel_bytes)
        beat, byte = divmod(rest, self.port_bytes)
        return beat * self.beat_bytes + port * self.port_bytes + byte

    def port_of(self, physical: int) -> int:
        """The port (channel) a physical address belongs to."""
        return physical // self.channel_bytes

    def pieces(self, logical: int, nbytes: int) -> list[tuple[int, int, int]]:
        """A logical range as ``(port, physical, offset)`` runs: ``offset`` is where the
        run starts in the range, and each run is at most one port beat long, in logical
        order. With one port it is the range itself."""
        if self.ports == 1:
            return [(0, logical, 0)] if nbytes else []
        out, pos, end = [], logical, logical + nbytes
        while pos < end:
            run = min(end, (pos // self.port_bytes + 1) * self.port_bytes) - pos
            out.append((self.port_of(self.physical(pos)), self.physical(pos), pos - logical))
            pos += run
        return out

    def to_channels(self, logical: int, data: bytes | np.ndarray) -> list[tuple[int, int, np.ndarray]]:
        """Split data written at a logical address into one contiguous physical run per
        port, ``(port, physical, bytes)``; the range must cover whole engine beats (the
        host pads what it writes to them)."""
        data = np.frombuffer(bytes(data), dtype=np.uint8) if not isinstance(data, np.ndarray) \
            else np.ascontiguousarray(data).view(np.uint8).reshape(-1)
        self._check_whole_beats(logical, data.size)
        beats = data.reshape(-1, self.ports, self.port_bytes)
        first = logical // self.beat_bytes
        return [(p, p * self.channel_bytes + first * self.port_bytes,
                 np.ascontiguousarray(beats[:, p, :]).reshape(-1)) for p in range(self.ports)]

    def from_channels(self, logical: int, runs: list[np.ndarray]) -> np.ndarray:
        """The inverse of :meth:`to_channels`: one run per port (in port order, as read
        from ``physical`` addresses :meth:`to_channels` names) back into logical order."""
        if len(runs) != self.ports:
            raise ValueError(f"need {self.ports} channel runs, got {len(runs)}")
        stacked = np.stack([np.asarray(r, dtype=np.uint8).reshape(-1, self.port_bytes)
                            for r in runs], axis=1)
        out = stacked.reshape(-1)
        self._check_whole_beats(logical, out.size)
        return out

    def _check_whole_beats(self, logical: int, nbytes: int) -> None:
        if logical % self.beat_bytes or nbytes % self.beat_bytes:
            raise ValueError(f"striped transfer [0x{logical:x}, +{nbytes}) does not cover whole "
                             f"{self.beat_bytes}-byte engine beats")
        if logical + nbytes > self.size:
            raise ValueError(f"striped transfer [0x{logical:x}, +{nbytes}) is outside the "
                             f"{self.size}-byte memory")
