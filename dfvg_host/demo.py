"""The demo model pair the repository ships, and a cache of its compiled draft."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

from dfvg_hw.spec.config import EngineConfig

__all__ = ["REPO_ROOT", "DEMO_DRAFT", "DEMO_TARGET", "DEMO_DATA", "demo_paths", "compile_cached"]

REPO_ROOT = Path(__file__).resolve().parent.parent
DEMO_DRAFT = REPO_ROOT / "models" / "demo-draft"
DEMO_TARGET = REPO_ROOT / "models" / "demo-target"
DEMO_DATA = REPO_ROOT / "models" / "demo-data"


def demo_paths() -> tuple[Path, Path]:
    """(draft, target) directories; a clear error if this is not a source checkout."""
    for p in (DEMO_DRAFT, DEMO_TARGET):
        if not (p / "config.json").is_file():
            raise FileNotFoundError(f"the demo models are not at {p}: they ship with the source "
                                    "checkout (models/); pass --draft/--target to use your own")
    return DEMO_DRAFT, DEMO_TARGET


def _cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "dfvg"


def _fingerprint(model_dir: Path, calibration: Path | None, engine: EngineConfig) -> str:
    h = hashlib.sha256()
    for f in sorted(model_dir.glob("*.json")) + sorted(model_dir.glob("*.safetensors")):
        h.update(f.name.encode())
        h.update(f.read_bytes())
    if calibration is not None:
        h.update(calibration.read_bytes())
    h.update(repr(sorted(engine.to_dict().items())).encode())
    # The compiler's own sources: a changed compiler must not reuse an old image.
    for mod in sorted((REPO_ROOT / "dfvg_hw").glob("*.py")) + [Path(__file__).with_name("compiler.py")]:
        h.update(mod.read_bytes())
    return h.hexdigest()[:16]


def compile_cached(model_dir: Path, engine: EngineConfig, calibration: Path | None, log=print):
    """The compiled draft for ``engine``, from the cache when its inputs are unchanged."""
    from dfvg_host.compiler import CompiledDraft, compile_draft

    out = _cache_dir() / f"{model_dir.name}-{engine.name}-{_fingerprint(model_dir, calibration, engine)}"
    if (out / "manifest.json").is_file():
        return CompiledDraft.load(out)
    log(f"compiling {model_dir} for {engine.name} (cached in {out}) ...")
    text = calibration.read_text() if calibration else None
    compiled = compile_draft(model_dir, engine, calibration_text=text)
    compiled.save(out)
    return compiled
