"""Vector / special-function unit: the elementwise, RMSNorm, RoPE and attention blocks.

:class:`VectorUnit` instantiates one of each block for an :class:`EngineConfig` and
exposes each block's interface unchanged under the block's name, so the controller
sees one component with one clock. The blocks share nothing and run concurrently;
what feeds them is the controller's business (VMEM reads and writes, parameter blocks
from device memory, the matrix unit's accumulator stream, the KV buffer). How each
instruction maps onto them (isa.md §3):

=============  =========================================================================
instruction    datapath
=============  =========================================================================
RMSNORM        ``rmsnorm``: each int16 row streamed twice from VMEM (pass 1 Σx², pass 2
               with ``gamma`` from the parameter block), ``eps``/``gamma_shift`` from its
               header; int8 rows back to VMEM (int16 with ``WIDE``: ``wide``).
MATMUL RESADD  matrix-unit accumulators + per-channel (mult, shift) and the int16
               residual read from ``dst`` → ``residual_add`` → ``dst``.
               (INT8 and LOGITS modes use the matrix unit's own requantiser.)
ROPE           ``rope``: per head, ``a`` = first half and ``b`` = second half of the head,
               ``cos``/``sin`` = the POS row of the table; results to the same halves.
ATTN           ``attention``: per query head, ``q`` from VMEM with the ATTN word, then K
               and V rows 0 … POS of KV head ``h div (n/G)`` from the KV buffer; int8 out
               (int16 with ``WIDE``: the q beat's ``wide``).
ACTMUL         ``act_mul``: table loaded from the ACTMUL block through ``lut_*``, then
               gate/up beats from one VMEM row, ``mult``/``shift`` from its word; int8
               out (int16 with ``WIDE``: ``wide``).
(elementwise)  ``mul``: ``requant(a·b, mult, shift)`` of two int8 vectors.
=============  =========================================================================

Latencies (clock edges from accepting a beat to its output, outputs ready):
``residual_add`` 4, ``mul`` 4, ``act_mul`` 5, ``rope`` 3, ``rmsnorm`` 4 per pass-2 beat
(plus ``2 + ceil(log2 lanes) + 4`` between the passes), ``attention``
``2·T + ceil(log2 head_dim) + 45`` per head (:meth:`Attention.cycles`).
:func:`latencies` returns them for a configuration.
"""

from __future__ import annotations

from amaranth import Module
from amaranth.lib import wiring
from amaranth.lib.wiring import Out

from dfvg_hw.config import EngineConfig
from dfvg_hw.elementwise import ActMul, ElementwiseMul, ResidualAdd
from dfvg_hw.rmsnorm import RMSNorm
from dfvg_hw.rope import Rope
from dfvg_hw.softmax import Attention

__all__ = ["VectorUnit", "latencies"]


def _units(config: EngineConfig) -> dict:
    return {
        "rmsnorm": RMSNorm(config),
        "residual_add": ResidualAdd(config),
        "mul": ElementwiseMul(config),
        "act_mul": ActMul(config),
        "rope": Rope(config),
        "attention": Attention(config),
    }


def latencies(config: EngineConfig) -> dict:
    """Pipeline latencies (edges) of the blocks for ``config``; attention as a function of T."""
    return {
        "residual_add": ResidualAdd.LATENCY,
        "mul": ElementwiseMul.LATENCY,
        "act_mul": ActMul.LATENCY,
        "rope": Rope.LATENCY,
        "rmsnorm": RMSNorm.LATENCY,
        "rmsnorm_turnaround": RMSNorm.turnaround(config.lanes),
        "attention": lambda t: Attention.head_cycles(config.head_dim, t),
    }


class VectorUnit(wiring.Component):
    """All vector blocks of one engine, each interface exposed under its block's name.

    Parameters
    ----------
    config : EngineConfig
        Sizes every block (``lanes``, ``head_dim``, ``kv_positions``, ``vmem_bytes``).

    Members
    -------
    rmsnorm : Out(RMSNorm(config).signature)
        :class:`~dfvg_hw.rmsnorm.RMSNorm` ports (``i``, ``eps``, ``gamma_shift``, ``wide``, ``o``, ``busy``).
    residual_add : Out(ResidualAdd(config).signature)
        :class:`~dfvg_hw.elementwise.ResidualAdd` ports.
    mul : Out(ElementwiseMul(config).signature)
        :class:`~dfvg_hw.elementwise.ElementwiseMul` ports.
    act_mul : Out(ActMul(config).signature)
        :class:`~dfvg_hw.elementwise.ActMul` ports (with the table write port).
    rope : Out(Rope(config).signature)
        :class:`~dfvg_hw.rope.Rope` ports.
    attention : Out(Attention(config).signature)
        :class:`~dfvg_hw.softmax.Attention` ports (``q``, ``k``, ``v``, ``o``).
    """

    def __init__(self, config: EngineConfig):
        self.config = config
        self._units = _units(config)
        super().__init__({name: Out(unit.signature) for name, unit in self._units.items()})

    def elaborate(self, platform):
        m = Module()
        for name, unit in self._units.items():
            m.submodules[name] = unit
            wiring.connect(m, wiring.flipped(getattr(self, name)), unit)
        return m
