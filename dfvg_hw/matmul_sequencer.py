"""MATMUL sequencing: operands from VMEM and device memory through the matrix unit, results
back to VMEM or into the logit buffer (isa.md §3.4, ``FunctionalEngine._matmul``).

One MATMUL runs in row passes. A pass holds ``rows`` rows (``rows // 2`` wide rows, each
as a hi/lo digit pair, :func:`~dfvg_hw.numerics.wide_digits`):

1. **x load.** The pass's source rows are read from VMEM once and cut into K-slices in
   the x buffer (entry ``kt`` holds slice ``kt`` of every row slot, as the matrix unit's
   ``x`` port takes them), so the weights can stream without re-reading VMEM.
2. **Stream.** For each output group (``lanes`` channels): its weight tiles
   (``lanes·kpad`` bytes, tile-major in the image) and then its ``lanes`` requant words
   (after all tiles in the image) are read from device memory; each tile meets x-buffer
   entry ``kt`` in the matrix unit.
3. **Write-back.** Each output row of a group goes to VMEM (INT8: int8, RESADD: int16,
   the residual read from the same place first) or, in LOGITS mode, to the logit buffer.

Errors, in the functional model's order: the weight block past device memory
(``BAD_ADDRESS``), the source span outside VMEM (``BAD_ADDRESS``), LOGITS with
``rows ≠ 1`` or ``n > vocab_max`` (``PROGRAM``), the destination span outside VMEM
(``BAD_ADDRESS``).

Limits of this first sequencer: weight blocks must be aligned to the memory bus (the
image's blocks are) and ``4·lanes`` bytes (a group's requant words) at least one bus
beat; results are written one VMEM line per cycle.
"""

from __future__ import annotations

from amaranth import Cat, Const, Module, Mux, Signal, signed, unsigned
from amaranth.lib import data, stream, wiring
from amaranth.lib.memory import Memory
from amaranth.lib.wiring import In, Out

from dfvg_hw.config import EngineConfig, VMEM_LINE_BYTES
from dfvg_hw.descriptors import ErrorCode
from dfvg_hw.isa import MatmulMode
from dfvg_hw.matrix import DIGIT_BITS, MatrixUnit
from dfvg_hw.memory_port import MemoryCommand, ReadBeat
from dfvg_hw.sample_unit import LogitTile
from dfvg_hw.vmem import Gearbox, VmemSpan, VmemReadBeat

__all__ = ["MatmulSequencer", "MatmulJob"]

L = VMEM_LINE_BYTES


class MatmulJob(data.StructLayout):
    """One MATMUL as the controller hands it over: the instruction's fields and the
    weight block's device address (image base, offset and layer stride applied)."""

    def __init__(self):
        super().__init__({"addr": unsigned(64), "mode": unsigned(2), "wide": unsigned(1),
                          "rows": unsigned(8), "dst": unsigned(16), "src": unsigned(16),
                          "n": unsigned(16), "k": unsigned(16)})


class MatmulSequencer(wiring.Component):
    """Runs one MATMUL per ``job`` and answers with ``done`` and an error code.

    Members
    -------
    job : In(stream.Signature(MatmulJob()))
    done : Out(1)
        One-cycle pulse when the job is finished (``error`` says how).
    error : Out(8)
        :class:`~dfvg_hw.descriptors.ErrorCode` of the finished job (``OK`` = 0).
    read_cmd, read_data : memory-port read interface (controller side)
    vmem_rd_cmd, vmem_rd : the VMEM span reader (controller side)
    peek_addr, peek_data : VMEM random line reads (data one cycle after the address)
    poke_en, poke_addr, poke_data : VMEM random line writes with a byte mask
    vmem_error : In(1)
        The VMEM refused a span.
    logits_begin, logits_n, logits : the logit buffer's write side
    """

    @staticmethod
    def supports(config: EngineConfig, data_width: int) -> bool:
        """Whether this sequencer handles the geometry: a result row of a group (``lanes``
        int16) fits in one VMEM line, and a group's requant words fill whole bus beats."""
        return 2 * config.lanes <= L and (4 * config.lanes) % (data_width // 8) == 0

    def __init__(self, config: EngineConfig, data_width: int):
        if not self.supports(config, data_width):
            raise ValueError(f"MatmulSequencer does not handle lanes={config.lanes} with a "
                             f"{data_width}-bit bus yet")
        self.config = config
        self.data_width = data_width
        c = config
        self.x_depth = c.vmem_bytes // c.reduce          # K-slices of the longest int8 row
        super().__init__(wiring.Signature({
            "job": In(stream.Signature(MatmulJob())),
            "done": Out(1),
            "error": Out(8),
            "read_cmd": Out(stream.Signature(MemoryCommand(config))),
            "read_data": In(stream.Signature(ReadBeat(data_width))),
            "vmem_rd_cmd": Out(stream.Signature(VmemSpan(config))),
            "vmem_rd": In(stream.Signature(VmemReadBeat())),
            "vmem_error": In(1),
            "peek_addr": Out(16),
            "peek_data": In(8 * L),
            "poke_en": Out(L),
            "poke_addr": Out(16),
            "poke_data": Out(8 * L),
            "logits_begin": Out(1),
            "logits_n": Out(16),
            "logits": Out(stream.Signature(LogitTile(c.lanes))),
        }))

    def elaborate(self, platform):
        m = Module()
        c, DW = self.config, self.data_width
        M, N, K = c.rows, c.lanes, c.reduce
        beat_bytes = DW // 8
        slot_bits = K * DIGIT_BITS
        mx = m.submodules.matrix = MatrixUnit(c)
        xbuf = m.submodules.x_buffer = Memory(shape=unsigned(M * slot_bits), depth=self.x_depth,
                                             init=[])
        xw, xr = xbuf.write_port(granularity=slot_bits), xbuf.read_port()
        cut8 = m.submodules.cut_int8 = Gearbox(L, K)          # VMEM lines → K int8
        cut16 = m.submodules.cut_int16 = Gearbox(L, 2 * K)    # VMEM lines → K int16
        tiles = m.submodules.tiles = Gearbox(beat_bytes, N * K)

        job = Signal(MatmulJob())
        n_groups, k_tiles = Signal(16), Signal(16)
        stride_in, stride_out, out_bytes = Signal(32), Signal(32), Signal(32)
        per_pass = Mux(job.wide, M // 2, M)
        first, pass_rows = Signal(8), Signal(8)
        weight_bytes = Signal(48)
        out_eb = Mux(job.mode == MatmulMode.INT8, 1, 2)

        def padded(x, mult):
            return (x + mult - 1) // mult * mult

        m.d.comb += self.job.ready.eq(0)
        with m.FSM(name="matmul"):
            with m.State("IDLE"):
                m.d.comb += self.job.ready.eq(1)
                with m.If(self.job.valid):
                    p = self.job.payload
                    npad, kpad = padded(p.n, N), padded(p.k, K)
                    in_bytes = p.k * Mux(p.wide, 2, 1)
                    m.d.sync += [job.eq(p), n_groups.eq(npad // N), k_tiles.eq(kpad // K),
                                 weight_bytes.eq(npad * kpad), first.eq(0),
                                 stride_in.eq(padded(in_bytes, L)),
                                 stride_out.eq(padded(p.n * Mux(p.mode == MatmulMode.INT8, 1, 2), L)),
                                 out_bytes.eq(p.n * Mux(p.mode == MatmulMode.INT8, 1, 2))]
                    m.next = "RANGE"
            with m.State("RANGE"):
                end = job.addr + weight_bytes + 4 * n_groups * N
                with m.If(end > c.mem_bytes):
                    m.d.sync += self.error.eq(ErrorCode.BAD_ADDRESS)
                    m.next = "DONE"
                with m.Else():
                    m.next = "PASS"

            # -- x load ---------------------------------------------------------------------------
            with m.State("PASS"):
                rows_left = job.rows - first
                m.d.sync += pass_rows.eq(Mux(rows_left > per_pass, per_pass, rows_left))
                m.next = "X_CMD"
            with m.State("X_CMD"):
                m.d.comb += [self.vmem_rd_cmd.valid.eq(1),
                             self.vmem_rd_cmd.payload.line.eq(job.src + first * stride_in // L),
                             self.vmem_rd_cmd.payload.rows.eq(pass_rows),
                             self.vmem_rd_cmd.payload.row_bytes.eq(_saturate(
                                 job.k * Mux(job.wide, 2, 1), len(self.vmem_rd_cmd.payload.row_bytes)))]
                with m.If(self.vmem_rd_cmd.ready):
                    m.next = "X_LOAD"
            x_row, x_kt = Signal(8), Signal(16)
            with m.State("X_LOAD"):
                src = self.vmem_rd
                for cut in (cut8, cut16):
                    m.d.comb += [cut.i.payload.data.eq(src.payload.data),
                                 cut.i.payload.last.eq(src.payload.row_last)]
                m.d.comb += [cut8.i.valid.eq(src.valid & ~job.wide), cut16.i.valid.eq(src.valid & job.wide),
                             src.ready.eq(Mux(job.wide, cut16.i.ready, cut8.i.ready)),
                             cut8.o.ready.eq(1), cut16.o.ready.eq(1)]
                slice_valid = Mux(job.wide, cut16.o.valid, cut8.o.valid)
                slice_last = Mux(job.wide, cut16.o.payload.last, cut8.o.payload.last)
                # the slice as matrix-unit digits, placed in its row slot(s)
                slots = Signal(M * slot_bits)
                enable = Signal(M)
                int8_digits = Cat(*(_sext(b, DIGIT_BITS) for b in cut8.o.payload.data))
                hi_digits, lo_digits = [], []
                for j in range(K):
                    v = Cat(cut16.o.payload.data[2 * j], cut16.o.payload.data[2 * j + 1]).as_signed()
                    lo_digits.append(_sext(v[:8], DIGIT_BITS))
                    hi_digits.append((v[8:].as_signed() + v[7])[:DIGIT_BITS])
                with m.If(job.wide):
                    for r in range(M // 2):
                        with m.If(x_row == r):
                            m.d.comb += [slots.word_select(2 * r, slot_bits).eq(Cat(*hi_digits)),
                                         slots.word_select(2 * r + 1, slot_bits).eq(Cat(*lo_digits)),
                                         enable.eq(0b11 << (2 * r))]
                with m.Else():
                    for r in range(M):
                        with m.If(x_row == r):
                            m.d.comb += [slots.word_select(r, slot_bits).eq(int8_digits),
                                         enable.eq(1 << r)]
                m.d.comb += [xw.addr.eq(x_kt), xw.data.eq(slots),
                             xw.en.eq(Mux(slice_valid & (x_kt < k_tiles), enable, 0))]
                with m.If(slice_valid):
                    m.d.sync += x_kt.eq(x_kt + 1)
                    with m.If(slice_last):
                        m.d.sync += [x_kt.eq(0), x_row.eq(x_row + 1)]
                        with m.If(x_row + 1 == pass_rows):
                            m.d.sync += x_row.eq(0)
                            m.next = "CHECK"
                with m.If(self.vmem_error):
                    m.d.sync += [self.error.eq(ErrorCode.BAD_ADDRESS), x_kt.eq(0), x_row.eq(0)]
                    m.next = "DONE"
            with m.State("CHECK"):
                logits = job.mode == MatmulMode.LOGITS
                dst_end = job.dst * L + (job.rows - 1) * stride_out + out_bytes
                with m.If(logits & ((job.rows != 1) | (job.n > c.vocab_max))):
                    m.d.sync += self.error.eq(ErrorCode.PROGRAM)
                    m.next = "DONE"
                with m.Elif(~logits & (dst_end > c.vmem_bytes)):
                    m.d.sync += self.error.eq(ErrorCode.BAD_ADDRESS)
                    m.next = "DONE"
                with m.Else():
                    m.d.comb += [self.logits_begin.eq(logits), self.logits_n.eq(job.n)]
                    m.next = "STREAM"

            # -- stream weights and requant words; write results back ------------------------------
            cmd_group, cmd_q = Signal(16), Signal()
            data_q, data_beats = Signal(), Signal(32)
            out_group, out_count = Signal(16), Signal(16)
            with m.State("STREAM"):
                tile_beats = N * k_tiles * K // beat_bytes
                q_beats = max(1, 4 * N // beat_bytes)
                # commands: tiles of group g, then its requant words
                with m.If(cmd_group < n_groups):
                    m.d.comb += [
                        self.read_cmd.valid.eq(1),
                        self.read_cmd.payload.addr.eq(Mux(cmd_q,
                                                          job.addr + weight_bytes + 4 * N * cmd_group,
                                                          job.addr + cmd_group * N * k_tiles * K)),
                        self.read_cmd.payload.length.eq(Mux(cmd_q, 4 * N, N * k_tiles * K)),
                    ]
                    with m.If(self.read_cmd.ready):
                        m.d.sync += cmd_q.eq(~cmd_q)
                        with m.If(cmd_q):
                            m.d.sync += cmd_group.eq(cmd_group + 1)
                # data: route beats to the tile cutter or the requant-word register
                beat = self.read_data
                qbuf = Signal(32 * N)
                q_full = Signal()
                m.d.comb += [tiles.i.payload.data.eq(beat.payload.data),
                             tiles.i.payload.last.eq(0)]
                with m.If(~data_q):
                    m.d.comb += [tiles.i.valid.eq(beat.valid), beat.ready.eq(tiles.i.ready)]
                    with m.If(beat.valid & tiles.i.ready):
                        m.d.sync += data_beats.eq(data_beats + 1)
                        with m.If(data_beats + 1 == tile_beats):
                            m.d.sync += [data_beats.eq(0), data_q.eq(1)]
                with m.Else():
                    m.d.comb += beat.ready.eq(~q_full)
                    with m.If(beat.valid & ~q_full):
                        if q_beats > 1:
                            m.d.sync += qbuf.word_select(data_beats[:(q_beats - 1).bit_length()],
                                                         DW).eq(beat.payload.data)
                        else:
                            m.d.sync += qbuf.eq(beat.payload.data[:32 * N])
                        m.d.sync += data_beats.eq(data_beats + 1)
                        with m.If(data_beats + 1 == q_beats):
                            m.d.sync += [data_beats.eq(0), data_q.eq(0), q_full.eq(1)]
                m.d.comb += [mx.q.valid.eq(q_full), mx.q.payload.words.as_value().eq(qbuf),
                             mx.q.payload.mode.eq(job.mode), mx.q.payload.wide.eq(job.wide),
                             mx.q.payload.rows.eq(pass_rows)]
                with m.If(mx.q.valid & mx.q.ready):
                    m.d.sync += q_full.eq(0)
                # tiles meet x-buffer entries: the read port shows entry `x_at`
                kt, x_at = Signal(16), Signal(16)
                take = mx.w.valid & mx.w.ready
                next_kt = Mux(kt + 1 == k_tiles, 0, kt + 1)
                m.d.comb += [xr.addr.eq(Mux(take, next_kt, kt)),
                             mx.w.valid.eq(tiles.o.valid & (x_at == kt)),
                             mx.w.payload.data.as_value().eq(tiles.o.payload.data.as_value()),
                             mx.w.payload.last.eq(kt + 1 == k_tiles),
                             tiles.o.ready.eq(mx.w.ready & (x_at == kt)),
                             mx.x.valid.eq(mx.w.valid),
                             mx.x.payload.as_value().eq(xr.data)]
                m.d.sync += x_at.eq(xr.addr)
                with m.If(take):
                    m.d.sync += kt.eq(next_kt)

                # RESADD: the residual of each output row, read in output order (group by
                # group, its rows in turn); `peek_at` is the line whose data is on peek_data
                res_group, res_row, peek_at = Signal(16), Signal(8), Signal(16)
                res_offset = (first + res_row) * stride_out + res_group * N * 2
                res_line = (job.dst + res_offset // L)[:16]
                res_bytes = self.peek_data >> (8 * (res_offset % L))
                m.d.comb += self.peek_addr.eq(res_line)
                m.d.sync += peek_at.eq(res_line)
                m.d.comb += mx.res.valid.eq((job.mode == MatmulMode.RESADD) & (peek_at == res_line))
                for lane in range(N):
                    m.d.comb += mx.res.payload[lane].eq(res_bytes.word_select(lane, 16).as_signed())
                with m.If(mx.res.valid & mx.res.ready):
                    m.d.sync += res_row.eq(res_row + 1)
                    with m.If(res_row + 1 == pass_rows):
                        m.d.sync += [res_row.eq(0), res_group.eq(res_group + 1)]

                # results: one row of a group per beat, to the logit buffer or into dst
                o = mx.o
                with m.If(job.mode == MatmulMode.LOGITS):
                    m.d.comb += [self.logits.valid.eq(o.valid), o.ready.eq(self.logits.ready),
                                 self.logits.payload.data.as_value().eq(o.payload.data.as_value())]
                with m.Else():
                    # N·eb ≤ 16 bytes at byte `row·stride + group·N·eb` of dst: inside one line;
                    # the lanes past n are not written
                    offset = (first + o.payload.row) * stride_out + out_group * N * out_eb
                    shift = offset % L
                    int8_bytes = Cat(*(v[:8] for v in o.payload.data))
                    int16_bytes = Cat(*(v[:16] for v in o.payload.data))
                    in_row = Cat(*((out_group * N * out_eb + i) < out_bytes for i in range(2 * N)))
                    mask = Mux(out_eb == 1, in_row[:N], in_row[:2 * N])
                    m.d.comb += [self.poke_addr.eq(job.dst + offset // L),
                                 self.poke_data.eq(Mux(out_eb == 1, int8_bytes, int16_bytes) << (8 * shift)),
                                 self.poke_en.eq(Mux(o.valid, mask << shift, 0)),
                                 o.ready.eq(1)]
                with m.If(o.valid & o.ready & o.payload.last):
                    m.d.sync += out_group.eq(out_group + 1)
                    with m.If(out_group + 1 == n_groups):
                        m.d.sync += [out_group.eq(0), cmd_group.eq(0), cmd_q.eq(0), kt.eq(0),
                                     res_group.eq(0), res_row.eq(0), first.eq(first + pass_rows)]
                        m.next = "NEXT_PASS"
            with m.State("NEXT_PASS"):
                with m.If(first < job.rows):
                    m.next = "PASS"
                with m.Else():
                    m.next = "DONE"
            with m.State("DONE"):
                m.d.comb += self.done.eq(1)
                m.d.sync += [first.eq(0)]
                m.next = "CLEAR"
            with m.State("CLEAR"):
                m.d.sync += self.error.eq(0)
                m.next = "IDLE"
        return m


def _sext(value, bits):
    """Sign-extend a value (taken as signed) to ``bits`` bits."""
    v = value.as_signed()
    return Cat(v, v[-1].replicate(bits - len(v)))


def _saturate(value, bits):
    """``value`` clamped to an unsigned ``bits``-bit field (its maximum stands for 'too big')."""
    top = (1 << bits) - 1
    return Mux(value > top, top, value)
