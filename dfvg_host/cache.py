"""The on-disk cache under ``~/.cache/dfvg`` (``$XDG_CACHE_HOME/dfvg``): where it is, the
fingerprint that keys a compiled draft, and writes that are safe when several processes
(pytest-xdist workers, two ``dfvg`` commands) fill the same entry at once.

An entry is either complete or absent: a directory is built under a temporary name and
renamed into place, a file is written to a temporary name and replaced into place, and
building one entry is serialised by a lock file so that concurrent processes build it once.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import secrets
import shutil
from pathlib import Path
from typing import Callable, Iterator

from dfvg_hw.spec.config import EngineConfig

__all__ = ["REPO_ROOT", "cache_dir", "fingerprint", "locked", "build_dir_once", "write_text_atomic"]

REPO_ROOT = Path(__file__).resolve().parent.parent


def cache_dir() -> Path:
    """``$XDG_CACHE_HOME/dfvg``, by default ``~/.cache/dfvg`` (not created here)."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "dfvg"


def calibration_files(calibration: Path | tuple[Path, ...] | None) -> tuple[Path, ...]:
    """The calibration text files, in order: one path, several, or none."""
    if calibration is None:
        return ()
    return (calibration,) if isinstance(calibration, Path) else tuple(calibration)


def calibration_text(calibration: Path | tuple[Path, ...] | None) -> str | None:
    """The calibration files' texts joined by blank lines; None without files."""
    files = calibration_files(calibration)
    return "\n\n".join(f.read_text() for f in files) if files else None


def fingerprint(model_dir: Path, calibration: Path | tuple[Path, ...] | None, engine: EngineConfig,
                tokenizer_dir: Path | None = None) -> str:
    """16 hex digits over what a compiled draft depends on: the model's config and weights,
    the calibration text and the tokenizer that reads it, the engine configuration and the
    compiler's own sources."""
    h = hashlib.sha256()
    files = sorted(model_dir.glob("*.json")) + sorted(model_dir.glob("*.safetensors"))
    if tokenizer_dir is not None and Path(tokenizer_dir).resolve() != model_dir.resolve():
        files += sorted(Path(tokenizer_dir).glob("*.json"))
    for f in files:
        h.update(f.name.encode())
        h.update(f.read_bytes())
    for text_file in calibration_files(calibration):
        h.update(text_file.read_bytes())
    h.update(repr(sorted(engine.to_dict().items())).encode())
    # The compiler's own sources: a changed compiler must not reuse an old image. The
    # contract modules (dfvg_hw/spec: ISA, image layout, numerics) are part of it.
    for mod in sorted((REPO_ROOT / "dfvg_hw").rglob("*.py")) + [
            Path(__file__).with_name(name)
            for name in ("compiler.py", "compiled_draft.py", "families.py", "draft_vocab.py", "qk_balance.py")]:
        h.update(mod.read_bytes())
    return h.hexdigest()[:16]


@contextlib.contextmanager
def locked(path: Path) -> Iterator[None]:
    """Hold an exclusive lock on ``<path>.lock`` (created with its parent) for the block."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_name(path.name + ".lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def build_dir_once(out: Path, build: Callable[[Path], object], *,
                   complete: Callable[[Path], bool] = Path.is_dir) -> bool:
    """Make directory ``out`` by ``build(tmp)`` unless it is ``complete``; True when this
    call built it.

    ``build`` fills a temporary sibling directory, which is renamed to ``out`` only once it
    is complete, so a reader that sees ``out`` sees all of it. Concurrent callers take
    turns on a lock; the later ones find ``out`` and build nothing. An incomplete ``out``
    (left by a writer that was not atomic) is replaced.
    """
    if complete(out):
        return False
    with locked(out):
        if complete(out):
            return False
        tmp = _temporary_name(out)
        tmp.mkdir()                     # (mkdtemp would make it private to this user)
        try:
            build(tmp)
            if out.exists():
                shutil.rmtree(out)
            os.rename(tmp, out)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return True


def _temporary_name(path: Path) -> Path:
    """A hidden sibling of ``path`` that no other process picks."""
    return path.with_name(f".{path.name}.{os.getpid()}-{secrets.token_hex(4)}.tmp")


def write_text_atomic(path: Path, text: str) -> None:
    """Write ``path`` so that readers see the old content or the new, never a part."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = _temporary_name(path)
    try:
        with open(tmp, "x") as f:      # (mkstemp would make it private to this user)
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
