"""Step caches: skip (part of) a DiT's block stack on denoising steps where its input barely changed.

A transformer's forward wraps its block loop in a StepCache, split as `head` (block 0) and `tail` (the rest):

    cache = StepCache.from_config("teacache", num_steps=50)          # or none / fbcache / taylorseer
    hidden = cache.run(step, hidden, head=first_block, tail=other_blocks, judge=modulated_input_of_block_0)

`hidden` is a tensor or a tuple of tensors (e.g. video and text streams); head / tail take and return the same
structure. A policy says per step whether to compute; when not, it stands in for the skipped blocks:

| policy | judge | skips | stand-in |
|---|---|---|---|
| none | - | nothing | - |
| teacache | caller's: modulated input of block 0 | whole stack | input + residual of the last computed step |
| fbcache | block 0's output (head always runs) | tail | head output + tail residual of the last computed step |
| taylorseer | - | whole stack | Taylor extrapolation (order 0 or 1) of the stack output over step index |

Under sequence parallel, pass the sp group: the relative L1 sums are all-reduced, so every rank takes the same
decision (different decisions would desynchronise the ranks' collectives). Step 0 resets the policy's state.
"""
from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from common.parallel import all_reduce

State = torch.Tensor | tuple[torch.Tensor, ...]
POLICIES = ("none", "teacache", "fbcache", "taylorseer")
# HunyuanVideo's rescale polynomial for TeaCache, highest power first (numpy.polyval order).
TEACACHE_HUNYUAN_VIDEO = (733.226126, -401.131952, 67.5869174, -3.149879, 0.0961237896)


def _map(fn, *states: State) -> State:
    if isinstance(states[0], torch.Tensor):
        return fn(*states)
    return tuple(fn(*parts) for parts in zip(*states))


def relative_l1(x: torch.Tensor, ref: torch.Tensor, group: dist.ProcessGroup | None = None) -> float:
    """mean|x - ref| / mean|ref| over the whole tensor, summed over the group's shards when sequence-parallel."""
    sums = torch.stack([(x - ref).abs().sum(), ref.abs().sum()]).double()  # [2]
    all_reduce(sums, group)
    return (sums[0] / sums[1]).item()


def polyval(coefficients, x: float) -> float:
    """numpy.polyval: coefficients highest power first."""
    value = 0.0
    for c in coefficients:
        value = value * x + c
    return value


class NoCache:
    """Always compute: the baseline."""

    needs_head = False

    def reset(self) -> None:
        pass

    def should_compute(self, step: int, judge) -> bool:
        return True

    def update(self, step: int, x: State, y: State) -> None:
        pass

    def reuse(self, step: int, x: State) -> State:
        raise AssertionError("NoCache never skips")


class TeaCache:
    """TeaCache: accumulate the rescaled relative change of the judge; compute once it reaches the threshold.

    acc += |poly(rel)|, rel = relative_l1(judge, previous step's judge). Compute (and reset acc to 0) when
    acc >= threshold; step 0 and the last 2 steps always compute (and also reset acc). Skipped steps return
    input + the whole stack's residual from the last computed step.
    """

    needs_head = False

    def __init__(self, num_steps: int, threshold: float = 0.15, coefficients=TEACACHE_HUNYUAN_VIDEO,
                 group: dist.ProcessGroup | None = None):
        self.num_steps, self.threshold, self.coefficients, self.group = num_steps, threshold, coefficients, group
        self.reset()

    def reset(self) -> None:
        self.acc, self.prev_judge, self.residual = 0.0, None, None

    def should_compute(self, step: int, judge: torch.Tensor) -> bool:
        forced = step == 0 or step >= self.num_steps - 2 or self.prev_judge is None or self.residual is None
        if not forced:
            self.acc += abs(polyval(self.coefficients, relative_l1(judge, self.prev_judge, self.group)))
        self.prev_judge = judge.detach()
        if forced or self.acc >= self.threshold:
            self.acc = 0.0
            return True
        return False

    def update(self, step: int, x: State, y: State) -> None:
        self.residual = _map(torch.sub, y, x)

    def reuse(self, step: int, x: State) -> State:
        return _map(torch.add, x, self.residual)


class FBCache:
    """First-block cache: block 0 always runs; its output is the judge.

    Compute the tail when relative_l1(block-0 output, block-0 output of the last COMPUTED step) >= threshold,
    or when nothing is cached yet. The reference moves only on computed steps (as upstream ParaAttention /
    diffusers do), so a slow drift still adds up to a recompute. Skipped steps return block-0 output + the
    tail's residual from the last computed step.
    """

    needs_head = True

    def __init__(self, threshold: float = 0.05, group: dist.ProcessGroup | None = None):
        self.threshold, self.group = threshold, group
        self.reset()

    def reset(self) -> None:
        self.ref, self.residual = None, None

    def should_compute(self, step: int, judge: torch.Tensor) -> bool:
        if self.ref is not None and self.residual is not None:
            if relative_l1(judge, self.ref, self.group) < self.threshold:
                return False
        self.ref = judge.detach()
        return True

    def update(self, step: int, x: State, y: State) -> None:
        self.residual = _map(torch.sub, y, x)

    def reuse(self, step: int, x: State) -> State:
        return _map(torch.add, x, self.residual)


class TaylorSeer:
    """TaylorSeer: compute on steps 0..order and every `interval`-th step; in between, extrapolate the stack output.

    order 1: y(s) = y_b + (y_b - y_a) / (b - a) * (s - b) from the last two computed steps a < b (the first-order
    Taylor term as a finite difference over step index); order 0: y(s) = y_b (plain reuse of the output).
    With interval N, N - 1 of every N steps are extrapolated.
    """

    needs_head = False

    def __init__(self, interval: int = 5, order: int = 1):
        if order not in (0, 1) or interval < 1:
            raise ValueError(f"taylorseer: order {order} (0 or 1), interval {interval} (>= 1)")
        self.interval, self.order = interval, order
        self.reset()

    def reset(self) -> None:
        self.history: list[tuple[int, State]] = []  # (step, stack output) of the last order + 1 computed steps

    def should_compute(self, step: int, judge=None) -> bool:
        return step <= self.order or step % self.interval == 0 or not self.history

    def update(self, step: int, x: State, y: State) -> None:
        self.history = (self.history + [(step, y)])[-(self.order + 1):]

    def reuse(self, step: int, x: State) -> State:
        b, y_b = self.history[-1]
        if self.order == 0 or len(self.history) < 2:
            return y_b
        a, y_a = self.history[-2]
        t = (step - b) / (b - a)
        return _map(lambda yb, ya: yb + (yb - ya) * t, y_b, y_a)


def make_policy(name: str, num_steps: int, group: dist.ProcessGroup | None = None, **options):
    """A policy by its config name; options are the policy's keyword arguments (threshold, interval, order, ...)."""
    if name == "none":
        return NoCache()
    if name == "teacache":
        return TeaCache(num_steps, group=group, **options)
    if name == "fbcache":
        return FBCache(group=group, **options)
    if name == "taylorseer":
        return TaylorSeer(**options)
    raise ValueError(f"unknown step cache {name!r}: expected one of {POLICIES}")


class StepCache:
    """Wraps a transformer's block loop; `computed` records each step's decision (True = blocks ran)."""

    def __init__(self, policy):
        self.policy = policy
        self.computed: list[bool] = []

    @classmethod
    def from_config(cls, name: str, num_steps: int, group: dist.ProcessGroup | None = None, **options):
        return cls(make_policy(name, num_steps, group, **options))

    def run(self, step: int, x: State, head: Callable[[State], State], tail: Callable[[State], State],
            judge: torch.Tensor | None = None) -> State:
        """The block stack tail(head(x)) at denoising step `step` (0-based), or the policy's stand-in for it."""
        if step == 0:
            self.policy.reset()
            self.computed = []
        if self.policy.needs_head:
            x = head(x)
            judge, stack = (x if isinstance(x, torch.Tensor) else x[0]), tail
        else:
            stack = lambda h: tail(head(h))  # noqa: E731
        compute = self.policy.should_compute(step, judge)
        self.computed.append(compute)
        if not compute:
            return self.policy.reuse(step, x)
        y = stack(x)
        self.policy.update(step, x, y)
        return y
