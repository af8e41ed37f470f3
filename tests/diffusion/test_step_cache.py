"""Step caches: `none` is the baseline bit for bit; each policy's decisions follow its rule, worked out here by hand."""
import numpy as np
import pytest
import torch

from common.diffusion.step_cache import TEACACHE_HUNYUAN_VIDEO, StepCache, make_policy


def _toy_stack(seed=0, width=8, depth=4, act=torch.tanh):
    g = torch.Generator().manual_seed(seed)
    weights = [torch.randn(width, width, generator=g) * 0.2 for _ in range(depth)]
    blocks = [lambda h, w=w: h + act(h @ w) for w in weights]  # residual blocks [B, S, C] -> [B, S, C]

    def tail(h):
        for block in blocks[1:]:
            h = block(h)
        return h

    return blocks[0], tail


def _inputs(steps, speed, seed=1):
    g = torch.Generator().manual_seed(seed)
    x0, drift = torch.randn(2, 6, 8, generator=g), torch.randn(2, 6, 8, generator=g)
    return [x0 + speed * t * drift for t in range(steps)]  # [B, S, C] per step


def test_none_equals_baseline_exactly():
    head, tail = _toy_stack()
    cache = StepCache.from_config("none", num_steps=6)
    for step, x in enumerate(_inputs(6, 0.3)):
        assert torch.equal(cache.run(step, x, head, tail, judge=x), tail(head(x)))
    assert cache.computed == [True] * 6


def test_tuple_state():
    cache = StepCache.from_config("teacache", num_steps=6, threshold=10.0)
    head, tail = (lambda s: (s[0] + 1, s[1] * 2)), (lambda s: (s[0] * 3, s[1] - 1))
    x = (torch.ones(3), torch.full((3,), 2.0))
    assert all(torch.equal(a, b) for a, b in zip(cache.run(0, x, head, tail, judge=x[0]), (torch.full((3,), 6.0), torch.full((3,), 3.0))))
    y = cache.run(1, (torch.zeros(3), torch.zeros(3)), head, tail, judge=x[0] * 1.001)  # skipped: x + residual
    assert cache.computed == [True, False]
    assert torch.equal(y[0], torch.full((3,), 5.0)) and torch.equal(y[1], torch.full((3,), 1.0))


def test_teacache_decisions_by_hand():
    values = [1.0, 1.01, 1.02, 1.10, 1.11, 1.12, 1.5, 1.51, 1.52, 1.53]
    judges = [torch.full((2, 3), v) for v in values]
    want, acc = [], 0.0
    for step, v in enumerate(values):  # the rule, written out with numpy
        if step == 0 or step >= len(values) - 2:
            want.append(True)
            acc = 0.0
            continue
        rel = abs(v - values[step - 1]) / abs(values[step - 1])
        acc += abs(np.polyval(TEACACHE_HUNYUAN_VIDEO, rel))
        want.append(bool(acc >= 0.15))
        acc = 0.0 if acc >= 0.15 else acc
    # |poly(rel)| per step: .071 .071 | .099 -> acc .241 | .073 .073 | .857 | .078 ; last 2 forced
    assert want == [True, False, False, True, False, False, True, False, True, True]
    cache = StepCache(make_policy("teacache", num_steps=len(values)))
    for step, j in enumerate(judges):
        cache.run(step, j, lambda h: h, lambda h: h * 2, judge=j)
    assert cache.computed == want


def test_teacache_skips_slow_inputs():
    head, tail = _toy_stack()
    xs = _inputs(10, 0.002)
    cache = StepCache.from_config("teacache", num_steps=10, threshold=0.15)
    outs = [cache.run(step, x, head, tail, judge=x) for step, x in enumerate(xs)]
    assert cache.computed[0] and cache.computed[-2:] == [True, True]
    assert not all(cache.computed)
    for x, y in zip(xs, outs):
        torch.testing.assert_close(y, tail(head(x)), rtol=0, atol=0.05)


def test_fbcache_decisions_by_hand():
    values = [1.0, 1.02, 1.04, 1.06, 1.2, 1.21, 1.3]
    # rel against block-0 output of the last computed step: .02 .04 | .06 | .132 | .0083 | .083
    want = [True, False, False, True, True, False, True]
    cache = StepCache.from_config("fbcache", num_steps=len(values), threshold=0.05)
    outs = []
    for step, v in enumerate(values):
        outs.append(cache.run(step, torch.zeros(4), lambda h, v=v: h + v, lambda h: h * 2))
    assert cache.computed == want
    torch.testing.assert_close(outs[1], torch.full((4,), 1.02 + 1.0))  # head output + tail residual of step 0
    torch.testing.assert_close(outs[5], torch.full((4,), 1.21 + 1.2))  # residual of step 4
    torch.testing.assert_close(outs[6], torch.full((4,), 2.6))


def test_taylorseer_schedule_and_linear_extrapolation():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(8, 8, generator=g)
    head, tail = (lambda h: h @ w), (lambda h: h * 0.5 + 1)  # affine stack: output linear in the step
    xs = _inputs(10, 0.5)
    cache = StepCache.from_config("taylorseer", num_steps=10, interval=3, order=1)
    outs = [cache.run(step, x, head, tail) for step, x in enumerate(xs)]
    assert cache.computed == [True, True, False, True, False, False, True, False, False, True]
    for x, y in zip(xs, outs):  # first-order extrapolation of a linear trajectory is exact
        torch.testing.assert_close(y, tail(head(x)), rtol=1e-5, atol=1e-5)
    zero = StepCache.from_config("taylorseer", num_steps=10, interval=3, order=0)
    outs = [zero.run(step, x, head, tail) for step, x in enumerate(xs)]
    assert zero.computed == [True, False, False, True, False, False, True, False, False, True]
    assert torch.equal(outs[2], tail(head(xs[0])))  # order 0: the last computed output


def test_unknown_policy():
    with pytest.raises(ValueError, match="unknown step cache"):
        make_policy("deepcache", num_steps=10)
    with pytest.raises(ValueError, match="order"):
        make_policy("taylorseer", num_steps=10, order=2)
