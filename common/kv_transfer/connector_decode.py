"""The decode (D) role of PD disaggregation: a request's prompt is prefilled by a prefill instance into blocks
allocated here, then decoded (and streamed) here.

The router names the prefill instance of each request in the `X-PD-Prefill` header (it must be one of this
instance's --pd-bootstrap URLs). The scheduler admits such a request by allocating its prompt's blocks (a request
that does not fit waits here, in order); the engine then calls `start_load`, and this connector posts
/pd/prefill to the prefill instance with the transport address, cache layout and block ids of every rank that
holds the request (its DP rank's attention-TP peers: P writes each). The answer (after P's writes returned)
carries the first token: the request joins the running batch. P's own DP rank needs no telling: the P rank that
prefilled the request writes it. This connector is the HTTP client of P's /pd routes (the serving layer's pd_routes.py).

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

from common.engine import LLMEngine
from common.engine.kv_connector import BlockTable
from common.engine.request import Request

from .connector_base import EngineHost, PDConnector, images_to_json, logprobs_from_json
from .transport import KVTransport

try:
    import httpx2 as httpx  # what openai 3.x installs
except ImportError:  # pragma: no cover
    import httpx

logger = logging.getLogger("npu_cookbook.pd")


class DecodeConnector(PDConnector):
    """The engine's KV connector on a decode instance (common/engine/kv_connector.py). Every rank of the instance
    has one; rank 0's also talks to the prefill instances. A rank that admits a request sends rank 0 its target (its
    transfer address, cache layout and block ids); once every attention-TP peer of that DP rank has (they hold the
    same requests, each its own copy of the cache), rank 0 posts /pd/prefill naming them all, and hands the answer
    to every rank as a command."""

    def __init__(self, transport: KVTransport, bootstrap_urls: list[str], transfer_timeout: float = 600.0,
                 abort_timeout: float = 30.0, api_key: str | None = None):
        super().__init__(transport)
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}  # P's /pd routes check it
        self.prefill_urls = {u.rstrip("/") for u in bootstrap_urls}
        self.transfer_timeout, self.abort_timeout = transfer_timeout, abort_timeout
        self.targets: dict[str, dict] = {}  # rank 0: per room, the load messages so far
        self.posts: dict[str, asyncio.Task] = {}  # rank 0: the /pd/prefill calls in flight (what an abort cancels)
        self.loads: set[asyncio.Task] = set()  # rank 0: their _load tasks, each ending its request
        self.answered_then_aborted: set[str] = set()  # rank 0: aborted between P's answer and _load's reading it
        self.loop: asyncio.AbstractEventLoop | None = None
        self.client: httpx.AsyncClient | None = None

    def bind(self, engine: LLMEngine, async_engine: EngineHost, loop: asyncio.AbstractEventLoop | None) -> None:
        """At start: register the engine's cache tensors; rank 0 (with the server's loop) makes the HTTP calls."""
        super().bind(engine, async_engine, loop)
        self.loop, self.layout_description = loop, self.layout.describe()  # sent with every request
        if loop is not None:
            self.client = httpx.AsyncClient(timeout=httpx.Timeout(self.transfer_timeout, connect=10.0),
                                            headers=self.headers,
                                            limits=httpx.Limits(max_connections=None, max_keepalive_connections=64))

    def check_prefill_url(self, url: str) -> str:
        """The prefill instance a request names, normalised; ValueError if it is not one of ours."""
        url = url.rstrip("/")
        if url not in self.prefill_urls:
            raise ValueError(f"prefill instance {url!r} is not one this decode instance was started with "
                             f"(--pd-bootstrap): {sorted(self.prefill_urls)}")
        return url

    # the engine's thread, on the ranks that own the request
    def start_load(self, request: Request, block_table: BlockTable) -> None:
        target = {"peer": self.transport.address, "layout": self.layout_description,
                  "block_tables": {g: list(t) for g, t in block_table.items()}}
        body = None
        if self.tp_rank == 0:  # the request itself, once
            body = {"room": request.request_id, "prompt_token_ids": request.prompt_token_ids,
                    "sampling_params": dataclasses.asdict(request.sampling_params),
                    "url": request.kv_transfer_params["prefill_url"], "images": images_to_json(request.mm_inputs)}
        self.outbox.append(("load", request.request_id, self.tp_rank, target, body))

    def cancel_load(self, request_id: str) -> None:
        self.outbox.append(("cancel", request_id))

    def on_command(self, payload):
        """Every rank: ("loaded", room, answer) or ("failed", room, error | None: aborted); the outputs it makes."""
        engine = self.engine
        kind, rid, arg = payload
        if kind == "loaded":
            return engine.finish_remote_prefill(rid, arg["token_ids"], logprobs_from_json(arg.get("logprobs")),
                                                logprobs_from_json(arg.get("prompt_logprobs")),
                                                num_cached_tokens=arg.get("num_cached_tokens", 0))
        return engine.fail_remote_prefill(rid, arg)

    # rank 0: the engine's thread
    def on_messages(self, messages: list) -> None:
        for m in messages:
            if m[0] == "load":
                _, rid, tp_rank, target, body = m
                entry = self.targets.setdefault(rid, {"targets": {}, "body": None})
                entry["targets"][tp_rank] = target
                entry["body"] = entry["body"] or body
                if len(entry["targets"]) == self.num_tp:
                    del self.targets[rid]
                    body = {**entry["body"], "targets": [entry["targets"][i] for i in range(self.num_tp)]}
                    self.loop.call_soon_threadsafe(self._start, rid, body.pop("url"), body)
            else:
                self.loop.call_soon_threadsafe(self._cancel, m[1])

    # rank 0: the event loop
    def _start(self, rid: str, url: str, body: dict) -> None:
        # An abort cancels the post, never _load: a task cancelled before it first runs never enters its body (an
        # abort queued right behind this call would otherwise leave the request holding its blocks for good).
        post = self.posts[rid] = self.loop.create_task(self.client.post(url + "/pd/prefill", json=body))
        load = self.loop.create_task(self._load(rid, url, post))
        self.loads.add(load)
        load.add_done_callback(self.loads.discard)

    def _cancel(self, rid: str) -> None:
        post = self.posts.get(rid)
        if post is None:  # its answer came first and is queued before this abort: abort it as a running request
            self.async_engine.abort(rid)
        elif not post.cancel():  # the answer is in and _load is on it: it ends the request as aborted
            self.answered_then_aborted.add(rid)

    async def _load(self, rid: str, url: str, post: asyncio.Task) -> None:
        result, error = None, None
        try:
            r = await post
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
            self.posts.pop(rid, None)
        if rid in self.answered_then_aborted:
            self.answered_then_aborted.discard(rid)
            result = None  # P's writes are over: the blocks can go
        if result is not None:
            self.async_engine.send_kv_command(("loaded", rid, result))
        else:
            if error is not None:
                logger.warning("%s: %s", rid, error)
            self.async_engine.send_kv_command(("failed", rid, error))

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
        for post in list(self.posts.values()):
            post.cancel()
        await asyncio.gather(*self.loads, return_exceptions=True)
        if self.client is not None:
            await self.client.aclose()


def _message(r) -> str:
    try:
        return r.json()["error"]["message"]
    except Exception:  # noqa: BLE001 - not an OpenAI error body
        return r.text[:200]
