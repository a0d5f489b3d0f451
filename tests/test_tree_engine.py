"""Tree drafting on the functional model (docs/isa.md §9): a tree request's nodes, their
paths' attention, the greedy and sampled expansions, compaction, the request checks and
the cycle model's walk."""

import numpy as np
import pytest

from dfvg_hw.spec import numerics as nx
from dfvg_hw.spec.descriptors import (MAX_DRAFT, REQUEST_FIELDS, REQUEST_HEADER_WORDS, Compaction,
                                      DraftedToken, DraftRequest, DraftResult, ErrorCode, pack_fields)
from dfvg_hw.spec.isa import Op, decode
from sim.cycle_model import estimate_request
from sim.session import IMAGE_ADDR, REQUEST_ADDR, RESULT_ADDR, FunctionalSession

T1 = dict(t_mult=nx.T1_MULT, t_shift=nx.T1_SHIFT)


def prompt(n, seed=0, vocab=256):
    return np.random.default_rng(seed).integers(3, vocab, n).tolist()


@pytest.fixture
def fresh(tiny_engine, tiny_compiled):
    return lambda: FunctionalSession(tiny_engine, tiny_compiled.image, tiny_compiled.program)


@pytest.fixture
def tree(tiny_compiled):
    t = tiny_compiled.tree
    assert t.width == 2          # the tiny preset's rows: the compiler's tree forward
    return t


def tree_request(tree, tokens, levels, start_pos=0, **kw) -> DraftRequest:
    kw.setdefault("topk", 4)
    return DraftRequest(tokens, start_pos, levels, tree_width=tree.width, tree_pc=tree.pc,
                        row_pitch=tree.row_pitch, **kw)


def ok(result: DraftResult) -> list[DraftedToken]:
    assert result.status == ErrorCode.OK, result.status.describe()
    return result.tokens


def path_of(nodes: list[DraftedToken], i: int) -> list[int]:
    out = []
    while i != -1:
        out.append(i)
        i = nodes[i].parent
    return out[::-1]


def test_the_compiler_emits_the_tree_forward_after_halt(tiny_compiled, tree):
    ops = [decode(w) for w in tiny_compiled.program]
    assert ops[tree.pc - 1].opcode == Op.HALT and ops[-1].opcode == Op.HALT
    body = ops[tree.pc:]
    assert {i.rows for i in body if i.opcode not in (Op.LOOP, Op.ENDLOOP, Op.NEXT, Op.HALT, Op.SAMPLE)} == {2}
    assert not any(i.opcode == Op.BRANCH for i in body)      # every tree forward samples
    assert {i.rows for i in ops[:tree.pc] if i.rows} == {1}   # the chain forward is unchanged


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_every_node_drafts_what_its_path_drafts_as_a_chain(fresh, tree, seed):
    """The tree's mask is right when each node's distribution equals chain drafting of the
    tokens on its root-to-node path, bit for bit: attention over the committed context and
    the node's ancestors only, at the node's logical position."""
    p = prompt(3 + seed, seed)
    nodes = ok(fresh().run(tree_request(tree, p, 3)))
    assert len(nodes) == 3 * tree.width
    for i, node in enumerate(nodes):
        path = path_of(nodes, i)
        assert [j // tree.width for j in path] == list(range(i // tree.width + 1))   # one a level
        chain = ok(fresh().run(DraftRequest(p + [nodes[j].token for j in path[:-1]], 0, 1, topk=4)))[0]
        assert (chain.topk_ids, chain.topk_probs) == (node.topk_ids, node.topk_probs), f"node {i}"
        assert node.token in node.topk_ids


def test_greedy_expansion_keeps_the_most_probable_paths(fresh, tree):
    """Each level is the ``width`` best candidates by path score over every row's top-k
    (numerics.tree_expand_greedy), the rows' distributions taken from chain drafting."""
    p, w = prompt(4), tree.width
    nodes = ok(fresh().run(tree_request(tree, p, 3)))

    def top(path_tokens):
        return ok(fresh().run(DraftRequest(p + path_tokens, 0, 1, topk=4)))[0]

    rows, scores = [[]], [nx.TREE_SCORE_ROOT]       # the root: the last input
    for level in range(3):
        sources = [top(path) for path in rows]
        picks = nx.tree_expand_greedy(scores, [src.topk_probs for src in sources], w)
        made = nodes[level * w:(level + 1) * w]
        for r, (src, j, _) in enumerate(picks):
            assert made[r].token == sources[src].topk_ids[j]
            assert made[r].parent == (-1 if level == 0 else (level - 1) * w + src)
        rows = [rows[src] + [sources[src].topk_ids[j]] for src, j, _ in picks]
        scores = [score for _, _, score in picks]
    assert nodes[0].token == nodes[0].topk_ids[0]              # row 0 starts with the argmax


def test_greedy_expansion_rule():
    # path scores 1.0 and 0.5; candidate (1, 0) at 0.5·0.9 beats (0, 1) at 1.0·0.3
    half = nx.TREE_SCORE_ROOT // 2
    p = lambda x: int(x * nx.TREE_SCORE_ROOT)
    picks = nx.tree_expand_greedy([nx.TREE_SCORE_ROOT, half], [[p(0.6), p(0.3)], [p(0.9), p(0.1)]], 3)
    assert [(s, j) for s, j, _ in picks] == [(0, 0), (1, 0), (0, 1)]
    ties = nx.tree_expand_greedy([half, half], [[p(0.5)], [p(0.5)]], 2)
    assert [(s, j) for s, j, _ in ties] == [(0, 0), (1, 0)]      # ties to the lower row
    with pytest.raises(ValueError, match="candidates"):
        nx.tree_expand_greedy([nx.TREE_SCORE_ROOT], [[p(1.0)]], 2)


def test_sampled_tree_draws_siblings_iid_and_continues_each_branch(fresh, tree):
    req = tree_request(tree, prompt(4), 3, sample=True, seed=7, counter=100, **T1)
    nodes = ok(fresh().run(req))
    w = tree.width
    for i, node in enumerate(nodes):
        level, row = divmod(i, w)
        assert node.parent == (-1 if level == 0 else (level - 1) * w + row)
        # the draw is counter + record index over the source row's top-k
        r24 = nx.rng32(7, 100 + i) >> (32 - nx.PROB_BITS)
        assert node.token == node.topk_ids[nx.sample_index(node.topk_probs, r24)]
    assert nodes[0].topk_ids == nodes[1].topk_ids            # level 1: one q for every sibling
    assert ok(fresh().run(req)) == nodes                      # reproducible


def test_compaction_puts_the_accepted_path_in_place(fresh, tree, tiny_compiled):
    p, w = prompt(5, 3), tree.width
    s = fresh()
    nodes = ok(s.run(tree_request(tree, p, 3)))
    accepted = path_of(nodes, 2 * w - 1)                       # level 2's last row
    assert any(i % w for i in accepted)                        # off row 0: something moves
    slots = tiny_compiled.shape.layers * tiny_compiled.shape.kv_heads
    comp = Compaction(len(p), w, tuple(i % w for i in accepted), slots)
    tokens = [nodes[i].token for i in accepted]
    after = ok(s.run(DraftRequest([5, 9], len(p) + 2, 4, topk=4, compaction=comp)))
    whole = ok(fresh().run(DraftRequest(p + tokens + [5, 9], 0, 4, topk=4)))
    assert after == whole


def test_tree_of_one_level_makes_the_roots_children(fresh, tree):
    nodes = ok(fresh().run(tree_request(tree, prompt(3), 1)))
    assert [n.parent for n in nodes] == [-1] * tree.width
    assert [n.token for n in nodes] == nodes[0].topk_ids[:tree.width]


def test_the_parent_travels_in_record_word_zero():
    t = DraftedToken(4095, 7, [4095, 3], [7, 9], parent=41)
    r = DraftResult(seq=1, status=ErrorCode.OK, end_pos=3, cycles=9, n_forward=2, tokens=[t], topk=2)
    back = DraftResult.unpack(r.pack(4), 4).tokens[0]
    assert (back.token, back.parent) == (4095, 41)
    chain = DraftResult(seq=1, status=ErrorCode.OK, end_pos=3, cycles=9, n_forward=2,
                        tokens=[DraftedToken(5, 1, [5], [1])], topk=1)
    assert chain.pack(4)[4 * 16:4 * 17] == (5).to_bytes(4, "little")   # a chain record: the token alone
    assert DraftResult.unpack(chain.pack(4), 4).tokens[0].parent == -1


@pytest.mark.parametrize("change, code, why", [
    (dict(topk=1), ErrorCode.BAD_REQUEST, "greedy tree of width 2 needs topk"),
    (dict(n_draft=MAX_DRAFT // 2 + 1), ErrorCode.BAD_REQUEST, "nodes"),
    (dict(tree_width=3), ErrorCode.BAD_REQUEST, "tree_width 3"),
    (dict(row_pitch=0), ErrorCode.BAD_REQUEST, "row_pitch"),
    (dict(tree_width=0), ErrorCode.BAD_REQUEST, "need a tree_width"),
    (dict(tree_width=1), ErrorCode.PROGRAM, "tree forward of width 1"),
    (dict(start_pos=120), ErrorCode.KV_OVERFLOW, "position"),
    (dict(compact_len=2, compact_from=2, compact_width=2, compact_rows=0x20, compact_slots=4),
     ErrorCode.BAD_REQUEST, "not a tree path"),
    (dict(compact_len=1, compact_from=2, compact_width=3, compact_rows=1, compact_slots=4),
     ErrorCode.BAD_REQUEST, "not a tree path"),
    (dict(compact_len=1, compact_from=2, compact_width=2, compact_rows=1, compact_slots=99),
     ErrorCode.BAD_REQUEST, "outside the KV buffer"),
    (dict(compact_len=1, compact_from=2, compact_width=2, compact_rows=1, compact_slots=4,
          kv_slot_base=2), ErrorCode.BAD_REQUEST, "outside the KV buffer"),
    (dict(compact_len=0, compact_slots=4), ErrorCode.BAD_REQUEST, "without compact_len"),
])
def test_bad_tree_requests_fault_with_their_code(fresh, tree, change, code, why):
    """Header fields as the engine reads them (the host's own checks are bypassed)."""
    tokens = prompt(3)
    fields = dict(start_pos=0, n_in=len(tokens), n_draft=3, topk=4, tree_width=tree.width,
                  tree_pc=tree.pc, row_pitch=tree.row_pitch, seq=1)
    fields.update(change)
    words = pack_fields(REQUEST_FIELDS, REQUEST_HEADER_WORDS, fields) + tokens
    s = fresh()
    s.engine.memory.write(REQUEST_ADDR, np.array(words, "<u4").tobytes())
    result = s.engine.run(image_base=IMAGE_ADDR, request_addr=REQUEST_ADDR, result_addr=RESULT_ADDR)
    assert result.status == code and why in str(s.engine.last_fault)


def test_a_chain_only_engine_refuses_tree_fields(tiny_engine, tiny_compiled, tree):
    s = FunctionalSession(tiny_engine, tiny_compiled.image, tiny_compiled.program)
    s.engine.tree_width = 0
    for request in (tree_request(tree, prompt(3), 2),
                    DraftRequest(prompt(3), 4, 2, compaction=Compaction(2, 2, (1,), 4))):
        assert s.run(request).status == ErrorCode.BAD_REQUEST
        assert "chains only" in str(s.engine.last_fault)


def test_rows_other_than_one_still_fault_in_a_chain_forward(fresh, tree):
    """EMBED, KVAPPEND, ATTN and LOGITS take several rows only in a tree forward."""
    s = fresh()
    r = s.run(DraftRequest(prompt(3), 0, 2, topk=2, tree_pc=0))       # a chain request
    assert r.status == ErrorCode.OK
    # enter the tree forward from a chain request: NEXT's n is the tree entry
    from dfvg_hw.spec.isa import Instruction, encode
    program = list(s.engine.imem)
    at = next(i for i, w in enumerate(program) if decode(w).opcode == Op.NEXT)
    program[at] = encode(Instruction(Op.NEXT, n=tree.pc))
    bad = FunctionalSession(s.engine.config, b"", program)
    bad.engine.memory.write(IMAGE_ADDR, s.engine.memory.read(IMAGE_ADDR, 1 << 16))
    r = bad.run(DraftRequest(prompt(3), 0, 2, topk=2))
    assert r.status == ErrorCode.PROGRAM and "chain forward" in str(bad.engine.last_fault)


@pytest.mark.parametrize("sample, comp", [(False, None), (True, (2, 4))])
def test_cycle_estimate_of_a_tree_request_equals_the_functional_count(fresh, tree, tiny_engine,
                                                                      tiny_compiled, sample, comp):
    s = fresh()
    compaction = None
    if comp:
        ok(s.run(tree_request(tree, prompt(4), 3)))
        compaction = Compaction(4, tree.width, (1, 0), comp[1])
    extra = T1 if sample else {}
    r = s.run(tree_request(tree, prompt(3), 4, start_pos=6 if comp else 0, sample=sample,
                           compaction=compaction, **extra))
    assert r.status == ErrorCode.OK
    est = estimate_request(tiny_engine, tiny_compiled.program, n_in=3, n_draft=4,
                           start_pos=6 if comp else 0, topk=4, image_base=IMAGE_ADDR,
                           tree_width=tree.width, tree_pc=tree.pc, row_pitch=tree.row_pitch,
                           sample=sample, compaction=comp or (0, 0))
    assert s.engine.counts.by_op == est.by_op and s.engine.counts.total == est.total
    assert r.n_forward == 3 + 3 and r.end_pos == (6 if comp else 0) + 3 + 3


def test_a_sampled_tree_forward_without_its_own_logits_draws_from_the_one_row(tiny_engine, tiny_compiled, tree):
    """A tree forward whose program skips its LOGITS leaves the root's one row in the
    buffer: every row draws from it (as the RTL's sampler does), no bare exception."""
    from dfvg_hw.spec.isa import Instruction, MatmulMode, encode
    program = list(tiny_compiled.program)
    at = next(i for i in range(tree.pc, len(program))
              if decode(program[i]).opcode == Op.MATMUL and decode(program[i]).mode == MatmulMode.LOGITS)
    program[at] = encode(Instruction(Op.NOP))
    s = FunctionalSession(tiny_engine, tiny_compiled.image, program)
    nodes = ok(s.run(tree_request(tree, prompt(3), 3, sample=True, seed=5, **T1)))
    w = tree.width
    assert [n.parent for n in nodes[w:]] == [(level - 1) * w for level in (1, 2) for _ in range(w)]
    assert all(n.topk_ids == nodes[0].topk_ids for n in nodes)      # all from the root's row
