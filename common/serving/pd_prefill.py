"""The prefill (P) role of PD disaggregation: prefill a decode instance's request, write its KV into the blocks the
decode instance allocated, answer with the first token.

    POST /pd/prefill  {room, prompt_token_ids, sampling_params, peer, layout, block_tables}
        runs the prompt (prefix cache, chunked prefill as any request), samples the first token with the request's
        own sampling parameters, writes every cache group's blocks (runs of consecutive blocks one write per cache
        tensor) through the KVTransport into `peer`'s registered memory, frees its blocks, and answers
        {token_ids, logprobs, prompt_logprobs, num_cached_tokens}. The answer is the decode instance's
        notification: it comes after the writes returned. Errors are OpenAI error bodies (400 bad layout or
        parameters, 409 an aborted or duplicate room, 503 overloaded, 500 the prefill failed, 502 the write failed).
    POST /pd/abort  {room}
        no write for the room happens after the answer: a request still in the engine is aborted (its blocks
        freed), one being written stops between batches and is waited for; a room that has not arrived yet is
        refused when it does. The decode instance frees its blocks once this answers.
    GET /pd/info    this instance's role, transport address and cache layout signature.

A decode instance that goes away (its /pd/prefill connection closes) aborts the room the same way, so P's blocks
come back whether D finished, failed or died. The engine calls `start_send` on its own thread when a
do_remote_decode request finishes; the writes run on one sender thread, so the engine keeps stepping meanwhile.
"""
from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import dataclasses
import logging
import threading
import time
from dataclasses import dataclass, field

from fastapi import FastAPI, Request
from pydantic import BaseModel

from common.engine import SamplingParams
from common.kv_transfer import CacheLayout, KVTransport

from .async_engine import AsyncLLMEngine, EngineOverloaded
from .pd_protocol import logprobs_to_json
from .responses import error_response, run_unless_disconnected

logger = logging.getLogger("npu_cookbook.pd")
WRITES_PER_BATCH = 256  # ranges per transport.write: an abort stops the room between batches
TOMBSTONES = 4096  # aborted rooms remembered (a /pd/prefill arriving after its /pd/abort is refused)


@dataclass(eq=False)
class Room:
    """One request prefilled for a decode instance, from /pd/prefill until its blocks are freed."""
    peer: str
    layout: CacheLayout
    block_tables: dict[str, list[int]]
    state: str = "engine"  # "engine" (prefilling) -> "sending" (writes) -> "done"
    aborted: bool = False
    done: concurrent.futures.Future = field(default_factory=concurrent.futures.Future)  # result: error or None


@dataclass
class TransferStats:
    num_transfers: int = 0
    num_writes: int = 0  # byte ranges written
    bytes: int = 0
    seconds: float = 0.0  # in transport.write
    num_failed: int = 0
    num_aborted: int = 0


class PrefillConnector:
    """The engine's KV connector on a prefill instance (see common/engine/llm_engine.py)."""

    def __init__(self, transport: KVTransport, abort_timeout: float = 30.0):
        self.transport, self.abort_timeout = transport, abort_timeout
        self.layout: CacheLayout | None = None  # the engine's cache tensors, registered at bind
        self.rooms: dict[str, Room] = {}
        self.tombstones: collections.OrderedDict[str, None] = collections.OrderedDict()
        self.lock = threading.Lock()
        self.sender = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="kv-send")
        self.stats = TransferStats()
        self.async_engine: AsyncLLMEngine | None = None

    def bind(self, async_engine: AsyncLLMEngine, loop: asyncio.AbstractEventLoop) -> None:
        """At server start: register the engine's cache tensors with the transport."""
        self.async_engine = async_engine
        self.layout = CacheLayout.from_tensors(async_engine.engine.model.cache_tensors())
        self.transport.register(self.layout.regions())

    # the engine's thread
    def start_load(self, request, block_table) -> None:
        raise RuntimeError("a prefill instance does not receive KV")

    def cancel_load(self, request_id: str) -> None:
        raise RuntimeError("a prefill instance does not receive KV")

    def start_send(self, request, block_table: dict[str, list[int]]) -> None:
        rid = request.request_id
        with self.lock:
            room = self.rooms.get(rid)
            send = room is not None and not room.aborted
            if send:
                room.state = "sending"
        if not send:  # aborted meanwhile (or its decode instance went away): nothing to write
            self.async_engine.run_in_engine(lambda: self.async_engine.engine.release_sent(rid))
            if room is not None:
                room.state = "done"
                room.done.set_result("aborted")
            return
        self.sender.submit(self._send, rid, room, {g: list(t) for g, t in block_table.items()})

    # the sender thread
    def _send(self, rid: str, room: Room, tables: dict[str, list[int]]) -> None:
        error = None
        try:
            srcs, dsts, lengths = self.layout.writes(room.layout, tables, room.block_tables)
            t0 = time.perf_counter()
            for i in range(0, len(srcs), WRITES_PER_BATCH):
                if room.aborted:
                    error = "aborted"
                    self.stats.num_aborted += 1
                    break
                j = slice(i, i + WRITES_PER_BATCH)
                self.transport.write(room.peer, srcs[j], dsts[j], lengths[j])
            self.stats.seconds += time.perf_counter() - t0
            if error is None:
                self.stats.num_transfers += 1
                self.stats.num_writes += len(srcs)
                self.stats.bytes += sum(lengths)
        except Exception as e:  # noqa: BLE001 - the room fails, the instance goes on
            error = f"{type(e).__name__}: {e}"
            self.stats.num_failed += 1
            logger.warning("KV transfer of %s to %s failed: %s", rid, room.peer, error)
        finally:
            self.async_engine.run_in_engine(lambda: self.async_engine.engine.release_sent(rid))
            with self.lock:
                room.state = "done"
                self.rooms.pop(rid, None)
            room.done.set_result(error)

    # the event loop
    def open_room(self, rid: str, room: Room) -> str | None:
        """Register a room; why not (aborted before it came, or in use), or None."""
        with self.lock:
            if rid in self.tombstones:
                return f"room {rid} was aborted"
            if rid in self.rooms:
                return f"room {rid} is in use"
            self.rooms[rid] = room
        return None

    def close_room(self, rid: str, room: Room) -> None:
        """/pd/prefill is over (answered, failed or its client gone): nothing is sent for the room after this
        unless the writes already started (they then end on their own)."""
        with self.lock:
            if room.state == "engine":
                room.aborted = True
                if self.rooms.get(rid) is room:
                    del self.rooms[rid]

    async def abort(self, rid: str) -> bool:
        """No write for the room after this returns True (False: the writes did not stop within abort_timeout)."""
        with self.lock:
            self.tombstones[rid] = None
            while len(self.tombstones) > TOMBSTONES:
                self.tombstones.popitem(last=False)
            room = self.rooms.get(rid)
            if room is not None:
                room.aborted = True
        self.async_engine.abort(rid)  # still prefilling: the engine frees it (unknown ids are ignored)
        if room is None or room.state != "sending":
            return True
        try:
            await asyncio.wait_for(asyncio.wrap_future(room.done), self.abort_timeout)
            return True
        except asyncio.TimeoutError:
            return False


class PrefillBody(BaseModel):
    room: str
    prompt_token_ids: list[int]
    sampling_params: dict
    peer: str
    layout: dict[str, list[list[int]]]
    block_tables: dict[str, list[int]]


class AbortBody(BaseModel):
    room: str


def add_prefill_routes(app: FastAPI, async_engine: AsyncLLMEngine, connector: PrefillConnector) -> None:
    @app.post("/pd/prefill")
    async def prefill(body: PrefillBody, raw: Request):
        dst = CacheLayout.from_description(body.layout)
        if (why := connector.layout.mismatch(dst)) is not None:
            return error_response(400, f"the decode instance's KV cache differs from this one's ({why}): run P "
                                       "and D with the same checkpoint, preset and dtype", "invalid_request_error")
        try:
            sp = SamplingParams(**body.sampling_params)
        except (TypeError, ValueError) as e:
            return error_response(400, f"sampling_params: {e}", "invalid_request_error", "sampling_params")
        params = dataclasses.replace(sp, max_tokens=min(sp.max_tokens, 1))  # the first token; D samples the rest
        room = Room(body.peer, dst, body.block_tables)
        if (why := connector.open_room(body.room, room)) is not None:
            return error_response(409, why, "invalid_request_error", "room")
        try:
            finished, result = await run_unless_disconnected(raw, _prefill(async_engine, body, params, room))
            if not finished:
                return error_response(499, "the decode instance went away", "aborted")
            return result
        finally:
            connector.close_room(body.room, room)

    @app.post("/pd/abort")
    async def abort(body: AbortBody):
        stopped = await connector.abort(body.room)
        if not stopped:
            return error_response(504, f"room {body.room}: its writes did not stop within "
                                       f"{connector.abort_timeout:.0f} s", "timeout")
        return {"room": body.room, "released": True}

    @app.get("/pd/info")
    async def info():
        return {"role": "prefill", "address": connector.transport.address, "layout": connector.layout.signature(),
                "transfers": dataclasses.asdict(connector.stats)}


async def _prefill(async_engine: AsyncLLMEngine, body: PrefillBody, params: SamplingParams, room: Room):
    final = None
    try:
        async for out in async_engine.generate(body.prompt_token_ids, params, body.room,
                                               kv_transfer_params={"do_remote_decode": True}):
            final = out
    except EngineOverloaded as e:
        return error_response(503, str(e), "server_overloaded", headers={"Retry-After": "1"})
    except ValueError as e:
        return error_response(400, str(e), "invalid_request_error", "prompt_token_ids")
    if final.finish_reason in ("abort", "error"):
        return error_response(500, f"prefill failed: {final.error or final.finish_reason}", "internal_server_error")
    error = await asyncio.wrap_future(room.done)  # the writes ended (the sender always sets it)
    if error is not None:
        return error_response(502, f"KV transfer to {room.peer} failed: {error}", "kv_transfer_error")
    return {"room": body.room, "token_ids": final.token_ids, "logprobs": logprobs_to_json(final.logprobs),
            "prompt_logprobs": logprobs_to_json(final.prompt_logprobs), "num_cached_tokens": final.num_cached_tokens}
