"""RMSNorm, alone and fused with the residual add."""
from __future__ import annotations

import torch


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """x * rsqrt(mean(x^2) + eps) * weight, in fp32, cast back to x.dtype; weight None = unweighted."""
    x32 = x.float()  # [..., H]
    mean_sq = torch.linalg.vector_norm(x32, dim=-1, keepdim=True).square() / x.shape[-1]  # no [..., H] temporary
    y = x32 * torch.rsqrt(mean_sq + eps)
    if weight is not None:
        y = y * weight.float()
    return y.to(x.dtype)


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor | None, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual), x + residual)."""
    summed = x + residual  # [..., H]
    return rms_norm(summed, weight, eps), summed
