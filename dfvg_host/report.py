"""The compile report: sizes, instruction count and modelled draft speed.

Every speed figure here is *modelled*: cycles come from the cycle model
(:mod:`sim.cycle_model`) at the preset's clock. The rooflines divide a bandwidth by the
bytes the engine reads per token:

* **achievable**: what the card's memory sustains with every channel streaming, as its
  vendor measured it (``EngineConfig.achievable_bandwidth_gbps``; 421 GB/s on the HBM
  Alveos). *Efficiency* is the modelled speed over this roofline (or over the compute
  roofline, if that is lower): the card's roofline, not the engine's ports'.
* **theoretical**: the data sheet's bandwidth (``mem_bandwidth_gbps``), never reached.
* **ports**: what the engine's memory ports can move (``engine_bandwidth_gbps``), which
  says whether the ports or the rest of the engine fall short.

Nothing is measured on hardware.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from dfvg_hw.spec.config import EngineConfig
from dfvg_host.compiled_draft import TreeProgram
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
    roofline_compute_tokens_per_s: float
    macs_per_token: int
    cycles_by_op: dict
    engine_bandwidth_gbps: float
    achievable_bandwidth_gbps: float
    theoretical_bandwidth_gbps: float
    mem_ports: int
    #: width of the program's tree forward (0: none), a tree level's and a chain token's
    #: marginal cycles (one more level or token in a request) at ``context``
    tree_width: int = 0
    tree_level_cycles: int = 0
    chain_token_cycles: int = 0

    def _memory_roofline(self, gbps: float) -> float:
        return gbps * 1e9 / self.bytes_per_token

    @property
    def roofline_achievable_tokens_per_s(self) -> float:
        """The card's sustained memory bandwidth ÷ bytes read per token."""
        return self._memory_roofline(self.achievable_bandwidth_gbps)

    @property
    def roofline_theoretical_tokens_per_s(self) -> float:
        """The data sheet's memory bandwidth ÷ bytes read per token."""
        return self._memory_roofline(self.theoretical_bandwidth_gbps)

    @property
    def roofline_ports_tokens_per_s(self) -> float:
        """What the engine's memory ports can move ÷ bytes read per token."""
        return self._memory_roofline(self.engine_bandwidth_gbps)

    @property
    def bound(self) -> str:
        """Which card roofline is lower: ``memory`` (achievable) or ``compute``."""
        return ("memory" if self.roofline_achievable_tokens_per_s <= self.roofline_compute_tokens_per_s
                else "compute")

    @property
    def efficiency(self) -> float:
        """Modelled speed ÷ the lower of the achievable memory and the compute rooflines."""
        return self.tokens_per_s / min(self.roofline_achievable_tokens_per_s,
                                       self.roofline_compute_tokens_per_s)

    @property
    def fraction_of_theoretical(self) -> float:
        """Modelled speed ÷ the theoretical memory roofline."""
        return self.tokens_per_s / self.roofline_theoretical_tokens_per_s

    def to_dict(self) -> dict:
        return dict(asdict(self), efficiency=self.efficiency, bound=self.bound,
                    fraction_of_theoretical=self.fraction_of_theoretical,
                    roofline_achievable_tokens_per_s=self.roofline_achievable_tokens_per_s,
                    roofline_theoretical_tokens_per_s=self.roofline_theoretical_tokens_per_s,
                    roofline_ports_tokens_per_s=self.roofline_ports_tokens_per_s)

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
            f"memory        {self.bytes_per_token:,} bytes read per token",
            f"  achievable  {self.achievable_bandwidth_gbps:g} GB/s -> roofline "
            f"{self.roofline_achievable_tokens_per_s:,.0f} tokens/s [the card's sustained bandwidth]",
            f"  theoretical {self.theoretical_bandwidth_gbps:g} GB/s -> roofline "
            f"{self.roofline_theoretical_tokens_per_s:,.0f} tokens/s [data sheet]",
            f"  ports       {self.mem_ports} x {self.engine_bandwidth_gbps / self.mem_ports:.3g} GB/s = "
            f"{self.engine_bandwidth_gbps:.4g} GB/s -> roofline "
            f"{self.roofline_ports_tokens_per_s:,.0f} tokens/s [the engine's memory ports]",
            f"compute       {self.macs_per_token:,} MACs per token -> roofline "
            f"{self.roofline_compute_tokens_per_s:,.0f} tokens/s [peak MACs at clock]",
            f"efficiency    {100 * self.efficiency:.1f}% of the card's roofline ({self.bound}-bound), "
            f"{100 * self.fraction_of_theoretical:.1f}% of the theoretical",
        ] + self._tree_lines())

    def _tree_lines(self) -> list[str]:
        if not self.tree_width:
            return ["tree          none (the preset's rows or VMEM hold one row)"]
        ratio = self.tree_width * self.chain_token_cycles / self.tree_level_cycles
        return [f"tree level    {self.tree_width} nodes in {self.tree_level_cycles:,} cycles, a chain "
                f"token {self.chain_token_cycles:,} [modelled: cycle model]: {ratio:.2f}x the "
                f"chain's drafted tokens per cycle"]


def compile_report(engine: EngineConfig, program: list[int], *, model: str, image_bytes: int,
                   context_limit: int, context: int | None = None,
                   tree: TreeProgram | None = None) -> CompileReport:
    """Modelled cost of one steady-state draft step (one forward + sample) at ``context``;
    with the program's ``tree``, also of one tree level against one chain token."""
    context = min(context if context is not None else 256, context_limit)
    counts = estimate_request(engine, program, n_in=1, n_draft=1, start_pos=context - 1)
    tree_fields = {}
    if tree is not None and tree.width and context + tree.width <= context_limit:
        def total(levels: int, width: int) -> int:
            return estimate_request(engine, program, n_in=1, n_draft=levels, start_pos=context - 1,
                                    tree_width=width, tree_pc=tree.pc if width else 0,
                                    row_pitch=tree.row_pitch if width else 0, topk=engine.topk_max).total
        tree_fields = dict(tree_width=tree.width, tree_level_cycles=total(2, tree.width) - total(1, tree.width),
                           chain_token_cycles=total(2, 0) - total(1, 0))
    clock = engine.clock_mhz * 1e6
    return CompileReport(
        preset=engine.name, model=model, image_bytes=image_bytes, program_words=len(program),
        program_bytes=16 * len(program), context_limit=context_limit, context=context,
        cycles_per_token=counts.total, bytes_per_token=counts.mem_bytes, clock_mhz=engine.clock_mhz,
        tokens_per_s=clock / counts.total,
        engine_bandwidth_gbps=engine.engine_bandwidth_gbps,
        achievable_bandwidth_gbps=engine.achievable_bandwidth_gbps,
        theoretical_bandwidth_gbps=engine.mem_bandwidth_gbps, mem_ports=engine.mem_ports,
        # A chain drafts one row: it uses lanes x reduce of the M x N x K MACs per cycle.
        roofline_compute_tokens_per_s=clock * engine.lanes * engine.reduce / counts.macs,
        macs_per_token=counts.macs, cycles_by_op=counts.by_op, **tree_fields)
