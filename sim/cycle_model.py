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

Memory symbols used below: ``L`` = ``mem_latency_cycles``, ``B`` = bytes per beat of the
engine's port (``mem_port_bits / 8``), ``p`` = beats per cycle the memory delivers
(``min(1, mem_bytes_per_cycle / B)``). A read command accepted in cycle ``c`` has its
first beat in cycle ``c + READ_OVERHEAD + L``. Timing does not depend on data, only on
instruction fields, addresses and the KV position. All figures it produces are
*modelled*.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache
from math import ceil, gcd

from dfvg_hw.config import EngineConfig, VMEM_LINE_BYTES
from dfvg_hw.descriptors import REQUEST_HEADER_WORDS, RESULT_HEADER_WORDS, record_words
from dfvg_hw.image import ACT_PARAM_BYTES, ATTN_PARAM_BYTES, NORM_PARAM_BYTES, padded
from dfvg_hw.isa import Instruction, MatmulMode, Op

__all__ = ["CycleModel", "CycleCounts", "estimate_request", "BEFORE_FINISH"]

LINE = VMEM_LINE_BYTES
ISSUE = 2            #: FETCH + DECODE, charged at DECODE; a control instruction costs just this
UNIT_OVERHEAD = 4    #: ISSUE + the job hand-over (1) + RETIRE (1) of a unit instruction
READ_OVERHEAD = 3    #: MemoryPort: command register, burst issue, AR register (MemoryPort.READ_OVERHEAD)
MAX_OUTSTANDING = 8  #: bursts the memory port keeps in flight
MAX_BURST = 256      #: AXI4 beats per burst
PAGE = 4096          #: AXI4 bursts do not cross 4 KiB
VMEM_READ = 3        #: VectorMemory.READ_LATENCY
REQUANT = 3          #: Requantizer.LATENCY
ACC_TO_WB = 6        #: matrix unit: last tile taken -> first row into the requantisers
ACT_LUT = 256        #: ActMul.LUT_DEPTH: entries loaded per ACTMUL, one a cycle
SAMPLE_DIV = 25      #: the sampler's probability divider (PROB_BITS + 1 steps)
ATTN_TAIL = 43       #: attention per head: MAC 2, reciprocal 34, normaliser 3, hand-offs 4
GQA_DIVIDE = 16      #: ATTN: heads per KV head by a 16-step divider
#: Cycles of :meth:`CycleModel.request_finish` before FINISH, where the result descriptor's
#: cycle count is taken (the FETCH that finds the request over).
BEFORE_FINISH = 1
#: ACTMUL with a RowWriter slower than its beats (WIDE at lanes >= 16): the first pair of
#: beat m waits until the writer has taken beat m - K (measured from RTL traces).
ACT_STALL_BEATS = {16: 6, 32: 4, 64: 4}


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


def _ceil_log2(x: int) -> int:
    return (x - 1).bit_length()


def _lines(byte_addr: int, nbytes: int) -> int:
    """VMEM lines that ``nbytes`` at VMEM byte ``byte_addr`` touch."""
    return (byte_addr % LINE + nbytes + LINE - 1) // LINE if nbytes else 0


def _window(byte_addr: int, nbytes: int) -> int:
    """A gather or scatter through ``VmemWindow``: the request state, then lines + 2."""
    return _lines(byte_addr, nbytes) + 3


# -- the memory path ---------------------------------------------------------------------------
@dataclass(frozen=True)
class _Port:
    latency: int        #: L
    bus_bytes: int      #: B
    beats_per_cycle: float  #: p

    @property
    def lines_per_beat(self) -> int:
        return self.bus_bytes // LINE

    def beat_offset(self, i: int) -> int:
        """Cycles from a read's first beat to its beat ``i`` (the memory's token bucket
        full at the start, refilled ``p`` a cycle)."""
        return ceil(i / self.beats_per_cycle - 1e-9)

    def last_line_taken(self, beats: int, lines: int) -> int:
        """For a read accepted in cycle 0 whose beats are split into VMEM lines (one line
        a cycle; a beat enters the splitter as the previous one's last line leaves): the
        cycle line ``lines − 1`` is taken. The burst issues in cycle 1, the address in 2,
        beat ``k`` is due ``2 + L + k/p`` and passes the port's output register."""
        split = self.lines_per_beat
        bucket = _TokenBucket(self.beats_per_cycle)
        registered = taken = -10 ** 9
        taken_at = []
        for _ in range(beats):
            offered = bucket.offer(max(2 + self.latency, registered + 1))
            registered = max(offered, taken + split - 1)
            taken = registered + 1
            taken_at.append(taken)
        i = lines - 1
        return taken_at[i // split] + 1 + i % split

    def arrival(self, i: int, first: int) -> int:
        """Cycle a LineAligner takes input line ``i`` of a read whose first beat is on the
        port in cycle ``first`` (the beat-to-lines Gearbox adds a register and passes one
        line a cycle)."""
        lpb = self.lines_per_beat
        return first + 1 + max(i, self.beat_offset(i // lpb) + i % lpb)

    def emit(self, j: int, first: int, skip: int, length: int) -> int:
        """Cycle the LineAligner of an UnalignedReader emits output line ``j`` of a read of
        ``length`` bytes starting ``skip`` bytes into its first beat: it drops
        ``skip // 16`` lines, holds one, and emits when the next line arrives (or one
        cycle after the last)."""
        d = skip // LINE
        n_in = ceil((length + skip) / self.bus_bytes) * self.lines_per_beat
        if d + j + 1 < n_in:
            return self.arrival(d + j + 1, first)
        return self.arrival(n_in - 1, first) + 1


def _bursts(addr: int, nbytes: int, bus_bytes: int) -> list[int]:
    """Beats of each burst the memory port splits a read into (4 KiB pages, 256 beats)."""
    beats, out = ceil(nbytes / bus_bytes), []
    while beats:
        b = min(beats, (PAGE - addr % PAGE) // bus_bytes, MAX_BURST)
        out.append(b)
        beats -= b
        addr += b * bus_bytes
    return out


class _TokenBucket:
    """The simulated memory's rate limit: ``p`` beats a cycle, at most one banked."""

    def __init__(self, p: float):
        self.p, self.last, self.tokens = p, -10 ** 9, 1.0

    def offer(self, t: int) -> int:
        """The first cycle ``>= t`` a beat can be offered; spends its token."""
        if self.tokens + self.p * (t - self.last) < 1:
            t = self.last + ceil((1 - self.tokens) / self.p - 1e-9)
        self.tokens = min(1.0, self.tokens + self.p * (t - self.last)) - 1
        self.last = t
        return t


# -- MATMUL ------------------------------------------------------------------------------------
def _matmul_stream(port: _Port, groups: int, pass_rows: int, resadd: bool, lanes: int,
                   tile_bytes: int, addr: int, q_addr: int, line_of) -> int:
    """Cycles of the MATMUL sequencer's STREAM state for one row pass (matmul_sequencer.py).

    Reads: per group a tile command (``lanes·kpad`` bytes) then a requant command
    (``4·lanes``); a command costs a cycle to accept and one per burst issued, at most
    :data:`MAX_OUTSTANDING` bursts await their last beat, and each beat passes the port's
    output register. The first requant beat of group ``g`` waits until group ``g − 1``'s
    last row has entered the requantisers (one bank of requant words).
    Write-back: a group's rows enter the requantisers :data:`ACC_TO_WB` cycles after its
    last tile (and after its requant words), one a cycle, two after the previous group's
    last; the 3-stage requantiser freezes while a RESADD row waits for its residual line,
    which is peeked one cycle after the previous transfer (a row on a new line goes two
    cycles after the one before).
    """
    L, B, p = port.latency, port.bus_bytes, port.beats_per_cycle
    bucket = _TokenBucket(p)
    issued, pops = -1, []
    r_last = c_last = -10 ** 9
    q_free = None
    entered_prev, out_prev, line_prev = -10 ** 9, -10 ** 9, None
    freezes: list[tuple[int, int]] = []

    def advance(x: int) -> int:              # the first cycle >= x the requantiser moves
        moved = True
        while moved:
            moved = False
            for a, b in freezes[-4:]:
                if a <= x < b:
                    x, moved = b, True
        return x

    for g in range(groups):
        for bursts, is_q in ((_bursts(addr + g * tile_bytes, tile_bytes, B), False),
                             (_bursts(q_addr + g * 4 * lanes, 4 * lanes, B), True)):
            for i, n in enumerate(bursts):
                s = issued + (2 if i == 0 else 1)
                if len(pops) >= MAX_OUTSTANDING:
                    s = max(s, pops[-MAX_OUTSTANDING] + 1)
                issued = s
                ready = q_free if (is_q and i == 0 and q_free is not None) else -10 ** 9
                if p >= 1:
                    r1 = max(s + 1 + L, r_last + 1, c_last)
                    c1 = max(r1 + 1, ready)
                    if n == 1:
                        r_last, c_last = r1, c1
                    elif c1 == r1 + 1:
                        r_last, c_last = r1 + n - 1, c1 + n - 1
                    else:
                        r_last, c_last = c1 + n - 2, c1 + n - 1
                else:
                    for j in range(n):
                        r_last = max(bucket.offer(max(s + 1 + L, r_last + 1)), c_last)
                        c_last = max(r_last + 1, ready if j == 0 else -10 ** 9)
                pops.append(r_last)
            if is_q:
                q_taken = c_last
            else:
                tile_taken = c_last + 1
        ready = max(tile_taken + ACC_TO_WB, q_taken + 1, entered_prev + 2)
        for r in range(pass_rows):
            entered = advance(max(ready, entered_prev + 1))
            a = entered + 1
            for _ in range(REQUANT - 1):
                a = advance(a) + 1
            out = a
            if resadd:
                line = line_of(g, r)
                out = max(a, out_prev + (1 if line == line_prev else 2))
                line_prev = line
            if out > a:
                freezes.append((a, out))
            out_prev, entered_prev = out, entered
        q_free = entered_prev + 1
    return out_prev + 2


@lru_cache(maxsize=4096)
def _matmul_cycles(port: _Port, lanes: int, reduce: int, rows_per_pass: int, n: int, k: int,
                   rows: int, mode: int, wide: bool, page_offset: int, dst: int) -> int:
    npad, kpad = padded(n, lanes), padded(k, reduce)
    per_pass = rows_per_pass // 2 if wide else rows_per_pass
    slice_bytes = 2 * reduce if wide else reduce
    slices_per_row = ceil(k * (2 if wide else 1) / LINE) * max(1, LINE // slice_bytes)
    row_stride = padded(n * (1 if mode == MatmulMode.INT8 else 2), LINE)
    total = UNIT_OVERHEAD + 2                       # + RANGE, DONE
    first = 0
    while first < rows:
        pass_rows = min(per_pass, rows - first)
        x_load = VMEM_READ + pass_rows * slices_per_row
        f0 = first
        stream = _matmul_stream(
            port, npad // lanes, pass_rows, mode == MatmulMode.RESADD, lanes, lanes * kpad,
            page_offset, page_offset + npad * kpad,
            lambda g, r: dst + ((f0 + r) * row_stride + g * 2 * lanes) // LINE)
        total += 4 + x_load + stream                # PASS, X_CMD, CHECK, NEXT_PASS
        first += pass_rows
    return total


# -- RMSNORM, ACTMUL, ROPE ---------------------------------------------------------------------
def _writer_tail(row_bytes: int, beats_per_row: int, lanes: int, wide: bool) -> tuple[int, int]:
    """(lines per result beat, lines of a row's last beat the RowWriter drops)."""
    beat_bytes = lanes * (2 if wide else 1)
    if beat_bytes <= LINE:
        return 1, 0
    s = beat_bytes // LINE
    return s, beats_per_row * s - ceil(row_bytes / LINE)


def _done_after(last_beat_out: int, s: int, dropped: int) -> int:
    """The DONE cycle of a row job whose last result beat leaves its unit in
    ``last_beat_out`` (RowWriteProgress: the rows count and VMEM's wr_done, registered)."""
    last_line = last_beat_out + s
    return max(last_line + 1, last_line - dropped + 2) + 1


def _writer_last_take(in0: int, in_prev: int, in_last: int, beats: int, s: int) -> int:
    """The cycle the RowWriter takes a row's last beat when it takes one every ``s``
    cycles at most."""
    if beats == 1:
        return in0
    return max(in_last, in_prev + s, in0 + (beats - 1) * s)


def _rmsnorm(port: _Port, lanes: int, n: int, rows: int, wide: bool, addr: int) -> int:
    """norm_sequencer.py: read the parameter head; per row, pass 1 over x (sum of squares,
    then rsqrt) races the gamma read issued at the row's start; pass 2 streams x and
    gamma through the scaler."""
    L, B = port.latency, port.bus_bytes
    ell = ceil(2 * n / LINE)                       # VMEM lines of an int16 row
    if 2 * lanes <= LINE:                          # beats cut from lines ...
        cut, pack = LINE // (2 * lanes), None
        beats = ell * cut
    else:                                          # ... or packed from several lines
        cut, pack = None, 2 * lanes // LINE
        beats = ceil(ell / pack)
    stream = max(beats, ell)
    turnaround = 2 + _ceil_log2(lanes) + 4         # square, tree, accumulate, rsqrt
    first = 2 + READ_OVERHEAD + L
    skip = addr % B
    head_out = port.emit(0, first, skip, NORM_PARAM_BYTES) + 1
    head_lines = ceil((NORM_PARAM_BYTES + skip) / B) * port.lines_per_beat
    gamma_cmd = max(head_out + 3, port.arrival(head_lines - 1, first) + 1)
    gamma_skip = (addr + NORM_PARAM_BYTES) % B
    s, dropped = _writer_tail((2 if wide else 1) * n, beats, lanes, wide)

    g = gamma_cmd
    for _ in range(rows):
        gamma_first = g + 1 + READ_OVERHEAD + L
        pass2 = g + 1 + 4 + stream
        u = pass2 + turnaround - 1
        gamma_line = lambda j: port.emit(j, gamma_first, gamma_skip, 2 * n) + 1
        if pack is None:
            end, gap = max(u + beats - 1, gamma_line(0) + beats, gamma_line(ell - 1) + cut), 1
        else:
            g0 = gamma_line(min(pack, ell) - 1) + 1
            tail = ell - pack if beats > 1 else 0
            end = max(pass2 + 3 + ell, gamma_line(ell - 1) + 1, max(u, g0) + tail)
            gap = ell - pack * (beats - 1)
        g = end + 1
    last_out = end + 4 + (max(0, s - gap) if beats > 1 else 0)    # RMSNorm.LATENCY 4
    return UNIT_OVERHEAD + _done_after(last_out, s, dropped)


def _actmul_rows(a: int, rows: int, n: int, lanes: int, s: int):
    """ACTMUL's row loop from the first ROW_ALIGN in cycle ``a``: (cycle the writer takes
    the last beat, beats per row)."""
    g_lines = ceil(n / LINE)
    d = n // LINE                                  # lines the up-half aligner drops
    r = max(1, LINE // lanes)                      # cycles per (gate, up) line pair
    q = max(1, lanes // LINE)                      # lines per ActMul beat when packing
    if lanes <= LINE:
        beats, last_lines, spacing = r * g_lines, 1, 1
    else:
        beats = ceil(g_lines / q)
        last_lines, spacing = g_lines - q * (beats - 1), q
    stall = ACT_STALL_BEATS.get(lanes)
    m = beats - 1
    w_last = None
    for _ in range(rows):
        f0 = a + 6 + d                             # ROW_ALIGN, ROW_CMD, VMEM 3, aligner
        f_last = f0 + r * (g_lines - 1)
        if lanes <= LINE:
            in0, in_prev, in_last = f0 + 1, f0 + beats - 1, f0 + beats
        else:
            in0 = f0 + min(q, g_lines)
            in_prev, in_last = f_last + 1 - last_lines, f_last + 1
        w0 = in0 + 5 if w_last is None else max(in0 + 5, w_last + s)
        w_last = _writer_last_take(w0, in_prev + 5, in_last + 5, beats, s)
        last_pair = f_last
        if s > spacing and stall is not None:      # the writer is the bottleneck
            bounds = []
            if m >= stall:
                bounds.append(w0 + (m - stall) * s)
            if lanes == 64 and m >= 4:
                bounds.append(w0 + s + (m - 4) * q)
            if bounds:
                last_pair = max(last_pair, max(bounds) + last_lines - 1)
        a = last_pair + 1
    return w_last, beats


def _actmul(port: _Port, lanes: int, n: int, rows: int, wide: bool, addr: int) -> int:
    """actmul_sequencer.py: the parameter head and the SiLU table (256 entries, one a
    cycle into the unit's LUT, every instruction), then per row the gate and up halves
    read from VMEM in pairs through ActMul and the RowWriter."""
    first = 2 + READ_OVERHEAD + port.latency
    skip = addr % port.bus_bytes
    head_out = port.emit(0, first, skip, ACT_PARAM_BYTES) + 1
    first_table_line = max(head_out, port.emit(1, first, skip, ACT_PARAM_BYTES))
    a = first_table_line + 2 + ACT_LUT + 3        # table, index check, CHECK, WRITE_CMD
    beat_bytes = lanes * (2 if wide else 1)
    s = max(1, beat_bytes // LINE)
    w_last, beats = _actmul_rows(a, rows, n, lanes, s)
    _, dropped = _writer_tail((2 if wide else 1) * n, beats, lanes, wide)
    if beat_bytes <= LINE and wide:
        dropped = 2 * ceil(n / LINE) - ceil(2 * n / LINE)
    return UNIT_OVERHEAD + _done_after(w_last, s, dropped)


def _rope(port: _Port, n: int, k: int, rows: int, addr: int, pos: int) -> int:
    """rope_sequencer.py: the table row of ``POS`` (whole beats), then head by head: gather
    (lines + 3), rotate (Rope.LATENCY 3 + 2), scatter (lines + 3), next."""
    row_addr = addr + pos * 2 * k
    beats = ceil((row_addr % port.bus_bytes + 2 * k) / port.bus_bytes)
    spans = 3 + READ_OVERHEAD + port.latency + port.beat_offset(beats - 1) + 2
    per_row = sum(11 + 2 * _lines(h * k, k) for h in range(n))
    return UNIT_OVERHEAD + spans + rows * per_row + 1


# -- KVAPPEND, ATTN ----------------------------------------------------------------------------
def _kv_words(config: EngineConfig) -> int:
    """KV buffer words per head entry (one word a cycle on its port)."""
    return config.head_dim // gcd(config.reduce, config.head_dim)


def _kvappend(config: EngineConfig, n: int, k: int, src: int) -> int:
    """kv_sequencer.py: per head, gather K and V from VMEM, then append 2W words."""
    w = _kv_words(config)
    base = src * LINE
    heads = sum(_window(base + h * k, k) + _window(base + n * k + h * k, k) + 3 + 2 * w
                for h in range(n))
    return UNIT_OVERHEAD + 3 + heads                # CHECK, SET_POS, DONE


def _attn(port: _Port, config: EngineConfig, n: int, k: int, src: int, dst: int, pos: int,
          wide: bool, addr: int) -> int:
    """kv_sequencer.py + softmax.Attention, heads strictly one after another: per head the
    K rows stream at one KV word a cycle (W·T), the scores go through the dot-product
    tree and exp, the V rows stream again (the gearbox holds one row, so V cannot be
    fetched ahead), then reciprocal and normaliser."""
    w = _kv_words(config)
    t = pos + 1
    out_bytes = 2 * k if wide else k
    beats = ceil((addr % port.bus_bytes + ATTN_PARAM_BYTES) / port.bus_bytes)
    params = 6 + port.latency + (beats - 1) * ceil(1 / port.beats_per_cycle)
    per_head_kv = 2 * w * t - w + max(7 + _ceil_log2(config.head_dim), w) + ATTN_TAIL
    heads = sum(_window(src * LINE + h * k, k) + per_head_kv + _window(dst * LINE + h * out_bytes, out_bytes)
                for h in range(n))
    # CHECK, params, GROUPS, DIVIDE, ATTN_SPANS, SET_POS, DONE
    return UNIT_OVERHEAD + 1 + params + 1 + GQA_DIVIDE + 3 + heads


# -- the model ---------------------------------------------------------------------------------
class CycleModel:
    """Cycles per instruction and per request for one :class:`EngineConfig`.

    Members
    -------
    config : EngineConfig
    port : the memory path's timing (latency, bytes per beat, beats per cycle)
    """

    def __init__(self, config: EngineConfig):
        self.config = config
        bus = config.mem_port_bits // 8
        self.port = _Port(config.mem_latency_cycles, bus,
                          min(1.0, config.mem_bytes_per_cycle / bus))

    def _read(self, beats: int) -> int:
        """A read state pair (command, data) of ``beats`` beats, consumed as they come."""
        return READ_OVERHEAD + self.port.latency + 1 + ceil((beats - 1) / self.port.beats_per_cycle)

    def instruction(self, ins: Instruction, *, pos: int = 0, topk: int = 1, addr: int | None = None,
                    token_from_request: bool = True) -> tuple[int, int]:
        """(cycles, device-memory bytes read) of one instruction.

        ``pos`` is the KV position, ``addr`` the resolved device address of the
        instruction's block (image base + ``addr`` + the layer offset; by default
        ``ins.addr``, i.e. an image at a 4 KiB-aligned base), ``token_from_request``
        whether EMBED's token comes from the request (read from memory) rather than from
        the sampler.
        """
        c, port = self.config, self.port
        op = ins.opcode
        addr = ins.addr if addr is None else addr
        rows = max(ins.rows, 1)
        if op == Op.MATMUL:
            npad, kpad = padded(ins.n, c.lanes), padded(ins.k, c.reduce)
            cycles = _matmul_cycles(port, c.lanes, c.reduce, c.rows, ins.n, ins.k, rows,
                                    int(ins.mode), ins.wide, addr % PAGE, ins.dst)
            return cycles, npad * kpad + 4 * npad
        if op == Op.RMSNORM:
            return (_rmsnorm(port, c.lanes, ins.n, rows, bool(ins.wide), addr),
                    NORM_PARAM_BYTES + rows * 2 * ins.n)
        if op == Op.ROPE:
            return _rope(port, ins.n, ins.k, rows, addr, pos), 2 * ins.k
        if op == Op.KVAPPEND:
            return _kvappend(c, ins.n, ins.k, ins.src), 0
        if op == Op.ATTN:
            return (_attn(port, c, ins.n, ins.k, ins.src, ins.dst, pos, bool(ins.wide), addr),
                    ATTN_PARAM_BYTES)
        if op == Op.ACTMUL:
            return _actmul(port, c.lanes, ins.n, rows, bool(ins.wide), addr), ACT_PARAM_BYTES
        if op == Op.EMBED:
            return self._embed(ins.n, token_from_request)
        if op == Op.SAMPLE:
            return self._sample(ins.n, topk), 0
        return ISSUE, 0      # NOP, HALT, LOOP, ENDLOOP, BRANCH, NEXT

    def _embed(self, n: int, token_from_request: bool) -> tuple[int, int]:
        """controller.py EMBED_*: read the token (one beat) if it comes from the request,
        open the VMEM span, read the row and write it a line a cycle."""
        port = self.port
        lines = ceil(2 * n / LINE)
        token = 1 + READ_OVERHEAD + port.latency if token_from_request else 1
        if port.beats_per_cycle >= 1:
            data = READ_OVERHEAD + 1 + port.latency + lines
        else:
            data = port.last_line_taken(ceil(2 * n / port.bus_bytes), lines) + 1
        nbytes = 2 * n + (port.bus_bytes if token_from_request else 0)
        # FETCH + DECODE, the token, EMBED_CMD, EMBED_READ, the row, RETIRE
        return ISSUE + token + 2 + data + 1, nbytes

    def _sample(self, n: int, topk: int) -> int:
        """sample_unit.py + sampler.py: the logit buffer streams a tile a cycle into the
        lanes' top-k lists, which merge one candidate a cycle; then exp, the divider and
        the probabilities over the k winners, and the record a word a cycle into the
        result RAM."""
        c = self.config
        k = min(max(topk, 1), c.topk_max)
        k_eff = min(k, n)
        merge = c.lanes * k if c.lanes > 1 else 0
        prob = k_eff + 1 if k_eff > 1 else 0
        return (ISSUE + 2 + ceil(n / c.lanes) + merge + k_eff + 4 + SAMPLE_DIV + prob + 1
                + record_words(c.topk_max) + 1)

    def request_start(self, n_in: int) -> tuple[int, int]:
        """(cycles, bytes) before the first instruction: the header and the token scan."""
        B = self.port.bus_bytes
        header, scan = 4 * REQUEST_HEADER_WORDS, 4 * n_in
        return (self._read(ceil(header / B)) + 1 + self._read(ceil(scan / B)) + 1,
                header + scan)

    def request_finish(self, n_records: int) -> tuple[int, int]:
        """(cycles, bytes) after HALT: the result header assembled a word a cycle, every
        word read from the result RAM and packed (2 cycles), sent a beat a cycle, then the
        write response. The result's own cycle count stops :data:`BEFORE_FINISH` cycles
        in; the counters take all of them."""
        words = RESULT_HEADER_WORDS + n_records * record_words(self.config.topk_max)
        per_beat = self.port.bus_bytes // 4
        cycles = (3 + RESULT_HEADER_WORDS + 1 + 2 * words + ceil(words / per_beat) + 1
                  + self.port.latency + 2)
        return cycles, 4 * words

    @staticmethod
    def macs(ins: Instruction, *, pos: int = 0) -> int:
        """Multiply-accumulates of one instruction (matmuls and attention)."""
        if ins.opcode == Op.MATMUL:
            return max(ins.rows, 1) * ins.n * ins.k
        if ins.opcode == Op.ATTN:
            return 2 * max(ins.rows, 1) * ins.n * ins.k * (pos + 1)
        return 0


def estimate_request(config: EngineConfig, program: list[int], *, n_in: int, n_draft: int,
                     start_pos: int, topk: int = 1, image_base: int = 0) -> CycleCounts:
    """Modelled cycles of one request, walking the program's control flow without data.

    Timing does not depend on token values, so this equals the functional model's count
    for the same request shape (a test checks it).
    """
    from dfvg_hw.isa import decode
    from sim.controller import CONTROL_OPS, Sequencer

    model = CycleModel(config)
    counts = CycleCounts()
    counts.add("REQUEST", *model.request_start(n_in))
    seq = Sequencer([0] * n_in, start_pos, n_draft)
    budget = (n_in + n_draft + 1) * len(program) * 256
    while not seq.halted and budget:
        budget -= 1
        ins = decode(program[seq.pc])
        addr = image_base + ins.addr + (seq.layer * seq.lstride if ins.layer_relative else 0)
        counts.add(ins.opcode, *model.instruction(ins, pos=seq.pos, topk=topk, addr=addr,
                                                  token_from_request=not seq.token_is_drafted),
                   macs=model.macs(ins, pos=seq.pos))
        if ins.opcode in CONTROL_OPS:
            seq.control(ins)
            continue
        if ins.opcode == Op.SAMPLE:
            seq.drafted(0)
        seq.pc += 1
    if not seq.halted:
        raise ValueError("program does not halt within the watchdog budget")
    counts.add("REQUEST", *model.request_finish(seq.n_drafted))
    return counts
