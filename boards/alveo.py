"""What every Alveo board platform records: part, pins, PCIe link, memory system, capacity.

Each card is an Amaranth :class:`~amaranth.vendor.XilinxPlatform` subclass (one file per
card in this package). Its ``resources`` are the card's reference-clock, PCIe and status
pins, taken from AMD's published master XDC for the card; the XDC that the build writes
is generated from these resources (:mod:`boards.vivado`), so a pin is written down once.

The engine itself has no pins: on a card it sits behind the XDMA PCIe bridge and a memory
controller inside a Vivado block design. The platform therefore also records what that
block design needs: the PCIe link and where its hard block sits, the memory controllers
and their reference clocks, the clock that feeds the engine's clock generator, the engine
preset the card pairs with, and the part's resource capacity for ``--estimate``.
"""

from __future__ import annotations

from dataclasses import dataclass

from amaranth.build import Resource
from amaranth.vendor import XilinxPlatform

__all__ = ["AlveoPlatform", "PartCapacity", "PcieLink", "MemorySystem", "HBM", "DDR4"]

HBM = "HBM"
DDR4 = "DDR4"


@dataclass(frozen=True)
class PartCapacity:
    """Programmable-logic resources of an FPGA part, for the ``--estimate`` table.

    Attributes
    ----------
    lut, ff, dsp, bram36, uram : int
        CLB LUTs, CLB flip-flops, DSP48E2 slices, 36 Kb block RAMs, 288 Kb UltraRAMs.
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
            lines.append(f"{label:<8} {count:>10g} {have:>10} {100.0 * count / have:>6.2f}%")
        return "\n".join(lines)


@dataclass(frozen=True)
class PcieLink:
    """The card's PCIe edge connector as the XDMA IP sees it.

    Attributes
    ----------
    lanes : int
        Link width (16 on every Alveo card here).
    gen : int
        PCIe generation the XDMA is configured for (3: 8 GT/s per lane).
    block : str or None
        ``CONFIG.pcie_blk_locn`` of the XDMA IP: the PCIe hard block wired to the
        connector's lanes. ``None`` leaves the IP's default for the part.
    quad : str or None
        ``CONFIG.select_quad``: the first GTY quad of the lanes. ``None`` leaves the default.
    refclk : str
        Resource name of the 100 MHz reference clock from the connector.
    perst : str
        Resource name of the connector's active-low PERST# reset.
    """
    lanes: int
    gen: int
    block: str | None
    quad: str | None
    refclk: str = "pcie_refclk"
    perst: str = "pcie_perst_n"


@dataclass(frozen=True)
class MemorySystem:
    """Device memory behind the engine and the DMA engine.

    Attributes
    ----------
    kind : str
        :data:`HBM` (one HBM controller IP for both stacks) or :data:`DDR4` (one DDR4
        controller IP per channel).
    channels : int
        DDR4 channels, or HBM stacks.
    bytes_per_channel : int
        Capacity of one channel (stack).
    refclks : tuple of str
        Resource names of the memory reference clocks: one for HBM (it drives both stacks'
        ``HBM_REF_CLK``), one per channel for DDR4.
    refclk_mhz : float
        Their frequency.
    board_interfaces : tuple of str
        For DDR4, the board-file interface of each channel's pins (``ddr4_sdram_c0`` …):
        the DDR4 IP takes its ~120 pin locations per channel from the card's Vivado board
        file, so they are not repeated in the generated XDC.
    cattrip : str or None
        Resource name of the HBM catastrophic-temperature output to the card's
        satellite controller (HBM cards only).
    """
    kind: str
    channels: int
    bytes_per_channel: int
    refclks: tuple[str, ...]
    refclk_mhz: float
    board_interfaces: tuple[str, ...] = ()
    cattrip: str | None = None

    @property
    def total_bytes(self) -> int:
        return self.channels * self.bytes_per_channel


class AlveoPlatform(XilinxPlatform):
    """Common base of the Alveo card platforms.

    Members
    -------
    name : str
        Board name as ``--board`` takes it (``alveo-u55c`` …).
    preset : str
        The :mod:`dfvg_hw.spec.config` preset this card's bitstream is built from.
    board_part : str
        Vivado board-part pattern (``xilinx.com:au55c:part0:*``); the flow picks the newest
        installed version. Required only where the memory controller uses board-file pins.
    pcie : PcieLink
    memory : MemorySystem
    fabric_clock : str
        Resource name of the free-running clock that feeds the engine's clock generator.
    capacity : PartCapacity
    xdc_source : str
        Where the pin locations come from.
    """

    toolchain = "Vivado"
    name: str
    preset: str
    board_part: str
    pcie: PcieLink
    memory: MemorySystem
    fabric_clock: str
    capacity: PartCapacity
    xdc_source: str
    resources: list[Resource] = []
    connectors: list = []

    def __init__(self):
        super().__init__(toolchain="Vivado")

    @property
    def part(self) -> str:
        """The full part name, as Vivado's ``-part`` takes it."""
        return self._part

    @property
    def memory_kind(self) -> str:
        return self.memory.kind

    def resource(self, name: str) -> Resource:
        """The resource called ``name`` (number 0); every board pin here has one instance."""
        return self.lookup(name, 0)

    def clock_mhz(self, name: str) -> float:
        """Frequency of the clock resource ``name`` in MHz."""
        return self.resource(name).clock.frequency / 1e6

    def describe(self) -> str:
        """One line: card, part, memory and preset."""
        gib = self.memory.total_bytes / (1 << 30)
        return (f"{self.name}: {self.part}, {gib:g} GiB {self.memory.kind}, PCIe Gen{self.pcie.gen} "
                f"x{self.pcie.lanes}, engine preset {self.preset}")
