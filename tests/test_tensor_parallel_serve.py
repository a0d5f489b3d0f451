"""``dfvg serve --tensor-parallel`` under torchrun: two ranks on gloo serve over HTTP as one.

Rank 0 serves (HTTP, scheduler, the ``sim`` draft device) and broadcasts every verifier
call; rank 1 holds the other half of the target and repeats them. Greedy completions,
one at a time and four at once, must be the target's own greedy decoding; SIGTERM to
torchrun must take every process down, the follower told to stop by rank 0.
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import torch

from dfvg_host import cli

ROOT = Path(__file__).resolve().parents[1]
TARGET = ROOT / "models" / "demo-target"
DRAFT = ROOT / "models" / "demo-draft"
TORCHRUN = Path(sys.executable).parent / "torchrun"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def children(pid: int) -> list[int]:
    """The pids whose parent is ``pid`` (from /proc)."""
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                out.append(int(entry.name))
    return out


def alive(pid: int) -> bool:
    try:
        return (Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def greedy_reference(target, ids: list[int], max_new_tokens: int, eos: int) -> list[int]:
    with torch.no_grad():
        out = target.generate(torch.tensor([ids]), max_new_tokens=max_new_tokens, do_sample=False,
                              eos_token_id=eos, pad_token_id=eos)
    return out[0, len(ids):].tolist()


def test_tensor_parallel_outside_torchrun_says_how_to_run_it(monkeypatch, capsys):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    code = cli.main(["serve", "--tensor-parallel", "--port", "0", "--target", str(TARGET), "--draft", str(DRAFT),
                     "--device", "sim://alveo-u55c"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1, err
    assert "torchrun --nproc-per-node N -m dfvg_host.cli serve --tensor-parallel" in err


@pytest.mark.skipif(not TORCHRUN.exists() or not Path("/proc/self/stat").exists(),
                    reason="needs torchrun next to this Python and /proc")
def test_two_ranks_serve_greedy_as_the_target_alone(tmp_path, demo_pair):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    out, err = open(tmp_path / "stdout", "w+"), open(tmp_path / "stderr", "w+")
    run = subprocess.Popen([str(TORCHRUN), "--standalone", "--nproc-per-node", "2", "-m", "dfvg_host.cli", "serve",
                            "--tensor-parallel", "--port", str(port), "--target", str(TARGET), "--draft", str(DRAFT),
                            "--device", "sim://alveo-u55c", "--log-level", "warning"],
                           cwd=ROOT, env=env, stdout=out, stderr=err, start_new_session=True)
    ranks: list[int] = []

    def logs() -> str:
        out.seek(0), err.seek(0)
        return f"--- stdout\n{out.read()}\n--- stderr\n{err.read()[-4000:]}"

    try:
        tok = AutoTokenizer.from_pretrained(TARGET)
        target = AutoModelForCausalLM.from_pretrained(TARGET).eval()
        text = (demo_pair[2] / "heldout.txt").read_text()
        prompts = [text[i * 211:i * 211 + 60] for i in range(5)]
        want = [tok.decode(greedy_reference(target, tok(p)["input_ids"], 24, tok.eos_token_id),
                           skip_special_tokens=True) for p in prompts]

        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 75
        while True:
            assert run.poll() is None, f"torchrun exited with {run.returncode}\n{logs()}"
            assert time.monotonic() < deadline, f"no /health within 75 s\n{logs()}"
            try:
                health = httpx.get(url + "/health", timeout=2).json()
                break
            except httpx.HTTPError:
                time.sleep(0.5)
        assert health["status"] == "ok" and health["draft_device"] == "ok"
        ranks = children(run.pid)
        assert len(ranks) == 2, ranks

        def body(prompt):
            return {"model": "demo-target", "prompt": prompt, "max_tokens": 24, "temperature": 0}

        r = httpx.post(url + "/v1/completions", json=body(prompts[0]), timeout=60).json()
        assert r["choices"][0]["text"] == want[0]
        assert r["dfvg"]["drafted_tokens"] > 0

        async def four():
            async with httpx.AsyncClient(timeout=60) as client:
                rs = await asyncio.gather(*(client.post(url + "/v1/completions", json=body(p))
                                            for p in prompts[1:]))
            return [x.json()["choices"][0]["text"] for x in rs]

        assert asyncio.run(four()) == want[1:]
        out.seek(0)
        stdout = out.read()
        assert "rank 1 following rank 0" in stdout and "dfvg serve: model 'demo-target'" in stdout, logs()

        run.send_signal(signal.SIGTERM)
        # torchrun passes SIGTERM on and SIGKILLs what is left 30 s later: a follower that
        # was not told to stop would still be there at 20 s.
        try:
            run.wait(timeout=20)
        except subprocess.TimeoutExpired:
            pytest.fail(f"torchrun still running 20 s after SIGTERM\n{logs()}")
        deadline = time.monotonic() + 20
        while any(alive(pid) for pid in ranks) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not any(alive(pid) for pid in ranks), logs()
        assert "lost rank 0" not in logs()
    finally:
        if run.poll() is None:
            os.killpg(run.pid, signal.SIGKILL)
            run.wait()
        for pid in ranks:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
        out.close(), err.close()
