"""AXI4-Lite: the bus signature, its response codes, and flat prefixed ports for a top level.

The host reaches the engine's register file over AXI4-Lite (on a card, the XDMA user BAR
through a SmartConnect). The signature's members carry the AXI signal names without a
prefix (``awaddr``, ``wdata``, …) so a top-level module can expose them as
``s_axil_awaddr`` … — the names Vivado's interface inference needs
(``boards.vivado.EngineInterface.ports``) — with :func:`prefixed_members` and
:func:`connect_prefixed`.
"""

from __future__ import annotations

from amaranth import Module
from amaranth.lib import enum, wiring
from amaranth.lib.wiring import In, Out

__all__ = ["AXI4LiteSignature", "AxiResp", "prefixed_members", "connect_prefixed"]


class AxiResp(enum.Enum, shape=2):
    """``bresp`` / ``rresp`` codes (AMBA AXI, A3.4.4)."""
    OKAY = 0
    EXOKAY = 1      #: exclusive access success: never on AXI4-Lite
    SLVERR = 2      #: the slave saw the access and reports an error
    DECERR = 3      #: no slave at the address (interconnects answer with this)


class AXI4LiteSignature(wiring.Signature):
    """AXI4-Lite, seen from the master (a slave takes it flipped: ``In(AXI4LiteSignature(…))``).

    Parameters
    ----------
    addr_width : int
        Byte-address width of ``awaddr`` and ``araddr``.
    data_width : int
        32 or 64, the only AXI4-Lite data widths.

    Members
    -------
    awaddr : Out(addr_width)
        Write address.
    awprot : Out(3)
        Write protection type (privileged, non-secure, instruction).
    awvalid : Out(1)
    awready : In(1)
        Write-address handshake.
    wdata : Out(data_width)
        Write data.
    wstrb : Out(data_width // 8)
        Byte strobes: bit ``i`` set writes byte ``i`` of ``wdata``.
    wvalid : Out(1)
    wready : In(1)
        Write-data handshake.
    bresp : In(AxiResp)
        Write response.
    bvalid : In(1)
    bready : Out(1)
        Write-response handshake.
    araddr : Out(addr_width)
        Read address.
    arprot : Out(3)
        Read protection type.
    arvalid : Out(1)
    arready : In(1)
        Read-address handshake.
    rdata : In(data_width)
        Read data.
    rresp : In(AxiResp)
        Read response.
    rvalid : In(1)
    rready : Out(1)
        Read-data handshake.
    """

    def __init__(self, addr_width: int, data_width: int = 32):
        if addr_width < 1:
            raise ValueError(f"AXI4-Lite address width must be positive, not {addr_width}")
        if data_width not in (32, 64):
            raise ValueError(f"AXI4-Lite data width is 32 or 64, not {data_width}")
        self.addr_width = addr_width
        self.data_width = data_width
        super().__init__({
            "awaddr": Out(addr_width), "awprot": Out(3), "awvalid": Out(1), "awready": In(1),
            "wdata": Out(data_width), "wstrb": Out(data_width // 8), "wvalid": Out(1),
            "wready": In(1),
            "bresp": In(AxiResp), "bvalid": In(1), "bready": Out(1),
            "araddr": Out(addr_width), "arprot": Out(3), "arvalid": Out(1), "arready": In(1),
            "rdata": In(data_width), "rresp": In(AxiResp), "rvalid": In(1), "rready": Out(1),
        })

    def __eq__(self, other):
        return (type(other) is type(self) and other.addr_width == self.addr_width
                and other.data_width == self.data_width)

    def __repr__(self):
        return f"AXI4LiteSignature({self.addr_width}, {self.data_width})"


def prefixed_members(signature: wiring.Signature, prefix: str) -> dict[str, wiring.Member]:
    """The port members of ``signature`` (flipped or not) renamed ``prefix + name``.

    A top-level component adds them to its own signature to expose a bus as flat ports with
    the names a tool expects, e.g. ``prefixed_members(AXI4LiteSignature(8).flip(), "s_axil_")``
    gives ``s_axil_awaddr`` (an input) … ``s_axil_rready``.
    """
    members = {}
    for name, member in signature.members.items():
        if not member.is_port:
            raise TypeError(f"member {name!r} is not a port; only flat signatures can be prefixed")
        members[prefix + name] = member
    return members


def connect_prefixed(m: Module, outer, prefix: str, inner) -> None:
    """Connect the flat ports ``prefix + name`` of ``outer`` to the interface ``inner``.

    ``outer`` is a component whose signature includes ``prefixed_members(sig, prefix)`` and
    ``inner`` an interface of the same orientation ``sig`` (a submodule's bus): each input
    of ``outer`` drives the same-named member of ``inner``, and each of ``inner``'s outputs
    drives ``outer``'s port.
    """
    for name, member in inner.signature.members.items():
        port = getattr(outer, prefix + name)
        if member.flow == In:
            m.d.comb += getattr(inner, name).eq(port)
        else:
            m.d.comb += port.eq(getattr(inner, name))
