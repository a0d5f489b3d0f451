"""The transport: the four operations every draft device offers, and opening one by URL.

=================  ===============================================================
``sim://PRESET``   the functional model of the engine (``sim.device.SimDevice``)
``rtl://PRESET``   the generated engine in Amaranth's simulator (``sim.rtl_device.RtlDevice``)
``rtl+verilator://PRESET``
                   the same Verilog in Verilator (``sim.verilator_device.VerilatorDevice``);
                   an RTL device refuses a preset whose matrix tile has more than
                   ``sim.rtl_limits.MAX_SIMULATED_MULTIPLIERS`` multipliers unless the
                   URL ends in ``?large=1``
``xdma://PATH``    an Alveo card through the XDMA driver's ``PATH_user``, ``_h2c_0``, ``_c2h_0``,
                   ``_events_0`` (``dfvg_host.xdma``); ``xdma://`` alone is ``/dev/xdma0``
=================  ===============================================================

:class:`~dfvg_host.transport_base.Transport` (the protocol) and :class:`TransportError` are
defined in :mod:`dfvg_host.transport_base` and re-exported here.

:class:`LinkedTransport` wraps any transport and accounts PCIe traffic with a
:class:`LinkModel`: every figure it produces is *modelled*. :class:`RetryingTransport`
wraps any transport and retries an access that raised :class:`TransportError` a bounded
number of times, so that a transient link error costs a retry instead of the device.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from urllib.parse import parse_qs, urlparse

from dfvg_host.transport_base import Transport, TransportError

__all__ = ["Transport", "LinkModel", "LinkStats", "LinkedTransport", "RetryingTransport",
           "open_transport", "TransportError"]


@dataclass(frozen=True)
class LinkModel:
    """PCIe cost model (all Alveo presets: Gen3 x16 through XDMA).

    Attributes
    ----------
    dma_gbps : float
        Sustained DMA bandwidth, GB/s (Gen3 x16 is 15.75 GB/s raw; XDMA sustains ~12).
    dma_setup_us : float
        Per-transfer cost: descriptor fetch, doorbell and completion, ~5 µs for XDMA.
    reg_read_us, reg_write_us : float
        An MMIO read is a non-posted round trip (~1 µs); a write is posted (~0.2 µs).
    irq_us : float
        Interrupt delivery to a waiting user thread (~5 µs).
    """
    dma_gbps: float = 12.0
    dma_setup_us: float = 5.0
    reg_read_us: float = 1.0
    reg_write_us: float = 0.2
    irq_us: float = 5.0


@dataclass
class LinkStats:
    """PCIe traffic counted by :class:`LinkedTransport`; ``seconds`` is modelled."""
    h2c_bytes: int = 0
    c2h_bytes: int = 0
    dma_transfers: int = 0
    reg_reads: int = 0
    reg_writes: int = 0
    irqs: int = 0
    seconds: float = 0.0

    @property
    def bytes(self) -> int:
        return self.h2c_bytes + self.c2h_bytes

    def snapshot(self) -> "LinkStats":
        return LinkStats(**vars(self))

    def since(self, before: "LinkStats") -> "LinkStats":
        return LinkStats(**{k: getattr(self, k) - getattr(before, k) for k in vars(self)})


class LinkedTransport:
    """A transport that forwards every operation and charges it to the link model.

    Members
    -------
    inner : Transport
    link : LinkModel
    stats : LinkStats
    """

    def __init__(self, inner: Transport, link: LinkModel | None = None):
        self.inner = inner
        self.link = link or LinkModel()
        self.stats = LinkStats()

    def _dma(self, nbytes: int) -> float:
        return self.link.dma_setup_us * 1e-6 + nbytes / (self.link.dma_gbps * 1e9)

    def read32(self, offset: int) -> int:
        self.stats.reg_reads += 1
        self.stats.seconds += self.link.reg_read_us * 1e-6
        return self.inner.read32(offset)

    def write32(self, offset: int, value: int) -> None:
        self.stats.reg_writes += 1
        self.stats.seconds += self.link.reg_write_us * 1e-6
        self.inner.write32(offset, value)

    def dma_write(self, addr: int, data: bytes) -> None:
        self.stats.h2c_bytes += len(data)
        self.stats.dma_transfers += 1
        self.stats.seconds += self._dma(len(data))
        self.inner.dma_write(addr, data)

    def dma_read(self, addr: int, nbytes: int) -> bytes:
        self.stats.c2h_bytes += nbytes
        self.stats.dma_transfers += 1
        self.stats.seconds += self._dma(nbytes)
        return self.inner.dma_read(addr, nbytes)

    def wait_irq(self, timeout_s: float) -> bool:
        got = self.inner.wait_irq(timeout_s)
        if got:
            self.stats.irqs += 1
            self.stats.seconds += self.link.irq_us * 1e-6
        return got

    def close(self) -> None:
        self.inner.close()


class RetryingTransport:
    """A transport that retries an access raising :class:`TransportError`.

    Each operation is tried at most ``1 + retries`` times, sleeping ``backoff_s``,
    ``2·backoff_s``, ... between tries; the last error is re-raised. Every operation of
    the driver may be repeated without harm: register reads have no side effects, the
    register writes it issues either set a value or are write-1-to-clear/-set commands
    (a repeated ``START`` reruns the same request, whose result carries the same ``seq``),
    and DMAs write or read whole buffers. An interrupt wait is retried with the same
    timeout. Errors other than :class:`TransportError` pass through at once.

    Members
    -------
    inner : Transport
    retries : int
        Extra tries per operation (0: no retry).
    backoff_s : float
        Sleep before the first retry; doubled before each further one.
    retried : int
        Retries made so far (each one after a failed try).
    failures : int
        Operations that failed on every try (their error was re-raised).
    """

    def __init__(self, inner: Transport, *, retries: int = 2, backoff_s: float = 1e-3):
        if retries < 0:
            raise ValueError(f"retries must be >= 0, got {retries}")
        self.inner = inner
        self.retries = retries
        self.backoff_s = backoff_s
        self.retried = 0
        self.failures = 0

    def _call(self, op: str, *args):
        delay = self.backoff_s
        for attempt in range(self.retries + 1):
            try:
                return getattr(self.inner, op)(*args)
            except TransportError:
                if attempt == self.retries:
                    self.failures += 1
                    raise
            self.retried += 1
            if delay > 0:
                time.sleep(delay)
            delay *= 2

    def read32(self, offset: int) -> int:
        return self._call("read32", offset)

    def write32(self, offset: int, value: int) -> None:
        self._call("write32", offset, value)

    def dma_write(self, addr: int, data: bytes) -> None:
        self._call("dma_write", addr, data)

    def dma_read(self, addr: int, nbytes: int) -> bytes:
        return self._call("dma_read", addr, nbytes)

    def wait_irq(self, timeout_s: float) -> bool:
        return self._call("wait_irq", timeout_s)

    def close(self) -> None:
        self.inner.close()


#: The query options each simulated device takes: ``cores`` (a card with several draft
#: cores; not built by the Verilator harness) and ``large`` (a card's preset in RTL
#: simulation, sim.rtl_limits).
DEVICE_OPTIONS = {"sim": {"cores"}, "rtl": {"cores", "large"}, "rtl+verilator": {"large"}}


def _card_config(url: str, config, cores: str):
    """``config`` for a card of ``cores`` draft cores (``?cores=N``), held to the
    generator's own bounds on the count (``EngineConfig.draft_cores``)."""
    from dfvg_hw.spec.config import ConfigError

    if not cores.isdigit():
        raise TransportError(f"device {url!r}: cores={cores}: give the number of draft cores on the "
                             "card, an integer")
    try:
        return config.with_changes(draft_cores=int(cores))
    except (ValueError, ConfigError) as exc:
        raise TransportError(f"device {url!r}: cores={cores}: {exc}") from None


def open_transport(url: str) -> tuple[Transport, "object"]:
    """Open a device URL; returns (transport, engine config it was built from or None)."""
    from dfvg_hw.spec.config import ConfigError, get_preset

    parsed = urlparse(url)
    scheme = parsed.scheme
    if scheme in ("sim", "rtl", "rtl+verilator"):
        name = parsed.netloc or parsed.path.lstrip("/")
        try:
            config = get_preset(name or ("alveo-u55c" if scheme == "sim" else "tiny"))
        except ConfigError as exc:
            raise TransportError(f"device {url!r}: {exc}") from None
        options = parse_qs(parsed.query)
        known = DEVICE_OPTIONS[scheme]
        unknown = set(options) - known
        if unknown:
            raise TransportError(f"device {url!r}: unknown option {sorted(unknown)[0]!r}; a {scheme} device "
                                 f"takes {', '.join(f'?{k}=…' for k in sorted(known))}")
        card = _card_config(url, config, options.get("cores", ["1"])[-1])
        if scheme == "sim":
            from sim.device import SimCard, SimDevice
            return (SimCard(config, card.draft_cores) if card.draft_cores > 1 else SimDevice(config)), config
        from sim.rtl_limits import SimulationTooLarge, check_simulation_size
        try:
            check_simulation_size(config, scheme, large=options.get("large", ["0"])[-1] == "1")
        except SimulationTooLarge as exc:
            raise TransportError(str(exc)) from None
        if scheme == "rtl":
            from sim.rtl_device import RtlDevice
            return RtlDevice(card), config
        from sim.verilator_device import VerilatorDevice
        try:
            return VerilatorDevice(config), config
        except (FileNotFoundError, RuntimeError) as exc:
            raise TransportError(f"device {url!r}: {exc}") from None
    if scheme == "xdma":
        # The card reports its parameters in registers; the driver checks them at bring-up.
        from dfvg_host.xdma import DEFAULT_PREFIX, XdmaTransport
        return XdmaTransport(parsed.netloc + parsed.path or DEFAULT_PREFIX), None
    raise TransportError(f"device {url!r}: unknown scheme; use sim://PRESET "
                         "(for example sim://alveo-u55c)")
