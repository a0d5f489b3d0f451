"""AXI4 arbiter: several AXI4 masters onto one AXI4 master per memory port.

Several draft cores on one card (:class:`~dfvg_hw.draft_cores.DraftCores`) share the
card's memory ports: port ``p`` of every core goes through this arbiter onto the card's
port ``p``::

    masters[0][p] ─┐   AR, AW: round-robin grant, one burst at a time   ┌─► axi[p]
    masters[1][p] ─┼─► W: the master whose AW is oldest, until WLAST   ─┤
    …             ─┘   R, B: back to the master that issued the burst ◄─┘

**Routing answers without IDs.** :class:`~dfvg_hw.axi4.AXI4Signature` has no ID signals
(the engine issues every burst with ID 0 and the interconnect's default), so the memory
answers each direction in the order the bursts were issued, and that order says whose
each answer is. The arbiter keeps it per port in three small queues of master indices,
pushed when an AR or AW is transferred: the read queue routes R beats (popped after the
burst's ``arlen + 1`` beats, counted here as :class:`~dfvg_hw.memory_port.MemoryPort`
counts them, so a wrong ``rlast`` cannot send a beat to the wrong master), the write
queue gives the W channel to the master of the oldest AW until its ``wlast``, and the
response queue routes B. Tagging IDs would need ID signals on every port and a card
interconnect that keeps them; the queues need neither, and reads of different masters
are still in flight at once (up to ``max_outstanding`` bursts per port and direction).

**Grant.** AR and AW are each granted round-robin (the master after the one granted last
goes first), one burst at a time; a grant is combinational, so a master alone sees no
cycle added on any channel. An offered AR or AW keeps its grant until it is transferred,
so the payload the memory sees stays stable. Under full load every master gets one burst
in every ``masters`` bursts.

**Ports in lockstep.** With ``ports`` > 1 every master is a striped engine: it issues
the same bursts on all its ports and takes a read beat only when every port has one
(:class:`~dfvg_hw.striped_memory_port.StripedMemoryPort`). Per-port arbiters that
granted independently could order two masters' bursts differently on two ports; each
port then returns the first master's beats first, neither master can take a beat from
both ports, and both wait for ever (the same for W). So one grant serves every port: a
master granted an AR (AW) keeps the grant until its burst is transferred on every port,
and every port sees the masters' bursts in the same order. A master alone is not held
back by this while its ports issue together, as they do behind memories that answer
alike (what the cycle model assumes).

Timing: nothing is registered on the way through. Each port's readies depend
combinationally on the masters' valids (through the grant) and the memory's readies;
a card that needs the timing puts an AXI register slice on either side, at a cycle each
way. W waits one cycle after its AW is transferred (its queue entry is written at that
edge), which costs nothing in front of a memory that takes a burst's W only after its
AW, as :class:`~sim.axi_memory.AXI4SlaveMemory` does.
"""

from __future__ import annotations

from amaranth import Cat, Module, Shape, Signal
from amaranth.lib import wiring
from amaranth.lib.fifo import SyncFIFO
from amaranth.lib.wiring import In, Out

from dfvg_hw.axi4 import AXI4Signature
from dfvg_hw.spec import timing

__all__ = ["AXI4Arbiter"]

#: AR/AW payload fields besides valid and ready
_ADDRESS_FIELDS = ("addr", "len", "size", "burst")


class AXI4Arbiter(wiring.Component):
    """``masters`` AXI4 masters, each with ``ports`` ports, onto ``ports`` AXI4 masters
    (see the module docstring). With one master it is wires.

    Parameters
    ----------
    masters : int
        Masters merged (draft cores), at least 1.
    ports : int
        Ports of each master, and of the merged side (memory channels), at least 1.
    data_width, addr_width : int
        Of every port (:class:`~dfvg_hw.axi4.AXI4Signature`).
    max_outstanding : int, optional
        Bursts in flight per port and direction (the queues' depth); an AR or AW waits
        while its queue is full. By default ``masters · MEM_MAX_OUTSTANDING``: every
        master's :class:`~dfvg_hw.memory_port.MemoryPort` can have all its bursts in
        flight, so the queues never hold one back.

    Members
    -------
    masters : In(AXI4Signature(data_width, addr_width)).array(masters, ports)
        ``masters[i][p]``: port ``p`` of master ``i`` (this side is their slave).
    axi : Out(AXI4Signature(data_width, addr_width)).array(ports)
        The merged masters, port by port.
    """

    def __init__(self, masters: int, *, ports: int = 1, data_width: int = 256,
                 addr_width: int = 64, max_outstanding: int | None = None):
        if masters < 1 or ports < 1:
            raise ValueError(f"an arbiter needs at least one master and one port, not "
                             f"{masters} and {ports}")
        if max_outstanding is None:
            max_outstanding = masters * timing.MEM_MAX_OUTSTANDING
        if max_outstanding < 1:
            raise ValueError(f"max_outstanding must be at least 1, not {max_outstanding}")
        self.n_masters = masters
        self.ports = ports
        self.max_outstanding = max_outstanding
        self.index_bits = Shape.cast(range(masters)).width
        sig = AXI4Signature(data_width, addr_width)
        super().__init__({"masters": In(sig).array(masters, ports),
                          "axi": Out(sig).array(ports)})

    def elaborate(self, platform):
        m = Module()
        if self.n_masters == 1:
            for p in range(self.ports):
                wiring.connect(m, wiring.flipped(self.masters[0][p]), wiring.flipped(self.axi[p]))
            return m

        def queue(name: str, width: int, p: int) -> SyncFIFO:
            fifo = SyncFIFO(width=width, depth=self.max_outstanding)
            m.submodules[f"{name}{p}"] = fifo
            return fifo

        reads = [queue("read_order", self.index_bits + 8, p) for p in range(self.ports)]
        writes = [queue("write_order", self.index_bits, p) for p in range(self.ports)]
        responses = [queue("response_order", self.index_bits, p) for p in range(self.ports)]

        ar_grant, ar_fire = self._address_channel(m, "ar", [q.w_rdy for q in reads])
        aw_grant, aw_fire = self._address_channel(
            m, "aw", [w.w_rdy & b.w_rdy for w, b in zip(writes, responses)])
        for p in range(self.ports):
            axi = self.axi[p]
            m.d.comb += [reads[p].w_en.eq(ar_fire[p]), reads[p].w_data.eq(Cat(ar_grant, axi.arlen)),
                         writes[p].w_en.eq(aw_fire[p]), writes[p].w_data.eq(aw_grant),
                         responses[p].w_en.eq(aw_fire[p]), responses[p].w_data.eq(aw_grant)]
            self._read_data(m, p, reads[p])
            self._write_data(m, p, writes[p])
            self._write_response(m, p, responses[p])
        return m

    # -- AR and AW --------------------------------------------------------------------------
    def _round_robin(self, m, requests, last, grant):
        """``grant`` := the first requesting master after ``last``, wrapping round."""
        n = self.n_masters
        with m.Switch(last):
            for after in range(n):
                with m.Case(after):
                    # Later statements win: the candidates from the lowest priority (the
                    # master granted last) to the highest (the one after it).
                    for k in reversed(range(1, n + 1)):
                        i = (after + k) % n
                        with m.If(requests[i]):
                            m.d.comb += grant.eq(i)

    def _address_channel(self, m, ch: str, room):
        """Grant AR or AW (``ch``) to one master on every port (see the module docstring);
        ``room[p]``: port ``p``'s queues can take the burst. Returns the grant and the
        ports' transfers."""
        n, ports = self.n_masters, self.ports
        requests = Signal(n, name=f"{ch}_requests")
        m.d.comb += requests.eq(Cat(*(Cat(*(getattr(self.masters[i][p], ch + "valid")
                                             for p in range(ports))).any() for i in range(n))))
        held = Signal(name=f"{ch}_held")            # a burst granted, not yet on every port
        owner = Signal(range(n), name=f"{ch}_owner")
        last = Signal(range(n), name=f"{ch}_last", init=n - 1)   # master 0 goes first
        done = Signal(ports, name=f"{ch}_done")      # ports that have transferred it
        grant = Signal(range(n), name=f"{ch}_grant")
        fire = Signal(ports, name=f"{ch}_fire")
        with m.If(held):
            m.d.comb += grant.eq(owner)
        with m.Else():
            self._round_robin(m, requests, last, grant)

        for p in range(ports):
            out = self.axi[p]
            # the port takes the granted burst: not taken there yet, room in its queues
            free = Signal(name=f"{ch}_free{p}")
            m.d.comb += free.eq(~done[p] & room[p])
            with m.Switch(grant):
                for i in range(n):
                    with m.Case(i):
                        src = self.masters[i][p]
                        m.d.comb += [
                            getattr(out, ch + "valid").eq(free & getattr(src, ch + "valid")),
                            getattr(src, ch + "ready").eq(free & getattr(out, ch + "ready")),
                        ]
                        m.d.comb += [getattr(out, ch + f).eq(getattr(src, ch + f))
                                     for f in _ADDRESS_FIELDS]
            m.d.comb += fire[p].eq(getattr(out, ch + "valid") & getattr(out, ch + "ready"))

        with m.If(held | requests.any()):
            with m.If((done | fire).all()):
                m.d.sync += [held.eq(0), done.eq(0), last.eq(grant)]
            with m.Else():
                m.d.sync += [held.eq(1), owner.eq(grant), done.eq(done | fire)]
        return grant, fire

    # -- R, W, B ---------------------------------------------------------------------------
    def _read_data(self, m, p: int, order: SyncFIFO):
        """R beats of port ``p`` to the master at the head of its read queue, for the
        burst's ``arlen + 1`` beats."""
        axi = self.axi[p]
        head = order.r_data[:self.index_bits]
        length = order.r_data[self.index_bits:]
        beat = Signal(8, name=f"read_beat{p}")
        for i in range(self.n_masters):
            dst = self.masters[i][p]
            m.d.comb += [dst.rdata.eq(axi.rdata), dst.rresp.eq(axi.rresp), dst.rlast.eq(axi.rlast),
                         dst.rvalid.eq(axi.rvalid & order.r_rdy & (head == i))]
        with m.Switch(head):
            for i in range(self.n_masters):
                with m.Case(i):
                    m.d.comb += axi.rready.eq(order.r_rdy & self.masters[i][p].rready)
        with m.If(axi.rvalid & axi.rready):
            with m.If(beat == length):
                m.d.sync += beat.eq(0)
                m.d.comb += order.r_en.eq(1)
            with m.Else():
                m.d.sync += beat.eq(beat + 1)

    def _write_data(self, m, p: int, order: SyncFIFO):
        """Port ``p``'s W channel to the master of the oldest AW, until its WLAST."""
        axi = self.axi[p]
        head = order.r_data
        with m.Switch(head):
            for i in range(self.n_masters):
                with m.Case(i):
                    src = self.masters[i][p]
                    m.d.comb += [axi.wvalid.eq(order.r_rdy & src.wvalid),
                                 src.wready.eq(order.r_rdy & axi.wready),
                                 axi.wdata.eq(src.wdata), axi.wstrb.eq(src.wstrb),
                                 axi.wlast.eq(src.wlast)]
        m.d.comb += order.r_en.eq(axi.wvalid & axi.wready & axi.wlast)

    def _write_response(self, m, p: int, order: SyncFIFO):
        """Port ``p``'s B responses to the masters, in AW order."""
        axi = self.axi[p]
        head = order.r_data
        for i in range(self.n_masters):
            dst = self.masters[i][p]
            m.d.comb += [dst.bresp.eq(axi.bresp),
                         dst.bvalid.eq(axi.bvalid & order.r_rdy & (head == i))]
        with m.Switch(head):
            for i in range(self.n_masters):
                with m.Case(i):
                    m.d.comb += axi.bready.eq(order.r_rdy & self.masters[i][p].bready)
        m.d.comb += order.r_en.eq(axi.bvalid & axi.bready)
