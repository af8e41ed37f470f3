"""The decode (D) role of PD disaggregation: a request's prompt is prefilled by a prefill instance into blocks
allocated here, then decoded (and streamed) here.

The router names the prefill instance of each request in the `X-PD-Prefill` header (it must be one of this
instance's --pd-bootstrap URLs). The scheduler admits such a request by allocating its prompt's blocks (a request
that does not fit waits here, in order); the engine then calls `start_load`, and this connector posts
/pd/prefill to the prefill instance with this instance's transport address, cache layout and the block ids. The
answer (after P's writes returned) carries the first token: the request joins the running batch.

Faults, each ending the request in bounded time with its blocks freed only when no write can still land in them:
- the client goes away (abort) while the KV is on its way: /pd/prefill is cancelled, then /pd/abort tells P to
  stop (answered once no write for the room can happen; P unreachable: it is gone and writes nothing);
- P dies (connection reset / refused) or answers an error: the request ends with finish_reason "error" and P's
  reason; no answer within transfer_timeout: /pd/abort as above, then the error.
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging

from common.kv_transfer import CacheLayout, KVTransport

from .async_engine import AsyncLLMEngine
from .pd_protocol import logprobs_from_json

try:
    import httpx2 as httpx  # what openai 3.x installs
except ImportError:  # pragma: no cover
    import httpx

logger = logging.getLogger("npu_cookbook.pd")


class DecodeConnector:
    """The engine's KV connector on a decode instance (see common/engine/llm_engine.py)."""

    def __init__(self, transport: KVTransport, bootstrap_urls: list[str], transfer_timeout: float = 600.0,
                 abort_timeout: float = 30.0):
        self.transport = transport
        self.layout: CacheLayout | None = None  # the engine's cache tensors, registered at bind
        self.prefill_urls = {u.rstrip("/") for u in bootstrap_urls}
        self.transfer_timeout, self.abort_timeout = transfer_timeout, abort_timeout
        self.tasks: dict[str, asyncio.Task] = {}
        self.async_engine: AsyncLLMEngine | None = None
        self.loop: asyncio.AbstractEventLoop | None = None
        self.client: httpx.AsyncClient | None = None

    def bind(self, async_engine: AsyncLLMEngine, loop: asyncio.AbstractEventLoop) -> None:
        """At server start: register the engine's cache tensors; the transfers' HTTP calls run on its loop."""
        self.async_engine, self.loop = async_engine, loop
        self.layout = CacheLayout.from_tensors(async_engine.engine.model.cache_tensors())
        self.transport.register(self.layout.regions())
        self.client = httpx.AsyncClient(timeout=httpx.Timeout(self.transfer_timeout, connect=10.0),
                                        limits=httpx.Limits(max_connections=None, max_keepalive_connections=64))

    def check_prefill_url(self, url: str) -> str:
        """The prefill instance a request names, normalised; ValueError if it is not one of ours."""
        url = url.rstrip("/")
        if url not in self.prefill_urls:
            raise ValueError(f"prefill instance {url!r} is not one this decode instance was started with "
                             f"(--pd-bootstrap): {sorted(self.prefill_urls)}")
        return url

    # the engine's thread
    def start_send(self, request, block_table) -> None:
        raise RuntimeError("a decode instance does not send KV")

    def start_load(self, request, block_table: dict[str, list[int]]) -> None:
        body = {"room": request.request_id, "prompt_token_ids": request.prompt_token_ids,
                "sampling_params": dataclasses.asdict(request.sampling_params), "peer": self.transport.address,
                "layout": self.layout.describe(), "block_tables": {g: list(t) for g, t in block_table.items()}}
        url = request.kv_transfer_params["prefill_url"]
        self.loop.call_soon_threadsafe(self._start, request.request_id, url, body)

    def cancel_load(self, request_id: str) -> None:
        self.loop.call_soon_threadsafe(self._cancel, request_id)

    # the event loop
    def _start(self, rid: str, url: str, body: dict) -> None:
        self.tasks[rid] = self.loop.create_task(self._load(rid, url, body))

    def _cancel(self, rid: str) -> None:
        task = self.tasks.get(rid)
        if task is not None:
            task.cancel()
        else:  # its answer came first and is queued before this abort: abort it as a running request
            self.async_engine.run_in_engine(lambda: self.async_engine.engine.abort(rid))

    async def _load(self, rid: str, url: str, body: dict) -> None:
        engine = self.async_engine.engine
        result, error = None, None
        try:
            r = await self.client.post(url + "/pd/prefill", json=body)
            if r.status_code == 200:
                result = r.json()
            else:
                error = f"prefill instance {url} answered {r.status_code}: {_message(r)}"
        except asyncio.CancelledError:  # aborted here: P must stop writing before the blocks are reused
            await self._abort_remote(url, rid)
        except httpx.HTTPError as e:
            if not isinstance(e, (httpx.ConnectError, httpx.RemoteProtocolError)):  # alive, maybe still writing
                await self._abort_remote(url, rid)
            error = f"prefill instance {url} failed: {type(e).__name__} {e}".rstrip()
        finally:
            self.tasks.pop(rid, None)
        if result is not None:
            self.async_engine.run_in_engine(lambda: engine.finish_remote_prefill(
                rid, result["token_ids"], logprobs_from_json(result.get("logprobs")),
                logprobs_from_json(result.get("prompt_logprobs")),
                num_cached_tokens=result.get("num_cached_tokens", 0)))
        else:
            if error is not None:
                logger.warning("%s: %s", rid, error)
            self.async_engine.run_in_engine(lambda: engine.fail_remote_prefill(rid, error))

    async def _abort_remote(self, url: str, rid: str) -> None:
        """Ask P to stop writing the room; returns when it has, when P is gone, or after abort_timeout."""
        try:
            r = await asyncio.shield(self.client.post(url + "/pd/abort", json={"room": rid},
                                                      timeout=self.abort_timeout))
            if r.status_code != 200:
                logger.warning("%s: /pd/abort at %s answered %d: %s", rid, url, r.status_code, _message(r))
        except httpx.HTTPError as e:  # refused / reset: P is gone and writes nothing
            logger.warning("%s: /pd/abort at %s: %s (freeing the blocks)", rid, url, type(e).__name__)

    async def aclose(self) -> None:
        for task in list(self.tasks.values()):
            task.cancel()
        await asyncio.gather(*self.tasks.values(), return_exceptions=True)
        if self.client is not None:
            await self.client.aclose()


def _message(r) -> str:
    try:
        return r.json()["error"]["message"]
    except Exception:  # noqa: BLE001 - not an OpenAI error body
        return r.text[:200]
