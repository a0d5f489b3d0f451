"""ProgramFlow RTL against sim.program_flow.ProgramFlow: random instruction streams retired
into both, every register compared after every instruction, faults included; chain and
tree requests (NEXT entering the tree forward at ``tree_pc``, TREE_LEVEL)."""

from __future__ import annotations

import numpy as np

from dfvg_hw.spec.descriptors import ErrorCode
from dfvg_hw.spec.isa import Cond, Op
from dfvg_hw.program_flow import ProgramFlow
from sim.program_flow import CONTROL_OPS, ControlFault, ProgramFlow as ModelProgramFlow
from dfvg_hw.verilog import to_verilog
from sim.lint import verilator_lint
from sim.testbench import run_simulation, stream_put


def random_retire(rng, model: ModelProgramFlow) -> dict:
    """The next retired instruction: mostly what a well-formed program does at this point,
    sometimes something a malformed one does."""
    r = rng.random()
    if model.samples_now and r < 0.5:
        return {"opcode": Op.SAMPLE, "token": int(rng.integers(0, 1 << 16))}
    choices = [Op.NEXT, Op.LOOP, Op.ENDLOOP, Op.BRANCH, Op.MATMUL, Op.SAMPLE, Op.HALT, Op.NOP]
    weights = np.array([4, 2, 3, 3, 4, 0.5, 0.3, 1.0])
    op = Op(int(rng.choice([int(c) for c in choices], p=weights / weights.sum())))
    ins = {"opcode": op}
    if op == Op.LOOP:
        ins.update(n=int(rng.choice([0, 1, 2, 3, 65535], p=[0.05, 0.3, 0.3, 0.3, 0.05])),
                   addr=int(rng.integers(0, 1 << 32)))
    elif op in (Op.NEXT, Op.BRANCH):
        ins["n"] = int(rng.integers(0, 1 << 16))
        if op == Op.BRANCH:
            ins["flags"] = int(rng.choice([Cond.ALWAYS, Cond.NO_SAMPLE]))
    elif op == Op.SAMPLE:
        ins["token"] = int(rng.integers(0, 1 << 16))
    return ins


class _Ins:
    """The attribute view of a retired instruction that ModelProgramFlow.control reads."""

    def __init__(self, d):
        self.opcode, self.flags, self.n, self.addr = d["opcode"], d.get("flags", 0), d.get("n", 0), d.get("addr", 0)


def model_retire(model: ModelProgramFlow, ins: dict) -> ErrorCode | None:
    """Retire ``ins`` into the functional model's sequencer exactly as FunctionalEngine does."""
    try:
        if ins["opcode"] in CONTROL_OPS:
            model.control(_Ins(ins))
        elif ins["opcode"] == Op.SAMPLE:
            model.drafted(ins["token"])
            model.pc += 1
        else:
            model.pc += 1
    except ControlFault as fault:
        return fault.code
    return None


def test_sequencer_matches_the_functional_model():
    rng = np.random.default_rng(1)
    dut = ProgramFlow()
    trials = []
    for _ in range(300):
        tokens = [int(t) for t in rng.integers(0, 1 << 16, int(rng.integers(1, 5)))]
        tree = (int(rng.integers(1, 5)), int(rng.integers(0, 1 << 16))) if rng.random() < 0.5 else (0, 0)
        trials.append((tokens, int(rng.integers(0, 1000)), int(rng.integers(0, 6)), tree))
    stats = {"steps": 0, "faults": 0, "halts": 0, "drafted": 0, "tree_forwards": 0}

    def state(ctx, tokens):
        token = ctx.get(dut.drafted_token) if ctx.get(dut.token_is_drafted) else tokens[ctx.get(dut.in_idx)]
        return {"pc": ctx.get(dut.pc), "pos": ctx.get(dut.pos), "token": token,
                "layer": ctx.get(dut.layer), "lstride": ctx.get(dut.lstride),
                "samples_now": bool(ctx.get(dut.samples_now)), "n_drafted": ctx.get(dut.n_drafted),
                "forwards": ctx.get(dut.forwards), "halted": bool(ctx.get(dut.halted)),
                "tree_level": ctx.get(dut.tree_level), "tree_forward": bool(ctx.get(dut.tree_forward))}

    def expect(model):
        return {"pc": model.pc, "pos": model.pos, "token": model.token, "layer": model.layer,
                "lstride": model.lstride, "samples_now": model.samples_now,
                "n_drafted": model.n_drafted, "forwards": model.forwards, "halted": model.halted,
                "tree_level": model.tree_level, "tree_forward": model.tree_forward}

    async def tb(ctx):
        for tokens, start_pos, n_draft, (tree_width, tree_pc) in trials:
            model = ModelProgramFlow(tokens, start_pos, n_draft, tree_width=tree_width, tree_pc=tree_pc)
            await stream_put(ctx, dut.start, {"start_pos": start_pos, "n_tokens": len(tokens),
                                              "n_draft": n_draft, "tree_width": tree_width,
                                              "tree_pc": tree_pc})
            assert state(ctx, tokens) == expect(model)
            for _ in range(80):
                ins = random_retire(rng, model)
                pc_before = model.pc
                code = model_retire(model, ins)
                await stream_put(ctx, dut.retire, {"token": 0, "flags": 0, "n": 0, "addr": 0, **ins})
                stats["steps"] += 1
                if code is not None:
                    assert ctx.get(dut.fault.valid) and not ctx.get(dut.running)
                    assert (ctx.get(dut.fault.code), ctx.get(dut.fault.pc)) == (code, pc_before)
                    stats["faults"] += 1
                    break
                assert not ctx.get(dut.fault.valid)
                assert state(ctx, tokens) == expect(model), f"after {ins}"
                stats["tree_forwards"] += ins["opcode"] == Op.NEXT and model.tree_forward
                if model.halted:
                    assert not ctx.get(dut.running) and not ctx.get(dut.retire.ready)
                    stats["halts"] += 1
                    break
            stats["drafted"] += model.n_drafted

    run_simulation(dut, tb)
    assert stats["steps"] >= 1000 and stats["faults"] >= 10 and stats["halts"] >= 3
    assert stats["drafted"] >= 20 and stats["tree_forwards"] >= 15, stats


def test_lint_clean():
    clean, output = verilator_lint(to_verilog(ProgramFlow(), "sequencer"), "sequencer")
    assert clean, output
