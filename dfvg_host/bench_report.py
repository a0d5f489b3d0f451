"""Readable tables of a :class:`~dfvg_host.bench.BenchResult`.

Every column header says whether its figure is measured on this host or modelled
(cycle model, link model); the notes under each table say how tokens/s is formed.
"""

from __future__ import annotations

from dfvg_host.bench import (ALL_TASKS, ENGINE_TREE, ENGINE_TREE_PIPELINED, MULTI_METHODS, BenchResult,
                             Tally)

__all__ = ["format_result", "speed_table", "task_table", "position_table", "efficiency_table",
           "adaptive_table", "engine_tree_table", "strategies_line"]


def _num(x: float | None, fmt: str, empty: str = "-") -> str:
    return empty if x is None else format(x, fmt)


def _ratio(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}x"


def _match_note(result: BenchResult) -> str:
    """Whether every method reproduced target-only greedy decoding, prompt by prompt."""
    rows = [t for t in result.rows(ALL_TASKS) if t.method != "target-only"]
    differ = [f"{t.key} ({t.prompts - t.matches_target_only} of {t.prompts})"
              for t in rows if t.matches_target_only != t.prompts]
    if not differ:
        return (f"Every method's output equals target-only greedy decoding on all "
                f"{result.baseline().prompts} prompts.")
    return ("Outputs that differ from target-only greedy decoding (float near-ties or a bug): "
            + ", ".join(differ) + ".")


def _key_width(result: BenchResult) -> int:
    """The method column's width: 24, or the longest row name and a space."""
    return max([24] + [len(t.key) + 1 for t in result.rows(ALL_TASKS)])


def speed_table(result: BenchResult) -> str:
    s = result.setup
    w = _key_width(result)
    base = result.baseline()
    head = (f"{'method':<{w}}{'tok/s':>8}{'target s':>10}{'host s':>8}{'draft s':>9}{'FPGA s':>9}"
            f"{'PCIe s':>9}{'accept':>8}{'len':>6}{'host/round':>13}{'x target':>10}{'x assisted':>11}")
    unit = (f"{'':<{w}}{'':>8}{'measured':>10}{'meas.':>8}{'meas.':>9}{'modelled':>9}"
            f"{'modelled':>9}{'':>8}{'':>6}{'µs':>7}{'%':>6}{'-only':>10}{'same γ':>11}")
    lines = [f"Decoding speed: {s['prompts']} prompts ({s['prompt_mix']}) x {s['max_new_tokens']} new "
             "tokens, greedy, EOS ignored",
             f"target {s['target']} on {s['verifier_device']} ({s['dtype']}) | draft {s['draft']}: "
             f"float on {s['verifier_device']} for assisted, int8 on {s['device']} for DFVG",
             "", head, unit]
    for t in result.rows(ALL_TASKS):
        same = result.get("assisted", t.gamma) if t.is_dfvg and t.gamma is not None else None
        lines.append(
            f"{t.key:<{w}}{t.tokens_per_s:>8.1f}{t.target_s:>10.3f}{t.host_s:>8.3f}"
            f"{_num(t.draft_s if t.method == 'assisted' else None, '9.3f'):>9}"
            f"{_num(t.draft_s if t.is_dfvg else None, '9.4f'):>9}"
            f"{_num(t.pcie_s if t.is_dfvg else None, '9.4f'):>9}"
            f"{_num(t.acceptance_rate, '8.3f'):>8}{t.mean_accepted_length:>6.2f}"
            f"{t.host_us_per_round:>7.0f}{100 * t.host_share:>5.1f}%"
            f"{_ratio(result.speedup(t, base)):>10}{_ratio(result.speedup(t, same)):>11}")
    sim = sum(t.simulator_s for t in result.rows(ALL_TASKS) if t.is_dfvg)
    lines += ["",
              "tok/s: target-only and assisted are measured wall time; DFVG is projected = measured "
              "target + host + modelled FPGA (cycle model) + PCIe (link model), unpipelined.",
              "dfvg-pipelined: the engine drafts the next round while the target verifies; its "
              "tok/s takes the overlap (modelled: the sim device runs synchronously) once.",
              "dfvg-adaptive: serial DFVG with γ chosen per round from the measured acceptance and "
              "verify time and the modelled draft time (projected like dfvg).",
              "accept: drafted tokens accepted (assisted: derived from forward-pass counts); "
              "len: tokens committed per target forward pass.",
              *(["dfvg-engine-tree: the engine drafts a token tree of γ levels per round, verified in "
                 "one target forward; accept counts levels (projected like dfvg)."]
                if result.rows(ALL_TASKS, ENGINE_TREE) else []),
              *(["dfvg-engine-tree-pipelined: the same trees, the engine drafting the next round's "
                 "tree while the target verifies (overlap modelled, counted once, like dfvg-pipelined)."]
                if result.rows(ALL_TASKS, ENGINE_TREE_PIPELINED) else []),
              "host/round: measured time outside the forward passes, per target forward, and as a "
              "share of the method's time.",
              f"The functional model stood in for the FPGA for {sim:.1f} s of measured wall time, "
              "not counted above.",
              _match_note(result)]
    return "\n".join(lines)


def task_table(result: BenchResult) -> str:
    w = _key_width(result)
    tasks = result.tasks + [ALL_TASKS]
    col = 22
    lines = ["Acceptance by task: accepted/drafted, tokens per target forward, speedup over "
             "target-only on the same task",
             "",
             f"{'method':<{w}}" + "".join(f"{t:>{col}}" for t in tasks),
             f"{'':<{w}}" + "".join(f"{'accept   len  x t-o':>{col}}" for _ in tasks)]
    for t in result.rows(ALL_TASKS):
        if t.method == "target-only":
            continue
        cells = []
        for task in tasks:
            r = result.get(t.method, t.gamma, task)
            cells.append(f"{_num(r.acceptance_rate, '.3f'):>6} {r.mean_accepted_length:>5.2f} "
                         f"{_ratio(result.speedup(r, result.baseline(task))):>6}")
        lines.append(f"{t.key:<{w}}" + "".join(f"{c:>{col}}" for c in cells))
    lines += ["", "speedups: DFVG projected / target-only measured; assisted measured / measured."]
    return "\n".join(lines)


def pipeline_table(result: BenchResult) -> str:
    rows = result.rows(ALL_TASKS, "dfvg-pipelined")
    if not rows:
        return ""
    base = result.baseline()
    lines = ["Pipelined DFVG: the engine drafts round n+1 while the target verifies round n "
             "(overlap modelled)", "",
             f"{'method':<24}{'tok/s':>8}{'serial':>8}{'hits':>7}{'misses':>8}{'hidden s':>10}"
             f"{'hidden':>8}{'x target':>10}{'x serial':>10}",
             f"{'':<24}{'proj.':>8}{'proj.':>8}{'':>7}{'':>8}{'modelled':>10}{'%':>8}{'-only':>10}"
             f"{'same γ':>10}"]
    for t in rows:
        serial = result.get("dfvg", t.gamma)
        lines.append(f"{t.key:<24}{t.tokens_per_s:>8.1f}"
                     f"{_num(serial.tokens_per_s if serial else None, '8.1f'):>8}"
                     f"{t.pipeline_hits:>7}{t.pipeline_misses:>8}{t.hidden_s:>10.4f}"
                     f"{100 * (t.hidden_share or 0):>7.1f}%{_ratio(result.speedup(t, base)):>10}"
                     f"{_ratio(result.speedup(t, serial)):>10}")
    lines += ["", "hits: rounds whose drafts were ready when verification ended; hidden: engine + "
              "PCIe time that overlapped verification, as a share of all engine + PCIe time."]
    return "\n".join(lines)


def adaptive_table(result: BenchResult) -> str:
    t = result.get("dfvg-adaptive", None)
    if t is None:
        return ""
    best = result.best("dfvg")
    hist = " ".join(f"{g}:{n}" for g, n in sorted(t.gamma_histogram.items()))
    lines = ["Adaptive DFVG: γ chosen per round (serial schedule; dfvg_host/adaptive.py)", "",
             f"{'method':<24}{'tok/s':>8}{'mean γ':>8}{'accept':>8}{'len':>6}{'x target':>10}"
             f"{'x best':>9}  best fixed γ",
             f"{'':<24}{'proj.':>8}{'':>8}{'':>8}{'':>6}{'-only':>10}{'fixed':>9}"]
    lines.append(f"{t.key:<24}{t.tokens_per_s:>8.1f}{_num(t.mean_gamma, '8.2f'):>8}"
                 f"{_num(t.acceptance_rate, '8.3f'):>8}{t.mean_accepted_length:>6.2f}"
                 f"{_ratio(result.speedup(t, result.baseline())):>10}"
                 f"{_ratio(result.speedup(t, best)):>9}  {best.key if best else '-'}")
    lines += ["", f"rounds by γ: {hist}",
              "x best fixed: over serial DFVG at its best γ of this run's sweep (chosen after the "
              "fact); one controller learnt over every prompt, warm-up included."]
    return "\n".join(lines)


def several_table(result: BenchResult) -> str:
    """Several drafters (Smurfs): each alone, voting, the merged tree, voting with an
    adaptive γ; per multi-drafter row, each drafter's matched share and times chosen."""
    multi = [t for t in result.rows(ALL_TASKS) if t.method in MULTI_METHODS]
    if not multi:
        return ""
    single = result.best_single_drafter()
    alone = [t for t in result.rows(ALL_TASKS) if t.method == "dfvg" or t.method.startswith("dfvg[")]
    lines = [f"Several drafters: {result.setup['draft']} (dfvg) and "
             f"{', '.join(result.setup.get('extra_drafters') or [])} (dfvg[NAME]); drafting at once, a "
             "round costs the slowest engine plus the busiest link (modelled)", "",
             f"{'method':<30}{'tok/s':>8}{'accept':>8}{'len':>6}{'x target':>10}{'x best':>8}  drafters: "
             "matched share, rounds chosen",
             f"{'':<30}{'proj.':>8}{'':>8}{'':>6}{'-only':>10}{'alone':>8}"]
    for t in alone + multi:
        who = "  ".join(f"{name} {m / j if j else 0:.2f} {c}" for name, (j, m, c) in t.drafters.items())
        lines.append(f"{t.key:<30}{t.tokens_per_s:>8.1f}{_num(t.acceptance_rate, '8.3f'):>8}"
                     f"{t.mean_accepted_length:>6.2f}{_ratio(result.speedup(t, result.baseline())):>10}"
                     f"{_ratio(result.speedup(t, single)):>8}  {who}")
    lines += ["", "x best alone: over the fastest drafter alone at any γ of this run "
              f"({single.key if single else '-'}). vote: weighted-majority voting, greedy only; tree: "
              "every draft verified in one forward as a token tree; accept counts the verified "
              "path's tokens against γ.",
              "matched share: of each drafter's drafted tokens that the committed tokens cover, "
              "the share they confirmed; weights follow it (dfvg_host/voting.py)."]
    return "\n".join(lines)


def engine_tree_table(result: BenchResult) -> str:
    """The engine's token trees at each depth, serial and pipelined, next to the chain of
    the same schedule at the same γ and at as many verified tokens per forward."""
    rows = result.rows(ALL_TASKS, ENGINE_TREE) + result.rows(ALL_TASKS, ENGINE_TREE_PIPELINED)
    if not rows:
        return ""
    width = result.setup.get("engine_tree_width")
    budget = result.setup.get("engine_tree_budget")
    w = _key_width(result)
    lines = [f"Engine token trees: the engine drafts a tree of γ levels x {width} rows per request "
             "(docs/isa.md §9), the target verifies "
             + (f"at most {budget} of its nodes (the likeliest accepted)" if budget else "all of it")
             + " in one forward", "",
             f"{'method':<{w}}{'tok/s':>8}{'verified':>10}{'tokens':>8}{'accept':>8}{'hits':>6}"
             f"{'misses':>8}{'hidden':>8}{'x target':>10}{'x chain':>9}{'x chain':>11}  chain at as many "
             "verified",
             f"{'':<{w}}{'proj.':>8}{'/fwd':>10}{'/fwd':>8}{'levels':>8}{'':>6}{'':>8}{'% mod.':>8}"
             f"{'-only':>10}{'same γ':>9}{'same ver.':>11}"]
    for t in rows:
        piped = t.method == ENGINE_TREE_PIPELINED
        chain_method = "dfvg-pipelined" if piped else "dfvg"
        chain = result.get(chain_method, t.gamma)
        same = result.chain_at_nodes(t, chain_method)
        lines.append(f"{t.key:<{w}}{t.tokens_per_s:>8.1f}{_num(t.verified_per_forward, '10.1f'):>10}"
                     f"{t.mean_accepted_length:>8.2f}{_num(t.acceptance_rate, '8.3f'):>8}"
                     f"{_num(t.pipeline_hits if piped else None, 'd'):>6}"
                     f"{_num(t.pipeline_misses if piped else None, 'd'):>8}"
                     f"{_num(100 * t.hidden_share if t.hidden_share is not None else None, '.1f'):>7}"
                     f"{'%' if t.hidden_share is not None else ' '}"
                     f"{_ratio(result.speedup(t, result.baseline())):>10}"
                     f"{_ratio(result.speedup(t, chain)):>9}{_ratio(result.speedup(t, same)):>11}  "
                     + (f"{same.key}: {same.mean_accepted_length:.2f} tokens/fwd, "
                        f"{same.tokens_per_s:.1f} tok/s" if same else "-"))
    lines += ["", "verified/fwd: draft tokens each verifying target forward checked (the tree's nodes"
              + (f", at most the budget of {budget}" if budget else "") + "; a chain's γ); tokens/fwd: "
              "tokens committed per target forward (accepted + 1). accept: levels the accepted path "
              "reached / levels drafted.",
              "x chain: over the chain of the same schedule (dfvg for the serial trees, dfvg-pipelined "
              "for the pipelined ones); same ver.: the chain whose γ is the tree's verified nodes "
              "(depth x width" + (", or the budget when smaller" if budget else "") + ").",
              "tok/s projected as dfvg's: measured target + host, modelled engine (the cycle model's "
              "tree request, docs/isa.md §9.5) + PCIe; pipelined rows count the modelled overlap once "
              "(hits: rounds whose next tree was ready when verification ended; hidden: engine + PCIe "
              "time that overlapped verification, modelled)."]
    return "\n".join(lines)


def strategies_line(result: BenchResult) -> str:
    """Chain and tree, serial and pipelined, each at its best γ, as x target-only."""
    h = result.strategies_headline()
    if not h:
        return ""
    cells = [f"{v['strategy']} {v['schedule']} {_ratio(v['over_target_only'])} ({v['key']})"
             for v in h["strategies"].values()]
    return ("Strategies and schedules at their best γ, x target-only: " + "; ".join(cells)
            + f". Fastest: {h['best_strategy']}.")


def position_table(result: BenchResult) -> str:
    rows = [t for t in result.rows(ALL_TASKS, "dfvg")]
    width = max((len(t.acceptance_per_position) for t in rows), default=0)
    lines = ["DFVG acceptance per draft position (accepted/drafted at position k, all tasks)", "",
             f"{'method':<24}" + "".join(f"{k:>7}" for k in range(1, width + 1))]
    for t in rows:
        lines.append(f"{t.key:<24}" + "".join(f"{a:>7.3f}" for a in t.acceptance_per_position))
    lines += ["", "Assisted generation does not expose which position was rejected, so it has no row."]
    return "\n".join(lines)


def efficiency_table(result: BenchResult) -> str:
    rows = result.efficiency
    if not rows:
        return ""
    lines = ["Draft-engine efficiency, all modelled: cycle model on the compiled program "
             "(random weights), one draft token at the context shown",
             "",
             f"{'shape':<20}{'preset':<12}{'ctx':>6}{'tok/s':>9}{'achievable':>12}{'of it':>7}"
             f"{'theoretical':>13}{'of it':>7}{'ports':>9}{'compute':>10}{'bound':>8}"
             f"{'cycles/tok':>12}{'MB/tok':>8}  cycles by opcode",
             f"{'':<20}{'':<12}{'':>6}{'modelled':>9}{'roofline':>12}{'':>7}"
             f"{'roofline':>13}{'':>7}{'roofline':>9}{'roofline':>10}"]
    for r in rows:
        p = r.report
        ops = ", ".join(f"{op} {c:,}" for op, c in sorted(p.cycles_by_op.items(), key=lambda kv: -kv[1]))
        lines.append(f"{r.shape:<20}{p.preset:<12}{p.context:>6}{p.tokens_per_s:>9,.0f}"
                     f"{p.roofline_achievable_tokens_per_s:>12,.0f}{100 * p.efficiency:>6.1f}%"
                     f"{p.roofline_theoretical_tokens_per_s:>13,.0f}{100 * p.fraction_of_theoretical:>6.1f}%"
                     f"{p.roofline_ports_tokens_per_s:>9,.0f}{p.roofline_compute_tokens_per_s:>10,.0f}"
                     f"{r.bound:>8}{p.cycles_per_token:>12,}{p.bytes_per_token / 1e6:>8.1f}  {ops}")
    lines += ["", "achievable roofline: the card's sustained memory bandwidth (every channel "
              "streaming, the vendor's measurement) / bytes read per token; 'of it' is the "
              "efficiency (÷ the compute roofline instead where that is lower). theoretical: the "
              "data sheet's bandwidth. ports: what the engine's memory ports move. compute: "
              "clock x lanes x reduce MACs per cycle (a chain fills one row) / MACs per token."]
    return "\n".join(lines)


def format_result(result: BenchResult) -> str:
    h = result.headline()
    parts = [speed_table(result), task_table(result), position_table(result)]
    piped = pipeline_table(result)
    if piped:
        parts.insert(1, piped)
    adaptive = adaptive_table(result)
    if adaptive:
        parts.insert(2 if piped else 1, adaptive)
    several = several_table(result)
    if several:
        parts.insert(1 + bool(piped) + bool(adaptive), several)
    trees = engine_tree_table(result)
    if trees:
        parts.insert(1 + bool(piped) + bool(adaptive) + bool(several), trees)
    if h["best_dfvg"]:
        parts.append(f"Headline: DFVG at its best γ ({h['best_dfvg']}) runs "
                     f"{_ratio(h['dfvg_over_target_only'])} target-only decoding and "
                     f"{_ratio(h['dfvg_over_best_assisted'])} the best assisted generation "
                     f"({h['best_assisted']}); {_ratio(h['dfvg_over_assisted_same_gamma'])} assisted "
                     f"at the same γ. Best assisted: {_ratio(h['best_assisted_over_target_only'])} "
                     "target-only."
                     + (f" Pipelined DFVG at its best γ ({h['best_dfvg_pipelined']}): "
                        f"{_ratio(h['dfvg_pipelined_over_target_only'])} target-only, "
                        f"{_ratio(h['dfvg_pipelined_over_dfvg'])} serial DFVG at its best."
                        if h.get("best_dfvg_pipelined") else "")
                     + (f" Adaptive DFVG (mean γ {h['dfvg_adaptive_mean_gamma']:.2f}): "
                        f"{_ratio(h['dfvg_adaptive_over_target_only'])} target-only, "
                        f"{_ratio(h['dfvg_adaptive_over_best_fixed'])} serial DFVG at its best fixed γ."
                        if h.get("dfvg_adaptive") and h.get("dfvg_adaptive_mean_gamma") is not None else "")
                     + "".join(f" {v['key']}: {_ratio(v['over_target_only'])} target-only, "
                               f"{_ratio(v['over_best_single_drafter'])} the best drafter alone "
                               f"({v['best_single_drafter']})."
                               for k, v in h.items() if k.replace("_", "-") in MULTI_METHODS)
                     + (f" Engine trees at their best ({h['dfvg_engine_tree']['key']}, "
                        f"{h['dfvg_engine_tree']['mean_accepted_length']:.2f} tokens per target forward): "
                        f"{_ratio(h['dfvg_engine_tree']['over_target_only'])} target-only, "
                        f"{_ratio(h['dfvg_engine_tree']['over_best_dfvg'])} the best chain "
                        f"({h['dfvg_engine_tree']['best_dfvg']})." if h.get("dfvg_engine_tree") else "")
                     + (f" Pipelined engine trees at their best ({h['dfvg_engine_tree_pipelined']['key']}): "
                        f"{_ratio(h['dfvg_engine_tree_pipelined']['over_target_only'])} target-only, "
                        f"{_ratio(h['dfvg_engine_tree_pipelined']['over_best_engine_tree'])} the serial "
                        f"trees at their best, {_ratio(h['dfvg_engine_tree_pipelined']['over_best_dfvg_pipelined'])} "
                        f"the best pipelined chain ({h['dfvg_engine_tree_pipelined']['best_dfvg_pipelined']})."
                        if h.get("dfvg_engine_tree_pipelined") else "")
                     + ("\n" + strategies_line(result) if h.get("strategies") else "")
                     + "\n[" + h["label"] + "]")
    eff = efficiency_table(result)
    if eff:
        parts.append(eff)
    rule = "\n\n" + "-" * 118 + "\n"
    return rule.join(parts)
