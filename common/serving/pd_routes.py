"""The /pd routes of a prefill (P) instance: the HTTP face of common/kv_transfer's PrefillConnector.

    POST /pd/prefill  {room, prompt_token_ids, sampling_params, targets: [{peer, layout, block_tables}], images}
        runs the prompt (prefix cache, chunked prefill as any request; its images, sent as the decode instance
        received them, processed and encoded here), samples the first token with the request's
        own sampling parameters, writes every cache group's blocks (runs of consecutive blocks one write per cache
        tensor) through the KVTransport into each target's registered memory, frees its blocks, and answers
        {token_ids, logprobs, prompt_logprobs, num_cached_tokens}. The answer is the decode instance's
        notification: it comes after the writes returned. Errors are OpenAI error bodies (400 bad layout or
        parameters, 409 an aborted or duplicate room, 503 overloaded, 500 the prefill failed, 502 the write failed).
    POST /pd/abort  {room}
        no write for the room happens after the answer: a request still in the engine is aborted (its blocks
        freed), one being written stops between batches and is waited for; a room that has not arrived yet is
        refused when it does. The decode instance frees its blocks once this answers.
    GET /pd/info    this instance's role, transport address and cache layout signature.

A decode instance that goes away (its /pd/prefill connection closes) aborts the room the same way, so P's blocks
come back whether D finished, failed or died.
"""
from __future__ import annotations

import asyncio
import dataclasses

from fastapi import FastAPI, Request
from pydantic import BaseModel

from common.engine import SamplingParams
from common.kv_transfer import CacheLayout, PrefillConnector
from common.kv_transfer.connector_base import images_from_json, logprobs_to_json

from .async_engine import AsyncLLMEngine, EngineOverloaded
from .http_utils import error_response, run_unless_disconnected


class Target(BaseModel):
    """One rank of the decode instance that holds the request: where to write, and which blocks."""
    peer: str
    layout: dict[str, list[list[int]]]
    block_tables: dict[str, list[int]]


class PrefillBody(BaseModel):
    room: str
    prompt_token_ids: list[int]
    sampling_params: dict
    targets: list[Target]
    images: list[dict] = []  # connector_base.images_to_json: [{identifier, offset, length, data (base64)}]


class AbortBody(BaseModel):
    room: str


def add_prefill_routes(app: FastAPI, async_engine: AsyncLLMEngine, connector: PrefillConnector,
                       dependencies: list = ()) -> None:
    """The /pd routes, behind `dependencies` (the server's API-key check: whoever may post /pd/prefill decides where
    this instance writes)."""
    dependencies = list(dependencies)

    @app.post("/pd/prefill", dependencies=dependencies)
    async def prefill(body: PrefillBody, raw: Request):
        for target in body.targets:
            if (why := connector.layout.mismatch(CacheLayout.from_description(target.layout))) is not None:
                return error_response(400, f"the decode instance's KV cache differs from this one's ({why}): run "
                                           "P and D with the same checkpoint, dtype and MTP setting",
                                      "invalid_request_error")
        try:
            sp = SamplingParams(**body.sampling_params)
        except (TypeError, ValueError) as e:
            return error_response(400, f"sampling_params: {e}", "invalid_request_error", "sampling_params")
        params = dataclasses.replace(sp, max_tokens=min(sp.max_tokens, 1))  # the first token; D samples the rest
        finished, result = await run_unless_disconnected(raw, _prefill(async_engine, connector, body, params))
        if not finished:
            return error_response(499, "the decode instance went away", "aborted")
        return result

    @app.post("/pd/abort", dependencies=dependencies)
    async def abort(body: AbortBody):
        stopped = await connector.abort(body.room)
        if not stopped:
            return error_response(504, f"room {body.room}: its writes did not stop within "
                                       f"{connector.abort_timeout:.0f} s", "timeout")
        return {"room": body.room, "released": True}

    @app.get("/pd/info", dependencies=dependencies)
    async def info():
        return {"role": "prefill", "address": connector.transport.address, "layout": connector.layout.signature(),
                "transfers": dataclasses.asdict(connector.stats)}


async def _prefill(async_engine: AsyncLLMEngine, connector: PrefillConnector, body: PrefillBody,
                   params: SamplingParams):
    # The room opens and the request is queued in one step of the event loop: a /pd/abort comes before both (the
    # room is refused) or after both (the abort command finds the request in the engine).
    room, why = connector.open_room(body.room)
    if room is None:
        return error_response(409, why, "invalid_request_error", "room")
    final = None
    targets = [t.model_dump() for t in body.targets]
    try:
        images = await asyncio.to_thread(images_from_json, body.images, async_engine.engine.contract.encoder)
    except ValueError as e:
        return error_response(400, str(e), "invalid_request_error", "images")
    try:
        async for out in async_engine.generate(body.prompt_token_ids, params, body.room,
                                               kv_transfer_params={"do_remote_decode": True, "targets": targets},
                                               mm_inputs=images):
            final = out
        if final.finish_reason in ("abort", "error"):
            return error_response(500, f"prefill failed: {final.error or final.finish_reason}",
                                  "internal_server_error")
        # the writes ended (the writing rank always says so); shielded: a cancelled wait must not cancel room.done
        error = await asyncio.shield(asyncio.wrap_future(room.done))
    except EngineOverloaded as e:
        return error_response(503, str(e), "server_overloaded", headers={"Retry-After": "1"})
    except ValueError as e:
        return error_response(400, str(e), "invalid_request_error", "prompt_token_ids")
    finally:
        connector.close_room(body.room, room)
    if error is not None:
        return error_response(502, f"KV transfer to {', '.join(t['peer'] for t in targets)} failed: {error}",
                              "kv_transfer_error")
    return {"room": body.room, "token_ids": final.token_ids, "logprobs": logprobs_to_json(final.logprobs),
            "prompt_logprobs": logprobs_to_json(final.prompt_logprobs), "num_cached_tokens": final.num_cached_tokens}
