"""Alveo U55C: XCU55C, 16 GiB HBM2 in two stacks, PCIe Gen3 x16 — the default ``--board alveo``.

Pin sources (AMD's master XDC for the U55C/U55N card, read as reproduced in public
repositories; the U55C and U55N share the board):

* ``PCIE_REFCLK1_P/N`` AR15/AR14 (MGTREFCLK0 of quad 225, the refclk for x16), and
  ``PCIE_PERST_LS_65`` BF41, LVCMOS18 (bank 65, ``IO_T3U_N12_PERSTN0_65``);
* ``SYSCLK2_P/N`` BK10/BL10, LVDS, 100 MHz (bank 68) — the clock designs on this card
  feed to the HBM reference input;
* ``SYSCLK3_P/N`` BK43/BK44, LVDS, 100 MHz (bank 65) — a second, free 100 MHz clock;
* ``HBM_CATTRIP_LS`` BE45, LVCMOS18: must be driven low while the HBM is not overheating,
  or the satellite controller cuts the card's power.

All five agree with the ``U55N - Master XDC`` header (its clock-tree table lists the same
package pins) and with the FPGA-Ninja/Corundum U55C constraints.
"""

from amaranth.build import Attrs, Clock, DiffPairs, Pins, Resource

from boards.alveo import HBM, AlveoPlatform, MemorySystem, PartCapacity, PcieLink

__all__ = ["AlveoU55CPlatform"]

GiB = 1 << 30


class AlveoU55CPlatform(AlveoPlatform):
    name = "alveo-u55c"
    preset = "alveo-u55c"
    device = "xcu55c"
    package = "fsvh2892"
    speed = "2L-e"
    board_part = "xilinx.com:au55c:part0:*"
    default_clk = "sysclk3"
    fabric_clock = "sysclk3"
    # The x16 lanes occupy GTY quads 224-227 next to the PCIE4C hard block X1Y0; the
    # Vitis shells and open-source XDMA designs for this card place the XDMA there.
    pcie = PcieLink(lanes=16, gen=3, block="PCIE4C_X1Y0", quad="GTY_Quad_227")
    # Two 8-high stacks of 8 GiB: 32 pseudo-channels of 512 MiB, each behind its own
    # 256-bit AXI port that takes up to 450 MHz (PG276; 32 x 14.4 GB/s = 460 GB/s, DS978).
    memory = MemorySystem(kind=HBM, channels=2, bytes_per_channel=8 * GiB,
                          refclks=("hbm_refclk",), refclk_mhz=100.0, cattrip="hbm_cattrip",
                          pseudo_channels=32, port_bits=256, port_max_mhz=450.0)
    # DS978 (Alveo U55C data sheet), table "Alveo U55C card": 1,304K LUTs, 2,607K
    # registers, 9,024 DSP slices, 2,016 block RAMs (70.9 Mb), 960 UltraRAMs (270 Mb).
    capacity = PartCapacity(lut=1_303_680, ff=2_607_360, dsp=9_024, bram36=2_016, uram=960,
                            source="AMD DS978, Alveo U55C data sheet")
    xdc_source = "AMD U55C/U55N master XDC (see boards/alveo_u55c.py)"
    resources = [
        Resource("pcie_refclk", 0, DiffPairs("AR15", "AR14", dir="i"), Clock(100e6)),
        Resource("pcie_perst_n", 0, Pins("BF41", dir="i"), Attrs(IOSTANDARD="LVCMOS18")),
        Resource("hbm_refclk", 0, DiffPairs("BK10", "BL10", dir="i"), Clock(100e6),
                 Attrs(IOSTANDARD="LVDS")),
        Resource("sysclk3", 0, DiffPairs("BK43", "BK44", dir="i"), Clock(100e6),
                 Attrs(IOSTANDARD="LVDS")),
        Resource("hbm_cattrip", 0, Pins("BE45", dir="o"), Attrs(IOSTANDARD="LVCMOS18")),
    ]
