"""BeatNarrower (the non-matrix parts' D-bit port on the W-bit engine beat) against a
Python reference of what it must do, with a behavioural wide port behind it.

The wide port here is a model of the memory port's client contract: it takes commands
when it likes, streams ``ceil(length / W)`` beats per read (bytes past ``length``
zeroed) with random gaps, takes write beats with random back-pressure and writes their
bytes up to ``length``. It asserts that every command it gets is one the narrower may
forward (engine-beat aligned, in range, not empty). The reference is the narrow port's
contract: the pieces are memory bytes ``[addr, addr + length)`` zero-padded to whole
``D``-bit pieces, ``last`` on the final one, and the wide command is the read from
``addr`` rounded down to ``W``.
"""

from __future__ import annotations

import random
from collections import deque
from math import ceil

import pytest
from amaranth import Elaboratable, Module, Signal

from dfvg_hw.beat_narrower import BeatNarrower
from dfvg_hw.spec.config import get_preset
from sim.testbench import run_simulation

HBM = get_preset("tiny-hbm")            # 4 × 128-bit channels: W = 512, D = 128
MEM = 1 << 16                           # the bytes the commands address (mem_bytes is larger)


class _Clocked(Elaboratable):
    """The narrower with a ``sync`` domain even where it is a wire (W == D)."""

    def __init__(self, dut):
        self.dut = dut

    def elaborate(self, platform):
        m = Module()
        m.submodules.dut = self.dut
        tick = Signal()
        m.d.sync += tick.eq(~tick)
        return m


class Rig:
    """A narrower, a wide-port model and a narrow-side client, driven one cycle at a time
    from one testbench (inputs set, settled outputs read, then the edge)."""

    def __init__(self, wide=512, narrow=128, *, seed=0, gaps=0.3, stalls=0.3, config=HBM):
        self.dut = BeatNarrower(config, wide, narrow)
        self.W, self.D = wide // 8, narrow // 8
        self.rng = random.Random(seed)
        self.gaps, self.stalls = gaps, stalls
        self.memory = bytearray(self.rng.randbytes(MEM))
        self.mem_bytes = config.mem_bytes
        self.wide_commands = []             # (addr, length) the wide port took, reads
        self.wide_writes = []
        self.pieces = []                    # (data bytes, last) the client took
        self.cycles = 0
        self.bubbles = 0                    # cycles a wide beat waited with the client ready

    def run(self, reads=(), writes=(), *, errors=None, check_no_bubbles=False, limit=200_000):
        """Issue ``reads`` then ``writes`` ((addr, length) each, or (addr, length, data)
        for writes) through the narrow port; returns the error flags seen at the end."""
        dut, rng = self.dut, self.rng
        result = {}

        async def bench(ctx):
            n, w = dut.narrow, dut.wide
            reads_left, writes_left = deque(reads), deque(writes)
            beats = deque()                  # the wide port's read beats still to send
            wide_writes = deque()            # (addr, length, beats) write commands taken
            narrow_writes = deque()          # the client's write beats still to offer
            current = None                   # the wide beat on read_data
            for _ in range(limit):
                if not (reads_left or writes_left or beats or current or narrow_writes
                        or wide_writes):
                    break
                # the client: commands, then read pieces with back-pressure, write beats
                cmd = reads_left[0] if reads_left else None
                ctx.set(n.read_cmd.valid, cmd is not None)
                if cmd:
                    ctx.set(n.read_cmd.payload.addr, cmd[0])
                    ctx.set(n.read_cmd.payload.length, cmd[1])
                wcmd = writes_left[0] if (writes_left and not reads_left) else None
                ctx.set(n.write_cmd.valid, wcmd is not None)
                if wcmd:
                    ctx.set(n.write_cmd.payload.addr, wcmd[0])
                    ctx.set(n.write_cmd.payload.length, wcmd[1])
                ready = check_no_bubbles or rng.random() >= self.stalls
                ctx.set(n.read_data.ready, ready)
                offer = narrow_writes and rng.random() >= self.stalls
                ctx.set(n.write_data.valid, bool(offer))
                if offer:
                    ctx.set(n.write_data.payload, int.from_bytes(narrow_writes[0], "little"))
                # the wide port
                ctx.set(w.read_cmd.ready, rng.random() >= self.stalls)
                ctx.set(w.write_cmd.ready, rng.random() >= self.stalls)
                ctx.set(w.write_data.ready, rng.random() >= self.stalls)
                if current is None and beats and rng.random() >= self.gaps:
                    current = beats.popleft()
                ctx.set(w.read_data.valid, current is not None)
                if current is not None:
                    ctx.set(w.read_data.payload.data, int.from_bytes(current[0], "little"))
                    ctx.set(w.read_data.payload.last, current[1])
                # what moves this cycle
                if ctx.get(w.read_cmd.valid) and ctx.get(w.read_cmd.ready):
                    addr, length = ctx.get(w.read_cmd.payload.addr), ctx.get(w.read_cmd.payload.length)
                    # a wire (W == D) passes a zero-length read on: the port's no-op
                    assert addr % self.W == 0 and addr + length <= self.mem_bytes
                    assert length or self.W == self.D
                    self.wide_commands.append((addr, length))
                    data = bytes(self.memory[addr:addr + length])
                    data += bytes(-len(data) % self.W)
                    count = len(data) // self.W
                    beats.extend((data[i * self.W:(i + 1) * self.W], i == count - 1)
                                 for i in range(count))
                if cmd and ctx.get(n.read_cmd.ready):
                    reads_left.popleft()
                if wcmd and ctx.get(n.write_cmd.ready):
                    writes_left.popleft()
                    addr, length, data = wcmd
                    if ctx.get(w.write_cmd.valid):
                        narrow_writes.extend(data[i:i + self.D] for i in range(0, len(data), self.D))
                if ctx.get(w.write_cmd.valid) and ctx.get(w.write_cmd.ready):
                    addr, length = ctx.get(w.write_cmd.payload.addr), ctx.get(w.write_cmd.payload.length)
                    assert addr % self.W == 0 and length and addr + length <= self.mem_bytes
                    self.wide_writes.append((addr, length))
                    wide_writes.append([addr, length, ceil(length / self.W)])
                if ctx.get(n.read_data.valid) and ready:
                    value = ctx.get(n.read_data.payload.data)
                    self.pieces.append((value.to_bytes(self.D, "little"),
                                        bool(ctx.get(n.read_data.payload.last))))
                elif current is not None and ready:
                    self.bubbles += 1
                if current is not None and ctx.get(w.read_data.ready):
                    current = None
                if offer and ctx.get(n.write_data.ready):
                    narrow_writes.popleft()
                if ctx.get(w.write_data.valid) and ctx.get(w.write_data.ready):
                    assert wide_writes, "write data without a command"
                    entry = wide_writes[0]
                    addr, length, left = entry
                    beat = ctx.get(w.write_data.payload).to_bytes(self.W, "little")
                    offset = (ceil(length / self.W) - left) * self.W
                    keep = min(self.W, length - offset)
                    self.memory[addr + offset:addr + offset + keep] = beat[:keep]
                    entry[2] -= 1
                    if entry[2] == 0:
                        wide_writes.popleft()
                await ctx.tick()
                self.cycles += 1
            else:
                raise AssertionError("the narrower hung")
            for stream in (n.read_cmd, n.write_cmd, n.write_data):
                ctx.set(stream.valid, 0)
            result["error"] = {f: ctx.get(getattr(n.error, f)) for f in ("range", "misaligned")}
            ctx.set(n.clear_error, 1)
            await ctx.tick()
            ctx.set(n.clear_error, 0)
            result["cleared"] = ctx.get(n.error.as_value())

        run_simulation(_Clocked(self.dut), bench)
        return result

    def expected_pieces(self, reads, memory):
        out = []
        for addr, length in reads:
            data = bytes(memory[addr:addr + length])
            data += bytes(-len(data) % self.D)
            count = len(data) // self.D
            out += [(data[i * self.D:(i + 1) * self.D], i == count - 1) for i in range(count)]
        return out

    def expected_wide(self, reads):
        return [(a - a % self.W, n + a % self.W) for a, n in reads if n]


def random_reads(rng, count, W, D):
    """Reads at every skip into the wide beat, of every length class: 1 byte, under a
    piece, whole pieces, ending on a wide-beat boundary, several wide beats."""
    out = []
    for _ in range(count):
        addr = rng.randrange(0, MEM // 2, D)
        length = rng.choice([1, D - 1, D, W, W - addr % W, 2 * W - addr % W,
                             rng.randrange(1, 4 * W), rng.randrange(1, 2 * D)])
        out.append((addr, length))
    return out


@pytest.mark.parametrize("wide,narrow,count", [(512, 128, 1000), (1024, 256, 200)])
def test_random_reads(wide, narrow, count):
    rig = Rig(wide, narrow, seed=wide)
    reads = random_reads(random.Random(count), count, wide // 8, narrow // 8)
    memory = bytes(rig.memory)
    result = rig.run(reads)
    assert rig.pieces == rig.expected_pieces(reads, memory)
    assert rig.wide_commands == rig.expected_wide(reads)
    assert result["error"] == {"range": 0, "misaligned": 0}


def test_reads_add_no_cycle():
    """A client always ready takes a piece in every cycle a wide beat waits: the leading
    pieces cost nothing and the wide beat is taken with its last piece."""
    rig = Rig(seed=3)
    reads = random_reads(random.Random(5), 200, rig.W, rig.D)
    memory = bytes(rig.memory)
    rig.run(reads, check_no_bubbles=True)
    assert rig.pieces == rig.expected_pieces(reads, memory)
    assert rig.bubbles == 0


def test_edge_reads():
    """Length 0 (no wide command, no piece), exactly W from a wide beat, one byte at the
    last piece of a wide beat, a read ending on a wide-beat boundary."""
    rig = Rig(seed=1)
    W, D = rig.W, rig.D
    reads = [(4 * W, 0), (4 * W, W), (5 * W + W - D, 1), (6 * W + D, W - D), (7 * W + 2 * D, 0),
             (8 * W + 3 * D, D + 1)]
    memory = bytes(rig.memory)
    result = rig.run(reads)
    assert rig.pieces == rig.expected_pieces(reads, memory)
    assert rig.wide_commands == [(4 * W, W), (5 * W, W - D + 1), (6 * W, W), (8 * W, 3 * D + D + 1)]
    assert [p[1] for p in rig.pieces].count(True) == 4
    assert result["error"] == {"range": 0, "misaligned": 0}


def test_refusals():
    """A read off the narrow beat, a write off the wide beat and commands past mem_bytes
    are accepted and dropped with their flag (nothing reaches the wide port); clear_error
    clears the flags."""
    for reads, writes, flag in [([(64 + 4, 16)], [], "misaligned"),
                                ([(HBM.mem_bytes - 16, 32)], [], "range"),
                                ([], [(64 + 16, 16, bytes(16))], "misaligned"),
                                ([], [(HBM.mem_bytes - 64, 128, bytes(128))], "range")]:
        rig = Rig(seed=2)
        result = rig.run(reads, writes)
        assert not rig.wide_commands and not rig.wide_writes and not rig.pieces
        assert result["error"][flag] == 1 and sum(result["error"].values()) == 1
        assert result["cleared"] == 0


@pytest.mark.parametrize("wide,narrow", [(512, 128), (1024, 256)])
def test_random_writes(wide, narrow):
    """Writes from engine beats of random lengths (a partial final wide beat, one byte,
    exactly W) land byte for byte, and not a byte past ``length``."""
    rig = Rig(wide, narrow, seed=7)
    W, D = rig.W, rig.D
    rng = random.Random(11)
    reference = bytearray(rig.memory)
    writes = []
    for _ in range(1000 if wide == 512 else 200):
        addr = rng.randrange(0, MEM // 2, W)
        length = rng.choice([1, D, W, W + D, rng.randrange(1, 4 * W)])
        data = rng.randbytes(length) + bytes(-length % D)
        writes.append((addr, length, data))
        reference[addr:addr + length] = data[:length]
    result = rig.run((), writes)
    assert rig.memory == reference
    assert rig.wide_writes == [(a, n) for a, n, _ in writes]
    assert result["error"] == {"range": 0, "misaligned": 0}


def test_one_port_is_a_wire():
    """W == D: commands reach the wide port unchanged (the port refuses what it refuses)
    and its beats pass as they are."""
    rig = Rig(128, 128, seed=4)
    reads = [(0, 1), (16, 16), (48, 100), (32, 0)]
    memory = bytes(rig.memory)
    rig.run(reads, check_no_bubbles=True)
    assert rig.wide_commands == reads
    assert rig.pieces == rig.expected_pieces(reads, memory)
    assert rig.bubbles == 0


def test_lint_clean():
    from dfvg_hw.verilog import to_verilog
    from sim.lint import verilator_lint
    clean, output = verilator_lint(to_verilog(BeatNarrower(HBM, 512, 128), "beat_narrower"),
                                   "beat_narrower")
    assert clean, output
