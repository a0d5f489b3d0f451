"""MatmulSequencer against the functional model's MATMUL (sim/op_bench.py), bit for bit:
VMEM after every job, the logit vectors of LOGITS jobs and the error codes; and against
the cycle model (sim/cycle_model.py): every job that completes takes exactly the cycles
the model gives its instruction, less what the controller adds around the sequencer.

Geometries: ``tiny`` (one VMEM line per result row, one bus beat of requant words),
``tiny`` with 16 lanes (a RESADD row is two lines, requant words four beats), 32 lanes
× reduce 4 × 4 rows on a 256-bit bus (INT8 rows two lines, RESADD rows four, x slices
split from lines), 4 lanes × reduce 32 × 8 rows on a 256-bit bus, ``tiny`` on a 256-bit bus
(requant words in half a beat) and a slow memory (under a beat a cycle, long latency);
weight blocks on a beat, at several offsets from a 64-byte boundary (a block off the beat
is BAD_ADDRESS). Weight padding and the requant words'
reserved bits are random, so nothing may depend on them.

Tree forwards (docs/isa.md §9.2): jobs with a row ``pitch`` (rows of the source, of the
INT8 result and of the RESADD residual ``pitch`` lines apart) and LOGITS of several rows
(every row's logits, tiles tagged with their row), against the functional model's tree
forward (a job's ``tree`` entry; the logit buffer is ``logit_rows``) and the cycle
model's pitch.

BIAS (issue #17): random jobs of all four modes (INT32 too) over blocks whose requant
records hold int32 biases, at tiny (a record two beats), 16 lanes (eight beats) and on a
512-bit bus (two records a beat, batched); accumulators
and biases at their extremes, so that every mode saturates; a block whose biases end past
device memory; a timing corner where the batched record reads decide the count.

BLOCKS (issue #13): random jobs of all four modes over blocks with scale tiles (random
block multipliers, 0 and 65535 common; random bytes in the scale tiles' unused entries),
with and without BIAS, at tiny (a scale tile two beats), 32 lanes × reduce 4 on a 256-bit
bus (a run of two tiles per scale tile), reduce 32 × 8 rows, a slow memory; the timing corners again with every job block-scaled (the matrix unit
stalled while a scale tile arrives); a block whose scale tiles put its records past memory.
"""

from __future__ import annotations


import numpy as np
import pytest

from dfvg_hw.spec import numerics as nx
from dfvg_hw.spec import timing as tm
from dfvg_hw.spec.config import VMEM_LINE_BYTES, get_preset
from dfvg_hw.spec.descriptors import ErrorCode
from dfvg_hw.spec.image import (pack_requant_records, padded, requant_record_bytes,
                                tile_weights, weight_area_bytes)
from dfvg_hw.spec.isa import Flag, Instruction, MatmulMode, Op, output_element_bytes
from dfvg_hw.matmul_sequencer import MatmulSequencer
from sim.cycle_model import CycleModel, TreeTiming
from sim.memory import DeviceMemory
from sim.op_bench import compare_with_reference, run_jobs
from sim.tree_state import TreeState
from dfvg_hw.verilog import to_verilog
from sim.lint import verilator_lint
from sequencer_cases import mutant, wide_line

TINY = get_preset("tiny")
L = VMEM_LINE_BYTES
INT8, RESADD, LOGITS, INT32 = MatmulMode.INT8, MatmulMode.RESADD, MatmulMode.LOGITS, MatmulMode.INT32

#: Cycles of a unit instruction that the controller spends around its sequencer and the op
#: bench does not see (controller.py's per-unit counters): FETCH + DECODE (2), the job
#: hand-over (1) and RETIRE (1). The bench counts from the job's transfer to ``done``.
CONTROLLER_CYCLES = 2 + 1 + 1

#: (n, k) of the weight blocks the random jobs use: n and k multiples of the geometry's
#: lanes/reduce and not, one group, one K-tile
SHAPES = ((40, 40), (7, 5), (64, 24), (33, 17), (4, 8), (96, 3), (1, 70))


def _mm(mode, rows, n, k, src, dst, addr, wide=False, pitch=0, bias=False, blocks=False,
        out16=False) -> dict:
    flags = ((int(mode) << 1) | (Flag.WIDE if wide else 0) | (Flag.BIAS if bias else 0)
             | (Flag.BLOCKS if blocks else 0) | (Flag.OUT16 if out16 else 0))
    return dict(opcode=Op.MATMUL, flags=flags, rows=rows, n=n, k=k, src=src, dst=dst, addr=addr,
                pitch=pitch)


def _in_tree(job: dict) -> bool:
    """Whether ``job`` is an instruction of a tree forward: it has a row pitch, or it is a
    LOGITS of several rows (the controller hands neither over in a chain forward)."""
    return bool(job["pitch"]) or ((job["flags"] >> 1) & 3 == LOGITS and job["rows"] > 1)


def _random_biases(rng, count: int) -> np.ndarray:
    """int32 biases of a random magnitude each (a 1-bit one to a full-range one), one in
    eight an edge: ±(2^31 − 1), −2^31 or 0."""
    biases = rng.integers(-(1 << 31), 1 << 31, count) >> rng.integers(0, 32, count)
    edges = rng.choice(np.array([(1 << 31) - 1, -(1 << 31) + 1, -(1 << 31), 0]), count)
    return np.where(rng.random(count) < 1 / 8, edges, biases)


def _random_scales(rng, n: int, k_tiles: int) -> np.ndarray:
    """Block multipliers ``[n, k_tiles]``: random u16, one in eight 0 and one in eight 65535."""
    m = rng.integers(0, 1 << 16, (n, k_tiles))
    edge = rng.random(m.shape)
    return np.where(edge < 1 / 8, 0, np.where(edge > 7 / 8, (1 << 16) - 1, m))


def _write_block(rng, memory: DeviceMemory, config, addr: int, n: int, k: int,
                 bias: bool = False, blocks: bool = False) -> int:
    """A weight block for ``n × k`` at ``addr`` with random weights, random bytes in the
    tile padding, and requant words with random ``mult``, a ``shift`` from 10 to 36 (some
    outputs saturate, some do not) and random reserved bits; with ``bias``, each group's
    record also holds random biases (:func:`_random_biases`, the padding channels' too);
    with ``blocks``, scale tiles of :func:`_random_scales` (random bytes in their unused
    entries). Returns its size."""
    lanes, reduce = config.lanes, config.reduce
    npad, k_tiles = padded(n, lanes), padded(k, reduce) // reduce
    scales = _random_scales(rng, n, k_tiles) if blocks else None
    tiles = tile_weights(rng.integers(-128, 128, (n, k)).astype(np.int8), lanes, reduce, scales)
    real = tile_weights(np.ones((n, k), np.int8), lanes, reduce,
                        np.full((n, k_tiles), 0x0101) if blocks else None) != 0
    tiles = np.where(real, tiles, rng.integers(-128, 128, tiles.size).astype(np.int8))
    mult, shift = rng.integers(0, 1 << 16, npad), rng.integers(10, 37, npad)
    # the reserved bits 22–31 above the 6-bit shift (pack_qparams shifts it into place)
    shift |= rng.integers(0, 1 << 10, npad) << 6
    records = pack_requant_records(mult, shift, _random_biases(rng, npad) if bias else None,
                                   npad, lanes)
    memory.write(addr, tiles.tobytes() + records)
    assert tiles.size == weight_area_bytes(n, k, lanes, reduce, blocks)
    return tiles.size + len(records)


def _blocks(rng, config, shapes=SHAPES, offsets=(0,), bias=False, blocks=False, data_width=128):
    """Device memory with one block per shape (each with biases if ``bias``, scale tiles
    if ``blocks``), block ``i`` ``offsets[i % len(offsets)]`` bytes past a 64-byte
    boundary, a multiple of the ``data_width``-bit beat (a block off the beat is
    BAD_ADDRESS, which test_blocks_off_the_beat_are_bad_address holds the sequencer to);
    returns the memory and ``{(n, k): addr}``."""
    memory = DeviceMemory(config.mem_bytes)
    addrs, addr = {}, 0x1000
    assert all(offset % (data_width // 8) == 0 for offset in offsets)
    for i, (n, k) in enumerate(shapes):
        at = addr + offsets[i % len(offsets)]
        addrs[(n, k)] = at
        addr = padded(at + _write_block(rng, memory, config, at, n, k, bias, blocks), 64)
    return memory, addrs


def _lines(nbytes: int, line: int = L) -> int:
    return -(-nbytes // line)


def _out_bytes(mode, out16=False) -> int:
    """Bytes of an output element in VMEM (LOGITS: none)."""
    return 0 if mode == LOGITS else output_element_bytes(mode, out16)


def _random_job(rng, config, addrs, bias=False, blocks=False, out16_share=0.0) -> dict:
    """A random MATMUL over one of the blocks (with ``BIAS`` if ``bias``: the blocks'
    records hold biases): any mode, wide or not, 1 … rows rows (LOGITS: 1), source and
    destination apart, somewhere in VMEM; ``OUT16`` on a share of them (any mode: the
    others ignore it)."""
    (n, k), addr = list(addrs.items())[int(rng.integers(len(addrs)))]
    mode = MatmulMode(int(rng.integers(4)))
    wide = bool(rng.integers(2))
    rows = 1 if mode == LOGITS else int(rng.integers(1, config.rows + 1))
    out16 = bool(out16_share) and rng.random() < out16_share     # (no draw without: seeds keep their jobs)
    line = config.vmem_line_bytes
    lines = config.vmem_bytes // line
    src_lines = rows * _lines(k * (2 if wide else 1), line)
    dst_lines = rows * _lines(n * _out_bytes(mode, out16), line)
    while True:
        src = int(rng.integers(0, lines - src_lines + 1))
        dst = int(rng.integers(0, lines - dst_lines + 1))
        if dst + dst_lines <= src or src + src_lines <= dst:
            return _mm(mode, rows, n, k, src, dst, addr, wide, bias=bias, blocks=blocks, out16=out16)


def model_cycles(config, data_width: int, job: dict) -> int:
    """The cycle model's count for a MATMUL job on the op bench: the instruction's cycles
    at the job's device address (the bench has no image base) on a ``data_width``-bit
    port, less :data:`CONTROLLER_CYCLES`."""
    model = CycleModel(config.with_changes(mem_port_bits=data_width))
    ins = Instruction(Op.MATMUL, **{name: job[name] for name in _INSTRUCTION_FIELDS})
    tree = None
    if _in_tree(job):           # (a tree forward at level 1 of a tree of the job's rows)
        tree = TreeTiming(job["rows"], 1, 0, config.vmem_line_bytes * job["pitch"], 1, False)
    return model.instruction(ins, addr=job["addr"], tree=tree)[0] - CONTROLLER_CYCLES


#: the job fields that are instruction fields
_INSTRUCTION_FIELDS = ("flags", "rows", "dst", "src", "n", "k", "addr")


def _check(rng, config, jobs, memory, data_width=128, vmem=None, sequencer_class=MatmulSequencer):
    """Run ``jobs`` on the sequencer and on the functional model from the same VMEM
    (random unless given): the same error codes, VMEM and logit buffers (every row;
    :func:`~sim.op_bench.compare_with_reference`, a job in a tree forward, :func:`_in_tree`,
    at level 1 of a tree as wide as its rows); and each job that completes takes the cycle
    model's cycles. Returns the error codes."""
    if vmem is None:
        vmem = rng.integers(0, 256, config.vmem_bytes, dtype=np.uint8)
    # the functional model's memory beat is the bench's bus (a block's alignment depends on it)
    config = config.with_changes(mem_port_bits=data_width)
    jobs = [{"pitch": 0, "opcode": Op.MATMUL} | job for job in jobs]
    jobs = [job | {"tree": TreeState(job["rows"], 0, level=1)} if _in_tree(job) else job
            for job in jobs]
    cycles = []
    errors = compare_with_reference(config, sequencer_class(config, data_width), vmem, memory,
                                    jobs, data_width=data_width, cycles=cycles)
    # every job ends with the sequencer's done: its own checks refuse a bad block before
    # a read goes out (None: the memory port refused a read and the bench cancelled)
    assert len(cycles) == len(jobs) and None not in cycles
    # (the model costs instructions that complete; a refused one stops after RANGE)
    timed = [(job, got) for job, got, error in zip(jobs, cycles, errors) if error == ErrorCode.OK]
    assert [got for _, got in timed] == [model_cycles(config, data_width, job) for job, _ in timed]
    return errors


def _check_random(seed, config, data_width=128, count=16, offsets=(0,), bias=False, blocks=False,
                  out16_share=0.0):
    """``count`` random jobs plus one wide job of every mode with all rows (a RESADD, an
    INT32 and an INT8 of more rows than a pass holds), all OK; every job with ``BIAS`` if
    ``bias``, with ``BLOCKS`` if ``blocks``, ``OUT16`` on ``out16_share`` of the random
    ones. Returns the jobs."""
    rng = np.random.default_rng(seed)
    memory, addrs = _blocks(rng, config, offsets=offsets, bias=bias, blocks=blocks, data_width=data_width)
    jobs = [_random_job(rng, config, addrs, bias, blocks, out16_share) for _ in range(count)]
    a = addrs[(33, 17)]
    flags = dict(bias=bias, blocks=blocks)
    jobs += [_mm(RESADD, config.rows, 33, 17, 0, 100, a, wide=True, **flags),
             _mm(INT8, config.rows, 33, 17, 0, 100, a, wide=True, **flags),
             _mm(LOGITS, 1, 33, 17, 20, 0, a, wide=True, **flags)]
    if bias or blocks:
        jobs.append(_mm(INT32, config.rows, 33, 17, 0, 100, a, wide=True, **flags))
    errors = _check(rng, config, jobs, memory, data_width)
    assert errors == [ErrorCode.OK] * len(jobs)
    modes = {(j["flags"] >> 1) & 3 for j in jobs}
    assert modes == {INT8, RESADD, LOGITS, INT32}
    return jobs


# -- tiny: one line per result row ------------------------------------------------------------

def test_tiny_random_jobs():
    _check_random(1, TINY, count=20)


@pytest.mark.parametrize("data_width", [128, 256])
def test_blocks_off_the_beat_are_bad_address(data_width):
    """A block's address is a multiple of the bus beat: any other is BAD_ADDRESS, as in the
    functional model, k = 0 (only records to read) too. On a 256-bit bus that includes
    blocks a whole requant record (16 bytes at tiny) off the beat, which the sequencer
    once re-cut; the last job, on the beat, still runs."""
    rng = np.random.default_rng(2)
    beat = data_width // 8
    memory, addrs = _blocks(rng, TINY, shapes=((8, 8), (40, 40)), data_width=data_width)
    a, b = addrs[(8, 8)], addrs[(40, 40)]
    jobs = [_mm(INT8, 1, 8, 8, 0, 40, a + 1), _mm(INT8, 1, 8, 8, 0, 40, a + beat - 1),
            _mm(INT8, 2, 40, 40, 0, 60, b + 8), _mm(LOGITS, 1, 8, 8, 0, 0, a + 16),
            _mm(INT8, 1, 8, 0, 0, 40, b + 16), _mm(INT8, 1, 8, 8, 0, 40, a)]
    off_beat = [ErrorCode.BAD_ADDRESS] * 3 + [ErrorCode.OK if beat == 16 else ErrorCode.BAD_ADDRESS] * 2
    assert _check(rng, TINY, jobs, memory, data_width) == off_beat + [ErrorCode.OK]


def test_errors_in_the_functional_models_order():
    """The sequencer's checks in the functional model's order. (Whether a LOGITS may have
    several rows, i.e. rows = the tree's width in a tree forward and 1 otherwise, is the
    controller's check, made before the job: the sequencer takes any rows ≤ config.rows.)"""
    rng = np.random.default_rng(3)
    memory, addrs = _blocks(rng, TINY, shapes=((40, 40), (8, 8)))
    a, small = addrs[(40, 40)], addrs[(8, 8)]
    last_line = TINY.vmem_bytes // L - 1
    end_block = TINY.mem_bytes - (8 * 8 + 4 * 8)      # an 8 × 8 block ending with memory
    _write_block(rng, memory, TINY, end_block, 8, 8)
    jobs = [
        _mm(INT8, 3, 8, 8, 0, 40, small),                          # rows > config.rows: PROGRAM
        _mm(INT8, 3, 8, 8, last_line + 5, 40, end_block + 1),      # ... before anything else
        _mm(INT8, 1, 8, 8, last_line + 5, 40, end_block + 1),      # weights past memory
        _mm(INT8, 1, 8, 8, 0, 40, end_block),                      # weights end with memory: OK
        _mm(INT8, 2, 40, 40, last_line - 3, 40, a),                # src's second row outside VMEM
        _mm(LOGITS, 2, 8, 8, last_line + 5, 0, small),             # src outside, two logit rows
        _mm(LOGITS, 2, 8, 8, 0, 0, small),                         # two rows: a tree's (OK)
        _mm(LOGITS, 1, TINY.vocab_max + 1, 8, 0, 0, small),        # n > vocab_max: PROGRAM
        _mm(RESADD, 1, 40, 40, 0, last_line - 3, a),               # int32 dst outside VMEM
        _mm(INT8, 1, 40, 40, 0, last_line - 3, a),                 # the same, int8: inside
        _mm(INT8, 2, 8, 8, 0, last_line, small, wide=True),        # two rows: outside
        _mm(LOGITS, 1, 8, 8, 0, last_line + 100, small),           # LOGITS ignores dst
        _mm(INT8, 2, 40, 40, 10, 30, a, wide=True),                # and the engine still works
    ]
    errors = _check(rng, TINY, jobs, memory)
    assert errors == [ErrorCode.PROGRAM, ErrorCode.PROGRAM, ErrorCode.BAD_ADDRESS, ErrorCode.OK,
                      ErrorCode.BAD_ADDRESS, ErrorCode.BAD_ADDRESS, ErrorCode.OK,
                      ErrorCode.PROGRAM, ErrorCode.BAD_ADDRESS, ErrorCode.OK,
                      ErrorCode.BAD_ADDRESS, ErrorCode.OK, ErrorCode.OK]


@pytest.mark.parametrize("data_width", [128, 256])
def test_empty_operands(data_width):
    """n = 0 writes nothing (LOGITS: an empty vector); k = 0 gives zero accumulators
    whatever tile and x rows the jobs before left (on a 256-bit bus its reads are one beat
    of two groups' records each)."""
    rng = np.random.default_rng(4)
    memory, addrs = _blocks(rng, TINY, shapes=((10, 16),), data_width=data_width)
    a = addrs[(10, 16)]
    last_line = TINY.vmem_bytes // L - 1
    jobs = [_mm(INT8, 2, 0, 16, 0, 40, a), _mm(LOGITS, 1, 0, 16, 0, 0, a),
            _mm(INT8, 2, 10, 0, last_line + 1, 40, a),         # an empty row just past VMEM: OK
            _mm(RESADD, 2, 10, 0, 3, 40, a),
            _mm(INT8, 2, 10, 0, 3, 50, a, wide=True), _mm(LOGITS, 1, 10, 0, 3, 0, a),
            _mm(RESADD, 2, 0, 0, 3, last_line + 2, a), _mm(INT8, 2, 10, 16, 0, 60, a),
            _mm(INT32, 1, 10, 0, 0, 70, a)]
    errors = _check(rng, TINY, jobs, memory, data_width)
    assert errors == [ErrorCode.OK] * 6 + [ErrorCode.BAD_ADDRESS, ErrorCode.OK, ErrorCode.OK]


# -- wider geometries: result rows over several lines --------------------------------------------

def test_16_lanes():
    """RESADD rows of four lines, INT8 rows of one, requant words four beats."""
    _check_random(5, TINY.with_changes(lanes=16), count=12)


def test_32_lanes_wide_bus():
    """256-bit bus, 32 lanes × reduce 4 × 4 rows: INT8 rows two lines, RESADD rows eight,
    requant words four beats;
    wide jobs of 3 and 4 rows take two passes."""
    _check_random(6, TINY.with_changes(lanes=32, reduce=4, rows=4), data_width=256, count=10)


def test_reduce_32_eight_rows():
    """256-bit bus, 4 lanes × reduce 32 × 8 rows (the Alveo presets' reduce and rows): x
    slices packed from two lines (four when wide), up to four wide rows per pass."""
    _check_random(9, TINY.with_changes(reduce=32, rows=8), data_width=256, count=6,
                  offsets=(0, 32))


@pytest.mark.parametrize("line, lanes", [(32, 16), (64, 8)])
def test_wider_lines(line, lanes):
    """VMEM lines of 32 and 64 bytes: x rows cut from the wider lines, result rows inside a
    line (INT8) and over two (INT32 and RESADD at 16 lanes, 32-byte lines), residuals
    peeked a line at a time, with BIAS; as the functional model, in the cycle model's cycles."""
    config, data_width = wide_line(line, TINY.with_changes(lanes=lanes))
    _check_random(50 + line, config, data_width=data_width, count=3, offsets=(0, 64), bias=True)


def test_tiny_wide_bus():
    """256-bit bus at 4 lanes: a group's requant words are half a beat, at either half
    (a read of the beat serves two groups)."""
    _check_random(7, TINY, data_width=256, count=8, offsets=(32, 0))


def test_slow_memory():
    """8 lanes × 4 rows on a 256-bit bus at 1 GB/s (0.31 beats a cycle) and 300 ns (30
    cycles): beats wait for the memory's bandwidth."""
    config = TINY.with_changes(lanes=8, rows=4, mem_latency_ns=300.0, mem_bandwidth_gbps=1.0)
    _check_random(10, config, data_width=256, count=8, offsets=(0, 32))


# -- BIAS: a group's record is its requant words, then its int32 biases -------------------------

def _output_values(job) -> int:
    """The output channels × rows a job computes (a wide row counts once)."""
    return job["n"] * job["rows"]


def test_bias_tiny():
    """BIAS jobs of all four modes, narrow and wide, at tiny (a group's record is two
    beats: words, then biases), blocks at four offsets from 64 bytes: at least 1000 output
    values against the functional model, every job in the cycle model's cycles."""
    jobs = _check_random(31, TINY, count=22, offsets=(0, 16, 32, 48), bias=True)
    assert {((j["flags"] >> 1) & 3, bool(j["flags"] & Flag.WIDE)) for j in jobs} == \
        {(mode, wide) for mode in MatmulMode for wide in (False, True)}
    assert sum(map(_output_values, jobs)) >= 1000


def test_bias_batched_records():
    """512-bit bus at 4 lanes: a beat holds two BIAS records (four without BIAS), read once
    per two groups (one per four without BIAS)."""
    config = TINY.with_changes(reduce=16)
    assert tm.matmul_records_per_beat(64, config.lanes, True) == 2
    _check_random(32, config, data_width=512, count=6, offsets=(0, 0, 64), bias=True)


def test_bias_tiny_wide_bus():
    """256-bit bus at 4 lanes: two records a beat without BIAS, one with it (8N = B), so a
    BIAS job reads a record per group (tiny-hbm's shape)."""
    assert [tm.matmul_records_per_beat(32, TINY.lanes, b) for b in (False, True)] == [2, 1]
    _check_random(36, TINY, data_width=256, count=4, offsets=(0, 32), bias=True)


def test_bias_16_lanes():
    """16 lanes: a BIAS record is eight beats (four of words, four of biases) and int32
    rows are four lines."""
    _check_random(33, TINY.with_changes(lanes=16), count=6, offsets=(0, 16), bias=True)


def test_bias_extremes():
    """Accumulators at the ends of their range (all weights and inputs extreme) with
    biases ±(2^31 − 1), −2^31 and 0 and requant parameters from saturating (mult 65535,
    shift 0) to exact (shift 32): INT8, LOGITS, RESADD and INT32 each saturate at both
    ends, and an accumulator plus a bias beyond int32 is not wrapped (mult 1, shift 1)."""
    config = TINY
    n, k = 64, 32
    c = np.arange(n)
    # channel c: bias c % 4, weight sign (c // 4) % 2, requant parameters c // 8
    biases = np.array([(1 << 31) - 1, -(1 << 31), -(1 << 31) + 1, 0])[c % 4]
    sign = np.where((c // 4) % 2, -1, 1)
    weights = np.where(sign > 0, 127, -128)[:, None] * np.ones((n, k), np.int64)
    params = np.array([(65535, 0), (1, 1), (65535, 32), (1, 0), (40000, 24), (1, 16), (3, 2),
                       (65535, 40)])[c // 8]
    mult, shift = params[:, 0], params[:, 1]
    memory = DeviceMemory(config.mem_bytes)
    memory.write(0x1000, tile_weights(weights.astype(np.int8), config.lanes, config.reduce).tobytes()
                 + pack_requant_records(mult, shift, biases, n, config.lanes))
    # VMEM lines 0–63 all 0x7F (int8 127, int16 32639, int32 0x7F7F7F7F), 64–127 all 0x80
    vmem = np.zeros(config.vmem_bytes, np.uint8)
    vmem[:64 * L], vmem[64 * L:128 * L] = 0x7F, 0x80
    jobs = [_mm(mode, 1 if mode == LOGITS else config.rows // (2 if wide else 1), n, k,
                src, src + 20 if mode == RESADD else 130, 0x1000, wide, bias=True)
            for mode in MatmulMode for wide in (False, True) for src in (0, 64)]
    jobs.append(_mm(INT32, 2, 16, k, 0, 150, 0x1000))       # without BIAS: the words alone
    rng = np.random.default_rng(34)
    assert _check(rng, config, jobs, memory, vmem=vmem) == [ErrorCode.OK] * len(jobs)
    # the inputs do reach every saturation (what the functional model, now the RTL, gives)
    outputs = {mode: [] for mode in MatmulMode}
    for x, residual in ((127, 0x7F7F7F7F), (-128, -0x7F7F7F80), (32639, 0x7F7F7F7F),
                        (-32640, -0x7F7F7F80)):
        acc = nx.add_bias(x * weights.sum(axis=1), biases)
        outputs[INT8] += list(nx.requant(acc, mult, shift, nx.ACT_BITS))
        outputs[LOGITS] += list(nx.requant(acc, mult, shift, nx.LOGIT_BITS))
        outputs[INT32] += list(nx.requant(acc, mult, shift, nx.RES_BITS))
        outputs[RESADD] += list(nx.residual_add(residual, acc, mult, shift))
        assert (np.abs(acc) >= 1 << 31).any()               # beyond int32: must not wrap
    for mode, bits in ((INT8, 8), (LOGITS, 16), (RESADD, 32), (INT32, 32)):
        assert min(outputs[mode]) == -(1 << (bits - 1)), mode
        assert max(outputs[mode]) == (1 << (bits - 1)) - 1, mode


def test_bias_records_past_memory():
    """A BIAS block is checked with its records (8 bytes a channel): one that ends with
    device memory runs, one whose biases end a byte past it is refused (BAD_ADDRESS) before
    anything moves, as the functional model does; a block that ends with memory without
    BIAS is past it with BIAS."""
    config = TINY
    rng = np.random.default_rng(35)
    memory = DeviceMemory(config.mem_bytes)
    n = k = 8
    size = n * k + n * requant_record_bytes(config.lanes, True) // config.lanes
    at_end = config.mem_bytes - size
    _write_block(rng, memory, config, at_end, n, k, bias=True)
    plain_end = config.mem_bytes - (n * k + 4 * n)
    jobs = [_mm(INT32, 1, n, k, 0, 40, at_end, bias=True),          # ends with memory: OK
            _mm(RESADD, 1, n, k, 0, 40, at_end + 1, bias=True),     # a byte past: BAD_ADDRESS
            _mm(INT8, 1, n, k, 0, 40, plain_end),                    # no BIAS, ends with memory
            _mm(LOGITS, 1, n, k, 0, 0, plain_end, bias=True),        # the same block with BIAS
            _mm(INT8, 2, n, k, 0, 40, at_end, wide=True, bias=True)]
    errors = _check(rng, config, jobs, memory)
    assert errors == [ErrorCode.OK, ErrorCode.BAD_ADDRESS, ErrorCode.OK, ErrorCode.BAD_ADDRESS,
                      ErrorCode.OK]


# -- BLOCKS: a scale tile of block multipliers before every run of reduce/2 tiles ---------------

def test_blocks_tiny():
    """BLOCKS jobs of all four modes, narrow and wide, with and without BIAS, at tiny (a
    scale tile two beats, four tiles a run), blocks at four offsets from 64 bytes: at least
    1000 output values against the functional model, every job in the cycle model's
    cycles."""
    jobs = _check_random(41, TINY, count=22, offsets=(0, 16, 32, 48), blocks=True)
    jobs += _check_random(42, TINY, count=6, offsets=(0, 16), bias=True, blocks=True)
    assert {((j["flags"] >> 1) & 3, bool(j["flags"] & Flag.WIDE)) for j in jobs} == \
        {(mode, wide) for mode in MatmulMode for wide in (False, True)}
    assert sum(map(_output_values, jobs)) >= 1000


def test_blocks_32_lanes_wide_bus():
    """256-bit bus, 32 lanes × reduce 4: a scale tile is four beats for a run of two tiles,
    int32 rows eight lines; wide jobs take two passes."""
    _check_random(43, TINY.with_changes(lanes=32, reduce=4, rows=4), data_width=256, count=5,
                  blocks=True)


def test_blocks_reduce_32():
    """256-bit bus, 4 lanes × reduce 32 × 8 rows (the Alveo presets' reduce): runs of 16
    tiles, so a k of 17 … 70 has one or two runs, the last one short."""
    _check_random(44, TINY.with_changes(reduce=32, rows=8), data_width=256, count=3,
                  offsets=(0, 32), blocks=True)


def test_blocks_slow_memory():
    """A slow memory (0.31 beats a cycle, 30 cycles of latency) at odd byte offsets."""
    config = TINY.with_changes(lanes=8, rows=4, mem_latency_ns=300.0, mem_bandwidth_gbps=1.0)
    _check_random(45, config, data_width=256, count=6, offsets=(0, 32), blocks=True)


def test_blocks_records_past_memory():
    """A BLOCKS block is checked with its scale tiles: one that ends with device memory
    runs, one a byte further is refused (BAD_ADDRESS) before anything moves, and a plain
    block that ends with memory is past it when read with BLOCKS."""
    config = TINY
    rng = np.random.default_rng(46)
    memory = DeviceMemory(config.mem_bytes)
    n = k = 8
    size = weight_area_bytes(n, k, config.lanes, config.reduce, True) + 4 * n
    at_end = config.mem_bytes - size
    _write_block(rng, memory, config, at_end, n, k, blocks=True)
    plain_end = config.mem_bytes - (n * k + 4 * n)
    jobs = [_mm(INT8, 2, n, k, 0, 40, at_end, blocks=True),          # ends with memory: OK
            _mm(RESADD, 1, n, k, 0, 40, at_end + 1, blocks=True),    # a byte past: BAD_ADDRESS
            _mm(LOGITS, 1, n, k, 0, 0, plain_end, blocks=True),      # a plain block's size
            _mm(INT32, 2, n, k, 0, 40, at_end, wide=True, blocks=True)]
    errors = _check(rng, config, jobs, memory)
    assert errors == [ErrorCode.OK, ErrorCode.BAD_ADDRESS, ErrorCode.BAD_ADDRESS, ErrorCode.OK]


def test_an_engine_without_block_multipliers():
    """``weight_blocks=False``: plain jobs of every mode compute and time as at tiny, and a
    BLOCKS job is refused with PROGRAM as the functional model refuses it, after
    ``rows > config.rows`` and before a weight block past memory, whatever its mode; the
    sequencer runs on after it."""
    config = TINY.with_changes(weight_blocks=False)
    _check_random(51, config, count=6)
    rng = np.random.default_rng(48)
    memory, addrs = _blocks(rng, config, shapes=((8, 8), (33, 17)))
    a, b = addrs[(8, 8)], addrs[(33, 17)]
    past = config.mem_bytes - 4
    jobs = [_mm(INT8, 3, 8, 8, 0, 40, a, blocks=True),              # rows > config.rows: PROGRAM
            _mm(INT8, 1, 8, 8, 0, 40, past, blocks=True),           # BLOCKS before the weights' end
            _mm(RESADD, 2, 33, 17, 0, 40, b, wide=True, blocks=True),
            _mm(LOGITS, 1, 8, 8, 0, 0, a, blocks=True, bias=True),
            _mm(INT32, 1, 33, 17, 0, 40, b),                        # and a plain job runs
            _mm(INT8, 1, 8, 8, 0, 40, past)]                        # (its weights past memory)
    errors = _check(rng, config, jobs, memory)
    assert errors == [ErrorCode.PROGRAM] * 4 + [ErrorCode.OK, ErrorCode.BAD_ADDRESS]


# -- timing corners: each term of the cycle model decides some job's count -------------------

#: Geometry (config, bus width) and jobs ``(mode, rows, n, k, weight address, wide)`` where a
#: term of the MATMUL cycle model decides the count: changing that term by one cycle
#: changes some job's count. Weight addresses are on the beat. ``far``: 100 cycles of latency, so bursts wait for the
#: burst-track FIFO, and reads split at a 4 KiB page one or two beats in. ``rows8``: eight
#: rows of 16 lanes on a 512-bit bus (requant words one beat), so write-back outlasts the
#: weights: the matrix unit waits for the bank, the packer holds a tile, and consecutive
#: RESADD rows share a residual line. ``slow``: 0.2 beats a cycle, so a requant read
#: decides when its group is written back; k = 0 too (a read per two groups' records).
#: ``fractional``: 4 lanes × reduce 16 (a tile is a beat) on a 512-bit bus at 0.6875 beats
#: a cycle (the alveo-u55c rate's shape: a fraction over 1/2) and 30 cycles of latency:
#: one beat holds four groups' requant words, read once per four groups on a beat-aligned
#: block (full and partial batches, one group and 25; RESADD of two rows, so a batch's
#: later groups wait for the word register), and with k = 0, where the reads are the
#: records alone.
#: ``fractional-bias``: the same with ``BIAS`` (a job's seventh entry): a beat holds two
#: records, so one read per two groups.
CORNERS = {
    "far": (TINY.with_changes(mem_latency_ns=1000.0), 128, [
        (LOGITS, 1, 100, 40, 0x1f70, True), (RESADD, 2, 64, 70, 0x1fb0, False),
        (RESADD, 2, 64, 0, 0x1010, True), (INT8, 2, 64, 5, 0x1f60, True),
        (RESADD, 1, 33, 70, 0x1fa0, True), (RESADD, 1, 5, 5, 0x1ff0, True)]),
    "rows8": (TINY.with_changes(lanes=16, reduce=4, rows=8, mem_bandwidth_gbps=6.4), 512, [
        (INT8, 8, 33, 8, 0x1fc0, False), (LOGITS, 1, 33, 8, 0x1000, False),
        (INT8, 6, 16, 8, 0x1000, False), (RESADD, 8, 7, 8, 0x1000, False),
        (RESADD, 5, 7, 40, 0x1000, True), (RESADD, 2, 33, 3, 0x1000, False),
        (INT8, 3, 16, 3, 0x1f80, False)]),
    "slow": (TINY.with_changes(mem_latency_ns=300.0, mem_bandwidth_gbps=0.64), 256, [
        (RESADD, 1, 16, 40, 0x1000, False), (RESADD, 2, 33, 3, 0x1fa0, False),
        (RESADD, 2, 1, 70, 0x1020, False), (RESADD, 2, 100, 0, 0x1000, False)]),
    "fractional": (TINY.with_changes(reduce=16, mem_latency_ns=300.0, mem_bandwidth_gbps=4.4),
                   512, [
        (INT8, 1, 40, 40, 0x1000, False), (LOGITS, 1, 100, 8, 0x1400, False),
        (RESADD, 2, 33, 17, 0x1000, False), (INT8, 2, 40, 5, 0x1000, True),
        (INT8, 1, 3, 8, 0x1000, False), (RESADD, 2, 40, 0, 0x1000, False)]),
    "fractional-bias": (TINY.with_changes(reduce=16, mem_latency_ns=300.0, mem_bandwidth_gbps=4.4),
                        512, [
        (INT8, 1, 100, 8, 0x1000, False, True), (RESADD, 2, 33, 17, 0x1000, False, True),
        (INT32, 2, 40, 40, 0x1000, True, True), (LOGITS, 1, 3, 8, 0x1000, False, True),
        (INT32, 2, 25, 0, 0x1040, False, True)]),
}


@pytest.mark.parametrize("name", CORNERS)
def test_timing_corners(name, blocks=False):
    """The corner jobs compute what the functional model does and take the model's
    cycles (the weights are random bytes: timing does not depend on data)."""
    config, data_width, shapes = CORNERS[name]
    rng = np.random.default_rng(11)
    memory = DeviceMemory(config.mem_bytes)
    memory.write(0x1000, rng.integers(0, 256, 0x3000, dtype=np.uint8).tobytes())
    jobs = [_mm(mode, rows, n, k, 0, 128, addr, wide, bias=bool(bias), blocks=blocks)
            for mode, rows, n, k, addr, wide, *bias in shapes]
    assert _check(rng, config, jobs, memory, data_width) == [ErrorCode.OK] * len(jobs)


@pytest.mark.parametrize("name", CORNERS)
def test_block_timing_corners(name):
    """The corners again with every job block-scaled: the scale tiles lengthen each
    group's read, and the write-back stalls meet them."""
    test_timing_corners(name, blocks=True)


# -- timing: unchanged at tiny ----------------------------------------------------------------------

#: cycles from job to done of TIMING_JOBS at tiny on a 128-bit bus, as the sequencer before
#: multi-line write-back took them (commit de4d14c), less what the weight reads and the
#: tiles now overlap with the x load (issue #14: 148, 155, 292, 148, 109, 194, 148, 40, 41
#: before); the cycle model is fitted to them
TINY_CYCLES = [136, 137, 270, 136, 95, 176, 136, 33, 33]


def _timing_jobs(addrs):
    a, b, c = addrs[(40, 40)], addrs[(7, 5)], addrs[(33, 17)]
    return [_mm(INT8, 1, 40, 40, 0, 100, a), _mm(INT8, 2, 40, 40, 0, 100, a),
            _mm(INT8, 2, 40, 40, 0, 100, a, wide=True), _mm(RESADD, 1, 40, 40, 0, 100, a),
            _mm(RESADD, 2, 33, 17, 10, 100, c), _mm(RESADD, 2, 33, 17, 10, 100, c, wide=True),
            _mm(LOGITS, 1, 40, 40, 0, 0, a), _mm(LOGITS, 1, 7, 5, 0, 0, b, wide=True),
            _mm(INT8, 1, 7, 5, 3, 7, b)]


def tiny_cycles(sequencer) -> list[int]:
    """Each timing job's cycles on ``sequencer`` (any sequencer with the MATMUL ports)."""
    rng = np.random.default_rng(8)
    memory, addrs = _blocks(rng, TINY)
    vmem = rng.integers(0, 256, TINY.vmem_bytes, dtype=np.uint8)
    cycles = []
    _, errors = run_jobs(TINY, sequencer, vmem, memory, _timing_jobs(addrs), cycles=cycles)
    assert errors == [ErrorCode.OK] * len(errors)
    return cycles


def test_tiny_timing_unchanged():
    assert tiny_cycles(MatmulSequencer(TINY, 128)) == TINY_CYCLES


def test_lint():
    ok, log = verilator_lint(to_verilog(MatmulSequencer(TINY, 128), "matmul_sequencer"),
                             "matmul_sequencer")
    assert ok, log


# -- tree forwards: rows a pitch apart, LOGITS of several rows -------------------------------------

def _operand_lines(mode, k, n, wide) -> tuple[int, int]:
    """VMEM lines of one source row and one destination row (LOGITS: none)."""
    dst = 0 if mode == LOGITS else _lines(n * (1 if mode == INT8 else 4))
    return _lines(k * (2 if wide else 1)), dst


def _random_tree_job(rng, config, addrs) -> dict:
    """A random MATMUL of a tree forward: any mode (LOGITS of any rows too), wide or not,
    1 … rows rows whose source and destination rows lie ``pitch`` lines apart (at least a
    row of either; one in five exactly the source row's lines, one in ten pitch 0), the
    two operands apart, somewhere in VMEM, one in four ending in VMEM's last line."""
    (n, k), addr = list(addrs.items())[int(rng.integers(len(addrs)))]
    mode = MatmulMode(int(rng.integers(3)))
    wide = bool(rng.integers(2))
    rows = int(rng.integers(1, config.rows + 1))
    src_lines, dst_lines = _operand_lines(mode, k, n, wide)
    pitch = max(src_lines, dst_lines, 1) + int(rng.integers(0, 4))
    if rng.random() < 0.2 and src_lines >= dst_lines:
        pitch = max(src_lines, 1)
    elif rng.random() < 0.1:
        pitch = 0
    step = pitch or None
    lines = config.vmem_bytes // L

    def span(row_lines):            # lines from an operand's first line to its end
        return (rows - 1) * (step or row_lines) + row_lines

    src_span, dst_span = span(src_lines), span(dst_lines) if dst_lines else 0
    while True:
        src = int(rng.integers(0, lines - src_span + 1))
        dst = int(rng.integers(0, lines - dst_span + 1))
        if rng.random() < 0.25:     # one of them ends in VMEM's last line
            if dst_lines and rng.integers(2):
                dst = lines - dst_span
            else:
                src = lines - src_span
        if dst + dst_span <= src or src + src_span <= dst:
            return _mm(mode, rows, n, k, src, dst, addr, wide, pitch)


def _check_tree_random(seed, config, data_width=128, count=40, offsets=(0,)):
    """``count`` random tree-forward jobs (all OK) with at least one pitched job of
    every mode and a LOGITS of several rows, plus a wide LOGITS and a wide RESADD of all
    rows at a pitch (more rows than a pass holds)."""
    rng = np.random.default_rng(seed)
    memory, addrs = _blocks(rng, config, offsets=offsets, data_width=data_width)
    jobs = [_random_tree_job(rng, config, addrs) for _ in range(count)]
    a, pitch = addrs[(33, 17)], _lines(4 * 33) + 1
    jobs += [_mm(LOGITS, config.rows, 33, 17, 3, 0, a, wide=True, pitch=pitch),
             _mm(RESADD, config.rows, 33, 17, 1, 130, a, wide=True, pitch=pitch)]
    errors = _check(rng, config, jobs, memory, data_width)
    assert errors == [ErrorCode.OK] * len(jobs)
    pitched = {(j["flags"] >> 1) & 3 for j in jobs if j["pitch"] and j["rows"] > 1}
    assert pitched == {INT8, RESADD, LOGITS}
    assert any((j["flags"] >> 1) & 3 == LOGITS and j["rows"] > 1 for j in jobs)
    return jobs


def test_tree_rows_tiny():
    _check_tree_random(21, TINY, count=80)


def test_tree_rows_16_lanes():
    """RESADD rows of four lines at a pitch: the residual's lines follow the pitch."""
    _check_tree_random(22, TINY.with_changes(lanes=16), count=40)


def test_tree_rows_32_lanes_wide_bus():
    """Four rows of 32 lanes on a 256-bit bus, weights at two offsets from 64 bytes:
    INT8 rows of two lines, RESADD rows of eight, LOGITS of up to four rows (two passes
    when wide)."""
    _check_tree_random(23, TINY.with_changes(lanes=32, reduce=4, rows=4), data_width=256,
                       count=40, offsets=(32, 0))


def test_tree_rows_reduce_32_eight_rows():
    """Eight rows at reduce 32 (the Alveo presets' rows and reduce) on a 256-bit bus."""
    _check_tree_random(24, TINY.with_changes(reduce=32, rows=8), data_width=256, count=30,
                       offsets=(0, 32))


def test_tree_rows_at_vmems_end():
    """A pitched operand whose last row ends with VMEM is inside; one line further it is
    outside (BAD_ADDRESS), for the source, the INT8 and the int32 RESADD destination, and
    whatever the rows' own stride would give; rows 1 ignore the pitch."""
    config = TINY.with_changes(lanes=16)
    rng = np.random.default_rng(25)
    memory, addrs = _blocks(rng, config, shapes=((40, 40), (7, 5)))
    a, b = addrs[(40, 40)], addrs[(7, 5)]
    last = config.vmem_bytes // L       # one past the last line
    # 40 × 40: source rows 3 lines, INT8 rows 3, RESADD rows 10; pitch 11
    jobs = [
        _mm(INT8, 2, 40, 40, last - 11 - 3, 0, a, pitch=11),         # src ends with VMEM
        _mm(INT8, 2, 40, 40, last - 11 - 2, 0, a, pitch=11),         # ... a line further
        _mm(INT8, 2, 40, 40, 0, last - 11 - 3, a, pitch=11),         # INT8 dst ends with VMEM
        _mm(INT8, 2, 40, 40, 0, last - 11 - 2, a, pitch=11),
        _mm(RESADD, 2, 40, 40, 0, last - 11 - 10, a, pitch=11),      # RESADD dst ends with VMEM
        _mm(RESADD, 2, 40, 40, 0, last - 11 - 9, a, pitch=11),
        _mm(LOGITS, 2, 40, 40, last - 11 - 3, 5, a, pitch=11),       # LOGITS' source too
        _mm(LOGITS, 2, 40, 40, last - 11 - 2, 0, a, pitch=11),
        _mm(INT8, 1, 40, 40, last - 3, last - 3, a, wide=False, pitch=40),  # rows 1: no pitch
        _mm(INT8, 2, 7, 5, last - 41, 0, b, pitch=40),               # pitch past the stride: in
        _mm(INT8, 2, 7, 5, last - 40, 0, b, pitch=40),               # ... and out
        _mm(RESADD, 2, 7, 5, 0, last - 22, b, wide=True, pitch=20),  # wide, dst at the end
        _mm(RESADD, 2, 7, 0, 0, 50, b, pitch=9),                     # k = 0: no row is loaded
        _mm(INT8, 2, 0, 5, 0, 50, b, pitch=9),                       # n = 0: nothing written
        _mm(LOGITS, 2, 0, 5, 0, 0, b, pitch=9),                      # ... two empty logit rows
    ]
    errors = _check(rng, config, jobs, memory)
    ok, outside = ErrorCode.OK, ErrorCode.BAD_ADDRESS
    assert errors == [ok, outside] * 4 + [ok, ok, outside] + [ok] * 4


def test_tree_rows_timing():
    """A pitch equal to the source rows' own stride loads them as one span (the chain's
    cycles); any other pitch as a span per row, MATMUL_ROW_SPAN more per row after the
    first (the model, which the random tests hold to the RTL, is what says so here)."""
    config = TINY.with_changes(rows=4)
    rng = np.random.default_rng(26)
    memory, addrs = _blocks(rng, config, shapes=((40, 40),))
    a = addrs[(40, 40)]
    jobs = [_mm(INT8, 4, 40, 40, 0, 100, a), _mm(INT8, 4, 40, 40, 0, 100, a, pitch=3),
            _mm(INT8, 4, 40, 40, 0, 100, a, pitch=5)]
    cycles = [model_cycles(config, 128, job) for job in jobs]
    assert cycles[0] == cycles[1] == cycles[2] - 3 * tm.MATMUL_ROW_SPAN
    assert _check(rng, config, jobs, memory) == [ErrorCode.OK] * 3


# -- the weight reads start with the row pass, ahead of the x load (issue #14) ---------------

#: Memories against which the x load races the pass's first weight beats at tiny:
#: ``quick`` (one cycle of latency, a beat a cycle: the first tiles arrive long before x is
#: in, so the packer, the aligner and the port's register fill and the memory is held
#: back with bursts in flight), ``slow`` (three cycles, 0.31 beats a cycle: the memory's
#: banked credit when the hold ends) and ``far`` (60 cycles, longer than every x load here:
#: the beats arrive after STREAM has started, as before).
EARLY_MEMORIES = {
    "quick": TINY.with_changes(mem_latency_ns=10.0),
    "slow": TINY.with_changes(mem_latency_ns=30.0, mem_bandwidth_gbps=0.5),
    "far": TINY.with_changes(mem_latency_ns=600.0),
}


@pytest.mark.parametrize("name", EARLY_MEMORIES)
def test_weight_reads_ahead_of_the_x_load(name):
    """Jobs whose x load (long and wide source rows, several passes, rows a pitch apart:
    a span per row) is far longer or shorter than the memory latency, on blocks at two
    offsets from 64 bytes, with BIAS and with BLOCKS (a scale tile taken while x loads) and
    k = 0 (only requant reads): as the functional model, in the cycle model's cycles."""
    config = EARLY_MEMORIES[name]
    rng = np.random.default_rng(60)
    memory, addrs = _blocks(rng, config, shapes=((9, 200), (33, 17), (4, 8)), offsets=(0, 16),
                            bias=True, blocks=True)
    long_, mid, small = addrs[(9, 200)], addrs[(33, 17)], addrs[(4, 8)]
    jobs = [_mm(INT8, 2, 9, 200, 0, 100, long_, wide=True, bias=True, blocks=True),
            _mm(RESADD, 2, 9, 200, 0, 100, long_, bias=True),
            _mm(LOGITS, 1, 9, 200, 0, 0, long_, wide=True, blocks=True),
            _mm(INT32, 2, 33, 17, 3, 100, mid, wide=True, pitch=12, bias=True),
            _mm(RESADD, 2, 33, 17, 3, 100, mid, pitch=9, blocks=True, bias=True),
            _mm(INT8, 2, 4, 8, 0, 100, small, bias=True),
            _mm(RESADD, 2, 9, 0, 0, 100, long_, bias=True)]
    assert _check(rng, config, jobs, memory) == [ErrorCode.OK] * len(jobs)


def test_tiles_meet_x_as_it_loads():
    """The matrix unit takes a pass's first tiles as their x entries are written, not after
    the whole x load (3 + 26 slices of a 200-byte row, one a cycle, against a tile's two
    beats every two cycles): a one-row job takes exactly the added memory latency more at
    2, 10 and 25 cycles. With two rows each tile waits for the second row's slice, 26
    cycles after the first's, so a latency up to that costs nothing (the RTL's cycles,
    held to the model's)."""
    rng = np.random.default_rng(61)
    memory, addrs = _blocks(rng, TINY, shapes=((9, 200),))
    jobs = [_mm(INT8, rows, 9, 200, 0, 100, addrs[(9, 200)]) for rows in (1, 2)]
    latencies = (2, 10, 25)
    one, two = [], []
    for latency in latencies:
        config = TINY.with_changes(mem_latency_ns=10.0 * latency)
        assert _check(rng, config, jobs, memory) == [ErrorCode.OK] * 2
        one.append(model_cycles(config, 128, jobs[0]))
        two.append(model_cycles(config, 128, jobs[1]))
    assert [c - one[0] for c in one] == [lat - latencies[0] for lat in latencies]
    assert two[0] == two[1] == two[2]


# -- ROWEXP: each row's requantisation shift less its row exponent -------------------------
@pytest.mark.parametrize("config, data_width", [(TINY, 128), (TINY.with_changes(lanes=32), 256),
                                                (TINY.with_changes(rows=8, reduce=32), 128)],
                         ids=["tiny", "32-lanes", "8-rows"])
def test_row_exponents(config, data_width):
    """Random jobs with ``ROWEXP`` (half of them; any mode, wide or not, some with more
    rows than a pass holds) under random row exponents: the sequencer reads row ``r``'s
    exponent for its output row ``r`` of every pass, as the functional model does, in
    the same cycles as without."""
    rng = np.random.default_rng(71 + config.rows + config.lanes)
    memory, addrs = _blocks(rng, config, data_width=data_width)
    jobs = []
    for _ in range(24):
        job = _random_job(rng, config, addrs)
        if rng.random() < 0.5:
            job["flags"] |= Flag.ROWEXP
        job["row_exp"] = [int(e) for e in rng.integers(0, nx.ROW_EXP_MAX + 1, config.rows)]
        jobs.append(job)
    a = addrs[(33, 17)]
    jobs.append(dict(_mm(RESADD, config.rows, 33, 17, 0, 100, a, wide=True),
                     row_exp=list(range(config.rows)), flags=Flag.ROWEXP | Flag.WIDE | RESADD << 1))
    assert _check(rng, config, jobs, memory, data_width) == [ErrorCode.OK] * len(jobs)
    assert sum(bool(j["flags"] & Flag.ROWEXP) for j in jobs) >= 8


# -- OUT16: an INT8-mode MATMUL that writes int16 (the gate/up rows of an ACTMUL IN16) -------------
def _int16_outputs(jobs) -> int:
    return sum(j["rows"] * j["n"] for j in jobs
               if j["flags"] & Flag.OUT16 and (j["flags"] >> 1) & 3 == INT8)


@pytest.mark.parametrize("config, data_width, seed", [
    (TINY, 128, 71), (TINY.with_changes(lanes=16), 128, 72),
    (TINY.with_changes(lanes=32, reduce=4, rows=4), 256, 73)], ids=["tiny", "lanes16", "lanes32"])
def test_out16_random_jobs(config, data_width, seed):
    """Random jobs, two in three with OUT16 (INT8 rows of int16: one line at 4 lanes, two
    at 16, four at 32; other modes ignore the flag), BIAS and not, as the functional model
    in the cycle model's cycles; at least 300 int16 outputs each (over 1000 in all)."""
    jobs = _check_random(seed, config, data_width, count=40, bias=seed % 2 == 0, out16_share=2 / 3)
    assert _int16_outputs(jobs) >= 300, _int16_outputs(jobs)


def test_out16_wider_lines_and_tree_rows():
    """32-byte lines at 16 lanes, and OUT16 rows of a tree forward a pitch apart."""
    config, data_width = wide_line(32, TINY.with_changes(lanes=16))
    jobs = _check_random(74, config, data_width=data_width, count=6, offsets=(0, 64), bias=True,
                         out16_share=1.0)
    assert _int16_outputs(jobs) > 0
    rng = np.random.default_rng(75)
    memory, addrs = _blocks(rng, TINY)
    a = addrs[(33, 17)]
    pitch = _lines(2 * 33) + 1
    jobs = [_mm(INT8, 2, 33, 17, 3, 100, a, wide=True, pitch=pitch, out16=True),
            _mm(INT8, 2, 40, 40, 20, 150, addrs[(40, 40)], pitch=_lines(80), out16=True),
            _mm(INT8, 1, 7, 5, 200, 210, addrs[(7, 5)], out16=True)]
    assert _check(rng, TINY, jobs, memory) == [ErrorCode.OK] * len(jobs)


@pytest.mark.parametrize("old, new", [
    # int16 rows written as int8
    ("return Mux(mode == MatmulMode.INT8, Mux(out16, 2, 1), 4)",
     "return Mux(mode == MatmulMode.INT8, Mux(out16, 1, 1), 4)"),
    # the matrix unit saturating to int8
    ("mx.q.payload.mode.eq(Mux(out16 & (mode == MatmulMode.INT8),", "mx.q.payload.mode.eq(Mux(0,"),
], ids=["int8-bytes", "int8-saturation"])
def test_out16_mutations_are_caught(old, new):
    """The OUT16 checks can fail."""
    import dfvg_hw.matmul_sequencer as matmul_module
    bad = mutant(matmul_module, old, new, shared=("MatmulMode",)).MatmulSequencer
    rng = np.random.default_rng(76)
    memory, addrs = _blocks(rng, TINY)
    jobs = [_mm(INT8, 2, 40, 40, 0, 100, addrs[(40, 40)], wide=True, out16=True),
            _mm(INT8, 1, 33, 17, 20, 150, addrs[(33, 17)], out16=True)]
    with pytest.raises(AssertionError):
        _check(rng, TINY, jobs, memory, sequencer_class=bad)
