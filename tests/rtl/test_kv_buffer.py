"""KV buffer RTL against a numpy model of the functional engine's ``kv_k`` / ``kv_v``.

The model is ``FunctionalEngine``'s KV semantics (sim/functional.py, docs/isa.md §1.4,
§3.6–3.7): KVAPPEND writes ``kv[slot, POS, :k]``; ATTN reads positions ``0 … POS``;
``POS ≥ kv_positions`` is an overflow and ``slot ≥ kv_slots`` a range error, either of
which writes nothing; rollback is just setting POS (the request's start_pos). A tree
row's read adds its path entries after the positions (§9.2), and a COPY is one entry of
a request's compaction (``FunctionalEngine._compact``, §9.3). K and V are read on
channels of their own, which run at the same time.
"""

from __future__ import annotations

from math import gcd

import numpy as np
import pytest
from amaranth import Module, Signal
from amaranth.lib import wiring
from amaranth.lib.memory import Memory

from dfvg_hw.spec.config import get_preset
from dfvg_hw.bank_memory import BankMemory
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
    # 12-bit elements (a wider KV cache, numerics.kv_entry): the merge, rows and contents
    "b4kv12": TINY.with_changes(kv_slots=3, kv_positions=12, kv_banks=4, kv_bits=12),
}
ONE_POSITION = TINY.with_changes(kv_slots=1, kv_positions=1)
#: bank memories split into a "URAM" and a "BRAM" part (BankMemory), with a small URAM
#: depth so that a tiny buffer splits as alveo-u55c's 9 216-word bank memories do: (config,
#: uram_depth)
SPLIT = {
    # one bank, 140 words (4 an entry): 128 + 12, the seam between slot 4's positions 3
    # and 4
    "s5p7r4-split": (CONFIGS["s5p7r4"], 128),
    # 4 banks, 3 slots × 6 groups = 18 rows: 16 + 2, the seam between slot 2's
    # positions 12 … 15 and 16 … 19
    "s3p24b4-split": (TINY.with_changes(kv_slots=3, kv_positions=24, kv_banks=4), 16),
}


def make_buffer(cfg, uram_depth=None):
    """A KVBuffer; with ``uram_depth`` its memories are "ultra" and split at that depth."""
    return KVBuffer(cfg) if uram_depth is None else \
        KVBuffer(cfg, ram_style="ultra", uram_depth=uram_depth)


class KVModel:
    """Reference: the functional model's KV arrays, POS register and error flags."""

    def __init__(self, cfg, word_elements):
        self.cfg, self.wb, self.banks = cfg, word_elements, cfg.kv_banks
        shape = (cfg.kv_slots, cfg.kv_positions, cfg.head_dim)
        self.k, self.v = np.zeros(shape, np.int64), np.zeros(shape, np.int64)
        self.pos = 0
        self.overflow = self.range = 0
        self.rows_read = 0          # K and V entries the reads stream

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

    def read(self, side, slot, path=()):
        """The beats (data, last) of a read of K (``side`` 0) or V (1), or [] for a read
        in error; ``path``: the positions of the path entries that follow positions
        ``0 … pos``."""
        if not self._check(slot, path=path):
            return []
        t, B = self.pos + 1, self.banks
        arr = (self.k, self.v)[side]
        self.rows_read += t + len(path)
        if B == 1:
            words = np.concatenate([arr[slot, :t], arr[slot, list(path)]]).reshape(-1, self.wb)
            beats = [(w.tolist(), 0) for w in words]
        else:
            beats = []
            for g in range(-(-t // B)):         # a beat: positions g·B … g·B + B − 1
                keep = [g * B + b < t for b in range(B)]
                rows = [arr[slot, g * B + b].tolist() if keep[b] else None for b in range(B)]
                beats.append((rows, sum(kb << b for b, kb in enumerate(keep)), 0))
            # a path entry: a beat of its own, the entry in row 0
            beats += [([arr[slot, p].tolist()] + [None] * (B - 1), 1, 0) for p in path]
        return beats[:-1] + [beats[-1][:-1] + (1,)]


def beat_of(dut, beat):
    """A read beat as KVModel.read gives it (banked: the rows not kept are None)."""
    if dut.banks == 1:
        return ([int(b) for b in beat.data], int(beat.last))
    keep = int(beat.keep)
    rows = [[int(x) for x in beat.rows[b]] if keep >> b & 1 else None for b in range(dut.banks)]
    return (rows, keep, int(beat.last))


def elements(rng, cfg, n):
    """``n`` random KV elements of ``cfg.kv_bits``, the extremes among them."""
    half = 1 << (cfg.kv_bits - 1)
    values = rng.integers(-half, half, n)
    values[rng.random(n) < 0.1] = -half
    values[rng.random(n) < 0.1] = half - 1
    return values


def words_of(entry, wb):
    return [[int(b) for b in entry[i:i + wb]] for i in range(0, len(entry), wb)]


class PathTable(wiring.Component):
    """Test adapter: a KVBuffer whose channels' ``*_path_pos`` answer their
    ``*_path_index`` from tables, as the controller's ancestor registers do: the K
    channel's read number ``i`` (counted as the channel takes them) reads ``paths[0][i]``,
    the V channel's ``paths[1][i]``. Every other member is the buffer's."""

    def __init__(self, buffer: KVBuffer, paths: tuple[list, list]):
        self.buffer, self.paths = buffer, paths
        members = dict(buffer.signature.members)
        for side in "kv":
            del members[f"{side}_path_index"], members[f"{side}_path_pos"]
        super().__init__(wiring.Signature(members))
        self.banks, self.words, self.word_elements = buffer.banks, buffer.words, buffer.word_elements

    def elaborate(self, platform):
        m = Module()
        kv = m.submodules.buffer = self.buffer
        for name, member in self.signature.members.items():
            inner, outer = getattr(kv, name), getattr(self, name)
            if member.is_port:
                m.d.comb += (outer.eq(inner) if member.flow == wiring.Out else inner.eq(outer))
            else:
                wiring.connect(m, wiring.flipped(outer), inner)
        for side, paths in zip("kv", self.paths):
            flat = [p for path in paths for p in (list(path) + [0] * PATH_ENTRIES)[:PATH_ENTRIES]]
            table = m.submodules[f"{side}_table"] = Memory(shape=16, depth=max(len(flat), 1),
                                                           init=flat)
            port = table.read_port(domain="comb")
            reads = Signal(range(len(paths) + 2), name=f"{side}_reads")
            request = getattr(kv, f"{side}_read")
            with m.If(request.valid & request.ready):
                m.d.sync += reads.eq(reads + 1)
            m.d.comb += [port.addr.eq((reads - 1) * PATH_ENTRIES + getattr(kv, f"{side}_path_index")),
                         getattr(kv, f"{side}_path_pos").eq(port.data)]
        return m


def run_ops(cfg, ops, rng, *, wgap=0.2, backpressure=0.3, check_each=True, stall=None,
            uram_depth=None):
    """Drive ``ops`` into a KVBuffer and the model; compare every beat of both read
    channels and, after every command, ``pos`` and ``error``, and at the end the stored K
    and V (:meth:`KVBuffer.contents`, as co-simulation reads them) with the model's;
    ``stall`` maps beat indices (of either channel) to extra cycles its reader waits
    before taking them; ``uram_depth``: split bank memories (:func:`make_buffer`). A ``read``
    (``(slot,)`` or ``(slot, path)``) requests K then V of the slot; a ``cross`` (``(k_slot,
    k_path, v_slot, v_path)``) K of one slot and V of another. Requests go out as soon as
    their channel takes them, so a read's V streams beside the next read's K. With a path
    anywhere the buffer runs in a :class:`PathTable`. Returns (beats compared, model,
    dut)."""
    requests = []                      # (side, slot, path) in the order they are issued
    for op, args in ops:
        if op == "read":
            path = args[1] if len(args) > 1 else ()
            requests += [(0, args[0], path), (1, args[0], path)]
        elif op == "cross":
            requests += [(0, args[0], args[1]), (1, args[2], args[3])]
    paths = tuple([path for side, _, path in requests if side == s] for s in (0, 1))
    buffer = make_buffer(cfg, uram_depth)
    dut = buffer if not any(p for _, _, p in requests) else PathTable(buffer, paths)
    model = KVModel(cfg, dut.word_elements)
    plan = []                          # (op, args, expected pos, expected (ovf, rng))
    expected = ([], [])                # each channel's beats
    for op, args in ops:
        if op == "append":
            model.append(*args)
        elif op == "read":
            for side in (0, 1):
                expected[side].extend(model.read(side, *args))
        elif op == "cross":
            expected[0].extend(model.read(0, args[0], args[1]))
            expected[1].extend(model.read(1, args[2], args[3]))
        elif op == "copy":
            model.copy(*args)
        elif op == "rollback":
            model.rollback(*args)
        elif op == "advance":
            model.advance()
        elif op == "clear":
            model.overflow = model.range = 0
        plan.append((op, args, model.pos, (int(model.overflow), int(model.range))))
    got = ([], [])
    wgaps = iter(rng.random(100000) < wgap)
    ogaps = [rng.random(len(e) + 1) < backpressure for e in expected]
    done = {"driver": False}
    channels = ((dut.k_read, dut.k_data), (dut.v_read, dut.v_data))

    async def driver(ctx):
        for i, (op, args, pos, err) in enumerate(plan):
            if op == "clear":
                ctx.set(dut.clear_error, 1)
                await ctx.tick()
                ctx.set(dut.clear_error, 0)
            elif op == "append":
                slot, k, kd, vd = args
                await stream_put(ctx, dut.cmd, {"op": KVOp.APPEND, "slot": slot, "arg": k})
                for word in words_of(kd, dut.word_elements) + words_of(vd, dut.word_elements):
                    if next(wgaps):
                        await ctx.tick()
                    await stream_put(ctx, dut.wdata, word)
            elif op in ("read", "cross"):
                path = args[1] if len(args) > 1 else ()
                sides = [(args[0], path), (args[0], path)] if op == "read" else \
                    [(args[0], args[1]), (args[2], args[3])]
                for (request, _), (slot, path) in zip(channels, sides):
                    await stream_put(ctx, request, {"slot": slot, "paths": len(path)})
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
        # the last command's trailing write: an APPEND's or a COPY's, once it is done
        while ctx.get(dut.busy):
            await ctx.tick()
        await ctx.tick().repeat(2)
        stored = buffer.contents(lambda mem, i: ctx.get(mem.data[i]))
        for side, arr in enumerate((model.k, model.v)):
            np.testing.assert_array_equal(stored[side], arr, err_msg=f"stored {'KV'[side]}")
        done["driver"] = True

    def reader(side):
        async def process(ctx):
            for i in range(len(expected[side])):
                if ogaps[side][i]:
                    await ctx.tick()
                for _ in range((stall or {}).get(i, 0)):
                    await ctx.tick()
                beat = await stream_get(ctx, channels[side][1])
                got[side].append(beat_of(dut, beat))
        return process

    total_words = sum(2 * dut.words for op, *_ in plan if op in ("append", "copy"))
    beats = len(expected[0]) + len(expected[1])
    limit = 6 * (len(plan) + beats + total_words) + 200 + 2 * sum((stall or {}).values())
    run_simulation(dut, driver, reader(0), reader(1),
                   watchdog(limit, lambda: done["driver"] and
                            all(len(g) == len(e) for g, e in zip(got, expected))))
    for side in (0, 1):
        assert len(got[side]) == len(expected[side]), "KV"[side]
        for i, (g, e) in enumerate(zip(got[side], expected[side])):
            assert g == e, f"{'KV'[side]} beat {i}: got {g}, expected {e}"
    return beats, model, dut


def random_ops(cfg, rng, n):
    """A random command sequence: appends (sometimes partial, sometimes out of range),
    reads (K and V of one slot, or K of one and V of another at once), advances,
    rollbacks (to 0, to full, beyond full, anywhere) and error clears."""
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
            ops.append(("append", (slot, k, elements(rng, cfg, D), elements(rng, cfg, D))))
        elif r < 0.54:
            ops.append(("read", (slot,)))
        elif r < 0.60:
            ops.append(("cross", (slot, (), int(rng.integers(0, S)), ())))
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
            path = tuple(int(p) for p in rng.integers(0, P, length))
            if rng.random() < 0.3:          # K of this path beside V of another slot's
                other = tuple(int(p) for p in rng.integers(0, P, int(rng.integers(0, 4))))
                ops.append(("cross", (slot, path, int(rng.integers(0, S)), other)))
            else:
                ops.append(("read", (slot, path)))
        elif r < 0.45:
            source = int(rng.integers(0, P)) if rng.random() < 0.95 else int(rng.integers(P, 1 << 16))
            if rng.random() < 0.5:          # a destination inside the buffer (pos is often full)
                ops.append(("rollback", (int(rng.integers(0, P)),)))
            ops.append(("copy", (slot, source)))
    return ops


@pytest.mark.parametrize("name", ["tiny", "s9p20d32", "b2", "s3p13b4", "s2p16b8d32", "b4kv12"])
def test_path_reads_and_copies(name):
    """Random sequences of appends, reads with and without a path, copies, rollbacks and
    error clears against the model: a path entry streams as ``words`` words (banked: one
    beat, row 0, keep 1) after the positions of each section; a copy moves the whole
    entry (stale bytes past a partial append's k too) between any two banks."""
    cfg = CONFIGS[name]
    rng = np.random.default_rng(40 + sum(map(ord, name)))
    ops = fill(cfg, 0, rng) + tree_ops(cfg, rng, 300 if cfg.kv_banks == 1 else 360)
    beats, model, _ = run_ops(cfg, ops, rng)
    reads = [op for op in ops if op[0] in ("read", "cross") and len(op[1]) > 1 and op[1][1]]
    copies = [op for op in ops if op[0] == "copy"]
    assert len(reads) >= 40 and len(copies) >= 30 and model.rows_read >= 500, model.rows_read


def fill(cfg, slot, rng, n=None):
    """Append positions 0 … n-1 of one slot: rollback 0, then append + advance."""
    ops = [("rollback", (0,))]
    for _ in range(cfg.kv_positions if n is None else n):
        ops += [("append", (slot, cfg.head_dim, elements(rng, cfg, cfg.head_dim),
                     elements(rng, cfg, cfg.head_dim))), ("advance", ())]
    return ops


def read_beats(dut, t):
    """Beats of one channel's read over positions 0 … t − 1."""
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
    """An APPEND issued while the previous read's last beats still wait on k_data and
    v_data: the pending beats are delivered intact and the partial append merges with the
    entry's true old bytes (the merge's read must not see the stalled output registers)."""
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
    first_read = read_beats(probe, 3)
    beats, model, dut = run_ops(cfg, ops, rng, wgap=0.0, backpressure=0.0,
                                stall={first_read - 1: 40, first_read - 2: 3})
    assert beats == 2 * first_read + 2 * read_beats(dut, 6)


def throughput(dut, cfg, n, rng, slot=1):
    """Append ``n`` positions of ``slot``, then a K read and at once a V read over them,
    both outputs always ready: (expected K and V beats, got K and V beats, the cycle each
    beat was valid, counted from the K request's transfer)."""
    model = KVModel(cfg, dut.word_elements)
    appends = []
    for p in range(n):
        kd, vd = rng.integers(-128, 128, cfg.head_dim), rng.integers(-128, 128, cfg.head_dim)
        model.append(slot, cfg.head_dim, kd, vd)
        model.advance()
        appends.append((kd, vd))
    model.rollback(n - 1)
    expected = (model.read(0, slot), model.read(1, slot))
    stamps, got = ([], []), ([], [])

    async def tb(ctx):
        for kd, vd in appends:
            await stream_put(ctx, dut.cmd, {"op": KVOp.APPEND, "slot": slot, "arg": cfg.head_dim})
            for word in words_of(kd, dut.word_elements) + words_of(vd, dut.word_elements):
                await stream_put(ctx, dut.wdata, word)
            await stream_put(ctx, dut.cmd, {"op": KVOp.ADVANCE, "slot": 0, "arg": 0})
        await stream_put(ctx, dut.cmd, {"op": KVOp.ROLLBACK, "slot": 0, "arg": n - 1})
        ctx.set(dut.k_data.ready, 1)
        ctx.set(dut.v_data.ready, 1)
        await stream_put(ctx, dut.k_read, {"slot": slot, "paths": 0})
        ctx.set(dut.v_read.payload, {"slot": slot, "paths": 0})
        ctx.set(dut.v_read.valid, 1)
        cycle = 0
        while len(got[0]) < len(expected[0]) or len(got[1]) < len(expected[1]):
            _, _, v_ready, *sampled = await ctx.tick().sample(
                dut.v_read.ready, dut.k_data.valid, dut.k_data.payload, dut.v_data.valid,
                dut.v_data.payload)
            if v_ready:
                ctx.set(dut.v_read.valid, 0)
            cycle += 1
            for side in (0, 1):
                valid, beat = sampled[2 * side:2 * side + 2]
                if valid:
                    stamps[side].append(cycle)
                    got[side].append(beat_of(dut, beat))
            assert cycle < 1000

    run_simulation(dut, tb)
    return expected, got, stamps


@pytest.mark.parametrize("name", ["tiny", "b2", "s2p16b8d32"])
def test_k_and_v_reads_at_once(name):
    """With the outputs always ready a K read and the V read requested the cycle after
    stream at the same time, one beat per cycle each (a word; banked, a row from every
    bank), no bubbles, each the first READ_LATENCY cycles after its request."""
    cfg = CONFIGS[name]
    dut = KVBuffer(cfg)
    expected, got, stamps = throughput(dut, cfg, 10, np.random.default_rng(9))
    assert got == expected
    for side in (0, 1):
        assert stamps[side][-1] - stamps[side][0] == len(expected[side]) - 1 \
            == read_beats(dut, 10) - 1
    assert stamps[0][0] == KVBuffer.READ_LATENCY          # cycles after the K request
    assert stamps[1][0] == KVBuffer.READ_LATENCY + 1      # the V request, a cycle later


def test_a_serialising_mutation_is_caught(monkeypatch):
    """The overlap check can fail: a V channel that waits for the K channel's read to end
    (one read at a time, as before the channels) makes test_k_and_v_reads_at_once's
    timing fail, though every beat is right."""
    import dfvg_hw.kv_buffer as kv_module
    cfg = CONFIGS["b2"]
    old = "request.ready.eq((r_state == _ReadState.IDLE) & (state == _State.IDLE))"
    bad = mutant(kv_module, old, old[:-1] + ' & (self.k_read.ready if name == "v" else 1))'
                 ).KVBuffer(cfg)
    expected, got, stamps = throughput(bad, cfg, 10, np.random.default_rng(9))
    assert got == expected
    assert stamps[1][0] > KVBuffer.READ_LATENCY + 1


def test_address_map_and_width():
    """The documented word width, depth and RAM style, at the tiny and u55c sizes."""
    u55c = get_preset("alveo-u55c")
    for cfg, wb, depth, style in ((TINY, 8, 2 * 2 * 64 * 2, None),
                                  # one bank (the preset itself has 8)
                                  (u55c.with_changes(kv_banks=1, kv_bits=8), 32, 144 * 1024 * 2, "ultra"),
                                  # banked: a row per word, each bank 1/16 of the positions
                                  (u55c.with_changes(kv_banks=16), 64, 144 * 64, "ultra"),
                                  (CONFIGS["s3p13b4"], 16, 3 * 4, None)):
        kv = KVBuffer(cfg)
        kv._MustUse__silence = True          # only its parameters are inspected here
        assert (kv.word_elements, kv.words, kv.depth, kv.ram_style) == (wb, cfg.head_dim // wb, depth, style)
        assert kv.element_bits == cfg.kv_bits        # u55c: 12, a 768-bit row


def parts(depth, ram_style="ultra", uram_depth=BankMemory.URAM_DEPTH):
    bank = BankMemory(512, depth, ram_style=ram_style, uram_depth=uram_depth)
    bank._MustUse__silence = True
    return [(part.depth, part.attrs.get("ram_style")) for part in bank.parts]


def test_bank_memory_split():
    """A URAM bank memory splits only where it saves URAM: alveo-u55c's 16-bank buffer
    (9 216 words a bank memory) keeps 8 192 words in URAM and 1 024 in BRAM (2 URAMs deep,
    not 3); a depth that is a whole number of URAMs, a remainder over a quarter of a URAM,
    a memory under one URAM, or one not in URAM stays whole."""
    u55c = get_preset("alveo-u55c")
    for banks, expected in ((16, [(8192, "ultra"), (1024, "block")]),
                            (1, [(294912, "ultra")])):
        # (one bank streams int8 words: kv_bits 8)
        kv = KVBuffer(u55c.with_changes(kv_banks=banks, kv_bits=12 if banks > 1 else 8))
        kv._MustUse__silence = True
        assert parts(kv.depth, kv.ram_style) == expected
    assert parts(4096 + 1025) == [(5121, "ultra")]
    assert parts(2 * 4096 + 1) == [(8192, "ultra"), (1, "block")]
    assert parts(1000) == [(1000, "ultra")]
    assert parts(9216, "block") == [(9216, "block")]
    assert parts(9216, None) == [(9216, None)]
    for name, (cfg, uram_depth) in SPLIT.items():
        depth = KVBuffer(cfg).depth
        assert depth % uram_depth and len(parts(depth, uram_depth=uram_depth)) == 2, name


@pytest.mark.parametrize("name", ["tiny", "s3p13b4", *SPLIT])
def test_lint_clean(name):
    cfg, uram_depth = SPLIT[name] if name in SPLIT else (CONFIGS[name], None)
    clean, output = verilator_lint(to_verilog(make_buffer(cfg, uram_depth), "kv_buffer"),
                                   "kv_buffer")
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
    ("tiny", "path_addr = (path_pos >> bank_bits) * W + r_word",
     "path_addr = (path_pos >> bank_bits) * W + r_word + W"),
    ("b2", "r_bank.eq(path_pos[:bank_bits])", "r_bank.eq(~path_pos[:bank_bits])"),
    ("b2", "copy_bank.eq(copy_from[:bank_bits])", "copy_bank.eq(pos[:bank_bits])"),
], ids=["path-position+1", "path-bank", "copy-from-the-destination-bank"])
def test_a_path_or_copy_mutation_is_caught(monkeypatch, name, old, new):
    """The path and copy checks can fail: a path entry read one position on, or from the
    wrong bank, or a copy reading the destination's bank makes test_path_reads_and_copies
    fail."""
    import dfvg_hw.kv_buffer as kv_module
    cfg = CONFIGS[name]
    ops = fill(cfg, 0, np.random.default_rng(6)) + tree_ops(cfg, np.random.default_rng(4), 150)
    run_ops(cfg, ops, np.random.default_rng(5))                 # the original passes
    monkeypatch.setitem(globals(), "KVBuffer", mutant(kv_module, old, new).KVBuffer)
    with pytest.raises(AssertionError):
        run_ops(cfg, ops, np.random.default_rng(5))


def seam_ops(cfg, uram_depth, rng):
    """Every slot filled (so both parts of every bank memory hold data), then at each
    entry beside the seam between the parts (the entries holding words ``split − 1``
    and ``split``): a partial append, a read with the seam's entries as its path, copies
    to it from the others across the seam, and a read of the whole slot."""
    probe = make_buffer(cfg, uram_depth)
    probe._MustUse__silence = True
    W, B, PB, D = probe.words, probe.banks, probe.bank_positions, cfg.head_dim
    split = probe.depth // uram_depth * uram_depth
    seam = [(slot, pos) for slot in range(cfg.kv_slots) for pos in range(cfg.kv_positions)
            if {split - 1, split} & set(range((slot * PB + pos // B) * W,
                                              (slot * PB + pos // B + 1) * W))]
    assert {a < split for s, p in seam for a in [(s * PB + p // B) * W]} == {True, False}
    ops = [op for slot in range(cfg.kv_slots) for op in fill(cfg, slot, rng)]
    for slot, pos in seam:
        around = tuple(p for s, p in seam if s == slot)
        ops += [("rollback", (pos,)),
                ("append", (slot, int(rng.integers(1, D)), rng.integers(-128, 128, D),
                            rng.integers(-128, 128, D))),
                ("read", (slot, around))]
        for source in around:
            if source != pos:
                ops += [("rollback", (pos,)), ("copy", (slot, source))]
        ops += [("rollback", (cfg.kv_positions - 1,)), ("read", (slot, around))]
    return ops, seam


@pytest.mark.parametrize("name", list(SPLIT))
def test_split_bank_memories(name):
    """Bank memories split into a URAM and a BRAM part (BankMemory) behave as one: the
    entries at the seam written (partly), read (as positions and as path entries), copied
    across the seam both ways, then random appends, reads, path reads and copies, every
    beat and the stored K and V against the model; the read timing of a split buffer is
    the single memory's."""
    cfg, uram_depth = SPLIT[name]
    rng = np.random.default_rng(70 + sum(map(ord, name)))
    ops, seam = seam_ops(cfg, uram_depth, rng)
    ops += tree_ops(cfg, rng, 200)
    beats, model, _ = run_ops(cfg, ops, rng, uram_depth=uram_depth)
    assert len(seam) >= 2 and model.rows_read >= 300, model.rows_read
    dut = make_buffer(cfg, uram_depth)
    n = cfg.kv_positions                 # a read over every position crosses the seam
    expected, got, stamps = throughput(dut, cfg, n, np.random.default_rng(9), slot=seam[0][0])
    assert got == expected
    assert stamps[0][0] == KVBuffer.READ_LATENCY and stamps[1][0] == KVBuffer.READ_LATENCY + 1
    assert stamps[0][-1] - stamps[0][0] == read_beats(dut, n) - 1


@pytest.mark.parametrize("name, old, new", [
    ("s5p7r4-split", "high_r.eq(self.r_addr >= self.split)", "high_r.eq(self.r_addr > self.split)"),
    ("s3p24b4-split", "high_w = self.w_addr >= self.split", "high_w = self.w_addr > self.split"),
    ("s3p24b4-split", "m.d.sync += high_r.eq", "m.d.comb += high_r.eq"),
], ids=["read-select-off-by-one", "write-select-off-by-one", "select-unregistered"])
def test_a_split_mutation_is_caught(monkeypatch, name, old, new):
    """The seam checks can fail: word ``split`` read from or written to the URAM part (an
    off-by-one in the part select), or the read data selected by the address of the
    current cycle instead of the registered one, makes test_split_bank_memories' seam
    sequence fail."""
    import dfvg_hw.bank_memory as bank_module
    import dfvg_hw.kv_buffer as kv_module
    cfg, uram_depth = SPLIT[name]
    ops, _ = seam_ops(cfg, uram_depth, np.random.default_rng(8))
    run_ops(cfg, ops, np.random.default_rng(5), uram_depth=uram_depth)   # the original passes
    monkeypatch.setattr(kv_module, "BankMemory",
                        mutant(bank_module, old, new, shared=()).BankMemory)
    with pytest.raises(AssertionError):
        run_ops(cfg, ops, np.random.default_rng(5), uram_depth=uram_depth)
