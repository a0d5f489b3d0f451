"""The target-side verifier: one forward pass per round over the pending token + drafts."""

from __future__ import annotations

import time
from pathlib import Path

import torch

__all__ = ["Verifier", "pick_device", "parse_dtype"]

_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "float16": torch.float16,
           "fp16": torch.float16, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}


def pick_device(name: str | None = None) -> torch.device:
    """``cuda`` when present, else ``cpu``; or the device the caller names, checked to
    exist on this machine (a ``ValueError`` that says what to use otherwise)."""
    if not name:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        raise ValueError(f"--verifier-device {name!r} is not a torch device; use cpu, cuda or "
                         "cuda:N") from None
    if device.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            raise ValueError(f"--verifier-device {name}: this machine has no CUDA device (torch "
                             f"{torch.__version__}); use --verifier-device cpu")
        if device.index is not None and device.index >= count:
            raise ValueError(f"--verifier-device {name}: this machine has {count} CUDA device(s), "
                             f"cuda:0 to cuda:{count - 1}")
    elif device.type == "mps" and not torch.backends.mps.is_available():
        raise ValueError(f"--verifier-device {name}: MPS is not available here; use cpu")
    elif device.type not in ("cpu", "cuda", "mps"):
        raise ValueError(f"--verifier-device {name}: dfvg runs the target on cpu, cuda or mps")
    return device


def parse_dtype(name: str | None) -> torch.dtype:
    if name is None:
        return torch.float32
    try:
        return _DTYPES[name]
    except KeyError:
        raise ValueError(f"unknown dtype {name!r}; use one of {', '.join(_DTYPES)}") from None


class Verifier:
    """Any ``AutoModelForCausalLM`` target, holding the KV cache of the committed prefix.

    The cache holds every committed token but the last ("pending") one; a round scores
    ``[pending] + drafts`` in one forward pass, which gives the target's logits after the
    pending token and after each draft.

    Members
    -------
    model : transformers.PreTrainedModel
    device : torch.device
    seconds : float
        Measured wall time spent in forward passes (synchronised on cuda).
    forwards : int
        Forward passes run (prefill included).
    """

    def __init__(self, model, device: torch.device | None = None):
        from transformers import DynamicCache

        self._cache_cls = DynamicCache
        self.device = device or next(model.parameters()).device
        self.model = model.to(self.device).eval()
        self.seconds = 0.0
        self.forwards = 0
        self.cache = None
        self.pending: int | None = None
        self.length = 0          # tokens in the cache

    @classmethod
    def from_pretrained(cls, path: str | Path, *, device: str | None = None,
                        dtype: str | None = None) -> "Verifier":
        from dfvg_host.checkpoints import check_causal_lm, load_causal_lm, load_checkpoint_config

        dev = pick_device(device)
        check_causal_lm(load_checkpoint_config(Path(path), "--target"), path)
        return cls(load_causal_lm(Path(path), parse_dtype(dtype), "target"), dev)

    @property
    def vocab_size(self) -> int:
        return self.model.config.vocab_size

    def _forward(self, ids: list[int]) -> torch.Tensor:
        t0 = time.perf_counter()
        with torch.no_grad():
            out = self.model(torch.tensor([ids], device=self.device), cache=self.cache, use_cache=True)
        logits = out.logits[0].float()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.seconds += time.perf_counter() - t0
        self.forwards += 1
        self.length += len(ids)
        return logits.cpu()

    def prefill(self, prompt: list[int]) -> None:
        """Start a sequence: cache all prompt tokens but the last, which becomes pending."""
        if not prompt:
            raise ValueError("the prompt must contain at least one token")
        self.cache = self._cache_cls(config=self.model.config)
        self.length = 0
        if len(prompt) > 1:
            self._forward(prompt[:-1])
        self.pending = prompt[-1]

    def score(self, drafts: list[int]) -> torch.Tensor:
        """Target logits ``[len(drafts) + 1, V]`` after the pending token and each draft."""
        return self._forward([self.pending] + list(drafts))

    def commit(self, accepted: int, drafted: int, next_token: int) -> None:
        """Keep the pending token and ``accepted`` drafts in the cache; ``next_token`` pends."""
        drop = drafted - accepted
        if drop:
            self.cache.crop(-drop)
            self.length -= drop
        self.pending = next_token
