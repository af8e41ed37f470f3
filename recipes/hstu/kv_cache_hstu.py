"""Paged history cache for HSTU: the K / V of each user's history tokens, per layer, in a device page pool.

Pages come from common.kv_cache.BlockPool (page 0 is the null page, never handed out). Each user owns an
append-only page list; `begin(batch)` grows the lists of the batch's users for their new history tokens, evicting
whole users in least-recently-used order when the pool runs short (never a user of the running batch: they are
marked used first). An evicted user is recomputed from scratch next time. Only history tokens are appended;
candidates are attended to, never stored. Exact only with causal contextual tokens (HSTUConfig.causal_contextual):
then a token's K / V depend on earlier tokens only, so they do not change as the history grows.

Host tier (host_chunk_size > 0): an evicted user's complete chunks of host_chunk_size tokens (the cold part of its
history) are copied to host tensors first; when the user comes back, `begin` reserves fresh pages and each layer's
chunks are onloaded into them just before that layer runs (BatchKV, layer by layer, as upstream), and only the tail
after the last complete chunk is recomputed. So every layer of a batch must run once through its BatchKV (the model
does). The host tier is unbounded here and the copies are synchronous (upstream overlaps the onload of layer l + 1
with the compute of layer l on a second stream).
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import torch

from common.kv_cache import BlockPool


@dataclass(slots=True)
class CacheStats:
    reused_tokens: int = 0  # history tokens read from the cache instead of computed
    computed_tokens: int = 0  # history tokens computed (and appended)
    onloaded_tokens: int = 0  # history tokens copied back from the host tier instead of computed
    evicted_users: int = 0

    @property
    def hit_ratio(self) -> float:
        """Share of the history tokens a batch needed that were not computed (device hits + host onloads)."""
        hits = self.reused_tokens + self.onloaded_tokens
        return hits / (hits + self.computed_tokens) if hits + self.computed_tokens else 0.0


class HistoryKVCache:
    def __init__(self, num_layers, num_pages, page_size, num_heads, k_dim, v_dim, dtype=torch.float32,
                 device="cpu", host_chunk_size=0):
        assert page_size > 0 and num_pages >= 2 and host_chunk_size >= 0
        self.page_size, self.host_chunk_size = page_size, host_chunk_size
        self.host: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # user -> K, V [layers, n, H, D] on the host
        self.pool = BlockPool(num_pages, enable_prefix_caching=False)
        self.k = torch.zeros(num_layers, num_pages, page_size, num_heads, k_dim, dtype=dtype, device=device)
        self.v = torch.zeros(num_layers, num_pages, page_size, num_heads, v_dim, dtype=dtype, device=device)
        self.pages: OrderedDict[int, list[int]] = OrderedDict()  # user -> pages, least recently used first
        self.lengths: dict[int, int] = {}  # user -> cached history tokens
        self.stats = CacheStats()

    def cached_length(self, user: int) -> int:
        """History tokens of `user` the next batch need not compute: on the device, else in the host tier."""
        if user in self.lengths:
            return self.lengths[user]
        return self.host[user][0].shape[1] if user in self.host else 0

    def evict(self, user: int) -> None:
        pages, length = self.pages.pop(user), self.lengths.pop(user)
        cold = length // self.host_chunk_size * self.host_chunk_size if self.host_chunk_size else 0
        if cold > (self.host[user][0].shape[1] if user in self.host else 0):  # offload the complete chunks
            rows = self._slots(pages, torch.arange(cold))
            self.host[user] = tuple(pool.flatten(1, 2)[:, rows].cpu() for pool in (self.k, self.v))
        self.pool.free(pages)
        self.stats.evicted_users += 1

    def _slots(self, pages: list[int], positions: torch.Tensor) -> torch.Tensor:
        """Rows of a pool viewed [pages * page_size, ...] holding these token positions of a page list."""
        ps = self.page_size
        return (torch.tensor(pages, dtype=torch.long)[positions // ps] * ps + positions % ps).to(self.k.device)

    def begin(self, users: list[int], new_history: list[int], lengths: list[int]) -> BatchKV:
        """Reserve pages for `new_history[b]` more tokens of users[b], whose batch row holds lengths[b] new tokens
        (new history first, then candidates). -> the BatchKV the model's layers read and write through."""
        assert len(set(users)) == len(users), "a user appears twice in the batch"
        cached = [self.cached_length(u) for u in users]
        onload = [u not in self.lengths and u in self.host for u in users]
        for user in users:  # most recently used, so that this batch never evicts its own users
            self.pages.setdefault(user, [])
            self.lengths.setdefault(user, 0)
            self.pages.move_to_end(user)
        onloads = []  # (pool rows, host K, host V): copied layer by layer by BatchKV
        for user, n, old, from_host in zip(users, new_history, cached, onload):
            need = -(-(old + n) // self.page_size) - len(self.pages[user])
            while need > self.pool.num_free_blocks:
                victim = next((u for u in self.pages if u not in users), None)
                if victim is None:
                    raise RuntimeError(f"history cache: {self.pool.num_blocks - 1} pages cannot hold this batch")
                self.evict(victim)
            self.pages[user] += self.pool.allocate(max(need, 0))
            self.lengths[user] = old + n
            if from_host:  # the cold chunks go back into the fresh pages, one layer at a time
                onloads.append((self._slots(self.pages[user], torch.arange(old)), *self.host[user]))
                self.stats.onloaded_tokens += old
        self.stats.reused_tokens += sum(c for c, h in zip(cached, onload) if not h)
        self.stats.computed_tokens += sum(new_history)
        return BatchKV(self, [self.pages[u] for u in users], cached, new_history, lengths, onloads)


class BatchKV:
    """One batch's view of the cache: kv(layer, k_new, v_new) onloads this layer's host chunks of returning users,
    appends the new history rows of every user to its pages and returns (k, v, cu_seqlens_k): per user its cached
    prefix then its new tokens, packed."""

    def __init__(self, cache: HistoryKVCache, pages, cached, new_history, lengths, onloads=()):
        self.cache, self.onloads = cache, list(onloads)
        dev = cache.k.device
        slot = lambda b, positions: cache._slots(pages[b], positions)  # noqa: E731
        cu_q = [0, *torch.tensor(lengths).cumsum(0).tolist()]
        k_lens = [c + n for c, n in zip(cached, lengths)]
        cu_k = [0, *torch.tensor(k_lens).cumsum(0).tolist()]
        ar = torch.arange
        self.prefix_src = torch.cat([slot(b, ar(c)) for b, c in enumerate(cached)]).to(dev)  # pool rows
        self.prefix_dst = torch.cat([cu_k[b] + ar(c) for b, c in enumerate(cached)]).to(dev)  # packed k rows
        self.new_dst = torch.cat([cu_k[b] + c + ar(n) for b, (c, n) in enumerate(zip(cached, lengths))]).to(dev)
        self.write_src = torch.cat([cu_q[b] + ar(n) for b, n in enumerate(new_history)]).to(dev)  # new rows
        self.write_dst = torch.cat([slot(b, c + ar(n)) for b, (c, n) in enumerate(zip(cached, new_history))]).to(dev)
        self.cu_seqlens_k = torch.tensor(cu_k, dtype=torch.int32, device=dev)
        self.total_k = cu_k[-1]

    def __call__(self, layer: int, k: torch.Tensor, v: torch.Tensor):
        out = []
        for pool, new, side in ((self.cache.k[layer], k, 1), (self.cache.v[layer], v, 2)):
            flat = pool.view(-1, *pool.shape[2:])  # [pages * page_size, H, D]
            for onload in self.onloads:  # this layer's cold chunks, just before the layer reads them
                flat[onload[0]] = onload[side][layer].to(flat.device)
            flat[self.write_dst] = new[self.write_src].to(flat.dtype)
            packed = new.new_empty(self.total_k, *new.shape[1:])
            packed[self.prefix_dst] = flat[self.prefix_src].to(new.dtype)
            packed[self.new_dst] = new
            out.append(packed)
        return out[0], out[1], self.cu_seqlens_k
