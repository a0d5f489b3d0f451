"""PCIe card platforms for the draft engine, and the Vivado flow that builds for them.

=============  ==========================  =================  ===============
board          part                        device memory      engine preset
=============  ==========================  =================  ===============
alveo-u55c     xcu55c-fsvh2892-2L-e        16 GiB HBM2        alveo-u55c
alveo-u280     xcu280-fsvh2892-2L-e        8 GiB HBM2         alveo-u280
alveo-u250     xcu250-figd2104-2L-e        64 GiB DDR4 (x4)   alveo-u250
nitefury       xc7a200tfbg484-2            1 GiB DDR3 (x16)   nitefury
litefury       xc7a100tfgg484-2            512 MiB DDR3 (x16) litefury
=============  ==========================  =================  ===============

``alveo`` alone means the U55C. The M.2 cards (NiteFury II, LiteFury) are
``amaranth-boards``' own platforms with the flow's records added (:mod:`boards.nitefury`).
:func:`get_board` returns a platform instance; :mod:`boards.vivado` turns one into XDC
constraints and a Vivado Tcl flow. Only :mod:`dfvg_hw.spec` and the RTL are imported here.
"""

from __future__ import annotations

from boards.alveo import AlveoPlatform
from boards.alveo_u55c import AlveoU55CPlatform
from boards.alveo_u250 import AlveoU250Platform
from boards.alveo_u280 import AlveoU280Platform
from boards.card import DDR3, DDR4, HBM, CardPlatform, MemorySystem, PartCapacity, PcieLink
from boards.nitefury import LitefuryPlatform, NitefuryPlatform

__all__ = ["CardPlatform", "AlveoPlatform", "AlveoU55CPlatform", "AlveoU280Platform",
           "AlveoU250Platform", "NitefuryPlatform", "LitefuryPlatform", "PartCapacity",
           "PcieLink", "MemorySystem", "HBM", "DDR4", "DDR3", "BOARDS", "ALVEO_BOARDS",
           "ALIASES", "DEFAULT_BOARD", "board_names", "get_board"]

#: The Alveo cards by ``--board`` name.
ALVEO_BOARDS: dict[str, type[AlveoPlatform]] = {
    cls.name: cls for cls in (AlveoU55CPlatform, AlveoU280Platform, AlveoU250Platform)}
#: Every board by its ``--board`` name.
BOARDS: dict[str, type[CardPlatform]] = {
    **ALVEO_BOARDS, **{cls.name: cls for cls in (NitefuryPlatform, LitefuryPlatform)}}
DEFAULT_BOARD = AlveoU55CPlatform.name
#: Short names: ``alveo`` is the card the project targets first.
ALIASES = {"alveo": DEFAULT_BOARD}


def board_names() -> list[str]:
    """Names :func:`get_board` accepts, aliases first."""
    return [*ALIASES, *BOARDS]


def get_board(name: str) -> CardPlatform:
    """The platform for board ``name``; an unknown name lists the known ones."""
    cls = BOARDS.get(ALIASES.get(name, name))
    if cls is None:
        known = ", ".join(f"{alias} (= {target})" for alias, target in ALIASES.items())
        raise ValueError(f"unknown board {name!r}; known boards: {known}, {', '.join(BOARDS)}")
    return cls()
