"""Register file: the host interface's AXI4-Lite slave (docs/registers.md §1).

The register map is :mod:`dfvg_hw.spec.regmap`; the behaviour is that of the functional device
(``sim/device.py``), split between this block and the controller:

* here: the RW registers (``IRQ_ENABLE``, ``PROG_LEN`` and the six 64-bit base
  addresses), ``IRQ_STATUS`` and the interrupt, ``CONTROL``'s command pulses, the constant
  identity and parameter registers, and the AXI4-Lite protocol;
* in the controller (inputs on :class:`EngineStatusSignature`): ``STATUS``, ``ERROR``,
  ``ERROR_PC``, ``LAST_SEQ``, ``CYCLES`` and ``BUSY_CYCLES``, which the commands change
  (the controller also clears them on a soft reset).

Choices where the ``sim`` device has nothing to say (it has no byte strobes, no bus and no
time between a command and its effect):

* **Byte strobes.** A strobe-less byte is not written: RW registers keep it, and for
  ``CONTROL`` (W1S) and ``IRQ_STATUS`` (W1C) its bits count as 0.
* **64-bit counters.** Reading ``CYCLES_LO`` (``BUSY_CYCLES_LO``) copies the high word into
  a snapshot, and ``CYCLES_HI`` (``BUSY_CYCLES_HI``) reads that snapshot, so a LO-then-HI
  read pair is never torn by a request ending between the two reads. A soft reset zeroes
  the snapshots, as it zeroes the counters.
* **Unmapped offsets** read ``0xDEADBEEF`` and ignore writes, like the ``sim`` device;
  every response is ``OKAY``. The two address bits below the word are ignored.
* **Soft reset** clears ``IRQ_STATUS`` at the clock edge that ends the ``soft_reset``
  pulse, the edge at which the controller clears its registers, so a ``done_pulse`` in
  that cycle (which the reset discards) leaves no interrupt behind. A ``done_pulse`` in
  the cycle of a W1C write to ``IRQ_STATUS`` wins: an event is never lost.

Timing: a write takes effect at the edge that raises ``bvalid`` (so a read issued after
the write response sees it); ``CONTROL`` pulses are high the cycle after that edge; a
read samples the registers and the status inputs at the ``AR`` handshake. ``irq`` is a
register: it follows ``IRQ_STATUS & IRQ_ENABLE`` one cycle later.
"""

from __future__ import annotations

from amaranth import Cat, Const, Module, Signal
from amaranth.lib import data, wiring
from amaranth.lib.wiring import In, Out

from dfvg_hw.axi_lite import AXI4LiteSignature, AxiResp
from dfvg_hw.spec.config import EngineConfig
from dfvg_hw.spec.regmap import (ENGINE_ID, ENGINE_VERSION, OP_CYCLE_BUCKETS, Control, Irq, Reg, Status,
                            engine_params, op_cycles_offset, register_space_bits)

__all__ = ["RegisterFile", "EngineCommand", "EngineControlSignature", "EngineStatusSignature",
           "UNMAPPED_READ"]

#: What an unmapped offset reads, as in the ``sim`` device.
UNMAPPED_READ = 0xDEADBEEF
_WORD_BITS = 32
_ADDR_BITS = 64
_BUFFER_PAIRS = 2


def _bit(flag: int) -> int:
    """Bit position of a single-bit register flag (``Control.BUF`` → 8)."""
    return int(flag).bit_length() - 1


class EngineCommand(data.StructLayout):
    """The commands of one ``CONTROL`` write (docs/registers.md §1.2), each a one-cycle
    pulse; ``buf`` is ``CONTROL.BUF`` of the same write, meaningful with ``start``."""

    def __init__(self):
        super().__init__({name: 1 for name in self.CONTROL_BITS})

    #: Field → the ``CONTROL`` bit it comes from.
    CONTROL_BITS = {"start": Control.START, "abort": Control.ABORT,
                    "soft_reset": Control.SOFT_RESET, "load_program": Control.LOAD_PROGRAM,
                    "buf": Control.BUF}


class EngineControlSignature(wiring.Signature):
    """What the register file tells the controller (the register file drives every member;
    the controller takes it flipped).

    Members
    -------
    command : Out(EngineCommand)
        ``CONTROL``'s commands: ``start``, ``abort``, ``soft_reset`` and ``load_program``
        are high for exactly one cycle per ``CONTROL`` write that sets their bit, ``buf``
        carries that write's ``BUF`` bit in the same cycle; all zero otherwise. The
        controller executes them in the order soft reset, load program, start.
    image_base : Out(64)
        ``IMAGE_BASE``: device address of the weights image.
    prog_base : Out(64)
        ``PROG_BASE``: device address of the program, for ``load_program``.
    prog_len : Out(32)
        ``PROG_LEN``: program length in 128-bit instructions, for ``load_program``.
    request_base : Out(ArrayLayout(unsigned(64), 2))
        ``REQ0`` and ``REQ1``: the ping and pong request buffers, indexed by ``buf``.
    result_base : Out(ArrayLayout(unsigned(64), 2))
        ``RES0`` and ``RES1``: the ping and pong result buffers, indexed by ``buf``.
    """

    def __init__(self):
        super().__init__({
            "command": Out(EngineCommand()),
            "image_base": Out(_ADDR_BITS),
            "prog_base": Out(_ADDR_BITS),
            "prog_len": Out(_WORD_BITS),
            "request_base": Out(data.ArrayLayout(_ADDR_BITS, _BUFFER_PAIRS)),
            "result_base": Out(data.ArrayLayout(_ADDR_BITS, _BUFFER_PAIRS)),
        })


class EngineStatusSignature(wiring.Signature):
    """What the controller shows the host (the controller drives every member; the register
    file takes it flipped). Values are register-wide; narrower sources zero-extend.

    Members
    -------
    busy, done, error, program_loaded, buf : Out(1)
        The ``STATUS`` bits (docs/registers.md §1.3).
    error_code : Out(32)
        ``ERROR``: the ``ErrorCode`` of the last request or failed ``LOAD_PROGRAM``.
    error_pc : Out(32)
        ``ERROR_PC``: program counter of the faulting instruction.
    last_seq : Out(32)
        ``LAST_SEQ``: ``seq`` of the last completed request.
    cycles : Out(64)
        ``CYCLES``: engine cycles of the last request.
    busy_cycles : Out(64)
        ``BUSY_CYCLES``: request cycles since the last soft reset.
    op_cycles : Out(ArrayLayout(unsigned(32), len(OP_CYCLE_BUCKETS)))
        The per-unit counters of the last request, in ``regmap.OP_CYCLE_BUCKETS`` order
        (read at ``regmap.op_cycles_offset``).
    done_pulse : Out(1)
        High for one cycle when a request finishes or a ``LOAD_PROGRAM`` fails: sets
        ``IRQ_STATUS.DONE``.
    """

    #: The one-bit members → their ``STATUS`` bit.
    FLAGS = {"busy": Status.BUSY, "done": Status.DONE, "error": Status.ERROR,
             "program_loaded": Status.PROGRAM_LOADED, "buf": Status.BUF}

    def __init__(self):
        super().__init__({
            **{name: Out(1) for name in self.FLAGS},
            "error_code": Out(_WORD_BITS),
            "error_pc": Out(_WORD_BITS),
            "last_seq": Out(_WORD_BITS),
            "cycles": Out(_ADDR_BITS),
            "busy_cycles": Out(_ADDR_BITS),
            "op_cycles": Out(data.ArrayLayout(_WORD_BITS, len(OP_CYCLE_BUCKETS))),
            "done_pulse": Out(1),
        })


class RegisterFile(wiring.Component):
    """The engine's AXI4-Lite register file (see the module docstring for its semantics).

    The slave accepts ``AW`` and ``W`` independently, in either order or together, and
    performs the write once it holds both; it keeps ``bvalid`` (and ``rvalid``) until the
    master takes the response, and handles one write and one read at a time. Every ready
    depends only on the block's own state, never on a valid. A write costs 3 cycles and a
    read 2 at least.

    Parameters
    ----------
    config : EngineConfig
        The engine the bitstream is built for: the parameter registers' values.
    addr_width : int or None
        Byte-address width of the bus; ``None`` (default) is the smallest that covers the
        register map (``regmap.register_space_bits()``, 8 today). Offsets beyond the
        map are unmapped.
    tree_width : int, optional
        The widest tree the engine drafts: ``P_TREE_WIDTH`` (0: chains only); by default
        ``config.rows``, as the engine drafts.

    Members
    -------
    bus : In(AXI4LiteSignature(addr_width))
        The host's register reads and writes (a slave port: the signature flipped).
    ctrl : Out(EngineControlSignature())
        Commands and address registers, to the controller.
    status : In(EngineStatusSignature())
        The controller's state for the read-only registers, and its done pulse.
    irq : Out(1)
        Level interrupt: ``IRQ_STATUS & IRQ_ENABLE ≠ 0``, registered.
    """

    def __init__(self, config: EngineConfig, addr_width: int | None = None, *,
                 tree_width: int | None = None):
        needed = register_space_bits()
        addr_width = needed if addr_width is None else addr_width
        if addr_width < needed:
            raise ValueError(f"an address width of {addr_width} bits does not reach the last "
                             f"register; it needs {needed}")
        self.config = config
        self.addr_width = addr_width
        self.tree_width = config.rows if tree_width is None else tree_width
        super().__init__({
            "bus": In(AXI4LiteSignature(addr_width)),
            "ctrl": Out(EngineControlSignature()),
            "status": In(EngineStatusSignature()),
            "irq": Out(1),
        })

    def _rw_registers(self, irq_enable) -> dict[Reg, object]:
        """Every RW register → the 32 bits that hold it (the ``ctrl`` outputs themselves,
        so the value lives in one place)."""
        ctrl = self.ctrl
        wide = {Reg.IMAGE_BASE_LO: ctrl.image_base, Reg.PROG_BASE_LO: ctrl.prog_base,
                Reg.REQ0_LO: ctrl.request_base[0], Reg.REQ1_LO: ctrl.request_base[1],
                Reg.RES0_LO: ctrl.result_base[0], Reg.RES1_LO: ctrl.result_base[1]}
        registers = {Reg.IRQ_ENABLE: irq_enable, Reg.PROG_LEN: ctrl.prog_len}
        for lo, value in wide.items():
            registers[lo] = value[:_WORD_BITS]
            registers[Reg(lo + 4)] = value[_WORD_BITS:]
        return registers

    def elaborate(self, platform):
        m = Module()
        bus, ctrl, status = self.bus, self.ctrl, self.status

        irq_enable = Signal(_WORD_BITS)
        irq_status = Signal(max(Irq).bit_length())
        # High words of the 64-bit counters, copied when their low word is read.
        cycles_hi_snapshot = Signal(_WORD_BITS)
        busy_cycles_hi_snapshot = Signal(_WORD_BITS)

        rw_registers = self._rw_registers(irq_enable)
        status_bits = [Const(0, 1)] * _WORD_BITS
        for name, flag in EngineStatusSignature.FLAGS.items():
            status_bits[_bit(flag)] = getattr(status, name)
        status_word = Cat(*status_bits)

        readable = {Reg.ID: ENGINE_ID, Reg.VERSION: ENGINE_VERSION,
                    **engine_params(self.config, tree_width=self.tree_width),
                    Reg.CONTROL: 0,                       # W1S: the bits clear themselves
                    Reg.STATUS: status_word,
                    Reg.ERROR: status.error_code, Reg.ERROR_PC: status.error_pc,
                    Reg.IRQ_STATUS: irq_status, Reg.LAST_SEQ: status.last_seq,
                    Reg.CYCLES_LO: status.cycles[:_WORD_BITS], Reg.CYCLES_HI: cycles_hi_snapshot,
                    Reg.BUSY_CYCLES_LO: status.busy_cycles[:_WORD_BITS],
                    Reg.BUSY_CYCLES_HI: busy_cycles_hi_snapshot,
                    **rw_registers}
        # A register added to regmap must be decoded here too, not silently read as unmapped.
        assert set(readable) == set(Reg), set(Reg) ^ set(readable)
        readable.update({op_cycles_offset(bucket): status.op_cycles[i]
                         for i, bucket in enumerate(OP_CYCLE_BUCKETS)})

        # -- read channel: one read at a time, the data registered at the AR handshake ----
        m.d.comb += [bus.arready.eq(~bus.rvalid), bus.rresp.eq(AxiResp.OKAY)]
        with m.If(bus.rvalid & bus.rready):
            m.d.sync += bus.rvalid.eq(0)
        with m.If(bus.arvalid & bus.arready):
            m.d.sync += bus.rvalid.eq(1)
            with m.Switch(bus.araddr[2:]):
                for reg, value in readable.items():
                    with m.Case(reg >> 2):
                        m.d.sync += bus.rdata.eq(value)
                with m.Default():
                    m.d.sync += bus.rdata.eq(UNMAPPED_READ)
            with m.If(bus.araddr[2:] == Reg.CYCLES_LO >> 2):
                m.d.sync += cycles_hi_snapshot.eq(status.cycles[_WORD_BITS:])
            with m.If(bus.araddr[2:] == Reg.BUSY_CYCLES_LO >> 2):
                m.d.sync += busy_cycles_hi_snapshot.eq(status.busy_cycles[_WORD_BITS:])

        # -- write channel: hold AW and W until both are here, then write and respond -----
        aw_held, w_held = Signal(), Signal()
        write_word = Signal(self.addr_width - 2)
        write_data = Signal(_WORD_BITS)
        write_strobe = Signal(_WORD_BITS // 8)
        m.d.comb += [bus.awready.eq(~aw_held), bus.wready.eq(~w_held),
                     bus.bresp.eq(AxiResp.OKAY)]
        with m.If(bus.awvalid & bus.awready):
            m.d.sync += [aw_held.eq(1), write_word.eq(bus.awaddr[2:])]
        with m.If(bus.wvalid & bus.wready):
            m.d.sync += [w_held.eq(1), write_data.eq(bus.wdata), write_strobe.eq(bus.wstrb)]
        with m.If(bus.bvalid & bus.bready):
            m.d.sync += bus.bvalid.eq(0)

        write = Signal()          # the held write is performed at this edge
        m.d.comb += write.eq(aw_held & w_held & ~bus.bvalid)
        # The written bits: strobe-less bytes count as 0 (for W1S and W1C).
        strobed_data = Signal(_WORD_BITS)
        m.d.comb += strobed_data.eq(write_data & Cat(*(bit.replicate(8) for bit in write_strobe)))

        m.d.sync += ctrl.command.eq(0)        # commands are pulses
        with m.If(write):
            m.d.sync += [aw_held.eq(0), w_held.eq(0), bus.bvalid.eq(1)]
            # One If per register rather than a Switch: Amaranth writes a Switch as one
            # Verilog case per signal, which Verilator finds incomplete (CASEINCOMPLETE).
            for reg, storage in rw_registers.items():
                with m.If(write_word == reg >> 2):
                    for byte, enabled in enumerate(write_strobe):
                        with m.If(enabled):
                            m.d.sync += storage[8 * byte:8 * byte + 8].eq(
                                write_data[8 * byte:8 * byte + 8])
            with m.If(write_word == Reg.CONTROL >> 2):
                for name, flag in EngineCommand.CONTROL_BITS.items():
                    m.d.sync += ctrl.command[name].eq(strobed_data[_bit(flag)])

        # IRQ_STATUS: a W1C write clears its bits, then events set theirs (an event at the
        # same edge is kept); the soft reset overrides both, so that a request the reset
        # discards leaves no interrupt behind.
        irq_clear, irq_events = Signal.like(irq_status), Signal.like(irq_status)
        with m.If(write & (write_word == Reg.IRQ_STATUS >> 2)):
            m.d.comb += irq_clear.eq(strobed_data)
        m.d.comb += irq_events[_bit(Irq.DONE)].eq(status.done_pulse)
        m.d.sync += irq_status.eq(irq_status & ~irq_clear | irq_events)
        with m.If(ctrl.command.soft_reset):
            m.d.sync += [irq_status.eq(0), cycles_hi_snapshot.eq(0),
                         busy_cycles_hi_snapshot.eq(0)]

        m.d.sync += self.irq.eq((irq_status & irq_enable).any())
        return m
