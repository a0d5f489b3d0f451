"""The driver against the sim device, and against devices that misbehave.

(The driver's recovery tools — the result contract, the ERROR register check, retries and
reset — are tested in test_fault_injection.py, with the faults they answer.)"""

import numpy as np
import pytest

from dfvg_hw.spec.config import get_preset
from dfvg_hw.spec.descriptors import DraftRequest, ErrorCode
from dfvg_hw.spec.numerics import host_temperature
from dfvg_hw.spec.regmap import Control, Irq, Reg, Status
from dfvg_host.compiler import CompiledDraft
from dfvg_host.driver import (ContextFull, DeviceFault, DeviceTimeout, DraftDevice, EngineMismatch,
                              MalformedResult)
from dfvg_host.transport import TransportError, open_transport
from sim.device import SimDevice
from sim.session import FunctionalSession


PROMPT = [5, 17, 99, 3, 42, 7]


def test_driver_results_equal_the_functional_model(tiny_engine, tiny_compiled):
    dev = DraftDevice.open("sim://tiny", tiny_compiled)
    out = dev.draft(PROMPT, 6, sample=True, temperature=0.7, topk=3, seed=11, counter=5)
    direct = FunctionalSession(tiny_engine, tiny_compiled.image, tiny_compiled.program).run(
        DraftRequest(tokens=PROMPT, start_pos=0, n_draft=6, topk=3, sample=True,
                     t_mult=host_temperature(0.7)[0], t_shift=host_temperature(0.7)[1], seed=11,
                     counter=5))
    assert out.tokens == direct.tokens and out.cycles == direct.cycles
    assert out.end_pos == dev.kv_length == dev.committed == len(PROMPT) + 5
    last, busy = dev.cycles()
    assert last > out.cycles and busy >= last        # CYCLES runs on through the result write
    # ping-pong: consecutive requests alternate buffers
    dev.rollback(len(PROMPT))
    again = dev.draft(out.ids[:1], 5, sample=True, temperature=0.7, topk=3, seed=11, counter=6)
    assert again.ids == out.ids[1:]


def test_more_layers_than_kv_heads_fill_the_kv_slots(tmp_path, tiny_engine):
    """4 layers × 1 KV head: twice tiny's old kv_layers = 2, in its 4 KV slots (layer l's
    head in slot l). Teacher-forced on the sim device, the engine follows the float model,
    and each layer's KV is in its own slot."""
    import numpy as np
    import torch
    from dfvg_host.compiler import compile_draft, load_model
    from dfvg_host.fixtures import make_tiny_llama

    model_dir = make_tiny_llama(tmp_path / "deep", layers=4, heads=2, kv_heads=1, seed=3)
    compiled = compile_draft(model_dir, tiny_engine)
    device = SimDevice(tiny_engine)
    dev = DraftDevice(device, compiled)
    ids = PROMPT + [11, 200, 31, 8, 150, 64, 90, 23, 17, 5, 250, 120, 77, 3, 9, 44]
    got = []
    for i, t in enumerate(ids):
        dev.rollback(i)
        got.append(dev.draft([t], 1).ids[0])
    with torch.no_grad():
        ref = load_model(model_dir)(torch.tensor([ids])).logits[0].numpy().argmax(-1)
    assert np.mean(np.array(got) == ref) >= 0.75
    kv = device.engine.kv_k[:, :len(ids)]
    assert all(kv[s].any() for s in range(4)) and not (kv[0] == kv[1]).all()


def test_rollback_is_bounded(tiny_compiled):
    dev = DraftDevice.open("sim://tiny", tiny_compiled)
    dev.draft(PROMPT, 2)
    with pytest.raises(ValueError, match="engine holds 7"):
        dev.rollback(8)


def test_error_status_raises_with_the_drafted_tokens(tiny_engine, tiny_compiled):
    # A manifest claiming more context than the engine has: the engine itself must refuse.
    lying = CompiledDraft(tiny_compiled.image, tiny_compiled.program,
                          dict(tiny_compiled.manifest, context_limit=10 ** 6))
    dev = DraftDevice.open("sim://tiny", lying)
    with pytest.raises(DeviceFault) as info:
        dev.draft(list(range(3, 63)), 8)      # 60 inputs fill positions 0..59
    assert info.value.code == ErrorCode.KV_OVERFLOW and "KV capacity" in str(info.value)
    # drafts fed back at positions 60..63 fit, the 5th would be at 64: 5 tokens drafted
    assert len(info.value.tokens) == 5
    assert dev.committed == 0 and dev.kv_length == tiny_engine.kv_positions


def test_context_limit_is_checked_before_the_device(tiny_engine, tiny_compiled):
    dev = DraftDevice.open("sim://tiny", tiny_compiled)
    with pytest.raises(ContextFull, match="context limit is 64"):
        dev.draft(list(range(3, 63)), 8)


class StaleDevice(SimDevice):
    """Acknowledges START without running the request."""
    stale = False

    def write32(self, offset, value):
        if offset == Reg.CONTROL and value & Control.START and self.stale:
            self._regs[Reg.STATUS] |= Status.DONE
            self._regs[Reg.IRQ_STATUS] |= Irq.DONE
            return
        super().write32(offset, value)


class CorruptingDevice(SimDevice):
    """Flips one bit of every result buffer read."""

    def dma_read(self, addr, nbytes):
        data = bytearray(super().dma_read(addr, nbytes))
        data[-1] ^= 0x10
        return bytes(data)


class SilentDevice(SimDevice):
    """Never finishes: no interrupt, no DONE."""

    def write32(self, offset, value):
        if offset == Reg.CONTROL and value & Control.START:
            self._regs[Reg.STATUS] = Status.BUSY | Status.PROGRAM_LOADED
            return
        super().write32(offset, value)


def test_stale_result_buffer_is_detected(tiny_engine, tiny_compiled):
    device = StaleDevice(tiny_engine)
    dev = DraftDevice(device, tiny_compiled)
    dev.draft(PROMPT, 2)
    dev.draft([1], 2)
    device.stale = True
    with pytest.raises(MalformedResult, match="stale: it answers request 1, not 3"):
        dev.draft([2], 2)


def test_corrupted_result_is_detected(tiny_engine, tiny_compiled):
    dev = DraftDevice(CorruptingDevice(tiny_engine), tiny_compiled)
    with pytest.raises(MalformedResult, match="check word"):
        dev.draft(PROMPT, 3)


def test_timeout(tiny_engine, tiny_compiled):
    dev = DraftDevice(SilentDevice(tiny_engine), tiny_compiled, timeout_s=0.2)
    with pytest.raises(DeviceTimeout, match="did not finish within 0.2 s"):
        dev.draft(PROMPT, 2)


def test_engine_checks(tiny_engine, tiny_compiled, demo_compiled):
    wrong_version = SimDevice(tiny_engine)
    wrong_version._regs[Reg.VERSION] = 7 << 16
    with pytest.raises(EngineMismatch, match="engine version 7.0"):
        DraftDevice(wrong_version, tiny_compiled)
    u55c = get_preset("alveo-u55c")
    with pytest.raises(EngineMismatch, match=rf"compiled for {u55c.rows} \(preset 'alveo-u55c'\)"):
        DraftDevice(SimDevice(tiny_engine), demo_compiled)
    for reg, name, value in ((Reg.P_VMEM_LINE_BYTES, "vmem_line_bytes", 64),
                             (Reg.P_WEIGHT_BLOCKS, "weight_blocks", 1 - int(tiny_engine.weight_blocks)),
                             (Reg.P_KV_BITS, "kv_bits", 12)):
        other_build = SimDevice(tiny_engine)
        other_build._regs[reg] = value
        with pytest.raises(EngineMismatch, match=rf"engine parameter {name} is {value}, the draft was "
                                                  rf"compiled for {int(getattr(tiny_engine, name))}"):
            DraftDevice(other_build, tiny_compiled)
    not_an_engine = SimDevice(tiny_engine)
    not_an_engine._regs[Reg.ID] = 0
    with pytest.raises(EngineMismatch, match="no DFVG engine"):
        DraftDevice(not_an_engine, tiny_compiled)


@pytest.mark.parametrize("url, message", [
    ("sim://alveo-v80", "unknown engine preset"),
    ("rtl+verilator://alveo-v80", "unknown engine preset"),
    ("pcie://x", "unknown scheme"),
])
def test_bad_device_urls(url, message):
    with pytest.raises(TransportError, match=message):
        open_transport(url)


def test_start_without_program_is_a_device_fault(tiny_engine, tiny_compiled):
    device = SimDevice(tiny_engine)
    dev = DraftDevice(device, tiny_compiled)
    device.write32(Reg.CONTROL, Control.SOFT_RESET)      # forgets the loaded program
    with pytest.raises(DeviceFault) as info:
        dev.draft(PROMPT, 2)
    assert info.value.code == ErrorCode.PROGRAM and "no program is loaded" in str(info.value)



# -- several sequences on one engine -----------------------------------------------------

_TWO_SEQUENCE_DRAFT = []


def two_sequence_draft(tmp_path_factory, tiny_engine):
    """2 layers × 1 KV head: 2 KV slots a sequence, so tiny's 4 slots hold 2 sequences.
    Compiled once per process (a function, not a fixture, so that test_xdma.py, which
    runs these tests over XDMA with conftest's fixtures, can run them too)."""
    if not _TWO_SEQUENCE_DRAFT:
        from dfvg_host.compiler import compile_draft
        from dfvg_host.fixtures import make_tiny_llama
        model = make_tiny_llama(tmp_path_factory.mktemp("two-sequences"), layers=2, heads=2,
                                kv_heads=1, seed=5)
        _TWO_SEQUENCE_DRAFT.append(compile_draft(model, tiny_engine))
    return _TWO_SEQUENCE_DRAFT[0]


def sequence_script(prompt, n=4):
    """One sequence's driver calls: a prompt, a rollback into its drafts, a sampled
    request, a rollback into the prompt, a greedy request."""
    return [("draft", (prompt, n), {}), ("rollback", (len(prompt) + 1,), {}),
            ("draft", ([11, 12], n), dict(sample=True, temperature=0.7, topk=3, seed=11, counter=5)),
            ("rollback", (3,), {}), ("draft", (prompt[3:5], n), {})]


def play(dev, step):
    kind, args, kwargs = step
    if kind == "rollback":
        dev.rollback(*args)
        return ("rollback", dev.kv_length, dev.committed)
    out = dev.draft(*args, **kwargs)
    return ("draft", out.tokens, out.end_pos, out.n_forward, out.cycles, dev.kv_length, dev.committed)


SCRIPTS = [sequence_script(PROMPT), sequence_script([9, 250, 31, 8, 150])]


def test_interleaved_sequences_draft_as_each_alone(tiny_engine, tmp_path_factory):
    """Two sequences' calls interleaved on one device (select_sequence before each) see
    exactly what each sees alone on a device of its own, and each one's KV sits in its
    own slots (sequence i from slot i · slots_per_sequence)."""
    draft = two_sequence_draft(tmp_path_factory, tiny_engine)
    alone, kv_alone = [], []
    for script in SCRIPTS:
        device = SimDevice(tiny_engine)
        dev = DraftDevice(device, draft)
        alone.append([play(dev, step) for step in script])
        kv_alone.append(device.engine.kv_k.copy())
    device = SimDevice(tiny_engine)
    dev = DraftDevice(device, draft)
    assert (dev.slots_per_sequence, dev.max_sequences, dev.current_sequence) == (2, 2, 0)
    got = [[], []]
    for steps in zip(*SCRIPTS):
        for index in (1, 0):
            dev.select_sequence(index)
            got[index].append(play(dev, steps[index]))
    assert got == alone
    assert alone[0][0][1] != alone[1][0][1]
    for index in (0, 1):
        np.testing.assert_array_equal(device.engine.kv_k[2 * index:2 * index + 2], kv_alone[index][:2])
        dev.select_sequence(index)
        assert (dev.kv_length, dev.committed) == alone[index][-1][-2:]


def test_select_sequence_checks_its_index(tiny_engine, tiny_compiled, tmp_path_factory):
    dev = DraftDevice.open("sim://tiny", two_sequence_draft(tmp_path_factory, tiny_engine))
    for bad in (-1, 2, "1", True, 0.0, None):
        with pytest.raises(ValueError, match=r"holds 2 sequence\(s\) of 2 KV slots \(0..1\)"):
            dev.select_sequence(bad)
    dev.select_sequence(np.int64(1))
    assert dev.current_sequence == 1 and type(dev.current_sequence) is int
    whole = DraftDevice.open("sim://tiny", tiny_compiled)      # 2 × 2 slots: the whole engine
    assert (whole.slots_per_sequence, whole.max_sequences) == (4, 1)
    with pytest.raises(ValueError, match="0..0"):
        whole.select_sequence(1)


def test_reset_forgets_every_sequence(tiny_engine, tmp_path_factory):
    """reset() empties the engine's KV: every sequence's kv_length and committed go to 0,
    the current sequence stays selected, resets counts it; drafting afterwards is as on
    a fresh device."""
    dev = DraftDevice(SimDevice(tiny_engine), two_sequence_draft(tmp_path_factory, tiny_engine))
    for index in (0, 1):
        dev.select_sequence(index)
        first = dev.draft(PROMPT, 3)
    assert dev.kv_length == dev.committed == len(PROMPT) + 2
    dev.reset()
    assert dev.resets == 1 and dev.current_sequence == 1
    for index in (0, 1):
        dev.select_sequence(index)
        assert dev.kv_length == dev.committed == 0
        with pytest.raises(ValueError, match="engine holds 0"):
            dev.rollback(1)
    dev.select_sequence(1)
    assert dev.draft(PROMPT, 3).tokens == first.tokens


# -- submit / collect ------------------------------------------------------------------
def test_submit_then_collect_equals_draft(tiny_compiled):
    """The asynchronous pair gives what draft() gives, request after request, with the
    same KV bookkeeping; the committed KV moves only on collect."""
    sync, split = DraftDevice.open("sim://tiny", tiny_compiled), DraftDevice.open("sim://tiny", tiny_compiled)
    kwargs = dict(sample=True, temperature=0.7, topk=3, seed=11)
    steps = [(PROMPT, 4, 0, None), ([9], 3, 4, len(PROMPT) + 2), ([1, 2], 5, 7, None)]
    for tokens, n, counter, rollback in steps:
        if rollback is not None:
            sync.rollback(rollback)
            split.rollback(rollback)
        want = sync.draft(tokens, n, counter=counter, **kwargs)
        before = split.committed
        pending = split.submit(tokens, n, counter=counter, **kwargs)
        assert split.pending is pending and split.committed == before
        got = split.collect(pending)
        assert split.pending is None
        assert (got.tokens, got.cycles, got.end_pos, got.n_forward) == \
               (want.tokens, want.cycles, want.end_pos, want.n_forward)
        assert (split.kv_length, split.committed) == (sync.kv_length, sync.committed)


def test_poll_says_when_a_request_has_finished(tiny_engine, tiny_compiled):
    """poll() reads STATUS once and waits for nothing: False while the engine runs, True
    once it is done; collect() then gives what draft() gives."""
    class Slow(SimDevice):
        """Runs a started request only at the third STATUS read after its START."""
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.started, self.reads = None, 0

        def _start(self, buf):
            self.started, self.reads = buf, 0
            self._regs[Reg.STATUS] = (self._regs[Reg.STATUS] & Status.PROGRAM_LOADED) | Status.BUSY

        def _run(self):
            if self.started is not None:
                buf, self.started = self.started, None
                super()._start(buf)

        def read32(self, offset):
            if offset == Reg.STATUS:
                self.reads += 1
                if self.reads >= 3:
                    self._run()
            return super().read32(offset)


    dev = DraftDevice(Slow(tiny_engine), tiny_compiled)
    dev.load()
    want = DraftDevice.open("sim://tiny", tiny_compiled).draft(PROMPT, 3)
    pending = dev.submit(PROMPT, 3)
    assert [dev.poll(pending) for _ in range(3)] == [False, False, True]
    assert dev.committed == 0 and dev.collect(pending).tokens == want.tokens
    with pytest.raises(RuntimeError, match="not in flight"):
        dev.poll(pending)
    pending = dev.submit([4], 1)
    assert [dev.poll(pending) for _ in range(3)] == [False, False, True]
    assert dev.collect(pending).end_pos == want.end_pos + 1


def test_one_request_in_flight(tiny_compiled):
    dev = DraftDevice.open("sim://tiny", tiny_compiled)
    first = dev.submit(PROMPT, 2)
    assert first.buffer == 0
    for call in (lambda: dev.submit([1], 1), lambda: dev.draft([1], 1), lambda: dev.rollback(0)):
        with pytest.raises(RuntimeError, match="in flight"):
            call()
    dev.collect(first)
    with pytest.raises(RuntimeError, match="not in flight"):
        dev.collect(first)                      # collected already
    second = dev.submit([3], 1)
    assert second.buffer == 1                   # the other ping-pong buffer
    dev.reset()
    with pytest.raises(RuntimeError, match="not in flight"):
        dev.collect(second)                     # the reset lost it
    assert dev.pending is None and dev.committed == 0
    assert dev.draft(PROMPT, 1).end_pos == len(PROMPT)


def test_collect_raises_what_draft_raises(tiny_engine, tiny_compiled):
    """A stale result (the engine never ran the request) fails collect, KV unchanged."""
    class NoStart(SimDevice):
        def write32(self, offset, value):
            if offset == Reg.CONTROL and value & Control.START:
                return                           # START lost: no result is written
            super().write32(offset, value)
    dev = DraftDevice(NoStart(tiny_engine), tiny_compiled, timeout_s=0.05)
    pending = dev.submit(PROMPT, 2)
    with pytest.raises((DeviceTimeout, MalformedResult)):
        dev.collect(pending)
    assert dev.pending is None and dev.committed == 0
