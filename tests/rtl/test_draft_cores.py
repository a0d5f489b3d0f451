"""DraftCores (several draft engines on one card) driven as the host drives a card: each
core through its own register window, with its own request and result buffers in the
one device memory, against the ``sim`` device (the functional model and the cycle model)
running the same request alone.

The cores are driven with ``test_rtl_device.run`` (program load, request, result, the
registers after it) through :class:`RelocatedCore`, which makes one core of a simulated
DraftCores look like a device of its own; ``test_rtl_device.same`` compares the results.
"""

from __future__ import annotations

import dataclasses
import gc
import random
import time
import warnings

import numpy as np
import pytest
from amaranth import Elaboratable, Module, Shape, unsigned
from amaranth.hdl import UnusedElaboratable
from amaranth.lib import wiring

from dfvg_hw.axi_lite import AxiResp
from dfvg_hw.draft_cores import CoreWindows, DraftCores
from dfvg_hw.engine import DraftEngine
from dfvg_hw.register_file import UNMAPPED_READ, RegisterFile
from dfvg_hw.spec.config import get_preset
from dfvg_hw.spec.regmap import ENGINE_ID, Reg, register_space_bits
from dfvg_hw.verilog import to_verilog
from sim import rtl_device
from sim.axi_lite_bus import AxiLiteTiming, axil_read, axil_slave_monitor, axil_write
from sim.device import SimDevice
from sim.lint import verilator_lint
from sim.testbench import run_simulation, watchdog

from test_rtl_device import CASES, TINY, run, same

WINDOW_BITS = register_space_bits()


class RelocatedCore:
    """Core ``index`` of a simulated DraftCores as a device of its own (the transport
    operations ``test_rtl_device.run`` uses): its register window, its own part of the
    one device memory — every address the host DMAs to or writes into an address
    register is moved up by ``base`` — and its own interrupt, polled in its
    ``IRQ_STATUS``, since the other cores' share the simulation.

    ``while_waiting``, if given, is called at the first ``wait_irq``: it drives another
    core while this one runs its request, so the two overlap in simulated time.

    The host's :class:`dfvg_host.core_window.CoreWindow` leaves the relocation to the
    driver (``DraftDevice(memory_base=…)``); ``test_rtl_device.run`` is not the driver, so
    this adapter relocates the addresses itself.
    """

    ADDRESS_REGISTERS = (Reg.IMAGE_BASE_LO, Reg.PROG_BASE_LO, Reg.REQ0_LO, Reg.REQ1_LO,
                         Reg.RES0_LO, Reg.RES1_LO)

    def __init__(self, device, index: int, base: int, while_waiting=None):
        self.device, self.base, self.while_waiting = device, base, while_waiting
        self.window = index << WINDOW_BITS

    def read32(self, offset: int) -> int:
        return self.device.read32(self.window | offset)

    def write32(self, offset: int, value: int) -> None:
        if offset in self.ADDRESS_REGISTERS:
            value += self.base          # bases are below 4 GiB: no carry into _HI
        self.device.write32(self.window | offset, value)

    def dma_write(self, addr: int, data: bytes) -> None:
        self.device.dma_write(self.base + addr, data)

    def dma_read(self, addr: int, nbytes: int) -> bytes:
        return self.device.dma_read(self.base + addr, nbytes)

    def wait_irq(self, timeout_s: float) -> bool:
        if self.while_waiting is not None:
            drive_other_core, self.while_waiting = self.while_waiting, None
            drive_other_core()
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.read32(Reg.IRQ_STATUS) & self.read32(Reg.IRQ_ENABLE):
                return True
        return False

    def close(self) -> None:
        pass


@pytest.fixture
def two_cores():
    """The rtl device of a card with two tiny cores (DraftCores)."""
    return rtl_device.RtlDevice(TINY.with_changes(draft_cores=2))


def results_apart_from_cycles(rtl, ref):
    """``same`` for a core that ran while another did: everything but the cycle counts
    bit for bit, and every cycle count at least the cycle model's (the memory is shared;
    no unit runs faster for it). Returns (RTL cycles, model cycles)."""
    (r_res, r_regs, r_raw), (f_res, f_regs, f_raw) = rtl, ref
    assert f_res is not None and r_res is not None
    r_units, f_units = r_regs["units"], f_regs["units"]
    assert all(r_units[b] >= n for b, n in f_units.items()), (r_units, f_units)
    assert r_regs["cycles"] >= f_regs["cycles"] and r_res.cycles >= f_res.cycles
    cycles = r_regs["cycles"], f_regs["cycles"]
    as_modelled = dict(r_regs, units=f_units, cycles=f_regs["cycles"])
    same((dataclasses.replace(r_res, cycles=f_res.cycles), as_modelled, r_raw), ref)
    return cycles


def test_two_cores_draft_alone_and_at_once(two_cores):
    """Two tiny cores on one memory port, each with its own buffers and its own copy of
    the image and program (core 1's 8 MiB up). Core 1 alone: its result, registers and
    every OP_CYCLES counter equal the sim device's, cycle for cycle. Then core 0 drafts
    greedily while core 1 samples: both results (tokens, top-k records, probabilities,
    status, end_pos) are still the functional model's bit for bit, and their cycle counts
    at least the model's, at least one above it (they did contend for the memory)."""
    greedy, sampled = CASES["greedy_drafts"][:2], CASES["sampled_drafts"][:2]
    ref_greedy, ref_sampled = run(SimDevice(TINY), *greedy), run(SimDevice(TINY), *sampled)
    assert ref_greedy[0].tokens and ref_sampled[0].tokens

    # alone: one sampled draft (a shorter request, the same units)
    one = (sampled[0], dataclasses.replace(sampled[1], n_draft=1))
    same(run(RelocatedCore(two_cores, 1, base=8 << 20), *one), run(SimDevice(TINY), *one))

    during = []
    core1 = RelocatedCore(two_cores, 1, base=8 << 20)
    core0 = RelocatedCore(two_cores, 0, base=0,
                       while_waiting=lambda: during.append(run(core1, *sampled)))
    first = run(core0, *greedy)
    cycles = [results_apart_from_cycles(first, ref_greedy),
              results_apart_from_cycles(during[0], ref_sampled)]
    print(f"\ncycles (RTL, model): core 0 greedy {cycles[0]}, core 1 sampled {cycles[1]}")
    assert any(rtl > model for rtl, model in cycles), cycles


class WindowsOnRegisterFiles(Elaboratable):
    """CoreWindows in front of ``cores`` bare register files (the engines' own slaves)."""

    def __init__(self, cores: int):
        self.windows = CoreWindows(cores, WINDOW_BITS)
        self.files = [RegisterFile(TINY.with_changes(imem_words=100 + i)) for i in range(cores)]
        self.bus = self.windows.bus

    def elaborate(self, platform):
        m = Module()
        m.submodules.windows = self.windows
        for i, (regs, window) in enumerate(zip(self.files, self.windows.cores)):
            m.submodules[f"core{i}"] = regs
            wiring.connect(m, window, regs.bus)
        return m


def test_windows_route_to_their_core_and_refuse_the_rest():
    """Three register files behind the decoder, accesses with random AXI-Lite timing:
    each window reads its own core (P_IMEM_WORDS differs per core) and keeps its own RW
    registers; the fourth window, past the last core, answers DECERR with data 0 to reads
    and writes, and the bus goes on working after it."""
    dut = WindowsOnRegisterFiles(3)
    rng = np.random.default_rng(1)
    order = list(range(4)) * 3
    random.Random(2).shuffle(order)

    async def host(ctx):
        bus = dut.bus
        for n, window in enumerate(order):
            base, timing = window << WINDOW_BITS, AxiLiteTiming.random(rng)
            if window == 3:
                assert await axil_write(ctx, bus, base | Reg.PROG_LEN, 5, timing=timing,
                                        expect=AxiResp.DECERR) == AxiResp.DECERR
                assert await axil_read(ctx, bus, base | Reg.ID, timing,
                                       expect=AxiResp.DECERR) == 0
                continue
            assert await axil_read(ctx, bus, base | Reg.ID, timing) == ENGINE_ID
            assert await axil_read(ctx, bus, base | Reg.P_IMEM_WORDS, timing) == 100 + window
            await axil_write(ctx, bus, base | Reg.PROG_LEN, 1000 * window + n, timing=timing)
            assert await axil_read(ctx, bus, base | Reg.PROG_LEN, timing) == 1000 * window + n
        # each core kept its own last PROG_LEN
        for window in range(3):
            last = max(n for n, w in enumerate(order) if w == window)
            assert await axil_read(ctx, bus, window << WINDOW_BITS | Reg.PROG_LEN) == 1000 * window + last
        assert await axil_read(ctx, bus, 3 << WINDOW_BITS | 0x1F0, expect=AxiResp.DECERR) == 0
        assert await axil_read(ctx, bus, 2 << WINDOW_BITS | 0x1F0) == UNMAPPED_READ
        finished.append(True)

    finished = []
    run_simulation(dut, host, watchdog(2000, lambda: finished),
                   processes=[axil_slave_monitor(dut.bus)])


def members(component_class, config) -> dict:
    """The ports of a component built and dropped (never elaborated)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UnusedElaboratable)
        ports = dict(component_class(config).signature.members)
        gc.collect()
    return ports


def test_ports_are_the_engines():
    """One core: the DraftEngine's own ports. Three cores of a four-channel engine: the
    engine's four memory masters, a register port two address bits wider, one interrupt
    per core."""
    assert members(DraftCores, TINY) == members(DraftEngine, TINY)
    hbm = get_preset("tiny-hbm")
    three, engine = members(DraftCores, hbm.with_changes(draft_cores=3)), members(DraftEngine, hbm)
    masters = {n: v for n, v in engine.items() if n.startswith("m0")}
    assert len(masters) == 4 * 25 and {n: three[n] for n in masters} == masters
    assert Shape.cast(three["s_axil_awaddr"].shape) == unsigned(WINDOW_BITS + 2)
    assert Shape.cast(three["irq"].shape) == unsigned(3)
    assert three.keys() == engine.keys()          # the same names throughout


def test_windows_lint_clean():
    for cores in (2, 3):
        clean, output = verilator_lint(to_verilog(CoreWindows(cores, WINDOW_BITS), "windows"), "windows")
        assert clean, output
