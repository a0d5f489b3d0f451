"""Bit-exact functional model of the draft engine.

:class:`FunctionalEngine` executes a program from instruction memory against a weights
image and a request descriptor in :class:`~sim.memory.DeviceMemory`, exactly as the
hardware does: the controller (loops, branches, the on-device draft loop), the units
(embedding, RMSNorm, matrix unit, RoPE, KV buffer, attention, gated activation, token
sampler) computed with :mod:`dfvg_hw.spec.numerics`, and the result descriptor written back
to device memory. The :class:`~sim.cycle_model.CycleModel` counts cycles alongside.
"""

from __future__ import annotations

import numpy as np

from dfvg_hw.spec import numerics as nx
from dfvg_hw.spec.config import EngineConfig
from dfvg_hw.spec.descriptors import (MAX_COMPACT, MAX_DRAFT, REQUEST_HEADER_WORDS,
                                      RESULT_HEADER_WORDS, TREE_FIELDS, Compaction, DraftedToken,
                                      DraftRequest, DraftResult, ErrorCode, watchdog_budget)
from dfvg_hw.spec.image import (ACT_PARAM_BYTES, ATTN_PARAM_BYTES, NORM_PARAM_BYTES,
                           embed_row_stride, padded, requant_record_bytes,
                           unpack_requant_records, untile_scales, untile_weights, weight_area_bytes)
from dfvg_hw.spec.isa import (ACTMUL_SEGMENTS, IllegalInstruction, Instruction, MatmulMode, Op,
                              actmul_source_bytes, decode, matmul_output_bytes)
from sim.program_flow import CONTROL_OPS, ControlFault, ProgramFlow, block_address
from sim.cycle_model import BEFORE_FINISH, ISSUE, UNIT_OVERHEAD, CycleCounts, CycleModel, PrefetchChain, TreeTiming
from sim.memory import DeviceMemory, MemoryError_
from sim.tree_state import SampledRow, TreeState

__all__ = ["FunctionalEngine", "EngineFault"]


class EngineFault(Exception):
    """Stops a run with an error code (becomes the result's status and ERROR register)."""

    def __init__(self, code: ErrorCode, detail: str):
        self.code = code
        self.detail = detail
        super().__init__(f"{code.name}: {detail}")


class FunctionalEngine:
    """The draft engine's functional model.

    Members
    -------
    config : EngineConfig
        The engine being modelled.
    memory : DeviceMemory
        Device memory holding images, programs and descriptors.
    kv_k, kv_v : numpy.ndarray
        The on-chip KV buffers, ``[kv_slots, kv_positions, head_dim]`` int16 holding
        elements of ``cfg.kv_bits`` (numerics.kv_entry); layer ``l``'s
        KV head ``h`` is slot ``kv_slot_base + l · G + h`` for the instruction's KV-head
        count ``G``.
    kv_slot_base : int
        The first KV slot of the running request's sequence (its header's
        ``kv_slot_base``; 0 outside a request).
    vmem : numpy.ndarray
        The activation scratchpad, ``vmem_bytes`` bytes.
    logits : numpy.ndarray or None
        The sampler's logit buffer (int16, Q7.8) after the last LOGITS matmul, readable
        for debugging as the hardware's debug port would expose it: row 0 (the only row
        outside tree forwards).
    logit_rows : numpy.ndarray or None
        Every row of the logit buffer, ``[rows, n]`` (docs/isa.md §9.2).
    tree_width : int
        The widest tree this engine drafts (``P_TREE_WIDTH``): ``config.rows`` by
        default; 0 models an engine that drafts chains only (the RTL of this revision).
    tree : TreeState or None
        The running tree request's nodes.
    counts : CycleCounts
        Modelled cycles of the last run.
    """

    def __init__(self, config: EngineConfig, memory: DeviceMemory | None = None, *,
                 tree_width: int | None = None):
        self.config = config
        self.tree_width = config.rows if tree_width is None else tree_width
        if not 0 <= self.tree_width <= config.rows:
            raise ValueError(f"tree_width {self.tree_width} is not in 0 … rows = {config.rows}")
        self.tree: TreeState | None = None
        self.logit_rows: np.ndarray | None = None
        self._pitch: int | None = None
        self.memory = memory if memory is not None else DeviceMemory(config.mem_bytes)
        shape = (config.kv_slots, config.kv_positions, config.head_dim)
        self.kv_k = np.zeros(shape, dtype=np.int16)     # elements of cfg.kv_bits
        self.kv_v = np.zeros(shape, dtype=np.int16)
        self.kv_slot_base = 0
        self.vmem = np.zeros(config.vmem_bytes, dtype=np.uint8)
        self.imem: list[int] = []
        self._decoded: list = []
        self.logits: np.ndarray | None = None
        #: each row's exponent from the last ACTMUL that computed it (MATMUL ROWEXP reads them)
        self.row_exp = np.zeros(config.rows, dtype=np.int64)
        self.cycle_model = CycleModel(config)
        self.counts = CycleCounts()
        self._weights: dict[tuple[int, int, int, bool, bool], tuple] = {}
        self.last_fault: Exception | None = None
        self.memory.on_write(self._invalidate)

    # -- host-visible operations -----------------------------------------------------
    def load_program(self, addr: int, n_words: int) -> None:
        """Copy ``n_words`` 128-bit instructions from device memory into instruction memory."""
        if n_words > self.config.imem_words:
            raise EngineFault(ErrorCode.PROGRAM, f"program of {n_words} instructions exceeds "
                              f"the {self.config.imem_words}-word instruction memory")
        raw = self.memory.read(addr, 16 * n_words)
        self.imem = [int.from_bytes(raw[i:i + 16], "little") for i in range(0, len(raw), 16)]
        # Decoding is a pure function of the word; decode once per load, fault at fetch.
        self._decoded = []
        for word in self.imem:
            try:
                self._decoded.append(decode(word))
            except IllegalInstruction as exc:
                self._decoded.append(exc)

    def soft_reset(self) -> None:
        """Clear KV, VMEM, the row exponents and the logit buffer (the CONTROL register's
        soft reset)."""
        self.row_exp.fill(0)
        self.kv_k.fill(0)
        self.kv_v.fill(0)
        self.vmem.fill(0)
        self.logits = self.logit_rows = None

    def run(self, *, image_base: int, request_addr: int, result_addr: int,
            watchdog: int | None = None) -> DraftResult:
        """Execute one request; writes and returns the result descriptor.

        Errors never raise: they stop the run with a status code, and every token drafted
        before the error is still in the result.
        """
        self.counts = CycleCounts()
        self.last_fault = None
        self.logits = self.logit_rows = None   # a SAMPLE must follow this request's own LOGITS matmul
        self.kv_slot_base = 0
        self.tree = self._pitch = None
        header = dict(seq=0, start_pos=0, topk=1)
        drafted: list[DraftedToken] = []
        seq = None
        status = ErrorCode.OK
        try:
            try:
                header = DraftRequest.unpack_header(self.memory.read(request_addr, 4 * REQUEST_HEADER_WORDS))
            except MemoryError_ as exc:
                raise EngineFault(ErrorCode.BAD_ADDRESS, f"request descriptor: {exc}") from None
            # the engine reads the request and writes a result even when it refuses it
            # (the token scan only after a header that passes its checks)
            self.counts.add("REQUEST", *self.cycle_model.request_header())
            tokens = self._read_request_tokens(header, request_addr)
            self.kv_slot_base = header["kv_slot_base"]
            self._compact(Compaction.from_header(header))
            width = header["tree_width"]
            seq = ProgramFlow(tokens, header["start_pos"], header["n_draft"], tree_width=width,
                              tree_pc=header["tree_pc"])
            if width:
                self.tree = TreeState(width, header["start_pos"] + len(tokens))
            budget = watchdog if watchdog is not None else \
                watchdog_budget(len(tokens), header["n_draft"], max(len(self.imem), 1))
            self._execute(seq, header, image_base, drafted, result_addr, budget)
        except (EngineFault, ControlFault) as fault:
            status = fault.code
            self.last_fault = fault
        # The result reports the cycles up to FINISH; the engine's counters go on through
        # the result write.
        # (request_finish counts from the FETCH that finds the request over, which _execute
        # charged where the request had one)
        finish, nbytes = self.cycle_model.request_finish(len(drafted))
        reported = self.counts.total
        self.counts.add("REQUEST", finish - BEFORE_FINISH, nbytes)
        result = DraftResult(seq=header["seq"], status=status,
                             end_pos=seq.pos if seq else header["start_pos"],
                             cycles=reported, n_forward=seq.forwards if seq else 0,
                             error_pc=seq.pc if seq and status else 0, tokens=drafted,
                             topk=len(drafted[0].topk_ids) if drafted else 0)
        self._write_result(result_addr, result)
        return result

    # -- controller --------------------------------------------------------------------
    def _read_request_tokens(self, h: dict, request_addr: int) -> list[int]:
        c = self.config
        if h["n_in"] < 1:
            raise EngineFault(ErrorCode.BAD_REQUEST, "n_in must be at least 1")
        if h["n_draft"] > MAX_DRAFT:
            raise EngineFault(ErrorCode.BAD_REQUEST, f"n_draft {h['n_draft']} > {MAX_DRAFT}")
        if not 1 <= h["topk"] <= c.topk_max:
            raise EngineFault(ErrorCode.BAD_REQUEST, f"topk {h['topk']} not in 1..{c.topk_max}")
        if h["sample"] and h["t_mult"] == 0:
            raise EngineFault(ErrorCode.BAD_REQUEST, "sampling needs a non-zero t_mult")
        if h["t_shift"] > 63 or h["flags_reserved"] or h["reserved"]:
            raise EngineFault(ErrorCode.BAD_REQUEST, "reserved request fields must be 0")
        self._check_tree_fields(h)
        self.counts.add("REQUEST", *self.cycle_model.request_scan(h["n_in"]))
        try:
            raw = self.memory.view(request_addr + 4 * REQUEST_HEADER_WORDS, 4 * h["n_in"])
        except MemoryError_ as exc:
            raise EngineFault(ErrorCode.BAD_ADDRESS, str(exc)) from None
        tokens = [int(t) for t in raw.view("<u4")]
        bad = [t for t in tokens if t >= c.vocab_max]
        if bad:
            raise EngineFault(ErrorCode.BAD_REQUEST, f"token id {bad[0]} ≥ vocab_max {c.vocab_max}")
        return tokens

    def _check_tree_fields(self, h: dict) -> None:
        """The tree and compaction fields (docs/isa.md §5.1, §9)."""
        c, width = self.config, h["tree_width"]
        if not self.tree_width and any(h[f] for f in TREE_FIELDS):
            raise EngineFault(ErrorCode.BAD_REQUEST, "this engine drafts chains only "
                              "(P_TREE_WIDTH = 0): the tree and compaction fields must be 0")
        if width > self.tree_width:
            raise EngineFault(ErrorCode.BAD_REQUEST, f"tree_width {width} > the engine's "
                              f"{self.tree_width}")
        if width:
            if h["n_draft"] * width > MAX_DRAFT:
                raise EngineFault(ErrorCode.BAD_REQUEST, f"{h['n_draft']} levels × {width} = "
                                  f"{h['n_draft'] * width} nodes > {MAX_DRAFT}")
            if not h["sample"] and h["topk"] < width:
                raise EngineFault(ErrorCode.BAD_REQUEST, f"a greedy tree of width {width} "
                                  f"needs topk ≥ {width}, not {h['topk']}")
            if width > 1 and not h["row_pitch"]:
                raise EngineFault(ErrorCode.BAD_REQUEST, "a tree of width > 1 needs a row_pitch")
        elif h["tree_pc"] or h["row_pitch"]:
            raise EngineFault(ErrorCode.BAD_REQUEST, "tree_pc and row_pitch need a tree_width")
        n = h["compact_len"]
        if not n:
            if any(h[f] for f in ("compact_from", "compact_width", "compact_slots", "compact_rows")):
                raise EngineFault(ErrorCode.BAD_REQUEST, "compaction fields without compact_len")
            return
        comp = Compaction.from_header(h)
        if n > MAX_COMPACT or not 1 <= comp.width <= self.tree_width \
                or h["compact_rows"] >> (4 * n) or any(r >= comp.width for r in comp.rows):
            raise EngineFault(ErrorCode.BAD_REQUEST, f"compaction of {n} levels of width "
                              f"{comp.width} with rows {list(comp.rows)} is not a tree path")
        if max(src for src, _ in comp.moves()) >= c.kv_positions \
                or h["kv_slot_base"] + comp.slots > c.kv_slots:
            raise EngineFault(ErrorCode.BAD_REQUEST, "compaction outside the KV buffer")

    def _compact(self, comp: Compaction) -> None:
        """Move an accepted path's KV into its logical positions (docs/isa.md §9.3)."""
        if not comp.rows:
            return
        self.counts.add("REQUEST", self.cycle_model.compaction(len(comp.rows), comp.slots))
        slots = slice(self.kv_slot_base, self.kv_slot_base + comp.slots)
        for src, dst in comp.moves():
            self.kv_k[slots, dst] = self.kv_k[slots, src]
            self.kv_v[slots, dst] = self.kv_v[slots, src]

    def _execute(self, seq: ProgramFlow, h: dict, image_base: int, drafted: list,
                 result_addr: int, budget: int) -> None:
        # A request that ends at a FETCH (after HALT, past the program's end, over the
        # budget, after a control instruction's fault) spends that FETCH (BEFORE_FINISH)
        # before FINISH; one that another instruction stops goes from it straight to FINISH.
        executed = 0
        prefetch = PrefetchChain(self.cycle_model)
        while not seq.halted:
            if seq.pc >= len(self.imem):
                self.counts.add("REQUEST", BEFORE_FINISH)
                raise EngineFault(ErrorCode.PROGRAM, f"pc {seq.pc} ran past the program's "
                                  f"{len(self.imem)} instructions")
            executed += 1
            if executed > budget:
                self.counts.add("REQUEST", BEFORE_FINISH)
                raise EngineFault(ErrorCode.WATCHDOG, f"{budget} instructions without HALT")
            ins = self._decoded[seq.pc]
            if isinstance(ins, IllegalInstruction):
                # its fetch and decode are REQUEST's whatever its opcode byte (docs/registers.md)
                self.counts.add("REQUEST", ISSUE)
                raise EngineFault(ErrorCode.ILLEGAL_INSTRUCTION, str(ins))
            addr = seq.block_address(ins, image_base)
            self.set_row_pitch(h["row_pitch"] if seq.tree_forward else 0)
            try:
                self._check_operands(ins, seq, addr)
            except EngineFault:
                # the unit refuses the job before it moves any data (docs/isa.md §8)
                self.counts.add(ins.opcode, UNIT_OVERHEAD)
                raise
            cycles, nbytes = self.cycle_model.instruction(ins, pos=seq.pos, topk=h["topk"], addr=addr,
                                                          token_from_request=not seq.token_is_drafted,
                                                          tree=self._tree_timing(ins, seq, h),
                                                          head=prefetch.head(ins))
            self.counts.add(ins.opcode, cycles, nbytes, self.cycle_model.macs(ins, pos=seq.pos))
            prefetch.ran(ins, cycles, addr=addr, tree_forward=seq.tree_forward)
            if ins.opcode in CONTROL_OPS:
                try:
                    seq.control(ins)
                except ControlFault:
                    # the RTL's program flow reports it at the next FETCH
                    self.counts.add("REQUEST", BEFORE_FINISH)
                    raise
                continue
            if ins.opcode == Op.SAMPLE:
                records = self._sample(ins, h, seq.n_drafted, seq)
                seq.drafted(records[-1].token)
                for token in records:
                    drafted.append(token)
                    self._write_record(result_addr, len(drafted) - 1, token)
            else:
                self._unit(ins, seq, image_base)
            seq.pc += 1
        self.counts.add("REQUEST", BEFORE_FINISH)

    # -- units -------------------------------------------------------------------------
    def _check_operands(self, ins: Instruction, st: ProgramFlow, addr: int) -> None:
        """The checks a unit makes on its job before it moves any data, in the unit's
        order: they read only the fields, the controller's registers and the memory sizes,
        so they come before the cycle model prices the instruction (whose cost grows with
        ``n·k``) and before :meth:`_unit` runs it. ``addr`` is the block's device address.
        Checks that need data (RMSNORM's ``gamma_shift``, ATTN's KV-head count) stay in
        :meth:`_unit`, as do the KV buffer's."""
        op, c = ins.opcode, self.config
        if op in CONTROL_OPS or op in (Op.NOP, Op.SAMPLE):
            return
        branches = op in (Op.EMBED, Op.KVAPPEND, Op.ATTN) or (
            op == Op.MATMUL and ins.mode == MatmulMode.LOGITS)
        if branches and ins.rows != st.rows_expected:
            raise EngineFault(ErrorCode.PROGRAM, f"{op.name} with rows={ins.rows} in a "
                              + (f"tree forward of width {st.tree_width}" if st.tree_forward
                                 else "chain forward (rows 1; several rows are a tree's branches)"))
        if ins.rows > c.rows:
            raise EngineFault(ErrorCode.PROGRAM, f"rows={ins.rows} > engine rows {c.rows}")
        rows, wide_bytes = ins.rows, 2 if ins.wide else 1
        if op == Op.EMBED:
            # rows are padded to whole engine beats; the unit reads them through the narrow
            # path (docs/isa.md §1.1), whose beat is one channel's: the table starts on one
            beat = c.port_bytes
            if ins.position:
                self._check_pos(st.pos)
            for token in self._embed_rows(ins, st):
                row = addr + token * embed_row_stride(ins.n, c.mem_beat_bytes)
                if row % beat:
                    raise EngineFault(ErrorCode.BAD_ADDRESS, f"EMBED row at 0x{row:x} is not "
                                      f"aligned to the {beat}-byte memory beat")
                self._dram(row, 4 * ins.n)
            self._vspan(ins.dst, rows, 4 * ins.n)
        elif op == Op.RMSNORM:
            if ins.k > 1 and ins.n % c.vmem_line_bytes:
                # segments start on VMEM lines, in the int32 source and the int8 output alike
                raise EngineFault(ErrorCode.PROGRAM, f"RMSNORM of {ins.k} segments of {ins.n}: "
                                  f"a segment must be a multiple of {c.vmem_line_bytes} elements")
            self._dram(addr, NORM_PARAM_BYTES)      # gamma_shift is checked before gamma's read
        elif op == Op.MATMUL:
            if ins.blocks and not c.weight_blocks:
                raise EngineFault(ErrorCode.PROGRAM, "MATMUL BLOCKS on an engine built without "
                                  "block multipliers (weight_blocks)")
            if addr % c.mem_beat_bytes:
                raise EngineFault(ErrorCode.BAD_ADDRESS, f"MATMUL block at 0x{addr:x} is not "
                                  f"aligned to the {c.mem_beat_bytes}-byte memory beat")
            npad = padded(ins.n, c.lanes)
            self._dram(addr, weight_area_bytes(ins.n, ins.k, c.lanes, c.reduce, ins.blocks)
                       + requant_record_bytes(c.lanes, ins.bias) * (npad // c.lanes))
            self._vspan(ins.src, rows, ins.k * wide_bytes)
            if ins.mode == MatmulMode.LOGITS:
                if ins.n > c.vocab_max:
                    raise EngineFault(ErrorCode.PROGRAM, f"{ins.n} logits > vocab_max {c.vocab_max}")
            else:
                self._vspan(ins.dst, rows, ins.n * matmul_output_bytes(ins))
        elif op == Op.ROPE:
            if ins.k % 2:
                raise EngineFault(ErrorCode.PROGRAM, f"ROPE over an odd head dimension {ins.k}")
            self._check_pos(st.pos)
            if ins.k > c.head_dim:
                raise EngineFault(ErrorCode.PROGRAM, f"ROPE over head dimension {ins.k} > "
                                  f"head_dim {c.head_dim}")
            if ins.k:                   # an empty table row is not read, wherever it is
                self._dram(addr + st.pos * 2 * ins.k, 2 * ins.k)
            self._vspan(ins.src, rows, ins.n * ins.k * wide_bytes)
            self._vspan(ins.dst, rows, ins.n * ins.k * wide_bytes)
        elif op == Op.ACTMUL:
            if ins.k > ACTMUL_SEGMENTS:
                raise EngineFault(ErrorCode.PROGRAM, f"ACTMUL of {ins.k} segments > "
                                  f"{ACTMUL_SEGMENTS}")
            self._dram(addr, ACT_PARAM_BYTES * max(ins.k, 1))
            self._vspan(ins.src, rows, actmul_source_bytes(ins))
            self._vspan(ins.dst, rows, ins.n * wide_bytes)

    def _unit(self, ins: Instruction, st: ProgramFlow, image_base: int) -> None:
        """Run a unit instruction that passed :meth:`_check_operands`."""
        op = ins.opcode
        addr = block_address(ins, image_base, st.layer, st.lstride)
        rows = ins.rows
        if op == Op.EMBED:
            stride = embed_row_stride(ins.n, self.config.mem_beat_bytes)
            table = [self._dram(addr + token * stride, 4 * ins.n).view("<i4")
                     for token in self._embed_rows(ins, st)]
            self._vstore(ins.dst, np.stack(table), np.int32)
        elif op == Op.RMSNORM:
            head = self._dram(addr, NORM_PARAM_BYTES).view("<u4")
            if head[1] > nx.GAMMA_SHIFT_MAX:
                raise EngineFault(ErrorCode.PROGRAM, f"RMSNORM gamma_shift {int(head[1])} > "
                                  f"{nx.GAMMA_SHIFT_MAX}")
            gamma = self._dram(addr + NORM_PARAM_BYTES, 2 * ins.n).view("<i2")
            # k ≥ 2: each row is k segments of n (heads), each normalised on its own
            segments = max(ins.k, 1)
            x = self._vload(ins.src, rows, segments * ins.n, np.int32).reshape(rows, segments, ins.n)
            bits, dtype = (16, np.int16) if ins.wide else (8, np.int8)
            y = nx.rmsnorm(x, gamma, int(head[1]), int(head[0]), bits)
            self._vstore(ins.dst, y.reshape(rows, segments * ins.n), dtype)
        elif op == Op.MATMUL:
            self._matmul(ins, addr)
        elif op == Op.ROPE:
            if not ins.k:
                return                  # nothing to rotate (and no table read)
            table = self._dram(addr + st.pos * 2 * ins.k, 2 * ins.k).view("<i2").reshape(-1, 2)
            bits, dtype = (16, np.int16) if ins.wide else (8, np.int8)
            x = self._vload(ins.src, rows, ins.n * ins.k, dtype).reshape(rows, ins.n, ins.k)
            y = nx.rope(x, table[:, 0], table[:, 1], bits)
            self._vstore(ins.dst, y.reshape(rows, -1), dtype)
        elif op == Op.KVAPPEND:
            slot = self._check_kv(ins, st.layer, ins.n)
            positions = self._kv_positions(st)
            kv = self._vload(ins.src, rows, 2 * ins.n * ins.k, np.int16 if ins.wide else np.int8)
            kv = nx.kv_entry(kv, self.config.kv_bits, ins.wide).reshape(rows, 2, ins.n, ins.k)
            for r, position in enumerate(positions):
                self.kv_k[slot:slot + ins.n, position, :ins.k] = kv[r, 0]
                self.kv_v[slot:slot + ins.n, position, :ins.k] = kv[r, 1]
        elif op == Op.ATTN:
            self._attention(ins, st, addr)
        elif op == Op.ACTMUL:
            bits, dtype = (16, np.int16) if ins.wide else (8, np.int8)
            if ins.ungated:             # an ungated MLP: the gate alone, up taken as 1
                gate = self._vload(ins.src, rows, ins.n, np.int16 if ins.in16 else np.int8)
                up = np.ones_like(gate)
            else:               # [gate | up], int8 or (IN16) int16
                gu = self._vload(ins.src, rows, 2 * ins.n, np.int16 if ins.in16 else np.int8)
                gate, up = gu[:, :ins.n], gu[:, ins.n:]
            # k blocks, one per channel segment: channel c takes the last segment whose
            # first channel (segment 0's: 0) is at most c
            blocks = self._dram(addr, ACT_PARAM_BYTES * max(ins.k, 1)).reshape(-1, ACT_PARAM_BYTES)
            heads = blocks[:, :8].copy().view("<u4")
            firsts = np.where(np.arange(len(blocks)) == 0, 0, heads[:, 1] & 0xFFFF)
            exp_max = int(heads[0, 1] >> 16) & nx.ROW_EXP_MAX
            # (the last True of each channel's row of firsts ≤ c; segment 0 always holds)
            starts_by = firsts[None, :] <= np.arange(ins.n)[:, None]
            segment = len(blocks) - 1 - np.argmax(starts_by[:, ::-1], axis=1)

            def act(extra):
                y = np.zeros(gate.shape, np.int64)
                for s, block in enumerate(blocks):
                    cols = segment == s
                    mult, shift = int(heads[s, 0]) & 0xFFFF, (int(heads[s, 0]) >> 16) & 0x3F
                    lut = block[16:].copy().view("<i2")
                    gated_act = nx.act_mul_wide if ins.in16 else nx.act_mul
                    y[:, cols] = gated_act(gate[:, cols], up[:, cols], lut, mult, shift, bits, extra)
                return y
            if ins.rowexp:      # each row measured at the coarsest exponent E first
                exp = nx.act_row_exponent(act(exp_max), exp_max, bits)
                self._vstore(ins.dst, act(exp[:, None]), dtype)
                if ins.n:
                    self.row_exp[:rows] = exp
            else:
                self._vstore(ins.dst, act(0), dtype)
        elif op == Op.NOP:
            pass
        else:  # pragma: no cover - decode() admits only the opcodes handled above
            raise EngineFault(ErrorCode.ILLEGAL_INSTRUCTION, f"unhandled opcode {op.name}")

    def _matmul(self, ins: Instruction, addr: int) -> None:
        c = self.config
        key = (addr, ins.n, ins.k, ins.bias, ins.blocks)
        if key not in self._weights:
            npad = padded(ins.n, c.lanes)
            area = weight_area_bytes(ins.n, ins.k, c.lanes, c.reduce, ins.blocks)
            tiles = self._dram(addr, area)
            w = untile_weights(tiles, ins.n, ins.k, c.lanes, c.reduce, ins.blocks).astype(np.int64)
            if ins.blocks:
                # each weight times its block multiplier: |m·w| < 2^23, so an int8 (or digit)
                # row's float64 dot product stays below 2^46, exact (numerics.block_matmul)
                m = untile_scales(tiles, ins.n, ins.k, c.lanes, c.reduce)
                w = w * np.repeat(m, c.reduce, axis=1)[:, :ins.k]
            record_bytes = requant_record_bytes(c.lanes, ins.bias) * (npad // c.lanes)
            mult, shift, bias = unpack_requant_records(self._dram(addr + area, record_bytes),
                                                       ins.n, c.lanes, ins.bias)
            self._weights[key] = (w.astype(np.float64).T, mult, shift, bias, area + record_bytes)
        wt, mult, shift, bias, _ = self._weights[key]
        x = self._vload(ins.src, ins.rows, ins.k, np.int16 if ins.wide else np.int8)
        if ins.blocks:
            # int16 rows as the matrix unit's two digit rows, so each product stays exact
            digits = nx.wide_digits(x) if ins.wide else (np.zeros_like(x, np.int64), x)
            hi, lo = (np.rint(d.astype(np.float64) @ wt).astype(np.int64) for d in digits)
            acc = nx.block_round(256 * hi + lo)
        else:
            # float64 BLAS is exact: |int16 · int8| sums over k < 2^16 stay below 2^38 < 2^53.
            acc = np.rint(x.astype(np.float64) @ wt).astype(np.int64)
        acc = nx.add_bias(acc, bias)
        if ins.rowexp:
            shift = nx.row_shift(shift[None, :], self.row_exp[:ins.rows, None])
        mode = ins.mode
        if mode == MatmulMode.INT8 and ins.out16:
            self._vstore(ins.dst, nx.requant(acc, mult, shift, 16), np.int16)
        elif mode == MatmulMode.INT8:
            self._vstore(ins.dst, nx.requant(acc, mult, shift), np.int8)
        elif mode == MatmulMode.RESADD:
            x_res = self._vload(ins.dst, ins.rows, ins.n, np.int32)
            self._vstore(ins.dst, nx.residual_add(x_res, acc, mult, shift), np.int32)
        elif mode == MatmulMode.INT32:
            self._vstore(ins.dst, nx.requant(acc, mult, shift, nx.RES_BITS), np.int32)
        else:  # LOGITS
            self.logit_rows = nx.requant(acc, mult, shift, nx.LOGIT_BITS).astype(np.int16)
            self.logits = self.logit_rows[0]

    def _attention(self, ins: Instruction, st: ProgramFlow, addr: int) -> None:
        self._check_kv(ins, st.layer, None)     # k only: the KV-head count is in the block
        self._kv_positions(st)
        head = self._dram(addr, ATTN_PARAM_BYTES).view("<u4")
        mult, shift, kv_heads = int(head[0]) & 0xFFFF, (int(head[0]) >> 16) & 0x3F, int(head[1])
        if kv_heads < 1 or ins.n % kv_heads:
            raise EngineFault(ErrorCode.PROGRAM, f"ATTN with {ins.n} heads over {kv_heads} KV heads")
        slot = self._check_kv(ins, st.layer, kv_heads)
        group, rows = ins.n // kv_heads, ins.rows
        q = self._vload(ins.src, rows, ins.n * ins.k, np.int16 if ins.in16 else np.int8).reshape(rows, ins.n, ins.k)
        out = np.empty((rows, ins.n, ins.k), dtype=np.int64)
        bits, dtype = (16, np.int16) if ins.wide else (8, np.int8)
        for r in range(rows):
            # a tree row sees the committed context and its own path (docs/isa.md §9.2)
            seen = self.tree.attended(r) if st.tree_forward else slice(0, st.pos + 1)
            for hd in range(ins.n):
                kvh = hd // group
                out[r, hd] = nx.attention(q[r, hd], self.kv_k[slot + kvh, seen, :ins.k],
                                          self.kv_v[slot + kvh, seen, :ins.k], mult, shift, bits, ins.in16,
                                          self.config.kv_bits)
        self._vstore(ins.dst, out.reshape(rows, -1), dtype)

    def sample(self, n: int, header: dict, index: int, flow: ProgramFlow | None = None) -> list[DraftedToken]:
        """The records of ``SAMPLE n`` over the logit buffer (``logit_rows``): one drafted
        token (``index``: N_DRAFTED), or in a tree request (``tree`` set, ``flow`` its
        controller registers) the next level's nodes. The reference the sampler's RTL
        tests use."""
        flow = flow if flow is not None else ProgramFlow([0], 0, index + 1)
        flow.n_drafted = index
        return self._sample(Instruction(Op.SAMPLE, n=n), header, index, flow)

    def _sample(self, ins: Instruction, h: dict, index: int, st: ProgramFlow) -> list[DraftedToken]:
        """The records of one SAMPLE: one drafted token, or a tree's next level."""
        held = 0 if self.logits is None else self.logits.shape[0]
        if not held or ins.n != held:      # a LOGITS matmul of n = 0 leaves it empty too
            raise EngineFault(ErrorCode.PROGRAM, f"SAMPLE over {ins.n} logits, but the logit "
                              f"buffer holds {held}")
        k = min(h["topk"], ins.n)
        t_mult, t_shift = (h["t_mult"], h["t_shift"]) if h["t_mult"] else (nx.T1_MULT, nx.T1_SHIFT)
        sources = []
        for logits in self.logit_rows:
            top = nx.topk_select(logits, k)
            sources.append(SampledRow([int(t) for t in top],
                                      [int(p) for p in nx.sampler_probs(logits[top], t_mult, t_shift)]))

        def draw(row: SampledRow, counter: int) -> int:
            r24 = nx.rng32(h["seed"], h["counter"] + counter) >> (32 - nx.PROB_BITS)
            return nx.sample_index(row.probs, r24)

        if self.tree is None:
            j = draw(sources[0], index) if h["sample"] else 0
            row = sources[0]
            return [DraftedToken(row.ids[j], row.probs[j], row.ids, row.probs)]
        tree, draws = self.tree, None
        if not st.samples_now:
            return [DraftedToken(0, 0, [], [])]   # the controller faults it (seq.drafted)
        if h["sample"]:
            first = tree.level * tree.width          # the new level's first record index
            # each row draws from its own source row; from row 0 when the buffer holds one
            # (the root's, or a tree forward that computed no logits of its own)
            draws = [draw(sources[r if len(sources) > 1 else 0], first + r) for r in range(tree.width)]
        try:
            return tree.expand(sources, draws)
        except ValueError as exc:
            raise EngineFault(ErrorCode.PROGRAM, f"SAMPLE: {exc}") from None

    # -- memories ---------------------------------------------------------------------
    def _dram(self, addr: int, n: int) -> np.ndarray:
        try:
            return self.memory.view(addr, n)
        except MemoryError_ as exc:
            raise EngineFault(ErrorCode.BAD_ADDRESS, str(exc)) from None

    def _vspan(self, line: int, rows: int, row_bytes: int) -> tuple[int, int]:
        # in a tree forward, rows lie the request's row pitch apart (docs/isa.md §9.2)
        line_bytes = self.config.vmem_line_bytes
        stride = self._pitch if self._pitch and rows > 1 else padded(row_bytes, line_bytes)
        start = line * line_bytes
        end = start + (rows - 1) * stride + row_bytes
        if end > self.config.vmem_bytes:
            raise EngineFault(ErrorCode.BAD_ADDRESS, f"VMEM access [0x{start:x}, 0x{end:x}) "
                              f"outside the {self.config.vmem_bytes}-byte VMEM")
        return start, stride

    def _vload(self, line: int, rows: int, n: int, dtype) -> np.ndarray:
        """``rows`` rows of ``n`` elements; row r starts at the line after row r-1 ends."""
        row_bytes = n * np.dtype(dtype).itemsize
        start, stride = self._vspan(line, rows, row_bytes)
        if rows == 1:
            return self.vmem[start:start + row_bytes].view(dtype).astype(np.int64)[None, :]
        return np.stack([self.vmem[start + r * stride: start + r * stride + row_bytes].view(dtype)
                         for r in range(rows)]).astype(np.int64)

    def _vstore(self, line: int, values: np.ndarray, dtype) -> None:
        values = np.asarray(values)
        rows, n = values.shape
        row_bytes = n * np.dtype(dtype).itemsize
        start, stride = self._vspan(line, rows, row_bytes)
        for r in range(rows):
            self.vmem[start + r * stride: start + r * stride + row_bytes] = \
                values[r].astype(dtype).view(np.uint8)

    def set_row_pitch(self, lines: int) -> None:
        """The VMEM row pitch of the instructions that follow (a tree forward's, docs/isa.md
        §9.2); 0: each operand's own stride."""
        self._pitch = self.config.vmem_line_bytes * lines or None

    def _embed_rows(self, ins: Instruction, st: ProgramFlow) -> list[int]:
        """The table row of each of EMBED's rows: the row's token, or with ``POSITION`` the
        position (a tree level's rows share it)."""
        tokens = self._row_tokens(st)
        return [st.pos] * len(tokens) if ins.position else tokens

    def _row_tokens(self, st: ProgramFlow) -> list[int]:
        """EMBED's tokens: the forward's TOKEN, or the nodes of the tree level it feeds."""
        return self.tree.tokens if st.tree_forward else [st.token]

    def _kv_positions(self, st: ProgramFlow) -> list[int]:
        """The KV positions KVAPPEND writes (one per row): ``POS``, or the level's storage
        (docs/isa.md §9.2); KV_OVERFLOW past the buffer before anything is written."""
        if not st.tree_forward:
            self._check_pos(st.pos)
            return [st.pos]
        positions = [self.tree.storage(st.tree_level, r) for r in range(self.tree.width)]
        self._check_pos(positions[-1])
        return positions

    def _tree_timing(self, ins: Instruction, st: ProgramFlow, h: dict):
        """What the cycle model needs of a tree forward or a tree SAMPLE (None otherwise)."""
        if self.tree is None:
            return None
        sources = self.logit_rows.shape[0] if self.logit_rows is not None else 1
        return TreeTiming(self.tree.width, st.tree_level, st.tree_base,
                          self.config.vmem_line_bytes * h["row_pitch"],
                          sources, bool(h["sample"]))

    def _check_pos(self, pos: int) -> None:
        if pos >= self.config.kv_positions:
            raise EngineFault(ErrorCode.KV_OVERFLOW, f"position {pos} ≥ KV capacity "
                              f"{self.config.kv_positions}")

    def _check_kv(self, ins: Instruction, layer: int, kv_heads: int | None) -> int:
        """The first KV slot of ``layer`` with ``kv_heads`` KV heads, ``kv_slot_base +
        layer · kv_heads`` (docs/isa.md §1.4); PROGRAM when its slots (``kv_slot_base +
        (layer + 1) · kv_heads > kv_slots``) or ``k`` lie beyond the KV buffer.
        ``kv_heads=None`` checks ``k`` only (ATTN before it reads its KV-head count)."""
        c, base = self.config, self.kv_slot_base
        over = kv_heads is not None and base + (layer + 1) * kv_heads > c.kv_slots
        if over or ins.k > c.head_dim:
            at = f" from slot {base}" if base else ""
            raise EngineFault(ErrorCode.PROGRAM, f"{ins.opcode.name} at layer {layer} with "
                              f"{kv_heads or 0} KV heads × {ins.k}{at} exceeds the KV buffer "
                              f"({c.kv_slots} slots × head_dim {c.head_dim})")
        return base + layer * (kv_heads or 0)

    def _invalidate(self, addr: int, nbytes: int) -> None:
        for key in [key for key, v in self._weights.items()
                    if key[0] < addr + nbytes and addr < key[0] + v[-1]]:
            del self._weights[key]

    def _write_record(self, result_addr: int, index: int, token: DraftedToken) -> None:
        """Make a drafted token durable at once; the header and check word come at the end,
        so a half-written result never looks complete."""
        words = np.array(token.record(self.config.topk_max), dtype="<u4").tobytes()
        try:
            self.memory.write(result_addr + 4 * RESULT_HEADER_WORDS + index * len(words), words)
        except MemoryError_:
            raise EngineFault(ErrorCode.BAD_ADDRESS, "result buffer outside device memory") from None

    def _write_result(self, result_addr: int, result: DraftResult) -> None:
        try:
            self.memory.write(result_addr, result.pack(self.config.topk_max))
        except MemoryError_:
            pass  # the result buffer itself is out of range; the ERROR register still says so
