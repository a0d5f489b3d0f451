"""AXI4-Lite master helpers for Amaranth testbenches, and a slave-side protocol monitor.

``await axil_write(ctx, bus, addr, value)`` and ``await axil_read(ctx, bus, addr)`` do one
access each on a :class:`dfvg_hw.axi_lite.AXI4LiteSignature` bus (the slave's interface,
e.g. ``dut.bus``). An :class:`AxiLiteTiming` delays each channel's valid or ready by some
cycles, which sets the order in which ``AW`` and ``W`` arrive and back-pressures ``B`` and
``R``; :meth:`AxiLiteTiming.random` draws one. :func:`axil_slave_monitor` is a process
that fails the simulation when the slave breaks a handshake rule.
"""

from __future__ import annotations

from dataclasses import dataclass

from dfvg_hw.axi_lite import AxiResp

__all__ = ["AxiLiteTiming", "axil_write", "axil_read", "axil_slave_monitor", "AxiLiteError"]


class AxiLiteError(AssertionError):
    """The slave answered with an error response, or broke the protocol."""


@dataclass(frozen=True)
class AxiLiteTiming:
    """Cycles a master waits before each step of an access.

    ``aw`` and ``w``: before raising ``awvalid`` / ``wvalid`` (counted from the start of the
    write, so ``aw < w`` sends the address first, ``w < aw`` the data first, equal values
    both together); ``b``: after both are sent, before raising ``bready``; ``ar``: before
    raising ``arvalid``; ``r``: after the address is sent, before raising ``rready``.
    """
    aw: int = 0
    w: int = 0
    b: int = 0
    ar: int = 0
    r: int = 0

    @classmethod
    def random(cls, rng, max_delay: int = 4) -> "AxiLiteTiming":
        """Independent delays of 0 … ``max_delay`` cycles (``rng``: a numpy Generator)."""
        return cls(*(int(d) for d in rng.integers(0, max_delay + 1, 5)))


_NO_DELAY = AxiLiteTiming()


async def _wait(ctx, cycles: int) -> None:
    for _ in range(cycles):
        await ctx.tick()


async def axil_write(ctx, bus, addr: int, value: int, strobe: int | None = None,
                     timing: AxiLiteTiming = _NO_DELAY, *, expect=AxiResp.OKAY) -> AxiResp:
    """Write ``value`` at byte address ``addr`` (``strobe``: byte enables, default all).

    Returns the response; raises :class:`AxiLiteError` if it is not ``expect`` (pass
    ``expect=None`` to accept any).
    """
    if strobe is None:
        strobe = (1 << len(bus.wstrb)) - 1
    ctx.set(bus.awaddr, addr)
    ctx.set(bus.awprot, 0)
    ctx.set(bus.wdata, value)
    ctx.set(bus.wstrb, strobe)
    # Drive both channels cycle by cycle: each valid rises after its own delay and stays
    # up until its handshake, independently of the other channel.
    address_sent = data_sent = False
    cycle = 0
    while not (address_sent and data_sent):
        ctx.set(bus.awvalid, not address_sent and cycle >= timing.aw)
        ctx.set(bus.wvalid, not data_sent and cycle >= timing.w)
        _, _, awvalid, awready, wvalid, wready = await ctx.tick().sample(
            bus.awvalid, bus.awready, bus.wvalid, bus.wready)
        address_sent |= bool(awvalid and awready)
        data_sent |= bool(wvalid and wready)
        cycle += 1
    ctx.set(bus.awvalid, 0)
    ctx.set(bus.wvalid, 0)
    await _wait(ctx, timing.b)
    ctx.set(bus.bready, 1)
    resp, = await ctx.tick().sample(bus.bresp).until(bus.bvalid)
    ctx.set(bus.bready, 0)
    resp = AxiResp(resp)
    if expect is not None and resp != expect:
        raise AxiLiteError(f"write of 0x{value:08x} at 0x{addr:x}: response {resp.name}, "
                           f"expected {expect.name}")
    return resp


async def axil_read(ctx, bus, addr: int, timing: AxiLiteTiming = _NO_DELAY, *,
                    expect=AxiResp.OKAY) -> int:
    """Read the word at byte address ``addr``; raises :class:`AxiLiteError` if the response
    is not ``expect`` (``None`` accepts any)."""
    await _wait(ctx, timing.ar)
    ctx.set(bus.araddr, addr)
    ctx.set(bus.arprot, 0)
    ctx.set(bus.arvalid, 1)
    await ctx.tick().until(bus.arready)
    ctx.set(bus.arvalid, 0)
    await _wait(ctx, timing.r)
    ctx.set(bus.rready, 1)
    data, resp = await ctx.tick().sample(bus.rdata, bus.rresp).until(bus.rvalid)
    ctx.set(bus.rready, 0)
    resp = AxiResp(resp)
    if expect is not None and resp != expect:
        raise AxiLiteError(f"read at 0x{addr:x}: response {resp.name}, expected {expect.name}")
    return int(data)


def axil_slave_monitor(bus):
    """A process (``run_simulation(processes=[...])``) that raises :class:`AxiLiteError`
    when the slave drops ``bvalid`` or ``rvalid`` before the handshake, or changes the
    response or read data while it waits for one."""
    async def monitor(ctx):
        held = {}        # channel → (its signals' values) while valid waits for ready
        async for _, _, bvalid, bready, bresp, rvalid, rready, rdata, rresp in ctx.tick().sample(
                bus.bvalid, bus.bready, bus.bresp, bus.rvalid, bus.rready, bus.rdata, bus.rresp):
            for channel, valid, ready, payload in (("B", bvalid, bready, (bresp,)),
                                                   ("R", rvalid, rready, (rdata, rresp))):
                before = held.pop(channel, None)
                if before is not None and (not valid or payload != before):
                    raise AxiLiteError(f"{channel} channel: valid or payload changed before "
                                       f"the handshake (was {before}, now valid={valid} "
                                       f"{payload})")
                if valid and not ready:
                    held[channel] = payload
    return monitor
