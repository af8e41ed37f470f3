"""The encoder stage's outputs (image embeddings), held from the step that encodes an item until the prefill of every
request that reads it has consumed its span.

The scheduler owns the cache: when a step's prefill chunk reaches an item, the chunk's request takes a reference on
it (`hold`; an item no request holds yet is reserved, and that step encodes it: the engine runs the model's encoder
on the step's new items first, in one call, and `put`s the outputs). Items are keyed by their content hash, so
requests with the same image share one entry and one encode. A request lets go of an item once its computed tokens
passed the item's span (`release`), and of all of them when it finishes, is aborted or preempted (`release_request`);
an entry nobody holds is dropped at once. `capacity` bounds the rows held (vLLM's encoder_cache_size): a chunk that
would need more stops before the item (the scheduler's encoder budget).
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from .multimodal import MultiModalInput


@dataclass(slots=True)
class _Entry:
    num_tokens: int
    holders: set[str] = field(default_factory=set)
    output: torch.Tensor | None = None  # [num_tokens, D] once encoded


class EncoderCache:
    def __init__(self, capacity: int):
        if capacity < 1:
            raise ValueError(f"encoder cache capacity must be >= 1 token, got {capacity}")
        self.capacity = capacity
        self.num_tokens = 0  # rows reserved or held
        self._entries: dict[str, _Entry] = {}
        self._held: dict[str, set[str]] = {}  # request id -> identifiers it holds

    def __contains__(self, identifier: str) -> bool:
        return identifier in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def can_reserve(self, num_tokens: int) -> bool:
        return self.num_tokens + num_tokens <= self.capacity

    def holds(self, request_id: str, identifier: str) -> bool:
        return identifier in self._held.get(request_id, ())

    def hold(self, request_id: str, mm: MultiModalInput) -> bool:
        """Take the request's reference on the item; True when the item was not held by anyone (it must be encoded
        this step: reserved here, filled by `put`)."""
        entry = self._entries.get(mm.identifier)
        new = entry is None
        if new:
            if not self.can_reserve(mm.length):
                raise RuntimeError(f"encoder cache full: {self.num_tokens} of {self.capacity} rows held, "
                                   f"{mm.length} more asked (check can_reserve first)")
            entry = self._entries[mm.identifier] = _Entry(mm.length)
            self.num_tokens += mm.length
        entry.holders.add(request_id)
        self._held.setdefault(request_id, set()).add(mm.identifier)
        return new

    def put(self, identifier: str, output: torch.Tensor) -> None:
        entry = self._entries[identifier]
        if output.shape[0] != entry.num_tokens:
            raise ValueError(f"the encoder gave {output.shape[0]} rows for an item of {entry.num_tokens} tokens")
        entry.output = output

    def get(self, identifier: str) -> torch.Tensor:
        output = self._entries[identifier].output
        if output is None:
            raise RuntimeError(f"item {identifier[:12]} is reserved but not encoded yet")
        return output

    def release(self, request_id: str, identifier: str) -> None:
        """Drop the request's reference (its prefill consumed the item); the entry goes with its last holder."""
        held = self._held.get(request_id)
        if held is None or identifier not in held:
            return
        held.discard(identifier)
        if not held:
            del self._held[request_id]
        entry = self._entries[identifier]
        entry.holders.discard(request_id)
        if not entry.holders:
            del self._entries[identifier]
            self.num_tokens -= entry.num_tokens

    def release_request(self, request_id: str) -> None:
        """Drop every reference of a request (finished, aborted, preempted)."""
        for identifier in list(self._held.get(request_id, ())):
            self.release(request_id, identifier)


def gather_embeddings(cache: EncoderCache, chunks: Sequence[tuple[Sequence[MultiModalInput], int, int, int]]
                      ) -> tuple[list[int], list[torch.Tensor]]:
    """The embedding rows of a step's packed batch: chunks[b] = (request b's items, the first and past-the-last
    positions of its chunk this step, its chunk's first row in the batch). -> (rows, the embeddings of those rows in
    pieces) for every item position inside a chunk; a chunk that splits an item takes its slice."""
    rows, pieces = [], []
    for inputs, start, end, first_row in chunks:
        for mm in inputs:
            lo, hi = max(mm.offset, start), min(mm.end, end)
            if lo >= hi:
                continue
            pieces.append(cache.get(mm.identifier)[lo - mm.offset: hi - mm.offset])  # [hi - lo, D]
            rows.extend(range(first_row + lo - start, first_row + hi - start))
    return rows, pieces
