"""The server's request checks, OpenAI error shape, top-p, and incremental text with stop
strings, without a server."""

from __future__ import annotations

import pytest
import torch

from dfvg_host.acceptance import SamplingParams, target_distribution
from dfvg_host.serving.protocol import APIError, parse_chat, parse_completion, parse_json
from dfvg_host.serving.text import TextStream


def test_defaults_follow_openai():
    prompt, params = parse_completion({"model": "m", "prompt": "hello"})
    assert prompt == "hello" and params.max_tokens is None and params.stop == ()
    assert params.sampling.temperature == 1.0 and params.sampling.top_p == 1.0
    assert not params.stream and not params.include_usage
    _, params = parse_completion({"model": "m", "prompt": [1, 2], "seed": 5, "temperature": 0,
                                  "stop": "\n", "stream": True, "stream_options": {"include_usage": True}})
    assert params.sampling.seed == 5 and params.sampling.greedy and params.stop == ("\n",)
    assert params.include_usage
    messages, params = parse_chat({"model": "m", "max_completion_tokens": 7, "messages": [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]})
    assert messages[1] == {"role": "user", "content": "ab"} and params.max_tokens == 7


@pytest.mark.parametrize("body, param", [
    ({"model": "m", "prompt": "x", "n": 3}, "n"),
    ({"model": "m", "prompt": "x", "best_of": 2}, "best_of"),
    ({"model": "m", "prompt": "x", "echo": True}, "echo"),
    ({"model": "m", "prompt": "x", "suffix": "y"}, "suffix"),
    ({"model": "m", "prompt": "x", "presence_penalty": 1}, "presence_penalty"),
    ({"model": "m", "prompt": "x", "logit_bias": {"5": 1}}, "logit_bias"),
    ({"model": "m", "prompt": "x", "max_tokens": 0}, "max_tokens"),
    ({"model": "m", "prompt": "x", "max_tokens": True}, "max_tokens"),
    ({"model": "m", "prompt": "x", "top_k": -2}, "top_k"),
    ({"model": "m", "prompt": "x", "seed": "1"}, "seed"),
    ({"model": "m", "prompt": "x", "stream": "yes"}, "stream"),
    ({"model": "m", "prompt": "x", "stream_options": {"include_usage": True}}, "stream_options"),
    ({"model": "m", "prompt": ["a", "b"]}, "prompt"),
    ({"model": "m", "prompt": [1, -1]}, "prompt"),
    ({"prompt": "x"}, "model"),
])
def test_refusals_name_the_field(body, param):
    with pytest.raises(APIError) as info:
        parse_completion(body)
    err = info.value
    assert err.status == 400 and err.param == param and err.message
    assert err.body() == {"error": {"message": err.message, "type": "invalid_request_error",
                                    "param": param, "code": None}}


def test_chat_refuses_tools_and_bad_json():
    with pytest.raises(APIError, match="tools is not supported"):
        parse_chat({"model": "m", "messages": [{"role": "user", "content": "x"}],
                    "tools": [{"type": "function"}]})
    for raw in (b"{", b"\xff\xfe", b"3"):
        with pytest.raises(APIError) as info:
            parse_json(raw)
        assert info.value.status == 400


def test_top_p_keeps_the_smallest_nucleus():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    for top_p, kept in ((0.5, 1), (0.51, 2), (0.8, 2), (0.81, 3), (1.0, 4)):
        p = target_distribution(logits, SamplingParams(temperature=1.0, top_p=top_p))[0]
        assert int((p > 0).sum()) == kept, top_p
        assert torch.allclose(p[:kept], torch.tensor([0.5, 0.3, 0.15, 0.05][:kept],
                                                     dtype=torch.float64) / sum([0.5, 0.3, 0.15, 0.05][:kept]))
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(temperature=1.0, top_p=0.0).validate()


class _CharTokenizer:
    """Token i is byte i; a lone UTF-8 lead byte decodes to U+FFFD, as real tokenizers do."""

    def decode(self, ids, skip_special_tokens=True):
        return bytes(ids).decode("utf-8", errors="replace")


def _bytes(text: str) -> list[int]:
    return list(text.encode())


def test_text_stream_releases_exactly_the_decoded_text():
    text = "héllo wörld — ünïcode ✓"
    stream = TextStream(_CharTokenizer())
    pieces = [stream.feed([b]) for b in _bytes(text)] + [stream.finish()]
    assert "".join(pieces) == text and "\ufffd" not in "".join(pieces)


def test_text_stream_stops_before_the_stop_string_across_rounds():
    stream = TextStream(_CharTokenizer(), stop=("END", "\n\n"))
    out = stream.feed(_bytes("abc E"))
    assert out == "abc"                   # " E" could begin "END": held back
    out += stream.feed(_bytes("N"))
    out += stream.feed(_bytes("D and more"))
    assert out + stream.finish() == "abc " and stream.stopped
    assert stream.feed(_bytes("x")) == ""
    first = TextStream(_CharTokenizer(), stop=("END", "b"))
    assert first.feed(_bytes("aENDb")) == "a"   # the earliest stop string wins
