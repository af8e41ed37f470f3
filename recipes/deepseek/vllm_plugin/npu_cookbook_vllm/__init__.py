"""vLLM general plugin: registers the recipe's DeepSeek-V4 under its own architecture name.

vLLM calls `register()` once in every process it starts (API server, engine core, workers). The name is ours, so
vLLM's own `DeepseekV4ForCausalLM` (and vllm-ascend's override of it) stays untouched: a checkpoint runs on this
model only when the user selects it, with `--hf-overrides '{"architectures": ["NpuCookbookDeepseekV4ForCausalLM"]}'`
or an `architectures` entry in its config.json.
"""
ARCHITECTURE = "NpuCookbookDeepseekV4ForCausalLM"


def register() -> None:
    """Register the model lazily (by module path: nothing heavy is imported here). Idempotent."""
    from vllm import ModelRegistry

    if ARCHITECTURE not in ModelRegistry.get_supported_archs():
        ModelRegistry.register_model(ARCHITECTURE, "npu_cookbook_vllm.model:NpuCookbookDeepseekV4ForCausalLM")
