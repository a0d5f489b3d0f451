#!/usr/bin/env python3
"""The engine's token trees on the demo pair: greedy exactness, and tokens per target
forward against the chain at as many tokens verified per forward.

Held-out prompts (``models/demo-data/heldout.txt``, as ``tests/test_speculative.py`` cuts
them) decoded greedily on ``sim://alveo-u55c`` by :class:`~dfvg_host.tree_drafting.TreeDecoder`
(trees of depth D, 4 wide: the preset's rows, so 4·D nodes per forward) and by the chain
decoder at γ = 4·D (as many draft tokens verified per forward) and at γ = D (as deep);
every output is checked token for token against the target's own greedy ``generate``.
``--budgets N@D`` adds budgeted trees: depth D, the N most likely nodes verified
(:class:`~dfvg_host.tree_drafting.TreeDecoder`'s ``budget``), beside the chain at γ = N;
``--pipelined`` runs every method pipelined too (:class:`~dfvg_host.pipelined.
PipelinedDecoder`, :class:`~dfvg_host.pipelined_tree.PipelinedTreeDecoder`).
Prints per method: the prompts that matched, tokens committed per target forward, draft
tokens verified per forward, the modelled engine cycles per drafting request (cycle
model, exact against the RTL), the measured target time per verifying forward, the
pipeline's hit rate, and the projected tokens/s (measured target + host, modelled engine
+ PCIe; pipelined, the modelled overlap counted once). ``--temperature T`` samples
instead (lossless, so no exactness check; the figures are then acceptance under sampling).

    .venv/bin/python benchmarks/engine_tree.py --prompts 8 --new-tokens 64 --depths 1,2,4
    .venv/bin/python benchmarks/engine_tree.py --depths "" --budgets 16@8 --pipelined
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from dfvg_hw.spec.config import get_preset  # noqa: E402
from dfvg_host.acceptance import SamplingParams  # noqa: E402
from dfvg_host.compiler import load_model  # noqa: E402
from dfvg_host.demo import DEMO_DATA, compile_cached, demo_paths  # noqa: E402
from dfvg_host.driver import DraftDevice  # noqa: E402
from dfvg_host.pipelined import PipelinedDecoder  # noqa: E402
from dfvg_host.pipelined_tree import PipelinedTreeDecoder  # noqa: E402
from dfvg_host.speculative import SpeculativeDecoder  # noqa: E402
from dfvg_host.tree_drafting import TreeDecoder  # noqa: E402
from dfvg_host.verifier import Verifier  # noqa: E402

URL = "sim://alveo-u55c"


def main(argv=None) -> int:
    from transformers import AutoTokenizer

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--depths", default="1,2,4", help="tree depths (comma-separated)")
    p.add_argument("--budgets", default="",
                   help="also trees of depth DEPTH verifying their N most probable nodes, as "
                        "N@DEPTH (comma-separated, e.g. 8@8,16@16); the chain runs at γ = N beside them")
    p.add_argument("--pipelined", action="store_true",
                   help="also run every method pipelined (the engine drafts the next round while the "
                        "target verifies; overlap modelled)")
    p.add_argument("--draft", default=None, help="draft directory (default: the demo draft)")
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy, checked for exactness")
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    draft_dir, target_dir = demo_paths()
    draft_dir = Path(args.draft) if args.draft else draft_dir
    compiled = compile_cached(draft_dir, get_preset("alveo-u55c"), DEMO_DATA / "calibration.txt",
                              log=lambda *_: None)
    tok = AutoTokenizer.from_pretrained(target_dir)
    target = load_model(target_dir)
    verifier = Verifier(target, torch.device("cpu"))
    text_ids = tok((DEMO_DATA / "heldout.txt").read_text())["input_ids"]
    prompts = [text_ids[i * 300: i * 300 + 24] for i in range(args.prompts)]
    sampling = SamplingParams(temperature=args.temperature, seed=1)
    greedy = sampling.greedy
    refs = []
    if greedy:
        with torch.no_grad():
            refs = [target.generate(torch.tensor([q]), max_new_tokens=args.new_tokens, do_sample=False,
                                    attention_mask=torch.ones(1, len(q), dtype=torch.long))[0, len(q):].tolist()
                    for q in prompts]
    device = DraftDevice.open(URL, compiled)
    width = device.tree_width
    methods: dict[str, object] = {}
    options = dict(sampling=sampling, eos_token_id=tok.eos_token_id)

    def add(name, cls, **kwargs):
        methods.setdefault(name, cls(device, verifier, **kwargs, **options))
        if args.pipelined:
            piped = PipelinedTreeDecoder if cls is TreeDecoder else PipelinedDecoder
            methods.setdefault(f"{name}, pipelined", piped(device, verifier, **kwargs, **options))

    for spec in filter(None, args.budgets.split(",")):
        budget, d = (int(x) for x in spec.split("@"))
        add(f"tree {budget} of {d * width} (d{d})", TreeDecoder, depth=d, budget=budget)
        add(f"chain γ={budget}", SpeculativeDecoder, gamma=budget)
    for d in filter(None, args.depths.split(",")):
        d = int(d)
        add(f"tree depth {d} ({d * width} nodes)", TreeDecoder, depth=d)
        for g in (d * width, d):
            add(f"chain γ={g}", SpeculativeDecoder, gamma=g)
    print(f"{len(prompts)} held-out prompts x {args.new_tokens} new tokens, "
          f"{'greedy' if greedy else f'T={args.temperature}'}, {draft_dir.name} on {URL} (trees "
          f"{width} wide), target {target_dir.name} on cpu, {args.threads} thread(s)\n")
    print(f"{'method':<36}{'exact':>8}{'tok/fwd':>9}{'verified':>10}{'cycles/req':>12}{'ms/verify':>11}"
          f"{'hits':>6}{'tok/s proj.':>13}")
    failed = 0
    for name, decoder in methods.items():
        exact = tokens = rounds = accepted = verified = requests = cycles = hits = misses = 0
        seconds = verify_s = 0.0
        t0 = time.perf_counter()
        for i, q in enumerate(prompts):
            out = decoder.generate(q, args.new_tokens)
            m = out.metrics
            exact += greedy and out.tokens == refs[i]
            tokens, rounds, accepted = tokens + m.emitted_tokens, rounds + m.rounds, accepted + m.accepted_tokens
            drafting = sum(1 for g in m.gamma_per_round if g > 0)
            requests += drafting
            verified += m.tree_nodes or m.drafted_tokens
            cycles += m.device_cycles
            hits, misses = hits + m.pipeline_hits, misses + m.pipeline_misses
            seconds += m.projected_seconds
            verify_s += m.verifier_seconds
        failed += greedy and exact != len(prompts)
        print(f"{name:<36}{f'{exact}/{len(prompts)}' if greedy else '-':>8}{(accepted + rounds) / rounds:>9.2f}"
              f"{verified / requests:>10.2f}{cycles / requests:>12,.0f}{1e3 * verify_s / rounds:>11.2f}"
              f"{f'{hits / (hits + misses):.2f}' if hits + misses else '-':>6}{tokens / seconds:>13.1f}   [{time.perf_counter() - t0:.0f} s wall]", flush=True)
    print("\ntok/fwd: tokens committed per verifying target forward (accepted + 1); verified: draft "
          "tokens per forward that verified drafts (tree nodes, chain γ); cycles/req: modelled engine "
          "cycles per drafting round (incl. its feed); ms/verify: measured target time per verifying "
          "forward; hits: continuations used / submitted (pipelined); tok/s: projected (measured target + "
          "host, modelled engine + PCIe; pipelined: overlap modelled, counted once)."
          + (" exact: outputs equal to the target's greedy generate()." if greedy else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
