"""The compile report: sizes, instruction count and modelled draft speed.

Every speed figure here is *modelled*: cycles come from the cycle model
(:mod:`sim.cycle_model`) at the preset's clock; the memory roofline is the bandwidth the
engine's memory port can move (``EngineConfig.engine_bandwidth_gbps``), and the board
roofline the card's whole device-memory bandwidth, which only a multi-port memory system
would reach. Nothing is measured on hardware.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from dfvg_hw.spec.config import EngineConfig
from sim.cycle_model import estimate_request

__all__ = ["CompileReport", "compile_report"]


@dataclass
class CompileReport:
    preset: str
    model: str
    image_bytes: int
    program_words: int
    program_bytes: int
    context_limit: int
    context: int
    cycles_per_token: int
    bytes_per_token: int
    clock_mhz: float
    tokens_per_s: float
    roofline_memory_tokens_per_s: float
    roofline_compute_tokens_per_s: float
    macs_per_token: int
    cycles_by_op: dict
    engine_bandwidth_gbps: float
    board_bandwidth_gbps: float

    @property
    def roofline_board_tokens_per_s(self) -> float:
        """The memory roofline at the board's whole bandwidth (not reachable through one
        port when the board has more)."""
        return self.board_bandwidth_gbps * 1e9 / self.bytes_per_token

    @property
    def efficiency(self) -> float:
        """Modelled speed ÷ the lower of the two rooflines."""
        return self.tokens_per_s / min(self.roofline_memory_tokens_per_s,
                                       self.roofline_compute_tokens_per_s)

    def to_dict(self) -> dict:
        return dict(asdict(self), efficiency=self.efficiency)

    def text(self) -> str:
        top = sorted(self.cycles_by_op.items(), key=lambda kv: -kv[1])[:4]
        share = ", ".join(f"{op} {100 * c / self.cycles_per_token:.0f}%" for op, c in top)
        return "\n".join([
            f"preset        {self.preset}",
            f"model         {self.model}",
            f"image         {self.image_bytes:,} bytes",
            f"program       {self.program_words} instructions ({self.program_bytes} bytes)",
            f"context       up to {self.context_limit} positions",
            f"draft token   {self.cycles_per_token:,} cycles at context {self.context} "
            f"[modelled: cycle model]  ({share})",
            f"draft speed   {self.tokens_per_s:,.0f} tokens/s at {self.clock_mhz:g} MHz "
            f"[modelled]",
            f"memory        {self.bytes_per_token:,} bytes read per token -> roofline "
            f"{self.roofline_memory_tokens_per_s:,.0f} tokens/s [modelled: the engine's memory "
            f"port, {self.engine_bandwidth_gbps:g} GB/s]",
            f"board memory  {self.board_bandwidth_gbps:g} GB/s -> roofline "
            f"{self.roofline_board_tokens_per_s:,.0f} tokens/s [modelled: needs a multi-port "
            f"memory system]" if self.board_bandwidth_gbps > self.engine_bandwidth_gbps else
            f"board memory  {self.board_bandwidth_gbps:g} GB/s (the port is not the limit)",
            f"compute       {self.macs_per_token:,} MACs per token -> roofline "
            f"{self.roofline_compute_tokens_per_s:,.0f} tokens/s [modelled: peak MACs at clock]",
            f"efficiency    {100 * self.efficiency:.1f}% of min(rooflines)",
        ])


def compile_report(engine: EngineConfig, program: list[int], *, model: str, image_bytes: int,
                   context_limit: int, context: int | None = None) -> CompileReport:
    """Modelled cost of one steady-state draft step (one forward + sample) at ``context``."""
    context = min(context if context is not None else 256, context_limit)
    counts = estimate_request(engine, program, n_in=1, n_draft=1, start_pos=context - 1)
    clock = engine.clock_mhz * 1e6
    return CompileReport(
        preset=engine.name, model=model, image_bytes=image_bytes, program_words=len(program),
        program_bytes=16 * len(program), context_limit=context_limit, context=context,
        cycles_per_token=counts.total, bytes_per_token=counts.mem_bytes, clock_mhz=engine.clock_mhz,
        tokens_per_s=clock / counts.total,
        roofline_memory_tokens_per_s=engine.engine_bandwidth_gbps * 1e9 / counts.mem_bytes,
        engine_bandwidth_gbps=engine.engine_bandwidth_gbps,
        board_bandwidth_gbps=engine.mem_bandwidth_gbps,
        # A chain drafts one row: it uses lanes x reduce of the M x N x K MACs per cycle.
        roofline_compute_tokens_per_s=clock * engine.lanes * engine.reduce / counts.macs,
        macs_per_token=counts.macs, cycles_by_op=counts.by_op)
