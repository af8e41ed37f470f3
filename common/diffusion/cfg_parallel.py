"""Classifier-free guidance, batched on one rank or split across the two ranks of a cfg group.

    noise = uncond + scale * (cond - uncond)

Batched (group None): one forward over [cond; uncond] stacked on the batch dim. CFG parallel (a cfg group of 2
ranks): rank 0 runs the cond branch, rank 1 the uncond branch, and the two predictions are all-gathered, so each
rank takes the same guided step with half the compute. Both branches' inputs must have the same shapes (pad the
text to one length with a mask).
"""
from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from common.parallel import all_gather, group_rank, group_size

Inputs = dict[str, torch.Tensor]


def guided_prediction(predict: Callable[..., torch.Tensor], cond: Inputs, uncond: Inputs, scale: float,
                      group: dist.ProcessGroup | None = None, shared: Inputs | None = None, **options) -> torch.Tensor:
    """CFG-combined prediction [B, ...]. cond / uncond: the branch-specific keyword tensors [B, ...] (same shapes);
    shared: keyword tensors [B, ...] both branches take (latents, timestep; repeated for the batched call);
    options: other keyword arguments, passed to predict as they are."""
    if cond.keys() != uncond.keys():
        raise ValueError(f"cfg branches take different inputs: {sorted(cond)} vs {sorted(uncond)}")
    shared = shared or {}
    size = group_size(group)
    if size == 1:
        both = {k: torch.cat([cond[k], uncond[k]]) for k in cond} | {k: torch.cat([v, v]) for k, v in shared.items()}
        pred_cond, pred_uncond = predict(**both, **options).chunk(2)  # [B, ...] each
    elif size == 2:
        mine = cond if group_rank(group) == 0 else uncond
        pred_cond, pred_uncond = all_gather(predict(**mine, **shared, **options), group, dim=0).chunk(2)
    else:
        raise ValueError(f"cfg parallel needs a group of 2 ranks, got {size}")
    return pred_uncond + scale * (pred_cond - pred_uncond)
