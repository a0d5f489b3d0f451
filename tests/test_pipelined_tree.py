"""Pipelined tree speculative decoding (dfvg_host/pipelined_tree.py) and budgeted trees:
greedy exactness, the engine's KV after hits and misses (every tree the decoder drafts
equals one a fresh device drafts from the committed tokens), lossless sampling through
the hit path by chi-square (and that the test can fail), faults.

The drafts are tiny Llamas on ``sim://tiny`` (trees 2 wide).
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch

import dfvg_host.tree as tree_module
from conftest import make_tiny_llama
from sampling_checks import chi_square_p
from test_pipelined import sample_second_third as chain_samples, second_third_distribution
from test_tree_drafting import DEAD, NEW, PROMPTS, random_draft, reference, target  # noqa: F401 - fixtures
from dfvg_hw.spec.regmap import MemoryMap
from dfvg_host.acceptance import SamplingParams
from dfvg_host.compiler import load_model
from dfvg_host.driver import DraftDevice
from dfvg_host.fault_injection import Fault, FaultInjectingTransport, FaultKind
from dfvg_host.pipelined_tree import PipelinedTreeDecoder
from dfvg_host.tree_drafting import TreeCursor, TreeDecoder
from dfvg_host.verifier import Verifier
from sim.device import SimDevice


def records(out) -> list:
    return [(t.token, t.parent, t.topk_ids, t.topk_probs) for t in out.tokens]


class CheckedDecoder(PipelinedTreeDecoder):
    """Holds every tree it drafts — serially after a miss, or as a continuation — to the
    tree a fresh device drafts when fed the tokens the engine should hold: a wrong
    compaction or rollback changes the KV the next tree is drafted from."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.checked = Counter()
        self.fresh = DraftDevice.open("sim://tiny", self.draft.compiled)

    def expect(self, tokens: list[int], levels: int, got) -> None:
        self.fresh.rollback(0)
        head, tail = tokens[:-1], tokens[-1:]
        while head:                    # the prompt may be longer than a request takes
            self.fresh.draft(head[:MemoryMap.MAX_INPUT_TOKENS], 0)
            head = head[MemoryMap.MAX_INPUT_TOKENS:]
        want = self.fresh.draft_tree(tail, levels, **TreeCursor.tree_options(self.fresh, self.sampling))
        assert records(got) == records(want), f"tree after {tokens} differs from a fresh device's"

    def _draft_timed(self, run, state, seq, n, round_no):
        d, requests = super()._draft_timed(run, state, seq, n, round_no)
        if d is not None:
            self.expect(list(seq), n, d)
            self.checked["serial"] += 1
        return d, requests

    def _settle(self, run, state, seq, c, n, d, verdict, going_on, use_device, round_no):
        if c.output is not None:
            self.expect(c.optimistic, c.n_next + 1, c.output)
            self.checked["continuation"] += 1
        return super()._settle(run, state, seq, c, n, d, verdict, going_on, use_device, round_no)


def decoder_on(compiled, target, cls=PipelinedTreeDecoder, transport=None, **kwargs):
    dev = DraftDevice(transport, compiled, timeout_s=0.1, retry_backoff_s=0.0) if transport else \
        DraftDevice.open("sim://tiny", compiled)
    return cls(dev, Verifier(target, torch.device("cpu")), eos_token_id=1, **kwargs)


@pytest.mark.parametrize("depth, budget", [(1, None), (3, None), (4, 3), ("auto", None)])
def test_greedy_is_exact_and_the_engine_holds_what_it_should(tiny_compiled, random_draft, target,
                                                             reference, depth, budget):
    hits = 0
    for compiled in (tiny_compiled, random_draft):     # the target itself, and a poor drafter
        decoder = decoder_on(compiled, target, CheckedDecoder, depth=depth, budget=budget)
        for prompt in PROMPTS:
            out = decoder.generate(prompt, NEW)
            m = out.metrics
            assert out.tokens == reference[tuple(prompt)] and not out.faults
            assert m.schedule == "pipelined" and m.pipeline_hits + m.pipeline_misses > 0
            assert m.tree_nodes <= (budget or 2 * 16) * m.rounds
            hits += m.pipeline_hits
            assert 0 < m.hidden_draft_seconds <= m.device_seconds + m.pcie_seconds
        assert decoder.checked["serial"] > 0 and decoder.checked["continuation"] > 0
    assert hits > 0


def test_the_deepest_trees_on_the_demo_pair(demo_pair, demo_compiled):
    """Depth 16 at width 4 fills a request (64 nodes): the continuation, one level more
    than the next round's tree, drafts 16 levels for a 15-level round."""
    from transformers import AutoTokenizer
    _, target_dir, data = demo_pair
    model = load_model(target_dir)
    prompt = AutoTokenizer.from_pretrained(target_dir)((data / "heldout.txt").read_text())["input_ids"][:24]
    with torch.no_grad():
        want = model.generate(torch.tensor([prompt]), max_new_tokens=64, do_sample=False,
                              attention_mask=torch.ones(1, len(prompt), dtype=torch.long))[0, len(prompt):]
    decoder = PipelinedTreeDecoder(DraftDevice.open("sim://alveo-u55c", demo_compiled),
                                   Verifier(model, torch.device("cpu")), depth=16, budget=8)
    out = decoder.generate(prompt, 64)
    m = out.metrics
    assert out.tokens == want.tolist() and not out.faults
    assert m.pipeline_hits > 0 and 1 <= min(m.gamma_per_round) and max(m.gamma_per_round) <= 8


def test_budget_verifies_the_most_likely_nodes(tiny_compiled, target, reference):
    decoder = decoder_on(tiny_compiled, target, TreeDecoder, depth=6, budget=4)
    out = decoder.generate(PROMPTS[0], NEW)
    m = out.metrics
    assert out.tokens == reference[tuple(PROMPTS[0])]
    assert m.tree_budget == 4 and m.tree_nodes == 4 * (m.rounds - (m.gamma_per_round[-1] == 0))
    # A budget smaller than the tree still reaches past the depth a 2-wide tree of 4 nodes
    # would have: the chosen nodes follow the draft's confidence; the metrics count the
    # levels verified, not the 6 drafted.
    assert 2 < max(m.gamma_per_round) <= 4 and m.mean_accepted_length > 3
    assert decoder.ranks.trials and sum(decoder.ranks.hits.values()) > 0
    with pytest.raises(ValueError, match="budget"):
        decoder_on(tiny_compiled, target, TreeDecoder, depth=2, budget=0)


def test_short_generations_and_the_context_limit(tiny_compiled, target, reference):
    decoder = decoder_on(tiny_compiled, target, CheckedDecoder, depth=3)
    for n in (1, 2, 5):
        out = decoder.generate(PROMPTS[1], n)
        assert out.tokens == reference[tuple(PROMPTS[1])][:n]
    limit = tiny_compiled.context_limit
    long_prompt = [(7 * i) % 250 + 3 for i in range(limit - 6)]
    out = decoder.generate(long_prompt, 40)
    assert out.stop_reason == "context_limit" and "kv_positions" in out.message
    with torch.no_grad():
        want = target.generate(torch.tensor([long_prompt]), max_new_tokens=len(out.tokens),
                               do_sample=False, eos_token_id=1, pad_token_id=2)[0, len(long_prompt):]
    assert out.tokens == want.tolist()


@pytest.mark.parametrize("plan", [[Fault(FaultKind.CORRUPT, "dma_read", at=4)],
                                  [Fault(FaultKind.ERROR, "start", at=3)],
                                  [Fault(FaultKind.ERROR, "start", at=4)], DEAD],
                         ids=["corrupt-result", "error-status-serial", "error-status-continuation", "dead"])
def test_faults_keep_greedy_exact(tiny_engine, tiny_compiled, target, reference, plan):
    inj = FaultInjectingTransport(SimDevice(tiny_engine), armed=False)
    decoder = decoder_on(tiny_compiled, target, transport=inj, depth=3)
    inj.arm(plan)
    out = decoder.generate(PROMPTS[1], NEW)
    assert out.tokens == reference[tuple(PROMPTS[1])] and out.stop_reason == "max_new_tokens"
    assert inj.injected and out.metrics.device_faults >= 1
    assert out.degraded == (plan is DEAD) and out.metrics.device_resets >= 1
    again = decoder.generate(PROMPTS[2], NEW)           # the next generation starts clean
    assert again.tokens == reference[tuple(PROMPTS[2])]


# -- sampling through the hit path: lossless, and the test can fail ------------------------------
VOCAB = 8
PROMPT = [1, 4, 6, 3]
PARAMS = SamplingParams(temperature=0.5, top_k=0)


@pytest.fixture(scope="module")
def small_vocab_target(tmp_path_factory):
    """A random target over 8 tokens drafting for itself (no EOS)."""
    root = tmp_path_factory.mktemp("ptree-small-vocab")
    return make_tiny_llama(root / "target", vocab=VOCAB, seed=10, weight_scale=3.0, eos=None)


def sample_second_third(target_dir, n):
    """Depth 1, 4 tokens: round 1 verifies level 1 (2 i.i.d. draws) and submits a
    continuation whose level 1 guesses the next token; on a hit round 2 verifies the
    continuation's level 2 below it, so tokens 2 and 3 come through the hit path."""
    return chain_samples(target_dir, n, make=lambda device, verifier: PipelinedTreeDecoder(device, verifier,
                                                                                           depth=1))


def test_sampling_is_lossless(small_vocab_target):
    n = 1200
    counts, hits = sample_second_third(small_vocab_target, n)
    assert hits > n // 10, f"only {hits} hits in {n} generations"
    p = chi_square_p(counts, second_third_distribution(small_vocab_target, PROMPT, PARAMS), n)
    print(f"pipelined trees: chi-square p = {p:.3g} from {n} samples, {hits} hits")
    assert p > 0.01, f"pipelined tree samples differ from the target distribution (p = {p:.2e})"


def test_wrong_q_is_detected(small_vocab_target, monkeypatch):
    uniform = lambda token, vocab: torch.full((vocab,), 1.0 / vocab, dtype=torch.float64)
    monkeypatch.setattr(tree_module, "draft_distribution", uniform)
    n = 500
    counts, _ = sample_second_third(small_vocab_target, n)
    p = chi_square_p(counts, second_third_distribution(small_vocab_target, PROMPT, PARAMS), n)
    print(f"pipelined trees with a uniform q: chi-square p = {p:.3g} from {n} samples")
    assert p < 0.01, f"a uniform q went undetected (p = {p:.3f})"
