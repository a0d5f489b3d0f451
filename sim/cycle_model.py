"""Cycle model of the draft engine: the cycles the RTL takes, per instruction and per request.

The model is the timing contract for the RTL, and it is exact: each formula follows the
structure of one sequencer (its states, its per-row, per-head and per-beat loops, the
pipeline latencies of its units) and of the memory path (:class:`~dfvg_hw.memory_port.
MemoryPort` and the simulated memory of :mod:`sim.axi_memory`). The co-simulation tests
hold it to the RTL's per-unit ``OP_CYCLES`` counters cycle for cycle.

What a count covers is what the controller charges to a counter: ``FETCH`` + ``DECODE``
(2, :data:`ISSUE`), then every cycle until the next ``FETCH``; a unit instruction adds its
job hand-over and ``RETIRE`` (:data:`UNIT_OVERHEAD` in all). The ``"REQUEST"`` bucket is
the request's own work: the header and the token scan before the first instruction, and
after ``HALT`` the result descriptor assembled on chip and written out.

Memory symbols used below: ``L`` = ``mem_latency_cycles``, ``B`` = bytes per engine beat
(``mem_beat_bytes``: a beat of each of the ``mem_ports`` channels side by side), ``p`` =
beats per cycle each channel's memory delivers (``port_beats_per_cycle``). The channels
run in lockstep (:class:`~dfvg_hw.striped_memory_port.StripedMemoryPort`): the same
bursts, the same latency and rate on each, so the memory path is one port of ``B`` bytes
whose AXI 4 KiB pages are each channel's, i.e. logical pages of ``4096 · mem_ports``
bytes. A read command accepted in cycle ``c`` has its first beat in cycle
``c + READ_OVERHEAD + L``. Only MATMUL reads whole engine beats (``port``); every other
part reads one channel's beat ``D = mem_port_bits / 8`` at a time through the
:class:`~dfvg_hw.beat_narrower.BeatNarrower` (``unit_port``,
:meth:`~sim.timing_common.PortTiming.for_units`): the same first cycle, then the
``k = mem_ports`` pieces of each engine beat at most one a cycle. Timing does not depend on data, only on
instruction fields, addresses and the KV position. All figures it produces are
*modelled*.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from math import ceil

from dfvg_hw.spec import kv_timing as kvt
from dfvg_hw.spec import timing as tm
from dfvg_hw.spec.config import EngineConfig
from dfvg_hw.spec.descriptors import REQUEST_HEADER_WORDS, RESULT_HEADER_WORDS, record_words, watchdog_budget
from dfvg_hw.spec.image import (ACT_PARAM_BYTES, ATTN_PARAM_BYTES, NORM_PARAM_BYTES, padded,
                                requant_record_bytes, weight_area_bytes)
from dfvg_hw.spec.isa import Instruction, MatmulMode, Op
from sim.attention_timing import attn_cycles, attn_job_cycles, compaction_cycles, kvappend_cycles
from sim.sample_timing import tree_sample_cycles
from sim.elementwise_timing import (actmul_cycles, rmsnorm_cycles, rmsnorm_gamma_reads,
                                    rmsnorm_gamma_taken, rope_cycles)
from sim.matmul_timing import matmul_cycles, ReadPath
from sim.timing_common import READ_OVERHEAD, RES_BYTES, UNIT_OVERHEAD, LineSplitter, PortTiming

__all__ = ["CycleModel", "CycleCounts", "PrefetchChain", "TreeTiming", "estimate_request", "BEFORE_FINISH", "ISSUE",
           "UNIT_OVERHEAD", "SPLIT_OPS"]

#: The latencies and fixed overheads below are the RTL's own (:mod:`dfvg_hw.spec.timing`).
ISSUE, BEFORE_FINISH = tm.ISSUE, tm.BEFORE_FINISH
#: The opcodes a tree forward runs as one single-row job per row (controller.py).
SPLIT_OPS = (Op.EMBED, Op.RMSNORM, Op.ROPE, Op.KVAPPEND, Op.ATTN, Op.ACTMUL)
#: Instruction prices a :class:`CycleModel` keeps (a few MB; the keys include the KV
#: position, so a long generation would otherwise keep one per instruction and position)
PRICES_KEPT = 1 << 15


@dataclass(frozen=True)
class TreeTiming:
    """What prices a tree request's instructions (docs/isa.md §9.5).

    Members
    -------
    width : int
        The tree's width ``W``.
    level : int
        The level a tree forward feeds (0: an input forward).
    base : int
        ``P0``, the position after the last input.
    pitch : int
        The VMEM row pitch in bytes.
    sources : int
        Rows of the logit buffer a SAMPLE reads (1 in the last input forward, ``W`` after).
    sampled : bool
        Whether the request samples (the expansion then needs no candidate selection).
    """
    width: int
    level: int
    base: int
    pitch: int
    sources: int
    sampled: bool


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


# -- the model ---------------------------------------------------------------------------------
class CycleModel:
    """Cycles per instruction and per request for one :class:`EngineConfig`.

    Members
    -------
    config : EngineConfig
    port : the wide memory path's timing (latency, engine beat, beats per cycle): MATMUL's
    unit_port : the narrow path's (one channel's beat): every other part's
    """

    def __init__(self, config: EngineConfig):
        self.config = config
        self.port = PortTiming.for_config(config)
        self.unit_port = PortTiming.for_units(config)
        # Timing depends on no data (the module docstring), so a price is kept by its
        # arguments: a program prices the same instructions request after request.
        self._priced: dict[tuple, object] = {}

    def _read(self, nbytes: int, offset: int) -> int:
        """A read state pair (command, data) of ``nbytes`` at ``offset`` bytes into a
        4 KiB-aligned region (the request's), consumed as they come."""
        port = self.unit_port.at(offset)
        return (tm.REQUEST_READ_CMD + READ_OVERHEAD + port.latency
                + port.beat_offset(ceil(nbytes / port.bus_bytes) - 1))

    def instruction(self, ins: Instruction, *, pos: int = 0, topk: int = 1, addr: int | None = None,
                    token_from_request: bool = True, tree: TreeTiming | None = None,
                    head: int = 0) -> tuple[int, int]:
        """(cycles, device-memory bytes read) of one instruction.

        ``pos`` is the KV position, ``addr`` the resolved device address of the
        instruction's block (image base + ``addr`` + the layer offset; by default
        ``ins.addr``, i.e. an image at a 4 KiB-aligned base), ``token_from_request``
        whether EMBED's token comes from the request (read from memory) rather than from
        the sampler, ``tree`` the tree request's shape where there is one, ``head`` a
        MATMUL's prefetch head start (:meth:`prefetch_head`; 0: not prefetched).
        """
        key = (ins, pos, topk, addr, token_from_request, tree, head)
        price = self._priced.get(key)
        if price is None:
            self._keep_room()
            price = self._priced[key] = self._price(ins, pos, topk, addr, token_from_request, tree, head)
        return price

    def _price(self, ins: Instruction, pos: int, topk: int, addr: int | None, token_from_request: bool,
               tree: TreeTiming | None, head: int) -> tuple[int, int]:
        c, port, unit_port = self.config, self.port, self.unit_port
        op = ins.opcode
        addr = ins.addr if addr is None else addr
        if tree is not None and op == Op.SAMPLE:
            return tree_sample_cycles(c, ins.n, topk, tree.sources, tree.width, tree.sampled), 0
        if tree is not None and tree.level and op in SPLIT_OPS and (ins.rows == 1 or tree.pitch):
            return self._tree_rows(ins, tree, pos, addr)
        rows = max(ins.rows, 1)
        if op == Op.MATMUL:
            npad = padded(ins.n, c.lanes)
            # a tree forward's rows lie the request's pitch apart (docs/isa.md §9.2)
            pitch = tree.pitch if tree is not None and tree.level else 0
            cycles = matmul_cycles(port, c.lanes, c.reduce, c.rows, ins.n, ins.k, rows,
                                    int(ins.mode), bool(ins.wide), addr % port.page,
                                    ins.dst if ins.mode == MatmulMode.RESADD else 0, pitch,
                                    ins.bias, ins.blocks, head, ins.out16)
            return cycles, (weight_area_bytes(ins.n, ins.k, c.lanes, c.reduce, ins.blocks)
                            + requant_record_bytes(c.lanes, ins.bias) * (npad // c.lanes))
        if op == Op.RMSNORM:
            # k ≥ 2 segments (QK-norm heads) run as rows of their own; gamma is read once
            # when the gamma buffer keeps it, else once per row
            segment_rows = rows * max(ins.k, 1)
            return (rmsnorm_cycles(unit_port, c.lanes, ins.n, segment_rows, bool(ins.wide), addr),
                    NORM_PARAM_BYTES + rmsnorm_gamma_reads(c.lanes, ins.n, segment_rows, c.vmem_line_bytes) * 2 * ins.n)
        if op == Op.ROPE:
            return rope_cycles(unit_port, ins.n, ins.k, rows, addr, pos, bool(ins.wide)), 2 * ins.k
        if op == Op.KVAPPEND:
            return kvappend_cycles(c, ins.n, ins.k, ins.src, bool(ins.wide)), 0
        if op == Op.ATTN:
            return (attn_cycles(unit_port, c, ins.n, ins.k, ins.src, ins.dst, pos, bool(ins.wide), addr,
                                ins.in16),
                    ATTN_PARAM_BYTES)
        if op == Op.ACTMUL:
            segments = max(ins.k, 1)        # one parameter block per channel segment
            return (actmul_cycles(unit_port, c.lanes, ins.n, rows, bool(ins.wide), addr,
                                  ungated=bool(ins.ungated), segments=segments, rowexp=ins.rowexp,
                                  in16=ins.in16),
                    ACT_PARAM_BYTES * segments)
        if op == Op.EMBED:
            # POSITION indexes the table by POS: no token to read
            return self._embed(ins.n, token_from_request and not ins.position, addr)
        if op == Op.SAMPLE:
            return self._sample(ins.n, topk), 0
        return ISSUE, 0      # NOP, HALT, LOOP, ENDLOOP, BRANCH, NEXT

    def prefetch_at(self, ins: Instruction, *, addr: int | None = None) -> int | None:
        """The cycle, from this unit instruction's FETCH, in which the controller hands the
        next instruction, when it is a MATMUL, to the MATMUL sequencer as a prefetch
        (controller.py): the cycle after the memory port gave the unit's last read beat
        (the unit says ``reads_done`` once its last read command is out; the port is then
        read-idle, :data:`~dfvg_hw.spec.timing.PREFETCH_IDLE`). ATTN and ACTMUL say so
        (their parameter blocks are their only reads, taken as they come), and a one-row
        RMSNORM whose row fits the row buffer, where gamma beats are whole lines, the
        cycle after its gamma reader gave the last line
        (:func:`~sim.elementwise_timing.rmsnorm_gamma_taken`); the others give no
        prefetch (None). Chain forwards only: the caller checks that."""
        key = ("prefetch_at", ins, addr)
        if key not in self._priced:
            self._keep_room()
            self._priced[key] = self._prefetch_cycle(ins, ins.addr if addr is None else addr)
        return self._priced[key]

    def _keep_room(self) -> None:
        if len(self._priced) >= PRICES_KEPT:
            self._priced.clear()

    def _prefetch_cycle(self, ins: Instruction, addr: int) -> int | None:
        c, op = self.config, ins.opcode
        port = self.unit_port
        if op == Op.RMSNORM:
            if (ins.rows * max(ins.k, 1) != 1 or ins.n == 0
                    or ins.n > tm.norm_row_buffer_beats(c.lanes) * c.lanes):
                return None
            taken = rmsnorm_gamma_taken(port, c.lanes, ins.n, bool(ins.wide), addr)
            return None if taken is None else ISSUE + taken + 1
        if op == Op.ATTN:
            # the block's read goes out from CHECK, through the BlockReader's command register
            nbytes = ATTN_PARAM_BYTES
            first = kvt.ATTN_CHECK + tm.READER_CMD_REGISTER
        elif op == Op.ACTMUL:
            nbytes = max(ins.k, 1) * ACT_PARAM_BYTES
            port = port.with_line(tm.actmul_param_line(port.line, port.bus_bytes))
            first = tm.PARAM_CMD
        else:
            return None
        port = port.at(addr)
        first += READ_OVERHEAD + port.latency          # the read's first beat on the port
        last = ceil((addr % port.bus_bytes + nbytes) / port.bus_bytes) - 1
        # the reader's gearbox takes a beat as it takes the beat's first line
        taken = port.arrival(last * port.lines_per_beat, first) - tm.GEARBOX_LATENCY
        return ISSUE + taken + tm.PREFETCH_IDLE

    @staticmethod
    def prefetch_head(at: int | None, cycles: int) -> int:
        """A MATMUL's head start: the cycles its first read command comes before its PASS,
        when the unit instruction before it (``cycles`` long) gave the prefetch in cycle
        ``at`` from its FETCH (:meth:`prefetch_at`); 0 when it gave none, or not while it
        ran (its RUN state ends the cycle before RETIRE)."""
        if at is None or at > cycles - tm.RETIRE - 1:
            return 0
        return cycles - (at + tm.PREFETCH_FIRST_READ) + tm.MATMUL_PASS_FROM_FETCH

    def _tree_rows(self, ins: Instruction, tree: TreeTiming, pos: int, addr: int) -> tuple[int, int]:
        """A tree forward's EMBED, RMSNORM, ROPE, KVAPPEND, ATTN or ACTMUL (controller.py):
        one single-row job per row, row ``r``'s ``src`` and ``dst`` ``r · pitch`` on, each
        the unit's own cost; the controller's FETCH, DECODE and RETIRE once, and a
        hand-over per job. EMBED embeds the row's node (no token read); ATTN attends to
        the ``P0`` committed positions and the row's path of ``level`` entries."""
        c, op = self.config, ins.opcode
        lines = tree.pitch // c.vmem_line_bytes
        costs = []
        for r in range(ins.rows):
            row = replace(ins, rows=1, src=ins.src + r * lines, dst=ins.dst + r * lines)
            if op == Op.EMBED:
                costs.append(self._embed(ins.n, False, addr))
            elif op == Op.KVAPPEND:
                costs.append((kvappend_cycles(c, ins.n, ins.k, row.src, bool(ins.wide)), 0))
            elif op == Op.ATTN:
                costs.append((attn_job_cycles(self.unit_port, c, ins.n, ins.k, row.src, row.dst, tree.base,
                                              tree.level, bool(ins.wide), addr, ins.in16), ATTN_PARAM_BYTES))
            else:
                costs.append(self.instruction(row, pos=pos, addr=addr))
        cycles = (UNIT_OVERHEAD + sum(cost - UNIT_OVERHEAD for cost, _ in costs)
                  + (len(costs) - 1) * tm.TREE_ROW_HANDOVER)
        return cycles, sum(nbytes for _, nbytes in costs)

    def compaction(self, levels: int, slots: int) -> int:
        """Cycles of a request's compaction (docs/isa.md §9.3): the controller's hand-over,
        then the KV sequencer's copies, before the program."""
        return tm.COMPACT_HANDOVER + compaction_cycles(self.config, levels, slots)

    def _embed(self, n: int, token_from_request: bool, addr: int = 0) -> tuple[int, int]:
        """controller.py EMBED_*: read the token (one beat) if it comes from the request,
        open the VMEM span, read the row and write it a line a cycle. Rows are a whole
        number of engine beats apart (``embed_row_stride``), so the row's timing does not
        depend on the token, only on where the table ``addr`` starts in an engine beat (a
        page boundary inside the row splits its burst, which costs nothing: the next
        burst is issued long before its data is due)."""
        port = self.unit_port.at(addr)
        row = RES_BYTES * n                         # an int32 row
        lines = ceil(row / port.line)
        token = tm.EMBED_TOKEN + (READ_OVERHEAD + port.latency if token_from_request else 0)
        if n == 0:
            # An empty row: the zero-length read is a no-op (memory_port.py) and the
            # empty span's wr_done, VMEM_CHECK_LATENCY after EMBED_CMD, ends ROW.
            data = max(1, tm.VMEM_CHECK_LATENCY + 1 - tm.EMBED_COMMANDS)
        elif port.beats_per_cycle >= 1 and port.pieces == 1:
            data = READ_OVERHEAD + port.latency + tm.GEARBOX_LATENCY + lines
        elif port.pieces > 1:
            # the narrower's pieces into the line gearbox, a line a cycle
            data = READ_OVERHEAD + port.latency + port.arrival(lines - 1, 0) + 1
        else:
            splitter = LineSplitter(port.lines_per_beat)
            last_beat = ReadPath(port).read(0, row, splitter)
            data = last_beat + tm.GEARBOX_LATENCY + (lines - 1) % port.lines_per_beat + 1
        nbytes = row + (port.bus_bytes if token_from_request else 0)
        # FETCH + DECODE, the token, EMBED_CMD, EMBED_READ, the row, RETIRE
        return ISSUE + token + tm.EMBED_COMMANDS + data + tm.RETIRE, nbytes

    def _sample(self, n: int, topk: int) -> int:
        """sample_sequencer.py + token_sampler.py: the logit buffer streams a tile a cycle into the
        lanes' top-k lists, which merge one candidate a cycle; then exp, the divider and
        the probabilities over the k winners, and the record a word a cycle into the
        result RAM."""
        c = self.config
        k = min(max(topk, 1), c.topk_max)
        k_eff = min(k, n)
        return (ISSUE + tm.SAMPLE_START + ceil(n / c.lanes) + tm.sampler_latency(c.lanes, k, k_eff)
                + record_words(c.topk_max) + tm.RETIRE)

    def request_start(self, n_in: int) -> tuple[int, int]:
        """(cycles, bytes) before the first instruction: the header and the token scan."""
        (c0, b0), (c1, b1) = self.request_header(), self.request_scan(n_in)
        return c0 + c1, b0 + b1

    def request_header(self) -> tuple[int, int]:
        """(cycles, bytes) of the header's read and check (all a request refused for a
        header field costs before its result: request_front_end.py scans no tokens)."""
        header = 4 * REQUEST_HEADER_WORDS
        return self._read(header, 0) + tm.REQUEST_READ_DONE, header

    def request_scan(self, n_in: int) -> tuple[int, int]:
        """(cycles, bytes) of the token scan, after a header that passed its checks."""
        scan = 4 * n_in
        return self._read(scan, 4 * REQUEST_HEADER_WORDS) + tm.REQUEST_READ_DONE, scan

    def request_finish(self, n_records: int) -> tuple[int, int]:
        """(cycles, bytes) after HALT: the result header assembled a word a cycle, every
        word read from the result RAM and packed (2 cycles), sent a beat a cycle, then the
        write response. The result's own cycle count stops :data:`BEFORE_FINISH` cycles
        in; the counters take all of them."""
        words = RESULT_HEADER_WORDS + n_records * record_words(self.config.topk_max)
        per_beat = self.unit_port.bus_bytes // 4
        cycles = (tm.RESULT_PRELUDE + RESULT_HEADER_WORDS + tm.RESULT_CMD
                  + tm.RESULT_WORD_CYCLES * words + ceil(words / per_beat) + tm.RESULT_DATA_EXIT
                  + self.unit_port.latency + tm.RESULT_WAIT)
        return cycles, 4 * words

    @staticmethod
    def macs(ins: Instruction, *, pos: int = 0) -> int:
        """Multiply-accumulates of one instruction (matmuls and attention)."""
        if ins.opcode == Op.MATMUL:
            return max(ins.rows, 1) * ins.n * ins.k
        if ins.opcode == Op.ATTN:
            return 2 * max(ins.rows, 1) * ins.n * ins.k * (pos + 1)     # a tree row: its path's length
        return 0


class PrefetchChain:
    """The MATMUL prefetch from one instruction of a request to the next, as the functional
    model and :func:`estimate_request` walk the program: :meth:`head` is a MATMUL's head
    start, :meth:`ran` records what the instruction just priced gives the next one."""

    def __init__(self, model: CycleModel):
        self.model = model
        self._given: tuple[int | None, int] | None = None    # (prefetch_at, cycles) of the last

    def head(self, ins: Instruction) -> int:
        """``ins``'s head start (:meth:`CycleModel.prefetch_head`): 0 but for a MATMUL that
        the instruction before it prefetched."""
        if self._given is None or ins.opcode != Op.MATMUL:
            return 0
        return self.model.prefetch_head(*self._given)

    def ran(self, ins: Instruction, cycles: int, *, addr: int, tree_forward: bool) -> None:
        """``ins`` took ``cycles``; only a chain forward's unit instruction prefetches the
        MATMUL after it (controller.py)."""
        self._given = None if tree_forward else (self.model.prefetch_at(ins, addr=addr), cycles)


def estimate_request(config: EngineConfig, program: list[int], *, n_in: int, n_draft: int,
                     start_pos: int, topk: int = 1, image_base: int = 0, tree_width: int = 0,
                     tree_pc: int = 0, row_pitch: int = 0, sample: bool = False,
                     compaction: tuple[int, int] = (0, 0)) -> CycleCounts:
    """Modelled cycles of one request, walking the program's control flow without data.

    Timing does not depend on token values, so this equals the functional model's count
    for the same request shape (a test checks it). A tree request (``tree_width`` ≥ 1,
    docs/isa.md §9) is priced level by level; ``compaction`` is its (levels, slots).
    """
    from dfvg_hw.spec.isa import decode
    from sim.program_flow import CONTROL_OPS, ProgramFlow

    model = CycleModel(config)
    counts = CycleCounts()
    counts.add("REQUEST", *model.request_start(n_in))
    if compaction[0]:
        counts.add("REQUEST", model.compaction(*compaction))
    seq = ProgramFlow([0] * n_in, start_pos, n_draft, tree_width=tree_width, tree_pc=tree_pc)
    budget = watchdog_budget(n_in, n_draft, len(program))
    sources, records = 1, 0
    prefetch = PrefetchChain(model)
    while not seq.halted and budget:
        budget -= 1
        ins = decode(program[seq.pc])
        tree = None
        if tree_width:
            tree = TreeTiming(tree_width, seq.tree_level, seq.tree_base, 16 * row_pitch, sources, sample)
        addr = seq.block_address(ins, image_base)
        cycles, nbytes = model.instruction(ins, pos=seq.pos, topk=topk, addr=addr,
                                           token_from_request=not seq.token_is_drafted, tree=tree,
                                           head=prefetch.head(ins))
        counts.add(ins.opcode, cycles, nbytes, macs=model.macs(ins, pos=seq.pos))
        prefetch.ran(ins, cycles, addr=addr, tree_forward=seq.tree_forward)
        if ins.opcode in CONTROL_OPS:
            seq.control(ins)
            continue
        if ins.opcode == Op.MATMUL and ins.mode == MatmulMode.LOGITS:
            sources = ins.rows
        if ins.opcode == Op.SAMPLE:
            seq.drafted(0)
            records += max(tree_width, 1)
        seq.pc += 1
    if not seq.halted:
        raise ValueError("program does not halt within the watchdog budget")
    counts.add("REQUEST", *model.request_finish(records))
    return counts
