"""``dfvg bench-serve``: a bounded load test of the server, DFVG against target-only.

Both servers run in this process under uvicorn and are driven over HTTP on 127.0.0.1 by
asyncio clients; at each concurrency level ``c`` the requests go out ``c`` at a time
(a new one as soon as one ends), greedy, from the multi-task prompt set. Target-only
serving is the same scheduler with no draft device: same batching, one token per
sequence per forward.

Figures, each labelled:

* *measured*: wall time of the whole level at the client and each request's latency.
* *projected*: the same with the simulator's wall (it stands in for the FPGA) replaced by
  the engine's modelled time and the link model's PCIe time
  (:mod:`~dfvg_host.serving.scheduler`); the target's forwards are measured.

Every DFVG output is compared with the target-only output of the same prompt: greedy
speculative decoding must give the same text.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

import httpx
import numpy as np

from dfvg_host.serving.app import ServedModel
from dfvg_host.serving.server import BackgroundServer

__all__ = ["LevelResult", "run_levels", "mismatches", "format_table"]


@dataclass
class LevelResult:
    """One server at one concurrency level.

    Members
    -------
    mode : str
        ``"dfvg"`` or ``"target-only"``.
    concurrency, requests, tokens : int
    wall_s : float
        Measured wall of the level, first request sent to last answer.
    projected_s : float
        ``wall_s`` with the simulator's wall replaced by modelled engine and PCIe time.
    latencies_s, projected_latencies_s : list of float
        Per request: measured at the client; projected by the server.
    texts : list of str
    acceptance_rate, mean_accepted_length : float
    forwards : int
        Batched target forwards in the level.
    """
    mode: str
    concurrency: int
    requests: int
    tokens: int
    wall_s: float
    projected_s: float
    latencies_s: list[float] = field(default_factory=list)
    projected_latencies_s: list[float] = field(default_factory=list)
    texts: list[str] = field(default_factory=list)
    acceptance_rate: float = 0.0
    mean_accepted_length: float = 0.0
    forwards: int = 0

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.wall_s if self.wall_s else 0.0

    @property
    def projected_tokens_per_s(self) -> float:
        return self.tokens / self.projected_s if self.projected_s else 0.0

    def percentile(self, q: float, *, projected: bool = True) -> float:
        values = self.projected_latencies_s if projected else self.latencies_s
        return float(np.percentile(values, q)) if values else 0.0

    def to_dict(self) -> dict:
        return {"mode": self.mode, "concurrency": self.concurrency, "requests": self.requests,
                "tokens": self.tokens, "wall_s": self.wall_s, "projected_s": self.projected_s,
                "tokens_per_s_measured": self.tokens_per_s,
                "tokens_per_s_projected": self.projected_tokens_per_s,
                "p50_latency_s_measured": self.percentile(50, projected=False),
                "p99_latency_s_measured": self.percentile(99, projected=False),
                "p50_latency_s_projected": self.percentile(50), "p99_latency_s_projected": self.percentile(99),
                "acceptance_rate": self.acceptance_rate, "mean_accepted_length": self.mean_accepted_length,
                "target_forwards": self.forwards}


async def _drive(url: str, model: str, prompts: list[str], concurrency: int, max_tokens: int):
    """Send every prompt, ``concurrency`` in flight; (text, tokens, latency, projected) each."""
    gate = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(base_url=url, timeout=None) as client:
        async def one(prompt: str):
            async with gate:
                t0 = time.perf_counter()
                r = await client.post("/v1/completions", json={
                    "model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0})
                latency = time.perf_counter() - t0
                r.raise_for_status()
                body = r.json()
                return (body["choices"][0]["text"], body["usage"]["completion_tokens"], latency,
                        body["dfvg"]["projected_latency_s"])
        return await asyncio.gather(*(one(p) for p in prompts))


def _level(server: BackgroundServer, mode: str, prompts: list[str], concurrency: int,
           max_tokens: int) -> LevelResult:
    scheduler = server.served.scheduler
    m = scheduler.metrics
    before = (scheduler.projection_offset, m.rounds, m.drafted_tokens, m.accepted_tokens,
              scheduler.verifier.forwards)
    t0 = time.perf_counter()
    answers = asyncio.run(_drive(server.url, server.served.name, prompts, concurrency, max_tokens))
    wall = time.perf_counter() - t0
    rounds = m.rounds - before[1]
    drafted, accepted = m.drafted_tokens - before[2], m.accepted_tokens - before[3]
    return LevelResult(mode, concurrency, len(prompts), sum(a[1] for a in answers), wall,
                       wall - (scheduler.projection_offset - before[0]),
                       [a[2] for a in answers], [a[3] for a in answers], [a[0] for a in answers],
                       accepted / drafted if drafted else 0.0,
                       (accepted + rounds) / rounds if rounds else 0.0,
                       scheduler.verifier.forwards - before[4])


def run_levels(servers: dict[str, ServedModel], prompts: list[str], concurrencies: list[int],
               max_tokens: int, requests_per_level=lambda c: max(8, 2 * c), log=print) -> list[LevelResult]:
    """Every server at every level, one after the other, after one warm-up request each."""
    results = []
    for mode, served in servers.items():
        with BackgroundServer(served) as server:
            _level(server, mode, prompts[:1], 1, 4)
            for c in concurrencies:
                batch = [prompts[i % len(prompts)] for i in range(requests_per_level(c))]
                log(f"  {mode}: {len(batch)} requests, {c} at a time ...")
                results.append(_level(server, mode, batch, c, max_tokens))
    return results


def mismatches(results: list[LevelResult]) -> list[str]:
    """Levels where DFVG's greedy texts differ from target-only's (there should be none)."""
    base = {r.concurrency: r.texts for r in results if r.mode == "target-only"}
    return [f"concurrency {r.concurrency}" for r in results
            if r.mode == "dfvg" and r.concurrency in base and r.texts != base[r.concurrency]]


def format_table(results: list[LevelResult]) -> str:
    base = {r.concurrency: r for r in results if r.mode == "target-only"}
    lines = [f"{'server':12s} {'conc':>4s} {'reqs':>4s} {'tokens':>6s} {'tok/s proj':>10s} "
             f"{'p50 proj':>9s} {'p99 proj':>9s} {'tok/s meas':>10s} {'p50 meas':>9s} {'p99 meas':>9s} "
             f"{'accept':>6s} {'len':>5s} {'fwds':>5s} {'speedup':>7s}"]
    for r in results:
        b = base.get(r.concurrency)
        speedup = (f"{r.projected_tokens_per_s / b.projected_tokens_per_s:6.2f}x"
                   if b is not None and b.projected_tokens_per_s else "      -")
        lines.append(f"{r.mode:12s} {r.concurrency:4d} {r.requests:4d} {r.tokens:6d} "
                     f"{r.projected_tokens_per_s:10.1f} {r.percentile(50):8.3f}s {r.percentile(99):8.3f}s "
                     f"{r.tokens_per_s:10.1f} {r.percentile(50, projected=False):8.3f}s "
                     f"{r.percentile(99, projected=False):8.3f}s {r.acceptance_rate:6.3f} "
                     f"{r.mean_accepted_length:5.2f} {r.forwards:5d} {speedup}")
    lines.append("proj = projected: measured target forwards and host + modelled engine (cycle model) "
                 "and PCIe (link model); meas = measured wall, the engine simulated in software. "
                 "speedup = projected tokens/s against target-only serving at the same concurrency.")
    return "\n".join(lines)

