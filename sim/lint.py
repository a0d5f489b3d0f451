"""Verilator lint of generated Verilog, with the warnings waived for Amaranth's output."""

from __future__ import annotations

import shutil
import subprocess
import tempfile
from pathlib import Path

__all__ = ["verilator_lint", "VERILATOR_WAIVERS"]

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
