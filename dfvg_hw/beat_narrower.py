"""Beat narrower: the non-matrix parts' narrow view of the wide engine beat.

The striped memory path (:class:`~dfvg_hw.striped_memory_port.StripedMemoryPort`) moves one
*engine beat* of ``W = mem_ports · mem_port_bits`` bits: 2 KiB at ``alveo-u55c``. Only the
matrix path (MATMUL's weight tiles and requant records) needs a beat that wide; every other
part of the controller (program load, request header and tokens, result writer, EMBED,
RMSNORM, ROPE, the KV sequencer, ACTMUL) reads small blocks a VMEM line at a time,
and a 2 KiB beat would only make their gearboxes and word selects 32 times wider. This
component gives them a memory port of ``D = mem_port_bits`` bits (one channel's beat) on
top of the wide one::

    narrow.read_cmd  (addr a multiple of D/8)  ─►  wide.read_cmd (addr rounded down to W/8)
    narrow.read_data ◄─ piece (addr mod W)/D … of each wide beat, one a cycle ◄─ wide.read_data
    narrow.write_data ─► gathered into W-bit beats ─► wide.write_data

Reads. A command ``(addr, length)`` becomes the wide command from ``addr`` rounded down to
the engine beat, ``length`` grown by the ``s · D/8`` bytes skipped (``s = (addr mod W/8) /
(D/8)``); the narrow side sees exactly ``ceil(length / (D/8))`` pieces, ``last`` on the
final one. The pieces are cut combinationally from the wide port's output register: piece
``s`` of the first wide beat is on ``narrow.read_data`` as soon as that beat is, the
leading pieces cost no cycle, one piece passes a cycle, and a wide beat is taken from the
port in the cycle its last piece (the ``k − 1``-th, ``k = W/D``, or the command's final
one) is taken; the rest of the final wide beat is dropped. So narrow piece ``i`` of a read
is in wide beat ``(s + i) // k`` and leaves no earlier than that beat arrives and no
earlier than the cycle after piece ``i − 1`` — the cycle model's
:meth:`sim.timing_common.PortTiming.for_units`. A small FIFO carries each forwarded
command's ``s`` and final piece to the data side.

Writes start on an engine beat (``addr`` a multiple of ``W/8``: the result buffer's 4 KiB
regions): ``D``-bit beats are gathered into ``W``-bit beats, the beat that completes a wide
beat (or the command's final one) goes out in the cycle it comes, combinationally, and the
wide port masks the bytes past ``length``. A write command waits until the previous one's
beats are all in.

Refusals are the narrow port's own, as a memory port of ``D/8``-byte beats would make them
(:mod:`dfvg_hw.memory_port`): a read whose ``addr`` is not a multiple of ``D/8``, a write
whose ``addr`` is not a multiple of ``W/8`` (``error.misaligned``), a command past
``mem_bytes`` (``error.range``) is accepted and dropped and its flag is raised from the next
cycle on; a zero-length command is a no-op. ``error`` is these flags OR the wide port's,
``clear_error`` clears both. ``read_idle`` and ``write_idle`` are the wide port's (a
forwarded command keeps the wide port busy until its last beat has left).

With ``W == D`` (one memory port) the component is a wire: the wide port itself refuses
what it refuses.
"""

from __future__ import annotations

from amaranth import Cat, Module, Mux, ResetInserter, Signal, unsigned
from amaranth.lib import data, stream, wiring
from amaranth.lib.fifo import SyncFIFO
from amaranth.lib.wiring import In, Out
from amaranth.utils import exact_log2

from dfvg_hw.memory_port import MemoryCommand, MemoryPortError, ReadBeat
from dfvg_hw.spec import timing
from dfvg_hw.spec.config import EngineConfig

__all__ = ["MemoryClientSignature", "BeatNarrower", "NARROW_BEAT_BITS"]

#: The beats the non-matrix parts take: one memory channel's beat.
NARROW_BEAT_BITS = (128, 256, 512)

#: Read commands the narrower tracks at once: every burst the wide port has in flight
#: (``MEM_MAX_OUTSTANDING``), one command in its splitter and one beat in its output
#: register, so the FIFO never holds a command back.
READ_TRACK_DEPTH = timing.MEM_MAX_OUTSTANDING + 2


class MemoryClientSignature(wiring.Signature):
    """A memory port's client side (members named as the
    :class:`~dfvg_hw.memory_port.MemoryPort`'s, directions flipped).

    Members
    -------
    read_cmd : Out(stream.Signature(MemoryCommand(config)))
    read_data : In(stream.Signature(ReadBeat(data_width)))
    write_cmd : Out(stream.Signature(MemoryCommand(config)))
    write_data : Out(stream.Signature(unsigned(data_width)))
    read_idle : In(1)
    write_idle : In(1)
    error : In(MemoryPortError())
    clear_error : Out(1)
    """

    def __init__(self, config: EngineConfig, data_width: int):
        super().__init__({
            "read_cmd": Out(stream.Signature(MemoryCommand(config))),
            "read_data": In(stream.Signature(ReadBeat(data_width))),
            "write_cmd": Out(stream.Signature(MemoryCommand(config))),
            "write_data": Out(stream.Signature(unsigned(data_width))),
            "read_idle": In(1),
            "write_idle": In(1),
            "error": In(MemoryPortError()),
            "clear_error": Out(1),
        })


class _ReadTrack(data.StructLayout):
    """A forwarded read's pieces: ``skip`` leading pieces of its first wide beat, its
    final piece ``end`` in its last wide beat."""

    def __init__(self, piece_bits: int):
        super().__init__({"skip": unsigned(piece_bits), "end": unsigned(piece_bits)})


class BeatNarrower(wiring.Component):
    """``D``-bit memory port on top of a ``W``-bit one (see the module docstring).

    Parameters
    ----------
    config : EngineConfig
        ``mem_bytes`` bounds the commands.
    wide_width : int
        ``W``: the wide port's beat in bits (the engine beat).
    narrow_width : int
        ``D``: the beat the clients see, 128, 256 or 512 bits, dividing ``W``.

    Members
    -------
    narrow : In(MemoryClientSignature(config, narrow_width))
        The port the clients use (a memory port's members, ``D``-bit beats).
    wide : Out(MemoryClientSignature(config, wide_width))
        To the wide memory port.
    flush : In(1)
        Forget the reads in flight (their data are drained from the wide port directly):
        the controller's drain after a fault.
    """

    def __init__(self, config: EngineConfig, wide_width: int, narrow_width: int):
        if narrow_width not in NARROW_BEAT_BITS or wide_width % narrow_width \
                or wide_width // narrow_width & (wide_width // narrow_width - 1):
            raise ValueError(f"a {wide_width}-bit beat does not narrow to {narrow_width} bits: "
                             f"the narrow beat is 128, 256 or 512 bits and a power-of-two "
                             f"fraction of the wide one")
        self.config = config
        self.wide_width, self.narrow_width = wide_width, narrow_width
        #: narrow pieces per wide beat
        self.pieces = wide_width // narrow_width
        super().__init__({
            "narrow": In(MemoryClientSignature(config, narrow_width)),
            "wide": Out(MemoryClientSignature(config, wide_width)),
            "flush": In(1),
        })

    def elaborate(self, platform):
        m = Module()
        narrow, wide = self.narrow, self.wide
        if self.pieces == 1:
            self._wire_through(m)
            return m

        k, D = self.pieces, self.narrow_width
        piece_bits = exact_log2(k)
        narrow_bytes, wide_bytes = D // 8, self.wide_width // 8
        nb, wb = exact_log2(narrow_bytes), exact_log2(wide_bytes)
        own = Signal(MemoryPortError())           # this port's own refusals, sticky
        # clear_error first: a cause in the same cycle still sets its flag (later wins)
        with m.If(narrow.clear_error):
            m.d.sync += own.eq(0)

        def in_range(cmd):
            return cmd.addr + cmd.length <= self.config.mem_bytes

        def refuse(cmd, aligned):
            with m.If(~aligned):
                m.d.sync += own.misaligned.eq(1)
            with m.If(~in_range(cmd)):
                m.d.sync += own.range.eq(1)

        # -- reads -------------------------------------------------------------------------
        m.submodules.read_tracks = tracks = ResetInserter({"sync": self.flush})(
            SyncFIFO(width=_ReadTrack(piece_bits).size, depth=READ_TRACK_DEPTH))
        cmd = narrow.read_cmd.payload
        aligned = cmd.addr[:nb] == 0
        forward = aligned & in_range(cmd) & (cmd.length != 0)
        skip = cmd.addr[nb:wb]
        pieces = (cmd.length + (narrow_bytes - 1)) >> nb
        m.d.comb += [
            wide.read_cmd.valid.eq(narrow.read_cmd.valid & forward & tracks.w_rdy),
            wide.read_cmd.payload.addr.eq((cmd.addr >> wb) << wb),
            wide.read_cmd.payload.length.eq(cmd.length + (skip << nb)),
            narrow.read_cmd.ready.eq(Mux(forward, wide.read_cmd.ready & tracks.w_rdy, 1)),
            tracks.w_en.eq(wide.read_cmd.valid & wide.read_cmd.ready),
            tracks.w_data.eq(Cat(skip, (skip + pieces - 1)[:piece_bits])),
        ]
        with m.If(narrow.read_cmd.valid & narrow.read_cmd.ready & ~forward):
            refuse(cmd, aligned)

        track = data.View(_ReadTrack(piece_bits), tracks.r_data)
        first = Signal(init=1)                    # the next piece is a command's first
        at = Signal(piece_bits)
        piece = Mux(first, track.skip, at)
        final = wide.read_data.payload.last & (piece == track.end)
        beat_taken = final | (piece == k - 1)
        m.d.comb += [
            narrow.read_data.valid.eq(wide.read_data.valid & tracks.r_rdy),
            narrow.read_data.payload.data.eq(wide.read_data.payload.data.word_select(piece, D)),
            narrow.read_data.payload.last.eq(final),
            wide.read_data.ready.eq(narrow.read_data.ready & tracks.r_rdy & beat_taken),
        ]
        with m.If(narrow.read_data.valid & narrow.read_data.ready):
            m.d.comb += tracks.r_en.eq(final)
            m.d.sync += [first.eq(final), at.eq(piece + 1)]
        with m.If(self.flush):
            m.d.sync += first.eq(1)

        # -- writes ------------------------------------------------------------------------
        cmd = narrow.write_cmd.payload
        aligned = cmd.addr[:wb] == 0
        forward = aligned & in_range(cmd) & (cmd.length != 0)
        pieces_left = Signal(range(self.config.mem_bytes // narrow_bytes + 1))
        idle = pieces_left == 0
        m.d.comb += [
            wide.write_cmd.valid.eq(narrow.write_cmd.valid & forward & idle),
            wide.write_cmd.payload.eq(cmd),
            narrow.write_cmd.ready.eq(idle & Mux(forward, wide.write_cmd.ready, 1)),
        ]
        with m.If(wide.write_cmd.valid & wide.write_cmd.ready):
            m.d.sync += pieces_left.eq((cmd.length + (narrow_bytes - 1)) >> nb)
        with m.If(narrow.write_cmd.valid & narrow.write_cmd.ready & ~forward):
            refuse(cmd, aligned)

        held = Signal(self.wide_width)
        slot = Signal(piece_bits)
        completes = (slot == k - 1) | (pieces_left == 1)
        m.d.comb += [
            wide.write_data.valid.eq(narrow.write_data.valid & ~idle & completes),
            wide.write_data.payload.eq(Cat(*(Mux(slot == i, narrow.write_data.payload,
                                                 held.word_select(i, D)) for i in range(k)))),
            narrow.write_data.ready.eq(~idle & Mux(completes, wide.write_data.ready, 1)),
        ]
        with m.If(narrow.write_data.valid & narrow.write_data.ready):
            m.d.sync += [held.word_select(slot, D).eq(narrow.write_data.payload),
                         slot.eq(Mux(completes, 0, slot + 1)),
                         pieces_left.eq(pieces_left - 1)]

        # -- status ------------------------------------------------------------------------
        m.d.comb += [
            wide.clear_error.eq(narrow.clear_error),
            narrow.error.eq(wide.error.as_value() | own.as_value()),
            narrow.read_idle.eq(wide.read_idle),
            narrow.write_idle.eq(wide.write_idle),
        ]
        return m

    def _wire_through(self, m):
        narrow, wide = self.narrow, self.wide
        for name in ("read_cmd", "write_cmd", "write_data"):
            outer, inner = getattr(narrow, name), getattr(wide, name)
            m.d.comb += [inner.valid.eq(outer.valid), inner.payload.eq(outer.payload),
                         outer.ready.eq(inner.ready)]
        m.d.comb += [narrow.read_data.valid.eq(wide.read_data.valid),
                     narrow.read_data.payload.eq(wide.read_data.payload),
                     wide.read_data.ready.eq(narrow.read_data.ready),
                     wide.clear_error.eq(narrow.clear_error)]
        for name in ("read_idle", "write_idle", "error"):
            m.d.comb += getattr(narrow, name).eq(getattr(wide, name))
