"""The FastAPI application of ``dfvg serve``: OpenAI's completions and chat endpoints.

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions`` (both streaming by
server-sent events with ``"stream": true``, as OpenAI's API does), ``GET /v1/models``,
``GET /health`` and ``GET /metrics`` (Prometheus). Requests are decoded by the
:class:`~dfvg_host.serving.scheduler.Scheduler` on its own thread; each request reads its
tokens from an asyncio queue the scheduler fills. A client that disconnects cancels its
sequence, which frees its place and its KV slots at the next round.

Every response carries, beside OpenAI's fields, a ``dfvg`` object: the sequence's drafted
and accepted tokens, rounds, and its latency measured and projected (engine time
modelled; see :mod:`~dfvg_host.serving.scheduler`).
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from dfvg_host.serving.prometheus import CONTENT_TYPE, ServerMetrics
from dfvg_host.serving.protocol import (DEFAULT_COMPLETION_MAX_TOKENS, APIError, RequestParams,
                                        parse_chat, parse_completion, parse_json)
from dfvg_host.serving.scheduler import Overloaded, Scheduler, Sequence
from dfvg_host.serving.text import TextStream

__all__ = ["create_app", "ServedModel"]

#: How often a request waiting for tokens checks that its client is still there.
_DISCONNECT_POLL_S = 0.25


@dataclass
class ServedModel:
    """What the server decodes with.

    Members
    -------
    name : str
        The model name clients send (``/v1/models`` lists it).
    scheduler : Scheduler
    tokenizer : transformers tokenizer
    chat_template : str or None
        Overrides the tokenizer's own (``--chat-template``).
    """
    name: str
    scheduler: Scheduler
    tokenizer: object
    chat_template: str | None = None

    def encode_prompt(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            ids = self.tokenizer(prompt)["input_ids"]
            if not ids:
                raise APIError(400, "the prompt tokenises to nothing", param="prompt")
            return ids
        vocab = self.scheduler.verifier.vocab_size
        bad = next((t for t in prompt if t >= vocab), None)
        if bad is not None:
            raise APIError(400, f"token id {bad} is outside the vocabulary (0..{vocab - 1})",
                           param="prompt")
        return list(prompt)

    def encode_chat(self, messages: list[dict]) -> list[int]:
        template = self.chat_template or getattr(self.tokenizer, "chat_template", None)
        if not template:
            raise APIError(400, f"model {self.name!r} has no chat template: start the server with "
                           "--chat-template FILE (a Jinja template), or use /v1/completions",
                           param="messages")
        try:
            text = self.tokenizer.apply_chat_template(messages, chat_template=template,
                                                      add_generation_prompt=True, tokenize=False)
        except Exception as exc:             # noqa: BLE001 - a template error is the request's
            raise APIError(400, f"the chat template cannot render these messages: {exc}",
                           param="messages") from None
        # The template writes the special tokens itself.
        ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        if not ids:
            raise APIError(400, "the chat template renders these messages to nothing", param="messages")
        return ids


class _Exchange:
    """One request's bridge from the scheduler's thread to the event loop."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self.queue: asyncio.Queue = asyncio.Queue()

    def on_event(self, seq: Sequence, tokens: list[int], finish: str | None) -> None:
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, (tokens, finish))
        except RuntimeError:
            # The server stopped (its loop is closed): nobody is left to read the event.
            pass


def _dfvg_fields(seq: Sequence) -> dict:
    m = seq.metrics
    return {"drafted_tokens": m.drafted_tokens, "accepted_tokens": m.accepted_tokens,
            "rounds": m.rounds, "acceptance_rate": m.acceptance_rate,
            "engine_cycles": m.device_cycles, "latency_s": seq.latency,
            "projected_latency_s": seq.projected_latency,
            "labels": {"latency_s": "measured wall",
                       "projected_latency_s": "measured wall - simulator wall + modelled engine "
                                              "and PCIe time"}}


def _usage(seq: Sequence) -> dict:
    return {"prompt_tokens": len(seq.prompt), "completion_tokens": len(seq.tokens),
            "total_tokens": len(seq.prompt) + len(seq.tokens)}


class _Decode:
    """Runs one request through the scheduler and yields its text as it becomes final."""

    def __init__(self, served: ServedModel, metrics: ServerMetrics, prompt: list[int],
                 params: RequestParams, max_tokens: int):
        self.served = served
        self.metrics = metrics
        self.exchange = _Exchange(asyncio.get_running_loop())
        self.text = TextStream(served.tokenizer, params.stop)
        try:
            self.seq = served.scheduler.submit(prompt, max_tokens, params.sampling,
                                               self.exchange.on_event)
        except Overloaded as exc:
            metrics.rejected += 1
            raise APIError(429, str(exc), type="rate_limit_error", code="server_busy",
                           headers={"Retry-After": str(exc.retry_after_s)}) from None
        except ValueError as exc:
            raise APIError(400, str(exc), param="max_tokens") from None
        self.finish_reason: str | None = None

    async def pieces(self, request: Request):
        """Text pieces until the sequence ends; ``finish_reason`` is set then."""
        try:
            while self.finish_reason is None:
                try:
                    tokens, finish = await asyncio.wait_for(self.exchange.queue.get(), _DISCONNECT_POLL_S)
                except asyncio.TimeoutError:
                    if await request.is_disconnected():
                        self.seq.cancel()
                        return
                    continue
                piece = self.text.feed(tokens)
                if self.text.stopped:
                    self.served.scheduler.end(self.seq, "stop")
                    self.finish_reason = "stop"
                elif finish is not None:
                    piece += self.text.finish()
                    self.finish_reason = finish
                if self.finish_reason is not None:
                    self.metrics.observe(self.seq)
                if piece:
                    yield piece
        finally:
            if self.finish_reason is None:
                self.seq.cancel()


def _sse(payload) -> str:
    return f"data: {payload if isinstance(payload, str) else json.dumps(payload)}\n\n"


def create_app(served: ServedModel) -> FastAPI:
    """The application; ``served.scheduler`` must be started (and stopped) by the caller."""
    app = FastAPI(title="dfvg serve", description="OpenAI-compatible speculative decoding: draft on "
                  "the DFVG engine, verify on the target.")
    metrics = ServerMetrics(served.scheduler, served.name)
    app.state.served = served
    app.state.metrics = metrics

    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError):
        return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)

    def check_model(params: RequestParams) -> None:
        if params.model != served.name:
            raise APIError(404, f"the model {params.model!r} does not exist on this server; it "
                           f"serves {served.name!r} (GET /v1/models)", param="model",
                           code="model_not_found")

    def max_tokens_for(params: RequestParams, prompt: list[int], default: int | None) -> int:
        if params.max_tokens is not None:
            return params.max_tokens
        rest = served.scheduler.context_limit - len(prompt)
        return max(1, min(default, rest) if default else rest)

    async def run(request: Request, prompt: list[int], params: RequestParams, default_max: int | None,
                  kind: str):
        decode = _Decode(served, metrics, prompt, params, max_tokens_for(params, prompt, default_max))
        rid = f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex}"
        created = int(time.time())
        if params.stream:
            return StreamingResponse(_stream(request, decode, params, rid, created, kind),
                                     media_type="text/event-stream")
        text = "".join([piece async for piece in decode.pieces(request)])
        if decode.finish_reason is None:     # the client went away
            return Response(status_code=499)
        choice = {"index": 0, "finish_reason": decode.finish_reason, "logprobs": None}
        if kind == "chat":
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
        return JSONResponse({"id": rid, "object": "chat.completion" if kind == "chat" else "text_completion",
                             "created": created, "model": served.name, "choices": [choice],
                             "usage": _usage(decode.seq), "dfvg": _dfvg_fields(decode.seq)})

    async def _stream(request: Request, decode: _Decode, params: RequestParams, rid: str, created: int,
                      kind: str):
        obj = "chat.completion.chunk" if kind == "chat" else "text_completion"

        def chunk(piece: str | None, finish: str | None, **extra) -> dict:
            if kind == "chat":
                delta = {} if piece is None else {"content": piece}
                choice = {"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}
            else:
                choice = {"index": 0, "text": piece or "", "finish_reason": finish, "logprobs": None}
            return {"id": rid, "object": obj, "created": created, "model": served.name,
                    "choices": [choice], **extra}

        if kind == "chat":
            first = chunk(None, None)
            first["choices"][0]["delta"] = {"role": "assistant", "content": ""}
            yield _sse(first)
        async for piece in decode.pieces(request):
            yield _sse(chunk(piece, None))
        if decode.finish_reason is None:
            return
        yield _sse(chunk(None if kind == "chat" else "", decode.finish_reason, dfvg=_dfvg_fields(decode.seq)))
        if params.include_usage:
            usage = chunk(None, None, usage=_usage(decode.seq))
            usage["choices"] = []
            yield _sse(usage)
        yield _sse("[DONE]")

    @app.post("/v1/completions")
    async def completions(request: Request):
        prompt, params = parse_completion(parse_json(await request.body()))
        check_model(params)
        return await run(request, served.encode_prompt(prompt), params, DEFAULT_COMPLETION_MAX_TOKENS,
                         "completion")

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        messages, params = parse_chat(parse_json(await request.body()))
        check_model(params)
        return await run(request, served.encode_chat(messages), params, None, "chat")

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": served.name, "object": "model", "created": 0,
                                            "owned_by": "dfvg",
                                            "max_model_len": served.scheduler.context_limit}]}

    @app.get("/health")
    async def health():
        if not served.scheduler.alive:
            return JSONResponse({"status": "scheduler stopped"}, status_code=503)
        return {"status": "ok", "running": served.scheduler.running, "waiting": served.scheduler.waiting,
                "draft_device": "given up: " + served.scheduler.device_given_up
                if served.scheduler.device_given_up else
                ("none (target only)" if served.scheduler.device is None else "ok")}

    @app.get("/metrics")
    async def prometheus_metrics():
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    return app
