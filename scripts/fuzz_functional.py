#!/usr/bin/env python
"""Fuzz the functional model: random programs on random images and requests through the
sim device's register interface (sim.fuzz), counting how each run ends.

    .venv/bin/python scripts/fuzz_functional.py --count 20000 --seed 1
    .venv/bin/python scripts/fuzz_functional.py --count 200 --rtl 50     # + 50 on Verilator

Prints the programs run, how many completed, the faults by ErrorCode, the bare exceptions
(anything but an engine fault: a bug, each printed once with its case index) and the
hangs (runs past --time-limit). With ``--rtl N`` the first N cases also run on the
rtl+verilator device and are compared with the sim device: error code, error PC, tokens,
and the cycle counters (all of them on a run that completes, the units counted on a
fault). Exit status 1 if anything was found.
"""

from __future__ import annotations

import argparse
import collections
import sys
import time
import traceback
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dfvg_hw.spec.config import get_preset                       # noqa: E402
from dfvg_hw.spec.regmap import OP_CYCLE_BUCKETS, Control, Reg, op_cycles_offset  # noqa: E402
from sim import fuzz                                              # noqa: E402
from sim.device import SimDevice                                  # noqa: E402


def counters(dev) -> dict:
    return {b: dev.read32(op_cycles_offset(b)) for b in OP_CYCLE_BUCKETS}


def compare_rtl(config, cases, log) -> int:
    """Run ``cases`` on one Verilator device (scrubbed and soft-reset between cases) and on
    a fresh sim device each; returns the number of mismatches."""
    from sim.verilator_device import VerilatorDevice
    rtl = VerilatorDevice(config)
    scrub = [(fuzz.IMAGE_ADDR, 64 * 256), (fuzz.PROGRAM_ADDR, 16 * 64), (fuzz.REQUEST_ADDR, 4096),
             (fuzz.RESULT_ADDR, 4096)]
    bad = 0
    try:
        for i, case in cases:
            outs = []
            for dev in (rtl, SimDevice(config)):
                dev.write32(Reg.CONTROL, Control.SOFT_RESET)
                for addr, n in scrub:
                    dev.dma_write(addr, bytes(n))
                fuzz.load_case(dev, case)
                out = fuzz.start_case(dev, case, timeout_s=120)
                outs.append((out, counters(dev)))
            (r, r_units), (s, s_units) = outs
            same = (r.error, r.error_pc, r.tokens) == (s.error, s.error_pc, s.tokens)
            if same and not s.error:
                same = r.cycles == s.cycles and r_units == s_units
            elif same:
                same = {b for b, n in r_units.items() if n} == {b for b, n in s_units.items() if n}
            if not same:
                bad += 1
                log(f"case {i}: rtl {r.error.name} pc {r.error_pc} {r.tokens} {r.cycles} | "
                    f"sim {s.error.name} pc {s.error_pc} {s.tokens} {s.cycles}")
    finally:
        rtl.close()
    return bad


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--count", type=int, default=2000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--time-limit", type=float, default=10.0, help="seconds per run")
    ap.add_argument("--rtl", type=int, default=0, metavar="N",
                    help="also compare the first N cases with the rtl+verilator device")
    args = ap.parse_args(argv)
    config = get_preset(args.preset)
    rng = np.random.default_rng(args.seed)
    ends, bare, hangs, keep = collections.Counter(), collections.Counter(), 0, []
    t0 = time.perf_counter()
    for i in range(args.count):
        case = fuzz.random_case(rng, config)
        if i < args.rtl:
            keep.append((i, case))
        try:
            ends[fuzz.run_case(config, case, args.time_limit).error.name] += 1
        except fuzz.Hang:
            hangs += 1
            print(f"case {i}: hang", flush=True)
        except Exception as exc:                     # noqa: BLE001 - what we are looking for
            where = traceback.extract_tb(exc.__traceback__)[-1]
            key = f"{type(exc).__name__}: {exc} at {Path(where.filename).name}:{where.lineno}"
            if key not in bare:
                print(f"case {i}: {key}", flush=True)
            bare[key] += 1
    elapsed = time.perf_counter() - t0
    print(f"programs {args.count} (seed {args.seed}, preset {config.name}, {elapsed:.0f} s)")
    print(f"completed {ends.pop('OK', 0)}")
    print("faults " + ", ".join(f"{k} {v}" for k, v in ends.most_common()))
    print(f"bare exceptions {sum(bare.values())}" + "".join(f"\n  {v} × {k}" for k, v in bare.items()))
    print(f"hangs {hangs}")
    found = bool(bare) or bool(hangs)
    if keep:
        mismatches = compare_rtl(config, keep, print)
        print(f"rtl+verilator: {len(keep)} compared, {mismatches} mismatches")
        found |= bool(mismatches)
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
