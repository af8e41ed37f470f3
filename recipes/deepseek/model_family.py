"""Which model a checkpoint is, and the modules that serve it: DeepSeek-V4 (modeling_deepseek_v4) or the MLA family
(DeepSeek-V3 / R1, V3.2, Kimi-K2: modeling_deepseek_v3), chosen by config.json's model_type, or by `--model` /
a preset's `model:` for the tiny checkpoints. Each family brings its own config, layout check, loader, memory
check, tiny writer and chat format (V4: the publisher's encoding; the MLA family: the tokenizer's template); the command lines and the server only go through this table."""
from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from transformers import AutoTokenizer, PreTrainedTokenizerFast

import config_deepseek_v3
import config_deepseek_v4
import modeling_deepseek_v3
import modeling_deepseek_v4
import tiny_deepseek_v3
import tiny_deepseek_v4
import weights_deepseek_v3
import weights_deepseek_v4
from chat_format_deepseek_v4 import DeepseekV4ChatFormat

WEIGHTS = Path(__file__).resolve().parents[2] / "weights"


@dataclass(frozen=True)
class ModelFamily:
    name: str  # --model / a preset's `model:`
    model_types: tuple[str, ...]  # config.json's model_type values it serves
    model_args: Callable  # ModelArgs.from_config
    check_layout: Callable  # (args, layout): ValueError for a layout the model cannot split into
    load_model: Callable  # (path, dtype, device, parallel=, mtp=, ...)
    check_fits: Callable  # (args, dtype, device, mtp, ...): ValueError with the arithmetic
    write_tiny: Callable  # (path): the tiny random checkpoint
    tiny_is_current: Callable  # (path): written by this revision of the writer
    chat_format: Callable | None = None  # () -> the server's ChatFormat; None: the tokenizer's chat template
    check_offload: Callable | None = None  # (args, layout, resident_experts): ValueError; None: no MoE offload
    tiny_kwargs: dict = field(default_factory=dict)

    @property
    def supports_offload(self) -> bool:
        return self.check_offload is not None

    @property
    def tiny(self) -> Path:
        return WEIGHTS / f"{self.name}-tiny"

    def ensure_tiny(self) -> Path:
        """The tiny checkpoint, written (again) when missing or written by an older revision."""
        if not self.tiny_is_current(self.tiny):
            self.write_tiny(self.tiny, **self.tiny_kwargs)
        return self.tiny


V4 = ModelFamily("deepseek-v4", ("deepseek_v4",), config_deepseek_v4.ModelArgs.from_config,
                 modeling_deepseek_v4.check_layout, weights_deepseek_v4.load_model, weights_deepseek_v4.check_fits,
                 tiny_deepseek_v4.write_tiny_checkpoint, tiny_deepseek_v4.is_current,
                 chat_format=DeepseekV4ChatFormat, check_offload=modeling_deepseek_v4.check_offload)
V3_FAMILY = [ModelFamily(name, types, config_deepseek_v3.ModelArgs.from_config, modeling_deepseek_v3.check_layout,
                         weights_deepseek_v3.load_model, weights_deepseek_v3.check_fits,
                         tiny_deepseek_v3.write_tiny_checkpoint, tiny_deepseek_v3.is_current,
                         tiny_kwargs={"variant": variant})
             for name, types, variant in (("deepseek-v3", ("deepseek_v3",), "v3"),
                                          ("deepseek-v32", ("deepseek_v32",), "v32"),
                                          ("kimi-k2", ("kimi_k2",), "kimi"))]
FAMILIES = {f.name: f for f in [V4, *V3_FAMILY]}
DEFAULT_FAMILY = V4.name  # what runs without --weights, --model or a preset's `model:`


def family_of_config(config: dict) -> ModelFamily:
    """The family of a checkpoint's config.json; ValueError for a model_type the recipe does not serve."""
    model_type = config.get("model_type")
    for family in FAMILIES.values():
        if model_type in family.model_types:
            return family
    served = sorted(t for f in FAMILIES.values() for t in f.model_types)
    raise ValueError(f"config.json model_type {model_type!r} is not served by this recipe (it serves {served})")


def load_tokenizer(path):
    """The checkpoint's tokenizer: a plain tokenizer.json as such (AutoTokenizer would first want a config class
    for the model type, which transformers lacks for kimi_k2), else AutoTokenizer (Kimi-K2's own TikToken code is
    not run: transformers names the flag it would need)."""
    config = Path(path) / "tokenizer_config.json"
    cls = json.loads(config.read_text()).get("tokenizer_class") if config.exists() else None
    if cls == "PreTrainedTokenizerFast":
        return PreTrainedTokenizerFast.from_pretrained(path)
    return AutoTokenizer.from_pretrained(path)
