"""Faults survived, nothing lost: drafting through a fault-injecting transport.

Every generation here runs the sim device behind a :class:`FaultInjectingTransport` and is
checked token for token against target-only greedy decoding (``model.generate``): drops,
lost writes, bit flips, hung and failing requests, at chosen operations and in a seeded
random campaign; a device that never works; a verifier that raises. Then the driver's
recovery tools one by one: the result contract, the ERROR register check, retries, reset.
The pair is the tiny
Llama of the fixtures drafting for itself (high acceptance, so faults land in rounds with
accepted drafts and KV rollbacks), 24 new tokens per run.
"""

from __future__ import annotations

import math
from collections import Counter

import pytest
import torch

from dfvg_hw.spec.descriptors import DraftResult, ErrorCode
from dfvg_hw.spec.regmap import Control, MemoryMap, Reg, Status
from dfvg_host.acceptance import SamplingParams
from dfvg_host.compiler import load_model
from dfvg_host.driver import DeviceFault, DeviceLinkError, DeviceTimeout, DraftDevice, MalformedResult
from dfvg_host.fault_injection import Fault, FaultInjectingTransport, FaultKind
from dfvg_host.transport import TransportError
from dfvg_host.speculative import SpeculativeDecoder
from dfvg_host.verifier import Verifier
from sim.device import SimDevice

PROMPTS = [[5, 17, 99, 3, 42, 7], [100, 4, 61, 9], [33, 200, 12, 77, 150], [8, 250, 19]]
NEW = 24
TIMEOUT_S = 0.1        # the driver's request timeout: a hung request costs this much
EOS = 1                # make_tiny_llama's EOS


@pytest.fixture(scope="module")
def target(tiny_draft_dir):
    return load_model(tiny_draft_dir)


@pytest.fixture(scope="module")
def reference(target):
    """Target-only greedy decoding of each prompt (transformers' generate)."""
    refs = {}
    with torch.no_grad():
        for p in PROMPTS:
            refs[tuple(p)] = target.generate(torch.tensor([p]), max_new_tokens=NEW, do_sample=False,
                                             eos_token_id=EOS, pad_token_id=2)[0, len(p):].tolist()
    return refs


def make(tiny_engine, tiny_compiled, target, plan=(), *, rate=0.0, seed=0, sampling=SamplingParams(),
         **decoder_kwargs):
    """A decoder on the sim device behind an injector, armed once the device is up."""
    inj = FaultInjectingTransport(SimDevice(tiny_engine), armed=False)
    device = DraftDevice(inj, tiny_compiled, timeout_s=TIMEOUT_S, retry_backoff_s=0.0)
    inj.arm(plan, rate=rate, seed=seed)
    decoder = SpeculativeDecoder(device, Verifier(target, torch.device("cpu")), gamma=4,
                                 sampling=sampling, eos_token_id=EOS, **decoder_kwargs)
    return decoder, inj


def test_fault_free_run_equals_target_only(tiny_engine, tiny_compiled, target, reference):
    decoder, inj = make(tiny_engine, tiny_compiled, target)
    for p in PROMPTS:
        out = decoder.generate(p, NEW)
        assert out.tokens == reference[tuple(p)] and not out.degraded and not inj.injected
        assert out.metrics.faults_line() == "none"
    assert out.metrics.acceptance_rate > 0.5       # drafts are accepted: rollbacks happen


# (id, plan, expected device faults by kind, resets, degraded; None: not checked, as what a
# bit flip in a register or a request leads to depends on the bits)
CASES = [
    ("drop-dma-read-retried", [Fault(FaultKind.DROP, "dma_read", at=2)], {}, 0, False),
    ("drop-start-retried", [Fault(FaultKind.DROP, "start", at=1, repeat=2)], {}, 0, False),
    ("drop-wait-irq-retried", [Fault(FaultKind.DROP, "wait_irq", at=0)], {}, 0, False),
    ("drop-read32-retried", [Fault(FaultKind.DROP, "read32", at=1)], {}, 0, False),
    ("drop-outlives-retries", [Fault(FaultKind.DROP, "dma_read", at=2, repeat=3)], {"link": 1}, 1, False),
    ("lose-request-dma", [Fault(FaultKind.LOSE, "dma_write", at=2)], {"malformed": 1}, 1, False),
    ("lose-start", [Fault(FaultKind.LOSE, "start", at=1)], {"malformed": 1}, 1, False),
    ("corrupt-result", [Fault(FaultKind.CORRUPT, "dma_read", at=1, bits=3)], {"malformed": 1}, 1, False),
    ("corrupt-error-register", [Fault(FaultKind.CORRUPT, "read32", at=2, bits=1)], None, None, None),
    ("corrupt-request", [Fault(FaultKind.CORRUPT, "dma_write", at=1, bits=2)], None, None, None),
    ("hang", [Fault(FaultKind.DELAY, "start", at=2)], {"timeout": 1}, 1, False),
    ("slow-but-in-time", [Fault(FaultKind.DELAY, "start", at=1, seconds=0.002)], {}, 0, False),
    ("error-status", [Fault(FaultKind.ERROR, "start", at=3, code=ErrorCode.WATCHDOG)],
     {"error_status": 1}, 1, False),
    ("fault-during-replay", [Fault(FaultKind.ERROR, "start", at=1), Fault(FaultKind.ERROR, "start", at=2)],
     {"error_status": 2}, 2, False),
    ("request-caused-error", [Fault(FaultKind.ERROR, "start", at=2, code=ErrorCode.KV_OVERFLOW)],
     {"error_status": 1}, 0, True),
    ("recoveries-spent", [Fault(FaultKind.ERROR, "start", at=1, repeat=3)], {"error_status": 3}, 2, True),
]


@pytest.mark.parametrize("plan, kinds, resets, degraded", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_fault_at_a_chosen_point(tiny_engine, tiny_compiled, target, reference, plan, kinds, resets, degraded):
    decoder, inj = make(tiny_engine, tiny_compiled, target, plan)
    prompt = PROMPTS[0]
    out = decoder.generate(prompt, NEW)
    m = out.metrics
    assert out.tokens == reference[tuple(prompt)]
    assert out.stop_reason == "max_new_tokens" and out.error is None
    assert len(inj.injected) >= 1 and all(f.planned for f in inj.injected)
    if kinds is not None:
        assert m.device_faults_by_kind == kinds and m.device_faults == len(out.faults)
    if resets is not None:
        assert m.device_resets == resets
    if degraded is not None:
        assert out.degraded == degraded
    assert bool(out.fallback_reason) == out.degraded
    assert (m.fallback_tokens > 0) == out.degraded and (m.fallback_rounds > 0) == out.degraded
    if plan[0].kind is FaultKind.DROP:     # 2 retries; a third drop is a link error
        assert m.transport_retries == min(plan[0].repeat, 2)
    if m.device_faults:
        assert "faults " in m.summary() and m.to_dict()["device_faults"] == m.device_faults


def test_random_campaign(tiny_engine, tiny_compiled, target, reference):
    """40 seeded runs of 16 tokens, every operation hit at random (rate 4 %) by any kind."""
    injected, kinds, resets, degraded, retries = 0, Counter(), 0, 0, 0
    for seed in range(40):
        decoder, inj = make(tiny_engine, tiny_compiled, target, rate=0.04, seed=seed)
        prompt = PROMPTS[seed % len(PROMPTS)]
        out = decoder.generate(prompt, 16)
        assert out.tokens == reference[tuple(prompt)][:16], (seed, inj.injected, out.faults)
        assert out.stop_reason == "max_new_tokens"
        injected += len(inj.injected)
        kinds.update(inj.by_kind())
        resets += out.metrics.device_resets
        degraded += out.degraded
        retries += out.metrics.transport_retries
    print(f"random campaign: {injected} faults injected {dict(kinds)}, {resets} resets, "
          f"{retries} retries, {degraded} of 40 runs degraded")
    assert set(kinds) == {k.value for k in FaultKind}, kinds
    assert injected >= 40 and resets >= 10 and retries >= 10 and degraded >= 1


@pytest.mark.parametrize("plan", [
    [Fault(FaultKind.ERROR, "start", repeat=math.inf, code=ErrorCode.ILLEGAL_INSTRUCTION)],
    [Fault(FaultKind.DROP, op, repeat=math.inf) for op in ("read32", "write32", "start", "dma_write")],
], ids=["every-request-fails", "link-dead"])
def test_device_that_never_works(tiny_engine, tiny_compiled, target, reference, plan):
    decoder, inj = make(tiny_engine, tiny_compiled, target, plan)
    for prompt in PROMPTS[:2]:     # the second generation tries a reset first, in vain
        out = decoder.generate(prompt, NEW)
        m = out.metrics
        assert out.tokens == reference[tuple(prompt)] and out.stop_reason == "max_new_tokens"
        assert out.degraded and "reset" in out.fallback_reason
        assert m.fallback_tokens == len(out.tokens) and m.drafted_tokens == 0
        assert m.device_resets == decoder.max_recoveries


def test_without_fallback_the_device_error_stops_generation(tiny_engine, tiny_compiled, target, reference):
    plan = [Fault(FaultKind.ERROR, "start", at=2, repeat=math.inf)]
    decoder, _ = make(tiny_engine, tiny_compiled, target, plan, fallback=False, max_recoveries=1)
    out = decoder.generate(PROMPTS[0], NEW)
    assert out.stop_reason == "device_error" and "WATCHDOG" in out.message
    assert 0 < len(out.tokens) < NEW and out.tokens == reference[tuple(PROMPTS[0])][:len(out.tokens)]


def test_replay_in_several_requests(tiny_engine, tiny_compiled, target, reference):
    """A replay longer than a request's input limit goes in several requests."""
    plan = [Fault(FaultKind.DELAY, "start", at=4), Fault(FaultKind.CORRUPT, "dma_read", at=9)]
    decoder, inj = make(tiny_engine, tiny_compiled, target, plan)
    decoder.max_input_tokens = 4
    prompt = PROMPTS[0]
    out = decoder.generate(prompt, NEW)
    assert out.tokens == reference[tuple(prompt)] and not out.degraded
    assert out.metrics.device_resets == 2 and inj.counts["start"] > 12


def test_sampling_replay_is_identical_to_the_fault_free_run(tiny_engine, tiny_compiled, target):
    """Recovered faults change nothing, not even a sampled token (same seed)."""
    sampling = SamplingParams(temperature=1.0, top_k=4, seed=7)
    clean, _ = make(tiny_engine, tiny_compiled, target, sampling=sampling)
    plan = [Fault(FaultKind.CORRUPT, "dma_read", at=1), Fault(FaultKind.DELAY, "start", at=4),
            Fault(FaultKind.DROP, "dma_read", at=6, repeat=3)]
    faulty, inj = make(tiny_engine, tiny_compiled, target, plan, sampling=sampling, max_recoveries=3)
    for prompt in PROMPTS[:2]:
        want, got = clean.generate(prompt, NEW), faulty.generate(prompt, NEW)
        assert got.tokens == want.tokens and not got.degraded
    assert len(inj.injected) == 5 and faulty.draft.resets == 3


def test_target_token_outside_the_draft_vocabulary_falls_back(tmp_path, tiny_engine, tiny_compiled):
    """A target with a larger vocabulary than the draft: the draft cannot take its tokens."""
    from conftest import make_tiny_llama
    big = load_model(make_tiny_llama(tmp_path / "big", vocab=320, seed=4, eos=None))
    decoder, _ = make(tiny_engine, tiny_compiled, big)
    decoder.eos_token_id = None
    prompt = PROMPTS[0]
    with torch.no_grad():
        ref = big.generate(torch.tensor([prompt]), max_new_tokens=NEW, do_sample=False,
                           pad_token_id=2)[0, len(prompt):].tolist()
    assert max(ref) >= 256, "the reference never leaves the draft's vocabulary"
    out = decoder.generate(prompt, NEW)
    assert out.tokens == ref and out.degraded and "outside the draft's vocabulary" in out.fallback_reason
    assert out.metrics.device_faults == 0 and out.metrics.device_resets == 0


@pytest.mark.parametrize("fail_at", [0, 3])
def test_verifier_exception_keeps_the_tokens(tiny_engine, tiny_compiled, target, reference, fail_at):
    """A target that raises on its (fail_at + 1)-th forward pass (0: the prefill)."""
    decoder, _ = make(tiny_engine, tiny_compiled, target)
    forward = decoder.verifier._forward
    calls = []

    def failing(ids):
        calls.append(ids)
        if len(calls) > fail_at:
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        return forward(ids)

    decoder.verifier._forward = failing
    streamed = []
    prompt = PROMPTS[0]
    out = decoder.generate(prompt, NEW, on_tokens=streamed.extend)
    assert out.stop_reason == "verifier_error" and isinstance(out.error, RuntimeError)
    assert "illegal memory access" in out.message and f"the {len(out.tokens)} tokens" in out.message
    assert streamed == out.tokens == reference[tuple(prompt)][:len(out.tokens)]
    assert (len(out.tokens) > 0) == (fail_at > 0)
    # the next generation starts afresh
    decoder.verifier._forward = forward
    assert decoder.generate(prompt, NEW).tokens == reference[tuple(prompt)]


def test_fault_plan_is_checked():
    with pytest.raises(ValueError, match="applies to start"):
        Fault(FaultKind.DELAY, "dma_read")
    with pytest.raises(ValueError, match="code other than OK"):
        Fault(FaultKind.ERROR, code=ErrorCode.OK)
    assert Fault("corrupt").op == "dma_read"


# -- the driver's recovery tools, each against a device that needs it -------------------------

DRIVER_PROMPT = [5, 17, 99, 3, 42, 7]


class HungDevice(SimDevice):
    """Never finishes a request: no interrupt, no DONE."""

    def write32(self, offset, value):
        if offset == Reg.CONTROL and value & Control.START:
            self._regs[Reg.STATUS] = Status.BUSY | Status.PROGRAM_LOADED
            return
        super().write32(offset, value)


class RewritingDevice(SimDevice):
    """Rewrites each result it returns with ``rewrite(result)`` and a valid check word: a
    device or link that corrupts a result consistently."""
    rewrite = None

    def dma_read(self, addr, nbytes):
        data = super().dma_read(addr, nbytes)
        if self.rewrite is not None and addr in MemoryMap.RESULT:
            result = DraftResult.unpack(data, self.config.topk_max)
            self.rewrite(result)
            packed = result.pack(self.config.topk_max)
            data = packed + data[len(packed):]
        return data


def _set(obj, **fields):
    for k, v in fields.items():
        setattr(obj, k, v)


@pytest.mark.parametrize("rewrite, sample, message", [
    (lambda r: _set(r.tokens[1], token=(set(range(9)) - set(r.tokens[1].topk_ids)).pop()), True,
     r"outside its top-k .* \(q\(token\) = 0\)"),
    (lambda r: _set(r.tokens[0], prob=r.tokens[0].prob + 1), True, "reports probability"),
    (lambda r: r.tokens[2].topk_probs.__setitem__(-1, r.tokens[2].topk_probs[-1] + 5), True,
     "sum to"),
    (lambda r: _set(r, end_pos=r.end_pos + 1), True, "end_pos is"),
    (lambda r: _set(r.tokens[0], token=r.tokens[0].topk_ids[1], prob=r.tokens[0].topk_probs[1]),
     False, "greedy draft 0 is candidate 1"),
], ids=["q-zero", "prob", "sum", "end-pos", "greedy-not-argmax"])
def test_a_consistent_but_wrong_result_is_malformed(tiny_engine, tiny_compiled, rewrite, sample, message):
    device = RewritingDevice(tiny_engine)
    dev = DraftDevice(device, tiny_compiled)
    device.rewrite = rewrite
    with pytest.raises(MalformedResult, match=message):
        dev.draft(DRIVER_PROMPT, 3, sample=sample, temperature=1.0, topk=4, seed=3)
    assert dev.committed == 0


class RegisterDevice(SimDevice):
    """Reports ``error`` in the ERROR register whatever the request did."""
    error = 0

    def read32(self, offset):
        return self.error if offset == Reg.ERROR and self.error else super().read32(offset)


def test_error_register_is_checked_against_the_result(tiny_engine, tiny_compiled):
    device = RegisterDevice(tiny_engine)
    dev = DraftDevice(device, tiny_compiled)
    device.error = int(ErrorCode.WATCHDOG)
    with pytest.raises(DeviceFault, match="WATCHDOG"):
        dev.draft(DRIVER_PROMPT, 2)
    device.error = 0x1234
    with pytest.raises(MalformedResult, match="ERROR register reads 4660"):
        dev.draft(DRIVER_PROMPT, 2)


class FlakyDevice(SimDevice):
    """DMA reads fail ``fail`` times, then work."""
    fail = 0

    def dma_read(self, addr, nbytes):
        if self.fail:
            self.fail -= 1
            raise TransportError("C2H DMA failed: Input/output error")
        return super().dma_read(addr, nbytes)


def test_transient_transport_errors_are_retried(tiny_engine, tiny_compiled):
    device = FlakyDevice(tiny_engine)
    dev = DraftDevice(device, tiny_compiled, retries=2, retry_backoff_s=0.0)
    want = DraftDevice.open("sim://tiny", tiny_compiled).draft(DRIVER_PROMPT, 3).ids
    device.fail = 2
    assert dev.draft(DRIVER_PROMPT, 3).ids == want and dev.transport_retries == 2
    device.fail = 3
    dev.rollback(0)
    with pytest.raises(DeviceLinkError, match=r"failed 3 times in a row") as info:
        dev.draft(DRIVER_PROMPT, 3)
    # both a device error and a transport error, for callers catching either
    assert isinstance(info.value, TransportError) and dev.committed == 0


def test_reset_brings_a_hung_device_back(tiny_engine, tiny_compiled):
    device = HungDevice(tiny_engine)
    dev = DraftDevice(device, tiny_compiled, timeout_s=0.05)
    dev.ABORT_GRACE_S = 0.05
    with pytest.raises(DeviceTimeout):
        dev.draft(DRIVER_PROMPT, 2)
    device.__class__ = SimDevice            # the hang is over; the engine state is not
    dev.reset()
    assert dev.resets == 1 and dev.committed == dev.kv_length == 0
    want = DraftDevice.open("sim://tiny", tiny_compiled).draft(DRIVER_PROMPT, 3)
    assert dev.draft(DRIVER_PROMPT, 3).tokens == want.tokens
