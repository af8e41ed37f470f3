"""Sampling: the UniPC loop the pipeline drives == the publisher's sigma formula; it integrates the flow ODE;
the distilled step; CFG scale switch; the SR re-noise constant."""
import math

import numpy as np
import pytest
import torch
from diffusers import DDPMScheduler

from scheduler_magihuman import (SR_RENOISE_ALPHA, distill_step, flow_sigmas, make_unipc, renoise,
                                 video_guidance)


@pytest.mark.parametrize("steps", [32, 8, 5])
def test_unipc_sigmas_and_timesteps_follow_the_formula(steps):
    s = np.linspace(0.999, 0, steps + 1)[:-1]
    sigma = 5 * s / (1 + 4 * s)  # shift 5
    sched = make_unipc(steps)
    np.testing.assert_allclose(sched.sigmas[:-1].numpy(), sigma, atol=1e-7)
    assert sched.sigmas[-1] == 0 and len(sched.timesteps) == steps
    assert sched.timesteps.tolist() == (sigma * 1000).astype(np.int64).tolist()
    np.testing.assert_allclose(flow_sigmas(steps), sigma)
    default = make_unipc(steps)
    default.set_timesteps(steps)  # diffusers' own list is not the publisher's
    assert np.abs(default.sigmas[:-1].numpy() - sigma).max() > 1e-3


def gaussian_velocity(x, sigma, mu, s):
    """Exact flow velocity for data ~ N(mu, s^2): x_t = (1 - sigma) x0 + sigma eps."""
    a = 1 - sigma
    x0 = mu + a * s * s / (a * a * s * s + sigma * sigma) * (x - a * mu)  # E[x0 | x_t]
    return (x - x0) / sigma


def test_unipc_loop_integrates_the_flow_ode():
    """Gaussian data: the ODE keeps (x - (1 - sigma) mu) / sqrt((1 - sigma)^2 s^2 + sigma^2) constant; the loop's
    error against that closed form shrinks with the step count (sign / x0-conversion mistakes would not)."""
    mu, s = 0.7, 0.5
    errors = []
    for steps in (5, 8, 32, 128):
        sched = make_unipc(steps)
        start = torch.linspace(-2, 2, 22, dtype=torch.float64).view(2, 11)  # the scheduler wants a batch dim
        x = start.clone()
        for t, sigma in zip(sched.timesteps, sched.sigmas[:-1].tolist()):
            x = sched.step(gaussian_velocity(x, sigma, mu, s), t, x).prev_sample
        s0 = float(sched.sigmas[0])
        exact = mu + s * (start - (1 - s0) * mu) / math.sqrt((1 - s0) ** 2 * s * s + s0 * s0)
        errors.append(float((x - exact).abs().max()))
    assert errors == sorted(errors, reverse=True) and errors[2] < 0.05 and errors[3] < 5e-3, errors


def test_distill_step_lands_on_the_predicted_x0():
    torch.manual_seed(0)
    target, x = torch.randn(6), torch.randn(6)
    sigmas = [*flow_sigmas(8).tolist(), 0.0]
    for sigma, nxt in zip(sigmas, sigmas[1:]):  # a model that knows x0: v = (x - x0) / sigma
        noise = torch.randn(6)
        new = distill_step(x, (x - target) / sigma, sigma, nxt, noise)
        torch.testing.assert_close(new, nxt * noise + (1 - nxt) * target)
        x = new
    torch.testing.assert_close(x, target)


def test_video_guidance_switches_at_timestep_500():
    assert video_guidance(999) == 5.0 and video_guidance(501) == 5.0
    assert video_guidance(500) == 2.0 and video_guidance(0) == 2.0
    ts = make_unipc(32).timesteps.tolist()
    assert 0 < sum(video_guidance(t) == 5.0 for t in ts) < 32


def test_sr_renoise_coefficient():
    ddpm = DDPMScheduler(beta_schedule="scaled_linear", beta_start=0.00085, beta_end=0.012,
                         rescale_betas_zero_snr=True)
    assert SR_RENOISE_ALPHA == pytest.approx(float(ddpm.alphas_cumprod[220].sqrt()), abs=1e-5)
    x, eps = torch.randn(1000, dtype=torch.float64), torch.randn(1000, dtype=torch.float64)
    torch.testing.assert_close(renoise(x, eps), 0.83891 * x + math.sqrt(1 - 0.83891 ** 2) * eps)
