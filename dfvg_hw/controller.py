"""Controller: runs the host's commands and executes the loaded program, one instruction
at a time, against the functional model's semantics (``sim/functional.py``).

Host commands (from the register file, executed in the order soft reset, load program,
start; several may arrive in one ``CONTROL`` write):

* **LOAD_PROGRAM** copies ``PROG_LEN`` instructions from ``PROG_BASE`` into IMEM
  (``PROGRAM`` if the program is longer than IMEM, ``BAD_ADDRESS`` if it is not in device
  memory; either failure clears ``PROGRAM_LOADED`` and completes with the error).
* **START** runs the request in the ping or pong buffer: read and check the request
  header (``BAD_REQUEST``), scan the input tokens (``token < vocab_max``), execute from
  PC 0 until HALT or a fault, then write the result descriptor (header, records, check
  word) and complete: ``DONE`` (and ``ERROR``) in STATUS, ERROR/ERROR_PC, LAST_SEQ,
  CYCLES, the completion interrupt.
* **SOFT_RESET** clears the status and counter registers and ``PROGRAM_LOADED``, VMEM, the
  KV cache and the logit buffer.

``STATUS.BUSY`` is up from the moment a command arrives until it is done (soft reset and
program load take time too), and every busy cycle of a request is also counted against
the unit it is spent in (``OP_CYCLES``: the instruction's opcode, or the request's own
overhead).

Execution: fetch (IMEM is a synchronous memory), decode (:class:`InstructionDecoder`;
an illegal word faults ``ILLEGAL_INSTRUCTION`` when fetched), then either retire a control
instruction into the :class:`ProgramFlow` at once or run a unit instruction and retire it
when it is done. ``pc`` past the loaded program faults ``PROGRAM``; running through an
instruction budget of ``(n_in + n_draft + 1) · PROG_LEN · 256`` faults ``WATCHDOG``.
``CONTROL.ABORT`` stops a running request at its next fetch with ``ABORTED``, the result
written as for any fault (drafted tokens kept); an ABORT while no request runs is
ignored, and one cannot interrupt a unit that is waiting on memory (soft reset can).

Unit instructions: ``EMBED``, ``SAMPLE`` and ``NOP`` here; ``MATMUL`` through
:class:`~dfvg_hw.matmul_sequencer.MatmulSequencer` (every preset geometry; for one it
does not support, see ``MatmulSequencer.supports``, a MATMUL stops the request with
``PROGRAM``); ``RMSNORM``, ``ROPE``, ``KVAPPEND``/``ATTN`` and ``ACTMUL`` through the
sequencers of :func:`unit_sequencers`. All of them share the
:class:`~dfvg_hw.op_port.OpSequencerSignature` (the MATMUL sequencer adds the logit
buffer's write side).

The result buffer is assembled on chip (records as SAMPLE produces them, the header at
the end) and written in one burst from the result address, because records are not
aligned to the bus width.
"""

from __future__ import annotations

from amaranth import Cat, Module, Mux, ResetInserter, Signal, unsigned
from amaranth.lib import data, stream, wiring
from amaranth.lib.memory import Memory
from amaranth.lib.wiring import In, Out

from dfvg_hw.spec.config import EngineConfig, VMEM_LINE_BYTES
from dfvg_hw.decoder import InstructionDecoder
from dfvg_hw.spec.descriptors import (MAX_DRAFT, REQUEST_HEADER_WORDS, RESULT_CHECK_SALT,
                                 RESULT_HEADER_WORDS, ErrorCode, RequestFlag, record_words)
from dfvg_hw.spec.isa import INSTRUCTION_BYTES, Op
from dfvg_hw.matmul_sequencer import MatmulSequencer
from dfvg_hw.memory_port import MemoryCommand, MemoryPortError, ReadBeat
from dfvg_hw.register_file import EngineControlSignature, EngineStatusSignature
from dfvg_hw.spec.regmap import OP_CYCLE_BUCKETS
from dfvg_hw.sample_sequencer import SampleSequencer
from dfvg_hw.program_flow import ProgramFlow
from dfvg_hw.vmem import Gearbox, VectorMemory

__all__ = ["Controller", "MemoryClientSignature"]


class MemoryClientSignature(wiring.Signature):
    """The controller's side of the :class:`~dfvg_hw.memory_port.MemoryPort` (members named
    as the port's, directions flipped).

    Members
    -------
    read_cmd : Out(stream.Signature(MemoryCommand(config)))
    read_data : In(stream.Signature(ReadBeat(data_width)))
    write_cmd : Out(stream.Signature(MemoryCommand(config)))
    write_data : Out(stream.Signature(unsigned(data_width)))
    read_idle : In(1)
    write_idle : In(1)
    error : In(MemoryPortError())
    clear_error : Out(1)
    """

    def __init__(self, config: EngineConfig, data_width: int):
        super().__init__({
            "read_cmd": Out(stream.Signature(MemoryCommand(config))),
            "read_data": In(stream.Signature(ReadBeat(data_width))),
            "write_cmd": Out(stream.Signature(MemoryCommand(config))),
            "write_data": Out(stream.Signature(unsigned(data_width))),
            "read_idle": In(1),
            "write_idle": In(1),
            "error": In(MemoryPortError()),
            "clear_error": Out(1),
        })


class Controller(wiring.Component):
    """The draft engine's controller with IMEM, VMEM, the decoder, the sequencer and the
    logit buffer/sampler.

    Parameters
    ----------
    config : EngineConfig
    data_width : int
        Device-memory bus width in bits (the memory port's), a multiple of 128.

    Members
    -------
    ctrl : In(EngineControlSignature())
        Commands and base addresses from the register file.
    status : Out(EngineStatusSignature())
        STATUS, ERROR, ERROR_PC, LAST_SEQ, the cycle counters and the completion pulse.
    mem : Out(MemoryClientSignature(config, data_width))
        Device memory through the memory port.
    """

    def __init__(self, config: EngineConfig, data_width: int = 128):
        if data_width not in (128, 256, 512):
            raise ValueError(f"data_width must be 128, 256 or 512 bits, got {data_width}")
        self.config = config
        self.data_width = data_width
        self.record_words = record_words(config.topk_max)
        self.result_words = RESULT_HEADER_WORDS + MAX_DRAFT * self.record_words
        super().__init__(wiring.Signature({
            "ctrl": In(EngineControlSignature()),
            "status": Out(EngineStatusSignature()),
            "mem": Out(MemoryClientSignature(config, data_width)),
        }))

    def elaborate(self, platform):
        m = Module()
        c, DW = self.config, self.data_width
        beat_bytes, beat_words = DW // 8, DW // 32
        ctrl, st, mem = self.ctrl, self.status, self.mem

        imem = m.submodules.imem = Memory(shape=unsigned(128), depth=c.imem_words, init=[])
        imem_w, imem_r = imem.write_port(), imem.read_port()
        dec = m.submodules.decoder = InstructionDecoder()
        seq = m.submodules.sequencer = ProgramFlow()
        vmem = m.submodules.vmem = VectorMemory(c)
        samp = m.submodules.sample_unit = SampleSequencer(c)
        # EMBED's row, beats cut into VMEM lines. A row that ends inside a beat leaves that
        # beat's other lines behind: the gearbox is emptied before each EMBED reads.
        to_lines = Gearbox(beat_bytes, VMEM_LINE_BYTES)
        flush_lines = Signal()
        m.submodules.beats_to_lines = ResetInserter({"sync": flush_lines})(to_lines)
        result = m.submodules.result_buffer = Memory(shape=unsigned(32), depth=self.result_words,
                                                     init=[])
        res_w, res_r = result.write_port(), result.read_port()
        # unit-instruction sequencers with the common OpSequencerSignature (op_port.py);
        # each is reset (ResetInserter) when a fault stops the request under it. MATMUL's
        # also writes the logit buffer (wired in its RUN state).
        sequencers = unit_sequencers()
        mm = None
        if MatmulSequencer.supports(c, DW):
            sequencers.insert(0, ((Op.MATMUL,), "matmul", MatmulSequencer))
        op_units = []
        for opcodes, name, factory in sequencers:
            unit, cancel = factory(c, DW), Signal(name=f"{name}_cancel")
            m.submodules[name] = ResetInserter({"sync": cancel})(unit)
            m.d.comb += [unit.peek_data.eq(vmem.peek_data), unit.vmem_error.eq(vmem.error),
                         unit.vmem_wr_done.eq(vmem.wr_done)]
            op_units.append((opcodes, name.upper(), unit, cancel))
            if name == "matmul":
                mm = unit
        self.units = {name.lower(): unit for _, name, unit, _ in op_units}   # for co-simulation
        kv = self.units.get("kv")             # its `clear` zeroes the KV cache on soft reset

        # -- host commands arrive as pulses; keep them until their turn ----------------------
        cmd = ctrl.command
        want_reset, want_load, want_start, start_buf = Signal(), Signal(), Signal(), Signal()
        want_abort = Signal()                # honoured at the next FETCH of a running request
        with m.If(cmd.soft_reset):
            m.d.sync += want_reset.eq(1)
        with m.If(cmd.load_program):
            m.d.sync += want_load.eq(1)
        with m.If(cmd.start):
            m.d.sync += [want_start.eq(1), start_buf.eq(cmd.buf)]
        with m.If(cmd.abort):
            m.d.sync += want_abort.eq(1)

        # -- request state -----------------------------------------------------------------
        program_len = Signal(range(c.imem_words + 1))
        header = Signal(data.ArrayLayout(unsigned(32), REQUEST_HEADER_WORDS))
        req_base, res_base = Signal(64), Signal(64)
        n_in, n_draft, topk = header[3], header[4], header[5]
        code = Signal(8)                     # the request's ErrorCode
        error_pc = Signal(16)
        started = Signal()                   # the sequencer holds this request's state
        cycles = Signal(64)
        result_cycles = Signal(64)           # the count the result reports: START to FINISH
        budget = Signal(48)
        count = Signal(32)                   # beats / words / tokens of the current step
        n_records, record_sum, first_k = Signal(range(MAX_DRAFT + 1)), Signal(32), Signal(8)
        token = Signal(16)                   # the current forward's token (EMBED)
        ins = dec.fields
        busy = Signal()
        # STATUS.BUSY: a request runs, or a command is pending or in progress (docs/registers.md)
        m.d.comb += st.cycles.eq(cycles)
        with m.If(busy):
            m.d.sync += cycles.eq(cycles + 1)

        m.d.comb += [imem_r.addr.eq(seq.pc), dec.word.eq(imem_r.data)]
        mem_failed = mem.error.as_value().any()

        def fault(error: ErrorCode):
            m.d.sync += [code.eq(error), error_pc.eq(Mux(started, seq.pc, 0))]
            m.next = "FINISH"

        def retire():
            """Hand the decoded instruction to the sequencer (always ready while running)."""
            m.d.comb += [seq.retire.valid.eq(1),
                         seq.retire.payload.opcode.eq(ins.opcode),
                         seq.retire.payload.flags.eq(ins.flags),
                         seq.retire.payload.n.eq(ins.n),
                         seq.retire.payload.addr.eq(ins.addr),
                         seq.retire.payload.token.eq(token)]

        def read(addr, length):
            m.d.comb += [mem.read_cmd.valid.eq(1), mem.read_cmd.payload.addr.eq(addr),
                         mem.read_cmd.payload.length.eq(length)]

        with m.FSM(name="phase") as phase:
            # -- idle: take the pending commands in order --------------------------------------
            with m.State("IDLE"):
                m.d.sync += want_abort.eq(0)    # nothing runs: an ABORT has nothing to stop
                with m.If(want_reset):
                    m.d.sync += [want_reset.eq(0), count.eq(0)]
                    m.d.sync += [st.program_loaded.eq(0), st.done.eq(0), st.error.eq(0),
                                 st.error_code.eq(0), st.error_pc.eq(0), st.last_seq.eq(0),
                                 st.busy_cycles.eq(0), cycles.eq(0), st.buf.eq(0)]
                    m.d.comb += [samp.clear.eq(1), mem.clear_error.eq(1)]
                    m.next = "CLEAR_VMEM"
                with m.Elif(want_load):
                    m.d.sync += [want_load.eq(0), st.program_loaded.eq(0), count.eq(0),
                                 code.eq(ErrorCode.OK), error_pc.eq(0), started.eq(0)]
                    m.d.comb += mem.clear_error.eq(1)
                    with m.If(ctrl.prog_len > c.imem_words):
                        m.d.sync += code.eq(ErrorCode.PROGRAM)
                        m.next = "REPORT"
                    with m.Else():
                        m.next = "LOAD_CMD"
                with m.Elif(want_start):
                    m.d.sync += [want_start.eq(0), st.buf.eq(start_buf), st.done.eq(0),
                                 st.error.eq(0), cycles.eq(0), started.eq(0),
                                 code.eq(ErrorCode.OK), error_pc.eq(0), n_records.eq(0),
                                 record_sum.eq(0), first_k.eq(0), count.eq(0),
                                 req_base.eq(ctrl.request_base[start_buf]),
                                 res_base.eq(ctrl.result_base[start_buf]),
                                 header.eq(0)]
                    m.d.comb += [mem.clear_error.eq(1), samp.clear.eq(1), vmem.clear_error.eq(1)]
                    with m.If(~st.program_loaded):
                        # as SimDevice: completes with PROGRAM, writes no result
                        m.d.sync += code.eq(ErrorCode.PROGRAM)
                        m.next = "REPORT"
                    with m.Else():
                        m.d.sync += busy.eq(1)
                        m.next = "HEADER_CMD"

            # -- soft reset: zero VMEM ---------------------------------------------------------
            with m.State("CLEAR_VMEM"):
                m.d.comb += [vmem.wr_cmd.valid.eq(1), vmem.wr_cmd.payload.line.eq(0),
                             vmem.wr_cmd.payload.rows.eq(1),
                             vmem.wr_cmd.payload.row_bytes.eq(c.vmem_bytes)]
                with m.If(vmem.wr_cmd.ready):
                    m.next = "CLEAR_VMEM_LINES"
            with m.State("CLEAR_VMEM_LINES"):
                m.d.comb += vmem.wr.valid.eq(1)          # data 0
                with m.If(vmem.wr_done):
                    m.next = "CLEAR_KV"
            with m.State("CLEAR_KV"):
                # the functional model's soft reset zeroes the KV cache too
                if kv is None:
                    m.next = "IDLE"
                else:
                    m.d.comb += kv.clear.eq(1)
                    m.next = "CLEAR_KV_WAIT"
            with m.State("CLEAR_KV_WAIT"):
                with m.If(kv is None or ~kv.clearing):
                    m.next = "IDLE"

            # -- LOAD_PROGRAM --------------------------------------------------------------------
            with m.State("LOAD_CMD"):
                read(ctrl.prog_base, ctrl.prog_len * INSTRUCTION_BYTES)
                with m.If(mem.read_cmd.ready):
                    m.d.sync += program_len.eq(ctrl.prog_len)
                    m.next = "LOAD_WAIT"
            with m.State("LOAD_WAIT"):
                # the port refuses a bad range at once; otherwise the beats follow
                with m.If(mem_failed):
                    m.d.sync += code.eq(ErrorCode.BAD_ADDRESS)
                    m.next = "REPORT"
                with m.Elif(program_len == 0):
                    m.d.sync += [st.program_loaded.eq(1), st.error.eq(0), st.error_code.eq(0)]
                    m.next = "IDLE"
                with m.Else():
                    m.next = "LOAD_DATA"
            with m.State("LOAD_DATA"):
                # one beat holds beat_bytes / 16 instructions; IMEM takes one per cycle
                sub = Signal(range(max(2, beat_bytes // INSTRUCTION_BYTES)))
                last_sub = (sub == beat_bytes // INSTRUCTION_BYTES - 1) | (count + 1 == program_len)
                words = mem.read_data.payload.data
                m.d.comb += [
                    imem_w.en.eq(mem.read_data.valid), imem_w.addr.eq(count),
                    imem_w.data.eq(words.word_select(sub, 128)),
                    mem.read_data.ready.eq(last_sub),
                ]
                with m.If(mem.read_data.valid):
                    m.d.sync += [count.eq(count + 1), sub.eq(Mux(last_sub, 0, sub + 1))]
                    with m.If(count + 1 == program_len):
                        with m.If(mem_failed):
                            m.d.sync += code.eq(ErrorCode.BAD_ADDRESS)
                            m.next = "REPORT"
                        with m.Else():
                            m.d.sync += [st.program_loaded.eq(1), st.error.eq(0),
                                         st.error_code.eq(0)]
                            m.next = "IDLE"

            # -- START: header, token scan ---------------------------------------------------------
            with m.State("HEADER_CMD"):
                read(req_base, 4 * REQUEST_HEADER_WORDS)
                with m.If(mem.read_cmd.ready):
                    m.next = "HEADER_DATA"
            with m.State("HEADER_DATA"):
                m.d.comb += mem.read_data.ready.eq(1)
                with m.If(mem_failed):
                    fault(ErrorCode.BAD_ADDRESS)
                with m.Elif(mem.read_data.valid):
                    beats = max(1, 4 * REQUEST_HEADER_WORDS // beat_bytes)
                    with m.Switch(count):
                        for b in range(beats):
                            with m.Case(b):
                                lo = b * DW
                                hi = min(lo + DW, 32 * REQUEST_HEADER_WORDS)
                                m.d.sync += header.as_value()[lo:hi].eq(
                                    mem.read_data.payload.data[:hi - lo])
                    m.d.sync += count.eq(count + 1)
                    with m.If(mem.read_data.payload.last):
                        m.next = "HEADER_CHECK"
            with m.State("HEADER_CHECK"):
                reserved = Cat(*(header[w] for w in range(10, REQUEST_HEADER_WORDS))).any()
                t_mult, t_shift = header[6][:16], header[6][16:]
                bad = ((n_in == 0) | (n_draft > MAX_DRAFT) | (topk == 0) | (topk > c.topk_max)
                       | (header[1][0] & (t_mult == 0)) | (t_shift > 63)
                       | (header[1] & (0xFFFFFFFF ^ int(RequestFlag.SAMPLE))).any() | reserved)
                m.d.sync += count.eq(0)
                with m.If(bad):
                    fault(ErrorCode.BAD_REQUEST)
                with m.Else():
                    m.next = "SCAN_CMD"
            with m.State("SCAN_CMD"):
                read(req_base + 4 * REQUEST_HEADER_WORDS, n_in * 4)
                with m.If(mem.read_cmd.ready):
                    m.next = "SCAN_DATA"
            with m.State("SCAN_DATA"):
                m.d.comb += mem.read_data.ready.eq(1)
                beat = mem.read_data.payload.data
                in_range = Signal()
                m.d.comb += in_range.eq(1)
                for w in range(beat_words):
                    # words past n_in are zero (the port zeroes the tail), so they pass
                    with m.If(beat.word_select(w, 32) >= c.vocab_max):
                        m.d.comb += in_range.eq(0)
                with m.If(mem_failed):
                    fault(ErrorCode.BAD_ADDRESS)
                with m.Elif(mem.read_data.valid):
                    with m.If(~in_range):
                        m.d.sync += code.eq(ErrorCode.BAD_REQUEST)
                    with m.If(mem.read_data.payload.last):
                        m.next = "SCAN_DONE"
            with m.State("SCAN_DONE"):
                with m.If(code != ErrorCode.OK):
                    m.next = "FINISH"
                with m.Else():
                    m.d.comb += [seq.start.valid.eq(1),
                                 seq.start.payload.start_pos.eq(header[2]),
                                 seq.start.payload.n_tokens.eq(n_in),
                                 seq.start.payload.n_draft.eq(n_draft)]
                    m.d.sync += [started.eq(1),
                                 budget.eq((n_in + n_draft + 1) * program_len * 256)]
                    m.next = "FETCH"

            # -- execution ------------------------------------------------------------------------
            with m.State("FETCH"):
                # the previous instruction's retirement shows here; IMEM's read port is
                # synchronous: the word at seq.pc is valid next cycle
                with m.If(seq.fault.valid):
                    m.d.sync += [code.eq(seq.fault.code), error_pc.eq(seq.fault.pc)]
                    m.next = "FINISH"
                with m.Elif(seq.halted):
                    m.next = "FINISH"
                with m.Elif(want_abort):
                    fault(ErrorCode.ABORTED)
                with m.Elif(seq.pc >= program_len):
                    fault(ErrorCode.PROGRAM)
                with m.Elif(budget == 0):
                    fault(ErrorCode.WATCHDOG)
                with m.Else():
                    m.d.sync += budget.eq(budget - 1)
                    m.next = "DECODE"
            with m.State("DECODE"):
                control = Signal()
                m.d.comb += control.eq((ins.opcode == Op.HALT) | (ins.opcode == Op.LOOP)
                                       | (ins.opcode == Op.ENDLOOP) | (ins.opcode == Op.BRANCH)
                                       | (ins.opcode == Op.NEXT))
                with m.If(dec.illegal):
                    fault(ErrorCode.ILLEGAL_INSTRUCTION)
                with m.Elif(control | (ins.opcode == Op.NOP)):
                    retire()
                    m.next = "FETCH"
                with m.Elif(ins.opcode == Op.EMBED):
                    with m.If(ins.rows != 1):
                        fault(ErrorCode.PROGRAM)
                    with m.Else():
                        m.next = "EMBED_TOKEN"
                for opcodes, name, unit, _ in op_units:
                    with m.Elif(Cat(*(ins.opcode == op for op in opcodes)).any()):
                        with m.If(ins.rows > c.rows):
                            fault(ErrorCode.PROGRAM)
                        with m.Else():
                            m.next = f"{name}_JOB"
                with m.Elif(ins.opcode == Op.SAMPLE):
                    with m.If((samp.n_logits == 0) | (ins.n != samp.n_logits)):
                        fault(ErrorCode.PROGRAM)
                    with m.Elif(~seq.samples_now):
                        fault(ErrorCode.PROGRAM)
                    with m.Else():
                        m.next = "SAMPLE_REQ"
                with m.Else():
                    fault(ErrorCode.PROGRAM)        # a unit instruction not sequenced yet
            with m.State("RETIRE"):
                retire()
                m.next = "FETCH"

            # -- EMBED: the token's row of the table into VMEM ----------------------------------
            with m.State("EMBED_TOKEN"):
                with m.If(seq.token_is_drafted):
                    m.d.sync += token.eq(seq.drafted_token)
                    m.next = "EMBED_CMD"
                with m.Else():
                    addr = req_base + 4 * REQUEST_HEADER_WORDS + 4 * seq.in_idx
                    read(addr & ~(beat_bytes - 1), beat_bytes)
                    with m.If(mem.read_cmd.ready):
                        m.d.sync += count.eq((addr // 4) % beat_words)
                        m.next = "EMBED_TOKEN_DATA"
            with m.State("EMBED_TOKEN_DATA"):
                m.d.comb += mem.read_data.ready.eq(1)
                with m.If(mem_failed):
                    fault(ErrorCode.BAD_ADDRESS)
                with m.Elif(mem.read_data.valid):
                    m.d.sync += token.eq(mem.read_data.payload.data.word_select(count, 32))
                    m.next = "EMBED_CMD"
            with m.State("EMBED_CMD"):
                m.d.comb += flush_lines.eq(1)
                row_bytes = ins.n * 2
                m.d.comb += [vmem.wr_cmd.valid.eq(1), vmem.wr_cmd.payload.line.eq(ins.dst),
                             vmem.wr_cmd.payload.rows.eq(1), vmem.wr_cmd.payload.row_bytes.eq(row_bytes)]
                with m.If(vmem.wr_cmd.ready):
                    m.next = "EMBED_READ"
            with m.State("EMBED_READ"):
                read(ctrl.image_base + ins.addr + token * ins.n * 2, ins.n * 2)
                with m.If(vmem.error):
                    fault(ErrorCode.BAD_ADDRESS)
                with m.Elif(mem.read_cmd.ready):
                    m.next = "EMBED_DATA"
            with m.State("EMBED_DATA"):
                m.d.comb += [vmem.wr.valid.eq(to_lines.o.valid),
                             vmem.wr.payload.data.eq(to_lines.o.payload.data),
                             to_lines.o.ready.eq(vmem.wr.ready)]
                m.d.comb += [to_lines.i.valid.eq(mem.read_data.valid),
                             to_lines.i.payload.data.eq(mem.read_data.payload.data),
                             to_lines.i.payload.last.eq(mem.read_data.payload.last),
                             mem.read_data.ready.eq(to_lines.i.ready)]
                with m.If(mem_failed | vmem.error):
                    m.d.comb += vmem.cancel.eq(1)
                    fault(ErrorCode.BAD_ADDRESS)
                with m.Elif(vmem.wr_done):
                    m.next = "RETIRE"

            # -- unit instructions: their sequencers own the shared ports meanwhile --------------
            for opcodes, name, unit, cancel in op_units:
                with m.State(f"{name}_JOB"):
                    lrel = ins.flags & 1
                    job = unit.job.payload
                    m.d.comb += [unit.job.valid.eq(1),
                                 job.opcode.eq(ins.opcode), job.flags.eq(ins.flags),
                                 job.rows.eq(ins.rows), job.dst.eq(ins.dst), job.src.eq(ins.src),
                                 job.n.eq(ins.n), job.k.eq(ins.k),
                                 job.addr.eq(ctrl.image_base + ins.addr
                                             + Mux(lrel, seq.layer * seq.lstride, 0)),
                                 job.pos.eq(seq.pos), job.layer.eq(seq.layer)]
                    with m.If(unit.job.ready):
                        m.next = f"{name}_RUN"
                with m.State(f"{name}_RUN"):
                    _lend_shared_ports(m, unit, mem, vmem)
                    if unit is mm:
                        # the MATMUL sequencer also owns the logit buffer's write side
                        m.d.comb += [samp.begin.eq(mm.logits_begin), samp.begin_n.eq(mm.logits_n)]
                        wiring.connect(m, mm.logits, samp.logits)
                    with m.If(mem_failed):
                        m.d.comb += cancel.eq(1)         # a refused read brings no data
                        fault(ErrorCode.BAD_ADDRESS)
                    with m.Elif(unit.done):
                        with m.If(unit.error != ErrorCode.OK):
                            fault(unit.error)
                        with m.Else():
                            m.next = "RETIRE"

            # -- SAMPLE: the sampler over the logit buffer; the record into the result -----------
            with m.State("SAMPLE_REQ"):
                h = header
                m.d.comb += [samp.req.valid.eq(1),
                             samp.req.payload.k.eq(topk),
                             samp.req.payload.t_mult.eq(h[6][:16]),
                             samp.req.payload.t_shift.eq(h[6][16:22]),
                             samp.req.payload.sample.eq(h[1][0]),
                             samp.req.payload.seed.eq(Cat(h[7], h[8])),
                             samp.req.payload.counter.eq(h[9] + seq.n_drafted)]
                with m.If(samp.req.ready):
                    m.d.sync += count.eq(0)
                    m.next = "SAMPLE_RECORD"
            with m.State("SAMPLE_RECORD"):
                rec = samp.record.payload
                m.d.comb += [samp.record.ready.eq(1),
                             res_w.en.eq(samp.record.valid),
                             res_w.addr.eq(RESULT_HEADER_WORDS + n_records * self.record_words + count),
                             res_w.data.eq(rec.word)]
                with m.If(samp.record.valid):
                    m.d.sync += [count.eq(count + 1), record_sum.eq(record_sum + rec.word)]
                    with m.If(count == 0):
                        m.d.sync += token.eq(rec.word)          # the drafted token
                        with m.If(n_records == 0):
                            m.d.sync += first_k.eq(rec.k)
                    with m.If(rec.last):
                        m.d.sync += n_records.eq(n_records + 1)
                        m.next = "RETIRE"

            # -- the result descriptor --------------------------------------------------------------
            with m.State("FINISH"):
                m.d.comb += vmem.cancel.eq(1)
                m.d.comb += [cancel.eq(1) for *_, cancel in op_units]
                m.d.sync += [count.eq(0), result_cycles.eq(cycles), want_abort.eq(0)]
                m.next = "DRAIN"
            with m.State("DRAIN"):
                # let an abandoned read stream run out, so the next request's reads are its own
                m.d.comb += mem.read_data.ready.eq(1)
                with m.If(~mem.read_data.valid & mem.read_idle):
                    m.next = "RESULT"
            with m.State("RESULT"):
                end_pos = Mux(started, seq.pos, header[2])
                fields = [header[0], code, n_records, end_pos, result_cycles[:32], result_cycles[32:],
                          Mux(started, seq.forwards, 0), Mux(code != 0, error_pc, 0),
                          Mux(n_records != 0, first_k, 0)]
                check = Signal(32)
                total = record_sum + RESULT_CHECK_SALT
                for f in fields:
                    total = total + f
                m.d.comb += check.eq(total)
                words = fields + [0] * (RESULT_HEADER_WORDS - 1 - len(fields)) + [check]
                m.d.comb += res_w.en.eq(1)
                with m.Switch(count):
                    for i, w in enumerate(words):
                        with m.Case(i):
                            m.d.comb += [res_w.addr.eq(i), res_w.data.eq(w)]
                m.d.sync += count.eq(count + 1)
                with m.If(count == RESULT_HEADER_WORDS - 1):
                    m.d.sync += count.eq(0)
                    m.next = "RESULT_CMD"
            with m.State("RESULT_CMD"):
                total_words = RESULT_HEADER_WORDS + n_records * self.record_words
                m.d.comb += [mem.write_cmd.valid.eq(1), mem.write_cmd.payload.addr.eq(res_base),
                             mem.write_cmd.payload.length.eq(total_words * 4)]
                with m.If(mem.write_cmd.ready):
                    m.next = "RESULT_DATA"
            with m.State("RESULT_DATA"):
                # words leave the result RAM one per cycle and are packed into bus beats
                total_words = RESULT_HEADER_WORDS + n_records * self.record_words
                n_beats = (total_words + beat_words - 1) // beat_words
                pack = Signal(DW)
                fill = Signal(range(beat_words + 1))
                have = Signal()               # res_r.data holds word `count - 1`
                beat_valid = Signal()
                sent = Signal(range(self.result_words + 1))
                m.d.comb += [res_r.addr.eq(count), mem.write_data.valid.eq(beat_valid),
                             mem.write_data.payload.eq(pack)]
                with m.If(mem.write_data.valid & mem.write_data.ready):
                    m.d.sync += [beat_valid.eq(0), fill.eq(0), pack.eq(0), sent.eq(sent + 1)]
                with m.Elif(~beat_valid):
                    with m.If(have):
                        m.d.sync += [pack.word_select(fill, 32).eq(res_r.data), fill.eq(fill + 1),
                                     have.eq(0)]
                        with m.If((fill == beat_words - 1) | (count == total_words)):
                            m.d.sync += beat_valid.eq(1)
                    with m.Elif(count < total_words):
                        m.d.sync += [count.eq(count + 1), have.eq(1)]
                with m.If((sent == n_beats) & ~beat_valid):
                    m.d.sync += [sent.eq(0), fill.eq(0), have.eq(0)]
                    m.next = "RESULT_WAIT"
            with m.State("RESULT_WAIT"):
                with m.If(mem.write_idle):
                    m.next = "REPORT"
            with m.State("REPORT"):
                # STATUS/ERROR as SimDevice._finish sets them; a failed load reports here too
                m.d.sync += [busy.eq(0), st.done.eq(1), st.error.eq(code != ErrorCode.OK),
                             st.error_code.eq(code), st.error_pc.eq(Mux(code != 0, error_pc, 0)),
                             started.eq(0)]
                with m.If(busy):
                    m.d.sync += [st.last_seq.eq(header[0]), st.busy_cycles.eq(st.busy_cycles + cycles)]
                m.d.comb += st.done_pulse.eq(1)
                m.next = "IDLE"
        # -- per-unit busy counters (regmap.OP_CYCLE_BUCKETS) ------------------------------------
        # An instruction's fetch and decode cycles go to its opcode (as the cycle model's ISSUE
        # does), then every cycle until it retires; all other busy cycles are the request's.
        request_bucket = OP_CYCLE_BUCKETS.index("REQUEST")
        bucket = Signal(range(len(OP_CYCLE_BUCKETS)), init=request_bucket)
        decoded = Signal.like(bucket)
        with m.Switch(ins.opcode):
            for op in Op:
                with m.Case(op):
                    m.d.comb += decoded.eq(OP_CYCLE_BUCKETS.index(op.name))
            with m.Default():
                m.d.comb += decoded.eq(request_bucket)
        counters = st.op_cycles
        with m.If(want_start & phase.ongoing("IDLE") & ~want_reset & ~want_load):
            m.d.sync += [counters.as_value().eq(0), bucket.eq(request_bucket)]
        with m.Elif(busy):
            with m.If(phase.ongoing("DECODE")):
                m.d.sync += [bucket.eq(decoded), counters[decoded].eq(counters[decoded] + 2)]
            with m.Elif(phase.ongoing("FETCH")):
                # counted with the decode, unless the request ends here
                with m.If(seq.fault.valid | seq.halted | (seq.pc >= program_len) | (budget == 0)):
                    m.d.sync += counters[request_bucket].eq(counters[request_bucket] + 1)
            with m.Elif(phase.ongoing("FINISH")):
                m.d.sync += [bucket.eq(request_bucket),
                             counters[request_bucket].eq(counters[request_bucket] + 1)]
            with m.Else():
                m.d.sync += counters[bucket].eq(counters[bucket] + 1)
        with m.If(want_reset & phase.ongoing("IDLE")):
            m.d.sync += counters.as_value().eq(0)
        m.d.comb += st.busy.eq(busy | want_reset | want_load | want_start | ~phase.ongoing("IDLE"))
        return m


def unit_sequencers():
    """(opcodes, name, factory(config, data_width)) of every unit-instruction sequencer
    with the common :class:`~dfvg_hw.op_port.OpSequencerSignature`."""
    from dfvg_hw.actmul_sequencer import ActMulSequencer
    from dfvg_hw.kv_sequencer import KvSequencer
    from dfvg_hw.norm_sequencer import NormSequencer
    from dfvg_hw.rope_sequencer import RopeSequencer
    return [((Op.RMSNORM,), "norm", NormSequencer),
            ((Op.KVAPPEND, Op.ATTN), "kv", KvSequencer),
            ((Op.ROPE,), "rope", RopeSequencer),
            ((Op.ACTMUL,), "actmul", ActMulSequencer)]


def _lend_shared_ports(m: Module, unit, mem, vmem: VectorMemory) -> None:
    """Connect ``unit``'s memory-read and VMEM ports to the shared ones (while it runs)."""
    for source, sink in ((unit.read_cmd, mem.read_cmd), (mem.read_data, unit.read_data),
                         (unit.vmem_rd_cmd, vmem.rd_cmd), (vmem.rd, unit.vmem_rd),
                         (unit.vmem_wr_cmd, vmem.wr_cmd), (unit.vmem_wr, vmem.wr)):
        m.d.comb += [sink.valid.eq(source.valid), sink.payload.eq(source.payload),
                     source.ready.eq(sink.ready)]
    m.d.comb += [vmem.peek_addr.eq(unit.peek_addr), vmem.poke_en.eq(unit.poke_en),
                 vmem.poke_addr.eq(unit.poke_addr), vmem.poke_data.eq(unit.poke_data)]
