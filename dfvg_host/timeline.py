"""A per-round timeline of a generation on the projected clock, written as a Chrome trace.

Each :class:`Span` sits on one lane — ``engine`` (the draft engine), ``pcie`` (the link),
``target`` (the verifier's forward passes) or ``host`` (the host's own work) — and says
whether its duration is *measured* (wall time on this host: target, host) or *modelled*
(the engine's cycle counts at its clock, PCIe from the link model). The clock is the
projected one, the clock of ``SpecDecodeMetrics.projected_seconds``: spans follow one
another, except that a pipelined decoder's speculative continuation (engine and PCIe)
starts with the verification it overlaps, and the round ends when the later of the two
does. On the ``sim`` device the engine runs synchronously in wall time, so that overlap
is modelled, not observed.

:meth:`Timeline.to_chrome` gives the Trace Event Format (``{"traceEvents": [...]}``,
complete events ``"ph": "X"`` in microseconds) that chrome://tracing and Perfetto
(ui.perfetto.dev) open; :meth:`Timeline.write` writes it to a file.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["Span", "Timeline", "LANES"]

#: The lanes, in the order a trace viewer shows them (their thread ids).
LANES = ("engine", "pcie", "target", "host")


@dataclass
class Span:
    """One stretch of work: ``start`` and ``duration`` in seconds on the projected clock;
    ``source`` is ``"measured"`` or ``"modelled"``; ``args`` say more (round, tokens)."""
    lane: str
    name: str
    start: float
    duration: float
    source: str
    args: dict = field(default_factory=dict)

    @property
    def end(self) -> float:
        return self.start + self.duration


class Timeline:
    """Spans of one generation. ``now`` is where the next sequential span starts.

    Members
    -------
    spans : list of Span
    now : float
        The projected clock, seconds since the generation began.
    schedule : str
        ``"serial"`` or ``"pipelined"``, as the decoder that recorded it.
    """

    def __init__(self, schedule: str = "serial"):
        self.spans: list[Span] = []
        self.now = 0.0
        self.schedule = schedule

    def add(self, lane: str, name: str, start: float, duration: float, source: str, **args) -> Span:
        """A span at ``start`` (spans of no duration are dropped: nothing happened)."""
        if lane not in LANES:
            raise ValueError(f"unknown lane {lane!r}; one of {', '.join(LANES)}")
        if source not in ("measured", "modelled"):
            raise ValueError(f"a span is 'measured' or 'modelled', not {source!r}")
        span = Span(lane, name, start, max(0.0, duration), source, args)
        if span.duration > 0:
            self.spans.append(span)
        return span

    def then(self, lane: str, name: str, duration: float, source: str, **args) -> Span:
        """A span at ``now``; ``now`` moves to its end."""
        span = self.add(lane, name, self.now, duration, source, **args)
        self.now = max(self.now, self.now + span.duration)
        return span

    @property
    def end(self) -> float:
        return max([self.now] + [s.end for s in self.spans])

    def lanes(self) -> set[str]:
        return {s.lane for s in self.spans}

    def to_chrome(self, process: str = "dfvg generate") -> dict:
        """The Trace Event Format: one complete event per span, times in µs, one thread
        per lane (named), one process."""
        events = [{"name": "process_name", "ph": "M", "pid": 1, "tid": 0,
                   "args": {"name": f"{process} ({self.schedule})"}}]
        for tid, lane in enumerate(LANES, 1):
            events.append({"name": "thread_name", "ph": "M", "pid": 1, "tid": tid, "args": {"name": lane}})
            events.append({"name": "thread_sort_index", "ph": "M", "pid": 1, "tid": tid,
                           "args": {"sort_index": tid}})
        for s in self.spans:
            events.append({"name": s.name, "cat": s.source, "ph": "X", "ts": s.start * 1e6,
                           "dur": s.duration * 1e6, "pid": 1, "tid": LANES.index(s.lane) + 1,
                           "args": {"lane": s.lane, "source": s.source, **s.args}})
        return {"traceEvents": events, "displayTimeUnit": "ms",
                "otherData": {"schedule": self.schedule,
                              "clock": "projected: measured target and host, modelled engine and "
                                       "PCIe" + ("; the continuation's engine time overlaps "
                                                 "verification (modelled on the sim device)"
                                                 if self.schedule == "pipelined" else "")}}

    def write(self, path: str | Path, process: str = "dfvg generate") -> None:
        Path(path).write_text(json.dumps(self.to_chrome(process), indent=1) + "\n")
