"""Which blocks each request holds in each cache group; prefix-cache hits; freeing what a sliding window left behind;
the state slots of state groups.

One manager per engine. Pure bookkeeping: the model owns the cache tensors and reads them through `block_table`.

State groups (CacheGroupSpec kind "state": a linear attention's per-request state, vLLM's MambaSpec) come from a
pool of slots, one BlockPool like a paged group's. A request holds one slot: the state after its computed tokens
(none before its first step: it starts from a zero state, read slot 0). A step reads that slot and writes, in
place, the same one, unless the slot is a prefix-cache checkpoint (shared, or kept for later requests): then the
step writes a fresh slot and the checkpoint is released once the step ran (`cache_blocks`). With prefix caching
the state after a step that ends on a block boundary is registered under that block's hash, a checkpoint (vLLM's
"align" mode); a new request hits a prefix only where every paged group holds its blocks and every state group a
checkpoint at its end, and its first step reads that checkpoint. `align_chunk` cuts prefill chunks so that they
end on block boundaries and the prompt's last whole block gets a checkpoint. A slot is freed like a block (finish,
abort, preemption, a failed step); a freed checkpoint stays findable until its slot is reused (LRU), so saved
states are evicted like blocks.

Speculative decoding (vLLM's spec_state_indices): a step that verifies d drafts may leave 1..d+1 of its tokens
computed, so it writes the state after each of those candidate ends to its own slot (the table's write columns,
`state_writes` = 1 + the most drafts a step verifies; the all-accepted end may be written in place); once the step
ran, the slot of the end actually committed becomes the request's state and the others are freed. Nothing is
recomputed after a rejection.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from collections.abc import Sequence

from .block_hash import MultiModalSpan, hash_blocks
from .block_pool import NULL_BLOCK, BlockPool
from .spec import CacheGroupSpec


@dataclass(slots=True)
class KVCacheStats:
    prefix_cache_queries: int = 0  # tokens of the requests admitted (first successful allocate)
    prefix_cache_hits: int = 0  # of those, tokens whose cache came from the prefix cache


@dataclass(slots=True)
class _State:
    """A request's slots in one state group."""
    slot: int = NULL_BLOCK  # holds the state after the request's computed tokens (NULL: none yet, a zero state)
    writes: list[int] = field(default_factory=list)  # the scheduled step's write slots, one per candidate end (the
    #   last: all its tokens; == slot: in place; NULL before the first candidate); [] : no step scheduled
    ends: range = range(0)  # the scheduled step's candidate ends (tokens computed once it ran), the last one last


@dataclass(slots=True)
class _Request:
    tables: dict[str, list[int]]  # paged groups
    hashes: list[int] = field(default_factory=list)  # of the request's computed full blocks
    num_cached_blocks: int = 0  # leading blocks whose hashes are registered in the pools
    mm_spans: Sequence[MultiModalSpan] = ()  # the prompt's multimodal items (their content is part of the hashes)
    states: dict[str, _State] = field(default_factory=dict)  # state groups


class KVCacheManager:
    def __init__(self, specs: list[CacheGroupSpec], num_blocks: dict[str, int], enable_prefix_caching: bool = True,
                 state_writes: int = 1):
        """state_writes: write columns of a state group's table, 1 + the most drafts a step verifies."""
        names = [s.name for s in specs]
        assert names and len(set(names)) == len(names), f"cache group names must be unique: {names}"
        assert set(num_blocks) == set(names), f"num_blocks {sorted(num_blocks)} != cache groups {sorted(names)}"
        self.block_size = specs[0].block_size
        assert all(s.block_size == self.block_size for s in specs), \
            f"every cache group must share one block_size in tokens (block hashes are shared): {specs}"
        self.specs = {s.name: s for s in specs if not s.is_state}  # the paged groups
        self.state_specs = {s.name: s for s in specs if s.is_state}
        self.num_blocks = dict(num_blocks)
        self.enable_prefix_caching = enable_prefix_caching
        assert state_writes >= 1, f"state_writes {state_writes} must be at least 1"
        self.state_writes = state_writes
        self.pools = {name: BlockPool(n, enable_prefix_caching) for name, n in num_blocks.items()}
        self.stats = KVCacheStats()
        self._requests: dict[str, _Request] = {}

    @property
    def num_requests(self) -> int:
        return len(self._requests)

    def num_free_blocks(self, group: str | None = None) -> int:
        if group is not None:
            return self.pools[group].num_free_blocks
        return sum(p.num_free_blocks for p in self.pools.values())

    def usage(self) -> float:
        """Fraction of the usable blocks (the null blocks excluded) held by requests, over all groups."""
        usable = sum(p.num_blocks - 1 for p in self.pools.values())
        return 1 - self.num_free_blocks() / usable

    def all_blocks_free(self) -> bool:
        return all(p.num_free_blocks == p.num_blocks - 1 for p in self.pools.values())

    def block_table(self, request_id: str) -> dict[str, list[int]]:
        """Group name -> block ids by block index (null block 0 where a window left them; the lists are live); a
        state group -> [read slot, *write slots] of the scheduled step (state_writes columns, null where unused)."""
        req = self._requests[request_id]
        return {**req.tables, **{g: [st.slot, *(st.writes or [NULL_BLOCK] * self.state_writes)]
                                 for g, st in req.states.items()}}

    def align_chunk(self, start: int, num_new: int, num_tokens: int) -> int:
        """num_new, or fewer, for a chunk [start, start + num_new) of a request with num_tokens tokens: with state
        groups and prefix caching the chunk ends on a block boundary where it can (a chunk within one block is
        left as it is), and a chunk that passes the last boundary before num_tokens stops there, so that the
        state there becomes a checkpoint (vLLM's `_mamba_block_aligned_split`)."""
        if not self.state_specs or not self.enable_prefix_caching:
            return num_new
        end, last = start + num_new, num_tokens - num_tokens % self.block_size
        if end < last and end // self.block_size * self.block_size > start:
            return end // self.block_size * self.block_size - start
        if start < last < end:
            return last - start
        return num_new

    def get_computed_tokens(self, request_id: str, token_ids: list[int], mm_spans: Sequence[MultiModalSpan] = ()
                            ) -> int:
        """For a new request: how many leading tokens (whole blocks, fewer than all) the cache already holds in every
        group. A full group needs all blocks before that point; a window group only those its next query reads.
        mm_spans: the prompt's multimodal items (a block holding part of one hits only under the same content)."""
        assert request_id not in self._requests, f"{request_id} already holds blocks"
        if not self.enable_prefix_caching or not token_ids:
            return 0
        hashes = hash_blocks(token_ids, self.block_size, num_tokens=len(token_ids) - 1, mm_spans=mm_spans)
        cached = {g: [p.lookup(h) is not None for h in hashes] for g, p in self.pools.items()}
        n = len(hashes)
        while (m := min([self._longest_hit(spec, cached[g], n) for g, spec in self.specs.items()]
                        + [next(k for k in range(n, -1, -1) if k == 0 or cached[g][k - 1])
                           for g in self.state_specs])) < n:
            n = m  # a window group's (or a state group's) hit at n does not imply one at m < n: check all again
        return n * self.block_size

    def _longest_hit(self, spec: CacheGroupSpec, cached: list[bool], n: int) -> int:
        """The most blocks k <= n such that every block the group needs for positions < k * block_size is cached."""
        last_miss = [-1] * (n + 1)  # last_miss[k]: the last uncached block before block k
        for i in range(n):
            last_miss[i + 1] = last_miss[i] if cached[i] else i
        return next(k for k in range(n, -1, -1) if last_miss[k] < spec.first_needed_block(k * self.block_size))

    def allocate(self, request_id: str, token_ids: list[int], num_computed_tokens: int, num_new_tokens: int,
                 num_cached_tokens: int = 0, mm_spans: Sequence[MultiModalSpan] = (), ends: range | None = None
                 ) -> bool:
        """Make room for positions [num_computed_tokens, num_computed_tokens + num_new_tokens). On a request's first
        call, num_cached_tokens = get_computed_tokens(...) = num_computed_tokens takes those hit blocks, and mm_spans
        (the prompt's multimodal items, kept for every later hash) is given; later calls ignore both. Blocks no
        window query will read again are freed. ends: the token counts the step may leave computed, a state slot
        each (a step verifying d drafts: d + 1 of them, at most state_writes; default: the one end
        num_computed_tokens + num_new_tokens). All or nothing: False, and no pool changed, when some group lacks
        blocks (the scheduler then waits or preempts)."""
        req = self._requests.get(request_id)
        new = req is None
        if new:
            assert num_computed_tokens == num_cached_tokens, \
                f"{request_id}: a new request has computed only its cached tokens ({num_cached_tokens}), " \
                f"not {num_computed_tokens}"
            assert num_cached_tokens % self.block_size == 0 and (self.enable_prefix_caching or not num_cached_tokens), \
                f"{request_id}: num_cached_tokens {num_cached_tokens} is not from get_computed_tokens"
            req = self._hit(token_ids, num_cached_tokens // self.block_size, mm_spans)
        num_needed = -(-(num_computed_tokens + num_new_tokens) // self.block_size)
        plan = {}
        for g, spec in self.specs.items():
            table, pool = req.tables[g], self.pools[g]
            stale = _out_of_window(table, spec.first_needed_block(num_computed_tokens))
            num_alloc = max(0, num_needed - len(table))
            revived = sum(i != NULL_BLOCK and pool.blocks[i].ref_cnt == 0 for i in table) if new else 0
            released = sum(pool.blocks[table[i]].ref_cnt == 1 for i in stale)
            if num_alloc > pool.num_free_blocks - revived + released:
                return False
            plan[g] = stale, num_alloc
        ends = ends or range(num_computed_tokens + num_new_tokens, num_computed_tokens + num_new_tokens + 1)
        assert 0 < len(ends) <= self.state_writes and ends.start > num_computed_tokens, \
            f"{request_id}: candidate ends {ends} after {num_computed_tokens} tokens (state_writes {self.state_writes})"
        for g, st in req.states.items():  # fresh slots, but the last end in place if the request's slot is private
            pool = self.pools[g]
            shared = st.slot == NULL_BLOCK or pool.blocks[st.slot].ref_cnt > (0 if new else 1) \
                or pool.blocks[st.slot].block_hash is not None
            revived = new and st.slot != NULL_BLOCK and pool.blocks[st.slot].ref_cnt == 0
            if len(ends) - (not shared) > pool.num_free_blocks - revived:
                return False
            plan[g] = len(ends) - (not shared)
        if new:
            for g, pool in self.pools.items():
                pool.touch(req.tables[g] if g in req.tables else [req.states[g].slot])
            self._requests[request_id] = req
            if self.enable_prefix_caching:
                self.stats.prefix_cache_queries += len(token_ids)
                self.stats.prefix_cache_hits += num_cached_tokens
        self.cache_blocks(request_id, token_ids, num_computed_tokens)  # before the window frees computed blocks
        for g, st in req.states.items():
            fresh = self.pools[g].allocate(plan.pop(g))
            st.writes = [NULL_BLOCK] * (self.state_writes - len(ends)) + fresh + [st.slot] * (len(ends) - len(fresh))
            st.ends = ends
        for g, (stale, num_alloc) in plan.items():
            table, pool = req.tables[g], self.pools[g]
            pool.free([table[i] for i in stale])
            table[stale.start:stale.stop] = [NULL_BLOCK] * len(stale)
            table += pool.allocate(num_alloc)
        return True

    def allocate_external(self, request_id: str, num_tokens: int, mm_spans: Sequence[MultiModalSpan] = ()) -> bool:
        """For a new request whose first num_tokens positions are computed elsewhere (PD: written by a prefill
        instance): the blocks holding them that a later query reads (a full group: all; a window group: from
        first_needed_block(num_tokens) on, null before), and a state slot per state group for the state after them.
        mm_spans: the prompt's multimodal items. All or nothing, as allocate."""
        assert request_id not in self._requests, f"{request_id} already holds blocks"
        n = -(-num_tokens // self.block_size)
        plan = {g: min(spec.first_needed_block(num_tokens), n) for g, spec in self.specs.items()}
        if any(n - first > self.pools[g].num_free_blocks for g, first in plan.items()) \
                or any(not self.pools[g].num_free_blocks for g in self.state_specs):
            return False
        self._requests[request_id] = _Request({g: [NULL_BLOCK] * first + self.pools[g].allocate(n - first)
                                               for g, first in plan.items()}, mm_spans=mm_spans,
                                              states={g: _State(self.pools[g].allocate(1)[0])
                                                      for g in self.state_specs})
        return True

    def _hit(self, token_ids: list[int], num_blocks: int, mm_spans: Sequence[MultiModalSpan]) -> _Request:
        hashes = hash_blocks(token_ids, self.block_size, num_tokens=num_blocks * self.block_size, mm_spans=mm_spans)
        tables = {}
        for g, spec in self.specs.items():
            first = spec.first_needed_block(num_blocks * self.block_size)
            ids = [self.pools[g].lookup(h) for h in hashes[first:]]
            if None in ids:
                raise RuntimeError(f"group {g}: a prefix-cache hit was evicted since get_computed_tokens; "
                                   "allocate a request right after querying it")
            tables[g] = [NULL_BLOCK] * first + ids
        states = {g: _State(self.pools[g].lookup(hashes[num_blocks - 1]) if num_blocks else NULL_BLOCK)
                  for g in self.state_specs}
        if any(st.slot is None for st in states.values()):
            raise RuntimeError("a prefix-cache checkpoint was evicted since get_computed_tokens; allocate a request "
                               "right after querying it")
        return _Request(tables, hashes, num_cached_blocks=num_blocks, mm_spans=mm_spans, states=states)

    def cache_blocks(self, request_id: str, token_ids: list[int], num_computed_tokens: int) -> None:
        """Register the request's blocks that became full (all block_size tokens computed) under their hashes, in
        every group whose table still holds them. Once the scheduled step ran (num_computed_tokens reached one of its
        candidate ends), a state group's slot written for that end becomes the request's state (the slot it read and
        the other ends' are released), and a checkpoint when that end is a block boundary. Idempotent."""
        req = self._requests[request_id]
        if self.enable_prefix_caching:
            hash_blocks(token_ids, self.block_size, req.hashes, num_computed_tokens, req.mm_spans)
        for g, st in req.states.items():
            if not st.writes or num_computed_tokens < st.ends.start:
                continue
            assert num_computed_tokens in st.ends, f"{request_id}: {num_computed_tokens} tokens, not an end of {st.ends}"
            keep = st.writes[num_computed_tokens - st.ends.stop + len(st.writes)]
            self.pools[g].free([s for s in {st.slot, *st.writes} - {keep, NULL_BLOCK}])
            st.slot, st.writes = keep, []
            if self.enable_prefix_caching and num_computed_tokens % self.block_size == 0:
                self.pools[g].cache(st.slot, req.hashes[num_computed_tokens // self.block_size - 1])
        if not self.enable_prefix_caching:
            return
        for g in self.specs:
            pool, table = self.pools[g], req.tables[g]
            assert len(req.hashes) <= len(table), f"{request_id}: tokens computed beyond its allocated blocks"
            for i in range(req.num_cached_blocks, len(req.hashes)):
                pool.cache(table[i], req.hashes[i])
        req.num_cached_blocks = len(req.hashes)

    def free(self, request_id: str) -> None:
        """Release the request's blocks, last block first: its first blocks, the prefix most likely to be shared,
        enter the free queue last and so are evicted last. Unknown ids are ignored."""
        req = self._requests.pop(request_id, None)
        if req is not None:
            for g, st in req.states.items():
                self.pools[g].free([s for s in {*st.writes} - {st.slot, NULL_BLOCK}])
                self.pools[g].free([st.slot])
            for g in self.specs:
                self.pools[g].free(reversed(req.tables[g]))


def _out_of_window(table: list[int], first_needed: int) -> range:
    """Indices of the blocks before `first_needed` that the table still holds (freed ones are a null prefix)."""
    start = end = min(first_needed, len(table))
    while start > 0 and table[start - 1] != NULL_BLOCK:
        start -= 1
    return range(start, end)
