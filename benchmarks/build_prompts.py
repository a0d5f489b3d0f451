"""Build the multi-task prompt set ``benchmarks/prompts/multitask.json`` offline.

Three tasks, each from text on the machine that nobody on this project wrote
(``benchmarks/prompts/SOURCES.md`` has the licences):

code
    Python functions from the **held-out split** of the CPython 3.11 standard library
    (the split ``scripts/train_demo_models.py`` makes, so the demo models never saw
    these files), excluding the files already in ``models/demo-data/heldout.txt`` (the
    tests' prompts). Each prompt is a ``def`` line and the lines after it.
prose
    Paragraphs of the README files Debian ships for zlib, zstd, libffi and libpng
    (``/usr/share/doc``), cut after a sentence.
dialogue
    Question-and-answer turns of the zlib FAQ (``/usr/share/doc/zlib1g-dev/FAQ.gz``):
    one answered question, then the next question and ``A:`` for the model to answer.

The result is deterministic for the same sources. Run it with the interpreter the demo
models were trained with (CPython 3.11.7)::

    python benchmarks/build_prompts.py [--per-task 8] [-o benchmarks/prompts/multitask.json]
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import importlib.util
import json
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOC = Path("/usr/share/doc")
PROSE_SOURCES = [  # (Debian package, README, licence of the excerpted text)
    ("zlib1g-dev", "README.gz", "Zlib"),
    ("zstd", "README.md.gz", "BSD-3-Clause (dual with GPL-2.0)"),
    ("libffi8", "README.md.gz", "MIT (Expat)"),
    ("libpng16-16", "README.gz", "libpng-2.0"),
]
FAQ = ("zlib1g-dev", "FAQ.gz", "Zlib")


def _training_script():
    """``scripts/train_demo_models.py`` as a module: its split is the one the models saw."""
    spec = importlib.util.spec_from_file_location("train_demo_models", ROOT / "scripts" / "train_demo_models.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _read(path: Path) -> str:
    data = path.read_bytes()
    return (gzip.decompress(data) if path.suffix == ".gz" else data).decode("utf-8")


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()[:16]


def _package_version(pkg: str) -> str:
    try:
        return subprocess.run(["dpkg-query", "-W", "-f", "${Version}", pkg], capture_output=True,
                              text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def code_prompts(per_task: int) -> tuple[list[dict], list[dict]]:
    """Function openings from held-out stdlib files, one per file, in path-hash order."""
    train = _training_script()
    root, rels = train.stdlib_files()
    _, heldout = train.split_files(rels, 50)
    _, in_heldout_txt = train.pick_excerpt(root, heldout)
    prompts, sources = [], []
    for rel in sorted(heldout, key=lambda r: (train.path_hash(r), r)):
        if rel in in_heldout_txt or rel.startswith("encodings/"):
            continue
        lines = (root / rel).read_text(encoding="utf-8").splitlines(keepends=True)
        defs = [i for i, line in enumerate(lines) if re.match(r"\s*def \w+\(", line)]
        if not defs:
            continue
        start = defs[len(defs) // 2]         # a function from the middle of the file
        end = start
        while end < len(lines) and (sum(map(len, lines[start:end])) < 240 or end - start < 3):
            end += 1
        text = "".join(lines[start:end])
        if len(text) > 600:                   # a long signature or docstring line: skip the file
            continue
        source = f"CPython {sys.version.split()[0]} Lib/{rel}, lines {start + 1}-{end} (held-out split)"
        prompts.append(dict(task="code", source=source, licence="PSF-2.0", text=text))
        sources.append(dict(path=f"Lib/{rel}", sha256=_sha(root / rel)))
        if len(prompts) == per_task:
            break
    return prompts, sources


def _paragraphs(text: str) -> list[str]:
    return [p for p in re.split(r"\n\s*\n", text) if p.strip()]


def _is_prose(par: str) -> bool:
    """A paragraph of running text: no tables, code, headings, link lists or banners."""
    lines = par.strip().splitlines()
    if any(line.startswith(("|", "#", "<", "[", "```", "    ", "\t", "*", "=", "-")) for line in lines):
        return False
    letters = sum(c.isalpha() or c.isspace() for c in par)
    return len(par) >= 200 and letters / len(par) > 0.9 and par.count(". ") >= 1


def _cut_after_sentence(par: str, at_least: int = 140) -> str:
    """The paragraph up to the first sentence end past ``at_least`` characters."""
    for m in re.finditer(r"[.!?](?=\s)", par):
        if m.end() >= at_least and m.end() < len(par.rstrip()) - 20:
            return par[:m.end()]
    return par.rstrip()


def prose_prompts(per_task: int) -> tuple[list[dict], list[dict]]:
    """Prose paragraphs from README files, taken in turn from each package."""
    pools, sources = [], []
    for pkg, name, licence in PROSE_SOURCES:
        path = DOC / pkg / name
        pars = [p.strip("\n") for p in _paragraphs(_read(path)) if _is_prose(p)]
        src = f"{path} (Debian {pkg} {_package_version(pkg)})"
        pools.append([dict(task="prose", source=src, licence=licence, text=_cut_after_sentence(p))
                      for p in pars])
        sources.append(dict(path=str(path), package=pkg, version=_package_version(pkg), sha256=_sha(path)))
    prompts = []
    while len(prompts) < per_task and any(pools):
        for pool in pools:
            if pool and len(prompts) < per_task:
                prompts.append(pool.pop(0))
    return prompts, sources


def _faq_entries(text: str) -> list[tuple[str, str]]:
    """(question, first answer paragraph) of a numbered FAQ, whitespace collapsed."""
    entries = []
    for m in re.finditer(r"^ ?\d+\. (.+?)\n\n(.+?)(?=\n\n|\Z)", text, re.S | re.M):
        question = " ".join(m.group(1).split())
        answer = " ".join(m.group(2).split())
        entries.append((question, answer))
    return entries


def dialogue_prompts(per_task: int) -> tuple[list[dict], list[dict]]:
    """One answered FAQ question, then the next question for the model to answer."""
    pkg, name, licence = FAQ
    path = DOC / pkg / name
    # Answers that end in ':' introduce a code or link block the prompt would cut off.
    entries = [(q, a) for q, a in _faq_entries(_read(path)) if 40 <= len(a) <= 400 and not a.endswith(":")]
    step = max(1, (len(entries) - 1) // per_task)
    prompts = []
    for i in range(0, len(entries) - 1, step)[:per_task]:
        (q1, a1), (q2, _) = entries[i], entries[i + 1]
        prompts.append(dict(task="dialogue", licence=licence,
                            source=f"{path} (Debian {pkg} {_package_version(pkg)}), Q&A reformatted",
                            text=f"Q: {q1}\nA: {a1}\n\nQ: {q2}\nA:"))
    return prompts, [dict(path=str(path), package=pkg, version=_package_version(pkg), sha256=_sha(path))]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--per-task", type=int, default=8)
    ap.add_argument("-o", "--output", default=str(ROOT / "benchmarks" / "prompts" / "multitask.json"))
    args = ap.parse_args(argv)
    prompts, sources = [], {}
    for task, build in (("code", code_prompts), ("prose", prose_prompts), ("dialogue", dialogue_prompts)):
        got, src = build(args.per_task)
        if len(got) < args.per_task:
            print(f"build_prompts: only {len(got)} {task} prompts found", file=sys.stderr)
            return 1
        prompts += got
        sources[task] = src
    out = dict(description="DFVG multi-task prompt set: code, prose documentation, dialogue-like Q&A. "
                           "Built by benchmarks/build_prompts.py; provenance in benchmarks/prompts/SOURCES.md.",
               python=sys.version.split()[0], sources=sources, prompts=prompts)
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text(json.dumps(out, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    print(f"wrote {len(prompts)} prompts to {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
