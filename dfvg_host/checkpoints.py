"""Local Hugging Face checkpoints: loading them with errors a user can act on, and
checking before any slow work that a draft and a target can decode together.

Speculative decoding compares token ids: the draft proposes ids, the target scores the
same ids. Both must therefore read text with the same tokenizer (vocabulary and special
tokens), every id the tokenizer produces must have a row in the draft's embedding table
and a logit in the target's head, and the target must be a causal language model.
"""

from __future__ import annotations

from pathlib import Path

__all__ = ["CheckpointError", "load_causal_lm", "load_checkpoint_config", "check_causal_lm",
           "check_tokenizer_pair", "load_tokenizer", "first_line",
           "TOKENIZER_FILES", "has_tokenizer"]

_SPECIAL = ("bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id")

#: Files any of which makes a directory loadable with ``AutoTokenizer.from_pretrained``.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def has_tokenizer(directory: Path) -> bool:
    """Whether ``directory`` holds tokenizer files (:data:`TOKENIZER_FILES`)."""
    return any((Path(directory) / f).is_file() for f in TOKENIZER_FILES)


class CheckpointError(ValueError):
    """A model directory that cannot be used as given; the message says what to do."""


def first_line(exc: BaseException) -> str:
    """The first line of an exception's message, or its type's name when it has none."""
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def load_checkpoint_config(path: Path, role: str):
    """The ``AutoConfig`` of the local directory ``path``; ``role`` ("--target", "--draft")
    names it in the error."""
    from transformers import AutoConfig
    if not (Path(path) / "config.json").is_file():
        raise CheckpointError(f"{role} {path} is not a Hugging Face model directory (no config.json)")
    try:
        return AutoConfig.from_pretrained(path, local_files_only=True)
    except Exception as exc:             # noqa: BLE001 - transformers raises many kinds here
        raise CheckpointError(f"{role} {path}: cannot read config.json ({first_line(exc)}); fix or "
                              "re-export the checkpoint") from None


def check_causal_lm(config, path: Path, role: str = "--target") -> None:
    """A :class:`CheckpointError` unless ``config`` describes a causal (decoder) LM."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES as causal
    classes = set()
    for value in causal.values():
        classes.update((value,) if isinstance(value, str) else value)
    architectures = getattr(config, "architectures", None) or []
    model_type = getattr(config, "model_type", "?")
    if architectures:
        ok = any(a in classes for a in architectures)
    else:
        ok = model_type in causal and not getattr(config, "is_encoder_decoder", False)
    if not ok:
        what = ", ".join(architectures) or f"model_type '{model_type}'"
        raise CheckpointError(f"{role} {path} is a {what}, not a causal language model: speculative "
                              "decoding needs a decoder-only model that AutoModelForCausalLM loads "
                              "(a ...ForCausalLM or ...LMHeadModel)")


def load_causal_lm(path: Path, dtype, role: str = "model", *, device_map=None, max_memory=None,
                   offload_folder=None, tp_plan=None):
    """``AutoModelForCausalLM.from_pretrained`` on a local directory; a damaged checkpoint
    (truncated or corrupt weights, a config that does not match them) is a
    :class:`CheckpointError` rather than the loader's traceback.

    ``device_map``, ``max_memory`` and ``offload_folder`` go to accelerate's placement (a
    layer split over devices, offloading to cpu or disk); ``tp_plan`` (``"auto"`` or a
    plan) shards the model over the ranks of an initialised ``torch.distributed`` process
    group, through transformers' ``DistributedConfig``. With either, a failure may also be
    the placement's, and the message says so."""
    from transformers import AutoModelForCausalLM
    placement = {k: v for k, v in (("device_map", device_map), ("max_memory", max_memory),
                                   ("offload_folder", offload_folder)) if v is not None}
    if tp_plan is not None:
        from transformers.distributed import DistributedConfig
        placement["distributed_config"] = DistributedConfig(tp_plan=tp_plan)
    try:
        return AutoModelForCausalLM.from_pretrained(path, dtype=dtype, local_files_only=True, **placement)
    except Exception as exc:             # noqa: BLE001 - safetensors, torch and transformers errors
        if placement:
            how = ", ".join(f"{k}={v!r}" for k, v in (("device_map", device_map), ("max_memory", max_memory),
                                                      ("tp_plan", tp_plan)) if v is not None)
            raise CheckpointError(f"cannot load the {role} in {path} with {how} ({type(exc).__name__}: "
                                  f"{first_line(exc)}); check the placement options, or re-export the "
                                  "checkpoint if it is damaged") from None
        raise CheckpointError(f"cannot load the {role} weights in {path} ({type(exc).__name__}: "
                              f"{first_line(exc)}); the checkpoint is damaged or incomplete — "
                              "re-export or copy it again") from None


def load_tokenizer(path: Path, role: str):
    """``AutoTokenizer.from_pretrained`` on a local directory, with an error that names the
    ``role`` ("draft", "target") and what the directory needs."""
    from transformers import AutoTokenizer
    if not has_tokenizer(path):
        raise CheckpointError(f"the {role} directory {path} has no tokenizer files ({', '.join(TOKENIZER_FILES)}); "
                              "copy the model's tokenizer into it")
    try:
        return AutoTokenizer.from_pretrained(path, local_files_only=True)
    except Exception as exc:             # noqa: BLE001 - tokenizers, sentencepiece, OSError ...
        raise CheckpointError(f"cannot load the {role}'s tokenizer in {path} ({first_line(exc)}); "
                              "the directory needs tokenizer.json (or the files its "
                              "tokenizer_config.json names)") from None


def check_tokenizer_pair(target_dir: Path, target_vocab: int, draft_vocab: int,
                         draft_tokenizer_dir: Path | None = None):
    """The target's tokenizer, after checking that the draft can work with it.

    ``draft_tokenizer_dir`` is the draft's own tokenizer when it has one: its vocabulary
    and special tokens must equal the target's. Every id the tokenizer can produce must
    be below ``draft_vocab`` and ``target_vocab`` (the embedding and head sizes, which
    may be padded larger than the tokenizer)."""
    tok = load_tokenizer(target_dir, "target")
    if draft_tokenizer_dir is not None and Path(draft_tokenizer_dir).resolve() != Path(target_dir).resolve():
        draft_tok = load_tokenizer(draft_tokenizer_dir, "draft")
        vocab, draft_words = tok.get_vocab(), draft_tok.get_vocab()
        if vocab != draft_words:
            only_target = len(vocab.keys() - draft_words.keys())
            only_draft = len(draft_words.keys() - vocab.keys())
            moved = sum(1 for w in vocab.keys() & draft_words.keys() if vocab[w] != draft_words[w])
            raise CheckpointError(
                f"the draft's tokenizer ({draft_tokenizer_dir}) is not the target's ({target_dir}): "
                f"{only_target} tokens only in the target's, {only_draft} only in the draft's, "
                f"{moved} with other ids; speculative decoding needs a draft trained with the "
                "target's tokenizer")
        special = [(n, getattr(tok, n), getattr(draft_tok, n)) for n in _SPECIAL
                   if getattr(tok, n) != getattr(draft_tok, n)]
        if special:
            raise CheckpointError("the draft's and the target's tokenizers differ in special tokens: " +
                                  ", ".join(f"{n} {t} (target) vs {d} (draft)" for n, t, d in special) +
                                  "; use a draft built for the target's tokenizer")
    ids = len(tok)
    for role, vocab in (("draft", draft_vocab), ("target", target_vocab)):
        if ids > vocab:
            raise CheckpointError(f"the tokenizer in {target_dir} produces ids up to {ids - 1}, but the "
                                  f"{role} has a vocabulary of {vocab}: the {role} was not built for "
                                  "this tokenizer")
    return tok
