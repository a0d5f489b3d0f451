"""Heads streamed through VMEM's line ports, a line a cycle (ROPE, KVAPPEND; issue #14).

A ROPE or KVAPPEND operand is ``rows`` rows of ``n`` heads of ``k`` bytes side by side
(docs/isa.md §1.3): row ``r`` starts ``skip`` bytes into line ``line + r·stride`` and its
``n·k`` bytes run on over the next lines, with ``k`` any even (ROPE) or any (KVAPPEND)
count up to ``head_dim``, so a head may start anywhere in a line and end in another.
Gathering and scattering head by head (:class:`~dfvg_hw.operand_access.VmemWindow`)
costs a request and a ``done`` per head, and peeks a line shared by two heads twice;
these two blocks instead keep a row's bytes flowing:

* :class:`HeadCutter` peeks the operand's lines in order, one a cycle, into a byte queue
  and offers its first ``k`` bytes as a head as soon as they are in;
* :class:`HeadPacker` queues heads back to back and pokes each line once it is whole
  (a row's last line with the row's bytes only), so a line is written once, with the
  byte mask of exactly the operand.

Both read and write whole rows in order, so an operand rewritten in place (``src ==
dst``, the same layout) is exact: a line is poked only after every head with a byte in
it has left the cutter, and the cutter never peeks a line again.
"""

from __future__ import annotations

from amaranth import Cat, Module, Mux, Signal, unsigned
from amaranth.lib import data, stream, wiring
from amaranth.lib.wiring import In, Out

from dfvg_hw.spec.config import EngineConfig
from dfvg_hw.operand_access import byte_mask

__all__ = ["HeadRun", "HeadCutter", "HeadPacker"]


class HeadRun(data.StructLayout):
    """An operand of heads: ``rows`` rows of ``row_bytes`` bytes (``n·k``, whole heads of
    ``k`` bytes), row ``r`` from byte ``skip`` of VMEM line ``line + r·stride``."""

    def __init__(self, config: EngineConfig, max_head: int):
        super().__init__({
            "line": unsigned(16), "skip": range(config.vmem_line_bytes),
            "k": range(max_head + 1), "row_bytes": range(config.vmem_bytes + 1),
            "rows": unsigned(8), "stride": unsigned(16),
        })


class _LineWalk:
    """The walk over a run's lines that the cutter and the packer share: line after line of
    a row, ``amount`` of its bytes each, then the next row ``stride`` lines after the first
    line of this one; ``rows_left`` reaches 0 after the last row (at once for empty rows)."""

    def __init__(self, run):
        self.run = run
        self.line, self.row_line = Signal(16), Signal(16)
        self.row_left = Signal.like(run.row_bytes)  # bytes of the row not yet visited
        self.rows_left = Signal(8)

    def row_ends(self, amount):
        """Whether a line of ``amount`` bytes is the row's last."""
        return self.row_left == amount

    def start(self, m: Module, p):
        """Begin run ``p`` (the run's payload) at its first line."""
        m.d.sync += [self.line.eq(p.line), self.row_line.eq(p.line), self.row_left.eq(p.row_bytes),
                     self.rows_left.eq(Mux(p.row_bytes == 0, 0, p.rows))]

    def step(self, m: Module, amount):
        """Move past the current line, which holds ``amount`` of the row's bytes."""
        run = self.run
        m.d.sync += [self.line.eq(self.line + 1), self.row_left.eq(self.row_left - amount)]
        with m.If(self.row_ends(amount)):
            m.d.sync += [self.rows_left.eq(self.rows_left - 1),
                         self.row_line.eq(self.row_line + run.stride),
                         self.line.eq(self.row_line + run.stride), self.row_left.eq(run.row_bytes)]


class HeadCutter(wiring.Component):
    """Cuts an operand's heads out of its VMEM lines, peeking a line a cycle.

    The lines of a run are peeked in order, a row's lines, then the next row's; the
    bytes of the run in each (past ``skip`` in a row's first line, up to the row's end
    in its last) go to the back of a byte queue, the cycle after the peek. The queue's
    first ``k`` bytes are the head on offer (``heads.valid`` once they are in), and a
    head taken leaves the queue.

    The cutter asks for a line (``want``) while the bytes it holds and has peeked, less
    a head leaving this cycle, are fewer than ``k + lookahead·L`` (``L =
    vmem_line_bytes``): with ``lookahead = 0`` it stops once the next head is peeked
    (a consumer that takes a head every few cycles, and shares the peek port); with
    ``lookahead = 1`` it reads a line further, which keeps a head a cycle flowing
    whatever ``k`` and ``L``. The queue holds ``head_dim + (lookahead + 1)·L`` bytes.

    Parameters
    ----------
    config : EngineConfig
        ``vmem_line_bytes``, ``vmem_bytes``.
    max_head : int
        Largest ``k``.
    lookahead : int
        Lines peeked beyond the next head: 0 or 1.

    Members
    -------
    run : In(stream.Signature(HeadRun(config, max_head)))
        The operand; always ready: a run replaces whatever is left of the previous one.
    want : Out(1)
        The cutter asks to peek line ``peek_addr`` this cycle.
    grant : In(1)
        The peek port is the cutter's this cycle (only counts with ``want``).
    peek_addr : Out(16)
    peek_data : In(8 · vmem_line_bytes)
        VMEM's peek port: ``peek_data`` is the line granted the cycle before.
    heads : Out(stream.Signature(8 · max_head))
        The next head, at bytes ``0 … k − 1`` (the bytes after it are the run's next
        ones, or zero). A run of ``k = 0`` offers empty heads without end: the consumer
        counts them.
    """

    def __init__(self, config: EngineConfig, max_head: int, lookahead: int):
        if lookahead not in (0, 1):
            raise ValueError(f"HeadCutter lookahead is 0 or 1 lines, got {lookahead}")
        self.config, self.max_head, self.lookahead = config, max_head, lookahead
        L = config.vmem_line_bytes
        self.queue_bytes = max_head + (lookahead + 1) * L
        super().__init__(wiring.Signature({
            "run": In(stream.Signature(HeadRun(config, max_head))),
            "want": Out(1),
            "grant": In(1),
            "peek_addr": Out(16),
            "peek_data": In(8 * L),
            "heads": Out(stream.Signature(8 * max_head)),
        }))

    def elaborate(self, platform):
        m = Module()
        L = self.config.vmem_line_bytes
        Q = self.queue_bytes
        run = Signal.like(self.run.payload)
        queue = Signal(8 * Q)
        fill = Signal(range(Q + 1))                 # bytes in the queue
        arriving = Signal(range(L + 1))             # bytes of the line peeked last cycle
        arriving_skip = Signal(range(L))            # ... and where they start in it
        walk = _LineWalk(run)                       # the next line to peek
        row_left, rows_left = walk.row_left, walk.rows_left
        first = Signal()                            # the next line is a row's first

        m.d.comb += self.run.ready.eq(1)
        taken = self.heads.valid & self.heads.ready
        leaving = Mux(taken, run.k, 0)
        held = fill + arriving - leaving
        skip = Mux(first, run.skip, 0)
        amount = Mux(row_left < L - skip, row_left, L - skip)
        m.d.comb += [
            self.heads.valid.eq(fill >= run.k),
            self.heads.payload.eq(queue[:8 * self.max_head]),
            self.want.eq((rows_left != 0) & (held < run.k + self.lookahead * L)),
            self.peek_addr.eq(walk.line),
        ]
        # the line peeked last cycle joins the queue behind what stays of it
        line = (self.peek_data >> (arriving_skip << 3)) & byte_mask(arriving, L)
        base = (fill - leaving)[:len(fill)]
        m.d.sync += [queue.eq((queue >> (leaving << 3)) | (line << (base << 3))),
                     fill.eq(base + arriving), arriving.eq(0)]
        with m.If(self.want & self.grant):
            m.d.sync += [arriving.eq(amount), arriving_skip.eq(skip),
                         first.eq(walk.row_ends(amount))]   # after a row's last line, a first
            walk.step(m, amount)

        with m.If(self.run.valid):
            p = self.run.payload
            m.d.sync += [run.eq(p), queue.eq(0), fill.eq(0), arriving.eq(0), first.eq(1)]
            walk.start(m, p)
        return m


class HeadPacker(wiring.Component):
    """Packs heads back to back into an operand's VMEM lines and pokes each line once.

    Heads join the back of a byte queue (their first ``k`` bytes); whenever the queue
    holds the whole of the next line — ``L`` bytes, or what is left of the row in its
    last line — the line is poked with a byte mask of those bytes and leaves the queue,
    so the next row's first head starts the next row's first line. The queue holds
    ``head_dim + L`` bytes and a head waits while it would not fit; behind a
    :class:`HeadCutter` of the same layout (ROPE's) it never has to: heads come no
    faster than a cycle each nor than their lines are peeked, and a line leaves a cycle.

    Parameters
    ----------
    config : EngineConfig
        ``vmem_line_bytes``, ``vmem_bytes``.
    max_head : int
        Largest ``k``.

    Members
    -------
    run : In(stream.Signature(HeadRun(config, max_head)))
        The operand (``skip`` must be 0: rows start at a line); always ready: a run
        replaces whatever is left of the previous one.
    heads : In(stream.Signature(8 · max_head))
        Heads, at bytes ``0 … k − 1`` (later bytes are ignored).
    busy : Out(1)
        Lines of the run are still to be poked.
    last : Out(1)
        The run's last line is poked this cycle.
    poke_en : Out(vmem_line_bytes)
    poke_addr : Out(16)
    poke_data : Out(8 · vmem_line_bytes)
        VMEM's poke port.
    """

    def __init__(self, config: EngineConfig, max_head: int):
        self.config, self.max_head = config, max_head
        L = config.vmem_line_bytes
        self.queue_bytes = max_head + L
        super().__init__(wiring.Signature({
            "run": In(stream.Signature(HeadRun(config, max_head))),
            "heads": In(stream.Signature(8 * max_head)),
            "busy": Out(1),
            "last": Out(1),
            "poke_en": Out(L),
            "poke_addr": Out(16),
            "poke_data": Out(8 * L),
        }))

    def elaborate(self, platform):
        m = Module()
        L = self.config.vmem_line_bytes
        Q = self.queue_bytes
        run = Signal.like(self.run.payload)
        queue = Signal(8 * Q)
        fill = Signal(range(Q + 1))
        walk = _LineWalk(run)                       # the next line to poke
        row_left, rows_left = walk.row_left, walk.rows_left

        m.d.comb += self.run.ready.eq(1)
        amount = Mux(row_left < L, row_left, L)
        out = (rows_left != 0) & (fill >= amount)
        leaving = Mux(out, amount, 0)
        m.d.comb += [
            self.busy.eq(rows_left != 0),
            self.last.eq(out & (rows_left == 1) & walk.row_ends(amount)),
            self.poke_addr.eq(walk.line), self.poke_data.eq(queue[:8 * L]),
            self.poke_en.eq(Mux(out, Cat(b < amount for b in range(L)), 0)),
            self.heads.ready.eq(fill - leaving + run.k <= Q),
        ]
        taken = self.heads.valid & self.heads.ready
        head = Mux(taken, self.heads.payload & byte_mask(run.k, self.max_head), 0)
        base = (fill - leaving)[:len(fill)]
        m.d.sync += [queue.eq((queue >> (leaving << 3)) | (head << (base << 3))),
                     fill.eq(base + Mux(taken, run.k, 0))]
        with m.If(out):
            walk.step(m, amount)

        with m.If(self.run.valid):
            m.d.sync += [run.eq(self.run.payload), queue.eq(0), fill.eq(0)]
            walk.start(m, self.run.payload)
        return m
