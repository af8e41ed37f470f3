"""The engine step loop shared by offline generation and the server: schedule, forward, sample, update.

A step whose forward (or sampling) raises fails the requests it scheduled, not the engine: they finish with
finish_reason "error" and the message, their KV blocks are freed, and the next step serves the others.

Over several ranks (the model's common.parallel.Parallel): each attention-DP rank runs its own engine over its own
requests; attention-TP peers run the same requests and sample alike (one generator, seeded alike). Every rank
steps in lock-step (`has_unfinished_anywhere`), and a rank with nothing scheduled forwards an empty batch, so the
expert-parallel collectives of the others never wait for it. A fault in a step there ends the job (the other ranks'
collectives would wait for the failed one): the exception propagates.

PD disaggregation goes through a KV connector (common/engine/kv_connector.py: the Protocol and its block-ownership
promises; common/kv_transfer holds the Mooncake implementations), called on the engine's thread:
`start_load(request, block_table)` when a do_remote_prefill request got its blocks (decode side),
`cancel_load(request_id)` when one is aborted while its KV is on the way (its blocks are freed only once the
prefill side no longer writes them: the connector then calls `fail_remote_prefill`), and `start_send(request,
block_table)` when a do_remote_decode request finished (prefill side; `release_sent` frees its blocks after).

Structured output (common/engine/structured_output.py): a request whose SamplingParams has `structured_outputs` is
compiled in make_request (ValueError before it is queued), gets its grammar state at `add`, has its rows masked
before sampling and draft verification, and advances its grammar by every committed token (those a PD prefill
instance sampled included). A committed token the grammar refuses fails that request ("error"), not the engine.
"""
from __future__ import annotations

import collections
import dataclasses
import itertools
import logging
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from common import parallel as par
from common.frame_stack import call_on_fresh_chunk
from common.kv_cache import KVCacheManager

from .config import EngineConfig
from .detokenizer import IncrementalDetokenizer, find_stop
from .kv_connector import KVConnector
from .model_runner import ModelRunner, blocks_that_fit
from .multimodal import MultiModalInput, check_placements, expand_placeholders, multimodal_prompt
from .request import Request, RequestStatus
from .sampler import Sampler, TokenLogprobs, make_generator, token_logprobs
from .sampling_params import SamplingParams
from .scheduler import Scheduler, SchedulerOutput
from .spec_decode import MTPProposer
from .structured_output import StructuredOutputManager

logger = logging.getLogger(__name__)
RECENT_STEPS = 1024  # EngineStats.recent_step_tokens keeps this many


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    text: str
    token_ids: list[int]
    finished: bool
    finish_reason: str | None  # "stop" | "length" | "abort" | "error"
    logprobs: list[TokenLogprobs] | None = None
    num_cached_tokens: int = 0
    prompt_logprobs: list[TokenLogprobs] | None = None  # prompt tokens 1.. (the first has none), when asked
    error: str | None = None  # finish_reason "error": what failed


@dataclass
class EngineStats:
    prefill_tokens: int = 0  # prompt (and recomputed) tokens run through the model
    decode_tokens: int = 0  # tokens generated
    prefill_time: float = 0.0  # seconds in steps that ran prefill tokens
    decode_time: float = 0.0  # seconds in decode-only steps
    steps: int = 0
    step_errors: int = 0  # steps whose forward or sampling raised
    consecutive_step_errors: int = 0  # since the last step that succeeded
    num_draft_tokens: int = 0  # MTP drafts verified (speculative decoding)
    num_accepted_tokens: int = 0  # of them, accepted
    num_verify_steps: int = 0  # request-steps that verified drafts
    propose_time: float = 0.0  # seconds in the MTP proposer (part of the step times above)
    encoder_calls: int = 0  # encoder-stage calls (one per step that had images to encode)
    encoder_images: int = 0  # images encoded
    encoder_time: float = 0.0  # seconds in the encoder stage (part of the prefill time)

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens committed per verifying request-step: accepted drafts + 1."""
        return 1 + self.num_accepted_tokens / self.num_verify_steps if self.num_verify_steps else 0.0

    recent_step_tokens: collections.deque = dataclasses.field(
        default_factory=lambda: collections.deque(maxlen=RECENT_STEPS))  # tokens of the last steps


class LLMEngine:
    def __init__(self, model, tokenizer, config: EngineConfig | None = None, kv_connector: KVConnector | None = None):
        self.model, self.tokenizer, self.kv_connector = model, tokenizer, kv_connector
        self.contract = contract = model.engine_contract()
        config = (config or EngineConfig()).resolve(contract.max_position_embeddings)
        specs = model.cache_specs(config.block_size)
        num_blocks = ({s.name: config.num_blocks for s in specs} if config.num_blocks
                      else blocks_that_fit(model, config))
        full = [num_blocks[s.name] for s in specs if s.sliding_window is None and not s.is_state] \
            or list(num_blocks.values())
        capacity = (min(full) - 1) * config.block_size  # tokens of one request in the full groups
        if capacity < config.max_model_len:  # one request must always fit in the whole cache
            logger.warning("the KV cache holds %d tokens: max_model_len lowered from %d", capacity,
                           config.max_model_len)
            config = dataclasses.replace(config, max_model_len=capacity)
        self.config = config  # final: the cache is sized from these numbers and they never change
        self.parallel = contract.parallel or par.Parallel(par.LLMParallelLayout())
        self.dp_group, tp_group = self.parallel.group("attn_dp"), self.parallel.group("attn_tp")
        self.proposer = None  # MTP drafts (speculative decoding)
        if config.num_speculative_tokens:
            if contract.mtp is None:
                raise ValueError("speculative decoding needs the model's MTP layer (load_model(..., mtp=True) with a "
                                 "checkpoint whose num_nextn_predict_layers >= 1)")
            self.runner = ModelRunner(model, contract, config, num_blocks, keep_streams=True)
            self.proposer = MTPProposer(contract.mtp, [s.name for s in specs], self.runner.device,
                                        config.num_speculative_tokens, config.block_size, config.max_model_len,
                                        lockstep=par.group_size(self.dp_group) > 1,
                                        state_groups=self.runner.state_groups)
        else:
            self.runner = ModelRunner(model, contract, config, num_blocks)
        self.kv_cache = KVCacheManager(self.runner.specs, self.runner.num_blocks, config.enable_prefix_caching,
                                       state_writes=1 + config.num_speculative_tokens)
        self.scheduler = Scheduler(config, self.kv_cache)
        generator = None
        if par.group_size(tp_group) > 1:  # TP peers draw the same noise: one seed, from the group's first rank
            generator = make_generator(par.broadcast_int(random.SystemRandom().getrandbits(62), tp_group))
        self.sampler = Sampler(generator)
        self.eos_token_ids = set(contract.eos_token_ids)
        self.structured_output = None  # the grammar compiler and masks; None without a tokenizer
        if tokenizer is not None:
            self.structured_output = StructuredOutputManager(tokenizer, contract.vocab_size,
                                                             list(contract.eos_token_ids))
        self.stats = EngineStats()
        self._ids = itertools.count()

    @property
    def requests(self) -> dict[str, Request]:
        """The unfinished requests by id (the scheduler's; read-only use)."""
        return self.scheduler.requests

    def add_request(self, prompt: str | list[int] | dict, params: SamplingParams, request_id: str | None = None,
                    add_special_tokens: bool = True) -> str:
        """Queue a prompt (text, see `tokenize`; token ids; or a multimodal prompt: see make_request). ValueError
        when it can never run."""
        req = self.make_request(prompt, params, request_id, add_special_tokens)
        self.add(req)
        return req.request_id

    def tokenize(self, prompt: str | list[int], add_special_tokens: bool = True) -> list[int]:
        """A prompt's token ids. Text gets the tokenizer's special tokens (its BOS, where it adds one) unless
        add_special_tokens is False (text that already carries them: a rendered chat prompt), as vLLM tokenizes
        completions and LLM.generate prompts; token ids are used as given."""
        return (self.tokenizer(prompt, add_special_tokens=add_special_tokens).input_ids if isinstance(prompt, str)
                else list(prompt))

    def make_request(self, prompt: str | list[int] | dict, params: SamplingParams, request_id: str | None = None,
                     add_special_tokens: bool = True, mm_inputs: Sequence[MultiModalInput] = ()) -> Request:
        """Tokenize (`tokenize`) and check a prompt without touching engine state (safe from another thread).

        A multimodal prompt is vLLM's dict: {"prompt": text or "prompt_token_ids": ids, "multi_modal_data":
        {"image": an image or a list of them}} (encoded bytes, PIL images or paths), the prompt holding one image
        placeholder per image; each image goes through the model's encoder stage (`place_images`). mm_inputs: the
        images of a prompt of ids already expanded (placed where they lie)."""
        if isinstance(prompt, dict):
            if mm_inputs:
                raise ValueError("a multimodal prompt dict carries its images itself: pass no mm_inputs with it")
            text, images = multimodal_prompt(prompt)
            prompt, mm_inputs = self.place_images(self.tokenize(text, add_special_tokens), images)
        ids = self.tokenize(prompt, add_special_tokens)
        if not ids:
            raise ValueError("the prompt is empty")
        if len(ids) >= self.config.max_model_len:
            raise ValueError(f"the prompt has {len(ids)} tokens; this model accepts at most "
                             f"{self.config.max_model_len - 1} (max_model_len {self.config.max_model_len})")
        if not all(isinstance(t, int) and 0 <= t < self.contract.vocab_size for t in ids):
            raise ValueError(f"prompt token ids must be ints in [0, {self.contract.vocab_size})")
        self._check_images(ids, list(mm_inputs))
        if params.structured_outputs is not None:
            if self.structured_output is None:
                raise ValueError("structured_outputs needs the engine's tokenizer")
            self.structured_output.compile(params.structured_outputs)  # ValueError for what it refuses
        request_id = request_id if request_id is not None else str(next(self._ids))
        return Request(request_id, ids, params, prompt if isinstance(prompt, str) else None,
                       mm_inputs=list(mm_inputs))

    def place_images(self, prompt: str | list[int], images: Sequence) -> tuple[list[int], list[MultiModalInput]]:
        """A prompt with one image placeholder per image -> its ids with each placeholder expanded to the image's
        span, and the images placed there (the model's encoder stage processes each: ValueError naming what is wrong
        with one, or when the model takes no images)."""
        encoder = self.contract.encoder
        if encoder is None:
            raise ValueError("this model takes no images (its checkpoint has no vision tower)")
        ids = self.tokenize(prompt, add_special_tokens=False)
        items = []
        for i, image in enumerate(images):
            try:
                item = encoder.process(image)
            except ValueError as e:
                raise ValueError(f"image {i}: {e}") from None
            items.append(dataclasses.replace(item, source=bytes(image)) if isinstance(image, (bytes, bytearray))
                         else item)
        return expand_placeholders(ids, items, encoder.placeholder_token_id)

    def _check_images(self, ids: list[int], mm_inputs: list[MultiModalInput]) -> None:
        """ValueError unless the images lie on placeholder ids and each fits the encoder's budget and cache."""
        encoder = self.contract.encoder
        if not mm_inputs:
            return
        if encoder is None:
            raise ValueError("this model takes no images (its checkpoint has no vision tower)")
        check_placements(ids, mm_inputs, encoder.placeholder_token_id)
        limit = min(self.config.max_num_encoder_input_tokens, self.config.encoder_cache_size)
        for i, mm in enumerate(mm_inputs):
            if mm.length > limit:
                raise ValueError(f"image {i} takes {mm.length} tokens, more than the encoder takes at once ({limit}: "
                                 "raise max_num_encoder_input_tokens and encoder_cache_size)")
            if mm.data is None:
                raise ValueError(f"image {i} has no data to encode")

    def add(self, req: Request) -> None:
        """Queue a request made by make_request. ValueError for an id in use."""
        p = req.sampling_params
        grammar = (self.structured_output.start(p.structured_outputs, req.prompt_token_ids)
                   if p.structured_outputs is not None else None)  # compiled in make_request: a cache hit
        self.scheduler.add(req)
        req.grammar = grammar
        req.detokenizer = IncrementalDetokenizer(self.tokenizer, p.skip_special_tokens, req.prompt_token_ids)

    def abort(self, request_id: str) -> None:
        req = self.scheduler.requests.get(request_id)
        if req is not None and req.status is RequestStatus.WAITING_FOR_REMOTE_KVS:
            self.kv_connector.cancel_load(request_id)  # its blocks may still be written: the connector frees them
            return
        if self.scheduler.abort(request_id) is not None:
            req.grammar = None

    def finish_remote_prefill(self, request_id: str, token_ids: list[int], logprobs: list | None = None,
                              prompt_logprobs: list | None = None, num_cached_tokens: int = 0) -> RequestOutput | None:
        """Decode side: the prompt's KV is in the request's blocks and the prefill instance sampled token_ids (its
        first token; none for max_tokens 0). The request runs on from here; its output, or None if it is gone."""
        req = self.scheduler.receiving.get(request_id)
        if req is None:
            return None
        self.scheduler.remote_prefill_done(req)
        req.num_cached_tokens = num_cached_tokens
        req.prompt_logprobs = list(prompt_logprobs or [])
        reason = None if token_ids else "length"
        for token, lp in zip(token_ids, logprobs or [None] * len(token_ids)):
            req.output_token_ids.append(token)
            if lp is not None:
                req.output_logprobs.append(lp)
            self.stats.decode_tokens += 1
            if reason := self._stop_reason(req):
                break
        if reason:
            self.scheduler.finish(req, reason)
            req.grammar = None
        else:
            self.sampler.skip(req.sampling_params, req.generator, self.contract.vocab_size)  # as if sampled here
        return self._output(req)

    def fail_remote_prefill(self, request_id: str, error: str | None) -> RequestOutput | None:
        """Decode side: the prompt's KV will not come (error: why; None: the request was aborted); the prefill
        instance no longer writes its blocks, which are freed. Its output, or None if it is gone."""
        req = self.scheduler.receiving.get(request_id)
        if req is None:
            return None
        req.error = error
        self.scheduler.finish(req, "abort" if error is None else "error")
        req.grammar = None
        return self._output(req)

    def release_sent(self, request_id: str) -> None:
        """Prefill side: the connector has sent (or given up sending) a finished request's blocks."""
        self.scheduler.release(request_id)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def has_unfinished_anywhere(self) -> bool:
        """Whether this or another data-parallel rank has requests: then every rank steps (a collective)."""
        return par.any_rank(self.has_unfinished(), self.dp_group)

    def step(self) -> list[RequestOutput]:
        """One scheduled forward; returns the requests that got a token (or finished) this step."""
        return call_on_fresh_chunk(self._step)  # its calls never cross a chunk of CPython's frame stack over and over

    def _step(self) -> list[RequestOutput]:
        t0 = time.perf_counter()
        plan = self.scheduler.schedule()
        for req in plan.remote_prefills:
            self.kv_connector.start_load(req, self.kv_cache.block_table(req.request_id))
        if not plan.scheduled:
            s = self.scheduler
            if s.waiting and not (s.running or s.receiving or s.sending):  # blocks that will come back: wait
                raise RuntimeError("the next waiting request cannot be scheduled with an empty batch")
            if par.group_size(self.dp_group) > 1:
                self.runner.execute_idle()  # the other DP ranks' step: meet their collectives
                if self.proposer is not None:
                    self.proposer.propose([], None, [], [])  # and their MTP forwards
            return []
        sampling = [s for s in plan.scheduled if s.sample]
        try:
            prompt_logprobs, result, tables = self._forward(plan)
            committed = self._sample(sampling, result.logits)
        except Exception as e:  # noqa: BLE001 - the step's requests fail, the engine goes on
            return self._fail_step(plan, e)
        self.stats.consecutive_step_errors = 0
        decodes = sum(s.num_new_tokens for s in plan.scheduled
                      if s.num_new_tokens - len(s.draft_token_ids) == 1 and s.request.output_token_ids)
        num_generated, stops = 0, {}
        for s, (tokens, logprobs) in zip(sampling, committed):
            req = s.request
            for n, (token, lp) in enumerate(zip(tokens, logprobs), 1):
                req.output_token_ids.append(token)
                if lp is not None:
                    req.output_logprobs.append(lp)
                num_generated += 1
                if reason := self._stop_reason(req):  # committed tokens after a stop are dropped
                    stops[req.request_id] = reason
                    break
            s.num_accepted = min(s.num_accepted, n)  # the accepted drafts still in the sequence
        self.scheduler.update_from_output(plan)  # before the stopped ones finish: their full blocks register too
        outputs = []
        for s, lps in zip(plan.scheduled, prompt_logprobs):
            if lps is not None:
                s.request.prompt_logprobs += lps
            if s.end == s.request.num_tokens and not s.sample:  # max_tokens 0: the prompt was all there was to do
                self._finish(s.request, "length")
                outputs.append(self._output(s.request))
        for s in sampling:
            if s.request.request_id in stops:
                self._finish(s.request, stops[s.request.request_id])
            outputs.append(self._output(s.request))
        if self.proposer is not None:
            t1 = time.perf_counter()
            try:
                drafts = self.proposer.propose(plan.scheduled, result.streams, result.offsets, tables)
            except Exception as e:  # noqa: BLE001 - as a failed forward
                return self._fail_step(plan, e)
            for s in plan.scheduled:
                s.request.spec_token_ids = drafts.get(s.request.request_id, [])
            self.stats.propose_time += time.perf_counter() - t1
        self._account(plan.num_tokens, plan.num_tokens - decodes, num_generated, time.perf_counter() - t0)
        return outputs

    def _sample(self, sampling, logits: torch.Tensor) -> list[tuple[list[int], list]]:
        """Per sampling request, the tokens its rows commit and their logprobs (or None each); sets num_accepted.
        Greedy requests and requests without drafts: the sampler over all their rows, drafts accepted while they
        equal the row's token, then that row's token. Sampled requests with drafts: Sampler.verify (the
        speculative-sampling rule). Rows of structured-output requests are masked first (logits in place: log-probs
        then describe the masked distribution, as vLLM's)."""
        spans, plain, row = [], [], 0
        for s in sampling:
            spans.append(range(row, row + len(s.draft_token_ids) + 1))
            row = spans[-1].stop
            if s.request.sampling_params.greedy or not s.draft_token_ids:
                plain += spans[-1]
        constrained = [(s.request.grammar, span.start, s.draft_token_ids) for s, span in zip(sampling, spans)
                       if s.request.grammar is not None]
        if constrained:
            self.structured_output.apply(logits, constrained)  # before sampling and verification
        reqs = {r: s.request for s, span in zip(sampling, spans) for r in span}
        sampled = self.sampler(logits[plain], [reqs[r].sampling_params for r in plain],
                               [reqs[r].generator for r in plain]) if plain else None
        at = {r: j for j, r in enumerate(plain)}
        out = []
        for s, span in zip(sampling, spans):
            req, drafts = s.request, s.draft_token_ids
            p = req.sampling_params
            if span.start in at:
                tokens = [sampled.token_ids[at[r]] for r in span]
                a = next((i for i, d in enumerate(drafts) if tokens[i] != d), len(drafts))
                tokens = tokens[: a + 1]
                lps = [sampled.logprobs[at[r]] if sampled.logprobs is not None else None for r in span][: a + 1]
            else:
                tokens = self.sampler.verify(logits[span.start: span.stop], p, req.generator, drafts)
                a = len(tokens) - 1
                lps = (token_logprobs(logits[span.start: span.start + a + 1], torch.tensor(tokens, device=logits.device),
                                      [p.logprobs] * (a + 1)) if p.logprobs is not None else [None] * (a + 1))
            s.num_accepted = a
            if drafts:
                self.stats.num_draft_tokens += len(drafts)
                self.stats.num_accepted_tokens += a
                self.stats.num_verify_steps += 1
            out.append((tokens, lps))
        return out

    def _forward(self, plan: SchedulerOutput):
        """Run the model for a step: (per scheduled request its new prompt log-probs or None, the runner's output,
        the block tables it ran with)."""
        tables = [self.kv_cache.block_table(s.request.request_id) for s in plan.scheduled]
        encoder_cache = self.scheduler.encoder_cache
        if plan.encoder_inputs:  # the encoder stage: the step's new images, before the prefill that reads them
            t0 = time.perf_counter()
            for mm, output in zip(plan.encoder_inputs, self.runner.execute_encoder(plan.encoder_inputs)):
                encoder_cache.put(mm.identifier, output)
            self.stats.encoder_time += time.perf_counter() - t0
            self.stats.encoder_calls += 1
            self.stats.encoder_images += len(plan.encoder_inputs)
        result = self.runner.execute(plan.scheduled, tables, encoder_cache)
        prompt_logprobs = []
        for s, logits in zip(plan.scheduled, result.prompt_logits):
            if logits is None:
                prompt_logprobs.append(None)
                continue
            positions = s.prompt_logprob_positions
            next_ids = torch.tensor(s.request.prompt_token_ids[positions.start + 1: positions.stop + 1],
                                    device=logits.device)
            prompt_logprobs.append(token_logprobs(logits, next_ids, [s.request.sampling_params.prompt_logprobs]
                                                  * len(positions)))
        return prompt_logprobs, result, tables

    def _finish(self, req: Request, reason: str) -> None:
        self.scheduler.finish(req, reason)
        req.grammar = None
        if req.request_id in self.scheduler.sending:  # PD prefill side: its blocks go to the decode instance
            self.kv_connector.start_send(req, self.kv_cache.block_table(req.request_id))

    def _fail_step(self, plan: SchedulerOutput, e: Exception) -> list[RequestOutput]:
        """Finish every request of a failed step with finish_reason "error"; their blocks go back to the pool.
        Over several ranks the exception propagates instead: the job ends."""
        if self.parallel.world_size > 1:
            raise e
        message = f"{type(e).__name__}: {e}"
        logger.exception("engine step %d failed (%d requests): %s", self.stats.steps, len(plan.scheduled), message)
        self.stats.step_errors += 1
        self.stats.consecutive_step_errors += 1
        outputs = []
        for s in plan.scheduled:
            s.request.error = message
            self.scheduler.finish(s.request, "error")
            s.request.grammar = None
            outputs.append(self._output(s.request))
        return outputs

    def _account(self, num_tokens: int, prefill: int, num_sampled: int, dt: float) -> None:
        s = self.stats
        s.steps += 1
        s.recent_step_tokens.append(num_tokens)
        s.decode_tokens += num_sampled
        if prefill > 0:
            s.prefill_tokens += prefill
            s.prefill_time += dt
        else:
            s.decode_time += dt

    def _stop_reason(self, req: Request) -> str | None:
        """After appending a token: "stop" / "length" if the request ends with it, else None; the text follows
        the token (cut before a stop string) and so does its grammar ("error", with req.error, when the grammar
        refuses it; "stop" once the grammar has terminated)."""
        p, tok = req.sampling_params, req.output_token_ids[-1]
        reason = None
        if req.grammar is not None and not self.structured_output.accept(req.grammar, tok):
            req.error = (f"token {tok} does not continue the request's structured_outputs grammar (after "
                         f"{len(req.output_token_ids) - 1} output tokens)")
            return "error"
        if (tok in self.eos_token_ids and not p.ignore_eos) or tok in p.stop_token_ids:
            reason = "stop"
        elif req.grammar is not None and StructuredOutputManager.is_terminated(req.grammar):
            reason = "stop"  # the grammar ended with a stop token (under ignore_eos: nothing else may follow)
        elif len(req.output_token_ids) >= p.max_tokens or req.num_tokens >= self.config.max_model_len:
            reason = "length"
        delta = req.detokenizer.update([tok])
        req.text = req.detokenizer.text
        cut = find_stop(req.text, len(delta), p.stop) if p.stop else None
        if cut is not None:  # a stop string ends the text before it
            reason, req.text = "stop", req.text[:cut]
        return reason

    def _output(self, req: Request) -> RequestOutput:
        p = req.sampling_params
        return RequestOutput(req.request_id, req.prompt, req.prompt_token_ids, req.text, list(req.output_token_ids),
                             req.finished, req.finish_reason, list(req.output_logprobs) if p.logprobs is not None
                             else None, req.num_cached_tokens,
                             list(req.prompt_logprobs) if p.prompt_logprobs is not None else None, req.error)
