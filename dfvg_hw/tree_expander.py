"""The expansion of a tree level (docs/isa.md §9.2): from the sampled source rows of the
logit buffer to the next level's nodes, their result records and, for the controller, each
new row's source row and token.

A tree ``SAMPLE`` runs the :class:`~dfvg_hw.token_sampler.TokenSampler` once a pass
(:class:`~dfvg_hw.sample_sequencer.SampleSequencer` sequences the passes), and every pass's
result comes here with the logit-buffer row it read:

* its top-k list is stored, an entry a cycle, in the source-list memory (slot = the pass),
  because each node's record carries its source row's whole list (isa.md §5.2);
* **greedy** (a pass per source row ``s``): entry ``j`` is a candidate with path score
  ``(SCORE[s] · p_s[j]) >> 24`` (:func:`~dfvg_hw.spec.numerics.path_score`; ``SCORE`` is
  2^24 at the root), registered, then inserted into a ``rows``-deep best-first list. The
  candidates arrive in (``s``, ``j``) order and displace only strictly lower scores, so
  ties go to the lower ``s``, then the lower ``j``, as
  :func:`~dfvg_hw.spec.numerics.tree_expand_greedy` orders them;
* **sampled** (a pass per new row ``r``, its draw made by the sampler): the drawn entry is
  row ``r``'s pick. Every pick enters the list with the same key, so the list keeps them
  in pass order, i.e. row order.

After the last pass the list's first ``W`` entries are the new level's rows ``0 … W − 1``:
each is emitted as its record (the record words of :meth:`DraftedToken.record
<dfvg_hw.spec.descriptors.DraftedToken.record>` with the parent's record index + 1 in word
0's bits 16–23) and, in the cycle its word 0 is taken, as a :class:`TreeNode` on
``expansion``. Then ``SCORE[r]`` takes row ``r``'s path score, for the next level's
candidates (the functional model's :meth:`sim.tree_state.TreeState.expand`).

Timing (all streams ready): a source list is taken ``k`` cycles after it is offered (an
entry a cycle); the first record word follows the last list's take by
:data:`~dfvg_hw.spec.timing.TREE_PICK_SETTLE` + 1 cycles (the last candidate's score
register, then its insertion); then a record word a cycle, ``W · record_words`` in all.
"""

from __future__ import annotations

from amaranth import Module, Mux, Signal, unsigned
from amaranth.lib import data, stream, wiring
from amaranth.lib.memory import Memory
from amaranth.lib.wiring import In, Out

from dfvg_hw.spec import numerics as nx
from dfvg_hw.spec.config import EngineConfig
from dfvg_hw.spec.descriptors import PARENT_LSB, record_words
from dfvg_hw.token_sampler import PROB_WIDTH, RecordWord, SamplerResult, TopList, select

__all__ = ["TreeExpander", "TreeLevel", "SourceList", "TreeNode"]


class TreeLevel(data.StructLayout):
    """The level a tree SAMPLE makes.

    Fields
    ------
    width : unsigned(8)
        ``W``: the level's rows (the request's ``tree_width``).
    first : unsigned(8)
        The record index of its row 0, ``N_DRAFTED · W`` (0: level 1, whose parent is the
        root). Row ``r``'s parent record is ``first − W + s`` for its source row ``s``.
    sampled : unsigned(1)
        The request samples: each pass is one row's draw, not a source row's candidates.
    """

    def __init__(self):
        super().__init__({"width": unsigned(8), "first": unsigned(8), "sampled": 1})


class SourceList(data.StructLayout):
    """One pass of a tree SAMPLE: the sampler's result over logit-buffer row ``row``.

    Fields
    ------
    result : SamplerResult(topk_max)
        The row's top-k ids and probabilities, and (sampled) its draw's rank.
    row : unsigned
        The logit-buffer row the pass read: the candidates' source row, the parent's row.
    last : unsigned(1)
        The level's last pass.
    """

    def __init__(self, topk_max: int, rows: int):
        super().__init__({"result": SamplerResult(topk_max), "row": range(rows), "last": 1})


class TreeNode(data.StructLayout):
    """A new node of the level, for the controller's token and path tables.

    Fields
    ------
    row : unsigned
        Its row in the new level.
    source : unsigned
        The row of its parent in the level fed (0 for level 1: the root).
    token : unsigned(16)
        Its token, which ``EMBED`` row ``row`` feeds in the next tree forward.
    """

    def __init__(self, rows: int):
        super().__init__({"row": range(rows), "source": range(rows), "token": unsigned(16)})


class _ListEntry(data.StructLayout):
    """One top-k entry of a stored source list."""

    def __init__(self):
        super().__init__({"id": unsigned(16), "prob": unsigned(PROB_WIDTH)})


class _Pick(data.StructLayout):
    """A candidate node: the source list it came from, its source row, token, probability."""

    def __init__(self, rows: int):
        super().__init__({"slot": range(rows), "source": range(rows), "token": unsigned(16),
                          "prob": unsigned(PROB_WIDTH)})


class TreeExpander(wiring.Component):
    """A tree level's expansion: source lists in, the level's records and nodes out.

    Parameters
    ----------
    config : EngineConfig
        Uses ``rows`` (the widest level, the passes a level holds) and ``topk_max``.

    Members
    -------
    level : In(stream.Signature(TreeLevel()))
        A new level (taken when idle); its passes follow on ``source``.
    source : In(stream.Signature(SourceList(topk_max, rows)))
        A pass's result, taken after its ``k`` list entries are stored (``k`` cycles).
    record : Out(stream.Signature(RecordWord(topk_max)))
        The ``W`` records, row 0 first; ``final`` on the last word of row ``W − 1``.
    expansion : Out(stream.Signature(TreeNode(rows)))
        Row ``r``'s node, valid for the one cycle its record's word 0 is taken; its
        consumer is always ready (``ready`` is not looked at), as the result writer is
        for the records.
    """

    def __init__(self, config: EngineConfig):
        self.config = config
        self.rows, self.topk_max = config.rows, config.topk_max
        self.record_words = record_words(config.topk_max)
        super().__init__(wiring.Signature({
            "level": In(stream.Signature(TreeLevel())),
            "source": In(stream.Signature(SourceList(self.topk_max, self.rows))),
            "record": Out(stream.Signature(RecordWord(self.topk_max))),
            "expansion": Out(stream.Signature(TreeNode(self.rows))),
        }))

    def elaborate(self, platform):
        m = Module()
        R, K, RW = self.rows, self.topk_max, self.record_words
        lists = m.submodules.source_lists = Memory(shape=_ListEntry(), depth=R * K, init=[])
        wp, rp = lists.write_port(), lists.read_port()
        picks = TopList(R, _Pick(R), "pick", by_index=False, value_shape=unsigned(PROB_WIDTH))
        scores = [Signal(PROB_WIDTH, name=f"score{r}") for r in range(R)]

        width, first, sampled = Signal(8), Signal(8), Signal()
        k = Signal(range(K + 1))              # the level's list length (every pass's)
        slot = Signal(range(R))               # the pass being stored
        j = Signal(range(K))                  # its entry being stored
        # the candidate's pipeline register: its score is a 25 × 25-bit product
        cand_valid, cand_key, cand = Signal(), Signal(PROB_WIDTH), Signal(_Pick(R))
        m.d.sync += cand_valid.eq(0)
        picks.insert(m, cand_valid, cand_key, cand)

        with m.FSM(name="expand"):
            with m.State("IDLE"):
                m.d.comb += self.level.ready.eq(1)
                with m.If(self.level.valid):
                    lv = self.level.payload
                    m.d.sync += [width.eq(lv.width), first.eq(lv.first), sampled.eq(lv.sampled),
                                 slot.eq(0), j.eq(0)]
                    picks.clear(m)
                    m.next = "STORE"

            with m.State("STORE"):
                src = self.source.payload
                res = src.result
                entry_id = select([res.ids[i] for i in range(K)], j)
                entry_prob = select([res.probs[i] for i in range(K)], j)
                stored = self.source.valid & (j < res.k)
                end = j + 1 >= res.k
                m.d.comb += [wp.en.eq(stored), wp.addr.eq(slot * K + j),
                             wp.data.id.eq(entry_id), wp.data.prob.eq(entry_prob),
                             self.source.ready.eq(end)]
                # the root's path score is 1.0 (2^24): its candidates score their probability
                parent_score = Mux(first == 0, nx.TREE_SCORE_ROOT, select(scores, src.row))
                score = (parent_score * entry_prob) >> nx.PROB_BITS
                m.d.sync += [
                    cand_valid.eq(stored & (~sampled | (j == res.rank))),
                    # one key for every sampled pick: the list keeps them in row order
                    cand_key.eq(Mux(sampled, 0, score)),
                    cand.slot.eq(slot), cand.source.eq(src.row),
                    cand.token.eq(entry_id), cand.prob.eq(entry_prob),
                ]
                with m.If(self.source.valid):
                    m.d.sync += j.eq(j + 1)
                    with m.If(end):
                        m.d.sync += [j.eq(0), slot.eq(slot + 1), k.eq(res.k)]
                        with m.If(src.last):
                            m.next = "SETTLE"

            with m.State("SETTLE"):
                # the last candidate enters the list
                m.next = "EMIT"

            with m.State("EMIT"):
                row = Signal(range(R))
                word = Signal(range(RW))
                pick = data.View(_Pick(R), select([p.as_value() for p in picks.idx], row))
                last = word == RW - 1
                final = last & (row == width - 1)
                parent = Signal(8)                      # the parent's record index + 1
                m.d.comb += parent.eq(Mux(first == 0, 0, first - width + 1 + pick.source))
                entry = word[1:] - 1                                          # words 2 + 2i, 3 + 2i
                listed = (word >= 2) & (entry < k)
                value = Signal(32)
                with m.If(word == 0):
                    m.d.comb += value.eq(pick.token | (parent << PARENT_LSB))
                with m.Elif(word == 1):
                    m.d.comb += value.eq(pick.prob)
                with m.Elif(listed):
                    m.d.comb += value.eq(Mux(word[0], rp.data.prob, rp.data.id))
                take = self.record.ready
                # the read port runs a word ahead: the entry of word + 1, (word − 1) div 2
                ahead = Mux((word == 0) | last, 0, (word - 1)[1:])
                m.d.comb += [
                    self.record.valid.eq(1), self.record.payload.word.eq(value),
                    self.record.payload.k.eq(k), self.record.payload.last.eq(last),
                    self.record.payload.final.eq(final),
                    rp.en.eq(take), rp.addr.eq(pick.slot * K + ahead),
                    self.expansion.valid.eq(take & (word == 0)),
                    self.expansion.payload.row.eq(row),
                    self.expansion.payload.source.eq(pick.source),
                    self.expansion.payload.token.eq(pick.token),
                ]
                with m.If(take):
                    m.d.sync += word.eq(Mux(last, 0, word + 1))
                    with m.If(last):
                        m.d.sync += row.eq(row + 1)
                    with m.If(final):
                        m.d.sync += row.eq(0)
                        # the new level's path scores, for its candidates at the next SAMPLE
                        m.d.sync += [s.eq(v) for s, v in zip(scores, picks.val)]
                        m.next = "IDLE"
        return m
