"""Softmax and attention: exp2 path, softmax weights, reciprocal, normaliser, attention.

All bit-exact with :mod:`dfvg_hw.spec.numerics`:

* :class:`SoftmaxExp` — the exp path ``exp2_neg(round_shift((max − s) · mult, shift))``:
  subtract, multiply, rounding shift into the 256 × 17-bit ``EXP2_LUT`` ROM, shift.
* :class:`SoftmaxWeights` — :func:`numerics.softmax_weights` over a vector of int32
  scores streamed ``lanes`` per beat: buffers the vector, finds its maximum, then
  streams the weights, and reports their sum ``E``.
* :class:`Reciprocal` — ``floor(2^32 / E)``, a sequential restoring divider (one quotient
  bit per cycle, 34 cycles).
* :class:`Normalizer` — ``sat8(round_shift(num · R, 32))`` per lane, on the shared
  requantiser.
* :class:`Attention` — :func:`numerics.attention` for query heads over streamed K and
  V rows, composed of the pieces above; a score pass and a weights pass work on
  different heads at once, with a third head's scores waiting between them.
"""

from __future__ import annotations

from amaranth import Array, Cat, Const, Module, Mux, Signal, signed, unsigned
from amaranth.lib import data, enum, stream, wiring
from amaranth.lib.memory import Memory
from amaranth.lib.wiring import In, Out
from amaranth.utils import ceil_log2

from dfvg_hw.spec import numerics as nx
from dfvg_hw.spec import kv_timing, timing
from dfvg_hw.spec.config import EngineConfig
from dfvg_hw.dsp_pack import PACKED_BITS, packed_operand, unpacked_products
from dfvg_hw.elementwise import WIDE_BITS, VectorRequantizer, narrow_unless_wide, reduce_tree

__all__ = ["SoftmaxExp", "SoftmaxWeights", "Reciprocal", "Normalizer", "Attention",
           "EXP_BITS", "RECIP_OUT_BITS"]

#: Width of a softmax weight: Q0.16 in [0, 2^16].
EXP_BITS = nx.EXP_FRAC + 9
#: Width of the attention reciprocal floor(2^32 / E) for E ≥ 2^16: at most 2^16.
RECIP_OUT_BITS = nx.RECIP_BITS - 16 + 1


def _smax(a, b):
    return Mux(a > b, a, b)


class SoftmaxExp(wiring.Component):
    """Exp path of the softmax, ``lanes`` scores per beat.

    Per lane ``e = exp2_neg(round_shift((max − s) · mult, shift))`` (0 for a lane whose
    ``keep`` bit is clear), bit-exact with :func:`numerics.softmax_weights` given the
    vector's maximum. Four stages, initiation interval 1:

    1. ``d = max − s`` (unsigned, < 2^score_bits);
    2. ``p = d · mult``;
    3. ``u = (p + 2^(shift−1)) >> shift``; ``EXP2_LUT[u mod 2^8]`` read (synchronous ROM,
       one copy per lane) while ``n = u >> 8`` is registered (n ≥ 17 gives 0);
    4. ``e = EXP2_LUT[…] >> n``.

    Parameters
    ----------
    lanes : int
        Scores per beat.
    score_bits : int
        Signed score width (32 for int32 scores; attention uses less).

    Members
    -------
    i : In(stream.Signature(StructLayout({"s": ArrayLayout(signed(score_bits), lanes), "keep": unsigned(lanes), "max": signed(score_bits), "mult": unsigned(16), "shift": unsigned(6), "last": 1})))
        Scores, lane mask, the vector's maximum and (mult, shift), end-of-vector flag.
    o : Out(stream.Signature(StructLayout({"e": ArrayLayout(unsigned(17), lanes), "last": 1})))
        Weights in Q0.16 and the end-of-vector flag.
    """

    LATENCY = timing.SOFTMAX_EXP_LATENCY

    def __init__(self, lanes: int, score_bits: int = 32):
        self.lanes, self.score_bits = lanes, score_bits
        super().__init__({
            "i": In(stream.Signature(data.StructLayout({
                "s": data.ArrayLayout(signed(score_bits), lanes),
                "keep": unsigned(lanes),
                "max": signed(score_bits),
                "mult": unsigned(nx.MULT_BITS),
                "shift": unsigned(6),
                "last": 1,
            }))),
            "o": Out(stream.Signature(data.StructLayout({
                "e": data.ArrayLayout(unsigned(EXP_BITS), lanes),
                "last": 1,
            }))),
        })

    def elaborate(self, platform):
        m = Module()
        sb, lanes = self.score_bits, self.lanes
        p_bits = sb + nx.MULT_BITS
        max_shift = p_bits + 1          # p < 2^p_bits: any larger shift rounds to 0 as this one
        adv = Signal()
        m.d.comb += [adv.eq(~self.o.valid | self.o.ready), self.i.ready.eq(adv)]
        ip = self.i.payload

        v1, v2, v3 = Signal(), Signal(), Signal()
        last1, last2, last3 = Signal(), Signal(), Signal()
        mult1 = Signal(unsigned(nx.MULT_BITS))
        shift1, shift2 = Signal(range(max_shift + 1)), Signal(range(max_shift + 1))
        keep1, keep2 = Signal(lanes), Signal(lanes)
        with m.If(adv):
            m.d.sync += [
                v1.eq(self.i.valid), last1.eq(ip.last), keep1.eq(ip.keep), mult1.eq(ip.mult),
                shift1.eq(Mux(ip.shift > max_shift, max_shift, ip.shift)),
                v2.eq(v1), last2.eq(last1), keep2.eq(keep1), shift2.eq(shift1),
                v3.eq(v2), last3.eq(last2),
                self.o.valid.eq(v3), self.o.payload.last.eq(last3),
            ]
        half = Signal(p_bits + 1)
        m.d.comb += half.eq((Const(1, p_bits + 2) << shift2) >> 1)
        for l in range(lanes):
            d1 = Signal(unsigned(sb), name=f"d1_{l}")
            p2 = Signal(unsigned(p_bits), name=f"p2_{l}")
            u = Signal(unsigned(p_bits + 1), name=f"u_{l}")
            n3 = Signal(range(nx.EXP_ONE.bit_length() + 1), name=f"n3_{l}")
            zero3 = Signal(name=f"zero3_{l}")
            # one ROM copy per lane (yosys maps a many-read-port memory poorly)
            rom = m.submodules[f"exp2_lut{l}"] = Memory(
                shape=unsigned(EXP_BITS), depth=1 << nx.EXP_FRAC,
                init=[int(v) for v in nx.EXP2_LUT])
            rp = rom.read_port()
            m.d.comb += [u.eq((p2 + half) >> shift2), rp.en.eq(adv), rp.addr.eq(u[:nx.EXP_FRAC])]
            n = u[nx.EXP_FRAC:]
            with m.If(adv):
                m.d.sync += [
                    d1.eq(ip.max - ip.s[l]),
                    p2.eq(d1 * mult1),
                    n3.eq(n[:n3.shape().width]),
                    zero3.eq(~keep2[l] | (n >= 17)),
                    self.o.payload.e[l].eq(Mux(zero3, 0, rp.data >> n3)),
                ]
        return m


class SoftmaxWeightsInput(data.StructLayout):
    def __init__(self, lanes: int, score_bits: int = 32):
        super().__init__({"s": data.ArrayLayout(signed(score_bits), lanes),
                          "keep": unsigned(lanes), "last": 1})


class _SwPhase(enum.Enum, shape=2):
    LOAD = 0
    DRAIN = 1
    EMIT = 2


class SoftmaxWeights(wiring.Component):
    """Unnormalised softmax weights, bit-exact with :func:`numerics.softmax_weights`.

    Two passes per vector. **Load:** beats of ``lanes`` int32 scores (``keep`` marks the
    valid lanes of a partial last beat; at least one lane of a vector must be kept) are
    written to a score buffer while a registered max tree and a running maximum find
    ``max(s)``. **Emit:** the buffer is read back in order through :class:`SoftmaxExp`
    (with ``mult``/``shift`` sampled with the vector's last input beat) and the weights
    stream out on ``o``, ``lanes`` per beat (0 in lanes not kept), ``last`` on the final
    beat. The sum ``E = Σ e`` of the vector's weights follows on ``total`` (one beat per
    vector, ``2 + ceil(log2 lanes)`` cycles after the last weight beat), ready for
    :class:`Reciprocal`.

    The next vector loads while the previous one's tail is emitted; its emit pass waits
    until the previous ``total`` has been taken.

    Parameters
    ----------
    config : EngineConfig
        ``lanes`` sets the beat width.
    max_len : int, optional
        Longest vector in elements (default ``config.kv_positions``, one score per KV
        position); the buffer holds ``ceil(max_len / lanes)`` beats.

    Members
    -------
    i : In(stream.Signature(SoftmaxWeightsInput(lanes)))
        Scores.
    mult : In(unsigned(16))
        Score → log2-units multiplier (numerics.md §5.2).
    shift : In(unsigned(6))
        Its shift.
    o : Out(stream.Signature(StructLayout({"e": ArrayLayout(unsigned(17), lanes), "last": 1})))
        Weights, Q0.16.
    total : Out(stream.Signature(unsigned(total_bits)))
        ``Σ e`` per vector.

    Timing: the first weight beat is valid ``LOAD_TO_EMIT`` = ``3 + ceil(log2 lanes) +
    SoftmaxExp.LATENCY`` edges after the edge that accepts the vector's last score
    beat; then one beat per cycle.
    """

    def __init__(self, config: EngineConfig, max_len: int | None = None):
        self.lanes = config.lanes
        self.max_len = config.kv_positions if max_len is None else max_len
        self.depth = -(-self.max_len // self.lanes)
        self.total_bits = (self.max_len * nx.EXP_ONE).bit_length()
        self.LOAD_TO_EMIT = timing.softmax_load_to_emit(self.lanes)
        super().__init__({
            "i": In(stream.Signature(SoftmaxWeightsInput(self.lanes))),
            "mult": In(unsigned(nx.MULT_BITS)),
            "shift": In(unsigned(6)),
            "o": Out(stream.Signature(data.StructLayout({
                "e": data.ArrayLayout(unsigned(EXP_BITS), self.lanes), "last": 1}))),
            "total": Out(stream.Signature(unsigned(self.total_bits))),
        })

    def elaborate(self, platform):
        m = Module()
        lanes = self.lanes
        ex = m.submodules.exp = SoftmaxExp(lanes, 32)
        buf_layout = data.StructLayout({"s": data.ArrayLayout(signed(32), lanes),
                                        "keep": unsigned(lanes)})
        buf = m.submodules.buffer = Memory(shape=buf_layout, depth=self.depth, init=[])
        wp, rp = buf.write_port(), buf.read_port()
        ip = self.i.payload
        phase = Signal(_SwPhase)
        count = Signal(range(self.depth + 1))
        first = Signal(init=1)
        mult, shift = Signal(unsigned(nx.MULT_BITS)), Signal(6)
        total_pending = Signal()
        r_v, r_last = Signal(), Signal()        # read stage of the emit pass

        # -- load: buffer the scores, running maximum over kept lanes ------------------------
        take = Signal()
        m.d.comb += [take.eq(self.i.valid & self.i.ready),
                     # the last beat of the previous vector may still wait in the read
                     # stage, reading vmax/mult/shift: the next vector starts after it
                     self.i.ready.eq((phase == _SwPhase.LOAD) & ~r_v),
                     wp.en.eq(take), wp.addr.eq(Mux(first, 0, count)),
                     wp.data.s.eq(ip.s), wp.data.keep.eq(ip.keep)]
        lo = -(1 << 31)
        masked = [Mux(ip.keep[l], ip.s[l], lo) for l in range(lanes)]
        beat_max, t_v, (t_first, t_last), _ = reduce_tree(
            m, masked, _smax, valid=take, tags=[first, ip.last], name="max")
        vmax = Signal(signed(32))
        max_done = Signal()
        with m.If(take):
            m.d.sync += [first.eq(ip.last), count.eq(Mux(first, 1, count + 1))]
        with m.If(take & ip.last):
            m.d.sync += [mult.eq(self.mult), shift.eq(self.shift)]
        m.d.sync += max_done.eq(t_v & t_last)
        with m.If(t_v):
            m.d.sync += vmax.eq(Mux(t_first, beat_max, _smax(vmax, beat_max)))

        # -- emit: read back in order through the exp path ------------------------------------
        rd = Signal(range(self.depth + 1))
        r_adv = Signal()
        issue = Signal()
        m.d.comb += [
            r_adv.eq(~r_v | ex.i.ready),
            issue.eq(r_adv & (phase == _SwPhase.EMIT)),
            rp.en.eq(r_adv), rp.addr.eq(rd),
            ex.i.valid.eq(r_v),
            ex.i.payload.s.eq(rp.data.s), ex.i.payload.keep.eq(rp.data.keep),
            ex.i.payload.max.eq(vmax), ex.i.payload.mult.eq(mult), ex.i.payload.shift.eq(shift),
            ex.i.payload.last.eq(r_last),
        ]
        with m.If(r_adv):
            m.d.sync += [r_v.eq(issue), r_last.eq(rd == count - 1)]
        with m.If(issue):
            m.d.sync += rd.eq(rd + 1)

        with m.If(phase == _SwPhase.LOAD):
            with m.If(take & ip.last):
                m.d.sync += phase.eq(_SwPhase.DRAIN)
        with m.Elif(phase == _SwPhase.DRAIN):       # max tree empties; previous total taken
            with m.If(max_done):
                m.d.sync += max_done.eq(1)          # hold until the emit pass can start
            with m.If(max_done & ~total_pending):
                m.d.sync += [phase.eq(_SwPhase.EMIT), rd.eq(0), max_done.eq(0)]
        with m.Else():                               # EMIT
            with m.If(issue & (rd == count - 1)):
                m.d.sync += phase.eq(_SwPhase.LOAD)

        # -- output and the sum of the weights --------------------------------------------------
        m.d.comb += [self.o.valid.eq(ex.o.valid), self.o.payload.eq(ex.o.payload),
                     ex.o.ready.eq(self.o.ready)]
        hs = Signal()
        m.d.comb += hs.eq(self.o.valid & self.o.ready)
        esum, e_v, (e_last,), _ = reduce_tree(m, list(ex.o.payload.e), lambda a, b: a + b,
                                              valid=hs, tags=[ex.o.payload.last], name="esum")
        acc, acc_first = Signal(self.total_bits), Signal(init=1)
        new = Signal(self.total_bits)
        m.d.comb += new.eq(Mux(acc_first, 0, acc) + esum)
        with m.If(self.total.valid & self.total.ready):
            m.d.sync += [self.total.valid.eq(0), total_pending.eq(0)]
        with m.If(e_v):
            m.d.sync += [acc.eq(new), acc_first.eq(e_last)]
            with m.If(e_last):
                m.d.sync += [self.total.valid.eq(1), self.total.payload.eq(new)]
        with m.If(ex.i.valid & ex.i.ready & r_last):
            m.d.sync += total_pending.eq(1)
        return m


class Reciprocal(wiring.Component):
    """``floor(2^dividend_log2 / E)`` by a sequential restoring divider.

    One quotient bit per cycle, most significant first, over the ``dividend_log2 + 1``
    bits of the dividend ``2^dividend_log2``: the partial remainder is shifted left with
    the next dividend bit, compared with ``E`` and reduced when not smaller. With the
    default 32 that is 33 iterations after the load cycle: ``LATENCY = 34``.

    A divisor known to be ``E ≥ 2^min_divisor_log2`` (attention's sum of weights: the
    maximum's own weight is ``EXP_ONE = 2^16``) makes the first ``min_divisor_log2``
    quotient bits 0 and leaves the remainder ``2^(min_divisor_log2 − 1)`` after them: the
    divider starts there, ``min_divisor_log2`` cycles sooner (attention: ``LATENCY = 18``)
    with the same quotient. ``E = 0``, or ``E`` below the bound, is undefined.

    Parameters
    ----------
    divisor_bits : int
        Width of the unsigned divisor ``E``.
    dividend_log2 : int
        ``log2`` of the dividend (32 for attention, 40 for the sampler).
    min_divisor_log2 : int, optional
        ``E ≥ 2^min_divisor_log2`` is guaranteed (default 0: any ``E ≥ 1``); at most
        ``dividend_log2``.

    Members
    -------
    i : In(stream.Signature(unsigned(divisor_bits)))
        The divisor.
    o : Out(stream.Signature(unsigned(dividend_log2 + 1)))
        The quotient.
    """

    def __init__(self, divisor_bits: int, dividend_log2: int = nx.RECIP_BITS,
                 min_divisor_log2: int = 0):
        assert 0 <= min_divisor_log2 <= dividend_log2
        self.divisor_bits, self.dividend_log2 = divisor_bits, dividend_log2
        self.min_divisor_log2 = min_divisor_log2
        self.LATENCY = timing.reciprocal_latency(dividend_log2, min_divisor_log2)
        super().__init__({
            "i": In(stream.Signature(unsigned(divisor_bits))),
            "o": Out(stream.Signature(unsigned(dividend_log2 + 1))),
        })

    def elaborate(self, platform):
        m = Module()
        skip = self.min_divisor_log2
        steps = self.dividend_log2 + 1 - skip
        div = Signal(self.divisor_bits)
        rem = Signal(self.divisor_bits + 1)
        q = self.o.payload
        count = Signal(range(steps + 1))
        busy = Signal()
        m.d.comb += self.i.ready.eq(~busy & (~self.o.valid | self.o.ready))
        with m.If(self.o.valid & self.o.ready):
            m.d.sync += self.o.valid.eq(0)
        with m.If(self.i.valid & self.i.ready):
            # the remainder after the skipped steps: the dividend's one, shifted on
            m.d.sync += [div.eq(self.i.payload), rem.eq((1 << skip) >> 1), q.eq(0),
                         count.eq(steps), busy.eq(1)]
        with m.If(busy):
            # the dividend 2^dividend_log2 has a single one, met on the first step unless
            # skipped
            rem2 = Cat((count == steps) & (skip == 0), rem)
            ge = rem2 >= div
            m.d.sync += [rem.eq(Mux(ge, rem2 - div, rem2)), q.eq(Cat(ge, q)),
                         count.eq(count - 1)]
            with m.If(count == 1):
                m.d.sync += [busy.eq(0), self.o.valid.eq(1)]
        return m


class Normalizer(wiring.Component):
    """Attention output scaling ``o = sat8(round_shift(num · R, 32 + x))`` per lane, or with
    ``wide`` ``sat16(round_shift(num · R, 24 + x))`` (``ATTN`` with ``WIDE``), where ``x =
    kv_bits − 8`` (V's elements are ``kv_bits`` wide; numerics.attention).

    ``R = floor(2^32 / E) ≤ 2^16`` needs 17 bits, one more than the shared requantiser's
    multiplier; ``R = 2^16`` is passed as ``(mult, shift) = (2^15, 31)``, which rounds
    identically (``round_shift(num·2^16, 32) = round_shift(num·2^15, 31)``), every other
    ``R`` as ``(R, 32)``; 8 less for a wide output, ``x`` more. The rest is a
    :class:`VectorRequantizer`: ``LATENCY = 3``.

    Parameters
    ----------
    lanes : int
        Elements per beat.
    num_bits : int
        Signed width of the numerators ``Σ e·v``.
    kv_bits : int
        Width of a V element (8 by default).

    Members
    -------
    i : In(stream.Signature(StructLayout({"num": ArrayLayout(signed(num_bits), lanes), "recip": unsigned(17), "wide": 1})))
        Numerators, the reciprocal of their weight sum, and the output width.
    o : Out(stream.Signature(ArrayLayout(signed(16), lanes)))
        The attention output (int8 sign-extended unless wide).
    """

    LATENCY = timing.NORMALIZER_LATENCY

    def __init__(self, lanes: int, num_bits: int, kv_bits: int = nx.ACT_BITS):
        self.lanes, self.num_bits, self.kv_bits = lanes, num_bits, kv_bits
        super().__init__({
            "i": In(stream.Signature(data.StructLayout({
                "num": data.ArrayLayout(signed(num_bits), lanes),
                "recip": unsigned(RECIP_OUT_BITS), "wide": 1}))),
            "o": Out(stream.Signature(data.ArrayLayout(signed(WIDE_BITS), lanes))),
        })

    def elaborate(self, platform):
        m = Module()
        vr = m.submodules.requant = VectorRequantizer(self.lanes, WIDE_BITS, self.num_bits,
                                                      side=1)
        recip, wide = self.i.payload.recip, self.i.payload.wide
        full = recip[nx.MULT_BITS]                          # R = 2^16
        mult = Mux(full, 1 << (nx.MULT_BITS - 1), recip[:nx.MULT_BITS])
        shift = (Mux(full, nx.RECIP_BITS - 1, nx.RECIP_BITS) + (self.kv_bits - nx.ACT_BITS)
                 - Mux(wide, WIDE_BITS - nx.ACT_BITS, 0))
        for l in range(self.lanes):
            r = vr.i.payload.r[l]
            m.d.comb += [r.acc.eq(self.i.payload.num[l]), r.mult.eq(mult), r.shift.eq(shift)]
            m.d.comb += self.o.payload[l].eq(narrow_unless_wide(vr.o.payload.y[l],
                                                                vr.o.payload.side))
        m.d.comb += [
            vr.i.valid.eq(self.i.valid), self.i.ready.eq(vr.i.ready), vr.i.payload.side.eq(wide),
            self.o.valid.eq(vr.o.valid), vr.o.ready.eq(self.o.ready),
        ]
        return m


def _shift_add_product(e, v):
    """``e · v`` for unsigned ``e`` and signed ``v`` (int8, or a wider KV element) without
    a multiplier: the partial products ``e · 2^i`` of ``v``'s set bits (its top bit
    weighing −2^(w−1)) summed by a balanced adder tree, so synthesis builds LUTs and carry
    chains rather than a DSP."""
    w = len(v)
    terms = [Mux(v[i], e << i, 0) for i in range(w - 1)]
    terms.append(-Mux(v[w - 1], e << (w - 1), 0))
    while len(terms) > 1:
        terms = [terms[i] + terms[i + 1] if i + 1 < len(terms) else terms[i]
                 for i in range(0, len(terms), 2)]
    return terms[0]


class Attention(wiring.Component):
    """One query head over streamed K and V rows, bit-exact with :func:`numerics.attention`.

    Rows come in groups of ``B = config.kv_banks`` (one per KV bank; one row when
    ``B = 1``), a group a cycle. Sequence per head (``T`` = number of K rows,
    ``G = ceil(T / B)`` groups, ``D = config.head_dim``):

    1. ``q`` beat: the query and the ATTN block's (mult, shift).
    2. **Scores** (the score pass): one group of K rows per cycle; ``B·D`` products of
       K (``kv_bits``-bit elements) and the query (``q_bits``: int8, or ATTN ``IN16``'s
       int16 read as 11 bits over int8 K, 16 over wider K, :func:`numerics.attention_query`)
       and ``B`` registered adder trees give ``s_t = K[t]·q``, written (with the group's
       ``keep`` mask) to one of three ``ceil(kv_positions / B)``-deep score buffers, while
       a registered max tree over the kept lanes (``ceil(log2 B)`` levels) feeds a running
       maximum. ``last`` on the final group ends the pass. Banks ``2i`` and ``2i + 1`` meet
       the same ``q[j]``, so with int8 K their two products are one DSP48E2 product
       (:mod:`dfvg_hw.dsp_pack`): ``B·D / 2`` multipliers; wider K elements do not pack
       (``kv_bits + q_bits − 1`` bits a product), ``B·D``.
    3. **Weights** (the weights pass): takes the head (its maximum, group count, mult,
       shift and width; an accumulator set cleared) once its scores are complete, the
       head before has met its last V group, and one of the two accumulator sets is free
       (its head's ``E`` gone to the reciprocal). The buffer is read back through
       :class:`SoftmaxExp` (``B`` lanes, a group per cycle; 0 for lanes not kept); the
       group's weights ``e_t`` meet its V rows (one group per cycle, in order): ``E += Σ
       e_t`` and ``num[d] += Σ e_t · V[t][d]`` through registered adder trees over the ``B``
       lanes. Integer sums, so the result is the functional model's in any grouping.
       The ``e·V`` products of banks ``V_DSP_BANKS`` and up are shift-and-add logic.
    4. **Reciprocal:** ``R = floor(2^32 / E)`` (:class:`Reciprocal`, 34 cycles).
    5. **Output:** ``o[d] = sat8(round_shift(num[d] · R, 32 + kv_bits − 8))``, or int16
       with the q beat's ``wide`` (:class:`Normalizer`).

    With all streams ready, the output is valid ``cycles(T) = 2·G + ceil(log2 D) +
    2·ceil(log2 B) + 45`` edges after the edge that accepts ``q``
    (:func:`dfvg_hw.spec.kv_timing.attention_head_cycles`). **Heads in flight:** the next
    head's ``q`` is accepted the cycle after this head's last K group (its scores still
    in the trees; each group carries its head's buffer and a first-group flag) once the
    next score buffer in turn has been read, so K groups stream back to back, one cycle
    apart for the ``q`` beat, and beside them the V groups of an earlier head. The weights
    pass takes the heads in turn, on the edge the one before meets its last V group at the
    earliest (``ATTN_START_TO_JOIN`` cycles before its first V group meets its weights);
    the two accumulator sets take the heads in turn, and a head's numerators move to hold
    registers as its ``E`` goes to the reciprocal, which takes the next ``E`` once its
    quotient has gone to the normaliser. Outputs come in head order. Grouped-query
    attention streams the same K/V for every query head of the group.

    A tree row's path (docs/isa.md §9.2) comes after its positions as groups of one row
    each (row 0, ``keep = 1``): they lie in any bank. The sums are the same in any
    grouping, so only the number of groups changes: ``G = ceil(prefix / B) + path``.

    Parameters
    ----------
    config : EngineConfig
        ``head_dim`` (D), ``kv_positions`` (largest T), ``kv_banks`` (B) and ``kv_bits``
        (the K and V elements' width).
    path_entries : int, optional
        The most one-row groups a head's rows may end with (a tree row's path); each score
        buffer holds ``min(kv_positions, ceil(kv_positions / B) + path_entries)`` groups
        (T ≤ kv_positions still). Default 0: positions only.
    v_dsp_banks : int, optional
        Banks whose ``e·V`` products are multipliers (default ``V_DSP_BANKS``).

    Members
    -------
    q : In(stream.Signature(StructLayout({"q": ArrayLayout(signed(q_bits), D), "mult": unsigned(16), "shift": unsigned(6), "wide": 1})))
        The query head (int8 sign-extended, or an ``IN16`` query already saturated to
        ``q_bits``: 11, or 16 over a KV cache wider than int8), the softmax multiplier and
        the output width.
    k : In(stream.Signature(StructLayout({"row": ArrayLayout(signed(kv_bits), D), "last": 1})))
        K rows 0 … T−1, ``last`` on row T−1. With ``B ≥ 2``: ``{"rows": ArrayLayout(
        ArrayLayout(signed(kv_bits), D), B), "keep": unsigned(B), "last": 1}``, groups of rows
        ``g·B … g·B + B − 1``, ``keep`` marking the rows ``< T`` (at least row ``g·B``,
        lane 0; a path row is a group of its own in lane 0).
    v : In(stream.Signature(ArrayLayout(signed(kv_bits), D)))
        V rows 0 … T−1 (taken once the head's scores are complete, while later heads'
        K rows come); with ``B ≥ 2``
        ``ArrayLayout(ArrayLayout(signed(kv_bits), D), B)``, the same groups (rows not kept
        are ignored).
    o : Out(stream.Signature(ArrayLayout(signed(16), D)))
        The attention output (int8 sign-extended unless wide).
    """

    #: banks whose ``e·V`` products are multipliers (DSPs); the rest are shift-and-add
    #: logic, since a 17-bit weight times int8 does not pack: 16 banks' 1,024 would take
    #: alveo-u55c's engine past 70 % of its 9,024 DSPs
    V_DSP_BANKS = 8
    #: score buffers: a head's score pass, the weights pass's head, and one in between
    SCORE_BUFFERS = kv_timing.ATTN_SCORE_BUFFERS

    def __init__(self, config: EngineConfig, path_entries: int = 0,
                 v_dsp_banks: int | None = None):
        self.head_dim = d = config.head_dim
        self.banks = b = config.kv_banks
        self.v_dsp_banks = self.V_DSP_BANKS if v_dsp_banks is None else v_dsp_banks
        self.max_t = config.kv_positions
        self.kv_bits = kv_bits = config.kv_bits
        #: the query's bits (numerics.attention_query_bits): 11 over int8 K, 16 over wider
        self.q_bits = nx.attention_query_bits(kv_bits)
        #: a K element times the query, ``|k·q| ≤ 2^(kv_bits − 1) · (2^(q_bits − 1) − 1)``:
        #: int8 K < 2^17, 18 signed bits, the packed DSP product's low field (two banks
        #: share a DSP48E2); wider K one product a DSP (q on the 27-bit port)
        self.product_bits = kv_bits + self.q_bits - 1
        self.packed = kv_bits == nx.ACT_BITS
        #: groups of a score buffer: the positions' ceil(T / B), and a path's one row a group
        self.depth = min(self.max_t, -(-self.max_t // b) + path_entries)
        self.score_bits = ceil_log2(d) + self.product_bits    # int8 K: |s| ≤ D·2^17
        self.sum_bits = (self.max_t * nx.EXP_ONE).bit_length()
        self.num_bits = (self.max_t * nx.EXP_ONE << (kv_bits - 1)).bit_length() + 1
        vec = data.ArrayLayout(signed(kv_bits), d)
        if b == 1:
            k_layout, v_layout = data.StructLayout({"row": vec, "last": 1}), vec
        else:
            v_layout = data.ArrayLayout(vec, b)
            k_layout = data.StructLayout({"rows": v_layout, "keep": unsigned(b), "last": 1})
        super().__init__({
            "q": In(stream.Signature(data.StructLayout({
                "q": data.ArrayLayout(signed(self.q_bits), d),
                "mult": unsigned(nx.MULT_BITS), "shift": unsigned(6), "wide": 1}))),
            "k": In(stream.Signature(k_layout)),
            "v": In(stream.Signature(v_layout)),
            "o": Out(stream.Signature(data.ArrayLayout(signed(WIDE_BITS), d))),
        })

    def cycles(self, t: int) -> int:
        """Edges from accepting ``q`` to a valid output for ``t`` rows, streams ready.

        q (1) + K groups (G) + dot-product tree (ceil(log2 D)) + max tree (ceil(log2 B))
        + max/phase (1) + first read (1) + exp path (``SoftmaxExp.LATENCY``) + the other
        G − 1 weights + V join (1) + column-sum tree (ceil(log2 B)) + accumulate (1) +
        reciprocal (34) + normaliser (3).
        """
        return kv_timing.attention_head_cycles(self.head_dim, t, self.banks)

    @staticmethod
    def head_cycles(head_dim: int, t: int, banks: int = 1) -> int:
        """:meth:`cycles` for a given head dimension and bank count."""
        return kv_timing.attention_head_cycles(head_dim, t, banks)

    def elaborate(self, platform):
        m = Module()
        d, sb, B = self.head_dim, self.score_bits, self.banks
        depth, nbuf = self.depth, self.SCORE_BUFFERS
        ex = m.submodules.exp = SoftmaxExp(B, sb)
        # E ≥ EXP_ONE: the head's maximum has weight exp2_neg(0) = EXP_ONE
        rc = m.submodules.recip = Reciprocal(self.sum_bits,
                                             min_divisor_log2=nx.EXP_ONE.bit_length() - 1)
        nm = m.submodules.norm = Normalizer(d, self.num_bits, self.kv_bits)
        score_shape = signed(sb) if B == 1 else data.StructLayout({
            "s": data.ArrayLayout(signed(sb), B), "keep": unsigned(B)})
        # score buffer b holds groups b·depth …: heads use them in turn, so one head's scores
        # are written while an earlier head's are read and a third head's wait in between
        scores = m.submodules.scores = Memory(shape=score_shape, depth=nbuf * depth, init=[])
        wp, rp = scores.write_port(), scores.read_port()
        buf_base = Array(Const(b * depth, range(nbuf * depth)) for b in range(nbuf))

        def next_buf(b):
            return Mux(b == nbuf - 1, 0, b + 1)

        # per buffer, the head it holds: taken with q (mult, shift, wide), then its group
        # count and maximum when its scores are complete
        h_mult = Array(Signal(unsigned(nx.MULT_BITS), name=f"mult_{b}") for b in range(nbuf))
        h_shift = Array(Signal(6, name=f"shift_{b}") for b in range(nbuf))
        h_wide = Array(Signal(name=f"wide_{b}") for b in range(nbuf))
        h_groups = Array(Signal(range(depth + 1), name=f"groups_{b}") for b in range(nbuf))
        h_smax = Array(Signal(signed(sb), name=f"smax_{b}") for b in range(nbuf))
        in_use = Signal(nbuf)                   # taken by a q, its reads not all issued
        complete = Signal(nbuf)                 # its scores complete, the weights pass not begun

        q = Signal(data.ArrayLayout(signed(self.q_bits), d))
        k_buf, alloc = Signal(range(nbuf)), Signal(range(nbuf))   # the K pass's buffer, the next
        k_open, k_first = Signal(), Signal()    # K rows still expected; the next is the first
        take_q = Signal()
        # the next q once the K pass has all its rows (their scores may still be on the way)
        # and the next buffer is free
        m.d.comb += [self.q.ready.eq(~k_open & ~in_use.bit_select(alloc, 1)),
                     take_q.eq(self.q.valid & self.q.ready)]

        # -- scores: B dot products a cycle --------------------------------------------------
        take_k = Signal()
        m.d.comb += [self.k.ready.eq(k_open), take_k.eq(self.k.valid & self.k.ready)]
        k_rows = [self.k.payload.row] if B == 1 else list(self.k.payload.rows)
        p_v, p_last, p_first, p_buf = Signal(), Signal(), Signal(), Signal(range(nbuf))
        m.d.sync += [p_v.eq(take_k), p_last.eq(take_k & self.k.payload.last),
                     p_first.eq(k_first), p_buf.eq(k_buf)]
        p_keep = Signal(B)
        if B > 1:
            m.d.sync += p_keep.eq(self.k.payload.keep)
        # int8 K: banks 2i and 2i + 1 meet the same q[j], one packed DSP product carries both
        prods = [[None] * d for _ in range(B)]
        pairs = B // 2 if self.packed else 0
        pb = self.product_bits
        for i in range(pairs):
            for j in range(d):
                pk = Signal(signed(PACKED_BITS + nx.ATTN_Q_BITS), name=f"qk_{2 * i}_{2 * i + 1}_{j}")
                m.d.sync += pk.eq(packed_operand(k_rows[2 * i][j], k_rows[2 * i + 1][j]) * q[j])
                hi_floor, borrow, lo = unpacked_products(pk)
                # both products fit product_bits
                prods[2 * i][j] = (hi_floor + borrow)[:pb].as_signed()
                prods[2 * i + 1][j] = lo[:pb].as_signed()
        for b in range(2 * pairs, B):           # one bank, or wide K: plain products
            for j in range(d):
                prods[b][j] = Signal(signed(pb), name=f"qk{j}" if B == 1 else f"qk_{b}_{j}")
                m.d.sync += prods[b][j].eq(k_rows[b][j] * q[j])
        bank_scores = []
        for b in range(B):
            sfx = "" if B == 1 else f"_{b}"
            if b == 0:
                tags = [p_last, p_first, p_buf] + ([p_keep] if B > 1 else [])
                score, s_v, s_tags, _ = reduce_tree(m, prods[b], lambda x, y: x + y, valid=p_v,
                                                    tags=tags, name=f"dot{sfx}")
                s_last, s_first, s_buf = s_tags[:3]
                s_keep = s_tags[3] if B > 1 else Const(1, 1)
            else:
                score, *_ = reduce_tree(m, prods[b], lambda x, y: x + y, name=f"dot{sfx}")
            bank_scores.append(score)
        n_rows = Signal(range(depth + 1))       # groups of the head written before this one
        row = Mux(s_first, 0, n_rows)
        m.d.comb += [wp.en.eq(s_v), wp.addr.eq(buf_base[s_buf] + row)]
        if B == 1:
            m.d.comb += wp.data.eq(bank_scores[0])
        else:
            m.d.comb += [wp.data.keep.eq(s_keep)] + [wp.data.s[b].eq(bank_scores[b])
                                                      for b in range(B)]
        with m.If(s_v):
            m.d.sync += n_rows.eq(row + 1)
            with m.If(s_last):
                m.d.sync += h_groups[s_buf].eq(row + 1)
        # the group's maximum over its kept lanes (row g·B is always kept)
        lo_score = -(1 << (sb - 1))
        masked = [bank_scores[0]] + [Mux(s_keep[b], bank_scores[b], lo_score)
                                     for b in range(1, B)]
        gmax, g_v, (g_last, g_first, g_buf), _ = reduce_tree(
            m, masked, _smax, valid=s_v, tags=[s_last, s_first, s_buf], name="gmax")
        smax = Signal(signed(sb))               # the running maximum of the head's groups
        head_max = Signal(signed(sb))
        m.d.comb += head_max.eq(Mux(g_first, gmax, _smax(smax, gmax)))
        scores_done = Signal()                  # a head's last maximum, this cycle
        m.d.comb += scores_done.eq(g_v & g_last)
        with m.If(take_q):
            m.d.sync += [q.eq(self.q.payload.q), h_mult[alloc].eq(self.q.payload.mult),
                         h_shift[alloc].eq(self.q.payload.shift),
                         h_wide[alloc].eq(self.q.payload.wide),
                         k_buf.eq(alloc), alloc.eq(next_buf(alloc)), k_open.eq(1), k_first.eq(1)]
        with m.If(take_k):
            m.d.sync += k_first.eq(0)
            with m.If(self.k.payload.last):
                m.d.sync += k_open.eq(0)
        with m.If(g_v):
            m.d.sync += smax.eq(head_max)
        with m.If(scores_done):
            m.d.sync += h_smax[g_buf].eq(head_max)

        # -- weights: read a head's scores back through the exp path, meet the V rows ----------
        # The weights pass takes the next head in turn once its scores are complete (on the
        # edge of its last maximum, at the earliest), the head before has met its last V
        # group (on that edge, at the earliest: the exp path is then empty, so a head's
        # weights meet V as they would alone), and one of the two accumulator sets is free.
        v_buf = Signal(range(nbuf))             # the buffer the weights pass reads next
        r_buf = Signal(range(nbuf))             # ... and the one it reads
        v_smax = Signal(signed(sb))
        v_groups = Signal(range(depth + 1))
        v_mult, v_shift = Signal(unsigned(nx.MULT_BITS)), Signal(6)
        rd = Signal(range(depth + 1))
        r_v, r_last, r_adv, issue = Signal(), Signal(), Signal(), Signal()
        issuing = Signal()                      # reads still to issue
        m.d.comb += [
            r_adv.eq(~r_v | ex.i.ready),
            issue.eq(r_adv & issuing),
            rp.en.eq(r_adv), rp.addr.eq(buf_base[r_buf] + rd),
            ex.i.valid.eq(r_v),
            ex.i.payload.max.eq(v_smax), ex.i.payload.mult.eq(v_mult),
            ex.i.payload.shift.eq(v_shift), ex.i.payload.last.eq(r_last),
        ]
        if B == 1:
            m.d.comb += [ex.i.payload.s[0].eq(rp.data), ex.i.payload.keep.eq(1)]
        else:
            m.d.comb += [ex.i.payload.s.eq(rp.data.s), ex.i.payload.keep.eq(rp.data.keep)]
        with m.If(r_adv):
            m.d.sync += [r_v.eq(issue), r_last.eq(rd == v_groups - 1)]
        with m.If(issue):
            m.d.sync += rd.eq(rd + 1)
            with m.If(rd == v_groups - 1):
                m.d.sync += issuing.eq(0)
        with m.If(issue & (rd == v_groups - 1)):
            m.d.sync += in_use.bit_select(r_buf, 1).eq(0)

        # Two accumulator sets, heads in turn: a head accumulates in one while the head
        # before it waits in the other for the reciprocal; a set is free again once its E
        # has gone to the reciprocal (its numerators to the hold registers).
        e_sum = [Signal(self.sum_bits, name=f"e_sum{p}") for p in range(2)]
        num = [[Signal(signed(self.num_bits), name=f"num{p}_{j}") for j in range(d)]
               for p in range(2)]
        set_wide = [Signal(name=f"wide{p}") for p in range(2)]
        set_busy, set_full = Signal(2), Signal(2)   # taken by a head; its E ready
        v_set, join_set, rc_set = Signal(), Signal(), Signal()  # next to take, to meet V, to divide
        handed_off = Signal()                   # a head's E goes to the reciprocal
        head_ready = Signal()
        m.d.comb += head_ready.eq(complete.bit_select(v_buf, 1)
                                  | (scores_done & (g_buf == v_buf)))
        set_free = Signal()
        m.d.comb += set_free.eq(~set_busy.bit_select(v_set, 1)
                                | (handed_off & (rc_set == v_set)))
        start = Signal()
        w_busy = Signal()                       # the weights pass's head has V groups to meet
        last_join = Signal()
        m.d.comb += start.eq(head_ready & (~w_busy | last_join) & set_free)

        mac_v, mac_last, mac_set = Signal(), Signal(), Signal()
        join = Signal()
        m.d.comb += [join.eq(ex.o.valid & self.v.valid),
                     ex.o.ready.eq(self.v.valid), self.v.ready.eq(ex.o.valid)]
        m.d.comb += last_join.eq(join & ex.o.payload.last)
        with m.If(last_join):
            m.d.sync += [join_set.eq(~join_set), w_busy.eq(0)]
        v_rows = [self.v.payload] if B == 1 else list(self.v.payload)
        es = list(ex.o.payload.e)
        m.d.sync += [mac_v.eq(join), mac_last.eq(join & ex.o.payload.last),
                     mac_set.eq(join_set)]
        ev = [[Signal(signed(EXP_BITS + self.kv_bits + 1),
                      name=f"ev{j}" if B == 1 else f"ev_{b}_{j}") for j in range(d)]
              for b in range(B)]
        for b in range(B):
            for j in range(d):
                m.d.sync += ev[b][j].eq(es[b] * v_rows[b][j] if b < self.v_dsp_banks
                                        else _shift_add_product(es[b], v_rows[b][j]))
        # Σ_b e_b and Σ_b e_b·V_b[d]: registered trees over the B lanes (none for one bank)
        e_tot, e_v, (e_set,), _ = reduce_tree(m, es, lambda x, y: x + y, valid=join,
                                              tags=[join_set], name="esum")
        col_v = col_last = col_set = None
        for j in range(d):
            if j == 0:
                col, col_v, (col_last, col_set), _ = reduce_tree(
                    m, [ev[b][j] for b in range(B)], lambda x, y: x + y, valid=mac_v,
                    tags=[mac_last, mac_set], name=f"col{j}")
            else:
                col, *_ = reduce_tree(m, [ev[b][j] for b in range(B)], lambda x, y: x + y,
                                      name=f"col{j}")
            for p in range(2):
                with m.If(col_v & (col_set == p)):
                    m.d.sync += num[p][j].eq(num[p][j] + col)
        for p in range(2):
            with m.If(e_v & (e_set == p)):
                m.d.sync += e_sum[p].eq(e_sum[p] + e_tot)
        with m.If(col_v & col_last):
            m.d.sync += set_full.bit_select(col_set, 1).eq(1)

        # -- reciprocal and output --------------------------------------------------------------
        # The reciprocal takes the heads' E in turn; their numerators move to hold registers
        # as it does, and it takes a new E only once its previous quotient is in the
        # normaliser, which frees the hold registers on the same edge.
        num_hold = [Signal(signed(self.num_bits), name=f"num_hold{j}") for j in range(d)]
        wide_hold = Signal()
        m.d.comb += [rc.i.valid.eq(set_full.bit_select(rc_set, 1)),
                     rc.i.payload.eq(Mux(rc_set, e_sum[1], e_sum[0])),
                     handed_off.eq(rc.i.valid & rc.i.ready)]
        with m.If(handed_off):
            m.d.sync += [set_full.bit_select(rc_set, 1).eq(0),
                         set_busy.bit_select(rc_set, 1).eq(0), rc_set.eq(~rc_set),
                         wide_hold.eq(Mux(rc_set, set_wide[1], set_wide[0]))]
            m.d.sync += [num_hold[j].eq(Mux(rc_set, num[1][j], num[0][j])) for j in range(d)]
        with m.If(scores_done):
            m.d.sync += complete.bit_select(g_buf, 1).eq(1)
        with m.If(start):
            # the head's maximum, the final one on the edge of its last group
            m.d.sync += [v_smax.eq(Mux(complete.bit_select(v_buf, 1), h_smax[v_buf], head_max)),
                         v_groups.eq(Mux(s_v & s_last & (s_buf == v_buf), row + 1,
                                         h_groups[v_buf])),
                         v_mult.eq(h_mult[v_buf]), v_shift.eq(h_shift[v_buf]),
                         complete.bit_select(v_buf, 1).eq(0),
                         r_buf.eq(v_buf), v_buf.eq(next_buf(v_buf)), rd.eq(0), issuing.eq(1),
                         w_busy.eq(1),
                         set_busy.bit_select(v_set, 1).eq(1), v_set.eq(~v_set)]
            for p in range(2):
                with m.If(v_set == p):
                    m.d.sync += [e_sum[p].eq(0), set_wide[p].eq(h_wide[v_buf])]
                    m.d.sync += [n.eq(0) for n in num[p]]
        with m.If(take_q):
            m.d.sync += in_use.bit_select(alloc, 1).eq(1)
        m.d.comb += [nm.i.valid.eq(rc.o.valid), nm.i.payload.recip.eq(rc.o.payload),
                     nm.i.payload.wide.eq(wide_hold), rc.o.ready.eq(nm.i.ready)]
        for j in range(d):
            m.d.comb += nm.i.payload.num[j].eq(num_hold[j])
        m.d.comb += [self.o.valid.eq(nm.o.valid), self.o.payload.eq(nm.o.payload),
                     nm.o.ready.eq(self.o.ready)]
        return m
