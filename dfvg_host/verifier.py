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
           "input_device", "is_placed", "timed_forward", "compact_cache"]

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


def compact_cache(cache, keep: torch.Tensor) -> None:
    """Keep only the sequence positions ``keep`` (ascending indices) of every layer of a
    transformers ``DynamicCache``, in place. Sliding-window, static, quantised and
    linear-attention layers keep state this cannot rewrite: a ``NotImplementedError``."""
    from transformers.cache_utils import DynamicLayer

    for layer in cache.layers:
        if type(layer) is not DynamicLayer:
            raise NotImplementedError(f"compacting a {type(layer).__name__} cache layer is not "
                                      "supported; token trees need a plain DynamicCache")
        if not layer.is_initialized:
            continue
        index = keep.to(layer.keys.device)
        layer.keys = layer.keys.index_select(-2, index)
        layer.values = layer.values.index_select(-2, index)


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
        self._tree = None        # (start, tree) of the last score_tree, until commit_path

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
        self._tree = None
        if len(prompt) > 1:
            self._forward(prompt[:-1])
        self.pending = prompt[-1]

    def score(self, drafts: list[int]) -> torch.Tensor:
        """Target logits ``[len(drafts) + 1, V]`` after the pending token and each draft."""
        self._no_tree_pending("score")
        return self._forward([self.pending] + list(drafts))

    def commit(self, accepted: int, drafted: int, next_token: int) -> None:
        """Keep the pending token and ``accepted`` drafts in the cache; ``next_token`` pends."""
        self._no_tree_pending("commit")
        drop = drafted - accepted
        if drop:
            self.cache.crop(-drop)
            self.length -= drop
        self.pending = next_token

    def _no_tree_pending(self, what: str) -> None:
        # The cache holds every node of a scored tree: a chain's crop would keep the wrong ones.
        if self._tree is not None:
            raise RuntimeError(f"{what}() after score_tree(): commit the tree's accepted path with "
                               "commit_path() first")

    # -- token trees (dfvg_host.tree) ----------------------------------------------------
    def score_tree(self, tree) -> torch.Tensor:
        """Target logits ``[1 + len(tree), V]`` after the pending token and after each node
        of ``tree`` (a :class:`~dfvg_host.tree.DraftTree`), in one forward pass.

        The pass feeds ``[pending] + tree.tokens`` with explicit position ids (the pending
        token at the cache length, a node at that plus its depth) and a 4-D additive mask
        ``[1, 1, 1 + n, cache + 1 + n]``: every row sees the whole cache and the pending
        token, a node also its ancestors and itself. transformers' masking returns a 4-D
        mask as given (``masking_utils._preprocess_mask_arguments``), and both its sdpa and
        eager attention add a float mask to the scores, so the mask is 0 where a token may
        attend and the dtype's minimum elsewhere. Row ``1 + i`` equals the last logits of
        the chain ``[pending] + tree.path_tokens(i)``. The cache then holds every node;
        :meth:`commit_path` keeps the accepted ones.
        """
        n = len(tree)
        start = self.length
        local = tree.attention_mask()
        allowed = torch.ones(n + 1, start + n + 1, dtype=torch.bool)
        allowed[:, start:] = local
        dtype = next(self.model.parameters()).dtype
        if not dtype.is_floating_point:
            dtype = torch.float32
        bias = torch.zeros(allowed.shape, dtype=dtype).masked_fill_(~allowed, torch.finfo(dtype).min)
        ids = torch.tensor([[self.pending] + tree.tokens], device=self.device)
        logits, seconds = timed_forward(self.model, input_ids=ids,
                                        attention_mask=bias[None, None].to(self.device),
                                        position_ids=tree.position_ids(start)[None].to(self.device),
                                        cache=self.cache, use_cache=True)
        self.seconds += seconds
        self.forwards += 1
        self.length += n + 1
        self._tree = (start, tree)
        return logits[0]

    def commit_path(self, path_nodes: list[int], next_token: int) -> None:
        """After :meth:`score_tree`: keep the pending token and the nodes of ``path_nodes``
        (a root-to-node path of the scored tree, possibly empty) in the cache, in that
        order, and drop every other node's entries; ``next_token`` pends. The cache is then
        what a chain that decoded that path would hold (up to float rounding), so the
        next round (:meth:`score` or :meth:`score_tree`) continues as after a chain."""
        tree_state = getattr(self, "_tree", None)
        if tree_state is None:
            raise RuntimeError("commit_path follows score_tree; no tree was scored since the "
                               "last commit")
        start, tree = tree_state
        path_nodes = [int(i) for i in path_nodes]
        if not tree.is_path(path_nodes):
            raise ValueError(f"{path_nodes} is not a root-to-node path of the scored tree "
                             f"(parents {tree.parents})")
        keep_from = start + 1      # the cache up to and including the pending token stays
        if path_nodes != list(range(len(path_nodes))):
            keep = torch.tensor(list(range(keep_from)) + [keep_from + i for i in path_nodes],
                                dtype=torch.long)
            compact_cache(self.cache, keep)
        else:                      # nodes 0..k-1 already follow the pending token
            drop = len(tree) - len(path_nodes)
            if drop:
                self.cache.crop(-drop)
        self.length = keep_from + len(path_nodes)
        self.pending = next_token
        self._tree = None
