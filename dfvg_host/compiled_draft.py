"""A compiled draft on disk: ``image.bin``, ``program.bin``, ``program.s`` and
``manifest.json``, checked when loaded.

The manifest records the format, the image and engine versions the draft was compiled
for, and each binary file's size and SHA-256. :meth:`CompiledDraft.load` checks all of
them before anything reaches a device, so a truncated, corrupted or hand-edited compile
output is a :class:`CompiledDraftError` that names the file and says what to do, never a
fault deep inside the engine.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, fields
from pathlib import Path

from dfvg_hw.spec.image import IMAGE_VERSION
from dfvg_hw.spec.isa import INSTRUCTION_BITS, disassemble, from_bytes, to_bytes
from dfvg_hw.spec.regmap import ENGINE_VERSION

__all__ = ["CompiledDraft", "CompiledDraftError", "ModelShape", "TreeProgram", "MANIFEST_FORMAT", "MANIFEST_KEYS"]

#: The manifest layout this host reads and writes; 2 added the versions and checksums.
MANIFEST_FORMAT = 2

#: Keys every manifest has, with the JSON types their values have.
MANIFEST_KEYS = {"format": int, "image_version": int, "engine_version": int, "engine": dict,
                 "model": dict, "model_dir": str, "context_limit": int, "image_bytes": int,
                 "program_words": int, "files": dict}

_INSTRUCTION_BYTES = INSTRUCTION_BITS // 8
_RECOMPILE = "recompile the draft with `dfvg compile`"


class CompiledDraftError(ValueError):
    """A compile output that cannot be used as it is; the message names the file."""


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


@dataclass(frozen=True)
class ModelShape:
    """What the compiler needs to know of a draft (the manifest's ``model``): a decoder of
    a supported family (``model_type`` llama, qwen2, qwen3 or opt, :mod:`dfvg_host.families`)."""
    model_type: str
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    max_positions: int
    rms_norm_eps: float
    hidden_act: str
    tied_embeddings: bool

    @property
    def qkv_out(self) -> int:
        return (self.heads + 2 * self.kv_heads) * self.head_dim

    @property
    def rope(self) -> bool:
        """Whether positions are rotary (else a learned table: OPT)."""
        from dfvg_host.families import layout_of
        return layout_of(self.model_type).rope

    @property
    def qk_norm(self) -> bool:
        """Whether q and k are normalised per head before RoPE (Qwen3)."""
        from dfvg_host.families import layout_of
        return layout_of(self.model_type).qk_norm

    @property
    def qk_out(self) -> int:
        """Channels of q and k together (the QK-norm's int32 row)."""
        return (self.heads + self.kv_heads) * self.head_dim

    def describe(self) -> str:
        return (f"{self.model_type}: {self.layers} layers, hidden {self.hidden}, {self.heads} heads "
                f"({self.kv_heads} KV) x {self.head_dim}, intermediate {self.intermediate}, "
                f"vocab {self.vocab}")


@dataclass
class CompiledDraft:
    """A compiled draft: the image, the program and what the host needs to drive them.

    Members
    -------
    image : bytes
        The weights image, DMA'd to the device as it is.
    program : list of int
        The instruction words.
    manifest : dict
        The engine configuration, the model shape, the context limit, the layout and the
        scales; :data:`MANIFEST_KEYS` lists the keys every manifest has.
    """
    image: bytes
    program: list[int]
    manifest: dict

    def save(self, out_dir: str | Path) -> Path:
        """Write the four files into ``out_dir``; the manifest gets the binaries' sizes and
        checksums."""
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        program = to_bytes(self.program)
        self.manifest.update(format=MANIFEST_FORMAT, image_version=IMAGE_VERSION,
                             engine_version=ENGINE_VERSION,
                             files={"image.bin": dict(bytes=len(self.image), sha256=_sha256(self.image)),
                                    "program.bin": dict(bytes=len(program), sha256=_sha256(program))})
        (out / "image.bin").write_bytes(self.image)
        (out / "program.bin").write_bytes(program)
        (out / "program.s").write_text(
            f"; DFVG draft program for preset {self.manifest['engine']['name']}\n"
            f"; model: {self.manifest['model_dir']}\n" + disassemble(self.program))
        (out / "manifest.json").write_text(json.dumps(self.manifest, indent=2) + "\n")
        return out

    @classmethod
    def load(cls, out_dir: str | Path) -> "CompiledDraft":
        """Read and check a compile output; a :class:`CompiledDraftError` names what is wrong."""
        out = Path(out_dir)
        manifest = _read_manifest(out / "manifest.json")
        blobs = {name: _read_checked(out / name, manifest["files"]) for name in ("image.bin", "program.bin")}
        image, program = blobs["image.bin"], blobs["program.bin"]
        if len(image) != manifest["image_bytes"] or len(program) != manifest["program_words"] * _INSTRUCTION_BYTES:
            raise CompiledDraftError(f"{out / 'manifest.json'} disagrees with its own file list "
                                     f"(image_bytes, program_words); {_RECOMPILE}")
        return cls(image, from_bytes(program), manifest)

    @staticmethod
    def is_complete(out_dir: Path) -> bool:
        """Whether ``out_dir`` holds a compile output that :meth:`load` accepts."""
        try:
            CompiledDraft.load(out_dir)
        except (CompiledDraftError, OSError):
            return False
        return True

    @property
    def shape(self) -> ModelShape:
        return ModelShape(**self.manifest["model"])

    @property
    def vocabulary(self) -> "DraftVocabulary | None":
        """The tokens the engine drafts over when it holds fewer than the model's
        (``dfvg compile --draft-vocab``), else None."""
        from dfvg_host.draft_vocab import DraftVocabulary
        entry = self.manifest.get("draft_vocab")
        return None if entry is None else DraftVocabulary.from_dict(entry)

    @property
    def context_limit(self) -> int:
        return self.manifest["context_limit"]

    @property
    def tree(self) -> "TreeProgram":
        """The program's tree forward (docs/isa.md §9.2); width 0 when it has none (a
        preset of one row, a VMEM too small for two, or a draft compiled before trees)."""
        return TreeProgram(**self.manifest.get("tree", dict(width=0, pc=0, row_pitch=0)))


@dataclass(frozen=True)
class TreeProgram:
    """Where a compiled program drafts trees.

    Members
    -------
    width : int
        Rows of its tree forward: the width of every tree it drafts (0: none).
    pc : int
        The tree forward's first instruction (the request's ``tree_pc``).
    row_pitch : int
        VMEM lines between the rows of a tree forward (the request's ``row_pitch``).
    """
    width: int
    pc: int
    row_pitch: int


def _read_manifest(path: Path) -> dict:
    if not path.is_file():
        raise CompiledDraftError(f"{path} does not exist: pass the output directory of `dfvg compile`")
    try:
        manifest = json.loads(path.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CompiledDraftError(f"{path} is not valid JSON ({exc}); the compile output is damaged: "
                                 f"{_RECOMPILE}") from None
    if not isinstance(manifest, dict):
        raise CompiledDraftError(f"{path} is not a JSON object; {_RECOMPILE}")
    if manifest.get("format") != MANIFEST_FORMAT:
        raise CompiledDraftError(f"{path} has manifest format {manifest.get('format')!r}, this dfvg reads "
                                 f"format {MANIFEST_FORMAT}; {_RECOMPILE}")
    missing = [k for k in MANIFEST_KEYS if k not in manifest]
    if missing:
        raise CompiledDraftError(f"{path} lacks {', '.join(missing)}; {_RECOMPILE}")
    wrong = [k for k, kind in MANIFEST_KEYS.items()
             if not isinstance(manifest[k], kind) or (kind is int and isinstance(manifest[k], bool))]
    if wrong:
        raise CompiledDraftError(f"{path}: {', '.join(wrong)} must be "
                                 f"{', '.join(MANIFEST_KEYS[k].__name__ for k in wrong)}; {_RECOMPILE}")
    if set(manifest["model"]) != {f.name for f in fields(ModelShape)}:
        raise CompiledDraftError(f"{path}: the model entry has the keys {sorted(manifest['model'])}, "
                                 f"not those of a model shape; {_RECOMPILE}")
    if manifest["image_version"] != IMAGE_VERSION or manifest["engine_version"] >> 16 != ENGINE_VERSION >> 16:
        raise CompiledDraftError(f"{path.parent} was compiled for image version {manifest['image_version']}, "
                                 f"this dfvg builds version {IMAGE_VERSION}; {_RECOMPILE}")
    return manifest


def _read_checked(path: Path, files: dict) -> bytes:
    """The bytes of ``path`` if its size and SHA-256 are those the manifest records."""
    entry = files.get(path.name)
    if not isinstance(entry, dict) or not {"bytes", "sha256"} <= entry.keys():
        raise CompiledDraftError(f"{path.parent / 'manifest.json'} records no size and checksum for "
                                 f"{path.name}; {_RECOMPILE}")
    if not path.is_file():
        raise CompiledDraftError(f"{path} is missing; {_RECOMPILE}")
    data = path.read_bytes()
    if len(data) != entry["bytes"]:
        raise CompiledDraftError(f"{path} has {len(data)} bytes, the manifest records {entry['bytes']}: "
                                 f"the file is truncated or was replaced; {_RECOMPILE}")
    if _sha256(data) != entry["sha256"]:
        raise CompiledDraftError(f"{path} does not match the SHA-256 the manifest records: the file is "
                                 f"corrupt; {_RECOMPILE}")
    return data
