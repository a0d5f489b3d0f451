#!/usr/bin/env python
"""Fault campaign: speculative decoding through a fault-injecting transport, every output
checked token for token against target-only greedy decoding.

    .venv/bin/python scripts/fault_campaign.py --pair tiny --runs 400 --seed 1
    .venv/bin/python scripts/fault_campaign.py --pair demo --runs 100 --seed 2

Each run builds a sim device behind a ``FaultInjectingTransport`` (dfvg_host.fault_injection)
that hits every register access, DMA, interrupt wait and request start at random with
probability ``--rate``, by any fault kind (drop, lose, corrupt, delay, error), seeded per
run; then it generates ``--per-device`` prompts in a row on that device (so a device given
up in one generation is reset at the start of the next) and compares each output with the
target's own greedy ``generate``. The pair is ``tiny`` (a random tiny Llama drafting for
itself on the ``tiny`` preset, random prompts) or ``demo`` (the shipped pair on
``alveo-u55c``, prompts from the held-out text). It prints the generations checked, the
faults injected by kind, the device faults the decoder met by kind, the resets, transport
retries and fallbacks, and how many outputs equalled target-only decoding. Exit status 1
if any did not.
"""

from __future__ import annotations

import argparse
import logging
import random
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch                                                          # noqa: E402

from dfvg_hw.spec.config import get_preset                            # noqa: E402
from dfvg_host.compiler import compile_draft, load_model              # noqa: E402
from dfvg_host.driver import DraftDevice                              # noqa: E402
from dfvg_host.fault_injection import FaultInjectingTransport, FaultKind  # noqa: E402
from dfvg_host.speculative import SpeculativeDecoder                  # noqa: E402
from dfvg_host.verifier import Verifier                               # noqa: E402
from sim.device import SimDevice                                      # noqa: E402


def tiny_pair(workdir: Path, count: int, seed: int):
    from dfvg_host.fixtures import make_tiny_llama
    model_dir = make_tiny_llama(workdir / "tiny")
    engine = get_preset("tiny")
    rng = random.Random(seed)
    prompts = [[rng.randrange(3, 256) for _ in range(rng.randint(2, 10))] for _ in range(count)]
    return engine, compile_draft(model_dir, engine), load_model(model_dir), prompts, 1


def demo_pair(count: int):
    from transformers import AutoTokenizer

    from dfvg_host.demo import DEMO_DATA, compile_cached, demo_paths
    draft_dir, target_dir = demo_paths()
    engine = get_preset("alveo-u55c")
    compiled = compile_cached(draft_dir, engine, DEMO_DATA / "calibration.txt", log=lambda *a: None)
    tok = AutoTokenizer.from_pretrained(target_dir)
    ids = tok((DEMO_DATA / "heldout.txt").read_text())["input_ids"]
    stride = max(24, (len(ids) - 24) // count)
    prompts = [ids[i * stride: i * stride + 24] for i in range(count)]
    return engine, compiled, load_model(target_dir), prompts, tok.eos_token_id


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pair", choices=("tiny", "demo"), default="tiny")
    ap.add_argument("--runs", type=int, default=200, help="devices, each with --per-device generations")
    ap.add_argument("--per-device", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--rate", type=float, default=0.03, help="probability that an operation is hit")
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--gamma", type=int, default=4)
    ap.add_argument("--max-recoveries", type=int, default=2)
    ap.add_argument("--timeout", type=float, default=0.1, help="the driver's request timeout, s")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    logging.disable(logging.WARNING)      # the fallback warnings; they are counted below

    t0 = time.perf_counter()
    n_prompts = args.runs * args.per_device
    with tempfile.TemporaryDirectory() as tmp:
        if args.pair == "tiny":
            engine, compiled, target, prompts, eos = tiny_pair(Path(tmp), n_prompts, args.seed)
        else:
            engine, compiled, target, prompts, eos = demo_pair(n_prompts)
    verifier = Verifier(target, torch.device("cpu"))

    def reference(prompt):
        with torch.no_grad():
            return target.generate(torch.tensor([prompt]), max_new_tokens=args.new_tokens,
                                   do_sample=False, eos_token_id=eos,
                                   pad_token_id=eos)[0, len(prompt):].tolist()

    injected, planned, met, stops = Counter(), 0, Counter(), Counter()
    checked = equal = resets = retries = degraded = fallback_tokens = tokens = 0
    mismatches = []
    for run in range(args.runs):
        inj = FaultInjectingTransport(SimDevice(engine), armed=False)
        device = DraftDevice(inj, compiled, timeout_s=args.timeout, retry_backoff_s=0.0)
        inj.arm(rate=args.rate, seed=args.seed * 1_000_003 + run, kinds=tuple(FaultKind))
        decoder = SpeculativeDecoder(device, verifier, gamma=args.gamma, eos_token_id=eos,
                                     max_recoveries=args.max_recoveries)
        for k in range(args.per_device):
            prompt = prompts[run * args.per_device + k]
            out = decoder.generate(prompt, args.new_tokens)
            checked += 1
            if out.tokens == reference(prompt):
                equal += 1
            else:
                mismatches.append((run, k, out.faults))
            m = out.metrics
            met.update(m.device_faults_by_kind)
            resets += m.device_resets
            retries += m.transport_retries
            degraded += out.degraded
            fallback_tokens += m.fallback_tokens
            tokens += len(out.tokens)
            stops[out.stop_reason] += 1
        injected.update(inj.by_kind())
        planned += sum(f.planned for f in inj.injected)

    def counts(c: Counter) -> str:
        return ", ".join(f"{k} {v}" for k, v in sorted(c.items())) or "none"

    print(f"pair             {args.pair} on {engine.name}, gamma {args.gamma}, greedy, "
          f"{args.new_tokens} new tokens, seed {args.seed}, rate {args.rate:g} per operation")
    print(f"runs             {args.runs} devices x {args.per_device} generations = {checked} "
          f"generations, {tokens} tokens")
    print(f"faults injected  {sum(injected.values())}: {counts(injected)}")
    print(f"device faults    {sum(met.values())} met by the decoder: {counts(met)}")
    print(f"recovery         {resets} resets, {retries} transport retries")
    print(f"fallbacks        {degraded} generations degraded to the target alone "
          f"({fallback_tokens} of {tokens} tokens from the target alone)")
    print(f"stop reasons     {counts(stops)}")
    print(f"equal            {equal} of {checked} outputs equal target-only greedy decoding")
    print(f"time             {time.perf_counter() - t0:.1f} s")
    for run, k, faults in mismatches[:10]:
        print(f"MISMATCH run {run} generation {k}: faults {faults}")
    return 0 if equal == checked else 1


if __name__ == "__main__":
    sys.exit(main())
