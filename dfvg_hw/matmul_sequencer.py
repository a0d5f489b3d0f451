"""MATMUL sequencing: operands from VMEM and device memory through the matrix unit, results
back to VMEM or into the logit buffer (isa.md §3.4, ``FunctionalEngine._matmul``).

One MATMUL is checked, then runs in row passes. A pass holds ``rows`` rows (``rows // 2``
wide rows, each as a hi/lo digit pair, :func:`~dfvg_hw.spec.numerics.wide_digits`):

1. **x load.** The pass's source rows are read from VMEM once and cut into K-slices in
   the x buffer (entry ``kt`` holds slice ``kt`` of every row slot, as the matrix unit's
   ``x`` port takes them), so the weights can stream without re-reading VMEM.
2. **Stream.** For each output group (``lanes`` channels): its weight tiles
   (``lanes·kpad`` bytes, tile-major in the image) and then its requant record (after all
   tiles in the image: its ``lanes`` requant words, with ``BIAS`` then its ``lanes`` int32
   biases, :func:`~dfvg_hw.spec.image.requant_record_bytes`) are read from device memory;
   each tile meets x-buffer entry ``kt`` in the matrix unit, which adds the biases (0
   without ``BIAS``) before it requantises.
   With ``BLOCKS`` a group's read also holds a scale tile before every run of
   ``reduce/2`` weight tiles (:func:`~dfvg_hw.spec.image.tile_weights`): it passes the tile
   packer like a weight tile and is taken into the ``scales`` register as soon as it is
   complete (whatever the matrix unit does); each weight tile of the run then carries its
   ``lanes`` multipliers (word ``kt mod reduce/2`` of the register) into the matrix unit,
   and the group's parameters say ``blocks`` so the write-back rounds the scaled sums.
   Without it every tile carries multipliers of 1.
3. **Write-back.** Each output row of a group goes to VMEM (INT8: int8, or int16 with
   ``OUT16``; RESADD: int32, the residual read from the same place first; INT32: int32)
   or, in LOGITS mode, to the logit buffer.

The weights do not depend on x, so a pass's reads (2.'s tiles and records) are issued from
the pass's first state (PASS), before and during the x load, and the x load does not wait
for the stream either: the matrix unit takes the first group's tile ``kt`` as soon as
x-buffer entry ``kt`` holds every row of the pass
(:data:`~dfvg_hw.spec.timing.MATMUL_X_TO_TILE` cycles after the last row's slice ``kt``),
while the later slices still load. Beats that come before their x wait in the tile packer
and the memory port's ``read_data`` register (the memory holding the rest back); a scale
tile is taken into ``scales`` as it completes, whenever that is. Requant words, residual
reads (VMEM's read port serves the x load first) and results wait for STREAM, after the
x load. A pass after the first reads its weights again from its own PASS.

**Prefetch.** The controller may offer the MATMUL on ``prefetch`` while the unit
instruction before it still runs (controller.py): taken in IDLE, the job's fields are
latched and checked against device memory (PREFETCH_CHECK: rows, BLOCKS, the block's
end; a block RANGE would refuse is not prefetched, so a prefetch faults nothing), then
PREFETCH issues the first pass's reads exactly as PASS would, its tiles waiting in the
packer (``x_in`` is 0) and the rest in the port. The job itself, the same
instruction, is then taken in PREFETCH; RANGE, PASS and the rest run as ever with the
reads going on. A reset (the controller's cancel) forgets a prefetch; the controller's
drain empties what it left in flight.

**Checks**, all before the first pass and in the functional model's order, so a refused
MATMUL changes nothing: ``rows > config.rows`` (``PROGRAM``), ``BLOCKS`` on an engine
built without block multipliers (``PROGRAM``: ``EngineConfig.weight_blocks``; no scale
tile then ever reaches the matrix unit), the weight block off the bus beat or past
device memory (``BAD_ADDRESS``; its records' biases too with ``BIAS``), the source span
outside VMEM (``BAD_ADDRESS``), LOGITS
with ``n > vocab_max`` (``PROGRAM``), the destination span outside VMEM
(``BAD_ADDRESS``). A MATMUL with ``n = 0`` writes nothing (LOGITS: an empty vector); with
``k = 0`` every accumulator is 0 (no tile is read: each group meets zero x rows with
whatever tile the packer holds, ``rows·reduce`` digits cleared instead of a
``lanes·reduce``-byte tile).
Whether a LOGITS may have several rows (a tree forward's ``W``, else 1; isa.md §9) is the
controller's check, made before it hands the job over.

**Tree forwards** (isa.md §9.2). With ``pitch ≠ 0`` and ``rows ≥ 2``, row ``r`` of the
source, of the INT8 or INT32 result and of the RESADD residual lies at ``line + r·pitch`` instead
of the operand's own line-rounded stride, and the VMEM checks take the operand to end
with its last row there. The write-back and the residual reads only change their row
stride. VMEM's span reader walks one run of lines, so source rows whose pitch is not
their own stride are loaded as one span per row (X_CMD and VMEM's read latency again per
row after a pass's first, :data:`~dfvg_hw.spec.timing.MATMUL_ROW_SPAN`); a pitch equal to
it costs nothing. Rows must not overlap (``pitch`` at least the lines of a row of each
operand: the write-back writes group by group, not row by row). A LOGITS of ``R`` rows
fills ``R`` logit-buffer rows: ``logits_begin`` pulses once, before the first pass, with
``logits_n`` and ``logits_rows = R``; every output tile carries its buffer row
(``LogitTile.row``). Tiles of a pass come group by group, its rows in turn within a
group, and passes follow each other, so each row's tiles arrive in group order.

**Geometry** (:meth:`MatmulSequencer.supports`): any lanes ``N`` and reduce ``K`` with
``N·K`` at least one bus beat (a tile is whole beats) and ``2K ≤ 256`` (the x cutter).

* *Weights on a beat.* A block starts on a bus beat (``BAD_ADDRESS`` otherwise, as the
  memory port takes bus-aligned addresses only), and a group's tiles are whole beats, so
  every read starts on a beat and its beats go to the packer or the record register as
  they come. (Until 2026-12-05 a block could start anywhere and a beat aligner re-cut
  the reads: 66k LUTs at alveo-u55c even at record granularity, 202k at byte granularity.)
* *Requant records* ``R = 4N`` bytes per group (``8N`` with ``BIAS``: the words, then
  the biases): whole beats, or, when ``R`` is less than a beat (and divides it), the
  records of ``G = B/R`` groups share a beat (:func:`~dfvg_hw.spec.timing.matmul_records_per_beat`;
  ``G`` halves with ``BIAS``): group ``g``'s record is read only for ``g`` a multiple of
  ``G``, as one aligned beat of ``min(G, groups − g)·R`` bytes after its tiles, and kept
  in a register (``max(8N, B)`` bytes) that serves the next ``G − 1`` groups (a group's
  record is shown to the matrix unit as soon as the previous group's is used). At the
  Alveo U55C preset (``4N`` = 256 B, 2 KiB beats) that is one requant beat per 8 groups
  (4 with ``BIAS``) instead of one per group. With ``k = 0`` the reads are the records
  alone, one per batch.
* *Write-back*: a group's result row is ``N`` bytes (INT8), ``2N`` (INT8 with ``OUT16``:
  the matrix unit saturates it to int16, as in LOGITS) or ``4N`` (RESADD: the int32
  residual; INT32). Up to a line it is one masked write inside a line; beyond, it starts a line
  and takes ``W = N·eb/16`` line writes, one per cycle, the lanes past ``n`` masked off.
  A RESADD residual row likewise takes ``R = max(1, 4N/16)`` line reads (one per cycle,
  one more cycle to start each row). LOGITS rows go to the logit buffer as one ``N``-lane tile.

**Timing.** At ``tiny`` (every result row inside one line, requant words one beat,
blocks bus-aligned) the sequencer takes the cycles of the one-line sequencer before it
less what the early weight reads overlap (tests/rtl/test_matmul_sequencer.py pins them): a
pass's first tile enters the matrix unit when both its beats (the memory latency after
PASS) and its x entry are in, not after the whole x load and then the latency; an x load
longer than the latency (the down projection's ``k = 3072`` at alveo-u55c: 96 slices
against 60 cycles) costs only where the weights catch up with it. Wider rows cost more at the
output: a group row holds the write-back for ``W = max(1, N/16)`` cycles in INT8,
``R + 1`` in RESADD (``R = max(1, 4N/16)`` residual lines read, the same ``R`` lines
written; a group's first residual is read in advance), ``R`` in INT32 (no residual), 1 in
LOGITS. ``BIAS`` costs only its record bytes (the matrix unit adds the bias in the cycle
a row enters the requantisers). Against one line per
row, each pass's last group adds ``rows_pass · (W − 1)`` cycles (INT8) or
``rows_pass · (R − 1)`` (RESADD) to the pass's tail, ``rows_pass`` being the pass's output
rows (a wide row counts once). Earlier groups' write-backs overlap the next group's
weight stream and cost nothing while ``rows_pass · W`` (RESADD: ``rows_pass · (R + 1)``) is
at most that group's ``N·Kp/B + max(1, 4N/B)`` beats: at the Alveo presets 32 (136)
cycles for 8 rows against at least 72 beats, so a RESADD of 8 rows at 64 lanes now
waits on its write-back (single-row RESADDs, the compiler's, take 17 against 72).

The x buffer holds ``ceil(min(65535, vmem_bytes) / K)`` K-slices: the longest ``k`` a
MATMUL can use (the ``k`` field is 16-bit, and an int8 source row of ``k`` bytes must fit
in VMEM): 2048 × 2304 bits (4.7 Mbit, 32 URAM288 or 128 BRAM36 at 2304 bits wide) at
the Alveo presets, where ``vmem_bytes / K`` entries would be 8192 (18.9 Mbit). A
destination that overlaps source rows of a later pass is not supported (the functional
model reads all rows first); the compiler's matmuls are single-row with ``dst`` apart
from ``src``.
"""

from __future__ import annotations

from amaranth import Cat, Const, Module, Mux, Signal, unsigned
from amaranth.lib import data, stream, wiring
from amaranth.lib.wiring import In, Out
from amaranth.lib.memory import Memory
from amaranth.utils import exact_log2

from dfvg_hw.spec import numerics as nx
from dfvg_hw.spec.config import EngineConfig
from dfvg_hw.spec.descriptors import ErrorCode
from dfvg_hw.spec.image import requant_record_bytes, scale_run_tiles
from dfvg_hw.spec.timing import matmul_records_per_beat
from dfvg_hw.spec.isa import MatmulMode
from dfvg_hw.matrix import DIGIT_BITS, MatrixUnit
from dfvg_hw.layouts import flags_view
from dfvg_hw.op_port import OpJob, OpSequencerSignature
from dfvg_hw.operand_access import vmem_span_outside
from dfvg_hw.sample_sequencer import LogitTile
from dfvg_hw.vmem import Gearbox

__all__ = ["MatmulSequencer", "TilePacker"]

#: the longest k the 16-bit instruction field allows
K_MAX = (1 << 16) - 1


class TilePacker(wiring.Component):
    """Packs ``tile_bytes / beat_bytes`` beats into one tile (the first beat in the lowest
    bytes), with an output register; beats enter while the tile register is empty or
    being taken. The timing of :class:`~dfvg_hw.vmem.Gearbox` packing (one beat per
    cycle, the tile valid the cycle after its last beat) without its 256-byte limit, and a
    shift register instead of a slot demultiplexer.

    Parameters
    ----------
    beat_bytes, tile_bytes : int
        Beat and tile widths; the tile is whole beats.

    Members
    -------
    i : In(stream.Signature(unsigned(8 · beat_bytes)))
        Beats, one per cycle at most.
    o : Out(stream.Signature(unsigned(8 · tile_bytes)))
        Tiles (held until taken).
    """

    def __init__(self, beat_bytes: int, tile_bytes: int):
        assert tile_bytes % beat_bytes == 0
        self.beat_bits, self.ratio = 8 * beat_bytes, tile_bytes // beat_bytes
        super().__init__(wiring.Signature({
            "i": In(stream.Signature(unsigned(8 * beat_bytes))),
            "o": Out(stream.Signature(unsigned(8 * tile_bytes))),
        }))

    def elaborate(self, platform):
        m = Module()
        B, ratio = self.beat_bits, self.ratio
        tile = Signal(B * ratio)
        count = Signal(range(max(2, ratio)))
        m.d.comb += [self.o.p.eq(tile), self.i.ready.eq(~self.o.valid | self.o.ready)]
        with m.If(self.o.valid & self.o.ready):
            m.d.sync += self.o.valid.eq(0)
        with m.If(self.i.valid & self.i.ready):
            # each beat enters at the top; after `ratio` beats the first is at the bottom
            m.d.sync += tile.eq(Cat(tile[B:], self.i.p) if ratio > 1 else self.i.p)
            m.d.sync += count.eq(Mux(count == ratio - 1, 0, count + 1))
            with m.If(count == ratio - 1):
                m.d.sync += self.o.valid.eq(1)
        return m


class MatmulSequencer(wiring.Component):
    """Runs one MATMUL per ``job`` (see the module docstring for the order of work, the
    checks and the timing) and answers with ``done`` and an error code.

    Parameters
    ----------
    config : EngineConfig
        ``rows``, ``lanes``, ``reduce`` (the matrix unit), ``vmem_bytes``, ``mem_bytes``,
        ``vocab_max``.
    data_width : int
        Memory bus width in bits (a multiple of 128; see :meth:`supports`).

    Members
    -------
    job : In(stream.Signature(OpJob()))
        The MATMUL: ``addr`` (weight block), ``flags`` (its ``mode``, ``wide`` and ``bias``
        sub-fields: ``WIDE``, ``BIAS``), ``rows``, ``dst``, ``src``, ``n``, ``k`` and ``pitch`` (rows ``pitch``
        lines apart when not 0 and ``rows ≥ 2``; 0: each operand's own stride).
    done : Out(1)
        One-cycle pulse: the job is finished, ``error`` holds its outcome.
    error : Out(8)
        :class:`~dfvg_hw.spec.descriptors.ErrorCode` (OK, PROGRAM or BAD_ADDRESS).
    read_cmd, read_data : the memory port's read side (weight tiles, requant records)
    vmem_rd_cmd, vmem_rd : VMEM's span reader (the x rows, one span per pass)
    vmem_wr_cmd, vmem_wr, vmem_wr_done : unused (results go through the poke port)
    vmem_error : In(1)
        VMEM refused a span (cannot happen: spans are checked first; kept as a guard).
    peek_addr, peek_data : VMEM line reads (RESADD residuals; data one cycle after the address)
    poke_en, poke_addr, poke_data : VMEM line writes with a byte mask (results)
    prefetch : In(stream.Signature(OpJob()))
        The next instruction, when it is a MATMUL, offered while another unit runs (the
        controller lends this sequencer the wide read path from the cycle after it is
        taken): taken in IDLE, its first pass's weight and requant reads are issued from
        then on if they pass RANGE's memory checks (PREFETCH), and ``job`` must then be
        the same instruction. A reset (the controller's cancel) forgets it.
    logits_begin : Out(1)
        One-cycle pulse: a LOGITS buffer of ``logits_rows`` rows of ``logits_n`` entries
        starts (once per LOGITS job, whatever its passes).
    logits_n : Out(16)
    logits_rows : Out(8)
        Valid with ``logits_begin``: the job's rows (1 in a chain forward).
    logits : Out(stream.Signature(LogitTile(lanes)))
        The logit buffer's write side (:class:`~dfvg_hw.sample_sequencer.SampleSequencer`):
        ``lanes`` logits of row ``row``, each row's tiles in order (see the module docstring).
    row_exp : In(ArrayLayout(unsigned(ROW_EXP_BITS), rows))
        The controller's row exponent registers; a ``ROWEXP`` job requantises row ``r``
        with ``max(shift − row_exp[r], 0)`` (read as its groups are written back, after
        the ACTMUL before it has set them).
    """

    @staticmethod
    def supports(config: EngineConfig, data_width: int) -> bool:
        """Whether this sequencer handles the geometry: a weight tile (``lanes·reduce``
        bytes) is whole bus beats, and the x cutter's wide slice (``2·reduce`` bytes) is
        at most 256 bytes (:class:`~dfvg_hw.vmem.Gearbox`). Every preset qualifies at 128
        and 256 bits."""
        beat = data_width // 8
        return (data_width % 128 == 0 and config.lanes * config.reduce >= beat
                and 2 * config.reduce <= 256)

    def __init__(self, config: EngineConfig, data_width: int):
        if not self.supports(config, data_width):
            raise ValueError(f"MatmulSequencer does not handle lanes={config.lanes}, "
                             f"reduce={config.reduce} with a {data_width}-bit bus")
        self.config = config
        self.data_width = data_width
        c = config
        #: K-slices of the longest source row a MATMUL can name (see the module docstring)
        self.x_depth = -(-min(K_MAX, c.vmem_bytes) // c.reduce)
        members = dict(OpSequencerSignature(config, data_width).members.items())
        members.update({
            "prefetch": In(stream.Signature(OpJob())),
            "logits_begin": Out(1),
            "logits_n": Out(16),
            "logits_rows": Out(8),
            "logits": Out(stream.Signature(LogitTile(c.lanes))),
            "row_exp": In(data.ArrayLayout(unsigned(nx.ROW_EXP_BITS), c.rows)),
        })
        super().__init__(wiring.Signature(members))

    def elaborate(self, platform):
        m = Module()
        c, DW = self.config, self.data_width
        M, N, K, L = c.rows, c.lanes, c.reduce, c.vmem_line_bytes
        beat_bytes = DW // 8
        slot_bits = K * DIGIT_BITS
        mx = m.submodules.matrix = MatrixUnit(c)
        xbuf = m.submodules.x_buffer = Memory(shape=unsigned(M * slot_bits), depth=self.x_depth,
                                             init=[])
        xw, xr = xbuf.write_port(granularity=slot_bits), xbuf.read_port()
        cut8 = m.submodules.cut_int8 = Gearbox(L, K)          # VMEM lines → K int8
        cut16 = m.submodules.cut_int16 = Gearbox(L, 2 * K)    # VMEM lines → K int16
        tiles = m.submodules.tiles = TilePacker(beat_bytes, N * K)

        job = Signal(OpJob())
        mode = flags_view(job.flags).mode
        wide = flags_view(job.flags).wide
        bias = flags_view(job.flags).bias
        rowexp = flags_view(job.flags).row_exponent
        # without block multipliers a BLOCKS job is refused in RANGE, so none streams
        blocks = flags_view(job.flags).blocks if c.weight_blocks else Const(0)
        # g_tiles: the tiles of a group's read, its scale tiles (BLOCKS) included
        n_groups, k_tiles, g_tiles = Signal(16), Signal(16), Signal(17)
        T = scale_run_tiles(K)          # weight tiles per scale tile
        stride_in, stride_out, in_bytes, out_bytes = Signal(32), Signal(32), Signal(32), Signal(32)
        # rows `pitch` lines apart (a tree forward's operands, isa.md §9.2) ...
        pitched = Signal()
        # ... and the source rows then not one run of lines: one VMEM span per row
        x_row_spans = Signal()
        per_pass = Mux(wide, M // 2, M)
        first, pass_rows = Signal(8), Signal(8)
        weight_bytes = Signal(48)
        out16 = flags_view(job.flags).out16
        out_eb = output_bytes(mode, out16)
        k_zero = k_tiles == 0            # no tiles: each group gets one zero tile
        # a block starts on a beat (BAD_ADDRESS otherwise): every read below is then aligned
        misaligned = job.addr[:exact_log2(beat_bytes)].any()

        def padded(x, mult):
            return (x + mult - 1) // mult * mult

        def record_offset(g):           # group g's requant record, from the end of the tiles
            return Mux(bias, requant_record_bytes(N, True) * g, requant_record_bytes(N, False) * g)

        m.d.comb += [self.job.ready.eq(0), mx.res.valid.eq(0)]
        peek_live = Signal()            # peek_data answers a STREAM peek (set in STREAM)
        m.d.sync += peek_live.eq(0)
        # -- the pass's weights and requant records, read from the pass's start, and its tiles
        # into the matrix unit as their x entries come in (the weights do not depend on x:
        # the reads run while x loads, the packer and the memory port holding
        # the beats that come before their x) ----------------------------------------------
        fetching = Signal()             # PASS … STREAM (PREFETCH … STREAM when prefetched)
        prefetched = Signal()           # this job's first pass read from PREFETCH on
        cmd_group, cmd_q = Signal(16), Signal()
        data_q, data_beats, data_group = Signal(), Signal(32), Signal(16)

        # The records of G = B/R groups share a beat (R < B): one read of the beat serves
        # them all, made with the first group's tiles (k = 0: the reads are the records
        # alone, one a batch). G differs with BIAS; G = 1 is a batch of one.
        G = {b: matmul_records_per_beat(beat_bytes, N, b) for b in (False, True)}
        g_batch = Mux(bias, G[True], G[False])

        def needs_q(g):                 # group g's read brings its batch's records
            return (g & (g_batch - 1)) == 0

        def q_groups(g):                # groups whose records a read for group g brings
            left = n_groups - g
            return Mux(left < g_batch, left, g_batch)
        # mx.q shows the words of group q_group while q_group < q_end (q_end: one past
        # the last group whose words are in qbuf); a read's beats enter at q_group == q_end
        q_group, q_end = Signal(16), Signal(16)
        kt = Signal(16)                 # the K-tile the matrix unit takes next
        x_at, zero_tiles = Signal(16), Signal(16)
        # x-buffer entries the last row of the pass has written (x_in), a cycle later (x_in_d:
        # the read port reads before it writes, so an entry is read the cycle after its write)
        x_in, x_in_d = Signal(16), Signal(16)
        m.d.sync += x_in_d.eq(x_in)
        streaming = Signal()            # STREAM: records, residuals and results move
        # BLOCKS: the packer's next tile is a run's scale tile until it is taken into
        # `scales` (at once, whatever the matrix unit does); the run's weight tiles
        # then each take their lanes' multipliers from it
        scales, scales_in = Signal(8 * N * K), Signal()
        scale_tile = blocks & ~scales_in
        # Wide data paths are driven in every state and only their valids say when they
        # count: a comb assignment under a condition ANDs each of its bits with it (two
        # 16,384-bit paths at alveo-u55c, 33k LUTs in Yosys). These go in after the FSM.
        ungated = []
        beat = self.read_data
        qbuf = Signal(max(64 * N, DW))
        ungated += [tiles.i.p.eq(beat.p.data), mx.w.payload.data.as_value().eq(tiles.o.p),
                    # k = 0: zero rows against whatever tile (M·K digits to clear, not N·K weights)
                    mx.x.payload.as_value().eq(Mux(k_zero, 0, xr.data))]
        with m.If(fetching):
            tile_beats = N * g_tiles * K // beat_bytes
            q_beats = {b: max(1, requant_record_bytes(N, b) // beat_bytes) for b in (False, True)}
            # commands: tiles of group g (none when k = 0), then its batch's requant records
            is_q = cmd_q | k_zero
            q_addr = job.addr + weight_bytes + record_offset(cmd_group)
            tile_addr = job.addr + cmd_group * N * g_tiles * K
            with m.If(cmd_group < n_groups):
                m.d.comb += [
                    self.read_cmd.valid.eq(1),
                    self.read_cmd.payload.addr.eq(Mux(is_q, q_addr, tile_addr)),
                    self.read_cmd.payload.length.eq(
                        Mux(is_q, record_offset(q_groups(cmd_group)), N * g_tiles * K)),
                ]
                with m.If(self.read_cmd.ready):
                    with m.If(is_q):
                        m.d.sync += [cmd_q.eq(0),
                                     cmd_group.eq(cmd_group + Mux(k_zero, q_groups(cmd_group), 1))]
                    with m.Elif(needs_q(cmd_group)):
                        m.d.sync += cmd_q.eq(1)
                    with m.Else():          # its words come with an earlier group's
                        m.d.sync += cmd_group.eq(cmd_group + 1)
            # data: beats to the tile packer or the record register
            in_q = data_q | k_zero
            job_q_beats = Mux(bias, q_beats[True], q_beats[False])
            q_full = q_group != q_end
            with m.If(~in_q):
                m.d.comb += [tiles.i.valid.eq(beat.valid), beat.ready.eq(tiles.i.ready)]
                with m.If(beat.valid & tiles.i.ready):
                    m.d.sync += data_beats.eq(data_beats + 1)
                    with m.If(data_beats + 1 == tile_beats):
                        m.d.sync += data_beats.eq(0)
                        with m.If(needs_q(data_group)):
                            m.d.sync += data_q.eq(1)
                        with m.Else():
                            m.d.sync += data_group.eq(data_group + 1)
            with m.Else():
                m.d.comb += beat.ready.eq(~q_full)
                with m.If(beat.valid & ~q_full):
                    if q_beats[True] > 1:
                        m.d.sync += qbuf.word_select(data_beats[:exact_log2(q_beats[True])],
                                                     DW).eq(beat.p.data)
                    else:
                        m.d.sync += qbuf.eq(beat.p.data)
                    m.d.sync += data_beats.eq(data_beats + 1)
                    with m.If(data_beats + 1 == job_q_beats):
                        m.d.sync += [data_beats.eq(0), data_q.eq(0),
                                     q_end.eq(data_group + q_groups(data_group)),
                                     data_group.eq(data_group + Mux(k_zero, q_groups(data_group), 1))]
            with m.If(tiles.o.valid & scale_tile):
                m.d.sync += [scales.eq(tiles.o.p), scales_in.eq(1)]
            # tiles meet x-buffer entries: the read port shows entry `x_at`, and entry `kt`
            # is complete (every row of the pass written) once `kt < x_in_d`: the matrix
            # unit takes the pass's first tiles while x is still loading
            x_ready = kt < x_in_d
            take = mx.w.valid & mx.w.ready
            next_kt = Mux(kt + 1 == k_tiles, 0, kt + 1)
            run_end = (kt[:exact_log2(T)] == T - 1) | (kt + 1 == k_tiles)
            m.d.comb += [xr.addr.eq(Mux(take, next_kt, kt)),
                         mx.w.valid.eq(Mux(k_zero, streaming & (zero_tiles < n_groups),
                                           tiles.o.valid & ~scale_tile & (x_at == kt) & x_ready)),
                         mx.w.payload.last.eq(k_zero | (kt + 1 == k_tiles)),
                         tiles.o.ready.eq(scale_tile | (mx.w.ready & (x_at == kt) & x_ready)),
                         mx.x.valid.eq(mx.w.valid)]
            if c.weight_blocks:
                ungated.append(mx.w.payload.scale.as_value().eq(
                    Mux(blocks, scales.word_select(kt[:exact_log2(T)], 16 * N),
                        Cat(*(Const(1, 16) for _ in range(N))))))
            m.d.sync += x_at.eq(xr.addr)
            with m.If(take):
                m.d.sync += kt.eq(next_kt)
                with m.If(k_zero):
                    m.d.sync += zero_tiles.eq(zero_tiles + 1)
                with m.Elif(run_end):
                    m.d.sync += scales_in.eq(0)

        with m.FSM(name="matmul"):
            def accept(p):
                """Take job ``p`` (the job itself, or the prefetch of the same instruction)."""
                p_wide, p_mode = flags_view(p.flags).wide, flags_view(p.flags).mode
                npad, kpad = padded(p.n, N), padded(p.k, K)
                p_k_tiles = kpad // K
                p_g_tiles = p_k_tiles + Mux(flags_view(p.flags).blocks,
                                            (p_k_tiles + T - 1) >> exact_log2(T), 0)
                p_in = p.k * Mux(p_wide, 2, 1)
                p_out = p.n * output_bytes(p_mode, flags_view(p.flags).out16)
                p_pitched = (p.pitch != 0) & (p.rows > 1)
                pitch_bytes = p.pitch * L
                return [job.eq(p), n_groups.eq(npad // N), k_tiles.eq(p_k_tiles),
                        g_tiles.eq(p_g_tiles), weight_bytes.eq(npad * p_g_tiles * K),
                        first.eq(0),
                        in_bytes.eq(p_in), out_bytes.eq(p_out), pitched.eq(p_pitched),
                        stride_in.eq(Mux(p_pitched, pitch_bytes, padded(p_in, L))),
                        stride_out.eq(Mux(p_pitched, pitch_bytes, padded(p_out, L))),
                        x_row_spans.eq(p_pitched & (pitch_bytes != padded(p_in, L)))]

            with m.State("IDLE"):
                m.d.comb += [self.job.ready.eq(1), self.prefetch.ready.eq(~self.job.valid)]
                m.d.sync += prefetched.eq(0)
                with m.If(self.job.valid):
                    m.d.sync += accept(self.job.payload)
                    m.next = "RANGE"
                with m.Elif(self.prefetch.valid):
                    m.d.sync += accept(self.prefetch.payload)
                    m.next = "PREFETCH_CHECK"
            # -- prefetch: the next instruction's first pass reads its weights while the unit
            # before it still runs (the controller lends the wide read path once that unit's
            # reads are done and the port is idle). Only reads that RANGE would allow go out
            # (rows, BLOCKS, the block inside device memory): a prefetch faults nothing; a
            # refused one just leaves the job to start as usual.
            with m.State("PREFETCH_CHECK"):
                end = job.addr + weight_bytes + record_offset(n_groups)
                with m.If((job.rows > M) | (flags_view(job.flags).blocks & (not c.weight_blocks))
                          | (end > c.mem_bytes) | misaligned):
                    m.next = "IDLE"
                with m.Else():
                    m.d.sync += prefetched.eq(1)
                    m.next = "PREFETCH"
            with m.State("PREFETCH"):
                # the tiles wait in the packer (x_in = 0), the rest in the port
                m.d.comb += [fetching.eq(1), self.job.ready.eq(1)]
                with m.If(self.job.valid):
                    m.d.sync += accept(self.job.payload)        # the same fields
                    m.next = "RANGE"
            with m.State("RANGE"):
                m.d.comb += fetching.eq(prefetched)     # a prefetch's reads go on
                # every check, in the functional model's order, before anything moves
                logits = mode == MatmulMode.LOGITS
                end = job.addr + weight_bytes + record_offset(n_groups)

                def outside(line, row_bytes):
                    # pitched rows: the operand ends with its last row, at line + (rows − 1)·pitch
                    last_row = line + (job.rows - 1) * job.pitch
                    return Mux(pitched, vmem_span_outside(c, last_row, 1, row_bytes),
                               vmem_span_outside(c, line, job.rows, row_bytes))
                with m.If(job.rows > M):
                    m.d.sync += self.error.eq(ErrorCode.PROGRAM)
                    m.next = "DONE"
                with m.Elif(flags_view(job.flags).blocks & (not c.weight_blocks)):
                    m.d.sync += self.error.eq(ErrorCode.PROGRAM)
                    m.next = "DONE"
                with m.Elif(misaligned | (end > c.mem_bytes)):
                    m.d.sync += self.error.eq(ErrorCode.BAD_ADDRESS)
                    m.next = "DONE"
                with m.Elif(outside(job.src, in_bytes)):
                    m.d.sync += self.error.eq(ErrorCode.BAD_ADDRESS)
                    m.next = "DONE"
                with m.Elif(logits & (job.n > c.vocab_max)):
                    m.d.sync += self.error.eq(ErrorCode.PROGRAM)
                    m.next = "DONE"
                with m.Elif(~logits & outside(job.dst, out_bytes)):
                    m.d.sync += self.error.eq(ErrorCode.BAD_ADDRESS)
                    m.next = "DONE"
                with m.Else():
                    m.next = "PASS"

            # -- x load ---------------------------------------------------------------------------
            with m.State("PASS"):
                m.d.comb += fetching.eq(1)
                rows_left = job.rows - first
                m.d.sync += pass_rows.eq(Mux(rows_left > per_pass, per_pass, rows_left))
                m.next = "X_CMD"
            x_row, x_kt = Signal(8), Signal(16)
            with m.State("X_CMD"):
                m.d.comb += fetching.eq(1)
                # the pass's rows as one span, or (x_row_spans) row x_row alone
                with m.If(k_zero):              # an empty row: VMEM would stream nothing
                    m.next = "CHECK"
                with m.Else():
                    m.d.comb += [self.vmem_rd_cmd.valid.eq(1),
                                 self.vmem_rd_cmd.payload.line.eq(
                                     job.src + (first + x_row) * stride_in // L),
                                 self.vmem_rd_cmd.payload.rows.eq(Mux(x_row_spans, 1, pass_rows)),
                                 self.vmem_rd_cmd.payload.row_bytes.eq(in_bytes)]
                    with m.If(self.vmem_rd_cmd.ready):
                        m.next = "X_LOAD"
            with m.State("X_LOAD"):
                m.d.comb += fetching.eq(1)
                src = self.vmem_rd
                for cut in (cut8, cut16):
                    m.d.comb += [cut.i.payload.data.eq(src.payload.data),
                                 cut.i.payload.last.eq(src.payload.row_last)]
                m.d.comb += [cut8.i.valid.eq(src.valid & ~wide), cut16.i.valid.eq(src.valid & wide),
                             src.ready.eq(Mux(wide, cut16.i.ready, cut8.i.ready)),
                             cut8.o.ready.eq(1), cut16.o.ready.eq(1)]
                slice_valid = Mux(wide, cut16.o.valid, cut8.o.valid)
                slice_last = Mux(wide, cut16.o.payload.last, cut8.o.payload.last)
                # the slice as matrix-unit digits, placed in its row slot(s)
                slots = Signal(M * slot_bits)
                enable = Signal(M)
                int8_digits = Cat(*(_sext(b, DIGIT_BITS) for b in cut8.o.payload.data))
                hi_digits, lo_digits = [], []
                for j in range(K):
                    v = Cat(cut16.o.payload.data[2 * j], cut16.o.payload.data[2 * j + 1]).as_signed()
                    lo_digits.append(_sext(v[:8], DIGIT_BITS))
                    hi_digits.append((v[8:].as_signed() + v[7])[:DIGIT_BITS])
                with m.If(wide):
                    for r in range(M // 2):
                        with m.If(x_row == r):
                            m.d.comb += [slots.word_select(2 * r, slot_bits).eq(Cat(*hi_digits)),
                                         slots.word_select(2 * r + 1, slot_bits).eq(Cat(*lo_digits)),
                                         enable.eq(0b11 << (2 * r))]
                with m.Else():
                    for r in range(M):
                        with m.If(x_row == r):
                            m.d.comb += [slots.word_select(r, slot_bits).eq(int8_digits),
                                         enable.eq(1 << r)]
                m.d.comb += [xw.addr.eq(x_kt), xw.data.eq(slots),
                             xw.en.eq(Mux(slice_valid & (x_kt < k_tiles), enable, 0))]
                with m.If(slice_valid & (x_kt < k_tiles) & (x_row + 1 == pass_rows)):
                    m.d.sync += x_in.eq(x_kt + 1)
                with m.If(slice_valid):
                    m.d.sync += x_kt.eq(x_kt + 1)
                    with m.If(slice_last):
                        m.d.sync += [x_kt.eq(0), x_row.eq(x_row + 1)]
                        with m.If(x_row + 1 == pass_rows):
                            m.d.sync += x_row.eq(0)
                            m.next = "CHECK"
                        with m.Elif(x_row_spans):
                            m.next = "X_CMD"
                # not expected: the span was checked (reads already issued would stay in
                # flight, so this guard is no recovery, only a loud stop)
                with m.If(self.vmem_error):
                    m.d.sync += [self.error.eq(ErrorCode.BAD_ADDRESS), x_kt.eq(0), x_row.eq(0)]
                    m.next = "DONE"
            with m.State("CHECK"):
                m.d.comb += fetching.eq(1)
                # (the checks are made in RANGE; this cycle starts the pass's stream)
                # (a LOGITS job's vector starts once, before its first pass)
                m.d.comb += [self.logits_begin.eq((mode == MatmulMode.LOGITS) & (first == 0)),
                             self.logits_n.eq(job.n), self.logits_rows.eq(job.rows)]
                with m.If(n_groups == 0):       # nothing to compute or write
                    m.next = "DONE"
                with m.Else():
                    m.next = "STREAM"

            # -- stream (x is in): requant words, residuals, write-back --------------------------
            out_group = Signal(16)
            with m.State("STREAM"):
                m.d.comb += [fetching.eq(1), streaming.eq(1)]
                # group q_group's record in qbuf, in units of a record's words (4N bytes):
                # at q_group mod G without BIAS; words at 2·(q_group mod G), biases after
                def in_batch(g, batch):
                    return g[:exact_log2(batch)] if batch > 1 else Const(0, 1)
                at = Mux(bias, in_batch(q_group, G[True]) << 1, in_batch(q_group, G[False]))
                words = qbuf.word_select(at, 32 * N)
                m.d.comb += mx.q.valid.eq(q_full)
                ungated += [mx.q.payload.words.as_value().eq(words),
                            mx.q.payload.bias.as_value().eq(
                                Mux(bias, qbuf.word_select(at | 1, 32 * N), 0)),
                            # OUT16: the matrix unit's 16-bit saturation (its LOGITS case)
                            mx.q.payload.mode.eq(Mux(out16 & (mode == MatmulMode.INT8),
                                                     MatmulMode.LOGITS, mode)),
                            mx.q.payload.wide.eq(wide),
                            mx.q.payload.rows.eq(pass_rows),
                            *(mx.q.payload.exps[r].eq(Mux(rowexp, self.row_exp[(first + r)[:8]], 0))
                              for r in range(M))]
                if c.weight_blocks:
                    ungated.append(mx.q.payload.blocks.eq(blocks))
                with m.If(mx.q.valid & mx.q.ready):
                    m.d.sync += q_group.eq(q_group + 1)
                # RESADD: the residual of each output row, read in output order (group by
                # group, its rows in turn) as R lines; `peek_at` is the line on peek_data,
                # if it was peeked in this state (x loads use the same VMEM read port)
                res_group, res_row, peek_at = Signal(16), Signal(8), Signal(16)
                m.d.sync += peek_live.eq(1)
                res_offset = (first + res_row) * stride_out + res_group * N * 4
                res_lines = max(1, 4 * N // L)
                restart_residuals = []
                if res_lines == 1:
                    # the row inside one line
                    res_line = (job.dst + res_offset // L)[:16]
                    res_bytes = self.peek_data >> (8 * (res_offset % L))
                    m.d.comb += self.peek_addr.eq(res_line)
                    m.d.sync += peek_at.eq(res_line)
                    m.d.comb += mx.res.valid.eq((mode == MatmulMode.RESADD) & peek_live
                                                & (peek_at == res_line))
                else:
                    # whole lines from a line boundary; the earlier ones wait in `res_held`
                    res_j = Signal(range(res_lines))
                    res_held = Signal(8 * L * (res_lines - 1))
                    row_line = (job.dst + res_offset // L)[:16]
                    here = peek_live & (peek_at == (row_line + res_j)[:16])
                    more = here & (res_j != res_lines - 1)
                    # ask for the next line as the current one arrives: one line per cycle
                    m.d.comb += self.peek_addr.eq(row_line + res_j + more)
                    m.d.sync += peek_at.eq(self.peek_addr)
                    with m.If(more):
                        m.d.sync += [res_held.word_select(res_j, 8 * L).eq(self.peek_data),
                                     res_j.eq(res_j + 1)]
                    res_bytes = Cat(res_held, self.peek_data)
                    m.d.comb += mx.res.valid.eq((mode == MatmulMode.RESADD) & here
                                                & (res_j == res_lines - 1))
                    with m.If(mx.res.valid & mx.res.ready):
                        m.d.sync += res_j.eq(0)
                    # past the last group it gathers lines nobody takes: start the next pass afresh
                    restart_residuals = [res_j.eq(0)]
                for lane in range(N):
                    ungated.append(mx.res.payload[lane].eq(res_bytes.word_select(lane, 32).as_signed()))
                with m.If(mx.res.valid & mx.res.ready):
                    m.d.sync += res_row.eq(res_row + 1)
                    with m.If(res_row + 1 == pass_rows):
                        m.d.sync += [res_row.eq(0), res_group.eq(res_group + 1)]

                # results: to the logit buffer (a tile per row) or into dst, a line per cycle
                o = mx.o
                ungated += [self.logits.payload.row.eq(first + o.payload.row),
                            *(self.logits.payload.data[j].eq(o.payload.data[j][:nx.LOGIT_BITS])
                              for j in range(N))]
                wb_lines = {eb: max(1, N * eb // L) for eb in _OUTPUT_BYTES}
                wb_line = Signal(range(max(2, *wb_lines.values())))      # (no 0-bit signal)
                with m.If(mode == MatmulMode.LOGITS):
                    m.d.comb += [self.logits.valid.eq(o.valid), o.ready.eq(self.logits.ready)]
                with m.Else():
                    # the group's row is N·eb bytes at byte `row·stride + group·N·eb` of dst:
                    # inside one line when N·eb ≤ 16 (at `shift`), else whole lines from a
                    # line boundary; bytes past the row's n elements are not written
                    offset = (first + o.payload.row) * stride_out + out_group * N * out_eb
                    shift = offset % L
                    left = out_bytes - (out_group * N * out_eb + L * wb_line)      # signed
                    last_line = wb_line == by_width(out_eb, wb_lines) - 1
                    pieces, masks = {}, {}
                    for eb in _OUTPUT_BYTES:
                        row_bytes = Cat(*(v[:8 * eb] for v in o.payload.data))
                        nbytes = N * eb
                        pieces[eb] = (row_bytes if nbytes <= L
                                      else row_bytes.word_select(wb_line, 8 * L))
                        masks[eb] = Cat(*(left > i for i in range(min(L, nbytes))))
                    ungated.append(self.poke_data.eq(by_width(out_eb, pieces) << (8 * shift)))
                    m.d.comb += [self.poke_addr.eq(job.dst + offset // L + wb_line),
                                 self.poke_en.eq(Mux(o.valid, by_width(out_eb, masks) << shift, 0)),
                                 o.ready.eq(last_line)]
                    with m.If(o.valid):
                        m.d.sync += wb_line.eq(Mux(last_line, 0, wb_line + 1))
                with m.If(o.valid & o.ready & o.payload.last):
                    m.d.sync += out_group.eq(out_group + 1)
                    with m.If(out_group + 1 == n_groups):
                        m.d.sync += [out_group.eq(0), cmd_group.eq(0), cmd_q.eq(0), kt.eq(0),
                                     q_group.eq(0), q_end.eq(0),
                                     res_group.eq(0), res_row.eq(0), data_group.eq(0),
                                     zero_tiles.eq(0), x_in.eq(0), first.eq(first + pass_rows),
                                     *restart_residuals]
                        m.next = "NEXT_PASS"
            with m.State("NEXT_PASS"):
                with m.If(first < job.rows):
                    m.next = "PASS"
                with m.Else():
                    m.next = "DONE"
            with m.State("DONE"):
                m.d.comb += self.done.eq(1)
                # (x_in too: a pass that ends in CHECK, n = 0, leaves it set)
                m.d.sync += [first.eq(0), x_in.eq(0)]
                m.next = "CLEAR"
            with m.State("CLEAR"):
                m.d.sync += self.error.eq(0)
                m.next = "IDLE"
        m.d.comb += ungated
        return m


#: bytes of an output element in VMEM: INT8, INT8 with OUT16, RESADD and INT32
_OUTPUT_BYTES = (1, 2, 4)


def output_bytes(mode, out16):
    """An output element's bytes in VMEM (isa.matmul_output_bytes), from the job's mode
    and OUT16 flag."""
    return Mux(mode == MatmulMode.INT8, Mux(out16, 2, 1), 4)


def by_width(eb, values: dict):
    """``values[w]`` for the output element width ``eb`` (a signal of one of
    :data:`_OUTPUT_BYTES`)."""
    return Mux(eb == 1, values[1], Mux(eb == 2, values[2], values[4]))


def _sext(value, bits):
    """Sign-extend a value (taken as signed) to ``bits`` bits."""
    v = value.as_signed()
    return Cat(v, v[-1].replicate(bits - len(v)))
