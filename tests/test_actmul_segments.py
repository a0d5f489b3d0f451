"""The compiler's gated activation: one ACTMUL a layer over all the MLP's channel groups,
their parameter blocks one after the other (docs/isa.md §3.8, §4.5, §4.7)."""

import struct

import numpy as np
import pytest

from dfvg_hw.spec.config import get_preset
from dfvg_hw.spec.image import ACT_PARAM_BYTES
from dfvg_hw.spec.isa import Op, decode


@pytest.mark.parametrize("preset", ["tiny", "tiny-hbm"])     # engine beats of 16 and 64 bytes
def test_one_actmul_a_layer_over_its_groups_blocks(tiny_draft_dir, preset):
    """The groups are 8, 8, 16 and the rest whatever the VMEM line, one ACTMUL a layer has
    a segment for each, and its k blocks lie one after the other at its address (a layer
    block's parts are aligned to the engine beat: the blocks must be one part), each naming
    its group's first channel."""
    from dfvg_host.compiler import compile_draft
    compiled = compile_draft(tiny_draft_dir, get_preset(preset))
    groups = compiled.manifest["layout"]["act_groups"]
    assert groups == [8, 8, 16, 32]
    actmuls = [ins for ins in map(decode, compiled.program) if ins.opcode == Op.ACTMUL]
    assert actmuls and all((ins.k, ins.n) == (len(groups), sum(groups)) for ins in actmuls)
    for ins in actmuls:
        blocks = compiled.image[ins.addr:ins.addr + len(groups) * ACT_PARAM_BYTES]
        heads = [struct.unpack_from("<2I", blocks, s * ACT_PARAM_BYTES) for s in range(len(groups))]
        assert [first for _, first in heads] == list(np.cumsum([0] + groups[:-1]))
        assert all(word & 0xFFFF for word, _ in heads)           # every segment has a multiplier
