"""BatchVerifier: one forward pass over many sequences gives each the single-sequence
Verifier's logits; greedy decoding through it is exactly the target's greedy output."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

import dfvg_host.batch_verifier as batch_verifier
from dfvg_host.batch_verifier import BatchVerifier
from dfvg_host.checkpoints import CheckpointError
from dfvg_host.compiler import load_model
from dfvg_host.verifier import Verifier, check_placement

TARGET = Path(__file__).resolve().parents[1] / "models" / "demo-target"
ATOL = 1e-4

#: prompts of different lengths (one of one token: an empty cache) and drafts of different
#: counts (one with none)
PROMPTS = {7: [0, 5, 6, 7, 8, 9, 10], 3: [0], 11: [0, 44, 55], 2: list(range(10, 40))}
DRAFTS = {7: [1, 2, 3], 3: [], 11: [7, 8, 9, 10, 11], 2: [4]}


@pytest.fixture(scope="module")
def target():
    return load_model(TARGET)


@pytest.fixture
def bv(target):
    return BatchVerifier(target, torch.device("cpu"))


def verifier_logits(model, prompt, rounds):
    """The single-sequence Verifier's logits for ``rounds`` of (drafts, accepted, next)."""
    v = Verifier(model, torch.device("cpu"))
    v.prefill(prompt)
    out = []
    for drafts, accepted, next_token in rounds:
        out.append(v.score(drafts))
        v.commit(accepted, len(drafts), next_token)
    return out


def greedy_verdict(logits: torch.Tensor, drafts: list[int]) -> tuple[int, int]:
    best = logits.argmax(-1).tolist()
    accepted = 0
    while accepted < len(drafts) and drafts[accepted] == best[accepted]:
        accepted += 1
    return accepted, best[accepted]


def test_one_forward_gives_each_sequence_the_single_verifiers_logits(target, bv):
    for seq_id, prompt in PROMPTS.items():
        bv.add(seq_id, prompt)
    before = bv.forwards
    out = bv.score(DRAFTS)
    assert bv.forwards == before + 1 and bv.seconds > 0
    assert set(out) == set(PROMPTS)
    for seq_id, prompt in PROMPTS.items():
        ref = verifier_logits(target, prompt, [(DRAFTS[seq_id], 0, 0)])[0]
        assert out[seq_id].dtype == torch.float32 and out[seq_id].device.type == "cpu"
        assert out[seq_id].shape == (len(DRAFTS[seq_id]) + 1, bv.vocab_size)
        torch.testing.assert_close(out[seq_id], ref, atol=ATOL, rtol=0)


def test_rounds_after_partial_commits_match_the_verifier(target, bv):
    """Three rounds; every sequence keeps a different number of its drafts each time, so the
    caches crop by different amounts and grow to different lengths."""
    rng = random.Random(1)
    rounds = {i: [] for i in PROMPTS}
    for seq_id, prompt in PROMPTS.items():
        bv.add(seq_id, prompt)
    got = {i: [] for i in PROMPTS}
    for r in range(3):
        drafts = {i: [rng.randrange(4096) for _ in range((r + len(p)) % 5)] for i, p in PROMPTS.items()}
        out = bv.score(drafts)
        for i, logits in out.items():
            accepted, next_token = rng.randint(0, len(drafts[i])), rng.randrange(4096)
            before = bv.length(i)
            bv.commit(i, accepted, len(drafts[i]), next_token)
            assert bv.length(i) == before - (len(drafts[i]) - accepted)
            rounds[i].append((drafts[i], accepted, next_token))
            got[i].append(logits)
    for i, prompt in PROMPTS.items():
        for logits, ref in zip(got[i], verifier_logits(target, prompt, rounds[i])):
            torch.testing.assert_close(logits, ref, atol=ATOL, rtol=0)


def test_lengths_count_the_cache_per_sequence(bv):
    bv.add(1, [0, 5, 6, 7])
    bv.add(2, [0])
    assert (bv.length(1), bv.length(2)) == (3, 0)
    bv.score({1: [8, 9, 10], 2: [11]})
    assert (bv.length(1), bv.length(2)) == (7, 2)
    bv.commit(1, 1, 3, 12)            # pending + 1 draft kept, 2 dropped
    bv.commit(2, 0, 1, 13)            # pending kept, the draft dropped
    assert (bv.length(1), bv.length(2)) == (5, 1)
    bv.score({2: []})                 # a round of sequence 2 alone leaves sequence 1 as it is
    assert (bv.length(1), bv.length(2)) == (5, 2)
    assert 1 in bv and 2 in bv and 3 not in bv and len(bv) == 2


def test_garbage_in_the_padding_changes_nothing(target, bv, monkeypatch):
    """The mask, not the zeros, hides the padding: pad the caches with large random values
    and every sequence's logits stay the Verifier's."""
    def noisy_pad(states, like, length):
        padded = batch_verifier.F.pad(states, (0, 0, length - states.shape[2], 0)) if states is not None \
            else like.new_zeros(1, like.shape[1], length, like.shape[3])
        pad = length - (states.shape[2] if states is not None else 0)
        padded[:, :, :pad] = torch.randn_like(padded[:, :, :pad]) * 100
        return padded
    monkeypatch.setattr(batch_verifier, "left_pad", noisy_pad)
    for seq_id, prompt in PROMPTS.items():
        bv.add(seq_id, prompt)
    out = bv.score(DRAFTS)
    for seq_id, prompt in PROMPTS.items():
        ref = verifier_logits(target, prompt, [(DRAFTS[seq_id], 0, 0)])[0]
        torch.testing.assert_close(out[seq_id], ref, atol=ATOL, rtol=0)


def test_without_the_mask_the_logits_differ(target, bv, monkeypatch):
    """The control of the tests above: the same forward without the attention mask lets
    tokens see the padding, and the comparison with the Verifier catches it."""
    forward = batch_verifier.timed_forward
    monkeypatch.setattr(batch_verifier, "timed_forward",
                        lambda model, **inputs: forward(model, **{k: v for k, v in inputs.items()
                                                                 if k != "attention_mask"}))
    for seq_id, prompt in PROMPTS.items():
        bv.add(seq_id, prompt)
    out = bv.score(DRAFTS)
    ref = verifier_logits(target, PROMPTS[3], [(DRAFTS[3], 0, 0)])[0]
    assert not torch.allclose(out[3], ref, atol=ATOL, rtol=0)


def decode_interleaved(bv, prompts, max_new, eos, drafts_for, *, start_round):
    """Greedy speculative decoding of ``prompts`` through ``bv``: sequence ``i`` joins at
    round ``start_round[i]`` and leaves when done; ``drafts_for(i, tokens)`` proposes."""
    out = {i: [] for i in prompts}
    active: set[int] = set()
    for r in range(10_000):
        for i, p in prompts.items():
            if start_round[i] == r:
                bv.add(i, p)
                active.add(i)
        if not active and r > max(start_round.values()):
            return out
        drafts = {i: drafts_for(i, out[i]) for i in sorted(active)}
        for i, logits in bv.score(drafts).items():
            accepted, next_token = greedy_verdict(logits, drafts[i])
            bv.commit(i, accepted, len(drafts[i]), next_token)
            out[i].extend(drafts[i][:accepted] + [next_token])
            if eos in out[i]:
                out[i] = out[i][:out[i].index(eos) + 1]
            if len(out[i]) >= max_new or out[i][-1] == eos:
                out[i] = out[i][:max_new]
                bv.remove(i)
                active.discard(i)
    raise AssertionError("decoding did not finish")


def test_interleaved_greedy_decoding_equals_generate(target, bv):
    """Five prompts joining at different rounds, with drafts that are partly the target's own
    continuation and partly wrong, so rounds accept from none to all of their drafts."""
    tok_prompts = {0: [0, 5, 6, 7, 8], 1: [0], 2: [0, 100, 200, 300], 3: list(range(50, 70)), 4: [0, 9, 9]}
    max_new = 24
    eos = target.generation_config.eos_token_id
    expected = {}
    for i, p in tok_prompts.items():
        with torch.no_grad():
            ids = target.generate(torch.tensor([p]), max_new_tokens=max_new, do_sample=False)
        expected[i] = ids[0, len(p):].tolist()
    rng = random.Random(3)

    def drafts_for(i, done):
        k = rng.randint(0, 5)
        drafts = list(expected[i][len(done) + 1:len(done) + 1 + k])
        if drafts and rng.random() < 0.5:
            j = rng.randrange(len(drafts))
            drafts[j] = (drafts[j] + 1 + rng.randrange(100)) % 4096
        return drafts

    got = decode_interleaved(bv, tok_prompts, max_new, eos, drafts_for,
                             start_round={0: 0, 1: 0, 2: 2, 3: 3, 4: 5})
    assert got == expected
    assert len(bv) == 0


def test_remove_frees_the_id_for_a_new_sequence(target, bv):
    bv.add(5, [0, 1, 2, 3, 4, 5])
    bv.score({5: [6, 7]})
    bv.commit(5, 2, 2, 8)
    bv.remove(5)
    assert 5 not in bv and len(bv) == 0
    bv.add(5, [0, 44])
    bv.add(6, [0, 3, 4, 5, 6, 7, 8, 9])
    out = bv.score({5: [12, 13], 6: []})
    torch.testing.assert_close(out[5], verifier_logits(target, [0, 44], [([12, 13], 0, 0)])[0], atol=ATOL, rtol=0)
    assert bv.length(5) == 4


def test_errors_say_what_is_wrong(bv):
    with pytest.raises(ValueError, match="at least one token"):
        bv.add(1, [])
    bv.add(1, [0, 5])
    with pytest.raises(ValueError, match="already present"):
        bv.add(1, [0])
    with pytest.raises(ValueError, match="outside the target's vocabulary of 4096"):
        bv.add(2, [0, 4096])
    assert 2 not in bv
    with pytest.raises(KeyError, match="no sequence 9"):
        bv.score({1: [], 9: [3]})
    with pytest.raises(ValueError, match="outside the target's vocabulary"):
        bv.score({1: [-1]})
    with pytest.raises(ValueError, match="nothing to commit"):
        bv.commit(1, 0, 0, 3)
    bv.score({1: [3, 4]})
    with pytest.raises(ValueError, match="not committed"):
        bv.score({1: []})
    with pytest.raises(ValueError, match="scored with 2 drafts"):
        bv.commit(1, 0, 3, 5)
    with pytest.raises(ValueError, match="scored with 2 drafts"):
        bv.commit(1, 3, 2, 5)
    bv.commit(1, 2, 2, 5)
    for call in (lambda: bv.remove(4), lambda: bv.length(4), lambda: bv.commit(4, 0, 0, 1)):
        with pytest.raises(KeyError, match="no sequence 4"):
            call()
    assert bv.score({}) == {}


def test_sliding_window_targets_are_refused():
    from transformers import MistralConfig, MistralForCausalLM
    cfg = MistralConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
                        intermediate_size=64, vocab_size=64, sliding_window=16)
    with pytest.raises(ValueError, match="DynamicSlidingWindowLayer.*Verifier"):
        BatchVerifier(MistralForCausalLM(cfg), torch.device("cpu"))


def test_a_gpt2_target_with_learned_positions(tmp_path):
    """Absolute position embeddings read the explicit position ids: GPT-2 batches too."""
    from transformers import GPT2Config, GPT2LMHeadModel
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_embd=32, n_layer=2, n_head=2, vocab_size=64, n_positions=64)).eval()
    bv = BatchVerifier(model, torch.device("cpu"))
    prompts = {0: [1, 2, 3, 4, 5, 6, 7, 8], 1: [9], 2: [10, 11, 12]}
    drafts = {0: [1], 1: [2, 3, 4], 2: []}
    for i, p in prompts.items():
        bv.add(i, p)
    out = bv.score(drafts)
    for i, p in prompts.items():
        torch.testing.assert_close(out[i], verifier_logits(model, p, [(drafts[i], 0, 0)])[0], atol=ATOL, rtol=0)


# -- loading: one device, accelerate's device maps ---------------------------------------

def greedy_tokens(model, prompts, max_new=12):
    out = {}
    for i, p in prompts.items():
        with torch.no_grad():
            out[i] = model.generate(torch.tensor([p]), max_new_tokens=max_new, do_sample=False)[0, len(p):].tolist()
    return out


def batch_greedy(bv, prompts, max_new=12):
    """Plain greedy decoding (no drafts) of all ``prompts`` at once through ``bv``."""
    for i, p in prompts.items():
        bv.add(i, p)
    out = {i: [] for i in prompts}
    while len(bv):
        for i, logits in bv.score({i: [] for i in sorted(out) if i in bv}).items():
            token = int(logits[0].argmax())
            out[i].append(token)
            bv.commit(i, 0, 0, token)
            if len(out[i]) == max_new or token == 1:
                bv.remove(i)
    return out


LOAD_PROMPTS = {0: [0, 5, 6, 7, 8], 1: [0, 300, 301], 2: [0]}


@pytest.mark.parametrize("placement", ["device", "auto", "dict+disk", "max_memory"])
def test_from_pretrained_placements_decode_as_generate(target, tmp_path, placement):
    """``device_map="auto"`` (all on cpu here), a device map sending three layers to disk
    (accelerate's offload hooks), and a ``max_memory`` too small for any layer (all offloaded)."""
    kwargs = {"device": {"device": "cpu"}, "auto": {"device_map": "auto"},
              "dict+disk": {"device_map": {"model.embed_tokens": "cpu", "model.rotary_emb": "cpu",
                                           "model.norm": "cpu", "lm_head": "cpu",
                                           **{f"model.layers.{i}": "cpu" if i < 3 else "disk" for i in range(6)}},
                            "offload_folder": str(tmp_path)},
              "max_memory": {"device_map": "auto", "max_memory": {"cpu": "1MB"}, "offload_folder": str(tmp_path)},
              }[placement]
    bv = BatchVerifier.from_pretrained(TARGET, **kwargs)
    if placement in ("dict+disk", "max_memory"):
        assert "disk" in bv.model.hf_device_map.values()
    assert bv.device == torch.device("cpu")
    assert batch_greedy(bv, LOAD_PROMPTS) == greedy_tokens(target, LOAD_PROMPTS)
    v = Verifier.from_pretrained(TARGET, **kwargs)
    v.prefill(LOAD_PROMPTS[0])
    assert int(v.score([])[0].argmax()) == greedy_tokens(target, LOAD_PROMPTS)[0][0]


def test_placement_options_that_conflict_are_refused(tmp_path, monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(ValueError, match="not both"):
        BatchVerifier.from_pretrained(TARGET, device="cpu", device_map="auto")
    with pytest.raises(ValueError, match="not both"):
        check_placement(None, "auto", "auto")
    with pytest.raises(ValueError, match="torchrun"):
        Verifier.from_pretrained(TARGET, tp_plan="auto")
    with pytest.raises(CheckpointError, match="device_map='nowhere'.*placement"):
        BatchVerifier.from_pretrained(TARGET, device_map="nowhere")
