"""Engine efficiency: modelled draft speed of paper-sized draft shapes against the rooflines.

For each shape and board preset the shape is compiled by the real compiler
(:func:`~dfvg_host.compiler.compile_draft`, random weights: the cycle model depends on
shapes only) and costed by :func:`~dfvg_host.report.compile_report`, exactly as
``dfvg compile --random-weights`` does. Every figure here is *modelled*.

Compiling a 160M-parameter shape takes ~20 s per preset on one core, so each report is
cached (``~/.cache/dfvg/efficiency``) under a fingerprint of the shape, the preset and
the compiler's sources, like the demo draft's compile cache.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

from dfvg_hw.spec.config import EngineConfig
from dfvg_host.cache import cache_dir, fingerprint, locked, write_text_atomic
from dfvg_host.report import CompileReport, compile_report

__all__ = ["DraftShape", "PAPER_SHAPES", "FAMILY_SHAPES", "EfficiencyRow", "engine_efficiency"]


@dataclass(frozen=True)
class DraftShape:
    """A draft shape of a supported family, written out as a Hugging Face ``config.json``.

    Members
    -------
    family : str
        ``model_type`` (llama, qwen2, qwen3, opt).
    kv_heads, head_dim : int or None
        GQA KV heads and the head width (default: ``heads`` and ``hidden / heads``).
    tied : bool
        Whether the LM head is the embedding matrix.
    draft_vocab : int or None
        ``dfvg compile --draft-vocab``: the engine drafts over this many of ``vocab``.
    """
    name: str
    hidden: int
    layers: int
    heads: int
    intermediate: int
    vocab: int
    max_positions: int = 2048
    family: str = "llama"
    kv_heads: int | None = None
    head_dim: int | None = None
    tied: bool = False
    draft_vocab: int | None = None

    def write_config(self, directory: Path) -> Path:
        """Write ``config.json`` into ``directory`` (only when it changed) and return it."""
        from transformers import AutoConfig

        directory.mkdir(parents=True, exist_ok=True)
        extra = {} if self.head_dim is None else dict(head_dim=self.head_dim)
        if self.family == "opt":        # OPT names the MLP width ffn_dim and has no GQA
            extra.update(ffn_dim=self.intermediate, word_embed_proj_dim=self.hidden)
        else:
            extra.update(intermediate_size=self.intermediate, num_key_value_heads=self.kv_heads or self.heads)
        config = AutoConfig.for_model(self.family, hidden_size=self.hidden, num_hidden_layers=self.layers,
                                      num_attention_heads=self.heads, vocab_size=self.vocab,
                                      max_position_embeddings=self.max_positions,
                                      tie_word_embeddings=self.tied, **extra)
        text = config.to_json_string()
        path = directory / "config.json"
        # Rewriting identical bytes would be harmless, but skipping it keeps the file's
        # mtime stable for anyone inspecting the cache.
        if not path.is_file() or path.read_text() != text:
            write_text_atomic(path, text)
        return directory


#: The draft shapes of the DFVG paper's LLaMA pairs (JackFram's llama-68m / llama-160m).
PAPER_SHAPES = (
    DraftShape("LLaMA-68M-shaped", hidden=768, layers=2, heads=12, intermediate=3072, vocab=32000),
    DraftShape("LLaMA-160M-shaped", hidden=768, layers=12, heads=12, intermediate=3072, vocab=32000),
)

#: The other families' common drafts (issue #17), from their published configs (OPT-125M
#: drafts for OPT-13B in the DFVG paper, Qwen3-0.6B for Qwen3-8B); Qwen's
#: 151,936 tokens exceed the engine's 16-bit ids, so they draft over 65,534 of them.
FAMILY_SHAPES = (
    DraftShape("OPT-125M-shaped", hidden=768, layers=12, heads=12, intermediate=3072, vocab=50272,
               family="opt", tied=True),
    DraftShape("Qwen2.5-0.5B-shaped", hidden=896, layers=24, heads=14, kv_heads=2, intermediate=4864,
               vocab=151936, family="qwen2", tied=True, draft_vocab=65535),
    DraftShape("Qwen3-0.6B-shaped", hidden=1024, layers=28, heads=16, kv_heads=8, head_dim=128,
               intermediate=3072, vocab=151936, family="qwen3", tied=True, draft_vocab=65535),
)


@dataclass(frozen=True)
class EfficiencyRow:
    """One shape on one preset: the compile report's modelled figures."""
    shape: str
    report: CompileReport

    @property
    def bound(self) -> str:
        """Which card roofline is lower: what limits the engine on this shape."""
        return self.report.bound

    def to_dict(self) -> dict:
        r = self.report
        return dict(shape=self.shape, **{k: v for k, v in r.to_dict().items() if k != "cycles_by_op"},
                    cycles_by_op=dict(r.cycles_by_op),
                    label="modelled: cycle model on the compiled program; rooflines from the "
                          "card's achievable and theoretical memory bandwidth, the engine's "
                          "ports and peak MACs")


def _report_fingerprint() -> str:
    """The sources that turn a compiled program into figures: a changed cycle model or
    report must not reuse cached figures."""
    import sim.attention_timing
    import sim.elementwise_timing
    import sim.matmul_timing
    import sim.cycle_model
    import sim.timing_common
    from dfvg_host import report
    h = hashlib.sha256()
    for module in (sim.cycle_model, sim.attention_timing, sim.timing_common, sim.matmul_timing,
                   sim.elementwise_timing, report):
        h.update(Path(module.__file__).read_bytes())
    return h.hexdigest()[:8]


def _cached_report(path: Path) -> CompileReport | None:
    return CompileReport(**json.loads(path.read_text())) if path.is_file() else None


def _compile_and_report(shape_dir: Path, engine: EngineConfig, context: int, model,
                        draft_vocab: int | None) -> CompileReport:
    from dfvg_host.compiler import compile_draft

    compiled = compile_draft(shape_dir, engine, random_weights=True, model=model, draft_vocab=draft_vocab)
    return compile_report(engine, compiled.program, model=compiled.shape.describe(),
                          image_bytes=len(compiled.image), context_limit=compiled.context_limit,
                          context=context)


def engine_efficiency(engines: list[EngineConfig], shapes: tuple[DraftShape, ...] = PAPER_SHAPES, *,
                      context: int = 256, cache: bool = True,
                      log: Callable[[str], None] = lambda _: None) -> list[EfficiencyRow]:
    """Modelled draft tokens/s and rooflines of every shape on every engine preset.

    Parameters
    ----------
    engines : list of EngineConfig
        Presets to compile for.
    shapes : tuple of DraftShape
        Draft shapes (default: the paper's LLaMA-68M and LLaMA-160M shapes).
    context : int
        KV positions the steady-state draft step is modelled at (as ``dfvg compile --context``).
    cache : bool
        Reuse reports cached under ``~/.cache/dfvg/efficiency``.
    log : callable
        Progress messages (compiling is slow for large shapes).

    Returns
    -------
    list of EfficiencyRow
        In shape-major order.
    """
    from dfvg_host.compiler import load_model

    root = cache_dir() / "efficiency"
    rows = []
    for shape in shapes:
        shape_dir = shape.write_config(root / "shapes" / shape.name)
        model = None          # loaded once per shape, and only when a preset is not cached
        for engine in engines:
            key = (f"{shape.name}-{engine.name}-ctx{context}-v{shape.draft_vocab or 0}-"
                   f"{fingerprint(shape_dir, None, engine)}-{_report_fingerprint()}")
            path = root / f"{key}.json"
            report = _cached_report(path) if cache else None
            if report is None:
                # Concurrent processes take turns; the later ones find the report written.
                with locked(path):
                    report = _cached_report(path) if cache else None
                    if report is None:
                        log(f"compiling {shape.name} (random weights) for {engine.name} ...")
                        if model is None:
                            model = load_model(shape_dir, random_weights=True)
                        report = _compile_and_report(shape_dir, engine, context, model, shape.draft_vocab)
                        write_text_atomic(path, json.dumps(asdict(report), indent=1) + "\n")
            rows.append(EfficiencyRow(shape.name, report))
    return rows
