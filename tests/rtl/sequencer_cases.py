"""Cases shared by the row sequencers' tests (ActMulSequencer, NormSequencer).

Both run jobs of ``rows`` rows of ``n`` source elements (RMSNORM: int32 residuals, ``4n``
bytes; ACTMUL: an int8 gate and up pair, ``2n`` bytes) into int8 or, with ``WIDE``, int16
results, with a parameter block at ``addr``; they are checked
the same way against the functional model (:func:`sim.op_bench.compare_with_reference`).
Each test file keeps its own parameter blocks and cases. :func:`model_cycles` also times
KVAPPEND and ATTN jobs (test_kv_sequencer), :func:`wide_line` is ``tiny`` with wider VMEM
lines for every sequencer's wide-line case, and :func:`mutant` builds a one-edit copy of
an RTL module for the tests that show a check can fail.
"""

from __future__ import annotations

import numpy as np

from dfvg_hw.spec.config import VMEM_LINE_BYTES, get_preset
from dfvg_hw.spec import timing
from dfvg_hw.spec.isa import Flag, Instruction, Op
from sim.cycle_model import CycleModel
from sim.op_bench import compare_with_reference

TINY = get_preset("tiny")
L = VMEM_LINE_BYTES
#: the longest row the random jobs use
MAX_N = 64
#: VMEM line widths of the wide-line cases (the 256- and 512-bit Alveo presets')
WIDE_LINES = (32, 64)


def wide_line(line_bytes: int, config=TINY):
    """``config`` with VMEM lines of ``line_bytes``: as many lines as before (so the cases'
    line numbers still fit), a memory port one line wide, heads of at least a line
    (head_dim is whole lines). Returns (config, data_width)."""
    lines = config.vmem_bytes // config.vmem_line_bytes
    return (config.with_changes(vmem_line_bytes=line_bytes, mem_port_bits=8 * line_bytes,
                                vmem_bytes=lines * line_bytes,
                                head_dim=max(config.head_dim, line_bytes)), 8 * line_bytes)


def row_job(opcode, rows, n, src, dst, addr, wide=False) -> dict:
    """A row job for :func:`sim.op_bench.run_jobs`: ``rows`` rows of ``n`` elements from
    VMEM line ``src`` to line ``dst``, parameter block at ``addr``, int16 results if
    ``wide``."""
    return dict(opcode=opcode, flags=Flag.WIDE if wide else 0, rows=rows, n=n, src=src,
                dst=dst, addr=addr)


def source_bytes(opcode) -> int:
    """Bytes per element of a row job's source row."""
    return 4 if opcode == Op.RMSNORM else 2


def random_row_job(rng, opcode, blocks, config=TINY) -> dict:
    """A random row job on ``config`` with one of ``blocks`` as its parameter block, either
    in place or with source and destination apart."""
    n = int(rng.integers(1, MAX_N + 1))
    rows = int(rng.integers(1, config.rows + 1))
    wide = bool(rng.integers(2))
    line = config.vmem_line_bytes
    lines = config.vmem_bytes // line
    src_lines = rows * -(-source_bytes(opcode) * n // line)
    dst_lines = rows * -(-(2 if wide else 1) * n // line)
    src = int(rng.integers(0, lines - src_lines))
    dst = src
    while rng.random() >= 0.25 and dst == src:
        # in place or apart: a partly overlapping destination is not supported
        candidate = int(rng.integers(0, lines - dst_lines))
        if candidate + dst_lines <= src or src + src_lines <= candidate:
            dst = candidate
    return row_job(opcode, rows, n, src, dst, addr=blocks[int(rng.integers(len(blocks)))],
                   wide=wide)


def check_row_jobs(rng, sequencer_class, make_memory, jobs, data_width=128, config=TINY,
                   timed=False):
    """Run ``jobs`` on a ``sequencer_class(config, data_width)`` and on the functional model
    from random VMEM and the device memory ``make_memory(rng)`` gives; assert they agree
    and return the error codes. With ``timed``, also assert that every job that completes
    takes the cycle model's cycles (:func:`model_cycles`)."""
    vmem = rng.integers(0, 256, config.vmem_bytes, dtype=np.uint8)
    memory = make_memory(rng)
    cycles = []
    errors = compare_with_reference(config, sequencer_class(config, data_width), vmem, memory,
                                    jobs, data_width=data_width, cycles=cycles)
    if timed:
        timed_jobs = [(job, got) for job, got, error in zip(jobs, cycles, errors) if error == 0]
        assert [got for _, got in timed_jobs] == [model_cycles(config, data_width, job)
                                                  for job, _ in timed_jobs]
    return errors


def model_cycles(config, data_width: int, job: dict) -> int:
    """The cycle model's count for a job on the op bench: the instruction's cycles at
    the job's device address (and KV position ``pos``, for KVAPPEND and ATTN) on a
    ``data_width``-bit port, less the controller's ``UNIT_OVERHEAD`` (the bench counts
    from the job's hand-over to ``done``)."""
    model = CycleModel(config.with_changes(mem_port_bits=data_width))
    fields = ("flags", "rows", "dst", "src", "n", "k", "addr")
    ins = Instruction(job["opcode"], **{name: job[name] for name in fields if name in job})
    return model.instruction(ins, pos=job.get("pos", 0), addr=job.get("addr", 0))[0] \
        - timing.UNIT_OVERHEAD


def check_random_row_jobs(rng, sequencer_class, make_memory, opcode, blocks, count=24,
                          timed=False, config=TINY, data_width=128, min_elements=1000):
    """:func:`check_row_jobs` on ``count`` :func:`random_row_job`\\ s; assert they moved
    at least ``min_elements`` elements, so the run is not a handful of short rows."""
    jobs = [random_row_job(rng, opcode, blocks, config) for _ in range(count)]
    check_row_jobs(rng, sequencer_class, make_memory, jobs, data_width, config, timed=timed)
    elements = sum(j["rows"] * j["n"] for j in jobs)
    assert elements >= min_elements, elements


def check_wide_lanes(rng, sequencer_class, make_memory, opcode, blocks, timed=False):
    """64 lanes (the Alveo presets') on a 256-bit bus: unit beats wider than a line, so
    rows are packed into beats and results split into lines, with surplus lines past a
    row's end; each job must start only after the previous one's surplus has left. The
    jobs use ``blocks[0]`` to ``blocks[3]`` and must all be OK."""
    jobs = [row_job(opcode, 2, 20, 60, 60, addr=blocks[1], wide=True),
            row_job(opcode, 1, 100, 10, 40, addr=blocks[0]),
            row_job(opcode, 2, 9, 100, 100, addr=blocks[2], wide=True),
            row_job(opcode, 1, 70, 150, 200, addr=blocks[3], wide=True),
            row_job(opcode, 2, 33, 80, 30, addr=blocks[0])]
    errors = check_row_jobs(rng, sequencer_class, make_memory, jobs, data_width=256,
                            config=TINY.with_changes(lanes=64), timed=timed)
    assert errors == [0] * len(jobs)            # ErrorCode.OK


def mutant(module, old: str, new: str, shared=("KVOp",)):
    """A copy of ``module`` with one source edit (``old`` must occur exactly once); the
    names in ``shared`` stay the original's (enums the test bench encodes with)."""
    import importlib.util
    import inspect
    source = inspect.getsource(module)
    assert source.count(old) == 1, old
    spec = importlib.util.spec_from_loader(module.__name__ + "_mutant", loader=None)
    copy = importlib.util.module_from_spec(spec)
    exec(compile(source.replace(old, new), module.__file__, "exec"), copy.__dict__)
    copy.__dict__.update({name: getattr(module, name) for name in shared})
    return copy
