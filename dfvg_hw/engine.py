"""``DraftEngine``: the draft engine's top level, composed from its engine configuration.

::

    s_axil_* ─► RegisterFile ─ctrl─► Controller ─mem─► StripedMemoryPort ─► m_axi_*
                     ▲  └─irq          │ IMEM, VMEM,         (one MemoryPort     (m00_axi_*,
                     └──── status ◄────┘ decoder, sequencer,  per channel)        m01_axi_*, …)
                                         logit buffer + sampler

The ports are flat and named as Vivado's interface inference expects them
(``boards.vivado.EngineInterface.ports()``): ``clk``, ``rst`` (active high, synchronous),
the AXI4-Lite slave ``s_axil_*`` (the register map, ``dfvg_hw.spec.regmap``), one AXI4
master per memory channel into device memory (``m_axi_*`` with one channel, else
``m00_axi_*``, ``m01_axi_*``, …: :func:`dfvg_hw.axi4.master_prefix`), and the completion
interrupt ``irq`` (a level: ``IRQ_STATUS & IRQ_ENABLE``).

The controller and every unit see one memory beat of ``mem_ports · data_width`` bits (the
engine beat, ``EngineConfig.mem_beat_bytes``) and logical addresses; the
:class:`~dfvg_hw.striped_memory_port.StripedMemoryPort` spreads each command over the
channels in lockstep (:mod:`dfvg_hw.spec.striping`).
"""

from __future__ import annotations

from amaranth import Module
from amaranth.lib import wiring
from amaranth.lib.wiring import Out

from dfvg_hw.axi4 import AXI4Signature, connect_flat, master_prefix
from dfvg_hw.axi_lite import AXI4LiteSignature, connect_prefixed, prefixed_members
from dfvg_hw.spec.config import EngineConfig
from dfvg_hw.controller import Controller
from dfvg_hw.striped_memory_port import StripedMemoryPort
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
        Width of each AXI4 master's data bus in bits; by default the configuration's
        ``mem_port_bits`` (128 for ``tiny``: one 16-byte VMEM line per beat; 512 for an
        Alveo HBM pseudo-channel's bridged port, one 64-byte line), which is what the cycle model assumes. The engine beat
        is ``config.mem_ports`` times it.
    tree_width : int, optional
        The widest tree the engine drafts, 0 … ``config.rows`` (``P_TREE_WIDTH``, docs/isa.md
        §9.4; 0: chains only, tree requests are refused); by default ``config.rows``
        (:meth:`default_tree_width`).

    Members
    -------
    s_axil_awaddr … s_axil_rready : In/Out
        AXI4-Lite slave: the register file.
    m_axi_awaddr … m_axi_rready : Out/In
        AXI4 master into device memory, with one memory channel; with ``mem_ports`` > 1,
        ``m00_axi_*`` … one per channel (:attr:`axi_prefixes`).
    irq : Out(1)
        Completion interrupt.

    Attributes
    ----------
    axi : AXI4Signature
        Each master's signature.
    axi_prefixes : list of str
        The masters' flat name prefixes, channel by channel.
    memory_port : StripedMemoryPort
    """

    def __init__(self, config: EngineConfig, data_width: int | None = None,
                 tree_width: int | None = None):
        self.config = config
        self.data_width = data_width = data_width or config.mem_port_bits
        self.tree_width = self.default_tree_width(config) if tree_width is None else tree_width
        if not 0 <= self.tree_width <= config.rows:
            raise ValueError(f"tree_width {self.tree_width} is not in 0 … rows = {config.rows}")
        self.axil = AXI4LiteSignature(register_space_bits())
        self.axi = AXI4Signature(data_width, 64)
        self.axi_prefixes = [master_prefix(p, config.mem_ports) for p in range(config.mem_ports)]
        masters = {}
        for prefix in self.axi_prefixes:
            masters.update(self.axi.flat_members(prefix))
        super().__init__(wiring.Signature({
            **prefixed_members(self.axil.flip(), AXIL_PREFIX),
            **masters,
            "irq": Out(1),
        }))
        self.registers = RegisterFile(config, tree_width=self.tree_width)
        self.memory_port = StripedMemoryPort(config, port_width=data_width)
        #: co-simulation reaches the engine's state through it (``controller.units``)
        self.controller = Controller(config, self.memory_port.data_width, self.tree_width)

    @staticmethod
    def default_tree_width(config: EngineConfig) -> int:
        """The tree width an engine of ``config`` drafts unless told otherwise: its rows
        (a tree forward feeds a level's nodes as the matrix unit's rows)."""
        return config.rows

    def elaborate(self, platform):
        m = Module()
        regs = m.submodules.registers = self.registers
        ctl = m.submodules.controller = self.controller
        port = m.submodules.memory_port = self.memory_port
        connect_prefixed(m, self, AXIL_PREFIX, regs.bus)
        for axi, prefix in zip(port.axi, self.axi_prefixes):
            connect_flat(m, axi, self, prefix)
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
