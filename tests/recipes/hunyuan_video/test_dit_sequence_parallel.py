"""The DiT under sequence parallel on 2 real gloo ranks (Ulysses and ring) equals the single-rank forward (fp32,
1e-5): video tokens sharded (an odd count is padded), text replicated and right-padded per row; TeaCache and
FBCache decisions under SP equal the single-rank ones. One launch of 2 ranks for everything."""
import pytest
import torch
from dist_helpers import run_ranks
from modeling_hunyuan_video import HunyuanVideoTransformer3D
from weights_hunyuan_video import random_state_dict, tiny_config

from common import parallel
from common.diffusion.step_cache import StepCache

LATENTS = ((3, 6, 2), (2, 4, 4))  # (T, H, W): 9 video tokens (padded to 10 over 2 ranks), then 8


def _inputs(cfg, frames, height, width):
    g = torch.Generator().manual_seed(5)
    mask = torch.tensor([[1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 1]])
    return dict(hidden_states=torch.randn(2, cfg.in_channels, frames, height, width, generator=g),
                timestep=torch.tensor([700.0, 50.0]),
                encoder_hidden_states=torch.randn(2, 6, cfg.text_states_dim, generator=g),
                encoder_attention_mask=mask, pooled_projections=torch.randn(2, cfg.text_states_dim_2, generator=g),
                guidance=torch.tensor([6000.0, 6000.0]))


def _check() -> None:
    torch.set_num_threads(1)  # two ranks on a small machine
    par = parallel.init_parallel(parallel.ParallelLayout(sp=2), timeout_s=60)
    try:
        cfg = tiny_config()
        model = HunyuanVideoTransformer3D(cfg).eval()
        model.load_state_dict(random_state_dict(cfg, seed=1))
        group = par.group("sp")
        with torch.no_grad():
            for sp_mode, shape in [(mode, shape) for mode in ("ulysses", "ring") for shape in LATENTS]:
                x = _inputs(cfg, *shape)
                want = model(**x)
                got = model(**x, sp_group=group, sp_mode=sp_mode)
                torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
            x = _inputs(cfg, *LATENTS[0])  # padded video rows must not sway a cache's judge
            for policy, threshold in (("teacache", 0.1), ("fbcache", 0.05)):
                sp, one = (StepCache.from_config(policy, 5, group=g, threshold=threshold) for g in (group, None))
                for step in range(5):
                    xs = dict(x, hidden_states=x["hidden_states"] * (1 - 0.002 * step), timestep=x["timestep"] - step)
                    got = model(**xs, step=step, step_cache=sp, sp_group=group)  # Ulysses
                    torch.testing.assert_close(got, model(**xs, step=step, step_cache=one), rtol=1e-5, atol=1e-5)
                assert sp.computed == one.computed and not all(one.computed), policy
    finally:
        parallel.destroy_parallel()


@pytest.mark.slow
def test_two_ranks_equal_one():
    """One launch for both modes (a launch costs seconds on a small machine)."""
    run_ranks(_check, 2)
