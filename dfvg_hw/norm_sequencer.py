"""RMSNORM sequencing (docs/isa.md §3.3, ``FunctionalEngine._unit``): the parameter
block from device memory, each int32 source row (each segment of one, ``k ≥ 2``) three
times through :class:`~dfvg_hw.rmsnorm.RMSNorm`, the normalised rows into VMEM.

Per job:

1. **Head.** The block's first line (``eps`` = word 0, ``gamma_shift`` = word 1) is read
   by a reader of its own; the read covers the block's 40-byte head, so a head past
   device memory is refused by the memory port (``BAD_ADDRESS``, the controller resets
   the sequencer).
2. **Checks**, in the functional model's order after the head: ``gamma_shift >
   GAMMA_SHIFT_MAX`` (``PROGRAM``); gamma past device memory, the source span, the
   destination span outside VMEM (all ``BAD_ADDRESS``). They are all made before VMEM's
   writer is given the destination span, so a refused instruction leaves VMEM untouched
   and no port waiting. ``rows > config.rows`` and segments off a line (below;
   ``PROGRAM``) are checked first of all, as ``_check_operands`` does.

   **Early start.** The head's memory latency is not paid in series: when what the
   instruction alone says passes (gamma, hence the head, inside device memory, both
   spans inside VMEM, ``n > 0``), ``gamma_shift`` is the only fault left, and row 0's
   pass 0 (a VMEM read into the row buffer) and the gamma read (gamma's read command
   right behind the head's: the port keeps both in flight and answers in order) start
   as the head's read is issued. Pass 1 samples ``eps``, so row 0's pass 1 waits for
   the head and its check; the destination span is given to VMEM's writer after it. A
   ``gamma_shift`` refused then (``PROGRAM``) ends the job after pass 0: the RMSNorm is
   reset and the gamma read emptied, so VMEM is untouched and no port waits. Otherwise
   (a fault the instruction shows, or ``n = 0``) the head is read and checked first,
   as above.
3. **Rows.** The destination is one write span (``rows`` rows); each source row
   (``4n`` bytes: the int32 residual) is read from VMEM as a one-row span for pass 0
   (the row's shift ``p``), its x beats kept in the **row buffer**
   (``timing.NORM_ROW_BUFFER_BYTES``, 16 KiB: rows up to 4096 elements); pass 1 (Σx'²)
   and pass 2 (every x beat meets the gamma beat of the same lanes) replay the buffer a
   beat a cycle instead of reading VMEM's lines again. A row longer than the
   buffer is read from VMEM three times, as three one-row spans. **Gamma** is read from
   device memory as the first row starts (row 0's with the head's read, on an early
   start; a later row's as soon as the reader has emptied the last gamma's beat),
   without holding up pass 0, so its latency hides behind passes 0 and 1 (on a port slower than a
   line a cycle the reader holds only a few of its lines before it holds memory back, so
   a long row's gamma comes at the port's rate once pass 2 catches up with it:
   ``sim.elementwise_timing._GammaLines``). Pass 2 of a row that fits
   the row buffer also keeps its gamma beats in the **gamma buffer**
   (``timing.NORM_GAMMA_BUFFER_BYTES``, 512 bytes: 256 elements, a QK-norm head) when
   they fit it; then the later rows read no gamma, and their pass 2 replays the buffer
   (indexed like the row buffer) a beat every ``timing.norm_gamma_replay_pace`` cycles,
   a gamma read's own pace, so that the row writer never falls behind. Otherwise gamma is
   re-read for every row, requested as the row starts: a buffer for any row would have
   to hold ``vmem_bytes / 2`` bytes, so a long row costs ``2n`` more bytes of
   device-memory traffic per extra row. Gamma is ``2n`` bytes cut into beats of
   ``2·lanes`` bytes, x ``4n`` bytes cut into beats of ``4·lanes``: below 8 lanes a row's
   last gamma line can give a beat or more past x's last one (padding lanes only), so
   the gamma cutter is emptied as each gamma read starts.

**Segments** (``k ≥ 2``: Qwen3's QK-norm, a row of heads each normalised on its own
with the one gamma of ``n``). Each row is ``k`` segments of ``n`` elements, and ``n``
must be a multiple of the VMEM line (``vmem_line_bytes``, else ``PROGRAM``), so every segment starts on a VMEM line in
the int32 source (``4n`` bytes) and in the int8 or int16 output (``n`` or ``2n``): the
rows' segments lie end to end, and the job runs as ``rows·k`` rows of ``n`` — the
checks, the row loop, the gamma buffer, the cycle model's price (``rmsnorm_cycles`` of
``rows·k`` rows). Only VMEM's write span stays ``rows`` rows of
``k`` segments (the same lines; its ``rows`` field is 8 bits). ``k`` of 0 or 1 is one
segment.

Parameter blocks may sit at any byte address (:class:`~dfvg_hw.line_streams.UnalignedReader`):
compiled images align them to 16 bytes, but a 256-bit bus needs 32, and gamma itself
is at ``addr + 40``.

A row of ``n`` elements that fits the buffer takes about ``max(ℓ, b) + 2b`` cycles of
beats (``ℓ = ceil(4n/L)`` VMEM lines of ``L`` bytes, ``b = ℓ·max(1, L/(4·lanes))`` beats,
or ``ceil(ℓ·L/(4·lanes))`` from ``4·lanes > L`` on; pass 2 can be paced by gamma's lines,
``2·lanes/L`` a beat, and the writer's) plus one VMEM read latency (``NORM_PASS_START``), the shift's
``RMSNORM_SHIFT_TURNAROUND`` and :meth:`~dfvg_hw.rmsnorm.RMSNorm.turnaround`; a longer
row ``3·max(ℓ, b)`` plus three VMEM read latencies, the shift's turnaround hidden behind
the second one, and the rsqrt's turnaround; results are written as they come
(:func:`sim.elementwise_timing.rmsnorm_cycles` has it to the cycle). ``src == dst`` is exact: an output line is written only after the
input lines it overlays were read for the last time (the output row is never longer
than the input row, and starts no later). A destination overlapping the source
otherwise is not supported (the functional model reads all rows first).
"""

from __future__ import annotations

from amaranth import Cat, Module, Mux, ResetInserter, Signal, unsigned
from amaranth.lib import wiring
from amaranth.lib.memory import Memory
from amaranth.utils import exact_log2

from dfvg_hw.spec import numerics as nx
from dfvg_hw.spec import timing
from dfvg_hw.spec.config import EngineConfig
from dfvg_hw.spec.descriptors import ErrorCode
from dfvg_hw.spec.image import NORM_PARAM_BYTES

from dfvg_hw.line_streams import (RowWriteProgress, RowWriter, UnalignedReader, lines_of,
                                  read_request, span_request)
from dfvg_hw.operand_access import vmem_span_outside
from dfvg_hw.layouts import flags_view
from dfvg_hw.op_port import OpJob, OpSequencerSignature
from dfvg_hw.rmsnorm import RMSNorm
from dfvg_hw.vmem import Gearbox

__all__ = ["NormSequencer"]



class NormSequencer(wiring.Component):
    """Runs one RMSNORM per ``job`` (see the module docstring for the order of work and
    the checks) and answers with ``done`` and an error code.

    Parameters
    ----------
    config : EngineConfig
        ``lanes``, ``rows``, ``vmem_bytes``, ``mem_bytes``.
    data_width : int
        Memory bus width in bits (at least 128).

    Members
    -------
    job : In(stream.Signature(OpJob()))
        The RMSNORM: ``addr`` (parameter block), ``flags`` (``WIDE``), ``rows``, ``dst``,
        ``src``, ``n`` and ``k`` (segments per row).
    done : Out(1)
        One-cycle pulse: the job is finished, ``error`` holds its outcome.
    error : Out(8)
        :class:`~dfvg_hw.spec.descriptors.ErrorCode` (OK, PROGRAM or BAD_ADDRESS).
    read_cmd, read_data : the memory port's read side (parameter head and gamma, each
        through a reader of its own: the head's command first, its beats come first)
    vmem_rd_cmd, vmem_rd : VMEM's span reader (one-row spans, each segment-row once, or
        three times when longer than the row buffer)
    vmem_wr_cmd, vmem_wr, vmem_wr_done : VMEM's span writer (one span per job)
    vmem_error : In(1)
        Unused: spans are checked before they are issued.
    peek_addr, peek_data, poke_en, poke_addr, poke_data : unused (idle)
    """

    def __init__(self, config: EngineConfig, data_width: int):
        self.config, self.data_width = config, data_width
        #: x beats the row buffer holds (timing.norm_row_buffer_beats)
        self.buffer_beats = timing.norm_row_buffer_beats(config.lanes)
        super().__init__(OpSequencerSignature(config, data_width))

    def elaborate(self, platform):
        m = Module()
        c = self.config
        lanes, L = c.lanes, c.vmem_line_bytes
        reader = m.submodules.reader = UnalignedReader(c, self.data_width)       # gamma
        # the head has a reader of its own, so that gamma's read command follows the head's
        # at once (the port keeps both in flight and answers in order) instead of waiting
        # until the head's line is out
        head_reader = m.submodules.head_reader = UnalignedReader(c, self.data_width)
        norm = RMSNorm(c)
        abort = Signal()                    # a refused job leaves the RMSNorm after pass 0
        m.submodules.norm = ResetInserter({"sync": abort})(norm)
        x_cut = m.submodules.x_cut = Gearbox(L, 4 * lanes)         # VMEM lines → lanes × int32
        gamma_cut = Gearbox(L, 2 * lanes)                         # gamma lines → lanes × int16
        flush_gamma = Signal()              # a row's surplus gamma beats (below 8 lanes) go
        m.submodules.gamma_cut = ResetInserter({"sync": flush_gamma})(gamma_cut)
        writer = m.submodules.writer = RowWriter(c)
        depth = self.buffer_beats
        # the row buffer: pass 0's x beats, replayed a beat a cycle for passes 1 and 2 of a
        # row that fits (a longer row reads VMEM three times)
        x_buffer = m.submodules.x_buffer = Memory(shape=unsigned(32 * lanes), depth=depth, init=[])
        buf_wr, buf_rd = x_buffer.write_port(), x_buffer.read_port()
        written = Signal(range(depth + 1))          # pass-0 beats of the row in the buffer
        last_at = Signal(range(depth))              # the row's last beat
        fetch = Signal(range(depth + 1))            # the beat read next
        shown, shown_last = Signal(), Signal()      # buf_rd.data holds a beat (the last)
        replaying = Signal()
        # the gamma buffer: the first row's gamma beats as its pass 2 takes them, replayed
        # (indexed like the row buffer) by the later rows' pass 2 when they fit
        gamma_depth = timing.norm_gamma_buffer_beats(lanes)
        gamma_buffer = m.submodules.gamma_buffer = Memory(shape=unsigned(16 * lanes),
                                                          depth=gamma_depth, init=[])
        gamma_wr, gamma_rd = gamma_buffer.write_port(), gamma_buffer.read_port()
        gamma_fits = Signal()                       # this row's gamma beats fit the buffer
        gamma_kept = Signal()                       # the buffer holds the job's gamma
        pace_cycles = timing.norm_gamma_replay_pace(lanes, L)
        # cycles until the next replayed gamma beat (a bit at least: no empty Verilog vector)
        pace = Signal(range(max(pace_cycles, 2)))

        head_beats = Signal()               # the port's next beats are the head's
        with m.If(head_reader.read_cmd.valid):
            wiring.connect(m, head_reader.read_cmd, wiring.flipped(self.read_cmd))
            with m.If(self.read_cmd.ready):
                m.d.sync += head_beats.eq(1)
        with m.Else():
            wiring.connect(m, reader.read_cmd, wiring.flipped(self.read_cmd))
        with m.If(head_beats):
            wiring.connect(m, wiring.flipped(self.read_data), head_reader.read_data)
            with m.If(self.read_data.valid & self.read_data.ready & self.read_data.p.last):
                m.d.sync += head_beats.eq(0)
        with m.Else():
            wiring.connect(m, wiring.flipped(self.read_data), reader.read_data)

        # ``reads_done`` (the controller may then prefetch the next MATMUL's weights): a
        # one-row job (one segment) of an early start whose row fits the row buffer reads
        # the head and gamma once each and nothing after; it says so once gamma's reader
        # has given its last line (the port has then given every beat). Only where gamma
        # beats are packed from whole lines (2·lanes ≥ L: the cycle model's gamma takes);
        # other jobs never say so.
        reads_issued = Signal(2)
        with m.If(self.read_cmd.valid & self.read_cmd.ready & (reads_issued != 3)):
            m.d.sync += reads_issued.eq(reads_issued + 1)

        job = Signal(OpJob())
        wide = flags_view(job.flags).wide
        in_bytes = Signal(18)                       # 4n: an int32 row
        gamma_bytes = Signal(17)                    # 2n
        out_bytes = Signal(17)                      # n, or 2n when wide
        eps, gamma_shift = Signal(32), Signal(32)
        # k ≥ 2: each row is k segments of n, each normalised on its own; a segment starts
        # on a line in the source and the destination alike (n % L == 0, checked), so the
        # job runs as rows·k rows of n laid end to end
        segments = Mux(job.k > 1, job.k, 1)
        segment_rows = Signal(len(job.rows) + len(job.k))     # set with the job
        early = Signal()                                      # the job took an early start
        row = Signal.like(segment_rows)                       # the segment-row being normalised
        error = Signal(8)
        gamma_addr = job.addr + NORM_PARAM_BYTES

        m.d.comb += [
            self.error.eq(error),
            norm.eps.eq(eps), norm.gamma_shift.eq(gamma_shift[:5]), norm.wide.eq(wide),
            writer.i.valid.eq(norm.o.valid), writer.i.p.last.eq(norm.o.p.last),
            norm.o.ready.eq(writer.i.ready),
            # VMEM lines feed x_cut, memory lines gamma_cut (except the head's line)
            x_cut.i.valid.eq(self.vmem_rd.valid), x_cut.i.p.data.eq(self.vmem_rd.p.data),
            x_cut.i.p.last.eq(self.vmem_rd.p.row_last), self.vmem_rd.ready.eq(x_cut.i.ready),
            gamma_cut.i.valid.eq(reader.o.valid), gamma_cut.i.p.data.eq(reader.o.p.data),
            gamma_cut.i.p.last.eq(reader.o.p.last), reader.o.ready.eq(gamma_cut.i.ready),
        ]
        m.d.comb += [writer.i.p.y[j].eq(norm.o.p.y[j]) for j in range(lanes)]
        x_bytes = Mux(replaying, buf_rd.data, x_cut.o.p.data.as_value())
        g_bytes = Mux(gamma_kept, gamma_rd.data, gamma_cut.o.p.data.as_value())
        for j in range(lanes):
            m.d.comb += [norm.i.p.x[j].eq(x_bytes.word_select(j, 32)),
                         norm.i.p.gamma[j].eq(g_bytes.word_select(j, 16))]
        m.d.comb += norm.i.p.last.eq(Mux(replaying, shown_last, x_cut.o.p.last))

        # pass 0 fills the buffer; a replay reads it a beat a cycle, one beat ahead
        pass0_take = Signal()
        m.d.comb += [buf_wr.en.eq(pass0_take & (written < depth)), buf_wr.addr.eq(written),
                     buf_wr.data.eq(x_cut.o.p.data.as_value())]
        with m.If(pass0_take & (written < depth)):
            m.d.sync += written.eq(written + 1)
        replay_take = Signal()
        replay_adv = replaying & (~shown | replay_take)
        m.d.comb += [buf_rd.en.eq(replay_adv), buf_rd.addr.eq(fetch),
                     gamma_rd.en.eq(replay_adv), gamma_rd.addr.eq(fetch),
                     gamma_wr.addr.eq(fetch - 1), gamma_wr.data.eq(gamma_cut.o.p.data.as_value())]
        with m.If(pace != 0):
            m.d.sync += pace.eq(pace - 1)
        with m.If(replay_adv):
            m.d.sync += [shown.eq(fetch <= last_at), shown_last.eq(fetch == last_at),
                         fetch.eq(fetch + 1)]

        # a row's gamma read is requested as the row starts (row 0's with the head's read)
        # and issued as soon as gamma's reader takes it (it may still be emptying the last
        # gamma's beat): pass 0 does not wait for it
        gamma_wanted = Signal()
        gamma_reading = Signal()                # the reader has taken a gamma read not all out
        with m.If(gamma_wanted):
            m.d.comb += [*read_request(reader, gamma_addr, gamma_bytes, lines_of(gamma_bytes, L)),
                         flush_gamma.eq(reader.cmd.ready)]
            with m.If(reader.cmd.ready):
                m.d.sync += [gamma_wanted.eq(0), gamma_reading.eq(1)]
        head_pending = Signal()                 # the head's line is still to come
        m.d.comb += head_reader.o.ready.eq(1)
        with m.If(head_reader.o.valid):
            head = head_reader.o.p.data.as_value()
            m.d.sync += [eps.eq(head[:32]), gamma_shift.eq(head[32:64]), head_pending.eq(0)]
        with m.If(reader.o.valid & reader.o.ready & reader.o.p.last):
            m.d.sync += gamma_reading.eq(0)
        if 2 * lanes >= L:
            m.d.comb += self.reads_done.eq(early & (segment_rows == 1) & (job.n <= depth * lanes)
                                           & (reads_issued == 2) & ~gamma_wanted & ~gamma_reading)

        # an early start (everything the instruction says checked in HEAD_CMD): row 0's
        # pass 0 and the gamma read go while the head is read; the head's check comes before
        # pass 1 (which samples eps) and the destination span after it
        checking = Signal()                     # the head's gamma_shift is still to check
        refused = Signal()                      # ... and was refused: PROGRAM after pass 0
        write_wanted = Signal()
        with m.If(checking & ~head_pending):
            m.d.sync += checking.eq(0)
            with m.If(gamma_shift > nx.GAMMA_SHIFT_MAX):
                m.d.sync += [refused.eq(1), error.eq(ErrorCode.PROGRAM), gamma_wanted.eq(0)]
            with m.Else():
                m.d.sync += write_wanted.eq(1)
        hold = checking | refused               # pass 1 of row 0 waits for the check
        with m.If(write_wanted):
            m.d.comb += span_request(self.vmem_wr_cmd, job.dst, job.rows, segments * out_bytes)
            with m.If(self.vmem_wr_cmd.ready):
                m.d.sync += write_wanted.eq(0)

        def start_replay():
            return [fetch.eq(0), shown.eq(0), shown_last.eq(0), pace.eq(0)]
        progress = RowWriteProgress(m, writer, self.vmem_wr, self.vmem_wr_done,
                                    wide=wide, row_bytes=out_bytes)

        def request_source_row():
            """Source segment-row ``row`` as a one-row span (each is read up to three times)."""
            return span_request(self.vmem_rd_cmd, job.src + row * lines_of(in_bytes, L), 1, in_bytes)

        with m.FSM(name="rmsnorm"):
            with m.State("IDLE"):
                m.d.comb += self.job.ready.eq(1)
                with m.If(self.job.valid):
                    p = self.job.payload
                    p_wide = flags_view(p.flags).wide
                    m.d.sync += [job.eq(p), in_bytes.eq(4 * p.n), gamma_bytes.eq(2 * p.n),
                                 out_bytes.eq(Mux(p_wide, 2 * p.n, p.n)), row.eq(0), gamma_kept.eq(0),
                                 segment_rows.eq(p.rows * Mux(p.k > 1, p.k, 1)),
                                 refused.eq(0), error.eq(ErrorCode.OK), *progress.restart(),
                                 reads_issued.eq(0), early.eq(0)]
                    m.next = "HEAD_CMD"
            # what the instruction alone says: gamma (so the head) inside memory, both spans
            # inside VMEM; then the head's gamma_shift is the only fault left
            static_ok = ~((gamma_addr + gamma_bytes > c.mem_bytes)
                          | vmem_span_outside(c, job.src, segment_rows, in_bytes)
                          | vmem_span_outside(c, job.dst, segment_rows, out_bytes))
            with m.State("HEAD_CMD"):
                with m.If((job.rows > c.rows) | ((job.k > 1) & (job.n[:exact_log2(L)] != 0))):
                    m.d.sync += error.eq(ErrorCode.PROGRAM)
                    m.next = "DONE"
                with m.Else():
                    m.d.comb += read_request(head_reader, job.addr, NORM_PARAM_BYTES, lines=1)
                    with m.If(head_reader.cmd.ready):
                        m.d.sync += head_pending.eq(1)
                        with m.If(static_ok & (job.n != 0)):
                            m.d.sync += [checking.eq(1), gamma_wanted.eq(1), early.eq(1)]
                            m.next = "PASS0_CMD"
                        with m.Else():                  # today's order: faults, or n = 0
                            m.next = "HEAD"
            with m.State("HEAD"):
                with m.If(head_reader.o.valid):         # taken by head_pending
                    m.next = "CHECK"
            with m.State("CHECK"):
                with m.If(gamma_shift > nx.GAMMA_SHIFT_MAX):
                    m.d.sync += error.eq(ErrorCode.PROGRAM)
                    m.next = "DONE"
                with m.Elif(~static_ok):
                    m.d.sync += error.eq(ErrorCode.BAD_ADDRESS)
                    m.next = "DONE"
                with m.Elif(job.n == 0):                # nothing to read or write
                    m.next = "DONE"
                with m.Else():
                    m.next = "WRITE_CMD"
            with m.State("WRITE_CMD"):
                # the same lines as rows·k rows of n: the span's rows field is 8 bits
                m.d.comb += span_request(self.vmem_wr_cmd, job.dst, job.rows, segments * out_bytes)
                with m.If(self.vmem_wr_cmd.ready):
                    m.d.sync += gamma_wanted.eq(1)
                    m.next = "PASS0_CMD"
            with m.State("PASS0_CMD"):
                m.d.comb += request_source_row()
                m.d.sync += written.eq(0)
                with m.If(self.vmem_rd_cmd.ready):
                    m.next = "PASS0"
            with m.State("PASS0"):                       # the row's shift: gamma is not looked at
                m.d.comb += [norm.i.valid.eq(x_cut.o.valid), x_cut.o.ready.eq(norm.i.ready),
                             pass0_take.eq(x_cut.o.valid & norm.i.ready)]
                with m.If(pass0_take & x_cut.o.p.last):
                    with m.If(written < depth):          # the whole row is in the buffer
                        m.d.sync += [last_at.eq(written), *start_replay(),
                                     gamma_fits.eq(written < gamma_depth)]
                        m.next = "PASS1_REPLAY"
                    with m.Else():
                        m.d.sync += gamma_fits.eq(0)
                        m.next = "PASS1_CMD"
            with m.State("PASS1_REPLAY"):                # Σx² from the buffer
                m.d.comb += [replaying.eq(1), norm.i.valid.eq(shown & ~hold),
                             replay_take.eq(shown & ~hold & norm.i.ready)]
                with m.If(refused):
                    m.next = "REFUSED"
                with m.If(replay_take & shown_last):
                    m.d.sync += start_replay()
                    m.next = "PASS2_REPLAY"
            with m.State("PASS2_REPLAY"):                # x beats from the buffer meet gamma
                # the gamma read's beats (kept as they go when they fit), or the kept ones
                # a gamma read's pace apart
                both = shown & Mux(gamma_kept, pace == 0, gamma_cut.o.valid)
                m.d.comb += [replaying.eq(1), norm.i.valid.eq(both),
                             replay_take.eq(both & norm.i.ready),
                             gamma_cut.o.ready.eq(replay_take & ~gamma_kept),
                             gamma_wr.en.eq(replay_take & ~gamma_kept & gamma_fits)]
                with m.If(replay_take & gamma_kept):
                    m.d.sync += pace.eq(pace_cycles - 1)
                with m.If(replay_take & shown_last):
                    progress.end_row(m, row, segment_rows, next_row_state="PASS0_CMD")
                    m.d.sync += [gamma_wanted.eq((row + 1 != segment_rows) & ~gamma_fits),
                                 gamma_kept.eq(gamma_fits)]
            with m.State("PASS1_CMD"):
                with m.If(refused):
                    m.next = "REFUSED"
                with m.Elif(~checking):
                    m.d.comb += request_source_row()
                    with m.If(self.vmem_rd_cmd.ready):
                        m.next = "PASS1"
            with m.State("REFUSED"):
                # pass 0 is over: the RMSNorm forgets it, the gamma read (if the reader
                # took it) is emptied, so that no port waits on this job
                m.d.comb += [abort.eq(1), gamma_cut.i.valid.eq(0), reader.o.ready.eq(1)]
                with m.If(~gamma_reading & ~gamma_wanted):
                    m.next = "DONE"
            with m.State("PASS1"):                       # Σx²: gamma is not looked at
                m.d.comb += [norm.i.valid.eq(x_cut.o.valid), x_cut.o.ready.eq(norm.i.ready)]
                with m.If(x_cut.o.valid & norm.i.ready & x_cut.o.p.last):
                    m.next = "PASS2_CMD"
            with m.State("PASS2_CMD"):
                m.d.comb += request_source_row()
                with m.If(self.vmem_rd_cmd.ready):
                    m.next = "PASS2"
            with m.State("PASS2"):                       # x beats meet gamma beats
                both = x_cut.o.valid & gamma_cut.o.valid
                take = both & norm.i.ready
                m.d.comb += [norm.i.valid.eq(both), x_cut.o.ready.eq(take),
                             gamma_cut.o.ready.eq(take)]
                with m.If(take & x_cut.o.p.last):
                    progress.end_row(m, row, segment_rows, next_row_state="PASS0_CMD")
                    m.d.sync += gamma_wanted.eq(row + 1 != segment_rows)
            # the writer counts rows in 8 bits: once VMEM's wr_done has come, every
            # segment-row but possibly the last has left it, so the low 8 bits tell
            progress.add_finish_states(m, segment_rows[:8], self.done)
        return m
