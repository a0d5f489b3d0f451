"""The target-side verifier of many sequences: one forward pass scores every sequence's round.

Each sequence keeps its own KV cache (per layer a key and a value tensor ``[1, H, L, D]``),
so that one sequence can be cropped, removed or added alone. A round builds a batched
cache by left-padding every sequence's keys and values to the longest, runs the target
once over the right-padded ``[pending] + drafts`` of each, with a 2-D attention mask that
is 0 on the padding and each sequence's own position ids, and then stores each sequence's
new keys and values back, without the padding.

The cache API of transformers used here is public: ``DynamicCache(config=...)`` and its
``layers`` (``DynamicLayer`` objects, whose ``keys`` / ``values`` attributes hold the
tensors) and ``is_sliding`` / ``is_linear`` / ``is_dummy``; a batched cache is built with
``DynamicCache(ddp_cache_data=[(keys, values), ...], config=...)``. No private name of
transformers is used.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

from dfvg_host.verifier import load_target, place, timed_forward

__all__ = ["BatchVerifier"]

#: per layer, the keys and the values of one sequence, each ``[1, kv_heads, length, head_dim]``
LayerKV = tuple[torch.Tensor, torch.Tensor]


@dataclass
class _Sequence:
    """One sequence: the cache of its committed tokens but the last, and that pending token."""
    pending: int
    kv: list[LayerKV] = field(default_factory=list)      # empty while nothing is cached
    length: int = 0
    scored: int | None = None     # drafts of the round scored and not yet committed


class BatchVerifier:
    """Any ``AutoModelForCausalLM`` target with full-attention layers, verifying the rounds of
    many sequences in one forward pass.

    The conventions are :class:`~dfvg_host.verifier.Verifier`'s, per sequence: the cache
    holds every committed token but the last ("pending") one; a round scores
    ``[pending] + drafts`` and gives the target's logits after the pending token and after
    each draft. :meth:`add` prefills a sequence in its own forward pass (batch of one,
    exactly the single-sequence prefill); :meth:`score` runs one forward pass over every
    sequence it names; :meth:`commit` keeps what was accepted.

    Greedy decoding through it gives the tokens of the single-sequence ``Verifier``: the
    logits differ only by float rounding (padding changes the shapes the kernels reduce
    over, never what a token attends to).

    Members
    -------
    model : transformers.PreTrainedModel
    device : torch.device
        Where input ids go (the main device of a device map; a rank's device under
        tensor parallelism).
    seconds : float
        Measured wall time spent in forward passes (synchronised on cuda).
    forwards : int
        Forward passes run (prefills included).
    """

    def __init__(self, model, device: torch.device | None = None):
        from transformers import DynamicCache

        self._cache_cls = DynamicCache
        self.model, self.device = place(model, device)
        refuse_unbatchable(self.model, DynamicCache)
        self.seconds = 0.0
        self.forwards = 0
        self._seqs: dict[int, _Sequence] = {}

    @classmethod
    def from_pretrained(cls, path: str | Path, *, device: str | None = None, dtype: str | None = None,
                        device_map=None, max_memory=None, offload_folder=None,
                        tp_plan=None) -> "BatchVerifier":
        """Load a local target directory, checked and placed as
        :meth:`Verifier.from_pretrained <dfvg_host.verifier.Verifier.from_pretrained>` does
        (``device``, or ``device_map`` with ``max_memory`` / ``offload_folder``, or
        ``tp_plan="auto"`` under ``torchrun``)."""
        return cls(*load_target(path, device=device, dtype=dtype, device_map=device_map, max_memory=max_memory,
                                offload_folder=offload_folder, tp_plan=tp_plan))

    @property
    def vocab_size(self) -> int:
        return self.model.config.vocab_size

    def __contains__(self, seq_id: object) -> bool:
        return seq_id in self._seqs

    def __len__(self) -> int:
        return len(self._seqs)

    def length(self, seq_id: int) -> int:
        """Tokens in the sequence's cache (its committed tokens but the pending one, plus the
        round scored and not yet committed)."""
        return self._get(seq_id).length

    def add(self, seq_id: int, prompt: list[int]) -> None:
        """Start a sequence: cache all prompt tokens but the last, which becomes pending. The
        prefill is a forward pass of its own (none for a one-token prompt)."""
        if seq_id in self._seqs:
            raise ValueError(f"sequence {seq_id} is already present; remove it first or use a new id")
        if not prompt:
            raise ValueError(f"sequence {seq_id}: the prompt must contain at least one token")
        self._check_ids(seq_id, prompt, "prompt")
        seq = _Sequence(pending=int(prompt[-1]))
        if len(prompt) > 1:
            cache = self._cache_cls(config=self.model.config)
            self._run(input_ids=torch.tensor([list(prompt[:-1])], device=self.device), cache=cache, use_cache=True)
            seq.kv = [(layer.keys, layer.values) for layer in cache.layers]
            seq.length = len(prompt) - 1
        self._seqs[seq_id] = seq

    def remove(self, seq_id: int) -> None:
        """Forget the sequence and free its cache."""
        self._get(seq_id)
        del self._seqs[seq_id]

    def score(self, drafts_by_seq: dict[int, list[int]]) -> dict[int, torch.Tensor]:
        """One forward pass over the listed sequences; per sequence, float32 cpu logits
        ``[len(drafts) + 1, V]`` after its pending token and each of its drafts.

        Each listed sequence must have committed its previous round (:meth:`commit`)."""
        for seq_id, drafts in drafts_by_seq.items():
            if self._get(seq_id).scored is not None:
                raise ValueError(f"sequence {seq_id}: its last round is not committed; call commit() "
                                 "before scoring it again")
            self._check_ids(seq_id, drafts, "drafts")
        if not drafts_by_seq:
            return {}
        ids = list(drafts_by_seq)
        seqs = [self._seqs[i] for i in ids]
        rows = [[s.pending, *map(int, drafts_by_seq[i])] for i, s in zip(ids, seqs)]
        past = max(s.length for s in seqs)
        logits, cache = self._run_batch(seqs, rows, past)
        for b, (seq, row) in enumerate(zip(seqs, rows)):
            seq.kv = [(layer.keys[b:b + 1, :, past - seq.length:past + len(row)].clone(),
                       layer.values[b:b + 1, :, past - seq.length:past + len(row)].clone())
                      for layer in cache.layers]
            seq.length += len(row)
            seq.scored = len(row) - 1
        return {i: logits[b, :len(row)] for b, (i, row) in enumerate(zip(ids, rows))}

    def commit(self, seq_id: int, accepted: int, drafted: int, next_token: int) -> None:
        """Keep the pending token and ``accepted`` drafts in the sequence's cache, drop the
        other ``drafted - accepted``; ``next_token`` pends."""
        seq = self._get(seq_id)
        if seq.scored is None:
            raise ValueError(f"sequence {seq_id}: nothing to commit; score() its round first")
        if drafted != seq.scored or not 0 <= accepted <= drafted:
            raise ValueError(f"sequence {seq_id}: commit(accepted={accepted}, drafted={drafted}) does not fit "
                             f"the round scored with {seq.scored} drafts (0 <= accepted <= drafted)")
        self._check_ids(seq_id, [next_token], "next_token")
        drop = drafted - accepted
        if drop:
            seq.kv = [(k[:, :, :-drop], v[:, :, :-drop]) for k, v in seq.kv]
            seq.length -= drop
        seq.pending = int(next_token)
        seq.scored = None

    # -- the pieces ----------------------------------------------------------------------

    def _get(self, seq_id: int) -> _Sequence:
        try:
            return self._seqs[seq_id]
        except KeyError:
            raise KeyError(f"no sequence {seq_id} in the verifier (add() it first)") from None

    def _check_ids(self, seq_id: int, tokens: list[int], what: str) -> None:
        """A ``ValueError`` for a token id outside the vocabulary, before it could fail the
        forward pass of every sequence in the batch."""
        bad = [t for t in tokens if not 0 <= int(t) < self.vocab_size]
        if bad:
            raise ValueError(f"sequence {seq_id}: {what} holds token id(s) {bad[:4]} outside the target's "
                             f"vocabulary of {self.vocab_size}")

    def _run(self, **inputs) -> torch.Tensor:
        logits, seconds = timed_forward(self.model, **inputs)
        self.seconds += seconds
        self.forwards += 1
        return logits

    def _run_batch(self, seqs: list[_Sequence], rows: list[list[int]], past: int):
        """The batched forward: caches left-padded to ``past``, new tokens right-padded to the
        longest row. Returns the logits ``[B, width, V]`` and the batched cache after it."""
        width = max(len(r) for r in rows)
        input_ids = torch.tensor([r + [r[-1]] * (width - len(r)) for r in rows], device=self.device)
        mask = torch.tensor([[0] * (past - s.length) + [1] * (s.length + len(r)) + [0] * (width - len(r))
                             for s, r in zip(seqs, rows)], device=self.device)
        positions = torch.tensor([[s.length + j for j in range(width)] for s in seqs], device=self.device)
        cache = self._batched_cache(seqs, past)
        logits = self._run(input_ids=input_ids, attention_mask=mask, position_ids=positions,
                           cache=cache, use_cache=True)
        return logits, cache

    def _batched_cache(self, seqs: list[_Sequence], past: int):
        """A ``DynamicCache`` of ``past`` positions: each sequence's keys and values at the end,
        zeros (masked out) before them."""
        if past == 0:
            return self._cache_cls(config=self.model.config)
        template = next(s.kv for s in seqs if s.length)
        layers = []
        for index, (k0, v0) in enumerate(template):
            keys = [left_pad(s.kv[index][0] if s.length else None, k0, past) for s in seqs]
            values = [left_pad(s.kv[index][1] if s.length else None, v0, past) for s in seqs]
            layers.append((torch.cat(keys), torch.cat(values)))
        return self._cache_cls(ddp_cache_data=layers, config=self.model.config)


def left_pad(states: torch.Tensor | None, like: torch.Tensor, length: int) -> torch.Tensor:
    """``states`` ``[1, H, L, D]`` with zeros before it up to ``length`` positions; all zeros
    shaped as ``like`` when ``states`` is ``None`` (a sequence with an empty cache)."""
    if states is None:
        return like.new_zeros(1, like.shape[1], length, like.shape[3])
    return F.pad(states, (0, 0, length - states.shape[2], 0))


def refuse_unbatchable(model, cache_cls) -> None:
    """A ``ValueError`` unless every layer of ``model`` keeps a plain, croppable full-attention
    cache: sliding-window, linear-attention (state-space) and KV-sharing layers, and
    encoder-decoders, cannot be padded, batched and cropped this way."""
    config = model.config
    if getattr(config, "is_encoder_decoder", False):
        raise ValueError(f"BatchVerifier needs a decoder-only target; {type(model).__name__} is an "
                         "encoder-decoder")
    from transformers.cache_utils import DynamicLayer
    layers = cache_cls(config=config).layers
    odd = sorted({type(layer).__name__ for layer in layers if type(layer) is not DynamicLayer})
    if odd or not layers:
        raise ValueError(f"BatchVerifier supports targets whose every layer keeps a full-attention "
                         f"cache (DynamicLayer); {type(model).__name__} has {', '.join(odd) or 'no cache layers'} "
                         "(sliding-window, linear-attention or shared-KV layers): verify it with "
                         "dfvg_host.verifier.Verifier, one sequence at a time")
