"""HunyuanVideo text-to-video: text encoders -> flow-matching denoising loop over the DiT -> VAE decode.

The loop is diffusers' HunyuanVideoPipeline step for step (same noise for the same seed, same scheduler calls), so
the two give the same video for the same weights; what this one adds is the NPU-side machinery: sequence parallel
(the DiT shards video tokens over the sp group; Ulysses, ring, or Ulysses x ring), CFG parallel (cond / uncond on the two ranks of the cfg group,
when true CFG is on), step caches (TeaCache / FBCache / TaylorSeer), and tiled / patch-parallel VAE decode.

Scheduler: diffusers' FlowMatchEulerDiscreteScheduler with shift 7 (flow_shift), driven by sigmas
linspace(1, 0, steps + 1)[:-1] as diffusers' pipeline does; the model is guidance-distilled, so the guidance scale
(6.0) enters the DiT as an embedding (x1000), not as a second forward.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from diffusers import FlowMatchEulerDiscreteScheduler
from tqdm.auto import tqdm

from common.diffusion.cfg_parallel import guided_prediction
from common.diffusion.sequence_parallel import UlyssesRing, ulysses_ring_groups
from common.diffusion.step_cache import StepCache
from common.parallel import Parallel
from config_hunyuan_video import MODEL_DIR
from sampling_hunyuan_video import SamplingConfig
from text_encoder_hunyuan_video import HunyuanVideoTextEncoders, TextEncoderConfig
from vae_hunyuan_video import load_vae
from weights_hunyuan_video import load_transformer



def sp_mode(parallel: Parallel | None, ulysses_degree: int, ring_degree: int) -> str | UlyssesRing:
    """How the DiT splits attention over the sp group: "ulysses", "ring", or both (sub-groups; collective)."""
    sp = 1 if parallel is None else parallel.size("sp")
    if ulysses_degree * ring_degree != sp:
        raise ValueError(f"ulysses degree {ulysses_degree} x ring degree {ring_degree} != sp size {sp}")
    if ring_degree == 1:
        return "ulysses"
    if ulysses_degree == 1:
        return "ring"
    return ulysses_ring_groups(parallel.layout.group_ranks("sp"), ulysses_degree, parallel.rank)


@dataclass
class PipelineOutput:
    video: torch.Tensor  # [3, T, H, W] in [-1, 1]
    latents: torch.Tensor  # [1, C, t, h, w], the denoised latents
    timings: dict[str, float]  # seconds per stage
    computed_steps: list[bool]  # the step cache's decisions (True = the DiT ran)


class HunyuanVideoPipeline:
    def __init__(self, text_encoders: HunyuanVideoTextEncoders, transformer, vae, vae_scaling_factor: float,
                 parallel: Parallel | None = None, ulysses_degree: int = 1, ring_degree: int = 1,
                 vae_tiling: bool = False):
        self.text_encoders, self.transformer, self.vae = text_encoders, transformer.eval(), vae.eval()
        self.vae_scaling_factor, self.parallel, self.vae_tiling = vae_scaling_factor, parallel, vae_tiling
        self.sp_mode = sp_mode(parallel, ulysses_degree, ring_degree)

    @classmethod
    def from_pretrained(cls, root: str | Path, dtype: torch.dtype = torch.bfloat16, device: str = "cpu",
                        parallel: Parallel | None = None, vae_dtype: torch.dtype = torch.float32,
                        text_config: TextEncoderConfig = TextEncoderConfig(), ulysses_degree: int = 1,
                        ring_degree: int = 1, vae_tiling: bool = False):
        root = Path(root)
        transformer = load_transformer(root / MODEL_DIR / "transformers", dtype, device)
        vae = load_vae(root / MODEL_DIR / "vae", vae_dtype, device)
        text = HunyuanVideoTextEncoders.from_pretrained(root, dtype, device, text_config)
        return cls(text, transformer, vae, vae.config.scaling_factor, parallel, ulysses_degree, ring_degree,
                   vae_tiling)

    def _group(self, name: str):
        return None if self.parallel is None else self.parallel.group(name)

    @property
    def device(self) -> torch.device:
        return next(self.transformer.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        return next(self.transformer.parameters()).dtype

    def prepare_latents(self, cfg: SamplingConfig) -> torch.Tensor:
        """Noise [1, C, t, h, w] from the seed, float32, drawn on the CPU (the same on every rank and device)."""
        generator = torch.Generator("cpu").manual_seed(cfg.seed)
        shape = (1, self.transformer.config.in_channels, *cfg.latent_shape)
        return torch.randn(shape, generator=generator, dtype=torch.float32).to(self.device)

    def make_scheduler(self, cfg: SamplingConfig) -> FlowMatchEulerDiscreteScheduler:
        scheduler = FlowMatchEulerDiscreteScheduler(shift=cfg.flow_shift)
        scheduler.set_timesteps(sigmas=np.linspace(1.0, 0.0, cfg.infer_steps + 1)[:-1], device=self.device)
        scheduler.set_begin_index(0)
        return scheduler

    @torch.no_grad()
    def denoise(self, text: dict, negative: dict | None, cfg: SamplingConfig, latents: torch.Tensor,
                progress: bool = True) -> tuple[torch.Tensor, list[bool]]:
        """The flow-matching loop; text / negative: encoder_hidden_states, encoder_attention_mask,
        pooled_projections for the cond / uncond branch. Returns (latents, step cache decisions)."""
        scheduler = self.make_scheduler(cfg)
        sp_group = self._group("sp")
        cache = StepCache.from_config(cfg.cache, cfg.infer_steps, group=sp_group, **cfg.cache_options)
        guidance = torch.full((1,), cfg.embedded_guidance * 1000.0, device=self.device, dtype=self.dtype)
        show = progress and (self.parallel is None or self.parallel.rank == 0)
        for i, t in enumerate(tqdm(scheduler.timesteps, desc="denoise", disable=not show)):
            shared = {"hidden_states": latents.to(self.dtype), "timestep": t.expand(1).to(latents.dtype),
                      "guidance": guidance}
            options = {"step": i, "step_cache": cache, "sp_group": sp_group, "sp_mode": self.sp_mode}
            if negative is None:
                noise_pred = self.transformer(**text, **shared, **options)
            else:
                noise_pred = guided_prediction(self.transformer, text, negative, cfg.true_cfg_scale,
                                               group=self._group("cfg"), shared=shared, **options)
            latents = scheduler.step(noise_pred, t, latents, return_dict=False)[0]
        return latents, cache.computed

    @torch.no_grad()
    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """[1, C, t, h, w] latents -> [3, T, H, W] pixels in [-1, 1]."""
        z = latents.to(next(self.vae.parameters()).dtype) / self.vae_scaling_factor
        if self.vae_tiling:
            return self.vae.tiled_decode(z, group=self._group("sp"))[0]
        return self.vae.decode(z)[0]

    @torch.no_grad()
    def encode_prompt(self, prompt: str) -> dict:
        states, mask, pooled = self.text_encoders.encode([prompt])
        return {"encoder_hidden_states": states.to(self.dtype), "encoder_attention_mask": mask,
                "pooled_projections": pooled.to(self.dtype)}

    def __call__(self, prompt: str, cfg: SamplingConfig = SamplingConfig(), latents: torch.Tensor | None = None,
                 progress: bool = True) -> PipelineOutput:
        timings = {}
        start = time.perf_counter()
        text = self.encode_prompt(prompt)
        negative = self.encode_prompt(cfg.negative_prompt) if cfg.true_cfg else None
        timings["text_encoders"] = time.perf_counter() - start

        start = time.perf_counter()
        latents = self.prepare_latents(cfg) if latents is None else latents
        latents, computed = self.denoise(text, negative, cfg, latents, progress)
        timings["denoise"] = time.perf_counter() - start

        start = time.perf_counter()
        video = self.decode(latents)
        timings["vae_decode"] = time.perf_counter() - start
        return PipelineOutput(video.float().clamp(-1, 1), latents, timings, computed)
