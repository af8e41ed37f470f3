"""What one HunyuanVideo generation asks for: size, length, steps, guidance, seed, step cache (checked up front)."""
from __future__ import annotations

from dataclasses import dataclass, field

from common.diffusion.step_cache import POLICIES

VAE_SPATIAL, VAE_TEMPORAL = 8, 4  # the causal VAE's downsampling: 8x in H and W, 4x in time (first frame apart)


@dataclass(frozen=True)
class SamplingConfig:
    height: int = 64
    width: int = 64
    video_length: int = 5  # frames; 4k + 1 (the causal VAE decodes k + 1 latent frames to 4k + 1)
    infer_steps: int = 4
    embedded_guidance: float = 6.0
    flow_shift: float = 7.0
    seed: int = 0
    true_cfg_scale: float = 1.0  # > 1 with a negative prompt: real CFG (two branches)
    negative_prompt: str = ""
    cache: str = "none"
    cache_options: dict = field(default_factory=dict)

    def __post_init__(self):
        if self.height % 16 or self.width % 16 or self.height < 16 or self.width < 16:
            raise ValueError(f"video size {self.height}x{self.width}: height and width must be positive multiples "
                             "of 16 (VAE 8x, patch 2x)")
        if self.video_length < 1 or (self.video_length - 1) % VAE_TEMPORAL:
            raise ValueError(f"video length {self.video_length}: must be 4k + 1 frames (1, 5, 9, ..., 129)")
        if self.infer_steps < 1:
            raise ValueError(f"infer steps {self.infer_steps}: must be >= 1")
        if self.cache not in POLICIES:
            raise ValueError(f"cache {self.cache!r}: expected one of {', '.join(POLICIES)}")
        if self.true_cfg_scale < 1:
            raise ValueError(f"true_cfg_scale {self.true_cfg_scale}: must be >= 1 (1 = off)")

    @property
    def latent_shape(self) -> tuple[int, int, int]:
        return (self.video_length - 1) // VAE_TEMPORAL + 1, self.height // VAE_SPATIAL, self.width // VAE_SPATIAL

    @property
    def true_cfg(self) -> bool:
        return self.true_cfg_scale > 1
