"""Engine configuration: every parameter of the draft-engine generator in one dataclass.

The generator (RTL), the functional and cycle models (``sim``) and the compiler
(``dfvg_host``) all read the same :class:`EngineConfig`, so a preset name fully
determines what is built, what is simulated and what a compiled model must fit.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

__all__ = ["EngineConfig", "ConfigError", "PRESETS", "get_preset", "preset_names"]

#: Default bytes per line of the on-chip vector memory (VMEM): the narrowest line, one
#: 128-bit memory beat. A config's own width is :attr:`EngineConfig.vmem_line_bytes`;
#: VMEM addresses in instructions count its lines (16-bit fields).
VMEM_LINE_BYTES = 16


class ConfigError(ValueError):
    """An engine configuration that cannot be built; the message names the parameter."""


def _is_pow2(x: int) -> bool:
    return x > 0 and (x & (x - 1)) == 0


@dataclass(frozen=True)
class EngineConfig:
    """Parameters of one draft engine.

    Attributes
    ----------
    name : str
        Preset name, reported by the engine's ID registers.
    rows : int
        M — draft rows the matrix unit computes at once (1 for a chain; up to the tree
        branch count), reusing each weight tile across rows.
    lanes : int
        N — output channels per matrix-unit tile (one int32 accumulator each).
    reduce : int
        K — reduction width: int8 products summed per lane per cycle.
    acc_bits : int
        Accumulator width of the matrix unit (int8 weights and activations, an int16
        residual stream: :mod:`dfvg_hw.spec.numerics` fixes those).
    kv_slots, kv_positions, head_dim : int
        On-chip KV capacity: slots × positions, each entry ``head_dim`` int8 for K and the
        same for V. A slot holds one (layer, KV head) pair of the model: layer ``l``'s KV
        head ``h`` lives in slot ``l · n_kv_heads + h`` (docs/isa.md §1.4), so any model
        with ``layers · kv_heads ≤ kv_slots`` fits, however it splits the product.
    vocab_max : int
        Largest vocabulary the token sampler streams.
    topk_max : int
        Largest top-k the sampler keeps and reports.
    vmem_bytes : int
        On-chip activation scratchpad.
    imem_words : int
        Instruction memory depth (128-bit instructions).
    clock_mhz : float
        Engine clock.
    mem_bandwidth_gbps : float
        The card's theoretical device-memory bandwidth, GB/s (10^9 bytes/s): the data
        sheet's figure, all channels together.
    mem_latency_ns : float
        Device-memory read latency (first beat of a burst), as one port sees it.
    mem_bytes : int
        Device-memory capacity, all channels together.
    mem_port_bits : int
        Data width of each of the engine's AXI4 masters into device memory, on the engine
        side (128: one VMEM line a beat; 512: a 256-bit HBM pseudo-channel port at 450 MHz
        behind a width and clock converter). A port moves at most one beat a cycle.
    mem_ports : int
        AXI4 masters, one per memory channel (an HBM pseudo-channel, a DDR4 controller).
        Port ``p`` reads and writes only channel ``p``'s ``mem_bytes / mem_ports`` bytes;
        the engine drives all of them in lockstep and sees one beat of
        :attr:`mem_beat_bytes` (docs/isa.md §1.1 "Striping"; :mod:`dfvg_hw.spec.striping`).
    mem_clock_mhz : float
        Clock of the memory side of each port (the HBM's AXI clock). ``0``: the engine
        clock, no clock crossing. Where it differs, the board flow puts a clock converter
        on each port; the engine's timing sees only :attr:`port_beats_per_cycle`.
    mem_achievable_gbps : float
        Bandwidth the card's memory sustains when every channel streams sequential reads,
        as measured by its vendor (all channels together). ``0``: not measured, taken as
        :attr:`mem_bandwidth_gbps`. Each port is rate-limited to its share of it, and the
        "achievable roofline" divides by it.
    vmem_line_bytes : int
        Bytes of one VMEM line: the unit VMEM addresses in instructions count, the width
        of VMEM's read and write ports (a line a cycle each), and the alignment of every
        VMEM row. The elementwise units, ATTN's operands and MATMUL's activation load
        stream VMEM a line a cycle, so a wider line makes them faster at the cost of
        padding short rows. A power of two from 16 to the narrow memory beat
        (:attr:`port_bytes`); :data:`VMEM_LINE_BYTES` (16) by default.
    weight_blocks : bool
        Whether the matrix unit has the block multipliers of MATMUL ``BLOCKS``
        (block-scaled int8 weights, docs/numerics.md §3): a 16-bit multiplier per
        accumulator. Without them a ``BLOCKS`` MATMUL faults ``PROGRAM`` (docs/isa.md
        §3.4) and the compiler refuses ``--weight-blocks``.
    kv_bits : int
        Bits of a KV cache element, 8 to 16 (numerics.kv_entry): K and V rows are
        ``head_dim`` elements of ``kv_bits``. KVAPPEND ``WIDE`` saturates an int16 source
        to them, an int8 source fills their top 8 bits. Above 8 the attention unit's score
        products are one DSP48E2 each instead of two banks' in one (docs/numerics.md §6).
    kv_banks : int
        Banks of the KV buffer: position ``t`` lives in bank ``t mod kv_banks``, and ATTN
        reads one K or V row from every bank a cycle (docs/isa.md §1.4).
    draft_cores : int
        Draft engines on one card (1 to 16), each with the parameters above, its own
        register window, program and requests, sharing the card's memory ports through
        one arbiter per port (:class:`dfvg_hw.draft_cores.DraftCores`,
        docs/architecture.md "Several draft cores"). It does not change what a core is:
        every core is the engine the other parameters describe.
    source : str
        Where the numbers come from.
    """

    name: str
    rows: int
    lanes: int
    reduce: int
    kv_slots: int
    kv_positions: int
    head_dim: int
    vocab_max: int
    topk_max: int
    vmem_bytes: int
    imem_words: int
    clock_mhz: float
    mem_bandwidth_gbps: float
    mem_latency_ns: float
    mem_bytes: int
    mem_port_bits: int = 128
    mem_ports: int = 1
    mem_clock_mhz: float = 0.0
    mem_achievable_gbps: float = 0.0
    kv_banks: int = 1
    kv_bits: int = 8
    vmem_line_bytes: int = VMEM_LINE_BYTES
    weight_blocks: bool = True
    draft_cores: int = 1
    acc_bits: int = 32
    source: str = ""

    def __post_init__(self):
        self.validate()

    # -- derived quantities -------------------------------------------------------------
    @property
    def macs_per_cycle(self) -> int:
        return self.rows * self.lanes * self.reduce

    @property
    def mem_bytes_per_cycle(self) -> float:
        """The card's theoretical bandwidth in bytes per engine cycle."""
        return self.mem_bandwidth_gbps * 1e9 / (self.clock_mhz * 1e6)

    @property
    def achievable_bandwidth_gbps(self) -> float:
        """:attr:`mem_achievable_gbps`, or the theoretical figure where none was measured."""
        return self.mem_achievable_gbps or self.mem_bandwidth_gbps

    @property
    def port_bytes(self) -> int:
        """Bytes per beat of one port (engine side)."""
        return self.mem_port_bits // 8

    @property
    def mem_beat_bytes(self) -> int:
        """Bytes of one engine beat: a beat of every port, side by side (port 0 lowest)."""
        return self.mem_ports * self.port_bytes

    @property
    def mem_channel_bytes(self) -> int:
        """Bytes of device memory behind each port (one channel)."""
        return self.mem_bytes // self.mem_ports

    @property
    def port_beats_per_cycle(self) -> float:
        """Beats a cycle one port's memory delivers: its share of the achievable
        bandwidth, at most one (a port moves at most a beat a cycle). The simulated
        memories rate-limit each port to this, and the cycle model uses it."""
        return self.beats_per_cycle(self.port_bytes)

    def beats_per_cycle(self, beat_bytes: int) -> float:
        """:attr:`port_beats_per_cycle` for a port of ``beat_bytes`` bytes a beat."""
        share = self.achievable_bandwidth_gbps * 1e9 / self.mem_ports
        return min(1.0, share / (beat_bytes * self.clock_mhz * 1e6))

    @property
    def engine_bytes_per_cycle(self) -> float:
        """Device-memory bytes per cycle the engine moves when streaming: every port at
        :attr:`port_beats_per_cycle`."""
        return self.port_beats_per_cycle * self.mem_beat_bytes

    @property
    def engine_bandwidth_gbps(self) -> float:
        """:attr:`engine_bytes_per_cycle` in GB/s (10^9 bytes/s) at the engine clock."""
        return self.engine_bytes_per_cycle * self.clock_mhz * 1e6 / 1e9

    @property
    def mem_latency_cycles(self) -> int:
        return max(1, round(self.mem_latency_ns * 1e-9 * self.clock_mhz * 1e6))

    @property
    def kv_bytes(self) -> int:
        """On-chip KV storage: K and V, ``kv_bits`` an element (whole bytes of a row)."""
        return 2 * self.kv_slots * self.kv_positions * self.kv_row_bytes

    @property
    def kv_row_bytes(self) -> int:
        """Bytes of one K or V row: ``head_dim`` elements of ``kv_bits``."""
        return -(-self.head_dim * self.kv_bits // 8)

    def with_changes(self, **changes) -> "EngineConfig":
        """A copy with some parameters changed (validated like any other config)."""
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    # -- validation ---------------------------------------------------------------------
    def validate(self) -> None:
        def need(cond: bool, param: str, why: str):
            if not cond:
                raise ConfigError(f"engine config {self.name!r}: {param} = "
                                  f"{getattr(self, param)!r}: {why}")

        for p in ("rows", "lanes", "reduce", "kv_slots", "kv_positions",
                  "head_dim", "vocab_max", "topk_max", "vmem_bytes", "imem_words", "mem_bytes"):
            need(isinstance(getattr(self, p), int) and getattr(self, p) > 0, p,
                 "must be a positive integer")
        for p in ("clock_mhz", "mem_bandwidth_gbps", "mem_latency_ns"):
            need(getattr(self, p) > 0, p, "must be positive")
        for p in ("mem_clock_mhz", "mem_achievable_gbps"):
            need(getattr(self, p) >= 0, p, "must be positive, or 0 for the default")
        need(self.mem_achievable_gbps <= self.mem_bandwidth_gbps, "mem_achievable_gbps",
             "cannot exceed the theoretical mem_bandwidth_gbps")
        need(isinstance(self.mem_ports, int) and _is_pow2(self.mem_ports)
             and self.mem_ports <= 64, "mem_ports",
             "a power of two, at most 64 (32 HBM pseudo-channels on an Alveo U55C)")
        need(self.mem_bytes % (self.mem_ports * 4096) == 0, "mem_bytes",
             f"must split into {self.mem_ports} channels of whole 4 KiB pages")
        need(isinstance(self.kv_banks, int) and _is_pow2(self.kv_banks)
             and self.kv_banks <= self.kv_positions, "kv_banks",
             "a power of two, at most kv_positions")
        need(isinstance(self.kv_bits, int) and not isinstance(self.kv_bits, bool)
             and 8 <= self.kv_bits <= 16, "kv_bits",
             "an integer from 8 to 16 (a KVAPPEND source is int8 or int16)")
        need(self.kv_bits == 8 or self.kv_banks >= 2, "kv_bits",
             "above 8 only with kv_banks >= 2: the one-bank KV buffer streams reduce-wide "
             "int8 words through a byte gearbox, a banked one whole rows")
        need(isinstance(self.draft_cores, int) and not isinstance(self.draft_cores, bool)
             and 1 <= self.draft_cores <= 16, "draft_cores",
             "an integer from 1 to 16 (the memory arbiters' round-robin grant grows with the "
             "square of the core count)")
        need(self.acc_bits == 32, "acc_bits", "the numerics define int32 accumulators only")
        need(self.rows >= 2, "rows", "at least 2: a wide (int16) matmul row is two int8 digit "
             "rows that the matrix unit computes side by side")
        need(self.rows <= 64, "rows", "at most 64 draft rows (the instruction's rows field is 8 bits "
             "and tree budgets beyond 64 branches are not useful)")
        need(_is_pow2(self.lanes), "lanes", "must be a power of two")
        need(_is_pow2(self.reduce), "reduce", "must be a power of two")
        need(self.reduce >= 4, "reduce", "must be at least 4")
        need(self.mem_port_bits in (128, 256, 512), "mem_port_bits",
             "the memory port is 128, 256 or 512 bits (whole VMEM lines a beat, and weight "
             "tiles of whole beats)")
        line = self.vmem_line_bytes
        need(isinstance(line, int) and not isinstance(line, bool) and _is_pow2(line)
             and line >= 16, "vmem_line_bytes", "a power of two, at least 16")
        need(line <= self.port_bytes, "vmem_line_bytes",
             f"at most the {self.port_bytes}-byte memory port beat (mem_port_bits / 8): one "
             "narrow memory beat must hold whole VMEM lines")
        need(self.head_dim % line == 0, "head_dim",
             f"must be a multiple of the {line}-byte VMEM line (RoPE pairs and KV "
             "rows are line-aligned)")
        need(self.kv_slots <= 65535, "kv_slots", "at most 65535 slots (16-bit LAYER and head "
             "counts)")
        need(self.kv_positions <= 65535, "kv_positions", "at most 65535 positions (16-bit position counters)")
        need(self.vocab_max <= 65535, "vocab_max", "token ids are 16-bit in the ISA's n field")
        need(self.topk_max <= 64, "topk_max", "the sampler keeps at most 64 candidates")
        need(self.topk_max <= self.vocab_max, "topk_max", "cannot exceed vocab_max")
        need(self.vmem_bytes % line == 0, "vmem_bytes",
             f"must be a multiple of the {line}-byte VMEM line")
        need(self.vmem_bytes <= line * 65536, "vmem_bytes",
             f"VMEM addresses are 16-bit line numbers (at most 65536 lines of {line} bytes)")
        need(self.imem_words <= 65536, "imem_words", "program counters are 16-bit")
        need(self.mem_bytes <= 1 << 36, "mem_bytes", "device addresses are at most 36-bit (64 GiB)")
        # int8 x int8 products summed over K must not overflow the accumulator for any
        # K the engine accepts (16-bit k field): 2^14 * 2^16 < 2^31.
        need(self.acc_bits >= 2 * 8 + 16, "acc_bits",
             "too narrow for a 65535-long int8 dot product")


GiB = 1 << 30

#: Named presets. Board numbers come from the AMD data sheets cited in ``source``.
PRESETS: dict[str, EngineConfig] = {
    cfg.name: cfg for cfg in [
        EngineConfig(
            name="tiny", rows=2, lanes=4, reduce=8,
            kv_slots=4, kv_positions=64, head_dim=16,
            vocab_max=512, topk_max=4, vmem_bytes=4096, imem_words=256,
            clock_mhz=100.0, mem_bandwidth_gbps=1.6, mem_latency_ns=100.0, mem_bytes=1 << 24,
            source="small enough to simulate the RTL in tests; 100 MHz and one 128-bit "
                   "100 MHz AXI port (1.6 GB/s) are nominal, not a board"),
        EngineConfig(
            name="alveo-u55c", rows=4, lanes=64, reduce=32,
            kv_slots=144, kv_positions=1024, head_dim=64, kv_banks=16,
            vocab_max=65535, topk_max=16, vmem_bytes=1 << 18, imem_words=4096,
            clock_mhz=300.0, mem_bandwidth_gbps=460.0, mem_latency_ns=200.0, mem_bytes=16 * GiB,
            mem_port_bits=512, mem_ports=32, mem_clock_mhz=450.0, mem_achievable_gbps=421.0,
            vmem_line_bytes=64, kv_bits=12,
            source="Alveo U55C (XCU55C, DS978): 16 GB HBM2 in 32 pseudo-channels at 460 GB/s, "
                   "9024 DSP, 960 URAM (33.75 MB). 421 GB/s achievable: AMD's HBM bandwidth "
                   "example with 32 masters, each on its own pseudo-channel (measured on a U280, "
                   "the same HBM). One 512-bit master a pseudo-channel at 300 MHz, bridged to its "
                   "256-bit 450 MHz HBM port (docs/boards.md §2.1); 200 ns read latency: the "
                   "~110-140 ns measured at the HBM plus an allowance for the bridge (not "
                   "measured). Tile 4x64x32: one 2 KiB engine beat a cycle, 4 rows for trees. "
                   "KV of 12-bit elements (28.3 MB) in URAM, 16 banks: ATTN takes 16 K or V rows "
                   "a cycle, a 16-bit query times K one DSP a product, banks 8-15's e·V products "
                   "logic (the DSPs of 8 banks). 12 bits and block-scaled weights take "
                   "SmolLM2-135M from 93.2 % to 97.6 % top-1 agreement (docs/numerics.md "
                   "§13.7); they cost 512 DSPs of the score products (no longer two banks to a "
                   "DSP) and the block multipliers' 384. 300 MHz as in the DFVG paper. 64-byte "
                   "VMEM lines, the 512-bit port's beat: RMSNORM, ACTMUL, ROPE, KVAPPEND, ATTN's "
                   "operands and MATMUL's activation load move a line a cycle, and 16-byte lines "
                   "made them a third of a LLaMA-160M token"),
        EngineConfig(
            name="alveo-u55c-1ch", rows=4, lanes=64, reduce=32,
            kv_slots=144, kv_positions=1024, head_dim=64, kv_banks=8,
            vocab_max=65535, topk_max=16, vmem_bytes=1 << 18, imem_words=4096,
            clock_mhz=300.0, mem_bandwidth_gbps=460.0, mem_latency_ns=200.0, mem_bytes=16 * GiB,
            mem_port_bits=256, mem_achievable_gbps=421.0, vmem_line_bytes=32, kv_bits=12,
            source="alveo-u55c with one 256-bit memory channel at the engine clock (9.6 GB/s, "
                   "within one pseudo-channel's 13.1): the single-channel engine, smaller to build "
                   "and simulate, and the baseline of the efficiency table. Rooflines are the card's, "
                   "as for alveo-u55c. 32-byte VMEM lines: the widest the 256-bit port's beat holds"),
        EngineConfig(
            name="alveo-u280", rows=4, lanes=64, reduce=32,
            kv_slots=144, kv_positions=1024, head_dim=64, kv_banks=16,
            vocab_max=65535, topk_max=16, vmem_bytes=1 << 18, imem_words=4096,
            clock_mhz=300.0, mem_bandwidth_gbps=460.0, mem_latency_ns=200.0, mem_bytes=8 * GiB,
            mem_port_bits=512, mem_ports=32, mem_clock_mhz=450.0, mem_achievable_gbps=421.0,
            vmem_line_bytes=64, kv_bits=12,
            source="Alveo U280 (XCU280, DS963): 8 GB HBM2 in 32 pseudo-channels at 460 GB/s "
                   "(plus 32 GB DDR4, unused), 9024 DSP, 960 URAM. 421 GB/s achievable: AMD's HBM "
                   "bandwidth example on this card (32 masters, one a pseudo-channel). Ports, "
                   "latency, tile, 12-bit KV and 64-byte VMEM lines as alveo-u55c; 300 MHz"),
        EngineConfig(
            name="alveo-u250", rows=8, lanes=32, reduce=32,
            kv_slots=144, kv_positions=1024, head_dim=64, kv_banks=8,
            vocab_max=65535, topk_max=16, vmem_bytes=1 << 18, imem_words=4096,
            clock_mhz=300.0, mem_bandwidth_gbps=77.0, mem_latency_ns=250.0, mem_bytes=64 * GiB,
            mem_port_bits=512, mem_ports=4, mem_clock_mhz=300.0, vmem_line_bytes=64, kv_bits=12,
            source="Alveo U250 (XCU250, DS962): 64 GB DDR4 in 4 channels at 77 GB/s, "
                   "12288 DSP, 1280 URAM; one 512-bit master per DDR4 controller (its 300 MHz "
                   "AXI clock). No vendor measurement of sustained bandwidth is used, so the "
                   "achievable roofline is the theoretical one. 300 MHz. DDR bandwidth makes the "
                   "tile smaller (32 x 32) while staying memory-bound for chains; KV of 12-bit "
                   "elements in URAM, 8 banks. 64-byte VMEM lines (the 512-bit port's beat), so the elementwise "
                   "units stream VMEM as fast as the 32-lane units take it"),
        EngineConfig(
            name="nitefury", rows=2, lanes=16, reduce=8,
            kv_slots=24, kv_positions=256, head_dim=64,
            vocab_max=32000, topk_max=16, vmem_bytes=1 << 17, imem_words=2048,
            clock_mhz=125.0, mem_bandwidth_gbps=1.6, mem_latency_ns=250.0, mem_bytes=1 * GiB,
            mem_port_bits=128,
            source="NiteFury II M.2 card (XC7A200T, DS180: 740 DSP48E1, 365 BRAM36, no URAM): "
                   "1 GiB x16 DDR3 at 800 MT/s = 1.6 GB/s peak (RHS Research's Nitefury-II "
                   "MIG project: 400 MHz, 4:1, 128-bit AXI = the memory port), PCIe Gen2 x4. "
                   "Tile 2x16x8 (256 MACs) and a LLaMA-68M-sized KV (24 slots = 2 layers x 12 "
                   "KV heads, x 256 positions x 64) in block RAM (192 BRAM36); 125 MHz, an Artix-7 -2 "
                   "target, not yet met in Vivado"),
        EngineConfig(
            name="litefury", rows=2, lanes=4, reduce=8,
            kv_slots=4, kv_positions=512, head_dim=64,
            vocab_max=4096, topk_max=8, vmem_bytes=1 << 15, imem_words=1024,
            clock_mhz=100.0, mem_bandwidth_gbps=1.6, mem_latency_ns=250.0, mem_bytes=512 << 20,
            mem_port_bits=128,
            source="LiteFury M.2 card (XC7A100T, DS180: 240 DSP48E1, 135 BRAM36, no URAM): "
                   "512 MiB x16 DDR3 at 800 MT/s = 1.6 GB/s peak (RHS Research's MIG project), "
                   "PCIe Gen2 x4. The tiny tile (2x4x8) and a KV the size of the demo draft "
                   "(4 slots = 2 layers x 2 KV heads, x 512 positions x 64, 64 BRAM36); 100 MHz"),
        EngineConfig(
            name="tiny-hbm", rows=2, lanes=8, reduce=8,
            kv_slots=4, kv_positions=64, head_dim=16,
            vocab_max=512, topk_max=4, vmem_bytes=4096, imem_words=256,
            clock_mhz=100.0, mem_bandwidth_gbps=6.4, mem_latency_ns=100.0, mem_bytes=1 << 24,
            mem_port_bits=128, mem_ports=4, mem_achievable_gbps=4.8, kv_banks=2, kv_bits=12,
            source="the multi-channel engine small enough to co-simulate in tests: 4 channels "
                   "of 4 MiB behind 128-bit ports at 100 MHz (6.4 GB/s in all), each rate-limited "
                   "to 75 % of its peak (4.8 GB/s achievable) as a stand-in for refresh and "
                   "page misses; 2 KV banks of 12-bit elements, as alveo-u55c's. Nominal, not a "
                   "board"),
    ]
}


def preset_names() -> list[str]:
    return list(PRESETS)


def get_preset(name: str) -> EngineConfig:
    """The preset called *name*; an unknown name lists the known ones."""
    try:
        return PRESETS[name]
    except KeyError:
        raise ConfigError(f"unknown engine preset {name!r}; known presets: "
                          f"{', '.join(PRESETS)}") from None
