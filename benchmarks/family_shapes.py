#!/usr/bin/env python3
"""Modelled draft speed of each supported family's common draft shape on a board preset.

Each shape (``dfvg_host.efficiency.FAMILY_SHAPES``, from the published configs of
OPT-125M, Qwen2.5-0.5B and Qwen3-0.6B, and the paper's LLaMA-160M) is compiled by the real compiler
with random weights, exactly as ``dfvg compile --random-weights`` does, and costed by the
cycle model. Every figure is modelled. A shape the preset cannot hold prints the
compiler's one-line reason; ``--what-if KEY=VALUE,...`` then sizes it on the preset with
those parameters changed (for example the head width and KV slots Qwen3-0.6B needs), a
configuration no bitstream has been built for.

    .venv/bin/python benchmarks/family_shapes.py --contexts 256,1024
    .venv/bin/python benchmarks/family_shapes.py --what-if head_dim=128,kv_slots=224,kv_positions=256
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from dfvg_hw.spec.config import get_preset  # noqa: E402
from dfvg_host.compiler import DoesNotFit  # noqa: E402
from dfvg_host.efficiency import FAMILY_SHAPES, PAPER_SHAPES, engine_efficiency  # noqa: E402


def _changes(text: str) -> dict:
    return {key: int(value) for key, value in (item.split("=") for item in text.split(",") if item)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="alveo-u55c")
    p.add_argument("--contexts", default="256,1024")
    p.add_argument("--what-if", default="", help="KEY=VALUE,... preset changes for shapes that do not fit")
    args = p.parse_args(argv)
    engine = get_preset(args.preset)
    what_if = engine.with_changes(**_changes(args.what_if)) if args.what_if else None
    print(f"{'shape':22s} {'preset':24s} {'ctx':>5s} {'tok/s':>7s} {'roofline':>8s} {'eff.':>6s}  "
          f"bytes/token  cycles by opcode [all modelled: cycle model at {engine.clock_mhz:g} MHz]")
    for shape in (PAPER_SHAPES[1], *FAMILY_SHAPES):
        for context in (int(c) for c in args.contexts.split(",")):
            for cfg, label in ((engine, engine.name), (what_if, f"{engine.name} what-if")):
                if cfg is None:
                    continue
                if context > cfg.kv_positions:
                    print(f"{shape.name:22s} {label:24s} {context:5d} past its kv_positions = {cfg.kv_positions}")
                    continue
                try:
                    (row,) = engine_efficiency([cfg], (shape,), context=context, log=print)
                except DoesNotFit as exc:
                    if cfg is engine:
                        print(f"{shape.name:22s} {label:24s} {context:5d} does not fit: {exc}")
                    continue
                r = row.report
                ops = ", ".join(f"{op} {c:,}" for op, c in sorted(r.cycles_by_op.items(), key=lambda kv: -kv[1])[:5])
                print(f"{shape.name:22s} {label:24s} {context:5d} {r.tokens_per_s:7.0f} "
                      f"{r.roofline_achievable_tokens_per_s:8.0f} {100 * r.efficiency:5.1f}%  "
                      f"{r.bytes_per_token:11,d}  {ops}")
                if cfg is engine:
                    break       # fits as it is: no what-if needed
    if what_if is not None:
        print(f"what-if: {args.preset} with {args.what_if} (sizing only: no bitstream built)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
