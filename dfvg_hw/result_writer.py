"""The result writer: assembles a request's result descriptor on chip (docs/isa.md §5.2)
and writes it to device memory in one burst.

Records arrive as SAMPLE produces them (``record``, a word a cycle) and go into the
result RAM after the header's place; at the end of the request (``start``) the header
(:class:`~dfvg_hw.layouts.ResultHeader`: the controller's fields, the record count, the
first record's top-k length and the check word) is written into the RAM a word a cycle,
then every word is read back a word a cycle, packed into bus beats and sent from
``base``. The RAM is the staging buffer because records are not aligned to the bus width.

``done`` pulses once the memory port has no write outstanding.
"""

from __future__ import annotations

from amaranth import Module, Mux, Signal, unsigned
from amaranth.lib import stream, wiring
from amaranth.lib.memory import Memory
from amaranth.lib.wiring import In, Out

from dfvg_hw.layouts import ResultHeader
from dfvg_hw.memory_port import MemoryCommand
from dfvg_hw.sample_sequencer import RecordWord
from dfvg_hw.spec.config import EngineConfig
from dfvg_hw.spec.descriptors import MAX_DRAFT, RESULT_CHECK_SALT, RESULT_HEADER_WORDS, record_words

__all__ = ["ResultWriter"]


class ResultWriter(wiring.Component):
    """Collects one request's records and writes its result descriptor on ``start`` (see
    the module docstring).

    Parameters
    ----------
    config : EngineConfig
        ``topk_max`` (the record length).
    data_width : int
        Memory bus width in bits (a multiple of 128).

    Members
    -------
    clear : In(1)
        A new request: no records yet.
    record : In(stream.Signature(RecordWord(topk_max)))
        The words of the drafted tokens' records, in order (always ready).
    word : Out(range(record_words))
        Index in its record of the next record word (0: the drafted token).
    start : In(1)
        Write the descriptor to ``base``: ``seq`` … ``error_pc`` must hold until ``done``.
    seq, status, end_pos, cycles, n_forward, error_pc : In
        The header's fields that the controller knows (``cycles`` 64 bits, the others 32).
    base : In(64)
        The result buffer's device address.
    done : Out(1)
        One-cycle pulse: the descriptor is written.
    write_cmd : Out(stream.Signature(MemoryCommand(config)))
    write_data : Out(stream.Signature(unsigned(data_width)))
    write_idle : In(1)
        The memory port's write side.
    """

    def __init__(self, config: EngineConfig, data_width: int):
        self.config, self.data_width = config, data_width
        self.record_words = record_words(config.topk_max)
        self.result_words = RESULT_HEADER_WORDS + MAX_DRAFT * self.record_words
        super().__init__(wiring.Signature({
            "clear": In(1),
            "record": In(stream.Signature(RecordWord(config.topk_max))),
            "word": Out(range(self.record_words)),
            "start": In(1),
            "seq": In(32), "status": In(32), "end_pos": In(32), "cycles": In(64),
            "n_forward": In(32), "error_pc": In(32),
            "base": In(64),
            "done": Out(1),
            "write_cmd": Out(stream.Signature(MemoryCommand(config))),
            "write_data": Out(stream.Signature(unsigned(data_width))),
            "write_idle": In(1),
        }))

    def elaborate(self, platform):
        m = Module()
        DW, beat_words = self.data_width, self.data_width // 32
        result = m.submodules.result_buffer = Memory(shape=unsigned(32), depth=self.result_words,
                                                     init=[])
        res_w, res_r = result.write_port(), result.read_port()
        n_records, record_sum, first_k = Signal(range(MAX_DRAFT + 1)), Signal(32), Signal(8)
        count = Signal(range(self.result_words + 1))

        # -- records, as SAMPLE produces them ------------------------------------------------
        rec, word = self.record.payload, self.word
        m.d.comb += [self.record.ready.eq(1),
                     res_w.en.eq(self.record.valid),
                     res_w.addr.eq(RESULT_HEADER_WORDS + n_records * self.record_words + word),
                     res_w.data.eq(rec.word)]
        with m.If(self.record.valid):
            m.d.sync += [word.eq(word + 1), record_sum.eq(record_sum + rec.word)]
            with m.If((word == 0) & (n_records == 0)):
                m.d.sync += first_k.eq(rec.k)
            with m.If(rec.last):
                m.d.sync += [n_records.eq(n_records + 1), word.eq(0)]
        with m.If(self.clear):
            m.d.sync += [n_records.eq(0), record_sum.eq(0), first_k.eq(0), word.eq(0)]

        # -- the descriptor ----------------------------------------------------------------------
        header = Signal(ResultHeader())
        m.d.comb += [header.seq.eq(self.seq), header.status.eq(self.status),
                     header.n_drafted.eq(n_records), header.end_pos.eq(self.end_pos),
                     header.cycles.eq(self.cycles), header.n_forward.eq(self.n_forward),
                     header.error_pc.eq(self.error_pc),
                     header.topk.eq(Mux(n_records != 0, first_k, 0))]
        # the check word over the others (``header.check`` stays 0: a sum over the whole
        # header would read its own output)
        check, total = Signal(32), record_sum + RESULT_CHECK_SALT
        for i in range(RESULT_HEADER_WORDS - 1):
            total = total + header.as_value().word_select(i, 32)
        m.d.comb += check.eq(total)
        total_words = RESULT_HEADER_WORDS + n_records * self.record_words

        with m.FSM(name="result"):
            with m.State("IDLE"):
                with m.If(self.start):
                    m.d.sync += count.eq(0)
                    m.next = "HEADER"
            with m.State("HEADER"):
                # a word a cycle into the RAM, ahead of the records
                m.d.comb += [res_w.en.eq(1), res_w.addr.eq(count),
                             res_w.data.eq(Mux(count == RESULT_HEADER_WORDS - 1, check,
                                               header.as_value().word_select(count, 32)))]
                m.d.sync += count.eq(count + 1)
                with m.If(count == RESULT_HEADER_WORDS - 1):
                    m.d.sync += count.eq(0)
                    m.next = "CMD"
            with m.State("CMD"):
                m.d.comb += [self.write_cmd.valid.eq(1), self.write_cmd.payload.addr.eq(self.base),
                             self.write_cmd.payload.length.eq(total_words * 4)]
                with m.If(self.write_cmd.ready):
                    m.next = "DATA"
            with m.State("DATA"):
                # words leave the result RAM one per cycle and are packed into bus beats
                n_beats = (total_words + beat_words - 1) // beat_words
                pack = Signal(DW)
                fill = Signal(range(beat_words + 1))
                have = Signal()               # res_r.data holds word `count - 1`
                beat_valid = Signal()
                sent = Signal(range(self.result_words + 1))
                m.d.comb += [res_r.addr.eq(count), self.write_data.valid.eq(beat_valid),
                             self.write_data.payload.eq(pack)]
                with m.If(self.write_data.valid & self.write_data.ready):
                    m.d.sync += [beat_valid.eq(0), fill.eq(0), pack.eq(0), sent.eq(sent + 1)]
                with m.Elif(~beat_valid):
                    with m.If(have):
                        m.d.sync += [pack.word_select(fill, 32).eq(res_r.data), fill.eq(fill + 1),
                                     have.eq(0)]
                        with m.If((fill == beat_words - 1) | (count == total_words)):
                            m.d.sync += beat_valid.eq(1)
                    with m.Elif(count < total_words):
                        m.d.sync += [count.eq(count + 1), have.eq(1)]
                with m.If((sent == n_beats) & ~beat_valid):
                    m.d.sync += [sent.eq(0), fill.eq(0), have.eq(0)]
                    m.next = "WAIT"
            with m.State("WAIT"):
                with m.If(self.write_idle):
                    m.d.comb += self.done.eq(1)
                    m.next = "IDLE"
        return m
