"""An AXI4 slave memory for Amaranth simulation, backed by :class:`sim.memory.DeviceMemory`.

It stands in for HBM/DDR behind the engine's AXI4 master in RTL tests and in the ``rtl``
co-simulation device: bursts read and write the same :class:`DeviceMemory` the host's DMA
fills, with a configurable first-beat latency and bandwidth, optional random stalls, and
error responses. It also checks the master: every AXI rule the engine relies on is an
assertion here (:class:`AXIProtocolError` fails the simulation at the offending cycle).

Usage::

    mem = DeviceMemory(config.mem_bytes)
    slave = AXI4SlaveMemory(dut.axi, mem, MemoryTiming.for_config(config, data_width=128))
    run_simulation(dut, testbench, processes=[slave.process])

For a top-level component with flat ``m_axi_*`` ports pass ``prefix="m_axi_"``.

Timing, counted in clock edges (a transfer happens at the edge where valid and ready
are both high):

* ``read_latency`` L — from the edge that transfers an AR to the edge that can transfer its
  first R beat (L = 1: ``rvalid`` rises right after the AR edge). Later beats of a burst, and
  later bursts whose latency has already elapsed, follow back to back.
* ``write_latency`` — from the edge that transfers a burst's last W beat to the edge that
  can transfer its B response.
* ``beats_per_cycle`` — sustained beats per cycle, reads and writes each (a token bucket
  holding at most one beat, refilled by ``beats_per_cycle`` each cycle; an R beat spends a
  token when it is offered, a W beat when it is taken).
* ``stall`` — probability that the memory, in a given cycle, holds a ready low (AR, AW, W) or
  delays raising a valid (R, B); once raised, a valid stays up until its transfer.

Rules checked (ARM IHI 0022 AXI4): a master valid (AR, AW, W) stays high with a stable
payload until its transfer; bursts are INCR, at most 256 beats, never cross a 4 KiB
boundary; ``wlast`` is high on exactly the last beat of each burst. Limits of the model,
also asserted: full-width beats only (AxSIZE = log2 of the bus bytes) at bus-aligned
addresses — what :class:`dfvg_hw.memory_port.MemoryPort` issues.

Responses: a burst that reaches past the end of the memory gets DECERR, one that touches an
``error_ranges`` interval SLVERR; such reads return zeros and such writes change nothing.

Channels: behind a striped engine (``mem_ports`` > 1, :mod:`dfvg_hw.spec.striping`) there
is one slave per port, each given the port's ``channel`` and the configuration's
:class:`~dfvg_hw.spec.striping.Striping`. Its bus addresses are *physical*; it answers only
for its own channel ``[channel · C, (channel+1) · C)`` (DECERR elsewhere, whatever the
memory's size) and reads and writes each port beat at its logical address
(``Striping.logical``) in the shared, logical :class:`DeviceMemory` the host fills. Each
slave keeps its own latency and token bucket: the preset's per-port rate
(``EngineConfig.port_beats_per_cycle``, :meth:`MemoryTiming.for_config`).
"""

from __future__ import annotations

import random
from collections import deque
from dataclasses import dataclass, field, replace

from dfvg_hw.axi4 import BOUNDARY_BYTES, Burst, MAX_BURST_BEATS, Resp
from dfvg_hw.spec.config import EngineConfig
from dfvg_hw.spec.striping import Striping
from sim.memory import DeviceMemory

__all__ = ["AXI4SlaveMemory", "MemoryTiming", "AXIProtocolError"]


#: Read beats of credit a channel banks while a read streams (one while it is idle): the
#: first beat of a read comes when it is due, beat ``i`` ``ceil(i/p)`` cycles later, and a
#: reader that stalls finds up to this many beats' worth of credit when it resumes.
READ_CREDIT = 2.0


class AXIProtocolError(AssertionError):
    """The master broke an AXI4 rule (or asked for something the model does not do)."""


@dataclass(frozen=True)
class MemoryTiming:
    """How fast the simulated memory answers (see the module docstring for the units).

    Members
    -------
    read_latency : int
        Edges from an AR transfer to its first R transfer (≥ 1).
    write_latency : int
        Edges from a burst's last W transfer to its B transfer (≥ 1).
    beats_per_cycle : float
        Sustained beats per cycle in each direction, 0 < x ≤ 1.
    stall : float
        Per-channel, per-cycle probability of a random stall (0 = none).
    max_outstanding : int
        Bursts the memory queues per direction before it holds AR/AW ready low.
    """

    read_latency: int = 1
    write_latency: int = 1
    beats_per_cycle: float = 1.0
    stall: float = 0.0
    max_outstanding: int = 16

    def __post_init__(self):
        if self.read_latency < 1 or self.write_latency < 1:
            raise ValueError("memory latencies are at least one cycle")
        if not 0 < self.beats_per_cycle <= 1:
            raise ValueError(f"beats_per_cycle must be in (0, 1], not {self.beats_per_cycle}")
        if not 0 <= self.stall < 1:
            raise ValueError(f"stall must be a probability below 1, not {self.stall}")
        if self.max_outstanding < 1:
            raise ValueError("the memory must accept at least one burst")

    @classmethod
    def for_config(cls, config: EngineConfig, data_width: int | None = None, **changes) -> "MemoryTiming":
        """The configured memory seen through each ``data_width``-bit port (default: the
        configuration's ``mem_port_bits``) at the engine clock: latency = ``mem_latency_ns``
        in cycles (both directions), bandwidth = the port's share of the achievable
        bandwidth in beats per cycle (``EngineConfig.port_beats_per_cycle`` at the
        configured width), at most one (a port cannot move more than a beat a cycle,
        whatever the memory could)."""
        rate = config.beats_per_cycle((data_width or config.mem_port_bits) // 8)
        timing = cls(read_latency=config.mem_latency_cycles,
                     write_latency=config.mem_latency_cycles, beats_per_cycle=rate)
        return replace(timing, **changes)


@dataclass
class _Burst:
    addr: int
    beats: int
    resp: Resp
    due: int = 0           # first cycle in which its next beat / its response may be presented
    done_beats: int = 0


@dataclass
class _Held:
    """A master channel's valid and payload in the previous cycle, to check it was held."""
    name: str
    pending: bool = False
    payload: tuple = field(default_factory=tuple)


class AXI4SlaveMemory:
    """AXI4 slave (no IDs, in-order responses) over a :class:`DeviceMemory`.

    Parameters
    ----------
    bus : object
        The master's AXI4 interface (e.g. ``MemoryPort.axi``): attributes ``prefix + name``
        for every :class:`dfvg_hw.axi4.AXI4Signature` member. The data width is read from
        ``wdata``.
    memory : DeviceMemory
        Backing store; its ``size`` is the end of the address space (DECERR beyond; with
        ``striping``, the end of this slave's channel).
    timing : MemoryTiming
    error_ranges : sequence of (start, end)
        Byte ranges ``[start, end)`` that answer SLVERR.
    seed : int
        Seed of the stall generator.
    prefix : str
        Prefix of the bus's member names (``"m_axi_"`` for a top level's flat ports).
    striping : Striping, optional
        The engine's striping; with it, this slave is channel ``channel``'s (see the module
        docstring): physical bus addresses, its own channel only, beats mapped to logical
        ``memory`` addresses. Without it (or with one port) bus addresses are ``memory``'s.
    channel : int
        The channel this slave answers for (with ``striping``).

    Members
    -------
    memory : DeviceMemory
    timing : MemoryTiming
    bytes_per_beat : int
    read_bursts, write_bursts : list of (addr, beats)
        Every burst accepted, in order.
    read_beats, write_beats : int
        Beats transferred.
    cycle : int
        Cycles simulated so far.
    """

    _MASTER_OUT = ("araddr", "arlen", "arsize", "arburst", "arvalid", "rready",
                   "awaddr", "awlen", "awsize", "awburst", "awvalid",
                   "wdata", "wstrb", "wlast", "wvalid", "bready")
    _SLAVE_OUT = ("arready", "rvalid", "rdata", "rresp", "rlast",
                  "awready", "wready", "bvalid", "bresp")

    def __init__(self, bus, memory: DeviceMemory, timing: MemoryTiming = MemoryTiming(), *,
                 error_ranges=(), seed: int = 0, prefix: str = "",
                 striping: Striping | None = None, channel: int = 0):
        self.signals = {name: getattr(bus, prefix + name)
                        for name in self._MASTER_OUT + self._SLAVE_OUT}
        self.memory = memory
        self.timing = timing
        self.bytes_per_beat = len(self.signals["wdata"]) // 8
        self.size_code = self.bytes_per_beat.bit_length() - 1
        self.error_ranges = list(error_ranges)
        if striping is not None and striping.ports > 1:
            if striping.port_bytes != self.bytes_per_beat:
                raise ValueError(f"a {self.bytes_per_beat}-byte bus behind a striping of "
                                 f"{striping.port_bytes}-byte port beats")
            if not 0 <= channel < striping.ports:
                raise ValueError(f"channel {channel} of {striping.ports}")
            self.striping = striping
            self.channel_range = (channel * striping.channel_bytes,
                                  (channel + 1) * striping.channel_bytes)
        else:
            self.striping = None
            self.channel_range = (0, memory.size)
        self.read_bursts: list[tuple[int, int]] = []
        self.write_bursts: list[tuple[int, int]] = []
        self.read_beats = 0
        self.write_beats = 0
        self.cycle = 0
        self._random = random.Random(seed)
        self._reads: deque[_Burst] = deque()      # accepted, not fully returned
        self._writes: deque[_Burst] = deque()     # accepted, data not complete
        self._responses: deque[_Burst] = deque()  # data complete, B not yet transferred
        self._read_tokens = self._write_tokens = 1.0
        self._read_demand = False    # last cycle, a read beat was offered or due (READ_CREDIT)
        self._held = {ch: _Held(ch) for ch in ("ar", "aw", "w")}
        self._rvalid = self._bvalid = False     # a valid offered last cycle, not yet taken

    # -- checks -----------------------------------------------------------------------------
    def _fail(self, why: str):
        raise AXIProtocolError(f"cycle {self.cycle}: {why}")

    def _check_held(self, channel: str, valid: int, ready: int, payload: tuple):
        held = self._held[channel]
        if held.pending:
            if not valid:
                self._fail(f"{channel.upper()}VALID dropped before its transfer")
            if payload != held.payload:
                self._fail(f"{channel.upper()} payload changed while VALID waited for READY: "
                           f"{held.payload} -> {payload}")
        held.pending = bool(valid and not ready)
        held.payload = payload

    def _address(self, channel: str, addr: int, length: int, size: int, burst: int) -> _Burst:
        beats = length + 1
        if burst != Burst.INCR:
            self._fail(f"{channel} burst type {burst}: only INCR is modelled")
        if beats > MAX_BURST_BEATS:
            self._fail(f"{channel} burst of {beats} beats (AXI4 INCR allows {MAX_BURST_BEATS})")
        if size != self.size_code:
            self._fail(f"{channel}SIZE {size}: the model takes full {self.bytes_per_beat}-byte beats only")
        if addr % self.bytes_per_beat:
            self._fail(f"{channel}ADDR 0x{addr:x} is not {self.bytes_per_beat}-byte aligned")
        end = addr + beats * self.bytes_per_beat
        if addr // BOUNDARY_BYTES != (end - 1) // BOUNDARY_BYTES:
            self._fail(f"{channel} burst [0x{addr:x}, 0x{end:x}) crosses a 4 KiB boundary")
        first, past = self.channel_range
        if addr < first or end > past:
            resp = Resp.DECERR
        elif any(addr < hi and lo < end for lo, hi in self.error_ranges):
            resp = Resp.SLVERR
        else:
            resp = Resp.OKAY
        return _Burst(addr, beats, resp)

    def _stalled(self) -> bool:
        return self.timing.stall > 0 and self._random.random() < self.timing.stall

    # -- the data paths -------------------------------------------------------------------
    def _beat_address(self, burst: _Burst) -> int:
        """The memory address of the burst's next beat (a port beat is one contiguous run
        of logical bytes)."""
        addr = burst.addr + burst.done_beats * self.bytes_per_beat
        return addr if self.striping is None else self.striping.logical(addr)

    def _read_beat(self, burst: _Burst) -> int:
        if burst.resp != Resp.OKAY:
            return 0
        addr = self._beat_address(burst)
        return int.from_bytes(self.memory.view(addr, self.bytes_per_beat).tobytes(), "little")

    def _write_beat(self, burst: _Burst, wdata: int, wstrb: int):
        if burst.resp != Resp.OKAY or not wstrb:
            return
        addr = self._beat_address(burst)
        beat = bytearray(self.memory.read(addr, self.bytes_per_beat))
        new = wdata.to_bytes(self.bytes_per_beat, "little")
        for i in range(self.bytes_per_beat):
            if wstrb >> i & 1:
                beat[i] = new[i]
        self.memory.write(addr, bytes(beat))

    async def process(self, ctx):
        """The slave, as an Amaranth simulator process (``Simulator.add_process``, or
        ``run_simulation(..., processes=[slave.process])``): it runs in the background for
        as long as the testbenches do."""
        s = self.signals
        names = self._MASTER_OUT + self._SLAVE_OUT
        async for _, _, *values in ctx.tick().sample(*(s[n] for n in names)):
            v = dict(zip(names, values))       # the values of the cycle that just ended
            self._transfers(v)
            self.cycle += 1
            self._drive(ctx)                   # the slave's outputs for the new cycle

    def _transfers(self, v: dict):
        """Check the master's side of the cycle that ended and act on its transfers."""
        self._check_held("ar", v["arvalid"], v["arready"],
                         (v["araddr"], v["arlen"], v["arsize"], v["arburst"]))
        self._check_held("aw", v["awvalid"], v["awready"],
                         (v["awaddr"], v["awlen"], v["awsize"], v["awburst"]))
        self._check_held("w", v["wvalid"], v["wready"], (v["wdata"], v["wstrb"], v["wlast"]))

        if v["arvalid"] and v["arready"]:
            burst = self._address("AR", v["araddr"], v["arlen"], v["arsize"], v["arburst"])
            burst.due = self.cycle + self.timing.read_latency
            self._reads.append(burst)
            self.read_bursts.append((burst.addr, burst.beats))
        if v["rvalid"] and v["rready"]:
            burst = self._reads[0]
            burst.done_beats += 1
            self.read_beats += 1
            if burst.done_beats == burst.beats:
                self._reads.popleft()
        if v["awvalid"] and v["awready"]:
            burst = self._address("AW", v["awaddr"], v["awlen"], v["awsize"], v["awburst"])
            self._writes.append(burst)
            self.write_bursts.append((burst.addr, burst.beats))
        if v["wvalid"] and v["wready"]:
            burst = self._writes[0]
            final = burst.done_beats == burst.beats - 1
            if bool(v["wlast"]) != final:
                self._fail(f"WLAST = {v['wlast']} on beat {burst.done_beats + 1} of a "
                           f"{burst.beats}-beat burst at 0x{burst.addr:x}")
            self._write_beat(burst, v["wdata"], v["wstrb"])
            self._write_tokens -= 1
            burst.done_beats += 1
            self.write_beats += 1
            if final:
                self._writes.popleft()
                burst.due = self.cycle + self.timing.write_latency
                self._responses.append(burst)
        if v["bvalid"] and v["bready"]:
            self._responses.popleft()
        self._rvalid, self._bvalid = (v["rvalid"] and not v["rready"],
                                      v["bvalid"] and not v["bready"])

    def _drive(self, ctx):
        """Set the slave's outputs for the cycle ``self.cycle``: a valid that waited for
        ready stays up; otherwise a beat or response is offered when it is due, the
        bandwidth allows and no random stall hits."""
        s, t, now = self.signals, self.timing, self.cycle
        # Read credit: up to one beat banked while nothing is due, READ_CREDIT beats while a
        # read streams, so a stream keeps its fractional rate (1.0 would round every beat's
        # leftover away: 1/ceil(1/p) beats a cycle instead of p).
        cap = READ_CREDIT if self._read_demand else 1.0
        self._read_tokens = min(cap, self._read_tokens + t.beats_per_cycle)
        self._write_tokens = min(1.0, self._write_tokens + t.beats_per_cycle)

        ctx.set(s["arready"], len(self._reads) < t.max_outstanding and not self._stalled())
        ctx.set(s["awready"], len(self._writes) + len(self._responses) < t.max_outstanding
                and not self._stalled())

        rvalid = self._rvalid
        if not rvalid and self._reads and self._reads[0].due <= now \
                and self._read_tokens >= 1 and not self._stalled():
            self._read_tokens -= 1
            rvalid = True
        if rvalid:
            burst = self._reads[0]
            ctx.set(s["rdata"], self._read_beat(burst))
            ctx.set(s["rresp"], burst.resp)
            ctx.set(s["rlast"], burst.done_beats == burst.beats - 1)
        ctx.set(s["rvalid"], rvalid)
        self._read_demand = rvalid or bool(self._reads and self._reads[0].due <= now)

        # W is taken only for a burst whose address has arrived (AXI lets a slave wait).
        ctx.set(s["wready"], bool(self._writes) and self._write_tokens >= 1 and not self._stalled())

        bvalid = self._bvalid or (bool(self._responses) and self._responses[0].due <= now
                                  and not self._stalled())
        if bvalid:
            ctx.set(s["bresp"], self._responses[0].resp)
        ctx.set(s["bvalid"], bvalid)
