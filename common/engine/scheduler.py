"""Continuous batching: each step mixes decodes and prefill chunks under a token budget.

Running requests go first, oldest first (decodes and unfinished prefill chunks); then waiting requests in
arrival order, each starting past its prefix-cache hit, as long as budget, batch size and blocks allow (FIFO:
a waiting request that does not fit stops the queue). When blocks run out for a running request, the newest
running request is preempted by recompute: its blocks are freed and it goes back to the front of the queue.

The scheduler is the one owner of request and KV state: it holds every unfinished request by id, and it alone
allocates, registers (prefix cache) and frees KV blocks. The engine asks it to add, finish and advance requests.

The encoder stage (images, common/engine/encoder_cache.py): a chunk that reaches an image holds its encoder output
in the encoder cache; an image nobody holds yet is encoded in this step (`SchedulerOutput.encoder_inputs`), under a
per-step budget of encoder rows (max_num_encoder_input_tokens) and the cache's capacity. A chunk that would need an
image beyond either stops before it (the rest comes in a later step). A chunk may split an image: the image's output
stays held until the request's computed tokens passed it, then it is released (and with every finish, abort and
preemption).

State cache groups (a linear attention's per-request state, common/kv_cache/kv_cache_manager.py) are allocated,
freed and preempted with the request's blocks, by the same calls: a request that gets no state slot waits (or
preempts) as one that gets no block; with prefix caching, prefill chunks end on block boundaries (`_chunk`); a
step that verifies drafts gets a state slot per end it may commit.

PD disaggregation: on a decode instance a waiting request with do_remote_prefill is admitted by allocating its
prompt's blocks (FIFO, as any admission: one D cannot hold waits, it is not dropped) and then waits, outside the
batch, in `receiving` until the KV connector reports its KV written (`remote_prefill_done`) or failed (`finish`).
It counts against max_num_seqs from admission on. On a prefill instance a request with do_remote_decode that
finishes normally keeps its blocks in `sending` until `release`: the connector reads them meanwhile.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from common.kv_cache import KVCacheManager

from .config import EngineConfig
from .encoder_cache import EncoderCache
from .multimodal import MultiModalInput
from .request import Request, RequestStatus


@dataclass(slots=True)
class ScheduledRequest:
    """One request's part of a step: tokens [start, start + num_new_tokens) of its sequence, the last
    len(draft_token_ids) of them the MTP drafts being verified (not yet part of the sequence)."""
    request: Request
    start: int  # its num_computed_tokens when scheduled
    num_new_tokens: int  # drafts included: what the step's budget counts
    sample: bool  # a next token is sampled from this step's last row (the one place this rule lives)
    prompt_logprob_positions: range  # positions p whose logits score prompt token p + 1 (prompt_logprobs)
    draft_token_ids: list[int] = field(default_factory=list)
    num_accepted: int = 0  # drafts accepted, set by the engine after sampling

    @property
    def end(self) -> int:
        return self.start + self.num_new_tokens

    @property
    def num_computed_after(self) -> int:
        """Tokens in the cache once the step is done: the sequence's own new tokens and the accepted drafts (the
        KV of rejected drafts is left where it is; every later query of those positions rewrites it first)."""
        return self.end - len(self.draft_token_ids) + self.num_accepted


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    remote_prefills: list[Request] = field(default_factory=list)  # admitted this step into `receiving`
    encoder_inputs: list[MultiModalInput] = field(default_factory=list)  # images to encode first (each once)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)


def schedule_entry(req: Request, num_new: int, drafts: list[int] = ()) -> ScheduledRequest:
    start = req.num_computed_tokens
    end = start + num_new
    sample = end == req.num_tokens and req.sampling_params.max_tokens > 0
    positions = range(0)
    if req.sampling_params.prompt_logprobs is not None:  # scored once: a recompute skips what is already scored
        positions = range(max(start, len(req.prompt_logprobs)), min(end, req.num_prompt_tokens - 1))
    return ScheduledRequest(req, start, num_new + len(drafts), sample, positions, list(drafts))


def drafts_to_verify(req: Request, budget: int, max_model_len: int) -> list[int]:
    """The request's MTP drafts that this decode step verifies: within the step's token budget (after its own
    token), the tokens it may still generate and the model length."""
    left = req.sampling_params.max_tokens - len(req.output_token_ids) - 1  # the step commits drafts + one
    return req.spec_token_ids[: max(0, min(budget - 1, left, max_model_len - req.num_tokens - 1))]


class Scheduler:
    def __init__(self, config: EngineConfig, kv_cache: KVCacheManager):
        self.config, self.kv_cache = config, kv_cache
        self.encoder_cache = EncoderCache(config.encoder_cache_size or config.max_num_batched_tokens)
        self.requests: dict[str, Request] = {}  # every unfinished request
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.receiving: dict[str, Request] = {}  # WAITING_FOR_REMOTE_KVS (PD decode side)
        self.sending: dict[str, Request] = {}  # finished, blocks held for the KV connector (PD prefill side)
        self.num_preemptions = 0

    def add(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    def schedule(self) -> SchedulerOutput:
        out, budget = SchedulerOutput(), self.config.max_num_batched_tokens
        encoder_budget = self.config.max_num_encoder_input_tokens or budget
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            num_new = self._chunk(req, req.num_computed_tokens, min(req.num_tokens - req.num_computed_tokens, budget))
            num_new = self._encodable(req, req.num_computed_tokens, num_new, encoder_budget)
            if num_new == 0:  # its chunk starts at an image the encoder cannot take this step
                i += 1
                continue
            decode = req.num_computed_tokens == req.num_tokens - 1
            drafts = drafts_to_verify(req, budget, self.config.max_model_len) if decode else []
            slots = self._slots(req, req.num_computed_tokens, num_new, drafts)
            end = req.num_computed_tokens + num_new
            ends = range(end, end + len(drafts) + 1)  # what the step may leave computed: a state slot each
            while not self.kv_cache.allocate(req.request_id, req.all_token_ids, req.num_computed_tokens, slots,
                                             ends=ends):
                victim = self.running.pop()
                self._preempt(victim)
                if victim is req:
                    break
            else:
                out.scheduled.append(schedule_entry(req, num_new, drafts))
                budget -= num_new + len(drafts)
                encoder_budget -= self._hold_images(req, req.num_computed_tokens, num_new, out)
                i += 1
        while self.waiting and budget > 0 and len(self.running) + len(self.receiving) < self.config.max_num_seqs:
            req = self.waiting[0]
            if req.do_remote_prefill:  # blocks for the prompt, written by the prefill instance
                if not self.kv_cache.allocate_external(req.request_id, req.num_prompt_tokens, req.mm_inputs):
                    break
                self.waiting.popleft()
                req.status = RequestStatus.WAITING_FOR_REMOTE_KVS
                self.receiving[req.request_id] = req
                out.remote_prefills.append(req)
                continue
            # prompt log-probs need the logits of every prompt position: such a request reads no cached prefix
            reads_cache = req.sampling_params.prompt_logprobs is None
            cached = (self.kv_cache.get_computed_tokens(req.request_id, req.all_token_ids, req.mm_inputs)
                      if reads_cache else 0)
            num_new = self._encodable(req, cached, self._chunk(req, cached, min(req.num_tokens - cached, budget)),
                                      encoder_budget)
            if num_new == 0 or (num_new < req.num_tokens - cached and not self.config.enable_chunked_prefill):
                break
            if not self.kv_cache.allocate(req.request_id, req.all_token_ids, cached, self._slots(req, cached, num_new),
                                          cached, req.mm_inputs, ends=range(cached + num_new, cached + num_new + 1)):
                break
            self.waiting.popleft()
            if req.num_preemptions == 0:
                req.num_cached_tokens = cached
            req.num_computed_tokens, req.status = cached, RequestStatus.RUNNING
            self.running.append(req)
            out.scheduled.append(schedule_entry(req, num_new))
            budget -= num_new
            encoder_budget -= self._hold_images(req, cached, num_new, out)
        return out

    def _chunk(self, req: Request, start: int, num_new: int) -> int:
        """A prefill chunk of num_new tokens from start, cut to end on a block boundary where a state group keeps
        its prefix-cache checkpoints there (KVCacheManager.align_chunk; with chunked prefill only)."""
        if not self.config.enable_chunked_prefill:
            return num_new
        return self.kv_cache.align_chunk(start, num_new, req.num_tokens)

    def _encodable(self, req: Request, start: int, num_new: int, encoder_budget: int) -> int:
        """num_new, or fewer: the chunk [start, start + num_new) stops before the first image it reaches that is not
        in the encoder cache and would not fit this step's encoder budget or the cache (0: it starts inside one)."""
        end, cost, new = start + num_new, 0, set()
        for mm in req.mm_inputs:
            if mm.offset >= end:
                break
            if mm.end <= start or mm.identifier in self.encoder_cache or mm.identifier in new:
                continue
            if cost + mm.length > encoder_budget or not self.encoder_cache.can_reserve(cost + mm.length):
                return max(mm.offset - start, 0)
            cost += mm.length
            new.add(mm.identifier)
        return num_new

    def _hold_images(self, req: Request, start: int, num_new: int, out: SchedulerOutput) -> int:
        """The scheduled chunk [start, start + num_new) holds the encoder outputs of the images it reaches; those no
        request held go to the step's encoder_inputs. Returns their encoder rows."""
        cost = 0
        for mm in req.mm_inputs:
            if mm.offset >= start + num_new:
                break
            if mm.end > start and not self.encoder_cache.holds(req.request_id, mm.identifier) \
                    and self.encoder_cache.hold(req.request_id, mm):
                out.encoder_inputs.append(mm)
                cost += mm.length
        return cost

    def _slots(self, req: Request, start: int, num_new: int, drafts: list[int] = ()) -> int:
        """Cache positions a step of `num_new` tokens (+ drafts) from `start` on needs. A step that
        samples under speculative decoding also proposes the request's next drafts: the MTP chain writes its KV
        at num_speculative_tokens - 1 positions past the committed tokens (lookahead)."""
        k = self.config.num_speculative_tokens
        lookahead = k - 1 if k and start + num_new == req.num_tokens else 0
        return min(num_new + len(drafts) + lookahead, self.config.max_model_len - start)

    def update_from_output(self, output: SchedulerOutput) -> None:
        """The step's forward ran: its tokens are in the cache; register the blocks that became full."""
        for s in output.scheduled:
            req = s.request
            req.num_computed_tokens = s.num_computed_after
            for mm in req.mm_inputs:  # images the prefill has consumed: their encoder outputs go
                if mm.end <= req.num_computed_tokens:
                    self.encoder_cache.release(req.request_id, mm.identifier)
            if not req.finished:
                self.kv_cache.cache_blocks(req.request_id, req.all_token_ids, req.num_computed_tokens)

    def _preempt(self, req: Request) -> None:
        self.kv_cache.free(req.request_id)
        self.encoder_cache.release_request(req.request_id)
        req.num_computed_tokens, req.status, req.spec_token_ids = 0, RequestStatus.WAITING, []
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)

    def remote_prefill_done(self, req: Request) -> None:
        """The prefill instance wrote the prompt's KV into the request's blocks: it runs from here on (a later
        preemption recomputes it here: it is no longer a remote prefill)."""
        del self.receiving[req.request_id]
        req.num_computed_tokens, req.status, req.kv_transfer_params = req.num_prompt_tokens, RequestStatus.RUNNING, None
        self.running.append(req)

    def finish(self, req: Request, reason: str) -> None:
        """Retire a request (stop, length, abort, error) wherever it is, freeing its blocks (a do_remote_decode
        request that ended normally holds them in `sending` until `release`)."""
        if req.finished:
            return
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        self.receiving.pop(req.request_id, None)
        self.requests.pop(req.request_id, None)
        self.encoder_cache.release_request(req.request_id)
        if req.do_remote_decode and reason in ("stop", "length"):
            self.sending[req.request_id] = req
        else:
            self.kv_cache.free(req.request_id)
        req.status, req.finish_reason = RequestStatus.FINISHED, reason

    def release(self, request_id: str) -> None:
        """The KV connector is done with a finished request's blocks: free them. Unknown ids are ignored."""
        if self.sending.pop(request_id, None) is not None:
            self.kv_cache.free(request_id)

    def abort(self, request_id: str) -> Request | None:
        """Finish the request with this id as aborted; None when it is unknown or already finished."""
        req = self.requests.get(request_id)
        if req is not None:
            self.finish(req, "abort")
        return req
