"""Adaptive speculation length (dfvg_host/adaptive.py): the controller on synthetic
rounds, and the decoders with ``gamma="auto"`` — exact greedy output, lossless sampling."""

from __future__ import annotations

import random
from collections import Counter

import pytest
import torch

from sampling_checks import chi_square_p
from test_fault_injection import EOS, NEW, PROMPTS, TIMEOUT_S, reference, target  # noqa: F401
from test_speculative import (PARAMS, PROMPT, first_two_distribution, heldout_prompts,  # noqa: F401
                              small_vocab_pair)
from dfvg_hw.spec.config import get_preset
from dfvg_host.acceptance import SamplingParams
from dfvg_host.adaptive import AdaptiveLength, LinearFit, RoundFacts
from dfvg_host.compiler import compile_draft, load_model
from dfvg_host.driver import DraftDevice
from dfvg_host.metrics import SpecDecodeMetrics
from dfvg_host.pipelined import PipelinedDecoder
from dfvg_host.speculative import SpeculativeDecoder
from dfvg_host.verifier import Verifier
from sim.device import SimDevice


# -- the controller on synthetic rounds ------------------------------------------------------
class World:
    """Synthetic rounds: each draft accepted with probability ``acc`` (given the earlier
    ones), verification ``tv0 + tv1·(γ+1)`` s, a draft request ``td0 + td1·γ`` s."""

    def __init__(self, acc=0.9, tv=(0.010, 0.0005), td=(0.0002, 0.0005), seed=0):
        self.acc, self.tv, self.td = acc, tv, td
        self.rng = random.Random(seed)

    def run(self, c: AdaptiveLength, rounds: int) -> list[int]:
        used = []
        for _ in range(rounds):
            g = c.choose()
            assert c.gamma_min <= g <= c.gamma_max
            k = 0
            while k < g and self.rng.random() < self.acc:
                k += 1
            c.observe(RoundFacts(g, k, self.tv[0] + self.tv[1] * (g + 1), 1e-4,
                                 ((g, self.td[0] + self.td[1] * g),)))
            used.append(g)
        return used


def test_expected_tokens_is_one_plus_the_sum_of_prefix_products(monkeypatch):
    c = AdaptiveLength(gamma_max=4)
    a = {1: 0.9, 2: 0.5, 3: 0.2, 4: 1.0}
    monkeypatch.setattr(c, "acceptance", lambda i: a[i])
    assert c.expected_tokens(0) == 1.0
    assert c.expected_tokens(3) == pytest.approx(1 + 0.9 + 0.9 * 0.5 + 0.9 * 0.5 * 0.2)
    # and it is the mean of 1 + accepted over simulated rounds
    rng, total, n = random.Random(1), 0, 20000
    for _ in range(n):
        k = 0
        while k < 3 and rng.random() < a[k + 1]:
            k += 1
        total += 1 + k
    assert total / n == pytest.approx(c.expected_tokens(3), abs=0.03)


def test_acceptance_is_estimated_per_position_given_the_earlier_ones():
    """Position 1 always accepted, position 2 always rejected: a_1 → 1, a_2 → 0; a
    position never judged is priced at the pooled acceptance."""
    c = AdaptiveLength(gamma_max=6, decay=1.0)
    for _ in range(200):
        c.observe(RoundFacts(4, 1, 0.01, None, ((4, 0.001),)))   # judged: 1 (yes), 2 (no)
    assert c.acceptance(1) > 0.95 and c.acceptance(2) < 0.05
    assert c.acceptance(3) == pytest.approx(c.pooled_acceptance) == pytest.approx(0.5, abs=0.01)


def test_linear_fit_recovers_a_line_and_guesses_when_unidentified():
    f = LinearFit(decay=0.9)
    for x in [2, 5, 3, 8, 1, 4] * 5:
        f.update(x, 0.01 + 0.002 * x)
    assert f.coefficients() == pytest.approx((0.01, 0.002))
    flat, prop = LinearFit(unidentified="flat"), LinearFit(unidentified="proportional")
    for fit in (flat, prop):
        fit.update(4, 0.02)
    assert flat.predict(8) == pytest.approx(0.02) and prop.predict(8) == pytest.approx(0.04)


def test_gamma_grows_toward_the_max_with_high_acceptance_and_cheap_drafts():
    c = AdaptiveLength(gamma_max=16)
    used = World(acc=0.97).run(c, 80)
    assert c.best_gamma() >= 12 and sum(used[-20:]) / 20 >= 12


def test_gamma_shrinks_with_low_acceptance():
    c = AdaptiveLength(gamma_max=16)
    World(acc=0.97).run(c, 40)
    used = World(acc=0.15, seed=1).run(c, 60)
    assert c.best_gamma() <= 2 and sum(used[-20:]) / 20 <= 2.5


def test_gamma_shrinks_when_drafts_cost_as_much_as_verification():
    c = AdaptiveLength(gamma_max=16)
    World(acc=0.75, td=(0.0002, 0.01)).run(c, 60)
    assert c.best_gamma() <= 2
    cheap = AdaptiveLength(gamma_max=16)
    World(acc=0.75).run(cheap, 60)
    assert cheap.best_gamma() >= 4          # the same acceptance, cheap drafts: longer chains


def test_gamma_recovers_when_conditions_change():
    c = AdaptiveLength(gamma_max=16)
    highs = []
    for phase, acc in enumerate([0.97, 0.15, 0.97, 0.15]):
        used = World(acc=acc, seed=phase).run(c, 60)
        highs.append(sum(used[-15:]) / 15)
    assert highs[0] >= 10 and highs[2] >= 10 and highs[1] <= 2.5 and highs[3] <= 2.5


def test_pipelined_pricing_fits_the_continuation_inside_verification():
    """A drafted token costs a third of a verification. Serial pays for every draft;
    pipelined hides a continuation of γ + 1 drafts behind verification while it fits
    (γ + 1 = 3 here), and is priced faster at its choice."""
    serial, piped = AdaptiveLength(), AdaptiveLength(pipelined=True)
    for c in (serial, piped):
        World(acc=0.9, tv=(0.010, 0.0002), td=(0.0001, 0.0035), seed=3).run(c, 100)
    assert piped.best_gamma() == 2 and serial.best_gamma() > 2
    assert piped.tokens_per_second(2) > serial.tokens_per_second(serial.best_gamma())


def test_probes_are_by_count_and_stay_in_range():
    c = AdaptiveLength(gamma_min=2, gamma_max=5, gamma_init=3, probe_every=4)
    assert [c.choose() for _ in range(8)] == [3, 3, 3, 4, 3, 3, 3, 4] and c.probes == 2
    top = AdaptiveLength(gamma_max=3, gamma_init=3, probe_every=1)
    assert {top.choose() for _ in range(5)} == {3}
    with pytest.raises(ValueError):
        AdaptiveLength(gamma_min=4, gamma_max=2)


# -- the decoders ---------------------------------------------------------------------------
@pytest.fixture(scope="module")
def self_draft(tiny_draft_dir, tiny_compiled, tiny_engine):
    """The tiny Llama drafting for itself (high acceptance: γ has room to grow)."""
    model = load_model(tiny_draft_dir)

    def make(decoder_class=SpeculativeDecoder, **kwargs):
        device = DraftDevice(SimDevice(tiny_engine), tiny_compiled, timeout_s=TIMEOUT_S, retry_backoff_s=0.0)
        return decoder_class(device, Verifier(model, torch.device("cpu")), eos_token_id=EOS, **kwargs)
    return make


@pytest.mark.parametrize("decoder_class", [SpeculativeDecoder, PipelinedDecoder])
def test_greedy_is_exact_on_the_tiny_pair(self_draft, reference, decoder_class):
    decoder = self_draft(decoder_class, gamma="auto")
    assert decoder.adaptive.pipelined == (decoder_class is PipelinedDecoder)
    used = Counter()
    for _ in range(2):                 # the second pass starts from what the first learnt
        for p in PROMPTS:
            out = decoder.generate(p, NEW)
            assert out.tokens == reference[tuple(p)]
            m = out.metrics
            assert m.gamma_mode == "auto" and m.gamma == 0 and len(m.gamma_per_round) == m.rounds
            assert sum(m.gamma_per_round) == m.drafted_tokens
            used.update(g for g in m.gamma_per_round if g)
    assert len(used) >= 2, f"γ never changed: {used}"
    assert decoder.adaptive.rounds > 0 and decoder.adaptive.choices > 0


def test_greedy_is_exact_on_the_demo_pair(demo_pair, demo_compiled):
    """A few held-out prompts x 48 tokens, serial and pipelined, against transformers'
    greedy generate()."""
    from transformers import AutoTokenizer
    _, target_dir, data_dir = demo_pair
    tok = AutoTokenizer.from_pretrained(target_dir)
    model = load_model(target_dir)
    device = DraftDevice.open("sim://alveo-u55c", demo_compiled)
    verifier = Verifier(model, torch.device("cpu"))
    decoders = [cls(device, verifier, gamma="auto", eos_token_id=tok.eos_token_id)
                for cls in (SpeculativeDecoder, PipelinedDecoder)]
    used = Counter()
    for prompt in heldout_prompts(data_dir, tok, count=3):
        with torch.no_grad():
            ref = model.generate(torch.tensor([prompt]), max_new_tokens=48,
                                 do_sample=False)[0, len(prompt):].tolist()
        for decoder in decoders:
            out = decoder.generate(prompt, 48)
            assert out.tokens == ref, decoder.schedule
            used.update(out.metrics.gamma_per_round)
    assert len(used) >= 2


def test_fixed_gamma_is_unchanged_and_bad_gammas_are_refused(self_draft):
    d = self_draft(gamma=3)
    assert d.adaptive is None and d.gamma == 3
    m = d.generate(PROMPTS[0], NEW).metrics
    assert m.gamma_mode == "fixed" and m.gamma == 3 and "gamma 3)" in m.summary()
    assert "gamma            auto" not in m.summary()
    assert set(m.gamma_per_round[:-1]) <= {3}
    mine = AdaptiveLength(gamma_max=5)
    d = self_draft(PipelinedDecoder, adaptive=mine)
    assert d.adaptive is mine and mine.pipelined and d.gamma == 5
    for bad in ("fast", 0, 2.5):
        with pytest.raises(ValueError, match="gamma must be"):
            self_draft(gamma=bad)


def test_metrics_report_gamma_per_round():
    m = SpecDecodeMetrics(gamma_mode="auto")
    for drafted, accepted in ((4, 4), (6, 1), (4, 0), (0, 0)):
        m.record_round(drafted, accepted, accepted + 1)
    assert m.gamma_per_round == [4, 6, 4, 0] and m.mean_gamma == pytest.approx(14 / 3)
    assert m.gamma_histogram == {4: 2, 6: 1}
    d = m.to_dict()
    assert d["mean_gamma"] == m.mean_gamma and d["gamma_per_round"] == [4, 6, 4, 0]
    assert "gamma auto)" in m.summary() and "auto: mean 4.67; rounds by gamma 4:2 6:1" in m.summary()


# -- sampling stays lossless ------------------------------------------------------------------
class TimelessLength(AdaptiveLength):
    """AdaptiveLength priced with fixed times instead of the measured ones, so that its
    choices depend on the past rounds' draws alone and the test is deterministic; it
    keeps its choices."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.chosen: list[int] = []

    def choose(self) -> int:
        self.chosen.append(super().choose())
        return self.chosen[-1]

    def observe(self, facts: RoundFacts) -> None:
        super().observe(RoundFacts(facts.drafted, facts.accepted, 0.010 + 0.001 * (facts.drafted + 1),
                                   None, tuple((n, 0.002 * n) for n, _ in facts.draft_requests)))


@pytest.mark.parametrize("drafter, n", [("other", 700), ("self", 1500)])
def test_sampling_is_lossless(small_vocab_pair, drafter, n):
    """First two tokens of 4-token generations with an adaptive γ in 1..3 that carries
    over from sample to sample (and probes every other choice), so round 1's γ varies.
    γ depends on the past only, so given round 1's γ the law of the tokens is still the
    target's: checked for each γ and overall. ``other``: a different random draft (low
    acceptance); ``self``: the target drafting for itself (higher acceptance, so a
    round's later drafts decide the second token more often — where choosing γ from the
    round's own drafts shows)."""
    draft, target_dir = small_vocab_pair
    draft = draft if drafter == "other" else target_dir
    device = DraftDevice.open("sim://tiny", compile_draft(draft, get_preset("tiny")))
    adaptive = TimelessLength(gamma_max=3, probe_every=2)
    decoder = SpeculativeDecoder(device, Verifier(load_model(target_dir), torch.device("cpu")),
                                 adaptive=adaptive, sampling=PARAMS)
    by_gamma: dict[int, Counter] = {}                # round 1's γ -> counts; ~18 ms a generation
    for seed in range(n):
        decoder.sampling = SamplingParams(PARAMS.temperature, PARAMS.top_k, seed)
        decoder._generator.manual_seed(seed ^ 0x5EED)
        first = len(adaptive.chosen)
        out = decoder.generate(PROMPT, 4)
        by_gamma.setdefault(adaptive.chosen[first], Counter())[tuple(out.tokens[:2])] += 1
    assert len(by_gamma) >= 2, f"round 1's γ never varied: {list(by_gamma)}"
    expected = first_two_distribution(target_dir, PROMPT, PARAMS)
    groups = {g: (sum(c.values()), c) for g, c in by_gamma.items()}
    p = {g: chi_square_p(c, expected, k) for g, (k, c) in groups.items() if k >= 200}
    p["all"] = chi_square_p(sum(by_gamma.values(), Counter()), expected, n)
    sizes = {g: k for g, (k, _) in groups.items()}
    # 0.01 overall; 0.01 / 3 for each γ (three more tests)
    assert p["all"] > 0.01 and all(v > 0.01 / 3 for v in p.values()), \
        f"adaptive samples differ from the target distribution: p {p}, samples by γ {sizes}"
