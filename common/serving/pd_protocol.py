"""What the PD roles and the router share: the header that names a request's prefill instance, the JSON form of
log-probs in the prefill instance's answer and of a request's images, and the part of a KV connector both roles
have."""
from __future__ import annotations

import base64
import binascii
import collections

from common import parallel as par
from common.engine.multimodal import MultiModalInput
from common.engine.sampler import TokenLogprobs
from common.kv_transfer import CacheLayout, KVTransport

PREFILL_HEADER = "x-pd-prefill"  # router -> decode instance: the base URL of the prefill instance to use


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
    """Both roles' KV connector (see common/engine/llm_engine.py and common/serving/async_engine.py): the transport,
    the engine's cache layout registered with it at bind, this rank's place in its attention-TP group, and the
    outbox of messages for rank 0 (appended from the engine and sender threads, drained after each step)."""

    def __init__(self, transport: KVTransport):
        self.transport = transport
        self.layout: CacheLayout | None = None
        self.outbox: collections.deque = collections.deque()
        self.async_engine = None

    def bind(self, async_engine, loop) -> None:
        """At start, on every rank (loop: the server's event loop on rank 0, None elsewhere)."""
        self.async_engine = async_engine
        self.layout = CacheLayout.from_tensors(async_engine.engine.model.cache_tensors())
        self.transport.register(self.layout.regions())
        tp = async_engine.parallel.group("attn_tp")
        self.num_tp, self.tp_rank = par.group_size(tp), par.group_rank(tp)

    def take_messages(self) -> list:
        out = []
        while self.outbox:
            out.append(self.outbox.popleft())
        return out

    async def aclose(self) -> None:
        """At server shutdown, on rank 0."""
