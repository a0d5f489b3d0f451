"""`dfvg generate` when the draft device or the target fails mid-generation: the tokens
reach the user, the exit code and one stderr line say what happened, and with a device
that never works the output is still exactly the target's greedy decoding."""

from __future__ import annotations

import json
import math

import pytest

from dfvg_hw.spec.descriptors import ErrorCode
from dfvg_host import cli
from dfvg_host.fault_injection import Fault, FaultInjectingTransport, FaultKind

ARGS = ["generate", "--prompt", "import os\n\ndef main():\n", "--max-new-tokens", "12", "--gamma", "3",
        "--json"]


def run(capsys, argv=ARGS):
    code = cli.main(argv)
    out = capsys.readouterr()
    return code, json.loads(out.out), [line for line in out.err.splitlines() if line.startswith("dfvg:")]


@pytest.fixture
def clean(capsys):
    code, result, lines = run(capsys)
    assert code == 0 and not lines and not result["degraded"]
    return result


def failing_device(monkeypatch, fault: Fault):
    """``--device`` opens the sim device behind an injector that arms itself once the
    image and program are loaded (the first START)."""
    open_device = cli._open_device

    def open_with_faults(url):
        transport, engine = open_device(url)
        return FaultInjectingTransport(transport, [fault]), engine
    monkeypatch.setattr(cli, "_open_device", open_with_faults)


def test_device_that_never_works_falls_back_to_the_target(clean, monkeypatch, capsys):
    failing_device(monkeypatch, Fault(FaultKind.ERROR, repeat=math.inf, code=ErrorCode.WATCHDOG))
    code, result, lines = run(capsys)
    assert code == 0
    assert result["token_ids"] == clean["token_ids"]
    assert result["degraded"] and result["stop_reason"] == "max_new_tokens"
    assert result["metrics"]["fallback_tokens"] == 12 and result["metrics"]["device_resets"] == 2
    assert len(lines) == 1 and lines[0].startswith("dfvg: warning: the draft device was given up")


def test_verifier_error_keeps_the_tokens(clean, monkeypatch, capsys):
    from dfvg_host.verifier import Verifier
    score = Verifier.score

    def score_then_fail(self, drafts):
        if self.forwards >= 3:           # the prefill and two rounds succeed
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        return score(self, drafts)
    monkeypatch.setattr(Verifier, "score", score_then_fail)
    code, result, lines = run(capsys)
    assert code == 1 and result["stop_reason"] == "verifier_error"
    kept = result["token_ids"]
    assert 2 <= len(kept) < 12 and kept == clean["token_ids"][:len(kept)]
    assert len(lines) == 1 and lines[0].startswith("dfvg: error:") and "illegal memory access" in lines[0]
    assert "RuntimeError" in result["error"]
