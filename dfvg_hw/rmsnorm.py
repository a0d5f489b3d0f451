"""RMSNorm with its reciprocal square root, bit-exact with numerics.rmsnorm / rsqrt_fixed."""

from __future__ import annotations

from amaranth import Cat, Const, Module, Mux, Signal, signed, unsigned
from amaranth.lib import data, enum, stream, wiring
from amaranth.lib.memory import Memory
from amaranth.lib.wiring import In, Out
from amaranth.utils import ceil_log2

from dfvg_hw.spec import numerics as nx
from dfvg_hw.spec import timing
from dfvg_hw.spec.config import EngineConfig
from dfvg_hw.elementwise import WIDE_BITS, VectorRequantizer, narrow_unless_wide, reduce_tree

__all__ = ["Rsqrt", "RsqrtResult", "RMSNorm", "RMSNormInput", "RMSNormOutput", "sumsq_bits"]

_LUT_LO = 1 << nx.RSQRT_INDEX_BITS                # u ∈ [2^8, 2^10)
_LUT_DEPTH = len(nx.RSQRT_LUT)                    # 768
_R_BITS = int(nx.RSQRT_LUT.max()).bit_length()    # 16: entries in [16392, 32768]


def sumsq_bits(max_len: int) -> int:
    """Width of ``Σ x² + eps`` for rows of up to ``max_len`` int16 values (the row after
    its :func:`~dfvg_hw.spec.numerics.norm_input_shift`) and a u32 eps."""
    return (max_len * (1 << 30) + (1 << 32) - 1).bit_length()


class _Phase(enum.Enum, shape=3):
    MAX = 0     # pass 0: OR of the one's-complement magnitudes
    LOD = 1     # leading-one detector: the row's shift p
    SUM = 2     # pass 1: accumulate Σ(x >> p)²
    DRAIN = 3   # adder tree empties, then sumsq goes to the rsqrt
    SCALE = 4   # pass 2: scale and requantise


class RsqrtResult(data.StructLayout):
    """``1/√s ≈ r · 2^−(15 + k)``."""

    def __init__(self, k_bits: int = 5):
        super().__init__({"r": unsigned(_R_BITS), "k": unsigned(k_bits)})


class Rsqrt(wiring.Component):
    """Reciprocal square root, bit-exact with :func:`dfvg_hw.spec.numerics.rsqrt_fixed`.

    Four stages at initiation interval 1:

    1. leading-one detector: ``e = floor(log2 s)``, ``k = e >> 1``;
    2. barrel shift by the even amount ``2k``: ``u = (s · 2^8) >> 2k`` (this is
       ``s >> (2k − 8)`` or ``s << (8 − 2k)``, one shifter for both), ROM index
       ``u − 2^8`` ∈ [0, 768);
    3. the 768 × 16-bit ``RSQRT_LUT`` ROM (synchronous read, one BRAM18);
    4. output register.

    ``s = 0`` is taken as 1, as ``rsqrt_fixed`` does: ``r = 2^15, k = 0`` (stage 1 sets
    the argument's bit 0, so the ROM index stays in range; RMSNorm multiplies this ``r``
    by a zero row, so its output is 0).

    Parameters
    ----------
    in_bits : int
        Width of the unsigned argument (at most 62).

    Members
    -------
    i : In(stream.Signature(unsigned(in_bits)))
        The argument ``s``.
    o : Out(stream.Signature(RsqrtResult))
        ``(r, k)``.
    """

    LATENCY = timing.RSQRT_LATENCY

    def __init__(self, in_bits: int):
        if not 1 <= in_bits <= 62:
            raise ValueError(f"rsqrt_fixed is defined for s < 2^62, got a {in_bits}-bit argument")
        self.in_bits = in_bits
        self.k_bits = max(1, ceil_log2((in_bits - 1) // 2 + 1))
        super().__init__({
            "i": In(stream.Signature(unsigned(in_bits))),
            "o": Out(stream.Signature(RsqrtResult(self.k_bits))),
        })

    def elaborate(self, platform):
        m = Module()
        adv = Signal()
        v1, v2, v3 = Signal(), Signal(), Signal()
        m.d.comb += [adv.eq(~self.o.valid | self.o.ready), self.i.ready.eq(adv)]

        # stage 1: leading-one detector (the last true If wins: the highest set bit)
        s = self.i.payload
        e = Signal(range(self.in_bits))
        for b in range(self.in_bits):
            with m.If(s[b]):
                m.d.comb += e.eq(b)
        s1, k1 = Signal(self.in_bits), Signal(self.k_bits)
        # stage 2: even barrel shift to the 10-bit mantissa u, ROM index u - 2^8
        u = Signal(nx.RSQRT_INDEX_BITS + 2)
        m.d.comb += u.eq((Cat(Const(0, nx.RSQRT_INDEX_BITS), s1) >> Cat(Const(0, 1), k1))
                         [:nx.RSQRT_INDEX_BITS + 2])
        idx2, k2 = Signal(range(_LUT_DEPTH)), Signal(self.k_bits)
        # stage 3: ROM
        rom = m.submodules.rom = Memory(shape=unsigned(_R_BITS), depth=_LUT_DEPTH,
                                        init=[int(v) for v in nx.RSQRT_LUT])
        rp = rom.read_port()
        k3 = Signal(self.k_bits)
        m.d.comb += [rp.en.eq(adv), rp.addr.eq(idx2)]
        with m.If(adv):
            m.d.sync += [
                v1.eq(self.i.valid), s1.eq(s | (s == 0)), k1.eq(e >> 1),
                v2.eq(v1), idx2.eq(u - _LUT_LO), k2.eq(k1),
                v3.eq(v2), k3.eq(k2),
                self.o.valid.eq(v3), self.o.payload.r.eq(rp.data), self.o.payload.k.eq(k3),
            ]
        return m


class RMSNormInput(data.StructLayout):
    """One beat of a row: ``lanes`` int32 residuals, their gains (pass 2 only), end of row."""

    def __init__(self, lanes: int):
        super().__init__({
            "x": data.ArrayLayout(signed(nx.RES_BITS), lanes),
            "gamma": data.ArrayLayout(signed(16), lanes),
            "last": 1,
        })


class RMSNormOutput(data.StructLayout):
    """One beat of the normalised row (int8 sign-extended, or int16 for a wide row) and
    its end-of-row flag."""

    def __init__(self, lanes: int):
        super().__init__({"y": data.ArrayLayout(signed(WIDE_BITS), lanes), "last": 1})


def _shift_to_int16(m: Module, x, p, name: str):
    """``x >> p`` (floor) as int16: exact, since ``p`` is the row's norm_input_shift."""
    xs = Signal(signed(nx.NORM_IN_BITS), name=name)
    m.d.comb += xs.eq((x >> p)[:nx.NORM_IN_BITS])
    return xs


class RMSNorm(wiring.Component):
    """RMSNorm of int32 rows to int8 (or int16 with ``wide``), bit-exact with
    :func:`dfvg_hw.spec.numerics.rmsnorm`.

    The controller streams each row **three times** through ``i``, ``lanes`` elements per
    beat, ``last`` on the final beat of each pass (``gamma`` is looked at in pass 2 only):

    * pass 0: per lane the one's-complement magnitude ``x ^ (x >> 31)`` (no negation),
      OR-ed over the lanes and the beats into ``m``; then a leading-one detector gives the
      row's shift ``p = max(0, bitlen(m) − 15)`` (:func:`~dfvg_hw.spec.numerics.
      norm_input_shift`), so that every ``x >> p`` fits int16;
    * pass 1: per lane ``x' = x >> p`` (a registered barrel shifter), a 16-bit squarer, a
      registered adder tree, and a ``sumsq_bits``-wide accumulator preset to
      ``eps >> 2p``: ``sumsq = Σ x'² + eps'``;
    * :class:`Rsqrt` of ``sumsq`` gives ``(r, k)``;
    * pass 2: per lane ``x' = x >> p`` again, ``x' · gamma`` (|x'·γ| ≤ 2^30), then a
      :class:`VectorRequantizer` with ``mult = r`` (≤ 2^15) and
      ``shift = 15 + k + gamma_shift`` (8 less for a wide row):
      ``requant(x'·γ, r, shift)`` is exactly ``sat(round_shift(x' · r · γ, shift))``, to
      16 bits and then, unless wide, to 8 (``sat8 ∘ sat16 = sat8``).

    The shift keeps the datapath of an int16 RMSNorm (16-bit squarers and multipliers, the
    same accumulator) for a residual of any magnitude: a massive-activation channel only
    moves ``p``. Pass 0 and pass 1 take a beat every cycle (nothing comes out); between
    them the input is not ready for :data:`SHIFT_TURNAROUND` cycles, during the rsqrt for
    :attr:`TURNAROUND`; pass 2 streams at initiation interval 1 with backpressure from
    ``o``. A row shorter than a whole number of beats is padded with zeros (x = 0 ORs
    nothing into ``m``, adds nothing to Σx² and gives y = 0). An all-zero row outputs zeros
    for any ``eps`` (with ``eps = 0`` the rsqrt sees ``s = 0`` and, like ``rsqrt_fixed``,
    takes it as 1).

    ``eps`` is sampled with the first beat of pass 1, and ``gamma_shift`` (legal range
    0 … 16, ``GAMMA_SHIFT_MAX``; the controller faults larger values) and ``wide`` with
    the last beat of pass 1.

    Parameters
    ----------
    config : EngineConfig
        ``lanes`` sets the beat width; rows are bounded by the VMEM size.
    max_len : int, optional
        Longest row in elements (default: ``config.vmem_bytes // 4``, int32 rows); sets
        the accumulator width :func:`sumsq_bits`.

    Members
    -------
    i : In(stream.Signature(RMSNormInput(lanes)))
        Row beats, pass 0, pass 1, then pass 2.
    eps : In(unsigned(32))
        ε in units of Σx² (of the unshifted row).
    gamma_shift : In(unsigned(5))
        Gain shift.
    wide : In(1)
        Write int16 (``RMSNORM`` with ``WIDE``) instead of int8.
    o : Out(stream.Signature(RMSNormOutput(lanes)))
        Normalised row beats (pass 2), ``last`` on the final one.
    busy : Out(1)
        A row is between its first pass-0 beat and its last pass-2 beat.

    Timing: ``LATENCY`` (pass-2 beat in → its output) is 5: the shift, the gamma
    product, the requantiser. ``SHIFT_TURNAROUND`` (2) is the number of cycles from the
    edge that accepts the last pass-0 beat to the first edge that can accept a pass-1
    beat (the OR register, the leading-one detector). ``TURNAROUND`` is the number of
    cycles from the edge that accepts the last pass-1 beat to the first edge that can
    accept a pass-2 beat: ``3 + ceil(log2(lanes)) + Rsqrt.LATENCY`` (shift, square, adder
    tree, accumulate, rsqrt).
    """

    LATENCY = timing.RMSNORM_LATENCY
    SHIFT_TURNAROUND = timing.RMSNORM_SHIFT_TURNAROUND

    @staticmethod
    def turnaround(lanes: int) -> int:
        """``TURNAROUND`` for a given lane count: shift, square, tree, accumulate, rsqrt."""
        return timing.rmsnorm_turnaround(lanes)

    def __init__(self, config: EngineConfig, max_len: int | None = None):
        self.lanes = config.lanes
        self.max_len = config.vmem_bytes // 4 if max_len is None else max_len
        self.acc_bits = sumsq_bits(self.max_len)
        self.TURNAROUND = self.turnaround(self.lanes)
        super().__init__({
            "i": In(stream.Signature(RMSNormInput(self.lanes))),
            "eps": In(unsigned(32)),
            "gamma_shift": In(unsigned(5)),
            "wide": In(1),
            "o": Out(stream.Signature(RMSNormOutput(self.lanes))),
            "busy": Out(1),
        })

    def shift_of(self, m: Module, mag):
        """The row's shift from the OR of its magnitudes: ``max(0, bitlen(mag) − 15)``."""
        length = Signal(range(nx.RES_BITS + 1))
        for b in range(len(mag)):                 # the last true If wins: the highest set bit
            with m.If(mag[b]):
                m.d.comb += length.eq(b + 1)
        return Mux(length > nx.NORM_IN_BITS - 1, length - (nx.NORM_IN_BITS - 1), 0)

    def elaborate(self, platform):
        m = Module()
        lanes = self.lanes
        rs = m.submodules.rsqrt = Rsqrt(self.acc_bits)
        # side band: (last, wide) travel with each beat, so a row's outputs keep its
        # width while the next row's pass 1 already sampled another
        vr = m.submodules.requant = VectorRequantizer(lanes, WIDE_BITS, 32, side=2)
        p = self.i.payload
        phase = Signal(_Phase)
        first = Signal(init=1)                    # next beat starts a row (its pass 0)

        # -- pass 0: OR of one's-complement magnitudes, then the leading-one detector ------
        max_ready, take0 = Signal(), Signal()
        m.d.comb += take0.eq(self.i.valid & max_ready)
        mag_bits = nx.RES_BITS - 1                # x ^ sign(x) is non-negative: 31 bits
        beat_or = Signal(mag_bits)
        m.d.comb += beat_or.eq(_or_all([(p.x[l] ^ p.x[l][-1].replicate(nx.RES_BITS))[:mag_bits]
                                         for l in range(lanes)]))
        row_or = Signal(mag_bits)
        shift = Signal(range(nx.RES_BITS - nx.NORM_IN_BITS + 2))   # p ≤ 16
        with m.If(take0):
            m.d.sync += row_or.eq(Mux(first, 0, row_or) | beat_or)
        with m.If(phase == _Phase.LOD):
            m.d.sync += shift.eq(self.shift_of(m, row_or))

        # -- pass 1: shift, squares, adder tree, accumulator -------------------------------
        sum_ready, take1 = Signal(), Signal()
        sum_first = Signal()                      # next pass-1 beat is the row's first
        m.d.comb += take1.eq(self.i.valid & sum_ready)
        xs_v, xs_last = Signal(), Signal()
        xs1 = [Signal(signed(nx.NORM_IN_BITS), name=f"xs{l}") for l in range(lanes)]
        m.d.sync += [xs_v.eq(take1), xs_last.eq(take1 & p.last)]
        for l in range(lanes):
            m.d.sync += xs1[l].eq(_shift_to_int16(m, p.x[l], shift, f"xs1_{l}"))
        sq_v, sq_last = Signal(), Signal()
        squares = [Signal(unsigned(2 * nx.NORM_IN_BITS - 1), name=f"sq{l}") for l in range(lanes)]
        m.d.sync += [sq_v.eq(xs_v), sq_last.eq(xs_last)]
        for l in range(lanes):
            m.d.sync += squares[l].eq(xs1[l] * xs1[l])
        total, t_v, (t_last,), _ = reduce_tree(m, squares, lambda a, b: a + b, valid=sq_v,
                                               tags=[sq_last], name="sumsq")
        acc = Signal(self.acc_bits)
        acc_done = Signal()                       # the row's last partial sum is in acc
        gs, wide = Signal(5), Signal()
        with m.If(take1 & sum_first):
            m.d.sync += acc.eq(self.eps >> Cat(Const(0, 1), shift))     # eps >> 2p
        with m.If(take1):
            m.d.sync += sum_first.eq(0)
        with m.If(take1 & p.last):
            m.d.sync += [gs.eq(self.gamma_shift), wide.eq(self.wide)]
        with m.If(t_v):
            m.d.sync += [acc.eq(acc + total), acc_done.eq(t_last)]
        with m.Else():
            m.d.sync += acc_done.eq(0)

        # -- pass 2: shift, x'·gamma, then requantise by (r, 15 + k + gamma_shift) ------
        # (r, k) stay in the rsqrt's output register (not popped) for the whole pass.
        r = rs.o.payload.r
        total_shift = nx.RSQRT_BITS + rs.o.payload.k + gs - Mux(wide, WIDE_BITS - nx.ACT_BITS, 0)
        rq_shift = Mux(total_shift > 63, 63, total_shift)
        front_adv, v0, v1 = Signal(), Signal(), Signal()
        scale_ready, take2 = Signal(), Signal()
        # a stall-all front end (the shift, then the product) ahead of the requantiser
        m.d.comb += [front_adv.eq(~v1 | vr.i.ready), take2.eq(self.i.valid & scale_ready)]
        # stage 0 keeps (r, shift) with the beat: the row's last take pops the rsqrt
        xs2 = [Signal(signed(nx.NORM_IN_BITS), name=f"xs2_{l}") for l in range(lanes)]
        g2 = [Signal(signed(16), name=f"g2_{l}") for l in range(lanes)]
        last2, wide2 = Signal(), Signal()
        r2, rq_shift2 = Signal.like(r), Signal(6)
        with m.If(front_adv):
            m.d.sync += [v0.eq(take2), last2.eq(p.last), wide2.eq(wide), r2.eq(r),
                         rq_shift2.eq(rq_shift),
                         v1.eq(v0), vr.i.payload.side.eq(Cat(last2, wide2))]
            for l in range(lanes):
                q = vr.i.payload.r[l]
                m.d.sync += [xs2[l].eq(_shift_to_int16(m, p.x[l], shift, f"xs2in_{l}")),
                             g2[l].eq(p.gamma[l]),
                             q.acc.eq(xs2[l] * g2[l]), q.mult.eq(r2), q.shift.eq(rq_shift2)]
        m.d.comb += [self.o.payload.y[l].eq(narrow_unless_wide(vr.o.payload.y[l], vr.o.payload.side[1]))
                     for l in range(lanes)]
        m.d.comb += [
            vr.i.valid.eq(v1),
            self.o.valid.eq(vr.o.valid),
            self.o.payload.last.eq(vr.o.payload.side[0]),
            vr.o.ready.eq(self.o.ready),
        ]

        # -- sequencing ---------------------------------------------------------------------
        m.d.comb += [self.i.ready.eq(max_ready | sum_ready | scale_ready), self.busy.eq(~first)]
        with m.If(take0):
            m.d.sync += first.eq(0)
        # (If/Elif rather than m.FSM: five states in three bits lint clean as an if chain)
        with m.If(phase == _Phase.MAX):
            m.d.comb += max_ready.eq(1)
            with m.If(take0 & p.last):
                m.d.sync += phase.eq(_Phase.LOD)
        with m.Elif(phase == _Phase.LOD):          # row_or is complete: p into `shift`
            m.d.sync += [phase.eq(_Phase.SUM), sum_first.eq(1)]
        with m.Elif(phase == _Phase.SUM):
            m.d.comb += sum_ready.eq(1)
            with m.If(take1 & p.last):
                m.d.sync += phase.eq(_Phase.DRAIN)
        with m.Elif(phase == _Phase.DRAIN):        # the tree empties into acc, then rsqrt
            m.d.comb += [rs.i.valid.eq(acc_done), rs.i.payload.eq(acc)]
            with m.If(acc_done & rs.i.ready):
                m.d.sync += phase.eq(_Phase.SCALE)
        with m.Else():                             # SCALE
            m.d.comb += [scale_ready.eq(front_adv & rs.o.valid),
                         rs.o.ready.eq(take2 & p.last)]
            with m.If(take2 & p.last):
                m.d.sync += [phase.eq(_Phase.MAX), first.eq(1)]
        return m


def _or_all(values):
    """The bitwise OR of equal-width values (a flat tree: the synthesiser balances it)."""
    out = values[0]
    for v in values[1:]:
        out = out | v
    return out
