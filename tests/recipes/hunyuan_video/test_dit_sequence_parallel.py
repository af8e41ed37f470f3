"""The DiT under sequence parallel on 2 real gloo ranks (Ulysses and ring) equals the single-rank forward (fp32,
1e-5): video tokens sharded (an odd count is padded), text replicated and right-padded per row; step-cache
decisions under SP equal the single-rank ones."""
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
                timestep=torch.tensor([700.0, 50.0]), encoder_hidden_states=torch.randn(2, 6, cfg.text_states_dim, generator=g),
                encoder_attention_mask=mask, pooled_projections=torch.randn(2, cfg.text_states_dim_2, generator=g),
                guidance=torch.tensor([6000.0, 6000.0]))


def _check(sp_mode: str) -> None:
    torch.set_num_threads(1)  # two ranks on a small machine
    par = parallel.init_parallel(parallel.ParallelLayout(sp=2), timeout_s=60)
    try:
        cfg = tiny_config()
        model = HunyuanVideoTransformer3D(cfg).eval()
        model.load_state_dict(random_state_dict(cfg, seed=1))
        group = par.group("sp")
        with torch.no_grad():
            for shape in LATENTS:
                x = _inputs(cfg, *shape)
                want = model(**x)
                got = model(**x, sp_group=group, sp_mode=sp_mode)
                torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
            if sp_mode == "ring":  # the cache's collective is the same for both modes
                return
            x = _inputs(cfg, *LATENTS[0])
            caches = {"sp": StepCache.from_config("teacache", 5, group=group, threshold=0.1),
                      "one": StepCache.from_config("teacache", 5, threshold=0.1)}
            for step in range(5):
                xs = dict(x, hidden_states=x["hidden_states"] * (1 - 0.002 * step), timestep=x["timestep"] - step)
                got = model(**xs, step=step, step_cache=caches["sp"], sp_group=group, sp_mode=sp_mode)
                want = model(**xs, step=step, step_cache=caches["one"])
                torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
            assert caches["sp"].computed == caches["one"].computed and not all(caches["one"].computed)
    finally:
        parallel.destroy_parallel()


@pytest.mark.slow
@pytest.mark.parametrize("sp_mode", ["ulysses", "ring"])
def test_two_ranks_equal_one(sp_mode):
    run_ranks(_check, 2, sp_mode)
