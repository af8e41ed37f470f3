"""What the prefill and decode connectors share: the part of a KV connector both roles have, what they need of the
thread that runs the engine, and the JSON forms of log-probs and images in the /pd/prefill body and answer (the
serving layer's /pd routes read and write the same forms)."""
from __future__ import annotations

import asyncio
import base64
import binascii
import collections
from collections.abc import Callable
from typing import Protocol

from common import parallel as par
from common.engine import LLMEngine
from common.engine.kv_connector import BlockTable
from common.engine.multimodal import MultiModalInput
from common.engine.request import Request
from common.engine.sampler import TokenLogprobs

from .layout import CacheLayout
from .transport import KVTransport


class EngineHost(Protocol):
    """What runs the engine's thread (the server's AsyncLLMEngine): where a connector's commands, closures and
    aborts go. Each is thread-safe and returns at once; the engine applies them between two steps."""

    def send_kv_command(self, payload) -> None:
        """Rank 0: `payload` (picklable) to every rank's connector, its `on_command` on the engine's thread."""

    def run_in_engine(self, fn: Callable[[], object]) -> None:
        """fn() on this rank's engine thread (not broadcast)."""

    def abort(self, request_id: str) -> None:
        """Rank 0: abort the request as the server does when its client goes away (its stream too)."""


def logprobs_to_json(lps: list[TokenLogprobs | None] | None) -> list | None:
    if lps is None:
        return None
    return [None if lp is None else [lp.token_id, lp.logprob, [list(t) for t in lp.top]] for lp in lps]


def logprobs_from_json(data: list | None) -> list[TokenLogprobs | None] | None:
    if data is None:
        return None
    return [None if d is None else TokenLogprobs(int(d[0]), float(d[1]), [(int(i), float(v)) for i, v in d[2]])
            for d in data]


def images_to_json(inputs: list[MultiModalInput]) -> list[dict]:
    """A decode instance's images for the prefill instance: where each lies, its content hash, and the encoded bytes
    the decode instance received (the prefill instance processes and encodes them; the decode instance never
    runs its encoder for them)."""
    if any(mm.source is None for mm in inputs):
        raise ValueError("an image without its encoded bytes cannot be prefilled by another instance")
    return [{"identifier": mm.identifier, "offset": mm.offset, "length": mm.length,
             "data": base64.b64encode(mm.source).decode()} for mm in inputs]


def images_from_json(items: list[dict], encoder) -> list[MultiModalInput]:
    """The prefill instance's side: each image processed by this model's encoder stage (`encoder`, the model
    contract's) and checked against what the decode instance placed (its length and content hash: the same
    checkpoint and image processor on both). ValueError naming the mismatch."""
    if items and encoder is None:
        raise ValueError("this prefill instance's model takes no images")
    placed = []
    for i, item in enumerate(items):
        try:
            source = base64.b64decode(item["data"], validate=True)
        except (binascii.Error, ValueError, KeyError, TypeError):
            raise ValueError(f"images[{i}]: data is not base64") from None
        processed = encoder.process(source)
        if (processed.identifier, processed.num_tokens) != (item["identifier"], item["length"]):
            raise ValueError(f"images[{i}]: processed here it is {processed.num_tokens} tokens with another content "
                             "hash than the decode instance's: run P and D with the same checkpoint")
        placed.append(MultiModalInput(item["identifier"], item["offset"], item["length"], processed.data, source))
    return placed


class PDConnector:
    """Both roles' KV connector (common/engine/kv_connector.py; driven by the server's AsyncLLMEngine): the
    transport, the engine's cache layout registered with it at bind, this rank's place in its attention-TP group, and
    the outbox of messages for rank 0 (appended from the engine and sender threads, drained after each step)."""

    def __init__(self, transport: KVTransport):
        self.transport = transport
        self.layout: CacheLayout | None = None
        self.outbox: collections.deque = collections.deque()
        self.engine: LLMEngine | None = None
        self.async_engine: EngineHost | None = None

    def bind(self, engine: LLMEngine, async_engine: EngineHost, loop: asyncio.AbstractEventLoop | None) -> None:
        """At start, on every rank: register the engine's cache tensors (its runner's `cache_tensors`, which it owns)
        with the transport; `async_engine` runs the engine's thread (loop: the server's event loop on rank 0, None
        elsewhere)."""
        self.engine, self.async_engine = engine, async_engine
        self.layout = CacheLayout.from_tensors(engine.runner.cache_tensors)
        self.transport.register(self.layout.regions())
        tp = engine.parallel.group("attn_tp")
        self.num_tp, self.tp_rank = par.group_size(tp), par.group_rank(tp)

    # the engine's thread: the other role's calls. No request of this instance asks for them (the server marks
    # do_remote_prefill on a decode instance only, /pd/prefill do_remote_decode on a prefill instance only); they are
    # answered anyway, so that the blocks go back to the engine.
    def start_load(self, request: Request, block_table: BlockTable) -> None:
        rid, why = request.request_id, f"a {type(self).__name__} loads no KV"
        self.async_engine.run_in_engine(lambda: self.engine.fail_remote_prefill(rid, why))

    def cancel_load(self, request_id: str) -> None:
        """Nothing to stop: start_load has failed the load already."""

    def start_send(self, request: Request, block_table: BlockTable) -> None:
        rid = request.request_id
        self.async_engine.run_in_engine(lambda: self.engine.release_sent(rid))

    def take_messages(self) -> list:
        out = []
        while self.outbox:
            out.append(self.outbox.popleft())
        return out

    async def aclose(self) -> None:
        """At server shutdown, on rank 0."""
