"""The ``dfvg`` command line."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

__all__ = ["main"]


class CliError(Exception):
    """A user error: printed as one line, exit code 2."""


def _preset(name: str):
    from dfvg_hw.config import ConfigError, get_preset
    try:
        return get_preset(name)
    except ConfigError as exc:
        raise CliError(str(exc)) from None


def _read_calibration(path: str | None, required_for: Path) -> tuple[str | None, Path | None]:
    from dfvg_host.demo import DEMO_DATA
    if path:
        p = Path(path)
        if not p.is_file():
            raise CliError(f"calibration file {p} does not exist")
        return p.read_text(), p
    default = DEMO_DATA / "calibration.txt"
    if default.is_file():
        return default.read_text(), default
    raise CliError(f"no calibration text for {required_for}: pass --calibration FILE "
                   "(or --random-weights for sizing only)")


def cmd_compile(args) -> int:
    from dfvg_host.compiler import compile_draft
    from dfvg_host.report import compile_report

    engine = _preset(args.preset)
    draft = Path(args.draft)
    if not draft.is_dir():
        raise CliError(f"--draft {draft} is not a directory")
    text = None
    if not args.random_weights:
        text, _ = _read_calibration(args.calibration, draft)
    t0 = time.perf_counter()
    compiled = compile_draft(draft, engine, calibration_text=text, random_weights=args.random_weights)
    compiled.save(args.output)
    shape = compiled.shape
    report = compile_report(engine, compiled.program, model=shape.describe(),
                            image_bytes=len(compiled.image), context_limit=compiled.context_limit,
                            context=args.context)
    (Path(args.output) / "report.json").write_text(json.dumps(report.to_dict(), indent=2) + "\n")
    (Path(args.output) / "report.txt").write_text(report.text() + "\n")
    if args.json:
        print(json.dumps(report.to_dict(), indent=2))
    else:
        print(f"compiled {draft} -> {args.output} in {time.perf_counter() - t0:.1f} s "
              f"(weights: {'random, for sizing' if args.random_weights else 'int8 per channel'})")
        print(report.text())
    return 0


def cmd_presets(args) -> int:
    from dfvg_hw.config import PRESETS
    for cfg in PRESETS.values():
        print(f"{cfg.name:12s} tile {cfg.rows}x{cfg.lanes}x{cfg.reduce}  KV {cfg.kv_layers}L x "
              f"{cfg.kv_heads}H x {cfg.kv_positions}P x {cfg.head_dim}  {cfg.clock_mhz:g} MHz  "
              f"{cfg.mem_bandwidth_gbps:g} GB/s\n{'':12s} {cfg.source}")
    return 0


def cmd_demo(args) -> int:
    """Greedy drafting of the shipped draft on the functional model, checked against float."""
    import numpy as np
    import torch
    from transformers import AutoTokenizer

    from dfvg_hw.descriptors import DraftRequest, ErrorCode
    from dfvg_host.compiler import load_model
    from dfvg_host.demo import DEMO_DATA, compiled_demo, demo_paths
    from dfvg_host.report import compile_report
    from sim.session import FunctionalSession

    engine = _preset(args.preset)
    draft_dir, _ = demo_paths()
    compiled = compiled_demo(draft_dir, engine, DEMO_DATA / "calibration.txt")
    tok = AutoTokenizer.from_pretrained(draft_dir, local_files_only=True)
    prompt_ids = tok(args.prompt)["input_ids"]
    if len(prompt_ids) + args.max_new_tokens > compiled.context_limit:
        raise CliError(f"prompt ({len(prompt_ids)} tokens) + --max-new-tokens exceeds the "
                       f"context limit of {compiled.context_limit}")
    session = FunctionalSession(engine, compiled.image, compiled.program)
    print(f"draft engine: functional model of '{engine.name}' (sim), greedy, "
          f"{args.gamma} tokens per request\n")
    print(args.prompt, end="", flush=True)
    drafted, cycles, wall = [], 0, 0.0
    inputs, pos = prompt_ids, 0
    while len(drafted) < args.max_new_tokens:
        n = min(args.gamma, args.max_new_tokens - len(drafted))
        t0 = time.perf_counter()
        result = session.run(DraftRequest(tokens=inputs, start_pos=pos, n_draft=n))
        wall += time.perf_counter() - t0
        if result.status != ErrorCode.OK:
            raise CliError(f"engine error {result.status.name}: {result.status.describe()}")
        new = [t.token for t in result.tokens]
        cycles += result.cycles
        print(tok.decode(drafted + new)[len(tok.decode(drafted)):], end="", flush=True)
        drafted += new
        inputs, pos = [new[-1]], result.end_pos
    print("\n")
    model = load_model(draft_dir)
    with torch.no_grad():
        ref = model.generate(torch.tensor([prompt_ids]), max_new_tokens=len(drafted), do_sample=False,
                             min_new_tokens=len(drafted))[0, len(prompt_ids):].tolist()
    same = next((i for i, (a, b) in enumerate(zip(drafted, ref)) if a != b), len(drafted))
    report = compile_report(engine, compiled.program, model=compiled.shape.describe(),
                            image_bytes=len(compiled.image), context_limit=compiled.context_limit)
    print(f"int8 engine vs float draft (transformers, greedy): first {same} of {len(drafted)} "
          f"tokens identical; {sum(a == b for a, b in zip(drafted, ref))} equal overall")
    print(f"engine time   {cycles:,} cycles for {len(drafted)} tokens incl. prompt prefill = "
          f"{cycles / engine.clock_mhz / 1e3:.3f} ms at {engine.clock_mhz:g} MHz [modelled: cycle model]")
    print(f"draft speed   {report.tokens_per_s:,.0f} tokens/s steady state at context "
          f"{report.context} [modelled]")
    print(f"simulation    {wall:.2f} s wall for the functional model [measured, host CPU]")
    return 0


def build_parser() -> argparse.ArgumentParser:
    from dfvg_hw.config import preset_names

    p = argparse.ArgumentParser(prog="dfvg", description="Draft-on-FPGA, Verify-on-GPU "
                                "speculative decoding: draft-engine compiler, simulators and runtime.")
    sub = p.add_subparsers(dest="command", required=True)

    c = sub.add_parser("compile", help="compile a Hugging Face draft model for the draft engine")
    c.add_argument("--draft", required=True, help="local Hugging Face model directory (Llama family)")
    c.add_argument("--preset", default="alveo-u55c", help=f"engine preset ({', '.join(preset_names())})")
    c.add_argument("-o", "--output", required=True, help="output directory")
    c.add_argument("--calibration", help="text file to calibrate activation scales "
                   "(default: the shipped calibration text)")
    c.add_argument("--random-weights", action="store_true",
                   help="initialise weights randomly from config.json (for sizing a model shape)")
    c.add_argument("--context", type=int, default=256,
                   help="context length the speed figures are modelled at (default 256)")
    c.add_argument("--json", action="store_true", help="print the report as JSON")
    c.set_defaults(func=cmd_compile)

    d = sub.add_parser("demo", help="draft with the shipped demo draft on the functional model")
    d.add_argument("--preset", default="alveo-u55c")
    d.add_argument("--prompt", default="def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n")
    d.add_argument("--max-new-tokens", type=int, default=48)
    d.add_argument("--gamma", type=int, default=8, help="tokens drafted per device request")
    d.set_defaults(func=cmd_demo)

    s = sub.add_parser("presets", help="list the engine presets")
    s.set_defaults(func=cmd_presets)
    return p


def main(argv: list[str] | None = None) -> int:
    from dfvg_hw.config import ConfigError
    from dfvg_host.compiler import CompileError

    parser = build_parser()
    args = parser.parse_args(argv)
    for name in ("max_new_tokens", "gamma", "context"):
        if getattr(args, name, 1) is not None and getattr(args, name, 1) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    try:
        return args.func(args)
    except (CliError, CompileError, ConfigError, FileNotFoundError) as exc:
        print(f"dfvg: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
