"""Token sampler: streaming top-k, exact fixed-point probabilities and counter-based sampling.

Bit-exact with the ``SAMPLE`` instruction of the functional model (``sim/functional.py``
``_sample``), i.e. with :func:`dfvg_hw.spec.numerics.topk_select`,
:func:`~dfvg_hw.spec.numerics.sampler_probs`, :func:`~dfvg_hw.spec.numerics.rng32` and
:func:`~dfvg_hw.spec.numerics.sample_index` (``docs/numerics.md`` §9–10, ``docs/isa.md`` §3.9).

Datapath, in the order a sample goes through it:

1. **Collect** (``lanes`` logits per cycle, no stall). Every lane keeps a ``topk_max``-deep
   insertion list of the logits it has seen. A lane sees its indices in increasing order,
   so "a new value displaces only strictly smaller entries" gives the lower-index tie rule.
2. **Merge** (only when ``lanes > 1``): the lane lists are fed, one candidate per cycle,
   into a final insertion list that compares (value, −index), so ties still go to the
   lower index whatever the arrival order. Only the first ``k`` entries of each lane can
   reach the global top-``k``: ``lanes · k`` cycles, as in ``sim/cycle_model.py``.
3. **Exp** (``k`` issues + 4): ``d = l_0 − l_j``, ``d · t_mult``, rounding shift, the
   256 × 17-bit ``EXP2_LUT`` ROM, the integer-part shift, and ``Σe``.
4. **Divide** (25 cycles): a restoring divider for ``R = floor(2^40 / Σe)``. Because
   ``Σe ≥ 2^16`` (``e_0 = 2^16``), ``R ≤ 2^24`` has 25 bits and the partial remainder can
   start at ``2^40 >> 25 = 2^15``: one quotient bit per cycle, 25 cycles.
5. **Probabilities and draw** (``k + 1`` cycles, none for ``k = 1``, then 1 for ``p_0``): ``p_j = (e_j·R) >> 16``
   for ``j = k−1 … 1`` (descending), then ``p_0 = 2^24 − Σ_{j≥1} p_j``, which equals
   ``numerics``' "remainder to entry 0". The draw is fused into the same pass: the first
   ``j`` with ``Σ_{i≤j} p_i > r24`` is the smallest ``j`` with ``Σ_{i>j} p_i < 2^24 − r24``,
   and the suffix sums are exactly what the descending pass accumulates.

The RNG (:class:`Rng32`, ``rng32(seed, counter)``) runs as soon as the request is accepted
and is done long before the draw needs it.
"""

from __future__ import annotations

from amaranth import Array, C, Cat, Module, Mux, Signal, signed, unsigned
from amaranth.lib import data, enum, stream, wiring
from amaranth.lib.memory import Memory
from amaranth.lib.wiring import In, Out

from dfvg_hw.spec import numerics as nx
from dfvg_hw.spec import timing
from dfvg_hw.spec.config import EngineConfig

__all__ = ["TokenSampler", "Rng32", "RngInput", "SamplerRequest", "LogitBeat", "SamplerResult",
           "RecordWord", "TopList", "select", "PROB_WIDTH"]

#: Width of a reported probability: units of 2^-24, and ``p = 2^24`` exactly when k = 1.
PROB_WIDTH = nx.PROB_BITS + 1

_MIX_C1, _MIX_C2 = 0x21F0AAAD, 0x735A2D97
_EXP_ZERO_SHIFT = 17           # exp2_neg: integer part ≥ 17 gives exactly 0
_DIVIDEND = 1 << (nx.PROB_BITS + 16)   # R = floor(2^40 / Σe)


def _bits(n: int) -> int:
    """Bits of an unsigned field that holds 0 … n."""
    return max(1, int(n).bit_length())


def select(values, index):
    """``values[index]``, 0 past the end; padded so every index value has a case (lint-clean)."""
    values = list(values)
    values += [C(0, 1)] * ((1 << len(index)) - len(values))
    return Array(values)[index]


class _Phase(enum.Enum, shape=3):
    COLLECT = 0   #: taking the request and the logit beats
    MERGE = 1     #: lane lists -> final list, one candidate per cycle (lanes > 1)
    EXP = 2       #: e_j and Σe
    DIV = 3       #: R = floor(2^40 / Σe)
    PROB = 4      #: p_j for j = k−1 … 1, suffix sums and the draw
    FIN = 5       #: p_0 and the draw's last comparison
    OUT = 6       #: result offered on `o`


# -- layouts ---------------------------------------------------------------------------
class RngInput(data.StructLayout):
    """One draw: the host's 64-bit seed and the 32-bit counter."""

    def __init__(self):
        super().__init__({"seed": unsigned(64), "counter": unsigned(32)})


class SamplerRequest(data.StructLayout):
    """Per-sample parameters of :class:`TokenSampler`.

    Fields
    ------
    k : unsigned(bits for topk_max)
        Top-k size. 0 is taken as 1 and values above ``topk_max`` as ``topk_max`` (the
        engine rejects both at request time, ``BAD_REQUEST``). If fewer than ``k`` logits
        are streamed, the result has as many entries as there were logits
        (``k = min(topk, n)``, isa.md §3.9).
    t_mult, t_shift : unsigned(16), unsigned(6)
        Temperature: ``t_mult · 2^−t_shift ≈ log2(e)/T``. ``t_mult = 0`` selects
        ``(T1_MULT, T1_SHIFT)`` (T = 1), as the engine does for greedy requests.
    sample : unsigned(1)
        1: draw with the RNG; 0: greedy (the token is ``top[0]``, no draw).
    seed : unsigned(64)
        The request's RNG seed.
    counter : unsigned(32)
        The RNG counter of this draw: the request's counter base plus the index of the
        drafted token (``counter + N_DRAFTED``); the controller adds the two.
    """

    def __init__(self, topk_max: int):
        super().__init__({
            "k": unsigned(_bits(topk_max)),
            "t_mult": unsigned(nx.MULT_BITS),
            "t_shift": unsigned(6),
            "sample": unsigned(1),
            "seed": unsigned(64),
            "counter": unsigned(32),
        })


class LogitBeat(data.StructLayout):
    """Up to ``lanes`` Q7.8 logits in vocabulary order.

    Fields
    ------
    data : ArrayLayout(signed(16), lanes)
        ``data[l]`` for ``l < count`` is the logit of token ``base + l``, where ``base`` is
        the number of logits in the earlier beats of the same vector.
    count : unsigned(bits for lanes)
        Valid lanes, ``0 … lanes``; lanes at or above ``count`` are ignored.
    last : unsigned(1)
        Marks the final beat of the vector.
    """

    def __init__(self, lanes: int):
        super().__init__({
            "data": data.ArrayLayout(signed(nx.LOGIT_BITS), lanes),
            "count": unsigned(_bits(lanes)),
            "last": unsigned(1),
        })


class SamplerResult(data.StructLayout):
    """One drafted token with its top-k list (a ``SAMPLE`` record, isa.md §5.2).

    Fields
    ------
    token : unsigned(16)
        The chosen token id (``ids[rank]``).
    prob : unsigned(25)
        Its probability, units of 2^-24 (``probs[rank]``).
    rank : unsigned
        Its position in the top-k list (0 in greedy mode).
    k : unsigned
        Entries in the list: ``min(k, n)``; 0 only if the vector had no logits (then every
        field is 0).
    ids, probs : ArrayLayout(unsigned(16), topk_max), ArrayLayout(unsigned(25), topk_max)
        The top-k token ids, largest logit first (ties: lower id first), and their
        probabilities (sum exactly 2^24); entries at ``k`` and above are 0.
    """

    def __init__(self, topk_max: int):
        super().__init__({
            "token": unsigned(16),
            "prob": unsigned(PROB_WIDTH),
            "rank": unsigned(_bits(topk_max - 1)),
            "k": unsigned(_bits(topk_max)),
            "ids": data.ArrayLayout(unsigned(16), topk_max),
            "probs": data.ArrayLayout(unsigned(PROB_WIDTH), topk_max),
        })


class RecordWord(data.StructLayout):
    """One 32-bit word of a drafted token's result record (:meth:`DraftedToken.record
    <dfvg_hw.spec.descriptors.DraftedToken.record>`), as a SAMPLE hands it to the result.

    Fields
    ------
    word : unsigned(32)
        The record word.
    k : unsigned
        The record's top-k list length (the result header's ``topk``).
    last : unsigned(1)
        The record's final word.
    final : unsigned(1)
        The SAMPLE's final word: its only record's ``last`` in a chain, the last node's in
        a tree level (docs/isa.md §9.2).
    """

    def __init__(self, topk_max: int):
        super().__init__({"word": unsigned(32), "k": unsigned(topk_max.bit_length()), "last": 1,
                          "final": 1})


# -- RNG -------------------------------------------------------------------------------
def _xorshift(x, s: int):
    return x ^ (x >> s)


class Rng32(wiring.Component):
    """Pipelined counter-based RNG, bit-exact with :func:`dfvg_hw.spec.numerics.rng32`.

    ``mix32(mix32((counter + seed_lo) mod 2^32) XOR seed_hi)``; each ``mix32`` is two
    xorshift-multiply stages (a 32 × 32 → low-32 constant multiply each) and a final
    xorshift. Seven register stages, initiation interval 1; backpressure stalls the whole
    pipeline.

    Members
    -------
    i : In(stream.Signature(RngInput))
        Seed and counter.
    o : Out(stream.Signature(unsigned(32)))
        ``rng32(seed, counter)``.
    """

    LATENCY = timing.RNG_LATENCY

    def __init__(self):
        super().__init__({
            "i": In(stream.Signature(RngInput())),
            "o": Out(stream.Signature(unsigned(32))),
        })

    def elaborate(self, platform):
        m = Module()
        advance = Signal()
        m.d.comb += [advance.eq(~self.o.valid | self.o.ready), self.i.ready.eq(advance)]
        valid, word = _rng32_pipeline(m, advance, self.i.valid, self.i.payload.seed,
                                      self.i.payload.counter)
        m.d.comb += [self.o.valid.eq(valid), self.o.payload.eq(word)]
        return m


def _rng32_pipeline(m, advance, valid, seed, counter):
    """The :class:`Rng32` datapath, built into ``m`` (inlined: no submodule in the Verilog).

    Returns the registered (valid, word) of the last stage.
    """
    v = [Signal(name=f"rng_v{s}") for s in range(Rng32.LATENCY)]
    x = [Signal(32, name=f"rng_x{s}") for s in range(Rng32.LATENCY)]
    hi = [Signal(32, name=f"rng_hi{s}") for s in range(3)]
    with m.If(advance):
        m.d.sync += [
            # mix32 #1 of (counter + seed_lo)
            v[0].eq(valid), x[0].eq(counter + seed[:32]), hi[0].eq(seed[32:]),
            v[1].eq(v[0]), x[1].eq(_xorshift(x[0], 16) * _MIX_C1), hi[1].eq(hi[0]),
            v[2].eq(v[1]), x[2].eq(_xorshift(x[1], 15) * _MIX_C2), hi[2].eq(hi[1]),
            v[3].eq(v[2]), x[3].eq(_xorshift(x[2], 15) ^ hi[2]),
            # mix32 #2
            v[4].eq(v[3]), x[4].eq(_xorshift(x[3], 16) * _MIX_C1),
            v[5].eq(v[4]), x[5].eq(_xorshift(x[4], 15) * _MIX_C2),
            v[6].eq(v[5]), x[6].eq(_xorshift(x[5], 15)),
        ]
    return v[6], x[6]


# -- insertion lists -------------------------------------------------------------------
class TopList:
    """``depth`` registered entries (valid, value, index), sorted best first: the sampler's
    top-k lists and the tree expander's best candidates (:mod:`dfvg_hw.tree_expander`).

    Valid entries always form a prefix. ``by_index=False`` is for candidates that arrive
    in increasing index order (a value displaces only strictly smaller ones, so equal
    values keep their arrival order and ``index`` may be any payload);
    ``by_index=True`` compares (value, −index) and is order-independent.
    """

    def __init__(self, depth: int, idx_shape, name: str, by_index: bool,
                 value_shape=signed(nx.LOGIT_BITS)):
        self.depth, self.by_index = depth, by_index
        self.vld = [Signal(name=f"{name}_vld{i}") for i in range(depth)]
        self.val = [Signal(value_shape, name=f"{name}_val{i}") for i in range(depth)]
        self.idx = [Signal(idx_shape, name=f"{name}_idx{i}") for i in range(depth)]

    def insert(self, m, valid, value, index):
        """Insert (value, index) at the next clock edge when ``valid``.

        ``beats[i]``: the candidate outranks entry i (always true for an invalid entry).
        ``beats`` is monotone (a prefix of false, then true), so entry i keeps its value,
        takes the candidate (first true), or takes entry i−1 (shifted down); the last
        entry falls off.
        """
        beats = []
        for i in range(self.depth):
            b = Signal(name=f"beats{i}")
            gt = value > self.val[i]
            if self.by_index:
                gt = gt | ((value == self.val[i]) & (index < self.idx[i]))
            m.d.comb += b.eq(~self.vld[i] | gt)
            beats.append(b)
        with m.If(valid):
            for i in range(self.depth):
                if i == 0:
                    with m.If(beats[0]):
                        m.d.sync += [self.vld[0].eq(1), self.val[0].eq(value), self.idx[0].eq(index)]
                else:
                    with m.If(beats[i - 1]):                   # shifted down by one
                        m.d.sync += [self.vld[i].eq(self.vld[i - 1]), self.val[i].eq(self.val[i - 1]),
                                     self.idx[i].eq(self.idx[i - 1])]
                    with m.Elif(beats[i]):                     # the new entry lands here
                        m.d.sync += [self.vld[i].eq(1), self.val[i].eq(value), self.idx[i].eq(index)]

    def copy_from(self, m, other: "TopList"):
        for i in range(self.depth):
            m.d.sync += [self.vld[i].eq(other.vld[i]), self.val[i].eq(other.val[i]),
                         self.idx[i].eq(other.idx[i])]

    def clear(self, m):
        m.d.sync += [v.eq(0) for v in self.vld]


# -- sampler ---------------------------------------------------------------------------
class TokenSampler(wiring.Component):
    """Streaming token sampler, bit-exact with the functional model's ``SAMPLE``.

    Protocol: the request (``req``) and the logit vector (``logits``, ``lanes`` per beat,
    ending with a ``last`` beat) may arrive in either order, and overlap; each is accepted
    once per sample. When both are in, the sampler computes (``latency`` cycles) and
    offers the result on ``o``; after ``o`` is taken it accepts the next request and
    vector. Logits are accepted at one beat per cycle without stalls, so the LOGITS matmul
    is never held up while it streams.

    Latency: a beat is taken every cycle (``lanes`` logits per cycle) and is in the lane
    lists one cycle later. After the edge that takes the last beat (request already in),
    ``o.valid`` rises after ``lanes·k`` (merge, only if ``lanes > 1``) ``+ (k + 4)`` (exp)
    ``+ 25`` (divide) ``+ (k + 1)`` (probabilities, 0 for ``k = 1``) ``+ 1`` cycles, with
    ``k = min(topk, n)`` except in the merge term; see :meth:`latency`. That is
    ``lanes·k + 2k + 31`` for ``k ≥ 2``: the cycle model's SAMPLE charges
    ``lanes·topk + 2·topk + 38`` (``EXP_LATENCY + DIV_LATENCY = 38``) plus issue and the
    record write, 7 cycles more than this block needs.

    Not checked (the engine faults these before sampling): a vector longer than
    ``vocab_max`` (the ids wrap), and an empty vector (the result then has ``k = 0`` and
    all fields 0).

    Parameters
    ----------
    config : EngineConfig
        Uses ``topk_max``, ``vocab_max`` and (by default) ``lanes``.
    lanes : int, optional
        Logits per beat; defaults to ``config.lanes`` (one beat per LOGITS output tile).

    Members
    -------
    req : In(stream.Signature(SamplerRequest(topk_max)))
        k, temperature, sample flag, seed and counter of this sample.
    logits : In(stream.Signature(LogitBeat(lanes)))
        The int16 Q7.8 logit vector, in index order.
    o : Out(stream.Signature(SamplerResult(topk_max)))
        Token, probability, rank and the top-k (id, probability) list in rank order.
    """

    EXP_LATENCY = timing.SAMPLER_EXP_LATENCY   #: exp pipeline after the last issue
    DIV_CYCLES = timing.SAMPLER_DIV_CYCLES     #: restoring divider, a bit of R a cycle

    def __init__(self, config: EngineConfig, lanes: int | None = None):
        self.config = config
        self.lanes = config.lanes if lanes is None else lanes
        if self.lanes < 1:
            raise ValueError(f"lanes must be positive, got {self.lanes}")
        self.topk_max = config.topk_max
        self.vocab_max = config.vocab_max
        super().__init__({
            "req": In(stream.Signature(SamplerRequest(self.topk_max))),
            "logits": In(stream.Signature(LogitBeat(self.lanes))),
            "o": Out(stream.Signature(SamplerResult(self.topk_max))),
        })

    def latency(self, k: int, n: int | None = None) -> int:
        """Cycles from the clock edge that accepts the last logit beat to ``o.valid``.

        Assumes the request was already accepted. ``k`` is the request's top-k, ``n`` the
        number of logits (default: at least ``k``). The collect phase itself costs one
        cycle per beat, overlapped with the producer.
        """
        k = min(max(k, 1), self.topk_max)
        k_eff = k if n is None else min(k, n)
        if k_eff == 0:
            return (self.lanes * k if self.lanes > 1 else 0) + 1
        return timing.sampler_latency(self.lanes, k, k_eff)

    def elaborate(self, platform):
        m = Module()
        K, L = self.topk_max, self.lanes
        idx_shape = unsigned(_bits(self.vocab_max - 1))
        sum_bits = _bits(K << 16)                 # Σe ≤ k · 2^16
        one = 1 << nx.PROB_BITS

        m.submodules.exp_rom = rom = Memory(shape=unsigned(17), depth=256,
                                            init=[int(v) for v in nx.EXP2_LUT])
        rom_rd = rom.read_port()

        lanes = [TopList(K, idx_shape, f"lane{l}", by_index=False) for l in range(L)]
        final = TopList(K, idx_shape, "top", by_index=True) if L > 1 else lanes[0]

        phase = Signal(_Phase)
        in_phase = {p: Signal(name=f"in_{p.name.lower()}") for p in _Phase}
        for p, sig in in_phase.items():
            m.d.comb += sig.eq(phase == p)

        # ---- request registers and the RNG ----------------------------------------------
        have_req, done = Signal(), Signal()
        k_req = Signal(range(1, K + 1))
        t_mult = Signal(nx.MULT_BITS)
        t_shift = Signal(range(34))              # shifts ≥ 33 round every d·t_mult < 2^32 to 0
        sample = Signal()
        thr = Signal(nx.PROB_BITS + 1)           # 2^24 − r24, in [1, 2^24]
        base = Signal(range(self.vocab_max + 1))

        rq = self.req.payload
        req_fire = Signal()
        m.d.comb += [self.req.ready.eq(in_phase[_Phase.COLLECT] & ~have_req),
                     req_fire.eq(self.req.valid & self.req.ready)]
        with m.If(req_fire):
            tm_zero = rq.t_mult == 0
            m.d.sync += [
                have_req.eq(1),
                k_req.eq(Mux(rq.k == 0, 1, Mux(rq.k > K, K, rq.k))),
                t_mult.eq(Mux(tm_zero, nx.T1_MULT, rq.t_mult)),
                t_shift.eq(Mux(tm_zero, nx.T1_SHIFT, Mux(rq.t_shift > 33, 33, rq.t_shift))),
                sample.eq(rq.sample),
            ]
        # The draw is ready Rng32.LATENCY cycles after the request: long before the
        # probability pass needs it (exp and divide alone take more than 29 cycles).
        rng_valid, rng_word = _rng32_pipeline(m, C(1, 1), req_fire, rq.seed, rq.counter)
        with m.If(rng_valid):
            m.d.sync += thr.eq(one - (rng_word >> (32 - nx.PROB_BITS)))

        # ---- collect ----------------------------------------------------------------------
        beat = self.logits.payload
        fire = Signal()
        m.d.comb += [self.logits.ready.eq(in_phase[_Phase.COLLECT] & ~done),
                     fire.eq(self.logits.valid & self.logits.ready)]
        with m.If(in_phase[_Phase.COLLECT]):
            for l, lst in enumerate(lanes):
                lst.insert(m, fire & (beat.count > l), beat.data[l],
                           (base + l)[:idx_shape.width])
        with m.If(fire):
            m.d.sync += base.eq(base + beat.count)
            with m.If(beat.last):
                m.d.sync += done.eq(1)
        start = Signal()
        m.d.comb += start.eq(in_phase[_Phase.COLLECT] & (done | (fire & beat.last))
                             & (have_req | req_fire))

        # ---- merge (lanes > 1): lane 0 holds original lane `mlane`; the lanes rotate -----
        if L > 1:
            mrank = Signal(range(K))
            mlane = Signal(range(L))
            merge_last = Signal()
            m.d.comb += merge_last.eq((mlane == L - 1) & (mrank == k_req - 1))
            with m.If(in_phase[_Phase.MERGE]):
                for l in range(L):
                    lanes[l].copy_from(m, lanes[(l + 1) % L])
                final.insert(m, select(lanes[0].vld, mrank), select(lanes[0].val, mrank),
                             select(lanes[0].idx, mrank))
                m.d.sync += mlane.eq(Mux(mlane == L - 1, 0, mlane + 1))
                with m.If(mlane == L - 1):
                    m.d.sync += mrank.eq(mrank + 1)
            with m.If(start):
                m.d.sync += [mrank.eq(0), mlane.eq(0)]

        # ---- exp pipeline: issue j -> d -> d·t_mult -> u -> ROM (+ shift) -> Σe ----------
        j = Signal(range(K + 1))                 # issued so far; k_eff once EXP ends
        issue = Signal()
        m.d.comb += issue.eq(in_phase[_Phase.EXP] & (j < k_req) & select(final.vld, j))
        ev1, ev2, ev3, ev4 = (Signal(name=f"ev{s}") for s in range(1, 5))
        d1 = Signal(16)
        prod2 = Signal(32)
        u3 = Signal(32)
        nsh4 = Signal(range(_EXP_ZERO_SHIFT + 1))
        e_sr = [Signal(17, name=f"e{i}") for i in range(K)]   # e_sr[0] = most recent
        esum = Signal(sum_bits)

        half = Signal(33)
        u_wide = Signal(34)
        e_new = Signal(17)
        int_part = u3[8:]
        m.d.comb += [
            half.eq((C(1, 34) << t_shift) >> 1),                 # 2^(s−1); 0 for s = 0
            u_wide.eq((prod2 + half) >> t_shift),
            rom_rd.addr.eq(u3[:8]),
            e_new.eq(Mux(nsh4 >= _EXP_ZERO_SHIFT, 0, rom_rd.data >> nsh4)),
        ]
        m.d.sync += [
            ev1.eq(issue), d1.eq(final.val[0] - select(final.val, j)),   # ≥ 0: the list is sorted
            ev2.eq(ev1), prod2.eq(d1 * t_mult),
            ev3.eq(ev2), u3.eq(u_wide),
            ev4.eq(ev3), nsh4.eq(Mux(int_part >= _EXP_ZERO_SHIFT, _EXP_ZERO_SHIFT, int_part)),
        ]
        with m.If(issue):
            m.d.sync += j.eq(j + 1)
        with m.If(ev4):
            m.d.sync += [esum.eq(esum + e_new), e_sr[0].eq(e_new)]
            m.d.sync += [e_sr[i].eq(e_sr[i - 1]) for i in range(1, K)]
        exp_done = Signal()
        m.d.comb += exp_done.eq(in_phase[_Phase.EXP] & ~issue & ~(ev1 | ev2 | ev3))

        # ---- divider: R = floor(2^40 / Σe), Σe ≥ 2^16 so R < 2^25 -----------------------
        rem = Signal(sum_bits)
        recip = Signal(PROB_WIDTH)
        dcount = Signal(range(self.DIV_CYCLES))
        trial = Signal(sum_bits + 1)
        ge = Signal()
        m.d.comb += [trial.eq(rem << 1), ge.eq(trial >= esum)]
        with m.If(in_phase[_Phase.DIV]):
            m.d.sync += [rem.eq(Mux(ge, trial - esum, trial)), recip.eq(Cat(ge, recip[:-1])),
                         dcount.eq(dcount + 1)]
        with m.If(exp_done):
            m.d.sync += [rem.eq(_DIVIDEND >> self.DIV_CYCLES), recip.eq(0), dcount.eq(0)]
        div_done = Signal()
        m.d.comb += div_done.eq(in_phase[_Phase.DIV] & (dcount == self.DIV_CYCLES - 1))

        # ---- probabilities and the draw, j = k−1 … 1 ------------------------------------
        pj = Signal(range(K))
        pissue = Signal()
        m.d.comb += pissue.eq(in_phase[_Phase.PROB] & (pj != 0))
        pv1, pv2 = Signal(), Signal()
        pj1, pj2 = Signal(range(K)), Signal(range(K))
        e1 = Signal(17)
        prod_p = Signal(17 + PROB_WIDTH)
        p_arr = [Signal(PROB_WIDTH, name=f"p{i}") for i in range(K)]
        suf = Signal(PROB_WIDTH)                 # Σ_{i > j} p_i
        sel = Signal(range(K))
        m.d.sync += [pv1.eq(pissue), e1.eq(e_sr[0]), pj1.eq(pj),
                     pv2.eq(pv1), prod_p.eq(e1 * recip), pj2.eq(pj1)]
        with m.If(pissue):
            m.d.sync += pj.eq(pj - 1)
            m.d.sync += [e_sr[i].eq(e_sr[i + 1]) for i in range(K - 1)]
        with m.If(div_done):
            m.d.sync += pj.eq(j - 1)
        p_new = prod_p[16:16 + PROB_WIDTH]
        draw = Signal()
        m.d.comb += draw.eq(sample & (suf < thr))
        with m.If(pv2):
            for i in range(1, K):
                with m.If(pj2 == i):
                    m.d.sync += p_arr[i].eq(p_new)
            m.d.sync += suf.eq(suf + p_new)
            with m.If(draw):
                m.d.sync += sel.eq(pj2)
        with m.If(in_phase[_Phase.FIN]):
            m.d.sync += p_arr[0].eq(one - suf)
            with m.If(draw):
                m.d.sync += sel.eq(0)
        with m.If(start):
            m.d.sync += [j.eq(0), esum.eq(0), suf.eq(0), sel.eq(0)]

        # ---- result: combinational from the held registers ----------------------------
        k_eff = j
        op = self.o.payload
        m.d.comb += [op.k.eq(k_eff), op.rank.eq(sel), self.o.valid.eq(in_phase[_Phase.OUT])]
        for i in range(K):
            keep = k_eff > i
            m.d.comb += [op.ids[i].eq(Mux(keep, final.idx[i], 0)),
                         op.probs[i].eq(Mux(keep, p_arr[i], 0))]
        m.d.comb += [op.token.eq(Mux(k_eff != 0, select(final.idx, sel), 0)),
                     op.prob.eq(Mux(k_eff != 0, select(p_arr, sel), 0))]
        out_done = Signal()
        m.d.comb += out_done.eq(self.o.valid & self.o.ready)
        with m.If(out_done):
            for lst in lanes + ([final] if L > 1 else []):
                lst.clear(m)
            m.d.sync += [base.eq(0), done.eq(0), have_req.eq(0)]

        # ---- phase sequencing -------------------------------------------------------------
        with m.If(start):
            m.d.sync += phase.eq(_Phase.MERGE if L > 1 else _Phase.EXP)
        if L > 1:
            with m.If(in_phase[_Phase.MERGE] & merge_last):
                m.d.sync += phase.eq(_Phase.EXP)
        with m.If(exp_done):
            m.d.sync += phase.eq(Mux(j == 0, _Phase.OUT, _Phase.DIV))    # j = 0: empty vector
        with m.If(div_done):
            m.d.sync += phase.eq(Mux(j == 1, _Phase.FIN, _Phase.PROB))
        with m.If(in_phase[_Phase.PROB] & ~pissue & ~pv1):
            m.d.sync += phase.eq(_Phase.FIN)
        with m.If(in_phase[_Phase.FIN]):
            m.d.sync += phase.eq(_Phase.OUT)
        with m.If(out_done):
            m.d.sync += phase.eq(_Phase.COLLECT)
        return m
