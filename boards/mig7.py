"""MIG 7-series DDR3 controller settings and its project file, pins from a platform resource.

The MIG 7-series IP in a block design is configured by an XML project file (``.prj``),
not by ``CONFIG`` properties: Vivado's own ``write_bd_tcl`` writes one next to the IP and
points ``CONFIG.XML_INPUT_FILE`` at it. :func:`prj_text` writes that file with every DDR3
pin (``PinSelection``) and the system-clock pins taken from the platform's resources, so
the MIG's generated constraints place the memory where the platform says it is.

The layout of the file follows the one RHS Research's own NiteFury/LiteFury sample
project writes (github.com/RHSResearchLLC/NiteFury-and-LiteFury,
``Sample-Projects/Project-0-x1/.../hw_handoff/Top_bd.tcl``, MIG 4.1): 4:1 PHY, 400 MHz
memory clock (800 MT/s) from the 200 MHz board clock, which also serves as the IDELAY
reference ("Use System Clock"), and an AXI slave interface.
"""

from __future__ import annotations

from dataclasses import dataclass
from xml.sax.saxutils import quoteattr

from amaranth.build import DiffPairs

__all__ = ["Mig7Ddr3", "MIG_PORT_PREFIX", "mig_pins", "prj_text"]

#: Port-name prefix MIG gives the DDR3 pins (``ddr3_addr[0]`` …).
MIG_PORT_PREFIX = "ddr3_"

#: Platform ``ddr3`` subsignal → MIG pin name (without the prefix); a differential pair
#: becomes ``<name>_p`` / ``<name>_n``. The address bus keeps only ``row_bits`` pins.
_SUBSIGNALS = {"a": "addr", "ba": "ba", "ras": "ras_n", "cas": "cas_n", "we": "we_n",
               "clk": "ck", "clk_en": "cke", "odt": "odt", "rst": "reset_n", "cs": "cs_n",
               "dm": "dm", "dq": "dq", "dqs": "dqs"}
#: MIG writes these as one-element buses.
_BUS_OF_ONE = {"ck", "cke", "odt", "cs_n"}


@dataclass(frozen=True)
class Mig7Ddr3:
    """One DDR3 component behind a MIG 7-series controller.

    Attributes
    ----------
    resource : str
        The platform resource holding the DDR3 pins (``ddr3``).
    part : str
        MIG's memory-device name (``DDR3_SDRAM/Components/<part>``).
    custom_part : str or None
        A MIG custom part derived from ``part`` with these address bits and timings (as
        RHS Research's NiteFury II project does for its 8 Gb component).
    row_bits, col_bits, bank_bits : int
        Address bits of the component (an 8 Gb x16 part has 16 row bits; 4 Gb has 15).
    data_width : int
        DQ width (the platform's ``dq`` pins).
    mem_clock_mhz : float
        DDR3 clock (400 MHz: 800 MT/s, 4:1 PHY, so the UI clock is 100 MHz).
    sys_clock : str
        Board-pin name of the MIG system clock (also the IDELAY reference).
    sys_clock_bank : int
        I/O bank of that clock's pins (MIG's project file names it).
    voltage : str
        DDR3 supply (``1.5V``; the platform's SSTL15 standard).
    timing : dict
        MIG ``TimingParameters`` of the part, ns.
    cas_latency, cas_write_latency : int
    source : str
    """
    resource: str
    part: str
    row_bits: int
    col_bits: int
    bank_bits: int
    data_width: int
    mem_clock_mhz: float
    sys_clock: str
    sys_clock_bank: int
    voltage: str
    timing: tuple[tuple[str, str], ...]
    cas_latency: int = 6
    cas_write_latency: int = 5
    custom_part: str | None = None
    source: str = ""

    PHY_RATIO = 4

    @property
    def bytes(self) -> int:
        return (1 << (self.row_bits + self.col_bits + self.bank_bits)) * self.data_width // 8

    @property
    def axi_data_width(self) -> int:
        """The MIG's native AXI width: 2 × PHY ratio × DQ width (128 for x16 at 4:1)."""
        return 2 * self.PHY_RATIO * self.data_width

    @property
    def ui_clock_mhz(self) -> float:
        return self.mem_clock_mhz / self.PHY_RATIO

    @property
    def peak_gbps(self) -> float:
        """Peak bandwidth, GB/s: two transfers a memory clock of ``data_width`` bits."""
        return 2 * self.mem_clock_mhz * 1e6 * self.data_width / 8 / 1e9


def _std(attrs) -> str | None:
    return attrs.get("IOSTANDARD", attrs.get("IOStandard"))


def mig_pins(platform, mig: Mig7Ddr3) -> list[tuple[str, str, str, str]]:
    """(MIG pin name, package pin, IOSTANDARD, IN_TERM) for every DDR3 pin of ``platform``.

    The I/O standard is the subsignal's, else the resource's (``SSTL15``); a differential
    pair takes ``DIFF_`` and the resource's standard, since one bank cannot mix SSTL15 with
    the 1.35 V DIFF_SSTL135 that amaranth-boards' nitefury ``dqs`` names.
    """
    res = platform.lookup(mig.resource, 0)
    base = _std(res.attrs)
    pins = []
    for sub in res.ios:
        name = _SUBSIGNALS[sub.name]
        io = sub.ios[0]
        in_term = sub.attrs.get("IN_TERM", "")
        if isinstance(io, DiffPairs):
            std = f"DIFF_{base}"
            for suffix, names in (("_p", io.p.names), ("_n", io.n.names)):
                pins += [(f"{MIG_PORT_PREFIX}{name}{suffix}[{i}]", pad, std, in_term)
                         for i, pad in enumerate(names)]
            continue
        std = _std(sub.attrs) or base
        names = io.names[:mig.row_bits] if name == "addr" else io.names
        if len(names) == 1 and name not in _BUS_OF_ONE:
            pins.append((f"{MIG_PORT_PREFIX}{name}", names[0], std, in_term))
        else:
            pins += [(f"{MIG_PORT_PREFIX}{name}[{i}]", pad, std, in_term) for i, pad in enumerate(names)]
    return pins


def prj_text(platform, mig: Mig7Ddr3, module_name: str, axi_addr_width: int) -> str:
    """The MIG project file for ``platform``'s DDR3 resource."""
    clk = platform.board_pin(mig.sys_clock)
    period_ps = round(1e6 / mig.mem_clock_mhz)
    in_mhz = clk.clock_hz / 1e6
    fpga = f"{platform.device}-{platform.package}/-{platform.speed}"
    timing = " ".join(f"{k}={quoteattr(v)}" for k, v in mig.timing)
    pin_lines = [f'            <Pin VCCAUX_IO="" IOSTANDARD={quoteattr(std)} PADName={quoteattr(pad)} '
                 f'SLEW="" name={quoteattr(name)} IN_TERM={quoteattr(term)} />'
                 for name, pad, std, term in mig_pins(platform, mig)]
    return "\n".join([
        "<?xml version='1.0' encoding='UTF-8'?>",
        "<!-- Written by boards.mig7 from the board platform's ddr3 resource; regenerate it with "
        "python -m dfvg_hw.build rather than edit. -->",
        '<Project NoOfControllers="1" >',
        f"    <ModuleName>{module_name}</ModuleName>",
        "    <dci_inouts_inputs>1</dci_inouts_inputs>",
        "    <dci_inputs>1</dci_inputs>",
        "    <Debug_En>OFF</Debug_En>",
        "    <DataDepth_En>1024</DataDepth_En>",
        "    <LowPower_En>ON</LowPower_En>",
        "    <XADC_En>Enabled</XADC_En>",
        f"    <TargetFPGA>{fpga}</TargetFPGA>",
        "    <Version>4.2</Version>",
        "    <SystemClock>Differential</SystemClock>",
        "    <ReferenceClock>Use System Clock</ReferenceClock>",
        "    <SysResetPolarity>ACTIVE LOW</SysResetPolarity>",
        "    <BankSelectionFlag>FALSE</BankSelectionFlag>",
        "    <InternalVref>0</InternalVref>",
        "    <dci_hr_inouts_inputs>50 Ohms</dci_hr_inouts_inputs>",
        "    <dci_cascade>0</dci_cascade>",
        '    <Controller number="0" >',
        f"        <MemoryDevice>DDR3_SDRAM/Components/{mig.part}</MemoryDevice>",
        f"        <TimePeriod>{period_ps}</TimePeriod>",
        "        <VccAuxIO>1.8V</VccAuxIO>",
        f"        <PHYRatio>{mig.PHY_RATIO}:1</PHYRatio>",
        f"        <InputClkFreq>{in_mhz:g}</InputClkFreq>",
        "        <UIExtraClocks>0</UIExtraClocks>",
        f"        <MMCM_VCO>{round(2 * mig.mem_clock_mhz)}</MMCM_VCO>",
        "        <MMCMClkOut0> 1.000</MMCMClkOut0>",
        *[f"        <MMCMClkOut{i}>1</MMCMClkOut{i}>" for i in range(1, 5)],
        f"        <DataWidth>{mig.data_width}</DataWidth>",
        "        <DeepMemory>1</DeepMemory>",
        "        <DataMask>1</DataMask>",
        "        <ECC>Disabled</ECC>",
        "        <Ordering>Strict</Ordering>",
        "        <BankMachineCnt>4</BankMachineCnt>",
        f"        <CustomPart>{'TRUE' if mig.custom_part else 'FALSE'}</CustomPart>",
        f"        <NewPartName>{mig.custom_part or ''}</NewPartName>",
        f"        <RowAddress>{mig.row_bits}</RowAddress>",
        f"        <ColAddress>{mig.col_bits}</ColAddress>",
        f"        <BankAddress>{mig.bank_bits}</BankAddress>",
        f"        <MemoryVoltage>{mig.voltage}</MemoryVoltage>",
        f"        <C0_MEM_SIZE>{mig.bytes}</C0_MEM_SIZE>",
        "        <UserMemoryAddressMap>BANK_ROW_COLUMN</UserMemoryAddressMap>",
        "        <PinSelection>",
        *pin_lines,
        "        </PinSelection>",
        "        <System_Clock>",
        f'            <Pin PADName="{clk.io.p.names[0]}/{clk.io.n.names[0]}(CC_P/N)" '
        f'Bank="{mig.sys_clock_bank}" name="sys_clk_p/n" />',
        "        </System_Clock>",
        "        <System_Control>",
        '            <Pin PADName="No connect" Bank="Select Bank" name="sys_rst" />',
        '            <Pin PADName="No connect" Bank="Select Bank" name="init_calib_complete" />',
        '            <Pin PADName="No connect" Bank="Select Bank" name="tg_compare_error" />',
        "        </System_Control>",
        "        <TimingParameters>",
        f"            <Parameters {timing} />",
        "        </TimingParameters>",
        '        <mrBurstLength name="Burst Length" >8 - Fixed</mrBurstLength>',
        '        <mrBurstType name="Read Burst Type and Length" >Sequential</mrBurstType>',
        f'        <mrCasLatency name="CAS Latency" >{mig.cas_latency}</mrCasLatency>',
        '        <mrMode name="Mode" >Normal</mrMode>',
        '        <mrDllReset name="DLL Reset" >No</mrDllReset>',
        '        <mrPdMode name="DLL control for precharge PD" >Slow Exit</mrPdMode>',
        '        <emrDllEnable name="DLL Enable" >Enable</emrDllEnable>',
        '        <emrOutputDriveStrength name="Output Driver Impedance Control" >RZQ/7</emrOutputDriveStrength>',
        '        <emrMirrorSelection name="Address Mirroring" >Disable</emrMirrorSelection>',
        '        <emrCSSelection name="Controller Chip Select Pin" >Disable</emrCSSelection>',
        '        <emrRTT name="RTT (nominal) - On Die Termination (ODT)" >RZQ/4</emrRTT>',
        '        <emrPosted name="Additive Latency (AL)" >0</emrPosted>',
        '        <emrOCD name="Write Leveling Enable" >Disabled</emrOCD>',
        '        <emrDQS name="TDQS enable" >Enabled</emrDQS>',
        '        <emrRDQS name="Qoff" >Output Buffer Enabled</emrRDQS>',
        '        <mr2PartialArraySelfRefresh name="Partial-Array Self Refresh" >Full Array</mr2PartialArraySelfRefresh>',
        f'        <mr2CasWriteLatency name="CAS write latency" >{mig.cas_write_latency}</mr2CasWriteLatency>',
        '        <mr2AutoSelfRefresh name="Auto Self Refresh" >Enabled</mr2AutoSelfRefresh>',
        '        <mr2SelfRefreshTempRange name="High Temparature Self Refresh Rate" >Normal</mr2SelfRefreshTempRange>',
        '        <mr2RTTWR name="RTT_WR - Dynamic On Die Termination (ODT)" >Dynamic ODT off</mr2RTTWR>',
        "        <PortInterface>AXI</PortInterface>",
        "        <AXIParameters>",
        "            <C0_C_RD_WR_ARB_ALGORITHM>RD_PRI_REG</C0_C_RD_WR_ARB_ALGORITHM>",
        f"            <C0_S_AXI_ADDR_WIDTH>{axi_addr_width}</C0_S_AXI_ADDR_WIDTH>",
        f"            <C0_S_AXI_DATA_WIDTH>{mig.axi_data_width}</C0_S_AXI_DATA_WIDTH>",
        "            <C0_S_AXI_ID_WIDTH>4</C0_S_AXI_ID_WIDTH>",
        "            <C0_S_AXI_SUPPORTS_NARROW_BURST>0</C0_S_AXI_SUPPORTS_NARROW_BURST>",
        "        </AXIParameters>",
        "    </Controller>",
        "</Project>",
        "",
    ])
