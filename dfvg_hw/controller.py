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
instruction budget of :func:`~dfvg_hw.spec.descriptors.watchdog_budget` (``(n_in + n_draft + 1)
· PROG_LEN · 256``) faults ``WATCHDOG``.
``CONTROL.ABORT`` stops a running request at its next fetch with ``ABORTED``, the result
written as for any fault (drafted tokens kept); an ABORT while no request runs is
ignored, and one cannot interrupt a unit that is waiting on memory (soft reset can).

Unit instructions: ``SAMPLE`` and ``NOP`` here; ``EMBED`` through
:class:`~dfvg_hw.embed_sequencer.EmbedSequencer`; ``MATMUL`` through
:class:`~dfvg_hw.matmul_sequencer.MatmulSequencer` (every preset geometry; for one it
does not support, see ``MatmulSequencer.supports``, a MATMUL stops the request with
``PROGRAM``); ``RMSNORM``, ``ROPE``, ``KVAPPEND``/``ATTN`` and ``ACTMUL`` through the
sequencers of :func:`unit_sequencers` (the KV sequencer also takes the request header's
``kv_slot_base``, the first KV slot of the request's sequence). All of them share the
:class:`~dfvg_hw.op_port.OpSequencerSignature` (the MATMUL sequencer adds the logit
buffer's write side, the EMBED sequencer the TOKEN register's inputs).

**Tree requests** (docs/isa.md §9; an engine built with ``tree_width`` ≥ 1, which it
reports in ``P_TREE_WIDTH``). After the token scan the request's compaction runs on the
KV sequencer (its ``compact`` port), charged to the request. A tree forward (the program
flow's ``tree_forward``: NEXT entered it at ``tree_pc``) runs EMBED, KVAPPEND, ATTN,
RMSNORM, ROPE and ACTMUL of ``rows`` rows as one single-row job per row, the last row
first, row ``r``'s ``src`` and ``dst`` ``r · row_pitch`` lines on (so the sequencers see
one row at a time, and a span past VMEM is refused in the first job, before anything
moves); EMBED's token is the row's node's, KVAPPEND writes at the node's storage
position, ATTN attends to the committed context (``prefix`` = ``P0``) and the row's path
(``path_len`` = TREE_LEVEL, its positions through the KV sequencer's path port); a level
whose last node lies past the KV buffer makes the first job's position overflow, so the
sequencer faults ``KV_OVERFLOW`` where the functional model does, after its earlier
checks. MATMUL takes all rows at once with the request's ``row_pitch``. The
:class:`~dfvg_hw.tree_registers.TreeRegisters` hold the level's tokens and paths; a
SAMPLE of a tree request writes the next level's records and updates them.

The parts, each its own component: the :class:`~dfvg_hw.request_front_end.RequestFrontEnd`
(request header, checks, token scan), the unit sequencers, the
:class:`~dfvg_hw.result_writer.ResultWriter` (the result buffer, assembled on chip and
written in one burst), the :class:`~dfvg_hw.tree_registers.TreeRegisters` and the
:class:`~dfvg_hw.op_cycle_counters.OpCycleCounters`. The controller itself keeps the host
commands, the program load, fetch and decode, SAMPLE, and lends the shared ports (memory
port, VMEM) to the part whose turn it is.

**The memory path.** ``mem`` is the striped memory port's engine beat (``W =
mem_ports · mem_port_bits`` bits). The MATMUL sequencer alone is lent it whole (its weight
tiles and requant records are the engine's bandwidth); every other part — the program load,
the request front end, the result writer, EMBED, RMSNORM, ROPE, the KV sequencer and ACTMUL
— reads and writes one channel's beat (``unit_width``) through the
:class:`~dfvg_hw.beat_narrower.BeatNarrower`, which costs no cycle and is a wire with one
memory port. After a fault the drain empties the wide port itself and flushes the
narrower's reads in flight.

**The MATMUL prefetch.** IMEM has a second read port that shows the word after the
current one. While a unit instruction of a chain forward runs and that word is a MATMUL,
the controller offers it to the MATMUL sequencer's ``prefetch`` port once the running
unit says ``reads_done`` (its last read command is out: ATTN, ACTMUL, a one-row RMSNORM)
and the memory port is read-idle, and lends the sequencer the wide read path from then
until that MATMUL runs (or FINISH): its first pass's weights are in flight when it
starts. Not when the next FETCH will stop the request (watchdog, abort), so a fault
there has no reads to drain. The overlapped cycles count for the running unit
(docs/isa.md, the timing section).
"""

from __future__ import annotations

from amaranth import Cat, Module, Mux, ResetInserter, Signal, unsigned
from amaranth.lib import data, stream, wiring
from amaranth.lib.memory import Memory
from amaranth.lib.wiring import In, Out

from dfvg_hw.spec import numerics as nx
from dfvg_hw.spec.config import EngineConfig
from dfvg_hw.beat_narrower import NARROW_BEAT_BITS, BeatNarrower, MemoryClientSignature
from dfvg_hw.decoder import InstructionDecoder
from dfvg_hw.spec.descriptors import REQUEST_HEADER_WORDS, ErrorCode, watchdog_budget
from dfvg_hw.spec.isa import CONTROL_OPS, INSTRUCTION_BYTES, MatmulMode, Op
from dfvg_hw.layouts import flags_view
from dfvg_hw.embed_sequencer import EmbedSequencer
from dfvg_hw.matmul_sequencer import MatmulSequencer
from dfvg_hw.op_cycle_counters import OpCycleCounters
from dfvg_hw.register_file import EngineControlSignature, EngineStatusSignature
from dfvg_hw.request_front_end import RequestFrontEnd
from dfvg_hw.result_writer import ResultWriter
from dfvg_hw.sample_sequencer import SampleSequencer
from dfvg_hw.program_flow import ProgramFlow
from dfvg_hw.tree_registers import POSITION_BITS, TreeRegisters
from dfvg_hw.vmem import VectorMemory

__all__ = ["Controller", "MemoryClientSignature"]

#: Opcodes a tree forward runs as one single-row job per row (the others take all rows).
SPLIT_OPS = (Op.EMBED, Op.RMSNORM, Op.ROPE, Op.KVAPPEND, Op.ATTN, Op.ACTMUL)
#: Opcodes whose rows are a tree's branches: 1 in a chain forward, the tree's width in a
#: tree forward (with MATMUL in LOGITS mode).
BRANCH_OPS = (Op.EMBED, Op.KVAPPEND, Op.ATTN)

class Controller(wiring.Component):
    """The draft engine's controller with IMEM, VMEM, the decoder, the program flow, the
    unit sequencers, the logit buffer/sampler, the request front end and the result writer.

    Parameters
    ----------
    config : EngineConfig
    data_width : int
        ``W``: the engine beat in bits (the striped memory port's: every channel's beat
        side by side). The MATMUL sequencer takes it whole; every other part takes
        ``D = W / mem_ports`` bits (one channel's beat, 128, 256 or 512) through the
        :class:`~dfvg_hw.beat_narrower.BeatNarrower`.
    tree_width : int, optional
        The widest tree the engine drafts (``P_TREE_WIDTH``), 0 … ``config.rows``; 0
        refuses tree requests. By default ``config.rows``.

    Members
    -------
    ctrl : In(EngineControlSignature())
        Commands and base addresses from the register file.
    status : Out(EngineStatusSignature())
        STATUS, ERROR, ERROR_PC, LAST_SEQ, the cycle counters and the completion pulse.
    mem : Out(MemoryClientSignature(config, data_width))
        Device memory through the memory port.

    Attributes
    ----------
    unit_width : int
        ``D``, the beat of the narrow path.
    narrower : BeatNarrower
    units : dict[str, wiring.Component]
        The unit-instruction sequencers by submodule name (``matmul`` where supported,
        ``norm``, ``kv``, ``rope``, ``actmul``, ``embed``); co-simulation reads the KV
        cache through ``units["kv"].kv_buffer``.
    front_end : RequestFrontEnd
    result_writer : ResultWriter
    tree_registers : TreeRegisters
    op_counters : OpCycleCounters
    """

    def __init__(self, config: EngineConfig, data_width: int = 128, tree_width: int | None = None):
        unit_width = data_width // config.mem_ports
        if unit_width not in NARROW_BEAT_BITS or unit_width * config.mem_ports != data_width:
            raise ValueError(f"data_width {data_width} is not {config.mem_ports} memory channels "
                             f"of 128, 256 or 512 bits")
        self.config = config
        self.data_width = data_width
        self.unit_width = unit_width
        self.narrower = BeatNarrower(config, data_width, unit_width)
        self.tree_width = config.rows if tree_width is None else tree_width
        super().__init__(wiring.Signature({
            "ctrl": In(EngineControlSignature()),
            "status": Out(EngineStatusSignature()),
            "mem": Out(MemoryClientSignature(config, data_width)),
        }))
        self.imem = Memory(shape=unsigned(128), depth=config.imem_words, init=[])
        # the second read port shows the next instruction (pc + 1) to the MATMUL prefetch
        self._imem_ports = self.imem.write_port(), self.imem.read_port(), self.imem.read_port()
        self.decoder = InstructionDecoder()
        self.next_decoder = InstructionDecoder()
        self.program_flow = ProgramFlow()
        self.vmem = VectorMemory(config)
        self.sample_unit = SampleSequencer(config)
        self.front_end = RequestFrontEnd(config, unit_width, self.tree_width)
        self.result_writer = ResultWriter(config, unit_width)
        self.tree_registers = TreeRegisters(config)
        self.op_counters = OpCycleCounters()
        # unit-instruction sequencers with the common OpSequencerSignature (op_port.py)
        # the table rows EMBED reads are padded to whole engine beats (image.embed_row_stride)
        embed = lambda config, width: EmbedSequencer(config, width, row_beat_bits=data_width)
        sequencers = unit_sequencers() + [((Op.EMBED,), "embed", embed)]
        self.units = {name: factory(config, unit_width) for _, name, factory in sequencers}
        if MatmulSequencer.supports(config, data_width):
            # the matrix path alone takes the whole engine beat
            self.units = {"matmul": MatmulSequencer(config, data_width), **self.units}
            sequencers.insert(0, ((Op.MATMUL,), "matmul", MatmulSequencer))
        self.unit_opcodes = {name: opcodes for opcodes, name, _ in sequencers}

    def elaborate(self, platform):
        m = Module()
        c = self.config
        beat_bytes = self.unit_width // 8
        ctrl, st, wide = self.ctrl, self.status, self.mem
        # every part but the MATMUL sequencer reads and writes through the narrower's port
        narrower = m.submodules.narrower = self.narrower
        mem = narrower.narrow
        matmul_reads = Signal()             # the MATMUL sequencer has the wide reads
        wiring.connect(m, narrower.wide.write_cmd, wiring.flipped(wide.write_cmd))
        wiring.connect(m, narrower.wide.write_data, wiring.flipped(wide.write_data))
        m.d.comb += [narrower.wide.read_idle.eq(wide.read_idle),
                     narrower.wide.write_idle.eq(wide.write_idle),
                     narrower.wide.error.eq(wide.error), wide.clear_error.eq(narrower.wide.clear_error)]
        with m.If(~matmul_reads):
            wiring.connect(m, narrower.wide.read_cmd, wiring.flipped(wide.read_cmd))
            wiring.connect(m, wiring.flipped(wide.read_data), narrower.wide.read_data)
        mm = self.units.get("matmul")
        if mm is not None:
            with m.If(matmul_reads):
                wiring.connect(m, mm.read_cmd, wiring.flipped(wide.read_cmd))
                wiring.connect(m, wiring.flipped(wide.read_data), mm.read_data)
        # the wide read path is lent to a MATMUL prefetch (from the cycle after the MATMUL
        # sequencer took it until that MATMUL runs, or the request stops)
        lent = Signal()
        with m.If(lent):
            m.d.comb += matmul_reads.eq(1)

        imem = m.submodules.imem = self.imem
        imem_w, imem_r, imem_next = self._imem_ports
        dec = m.submodules.decoder = self.decoder
        nxt_dec = m.submodules.next_decoder = self.next_decoder
        seq = m.submodules.sequencer = self.program_flow
        vmem = m.submodules.vmem = self.vmem
        samp = m.submodules.sample_unit = self.sample_unit
        front = m.submodules.request = self.front_end
        writer = m.submodules.result = self.result_writer
        counters = m.submodules.op_counters = self.op_counters
        tree = m.submodules.tree_registers = self.tree_registers
        # each unit is reset (ResetInserter) when a fault stops the request under it. MATMUL's
        # also writes the logit buffer (wired in its RUN state), EMBED's reads TOKEN.
        op_units = []
        for name, unit in self.units.items():
            cancel = Signal(name=f"{name}_cancel")
            m.submodules[name] = ResetInserter({"sync": cancel})(unit)
            m.d.comb += [unit.peek_data.eq(vmem.peek_data), unit.vmem_error.eq(vmem.error),
                         unit.vmem_wr_done.eq(vmem.wr_done)]
            op_units.append((self.unit_opcodes[name], name.upper(), unit, cancel))
        kv, embed = self.units.get("kv"), self.units["embed"]


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
        header = front.header
        res_base = Signal(64)
        code = Signal(8)                     # the request's ErrorCode
        error_pc = Signal(16)
        started = Signal()                   # the sequencer holds this request's state
        cycles = Signal(64)
        result_cycles = Signal(64)           # the count the result reports: START to FINISH
        budget = Signal(48)
        count = Signal(32)                   # instructions of the program load
        token = Signal(16)                   # the current forward's token (EMBED, SAMPLE)
        ins = dec.fields
        # a tree forward's instruction split into single-row jobs: the row running (the
        # last first) and whether it is split at all
        split, row = Signal(), Signal(range(c.rows))

        # -- row exponents: set by ACTMUL ROWEXP (a row as its write pass starts; a split
        # job's row 0 is the tree row it runs), read by MATMUL ROWEXP; architectural state,
        # zeroed by soft reset only (isa.md §1.6, §3.8) -------------------------------------
        row_exp = Signal(data.ArrayLayout(unsigned(nx.ROW_EXP_BITS), c.rows))
        clear_row_exp = Signal()
        actmul = self.units.get("actmul")
        if actmul is not None:
            with m.If(actmul.exp_we):
                m.d.sync += row_exp[Mux(split, row, actmul.exp_row)].eq(actmul.exp_value)
        with m.If(clear_row_exp):
            m.d.sync += row_exp.eq(0)
        if mm is not None:
            m.d.comb += mm.row_exp.eq(row_exp)
        busy = Signal()
        # STATUS.BUSY: a request runs, or a command is pending or in progress (docs/registers.md)
        m.d.comb += st.cycles.eq(cycles)
        with m.If(busy):
            m.d.sync += cycles.eq(cycles + 1)

        m.d.comb += [imem_r.addr.eq(seq.pc), dec.word.eq(imem_r.data),
                     imem_next.addr.eq(seq.pc + 1), nxt_dec.word.eq(imem_next.data)]
        mem_failed = mem.error.as_value().any()
        tree_forward = seq.tree_forward
        m.d.comb += [front.mem_error.eq(mem_failed),
                     # a tree forward embeds the row's node: its token, nothing to read
                     embed.token_is_drafted.eq(seq.token_is_drafted | tree_forward),
                     embed.drafted_token.eq(Mux(tree_forward, tree.token, seq.drafted_token)),
                     embed.token_addr.eq(front.base + 4 * REQUEST_HEADER_WORDS + 4 * seq.in_idx)]
        m.d.comb += [tree.row.eq(row), tree.level.eq(seq.tree_level)]
        if kv is not None:
            # the request's sequence's first KV slot (the header holds until the next START)
            m.d.comb += kv.slot_base.eq(header.kv_slot_base)
            # ATTN's tree rows ask for their paths' positions
            m.d.comb += [tree.path_index.eq(kv.path_index), kv.path_pos.eq(tree.path_pos)]
        # the result's fields, as the controller knows them at the end of a request
        m.d.comb += [writer.seq.eq(header.seq), writer.status.eq(code),
                     writer.end_pos.eq(Mux(started, seq.pos, header.start_pos)),
                     writer.cycles.eq(result_cycles),
                     writer.n_forward.eq(Mux(started, seq.forwards, 0)),
                     writer.error_pc.eq(Mux(code != 0, error_pc, 0)),
                     writer.base.eq(res_base), writer.write_idle.eq(mem.write_idle)]

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

        def lend_memory_reads(part):
            wiring.connect(m, part.read_cmd, mem.read_cmd)
            wiring.connect(m, mem.read_data, part.read_data)

        layer_offset = Signal(64)
        m.d.comb += layer_offset.eq(seq.layer * seq.lstride)
        # -- the MATMUL prefetch: while a unit instruction of a chain forward runs and the
        # next word (pc + 1, where it retires to) is a MATMUL, once that unit has issued
        # its last read (``reads_done``) and the port is read-idle, the MATMUL sequencer
        # gets the next instruction's job and the wide read path, and issues its first
        # pass's reads (tiles wait in its packer, the rest in the aligner and the port);
        # the instruction itself then runs as usual. A fault or an abort in between goes
        # through FINISH and DRAIN like any other. Not in a tree forward (split jobs).
        nxt = nxt_dec.fields
        prefetch_ok = Signal()
        if mm is not None:
            m.d.comb += prefetch_ok.eq((nxt.opcode == Op.MATMUL) & ~nxt_dec.illegal
                                       & (seq.pc + 1 < program_len) & ~tree_forward & ~lent
                                       & wide.read_idle
                                       # (not when the next FETCH stops the request: a
                                       # watchdog or an abort leaves no reads to drain)
                                       & (budget != 0) & ~want_abort)
            pf = mm.prefetch.payload
            m.d.comb += [pf.opcode.eq(nxt.opcode), pf.flags.eq(nxt.flags), pf.rows.eq(nxt.rows),
                         pf.dst.eq(nxt.dst), pf.src.eq(nxt.src), pf.n.eq(nxt.n), pf.k.eq(nxt.k),
                         pf.addr.eq(ctrl.image_base + nxt.addr
                                    + Mux(flags_view(nxt.flags).layer_relative, layer_offset, 0)),
                         pf.pos.eq(seq.pos), pf.layer.eq(seq.layer)]
            with m.If(mm.prefetch.valid & mm.prefetch.ready):
                m.d.sync += lent.eq(1)

        with m.FSM(name="phase") as phase:
            # -- idle: take the pending commands in order --------------------------------------
            with m.State("IDLE"):
                m.d.sync += want_abort.eq(0)    # nothing runs: an ABORT has nothing to stop
                with m.If(want_reset):
                    m.d.sync += [want_reset.eq(0), count.eq(0)]
                    m.d.sync += [st.program_loaded.eq(0), st.done.eq(0), st.error.eq(0),
                                 st.error_code.eq(0), st.error_pc.eq(0), st.last_seq.eq(0),
                                 st.busy_cycles.eq(0), cycles.eq(0), st.buf.eq(0)]
                    m.d.comb += [samp.clear.eq(1), mem.clear_error.eq(1), counters.clear.eq(1)]
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
                                 code.eq(ErrorCode.OK), error_pc.eq(0), count.eq(0),
                                 res_base.eq(ctrl.result_base[start_buf])]
                    m.d.comb += [mem.clear_error.eq(1), samp.clear.eq(1), vmem.clear_error.eq(1),
                                 writer.clear.eq(1), counters.start.eq(1)]
                    with m.If(~st.program_loaded):
                        # as SimDevice: completes with PROGRAM, writes no result
                        m.d.sync += code.eq(ErrorCode.PROGRAM)
                        m.next = "REPORT"
                    with m.Else():
                        m.d.comb += [front.start.valid.eq(1),
                                     front.start.payload.eq(ctrl.request_base[start_buf])]
                        m.d.sync += busy.eq(1)
                        m.next = "REQUEST"

            # -- soft reset: zero VMEM ---------------------------------------------------------
            with m.State("CLEAR_VMEM"):
                m.d.comb += [clear_row_exp.eq(1), vmem.wr_cmd.valid.eq(1), vmem.wr_cmd.payload.line.eq(0),
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

            # -- START: the front end reads and checks the request -------------------------------
            with m.State("REQUEST"):
                lend_memory_reads(front)
                with m.If(front.done):
                    with m.If(front.error != ErrorCode.OK):
                        fault(front.error)
                    with m.Else():
                        # P0, the position after the last input: past 16 bits it only
                        # has to overflow the KV buffer
                        tree_base = header.start_pos + header.n_in
                        m.d.comb += [seq.start.valid.eq(1),
                                     seq.start.payload.start_pos.eq(header.start_pos),
                                     seq.start.payload.n_tokens.eq(header.n_in),
                                     seq.start.payload.n_draft.eq(header.n_draft),
                                     seq.start.payload.tree_width.eq(header.tree_width),
                                     seq.start.payload.tree_pc.eq(header.tree_pc),
                                     tree.start.eq(1), tree.width.eq(header.tree_width),
                                     tree.base.eq(Mux(tree_base >> POSITION_BITS != 0,
                                                      (1 << POSITION_BITS) - 1, tree_base))]
                        m.d.sync += [started.eq(1),
                                     budget.eq(watchdog_budget(header.n_in, header.n_draft,
                                                               program_len))]
                        with m.If(header.compact_len != 0):
                            m.next = "COMPACT"
                        with m.Else():
                            m.next = "FETCH"

            # -- the request's compaction (isa §9.3), before the program: the KV sequencer's --
            with m.State("COMPACT"):
                if kv is not None:
                    job = kv.compact.payload
                    m.d.comb += [kv.compact.valid.eq(1),
                                 job.base.eq(header.compact_from), job.width.eq(header.compact_width),
                                 job.count.eq(header.compact_len), job.rows.eq(header.compact_rows),
                                 job.slot_base.eq(header.kv_slot_base),
                                 job.slots.eq(header.compact_slots)]
                    with m.If(kv.compact.ready):
                        m.next = "COMPACT_RUN"
                else:
                    m.next = "FETCH"
            with m.State("COMPACT_RUN"):
                with m.If(kv is None or kv.compact_done):
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
                m.d.comb += control.eq(Cat(*(ins.opcode == op for op in sorted(CONTROL_OPS))).any())
                with m.If(dec.illegal):
                    fault(ErrorCode.ILLEGAL_INSTRUCTION)
                with m.Elif(control | (ins.opcode == Op.NOP)):
                    retire()
                    m.next = "FETCH"
                # the rows a tree's branches must have: the tree's width in a tree forward
                is_op = lambda *ops: Cat(*(ins.opcode == op for op in ops)).any()
                branches = is_op(*BRANCH_OPS) | (
                    (ins.opcode == Op.MATMUL) & (flags_view(ins.flags).mode == MatmulMode.LOGITS))
                rows_expected = Mux(tree_forward, header.tree_width, 1)
                # rows a row pitch apart (or one row) become single-row jobs; several rows
                # without one (a tree of width 1 has none) keep the operand's own stride
                split_now = (tree_forward & is_op(*SPLIT_OPS)
                             & ((ins.rows == 1) | (header.row_pitch != 0)))
                for opcodes, name, unit, _ in op_units:
                    with m.Elif(is_op(*opcodes)):
                        with m.If(branches & (ins.rows != rows_expected)):
                            fault(ErrorCode.PROGRAM)
                        with m.Elif(ins.rows > c.rows):
                            fault(ErrorCode.PROGRAM)
                        with m.Else():
                            m.d.sync += [split.eq(split_now), row.eq(Mux(split_now, ins.rows - 1, 0))]
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

            # -- unit instructions: their sequencers own the shared ports meanwhile --------------
            # a split job's row ``row``: ``row · row_pitch`` lines on (a line past 16 bits
            # is outside VMEM: it saturates to the last line)
            def row_line(line):
                at = line + row * header.row_pitch
                return Mux(split, Mux(at >> 16 != 0, 0xFFFF, at), line)
            # a tree level's KV: node (d, row) stored at S(d, row); ATTN over P0 positions
            # then the row's path of d. A level past the buffer overflows the first job.
            last_position = (1 << 16) - 1
            tree_kv_pos = Mux(tree.level_overflow | (tree.storage >> 16 != 0), last_position,
                              tree.storage)
            tree_prefix = Mux(tree.level_overflow, (1 << 17) - 1, tree.p0)
            for opcodes, name, unit, cancel in op_units:
                with m.State(f"{name}_JOB"):
                    lrel = flags_view(ins.flags).layer_relative
                    job = unit.job.payload
                    m.d.comb += [unit.job.valid.eq(1),
                                 job.opcode.eq(ins.opcode), job.flags.eq(ins.flags),
                                 job.rows.eq(Mux(split, 1, ins.rows)),
                                 job.dst.eq(row_line(ins.dst)), job.src.eq(row_line(ins.src)),
                                 job.n.eq(ins.n), job.k.eq(ins.k),
                                 job.addr.eq(ctrl.image_base + ins.addr + Mux(lrel, layer_offset, 0)),
                                 job.pos.eq(seq.pos), job.layer.eq(seq.layer),
                                 # several rows of a tree forward lie row_pitch lines apart
                                 job.pitch.eq(Mux(tree_forward & ~split, header.row_pitch, 0)),
                                 # a chain forward's KV: write at POS, attend to 0 … POS
                                 job.kv_pos.eq(Mux(tree_forward, tree_kv_pos, seq.pos)),
                                 job.prefix.eq(Mux(tree_forward, tree_prefix, seq.pos + 1)),
                                 job.path_len.eq(Mux(tree_forward, seq.tree_level, 0))]
                    if unit is embed:
                        lend_memory_reads(embed)    # it reads the input token as it takes the job
                    with m.If(unit.job.ready):
                        m.next = f"{name}_RUN"
                with m.State(f"{name}_RUN"):
                    if unit is mm:
                        # (the wide read path: see matmul_reads; a prefetch's loan ends here)
                        m.d.comb += matmul_reads.eq(1)
                        m.d.sync += lent.eq(0)
                    else:
                        lend_memory_reads(unit)
                        if mm is not None:
                            m.d.comb += mm.prefetch.valid.eq(prefetch_ok & unit.reads_done)
                    _lend_vmem(m, unit, vmem)
                    if unit is mm:
                        # the MATMUL sequencer also owns the logit buffer's write side
                        m.d.comb += [samp.begin.eq(mm.logits_begin), samp.begin_n.eq(mm.logits_n),
                                     samp.begin_rows.eq(mm.logits_rows)]
                        wiring.connect(m, mm.logits, samp.logits)
                    with m.If(mem_failed):
                        m.d.comb += cancel.eq(1)         # a refused read brings no data
                        fault(ErrorCode.BAD_ADDRESS)
                    with m.Elif(unit.done):
                        if unit is embed:
                            m.d.sync += token.eq(embed.token)
                        with m.If(unit.error != ErrorCode.OK):
                            fault(unit.error)
                        with m.Elif(split & (row != 0)):
                            m.d.sync += row.eq(row - 1)
                            m.next = f"{name}_JOB"
                        with m.Else():
                            m.next = "RETIRE"

            # -- SAMPLE: the sampler over the logit buffer; the records into the result ---------
            # (a tree request's SAMPLE makes a level: W records, and a node per row for the
            # tree registers, whose new paths take over with the last record)
            m.d.comb += tree.expand_level.eq(seq.tree_level)
            with m.State("SAMPLE_REQ"):
                h = header
                m.d.comb += [samp.req.valid.eq(1),
                             samp.req.payload.k.eq(h.topk),
                             samp.req.payload.t_mult.eq(h.t_mult),
                             samp.req.payload.t_shift.eq(h.t_shift[:6]),
                             samp.req.payload.sample.eq(h.flags.sample),
                             samp.req.payload.seed.eq(h.seed),
                             samp.req.payload.counter.eq(h.counter),
                             samp.req.payload.n_drafted.eq(seq.n_drafted),
                             samp.req.payload.tree_width.eq(h.tree_width)]
                with m.If(samp.req.ready):
                    m.next = "SAMPLE_RECORD"
            with m.State("SAMPLE_RECORD"):
                wiring.connect(m, samp.record, writer.record)
                wiring.connect(m, samp.expansion, tree.expand)
                with m.If(samp.error):
                    fault(ErrorCode.PROGRAM)        # a greedy level short of candidates
                with m.Elif(samp.record.valid):
                    with m.If(writer.word == 0):
                        m.d.sync += token.eq(samp.record.payload.word)   # the drafted token
                    with m.If(samp.record.payload.final):
                        m.d.comb += tree.commit.eq(1)
                        m.next = "RETIRE"

            # -- the result descriptor --------------------------------------------------------------
            with m.State("FINISH"):
                m.d.sync += lent.eq(0)          # (the MATMUL sequencer is reset with the rest)
                m.d.comb += vmem.cancel.eq(1)
                m.d.comb += [cancel.eq(1) for *_, cancel in op_units]
                m.d.sync += [result_cycles.eq(cycles), want_abort.eq(0)]
                m.next = "DRAIN"
            with m.State("DRAIN"):
                # let an abandoned read stream run out, so the next request's reads are its
                # own: drained whole from the wide port, the narrower forgetting its reads
                m.d.comb += [wide.read_data.ready.eq(1), narrower.flush.eq(1)]
                with m.If(~wide.read_data.valid & wide.read_idle):
                    m.d.comb += writer.start.eq(1)
                    m.next = "RESULT"
            with m.State("RESULT"):
                wiring.connect(m, writer.write_cmd, mem.write_cmd)
                wiring.connect(m, writer.write_data, mem.write_data)
                with m.If(writer.done):
                    m.next = "REPORT"
            with m.State("REPORT"):
                # STATUS/ERROR as SimDevice._finish sets them; a failed load reports here too
                m.d.sync += [busy.eq(0), st.done.eq(1), st.error.eq(code != ErrorCode.OK),
                             st.error_code.eq(code), st.error_pc.eq(Mux(code != 0, error_pc, 0)),
                             started.eq(0)]
                with m.If(busy):
                    m.d.sync += [st.last_seq.eq(header.seq), st.busy_cycles.eq(st.busy_cycles + cycles)]
                m.d.comb += st.done_pulse.eq(1)
                m.next = "IDLE"

        # -- per-unit busy counters (regmap.OP_CYCLE_BUCKETS) ------------------------------------
        fetch_ends = seq.fault.valid | seq.halted | (seq.pc >= program_len) | (budget == 0)
        m.d.comb += [counters.busy.eq(busy), counters.opcode.eq(ins.opcode),
                     counters.illegal.eq(dec.illegal),
                     counters.decode.eq(phase.ongoing("DECODE")),
                     counters.fetch.eq(phase.ongoing("FETCH")), counters.fetch_ends.eq(fetch_ends),
                     counters.finish.eq(phase.ongoing("FINISH")),
                     st.op_cycles.eq(counters.op_cycles)]
        m.d.comb += st.busy.eq(busy | want_reset | want_load | want_start | ~phase.ongoing("IDLE"))
        return m


def unit_sequencers():
    """(opcodes, name, factory(config, data_width)) of every unit-instruction sequencer
    with the common :class:`~dfvg_hw.op_port.OpSequencerSignature` but MATMUL's (which
    needs a supported geometry) and EMBED's."""
    from dfvg_hw.actmul_sequencer import ActMulSequencer
    from dfvg_hw.kv_sequencer import KvSequencer
    from dfvg_hw.norm_sequencer import NormSequencer
    from dfvg_hw.rope_sequencer import RopeSequencer
    return [((Op.RMSNORM,), "norm", NormSequencer),
            ((Op.KVAPPEND, Op.ATTN), "kv", KvSequencer),
            ((Op.ROPE,), "rope", RopeSequencer),
            ((Op.ACTMUL,), "actmul", ActMulSequencer)]


def _lend_vmem(m: Module, unit, vmem: VectorMemory) -> None:
    """Connect ``unit``'s VMEM ports to the shared ones (while it runs)."""
    wiring.connect(m, unit.vmem_rd_cmd, vmem.rd_cmd)
    wiring.connect(m, vmem.rd, unit.vmem_rd)
    wiring.connect(m, unit.vmem_wr_cmd, vmem.wr_cmd)
    wiring.connect(m, unit.vmem_wr, vmem.wr)
    m.d.comb += [vmem.peek_addr.eq(unit.peek_addr), vmem.poke_en.eq(unit.poke_en),
                 vmem.poke_addr.eq(unit.poke_addr), vmem.poke_data.eq(unit.poke_data)]
