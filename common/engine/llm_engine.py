"""The engine step loop shared by offline generation and the server: schedule, forward, sample, update."""
from __future__ import annotations

import itertools
import logging
import time
from dataclasses import dataclass, field

from common.kv_cache import KVCacheManager

from .config import EngineConfig
from .model_runner import ModelRunner
from .request import Request
from .sampler import Sampler, TokenLogprobs
from .sampling_params import SamplingParams
from .scheduler import Scheduler

logger = logging.getLogger(__name__)


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    text: str
    token_ids: list[int]
    finished: bool
    finish_reason: str | None
    logprobs: list[TokenLogprobs] | None = None
    num_cached_tokens: int = 0


@dataclass
class EngineStats:
    prefill_tokens: int = 0  # prompt (and recomputed) tokens run through the model
    decode_tokens: int = 0  # tokens generated
    prefill_time: float = 0.0  # seconds in steps that ran prefill tokens
    decode_time: float = 0.0  # seconds in decode-only steps
    steps: int = 0
    step_tokens: list[int] = field(default_factory=list)


class LLMEngine:
    def __init__(self, model, tokenizer, config: EngineConfig | None = None):
        self.model, self.tokenizer = model, tokenizer
        self.config = config or EngineConfig()
        model_len = model.args.max_position_embeddings
        self.config.max_model_len = min(self.config.max_model_len or model_len, model_len)
        self.runner = ModelRunner(model, self.config)
        capacity = (min(self.runner.num_blocks.values()) - 1) * self.config.block_size
        if capacity < self.config.max_model_len:  # one request must always fit in the whole cache
            logger.warning("the KV cache holds %d tokens: max_model_len lowered from %d", capacity,
                           self.config.max_model_len)
            self.config.max_model_len = capacity
        self.kv_cache = KVCacheManager(self.runner.specs, self.runner.num_blocks, self.config.enable_prefix_caching)
        self.scheduler = Scheduler(self.config, self.kv_cache)
        self.sampler = Sampler()
        self.eos_token_ids = set(model.args.eos_token_ids)
        self.requests: dict[str, Request] = {}
        self.stats = EngineStats()
        self._ids = itertools.count()

    def add_request(self, prompt: str | list[int], params: SamplingParams, request_id: str | None = None) -> str:
        """Queue a prompt (text, tokenized as is, or token ids). ValueError when it can never run."""
        req = self.make_request(prompt, params, request_id)
        self.add(req)
        return req.request_id

    def make_request(self, prompt: str | list[int], params: SamplingParams, request_id: str | None = None) -> Request:
        """Tokenize and check a prompt without touching engine state (safe from another thread)."""
        ids = self.tokenizer(prompt, add_special_tokens=False).input_ids if isinstance(prompt, str) else list(prompt)
        if not ids:
            raise ValueError("the prompt is empty")
        if len(ids) >= self.config.max_model_len:
            raise ValueError(f"the prompt has {len(ids)} tokens; this model accepts at most "
                             f"{self.config.max_model_len - 1} (max_model_len {self.config.max_model_len})")
        if not all(isinstance(t, int) and 0 <= t < self.model.args.vocab_size for t in ids):
            raise ValueError(f"prompt token ids must be ints in [0, {self.model.args.vocab_size})")
        request_id = request_id if request_id is not None else str(next(self._ids))
        return Request(request_id, ids, params, prompt if isinstance(prompt, str) else None)

    def add(self, req: Request) -> None:
        if req.request_id in self.requests:
            raise ValueError(f"request id {req.request_id!r} is already in use")
        self.requests[req.request_id] = req
        self.scheduler.add(req)

    def abort(self, request_id: str) -> None:
        req = self.requests.pop(request_id, None)
        if req is not None and not req.finished:
            self.scheduler.finish(req, "abort")

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def step(self) -> list[RequestOutput]:
        """One scheduled forward; returns the requests that got a token (or finished) this step."""
        t0 = time.perf_counter()
        plan = self.scheduler.schedule()
        if not plan.scheduled:
            if self.scheduler.waiting and not self.scheduler.running:
                raise RuntimeError("the next waiting request cannot be scheduled with an empty batch")
            return []
        decodes = sum(1 for r, n in plan.scheduled if n == 1 and r.output_token_ids)
        tables = [self.kv_cache.block_table(r.request_id) for r, _ in plan.scheduled]
        logits = self.runner.execute(plan.scheduled, tables)
        sampling = [r for r, n in plan.scheduled if r.num_computed_tokens + n == r.num_tokens]
        sampled = self.sampler(logits, [r.sampling_params for r in sampling], [r.generator for r in sampling])
        for req, n in plan.scheduled:
            req.num_computed_tokens += n
            self.kv_cache.cache_blocks(req.request_id, req.all_token_ids, req.num_computed_tokens)
        outputs = []
        for i, req in enumerate(sampling):
            req.output_token_ids.append(sampled.token_ids[i])
            if sampled.logprobs is not None and sampled.logprobs[i] is not None:
                req.output_logprobs.append(sampled.logprobs[i])
            self._check_stop(req)
            outputs.append(self._output(req))
        dt = time.perf_counter() - t0
        self._account(plan.num_tokens, plan.num_tokens - decodes, len(sampling), dt)
        return outputs

    def _account(self, num_tokens: int, prefill: int, num_sampled: int, dt: float) -> None:
        s = self.stats
        s.steps += 1
        s.step_tokens.append(num_tokens)
        s.decode_tokens += num_sampled
        if prefill > 0:
            s.prefill_tokens += prefill
            s.prefill_time += dt
        else:
            s.decode_time += dt

    def _check_stop(self, req: Request) -> None:
        p, tok = req.sampling_params, req.output_token_ids[-1]
        reason = None
        if (tok in self.eos_token_ids and not p.ignore_eos) or tok in p.stop_token_ids:
            reason = "stop"
        elif len(req.output_token_ids) >= p.max_tokens or req.num_tokens >= self.config.max_model_len:
            reason = "length"
        if p.stop or reason:
            req.text = self.tokenizer.decode(req.output_token_ids, skip_special_tokens=True)
            hits = [req.text.find(s) for s in p.stop if s in req.text]
            if hits:  # a stop string ends the text before it
                reason, req.text = "stop", req.text[: min(hits)]
        if reason:
            self.scheduler.finish(req, reason)

    def _output(self, req: Request) -> RequestOutput:
        if req.finished:
            self.requests.pop(req.request_id, None)
        return RequestOutput(req.request_id, req.prompt, req.prompt_token_ids, req.text, list(req.output_token_ids),
                             req.finished, req.finish_reason,
                             list(req.output_logprobs) if req.sampling_params.logprobs is not None else None,
                             req.num_cached_tokens)
