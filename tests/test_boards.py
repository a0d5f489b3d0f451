"""The NiteFury II / LiteFury targets: their engine presets validate, fit the Artix-7 part
they pair with, and the engine elaborates at them (elaboration only, to stay fast)."""

from __future__ import annotations

import re

import pytest
from amaranth.hdl import Fragment

from boards import DDR3, get_board
from boards.vivado import EngineInterface
from dfvg_hw.spec.config import get_preset

#: 36 Kb block RAM as 32 Kb of data (8-bit bytes, parity bits unused).
BRAM36_BYTES = 4096


@pytest.mark.parametrize("name", ["nitefury", "litefury"])
def test_m2_board_pairs_with_a_preset_that_fits_its_part(name):
    board = get_board(name)
    preset = get_preset(board.preset)
    preset.validate()
    assert preset.source
    assert board.memory.kind == DDR3 and board.memory.total_bytes == preset.mem_bytes
    assert board.part.startswith(board.device) and board.capacity.uram == 0
    # The engine's memory port is the MIG's native AXI width, and the link and memory
    # bandwidths are what the preset models.
    assert EngineInterface.for_config(preset, ["dfvg_engine.v"]).axi_data_width == \
        board.memory.mig.axi_data_width == preset.mem_port_bits
    assert preset.mem_bandwidth_gbps == board.memory.mig.peak_gbps
    assert preset.engine_bandwidth_gbps >= preset.mem_bandwidth_gbps
    # With no URAM the KV buffer lives in block RAM: it must leave room for the rest.
    assert preset.kv_bytes <= 0.6 * board.capacity.bram36 * BRAM36_BYTES
    # The matrix unit takes ~0.51 DSP per MAC (the alveo-u55c estimate in the README:
    # 8,320 DSPs for 16,384 MACs): it must leave at least half the part's DSPs.
    assert 0.51 * preset.macs_per_cycle <= 0.5 * board.capacity.dsp
    table = board.capacity.table({"LUT": 1000, "FF": 2000, "DSP": 64, "BRAM": 10, "URAM": 0})
    assert f"{board.capacity.dsp}" in table and "URAM" in table


@pytest.mark.parametrize("name", ["nitefury", "litefury"])
def test_engine_elaborates_at_the_m2_presets(name):
    from dfvg_hw.engine import DraftEngine

    config = get_preset(get_board(name).preset)
    fragment = Fragment.get(DraftEngine(config, config.mem_port_bits), None)
    assert fragment is not None


@pytest.mark.parametrize("name", ["alveo-u55c", "alveo-u280", "alveo-u250", "nitefury", "litefury"])
def test_board_preset_memory_ports_fit_the_memory_system(name):
    """Each card's own preset can be built by its board flow: its memory masters divide
    the controller ports, and (on a multi-port preset) each master moves at least what its
    controller port does, so the bridge between them is not the bottleneck."""
    from boards.vivado import check_memory_ports, memory_links

    board = get_board(name)
    preset = get_preset(board.preset)
    iface = EngineInterface.for_config(preset, ["dfvg_engine.v"])
    check_memory_ports(board, iface)
    if preset.mem_ports > 1:
        mem = board.memory
        assert preset.mem_channel_bytes % mem.port_span_bytes == 0
        assert [link.offset for link in memory_links(board, iface)] == \
            [p * preset.mem_channel_bytes for p in range(preset.mem_ports)]
        ports_per_master = mem.slave_ports // preset.mem_ports
        assert preset.mem_port_bits * preset.clock_mhz >= \
            ports_per_master * mem.port_bits * min(iface.memory_clock_mhz, mem.port_max_mhz)


def test_controller_elaborates_past_a_512_bit_engine_beat():
    """An engine beat wider than 512 bits (8 × 128-bit channels here; 32 × 512 on the
    U55C) elaborates: the MATMUL sequencer takes the whole beat, every other part one
    channel's through the BeatNarrower (no simulation: Fragment.get only)."""
    from amaranth.hdl import Fragment
    from dfvg_hw.controller import Controller

    config = get_preset("tiny-hbm").with_changes(name="tiny-hbm-8ch", mem_ports=8, lanes=16)
    controller = Controller(config, config.mem_ports * config.mem_port_bits)
    Fragment.get(controller, None).prepare()
    assert controller.data_width == 1024 and controller.unit_width == 128
    assert controller.units["matmul"].data_width == 1024
    assert {name: unit.data_width for name, unit in controller.units.items() if name != "matmul"} \
        == dict.fromkeys(("norm", "kv", "rope", "actmul", "embed"), 128)
    assert controller.narrower.pieces == 8


@pytest.mark.parametrize("argv, message", [
    (["--draft-cores", "2"], "--draft-cores is for the estimate: give it with --estimate"),
    (["--draft-cores", "17", "--estimate"], "draft_cores = 17"),
    (["--verilog", "{engine}"], "--verilog is for the estimate"),
    (["--jobs", "2"], "--jobs is for the estimate"),
    (["--estimate", "--jobs", "0"], "--jobs 0: give at least 1"),
    (["--estimate", "--verilog", "{engine}", "--run"], "leave one out"),
    (["--estimate", "--verilog", "{tmp}/missing.v"], "No such file"),
    (["--estimate", "--verilog", "{other}"], "has no module dfvg_engine: give the dfvg_engine.v"),
    (["--estimate", "--verilog", "{engine}"], "has 2 memory channel modules where the tiny preset's engine "
                                              "has 0"),
])
def test_estimate_arguments(argv, message, tmp_path, capsys):
    """The estimate's arguments, and a saved Verilog that is not the preset's engine, are
    refused before anything is synthesised."""
    from dfvg_hw.build import CHANNEL_MODULE, TOP, main
    channel = "".join(f"module \\{CHANNEL_MODULE.format(p)} (clk);\nendmodule\n" for p in range(2))
    (tmp_path / "engine.v").write_text(f"module {TOP}(clk);\nendmodule\n{channel}")
    (tmp_path / "other.v").write_text("module top(clk);\nendmodule\n")
    files = {"engine": tmp_path / "engine.v", "other": tmp_path / "other.v", "tmp": tmp_path}
    with pytest.raises(SystemExit) as exc:
        main(["--board", "alveo", "--preset", "tiny", "--out", str(tmp_path),
              *(arg.format(**files) for arg in argv)])
    assert exc.value.code == 2 and message in capsys.readouterr().err


def test_board_estimate_synthesises_the_engine_in_parts(monkeypatch):
    """At a striped board preset the estimate synthesises the engine in parts, each its
    own Yosys run: the matrix unit from a slice (× lanes/slice), one memory channel's port
    (× mem_ports), each separate module without the separate modules inside it (the KV
    unit without the attention unit and the KV buffer, the striped reader without its
    channels), and the rest with all of them left out, so that every module is counted
    exactly once."""
    import dfvg_hw.synthesis
    from dfvg_hw import build as flow

    calls = {}

    def fake_yosys(verilog_text, top="top", timeout=1800, blackbox=()):
        calls[top] = blackbox
        return {"LUT": 10.0, "FF": 20.0, "DSP": 1.0, "BRAM": 0.0, "URAM": 0.0}

    monkeypatch.setattr(dfvg_hw.synthesis, "yosys_resources", fake_yosys)
    config = get_preset("alveo-u55c")
    verilog = "".join(f"module \\{name} (clk);\nendmodule\n" for name in flow.SEPARATE_MODULES)
    total, parts = flow.estimate(config, verilog, log=lambda message: None, jobs=2)
    channels = {flow.CHANNEL_MODULE.format(p) for p in range(config.mem_ports)}
    assert set(calls) == {flow.TOP, "matrix", "channel", *flow.SEPARATE_MODULES}
    assert set(calls[flow.TOP]) == {flow.MATRIX_MODULE, *channels, *flow.SEPARATE_MODULES}
    kv = f"{flow.TOP}.controller.kv"
    assert set(calls[kv]) == {f"{kv}.attention", f"{kv}.kv"}
    assert set(calls[f"{flow.TOP}.memory_port"]) == channels
    assert calls[f"{flow.TOP}.controller.matmul"] == (flow.MATRIX_MODULE,)
    assert calls[f"{kv}.attention"] == () and calls[f"{flow.TOP}.controller.sample_unit.sampler"] == ()
    scale = config.lanes / flow.MATRIX_SLICE_LANES
    assert total["LUT"] == 10 + 10 * scale + 10 * config.mem_ports + 10 * len(flow.SEPARATE_MODULES)
    assert "32 x 512-bit" in parts[2][0] and parts[2][1]["FF"] == 20 * 32
    names = [name for name, _ in parts[3:]]
    assert len(names) == len(flow.SEPARATE_MODULES)
    assert "controller.kv without attention, kv [synthesised]" in names
    assert "controller.sample_unit.sampler [synthesised]" in names


def test_a_synthesis_part_reads_only_its_modules():
    """``select_modules`` hands Yosys one part of a design: the part's top and its
    submodules, a blackboxed module cut to a stub with its ports (and its own submodules
    dropped), nothing outside the part; reading the whole Alveo engine for each part took
    Yosys past this machine's memory."""
    from amaranth import Module
    from amaranth.lib import wiring
    from amaranth.lib.wiring import In, Out
    from dfvg_hw.synthesis import select_modules
    from dfvg_hw.verilog import to_verilog

    class Inc(wiring.Component):
        def __init__(self, depth):
            self.depth = depth
            super().__init__({"i": In(8), "o": Out(8)})

        def elaborate(self, platform):
            m = Module()
            if self.depth:
                inner = m.submodules.inner = Inc(self.depth - 1)
                m.d.comb += inner.i.eq(self.i)
                m.d.sync += self.o.eq(inner.o + 1)
            else:
                m.d.sync += self.o.eq(self.i + 1)
            return m

    class Pair(wiring.Component):
        def __init__(self):
            super().__init__({"i": In(8), "o": Out(8)})

        def elaborate(self, platform):
            m = Module()
            a = m.submodules.a = Inc(1)
            b = m.submodules.b = Inc(0)
            m.d.comb += [a.i.eq(self.i), b.i.eq(a.o), self.o.eq(b.o)]
            return m

    text = to_verilog(Pair(), "top")
    names = lambda verilog: re.findall(r"^module \\?(\S+?)\s*\(", verilog, re.M)
    assert sorted(names(text)) == ["top", "top.a", "top.a.inner", "top.b"]
    rest = select_modules(text, "top", blackbox=("top.a",))
    assert sorted(names(rest)) == ["top", "top.a", "top.b"]
    stub = rest[rest.index("module \\top.a "):]
    stub = stub[:stub.index("endmodule")]
    assert "(* blackbox *)\nmodule \\top.a " in rest and "always" not in stub
    ports = sorted(re.findall(r"^ *((?:input|output) (?:\[7:0\] )?\w+);$", stub, re.M))
    assert sorted(p.split()[-1] for p in ports) == ["clk", "i", "o", "rst"]
    # boxes nested in boxes: the outer one's stub alone (the inner one is its business)
    assert select_modules(text, "top", blackbox=("top.a.inner", "top.a")) == rest
    part = select_modules(text, "top.a")
    assert sorted(names(part)) == ["top.a", "top.a.inner"] and "blackbox" not in part
    with pytest.raises(ValueError, match="top.c"):
        select_modules(text, "top.c")
