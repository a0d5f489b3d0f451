"""How large an engine the ``rtl`` and ``rtl+verilator`` devices simulate without being
asked twice.

The RTL devices simulate the whole generated engine, and its cost grows with the matrix
tile: the ``tiny`` tile (2×4×8, 64 multipliers) builds in Verilator in about a minute
and runs a draft in seconds, while the old ``alveo-u55c`` tile (8×64×32, 16,384 multipliers)
took 150 s and 5 GB of memory to build before it simulated a single cycle. A user who
names a card's preset on an RTL device most likely wants the ``sim`` device; one who
really wants the RTL says so with ``?large=1`` in the URL.
"""

from __future__ import annotations

from dfvg_hw.spec.config import EngineConfig

__all__ = ["MAX_SIMULATED_MULTIPLIERS", "SimulationTooLarge", "check_simulation_size"]

#: Multipliers in the matrix tile (rows × lanes × reduce) an RTL device simulates without
#: ``large=1``: 16× the ``tiny`` tile, which covers ``nitefury``'s 256.
MAX_SIMULATED_MULTIPLIERS = 1024


class SimulationTooLarge(ValueError):
    """An RTL simulation of an engine larger than :data:`MAX_SIMULATED_MULTIPLIERS`."""


def check_simulation_size(config: EngineConfig, scheme: str, *, large: bool = False) -> None:
    """A :class:`SimulationTooLarge` that says what to use instead, unless ``config``'s
    matrix tile is small enough to simulate or ``large`` asks for it anyway."""
    multipliers = config.rows * config.lanes * config.reduce
    if large or multipliers <= MAX_SIMULATED_MULTIPLIERS:
        return
    raise SimulationTooLarge(
        f"{scheme}://{config.name} simulates the whole engine, with a matrix tile of {config.rows}×"
        f"{config.lanes}×{config.reduce} = {multipliers:,} multipliers: building and simulating it takes "
        "minutes and gigabytes before the first token (rtl+verilator://alveo-u55c: 150 s and 5 GB to "
        f"build). Use sim://{config.name} (the bit-exact functional model; time from the cycle model), "
        f"an RTL device at a small preset (tiny, nitefury), or {scheme}://{config.name}?large=1 to "
        "simulate it anyway")
