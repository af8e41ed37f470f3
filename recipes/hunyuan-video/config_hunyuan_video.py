"""The HunyuanVideo DiT's config, with the publisher's field names (HYVideo-T/2-cfgdistill by default)."""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path

MODEL_DIR = "hunyuan-video-t2v-720p"  # the publisher's folder under ckpts/: transformers/ (DiT) and vae/
REFINER_DEPTH = 2  # the publisher's SingleTokenRefiner depth (not a config field upstream)
REFINER_MLP_RATIO = 4.0


@dataclass(frozen=True)
class HunyuanVideoConfig:
    patch_size: tuple[int, int, int] = (1, 2, 2)  # (t, h, w)
    in_channels: int = 16
    out_channels: int = 16
    hidden_size: int = 3072
    heads_num: int = 24
    mlp_width_ratio: float = 4.0
    mlp_act_type: str = "gelu_tanh"
    mm_double_blocks_depth: int = 20
    mm_single_blocks_depth: int = 40
    rope_dim_list: tuple[int, int, int] = (16, 56, 56)  # (t, h, w), sums to the head dim
    rope_theta: float = 256.0
    qkv_bias: bool = True
    qk_norm: bool = True
    qk_norm_type: str = "rms"
    guidance_embed: bool = True
    text_projection: str = "single_refiner"
    use_attention_mask: bool = True
    text_states_dim: int = 4096
    text_states_dim_2: int = 768

    def __post_init__(self):
        object.__setattr__(self, "patch_size", tuple(int(p) for p in self.patch_size))
        object.__setattr__(self, "rope_dim_list", tuple(int(d) for d in self.rope_dim_list))
        checks = [
            (len(self.patch_size) == 3 and min(self.patch_size) >= 1, f"patch_size {self.patch_size}: 3 sizes >= 1"),
            (min(self.in_channels, self.out_channels) >= 1, "in_channels / out_channels must be >= 1"),
            (self.heads_num >= 1 and self.hidden_size % self.heads_num == 0,
             f"hidden_size {self.hidden_size} must be a multiple of heads_num {self.heads_num}"),
            (len(self.rope_dim_list) == 3 and all(d > 0 and d % 2 == 0 for d in self.rope_dim_list),
             f"rope_dim_list {self.rope_dim_list}: 3 even sizes"),
            (sum(self.rope_dim_list) == self.hidden_size // max(self.heads_num, 1),
             f"rope_dim_list {self.rope_dim_list} must sum to the head dim "
             f"{self.hidden_size // max(self.heads_num, 1)}"),
            (self.mm_double_blocks_depth >= 1, "mm_double_blocks_depth must be >= 1 (block 0 heads the step cache)"),
            (self.mm_single_blocks_depth >= 0, "mm_single_blocks_depth must be >= 0"),
            (self.mlp_width_ratio > 0, "mlp_width_ratio must be > 0"),
            (self.mlp_act_type == "gelu_tanh", f"mlp_act_type {self.mlp_act_type!r}: only 'gelu_tanh'"),
            (self.qk_norm_type == "rms", f"qk_norm_type {self.qk_norm_type!r}: only 'rms'"),
            (self.text_projection == "single_refiner",
             f"text_projection {self.text_projection!r}: only 'single_refiner'"),
            (self.use_attention_mask, "use_attention_mask false is not supported"),
            (min(self.text_states_dim, self.text_states_dim_2) >= 1, "text_states_dim(_2) must be >= 1"),
            (self.rope_theta > 0, "rope_theta must be > 0"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(f"HunyuanVideoConfig: {message}")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.heads_num

    @property
    def mlp_hidden_dim(self) -> int:
        return int(self.hidden_size * self.mlp_width_ratio)

    @classmethod
    def from_dict(cls, data: dict) -> HunyuanVideoConfig:
        """The known fields of a config.json object; other keys (e.g. the publisher's model name) are ignored."""
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in names})

    @classmethod
    def from_json(cls, path) -> HunyuanVideoConfig:
        return cls.from_dict(json.loads(Path(path).read_text()))

    def to_dict(self) -> dict:
        return {k: list(v) if isinstance(v, tuple) else v for k, v in dataclasses.asdict(self).items()}
