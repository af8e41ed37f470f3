"""Owns the model and its caches; turns a scheduled step into one packed forward and the logits to sample."""
from __future__ import annotations

import time
import weakref
from dataclasses import dataclass

import torch

from common import backend, cpu_gemm
from common.kv_cache import allocate_cache_tensors, cache_bytes_per_block, check_cache_specs, tensors_by_group

from .config import EngineConfig
from .encoder_cache import EncoderCache, gather_embeddings
from .forward_batch import ForwardBatch
from .graph_runner import GraphRunner, graph_capable
from .model_contract import CausalLM, ModelContract
from .multimodal import MultiModalInput
from .scheduler import ScheduledRequest


@dataclass
class ModelRunnerOutput:
    logits: torch.Tensor  # [N, V] fp32: per scheduled request that samples, in order, its last row and before it
    #   one row per draft verified (len(draft_token_ids) + 1 rows, positions in order)
    prompt_logits: list[torch.Tensor | None]  # per scheduled request: [len(prompt_logprob_positions), V] or None
    streams: torch.Tensor | None = None  # [T, n, D] residual streams, kept for the MTP drafts (speculative only)
    offsets: list[int] | None = None  # per scheduled request: its first row in streams


def blocks_that_fit(model, config: EngineConfig) -> dict[str, int]:
    """Blocks per cache group for the memory budget. A sliding-window group holds, per running request, only the
    blocks its window and its next chunk cover, so it gets what max_num_seqs requests can hold at once (a bound
    that does not grow with max_model_len); the full groups share the rest of the budget, capped at what
    max_num_seqs full-length requests could use. (Equal counts for every group left most of a windowed model's
    cache unusable: DeepSeek-V4-Flash keeps 97% of its bytes per token in the window group.) A state group gets
    a slot per running request (max_num_seqs), and with prefix caching twice as many more: a request writes a
    fresh slot in the step after a checkpoint, and saved checkpoints outlive their requests until evicted; under
    speculative decoding num_speculative_tokens more per request (a verify step writes a slot per candidate end)."""
    bs = config.block_size
    specs = model.cache_specs(bs)
    sizes = cache_bytes_per_block(model.cache_tensor_specs(), bs, model.engine_contract().dtype)
    per_block = {s.name: sizes.get(s.name, 0) for s in specs}  # bytes of one block of each group, all layers
    full_len = -(-config.max_model_len // bs)
    # a decoding request holds the blocks its window spans; the step's prefill chunks come on top (past that bound,
    # rare, the scheduler preempts as for any group)
    ahead = 2 * config.num_speculative_tokens  # drafts verified + the next drafts' lookahead, past the window
    bounded = {s.name: config.max_num_seqs * min(full_len, -(-(s.sliding_window - 1 + ahead) // bs) + 1)
               + -(-config.max_num_batched_tokens // bs) + 1 for s in specs if s.sliding_window is not None}
    per_request = (3 if config.enable_prefix_caching else 1) + config.num_speculative_tokens
    bounded |= {s.name: config.max_num_seqs * per_request + 1 for s in specs if s.is_state}
    full = [s.name for s in specs if s.sliding_window is None and not s.is_state]
    cap = config.max_num_seqs * full_len + 1
    left = config.kv_cache_memory_bytes - sum(n * per_block[g] for g, n in bounded.items())
    n_full = min(left // max(sum(per_block[g] for g in full), 1), cap) if full else 0
    if not full or n_full < 2:  # the budget does not even hold the windows: every group alike, as before
        n = max(2, min(config.kv_cache_memory_bytes // sum(per_block.values()), cap))
        return {s.name: n for s in specs}
    return {**bounded, **dict.fromkeys(full, n_full)}


_CACHE_OWNER = weakref.WeakKeyDictionary()  # model -> a weak reference to the owner of the caches it holds


def bind_new_caches(model: CausalLM, num_blocks: dict[str, int], block_size: int, owner: object = None,
                    contract: ModelContract | None = None) -> dict[str, list[torch.Tensor]]:
    """Allocate zeroed cache tensors for the model's CacheTensorSpecs (num_blocks per group, in the contract's dtype
    and device), bind them to the model and return them by group in spec order: the caller owns them. `owner`: the
    ModelRunner they are for; any other owner (None: a test, a one-shot forward) leaves every engine on this model
    refusing to run."""
    contract = contract or model.engine_contract()
    specs = model.cache_tensor_specs()
    tensors = allocate_cache_tensors(specs, num_blocks, block_size, contract.dtype, contract.device)
    model.bind_caches(tensors)
    if owner is None:
        _CACHE_OWNER.pop(model, None)
    else:
        _CACHE_OWNER[model] = weakref.ref(owner)
    return tensors_by_group(specs, tensors)


@torch.no_grad()
def prefill_logits(model: CausalLM, prompts: list[list[int]], block_size: int = 16) -> torch.Tensor:
    """Logits of every prompt position [T, V]: the whole prompts in one step over fresh contiguous caches (tests and
    benches; an engine on the same model refuses to run afterwards, its caches no longer bound)."""
    contract = model.engine_contract()
    specs = model.cache_specs(block_size)
    groups = [g.name for g in specs]
    batch, num_blocks = ForwardBatch.prefill(prompts, groups, block_size, contract.device,
                                             state_groups=tuple(g.name for g in specs if g.is_state))
    bind_new_caches(model, dict.fromkeys(groups, num_blocks), block_size, contract=contract)
    return model.compute_logits(model(batch))


class ModelRunner:
    """Runs a CausalLM (common/engine/model_contract.py) over the engine's steps. keep_streams: every step also
    returns the main model's residual streams (contract.mtp's halves), for the MTP drafts; contract.finish_prefill,
    where the model has it, is called after a step's forward with the rows of its batch (indices into the scheduled
    requests) whose prompt prefill ended in it."""

    def __init__(self, model: CausalLM, contract: ModelContract, config: EngineConfig, num_blocks: dict[str, int],
                 keep_streams: bool = False):
        if keep_streams and contract.mtp is None:
            raise ValueError("keep_streams needs the model's MTP halves (contract.mtp)")
        self.model, self.contract, self.config, self.keep_streams = model, contract, config, keep_streams
        self.device = contract.device
        if self.device.type == "cpu":
            backend.keep_freed_host_memory()
            cpu_gemm.pack_model(model)  # bf16 / fp32 weights into oneDNN's layout, once, dense copies dropped
        self.specs = model.cache_specs(config.block_size)
        check_cache_specs(self.specs, model.cache_tensor_specs())
        self.state_groups = tuple(s.name for s in self.specs if s.is_state)  # their tables: read, write slots
        self.num_blocks = dict(num_blocks)
        # the cache tensors, by group in spec order: this runner owns them (PD's KV transfer registers them)
        self.cache_tensors = bind_new_caches(model, self.num_blocks, config.block_size, self, contract)
        self.graphs = None  # exe_mode graph (auto: where it runs here): the decode steps' compiled buckets
        if config.exe_mode == "graph" or (config.exe_mode == "auto" and graph_capable(self.device)):
            self.graphs = GraphRunner(model, contract, config, [s.name for s in self.specs], self.device,
                                      keep_streams, self.state_groups)
            self.graphs.capture()
            if config.exe_mode == "auto":  # the buckets whose graph is slower than eager here run eager
                if self.graphs.one_rank:
                    self.graphs.start_trials()  # timed on its first real steps
                else:
                    self.graphs.calibrate()  # timed now, on padding steps, agreed by every rank

    def check_caches(self) -> None:
        """RuntimeError when the model's caches are no longer the ones this runner allocated: another engine on the
        same model (or prefill_logits) bound its own, and this engine's block tables (and graphs) would read and
        write its blocks."""
        if (owner := _CACHE_OWNER.get(self.model)) is None or owner() is not self:
            raise RuntimeError("the model's KV caches were reallocated by another engine on the same model: "
                               "give each engine its own model")

    @torch.inference_mode()
    def execute_idle(self) -> None:
        """A forward of no tokens, for a data-parallel rank with nothing to run (its collectives meet the others'):
        padding alone through the graph of the others' bucket when they run one."""
        self.check_caches()
        if self.graphs is not None and (bucket := self.graphs.step_bucket(0, True)) is not None:
            self.graphs.run(self.graphs.padding(bucket))
            return
        hidden = self.model(ForwardBatch.empty([s.name for s in self.specs], self.config.block_size, self.device,
                                               self.state_groups))
        self.model.compute_logits(hidden)

    @torch.inference_mode()
    def execute_encoder(self, inputs: list[MultiModalInput]) -> list[torch.Tensor]:
        """The encoder stage: a step's new images, across requests, in one call of the model's encoder -> per image
        its span's embeddings [length, D]."""
        if not inputs:
            return []
        outputs = self.contract.encoder.encode([mm.data for mm in inputs])
        for mm, out in zip(inputs, outputs):
            if out.shape[0] != mm.length:
                raise ValueError(f"the encoder gave {out.shape[0]} rows for an image of {mm.length} tokens")
        return outputs

    @torch.inference_mode()
    def execute(self, scheduled: list[ScheduledRequest], block_tables: list[dict[str, list[int]]],
                encoder_cache: EncoderCache | None = None) -> ModelRunnerOutput:
        """Forward the scheduled tokens; logits for the rows that sample and for the prompt positions scored. Chunks
        that reach images take their embeddings from encoder_cache."""
        self.check_caches()
        new_tokens = [s.request.all_token_ids[s.start : s.end - len(s.draft_token_ids)] + s.draft_token_ids
                      for s in scheduled]
        output = self._execute(scheduled, new_tokens, block_tables, encoder_cache)
        prefilled = [b for b, s in enumerate(scheduled) if s.sample and s.start < s.request.num_prompt_tokens]
        if prefilled and self.contract.finish_prefill is not None:
            self.contract.finish_prefill(prefilled)
        return output

    def _execute(self, scheduled: list[ScheduledRequest], new_tokens: list[list[int]],
                 block_tables: list[dict[str, list[int]]], encoder_cache: EncoderCache | None) -> ModelRunnerOutput:
        mm_rows, mm_embeds = self._multimodal_rows(scheduled, new_tokens, encoder_cache)
        if self.graphs is not None:
            fits = self.graphs.fits([s.num_new_tokens for s in scheduled]) and not any(
                s.prompt_logprob_positions for s in scheduled) and mm_rows is None
            if (bucket := self.graphs.step_bucket(len(scheduled), fits)) is not None:
                if (mode := self.graphs.trial_mode(bucket)) is None:
                    return self._execute_graph(scheduled, new_tokens, block_tables, bucket)
                start = time.perf_counter()  # exe_mode auto: this bucket's trial, real steps in each mode
                if mode == "graph":
                    output = self._execute_graph(scheduled, new_tokens, block_tables, bucket)
                else:
                    output = self._execute_eager(scheduled, new_tokens, block_tables, mm_rows, mm_embeds)
                self.graphs.record(bucket, mode, time.perf_counter() - start)
                return output
        return self._execute_eager(scheduled, new_tokens, block_tables, mm_rows, mm_embeds)

    def _execute_eager(self, scheduled: list[ScheduledRequest], new_tokens: list[list[int]],
                       block_tables: list[dict[str, list[int]]], mm_rows: torch.Tensor | None,
                       mm_embeds: torch.Tensor | None) -> ModelRunnerOutput:
        batch = ForwardBatch.build(new_tokens, [s.start for s in scheduled], block_tables, self.config.block_size,
                                   self.device, state_groups=self.state_groups)
        batch.mm_rows, batch.mm_embeds = mm_rows, mm_embeds
        streams = None
        if self.keep_streams:  # the model's two halves, the residual streams kept for the MTP drafts
            streams = self.contract.mtp.residual_streams(batch)  # [T, n, D]
            hidden = self.contract.mtp.final_hidden(streams)  # [T, D]
        else:
            hidden = self.model(batch)  # [T, D]
        ends = batch.cu_seqlens_q[1:].tolist()
        rows = [r for s, end in zip(scheduled, ends) if s.sample for r in range(end - 1 - len(s.draft_token_ids), end)]
        counts = [len(s.prompt_logprob_positions) for s in scheduled]
        for s, end, n in zip(scheduled, ends, counts):  # rows of positions p: the chunk's row p - start
            first = end - s.num_new_tokens + s.prompt_logprob_positions.start - s.start
            rows += range(first, first + n)
        logits = self.model.compute_logits(hidden[torch.tensor(rows, dtype=torch.long, device=hidden.device)])
        backend.synchronize()
        logits = logits.float()  # [N + sum(counts), V]
        num_sampled = len(rows) - sum(counts)
        parts = logits[num_sampled:].split(counts)
        return ModelRunnerOutput(logits[:num_sampled], [p if n else None for p, n in zip(parts, counts)], streams,
                                 [end - s.num_new_tokens for s, end in zip(scheduled, ends)])

    def _multimodal_rows(self, scheduled: list[ScheduledRequest], new_tokens: list[list[int]],
                         encoder_cache: EncoderCache | None) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """(rows [M], embeddings [M, D]) of the step's image positions, or (None, None) for a text-only step."""
        chunks, row = [], 0
        for s, tokens in zip(scheduled, new_tokens):
            if s.request.mm_inputs:
                chunks.append((s.request.mm_inputs, s.start, s.start + len(tokens), row))
            row += len(tokens)
        if not chunks:
            return None, None
        rows, pieces = gather_embeddings(encoder_cache, chunks)
        if not rows:
            return None, None
        return torch.tensor(rows, dtype=torch.long, device=self.device), torch.cat(pieces).to(self.device)

    def _execute_graph(self, scheduled: list[ScheduledRequest], new_tokens: list[list[int]],
                       block_tables: list[dict[str, list[int]]], bucket: int) -> ModelRunnerOutput:
        """A step of query_len-token sequences through its bucket's graph: the same output as `execute`'s."""
        batch = self.graphs.build(new_tokens, [s.start for s in scheduled], block_tables, bucket)
        logits, streams = self.graphs.run(batch, bucket)  # [B * Q, V], [B * Q, n, D] or None (B >= n)
        Q, n = self.graphs.query_len, len(scheduled)
        rows = [r for b, s in enumerate(scheduled) if s.sample
                for r in range((b + 1) * Q - 1 - len(s.draft_token_ids), (b + 1) * Q)]  # last row, drafts' before
        logits = logits[torch.tensor(rows, dtype=torch.long, device=logits.device)]
        backend.synchronize()
        return ModelRunnerOutput(logits.float(), [None] * n, None if streams is None else streams[: n * Q].clone(),
                                 [b * Q for b in range(n)])  # clone: a CUDA graph's outputs are overwritten next step
