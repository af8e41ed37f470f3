"""Continuous batching: each step mixes decodes and prefill chunks under a token budget.

Running requests go first, oldest first (decodes and unfinished prefill chunks); then waiting requests in
arrival order, each starting past its prefix-cache hit, as long as budget, batch size and blocks allow (FIFO:
a waiting request that does not fit stops the queue). When blocks run out for a running request, the newest
running request is preempted by recompute: its blocks are freed and it goes back to the front of the queue.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from common.kv_cache import KVCacheManager

from .config import EngineConfig
from .request import Request, RequestStatus


@dataclass
class SchedulerOutput:
    scheduled: list[tuple[Request, int]] = field(default_factory=list)  # (request, tokens to compute this step)
    preempted: list[Request] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(n for _, n in self.scheduled)


class Scheduler:
    def __init__(self, config: EngineConfig, kv_cache: KVCacheManager):
        self.config, self.kv_cache = config, kv_cache
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def _allocate(self, req: Request, num_new: int) -> bool:
        return self.kv_cache.allocate(req.request_id, req.all_token_ids, req.num_computed_tokens, num_new)

    def schedule(self) -> SchedulerOutput:
        out, budget = SchedulerOutput(), self.config.max_num_batched_tokens
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            num_new = min(req.num_tokens - req.num_computed_tokens, budget)
            while not self._allocate(req, num_new):
                victim = self.running.pop()
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is req:
                    break
            else:
                out.scheduled.append((req, num_new))
                budget -= num_new
                i += 1
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            req = self.waiting[0]
            cached = self.kv_cache.get_computed_tokens(req.request_id, req.all_token_ids)
            num_new = min(req.num_tokens - cached, budget)
            if num_new < req.num_tokens - cached and not self.config.enable_chunked_prefill:
                break
            if not self.kv_cache.allocate(req.request_id, req.all_token_ids, cached, num_new, cached):
                break
            self.waiting.popleft()
            if req.num_preemptions == 0:
                req.num_cached_tokens = cached
            req.num_computed_tokens, req.status = cached, RequestStatus.RUNNING
            self.running.append(req)
            out.scheduled.append((req, num_new))
            budget -= num_new
        return out

    def _preempt(self, req: Request) -> None:
        self.kv_cache.free(req.request_id)
        req.num_computed_tokens, req.status = 0, RequestStatus.WAITING
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)

    def finish(self, req: Request, reason: str) -> None:
        """Retire a request (stopped, length, aborted) wherever it is, freeing its blocks."""
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        self.kv_cache.free(req.request_id)
        req.status, req.finish_reason = RequestStatus.FINISHED, reason
