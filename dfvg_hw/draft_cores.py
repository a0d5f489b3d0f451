"""``DraftCores``: several draft engines on one card, sharing its memory ports.

::

                          ┌─► DraftEngine core 0 ─┐   port p of every core
    s_axil_* ─► CoreWindows ─► DraftEngine core 1 ─┼─► AXI4Arbiter ───► m_axi_* / mNN_axi_*
    (core i at i << 9)    └─► …                  ─┘   (one per memory port p)
    irq[i] ◄── core i's interrupt

``config.draft_cores`` cores, each a whole :class:`~dfvg_hw.engine.DraftEngine` of the
configuration: its own register file, controller, instruction memory, VMEM, KV buffer
and sampler, so each runs its own program and requests, independently of the others.
What they share is device memory: port ``p`` of every core goes through one
:class:`~dfvg_hw.axi4_arbiter.AXI4Arbiter` onto the card's port ``p`` (round-robin per
burst, answers routed back in issue order, one grant for all ports so that striped cores
never wait on each other's beats). The host gives each core its own request and result
buffers (and, as it likes, its own or a shared image and program) in the one device
memory.

The AXI4-Lite slave is the cores' register windows side by side: core ``i``'s register
``r`` is at ``i << register_space_bits() | r`` (:class:`CoreWindows`). With one core
``DraftCores`` is the :class:`DraftEngine`, wired through (no decoder, no arbiter).

The ports are flat and named as ``DraftEngine``'s: ``s_axil_*`` (address width
``register_space_bits() + ceil(log2(draft_cores))``), ``m_axi_*`` or ``m00_axi_*`` … (one
master per memory port), and ``irq`` (``draft_cores`` bits, bit ``i`` core ``i``'s).

Timing: the arbiter adds no cycle to a core alone, so its request runs in exactly the
cycles the cycle model gives; under contention a core waits for the others' bursts and
the model's count is a lower bound.
"""

from __future__ import annotations

from amaranth import Cat, Module, Signal
from amaranth.lib import wiring
from amaranth.lib.wiring import In, Out

from dfvg_hw.axi4 import connect_flat
from dfvg_hw.axi4_arbiter import AXI4Arbiter
from dfvg_hw.axi_lite import AXI4LiteSignature, AxiResp, connect_prefixed, prefixed_members
from dfvg_hw.engine import AXIL_PREFIX, DraftEngine
from dfvg_hw.spec.config import EngineConfig
from dfvg_hw.spec.regmap import register_space_bits

__all__ = ["DraftCores", "CoreWindows", "estimate"]

_WORD_BITS = 32


class CoreWindows(wiring.Component):
    """AXI4-Lite decoder: one slave port whose address space is ``cores`` windows of
    ``2 ** window_bits`` bytes side by side, window ``i`` on ``cores[i]``.

    One write and one read at a time, each held here and forwarded to the addressed
    core with the window's offset; the core's response is passed back as it comes. An
    address in a window past the last core (a core count that is not a power of two
    leaves some) is answered here with DECERR (no slave there) and, for a read, data 0,
    so the host never waits on a core that does not exist. Every ready towards the host
    depends only on this block's state. A write or a read costs one cycle more than the
    core's own (4 and 3 against a register file's 3 and 2).

    Parameters
    ----------
    cores : int
        Windows that have a core (at least 1).
    window_bits : int
        Byte-address bits of one window (the register space's, ``register_space_bits()``).

    Members
    -------
    bus : In(AXI4LiteSignature(window_bits + ceil(log2(cores))))
        The host's register reads and writes.
    cores : Out(AXI4LiteSignature(window_bits)).array(cores)
        Each core's register file.
    """

    def __init__(self, cores: int, window_bits: int):
        if cores < 1:
            raise ValueError(f"a decoder needs at least one window, not {cores}")
        self.count = cores
        self.window_bits = window_bits
        self.index_bits = (cores - 1).bit_length()
        #: the host side's address width: the windows side by side
        self.addr_width = window_bits + self.index_bits
        super().__init__({
            "bus": In(AXI4LiteSignature(self.addr_width)),
            "cores": Out(AXI4LiteSignature(window_bits)).array(cores),
        })

    def elaborate(self, platform):
        m = Module()
        bus, bits = self.bus, self.window_bits

        # -- write: hold AW and W from the host, hand them to the core, pass its B back ----
        aw_held, w_held, aw_sent, w_sent = Signal(), Signal(), Signal(), Signal()
        w_core = Signal(max(self.index_bits, 1))
        w_offset, w_prot = Signal(bits), Signal(3)
        w_data, w_strb = Signal(_WORD_BITS), Signal(_WORD_BITS // 8)
        m.d.comb += [bus.awready.eq(~aw_held), bus.wready.eq(~w_held)]
        with m.If(bus.awvalid & bus.awready):
            m.d.sync += [aw_held.eq(1), w_core.eq(bus.awaddr[bits:]), w_offset.eq(bus.awaddr[:bits]),
                         w_prot.eq(bus.awprot)]
        with m.If(bus.wvalid & bus.wready):
            m.d.sync += [w_held.eq(1), w_data.eq(bus.wdata), w_strb.eq(bus.wstrb)]
        write = aw_held & w_held
        for i, core in enumerate(self.cores):
            selected = write & (w_core == i)
            m.d.comb += [core.awaddr.eq(w_offset), core.awprot.eq(w_prot), core.wdata.eq(w_data),
                         core.wstrb.eq(w_strb),
                         core.awvalid.eq(selected & ~aw_sent), core.wvalid.eq(selected & ~w_sent)]
            with m.If(core.awvalid & core.awready):
                m.d.sync += aw_sent.eq(1)
            with m.If(core.wvalid & core.wready):
                m.d.sync += w_sent.eq(1)
            with m.If(selected):
                m.d.comb += [bus.bvalid.eq(aw_sent & w_sent & core.bvalid), bus.bresp.eq(core.bresp),
                             core.bready.eq(aw_sent & w_sent & bus.bready)]
        # Only a core count that is not a power of two leaves windows without a core (and
        # a comparison that is always false is what Verilator's CMPCONST flags).
        if self.count < 1 << self.index_bits:
            with m.If(write & (w_core >= self.count)):
                m.d.comb += [bus.bvalid.eq(1), bus.bresp.eq(AxiResp.DECERR)]
        with m.If(bus.bvalid & bus.bready):
            m.d.sync += [aw_held.eq(0), w_held.eq(0), aw_sent.eq(0), w_sent.eq(0)]

        # -- read: hold AR, hand it to the core, pass its R back -----------------------------
        ar_held, ar_sent = Signal(), Signal()
        r_core = Signal(max(self.index_bits, 1))
        r_offset, r_prot = Signal(bits), Signal(3)
        m.d.comb += bus.arready.eq(~ar_held)
        with m.If(bus.arvalid & bus.arready):
            m.d.sync += [ar_held.eq(1), r_core.eq(bus.araddr[bits:]), r_offset.eq(bus.araddr[:bits]),
                         r_prot.eq(bus.arprot)]
        for i, core in enumerate(self.cores):
            selected = ar_held & (r_core == i)
            m.d.comb += [core.araddr.eq(r_offset), core.arprot.eq(r_prot),
                         core.arvalid.eq(selected & ~ar_sent)]
            with m.If(core.arvalid & core.arready):
                m.d.sync += ar_sent.eq(1)
            with m.If(selected):
                m.d.comb += [bus.rvalid.eq(ar_sent & core.rvalid), bus.rdata.eq(core.rdata),
                             bus.rresp.eq(core.rresp), core.rready.eq(ar_sent & bus.rready)]
        if self.count < 1 << self.index_bits:
            with m.If(ar_held & (r_core >= self.count)):
                m.d.comb += [bus.rvalid.eq(1), bus.rresp.eq(AxiResp.DECERR)]
        with m.If(bus.rvalid & bus.rready):
            m.d.sync += [ar_held.eq(0), ar_sent.eq(0)]
        return m


class DraftCores(wiring.Component):
    """``config.draft_cores`` draft engines behind one register port and the card's memory
    ports (see the module docstring).

    Parameters
    ----------
    config : EngineConfig
        Every core's configuration; ``draft_cores`` says how many.
    data_width : int, optional
        Width of each memory port (default ``config.mem_port_bits``), as for
        :class:`~dfvg_hw.engine.DraftEngine`.

    Members
    -------
    s_axil_awaddr … s_axil_rready : In/Out
        AXI4-Lite slave: core ``i``'s register file at ``i << register_space_bits()``.
    m_axi_awaddr … m_axi_rready : Out/In
        AXI4 master into device memory, every core's port merged; with ``mem_ports`` > 1,
        ``m00_axi_*`` … one per memory port (:attr:`axi_prefixes`).
    irq : Out(draft_cores)
        Bit ``i``: core ``i``'s completion interrupt.

    Attributes
    ----------
    cores : list of DraftEngine
    windows : CoreWindows or None
        The register-window decoder (None with one core).
    arbiter : AXI4Arbiter
    axil : AXI4LiteSignature
        The register port's signature (master side).
    axi : AXI4Signature
        Each memory master's signature.
    axi_prefixes : list of str
        The memory masters' flat name prefixes, port by port.
    data_width : int
        Each memory port's width in bits.
    """

    def __init__(self, config: EngineConfig, data_width: int | None = None):
        self.config = config
        count = config.draft_cores
        self.cores = [DraftEngine(config, data_width) for _ in range(count)]
        first = self.cores[0]
        self.data_width, self.axi, self.axi_prefixes = first.data_width, first.axi, first.axi_prefixes
        self.windows = CoreWindows(count, register_space_bits()) if count > 1 else None
        self.axil = first.axil if self.windows is None else AXI4LiteSignature(self.windows.addr_width)
        self.arbiter = AXI4Arbiter(count, ports=config.mem_ports, data_width=self.data_width,
                                   addr_width=self.axi.addr_width)
        masters = {}
        for prefix in self.axi_prefixes:
            masters.update(self.axi.flat_members(prefix))
        super().__init__(wiring.Signature({
            **prefixed_members(self.axil.flip(), AXIL_PREFIX),
            **masters,
            "irq": Out(count),
        }))

    def elaborate(self, platform):
        m = Module()
        arbiter = m.submodules.arbiter = self.arbiter
        for i, core in enumerate(self.cores):
            m.submodules[f"core{i}"] = core
            for p, prefix in enumerate(self.axi_prefixes):
                connect_flat(m, arbiter.masters[i][p], core, prefix)
        for p, prefix in enumerate(self.axi_prefixes):
            connect_flat(m, arbiter.axi[p], self, prefix)

        if self.windows is None:
            inner = self.cores[0]
            for name, member in self.axil.members.items():
                outer, port = getattr(self, AXIL_PREFIX + name), getattr(inner, AXIL_PREFIX + name)
                m.d.comb += port.eq(outer) if member.flow == Out else outer.eq(port)
        else:
            windows = m.submodules.windows = self.windows
            connect_prefixed(m, self, AXIL_PREFIX, windows.bus)
            for core, window in zip(self.cores, windows.cores):
                # the window is the core's master: its outputs drive the core's inputs
                connect_prefixed(m, core, AXIL_PREFIX, window)
        m.d.comb += self.irq.eq(Cat(*(core.irq for core in self.cores)))
        return m


def estimate(config: EngineConfig, core: dict | None = None, *, timeout: int = 4 * 3600) -> dict:
    """Yosys estimate (``synth_xilinx -family xcup``: LUT, FF, DSP, BRAM, URAM, LUTRAM,
    CARRY) of ``DraftCores(config)``.

    With ``core`` None the whole component is synthesised (the cores, the arbiters and
    the decoder; minutes at ``tiny``). At a board preset, where one core takes Yosys
    hours (``python -m dfvg_hw.build --estimate``), pass that core's counts: the estimate
    is then ``draft_cores · core`` plus the arbiters and the decoder, synthesised on their
    own (they do not depend on the core's size, only on the core count, the memory ports
    and their width).
    """
    from dfvg_hw.synthesis import yosys_resources
    from dfvg_hw.verilog import to_verilog

    if core is None:
        return yosys_resources(to_verilog(DraftCores(config), "dfvg_cores", for_fpga=True),
                               "dfvg_cores", timeout=timeout)
    total = {k: config.draft_cores * v for k, v in core.items()}
    if config.draft_cores == 1:
        return total
    parts = [AXI4Arbiter(config.draft_cores, ports=config.mem_ports, data_width=config.mem_port_bits),
             CoreWindows(config.draft_cores, register_space_bits())]
    for part in parts:
        counts = yosys_resources(to_verilog(part, "part", for_fpga=True), "part", timeout=timeout)
        total = {k: total.get(k, 0) + counts.get(k, 0) for k in set(total) | set(counts)}
    return total
