"""Cycle model against the RTL, unit by unit, on a compiled tiny Llama draft.

    python benchmarks/cycle_model_vs_rtl.py [PRESET] [--change FIELD=VALUE ...]
    python benchmarks/cycle_model_vs_rtl.py [PRESET] --tree N [--seed S]

Compiles a small random Llama (``dfvg_host.fixtures.make_tiny_llama``, as the tests do) for
PRESET (default ``tiny``), runs the same driver calls on ``sim://`` (cycle model: modelled)
and on the Verilator engine (measured in simulation), and prints every ``OP_CYCLES``
counter of both and the result's cycles. The co-simulation tests assert that they are equal.
``--change`` derives a configuration from PRESET (``EngineConfig.with_changes``), e.g.
``tiny-hbm --change mem_port_bits=256 --change lanes=16`` (the narrow path's pieces two
VMEM lines each) or ``tiny-hbm --change mem_achievable_gbps=1.2`` (a memory slower than
the narrow path).

With ``--tree N``: N random tree-drafting sessions of three requests each
(:mod:`sim.tree_cases`: greedy and sampled trees, compaction of an accepted path, chain
requests between, faults) on both; every result bit for bit and every counter must agree
(``tests/test_rtl_tree.py`` runs a sample of them in CI). Prints what the sessions covered
and each disagreement; exits 1 if there is one.
"""

from __future__ import annotations

import argparse
import collections
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dfvg_hw.spec.config import get_preset  # noqa: E402
from dfvg_hw.spec.regmap import OP_CYCLE_BUCKETS, op_cycles_offset  # noqa: E402
from dfvg_host.compiler import compile_draft  # noqa: E402
from dfvg_host.driver import DraftDevice  # noqa: E402
from dfvg_host.fixtures import make_tiny_llama  # noqa: E402
from sim.device import SimDevice  # noqa: E402
from sim.verilator_device import VerilatorDevice  # noqa: E402

CALLS = [("6 input tokens, 8 greedy drafts", [5, 17, 99, 3, 42, 7], 8, {}),
         ("2 input tokens, 8 sampled drafts", [11, 12], 8,
          dict(sample=True, temperature=0.7, topk=3, seed=11, counter=5))]


def counters(device, compiled) -> list[dict]:
    driver = DraftDevice(device, compiled, timeout_s=600)
    runs = []
    for _, tokens, n, kwargs in CALLS:
        out = driver.draft(tokens, n, **kwargs)
        units = {b: device.read32(op_cycles_offset(b)) for b in OP_CYCLE_BUCKETS}
        runs.append(dict(units, result=out.cycles))
    device.close()
    return runs


def trees(config, compiled, sessions: int, seed: int) -> int:
    """``sessions`` random tree sessions on sim:// and the Verilator engine; 1 on any
    disagreement."""
    import numpy as np
    from dfvg_hw.spec.descriptors import ErrorCode
    from sim import tree_cases
    rng = np.random.default_rng(seed)
    device = VerilatorDevice(config, tree_width=config.rows, log=print)
    seen, bad, start = collections.Counter(), 0, time.monotonic()
    for i in range(sessions):
        requests, want = tree_cases.random_script(rng, compiled, lambda: SimDevice(config))
        tree_cases.soft_reset(device)
        got = tree_cases.run_script(device, compiled, requests)
        for what in tree_cases.compare_runs(compiled, got, want):
            bad += 1
            print(f"session {i}: {what}")
        for request, run in zip(requests, want):
            seen["requests"] += 1
            seen["tree requests"] += bool(request.tree_width)
            seen[run.result.status.name] += 1
            kind = ("sampled tree" if request.sample else "greedy tree") if request.tree_width else "chain"
            if run.result.status == ErrorCode.OK:
                seen[kind] += 1
                seen["compacted"] += request.compaction is not None
                seen["tree nodes"] += len(run.result.tokens) if request.tree_width else 0
                seen["cycles"] += run.cycles
    device.close()
    print(f"{sessions} sessions in {time.monotonic() - start:.0f} s: "
          + ", ".join(f"{k} {v:,}" for k, v in seen.items()))
    print(f"disagreements: {bad}")
    return 1 if bad else 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("preset", nargs="?", default="tiny")
    parser.add_argument("--tree", type=int, metavar="N", help="N random tree sessions instead")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--change", action="append", default=[], metavar="FIELD=VALUE",
                        help="derive the configuration: an EngineConfig field and its value")
    args = parser.parse_args()
    config = get_preset(args.preset)
    if args.change:
        changes = {}
        for item in args.change:
            field, _, value = item.partition("=")
            kind = type(getattr(config, field))
            changes[field] = kind(value)
        config = config.with_changes(name=f"{config.name}-derived", **changes)
    compiled = compile_draft(make_tiny_llama(Path(tempfile.mkdtemp())), config)
    if args.tree:
        return trees(config, compiled, args.tree, args.seed)
    model = counters(SimDevice(config), compiled)
    rtl = counters(VerilatorDevice(config, log=print), compiled)
    for (what, *_), m, r in zip(CALLS, model, rtl):
        print(f"{what}: cycle model [modelled] vs RTL [measured in Verilator]")
        for bucket in list(OP_CYCLE_BUCKETS) + ["result"]:
            if m[bucket] or r[bucket]:
                print(f"  {bucket:10s} {m[bucket]:>8,} {r[bucket]:>8,}  {'equal' if m[bucket] == r[bucket] else 'DIFFERENT'}")
        print(f"  {'all units':10s} {sum(m[b] for b in OP_CYCLE_BUCKETS):>8,} "
              f"{sum(r[b] for b in OP_CYCLE_BUCKETS):>8,}")
    return 0 if model == rtl else 1


if __name__ == "__main__":
    sys.exit(main())
