"""Latencies and fixed overheads of the engine's RTL blocks, each written once.

The RTL classes take their constants from here (``LATENCY = timing.REQUANT_LATENCY``) and
the cycle model (:mod:`sim.cycle_model`, docs/isa.md §8) builds its per-unit formulas
from the same names, so a number that changes in the hardware changes in the model.

Two kinds of numbers live here:

* **Pipeline latencies** of units (``*_LATENCY``): clock edges from the edge that accepts
  an input to the edge after which its output is valid, with the output ready. Most are
  structural — they emerge from the registers a block has — and the unit tests under
  ``tests/rtl/`` measure each one against the constant (``test_requant``,
  ``test_elementwise``, ``test_rmsnorm``, ``test_rope``, ``test_attention``,
  ``test_matrix``, ``test_vmem``, ``test_kv_buffer``, ``test_memory_port``).
* **Sequencer overheads**: cycles a sequencer's FSM spends in fixed states (a command
  state, a check, ``DONE``) around its data-dependent loops. They are named after the
  states they count; the co-simulation tests (every ``OP_CYCLES`` counter, cycle model
  against RTL) prove them.

numpy/stdlib only, like the rest of :mod:`dfvg_hw.spec`.
"""

from __future__ import annotations

from dfvg_hw.spec import numerics as nx
from dfvg_hw.spec.config import ConfigError
from dfvg_hw.spec.image import requant_record_bytes


def ceil_log2(x: int) -> int:
    """``ceil(log2 x)`` for ``x ≥ 1`` (0 for 1): the levels of a binary tree over ``x``."""
    return (x - 1).bit_length()


# -- memory path: dfvg_hw/memory_port.py, the AXI4 bus ------------------------------------------
#: MemoryPort: edges from accepting a read command to its first ``read_data`` beat beyond the
#: memory's own latency L (splitter register, AR register, read_data register).
MEM_READ_OVERHEAD = 3
#: MemoryPort: edges from accepting a write command to its first W transfer (splitter, AW
#: register and track, track FIFO output register, W register).
MEM_WRITE_OVERHEAD = 4
#: MemoryPort: bursts per direction in flight (the burst-track FIFO's depth).
MEM_MAX_OUTSTANDING = 8
#: AXI4 INCR: beats per burst at most (the memory port splits longer reads; dfvg_hw.axi4).
AXI_MAX_BURST_BEATS = 256
#: AXI4: a burst never crosses this many bytes (dfvg_hw.axi4's BOUNDARY_BYTES).
AXI_BOUNDARY_BYTES = 4096

# -- VMEM and the line streams: dfvg_hw/vmem.py, line_streams.py, operand_access.py ----------
#: VectorMemory: cycles from a span read command's transfer to its first valid line.
VMEM_READ_LATENCY = 3
#: VectorMemory: cycles from a span command's transfer to ``error`` (refused) or ``wr``
#: ready (accepted).
VMEM_CHECK_LATENCY = 2
#: Gearbox: cycles from the input beat that completes an output beat to that output beat
#: (its output register); the beat-to-lines split behind the memory port adds this.
GEARBOX_LATENCY = 1
#: VmemWindow: ``done`` pulses ``lines + WINDOW_DONE_AFTER`` cycles after a gather's or
#: scatter's command transfer (a gather's last line arrives the cycle after its peek).
WINDOW_DONE_AFTER = 2
#: A sequencer's gather or scatter through VmemWindow: its request state, then ``done``.
WINDOW_ACCESS = 1 + WINDOW_DONE_AFTER
#: UnalignedReader: its command register between a sequencer's request and the memory
#: port's ``read_cmd``.
READER_CMD_REGISTER = 1
#: LineAligner: its output register (a line leaves the cycle after it is cut).
LINE_ALIGNER_LATENCY = 1
#: BlockReader: cycles past the memory port's first beat of a block: the beat into the
#: block register, then ``done``.
BLOCK_READ_DONE = 2

# -- units: requant.py, elementwise.py, rmsnorm.py, rope.py, attention.py, matrix.py ----------
#: Requantizer: multiply, add the rounding half and shift, saturate.
REQUANT_LATENCY = 3
#: VectorRequantizer: ``lanes`` Requantizers in lockstep.
VECTOR_REQUANT_LATENCY = REQUANT_LATENCY
#: ActMul: the gate's table read and the ``· up`` product, then the VectorRequantizer.
ACTMUL_LATENCY = 2 + VECTOR_REQUANT_LATENCY
#: ActMul: SiLU table entries, loaded at every ACTMUL.
ACTMUL_LUT_DEPTH = 256
#: ActMul: table entries written together (one 16-byte word of int16s, a 16-byte line of
#: the parameter block whatever the VMEM line), so
#: the table loads in ``ACTMUL_LUT_DEPTH / ACTMUL_LUT_WRITE_ENTRIES`` writes, a line a cycle.
ACTMUL_LUT_WRITE_ENTRIES = 8
#: ActMul: the table's writes (words of :data:`ACTMUL_LUT_WRITE_ENTRIES` entries).
ACTMUL_LUT_WORDS = ACTMUL_LUT_DEPTH // ACTMUL_LUT_WRITE_ENTRIES
#: ActMul: table words written a cycle at most (its table banks per lane).
ACTMUL_LUT_BANKS = 4


def actmul_param_line(vmem_line_bytes: int, bus_bytes: int) -> int:
    """Bytes of the lines ActMulSequencer reads the ACTMUL parameter blocks in, a line a
    cycle: a VMEM line, but at most a bus beat and :data:`ACTMUL_LUT_BANKS` table words."""
    return min(vmem_line_bytes, bus_bytes, ACTMUL_LUT_BANKS * 2 * ACTMUL_LUT_WRITE_ENTRIES)
#: Rsqrt: the LUT index, the ROM read, the interpolation and the output register.
RSQRT_LATENCY = 4
#: RMSNorm: the register after the ``x >> p`` barrel shifter that cuts an int32 residual to
#: int16 (passes 1 and 2, ahead of the squarers and the gamma products).
RMSNORM_SHIFT_STAGE = 1
#: RMSNorm pass 2: the shift, the gamma product, then the VectorRequantizer.
RMSNORM_LATENCY = RMSNORM_SHIFT_STAGE + 1 + VECTOR_REQUANT_LATENCY
#: RMSNorm: from the edge that takes a row's last pass-0 beat to the first edge that can
#: take a pass-1 beat (the row's OR register, then the leading-one detector's ``p``).
RMSNORM_SHIFT_TURNAROUND = 2
#: Rope: four products, the two sums, the shift and clamp.
ROPE_LATENCY = 3
#: SoftmaxExp: subtract, multiply, rounding shift into the EXP2 ROM, shift.
SOFTMAX_EXP_LATENCY = 4
#: Normalizer: the attention output's scaling on a VectorRequantizer.
NORMALIZER_LATENCY = VECTOR_REQUANT_LATENCY
#: MatrixUnit: adder-tree stages between the products and the accumulator.
MATRIX_TREE_STAGES = 3
#: MatrixUnit: pipeline advances from a tile's take to its accumulation (S0, S1, the tree).
MATRIX_ACC_STAGES = 1 + 1 + MATRIX_TREE_STAGES
#: MatrixUnit: a group's ``last`` tile to its first output row (the accumulate stage, the
#: requantiser and the output stage after :data:`MATRIX_ACC_STAGES`).
MATRIX_LATENCY = MATRIX_ACC_STAGES + 1 + REQUANT_LATENCY + 1
#: KVBuffer: cycles from a read request's transfer to its channel's first valid beat.
KV_READ_LATENCY = 3


def rmsnorm_turnaround(lanes: int) -> int:
    """RMSNorm's ``TURNAROUND``: from the edge that takes a row's last pass-1 beat to the
    first edge that can take a pass-2 beat (shift, square, adder tree, accumulate, rsqrt)."""
    return RMSNORM_SHIFT_STAGE + 2 + ceil_log2(lanes) + RSQRT_LATENCY


def softmax_load_to_emit(lanes: int) -> int:
    """SoftmaxWeights' ``LOAD_TO_EMIT``: from the edge that takes a vector's last score beat
    to its first valid weight beat (buffer write, maximum tree, phase, exp path)."""
    return 3 + ceil_log2(lanes) + SOFTMAX_EXP_LATENCY


def reciprocal_latency(dividend_log2: int, min_divisor_log2: int = 0) -> int:
    """Reciprocal (a restoring divider of ``2^dividend_log2``): the load cycle, then one
    quotient bit a cycle over the dividend's ``dividend_log2 + 1`` bits, less the
    ``min_divisor_log2`` leading quotient bits that a divisor ``≥ 2^min_divisor_log2``
    makes 0."""
    return dividend_log2 + 2 - min_divisor_log2


#: Reciprocal of the attention weights' sum, ``floor(2^RECIP_BITS / E)``, ``E ≥ EXP_ONE``.
ATTN_RECIP_LATENCY = reciprocal_latency(nx.RECIP_BITS, nx.EXP_ONE.bit_length() - 1)
#: Attention: the per-head path from a score to its V row beyond the dot-product tree: the
#: maximum and phase, the first weight read, the exp path, the V join.
ATTN_SCORE_TO_V = 1 + 1 + SOFTMAX_EXP_LATENCY + 1
#: Attention: the query's and the accumulator's registers (one each) of a head.
ATTN_MAC_STAGES = 2


def attention_head_cycles(head_dim: int, t: int) -> int:
    """Attention: edges from accepting ``q`` to a valid output for ``t`` K/V rows with the
    streams ready (one KV row a cycle): K rows, tree, score-to-V path, the other ``t − 1``
    weights, then :data:`ATTN_MAC_STAGES`, the reciprocal and the normaliser."""
    return (2 * t - 1 + ceil_log2(head_dim) + ATTN_SCORE_TO_V + ATTN_MAC_STAGES
            + ATTN_RECIP_LATENCY + NORMALIZER_LATENCY)


# -- sampler: token_sampler.py, sample_sequencer.py ----------------------------------------------
#: TokenSampler: the exp pipeline after the last issue (product, shift, ROM, accumulate).
SAMPLER_EXP_LATENCY = 4
#: TokenSampler: the restoring divider, one quotient bit of ``R ≤ 2^PROB_BITS`` a cycle.
SAMPLER_DIV_CYCLES = nx.PROB_BITS + 1
#: Rng32: stages of the draw's mixing pipeline.
RNG_LATENCY = 7


def sampler_latency(lanes: int, k: int, k_eff: int) -> int:
    """TokenSampler: cycles from the edge that takes the last logit beat to ``o.valid``
    for ``k_eff ≥ 1`` winners of a top-``k``: the lane lists merged a candidate a cycle
    (``lanes > 1``), the exp pipeline over the winners, the divider, their probabilities
    (``k_eff > 1``) and the output register."""
    merge = lanes * k if lanes > 1 else 0
    prob = k_eff + 1 if k_eff > 1 else 0
    return merge + k_eff + SAMPLER_EXP_LATENCY + SAMPLER_DIV_CYCLES + prob + 1


#: SAMPLE: the controller's SAMPLE_REQ and the sampler's request before the logit buffer
#: streams its first tile.
SAMPLE_START = 2

# SAMPLE: tree rows and expansion (sample_sequencer.py, tree_expander.py)
#: A tree SAMPLE's request cycle (SAMPLE_REQ): the sequencer takes the level and checks it
#: before the first pass's request to the sampler.
TREE_SAMPLE_ACCEPT = 1
#: A refused tree SAMPLE (a greedy level with fewer candidates than rows): SAMPLE_REQ,
#: then the cycle the controller sees ``error`` and faults.
TREE_SAMPLE_REFUSED = 2
#: TreeExpander: after the last pass's list is taken, its last candidate's score register
#: before it enters the list (the first record word follows in the next cycle).
TREE_PICK_SETTLE = 1

# -- controller: dfvg_hw/controller.py -------------------------------------------------------------
#: FETCH + DECODE: charged at DECODE; a control instruction costs just this.
ISSUE = 2
#: ``<UNIT>_JOB``: the job's hand-over to a unit sequencer.
JOB_HANDOVER = 1
#: RETIRE: the state after a unit instruction or EMBED, before the next FETCH.
RETIRE = 1
#: What the controller adds to a unit sequencer's own cycles.
UNIT_OVERHEAD = ISSUE + JOB_HANDOVER + RETIRE
#: Cycles of the request's finish before FINISH, where the result's cycle count is taken
#: (the FETCH that finds the request over).
BEFORE_FINISH = 1
#: EMBED_TOKEN: one state, then (for an input token: not a drafted one, nor with POSITION)
#: the memory read of its beat.
EMBED_TOKEN = 1
#: EMBED_CMD + EMBED_READ: the VMEM write span, then the row's read command.
EMBED_COMMANDS = 2
#: HEADER_CMD / SCAN_CMD: the command state of each of the request's two reads.
REQUEST_READ_CMD = 1
#: HEADER_CHECK / SCAN_DONE: one state after each of the request's two reads.
REQUEST_READ_DONE = 1
#: The FETCH that finds the request over, FINISH and DRAIN, before RESULT.
RESULT_PRELUDE = 3
#: RESULT_CMD: the result descriptor's write command.
RESULT_CMD = 1
#: RESULT_DATA: each result word read from the result RAM, then packed into its beat.
RESULT_WORD_CYCLES = 2
#: RESULT_DATA's last cycle (every beat sent), then RESULT_WAIT beyond the memory's write
#: latency L: the write response, and REPORT.
RESULT_DATA_EXIT = 1
RESULT_WAIT = 2

# -- unit sequencers ----------------------------------------------------------------------------
#: A read-stream sequencer's (RMSNORM, ACTMUL) parameter read: its command state, then the
#: UnalignedReader's command register, before the memory port's own overhead.
PARAM_CMD = 1 + READER_CMD_REGISTER
#: A row sequencer's (RMSNORM, ACTMUL) DONE, after FINISH has seen the rows count and
#: VMEM's ``wr_done`` (RowWriteProgress).
ROW_JOB_DONE = 1

#: NormSequencer: CHECK, WRITE_CMD, then PASS0_CMD after the head line, where the head is
#: read and checked first (``n = 0``, or a fault the instruction shows; else an early start).
NORM_HEAD_TO_GAMMA = 3
#: NormSequencer, an early start: from the cycle IDLE takes the job to row 0's PASS0_CMD
#: (HEAD_CMD between), while the head is read.
NORM_EARLY_PASS0 = 2
#: NormSequencer, an early start: from the head's line to the first cycle row 0's pass 1
#: can go (a replayed beat taken, or PASS1_CMD): the head's line registered, gamma_shift
#: checked (pass 1 samples eps).
NORM_HEAD_CHECK = 2
#: NormSequencer: a pass's command state (PASS0_CMD, PASS1_CMD, PASS2_CMD), VMEM's read
#: latency and the line-to-beat Gearbox: from the cycle before PASS0_CMD to a row's first
#: pass-0 beat, and
#: from a pass's last beat to the next pass's first (RMSNORM_SHIFT_TURNAROUND hides in it).
NORM_PASS_START = 1 + VMEM_READ_LATENCY + GEARBOX_LATENCY
#: NormSequencer: bytes of its row buffer (pass 0's int32 x beats, replayed a beat a cycle
#: for passes 1 and 2 of a row that fits; a longer row reads VMEM three times).
NORM_ROW_BUFFER_BYTES = 16384


def norm_row_buffer_beats(lanes: int) -> int:
    """The NormSequencer row buffer's depth in x beats of ``4·lanes`` bytes."""
    return max(1, NORM_ROW_BUFFER_BYTES // (4 * lanes))


#: NormSequencer: bytes of its gamma buffer. A job's gamma of at most this many bytes
#: (256 elements: a QK-norm head) whose rows fit the row buffer is read once, kept as the
#: first row's pass 2 takes it, and replayed from the buffer for every later row (segment).
NORM_GAMMA_BUFFER_BYTES = 512


def norm_gamma_buffer_beats(lanes: int) -> int:
    """The NormSequencer gamma buffer's depth in gamma beats of ``2·lanes`` bytes."""
    return max(1, NORM_GAMMA_BUFFER_BYTES // (2 * lanes))


#: NormSequencer on a port slower than a line a cycle: the lines of a gamma read its
#: UnalignedReader holds while pass 2 holds the gamma Gearbox back (the memory port's
#: read_data register, the beat-to-lines Gearbox, the LineAligner's held line and its output
#: register) before it holds the memory back; the memory's next beat leaves
#: ``NORM_GAMMA_RELEASE`` cycles after the gamma Gearbox takes a line.
NORM_GAMMA_HELD_LINES = 4
NORM_GAMMA_RELEASE = 1


def norm_gamma_replay_pace(lanes: int, line_bytes: int) -> int:
    """Cycles between the gamma beats a row's pass 2 replays from the gamma buffer: as
    many as a beat has gamma lines of ``line_bytes`` (``2·lanes/L``, at least 1), the pace
    of a gamma read, which no output row writer (``lanes/L`` lines a beat, ``2·lanes/L``
    wide) falls behind."""
    return max(1, 2 * lanes // line_bytes)


#: ActMulSequencer: the reader's LineAligner emitting a table line to the cycle ActMul's
#: table takes it (a line, 8 entries, a cycle: no Gearbox in between).
ACTMUL_TABLE_WRITE = LINE_ALIGNER_LATENCY
#: ActMulSequencer: after the last table word, TABLE's index check, CHECK, WRITE_CMD.
ACTMUL_TABLE_TO_ROWS = 3
#: ActMulSequencer: ROW_ALIGN, ROW_CMD, VMEM's read latency and the up-half LineAligner
#: before a row's first (gate, up) pair (plus the lines the aligner drops).
ACTMUL_ROW_START = 1 + 1 + VMEM_READ_LATENCY + LINE_ALIGNER_LATENCY
#: RopeSequencer: CHECK, whose last cycle starts the table row's read and the heads' streams.
ROPE_CHECK = 1
#: RopeSequencer: DONE.
ROPE_DONE = 1
#: HeadCutter: a line peeked in cycle ``p`` has its bytes on offer from cycle ``p + 2``
#: (VMEM's peek register, then the cutter's queue).
HEAD_CUTTER_LATENCY = 2
#: HeadPacker: a head taken in cycle ``u`` is in the queue, and the line it completes can be
#: poked, from cycle ``u + 1``.
HEAD_PACKER_LATENCY = 1
#: KvSequencer, KVAPPEND: CHECK, SET_POS, DONE (a job of no heads is just these; with heads
#: ``done`` comes with the last word, no DONE).
KVAPPEND_STATES = 3
#: KvSequencer, KVAPPEND per head besides its 2W words: APPEND and the KV buffer's append
#: setup (the next head's APPEND, or DONE, follows the last word at once).
KVAPPEND_HEAD_STATES = 2
#: KvSequencer, KVAPPEND: CHECK, whose last cycle starts the K and V head cutters.
KVAPPEND_CHECK = 1
#: KvSequencer, ATTN: its states' latencies are in :mod:`dfvg_hw.spec.kv_timing`.
#: MatmulSequencer: RANGE and DONE, once per instruction.
MATMUL_STATES = 2
#: The MATMUL prefetch (controller.py): the memory port is read-idle (its output register
#: empty, no burst outstanding) the cycle after its last beat is taken, and the controller
#: hands the next MATMUL to its sequencer in that cycle.
PREFETCH_IDLE = 1
#: ... which takes it into PREFETCH_CHECK, then PREFETCH, whose first cycle offers the first
#: read command: two cycles after the hand-over.
PREFETCH_FIRST_READ = 2
#: A MATMUL's PASS, where an unprefetched job offers its first read command, from its
#: FETCH: FETCH, DECODE, the job's hand-over, RANGE.
MATMUL_PASS_FROM_FETCH = ISSUE + JOB_HANDOVER + 1
#: MatmulSequencer per row pass: PASS, X_CMD, CHECK.
MATMUL_PASS_STATES = 3
#: MatmulSequencer per row pass: NEXT_PASS.
MATMUL_NEXT_PASS = 1
#: MatmulSequencer: cycles from a row pass's first (PASS) to its first x slice's write into
#: the x buffer: PASS, X_CMD, then VMEM's read latency.
MATMUL_X_LOAD_FROM = 2 + VMEM_READ_LATENCY
#: MatmulSequencer: from the cycle an x-buffer entry is written by the pass's last row to the
#: first in which the matrix unit can take a tile against it (the count of written entries,
#: then its copy a cycle later: the x buffer's read port reads before the write).
MATMUL_X_TO_TILE = 2

# MATMUL: row pitch and LOGITS rows
#: MatmulSequencer, rows a pitch apart that is not their own stride (a tree forward,
#: isa.md §9.2): each source row after a pass's first is a VMEM span of its own, X_CMD
#: again and VMEM's read latency before its first line.
MATMUL_ROW_SPAN = 1 + VMEM_READ_LATENCY


def matmul_records_per_beat(bus_bytes: int, lanes: int, bias: bool) -> int:
    """MatmulSequencer: output groups whose requant records (``R = 4·lanes`` bytes, ``8·lanes``
    with ``BIAS``; :func:`~dfvg_hw.spec.image.requant_record_bytes`) one read of a beat
    brings: ``B / R`` when a record is less than a beat and divides it, else 1 (the block
    is beat-aligned, so a batch's records start on a beat)."""
    record = requant_record_bytes(lanes, bias)
    return bus_bytes // record if record < bus_bytes and bus_bytes % record == 0 else 1

#: ActMulSequencer with a RowWriter slower than its beats (``lanes ≥ 16`` with WIDE): the
#: first pair of beat ``m`` waits until the writer has taken beat ``m − K``; ``K`` per lane
#: count, read from RTL traces (the beats in flight between the pair and the writer: the
#: two Gearboxes, ActMul's pipeline and the RowWriter's pack stage).
ACTMUL_WRITER_LAG = {16: 6, 32: 4, 64: 4}
#: ... and, per lane count where it binds (read off the same traces), the lag ``K'`` of a
#: second bound: the first pair of beat ``m`` waits until ``s + (m − K')·q`` cycles after
#: the writer's first take (``s`` lines per result beat, ``q`` lines per ActMul beat).
ACTMUL_PACK_LAG = {64: 4}


def actmul_writer_lag(lanes: int) -> int:
    """:data:`ACTMUL_WRITER_LAG` of ``lanes``; a lane count it has no derivation for is an
    error (the cycle model would otherwise drop the bound and under-count)."""
    try:
        return ACTMUL_WRITER_LAG[lanes]
    except KeyError:
        raise ConfigError(
            f"lanes = {lanes}: the cycle model has no ACTMUL writer-stall bound for this lane "
            f"count (derived for lanes in {sorted(ACTMUL_WRITER_LAG)})") from None

# controller: tree forwards (controller.py, isa.md §9.2)
#: A tree forward's row job after the first (an instruction split into one job per row):
#: the controller goes from a row's ``done`` straight to the next row's ``<UNIT>_JOB``.
TREE_ROW_HANDOVER = JOB_HANDOVER
#: COMPACT: the compaction's hand-over to the KV sequencer, after the token scan.
COMPACT_HANDOVER = 1

# KV sequencer: tree rows and compaction
#: KvSequencer, a compaction (isa.md §9.3) from its hand-over to ``compact_done``, besides
#: its levels: COMPACT_END once the KV buffer is idle (the last copy's trailing write).
COMPACT_START = 1
#: ... per level: COMPACT_LEVEL, the ROLLBACK to the level's destination position.
COMPACT_LEVEL_STATES = 1
#: ... per (level, slot) besides the entry's ``W`` words: the KV buffer takes the COPY
#: and sets up its two addresses (COPY_SETUP).
KV_COPY_STATES = 2
