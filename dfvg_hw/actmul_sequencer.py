"""ACTMUL sequencing (docs/isa.md §3.8, ``FunctionalEngine._unit``): the activation tables
of the instruction's channel segments from device memory into
:class:`~dfvg_hw.elementwise.ActMul`, then each source row's gate and up halves (with
``UNGATED``, its gate alone) through it, the results into VMEM.

Per job:

1. **Parameters.** The ``S = max(k, 1)`` consecutive 528-byte blocks are read as one
   stream of lines of ``P = min(L, bus beat, 64)`` bytes (``timing.actmul_param_line``)
   (:class:`~dfvg_hw.line_streams.UnalignedReader`, any byte address), each ``P/16``
   **chunks** of 16 bytes (the blocks are laid out in 16-byte words): each block's first
   chunk gives its segment's ``mult = word0 & 0xFFFF``, ``shift = (word0 >> 16) & 0x3F``
   and first channel ``first = word1 & 0xFFFF`` (segment 0's is 0 whatever the block
   says), the next 32 chunks its 256 int16 table entries. A line's table chunks are
   consecutive table words (a head between them skipped), so each goes into its own bank
   of ActMul's tables: a whole line (``P/2`` entries) is written a cycle. Blocks past
   device memory are refused by the memory port (``BAD_ADDRESS``; the controller resets
   the sequencer before VMEM was touched).
2. **Checks.** ``rows > config.rows`` and ``k > ACTMUL_SEGMENTS`` (``PROGRAM``) first
   of all, as ``_unit`` does; the
   source (``rows × 2n`` int8; ``rows × n`` with ``UNGATED``) and destination spans
   outside VMEM (``BAD_ADDRESS``) before VMEM's writer is given the destination, so a
   refused instruction changes nothing.
3. **Rows.** The destination is one write span; each source row is one read span whose
   lines (``L = vmem_line_bytes`` bytes) are forked: the first ``ceil(n/L)`` (the gate half) into an on-chip **gate
   buffer**, and all of them into a :class:`~dfvg_hw.line_streams.LineAligner` that
   re-cuts the row from byte ``n`` (the up half). Each up line meets the gate line of the
   same elements from the buffer, both are cut into ``lanes``-element beats and go
   through ActMul together. The next row's span is issued when the row's last pair has
   left, so the buffer is never overwritten while it is still read.
4. **Ungated rows** (``UNGATED``, an ungated MLP's ReLU or GELU). A source row is its
   ``n`` gate bytes alone, and ActMul takes ``up = 1``: the row's span is ``n`` bytes, the
   aligner re-cuts it from byte 0 and its lines are the gate lines themselves, past the
   gate buffer (a narrow row may be up to all of VMEM, twice the buffer). The pairs
   run as a gated row's, without the ``⌊n/L⌋`` lines a gated row's aligner drops first.
5. **Segments.** Channel ``c`` of a row (lane ``j`` of the row's beat ``b``: ``c = b·lanes
   + j``) goes through the table, ``mult`` and ``shift`` of the last segment whose
   ``first ≤ c``; the row streams as one, whatever its segments, so a segment may end at
   any channel and the rows' timing does not depend on where the segments end.
6. **Row exponents** (``ROWEXP``, with the budget ``E = exp_max`` of the first block's
   head; docs/isa.md §3.8, :func:`~dfvg_hw.spec.numerics.act_row_exponent`). Each row goes
   through ActMul twice. The **measure pass** runs it at the coarsest exponent (``extra =
   E``) and writes nothing: the results' magnitudes are OR-ed into ``peak`` (lanes past
   ``n`` take ``up = 0``), whose bit length gives the row's exponent ``e`` once the pass's
   last beat has left ActMul. The **write pass** is a row as above, at ``extra = e``,
   except that a gated row's gates are still in the gate buffer: it reads the up half
   alone (from its first line, the aligner skipping ``n mod L`` bytes). The next row's
   measure pass starts once the write pass's last beat has left ActMul (to the writer),
   so each pass starts on an empty ActMul. Every row a job computes (``n ≥ 1``)
   reports its exponent on ``exp_we`` as its write pass starts.

7. **int16 gate and up** (``IN16``, docs/isa.md §3.8). The row is ``[gate | up]`` of
   ``2n`` int16 (``n`` ungated): the gate half is ``2n`` bytes, so its lines, the up half's
   start and a write pass's skip count bytes of ``2n``; lines are cut by a second pair of
   cutters into beats of ``lanes`` int16 (``2·lanes`` bytes), each lane's two bytes one
   signed value, and ActMul interpolates the table's knots
   (:func:`~dfvg_hw.spec.numerics.act_mul_wide`). A job uses one pair of cutters; the
   other stays empty.

The gate buffer holds ``ceil(vmem_bytes / 2L)`` lines (half of VMEM: the longest gate a
row inside VMEM can have). It is what makes ``src == dst`` exact for wide results too:
a wide output line overlays gate bytes needed by later outputs, which the buffer has
already taken; every other byte an output line overlays was read before that line is
written (reads run ahead of writes, a line per cycle). A destination partly overlapping
the source is not supported (the functional model reads all rows first). An ungated row
is not buffered, so ``src == dst`` is exact for its narrow results only (each output line
overlays the gate line it came from); a wide ungated result, twice its source row,
overlays gates not yet read, so a ``WIDE UNGATED`` destination must not overlap the
source (its row ``r`` also overlays the source's row ``r + 1``).

A row takes about ``ceil(2n/L)`` cycles of VMEM reads (``ceil(n/L)`` ungated) plus the
read latency and the pipeline's drain (ActMul's is
:attr:`~dfvg_hw.elementwise.ActMul.LATENCY`); at ``lanes < L`` ActMul's
``ceil(n/L)·L/lanes`` beats set the pace instead.
"""

from __future__ import annotations

import operator
from functools import reduce

from amaranth import Cat, Module, Mux, Signal, signed, unsigned
from amaranth.utils import exact_log2
from amaranth.lib import data, wiring
from amaranth.lib.wiring import Out
from amaranth.lib.fifo import SyncFIFOBuffered
from amaranth.lib.memory import Memory

from dfvg_hw.spec import numerics as nx
from dfvg_hw.spec import timing
from dfvg_hw.spec.config import EngineConfig
from dfvg_hw.spec.descriptors import ErrorCode
from dfvg_hw.elementwise import ActMul
from dfvg_hw.spec.image import ACT_PARAM_BYTES
from dfvg_hw.spec.isa import ACTMUL_SEGMENTS

from dfvg_hw.line_streams import (LineAligner, RowWriteProgress, RowWriter, UnalignedReader,
                                  lines_of, read_request, span_request)
from dfvg_hw.layouts import flags_view
from dfvg_hw.op_port import OpJob, OpSequencerSignature
from dfvg_hw.operand_access import job_spans_outside
from dfvg_hw.vmem import Gearbox

__all__ = ["ActMulSequencer"]

#: bytes of a parameter block's chunks: its head, or one table word (8 entries)
_CHUNK = 2 * ActMul.LUT_WRITE_ENTRIES
#: a parameter block's chunks: the head, then 32 chunks of table entries
_BLOCK_CHUNKS = 1 + ActMul.LUT_WORDS
#: result-row ``last`` flags in flight through ActMul (its beats carry none); a full FIFO
#: only pauses the input, so this sets no bound on correctness
_LAST_FIFO_DEPTH = 8


class ActMulSequencer(wiring.Component):
    """Runs one ACTMUL per ``job`` (see the module docstring for the order of work and the
    checks) and answers with ``done`` and an error code.

    Parameters
    ----------
    config : EngineConfig
        ``lanes``, ``rows``, ``vmem_bytes`` and ``vmem_line_bytes`` (the gate buffer),
        ``mem_bytes``.
    data_width : int
        Memory bus width in bits (at least 128).

    Members
    -------
    job : In(stream.Signature(OpJob()))
        The ACTMUL: ``addr`` (the first parameter block), ``flags`` (``WIDE``,
        ``UNGATED``, ``ROWEXP``, ``IN16``), ``rows``, ``dst``, ``src``, ``n``, ``k``
        (segments; 0 is one).
    done : Out(1)
        One-cycle pulse: the job is finished, ``error`` holds its outcome.
    error : Out(8)
        :class:`~dfvg_hw.spec.descriptors.ErrorCode` (OK, PROGRAM or BAD_ADDRESS).
    read_cmd, read_data : the memory port's read side (the parameter block)
    vmem_rd_cmd, vmem_rd : VMEM's span reader (one span per row)
    vmem_wr_cmd, vmem_wr, vmem_wr_done : VMEM's span writer (one span per job)
    vmem_error : In(1)
        Unused: spans are checked before they are issued.
    peek_addr, peek_data, poke_en, poke_addr, poke_data : unused (idle)
    exp_we : Out(1)
        Row ``exp_row``'s exponent is ``exp_value`` (the controller's row exponent registers,
        which MATMUL ``ROWEXP`` reads).
    exp_row : Out(8)
    exp_value : Out(ROW_EXP_BITS)
    """

    def __init__(self, config: EngineConfig, data_width: int):
        self.config, self.data_width = config, data_width
        self.gate_depth = -(-config.vmem_bytes // (2 * config.vmem_line_bytes))
        #: bytes of the parameter stream's lines: a VMEM line, at most a bus beat and 64
        self.param_line = timing.actmul_param_line(config.vmem_line_bytes, data_width // 8)
        super().__init__(wiring.Signature({
            **dict(OpSequencerSignature(config, data_width).members.items()),
            "exp_we": Out(1),
            "exp_row": Out(8),
            "exp_value": Out(nx.ROW_EXP_BITS),
        }))

    def elaborate(self, platform):
        m = Module()
        c = self.config
        lanes, L = c.lanes, c.vmem_line_bytes
        chunks = self.param_line // _CHUNK                  # chunks a parameter line
        reader = m.submodules.reader = UnalignedReader(c, self.data_width, self.param_line)
        act = m.submodules.act = ActMul(c, segments=ACTMUL_SEGMENTS, write_words=chunks)
        up_align = m.submodules.up_align = LineAligner(L)
        # lines → beats of lanes × int8, and (IN16) of lanes × int16
        cutters = {8: (Gearbox(L, lanes), Gearbox(L, lanes)),
                   16: (Gearbox(L, 2 * lanes), Gearbox(L, 2 * lanes))}
        for bits, (gate_cutter, up_cutter) in cutters.items():
            m.submodules[f"gate_cut{bits}"], m.submodules[f"up_cut{bits}"] = gate_cutter, up_cutter
        # each beat's end-of-row flag and whether it is a measure pass's
        lasts = m.submodules.row_lasts = SyncFIFOBuffered(width=2, depth=_LAST_FIFO_DEPTH)
        writer = m.submodules.writer = RowWriter(c)
        gate_buffer = m.submodules.gate_buffer = Memory(shape=unsigned(8 * L),
                                                        depth=self.gate_depth, init=[])
        gate_wr, gate_rd = gate_buffer.write_port(), gate_buffer.read_port()

        wiring.connect(m, reader.read_cmd, wiring.flipped(self.read_cmd))
        wiring.connect(m, wiring.flipped(self.read_data), reader.read_data)
        # the parameter blocks are the job's one read: once its command is with the port,
        # no other comes (the controller may prefetch the next MATMUL's weights behind it)
        param_issued = Signal()
        m.d.comb += self.reads_done.eq(param_issued)
        with m.If(self.read_cmd.valid & self.read_cmd.ready):
            m.d.sync += param_issued.eq(1)

        job = Signal(OpJob())
        wide, ungated = flags_view(job.flags).wide, flags_view(job.flags).ungated
        rowexp = flags_view(job.flags).row_exponent
        in16 = flags_view(job.flags).in16
        in_bytes = Signal(19)                       # 2n: gate and up; n: an ungated gate; IN16 twice
        out_bytes = Signal(17)                      # n, or 2n when wide
        gate_bytes = Mux(in16, job.n << 1, job.n)   # the gate half's bytes
        gate_lines = lines_of(gate_bytes, L)
        n_lines_in = gate_bytes >> exact_log2(L)    # whole lines before the up half starts
        segments = Mux(job.k == 0, 1, job.k)
        block_chunk = Signal(range(_BLOCK_CHUNKS))  # the next line's first chunk in its block
        block = Signal(range(ACTMUL_SEGMENTS + 2))  # ... and its block (segment)
        mults = Signal(act.mult.shape())
        shifts = Signal(act.shift.shape())
        firsts = Signal(data.ArrayLayout(unsigned(16), ACTMUL_SEGMENTS))
        chan = Signal(16)                           # channel of lane 0 of the next beat
        row = Signal(8)
        row_line = Signal(16)                       # lines of the current row read so far
        pair = Signal(16)                           # up line (and gate line) to pair next
        gate_at = Signal(16)                        # the gate line on gate_rd.data
        error = Signal(8)
        exp_max = Signal(nx.ROW_EXP_BITS)           # the row exponent budget E (ROWEXP)
        measuring = Signal()                        # the row's pass is its measure pass
        exp = Signal(nx.ROW_EXP_BITS)               # the row's exponent, for its write pass
        peak = Signal(16)                           # OR of the measure pass's |results|
        up_only = Signal()                          # a gated row's write pass: its gates are buffered
        # passes whose last pair is taken and last beat not yet out of ActMul, modulo 16: at
        # most the FIFO's beats and the two cutters' are in flight, so 0 means none
        in_flight = Signal(4)

        m.d.comb += [
            self.error.eq(error),
            act.mult.eq(mults), act.shift.eq(shifts), act.wide.eq(wide), act.in16.eq(in16),
            act.extra.eq(Mux(measuring, exp_max, exp)),
            up_only.eq(rowexp & ~measuring & ~ungated),
        ]
        progress = RowWriteProgress(m, writer, self.vmem_wr, self.vmem_wr_done,
                                    wide=wide, row_bytes=out_bytes)

        # -- parameters: each block's head chunk, then its table, a line a cycle ----------------
        # every line of the job's one read is taken as it comes: the blocks follow each
        # other without a gap. A line's chunks past the last block (the read's tail) are
        # not written.
        line = reader.o.p.data.as_value()
        bank_bits = exact_log2(chunks)
        m.d.comb += reader.o.ready.eq(1)
        for j in range(chunks):
            at = block_chunk + j
            wrap = at >= _BLOCK_CHUNKS                      # the chunk starts the next block
            index = Mux(wrap, at - _BLOCK_CHUNKS, at)[:len(block_chunk)]
            seg = (block + wrap)[:len(block)]
            chunk = line[j * 8 * _CHUNK:(j + 1) * 8 * _CHUNK]
            ours = reader.o.valid & (seg < segments)
            with m.If(ours & (index == 0)):
                m.d.sync += [mults[seg].eq(chunk[:16]), shifts[seg].eq(chunk[16:22]),
                             firsts[seg].eq(chunk[32:48])]
                with m.If(seg == 0):
                    m.d.sync += exp_max.eq(chunk[48:48 + nx.ROW_EXP_BITS])
            word = Cat((index - 1)[:5], seg[:exact_log2(ACTMUL_SEGMENTS)])   # 32·seg + entry word
            for b in range(chunks):                         # the bank of the word
                with m.If(ours & (index != 0) & (word[:bank_bits] == b)):
                    m.d.comb += [act.lut_we[b].eq(1), act.lut_addr[b].eq(word[bank_bits:]),
                                 act.lut_data[b].eq(chunk)]
        with m.If(reader.o.valid):
            after = block_chunk + chunks
            with m.If(after >= _BLOCK_CHUNKS):
                m.d.sync += [block_chunk.eq(after - _BLOCK_CHUNKS), block.eq(block + 1)]
            with m.Else():
                m.d.sync += block_chunk.eq(after)

        # -- rows: VMEM lines forked into the gate buffer and the up aligner ------------------
        line_taken = self.vmem_rd.valid & self.vmem_rd.ready
        m.d.comb += [
            up_align.i.valid.eq(self.vmem_rd.valid), up_align.i.p.data.eq(self.vmem_rd.p.data),
            up_align.i.p.last.eq(self.vmem_rd.p.last), self.vmem_rd.ready.eq(up_align.i.ready),
            gate_wr.en.eq(line_taken & ~ungated & ~up_only & (row_line < gate_lines)),
            gate_wr.addr.eq(row_line), gate_wr.data.eq(self.vmem_rd.p.data),
        ]
        with m.If(line_taken):
            m.d.sync += row_line.eq(row_line + 1)

        # each up line meets gate line `pair`: the read port shows the line addressed in
        # the previous cycle, and re-reads it every cycle, so a line written since is seen.
        # An ungated row's gate is the aligner's line itself (a row of up to all of VMEM,
        # longer than the buffer), paired with up = 1 at ActMul
        # (the job's element width picks one pair of cutters; the other stays idle and empty)
        pair_valid = up_align.o.valid & (ungated | (gate_at == pair))
        cut_ready = Mux(in16, cutters[16][0].i.ready & cutters[16][1].i.ready,
                        cutters[8][0].i.ready & cutters[8][1].i.ready)
        pair_taken = pair_valid & cut_ready
        m.d.comb += [
            gate_rd.addr.eq(Mux(pair_taken, pair + 1, pair)),
            up_align.o.ready.eq(pair_taken),
        ]
        for bits, (gate_cutter, up_cutter) in cutters.items():
            ours = in16 if bits == 16 else ~in16
            m.d.comb += [
                gate_cutter.i.valid.eq(ours & pair_valid & up_cutter.i.ready),
                up_cutter.i.valid.eq(ours & pair_valid & gate_cutter.i.ready),
                gate_cutter.i.p.data.eq(Mux(ungated, up_align.o.p.data, gate_rd.data)),
                gate_cutter.i.p.last.eq(up_align.o.p.last),
                up_cutter.i.p.eq(up_align.o.p),
            ]
        m.d.sync += gate_at.eq(gate_rd.addr)
        with m.If(pair_taken):
            m.d.sync += pair.eq(pair + 1)

        # -- ActMul, with each beat's end-of-row flag beside it --------------------------------
        gate_out = Mux(in16, cutters[16][0].o.valid, cutters[8][0].o.valid)
        up_out = Mux(in16, cutters[16][1].o.valid, cutters[8][1].o.valid)
        beat_last = Mux(in16, cutters[16][0].o.p.last, cutters[8][0].o.p.last)
        beat_valid = gate_out & up_out & lasts.w_rdy
        beat_taken = beat_valid & act.i.ready
        # a measure pass's beats go nowhere: only their magnitudes are kept
        out_last, out_measured = lasts.r_data[0], lasts.r_data[1]
        taken_out = Signal()
        m.d.comb += [
            act.i.valid.eq(beat_valid),
            *(cutter.o.ready.eq(beat_taken) for pair_ in cutters.values() for cutter in pair_),
            lasts.w_en.eq(beat_taken), lasts.w_data.eq(Cat(beat_last, measuring)),
            writer.i.valid.eq(act.o.valid & lasts.r_rdy & ~out_measured),
            act.o.ready.eq((writer.i.ready | out_measured) & lasts.r_rdy),
            lasts.r_en.eq(act.o.valid & (writer.i.ready | out_measured)),
            taken_out.eq(act.o.valid & lasts.r_rdy & (writer.i.ready | out_measured)),
            writer.i.p.last.eq(out_last),
        ]
        with m.If(taken_out & out_measured):
            m.d.sync += peak.eq(reduce(operator.or_, (Mux(y < 0, -y, y)[:16] for y in act.o.p), peak))
        pass_sent = Signal()                        # set in ROW when the pass's last pair is taken
        pass_out = taken_out & out_last
        m.d.sync += in_flight.eq(in_flight + pass_sent - pass_out)
        # each lane's segment: the last whose first channel is at most the lane's channel
        with m.If(beat_taken):
            m.d.sync += chan.eq(Mux(beat_last, 0, chan + lanes))
        for j in range(lanes):
            for s in range(1, ACTMUL_SEGMENTS):
                with m.If((s < segments) & (firsts[s] <= chan + j)):
                    m.d.comb += act.i.p.seg[j].eq(s)

        def lane(half, j):
            """Lane j of the beat of the job's gate (``half`` 0) or up (1) cutter, signed:
            byte j, or with IN16 bytes 2j and 2j + 1."""
            narrow, wide16 = cutters[8][half].o.p.data, cutters[16][half].o.p.data
            return Mux(in16, Cat(wide16[2 * j], wide16[2 * j + 1]).as_signed(), narrow[j].as_signed())
        for j in range(lanes):
            # a measure pass's lanes past the row's n channels (a beat's tail) count as 0
            past_row = measuring & (chan + j >= job.n)
            m.d.comb += [act.i.p.gate[j].eq(lane(0, j)),
                         act.i.p.up[j].eq(Mux(past_row, 0, Mux(ungated, 1, lane(1, j)))),
                         writer.i.p.y[j].eq(act.o.p[j])]

        # the row's exponent from the measure pass's peak: numerics.act_row_exponent
        peak_bits = Signal(range(17))
        for i in range(16):
            with m.If(peak[i]):
                m.d.comb += peak_bits.eq(i + 1)
        needed = Signal(signed(8))
        m.d.comb += needed.eq(peak_bits + exp_max - Mux(wide, 15, 7))
        measured = Mux(needed < 0, 0, Mux(needed > exp_max, exp_max, needed))
        drained = (in_flight == 0)

        with m.FSM(name="actmul"):
            with m.State("IDLE"):
                m.d.comb += self.job.ready.eq(1)
                with m.If(self.job.valid):
                    p = self.job.payload
                    m.d.sync += [job.eq(p),
                                 in_bytes.eq(Mux(flags_view(p.flags).ungated, p.n, 2 * p.n)
                                             << flags_view(p.flags).in16),
                                 out_bytes.eq(Mux(flags_view(p.flags).wide, 2 * p.n, p.n)),
                                 row.eq(0), block_chunk.eq(0), block.eq(0), chan.eq(0),
                                 exp_max.eq(0),
                                 param_issued.eq(0),
                                 error.eq(ErrorCode.OK), *progress.restart()]
                    m.next = "PARAM_CMD"
            with m.State("PARAM_CMD"):
                with m.If((job.rows > c.rows) | (job.k > ACTMUL_SEGMENTS)):
                    m.d.sync += error.eq(ErrorCode.PROGRAM)
                    m.next = "DONE"
                with m.Else():
                    m.d.comb += read_request(reader, job.addr, segments * ACT_PARAM_BYTES,
                                             lines_of(segments * ACT_PARAM_BYTES, self.param_line))
                    with m.If(reader.cmd.ready):
                        m.next = "PARAMS"
            with m.State("PARAMS"):                     # until every block's last chunk
                with m.If(block >= segments):
                    m.next = "CHECK"
            with m.State("CHECK"):
                with m.If(job_spans_outside(c, job, in_bytes, out_bytes)):
                    m.d.sync += error.eq(ErrorCode.BAD_ADDRESS)
                    m.next = "DONE"
                with m.Elif(job.n == 0):                # nothing to read or write
                    m.next = "DONE"
                with m.Else():
                    m.next = "WRITE_CMD"
            with m.State("WRITE_CMD"):
                m.d.comb += span_request(self.vmem_wr_cmd, job.dst, job.rows, out_bytes)
                with m.If(self.vmem_wr_cmd.ready):
                    m.d.sync += [measuring.eq(rowexp), exp.eq(0), peak.eq(0)]
                    m.next = "ROW_ALIGN"
            # the up half starts n bytes into the row, n mod L into a write pass's span
            up_skip = Mux(up_only, gate_bytes[:exact_log2(L)], gate_bytes)
            with m.State("ROW_ALIGN"):
                # an ungated row has no up half: the aligner passes its gate through
                m.d.comb += [up_align.setup.valid.eq(1),
                             up_align.setup.p.skip.eq(Mux(ungated, 0, up_skip)),
                             up_align.setup.p.lines.eq(gate_lines)]
                m.d.sync += [row_line.eq(0), pair.eq(0)]
                # a write pass: the row's exponent is known
                m.d.comb += [self.exp_we.eq(rowexp & ~measuring), self.exp_row.eq(row),
                             self.exp_value.eq(exp)]
                with m.If(up_align.setup.ready):
                    m.next = "ROW_CMD"
            with m.State("ROW_CMD"):
                row_start = job.src + row * lines_of(in_bytes, L)
                m.d.comb += span_request(self.vmem_rd_cmd, row_start + Mux(up_only, n_lines_in, 0), 1,
                                         in_bytes - Mux(up_only, n_lines_in * L, 0))
                with m.If(self.vmem_rd_cmd.ready):
                    m.next = "ROW"
            with m.State("ROW"):
                with m.If(pair_taken & up_align.o.p.last):
                    m.d.comb += pass_sent.eq(1)
                    with m.If(measuring):
                        m.next = "MEASURED"
                    with m.Elif(~rowexp):
                        progress.end_row(m, row, job.rows, next_row_state="ROW_ALIGN")
                    with m.Else():
                        progress.end_row(m, row, job.rows, next_row_state="DRAIN")
            with m.State("MEASURED"):                   # the measure pass's last beat is out
                with m.If(drained):
                    m.d.sync += [exp.eq(measured), measuring.eq(0)]
                    m.next = "ROW_ALIGN"
            with m.State("DRAIN"):                      # the write pass's last beat is out
                with m.If(drained):
                    m.d.sync += [measuring.eq(1), peak.eq(0)]
                    m.next = "ROW_ALIGN"
            progress.add_finish_states(m, job.rows, self.done)
        return m
