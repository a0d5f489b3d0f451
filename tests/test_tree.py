"""Token trees, the verification side (issue 15): masks, positions and TreeSort; one target
forward over a whole tree equal to per-path chains; the KV compacted to the accepted path;
greedy tree decoding equal to the target's greedy decoding; and tree sampling lossless
(chi-square), with a wrong q caught.

The trees are drafted here on the host by the float draft model (the engine's tree
drafting comes later): best-first expansion of the draft's top-k for greedy, and siblings
drawn from q (without replacement, or i.i.d.) for sampling.
"""

from __future__ import annotations

import heapq
import itertools
from collections import Counter

import numpy as np
import pytest
import torch

from conftest import make_tiny_llama
from dfvg_host.acceptance import (SamplingParams, accept_tree_greedy, accept_tree_rejection,
                                  target_distribution, verify_tree)
from dfvg_host.compiler import load_model
from dfvg_host.tree import ROOT, DraftTree, descendants, most_probable_nodes, subtree
from dfvg_host.tree_drafting import RankAcceptance, record_path
from dfvg_host.verifier import Verifier
from sampling_checks import chi_square_p, first_two_distribution


def random_tree(n: int, vocab: int, gen: torch.Generator, *, max_children: int = 3) -> DraftTree:
    """A random tree of ``n`` nodes: each node's parent drawn among ROOT and earlier nodes."""
    tree = DraftTree(vocab)
    while len(tree) < n:
        parent = int(torch.randint(-1, len(tree), (), generator=gen))
        if len(tree.children(parent)) < max_children:
            tree.add(int(torch.randint(vocab, (), generator=gen)), parent)
    return tree


def reachability(parents: list[int]) -> torch.Tensor:
    """[i, j]: j reached from i by following parent pointers zero or more times."""
    n = len(parents)
    out = torch.zeros(n, n, dtype=torch.bool)
    for i in range(n):
        j = i
        while j != ROOT:
            out[i, j] = True
            j = parents[j]
    return out


# -- masks, positions, TreeSort ------------------------------------------------------------

def test_masks_positions_and_paths():
    gen = torch.Generator().manual_seed(1)
    for trial in range(50):
        tree = random_tree(int(torch.randint(1, 24, (), generator=gen)), 50, gen)
        n = len(tree)
        anc = tree.ancestor_mask()
        assert torch.equal(anc, reachability(tree.parents))
        assert torch.equal(anc, anc.tril())           # parents come first
        att = tree.attention_mask()
        assert att.shape == (n + 1, n + 1) and att[:, 0].all() and not att[0, 1:].any()
        assert torch.equal(att[1:, 1:], anc)
        pos = tree.position_ids(37)
        assert pos[0] == 37
        for i in range(n):
            path = tree.path(i)
            assert tree.is_path(path) and path[-1] == i
            assert pos[1 + i] == 37 + len(path) == 37 + tree.nodes[i].depth
            assert set(path) == set(torch.nonzero(anc[i]).flatten().tolist())
    assert not DraftTree.from_parents([5, 6, 7], [-1, 0, -1]).is_path([0, 2])
    with pytest.raises(ValueError):
        DraftTree.from_parents([1, 2], [-1, 1])


def test_tree_sort_is_block_lower_triangular():
    gen = torch.Generator().manual_seed(2)
    for trial in range(50):
        tree = random_tree(int(torch.randint(1, 30, (), generator=gen)), 50, gen)
        ts = tree.tree_sort()
        assert sorted(ts.order) == list(range(len(tree)))
        sorted_tree = tree.permute(ts.order)
        # the same tree: each node's path of tokens, and each node's children in order
        for k, old in enumerate(ts.order):
            assert sorted_tree.path_tokens(k) == tree.path_tokens(old)
            assert [ts.order[c] for c in sorted_tree.children(k)] == tree.children(old)
        mask = sorted_tree.ancestor_mask()
        assert torch.equal(mask, reachability(sorted_tree.parents))
        # blocks tile 0..n; one per leaf; each a chain ending at a leaf
        assert ts.blocks[0][0] == 0 and ts.blocks[-1][1] == len(tree)
        assert all(a[1] == b[0] for a, b in zip(ts.blocks, ts.blocks[1:]))
        assert len(ts.blocks) == len(tree.leaves())
        for b, (s, e) in enumerate(ts.blocks):
            assert all(sorted_tree.parents[k] == k - 1 for k in range(s + 1, e))
            assert not sorted_tree.children(e - 1)
            # diagonal block exactly causal, nothing above it
            assert torch.equal(mask[s:e, s:e], torch.ones(e - s, e - s, dtype=torch.bool).tril())
            assert not mask[s:e, e:].any()
            # each block below the diagonal: the same row for every node, a prefix of ones
            for (cs, ce) in ts.blocks[:b]:
                sub = mask[s:e, cs:ce]
                assert (sub == sub[0]).all()
                ones = int(sub[0].sum())
                assert sub[0, :ones].all() and not sub[0, ones:].any()
        # each root-to-leaf branch: prefixes of earlier blocks, then its own block
        for (s, e) in ts.blocks:
            branch = sorted_tree.path(e - 1)
            assert branch[-(e - s):] == list(range(s, e))


def test_tree_from_engine_records():
    from dfvg_hw.spec.descriptors import DraftedToken
    from dfvg_hw.spec.numerics import PROB_BITS
    one = 1 << PROB_BITS
    rec = DraftedToken(token=3, prob=one // 2, topk_ids=[3, 5], topk_probs=[one // 2, one // 2])
    tree = DraftTree(vocab=8)
    i = tree.add(3, ROOT, rec)
    assert torch.equal(tree.q(i), torch.tensor([0, 0, 0, .5, 0, .5, 0, 0], dtype=torch.float64))


def brute_force_best(parents, probs, budget):
    """The ancestor-closed node set of ``budget`` nodes with the largest sum of path
    probabilities, by enumeration (the greedy top-k of path probability maximises it)."""
    def path_prob(i):
        p = 1.0
        while i != ROOT:
            p, i = p * probs[i], parents[i]
        return p
    closed = [set(c) for c in itertools.combinations(range(len(parents)), budget)
              if all(parents[i] == ROOT or parents[i] in c for i in c)]
    return max(sum(path_prob(i) for i in c) for c in closed), path_prob


def test_most_probable_nodes_is_the_best_ancestor_closed_budget():
    rng = np.random.default_rng(3)
    for _ in range(60):
        n = int(rng.integers(2, 9))
        parents = [ROOT] + [int(rng.integers(-1, i)) for i in range(1, n)]
        probs = [float(p) for p in rng.random(n)]
        budget = int(rng.integers(1, n + 1))
        chosen = most_probable_nodes(parents, probs, budget)
        assert chosen == sorted(chosen) and len(chosen) == budget
        assert all(parents[i] == ROOT or parents[i] in chosen for i in chosen)
        best, path_prob = brute_force_best(parents, probs, budget)
        assert sum(path_prob(i) for i in chosen) == pytest.approx(best)
    # ties go to the lower index; a zero probability ranks last; a budget past the tree takes it all
    assert most_probable_nodes([ROOT, ROOT, ROOT], [0.5, 0.5, 0.5], 2) == [0, 1]
    assert most_probable_nodes([ROOT, 0, ROOT], [1.0, 0.0, 0.1], 2) == [0, 2]
    assert most_probable_nodes([ROOT, 0], [0.3, 0.9], 5) == [0, 1]
    with pytest.raises(ValueError, match="before"):
        most_probable_nodes([ROOT, 2, 0], [0.5] * 3, 2)


def test_descendants_subtree_and_record_paths():
    parents = [ROOT, ROOT, 0, 1, 2, 1]
    assert descendants(parents) == list(range(6))
    assert descendants(parents, 1) == [3, 5] and descendants(parents, 0) == [2, 4]
    assert subtree(parents, [0, 2, 4]) == [ROOT, 0, 1]
    assert subtree(parents, [3, 5], root=1) == [ROOT, ROOT]
    assert record_path(parents, 4) == [0, 2, 4] and record_path(parents, ROOT) == []
    with pytest.raises(ValueError, match="without its parent"):
        subtree(parents, [0, 4])


def test_rank_acceptance_learns_what_the_target_chooses():
    ranks = RankAcceptance()
    prior = ranks.probability(0, 0.3)
    assert prior == pytest.approx(RankAcceptance.PRIOR[0]) and ranks.probability(1, 0.3) < prior
    for _ in range(200):              # the target always takes the draft's second choice at q ~ 0.3
        ranks.observe([10, 11, 12], [0.4, 0.3, 0.3], 11)
    assert ranks.probability(1, 0.31) > 0.95 and ranks.probability(0, 0.45) < 0.05
    assert ranks.probability(0, 0.95) == pytest.approx(RankAcceptance.PRIOR[0])   # another cell
    ranks.observe([10, 11], [0.6, 0.4], 99)                                         # outside the top-k
    assert ranks.probability(0, 0.6) < RankAcceptance.PRIOR[0] and ranks.probability(1, 0.4) < 1


# -- one target forward over a tree --------------------------------------------------------

@pytest.fixture(scope="module")
def demo_models(demo_pair):
    draft_dir, target_dir, data_dir = demo_pair
    return load_model(draft_dir), load_model(target_dir)


@pytest.fixture(scope="module")
def tiny_gqa_model(tiny_gqa_dir):
    return load_model(tiny_gqa_dir)


def chain_logits(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0, -1]


def cache_tensors(verifier: Verifier) -> list[torch.Tensor]:
    return [t for layer in verifier.cache.layers for t in (layer.keys, layer.values)]


@pytest.mark.parametrize("which", ["demo", "tiny_gqa"])
def test_score_tree_equals_per_path_chains_and_commit_path_equals_the_chain(which, request):
    model = request.getfixturevalue("demo_models")[1] if which == "demo" \
        else request.getfixturevalue("tiny_gqa_model")
    vocab = model.config.vocab_size
    gen = torch.Generator().manual_seed(3)
    for trial in range(4):
        prompt = torch.randint(4, vocab, (int(torch.randint(1, 20, (), generator=gen)),),
                               generator=gen).tolist()
        tree = random_tree(int(torch.randint(1, 14, (), generator=gen)), vocab, gen)
        v = Verifier(model, torch.device("cpu"))
        v.prefill(prompt)
        if trial % 2:                   # a chain round first: the cache not just a prefill
            v.score([7, 8])
            v.commit(1, 2, 9)
            prompt = prompt + [7, 9]
        if trial == 3:                  # and in TreeSort order
            tree = tree.permute(tree.tree_sort().order)
        logits = v.score_tree(tree)
        assert logits.shape == (len(tree) + 1, vocab)
        torch.testing.assert_close(logits[0], chain_logits(model, prompt), atol=1e-4, rtol=1e-4)
        for i in range(len(tree)):
            torch.testing.assert_close(logits[1 + i], chain_logits(model, prompt + tree.path_tokens(i)),
                                       atol=1e-4, rtol=1e-4)
        # commit a path that is not the first nodes, and compare with the chain's cache
        node = max(range(len(tree)), key=lambda i: (len(tree.path(i)), i))
        path = tree.path(node)[:max(1, len(tree.path(node)) - trial % 2)]
        nxt = int(torch.randint(4, vocab, (), generator=gen))
        v.commit_path(path, nxt)
        ref = Verifier(model, torch.device("cpu"))
        ref.prefill(prompt + [tree.nodes[i].token for i in path] + [nxt])
        assert v.length == ref.length and v.pending == ref.pending == nxt
        for a, b in zip(cache_tensors(v), cache_tensors(ref)):
            assert a.shape == b.shape
            torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
        drafts = [5, 6, 7]
        torch.testing.assert_close(v.score(drafts), ref.score(drafts), atol=1e-4, rtol=1e-4)
        v.commit(0, 3, 9)
        ref.commit(0, 3, 9)
        nxt_tree = random_tree(5, vocab, gen)
        torch.testing.assert_close(v.score_tree(nxt_tree), ref.score_tree(nxt_tree), atol=1e-4, rtol=1e-4)
        v.commit_path([], 4)
        assert v.length == ref.length - 5


def test_commit_path_refuses_what_is_not_a_path(tiny_gqa_model):
    v = Verifier(tiny_gqa_model, torch.device("cpu"))
    v.prefill([5, 6, 7])
    with pytest.raises(RuntimeError):
        v.commit_path([], 3)
    v.score_tree(DraftTree.from_parents([10, 11, 12], [-1, -1, 0]))
    with pytest.raises(ValueError):
        v.commit_path([1, 2], 3)
    for chain_call in (lambda: v.commit(1, 3, 3), lambda: v.score([1])):
        with pytest.raises(RuntimeError, match="commit_path"):
            chain_call()
    v.commit_path([0, 2], 3)
    assert v.length == 5 and v.pending == 3
    v.commit(0, 0, 4)                 # a chain round goes on once the tree is committed


# -- host drafting and a decoding loop for the tests ---------------------------------------

class HostDrafter:
    """Draft trees with a float draft model: its KV cache of the committed sequence kept
    between calls, each query a short forward over the path then cropped away, and the
    last logits memoised by prefix."""

    def __init__(self, model):
        from transformers import DynamicCache
        self.model = model
        self.memo: dict[tuple, torch.Tensor] = {}
        self.cache = DynamicCache(config=model.config)
        self.cached: list[int] = []          # the tokens the cache holds

    def logits(self, ids: list[int]) -> torch.Tensor:
        """The draft's last logits after ``ids`` (float64)."""
        key = tuple(ids)
        if key not in self.memo:
            if self.cached != ids[:len(self.cached)] or len(self.cached) >= len(ids):
                self.cache.crop(-len(self.cached)) if self.cached else None
                self.cached = []
            new = ids[len(self.cached):]
            with torch.no_grad():
                out = self.model(torch.tensor([new]), cache=self.cache, use_cache=True).logits[0, -1]
            self.memo[key] = out.double()
            self.cache.crop(-len(new))
        return self.memo[key]

    def advance(self, seq: list[int]) -> None:
        """Cache ``seq`` but its last token (the start of every query of the round)."""
        head = seq[:-1]
        if self.cached != head[:len(self.cached)]:
            if self.cached:
                self.cache.crop(-len(self.cached))
            self.cached = []
        if len(head) > len(self.cached):
            with torch.no_grad():
                self.model(torch.tensor([head[len(self.cached):]]), cache=self.cache, use_cache=True)
            self.cached = list(head)

    def best_first(self, seq: list[int], budget: int, branch: int, max_depth: int,
                   temperature: float = 1.0) -> DraftTree:
        """Greedy trees: grow the node whose path the draft finds most likely (its
        probabilities at ``temperature``), among the top-``branch`` children of the nodes
        so far, until ``budget`` nodes (EAGLE-2 / Sequoia-like). ``branch = 1`` drafts the
        draft's greedy chain of ``budget``."""
        self.advance(seq)
        tree = DraftTree()
        heap, tie = [], itertools.count()

        def expand(node: int, score: float) -> None:
            lp = torch.log_softmax(self.logits(seq + tree.path_tokens(node)) / temperature, -1)
            top = torch.topk(lp, branch)
            for v, t in zip(top.values.tolist(), top.indices.tolist()):
                heapq.heappush(heap, (-(score + v), next(tie), node, t))

        expand(ROOT, 0.0)
        while heap and len(tree) < budget:
            neg, _, parent, token = heapq.heappop(heap)
            i = tree.add(token, parent)
            if tree.nodes[i].depth < max_depth and len(tree) < budget:
                expand(i, -neg)
        return tree

    def sampled(self, seq: list[int], widths: list[int], gen: torch.Generator, *,
                replacement: bool, temperature: float = 1.0, wrong_q=None) -> DraftTree:
        """Sampling trees: ``widths[d]`` children under each node of depth ``d``, drawn from
        the draft's q — i.i.d. (each sibling carries q) or without replacement (sibling j
        carries q with siblings 1..j-1 removed, renormalised). ``wrong_q(q)`` replaces the q
        recorded (not the one drawn from), to check that a test catches it."""
        vocab = self.model.config.vocab_size
        self.advance(seq)
        tree = DraftTree(vocab)
        frontier = [ROOT]
        for width in widths:
            nxt = []
            for node in frontier:
                q = torch.softmax(self.logits(seq + tree.path_tokens(node)) / temperature, -1)
                for _ in range(width):
                    if not q.sum() > 0:
                        break
                    token = int(torch.multinomial(q, 1, generator=gen))
                    nxt.append(tree.add(token, node, q if wrong_q is None else wrong_q(q)))
                    if not replacement:
                        q = q.clone()
                        q[token] = 0
                        q = q / q.sum() if q.sum() > 0 else q
            frontier = nxt
        return tree


def tree_decode(verifier: Verifier, draft_tree, prompt: list[int], max_new: int,
                params: SamplingParams = SamplingParams(), gen: torch.Generator | None = None,
                eos: int | None = None) -> tuple[list[int], int]:
    """Decode ``max_new`` tokens: ``draft_tree(seq)`` drafts each round's tree, one
    score_tree, the verdict, commit_path. Returns the tokens and the rounds."""
    verifier.prefill(prompt)
    seq, out, rounds = list(prompt), [], 0
    while len(out) < max_new:
        tree = draft_tree(seq)
        verdict = verify_tree(verifier.score_tree(tree), tree, params, gen)
        verifier.commit_path(verdict.path, verdict.next_token)
        rounds += 1
        new = [tree.nodes[i].token for i in verdict.path] + [verdict.next_token]
        if eos is not None and eos in new:
            new = new[:new.index(eos) + 1]
            out += new
            break
        out += new
        seq += new
    return out[:max_new], rounds


# -- greedy --------------------------------------------------------------------------------

def heldout_prompts(data_dir, tokenizer, count, length=24, stride=300):
    ids = tokenizer((data_dir / "heldout.txt").read_text())["input_ids"]
    return [ids[i * stride: i * stride + length] for i in range(count)]


def test_accept_tree_greedy_takes_the_longest_matching_path():
    #        root ─┬─ 4 (node 0)
    #              └─ 2 (node 1) ─┬─ 3 (node 2)
    #                             └─ 5 (node 3) ── 6 (node 4)
    tree = DraftTree.from_parents([4, 2, 3, 5, 6], [-1, -1, 1, 1, 3])
    best = {0: 2, 1: 0, 2: 5, 3: 0, 4: 6, 5: 7}      # row -> the target's argmax there
    logits = torch.zeros(6, 8)
    for row, token in best.items():
        logits[row, token] = 1
    v = accept_tree_greedy(logits, tree)
    assert v.path == [1, 3, 4] and v.next_token == 7 and v.accepted == 3
    logits[4] = 0
    logits[4, 1] = 1                                   # node 4 no longer matches after node 3
    v = accept_tree_greedy(logits, tree)
    assert v.path == [1, 3] and v.next_token == 1
    logits[0] = 0
    logits[0, 7] = 1                                   # no child of the root matches
    v = accept_tree_greedy(logits, tree)
    assert v.path == [] and v.next_token == 7


def test_greedy_tree_decoding_equals_the_target_and_beats_the_chain(demo_pair, demo_models):
    """10 held-out prompts x 48 tokens: best-first trees of 8 nodes from the float draft
    give exactly the target's greedy output; tokens per target forward vs the draft's
    greedy chain of 8 (the same tokens verified per forward).

    The tree ranks paths by the draft's probabilities at temperature 0.5: the distilled
    demo draft is underconfident (its top-1 agrees with the target more often than its
    top-1 probability says), and at 1.0 best-first branches too early (0.96x the chain
    at 8 nodes, branch 3). Measured on these prompts: 1.08x at 4 nodes, 1.17x at 8, 1.37x
    at 16."""
    from transformers import AutoTokenizer
    draft_dir, target_dir, data_dir = demo_pair
    draft, target = demo_models
    tok = AutoTokenizer.from_pretrained(target_dir)
    drafter = HostDrafter(draft)
    budget, new_tokens = 8, 48
    tree_tokens = tree_rounds = chain_tokens = chain_rounds = 0
    for prompt in heldout_prompts(data_dir, tok, 10):
        with torch.no_grad():
            ref = target.generate(torch.tensor([prompt]), max_new_tokens=new_tokens,
                                  do_sample=False)[0, len(prompt):].tolist()
        out, rounds = tree_decode(Verifier(target, torch.device("cpu")),
                                  lambda s: drafter.best_first(s, budget, 3, budget, 0.5), prompt,
                                  new_tokens, eos=tok.eos_token_id)
        assert out == ref
        tree_tokens += len(out)
        tree_rounds += rounds
        out, rounds = tree_decode(Verifier(target, torch.device("cpu")),
                                  lambda s: drafter.best_first(s, budget, 1, budget), prompt,
                                  new_tokens, eos=tok.eos_token_id)
        assert out == ref
        chain_tokens += len(out)
        chain_rounds += rounds
    tree_len, chain_len = tree_tokens / tree_rounds, chain_tokens / chain_rounds
    print(f"\nmean tokens per target forward, {budget} tokens verified per forward: tree "
          f"{tree_len:.2f}, chain {chain_len:.2f}, ratio {tree_len / chain_len:.3f}")
    assert tree_len >= chain_len


# -- sampling ------------------------------------------------------------------------------

def exact_first_two(p0, p1):
    return (p0[:, None] * p1).numpy()


def synthetic_first_two(p0, p1, q0, q1, widths, n, *, replacement, record=None, seed=0):
    """Samples of the first two tokens through accept_tree_rejection alone, with target
    rows p0 / p1[x] and draft rows q0 / q1[x] over a small vocabulary; a second token the
    round did not give comes from p1 (the next round's target, exactly)."""
    gen = torch.Generator().manual_seed(seed)
    counts = Counter()
    vocab = p0.shape[0]

    def draw(tree, node, q, width):
        kids = []
        for _ in range(width):
            token = int(torch.multinomial(q, 1, generator=gen))
            kids.append(tree.add(token, node, q if record is None else record(q, kids, tree)))
            if not replacement:
                q = q.clone()
                q[token] = 0
                q = q / q.sum()
        return kids

    for _ in range(n):
        tree = DraftTree(vocab)
        for c in draw(tree, ROOT, q0, widths[0]):
            draw(tree, c, q1[tree.nodes[c].token], widths[1])
        # row 1 + i: the target after node i; after a depth-2 node it would give the
        # third token, which is not counted (p0 stands in)
        rows = torch.stack([p0] + [p1[node.token] if node.depth == 1 else p0 for node in tree.nodes])
        v = accept_tree_rejection(rows, tree, gen)
        first = [tree.nodes[i].token for i in v.path] + [v.next_token]
        if len(first) < 2:
            first.append(int(torch.multinomial(p1[first[0]], 1, generator=gen)))
        counts[tuple(first[:2])] += 1
    return counts


@pytest.fixture(scope="module")
def synthetic_rows():
    torch.manual_seed(5)
    vocab = 6
    p0 = torch.softmax(torch.randn(vocab, dtype=torch.float64) * 1.5, -1)
    p1 = torch.softmax(torch.randn(vocab, vocab, dtype=torch.float64) * 1.5, -1)
    q0 = torch.softmax(torch.randn(vocab, dtype=torch.float64) * 1.5, -1)
    q1 = torch.softmax(torch.randn(vocab, vocab, dtype=torch.float64) * 1.5, -1)
    return p0, p1, q0, q1


@pytest.mark.parametrize("replacement", [True, False], ids=["iid", "without-replacement"])
def test_recursive_rejection_is_exact(synthetic_rows, replacement):
    p0, p1, q0, q1 = synthetic_rows
    n = 6000
    counts = synthetic_first_two(p0, p1, q0, q1, [3, 2], n, replacement=replacement)
    p = chi_square_p(counts, exact_first_two(p0, p1), n)
    print(f"\nsynthetic tree sampling ({'iid' if replacement else 'without replacement'}): p = {p:.3f}")
    assert p > 0.01, f"tree sampling differs from the target distribution (p = {p:.2e})"


def test_recursive_rejection_with_the_wrong_sibling_q_is_caught(synthetic_rows):
    """Siblings drawn without replacement but verified as if i.i.d. (each with the
    unconditioned q): biased, and the same test sees it."""
    p0, p1, q0, q1 = synthetic_rows
    n = 6000

    def first_q(q, kids, tree):     # the q before any sibling was removed
        return tree.q(kids[0]) if kids else q

    counts = synthetic_first_two(p0, p1, q0, q1, [3, 2], n, replacement=False, record=first_q)
    p = chi_square_p(counts, exact_first_two(p0, p1), n)
    print(f"\nsynthetic tree sampling, without replacement verified as iid: p = {p:.2e}")
    assert p < 0.01, f"a wrong sibling q went undetected (p = {p:.3f})"


VOCAB = 8
PARAMS = SamplingParams(temperature=1.0)
PROMPT = [1, 4, 6, 3]


@pytest.fixture(scope="module")
def small_vocab_models(tmp_path_factory):
    """A random target and a different random draft over 8 tokens (test_speculative's pair)."""
    root = tmp_path_factory.mktemp("tree-small-vocab")
    target = make_tiny_llama(root / "target", vocab=VOCAB, seed=10, weight_scale=3.0, eos=None)
    draft = make_tiny_llama(root / "draft", vocab=VOCAB, seed=11, weight_scale=3.0, eos=None)
    return load_model(draft), load_model(target)


def sample_first_two_with_trees(draft, target, n, *, wrong_q=None, replacement=False):
    verifier = Verifier(target, torch.device("cpu"))
    drafter = HostDrafter(draft)
    gen = torch.Generator().manual_seed(1234)
    counts = Counter()
    for _ in range(n):
        out, _ = tree_decode(verifier, lambda s: drafter.sampled(s, [3, 2], gen, replacement=replacement,
                                                                 wrong_q=wrong_q),
                             PROMPT, 2, PARAMS, gen)
        counts[tuple(out[:2])] += 1
    return counts


def test_tree_sampling_is_lossless(small_vocab_models):
    """The whole path: host-drafted trees (siblings without replacement), score_tree,
    accept_tree_rejection, commit_path and a second round when the first gave one token."""
    draft, target = small_vocab_models
    n = 3000
    counts = sample_first_two_with_trees(draft, target, n)
    p = chi_square_p(counts, first_two_distribution(target, PROMPT, PARAMS, VOCAB), n)
    print(f"\ntree sampling on the small-vocabulary pair: p = {p:.3f}")
    assert p > 0.01, f"tree samples differ from the target distribution (p = {p:.2e})"


def test_tree_sampling_with_a_wrong_q_is_caught(small_vocab_models):
    draft, target = small_vocab_models
    n = 1500
    uniform = lambda q: torch.full_like(q, 1.0 / q.shape[0])
    counts = sample_first_two_with_trees(draft, target, n, wrong_q=uniform)
    p = chi_square_p(counts, first_two_distribution(target, PROMPT, PARAMS, VOCAB), n)
    print(f"\ntree sampling with a uniform q recorded: p = {p:.2e}")
    assert p < 0.01, f"a wrong q went undetected (p = {p:.3f})"
