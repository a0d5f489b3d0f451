"""KVAPPEND and ATTN sequencing around the engine's KV buffer and attention datapath
(docs/isa.md §1.4, §3.6, §3.7; ``FunctionalEngine._unit`` and ``_attention``).

:class:`KvSequencer` owns the :class:`~dfvg_hw.kv_buffer.KVBuffer` — the KV cache is state
of the engine and survives from job to job (a controller reset of the sequencer clears
its registers, never the memories) — and the :class:`~dfvg_hw.attention.Attention` unit.
Every job first sets the buffer's position register (ROLLBACK) from the job, since the
controller's registers are the one source of truth: KVAPPEND writes at ``kv_pos``, ATTN
reads ``0 … prefix − 1`` (a chain job: ``kv_pos = pos``, ``prefix = pos + 1``).

**Slots.** The buffer holds ``kv_slots`` (layer, KV head) pairs; KV head ``h`` of layer
``layer`` is slot ``base + layer · G + h``, where ``G`` is the job's own KV-head count:
KVAPPEND's ``n``, ATTN's ``G`` word, and ``base`` the request's ``kv_slot_base`` (the
``slot_base`` input, taken with the job), the first slot of the request's sequence. A job
whose slots ``base + layer · G … base + (layer + 1) · G − 1`` do not all exist faults
PROGRAM; ``(layer + 1) · G`` is a small multiply (``G ≤ kv_slots`` first) and ``base`` is
added to it (and, once the check passes, its low bits to ``layer · G`` for the slot).

**KVAPPEND** (``rows = 1``; ``n`` KV heads of ``k`` int8 for K, then the same for V, in one
VMEM row at ``src``; with WIDE int16, ``e = 2`` bytes an element, else ``e = 1``). Checks
in the model's order: ``rows ≠ 1``; ``base + (layer + 1) · n > kv_slots`` or ``k >
head_dim`` (PROGRAM); ``kv_pos ≥ kv_positions`` (KV_OVERFLOW); the ``2·n·k·e``-byte row
outside VMEM (BAD_ADDRESS). Then per head ``h`` the K elements at byte ``h·k·e`` and the V
elements at ``(n + h)·k·e``, each made a ``kv_bits`` element (:func:`numerics.kv_entry`:
an int16 saturated, an int8 shifted to the top bits), are appended at slot ``base +
layer · n + h``, position ``kv_pos``; elements ``k … head_dim − 1`` of the entry keep
their contents. The
heads stream: two :class:`~dfvg_hw.head_stream.HeadCutter`s peek the row's K half and
its V half (K first, sharing the peek port) a head ahead of the one being appended, so
the next APPEND goes to the KV buffer in the cycle after the last word of the one
before, unless that head's lines take longer to peek.

**ATTN** (``rows = 1``; ``n`` query heads of ``k`` int8 at ``src``, or with IN16 int16,
saturated to :func:`numerics.attention_query_bits` bits: 11 over an int8 KV cache, 16 over
a wider one). Checks: ``rows ≠ 1``;
``k > head_dim``, ``prefix = 0`` or ``path_len > PATH_ENTRIES`` (PROGRAM: a tree's
``P0 ≥ 1``, its depth ≤ ``MAX_DRAFT``); ``prefix + path_len > kv_positions``
(KV_OVERFLOW; a chain's ``pos ≥ kv_positions``, and for a tree row the controller has
checked the level's largest storage position already); the 16-byte parameter
block at ``addr`` (past device memory: the memory port refuses it, BAD_ADDRESS through
the controller's reset; SET_POS and q[0]'s gather, which run while the block is read,
change neither the KV nor VMEM); its ``G = kv_heads`` word 0, ``base + (layer + 1) · G > kv_slots`` or
``G`` not dividing ``n`` (PROGRAM; ``n / G`` by a divider that steps through ``n``'s bits
from its leading one); ``q`` or the output
(``n·k`` bytes, ``2·n·k`` with WIDE) outside VMEM (BAD_ADDRESS). Then per head ``h``:
gather ``q[h]`` (zero past ``k``, so the stale bytes ``k …`` of a KV entry add nothing to
a score), stream slot ``base + layer · G + h // (n / G)``, positions ``0 … prefix − 1`` and
then the ``path_len`` path positions, through the attention unit (K words packed into
rows, and V words into rows on a second gearbox), and scatter the ``k`` outputs
(int8, or int16 with WIDE) to ``dst + h·k·(1 or 2)``. Heads overlap in the attention
unit: QUERY hands ``q[h]`` to it as soon as it has taken head ``h − 1``'s K rows (and a
score buffer is free), then READ_K starts head ``h``'s K stream on the KV buffer's K
channel (while earlier heads' V streams on the V channel); head ``h``'s V read goes out
beside the FSM once its K read has ended and the V channel is free. The sequencer owes at
most two V reads, so a K read waits only for the V read of the head two before.
Meanwhile the sequencer takes head ``h − 2``'s output, scatters it and gathers
``q[h + 1]``: the outputs trail by two heads, so that the next q never waits for the
reciprocal.

**Tree rows** (docs/isa.md §9.2). The controller issues a tree forward's KVAPPEND and
ATTN one row at a time (``rows = 1``, ``src``/``dst`` at the row): KVAPPEND at the node's
storage position ``kv_pos = S(d, r)``; ATTN with ``prefix = P0`` and ``path_len = d``.
The KV buffer's K channel reads the path entry by entry during each head's K pass,
asking the ``path_index`` → ``path_pos`` port (the controller's table of the row's
ancestors, combinational); the V channel reads the same entries from a copy of those
answers (a head's V read starts after its K read has ended, and every head of the row
has the row's path), so the one port serves both. A path entry is a beat of its own
(banked: a group with one row), so a head streams ``ceil(prefix / B) + path_len``
groups, ``W`` words a group with one bank.

**Compaction** (§9.3). A ``compact`` job (before the program, no job running) copies,
for each level ``d < count`` in order and each slot ``slot_base … slot_base + slots −
1``, the whole K and V entry at ``base + d·width + rows[d]`` to ``base + d``: a ROLLBACK
to the destination per level, a KV-buffer COPY per entry (``W + 2`` cycles), then
``compact_done``. The front end has checked the fields (BAD_REQUEST); positions or slots
past the buffer still copy nothing there (the buffer's range and overflow checks).

**Clear.** ``clear`` (the controller's soft reset; the functional model zeroes KV there)
writes zeros over every entry: APPENDs of all-zero entries, position by position. It is
an extra member rather than a job because a soft reset is no instruction: it has no
fields, no error and no ``done`` in the instruction flow.

Cycles (``tiny``, 128-bit bus; ``T = prefix + path_len``, ``W = head_dim /
gcd(reduce, head_dim)`` KV words per entry, 2 on tiny): KVAPPEND ``4 + (2 + 2W)·n``
(the KV buffer's pace) whenever a head's K and V lines take no longer (n = 2, k = 16:
16; 52 for the 12 heads of alveo-u55c's LLaMA-160M, W = 1); ``done`` comes with the last
word. ATTN, the unit overhead and the parameter read included: n = 4, k = 16: 122 at
T = 1, 239 at T = 16, 719 at T = 64 (208, 291, 757 with the parameter read before
SET_POS and q[0]'s gather, all 16 divide steps and a 34-cycle reciprocal). The read goes
out from CHECK; SET_POS and q[0]'s gather run during its latency; then DIVIDE, ``n``'s
bits from its leading one (G's checks in its first cycle, the remainder and the spans in
its last), then the heads; the last head's V pass is not hidden, and at short contexts
the reciprocal's 18 cycles a head are the pace instead.
Each channel streams one word per cycle, so a head spends ``W`` cycles per position on
K, and the V pass of an earlier head runs beside it; at long contexts the weights pass,
``W·T`` plus the exp path's 6 cycles from a head's start to its first V join, is the
pace (the score passes run back to back beside it).
:mod:`sim.attention_timing` has the exact counts. Clear: about
``kv_positions · (1 + kv_slots · (2·W + 3))`` (tiny: ~1.9k).

**Banks.** With ``kv_banks = B ≥ 2`` a KV buffer beat is ``B`` whole rows (one per bank,
``keep`` masking positions past ``pos``) and goes straight to the attention unit (no
gearboxes): ``G = ceil(T / B)`` beats per pass, ``W = 1`` (an APPEND is one K and one V
row into bank ``pos mod B``). :mod:`sim.attention_timing` has the exact counts.
"""

from __future__ import annotations

from amaranth import Cat, Module, Mux, Signal
from amaranth.lib import stream, wiring
from amaranth.lib.memory import Memory
from amaranth.lib.wiring import In, Out
from amaranth.utils import exact_log2

from dfvg_hw.spec import kv_timing
from dfvg_hw.spec import numerics as nx
from dfvg_hw.spec.config import EngineConfig
from dfvg_hw.spec.descriptors import ErrorCode
from dfvg_hw.spec.image import ATTN_PARAM_BYTES
from dfvg_hw.spec.isa import Op
from dfvg_hw.kv_buffer import KVBuffer, KVOp, PATH_ENTRIES
from dfvg_hw.head_stream import HeadCutter
from dfvg_hw.layouts import CompactJob, flags_view
from dfvg_hw.op_port import OpJob, OpSequencerSignature
from dfvg_hw.operand_access import BlockReader, VmemWindow, vmem_span_outside, window_request
from dfvg_hw.attention import Attention
from dfvg_hw.elementwise import saturate, saturate_symmetric
from dfvg_hw.vmem import Gearbox

__all__ = ["KvSequencer"]

#: bits of ``n``, the dividend of the GQA group size ``n / G``: DIVIDE's most steps
N_BITS = kv_timing.GQA_DIVIDE_BITS


class KvSequencer(wiring.Component):
    """Runs KVAPPEND and ATTN jobs (dispatched on ``job.opcode``) against the KV buffer it
    owns, and clears that buffer on request.

    Parameters
    ----------
    config : EngineConfig
        KV geometry (``kv_slots``, ``kv_positions``, ``head_dim``, ``reduce``),
        ``vmem_bytes``.
    data_width : int
        Memory bus width in bits.

    Members
    -------
    job : In(stream.Signature(OpJob()))
        A KVAPPEND or ATTN (any other opcode finishes at once with PROGRAM): ``flags``
        (WIDE), ``rows``, ``dst``, ``src``, ``n``, ``k``, ``addr`` (ATTN's parameter
        block), ``layer``, ``kv_pos`` (KVAPPEND), ``prefix`` and ``path_len`` (ATTN).
        Not ready while a clear or a compaction is pending.
    done : Out(1)
        One-cycle pulse when the job is finished; ``error`` holds its outcome then.
    error : Out(8)
        :class:`~dfvg_hw.spec.descriptors.ErrorCode` of the finished job.
    read_cmd, read_data : the memory port's read side (ATTN's parameter block)
    peek_addr, peek_data, poke_en, poke_addr, poke_data : VMEM's random line ports
    vmem_rd_cmd, vmem_rd, vmem_wr_cmd, vmem_wr, vmem_wr_done, vmem_error : VMEM's span
        ports; unused (heads sit at arbitrary byte offsets, so they go through the line
        ports), their commands stay invalid.
    clear : In(1)
        Pulse: zero the whole KV buffer (soft reset). Remembered if a job is running and
        served before the next job is taken.
    clearing : Out(1)
        A clear is pending or running; the job port is not ready meanwhile.
    slot_base : In(16)
        The request's ``kv_slot_base`` (its header's word 10): the first KV slot of the
        request's sequence, added to every job's slots. Taken with the job; 0 where left
        undriven, the slot mapping without it.
    path_index : Out(range(PATH_ENTRIES))
        During an ATTN's path: the path entry the KV buffer's K channel reads (0-based),
        else 0.
    path_pos : In(16)
        The KV position of path entry ``path_index``, combinational (same cycle).
    compact : In(stream.Signature(CompactJob()))
        A request's compaction (``base``, ``width``, ``count``, ``rows``, ``slot_base``,
        ``slots``); taken when idle, before any job.
    compact_done : Out(1)
        One-cycle pulse: the compaction is finished (its last copy written).
    """

    def __init__(self, config: EngineConfig, data_width: int):
        self.config, self.data_width = config, data_width
        members = dict(OpSequencerSignature(config, data_width).members)
        members.update({"clear": In(1), "clearing": Out(1), "slot_base": In(16),
                        "path_index": Out(range(PATH_ENTRIES)), "path_pos": In(16),
                        "compact": In(stream.Signature(CompactJob())), "compact_done": Out(1)})
        super().__init__(wiring.Signature(members))

    def elaborate(self, platform):
        m = Module()
        L = self.config.vmem_line_bytes
        c = self.config
        D = c.head_dim
        kv = m.submodules.kv = KVBuffer(c)
        self.kv_buffer = kv                     # co-simulation reads the KV through it
        WB, W, B = kv.word_elements, kv.words, kv.banks
        attn = m.submodules.attention = Attention(c, path_entries=PATH_ENTRIES)
        # The K channel asks the controller for a path entry's position; the V channel reads
        # the same head's path after it, from a copy of the answers (every head of a tree
        # row has the row's path, and a head's V read starts once its K read has ended)
        m.d.comb += [self.path_index.eq(kv.k_path_index), kv.k_path_pos.eq(self.path_pos)]
        path_copy = m.submodules.path_copy = Memory(shape=16, depth=PATH_ENTRIES, init=[])
        copy_wr, copy_rd = path_copy.write_port(), path_copy.read_port(domain="comb")
        m.d.comb += [copy_wr.en.eq(1), copy_wr.addr.eq(kv.k_path_index),
                     copy_wr.data.eq(self.path_pos),
                     copy_rd.addr.eq(kv.v_path_index), kv.v_path_pos.eq(copy_rd.data)]
        params = m.submodules.params = BlockReader(c, self.data_width, ATTN_PARAM_BYTES)
        window = m.submodules.window = VmemWindow(c, 2 * D)      # a WIDE output head
        # KVAPPEND's K and V heads (int8, or int16 with WIDE), each cut from its half of
        # the row; K peeks first (its words go first), V when K has its next head
        cut_k = m.submodules.cut_k = HeadCutter(c, 2 * D, lookahead=0)
        cut_v = m.submodules.cut_v = HeadCutter(c, 2 * D, lookahead=0)
        EB = c.kv_bits
        wiring.connect(m, params.read_cmd, wiring.flipped(self.read_cmd))
        wiring.connect(m, wiring.flipped(self.read_data), params.read_data)
        # ATTN's parameter block is the job's one device-memory read: once its command is
        # out, the controller may prefetch the next MATMUL's weights behind it (op_port)
        params_issued = Signal()
        m.d.comb += self.reads_done.eq(params_issued)
        with m.If(self.read_cmd.valid & self.read_cmd.ready):
            m.d.sync += params_issued.eq(1)
        with m.If(self.job.valid & self.job.ready):
            m.d.sync += params_issued.eq(0)
        m.d.comb += [cut_k.grant.eq(cut_k.want), cut_v.grant.eq(cut_v.want & ~cut_k.want),
                     self.peek_addr.eq(Mux(cut_k.want, cut_k.peek_addr,
                                           Mux(cut_v.want, cut_v.peek_addr, window.peek_addr))),
                     window.peek_data.eq(self.peek_data), cut_k.peek_data.eq(self.peek_data),
                     cut_v.peek_data.eq(self.peek_data),
                     self.poke_en.eq(window.poke_en), self.poke_addr.eq(window.poke_addr),
                     self.poke_data.eq(window.poke_data)]

        job = Signal(OpJob())
        base = Signal(16)                   # the job's slot_base
        wide = Signal()
        in16 = Signal()                     # ATTN IN16: an int16 query, 2k bytes a head
        head_bytes = Signal(32)             # n·k: all heads of K, of V, of an int8 q
        out_head_bytes = Signal(range(2 * D + 1))   # k int8 or int16 outputs of one head
        head = Signal(16)
        outs = Signal(16)                   # ATTN outputs scattered
        in_offset, out_offset = Signal(32), Signal(32)
        # ATTN parameters and the GQA mapping
        mult, shift, groups = Signal(16), Signal(6), Signal(32)
        g_bits = c.kv_slots.bit_length()    # G ≤ kv_slots once checked
        dividend, quotient = Signal(N_BITS), Signal(N_BITS)
        remainder = Signal(g_bits)
        steps = Signal(range(N_BITS + 1))  # DIVIDE's cycles left: n's bits from its leading one
        params_in = Signal()                # the parameter block has arrived (mult, shift, groups)
        bad_span = Signal()                 # q or the output outside VMEM (reported after G's checks)
        in_group = Signal(N_BITS)           # query heads of the current group so far
        # KV buffer command registers (shared by KVAPPEND, ATTN and clear)
        kv_slot = Signal.like(kv.cmd.payload.slot)
        kv_arg = Signal(16)
        entry = Signal(2 * EB * D)          # K elements, then V elements, of one entry
        word = Signal(range(2 * W))
        clearing_kv = Signal()              # the append states serve a clear
        clear_pending = Signal()
        clear_pos = Signal(range(c.kv_positions))
        # heads whose K read is issued and V read is not (at most two), and their slots,
        # the oldest first
        v_owed = Signal(range(3))
        v_slot = [Signal.like(kv_slot, name=f"v_slot{i}") for i in range(2)]
        result = Signal(16 * D)
        # compaction: the job, its level, the level's first storage position, the slot
        compaction = Signal(CompactJob())
        level = Signal(8)
        level_first = Signal(26)            # base + level · width
        copy_slot = Signal(18)              # slot_base + the slots copied so far
        slots_left = Signal(16)

        m.d.comb += self.clearing.eq(clear_pending | clearing_kv)
        with m.If(self.clear):
            m.d.sync += clear_pending.eq(1)

        if B == 1:
            # KV words → D-byte rows → the attention unit's K port; the same for V
            for side, beats, port in (("k", kv.k_data, attn.k), ("v", kv.v_data, attn.v)):
                rows_of = m.submodules[f"{side}_rows"] = Gearbox(WB, D)
                row = port.payload.row if side == "k" else port.payload
                m.d.comb += [rows_of.i.valid.eq(beats.valid), beats.ready.eq(rows_of.i.ready),
                             rows_of.i.payload.data.as_value().eq(beats.payload.data.as_value()),
                             rows_of.i.payload.last.eq(beats.payload.last),
                             row.as_value().eq(rows_of.o.payload.data.as_value()),
                             port.valid.eq(rows_of.o.valid), rows_of.o.ready.eq(port.ready)]
            m.d.comb += attn.k.payload.last.eq(m.submodules.k_rows.o.payload.last)
        else:
            # banked: a beat is already a group of B rows (one per bank) with its keep mask
            m.d.comb += [attn.k.payload.rows.eq(kv.k_data.payload.rows),
                         attn.k.payload.keep.eq(kv.k_data.payload.keep),
                         attn.k.payload.last.eq(kv.k_data.payload.last),
                         attn.k.valid.eq(kv.k_data.valid), kv.k_data.ready.eq(attn.k.ready),
                         attn.v.payload.eq(kv.v_data.payload.rows),
                         attn.v.valid.eq(kv.v_data.valid), kv.v_data.ready.eq(attn.v.ready)]

        # A head's V read goes out beside the FSM once its K read has ended (the V side of
        # the attention unit takes it after the previous head's V): with two owed, the
        # older one's has (the newer K read went out after it)
        v_out, k_out = Signal(), Signal()
        m.d.comb += [kv.v_read.valid.eq((v_owed == 2) | ((v_owed == 1) & kv.k_read.ready)),
                     kv.v_read.payload.slot.eq(v_slot[0]),
                     kv.v_read.payload.paths.eq(job.path_len),
                     v_out.eq(kv.v_read.valid & kv.v_read.ready),
                     k_out.eq(kv.k_read.valid & kv.k_read.ready)]
        with m.If(v_out):
            m.d.sync += v_slot[0].eq(v_slot[1])
        with m.If(k_out):
            with m.If((v_owed == 0) | ((v_owed == 1) & v_out)):
                m.d.sync += v_slot[0].eq(kv_slot)
            with m.Else():
                m.d.sync += v_slot[1].eq(kv_slot)
        m.d.sync += v_owed.eq(v_owed + k_out - v_out)

        q_limit = (1 << (nx.attention_query_bits(c.kv_bits) - 1)) - 1
        for j in range(D):
            q16 = window.data.word_select(j, 16).as_signed()
            m.d.comb += attn.q.payload.q[j].eq(
                Mux(in16, saturate_symmetric(q16, q_limit), window.data.word_select(j, 8).as_signed()))
        m.d.comb += [attn.q.payload.mult.eq(mult), attn.q.payload.shift.eq(shift),
                     attn.q.payload.wide.eq(wide)]
        narrow_out = Cat(lane[:8] for lane in attn.o.payload)
        wide_out = Cat(lane[:16] for lane in attn.o.payload)

        def kv_elements(head):
            """A cut head's ``D`` elements as KV cache elements (numerics.kv_entry): int16
            saturated to ``kv_bits`` with WIDE, else int8 in the top 8 bits."""
            return Cat(Mux(wide, saturate(head.word_select(j, 16).as_signed(), EB),
                           head.word_select(j, 8).as_signed() << (EB - nx.ACT_BITS))[:EB]
                       for j in range(D))

        def finish(code):
            m.d.sync += self.error.eq(code)
            m.next = "DONE"

        def kv_command(op, **fields):
            """Comb statements offering KV-buffer command ``op`` with the given payload
            ``fields`` (``slot``, ``arg``); fields not given stay 0. The state
            moves on when ``kv.cmd.ready`` is high."""
            return [kv.cmd.valid.eq(1), kv.cmd.payload.op.eq(op),
                    *(getattr(kv.cmd.payload, name).eq(value) for name, value in fields.items())]

        def gather(offset, then):
            """A state body: gather k bytes at ``src + offset``, then go to ``then``."""
            m.d.comb += window_request(window, job.src * L + offset, job.k << in16)
            with m.If(window.cmd.ready):
                m.next = then

        # ATTN's parameter block: done is a pulse, which may come while the FSM is still
        # gathering q[0]
        with m.If(params.done):
            word0 = params.data[:32]
            m.d.sync += [mult.eq(word0[:16]), shift.eq(word0[16:22]),
                         groups.eq(params.data[32:64]), params_in.eq(1)]

        with m.FSM(name="kv"):
            with m.State("IDLE"):
                m.d.comb += [self.compact.ready.eq(~clear_pending),
                             self.job.ready.eq(~clear_pending & ~self.compact.valid)]
                with m.If(clear_pending):
                    m.d.sync += [clear_pending.eq(self.clear), clearing_kv.eq(1), clear_pos.eq(0),
                                 kv_slot.eq(0), kv_arg.eq(D), entry.eq(0)]
                    m.next = "CLEAR_POS"
                with m.Elif(self.compact.valid):
                    p = self.compact.payload
                    m.d.sync += [compaction.eq(p), level.eq(0), level_first.eq(p.base)]
                    with m.If((p.count == 0) | (p.slots == 0)):
                        m.next = "COMPACT_END"
                    with m.Else():
                        m.next = "COMPACT_LEVEL"
                with m.Elif(self.job.valid):
                    p = self.job.payload
                    wide_job = flags_view(p.flags).wide
                    m.d.sync += [job.eq(p), base.eq(self.slot_base), wide.eq(wide_job),
                                 in16.eq((p.opcode == Op.ATTN) & flags_view(p.flags).in16),
                                 head_bytes.eq(p.n * p.k),
                                 out_head_bytes.eq(Mux(wide_job, 2 * p.k, p.k)),
                                 self.error.eq(ErrorCode.OK)]
                    m.next = "CHECK"
            with m.State("CHECK"):
                appending = job.opcode == Op.KVAPPEND
                # KVAPPEND's slots base + layer · n … base + (layer + 1) · n − 1 (ATTN's
                # wait for G); the slot is right whenever the check passes (base ≤ kv_slots)
                slots_over = (job.n > c.kv_slots) | (base + (job.layer + 1) * job.n[:g_bits]
                                                     > c.kv_slots)
                m.d.sync += [head.eq(0), outs.eq(0), in_offset.eq(0), out_offset.eq(0),
                             in_group.eq(0), kv_arg.eq(job.k),
                             kv_slot.eq(base[:g_bits] + job.layer[:g_bits] * job.n[:g_bits])]
                with m.If(~appending & (job.opcode != Op.ATTN)):
                    finish(ErrorCode.PROGRAM)
                with m.Elif(job.rows != 1):
                    finish(ErrorCode.PROGRAM)
                with m.Elif((job.k > D) | Mux(appending, slots_over,
                                              (job.prefix == 0) | (job.path_len > PATH_ENTRIES))):
                    finish(ErrorCode.PROGRAM)
                with m.Elif(Mux(appending, job.kv_pos >= c.kv_positions,
                                job.prefix + job.path_len > c.kv_positions)):
                    finish(ErrorCode.KV_OVERFLOW)
                with m.Elif(appending):
                    with m.If(vmem_span_outside(c, job.src, 1, (2 * head_bytes) << wide)):
                        finish(ErrorCode.BAD_ADDRESS)
                    with m.Else():
                        # K heads from the row's first byte, V heads from byte n·k·e
                        v_start = job.src * L + (head_bytes << wide)
                        for cutter, line, skip in ((cut_k, job.src, 0),
                                                   (cut_v, v_start >> exact_log2(L),
                                                    v_start[:exact_log2(L)])):
                            m.d.comb += [cutter.run.valid.eq(1),
                                         cutter.run.payload.line.eq(line),
                                         cutter.run.payload.skip.eq(skip),
                                         cutter.run.payload.k.eq(job.k << wide),
                                         cutter.run.payload.row_bytes.eq(head_bytes << wide),
                                         cutter.run.payload.rows.eq(1)]
                        m.next = "SET_POS"
                with m.Else():
                    # ATTN: the parameter block's read goes out now, and the job's steps
                    # that need no parameter run during its latency (SET_POS, head 0's q
                    # gather); G's checks, n / G and the faults follow in the model's
                    # order once the block is in
                    m.d.comb += [params.cmd.valid.eq(1), params.cmd.payload.addr.eq(job.addr),
                                 params.cmd.payload.length.eq(ATTN_PARAM_BYTES)]
                    # the dividend from n's leading one: the quotient bits above it are 0
                    n_bits, n_zeros = Signal(range(N_BITS + 1)), Signal(range(N_BITS + 1))
                    m.d.comb += n_zeros.eq(N_BITS)
                    for i in range(N_BITS):
                        with m.If(job.n[i]):
                            m.d.comb += [n_bits.eq(i + 1), n_zeros.eq(N_BITS - 1 - i)]
                    m.d.sync += [bad_span.eq(vmem_span_outside(c, job.src, 1, head_bytes << in16)
                                             | vmem_span_outside(c, job.dst, 1,
                                                                 Mux(wide, 2, 1) * head_bytes)),
                                 params_in.eq(0), dividend.eq(job.n << n_zeros),
                                 quotient.eq(0), remainder.eq(0), steps.eq(n_bits)]
                    with m.If(params.cmd.ready):
                        m.next = "SET_POS"

            # -- ATTN parameters and the GQA group size --------------------------------------
            with m.State("PARAMS_WAIT"):
                with m.If(params.done | params_in):
                    m.next = "DIVIDE"
            with m.State("DIVIDE"):
                # n / G, a quotient bit a cycle; the first cycle also checks G (constant
                # from here: a fault ends the job before anything is handed on), the last
                # the remainder and then the spans, in the model's order
                partial = Cat(dividend[-1], remainder)
                fits = partial >= groups[:g_bits]
                rest = Mux(fits, partial - groups[:g_bits], partial)
                m.d.sync += [remainder.eq(rest), quotient.eq(Cat(fits, quotient)),
                             dividend.eq(dividend << 1), steps.eq(steps - 1),
                             kv_slot.eq(base[:g_bits] + job.layer[:g_bits] * groups[:g_bits])]
                with m.If((groups == 0) | (groups > c.kv_slots)
                          | (base + (job.layer + 1) * groups[:g_bits] > c.kv_slots)):
                    finish(ErrorCode.PROGRAM)
                with m.Elif(steps <= 1):
                    with m.If((steps == 1) & (rest != 0)):
                        finish(ErrorCode.PROGRAM)
                    with m.Elif(bad_span):
                        finish(ErrorCode.BAD_ADDRESS)
                    with m.Elif(job.n == 0):
                        finish(ErrorCode.OK)
                    with m.Else():
                        m.next = "QUERY"

            with m.State("SET_POS"):            # the buffer's POS for APPEND / READ
                m.d.comb += kv_command(KVOp.ROLLBACK, arg=Mux(job.opcode == Op.KVAPPEND,
                                                              job.kv_pos, job.prefix - 1))
                with m.If(kv.cmd.ready):
                    with m.If(job.opcode == Op.ATTN):
                        # q[0] only when a head and the spans allow it
                        m.next = "GATHER_Q"
                        with m.If((job.n == 0) | bad_span):
                            m.next = "PARAMS_WAIT"
                    with m.Elif(job.n == 0):
                        finish(ErrorCode.OK)
                    with m.Else():
                        m.next = "APPEND"

            # -- KVAPPEND: heads back to back; the cutters peek head h + 1 while h is appended
            with m.State("APPEND"):             # also a clear's entry
                heads_in = cut_k.heads.valid & cut_v.heads.valid
                with m.If(clearing_kv | heads_in):
                    m.d.comb += kv_command(KVOp.APPEND, slot=kv_slot, arg=kv_arg)
                    with m.If(kv.cmd.ready):
                        m.d.sync += word.eq(0)
                        m.next = "APPEND_DATA"
                        with m.If(~clearing_kv):    # the head leaves the cutters for entry
                            m.d.comb += [cut_k.heads.ready.eq(1), cut_v.heads.ready.eq(1)]
                            m.d.sync += entry.eq(Cat(kv_elements(cut_k.heads.payload),
                                                     kv_elements(cut_v.heads.payload)))
            with m.State("APPEND_DATA"):
                m.d.comb += [kv.wdata.valid.eq(1),
                             kv.wdata.payload.as_value().eq(entry.word_select(word, EB * WB))]
                with m.If(kv.wdata.ready):
                    m.d.sync += word.eq(word + 1)
                    with m.If(word == 2 * W - 1):
                        with m.If(clearing_kv):
                            m.next = "APPENDED"
                        with m.Else():          # the KV buffer takes the next APPEND at once
                            m.d.sync += [kv_slot.eq(kv_slot + 1), head.eq(head + 1)]
                            with m.If(head + 1 == job.n):
                                # done with the last word (error has held OK since the
                                # job was taken): the KV buffer writes it in the next
                                # cycles, before any later command can reach it
                                m.d.comb += self.done.eq(1)
                                m.next = "IDLE"
                            with m.Else():
                                m.next = "APPEND"
            with m.State("APPENDED"):           # a clear's entry is written
                m.next = "CLEAR_NEXT"

            # -- ATTN, heads overlapped ----------------------------------------------------------
            # Head h's q is taken (QUERY) as soon as the attention unit's weights pass has
            # taken head h − 1; READ_K starts head h's K rows (its V rows follow beside the
            # FSM); then head h − 2's output is scattered and q[h + 1] gathered.
            with m.State("GATHER_Q"):
                gather(in_offset, "GATHER_Q_WAIT")
            with m.State("GATHER_Q_WAIT"):
                with m.If(window.done):
                    m.next = "QUERY"
                    with m.If(head == 0):               # q[0]: gathered during the parameter read
                        m.next = "PARAMS_WAIT"
            with m.State("QUERY"):
                m.d.comb += attn.q.valid.eq(1)
                with m.If(attn.q.ready):
                    m.next = "READ_K"
            with m.State("READ_K"):
                # (at most one V read owed: the queue has room)
                m.d.comb += [kv.k_read.valid.eq(v_owed != 2), kv.k_read.payload.slot.eq(kv_slot),
                             kv.k_read.payload.paths.eq(job.path_len)]
                with m.If(kv.k_read.valid & kv.k_read.ready):
                    m.d.sync += [head.eq(head + 1),
                                 in_offset.eq(in_offset + (job.k << in16)), in_group.eq(in_group + 1)]
                    with m.If(in_group + 1 == quotient):       # next KV head's group
                        m.d.sync += [in_group.eq(0), kv_slot.eq(kv_slot + 1)]
                    with m.If((head >= 2) | (head + 1 == job.n)):
                        m.next = "ATTEND"                       # head − 2's output (or the last)
                    with m.Else():
                        m.next = "GATHER_Q"
            with m.State("ATTEND"):
                m.d.comb += attn.o.ready.eq(1)
                with m.If(attn.o.valid):
                    m.d.sync += result.eq(Mux(wide, wide_out, narrow_out))
                    m.next = "SCATTER"
            with m.State("SCATTER"):
                m.d.comb += window_request(window, job.dst * L + out_offset, out_head_bytes,
                                           data=result)
                with m.If(window.cmd.ready):
                    m.next = "SCATTER_WAIT"
            with m.State("SCATTER_WAIT"):
                with m.If(window.done):
                    m.d.sync += [out_offset.eq(out_offset + out_head_bytes), outs.eq(outs + 1)]
                    with m.If(outs + 1 == job.n):
                        # done now rather than from DONE: error has held OK since the job
                        # was taken
                        m.d.comb += self.done.eq(1)
                        m.next = "IDLE"
                    with m.Elif(head == job.n):
                        m.next = "ATTEND"                       # the last head's output
                    with m.Else():
                        m.next = "GATHER_Q"

            # -- clear: zero entries, position by position -----------------------------------
            with m.State("CLEAR_POS"):
                m.d.comb += kv_command(KVOp.ROLLBACK, arg=clear_pos)
                with m.If(kv.cmd.ready):
                    m.next = "APPEND"
            with m.State("CLEAR_NEXT"):
                m.d.sync += kv_slot.eq(kv_slot + 1)
                m.next = "APPEND"
                with m.If(kv_slot == c.kv_slots - 1):
                    m.d.sync += [kv_slot.eq(0), clear_pos.eq(clear_pos + 1)]
                    m.next = "CLEAR_POS"
                    with m.If(clear_pos == c.kv_positions - 1):
                        m.d.sync += clearing_kv.eq(0)
                        m.next = "IDLE"

            # -- compaction: per level a ROLLBACK to its destination, then a COPY per slot --
            def clamped(value, limit):
                """``value`` as a command field: ``limit`` (past the buffer) when larger."""
                return Mux(value > limit, limit, value)

            with m.State("COMPACT_LEVEL"):
                m.d.comb += kv_command(KVOp.ROLLBACK,
                                       arg=clamped(compaction.base + level, 0xFFFF))
                with m.If(kv.cmd.ready):
                    m.d.sync += [copy_slot.eq(compaction.slot_base),
                                 slots_left.eq(compaction.slots)]
                    m.next = "COMPACT_COPY"
            with m.State("COMPACT_COPY"):
                row = compaction.rows.word_select(level[:4], 4)
                m.d.comb += kv_command(KVOp.COPY, slot=clamped(copy_slot, c.kv_slots),
                                       arg=clamped(level_first + row, 0xFFFF))
                with m.If(kv.cmd.ready):
                    m.d.sync += [copy_slot.eq(copy_slot + 1), slots_left.eq(slots_left - 1)]
                    with m.If(slots_left == 1):
                        m.d.sync += [level.eq(level + 1),
                                     level_first.eq(level_first + compaction.width)]
                        with m.If(level + 1 == compaction.count):
                            m.next = "COMPACT_END"
                        with m.Else():
                            m.next = "COMPACT_LEVEL"
            with m.State("COMPACT_END"):        # the last copy written
                with m.If(~kv.busy):
                    m.d.comb += self.compact_done.eq(1)
                    m.next = "IDLE"

            with m.State("DONE"):
                m.d.comb += self.done.eq(1)
                m.next = "IDLE"
        return m
