"""Build the draft engine for a PCIe card: an Alveo, or a NiteFury II / LiteFury M.2 card.

    python -m dfvg_hw.build --board alveo [--preset NAME] [--out DIR] [--run] [--estimate [--draft-cores N]]
    python -m dfvg_hw.build --board nitefury --out build/nitefury

Elaborates :class:`~dfvg_hw.engine.DraftEngine` for the board's engine preset (or
``--preset``), writes ``dfvg_engine.v``, the board's XDC and the Vivado Tcl flow
(``boards.vivado``: XDMA, HBM, DDR4 or MIG 7-series DDR3 with its project file, clocking,
the engine as a module reference, the address map, synthesis to bitstream) into the build
directory, then:

* ``--run`` with ``vivado`` on PATH runs the flow, echoing its progress;
* otherwise prints the one command that runs it on a Vivado machine;
* ``--estimate`` synthesises the Verilog with Yosys (``synth_xilinx -family xcup``,
  ``pip install 'dfvg[synth]'``) and prints LUT / FF / DSP / BRAM / URAM next to the
  part's capacity (on the Artix-7 cards the cells counted are still UltraScale+ ones, an
  approximation of DSP48E1/RAMB36E1 use). A matrix unit wider than :data:`MATRIX_SLICE_LANES` lanes (thousands
  of multipliers: Yosys does not finish it here) is left out of the engine's synthesis
  and estimated from a slice of that many lanes, scaled by lanes ÷ slice lanes; lanes
  are independent columns, so the scaling is linear. The table says which rows are
  extrapolated, and so are the memory channels' ports of a striped board engine (one
  synthesised, times ``mem_ports``). ``DFVG_YOSYS=/usr/bin/yosys`` runs a native Yosys
  instead of yowasp's (the 32-channel engine needs more memory than WebAssembly's 4 GB;
  Debian's ``yosys`` package). ``--draft-cores N`` adds a card of N cores (``DraftCores``): N times the
  engine's counts plus the memory arbiters and register windows, synthesised on their own,
  and compares that with the part.
"""

from __future__ import annotations

import argparse
import re
import sys
import time
from pathlib import Path
from typing import NamedTuple

from boards import board_names, get_board
from boards.vivado import EngineInterface, check_memory_ports, run_flow, vivado_command, write_flow
from dfvg_hw.spec.config import ConfigError, get_preset
from dfvg_hw.engine import DraftEngine

__all__ = ["build", "main"]

TOP = "dfvg_engine"
#: The matrix unit is synthesised as a slice of this many lanes when it is wider.
MATRIX_SLICE_LANES = 4
MATRIX_MODULE = f"{TOP}.controller.matmul.matrix"
#: Memory channel ``p``'s port in a striped engine (``CHANNEL_MODULE.format(p)``).
CHANNEL_MODULE = f"{TOP}.memory_port.channel{{}}"
#: Modules a board-preset estimate synthesises on their own, beside the rest of the engine,
#: so that no one Yosys run has to hold more than a few MB of Verilog and the table shows
#: where the card goes: the largest leaves after the matrix unit (the sampler's
#: vocabulary-wide top-k, the attention unit's banked datapath, the KV buffer's URAM and
#: BRAM, ACTMUL's activation tables), then the units around them (each without the parts
#: inside it) and the striped reader without its channels. Yosys's time grows faster than
#: the Verilog does: the 5 MB left after the leaves alone ran for over an hour.
SEPARATE_MODULES = (f"{TOP}.controller.sample_unit.sampler", f"{TOP}.controller.kv.attention",
                    f"{TOP}.controller.kv.kv", f"{TOP}.controller.actmul.act",
                    f"{TOP}.controller.kv", f"{TOP}.controller.actmul", f"{TOP}.controller.matmul",
                    f"{TOP}.controller.norm", f"{TOP}.memory_port")


def _log(message: str) -> None:
    print(f"dfvg_hw.build: {message}", file=sys.stderr, flush=True)


def build(board_name: str, preset: str | None = None, out: str | Path | None = None, *,
          data_width: int | None = None, log=_log):
    """Write the build tree; return (board, config, FlowFiles, Verilog path)."""
    board = get_board(board_name)
    config = get_preset(preset or board.preset)
    width = data_width or config.mem_port_bits
    iface = EngineInterface.for_config(config, [f"{TOP}.v"], axi_data_width=width)
    check_memory_ports(board, iface)
    directory = Path(out or f"build/{board.name}-{config.name}")
    directory.mkdir(parents=True, exist_ok=True)
    start = time.monotonic()
    log(f"elaborating the {config.name} engine for {board.name} ({board.part}) "
        f"({config.mem_ports} × {width}-bit memory port{'s' if config.mem_ports > 1 else ''}); "
        f"large presets take minutes")
    from dfvg_hw.verilog import to_verilog
    verilog = directory / f"{TOP}.v"
    verilog.write_text(to_verilog(DraftEngine(config, width), TOP, for_fpga=True))
    log(f"wrote {verilog} ({verilog.stat().st_size / 1e6:.1f} MB) in {time.monotonic() - start:.0f} s")
    files = write_flow(directory, board, iface)
    extra = f", {files.mig_prj.name}" if files.mig_prj else ""
    log(f"wrote {files.xdc.name}{extra} and {files.tcl.name}")
    return board, config, files, verilog


def _count(x: float) -> str:
    return f"{x:,.0f}" if x == int(x) else f"{x:,.1f}"


def saved_engine_verilog(path: Path, config) -> str:
    """The text of an engine Verilog that :func:`build` wrote earlier for ``config``,
    checked to be one: its top module, and as many memory channels as the preset has."""
    text = path.read_text()
    if not re.search(rf"^module \\?{TOP}\s*\(", text, re.M):
        raise ValueError(f"{path} has no module {TOP}: give the {TOP}.v of a build tree")
    channels = len(re.findall(rf"^module \\{re.escape(CHANNEL_MODULE.format(''))}\d+ ", text, re.M))
    expected = config.mem_ports if config.mem_ports > 1 else 0
    if channels != expected:
        raise ValueError(f"{path} has {channels} memory channel modules where the {config.name} preset's "
                         f"engine has {expected}: give the Verilog of a build of {config.name}, or the "
                         "--preset it was built for")
    return text


class EstimatePart(NamedTuple):
    """One Yosys run of a board-preset estimate: ``top`` of ``verilog`` with the modules of
    ``blackbox`` left out, its counts times ``scale``."""

    name: str
    scale: float
    verilog: str
    top: str
    blackbox: tuple[str, ...]


def _short(module: str) -> str:
    """How a part's name calls a module it leaves out."""
    return "channels" if module.startswith(CHANNEL_MODULE.format("")) else module.rsplit(".", 1)[-1]


def estimate_parts(config, verilog_text: str) -> list[EstimatePart]:
    """The Yosys runs of a board-preset estimate (:func:`estimate`), the rest of the
    engine first."""
    from dfvg_hw.matrix import MatrixUnit
    from dfvg_hw.memory_port import MemoryPort
    from dfvg_hw.verilog import to_verilog
    from dfvg_hw import synthesis

    channels = config.mem_ports if config.mem_ports > 1 else 0
    separate = tuple(name for name in SEPARATE_MODULES if f"module \\{name} (" in verilog_text)
    boxes = (MATRIX_MODULE,) + tuple(CHANNEL_MODULE.format(p) for p in range(channels)) + separate
    scale = config.lanes / MATRIX_SLICE_LANES
    parts = [EstimatePart("rest of the engine [synthesised]", 1, verilog_text, TOP, boxes),
             EstimatePart(f"matrix unit {config.rows}x{config.lanes}x{config.reduce} [extrapolated "
                          f"x{scale:g} from a {MATRIX_SLICE_LANES}-lane slice, synthesised]", scale,
                          to_verilog(MatrixUnit(config.with_changes(lanes=MATRIX_SLICE_LANES)), "matrix",
                                     for_fpga=True), "matrix", ())]
    if channels:
        port = MemoryPort(config, data_width=config.mem_port_bits, channel=1, channels=channels)
        parts.append(EstimatePart(f"memory ports, {channels} x {config.mem_port_bits}-bit [one synthesised, "
                                  f"x{channels}]", channels, to_verilog(port, "channel", for_fpga=True),
                                  "channel", ()))
    for name in separate:
        inner = tuple(box for box in boxes if box != name and synthesis.within(box, name))
        without = " without " + ", ".join(dict.fromkeys(map(_short, inner))) if inner else ""
        parts.append(EstimatePart(f"{name.removeprefix(TOP + '.')}{without} [synthesised]", 1,
                                  verilog_text, name, inner))
    return parts


def estimate(config, verilog_text: str, log=_log, jobs: int | None = None
             ) -> tuple[dict, list[tuple[str, dict]]]:
    """Yosys estimate of the engine: (total, [(part, counts), …]).

    At a board preset (a matrix unit wider than :data:`MATRIX_SLICE_LANES`) the engine is
    synthesised in parts (:func:`estimate_parts`), each part its own Yosys run on the same
    Verilog (its module as the top), ``jobs`` of them at once (default: one a CPU core):

    * the matrix unit, extrapolated from a slice (lanes are independent columns);
    * one memory channel's port, times ``mem_ports`` (the ports differ only in their
      address range);
    * each module of :data:`SEPARATE_MODULES` that the engine has, with the parts inside
      it left out (blackboxed);
    * the rest: the engine with all of the above left out.

    No logic is counted twice or left out; a part's boundary only stops Yosys from
    optimising across it, so the sum is, if anything, high. Each part's counts are logged
    as it ends, so a run cut short still says where the card goes. The 32-channel engine's
    Verilog (74 MB) is more than yowasp's WebAssembly Yosys holds: run a native Yosys
    (``DFVG_YOSYS``)."""
    import os
    from concurrent.futures import ThreadPoolExecutor
    from dfvg_hw import synthesis

    if config.lanes <= MATRIX_SLICE_LANES:
        log("synthesising the engine with Yosys synth_xilinx -family xcup")
        used = synthesis.yosys_resources(verilog_text, TOP, timeout=24 * 3600)
        return used, [("engine [synthesised]", used)]
    runs = estimate_parts(config, verilog_text)
    workers = max(1, min(len(runs), jobs or os.cpu_count() or 1))
    log(f"synthesising the engine in {len(runs)} parts, {workers} at a time (Yosys synth_xilinx "
        "-family xcup; an hour or more at board presets)")

    def run(part: EstimatePart) -> tuple[str, dict]:
        start = time.monotonic()
        counts = synthesis.yosys_resources(part.verilog, part.top, timeout=24 * 3600,
                                           blackbox=part.blackbox)
        counts = {k: v * part.scale for k, v in counts.items()}
        log(f"{part.name.split(' [')[0]} ({time.monotonic() - start:.0f} s): {_counts(counts)}")
        return part.name, counts

    with ThreadPoolExecutor(workers) as pool:
        parts = list(pool.map(run, runs))
    cells = set().union(*(counts for _, counts in parts))
    total = {k: sum(counts.get(k, 0) for _, counts in parts) for k in cells}
    return total, parts


def _counts(counts: dict) -> str:
    return ", ".join(f"{k} {_count(counts.get(k, 0))}" for k in ("LUT", "FF", "DSP", "BRAM", "URAM"))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m dfvg_hw.build", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--board", default="alveo", help=f"one of: {', '.join(board_names())}")
    ap.add_argument("--preset", help="engine preset (default: the board's own)")
    ap.add_argument("--out", help="build directory (default: build/<board>-<preset>)")
    ap.add_argument("--run", action="store_true", help="run the Vivado flow (needs vivado on PATH)")
    ap.add_argument("--estimate", action="store_true", help="Yosys resource estimate of the engine")
    ap.add_argument("--draft-cores", type=int, default=1, metavar="N",
                    help="with --estimate: also the estimate of a card with N draft cores (N engines, "
                         "the memory arbiters and the register windows; dfvg_hw/draft_cores.py)")
    ap.add_argument("--verilog", metavar="FILE",
                    help="with --estimate: estimate this engine Verilog, written by an earlier build of "
                         "the same board and preset, instead of elaborating the engine again (35 min "
                         "at alveo-u55c on 2 cores); writes no build tree")
    ap.add_argument("--jobs", type=int, metavar="N",
                    help="with --estimate: Yosys runs at once (default: one a CPU core; a part of a "
                         "board preset can pass 7 GB)")
    args = ap.parse_args(argv)
    for flag, value in (("--draft-cores", args.draft_cores != 1), ("--verilog", args.verilog),
                        ("--jobs", args.jobs is not None)):
        if value and not args.estimate:
            ap.error(f"{flag} is for the estimate: give it with --estimate")
    if args.verilog and args.run:
        ap.error("--verilog estimates a saved Verilog; --run needs the build tree: leave one out")
    if args.jobs is not None and args.jobs < 1:
        ap.error(f"--jobs {args.jobs}: give at least 1")
    try:
        if args.verilog:
            board = get_board(args.board)
            config = get_preset(args.preset or board.preset)
            verilog_text = saved_engine_verilog(Path(args.verilog), config)
        else:
            board, config, files, verilog = build(args.board, args.preset, args.out)
            verilog_text = verilog.read_text() if args.estimate else ""
        cores = config.with_changes(draft_cores=args.draft_cores)
    except (OSError, ValueError, ConfigError) as exc:
        ap.error(str(exc))
    if args.estimate:
        used, parts = estimate(config, verilog_text, jobs=args.jobs)
        if cores.draft_cores > 1:
            from dfvg_hw.draft_cores import estimate as cores_estimate
            card = cores_estimate(cores, core=used)
            parts.append((f"{cores.draft_cores} draft cores: {cores.draft_cores} x the engine + the "
                          "memory arbiters and register windows [synthesised]", card))
            used = card
        print(f"{board.name} ({board.part}), engine preset {config.name}: Yosys estimate "
              "[not placed]")
        for name, counts in parts:
            print(f"  {name}: {_counts(counts)}")
        print(board.capacity.table(used))
        if args.verilog:
            return 0
    if args.run:
        if vivado_command(files) is None:
            ap.error(f"vivado is not on PATH; on a Vivado machine run: {files.command}")
        return run_flow(files)
    print(f"build tree ready in {files.directory}; on a Vivado machine run:\n  {files.command}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
