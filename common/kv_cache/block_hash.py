"""Chained block hashes for prefix caching: a block's hash covers its tokens and, through its parent, every token
before it. sha256 over fixed-width bytes, so hashes agree across processes and machines (prefill/decode instances).

Multimodal items (images) sit in the prompt as runs of identical placeholder ids: a block that holds part of one
also hashes the item's content hash and where the item starts relative to the block (vLLM's extra keys), so the
same image reuses the block and another image under the same placeholder ids does not. A block without items
hashes as before."""
from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence
from typing import Protocol

ROOT_HASH = 0


class MultiModalSpan(Protocol):
    """An item placed in the prompt (common.engine.multimodal.MultiModalInput)."""
    identifier: str
    offset: int
    length: int


def hash_block(parent_hash: int, token_ids: tuple[int, ...] | list[int], extra_keys: tuple = ()) -> int:
    digest = hashlib.sha256(parent_hash.to_bytes(32, "little"))
    digest.update(array("q", token_ids).tobytes())
    for identifier, start in extra_keys:  # (content hash, item start - block start) of each item in the block
        digest.update(f"|{identifier}@{start}".encode())
    return int.from_bytes(digest.digest(), "little")


def block_extra_keys(spans: Sequence[MultiModalSpan], start: int, end: int) -> tuple:
    """The items overlapping positions [start, end): ((identifier, offset - start), ...)."""
    return tuple((s.identifier, s.offset - start) for s in spans if s.offset < end and s.offset + s.length > start)


def hash_blocks(token_ids: list[int], block_size: int, hashes: list[int] | None = None,
                num_tokens: int | None = None, mm_spans: Sequence[MultiModalSpan] = ()) -> list[int]:
    """The hashes of the full blocks among the first `num_tokens` tokens (all by default); a partial block has none.
    `hashes`, if given, are the already known leading hashes: they are extended in place and returned. mm_spans:
    the prompt's multimodal items, whose content the blocks they overlap hash too."""
    hashes = [] if hashes is None else hashes
    num_tokens = len(token_ids) if num_tokens is None else min(num_tokens, len(token_ids))
    for i in range(len(hashes), num_tokens // block_size):
        parent = hashes[-1] if hashes else ROOT_HASH
        start, end = i * block_size, (i + 1) * block_size
        hashes.append(hash_block(parent, token_ids[start:end], block_extra_keys(mm_spans, start, end)))
    return hashes
