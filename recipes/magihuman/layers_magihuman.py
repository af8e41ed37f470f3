"""MagiHuman building blocks: modality dispatch, per-modality expert linears and RMSNorms, the clamped activations.

Tokens carry a modality (VIDEO 0, AUDIO 1, TEXT 2 = expert index). The dispatcher sorts them into modality groups
once; an expert linear then runs one GEMM per group (common.ops.grouped_matmul) and a modality RMSNorm scales each
group by its own (1 + w_m).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from common import ops

NUM_MODALITIES = 3


def swiglu7(u: torch.Tensor, limit: float = 7.0, alpha: float = 1.702) -> torch.Tensor:
    """Interleaved clipped SwiGLU: gate = u[0::2] <= 7, lin = u[1::2] in [-7, 7]; gate sigmoid(1.702 gate) (lin + 1).

    u [..., 2I] fp32 -> [..., I]. (npu_clipped_swiglu(alpha=1.702, limit=7, bias=1.0, interleaved=True) on Ascend.)
    """
    gate, lin = u[..., 0::2].clamp(max=limit), u[..., 1::2].clamp(-limit, limit)  # [..., I] each
    return gate * torch.sigmoid(alpha * gate) * (lin + 1)


def gelu7(x: torch.Tensor, limit: float = 7.0, alpha: float = 1.702) -> torch.Tensor:
    """x' sigmoid(1.702 x') with x' = min(x, 7) (no lower clamp); not gated."""
    x = x.clamp(max=limit)
    return x * torch.sigmoid(alpha * x)


class ModalityDispatcher:
    """Permutation of the tokens into modality groups and back: perm = argsort(modality), inv = argsort(perm)."""

    def __init__(self, modality: torch.Tensor):
        self.modality = modality  # [N] long, original order
        self.perm = torch.argsort(modality, stable=True)  # [N]
        self.inv = torch.argsort(self.perm)  # [N]
        self.group_sizes = torch.bincount(modality, minlength=NUM_MODALITIES)  # [3] tokens per expert
        self.identity = bool((self.perm == torch.arange(len(modality), device=modality.device)).all())
        self.sorted_modality = modality[self.perm]  # [N]

    def dispatch(self, x: torch.Tensor) -> torch.Tensor:  # original order -> modality groups
        return x if self.identity else x[self.perm]

    def undispatch(self, x: torch.Tensor) -> torch.Tensor:  # modality groups -> original order
        return x if self.identity else x[self.inv]


class ExpertLinear(nn.Module):
    """Bias-free linear with one weight per expert, stored stacked as [out * n, in] (expert i = rows i*out..).

    Input in modality groups (sizes from the dispatcher); cast to the weight dtype (bf16) for the matmul."""

    def __init__(self, in_features: int, out_features: int, num_experts: int, dtype=torch.bfloat16):
        super().__init__()
        self.in_features, self.out_features, self.num_experts = in_features, out_features, num_experts
        self.weight = nn.Parameter(torch.empty(out_features * num_experts, in_features, dtype=dtype),
                                   requires_grad=False)

    def forward(self, x: torch.Tensor, group_sizes: torch.Tensor) -> torch.Tensor:
        x = x.to(self.weight.dtype)  # [N, in]
        if self.num_experts == 1:
            return F.linear(x, self.weight)  # [N, out]
        w = self.weight.view(self.num_experts, self.out_features, self.in_features)  # [E, out, in]
        return ops.grouped_matmul(x, w, group_sizes)  # [N, out]


class MultiModalityRMSNorm(nn.Module):
    """y = x rsqrt(mean(x^2) + eps) (1 + w_m) in fp32, cast back; weight [dim * n] stores gamma - 1 (zero init).

    RMS over the whole last dim; each modality group scaled by its own 1 + w_m (one rms_norm per group)."""

    def __init__(self, dim: int, num_experts: int, eps: float = 1e-6):
        super().__init__()
        self.dim, self.num_experts, self.eps = dim, num_experts, eps
        self.weight = nn.Parameter(torch.zeros(dim * num_experts, dtype=torch.float32), requires_grad=False)

    def forward(self, x: torch.Tensor, group_sizes: torch.Tensor) -> torch.Tensor:
        gamma = 1.0 + self.weight.view(self.num_experts, self.dim)  # [E, dim] fp32
        if self.num_experts == 1:
            return ops.rms_norm(x, gamma[0], self.eps)  # [N, ..., dim]
        out, start = torch.empty_like(x), 0
        for m, size in enumerate(group_sizes.tolist()):
            if size:
                out[start:start + size] = ops.rms_norm(x[start:start + size], gamma[m], self.eps)
            start += size
        return out
