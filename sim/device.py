"""The ``sim`` device: the functional model behind the engine's register and memory map.

:class:`SimDevice` offers the transport operations a card offers — 32-bit register read
and write, DMA write and read at a device address, wait for the completion interrupt —
and implements the register file of :mod:`dfvg_hw.spec.regmap` around a
:class:`~sim.functional.FunctionalEngine`. A START executes the request descriptor the
host wrote, through the loaded program, exactly as the hardware would; the cycle model
supplies the cycle counters.
"""

from __future__ import annotations

from dfvg_hw.spec.config import EngineConfig
from dfvg_hw.spec.descriptors import ErrorCode
from dfvg_hw.spec.regmap import (ENGINE_ID, ENGINE_VERSION, OP_CYCLE_BUCKETS, Control, Irq, Reg, Status,
                            engine_params, op_cycles_offset, register_space_bits)
from sim.blas_threads import limit_numpy_blas_threads
from sim.functional import EngineFault, FunctionalEngine
from sim.memory import DeviceMemory, MemoryError_

__all__ = ["SimDevice", "SimCard"]

_RW = {Reg.IRQ_ENABLE, Reg.IMAGE_BASE_LO, Reg.IMAGE_BASE_HI, Reg.PROG_BASE_LO, Reg.PROG_BASE_HI,
       Reg.PROG_LEN, Reg.REQ0_LO, Reg.REQ0_HI, Reg.REQ1_LO, Reg.REQ1_HI, Reg.RES0_LO,
       Reg.RES0_HI, Reg.RES1_LO, Reg.RES1_HI}


class SimDevice:
    """A draft engine simulated by its functional model.

    Requests run to completion inside the START register write (the model is
    synchronous), so the completion interrupt is pending as soon as the write returns.
    It runs in the host's process, so it keeps numpy's BLAS to one thread
    (:mod:`sim.blas_threads`): a card takes none of the host's cores from the target.

    Members
    -------
    config : EngineConfig
    engine : FunctionalEngine
    memory : DeviceMemory
    """

    def __init__(self, config: EngineConfig, memory: DeviceMemory | None = None, *,
                 tree_width: int | None = None):
        limit_numpy_blas_threads()
        self.config = config
        self.memory = memory if memory is not None else DeviceMemory(config.mem_bytes)
        self.engine = FunctionalEngine(config, self.memory, tree_width=tree_width)
        self._regs = {reg: 0 for reg in Reg}
        self._regs.update(engine_params(config, tree_width=self.engine.tree_width))
        self._regs[Reg.ID] = ENGINE_ID
        self._regs[Reg.VERSION] = ENGINE_VERSION
        self._op_cycles = {op_cycles_offset(b): 0 for b in OP_CYCLE_BUCKETS}

    # -- transport operations ----------------------------------------------------------
    def read32(self, offset: int) -> int:
        if offset in self._op_cycles:
            return self._op_cycles[offset]
        try:
            return self._regs[Reg(offset)]
        except ValueError:
            return 0xDEADBEEF      # an unmapped offset reads as a recognisable pattern

    def write32(self, offset: int, value: int) -> None:
        value &= 0xFFFFFFFF
        try:
            reg = Reg(offset)
        except ValueError:
            return                 # writes to unmapped offsets are ignored, as on AXI-Lite
        if reg in _RW:
            self._regs[reg] = value
        elif reg == Reg.IRQ_STATUS:
            self._regs[reg] &= ~value
        elif reg == Reg.CONTROL:
            self._command(Control(value & 0x10F))

    def dma_write(self, addr: int, data: bytes) -> None:
        self.memory.write(addr, data)

    def dma_read(self, addr: int, nbytes: int) -> bytes:
        return self.memory.read(addr, nbytes)

    def wait_irq(self, timeout_s: float) -> bool:
        """True when an enabled interrupt is pending; nothing runs later, so no waiting."""
        return bool(self._regs[Reg.IRQ_STATUS] & self._regs[Reg.IRQ_ENABLE])

    def close(self) -> None:
        pass

    # -- the register file's behaviour ---------------------------------------------------
    def _addr(self, lo: Reg) -> int:
        return self._regs[lo] | (self._regs[Reg(lo + 4)] << 32)

    def _finish(self, code: ErrorCode, pc: int = 0) -> None:
        status = Status(self._regs[Reg.STATUS]) & ~(Status.BUSY | Status.ERROR)
        status |= Status.DONE | (Status.ERROR if code else 0)
        self._regs[Reg.STATUS] = int(status)
        self._regs[Reg.ERROR] = int(code)
        self._regs[Reg.ERROR_PC] = pc
        self._regs[Reg.IRQ_STATUS] |= Irq.DONE

    def _command(self, cmd: Control) -> None:
        if cmd & Control.SOFT_RESET:
            self.engine.soft_reset()
            for reg in (Reg.STATUS, Reg.ERROR, Reg.ERROR_PC, Reg.IRQ_STATUS, Reg.LAST_SEQ,
                        Reg.CYCLES_LO, Reg.CYCLES_HI, Reg.BUSY_CYCLES_LO, Reg.BUSY_CYCLES_HI):
                self._regs[reg] = 0
            self._op_cycles = dict.fromkeys(self._op_cycles, 0)
        if cmd & Control.LOAD_PROGRAM:
            try:
                self.engine.load_program(self._addr(Reg.PROG_BASE_LO), self._regs[Reg.PROG_LEN])
                self._regs[Reg.STATUS] = (self._regs[Reg.STATUS] | Status.PROGRAM_LOADED) & ~Status.ERROR
                self._regs[Reg.ERROR] = 0
            except (EngineFault, MemoryError_) as exc:
                code = exc.code if isinstance(exc, EngineFault) else ErrorCode.BAD_ADDRESS
                self._regs[Reg.STATUS] &= ~Status.PROGRAM_LOADED
                self._finish(code)
        if cmd & Control.START:
            self._start(1 if cmd & Control.BUF else 0)

    def _start(self, buf: int) -> None:
        self._regs[Reg.STATUS] = (self._regs[Reg.STATUS] & Status.PROGRAM_LOADED) \
            | Status.BUSY | (Status.BUF if buf else 0)
        if not self._regs[Reg.STATUS] & Status.PROGRAM_LOADED:
            self._finish(ErrorCode.PROGRAM)
            return
        req = self._addr(Reg.REQ1_LO if buf else Reg.REQ0_LO)
        res = self._addr(Reg.RES1_LO if buf else Reg.RES0_LO)
        try:
            result = self.engine.run(image_base=self._addr(Reg.IMAGE_BASE_LO),
                                     request_addr=req, result_addr=res)
        except MemoryError_:
            self._finish(ErrorCode.BAD_ADDRESS)
            return
        cycles = self.engine.counts.total          # the whole request, result write included
        busy = self._addr(Reg.BUSY_CYCLES_LO) + cycles
        self._regs[Reg.CYCLES_LO], self._regs[Reg.CYCLES_HI] = cycles & 0xFFFFFFFF, cycles >> 32
        self._regs[Reg.BUSY_CYCLES_LO], self._regs[Reg.BUSY_CYCLES_HI] = busy & 0xFFFFFFFF, busy >> 32
        self._regs[Reg.LAST_SEQ] = result.seq
        by_op = self.engine.counts.by_op
        self._op_cycles = {op_cycles_offset(b): by_op.get(b, 0) & 0xFFFFFFFF for b in OP_CYCLE_BUCKETS}
        self._finish(result.status, result.error_pc)


class SimCard:
    """A card with several draft cores (``DraftCores``), each simulated by its functional
    model: core ``i``'s register map in window ``i`` (``i << register_space_bits()``), one
    device memory for all of them. An offset past the last core's window reads 0 and
    ignores writes, as the RTL's window decoder answers DECERR (docs/registers.md).

    The functional model does not model the cores' contention for memory: each core's
    cycles are what it would take alone, a lower bound when several run at once
    (docs/architecture.md §9). Drive a core with :class:`dfvg_host.core_window.CoreWindow`.

    Members
    -------
    config : EngineConfig
        Every core's configuration.
    memory : DeviceMemory
    cores : list of SimDevice
    """

    def __init__(self, config: EngineConfig, cores: int):
        if cores < 1:
            raise ValueError(f"a card has at least one core, got {cores}")
        self.config = config
        self.memory = DeviceMemory(config.mem_bytes)
        self.cores = [SimDevice(config, self.memory) for _ in range(cores)]
        self._window = 1 << register_space_bits()

    def _core(self, offset: int) -> tuple[SimDevice | None, int]:
        core, reg = divmod(offset, self._window)
        return (self.cores[core] if core < len(self.cores) else None), reg

    def read32(self, offset: int) -> int:
        core, reg = self._core(offset)
        return core.read32(reg) if core is not None else 0

    def write32(self, offset: int, value: int) -> None:
        core, reg = self._core(offset)
        if core is not None:
            core.write32(reg, value)

    def dma_write(self, addr: int, data: bytes) -> None:
        self.memory.write(addr, data)

    def dma_read(self, addr: int, nbytes: int) -> bytes:
        return self.memory.read(addr, nbytes)

    @property
    def draft_cores(self) -> int:
        return len(self.cores)

    def wait_irq(self, timeout_s: float) -> bool:
        """Whether any core's interrupt is pending (the card's lines OR'd)."""
        return any(core.wait_irq(timeout_s) for core in self.cores)

    def wait_core_irq(self, core: int, timeout_s: float) -> bool:
        return self.cores[core].wait_irq(timeout_s)

    def close(self) -> None:
        pass
