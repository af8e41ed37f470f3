"""The recipe's DeepSeek-V3 family (recipes/deepseek/modeling_deepseek_v3.py: V3, V3.2, Kimi-K2; on common.ops)
as a vLLM model.

Its cache is MLA's: per layer and token one latent row [kv_lora_rank + qk_rope_head_dim] (and V3.2's indexer key
[index_head_dim]), every row kept, all read through one block table. Each tensor is a vLLM cache layer with an
MLAAttentionSpec (one latent vector per token, no separate V) of vLLM's block size; the layers differ only in
width, so vLLM keeps them in one cache group (one block table), as the recipe does. vLLM's CPU platform forces
16-token blocks for MLA models and turns chunked prefill and prefix caching off for them (no AMX).
"""
from __future__ import annotations

import torch

from common.kv_cache import CacheTensorSpec
from common.loader import Checkpoint
from vllm.v1.kv_cache_interface import MLAAttentionSpec

from .recipe_model import RecipeForCausalLM  # puts the recipe folder on sys.path

from config_deepseek_v3 import ModelArgs  # noqa: E402,I001
from modeling_deepseek_v3 import DeepseekV3  # noqa: E402
from weights_deepseek_v3 import load_into  # noqa: E402


class NpuCookbookDeepseekV3ForCausalLM(RecipeForCausalLM):
    """vLLM's model interface over the recipe's DeepseekV3 (one process; no MTP; float, FP8 or w8a8 checkpoints,
    read by the recipe's loader)."""

    family = "DeepSeek-V3"

    @classmethod
    def build_model(cls, config: dict) -> DeepseekV3:
        return DeepseekV3(ModelArgs.from_config(config))

    def cache_specs(self, tensors: list[CacheTensorSpec], block_size: int, dtype: torch.dtype):
        return {t.name: MLAAttentionSpec(block_size=block_size, num_kv_heads=1, head_size=t.width, dtype=dtype)
                for t in tensors}

    def table_of(self, tensor: CacheTensorSpec) -> str:
        return tensor.group  # the latent group: one table (the only one DeepseekV3.bind_caches accepts)

    def load_into(self) -> None:
        load_into(self.model, Checkpoint(self.path))
