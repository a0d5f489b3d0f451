"""Timing primitives the cycle model's parts share: VMEM lines (of the config's
``vmem_line_bytes``) and window accesses, and the memory path (the memory port and the simulated memory behind it).

The memory path has two views (dfvg_hw/controller.py): the MATMUL sequencer reads whole
engine beats (:meth:`PortTiming.for_config`), every other part reads one channel's beat
at a time through the :class:`~dfvg_hw.beat_narrower.BeatNarrower`
(:meth:`PortTiming.for_units`): its beats are the pieces of the engine beats, one a
cycle at most, cut combinationally from the memory port's output register."""

from __future__ import annotations

from dataclasses import dataclass, replace
from math import ceil

from dfvg_hw.spec import numerics as nx
from dfvg_hw.spec import timing as tm
from dfvg_hw.spec.config import EngineConfig
from sim.axi_memory import READ_CREDIT

__all__ = ["NEVER", "UNIT_OVERHEAD", "READ_OVERHEAD", "PAGE", "RES_BYTES", "window_cycles", "PortTiming",
           "axi_bursts", "ReadCredit", "LineSplitter"]

UNIT_OVERHEAD = tm.UNIT_OVERHEAD
READ_OVERHEAD = tm.MEM_READ_OVERHEAD
PAGE = tm.AXI_BOUNDARY_BYTES
#: Bytes of a residual-stream element (int32): EMBED rows, RMSNORM sources, RESADD rows.
RES_BYTES = nx.RES_BITS // 8
NEVER = -10 ** 9     #: "long before": a time that constrains nothing


def _lines(byte_addr: int, nbytes: int, line: int) -> int:
    """VMEM lines of ``line`` bytes that ``nbytes`` at VMEM byte ``byte_addr`` touch."""
    return (byte_addr % line + nbytes + line - 1) // line if nbytes else 0


def window_cycles(byte_addr: int, nbytes: int, line: int) -> int:
    """A gather or scatter through ``VmemWindow`` (VMEM lines of ``line`` bytes): the
    request state, then lines + 2."""
    return _lines(byte_addr, nbytes, line) + tm.WINDOW_ACCESS


# -- the memory path ---------------------------------------------------------------------------
@dataclass(frozen=True)
class PortTiming:
    """The memory path as one reader sees it.

    ``bus_bytes`` is the beat the reader takes: the engine beat on the wide path, one
    channel's beat (``D``) on the narrow one, where each engine beat arrives as ``pieces``
    (``k = W/D``) beats. ``beats_per_cycle`` is the rate of the *engine* beats (each
    channel's memory delivers ``p`` a cycle). ``skip`` is the pieces a read skips in its
    first engine beat (:meth:`at`), 0 on the wide path. ``line`` is the bytes of the lines
    the reader cuts its beats into: the config's VMEM line.
    """

    latency: int        #: L
    bus_bytes: int      #: B: the beat the reader takes
    beats_per_cycle: float  #: p: engine beats a cycle
    line: int           #: bytes of a line the beats are cut into (the VMEM line)
    page: int = PAGE    #: logical bytes of an AXI page: 4 KiB of each channel
    pieces: int = 1     #: k: reader beats per engine beat
    skip: int = 0       #: s: pieces the read skips in its first engine beat

    @classmethod
    def for_config(cls, config: EngineConfig) -> "PortTiming":
        """The wide path: whole engine beats (the MATMUL sequencer's)."""
        return cls(config.mem_latency_cycles, config.mem_beat_bytes,
                   config.port_beats_per_cycle, config.vmem_line_bytes, PAGE * config.mem_ports)

    @classmethod
    def for_units(cls, config: EngineConfig) -> "PortTiming":
        """The narrow path: one channel's beat, behind the BeatNarrower (every part but
        the MATMUL sequencer). Use :meth:`at` for a read's ``skip``."""
        return cls(config.mem_latency_cycles, config.port_bytes, config.port_beats_per_cycle,
                   config.vmem_line_bytes, PAGE * config.mem_ports, pieces=config.mem_ports)

    def with_line(self, line: int) -> "PortTiming":
        """The same path cut into lines of ``line`` bytes (ACTMUL's parameter block is
        read as 16-byte lines, whatever the VMEM line)."""
        return replace(self, line=line)

    def at(self, addr: int) -> "PortTiming":
        """The timing of a read issued at device byte ``addr`` (a multiple of
        ``bus_bytes``; the reader's own command): its first engine beat's skipped
        pieces."""
        return replace(self, skip=addr % (self.bus_bytes * self.pieces) // self.bus_bytes)

    @property
    def engine_beat_bytes(self) -> int:
        return self.bus_bytes * self.pieces

    @property
    def lines_per_beat(self) -> int:
        return self.bus_bytes // self.line

    def _engine_beat_offset(self, j: int) -> int:
        """Cycles from a read's first engine beat to its engine beat ``j`` on the port
        (the memory's token bucket full at the start, refilled ``p`` a cycle)."""
        return ceil(j / self.beats_per_cycle - 1e-9)

    def beat_offset(self, i: int) -> int:
        """Cycles from a read's first beat to its beat ``i``. On the narrow path beat
        (piece) ``i`` is in engine beat ``(s + i) // k`` and leaves no earlier than that
        engine beat is on the port and no earlier than the cycle after piece ``i − 1``
        (the narrower passes one a cycle and holds the engine beat until its last piece
        is taken, so a held beat never delays the next one past that)."""
        if self.pieces == 1:
            return self._engine_beat_offset(i)
        return i + _lateness(self.beats_per_cycle, self.pieces, self.skip, (self.skip + i) // self.pieces)

    def arrival(self, i: int, first: int) -> int:
        """Cycle a LineAligner takes input line ``i`` of a read whose first beat is on the
        port in cycle ``first`` (the beat-to-lines Gearbox adds a register and passes one
        line a cycle)."""
        lpb = self.lines_per_beat
        return first + tm.GEARBOX_LATENCY + max(i, self.beat_offset(i // lpb) + i % lpb)

    def emit(self, j: int, first: int, skip: int, length: int) -> int:
        """Cycle the LineAligner of an UnalignedReader emits output line ``j`` of a read of
        ``length`` bytes starting ``skip`` bytes into its first beat: it drops
        ``skip // line`` lines, holds one, and emits when the next line arrives (or one
        cycle after the last)."""
        d = skip // self.line
        n_in = ceil((length + skip) / self.bus_bytes) * self.lines_per_beat
        if d + j + 1 < n_in:
            return self.arrival(d + j + 1, first)
        return self.arrival(n_in - 1, first) + tm.LINE_ALIGNER_LATENCY


_LATENESS: dict[tuple[float, int, int], list[int]] = {}


def _lateness(p: float, k: int, s: int, beats: int) -> int:
    """``max(0, max over engine beats 1 ≤ j ≤ beats of ⌈j/p⌉ − (j·k − s))``: how far the
    engine beats' arrival holds a read's pieces back (a prefix maximum, kept per
    ``(p, k, s)`` since the cycle model asks for it piece after piece)."""
    table = _LATENESS.setdefault((p, k, s), [0])
    while len(table) <= beats:
        j = len(table)
        table.append(max(table[-1], ceil(j / p - 1e-9) - (j * k - s)))
    return table[beats]


def axi_bursts(addr: int, nbytes: int, bus_bytes: int, page: int = PAGE) -> list[int]:
    """Beats of each burst the memory port splits a read into (``page``: 4 KiB of each
    channel; 256 beats); a block that does not start on a beat is read from the beat it
    starts in."""
    skip = addr % bus_bytes
    addr -= skip
    beats, out = ceil((skip + nbytes) / bus_bytes), []
    while beats:
        b = min(beats, (page - addr % page) // bus_bytes, tm.AXI_MAX_BURST_BEATS)
        out.append(b)
        beats -= b
        addr += b * bus_bytes
    return out


class ReadCredit:
    """The simulated memory's read rate limit (:mod:`sim.axi_memory`): ``p`` beats a
    cycle; the credit is capped at one beat after a cycle in which no read beat was
    offered or due, and at ``READ_CREDIT`` beats after one in which one was."""

    def __init__(self, p: float):
        self.p, self.last, self.tokens = p, NEVER, 1.0

    def offer(self, t: int, due: int, held_until: int) -> int:
        """The first cycle ``>= t`` the memory offers the next beat, whose burst is due
        in cycle ``due`` (``t >= due``), the previous beat having been offered in
        ``self.last`` and taken in ``held_until``; spends the beat's credit."""
        p, tokens, c = self.p, self.tokens, self.last

        def refill(to: int, cap: float):
            nonlocal tokens, c
            if to > c:
                tokens = min(cap, tokens + p * (to - c)) if c > NEVER else min(cap, 1.0)
                c = to

        refill(held_until + 1, READ_CREDIT)     # the previous beat was on the bus till taken
        refill(due, 1.0)                        # nothing due: one beat banked at most
        start = max(t, c)
        if tokens < 1:
            start = max(start, c + ceil((1 - tokens) / p - 1e-9))
        refill(start, READ_CREDIT)
        self.tokens, self.last = tokens - 1, start
        return start


class LineSplitter:
    """EMBED's beat-to-line gearbox: it takes a beat when the previous beat's last line
    has left, and passes one line a cycle."""

    def __init__(self, lines_per_beat: int):
        self.split, self.taken = lines_per_beat, NEVER

    def beat(self, i: int, t: int) -> int:
        self.taken = max(t, self.taken + self.split)
        return self.taken

    def free(self, t: int) -> bool:
        """Whether beats offered one a cycle from ``t`` are taken as they come."""
        return self.split == 1 and t > self.taken

    def skip(self, i: int, count: int, t: int):
        """Beats ``i …`` taken one a cycle from ``t``."""
        self.taken = t + count - 1
