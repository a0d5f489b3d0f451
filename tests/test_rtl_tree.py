"""Tree drafting on the RTL engine (docs/isa.md §9) against the functional model.

* The controller's tree registers against :class:`sim.tree_state.TreeState`: tokens,
  storage positions, the level's overflow and every path position, over random levels.
* Random tree sessions (:mod:`sim.tree_cases`) on the compiled tiny draft: greedy and
  sampled trees of random prompts and depths, the next request compacting a random
  accepted path and drafting on from it, chain requests in between, and faults (tree fields
  refused, a tree past the KV buffer, a width the program was not compiled for). Every
  result equals the ``sim`` device's bit for bit (records with their parents, status,
  ``end_pos``, ``n_forward``, ``error_pc``) and cycle for cycle (every ``OP_CYCLES``
  counter and the result's count), on ``rtl+verilator://tiny``, on ``tiny-hbm`` (four
  memory channels, two KV banks) and, one short tree, on the Amaranth-simulated engine.

``python benchmarks/cycle_model_vs_rtl.py --tree N`` runs N such sessions (3 requests each).
"""

from __future__ import annotations

import collections

import numpy as np
import pytest

from dfvg_hw.spec.config import get_preset
from dfvg_hw.spec.descriptors import DraftRequest, ErrorCode
from dfvg_hw.spec.regmap import Reg
from dfvg_hw.tree_registers import TreeRegisters
from sim import tree_cases
from sim.device import SimDevice
from sim.rtl_device import RtlDevice
from sim.testbench import run_simulation
from sim.tree_state import TreeState
from sim.verilator_device import VerilatorDevice

TINY = get_preset("tiny")


def test_tree_registers_follow_tree_state():
    """Random levels of random sources: each row's token, storage, the level's overflow and
    the path port's every entry as TreeState has them (rows 4, so that the row and source
    fields are wider than a bit)."""
    c = TINY.with_changes(rows=4)
    dut = TreeRegisters(c)
    rng = np.random.default_rng(5)
    checked = collections.Counter()

    async def tb(ctx):
        for _ in range(30):
            width = int(rng.integers(1, c.rows + 1))
            base = int(rng.integers(0, c.kv_positions))
            model = TreeState(width, base)
            ctx.set(dut.start, 1)
            ctx.set(dut.width, width)
            ctx.set(dut.base, base)
            await ctx.tick()
            ctx.set(dut.start, 0)
            for level in range(int(rng.integers(1, 64 // width + 1))):
                picks = [(int(rng.integers(0, 1 if level == 0 else width)), int(rng.integers(0, 1 << 16)))
                         for _ in range(width)]
                model.paths = [model.paths[s] + [r] for r, (s, _) in enumerate(picks)]
                model.tokens, model.level = [t for _, t in picks], level + 1
                ctx.set(dut.expand_level, level)
                for r in rng.permutation(width):        # any order: the new paths are apart
                    ctx.set(dut.expand.valid, 1)
                    ctx.set(dut.expand.payload, {"row": int(r), "source": picks[r][0], "token": picks[r][1]})
                    await ctx.tick()
                ctx.set(dut.expand.valid, 0)
                ctx.set(dut.commit, 1)
                await ctx.tick()
                ctx.set(dut.commit, 0)
                ctx.set(dut.level, level + 1)
                for r in range(width):
                    ctx.set(dut.row, r)
                    assert ctx.get(dut.token) == model.tokens[r]
                    assert ctx.get(dut.storage) == model.storage(level + 1, r)
                    assert ctx.get(dut.level_overflow) == (model.storage(level + 1, width - 1) >= c.kv_positions)
                    checked["overflow"] += ctx.get(dut.level_overflow)
                    for j, position in enumerate(model.attended(r)[base:]):
                        ctx.set(dut.path_index, j)
                        assert ctx.get(dut.path_pos) == position % (1 << 16), (r, j)
                        checked["path"] += 1

    run_simulation(dut, tb)
    assert checked["path"] > 5000 and checked["overflow"] > 100


def _sessions(compiled, config, device, scripts: int, seed: int):
    """Run ``scripts`` random sessions on ``device`` (soft reset between them) and on fresh
    sim devices; return the disagreements and what the reference runs covered."""
    rng = np.random.default_rng(seed)
    bad, seen = [], collections.Counter()
    for i in range(scripts):
        requests, want = tree_cases.random_script(rng, compiled, lambda: SimDevice(config))
        tree_cases.soft_reset(device)
        got = tree_cases.run_script(device, compiled, requests)
        bad += [f"script {i}: {what}" for what in tree_cases.compare_runs(compiled, got, want)]
        for request, run in zip(requests, want):
            seen[run.result.status.name] += 1
            if run.result.status == ErrorCode.OK and request.tree_width:
                seen["sampled tree" if request.sample else "greedy tree"] += 1
                seen["compacted"] += request.compaction is not None
                seen["levels"] += request.n_draft
    return bad, seen


@pytest.fixture(scope="module")
def verilator_tiny():
    device = VerilatorDevice(TINY)          # the engine drafts trees as wide as its rows
    yield device
    device.close()


def test_tree_sessions_on_verilator(tiny_compiled, verilator_tiny):
    assert verilator_tiny.read32(Reg.P_TREE_WIDTH) == TINY.rows
    bad, seen = _sessions(tiny_compiled, TINY, verilator_tiny, scripts=30, seed=1)
    assert bad == []
    assert seen["greedy tree"] >= 20 and seen["sampled tree"] >= 10 and seen["compacted"] >= 10, seen
    assert {"BAD_REQUEST", "KV_OVERFLOW", "PROGRAM"} <= set(seen)


def test_tree_sessions_at_tiny_hbm(tiny_draft_dir):
    """Four memory channels and two KV banks: the path entries lie in either bank."""
    from dfvg_host.compiler import compile_draft
    hbm = get_preset("tiny-hbm")
    assert hbm.kv_banks >= 2
    compiled = compile_draft(tiny_draft_dir, hbm)
    device = VerilatorDevice(hbm)
    try:
        bad, seen = _sessions(compiled, hbm, device, scripts=5, seed=2)
    finally:
        device.close()
    assert bad == []
    assert seen["greedy tree"] + seen["sampled tree"] >= 5 and seen["compacted"] >= 1


def test_a_tree_on_the_amaranth_engine(tiny_compiled):
    """One greedy tree of two levels on the Amaranth-simulated engine (the Verilator one
    runs the Verilog Amaranth writes; this runs Amaranth's own simulation of it)."""
    tree = tiny_compiled.tree
    request = DraftRequest([5, 17], 0, 2, topk=3, tree_width=tree.width, tree_pc=tree.pc,
                           row_pitch=tree.row_pitch, seq=9)
    want = tree_cases.run_script(SimDevice(TINY), tiny_compiled, [request])
    got = tree_cases.run_script(RtlDevice(TINY), tiny_compiled, [request])
    assert want[0].result.status == ErrorCode.OK and len(want[0].result.tokens) == 2 * tree.width
    assert tree_cases.compare_runs(tiny_compiled, got, want) == []


def test_the_driver_drafts_trees_on_the_rtl_engine(tiny_compiled, verilator_tiny):
    """``DraftDevice.draft_tree`` and ``commit_tree_path`` through the Verilator engine: the
    driver reads the engine's tree width, its checks of the tree hold, and every tree and
    the compacted KV behind the next one equal the sim device's."""
    from dfvg_host.driver import DraftDevice

    def session(device):
        dev = DraftDevice(device, tiny_compiled, timeout_s=600)
        trees = [dev.draft_tree([5, 17, 99], 3)]
        nodes, path = trees[0].tokens, [2 * tiny_compiled.tree.width - 1]    # level 2's last row
        while nodes[path[0]].parent != -1:
            path.insert(0, nodes[path[0]].parent)
        c = dev.commit_tree_path(path)
        trees.append(dev.draft_tree([nodes[path[-1]].token, 42], 3, sample=True, temperature=0.8,
                                    seed=3, counter=11))
        dev.commit_tree_path([0])
        trees.append(dev.draft([7], 4))
        return c, [(t.tokens, t.end_pos, t.n_forward, t.cycles) for t in trees], dev.kv_length

    tree_cases.soft_reset(verilator_tiny)
    want = session(SimDevice(TINY))
    assert want[0] == 2 and len(want[1][0][0]) == 3 * tiny_compiled.tree.width
    assert session(verilator_tiny) == want
