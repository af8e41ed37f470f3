"""HunyuanImage-3.0 configuration: the publisher's config.json fields the recipe reads, with their invariants."""
from __future__ import annotations

from dataclasses import dataclass, field

# The special tokens of the text-to-image sequence by role, as the publisher's HunyuanImage3TokenizerFast names
# them (its ids: bos 127958, eos 127957, <boi> 128000, <eoi> 128001, <img> 128006, <cfg> 128010, <timestep> 128017,
# <img_size_1024> 128037, <img_ratio_0..32> 128044-128076).
SPECIAL_TOKENS = {
    "bos": "<|startoftext|>", "eos": "<|endoftext|>", "boi": "<boi>", "eoi": "<eoi>", "img": "<img>",
    "cfg": "<cfg>", "timestep": "<timestep>", "size": "<img_size_1024>",
    **{f"ratio_{k}": f"<img_ratio_{k}>" for k in range(33)},
}


@dataclass(slots=True)
class VAEConfig:
    """AutoencoderKLConv3D (`vae` in config.json)."""

    in_channels: int = 3
    out_channels: int = 3
    latent_channels: int = 32
    block_out_channels: tuple[int, ...] = (128, 256, 512, 1024, 1024)
    layers_per_block: int = 2
    ffactor_spatial: int = 16
    ffactor_temporal: int = 4
    scaling_factor: float = 0.562679178327931

    def __post_init__(self):
        self.block_out_channels = tuple(self.block_out_channels)
        levels = self.ffactor_spatial.bit_length() - 1
        assert 2**levels == self.ffactor_spatial and len(self.block_out_channels) > levels, \
            f"ffactor_spatial {self.ffactor_spatial}: needs a power of two below 2**{len(self.block_out_channels)}"
        assert self.block_out_channels[-1] % (2 * self.latent_channels) == 0, "encoder shortcut groups channels"
        assert all(c % 32 == 0 for c in self.block_out_channels), "GroupNorm(32) needs multiples of 32"


@dataclass(slots=True)
class HunyuanImageConfig:
    vocab_size: int = 133120
    hidden_size: int = 4096
    num_hidden_layers: int = 32
    num_attention_heads: int = 32
    num_key_value_heads: int = 8
    head_dim: int = 128
    moe_intermediate_size: int = 3072
    intermediate_size: int = 3072  # the shared MLP
    num_experts: int = 64
    moe_topk: int = 8
    num_shared_expert: int = 1
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    patch_size: int = 1
    patch_embed_hidden_dim: int = 1024
    vae_downsample_factor: tuple[int, int] = (16, 16)
    image_base_size: int = 1024
    vae: VAEConfig = field(default_factory=VAEConfig)
    special_token_ids: dict[str, int] = field(default_factory=dict)  # role -> id, filled from the tokenizer

    def __post_init__(self):
        assert self.num_attention_heads % self.num_key_value_heads == 0, "GQA: q heads per kv group must be whole"
        assert self.head_dim % 4 == 0, f"head_dim {self.head_dim}: 2D RoPE splits it in four"
        assert 2 <= self.moe_topk <= self.num_experts, "top-k >= 2 (the renormalised path) and <= num_experts"
        assert self.num_shared_expert == 1, "one shared MLP"
        assert self.patch_size == 1, "patch_size 1 (UNetDown / UNetUp without resampling)"
        assert self.patch_embed_hidden_dim % 32 == 0, "GroupNorm(32) in patch_embed / final_layer"
        self.vae_downsample_factor = tuple(self.vae_downsample_factor)

    @property
    def num_groups(self) -> int:
        """Query heads per kv group (G)."""
        return self.num_attention_heads // self.num_key_value_heads

    @classmethod
    def from_config(cls, config: dict) -> "HunyuanImageConfig":
        """From a config.json dict (unknown keys ignored; list-valued per-layer fields take their first value)."""
        kwargs = {}
        for name in cls.__dataclass_fields__:
            if name in config and name not in ("vae", "special_token_ids"):
                value = config[name]
                kwargs[name] = value[0] if isinstance(value, list) and name in ("moe_topk", "num_experts",
                                                                                "moe_intermediate_size") else value
        if "head_dim" not in config and "attention_head_dim" in config:  # the publisher's name for it
            kwargs["head_dim"] = config["attention_head_dim"]
        if "num_shared_expert" in kwargs and isinstance(kwargs["num_shared_expert"], list):
            kwargs["num_shared_expert"] = kwargs["num_shared_expert"][0]
        vae = config.get("vae") or {}
        kwargs["vae"] = VAEConfig(**{k: v for k, v in vae.items() if k in VAEConfig.__dataclass_fields__})
        return cls(**kwargs)
