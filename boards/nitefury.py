"""NiteFury II and LiteFury: Artix-7 M.2 cards with PCIe Gen2 x4 and one 16-bit DDR3.

The pins are amaranth-boards' own platforms (``amaranth_boards.nitefury``:
:class:`~amaranth_boards.nitefury.NitefuryIIPlatform`, XC7A200T-FBG484, and
:class:`~amaranth_boards.nitefury.LitefuryPlatform`, XC7A100T-FGG484); the classes here
subclass them and add what the Vivado flow needs. Nothing is retyped: the block design's
ports take their pins from these platform resources:

* ``pcie``: ``clk`` F6/E6 (the 100 MHz M.2 reference clock, MGTREFCLK of the GTP quad),
  ``rst`` J1 (PERST#, LVCMOS33, pull-up), ``clkreq`` G1 (CLKREQ#, driven low), ``rx`` /
  ``tx`` the four GTP lanes (B10/A10, B8/A8, D11/C11, D9/C9 and B6/A6, B4/A4, D5/C5,
  D7/C7);
* ``clk200``: J19/H19, 200 MHz, DIFF_SSTL15 — the MIG's system clock and IDELAY
  reference, as in RHS Research's own sample projects;
* ``ddr3``: the DDR3 component's 16 address, 3 bank, 16 DQ, 2 DQS, 2 DM and control pins,
  written into the MIG project file (:mod:`boards.mig7`).

Where the platform's attributes are not what the flow should use, the flow departs from
them, and says so here: the GT reference clock and lanes get no ``IOSTANDARD`` (the
platform gives the refclk DIFF_SSTL15; GT pins take none); the DQS pairs are DIFF_SSTL15
like the rest of the 1.5 V bank (the platform says DIFF_SSTL135, which cannot share a bank
with its own SSTL15); PERST# is an input (the platform declares ``dir="o"``). The
platform's ``SPIFlash`` and ``m2led`` resources are not used (its SPI ``clk`` L16 is also
its DDR3 ``we``; on 7-series the SPI clock is CCLK, reached through STARTUPE2).

The memory and lane placement follow RHS Research's sample projects for these cards
(github.com/RHSResearchLLC/NiteFury-and-LiteFury):

* NiteFury II: ``Sample-Projects/Project-0/FPGA/Nitefury-II/.../mig_b.prj`` — 1 GiB
  (C0_MEM_SIZE 1073741824, 16 row bits, a MIG custom part MT41J512m16XX-125 derived from
  MT41J256m16XX-125), x16, 400 MHz memory clock (800 MT/s, 1.6 GB/s peak) from the 200 MHz
  clock, 128-bit AXI;
* LiteFury: ``Sample-Projects/Project-0-x1/.../Top_bd.tcl`` — MT41K256M16XX-107, 15 row
  bits, 512 MiB, the same clocking;
* the GTP channel of each XDMA pipe lane: ``Project-0/FPGA-A200T-3/src/constraints/
  uEVB-early.xdc`` ("the board wiring doesn't match the default constraints provided by IP
  integrator"), applied with the XDC processed late.
"""

from __future__ import annotations

from amaranth_boards.nitefury import LitefuryPlatform as _Litefury
from amaranth_boards.nitefury import NitefuryIIPlatform as _NitefuryII

from boards.card import DDR3, SERIES7, BoardPin, CardPlatform, MemorySystem, PartCapacity, PcieLink
from boards.mig7 import Mig7Ddr3

__all__ = ["NitefuryPlatform", "LitefuryPlatform", "M2CardPlatform"]

MiB = 1 << 20

#: XDMA pipe lane → GTP channel, from RHS Research's uEVB-early.xdc (see the module doc).
_GT_SITES = ((3, "GTPE2_CHANNEL_X0Y7"), (0, "GTPE2_CHANNEL_X0Y6"),
             (2, "GTPE2_CHANNEL_X0Y5"), (1, "GTPE2_CHANNEL_X0Y4"))

#: PCIe Gen2 x4 (5 GT/s x 4 lanes, 8b/10b: 2 GB/s): a 128-bit AXI at 125 MHz carries it.
#: 7024 is the XDMA's default device ID for Gen2 x4, in AMD's xdma driver's table.
_PCIE = PcieLink(lanes=4, gen=2, block=None, quad=None, family=SERIES7, axi_data_width=128,
                 axi_mhz=125.0, device_id="7024", clkreq="pcie_clkreq_n", gt_sites=_GT_SITES)


class M2CardPlatform(CardPlatform):
    """What the NiteFury II and LiteFury share: the amaranth-boards resources, mapped onto
    the flow's board pins."""

    # The only board clock feeds the MIG; the engine clock is made from its UI clock.
    fabric_clock = None
    pcie = _PCIE
    config_voltage = "3.3"   # CFGBVS VCCO, 3.3 V: the platform's toolchain_prepare
    xdc_source = "amaranth_boards.nitefury (RHS Research NiteFury/LiteFury sample projects)"

    def board_pins(self) -> list[BoardPin]:
        pcie = {sub.name: sub for sub in self.lookup("pcie", 0).ios}
        clk200 = self.lookup("clk200", 0)
        std = lambda sub: sub.attrs.get("IOSTANDARD")
        return [
            # PCIe CEM / M.2: the reference clock is 100 MHz (the platform leaves it out).
            BoardPin("pcie_refclk", pcie["clk"].ios[0], None, 100e6),
            BoardPin("pcie_perst_n", pcie["rst"].ios[0], std(pcie["rst"])),
            BoardPin("pcie_clkreq_n", pcie["clkreq"].ios[0], std(pcie["clkreq"])),
            BoardPin("pcie_mgt_rx", pcie["rx"].ios[0]),
            BoardPin("pcie_mgt_tx", pcie["tx"].ios[0]),
            BoardPin("clk200", clk200.ios[0], clk200.attrs.get("IOSTANDARD"), clk200.clock.frequency),
        ]


class NitefuryPlatform(M2CardPlatform, _NitefuryII):
    name = "nitefury"
    preset = "nitefury"
    memory = MemorySystem(
        kind=DDR3, channels=1, bytes_per_channel=1024 * MiB, refclks=("clk200",), refclk_mhz=200.0,
        mig=Mig7Ddr3(resource="ddr3", part="MT41J256m16XX-125", custom_part="MT41J512m16XX-125",
                     row_bits=16, col_bits=10, bank_bits=3, data_width=16, mem_clock_mhz=400.0,
                     sys_clock="clk200", sys_clock_bank=15, voltage="1.5V",
                     timing=(("tcke", "5"), ("tfaw", "40"), ("tras", "35"), ("trcd", "13.75"),
                             ("trefi", "7.8"), ("trfc", "260"), ("trp", "13.75"), ("trrd", "7.5"),
                             ("trtp", "7.5"), ("twtr", "7.5")),
                     source="RHS Research Nitefury-II sample project, mig_b.prj"))
    # DS180 (7 Series FPGAs Data Sheet: Overview), XC7A200T: 33,650 slices (4 LUTs and
    # 8 flip-flops each), 740 DSP48E1 slices, 365 36 Kb block RAMs (13,140 Kb); no URAM.
    capacity = PartCapacity(lut=134_600, ff=269_200, dsp=740, bram36=365, uram=0,
                            source="AMD DS180, 7 Series FPGAs Data Sheet: Overview (XC7A200T)")


class LitefuryPlatform(M2CardPlatform, _Litefury):
    name = "litefury"
    preset = "litefury"
    memory = MemorySystem(
        kind=DDR3, channels=1, bytes_per_channel=512 * MiB, refclks=("clk200",), refclk_mhz=200.0,
        mig=Mig7Ddr3(resource="ddr3", part="MT41K256M16XX-107", row_bits=15, col_bits=10,
                     bank_bits=3, data_width=16, mem_clock_mhz=400.0, sys_clock="clk200",
                     sys_clock_bank=15, voltage="1.5V",
                     timing=(("twtr", "7.5"), ("trrd", "6"), ("trefi", "7.8"), ("tfaw", "35"),
                             ("trtp", "7.5"), ("tcke", "5"), ("trfc", "260"), ("trp", "13.91"),
                             ("tras", "34"), ("trcd", "13.91")),
                     source="RHS Research Project-0-x1 sample project, Top_bd.tcl"))
    # DS180, XC7A100T: 15,850 slices, 240 DSP48E1 slices, 135 36 Kb block RAMs (4,860 Kb).
    capacity = PartCapacity(lut=63_400, ff=126_800, dsp=240, bram36=135, uram=0,
                            source="AMD DS180, 7 Series FPGAs Data Sheet: Overview (XC7A100T)")
