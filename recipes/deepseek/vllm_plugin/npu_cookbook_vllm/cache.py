"""The recipe's cache tensors as vLLM cache layers: each paged tensor is a `CacheSlot` (an AttentionLayerBase with
a KVCacheSpec of its own), the tensors of a state group ("state" kind: a slot per request) a few `StateSlot`s
(vLLM's MambaBase: a MambaSpec page holding several state tensors), so vLLM's block manager owns them; the backends
compute nothing (the recipe's ops read the caches) and pass vLLM's CommonAttentionMetadata (block table, slot
mapping, lengths) through.

vLLM's hybrid allocator hands every cache group blocks of one physical page size (kv_cache_utils'
`get_kv_cache_groups`), and the recipe's ops read each cache tensor as a contiguous [blocks, rows, 1, width]
tensor, i.e. a layer-outer layout (LBNHC; block-outer packing would interleave layers within a block). So every
slot's page holds the same bytes: a tensor with fewer bytes per token holds more tokens per block
(`equal_page_specs`), as vLLM's own DeepSeek-V4 picks its block sizes.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable
from fractions import Fraction
from typing import ClassVar

import torch
from torch import nn

from common.kv_cache import CacheTensorSpec
from vllm.config import VllmConfig, get_current_vllm_config
from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase
from vllm.model_executor.layers.mamba.abstract import MambaBase
from vllm.v1.attention.backend import (AttentionBackend, AttentionCGSupport, AttentionMetadataBuilder,
                                       CommonAttentionMetadata)
from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheSpec, MambaSpec, SlidingWindowSpec
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


class RecipeStateBackend(RecipeCacheBackend):
    """The backend of the recipe's state slots: a state-space ("SSM") backend to vLLM, so its layers take no part
    in the attention block-size choice; metadata passed through like RecipeCacheBackend's."""

    @staticmethod
    def get_name() -> str:
        return "NPU_COOKBOOK_RECIPE_STATE"

    @classmethod
    def is_ssm(cls) -> bool:
        return True


class RecipeCacheMetadataBuilder(AttentionMetadataBuilder[CommonAttentionMetadata]):
    _cudagraph_support: ClassVar[AttentionCGSupport] = AttentionCGSupport.NEVER

    def __init__(self, kv_cache_spec, layer_names, vllm_config, device):  # abstract in AttentionMetadataBuilder
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)

    def build(self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata,
              fast_build: bool = False) -> CommonAttentionMetadata:
        return common_attn_metadata


def _register_layer(prefix: str, layer: nn.Module) -> None:
    context = get_current_vllm_config().compilation_config.static_forward_context
    if prefix in context:
        raise ValueError(f"duplicate cache layer name {prefix!r}")
    context[prefix] = layer


class CacheSlot(nn.Module, AttentionLayerBase):
    """One recipe cache tensor (`tensor`, a CacheTensorSpec) as a vLLM cache layer named `prefix`, declared to
    vLLM as `spec` (a KVCacheSpec, or a function of the final VllmConfig giving one: a hybrid model's block size is
    set only after the model is built). bind_kv_cache keeps vLLM's view as `cache`, the recipe's [num_blocks, rows
    a block, 1, width], and calls `on_bind`."""

    def __init__(self, prefix: str, tensor: CacheTensorSpec,
                 spec: KVCacheSpec | Callable[[VllmConfig], KVCacheSpec], on_bind: Callable[[], None]):
        super().__init__()
        self.prefix, self.tensor, self.spec, self.on_bind = prefix, tensor, spec, on_bind
        self.kv_cache = self.cache = None
        _register_layer(prefix, self)

    def get_kv_cache_spec(self, vllm_config: VllmConfig) -> KVCacheSpec:
        return self.spec(vllm_config) if callable(self.spec) else self.spec

    def bind_kv_cache(self, kv_cache: torch.Tensor) -> None:
        if not kv_cache.is_contiguous():
            raise ValueError(f"{self.prefix}: vLLM's cache view is not contiguous (a block-outer KV cache layout?); "
                             "the recipe's caches need a layer-outer one (VLLM_KV_CACHE_LAYOUT=LBNHC)")
        self.kv_cache = kv_cache  # [num_blocks, 1, rows a block, width]
        self.cache = kv_cache.view(kv_cache.shape[0], -1, 1, self.tensor.width)
        self.on_bind()

    def get_attn_backend(self) -> type[AttentionBackend]:
        return RecipeCacheBackend


class StateSlot(nn.Module, MambaBase):
    """Some state tensors of one recipe state group (`tensors`, CacheTensorSpecs with `rows`) as one vLLM mamba-type
    cache layer named `prefix`: vLLM's MambaSpec (MambaBase.get_kv_cache_spec: vLLM's state block size and cache
    mode), its states these tensors [rows, 1, width] in their dtypes (`dtype`: the model's, for those without their
    own), one after another in a page of `page_size(vllm_config)` bytes (the paged tensors' page, so that vLLM's
    hybrid allocator puts both kinds in one block pool). vLLM gives the layer one page per block of its group's
    block table; bind_kv_cache (MambaBase's) cuts each page into the tensors, `caches` by name, each the recipe's
    [num_blocks, rows, 1, width] (a slot = a vLLM block), and calls `on_bind`."""

    def __init__(self, prefix: str, tensors: list[CacheTensorSpec], dtype: torch.dtype,
                 page_size: Callable[[VllmConfig], int | None], on_bind: Callable[[], None]):
        super().__init__()
        if len({t.group for t in tensors}) != 1 or any(t.rows is None for t in tensors):
            raise ValueError(f"{prefix}: a state slot holds state tensors (rows set) of one cache group")
        self.prefix, self.tensors, self.dtype, self.page_size, self.on_bind = prefix, tensors, dtype, page_size, \
            on_bind
        self.group = tensors[0].group
        self.kv_cache, self.caches, self.spec = (), None, None
        _register_layer(prefix, self)

    @property
    def mamba_type(self) -> MambaAttentionBackendEnum:
        return MambaAttentionBackendEnum.LINEAR  # a tag (the copy functions' key): the backend is ours

    def get_state_shape(self) -> tuple[tuple[int, ...], ...]:
        return tuple((t.rows, 1, t.width) for t in self.tensors)

    def get_state_dtype(self) -> tuple[torch.dtype, ...]:
        return tuple(t.dtype or self.dtype for t in self.tensors)

    def get_kv_cache_spec(self, vllm_config: VllmConfig) -> MambaSpec:
        spec = super().get_kv_cache_spec(vllm_config)
        page = self.page_size(vllm_config)
        if page is not None:
            if page < spec.state_content_size_bytes:
                raise ValueError(f"{self.prefix}: its states take {spec.state_content_size_bytes} bytes, more than the "
                                 f"{page}-byte page of the paged caches at block_size "
                                 f"{vllm_config.cache_config.block_size}: pick a larger --block-size")
            spec = dataclasses.replace(spec, page_size_padded=page)
        self.spec = spec
        return spec

    def bind_kv_cache(self, kv_cache: torch.Tensor) -> None:
        super().bind_kv_cache(kv_cache)  # self.kv_cache: the states [num_blocks, rows, 1, width], page-strided
        self.caches = {t.name: state for t, state in zip(self.tensors, self.kv_cache)}
        self.on_bind()

    def get_attn_backend(self) -> type[AttentionBackend]:
        return RecipeStateBackend


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
