#!/usr/bin/env python
"""Fuzz the functional model, and the RTL against it: random programs on random images and
requests through the devices' register interface (sim.fuzz), counting how each run ends.

    .venv/bin/python scripts/fuzz_functional.py --count 20000 --seed 1
    .venv/bin/python scripts/fuzz_functional.py --count 3000 --seed 7 --rtl 800   # + Verilator

For the sim device it prints the programs run, how many completed, the faults by
ErrorCode (and by the opcode they stopped in), the opcodes that ran in completed programs,
the bare exceptions (anything but an engine fault: a bug, each printed once with its case
index) and the hangs (runs past --time-limit). With ``--rtl N`` the first N cases also run
on the rtl+verilator device (``--preset``, ``tiny`` by default) and are compared with the
sim device (sim.fuzz.compare: error code, error PC, tokens and the cycle counters); it
prints the same counts for both devices on those N cases, every disagreement, and the
RTL's hangs (no completion interrupt within twice the model's cycles + 100 000, or within
--rtl-timeout seconds, or a register access that never returns) and bare exceptions.
Exit status 1 if anything was found.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dfvg_hw.spec.config import get_preset                       # noqa: E402
from sim import fuzz                                              # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--count", type=int, default=2000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--time-limit", type=float, default=60.0,
                    help="seconds per sim run before it counts as a hang (a watchdog case on a loaded "
                         "machine takes ~10)")
    ap.add_argument("--rtl", type=int, default=0, metavar="N",
                    help="also compare the first N cases with the rtl+verilator device")
    ap.add_argument("--rtl-timeout", type=float, default=600.0,
                    help="seconds per rtl+verilator run before it counts as a hang (it also "
                         "must interrupt within 2x the model's cycles + 100000)")
    ap.add_argument("--rtl-max-cycles", type=int, default=0, metavar="C",
                    help="skip the rtl+verilator run of cases over C model cycles (0: none)")
    args = ap.parse_args(argv)
    config = get_preset(args.preset)
    rng = np.random.default_rng(args.seed)
    t0 = time.perf_counter()
    sim, keep = fuzz.fuzz_sim(config, rng, args.count, args.time_limit,
                              lambda line: print(line, flush=True), keep=args.rtl)
    print(f"sim: seed {args.seed}, preset {config.name}, {time.perf_counter() - t0:.0f} s")
    print("\n".join("  " + line for line in sim.lines()))
    found = bool(sim.bare) or bool(sim.hangs)
    if keep:
        from sim.verilator_device import VerilatorDevice
        t0 = time.perf_counter()
        runner = fuzz.DeviceRunner(config, VerilatorDevice, args.rtl_timeout)
        try:
            rtl, ref, bad, skipped = fuzz.fuzz_rtl(config, keep, runner, lambda line: print(line, flush=True),
                                                   args.rtl_max_cycles or None)
        finally:
            runner.close()
        print(f"rtl+verilator against sim: the first {len(keep)} cases, {skipped} skipped "
              f"(over {args.rtl_max_cycles} model cycles), {time.perf_counter() - t0:.0f} s, "
              f"disagreements {len(bad)}")
        print("  rtl+verilator:")
        print("\n".join("    " + line for line in rtl.lines()))
        print("  sim (the same cases):")
        print("\n".join("    " + line for line in ref.lines()))
        found |= bool(bad) or bool(rtl.bare) or bool(rtl.hangs)
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
