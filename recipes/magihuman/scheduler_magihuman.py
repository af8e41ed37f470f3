"""MagiHuman sampling: the publisher's flow UniPC (diffusers, with its sigma list), the distilled DDIM-style step,
the time-dependent CFG scales and the SR re-noise.

UniPC: order 2, bh2, predict x0, lower order final, final sigma 0; sigma_i = shift(linspace(0.999, 0, N+1)[:-1]),
shift(s) = 5 s / (1 + 4 s), timesteps int64(1000 sigma). diffusers' UniPCMultistepScheduler reproduces it only
when set_timesteps receives those unshifted sigmas (its own default list is off by up to 4e-3).
"""
from __future__ import annotations

import math

import numpy as np
import torch
from diffusers import UniPCMultistepScheduler

FLOW_SHIFT = 5.0
SR_RENOISE_ALPHA = 0.83891  # sqrt(alpha_bar) of a ZeroSNR DDPM schedule at index 220 (publisher's constant)
BASE_STEPS, DISTILL_STEPS, SR_STEPS = 32, 8, 5
VIDEO_CFG_HIGH, VIDEO_CFG_LOW, AUDIO_CFG, CFG_SWITCH_TIMESTEP = 5.0, 2.0, 5.0, 500
SR_VIDEO_CFG, SR_EARLY_FRAMES_CFG, SR_EARLY_FRAMES = 3.5, 2.0, 13  # SR: frames < 13 at min(2.0, 3.5) (over-exposure)


def unshifted_sigmas(num_steps: int) -> np.ndarray:
    return np.linspace(0.999, 0, num_steps + 1)[:-1]  # [N]


def flow_sigmas(num_steps: int, shift: float = FLOW_SHIFT) -> np.ndarray:
    """The publisher's N sigmas (final 0 not included)."""
    s = unshifted_sigmas(num_steps)
    return shift * s / (1 + (shift - 1) * s)


def make_unipc(num_steps: int, device=None, shift: float = FLOW_SHIFT) -> UniPCMultistepScheduler:
    scheduler = UniPCMultistepScheduler(
        num_train_timesteps=1000, use_flow_sigmas=True, flow_shift=shift, prediction_type="flow_prediction",
        solver_order=2, solver_type="bh2", predict_x0=True, lower_order_final=True, final_sigmas_type="zero")
    scheduler.set_timesteps(sigmas=unshifted_sigmas(num_steps), device=device)
    return scheduler


def distill_step(x: torch.Tensor, v: torch.Tensor, sigma: float, sigma_next: float, noise: torch.Tensor):
    """DDIM-style step of the distilled model: x0 = x - sigma v; x' = sigma' eps_fresh + (1 - sigma') x0."""
    x0 = x - sigma * v
    return sigma_next * noise + (1 - sigma_next) * x0


def video_guidance(timestep: int) -> float:
    """Video CFG scale: 5.0 while the int64 timestep is above 500, then 2.0 (audio stays at 5.0)."""
    return VIDEO_CFG_HIGH if timestep > CFG_SWITCH_TIMESTEP else VIDEO_CFG_LOW


def sr_video_guidance(latent_frames: int) -> torch.Tensor:
    """SR video CFG scale per latent frame, [1, T, 1, 1]: 3.5, lowered to 2.0 for the first 13 frames."""
    scale = torch.full((1, latent_frames, 1, 1), SR_VIDEO_CFG)
    scale[:, :SR_EARLY_FRAMES] = min(SR_EARLY_FRAMES_CFG, SR_VIDEO_CFG)
    return scale


def cfg(v_cond: torch.Tensor, v_uncond: torch.Tensor, scale) -> torch.Tensor:
    return v_uncond + scale * (v_cond - v_uncond)


def renoise(x: torch.Tensor, noise: torch.Tensor, alpha: float = SR_RENOISE_ALPHA) -> torch.Tensor:
    """SR start point: x = a x + sqrt(1 - a^2) eps (variance preserving)."""
    return alpha * x + math.sqrt(1 - alpha * alpha) * noise
