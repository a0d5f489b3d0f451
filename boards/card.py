"""What every PCIe card platform records: part, pins, PCIe link, memory system, capacity.

A card is an Amaranth :class:`~amaranth.vendor.XilinxPlatform` subclass with
:class:`CardPlatform` mixed in: the platform's ``resources`` hold the card's pins (from the
vendor's master XDC, or from an ``amaranth-boards`` platform that already has them), and
the mixin adds what the Vivado block design needs, which a pin list does not say: the PCIe
link and its XDMA settings, the memory controllers, the clock that feeds the engine's clock
generator, the engine preset the card pairs with, and the part's capacity for
``--estimate``. :meth:`CardPlatform.board_pins` names the top-level ports the flow uses and
the resource (or resource subsignal) each one's pins come from, so :mod:`boards.vivado`
writes the XDC from the platform and a pin is written down once.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from amaranth.build import DiffPairs, Pins, Resource

__all__ = ["CardPlatform", "BoardPin", "PartCapacity", "PcieLink", "MemorySystem",
           "HBM", "DDR4", "DDR3", "ULTRASCALE_PLUS", "SERIES7"]

HBM = "HBM"
DDR4 = "DDR4"
DDR3 = "DDR3"
#: PCIe hard-block families, as the XDMA IP differs between them.
ULTRASCALE_PLUS = "UltraScale+"
SERIES7 = "7-series"


@dataclass(frozen=True)
class PartCapacity:
    """Programmable-logic resources of an FPGA part, for the ``--estimate`` table.

    Attributes
    ----------
    lut, ff, dsp, bram36, uram : int
        LUTs, flip-flops, DSP slices, 36 Kb block RAMs, 288 Kb UltraRAMs (0 on parts
        without URAM).
    source : str
        The data sheet the numbers come from.
    """
    lut: int
    ff: int
    dsp: int
    bram36: int
    uram: int
    source: str

    #: Row order and labels of :meth:`table`; keys match ``dfvg_hw.synthesis.yosys_resources``.
    ROWS = (("LUT", "lut"), ("FF", "ff"), ("DSP", "dsp"), ("BRAM", "bram36"), ("URAM", "uram"))

    def table(self, used: dict[str, float]) -> str:
        """A text table of ``used`` (keys LUT, FF, DSP, BRAM, URAM) against this capacity."""
        lines = [f"{'resource':<8} {'used':>10} {'available':>10} {'util':>7}"]
        for label, attr in self.ROWS:
            have = getattr(self, attr)
            count = used.get(label, 0)
            util = f"{100.0 * count / have:>6.2f}%" if have else ("     -" if not count else "  none!")
            lines.append(f"{label:<8} {count:>10g} {have:>10} {util}")
        return "\n".join(lines)


@dataclass(frozen=True)
class PcieLink:
    """The card's PCIe edge connector as the XDMA IP sees it.

    Attributes
    ----------
    lanes : int
        Link width.
    gen : int
        PCIe generation the XDMA is configured for (2: 5 GT/s, 3: 8 GT/s per lane).
    block : str or None
        ``CONFIG.pcie_blk_locn`` of the XDMA IP: the PCIe hard block wired to the
        connector's lanes. ``None`` leaves the IP's default for the part.
    quad : str or None
        ``CONFIG.select_quad``: the first GT quad of the lanes. ``None`` leaves the default.
    refclk : str
        Board-pin name (:meth:`CardPlatform.board_pins`) of the 100 MHz reference clock.
    perst : str
        Board-pin name of the connector's active-low PERST#.
    family : str
        :data:`ULTRASCALE_PLUS` (PCIE4C: the refclk buffer feeds ``sys_clk_gt`` and
        ``sys_clk``) or :data:`SERIES7` (PCIE_2_1: the buffer feeds ``sys_clk`` only).
    axi_data_width, axi_mhz : int, float
        The XDMA's AXI bus: wide and fast enough to carry the link (Gen3 x16: 512 bits at
        250 MHz; Gen2 x4: 128 bits at 125 MHz).
    device_id : str
        ``pf0_device_id``: the XDMA default for the link, which AMD's ``xdma`` driver lists.
    clkreq : str or None
        Board-pin name of an M.2 CLKREQ#, driven low (refclk wanted) by the block design.
    gt_sites : tuple of (int, str)
        (XDMA pipe-lane index, GT channel site) pairs that override the IP's GT placement,
        for cards whose lane wiring differs from the IP's default (``()`` keeps it).
    """
    lanes: int
    gen: int
    block: str | None
    quad: str | None
    refclk: str = "pcie_refclk"
    perst: str = "pcie_perst_n"
    family: str = ULTRASCALE_PLUS
    axi_data_width: int = 512
    axi_mhz: float = 250.0
    device_id: str = "903F"
    clkreq: str | None = None
    gt_sites: tuple[tuple[int, str], ...] = ()

    @property
    def link_speed(self) -> str:
        """``pl_link_cap_max_link_speed`` of the XDMA IP."""
        return {1: "2.5_GT/s", 2: "5.0_GT/s", 3: "8.0_GT/s", 4: "16.0_GT/s"}[self.gen]


@dataclass(frozen=True)
class MemorySystem:
    """Device memory behind the engine and the DMA engine.

    Attributes
    ----------
    kind : str
        :data:`HBM` (one HBM controller IP for both stacks), :data:`DDR4` (one DDR4
        controller IP per channel) or :data:`DDR3` (one MIG 7-series controller).
    channels : int
        DDR channels, or HBM stacks.
    bytes_per_channel : int
        Capacity of one channel (stack).
    refclks : tuple of str
        Board-pin names of the memory reference clocks: one for HBM (it drives both stacks'
        ``HBM_REF_CLK``), one per channel for DDR4 and DDR3.
    refclk_mhz : float
        Their frequency.
    board_interfaces : tuple of str
        For DDR4, the board-file interface of each channel's pins (``ddr4_sdram_c0`` …):
        the DDR4 IP takes its ~120 pin locations per channel from the card's Vivado board
        file, so they are not repeated in the generated XDC.
    cattrip : str or None
        Board-pin name of the HBM catastrophic-temperature output to the card's
        satellite controller (HBM cards only).
    mig : object or None
        For DDR3, the MIG 7-series settings (:class:`boards.mig7.Mig7Ddr3`): its pins come
        from the platform's ``ddr3`` resource through the MIG project file.
    pseudo_channels : int
        HBM only: the pseudo-channels of both stacks together (32 on the XCU55C and
        XCU280), each with its own AXI slave port ``SAXI_00`` … ``SAXI_31`` and its own
        ``total_bytes / pseudo_channels`` of memory.
    port_bits : int
        Data width of one AXI slave port of the controller: 256 for an HBM pseudo-channel
        (PG276), 512 for a DDR4 controller's ``C0_DDR4_S_AXI`` (PG150). 0: not recorded.
    port_max_mhz : float
        The fastest AXI clock the controller's ports take: 450 MHz for HBM (PG276; 256 bits
        at 450 MHz = 14.4 GB/s, one pseudo-channel's peak), and for DDR4 the UI clock it
        runs its AXI port from (300 MHz at 2400 MT/s, a quarter of the memory clock).
    """
    kind: str
    channels: int
    bytes_per_channel: int
    refclks: tuple[str, ...]
    refclk_mhz: float
    board_interfaces: tuple[str, ...] = ()
    cattrip: str | None = None
    mig: object = None
    pseudo_channels: int = 0
    port_bits: int = 0
    port_max_mhz: float = 0.0

    @property
    def total_bytes(self) -> int:
        return self.channels * self.bytes_per_channel

    @property
    def slave_ports(self) -> int:
        """AXI slave ports of the memory system: pseudo-channels for HBM, else channels."""
        return self.pseudo_channels if self.kind == HBM else self.channels

    @property
    def port_span_bytes(self) -> int:
        """Memory behind one slave port (an HBM pseudo-channel, a DDR channel)."""
        return self.total_bytes // self.slave_ports

    @property
    def hbm_8high(self) -> bool:
        """Whether the HBM stacks are 8-high (8 GiB each, the XCU55C's): the HBM IP then
        names its ports ``SAXI_00_8HI`` …; 4-high stacks (4 GiB, the XCU280's) ``SAXI_00`` …"""
        return self.kind == HBM and self.bytes_per_channel >= 8 << 30


@dataclass(frozen=True)
class BoardPin:
    """One top-level port of the block design and the platform pins behind it.

    Attributes
    ----------
    name : str
        Port name: a differential clock is a ``diff_clock`` interface port, which the
        wrapper spells ``<name>_clk_p`` / ``_clk_n``; a GT lane group is part of the
        ``pcie_mgt`` interface (``pcie_mgt_rxp[i]`` …).
    io : DiffPairs or Pins
        The platform's pins.
    iostandard : str or None
        ``None`` for GT pins (reference clocks and lanes enter a transceiver quad).
    clock_hz : float or None
        Frequency of a clock input.
    attrs : dict
        Further XDC properties (``PULLUP``).
    """
    name: str
    io: object
    iostandard: str | None = None
    clock_hz: float | None = None
    attrs: dict = field(default_factory=dict)

    @property
    def is_diff_clock(self) -> bool:
        return isinstance(self.io, DiffPairs) and self.clock_hz is not None

    def ports(self) -> list[tuple[str, str]]:
        """(top-level port, package pin) for every pin."""
        if self.is_diff_clock:
            return [(f"{self.name}_clk_p", self.io.p.names[0]), (f"{self.name}_clk_n", self.io.n.names[0])]
        if isinstance(self.io, DiffPairs):        # GT lanes: pcie_mgt_rxp[i] / _rxn[i]
            return [(f"{{{self.name}p[{i}]}}", p) for i, p in enumerate(self.io.p.names)] + \
                   [(f"{{{self.name}n[{i}]}}", n) for i, n in enumerate(self.io.n.names)]
        if len(self.io.names) == 1:
            return [(self.name, self.io.names[0])]
        return [(f"{{{self.name}[{i}]}}", p) for i, p in enumerate(self.io.names)]


def _iostandard(attrs) -> str | None:
    # amaranth-boards spells the key both ways (nitefury's ddr3 rst says IOStandard).
    return attrs.get("IOSTANDARD", attrs.get("IOStandard"))


class CardPlatform:
    """Mixin for a card's :class:`~amaranth.vendor.XilinxPlatform`.

    Members
    -------
    name : str
        Board name as ``--board`` takes it.
    preset : str
        The :mod:`dfvg_hw.spec.config` preset this card's bitstream is built from.
    board_part : str
        Vivado board-part pattern; the flow picks the newest installed version. Required
        only where the memory controller uses board-file pins.
    pcie : PcieLink
    memory : MemorySystem
    fabric_clock : str or None
        Board-pin name of the free-running clock that feeds the engine's clock generator;
        ``None`` where the only board clock belongs to the memory controller, whose user
        clock then feeds it.
    capacity : PartCapacity
    xdc_source : str
        Where the pin locations come from.
    """

    name: str
    preset: str
    board_part: str = ""
    pcie: PcieLink
    memory: MemorySystem
    fabric_clock: str | None
    capacity: PartCapacity
    xdc_source: str
    #: Configuration-bank voltage written to the XDC (``CONFIG_VOLTAGE``).
    config_voltage: str = "1.8"

    @property
    def part(self) -> str:
        """The full part name, as Vivado's ``-part`` takes it."""
        return self._part

    @property
    def memory_kind(self) -> str:
        return self.memory.kind

    def resource(self, name: str) -> Resource:
        """The resource called ``name`` (number 0)."""
        return self.lookup(name, 0)

    def board_pins(self) -> list[BoardPin]:
        """The block design's top-level ports with their pins.

        By default every resource is one port of the same name (the Alveo platforms list
        only the pins the flow uses); a platform with more resources than that overrides it.
        """
        pins = []
        for (name, _), res in self.resources.items():
            io = res.ios[0]
            if isinstance(io, (DiffPairs, Pins)):
                pins.append(BoardPin(name, io, _iostandard(res.attrs),
                                     res.clock.frequency if res.clock else None,
                                     {k: v for k, v in res.attrs.items() if k == "PULLUP"}))
        return pins

    def board_pin(self, name: str) -> BoardPin:
        for pin in self.board_pins():
            if pin.name == name:
                return pin
        raise KeyError(f"board {self.name}: no board pin {name!r}")

    def clock_mhz(self, name: str) -> float:
        """Frequency of the clock board pin ``name`` in MHz."""
        return self.board_pin(name).clock_hz / 1e6

    def describe(self) -> str:
        """One line: card, part, memory and preset."""
        gib = self.memory.total_bytes / (1 << 30)
        return (f"{self.name}: {self.part}, {gib:g} GiB {self.memory.kind}, PCIe Gen{self.pcie.gen} "
                f"x{self.pcie.lanes}, engine preset {self.preset}")
