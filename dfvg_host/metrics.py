"""Speculative-decoding metrics, named as vLLM and llama.cpp expose them.

Each time figure is labelled: *measured* (wall clock on this host) or *modelled* (the
draft engine's cycle model at its clock; PCIe from the link model).
"""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["SpecDecodeMetrics"]


@dataclass
class SpecDecodeMetrics:
    gamma: int = 0
    rounds: int = 0
    drafted_tokens: int = 0
    accepted_tokens: int = 0
    emitted_tokens: int = 0
    target_forward_passes: int = 0
    drafted_per_position: list[int] = field(default_factory=list)
    accepted_per_position: list[int] = field(default_factory=list)
    verifier_seconds: float = 0.0          # measured
    host_seconds: float = 0.0              # measured
    simulator_seconds: float = 0.0         # measured wall of a simulated device (not host time)
    device_cycles: int = 0                 # the device's counters: see device_cycle_source
    device_clock_hz: float = 0.0
    device_cycle_source: str = "modelled: cycle model"   # DraftDevice.cycle_source
    pcie_bytes: int = 0                    # modelled traffic (link model)
    pcie_transfers: int = 0
    pcie_seconds: float = 0.0              # modelled
    prefill_tokens: int = 0

    def record_round(self, drafted: int, accepted: int, emitted: int) -> None:
        self.rounds += 1
        self.drafted_tokens += drafted
        self.accepted_tokens += accepted
        self.emitted_tokens += emitted
        while len(self.drafted_per_position) < drafted:
            self.drafted_per_position.append(0)
            self.accepted_per_position.append(0)
        for i in range(drafted):
            self.drafted_per_position[i] += 1
            self.accepted_per_position[i] += i < accepted

    @property
    def acceptance_rate(self) -> float:
        return self.accepted_tokens / self.drafted_tokens if self.drafted_tokens else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens committed per verification round: accepted drafts plus the bonus/correction."""
        return (self.accepted_tokens + self.rounds) / self.rounds if self.rounds else 0.0

    @property
    def acceptance_per_position(self) -> list[float]:
        return [a / d if d else 0.0 for a, d in zip(self.accepted_per_position, self.drafted_per_position)]

    @property
    def device_seconds(self) -> float:
        return self.device_cycles / self.device_clock_hz if self.device_clock_hz else 0.0

    @property
    def projected_seconds(self) -> float:
        """Sequential (unpipelined) time: measured verifier + host, modelled device + PCIe."""
        return self.verifier_seconds + self.host_seconds + self.device_seconds + self.pcie_seconds

    def to_dict(self) -> dict:
        d = dict(vars(self))
        d.update(acceptance_rate=self.acceptance_rate, mean_accepted_length=self.mean_accepted_length,
                 acceptance_per_position=self.acceptance_per_position,
                 device_seconds=self.device_seconds, projected_seconds=self.projected_seconds,
                 labels=dict(verifier_seconds="measured", host_seconds="measured",
                             simulator_seconds="measured (simulator wall, not in projection)",
                             device_seconds=self.device_cycle_source, pcie_seconds="modelled (link model)",
                             projected_seconds="measured verifier+host + modelled device+pcie"))
        return d

    def summary(self) -> str:
        pos = " ".join(f"{a:.2f}" for a in self.acceptance_per_position)
        proj = self.projected_seconds
        tps = self.emitted_tokens / proj if proj else 0.0
        return "\n".join([
            f"tokens           {self.emitted_tokens} in {self.rounds} rounds (gamma {self.gamma})",
            f"acceptance       {self.acceptance_rate:.3f}  ({self.accepted_tokens} of "
            f"{self.drafted_tokens} drafted)",
            f"accepted length  {self.mean_accepted_length:.2f} tokens per round (incl. bonus)",
            f"per position     {pos}",
            f"target forwards  {self.target_forward_passes} (incl. prefill)",
            f"verifier         {self.verifier_seconds:8.4f} s  [measured]",
            f"host             {self.host_seconds:8.4f} s  [measured]",
            f"draft engine     {self.device_seconds:8.4f} s  [{self.device_cycle_source}, "
            f"{self.device_cycles:,} cycles at {self.device_clock_hz / 1e6:g} MHz]",
            f"PCIe             {self.pcie_seconds:8.4f} s  [modelled: link model, "
            f"{self.pcie_bytes:,} bytes in {self.pcie_transfers} DMA transfers]",
            f"projected        {proj:8.4f} s = {tps:,.1f} tokens/s  [measured verifier+host + "
            f"modelled engine+PCIe, unpipelined]",
            f"simulator        {self.simulator_seconds:8.4f} s  [measured wall of the functional "
            f"model; stands in for the FPGA, not counted above]",
        ])
