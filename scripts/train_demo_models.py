#!/usr/bin/env python3
"""Train the small demo target/draft model pair used by DFVG, fully offline.

The corpus is the Python standard library's own ``.py`` sources (PSF license),
found through ``sysconfig``; nothing is downloaded.  The script produces:

* a byte-level BPE tokenizer (vocab 4096) saved in Hugging Face format;
* ``demo-target``: a ~7 M parameter ``LlamaForCausalLM`` trained on the data;
* ``demo-draft``: a ~0.9 M parameter ``LlamaForCausalLM`` distilled from the
  target (KL to the target's softened logits mixed with data cross-entropy);
* ``demo-data/``: calibration / held-out text excerpts, their provenance, and
  an evaluation report (``REPORT.md`` and ``report.json``).

Example (the configuration used for the committed models)::

    python scripts/train_demo_models.py --seed 0

Everything is seeded and the data order is deterministic, so a rerun with the
same seed, library versions and thread count reproduces the same models.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import platform
import random
import shlex
import sys
import sysconfig
import time
from pathlib import Path

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Idle OpenMP threads sleep instead of spinning: on a shared 2-core machine,
# spinning threads make training ~3x slower as soon as another process runs.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import transformers  # noqa: E402
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers  # noqa: E402
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast  # noqa: E402

SPECIAL_TOKENS = ["<s>", "</s>", "<unk>", "<pad>"]  # ids 0, 1, 2, 3
BOS_ID, EOS_ID, UNK_ID, PAD_ID = 0, 1, 2, 3
EXCLUDED_PARTS = {"test", "tests", "idlelib", "site-packages", "__pycache__"}
TEXT_BUDGET = 60_000  # bytes per demo-data text file (limit is 64 KiB)


# --------------------------------------------------------------------------- data


def stdlib_files() -> tuple[Path, list[str]]:
    """Return the stdlib root and the sorted relative paths of its ``.py`` files.

    Test suites (``test/``, ``tests/``, e.g. ``lib2to3/tests``), ``idlelib/`` and
    ``site-packages/`` are excluded, as are files that are not valid UTF-8.
    """
    root = Path(sysconfig.get_paths()["stdlib"]).resolve()
    rels = []
    for path in root.rglob("*.py"):
        rel = path.relative_to(root)
        if EXCLUDED_PARTS.intersection(rel.parts[:-1]):
            continue
        try:
            path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        rels.append(rel.as_posix())
    return root, sorted(rels)


def path_hash(rel: str) -> int:
    """Stable 32-bit hash of a relative path (independent of PYTHONHASHSEED)."""
    return int.from_bytes(hashlib.sha256(rel.encode("utf-8")).digest()[:4], "big")


def split_files(rels: list[str], heldout_permille: int) -> tuple[list[str], list[str]]:
    """Deterministically split files into (train, heldout) by hashing their path."""
    train = [r for r in rels if path_hash(r) % 1000 >= heldout_permille]
    heldout = [r for r in rels if path_hash(r) % 1000 < heldout_permille]
    return train, heldout


def pick_excerpt(root: Path, rels: list[str], budget: int = TEXT_BUDGET) -> tuple[str, list[str]]:
    """Concatenate whole files (verbatim) from ``rels`` until ``budget`` bytes.

    Files are visited in path-hash order (deterministic but spread over the
    library); files that do not fit in the remaining budget are skipped, as are
    the generated codec tables under ``encodings/`` (not representative code).
    """
    text, used, chosen = "", 0, []
    for rel in sorted(rels, key=lambda r: (path_hash(r), r)):
        if rel.startswith("encodings/"):
            continue
        body = (root / rel).read_text(encoding="utf-8")
        size = len(body.encode("utf-8"))
        if size < 1_000 or used + size > budget:
            continue
        text += body
        used += size
        chosen.append(rel)
        if budget - used < 2_000:
            break
    return text, chosen


# --------------------------------------------------------------------------- tokenizer


def train_tokenizer(root: Path, rels: list[str], vocab_size: int) -> PreTrainedTokenizerFast:
    """Train a byte-level BPE tokenizer on the given files.

    Special tokens take ids 0..3 (``<s>``, ``</s>``, ``<unk>``, ``<pad>``); the
    post-processor prepends ``<s>`` to every encoded sequence, like Llama.
    """
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(((root / r).read_text(encoding="utf-8") for r in rels), trainer)
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", BOS_ID)]
    )
    for i, name in enumerate(SPECIAL_TOKENS):
        assert tok.token_to_id(name) == i, (name, tok.token_to_id(name))
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        pad_token="<pad>",
        model_max_length=1024,
    )


def save_tokenizer(tokenizer: PreTrainedTokenizerFast, out_dir: Path) -> None:
    """Save the tokenizer files (tokenizer.json, tokenizer_config.json, special_tokens_map.json)."""
    tokenizer.save_pretrained(out_dir)
    cfg_path = out_dir / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["tokenizer_class"] = "PreTrainedTokenizerFast"  # portable across transformers 4.x / 5.x
    cfg["model_max_length"] = 1024
    cfg["add_bos_token"] = True
    cfg["add_eos_token"] = False
    cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    smap = {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "pad_token": "<pad>"}
    (out_dir / "special_tokens_map.json").write_text(json.dumps(smap, indent=2) + "\n")


def encode_files(tokenizer, root: Path, rels: list[str]) -> torch.Tensor:
    """Tokenize files (``<s>`` doc ``</s>`` each) and concatenate them into one 1-D stream."""
    texts = [(root / r).read_text(encoding="utf-8") for r in rels]
    ids = tokenizer(texts, add_special_tokens=True, verbose=False)["input_ids"]
    stream = np.fromiter((t for doc in ids for t in doc + [EOS_ID]), dtype=np.int64)
    return torch.from_numpy(stream)


def chunk(stream: torch.Tensor, seq_len: int) -> torch.Tensor:
    """Cut a token stream into non-overlapping rows of ``seq_len`` tokens (tail dropped)."""
    n = stream.numel() // seq_len
    return stream[: n * seq_len].view(n, seq_len)


def batches(rows: torch.Tensor, batch_size: int, steps: int, seed: int):
    """Yield ``steps`` batches, reshuffling rows each epoch with a seeded generator."""
    gen = torch.Generator().manual_seed(seed)
    order, pos = torch.randperm(rows.shape[0], generator=gen), 0
    for _ in range(steps):
        if pos + batch_size > order.numel():
            order, pos = torch.randperm(rows.shape[0], generator=gen), 0
        yield rows[order[pos : pos + batch_size]]
        pos += batch_size


# --------------------------------------------------------------------------- models


def make_config(kind: str, vocab_size: int) -> LlamaConfig:
    """Llama configuration for the ``target`` or ``draft`` model."""
    common = dict(
        vocab_size=vocab_size,
        max_position_embeddings=1024,
        rope_theta=10000.0,
        rms_norm_eps=1e-5,
        hidden_act="silu",
        initializer_range=0.02,
        attention_bias=False,
        mlp_bias=False,
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
        pad_token_id=PAD_ID,
        use_cache=True,
    )
    if kind == "target":
        return LlamaConfig(
            hidden_size=256, num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=4,
            head_dim=64, intermediate_size=704, tie_word_embeddings=False, **common,
        )
    if kind == "draft":
        return LlamaConfig(
            hidden_size=128, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
            head_dim=64, intermediate_size=352, tie_word_embeddings=True, **common,
        )
    if kind == "draft-small":
        # A second drafter for voting (issue #19): one layer, so it drafts in about half
        # the engine time of demo-draft and disagrees with it where its depth matters.
        return LlamaConfig(
            hidden_size=128, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2,
            head_dim=64, intermediate_size=352, tie_word_embeddings=True, **common,
        )
    if kind == "draft-qwen2":
        # Qwen2's draft features (issue #17): biases on q, k and v, GQA, tied embeddings.
        return transformers.Qwen2Config(
            hidden_size=128, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
            intermediate_size=352, tie_word_embeddings=True, use_sliding_window=False,
            **{k: v for k, v in common.items() if k not in ("attention_bias", "mlp_bias")},
        )
    if kind == "draft-qwen3":
        # Qwen3's: RMSNorm of q and k per head (QK-norm), GQA, tied embeddings, and
        # heads × head_dim (4 × 64) wider than hidden (128), as in Qwen3-0.6B (16 × 128 > 1024).
        return transformers.Qwen3Config(
            hidden_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            head_dim=64, intermediate_size=352, tie_word_embeddings=True, use_sliding_window=False,
            **{k: v for k, v in common.items() if k != "mlp_bias"},
        )
    if kind == "draft-opt":
        # OPT's (issue #17): LayerNorm with biases, biases on every linear layer, an ungated
        # ReLU MLP, learned position embeddings.
        return transformers.OPTConfig(
            hidden_size=128, num_hidden_layers=2, num_attention_heads=2, ffn_dim=352,
            word_embed_proj_dim=128, max_position_embeddings=1024, tie_word_embeddings=True,
            do_layer_norm_before=True, activation_function="relu", vocab_size=vocab_size,
            bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=PAD_ID,
        )
    raise ValueError(kind)


def new_model(config) -> torch.nn.Module:
    """A freshly initialised causal LM of ``config``'s family."""
    return transformers.AutoModelForCausalLM.from_config(config)


def n_params(model: torch.nn.Module) -> int:
    """Number of distinct parameters (tied weights counted once)."""
    return sum(p.numel() for p in model.parameters())


def lr_at(step: int, total: int, peak: float, warmup: int, min_ratio: float = 0.1) -> float:
    """Linear warm-up followed by cosine decay to ``min_ratio * peak``."""
    if step < warmup:
        return peak * (step + 1) / warmup
    t = (step - warmup) / max(1, total - warmup)
    return peak * (min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * min(1.0, t))))


def make_optimizer(model: torch.nn.Module, lr: float, weight_decay: float) -> torch.optim.AdamW:
    """AdamW with weight decay on matrices only (not on norms)."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95), eps=1e-8)


def train_loop(name, model, rows, args, steps, lr, loss_fn, seed) -> dict:
    """Generic training loop with AdamW, cosine schedule, grad clipping and progress logs.

    ``loss_fn(model, batch)`` returns ``(loss, extras)``; ``extras`` are logged.
    Weights and optimizer state stay float32; with ``args.bf16`` the forward
    pass runs under CPU bfloat16 autocast (about 1.6x faster here).
    """
    model.train()
    opt = make_optimizer(model, lr, args.weight_decay)
    warmup = min(args.warmup, max(1, steps // 10))
    t0 = time.time()
    tokens, window_tokens, window_t = 0, 0, time.time()
    last = float("nan")
    for step, batch in enumerate(batches(rows, args.batch_size, steps, seed)):
        for g in opt.param_groups:
            g["lr"] = lr_at(step, steps, lr, warmup)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.bf16):
            loss, extras = loss_fn(model, batch)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        last = loss.item()
        tokens += batch.numel()
        window_tokens += batch.numel()
        if (step + 1) % args.log_every == 0 or step + 1 == steps:
            now = time.time()
            print(
                f"[{name}] step {step + 1:5d}/{steps} loss {last:.4f} lr {opt.param_groups[0]['lr']:.2e} "
                + "".join(f"{k} {v:.4f} " for k, v in extras.items())
                + f"tok/s {window_tokens / (now - window_t):7.0f} elapsed {now - t0:7.1f}s",
                flush=True,
            )
            window_tokens, window_t = 0, now
    model.eval()
    return {"steps": steps, "tokens": tokens, "seconds": round(time.time() - t0, 1), "final_loss": last}


def lm_loss(model, batch: torch.Tensor):
    """Next-token cross-entropy on a batch of token rows."""
    return model(input_ids=batch, labels=batch).loss, {}


def distill_loss_fn(teacher, temperature: float, alpha: float):
    """Distillation loss ``alpha * T^2 * KL(teacher_T || student_T) + (1 - alpha) * CE(data)``.

    The KL term is computed as a soft-target cross-entropy (it differs from the
    KL only by the teacher's entropy, a constant for the student, so gradients
    are identical).  For ``T == 1`` both terms are fused into a single
    cross-entropy against the mixed target ``alpha * p_teacher + (1 - alpha) *
    onehot(data)``.  Logged extras: the batch's top-1 agreement with the
    teacher and the KL itself (first row of the batch).
    """

    def fn(student, batch: torch.Tensor):
        labels = batch[:, 1:].reshape(-1)
        with torch.no_grad():
            t_logits = teacher(input_ids=batch).logits[:, :-1].float()
            t_logits = t_logits.reshape(-1, t_logits.shape[-1])
            t_prob = F.softmax(t_logits / temperature, dim=-1)
        s_logits = student(input_ids=batch).logits[:, :-1].float()
        s_logits = s_logits.reshape(-1, s_logits.shape[-1])
        if temperature == 1.0:
            mixed = alpha * t_prob
            mixed[torch.arange(labels.numel()), labels] += 1.0 - alpha
            loss = F.cross_entropy(s_logits, mixed)
        else:
            soft = F.cross_entropy(s_logits / temperature, t_prob) * temperature**2
            loss = alpha * soft + (1.0 - alpha) * F.cross_entropy(s_logits, labels)
        with torch.no_grad():
            agree = (s_logits.argmax(-1) == t_logits.argmax(-1)).float().mean().item()
            n = batch.shape[1] - 1  # KL on the first row only, to keep logging cheap
            s_logp = F.log_softmax(s_logits[:n] / temperature, dim=-1)
            kl = (t_prob[:n] * (torch.log(t_prob[:n].clamp_min(1e-30)) - s_logp)).sum(-1).mean().item()
        return loss, {"kl": kl, "agree": agree}

    return fn


# --------------------------------------------------------------------------- evaluation


@torch.no_grad()
def evaluate(target, draft, rows: torch.Tensor, batch_size: int = 16) -> dict:
    """Held-out perplexities and teacher-forced greedy top-1 agreement.

    Agreement is the fraction of positions where ``argmax(draft logits) ==
    argmax(target logits)`` given the same (ground-truth) prefix.
    """
    nll_t = nll_d = 0.0
    agree = count = 0
    for i in range(0, rows.shape[0], batch_size):
        batch = rows[i : i + batch_size]
        lt = target(input_ids=batch).logits[:, :-1].float()
        ld = draft(input_ids=batch).logits[:, :-1].float()
        labels = batch[:, 1:]
        nll_t += F.cross_entropy(lt.reshape(-1, lt.shape[-1]), labels.reshape(-1), reduction="sum").item()
        nll_d += F.cross_entropy(ld.reshape(-1, ld.shape[-1]), labels.reshape(-1), reduction="sum").item()
        agree += (lt.argmax(-1) == ld.argmax(-1)).sum().item()
        count += labels.numel()
    return {
        "positions": count,
        "target_ppl": round(math.exp(nll_t / count), 3),
        "draft_ppl": round(math.exp(nll_d / count), 3),
        "top1_agreement": round(agree / count, 4),
    }


def write_report(out: Path, report: dict) -> str:
    """Write ``report.json`` and a human-readable ``REPORT.md``; return the markdown."""
    (out / "demo-data" / "report.json").write_text(json.dumps(report, indent=2) + "\n")
    p, h, x, tr = report["params"], report["eval_heldout_split"], report["eval_heldout_txt"], report["training"]
    md = f"""# DFVG demo models: training report

Generated by `scripts/train_demo_models.py`.

Command: `{report['command']}`

- seed: {report['seed']}
- wall time: {report['wall_time_s']:.0f} s ({report['wall_time_s'] / 60:.1f} min) on {report['env']['threads']} CPU threads
- environment: Python {report['env']['python']}, torch {report['env']['torch']}, transformers {report['env']['transformers']}, tokenizers {report['env']['tokenizers']}
- corpus: Python {report['data']['python_version']} standard library `.py` sources; {report['data']['train_files']} train files ({report['data']['train_tokens']:,} tokens), {report['data']['heldout_files']} held-out files ({report['data']['heldout_tokens']:,} tokens), context {report['data']['seq_len']}
- tokenizer: byte-level BPE, vocab {report['tokenizer']['vocab_size']}, special ids {report['tokenizer']['special_ids']}

| model | parameters | layers x hidden | training | steps | final train loss* |
|---|---:|---|---|---:|---:|
| demo-target | {p['target']:,} | 6 x 256 | LM cross-entropy | {tr['target']['steps']} | {tr['target']['final_loss']:.4f} |
| demo-draft | {p['draft']:,} | 2 x 128 | distillation (T={report['distill']['temperature']}, alpha={report['distill']['alpha']}) | {tr['draft']['steps']} | {tr['draft']['final_loss']:.4f} |

\* target: data cross-entropy; draft: mixed soft-target cross-entropy (includes the teacher's entropy).
Training used AdamW (betas 0.9/0.95, weight decay {report['args']['weight_decay']}), linear warm-up + cosine decay,
batch {report['args']['batch_size']} x {report['data']['seq_len']} tokens, peak lr {report['args']['target_lr']} (target) / {report['args']['draft_lr']} (draft),
bfloat16 autocast: {report['args']['bf16']}.

Target/draft parameter ratio: {p['target'] / p['draft']:.1f}x

## Held-out evaluation (teacher-forced, context {report['data']['seq_len']})

| eval set | positions | target ppl | draft ppl | draft/target top-1 agreement |
|---|---:|---:|---:|---:|
| held-out split | {h['positions']:,} | {h['target_ppl']:.3f} | {h['draft_ppl']:.3f} | {h['top1_agreement']:.4f} |
| `heldout.txt` | {x['positions']:,} | {x['target_ppl']:.3f} | {x['draft_ppl']:.3f} | {x['top1_agreement']:.4f} |

Agreement = fraction of positions where argmax(draft logits) == argmax(target logits).
"""
    (out / "demo-data" / "REPORT.md").write_text(md)
    return md


def write_sources(out: Path, root: Path, calib: list[str], held: list[str], n_train: int, n_held: int) -> None:
    """Write ``SOURCES.md`` describing where the demo texts came from."""

    def listing(rels):
        lines = []
        for r in rels:
            data = (root / r).read_bytes()
            lines.append(f"- `Lib/{r}` ({len(data):,} bytes, sha256 `{hashlib.sha256(data).hexdigest()[:16]}`)")
        return "\n".join(lines)

    md = f"""# Sources of the demo data

All text in this directory and all training data for `demo-target` / `demo-draft`
comes from the **Python standard library sources** (CPython {platform.python_version()},
`{sys.implementation.cache_tag}`), distributed under the Python Software Foundation
License (PSF License Agreement, https://docs.python.org/3/license.html).
Copyright (c) 2001-present Python Software Foundation; all rights reserved.

The corpus is every `.py` file under `sysconfig.get_paths()["stdlib"]`, excluding
`test/` and `tests/` directories (including `lib2to3/tests`), `idlelib/` and
`site-packages/`, sorted by path. Files are split by a stable hash of their
relative path: `int(sha256(path)[:4 bytes]) % 1000 < 50` goes to the held-out
split ({n_held} files), the rest to the training split ({n_train} files).

Each text file below is the verbatim concatenation, in the listed order, of
whole source files (no separators added), picked deterministically in path-hash
order (skipping generated `encodings/` codec tables) up to {TEXT_BUDGET:,} bytes.

## calibration.txt (training split)

{listing(calib)}

## heldout.txt (held-out split)

{listing(held)}
"""
    (out / "demo-data" / "SOURCES.md").write_text(md)


# --------------------------------------------------------------------------- main


def seed_everything(seed: int) -> None:
    """Seed Python, NumPy and torch, and request deterministic kernels."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    torch.use_deterministic_algorithms(True, warn_only=True)


def save_model(model, tokenizer, out_dir: Path, dtype: torch.dtype) -> None:
    """Save a model (safetensors) with generation config and tokenizer files."""
    model = model.to(dtype)
    model.config.use_cache = True
    model.generation_config = GenerationConfig(
        bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=PAD_ID, do_sample=False
    )
    model.save_pretrained(out_dir, safe_serialization=True)
    save_tokenizer(tokenizer, out_dir)
    model.to(torch.float32)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=Path("models"), help="output directory (default: models/)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--target-steps", type=int, default=1000)
    p.add_argument("--draft-steps", type=int, default=1200)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--target-lr", type=float, default=1.5e-3)
    p.add_argument("--draft-lr", type=float, default=3e-3)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--warmup", type=int, default=100)
    p.add_argument("--temperature", type=float, default=1.0, help="distillation softmax temperature")
    p.add_argument("--alpha", type=float, default=0.9, help="weight of the KL term (1-alpha on data CE)")
    p.add_argument("--vocab-size", type=int, default=4096)
    p.add_argument("--heldout-permille", type=int, default=50, help="held-out files per 1000 (default 5%%)")
    p.add_argument("--eval-rows", type=int, default=64, help="max held-out rows of --seq-len for evaluation")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--log-every", type=int, default=25)
    p.add_argument("--no-bf16", dest="bf16", action="store_false", help="train in plain float32 (slower)")
    p.add_argument("--target-dtype", choices=["float32", "bfloat16"], default="float32")
    p.add_argument("--drafter", metavar="NAME", help="train only one more drafter into OUT/NAME, "
                   "distilled from the existing OUT/demo-target (e.g. demo-draft-small)")
    p.add_argument("--drafter-shape", choices=["draft", "draft-small", "draft-qwen2", "draft-qwen3", "draft-opt"],
                   default="draft-small",
                   help="the extra drafter's shape (with --drafter)")
    return p.parse_args(argv)


def train_extra_drafter(args) -> dict:
    """Distil one more drafter from the committed ``demo-target`` (its tokenizer and its
    training split), into ``args.out / args.drafter``, with a ``TRAINING.md`` report."""
    t_start = time.time()
    torch.set_num_threads(args.threads)
    seed_everything(args.seed)
    out: Path = args.out
    tokenizer = PreTrainedTokenizerFast.from_pretrained(out / "demo-target")
    root, rels = stdlib_files()
    train_rels, held_rels = split_files(rels, args.heldout_permille)
    train_rows = chunk(encode_files(tokenizer, root, train_rels), args.seq_len)
    held_text = (out / "demo-data" / "heldout.txt").read_text(encoding="utf-8")
    held_rows = chunk(torch.tensor(tokenizer(held_text, verbose=False)["input_ids"]), args.seq_len)
    target = LlamaForCausalLM.from_pretrained(out / "demo-target", dtype=torch.float32).eval().requires_grad_(False)
    torch.manual_seed(args.seed + 1)
    draft = new_model(make_config(args.drafter_shape, args.vocab_size))
    loss = distill_loss_fn(target, args.temperature, args.alpha)
    stats = train_loop(args.drafter, draft, train_rows, args, args.draft_steps, args.draft_lr, loss, args.seed + 1)
    save_model(draft, tokenizer, out / args.drafter, torch.float32)
    ev = evaluate(target, draft, held_rows)
    cmd = " ".join(shlex.quote(a) for a in [Path(sys.executable).name, *sys.argv])
    cfg = draft.config
    md = f"""# {args.drafter}: training report

Generated by `scripts/train_demo_models.py`: a second drafter for `demo-target`, distilled
from it on the same training split and tokenizer as `demo-draft`, with another seed and shape.

Command: `{cmd}`

- shape: {cfg.model_type}, {cfg.num_hidden_layers} layer(s) x hidden {cfg.hidden_size}, {cfg.num_attention_heads} heads ({getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads} KV) x {getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads}, intermediate {getattr(cfg, "intermediate_size", None) or cfg.ffn_dim}; {n_params(draft):,} parameters
- training: {stats['steps']} steps, {stats['tokens']:,} tokens, {stats['seconds']:.0f} s on {args.threads} CPU thread(s); final loss {stats['final_loss']:.4f}
- distillation: T={args.temperature}, alpha={args.alpha}; seed {args.seed}
- wall time: {time.time() - t_start:.0f} s

| eval set | positions | target ppl | drafter ppl | drafter/target top-1 agreement |
|---|---:|---:|---:|---:|
| `demo-data/heldout.txt` | {ev['positions']:,} | {ev['target_ppl']:.3f} | {ev['draft_ppl']:.3f} | {ev['top1_agreement']:.4f} |
"""
    (out / args.drafter / "TRAINING.md").write_text(md)
    print(md, flush=True)
    return {"training": stats, "eval_heldout_txt": ev}


def main(argv=None) -> dict:
    args = parse_args(argv)
    if args.drafter:
        return train_extra_drafter(args)
    t_start = time.time()
    torch.set_num_threads(args.threads)
    seed_everything(args.seed)
    out: Path = args.out
    (out / "demo-data").mkdir(parents=True, exist_ok=True)

    root, rels = stdlib_files()
    train_rels, held_rels = split_files(rels, args.heldout_permille)
    print(f"corpus: {root} -> {len(train_rels)} train / {len(held_rels)} held-out files", flush=True)

    calib_text, calib_files = pick_excerpt(root, train_rels)
    held_text, held_files = pick_excerpt(root, held_rels)
    (out / "demo-data" / "calibration.txt").write_text(calib_text, encoding="utf-8")
    (out / "demo-data" / "heldout.txt").write_text(held_text, encoding="utf-8")
    write_sources(out, root, calib_files, held_files, len(train_rels), len(held_rels))

    tokenizer = train_tokenizer(root, train_rels, args.vocab_size)
    train_rows = chunk(encode_files(tokenizer, root, train_rels), args.seq_len)
    held_stream = encode_files(tokenizer, root, held_rels)
    held_rows = chunk(held_stream, args.seq_len)
    held_rows = held_rows[torch.linspace(0, held_rows.shape[0] - 1, min(args.eval_rows, held_rows.shape[0])).long()]
    held_txt_ids = torch.tensor(tokenizer(held_text, verbose=False)["input_ids"])
    held_txt_rows = chunk(held_txt_ids, args.seq_len)
    print(
        f"tokens: train {train_rows.numel():,} ({train_rows.shape[0]} rows), held-out {held_stream.numel():,}, "
        f"heldout.txt {held_txt_ids.numel():,}",
        flush=True,
    )
    assert held_txt_ids.numel() >= 2000, "heldout.txt must give at least 2000 tokens"

    torch.manual_seed(args.seed)
    target = LlamaForCausalLM(make_config("target", args.vocab_size))
    torch.manual_seed(args.seed + 1)
    draft = LlamaForCausalLM(make_config("draft", args.vocab_size))
    params = {"target": n_params(target), "draft": n_params(draft)}
    print(f"params: target {params['target']:,}  draft {params['draft']:,}", flush=True)

    stats_t = train_loop("target", target, train_rows, args, args.target_steps, args.target_lr, lm_loss, args.seed)
    target_dtype = getattr(torch, args.target_dtype)
    save_model(target, tokenizer, out / "demo-target", target_dtype)
    if target_dtype != torch.float32:  # distil from the weights that were actually saved
        target.to(target_dtype).to(torch.float32)
    target.eval().requires_grad_(False)

    loss = distill_loss_fn(target, args.temperature, args.alpha)
    stats_d = train_loop("draft", draft, train_rows, args, args.draft_steps, args.draft_lr, loss, args.seed + 1)
    save_model(draft, tokenizer, out / "demo-draft", torch.float32)

    report = {
        "command": " ".join(shlex.quote(a) for a in [Path(sys.executable).name, *sys.argv]),
        "seed": args.seed,
        "args": {k: str(v) for k, v in vars(args).items()},
        "params": params,
        "tokenizer": {
            "vocab_size": len(tokenizer),
            "special_ids": {"<s>": BOS_ID, "</s>": EOS_ID, "<unk>": UNK_ID, "<pad>": PAD_ID},
        },
        "data": {
            "python_version": platform.python_version(),
            "train_files": len(train_rels),
            "heldout_files": len(held_rels),
            "train_tokens": int(train_rows.numel()),
            "heldout_tokens": int(held_stream.numel()),
            "seq_len": args.seq_len,
        },
        "distill": {"temperature": args.temperature, "alpha": args.alpha},
        "training": {"target": stats_t, "draft": stats_d},
        "eval_heldout_split": evaluate(target, draft, held_rows),
        "eval_heldout_txt": evaluate(target, draft, held_txt_rows),
        "env": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "tokenizers": __import__("tokenizers").__version__,
            "threads": args.threads,
        },
    }
    report["wall_time_s"] = round(time.time() - t_start, 1)
    print(write_report(out, report), flush=True)
    return report


if __name__ == "__main__":
    main()
