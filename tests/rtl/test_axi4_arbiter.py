"""AXI4Arbiter (several AXI4 masters onto one memory port) with real MemoryPorts and
StripedMemoryPorts as its masters, against the AXI4 slave model of sim/axi_memory.py,
which checks the AXI4 rules on the merged port every cycle.

Each master reads its own region and writes another, so a read beat routed to the wrong
master, a write beat taken from the wrong one or a B response counted by the wrong one
shows up as wrong data, wrong memory or a hang. A monitor on the masters' AR and AW
handshakes checks that no master waits while another is granted twice (round-robin).
"""

from __future__ import annotations

import gc
import random
import warnings

import pytest
from amaranth import Elaboratable, Module
from amaranth.hdl import UnusedElaboratable
from amaranth.lib import wiring

from dfvg_hw.axi4_arbiter import AXI4Arbiter
from dfvg_hw.striped_memory_port import StripedMemoryPort
from dfvg_hw.verilog import to_verilog
from sim.axi_memory import AXI4SlaveMemory, MemoryTiming
from sim.lint import verilator_lint
from sim.memory import DeviceMemory
from sim.testbench import run_simulation

from test_memory_port import (DATA_WIDTH, TINY, Rig, data_beats, expected_beats, legal_bursts,
                              random_commands)
from test_striped_memory_port import HBM, StripedRig, logical_commands

REGION = 0x8000


class Merged(Elaboratable):
    """The masters' ports through one arbiter (``arbiter.axi`` is the merged port)."""

    def __init__(self, masters, ports: int = 1, data_width: int = DATA_WIDTH):
        self.masters = masters
        self.arbiter = AXI4Arbiter(len(masters), ports=ports, data_width=data_width)

    def elaborate(self, platform):
        m = Module()
        m.submodules.arbiter = arbiter = self.arbiter
        for i, master in enumerate(self.masters):
            m.submodules[f"master{i}"] = master
            ports = master.axi if isinstance(master, StripedMemoryPort) else [master.axi]
            for p, axi in enumerate(ports):
                wiring.connect(m, axi, arbiter.masters[i][p])
        return m


class Traffic:
    """Random reads of one region and writes of another for one master (a :class:`Rig`),
    with the data they must read and leave behind."""

    def __init__(self, rig, rng, base: int, count: int, commands=random_commands, stall=0.3):
        beat = rig.bytes_per_beat
        self.rig, self.stall = rig, stall
        self.image = rng.randbytes(2 * REGION)
        rig.memory.write(base, self.image)
        self.reference = bytearray(self.image)
        self.reads = commands(rng, base, REGION, count, beat)
        self.writes = commands(rng, base + REGION, REGION, count, beat)
        payload = rng.randbytes(sum(n for _, n in self.writes))
        self.write_beats, offset = [], 0
        for addr, length in self.writes:
            start = addr - base
            self.reference[start:start + length] = payload[offset:offset + length]
            self.write_beats += data_beats(payload[offset:offset + length], beat, rig.rng)
            offset += length
        self.base = base

    def testbenches(self, limit: int):
        rig, stall = self.rig, self.stall
        return [rig.feed_commands(rig.dut.read_cmd, "read", self.reads, stall=stall),
                rig.feed_commands(rig.dut.write_cmd, "write", self.writes, stall=stall),
                rig.feed_write_data(self.write_beats, stall=stall),
                rig.take_read_beats(sum(1 for _, n in self.reads if n), stall=stall),
                rig.until_idle(limit, len(self.writes))]

    def check(self):
        rig, beat = self.rig, self.rig.bytes_per_beat
        image = bytes(self.base) + self.image           # expected_beats takes absolute addresses
        want = [b for addr, n in self.reads for b in expected_beats(image, addr, n, beat)]
        assert [(d, last) for _, d, last in rig.beats] == want
        assert rig.memory.read(self.base, 2 * REGION) == bytes(self.reference)
        assert rig.write_done == len(self.writes)


def handshakes(merged: Merged, trace: list):
    """A process that appends, each cycle, ``{"ar"|"aw": [(valid, transferred) per master]}``
    for port 0 of every master."""
    arbiter = merged.arbiter
    signals = [getattr(arbiter.masters[i][0], ch + s) for ch in ("ar", "aw")
               for i in range(arbiter.n_masters) for s in ("valid", "ready")]

    async def process(ctx):
        async for _, _, *values in ctx.tick().sample(*signals):
            pairs = [(bool(v), bool(v and r)) for v, r in zip(values[::2], values[1::2])]
            n = arbiter.n_masters
            trace.append({"ar": pairs[:n], "aw": pairs[n:]})
    return process


def assert_round_robin(trace: list, channel: str) -> int:
    """No master waits (valid, not yet transferred) while another is granted twice; returns
    the longest wait in grants to others."""
    n = len(trace[0][channel])
    waiting = [None] * n            # per master: grants to each other master since it waited
    longest = 0
    for cycle, both in enumerate(trace):
        pairs = both[channel]
        for i, (valid, _) in enumerate(pairs):
            if valid and waiting[i] is None:
                waiting[i] = [0] * n
        for j, (_, granted) in enumerate(pairs):
            if not granted:
                continue
            assert sum(g for _, g in pairs) == 1, f"cycle {cycle}: two {channel.upper()} grants"
            assert max(waiting[j]) <= 1, (f"{channel.upper()}, cycle {cycle}: master {j} waited "
                                          f"while the others were granted {waiting[j]} times")
            longest = max(longest, sum(waiting[j]))
            waiting[j] = None
            for i in range(n):
                if i != j and waiting[i] is not None:
                    waiting[i][j] += 1
    return longest


def memory_rigs(n: int, memory: DeviceMemory, seed: int):
    return [Rig(memory=memory, seed=seed + 10 * i) for i in range(n)]


def run_merged(merged: Merged, rigs, slaves, testbenches, processes=()):
    for rig in rigs:
        rig.slave = slaves[0]          # the rigs time their records by the merged slave
    run_simulation(merged, *testbenches, processes=[s.process for s in slaves] + list(processes))


@pytest.mark.parametrize("masters", [2, 3])
def test_random_traffic_reaches_the_right_master(masters):
    """2 and 3 MemoryPorts reading and writing at once with random stalls everywhere
    (their commands, write data and read beats; the memory's five channels): every read
    beat reaches its master with the right data, every write lands, each master's bursts
    reach the memory in its own order, and reads of different masters are in flight at
    once."""
    rng = random.Random(masters)
    memory = DeviceMemory(TINY.mem_bytes)
    rigs = memory_rigs(masters, memory, seed=masters)
    merged = Merged([rig.dut for rig in rigs])
    timing = MemoryTiming(read_latency=6, write_latency=4, stall=0.2)
    slave = AXI4SlaveMemory(merged.arbiter.axi[0], memory, timing, seed=masters)
    traffic = [Traffic(rig, rng, i * 2 * REGION, 14) for i, rig in enumerate(rigs)]
    trace, owners_in_flight = [], set()

    async def in_flight(ctx):
        async for _ in ctx.tick():
            owners_in_flight.add(frozenset(b.addr // (2 * REGION) for b in slave._reads))

    run_merged(merged, rigs, [slave], [tb for t in traffic for tb in t.testbenches(60_000)],
               [handshakes(merged, trace), in_flight])
    bpb = DATA_WIDTH // 8
    for i, t in enumerate(traffic):
        t.check()
        mine = [b for b in slave.read_bursts if b[0] // (2 * REGION) == i]
        assert mine == [b for a, n in t.reads for b in legal_bursts(a, n, bpb)]
        mine = [b for b in slave.write_bursts if b[0] // (2 * REGION) == i]
        assert mine == [b for a, n in t.writes for b in legal_bursts(a, n, bpb)]
    assert max(len(owners) for owners in owners_in_flight) >= 2
    for channel in ("ar", "aw"):
        assert_round_robin(trace, channel)


def test_full_load_is_shared_round_robin():
    """Three masters that always have a burst to issue, in front of a memory that takes
    one AR only as a read finishes: each waits at most one grant of each other master,
    none starves, and the memory sees their bursts in strict rotation while all three are
    busy."""
    memory = DeviceMemory(TINY.mem_bytes)
    rigs = memory_rigs(3, memory, seed=50)
    merged = Merged([rig.dut for rig in rigs])
    slave = AXI4SlaveMemory(merged.arbiter.axi[0], memory, MemoryTiming(read_latency=4,
                                                                        max_outstanding=2))
    reads = 24
    trace, tbs = [], []
    for i, rig in enumerate(rigs):
        commands = [(i * REGION + 64 * k, 64) for k in range(reads)]       # 8-beat bursts
        tbs += [rig.feed_commands(rig.dut.read_cmd, "read", commands),
                rig.take_read_beats(reads), rig.until_idle(20_000)]
    run_merged(merged, rigs, [slave], tbs, [handshakes(merged, trace)])
    assert all(len(rig.beats) == 8 * reads for rig in rigs)
    assert assert_round_robin(trace, "ar") <= 2
    owners = [addr // REGION for addr, _ in slave.read_bursts]
    busy = owners[:3 * reads - 6]        # the tail: some masters are done
    assert busy[3:] == [busy[k % 3] for k in range(3, len(busy))]
    assert sorted(busy[:3]) == [0, 1, 2]


def test_a_master_alone_loses_no_cycle():
    """One of three masters busy, the others idle: every read beat, every command and the
    last write response come at exactly the edges they come without an arbiter (what
    keeps a core alone on the cycle model)."""
    def run(through_arbiter: bool):
        rng = random.Random(9)
        memory = DeviceMemory(TINY.mem_bytes)
        rig = Rig(memory=memory, seed=70)
        traffic = Traffic(rig, rng, 2 * REGION, 10, stall=0.0)
        timing = MemoryTiming(read_latency=7, write_latency=3, beats_per_cycle=0.75)
        if through_arbiter:
            rigs = [Rig(memory=memory, seed=71), rig, Rig(memory=memory, seed=72)]
            merged = Merged([r.dut for r in rigs])
            slave = AXI4SlaveMemory(merged.arbiter.axi[0], memory, timing)
            run_merged(merged, rigs, [slave], traffic.testbenches(20_000))
        else:
            rig.slave = slave = AXI4SlaveMemory(rig.dut.axi, memory, timing)
            rig.run(*traffic.testbenches(20_000))
        traffic.check()
        return rig.beats, rig.accepted, slave.cycle

    assert run(True) == run(False)


def test_striped_masters_share_every_channel_in_one_order():
    """Two StripedMemoryPorts (tiny-hbm's four channels, 64-bit ports) on four merged
    ports, each channel's memory stalling on its own (70 % of cycles) so the channels
    drift apart: with one grant for every channel both masters' bursts reach every channel
    in the same order, so neither waits for a beat queued behind the other's on another
    channel, and every beat and write is right. (With a grant per channel this case
    deadlocks: each master holds one channel's beat waiting for its other channel, where
    the other master's beats come first.)"""
    seed = 3
    rng = random.Random(seed)
    memory = DeviceMemory(HBM.mem_bytes)
    rigs = [StripedRig(port_width=64, memory=memory, seed=3 * seed + 10 * i) for i in range(2)]
    merged = Merged([rig.dut for rig in rigs], ports=4, data_width=64)
    timing = MemoryTiming(read_latency=6, write_latency=4, stall=0.7, beats_per_cycle=0.75)
    striping = rigs[0].striping
    slaves = [AXI4SlaveMemory(merged.arbiter.axi[p], memory, timing, seed=seed + p,
                              striping=striping, channel=p) for p in range(4)]
    traffic = [Traffic(rig, rng, i * 2 * REGION, 4, commands=logical_commands, stall=0.0)
               for i, rig in enumerate(rigs)]
    run_merged(merged, rigs, slaves, [tb for t in traffic for tb in t.testbenches(20_000)])
    for t in traffic:
        t.check()
    orders = [[striping.logical(addr) // (2 * REGION) for addr, _ in slave.read_bursts]
              for slave in slaves]
    assert all(order == orders[0] for order in orders), "the channels' read orders differ"
    for p, slave in enumerate(slaves):
        assert sorted(slave.read_bursts) == sorted(
            b for t, rig in zip(traffic, rigs) for b in rig.channel_bursts(t.reads, p))


def test_one_master_is_wires():
    """With one master nothing is added: no queue, no register, the ports wired through."""
    verilog = to_verilog(AXI4Arbiter(1, ports=2, data_width=64), "arbiter")
    assert "always" not in verilog and "reg " not in verilog


def test_bad_parameters_are_refused():
    with warnings.catch_warnings():
        # The half-built components are garbage, and Amaranth warns about unused elaboratables.
        warnings.simplefilter("ignore", UnusedElaboratable)
        with pytest.raises(ValueError, match="at least one master"):
            AXI4Arbiter(0)
        with pytest.raises(ValueError, match="max_outstanding"):
            AXI4Arbiter(2, max_outstanding=0)
        gc.collect()


@pytest.mark.parametrize("masters, ports", [(3, 1), (2, 4)])
def test_lint_clean(masters, ports):
    top = AXI4Arbiter(masters, ports=ports, data_width=128)
    clean, output = verilator_lint(to_verilog(top, "arbiter"), "arbiter")
    assert clean, output

