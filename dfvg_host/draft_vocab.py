"""A draft vocabulary smaller than the model's: the engine drafts over a kept subset.

The engine's token ids are 16-bit (``EngineConfig.vocab_max`` ≤ 65535), and Qwen-family
drafts have 151,936 tokens. As in frequency-ranked drafting (FR-Spec; EAGLE-3's reduced
draft vocabulary), the compiled draft keeps ``size − 1`` tokens: its LM head (LOGITS and
SAMPLE) covers only those, so the engine never drafts another token, and q is exactly
the distribution it drew from (0 outside the kept set), which keeps rejection sampling
lossless: the target still verifies, accepts and emits any token. Input tokens outside the
kept set share the last engine row, whose embedding is the mean of the dropped tokens'
embeddings, so the draft sees rare tokens approximately; that lowers acceptance after
them, never exactness.

Which tokens: the special tokens the config names (BOS, EOS, PAD), every token of the
calibration text, then the lowest ids. Byte-pair and SentencePiece vocabularies number
their tokens roughly by frequency, so low ids are the frequent ones. (A compile without
calibration text, ``--random-weights`` for sizing, calibrates on random ids, and so keeps
those: only the count matters there.)
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import numpy as np

__all__ = ["DraftVocabulary", "choose_draft_vocabulary"]


@dataclass(frozen=True, eq=False)     # it holds an array: identity, not value, equality
class DraftVocabulary:
    """The kept tokens of a draft, engine id ``e`` ↔ model id ``kept[e]``.

    Members
    -------
    kept : np.ndarray
        Model token ids, ascending (so the mapping keeps the order that breaks the
        sampler's ties); the engine's LM head rows, in this order.
    vocab : int
        The model's vocabulary size.
    """
    kept: np.ndarray
    vocab: int

    @property
    def size(self) -> int:
        """Engine embedding rows: the kept tokens and the shared row of all others."""
        return len(self.kept) + 1

    @property
    def unknown(self) -> int:
        """The engine id every dropped token is fed as."""
        return len(self.kept)

    @cached_property
    def _engine_ids(self) -> np.ndarray:
        """The engine id of every model id."""
        table = np.full(self.vocab, self.unknown, dtype=np.int64)
        table[self.kept] = np.arange(len(self.kept))
        return table

    def to_engine(self, tokens) -> list[int]:
        """Model ids → engine ids (dropped tokens → :attr:`unknown`); an id outside the
        model's vocabulary raises ``ValueError``."""
        bad = [t for t in tokens if not 0 <= t < self.vocab]
        if bad:
            raise ValueError(f"token id {bad[0]} is outside the model's vocabulary of {self.vocab}")
        return [int(self._engine_ids[t]) for t in tokens]

    def to_model(self, engine_ids) -> list[int]:
        """Engine ids the engine drafted → model ids; an id past the kept tokens raises
        ``IndexError`` (the engine never drafts the shared row)."""
        kept = self.kept
        out = []
        for e in engine_ids:
            if not 0 <= e < len(kept):
                raise IndexError(f"engine token {e} is outside the {len(kept)} kept tokens")
            out.append(int(kept[e]))
        return out

    def to_dict(self) -> dict:
        """Compact form for the manifest: the kept ids as ``[first, end)`` runs."""
        k = self.kept
        breaks = np.flatnonzero(np.diff(k) != 1) + 1
        starts, ends = np.r_[0, breaks], np.r_[breaks, len(k)]
        return dict(vocab=self.vocab, runs=[[int(k[a]), int(k[b - 1]) + 1] for a, b in zip(starts, ends)])

    @classmethod
    def from_dict(cls, d: dict) -> "DraftVocabulary":
        kept = np.concatenate([np.arange(a, b) for a, b in d["runs"]]) if d["runs"] else np.zeros(0, np.int64)
        return cls(kept.astype(np.int64), int(d["vocab"]))


def choose_draft_vocabulary(vocab: int, size: int, *, special: list[int], frequent: list[int]
                            ) -> DraftVocabulary:
    """Keep ``size − 1`` of ``vocab`` tokens: ``special``, then ``frequent`` (most frequent
    first), then the lowest ids; the last engine row is shared by the rest."""
    if not 2 <= size < vocab:
        raise ValueError(f"a draft vocabulary of {size} for a model of {vocab} tokens: "
                         f"it must be 2..{vocab - 1}")
    room = size - 1
    chosen: dict[int, None] = {}
    for t in list(special) + list(frequent):
        if 0 <= t < vocab and len(chosen) < room:
            chosen.setdefault(int(t), None)
    low = 0
    while len(chosen) < room:
        chosen.setdefault(low, None)
        low += 1
    return DraftVocabulary(np.array(sorted(chosen), dtype=np.int64), vocab)
