"""vLLM general plugin: registers the recipes' DeepSeek and Ling models under architecture names of their own.

vLLM calls `register()` once in every process it starts (API server, engine core, workers). The names are ours, so
vLLM's own `DeepseekV4ForCausalLM` / `DeepseekV3ForCausalLM` / `BailingMoeV3ForCausalLM` (and vllm-ascend's overrides
of them) stay untouched: a checkpoint runs on the recipe's model only when the user selects it, with
`--hf-overrides '{"architectures": ["NpuCookbookDeepseekV4ForCausalLM"]}'` or an `architectures` entry in its
config.json.
"""
ARCHITECTURES = {
    "NpuCookbookDeepseekV4ForCausalLM": "npu_cookbook_vllm.deepseek_v4:NpuCookbookDeepseekV4ForCausalLM",
    "NpuCookbookDeepseekV3ForCausalLM": "npu_cookbook_vllm.deepseek_v3:NpuCookbookDeepseekV3ForCausalLM",
    "NpuCookbookLingForCausalLM": "npu_cookbook_vllm.ling:NpuCookbookLingForCausalLM",
}


def register() -> None:
    """Register the models lazily (by module path: nothing heavy is imported here), and the transformers configs
    of their model types where transformers has none (hf_configs). Idempotent."""
    from vllm import ModelRegistry

    from .hf_configs import register_configs

    register_configs()

    for arch, target in ARCHITECTURES.items():
        if arch not in ModelRegistry.get_supported_archs():
            ModelRegistry.register_model(arch, target)
