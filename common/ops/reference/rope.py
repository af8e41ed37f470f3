"""Rotary position embedding on pre-expanded cos / sin tables."""
from __future__ import annotations

import torch


def rotary_emb(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """x * cos + rotate(x) * sin in fp32, cast to x.dtype.

    x [T, H, R]; cos / sin [T, R], already expanded to the full width R:
    half mode [c0..c_{R/2-1}, c0..c_{R/2-1}] with rotate(x) = cat(-x2, x1) over the halves;
    interleaved mode [c0, c0, c1, c1, ..] with rotate(x) taking each pair (x0, x1) to (-x1, x0).
    """
    x32 = x.float()  # [T, H, R]
    if interleaved and torch.compiler.is_compiling():
        # the same values gathered, (-x1, x0) at pair (x0, x1): a strided slice of a buffer the graph does not own
        # (fp32 x) stacked would guard a graph over a symbolic T on T != 1
        idx = torch.arange(x.shape[-1], device=x.device)  # [R]
        rotated = x32.index_select(-1, idx ^ 1) * (idx % 2 * 2 - 1)  # [T, H, R]
    elif interleaved:
        rotated = torch.stack((-x32[..., 1::2], x32[..., 0::2]), dim=-1).flatten(-2)  # [T, H, R]
    else:
        x1, x2 = x32.chunk(2, dim=-1)  # [T, H, R/2] each
        rotated = torch.cat((-x2, x1), dim=-1)  # [T, H, R]
    cos, sin = cos.float()[:, None], sin.float()[:, None]  # [T, 1, R]
    return (x32 * cos + rotated * sin).to(x.dtype)
