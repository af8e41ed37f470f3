"""The recipe's Ling-3.0-Flash (recipes/ling/modeling_ling.py, on common.ops) as a vLLM hybrid model.

Its two cache groups, declared to vLLM through vLLM's own interfaces:
- "mla", the MLA layers' latent rows (paged, a row per token): a CacheSlot per layer with an MLAAttentionSpec of
  vLLM's block size, all in one vLLM group (one block table), as the V3 family's;
- "kda", the KDA layers' conv history and recurrent state (a slot per request): StateSlots, vLLM mamba-type
  layers (MambaBase, MambaSpec), each packing the states of several KDA layers into one page, padded to the latent
  page; as many as there are MLA layers, so vLLM's hybrid allocator makes them one group too (state_packs).
vLLM's scheduler and block manager run the states as they run its own hybrid models': one slot per request without
prefix caching; with it ("align" mode, vLLM's default for hybrid models), a state block per `block_size` tokens,
prefill chunks cut at block boundaries, and the state copied into the request's current block before each step
(the copy functions of recipe_model). The plugin hands the model each request's (read, write) slot, the read slot 0
(a zero state) in its first step (RecipeForCausalLM.forward_batch).

vLLM's block size here: the smallest multiple of 128 tokens whose latent page holds one state page; with prefix
caching, hits land on multiples of it.
"""
from __future__ import annotations

from typing import ClassVar, Literal

import torch

from common.kv_cache import CacheTensorSpec
from common.loader import Checkpoint
from vllm.v1.kv_cache_interface import MLAAttentionSpec

from .recipe_model import RecipeForCausalLM, use_recipe

use_recipe("ling")

from config_ling import ModelArgs  # noqa: E402,I001
from modeling_ling import LingForCausalLM  # noqa: E402
from weights_ling import load_into  # noqa: E402


class NpuCookbookLingForCausalLM(RecipeForCausalLM):
    """vLLM's model interface over the recipe's LingForCausalLM (one process; no MTP; the recipe's loader)."""

    family = "Ling"
    is_hybrid: ClassVar[Literal[True]] = True  # vLLM's IsHybrid / HasInnerState: attention and state layers
    has_inner_state: ClassVar[Literal[True]] = True
    supports_mamba_prefix_caching: ClassVar[Literal[True]] = True

    @classmethod
    def build_model(cls, config: dict) -> LingForCausalLM:
        return LingForCausalLM(ModelArgs.from_config(config))

    def cache_specs(self, tensors: list[CacheTensorSpec], block_size: int, dtype: torch.dtype):
        return {t.name: MLAAttentionSpec(block_size=block_size, num_kv_heads=1, head_size=t.width, dtype=dtype)
                for t in tensors}

    def load_into(self) -> None:
        load_into(self.model, Checkpoint(self.path))
