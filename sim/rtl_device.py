"""The ``rtl`` device: the generated :class:`~dfvg_hw.engine.DraftEngine` in Amaranth's
simulator, behind the same transport operations as the ``sim`` device and a card.

* Register reads and writes are AXI4-Lite transactions on the engine's ``s_axil_*``
  ports (:mod:`sim.axi_lite_bus`), cycle by cycle.
* Device memory is a :class:`~sim.memory.DeviceMemory` behind one AXI4 slave model
  (:class:`~sim.axi_memory.AXI4SlaveMemory`) per memory channel, each with the preset's
  latency and its share of the bandwidth; the host's DMA reads and writes it directly, as
  XDMA does on a card. The memory is the engine's *logical* space: the slave of channel
  ``p`` maps the physical addresses on its port to it (:mod:`dfvg_hw.spec.striping`).
* ``wait_irq`` simulates until the engine raises ``irq`` or the wall-clock timeout runs
  out, so a hung engine is a device timeout, as on hardware.
* A configuration with ``draft_cores`` > 1 simulates a card of that many cores
  (:class:`~dfvg_hw.draft_cores.DraftCores`): core ``i``'s registers in window ``i``, one
  memory, and ``wait_core_irq`` waiting for one core's line
  (:class:`dfvg_host.core_window.CoreWindow` drives a core).

Nothing here computes a result: every figure the driver reads comes out of the engine's
registers and the memory the engine wrote.
"""

from __future__ import annotations

import time
from collections import deque
from types import SimpleNamespace

import numpy as np
from amaranth.sim import Simulator

from dfvg_hw.spec.config import EngineConfig
from dfvg_hw.draft_cores import DraftCores
from dfvg_hw.engine import AXIL_PREFIX, DraftEngine
from dfvg_hw.spec.striping import Striping
from sim.axi_lite_bus import axil_read, axil_write
from sim.axi_memory import AXI4SlaveMemory, MemoryTiming
from sim.memory import DeviceMemory

__all__ = ["RtlDevice"]


class RtlDevice:
    """A :class:`DraftEngine` simulated by Amaranth, offering the transport operations.

    Parameters
    ----------
    config : EngineConfig
    data_width : int, optional
        The width of each of the engine's AXI4 masters (default: the configuration's
        ``mem_port_bits``).
    timing : MemoryTiming, optional
        Each channel's memory timing (default: the preset's latency and per-port rate).
    tree_width : int, optional
        The widest tree the engine drafts (``DraftEngine``'s default if None).

    Members
    -------
    config : EngineConfig
    memory : DeviceMemory
    cycles : int
        Clock cycles simulated so far.
    sim_seconds : float
        Wall time spent simulating (for cycles/s).
    """

    def __init__(self, config: EngineConfig, *, data_width: int | None = None,
                 timing: MemoryTiming | None = None, tree_width: int | None = None):
        self.config = config
        self.memory = DeviceMemory(config.mem_bytes)
        # a card with several cores: each its register window, one memory (DraftCores)
        self.engine = (DraftCores(config, data_width) if config.draft_cores > 1
                       else DraftEngine(config, data_width, tree_width))

        timing = timing or MemoryTiming.for_config(config, data_width)
        striping = Striping(config.mem_ports, self.engine.data_width // 8,
                            config.mem_bytes // config.mem_ports)
        #: one slave memory per channel, channel p on the engine's master p
        self.slaves = [AXI4SlaveMemory(self.engine, self.memory, timing, prefix=prefix,
                                       striping=striping, channel=p)
                       for p, prefix in enumerate(self.engine.axi_prefixes)]
        self.slave = self.slaves[0]
        self._bus = SimpleNamespace(**{name: getattr(self.engine, AXIL_PREFIX + name)
                                       for name in self.engine.axil.members})
        self._queue: deque = deque()
        self.cycles = 0
        self.sim_seconds = 0.0
        self._sim = Simulator(self.engine)
        self._sim.add_clock(1e-6 / config.clock_mhz)
        for slave in self.slaves:
            self._sim.add_process(slave.process)
        self._sim.add_testbench(self._host, background=True)

    # -- the host side of the simulation ---------------------------------------------------
    async def _host(self, ctx):
        """Runs the queued register accesses; counts cycles in between."""
        while True:
            if self._queue:
                kind, args, box = self._queue.popleft()
                if kind == "read":
                    box.append(await axil_read(ctx, self._bus, *args))
                elif kind == "kv":
                    kv, = args      # in the model's order, whatever the banking
                    if ctx.get(kv.busy):
                        # busy drops a cycle before an APPEND's or a COPY's trailing write
                        # lands: read the memories once that is in
                        while ctx.get(kv.busy):
                            await ctx.tick()
                            self.cycles += 1
                        await ctx.tick().repeat(2)
                        self.cycles += 2
                    box.append(kv.contents(lambda mem, i: ctx.get(mem.data[i])))
                else:
                    await axil_write(ctx, self._bus, *args)
                    box.append(None)
            else:
                await ctx.tick()
                self.cycles += 1
                if self._until is not None and self._until(ctx):
                    self._until = None

    _until = None

    def _run(self, done, deadline: float | None = None) -> bool:
        """Simulate until ``done()``; False if the wall-clock ``deadline`` passes first."""
        start = time.monotonic()
        try:
            while not done():
                if deadline is not None and time.monotonic() >= deadline:
                    return False
                self._sim.advance()
            return True
        finally:
            self.sim_seconds += time.monotonic() - start

    def _access(self, kind: str, *args):
        box: list = []
        self._queue.append((kind, args, box))
        self._run(lambda: box)
        return box[0]

    # -- transport operations ----------------------------------------------------------------
    def read32(self, offset: int) -> int:
        return self._access("read", offset)

    def write32(self, offset: int, value: int) -> None:
        self._access("write", offset, value & 0xFFFFFFFF)

    def dma_write(self, addr: int, data: bytes) -> None:
        self.memory.write(addr, data)

    def dma_read(self, addr: int, nbytes: int) -> bytes:
        return self.memory.read(addr, nbytes)

    def wait_irq(self, timeout_s: float) -> bool:
        """Simulate until the interrupt (any core's, on a card with several) is raised."""
        return self._wait_for(lambda ctx: ctx.get(self.engine.irq), timeout_s)

    def wait_core_irq(self, core: int, timeout_s: float) -> bool:
        """Simulate until core ``core``'s interrupt line is raised (a card with several)."""
        return self._wait_for(lambda ctx: ctx.get(self.engine.irq) >> core & 1, timeout_s)

    def _wait_for(self, raised_in, timeout_s: float) -> bool:
        raised = []
        self._until = lambda ctx: raised.append(1) or True if raised_in(ctx) else False
        if not self._run(lambda: raised, time.monotonic() + timeout_s):
            self._until = None
            return False
        return True

    def kv_contents(self):
        """The engine's KV cache as (K, V) int16 arrays ``[kv_slots, kv_positions,
        head_dim]`` of ``kv_bits`` elements, read from the KV buffer's memories in
        simulation (the functional model's ``kv_k``/``kv_v``)."""
        kv = self.engine.controller.units["kv"].kv_buffer
        box: list = []
        self._queue.append(("kv", (kv,), box))
        self._run(lambda: box)
        return box[0]

    def close(self) -> None:
        self._queue.clear()

    @property
    def draft_cores(self) -> int:
        """Draft cores on the simulated card (each in its register window)."""
        return self.config.draft_cores

    @property
    def cycles_per_second(self) -> float:
        return self.cycles / self.sim_seconds if self.sim_seconds else 0.0
