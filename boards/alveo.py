"""The Alveo card platforms' common base (what every card records is in :mod:`boards.card`).

Each card is an Amaranth :class:`~amaranth.vendor.XilinxPlatform` subclass (one file per
card in this package), in amaranth-boards' style. Its ``resources`` are the card's reference-clock, PCIe and status
pins, taken from AMD's published master XDC for the card; the XDC that the build writes
is generated from these resources (:mod:`boards.vivado`), so a pin is written down once.

The engine itself has no pins: on a card it sits behind the XDMA PCIe bridge and a memory
controller inside a Vivado block design. The platform therefore also records what that
block design needs: the PCIe link and where its hard block sits, the memory controllers
and their reference clocks, the clock that feeds the engine's clock generator, the engine
preset the card pairs with, and the part's resource capacity for ``--estimate``.
"""

from __future__ import annotations

from amaranth.build import Resource
from amaranth.vendor import XilinxPlatform

from boards.card import DDR4, HBM, CardPlatform, MemorySystem, PartCapacity, PcieLink

__all__ = ["AlveoPlatform", "PartCapacity", "PcieLink", "MemorySystem", "HBM", "DDR4"]


class AlveoPlatform(CardPlatform, XilinxPlatform):
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
