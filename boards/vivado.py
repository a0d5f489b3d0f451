"""XDC constraints and the Vivado Tcl flow that put the draft engine on a PCIe card.

The engine is a plain Verilog module (``dfvg_engine``) with a clock, an active-high reset,
an AXI4-Lite register slave, an AXI4 memory master and an interrupt output —
:class:`EngineInterface` names them. On a card it becomes a *module reference* inside a
Vivado block design::

    host ══PCIe══ XDMA ──M_AXI_LITE (BAR, 64 KiB)── SmartConnect ── engine s_axil
                    │                                              engine m_axi ──┐
                    └──M_AXI (DMA H2C/C2H)── SmartConnect ──┬── HBM / DDR4 / DDR3 ◄┘
                  usr_irq_req ◄── engine irq

That is a one-port engine. An engine with several memory masters (``mem_ports``; issue #14)
gets one path per master instead, to its own controller port and nothing else
(:func:`memory_links`, :func:`host_path`)::

    engine m00_axi ── mem_sc_00 (2:1) ── HBM SAXI_00 ─┐   512 bits @ engine clock in,
    XDMA M_AXI ──────────┘                             │   256 bits @ 450 MHz AXI3 out;
    engine m01_axi ── mem_sc_01 (1:1) ── HBM SAXI_01   │   master p's address space holds
    …                                                  │   pseudo-channel p only (DECERR
    engine m31_axi ── mem_sc_31 (1:1) ── HBM SAXI_31   │   elsewhere); the host reaches all
                                                       └── 32 through the HBM's switch

    XDMA M_AXI ── host_sc (1:4) ─┬─ mem_sc_00 (2:1) ◄── engine m00_axi ── DDR4 c0   (U250)
                                 └─ …                                   … DDR4 c3

One generator serves every card: the Alveo cards (UltraScale+ XDMA, Gen3 x16; HBM or
DDR4) and the Artix-7 M.2 cards of :mod:`boards.nitefury` (7-series XDMA, Gen2 x4; one
DDR3 behind MIG 7-series, whose pins go into a MIG project file written beside the XDC).
The PCIe block and the memory system are the parts that differ; the board platform says
which (:class:`boards.card.PcieLink`, :class:`boards.card.MemorySystem`).

:func:`xdc_text` writes the card's pins from the board platform's resources, and
:func:`tcl_flow` writes a Tcl script in numbered steps (one ``proc`` each): project and part,
sources, block design, XDMA, memory controller(s), clocking and reset, the engine,
connections, address map, validation and wrapper, then synthesis, implementation and the
bitstream. :func:`write_flow` puts both beside the engine's Verilog; ``vivado -mode batch
-source build.tcl`` in that directory runs it (:func:`vivado_command`, :func:`run_flow`).

Nothing here needs Vivado; the tests run the Tcl under ``tclsh`` against stub commands.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

from boards.card import DDR3, DDR4, HBM, SERIES7, CardPlatform
from boards.mig7 import prj_text
from dfvg_hw.axi4 import master_prefix
from dfvg_hw.spec.regmap import register_space_bits

__all__ = ["EngineInterface", "MemoryLink", "HostPath", "memory_links", "host_path",
           "register_space_bits", "xdc_text", "tcl_flow", "write_flow", "FlowFiles",
           "vivado_command", "run_flow", "TCL_NAME", "PROGRESS_PREFIX"]

#: Name of the flow script in the build tree.
TCL_NAME = "build.tcl"
#: Every progress line the flow prints starts with this.
PROGRESS_PREFIX = "dfvg:"
#: Size of the XDMA AXI-Lite BAR that carries the register file (the smallest block-design
#: address range is 4 KiB; 64 KiB leaves room for the register map to grow).
REGISTER_BAR_KIB = 64
#: XDMA user-interrupt line the engine's ``irq`` drives (``/dev/xdma0_events_0``).
USER_IRQ = 0


@dataclass(frozen=True)
class EngineInterface:
    """The engine's top-level ports, as the block design wires them.

    Attributes
    ----------
    verilog_files : tuple of str
        The engine's Verilog, relative to the build directory.
    clock_mhz : float
        Target engine clock (``EngineConfig.clock_mhz``); the flow's clock generator makes it.
    top : str
        Verilog module name, referenced by the block design.
    clock, reset : str
        Clock input and its synchronous, active-high reset (Amaranth's ``clk``/``rst``).
    axil_prefix : str
        Prefix of the AXI4-Lite slave ports (``s_axil_awaddr`` …), the register file.
    axil_addr_width : int
        Its address width: the register space (:func:`register_space_bits`).
    axi_prefix : str
        Prefix of the AXI4 master ports (``m_axi_araddr`` …) into device memory of a
        one-port engine; an engine with several ports names them
        :func:`dfvg_hw.axi4.master_prefix` (``m00_axi_``, ``m01_axi_`` …), see
        :attr:`axi_prefixes`.
    axi_data_width, axi_addr_width : int
        Data width of each memory master (the preset's ``mem_port_bits``; the bridge in
        front of the memory controller converts to its ports' width) and address width
        (64, as the XDMA's).
    irq : str
        Level interrupt output (``IRQ_STATUS & IRQ_ENABLE ≠ 0``) to XDMA user IRQ 0.
    mem_ports : int
        Memory masters (``EngineConfig.mem_ports``): master ``p`` reads and writes only
        channel ``p``, physical bytes ``[p·C, (p+1)·C)`` with ``C = mem_bytes / mem_ports``.
    mem_clock_mhz : float
        Clock of the memory controller's AXI ports (``EngineConfig.mem_clock_mhz``; 0: the
        engine clock).
    """
    verilog_files: tuple[str, ...]
    clock_mhz: float
    top: str = "dfvg_engine"
    clock: str = "clk"
    reset: str = "rst"
    axil_prefix: str = "s_axil_"
    axil_addr_width: int = field(default_factory=register_space_bits)
    axi_prefix: str = "m_axi_"
    axi_data_width: int = 256
    axi_addr_width: int = 64
    irq: str = "irq"
    mem_ports: int = 1
    mem_clock_mhz: float = 0.0

    AXIL_DATA_WIDTH = 32

    @classmethod
    def for_config(cls, config, verilog_files, **changes) -> "EngineInterface":
        """The interface of an engine built from ``config`` (an ``EngineConfig``): its clock,
        its memory ports, their width and the memory side's clock."""
        changes = {"axi_data_width": config.mem_port_bits, "mem_ports": config.mem_ports,
                   "mem_clock_mhz": config.mem_clock_mhz, **changes}
        return cls(verilog_files=tuple(str(f) for f in verilog_files), clock_mhz=config.clock_mhz,
                   **changes)

    @property
    def axil_bus(self) -> str:
        """Interface name Vivado infers from the AXI4-Lite prefix (``s_axil``)."""
        return self.axil_prefix.rstrip("_")

    @property
    def axi_bus(self) -> str:
        """The first (on a one-port engine, the only) memory master's interface name."""
        return self.axi_buses[0]

    @property
    def axi_prefixes(self) -> tuple[str, ...]:
        """Port-name prefix of each memory master, master 0 first."""
        if self.mem_ports == 1:
            return (self.axi_prefix,)
        return tuple(master_prefix(p, self.mem_ports) for p in range(self.mem_ports))

    @property
    def axi_buses(self) -> tuple[str, ...]:
        """Interface name Vivado infers for each memory master (``m_axi``; ``m00_axi`` …)."""
        return tuple(prefix.rstrip("_") for prefix in self.axi_prefixes)

    @property
    def memory_clock_mhz(self) -> float:
        """The memory controller side's AXI clock: ``mem_clock_mhz``, or the engine's."""
        return self.mem_clock_mhz or self.clock_mhz

    def ports(self) -> list[tuple[str, str, int]]:
        """Every port as (name, "in"/"out", width), clock and reset first.

        These names are what Vivado's interface inference needs to see the AXI buses.
        """
        lite = self.axil_prefix
        aw, dw = self.axil_addr_width, self.AXIL_DATA_WIDTH
        ports = [(self.clock, "in", 1), (self.reset, "in", 1)]
        # AXI4-Lite slave: the host's register reads and writes.
        ports += [(lite + n, d, w) for n, d, w in [
            ("awaddr", "in", aw), ("awprot", "in", 3), ("awvalid", "in", 1), ("awready", "out", 1),
            ("wdata", "in", dw), ("wstrb", "in", dw // 8), ("wvalid", "in", 1), ("wready", "out", 1),
            ("bresp", "out", 2), ("bvalid", "out", 1), ("bready", "in", 1),
            ("araddr", "in", aw), ("arprot", "in", 3), ("arvalid", "in", 1), ("arready", "out", 1),
            ("rdata", "out", dw), ("rresp", "out", 2), ("rvalid", "out", 1), ("rready", "in", 1)]]
        # AXI4 masters: bursts into device memory, one master per memory channel.
        aw, dw = self.axi_addr_width, self.axi_data_width
        ports += [(full + n, d, w) for full in self.axi_prefixes for n, d, w in [
            ("awaddr", "out", aw), ("awlen", "out", 8), ("awsize", "out", 3), ("awburst", "out", 2),
            ("awvalid", "out", 1), ("awready", "in", 1),
            ("wdata", "out", dw), ("wstrb", "out", dw // 8), ("wlast", "out", 1),
            ("wvalid", "out", 1), ("wready", "in", 1),
            ("bresp", "in", 2), ("bvalid", "in", 1), ("bready", "out", 1),
            ("araddr", "out", aw), ("arlen", "out", 8), ("arsize", "out", 3), ("arburst", "out", 2),
            ("arvalid", "out", 1), ("arready", "in", 1),
            ("rdata", "in", dw), ("rresp", "in", 2), ("rlast", "in", 1), ("rvalid", "in", 1),
            ("rready", "out", 1)]]
        ports.append((self.irq, "out", 1))
        return ports


# ---------------------------------------------------------------------------------------
# Port naming shared by the XDC and the block design
# ---------------------------------------------------------------------------------------

def _board_ports(board: CardPlatform):
    """(board pin, [(top-level port, package pin)]) for every board pin of ``board``.

    A differential clock becomes a block-design ``diff_clock`` interface port named after
    the pin, which Vivado's wrapper spells ``<name>_clk_p`` / ``<name>_clk_n``.
    """
    for pin in board.board_pins():
        yield pin, pin.ports()


# ---------------------------------------------------------------------------------------
# XDC
# ---------------------------------------------------------------------------------------

def xdc_text(board: CardPlatform, interface: EngineInterface) -> str:
    """Pin, I/O-standard and clock constraints of ``board``'s top-level ports."""
    lines = [
        f"# DFVG draft engine on {board.name} ({board.part}): board pins and clocks.",
        f"# Generated by boards.vivado from the board platform; pins from {board.xdc_source}.",
        "# PCIe lanes are placed by the XDMA IP unless placed below; DDR4 pins come from the",
        "# card's board file, DDR3 pins from the MIG project file.",
        "",
        "# Configuration bank voltage and compressed bitstreams, as in the card's master XDC.",
        f"set_property CONFIG_VOLTAGE {board.config_voltage} [current_design]",
        *(["set_property CFGBVS VCCO [current_design]"] if board.pcie.family == SERIES7 else []),
        "set_property BITSTREAM.GENERAL.COMPRESS TRUE [current_design]",
    ]
    for res, ports in _board_ports(board):
        lines += ["", f"# {res.name}"]
        for port, pin in ports:
            lines.append(f"set_property PACKAGE_PIN {pin} [get_ports {port}]")
        # GT reference clocks and lanes have no I/O standard: they enter a transceiver quad.
        if res.iostandard:
            for port, _ in ports:
                lines.append(f"set_property IOSTANDARD {res.iostandard} [get_ports {port}]")
        if res.clock_hz is not None:
            period_ns = 1e9 / res.clock_hz
            lines.append(f"create_clock -period {period_ns:.3f} -name {res.name} "
                         f"[get_ports {ports[0][0]}]")
    if board.pcie.gt_sites:
        lines += ["", "# The card's lanes are not wired in the XDMA's default lane order: each pipe",
                  "# lane's GT channel is placed here (this file is processed LATE, after the IP's).",
                  *[f"set_property LOC {site} [get_cells -hierarchical -filter "
                    f"{{NAME =~ *{XDMA}*pipe_lane?{lane}?.gt_wrapper_i*channel_i}}]"
                    for lane, site in board.pcie.gt_sites]]
    perst = board.pcie.perst
    lines += [
        "",
        "# PERST# comes from the host asynchronously; hold it inactive when nothing drives it.",
        f"set_property PULLUP true [get_ports {perst}]",
        f"set_false_path -from [get_ports {perst}]",
    ]
    if board.pcie.clkreq:
        lines.append(f"set_false_path -to [get_ports {board.pcie.clkreq}]")
    if board.memory.cattrip:
        lines += [
            "# CATTRIP is a static status output to the satellite controller: no timing.",
            f"set_false_path -to [get_ports {board.memory.cattrip}]",
        ]
    lines += _memory_clock_notes(board, interface)
    lines += [
        "",
        "# The board clocks, the XDMA's axi_aclk and the engine clock are unrelated; the",
        "# SmartConnects and proc_sys_reset blocks synchronise every crossing.",
        *[f"set_clock_groups -asynchronous -group [get_clocks -include_generated_clocks {res.name}]"
          for res, _ in _board_ports(board) if res.clock_hz is not None],
        "",
    ]
    return "\n".join(lines)


def _memory_clock_notes(board: CardPlatform, interface: EngineInterface) -> list[str]:
    """What the clock groups below cover on a multi-port engine: the clocks Vivado derives
    from the clock generators (no create_clock of their own, which would override them)."""
    links = memory_links(board, interface)
    if not links and not (board.memory.kind == HBM and _separate_memory_clock(interface)):
        return []
    fabric = board.fabric_clock or "the memory controller's UI clock"
    lines = ["", f"# Memory clocks of the {interface.mem_ports}-port engine (derived by Vivado from the "
             "clock generators):",
             f"#   engine clock {interface.clock_mhz:g} MHz: {CLK_WIZ} from {fabric}, "
             f"in the {fabric} group below;"]
    if board.memory.kind == HBM:
        lines += [f"#   HBM AXI clock {interface.memory_clock_mhz:g} MHz: "
                  + (f"{HBM_CLK_WIZ} from {board.memory.refclks[0]}, in the {board.memory.refclks[0]} group;"
                     if _separate_memory_clock(interface) else "the engine clock;"),
                  "#   every engine-to-HBM crossing is inside a port's SmartConnect (its clock",
                  "#   converter carries its own CDC constraints)."]
    else:
        lines += [f"#   DDR4 channel p's UI clock {board.memory.port_max_mhz:g} MHz: its controller's MMCM, from "
                  "ddr4_c<p>_sysclk, in that clock's group;",
                  "#   every engine-to-controller crossing is inside channel p's SmartConnect."]
    return lines


# ---------------------------------------------------------------------------------------
# Tcl flow
# ---------------------------------------------------------------------------------------

def _tcl_props(props: dict) -> str:
    """``[list CONFIG.key {value} …]`` for ``set_property -dict``."""
    return "[list " + " ".join(f"CONFIG.{k} {{{v}}}" for k, v in props.items()) + "]"


class _Tcl:
    """Accumulates the flow: numbered steps, each a proc with a comment and a progress line."""

    def __init__(self):
        self.steps: list[tuple[str, str, list[str]]] = []   # (proc, title, body lines)

    def step(self, proc: str, title: str, body: list[str]) -> None:
        self.steps.append((proc, title, body))

    def render(self, header: list[str]) -> str:
        total = len(self.steps)
        out = header + [
            "",
            "proc dfvg_progress {number total title} {",
            f'    puts "{PROGRESS_PREFIX} \\[$number/$total\\] $title"',
            "    flush stdout",
            "}",
        ]
        for number, (proc, title, body) in enumerate(self.steps, 1):
            out += ["", f"# -- {number}. {title} " + "-" * max(0, 70 - len(title)),
                    f"proc {proc} {{}} {{", "    global dfvg_dir dfvg_jobs"]
            out += [f"    {line}" if line else "" for line in body]
            out.append("}")
        out += ["", "# -- run every step in order " + "-" * 45]
        for number, (proc, title, _) in enumerate(self.steps, 1):
            out.append(f'dfvg_progress {number} {total} "{title}"')
            out.append(proc)
        out.append(f'puts "{PROGRESS_PREFIX} done"')
        return "\n".join(out) + "\n"


#: The block-design cell names, used by several steps.
XDMA, ENGINE, HBM_CELL, MIG_CELL = "xdma_0", "engine", "hbm_0", "mig_7series_0"
#: Block-design interface port of the DDR3 pins (MIG names them ddr3_addr … inside).
DDR3_PORT = "ddr3"
#: The MIG project file in the build tree (boards.mig7.prj_text).
MIG_PRJ_NAME = "mig_ddr3.prj"
CLK_WIZ, ENGINE_RESET, MEM_RESET = "engine_clk_wiz", "engine_reset", "mem_reset"
BD_NAME = "dfvg_bd"


def _engine_clock() -> str:
    return f"[get_bd_pins {CLK_WIZ}/clk_out1]"


def _xdma_config(board: CardPlatform) -> dict:
    pcie = board.pcie
    config = {
        "mode_selection": "Advanced",
        "pl_link_cap_max_link_width": f"X{pcie.lanes}",
        "pl_link_cap_max_link_speed": pcie.link_speed,
        # An AXI bus that carries the link (Gen3 x16, 16 GB/s: 512 bits at 250 MHz).
        "axi_data_width": f"{pcie.axi_data_width}_bit",
        "axisten_freq": f"{pcie.axi_mhz:g}",
        "xdma_axi_intf_mm": "AXI_Memory_Mapped",
        # One H2C and one C2H channel: /dev/xdma0_h2c_0 and /dev/xdma0_c2h_0.
        "xdma_rnum_chnl": "1",
        "xdma_wnum_chnl": "1",
        # The AXI-Lite BAR (/dev/xdma0_user) maps onto the register file from offset 0.
        "axilite_master_en": "true",
        "axilite_master_scale": "Kilobytes",
        "axilite_master_size": str(REGISTER_BAR_KIB),
        "pciebar2axibar_axil_master": "0x00000000",
        "xdma_num_usr_irq": "1",
        "pf0_device_id": pcie.device_id,
    }
    if board.pcie.block:
        config.update(en_gt_selection="true", pcie_blk_locn=board.pcie.block,
                      select_quad=board.pcie.quad)
    return config


def _step_project(tcl: _Tcl, board: CardPlatform) -> None:
    project = "dfvg_" + board.name.replace("-", "_")
    body = [f"create_project -force {project} [file join $dfvg_dir vivado] -part {board.part}",
            "set_property target_language Verilog [current_project]"]
    if board.memory.board_interfaces:
        # The DDR4 controllers take their pins from the card's board file.
        body += [
            f"set parts [get_board_parts -quiet -latest_file_version {{{board.board_part}}}]",
            "if {[llength $parts] == 0} {",
            f'    error "{PROGRESS_PREFIX} the {board.name} board files ({board.board_part}) are not '
            'installed; add them from the Vivado board store (Tools > Vivado Store > Boards) '
            'and run this script again"',
            "}",
            "set_property board_part [lindex $parts end] [current_project]",
        ]
    tcl.step("dfvg_create_project", f"project for {board.part}", body)


def _step_sources(tcl: _Tcl, board: CardPlatform, interface: EngineInterface, xdc_name: str) -> None:
    files = " ".join(f"[file join $dfvg_dir {f}]" for f in interface.verilog_files)
    body = [f"add_files -norecurse [list {files}]",
            f"add_files -fileset constrs_1 -norecurse [file join $dfvg_dir {xdc_name}]"]
    if board.pcie.gt_sites:
        body += ["# After the IP's constraints, so that its GT placement gives way to the card's.",
                 f"set_property PROCESSING_ORDER LATE [get_files {xdc_name}]"]
    body += [f"set_property top {interface.top} [current_fileset]",
             "update_compile_order -fileset sources_1"]
    tcl.step("dfvg_add_sources", "engine Verilog and board constraints", body)


def _diff_clock_port(name: str, mhz: float) -> list[str]:
    return [f"create_bd_intf_port -mode Slave -vlnv xilinx.com:interface:diff_clock_rtl:1.0 {name}",
            f"set_property CONFIG.FREQ_HZ {round(mhz * 1e6)} [get_bd_intf_ports {name}]"]


def _step_block_design(tcl: _Tcl, board: CardPlatform) -> None:
    body = [f"create_bd_design {BD_NAME}",
            "# Board-level ports; the XDC places them."]
    for pin in board.board_pins():
        if pin.is_diff_clock:
            body += _diff_clock_port(pin.name, pin.clock_hz / 1e6)
    body += [
        "create_bd_intf_port -mode Master -vlnv xilinx.com:interface:pcie_7x_mgt_rtl:1.0 pcie_mgt",
        f"create_bd_port -dir I -type rst {board.pcie.perst}",
        f"set_property CONFIG.POLARITY ACTIVE_LOW [get_bd_ports {board.pcie.perst}]",
    ]
    if board.pcie.clkreq:
        body.append(f"create_bd_port -dir O {board.pcie.clkreq}")
    if board.memory.cattrip:
        body.append(f"create_bd_port -dir O {board.memory.cattrip}")
    for i, _ in enumerate(board.memory.board_interfaces):
        body.append(f"create_bd_intf_port -mode Master -vlnv xilinx.com:interface:ddr4_rtl:1.0 ddr4_c{i}")
    if board.memory.kind == DDR3:
        body.append(f"create_bd_intf_port -mode Master -vlnv xilinx.com:interface:ddrx_rtl:1.0 {DDR3_PORT}")
    tcl.step("dfvg_create_block_design", "block design and board ports", body)


def _step_pcie(tcl: _Tcl, board: CardPlatform) -> None:
    pcie = board.pcie
    refclk = pcie.refclk
    if pcie.family == SERIES7:
        # IBUFDS_GTE2: one output, which the 7-series PCIe core takes as sys_clk.
        clocks = ["# The 100 MHz connector clock enters the GTP quad through IBUFDS_GTE2.",
                  f"connect_bd_net [get_bd_pins pcie_refclk_buf/IBUF_OUT] [get_bd_pins {XDMA}/sys_clk]"]
    else:
        clocks = ["# The 100 MHz connector clock enters a GT quad: IBUFDS_GTE4, full rate for the GTs",
                  "# and divided by two for the PCIe core.",
                  f"connect_bd_net [get_bd_pins pcie_refclk_buf/IBUF_OUT] [get_bd_pins {XDMA}/sys_clk_gt]",
                  f"connect_bd_net [get_bd_pins pcie_refclk_buf/IBUF_DS_ODIV2] [get_bd_pins {XDMA}/sys_clk]"]
    body = [
        "set refclk_buf [create_bd_cell -type ip -vlnv xilinx.com:ip:util_ds_buf pcie_refclk_buf]",
        "set_property CONFIG.C_BUF_TYPE {IBUFDSGTE} $refclk_buf",
        f"set xdma [create_bd_cell -type ip -vlnv xilinx.com:ip:xdma {XDMA}]",
        f"set_property -dict {_tcl_props(_xdma_config(board))} $xdma",
        f"connect_bd_intf_net [get_bd_intf_ports {refclk}] [get_bd_intf_pins pcie_refclk_buf/CLK_IN_D]",
        *clocks,
        f"connect_bd_net [get_bd_ports {pcie.perst}] [get_bd_pins {XDMA}/sys_rst_n]",
        f"connect_bd_intf_net [get_bd_intf_pins {XDMA}/pcie_mgt] [get_bd_intf_ports pcie_mgt]",
    ]
    if pcie.clkreq:
        body += ["# CLKREQ# low: the card wants the reference clock, always.",
                 "set clkreq [create_bd_cell -type ip -vlnv xilinx.com:ip:xlconstant pcie_clkreq_low]",
                 "set_property CONFIG.CONST_VAL {0} $clkreq",
                 f"connect_bd_net [get_bd_pins pcie_clkreq_low/dout] [get_bd_ports {pcie.clkreq}]"]
    tcl.step("dfvg_add_xdma", f"XDMA PCIe Gen{pcie.gen} x{pcie.lanes} (DMA + register BAR)", body)


def _step_clocking(tcl: _Tcl, board: CardPlatform, interface: EngineInterface) -> None:
    fabric = board.fabric_clock
    if fabric is None:
        # The board's one clock feeds the memory controller: start from its UI clock.
        source_mhz, source = board.memory.mig.ui_clock_mhz, "Global_buffer"
        feed = [f"# No free board clock: the clock generator runs from the MIG's UI clock.",
                f"connect_bd_net [get_bd_pins {MIG_CELL}/ui_clk] [get_bd_pins {CLK_WIZ}/clk_in1]"]
    else:
        source_mhz, source = board.clock_mhz(fabric), "Differential_clock_capable_pin"
        feed = [f"connect_bd_intf_net [get_bd_intf_ports {fabric}] [get_bd_intf_pins {CLK_WIZ}/CLK_IN1_D]"]
    wiz = {"PRIM_SOURCE": source,
           "PRIM_IN_FREQ": f"{source_mhz:.3f}",
           "CLKOUT1_REQUESTED_OUT_FREQ": f"{interface.clock_mhz:.3f}",
           "USE_RESET": "false", "USE_LOCKED": "true"}
    body = [
        "# The engine runs from its own clock, made from a free-running board clock so that",
        "# it does not depend on the PCIe link.",
        f"set wiz [create_bd_cell -type ip -vlnv xilinx.com:ip:clk_wiz {CLK_WIZ}]",
        f"set_property -dict {_tcl_props(wiz)} $wiz",
        *feed,
        "# Engine reset: held while the PCIe link is down (axi_aresetn) or the clock unlocked.",
        f"set rst [create_bd_cell -type ip -vlnv xilinx.com:ip:proc_sys_reset {ENGINE_RESET}]",
        "set_property CONFIG.C_EXT_RESET_HIGH {0} $rst",
        f"connect_bd_net {_engine_clock()} [get_bd_pins {ENGINE_RESET}/slowest_sync_clk]",
        f"connect_bd_net [get_bd_pins {XDMA}/axi_aresetn] [get_bd_pins {ENGINE_RESET}/ext_reset_in]",
        f"connect_bd_net [get_bd_pins {CLK_WIZ}/locked] [get_bd_pins {ENGINE_RESET}/dcm_locked]",
    ]
    tcl.step("dfvg_add_clocking", f"clocking ({interface.clock_mhz:g} MHz engine clock) and reset", body)


def _smartconnect(name: str, n_si: int, n_mi: int, clocks: list[str], reset: str) -> list[str]:
    """A SmartConnect ``name`` clocked by ``clocks`` (aclk, aclk1, …) with ``reset`` (aresetn)."""
    props = {"NUM_SI": n_si, "NUM_MI": n_mi, "NUM_CLKS": len(clocks)}
    body = [f"set sc [create_bd_cell -type ip -vlnv xilinx.com:ip:smartconnect {name}]",
            f"set_property -dict {_tcl_props(props)} $sc"]
    for i, clock in enumerate(clocks):
        body.append(f"connect_bd_net {clock} [get_bd_pins {name}/aclk{i or ''}]")
    body.append(f"connect_bd_net {reset} [get_bd_pins {name}/aresetn]")
    return body


def _hbm_port(board: CardPlatform, index: int) -> str:
    """The HBM IP's AXI3 slave port ``index``: ``SAXI_00_8HI`` … on 8-high stacks (XCU55C),
    ``SAXI_00`` … on 4-high ones (XCU280)."""
    return f"SAXI_{index:02d}" + ("_8HI" if board.memory.hbm_8high else "")


def _hbm_segment(board: CardPlatform, port: int, channel: int) -> str:
    """Address segment of pseudo-channel ``channel`` as seen through SAXI port ``port``
    (the HBM IP gives each pseudo-channel a fixed segment ``HBM_MEMnn`` at ``nn`` times
    its size, on every port that reaches it)."""
    return f"{HBM_CELL}/{_hbm_port(board, port)}/HBM_MEM{channel:02d}"


@dataclass(frozen=True)
class MemoryLink:
    """One engine memory master's own path into device memory (an engine with several
    memory ports; a one-port engine keeps the flow's shared SmartConnect).

    Attributes
    ----------
    master : int
        The engine's memory master (``mem_ports`` of them).
    bus : str
        Its interface on the engine cell (``m00_axi`` …).
    bridge : str
        The 1:1 SmartConnect between the master and the controller port (2:1 where the
        host path shares it): clock, width and AXI4-to-AXI3 conversion, and the address
        decode that answers DECERR outside the channel.
    slave : str
        The controller's AXI slave interface the bridge drives (``hbm_0/SAXI_05_8HI``,
        ``ddr4_c2/C0_DDR4_S_AXI``).
    offset, size : int
        The master's channel: physical bytes ``[offset, offset + size)``.
    segments : tuple of (str, int, int)
        (address segment, offset, range) mapped into the master's address space: its
        channel, which is all it can reach.
    excluded : tuple of (str, int, int)
        Segments its slave port could reach but that are excluded from its address space
        (the rest of HBM, through the HBM's global switch).
    host_shared : bool
        Whether the host path enters device memory through this link's bridge too.
    """
    master: int
    bus: str
    bridge: str
    slave: str
    offset: int
    size: int
    segments: tuple[tuple[str, int, int], ...]
    excluded: tuple[tuple[str, int, int], ...] = ()
    host_shared: bool = False


@dataclass(frozen=True)
class HostPath:
    """How the XDMA's ``M_AXI`` (host DMA) reaches all of device memory on a multi-port
    engine. It carries host transfers only (weights, programs, requests and results); while
    the engine drafts it is idle, so a port it shares is the engine's alone then.

    Attributes
    ----------
    bridge : str
        The SmartConnect the XDMA's ``M_AXI`` enters.
    slave_interface : str
        That SmartConnect's slave interface the XDMA drives.
    ports : tuple of str
        The controller ports it reaches memory through.
    segments : tuple of (str, int, int)
        (address segment, offset, range): every byte of device memory, at its physical
        address (= the file offset of ``/dev/xdma0_h2c_0`` and ``_c2h_0``).
    """
    bridge: str
    slave_interface: str
    ports: tuple[str, ...]
    segments: tuple[tuple[str, int, int], ...]


#: The SmartConnect that fans the host path out to the DDR4 channels' bridges, or gives it
#: an HBM port of its own.
HOST_SC = "host_sc"
#: The HBM AXI clock's generator and reset (when it differs from the engine clock).
HBM_CLK_WIZ, HBM_AXI_RESET = "hbm_clk_wiz", "hbm_axi_reset"


def check_memory_ports(board: CardPlatform, interface: EngineInterface) -> None:
    """Refuse an engine whose memory masters cannot each own a part of ``board``'s memory."""
    n, mem = interface.mem_ports, board.memory
    if n == 1:
        return
    if mem.kind == HBM:
        if mem.pseudo_channels % n:
            raise ValueError(f"board {board.name}: a {n}-port engine does not divide the HBM's "
                             f"{mem.pseudo_channels} pseudo-channels; mem_ports must divide "
                             f"{mem.pseudo_channels}")
        if mem.port_max_mhz and interface.memory_clock_mhz > mem.port_max_mhz:
            raise ValueError(f"board {board.name}: the HBM's AXI ports run at most "
                             f"{mem.port_max_mhz:g} MHz, not {interface.memory_clock_mhz:g} "
                             f"(mem_clock_mhz)")
    elif mem.kind == DDR4:
        if n != mem.channels:
            raise ValueError(f"board {board.name}: a multi-port engine needs one master per "
                             f"DDR4 channel (mem_ports = {mem.channels}), not {n}")
    else:
        raise ValueError(f"board {board.name}: one {mem.kind} controller takes a one-port "
                         f"engine, not {n} ports")


def memory_links(board: CardPlatform, interface: EngineInterface) -> list[MemoryLink]:
    """Each memory master's path into ``board``'s memory, master 0 first (empty for a
    one-port engine, which shares one SmartConnect with the host as before).

    HBM: master ``p`` of ``n`` owns pseudo-channels ``[p·s, (p+1)·s)`` with ``s = 32 / n``
    and enters the HBM at ``SAXI_{p·s}``, the port of its first pseudo-channel (for
    ``n = 32``: master ``p`` on ``SAXI_p``, pseudo-channel ``p``, nothing else). DDR4:
    master ``p`` on channel ``p``'s controller.
    """
    check_memory_ports(board, interface)
    n, mem = interface.mem_ports, board.memory
    if n == 1:
        return []
    size = mem.total_bytes // n
    links = []
    for p, bus in enumerate(interface.axi_buses):
        bridge = f"mem_sc_{p:02d}"
        if mem.kind == HBM:
            span, pc = mem.pseudo_channels // n, mem.port_span_bytes
            port = p * span
            mine = range(p * span, (p + 1) * span)
            links.append(MemoryLink(
                p, bus, bridge, f"{HBM_CELL}/{_hbm_port(board, port)}", p * size, size,
                tuple((_hbm_segment(board, port, k), k * pc, pc) for k in mine),
                tuple((_hbm_segment(board, port, k), k * pc, pc)
                      for k in range(mem.pseudo_channels) if k not in mine),
                host_shared=(p == 0 and span == 1)))
        else:
            slave, _, segment = _memory_slaves(board)[p]
            links.append(MemoryLink(p, bus, bridge, slave, p * size, size,
                                    ((segment, p * size, size),)))
    return links


def host_path(board: CardPlatform, interface: EngineInterface) -> HostPath | None:
    """Where the host's DMA enters device memory beside a multi-port engine (``None`` for a
    one-port engine).

    HBM with 32 masters: every port is an engine master's, so the host shares port 0 with
    master 0 through that port's SmartConnect (2:1) and reaches every pseudo-channel
    through the HBM's global switch. HBM with fewer masters: the host takes ``SAXI_01``, a
    port no master uses, through a 1:1 SmartConnect of its own. DDR4: a 1:4 SmartConnect
    feeds the second slave interface of each channel's 2:1 bridge.
    """
    links = memory_links(board, interface)
    if not links:
        return None
    mem = board.memory
    if mem.kind == HBM:
        pc = mem.port_span_bytes
        shared = links[0].host_shared
        port = 0 if shared else 1
        bridge, intf = (links[0].bridge, "S01_AXI") if shared else (HOST_SC, "S00_AXI")
        return HostPath(bridge, intf, (f"{HBM_CELL}/{_hbm_port(board, port)}",),
                        tuple((_hbm_segment(board, port, k), k * pc, pc)
                              for k in range(mem.pseudo_channels)))
    return HostPath(HOST_SC, "S00_AXI", tuple(link.slave for link in links),
                    tuple(seg for link in links for seg in link.segments))


def _separate_memory_clock(interface: EngineInterface) -> bool:
    """Whether the memory side's AXI clock is a clock of its own (``mem_clock_mhz`` set and
    not the engine's)."""
    return bool(interface.mem_clock_mhz) and interface.mem_clock_mhz != interface.clock_mhz


def _hbm_axi_clock(interface: EngineInterface) -> str:
    return (f"[get_bd_pins {HBM_CLK_WIZ}/clk_out1]" if _separate_memory_clock(interface)
            else _engine_clock())


def _hbm_ports_used(board: CardPlatform, interface: EngineInterface) -> list[int]:
    """The HBM's SAXI ports the flow drives: the engine's masters' and the host's."""
    links = memory_links(board, interface)
    if not links:
        return [0, 1]            # one-port engine: port 0 the DMA, port 1 the engine
    used = {int(link.slave.split("_")[2]) for link in links}
    used |= {int(port.split("_")[2]) for port in host_path(board, interface).ports}
    return sorted(used)


def _step_hbm(tcl: _Tcl, board: CardPlatform, interface: EngineInterface) -> None:
    mem = board.memory
    refclk = mem.refclks[0]
    links = memory_links(board, interface)
    used = _hbm_ports_used(board, interface)
    axi_mhz = interface.memory_clock_mhz
    config = {
        "USER_HBM_DENSITY": f"{mem.total_bytes >> 30}GB",
        "USER_HBM_STACK": str(mem.channels),
        # The global switch lets every AXI port reach the whole memory, so device addresses
        # are the same for the DMA and the engine.
        "USER_SWITCH_ENABLE_00": "TRUE",
        "USER_SWITCH_ENABLE_01": "TRUE",
        "USER_APB_EN": "false",
        "USER_HBM_REF_CLK_0": f"{mem.refclk_mhz:g}",
        "USER_HBM_REF_CLK_1": f"{mem.refclk_mhz:g}",
        "USER_AXI_CLK_FREQ": f"{axi_mhz:g}",
    }
    if links:
        # Both stacks' AXI clocks, and the port whose clock each stack's logic is timed
        # from (ports 0-15 belong to stack 0, 16-31 to stack 1).
        config["USER_AXI_CLK1_FREQ"] = f"{axi_mhz:g}"
        half = mem.pseudo_channels // 2
        for stack, ports in enumerate(([p for p in used if p < half], [p for p in used if p >= half])):
            if ports:
                config[f"USER_CLK_SEL_LIST{stack}"] = f"AXI_{ports[0]:02d}_ACLK"
        config["USER_APB_PCLK_0"] = config["USER_APB_PCLK_1"] = f"{mem.refclk_mhz:g}"
    # Port 0 carries the DMA, port 1 the engine (one-port engine); or one port per engine
    # master and the host's; the rest stay off.
    config.update({f"USER_SAXI_{i:02d}": "true" if i in used else "false" for i in range(32)})
    engine_rstn = f"[get_bd_pins {ENGINE_RESET}/peripheral_aresetn]"
    axi_clock, axi_rstn = _hbm_axi_clock(interface), engine_rstn
    body = [
        "# HBM reference and APB clock: the board's 100 MHz clock through IBUFDS and BUFG.",
        "set ibuf [create_bd_cell -type ip -vlnv xilinx.com:ip:util_ds_buf hbm_refclk_ibuf]",
        f"connect_bd_intf_net [get_bd_intf_ports {refclk}] [get_bd_intf_pins hbm_refclk_ibuf/CLK_IN_D]",
        "set bufg [create_bd_cell -type ip -vlnv xilinx.com:ip:util_ds_buf hbm_refclk_bufg]",
        "set_property CONFIG.C_BUF_TYPE {BUFG} $bufg",
        "connect_bd_net [get_bd_pins hbm_refclk_ibuf/IBUF_OUT] [get_bd_pins hbm_refclk_bufg/BUFG_I]",
        f"set rst [create_bd_cell -type ip -vlnv xilinx.com:ip:proc_sys_reset {MEM_RESET}]",
        "set_property CONFIG.C_EXT_RESET_HIGH {0} $rst",
        f"connect_bd_net [get_bd_pins hbm_refclk_bufg/BUFG_O] [get_bd_pins {MEM_RESET}/slowest_sync_clk]",
        f"connect_bd_net [get_bd_ports {board.pcie.perst}] [get_bd_pins {MEM_RESET}/ext_reset_in]",
    ]
    if _separate_memory_clock(interface):
        axi_rstn = f"[get_bd_pins {HBM_AXI_RESET}/peripheral_aresetn]"
        wiz = {"PRIM_SOURCE": "Global_buffer", "PRIM_IN_FREQ": f"{mem.refclk_mhz:.3f}",
               "CLKOUT1_REQUESTED_OUT_FREQ": f"{axi_mhz:.3f}",
               "USE_RESET": "false", "USE_LOCKED": "true"}
        body += [
            f"# The HBM's AXI clock ({axi_mhz:g} MHz: a 256-bit port then carries a whole",
            "# pseudo-channel) from the HBM reference clock, asynchronous to the engine clock;",
            "# each port's SmartConnect crosses between the two.",
            f"set hwiz [create_bd_cell -type ip -vlnv xilinx.com:ip:clk_wiz {HBM_CLK_WIZ}]",
            f"set_property -dict {_tcl_props(wiz)} $hwiz",
            f"connect_bd_net [get_bd_pins hbm_refclk_bufg/BUFG_O] [get_bd_pins {HBM_CLK_WIZ}/clk_in1]",
            "# The AXI ports' reset, synchronous to that clock: held while the PCIe link is down",
            "# or the clock unlocked, like the engine's.",
            f"set hrst [create_bd_cell -type ip -vlnv xilinx.com:ip:proc_sys_reset {HBM_AXI_RESET}]",
            "set_property CONFIG.C_EXT_RESET_HIGH {0} $hrst",
            f"connect_bd_net {axi_clock} [get_bd_pins {HBM_AXI_RESET}/slowest_sync_clk]",
            f"connect_bd_net [get_bd_pins {XDMA}/axi_aresetn] [get_bd_pins {HBM_AXI_RESET}/ext_reset_in]",
            f"connect_bd_net [get_bd_pins {HBM_CLK_WIZ}/locked] [get_bd_pins {HBM_AXI_RESET}/dcm_locked]",
        ]
    body += [
        f"set hbm [create_bd_cell -type ip -vlnv xilinx.com:ip:hbm {HBM_CELL}]",
        f"set_property -dict {_tcl_props(config)} $hbm",
    ]
    for stack in range(mem.channels):
        body += [f"connect_bd_net [get_bd_pins hbm_refclk_bufg/BUFG_O] [get_bd_pins {HBM_CELL}/HBM_REF_CLK_{stack}]",
                 f"connect_bd_net [get_bd_pins hbm_refclk_bufg/BUFG_O] [get_bd_pins {HBM_CELL}/APB_{stack}_PCLK]",
                 f"connect_bd_net [get_bd_pins {MEM_RESET}/peripheral_aresetn] [get_bd_pins {HBM_CELL}/APB_{stack}_PRESET_N]"]
    for port in used:
        body += [f"connect_bd_net {axi_clock} [get_bd_pins {HBM_CELL}/AXI_{port:02d}_ACLK]",
                 f"connect_bd_net {axi_rstn} [get_bd_pins {HBM_CELL}/AXI_{port:02d}_ARESET_N]"]
    # Either stack overheating must reach the satellite controller.
    body += [
        "set trip [create_bd_cell -type ip -vlnv xilinx.com:ip:util_vector_logic hbm_cattrip_or]",
        "set_property -dict [list CONFIG.C_OPERATION {or} CONFIG.C_SIZE {1}] $trip",
        f"connect_bd_net [get_bd_pins {HBM_CELL}/DRAM_0_STAT_CATTRIP] [get_bd_pins hbm_cattrip_or/Op1]",
        f"connect_bd_net [get_bd_pins {HBM_CELL}/DRAM_1_STAT_CATTRIP] [get_bd_pins hbm_cattrip_or/Op2]",
        f"connect_bd_net [get_bd_pins hbm_cattrip_or/Res] [get_bd_ports {mem.cattrip}]",
    ]
    gib = mem.total_bytes >> 30
    title = f"HBM controller ({gib} GiB, {mem.channels} stacks)"
    if links:
        title = (f"HBM controller ({gib} GiB, {mem.channels} stacks, {len(used)} of "
                 f"{mem.pseudo_channels} ports at {axi_mhz:g} MHz)")
    tcl.step("dfvg_add_memory", title, body)


#: DDR4 IP input-clock periods by reference frequency: the IP offers a list of periods,
#: and for a 300 MHz reference that list has 3332 ps.
_DDR4_INPUT_PERIOD_PS = {300.0: 3332}


def _step_ddr4(tcl: _Tcl, board: CardPlatform) -> None:
    mem = board.memory
    period_ps = _DDR4_INPUT_PERIOD_PS[mem.refclk_mhz]
    body = [f"set rst [create_bd_cell -type ip -vlnv xilinx.com:ip:proc_sys_reset {MEM_RESET}]",
            "set_property CONFIG.C_EXT_RESET_HIGH {0} $rst",
            f"connect_bd_net {_engine_clock()} [get_bd_pins {MEM_RESET}/slowest_sync_clk]",
            f"connect_bd_net [get_bd_ports {board.pcie.perst}] [get_bd_pins {MEM_RESET}/ext_reset_in]"]
    for i, (intf, refclk) in enumerate(zip(mem.board_interfaces, mem.refclks)):
        cell = f"ddr4_c{i}"
        config = {"C0_DDR4_BOARD_INTERFACE": intf, "C0_CLOCK_BOARD_INTERFACE": "Custom",
                  "C0.DDR4_InputClockPeriod": str(period_ps), "C0.DDR4_AxiDataWidth": "512"}
        body += [
            f"# Channel {i}: pins from board interface {intf}, reference clock {refclk}.",
            f"set ddr [create_bd_cell -type ip -vlnv xilinx.com:ip:ddr4 {cell}]",
            f"set_property -dict {_tcl_props(config)} $ddr",
            f"connect_bd_intf_net [get_bd_intf_ports {refclk}] [get_bd_intf_pins {cell}/C0_SYS_CLK]",
            f"connect_bd_intf_net [get_bd_intf_pins {cell}/C0_DDR4] [get_bd_intf_ports {cell}]",
            f"connect_bd_net [get_bd_pins {MEM_RESET}/peripheral_reset] [get_bd_pins {cell}/sys_rst]",
            "# The AXI slave's reset must be synchronous to the controller's UI clock.",
            f"set uirst [create_bd_cell -type ip -vlnv xilinx.com:ip:proc_sys_reset {cell}_ui_reset]",
            f"connect_bd_net [get_bd_pins {cell}/c0_ddr4_ui_clk] [get_bd_pins {cell}_ui_reset/slowest_sync_clk]",
            f"connect_bd_net [get_bd_pins {cell}/c0_ddr4_ui_clk_sync_rst] [get_bd_pins {cell}_ui_reset/ext_reset_in]",
            f"connect_bd_net [get_bd_pins {cell}_ui_reset/peripheral_aresetn] [get_bd_pins {cell}/c0_ddr4_aresetn]",
        ]
    gib = mem.total_bytes >> 30
    tcl.step("dfvg_add_memory", f"DDR4 controllers ({mem.channels} x {mem.bytes_per_channel >> 30} GiB = {gib} GiB)", body)


def _mig_module_name() -> str:
    """Component name Vivado gives the MIG cell in the block design (the .prj names it)."""
    return f"{BD_NAME}_{MIG_CELL}_0"


def _step_ddr3(tcl: _Tcl, board: CardPlatform) -> None:
    mem, mig = board.memory, board.memory.mig
    refclk = mem.refclks[0]
    props = {"BOARD_MIG_PARAM": "Custom", "MIG_DONT_TOUCH_PARAM": "Custom",
             "RESET_BOARD_INTERFACE": "Custom", "XML_INPUT_FILE": MIG_PRJ_NAME}
    body = [
        f"set mig [create_bd_cell -type ip -vlnv xilinx.com:ip:mig_7series {MIG_CELL}]",
        "# MIG 7-series reads its settings and the DDR3 pins from a project file in the IP's",
        "# directory (written from the board platform's ddr3 resource), as write_bd_tcl does.",
        "set mig_dir [get_property IP_DIR [get_ips [get_property CONFIG.Component_Name $mig]]]",
        "file mkdir $mig_dir",
        f"file copy -force [file join $dfvg_dir {MIG_PRJ_NAME}] [file join $mig_dir {MIG_PRJ_NAME}]",
        f"set_property -dict {_tcl_props(props)} $mig",
        f"# System clock {refclk} ({mem.refclk_mhz:g} MHz), also the IDELAY reference.",
        f"connect_bd_intf_net [get_bd_intf_ports {refclk}] [get_bd_intf_pins {MIG_CELL}/SYS_CLK]",
        f"connect_bd_intf_net [get_bd_intf_pins {MIG_CELL}/DDR3] [get_bd_intf_ports {DDR3_PORT}]",
        "# Calibrate after PERST# (sys_rst is active low in the project file).",
        f"connect_bd_net [get_bd_ports {board.pcie.perst}] [get_bd_pins {MIG_CELL}/sys_rst]",
        "# The AXI slave's reset must be synchronous to the controller's UI clock.",
        f"set uirst [create_bd_cell -type ip -vlnv xilinx.com:ip:proc_sys_reset {MIG_CELL}_ui_reset]",
        f"connect_bd_net [get_bd_pins {MIG_CELL}/ui_clk] [get_bd_pins {MIG_CELL}_ui_reset/slowest_sync_clk]",
        f"connect_bd_net [get_bd_pins {MIG_CELL}/ui_clk_sync_rst] [get_bd_pins {MIG_CELL}_ui_reset/ext_reset_in]",
        f"connect_bd_net [get_bd_pins {MIG_CELL}/mmcm_locked] [get_bd_pins {MIG_CELL}_ui_reset/dcm_locked]",
        f"connect_bd_net [get_bd_pins {MIG_CELL}_ui_reset/peripheral_aresetn] [get_bd_pins {MIG_CELL}/aresetn]",
    ]
    size = _size_text(mem.total_bytes)
    tcl.step("dfvg_add_memory", f"DDR3 controller (MIG 7-series, {size}, x{mig.data_width} at "
             f"{2 * mig.mem_clock_mhz:g} MT/s)", body)


def _size_text(nbytes: int) -> str:
    return f"{nbytes >> 30} GiB" if nbytes % (1 << 30) == 0 else f"{nbytes >> 20} MiB"


def _range(nbytes: int) -> str:
    """An ``assign_bd_address -range`` value."""
    return f"{nbytes >> 30}G" if nbytes % (1 << 30) == 0 else f"{nbytes >> 20}M"


def _memory_slaves(board: CardPlatform) -> list[tuple[str, str, str]]:
    """(AXI slave interface pin, UI clock pin, address segment) of each DDR controller."""
    if board.memory.kind == DDR3:
        return [(f"{MIG_CELL}/S_AXI", f"[get_bd_pins {MIG_CELL}/ui_clk]", f"{MIG_CELL}/memmap/memaddr")]
    return [(f"ddr4_c{i}/C0_DDR4_S_AXI", f"[get_bd_pins ddr4_c{i}/c0_ddr4_ui_clk]",
             f"ddr4_c{i}/C0_DDR4_MEMORY_MAP/C0_DDR4_ADDRESS_BLOCK") for i in range(board.memory.channels)]


def _step_engine(tcl: _Tcl, interface: EngineInterface) -> None:
    pin = f"[get_bd_pins {ENGINE}/{interface.clock}]"
    tcl.step("dfvg_add_engine", f"engine ({interface.top}) as a module reference", [
        f"create_bd_cell -type module -reference {interface.top} {ENGINE}",
        "# Tell the block design which clock and reset the inferred AXI buses use.",
        f"set_property -dict [list CONFIG.ASSOCIATED_BUSIF {{{':'.join((interface.axil_bus, *interface.axi_buses))}}} "
        f"CONFIG.ASSOCIATED_RESET {{{interface.reset}}}] {pin}",
        f"set_property CONFIG.POLARITY ACTIVE_HIGH [get_bd_pins {ENGINE}/{interface.reset}]",
    ])


def _step_connect(tcl: _Tcl, board: CardPlatform, interface: EngineInterface) -> None:
    engine_clock = _engine_clock()
    xdma_clock = f"[get_bd_pins {XDMA}/axi_aclk]"
    engine_rstn = f"[get_bd_pins {ENGINE_RESET}/interconnect_aresetn]"
    body = [
        "# Engine clock, reset and interrupt.",
        f"connect_bd_net {engine_clock} [get_bd_pins {ENGINE}/{interface.clock}]",
        f"connect_bd_net [get_bd_pins {ENGINE_RESET}/peripheral_reset] [get_bd_pins {ENGINE}/{interface.reset}]",
        f"connect_bd_net [get_bd_pins {ENGINE}/{interface.irq}] [get_bd_pins {XDMA}/usr_irq_req]",
        "# Register BAR: XDMA AXI-Lite master (axi_aclk) to the engine's register file.",
        *_smartconnect("reg_sc", 1, 1, [xdma_clock, engine_clock], engine_rstn),
        f"connect_bd_intf_net [get_bd_intf_pins {XDMA}/M_AXI_LITE] [get_bd_intf_pins reg_sc/S00_AXI]",
        f"connect_bd_intf_net [get_bd_intf_pins reg_sc/M00_AXI] [get_bd_intf_pins {ENGINE}/{interface.axil_bus}]",
    ]
    links = memory_links(board, interface)
    if links:
        body += _connect_links(board, interface, links)
        tcl.step("dfvg_connect", f"interface connections (register BAR, {len(links)} memory ports, "
                 "host path, interrupt)", body)
        return
    masters = [f"{XDMA}/M_AXI", f"{ENGINE}/{interface.axi_bus}"]
    hbm_clock = [_hbm_axi_clock(interface)] if _separate_memory_clock(interface) else []
    if board.memory.kind == HBM:
        # One SmartConnect per HBM port: clock and AXI4-to-AXI3 conversion.
        for port, (master, clocks) in enumerate(zip(masters, [[engine_clock, xdma_clock, *hbm_clock],
                                                              [engine_clock, *hbm_clock]])):
            sc = f"mem_sc_{port}"
            body += [f"# {master} to HBM port {port}.",
                     *_smartconnect(sc, 1, 1, clocks, engine_rstn),
                     f"connect_bd_intf_net [get_bd_intf_pins {master}] [get_bd_intf_pins {sc}/S00_AXI]",
                     f"connect_bd_intf_net [get_bd_intf_pins {sc}/M00_AXI] "
                     f"[get_bd_intf_pins {HBM_CELL}/{_hbm_port(board, port)}]"]
    else:
        slaves = _memory_slaves(board)
        ui_clocks = [clock for _, clock, _ in slaves]
        body += [f"# Both masters reach every {board.memory.kind} channel through one SmartConnect.",
                 *_smartconnect("mem_sc", len(masters), len(slaves), [engine_clock, xdma_clock, *ui_clocks],
                                engine_rstn)]
        body += [f"connect_bd_intf_net [get_bd_intf_pins {m}] [get_bd_intf_pins mem_sc/S{i:02d}_AXI]"
                 for i, m in enumerate(masters)]
        body += [f"connect_bd_intf_net [get_bd_intf_pins mem_sc/M{i:02d}_AXI] "
                 f"[get_bd_intf_pins {slave}]" for i, (slave, _, _) in enumerate(slaves)]
    tcl.step("dfvg_connect", "interface connections (register BAR, memory, interrupt)", body)


def _connect_links(board: CardPlatform, interface: EngineInterface,
                   links: list[MemoryLink]) -> list[str]:
    """Each engine master through its own bridge to its own controller port, and the host
    path beside them (a multi-port engine)."""
    engine_clock, xdma_clock = _engine_clock(), f"[get_bd_pins {XDMA}/axi_aclk]"
    engine_rstn = f"[get_bd_pins {ENGINE_RESET}/interconnect_aresetn]"
    xdma_rstn = f"[get_bd_pins {XDMA}/axi_aresetn]"
    host = host_path(board, interface)
    mem = board.memory
    body = []
    if mem.kind == HBM:
        mem_clock = _hbm_axi_clock(interface)
        mem_clocks = [mem_clock] if _separate_memory_clock(interface) else []
        body += [f"# Engine master p ({interface.axi_data_width} bits at {interface.clock_mhz:g} MHz) to HBM "
                 f"port SAXI_p ({mem.port_bits} bits at {interface.memory_clock_mhz:g} MHz, AXI3)",
                 "# through its own 1:1 SmartConnect: clock, width and AXI4-to-AXI3 (16-beat) conversion,",
                 "# and an address decode that answers DECERR outside the master's channel. No",
                 "# SmartConnect is shared between masters: each streams its pseudo-channel alone."]
        if host.bridge == HOST_SC:
            body += ["# The host DMA has an HBM port of its own, and reaches every pseudo-channel",
                     "# through the HBM's global switch.",
                     *_smartconnect(HOST_SC, 1, 1, [xdma_clock, *mem_clocks], xdma_rstn),
                     f"connect_bd_intf_net [get_bd_intf_pins {XDMA}/M_AXI] [get_bd_intf_pins {HOST_SC}/S00_AXI]",
                     f"connect_bd_intf_net [get_bd_intf_pins {HOST_SC}/M00_AXI] [get_bd_intf_pins {host.ports[0]}]"]
        for link in links:
            shared = link.host_shared
            if shared:
                body += [f"# {link.bridge} is 2:1: the host DMA (XDMA M_AXI) shares master {link.master}'s port; it",
                         "# carries host transfers only, and is idle while the engine drafts."]
            clocks = [engine_clock, *mem_clocks, *([xdma_clock] if shared else [])]
            body += [*_smartconnect(link.bridge, 2 if shared else 1, 1, clocks, engine_rstn),
                     f"connect_bd_intf_net [get_bd_intf_pins {ENGINE}/{link.bus}] "
                     f"[get_bd_intf_pins {link.bridge}/S00_AXI]"]
            if shared:
                body.append(f"connect_bd_intf_net [get_bd_intf_pins {XDMA}/M_AXI] "
                            f"[get_bd_intf_pins {link.bridge}/S01_AXI]")
            body.append(f"connect_bd_intf_net [get_bd_intf_pins {link.bridge}/M00_AXI] "
                        f"[get_bd_intf_pins {link.slave}]")
        return body
    # DDR4: one controller (one AXI slave) per channel. Engine master p and the host enter
    # channel p's controller through a 2:1 SmartConnect; a 1:N SmartConnect fans the host out.
    slaves = _memory_slaves(board)
    body += [f"# Engine master p to DDR4 channel p's controller ({mem.port_bits} bits at its UI clock)",
             "# through a 2:1 SmartConnect (clock crossing, and DECERR outside the channel); the",
             "# host DMA reaches every channel through the second slave of each. The host path",
             "# carries host transfers only, and is idle while the engine drafts.",
             *_smartconnect(HOST_SC, 1, len(links), [xdma_clock], xdma_rstn),
             f"connect_bd_intf_net [get_bd_intf_pins {XDMA}/M_AXI] [get_bd_intf_pins {HOST_SC}/S00_AXI]"]
    for link, (_, ui_clock, _) in zip(links, slaves):
        body += [*_smartconnect(link.bridge, 2, 1, [engine_clock, xdma_clock, ui_clock], engine_rstn),
                 f"connect_bd_intf_net [get_bd_intf_pins {ENGINE}/{link.bus}] "
                 f"[get_bd_intf_pins {link.bridge}/S00_AXI]",
                 f"connect_bd_intf_net [get_bd_intf_pins {HOST_SC}/M{link.master:02d}_AXI] "
                 f"[get_bd_intf_pins {link.bridge}/S01_AXI]",
                 f"connect_bd_intf_net [get_bd_intf_pins {link.bridge}/M00_AXI] "
                 f"[get_bd_intf_pins {link.slave}]"]
    return body


def _step_addresses(tcl: _Tcl, board: CardPlatform, interface: EngineInterface) -> None:
    reg_seg = f"[get_bd_addr_segs {ENGINE}/{interface.axil_bus}/reg0]"
    spaces = [f"[get_bd_addr_spaces {XDMA}/M_AXI]", f"[get_bd_addr_spaces {ENGINE}/{interface.axi_bus}]"]
    body = ["# The register file at offset 0 of the AXI-Lite BAR (/dev/xdma0_user).",
            f"assign_bd_address -target_address_space [get_bd_addr_spaces {XDMA}/M_AXI_LITE] "
            f"-offset 0x00000000 -range {REGISTER_BAR_KIB}K {reg_seg}"]
    links = memory_links(board, interface)
    if links:
        body += ["# Device memory at its physical addresses (card address = file offset of",
                 "# /dev/xdma0_h2c_0 and _c2h_0; the XDMA transport stripes the engine's logical",
                 "# space onto them): all of it for the DMA, one channel for each engine master."]
        body += _link_addresses(board, interface, links)
        tcl.step("dfvg_assign_addresses", "address map", body)
        return
    body += ["# Device memory at the same addresses for the DMA (card address = file offset of",
             "# /dev/xdma0_h2c_0 and _c2h_0) and for the engine: 0 up to its size."]
    if board.memory.kind == HBM:
        for space, port in zip(spaces, range(2)):
            # HBM segments have fixed offsets: HBM_MEM00 at 0, each pseudo-channel after it.
            body.append(f"assign_bd_address -target_address_space {space} "
                        f"[get_bd_addr_segs {HBM_CELL}/{_hbm_port(board, port)}/HBM_MEM*]")
    else:
        size = board.memory.bytes_per_channel
        for space in spaces:
            for i, (_, _, segment) in enumerate(_memory_slaves(board)):
                body.append(f"assign_bd_address -target_address_space {space} -offset 0x{i * size:X} "
                            f"-range {_range(size)} [get_bd_addr_segs {segment}]")
    tcl.step("dfvg_assign_addresses", "address map", body)


def _link_addresses(board: CardPlatform, interface: EngineInterface,
                    links: list[MemoryLink]) -> list[str]:
    """The host sees all of memory; each engine master only its channel."""
    host = host_path(board, interface)
    body = []
    space = f"[get_bd_addr_spaces {XDMA}/M_AXI]"
    body += [f"assign_bd_address -target_address_space {space} -offset 0x{offset:X} "
             f"-range {_range(size)} [get_bd_addr_segs {segment}]"
             for segment, offset, size in host.segments]
    for link in links:
        space = f"[get_bd_addr_spaces {ENGINE}/{link.bus}]"
        body.append(f"# Engine master {link.master} ({link.bus}): its channel, 0x{link.offset:X} + "
                    f"{_size_text(link.size)}; an address outside it is a DECERR.")
        body += [f"assign_bd_address -target_address_space {space} -offset 0x{offset:X} "
                 f"-range {_range(size)} [get_bd_addr_segs {segment}]"
                 for segment, offset, size in link.segments]
        body += [f"exclude_bd_addr_seg -offset 0x{offset:X} -range {_range(size)} "
                 f"-target_address_space {space} [get_bd_addr_segs {segment}]"
                 for segment, offset, size in link.excluded]
    return body


def _step_finish_bd(tcl: _Tcl) -> None:
    tcl.step("dfvg_finish_block_design", "validate the block design and make its wrapper", [
        "validate_bd_design",
        "save_bd_design",
        f"set wrapper [make_wrapper -files [get_files {BD_NAME}.bd] -top]",
        "add_files -norecurse $wrapper",
        f"set_property top {BD_NAME}_wrapper [current_fileset]",
        "update_compile_order -fileset sources_1",
    ])


def _step_implement(tcl: _Tcl, board: CardPlatform) -> None:
    bit = f"dfvg_{board.name}.bit"
    tcl.step("dfvg_implement", "synthesis, implementation and bitstream (long: tens of minutes)", [
        "launch_runs synth_1 -jobs $dfvg_jobs",
        "wait_on_run synth_1",
        'if {[get_property PROGRESS [get_runs synth_1]] ne "100%"} {',
        f'    error "{PROGRESS_PREFIX} synthesis failed: see [get_property DIRECTORY [get_runs synth_1]]/runme.log"',
        "}",
        f'puts "{PROGRESS_PREFIX} synthesis done; implementing"',
        "launch_runs impl_1 -to_step write_bitstream -jobs $dfvg_jobs",
        "wait_on_run impl_1",
        'if {[get_property PROGRESS [get_runs impl_1]] ne "100%"} {',
        f'    error "{PROGRESS_PREFIX} implementation failed: see [get_property DIRECTORY [get_runs impl_1]]/runme.log"',
        "}",
        "set wns [get_property STATS.WNS [get_runs impl_1]]",
        "if {$wns < 0} {",
        f'    puts "{PROGRESS_PREFIX} WARNING: timing not met (WNS $wns ns); the bitstream may not work at the target clock"',
        "}",
        "set bits [glob -nocomplain [file join [get_property DIRECTORY [get_runs impl_1]] *.bit]]",
        "if {[llength $bits] == 0} {",
        f'    error "{PROGRESS_PREFIX} implementation finished without a bitstream"',
        "}",
        f"file copy -force [lindex $bits 0] [file join $dfvg_dir {bit}]",
        f'puts "{PROGRESS_PREFIX} bitstream: [file join $dfvg_dir {bit}]"',
    ])


def tcl_flow(board: CardPlatform, interface: EngineInterface, xdc_name: str | None = None) -> str:
    """The Vivado batch script that builds ``interface``'s engine for ``board``."""
    xdc_name = xdc_name or f"{board.name}.xdc"
    check_memory_ports(board, interface)
    tcl = _Tcl()
    _step_project(tcl, board)
    _step_sources(tcl, board, interface, xdc_name)
    _step_block_design(tcl, board)
    _step_pcie(tcl, board)
    if board.memory.kind == HBM:
        # The memory controllers' resets and AXI clocks come from the clocking step.
        _step_clocking(tcl, board, interface)
        _step_hbm(tcl, board, interface)
    elif board.memory.kind == DDR4:
        _step_clocking(tcl, board, interface)
        _step_ddr4(tcl, board)
    elif board.memory.kind == DDR3:
        # Here the clocking step starts from the controller's UI clock.
        _step_ddr3(tcl, board)
        _step_clocking(tcl, board, interface)
    else:
        raise ValueError(f"board {board.name}: unknown memory kind {board.memory.kind!r}")
    _step_engine(tcl, interface)
    _step_connect(tcl, board, interface)
    _step_addresses(tcl, board, interface)
    _step_finish_bd(tcl)
    _step_implement(tcl, board)
    header = [
        f"# DFVG draft engine: Vivado flow for {board.describe()}.",
        "# Generated by boards.vivado; regenerate it with python -m dfvg_hw.build rather than edit.",
        f"# Run from anywhere: vivado -mode batch -source {TCL_NAME} [-tclargs JOBS]",
        "",
        "set dfvg_dir [file dirname [file normalize [info script]]]",
        "set dfvg_jobs 8",
        "if {[info exists argv] && [llength $argv] > 0} { set dfvg_jobs [lindex $argv 0] }",
    ]
    return tcl.render(header)


# ---------------------------------------------------------------------------------------
# Build tree and running Vivado
# ---------------------------------------------------------------------------------------

@dataclass(frozen=True)
class FlowFiles:
    """What :func:`write_flow` wrote.

    Attributes
    ----------
    directory : Path
    xdc, tcl : Path
    mig_prj : Path or None
        The MIG project file, on DDR3 cards.
    """
    directory: Path
    xdc: Path
    tcl: Path
    mig_prj: Path | None = None

    @property
    def command(self) -> str:
        """The one shell command that runs the flow on a Vivado machine."""
        return f"cd {self.directory} && vivado -mode batch -source {TCL_NAME}"


def write_flow(directory, board: CardPlatform, interface: EngineInterface) -> FlowFiles:
    """Write ``<board>.xdc`` and ``build.tcl`` (and, on DDR3 cards, the MIG project file)
    into ``directory`` (which holds the Verilog)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    xdc = directory / f"{board.name}.xdc"
    tcl = directory / TCL_NAME
    xdc.write_text(xdc_text(board, interface))
    tcl.write_text(tcl_flow(board, interface, xdc.name))
    mig_prj = None
    if board.memory.kind == DDR3:
        mig = board.memory.mig
        mig_prj = directory / MIG_PRJ_NAME
        mig_prj.write_text(prj_text(board, mig, _mig_module_name(),
                                    axi_addr_width=(mig.bytes - 1).bit_length()))
    return FlowFiles(directory, xdc, tcl, mig_prj)


def vivado_command(files: FlowFiles, jobs: int | None = None) -> list[str] | None:
    """argv that runs the flow with the ``vivado`` on PATH, or ``None`` if there is none."""
    exe = shutil.which("vivado")
    if exe is None:
        return None
    argv = [exe, "-mode", "batch", "-nojournal", "-source", str(files.tcl)]
    return argv + (["-tclargs", str(jobs)] if jobs else [])


def run_flow(files: FlowFiles, jobs: int | None = None, out=sys.stdout) -> int:
    """Run the flow in Vivado, echoing its progress lines to ``out``; returns the exit code.

    Vivado's full log goes to ``vivado.log`` in the build directory.
    """
    argv = vivado_command(files, jobs)
    if argv is None:
        raise FileNotFoundError(f"vivado is not on PATH; on a Vivado machine run: {files.command}")
    log_path = files.directory / "vivado.log"
    with open(log_path, "w") as log, subprocess.Popen(
            argv, cwd=files.directory, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            text=True) as proc:
        for line in proc.stdout:
            log.write(line)
            if line.startswith((PROGRESS_PREFIX, "ERROR")):
                out.write(line)
                out.flush()
    return proc.returncode
