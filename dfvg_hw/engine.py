"""``DraftEngine``: the draft engine's top level, composed from its engine configuration.

::

    s_axil_* ─► RegisterFile ─ctrl─► Controller ─mem─► MemoryPort ─► m_axi_*
                     ▲  └─irq          │ IMEM, VMEM, decoder, sequencer,
                     └──── status ◄────┘ logit buffer + sampler

The ports are flat and named as Vivado's interface inference expects them
(``boards.vivado.EngineInterface.ports()``): ``clk``, ``rst`` (active high, synchronous),
the AXI4-Lite slave ``s_axil_*`` (the register map, ``dfvg_hw.spec.regmap``), the AXI4 master
``m_axi_*`` into device memory, and the completion interrupt ``irq`` (a level:
``IRQ_STATUS & IRQ_ENABLE``).
"""

from __future__ import annotations

from amaranth import Module
from amaranth.lib import wiring
from amaranth.lib.wiring import Out

from dfvg_hw.axi4 import AXI4Signature, connect_flat
from dfvg_hw.axi_lite import AXI4LiteSignature, connect_prefixed, prefixed_members
from dfvg_hw.spec.config import EngineConfig
from dfvg_hw.controller import Controller
from dfvg_hw.memory_port import MemoryPort
from dfvg_hw.register_file import RegisterFile
from dfvg_hw.spec.regmap import register_space_bits

__all__ = ["DraftEngine", "AXIL_PREFIX", "AXI_PREFIX"]

AXIL_PREFIX = "s_axil_"
AXI_PREFIX = "m_axi_"


class DraftEngine(wiring.Component):
    """The whole engine for one configuration.

    Parameters
    ----------
    config : EngineConfig
    data_width : int, optional
        Width of the AXI4 master's data bus in bits; by default the configuration's
        ``mem_port_bits`` (128 for ``tiny``: one 16-byte VMEM line per beat; 256 for an
        Alveo HBM pseudo-channel), which is what the cycle model assumes.

    Members
    -------
    s_axil_awaddr … s_axil_rready : In/Out
        AXI4-Lite slave: the register file.
    m_axi_awaddr … m_axi_rready : Out/In
        AXI4 master: device memory.
    irq : Out(1)
        Completion interrupt.
    """

    def __init__(self, config: EngineConfig, data_width: int | None = None):
        self.config = config
        self.data_width = data_width = data_width or config.mem_port_bits
        self.axil = AXI4LiteSignature(register_space_bits())
        self.axi = AXI4Signature(data_width, 64)
        super().__init__(wiring.Signature({
            **prefixed_members(self.axil.flip(), AXIL_PREFIX),
            **self.axi.flat_members(AXI_PREFIX),
            "irq": Out(1),
        }))
        self.registers = RegisterFile(config)
        #: co-simulation reaches the engine's state through it (``controller.units``)
        self.controller = Controller(config, data_width)
        self.memory_port = MemoryPort(config, data_width=data_width)

    def elaborate(self, platform):
        m = Module()
        regs = m.submodules.registers = self.registers
        ctl = m.submodules.controller = self.controller
        port = m.submodules.memory_port = self.memory_port
        connect_prefixed(m, self, AXIL_PREFIX, regs.bus)
        connect_flat(m, port.axi, self, AXI_PREFIX)
        wiring.connect(m, regs.ctrl, ctl.ctrl)
        wiring.connect(m, ctl.status, regs.status)
        mem = ctl.mem
        wiring.connect(m, mem.read_cmd, port.read_cmd)
        wiring.connect(m, port.read_data, mem.read_data)
        wiring.connect(m, mem.write_cmd, port.write_cmd)
        wiring.connect(m, mem.write_data, port.write_data)
        m.d.comb += [mem.read_idle.eq(port.read_idle), mem.write_idle.eq(port.write_idle),
                     mem.error.eq(port.error), port.clear_error.eq(mem.clear_error),
                     self.irq.eq(regs.irq)]
        return m
