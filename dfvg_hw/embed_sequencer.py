"""EMBED sequencing (docs/isa.md §3.2, ``FunctionalEngine._unit``): one row of a table
from device memory into VMEM, the row of the current forward's token or, with
``POSITION``, of the controller's position POS (OPT's learned position embeddings).

Per job:

1. **Index.** With ``POSITION``, the job's ``pos``: nothing to read. Otherwise the
   controller's TOKEN: the drafted token (``token_is_drafted``), taken with the job, or
   the request's input token, read as the job is taken (one bus beat, the word at
   ``token_addr``). That read is issued in the cycle the job is offered, so the
   controller lends this sequencer the memory port from its job cycle on.
2. **Span.** ``POS ≥ kv_positions`` (``POSITION`` only) faults ``KV_OVERFLOW`` in this
   cycle, before anything moves, as ROPE's position check. Else VMEM's writer is given
   the destination, one row of ``4n`` bytes (int32, the residual stream) from line
   ``dst`` (``BAD_ADDRESS`` if it leaves VMEM).
3. **Row.** ``4n`` bytes from ``addr + index · S``, where ``S`` =
   :func:`~dfvg_hw.spec.image.embed_row_stride` ``(n, B)`` is the row padded to whole
   engine beats (``B`` = ``row_beat_bits / 8``, ``EngineConfig.mem_beat_bytes``: every
   row starts on an engine beat whatever ``n``), read on the sequencer's own bus (the
   controller's narrow path, ``data_width``), cut into VMEM lines by a
   :class:`~dfvg_hw.vmem.Gearbox` (emptied before each row: a row that ends inside a beat
   leaves that beat's other lines behind) and written a line a cycle. The memory port
   refuses a row address off its beat (``BAD_ADDRESS``: a table not on a beat), which is
   the functional model's alignment check on ``addr + index · S``.

A ``POSITION`` job thus costs what a drafted token's does (no token read). ``rows`` is 1
(the controller refuses any other, and splits a tree forward's EMBED into a job per row,
each with the same ``pos``). ``token`` holds the last token-indexed job's token until the
next one, for the controller to retire with; a ``POSITION`` job leaves it as it is.
"""

from __future__ import annotations

from amaranth import Module, Mux, ResetInserter, Signal
from amaranth.lib import wiring
from amaranth.lib.wiring import In, Out
from amaranth.utils import exact_log2

from dfvg_hw.layouts import flags_view
from dfvg_hw.op_port import OpJob, OpSequencerSignature
from dfvg_hw.spec import numerics as nx
from dfvg_hw.spec.config import EngineConfig
from dfvg_hw.spec.descriptors import ErrorCode
from dfvg_hw.vmem import Gearbox

__all__ = ["EmbedSequencer"]


class EmbedSequencer(wiring.Component):
    """Runs one EMBED per ``job`` (see the module docstring) and answers with ``done`` and
    an error code.

    Parameters
    ----------
    config : EngineConfig
    data_width : int
        Memory bus width in bits (a multiple of 128).
    row_beat_bits : int, optional
        The beat the image pads table rows to (the engine beat); by default ``data_width``.

    Members
    -------
    job : In(stream.Signature(OpJob()))
        The EMBED: ``addr`` (the table, resolved), ``dst``, ``n``, ``flags`` (``POSITION``)
        and ``pos``. Taken once the token's read (if any) is accepted.
    done : Out(1)
        One-cycle pulse: the job is finished, ``error`` holds its outcome.
    error : Out(8)
        :class:`~dfvg_hw.spec.descriptors.ErrorCode` (OK, BAD_ADDRESS or, with
        ``POSITION``, KV_OVERFLOW).
    read_cmd, read_data : the memory port's read side (the token, then the row)
    vmem_wr_cmd, vmem_wr, vmem_wr_done, vmem_error : VMEM's span writer (one span per job)
    vmem_rd_cmd, vmem_rd, peek_addr, peek_data, poke_en, poke_addr, poke_data : unused (idle)
    token_is_drafted : In(1)
        The controller's TOKEN is ``drafted_token``; else the input token at ``token_addr``.
    drafted_token : In(16)
    token_addr : In(64)
        Device address of the current input token.
    token : Out(16)
        The last token-indexed job's token.
    """

    def __init__(self, config: EngineConfig, data_width: int, row_beat_bits: int | None = None):
        self.config, self.data_width = config, data_width
        self.row_beat_bytes = (row_beat_bits or data_width) // 8
        super().__init__(wiring.Signature({
            **dict(OpSequencerSignature(config, data_width).members.items()),
            "token_is_drafted": In(1),
            "drafted_token": In(16),
            "token_addr": In(64),
            "token": Out(16),
        }))

    def elaborate(self, platform):
        m = Module()
        beat_bytes, beat_words = self.data_width // 8, self.data_width // 32
        to_lines = Gearbox(beat_bytes, self.config.vmem_line_bytes)
        flush_lines = Signal()
        m.submodules.beats_to_lines = ResetInserter({"sync": flush_lines})(to_lines)

        job = Signal(OpJob())
        token, word = self.token, Signal(range(beat_words))
        by_position = flags_view(job.flags).position
        index = Mux(by_position, job.pos, token)       # the table row
        row_bytes = job.n * (nx.RES_BITS // 8)          # an int32 row
        # image.embed_row_stride: the row padded to whole beats
        row_beat, row_beat_bits = self.row_beat_bytes, exact_log2(self.row_beat_bytes)
        row_stride = ((row_bytes + (row_beat - 1)) >> row_beat_bits) << row_beat_bits
        # the span's byte field is narrower than 4·n: a row too long for it saturates to the
        # field's maximum (more than VMEM holds), so VMEM refuses it as BAD_ADDRESS instead
        # of writing a truncated row (VmemSpan's rule)
        span_max = (1 << len(self.vmem_wr_cmd.payload.row_bytes)) - 1
        span_bytes = Mux(row_bytes > span_max, span_max, row_bytes)

        def read(addr, length):
            m.d.comb += [self.read_cmd.valid.eq(1), self.read_cmd.payload.addr.eq(addr),
                         self.read_cmd.payload.length.eq(length)]

        def finish(error):
            m.d.comb += [self.done.eq(1), self.error.eq(error)]
            m.next = "IDLE"

        with m.FSM(name="embed"):
            with m.State("IDLE"):
                offered_position = flags_view(self.job.payload.flags).position
                with m.If(offered_position | self.token_is_drafted):
                    m.d.comb += self.job.ready.eq(1)
                    with m.If(self.job.valid):
                        m.d.sync += job.eq(self.job.payload)
                        with m.If(~offered_position):
                            m.d.sync += token.eq(self.drafted_token)
                        m.next = "SPAN"
                with m.Else():
                    addr = self.token_addr
                    with m.If(self.job.valid):
                        read(addr & ~(beat_bytes - 1), beat_bytes)
                    m.d.comb += self.job.ready.eq(self.read_cmd.ready)
                    with m.If(self.job.valid & self.read_cmd.ready):
                        m.d.sync += [job.eq(self.job.payload), word.eq((addr // 4) % beat_words)]
                        m.next = "TOKEN"
            with m.State("TOKEN"):
                m.d.comb += self.read_data.ready.eq(1)
                with m.If(self.read_data.valid):
                    m.d.sync += token.eq(self.read_data.payload.data.word_select(word, 32))
                    m.next = "SPAN"
            with m.State("SPAN"):
                m.d.comb += flush_lines.eq(1)
                with m.If(by_position & (job.pos >= self.config.kv_positions)):
                    finish(ErrorCode.KV_OVERFLOW)
                with m.Else():
                    m.d.comb += [self.vmem_wr_cmd.valid.eq(1),
                                 self.vmem_wr_cmd.payload.line.eq(job.dst),
                                 self.vmem_wr_cmd.payload.rows.eq(1),
                                 self.vmem_wr_cmd.payload.row_bytes.eq(span_bytes)]
                    with m.If(self.vmem_wr_cmd.ready):
                        m.next = "READ"
            with m.State("READ"):
                read(job.addr + index * row_stride, row_bytes)
                with m.If(self.vmem_error):
                    finish(ErrorCode.BAD_ADDRESS)
                with m.Elif(self.read_cmd.ready):
                    m.next = "ROW"
            with m.State("ROW"):
                m.d.comb += [self.vmem_wr.valid.eq(to_lines.o.valid),
                             self.vmem_wr.payload.data.eq(to_lines.o.payload.data),
                             to_lines.o.ready.eq(self.vmem_wr.ready),
                             to_lines.i.valid.eq(self.read_data.valid),
                             to_lines.i.payload.data.eq(self.read_data.payload.data),
                             to_lines.i.payload.last.eq(self.read_data.payload.last),
                             self.read_data.ready.eq(to_lines.i.ready)]
                with m.If(self.vmem_error):
                    finish(ErrorCode.BAD_ADDRESS)
                with m.Elif(self.vmem_wr_done):
                    finish(ErrorCode.OK)
        return m
