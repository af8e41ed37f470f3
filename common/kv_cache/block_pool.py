"""The blocks of one cache group: reference counts, an LRU free queue, and the prefix cache (block hash -> block)."""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

NULL_BLOCK = 0


@dataclass(slots=True, eq=False)
class Block:
    block_id: int
    ref_cnt: int = 0
    block_hash: int | None = None  # set once the block is full and cached, cleared when it is evicted


class BlockPool:
    """Block 0 is the null block: never handed out, never freed, the placeholder in block tables.

    A freed block goes to the tail of the free queue and allocation takes from the head, so the least recently freed
    block is reused first. A cached block whose ref count drops to 0 stays findable by its hash until it is reused
    (evicted); a cache hit on it `touch`es it back out of the free queue."""

    def __init__(self, num_blocks: int, enable_prefix_caching: bool = True):
        assert num_blocks >= 2, f"num_blocks {num_blocks}: need the null block and at least one more"
        self.num_blocks = num_blocks
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_queue: OrderedDict[int, Block] = OrderedDict((b.block_id, b) for b in self.blocks[1:])
        self.cached: dict[int, Block] = {}

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    def allocate(self, n: int) -> list[int]:
        if n > len(self.free_queue):
            raise RuntimeError(f"allocate({n}): only {len(self.free_queue)} free blocks")
        ids = []
        for _ in range(n):
            _, block = self.free_queue.popitem(last=False)
            self._evict(block)
            block.ref_cnt = 1
            ids.append(block.block_id)
        return ids

    def free(self, block_ids) -> None:
        """Drop one reference per id, in the given order; blocks reaching 0 join the free queue's tail in that order."""
        for i in block_ids:
            if i == NULL_BLOCK:
                continue
            block = self.blocks[i]
            assert block.ref_cnt > 0, f"block {i} freed more often than allocated"
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self.free_queue[i] = block

    def touch(self, block_ids) -> None:
        """Take one more reference on each (cache-hit) block, reviving it from the free queue if it was there."""
        for i in block_ids:
            if i == NULL_BLOCK:
                continue
            block = self.blocks[i]
            if block.ref_cnt == 0:
                del self.free_queue[i]
            block.ref_cnt += 1

    def cache(self, block_id: int, block_hash: int) -> None:
        """Register a full, computed block under its hash. A second block with a known hash is not registered."""
        block = self.blocks[block_id]
        if not self.enable_prefix_caching or block_id == NULL_BLOCK or block.block_hash is not None:
            return
        assert block.ref_cnt > 0, f"block {block_id} is cached while free"
        block.block_hash = block_hash
        self.cached.setdefault(block_hash, block)

    def lookup(self, block_hash: int) -> int | None:
        block = self.cached.get(block_hash)
        return None if block is None else block.block_id

    def _evict(self, block: Block) -> None:
        if block.block_hash is not None and self.cached.get(block.block_hash) is block:
            del self.cached[block.block_hash]
        block.block_hash = None
