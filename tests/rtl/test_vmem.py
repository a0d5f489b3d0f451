"""VMEM and Gearbox RTL, bit for bit against the functional model.

The VMEM reference *is* ``FunctionalEngine``: every span the RTL reads or writes is also
done by the engine's own ``_vload`` / ``_vstore`` (bytes as uint8) on its ``vmem``, so
the row stride, the bounds check (BAD_ADDRESS) and the bytes a write leaves alone are the
functional model's, not a copy of them.
"""

from __future__ import annotations

import gc
import warnings

import numpy as np
import pytest
from amaranth.hdl import UnusedElaboratable

from dfvg_hw.spec.config import VMEM_LINE_BYTES as LINE_BYTES
from dfvg_hw.spec.config import get_preset
from dfvg_hw.spec.descriptors import ErrorCode
from dfvg_hw.vmem import Gearbox, VectorMemory
from sim.functional import EngineFault, FunctionalEngine
from dfvg_hw.verilog import to_verilog
from sim.lint import verilator_lint
from sim.testbench import first_valid_after_accept, run_simulation, stream_get, stream_put, watchdog

TINY = get_preset("tiny")                                     # 4096 bytes: 256 lines
ODD = TINY.with_changes(vmem_bytes=65 * LINE_BYTES)           # bounds not at a power of two
#: VMEM lines of 32 bytes (65 of them) and of 64 (256): the 256- and 512-bit presets' lines
WIDE32 = TINY.with_changes(vmem_line_bytes=32, mem_port_bits=256, head_dim=32, vmem_bytes=65 * 32)
WIDE64 = TINY.with_changes(vmem_line_bytes=64, mem_port_bits=512, head_dim=64, vmem_bytes=256 * 64)


def row_lines(row_bytes: int, line: int = LINE_BYTES) -> int:
    return -(-row_bytes // line)


def span(line: int, rows: int, row_bytes: int) -> dict:
    return {"line": line, "rows": rows, "row_bytes": row_bytes}


def as_bytes(payload_data) -> list[int]:
    return [int(b) for b in payload_data]


class VmemModel:
    """The functional engine's VMEM, driven span by span with uint8 elements."""

    def __init__(self, cfg):
        self.engine = FunctionalEngine(cfg)
        self.line = cfg.vmem_line_bytes

    @property
    def vmem(self) -> np.ndarray:
        return self.engine.vmem

    def refuses(self, s: dict) -> bool:
        # rows = 0 never reaches VMEM (the decoder faults it); the RTL refuses it too
        if s["rows"] == 0:
            return True
        try:
            self.engine._vspan(s["line"], s["rows"], s["row_bytes"])
        except EngineFault as fault:
            assert fault.code == ErrorCode.BAD_ADDRESS
            return True
        return False

    def read(self, s: dict) -> list[tuple]:
        """The lines the reader streams: (a line's bytes, row_last, last); the rows come
        from ``_vload`` and are zero-padded to whole lines."""
        rows = self.engine._vload(s["line"], s["rows"], s["row_bytes"], np.uint8)
        L = self.line
        n = row_lines(s["row_bytes"], L)
        beats = []
        for r, row in enumerate(rows):
            padded = np.zeros(n * L, dtype=np.int64)
            padded[:len(row)] = row
            for i in range(n):
                beats.append((padded[i * L:(i + 1) * L].tolist(),
                              int(i == n - 1), int(i == n - 1 and r == len(rows) - 1)))
        return beats

    def write(self, s: dict, lines: list[list[int]]) -> None:
        """Store the span's lines with ``_vstore``: row r is lines r·n … r·n + n − 1,
        cut to ``row_bytes``."""
        n = row_lines(s["row_bytes"], self.line)
        flat = np.array(lines, dtype=np.uint8).reshape(s["rows"], n * self.line)
        self.engine._vstore(s["line"], flat[:, :s["row_bytes"]], np.uint8)


# -- driving the VMEM --------------------------------------------------------------------

async def pulse(ctx, signal):
    ctx.set(signal, 1)
    await ctx.tick()
    ctx.set(signal, 0)


async def maybe_wait(ctx, rng, p):
    """Idle 1–3 cycles with probability ``p`` (input gaps, output backpressure)."""
    if rng.random() < p:
        for _ in range(int(rng.integers(1, 4))):
            await ctx.tick()


async def read_span(ctx, dut, s):
    """Read a whole span (no backpressure); returns its beats."""
    await stream_put(ctx, dut.rd_cmd, s)
    return [await stream_get(ctx, dut.rd) for _ in range(row_lines(s["row_bytes"]) * s["rows"])]


async def expect_refusal(ctx, dut, cmd, s, quiet):
    """A refused span: ``error`` exactly CHECK_LATENCY cycles after the transfer, the port
    idle again, ``quiet`` (its data stream's valid or ready) low; then clear the error."""
    assert not ctx.get(dut.error)
    await stream_put(ctx, cmd, s)                     # returns after the transfer edge
    for _ in range(VectorMemory.CHECK_LATENCY - 1):
        assert not ctx.get(dut.error)
        await ctx.tick()
    assert ctx.get(dut.error), f"span {s} not refused"
    assert ctx.get(cmd.ready)
    for _ in range(3):
        assert not ctx.get(quiet), f"refused span {s} moved data"
        await ctx.tick()
    await pulse(ctx, dut.clear_error)
    assert not ctx.get(dut.error)


def run_steps(cfg, steps, model, rng, *, gap=0.25, stall=0.25):
    """Run ``steps`` on a VectorMemory and on ``model``.

    A step holds at most one read span and one write span, on disjoint lines, which run
    concurrently (the model's order within a step does not matter); a refused span is a
    step of its own, since both ports share ``error``. A write op is ("write", span,
    lines), a read op ("read", span). Returns the number of lines moved."""
    dut = VectorMemory(cfg)
    plan = []
    moved = 0
    for step in steps:
        entry = {"read": None, "write": None}
        for op in step:
            s = op[1]
            refused = model.refuses(s)
            if op[0] == "write":
                if not refused:
                    model.write(s, op[2])
                    moved += len(op[2])
                entry["write"] = (s, op[2], refused)
            else:
                expected = None if refused else model.read(s)
                moved += len(expected or [])
                entry["read"] = (s, expected)
        plan.append(entry)
    finished = {"read": -1, "write": -1}

    async def wait_for_step(ctx, me, other, i):
        finished[me] = i - 1
        while finished[other] < i - 1:
            await ctx.tick()

    async def writer(ctx):
        for i, entry in enumerate(plan):
            await wait_for_step(ctx, "write", "read", i)
            if entry["write"] is None:
                continue
            s, lines, refused = entry["write"]
            if refused:
                ctx.set(dut.wr.valid, 1)              # offered, and must not be taken
                await expect_refusal(ctx, dut, dut.wr_cmd, s, dut.wr.ready)
                ctx.set(dut.wr.valid, 0)
                continue
            await stream_put(ctx, dut.wr_cmd, s)
            for line in lines:
                await maybe_wait(ctx, rng, gap)
                await stream_put(ctx, dut.wr, {"data": line})
            waited = 0
            while not ctx.get(dut.wr_done):
                await ctx.tick()
                waited += 1
                assert waited < 3, f"write span {s}: no wr_done"
            assert not ctx.get(dut.error), f"write span {s}: error"
        finished["write"] = len(plan)

    async def reader(ctx):
        for i, entry in enumerate(plan):
            await wait_for_step(ctx, "read", "write", i)
            if entry["read"] is None:
                continue
            s, expected = entry["read"]
            if expected is None:
                await expect_refusal(ctx, dut, dut.rd_cmd, s, dut.rd.valid)
                continue
            await stream_put(ctx, dut.rd_cmd, s)
            for k, want in enumerate(expected):
                await maybe_wait(ctx, rng, stall)
                beat = await stream_get(ctx, dut.rd)
                got = (as_bytes(beat.data), int(beat.row_last), int(beat.last))
                assert got == want, f"read span {s}, line {k}: got {got}, expected {want}"
            assert not ctx.get(dut.error), f"read span {s}: error"
        finished["read"] = len(plan)

    limit = 8 * (moved + 10 * len(plan)) + 100
    run_simulation(dut, writer, reader,
                   watchdog(limit, lambda: min(finished.values()) >= len(plan)))
    assert min(finished.values()) >= len(plan)
    return moved


# -- random spans --------------------------------------------------------------------------

def random_lines(rng, s: dict, line: int = LINE_BYTES) -> list[list[int]]:
    return rng.integers(0, 256, (s["rows"] * row_lines(s["row_bytes"], line), line)).tolist()


def fitting_line(cfg, rows: int, row_bytes: int) -> int:
    """The highest first line a span fits at (−1 if none): its end lands on or just inside
    VMEM's end."""
    L = cfg.vmem_line_bytes
    return (cfg.vmem_bytes - row_bytes) // L - (rows - 1) * row_lines(row_bytes, L)


def random_span(cfg, rng) -> dict:
    """rows 1–4, row_bytes 1–80: mostly anywhere inside VMEM, some exactly at its end,
    some just past it, some far outside (line ≥ depth, row_bytes beyond the field)."""
    rows, row_bytes = int(rng.integers(1, 5)), int(rng.integers(1, 81))
    top = fitting_line(cfg, rows, row_bytes)
    kind = rng.random()
    if kind < 0.08:
        return span(top, rows, row_bytes)                           # ends at VMEM's end
    if kind < 0.14:
        return span(top + 1, rows, row_bytes)                       # a line too far
    if kind < 0.16:
        return span(int(rng.integers(0, 1 << 16)), rows, row_bytes)
    if kind < 0.17:
        return span(0, 1, (1 << cfg.vmem_bytes.bit_length()) - 1)   # saturated row_bytes
    if kind < 0.18:
        return span(0, 0, row_bytes)                                # rows = 0
    return span(int(rng.integers(0, top + 1)), rows, row_bytes)


def lines_of(s: dict, line: int) -> range:
    return range(s["line"], s["line"] + s["rows"] * row_lines(s["row_bytes"], line))


def random_steps(cfg, model, rng, min_lines: int) -> list[list[tuple]]:
    """Writes and reads, paired into concurrent steps when their lines are disjoint,
    until at least ``min_lines`` lines would move."""
    steps, moved, L = [], 0, cfg.vmem_line_bytes
    while moved < min_lines:
        w, r = random_span(cfg, rng), random_span(cfg, rng)
        write = ("write", w, random_lines(rng, w, L))
        read = ("read", r)
        if model.refuses(w) or model.refuses(r) or set(lines_of(w, L)) & set(lines_of(r, L)):
            steps += [[write], [read]] if rng.random() < 0.5 else [[read], [write]]
        else:
            steps.append([write, read])
        moved += sum(len(lines_of(x, L)) for x in (w, r) if not model.refuses(x))
    return steps


@pytest.mark.parametrize("cfg, min_lines", [(TINY, 2000), (ODD, 2000), (WIDE32, 800), (WIDE64, 800)],
                         ids=["tiny", "65-lines", "65-lines-of-32", "256-lines-of-64"])
def test_random_spans_match_functional_model(cfg, min_lines):
    """Random spans with random data, gaps and backpressure, reads and writes
    interleaved and concurrent, against _vload/_vstore; then the whole VMEM is read back,
    so bytes no span should have touched (past a row's end, refused spans) are checked
    too. Lines of 16 bytes, and the wider ones (row ends at every byte of a line)."""
    rng = np.random.default_rng(cfg.vmem_bytes)
    model = VmemModel(cfg)
    planning = VmemModel(cfg)                    # only to classify spans while planning
    steps = random_steps(cfg, planning, rng, min_lines)
    steps.append([("read", span(0, 1, cfg.vmem_bytes))])
    moved = run_steps(cfg, steps, model, rng)
    assert moved >= min_lines
    assert sum(1 for st in steps for op in st if model.refuses(op[1])) >= 10


@pytest.mark.parametrize("cfg", [TINY, WIDE64], ids=["tiny", "lines-of-64"])
def test_row_edges(cfg):
    """Rows ending mid-line are written with byte enables (the rest of the line keeps
    its bytes) and read back with zeros past the end; row_bytes = 0 moves nothing and
    still completes a write; a span of 255 rows and a one-byte VMEM-end row; clearing
    VMEM (soft reset) as one span of zeros."""
    L = cfg.vmem_line_bytes
    depth = cfg.vmem_bytes // L
    rng = np.random.default_rng(3)
    model = VmemModel(cfg)
    background = span(10, 1, L * 12)
    last_byte = span(depth - 1, 1, L)
    whole = span(0, 1, cfg.vmem_bytes)
    ops = [
        [("write", background, random_lines(rng, background, L))],
        [("write", last_byte, random_lines(rng, last_byte, L))],
        [("write", span(10, 3, L + 1), random_lines(rng, span(10, 3, L + 1), L))],   # 2 lines/row
        [("read", span(10, 1, L * 12))],
        [("read", span(10, 3, L + 1))],
        [("read", span(11, 2, L - 1))],
        [("write", span(12, 2, 0), [])], [("read", span(12, 2, 0))],
        [("write", span(depth, 1, 0), [])],                                 # start == end: fits
        [("write", span(0, 255, L), random_lines(rng, span(0, 255, L), L))],
        [("write", span(depth - 1, 1, 1), [[7] * L])],
        [("read", span(0, 1, cfg.vmem_bytes))],
        [("write", whole, [[0] * L] * depth)],
        [("read", whole)],
    ]
    run_steps(cfg, ops, model, rng)
    assert not model.vmem.any()


# -- timing --------------------------------------------------------------------------------

def test_read_latency():
    dut = VectorMemory(TINY)
    assert first_valid_after_accept(dut, dut.rd_cmd, dut.rd, span(3, 2, 40)) \
        == VectorMemory.READ_LATENCY == 3


def test_one_line_per_cycle():
    """Writer: wr ready CHECK_LATENCY cycles after the command, then one line per cycle
    and wr_done the cycle after the last. Reader, with rd always ready: one line per
    cycle from the first, across row boundaries."""
    cfg = TINY
    rng = np.random.default_rng(8)
    model = VmemModel(cfg)
    s = span(20, 4, 70)                                           # 4 rows of 5 lines
    lines = random_lines(rng, s)
    model.write(s, lines)
    expected = model.read(s)
    dut = VectorMemory(cfg)
    stamps = {"write": [], "done": None, "read": []}
    got = []

    async def tb(ctx):
        await stream_put(ctx, dut.wr_cmd, s)
        ctx.set(dut.wr.valid, 1)
        cycle = 1                              # cycles since the command's transfer edge
        for line in lines:
            ctx.set(dut.wr.p.data, line)
            _, _, ready = await ctx.tick().sample(dut.wr.ready)
            while not ready:
                _, _, ready = await ctx.tick().sample(dut.wr.ready)
                cycle += 1
            stamps["write"].append(cycle)
            cycle += 1
        ctx.set(dut.wr.valid, 0)
        assert ctx.get(dut.wr_done)
        await stream_put(ctx, dut.rd_cmd, s)
        ctx.set(dut.rd.ready, 1)
        cycle = 1
        while len(got) < len(expected):
            _, _, valid, beat = await ctx.tick().sample(dut.rd.valid, dut.rd.payload)
            if valid:
                stamps["read"].append(cycle)
                got.append((as_bytes(beat.data), int(beat.row_last), int(beat.last)))
            cycle += 1

    run_simulation(dut, tb)
    assert got == expected
    n = len(lines)
    assert stamps["write"] == list(range(VectorMemory.CHECK_LATENCY, VectorMemory.CHECK_LATENCY + n))
    assert stamps["read"] == list(range(VectorMemory.READ_LATENCY, VectorMemory.READ_LATENCY + n))


def test_same_line_same_cycle_reads_old_contents():
    """Read and write spans of the same lines, transferred in the same cycle with the
    write data ready: each line is read in the cycle it is written, and the read returns
    the old contents (read-first)."""
    cfg = TINY
    s = span(5, 1, 48)
    old = [[i] * 16 for i in range(3)]
    new = [[100 + i] * 16 for i in range(3)]
    dut = VectorMemory(cfg)
    got = []

    async def tb(ctx):
        await stream_put(ctx, dut.wr_cmd, s)
        for line in old:
            await stream_put(ctx, dut.wr, {"data": line})
        await ctx.tick()
        ctx.set(dut.wr_cmd.payload, s)
        ctx.set(dut.rd_cmd.payload, s)
        ctx.set(dut.wr_cmd.valid, 1)
        ctx.set(dut.rd_cmd.valid, 1)
        await ctx.tick()
        ctx.set(dut.wr_cmd.valid, 0)
        ctx.set(dut.rd_cmd.valid, 0)
        ctx.set(dut.rd.ready, 1)
        written = 0
        while len(got) < 3:                    # one cycle per iteration, both ports at once
            ctx.set(dut.wr.valid, written < 3)
            ctx.set(dut.wr.p.data, new[min(written, 2)])
            _, _, wr_ready, valid, beat = await ctx.tick().sample(dut.wr.ready, dut.rd.valid,
                                                                  dut.rd.payload)
            written += bool(wr_ready and written < 3)
            if valid:
                got.append(as_bytes(beat.data))
        ctx.set(dut.wr.valid, 0)
        ctx.set(dut.rd.ready, 0)
        got.append(as_bytes((await read_span(ctx, dut, s))[0].data))

    run_simulation(dut, tb)
    assert got[:3] == old
    assert got[3] == new[0]


def test_cancel():
    """cancel drops a write span midway (lines already written stay, the rest never
    are) and a stalled read span (rd empties); both ports take new spans afterwards."""
    cfg = TINY
    s = span(30, 1, 64)
    dut = VectorMemory(cfg)
    seen = {}

    async def tb(ctx):
        await stream_put(ctx, dut.wr_cmd, s)
        for i in range(2):
            await stream_put(ctx, dut.wr, {"data": [i + 1] * 16})
        await stream_put(ctx, dut.rd_cmd, span(30, 1, 64))
        for _ in range(4):                       # rd holds its first line, stalled
            await ctx.tick()
        assert ctx.get(dut.rd.valid)
        ctx.set(dut.wr.valid, 1)
        ctx.set(dut.wr.p.data, [9] * 16)
        ctx.set(dut.cancel, 1)
        assert not ctx.get(dut.wr.ready) and not ctx.get(dut.wr_cmd.ready)
        await ctx.tick()
        ctx.set(dut.cancel, 0)
        ctx.set(dut.wr.valid, 0)
        assert not ctx.get(dut.rd.valid)
        assert ctx.get(dut.rd_cmd.ready) and ctx.get(dut.wr_cmd.ready)
        assert not ctx.get(dut.wr_done) and not ctx.get(dut.error)
        seen["lines"] = [as_bytes(b.data) for b in await read_span(ctx, dut, s)]

    run_simulation(dut, tb)
    assert seen["lines"] == [[1] * 16, [2] * 16, [0] * 16, [0] * 16]


# -- Gearbox ---------------------------------------------------------------------------------

RATIOS = [1, 2, 4, 8, 16, 32]


def gearbox_model(in_bytes, out_bytes, beats):
    """Output beats (data, last) for input beats (data, last)."""
    out = []
    if in_bytes >= out_bytes:
        k = in_bytes // out_bytes
        for data, last in beats:
            out += [(data[j * out_bytes:(j + 1) * out_bytes], int(last and j == k - 1))
                    for j in range(k)]
    else:
        acc = []
        for data, last in beats:
            acc += data
            if last or len(acc) == out_bytes:
                out.append((acc + [0] * (out_bytes - len(acc)), int(last)))
                acc = []
    return out


def random_rows(rng, in_bytes, out_bytes, n_rows):
    """Input beats of ``n_rows`` rows; packing rows mostly end on a partial output beat."""
    per_out = max(1, out_bytes // in_bytes)
    beats = []
    for _ in range(n_rows):
        n = int(rng.integers(1, 2 * per_out + 2)) if per_out > 1 else int(rng.integers(1, 4))
        for i in range(n):
            beats.append((rng.integers(0, 256, in_bytes).tolist(), int(i == n - 1)))
    return beats


def run_gearbox(in_bytes, out_bytes, beats, rng, *, gap=0.0, stall=0.0):
    """Drive ``beats`` through a Gearbox, one decision per cycle (valid held until taken);
    returns the output beats and, per cycle, whether i and o transferred."""
    dut = Gearbox(in_bytes, out_bytes)
    n_out = len(gearbox_model(in_bytes, out_bytes, beats))
    got, log = [], []

    async def tb(ctx):
        i = 0
        while len(got) < n_out:
            if not ctx.get(dut.i.valid) and i < len(beats) and rng.random() >= gap:
                ctx.set(dut.i.p.data, beats[i][0])
                ctx.set(dut.i.p.last, beats[i][1])
                ctx.set(dut.i.valid, 1)
            ctx.set(dut.o.ready, int(rng.random() >= stall))
            _, _, iv, ir, ov, orr, op = await ctx.tick().sample(
                dut.i.valid, dut.i.ready, dut.o.valid, dut.o.ready, dut.o.payload)
            log.append((bool(iv and ir), bool(ov and orr)))
            if iv and ir:
                i += 1
                ctx.set(dut.i.valid, 0)
            if ov and orr:
                got.append((as_bytes(op.data), int(op.last)))
        assert i == len(beats)

    limit = 4 * (len(beats) + n_out) + 50
    run_simulation(dut, tb, watchdog(limit, lambda: len(got) >= n_out))
    return got, log


def gearbox_widths(rng, direction, ratio):
    narrow = int(rng.choice([w for w in (1, 2, 4, 8, 16) if w * ratio <= 256]))
    return (narrow * ratio, narrow) if direction == "split" else (narrow, narrow * ratio)


@pytest.mark.parametrize("direction", ["split", "pack"])
@pytest.mark.parametrize("ratio", RATIOS)
def test_gearbox_random(direction, ratio):
    """Random rows (partial last beats when packing), input gaps and output
    backpressure: output equal to the model, beat for beat."""
    rng = np.random.default_rng(ratio * 7 + (direction == "pack"))
    in_bytes, out_bytes = gearbox_widths(rng, direction, ratio)
    beats = random_rows(rng, in_bytes, out_bytes, 12)
    got, _ = run_gearbox(in_bytes, out_bytes, beats, rng, gap=0.3, stall=0.3)
    assert got == gearbox_model(in_bytes, out_bytes, beats)


@pytest.mark.parametrize("in_bytes,out_bytes", [(16, 4), (64, 2), (16, 16), (4, 16), (2, 64),
                                                (32, 8), (64, 16), (16, 64), (64, 64)])
def test_gearbox_full_throughput(in_bytes, out_bytes):
    """Input always valid, output always ready: a split emits a beat every cycle, a pack
    takes a beat every cycle (rows with partial last beats included)."""
    rng = np.random.default_rng(in_bytes * 1000 + out_bytes)
    beats = random_rows(rng, in_bytes, out_bytes, 6)
    got, log = run_gearbox(in_bytes, out_bytes, beats, rng)
    assert got == gearbox_model(in_bytes, out_bytes, beats)
    side = 1 if in_bytes >= out_bytes else 0               # split: o moves every cycle; pack: i
    moving = [c[side] for c in log]
    first = moving.index(True)
    count = len(got) if side else len(beats)
    assert moving[first:first + count] == [True] * count


@pytest.mark.parametrize("in_bytes,out_bytes", [(16, 4), (4, 16)])
def test_gearbox_latency(in_bytes, out_bytes):
    dut = Gearbox(in_bytes, out_bytes)
    beat = {"data": list(range(in_bytes)), "last": 1}
    assert first_valid_after_accept(dut, dut.i, dut.o, beat) == Gearbox.LATENCY == 1


@pytest.mark.parametrize("bad", [(3, 16), (16, 512), (0, 1)])
def test_gearbox_rejects_widths(bad):
    with warnings.catch_warnings():
        # the refused object is garbage, and Amaranth warns about unused elaboratables
        warnings.simplefilter("ignore", UnusedElaboratable)
        with pytest.raises(ValueError, match="power of two"):
            Gearbox(*bad)
        gc.collect()


# -- lint ------------------------------------------------------------------------------------

LINT_TARGETS = {
    "vmem": lambda: VectorMemory(TINY),
    "vmem_odd": lambda: VectorMemory(ODD),
    "vmem_64": lambda: VectorMemory(WIDE64),
    "gearbox_split": lambda: Gearbox(16, 4),
    "gearbox_pack": lambda: Gearbox(4, 16),
    "gearbox_same": lambda: Gearbox(16, 16),
}


@pytest.mark.parametrize("name", list(LINT_TARGETS))
def test_lint_clean(name):
    """verilator --lint-only -Wall with sim.lint's waivers only (none added here)."""
    clean, output = verilator_lint(to_verilog(LINT_TARGETS[name](), name), name)
    assert clean, output
