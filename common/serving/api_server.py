"""The OpenAI-compatible HTTP server: `build_app(async_engine, tokenizer, model_name)` -> a FastAPI app.

POST /v1/completions, POST /v1/chat/completions (JSON, or server-sent events with `stream: true`), GET /v1/models,
GET /health, GET /metrics. Every error is an OpenAI error body; no traceback ever reaches a client.

A request whose engine step failed answers 500 (an OpenAI error body), or in a stream ends with a choice whose
finish_reason is "error", an error event and [DONE]; the server goes on serving. A client that disconnects
aborts its requests, streaming or not, which frees their KV blocks.
"""
from __future__ import annotations

import asyncio
import json
import logging
import secrets
import time
import uuid

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from .async_engine import AsyncLLMEngine, EngineOverloaded
from .metrics import ServerMetrics
from .protocol import ChatCompletionRequest, CompletionRequest
from .pd_decode import DecodeConnector
from .pd_prefill import PrefillConnector, add_prefill_routes
from .pd_protocol import PREFILL_HEADER
from .responses import error_response, run_unless_disconnected
from .streams import TextStream, chat_logprobs, merge, start

logger = logging.getLogger("npu_cookbook.serving")
GENERATION_PATHS = ("/v1/completions", "/v1/chat/completions")
THINK_OPEN, THINK_CLOSE = "<think>", "</think>"


class APIError(Exception):
    def __init__(self, status: int, message: str, type: str = "invalid_request_error", param: str | None = None,
                 headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.headers = status, message, type, param, headers


class EndQuietlyOnCancel:
    """uvicorn cancels the responses still streaming when its graceful-shutdown timeout passes: end them there,
    without the traceback uvicorn would log for a cancelled application."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        try:
            await self.app(scope, receive, send)
        except asyncio.CancelledError:
            if scope["type"] != "http":
                raise
            logger.warning("%s cut off at shutdown", scope.get("path"))


def build_app(async_engine: AsyncLLMEngine, tokenizer, model_name: str, api_key: str | None = None,
              drain_timeout: float = 0.0) -> FastAPI:
    """PD roles: the engine's kv_connector decides (a DecodeConnector takes requests that name a prefill instance
    in the X-PD-Prefill header; a PrefillConnector adds the /pd routes)."""
    engine = async_engine.engine
    connector = engine.kv_connector
    metrics = ServerMetrics(engine)
    think_end_id = tokenizer.convert_tokens_to_ids(THINK_CLOSE) if THINK_CLOSE in tokenizer.get_vocab() else None

    async def lifespan(app: FastAPI):
        if connector is not None:
            connector.bind(async_engine, asyncio.get_running_loop())
        if not async_engine.started:
            async_engine.start()
        yield
        await asyncio.to_thread(async_engine.shutdown, drain_timeout)
        if connector is not None:
            await connector.aclose()

    app = FastAPI(title="npu-cookbook OpenAI-compatible server", lifespan=lifespan)
    app.add_middleware(EndQuietlyOnCancel)

    def check_api_key(request: Request) -> None:
        if api_key is None:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not secrets.compare_digest(token.strip().encode(), api_key.encode()):
            raise APIError(401, "missing or wrong API key (Authorization: Bearer <key>)", "authentication_error")

    def count_error(request: Request, outcome: str = "error") -> None:
        if request.url.path in GENERATION_PATHS:
            metrics.count(outcome)

    @app.exception_handler(APIError)
    async def on_api_error(request: Request, e: APIError):
        count_error(request, "rejected" if e.status == 503 else "error")
        return error_response(e.status, e.message, e.type, e.param, e.headers)

    @app.exception_handler(RequestValidationError)
    async def on_validation_error(request: Request, e: RequestValidationError):
        count_error(request)
        err = e.errors()[0] if e.errors() else {"loc": (), "msg": "invalid request"}
        loc = [str(x) for x in err.get("loc", ()) if x != "body"]
        if err.get("type") == "json_invalid":
            return error_response(400, f"the body is not valid JSON: {err.get('msg')}", "invalid_request_error")
        param = ".".join(loc) or None
        return error_response(400, f"{param or 'body'}: {err.get('msg')}", "invalid_request_error", param)

    @app.exception_handler(StarletteHTTPException)
    async def on_http_error(request: Request, e: StarletteHTTPException):
        return error_response(e.status_code, str(e.detail), "invalid_request_error" if e.status_code < 500 else
                              "internal_server_error", headers=getattr(e, "headers", None))

    @app.exception_handler(Exception)
    async def on_bug(request: Request, e: Exception):
        logger.exception("unhandled error on %s %s", request.method, request.url.path)
        count_error(request)
        return error_response(500, "internal server error", "internal_server_error")

    def check_model(model: str | None) -> None:
        if model is not None and model != model_name:
            raise APIError(404, f"the model `{model}` does not exist; this server serves `{model_name}`",
                           "NotFoundError", "model")

    def remote_prefill(raw: Request) -> dict | None:
        """PD decode side: the kv_transfer_params of a request the router paired with a prefill instance."""
        url = raw.headers.get(PREFILL_HEADER)
        if url is None:
            return None  # served here from the prompt on, as colocated
        if not isinstance(connector, DecodeConnector):
            raise APIError(400, f"{PREFILL_HEADER}: this instance is not a PD decode instance", param=PREFILL_HEADER)
        try:
            return {"do_remote_prefill": True, "prefill_url": connector.check_prefill_url(url)}
        except ValueError as e:
            raise APIError(400, str(e), param=PREFILL_HEADER) from None

    async def submit(prompts: list[list[int]], body, request_id: str, raw: Request) -> list:
        try:
            params = [body.sampling_params(len(p), engine.config.max_model_len, index=j)
                      for p in prompts for j in range(body.n)]
        except ValueError as e:
            raise APIError(400, str(e)) from None
        expanded = [p for p in prompts for _ in range(body.n)]
        kv = remote_prefill(raw)
        try:
            return await start(async_engine, expanded, params, request_id, kv)
        except EngineOverloaded as e:
            raise APIError(503, str(e), "server_overloaded", headers={"Retry-After": "1"}) from None
        except ValueError as e:
            raise APIError(400, str(e), param="prompt") from None

    def tokenize(prompt: str | list[int]) -> list[int]:
        return tokenizer(prompt, add_special_tokens=False).input_ids if isinstance(prompt, str) else list(prompt)

    def usage(prompts: list[list[int]], finals: dict) -> dict:
        prompt_tokens = sum(len(p) for p in prompts)
        completion_tokens = sum(len(o.token_ids) for o in finals.values())
        return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                "total_tokens": prompt_tokens + completion_tokens}

    def sse(obj) -> str:
        return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"

    async def event_stream(started, arrival, make_chunk, usage_chunk):
        finals, outcome = {}, "aborted"
        try:
            async for i, out in merge(started, metrics, arrival):
                chunk = make_chunk(i, out)
                if chunk is not None:
                    yield sse(chunk)
                if out.finished:
                    finals[i] = out
                if out.finish_reason == "error":  # the choice's finish_reason said it; the event says why
                    outcome = "error"
                    yield sse({"error": {"message": f"generation failed: {out.error}",
                                         "type": "internal_server_error", "param": None, "code": 500}})
                    yield "data: [DONE]\n\n"
                    return
            if usage_chunk is not None:
                yield sse(usage_chunk(finals))
            yield "data: [DONE]\n\n"
            outcome = "success"
        except Exception as e:  # noqa: BLE001 - headers are sent: report in-band
            logger.exception("generation failed mid-stream")
            outcome = "error"
            yield sse({"error": {"message": f"generation failed: {e}", "type": "internal_server_error",
                                 "param": None, "code": 500}})
            yield "data: [DONE]\n\n"
        finally:
            metrics.count(outcome)

    def stream_response(started, arrival, make_chunk, head, prompts, include_usage: bool) -> StreamingResponse:
        """SSE of the chunks make_chunk builds, then the usage chunk (include_usage) and [DONE]."""
        def usage_chunk(finals):
            return {**head, "choices": [], "usage": usage(prompts, finals)}
        return StreamingResponse(event_stream(started, arrival, make_chunk, usage_chunk if include_usage else None),
                                 media_type="text/event-stream")

    async def collect(started, arrival) -> dict:
        finals = {}
        async for i, out in merge(started, metrics, arrival):
            if out.finished:
                finals[i] = out
        failed = [out.error for out in finals.values() if out.finish_reason == "error"]
        if failed:
            raise APIError(500, f"generation failed: {failed[0]}", "internal_server_error")
        return finals

    async def whole(prompts, body, request_id: str, arrival: float, raw: Request) -> dict:
        return await collect(await submit(prompts, body, request_id, raw), arrival)

    async def unless_disconnected(raw: Request, work):
        finished, result = await run_unless_disconnected(raw, work)
        if not finished:
            metrics.count("aborted")
        return result

    @app.post("/v1/completions", dependencies=[Depends(check_api_key)])
    async def completions(body: CompletionRequest, raw: Request):
        arrival, created = time.perf_counter(), int(time.time())
        check_model(body.model)
        request_id = f"cmpl-{uuid.uuid4().hex}"
        prompts = [tokenize(p) for p in body.prompts]
        # echo: each choice's text starts with its prompt (as sent, or decoded from ids), log-probs too
        prompt_texts = [p if isinstance(p, str) else tokenizer.decode(ids) for p, ids in zip(body.prompts, prompts)]
        head = {"id": request_id, "object": "text_completion", "created": created, "model": model_name}
        streams = [TextStream(tokenizer, sp_stop(body)) for _ in range(len(prompts) * body.n)]

        def choice(i, out, text, first: bool):
            echo = body.echo and first
            ids = prompts[i // body.n]
            lps = None
            if body.logprobs is not None:
                lps = streams[i].completion_logprobs(streams[i].new_logprobs(out),
                                                     (ids, out.prompt_logprobs or []) if echo else None)
            return {"index": i, "text": prompt_texts[i // body.n] + text if echo else text, "logprobs": lps,
                    "finish_reason": out.finish_reason if out.finished else None}

        if body.stream:
            started = await unless_disconnected(raw, submit(prompts, body, request_id, raw))
            if started is None:
                return Response(status_code=499)  # gone before its first token (PD: while P prefilled)
            sent_first = set()

            def make_chunk(i, out):
                _, text = streams[i].update(out)
                first = i not in sent_first
                if not text and not out.finished and body.logprobs is None and not (body.echo and first):
                    return None
                sent_first.add(i)
                return {**head, "choices": [choice(i, out, text, first)]}
            return stream_response(started, arrival, make_chunk, head, prompts, body.include_usage)

        finals = await unless_disconnected(raw, whole(prompts, body, request_id, arrival, raw))
        if finals is None:
            return Response(status_code=499)  # nobody is listening
        metrics.count("success")
        choices = [choice(i, finals[i], streams[i].update(finals[i])[1], True) for i in range(len(finals))]
        return {**head, "choices": choices, "usage": usage(prompts, finals)}

    @app.post("/v1/chat/completions", dependencies=[Depends(check_api_key)])
    async def chat_completions(body: ChatCompletionRequest, raw: Request):
        arrival, created = time.perf_counter(), int(time.time())
        check_model(body.model)
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        try:
            text = tokenizer.apply_chat_template([m.as_template_input() for m in body.messages],
                                                 add_generation_prompt=True, tokenize=False,
                                                 **(body.chat_template_kwargs or {}))
        except Exception as e:  # noqa: BLE001 - a template error is the request's fault (jinja raises its own)
            raise APIError(400, f"the chat template failed on these messages: {e}", param="messages") from None
        reasoning = think_end_id is not None and text.rstrip().endswith(THINK_OPEN)
        prompts = [tokenize(text)]
        streams = [TextStream(tokenizer, sp_stop(body), think_end_id if reasoning else None) for _ in range(body.n)]
        head = {"id": request_id, "object": "chat.completion.chunk" if body.stream else "chat.completion",
                "created": created, "model": model_name}

        def logprobs(i, out):
            return chat_logprobs(tokenizer, streams[i].new_logprobs(out)) if body.logprobs else None

        if body.stream:
            started = await unless_disconnected(raw, submit(prompts, body, request_id, raw))
            if started is None:
                return Response(status_code=499)  # gone before its first token (PD: while P prefilled)
            role_sent = set()

            def make_chunk(i, out):
                think, content = streams[i].update(out)
                delta = {}
                if i not in role_sent:
                    role_sent.add(i)
                    delta["role"] = "assistant"
                if think:
                    delta["reasoning_content"] = think
                if content or not delta:
                    delta["content"] = content
                if not (think or content) and not out.finished and "role" not in delta and not body.logprobs:
                    return None
                return {**head, "choices": [{"index": i, "delta": delta, "logprobs": logprobs(i, out),
                                             "finish_reason": out.finish_reason if out.finished else None}]}
            return stream_response(started, arrival, make_chunk, head, prompts, body.include_usage)
        finals = await unless_disconnected(raw, whole(prompts, body, request_id, arrival, raw))
        if finals is None:
            return Response(status_code=499)  # nobody is listening
        metrics.count("success")
        choices = []
        for i in range(len(finals)):
            think, content = streams[i].update(finals[i])
            message = {"role": "assistant", "content": content}
            if reasoning:
                message["reasoning_content"] = think
            choices.append({"index": i, "message": message, "logprobs": logprobs(i, finals[i]),
                            "finish_reason": finals[i].finish_reason})
        return {**head, "choices": choices, "usage": usage(prompts, finals)}

    @app.get("/v1/models", dependencies=[Depends(check_api_key)])
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": 0,
                                            "owned_by": "npu-cookbook",
                                            "max_model_len": engine.config.max_model_len}]}

    if isinstance(connector, PrefillConnector):
        add_prefill_routes(app, async_engine, connector, [Depends(check_api_key)])  # D sends the same key

    @app.get("/health")
    async def health():
        alive = async_engine.alive
        return Response(status_code=200 if alive else 503)

    @app.get("/metrics")
    async def prometheus_metrics():
        return Response(metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    return app


def sp_stop(body) -> list[str]:
    stop = body.stop
    return [stop] if isinstance(stop, str) else list(stop or [])
