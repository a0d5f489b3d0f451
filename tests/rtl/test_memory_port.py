"""MemoryPort (the engine's AXI4 read/write DMA) against DeviceMemory, through the AXI4
slave model of sim/axi_memory.py.

The slave model asserts the AXI4 rules every cycle (valid held until ready with a stable
payload, INCR bursts of at most 256 beats that never cross 4 KiB, WLAST on each burst's
last beat), so every simulation here is also a protocol check of the port; the last tests
show that those assertions fire on a master that breaks them.

Most tests use a 64-bit bus: 8-byte beats make the 256-beat limit (2 KiB) bite before the
4 KiB rule, so both kinds of burst split occur; the throughput tests use the ``tiny``
preset's 128-bit port at its configured memory latency.
"""

from __future__ import annotations

import gc
import random
import re
import warnings
from math import ceil

import numpy as np
import pytest
from amaranth import Module, Signal
from amaranth.hdl import UnusedElaboratable
from amaranth.lib import wiring

from boards.vivado import EngineInterface
from dfvg_hw.axi4 import AXI4Signature, BOUNDARY_BYTES, Burst, MAX_BURST_BEATS, connect_flat
from dfvg_hw.spec.config import get_preset
from dfvg_hw.memory_port import MemoryPort
from sim.axi_memory import AXI4SlaveMemory, AXIProtocolError, MemoryTiming
from sim.memory import DeviceMemory
from dfvg_hw.verilog import to_verilog
from sim.lint import verilator_lint
from sim.testbench import run_simulation, stream_put

TINY = get_preset("tiny")
DATA_WIDTH = 64
PAGE = BOUNDARY_BYTES


# -- reference ------------------------------------------------------------------------------
def legal_bursts(addr: int, length: int, bytes_per_beat: int) -> list[tuple[int, int]]:
    """The bursts a command should become: as long as possible, ending at the command's
    end, after 256 beats or at a 4 KiB boundary."""
    bursts, beats = [], ceil(length / bytes_per_beat)
    while beats:
        n = min(beats, MAX_BURST_BEATS, (PAGE - addr % PAGE) // bytes_per_beat)
        bursts.append((addr, n))
        addr, beats = addr + n * bytes_per_beat, beats - n
    return bursts


def expected_beats(image: bytes, addr: int, length: int, bytes_per_beat: int):
    """(data, last) beats of a read: the bytes, zero-padded to a whole final beat."""
    padded = image[addr:addr + length].ljust(ceil(length / bytes_per_beat) * bytes_per_beat, b"\0")
    n = len(padded) // bytes_per_beat
    return [(int.from_bytes(padded[i * bytes_per_beat:(i + 1) * bytes_per_beat], "little"),
             int(i == n - 1)) for i in range(n)]


def random_commands(rng: random.Random, base: int, size: int, count: int, bytes_per_beat: int):
    """Commands inside [base, base + size): the cases that matter first — one longer than
    256 beats, one across a 4 KiB boundary, single bytes and partial final beats — then
    random ones."""
    def at(offset):
        return base + offset - offset % bytes_per_beat

    commands = [
        (at(PAGE // 2 + 40), MAX_BURST_BEATS * bytes_per_beat + 5 * bytes_per_beat + 3),
        (at(PAGE - 3 * bytes_per_beat), 7 * bytes_per_beat + 1),
        (at(2 * PAGE + 8), 1),
        (at(3 * PAGE - bytes_per_beat), bytes_per_beat - 1),
    ]
    while len(commands) < count:
        length = rng.choice([rng.randint(1, 4 * bytes_per_beat), rng.randint(1, 96 * bytes_per_beat)])
        commands.append((at(rng.randrange(size - length)), length))
    rng.shuffle(commands)
    return commands


# -- testbenches ----------------------------------------------------------------------------
class Rig:
    """A MemoryPort on an AXI4 slave memory, with testbenches that feed commands and write
    data and take read beats, each with random stalls.

    Members
    -------
    dut : MemoryPort
    memory : DeviceMemory
    slave : AXI4SlaveMemory
    beats : list of (edge, data, last)
        Read beats in arrival order with the clock edge that transferred them (edges count
        from the simulation start, as ``slave.cycle``).
    accepted : dict
        Edge that accepted each command, by (stream name, index).
    write_done : int
        ``write_done`` pulses seen.
    """

    def __init__(self, *, data_width=DATA_WIDTH, timing=MemoryTiming(), memory=None,
                 config=TINY, error_ranges=(), seed=0, max_outstanding=8):
        self.dut = MemoryPort(config, data_width=data_width, max_outstanding=max_outstanding)
        self.bytes_per_beat = data_width // 8
        self.memory = memory if memory is not None else DeviceMemory(config.mem_bytes)
        self.slave = AXI4SlaveMemory(self.dut.axi, self.memory, timing,
                                     error_ranges=error_ranges, seed=seed)
        self.rng = random.Random(seed + 1)
        self.feeding = 0           # feeder testbenches still running
        self.beats: list[tuple[int, int, int]] = []
        self.accepted: dict[tuple[str, int], int] = {}
        self.write_done = 0

    def _stalled(self, probability):
        return probability > 0 and self.rng.random() < probability

    def feeder(self, body):
        """A testbench running ``body(ctx)`` that ``until_idle`` waits for."""
        self.feeding += 1

        async def tb(ctx):
            await body(ctx)
            self.feeding -= 1
        return tb

    def feed_commands(self, stream, name, commands, stall=0.0):
        """Offer ``commands`` on ``stream``, waiting a random few cycles before each."""
        async def body(ctx):
            for i, (addr, length) in enumerate(commands):
                while self._stalled(stall):
                    await ctx.tick()
                await stream_put(ctx, stream, {"addr": addr, "length": length})
                self.accepted[name, i] = self.slave.cycle
        return self.feeder(body)

    def feed_write_data(self, beats, stall=0.0):
        async def body(ctx):
            for beat in beats:
                while self._stalled(stall):
                    await ctx.tick()
                await stream_put(ctx, self.dut.write_data, beat)
        return self.feeder(body)

    def take_read_beats(self, commands: int, stall=0.0):
        """Take read beats until ``commands`` commands have ended (``last``)."""
        async def tb(ctx):
            out, ended = self.dut.read_data, 0
            while ended < commands:
                ctx.set(out.ready, not self._stalled(stall))
                _, _, valid, ready, beat = await ctx.tick().sample(out.valid, out.ready, out.payload)
                if valid and ready:
                    self.beats.append((self.slave.cycle, beat.data, beat.last))
                    ended += beat.last
            ctx.set(out.ready, 0)
        return tb

    def until_idle(self, limit: int, write_commands: int = 0):
        """Count ``write_done`` pulses; finish once the feeders are done and the port is
        idle with every expected write done (a hang fails after ``limit`` cycles)."""
        async def tb(ctx):
            dut = self.dut
            for _ in range(limit):
                await ctx.tick()
                self.write_done += ctx.get(dut.write_done)
                if not self.feeding and self.write_done >= write_commands \
                        and ctx.get(dut.read_idle) and ctx.get(dut.write_idle):
                    return
            raise AssertionError(f"memory port hung: not idle after {limit} cycles")
        return tb

    def run(self, *testbenches):
        run_simulation(self.dut, *testbenches, processes=[self.slave.process])

    def read(self, commands, *, limit=2000, stall=0.0):
        """Run read ``commands`` alone; the beats land in ``self.beats``."""
        self.run(self.feed_commands(self.dut.read_cmd, "read", commands),
                 self.take_read_beats(sum(1 for _, n in commands if n), stall),
                 self.until_idle(limit))

    def error(self):
        return {name: int(getattr(self.final_error, name)) for name in ("range", "misaligned", "response")}

    def snapshot(self):
        """A testbench that records the port's error flags and counters at the end."""
        async def tb(ctx):
            self.final_error = ctx.get(self.dut.error)
            self.counters = {name: ctx.get(getattr(self.dut, name))
                             for name in ("read_bytes", "write_bytes", "busy_cycles")}
        return tb


def data_beats(content: bytes, bytes_per_beat: int, rng: random.Random) -> list[int]:
    """Write-data beats carrying ``content``, the final beat padded with random bytes (the
    port must mask them off with WSTRB)."""
    pad = (-len(content)) % bytes_per_beat
    padded = content + bytes(rng.randrange(256) for _ in range(pad))
    return [int.from_bytes(padded[i:i + bytes_per_beat], "little")
            for i in range(0, len(padded), bytes_per_beat)]


def run_and_snapshot(rig: Rig, *testbenches):
    """Run ``testbenches``; the last one to finish must be ``until_idle``: then snapshot."""
    *others, idle = testbenches

    async def idle_then_snapshot(ctx):
        await idle(ctx)
        await rig.snapshot()(ctx)
    rig.run(*others, idle_then_snapshot)


# -- functional tests -----------------------------------------------------------------------
def test_random_reads_and_writes_match_device_memory():
    """Reads and writes at once, random stalls on every channel (memory: AR, R, AW, W, B;
    port: commands, write data, read beats), compared bit for bit with DeviceMemory."""
    rng = random.Random(5)
    bpb = DATA_WIDTH // 8
    read_base, write_base, region = 0, 0x8000, 0x8000
    timing = MemoryTiming(read_latency=6, write_latency=4, stall=0.25)
    rig = Rig(timing=timing, seed=11)
    image = bytes(rng.randrange(256) for _ in range(read_base + region + region))
    rig.memory.write(0, image)
    reference = bytearray(image)

    reads = random_commands(rng, read_base, region, 18, bpb)
    writes = random_commands(rng, write_base, region, 18, bpb)
    payload = bytes(rng.randrange(256) for _ in range(sum(n for _, n in writes)))
    offset = 0
    for addr, length in writes:
        reference[addr:addr + length] = payload[offset:offset + length]
        offset += length
    write_beats, offset = [], 0
    for _, length in writes:
        write_beats += data_beats(payload[offset:offset + length], bpb, rig.rng)
        offset += length
    read_beats = sum(ceil(n / bpb) for _, n in reads)
    assert read_beats + len(write_beats) >= 1000

    run_and_snapshot(
        rig,
        rig.feed_commands(rig.dut.read_cmd, "read", reads, stall=0.3),
        rig.feed_commands(rig.dut.write_cmd, "write", writes, stall=0.3),
        rig.feed_write_data(write_beats, stall=0.3),
        rig.take_read_beats(len(reads), stall=0.3),
        rig.until_idle(40_000, len(writes)))

    want = [b for addr, n in reads for b in expected_beats(image, addr, n, bpb)]
    assert [(d, last) for _, d, last in rig.beats] == want
    assert rig.memory.read(0, 2 * region) == bytes(reference)
    assert rig.slave.read_bursts == [b for a, n in reads for b in legal_bursts(a, n, bpb)]
    assert rig.slave.write_bursts == [b for a, n in writes for b in legal_bursts(a, n, bpb)]
    assert rig.write_done == len(writes)
    assert rig.error() == {"range": 0, "misaligned": 0, "response": 0}
    assert rig.counters["read_bytes"] == sum(n for _, n in reads)
    assert rig.counters["write_bytes"] == sum(n for _, n in writes)
    assert 0 < rig.counters["busy_cycles"] <= rig.slave.cycle


def test_long_read_streams_one_beat_per_cycle():
    """A 771-beat read across four 4 KiB pages on the tiny preset's 128-bit port with its
    configured memory (latency 10 cycles, bandwidth ≥ 1 beat/cycle): beat k transfers
    exactly READ_OVERHEAD + L + k edges after the command — no bubble between bursts."""
    timing = MemoryTiming.for_config(TINY, 128)
    assert (timing.read_latency, timing.beats_per_cycle) == (10, 1.0)
    rig = Rig(data_width=128, timing=timing)
    image = np.random.default_rng(3).integers(0, 256, 4 * PAGE, dtype=np.uint8).tobytes()
    rig.memory.write(0, image)
    addr, length = PAGE - 128, 3 * PAGE + 40
    run_and_snapshot(rig, rig.feed_commands(rig.dut.read_cmd, "read", [(addr, length)]),
                     rig.take_read_beats(1), rig.until_idle(2000))

    assert [(d, last) for _, d, last in rig.beats] == expected_beats(image, addr, length, 16)
    start = rig.accepted["read", 0]
    first = start + MemoryPort.READ_OVERHEAD + timing.read_latency
    assert [c for c, _, _ in rig.beats] == list(range(first, first + len(rig.beats)))
    assert len(rig.beats) == 771 and len(rig.slave.read_bursts) == 4     # one per page
    # busy from the accepting edge to the last beat's: the cycle model's stream() plus
    # READ_OVERHEAD - 1 (it charges latency + beats; the port adds its registers)
    assert rig.counters["busy_cycles"] == MemoryPort.READ_OVERHEAD + timing.read_latency + 771 - 1


def test_long_write_streams_one_beat_per_cycle():
    """A 768-beat write across four pages with its data always ready: the port is busy
    for exactly WRITE_OVERHEAD + beats - 1 + L cycles, one W beat per cycle."""
    timing = MemoryTiming.for_config(TINY, 128)
    rig = Rig(data_width=128, timing=timing)
    addr, length = PAGE - 128, 3 * PAGE
    content = np.random.default_rng(4).integers(0, 256, length, dtype=np.uint8).tobytes()
    run_and_snapshot(rig, rig.feed_commands(rig.dut.write_cmd, "write", [(addr, length)]),
                     rig.feed_write_data(data_beats(content, 16, rig.rng)),
                     rig.until_idle(2000, 1))
    assert rig.memory.read(addr, length) == content
    assert rig.counters["busy_cycles"] == MemoryPort.WRITE_OVERHEAD + 768 - 1 + timing.write_latency


def test_back_to_back_commands_keep_the_bus_busy():
    """Sixteen 8-beat reads issued back to back overlap their memory latency (several
    bursts outstanding): the 128 beats arrive on consecutive cycles."""
    timing = MemoryTiming(read_latency=12)
    rig = Rig(timing=timing)
    rig.memory.write(0, bytes(range(256)) * 8)
    commands = [(64 * i, 64) for i in range(16)]
    rig.read(commands)
    first = rig.accepted["read", 0] + MemoryPort.READ_OVERHEAD + timing.read_latency
    assert [c for c, _, _ in rig.beats] == list(range(first, first + 128))


def test_bandwidth_limited_memory_paces_the_stream():
    """Half a beat per cycle: beat k transfers READ_OVERHEAD + L + 2k edges after the
    command — the memory, not the port, sets the pace."""
    timing = MemoryTiming(read_latency=4, beats_per_cycle=0.5)
    rig = Rig(timing=timing)
    rig.read([(0, 48 * 8)])
    first = rig.accepted["read", 0] + MemoryPort.READ_OVERHEAD + timing.read_latency
    assert [c for c, _, _ in rig.beats] == list(range(first, first + 96, 2))


# -- errors ---------------------------------------------------------------------------------
def test_error_responses_set_the_flag_and_keep_streams_framed():
    """SLVERR on a read burst: the flag rises, every beat still arrives (zeros for the
    failed burst) with ``last`` in place; SLVERR on a write: the flag rises, memory is
    unchanged, the command still completes; DECERR past the slave's memory likewise."""
    bad = (PAGE, PAGE + 64)
    memory = DeviceMemory(2 * PAGE)          # smaller than mem_bytes: beyond it is DECERR
    image = bytes(range(256)) * 32
    memory.write(0, image)
    rig = Rig(memory=memory, error_ranges=[bad])
    run_and_snapshot(rig, rig.feed_commands(rig.dut.read_cmd, "read", [(PAGE - 64, 128)]),
                     rig.take_read_beats(1), rig.until_idle(500))
    assert [(d, last) for _, d, last in rig.beats] == \
        expected_beats(image[:PAGE] + bytes(64), PAGE - 64, 128, 8)
    assert rig.error() == {"range": 0, "misaligned": 0, "response": 1}

    rig = Rig(memory=memory, error_ranges=[bad])
    run_and_snapshot(rig, rig.feed_commands(rig.dut.write_cmd, "write", [(PAGE, 16)]),
                     rig.feed_write_data([1, 2]), rig.until_idle(500, 1))
    assert rig.error()["response"] == 1 and rig.write_done == 1
    assert memory.read(0, 2 * PAGE) == image[:2 * PAGE]

    rig = Rig(memory=memory)
    run_and_snapshot(rig, rig.feed_commands(rig.dut.read_cmd, "read", [(2 * PAGE, 8)]),
                     rig.take_read_beats(1), rig.until_idle(500))
    assert rig.error()["response"] == 1 and [d for _, d, _ in rig.beats] == [0]


@pytest.mark.parametrize("kind, addr, length, flag", [
    ("read", TINY.mem_bytes - 8, 16, "range"),          # runs past the end
    ("write", TINY.mem_bytes, 1, "range"),              # starts at the end
    ("read", 1 << 40, 8, "range"),                      # beyond a 36-bit device address
    ("read", 4, 8, "misaligned"),
    ("write", 12, 8, "misaligned"),
])
def test_refused_commands_issue_nothing(kind, addr, length, flag):
    """A refused command raises its flag, touches no bus and leaves the port idle;
    ``clear_error`` lowers the flag and the next command runs normally."""
    rig = Rig()
    rig.memory.write(0, bytes(range(64)))
    dut = rig.dut
    stream = dut.read_cmd if kind == "read" else dut.write_cmd
    seen = {}

    async def refuse_then_read(ctx):
        await stream_put(ctx, stream, {"addr": addr, "length": length})
        await ctx.tick()
        seen["error"] = ctx.get(dut.error)
        seen["idle"] = ctx.get(dut.read_idle) and ctx.get(dut.write_idle)
        ctx.set(dut.clear_error, 1)
        await ctx.tick()
        ctx.set(dut.clear_error, 0)
        seen["cleared"] = ctx.get(dut.error.as_value())
        await stream_put(ctx, dut.read_cmd, {"addr": 16, "length": 0})     # a no-op
        await stream_put(ctx, dut.read_cmd, {"addr": 16, "length": 16})

    rig.run(rig.feeder(refuse_then_read), rig.take_read_beats(1), rig.until_idle(200))
    assert {name: int(getattr(seen["error"], name)) for name in ("range", "misaligned", "response")} \
        == {"range": int(flag == "range"), "misaligned": int(flag == "misaligned"), "response": 0}
    assert seen["idle"] and seen["cleared"] == 0
    assert rig.slave.read_bursts == [(16, 2)] and rig.slave.write_bursts == []
    assert [(d, last) for _, d, last in rig.beats] == expected_beats(bytes(range(64)), 16, 16, 8)


# -- the memory model's AXI checks ----------------------------------------------------------
async def _hold_until_ready(ctx, bus, channel, **payload):
    for name, value in payload.items():
        ctx.set(getattr(bus, channel + name), value)
    ctx.set(getattr(bus, channel + "valid"), 1)
    # A plain loop rather than tick().until(): the slave aborts the simulation mid-wait,
    # and an abandoned until() generator warns when it is collected.
    while not (await ctx.tick().sample(getattr(bus, channel + "ready")))[2]:
        pass
    ctx.set(getattr(bus, channel + "valid"), 0)


async def _crossing_read(ctx, bus):
    await _hold_until_ready(ctx, bus, "ar", addr=PAGE - 8, len=1, size=3, burst=Burst.INCR)


async def _dropped_arvalid(ctx, bus):
    ctx.set(bus.arvalid, 1)                  # the memory's arready is low in cycle 0
    await ctx.tick()
    ctx.set(bus.arvalid, 0)


async def _changed_araddr(ctx, bus):
    ctx.set(bus.arvalid, 1)
    await ctx.tick()
    ctx.set(bus.araddr, 8)


async def _early_wlast(ctx, bus):
    await _hold_until_ready(ctx, bus, "aw", addr=0, len=1, size=3, burst=Burst.INCR)
    await _hold_until_ready(ctx, bus, "w", data=1, strb=0xFF, last=1)


async def _wrap_burst(ctx, bus):
    await _hold_until_ready(ctx, bus, "aw", addr=0, len=3, size=3, burst=Burst.WRAP)


@pytest.mark.parametrize("violation, message", [
    (_crossing_read, "crosses a 4 KiB boundary"),
    (_dropped_arvalid, "ARVALID dropped"),
    (_changed_araddr, "AR payload changed"),
    (_early_wlast, "WLAST = 1 on beat 1 of a 2-beat burst"),
    (_wrap_burst, "only INCR"),
])
def test_memory_model_rejects_protocol_violations(violation, message):
    """The slave's assertions fire on a master that breaks the rules (driven by hand)."""
    m = Module()
    tick = Signal()
    m.d.sync += tick.eq(~tick)               # a clock domain for the bus to live in
    bus = AXI4Signature(DATA_WIDTH).create()
    slave = AXI4SlaveMemory(bus, DeviceMemory(4 * PAGE))

    async def master(ctx):
        await violation(ctx, bus)
        for _ in range(4):
            await ctx.tick()

    with pytest.raises(AXIProtocolError, match=message):
        run_simulation(m, master, processes=[slave.process])


# -- structure ------------------------------------------------------------------------------
def test_timing_from_config():
    u55c = get_preset("alveo-u55c")          # 200 ns at 300 MHz; 421 GB/s over 32 x 64 B ports
    t = MemoryTiming.for_config(u55c)
    assert (t.read_latency, t.write_latency) == (60, 60)
    assert t.beats_per_cycle == pytest.approx(421e9 / 32 / (64 * 300e6))
    assert MemoryTiming.for_config(u55c, 256).beats_per_cycle == 1.0     # 32 B a cycle is within a share
    slow = TINY.with_changes(mem_bandwidth_gbps=0.4)
    assert MemoryTiming.for_config(slow, 64).beats_per_cycle == 0.5
    with pytest.raises(ValueError, match="beats_per_cycle"):
        MemoryTiming(beats_per_cycle=1.5)


def test_bad_parameters_are_refused():
    with warnings.catch_warnings():
        # The half-built components are garbage, and Amaranth warns about unused elaboratables.
        warnings.simplefilter("ignore", UnusedElaboratable)
        with pytest.raises(ValueError, match="data width"):
            MemoryPort(TINY, data_width=48)
        # (a memory that is not whole bus beats no longer passes EngineConfig.validate:
        # mem_bytes is whole 4 KiB pages per channel)
        with pytest.raises(ValueError, match="channel 4 of 4"):
            MemoryPort(TINY, channel=4, channels=4)
        with pytest.raises(ValueError, match="channel 0 of 3"):
            MemoryPort(TINY, channel=0, channels=3)
        gc.collect()


@pytest.mark.parametrize("preset, data_width", [("tiny", 64), ("alveo-u55c", 256)])
def test_lint_clean(preset, data_width):
    """Verilator -Wall with the project's waivers (sim/rtl_lint.VERILATOR_WAIVERS) only;
    ``rlast`` is deliberately unread, which the UNUSEDSIGNAL waiver covers."""
    port = MemoryPort(get_preset(preset), data_width=data_width)
    clean, output = verilator_lint(to_verilog(port, "memory_port"), "memory_port")
    assert clean, output


def test_flat_ports_match_the_block_design():
    """A top level with ``flat_members`` + ``connect_flat`` has exactly the ``m_axi_*``
    ports the Vivado flow wires (names, directions, widths), and lints."""
    interface = EngineInterface.for_config(TINY, ["engine.v"])
    signature = AXI4Signature(interface.axi_data_width, interface.axi_addr_width)

    class Top(wiring.Component):
        def __init__(self):
            super().__init__(signature.flat_members(interface.axi_prefix))

        def elaborate(self, platform):
            m = Module()
            m.submodules.port = port = MemoryPort(TINY, data_width=interface.axi_data_width)
            connect_flat(m, port.axi, self, interface.axi_prefix)
            return m

    verilog = to_verilog(Top(), "top")
    declared = {name: (direction, int(msb) + 1 if msb else 1) for direction, msb, name in
                re.findall(r"^\s*(input|output)\s+(?:wire\s+|reg\s+)?(?:\[(\d+):0\]\s+)?(\w+);",
                           verilog, re.M)}
    wanted = {name: (d + "put", w) for name, d, w in interface.ports()
              if name.startswith(interface.axi_prefix)}
    assert {n: v for n, v in declared.items() if n.startswith(interface.axi_prefix)} == wanted
    clean, output = verilator_lint(verilog, "top")
    assert clean, output


@pytest.mark.parametrize("p", [0.685, 0.75, 0.4])
def test_a_stream_keeps_the_memory_rate(p):
    """The simulated memory's read credit (sim.axi_memory.READ_CREDIT, mirrored by the cycle
    model's ReadCredit, which the MATMUL timing tests hold to the RTL): a stream taken as
    it comes gets beat i ceil(i/p) cycles after its first, i.e. the rate p itself. A credit
    capped at one beat rounded every leftover away and gave 1/ceil(1/p) (0.5 at the U55C's
    0.685)."""
    from math import ceil

    from sim.timing_common import ReadCredit

    bucket, due, offered = ReadCredit(p), 100, []
    for i in range(1000):
        t = due if not offered else offered[-1] + 1
        offered.append(bucket.offer(t, due, offered[-1] if offered else -10 ** 9))
    assert offered[0] == due
    assert [o - due for o in offered[:50]] == [ceil(i / p - 1e-9) for i in range(50)]
    assert 999 / (offered[-1] - offered[0]) == pytest.approx(p, rel=0.01)
