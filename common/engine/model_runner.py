"""Owns the model and its caches; turns a scheduled step into one packed forward and the logits to sample."""
from __future__ import annotations

import torch

from common import backend, cpu_gemm

from .config import EngineConfig
from .forward_batch import ForwardBatch
from .request import Request


class ModelRunner:
    """The model must provide: cache_specs(block_size) -> [CacheGroupSpec], cache_bytes_per_block(block_size),
    allocate_caches(num_blocks: {group: n}, block_size), forward(ForwardBatch) -> hidden [T, D] and
    compute_logits(hidden [N, D]) -> [N, V]."""

    def __init__(self, model, config: EngineConfig):
        self.model, self.config = model, config
        self.device = next(model.parameters()).device
        if self.device.type == "cpu":
            backend.keep_freed_host_memory()
            cpu_gemm.pack_linears(model)  # bf16 weights in oneDNN's layout (a no-op for fp32 models)
        self.specs = model.cache_specs(config.block_size)
        num_blocks = config.num_blocks or self._blocks_that_fit()
        self.num_blocks = {s.name: num_blocks for s in self.specs}
        model.allocate_caches(self.num_blocks, config.block_size)

    def _blocks_that_fit(self) -> int:
        """As many blocks per group as the memory budget holds, capped at what max_num_seqs full-length
        requests could use."""
        per_block = sum(self.model.cache_bytes_per_block(self.config.block_size).values())
        cap = self.config.max_num_seqs * -(-self.config.max_model_len // self.config.block_size) + 1
        return max(2, min(self.config.kv_cache_memory_bytes // per_block, cap))

    @torch.inference_mode()
    def execute(self, scheduled: list[tuple[Request, int]], block_tables: list[dict[str, list[int]]]) -> torch.Tensor:
        """Forward the scheduled tokens; returns logits [N, V] (fp32) for the N requests whose step reaches the
        end of their tokens, in scheduling order."""
        new_tokens = [r.all_token_ids[r.num_computed_tokens : r.num_computed_tokens + n] for r, n in scheduled]
        batch = ForwardBatch.build(new_tokens, [r.num_computed_tokens for r, _ in scheduled], block_tables,
                                   self.config.block_size, self.device)
        hidden = self.model(batch)  # [T, D]
        last = [i for i, (r, n) in enumerate(scheduled) if r.num_computed_tokens + n == r.num_tokens]
        rows = batch.cu_seqlens_q[1:].long()[last] - 1
        logits = self.model.compute_logits(hidden[rows])  # [N, V]
        backend.synchronize()
        return logits
