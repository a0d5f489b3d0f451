"""ROPE sequencing: the table row of ``POS`` from device memory, then every head of every
row through the :class:`~dfvg_hw.rope.Rope` pair rotator, in VMEM (docs/isa.md §3.5,
``FunctionalEngine._unit``).

1. **Checks**, in the functional model's order: ``rows > cfg.rows`` (PROGRAM), odd ``k``
   (PROGRAM), ``POS ≥ kv_positions`` (KV_OVERFLOW).
2. **Table.** The ``k/2`` (cos, sin) int16 pairs at ``addr + POS·2k`` are fetched with a
   :class:`~dfvg_hw.operand_access.BlockReader` (any byte address; past device memory the
   memory port refuses it: BAD_ADDRESS through the controller's reset).
3. **Spans.** ``src`` and ``dst`` (``rows × n·k`` int8) must lie in VMEM (BAD_ADDRESS),
   checked before anything is written, as the model loads and stores whole operands.
4. **Heads.** For row ``r`` and head ``h`` the ``k`` bytes at byte ``r·stride + h·k`` of
   ``src`` are gathered (:class:`~dfvg_hw.operand_access.VmemWindow`), rotated as pairs
   ``(x_i, x_{i+k/2})`` in one Rope beat, and scattered to the same place in ``dst``.
   A head is read before it is written and a scatter touches only its own bytes, so the
   compiler's in-place ROPE (``src == dst``) is exact; a ``dst`` overlapping ``src``
   at another offset is not supported (the model reads every row before writing).

Limit: ``k ≤ head_dim`` (one Rope beat per head; every head the compiler emits, since ATTN
needs it). A larger even ``k`` faults PROGRAM where the model would rotate it.

Heads overlap: head ``h + 1`` is gathered while the Rope rotates head ``h``, which is
scattered once head ``h + 1`` has entered the Rope; a head costs its gather, ROTATE and
its scatter (``2·(lines + 3) + 1``), and only a job's lone head waits out the Rope's
latency. ``sim.elementwise_timing.rope_cycles`` has it to the cycle.
"""

from __future__ import annotations

from amaranth import Cat, Module, Signal
from amaranth.lib import wiring

from dfvg_hw.spec.config import EngineConfig
from dfvg_hw.spec.descriptors import ErrorCode
from dfvg_hw.op_port import OpJob, OpSequencerSignature
from dfvg_hw.operand_access import (BlockReader, VmemWindow, byte_mask, job_spans_outside,
                                    window_request)
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
    peek_addr, peek_data, poke_en, poke_addr, poke_data : VMEM's random line ports
    vmem_rd_cmd, vmem_rd, vmem_wr_cmd, vmem_wr, vmem_wr_done, vmem_error : VMEM's span
        ports; unused (heads sit at arbitrary byte offsets, so they go through the line
        ports), their commands stay invalid.
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
        window = m.submodules.window = VmemWindow(c, D)
        wiring.connect(m, table.read_cmd, wiring.flipped(self.read_cmd))
        wiring.connect(m, wiring.flipped(self.read_data), table.read_data)
        m.d.comb += [self.peek_addr.eq(window.peek_addr), window.peek_data.eq(self.peek_data),
                     self.poke_en.eq(window.poke_en), self.poke_addr.eq(window.poke_addr),
                     self.poke_data.eq(window.poke_data)]

        job = Signal(OpJob())
        row_bytes = Signal(32)              # n·k
        stride = Signal(32)                 # row_bytes in whole lines
        row, head = Signal(8), Signal(16)
        row_start = Signal(32)              # byte offset of the current row in src / dst
        offset = Signal(32)                 # byte offset of the current head
        half = Signal(range(D // 2 + 1))    # k / 2: where b starts in a head
        rotated = Signal(8 * D)
        have = Signal()                     # `rotated` holds the Rope's latest head
        pending = Signal()                  # a head has entered the Rope, not yet scattered
        issued_offset = Signal(32)          # byte offset of the head last sent into the Rope
        scatter_offset = Signal(32)         # ... and of the head to scatter next
        issued_last = Signal()              # the head last sent in is the job's last

        # the Rope beat of the gathered head: a = x[0 … k/2), b = x[k/2 … k), the table row
        x = window.data
        x_hi = x >> (half << 3)
        for j in range(pairs):
            m.d.comb += [rope.i.payload.a[j].eq(x.word_select(j, 8)),
                         rope.i.payload.b[j].eq(x_hi.word_select(j, 8)),
                         rope.i.payload.cos[j].eq(table.data.word_select(2 * j, 16)),
                         rope.i.payload.sin[j].eq(table.data.word_select(2 * j + 1, 16))]
        a_out = rope.o.payload.a.as_value() & byte_mask(half, pairs)
        b_out = rope.o.payload.b.as_value()

        def finish(code):
            m.d.sync += self.error.eq(code)
            m.next = "DONE"

        with m.FSM(name="rope") as fsm:
            with m.State("IDLE"):
                m.d.comb += self.job.ready.eq(1)
                with m.If(self.job.valid):
                    p = self.job.payload
                    m.d.sync += [job.eq(p), row_bytes.eq(p.n * p.k),
                                 stride.eq((p.n * p.k + L - 1) // L * L),
                                 half.eq(p.k >> 1), self.error.eq(ErrorCode.OK)]
                    m.next = "CHECK"
            with m.State("CHECK"):
                with m.If(job.rows > c.rows):
                    finish(ErrorCode.PROGRAM)
                with m.Elif(job.k[0]):
                    finish(ErrorCode.PROGRAM)
                with m.Elif(job.pos >= c.kv_positions):
                    finish(ErrorCode.KV_OVERFLOW)
                with m.Elif(job.k > D):           # beyond this sequencer (module docstring)
                    finish(ErrorCode.PROGRAM)
                with m.Else():
                    m.next = "TABLE"
            with m.State("TABLE"):
                m.d.comb += [table.cmd.valid.eq(1),
                             table.cmd.payload.addr.eq(job.addr + job.pos * 2 * job.k),
                             table.cmd.payload.length.eq(2 * job.k)]
                with m.If(table.cmd.ready):
                    m.next = "TABLE_WAIT"
            with m.State("TABLE_WAIT"):
                with m.If(table.done):
                    m.next = "SPANS"
            with m.State("SPANS"):
                m.d.sync += [row.eq(0), head.eq(0), row_start.eq(0), offset.eq(0),
                             pending.eq(0), have.eq(0)]
                with m.If(job_spans_outside(c, job, row_bytes, row_bytes)):
                    finish(ErrorCode.BAD_ADDRESS)
                with m.Elif(row_bytes == 0):      # n = 0 or k = 0: nothing to rotate
                    finish(ErrorCode.OK)
                with m.Else():
                    m.next = "GATHER"
            # Heads overlap: head h+1 is gathered while the Rope rotates head h, and head h
            # is scattered after head h+1 has entered the Rope (the window's register then
            # holds nothing still needed). `rotated` takes the Rope's output whenever it is
            # free (not while a scatter of it is being requested).
            with m.State("GATHER"):
                m.d.comb += window_request(window, job.src * L + offset, job.k)
                with m.If(window.cmd.ready):
                    m.next = "GATHER_WAIT"
            with m.State("GATHER_WAIT"):
                with m.If(window.done):
                    m.next = "ROTATE"
            with m.State("ROTATE"):
                m.d.comb += rope.i.valid.eq(1)
                with m.If(rope.i.ready):
                    m.d.sync += [head.eq(head + 1), offset.eq(offset + job.k),
                                 issued_offset.eq(offset), scatter_offset.eq(issued_offset),
                                 pending.eq(1)]
                    last_head = (head + 1 == job.n) & (row + 1 == job.rows)
                    with m.If(head + 1 == job.n):
                        m.d.sync += [head.eq(0), row.eq(row + 1),
                                     row_start.eq(row_start + stride),
                                     offset.eq(row_start + stride)]
                    m.d.sync += issued_last.eq(last_head)
                    with m.If(pending):              # the head before: scatter it now
                        m.next = "SCATTER"
                    with m.Elif(last_head):          # the only head: wait for its rotation
                        m.d.sync += scatter_offset.eq(offset)
                        m.next = "SCATTER_LAST"
                    with m.Else():
                        m.next = "GATHER"
            with m.State("SCATTER"):                 # the head before the one in the Rope
                m.d.comb += window_request(window, job.dst * L + scatter_offset, job.k,
                                           data=rotated)
                with m.If(window.cmd.ready):
                    m.d.sync += have.eq(0)
                    m.next = "SCATTER_WAIT"
            with m.State("SCATTER_WAIT"):
                with m.If(window.done):
                    m.d.sync += scatter_offset.eq(issued_offset)
                    with m.If(issued_last):
                        m.next = "SCATTER_LAST"
                    with m.Else():
                        m.next = "GATHER"
            with m.State("SCATTER_LAST"):            # the last head, once rotated
                with m.If(have):
                    m.d.comb += window_request(window, job.dst * L + scatter_offset, job.k,
                                               data=rotated)
                    with m.If(window.cmd.ready):
                        m.d.sync += have.eq(0)
                        m.next = "SCATTER_LAST_WAIT"
            with m.State("SCATTER_LAST_WAIT"):
                with m.If(window.done):
                    finish(ErrorCode.OK)
            with m.State("DONE"):
                m.d.comb += self.done.eq(1)
                m.next = "IDLE"
        # the Rope's output into `rotated`, except while a scatter of `rotated` is requested
        m.d.comb += rope.o.ready.eq(~fsm.ongoing("SCATTER")
                                    & ~(fsm.ongoing("SCATTER_LAST") & have))
        with m.If(rope.o.valid & rope.o.ready):
            m.d.sync += [rotated.eq(a_out | (b_out << (half << 3))), have.eq(1)]
        return m
