#!/usr/bin/env python3
"""Several drafters on the demo target: greedy exactness and acceptance, per merge rule.

Held-out prompts (``models/demo-data/heldout.txt``, the prompts of
``tests/test_speculative.py``) decoded greedily by ``MultiDraftDecoder`` with the demo
draft and ``demo-draft-small`` on two ``sim://alveo-u55c`` devices, under ``vote``,
``select`` and ``tree``, each output checked token for token against the target's own
greedy ``generate``; and each drafter alone (``SpeculativeDecoder``) for comparison.
Prints, per method, the prompts that matched, the mean accepted length per target
forward, and each drafter's matched share and final weight. It asserts correctness only;
the times it prints are the decoders' own (measured target and host, modelled engine and
PCIe).

    .venv/bin/python benchmarks/multi_draft_exactness.py --prompts 50 --new-tokens 128
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
from dfvg_host.compiler import load_model  # noqa: E402
from dfvg_host.demo import DEMO_DATA, compile_cached  # noqa: E402
from dfvg_host.driver import DraftDevice  # noqa: E402
from dfvg_host.multi_draft import MERGE_RULES, MultiDraftDecoder  # noqa: E402
from dfvg_host.speculative import SpeculativeDecoder  # noqa: E402
from dfvg_host.verifier import Verifier  # noqa: E402

DRAFTS = [REPO / "models" / "demo-draft", REPO / "models" / "demo-draft-small"]
TARGET = REPO / "models" / "demo-target"


def heldout_prompts(tokenizer, count: int, length: int = 24, stride: int = 300) -> list[list[int]]:
    ids = tokenizer((DEMO_DATA / "heldout.txt").read_text())["input_ids"]
    if len(ids) < count * stride:
        raise SystemExit(f"heldout.txt gives {len(ids) // stride} prompts, not {count}")
    return [ids[i * stride: i * stride + length] for i in range(count)]


def main(argv=None) -> int:
    from transformers import AutoTokenizer

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--prompts", type=int, default=50)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--gamma", type=int, default=4)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    engine = get_preset("alveo-u55c")
    compiled = [compile_cached(d, engine, DEMO_DATA / "calibration.txt", log=lambda *_: None) for d in DRAFTS]
    tok = AutoTokenizer.from_pretrained(TARGET)
    target = load_model(TARGET)
    verifier = Verifier(target, torch.device("cpu"))
    prompts = heldout_prompts(tok, args.prompts)
    with torch.no_grad():
        refs = [target.generate(torch.tensor([q]), max_new_tokens=args.new_tokens, do_sample=False,
                                attention_mask=torch.ones(1, len(q), dtype=torch.long))[0, len(q):].tolist()
                for q in prompts]
    names = [d.name for d in DRAFTS]
    methods = {f"alone[{n}]": SpeculativeDecoder(DraftDevice.open("sim://alveo-u55c", c), verifier,
                                                  gamma=args.gamma, eos_token_id=tok.eos_token_id)
               for n, c in zip(names, compiled)}
    for merge in MERGE_RULES:
        devices = [DraftDevice.open("sim://alveo-u55c", c) for c in compiled]
        methods[merge] = MultiDraftDecoder(devices, verifier, merge=merge, gamma=args.gamma, names=names,
                                           eos_token_id=tok.eos_token_id)
    print(f"{len(prompts)} held-out prompts x {args.new_tokens} new tokens, greedy, gamma {args.gamma}, "
          f"drafters {', '.join(names)} on sim://alveo-u55c; target {TARGET.name} on cpu\n")
    print(f"{'method':<26}{'exact':>8}{'len':>7}{'accept':>8}{'tok/s proj.':>13}  drafters: matched share, "
          "final weight")
    failed = 0
    for name, decoder in methods.items():
        exact = tokens = rounds = accepted = drafted = 0
        seconds = 0.0
        shares: dict[str, list[int]] = {}
        weights: dict[str, float] = {}
        t0 = time.perf_counter()
        for q, ref in zip(prompts, refs):
            out = decoder.generate(q, args.new_tokens)
            exact += out.tokens == ref
            m = out.metrics
            tokens, rounds = tokens + m.emitted_tokens, rounds + m.rounds
            accepted, drafted = accepted + m.accepted_tokens, drafted + m.drafted_tokens
            seconds += m.projected_seconds
            for d in getattr(out, "drafters", []):
                acc = shares.setdefault(d.name, [0, 0])
                acc[0] += d.matched
                acc[1] += d.judged
                weights[d.name] = d.weights[-1] if d.weights else 1.0
        failed += exact != len(prompts)
        who = "  ".join(f"{n} {m / j if j else 0:.3f} w{weights[n]:.2f}" for n, (m, j) in shares.items())
        print(f"{name:<26}{exact:>5}/{len(prompts):<2}{(accepted + rounds) / rounds:>7.2f}"
              f"{accepted / drafted if drafted else 0:>8.3f}{tokens / seconds:>13.1f}  {who}"
              f"   [{time.perf_counter() - t0:.0f} s wall]", flush=True)
    print("\nlen: tokens committed per target forward; tok/s: projected (measured target+host, "
          "modelled engine+PCIe; several drafters: the slowest per round). exact: outputs equal "
          "to the target's greedy generate().")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
