"""The recipe's cache tensors as vLLM cache layers: each one is a `CacheSlot` (an AttentionLayerBase with a
KVCacheSpec of its own), so vLLM's block manager owns it; the backend computes nothing (the recipe's ops read
the cache) and passes vLLM's CommonAttentionMetadata (block table, slot mapping, lengths) through.

vLLM's hybrid allocator hands every cache group blocks of one physical page size (kv_cache_utils'
`get_kv_cache_groups`), and the recipe's ops read each cache tensor as a contiguous [blocks, rows, 1, width]
tensor, i.e. a layer-outer layout (LBNHC; block-outer packing would interleave layers within a block). So every
slot's page holds the same bytes: a tensor with fewer bytes per token holds more tokens per block
(`equal_page_specs`), as vLLM's own DeepSeek-V4 picks its block sizes.
"""
from __future__ import annotations

from collections.abc import Callable
from fractions import Fraction
from typing import ClassVar

import torch
from torch import nn

from common.kv_cache import CacheTensorSpec
from vllm.config import VllmConfig, get_current_vllm_config
from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase
from vllm.v1.attention.backend import (AttentionBackend, AttentionCGSupport, AttentionMetadataBuilder,
                                       CommonAttentionMetadata)
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheSpec, SlidingWindowSpec
from vllm.v1.kv_cache_layout import KVCacheLayout


class RecipeCacheBackend(AttentionBackend):
    """The backend of the recipe's cache slots: no kernel of its own; its metadata is vLLM's
    CommonAttentionMetadata, passed through."""

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

    @classmethod
    def supported_kv_cache_layouts(cls) -> tuple[KVCacheLayout, ...]:
        return (KVCacheLayout.LBNHC, KVCacheLayout.LBHNC)  # layer-outer: each layer's cache one contiguous tensor


class RecipeCacheMetadataBuilder(AttentionMetadataBuilder[CommonAttentionMetadata]):
    _cudagraph_support: ClassVar[AttentionCGSupport] = AttentionCGSupport.NEVER

    def __init__(self, kv_cache_spec, layer_names, vllm_config, device):  # abstract in AttentionMetadataBuilder
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)

    def build(self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata,
              fast_build: bool = False) -> CommonAttentionMetadata:
        return common_attn_metadata


class CacheSlot(nn.Module, AttentionLayerBase):
    """One recipe cache tensor (`tensor`, a CacheTensorSpec) as a vLLM cache layer named `prefix`, declared to
    vLLM as `spec`. bind_kv_cache keeps vLLM's view as `cache`, the recipe's [num_blocks, rows a block, 1, width],
    and calls `on_bind`."""

    def __init__(self, prefix: str, tensor: CacheTensorSpec, spec: KVCacheSpec, on_bind: Callable[[], None]):
        super().__init__()
        self.prefix, self.tensor, self.spec, self.on_bind = prefix, tensor, spec, on_bind
        self.kv_cache = self.cache = None
        context = get_current_vllm_config().compilation_config.static_forward_context
        if prefix in context:
            raise ValueError(f"duplicate cache layer name {prefix!r}")
        context[prefix] = self

    def get_kv_cache_spec(self, vllm_config: VllmConfig) -> KVCacheSpec:
        return self.spec

    def bind_kv_cache(self, kv_cache: torch.Tensor) -> None:
        if not kv_cache.is_contiguous():
            raise ValueError(f"{self.prefix}: vLLM's cache view is not contiguous (a block-outer KV cache layout?); "
                             "the recipe's caches need a layer-outer one (VLLM_KV_CACHE_LAYOUT=LBNHC)")
        self.kv_cache = kv_cache  # [num_blocks, 1, rows a block, width]
        self.cache = kv_cache.view(kv_cache.shape[0], -1, 1, self.tensor.width)
        self.on_bind()

    def get_attn_backend(self) -> type[AttentionBackend]:
        return RecipeCacheBackend


def equal_page_specs(tensors: list[CacheTensorSpec], block_size: int, dtype: torch.dtype) -> dict[str, KVCacheSpec]:
    """A vLLM spec per cache tensor, all with one page size: `block_size` tokens of the tensor with the most bytes
    per token among those kept for every token (the compressed entries: a 256-token block holds 64 of DeepSeek-V4's
    ratio-4 entries, as in vLLM's own DeepSeek-V4); every other tensor holds as many tokens as fill that page.
    Sliding-window tensors get a SlidingWindowSpec (vLLM frees their blocks behind the window), the others a
    FullAttentionSpec with tokens_per_state = their compress ratio. ValueError where a page does not hold whole
    rows of a tensor."""
    per_token = {t.name: Fraction(t.width * dtype.itemsize, t.tokens_per_row) for t in tensors}
    full = [t for t in tensors if t.window is None] or tensors
    page = block_size * max(per_token[t.name] for t in full)
    specs = {}
    for t in tensors:
        tokens = page / per_token[t.name]
        if page.denominator != 1 or tokens.denominator != 1 or tokens % t.tokens_per_row:
            raise ValueError(f"{t.name}: a page of {float(page)} bytes (block_size {block_size}) does not hold whole "
                             f"rows of {t.width} x {dtype}, one per {t.tokens_per_row} tokens: pick another block size")
        common = dict(block_size=int(tokens), num_kv_heads=1, head_size=t.width, head_size_v=0, dtype=dtype,
                      tokens_per_state=t.tokens_per_row)
        specs[t.name] = (FullAttentionSpec(**common) if t.window is None
                         else SlidingWindowSpec(**common, sliding_window=t.window))
    return specs
