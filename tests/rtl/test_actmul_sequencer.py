"""ActMulSequencer against the functional model's ACTMUL (sim/op_bench.py), gated and
``UNGATED``, and against the cycle model."""

from __future__ import annotations

import struct

import numpy as np
import pytest

from dfvg_hw.spec import numerics as nx
from dfvg_hw.spec import timing
from dfvg_hw.spec.config import ConfigError
from dfvg_hw.spec.descriptors import ErrorCode
from dfvg_hw.spec.image import ACT_PARAM_BYTES
from dfvg_hw.spec.isa import ACTMUL_SEGMENTS, Flag, Instruction, Op
from dfvg_hw.actmul_sequencer import ActMulSequencer
from sim.memory import DeviceMemory
from dfvg_hw.verilog import to_verilog
from sim.cycle_model import CycleModel
from sim.elementwise_timing import actmul_cycles
from sim.op_bench import compare_with_reference
from sim.lint import verilator_lint
# the row-job harness shared with the other row sequencer's tests (tests/rtl/)
from sequencer_cases import (WIDE_LINES, wide_line, TINY, L, check_random_row_jobs, check_row_jobs, check_wide_lanes,
                             mutant, random_row_job, row_job)

#: parameter blocks (bus-aligned, odd, 8 mod 16, 13 mod 16) and their head words: int8
#: results spread, int16 results spread, saturating, and a word with bits above the shift
#: field set (the model masks them off)
BLOCKS = {0x1000: 40000 | 29 << 16, 0x2003: 30000 | 21 << 16, 0x3008: 65535,
          0x400D: 0xFFC0_0000 | 27 << 16 | 12345}
#: the block's table runs past the end of memory (BAD_ADDRESS)
PAST_END = TINY.mem_bytes - ACT_PARAM_BYTES + 1


#: runs of ACTMUL_SEGMENTS consecutive blocks (one per channel segment) at a bus-aligned,
#: an odd and an 8-mod-16 address, and how each picks its segments' first channels:
#: increasing, anywhere (unsorted, repeated, past n), every one a multiple of 4
SEGMENT_RUNS = {0x5000: "increasing", 0x7003: "anywhere", 0x9008: "multiples of 4"}


def _block(rng, word, first=None):
    """A parameter block: its head word, the segment's first channel in bytes 4–5 (the
    rest of the head 0xAA, which nothing reads) and a random table."""
    head = struct.pack("<I", word) + (b"\xAA" * 4 if first is None else struct.pack("<I", 0xAAAA0000 | first))
    return head.ljust(16, b"\xAA") + rng.integers(-32768, 32768, 256).astype("<i2").tobytes()


def _memory(rng) -> DeviceMemory:
    memory = DeviceMemory(TINY.mem_bytes)
    for addr, word in BLOCKS.items():
        memory.write(addr, _block(rng, word))
    for addr, kind in SEGMENT_RUNS.items():
        firsts = {"increasing": np.sort(rng.integers(1, 48, ACTMUL_SEGMENTS)),
                  "anywhere": rng.integers(0, 80, ACTMUL_SEGMENTS),
                  "multiples of 4": 4 * rng.integers(0, 16, ACTMUL_SEGMENTS)}[kind]
        words = [int(rng.integers(30000, 65536)) | int(rng.integers(18, 30)) << 16
                 for _ in range(ACTMUL_SEGMENTS)]
        memory.write(addr, b"".join(_block(rng, w, int(f)) for w, f in zip(words, firsts)))
    return memory


def _actmul(rows, n, src, dst, addr=0x1000, wide=False):
    return row_job(Op.ACTMUL, rows, n, src, dst, addr=addr, wide=wide)


def _check(rng, jobs, data_width=128, config=TINY):
    return check_row_jobs(rng, ActMulSequencer, _memory, jobs, data_width, config)


def test_rows_widths_alignments_and_in_place():
    rng = np.random.default_rng(11)
    jobs = [_actmul(1, 16, 10, 40), _actmul(2, 20, 60, 60, addr=0x2003, wide=True),
            _actmul(2, 7, 100, 100, addr=0x3008), _actmul(1, 1, 3, 5, addr=0x400D, wide=True),
            _actmul(2, 64, 120, 20), _actmul(2, 9, 150, 150, addr=0x2003, wide=True),
            # wide rows of n mod 16 ≤ 8 leave a surplus line per row; the narrow job after
            # must not see it, nor the wide one after that
            _actmul(2, 5, 170, 180, wide=True), _actmul(1, 5, 170, 190), _actmul(1, 3, 170, 200, wide=True)]
    assert _check(rng, jobs) == [ErrorCode.OK] * len(jobs)


def test_errors():
    rng = np.random.default_rng(12)
    last_line = TINY.vmem_bytes // L - 1
    jobs = [
        _actmul(3, 8, 0, 40),                                 # rows > config.rows: PROGRAM
        _actmul(1, 8, 0, 40, addr=PAST_END),                  # table past memory
        _actmul(1, 8, 0, 40, addr=PAST_END - 1),              # block ends with memory: OK
        _actmul(2, 8, last_line, 40),                         # src's second row outside VMEM
        _actmul(1, 16, last_line - 1, 40),                    # src row ends with VMEM: OK
        _actmul(1, 16, 0, last_line, wide=True),              # wide dst outside VMEM
        _actmul(1, 16, 0, last_line),                         # the same, narrow: inside
        _actmul(2, 0, last_line, last_line),                  # n = 0: nothing moves
        _actmul(1, 12, 30, 31, addr=0x2003),                  # and the engine still works
    ]
    errors = _check(rng, jobs)
    assert errors[:3] == [ErrorCode.PROGRAM, ErrorCode.BAD_ADDRESS, ErrorCode.OK]
    assert errors[-1] == ErrorCode.OK


def test_random_jobs():
    check_random_row_jobs(np.random.default_rng(13), ActMulSequencer, _memory, Op.ACTMUL, list(BLOCKS))


def test_wide_bus():
    """A 256-bit bus: the 16-byte-aligned blocks are misaligned for the port."""
    rng = np.random.default_rng(14)
    jobs = [_actmul(2, 40, 10, 50, addr=0x1000), _actmul(1, 33, 5, 5, addr=0x400D, wide=True),
            _actmul(1, 8, 0, 40, addr=PAST_END)]
    assert _check(rng, jobs, data_width=256) == [ErrorCode.OK, ErrorCode.OK, ErrorCode.BAD_ADDRESS]


def test_wide_lanes():
    """64 lanes: rows packed into beats wider than a line (see check_wide_lanes)."""
    check_wide_lanes(np.random.default_rng(5), ActMulSequencer, _memory, Op.ACTMUL, list(BLOCKS))


def test_lint():
    ok, log = verilator_lint(to_verilog(ActMulSequencer(TINY, 128), "actmul_sequencer"),
                             "actmul_sequencer")
    assert ok, log


def test_cycle_model_refuses_an_underived_writer_stall():
    """The cycle model's ACTMUL writer-stall lag is derived for 16, 32 and 64 lanes only: a
    job the writer paces at another lane count is an error naming it, not a bound dropped."""
    ins = Instruction(Op.ACTMUL, flags=Flag.WIDE, rows=1, dst=40, src=0, n=256, addr=0x1000)
    CycleModel(TINY.with_changes(lanes=64, mem_port_bits=256)).instruction(ins)
    with pytest.raises(ConfigError, match=r"lanes = 128.*\[16, 32, 64\]"):
        CycleModel(TINY.with_changes(lanes=128, mem_port_bits=256)).instruction(ins)


def test_cycles_equal_the_model():
    """The table loads a line (8 entries) a cycle: every job's cycles, n = 0 included and
    on 128- and 512-bit buses and at 64 lanes, are the cycle model's."""
    rng = np.random.default_rng(15)
    jobs = [_actmul(1, 16, 10, 40), _actmul(2, 20, 60, 60, addr=0x2003, wide=True),
            _actmul(2, 0, 10, 10, addr=0x3008), _actmul(1, 5, 170, 190, addr=0x400D)]
    for data_width in (128, 512):
        assert check_row_jobs(rng, ActMulSequencer, _memory, jobs, data_width,
                              timed=True) == [ErrorCode.OK] * len(jobs)
    check_wide_lanes(rng, ActMulSequencer, _memory, Op.ACTMUL, list(BLOCKS), timed=True)


# -- UNGATED: h = act(gate), the source row is the gate alone (an ungated MLP's ReLU) -------
def _ungated(rows, n, src, dst, addr=0x1000, wide=False):
    return dict(_actmul(rows, n, src, dst, addr, wide), flags=(Flag.WIDE if wide else 0) | Flag.UNGATED)


def _model_cycles(config, data_width, job):
    """The cycle model's count for an ACTMUL job, gated or not (as sequencer_cases'
    model_cycles counts it: less the controller's UNIT_OVERHEAD)."""
    port = CycleModel(config.with_changes(mem_port_bits=data_width)).port
    return actmul_cycles(port, config.lanes, job["n"], job["rows"], bool(job["flags"] & Flag.WIDE),
                         job["addr"], ungated=bool(job["flags"] & Flag.UNGATED),
                         segments=max(job.get("k", 0), 1),
                         rowexp=bool(job["flags"] & Flag.ROWEXP),
                         in16=bool(job["flags"] & Flag.IN16)) - timing.UNIT_OVERHEAD


def _check_timed(rng, jobs, data_width=128, config=TINY, sequencer_class=ActMulSequencer, vmem=None,
                 make_memory=_memory):
    """The jobs against the functional model (VMEM, error codes and the row exponents
    after every job) and, each that completes, against the cycle model, from random VMEM
    unless ``vmem`` is given; returns the error codes."""
    if vmem is None:
        vmem = rng.integers(0, 256, config.vmem_bytes, dtype=np.uint8)
    cycles = []
    errors = compare_with_reference(config, sequencer_class(config, data_width), vmem, make_memory(rng),
                                    jobs, data_width=data_width, cycles=cycles)
    timed = [(job, got) for job, got, error in zip(jobs, cycles, errors) if error == ErrorCode.OK]
    assert [got for _, got in timed] == [_model_cycles(config, data_width, job) for job, _ in timed]
    return errors


def test_ungated_rows_spans_and_long_rows():
    """Ungated rows of several n (a row of a gated job after them sees no trace of the
    flag), in place when narrow, the source checked over n bytes a row, and a narrow row
    longer than the gate buffer (half of VMEM); every job at the cycle model's count."""
    last_line = TINY.vmem_bytes // L - 1
    jobs = [_ungated(2, 20, 10, 40, wide=True), _ungated(2, 9, 60, 60, addr=0x2003),
            _actmul(2, 9, 60, 60, addr=0x3008),
            _ungated(1, 1, 3, 5, addr=0x400D, wide=True), _ungated(2, 64, 120, 20, addr=0x3008),
            _ungated(1, 2100, 30, 30, addr=0x2003),     # 132 lines: more than the buffer's 128
            _ungated(2, 16, last_line - 1, 40),          # the source ends with VMEM: OK
            _ungated(1, 33, last_line - 1, 40),          # 3 lines from the last but one
            _ungated(2, 0, last_line, last_line),
            _ungated(2, 7, 100, 110, addr=0x400D, wide=True), _actmul(1, 30, 100, 120, wide=True)]
    errors = _check_timed(np.random.default_rng(21), jobs)
    assert errors == [ErrorCode.OK] * 7 + [ErrorCode.BAD_ADDRESS] + [ErrorCode.OK] * 3
    jobs = [_ungated(2, 40, 10, 50, addr=0x1000), _ungated(1, 33, 5, 5, addr=0x400D)]
    assert _check_timed(np.random.default_rng(22), jobs, data_width=512) == [ErrorCode.OK] * 2


def test_ungated_random_jobs():
    """Random ungated jobs (one in four gated, in between), at least 1000 gate values,
    against the functional model and the cycle model. A wide ungated result is twice its
    source row, so it is never written in place (not supported: see the module)."""
    rng = np.random.default_rng(23)
    jobs = []
    for i in range(40):
        job = random_row_job(rng, Op.ACTMUL, list(BLOCKS))     # room for 2n bytes a row
        if i % 4:
            wide = bool(job["flags"] & Flag.WIDE) and job["src"] != job["dst"]
            job = _ungated(job["rows"], job["n"], job["src"], job["dst"], job["addr"], wide)
        jobs.append(job)
    assert _check_timed(rng, jobs) == [ErrorCode.OK] * len(jobs)
    gates = sum(j["rows"] * j["n"] for j in jobs if j["flags"] & Flag.UNGATED)
    assert gates >= 1000, gates


def test_ungated_wide_lanes():
    """64 lanes on a 256-bit bus: gate rows packed into beats of four lines, n not a
    multiple of the lanes, the writer pacing the wide rows."""
    jobs = [_ungated(2, 20, 60, 10, addr=0x2003, wide=True), _ungated(1, 100, 10, 10),
            _ungated(2, 9, 100, 120, addr=0x3008, wide=True), _ungated(1, 130, 150, 200, wide=True),
            _actmul(2, 33, 80, 30)]
    errors = _check_timed(np.random.default_rng(24), jobs, data_width=256,
                          config=TINY.with_changes(lanes=64))
    assert errors == [ErrorCode.OK] * len(jobs)


@pytest.mark.parametrize("old, new", [
    # the row's own bytes taken as up (the gate itself) instead of 1: other values
    ("Mux(past_row, 0, Mux(ungated, 1, lane(1, j)))", "Mux(past_row, 0, lane(1, j))"),
    # the aligner still skipping n bytes: it passes the bytes past the gate as gate lines
    ("up_align.setup.p.skip.eq(Mux(ungated, 0, up_skip))", "up_align.setup.p.skip.eq(up_skip)"),
], ids=["up-from-the-row", "skip-n"])
def test_ungated_mutations_are_caught(old, new):
    """The ungated checks can fail: a sequencer that reads the row as a gated one would
    gives other results than the functional model's."""
    import dfvg_hw.actmul_sequencer as actmul_module
    bad = mutant(actmul_module, old, new, shared=()).ActMulSequencer
    jobs = [_ungated(2, 40, 10, 50, wide=True), _ungated(1, 37, 20, 70)]
    with pytest.raises(AssertionError):
        _check_timed(np.random.default_rng(25), jobs, sequencer_class=bad)


@pytest.mark.parametrize("line, lanes", [(WIDE_LINES[0], 4), (WIDE_LINES[1], 16)])
def test_wider_lines(line, lanes):
    """VMEM lines of 32 bytes at 4 lanes and of 64 bytes at 16 (beats cut from lines, an
    int32 beat a whole line): random jobs as the functional model, in the cycle model's
    cycles."""
    config, data_width = wide_line(line, TINY.with_changes(lanes=lanes))
    check_random_row_jobs(np.random.default_rng(60 + line), ActMulSequencer, _memory, Op.ACTMUL, list(BLOCKS),
                          count=6, timed=True, config=config, data_width=data_width,
                          min_elements=200)


# -- segments: one ACTMUL over several channel groups, each with its own block ------------
def _segmented(rng, count, config=TINY, ungated_share=0.25):
    """``count`` random jobs over 2 … ACTMUL_SEGMENTS segments (one in eight a single
    segment, k = 0 or 1; half of the others 2 or 3, which read fewer blocks) of the
    SEGMENT_RUNS blocks; some ungated."""
    jobs = []
    for _ in range(count):
        job = random_row_job(rng, Op.ACTMUL, list(SEGMENT_RUNS), config)
        if rng.random() < ungated_share:
            wide = bool(job["flags"] & Flag.WIDE) and job["src"] != job["dst"]
            job = _ungated(job["rows"], job["n"], job["src"], job["dst"], job["addr"], wide)
        few = rng.random() < 0.5
        job["k"] = int(rng.integers(0, 2)) if rng.random() < 0.125 else \
            int(rng.integers(2, 4 if few else ACTMUL_SEGMENTS + 1))
        jobs.append(job)
    return jobs


def test_segments_random_jobs():
    """Random jobs of 1 … 8 segments (first channels increasing, unsorted, past n),
    1 or 2 rows, WIDE and not, some UNGATED, against the functional model and in the cycle
    model's cycles; at least 1000 outputs of jobs of two or more segments."""
    rng = np.random.default_rng(31)
    jobs = _segmented(rng, 26)
    assert _check_timed(rng, jobs) == [ErrorCode.OK] * len(jobs)
    outputs = sum(j["rows"] * j["n"] for j in jobs if j["k"] >= 2)
    assert outputs >= 1000, outputs


def test_segments_wide_lanes_and_lines():
    """Segments at 64 lanes on a 256-bit bus (several segments in one beat, the first
    channels of the increasing run all below 48) and at 16 lanes with 64-byte lines on a
    512-bit bus (four chunks of the blocks a line)."""
    rng = np.random.default_rng(32)
    jobs = [dict(_actmul(2, 100, 10, 60, addr=0x5000, wide=True), k=4)]
    errors = _check_timed(rng, jobs, data_width=256, config=TINY.with_changes(lanes=64))
    assert errors == [ErrorCode.OK] * len(jobs)
    config, data_width = wide_line(WIDE_LINES[1], TINY.with_changes(lanes=16))
    jobs = [dict(_actmul(2, 64, 10, 60, addr=0x7003, wide=True), k=8),
            dict(_ungated(1, 50, 100, 100, addr=0x9008), k=5)]
    assert _check_timed(rng, jobs, data_width=data_width, config=config) == [ErrorCode.OK] * len(jobs)


def test_segment_errors():
    """More than ACTMUL_SEGMENTS segments is PROGRAM; segments' blocks running past the end
    of memory are BAD_ADDRESS where one block would fit."""
    jobs = [dict(_actmul(1, 8, 0, 40, addr=0x5000), k=ACTMUL_SEGMENTS + 1),
            dict(_actmul(1, 8, 0, 40, addr=PAST_END - 1), k=2),
            dict(_actmul(1, 8, 0, 40, addr=PAST_END - 1 - ACT_PARAM_BYTES), k=2),
            dict(_actmul(1, 30, 0, 40, addr=0x7003, wide=True), k=ACTMUL_SEGMENTS)]
    errors = _check_timed(np.random.default_rng(33), jobs)
    assert errors == [ErrorCode.PROGRAM, ErrorCode.BAD_ADDRESS, ErrorCode.OK, ErrorCode.OK]


@pytest.mark.parametrize("old, new", [
    # a lane whose channel is a segment's first still in the segment before
    ("firsts[s] <= chan + j", "firsts[s] < chan + j"),
    # the channel count running on across rows: a second row's lanes in later segments
    ("Mux(beat_last, 0, chan + lanes)", "chan + lanes"),
], ids=["first-channel", "channel-across-rows"])
def test_segment_mutations_are_caught(old, new):
    """The segment checks can fail: a sequencer that picks a lane's segment wrongly gives
    other results than the functional model's."""
    import dfvg_hw.actmul_sequencer as actmul_module
    bad = mutant(actmul_module, old, new, shared=()).ActMulSequencer
    jobs = [dict(_actmul(2, 48, 10, 60, addr=0x9008, wide=True), k=8),
            dict(_actmul(2, 40, 100, 150, addr=0x5000), k=6)]
    with pytest.raises(AssertionError):
        _check_timed(np.random.default_rng(34), jobs, sequencer_class=bad)


def test_banked_table_mutation_is_caught():
    """At 64-byte lines a parameter line holds four chunks (heads and table words) that go
    into four banks: a sequencer that takes a chunk that starts the next block for the
    current block's (the wrap one chunk late) gives other results."""
    import dfvg_hw.actmul_sequencer as actmul_module
    bad = mutant(actmul_module, "wrap = at >= _BLOCK_CHUNKS", "wrap = at > _BLOCK_CHUNKS",
                 shared=()).ActMulSequencer
    config, data_width = wide_line(WIDE_LINES[1], TINY.with_changes(lanes=16))
    jobs = [dict(_actmul(1, 60, 10, 60, addr=0x7003, wide=True), k=8)]
    with pytest.raises(AssertionError):
        _check_timed(np.random.default_rng(35), jobs, data_width=data_width, config=config,
                     sequencer_class=bad)


# -- ROWEXP: each row measured at the coarsest exponent, then written at its own -----------
#: parameter blocks for ROWEXP jobs: (head word, exponent budget E). Results that need a
#: few bits more than int16 (wide) or ten more than int8; results far past int16 even at
#: E = 3 (every row at E, saturating); results that fit at exponent 0; and E = 0.
EXP_BLOCKS = {0xA000: (40000 | 20 << 16, nx.ROW_EXP_MAX), 0xB003: (30000 | 12 << 16, 3),
              0xC008: (65535 | 33 << 16, nx.ROW_EXP_MAX), 0xD00D: (50000 | 22 << 16, 0)}
#: a block whose table is 1 but at gate 0 (32767): an ungated row's lanes past its end
#: (gate bytes past the span, which VMEM's reader gives as 0) would dominate its peak
ZERO_GATE_PEAK = 0xE000


def _exp_memory(rng) -> DeviceMemory:
    memory = _memory(rng)
    for addr, (word, exp_max) in EXP_BLOCKS.items():
        head = struct.pack("<2I", word, exp_max << 16).ljust(16, b"\xAA")
        memory.write(addr, head + rng.integers(-32768, 32768, 256).astype("<i2").tobytes())
    table = np.ones(256, "<i2")
    table[128] = 32767
    memory.write(ZERO_GATE_PEAK, struct.pack("<2I", 65535 | 8 << 16, nx.ROW_EXP_MAX << 16).ljust(16, b"\0")
                 + table.tobytes())
    return memory


def _rowexp_jobs(rng, count, config=TINY):
    """``count`` random ROWEXP jobs over EXP_BLOCKS and (a quarter) the segment runs
    (whose first block's head gives E = 10), a quarter ungated."""
    jobs = []
    for _ in range(count):
        segmented = rng.random() < 0.25
        job = random_row_job(rng, Op.ACTMUL, list(SEGMENT_RUNS if segmented else EXP_BLOCKS), config)
        if rng.random() < 0.25:
            wide = bool(job["flags"] & Flag.WIDE) and job["src"] != job["dst"]
            job = _ungated(job["rows"], job["n"], job["src"], job["dst"], job["addr"], wide)
        job["flags"] |= Flag.ROWEXP
        if segmented:
            job["k"] = int(rng.integers(2, ACTMUL_SEGMENTS + 1))
        jobs.append(job)
    return jobs


def _check_exp(rng, jobs, *args, **kwargs):
    """:func:`_check_timed` over the memory with the ROWEXP blocks."""
    return _check_timed(rng, jobs, *args, make_memory=_exp_memory, **kwargs)


def test_row_exponents_random_jobs():
    """Random ROWEXP jobs (1 or 2 rows, WIDE or not, some ungated or of several segments):
    the results, the exponents each leaves and the cycles are the models'; at least 1000
    outputs, and exponents 0, the saturating block's budget and three others reached."""
    rng = np.random.default_rng(41)
    jobs = _rowexp_jobs(rng, 30)
    assert _check_exp(rng, jobs) == [ErrorCode.OK] * len(jobs)
    assert sum(j["rows"] * j["n"] for j in jobs) >= 1000
    engine_exps = set()
    vmem = rng.integers(0, 256, TINY.vmem_bytes, dtype=np.uint8)
    from sim.op_bench import reference_jobs
    exps = []
    reference_jobs(TINY, vmem, _exp_memory(rng), jobs, exponents=exps)
    for job, after in zip(jobs, exps):
        engine_exps.update(after[:job["rows"]])
    assert {0, 3} <= engine_exps and len(engine_exps) >= 5, engine_exps


def test_row_exponents_edges():
    """n = 1, a row of one line and one past it, in place, n = 0 (no row computed: the
    exponents stay), a job without ROWEXP after (they stay too), on 128- and 512-bit
    buses and at 64 lanes, where the measure pass's beats pack four lines."""
    def job(rows, n, src, dst, addr, wide=False):
        return dict(_actmul(rows, n, src, dst, addr=addr, wide=wide), flags=Flag.ROWEXP | (Flag.WIDE if wide else 0))
    rng = np.random.default_rng(42)
    jobs = [job(2, 1, 10, 40, 0xA000, wide=True), job(2, 16, 60, 60, 0xB003), job(1, 17, 80, 90, 0xA000, True),
            job(2, 0, 10, 10, 0xA000), _actmul(2, 20, 100, 120, addr=0x2003, wide=True),
            job(2, 33, 150, 150, 0xC008, wide=True), job(1, 8, 170, 180, 0xD00D)]
    for data_width in (128, 512):
        assert _check_exp(rng, jobs, data_width) == [ErrorCode.OK] * len(jobs)
    jobs = [job(2, 100, 10, 60, 0xA000, wide=True), job(1, 70, 150, 150, 0xB003),
            dict(job(2, 90, 200, 230, 0x5000, wide=True), k=5)]
    assert _check_exp(rng, jobs, 256, TINY.with_changes(lanes=64)) == [ErrorCode.OK] * len(jobs)
    config, data_width = wide_line(WIDE_LINES[1], TINY.with_changes(lanes=16))
    assert _check_exp(rng, jobs[:2], data_width, config) == [ErrorCode.OK] * 2


@pytest.mark.parametrize("old, new", [
    # the exponent one too small for int16 rows: they saturate
    ("Mux(wide, 15, 7)", "Mux(wide, 14, 7)"),
    # a beat's lanes past the row counted in the peak
    ("past_row = measuring & (chan + j >= job.n)", "past_row = 0"),
    # the write pass at the budget instead of the row's exponent
    ("act.extra.eq(Mux(measuring, exp_max, exp))", "act.extra.eq(exp_max)"),
    # the write pass's up lines taken into the gate buffer as gates
    ("gate_wr.en.eq(line_taken & ~ungated & ~up_only & (row_line < gate_lines))",
     "gate_wr.en.eq(line_taken & ~ungated & (row_line < gate_lines))"),
], ids=["exponent-off-by-one", "lanes-past-the-row", "write-at-the-budget", "gates-overwritten"])
def test_row_exponent_mutations_are_caught(old, new):
    """The exponent checks can fail. Besides random jobs, ungated rows of one or five
    channels at a table whose only large entry is at gate 0, the gate of the lanes past
    the row (the span's tail): counted, they would set the exponent."""
    import dfvg_hw.actmul_sequencer as actmul_module
    bad = mutant(actmul_module, old, new, shared=()).ActMulSequencer
    rng = np.random.default_rng(43)
    vmem = rng.integers(1, 256, TINY.vmem_bytes, dtype=np.uint8)     # no gate 0 in the rows
    tails = [dict(_ungated(2, n, 10, 40, addr=ZERO_GATE_PEAK, wide=True), flags=Flag.ROWEXP | Flag.WIDE | Flag.UNGATED)
             for n in (1, 5)]
    with pytest.raises(AssertionError):
        _check_exp(rng, tails + _rowexp_jobs(rng, 8), sequencer_class=bad, vmem=vmem)


# -- IN16: int16 gate and up, the table as interpolated knots (the compiler's gated MLPs) ----
def _in16_jobs(rng, count, config=TINY, blocks=None):
    """``count`` random IN16 jobs: a quarter ungated, a quarter with row exponents, a
    quarter over several segments. ``n`` is half a random row job's, so the source row's
    ``4n`` bytes have the room its ``2n`` had."""
    jobs = []
    for _ in range(count):
        segmented = rng.random() < 0.25
        job = random_row_job(rng, Op.ACTMUL, blocks or list(SEGMENT_RUNS if segmented else EXP_BLOCKS), config)
        job["n"] = max(1, job["n"] // 2)
        kind = rng.random()
        if kind < 0.25:
            wide = bool(job["flags"] & Flag.WIDE) and job["src"] != job["dst"]
            job = _ungated(job["rows"], job["n"], job["src"], job["dst"], job["addr"], wide)
        elif kind < 0.5:
            job["flags"] |= Flag.ROWEXP
        job["flags"] |= Flag.IN16
        if segmented:
            job["k"] = int(rng.integers(2, ACTMUL_SEGMENTS + 1))
        jobs.append(job)
    return jobs


def test_in16_random_jobs():
    """Random IN16 jobs (1 or 2 rows, WIDE or not; ungated, with row exponents or of several
    segments among them) and narrow jobs between: the results, the exponents and the
    cycles are the functional and the cycle model's; at least 1000 outputs."""
    rng = np.random.default_rng(51)
    jobs = _in16_jobs(rng, 40)
    jobs[5:5] = [_actmul(2, 20, 60, 60, addr=0x2003, wide=True)]
    assert _check_exp(rng, jobs) == [ErrorCode.OK] * len(jobs)
    assert sum(j["rows"] * j["n"] for j in jobs if j["flags"] & Flag.IN16) >= 1000


def test_in16_edges():
    """n = 1, rows of one line and one past it (8 int16 a 16-byte line), in place, n = 0,
    on 128- and 512-bit buses, at 64 lanes (a beat packs eight lines) and at wider lines."""
    def job(rows, n, src, dst, addr=0x1000, wide=False, extra=0):
        return dict(_actmul(rows, n, src, dst, addr=addr, wide=wide), flags=Flag.IN16 | extra | (Flag.WIDE if wide else 0))
    rng = np.random.default_rng(52)
    jobs = [job(2, 1, 10, 40, wide=True), job(2, 8, 60, 60, 0x2003), job(1, 9, 80, 90, 0x400D, True),
            job(2, 0, 10, 10), job(2, 17, 100, 100, 0xA000, True, Flag.ROWEXP),
            job(1, 30, 150, 200, 0x3008, extra=Flag.UNGATED), _actmul(1, 30, 100, 120, wide=True)]
    for data_width in (128, 512):
        assert _check_exp(rng, jobs, data_width) == [ErrorCode.OK] * len(jobs)
    jobs = [job(2, 100, 10, 60, 0xA000, wide=True, extra=Flag.ROWEXP), job(1, 70, 150, 150, 0xB003),
            dict(job(2, 90, 200, 150, 0x5000, wide=True), k=5), job(1, 33, 20, 40, extra=Flag.UNGATED)]
    assert _check_exp(rng, jobs, 256, TINY.with_changes(lanes=64)) == [ErrorCode.OK] * len(jobs)
    for line, lanes in ((WIDE_LINES[0], 4), (WIDE_LINES[1], 16)):
        config, data_width = wide_line(line, TINY.with_changes(lanes=lanes))
        assert _check_exp(rng, jobs[:2], data_width, config) == [ErrorCode.OK] * 2


@pytest.mark.parametrize("old, new", [
    # an int16 lane's bytes swapped
    ("Cat(wide16[2 * j], wide16[2 * j + 1])", "Cat(wide16[2 * j + 1], wide16[2 * j])"),
    # the up half taken from byte n, as an int8 row's
    ("gate_bytes = Mux(in16, job.n << 1, job.n)", "gate_bytes = job.n"),
    # ActMul told int8 operands
    ("act.in16.eq(in16)", "act.in16.eq(0)"),
], ids=["byte-order", "up-at-n", "narrow-unit"])
def test_in16_mutations_are_caught(old, new):
    """The IN16 checks can fail."""
    import dfvg_hw.actmul_sequencer as actmul_module
    bad = mutant(actmul_module, old, new, shared=()).ActMulSequencer
    rng = np.random.default_rng(53)
    with pytest.raises(AssertionError):
        _check_exp(rng, _in16_jobs(rng, 6), sequencer_class=bad)
