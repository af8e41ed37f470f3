"""The OpenAI-compatible HTTP server: `build_app(async_engine, tokenizer, model_name)` -> a FastAPI app.

POST /v1/completions (completions.py), POST /v1/chat/completions (chat.py), POST /v1/responses (responses.py): JSON,
or server-sent events with `stream: true`, over the request path they share (openai_serving.py); GET and DELETE
/v1/responses/{id} (the responses store); GET /v1/models, GET /health, GET /metrics.
Every error is an OpenAI error body; no traceback ever reaches a client.

A request whose engine step failed answers 500 (an OpenAI error body), or in a stream ends with a choice whose
finish_reason is "error", an error event and [DONE]; the server goes on serving. A client that disconnects
aborts its requests, streaming or not, which frees their KV blocks.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import secrets

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from common import cpu_threads
from common.kv_transfer import PrefillConnector

from .async_engine import AsyncLLMEngine
from .chat import OpenAIServingChat
from .chat_format import ChatFormat, TemplateChatFormat
from .completions import OpenAIServingCompletion
from .http_utils import APIError, error_response
from .media_connector import MediaConnector
from .metrics import ServerMetrics
from .openai_serving import OpenAIServing
from .pd_routes import add_prefill_routes
from .response_store import DEFAULT_MAX_ENTRIES, ResponseStore
from .responses import OpenAIServingResponses

logger = logging.getLogger("npu_cookbook.serving")
GENERATION_PATHS = ("/v1/completions", "/v1/chat/completions", "/v1/responses")


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
              drain_timeout: float = 0.0, chat_format: ChatFormat | None = None, media: MediaConnector | None = None,
              max_images: int = 8, responses_store_size: int = DEFAULT_MAX_ENTRIES) -> FastAPI:
    """chat_format: the model's (chat_format.py); None: the tokenizer's chat template (no tools). media, max_images:
    how image URLs are fetched (bounded bytes, time, pixels) and how many images a request may carry.
    responses_store_size: the most /v1/responses kept for previous_response_id and retrieval (least recently used
    evicted first; 0: none is stored).
    PD roles: the engine's kv_connector decides (a DecodeConnector takes requests that name a prefill instance
    in the X-PD-Prefill header; a PrefillConnector adds the /pd routes)."""
    engine = async_engine.engine
    connector = engine.kv_connector
    metrics = ServerMetrics(engine)
    serving = OpenAIServing(async_engine, tokenizer, model_name, metrics, media, max_images)

    async def lifespan(app: FastAPI):
        # the model's parallel ops keep the cores to the engine thread's OpenMP team (common/cpu_threads.py): this
        # thread (the event loop) and the to_thread work (image decoding, grammar compiles) start none
        cpu_threads.serial_thread()
        asyncio.get_running_loop().set_default_executor(concurrent.futures.ThreadPoolExecutor(
            thread_name_prefix="serving", initializer=cpu_threads.serial_thread))
        if connector is not None:
            connector.bind(engine, async_engine, asyncio.get_running_loop())
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

    authorized = [Depends(check_api_key)]
    app.post("/v1/completions", dependencies=authorized)(OpenAIServingCompletion(serving).create)
    chat_format = chat_format if chat_format is not None else TemplateChatFormat(tokenizer)
    chat = OpenAIServingChat(serving, chat_format)
    app.post("/v1/chat/completions", dependencies=authorized)(chat.create)
    responses = OpenAIServingResponses(serving, chat, ResponseStore(responses_store_size))
    app.post("/v1/responses", dependencies=authorized)(responses.create)
    app.get("/v1/responses/{response_id}", dependencies=authorized)(responses.retrieve)
    app.delete("/v1/responses/{response_id}", dependencies=authorized)(responses.delete)

    @app.get("/v1/models", dependencies=authorized)
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": 0,
                                            "owned_by": "npu-cookbook",
                                            "max_model_len": engine.config.max_model_len}]}

    if isinstance(connector, PrefillConnector):
        add_prefill_routes(app, async_engine, connector, authorized)  # D sends the same key

    @app.get("/health")
    async def health():
        alive = async_engine.alive
        return Response(status_code=200 if alive else 503)

    @app.get("/metrics")
    async def prometheus_metrics():
        return Response(metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    return app
