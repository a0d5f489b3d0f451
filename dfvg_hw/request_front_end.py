"""The request front end: reads and checks a request's header, scans its input tokens
(docs/isa.md §5.1, ``FunctionalEngine._read_request_tokens``) and tells the controller
whether the program may run.

Per request (``start``):

1. **Header.** The :data:`~dfvg_hw.spec.descriptors.REQUEST_HEADER_WORDS` words at the
   request base, into ``header`` (:class:`~dfvg_hw.layouts.RequestHeader`); a refused
   read ends the request with ``BAD_ADDRESS``.
2. **Checks** (one cycle): ``n_in ≥ 1``, ``n_draft ≤ MAX_DRAFT``, ``1 ≤ topk ≤
   topk_max``, ``SAMPLE`` needs ``t_mult ≠ 0``, ``t_shift ≤ 63``, reserved flag bits and
   words zero, and the tree and compaction fields (docs/isa.md §5.1 check 6a,
   ``FunctionalEngine._check_tree_fields``): all zero on an engine built with
   ``tree_width`` 0 (``P_TREE_WIDTH`` = 0, it drafts chains only), else a tree no wider
   than the engine's, of at most ``MAX_DRAFT`` nodes, ``topk ≥ W`` when greedy, a row
   pitch when wider than 1, no ``tree_pc`` or ``row_pitch`` without a tree, and a
   compaction that is a path of a tree no wider than the engine's, inside the KV buffer;
   any failure is ``BAD_REQUEST``.
3. **Token scan.** The ``n_in`` token words; a refused read is ``BAD_ADDRESS`` at once, a
   token ``≥ vocab_max`` is ``BAD_REQUEST`` once the scan is over (the read runs out).

``done`` pulses with the outcome in the cycle the request is decided; ``OK`` means the
program runs. ``header`` and ``base`` hold until the next ``start``.
"""

from __future__ import annotations

from amaranth import Cat, Module, Mux, Signal, unsigned
from amaranth.lib import stream, wiring
from amaranth.lib.wiring import In, Out

from dfvg_hw.layouts import RequestHeader
from dfvg_hw.memory_port import MemoryCommand, ReadBeat
from dfvg_hw.spec.config import EngineConfig
from dfvg_hw.spec.descriptors import (COMPACT_ROW_BITS, MAX_COMPACT, MAX_DRAFT, REQUEST_HEADER_WORDS,
                                      TREE_FIELDS, ErrorCode)

__all__ = ["RequestFrontEnd"]


class RequestFrontEnd(wiring.Component):
    """Reads, checks and scans one request per ``start`` (see the module docstring).

    Parameters
    ----------
    config : EngineConfig
        ``topk_max``, ``vocab_max``, ``kv_positions``, ``kv_slots``.
    data_width : int
        Memory bus width in bits (a multiple of 128).
    tree_width : int, optional
        The widest tree the engine drafts (its ``P_TREE_WIDTH``), 0 … ``config.rows``;
        by default ``config.rows``. 0: tree and compaction fields are refused.

    Members
    -------
    start : In(stream.Signature(unsigned(64)))
        The request's device address; taken (``ready``) while idle.
    done : Out(1)
        One-cycle pulse: the request is read and checked; ``error`` holds the outcome.
    error : Out(8)
        :class:`~dfvg_hw.spec.descriptors.ErrorCode`: OK, BAD_ADDRESS or BAD_REQUEST.
    header : Out(RequestHeader())
        The request's header (zero until it is read).
    base : Out(64)
        The request's device address (input token ``i`` is at ``base + 4·(16 + i)``).
    read_cmd : Out(stream.Signature(MemoryCommand(config)))
    read_data : In(stream.Signature(ReadBeat(data_width)))
        Device-memory reads (the header, then the tokens).
    mem_error : In(1)
        The memory port refused a read (its sticky error).
    """

    def __init__(self, config: EngineConfig, data_width: int, tree_width: int | None = None):
        self.config, self.data_width = config, data_width
        self.tree_width = config.rows if tree_width is None else tree_width
        if not 0 <= self.tree_width <= config.rows:
            raise ValueError(f"tree_width {self.tree_width} is not in 0 … rows = {config.rows}")
        super().__init__(wiring.Signature({
            "start": In(stream.Signature(unsigned(64))),
            "done": Out(1),
            "error": Out(8),
            "header": Out(RequestHeader()),
            "base": Out(64),
            "read_cmd": Out(stream.Signature(MemoryCommand(config))),
            "read_data": In(stream.Signature(ReadBeat(data_width))),
            "mem_error": In(1),
        }))

    def elaborate(self, platform):
        m = Module()
        c, DW = self.config, self.data_width
        beat_bytes, beat_words = DW // 8, DW // 32
        header, base = self.header, self.base
        count = Signal(range(max(2, 4 * REQUEST_HEADER_WORDS // beat_bytes + 1)))
        bad_token = Signal()
        data = self.read_data.payload.data

        def finish(error):
            m.d.comb += [self.done.eq(1), self.error.eq(error)]
            m.next = "IDLE"

        def read(addr, length):
            m.d.comb += [self.read_cmd.valid.eq(1), self.read_cmd.payload.addr.eq(addr),
                         self.read_cmd.payload.length.eq(length)]

        with m.FSM(name="request"):
            with m.State("IDLE"):
                m.d.comb += self.start.ready.eq(1)
                with m.If(self.start.valid):
                    m.d.sync += [base.eq(self.start.payload), header.eq(0), count.eq(0),
                                 bad_token.eq(0)]
                    m.next = "HEADER_CMD"
            with m.State("HEADER_CMD"):
                read(base, 4 * REQUEST_HEADER_WORDS)
                with m.If(self.read_cmd.ready):
                    m.next = "HEADER_DATA"
            with m.State("HEADER_DATA"):
                m.d.comb += self.read_data.ready.eq(1)
                with m.If(self.mem_error):
                    finish(ErrorCode.BAD_ADDRESS)
                with m.Elif(self.read_data.valid):
                    beats = max(1, 4 * REQUEST_HEADER_WORDS // beat_bytes)
                    with m.Switch(count):
                        for b in range(beats):
                            with m.Case(b):
                                lo = b * DW
                                hi = min(lo + DW, 32 * REQUEST_HEADER_WORDS)
                                m.d.sync += header.as_value()[lo:hi].eq(data[:hi - lo])
                    m.d.sync += count.eq(count + 1)
                    with m.If(self.read_data.payload.last):
                        m.next = "HEADER_CHECK"
            with m.State("HEADER_CHECK"):
                h = header
                bad = ((h.n_in == 0) | (h.n_draft > MAX_DRAFT) | (h.topk == 0)
                       | (h.topk > c.topk_max) | (h.flags.sample & (h.t_mult == 0))
                       | (h.t_shift > 63) | h.flags.reserved.any() | h.reserved.any()
                       | self._bad_tree_fields(h))
                with m.If(bad):
                    finish(ErrorCode.BAD_REQUEST)
                with m.Else():
                    m.next = "SCAN_CMD"
            with m.State("SCAN_CMD"):
                read(base + 4 * REQUEST_HEADER_WORDS, header.n_in * 4)
                with m.If(self.read_cmd.ready):
                    m.next = "SCAN_DATA"
            with m.State("SCAN_DATA"):
                m.d.comb += self.read_data.ready.eq(1)
                in_range = Signal()
                m.d.comb += in_range.eq(1)
                for w in range(beat_words):
                    # words past n_in are zero (the port zeroes the tail), so they pass
                    with m.If(data.word_select(w, 32) >= c.vocab_max):
                        m.d.comb += in_range.eq(0)
                with m.If(self.mem_error):
                    finish(ErrorCode.BAD_ADDRESS)
                with m.Elif(self.read_data.valid):
                    with m.If(~in_range):
                        m.d.sync += bad_token.eq(1)
                    with m.If(self.read_data.payload.last):
                        m.next = "SCAN_DONE"
            with m.State("SCAN_DONE"):
                finish(Mux(bad_token, ErrorCode.BAD_REQUEST, ErrorCode.OK))
        return m

    def _bad_tree_fields(self, h):
        """Whether the tree and compaction fields of header ``h`` are refused (a value)."""
        c, engine_width = self.config, self.tree_width
        if not engine_width:
            return Cat(*(getattr(h, name) for name in TREE_FIELDS)).any()
        width, levels = h.tree_width, h.compact_len
        tree = ((width > engine_width)
                | ((width != 0) & ((h.n_draft * width > MAX_DRAFT)
                                   | (~h.flags.sample & (h.topk < width))
                                   | ((width > 1) & (h.row_pitch == 0))))
                | ((width == 0) & ((h.tree_pc != 0) | (h.row_pitch != 0))))
        # compact_rows holds row r_d of level d in nibble d - 1 (d ≤ compact_len)
        nibbles = [h.compact_rows.word_select(d, COMPACT_ROW_BITS) for d in range(MAX_COMPACT)]
        not_a_path = Cat(*(Mux(d < levels, nibble >= h.compact_width, nibble != 0)
                           for d, nibble in enumerate(nibbles))).any()
        last_row = h.compact_rows.word_select((levels - 1)[:4], COMPACT_ROW_BITS)
        last_source = h.compact_from + (levels - 1) * h.compact_width + last_row
        compaction = Mux(levels == 0,
                         (h.compact_from != 0) | (h.compact_width != 0) | (h.compact_slots != 0)
                         | (h.compact_rows != 0),
                         (levels > MAX_COMPACT) | (h.compact_width == 0)
                         | (h.compact_width > engine_width) | not_a_path
                         | (last_source >= c.kv_positions)
                         | (h.kv_slot_base + h.compact_slots > c.kv_slots))
        return tree | compaction
