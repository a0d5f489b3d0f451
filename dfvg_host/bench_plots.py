"""PNG plots of a ``dfvg bench`` result (its JSON form), with matplotlib (``pip install 'dfvg[bench]'``).

Three figures: acceptance vs γ (per task), speedup over target-only vs γ (chains, and the
engine's trees serial and pipelined with γ their depth), and DFVG's acceptance per draft
position. Each says which figures are measured and which are
modelled. Replot a saved result without rerunning it::

    python -m dfvg_host.bench_plots benchmarks/results/quick.json -o benchmarks/plots
"""

from __future__ import annotations

import argparse
import json
import sys
import textwrap
from pathlib import Path

__all__ = ["plot_results"]

_TASK_STYLE = {"all": dict(color="black", linewidth=2.4)}
_METHOD_STYLE = {"dfvg": dict(marker="o", linestyle="-"), "assisted": dict(marker="s", linestyle="--"),
                 "dfvg-pipelined": dict(marker="^", linestyle="-."),
                 "dfvg-engine-tree": dict(marker="D", linestyle="-"),
                 "dfvg-engine-tree-pipelined": dict(marker="v", linestyle="-.")}
_METHOD_NAME = {"dfvg": "DFVG (int8 draft on sim FPGA)", "assisted": "HF assisted (float draft)",
                "dfvg-pipelined": "DFVG pipelined (overlap modelled)",
                "dfvg-engine-tree": "DFVG engine trees (γ = depth)",
                "dfvg-engine-tree-pipelined": "DFVG engine trees pipelined (γ = depth, overlap modelled)"}


def _swept(rows: list[dict], method: str) -> list[dict]:
    """Rows of ``method`` at a fixed γ, in γ order."""
    return sorted((r for r in rows if r["method"] == method and r["gamma"] is not None),
                  key=lambda r: r["gamma"])


def _footer(fig, setup: dict, note: str) -> float:
    """Write the run's setup and ``note`` under the axes, wrapped to the figure's width;
    returns the share of the figure's height it takes (for ``tight_layout``'s rect)."""
    width = int(fig.get_figwidth() * 19)          # characters of 7-point text per line
    text = "\n".join([textwrap.fill(f"{setup['prompts']} prompts ({setup['prompt_mix']}) x "
                                     f"{setup['max_new_tokens']} tokens, greedy; target {setup['target']} "
                                     f"on {setup['verifier_device']}; {setup['date']}", width),
                      textwrap.fill(note, width)])
    fig.text(0.01, 0.01, text, fontsize=7, color="0.3", va="bottom")
    return 0.02 + 0.13 / fig.get_figheight() * (text.count("\n") + 1)


def _acceptance_vs_gamma(plt, result: dict, out: Path) -> Path:
    from matplotlib.lines import Line2D

    fig, ax = plt.subplots(figsize=(7, 4.6))
    tasks = list(result["by_task"]) + ["all"]
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    task_handles = []
    for i, task in enumerate(tasks):
        rows = result["rows"] if task == "all" else result["by_task"][task]
        style = _TASK_STYLE.get(task, dict(color=colors[i % len(colors)], linewidth=1.4))
        for method in ("dfvg", "dfvg-pipelined", "assisted"):
            pts = _swept(rows, method)
            if pts:
                ax.plot([r["gamma"] for r in pts], [r["acceptance_rate"] for r in pts],
                        **style, **_METHOD_STYLE[method])
        task_handles.append(Line2D([], [], label="all tasks" if task == "all" else task, **style))
    method_handles = [Line2D([], [], color="0.3", label=_METHOD_NAME[m], **_METHOD_STYLE[m])
                      for m in ("dfvg", "dfvg-pipelined", "assisted") if _swept(result["rows"], m)]
    ax.set_xticks(result["setup"]["gammas"])
    ax.set_xlabel("γ (draft tokens per round)")
    ax.set_ylabel("acceptance rate (accepted / drafted)")
    ax.set_ylim(0, 1.02)
    ax.set_title("Acceptance vs γ, by task (measured: counted from greedy runs)")
    ax.grid(alpha=0.3)
    first = ax.legend(handles=task_handles, title="task", fontsize=8, loc="lower left")
    ax.add_artist(first)
    ax.legend(handles=method_handles, title="method", fontsize=8, loc="upper right")
    bottom = _footer(fig, result["setup"], "Assisted: derived from forward-pass counts. The int8 (DFVG) and float "
            "(assisted) drafts mostly agree, so their curves nearly coincide.")
    fig.tight_layout(rect=(0, bottom, 1, 1))
    path = out / "acceptance_vs_gamma.png"
    fig.savefig(path, dpi=130)
    plt.close(fig)
    return path


def _speedup_vs_gamma(plt, result: dict, out: Path) -> Path:
    fig, ax = plt.subplots(figsize=(9, 6.4))
    rows = result["rows"]
    colors = {"dfvg": "C0", "assisted": "C1", "dfvg-pipelined": "C2", "dfvg-engine-tree": "C4",
              "dfvg-engine-tree-pipelined": "C5"}
    for method, what in (("dfvg", "projected: measured target+host + modelled FPGA+PCIe"),
                         ("dfvg-pipelined", "projected, modelled overlap counted once"),
                         ("dfvg-engine-tree", "projected like DFVG"),
                         ("dfvg-engine-tree-pipelined", "projected, modelled overlap counted once"),
                         ("assisted", "measured wall time")):
        pts = _swept(rows, method)
        if pts:
            ax.plot([r["gamma"] for r in pts], [r["speedup_over_target_only"] for r in pts],
                    label=f"{_METHOD_NAME[method]} ({what})", color=colors[method],
                    **_METHOD_STYLE[method])
    default = next((r for r in rows if r["method"] == "assisted" and r["gamma"] is None), None)
    if default:
        ax.axhline(default["speedup_over_target_only"], color="C1", linestyle=":", linewidth=1,
                   label="HF assisted with transformers' default settings (measured)")
    adaptive = next((r for r in rows if r["method"] == "dfvg-adaptive"), None)
    if adaptive:
        ax.axhline(adaptive["speedup_over_target_only"], color="C3", linestyle="--", linewidth=1.2,
                   label=f"DFVG adaptive γ (mean {adaptive['mean_gamma'] or 0:.1f}; projected)")
    ax.axhline(1.0, color="0.4", linewidth=1, label="target-only autoregressive (measured) = 1")
    for r in _swept(rows, "dfvg"):
        ax.annotate(f"{r['speedup_over_target_only']:.2f}x", (r["gamma"], r["speedup_over_target_only"]),
                    textcoords="offset points", xytext=(0, 7), ha="center", fontsize=8, color="C0")
    ax.set_xticks(result["setup"]["gammas"])
    ax.set_xlabel("γ (draft tokens per round)")
    ax.set_ylabel("speedup over target-only (tokens/s ratio)")
    ax.set_ylim(0, 1.15 * max([1.0] + [r["speedup_over_target_only"] for r in rows]))
    ax.set_title("Speedup vs γ (ratios within one run, same prompts)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.13), ncol=2)
    bottom = _footer(fig, result["setup"], "DFVG serial: draft, PCIe and verify times are added; pipelined: "
            "the modelled overlap of drafting with verifying is counted once. Engine trees: γ is the "
            "tree's depth" + (f", at most {result['setup']['engine_tree_budget']} nodes verified"
                              if result["setup"].get("engine_tree_budget") else "") + ".")
    fig.tight_layout(rect=(0, bottom, 1, 1))
    path = out / "speedup_vs_gamma.png"
    fig.savefig(path, dpi=130)
    plt.close(fig)
    return path


def _acceptance_per_position(plt, result: dict, out: Path) -> Path:
    fig, ax = plt.subplots(figsize=(7, 4.6))
    for r in _swept(result["rows"], "dfvg"):
        per = r["acceptance_per_position"] or []
        ax.plot(range(1, len(per) + 1), per, marker="o", label=f"γ = {r['gamma']}")
    ax.set_xticks(range(1, max(result["setup"]["gammas"]) + 1))
    ax.set_xlabel("draft position k (1 = first drafted token)")
    ax.set_ylabel("acceptance at position k (accepted / drafted)")
    ax.set_ylim(0, 1.02)
    ax.set_title("DFVG acceptance per draft position, all tasks (measured: counted)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, title="draft length")
    bottom = _footer(fig, result["setup"], "A position counts as accepted only if every earlier draft in its round was.")
    fig.tight_layout(rect=(0, bottom, 1, 1))
    path = out / "acceptance_per_position.png"
    fig.savefig(path, dpi=130)
    plt.close(fig)
    return path


def plot_results(result: dict, out_dir: str | Path) -> list[Path]:
    """Write the three PNGs of ``result`` (``BenchResult.to_dict()``) into ``out_dir``."""
    import matplotlib
    matplotlib.use("Agg")           # files only: no display on servers and CI
    import matplotlib.pyplot as plt

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    return [f(plt, result, out) for f in (_acceptance_vs_gamma, _speedup_vs_gamma, _acceptance_per_position)]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("result", help="JSON written by `dfvg bench --json` or `--save`")
    ap.add_argument("-o", "--output", default=".", help="directory for the PNGs")
    args = ap.parse_args(argv)
    for path in plot_results(json.loads(Path(args.result).read_text()), args.output):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
