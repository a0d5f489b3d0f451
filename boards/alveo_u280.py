"""Alveo U280: XCU280, 8 GiB HBM2 in two stacks (and 32 GiB DDR4, unused), PCIe Gen3 x16.

Pin sources (AMD's ``U280 - Master XDC`` from alveo-u280-xdc.zip, read as reproduced in
public repositories, cross-checked against the FPGA-Ninja/Corundum AU280 constraints):

* PCIe x16 refclk AR15/AR14 (MGTREFCLK0 of quad 225) and PERST# BH26, LVCMOS18 (bank 67);
* ``SYSCLK0_P/N`` BJ43/BJ44, LVDS, 100 MHz (bank 65) — used here as the HBM reference
  clock, as the TaPaSCo AU280 platform does (the card's DDR4 channel 0, which it would
  otherwise clock, is not used);
* SYSCLK2 G31/F31, LVDS, 100 MHz — a free clock for the engine's clock generator;
* HBM CATTRIP D32, LVCMOS18 (drive low; high makes the satellite controller cut power).
"""

from amaranth.build import Attrs, Clock, DiffPairs, Pins, Resource

from boards.alveo import HBM, AlveoPlatform, MemorySystem, PartCapacity, PcieLink

__all__ = ["AlveoU280Platform"]

GiB = 1 << 30


class AlveoU280Platform(AlveoPlatform):
    name = "alveo-u280"
    preset = "alveo-u280"
    device = "xcu280"
    package = "fsvh2892"
    speed = "2L-e"
    board_part = "xilinx.com:au280:part0:*"
    default_clk = "sysclk2"
    fabric_clock = "sysclk2"
    # Same package and PCIe lane placement as the U55C (quads 224-227, PCIE4C X1Y0).
    pcie = PcieLink(lanes=16, gen=3, block="PCIE4C_X1Y0", quad="GTY_Quad_227")
    # Two 4-high stacks of 4 GiB: 32 pseudo-channels of 256 MiB, each behind its own
    # 256-bit AXI port that takes up to 450 MHz (PG276; 460 GB/s in all, DS963).
    memory = MemorySystem(kind=HBM, channels=2, bytes_per_channel=4 * GiB,
                          refclks=("hbm_refclk",), refclk_mhz=100.0, cattrip="hbm_cattrip",
                          pseudo_channels=32, port_bits=256, port_max_mhz=450.0)
    # DS963 (Alveo U280 data sheet): 1,304K LUTs, 2,607K registers, 9,024 DSP slices,
    # 2,016 block RAMs (70.9 Mb), 960 UltraRAMs (270 Mb).
    capacity = PartCapacity(lut=1_303_680, ff=2_607_360, dsp=9_024, bram36=2_016, uram=960,
                            source="AMD DS963, Alveo U280 data sheet")
    xdc_source = "AMD U280 master XDC (see boards/alveo_u280.py)"
    resources = [
        Resource("pcie_refclk", 0, DiffPairs("AR15", "AR14", dir="i"), Clock(100e6)),
        Resource("pcie_perst_n", 0, Pins("BH26", dir="i"), Attrs(IOSTANDARD="LVCMOS18")),
        Resource("hbm_refclk", 0, DiffPairs("BJ43", "BJ44", dir="i"), Clock(100e6),
                 Attrs(IOSTANDARD="LVDS")),
        Resource("sysclk2", 0, DiffPairs("G31", "F31", dir="i"), Clock(100e6),
                 Attrs(IOSTANDARD="LVDS")),
        Resource("hbm_cattrip", 0, Pins("D32", dir="o"), Attrs(IOSTANDARD="LVCMOS18")),
    ]
