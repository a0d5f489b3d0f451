"""The compiled demo draft on the functional model against the float draft."""

import numpy as np
import torch

from dfvg_hw.spec.config import get_preset
from dfvg_hw.spec.descriptors import DraftRequest, ErrorCode
from dfvg_host.compiler import load_model
from sim.session import FunctionalSession

POSITIONS = 1000
SEGMENT = 250


def test_int8_engine_agrees_with_float_draft(demo_pair, demo_compiled):
    """≥ 97 % greedy next-token agreement and mean logit cosine ≥ 0.99 on 1000 held-out positions."""
    from transformers import AutoTokenizer
    draft_dir, _, data_dir = demo_pair
    tok = AutoTokenizer.from_pretrained(draft_dir)
    ids = tok((data_dir / "heldout.txt").read_text())["input_ids"]
    assert len(ids) >= POSITIONS
    model = load_model(draft_dir)
    session = FunctionalSession(get_preset("alveo-u55c"), demo_compiled.image, demo_compiled.program)
    agree, cosines = 0, []
    for start in range(0, POSITIONS, SEGMENT):
        seq = ids[start:start + SEGMENT]
        with torch.no_grad():
            ref = model(torch.tensor([seq])).logits[0].double().numpy()
        for pos, token in enumerate(seq):
            # Teacher-forced: feed the held-out token at its position, draft one token.
            r = session.run(DraftRequest(tokens=[token], start_pos=pos, n_draft=1))
            assert r.status == ErrorCode.OK
            engine_logits = session.engine.logits / 256.0      # Q7.8
            agree += r.tokens[0].token == int(np.argmax(ref[pos]))
            cosines.append(engine_logits @ ref[pos] / np.linalg.norm(engine_logits) / np.linalg.norm(ref[pos]))
    agreement, cosine = agree / POSITIONS, float(np.mean(cosines))
    print(f"\nint8 engine vs float draft on {POSITIONS} held-out positions: "
          f"greedy agreement {agreement:.4f}, mean logit cosine {cosine:.5f}, min {min(cosines):.5f}")
    assert agreement >= 0.97
    assert cosine >= 0.99
