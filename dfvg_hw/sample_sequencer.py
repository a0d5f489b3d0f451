"""The logit buffer and the token sampler, as the controller drives them (isa.md §1.5, §3.9,
§9.2).

A ``MATMUL`` in ``LOGITS`` mode writes its output tiles into the logit buffer, a row of
tiles per matmul row; ``SAMPLE`` streams the buffer through the
:class:`~dfvg_hw.token_sampler.TokenSampler` and returns the drafted tokens as the words of
their result records (:meth:`DraftedToken.record
<dfvg_hw.spec.descriptors.DraftedToken.record>`), which the controller appends to the result
buffer.

In a chain (``tree_width = 0``) a SAMPLE is one pass over row 0 and one record, straight
from the sampler. In a tree request it makes the next level of ``W`` nodes (isa.md §9.2) in
passes of the sampler over the buffer's rows, one after another:

* **greedy**: a pass per source row (the rows of the last ``LOGITS``: 1 at the root, ``W``
  after), without a draw; the :class:`~dfvg_hw.tree_expander.TreeExpander` picks the ``W``
  best candidates by path score;
* **sampled**: a pass per new row ``r``, over source row ``r`` (row 0 when the buffer holds
  one row: the root's), drawing with RNG counter ``counter + N_DRAFTED · W + r`` (the
  counter base plus the new node's record index).

Then the expander emits the ``W`` records and a :class:`~dfvg_hw.tree_expander.TreeNode` per
new row on ``expansion``. A greedy level whose candidates cannot fill it (``min(topk, n)``
times the source rows ``< W``) is refused: no pass, ``error`` from the next cycle.

Timing of a tree SAMPLE, consumers always ready (``sim/sample_timing.py``): the request's
cycle, then per pass :data:`~dfvg_hw.spec.timing.SAMPLE_START` + the row's tiles + the
sampler's latency + ``k'`` (the expander stores the list an entry a cycle before it takes
it, and the next pass's request follows at once), one cycle for the last candidate to
settle, then the records a word a cycle.
"""

from __future__ import annotations

from math import ceil

from amaranth import Module, Mux, Signal, signed, unsigned
from amaranth.lib import data, stream, wiring
from amaranth.lib.memory import Memory
from amaranth.lib.wiring import In, Out

from dfvg_hw.spec import numerics as nx
from dfvg_hw.spec.config import EngineConfig
from dfvg_hw.spec.descriptors import MAX_DRAFT, record_words
from dfvg_hw.token_sampler import RecordWord, SamplerRequest, TokenSampler, select
from dfvg_hw.tree_expander import TreeExpander, TreeNode

__all__ = ["SampleSequencer", "SampleRequest", "LogitTile", "RecordWord"]


class LogitTile(data.StructLayout):
    """One output tile of a LOGITS matmul: ``lanes`` Q7.8 logits (tile ``t`` holds logits
    ``t·lanes …``; lanes past the vector's length are ignored) of logit-buffer row ``row``
    (0 but in a tree forward's LOGITS of several rows, isa.md §9.2)."""

    def __init__(self, lanes: int):
        super().__init__({"data": data.ArrayLayout(signed(nx.LOGIT_BITS), lanes),
                          "row": unsigned(8)})


class SampleRequest(data.StructLayout):
    """One SAMPLE: the :class:`~dfvg_hw.token_sampler.SamplerRequest` fields (``k``,
    ``t_mult``, ``t_shift``, ``sample``, ``seed``; ``counter`` as below) and the tree's.

    Fields
    ------
    counter : unsigned(32)
        The request's RNG counter base. A chain's draw uses ``counter + n_drafted``; row
        ``r`` of a tree level ``counter + n_drafted · tree_width + r``.
    n_drafted : unsigned(7)
        ``N_DRAFTED``: the SAMPLEs before this one in the request (a chain's tokens, a
        tree's levels: the level being fed, 0 at the root).
    tree_width : unsigned(8)
        The request's ``tree_width`` ``W``; 0: a chain.
    """

    def __init__(self, topk_max: int):
        super().__init__({**dict(SamplerRequest(topk_max).members),
                          "n_drafted": unsigned(MAX_DRAFT.bit_length()),
                          "tree_width": unsigned(8)})


class SampleSequencer(wiring.Component):
    """Logit buffer (``rows`` rows of ``ceil(vocab_max / lanes)`` tiles of ``lanes`` int16),
    token sampler and tree expander.

    Members
    -------
    clear : In(1)
        Empty the buffer (every request starts with no logits).
    begin : In(1)
        A LOGITS matmul of ``begin_rows`` rows of ``begin_n`` logits starts: its tiles
        follow on ``logits``, and replace every row.
    begin_n : In(16)
        Length of the rows that ``begin`` starts.
    begin_rows : In(8)
        Rows of the LOGITS matmul that ``begin`` starts (the matmul sequencer's
        ``logits_rows``): a tree SAMPLE's source rows.
    logits : In(stream.Signature(LogitTile(lanes)))
        The matmul's output tiles, each row's in order (always ready).
    n_logits : Out(16)
        Length of each row in the buffer (0: none).
    req : In(stream.Signature(SampleRequest(topk_max)))
        One SAMPLE over the buffer.
    record : Out(stream.Signature(RecordWord(topk_max)))
        The drafted tokens' :func:`~dfvg_hw.spec.descriptors.record_words` record words:
        a chain's one record, or a tree level's ``W`` (``final`` on the SAMPLE's last word).
    expansion : Out(stream.Signature(TreeNode(rows)))
        A tree level's new nodes, one with each record's word 0 (always ready: ``ready``
        is not looked at).
    error : Out(1)
        The last tree SAMPLE was refused: a greedy level with fewer candidates than rows.
        From the cycle after the request until the next request or ``clear``.
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
            "begin_rows": In(8),
            "logits": In(stream.Signature(LogitTile(self.lanes))),
            "n_logits": Out(16),
            "req": In(stream.Signature(SampleRequest(config.topk_max))),
            "record": Out(stream.Signature(RecordWord(config.topk_max))),
            "expansion": Out(stream.Signature(TreeNode(config.rows))),
            "error": Out(1),
        }))

    def elaborate(self, platform):
        m = Module()
        N, tiles, R, K = self.lanes, self.tiles, self.config.rows, self.config.topk_max
        buf = m.submodules.logit_buffer = Memory(shape=data.ArrayLayout(signed(nx.LOGIT_BITS), N),
                                                 depth=R * tiles, init=[])
        wp, rp = buf.write_port(), buf.read_port()
        sampler = m.submodules.sampler = TokenSampler(self.config)
        expander = m.submodules.expander = TreeExpander(self.config)

        # -- writing a LOGITS matmul's tiles, a tile counter per row ---------------------
        n_rows = Signal(range(R + 1))
        wr_tile = [Signal(range(tiles + 1), name=f"wr_tile{r}") for r in range(R)]
        tile = self.logits.payload
        tile_row = tile.row[:max(1, (R - 1).bit_length())]       # a row of this buffer
        m.d.comb += [self.logits.ready.eq(1), wp.en.eq(self.logits.valid),
                     wp.addr.eq(tile_row * tiles + select(wr_tile, tile_row)),
                     wp.data.eq(tile.data)]
        with m.If(self.logits.valid):
            with m.Switch(tile_row):
                for r in range(R):
                    with m.Case(r):
                        m.d.sync += wr_tile[r].eq(wr_tile[r] + 1)
        with m.If(self.begin):
            m.d.sync += [self.n_logits.eq(self.begin_n), n_rows.eq(self.begin_rows)]
            m.d.sync += [t.eq(0) for t in wr_tile]
        with m.If(self.clear):
            m.d.sync += [self.n_logits.eq(0), n_rows.eq(0)]

        # -- SAMPLE: a chain's request goes to the sampler; a tree's makes passes ----------
        rq = self.req.payload
        tree_busy = Signal()                  # a tree SAMPLE's passes or records are under way
        is_tree = rq.tree_width != 0
        m.d.comb += self.req.ready.eq(~tree_busy & (is_tree | sampler.req.ready))
        accept = self.req.valid & self.req.ready

        # the tree SAMPLE's request, kept for its passes
        level = Signal(SampleRequest(K))
        passes = Signal(range(R + 1))
        pass_index = Signal(range(R))         # the pass requested or in flight
        pass_row = Signal(range(R))           # the row it reads
        pass_pending = Signal()               # its request waits for the sampler
        level_pending = Signal()              # the expander has not taken the level yet
        first = Signal(8)                     # the new level's first record index
        k_req = Mux(rq.k == 0, 1, Mux(rq.k > K, K, rq.k))        # as the sampler takes it
        k_eff = Mux(self.n_logits < k_req, self.n_logits, k_req)
        short = ~rq.sample & (k_eff * n_rows < rq.tree_width)
        with m.If(accept):
            m.d.sync += self.error.eq(is_tree & short)
            with m.If(is_tree & ~short):
                m.d.sync += [tree_busy.eq(1), level.eq(rq), pass_index.eq(0), pass_pending.eq(1),
                             level_pending.eq(1), first.eq(rq.n_drafted * rq.tree_width),
                             passes.eq(Mux(rq.sample, rq.tree_width, n_rows))]
        with m.If(self.clear):
            m.d.sync += self.error.eq(0)

        sreq = sampler.req.payload
        with m.If(tree_busy):
            m.d.comb += [sampler.req.valid.eq(pass_pending),
                         sreq.k.eq(level.k), sreq.t_mult.eq(level.t_mult),
                         sreq.t_shift.eq(level.t_shift), sreq.sample.eq(level.sample),
                         sreq.seed.eq(level.seed),
                         sreq.counter.eq(level.counter + first + pass_index)]
        with m.Else():
            m.d.comb += [sampler.req.valid.eq(self.req.valid & ~is_tree),
                         sreq.k.eq(rq.k), sreq.t_mult.eq(rq.t_mult), sreq.t_shift.eq(rq.t_shift),
                         sreq.sample.eq(rq.sample), sreq.seed.eq(rq.seed),
                         sreq.counter.eq(rq.counter + rq.n_drafted)]

        # the expander: the level, then each pass's result with the row it read
        src = expander.source.payload
        m.d.comb += [expander.level.valid.eq(level_pending),
                     expander.level.payload.width.eq(level.tree_width),
                     expander.level.payload.first.eq(first),
                     expander.level.payload.sampled.eq(level.sample),
                     expander.source.valid.eq(tree_busy & sampler.o.valid),
                     src.result.eq(sampler.o.payload), src.row.eq(pass_row),
                     src.last.eq(pass_index == passes - 1)]
        with m.If(expander.level.valid & expander.level.ready):
            m.d.sync += level_pending.eq(0)
        with m.If(expander.source.valid & expander.source.ready & ~src.last):
            m.d.sync += [pass_index.eq(pass_index + 1), pass_pending.eq(1)]

        # -- the passes: the request to the sampler, then the buffer's tiles of one row ----
        last_tile = Signal(range(tiles + 1))
        m.d.comb += last_tile.eq((self.n_logits + N - 1) // N - 1)
        issuing, rd_tile, rd_row = Signal(), Signal(range(tiles + 1)), Signal(range(R))
        with m.If(sampler.req.valid & sampler.req.ready):
            # a level fed from a one-row buffer (the root's) reads row 0 in every pass
            row = Mux(tree_busy & (pass_index < n_rows), pass_index, 0)
            m.d.sync += [issuing.eq(self.n_logits != 0), rd_tile.eq(0), rd_row.eq(row),
                         pass_row.eq(row)]
            with m.If(tree_busy):
                m.d.sync += pass_pending.eq(0)
        # the read port's data and the beat's valid/metadata register on the same edge
        beat = sampler.logits
        advance = ~beat.valid | beat.ready
        m.d.comb += [rp.en.eq(advance), rp.addr.eq(rd_row * tiles + rd_tile),
                     beat.payload.data.eq(rp.data)]
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

        # -- a chain's result as record words ------------------------------------------------
        res = sampler.o.payload
        index = Signal(range(self.words))
        words = [res.token, res.prob]
        for i in range(K):
            words += [res.ids[i], res.probs[i]]
        word = Signal(32)
        with m.Switch(index):
            for i, w in enumerate(words):
                with m.Case(i):
                    m.d.comb += word.eq(w)
        final = index == self.words - 1
        with m.If(tree_busy):
            wiring.connect(m, expander.record, wiring.flipped(self.record))
            m.d.comb += sampler.o.ready.eq(expander.source.ready)
            with m.If(self.record.valid & self.record.ready & self.record.payload.final):
                m.d.sync += tree_busy.eq(0)
        with m.Else():
            m.d.comb += [
                self.record.valid.eq(sampler.o.valid),
                self.record.payload.word.eq(word),
                self.record.payload.k.eq(res.k),
                self.record.payload.last.eq(final),
                self.record.payload.final.eq(final),
                sampler.o.ready.eq(self.record.ready & final),
            ]
            with m.If(self.record.valid & self.record.ready):
                m.d.sync += index.eq(Mux(final, 0, index + 1))
        wiring.connect(m, expander.expansion, wiring.flipped(self.expansion))
        return m
