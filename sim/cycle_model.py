"""Cycle model of the draft engine: cycles per instruction from the engine configuration.

The model is the timing contract for the RTL (the co-simulation compares the two): an
in-order controller issues one instruction at a time; each unit streams its operands
from device memory at the configured bandwidth after the configured latency, and
overlaps that stream with its compute. All figures it produces are *modelled*.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from math import ceil, log2

from dfvg_hw.config import EngineConfig
from dfvg_hw.descriptors import REQUEST_HEADER_WORDS, RESULT_HEADER_WORDS, record_words
from dfvg_hw.image import ACT_PARAM_BYTES, ATTN_PARAM_BYTES, NORM_PARAM_BYTES, padded
from dfvg_hw.isa import Instruction, Op

__all__ = ["CycleModel", "CycleCounts"]


@dataclass
class CycleCounts:
    """Cycles of one run, in total and per unit (what the engine's counters report)."""
    total: int = 0
    by_op: dict = field(default_factory=dict)
    mem_bytes: int = 0
    macs: int = 0

    def add(self, op: Op | str, cycles: int, nbytes: int = 0, macs: int = 0):
        """Count ``cycles`` for an opcode, or for the bucket ``"REQUEST"`` (the request's own
        overhead), as the engine's per-unit counters do (``regmap.OP_CYCLE_BUCKETS``)."""
        name = op if isinstance(op, str) else op.name
        self.total += cycles
        self.by_op[name] = self.by_op.get(name, 0) + cycles
        self.mem_bytes += nbytes
        self.macs += macs


class CycleModel:
    """Cycles per instruction for one :class:`EngineConfig`.

    Members
    -------
    config : EngineConfig
    """

    ISSUE = 2          #: fetch + decode, not overlapped with the previous instruction
    RSQRT_LATENCY = 4  #: leading-one detect, shift, ROM, register
    DIV_LATENCY = 34   #: the sequential 32-bit reciprocal divider (1 bit per cycle + 2)
    EXP_LATENCY = 4    #: subtract, multiply, shift, ROM

    def __init__(self, config: EngineConfig):
        self.config = config
        self.latency = config.mem_latency_cycles
        self.bytes_per_cycle = config.engine_bytes_per_cycle
        # multiply, adder tree over `reduce`, accumulate, requantise (multiply, round, sat)
        self.matmul_pipe = 2 + ceil(log2(config.reduce)) + 1 + 3
        self.vector_pipe = 4

    def stream(self, nbytes: int) -> int:
        """Cycles to read ``nbytes`` of device memory as one burst, latency included."""
        return self.latency + ceil(nbytes / self.bytes_per_cycle) if nbytes else 0

    def instruction(self, ins: Instruction, *, pos: int = 0, topk: int = 1) -> tuple[int, int]:
        """(cycles, device-memory bytes) of one instruction; ``pos`` is the KV position."""
        c = self.config
        op = ins.opcode
        vec = lambda n: ceil(n / c.lanes)
        rows = max(ins.rows, 1)
        if op == Op.MATMUL:
            npad, kpad = padded(ins.n, c.lanes), padded(ins.k, c.reduce)
            nbytes = npad * kpad + 4 * npad
            # A wide (int16) row is two int8 digit rows computed side by side, so a pass
            # over the weights holds rows // 2 of them.
            passes = ceil(rows / (c.rows // 2)) if ins.wide else ceil(rows / c.rows)
            compute = (npad // c.lanes) * (kpad // c.reduce) * passes
            body = max(compute, ceil(nbytes / self.bytes_per_cycle))
            return self.ISSUE + self.latency + body + self.matmul_pipe, nbytes
        if op == Op.RMSNORM:
            nbytes = NORM_PARAM_BYTES + 2 * ins.n
            per_row = 2 * vec(ins.n) + self.RSQRT_LATENCY
            return self.ISSUE + max(self.stream(nbytes), vec(ins.n)) + rows * per_row + self.vector_pipe, nbytes
        if op == Op.ROPE:
            nbytes = 2 * ins.k
            return self.ISSUE + self.stream(nbytes) + rows * vec(ins.n * ins.k) + self.vector_pipe, nbytes
        if op == Op.KVAPPEND:
            return self.ISSUE + rows * 2 * ceil(ins.n * ins.k / c.reduce), 0
        if op == Op.ATTN:
            t = pos + 1
            per_head = (ceil(t / c.lanes) * ceil(ins.k / c.reduce)       # scores
                        + ceil(ins.k / c.lanes) * ceil(t / c.reduce)     # weighted sum of V
                        + self.EXP_LATENCY + self.DIV_LATENCY + self.matmul_pipe)
            return self.ISSUE + self.stream(ATTN_PARAM_BYTES) + rows * ins.n * per_head, ATTN_PARAM_BYTES
        if op == Op.ACTMUL:
            return (self.ISSUE + self.stream(ACT_PARAM_BYTES) + rows * vec(ins.n) + self.vector_pipe,
                    ACT_PARAM_BYTES)
        if op == Op.EMBED:
            nbytes = 2 * ins.n * rows
            return self.ISSUE + self.stream(nbytes) + self.vector_pipe, nbytes
        if op == Op.SAMPLE:
            # Each lane keeps a top-k list as the LOGITS matmul streams; the lists merge
            # one candidate per cycle, then exp, divide and select run over the k winners.
            out = 4 * record_words(c.topk_max)
            cycles = (self.ISSUE + c.lanes * topk + self.EXP_LATENCY + topk
                      + self.DIV_LATENCY + topk + ceil(out / self.bytes_per_cycle))
            return cycles, out
        return self.ISSUE, 0      # NOP, HALT, LOOP, ENDLOOP, BRANCH, NEXT

    @staticmethod
    def macs(ins: Instruction, *, pos: int = 0) -> int:
        """Multiply-accumulates of one instruction (matmuls and attention)."""
        if ins.opcode == Op.MATMUL:
            return max(ins.rows, 1) * ins.n * ins.k
        if ins.opcode == Op.ATTN:
            return 2 * max(ins.rows, 1) * ins.n * ins.k * (pos + 1)
        return 0

    def request_overhead(self, n_in: int) -> tuple[int, int]:
        """Reading the request descriptor and writing the result header."""
        req = 4 * (REQUEST_HEADER_WORDS + n_in)
        res = 4 * RESULT_HEADER_WORDS
        return self.stream(req) + ceil(res / self.bytes_per_cycle) + self.latency, req + res


def estimate_request(config: EngineConfig, program: list[int], *, n_in: int, n_draft: int,
                     start_pos: int, topk: int = 1) -> CycleCounts:
    """Modelled cycles of one request, walking the program's control flow without data.

    Timing does not depend on token values, so this equals the functional model's count
    for the same request shape (a test checks it).
    """
    from dfvg_hw.isa import decode
    from sim.controller import CONTROL_OPS, Sequencer

    model = CycleModel(config)
    counts = CycleCounts()
    cyc, nbytes = model.request_overhead(n_in)
    counts.add("REQUEST", cyc, nbytes)
    seq = Sequencer([0] * n_in, start_pos, n_draft)
    budget = (n_in + n_draft + 1) * len(program) * 256
    while not seq.halted and budget:
        budget -= 1
        ins = decode(program[seq.pc])
        counts.add(ins.opcode, *model.instruction(ins, pos=seq.pos, topk=topk),
                   macs=model.macs(ins, pos=seq.pos))
        if ins.opcode in CONTROL_OPS:
            seq.control(ins)
            continue
        if ins.opcode == Op.SAMPLE:
            seq.drafted(0)
        seq.pc += 1
    if not seq.halted:
        raise ValueError("program does not halt within the watchdog budget")
    return counts
