"""How closely a compiled draft follows its float model: teacher-forced agreement.

The engine (the bit-exact functional model) and the float model read the same tokens;
at every position the engine's greedy token is compared with the float model's argmax,
and the engine's logits (Q7.8) with the float logits by cosine. Teacher forcing keeps the
two on the same path, so one early disagreement does not spoil every later position.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from dfvg_hw.spec import numerics as nx
from dfvg_hw.spec.config import EngineConfig
from dfvg_hw.spec.descriptors import DraftRequest, ErrorCode
from sim.session import FunctionalSession

__all__ = ["Agreement", "teacher_forced_agreement", "segments"]


@dataclass(frozen=True)
class Agreement:
    """Teacher-forced agreement of a compiled draft with its float model.

    Members
    -------
    positions : int
        Positions compared.
    top1 : float
        Fraction of positions where the engine's greedy token is the float model's argmax.
    mean_cosine, min_cosine : float
        Cosine similarity of the engine's logits with the float logits.
    """

    positions: int
    top1: float
    mean_cosine: float
    min_cosine: float

    def describe(self) -> str:
        return (f"top-1 agreement {100 * self.top1:.2f} %, logit cosine mean {self.mean_cosine:.4f} "
                f"min {self.min_cosine:.4f} over {self.positions} teacher-forced positions")


def segments(token_ids: list[int], length: int, count: int) -> list[list[int]]:
    """Up to ``count`` consecutive, non-overlapping segments of ``length`` tokens."""
    return [token_ids[i:i + length] for i in range(0, len(token_ids) - length + 1, length)][:count]


def teacher_forced_agreement(model, engine: EngineConfig, image: bytes, program: list[int],
                             token_segments: list[list[int]], vocabulary=None) -> Agreement:
    """Run every segment from position 0 on the engine and on the float ``model``.

    Each position is one request of one token with ``n_draft = 1``: the engine extends its
    KV cache exactly as in drafting, and its logit buffer holds that position's logits.
    With a draft ``vocabulary`` (:class:`~dfvg_host.draft_vocab.DraftVocabulary`) the
    engine reads and drafts its ids: the float argmax still counts over the whole
    vocabulary (a dropped token is a miss), the cosine over the kept tokens' logits.
    """
    import torch

    session = FunctionalSession(engine, image, program)
    kept = slice(None) if vocabulary is None else vocabulary.kept
    agree, cosines = 0, []
    for seq in token_segments:
        with torch.no_grad():
            ref = model(torch.tensor([seq])).logits[0].double().numpy()
        fed = seq if vocabulary is None else vocabulary.to_engine(seq)
        for pos, token in enumerate(fed):
            result = session.run(DraftRequest(tokens=[token], start_pos=pos, n_draft=1))
            if result.status != ErrorCode.OK:
                raise RuntimeError(f"the engine stopped at position {pos}: "
                                   f"{ErrorCode(result.status).name}")
            logits = session.engine.logits / float(1 << nx.LOGIT_FRAC)
            drafted = result.tokens[0].token
            drafted = drafted if vocabulary is None else vocabulary.to_model([drafted])[0]
            agree += drafted == int(np.argmax(ref[pos]))
            ref_pos = ref[pos][kept]
            norm = np.linalg.norm(logits) * np.linalg.norm(ref_pos)
            cosines.append(float(logits @ ref_pos / norm) if norm else 0.0)
    return Agreement(len(cosines), agree / max(len(cosines), 1), float(np.mean(cosines)),
                     float(np.min(cosines)))
