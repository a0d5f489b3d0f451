"""The MATMUL weight prefetch (controller.py, matmul_sequencer.py): a MATMUL right after an
RMSNORM, an ATTN or an ACTMUL of a chain forward has its first pass's weight reads issued
while that unit still runs, once the unit's last read is out and the memory port is
read-idle. The cycle model prices it (``CycleModel.prefetch_at`` / ``prefetch_head``) and
must equal the RTL's per-unit counters; the drafted tokens must not change.

The engine is ``tiny`` with 8 lanes, where gamma beats (``2·lanes`` bytes) are whole
16-byte lines, so RMSNORM prefetches as well (at 4 lanes it gives no prefetch), and a
memory latency of 200 cycles instead of 10: the head starts RMSNORM (13 cycles), ACTMUL
(37) and ATTN (128) give then hide only part of it, so every cycle of them shows in
MATMUL's count (at 10 cycles every head start would hide it all, and an off-by-one in
the prefetch's timing would go unseen).
"""

from __future__ import annotations

import pytest

from dfvg_hw.spec.config import get_preset
from dfvg_hw.spec.isa import Op, assemble, decode
from dfvg_hw.spec.regmap import OP_CYCLE_BUCKETS, op_cycles_offset
from dfvg_host.driver import DraftDevice
from sim.cycle_model import CycleModel
from sim.device import SimDevice
from sim.rtl_device import RtlDevice

ENGINE = get_preset("tiny").with_changes(lanes=8, mem_latency_ns=2000.0)


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    from dfvg_host.compiler import compile_draft
    from dfvg_host.fixtures import make_tiny_llama
    pytest.importorskip("torch")
    return compile_draft(make_tiny_llama(tmp_path_factory.mktemp("prefetch"), layers=1), ENGINE)


def _draft(device, compiled):
    dev = DraftDevice(device, compiled, timeout_s=600)
    out = dev.draft([5, 17], 1)
    units = {b: device.read32(op_cycles_offset(b)) for b in OP_CYCLE_BUCKETS}
    device.close()
    return out.tokens, out.cycles, units


def test_the_model_gives_each_unit_a_head_start(compiled):
    """Each of RMSNORM, ATTN and ACTMUL is followed by a MATMUL in the program, and each
    gives it a head start that saves cycles (whatever the RTL then says: the next test)."""
    model = CycleModel(ENGINE)
    words = [decode(int(w)) for w in compiled.program]
    words = words[:[ins.opcode for ins in words].index(Op.HALT)]      # the chain forward's
    seen = set()
    for prev, ins in zip(words, words[1:]):
        if ins.opcode != Op.MATMUL or prev.opcode not in (Op.RMSNORM, Op.ATTN, Op.ACTMUL):
            continue
        cycles, _ = model.instruction(prev, pos=1)
        head = model.prefetch_head(model.prefetch_at(prev), cycles)
        assert head > 0, prev.opcode.name
        plain = model.instruction(ins, pos=1)[0]
        assert model.instruction(ins, pos=1, head=head)[0] < plain, prev.opcode.name
        assert model.instruction(ins, pos=1, head=head + 1)[0] < model.instruction(
            ins, pos=1, head=head)[0], prev.opcode.name
        seen.add(prev.opcode)
    assert seen == {Op.RMSNORM, Op.ATTN, Op.ACTMUL}


def test_prefetched_matmuls_on_the_rtl_equal_the_model(compiled):
    """The Amaranth engine drafts what the sim device drafts, and every OP_CYCLES counter
    (MATMUL's shortened by the prefetch, the units it overlaps unchanged) equals the
    cycle model's."""
    expected = _draft(SimDevice(ENGINE), compiled)
    got = _draft(RtlDevice(ENGINE), compiled)
    assert got == expected


class _KeepOpen:
    """A device whose ``close`` does nothing, so that ``run`` can drive it again."""

    def __init__(self, device):
        self.device = device

    def close(self):
        pass

    def __getattr__(self, name):
        return getattr(self.device, name)


@pytest.mark.parametrize("fault", ["range", "decode"])
def test_a_fault_after_a_prefetch_leaves_the_memory_path_clean(fault):
    """An RMSNORM prefetches the MATMUL after it, which then faults with its weight reads
    in flight: in its sequencer's RANGE (its source outside VMEM: BAD_ADDRESS), or before
    it runs, in the controller's DECODE (a LOGITS of two rows in a chain forward:
    PROGRAM; the wide read path is still lent to the prefetch then). The drain empties
    them, FINISH takes the loan back, and the next request on the same engine (a forward
    whose MATMUL prefetches too) is the sim device's, cycles included."""
    from dfvg_hw.spec.descriptors import DraftRequest, ErrorCode
    from dfvg_host.fixtures import TINY_NORM, TINY_WEIGHTS
    from test_rtl_device import run, same

    up, logits = hex(TINY_WEIGHTS["up"][0]), hex(TINY_WEIGHTS["logits"][0])
    head = f"""
        embed rows=1, dst=0, n=16, addr=0
        rmsnorm rows=1, dst=4, src=0, n=16, addr={hex(TINY_NORM)}, wide"""
    faulting = head + {
        "range": f"""
        matmul rows=1, dst=8, src={ENGINE.vmem_bytes // 16 - 1}, n=24, k=16, addr={up}, mode=int8, wide
        halt""",
        "decode": f"""
        matmul rows=2, dst=8, src=4, n=40, k=16, addr={logits}, mode=logits, wide
        halt"""}[fault]
    forward = head + f"""
        matmul rows=1, dst=0, src=4, n=40, k=16, addr={logits}, mode=logits, wide
        sample n=40
        halt"""
    results = {}
    for name, make in (("rtl", RtlDevice), ("sim", SimDevice)):
        device = make(ENGINE)
        keep = _KeepOpen(device)
        first = run(keep, faulting, DraftRequest([3], start_pos=0, n_draft=0, seq=1))
        second = run(keep, forward, DraftRequest([7], start_pos=1, n_draft=1, topk=4, seq=2))
        device.close()
        results[name] = first, second
    assert results["sim"][0][0].status == {"range": ErrorCode.BAD_ADDRESS,
                                           "decode": ErrorCode.PROGRAM}[fault]
    assert results["sim"][1][0].status == ErrorCode.OK
    for rtl, ref in zip(results["rtl"], results["sim"]):
        same(rtl, ref)
    # the forward's MATMUL was prefetched (the model's head start behind the RMSNORM)
    model = CycleModel(ENGINE)
    norm = decode(assemble(forward)[1])
    assert model.prefetch_at(norm, addr=TINY_NORM + 0) is not None
