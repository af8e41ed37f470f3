"""The DiT's step-cache wiring: none == no cache bit for bit; TeaCache judges double block 0's modulated input;
FBCache's head is double block 0; skipped steps stand in with the cached residual of the whole (img, txt) state."""
import pytest
import torch
import torch.nn.functional as F
from modeling_hunyuan_video import HunyuanVideoTransformer3D
from weights_hunyuan_video import random_state_dict, tiny_config

from common.diffusion.step_cache import FBCache, StepCache, TeaCache, make_policy

STEPS = 6


@pytest.fixture(scope="module")
def model():
    cfg = tiny_config()
    m = HunyuanVideoTransformer3D(cfg).eval()
    m.load_state_dict(random_state_dict(cfg, seed=2))
    return m


def step_inputs(cfg, seed=0):
    g = torch.Generator().manual_seed(seed)
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 0, 0, 0]])
    return dict(hidden_states=torch.randn(2, cfg.in_channels, 2, 4, 4, generator=g), timestep=torch.tensor([800.0] * 2),
                encoder_hidden_states=torch.randn(2, 5, cfg.text_states_dim, generator=g), encoder_attention_mask=mask,
                pooled_projections=torch.randn(2, cfg.text_states_dim_2, generator=g),
                guidance=torch.tensor([6000.0] * 2))


class Recording:
    """A policy that records the judge it is handed (the real policy decides)."""

    def __init__(self, policy):
        self.policy, self.judges = policy, []
        self.needs_head = policy.needs_head

    def reset(self):
        self.policy.reset()

    def should_compute(self, step, judge):
        self.judges.append(judge)
        return self.policy.should_compute(step, judge)

    def update(self, step, x, y):
        self.policy.update(step, x, y)

    def reuse(self, step, x):
        return self.policy.reuse(step, x)


def block0_io(model, x):
    """(img input, vec, img output) of double block 0 in a plain forward."""
    seen = {}
    block = model.double_blocks[0]
    pre = block.register_forward_pre_hook(lambda m, args: seen.update(img=args[0], vec=args[2]))
    post = block.register_forward_hook(lambda m, args, out: seen.update(out=out[0]))
    try:
        with torch.no_grad():
            model(**x)
    finally:
        pre.remove()
        post.remove()
    return seen["img"], seen["vec"], seen["out"]


@torch.no_grad()
def test_no_cache_policy_is_exactly_no_cache(model):
    x = step_inputs(model.config)
    cache = StepCache.from_config("none", STEPS)
    for step in range(3):
        xs = dict(x, timestep=x["timestep"] - 100 * step)
        assert torch.equal(model(**xs, step=step, step_cache=cache), model(**xs))
    assert cache.computed == [True] * 3


@torch.no_grad()
def test_teacache_judge_is_modulated_input_of_double_block_0(model):
    x = step_inputs(model.config)
    cache = StepCache(Recording(TeaCache(STEPS)))
    model(**x, step=0, step_cache=cache)
    img, vec, _ = block0_io(model, x)
    shift, scale = F.linear(F.silu(vec), model.double_blocks[0].img_mod.linear.weight,
                            model.double_blocks[0].img_mod.linear.bias).chunk(6, dim=-1)[:2]
    want = F.layer_norm(img, img.shape[-1:], eps=1e-6) * (1 + scale[:, None]) + shift[:, None]
    torch.testing.assert_close(cache.policy.judges[0], want, rtol=1e-6, atol=1e-6)


@torch.no_grad()
def test_fbcache_head_is_double_block_0(model):
    x = step_inputs(model.config)
    cache = StepCache(Recording(FBCache(threshold=0.05)))
    model(**x, step=0, step_cache=cache)
    _, _, block0_out = block0_io(model, x)
    torch.testing.assert_close(cache.policy.judges[0], block0_out, rtol=0, atol=0)


@pytest.mark.parametrize("name, options", [("teacache", {"threshold": 0.15}), ("fbcache", {"threshold": 0.05}),
                                           ("taylorseer", {"interval": 3, "order": 1})])
@torch.no_grad()
def test_skipped_step_reuses_the_cached_stack(model, name, options):
    """Step 1 repeats step 0's inputs: every policy skips it, and the stand-in equals the computed output."""
    x = step_inputs(model.config)
    cache = StepCache(make_policy(name, STEPS, **options))
    first = model(**x, step=0, step_cache=cache)
    if name == "taylorseer":  # it computes steps 0..order; step 2 extrapolates from two equal outputs
        model(**x, step=1, step_cache=cache)
    again = model(**x, step=len(cache.computed), step_cache=cache)
    assert cache.computed[-1] is False
    torch.testing.assert_close(again, first, rtol=1e-5, atol=1e-5)


@torch.no_grad()
def test_teacache_skips_on_a_slowly_changing_input(model):
    x = step_inputs(model.config)
    cache = StepCache.from_config("teacache", STEPS, threshold=0.15)
    outs, plain = [], []
    for step in range(STEPS):
        xs = dict(x, hidden_states=x["hidden_states"] * (1 - 0.001 * step), timestep=x["timestep"] - step)
        outs.append(model(**xs, step=step, step_cache=cache))
        plain.append(model(**xs))
    assert cache.computed[0] and cache.computed[-2:] == [True, True] and not all(cache.computed)
    for got, want, computed in zip(outs, plain, cache.computed):
        if computed:
            assert torch.equal(got, want)
        torch.testing.assert_close(got, want, rtol=0.05, atol=0.05)  # a skipped step is close, not equal
