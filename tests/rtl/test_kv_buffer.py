"""KV buffer RTL against a numpy model of the functional engine's ``kv_k`` / ``kv_v``.

The model is ``FunctionalEngine``'s KV semantics (sim/functional.py, docs/isa.md §1.4,
§3.6–3.7): KVAPPEND writes ``kv[layer, head, POS, :k]``; ATTN reads positions
``0 … POS``; ``POS ≥ kv_positions`` is an overflow that writes nothing; rollback is just
setting POS (the request's start_pos).
"""

from __future__ import annotations

from math import gcd

import numpy as np
import pytest

from dfvg_hw.spec.config import get_preset
from dfvg_hw.kv_buffer import KVBuffer, KVOp
from dfvg_hw.verilog import to_verilog
from sim.lint import verilator_lint
from sim.testbench import run_simulation, stream_get, stream_put, watchdog

TINY = get_preset("tiny")
CONFIGS = {
    "tiny": TINY,                                                    # 8-byte words, 2 per entry
    "l3h3p20d32": TINY.with_changes(kv_layers=3, kv_heads=3, kv_positions=20, head_dim=32,
                                    reduce=16),                      # non-power-of-two map
    "l1h5p7r4": TINY.with_changes(kv_layers=1, kv_heads=5, kv_positions=7, reduce=4),
}
ONE_POSITION = TINY.with_changes(kv_layers=1, kv_heads=1, kv_positions=1)


class KVModel:
    """Reference: the functional model's KV arrays, POS register and error flags."""

    def __init__(self, cfg, word_bytes):
        self.cfg, self.wb = cfg, word_bytes
        shape = (cfg.kv_layers, cfg.kv_heads, cfg.kv_positions, cfg.head_dim)
        self.k, self.v = np.zeros(shape, np.int64), np.zeros(shape, np.int64)
        self.pos = 0
        self.overflow = self.range = 0

    def rollback(self, n):
        self.pos = min(n, self.cfg.kv_positions)

    def advance(self):
        self.pos = min(self.pos + 1, self.cfg.kv_positions)

    def _check(self, layer, head, k=0):
        c = self.cfg
        ovf = self.pos >= c.kv_positions
        rng = layer >= c.kv_layers or head >= c.kv_heads or k > c.head_dim
        self.overflow |= ovf
        self.range |= rng
        return not (ovf or rng)

    def append(self, layer, head, k, kd, vd):
        if self._check(layer, head, k):
            self.k[layer, head, self.pos, :k] = kd[:k]
            self.v[layer, head, self.pos, :k] = vd[:k]

    def read(self, layer, head):
        """The READ beats (data, v, last), or [] for a READ in error."""
        if not self._check(layer, head):
            return []
        beats = []
        for v, arr in ((0, self.k), (1, self.v)):
            words = arr[layer, head, :self.pos + 1].reshape(-1, self.wb)
            beats += [(w.tolist(), v, int(i == len(words) - 1)) for i, w in enumerate(words)]
        return beats


def words_of(entry, wb):
    return [[int(b) for b in entry[i:i + wb]] for i in range(0, len(entry), wb)]


def run_ops(cfg, ops, rng, *, wgap=0.2, backpressure=0.3, check_each=True, stall=None):
    """Drive ``ops`` into a KVBuffer and the model; compare every READ beat and, after
    every command, ``pos`` and ``error``; ``stall`` maps read-beat indices to extra cycles
    the reader waits before taking them. Returns (read beats compared, model, dut)."""
    dut = KVBuffer(cfg)
    model = KVModel(cfg, dut.word_bytes)
    plan = []                          # (op, args, expected pos, expected (ovf, rng))
    expected_reads = []
    for op, args in ops:
        if op == "append":
            model.append(*args)
        elif op == "read":
            expected_reads += model.read(*args)
        elif op == "rollback":
            model.rollback(*args)
        elif op == "advance":
            model.advance()
        elif op == "clear":
            model.overflow = model.range = 0
        plan.append((op, args, model.pos, (int(model.overflow), int(model.range))))
    got = []
    wgaps = iter(rng.random(100000) < wgap)
    ogaps = rng.random(len(expected_reads) + 1) < backpressure
    done = {"driver": False}

    async def driver(ctx):
        for i, (op, args, pos, err) in enumerate(plan):
            if op == "clear":
                ctx.set(dut.clear_error, 1)
                await ctx.tick()
                ctx.set(dut.clear_error, 0)
            elif op == "append":
                layer, head, k, kd, vd = args
                await stream_put(ctx, dut.cmd, {"op": KVOp.APPEND, "layer": layer, "head": head,
                                                "arg": k})
                for word in words_of(kd, dut.word_bytes) + words_of(vd, dut.word_bytes):
                    if next(wgaps):
                        await ctx.tick()
                    await stream_put(ctx, dut.wdata, word)
            elif op == "read":
                layer, head = args
                await stream_put(ctx, dut.cmd, {"op": KVOp.READ, "layer": layer, "head": head,
                                                "arg": 0})
            elif op == "rollback":
                await stream_put(ctx, dut.cmd, {"op": KVOp.ROLLBACK, "layer": 0, "head": 0,
                                                "arg": args[0]})
            else:
                await stream_put(ctx, dut.cmd, {"op": KVOp.ADVANCE, "layer": 0, "head": 0, "arg": 0})
            if check_each:
                assert ctx.get(dut.pos) == pos, f"op {i} {op}: pos"
                e = ctx.get(dut.error)
                assert (e.overflow, e.range) == err, f"op {i} {op}{args[:2]}: error flags"
        done["driver"] = True

    async def reader(ctx):
        for i in range(len(expected_reads)):
            if ogaps[i]:
                await ctx.tick()
            for _ in range((stall or {}).get(i, 0)):
                await ctx.tick()
            beat = await stream_get(ctx, dut.rdata)
            got.append(([int(b) for b in beat.data], int(beat.v), int(beat.last)))

    total_words = sum(2 * dut.words for op, *_ in plan if op == "append")
    limit = 6 * (len(plan) + len(expected_reads) + total_words) + 200 + sum((stall or {}).values())
    run_simulation(dut, driver, reader,
                   watchdog(limit, lambda: done["driver"] and len(got) == len(expected_reads)))
    assert len(got) == len(expected_reads)
    for i, (g, e) in enumerate(zip(got, expected_reads)):
        assert g == e, f"read beat {i}: got {g}, expected {e}"
    return len(expected_reads), model, dut


def random_ops(cfg, rng, n):
    """A random command sequence: appends (sometimes partial, sometimes out of range),
    reads, advances, rollbacks (to 0, to full, beyond full, anywhere) and error clears."""
    L, H, P, D = cfg.kv_layers, cfg.kv_heads, cfg.kv_positions, cfg.head_dim
    lbits, hbits = max(1, L.bit_length()), max(1, H.bit_length())
    ops = []
    for _ in range(n):
        r = rng.random()
        layer = int(rng.integers(0, L)) if rng.random() < 0.95 else int(rng.integers(0, 1 << lbits))
        head = int(rng.integers(0, H)) if rng.random() < 0.95 else int(rng.integers(0, 1 << hbits))
        if r < 0.45:
            k = D if rng.random() < 0.6 else int(rng.integers(0, D + 1))
            if rng.random() < 0.03:
                k = int(rng.integers(D + 1, 1 << 16))
            ops.append(("append", (layer, head, k, rng.integers(-128, 128, D), rng.integers(-128, 128, D))))
        elif r < 0.60:
            ops.append(("read", (layer, head)))
        elif r < 0.85:
            ops.append(("advance", ()))
        elif r < 0.95:
            ops.append(("rollback", (int(rng.choice([0, P, P - 1, P + 3, int(rng.integers(0, P + 1))])),)))
        else:
            ops.append(("clear", ()))
    return ops


@pytest.mark.parametrize("name", list(CONFIGS))
def test_random_sequences(name):
    cfg = CONFIGS[name]
    rng = np.random.default_rng(sum(map(ord, name)))
    ops = random_ops(cfg, rng, 500)
    beats, model, _ = run_ops(cfg, ops, rng)
    assert len(ops) + beats >= 1000


def fill(cfg, layer, head, rng, n=None):
    """Append positions 0 … n-1 of one (layer, head): rollback 0, then append + advance."""
    ops = [("rollback", (0,))]
    for _ in range(cfg.kv_positions if n is None else n):
        ops += [("append", (layer, head, cfg.head_dim, rng.integers(-128, 128, cfg.head_dim),
                            rng.integers(-128, 128, cfg.head_dim))), ("advance", ())]
    return ops


@pytest.mark.parametrize("name", ["tiny", "l3h3p20d32", "one-position"])
def test_capacity_and_rollback_edges(name):
    """Fill a (layer, head) to capacity; at full an append raises overflow and writes
    nothing, a read raises overflow and streams nothing; rollback to full - 1 reads every
    position; rollback to 0 reads exactly position 0 (the stale entries stay unread); the
    flag is sticky until cleared; the extreme int8 values survive the round trip."""
    cfg = ONE_POSITION if name == "one-position" else CONFIGS[name]
    P, D = cfg.kv_positions, cfg.head_dim
    rng = np.random.default_rng(5)
    layer, head = cfg.kv_layers - 1, cfg.kv_heads - 1
    ops = fill(cfg, layer, head, rng)
    ops[1] = ("append", (layer, head, D, np.full(D, -128), np.full(D, 127)))
    ops += [
        ("append", (layer, head, D, np.full(D, 55), np.full(D, -55))),   # pos == P: overflow
        ("read", (layer, head)),                                         # overflow, no data
        ("advance", ()),                                                  # saturates at P
        ("rollback", (P + 100,)),                                        # saturates at P
        ("append", (layer, head, D, np.full(D, 66), np.full(D, -66))),
        ("rollback", (P - 1,)), ("read", (layer, head)),                 # all P positions
        ("clear", ()), ("read", (layer, head)),
        ("rollback", (0,)), ("read", (layer, head)),                     # position 0 only
        ("append", (layer, head, D // 2, np.full(D, 9), np.full(D, -9))),  # partial overwrite
        ("read", (layer, head)),
        ("rollback", (P,)), ("read", (layer, head)),
    ]
    beats, model, dut = run_ops(cfg, ops, rng)
    assert model.overflow == 1 and beats == 2 * dut.words * (P + P + 1 + 1)
    assert (model.k[layer, head, 0, :D // 2] == 9).all() and (model.k[layer, head, 0, D // 2:] == -128).all()


def test_append_while_read_output_stalled():
    """An APPEND issued while the previous READ's last word still waits on rdata: the
    pending word is delivered intact and the partial append merges with the entry's true
    old bytes (the merge's read must not see the stalled output register)."""
    cfg = TINY
    D = cfg.head_dim
    rng = np.random.default_rng(11)
    ops = fill(cfg, 0, 1, rng, n=6) + [
        ("rollback", (2,)), ("read", (0, 1)),
        ("append", (0, 1, 5, rng.integers(-128, 128, D), rng.integers(-128, 128, D))),
        ("advance", ()),
        ("append", (0, 1, D - 1, rng.integers(-128, 128, D), rng.integers(-128, 128, D))),
        ("rollback", (5,)), ("read", (0, 1)),
    ]
    words = cfg.head_dim // gcd(cfg.reduce, cfg.head_dim)
    first_read = 2 * 3 * words
    beats, model, _ = run_ops(cfg, ops, rng, wgap=0.0, backpressure=0.0,
                              stall={first_read - 1: 40, first_read - 2: 3})
    assert beats == first_read + 2 * 6 * words


def test_read_throughput():
    """With rdata always ready a READ streams one word per cycle, K then V, no bubbles,
    the first one READ_LATENCY cycles after the command."""
    cfg = TINY
    rng = np.random.default_rng(9)
    n = 10
    dut = KVBuffer(cfg)
    model = KVModel(cfg, dut.word_bytes)
    appends = []
    for p in range(n):
        kd, vd = rng.integers(-128, 128, cfg.head_dim), rng.integers(-128, 128, cfg.head_dim)
        model.append(1, 0, cfg.head_dim, kd, vd)
        model.advance()
        appends.append((kd, vd))
    model.rollback(n - 1)
    expected = model.read(1, 0)
    stamps, got = [], []

    async def tb(ctx):
        for kd, vd in appends:
            await stream_put(ctx, dut.cmd, {"op": KVOp.APPEND, "layer": 1, "head": 0, "arg": 16})
            for word in words_of(kd, dut.word_bytes) + words_of(vd, dut.word_bytes):
                await stream_put(ctx, dut.wdata, word)
            await stream_put(ctx, dut.cmd, {"op": KVOp.ADVANCE, "layer": 0, "head": 0, "arg": 0})
        await stream_put(ctx, dut.cmd, {"op": KVOp.ROLLBACK, "layer": 0, "head": 0, "arg": n - 1})
        await stream_put(ctx, dut.cmd, {"op": KVOp.READ, "layer": 1, "head": 0, "arg": 0})
        ctx.set(dut.rdata.ready, 1)
        cycle = 0
        while len(got) < len(expected):
            _, _, valid, beat = await ctx.tick().sample(dut.rdata.valid, dut.rdata.payload)
            cycle += 1
            if valid:
                stamps.append(cycle)
                got.append(([int(b) for b in beat.data], int(beat.v), int(beat.last)))

    run_simulation(dut, tb)
    assert got == expected
    assert stamps[-1] - stamps[0] == len(expected) - 1 == 2 * n * dut.words - 1
    assert stamps[0] == KVBuffer.READ_LATENCY          # cycles after the READ's transfer


def test_address_map_and_width():
    """The documented word width, depth and RAM style, at the tiny and u55c sizes."""
    for cfg, wb, depth, style in ((TINY, 8, 2 * 2 * 64 * 2, None),
                                  (get_preset("alveo-u55c"), 32, 12 * 12 * 1024 * 2, "ultra")):
        kv = KVBuffer(cfg)
        kv._MustUse__silence = True          # only its parameters are inspected here
        assert (kv.word_bytes, kv.words, kv.depth, kv.ram_style) == (wb, cfg.head_dim // wb, depth, style)


def test_lint_clean():
    clean, output = verilator_lint(to_verilog(KVBuffer(TINY), "kv_buffer"), "kv_buffer")
    assert clean, output
