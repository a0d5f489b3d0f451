"""γ sweep of chain speculative decoding on the demo pair, against target-only decoding.

Measured in one run on this host: target-only greedy decoding (transformers
``generate``) and the verifier's forward passes. Modelled: the draft engine's time
(cycle model at the preset clock) and PCIe (link model). The projection adds them
sequentially (no pipelining).

    python benchmarks/gamma_sweep.py [--prompts 8] [--new 128] [--preset alveo-u55c]
"""

from __future__ import annotations

import argparse
import json
import time

import torch
from transformers import AutoTokenizer

from dfvg_hw.config import get_preset
from dfvg_host.compiler import compile_draft, load_model
from dfvg_host.demo import DEMO_DATA, demo_paths
from dfvg_host.driver import DraftDevice
from dfvg_host.speculative import SpeculativeDecoder
from dfvg_host.verifier import Verifier


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--preset", default="alveo-u55c")
    ap.add_argument("--gammas", default="2,4,6,8")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()

    draft_dir, target_dir = demo_paths()
    tok = AutoTokenizer.from_pretrained(target_dir)
    ids = tok((DEMO_DATA / "heldout.txt").read_text())["input_ids"]
    prompts = [ids[i * 400: i * 400 + 32] for i in range(args.prompts)]
    engine = get_preset(args.preset)
    compiled = compile_draft(draft_dir, engine, calibration_text=(DEMO_DATA / "calibration.txt").read_text())
    target = load_model(target_dir)

    # Baseline, measured: target-only greedy decoding.
    t0 = time.perf_counter()
    base_tokens = 0
    with torch.no_grad():
        for p in prompts:
            out = target.generate(torch.tensor([p]), max_new_tokens=args.new, min_new_tokens=args.new,
                                  do_sample=False)
            base_tokens += out.shape[1] - len(p)
    base_s = time.perf_counter() - t0
    base_tps = base_tokens / base_s

    rows = []
    for gamma in [int(g) for g in args.gammas.split(",")]:
        device = DraftDevice.open(f"sim://{args.preset}", compiled)
        decoder = SpeculativeDecoder(device, Verifier(target, torch.device("cpu")), gamma=gamma)
        totals = dict(tokens=0, drafted=0, accepted=0, rounds=0, verifier=0.0, host=0.0, device=0.0, pcie=0.0)
        for p in prompts:
            m = decoder.generate(p, args.new).metrics
            totals["tokens"] += m.emitted_tokens
            totals["drafted"] += m.drafted_tokens
            totals["accepted"] += m.accepted_tokens
            totals["rounds"] += m.rounds
            totals["verifier"] += m.verifier_seconds
            totals["host"] += m.host_seconds
            totals["device"] += m.device_seconds
            totals["pcie"] += m.pcie_seconds
        projected = totals["verifier"] + totals["host"] + totals["device"] + totals["pcie"]
        tps = totals["tokens"] / projected
        rows.append(dict(gamma=gamma, acceptance=totals["accepted"] / totals["drafted"],
                         mean_accepted_length=(totals["accepted"] + totals["rounds"]) / totals["rounds"],
                         verifier_s=totals["verifier"], host_s=totals["host"],
                         device_s_modelled=totals["device"], pcie_s_modelled=totals["pcie"],
                         projected_tokens_per_s=tps, speedup=tps / base_tps))
    if args.json:
        print(json.dumps(dict(baseline_tokens_per_s=base_tps, rows=rows), indent=2))
        return
    print(f"target-only greedy (transformers generate, cpu fp32): {base_tps:.1f} tokens/s [measured]")
    print(f"{len(prompts)} held-out prompts x {args.new} new tokens, draft on sim://{args.preset}\n")
    print(f"{'gamma':>5} {'accept':>7} {'len/round':>9} {'verifier s':>10} {'host s':>7} "
          f"{'engine s':>9} {'PCIe s':>7} {'tok/s':>7} {'speedup':>7}")
    print(f"{'':>5} {'':>7} {'':>9} {'measured':>10} {'meas.':>7} {'modelled':>9} {'model.':>7} "
          f"{'proj.':>7} {'proj.':>7}")
    for r in rows:
        print(f"{r['gamma']:>5} {r['acceptance']:>7.3f} {r['mean_accepted_length']:>9.2f} "
              f"{r['verifier_s']:>10.3f} {r['host_s']:>7.3f} {r['device_s_modelled']:>9.4f} "
              f"{r['pcie_s_modelled']:>7.4f} {r['projected_tokens_per_s']:>7.1f} {r['speedup']:>6.2f}x")


if __name__ == "__main__":
    main()
