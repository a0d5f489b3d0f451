"""KvSequencer against the functional model's KVAPPEND and ATTN (sim/op_bench.py).

Each test runs a sequence of jobs in one bench, so the KV buffer carries from job to job
as it does in the engine; the functional model runs the same jobs on the same VMEM and
device memory. KVAPPEND is checked through the ATTN outputs that read it back (every
head, every position up to POS, partial ``k`` leaving stale bytes in place). tiny's 4 KV
slots hold 2 layers × 2 KV heads (slot ``layer · G + h``, docs/isa.md §1.4).
"""

from __future__ import annotations

import numpy as np
import pytest
from amaranth import Module, Mux, Signal
from amaranth.lib import wiring
from amaranth.lib.memory import Memory

from dfvg_hw.spec.config import VMEM_LINE_BYTES, get_preset
from dfvg_hw.spec.descriptors import ErrorCode
from dfvg_hw.spec.image import ATTN_PARAM_BYTES
from dfvg_hw.spec.isa import Flag, Instruction, Op
from dfvg_hw.kv_buffer import PATH_ENTRIES
from dfvg_hw.kv_sequencer import KvSequencer
from dfvg_hw.spec.descriptors import Compaction
from dfvg_hw.op_port import OpSequencerSignature
from sim.attention_timing import attn_job_cycles, compaction_cycles, kvappend_cycles
from sim.cycle_model import CycleModel, UNIT_OVERHEAD
from sim.functional import FunctionalEngine
from sim.tree_state import TreeState
from sim.memory import DeviceMemory
from sim.op_bench import functional_reference, run_jobs
from sequencer_cases import WIDE_LINES, model_cycles, wide_line
from dfvg_hw.verilog import to_verilog
from sim.lint import verilator_lint

TINY = get_preset("tiny")
L = VMEM_LINE_BYTES
OK, PROGRAM, KV_OVERFLOW, BAD_ADDRESS = (ErrorCode.OK, ErrorCode.PROGRAM, ErrorCode.KV_OVERFLOW,
                                         ErrorCode.BAD_ADDRESS)
#: ATTN parameter blocks: G = 2 (aligned), G = 1 (aligned), G = 2 (not bus-aligned),
#: G = 3 (slots past the end from layer 1 on), then bad ones: G = 0, G = 5 > kv_slots,
#: and a block running past device memory
GQA2, MHA1, GQA2_ODD, G3, G0, G5 = 0x3000, 0x3010, 0x3024, 0x3050, 0x3040, 0x3060
LAYERS, KV_HEADS = 2, 2
assert LAYERS * KV_HEADS == TINY.kv_slots
PAST_END = TINY.mem_bytes - 8


def _pass_through_but_job(m, adapter, seq) -> None:
    """Connect every member of a test adapter to its sequencer's, except ``job`` (which the
    adapter drives itself)."""
    for name, member in adapter.signature.members.items():
        if name != "job":
            inner, outer = getattr(seq, name), getattr(adapter, name)
            if member.is_port:
                m.d.comb += (outer.eq(inner) if member.flow == wiring.Out else inner.eq(outer))
            else:
                wiring.connect(m, wiring.flipped(outer), inner)


class ClearOnNop(wiring.Component):
    """Test adapter: a NOP job pulses the sequencer's ``clear`` and finishes (OK) when the
    KV buffer is zero, so run_jobs can put a soft reset between jobs."""

    def __init__(self, sequencer: KvSequencer):
        self.sequencer = sequencer
        super().__init__(OpSequencerSignature(TINY, 128))

    def elaborate(self, platform):
        m = Module()
        seq = m.submodules.sequencer = self.sequencer
        _pass_through_but_job(m, self, seq)
        is_nop = self.job.payload.opcode == Op.NOP
        busy = Signal()
        m.d.comb += [seq.job.payload.eq(self.job.payload),
                     seq.job.valid.eq(self.job.valid & ~is_nop),
                     self.job.ready.eq(seq.job.ready | (is_nop & ~busy)),
                     seq.clear.eq(self.job.valid & is_nop & ~busy)]
        with m.If(self.job.valid & is_nop & ~busy):
            m.d.sync += busy.eq(1)
        with m.If(busy & ~seq.clearing):
            m.d.sync += busy.eq(0)
            m.d.comb += [self.done.eq(1), self.error.eq(OK)]
        return m


class SlotBaseInAddr(wiring.Component):
    """Test adapter: each job's ``slot_base`` (the request's ``kv_slot_base``, which the
    controller drives beside the job) from bits 48-63 of its ``addr``, so run_jobs can
    give every job its own; the sequencer sees ``addr`` bits 0-47."""

    def __init__(self, sequencer: KvSequencer):
        self.sequencer = sequencer
        super().__init__(OpSequencerSignature(TINY, 128))

    def elaborate(self, platform):
        m = Module()
        seq = m.submodules.sequencer = self.sequencer
        _pass_through_but_job(m, self, seq)
        m.d.comb += [seq.job.payload.eq(self.job.payload), seq.job.payload.addr.eq(self.job.payload.addr[:48]),
                     seq.slot_base.eq(self.job.payload.addr[48:]),
                     seq.job.valid.eq(self.job.valid), self.job.ready.eq(seq.job.ready)]
        return m


def _memory(rng) -> DeviceMemory:
    memory = DeviceMemory(TINY.mem_bytes)
    for addr, groups in ((GQA2, 2), (MHA1, 1), (GQA2_ODD, 2), (G0, 0), (G3, 3), (G5, 5),
                         (PAST_END, 2)):
        # scores of random int8 vectors are ~±2^12: mult/shift that give spread softmaxes
        block = np.zeros(ATTN_PARAM_BYTES // 4, "<u4")
        block[0] = int(rng.integers(200, 4000)) | int(rng.integers(14, 19)) << 16
        block[1] = groups
        memory.write(addr, block.tobytes()[:TINY.mem_bytes - addr])
    return memory


def _run(rng, jobs, memory, *, clear_adapter=False, config=TINY, data_width=128, timed=True,
         prepare=None):
    """Run ``jobs`` on the RTL and on the functional model; compare errors and VMEM, and
    (``timed``) every job that completes OK with the cycle model's count. ``prepare``
    rewrites the random starting VMEM (a uint8 array) in place."""
    vmem = rng.integers(0, 256, config.vmem_bytes, dtype=np.uint8)
    if prepare is not None:
        prepare(vmem)
    sequencer = KvSequencer(config, data_width)
    cycles = []
    bases = [job.get("slot_base", 0) for job in jobs]
    jobs = [{name: value for name, value in job.items() if name != "slot_base"} for job in jobs]
    # a chain job's KV registers, as the controller sets them: write at POS, attend to 0 … POS
    chain = [chain_kv_fields(job) for job in jobs]
    if any(bases):                              # each job's kv_slot_base in addr bits 48-63
        dut = SlotBaseInAddr(sequencer)
        rtl_jobs = [job | {"addr": job.get("addr", 0) | base << 48} for job, base in zip(chain, bases)]
    else:
        dut, rtl_jobs = ClearOnNop(sequencer) if clear_adapter else sequencer, chain
    after, errors = run_jobs(config, dut, vmem, memory, rtl_jobs, data_width=data_width,
                             cycles=cycles)
    if timed:
        timed_jobs = [(job, got) for job, got, e in zip(jobs, cycles, errors)
                      if e == OK and job["opcode"] != Op.NOP]
        assert timed_jobs
        assert [got for _, got in timed_jobs] == [model_cycles(config, data_width, job)
                                                  for job, _ in timed_jobs]
    engine = FunctionalEngine(config, memory)
    engine.vmem[:] = vmem
    expected = []
    for job, base in zip(jobs, bases):
        engine.kv_slot_base = base
        if job["opcode"] == Op.NOP:             # the adapter's soft reset of KV
            engine.kv_k.fill(0)
            engine.kv_v.fill(0)
            expected.append(OK)
            continue
        ins = Instruction(Op(job["opcode"]), flags=job.get("flags", 0), rows=job["rows"],
                          dst=job.get("dst", 0), src=job["src"], n=job["n"], k=job["k"],
                          addr=job.get("addr", 0))
        expected.append(functional_reference(engine, ins, pos=job["pos"], layer=job["layer"]))
    assert errors == expected
    np.testing.assert_array_equal(after, engine.vmem)
    return errors


def chain_kv_fields(job: dict) -> dict:
    """``job`` with the KV fields a chain forward's controller gives it (``kv_pos = pos``,
    ``prefix = pos + 1``, no path) where it has none of its own."""
    pos = job.get("pos", 0)
    return {"kv_pos": pos, "prefix": pos + 1, "path_len": 0} | job


def _append(n, k, src, pos, layer=0, rows=1, base=0, wide=False):
    return dict(opcode=Op.KVAPPEND, flags=Flag.WIDE if wide else 0, rows=rows, n=n, k=k, src=src,
                pos=pos, layer=layer, slot_base=base)


def _attn(n, k, src, dst, pos, addr, layer=0, wide=False, rows=1, base=0, in16=False):
    flags = (Flag.WIDE if wide else 0) | (Flag.IN16 if in16 else 0)
    return dict(opcode=Op.ATTN, flags=flags, rows=rows, n=n, k=k, src=src,
                dst=dst, pos=pos, layer=layer, addr=addr, slot_base=base)


def _outputs(jobs, errors) -> int:
    return sum(j["n"] * j["k"] for j, e in zip(jobs, errors) if j["opcode"] == Op.ATTN and e == OK)


#: tiny with 2 and 4 KV banks (tiny-hbm's 2 banks; 4 with a context that is not a
#: multiple of the banks)
BANKED = {"b2": TINY.with_changes(kv_banks=2), "b4": TINY.with_changes(kv_banks=4)}


@pytest.mark.parametrize("name", ["b1", "b2", "b4"])
def test_appends_then_attention_gqa_wide_and_narrow(name):
    """Per position: KVAPPEND of both layers (random k, row at any line), then ATTN of
    both layers with 2 or 4 query heads over 2 KV heads or 1, narrow or wide, at byte
    offsets that are not line-aligned; every position, so every t mod kv_banks; cycles
    equal to the cycle model's."""
    config = BANKED.get(name, TINY)
    rng = np.random.default_rng(10 + config.kv_banks)
    jobs = []
    for pos in range(14 if name == "b1" else 11):
        for layer in range(LAYERS):
            # mostly full heads; sometimes a shorter k, leaving stale bytes k… behind
            k = TINY.head_dim if rng.random() < 0.7 else int(rng.integers(5, TINY.head_dim))
            jobs.append(_append(KV_HEADS, k, int(rng.integers(0, 200)), pos, layer))
        for layer in range(LAYERS):
            n, addr = [(2, GQA2), (4, GQA2_ODD), (2, MHA1), (4, GQA2)][int(rng.integers(4))]
            k = TINY.head_dim if rng.random() < 0.8 else int(rng.integers(3, TINY.head_dim))
            jobs.append(_attn(n, k, int(rng.integers(0, 120)), int(rng.integers(120, 240)), pos,
                              addr, layer, wide=bool(rng.random() < 0.5)))
    errors = _run(rng, jobs, _memory(rng), config=config)
    assert errors == [OK] * len(jobs)
    assert _outputs(jobs, errors) >= (1000 if name == "b1" else 600)


WIDE_KV = {"b4kv12": TINY.with_changes(kv_banks=4, kv_bits=12),
           "b2kv16": TINY.with_changes(kv_banks=2, kv_bits=16)}


def _wide_kv_case(name):
    """test_wide_kv_elements's jobs: (rng, jobs, memory, config, prepare)."""
    config = WIDE_KV[name]
    rng = np.random.default_rng(70 + config.kv_bits)
    memory = _memory(rng)
    for addr, groups in ((GQA2, 2), (MHA1, 1), (GQA2_ODD, 2)):
        # scores up to 2^(kv_bits + 14) · D (16-bit queries): multipliers that keep the
        # softmax spread
        block = np.zeros(ATTN_PARAM_BYTES // 4, "<u4")
        block[0] = int(rng.integers(200, 4000)) | (config.kv_bits + 15) << 16
        block[1] = groups
        memory.write(addr, block.tobytes())
    jobs, wide_rows, queries = [], [], []
    for pos in range(12):
        for layer in range(LAYERS):
            # a whole entry, and now and then a shorter one over it (its elements past k stay)
            ks = [TINY.head_dim] + ([int(rng.integers(5, TINY.head_dim))] if rng.random() < 0.4 else [])
            for k in ks:
                wide = bool(rng.random() < 0.7)
                jobs.append(_append(KV_HEADS, k, int(rng.integers(0, 100)), pos, layer, wide=wide))
                if wide:
                    wide_rows.append(jobs[-1])
        for layer in range(LAYERS):
            n, addr = [(2, GQA2), (4, GQA2_ODD), (2, MHA1), (4, GQA2)][int(rng.integers(4))]
            in16 = bool(rng.random() < 0.5)
            jobs.append(_attn(n, TINY.head_dim, int(rng.integers(100, 140)), int(rng.integers(140, 240)),
                              pos, addr, layer, wide=bool(rng.random() < 0.5), in16=in16))
            if in16:
                queries.append(jobs[-1])
    limit = 1 << (config.kv_bits - 1)

    def prepare(vmem):
        # int16 queries, read whole (16 bits) over a wide cache: −32768 saturates to −32767
        for job in queries:
            start, count = job["src"] * config.vmem_line_bytes, job["n"] * job["k"]
            q = rng.integers(-6000, 6000, count).astype("<i2")
            q[:3] = [-32768, 32767, -32767]
            vmem[start:start + 2 * count] = np.frombuffer(q.tobytes(), np.uint8)
        for job in wide_rows:           # int16 k and v around the element's range
            start, count = job["src"] * config.vmem_line_bytes, 2 * job["n"] * job["k"]
            kv = rng.integers(-limit - 300, limit + 300, count).clip(-32768, 32767).astype("<i2")
            vmem[start:start + 2 * count] = np.frombuffer(kv.tobytes(), np.uint8)

    return rng, jobs, memory, config, prepare


@pytest.mark.parametrize("name", list(WIDE_KV))
def test_wide_kv_elements(name):
    """A KV cache of ``kv_bits`` > 8 (numerics.kv_entry): KVAPPEND WIDE's int16 k and v
    saturated to ``kv_bits`` (values around the limit, so some saturate) and plain
    KVAPPENDs' int8 in the top bits, mixed in one cache; ATTN over them with int8 and
    16-bit queries, narrow and wide outputs (shifted by ``kv_bits − 8``); against the
    functional model, cycles equal to the cycle model's (a WIDE head is 2k bytes)."""
    rng, jobs, memory, config, prepare = _wide_kv_case(name)
    errors = _run(rng, jobs, memory, config=config, prepare=prepare)
    assert errors == [OK] * len(jobs)
    assert _outputs(jobs, errors) >= 1000


@pytest.mark.parametrize("module, old, new", [
    # an int16 k/v wrapped to kv_bits instead of saturated
    ("kv_sequencer", "saturate(head.word_select(j, 16).as_signed(), EB)", "head.word_select(j, 16).as_signed()"),
    # an int8 k/v in the element's low bits instead of its top 8
    ("kv_sequencer", "<< (EB - nx.ACT_BITS))[:EB]", ")[:EB]"),
    # a partial APPEND merging the old entry's elements as bytes
    ("kv_buffer", "old.word_select(b, eb))", "old.word_select(b, 8))")],
    ids=["wrap", "low-bits", "byte-merge"])
def test_a_wide_kv_mutation_is_caught(monkeypatch, module, old, new):
    """test_wide_kv_elements's b4kv12 jobs fail on the RTL with the element path mutated."""
    import importlib
    import sys
    from sequencer_cases import mutant
    bad = mutant(importlib.import_module(f"dfvg_hw.{module}"), old, new, shared=())
    if module == "kv_buffer":
        monkeypatch.setattr("dfvg_hw.kv_sequencer.KVBuffer", bad.KVBuffer)
    else:
        monkeypatch.setattr(sys.modules[__name__], "KvSequencer", bad.KvSequencer)
    rng, jobs, memory, config, prepare = _wide_kv_case("b4kv12")
    with pytest.raises(AssertionError):
        _run(rng, jobs, memory, config=config, prepare=prepare)


def _small_int16_queries(rng, vmem_jobs, config):
    """VMEM bytes where the IN16 jobs' queries lie, rewritten as int16 mostly inside the
    11-bit range (random VMEM is mostly past it, which the saturation test covers)."""
    def write(vmem):
        L = config.vmem_line_bytes
        for job in vmem_jobs:
            start, count = job["src"] * L, job["n"] * job["k"]
            q = rng.integers(-1100, 1100, count).astype("<i2")
            q[:4] = [1023, -1023, 1024, -1024]
            vmem[start:start + 2 * count] = np.frombuffer(q.tobytes(), np.uint8)
    return write


@pytest.mark.parametrize("name", ["b1", "b4"])
def test_int16_queries(name):
    """ATTN IN16: each head's q is 2k bytes, read as int16 saturated to ±1023 (11 bits),
    against the functional model; GQA and MHA, narrow and wide outputs, heads at byte
    offsets that are not line-aligned, queries mostly inside the 11-bit range and every
    edge of it; cycles equal to the cycle model's (the longer gather)."""
    config = BANKED.get(name, TINY)
    rng = np.random.default_rng(40 + config.kv_banks)
    jobs = []
    for pos in range(9):
        for layer in range(LAYERS):
            jobs.append(_append(KV_HEADS, TINY.head_dim, int(rng.integers(0, 200)), pos, layer))
        for layer in range(LAYERS):
            n, addr = [(2, GQA2), (4, GQA2_ODD), (2, MHA1), (4, GQA2)][int(rng.integers(4))]
            k = TINY.head_dim if rng.random() < 0.8 else int(rng.integers(3, TINY.head_dim))
            jobs.append(_attn(n, k, int(rng.integers(0, 100)), int(rng.integers(120, 240)), pos,
                              addr, layer, wide=bool(rng.random() < 0.5), in16=True))
    queries = _small_int16_queries(rng, [j for j in jobs if j["opcode"] == Op.ATTN], config)
    errors = _run(rng, jobs, _memory(rng), config=config, prepare=queries)
    assert errors == [OK] * len(jobs)
    assert _outputs(jobs, errors) >= 600


def test_int16_query_spans_and_saturation():
    """An IN16 query spans 2·n·k bytes: one that fits VMEM's end as int8 faults
    BAD_ADDRESS as int16; random VMEM (queries mostly past ±1023) saturates every head."""
    rng = np.random.default_rng(41)
    last = TINY.vmem_bytes // TINY.vmem_line_bytes - 1
    jobs = [_append(2, 16, 5, 0), _append(2, 16, 9, 1), _attn(2, 16, last - 1, 10, 1, GQA2),
            _attn(2, 16, last - 1, 10, 1, GQA2, in16=True), _attn(4, 16, 30, 100, 1, GQA2, in16=True),
            _attn(2, 16, 60, 140, 1, MHA1, wide=True, in16=True)]
    errors = _run(rng, jobs, _memory(rng))
    assert errors == [OK, OK, OK, BAD_ADDRESS, OK, OK]


@pytest.mark.parametrize("name", ["b1", "b4"])
def test_full_context_and_overflow(name):
    """All 64 positions of one layer, attention at the last ones, then POS = kv_positions:
    KV_OVERFLOW for KVAPPEND and ATTN, with nothing changed."""
    config = BANKED.get(name, TINY)
    rng = np.random.default_rng(11)
    P = TINY.kv_positions
    jobs = [_append(2, 16, int(rng.integers(0, 200)), pos, layer=1) for pos in range(P)]
    jobs += [_attn(4, 16, 10, 100, P - 1, GQA2, layer=1, wide=True),
             _attn(2, 16, 20, 140, P - 2, MHA1, layer=1),
             _append(2, 16, 30, P, layer=1), _attn(2, 16, 30, 160, P, GQA2, layer=1),
             _attn(2, 16, 40, 180, P - 1, MHA1, layer=1)]
    errors = _run(rng, jobs, _memory(rng), config=config)
    assert errors[-5:] == [OK, OK, KV_OVERFLOW, KV_OVERFLOW, OK]


def test_faults_in_the_functional_models_order():
    rng = np.random.default_rng(12)
    last = TINY.vmem_bytes // L - 1
    jobs = [_append(2, 16, 0, 0), _append(2, 16, 2, 1), _append(1, 9, 4, 2),
            # PROGRAM: rows ≠ 1 (before the position); KVAPPEND's slots layer·n … past
            # kv_slots = 4 (before the position); k > head_dim
            _append(2, 16, 0, 99, rows=2), _attn(2, 16, 0, 8, 99, GQA2, rows=2),
            _append(2, 16, 0, 99, layer=2), _append(5, 16, 0, 1), _append(1, 16, 0, 1, layer=4),
            _append(3, 16, 0, 1, layer=1), _append(1, 16, 0, 1, layer=0xFFFF),
            _append(2, 17, 0, 1), _attn(2, 17, 0, 8, 1, GQA2),
            # KV_OVERFLOW before the parameter block, the spans and ATTN's slots
            _attn(2, 16, 0, 8, 64, PAST_END), _append(2, 16, last, 64),
            _attn(2, 16, 0, 8, 64, GQA2, layer=2),
            # G = 0, G > kv_slots, ATTN's slots layer·G … past kv_slots, G not dividing n:
            # PROGRAM before the spans
            _attn(2, 16, last, 8, 1, G0), _attn(5, 16, last, 8, 1, G5),
            _attn(3, 16, last, 8, 1, G3, layer=1), _attn(2, 16, last, 8, 1, GQA2, layer=2),
            _attn(1, 16, last, 8, 1, MHA1, layer=4), _attn(2, 16, last, 8, 1, MHA1, layer=0xFFFF),
            _attn(2, 16, last, 8, 1, G3), _attn(3, 16, last, 8, 1, GQA2), _attn(3, 5, 0, 8, 2, GQA2),
            # BAD_ADDRESS: the KV row, q, the output (narrow fits, wide does not)
            _append(2, 16, last - 2, 1), _attn(2, 16, last, 8, 2, GQA2),
            _attn(2, 16, 8, last, 2, GQA2), _attn(2, 16, 8, last - 1, 2, GQA2),
            _attn(2, 16, 8, last - 1, 2, GQA2, wide=True),
            # the parameter block past device memory: the port refuses, the bench resets
            # the sequencer; the KV contents survive the reset
            _attn(2, 16, 8, 20, 2, PAST_END),
            _attn(4, 16, 8, 24, 2, GQA2), _attn(2, 16, 8, 40, 2, MHA1, wide=True),
            # the last slot exactly: layer 3 of one KV head, layer 1 of two, layer 0 of three
            _append(1, 16, 8, 2, layer=3), _attn(2, 16, 8, 60, 2, MHA1, layer=3),
            _attn(4, 16, 8, 70, 2, GQA2, layer=1), _attn(3, 16, 8, 90, 2, G3),
            # n = 0 does nothing but check (KVAPPEND: no slots, so any layer)
            _attn(0, 16, 8, 60, 2, GQA2), _append(0, 16, 8, 3), _append(0, 16, 8, 3, layer=9)]
    errors = _run(rng, jobs, _memory(rng))
    assert errors == [OK, OK, OK] + [PROGRAM] * 9 + [KV_OVERFLOW] * 3 + [PROGRAM] * 9 \
        + [BAD_ADDRESS] * 3 + [OK, BAD_ADDRESS, BAD_ADDRESS, OK, OK] + [OK] * 7


def test_clear_zeroes_kv():
    """A soft reset between appends: attention afterwards sees zeros where the appends
    before it were, and the appends after it (2 KV banks: the clear covers every bank)."""
    rng = np.random.default_rng(13)
    jobs = [_append(2, 16, 2 * p, p, layer) for p in range(4) for layer in range(2)]
    jobs += [_attn(2, 16, 40, 100, 3, GQA2, layer=1), {"opcode": Op.NOP},
             _append(2, 16, 50, 1, 1), _attn(4, 16, 60, 120, 3, GQA2, layer=1, wide=True),
             _attn(2, 16, 60, 140, 2, MHA1, layer=0)]
    errors = _run(rng, jobs, _memory(rng), clear_adapter=True, config=BANKED["b2"])
    assert errors == [OK] * len(jobs)


def test_one_word_entries_and_a_wide_bus():
    """head_dim 32 with reduce 32: one KV word per entry (no row packing), heads over
    three VMEM lines, wide outputs over five; a 256-bit bus, so the parameter blocks sit
    at several offsets inside a beat."""
    config = TINY.with_changes(head_dim=32, reduce=32, kv_positions=12)
    rng = np.random.default_rng(14)
    jobs = []
    for pos in range(6):
        jobs += [_append(2, int(rng.choice([32, 32, 19])), int(rng.integers(0, 150)), pos, layer)
                 for layer in range(2)]
        jobs.append(_attn(4, int(rng.choice([32, 23])), int(rng.integers(0, 100)),
                          int(rng.integers(100, 230)), pos, [GQA2, GQA2_ODD, MHA1][pos % 3],
                          layer=pos % 2, wide=bool(pos % 2)))
    errors = _run(rng, jobs, _memory(rng), config=config, data_width=256)
    assert errors == [OK] * len(jobs)


def test_long_entries_v_rows_pace_the_weights():
    """head_dim 64 with reduce 4: 16 KV words an entry, so a head's V rows (a row every 16
    cycles through the V gearbox, its read going out once the K read has ended) and not
    its scores decide when its weights first meet V; cycles equal to the cycle model's,
    whose V terms only this configuration exercises."""
    config = TINY.with_changes(head_dim=64, reduce=4, kv_positions=8)
    rng = np.random.default_rng(16)
    jobs = []
    for pos in range(5):
        jobs += [_append(2, int(rng.choice([64, 40])), int(rng.integers(0, 150)), pos, layer)
                 for layer in range(2)]
        jobs.append(_attn(int(rng.choice([2, 4])), int(rng.choice([64, 37])),
                          int(rng.integers(0, 100)), int(rng.integers(100, 200)), pos,
                          [GQA2, MHA1][pos % 2], layer=pos % 2, wide=bool(pos % 2)))
    errors = _run(rng, jobs, _memory(rng), config=config)
    assert errors == [OK] * len(jobs)


@pytest.mark.parametrize("line", WIDE_LINES)
def test_wider_lines(line):
    """VMEM lines of 32 and 64 bytes (heads of a line, 2 KV banks at 64): KVAPPEND and
    ATTN gather and scatter heads at byte offsets inside the wider lines, as the
    functional model, in the cycle model's cycles."""
    config, data_width = wide_line(line, TINY.with_changes(kv_positions=8))
    if line == 64:
        config = config.with_changes(kv_banks=2)
    D = config.head_dim
    rng = np.random.default_rng(15 + line)
    jobs = []
    for pos in range(4):
        jobs += [_append(2, int(rng.choice([D, D, D - 7])), int(rng.integers(0, 150)), pos, layer)
                 for layer in range(2)]
        jobs.append(_attn(4, int(rng.choice([D, D - 9])), int(rng.integers(0, 100)),
                          int(rng.integers(100, 230)), pos, [GQA2, GQA2_ODD, MHA1][pos % 3],
                          layer=pos % 2, wide=bool(pos % 2)))
    errors = _run(rng, jobs, _memory(rng), config=config, data_width=data_width)
    assert errors == [OK] * len(jobs)


#: an ATTN parameter block with G = 4: all of tiny's KV slots as layer 0's KV heads
G4 = 0x3070
#: (config, data_width) of the streamed-append cases: 16-byte lines and heads of one
#: line (two KV words an entry); heads of four lines into 2 banks (an entry a word, so
#: a head's lines take longer than its APPEND); 64-byte lines into 8 banks (alveo-u55c's)
STREAMED = {"l16": (TINY.with_changes(kv_positions=8), 128),
            "l16-d64-b2": (TINY.with_changes(head_dim=64, kv_banks=2, kv_positions=8), 128),
            "l64-b8": (wide_line(64, TINY.with_changes(kv_positions=8))[0].with_changes(kv_banks=8),
                       512)}


@pytest.mark.parametrize("name", list(STREAMED))
def test_streamed_appends(name):
    """KVAPPENDs of 4 KV heads of any k (odd ones too, so the V half starts inside a
    line and heads end inside lines) from rows at any line, two at a position (the second
    leaving the first's bytes past its k), read back by ATTNs of 4 query heads over the 4
    KV heads at k = head_dim, halfway and over every position (every byte of every entry
    counts); VMEM and errors as the functional model's, every job in the cycle model's
    cycles."""
    config, data_width = STREAMED[name]
    D, lines = config.head_dim, config.vmem_bytes // config.vmem_line_bytes
    rng = np.random.default_rng(60 + D + config.kv_banks)
    memory = _memory(rng)
    block = np.zeros(ATTN_PARAM_BYTES // 4, "<u4")
    block[:2] = [int(rng.integers(200, 4000)) | 16 << 16, 4]
    memory.write(G4, block.tobytes())
    positions = 8 if D == 16 else 3
    jobs = []
    for pos in range(positions):
        for k in (int(rng.choice([D, int(rng.integers(1, D))])), int(rng.integers(1, D))):
            row_lines = -(-8 * k // config.vmem_line_bytes)
            jobs.append(_append(4, k, int(rng.integers(0, lines // 2 - row_lines)), pos))
        if pos in (positions // 2, positions - 1):
            jobs.append(_attn(4, D, int(rng.integers(0, lines // 2)),
                              int(rng.integers(lines // 2, lines - 8)), pos, G4, wide=pos % 2))
    errors = _run(rng, jobs, memory, config=config, data_width=data_width)
    assert errors == [OK] * len(jobs)
    assert sum(j["n"] * j["k"] for j in jobs if j["opcode"] == Op.KVAPPEND) >= 500


@pytest.mark.parametrize("name", ["b1", "b2"])
def test_lint_clean(name):
    seq = KvSequencer(BANKED.get(name, TINY), 128)
    clean, output = verilator_lint(to_verilog(seq, "kv_sequencer"), "kv_sequencer")
    assert clean, output


def test_slot_base_sequences_and_their_boundary():
    """kv_slot_base (the request's first KV slot, docs/isa.md §1.4): two sequences of
    1 layer × 2 KV heads and one of 2 layers × 1, at bases 0, 2 and 1, appends and ATTN
    interleaved position by position, each reading back only its own slots (the ATTN
    outputs differ wherever a base were ignored); then the boundary: base + (layer +
    1)·G = kv_slots exactly is OK, one slot more is PROGRAM for KVAPPEND (n = 0 included)
    and for ATTN, before the position and the spans; a 16-bit base far past the buffer."""
    rng = np.random.default_rng(15)
    jobs = []
    for pos in range(6):
        for base in (2, 0):
            jobs.append(_append(2, 16, int(rng.integers(0, 200)), pos, base=base))
        for base, (n, addr) in ((0, (4, GQA2)), (2, (2, GQA2_ODD)), (2, (4, GQA2)), (0, (2, MHA1))):
            jobs.append(_attn(n, 16, int(rng.integers(0, 120)), int(rng.integers(120, 240)), pos,
                              addr, wide=bool(rng.random() < 0.5), base=base))
    ok = len(jobs)
    last = TINY.vmem_bytes // L - 1
    jobs += [_append(1, 16, 8, 6, layer=1, base=2), _attn(2, 16, 8, 60, 6, MHA1, layer=1, base=2),
             _append(1, 16, 8, 6, layer=0, base=3), _attn(2, 16, 8, 70, 6, MHA1, layer=0, base=3),
             _attn(4, 16, 8, 80, 6, GQA2, layer=0, base=2), _append(0, 16, 8, 3, layer=9, base=4),
             # one slot too many: PROGRAM (KVAPPEND's before KV_OVERFLOW), before the spans
             _append(2, 16, last, 99, base=3), _append(1, 16, 8, 6, layer=1, base=3),
             _append(0, 16, 8, 3, base=5), _attn(2, 16, last, 8, 6, GQA2, base=3),
             _attn(2, 16, 8, 60, 6, MHA1, layer=3, base=1), _append(1, 16, 8, 6, base=0xFFFF),
             _attn(2, 16, 8, 60, 6, MHA1, base=0xFFFF),
             # KV_OVERFLOW still comes first for ATTN (its slots wait for G)
             _attn(2, 16, 8, 60, 64, GQA2, base=3)]
    errors = _run(rng, jobs, _memory(rng))
    assert errors == [OK] * (ok + 6) + [PROGRAM] * 7 + [KV_OVERFLOW]
    assert _outputs(jobs, errors) >= 1000


# -- tree rows and compaction (docs/isa.md §9.2, §9.3) --------------------------------------
#: the marker opcode of a compaction job in :class:`TreeAdapter`
COMPACT = Op.HALT
#: tree configurations: tiny's KV (2 layers × 2 KV heads) at 1, 2 and 4 banks; 4 rows, so
#: the functional model takes a tree forward of up to 4 rows
TREE = {"b1": TINY.with_changes(rows=4), "b2": BANKED["b2"].with_changes(rows=4),
        "b4": BANKED["b4"].with_changes(rows=4)}


class TreeAdapter(wiring.Component):
    """Test adapter standing in for the controller around a tree forward: job ``i``'s
    path port answers from ``paths[i]`` (the positions of its path, as the controller's
    ancestor table does); a job's ``slot_base`` comes from bits 48-63 of its ``addr``; a
    ``COMPACT`` job is a compaction instead (``kv_pos`` → base, ``n`` → width, ``k`` →
    count, ``addr`` → rows, ``dst`` → slot_base, ``src`` → slots), its ``done`` the
    sequencer's ``compact_done``."""

    def __init__(self, sequencer: KvSequencer, paths: list, config=TINY):
        self.sequencer, self.paths = sequencer, paths
        super().__init__(OpSequencerSignature(config, 128))

    def elaborate(self, platform):
        m = Module()
        seq = m.submodules.sequencer = self.sequencer
        _pass_through_but_job(m, self, seq)
        p = self.job.payload
        compact = p.opcode == COMPACT
        m.d.comb += [seq.job.payload.eq(p), seq.job.payload.addr.eq(p.addr[:48]),
                     seq.slot_base.eq(p.addr[48:]),
                     seq.job.valid.eq(self.job.valid & ~compact),
                     seq.compact.valid.eq(self.job.valid & compact),
                     seq.compact.payload.base.eq(p.kv_pos), seq.compact.payload.width.eq(p.n),
                     seq.compact.payload.count.eq(p.k), seq.compact.payload.rows.eq(p.addr),
                     seq.compact.payload.slot_base.eq(p.dst), seq.compact.payload.slots.eq(p.src),
                     self.job.ready.eq(Mux(compact, seq.compact.ready, seq.job.ready)),
                     self.done.eq(seq.done | seq.compact_done),
                     self.error.eq(Mux(seq.compact_done, OK, seq.error))]
        flat = [pos for path in self.paths for pos in (list(path) + [0] * PATH_ENTRIES)[:PATH_ENTRIES]]
        table = m.submodules.paths = Memory(shape=16, depth=max(len(flat), 1), init=flat)
        port = table.read_port(domain="comb")
        jobs = Signal(range(len(self.paths) + 2))
        with m.If(self.job.valid & self.job.ready):
            m.d.sync += jobs.eq(jobs + 1)
        m.d.comb += [port.addr.eq((jobs - 1) * PATH_ENTRIES + seq.path_index),
                     seq.path_pos.eq(port.data)]
        return m


def _tree_model_cycles(config, job: dict) -> int:
    """The cycle model's count for one job of :class:`TreeAdapter` as the op bench counts
    it (from the hand-over to ``done``): a compaction's
    :func:`~sim.attention_timing.compaction_cycles`, a KVAPPEND's or ATTN's (any
    ``kv_pos``, ``prefix``, ``path_len``) less the controller's unit overhead."""
    if job["opcode"] == COMPACT:
        return compaction_cycles(config, job["k"], job["src"])
    if job["opcode"] == Op.KVAPPEND:
        return kvappend_cycles(config, job["n"], job["k"], job["src"],
                               bool(job.get("flags", 0) & Flag.WIDE)) - UNIT_OVERHEAD
    port = CycleModel(config.with_changes(mem_port_bits=128)).port
    return attn_job_cycles(port, config, job["n"], job["k"], job["src"], job["dst"],
                           job["prefix"], job["path_len"], bool(job.get("flags", 0) & Flag.WIDE),
                           job["addr"] & ((1 << 48) - 1)) - UNIT_OVERHEAD


class TreeRun:
    """Steps of a tree test: each is the RTL's jobs (a tree forward's rows one job each,
    as the controller issues them) and what the functional model does for the same step
    (``FunctionalEngine._unit`` over all rows with the tree's registers, or ``_compact``),
    with the error codes the RTL jobs must end with."""

    def __init__(self, config):
        self.config = config
        self.jobs, self.paths, self.expected, self.references = [], [], [], []

    def _add(self, jobs, reference, errors=None):
        self.jobs += jobs
        self.paths += [job.pop("path", ()) for job in jobs]
        self.expected += errors or [OK] * len(jobs)
        self.references.append(reference)

    def chain(self, job, base=0, error=OK):
        """A chain job (``pos`` its POS) that ends with ``error`` in the model too."""
        base = job.pop("slot_base", base)
        job = chain_kv_fields(job)

        def reference(engine):
            engine.kv_slot_base = base
            ins = Instruction(Op(job["opcode"]), flags=job.get("flags", 0), rows=1,
                              dst=job.get("dst", 0), src=job["src"], n=job["n"], k=job["k"],
                              addr=job.get("addr", 0))
            assert functional_reference(engine, ins, pos=job["pos"], layer=job["layer"]) == error
        self._add([job | {"addr": job.get("addr", 0) | base << 48}], reference, [error])

    def level(self, opcode, tree: TreeState, pitch, layer, n, k, src, dst=0, addr=0,
              wide=False):
        """A tree forward's KVAPPEND or ATTN of level ``tree.level``: ``W`` single-row jobs
        (row ``r`` at ``src + r·pitch``, KV at ``S(d, r)``, ATTN over ``P0`` positions and
        the row's path)."""
        d, W, P0 = tree.level, tree.width, tree.base
        flags = Flag.WIDE if wide else 0
        jobs = [dict(opcode=opcode, flags=flags, rows=1, n=n, k=k, src=src + r * pitch,
                     dst=dst + r * pitch, addr=addr, pos=P0 + d - 1, layer=layer,
                     kv_pos=tree.storage(d, r), prefix=P0, path_len=d,
                     path=tree.attended(r)[P0:]) for r in range(W)]
        snapshot = TreeState(W, P0, d, [0] * W, [list(p) for p in tree.paths], [0] * W)

        def reference(engine):
            engine.kv_slot_base = 0
            ins = Instruction(opcode, flags=flags, rows=W, dst=dst, src=src, n=n, k=k, addr=addr)
            assert functional_reference(engine, ins, pos=P0 + d - 1, layer=layer, pitch=pitch,
                                        tree=snapshot) == OK
        self._add(jobs, reference)

    def compaction(self, comp: Compaction, slot_base=0):
        fields = comp.fields()
        job = dict(opcode=COMPACT, rows=0, kv_pos=comp.base, n=comp.width, k=len(comp.rows),
                   addr=fields["compact_rows"], dst=slot_base, src=comp.slots)

        def reference(engine):
            engine.kv_slot_base = slot_base
            engine._compact(comp)
        self._add([job], reference)

    def check(self, rng, memory, min_attn=0):
        """Run the RTL jobs and the model's steps from the same random VMEM; compare the
        error codes, VMEM and every OK job's cycles with the cycle model's."""
        c = self.config
        vmem = rng.integers(0, 256, c.vmem_bytes, dtype=np.uint8)
        dut = TreeAdapter(KvSequencer(c, 128), self.paths, c)
        cycles = []
        after, errors = run_jobs(c, dut, vmem, memory, self.jobs, cycles=cycles)
        assert errors == self.expected
        engine = FunctionalEngine(c, memory)
        engine.vmem[:] = vmem
        for reference in self.references:
            reference(engine)
        np.testing.assert_array_equal(after, engine.vmem)
        timed = [(job, got) for job, got, e in zip(self.jobs, cycles, errors) if e == OK]
        assert [got for _, got in timed] == [_tree_model_cycles(c, job) for job, _ in timed]
        attn = sum(j["opcode"] == Op.ATTN and e == OK for j, e in zip(self.jobs, errors))
        assert attn >= min_attn, attn
        return errors


def _grow(tree: TreeState, rng) -> None:
    """The next level of ``tree``: each row's parent a random row of the current level."""
    W = tree.width
    parents = [int(rng.integers(0, W)) for _ in range(W)] if tree.level else [0] * W
    tree.paths = [(tree.paths[p] if tree.level else []) + [r] for r, p in enumerate(parents)]
    tree.level += 1


def _tree_request(run: TreeRun, rng, W, P0, levels, pitch=12):
    """One tree request's KV work: chain KVAPPENDs of both layers for positions 0 … P0 − 1
    (every tenth one followed by an ATTN), then for levels 1 … ``levels`` the tree
    forward's KVAPPEND and ATTN rows of both layers (random paths, 2 or 4 query heads
    over 2 KV heads or 1, narrow or wide, sometimes a short k); returns the tree."""
    for pos in range(P0):
        for layer in range(LAYERS):
            run.chain(_append(KV_HEADS, 16, int(rng.integers(0, 200)), pos, layer))
        if pos % 10 == 9:
            run.chain(_attn(2, 16, 30, 150, pos, GQA2, layer=int(rng.integers(LAYERS))))
    tree = TreeState(W, P0)
    for _ in range(levels):
        _grow(tree, rng)
        for layer in range(LAYERS):
            k = TINY.head_dim if rng.random() < 0.8 else int(rng.integers(5, TINY.head_dim))
            run.level(Op.KVAPPEND, tree, pitch, layer, KV_HEADS, k, int(rng.integers(0, 60)))
        for layer in range(LAYERS):
            n, addr = [(2, GQA2), (4, GQA2_ODD), (2, MHA1), (4, GQA2)][int(rng.integers(4))]
            k = TINY.head_dim if rng.random() < 0.8 else int(rng.integers(3, TINY.head_dim))
            run.level(Op.ATTN, tree, pitch, layer, n, k, int(rng.integers(0, 60)),
                      int(rng.integers(110, 256 - 8 - 3 * pitch)), addr,
                      wide=bool(rng.random() < 0.5))
    return tree


@pytest.mark.parametrize("name", ["b1", "b2", "b4"])
def test_tree_rows_random(name):
    """Random tree requests against the functional model's tree forward: the chain
    inputs, then each level's KVAPPEND rows at S(d, r) and ATTN rows over P0 positions and
    their random root-to-node paths (every path entry read through the path port, in any
    bank), W = 1 … 4; then the accepted path's compaction and chain ATTNs over the
    compacted context. Every job's cycles equal the cycle model's."""
    config = TREE[name]
    rng = np.random.default_rng(30 + config.kv_banks)
    run = TreeRun(config)
    for W, P0, levels in [(int(rng.integers(2, 5)), int(rng.integers(1, 12)), int(rng.integers(2, 5))),
                          (int(rng.integers(1, 5)), int(rng.integers(1, 20)), int(rng.integers(1, 4)))]:
        tree = _tree_request(run, rng, W, P0, levels)
        accepted = [int(rng.integers(0, W)) for _ in range(int(rng.integers(1, levels + 1)))]
        run.compaction(Compaction(P0, W, tuple(accepted), LAYERS * KV_HEADS))
        for layer in range(LAYERS):
            run.chain(_attn(4, 16, 20, 200, P0 + len(accepted) - 1, GQA2, layer, wide=True))
        # positions past the compacted ones keep the tree's entries
        run.chain(_attn(2, 16, 20, 220, tree.storage(levels, W - 1), GQA2, 1))
    run.check(rng, _memory(rng), min_attn=16)


def test_tree_edges_and_faults():
    """A tree whose last level ends at the last KV position (KVAPPEND at kv_positions − 1,
    ATTN with prefix + path_len = kv_positions is OK); then the faults: KVAPPEND at
    kv_pos = kv_positions, ATTN one position over (KV_OVERFLOW); ATTN with prefix 0 or a
    path longer than PATH_ENTRIES (PROGRAM, before the overflow); each leaves the KV as it
    was (the last ATTN reads it all). Compactions of no level and of no slot do nothing."""
    config = TREE["b2"]
    rng = np.random.default_rng(33)
    P = config.kv_positions
    run = TreeRun(config)
    W, levels = 3, 2
    P0 = P - (levels * W)                 # level 2's last row at P − 1
    tree = _tree_request(run, rng, W, P0, levels, pitch=10)
    assert tree.storage(levels, W - 1) == P - 1
    row = dict(opcode=Op.ATTN, flags=0, rows=1, n=2, k=16, src=12, dst=160, addr=GQA2, pos=0,
               layer=1)
    # prefix + path_len = kv_positions exactly, the path's last entry the last position
    run._add([dict(row, prefix=P - 2, path_len=2, path=(P - 4, P - 1))],
             _same_as_row(row, P - 2, (P - 4, P - 1)))
    faults = [dict(opcode=Op.KVAPPEND, rows=1, n=2, k=16, src=3, pos=0, layer=0, kv_pos=P),
              dict(row, prefix=P - 1, path_len=2, path=(P - 3, P - 1)),
              dict(row, prefix=0, path_len=1, path=(5,)),
              dict(row, prefix=P, path_len=PATH_ENTRIES + 1),
              dict(row, prefix=70000 - P, path_len=3)]
    run._add(faults, lambda engine: None, [KV_OVERFLOW, KV_OVERFLOW, PROGRAM, PROGRAM, KV_OVERFLOW])
    for comp in (Compaction(P0, W, (), 4), Compaction(P0, W, (2, 1), 0)):
        run.compaction(comp)
    run.chain(_attn(4, 16, 20, 200, P - 1, GQA2, 0, wide=True))
    run.chain(_attn(2, 16, 30, 220, P - 1, MHA1, 1))
    run.check(rng, _memory(rng))


def _same_as_row(row, prefix, path):
    """The functional model's step for one extra ATTN row: numerics.attention of each
    head over positions ``0 … prefix − 1`` and ``path``, written at the row's ``dst``."""
    from dfvg_hw.spec import numerics as nx

    def reference(engine):
        positions = list(range(prefix)) + list(path)
        block = engine.memory.view(row["addr"], ATTN_PARAM_BYTES).view("<u4")
        mult, shift, groups = int(block[0]) & 0xFFFF, int(block[0]) >> 16 & 0x3F, int(block[1])
        n, k = row["n"], row["k"]
        q = engine.vmem[row["src"] * L:row["src"] * L + n * k].view(np.int8).reshape(n, k)
        slot = row["layer"] * groups
        out = [nx.attention(q[h], engine.kv_k[slot + h // (n // groups), positions, :k],
                            engine.kv_v[slot + h // (n // groups), positions, :k], mult, shift, 8)
               for h in range(n)]
        engine.vmem[row["dst"] * L:row["dst"] * L + n * k] = np.concatenate(out).astype(np.int8).view(np.uint8)
    return reference


@pytest.mark.parametrize("name", ["b1", "b4"])
def test_compaction_random(name):
    """Random compactions against FunctionalEngine._compact: KV filled by chain KVAPPENDs
    at every position, then compactions of random base, width (1 … 16), levels (1 … 16),
    rows, and slot ranges (kv_slot_base and slots, the other slots untouched), each
    followed by ATTNs over every position of both layers (every K and V byte of every
    entry counts); cycles equal to compaction_cycles."""
    config = TREE[name].with_changes(kv_positions=40)      # fewer positions to fill and read
    rng = np.random.default_rng(34 + config.kv_banks)
    P, S = config.kv_positions, config.kv_slots
    run = TreeRun(config)
    for pos in range(P):
        for layer in range(LAYERS):
            run.chain(_append(KV_HEADS, 16, int(rng.integers(0, 200)), pos, layer))
    for i in range(8):
        width = int(rng.choice([1, 2, 3, int(rng.integers(1, 17))]))
        levels = int(rng.integers(1, 17))
        while True:
            base = int(rng.integers(0, P))
            rows = tuple(int(r) for r in rng.integers(0, width, levels))
            if Compaction(base, width, rows, 1).moves()[-1][0] < P:
                break
            levels = max(1, levels - 1)
        slot_base = int(rng.integers(0, S))
        slots = int(rng.integers(1, S - slot_base + 1))
        run.compaction(Compaction(base, width, rows, slots), slot_base)
        for layer in range(LAYERS):
            run.chain(_attn(2 if i % 2 else 4, 16, 20, 200 + 8 * layer, P - 1, GQA2, layer,
                            wide=bool(i % 2)))
    run.check(rng, _memory(rng))


def test_a_path_mutation_is_caught(monkeypatch):
    """The tree check can fail: a path read one entry off (path_index + 1) gives other
    ATTN outputs than the functional model's."""
    import dfvg_hw.kv_buffer as kv_module
    from sequencer_cases import mutant
    config = TREE["b1"]
    rng = np.random.default_rng(35)
    run = TreeRun(config)
    _tree_request(run, rng, 2, 3, 1)
    run.check(np.random.default_rng(36), _memory(np.random.default_rng(37)))
    bad = mutant(kv_module, "m.d.comb += path_index.eq(path_i)",
                 "m.d.comb += path_index.eq(path_i + 1)")
    monkeypatch.setattr("dfvg_hw.kv_sequencer.KVBuffer", bad.KVBuffer)
    with pytest.raises(AssertionError):
        run.check(np.random.default_rng(36), _memory(np.random.default_rng(37)))


def _parameter_overlap_jobs(rng):
    """Appends at positions 0 … 3, then ATTN of every kind (n = 1 … 4, a G of 1 or 2,
    narrow and wide, q lines apart) and n = 0."""
    jobs = [_append(KV_HEADS, 16, int(rng.integers(0, 200)), pos, layer)
            for pos in range(4) for layer in range(LAYERS)]
    jobs += [_attn(n, k, int(rng.integers(0, 120)), int(rng.integers(120, 240)), 3, addr, layer,
                   wide=wide)
             for n, k, addr, layer, wide in ((2, 16, GQA2, 0, False), (4, 11, GQA2, 1, True),
                                             (1, 16, MHA1, 1, False), (3, 16, G3, 0, True),
                                             (0, 16, GQA2, 0, False))]
    return jobs


@pytest.mark.parametrize("latency_ns", [100.0, 10.0])
def test_parameter_read_overlap(latency_ns):
    """ATTN's parameter block is read while SET_POS and q[0]'s gather run: DIVIDE starts
    the cycle after the later of the block's ``done`` and the gather's end (the block
    last with tiny's 10-cycle latency, about even at 1 cycle), cycle-exact with the
    cycle model and with the functional model's outputs."""
    config = TINY.with_changes(mem_latency_ns=latency_ns)
    rng = np.random.default_rng(41)
    jobs = _parameter_overlap_jobs(rng)
    errors = _run(rng, jobs, _memory(rng), config=config)
    assert errors == [OK] * len(jobs)


@pytest.mark.parametrize("edits", [
    # the block taken a cycle late: only once latched
    [("with m.If(params.done | params_in):", "with m.If(params_in):")],
    # ... or before it is in (G, mult and shift of the previous job, or of reset)
    [("with m.If(params.done | params_in):", "with m.If(1):")],
    # n / G over all 16 bits of n again, its leading zeros not skipped
    [("steps.eq(n_bits)]", "steps.eq(N_BITS)]"),
     ("dividend.eq(job.n << n_zeros)", "dividend.eq(job.n)")]],
    ids=["late", "early", "full-divide"])
def test_a_parameter_overlap_mutation_is_caught(monkeypatch, edits):
    """test_parameter_read_overlap's jobs fail on the RTL with the overlap mutated."""
    import importlib.util
    import inspect
    import sys
    import dfvg_hw.kv_sequencer as kv_module
    source = inspect.getsource(kv_module)
    for old, new in edits:
        assert source.count(old) == 1, old
        source = source.replace(old, new)
    spec = importlib.util.spec_from_loader(kv_module.__name__ + "_mutant", loader=None)
    bad = importlib.util.module_from_spec(spec)
    exec(compile(source, kv_module.__file__, "exec"), bad.__dict__)
    monkeypatch.setattr(sys.modules[__name__], "KvSequencer", bad.KvSequencer)
    rng = np.random.default_rng(41)
    jobs = _parameter_overlap_jobs(rng)
    with pytest.raises(AssertionError):
        _run(rng, jobs, _memory(rng))
