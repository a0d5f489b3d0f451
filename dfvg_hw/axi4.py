"""AXI4 memory-mapped bus: the engine's master port into device memory (HBM/DDR).

The member names are the flat AXI4 signal names Vivado's interface inference looks for
(``awaddr``, ``arlen``, … — see :meth:`boards.vivado.EngineInterface.ports`), without ID,
LOCK, CACHE, PROT, QOS, REGION and USER signals: the engine issues every burst with ID 0,
normal non-secure data access, so the interconnect's defaults for the missing signals
are right. Directions are the master's.

Only what the engine uses is modelled here: INCR bursts of full-width beats
(``AxSIZE = log2(data_width / 8)``), at most :data:`MAX_BURST_BEATS` beats, never crossing a
:data:`BOUNDARY_BYTES` boundary (AXI4 spec, ARM IHI 0022, §A3.4.1).
"""

from __future__ import annotations

import enum

from amaranth.lib import wiring
from amaranth.lib.wiring import In, Out

from dfvg_hw.spec import timing

__all__ = ["AXI4Signature", "Burst", "Resp", "MAX_BURST_BEATS", "BOUNDARY_BYTES",
           "connect_flat", "master_prefix"]

#: AXI4 INCR bursts carry at most 256 beats (AxLEN is beats − 1, 8 bits).
MAX_BURST_BEATS = timing.AXI_MAX_BURST_BEATS
#: No AXI burst may cross a 4 KiB address boundary (a slave's smallest address region).
BOUNDARY_BYTES = timing.AXI_BOUNDARY_BYTES


class Burst(enum.IntEnum):
    """AxBURST encodings."""
    FIXED = 0
    INCR = 1
    WRAP = 2


class Resp(enum.IntEnum):
    """xRESP encodings. The engine never issues exclusive accesses, so anything but OKAY
    is an error to it (EXOKAY to a normal access is itself a slave fault)."""
    OKAY = 0
    EXOKAY = 1
    SLVERR = 2
    DECERR = 3


class AXI4Signature(wiring.Signature):
    """AXI4 master interface without IDs, from the master's side.

    Parameters
    ----------
    data_width : int
        RDATA/WDATA width in bits: a power of two from 32 to 1024 (256 on the Alveo
        presets: one HBM pseudo-channel beat).
    addr_width : int
        ARADDR/AWADDR width (64, as the XDMA's).

    Members
    -------
    awaddr : Out(addr_width)
    awlen : Out(8)
        Beats in the burst minus one.
    awsize : Out(3)
        log2 of the bytes per beat.
    awburst : Out(2)
        :class:`Burst`.
    awvalid : Out(1)
    awready : In(1)
    wdata : Out(data_width)
        Byte ``i`` of the beat at bits ``8·i … 8·i+7`` (little-endian lanes).
    wstrb : Out(data_width // 8)
        Byte enables.
    wlast : Out(1)
    wvalid : Out(1)
    wready : In(1)
    bresp : In(2)
        :class:`Resp`.
    bvalid : In(1)
    bready : Out(1)
    araddr, arlen, arsize, arburst, arvalid : Out
        As for the write address channel.
    arready : In(1)
    rdata : In(data_width)
    rresp : In(2)
    rlast : In(1)
    rvalid : In(1)
    rready : Out(1)
    """

    def __init__(self, data_width: int = 256, addr_width: int = 64):
        if data_width not in (32, 64, 128, 256, 512, 1024):
            raise ValueError(f"AXI4 data width must be a power of two from 32 to 1024 bits, "
                             f"not {data_width}")
        if not 12 < addr_width <= 64:
            raise ValueError(f"AXI4 address width must be 13 to 64 bits (a burst is confined "
                             f"to a 4 KiB page), not {addr_width}")
        self.data_width = data_width
        self.addr_width = addr_width
        super().__init__({
            "awaddr": Out(addr_width), "awlen": Out(8), "awsize": Out(3), "awburst": Out(2),
            "awvalid": Out(1), "awready": In(1),
            "wdata": Out(data_width), "wstrb": Out(data_width // 8), "wlast": Out(1),
            "wvalid": Out(1), "wready": In(1),
            "bresp": In(2), "bvalid": In(1), "bready": Out(1),
            "araddr": Out(addr_width), "arlen": Out(8), "arsize": Out(3), "arburst": Out(2),
            "arvalid": Out(1), "arready": In(1),
            "rdata": In(data_width), "rresp": In(2), "rlast": In(1), "rvalid": In(1),
            "rready": Out(1),
        })

    @property
    def bytes_per_beat(self) -> int:
        return self.data_width // 8

    def __repr__(self):
        return f"AXI4Signature({self.data_width}, {self.addr_width})"

    def flat_members(self, prefix: str = "m_axi_") -> dict[str, wiring.Member]:
        """This signature's members named ``prefix + name``, for a top-level component
        whose Verilog ports must read ``m_axi_awaddr`` (a nested ``m_axi`` member would
        be written ``m_axi__awaddr``, which Vivado does not infer as an AXI bus)."""
        return {prefix + name: member for name, member in self.members.items()}


def master_prefix(port: int, ports: int) -> str:
    """The flat name prefix of memory master ``port`` of ``ports``: ``m_axi_`` for a
    single-port engine, ``m00_axi_``, ``m01_axi_``, … for several (Vivado infers each as
    its own AXI4 interface, as in its own IP's ``mNN_axi`` naming)."""
    return "m_axi_" if ports == 1 else f"m{port:02d}_axi_"


def connect_flat(m, master, top, prefix: str = "m_axi_") -> None:
    """Wire ``master`` (an interface with :class:`AXI4Signature`, master side, e.g. a
    :class:`~dfvg_hw.memory_port.MemoryPort`'s ``axi``) to ``top``'s flat members made by
    :meth:`AXI4Signature.flat_members` with the same ``prefix``."""
    for name, member in master.signature.members.items():
        outer = getattr(top, prefix + name)
        inner = getattr(master, name)
        m.d.comb += outer.eq(inner) if member.flow == Out else inner.eq(outer)
