"""vLLM's model interface over a recipe model (one process), through the model contract alone
(common/engine/model_contract.py): the constructor vLLM calls, a `CacheSlot` per cache tensor the model declares
(`cache_tensor_specs()`), the model's caches bound to vLLM's tensors (`bind_caches`, each tensor read through the
table of its vLLM group), and each step's flattened batch and attention metadata as the recipe's ForwardBatch.

A family subclass says how to build and load its model and, where the defaults do not fit, which vLLM spec each
of its cache tensors gets and which table the model reads it through.
"""
from __future__ import annotations

import json
import sys
from collections.abc import Iterable
from pathlib import Path

import torch
from torch import nn

import common
from common.engine.forward_batch import ForwardBatch
from common.kv_cache import CacheTensorSpec
from vllm.config import VllmConfig
from vllm.forward_context import get_forward_context
from vllm.v1.attention.backend import CommonAttentionMetadata
from vllm.v1.kv_cache_interface import KVCacheSpec

from .cache import CacheSlot, equal_page_specs

RECIPE_DIR = Path(common.__file__).resolve().parents[1] / "recipes" / "deepseek"
if str(RECIPE_DIR) not in sys.path:  # recipe folders are not packages: their modules import each other by name
    sys.path.insert(0, str(RECIPE_DIR))


class RecipeForCausalLM(nn.Module):
    """Subclasses set `family` (a name for messages) and implement build_model and load_into; cache_specs and
    table_of where the defaults (equal pages; each tensor through its recipe group's table) do not fit."""

    family = "recipe"

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = ""):
        super().__init__()
        model_config = vllm_config.model_config
        self.path = Path(model_config.model)
        if vllm_config.parallel_config.world_size != 1:
            raise ValueError(f"the npu-cookbook {self.family} plugin runs one process (tensor / pipeline parallel 1)")
        if not (self.path / "config.json").is_file():
            raise ValueError(f"the npu-cookbook {self.family} plugin reads a local checkpoint folder; "
                             f"{self.path} has no config.json")
        self.model = self.build_model(json.loads((self.path / "config.json").read_text()))
        self.contract = self.model.engine_contract()
        self.block_size, self.dtype = vllm_config.cache_config.block_size, model_config.dtype
        tensors = self.model.cache_tensor_specs()
        specs = self.cache_specs(tensors, self.block_size, self.dtype)
        self.slots = [CacheSlot(f"{prefix}.{t.name}" if prefix else t.name, t, specs[t.name], self._bind)
                      for t in tensors]

    # -- what a family provides
    def build_model(self, config: dict) -> nn.Module:
        raise NotImplementedError

    def cache_specs(self, tensors: list[CacheTensorSpec], block_size: int, dtype: torch.dtype) -> dict[str, KVCacheSpec]:
        """A vLLM spec per cache tensor, by name (default: cache.equal_page_specs)."""
        return equal_page_specs(tensors, block_size, dtype)

    def table_of(self, tensor: CacheTensorSpec) -> str:
        """The ForwardBatch block table (and slot mapping) key the model reads this tensor through (bind_caches'
        `tables`); default: its recipe group's, which vLLM must then give one cache group."""
        return tensor.group

    def load_into(self) -> None:
        raise NotImplementedError

    # -- vLLM's model interface
    def _bind(self) -> None:
        """Once vLLM has bound every slot: the model's caches are vLLM's tensors."""
        if all(s.cache is not None for s in self.slots):
            self.model.bind_caches({s.tensor.name: s.cache for s in self.slots},
                                   tables={s.tensor.name: self.table_of(s.tensor) for s in self.slots})

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens(input_ids)  # [T, D]

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, intermediate_tensors=None,
                inputs_embeds: torch.Tensor | None = None, **kwargs) -> torch.Tensor:
        """input_ids, positions [T] (vLLM's flattened step) -> hidden states [T, D]."""
        if inputs_embeds is not None:
            raise ValueError(f"the npu-cookbook {self.family} plugin takes token ids, not inputs_embeds")
        metadata = get_forward_context().attn_metadata
        T = input_ids.shape[0]
        if not metadata:  # a dummy step (no request, no cache): nothing to attend to
            return torch.zeros(T, self.contract.hidden_size, dtype=self.contract.dtype, device=input_ids.device)
        hidden = self.model(self.forward_batch(input_ids, positions, metadata))  # [n, D]
        if hidden.shape[0] < T:  # vLLM padded the step: padding rows are never sampled
            hidden = torch.cat([hidden, hidden.new_zeros(T - hidden.shape[0], hidden.shape[1])])
        return hidden

    def forward_batch(self, input_ids: torch.Tensor, positions: torch.Tensor,
                      metadata: dict[str, CommonAttentionMetadata]) -> ForwardBatch:
        """vLLM's step (its tokens and each cache group's attention metadata) as the recipe's packed ForwardBatch:
        each cache tensor's block table and slot mapping are its vLLM group's."""
        first = metadata[self.slots[0].prefix]
        n, B = first.num_actual_tokens, first.num_reqs
        cu = first.query_start_loc[: B + 1].to(torch.int32)  # [B+1]
        seq_ids = torch.repeat_interleave(torch.arange(B, device=cu.device), cu.diff())  # [n]
        tables, slots, source = {}, {}, {}
        for slot in self.slots:
            m, key = metadata[slot.prefix], self.table_of(slot.tensor)
            if source.setdefault(key, m) is not m:
                raise RuntimeError(f"{slot.prefix}: the model reads it through block table {key!r}, which vLLM gave "
                                   "another cache group (the specs put them in different groups)")
            tables[key] = m.block_table_tensor[:B].to(torch.int32)  # [B, max_blocks]
            slots[key] = m.slot_mapping[:n].long()  # [n]
        return ForwardBatch(
            input_ids=input_ids[:n].long(), positions=positions[:n].long(), seq_ids=seq_ids, cu_seqlens_q=cu,
            seq_lens=first.seq_lens[:B].to(torch.int32), block_size=self.block_size, block_tables=tables,
            slot_mapping=slots, max_seqlen_q=int(first.max_query_len), max_seqlen_k=int(first.max_seq_len))

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.model.compute_logits(hidden_states)  # [N, V] fp32

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Read the checkpoint folder through the recipe's loader (publisher or transformers names, FP8 / MXFP4
        dequantized); vLLM's own iterator is left unread. Returns the names of every parameter filled."""
        self.load_into()
        return {f"model.{n}" for n, _ in self.model.named_parameters()}
