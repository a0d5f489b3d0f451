"""The logit buffer and the token sampler, as the controller drives them (isa.md §1.5, §3.9).

A ``MATMUL`` in ``LOGITS`` mode writes its output tiles into the logit buffer; ``SAMPLE``
streams the buffer through the :class:`~dfvg_hw.token_sampler.TokenSampler` and returns the
drafted token as the words of its result record (:meth:`DraftedToken.record
<dfvg_hw.spec.descriptors.DraftedToken.record>`), which the controller appends to the result
buffer.
"""

from __future__ import annotations

from math import ceil

from amaranth import Module, Mux, Signal, signed, unsigned
from amaranth.lib import data, stream, wiring
from amaranth.lib.memory import Memory
from amaranth.lib.wiring import In, Out

from dfvg_hw.spec import numerics as nx
from dfvg_hw.spec.config import EngineConfig
from dfvg_hw.spec.descriptors import record_words
from dfvg_hw.token_sampler import SamplerRequest, TokenSampler

__all__ = ["SampleSequencer", "LogitTile", "RecordWord"]


class LogitTile(data.StructLayout):
    """One output tile of a LOGITS matmul: ``lanes`` Q7.8 logits (tile ``t`` holds logits
    ``t·lanes …``; lanes past the vector's length are ignored) of logit-buffer row ``row``
    (0 but in a tree forward's LOGITS of several rows, isa.md §9.2)."""

    def __init__(self, lanes: int):
        super().__init__({"data": data.ArrayLayout(signed(nx.LOGIT_BITS), lanes),
                          "row": unsigned(8)})


class RecordWord(data.StructLayout):
    """One 32-bit word of a drafted token's result record; ``k`` is the record's top-k list
    length (the result header's ``topk``), ``last`` marks the record's final word."""

    def __init__(self, topk_max: int):
        super().__init__({"word": unsigned(32), "k": unsigned(topk_max.bit_length()), "last": 1})


class SampleSequencer(wiring.Component):
    """Logit buffer (``ceil(vocab_max / lanes)`` tiles of ``lanes`` int16) and token sampler.

    Members
    -------
    clear : In(1)
        Empty the buffer (every request starts with no logits).
    begin : In(1)
        A LOGITS matmul of ``begin_n`` logits starts: its tiles follow on ``logits``.
    begin_n : In(16)
        Length of the vector that ``begin`` starts.
    logits : In(stream.Signature(LogitTile(lanes)))
        The matmul's output tiles in order (always ready).
    n_logits : Out(16)
        Length of the vector in the buffer (0: none).
    req : In(stream.Signature(SamplerRequest(topk_max)))
        One SAMPLE over the buffered vector (top-k, temperature, draw, seed, counter).
    record : Out(stream.Signature(RecordWord(topk_max)))
        The drafted token's :func:`~dfvg_hw.spec.descriptors.record_words` record words.
    """

    def __init__(self, config: EngineConfig):
        self.config = config
        self.lanes = config.lanes
        self.tiles = ceil(config.vocab_max / config.lanes)
        self.words = record_words(config.topk_max)
        super().__init__(wiring.Signature({
            "clear": In(1),
            "begin": In(1),
            "begin_n": In(16),
            "logits": In(stream.Signature(LogitTile(self.lanes))),
            "n_logits": Out(16),
            "req": In(stream.Signature(SamplerRequest(config.topk_max))),
            "record": Out(stream.Signature(RecordWord(config.topk_max))),
        }))

    def elaborate(self, platform):
        m = Module()
        N, tiles = self.lanes, self.tiles
        buf = m.submodules.logit_buffer = Memory(shape=data.ArrayLayout(signed(nx.LOGIT_BITS), N),
                                                 depth=tiles, init=[])
        wp, rp = buf.write_port(), buf.read_port()
        sampler = m.submodules.sampler = TokenSampler(self.config)

        # -- writing a LOGITS matmul's tiles ----------------------------------------------
        wr_tile = Signal(range(tiles + 1))
        m.d.comb += [self.logits.ready.eq(1), wp.en.eq(self.logits.valid),
                     wp.addr.eq(wr_tile), wp.data.eq(self.logits.payload.data)]
        with m.If(self.logits.valid):
            m.d.sync += wr_tile.eq(wr_tile + 1)
        with m.If(self.begin):
            m.d.sync += [wr_tile.eq(0), self.n_logits.eq(self.begin_n)]
        with m.If(self.clear):
            m.d.sync += self.n_logits.eq(0)

        # -- SAMPLE: the request to the sampler, then the buffer's tiles -------------------
        wiring.connect(m, wiring.flipped(self.req), sampler.req)
        last_tile = Signal(range(tiles + 1))
        m.d.comb += last_tile.eq((self.n_logits + N - 1) // N - 1)
        issuing, rd_tile = Signal(), Signal(range(tiles + 1))
        with m.If(self.req.valid & self.req.ready):
            m.d.sync += [issuing.eq(self.n_logits != 0), rd_tile.eq(0)]
        # the read port's data and the beat's valid/metadata register on the same edge
        beat = sampler.logits
        advance = ~beat.valid | beat.ready
        m.d.comb += [rp.en.eq(advance), rp.addr.eq(rd_tile), beat.payload.data.eq(rp.data)]
        with m.If(advance):
            m.d.sync += beat.valid.eq(issuing)
            with m.If(issuing):
                m.d.sync += [
                    rd_tile.eq(rd_tile + 1),
                    beat.payload.last.eq(rd_tile == last_tile),
                    beat.payload.count.eq(Mux(rd_tile == last_tile, self.n_logits - last_tile * N, N)),
                ]
                with m.If(rd_tile == last_tile):
                    m.d.sync += issuing.eq(0)

        # -- the result as record words ------------------------------------------------------
        res = sampler.o.payload
        index = Signal(range(self.words))
        words = [res.token, res.prob]
        for i in range(self.config.topk_max):
            words += [res.ids[i], res.probs[i]]
        word = Signal(32)
        with m.Switch(index):
            for i, w in enumerate(words):
                with m.Case(i):
                    m.d.comb += word.eq(w)
        final = index == self.words - 1
        m.d.comb += [
            self.record.valid.eq(sampler.o.valid),
            self.record.payload.word.eq(word),
            self.record.payload.k.eq(res.k),
            self.record.payload.last.eq(final),
            sampler.o.ready.eq(self.record.ready & final),
        ]
        with m.If(self.record.valid & self.record.ready):
            m.d.sync += index.eq(Mux(final, 0, index + 1))
        return m
