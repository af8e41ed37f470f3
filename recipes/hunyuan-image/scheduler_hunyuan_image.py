"""The flow-matching Euler scheduler of HunyuanImage-3.0, as diffusers' FlowMatchEulerDiscreteScheduler.

Publisher: s = linspace(1, 0, N+1), sigma = shift s / (1 + (shift - 1) s) with shift 3, timesteps = 1000 sigma[:-1],
x(s_next) = x(s) + (s_next - s) v. diffusers reproduces it exactly when given the unshifted sigmas
linspace(1, 0, N+1)[:-1]: it applies the same static shift and appends the terminal 0 (its default
`set_timesteps(N)` would start from linspace(1, 1/1000, N) instead, hence the explicit sigmas).
"""
from __future__ import annotations

import numpy as np
from diffusers import FlowMatchEulerDiscreteScheduler

SHIFT = 3.0


def make_scheduler(num_inference_steps: int, shift: float = SHIFT) -> FlowMatchEulerDiscreteScheduler:
    scheduler = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=shift)
    scheduler.set_timesteps(sigmas=np.linspace(1.0, 0.0, num_inference_steps + 1)[:-1])
    return scheduler
