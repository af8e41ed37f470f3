"""vLLM general plugin: registers the recipes' DeepSeek and Ling models under architecture names of their own.

vLLM calls `register()` once in every process it starts (API server, engine core, workers). The names are ours, so
vLLM's own `DeepseekV4ForCausalLM` / `DeepseekV3ForCausalLM` / `BailingMoeV3ForCausalLM` (and vllm-ascend's overrides
of them) stay untouched: a checkpoint runs on the recipe's model only when the user selects it, with
`--hf-overrides '{"architectures": ["NpuCookbookDeepseekV4ForCausalLM"]}'` or an `architectures` entry in its
config.json.

It is also a vLLM platform plugin (`cpu_platform_plugin`): on an AVX-512 CPU whose torch is capped to AVX2, vLLM's
CPU platform with vLLM's AVX2 kernel build (cpu_platform.py); inactive anywhere else.
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


def cpu_platform_plugin() -> str | None:
    """vLLM's platform plugin hook: cpu_platform.Avx2CpuPlatform where torch runs below AVX-512 (ATEN_CPU_CAPABILITY
    avx2 or default) on an x86 CPU that has AVX-512, else None (vLLM's own platform: on an AVX2-only CPU it picks
    the AVX2 build itself)."""
    import torch

    capped = torch.backends.cpu.get_cpu_capability() in ("AVX2", "DEFAULT")
    if capped and torch.cpu._is_avx512_supported() and not torch.cuda.is_available():
        return "npu_cookbook_vllm.cpu_platform.Avx2CpuPlatform"
    return None
