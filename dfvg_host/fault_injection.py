"""A transport that injects faults, to prove that faults are survived and nothing is lost.

:class:`FaultInjectingTransport` wraps any :class:`~dfvg_host.transport.Transport` (the
``sim`` device in the tests) and, at chosen operations or at random with a seeded rate,
makes the link or the device misbehave in one of five ways (:class:`FaultKind`):

==========  ======================================================================
``drop``    the access raises :class:`TransportError` and never reaches the device
            (a dropped PCIe transaction, an ``XdmaError``)
``lose``    a register write or host-to-card DMA returns normally but never arrives
            (a lost posted write: the engine runs a stale request, or none)
``corrupt`` bits flipped in the value a register read returns, the bytes a DMA read
            returns or the bytes a DMA write delivers
``delay``   a started request does not finish for ``seconds`` (``inf``: until the
            host writes ``ABORT`` or ``SOFT_RESET``): no interrupt, ``STATUS`` BUSY
``error``   the registers of a started request report an error: ``STATUS.ERROR`` and
            ``ERROR = code`` until the next ``START`` or ``SOFT_RESET``
==========  ======================================================================

Operations are counted by name (:data:`OPS`); a ``CONTROL`` write with the ``START`` bit
is the operation ``start``, every other register write ``write32``. A :class:`Fault`
names the operation it hits and the index of its first hit among the operations of that
name since the transport was armed; ``repeat`` hits as many in a row (a large number: a
device that keeps failing). With ``rate > 0`` every other operation is hit with that
probability by a kind drawn from those that apply to it; the draws come from one
``random.Random(seed)``, so a campaign is repeatable.
"""

from __future__ import annotations

import enum
import math
import random
import time
from collections import Counter
from dataclasses import dataclass

from dfvg_hw.spec.descriptors import ErrorCode
from dfvg_hw.spec.regmap import Control, Irq, Reg, Status
from dfvg_host.transport_base import Transport, TransportError

__all__ = ["FaultKind", "Fault", "Injected", "FaultInjectingTransport", "InjectedTransportError",
           "OPS", "APPLIES_TO", "RANDOM_ERROR_CODES"]


class FaultKind(str, enum.Enum):
    """What an injected fault does (see the module docstring)."""
    DROP = "drop"
    LOSE = "lose"
    CORRUPT = "corrupt"
    DELAY = "delay"
    ERROR = "error"


#: The operations a fault can hit, by the name faults count them under.
OPS = ("read32", "write32", "start", "dma_write", "dma_read", "wait_irq")

#: The operations each kind applies to (the first is its default).
APPLIES_TO: dict[FaultKind, tuple[str, ...]] = {
    FaultKind.DROP: ("dma_read", "read32", "write32", "start", "dma_write", "wait_irq"),
    FaultKind.LOSE: ("dma_write", "write32", "start"),
    FaultKind.CORRUPT: ("dma_read", "read32", "dma_write"),
    FaultKind.DELAY: ("start",),
    FaultKind.ERROR: ("start",),
}

#: Codes a random ``error`` fault reports: faults a reset can clear, and the two a
#: request provokes (``KV_OVERFLOW``, ``BAD_REQUEST``), which the decoder does not
#: reset for.
RANDOM_ERROR_CODES = (ErrorCode.WATCHDOG, ErrorCode.ILLEGAL_INSTRUCTION, ErrorCode.BAD_ADDRESS,
                      ErrorCode.ABORTED, ErrorCode.PROGRAM, ErrorCode.KV_OVERFLOW,
                      ErrorCode.BAD_REQUEST)


class InjectedTransportError(TransportError):
    """The error a ``drop`` fault raises."""


@dataclass(frozen=True)
class Fault:
    """One planned fault.

    Members
    -------
    kind : FaultKind
    op : str
        The operation it hits (:data:`OPS`); by default the first of
        ``APPLIES_TO[kind]``.
    at : int
        Index of the first operation hit, among the operations named ``op`` since the
        transport was armed (0 = the first).
    repeat : int or float
        Consecutive operations of that name hit (``math.inf``: every one from ``at`` on, a
        device that keeps failing).
    bits : int
        ``corrupt``: bits flipped per hit.
    seconds : float
        ``delay``: how long the request stays unfinished; ``math.inf`` until the host
        writes ``ABORT`` or ``SOFT_RESET``.
    code : ErrorCode
        ``error``: the code ``ERROR`` reports.
    """
    kind: FaultKind
    op: str | None = None
    at: int = 0
    repeat: int | float = 1
    bits: int = 1
    seconds: float = math.inf
    code: ErrorCode = ErrorCode.WATCHDOG

    def __post_init__(self):
        kind = FaultKind(self.kind)
        object.__setattr__(self, "kind", kind)
        object.__setattr__(self, "code", ErrorCode(self.code))
        if self.op is None:
            object.__setattr__(self, "op", APPLIES_TO[kind][0])
        if self.op not in APPLIES_TO[kind]:
            raise ValueError(f"a {kind.value} fault applies to {', '.join(APPLIES_TO[kind])}, "
                             f"not {self.op!r}")
        if self.at < 0 or self.repeat < 1 or self.bits < 1 or not self.seconds >= 0:
            raise ValueError(f"fault {self}: at >= 0, repeat >= 1, bits >= 1 and seconds >= 0")
        if kind is FaultKind.ERROR and self.code == ErrorCode.OK:
            raise ValueError("an error fault needs a code other than OK")

    def hits(self, op: str, index: int) -> bool:
        return op == self.op and self.at <= index < self.at + self.repeat


@dataclass(frozen=True)
class Injected:
    """A fault that was injected.

    Members
    -------
    kind : FaultKind
    op : str
        The operation hit (:data:`OPS`).
    index : int
        Its index among the operations of that name since the transport was armed.
    detail : str
        The register, address or bits concerned.
    planned : bool
        From the plan (else drawn at random).
    """
    kind: FaultKind
    op: str
    index: int
    detail: str = ""
    planned: bool = True


@dataclass
class _Overlay:
    """What the registers of the current request pretend."""
    hang_until: float = 0.0          # monotonic time; STATUS BUSY and no interrupt before it
    error: ErrorCode = ErrorCode.OK  # reported by STATUS/ERROR until the next START or reset


class FaultInjectingTransport:
    """A transport that forwards to ``inner`` and injects faults.

    Members
    -------
    inner : Transport
    plan : list of Fault
        Planned faults; an operation the plan hits draws no random fault.
    rate : float
        Probability that any other operation is hit by a random fault.
    kinds : tuple of FaultKind
        The kinds random faults are drawn from.
    rng : random.Random
        Seeded: decides random faults, their kind and parameters, and the bits flipped.
    armed : bool
        Whether faults are injected and operations counted (build the device unarmed,
        then :meth:`arm`).
    counts : collections.Counter
        Operations seen since armed, by name (:data:`OPS`).
    injected : list of Injected
        Every fault injected since armed, in order.
    """

    def __init__(self, inner: Transport, plan: list[Fault] | tuple[Fault, ...] = (), *,
                 rate: float = 0.0, seed: int = 0, kinds: tuple[FaultKind, ...] = tuple(FaultKind),
                 armed: bool = True):
        self.inner = inner
        self.plan: list[Fault] = []
        self.rate = 0.0
        self.kinds: tuple[FaultKind, ...] = ()
        self.rng = random.Random(seed)
        self.armed = False
        self.counts: Counter = Counter()
        self.injected: list[Injected] = []
        self._overlay = _Overlay()
        self.arm(plan, rate=rate, kinds=kinds)
        self.armed = armed

    # -- control ---------------------------------------------------------------------
    def arm(self, plan: list[Fault] | tuple[Fault, ...] | None = None, *, rate: float | None = None,
            kinds: tuple[FaultKind, ...] | None = None, seed: int | None = None) -> None:
        """Start injecting: zero the operation counts and the log, and replace what is given."""
        if plan is not None:
            self.plan = list(plan)
        if rate is not None:
            if not 0.0 <= rate <= 1.0:
                raise ValueError(f"rate must be in [0, 1], got {rate}")
            self.rate = rate
        if kinds is not None:
            self.kinds = tuple(FaultKind(k) for k in kinds)
        if seed is not None:
            self.rng.seed(seed)
        self.counts.clear()
        self.injected.clear()
        self.armed = True

    def disarm(self) -> None:
        """Stop injecting (a request hanging or in error stays so until ABORT/START/reset)."""
        self.armed = False

    def by_kind(self) -> dict[str, int]:
        """Faults injected since armed, by kind name."""
        return dict(Counter(f.kind.value for f in self.injected))

    # -- choosing faults ---------------------------------------------------------------
    def _fault(self, op: str) -> Fault | None:
        if not self.armed:
            return None
        index = self.counts[op]
        self.counts[op] += 1
        for fault in self.plan:
            if fault.hits(op, index):
                return fault
        if self.rate and self.rng.random() < self.rate:
            kinds = [k for k in self.kinds if op in APPLIES_TO[k]]
            if kinds:
                kind = self.rng.choice(kinds)
                return Fault(kind, op, at=index, bits=self.rng.randint(1, 3),
                             code=self.rng.choice(RANDOM_ERROR_CODES))
        return None

    def _log(self, fault: Fault, op: str, detail: str) -> None:
        planned = any(fault is f for f in self.plan)
        self.injected.append(Injected(fault.kind, op, self.counts[op] - 1, detail, planned))

    def _drop(self, fault: Fault, op: str, detail: str):
        self._log(fault, op, detail)
        raise InjectedTransportError(f"injected fault: {op} {detail} dropped")

    def _flip(self, data: bytes, bits: int) -> tuple[bytes, list[int]]:
        out = bytearray(data)
        where = [self.rng.randrange(len(out) * 8) for _ in range(bits)] if out else []
        for bit in where:
            out[bit >> 3] ^= 1 << (bit & 7)
        return bytes(out), where

    # -- the overlay of a hung or failed request ----------------------------------------------
    def _hanging(self) -> bool:
        return time.monotonic() < self._overlay.hang_until

    def _registers(self, offset: int, value: int) -> int:
        o = self._overlay
        if self._hanging():
            if offset == Reg.STATUS:
                return (value & ~(Status.DONE | Status.ERROR)) | Status.BUSY
            if offset == Reg.IRQ_STATUS:
                return value & ~Irq.DONE
        elif o.error:
            if offset == Reg.STATUS:
                return value | Status.DONE | Status.ERROR
            if offset == Reg.ERROR:
                return int(o.error)
        return value

    # -- transport operations ----------------------------------------------------------
    def read32(self, offset: int) -> int:
        fault = self._fault("read32")
        detail = f"of register 0x{offset:03x}"
        if fault and fault.kind is FaultKind.DROP:
            self._drop(fault, "read32", detail)
        value = self._registers(offset, self.inner.read32(offset))
        if fault and fault.kind is FaultKind.CORRUPT:
            raw, bits = self._flip(value.to_bytes(4, "little"), fault.bits)
            self._log(fault, "read32", f"{detail}: bits {bits} flipped")
            value = int.from_bytes(raw, "little")
        return value

    def write32(self, offset: int, value: int) -> None:
        start = offset == Reg.CONTROL and bool(value & Control.START)
        op = "start" if start else "write32"
        fault = self._fault(op)
        detail = f"of 0x{value & 0xFFFFFFFF:x} to register 0x{offset:03x}"
        if fault and fault.kind is FaultKind.DROP:
            self._drop(fault, op, detail)
        if fault and fault.kind is FaultKind.LOSE:
            self._log(fault, op, f"{detail} lost")
            return
        self.inner.write32(offset, value)
        if offset == Reg.CONTROL:
            if value & (Control.ABORT | Control.SOFT_RESET):
                self._overlay.hang_until = 0.0
            if value & (Control.START | Control.SOFT_RESET):
                self._overlay.error = ErrorCode.OK
        if fault and fault.kind is FaultKind.DELAY:
            self._overlay.hang_until = time.monotonic() + fault.seconds
            self._log(fault, op, f"request hangs for {fault.seconds:g} s")
        if fault and fault.kind is FaultKind.ERROR:
            self._overlay.error = fault.code
            self._log(fault, op, f"registers report {fault.code.name}")

    def dma_write(self, addr: int, data: bytes) -> None:
        fault = self._fault("dma_write")
        detail = f"of {len(data)} bytes to 0x{addr:x}"
        if fault and fault.kind is FaultKind.DROP:
            self._drop(fault, "dma_write", detail)
        if fault and fault.kind is FaultKind.LOSE:
            self._log(fault, "dma_write", f"{detail} lost")
            return
        if fault and fault.kind is FaultKind.CORRUPT:
            data, bits = self._flip(data, fault.bits)
            self._log(fault, "dma_write", f"{detail}: bits {bits} flipped")
        self.inner.dma_write(addr, data)

    def dma_read(self, addr: int, nbytes: int) -> bytes:
        fault = self._fault("dma_read")
        detail = f"of {nbytes} bytes from 0x{addr:x}"
        if fault and fault.kind is FaultKind.DROP:
            self._drop(fault, "dma_read", detail)
        data = self.inner.dma_read(addr, nbytes)
        if fault and fault.kind is FaultKind.CORRUPT:
            data, bits = self._flip(data, fault.bits)
            self._log(fault, "dma_read", f"{detail}: bits {bits} flipped")
        return data

    def wait_irq(self, timeout_s: float) -> bool:
        fault = self._fault("wait_irq")
        if fault and fault.kind is FaultKind.DROP:
            self._drop(fault, "wait_irq", f"(timeout {timeout_s:g} s)")
        if self._hanging():
            left = self._overlay.hang_until - time.monotonic()
            time.sleep(max(0.0, min(timeout_s, left)))
            if self._hanging():
                return False
            timeout_s = max(0.0, timeout_s - left)
        return self.inner.wait_irq(timeout_s)

    def close(self) -> None:
        self.inner.close()
