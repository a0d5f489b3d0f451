"""The ``rtl`` device (DraftEngine in Amaranth's simulator) against the ``sim`` device
(the functional model): the same register and memory traffic, the same results.

Each case loads a program, writes a request, starts it and reads the result descriptor
and the registers back, on both devices. Everything must agree bit for bit except the
cycle counts (the RTL's are measured, the functional model's come from the cycle model)
and the check word that covers them.
"""

from __future__ import annotations

import pytest

from dfvg_hw.spec import numerics as nx
from dfvg_hw.spec.descriptors import DraftRequest, DraftResult, ErrorCode, result_bytes
from dfvg_hw.spec.isa import assemble, to_bytes
from dfvg_hw.spec.regmap import OP_CYCLE_BUCKETS, Control, Irq, MemoryMap, Reg, Status, op_cycles_offset
from dfvg_hw.spec.config import get_preset
from sim.device import SimDevice
from sim.rtl_device import RtlDevice
from sim.verilator_device import VerilatorDevice
from dfvg_host.fixtures import TINY, TINY_FORWARD as FORWARD, TINY_NORM, TINY_WEIGHTS, tiny_image as image

# TINY, the image and the FORWARD program are shared with benchmarks/rtl_sim_speed.py.


def run(device, program, request: DraftRequest, *, load: bool = True):
    """Drive ``device`` as the driver does with ``program`` (assembly text or words);
    return (result or None, registers, raw result bytes)."""
    w = device.write32
    device.dma_write(MemoryMap.IMAGE, image())
    w(Reg.IMAGE_BASE_LO, MemoryMap.IMAGE)
    w(Reg.IRQ_ENABLE, Irq.DONE)
    if program is not None:
        words = assemble(program) if isinstance(program, str) else program
        device.dma_write(MemoryMap.PROGRAM, to_bytes(words))
        w(Reg.PROG_BASE_LO, MemoryMap.PROGRAM)
        w(Reg.PROG_LEN, len(words))
    if load:
        w(Reg.CONTROL, Control.LOAD_PROGRAM)
    device.dma_write(MemoryMap.REQUEST[0], request.pack())
    device.dma_write(MemoryMap.RESULT[0], bytes(result_bytes(TINY.topk_max, 4)))
    w(Reg.REQ0_LO, MemoryMap.REQUEST[0])
    w(Reg.RES0_LO, MemoryMap.RESULT[0])
    w(Reg.IRQ_STATUS, 0xFFFFFFFF)
    w(Reg.CONTROL, Control.START)
    assert device.wait_irq(120.0), "no completion interrupt"
    regs = {r: device.read32(r) for r in (Reg.STATUS, Reg.ERROR, Reg.ERROR_PC, Reg.LAST_SEQ,
                                          Reg.IRQ_STATUS)}
    regs["units"] = {b: device.read32(op_cycles_offset(b)) for b in OP_CYCLE_BUCKETS}
    regs["cycles"] = device.read32(Reg.CYCLES_LO)
    raw = device.dma_read(MemoryMap.RESULT[0], result_bytes(TINY.topk_max, 4))
    device.close()
    try:
        result = DraftResult.unpack(raw, TINY.topk_max)
    except ValueError:
        result = None
    return result, regs, raw


def same(rtl, ref):
    """Compare everything, cycle counts included: the RTL measures them, the sim device
    takes them from the cycle model, and on a request that completes the two agree for
    every unit. (A fault stops the RTL part-way through an instruction, which the model
    does not follow, so there only the units counted must be the same.)"""
    (r_res, r_regs, r_raw), (f_res, f_regs, f_raw) = rtl, ref
    r_units, f_units = r_regs.pop("units"), f_regs.pop("units")
    r_cycles, f_cycles = r_regs.pop("cycles"), f_regs.pop("cycles")
    assert r_regs == f_regs
    if f_res is None:
        assert r_res is None and r_raw == f_raw
    else:
        assert r_res is not None, "the RTL's result buffer does not parse"
        for field in ("seq", "status", "end_pos", "n_forward", "error_pc", "topk", "tokens"):
            assert getattr(r_res, field) == getattr(f_res, field), field
        assert r_res.cycles > 0
    assert sum(f_units.values()) == f_cycles
    if r_cycles:
        assert sum(r_units.values()) == r_cycles
        assert {b for b, n in r_units.items() if n} == {b for b, n in f_units.items() if n}
        if f_res is not None and f_res.status == ErrorCode.OK:
            assert r_units == f_units
            assert r_res.cycles == f_res.cycles


CASES = {
    "halt": ("halt", DraftRequest([5], start_pos=3, n_draft=0, seq=11), ErrorCode.OK),
    "forwards": ("""
        embed rows=1, dst=0, n=16, addr=0
        nop
        next n=0
        halt""", DraftRequest([1, 2, 511], start_pos=7, n_draft=0, seq=12), ErrorCode.OK),
    "layer_loop": ("""
        loop n=3, addr=64
        nop
        endloop
        branch cond=no_sample, n=4
        halt
        next n=0
        halt""", DraftRequest([9, 8], start_pos=0, n_draft=0, seq=13), ErrorCode.OK),
    "illegal": (assemble("nop") + [0xFF], DraftRequest([1], start_pos=0, n_draft=0, seq=14),
                ErrorCode.ILLEGAL_INSTRUCTION),
    "sample_without_logits": ("sample n=4\nhalt", DraftRequest([1], start_pos=0, n_draft=1, seq=15),
                              ErrorCode.PROGRAM),
    "next_without_sample": ("next n=0\nhalt", DraftRequest([1], start_pos=0, n_draft=2, seq=16),
                            ErrorCode.PROGRAM),
    "past_the_program": ("nop", DraftRequest([1], start_pos=0, n_draft=0, seq=17), ErrorCode.PROGRAM),
    "watchdog": ("branch n=0", DraftRequest([1], start_pos=0, n_draft=0, seq=18), ErrorCode.WATCHDOG),
    "bad_request": ("halt", DraftRequest([1], start_pos=0, n_draft=0, topk=0, seq=19),
                    ErrorCode.BAD_REQUEST),
    "bad_token": ("halt", DraftRequest([1, TINY.vocab_max], start_pos=0, n_draft=0, seq=20),
                  ErrorCode.BAD_REQUEST),
    "embed_outside_vmem": (f"embed rows=1, dst={TINY.vmem_bytes // 16 - 1}, n=16, addr=0\nhalt",
                           DraftRequest([3], start_pos=0, n_draft=0, seq=21), ErrorCode.BAD_ADDRESS),
}


T_MULT, T_SHIFT = nx.host_temperature(0.8)
LOGITS, UP, DOWN = (hex(TINY_WEIGHTS[name][0]) for name in ("logits", "up", "down"))
NORM = hex(TINY_NORM)
CASES.update({
    "greedy_drafts": (FORWARD, DraftRequest([3, 7], start_pos=5, n_draft=4, topk=4, seq=30),
                      ErrorCode.OK),
    "sampled_drafts": (FORWARD, DraftRequest([3, 7, 11], start_pos=0, n_draft=4, topk=3, sample=True,
                                             t_mult=T_MULT, t_shift=T_SHIFT, seed=99, counter=5,
                                             seq=31), ErrorCode.OK),
    "two_row_passes": (f"""
        embed rows=1, dst=0, n=16, addr=0
        embed rows=1, dst=4, n=16, addr=0
        rmsnorm rows=2, dst=8, src=0, n=16, addr={NORM}, wide
        matmul rows=2, dst=12, src=8, n=24, k=16, addr={UP}, mode=int8, wide
        matmul rows=2, dst=0, src=12, n=16, k=24, addr={DOWN}, mode=resadd
        rmsnorm rows=1, dst=8, src=4, n=16, addr={NORM}
        matmul rows=1, dst=0, src=8, n=40, k=16, addr={LOGITS}, mode=logits
        sample n=40
        halt""", DraftRequest([9], start_pos=0, n_draft=1, topk=4, seq=32), ErrorCode.OK),
    "weights_past_memory": (f"matmul rows=1, dst=0, src=0, n=40, k=16, addr={TINY.mem_bytes - 0x200000}, "
                            "mode=logits, wide\nhalt", DraftRequest([1], start_pos=0, n_draft=0, seq=33),
                            ErrorCode.BAD_ADDRESS),
    "logits_with_two_rows": (f"matmul rows=2, dst=0, src=0, n=40, k=16, addr={LOGITS}, mode=logits\nhalt",
                             DraftRequest([1], start_pos=0, n_draft=0, seq=34), ErrorCode.PROGRAM),
    "result_outside_vmem": (f"matmul rows=1, dst={TINY.vmem_bytes // 16 - 1}, src=0, n=24, k=16, "
                            f"addr={UP}, mode=int8\nhalt", DraftRequest([1], start_pos=0, n_draft=0, seq=35),
                            ErrorCode.BAD_ADDRESS),
})

#: learned positions (OPT, EMBED POSITION): the table's row of POS, then logits from it;
#: the last request's second forward is past the KV positions
POSITION = f"""
    embed rows=1, dst=0, n=16, addr=0, position
    branch cond=no_sample, n=4
    matmul rows=1, dst=8, src=0, n=40, k=16, addr={LOGITS}, mode=logits, wide
    sample n=40
    next n=0
    halt"""
CASES.update({
    "embed_position": (POSITION, DraftRequest([3, 7], start_pos=5, n_draft=2, topk=4, seq=50), ErrorCode.OK),
    "embed_position_overflow": (POSITION, DraftRequest([3], start_pos=TINY.kv_positions - 1, n_draft=2,
                                                       topk=4, seq=52), ErrorCode.KV_OVERFLOW),
})

#: two layers of one KV head, their entries appended at slot kv_slot_base + LAYER
#: (docs/isa.md §1.4): the last two slots exactly, one past them (PROGRAM at layer 1, the
#: KVAPPEND's pc), and a base whose layer 0 is already past the buffer
KV_LAYERS = """
    embed rows=1, dst=0, n=16, addr=0
    loop n=2, addr=0
    kvappend rows=1, src=0, n=1, k=16
    endloop
    halt"""
CASES.update({
    f"kv_slot_base_{base}": (KV_LAYERS, DraftRequest([3, 9], start_pos=4, n_draft=0, seq=40 + base,
                                                     kv_slot_base=base), status)
    for base, status in ((TINY.kv_slots - 2, ErrorCode.OK), (TINY.kv_slots - 1, ErrorCode.PROGRAM),
                         (TINY.kv_slots, ErrorCode.PROGRAM))})


DEVICES = {"rtl": RtlDevice, "rtl+verilator": VerilatorDevice}
#: The cases the Amaranth-simulated device runs too: Verilator runs every case of the same
#: generated design, and an ``rtl`` device costs ~5 s to elaborate per case; these cover
#: its drafting, its row passes, its faults (unit, memory, control, watchdog) and KV slots.
AMARANTH_CASES = ("sampled_drafts", "two_row_passes", "embed_position_overflow", "kv_slot_base_3",
                  "result_outside_vmem", "illegal", "watchdog")


@pytest.mark.parametrize("device, name", [("rtl+verilator", name) for name in CASES]
                         + [("rtl", name) for name in AMARANTH_CASES])
def test_rtl_device_matches_the_sim_device(name, device):
    program, request, status = CASES[name]
    ref = run(SimDevice(TINY), program, request)
    rtl = run(DEVICES[device](TINY), program, request)
    assert ref[0] is not None and ref[0].status == status
    if status == ErrorCode.OK:
        assert len(ref[0].tokens) == request.n_draft
    same(rtl, ref)


def test_embed_row_ending_inside_a_beat():
    """On a 256-bit port a 48-byte row (12 int32) ends half-way into its second beat; the
    line left over must not become the first line of the next EMBED (the logits and the
    sampled token depend on it)."""
    wide_port = TINY.with_changes(mem_port_bits=256)
    program = f"""
        embed rows=1, dst=8, n=12, addr=0
        embed rows=1, dst=0, n=16, addr=0
        matmul rows=1, dst=0, src=0, n=40, k=16, addr={LOGITS}, mode=logits, wide
        sample n=40
        halt"""
    request = DraftRequest([2], start_pos=0, n_draft=1, topk=4, seq=40)
    ref = run(SimDevice(wide_port), program, request)
    assert ref[0].status == ErrorCode.OK
    same(run(RtlDevice(wide_port), program, request), ref)


@pytest.mark.parametrize("device", list(DEVICES))
def test_embed_rows_padded_to_the_engine_beat(device):
    """At tiny-hbm (four 128-bit channels: a 64-byte engine beat) a 12-entry int32 row (48
    bytes) is padded to 64 (``embed_row_stride``): token 5's row is at ``addr + 320``, not
    ``addr + 240``, on both sides; the logits read it back, so the sampled token, its q and
    the top-k depend on which row was read. The striped read path carries the token, the
    row and the weights, and every OP_CYCLES counter equals the cycle model's."""
    hbm = get_preset("tiny-hbm")
    program = f"""
        embed rows=1, dst=0, n=12, addr=0
        matmul rows=1, dst=8, src=0, n=40, k=16, addr={LOGITS}, mode=logits, wide
        sample n=40
        halt"""
    request = DraftRequest([5], start_pos=0, n_draft=1, topk=4, seq=41)
    ref = run(SimDevice(hbm), program, request)
    assert ref[0].status == ErrorCode.OK
    same(run(DEVICES[device](hbm), program, request), ref)


def test_start_without_a_program():
    request = DraftRequest([1], start_pos=0, n_draft=0, seq=3)
    ref = run(SimDevice(TINY), None, request, load=False)
    rtl = run(RtlDevice(TINY), None, request, load=False)
    assert ref[1][Reg.ERROR] == ErrorCode.PROGRAM and ref[1][Reg.STATUS] & Status.ERROR
    same(rtl, ref)
