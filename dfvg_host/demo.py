"""The demo model pair the repository ships, and a cache of its compiled draft."""

from __future__ import annotations

from pathlib import Path

from dfvg_hw.spec.config import EngineConfig
from dfvg_host.cache import REPO_ROOT, build_dir_once, cache_dir, calibration_text, fingerprint

__all__ = ["REPO_ROOT", "DEMO_DRAFT", "DEMO_TARGET", "DEMO_DATA", "DEFAULT_CALIBRATION", "demo_paths",
           "compile_cached"]

DEMO_DRAFT = REPO_ROOT / "models" / "demo-draft"
DEMO_TARGET = REPO_ROOT / "models" / "demo-target"
DEMO_DATA = REPO_ROOT / "models" / "demo-data"
#: The calibration text of a draft compiled without --calibration: prose of several
#: kinds and code in several languages first, then the demo's Python. The compiler reads
#: its first 4096 tokens. (The demo draft, a Python model, keeps the Python alone.)
DEFAULT_CALIBRATION = (REPO_ROOT / "models" / "calibration" / "prose-and-code.txt",
                       DEMO_DATA / "calibration.txt")


def demo_paths() -> tuple[Path, Path]:
    """(draft, target) directories; a clear error if this is not a source checkout."""
    for p in (DEMO_DRAFT, DEMO_TARGET):
        if not (p / "config.json").is_file():
            raise FileNotFoundError(f"the demo models are not at {p}: they ship with the source "
                                    "checkout (models/); pass --draft/--target to use your own")
    return DEMO_DRAFT, DEMO_TARGET


def compile_cached(model_dir: Path, engine: EngineConfig, calibration: Path | tuple[Path, ...] | None,
                   log=print, *,
                   tokenizer_dir: Path | None = None, weight_blocks: bool | None = None,
                   row_exponents: bool | None = None):
    """The compiled draft for ``engine``, from the cache when its inputs are unchanged; the
    calibration text is tokenised by the tokenizer in ``tokenizer_dir`` (default ``model_dir``).
    ``weight_blocks``: block-scaled weights, ``row_exponents``: h's row exponents
    (``compile_draft``; ``None``: its defaults), each choice cached apart.

    Concurrent callers (pytest-xdist workers, two ``dfvg`` commands) compile an entry once:
    the others wait for it and load it (:func:`dfvg_host.cache.build_dir_once`).
    """
    from dfvg_host.compiler import CompiledDraft, compile_draft

    key = fingerprint(model_dir, calibration, engine, tokenizer_dir)
    named = {True: "-{}", False: "-no{}", None: ""}
    options = named[weight_blocks].format("blocks") + named[row_exponents].format("rowexp")
    out = cache_dir() / f"{model_dir.name}-{engine.name}{options}-{key}"
    built = []

    def build(tmp: Path) -> None:
        log(f"compiling {model_dir} for {engine.name} (cached in {out}) ...")
        text = calibration_text(calibration)
        built.append(compile_draft(model_dir, engine, calibration_text=text, tokenizer_dir=tokenizer_dir,
                                   weight_blocks=weight_blocks, row_exponents=row_exponents))
        built[0].save(tmp)

    build_dir_once(out, build, complete=CompiledDraft.is_complete)
    return built[0] if built else CompiledDraft.load(out)
