"""AXI4-Lite register file RTL against the ``sim`` device's register semantics.

The reference is ``sim.device.SimDevice`` itself, with its controller part replaced: its
command handler records the commands instead of running the functional engine (the RTL
only pulses them to the controller), and the controller's read-only registers show what
the test drives on the status inputs. Reads, RW and W1C writes, unmapped offsets and the
identity and parameter values are SimDevice's own code; byte strobes, the 64-bit counter
snapshot and the low address bits are the register file's documented extensions.
"""

import gc
import warnings

import numpy as np
import pytest
from amaranth import Module
from amaranth.hdl import UnusedElaboratable
from amaranth.lib import wiring
from amaranth.lib.wiring import Out

from boards.vivado import EngineInterface
from dfvg_hw.axi_lite import AXI4LiteSignature, AxiResp, connect_prefixed, prefixed_members
from dfvg_hw.spec.config import get_preset
from dfvg_hw.spec.regmap import PARAM_REGS, Control, Irq, Reg, register_space_bits
from dfvg_hw.register_file import EngineCommand, EngineStatusSignature, RegisterFile
from sim.axi_lite_bus import AxiLiteTiming, axil_read, axil_slave_monitor, axil_write
from sim.device import _RW as SIM_RW_REGISTERS
from sim.device import SimDevice
from dfvg_hw.verilog import to_verilog
from sim.lint import verilator_lint
from sim.testbench import run_simulation, watchdog

TINY = get_preset("tiny")
#: Every unmapped word of the 8-bit register space (docs/registers.md §1.1).
UNMAPPED = sorted(set(range(0, 0x100, 4)) - set(Reg))
#: 64-bit counters whose high word is read from the snapshot its low-word read takes.
SNAPSHOT_OF = {Reg.CYCLES_LO: Reg.CYCLES_HI, Reg.BUSY_CYCLES_LO: Reg.BUSY_CYCLES_HI}
MASK32 = 0xFFFF_FFFF


class RegisterReference(SimDevice):
    """SimDevice's register file without the engine behind it (see the module docstring)."""

    def __init__(self, config):
        super().__init__(config)
        self.commands: list[int] = []          # CONTROL commands, as the RTL must pulse them
        self.snapshots = {hi: 0 for hi in SNAPSHOT_OF.values()}

    def _command(self, cmd: Control) -> None:
        # The register file's share of a command: it passes it on, and a soft reset clears
        # IRQ_STATUS and (with the counters) the counter snapshots. The rest is the controller's.
        if cmd:
            self.commands.append(int(cmd))
        if cmd & Control.SOFT_RESET:
            self._regs[Reg.IRQ_STATUS] = 0
            self.snapshots = dict.fromkeys(self.snapshots, 0)

    def show_status(self, values: dict) -> None:
        """The controller's read-only registers, from the status input values."""
        self._regs[Reg.STATUS] = sum(int(flag) for name, flag in EngineStatusSignature.FLAGS.items()
                                     if values[name])
        self._regs[Reg.ERROR] = values["error_code"]
        self._regs[Reg.ERROR_PC] = values["error_pc"]
        self._regs[Reg.LAST_SEQ] = values["last_seq"]
        for lo, name in ((Reg.CYCLES_LO, "cycles"), (Reg.BUSY_CYCLES_LO, "busy_cycles")):
            self._regs[lo], self._regs[Reg(lo + 4)] = values[name] & MASK32, values[name] >> 32

    def done_event(self) -> None:
        self._regs[Reg.IRQ_STATUS] |= Irq.DONE

    def write(self, offset: int, value: int, strobe: int) -> None:
        """A strobed write: a strobe-less byte keeps an RW register's byte and is 0 else."""
        offset &= ~3
        mask = strobe_mask(strobe)
        if offset in SIM_RW_REGISTERS:
            value = self.read32(offset) & ~mask | value & mask
        else:
            value &= mask
        self.write32(offset, value)

    def read(self, offset: int) -> int:
        offset &= ~3
        if offset in SNAPSHOT_OF:
            self.snapshots[SNAPSHOT_OF[offset]] = self._regs[SNAPSHOT_OF[offset]]
        if offset in self.snapshots:
            return self.snapshots[offset]
        return self.read32(offset)

    @property
    def irq(self) -> bool:
        return self.wait_irq(0)

    def control_outputs(self) -> dict:
        """The ``ctrl`` address outputs the RTL must show."""
        return {"image_base": self._addr(Reg.IMAGE_BASE_LO),
                "prog_base": self._addr(Reg.PROG_BASE_LO), "prog_len": self._regs[Reg.PROG_LEN],
                "request_base": [self._addr(Reg.REQ0_LO), self._addr(Reg.REQ1_LO)],
                "result_base": [self._addr(Reg.RES0_LO), self._addr(Reg.RES1_LO)]}


def rtl_control_outputs(ctx, dut) -> dict:
    ctrl = dut.ctrl
    return {"image_base": ctx.get(ctrl.image_base), "prog_base": ctx.get(ctrl.prog_base),
            "prog_len": ctx.get(ctrl.prog_len),
            "request_base": [ctx.get(ctrl.request_base[b]) for b in range(2)],
            "result_base": [ctx.get(ctrl.result_base[b]) for b in range(2)]}


def random_status(rng) -> dict:
    values = {name: int(rng.integers(0, 2)) for name in EngineStatusSignature.FLAGS}
    for name in ("error_code", "error_pc", "last_seq"):
        values[name] = int(rng.integers(0, 1 << 32))
    for name in ("cycles", "busy_cycles"):
        values[name] = int(rng.integers(0, 1 << 32)) << 32 | int(rng.integers(0, 1 << 32))
    return values


def strobe_mask(strobe: int) -> int:
    return sum(0xFF << 8 * byte for byte in range(4) if strobe >> byte & 1)


def drive_status(ctx, dut, values: dict) -> None:
    for name, value in values.items():
        ctx.set(getattr(dut.status, name), value)


async def pulse_done(ctx, dut) -> None:
    ctx.set(dut.status.done_pulse, 1)
    await ctx.tick()
    ctx.set(dut.status.done_pulse, 0)


def command_monitor(dut, seen: list, responses: list | None = None):
    """A process recording (cycle, CONTROL bits) for every cycle a command output is high,
    and in ``responses`` the cycles in which a write response is first offered."""
    async def monitor(ctx):
        cycle, offered = 0, False
        fields = EngineCommand.CONTROL_BITS
        async for _, _, bvalid, *bits in ctx.tick().sample(
                dut.bus.bvalid, *(dut.ctrl.command[name] for name in fields)):
            value = sum(int(flag) for flag, bit in zip(fields.values(), bits) if bit)
            if value:
                seen.append((cycle, value))
            if bvalid and not offered and responses is not None:
                responses.append(cycle)
            offered = bvalid
            cycle += 1
    return monitor


def simulate(dut, host, *, commands: list | None = None, responses: list | None = None,
             limit: int = 200_000) -> None:
    """Run ``host`` against ``dut`` with the protocol monitor (and a command recorder)."""
    finished = []

    async def testbench(ctx):
        await host(ctx)
        finished.append(True)

    processes = [axil_slave_monitor(dut.bus)]
    if commands is not None:
        processes.append(command_monitor(dut, commands, responses))
    run_simulation(dut, testbench, watchdog(limit, lambda: finished), processes=processes)


# -- (1) random accesses against the reference ------------------------------------------

@pytest.mark.parametrize("seed", [1, 2])
def test_random_accesses_match_sim_device(seed, n_accesses=1000):
    rng = np.random.default_rng(seed)
    dut, ref = RegisterFile(TINY), RegisterReference(TINY)
    offsets = list(Reg) + UNMAPPED
    # Registers with side effects or interactions, drawn more often than the rest.
    eventful = [Reg.CONTROL, Reg.IRQ_STATUS, Reg.IRQ_ENABLE, *SNAPSHOT_OF, *SNAPSHOT_OF.values()]
    pulses = []
    counts = {"read": 0, "write": 0}

    async def host(ctx):
        for step in range(n_accesses):
            if rng.random() < 0.1:                   # the controller's state moves on
                values = random_status(rng)
                drive_status(ctx, dut, values)
                ref.show_status(values)
            if rng.random() < 0.2:                   # a request finishes
                await pulse_done(ctx, dut)
                ref.done_event()
            offset = int(rng.choice(eventful if rng.random() < 0.3 else offsets))
            if rng.random() < 0.15:
                offset |= int(rng.integers(1, 4))      # misaligned: low bits ignored
            timing = AxiLiteTiming.random(rng, max_delay=3)
            if rng.random() < 0.5:
                got, want = await axil_read(ctx, dut.bus, offset, timing), ref.read(offset)
                assert got == want, \
                    f"step {step}: read 0x{offset:03x} gave 0x{got:08x}, want 0x{want:08x}"
                counts["read"] += 1
            else:
                value = int(rng.integers(0, 1 << 32))
                strobe = 0xF if rng.random() < 0.6 else int(rng.integers(0, 16))
                await axil_write(ctx, dut.bus, offset, value, strobe, timing)
                ref.write(offset, value, strobe)
                counts["write"] += 1
            # irq is a register, and a soft reset clears IRQ_STATUS an edge after the
            # write response: two edges let both settle before the comparison.
            await ctx.tick().repeat(2)
            assert rtl_control_outputs(ctx, dut) == ref.control_outputs(), f"step {step}"
            assert ctx.get(dut.irq) == ref.irq, f"step {step}"

    simulate(dut, host, commands=pulses)
    assert min(counts.values()) > n_accesses // 3
    assert [value for _, value in pulses] == ref.commands
    assert all(b - a > 1 for (a, _), (b, _) in zip(pulses, pulses[1:])), "a pulse lasted >1 cycle"


@pytest.mark.parametrize("preset", ["alveo-u55c", "alveo-u250"])
def test_identity_and_parameters(preset):
    config = get_preset(preset)
    dut, ref = RegisterFile(config), RegisterReference(config)

    async def host(ctx):
        for reg in [Reg.ID, Reg.VERSION, *range(Reg.P_ROWS, Reg.P_CLOCK_KHZ + 4, 4), *PARAM_REGS,
                    Reg.P_MEM_CHANNEL_KIB]:
            assert await axil_read(ctx, dut.bus, reg) == ref.read(reg), Reg(reg).name

    simulate(dut, host)


def test_unmapped_offsets_and_wider_address_space():
    dut = RegisterFile(TINY, addr_width=12)

    async def host(ctx):
        await axil_write(ctx, dut.bus, Reg.PROG_LEN, 7)
        # 0x180 is beyond the map: it must not alias PROG_LEN (0x080) in a 12-bit space.
        await axil_write(ctx, dut.bus, 0x100 | Reg.PROG_LEN, 9)
        assert await axil_read(ctx, dut.bus, 0x100 | Reg.PROG_LEN) == 0xDEADBEEF
        assert await axil_read(ctx, dut.bus, Reg.PROG_LEN) == 7
        assert await axil_read(ctx, dut.bus, 0xFFC) == 0xDEADBEEF

    simulate(dut, host)
    with warnings.catch_warnings():
        # The half-built component is garbage, and Amaranth warns about unused elaboratables.
        warnings.simplefilter("ignore", UnusedElaboratable)
        with pytest.raises(ValueError, match=f"needs {register_space_bits()}"):
            RegisterFile(TINY, addr_width=register_space_bits() - 1)
        gc.collect()


def test_counter_high_word_comes_from_the_low_word_read():
    dut = RegisterFile(TINY)
    first, second = 0x0000_0001_FFFF_FFFF, 0x0000_0002_0000_0000

    async def host(ctx):
        ctx.set(dut.status.cycles, first)
        lo = await axil_read(ctx, dut.bus, Reg.CYCLES_LO)
        ctx.set(dut.status.cycles, second)      # a request ends between the two reads
        hi = await axil_read(ctx, dut.bus, Reg.CYCLES_HI)
        assert hi << 32 | lo == first           # not torn into 0x2_FFFF_FFFF
        assert await axil_read(ctx, dut.bus, Reg.CYCLES_LO) == 0
        assert await axil_read(ctx, dut.bus, Reg.CYCLES_HI) == 2
        await axil_write(ctx, dut.bus, Reg.CONTROL, Control.SOFT_RESET)
        await ctx.tick()
        assert await axil_read(ctx, dut.bus, Reg.CYCLES_HI) == 0

    simulate(dut, host)


# -- (2) CONTROL pulses -----------------------------------------------------------------

def test_control_pulses_last_one_cycle_and_carry_buf():
    dut = RegisterFile(TINY)
    pulses, responses = [], []
    writes = [Control.START | Control.BUF, Control.START, Control.ABORT,
              Control.SOFT_RESET | Control.LOAD_PROGRAM | Control.START | Control.BUF,
              0xFFFF_FFFF, 0xFFFF_FEF0, Control.LOAD_PROGRAM]   # all bits; only ignored bits
    strobes = [0xF] * len(writes)
    writes.append(Control.START | Control.BUF)
    strobes.append(0b0001)                                        # BUF's byte not strobed

    async def host(ctx):
        for value, strobe in zip(writes, strobes):
            await axil_write(ctx, dut.bus, Reg.CONTROL, value, strobe)
            assert await axil_read(ctx, dut.bus, Reg.CONTROL) == 0

    simulate(dut, host, commands=pulses, responses=responses)
    expected = [(cycle, int(Control(value & strobe_mask(strobe) & 0x10F)))
                for cycle, value, strobe in zip(responses, writes, strobes)
                if value & strobe_mask(strobe) & 0x10F]
    # Each command is high in exactly one cycle: the one in which its write is answered.
    assert pulses == expected


# -- (3) interrupts ---------------------------------------------------------------------

def test_irq_set_by_done_cleared_by_w1c_masked_by_enable():
    dut = RegisterFile(TINY)

    async def host(ctx):
        bus = dut.bus
        await pulse_done(ctx, dut)
        await ctx.tick()
        assert await axil_read(ctx, bus, Reg.IRQ_STATUS) == Irq.DONE
        assert not ctx.get(dut.irq)                           # latched, but not enabled
        await axil_write(ctx, bus, Reg.IRQ_ENABLE, Irq.DONE)
        await ctx.tick()
        assert ctx.get(dut.irq)
        await axil_write(ctx, bus, Reg.IRQ_STATUS, 0)        # W1C: writing 0 clears nothing
        await axil_write(ctx, bus, Reg.IRQ_STATUS, Irq.DONE, strobe=0b1110)   # byte 0 not strobed
        assert await axil_read(ctx, bus, Reg.IRQ_STATUS) == Irq.DONE
        await axil_write(ctx, bus, Reg.IRQ_STATUS, Irq.DONE)
        assert await axil_read(ctx, bus, Reg.IRQ_STATUS) == 0
        assert not ctx.get(dut.irq)
        # The registered irq rises the second edge after the done pulse's cycle.
        ctx.set(dut.status.done_pulse, 1)
        await ctx.tick()
        ctx.set(dut.status.done_pulse, 0)
        assert not ctx.get(dut.irq)
        await ctx.tick()
        assert ctx.get(dut.irq)
        await axil_write(ctx, bus, Reg.IRQ_ENABLE, 0)
        await ctx.tick()
        assert not ctx.get(dut.irq) and await axil_read(ctx, bus, Reg.IRQ_STATUS) == Irq.DONE
        await axil_write(ctx, bus, Reg.CONTROL, Control.SOFT_RESET)
        await ctx.tick()
        assert await axil_read(ctx, bus, Reg.IRQ_STATUS) == 0
        assert await axil_read(ctx, bus, Reg.IRQ_ENABLE) == 0      # kept (it was 0)

    simulate(dut, host)


async def write_with_done_pulse(ctx, dut, addr: int, value: int, edge: int) -> None:
    """A write whose ``done_pulse`` is high for the ``edge``-th clock edge after AW and W are
    taken: 1 is the edge that performs the write, 2 the one that ends a command's pulse."""
    bus = dut.bus
    for name, level in (("awaddr", addr), ("wdata", value), ("wstrb", 0xF), ("awvalid", 1),
                        ("wvalid", 1)):
        ctx.set(getattr(bus, name), level)
    await ctx.tick()                                   # both taken at once: ready is idle-high
    ctx.set(bus.awvalid, 0)
    ctx.set(bus.wvalid, 0)
    for e in (1, 2):
        ctx.set(dut.status.done_pulse, e == edge)
        await ctx.tick()
    ctx.set(dut.status.done_pulse, 0)
    ctx.set(bus.bready, 1)
    await ctx.tick().until(bus.bvalid)
    ctx.set(bus.bready, 0)


def test_irq_event_priorities():
    """A done event beats a W1C at the same edge; a soft reset beats one in its pulse cycle."""
    dut = RegisterFile(TINY)

    async def host(ctx):
        bus = dut.bus
        await pulse_done(ctx, dut)
        await write_with_done_pulse(ctx, dut, Reg.IRQ_STATUS, Irq.DONE, edge=1)
        assert await axil_read(ctx, bus, Reg.IRQ_STATUS) == Irq.DONE
        await write_with_done_pulse(ctx, dut, Reg.IRQ_STATUS, Irq.DONE, edge=2)
        assert await axil_read(ctx, bus, Reg.IRQ_STATUS) == Irq.DONE     # after the W1C
        await axil_write(ctx, bus, Reg.IRQ_STATUS, Irq.DONE)
        await write_with_done_pulse(ctx, dut, Reg.CONTROL, Control.SOFT_RESET, edge=2)
        assert await axil_read(ctx, bus, Reg.IRQ_STATUS) == 0
        await write_with_done_pulse(ctx, dut, Reg.CONTROL, Control.START, edge=2)
        assert await axil_read(ctx, bus, Reg.IRQ_STATUS) == Irq.DONE     # no reset: kept

    simulate(dut, host)


# -- (4) channel orderings and back-pressure --------------------------------------------

@pytest.mark.parametrize("timing", [
    AxiLiteTiming(aw=0, w=4), AxiLiteTiming(aw=4, w=0), AxiLiteTiming(aw=2, w=2),
    AxiLiteTiming(aw=0, w=0, b=6, ar=0, r=6), AxiLiteTiming(aw=5, w=1, b=3, ar=3, r=3),
], ids=["aw-first", "w-first", "together", "b-and-r-backpressure", "mixed"])
def test_write_orders_and_backpressure(timing):
    dut = RegisterFile(TINY)
    values = {Reg.REQ1_LO: 0x1234_5678, Reg.REQ1_HI: 0x9ABC_DEF0, Reg.PROG_LEN: 0x55}

    async def host(ctx):
        for reg, value in values.items():
            await axil_write(ctx, dut.bus, reg, value, timing=timing)
        for reg, value in values.items():
            assert await axil_read(ctx, dut.bus, reg, timing) == value
        assert ctx.get(dut.ctrl.request_base[1]) == 0x9ABC_DEF0_1234_5678
        assert ctx.get(dut.ctrl.prog_len) == 0x55

    simulate(dut, host)


def test_responses_wait_for_ready():
    """bvalid and rvalid stay up (payload stable: the monitor checks) while ready is low."""
    dut = RegisterFile(TINY)

    async def host(ctx):
        bus = dut.bus
        await axil_write(ctx, bus, Reg.PROG_LEN, 3, timing=AxiLiteTiming(b=8))
        assert await axil_read(ctx, bus, Reg.ID, AxiLiteTiming(r=8)) == 0x44465647
        # While a response waits, no further read is accepted (one outstanding read).
        ctx.set(bus.araddr, Reg.VERSION)
        ctx.set(bus.arvalid, 1)
        await ctx.tick().until(bus.arready)
        ctx.set(bus.arvalid, 0)
        await ctx.tick().repeat(2)
        assert ctx.get(bus.rvalid) and not ctx.get(bus.arready)
        ctx.set(bus.rready, 1)
        await ctx.tick()
        ctx.set(bus.rready, 0)
        assert ctx.get(bus.arready) and ctx.get(bus.rresp) == AxiResp.OKAY

    simulate(dut, host)


# -- (5) lint, and the top-level port names ---------------------------------------------

class FlatTop(wiring.Component):
    """A minimal top exposing the register file under the engine's port names."""

    def __init__(self, interface: EngineInterface):
        self.interface = interface
        bus = AXI4LiteSignature(interface.axil_addr_width).flip()
        super().__init__({**prefixed_members(bus, interface.axil_prefix), interface.irq: Out(1)})

    def elaborate(self, platform):
        m = Module()
        m.submodules.registers = registers = RegisterFile(TINY, self.interface.axil_addr_width)
        connect_prefixed(m, self, self.interface.axil_prefix, registers.bus)
        m.d.comb += getattr(self, self.interface.irq).eq(registers.irq)
        return m


def test_lint_clean():
    clean, output = verilator_lint(to_verilog(RegisterFile(TINY), "register_file"), "register_file")
    assert clean, output


def test_ports_match_the_engine_interface():
    interface = EngineInterface.for_config(TINY, ["dfvg_engine.v"])
    verilog = to_verilog(FlatTop(interface), "flat_top")
    clean, output = verilator_lint(verilog, "flat_top")
    assert clean, output
    wanted = {(name, direction, width) for name, direction, width in interface.ports()
              if name.startswith(interface.axil_prefix) or name == interface.irq}
    declared = set()
    for line in verilog.split("module flat_top")[1].split("endmodule")[0].splitlines():
        words = line.strip().rstrip(";").split()        # "input [7:0] s_axil_awaddr"
        if words and words[0] in ("input", "output"):
            width = int(words[1][1:].split(":")[0]) + 1 if len(words) == 3 else 1
            declared.add((words[-1], "in" if words[0] == "input" else "out", width))
    assert declared == wanted | {("clk", "in", 1), ("rst", "in", 1)}, declared ^ wanted


# -- (6) waveforms ----------------------------------------------------------------------

def test_vcd_written_when_asked(tmp_path, monkeypatch):
    monkeypatch.setenv("DFVG_VCD", str(tmp_path))
    dut = RegisterFile(TINY)

    async def host(ctx):
        await axil_write(ctx, dut.bus, Reg.IRQ_ENABLE, 1)

    simulate(dut, host)
    vcd, = tmp_path.glob("*.vcd")
    assert "bus__awvalid" in vcd.read_text()
