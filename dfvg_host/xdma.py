"""The ``xdma`` transport: an Alveo card through AMD/Xilinx's XDMA Linux driver.

The driver (``xdma.ko`` from github.com/Xilinx/dma_ip_drivers) makes character devices per
card, named from a prefix such as ``/dev/xdma0``:

======================  ==================================================================
``<prefix>_user``       the AXI-Lite BAR, i.e. the engine's register file: ``mmap``, or a
                        4-byte ``pread``/``pwrite`` at the register's byte offset
``<prefix>_h2c_0``      host-to-card DMA: ``pwrite`` with the card address as file offset
``<prefix>_c2h_0``      card-to-host DMA: ``pread`` with the card address as file offset
``<prefix>_events_0``   user interrupt 0 (the engine's ``irq``): a 4-byte read blocks until
                        it fires and returns the event count; the file supports ``poll``
======================  ==================================================================

:class:`XdmaTransport` implements :class:`~dfvg_host.transport_base.Transport` on these files.
Register access maps the BAR when the device allows it and falls back to ``pread``/
``pwrite``; DMA runs on a worker thread so that a hung card cannot hang the host past
``dma_timeout_s``; ``wait_irq`` polls the events file. Every failure is an
:class:`XdmaError` that says what to check.

**Striping.** The engine addresses device memory as one logical space laid across its
memory channels (:mod:`dfvg_hw.spec.striping`); the card's DMA sees physical addresses.
On open the transport reads the channel geometry from the engine's parameter registers
(``P_MEM_PORTS``, ``P_MEM_PORT_BITS``, ``P_MEM_CHANNEL_KIB``) and :class:`StripedDma` turns
every logical transfer into one DMA per channel for the whole engine beats, plus a DMA per
port-beat piece at a partial first or last beat. With one channel the map is the identity
and each transfer is one DMA, as before.
"""

from __future__ import annotations

import concurrent.futures
import mmap
import os
import select

from typing import Callable

import numpy as np

from dfvg_hw.spec.regmap import Reg
from dfvg_hw.spec.striping import Striping
from dfvg_host.transport_base import TransportError

__all__ = ["XdmaTransport", "XdmaError", "StripedDma", "DEFAULT_PREFIX", "DEVICE_SUFFIXES",
           "REGISTER_WINDOW"]

DEFAULT_PREFIX = "/dev/xdma0"
#: The device files the transport opens, by role.
DEVICE_SUFFIXES = {"user": "_user", "h2c": "_h2c_0", "c2h": "_c2h_0", "events": "_events_0"}
#: Bytes of the user BAR mapped for register access: one page holds the whole register
#: map (dfvg_hw.spec.regmap), and every BAR is at least a page.
REGISTER_WINDOW = mmap.PAGESIZE

_MODULE_HINT = ("load the XDMA driver (insmod xdma.ko from Xilinx dma_ip_drivers, or modprobe "
                "xdma) and check that the card is on the bus with a DFVG bitstream (lspci -d 10ee:)")
_PERMISSION_HINT = ("run as root, or give your user access with a udev rule such as "
                    'KERNEL=="xdma*", MODE="0660", GROUP="<your group>"')


class XdmaError(TransportError):
    """The XDMA device files could not be opened or an access to them failed."""


class StripedDma:
    """Logical transfers over physical DMA: whole engine beats as one run per channel, a
    partial beat at either end as port-beat pieces.

    Parameters
    ----------
    striping : Striping
        The engine's channel geometry.
    write : callable
        ``write(physical, data)``: one host-to-card DMA.
    read : callable
        ``read(physical, nbytes) -> bytes``: one card-to-host DMA.
    """

    def __init__(self, striping: Striping, write: Callable[[int, bytes], None],
                 read: Callable[[int, int], bytes]):
        self.striping, self._write, self._read = striping, write, read

    def _split(self, addr: int, nbytes: int) -> tuple[int, int]:
        """The whole-beat middle ``[lo, hi)`` of a logical range (empty if it has none)."""
        beat = self.striping.beat_bytes
        lo = -(-addr // beat) * beat
        hi = (addr + nbytes) // beat * beat
        return (lo, hi) if hi > lo else (addr, addr)

    def write(self, addr: int, data: bytes) -> None:
        data = bytes(data)
        if self.striping.ports == 1:
            self._write(addr, data)
            return
        lo, hi = self._split(addr, len(data))
        for at, phys, run in self._edge_runs(addr, len(data), lo, hi):
            self._write(phys, data[at:at + run])
        if hi > lo:
            for _, phys, run in self.striping.to_channels(lo, np.frombuffer(data[lo - addr:hi - addr], np.uint8)):
                self._write(phys, run.tobytes())

    def read(self, addr: int, nbytes: int) -> bytes:
        if self.striping.ports == 1:
            return self._read(addr, nbytes)
        out = bytearray(nbytes)
        lo, hi = self._split(addr, nbytes)
        for at, phys, run in self._edge_runs(addr, nbytes, lo, hi):
            out[at:at + run] = self._read(phys, run)
        if hi > lo:
            per_port = (hi - lo) // self.striping.ports
            first = (lo // self.striping.beat_bytes) * self.striping.port_bytes
            runs = [np.frombuffer(self._read(p * self.striping.channel_bytes + first, per_port), np.uint8)
                    for p in range(self.striping.ports)]
            out[lo - addr:hi - addr] = self.striping.from_channels(lo, runs).tobytes()
        return bytes(out)

    def _edge_runs(self, addr: int, nbytes: int, lo: int, hi: int):
        """``(offset in the transfer, physical address, bytes)`` of each port-beat piece
        of the partial beats before ``lo`` and after ``hi``."""
        for start, end in ((addr, lo), (hi, addr + nbytes)):
            if end <= start:
                continue
            pieces = self.striping.pieces(start, end - start)
            for i, (_, phys, off) in enumerate(pieces):
                run = (pieces[i + 1][2] if i + 1 < len(pieces) else end - start) - off
                yield start - addr + off, phys, run


class XdmaTransport:
    """Registers, DMA and the completion interrupt of one card through the XDMA driver.

    Members
    -------
    prefix : str
        Device-file prefix (``/dev/xdma0``).
    paths : dict of str to str
        The four device files by role (``user``, ``h2c``, ``c2h``, ``events``).
    mapped : bool
        Whether register access goes through an ``mmap`` of the BAR (else ``pread``/``pwrite``).
    dma_timeout_s : float
        Longest a single DMA may take before :class:`XdmaError`.
    """

    def __init__(self, prefix: str = DEFAULT_PREFIX, *, dma_timeout_s: float = 10.0,
                 use_mmap: bool = True):
        self.prefix = prefix
        self.paths = {role: prefix + suffix for role, suffix in DEVICE_SUFFIXES.items()}
        self.dma_timeout_s = dma_timeout_s
        missing = [path for path in self.paths.values() if not os.path.exists(path)]
        if missing:
            raise XdmaError(f"XDMA device files missing: {', '.join(missing)}; {_MODULE_HINT}")
        self._fds: dict[str, int] = {}
        self._map = self._regs = None
        self._dma_worker = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="xdma-dma")
        self._stuck: str | None = None
        try:
            for role, flags in (("user", os.O_RDWR), ("h2c", os.O_WRONLY), ("c2h", os.O_RDONLY),
                                ("events", os.O_RDONLY)):
                self._fds[role] = self._open(self.paths[role], flags)
            if use_mmap:
                self._map_registers()
            self._striped = StripedDma(self._read_striping(), self._dma_write_physical,
                                       self._dma_read_physical)
        except BaseException:
            self.close()
            raise

    @staticmethod
    def _open(path: str, flags: int) -> int:
        try:
            return os.open(path, flags | os.O_CLOEXEC)
        except PermissionError:
            raise XdmaError(f"permission denied opening {path}; {_PERMISSION_HINT}") from None
        except FileNotFoundError:
            raise XdmaError(f"XDMA device file missing: {path}; {_MODULE_HINT}") from None
        except OSError as exc:
            raise XdmaError(f"cannot open {path}: {exc.strerror}; {_MODULE_HINT}") from None

    def _map_registers(self) -> None:
        """Map the BAR's first page; devices that cannot be mapped keep pread/pwrite."""
        try:
            self._map = mmap.mmap(self._fds["user"], REGISTER_WINDOW, mmap.MAP_SHARED,
                                  mmap.PROT_READ | mmap.PROT_WRITE)
        except (OSError, ValueError):
            return
        # A 'I'-typed view makes each access one aligned 32-bit load or store, as the
        # AXI-Lite register file needs (byte-wise copies would split W1C/W1S writes).
        self._regs = memoryview(self._map).cast("I")

    @property
    def mapped(self) -> bool:
        return self._regs is not None

    def _read_striping(self) -> Striping:
        """The engine's memory channels, from its parameter registers. An engine that
        reports none (a bitstream older than version 2.2 reads 0) has one channel: the
        whole memory, unstriped."""
        ports = self.read32(Reg.P_MEM_PORTS)
        if ports <= 1:
            return Striping(1, 16, 1 << 62)
        bits, kib = self.read32(Reg.P_MEM_PORT_BITS), self.read32(Reg.P_MEM_CHANNEL_KIB)
        if bits % 128 or not kib or ports & (ports - 1):
            raise XdmaError(f"the engine reports {ports} memory channels of {kib} KiB behind "
                            f"{bits}-bit ports, which no DFVG engine has; the bitstream does not "
                            "match this host (rebuild it, or update dfvg)")
        return Striping(ports, bits // 8, kib << 10)

    # -- registers ---------------------------------------------------------------------
    def _check_register(self, offset: int) -> None:
        if offset % 4 or not 0 <= offset < REGISTER_WINDOW:
            raise ValueError(f"register offset 0x{offset:x} is not a 32-bit register of the "
                             f"first {REGISTER_WINDOW} bytes of the BAR")

    def read32(self, offset: int) -> int:
        self._check_register(offset)
        if self._regs is not None:
            return self._regs[offset >> 2]
        data = self._io(os.pread, "user", 4, offset, what=f"register read at 0x{offset:x}")
        if len(data) != 4:
            raise XdmaError(f"short read from {self.paths['user']}: {len(data)} of 4 bytes of the "
                            f"register at 0x{offset:x}; the XDMA driver or card misbehaves")
        return int.from_bytes(data, "little")

    def write32(self, offset: int, value: int) -> None:
        self._check_register(offset)
        value &= 0xFFFFFFFF
        if self._regs is not None:
            self._regs[offset >> 2] = value
        else:
            written = self._io(os.pwrite, "user", value.to_bytes(4, "little"), offset,
                               what=f"register write at 0x{offset:x}")
            if written != 4:
                raise XdmaError(f"short write to {self.paths['user']}: {written} of 4 bytes of the "
                                f"register at 0x{offset:x}")
        if offset == Reg.IRQ_STATUS:
            self._drain_events()

    def _io(self, call, role: str, *args, what: str):
        try:
            return call(self._fds[role], *args)
        except OSError as exc:
            raise XdmaError(f"{what} on {self.paths[role]} failed: {exc.strerror}") from None

    # -- DMA ---------------------------------------------------------------------------
    def dma_write(self, addr: int, data: bytes) -> None:
        """Write ``data`` at the engine's logical address ``addr`` (striped over channels)."""
        self._striped.write(addr, data)

    def dma_read(self, addr: int, nbytes: int) -> bytes:
        """Read ``nbytes`` from the engine's logical address ``addr``."""
        return self._striped.read(addr, nbytes)

    def _dma_write_physical(self, addr: int, data: bytes) -> None:
        self._run_dma(self._write_all, addr, memoryview(bytes(data)),
                      what=f"H2C DMA of {len(data)} bytes to card address 0x{addr:x}")

    def _dma_read_physical(self, addr: int, nbytes: int) -> bytes:
        return self._run_dma(self._read_all, addr, nbytes,
                             what=f"C2H DMA of {nbytes} bytes from card address 0x{addr:x}")

    def _write_all(self, addr: int, data: memoryview) -> None:
        done = 0
        while done < len(data):
            n = self._io(os.pwrite, "h2c", data[done:], addr + done, what=f"H2C DMA at 0x{addr + done:x}")
            if n <= 0:
                raise XdmaError(f"short write to {self.paths['h2c']}: {done} of {len(data)} bytes "
                                f"to card address 0x{addr:x}, and the driver accepts no more")
            done += n

    def _read_all(self, addr: int, nbytes: int) -> bytes:
        chunks, done = [], 0
        while done < nbytes:
            chunk = self._io(os.pread, "c2h", nbytes - done, addr + done,
                             what=f"C2H DMA at 0x{addr + done:x}")
            if not chunk:
                raise XdmaError(f"short read from {self.paths['c2h']}: {done} of {nbytes} bytes "
                                f"from card address 0x{addr:x}, and the driver returns no more")
            chunks.append(chunk)
            done += len(chunk)
        return b"".join(chunks)

    def _run_dma(self, transfer, addr, payload, *, what: str):
        if self._stuck:
            raise XdmaError(f"{what}: refused, an earlier DMA never finished ({self._stuck}); "
                            "close the device, reload the xdma driver or reset the card, and reopen")
        future = self._dma_worker.submit(transfer, addr, payload)
        try:
            return future.result(timeout=self.dma_timeout_s)
        except concurrent.futures.TimeoutError:
            # The worker stays blocked in the driver; later DMAs would queue behind it.
            self._stuck = what
            raise XdmaError(f"{what} did not finish within {self.dma_timeout_s:g} s; the card or the "
                            "XDMA driver is hung (check dmesg, reload the driver or reset the card)") from None

    # -- interrupt ---------------------------------------------------------------------
    def wait_irq(self, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` for user interrupt 0; consumes the event it reports."""
        poller = select.poll()
        poller.register(self._fds["events"], select.POLLIN)
        ready = poller.poll(max(0, round(timeout_s * 1000)))
        if not ready:
            return False
        if ready[0][1] & (select.POLLERR | select.POLLHUP | select.POLLNVAL):
            raise XdmaError(f"the interrupt file {self.paths['events']} reports an error "
                            f"(poll events 0x{ready[0][1]:x}); the card may have gone away")
        return self._read_event() > 0

    def _read_event(self) -> int:
        data = self._io(os.read, "events", 4, what="interrupt event read")
        if len(data) != 4:
            raise XdmaError(f"short read from {self.paths['events']}: {len(data)} of 4 bytes of the "
                            "event count")
        return int.from_bytes(data, "little")

    def _drain_events(self) -> None:
        """Consume an event already counted, so that it cannot answer the next wait.

        The driver writes IRQ_STATUS to clear the interrupt before each request; if the
        last request's interrupt was seen through STATUS instead (a lost or late event),
        its event would otherwise make the next ``wait_irq`` return before the engine ran.
        """
        poller = select.poll()
        poller.register(self._fds["events"], select.POLLIN)
        if poller.poll(0):
            self._read_event()

    def close(self) -> None:
        if self._regs is not None:
            self._regs.release()
            self._regs = None
        if self._map is not None:
            self._map.close()
            self._map = None
        for fd in self._fds.values():
            try:
                os.close(fd)
            except OSError:
                pass        # Linux releases the descriptor even when close reports an error
        self._fds = {}
        # A stuck worker cannot be joined; do not wait for it.
        self._dma_worker.shutdown(wait=self._stuck is None, cancel_futures=True)
