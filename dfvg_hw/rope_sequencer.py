"""ROPE sequencing: the table row of ``POS`` from device memory, then every head of every
row through the :class:`~dfvg_hw.rope.Rope` pair rotator, in VMEM (docs/isa.md §3.5,
``FunctionalEngine._unit``).

1. **Checks**, in the functional model's order: ``rows > cfg.rows`` (PROGRAM), odd ``k``
   (PROGRAM), ``POS ≥ kv_positions`` (KV_OVERFLOW); then ``src`` and ``dst`` (``rows ×
   n·k`` int8, or int16 with ``WIDE``) must lie in VMEM (BAD_ADDRESS). The model reads
   the table row before it checks the spans, but both faults are BAD_ADDRESS and nothing
   is written before either, so checking the spans first (in the same cycle as the rest)
   is the same.
2. **Table.** The ``k/2`` (cos, sin) int16 pairs at ``addr + POS·2k`` are fetched with a
   :class:`~dfvg_hw.operand_access.BlockReader` (any byte address; past device memory the
   memory port refuses it: BAD_ADDRESS through the controller's reset).
3. **Heads.** Row ``r`` of ``src`` is ``n`` heads of ``k`` elements (``k`` bytes, ``2k``
   with ``WIDE``) side by side from byte ``r·stride``. A
   :class:`~dfvg_hw.head_stream.HeadCutter` peeks the rows' lines a line
   a cycle and offers the heads in order; each is rotated as pairs ``(x_i,
   x_{i+k/2})`` in one Rope beat, and a :class:`~dfvg_hw.head_stream.HeadPacker` packs
   the rotated heads into the same places of ``dst`` and pokes each line once it is
   whole (a row's last line with the row's bytes only). A line is written only after
   every head in it has been read, and never read again, so the compiler's in-place
   ROPE (``src == dst``) is exact; a ``dst`` overlapping ``src`` at another offset is
   not supported (the model reads every row before writing).

Limit: ``k ≤ head_dim`` (one Rope beat per head; every head the compiler emits, since ATTN
needs it). A larger even ``k`` faults PROGRAM where the model would rotate it.

Streaming: the table read and the cutter start together at the end of CHECK, so the
first lines are peeked while the table row is on its way (the cutter holds a head and
a line or two until the row is in); from then on a head enters the Rope every cycle its
bytes are in, and the packer pokes a line a cycle behind it. A row costs its lines (or
its heads, where a head is less than a line) rather than a gather, a rotation and a
scatter per head; a job about the table read, its lines and the Rope's and the
streams' few cycles of latency. ``sim.elementwise_timing.rope_cycles`` has it to the
cycle.
"""

from __future__ import annotations

from amaranth import Cat, Module, Mux, Signal
from amaranth.lib import wiring
from amaranth.utils import exact_log2

from dfvg_hw.spec.config import EngineConfig
from dfvg_hw.spec.descriptors import ErrorCode
from dfvg_hw.op_port import OpJob, OpSequencerSignature
from dfvg_hw.head_stream import HeadCutter, HeadPacker
from dfvg_hw.layouts import flags_view
from dfvg_hw.operand_access import BlockReader, byte_mask, job_spans_outside
from dfvg_hw.rope import Rope

__all__ = ["RopeSequencer"]


class RopeSequencer(wiring.Component):
    """Runs one ROPE per ``job`` and answers with ``done`` and an error code.

    Parameters
    ----------
    config : EngineConfig
        ``head_dim`` (largest ``k``), ``rows``, ``kv_positions``, ``vmem_bytes``.
    data_width : int
        Memory bus width in bits.

    Members
    -------
    job : In(stream.Signature(OpJob()))
        The ROPE to run: ``rows``, ``dst``, ``src``, ``n``, ``k``, ``addr`` (the table),
        ``pos``.
    done : Out(1)
        One-cycle pulse when the job is finished; ``error`` holds its outcome then.
    error : Out(8)
        :class:`~dfvg_hw.spec.descriptors.ErrorCode` of the finished job.
    read_cmd, read_data : the memory port's read side (the table row)
    peek_addr, peek_data, poke_en, poke_addr, poke_data : VMEM's random line ports (the
        cutter's peeks and the packer's pokes)
    vmem_rd_cmd, vmem_rd, vmem_wr_cmd, vmem_wr, vmem_wr_done, vmem_error : VMEM's span
        ports; unused (the line ports read and write a line a cycle all the same, with
        byte masks for the rows' tails), their commands stay invalid.
    """

    def __init__(self, config: EngineConfig, data_width: int):
        if config.head_dim % 2:
            raise ValueError(f"RopeSequencer needs an even head_dim, got {config.head_dim}")
        self.config, self.data_width = config, data_width
        super().__init__(OpSequencerSignature(config, data_width))

    def elaborate(self, platform):
        m = Module()
        L = self.config.vmem_line_bytes
        c = self.config
        D = c.head_dim
        pairs = D // 2
        rope = m.submodules.rope = Rope(c)
        table = m.submodules.table = BlockReader(c, self.data_width, 2 * D)
        # a head is k bytes, or 2k with WIDE (int16 elements)
        cutter = m.submodules.cutter = HeadCutter(c, 2 * D, lookahead=1)
        packer = m.submodules.packer = HeadPacker(c, 2 * D)
        wiring.connect(m, table.read_cmd, wiring.flipped(self.read_cmd))
        wiring.connect(m, wiring.flipped(self.read_data), table.read_data)
        m.d.comb += [self.peek_addr.eq(cutter.peek_addr), cutter.peek_data.eq(self.peek_data),
                     cutter.grant.eq(1),
                     self.poke_en.eq(packer.poke_en), self.poke_addr.eq(packer.poke_addr),
                     self.poke_data.eq(packer.poke_data)]

        job = Signal(OpJob())
        wide = flags_view(job.flags).wide   # int16 elements
        row_bytes = Signal(32)              # n·k elements' bytes
        half = Signal(range(D + 1))         # where b starts in a head: k/2 elements' bytes
        table_in = Signal()                 # the table row has come (BlockReader: done)
        # the operand as the cutter reads it and the packer writes it: rows a stride of
        # whole lines apart, heads side by side from a row's first byte
        stride = (row_bytes + L - 1) >> exact_log2(L)
        for port, line in ((cutter.run, job.src), (packer.run, job.dst)):
            m.d.comb += [port.payload.line.eq(line), port.payload.skip.eq(0),
                         port.payload.k.eq(job.k << wide), port.payload.row_bytes.eq(row_bytes),
                         port.payload.rows.eq(job.rows), port.payload.stride.eq(stride)]

        # the Rope beat of the head on offer: a = x[0 … k/2), b = x[k/2 … k), the table row
        x = cutter.heads.payload
        x_hi = x >> (half << 3)

        def element(v, j):
            return Mux(wide, v.word_select(j, 16).as_signed(), v.word_select(j, 8).as_signed())

        for j in range(pairs):
            m.d.comb += [rope.i.payload.a[j].eq(element(x, j)),
                         rope.i.payload.b[j].eq(element(x_hi, j)),
                         rope.i.payload.cos[j].eq(table.data.word_select(2 * j, 16)),
                         rope.i.payload.sin[j].eq(table.data.word_select(2 * j + 1, 16)),
                         rope.i.payload.wide.eq(wide)]

        def elements(lanes):
            # the rotated half's bytes: int16 lanes, or their low bytes (int8 results)
            return Mux(wide, lanes.as_value(), Cat(lane[:8] for lane in lanes))

        a_out = elements(rope.o.payload.a) & byte_mask(half, 2 * pairs)
        b_out = elements(rope.o.payload.b)
        # heads stream cutter → Rope → packer once the table row is in (before it, the
        # cutter fills its queue: the first lines' peeks hide behind the table read)
        # (k = 0: the cutter's empty heads are not rotated, the job has none)
        table_ready = (table_in | table.done) & (row_bytes != 0)
        m.d.comb += [rope.i.valid.eq(cutter.heads.valid & table_ready),
                     cutter.heads.ready.eq(rope.i.ready & table_ready),
                     packer.heads.valid.eq(rope.o.valid), rope.o.ready.eq(packer.heads.ready),
                     packer.heads.payload.eq(a_out | (b_out << (half << 3)))]

        def finish(code):
            m.d.sync += self.error.eq(code)
            m.next = "DONE"

        with m.FSM(name="rope"):
            with m.State("IDLE"):
                m.d.comb += self.job.ready.eq(1)
                with m.If(self.job.valid):
                    p = self.job.payload
                    p_wide = flags_view(p.flags).wide
                    m.d.sync += [job.eq(p), row_bytes.eq((p.n * p.k) << p_wide),
                                 half.eq(Mux(p_wide, p.k, p.k >> 1)),
                                 table_in.eq(0), self.error.eq(ErrorCode.OK)]
                    m.next = "CHECK"
            with m.State("CHECK"):
                # the model's order; src and dst are checked before the table read too,
                # as nothing is written before the read is done either way
                with m.If(job.rows > c.rows):
                    finish(ErrorCode.PROGRAM)
                with m.Elif(job.k[0]):
                    finish(ErrorCode.PROGRAM)
                with m.Elif(job.pos >= c.kv_positions):
                    finish(ErrorCode.KV_OVERFLOW)
                with m.Elif(job.k > D):           # beyond this sequencer (module docstring)
                    finish(ErrorCode.PROGRAM)
                with m.Elif(job_spans_outside(c, job, row_bytes, row_bytes)):
                    finish(ErrorCode.BAD_ADDRESS)
                with m.Else():
                    # the table row's read and the operand's first peeks start together
                    m.d.comb += [table.cmd.valid.eq(1),
                                 table.cmd.payload.addr.eq(job.addr + job.pos * 2 * job.k),
                                 table.cmd.payload.length.eq(2 * job.k),
                                 cutter.run.valid.eq(1), packer.run.valid.eq(1)]
                    m.next = "RUN"
            with m.State("RUN"):
                with m.If(table.done):
                    m.d.sync += table_in.eq(1)
                    with m.If(row_bytes == 0):    # n = 0 or k = 0: nothing to rotate
                        finish(ErrorCode.OK)
                with m.If(packer.last):
                    finish(ErrorCode.OK)
            with m.State("DONE"):
                m.d.comb += self.done.eq(1)
                m.next = "IDLE"
        return m
