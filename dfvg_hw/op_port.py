"""What a unit-instruction sequencer sees of the engine: one instruction as a job, device
memory through the memory port, VMEM through its span and line ports.

The controller runs one instruction at a time: it hands the instruction to the sequencer
of its opcode as an :class:`OpJob` (addresses resolved, the controller registers it needs
attached), connects that sequencer to the shared ports for as long as it runs, and
retires the instruction when ``done`` pulses with ``error = OK``, or stops the request
with ``error``. A fault elsewhere (a refused memory command) resets the sequencer through
a ``ResetInserter``, so a sequencer never needs to recover from one itself.
"""

from __future__ import annotations

from amaranth import unsigned
from amaranth.lib import data, stream, wiring
from amaranth.lib.wiring import In, Out

from dfvg_hw.spec.config import EngineConfig
from dfvg_hw.memory_port import MemoryCommand, ReadBeat
from dfvg_hw.vmem import VmemReadBeat, VmemSpan, VmemWriteBeat

__all__ = ["OpJob", "OpSequencerSignature"]


class OpJob(data.StructLayout):
    """One unit instruction: its fields (isa.md §2), ``addr`` already resolved to a device
    address (``image_base + addr + LAYER·LSTRIDE`` with LREL), and the controller's
    ``pos`` (POS) and ``layer`` (LAYER) registers.

    The KV and row fields of tree drafting (isa.md §9), which a chain forward sets so
    that nothing changes: ``pitch`` is the VMEM row pitch in lines of a multi-row operand
    (0: the operand's own stride, §1.3); ``kv_pos`` the KV position KVAPPEND writes
    (chain: ``pos``); ATTN attends to positions ``0 … prefix − 1`` (chain: ``pos + 1``)
    and then to the ``path_len`` positions the KV sequencer's path port gives (chain: 0;
    a tree row at level d: its d path entries)."""

    def __init__(self):
        super().__init__({
            "opcode": unsigned(8), "flags": unsigned(8), "rows": unsigned(8),
            "dst": unsigned(16), "src": unsigned(16), "n": unsigned(16), "k": unsigned(16),
            "addr": unsigned(64), "pos": unsigned(16), "layer": unsigned(16),
            "pitch": unsigned(16), "kv_pos": unsigned(16), "prefix": unsigned(17),
            "path_len": unsigned(8),
        })


class OpSequencerSignature(wiring.Signature):
    """The ports of a unit-instruction sequencer (the sequencer's side).

    Members
    -------
    job : In(stream.Signature(OpJob()))
        The instruction to run (one at a time).
    done : Out(1)
        One-cycle pulse: the job is finished; ``error`` holds its outcome in that cycle.
    error : Out(8)
        :class:`~dfvg_hw.spec.descriptors.ErrorCode` of the finished job (0 = OK).
    read_cmd : Out(stream.Signature(MemoryCommand(config)))
    read_data : In(stream.Signature(ReadBeat(data_width)))
        Device-memory reads (:class:`~dfvg_hw.memory_port.MemoryPort`: bus-aligned
        addresses, any length, the tail of the last beat zeroed).
    vmem_rd_cmd : Out(stream.Signature(VmemSpan(config)))
    vmem_rd : In(stream.Signature(VmemReadBeat(vmem_line_bytes)))
    vmem_wr_cmd : Out(stream.Signature(VmemSpan(config)))
    vmem_wr : Out(stream.Signature(VmemWriteBeat(vmem_line_bytes)))
    vmem_wr_done : In(1)
    vmem_error : In(1)
        VMEM spans (:class:`~dfvg_hw.vmem.VectorMemory`); ``vmem_error`` is its sticky
        refusal flag (BAD_ADDRESS).
    peek_addr : Out(16)
    peek_data : In(8 · vmem_line_bytes)
    poke_en : Out(vmem_line_bytes)
    poke_addr : Out(16)
    poke_data : Out(8 · vmem_line_bytes)
        VMEM random line reads and byte-masked writes, while no span uses the same port.
    reads_done : Out(1)
        The running job has handed its last device-memory read command to the port (it
        will issue no other before ``done``): once the port is read-idle too, the
        controller may lend the wide read path to the next MATMUL's weight prefetch. A
        sequencer that never says so leaves it 0 (no prefetch behind it).
    """

    def __init__(self, config: EngineConfig, data_width: int):
        line_bytes = config.vmem_line_bytes
        super().__init__({
            "job": In(stream.Signature(OpJob())),
            "done": Out(1),
            "error": Out(8),
            "read_cmd": Out(stream.Signature(MemoryCommand(config))),
            "read_data": In(stream.Signature(ReadBeat(data_width))),
            "vmem_rd_cmd": Out(stream.Signature(VmemSpan(config))),
            "vmem_rd": In(stream.Signature(VmemReadBeat(line_bytes))),
            "vmem_wr_cmd": Out(stream.Signature(VmemSpan(config))),
            "vmem_wr": Out(stream.Signature(VmemWriteBeat(line_bytes))),
            "vmem_wr_done": In(1),
            "vmem_error": In(1),
            "peek_addr": Out(16),
            "peek_data": In(8 * line_bytes),
            "poke_en": Out(line_bytes),
            "poke_addr": Out(16),
            "poke_data": Out(8 * line_bytes),
            "reads_done": Out(1),
        })
