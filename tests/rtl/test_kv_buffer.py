"""KV buffer RTL against a numpy model of the functional engine's ``kv_k`` / ``kv_v``.

The model is ``FunctionalEngine``'s KV semantics (sim/functional.py, docs/isa.md §1.4,
§3.6–3.7): KVAPPEND writes ``kv[slot, POS, :k]``; ATTN reads positions ``0 … POS``;
``POS ≥ kv_positions`` is an overflow and ``slot ≥ kv_slots`` a range error, either of
which writes nothing; rollback is just setting POS (the request's start_pos). A tree
row's READ adds its path entries after the positions (§9.2), and a COPY is one entry of
a request's compaction (``FunctionalEngine._compact``, §9.3).
"""

from __future__ import annotations

from math import gcd

import numpy as np
import pytest
from amaranth import Module, Signal
from amaranth.lib import wiring
from amaranth.lib.memory import Memory

from dfvg_hw.spec.config import get_preset
from dfvg_hw.kv_buffer import KVBuffer, KVOp, PATH_ENTRIES
from dfvg_hw.verilog import to_verilog
from sim.lint import verilator_lint
from sim.testbench import run_simulation, stream_get, stream_put, watchdog
from sequencer_cases import mutant

TINY = get_preset("tiny")
CONFIGS = {
    "tiny": TINY,                                                    # 8-byte words, 2 per entry
    "s9p20d32": TINY.with_changes(kv_slots=9, kv_positions=20, head_dim=32,
                                  reduce=16),                        # non-power-of-two map
    "s5p7r4": TINY.with_changes(kv_slots=5, kv_positions=7, reduce=4),
    # banked: position t in bank t mod B, a READ beat is one row from every bank
    "b2": TINY.with_changes(kv_banks=2),
    "s3p13b4": TINY.with_changes(kv_slots=3, kv_positions=13, kv_banks=4),   # PB = 4: a pad row
    "s2p16b8d32": TINY.with_changes(kv_slots=2, kv_positions=16, head_dim=32, kv_banks=8),
}
ONE_POSITION = TINY.with_changes(kv_slots=1, kv_positions=1)


class KVModel:
    """Reference: the functional model's KV arrays, POS register and error flags."""

    def __init__(self, cfg, word_bytes):
        self.cfg, self.wb, self.banks = cfg, word_bytes, cfg.kv_banks
        shape = (cfg.kv_slots, cfg.kv_positions, cfg.head_dim)
        self.k, self.v = np.zeros(shape, np.int64), np.zeros(shape, np.int64)
        self.pos = 0
        self.overflow = self.range = 0
        self.rows_read = 0          # K and V entries the READs stream

    def rollback(self, n):
        self.pos = min(n, self.cfg.kv_positions)

    def advance(self):
        self.pos = min(self.pos + 1, self.cfg.kv_positions)

    def _check(self, slot, k=0, path=(), source=0):
        c = self.cfg
        ovf = self.pos >= c.kv_positions or source >= c.kv_positions
        rng = slot >= c.kv_slots or k > c.head_dim or len(path) > PATH_ENTRIES
        self.overflow |= ovf
        self.range |= rng
        return not (ovf or rng)

    def copy(self, slot, source):
        """COPY: the whole entry at ``source`` to ``pos`` (compaction)."""
        if self._check(slot, source=source):
            self.k[slot, self.pos] = self.k[slot, source]
            self.v[slot, self.pos] = self.v[slot, source]

    def append(self, slot, k, kd, vd):
        if self._check(slot, k):
            self.k[slot, self.pos, :k] = kd[:k]
            self.v[slot, self.pos, :k] = vd[:k]

    def read(self, slot, path=()):
        """The READ beats (data, v, last), or [] for a READ in error; ``path``: the
        positions of the path entries that follow positions ``0 … pos``."""
        if not self._check(slot, path=path):
            return []
        beats = []
        t, B = self.pos + 1, self.banks
        self.rows_read += 2 * (t + len(path))
        for v, arr in ((0, self.k), (1, self.v)):
            section = []
            if B == 1:
                words = np.concatenate([arr[slot, :t], arr[slot, list(path)]]).reshape(-1, self.wb)
                section = [(w.tolist(), v, 0) for w in words]
            else:
                groups = -(-t // B)             # a beat: positions g·B … g·B + B − 1
                for g in range(groups):
                    keep = [g * B + b < t for b in range(B)]
                    rows = [arr[slot, g * B + b].tolist() if keep[b] else None for b in range(B)]
                    section.append((rows, sum(kb << b for b, kb in enumerate(keep)), v, 0))
                # a path entry: a beat of its own, the entry in row 0
                section += [([arr[slot, p].tolist()] + [None] * (B - 1), 1, v, 0) for p in path]
            beats += section[:-1] + [section[-1][:-1] + (1,)]
        return beats


def beat_of(dut, beat):
    """A READ beat as KVModel.read gives it (banked: the rows not kept are None)."""
    if dut.banks == 1:
        return ([int(b) for b in beat.data], int(beat.v), int(beat.last))
    keep = int(beat.keep)
    rows = [[int(x) for x in beat.rows[b]] if keep >> b & 1 else None for b in range(dut.banks)]
    return (rows, keep, int(beat.v), int(beat.last))


def words_of(entry, wb):
    return [[int(b) for b in entry[i:i + wb]] for i in range(0, len(entry), wb)]


class PathTable(wiring.Component):
    """Test adapter: a KVBuffer whose ``path_pos`` answers ``path_index`` from a table, as
    the controller's ancestor registers do: READ number ``i`` (counted as the buffer
    takes them) reads ``paths[i]``. Every other member is the buffer's."""

    def __init__(self, buffer: KVBuffer, paths: list):
        self.buffer, self.paths = buffer, paths
        members = dict(buffer.signature.members)
        del members["path_index"], members["path_pos"]
        super().__init__(wiring.Signature(members))
        self.banks, self.words, self.word_bytes = buffer.banks, buffer.words, buffer.word_bytes

    def elaborate(self, platform):
        m = Module()
        kv = m.submodules.buffer = self.buffer
        for name, member in self.signature.members.items():
            inner, outer = getattr(kv, name), getattr(self, name)
            if member.is_port:
                m.d.comb += (outer.eq(inner) if member.flow == wiring.Out else inner.eq(outer))
            else:
                wiring.connect(m, wiring.flipped(outer), inner)
        flat = [p for path in self.paths
                for p in (list(path) + [0] * PATH_ENTRIES)[:PATH_ENTRIES]]
        table = m.submodules.table = Memory(shape=16, depth=max(len(flat), 1), init=flat)
        port = table.read_port(domain="comb")
        reads = Signal(range(len(self.paths) + 2))
        with m.If(kv.cmd.valid & kv.cmd.ready & (kv.cmd.payload.op == KVOp.READ)):
            m.d.sync += reads.eq(reads + 1)
        m.d.comb += [port.addr.eq((reads - 1) * PATH_ENTRIES + kv.path_index),
                     kv.path_pos.eq(port.data)]
        return m


def run_ops(cfg, ops, rng, *, wgap=0.2, backpressure=0.3, check_each=True, stall=None):
    """Drive ``ops`` into a KVBuffer and the model; compare every READ beat and, after
    every command, ``pos`` and ``error``; ``stall`` maps read-beat indices to extra cycles
    the reader waits before taking them. A read may carry a path (``("read", (slot,
    path))``); then the buffer runs in a :class:`PathTable`. Returns (read beats
    compared, model, dut)."""
    paths = [args[1] if len(args) > 1 else () for op, args in ops if op == "read"]
    dut = KVBuffer(cfg) if not any(paths) else PathTable(KVBuffer(cfg), paths)
    model = KVModel(cfg, dut.word_bytes)
    plan = []                          # (op, args, expected pos, expected (ovf, rng))
    expected_reads = []
    for op, args in ops:
        if op == "append":
            model.append(*args)
        elif op == "read":
            expected_reads += model.read(*args)
        elif op == "copy":
            model.copy(*args)
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
                slot, k, kd, vd = args
                await stream_put(ctx, dut.cmd, {"op": KVOp.APPEND, "slot": slot, "arg": k})
                for word in words_of(kd, dut.word_bytes) + words_of(vd, dut.word_bytes):
                    if next(wgaps):
                        await ctx.tick()
                    await stream_put(ctx, dut.wdata, word)
            elif op == "read":
                arg = len(args[1]) if len(args) > 1 else 0
                await stream_put(ctx, dut.cmd, {"op": KVOp.READ, "slot": args[0], "arg": arg})
            elif op == "copy":
                await stream_put(ctx, dut.cmd, {"op": KVOp.COPY, "slot": args[0], "arg": args[1]})
            elif op == "rollback":
                await stream_put(ctx, dut.cmd, {"op": KVOp.ROLLBACK, "slot": 0, "arg": args[0]})
            else:
                await stream_put(ctx, dut.cmd, {"op": KVOp.ADVANCE, "slot": 0, "arg": 0})
            if check_each:
                assert ctx.get(dut.pos) == pos, f"op {i} {op}: pos"
                e = ctx.get(dut.error)
                assert (e.overflow, e.range) == err, f"op {i} {op}{args[:1]}: error flags"
        done["driver"] = True

    async def reader(ctx):
        for i in range(len(expected_reads)):
            if ogaps[i]:
                await ctx.tick()
            for _ in range((stall or {}).get(i, 0)):
                await ctx.tick()
            beat = await stream_get(ctx, dut.rdata)
            got.append(beat_of(dut, beat))

    total_words = sum(2 * dut.words for op, *_ in plan if op in ("append", "copy"))
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
    S, P, D = cfg.kv_slots, cfg.kv_positions, cfg.head_dim
    sbits = S.bit_length()
    ops = []
    for _ in range(n):
        r = rng.random()
        slot = int(rng.integers(0, S)) if rng.random() < 0.95 else int(rng.integers(S, 1 << sbits))
        if r < 0.45:
            k = D if rng.random() < 0.6 else int(rng.integers(0, D + 1))
            if rng.random() < 0.03:
                k = int(rng.integers(D + 1, 1 << 16))
            ops.append(("append", (slot, k, rng.integers(-128, 128, D), rng.integers(-128, 128, D))))
        elif r < 0.60:
            ops.append(("read", (slot,)))
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
    ops = random_ops(cfg, rng, 500 if cfg.kv_banks == 1 else 800)
    beats, model, _ = run_ops(cfg, ops, rng)
    assert len(ops) + max(beats, model.rows_read) >= 1000     # words, or banked rows


def tree_ops(cfg, rng, n):
    """:func:`random_ops` with tree READs and COPYs among them: reads with a path of 1 to
    12 entries at any positions (in any bank, repeated, out of order), now and then the
    longest path (``PATH_ENTRIES``) or one too long (a range error); copies from any
    position to ``pos`` (now and then from ``kv_positions`` on: an overflow)."""
    S, P = cfg.kv_slots, cfg.kv_positions
    ops = []
    for op, args in random_ops(cfg, rng, n):
        ops.append((op, args))
        r = rng.random()
        slot = int(rng.integers(0, S)) if rng.random() < 0.95 else S
        if r < 0.25:
            length = int(rng.choice([1, 2, 3, int(rng.integers(1, 13))]))
            if rng.random() < 0.04:
                length = int(rng.choice([PATH_ENTRIES, PATH_ENTRIES + 1]))
            ops.append(("read", (slot, tuple(int(p) for p in rng.integers(0, P, length)))))
        elif r < 0.45:
            source = int(rng.integers(0, P)) if rng.random() < 0.95 else int(rng.integers(P, 1 << 16))
            ops.append(("copy", (slot, source)))
    return ops


@pytest.mark.parametrize("name", ["tiny", "s9p20d32", "b2", "s3p13b4", "s2p16b8d32"])
def test_path_reads_and_copies(name):
    """Random sequences of appends, reads with and without a path, copies, rollbacks and
    error clears against the model: a path entry streams as ``words`` words (banked: one
    beat, row 0, keep 1) after the positions of each section; a copy moves the whole
    entry (stale bytes past a partial append's k too) between any two banks."""
    cfg = CONFIGS[name]
    rng = np.random.default_rng(40 + sum(map(ord, name)))
    ops = tree_ops(cfg, rng, 300)
    beats, model, _ = run_ops(cfg, ops, rng)
    reads = [op for op in ops if op[0] == "read" and len(op[1]) > 1]
    copies = [op for op in ops if op[0] == "copy"]
    assert len(reads) >= 40 and len(copies) >= 30 and model.rows_read >= 500, model.rows_read


def fill(cfg, slot, rng, n=None):
    """Append positions 0 … n-1 of one slot: rollback 0, then append + advance."""
    ops = [("rollback", (0,))]
    for _ in range(cfg.kv_positions if n is None else n):
        ops += [("append", (slot, cfg.head_dim, rng.integers(-128, 128, cfg.head_dim),
                     rng.integers(-128, 128, cfg.head_dim))), ("advance", ())]
    return ops


def read_beats(dut, t):
    """Beats of one READ section over positions 0 … t − 1."""
    return -(-t // dut.banks) * dut.words


@pytest.mark.parametrize("name", ["tiny", "s9p20d32", "one-position", "s3p13b4"])
def test_capacity_and_rollback_edges(name):
    """Fill the last slot to capacity; at full an append raises overflow and writes
    nothing, a read raises overflow and streams nothing; rollback to full - 1 reads every
    position; rollback to 0 reads exactly position 0 (the stale entries stay unread); the
    flag is sticky until cleared; the extreme int8 values survive the round trip."""
    cfg = ONE_POSITION if name == "one-position" else CONFIGS[name]
    P, D = cfg.kv_positions, cfg.head_dim
    rng = np.random.default_rng(5)
    slot = cfg.kv_slots - 1
    ops = fill(cfg, slot, rng)
    ops[1] = ("append", (slot, D, np.full(D, -128), np.full(D, 127)))
    ops += [
        ("append", (slot, D, np.full(D, 55), np.full(D, -55))),      # pos == P: overflow
        ("read", (slot,)),                                            # overflow, no data
        ("advance", ()),                                              # saturates at P
        ("rollback", (P + 100,)),                                     # saturates at P
        ("append", (slot, D, np.full(D, 66), np.full(D, -66))),
        ("rollback", (P - 1,)), ("read", (slot,)),                    # all P positions
        ("clear", ()), ("read", (slot,)),
        ("rollback", (0,)), ("read", (slot,)),                        # position 0 only
        ("append", (slot, D // 2, np.full(D, 9), np.full(D, -9))),    # partial overwrite
        ("read", (slot,)),
        ("rollback", (P,)), ("read", (slot,)),
    ]
    beats, model, dut = run_ops(cfg, ops, rng)
    assert model.overflow == 1 and beats == 2 * (2 * read_beats(dut, P) + 2 * read_beats(dut, 1))
    assert (model.k[slot, 0, :D // 2] == 9).all() and (model.k[slot, 0, D // 2:] == -128).all()


@pytest.mark.parametrize("name", ["tiny", "s5p7r4", "s3p13b4"])
def test_slot_past_the_end(name):
    """APPEND and READ at ``slot = kv_slots`` (the first slot that does not exist) and at the
    largest slot the command can carry raise ``range`` and do nothing: no other slot is
    written (the address ``slot · kv_positions · words`` would wrap into the memory), the
    READ streams nothing, and the flag is sticky until cleared."""
    cfg = CONFIGS[name]
    S, D = cfg.kv_slots, cfg.head_dim
    rng = np.random.default_rng(15)
    top = (1 << S.bit_length()) - 1
    ops = [op for s in range(S) for op in fill(cfg, s, rng, n=3)] + [("rollback", (1,))]
    for bad in (S, top):
        ops += [("append", (bad, D, np.full(D, 77), np.full(D, -77))), ("read", (bad,)),
                ("clear", ())]
    ops += [("read", (s,)) for s in range(S)]
    beats, _, dut = run_ops(cfg, ops, rng)
    assert beats == S * 2 * read_beats(dut, 2)     # every slot's 2 positions, K and V


@pytest.mark.parametrize("name", ["tiny", "b2"])
def test_append_while_read_output_stalled(name):
    """An APPEND issued while the previous READ's last word still waits on rdata: the
    pending word is delivered intact and the partial append merges with the entry's true
    old bytes (the merge's read must not see the stalled output register)."""
    cfg = CONFIGS[name]
    D = cfg.head_dim
    rng = np.random.default_rng(11)
    ops = fill(cfg, 1, rng, n=6) + [
        ("rollback", (2,)), ("read", (1,)),
        ("append", (1, 5, rng.integers(-128, 128, D), rng.integers(-128, 128, D))),
        ("advance", ()),
        ("append", (1, D - 1, rng.integers(-128, 128, D), rng.integers(-128, 128, D))),
        ("rollback", (5,)), ("read", (1,)),
    ]
    probe = KVBuffer(cfg)
    probe._MustUse__silence = True
    first_read = 2 * read_beats(probe, 3)
    beats, model, dut = run_ops(cfg, ops, rng, wgap=0.0, backpressure=0.0,
                                stall={first_read - 1: 40, first_read - 2: 3})
    assert beats == first_read + 2 * read_beats(dut, 6)


@pytest.mark.parametrize("name", ["tiny", "b2", "s2p16b8d32"])
def test_read_throughput(name):
    """With rdata always ready a READ streams one beat per cycle (a word; banked, a row
    from every bank), K then V, no bubbles, the first one READ_LATENCY cycles after the
    command."""
    cfg = CONFIGS[name]
    rng = np.random.default_rng(9)
    n = 10
    dut = KVBuffer(cfg)
    model = KVModel(cfg, dut.word_bytes)
    appends = []
    for p in range(n):
        kd, vd = rng.integers(-128, 128, cfg.head_dim), rng.integers(-128, 128, cfg.head_dim)
        model.append(1, cfg.head_dim, kd, vd)
        model.advance()
        appends.append((kd, vd))
    model.rollback(n - 1)
    expected = model.read(1)
    stamps, got = [], []

    async def tb(ctx):
        for kd, vd in appends:
            await stream_put(ctx, dut.cmd, {"op": KVOp.APPEND, "slot": 1, "arg": cfg.head_dim})
            for word in words_of(kd, dut.word_bytes) + words_of(vd, dut.word_bytes):
                await stream_put(ctx, dut.wdata, word)
            await stream_put(ctx, dut.cmd, {"op": KVOp.ADVANCE, "slot": 0, "arg": 0})
        await stream_put(ctx, dut.cmd, {"op": KVOp.ROLLBACK, "slot": 0, "arg": n - 1})
        await stream_put(ctx, dut.cmd, {"op": KVOp.READ, "slot": 1, "arg": 0})
        ctx.set(dut.rdata.ready, 1)
        cycle = 0
        while len(got) < len(expected):
            _, _, valid, beat = await ctx.tick().sample(dut.rdata.valid, dut.rdata.payload)
            cycle += 1
            if valid:
                stamps.append(cycle)
                got.append(beat_of(dut, beat))

    run_simulation(dut, tb)
    assert got == expected
    assert stamps[-1] - stamps[0] == len(expected) - 1 == 2 * read_beats(dut, n) - 1
    assert stamps[0] == KVBuffer.READ_LATENCY          # cycles after the READ's transfer


def test_address_map_and_width():
    """The documented word width, depth and RAM style, at the tiny and u55c sizes."""
    u55c = get_preset("alveo-u55c")
    for cfg, wb, depth, style in ((TINY, 8, 2 * 2 * 64 * 2, None),
                                  # one bank (the preset itself has 8)
                                  (u55c.with_changes(kv_banks=1), 32, 144 * 1024 * 2, "ultra"),
                                  # banked: a row per word, each bank 1/16 of the positions
                                  (u55c.with_changes(kv_banks=16), 64, 144 * 64, "ultra"),
                                  (CONFIGS["s3p13b4"], 16, 3 * 4, None)):
        kv = KVBuffer(cfg)
        kv._MustUse__silence = True          # only its parameters are inspected here
        assert (kv.word_bytes, kv.words, kv.depth, kv.ram_style) == (wb, cfg.head_dim // wb, depth, style)


@pytest.mark.parametrize("name", ["tiny", "s3p13b4"])
def test_lint_clean(name):
    clean, output = verilator_lint(to_verilog(KVBuffer(CONFIGS[name]), "kv_buffer"), "kv_buffer")
    assert clean, output


@pytest.mark.parametrize("old, new", [
    ("m.d.sync += bank.eq(pos[:bank_bits])", "m.d.sync += bank.eq(pos[:bank_bits] + 1)"),
    ("(pos[:bank_bits] >= b for b", "(pos[:bank_bits] > b for b"),
], ids=["append-bank+1", "keep-off-by-one"])
def test_a_banking_mutation_is_caught(monkeypatch, old, new):
    """The banked checks can fail: an APPEND into the neighbouring bank, or a last group
    that drops its last position, makes test_random_sequences fail."""
    import dfvg_hw.kv_buffer as kv_module
    cfg = CONFIGS["b2"]
    ops = random_ops(cfg, np.random.default_rng(2), 150)
    run_ops(cfg, ops, np.random.default_rng(3))                 # the original passes
    monkeypatch.setitem(globals(), "KVBuffer", mutant(kv_module, old, new).KVBuffer)
    with pytest.raises(AssertionError):
        run_ops(cfg, ops, np.random.default_rng(3))


@pytest.mark.parametrize("name, old, new", [
    ("tiny", "path_addr = (self.path_pos >> bank_bits) * W + word",
     "path_addr = (self.path_pos >> bank_bits) * W + word + W"),
    ("b2", "r_bank.eq(self.path_pos[:bank_bits])", "r_bank.eq(~self.path_pos[:bank_bits])"),
    ("b2", "copy_bank.eq(copy_from[:bank_bits])", "copy_bank.eq(pos[:bank_bits])"),
], ids=["path-position+1", "path-bank", "copy-from-the-destination-bank"])
def test_a_path_or_copy_mutation_is_caught(monkeypatch, name, old, new):
    """The path and copy checks can fail: a path entry read one position on, or from the
    wrong bank, or a copy reading the destination's bank makes test_path_reads_and_copies
    fail."""
    import dfvg_hw.kv_buffer as kv_module
    cfg = CONFIGS[name]
    ops = tree_ops(cfg, np.random.default_rng(4), 150)
    run_ops(cfg, ops, np.random.default_rng(5))                 # the original passes
    monkeypatch.setitem(globals(), "KVBuffer", mutant(kv_module, old, new).KVBuffer)
    with pytest.raises(AssertionError):
        run_ops(cfg, ops, np.random.default_rng(5))
