"""Alveo U250: XCU250, 64 GiB DDR4 in four 16 GiB channels, PCIe Gen3 x16.

Pin sources (AMD's ``AU200/250 - Master XDC`` revision 2.04, alveo-u250-xdc; the U200
and U250 are pin compatible):

* ``PEX_REFCLK_C_P/N`` AM11/AM10 (MGTREFCLK0 of quad 226), and ``PCIE_PERST_LS`` BD21,
  LVCMOS12 (bank 64, 1.2 V);
* ``SYSCLK0_300`` … ``SYSCLK3_300``, 300 MHz, one per DDR4 controller: AY37/AY38,
  AW20/AW19, F32/E32, J16/H16. The XDC gives DIFF_POD12_DCI for 0, 2 and 3 (they sit in
  the 1.2 V DDR4 banks) and LVDS for 1 (bank 64);
* ``USER_SI570_CLOCK_P/N`` AU19/AV19, LVDS, 156.25 MHz by default (re-programmable) —
  a free clock for the engine's clock generator.

The DDR4 data, address and control pins (about 120 per channel) come from the card's
Vivado board file through the DDR4 IP's board interfaces ``ddr4_sdram_c0`` … ``c3``.

The XDMA's PCIe hard-block location is left at the IP's default for the part: no
published source seen here states it for this card, so it is not guessed.
"""

from amaranth.build import Attrs, Clock, DiffPairs, Pins, Resource

from boards.alveo import DDR4, AlveoPlatform, MemorySystem, PartCapacity, PcieLink

__all__ = ["AlveoU250Platform"]

GiB = 1 << 30


class AlveoU250Platform(AlveoPlatform):
    name = "alveo-u250"
    preset = "alveo-u250"
    device = "xcu250"
    package = "figd2104"
    speed = "2L-e"
    board_part = "xilinx.com:au250:part0:*"
    default_clk = "si570_clock"
    fabric_clock = "si570_clock"
    pcie = PcieLink(lanes=16, gen=3, block=None, quad=None)
    memory = MemorySystem(kind=DDR4, channels=4, bytes_per_channel=16 * GiB,
                          refclks=tuple(f"ddr4_c{i}_sysclk" for i in range(4)), refclk_mhz=300.0,
                          board_interfaces=tuple(f"ddr4_sdram_c{i}" for i in range(4)),
                          # DDR4-2400 x72 per channel: the controller's AXI port is 512 bits
                          # at its 300 MHz UI clock (PG150), 19.2 GB/s each, 77 GB/s in all.
                          port_bits=512, port_max_mhz=300.0)
    # DS962 (Alveo U200 and U250 data sheet), U250 column: 1,728K LUTs, 3,456K
    # registers, 12,288 DSP slices, 2,688 block RAMs (94.5 Mb), 1,280 UltraRAMs (360 Mb).
    capacity = PartCapacity(lut=1_728_000, ff=3_456_000, dsp=12_288, bram36=2_688, uram=1_280,
                            source="AMD DS962, Alveo U200 and U250 data sheet")
    xdc_source = "AMD AU200/250 master XDC rev 2.04 (see boards/alveo_u250.py)"
    resources = [
        Resource("pcie_refclk", 0, DiffPairs("AM11", "AM10", dir="i"), Clock(100e6)),
        Resource("pcie_perst_n", 0, Pins("BD21", dir="i"), Attrs(IOSTANDARD="LVCMOS12")),
        *[Resource(f"ddr4_c{i}_sysclk", 0, DiffPairs(p, n, dir="i"), Clock(300e6),
                   Attrs(IOSTANDARD=std))
          for i, (p, n, std) in enumerate([("AY37", "AY38", "DIFF_POD12_DCI"),
                                           ("AW20", "AW19", "LVDS"),
                                           ("F32", "E32", "DIFF_POD12_DCI"),
                                           ("J16", "H16", "DIFF_POD12_DCI")])],
        Resource("si570_clock", 0, DiffPairs("AU19", "AV19", dir="i"), Clock(156.25e6),
                 Attrs(IOSTANDARD="LVDS")),
    ]
