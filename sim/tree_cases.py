"""Random tree-drafting sessions on a compiled draft, run on two devices and compared.

A *script* is a list of requests to one engine, one after another, as a host drafting
trees sends them (docs/isa.md §9): a tree request (greedy or sampled, random prompt,
``1 … D`` levels), then often a request that compacts a random accepted path of the tree
before it (its nodes' KV moved in place, §9.3) and drafts on from there, chain requests
in between, and now and then a request that faults (a tree field refused, a tree forward
past the KV buffer, a tree width the program was not compiled for). :func:`random_script`
builds one on the functional model (``sim://``), since a request's compaction depends on
the tree the one before drafted, and :func:`run_script` replays it on any device with
the transport operations (:class:`~sim.device.SimDevice`, the RTL devices).

:func:`compare_runs` holds an RTL run to the functional one: every result bit for bit
(status, ``end_pos``, ``n_forward``, ``error_pc``, ``topk`` and every record with its
parent); on a request that completes every ``OP_CYCLES`` counter and the cycle count too,
on a fault the rules of :func:`sim.fuzz.compare` (the faulting instruction part-way).
Later requests of a script read the KV the earlier ones left, so a wrong compaction or
a KV entry stored at the wrong position shows in their drafts.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import numpy as np

from dfvg_hw.spec import numerics as nx
from dfvg_hw.spec.descriptors import (MAX_DRAFT, Compaction, DraftRequest, DraftResult, ErrorCode,
                                      result_bytes)
from dfvg_hw.spec.isa import to_bytes
from dfvg_hw.spec.regmap import Control, Irq, MemoryMap, Reg
from sim import fuzz

__all__ = ["TreeRun", "random_script", "run_script", "compare_runs", "load_draft", "soft_reset"]


@dataclass
class TreeRun:
    """One request's outcome on a device: its result (None if it does not parse), the
    ``OP_CYCLES`` counters and the ``CYCLES`` register."""
    request: DraftRequest
    result: DraftResult | None
    units: dict = field(default_factory=dict)
    cycles: int = 0


def load_draft(dev, compiled) -> None:
    """Write a compiled draft's image and program into ``dev`` and load the program, as
    the driver does."""
    dev.dma_write(MemoryMap.IMAGE, compiled.image)
    dev.dma_write(MemoryMap.PROGRAM, to_bytes(compiled.program))
    for lo, value in ((Reg.IMAGE_BASE_LO, MemoryMap.IMAGE), (Reg.PROG_BASE_LO, MemoryMap.PROGRAM),
                      (Reg.REQ0_LO, MemoryMap.REQUEST[0]), (Reg.RES0_LO, MemoryMap.RESULT[0])):
        dev.write32(lo, value & 0xFFFFFFFF)
        dev.write32(lo + 4, value >> 32)
    dev.write32(Reg.PROG_LEN, len(compiled.program))
    dev.write32(Reg.IRQ_ENABLE, Irq.DONE)
    dev.write32(Reg.CONTROL, Control.LOAD_PROGRAM)
    fuzz.wait_idle(dev, "LOAD_PROGRAM")


def soft_reset(dev) -> None:
    """Soft-reset ``dev`` (zero KV and VMEM), so that it starts a script as a fresh
    :class:`~sim.device.SimDevice` does."""
    dev.write32(Reg.CONTROL, Control.SOFT_RESET)
    fuzz.wait_idle(dev, "SOFT_RESET")


def run_request(dev, request: DraftRequest, timeout_s: float = 600.0) -> TreeRun:
    """Send one request to a loaded device and read what it answers."""
    size = result_bytes(dev.config.topk_max, MAX_DRAFT)
    dev.dma_write(MemoryMap.RESULT[0], bytes(size))
    dev.dma_write(MemoryMap.REQUEST[0], request.pack())
    dev.write32(Reg.IRQ_STATUS, Irq.DONE)
    dev.write32(Reg.CONTROL, Control.START)
    if not dev.wait_irq(timeout_s):
        raise fuzz.Hang("no completion interrupt")
    try:
        result = DraftResult.unpack(dev.dma_read(MemoryMap.RESULT[0], size), dev.config.topk_max)
    except ValueError:
        result = None
    return TreeRun(request, result, fuzz.read_units(dev),
                   dev.read32(Reg.CYCLES_LO) | dev.read32(Reg.CYCLES_HI) << 32)


def run_script(dev, compiled, requests: list[DraftRequest]) -> list[TreeRun]:
    """Load ``compiled`` into ``dev`` and run ``requests`` one after another."""
    load_draft(dev, compiled)
    return [run_request(dev, request) for request in requests]


def _prompt(rng, vocab: int, n: int) -> list[int]:
    return [int(t) for t in rng.integers(0, vocab, n)]


def random_script(rng, compiled, make_sim, steps: int = 3) -> tuple[list[DraftRequest], list[TreeRun]]:
    """A random script of ``steps`` requests and the functional model's runs of it
    (``make_sim()`` makes the reference device, a :class:`~sim.device.SimDevice`)."""
    dev = make_sim()
    c, tree, shape = dev.config, compiled.tree, compiled.shape
    vocab, slots, width = shape.vocab, shape.layers * shape.kv_heads, tree.width
    load_draft(dev, compiled)
    requests, runs, committed, last = [], [], 0, None
    for _ in range(steps):
        sample = bool(rng.random() < 0.4)
        kw = dict(sample=sample, topk=int(rng.integers(width, c.topk_max + 1)),
                  seed=int(rng.integers(0, 1 << 32)), counter=int(rng.integers(0, 1 << 32)),
                  seq=int(rng.integers(1, 1 << 32)))
        if sample:
            kw["t_mult"], kw["t_shift"] = nx.host_temperature(float(rng.choice([0.6, 1.0, 1.5])))
        levels, n_in = int(rng.integers(1, 5)), int(rng.integers(1, 5))
        fields = dict(kw, tokens=_prompt(rng, vocab, n_in), start_pos=committed, n_draft=levels,
                      tree_width=width, tree_pc=tree.pc, row_pitch=tree.row_pitch)
        u = rng.random()
        if u < 0.08:                         # a tree field the engine refuses
            bad = [dict(topk=max(width - 1, 1), sample=False), dict(row_pitch=0),
                   dict(tree_width=width + 1), dict(n_draft=MAX_DRAFT // width + 1)]
            fields.update(bad[int(rng.integers(0, len(bad)))])
        elif u < 0.14:                       # the tree's levels run past the KV buffer
            fields.update(start_pos=max(c.kv_positions - n_in - int(rng.integers(0, 2 * width + 2)), 0),
                          n_draft=levels + 2)
        elif u < 0.18:                       # a width the program's tree forward does not have
            fields.update(tree_width=width - 1 or 2, n_draft=max(levels, 2))
        else:
            if u < 0.3:                      # a chain request in between
                fields.update(tree_width=0, tree_pc=0, row_pitch=0)
            if last is not None and last.result is not None and last.result.status == ErrorCode.OK \
                    and last.request.tree_width and last.request.n_draft >= 2 and rng.random() < 0.7:
                # accept a path of the last tree: its levels 1 … c in place, then draft on
                nodes, w = last.result.tokens, last.request.tree_width
                node = (int(rng.integers(1, last.request.n_draft)) - 1) * w + int(rng.integers(0, w))
                path = []
                while node != -1:
                    path.append(node)
                    node = nodes[node].parent
                p0 = last.request.start_pos + len(last.request.tokens)
                fields.update(compaction=Compaction(p0, w, tuple(i % w for i in reversed(path)), slots),
                              start_pos=p0 + len(path))
            need = fields["start_pos"] + n_in + (fields["n_draft"] - 1) * max(fields["tree_width"], 1)
            if need > c.kv_positions:        # the context is full: start over
                fields.update(start_pos=0, compaction=None)
        request = DraftRequest(**fields)
        run = run_request(dev, request)
        requests.append(request)
        runs.append(run)
        last = run
        # what the next request may keep: a chain's KV up to end_pos, a tree's committed
        # context (its nodes lie above it, for a compaction to move)
        if run.result is not None and run.result.status == ErrorCode.OK:
            committed = run.result.end_pos if not request.tree_width else \
                request.start_pos + len(request.tokens)
        else:                                # a fault: what came before its start
            committed = min(committed, request.start_pos)
    return requests, runs


def compare_runs(compiled, got: list[TreeRun], want: list[TreeRun]) -> list[str]:
    """How the runs ``got`` differ from the functional ones ``want`` (empty: none)."""
    bad = []
    for i, (g, w) in enumerate(zip(got, want)):
        if (g.result is None) != (w.result is None):
            bad.append(f"request {i}: result {g.result} | {w.result}")
            continue
        if w.result is not None:
            for name in ("seq", "status", "end_pos", "n_forward", "error_pc", "topk", "tokens"):
                if getattr(g.result, name) != getattr(w.result, name):
                    bad.append(f"request {i}: {name} {getattr(g.result, name)} | {getattr(w.result, name)}")
        status = w.result.status if w.result is not None else ErrorCode.BAD_REQUEST
        case = fuzz.FuzzCase(compiled.program, b"", g.request.pack(), g.request.n_draft)
        outcome = lambda run: fuzz.Outcome(status, [], run.cycles, w.result.error_pc if w.result else 0,
                                           run.units)
        what = fuzz.compare(case, outcome(g), outcome(w))
        if what:
            bad.append(f"request {i}: {what}")
        if w.result is not None and w.result.status == ErrorCode.OK and g.result.cycles != w.result.cycles:
            bad.append(f"request {i}: result cycles {g.result.cycles} | {w.result.cycles}")
    if len(got) != len(want):
        bad.append(f"{len(got)} runs | {len(want)}")
    return bad
