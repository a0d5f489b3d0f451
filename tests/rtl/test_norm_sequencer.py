"""NormSequencer against the functional model's RMSNORM (sim/op_bench.py)."""

from __future__ import annotations

import numpy as np
import pytest

from dfvg_hw.spec.descriptors import ErrorCode
from dfvg_hw.spec.image import NORM_PARAM_BYTES, pack_norm_params
from dfvg_hw.spec.isa import Op
from dfvg_hw.norm_sequencer import NormSequencer
from sim.memory import DeviceMemory
from sim.op_bench import reference_jobs, run_jobs
from sim.tree_state import TreeState
from dfvg_hw.verilog import to_verilog
from sim.lint import verilator_lint
# the row-job harness shared with the other row sequencer's tests (tests/rtl/)
from sequencer_cases import (WIDE_LINES, wide_line, MAX_N, TINY, L, check_random_row_jobs, check_row_jobs,
                             check_wide_lanes, model_cycles, row_job)

#: parameter blocks: bus-aligned, odd (the head and gamma at every byte offset), 8 mod 16
BLOCKS = (0x1000, 0x2003, 0x3008, 0x400D)
#: a block whose gamma_shift is 17 (> GAMMA_SHIFT_MAX: PROGRAM)
BAD_SHIFT = 0x5000
#: a head inside memory whose gamma of more than 5 elements is not (BAD_ADDRESS after the head)
GAMMA_PAST_END = TINY.mem_bytes - NORM_PARAM_BYTES - 10
#: a head past the end of memory (BAD_ADDRESS from the head read)
HEAD_PAST_END = TINY.mem_bytes - 20
#: blocks with eps 0 (an all-zero segment's rsqrt sees s = 0) and with the largest eps
EPS_ZERO, EPS_MAX = 0x6000, 0x7000


def _memory(rng) -> DeviceMemory:
    memory = DeviceMemory(TINY.mem_bytes)
    for addr, shift in zip(BLOCKS, (5, 7, 3, 16)):     # spread, small, saturating, WIDE-only
        gamma = rng.integers(-32768, 32768, MAX_N).astype(np.int16)
        eps = int(rng.integers(0, 1 << 32))
        memory.write(addr, pack_norm_params(eps, gamma, shift))
    memory.write(BAD_SHIFT, pack_norm_params(5, np.ones(MAX_N, np.int16), 17))
    memory.write(GAMMA_PAST_END, pack_norm_params(7, np.full(5, 300, np.int16), 9))
    for addr, eps, shift in ((EPS_ZERO, 0, 9), (EPS_MAX, (1 << 32) - 1, 12)):
        memory.write(addr, pack_norm_params(eps, rng.integers(-32768, 32768, MAX_N).astype(np.int16),
                                            shift))
    return memory


def _norm(rows, n, src, dst, addr=BLOCKS[0], wide=False, k=0):
    """An RMSNORM job; ``k ≥ 2``: each row is ``k`` segments of ``n``."""
    return row_job(Op.RMSNORM, rows, n, src, dst, addr=addr, wide=wide) | {"k": k}


def _check(rng, jobs, data_width=128, config=TINY):
    """The jobs against the functional model, and each that completes against the cycle
    model's cycles."""
    return check_row_jobs(rng, NormSequencer, _memory, jobs, data_width, config, timed=True)


def test_rows_widths_alignments_and_in_place():
    rng = np.random.default_rng(1)
    jobs = [_norm(1, 16, 10, 40), _norm(2, 20, 60, 60, addr=BLOCKS[1], wide=True),
            _norm(2, 7, 100, 100, addr=BLOCKS[2]), _norm(1, 1, 3, 5, addr=BLOCKS[3], wide=True),
            _norm(2, 64, 120, 20, addr=BLOCKS[1])]
    assert _check(rng, jobs) == [ErrorCode.OK] * len(jobs)


def test_errors_in_the_functional_models_order():
    rng = np.random.default_rng(2)
    last_line = TINY.vmem_bytes // L - 1
    jobs = [
        _norm(3, 8, 0, 40),                                   # rows > config.rows: PROGRAM
        _norm(1, 8, 0, 40, addr=HEAD_PAST_END),               # head past memory
        _norm(1, 8, 0, 40, addr=BAD_SHIFT),                   # gamma_shift 17: PROGRAM ...
        _norm(1, 8, last_line + 5, 40, addr=BAD_SHIFT),       # ... before the VMEM checks
        _norm(1, 6, 0, 40, addr=GAMMA_PAST_END),              # gamma past memory
        _norm(1, 5, 0, 40, addr=GAMMA_PAST_END),              # gamma ends with memory: OK
        _norm(2, 16, last_line - 2, 40),                      # src's second row outside VMEM
        _norm(1, 16, 0, last_line, wide=True),                # wide dst outside VMEM
        _norm(1, 16, 0, last_line),                           # the same, narrow: inside
        _norm(2, 0, last_line, last_line),                    # n = 0: nothing moves
        _norm(1, 0, last_line + 1, 0),                        # n = 0 just past VMEM
        _norm(1, 12, 30, 31, addr=BLOCKS[1]),                 # and the engine still works
    ]
    errors = _check(rng, jobs)
    assert ErrorCode.PROGRAM in errors and ErrorCode.BAD_ADDRESS in errors
    assert errors[-1] == ErrorCode.OK


def test_random_jobs():
    check_random_row_jobs(np.random.default_rng(3), NormSequencer, _memory, Op.RMSNORM, BLOCKS,
                          timed=True)


def test_wide_bus():
    """A 256-bit bus: the 16-byte-aligned blocks are misaligned for the port."""
    rng = np.random.default_rng(4)
    jobs = [_norm(2, 40, 10, 50, addr=BLOCKS[0] + 16), _norm(1, 33, 5, 5, addr=BLOCKS[1], wide=True),
            _norm(1, 8, 0, 40, addr=BAD_SHIFT)]
    assert _check(rng, jobs, data_width=256) == [ErrorCode.OK, ErrorCode.OK, ErrorCode.PROGRAM]


def test_wide_lanes():
    """64 lanes: rows packed into beats wider than a line (see check_wide_lanes)."""
    check_wide_lanes(np.random.default_rng(5), NormSequencer, _memory, Op.RMSNORM, BLOCKS,
                     timed=True)


def test_lint():
    ok, log = verilator_lint(to_verilog(NormSequencer(TINY, 128), "norm_sequencer"), "norm_sequencer")
    assert ok, log


#: rows of many 64-lane beats (gamma's Gearbox and the writer pace pass 2), in place too
LONG_ROWS = [_norm(1, 200, 0, 60, wide=True), _norm(2, 130, 90, 160, addr=BLOCKS[1]),
             _norm(1, 300, 0, 80, addr=BLOCKS[2], wide=True),
             _norm(2, 77, 0, 200, addr=BLOCKS[3], wide=True), _norm(1, 256, 100, 100)]


def test_row_buffer_replays_long_rows():
    """Rows that fit the row buffer are read from VMEM once (passes 1 and 2 replay the
    buffer a beat a cycle): results and cycles (the cycle model's) at 64 lanes."""
    config = TINY.with_changes(lanes=64)
    from dfvg_hw.spec import timing
    assert all(job["n"] <= 64 * timing.norm_row_buffer_beats(64) for job in LONG_ROWS)
    assert _check(np.random.default_rng(6), LONG_ROWS, 256, config) == [ErrorCode.OK] * 5


def test_rows_longer_than_the_buffer_read_vmem_three_times(monkeypatch):
    """With a 64-byte row buffer (one 64-lane beat, four 4-lane beats) most rows do not
    fit and take three VMEM passes; the ones that do still replay: every job's cycles are
    the cycle model's, which must tell the two apart."""
    from dfvg_hw.spec import timing
    monkeypatch.setattr(timing, "NORM_ROW_BUFFER_BYTES", 64)
    rng = np.random.default_rng(7)
    jobs = [_norm(1, 16, 10, 40), _norm(2, 20, 60, 60, addr=BLOCKS[1], wide=True),
            _norm(1, 4, 3, 5, addr=BLOCKS[3], wide=True)]
    assert _check(rng, jobs) == [ErrorCode.OK] * 3
    assert _check(rng, jobs + LONG_ROWS[:2], 256, TINY.with_changes(lanes=64)) == [ErrorCode.OK] * 5


# -- segments (k ≥ 2: QK-norm, each head of a row normalised on its own) -------------------
#: TINY with room for a few segmented jobs side by side (each its own source and destination)
ROOMY = TINY.with_changes(vmem_bytes=16384)


def _segments(rng, count, n, bits=None):
    """``count`` int32 segments of ``n``, each of its own magnitude: all zero (``bits`` -1)
    or random below ``±2^bits`` (``bits`` 0 … 31, so each has its own shift ``p`` from 0
    to 16); ``bits`` random unless given."""
    bits = rng.integers(-1, 32, count) if bits is None else bits
    return np.concatenate([np.zeros(n, np.int64) if b < 0 else rng.integers(-(1 << b), 1 << b, n)
                           for b in bits]).astype(np.int32)


class _SegmentedJobs:
    """Segmented RMSNORM jobs laid out one after the other in VMEM, each source planted
    with segments of their own magnitudes and each destination apart from everything else
    (or in place), so that every job's result stays in VMEM to be compared.

    A tree forward's job (``pitch``: rows that many lines apart) runs on the sequencer
    as the controller runs it: one single-row job per row, the last row first; the
    functional model runs it as one instruction with the pitch."""

    def __init__(self, rng, config):
        self.rng, self.config = rng, config
        self.vmem = rng.integers(0, 256, config.vmem_bytes, dtype=np.uint8)
        self.line, self.rtl_jobs, self.ref_jobs, self.elements = 0, [], [], 0

    def _take(self, lines):
        start, self.line = self.line, self.line + lines
        assert self.line <= self.config.vmem_bytes // L, "the jobs do not fit VMEM"
        return start

    def add(self, rows, k, n, wide=False, in_place=False, addr=EPS_MAX, pitch=0, bits=None):
        src_lines, dst_lines = 4 * k * n // L, (2 if wide else 1) * k * n // L
        stride = pitch or src_lines
        src = self._take((rows - 1) * stride + src_lines)
        dst = src if in_place else self._take((rows - 1) * (pitch or dst_lines) + dst_lines)
        x = _segments(self.rng, rows * k, n, bits).reshape(rows, -1)
        for r in range(rows):
            at = (src + r * stride) * L
            self.vmem[at:at + 4 * k * n] = x[r].view(np.uint8)
        job = _norm(rows, n, src, dst, addr=addr, wide=wide, k=k)
        if pitch:
            self.rtl_jobs += [job | {"rows": 1, "src": src + r * pitch, "dst": dst + r * pitch}
                              for r in reversed(range(rows))]
            self.ref_jobs.append(job | {"pitch": pitch, "tree": TreeState(rows, 0, level=1)})
        else:
            self.rtl_jobs.append(job)
            self.ref_jobs.append(job)
        self.elements += rows * k * n

    def check(self, data_width=128):
        """Run the jobs on the sequencer and the functional model: every job OK, VMEM
        the same, every job's cycles the cycle model's."""
        c, memory = self.config, _memory(self.rng)
        cycles = []
        after, errors = run_jobs(c, NormSequencer(c, data_width), self.vmem, memory, self.rtl_jobs,
                                 data_width=data_width, cycles=cycles, max_cycles=100_000)
        expected, expected_errors = reference_jobs(c, self.vmem, memory, self.ref_jobs)
        assert errors == [ErrorCode.OK] * len(self.rtl_jobs)
        assert expected_errors == [ErrorCode.OK] * len(self.ref_jobs)
        np.testing.assert_array_equal(after, expected)
        assert cycles == [model_cycles(c, data_width, job) for job in self.rtl_jobs]


def test_segments_of_their_own_magnitudes():
    """Rows of 2 … 6 segments of 16 … 64, each segment its own shift p (zero segments
    under eps 0 and the largest eps among them), int8 and int16, in place or apart,
    several rows back to back and a tree forward's rows a pitch apart."""
    rng = np.random.default_rng(10)
    jobs = _SegmentedJobs(rng, ROOMY)
    # big next to small next to zero: a shift or a sum carried over from the previous
    # segment shows
    jobs.add(1, 6, 16, bits=[30, 0, 20, -1, 31, 3], addr=EPS_ZERO)
    jobs.add(2, 3, 32, wide=True, bits=[-1, 25, 1, 14, -1, 31], addr=EPS_MAX)
    jobs.add(2, 2, 16, in_place=True, pitch=12, bits=[8, 28, 31, -1], addr=EPS_ZERO)
    jobs.add(2, 4, 32, wide=True, pitch=40, addr=BLOCKS[2])
    blocks = (*BLOCKS, EPS_ZERO, EPS_MAX)
    while jobs.elements < 2000:
        rows, k, n = int(rng.integers(1, 3)), int(rng.integers(2, 7)), 16 * int(rng.integers(1, 5))
        pitch = 4 * k * n // L + int(rng.integers(0, 3)) if rows > 1 and rng.random() < 0.3 else 0
        jobs.add(rows, k, n, wide=bool(rng.integers(2)), in_place=bool(rng.random() < 0.3),
                 addr=blocks[int(rng.integers(len(blocks)))], pitch=pitch)
    jobs.check()


def test_segments_at_64_lanes():
    """64 lanes on a 256-bit bus: a segment of 16 … 48 is one partial beat, whose surplus
    result lines the writer drops segment by segment."""
    rng = np.random.default_rng(11)
    jobs = _SegmentedJobs(rng, ROOMY.with_changes(lanes=64))
    for rows, k, n, wide in ((1, 4, 16, False), (2, 3, 48, True), (1, 2, 80, False),
                             (2, 2, 64, True), (1, 5, 32, True)):
        jobs.add(rows, k, n, wide=wide, addr=(EPS_ZERO, EPS_MAX)[rows - 1])
    jobs.check(data_width=256)


def test_gamma_kept_when_it_fits_the_gamma_buffer():
    """Only the first row (segment) of a job reads gamma when the row fits the row buffer
    and its gamma the 512-byte gamma buffer; a longer gamma is read for every row.
    Results and cycles, at the buffer's edge (256 elements) and past it, at 4 and 64
    lanes, with a memory slow enough (2 µs) that a gamma read shows past passes 0 and 1."""
    from dfvg_hw.spec import timing
    assert timing.norm_gamma_buffer_beats(4) * 4 == 256 == timing.norm_gamma_buffer_beats(64) * 64
    for lanes, data_width, seed in ((4, 128, 14), (64, 256, 15)):
        rng = np.random.default_rng(seed)
        jobs = _SegmentedJobs(rng, ROOMY.with_changes(lanes=lanes, mem_latency_ns=2000.0))
        jobs.add(1, 2, 256, addr=BLOCKS[0])                      # kept (the last beat fits)
        jobs.add(1, 2, 272, wide=True, addr=BLOCKS[1])           # re-read per segment
        jobs.add(2, 1, 260, in_place=True, addr=BLOCKS[2])       # re-read per row
        jobs.check(data_width)


def test_more_segment_rows_than_the_writer_counts():
    """260 segment-rows in one job: more than the row writer counts (8 bits)."""
    rng = np.random.default_rng(12)
    jobs = _SegmentedJobs(rng, TINY.with_changes(vmem_bytes=20992))
    jobs.add(2, 130, 16, addr=BLOCKS[1])
    jobs.check()


def test_segment_errors_in_the_functional_models_order():
    rng = np.random.default_rng(13)
    last_line = TINY.vmem_bytes // L - 1
    jobs = [
        _norm(1, 8, 0, 40, k=2),                              # a segment off a line: PROGRAM ...
        _norm(1, 17, 0, 40, addr=HEAD_PAST_END, k=3),         # ... before the head's read
        _norm(1, 24, last_line, 40, addr=BAD_SHIFT, k=2),     # ... and any other check
        _norm(1, 8, 0, 40, k=1),                              # one segment: any n
        _norm(1, 16, 0, 40, addr=BAD_SHIFT, k=2),             # gamma_shift 17: PROGRAM
        _norm(1, 16, last_line - 6, 100, k=2),                # 8 source lines: 1 too many
        _norm(1, 16, 0, 100, k=65535),                        # 65535 segments: no wrap-round
        _norm(2, 16, 0, last_line - 14, wide=True, k=4),      # 16 wide lines: 1 too many
        _norm(2, 16, 0, last_line - 7, k=4),                  # the same narrow: inside
        _norm(2, 0, last_line, last_line, k=5),               # n = 0: nothing moves
        _norm(1, 32, 30, 60, addr=BLOCKS[1], k=3),            # and the engine still works
    ]
    P, B = ErrorCode.PROGRAM, ErrorCode.BAD_ADDRESS
    assert _check(rng, jobs) == [P, P, P, 0, P, B, B, B, 0, 0, 0]


@pytest.mark.parametrize("line, lanes", [(WIDE_LINES[0], 4), (WIDE_LINES[1], 16)])
def test_wider_lines(line, lanes):
    """VMEM lines of 32 bytes at 4 lanes and of 64 bytes at 16 (beats cut from lines, an
    int32 beat a whole line): random jobs as the functional model, in the cycle model's
    cycles."""
    config, data_width = wide_line(line, TINY.with_changes(lanes=lanes))
    check_random_row_jobs(np.random.default_rng(60 + line), NormSequencer, _memory, Op.RMSNORM, BLOCKS,
                          count=6, timed=True, config=config, data_width=data_width,
                          min_elements=200)


# -- a slow narrow port: gamma back-pressured by pass 2 ----------------------------------------
#: (line bytes, port beats a cycle, longest row): a 128-bit port at a quarter of a line a
#: cycle and at the Alveo U55C's pseudo-channel rate, a 512-bit port at that rate
SLOW_PORTS = ((16, 0.25, 512), (16, 0.685, 768), (64, 0.685, 768))


def _slow_port(line: int, rate: float):
    """64 lanes and 3 rows with VMEM lines of ``line`` bytes behind a port one line wide
    that delivers ``rate`` beats a cycle. Returns (config, data_width)."""
    config = TINY.with_changes(lanes=64, rows=3)
    if line != L:
        config, data_width = wide_line(line, config)
    else:
        data_width = 128
    lines = 16384 // line                               # three 768-element rows and more
    config = config.with_changes(vmem_bytes=lines * line,
                                 mem_bandwidth_gbps=rate * data_width / 8 * config.clock_mhz / 1e3)
    assert abs(config.beats_per_cycle(data_width // 8) - rate) < 1e-9
    return config, data_width


def _long_gamma_memory(rng) -> DeviceMemory:
    """Parameter blocks at ``BLOCKS`` with gammas long enough for the slow-port rows."""
    memory = _memory(rng)
    for addr, shift in zip(BLOCKS, (5, 7, 3, 16)):
        gamma = rng.integers(-32768, 32768, 1024).astype(np.int16)
        memory.write(addr, pack_norm_params(int(rng.integers(0, 1 << 32)), gamma, shift))
    return memory


def _slow_port_jobs(rng, config, max_n: int, count: int) -> list[dict]:
    """``count`` random RMSNORMs of up to 3 rows of up to ``max_n`` on ``config``: most
    rows long (their gamma not kept, a gamma read per row), some kept (n ≤ 256)."""
    line, lines = config.vmem_line_bytes, config.vmem_bytes // config.vmem_line_bytes
    jobs = []
    for _ in range(count):
        n = int(rng.integers(max_n // 2, max_n + 1) if rng.random() < 0.75
                else rng.integers(1, 257))
        rows = int(rng.integers(1, 4))
        wide = bool(rng.integers(2))
        src_lines, dst_lines = rows * -(-4 * n // line), rows * -(-(2 if wide else 1) * n // line)
        src = int(rng.integers(0, lines - src_lines + 1))
        dst = src
        if rng.random() < 0.7:                          # apart, on either side, or in place
            free = [d for d in range(lines - dst_lines + 1)
                    if d + dst_lines <= src or src + src_lines <= d]
            dst = int(rng.choice(free)) if free else src
        jobs.append(_norm(rows, n, src, dst, addr=BLOCKS[int(rng.integers(len(BLOCKS)))],
                          wide=wide))
    return jobs


@pytest.mark.parametrize("line, rate, max_n", SLOW_PORTS)
def test_long_rows_at_a_slow_narrow_port(line, rate, max_n):
    """A port slower than a line a cycle: the gamma read cannot run ahead of pass 2 (the
    reader holds a few lines and holds memory back), and a held memory banks at most
    ``READ_CREDIT`` beats, so pass 2 takes gamma at the port's rate from where it caught
    up. Random long rows, 1 to 3 rows, int8 and int16: results and every job's cycles."""
    config, data_width = _slow_port(line, rate)
    rng = np.random.default_rng(int(70 + 10 * rate + line))
    jobs = _slow_port_jobs(rng, config, max_n, count=4)
    assert max(job["n"] for job in jobs) > 256                 # a gamma read per row
    errors = check_row_jobs(rng, NormSequencer, _long_gamma_memory, jobs, data_width, config,
                            timed=True)
    assert errors == [ErrorCode.OK] * len(jobs)


# -- the head read beside row 0's pass 0 -----------------------------------------------------
#: device-memory latencies at TINY's 100 MHz: the head's line comes while row 0's pass 0
#: runs (a cycle), and long after it (150 cycles)
HEAD_LATENCIES = {"head_during_pass_0": 10.0, "head_after_pass_0": 1500.0}


@pytest.mark.parametrize("latency_ns", HEAD_LATENCIES.values(), ids=HEAD_LATENCIES.keys())
def test_head_read_beside_pass_0(latency_ns, monkeypatch):
    """Row 0's pass 0 and the gamma read start while the head is read; pass 1 waits for
    the head's check. A gamma_shift refused after pass 0 leaves VMEM untouched and empties
    the gamma read the reader took (the next job's head is its own); the instruction's
    own faults (gamma past memory, a span outside VMEM) start nothing early. Results
    against the functional model, each completed job's cycles against the cycle model;
    then rows longer than a 64-byte row buffer (pass 1 a VMEM read of its own)."""
    config = TINY.with_changes(mem_latency_ns=latency_ns)
    last_line = config.vmem_bytes // L - 1
    jobs = [_norm(2, 64, 0, 40), _norm(1, 64, 0, 40, addr=BAD_SHIFT),
            _norm(1, 7, 100, 100, addr=BLOCKS[1]), _norm(2, 16, 10, 10, addr=BAD_SHIFT, k=2),
            _norm(1, 64, 20, 60, addr=BLOCKS[3], wide=True),
            _norm(1, 6, 0, 40, addr=GAMMA_PAST_END), _norm(1, 16, 0, last_line, wide=True),
            _norm(1, 33, 30, 31, addr=BLOCKS[2])]
    errors = _check(np.random.default_rng(int(latency_ns)), jobs, config=config)
    OK, PROGRAM, BAD_ADDRESS = ErrorCode.OK, ErrorCode.PROGRAM, ErrorCode.BAD_ADDRESS
    assert errors == [OK, PROGRAM, OK, PROGRAM, OK, BAD_ADDRESS, BAD_ADDRESS, OK]
    from dfvg_hw.spec import timing
    monkeypatch.setattr(timing, "NORM_ROW_BUFFER_BYTES", 64)
    jobs = [_norm(2, 20, 60, 60, addr=BLOCKS[1], wide=True), _norm(1, 64, 0, 40, addr=BAD_SHIFT),
            _norm(1, 64, 10, 40, addr=BLOCKS[2])]
    errors = _check(np.random.default_rng(int(latency_ns) + 1), jobs, config=config)
    assert errors == [OK, PROGRAM, OK]
