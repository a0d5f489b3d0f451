"""Shared Amaranth testbench helpers: stream transfers and a simulation runner with VCD.

Every RTL test uses these, so stream handshakes are written once. Set ``DFVG_VCD=DIR``
(or pass ``--vcd DIR`` to pytest) to write a waveform for every simulation run into DIR,
named after the test.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from amaranth.sim import Simulator

__all__ = ["stream_put", "stream_get", "stream_through", "run_simulation", "vcd_dir", "watchdog",
           "first_valid_after_accept"]


async def stream_put(ctx, stream, payload) -> None:
    """Offer ``payload`` on a ``lib.stream`` interface and wait until it is taken."""
    ctx.set(stream.payload, payload)
    ctx.set(stream.valid, 1)
    await ctx.tick().until(stream.ready)
    ctx.set(stream.valid, 0)


async def stream_get(ctx, stream):
    """Accept one transfer from a ``lib.stream`` interface and return its payload."""
    ctx.set(stream.ready, 1)
    payload, = await ctx.tick().sample(stream.payload).until(stream.valid)
    ctx.set(stream.ready, 0)
    return payload


def watchdog(limit: int, done):
    """A testbench that fails the run if ``done()`` is not true within ``limit`` cycles,
    so a hung handshake fails the test instead of running forever."""
    async def tb(ctx):
        for _ in range(limit):
            if done():
                return
            await ctx.tick()
        raise AssertionError(f"simulation hung: not done after {limit} cycles")
    return tb


#: cycles :func:`stream_through` watches ``dut.o`` after the last expected beat: longer
#: than any unit's pipeline that it drives
TRAILING_CYCLES = 64


def stream_through(dut, payloads, *, ready=None) -> list:
    """Stream ``payloads`` into ``dut.i`` and take as many beats from ``dut.o``; return the
    output payloads. ``ready`` is a repeating pattern of the sink's readiness (0: one cycle
    of backpressure before that beat), so a unit is exercised with stalls. A beat offered
    within :data:`TRAILING_CYCLES` after the last one fails the run: one input, one output."""
    got = []

    async def put(ctx):
        for payload in payloads:
            await stream_put(ctx, dut.i, payload)

    async def get(ctx):
        for k in range(len(payloads)):
            if ready is not None and not ready[k % len(ready)]:
                await ctx.tick()
            got.append(await stream_get(ctx, dut.o))
        for cycle in range(TRAILING_CYCLES):
            assert not ctx.get(dut.o.valid), \
                f"a beat past the {len(payloads)} expected, {cycle} cycles after the last"
            await ctx.tick()

    run_simulation(dut, put, get)
    return got


def first_valid_after_accept(dut, inp, out, payload, before=None) -> int:
    """A block's latency: clock edges from the edge that accepts ``payload`` on stream
    ``inp`` to the edge after which stream ``out`` is valid (``out`` always ready).
    ``before(ctx)``, if given, runs first (to load a table, say)."""
    result = []

    async def tb(ctx):
        if before is not None:
            await before(ctx)
        ctx.set(out.ready, 1)
        ctx.set(inp.payload, payload)
        ctx.set(inp.valid, 1)
        await ctx.tick().until(inp.ready)
        ctx.set(inp.valid, 0)
        n = 1
        while not ctx.get(out.valid):
            await ctx.tick()
            n += 1
        result.append(n)

    run_simulation(dut, tb)
    return result[0]


def vcd_dir() -> Path | None:
    d = os.environ.get("DFVG_VCD")
    return Path(d) if d else None


def run_simulation(dut, *testbenches, processes=(), clock_period=1e-8, name: str | None = None,
                   deadline: float | None = None) -> None:
    """Simulate ``dut`` with a clock, the given async testbenches and processes.

    With ``DFVG_VCD`` set, the run writes ``$DFVG_VCD/<name>.vcd`` (name defaults to the
    current pytest test).
    """
    sim = Simulator(dut)
    sim.add_clock(clock_period, if_exists=True)     # purely combinational designs have none
    for tb in testbenches:
        sim.add_testbench(tb)
    for proc in processes:
        sim.add_process(proc)
    out = vcd_dir()
    if out is None:
        sim.run() if deadline is None else sim.run_until(deadline)
        return
    out.mkdir(parents=True, exist_ok=True)
    test = name or os.environ.get("PYTEST_CURRENT_TEST", "sim").split(" ")[0]
    path = out / (re.sub(r"[^A-Za-z0-9_.-]+", "_", test) + ".vcd")
    with sim.write_vcd(str(path)):
        sim.run() if deadline is None else sim.run_until(deadline)
