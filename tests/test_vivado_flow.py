"""The board flow without Vivado: the generated Tcl runs under tclsh against recording stubs,
the XDC carries each card's pins, and the engine's port list lints as Verilog. The Alveo
cards first, then the Artix-7 M.2 cards (NiteFury II, LiteFury), whose pins are
amaranth-boards' own platform resources."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

import xml.etree.ElementTree as ET

from amaranth_boards.nitefury import LitefuryPlatform, NitefuryIIPlatform

from boards import ALVEO_BOARDS, BOARDS, DEFAULT_BOARD, get_board
from boards.vivado import (MIG_PRJ_NAME, TCL_NAME, EngineInterface, check_memory_ports, host_path,
                           memory_links, write_flow)
from dfvg_hw.axi4 import master_prefix
from dfvg_hw.spec.config import get_preset

#: Every Vivado command the flow may call, as stubs that log "name args…" one call a line.
#: Queries return their last argument, so that it serves as the object handle Vivado
#: would return. A command missing here fails the run with "invalid command name".
STUBS = r"""
set ::stub_log [open $::env(STUB_LOG) w]
proc stub_record {name arguments} {
    puts $::stub_log [concat [list $name] $arguments]
    flush $::stub_log
}
foreach cmd {create_project set_property add_files update_compile_order create_bd_design
             create_bd_intf_port create_bd_port connect_bd_intf_net connect_bd_net
             assign_bd_address exclude_bd_addr_seg validate_bd_design save_bd_design
             launch_runs wait_on_run} {
    proc $cmd {args} [format {stub_record %s $args; return {}} $cmd]
}
foreach cmd {get_bd_intf_ports get_bd_ports get_bd_intf_pins get_bd_pins get_bd_addr_spaces
             get_bd_addr_segs get_files get_runs get_ips create_bd_cell} {
    proc $cmd {args} [format {stub_record %s $args; return [lindex $args end]} $cmd]
}
proc current_project {} { return dfvg_project }
proc current_fileset {} { return sources_1 }
proc get_board_parts {args} {
    stub_record get_board_parts $args
    return [string map {* 1.3} [lindex $args end]]
}
proc make_wrapper {args} {
    stub_record make_wrapper $args
    return /stub/dfvg_bd_wrapper.v
}
proc get_property {name object} {
    stub_record get_property [list $name $object]
    switch -- $name {
        PROGRESS  { return 100% }
        STATS.WNS { return 0.042 }
        DIRECTORY { return $::env(STUB_RUN_DIR) }
        IP_DIR    { return [file join $::env(STUB_RUN_DIR) mig_ip] }
        default   { return {} }
    }
}
"""


def _tclsh() -> str:
    exe = shutil.which("tclsh")
    if exe is None:
        pytest.fail("tclsh is not installed: the Vivado flow test runs the generated Tcl under it "
                    "(Debian/Ubuntu package 'tcl')")
    return exe


def _interface(board) -> EngineInterface:
    return EngineInterface.for_config(get_preset(board.preset), ["dfvg_engine.v"])


def _run_flow(board, tmp_path: Path, interface: EngineInterface | None = None
              ) -> tuple[list[str], str, Path]:
    """Write the flow for ``board`` (and its preset's engine, or ``interface``) and run it
    under tclsh; returns (calls, stdout, build dir)."""
    build = tmp_path / "build"
    files = write_flow(build, board, interface or _interface(board))
    run_dir = tmp_path / "impl_1"
    run_dir.mkdir()
    (run_dir / "dfvg_bd_wrapper.bit").write_bytes(b"stub bitstream")
    driver = tmp_path / "driver.tcl"
    driver.write_text(STUBS + f"\nsource {{{files.tcl}}}\n")
    log = tmp_path / "calls.log"
    proc = subprocess.run([_tclsh(), str(driver)], capture_output=True, text=True, timeout=60,
                          env={"STUB_LOG": str(log), "STUB_RUN_DIR": str(run_dir), "PATH": "/usr/bin:/bin"})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return log.read_text().splitlines(), proc.stdout, build


def _first(calls: list[str], command: str, *words: str, after: int = -1) -> int:
    """Index of the first call of ``command`` after ``after`` whose text holds every word."""
    for i, call in enumerate(calls):
        # A trailing space lets a word like " xdma_0/M_AXI " match a whole argument.
        if i > after and call.split(" ", 1)[0] == command and all(w in call + " " for w in words):
            return i
    raise AssertionError(f"no {command} call with {words} after call {after}:\n" + "\n".join(calls))


@pytest.mark.parametrize("name", list(ALVEO_BOARDS))
def test_tcl_flow_issues_the_block_design_in_order(name, tmp_path):
    board = get_board(name)
    bus = _interface(board).axi_bus          # m_axi, or m00_axi on a multi-port preset
    calls, stdout, build = _run_flow(board, tmp_path)

    at = _first(calls, "create_project", f"-part {board.part}")
    at = _first(calls, "add_files", "dfvg_engine.v", after=at)
    at = _first(calls, "add_files", "constrs_1", f"{board.name}.xdc", after=at)
    at = _first(calls, "create_bd_design", after=at)
    at = _first(calls, "create_bd_cell", "xilinx.com:ip:xdma", after=at)
    xdma_config = _first(calls, "set_property", "CONFIG.axilite_master_en true", after=at)
    assert "CONFIG.xdma_axi_intf_mm AXI_Memory_Mapped" in calls[xdma_config]
    assert "CONFIG.xdma_num_usr_irq 1" in calls[xdma_config]
    assert f"CONFIG.pl_link_cap_max_link_width X{board.pcie.lanes}" in calls[xdma_config]
    if board.memory.kind == "HBM":
        at = _first(calls, "create_bd_cell", "xilinx.com:ip:hbm", after=at)
        assert sum("xilinx.com:ip:ddr4" in c for c in calls) == 0
    else:
        at = _first(calls, "create_bd_cell", "xilinx.com:ip:ddr4", after=at)
        assert sum("xilinx.com:ip:ddr4" in c for c in calls) == board.memory.channels
        assert _first(calls, "set_property", "board_part", "au250") < at
    at = _first(calls, "create_bd_cell", "-type module -reference dfvg_engine", after=at)
    engine = calls[at].split()[-1]
    # The interface connections, in any order, after the engine exists.
    at = max(_first(calls, "connect_bd_intf_net", "xdma_0/M_AXI_LITE", after=at),
             _first(calls, "connect_bd_intf_net", f"{engine}/s_axil", after=at),
             _first(calls, "connect_bd_intf_net", f"{engine}/{bus}", after=at),
             _first(calls, "connect_bd_intf_net", " xdma_0/M_AXI ", after=at),
             _first(calls, "connect_bd_net", f"{engine}/irq", "xdma_0/usr_irq_req", after=at))
    at = _first(calls, "assign_bd_address", "xdma_0/M_AXI_LITE", "-offset 0x00000000",
                f"{engine}/s_axil/reg0", after=at)
    for space in (" xdma_0/M_AXI ", f" {engine}/{bus} "):
        _first(calls, "assign_bd_address", space, after=at)
    at = _first(calls, "validate_bd_design", after=at)
    at = _first(calls, "make_wrapper", "-top", after=at)
    at = _first(calls, "launch_runs", "synth_1", after=at)
    _first(calls, "launch_runs", "impl_1", "-to_step write_bitstream", after=at)

    # Progress: every numbered step, then the bitstream lands in the build tree.
    steps = re.findall(r"^dfvg: \[(\d+)/(\d+)\]", stdout, re.M)
    assert [int(n) for n, _ in steps] == list(range(1, int(steps[0][1]) + 1))
    assert stdout.rstrip().endswith("dfvg: done")
    assert (build / f"dfvg_{board.name}.bit").read_bytes() == b"stub bitstream"


@pytest.mark.parametrize("name", list(BOARDS))
def test_tcl_flow_only_refers_to_objects_it_created(name, tmp_path):
    """Each pin, port or address space is looked up after its cell or port exists."""
    calls, _, _ = _run_flow(get_board(name), tmp_path)
    _check_created_before_use(calls)


def _check_created_before_use(calls: list[str]) -> None:
    cells, ports = set(), set()
    for call in calls:
        command, *args = call.split()
        if command == "create_bd_cell":
            cells.add(args[-1])
        elif command in ("create_bd_port", "create_bd_intf_port"):
            ports.add(args[-1])
        elif command in ("get_bd_pins", "get_bd_intf_pins", "get_bd_addr_spaces", "get_bd_addr_segs"):
            assert args[-1].split("/")[0] in cells, f"{call}: no such cell yet"
        elif command in ("get_bd_ports", "get_bd_intf_ports"):
            assert args[-1] in ports, f"{call}: no such port yet"


#: Independent spot check of the published pins (the platforms are the source the XDC uses).
PUBLISHED_PINS = {
    "alveo-u55c": {"pcie_refclk_clk_p": "AR15", "pcie_refclk_clk_n": "AR14", "pcie_perst_n": "BF41"},
    "alveo-u280": {"pcie_refclk_clk_p": "AR15", "pcie_refclk_clk_n": "AR14", "pcie_perst_n": "BH26"},
    "alveo-u250": {"pcie_refclk_clk_p": "AM11", "pcie_refclk_clk_n": "AM10", "pcie_perst_n": "BD21"},
}


@pytest.mark.parametrize("name", list(ALVEO_BOARDS))
def test_xdc_carries_clock_and_pcie_pins(name, tmp_path):
    board = get_board(name)
    files = write_flow(tmp_path, board, _interface(board))
    xdc, tcl = files.xdc.read_text(), files.tcl.read_text()
    pins = dict(re.findall(r"^set_property PACKAGE_PIN (\w+) \[get_ports (\w+)\]", xdc, re.M))
    pins = {port: pin for pin, port in pins.items()}
    for port, pin in PUBLISHED_PINS[name].items():
        assert pins.get(port) == pin, f"{port}: {pins.get(port)} != published {pin}"
    assert re.search(r"^create_clock -period 10\.000 -name pcie_refclk \[get_ports pcie_refclk_clk_p\]",
                     xdc, re.M)
    # Every board clock is constrained, and every constrained port is a block-design port.
    for clock in (board.fabric_clock, *board.memory.refclks):
        period = 1e3 / board.clock_mhz(clock)
        assert f"create_clock -period {period:.3f} -name {clock} [get_ports {clock}_clk_p]" in xdc
    for port in pins:
        bd_name = re.sub(r"_clk_[pn]$", "", port)
        assert re.search(rf"create_bd_(intf_)?port .* {bd_name}$", tcl, re.M), port
    assert re.search(r"IOSTANDARD LVCMOS1[28] \[get_ports pcie_perst_n\]", xdc)


def test_unknown_board_lists_the_known_ones():
    with pytest.raises(ValueError, match="known boards: alveo .*alveo-u55c, alveo-u280, alveo-u250"):
        get_board("alveo-u200")
    assert get_board("alveo").name == DEFAULT_BOARD == "alveo-u55c"


@pytest.mark.parametrize("name", list(ALVEO_BOARDS))
def test_board_records_part_preset_and_capacity(name):
    board = get_board(name)
    preset = get_preset(board.preset)
    assert board.part.startswith(board.device) and board.part.endswith("-2L-e")
    assert board.memory.total_bytes == preset.mem_bytes
    assert board.capacity.dsp > 0 and board.capacity.uram > 0
    # The controller ports the engine's masters land on (PG276, PG150).
    if board.memory.kind == "HBM":
        assert (board.memory.pseudo_channels, board.memory.port_bits, board.memory.port_max_mhz) == \
            (32, 256, 450.0)
        assert board.memory.hbm_8high == (name == "alveo-u55c")
    else:
        assert (board.memory.slave_ports, board.memory.port_bits, board.memory.port_max_mhz) == \
            (4, 512, 300.0)
    # The board's multi-port engine splits its memory into whole controller ports.
    iface = _multi_port_interface(name)
    check_memory_ports(board, iface)
    assert {link.size for link in memory_links(board, iface)} == {board.memory.port_span_bytes}
    table = board.capacity.table({"LUT": 1000, "FF": 2000, "DSP": 64, "BRAM": 10, "URAM": 96})
    assert f"{board.capacity.dsp}" in table and "%" in table


def test_engine_ports_lint_and_match_the_block_design(tmp_path):
    """The engine's Verilog (``python -m dfvg_hw.build``; the tiny preset, to keep it quick)
    lints, has exactly the ports the flow wires, and names every pin the Tcl uses."""
    from dfvg_hw.build import main as build_main
    from sim.lint import verilator_lint

    board = get_board("alveo")
    interface = EngineInterface.for_config(get_preset("tiny"), ["dfvg_engine.v"])
    assert build_main(["--board", "alveo", "--preset", "tiny", "--out", str(tmp_path)]) == 0
    verilog = (tmp_path / "dfvg_engine.v").read_text()
    clean, output = verilator_lint(verilog, top=interface.top)
    assert clean, output
    module = verilog[verilog.index(f"module {interface.top}("):]
    module = module[:module.index("endmodule")]
    ports = {m[2]: ("in" if m[0] == "input" else "out", int(m[1]) + 1 if m[1] else 1)
             for m in re.findall(r"^\s*(input|output)\s+(?:wire\s+|reg\s+)?(?:\[(\d+):0\]\s*)?(\w+);",
                                 module, re.M)}
    assert ports == {name: (d, width) for name, d, width in interface.ports()}
    declared = set(ports)
    tcl = write_flow(tmp_path, board, interface).tcl.read_text()
    for pin in set(re.findall(r"get_bd_pins engine/(\w+)", tcl)):
        assert pin in declared, pin
    for bus in set(re.findall(r"get_bd_intf_pins engine/(\w+)", tcl)):
        assert any(name.startswith(bus + "_") for name in declared), bus
    assert (tmp_path / TCL_NAME).exists()


# -- Multi-port engines (issue #14) ------------------------------------------------------

#: The multi-channel engines the card presets become (issue #14): 32 HBM masters of 512 bits
#: at 300 MHz with a 450 MHz HBM AXI clock; four DDR4 masters on the U250. Applied with
#: with_changes, so the tests hold whether or not the presets already carry them.
MULTI_PORT = {
    "alveo-u55c": dict(mem_ports=32, mem_port_bits=512, mem_clock_mhz=450.0, mem_achievable_gbps=421.0),
    "alveo-u280": dict(mem_ports=32, mem_port_bits=512, mem_clock_mhz=450.0, mem_achievable_gbps=421.0),
    "alveo-u250": dict(mem_ports=4, mem_port_bits=512, mem_clock_mhz=300.0),
}


def _multi_port_interface(name: str, **changes) -> EngineInterface:
    config = get_preset(get_board(name).preset).with_changes(**{**MULTI_PORT[name], **changes})
    return EngineInterface.for_config(config, ["dfvg_engine.v"])


def _args(call: str) -> list[str]:
    return call.split()[1:]


def _smartconnects(calls: list[str]) -> dict[str, dict]:
    """Every SmartConnect: its properties, clock nets, and interface connections."""
    cells = {c.split()[-1]: {"props": "", "clocks": [], "si": {}, "mi": {}}
             for c in calls if c.startswith("create_bd_cell") and "xilinx.com:ip:smartconnect" in c}
    for call in calls:
        words = _args(call)
        if call.startswith("set_property -dict") and words[-1] in cells:
            cells[words[-1]]["props"] = call
        elif call.startswith("connect_bd_net") and len(words) == 2:
            src, dst = words
            cell, _, pin = dst.partition("/")
            if cell in cells and pin.startswith("aclk"):
                cells[cell]["clocks"].append(src)
        elif call.startswith("connect_bd_intf_net") and len(words) == 2:
            for here, there in (words, words[::-1]):
                cell, _, pin = here.partition("/")
                if cell in cells and pin.startswith("S"):
                    cells[cell]["si"][pin] = there
                elif cell in cells and pin.startswith("M"):
                    cells[cell]["mi"][pin] = there
    return cells


@pytest.mark.parametrize("name", ["alveo-u55c", "alveo-u280"])
def test_hbm_flow_gives_each_of_32_masters_its_own_port(name, tmp_path):
    board = get_board(name)
    iface = _multi_port_interface(name)
    calls, stdout, _ = _run_flow(board, tmp_path, iface)
    suffix = "_8HI" if name == "alveo-u55c" else ""          # 8-high stacks on the XCU55C
    pc = board.memory.total_bytes // 32                      # 512 MiB or 256 MiB
    assert iface.axi_buses == tuple(master_prefix(p, 32).rstrip("_") for p in range(32))

    # Master p -> its own SmartConnect -> SAXI_p; 32 distinct bridges and ports, none of
    # them carrying two engine masters, and only bridge 0 shared (2:1) with the host DMA.
    scs = _smartconnects(calls)
    engine_scs = {}
    for sc, info in scs.items():
        masters = [m for m in info["si"].values() if m.startswith("engine/m")]
        assert len(masters) <= 1, f"{sc} funnels {masters}"
        if masters:
            engine_scs[masters[0]] = sc
    ports = set()
    for p, bus in enumerate(iface.axi_buses):
        sc = engine_scs[f"engine/{bus}"]
        info = scs[sc]
        assert info["mi"] == {"M00_AXI": f"hbm_0/SAXI_{p:02d}{suffix}"}, (bus, info)
        assert "CONFIG.NUM_MI 1" in info["props"]
        ports.add(info["mi"]["M00_AXI"])
        # Clock conversion 300 -> 450 MHz inside the bridge.
        assert info["clocks"][:2] == ["engine_clk_wiz/clk_out1", "hbm_clk_wiz/clk_out1"], info
        if p == 0:
            assert info["si"] == {"S00_AXI": "engine/m00_axi", "S01_AXI": "xdma_0/M_AXI"}
            assert "CONFIG.NUM_SI 2" in info["props"] and "xdma_0/axi_aclk" in info["clocks"]
        else:
            assert info["si"] == {"S00_AXI": f"engine/{bus}"} and "CONFIG.NUM_SI 1" in info["props"]
    assert len(set(engine_scs.values())) == len(ports) == 32
    assert not any(c.startswith("connect_bd_intf_net") and "engine/m" in c and "hbm_0/" in c for c in calls)

    # Clocks: engine 300 MHz, HBM AXI 450 MHz from the HBM reference clock, on every port.
    at = _first(calls, "create_bd_cell", "xilinx.com:ip:clk_wiz engine_clk_wiz")
    _first(calls, "set_property", "CONFIG.CLKOUT1_REQUESTED_OUT_FREQ 300.000", after=at)
    _first(calls, "create_bd_cell", "xilinx.com:ip:clk_wiz hbm_clk_wiz")
    _first(calls, "set_property", "CONFIG.PRIM_IN_FREQ 100.000", "CONFIG.CLKOUT1_REQUESTED_OUT_FREQ 450.000")
    _first(calls, "connect_bd_net", "hbm_refclk_bufg/BUFG_O", "hbm_clk_wiz/clk_in1")
    hbm = calls[_first(calls, "set_property", "CONFIG.USER_HBM_DENSITY")]
    assert f"CONFIG.USER_HBM_DENSITY {board.memory.total_bytes >> 30}GB" in hbm
    for prop in ("USER_AXI_CLK_FREQ 450", "USER_AXI_CLK1_FREQ 450", "USER_SWITCH_ENABLE_00 TRUE",
                 "USER_SWITCH_ENABLE_01 TRUE", "USER_CLK_SEL_LIST0 AXI_00_ACLK",
                 "USER_CLK_SEL_LIST1 AXI_16_ACLK"):
        assert f"CONFIG.{prop}" in hbm
    for p in range(32):
        assert f"CONFIG.USER_SAXI_{p:02d} true" in hbm
        _first(calls, "connect_bd_net", "hbm_clk_wiz/clk_out1", f"hbm_0/AXI_{p:02d}_ACLK")
        _first(calls, "connect_bd_net", "hbm_axi_reset/peripheral_aresetn", f"hbm_0/AXI_{p:02d}_ARESET_N")
    _first(calls, "connect_bd_net", "hbm_clk_wiz/locked", "hbm_axi_reset/dcm_locked")

    # Address map: master p sees exactly pseudo-channel p at p x 512 MiB (the rest excluded,
    # so an access outside it is a DECERR); the host sees all 32 at their physical addresses.
    size = f"{pc >> 20}M"
    mapped = {}
    for call in calls:
        words = _args(call)
        if call.startswith("assign_bd_address") and "-target_address_space" in words:
            space = words[words.index("-target_address_space") + 1]
            if space.startswith(("engine/m", "xdma_0/M_AXI")) and space != "xdma_0/M_AXI_LITE":
                mapped.setdefault(space, []).append((int(words[words.index("-offset") + 1], 16),
                                                     words[words.index("-range") + 1], words[-1]))
    for p, bus in enumerate(iface.axi_buses):
        assert mapped[f"engine/{bus}"] == [(p * pc, size, f"hbm_0/SAXI_{p:02d}{suffix}/HBM_MEM{p:02d}")]
        excluded = [c for c in calls if c.startswith("exclude_bd_addr_seg") and f" engine/{bus} " in c]
        assert len(excluded) == 31 and not any(f"/HBM_MEM{p:02d}" in c for c in excluded)
    assert mapped["xdma_0/M_AXI"] == [(k * pc, size, f"hbm_0/SAXI_00{suffix}/HBM_MEM{k:02d}")
                                      for k in range(32)]
    assert 32 * pc == board.memory.total_bytes == get_preset(board.preset).mem_bytes
    assert "32 of 32 ports at 450 MHz" in stdout and stdout.rstrip().endswith("dfvg: done")
    _check_created_before_use(calls)


def test_hbm_flow_constrains_the_new_clocks(tmp_path):
    board = get_board("alveo-u55c")
    files = write_flow(tmp_path, board, _multi_port_interface("alveo-u55c"))
    xdc = files.xdc.read_text()
    # The 450 MHz clock derives from hbm_refclk, the 300 MHz engine clock from sysclk3: two
    # asynchronous groups, so the only crossings are the SmartConnects' clock converters.
    for clock in ("hbm_refclk", "sysclk3", "pcie_refclk"):
        assert (f"set_clock_groups -asynchronous -group [get_clocks -include_generated_clocks {clock}]"
                in xdc)
    assert "HBM AXI clock 450 MHz: hbm_clk_wiz from hbm_refclk" in xdc
    assert "engine clock 300 MHz: engine_clk_wiz from sysclk3" in xdc
    assert "create_clock -period 10.000 -name hbm_refclk [get_ports hbm_refclk_clk_p]" in xdc


def test_u250_flow_puts_one_master_on_each_ddr4_channel(tmp_path):
    board = get_board("alveo-u250")
    iface = _multi_port_interface("alveo-u250")
    calls, stdout, _ = _run_flow(board, tmp_path, iface)
    assert sum("xilinx.com:ip:ddr4" in c for c in calls) == 4
    for i in range(4):            # the channels' board pins and clocks, as before
        _first(calls, "connect_bd_intf_net", f"ddr4_c{i}_sysclk", f"ddr4_c{i}/C0_SYS_CLK")
        _first(calls, "set_property", f"CONFIG.C0_DDR4_BOARD_INTERFACE ddr4_sdram_c{i}",
               "CONFIG.C0.DDR4_AxiDataWidth 512")
    scs = _smartconnects(calls)
    assert scs["host_sc"]["si"] == {"S00_AXI": "xdma_0/M_AXI"}
    assert scs["host_sc"]["clocks"] == ["xdma_0/axi_aclk"] and "CONFIG.NUM_MI 4" in scs["host_sc"]["props"]
    size = 16 << 30
    for p in range(4):
        sc = scs[f"mem_sc_{p:02d}"]
        assert sc["si"] == {"S00_AXI": f"engine/m{p:02d}_axi", "S01_AXI": f"host_sc/M{p:02d}_AXI"}
        assert sc["mi"] == {"M00_AXI": f"ddr4_c{p}/C0_DDR4_S_AXI"}
        assert sc["clocks"] == ["engine_clk_wiz/clk_out1", "xdma_0/axi_aclk", f"ddr4_c{p}/c0_ddr4_ui_clk"]
        segment = f"ddr4_c{p}/C0_DDR4_MEMORY_MAP/C0_DDR4_ADDRESS_BLOCK"
        own = [c for c in calls if c.startswith("assign_bd_address") and f" engine/m{p:02d}_axi " in c]
        assert own == [f"assign_bd_address -target_address_space engine/m{p:02d}_axi "
                       f"-offset 0x{p * size:X} -range 16G {segment}"]
        _first(calls, "assign_bd_address", " xdma_0/M_AXI ", f"-offset 0x{p * size:X}", segment)
    # Only one SmartConnect per engine master, and none shared by two of them.
    assert sorted(scs) == ["host_sc", "mem_sc_00", "mem_sc_01", "mem_sc_02", "mem_sc_03", "reg_sc"]
    assert stdout.rstrip().endswith("dfvg: done")
    _check_created_before_use(calls)


def test_hbm_flow_with_fewer_masters_gives_the_host_its_own_port(tmp_path):
    """4 masters of 8 pseudo-channels each: master p on SAXI_{8p}, the host on SAXI_01."""
    board = get_board("alveo-u55c")
    iface = _multi_port_interface("alveo-u55c", mem_ports=4)
    links, host = memory_links(board, iface), host_path(board, iface)
    pc = board.memory.total_bytes // 32
    assert [link.slave for link in links] == [f"hbm_0/SAXI_{8 * p:02d}_8HI" for p in range(4)]
    assert all(not link.host_shared for link in links)
    for p, link in enumerate(links):
        assert [seg for seg, _, _ in link.segments] == \
            [f"hbm_0/SAXI_{8 * p:02d}_8HI/HBM_MEM{k:02d}" for k in range(8 * p, 8 * p + 8)]
        assert (link.offset, link.size) == (p * 8 * pc, 8 * pc) and len(link.excluded) == 24
    assert host.bridge == "host_sc" and host.ports == ("hbm_0/SAXI_01_8HI",) and len(host.segments) == 32
    calls, _, _ = _run_flow(board, tmp_path, iface)
    scs = _smartconnects(calls)
    assert scs["host_sc"]["mi"] == {"M00_AXI": "hbm_0/SAXI_01_8HI"}
    hbm = calls[_first(calls, "set_property", "CONFIG.USER_HBM_DENSITY")]
    assert [p for p in range(32) if f"CONFIG.USER_SAXI_{p:02d} true" in hbm] == [0, 1, 8, 16, 24]


def test_flow_refuses_masters_the_memory_cannot_split_between():
    def iface(ports, **changes):
        return EngineInterface(("dfvg_engine.v",), 300.0, mem_ports=ports, **changes)
    with pytest.raises(ValueError, match="must divide 32"):
        check_memory_ports(get_board("alveo-u55c"), iface(64))
    with pytest.raises(ValueError, match="at most 450 MHz"):
        check_memory_ports(get_board("alveo-u280"), iface(32, mem_clock_mhz=500.0))
    with pytest.raises(ValueError, match="one master per DDR4 channel"):
        check_memory_ports(get_board("alveo-u250"), iface(2))
    with pytest.raises(ValueError, match="one-port engine"):
        check_memory_ports(get_board("nitefury"), iface(2))


@pytest.mark.parametrize("name", list(BOARDS))
def test_one_port_flows_keep_their_shared_smartconnect(name, tmp_path):
    """A one-port engine (the M.2 cards, tiny) generates the flow it always did: one master
    m_axi, no per-port bridges, no second memory clock, the whole memory for the engine."""
    board = get_board(name)
    for iface in (EngineInterface.for_config(get_preset("tiny"), ["dfvg_engine.v"]),
                  EngineInterface.for_config(get_preset(board.preset).with_changes(
                      mem_ports=1, mem_clock_mhz=0.0), ["dfvg_engine.v"])):
        assert iface.axi_buses == ("m_axi",) and memory_links(board, iface) == []
        text = write_flow(tmp_path, board, iface).tcl.read_text()
        for word in ("mem_sc_00", "host_sc", "hbm_clk_wiz", "exclude_bd_addr_seg", "m00_axi"):
            assert word not in text
    assert "m_axi_awaddr" in [n for n, _, _ in iface.ports()]
    if board.memory.kind == "HBM":
        # A one-port engine with an HBM clock of its own: the same two ports, at 450 MHz.
        iface = EngineInterface.for_config(get_preset(board.preset).with_changes(
            mem_ports=1, mem_clock_mhz=450.0), ["dfvg_engine.v"])
        calls, _, _ = _run_flow(board, tmp_path, iface)
        _check_created_before_use(calls)
        for port in (0, 1):
            _first(calls, "connect_bd_net", "hbm_clk_wiz/clk_out1", f"hbm_0/AXI_{port:02d}_ACLK")
            _first(calls, "connect_bd_net", "hbm_clk_wiz/clk_out1", f"mem_sc_{port}/aclk")


def test_engine_interface_lists_every_masters_ports():
    iface = _multi_port_interface("alveo-u55c")
    names = [name for name, _, _ in iface.ports()]
    assert len(names) == len(set(names))
    for p in range(32):
        prefix = master_prefix(p, 32)
        assert (prefix + "rdata", "in", 512) in iface.ports() and prefix + "arlen" in names
    assert not any(name.startswith("m_axi_") for name in names)


def test_multi_port_engine_top_matches_the_interface():
    """The engine's top-level members equal EngineInterface.ports() at the 4-port test
    preset (its signature only: no elaboration)."""
    import gc
    import warnings

    from amaranth.hdl import Shape, UnusedElaboratable

    from dfvg_hw.engine import DraftEngine

    config = get_preset("tiny-hbm")
    with warnings.catch_warnings():          # built for its signature, never elaborated
        warnings.simplefilter("ignore", UnusedElaboratable)
        members = dict(DraftEngine(config).signature.members)
        gc.collect()
    assert master_prefix(0, config.mem_ports) + "araddr" in members, \
        "the engine must expose one AXI4 master per memory port"
    iface = EngineInterface.for_config(config, ["dfvg_engine.v"])
    declared = {(name, "out" if m.flow.name == "Out" else "in", Shape.cast(m.shape).width)
                for name, m in members.items()}
    wanted = {port for port in iface.ports() if port[0] not in (iface.clock, iface.reset)}
    assert declared == wanted, declared ^ wanted


# -- The Artix-7 M.2 cards --------------------------------------------------------------

M2_BOARDS = {"nitefury": NitefuryIIPlatform, "litefury": LitefuryPlatform}


@pytest.mark.parametrize("name", list(M2_BOARDS))
def test_m2_tcl_flow_issues_the_block_design_in_order(name, tmp_path):
    board = get_board(name)
    calls, stdout, build = _run_flow(board, tmp_path)

    at = _first(calls, "create_project", f"-part {board.part}")
    assert board.part == M2_BOARDS[name]().device + M2_BOARDS[name]().package + "-2"
    at = _first(calls, "add_files", "constrs_1", f"{board.name}.xdc", after=at)
    # The board XDC overrides the XDMA's GT placement, so it is processed after the IP's.
    at = _first(calls, "set_property", "PROCESSING_ORDER LATE", f"{board.name}.xdc", after=at)
    at = _first(calls, "create_bd_intf_port", "ddrx_rtl", " ddr3", after=at)
    at = _first(calls, "create_bd_cell", "xilinx.com:ip:xdma", after=at)
    xdma = calls[_first(calls, "set_property", "CONFIG.axilite_master_en true", after=at)]
    for prop in ("pl_link_cap_max_link_width X4", "pl_link_cap_max_link_speed 5.0_GT/s",
                 "axi_data_width 128_bit", "axisten_freq 125", "xdma_num_usr_irq 1",
                 "xdma_axi_intf_mm AXI_Memory_Mapped"):
        assert f"CONFIG.{prop}" in xdma
    assert "pcie_blk_locn" not in xdma            # 7-series: one PCIe block, the IP's default
    _first(calls, "connect_bd_net", "pcie_refclk_buf/IBUF_OUT", "xdma_0/sys_clk", after=at)
    assert not any("sys_clk_gt" in c for c in calls)
    _first(calls, "connect_bd_net", "pcie_clkreq_low/dout", "pcie_clkreq_n", after=at)
    at = _first(calls, "create_bd_cell", "xilinx.com:ip:mig_7series", after=at)
    at = _first(calls, "set_property", f"CONFIG.XML_INPUT_FILE {MIG_PRJ_NAME}", after=at)
    _first(calls, "connect_bd_intf_net", "clk200", "mig_7series_0/SYS_CLK", after=at)
    # The engine clock comes from the MIG's UI clock (the board's one clock feeds the MIG).
    at = _first(calls, "create_bd_cell", "xilinx.com:ip:clk_wiz", after=at)
    _first(calls, "connect_bd_net", "mig_7series_0/ui_clk", "engine_clk_wiz/clk_in1", after=at)
    at = _first(calls, "create_bd_cell", "-type module -reference dfvg_engine", after=at)
    at = max(_first(calls, "connect_bd_intf_net", "engine/m_axi", "mem_sc/S01_AXI", after=at),
             _first(calls, "connect_bd_intf_net", " xdma_0/M_AXI ", "mem_sc/S00_AXI", after=at),
             _first(calls, "connect_bd_intf_net", "mem_sc/M00_AXI", "mig_7series_0/S_AXI", after=at),
             _first(calls, "connect_bd_net", "engine/irq", "xdma_0/usr_irq_req", after=at))
    size = "1G" if board.memory.total_bytes == 1 << 30 else "512M"
    for space in (" xdma_0/M_AXI ", " engine/m_axi "):
        _first(calls, "assign_bd_address", space, "-offset 0x0", f"-range {size}",
               "mig_7series_0/memmap/memaddr", after=at)
    at = _first(calls, "validate_bd_design", after=at)
    _first(calls, "launch_runs", "impl_1", "-to_step write_bitstream", after=at)
    # The MIG project file was copied into the IP's directory, where MIG reads it.
    assert (tmp_path / "impl_1" / "mig_ip" / MIG_PRJ_NAME).read_text() == (build / MIG_PRJ_NAME).read_text()
    assert stdout.rstrip().endswith("dfvg: done")
    assert (build / f"dfvg_{board.name}.bit").read_bytes() == b"stub bitstream"


@pytest.mark.parametrize("name", list(M2_BOARDS))
def test_m2_tcl_flow_only_refers_to_objects_it_created(name, tmp_path):
    test_tcl_flow_only_refers_to_objects_it_created(name, tmp_path)


def _xdc_pins(xdc: str) -> dict[str, str]:
    return {port.strip("{}"): pin for pin, port in
            re.findall(r"^set_property PACKAGE_PIN (\w+) \[get_ports ([\w{}\[\]]+)\]", xdc, re.M)}


@pytest.mark.parametrize("name", list(M2_BOARDS))
def test_m2_xdc_pins_are_the_amaranth_boards_platform_resources(name, tmp_path):
    board = get_board(name)
    files = write_flow(tmp_path, board, _interface(board))
    xdc, tcl = files.xdc.read_text(), files.tcl.read_text()
    # Expected pins straight from amaranth-boards' platform, independently of board_pins().
    plat = M2_BOARDS[name]()
    pcie = {sub.name: sub.ios[0] for sub in plat.lookup("pcie", 0).ios}
    clk200 = plat.lookup("clk200", 0).ios[0]
    expected = {"pcie_refclk_clk_p": pcie["clk"].p.names[0], "pcie_refclk_clk_n": pcie["clk"].n.names[0],
                "pcie_perst_n": pcie["rst"].names[0], "pcie_clkreq_n": pcie["clkreq"].names[0],
                "clk200_clk_p": clk200.p.names[0], "clk200_clk_n": clk200.n.names[0]}
    for d in ("rx", "tx"):
        for i in range(4):
            expected[f"pcie_mgt_{d}p[{i}]"] = pcie[d].p.names[i]
            expected[f"pcie_mgt_{d}n[{i}]"] = pcie[d].n.names[i]
    assert _xdc_pins(xdc) == expected
    # Spot check against the vendor's own constraints (RHS Research uEVB-early.xdc).
    assert expected["pcie_mgt_rxp[0]"] == "B10" and expected["pcie_refclk_clk_p"] == "F6"
    assert expected["pcie_perst_n"] == "J1" and expected["clk200_clk_p"] == "J19"
    assert "create_clock -period 5.000 -name clk200 [get_ports clk200_clk_p]" in xdc
    assert "create_clock -period 10.000 -name pcie_refclk [get_ports pcie_refclk_clk_p]" in xdc
    # GT pins take no I/O standard; every constrained port is a block-design port.
    assert not re.search(r"IOSTANDARD \S+ \[get_ports \{?pcie_(mgt|refclk)", xdc)
    for port in _xdc_pins(xdc):
        bd_name = re.sub(r"_clk_[pn]$", "", port)
        bd_name = "pcie_mgt" if bd_name.startswith("pcie_mgt_") else bd_name
        assert re.search(rf"create_bd_(intf_)?port .* {bd_name}$", tcl, re.M), port
    assert len(re.findall(r"^set_property LOC GTPE2_CHANNEL_X0Y[4-7] ", xdc, re.M)) == 4


@pytest.mark.parametrize("name", list(M2_BOARDS))
def test_m2_mig_project_pins_are_the_platform_ddr3_resource(name, tmp_path):
    board = get_board(name)
    files = write_flow(tmp_path, board, _interface(board))
    root = ET.parse(files.mig_prj).getroot()
    pins = {p.get("name"): (p.get("PADName"), p.get("IOSTANDARD")) for p in root.iter("Pin")
            if p.get("name", "").startswith("ddr3_")}
    ddr3 = {sub.name: sub.ios[0] for sub in M2_BOARDS[name]().lookup("ddr3", 0).ios}
    rows = board.memory.mig.row_bits
    expected = {f"ddr3_addr[{i}]": pad for i, pad in enumerate(ddr3["a"].names[:rows])}
    for sub, mig in (("ba", "ba"), ("dq", "dq"), ("dm", "dm")):
        expected.update({f"ddr3_{mig}[{i}]": pad for i, pad in enumerate(ddr3[sub].names)})
    for sub, mig in (("dqs", "dqs"), ("clk", "ck")):
        expected.update({f"ddr3_{mig}_p[{i}]": pad for i, pad in enumerate(ddr3[sub].p.names)})
        expected.update({f"ddr3_{mig}_n[{i}]": pad for i, pad in enumerate(ddr3[sub].n.names)})
    for sub, mig in (("ras", "ras_n"), ("cas", "cas_n"), ("we", "we_n"), ("rst", "reset_n")):
        expected[f"ddr3_{mig}"] = ddr3[sub].names[0]
    expected["ddr3_cke[0]"], expected["ddr3_odt[0]"] = ddr3["clk_en"].names[0], ddr3["odt"].names[0]
    assert {k: pad for k, (pad, _) in pins.items()} == expected
    # One 1.5 V bank: SSTL15, DIFF_SSTL15 on the pairs, LVCMOS15 on RESET#.
    assert {std for _, std in pins.values()} == {"SSTL15", "DIFF_SSTL15", "LVCMOS15"}
    assert pins["ddr3_reset_n"][1] == "LVCMOS15" and pins["ddr3_dqs_p[0]"][1] == "DIFF_SSTL15"
    # Size, width and clocks agree with the engine preset and the MIG's AXI port.
    preset = get_preset(board.preset)
    assert int(root.find(".//C0_MEM_SIZE").text) == board.memory.total_bytes == preset.mem_bytes
    assert int(root.find(".//C0_S_AXI_DATA_WIDTH").text) == preset.mem_port_bits == 128
    assert 1 << int(root.find(".//C0_S_AXI_ADDR_WIDTH").text) == preset.mem_bytes
    assert root.find(".//TimePeriod").text == "2500" and root.find(".//InputClkFreq").text == "200"
    assert root.find(".//ModuleName").text == "dfvg_bd_mig_7series_0_0"
    assert board.memory.mig.peak_gbps == preset.mem_bandwidth_gbps
