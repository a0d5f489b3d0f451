"""``/metrics``: Prometheus text with vLLM's metric names, plus the engine's own.

The speculative-decoding counters are vLLM's (``vllm:spec_decode_num_drafts``,
``…_num_draft_tokens``, ``…_num_accepted_tokens``, ``…_num_accepted_tokens_per_pos``
with a ``position`` label, and the older ``…_num_emitted_tokens``), as are the request
gauges and latency histograms, so dashboards built for vLLM read this server too. The
engine's figures are ``dfvg:…``: its cycles (labelled with where they come from:
modelled by the cycle model, measured in RTL simulation or by the card's counters), the
target's forwards and measured seconds, device faults and resets. Counters are read from
the scheduler at scrape time, so nothing is counted twice.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

__all__ = ["ServerMetrics", "CONTENT_TYPE"]

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)


class _SchedulerCollector:
    def __init__(self, scheduler, model_name: str, rejected):
        self._scheduler = scheduler
        self._model = model_name
        self._rejected = rejected

    def _counter(self, name: str, doc: str, value, extra: dict | None = None):
        labels = {"model_name": self._model, **(extra or {})}
        family = CounterMetricFamily(name, doc, labels=list(labels))
        family.add_metric(list(labels.values()), value)
        return family

    def collect(self):
        s = self._scheduler
        m = s.metrics
        # Every round that drafted anything drafted a token at position 0.
        yield self._counter("vllm:spec_decode_num_drafts", "Rounds that drafted at least one token.",
                            m.drafted_per_position[0] if m.drafted_per_position else 0)
        yield self._counter("vllm:spec_decode_num_draft_tokens", "Tokens drafted on the engine.",
                            m.drafted_tokens)
        yield self._counter("vllm:spec_decode_num_accepted_tokens", "Drafted tokens the target accepted.",
                            m.accepted_tokens)
        yield self._counter("vllm:spec_decode_num_emitted_tokens",
                            "Tokens emitted (accepted drafts plus the target's own token per round).",
                            m.emitted_tokens)
        per_pos = CounterMetricFamily("vllm:spec_decode_num_accepted_tokens_per_pos",
                                      "Accepted drafts by position in the round.",
                                      labels=["model_name", "position"])
        for pos, accepted in enumerate(m.accepted_per_position):
            per_pos.add_metric([self._model, str(pos)], accepted)
        yield per_pos
        yield self._counter("vllm:generation_tokens", "Tokens generated.", m.emitted_tokens)
        running = GaugeMetricFamily("vllm:num_requests_running", "Sequences being decoded.",
                                    labels=["model_name"])
        running.add_metric([self._model], s.running)
        yield running
        waiting = GaugeMetricFamily("vllm:num_requests_waiting", "Sequences waiting for a place.",
                                    labels=["model_name"])
        waiting.add_metric([self._model], s.waiting)
        yield waiting
        success = CounterMetricFamily("vllm:request_success", "Finished requests by finish reason.",
                                      labels=["model_name", "finished_reason"])
        for reason, count in sorted(s.finished.items()):
            success.add_metric([self._model, reason], count)
        yield success
        yield self._counter("dfvg:requests_rejected", "Requests refused with 429 (server full).",
                            self._rejected())
        yield self._counter("dfvg:engine_cycles", "Draft-engine cycles spent on drafts.",
                            m.device_cycles, {"source": m.device_cycle_source or "none"})
        yield self._counter("dfvg:engine_seconds", "Draft-engine seconds (cycles at the engine clock).",
                            m.device_seconds, {"source": m.device_cycle_source or "none"})
        yield self._counter("dfvg:simulator_seconds",
                            "Measured wall of the simulated engine (stands in for the FPGA).",
                            m.simulator_seconds)
        yield self._counter("dfvg:pcie_seconds", "PCIe time of draft requests (modelled: link model).",
                            m.pcie_seconds)
        yield self._counter("dfvg:verifier_forwards", "Batched target forwards.", s.verifier.forwards)
        yield self._counter("dfvg:verifier_seconds", "Measured seconds in target forwards.",
                            s.verifier.seconds)
        faults = CounterMetricFamily("dfvg:device_faults", "Draft-device faults by kind.",
                                     labels=["model_name", "kind"])
        for kind, count in sorted(m.device_faults_by_kind.items()):
            faults.add_metric([self._model, kind], count)
        yield faults
        yield self._counter("dfvg:device_resets", "Draft-device resets.", m.device_resets)
        yield self._counter("dfvg:kv_reprefills", "Sequences that got KV slots after decoding "
                            "without (the engine's slots were all taken).", s.reprefills)
        yield self._counter("dfvg:kv_reprefill_tokens", "Committed tokens fed to the engine again by "
                            "those re-prefills.", s.reprefill_tokens)


class ServerMetrics:
    """The server's Prometheus registry.

    Members
    -------
    registry : prometheus_client.CollectorRegistry
        Its own (several servers in one process do not share counters).
    e2e_latency, time_to_first_token : prometheus_client.Histogram
        Measured wall seconds per request (``vllm:e2e_request_latency_seconds``,
        ``vllm:time_to_first_token_seconds``).
    projected_latency : prometheus_client.Histogram
        ``dfvg:projected_request_latency_seconds``: the same with the simulator's wall
        replaced by the modelled engine and PCIe time.
    rejected : int
    """

    def __init__(self, scheduler, model_name: str):
        self.registry = CollectorRegistry()
        self.rejected = 0
        self.registry.register(_SchedulerCollector(scheduler, model_name, lambda: self.rejected))
        kw = dict(labelnames=["model_name"], buckets=_LATENCY_BUCKETS, registry=self.registry)
        self.e2e_latency = Histogram("vllm:e2e_request_latency_seconds",
                                     "Request latency, measured wall.", **kw).labels(model_name)
        self.time_to_first_token = Histogram("vllm:time_to_first_token_seconds",
                                             "Time to the first token, measured wall.",
                                             **kw).labels(model_name)
        self.projected_latency = Histogram("dfvg:projected_request_latency_seconds",
                                           "Request latency with the engine's time modelled.",
                                           **kw).labels(model_name)

    def observe(self, seq) -> None:
        """Record a finished sequence's latencies."""
        self.e2e_latency.observe(seq.latency)
        self.projected_latency.observe(seq.projected_latency)
        if seq.first_token_at is not None:
            self.time_to_first_token.observe(seq.first_token_at - seq.submitted_at)

    def render(self) -> bytes:
        return generate_latest(self.registry)
