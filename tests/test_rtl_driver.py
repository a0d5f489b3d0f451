"""The driver on the RTL devices: a tiny Llama draft, compiled by the real compiler,
drafting greedily and sampled on the generated engine (Verilator, and Amaranth's
simulator for a shorter run), against the same driver calls on the sim device.

Tokens, probabilities and top-k lists must be equal bit for bit; so must the KV lengths
and everything the driver reads back. Cycle counts too: the RTL's are measured, the sim
device's come from the cycle model, and they must agree for every unit.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from dfvg_hw.spec.descriptors import ErrorCode
from dfvg_hw.spec.regmap import OP_CYCLE_BUCKETS, Reg, op_cycles_offset
from dfvg_host.driver import DeviceFault, DeviceTimeout, DraftDevice
from dfvg_host.transport import open_transport
from sim.device import SimDevice
from sim.rtl_device import RtlDevice
from sim.verilator_device import VerilatorDevice

PROMPT = [5, 17, 99, 3, 42, 7]
SAMPLED = dict(sample=True, temperature=0.7, topk=3, seed=11, counter=5)


def session(device, compiled, steps):
    """Run ``steps`` (draft and rollback calls) through a driver on ``device``; return what
    the driver saw, and the KV cache the engine holds at the end."""
    dev = DraftDevice(device, compiled, timeout_s=600)
    seen = []
    for kind, args, kwargs in steps:
        if kind == "rollback":
            dev.rollback(*args)
            seen.append(("rollback", dev.kv_length, dev.committed))
        else:
            out = dev.draft(*args, **kwargs)
            units = {b: device.read32(op_cycles_offset(b)) for b in OP_CYCLE_BUCKETS}
            seen.append(("draft", out.tokens, out.end_pos, out.n_forward, dev.kv_length,
                         out.cycles, units))
    if isinstance(device, SimDevice):
        kv = (device.engine.kv_k.copy(), device.engine.kv_v.copy())
    elif isinstance(device, RtlDevice):
        kv = device.kv_contents()
    else:
        kv = None                      # the Verilator harness has no KV read-back
    device.close()
    return seen, kv


def steps_for(n_greedy: int, n_sampled: int, n_last: int = 4, prompt: list[int] = PROMPT):
    return [
        ("draft", (prompt, n_greedy), {}),
        ("rollback", (len(prompt) + 1,), {}),       # keep the first drafted token
        ("draft", ([11, 12], n_sampled), SAMPLED),
        ("rollback", (len(prompt) // 2,), {}),      # back into the prompt: re-draft from there
        ("draft", ([3, 42], n_last), {}),
    ]


@pytest.mark.parametrize("device", ["rtl+verilator", "rtl"])
def test_driver_on_the_rtl_engine_equals_the_sim_device(device, tiny_engine, tiny_compiled):
    # Amaranth's simulator is ~250x slower (~4 s a forward): each draft there is short,
    # after half the prompt
    greedy, sampled, last = (8, 8, 4) if device == "rtl+verilator" else (2, 1, 2)
    steps = steps_for(greedy, sampled, last, PROMPT if device == "rtl+verilator" else PROMPT[:3])
    expected, kv_expected = session(SimDevice(tiny_engine), tiny_compiled, steps)
    make = VerilatorDevice if device == "rtl+verilator" else RtlDevice
    got, kv = session(make(tiny_engine), tiny_compiled, steps)
    assert got == expected
    assert len(expected[0][1]) == greedy and len(expected[2][1]) == sampled
    if kv is not None:                 # the KV cache itself, every layer, head and position
        for rtl_half, model_half in zip(kv, kv_expected):
            np.testing.assert_array_equal(rtl_half, model_half)
        assert np.any(kv_expected[0])


class _SlowClock:
    """The Verilator device, its clock advanced ``cycles`` per interrupt wait (``None``:
    as usual): the driver sees a request outlast its timeout at a cycle that does not
    depend on the host."""

    def __init__(self, device, cycles: int | None):
        self.device, self.cycles = device, cycles

    def wait_irq(self, timeout_s: float) -> bool:
        if self.cycles is None:
            return self.device.wait_irq(timeout_s)
        return self.device.run_cycles(self.cycles)

    def __getattr__(self, name):
        return getattr(self.device, name)


def test_timeout_aborts_the_engine_and_keeps_drafted_tokens(tiny_engine, tiny_compiled):
    """The driver's timeout path writes ABORT: the engine stops before its next instruction
    with ABORTED and writes what it drafted, which the DeviceTimeout carries."""
    reference = DraftDevice(SimDevice(tiny_engine), tiny_compiled).draft([5], 8)
    device = VerilatorDevice(tiny_engine)
    clock = _SlowClock(device, 20_000)
    dev = DraftDevice(clock, tiny_compiled, timeout_s=600)
    dev.timeout_s = 0.0
    with pytest.raises(DeviceTimeout, match="did not finish") as info:
        dev.draft([5], 8)
    drafted = info.value.tokens
    assert 1 <= len(drafted) < 8                     # aborted part-way through the draft loop
    assert drafted == reference.tokens[:len(drafted)]
    assert device.read32(Reg.ERROR) == ErrorCode.ABORTED
    assert dev.committed == 0                        # nothing was committed by the aborted request
    clock.cycles, dev.timeout_s = None, 600          # the engine is idle again and runs the next one
    assert dev.draft([5], 8).tokens == reference.tokens
    device.close()


def test_engine_error_reaches_the_driver(tiny_engine, tiny_compiled):
    """A program fault on the RTL engine raises DeviceFault with the code and the pc,
    as on the sim device."""
    from dfvg_host.compiler import CompiledDraft
    words = list(tiny_compiled.program)
    words[2] = 0xFF                              # an illegal opcode where a real one was
    broken = CompiledDraft(tiny_compiled.image, words, tiny_compiled.manifest)
    faults = []
    for device in (SimDevice(tiny_engine), VerilatorDevice(tiny_engine)):
        dev = DraftDevice(device, broken, timeout_s=600)
        with pytest.raises(DeviceFault) as info:
            dev.draft(PROMPT, 2)
        faults.append((info.value.code, info.value.pc))
        device.close()
    assert faults[0] == faults[1]


@pytest.mark.parametrize("url, kind", [("rtl://tiny", RtlDevice), ("rtl+verilator://tiny", VerilatorDevice)])
def test_rtl_urls_open_the_rtl_devices(url, kind):
    device, config = open_transport(url)
    assert isinstance(device, kind) and config.name == "tiny"
    assert device.read32(Reg.P_LANES) == config.lanes
    device.close()


def _with_char_tokenizer(model_dir, out_dir):
    """A copy of a tiny model directory with a 256-symbol character tokenizer (the tiny
    test models have a vocabulary of 256 and no tokenizer of their own)."""
    import shutil
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    shutil.copytree(model_dir, out_dir)
    vocab = {chr(32 + i): i for i in range(256)}
    core = Tokenizer(models.WordLevel(vocab, unk_token=chr(32)))
    core.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    PreTrainedTokenizerFast(tokenizer_object=core, unk_token=chr(32)).save_pretrained(out_dir)
    return out_dir


def test_generate_runs_end_to_end_on_verilator(tiny_draft_dir, tmp_path, capsys):
    """`dfvg generate --device rtl+verilator://tiny`: a tiny Llama drafting on the Verilated
    engine for itself as the target (so every greedy draft is accepted)."""
    from dfvg_host.cli import main
    model = str(_with_char_tokenizer(tiny_draft_dir, tmp_path / "tiny"))
    runs = {}
    for device in ("rtl+verilator://tiny", "sim://tiny"):
        code = main(["generate", "--target", model, "--draft", model, "--device", device,
                     "--prompt", "hello", "--max-new-tokens", "12", "--gamma", "4", "--json"])
        assert code == 0
        runs[device] = json.loads(capsys.readouterr().out)
    rtl, ref = runs["rtl+verilator://tiny"], runs["sim://tiny"]
    assert len(rtl["token_ids"]) == 12 and rtl["token_ids"] == ref["token_ids"]
    for key in ("acceptance_rate", "drafted_tokens", "accepted_tokens", "acceptance_per_position"):
        assert rtl["metrics"][key] == ref["metrics"][key], key
    assert rtl["metrics"]["labels"]["device_seconds"] == "measured: RTL simulation"
    assert ref["metrics"]["labels"]["device_seconds"] == "modelled: cycle model"


# -- the multi-channel engine (issue #14) ------------------------------------------------
@pytest.fixture(scope="module")
def hbm_compiled(tiny_draft_dir):
    """The tiny draft compiled for tiny-hbm: 4 channels of 128 bits, a 64-byte engine beat
    (every block on it, EMBED rows padded to it), 0.75 beats a cycle a channel."""
    from dfvg_host.compiler import compile_draft
    from dfvg_hw.spec.config import get_preset
    return compile_draft(tiny_draft_dir, get_preset("tiny-hbm"))


#: the fewest calls that run every opcode at least twice (a 2-token prompt and a greedy
#: draft: EMBED from the request and from the sampler, the layer loop, every unit, SAMPLE
#: greedy), a rollback, and a sampled draft (SAMPLE's RNG path)
HBM_STEPS = [("draft", ([5, 17], 2), {}), ("rollback", (3,), {}), ("draft", ([11], 1), SAMPLED)]


@pytest.mark.parametrize("url", ["rtl+verilator://tiny-hbm", "rtl://tiny-hbm"])
def test_multichannel_engine_equals_the_sim_device(url, hbm_compiled):
    """At tiny-hbm the engine stripes every read and write over four AXI masters in
    lockstep, each behind its own slave memory (its own channel, latency and token bucket);
    the driver sees what it sees on ``sim://tiny-hbm`` bit for bit — tokens, q, top-k, KV
    lengths — and every OP_CYCLES counter equals the cycle model's (a per-port rate below
    one beat a cycle, so the model's rate-limited paths are the ones held to the RTL)."""
    sim, config = open_transport("sim://tiny-hbm")
    device, rtl_config = open_transport(url)
    assert config == rtl_config and config.mem_ports == 4 and config.port_beats_per_cycle < 1
    expected, kv_expected = session(sim, hbm_compiled, HBM_STEPS)
    got, kv = session(device, hbm_compiled, HBM_STEPS)
    assert got == expected
    ran = {b for step in expected if step[0] == "draft" for b, n in step[-1].items() if n}
    assert {"EMBED", "RMSNORM", "MATMUL", "ROPE", "KVAPPEND", "ATTN", "ACTMUL", "SAMPLE"} <= ran
    if kv is not None:
        for rtl_half, model_half in zip(kv, kv_expected):
            np.testing.assert_array_equal(rtl_half, model_half)


@pytest.fixture(scope="module")
def two_sequence_draft(tmp_path_factory, tiny_engine):
    """2 layers × 1 KV head: 2 KV slots a sequence, so tiny's 4 slots hold 2 sequences."""
    from dfvg_host.compiler import compile_draft
    from dfvg_host.fixtures import make_tiny_llama
    model = make_tiny_llama(tmp_path_factory.mktemp("two-sequences"), layers=2, heads=2,
                            kv_heads=1, seed=5)
    return compile_draft(model, tiny_engine)


def interleaved(device, compiled, scripts):
    """Run each sequence's ``steps`` through one driver, interleaved step by step (the
    last sequence first); return what each saw, and the engine's KV at the end."""
    dev = DraftDevice(device, compiled, timeout_s=600)
    seen = [[] for _ in scripts]
    for steps in zip(*scripts):
        for index in reversed(range(len(scripts))):
            dev.select_sequence(index)
            kind, args, kwargs = steps[index]
            if kind == "rollback":
                dev.rollback(*args)
                seen[index].append(("rollback", dev.kv_length, dev.committed))
            else:
                out = dev.draft(*args, **kwargs)
                seen[index].append(("draft", out.tokens, out.end_pos, out.n_forward,
                                    dev.kv_length, out.cycles))
    kv = device.kv_contents() if isinstance(device, RtlDevice) else \
        (device.engine.kv_k.copy(), device.engine.kv_v.copy()) if isinstance(device, SimDevice) else None
    device.close()
    return seen, kv


@pytest.mark.parametrize("device", ["rtl+verilator", pytest.param("rtl", marks=pytest.mark.slow)])
def test_interleaved_sequences_on_the_rtl_engine(device, tiny_engine, two_sequence_draft):
    """Two sequences (KV slots 0-1 and 2-3) interleaved on the RTL engine draft exactly
    what each drafts alone on the sim device, cycles included; the Amaranth engine's KV is
    the functional model's, every slot (a request that ignored kv_slot_base would put
    sequence 1 over sequence 0)."""
    if device == "rtl+verilator":
        scripts = [[("draft", (PROMPT, 4), {}), ("rollback", (len(PROMPT) + 1,), {}),
                    ("draft", ([11, 12], 4), SAMPLED)],
                   [("draft", ([9, 250, 31, 8], 4), SAMPLED), ("rollback", (2,), {}),
                    ("draft", ([77], 4), {})]]
    else:                           # Amaranth's simulator: 7 forwards in all
        scripts = [[("draft", (PROMPT[:3], 1), {}), ("draft", ([11], 1), SAMPLED)],
                   [("draft", ([9, 250], 1), SAMPLED), ("draft", ([77], 1), {})]]
    alone = [interleaved(SimDevice(tiny_engine), two_sequence_draft, [s])[0][0] for s in scripts]
    expected, kv_expected = interleaved(SimDevice(tiny_engine), two_sequence_draft, scripts)
    assert expected == alone and alone[0][0][1] != alone[1][0][1]
    make = VerilatorDevice if device == "rtl+verilator" else RtlDevice
    got, kv = interleaved(make(tiny_engine), two_sequence_draft, scripts)
    assert got == alone
    if kv is not None:
        for rtl_half, model_half in zip(kv, kv_expected):
            np.testing.assert_array_equal(rtl_half, model_half)
        assert all(kv_expected[0][slot].any() for slot in range(4))


@pytest.fixture(scope="module", params=["qwen2", "qwen3", "opt"])
def family_compiled(request, tmp_path_factory, tiny_engine):
    """A tiny draft of each family beyond Llama (issue #17): Qwen2's biased q/k/v matmul
    (BIAS), Qwen3's int32 q/k row (INT32) and its per-head RMSNORM (segments), OPT's
    position row (EMBED POSITION) and ungated MLP (ACTMUL UNGATED)."""
    from dfvg_host.compiler import compile_draft
    from dfvg_host.fixtures import TINY_FAMILY_SHAPES, make_tiny_llama
    path = make_tiny_llama(tmp_path_factory.mktemp(request.param), seed=4,
                           **TINY_FAMILY_SHAPES[request.param])
    return compile_draft(path, tiny_engine)


def test_each_family_on_the_verilated_engine_equals_the_sim_device(tiny_engine, family_compiled):
    """Greedy and sampled drafts with rollbacks, bit for bit: tokens, q, top-k, KV lengths
    and every OP_CYCLES counter against the cycle model's."""
    steps = steps_for(4, 4)
    expected, _ = session(SimDevice(tiny_engine), family_compiled, steps)
    got, _ = session(VerilatorDevice(tiny_engine), family_compiled, steps)
    assert got == expected
    assert len(expected[0][1]) == 4


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_block_scaled_draft_on_the_verilated_engine_equals_the_sim_device(family, tiny_engine, tmp_path):
    """A tiny draft compiled with ``--weight-blocks`` (every MATMUL ``BLOCKS``; Qwen2's
    q/k/v with ``BIAS`` too): greedy and sampled drafts with rollbacks on the verilated
    engine equal the sim device's bit for bit, every OP_CYCLES counter included."""
    from dfvg_host.compiler import compile_draft
    from dfvg_host.fixtures import TINY_FAMILY_SHAPES, make_tiny_llama
    from dfvg_hw.spec.isa import Op, decode
    shape = {} if family == "llama" else TINY_FAMILY_SHAPES[family]
    compiled = compile_draft(make_tiny_llama(tmp_path / family, seed=6, **shape), tiny_engine,
                             weight_blocks=True)
    matmuls = [decode(w) for w in compiled.program if decode(w).opcode == Op.MATMUL]
    assert matmuls and all(ins.blocks for ins in matmuls)
    assert any(ins.bias for ins in matmuls) == (family == "qwen2")
    steps = steps_for(4, 4)
    expected, _ = session(SimDevice(tiny_engine), compiled, steps)
    got, _ = session(VerilatorDevice(tiny_engine), compiled, steps)
    assert got == expected
    assert len(expected[0][1]) == 4
