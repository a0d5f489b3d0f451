"""One KV bank memory, split by depth so that it fits UltraRAM without rounding up.

A URAM288 is 4096 words deep. A memory of ``depth`` words marked ``ram_style = "ultra"``
costs ``ceil(depth / 4096)`` URAMs per 72 bits of width, so a depth just past a multiple
of 4096 wastes most of a row of URAMs: at ``alveo-u55c`` each of the KV buffer's 32 bank
memories (16 banks, K and V) is 144 slots × 64 positions = 9 216 words of 512 bits, which
rounds up to 3 × 4096 deep, a third of it empty. :class:`BankMemory` keeps the words up to
the largest multiple of 4096 (8 192) in URAM and the rest (1 024) in a second memory in
block RAM, behind the ports of a single memory: one write port, one synchronous read port
with an enable, the same latency and read-during-write behaviour (the old word). The KV
buffer's timing does not change.
"""

from __future__ import annotations

from amaranth import Module, Mux, Signal, unsigned
from amaranth.lib import wiring
from amaranth.lib.memory import Memory
from amaranth.lib.wiring import In, Out

__all__ = ["BankMemory"]


class _Words:
    """``data[i]`` of a :class:`BankMemory`: word ``i`` of whichever part holds it, as a
    value the simulator reads (``ctx.get(bank.data[i])``, like a ``Memory``'s)."""

    def __init__(self, bank: "BankMemory"):
        self._bank = bank

    def __len__(self):
        return self._bank.depth

    def __getitem__(self, index: int):
        if not 0 <= index < self._bank.depth:
            raise IndexError(index)
        split = self._bank.split
        return (self._bank.parts[0].data[index] if index < split
                else self._bank.parts[1].data[index - split])


class BankMemory(wiring.Component):
    """A ``depth`` × ``width``-bit memory with one write and one synchronous read port,
    stored in one :class:`~amaranth.lib.memory.Memory` or, when that saves UltraRAM, two.

    It splits when ``ram_style`` is ``"ultra"`` and ``depth`` is past a multiple of
    ``uram_depth`` by at most ``uram_depth / 4``: words ``0 … split − 1`` (``split`` the
    largest multiple of ``uram_depth`` below ``depth``) in a memory marked ``"ultra"``,
    words ``split … depth − 1`` in one marked ``"block"``. A larger remainder would cost
    about as much block RAM as the URAM row it saves, so it stays one memory. Word ``a ≥
    split`` is at ``a − split`` of the second part, which is ``a``'s low bits: ``split`` is
    a multiple of ``uram_depth`` and the remainder is under it.

    Both parts are read every enabled cycle; the read data is the part that the address
    of that cycle fell in, selected by a register that, like the parts' data registers,
    holds while ``r_en`` is low. A read of the word written in the same cycle returns the
    old word, as a single memory's (non-transparent) port does.

    Parameters
    ----------
    width, depth : int
        Bits per word, words.
    ram_style : str or None
        ``ram_style`` of the memory (of the URAM part when split); None: none.
    uram_depth : int
        Words of one URAM (a power of two); smaller in tests, to split small memories.

    Attributes
    ----------
    split : int
        Words in the first part (``depth`` when not split).
    parts : list of Memory
        The one memory, or the URAM part and the block-RAM part.
    data : sequence
        ``data[i]``: word ``i`` for the simulator (``ctx.get``), whichever part holds it.

    Members
    -------
    w_addr : In(range(depth))
        Write address.
    w_data : In(width)
        Write data.
    w_en : In(1)
        Writes ``w_data`` at ``w_addr`` this cycle.
    r_addr : In(range(depth))
        Read address.
    r_en : In(1)
        Reads ``r_addr`` into ``r_data`` (the next cycle); low, ``r_data`` holds.
    r_data : Out(width)
        The word read.
    """

    #: words of a URAM288 (4K × 72)
    URAM_DEPTH = 4096

    def __init__(self, width: int, depth: int, *, ram_style: str | None = None,
                 uram_depth: int = URAM_DEPTH):
        assert uram_depth > 0 and uram_depth & (uram_depth - 1) == 0, uram_depth
        self.width, self.depth, self.ram_style = width, depth, ram_style
        split = depth // uram_depth * uram_depth
        rest = depth - split
        self.split = (split if ram_style == "ultra" and split and 0 < rest <= uram_depth // 4
                      else depth)
        attrs = {"ram_style": ram_style} if ram_style else None
        self.parts = [Memory(shape=unsigned(width), depth=self.split, init=[], attrs=attrs)]
        if self.split < depth:
            self.parts.append(Memory(shape=unsigned(width), depth=depth - self.split, init=[],
                                     attrs={"ram_style": "block"}))
        self.data = _Words(self)
        super().__init__({
            "w_addr": In(range(depth)),
            "w_data": In(width),
            "w_en": In(1),
            "r_addr": In(range(depth)),
            "r_en": In(1),
            "r_data": Out(width),
        })

    def elaborate(self, platform):
        m = Module()
        # the memories' names are the RTLIL memories': verilog.drop_uram_init drops the init
        # of every memory named as an "ultra" one, in any module, so they are not generic
        names = ("kv_uram", "kv_bram") if len(self.parts) == 2 else ("kv_mem",)
        writes, reads = [], []
        for name, part in zip(names, self.parts):
            m.submodules[name] = part
            writes.append(part.write_port())
            reads.append(part.read_port())
        for w, r in zip(writes, reads):
            m.d.comb += [w.addr.eq(self.w_addr), w.data.eq(self.w_data), r.addr.eq(self.r_addr),
                         r.en.eq(self.r_en)]
        if len(self.parts) == 1:
            m.d.comb += [writes[0].en.eq(self.w_en), self.r_data.eq(reads[0].data)]
            return m
        # the parts' addresses are ``r_addr``'s and ``w_addr``'s low bits (truncated by the
        # ports' width): below ``split`` the address itself, above it the offset past it
        high_w = self.w_addr >= self.split
        m.d.comb += [writes[0].en.eq(self.w_en & ~high_w), writes[1].en.eq(self.w_en & high_w)]
        high_r = Signal()                  # the registered read address was in the BRAM part
        with m.If(self.r_en):
            m.d.sync += high_r.eq(self.r_addr >= self.split)
        m.d.comb += self.r_data.eq(Mux(high_r, reads[1].data, reads[0].data))
        return m
