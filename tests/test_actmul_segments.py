"""The compiler's gated activation: one ACTMUL a layer over all the MLP's channel groups,
their parameter blocks one after the other (docs/isa.md §3.8, §4.5, §4.7)."""

import struct

import numpy as np
import pytest

from dfvg_hw.spec import numerics as nx
from dfvg_hw.spec.config import get_preset
from dfvg_hw.spec.image import ACT_PARAM_BYTES, unpack_requant_records, weight_area_bytes
from dfvg_hw.spec.isa import Op, decode


@pytest.mark.parametrize("preset", ["tiny", "tiny-hbm"])     # engine beats of 16 and 64 bytes
def test_one_actmul_a_layer_over_its_groups_blocks(tiny_draft_dir, preset):
    """The groups are 8, 8, 16 and the rest whatever the VMEM line, one ACTMUL a layer has
    a segment for each, and its k blocks lie one after the other at its address (a layer
    block's parts are aligned to the engine beat: the blocks must be one part), each naming
    its group's first channel; the first block carries h's row exponent budget."""
    from dfvg_host.compiler import compile_draft
    compiled = compile_draft(tiny_draft_dir, get_preset(preset), row_exponents=True)
    groups = compiled.manifest["layout"]["act_groups"]
    assert groups == [8, 8, 16, 32]
    actmuls = [ins for ins in map(decode, compiled.program) if ins.opcode == Op.ACTMUL]
    assert actmuls and all((ins.k, ins.n) == (len(groups), sum(groups)) for ins in actmuls)
    for ins in actmuls:
        blocks = compiled.image[ins.addr:ins.addr + len(groups) * ACT_PARAM_BYTES]
        heads = [struct.unpack_from("<2I", blocks, s * ACT_PARAM_BYTES) for s in range(len(groups))]
        assert [first & 0xFFFF for _, first in heads] == list(np.cumsum([0] + groups[:-1]))
        assert [first >> 16 for _, first in heads] == [nx.ROW_EXP_MAX] + [0] * (len(groups) - 1)
        assert all(word & 0xFFFF for word, _ in heads)           # every segment has a multiplier


@pytest.mark.parametrize("preset", ["tiny", "tiny-hbm"])
def test_row_exponents_reach_the_down_projection_unclipped(tiny_draft_dir, preset):
    """Each layer's ACTMUL measures h's row exponents and its down projection (the next
    MATMUL, which reads h) takes them; every down requant shift is at least the budget E,
    so ``max(shift − e, 0)`` never clips (numerics.md §13.2). No other MATMUL reads them."""
    from dfvg_host.compiler import compile_draft
    config = get_preset(preset)
    compiled = compile_draft(tiny_draft_dir, config, row_exponents=True)
    program = list(map(decode, compiled.program))
    flagged = [i for i, ins in enumerate(program) if ins.rowexp]
    actmuls = [i for i, ins in enumerate(program) if ins.opcode == Op.ACTMUL]
    assert actmuls and flagged == sorted(actmuls + [i + 1 for i in actmuls])
    for i in actmuls:
        down = program[i + 1]
        assert down.opcode == Op.MATMUL and down.src == program[i].dst
        area = weight_area_bytes(down.n, down.k, config.lanes, config.reduce, down.blocks)
        records = np.frombuffer(compiled.image, np.uint8)[down.addr + area:]
        mult, shift, _ = unpack_requant_records(records, down.n, config.lanes, down.bias)
        assert (shift[mult > 0] >= nx.ROW_EXP_MAX).all(), shift.min()


def test_without_row_exponents_h_has_one_static_scale(tiny_draft_dir):
    """With ``--no-row-exponents`` the compiler keeps one static scale for h: no ROWEXP
    anywhere, no exponent budget in the ACTMUL blocks, and h's scale 2^8 coarser than with
    them (numerics.md §13.2); a bias-free Llama gets them by default."""
    from dfvg_host.compiler import H_FINE_BITS, compile_draft
    config = get_preset("tiny")
    on = compile_draft(tiny_draft_dir, config, row_exponents=True)
    off = compile_draft(tiny_draft_dir, config, row_exponents=False)
    assert compile_draft(tiny_draft_dir, config).program == on.program
    assert not any(ins.rowexp for ins in map(decode, off.program))
    for ins in (ins for ins in map(decode, off.program) if ins.opcode == Op.ACTMUL):
        assert struct.unpack_from("<2I", off.image, ins.addr)[1] >> 16 == 0
    for a, b in zip(on.manifest["scales"]["layers"], off.manifest["scales"]["layers"]):
        assert b["down_in"] == pytest.approx(a["down_in"] * 2 ** H_FINE_BITS)


def test_gate_and_up_are_int16_rows_of_the_gateup_matmul(tiny_draft_dir):
    """The gated MLP's gate and up are int16 (numerics.md §13.2): the gate/up MATMUL writes
    them with OUT16 into a region of 4·intermediate bytes and the ACTMUL that reads them
    has IN16; its blocks are knot tables (every knot's slope its value change to the next,
    so the table is continuous), and its group scales 2^8 finer than int8's."""
    from dfvg_host.compiler import allocate_vmem, compile_draft
    config = get_preset("tiny")
    compiled = compile_draft(tiny_draft_dir, config)
    program = list(map(decode, compiled.program))
    actmuls = [i for i, ins in enumerate(program) if ins.opcode == Op.ACTMUL]
    assert actmuls
    for i in actmuls:
        gateup, act = program[i - 1], program[i]
        assert gateup.opcode == Op.MATMUL and gateup.out16 and gateup.dst == act.src
        assert act.in16 and not act.ungated
        for s in range(act.k):
            table = np.frombuffer(compiled.image, "<i2", 256, act.addr + s * ACT_PARAM_BYTES + 16)
            values, slopes = table[0::2].astype(int), table[1::2].astype(int)
            assert (values[1:] == values[:-1] + slopes[:-1]).all()
    shape = compiled.shape
    vmem = allocate_vmem(shape, config)
    assert (vmem["h"] - vmem["gateup"]) * config.vmem_line_bytes >= 4 * shape.intermediate
    for layer in compiled.manifest["scales"]["layers"]:
        assert max(layer["gate"]) < 1e-2 and max(layer["up"]) < 1e-2
