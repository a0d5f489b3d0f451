"""A test bench for one unit-instruction sequencer against the functional model.

:class:`OpBench` puts a sequencer (anything with :class:`~dfvg_hw.op_port.OpSequencerSignature`)
between a :class:`~dfvg_hw.vmem.VectorMemory` and a :class:`~dfvg_hw.memory_port.MemoryPort`
whose AXI4 master talks to :class:`~sim.axi_memory.AXI4SlaveMemory` over a
:class:`~sim.memory.DeviceMemory`, exactly as the controller connects it. :func:`run_jobs`
fills VMEM, runs instructions, reads VMEM back and returns it with each job's error code,
so a test can hold the result against ``FunctionalEngine._unit`` on the same VMEM and
device memory (:func:`functional_reference` for one instruction, :func:`reference_jobs`
for the same job list; :func:`compare_with_reference` runs both and asserts they agree).

A sequencer that also writes the logit buffer (the MATMUL sequencer's ``logits_begin``,
``logits_n`` and ``logits`` ports, as :class:`~dfvg_hw.sample_sequencer.SampleSequencer` takes
them) gets an always-ready sink that collects each logit vector it streams, so LOGITS
results are compared too; one with ``logits_rows`` (a LOGITS matmul of several rows, a tree
forward's, docs/isa.md §9.2) has each tile placed in the row its ``row`` field names.

Row exponents (docs/isa.md §3.8): a sequencer that reports them (ACTMUL's ``exp_we``,
``exp_row``, ``exp_value``) has them kept in a table as the controller keeps them, and
compared with the functional model's ``row_exp`` after every job; one that reads them
(MATMUL's ``row_exp``) gets each job's ``row_exp`` entry (a list; zeros at first, kept
from job to job where a job has none), which the functional model is given too.

A sequencer with a path port (the KV sequencer's ``path_index``/``path_pos``: the KV
positions of a tree row's path, which the controller serves) gets a table in the bench,
set per job from the job's ``path`` entry (a list of positions), and ``path_pos`` answers
``path_index`` from it in the same cycle, as the controller's tree registers do.
"""

from __future__ import annotations

import numpy as np
from amaranth import Module, Mux, ResetInserter, unsigned
from amaranth.lib import data, wiring
from amaranth.lib.wiring import In, Out

from dfvg_hw.spec.config import EngineConfig
from dfvg_hw.spec.descriptors import ErrorCode
from dfvg_hw.spec.isa import Instruction, Op
from dfvg_hw.memory_port import MemoryPort
from dfvg_hw.op_port import OpJob
from dfvg_hw.vmem import VectorMemory
from sim.axi_memory import AXI4SlaveMemory, MemoryTiming
from sim.functional import EngineFault, FunctionalEngine
from sim.memory import DeviceMemory
from sim.program_flow import ProgramFlow, block_address
from sim.tree_state import TreeState
from sim.testbench import run_simulation, stream_put

__all__ = ["OpBench", "run_jobs", "functional_reference", "reference_jobs", "compare_with_reference",
           "has_logit_port", "has_path_port", "reports_exponents", "reads_exponents", "PATH_ENTRIES"]

#: Entries of the bench's path table (a tree row's path has at most MAX_DRAFT levels).
PATH_ENTRIES = 64


class OpBench(wiring.Component):
    """A sequencer with the VMEM and memory port it works against, and a VMEM backdoor.

    Members
    -------
    job, done, error : the sequencer's job port, passed through
    backdoor : In(1)
        While high (and no job runs), ``peek_addr``/``poke_*`` reach VMEM directly.
    mem_error : Out(1)
        The memory port refused a command or got an error response (BAD_ADDRESS).
    cancel : In(1)
        Resets the sequencer (what the controller does after a memory error).
    peek_addr, peek_data, poke_en, poke_addr, poke_data : the backdoor's VMEM line ports
    axi : the memory port's AXI4 master
    path_table : In(ArrayLayout(unsigned(16), PATH_ENTRIES))
        Only for a sequencer with a path port: the KV positions of the running job's path;
        ``path_pos`` is entry ``path_index``.
    """

    def __init__(self, config: EngineConfig, sequencer, data_width: int = 128):
        self.config = config
        self.sequencer = sequencer
        self.port = MemoryPort(config, data_width=data_width)
        L = config.vmem_line_bytes
        super().__init__(wiring.Signature({
            "job": sequencer.signature.members["job"],
            "done": Out(1),
            "error": Out(8),
            "backdoor": In(1),
            "mem_error": Out(1),
            "cancel": In(1),
            "peek_addr": In(16),
            "peek_data": Out(8 * L),
            "poke_en": In(L),
            "poke_addr": In(16),
            "poke_data": In(8 * L),
            "axi": Out(self.port.axi.signature),
            **({"path_table": In(data.ArrayLayout(unsigned(16), PATH_ENTRIES))}
               if has_path_port(sequencer) else {}),
            **({"row_exp": In(sequencer.signature.members["row_exp"].shape)}
               if reads_exponents(sequencer) else {}),
        }))

    def elaborate(self, platform):
        m = Module()
        seq, port = self.sequencer, self.port
        vmem = m.submodules.vmem = VectorMemory(self.config)
        m.submodules.sequencer = ResetInserter({"sync": self.cancel})(seq)
        m.submodules.port = port
        wiring.connect(m, wiring.flipped(self.job), seq.job)
        wiring.connect(m, seq.read_cmd, port.read_cmd)
        wiring.connect(m, port.read_data, seq.read_data)
        wiring.connect(m, seq.vmem_rd_cmd, vmem.rd_cmd)
        wiring.connect(m, vmem.rd, seq.vmem_rd)
        wiring.connect(m, seq.vmem_wr_cmd, vmem.wr_cmd)
        wiring.connect(m, seq.vmem_wr, vmem.wr)
        wiring.connect(m, port.axi, wiring.flipped(self.axi))
        door = self.backdoor
        m.d.comb += [
            self.done.eq(seq.done), self.error.eq(seq.error),
            seq.vmem_wr_done.eq(vmem.wr_done),
            seq.vmem_error.eq(vmem.error),
            self.mem_error.eq(port.error.as_value().any()), port.clear_error.eq(self.cancel),
            vmem.clear_error.eq(self.cancel), vmem.cancel.eq(self.cancel),
            vmem.peek_addr.eq(Mux(door, self.peek_addr, seq.peek_addr)),
            seq.peek_data.eq(vmem.peek_data), self.peek_data.eq(vmem.peek_data),
            vmem.poke_en.eq(Mux(door, self.poke_en, seq.poke_en)),
            vmem.poke_addr.eq(Mux(door, self.poke_addr, seq.poke_addr)),
            vmem.poke_data.eq(Mux(door, self.poke_data, seq.poke_data)),
        ]
        if has_path_port(seq):
            m.d.comb += seq.path_pos.eq(self.path_table[seq.path_index])
        if reads_exponents(seq):
            m.d.comb += seq.row_exp.eq(self.row_exp)
        return m


def has_logit_port(sequencer) -> bool:
    """Whether ``sequencer`` streams logits (``logits_begin``, ``logits_n``, ``logits``)."""
    return "logits" in sequencer.signature.members


def has_path_port(sequencer) -> bool:
    """Whether ``sequencer`` asks for a tree row's path positions (``path_index``, ``path_pos``)."""
    return "path_index" in sequencer.signature.members


def reports_exponents(sequencer) -> bool:
    """Whether ``sequencer`` sets row exponents (``exp_we``, ``exp_row``, ``exp_value``)."""
    return "exp_we" in sequencer.signature.members


def reads_exponents(sequencer) -> bool:
    """Whether ``sequencer`` reads the row exponents (``row_exp``)."""
    return "row_exp" in sequencer.signature.members


def _exponent_keeper(sequencer, table: list):
    """A simulator process standing in for the controller's row exponent registers:
    ``table`` (a list of ints) takes each ``exp_we`` write."""
    async def process(ctx):
        async for _, _, we, row, value in ctx.tick().sample(sequencer.exp_we, sequencer.exp_row,
                                                          sequencer.exp_value):
            if we:
                table[row] = int(value)
    return process


def run_jobs(config: EngineConfig, sequencer, vmem: np.ndarray, memory: DeviceMemory,
             jobs: list[dict], *, data_width: int = 128, timing: MemoryTiming | None = None,
             max_cycles: int = 200_000, logits: list | None = None,
             cycles: list | None = None, exponents: list | None = None) -> tuple[np.ndarray, list[int]]:
    """Run ``jobs`` (dicts of :class:`OpJob` fields) one after the other, starting from
    VMEM contents ``vmem`` (uint8, ``vmem_bytes``); return VMEM afterwards and each job's
    error code. A job's ``path`` entry (a list of KV positions) is the path port's table
    while it runs (a sequencer with a path port only); entries that are no :class:`OpJob`
    field (``path``, :func:`reference_jobs`'s ``tree``) reach no port.

    ``logits``, if given, receives each logit vector the sequencer streams (int16 arrays,
    in order; ``[rows, n]`` for a LOGITS job of several rows; a sequencer with a logit
    port only). ``cycles``, if given, receives each
    job's cycle count from the clock edge that transfers the job to the one after which
    ``done`` is high (None for a job cancelled after a memory error). ``exponents``, if
    given, receives the row exponent table after each job (a sequencer that sets them).
    """
    bench = OpBench(config, sequencer, data_width)
    slave = AXI4SlaveMemory(bench.axi, memory, timing or MemoryTiming.for_config(config, data_width))
    L = config.vmem_line_bytes
    lines = np.asarray(vmem, np.uint8).reshape(-1, L)
    after = np.zeros_like(lines)
    errors: list[int] = []
    processes = [slave.process]
    if has_logit_port(sequencer):
        processes.append(_logit_sink(sequencer, [] if logits is None else logits))
    table = [0] * config.rows
    if reports_exponents(sequencer):
        processes.append(_exponent_keeper(sequencer, table))

    async def tb(ctx):
        ctx.set(bench.backdoor, 1)
        for i, line in enumerate(lines):
            ctx.set(bench.poke_addr, i)
            ctx.set(bench.poke_data, int.from_bytes(line.tobytes(), "little"))
            ctx.set(bench.poke_en, (1 << L) - 1)
            await ctx.tick()
        ctx.set(bench.poke_en, 0)
        ctx.set(bench.backdoor, 0)
        for job in jobs:
            path = job.get("path", [])
            if has_path_port(sequencer):
                ctx.set(bench.path_table, list(path) + [0] * (PATH_ENTRIES - len(path)))
            if reads_exponents(sequencer) and "row_exp" in job:     # else they stay
                ctx.set(bench.row_exp, list(job["row_exp"]))
            fields = {name: job.get(name, 0) for name in OpJob().members}   # not path, tree
            await stream_put(ctx, bench.job, fields)
            for elapsed in range(max_cycles):
                if ctx.get(bench.done):
                    errors.append(ctx.get(bench.error))
                    if cycles is not None:
                        cycles.append(elapsed + 1)
                    break
                if ctx.get(bench.mem_error):            # a refused read brings no data
                    errors.append(int(ErrorCode.BAD_ADDRESS))
                    if cycles is not None:              # (no done: the job was cancelled)
                        cycles.append(None)
                    ctx.set(bench.cancel, 1)
                    await ctx.tick()
                    ctx.set(bench.cancel, 0)
                    break
                await ctx.tick()
            else:
                raise AssertionError(f"job {job} did not finish in {max_cycles} cycles")
            await ctx.tick()
            if exponents is not None:
                exponents.append(list(table))
        ctx.set(bench.backdoor, 1)
        for i in range(len(lines)):
            ctx.set(bench.peek_addr, i)
            await ctx.tick()
            after[i] = np.frombuffer(ctx.get(bench.peek_data).to_bytes(L, "little"), np.uint8)

    run_simulation(bench, tb, processes=processes)
    return after.reshape(-1), errors


def _logit_sink(sequencer, vectors: list):
    """A simulator process standing in for the logit buffer: always ready; each
    ``logits_begin`` starts a vector of ``logits_n`` entries (in each of ``logits_rows``
    rows, where the sequencer has that port) that the following tiles fill, each in the
    row its ``row`` field names. A row that gets more tiles than it needs fails the run.
    A vector of one row is a 1-D array, one of several ``[rows, n]``."""
    lanes = len(sequencer.logits.payload.data)
    rows_port = sequencer.logits_rows if "logits_rows" in sequencer.signature.members else None

    async def process(ctx):
        ctx.set(sequencer.logits.ready, 1)
        want, filling = 0, None
        async for _, _, begin, n, rows, valid, tile, row in ctx.tick().sample(
                sequencer.logits_begin, sequencer.logits_n,
                sequencer.logits_begin if rows_port is None else rows_port,
                sequencer.logits.valid, sequencer.logits.payload.data, sequencer.logits.payload.row):
            if valid:
                assert filling is not None and row < len(filling) and len(filling[row]) < want, \
                    "a logit tile past the vector's end"
                filling[row].extend(int(tile[j]) for j in range(lanes))
                if all(len(values) >= want for values in filling):
                    done = np.array([values[:want] for values in filling], np.int16)
                    vectors[-1] = done[0] if len(filling) == 1 else done
                    filling = None
            if begin:
                assert filling is None, "a vector cut short"
                want, count = n, max(int(rows), 1) if rows_port is not None else 1
                filling = [[] for _ in range(count)]
                vectors.append(None)
                if not n:
                    vectors[-1] = np.zeros(0, np.int16) if count == 1 else np.zeros((count, 0), np.int16)
                    filling = None

    return process


def _registers(pos: int, layer: int, lstride: int = 0, token: int = 0,
               tree: TreeState | None = None) -> ProgramFlow:
    """The controller registers ``FunctionalEngine._unit`` reads: a chain forward, or the
    tree forward that feeds ``tree``'s current level."""
    registers = ProgramFlow([token], pos, 0, tree_width=tree.width if tree else 0)
    registers.layer, registers.lstride = layer, lstride
    registers.tree_level = tree.level if tree else 0
    return registers


def functional_reference(engine: FunctionalEngine, ins: Instruction, *, image_base: int = 0,
                         pos: int = 0, layer: int = 0, lstride: int = 0, pitch: int = 0,
                         tree: TreeState | None = None) -> int:
    """Execute one unit instruction on ``engine`` (its ``vmem``, KV and memory change in
    place), its operand checks first as in a run; return the ErrorCode it stops with (OK
    if none). ``tree`` makes it an instruction of the tree forward feeding the tree's
    current level (``pos`` is then that level's position, ``P0 + level − 1``), ``pitch``
    its row pitch in lines (docs/isa.md §9.2)."""
    registers = _registers(pos, layer, lstride, tree=tree)
    engine.tree = tree
    engine.set_row_pitch(pitch if tree else 0)
    try:
        engine._check_operands(ins, registers, block_address(ins, image_base, layer, lstride))
        engine._unit(ins, registers, image_base)
    except EngineFault as fault:
        return int(fault.code)
    return int(ErrorCode.OK)


#: the job fields that are instruction fields (``pos`` and ``layer`` are registers)
_INSTRUCTION_FIELDS = ("flags", "rows", "dst", "src", "n", "k", "addr")


def reference_jobs(config: EngineConfig, vmem: np.ndarray, memory: DeviceMemory,
                   jobs: list[dict], *, logits: list | None = None,
                   exponents: list | None = None) -> tuple[np.ndarray, list[int]]:
    """The functional model's answer to :func:`run_jobs` with the same arguments. A job's
    ``pitch`` and ``tree`` entries make it an instruction of a tree forward
    (:func:`functional_reference`); ``path`` entries are the RTL bench's and ignored.

    Parameters
    ----------
    config : EngineConfig
    vmem : np.ndarray
        VMEM contents before the first job (uint8, ``vmem_bytes``); not changed.
    memory : DeviceMemory
        Device memory the jobs read (and KV state lives beside it in the engine).
    jobs : list of dict
        :class:`OpJob` fields; missing ones are 0, ``pos`` and ``layer`` become the
        controller registers.
    logits : list, optional
        Receives the logit buffer of each job that completes a LOGITS matmul (its one row,
        or ``[rows, n]``).
    exponents : list, optional
        Receives the row exponents after each job. A job's ``row_exp`` entry sets them
        before it runs.

    Returns
    -------
    (np.ndarray, list of int)
        VMEM after the last job, and each job's ErrorCode.
    """
    engine = FunctionalEngine(config, memory)
    engine.vmem[:] = vmem
    errors = []
    for job in jobs:
        ins = Instruction(Op(job["opcode"]), **{name: job.get(name, 0) for name in _INSTRUCTION_FIELDS})
        engine.logits = None
        if "row_exp" in job:
            engine.row_exp[:] = job["row_exp"]
        errors.append(functional_reference(engine, ins, pos=job.get("pos", 0),
                                           layer=job.get("layer", 0), pitch=job.get("pitch", 0),
                                           tree=job.get("tree")))
        if logits is not None and engine.logits is not None:
            rows = engine.logit_rows
            logits.append(np.asarray(engine.logits if len(rows) == 1 else rows, np.int16))
        if exponents is not None:
            exponents.append([int(e) for e in engine.row_exp])
    return engine.vmem, errors


def compare_with_reference(config: EngineConfig, sequencer, vmem: np.ndarray,
                           memory: DeviceMemory, jobs: list[dict], *,
                           data_width: int = 128, cycles: list | None = None) -> list[int]:
    """Run ``jobs`` on ``sequencer`` (:func:`run_jobs`) and on the functional model
    (:func:`reference_jobs`) from the same VMEM and device memory; assert both give the
    same error codes, the same VMEM, (a sequencer with a logit port) the same logit
    vectors and (one that sets row exponents) the same row exponents after every job,
    and return the error codes. ``cycles``, if given, receives each job's cycles
    on the sequencer (as :func:`run_jobs` counts them)."""
    got_logits, want_logits, got_exponents, want_exponents = [], [], [], []
    after, errors = run_jobs(config, sequencer, vmem, memory, jobs, data_width=data_width,
                             logits=got_logits, cycles=cycles, exponents=got_exponents)
    expected, expected_errors = reference_jobs(config, vmem, memory, jobs, logits=want_logits,
                                               exponents=want_exponents)
    assert errors == expected_errors
    np.testing.assert_array_equal(after, expected)
    if reports_exponents(sequencer):
        assert got_exponents == want_exponents
    if has_logit_port(sequencer):
        assert len(got_logits) == len(want_logits)
        for got, want in zip(got_logits, want_logits):
            assert isinstance(got, np.ndarray), "a logit vector cut short"
            np.testing.assert_array_equal(got, want)
    return errors
