"""Chained block hashes for prefix caching: a block's hash covers its tokens and, through its parent, every token
before it. sha256 over fixed-width bytes, so hashes agree across processes and machines (prefill/decode instances)."""
from __future__ import annotations

import hashlib
from array import array

ROOT_HASH = 0


def hash_block(parent_hash: int, token_ids: tuple[int, ...] | list[int]) -> int:
    digest = hashlib.sha256(parent_hash.to_bytes(32, "little"))
    digest.update(array("q", token_ids).tobytes())
    return int.from_bytes(digest.digest(), "little")


def hash_blocks(token_ids: list[int], block_size: int, hashes: list[int] | None = None,
                num_tokens: int | None = None) -> list[int]:
    """The hashes of the full blocks among the first `num_tokens` tokens (all by default); a partial block has none.
    `hashes`, if given, are the already known leading hashes: they are extended in place and returned."""
    hashes = [] if hashes is None else hashes
    num_tokens = len(token_ids) if num_tokens is None else min(num_tokens, len(token_ids))
    for i in range(len(hashes), num_tokens // block_size):
        parent = hashes[-1] if hashes else ROOT_HASH
        hashes.append(hash_block(parent, token_ids[i * block_size: (i + 1) * block_size]))
    return hashes
