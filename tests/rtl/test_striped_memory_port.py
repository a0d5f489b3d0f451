"""StripedMemoryPort (the engine's memory channels in lockstep) against DeviceMemory, through
one AXI4 slave model per channel (sim/axi_memory.py with the configuration's Striping).

Every slave checks the AXI4 rules on its own port every cycle and answers only for its
own channel, mapping each port beat to its logical address, so a read that comes back
right and a write that lands right prove the striping map end to end: commands are
logical, each channel sees the physical bursts ``Striping`` says, and the engine beat is
the channels' beats side by side.
"""

from __future__ import annotations

import random
from math import ceil

import numpy as np
import pytest

from dfvg_hw.axi4 import AXI4Signature, master_prefix
from dfvg_hw.spec.config import get_preset
from dfvg_hw.spec.striping import Striping
from dfvg_hw.striped_memory_port import StripedMemoryPort
from dfvg_hw.verilog import to_verilog
from sim.axi_memory import AXI4SlaveMemory, MemoryTiming
from sim.lint import verilator_lint
from sim.memory import DeviceMemory
from sim.testbench import stream_put

from test_memory_port import (PAGE, Rig, data_beats, expected_beats, legal_bursts,
                              random_commands, run_and_snapshot)

HBM = get_preset("tiny-hbm")


class StripedRig(Rig):
    """:class:`test_memory_port.Rig` around a StripedMemoryPort: one slave per channel
    over one logical DeviceMemory (``slave`` is channel 0's, whose ``cycle`` the edges
    count)."""

    def __init__(self, *, config=HBM, port_width=None, timing=MemoryTiming(), memory=None,
                 error_ranges=None, seed=0, channel_of=None):
        self.dut = StripedMemoryPort(config, port_width=port_width)
        ports, width = self.dut.ports, self.dut.port_width
        self.striping = Striping(ports, width // 8, config.mem_bytes // ports)
        self.bytes_per_beat = self.dut.bytes_per_beat
        self.memory = memory if memory is not None else DeviceMemory(config.mem_bytes)
        channel_of = channel_of or list(range(ports))
        error_ranges = error_ranges or {}
        self.slaves = [AXI4SlaveMemory(self.dut.axi[p], self.memory, timing, seed=seed + 7 * p,
                                       striping=self.striping, channel=channel_of[p],
                                       error_ranges=error_ranges.get(p, ()))
                       for p in range(ports)]
        self.slave = self.slaves[0]
        self.rng = random.Random(seed + 1)
        self.feeding = 0
        self.beats = []
        self.accepted = {}
        self.write_done = 0

    def run(self, *testbenches):
        from sim.testbench import run_simulation
        run_simulation(self.dut, *testbenches, processes=[s.process for s in self.slaves])

    def channel_bursts(self, commands, channel):
        """The bursts channel ``channel`` must see for logical ``commands``."""
        s, out = self.striping, []
        for addr, length in commands:
            if length:
                start = channel * s.channel_bytes + addr // s.beat_bytes * s.port_bytes
                out += legal_bursts(start, ceil(length / s.beat_bytes) * s.port_bytes,
                                    s.port_bytes)
        return out


def logical_commands(rng, base, size, count, beat):
    """random_commands at engine-beat alignment, with tails that end in every channel
    (and some that leave whole channels out of the final beat)."""
    commands = random_commands(rng, base, size, count - 4, beat)
    for tail in (1, beat // 4 + 3, beat // 2, beat - 1):
        commands.append((base + beat * rng.randrange(size // beat - 200), 37 * beat + tail))
    rng.shuffle(commands)
    return commands


@pytest.mark.parametrize("port_width, stall", [(64, 0.2), (128, 0.0)])
def test_random_reads_and_writes_match_device_memory(port_width, stall):
    """Reads and writes at once, random stalls on the port's three streams and (first
    case) on every channel independently, so the channels drift apart and the lockstep
    merge has to hold beats back; compared bit for bit with DeviceMemory, and every
    channel's bursts with the striping map (64-bit ports: both the 256-beat and the 4 KiB
    split occur)."""
    rng = random.Random(port_width)
    timing = MemoryTiming(read_latency=6, write_latency=4, stall=stall, beats_per_cycle=0.75)
    rig = StripedRig(port_width=port_width, timing=timing, seed=3)
    beat = rig.bytes_per_beat
    region = 0x10000
    image = rng.randbytes(2 * region)
    rig.memory.write(0, image)
    reference = bytearray(image)

    reads = logical_commands(rng, 0, region, 16, beat)
    writes = logical_commands(rng, region, region, 16, beat)
    payload = rng.randbytes(sum(n for _, n in writes))
    write_beats, offset = [], 0
    for addr, length in writes:
        reference[addr:addr + length] = payload[offset:offset + length]
        write_beats += data_beats(payload[offset:offset + length], beat, rig.rng)
        offset += length
    assert sum(ceil(n / beat) for _, n in reads) + len(write_beats) >= 1000

    run_and_snapshot(
        rig,
        rig.feed_commands(rig.dut.read_cmd, "read", reads, stall=0.3),
        rig.feed_commands(rig.dut.write_cmd, "write", writes, stall=0.3),
        rig.feed_write_data(write_beats, stall=0.3),
        rig.take_read_beats(len(reads), stall=0.3),
        rig.until_idle(5_000, len(writes)))

    want = [b for addr, n in reads for b in expected_beats(image, addr, n, beat)]
    assert [(d, last) for _, d, last in rig.beats] == want
    assert rig.memory.read(0, 2 * region) == bytes(reference)
    for p, slave in enumerate(rig.slaves):
        assert slave.read_bursts == rig.channel_bursts(reads, p)
        assert slave.write_bursts == rig.channel_bursts(writes, p)
    assert rig.write_done == len(writes)
    assert rig.error() == {"range": 0, "misaligned": 0, "response": 0}
    assert rig.counters["read_bytes"] == sum(n for _, n in reads)
    assert rig.counters["write_bytes"] == sum(n for _, n in writes)
    assert 0 < rig.counters["busy_cycles"] <= rig.slave.cycle


def test_lockstep_is_one_port_of_the_engine_beat():
    """At tiny-hbm's own memory (4 × 128 bits, latency 10, 0.75 beats a cycle a port), an
    engine beat leaves in exactly the cycle a lone MemoryPort's beat does when given the
    same command in port beats on one channel: commands accepted, every read beat and
    every write completion on the same edges. This is the cycle model's assumption."""
    timing = MemoryTiming.for_config(HBM)
    assert (timing.read_latency, timing.beats_per_cycle) == (10, 0.75)
    rng = random.Random(9)
    beat, port_beat = HBM.mem_beat_bytes, HBM.port_bytes
    reads = [(beat * rng.randrange(4000), rng.choice([1, 40, beat, 3 * beat + 17, 300 * beat + 5]))
             for _ in range(12)]
    writes = [(beat * rng.randrange(4000, 8000), rng.choice([9, 2 * beat, 70 * beat + 33]))
              for _ in range(6)]

    def scenario(rig, translate):
        rd = [translate(c) for c in reads]
        wr = [translate(c) for c in writes]
        nbeats = sum(ceil(n / rig.bytes_per_beat) for _, n in wr)
        data = [rng.getrandbits(8 * rig.bytes_per_beat) for _ in range(nbeats)]
        done = []

        async def until_idle(ctx):          # rig.until_idle, recording write_done's edges
            for _ in range(20_000):
                await ctx.tick()
                if ctx.get(rig.dut.write_done):
                    done.append(rig.slave.cycle)
                if not rig.feeding and len(done) == len(wr) \
                        and ctx.get(rig.dut.read_idle) and ctx.get(rig.dut.write_idle):
                    return
            raise AssertionError("hung")

        rig.run(rig.feed_commands(rig.dut.read_cmd, "read", rd),
                rig.feed_commands(rig.dut.write_cmd, "write", wr),
                rig.feed_write_data(data), rig.take_read_beats(len(rd)), until_idle)
        return ([edge for edge, _, _ in rig.beats],
                [edge for edge, _, last in rig.beats if last],
                sorted(rig.accepted.items()), done, rig.slave.cycle)

    striped = StripedRig(timing=timing)
    lone = Rig(data_width=HBM.mem_port_bits, timing=timing, config=HBM)
    in_port_beats = lambda c: (c[0] // beat * port_beat, ceil(c[1] / beat) * port_beat)
    got, want = scenario(striped, lambda c: c), scenario(lone, in_port_beats)
    assert got == want
    assert len(got[0]) > 1000


def test_refusals_and_error_responses():
    """A command past the memory or off the engine beat (on a port beat) is refused by
    every channel alike: its flag, nothing on any bus. A failing burst on one channel
    raises ``response`` while the engine beats stay framed (that channel's part zero); a
    slave wired to another channel's port refuses the port's addresses (DECERR)."""
    beat = HBM.mem_beat_bytes
    image = bytes(range(256)) * 64
    refused = [((HBM.mem_bytes - beat, beat + 1), "range"),
               ((HBM.mem_bytes, 1), "range"),
               ((HBM.port_bytes, beat), "misaligned")]
    for (addr, length), flag in refused:
        rig = StripedRig()
        rig.memory.write(0, image)
        run_and_snapshot(rig, rig.feed_commands(rig.dut.read_cmd, "read", [(addr, length), (0, 5)]),
                         rig.take_read_beats(1), rig.until_idle(500))
        assert rig.error() == {"range": int(flag == "range"),
                               "misaligned": int(flag == "misaligned"), "response": 0}
        assert [s.read_bursts for s in rig.slaves] == [rig.channel_bursts([(0, 5)], p)
                                                       for p in range(4)]
        assert [(d, last) for _, d, last in rig.beats] == expected_beats(image, 0, 5, beat)

    # channel 2's first 4 KiB page answers SLVERR: the beats of a read there have zeros
    # in channel 2's slice, and the data elsewhere is right
    c = HBM.mem_bytes // 4
    rig = StripedRig(error_ranges={2: [(2 * c, 2 * c + PAGE)]})
    rig.memory.write(0, image)
    run_and_snapshot(rig, rig.feed_commands(rig.dut.read_cmd, "read", [(0, 3 * beat)]),
                     rig.take_read_beats(1), rig.until_idle(500))
    masked = bytearray(image[:3 * beat])
    for b in range(3):
        masked[b * beat + 32:b * beat + 48] = bytes(16)
    assert [(d, last) for _, d, last in rig.beats] == expected_beats(bytes(masked), 0, 3 * beat, beat)
    assert rig.error() == {"range": 0, "misaligned": 0, "response": 1}

    # port 3's bus answered by a slave of channel 1: every address is outside it
    rig = StripedRig(channel_of=[0, 1, 2, 1])
    rig.memory.write(0, image)
    run_and_snapshot(rig, rig.feed_commands(rig.dut.write_cmd, "write", [(beat, beat)]),
                     rig.feed_write_data([(1 << 512) - 1]), rig.until_idle(500, 1))
    assert rig.error()["response"] == 1 and rig.write_done == 1
    want = bytearray(image[:2 * beat])
    want[beat:beat + 48] = b"\xff" * 48
    assert rig.memory.read(0, 2 * beat) == bytes(want)


def test_slave_of_one_channel_maps_physical_to_logical():
    """The per-channel slave reads a port beat at its logical address and refuses what
    lies outside its channel (the host's DeviceMemory stays logical)."""
    s = Striping.for_config(HBM)
    memory = DeviceMemory(HBM.mem_bytes)
    memory.write(0, np.arange(4 * s.beat_bytes, dtype=np.uint8).tobytes())
    bus = AXI4Signature(HBM.mem_port_bits).create()
    slave = AXI4SlaveMemory(bus, memory, striping=s, channel=2)
    burst = slave._address("AR", s.physical(s.beat_bytes + 32), 0, 4, 1)
    assert slave._read_beat(burst) == int.from_bytes(bytes(range(96, 112)), "little")
    assert slave._address("AR", s.physical(32), 0, 4, 1).resp == 0
    assert slave._address("AR", s.physical(16), 0, 4, 1).resp == 3          # channel 1
    assert slave._address("AR", 3 * s.channel_bytes - 16, 0, 4, 1).resp == 0  # its last beat
    assert slave._address("AR", 3 * s.channel_bytes, 0, 4, 1).resp == 3      # channel 3


def test_lint_clean_and_named_masters():
    clean, output = verilator_lint(to_verilog(StripedMemoryPort(HBM), "striped"), "striped")
    assert clean, output
    assert [master_prefix(p, 4) for p in range(4)] == ["m00_axi_", "m01_axi_", "m02_axi_", "m03_axi_"]
