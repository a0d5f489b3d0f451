"""An emulation of the XDMA driver's character devices, backed by the functional model.

Tests point :class:`dfvg_host.xdma.XdmaTransport` at ``<mountpoint>/xdma0`` and it runs
exactly the code a card would: ``open``, 4-byte ``pread``/``pwrite`` at register offsets,
``pwrite``/``pread`` with card addresses as file offsets, ``poll`` and a blocking 4-byte
``read`` on the events file. The files are served by a small FUSE file system written here
(the kernel's FUSE protocol spoken directly over ``/dev/fuse``, no library), so every
access reaches the emulator synchronously, in order, as a driver call reaches the card:

=================  ======================================================================
``xdma0_user``     READ at a 4-aligned offset returns the register (``device.read32``),
                   4 bytes; WRITE of 4 bytes calls ``device.write32`` (which runs a START
                   to completion, as :class:`sim.device.SimDevice` does). Misaligned
                   offsets or other sizes fail with EPROTO, as ``cdev_ctrl.c`` does;
                   offsets beyond the 64 KiB BAR with EINVAL. ``mmap`` is refused (the
                   files are direct-I/O), so the transport's pread/pwrite path is the one
                   under test here.
``xdma0_h2c_0``    WRITE → ``device.dma_write(offset, data)``; outside device memory: EIO
                   (an AXI decode error in the real DMA engine).
``xdma0_c2h_0``    READ → ``device.dma_read(offset, size)``; outside memory: EIO.
``xdma0_events_0`` 4-byte READ blocks until the engine's interrupt line
                   (``IRQ_STATUS & IRQ_ENABLE``) has risen since the last read, then
                   returns 1 and clears; ``poll`` reports POLLIN while an event is
                   pending — the semantics of ``cdev_events.c``.
=================  ======================================================================

Limits: one DMA channel each way; the interrupt line is sampled after each register
write (the functional model only changes state there); no MSI-X, no engine running
concurrently with the host (the functional model is synchronous); large transfers are
split by the kernel into FUSE requests of at most 128 KiB, which the real driver does not
do (it splits into descriptors instead) — the transport sees one ``pread``/``pwrite``
either way.

Fault injection, for the transport's error paths: ``deny`` (file names whose ``open``
fails with EACCES, as a device node without permission does — also for root, which
mode bits would not stop), ``c2h_chunk`` (return at most this many bytes per C2H read),
``c2h_stop_after`` (after this many bytes, C2H reads return nothing) and
``c2h_stall`` (C2H reads never complete, like a hung DMA, until :meth:`stop`).

Mounting needs ``/dev/fuse`` and either root (``mount(2)``) or ``fusermount3``
(Debian package ``fuse3``); :func:`fuse_unavailable` says why not when it cannot.
"""

from __future__ import annotations

import ctypes
import errno
import os
import select
import shutil
import socket
import stat
import struct
import subprocess
import tempfile
import threading
from pathlib import Path

__all__ = ["XdmaEmulator", "fuse_unavailable", "BAR_BYTES"]

BAR_BYTES = 64 * 1024           # the AXI-Lite BAR the Vivado flow configures
MAX_WRITE = 128 * 1024

# FUSE protocol (include/uapi/linux/fuse.h): opcodes, flags and struct layouts.
LOOKUP, FORGET, GETATTR, OPEN, READ, WRITE, STATFS, RELEASE = 1, 2, 3, 14, 15, 16, 17, 18
FLUSH, INIT, OPENDIR, READDIR, RELEASEDIR, INTERRUPT, DESTROY, POLL, BATCH_FORGET = \
    25, 26, 27, 28, 29, 36, 38, 40, 42
NO_REPLY = {FORGET, INTERRUPT, BATCH_FORGET}
FOPEN_DIRECT_IO = 1 << 0
FUSE_BIG_WRITES = 1 << 5
FUSE_POLL_SCHEDULE_NOTIFY = 1 << 0
FUSE_NOTIFY_POLL = 1
POLLIN_RDNORM = select.POLLIN | select.POLLRDNORM

IN_HEADER = struct.Struct("<IIQQIIIHH")       # len opcode unique nodeid uid gid pid extlen pad
OUT_HEADER = struct.Struct("<IiQ")            # len error unique
INIT_OUT = struct.Struct("<IIIIHHIIHHI7I")
ATTR = struct.Struct("<QQQQQQIIIIIIIIII")
ENTRY_OUT = struct.Struct("<QQQQII")          # + ATTR
ATTR_OUT = struct.Struct("<QII")              # + ATTR
OPEN_OUT = struct.Struct("<QII")
IO_IN = struct.Struct("<QQIIQII")            # fh offset size flags lock_owner flags pad
WRITE_OUT = struct.Struct("<II")
POLL_IN = struct.Struct("<QQII")             # fh kh flags events
POLL_OUT = struct.Struct("<II")

ROOT = 1
FILES = {"user": 2, "h2c_0": 3, "c2h_0": 4, "events_0": 5}


class _Reply(Exception):
    """Raised by a handler to answer with an errno."""

    def __init__(self, code: int):
        self.code = code


def fuse_unavailable() -> str | None:
    """Why the emulator cannot mount here, or ``None`` if it can (probably)."""
    if not os.path.exists("/dev/fuse"):
        return "/dev/fuse does not exist (load the fuse module, or run the container with --device /dev/fuse)"
    if os.geteuid() != 0 and shutil.which("fusermount3") is None:
        return "not root and no fusermount3 (Debian package fuse3) to mount a FUSE file system"
    return None


class XdmaEmulator:
    """Serves ``<mountpoint>/<name>_{user,h2c_0,c2h_0,events_0}`` from ``device``.

    Members
    -------
    device : object
        Anything with ``read32``/``write32``/``dma_write``/``dma_read`` (a ``SimDevice``).
    mem_bytes : int
        Size the DMA files report.
    prefix : str
        Device-file prefix to give the transport (``<mountpoint>/xdma0``).
    deny, c2h_chunk, c2h_stop_after, c2h_stall
        Fault injection (see the module docstring).
    """

    def __init__(self, device, mem_bytes: int, *, name: str = "xdma0", deny=(),
                 c2h_chunk: int | None = None, c2h_stop_after: int | None = None,
                 c2h_stall: bool = False):
        self.device = device
        self.mem_bytes = mem_bytes
        self.name = name
        self.deny = set(deny)
        self.c2h_chunk = c2h_chunk
        self.c2h_stop_after = c2h_stop_after
        self.c2h_stall = c2h_stall
        self._mountpoint = Path(tempfile.mkdtemp(prefix="dfvg-xdma-"))
        self._fd: int | None = None
        self._thread: threading.Thread | None = None
        self._stopping = threading.Event()
        self._events = 0                 # cdev_events.c's events_irq
        self._event_readers: list[int] = []      # unique ids of blocked events reads
        self._poll_handles: set[int] = set()
        self._stalled: list[int] = []
        self._c2h_served = 0
        self._via_fusermount = False
        self.error: BaseException | None = None

    @property
    def prefix(self) -> str:
        return str(self._mountpoint / self.name)

    # -- mount and serve -------------------------------------------------------------
    def start(self) -> "XdmaEmulator":
        reason = fuse_unavailable()
        if reason:
            raise OSError(errno.ENODEV, f"cannot emulate XDMA device files: {reason}")
        if os.geteuid() == 0:
            self._fd = os.open("/dev/fuse", os.O_RDWR | os.O_CLOEXEC)
            opts = (f"fd={self._fd},rootmode={stat.S_IFDIR:o},user_id=0,group_id=0").encode()
            libc = ctypes.CDLL(None, use_errno=True)
            if libc.mount(b"dfvg-xdma", str(self._mountpoint).encode(), b"fuse.dfvg_xdma",
                          ctypes.c_ulong(2 | 4), opts) != 0:          # MS_NOSUID | MS_NODEV
                code = ctypes.get_errno()
                os.close(self._fd)
                raise OSError(code, f"mount of the XDMA emulation failed: {os.strerror(code)}")
        else:
            self._fd = self._fusermount()
        self._thread = threading.Thread(target=self._serve, name="xdma-emulator", daemon=True)
        self._thread.start()
        return self

    def _fusermount(self) -> int:
        """Mount through the setuid fusermount3, which hands back the /dev/fuse descriptor."""
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        with ours, theirs:
            env = dict(os.environ, _FUSE_COMMFD=str(theirs.fileno()))
            subprocess.run(["fusermount3", "-o", "subtype=dfvg_xdma", "--", str(self._mountpoint)],
                           env=env, pass_fds=(theirs.fileno(),), check=True)
            _, fds, _, _ = socket.recv_fds(ours, 1, 1)
        self._via_fusermount = True
        return fds[0]

    def stop(self) -> None:
        """Answer whatever is still blocked, unmount and stop serving."""
        if self._fd is None:
            return
        self._stopping.set()
        if self._thread:
            self._thread.join(timeout=10)
        for unique in self._event_readers + self._stalled:
            self._send(unique, -errno.EIO)
        self._event_readers, self._stalled = [], []
        if self._via_fusermount:
            subprocess.run(["fusermount3", "-u", "-z", str(self._mountpoint)], check=False)
        else:
            libc = ctypes.CDLL(None, use_errno=True)
            libc.umount2(str(self._mountpoint).encode(), 2)           # MNT_DETACH
        os.close(self._fd)
        self._fd = None
        try:
            self._mountpoint.rmdir()
        except OSError:
            pass

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()

    def _serve(self) -> None:
        buffer_size = MAX_WRITE + 4096
        while not self._stopping.is_set():
            # Wake up now and then to notice stop(): a blocked read(2) would not.
            if not select.select([self._fd], [], [], 0.05)[0]:
                continue
            try:
                request = os.read(self._fd, buffer_size)
            except OSError as exc:
                if exc.errno in (errno.ENOENT, errno.EINTR, errno.EAGAIN):
                    continue         # the request was interrupted before we read it
                return               # ENODEV: unmounted
            try:
                self._dispatch(request)
            except BaseException as exc:    # keep serving; the test reports it
                self.error = exc

    def _send(self, unique: int, error: int = 0, body: bytes = b"") -> None:
        try:
            os.write(self._fd, OUT_HEADER.pack(OUT_HEADER.size + len(body), error, unique) + body)
        except OSError as exc:
            if exc.errno != errno.ENOENT:      # the caller was interrupted and gave up
                raise

    def _dispatch(self, request: bytes) -> None:
        _, opcode, unique, node, *_ = IN_HEADER.unpack_from(request)
        payload = memoryview(request)[IN_HEADER.size:]
        if opcode in NO_REPLY:
            return
        handler = self._HANDLERS.get(opcode)
        if handler is None:
            self._send(unique, -errno.ENOSYS)
            return
        try:
            body = handler(self, unique, node, payload)
        except _Reply as reply:
            self._send(unique, -reply.code)
            return
        if body is not None:          # None: answered later (a blocking read)
            self._send(unique, 0, body)

    # -- file-system plumbing ----------------------------------------------------------
    def _attr(self, node: int) -> bytes:
        if node == ROOT:
            mode, size = stat.S_IFDIR | 0o755, 0
        else:
            role = next(r for r, n in FILES.items() if n == node)
            size = {"user": BAR_BYTES, "events_0": 4}.get(role, self.mem_bytes)
            mode = stat.S_IFREG | 0o666
        return ATTR.pack(node, size, (size + 511) // 512, 0, 0, 0, 0, 0, 0, mode, 1, 0, 0, 0, 4096, 0)

    def _init(self, unique, node, payload):
        major, minor, readahead, _ = struct.unpack_from("<IIII", payload)
        return INIT_OUT.pack(7, min(minor, 31), readahead, FUSE_BIG_WRITES, 16, 12, MAX_WRITE, 1,
                             MAX_WRITE // 4096, 0, 0, *[0] * 7)

    def _lookup(self, unique, node, payload):
        name = bytes(payload).split(b"\0", 1)[0].decode()
        if node != ROOT or not name.startswith(self.name + "_") or \
                name[len(self.name) + 1:] not in FILES:
            raise _Reply(errno.ENOENT)
        child = FILES[name[len(self.name) + 1:]]
        return ENTRY_OUT.pack(child, 0, 1, 1, 0, 0) + self._attr(child)

    def _getattr(self, unique, node, payload):
        return ATTR_OUT.pack(1, 0, 0) + self._attr(node)

    def _open(self, unique, node, payload):
        role = next((r for r, n in FILES.items() if n == node), None)
        if role is None:
            raise _Reply(errno.EISDIR)
        if f"{self.name}_{role}" in self.deny:
            raise _Reply(errno.EACCES)
        # Direct I/O: no page cache, every pread/pwrite reaches us with its offset and size.
        return OPEN_OUT.pack(node, FOPEN_DIRECT_IO, 0)

    def _opendir(self, unique, node, payload):
        return OPEN_OUT.pack(0, 0, 0)

    def _empty(self, unique, node, payload):
        return b""

    # -- the device files ----------------------------------------------------------------
    def _irq_line(self) -> bool:
        from dfvg_hw.spec.regmap import Reg
        return bool(self.device.read32(Reg.IRQ_STATUS) & self.device.read32(Reg.IRQ_ENABLE))

    def _user_access(self, access):
        """``access()`` on the register file; one event if it raised usr_irq_req. A card's
        engine finishes whenever it finishes; the emulated one can change state only inside
        an access, a read included (a device that runs on its nth STATUS read)."""
        before = self._irq_line()
        result = access()
        if self._irq_line() and not before:
            self._events = 1
            self._deliver_events()
        return result

    def _read(self, unique, node, payload):
        _, offset, size, *_ = IO_IN.unpack_from(payload)
        if node == FILES["user"]:
            if offset % 4:
                raise _Reply(errno.EPROTO)
            if offset + 4 > BAR_BYTES:
                raise _Reply(errno.EINVAL)
            return self._user_access(lambda: self.device.read32(offset)).to_bytes(4, "little")[:size]
        if node == FILES["c2h_0"]:
            return self._c2h(unique, offset, size)
        if node == FILES["events_0"]:
            if size != 4:
                raise _Reply(errno.EPROTO)
            self._event_readers.append(unique)
            self._deliver_events()
            return None
        raise _Reply(errno.EINVAL)       # h2c is write-only

    def _c2h(self, unique, offset, size):
        if self.c2h_stall:
            self._stalled.append(unique)
            return None
        if self.c2h_chunk is not None:
            size = min(size, self.c2h_chunk)
        if self.c2h_stop_after is not None:
            size = max(0, min(size, self.c2h_stop_after - self._c2h_served))
        try:
            data = self.device.dma_read(offset, size)
        except IndexError:
            raise _Reply(errno.EIO) from None
        self._c2h_served += len(data)
        return data

    def _write(self, unique, node, payload):
        _, offset, size, *_ = IO_IN.unpack_from(payload)
        data = bytes(payload[IO_IN.size:IO_IN.size + size])
        if node == FILES["user"]:
            if offset % 4 or size != 4:
                raise _Reply(errno.EPROTO)
            if offset + 4 > BAR_BYTES:
                raise _Reply(errno.EINVAL)
            self._user_access(lambda: self.device.write32(offset, int.from_bytes(data, "little")))
        elif node == FILES["h2c_0"]:
            try:
                self.device.dma_write(offset, data)
            except IndexError:
                raise _Reply(errno.EIO) from None
        else:
            raise _Reply(errno.EINVAL)
        return WRITE_OUT.pack(size, 0)

    def _poll(self, unique, node, payload):
        _, handle, flags, _ = POLL_IN.unpack_from(payload)
        if node != FILES["events_0"]:
            return POLL_OUT.pack(POLLIN_RDNORM | select.POLLOUT, 0)
        if self._events:
            return POLL_OUT.pack(POLLIN_RDNORM, 0)
        if flags & FUSE_POLL_SCHEDULE_NOTIFY:
            self._poll_handles.add(handle)
        return POLL_OUT.pack(0, 0)

    def _deliver_events(self) -> None:
        """Wake pollers; answer one blocked events read with the count, which then clears."""
        if not self._events:
            return
        for handle in self._poll_handles:
            notify = struct.pack("<Q", handle)
            os.write(self._fd, OUT_HEADER.pack(OUT_HEADER.size + len(notify), FUSE_NOTIFY_POLL, 0) + notify)
        self._poll_handles.clear()
        if self._event_readers:
            self._send(self._event_readers.pop(0), 0, self._events.to_bytes(4, "little"))
            self._events = 0

    _HANDLERS = {INIT: _init, LOOKUP: _lookup, GETATTR: _getattr, OPEN: _open, READ: _read,
                 WRITE: _write, POLL: _poll, OPENDIR: _opendir, READDIR: _empty,
                 RELEASE: _empty, RELEASEDIR: _empty, FLUSH: _empty, DESTROY: _empty}
