"""Build the draft engine for an Alveo card.

    python -m dfvg_hw.build --board alveo [--preset NAME] [--out DIR] [--run] [--estimate]

Elaborates :class:`~dfvg_hw.engine.DraftEngine` for the board's engine preset (or
``--preset``), writes ``dfvg_engine.v``, the board's XDC and the Vivado Tcl flow
(``boards.vivado``: XDMA, HBM or DDR4, clocking, the engine as a module reference, the
address map, synthesis to bitstream) into the build directory, then:

* ``--run`` with ``vivado`` on PATH runs the flow, echoing its progress;
* otherwise prints the one command that runs it on a Vivado machine;
* ``--estimate`` synthesises the Verilog with Yosys (``synth_xilinx -family xcup``,
  ``pip install 'dfvg[synth]'``) and prints LUT / FF / DSP / BRAM / URAM next to the
  part's capacity.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from boards import board_names, get_board
from boards.vivado import EngineInterface, run_flow, vivado_command, write_flow
from dfvg_hw.config import ConfigError, get_preset
from dfvg_hw.engine import DraftEngine

__all__ = ["build", "main"]

TOP = "dfvg_engine"


def _log(message: str) -> None:
    print(f"dfvg_hw.build: {message}", file=sys.stderr, flush=True)


def build(board_name: str, preset: str | None = None, out: str | Path | None = None, *,
          data_width: int | None = None, log=_log):
    """Write the build tree; return (board, config, FlowFiles, Verilog path)."""
    board = get_board(board_name)
    config = get_preset(preset or board.preset)
    width = data_width or config.mem_port_bits
    iface = EngineInterface.for_config(config, [f"{TOP}.v"], axi_data_width=width)
    directory = Path(out or f"build/{board.name}-{config.name}")
    directory.mkdir(parents=True, exist_ok=True)
    start = time.monotonic()
    log(f"elaborating the {config.name} engine for {board.name} ({board.part}) "
        f"({width}-bit memory port); large presets take minutes")
    from sim.rtl_tools import to_verilog
    verilog = directory / f"{TOP}.v"
    verilog.write_text(to_verilog(DraftEngine(config, width), TOP))
    log(f"wrote {verilog} ({verilog.stat().st_size / 1e6:.1f} MB) in {time.monotonic() - start:.0f} s")
    files = write_flow(directory, board, iface)
    log(f"wrote {files.xdc.name} and {files.tcl.name}")
    return board, config, files, verilog


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m dfvg_hw.build", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--board", default="alveo", help=f"one of: {', '.join(board_names())}")
    ap.add_argument("--preset", help="engine preset (default: the board's own)")
    ap.add_argument("--out", help="build directory (default: build/<board>-<preset>)")
    ap.add_argument("--run", action="store_true", help="run the Vivado flow (needs vivado on PATH)")
    ap.add_argument("--estimate", action="store_true", help="Yosys resource estimate of the engine")
    args = ap.parse_args(argv)
    try:
        board, config, files, verilog = build(args.board, args.preset, args.out)
    except (ValueError, ConfigError) as exc:
        ap.error(str(exc))
    if args.estimate:
        from sim.rtl_tools import yosys_resources
        _log("estimating resources with Yosys synth_xilinx -family xcup (slow for board presets)")
        used = yosys_resources(verilog.read_text(), TOP, timeout=24 * 3600)
        print(f"{board.name} ({board.part}), engine preset {config.name}: Yosys estimate "
              "[synthesised, not placed]")
        print(board.capacity.table(used))
    if args.run:
        if vivado_command(files) is None:
            ap.error(f"vivado is not on PATH; on a Vivado machine run: {files.command}")
        return run_flow(files)
    print(f"build tree ready in {files.directory}; on a Vivado machine run:\n  {files.command}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
