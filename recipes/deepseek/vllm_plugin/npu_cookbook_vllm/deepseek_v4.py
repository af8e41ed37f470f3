"""The recipe's DeepSeek-V4 (recipes/deepseek/modeling_deepseek_v4.py, on common.ops) as a vLLM model.

Its cache tensors, as vLLM cache layers with specs for what they are (`cache.equal_page_specs`, the adapter's default):
- each layer's sliding-window KV and each compressor's per-token state: a SlidingWindowSpec with the window its
  readers look back over (the KV: sliding_window; a compressor's state: the tokens one entry pools), so vLLM frees
  their blocks behind it;
- each compressor's compressed entries (the attention's and the indexer's): a FullAttentionSpec with
  tokens_per_state = its compress ratio, one entry of head_dim per `ratio` tokens, kept for the whole sequence.
All pages hold the same bytes: a block of vLLM's block_size (256 on CPU) tokens holds 64 of the ratio-4 entries;
the window KV, the states and the other entries hold as many tokens as fill that page. vLLM groups equal specs
and gives each group its own block table; the model reads each tensor through its own group's (bind_caches'
`tables`), with the block size of its own tensor.
"""
from __future__ import annotations

from common.kv_cache import CacheTensorSpec
from common.loader import Checkpoint

from .recipe_model import RecipeForCausalLM  # puts the recipe folder on sys.path

from config_deepseek_v4 import ModelArgs  # noqa: E402,I001
from modeling_deepseek_v4 import DeepseekV4  # noqa: E402
from weights_deepseek_v4 import load_into  # noqa: E402


class NpuCookbookDeepseekV4ForCausalLM(RecipeForCausalLM):
    """vLLM's model interface over the recipe's DeepseekV4 (one process; no MTP; float or the recipe's quantized
    checkpoints, read by the recipe's loader)."""

    family = "DeepSeek-V4"

    @classmethod
    def build_model(cls, config: dict) -> DeepseekV4:
        return DeepseekV4(ModelArgs.from_config(config))

    def table_of(self, tensor: CacheTensorSpec) -> str:
        return tensor.name  # every tensor through its own vLLM group's table (tensors of one recipe group differ)

    def load_into(self) -> None:
        load_into(self.model, Checkpoint(self.path), self.contract.dtype)
