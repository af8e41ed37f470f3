"""The recipe's DeepSeek-V4 (recipes/deepseek/modeling_deepseek_v4.py, on common.ops) as a vLLM model.

vLLM's block manager owns the caches. Every cache tensor of the recipe (a layer's sliding-window KV, each
compressor's per-token state, each compressor's entries) is one vLLM cache layer (`CacheSlot`) with a per-token
`FullAttentionSpec` of its own width, so all of them share one block size and one block table (one vLLM KV cache
group of uniform type), and vLLM's per-block view of the slot is byte for byte the tensor the recipe allocates
itself. The compressed entries ([blocks, block_size / ratio, 1, head_dim]) are declared as head_dim / ratio
elements per token, the same bytes per block.

Each step the packed batch vLLM hands the model (flattened tokens, prefill and decode mixed) and its attention
metadata (query start locations, kv lengths, block table, slot mapping) become the recipe's ForwardBatch; every
recipe cache group reads that one block table.
"""
from __future__ import annotations

import json
import sys
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import ClassVar

import torch
from torch import nn

import common
from common.engine.forward_batch import ForwardBatch
from common.loader import Checkpoint, load_weights as load_checkpoint
from vllm.config import VllmConfig, get_current_vllm_config
from vllm.forward_context import get_forward_context
from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase
from vllm.v1.attention.backend import (AttentionBackend, AttentionCGSupport, AttentionMetadataBuilder,
                                       CommonAttentionMetadata)
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheSpec

RECIPE_DIR = Path(common.__file__).resolve().parents[1] / "recipes" / "deepseek"
if str(RECIPE_DIR) not in sys.path:  # recipe folders are not packages: their modules import each other by name
    sys.path.insert(0, str(RECIPE_DIR))

from config_deepseek_v4 import ModelArgs  # noqa: E402
from modeling_deepseek_v4 import DeepseekV4  # noqa: E402
from weights_deepseek_v4 import MTP, PACKED, _packed_loader, rename  # noqa: E402


class RecipeCacheBackend(AttentionBackend):
    """The backend of the recipe's cache slots: no kernel of its own (the recipe's ops read the cache); its
    metadata is vLLM's CommonAttentionMetadata, passed through."""

    supported_dtypes: ClassVar[list[torch.dtype]] = [torch.float32, torch.bfloat16, torch.float16]
    supported_kv_cache_dtypes: ClassVar[list[str]] = ["auto", "float32", "bfloat16", "float16"]

    @staticmethod
    def get_name() -> str:
        return "NPU_COOKBOOK_RECIPE_CACHE"

    @staticmethod
    def get_impl_cls():
        raise NotImplementedError("the recipe's cache slots compute nothing: the model's own ops read them")

    @staticmethod
    def get_builder_cls() -> type["RecipeCacheMetadataBuilder"]:
        return RecipeCacheMetadataBuilder


class RecipeCacheMetadataBuilder(AttentionMetadataBuilder[CommonAttentionMetadata]):
    _cudagraph_support: ClassVar[AttentionCGSupport] = AttentionCGSupport.NEVER

    def __init__(self, kv_cache_spec, layer_names, vllm_config, device):
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)

    def build(self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata,
              fast_build: bool = False) -> CommonAttentionMetadata:
        return common_attn_metadata


class CacheSlot(nn.Module, AttentionLayerBase):
    """One cache tensor of the recipe in vLLM's block manager: `width` elements per token, blocks of block_size
    tokens. bind_kv_cache gives `assign` vLLM's view [num_blocks, 1, block_size, width] (contiguous)."""

    def __init__(self, prefix: str, width: int, block_size: int, dtype: torch.dtype,
                 assign: Callable[[torch.Tensor], None]):
        super().__init__()
        self.prefix, self.width, self.block_size, self.dtype, self.assign = prefix, width, block_size, dtype, assign
        self.kv_cache = torch.tensor([])
        context = get_current_vllm_config().compilation_config.static_forward_context
        if prefix in context:
            raise ValueError(f"duplicate cache layer name {prefix!r}")
        context[prefix] = self

    def get_kv_cache_spec(self, vllm_config: VllmConfig) -> KVCacheSpec:
        return FullAttentionSpec(block_size=self.block_size, num_kv_heads=1, head_size=self.width, head_size_v=0,
                                 dtype=self.dtype)

    def bind_kv_cache(self, kv_cache: torch.Tensor) -> None:
        if not kv_cache.is_contiguous():
            raise ValueError(f"{self.prefix}: vLLM's cache view is not contiguous (a block-outer KV cache layout?); "
                             "the recipe's caches need a layer-outer one (VLLM_KV_CACHE_LAYOUT=LBHNC)")
        self.kv_cache = kv_cache
        self.assign(kv_cache)

    def get_attn_backend(self) -> type[AttentionBackend]:
        return RecipeCacheBackend


def _slots_of(model: DeepseekV4, prefix: str, block_size: int, dtype: torch.dtype) -> list[CacheSlot]:
    """A CacheSlot for every cache tensor the recipe's allocate_caches would create, each assigning vLLM's view
    to the recipe module's attribute in the recipe's shape."""
    slots = []

    def slot(name: str, owner: nn.Module, attr: str, per_block: int, row: int):
        def assign(t: torch.Tensor):  # [num_blocks, 1, block_size, width] -> the recipe's [num_blocks, rows, 1, row]
            setattr(owner, attr, t.view(t.shape[0], per_block, 1, row))
        width = per_block * row // block_size
        slots.append(CacheSlot(f"{prefix}{name}", width, block_size, dtype, assign))

    for i, layer in enumerate(model.layers):
        attn = layer.attn
        slot(f"layers.{i}.attn.kv_cache", attn, "kv_cache", block_size, attn.head_dim)
        for name, c in (("compressor", attn.compressor), ("indexer.compressor", attn.indexer and attn.indexer.compressor)):
            if c is None:
                continue
            if c.head_dim % c.ratio:
                raise ValueError(f"layer {i} {name}: head_dim {c.head_dim} is not a multiple of its compress ratio "
                                 f"{c.ratio}, so its entries do not fill whole per-token rows")
            slot(f"layers.{i}.attn.{name}.state", c, "state", block_size, 2 * c.width)
            slot(f"layers.{i}.attn.{name}.entries", c, "entries", block_size // c.ratio, c.head_dim)
    return slots


class NpuCookbookDeepseekV4ForCausalLM(nn.Module):
    """vLLM's model interface over the recipe's DeepseekV4 (one process; no MTP; float or the recipe's quantized
    checkpoints, read by the recipe's loader)."""

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = ""):
        super().__init__()
        model_config = vllm_config.model_config
        self.path = Path(model_config.model)
        if vllm_config.parallel_config.world_size != 1:
            raise ValueError("the npu-cookbook DeepSeek-V4 plugin runs one process (tensor / pipeline parallel 1)")
        config = json.loads((self.path / "config.json").read_text())
        self.args = ModelArgs.from_config(config)
        self.model = DeepseekV4(self.args)
        self.block_size = vllm_config.cache_config.block_size
        self.model.cache_specs(self.block_size)  # ValueError unless the block size fits every compress ratio
        dtype = model_config.dtype
        self.slots = _slots_of(self.model, f"{prefix}." if prefix else "", self.block_size, dtype)
        self.groups = [g.name for g in self.model.cache_specs(self.block_size)]

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens(input_ids)  # [T, D]

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, intermediate_tensors=None,
                inputs_embeds: torch.Tensor | None = None, **kwargs) -> torch.Tensor:
        """input_ids, positions [T] (vLLM's flattened step) -> hidden states [T, D]."""
        if inputs_embeds is not None:
            raise ValueError("the npu-cookbook DeepSeek-V4 plugin takes token ids, not inputs_embeds")
        metadata = get_forward_context().attn_metadata
        T = input_ids.shape[0]
        if not metadata:  # a dummy step (no request, no cache): nothing to attend to
            return torch.zeros(T, self.args.hidden_size, dtype=self.model.embed.weight.dtype, device=input_ids.device)
        common_metadata = metadata[self.slots[0].prefix]
        batch = self.forward_batch(input_ids, positions, common_metadata)
        hidden = self.model(batch)  # [n, D]
        if hidden.shape[0] < T:  # vLLM padded the step: padding rows are never sampled
            hidden = torch.cat([hidden, hidden.new_zeros(T - hidden.shape[0], hidden.shape[1])])
        return hidden

    def forward_batch(self, input_ids: torch.Tensor, positions: torch.Tensor,
                      metadata: CommonAttentionMetadata) -> ForwardBatch:
        """vLLM's step (its tokens and attention metadata) as the recipe's packed ForwardBatch."""
        n, B = metadata.num_actual_tokens, metadata.num_reqs
        cu = metadata.query_start_loc[: B + 1].to(torch.int32)  # [B+1]
        seq_ids = torch.repeat_interleave(torch.arange(B, device=cu.device), cu.diff())  # [n]
        table = metadata.block_table_tensor[:B].to(torch.int32)  # [B, max_blocks]
        slots = metadata.slot_mapping[:n].long()  # [n]
        return ForwardBatch(
            input_ids=input_ids[:n].long(), positions=positions[:n].long(), seq_ids=seq_ids, cu_seqlens_q=cu,
            seq_lens=metadata.seq_lens[:B].to(torch.int32), block_size=self.block_size,
            block_tables=dict.fromkeys(self.groups, table), slot_mapping=dict.fromkeys(self.groups, slots),
            max_seqlen_q=int(metadata.max_query_len), max_seqlen_k=int(metadata.max_seq_len))

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.model.compute_logits(hidden_states)  # [N, V] fp32

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Read the checkpoint folder through the recipe's loader (publisher or transformers names, FP8 / MXFP4
        dequantized); vLLM's own iterator is left unread. Returns the names of every parameter filled."""
        ckpt = Checkpoint(self.path)
        for name, tensor in [*self.model.named_parameters(), *self.model.named_buffers()]:
            if name.endswith(PACKED):
                tensor.weight_loader = _packed_loader
        layout = any(n.startswith("model.") for n in ckpt.names())
        moe = self.model.layers[0].ffn
        experts = (moe.ep_rank, moe.ep_size, moe.experts.w13.shape[0])
        load_checkpoint(self.model, ckpt, lambda n: rename(n, layout, experts), dtype=self.model.embed.weight.dtype,
                        ignore=(MTP,))
        return {f"model.{n}" for n, _ in self.model.named_parameters()}
