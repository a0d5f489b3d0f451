"""Check a tensor-parallel target: ``torchrun --nproc-per-node N -m dfvg_host.tensor_parallel --target DIR``.

Every rank loads the target with transformers' tensor-parallel plan (``tp_plan="auto"``:
attention heads and MLP columns split over the ranks, DTensor weights) on the ``gloo``
backend on cpu, ``nccl`` on cuda, and runs the same greedy speculative decoding of a few
prompts through a :class:`~dfvg_host.batch_verifier.BatchVerifier`, all prompts in each
forward pass. The drafts are prompt-lookup guesses (the tokens that followed the last
occurrence of the last token), so rounds accept some drafts and crop the rest. Rank 0 then
loads the target alone, decodes each prompt with ``generate(do_sample=False)`` and checks
that the tokens are equal; every rank exits 0 when they are, 1 when they are not.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from dfvg_host.batch_verifier import BatchVerifier

__all__ = ["main", "greedy_decode", "lookup_drafts", "single_process_tokens", "DEFAULT_PROMPTS"]

DEFAULT_PROMPTS = ("def read_config(path):", "import os\nimport sys\n", "class Stack:\n    def push(self, item):",
                   "for i in range(10):")


def lookup_drafts(tokens: list[int], k: int) -> list[int]:
    """Up to ``k`` tokens that followed the last earlier occurrence of ``tokens[-1]``."""
    last = tokens[-1]
    for start in range(len(tokens) - 2, -1, -1):
        if tokens[start] == last:
            return tokens[start + 1:start + 1 + k]
    return []


def greedy_decode(bv: BatchVerifier, prompts: list[list[int]], max_new_tokens: int, *, gamma: int = 3,
                  eos: int | None = None) -> list[list[int]]:
    """Greedy speculative decoding of every prompt at once through ``bv`` (one forward pass
    per round for all the unfinished ones); the generated tokens of each prompt."""
    out: list[list[int]] = [[] for _ in prompts]
    for i, prompt in enumerate(prompts):
        bv.add(i, prompt)
    while len(bv):
        drafts = {i: lookup_drafts(prompts[i] + out[i], min(gamma, max_new_tokens - len(out[i]) - 1))
                  for i in range(len(prompts)) if i in bv}
        for i, logits in bv.score(drafts).items():
            best = logits.argmax(-1).tolist()
            accepted = 0
            while accepted < len(drafts[i]) and drafts[i][accepted] == best[accepted]:
                accepted += 1
            bv.commit(i, accepted, len(drafts[i]), best[accepted])
            out[i] += drafts[i][:accepted] + [best[accepted]]
            if eos is not None and eos in out[i]:
                out[i] = out[i][:out[i].index(eos) + 1]
            if len(out[i]) >= max_new_tokens or (eos is not None and out[i][-1] == eos):
                bv.remove(i)
    return out


def single_process_tokens(target: Path, prompts: list[list[int]], max_new_tokens: int, dtype: str | None):
    """What the target alone decodes greedily, one prompt at a time."""
    from dfvg_host.verifier import load_target
    model, device = load_target(target, device="cpu", dtype=dtype)
    out = []
    for prompt in prompts:
        with torch.no_grad():
            ids = model.generate(torch.tensor([prompt], device=device), max_new_tokens=max_new_tokens,
                                 do_sample=False)
        out.append(ids[0, len(prompt):].tolist())
    return out


def init_distributed(device: str) -> torch.device:
    """Join the ``torchrun`` process group: gloo on cpu, nccl on cuda (one GPU per local rank)."""
    if "WORLD_SIZE" not in os.environ:
        raise SystemExit("dfvg_host.tensor_parallel: run it under torchrun, e.g. torchrun --nproc-per-node 2 "
                         "-m dfvg_host.tensor_parallel --target DIR")
    if device == "cuda":
        local = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(local)
        dist.init_process_group("nccl", device_id=local)
        return local
    dist.init_process_group("gloo")
    return torch.device("cpu")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m dfvg_host.tensor_parallel", description=__doc__.splitlines()[0])
    p.add_argument("--target", type=Path, required=True, help="local HF model directory")
    p.add_argument("--prompt", action="append", help="prompt text (repeatable; default: four code snippets)")
    p.add_argument("--max-new-tokens", type=int, default=24)
    p.add_argument("--gamma", type=int, default=3, help="prompt-lookup drafts per round")
    p.add_argument("--dtype", default=None)
    p.add_argument("--device", choices=("cpu", "cuda"), default="cuda" if torch.cuda.is_available() else "cpu")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from dfvg_host.checkpoints import load_tokenizer
    device = init_distributed(args.device)
    rank, world = dist.get_rank(), dist.get_world_size()
    try:
        tok = load_tokenizer(args.target, "target")
        prompts = [tok.encode(text) for text in (args.prompt or DEFAULT_PROMPTS)]
        bv = BatchVerifier.from_pretrained(args.target, dtype=args.dtype, tp_plan="auto")
        got = greedy_decode(bv, prompts, args.max_new_tokens, gamma=args.gamma, eos=tok.eos_token_id)
        verdict = [None]
        if rank == 0:
            want = single_process_tokens(args.target, prompts, args.max_new_tokens, args.dtype)
            equal = got == want
            print(f"tensor parallel: {world} ranks ({dist.get_backend()}, {device}), tp_size {bv.model.tp_size}, "
                  f"{len(prompts)} prompts x {args.max_new_tokens} tokens in {bv.forwards} forwards "
                  f"({bv.seconds:.2f} s): {'identical to' if equal else 'DIFFERENT from'} the "
                  "single-process model")
            for g, w in zip(got, want):
                if g != w:
                    print(f"  tensor parallel {g}\n  single process  {w}")
            verdict = [equal]
        dist.broadcast_object_list(verdict, src=0)
        return 0 if verdict[0] else 1
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
