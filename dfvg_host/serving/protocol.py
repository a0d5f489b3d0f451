"""OpenAI's request fields, checked, and its error shape.

Every request the server cannot honour exactly is refused with a 4xx and OpenAI's error
object, whose message says what to change::

    {"error": {"message": "...", "type": "invalid_request_error", "param": "n", "code": null}}

What is honoured: ``temperature`` (0 is greedy), ``top_p`` and the vLLM extension
``top_k`` (both shape the target's distribution, which speculative sampling reproduces
exactly), ``max_tokens`` (``max_completion_tokens`` in chat), ``stop`` (up to four
strings), ``seed``, ``stream`` with ``stream_options.include_usage``, ``n = 1``, ``user``.
What is refused: ``n > 1``, ``best_of > 1``, ``logprobs``, ``echo``, ``suffix``, penalties,
``logit_bias``, tools and response formats, and any field OpenAI's API does not have.
"""

from __future__ import annotations

import json
import secrets
from dataclasses import dataclass

from dfvg_host.acceptance import SamplingParams

__all__ = ["APIError", "RequestParams", "parse_json", "parse_completion", "parse_chat",
           "DEFAULT_COMPLETION_MAX_TOKENS"]

#: OpenAI's default ``max_tokens`` of the legacy completions endpoint; chat defaults to
#: the rest of the context.
DEFAULT_COMPLETION_MAX_TOKENS = 16
MAX_STOP_STRINGS = 4

_COMMON = {"model", "max_tokens", "temperature", "top_p", "top_k", "stop", "seed", "n", "stream",
           "stream_options", "user", "logprobs", "presence_penalty", "frequency_penalty",
           "logit_bias"}
_COMPLETION_FIELDS = _COMMON | {"prompt", "best_of", "echo", "suffix"}
_CHAT_FIELDS = _COMMON | {"messages", "max_completion_tokens", "top_logprobs", "tools", "tool_choice",
                          "functions", "function_call", "response_format", "parallel_tool_calls"}
_UNSUPPORTED = ("tools", "tool_choice", "functions", "function_call", "response_format",
                "parallel_tool_calls")


class APIError(Exception):
    """A request refused: the HTTP status and OpenAI's error object.

    Members
    -------
    status : int
    message : str
        What is wrong and what to change.
    type : str
        OpenAI's error type (``invalid_request_error``, ``rate_limit_error``, ...).
    param : str or None
        The request field at fault.
    code : str or None
    headers : dict
        Extra response headers (``Retry-After`` on a 429).
    """

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}


@dataclass(frozen=True)
class RequestParams:
    """What a completion or chat request asks for, checked.

    Members
    -------
    model : str
    max_tokens : int or None
        None: the endpoint's default.
    sampling : SamplingParams
        Temperature, top-p, top-k and the seed (drawn at random when not given).
    stop : tuple of str
    stream : bool
    include_usage : bool
        ``stream_options.include_usage``: a last chunk with the token counts.
    """
    model: str
    max_tokens: int | None
    sampling: SamplingParams
    stop: tuple[str, ...]
    stream: bool
    include_usage: bool


def parse_json(raw: bytes) -> dict:
    """The request body as a JSON object, or a 400 that says why not."""
    try:
        body = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise APIError(400, f"the request body is not valid JSON ({exc}); send a JSON object with "
                       "Content-Type: application/json") from None
    if not isinstance(body, dict):
        raise APIError(400, f"the request body must be a JSON object, not {type(body).__name__}")
    return body


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _refuse(param: str, message: str) -> APIError:
    return APIError(400, message, param=param)


def _check_fields(body: dict, allowed: set[str], endpoint: str) -> None:
    unknown = sorted(set(body) - allowed)
    if unknown:
        raise _refuse(unknown[0], f"unrecognized request argument supplied: {unknown[0]} (not a "
                      f"field of {endpoint})")
    for name in _UNSUPPORTED:
        if body.get(name) not in (None, [], {}):
            raise _refuse(name, f"{name} is not supported by this server; send plain text requests")


def _optional_int(body: dict, name: str, minimum: int) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if not _is_int(value) or value < minimum:
        raise _refuse(name, f"{name} must be an integer >= {minimum}, got {value!r}")
    return value


def _number(body: dict, name: str, default: float, low: float, high: float, *,
            low_open: bool = False) -> float:
    value = body.get(name)
    if value is None:
        return default
    if not _is_number(value) or value > high or (value <= low if low_open else value < low):
        bound = f"({low}, {high}]" if low_open else f"[{low}, {high}]"
        raise _refuse(name, f"{name} must be a number in {bound}, got {value!r}")
    return float(value)


def _stop(body: dict) -> tuple[str, ...]:
    stop = body.get("stop")
    if stop is None:
        return ()
    stops = [stop] if isinstance(stop, str) else stop
    if (not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops)
            or len(stops) > MAX_STOP_STRINGS):
        raise _refuse("stop", f"stop must be a non-empty string or a list of at most "
                      f"{MAX_STOP_STRINGS} non-empty strings, got {stop!r}")
    return tuple(stops)


def _refuse_unsupported(body: dict) -> None:
    if body.get("n", 1) != 1:
        raise _refuse("n", f"n = {body['n']!r}: this server returns one choice per request; "
                      "send n = 1 (or several requests)")
    if body.get("best_of") not in (None, 1):
        raise _refuse("best_of", "best_of > 1 is not supported; send best_of = 1")
    if body.get("logprobs") not in (None, False):
        raise _refuse("logprobs", "logprobs are not supported by this server; leave logprobs unset")
    if body.get("top_logprobs") is not None:
        raise _refuse("top_logprobs", "top_logprobs are not supported by this server")
    if body.get("echo") not in (None, False):
        raise _refuse("echo", "echo is not supported; the prompt is not returned")
    if body.get("suffix") not in (None, ""):
        raise _refuse("suffix", "suffix (insertion) is not supported")
    for name in ("presence_penalty", "frequency_penalty"):
        if body.get(name) not in (None, 0, 0.0):
            raise _refuse(name, f"{name} is not supported: a penalty changes the target's "
                          "distribution per token, which this server does not apply; send 0")
    if body.get("logit_bias") not in (None, {}):
        raise _refuse("logit_bias", "logit_bias is not supported; leave it unset")
    if body.get("user") is not None and not isinstance(body["user"], str):
        raise _refuse("user", "user must be a string")


def _common(body: dict, max_tokens_field: str) -> RequestParams:
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise _refuse("model", "model is required: the name /v1/models lists")
    _refuse_unsupported(body)
    max_tokens = _optional_int(body, max_tokens_field, 1)
    if max_tokens_field != "max_tokens" and max_tokens is None:
        max_tokens = _optional_int(body, "max_tokens", 1)
    temperature = _number(body, "temperature", 1.0, 0.0, 2.0)
    top_p = _number(body, "top_p", 1.0, 0.0, 1.0, low_open=True)
    top_k = body.get("top_k")
    if top_k is None or top_k == -1:
        top_k = 0
    elif not _is_int(top_k) or top_k < 0:
        raise _refuse("top_k", f"top_k must be a non-negative integer (0 or -1: no limit), got {top_k!r}")
    seed = body.get("seed")
    if seed is None:
        seed = secrets.randbits(63)
    elif not _is_int(seed):
        raise _refuse("seed", f"seed must be an integer, got {seed!r}")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise _refuse("stream", f"stream must be true or false, got {stream!r}")
    options = body.get("stream_options")
    if options is not None and (not stream or not isinstance(options, dict)
                                or set(options) - {"include_usage"}):
        raise _refuse("stream_options", "stream_options is an object {\"include_usage\": bool} and "
                      "only goes with stream = true")
    sampling = SamplingParams(temperature=temperature, top_k=top_k, seed=seed % (1 << 64),
                              top_p=top_p)
    return RequestParams(model, max_tokens, sampling, _stop(body), stream,
                         bool((options or {}).get("include_usage", False)))


def parse_completion(body: dict) -> tuple[str | list[int], RequestParams]:
    """``/v1/completions``: the prompt (text, or token ids) and the parameters."""
    _check_fields(body, _COMPLETION_FIELDS, "/v1/completions")
    params = _common(body, "max_tokens")
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, str) and prompt:
        return prompt, params
    if isinstance(prompt, list) and prompt and all(_is_int(t) and t >= 0 for t in prompt):
        return prompt, params
    raise _refuse("prompt", "prompt must be a non-empty string or a non-empty list of token ids "
                  "(one prompt per request)")


def _message_text(message, index: int) -> tuple[str, str]:
    if not isinstance(message, dict) or not isinstance(message.get("role"), str):
        raise _refuse("messages", f"messages[{index}] must be an object with a role and a content")
    content = message.get("content")
    if isinstance(content, list):
        parts = []
        for part in content:
            if not (isinstance(part, dict) and part.get("type") == "text"
                    and isinstance(part.get("text"), str)):
                raise _refuse("messages", f"messages[{index}].content: only text parts are supported")
            parts.append(part["text"])
        content = "".join(parts)
    if not isinstance(content, str):
        raise _refuse("messages", f"messages[{index}].content must be a string or text parts")
    return message["role"], content


def parse_chat(body: dict) -> tuple[list[dict], RequestParams]:
    """``/v1/chat/completions``: the messages (role and text) and the parameters."""
    _check_fields(body, _CHAT_FIELDS, "/v1/chat/completions")
    params = _common(body, "max_completion_tokens")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise _refuse("messages", "messages must be a non-empty list of {role, content} objects")
    parsed = [dict(zip(("role", "content"), _message_text(m, i))) for i, m in enumerate(messages)]
    return parsed, params
