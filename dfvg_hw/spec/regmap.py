"""Register map and device-memory map of the draft engine — defined once, used everywhere.

The host reaches the engine through a 32-bit AXI4-Lite register file (on a card, the
XDMA user BAR) and device memory (HBM/DDR, through the XDMA DMA channels). The
functional device (``sim``), the RTL (``rtl``) and the card (``xdma``) all implement these
same offsets; the driver in ``dfvg_host`` uses nothing else. See ``docs/registers.md``.
"""

from __future__ import annotations

import enum

from dfvg_hw.spec.config import EngineConfig
from dfvg_hw.spec.descriptors import MAX_DRAFT, REQUEST_HEADER_WORDS, result_bytes
from dfvg_hw.spec.image import IMAGE_VERSION
from dfvg_hw.spec.isa import Op

__all__ = ["Reg", "Control", "Status", "Irq", "ENGINE_ID", "ENGINE_VERSION", "MemoryMap",
           "PARAM_REGS", "engine_params", "register_space_bits", "OP_CYCLES", "OP_CYCLE_BUCKETS",
           "op_cycles_offset"]

ENGINE_ID = 0x44465647            # ASCII "DFVG", most significant byte first
#: Engine version: major (ISA / descriptor / image format) << 16 | minor. Minor 1: KV
#: capacity in slots (P_KV_SLOTS replaces P_KV_LAYERS and P_KV_HEADS). Minor 2: striped
#: memory channels and KV banks (P_MEM_PORTS … P_KV_BANKS), EMBED rows padded to engine beats.
#: Minor 3: the request's ``kv_slot_base`` (word 10), several sequences' KV in one engine.
#: Minor 4: tree requests and compaction (words 10-15, docs/isa.md §9), ``P_TREE_WIDTH``,
#: the parent in record word 0.
#: Minor 5: MATMUL's BIAS flag and INT32 mode, RMSNORM segments (``k``), EMBED POSITION,
#: ACTMUL UNGATED: Qwen2, Qwen3 and OPT.
#: Minor 6: MATMUL's BLOCKS flag, block-scaled int8 weights (issue #13).
#: Minor 7: ``P_VMEM_LINE_BYTES`` and ``P_WEIGHT_BLOCKS``, the two generator parameters a
#: compiled program depends on that no register showed.
#: Minor 8: ``P_KV_BITS``, the KV cache's element width, and KVAPPEND's WIDE flag (issue #13).
ENGINE_VERSION = (IMAGE_VERSION << 16) | 8


class Reg(enum.IntEnum):
    """Byte offsets of the 32-bit registers. RO = read-only, W1S/W1C = write-1-to-set/clear."""
    ID = 0x000                #: RO  ENGINE_ID
    VERSION = 0x004           #: RO  ENGINE_VERSION
    # Engine parameters (RO), so the host can check a compiled model against the engine.
    P_ROWS = 0x010
    P_LANES = 0x014
    P_REDUCE = 0x018
    P_KV_SLOTS = 0x01C
    # 0x020 is unmapped (P_KV_HEADS before version 1.1)
    P_KV_POSITIONS = 0x024
    P_HEAD_DIM = 0x028
    P_VOCAB_MAX = 0x02C
    P_TOPK_MAX = 0x030
    P_VMEM_BYTES = 0x034
    P_IMEM_WORDS = 0x038
    P_CLOCK_KHZ = 0x03C
    CONTROL = 0x040           #: W1S self-clearing command bits (:class:`Control`)
    STATUS = 0x044            #: RO  (:class:`Status`)
    ERROR = 0x048             #: RO  ErrorCode of the last request (0 = OK)
    ERROR_PC = 0x04C          #: RO  program counter of the faulting instruction
    IRQ_ENABLE = 0x050        #: RW  (:class:`Irq`)
    IRQ_STATUS = 0x054        #: W1C (:class:`Irq`)
    LAST_SEQ = 0x058          #: RO  seq of the last completed request
    CYCLES_LO = 0x060         #: RO  cycles of the last request
    CYCLES_HI = 0x064
    BUSY_CYCLES_LO = 0x068    #: RO  cycles busy since reset
    BUSY_CYCLES_HI = 0x06C
    IMAGE_BASE_LO = 0x070     #: RW  device address of the weights image
    IMAGE_BASE_HI = 0x074
    PROG_BASE_LO = 0x078      #: RW  device address of the program
    PROG_BASE_HI = 0x07C
    PROG_LEN = 0x080          #: RW  program length in instructions
    REQ0_LO = 0x090           #: RW  ping request buffer
    REQ0_HI = 0x094
    REQ1_LO = 0x098           #: RW  pong request buffer
    REQ1_HI = 0x09C
    RES0_LO = 0x0A0           #: RW  ping result buffer
    RES0_HI = 0x0A4
    RES1_LO = 0x0A8           #: RW  pong result buffer
    RES1_HI = 0x0AC
    # Memory system and KV banking (RO, version 2.2), after the buffer registers.
    P_MEM_PORTS = 0x0B0       #: memory channels the engine stripes over (dfvg_hw.spec.striping)
    P_MEM_PORT_BITS = 0x0B4   #: data width of each channel's port
    P_MEM_CHANNEL_KIB = 0x0B8 #: KiB of device memory behind each port
    P_KV_BANKS = 0x0BC
    #: The widest token tree the engine drafts (docs/isa.md §9.4); 0: chains only (RO, 2.4).
    P_TREE_WIDTH = 0x0C0
    #: Bytes of a VMEM line: the compiler lays activations out in these lines (RO, 2.7).
    P_VMEM_LINE_BYTES = 0x0C4
    #: 1 when the matrix unit has MATMUL BLOCKS' multipliers, else 0 (RO, 2.7).
    P_WEIGHT_BLOCKS = 0x0C8
    #: Bits of a KV cache element, ``cfg.kv_bits`` (RO, 2.8): the compiler's k/v scales.
    P_KV_BITS = 0x0CC


#: Per-unit busy counters: the cycles of the last request spent in each opcode's
#: instructions (fetch to retire), then in the request's own overhead (reading the
#: request, writing the result), each a read-only 32-bit register from ``OP_CYCLES``.
OP_CYCLE_BUCKETS = tuple(op.name for op in Op) + ("REQUEST",)
OP_CYCLES = 0x100


def op_cycles_offset(bucket: str) -> int:
    """Register offset of an :data:`OP_CYCLE_BUCKETS` counter (an opcode name or REQUEST)."""
    return OP_CYCLES + 4 * OP_CYCLE_BUCKETS.index(bucket)


class Control(enum.IntFlag):
    START = 1 << 0            #: run the request in buffer BUF
    ABORT = 1 << 1            #: stop the running request at the next instruction
    SOFT_RESET = 1 << 2       #: clear KV, VMEM, status and counters (not the base registers)
    LOAD_PROGRAM = 1 << 3     #: copy PROG_LEN instructions from PROG_BASE into instruction memory
    BUF = 1 << 8              #: with START: 0 = ping (REQ0/RES0), 1 = pong (REQ1/RES1)


class Status(enum.IntFlag):
    BUSY = 1 << 0
    DONE = 1 << 1             #: the last request finished (cleared by START)
    ERROR = 1 << 2            #: the last request (or LOAD_PROGRAM) stopped with an error
    PROGRAM_LOADED = 1 << 3
    BUF = 1 << 8              #: buffer of the last started request


class Irq(enum.IntFlag):
    DONE = 1 << 0             #: a request finished (with or without error)


PARAM_REGS = {
    Reg.P_ROWS: "rows", Reg.P_LANES: "lanes", Reg.P_REDUCE: "reduce",
    Reg.P_KV_SLOTS: "kv_slots", Reg.P_KV_POSITIONS: "kv_positions",
    Reg.P_HEAD_DIM: "head_dim", Reg.P_VOCAB_MAX: "vocab_max", Reg.P_TOPK_MAX: "topk_max",
    Reg.P_VMEM_BYTES: "vmem_bytes", Reg.P_IMEM_WORDS: "imem_words",
    Reg.P_MEM_PORTS: "mem_ports", Reg.P_MEM_PORT_BITS: "mem_port_bits", Reg.P_KV_BANKS: "kv_banks",
    Reg.P_VMEM_LINE_BYTES: "vmem_line_bytes", Reg.P_WEIGHT_BLOCKS: "weight_blocks",
    Reg.P_KV_BITS: "kv_bits",
}


def register_space_bits() -> int:
    """Address bits of the AXI4-Lite register space: every :class:`Reg` and the per-unit
    counters."""
    return (max(max(Reg), op_cycles_offset(OP_CYCLE_BUCKETS[-1])) + 3).bit_length()


def engine_params(config: EngineConfig, *, tree_width: int = 0) -> dict[Reg, int]:
    """The read-only parameter registers' values for an engine built from ``config``;
    ``tree_width`` is what the implementation drafts (``P_TREE_WIDTH``): ``config.rows``
    for the functional model, 0 for an RTL without tree drafting."""
    values = {reg: int(getattr(config, name)) for reg, name in PARAM_REGS.items()}
    values[Reg.P_TREE_WIDTH] = tree_width
    values[Reg.P_CLOCK_KHZ] = round(config.clock_mhz * 1000)
    values[Reg.P_MEM_CHANNEL_KIB] = config.mem_channel_bytes >> 10
    return values


class MemoryMap:
    """Where the driver places things in device memory (fixed, 4 KiB aligned).

    ======================  ==========  ==========================================
    region                  offset      size
    ======================  ==========  ==========================================
    program                 0x0000_0000 imem_words × 16 bytes (≤ 1 MiB)
    request buffer 0 (ping) 0x0010_0000 64 KiB: header + up to 16 368 input tokens
    request buffer 1 (pong) 0x0011_0000 64 KiB
    result buffer 0 (ping)  0x0012_0000 64 KiB (≥ a MAX_DRAFT result at topk_max 64)
    result buffer 1 (pong)  0x0013_0000 64 KiB
    weights image           0x0020_0000 up to the end of device memory
    ======================  ==========  ==========================================
    """
    PROGRAM = 0x0000_0000
    REQUEST = (0x0010_0000, 0x0011_0000)
    RESULT = (0x0012_0000, 0x0013_0000)
    BUFFER_BYTES = 0x1_0000
    IMAGE = 0x0020_0000

    MAX_INPUT_TOKENS = BUFFER_BYTES // 4 - REQUEST_HEADER_WORDS

    @staticmethod
    def check(config: EngineConfig) -> None:
        assert result_bytes(config.topk_max, MAX_DRAFT) <= MemoryMap.BUFFER_BYTES
        assert 16 * config.imem_words <= MemoryMap.REQUEST[0]
