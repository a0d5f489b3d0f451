"""The target-side verifier: one forward pass per round over the pending token + drafts.

Also what the verifiers share: loading a target on one device, split over devices by
accelerate (``device_map``) or sharded over ``torchrun`` ranks (``tp_plan``), and a
timed forward pass.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import torch

__all__ = ["Verifier", "pick_device", "parse_dtype", "check_placement", "load_target", "place",
           "input_device", "is_placed", "timed_forward"]

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


def check_placement(device: str | None, device_map, tp_plan) -> None:
    """A ``ValueError`` for placement options that cannot go together, before any load:
    ``device`` with ``device_map`` or ``tp_plan``, both of those, or ``tp_plan`` in a
    process that ``torchrun`` did not start."""
    if device and (device_map is not None or tp_plan is not None):
        raise ValueError(f"give a device ({device!r}) or a device_map / tp_plan, not both: a device "
                         "map or a tensor-parallel plan places the target itself")
    if device_map is not None and tp_plan is not None:
        raise ValueError("give device_map or tp_plan, not both: transformers shards a tensor-parallel "
                         "target over the ranks itself")
    if tp_plan is not None and not (torch.distributed.is_available() and torch.distributed.is_initialized()
                                    or "WORLD_SIZE" in os.environ):
        raise ValueError("tp_plan needs torch.distributed: run under torchrun (e.g. torchrun "
                         "--nproc-per-node 2 -m dfvg_host.tensor_parallel --target DIR)")


def load_target(path: str | Path, *, device: str | None = None, dtype: str | None = None,
                device_map=None, max_memory=None, offload_folder=None,
                tp_plan=None) -> tuple[torch.nn.Module, torch.device | None]:
    """The checked and loaded target model, and the device to put it on (``None`` when
    ``device_map`` or ``tp_plan`` placed it). Errors say what to fix: a ``ValueError`` for
    options, a :class:`~dfvg_host.checkpoints.CheckpointError` for the directory."""
    from dfvg_host.checkpoints import check_causal_lm, load_causal_lm, load_checkpoint_config

    check_placement(device, device_map, tp_plan)
    placed = device_map is not None or tp_plan is not None
    dev = None if placed else pick_device(device)
    torch_dtype = parse_dtype(dtype)
    check_causal_lm(load_checkpoint_config(Path(path), "--target"), path)
    model = load_causal_lm(Path(path), torch_dtype, "target", device_map=device_map, max_memory=max_memory,
                           offload_folder=offload_folder, tp_plan=tp_plan)
    return model, dev


def is_placed(model) -> bool:
    """Whether accelerate dispatched ``model`` over devices (or offloaded it) or transformers
    sharded it for tensor parallelism: such a model must not be moved with ``.to``."""
    return bool(getattr(model, "hf_device_map", None)) or bool(getattr(model, "tp_size", None))


def input_device(model) -> torch.device:
    """Where ``model``'s input ids go: the main device of an accelerate device map (its first
    device that is neither cpu nor disk, as ``accelerate.dispatch_model`` picks it), else the
    device of its parameters (a tensor-parallel rank's own device)."""
    device_map = getattr(model, "hf_device_map", None) or {}
    for where in device_map.values():
        if where not in ("cpu", "disk", "meta"):
            return torch.device(f"cuda:{where}" if isinstance(where, int) else where)
    if device_map:
        return torch.device("cpu")
    return next(model.parameters()).device


def place(model, device: torch.device | None = None) -> tuple[object, torch.device]:
    """``(model in eval mode, where its input ids go)``: a placed model (:func:`is_placed`)
    stays where it is; any other moves to ``device`` (default: where its parameters are)."""
    if is_placed(model):
        return model.eval(), input_device(model)
    device = device or next(model.parameters()).device
    return model.to(device).eval(), device


def timed_forward(model, **inputs) -> tuple[torch.Tensor, float]:
    """``model(**inputs)`` without gradients: its float32 logits on the cpu and the wall time,
    synchronised with the logits' cuda device (the last stage of a device map, whose work
    waits for every earlier one)."""
    t0 = time.perf_counter()
    with torch.no_grad():
        logits = model(**inputs).logits.float()
    if logits.device.type == "cuda":
        torch.cuda.synchronize(logits.device)
    seconds = time.perf_counter() - t0
    return logits.cpu(), seconds


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
        self.model, self.device = place(model, device)
        self.seconds = 0.0
        self.forwards = 0
        self.cache = None
        self.pending: int | None = None
        self.length = 0          # tokens in the cache

    @classmethod
    def from_pretrained(cls, path: str | Path, *, device: str | None = None, dtype: str | None = None,
                        device_map=None, max_memory=None, offload_folder=None,
                        tp_plan=None) -> "Verifier":
        """Load a local target directory (see :func:`load_target`): on ``device`` (default
        cuda if present, else cpu), or placed by accelerate's ``device_map`` (``"auto"`` or a
        dict, with ``max_memory`` and ``offload_folder``), or sharded over ``torchrun`` ranks
        with ``tp_plan="auto"``."""
        return cls(*load_target(path, device=device, dtype=dtype, device_map=device_map, max_memory=max_memory,
                                offload_folder=offload_folder, tp_plan=tp_plan))

    @property
    def vocab_size(self) -> int:
        return self.model.config.vocab_size

    def _forward(self, ids: list[int]) -> torch.Tensor:
        logits, seconds = timed_forward(self.model, input_ids=torch.tensor([ids], device=self.device),
                                        cache=self.cache, use_cache=True)
        self.seconds += seconds
        self.forwards += 1
        self.length += len(ids)
        return logits[0]

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
