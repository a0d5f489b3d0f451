"""Cycle model against the RTL, unit by unit, on a compiled tiny Llama draft.

    python benchmarks/cycle_model_vs_rtl.py [PRESET]

Compiles a small random Llama (``dfvg_host.fixtures.make_tiny_llama``, as the tests do) for
PRESET (default ``tiny``), runs the same driver calls on ``sim://`` (cycle model: modelled)
and on the Verilator engine (measured in simulation), and prints every ``OP_CYCLES``
counter of both and the result's cycles. The co-simulation tests assert that they are equal.
"""

from __future__ import annotations

import sys
import tempfile
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


def main() -> int:
    config = get_preset(sys.argv[1] if len(sys.argv) > 1 else "tiny")
    compiled = compile_draft(make_tiny_llama(Path(tempfile.mkdtemp())), config)
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
