"""MagiHuman 9-coordinate Fourier RoPE: (t, h, w, T, H, W, refT, refH, refW) per token.

Per axis a: scale s = (ref - 1) / (size - 1) (1 when size = 1), centre c = (0, (H-1)/2, (W-1)/2),
p_a = (coord_a - c_a) s_a; theta[a * nb + k] = p_a * bands[k], bands = theta_base^(-k / nb), nb = head_dim / 8.
The first 6 nb dims of every head are rotated in half mode (pairs i, i + 3 nb); the rest pass through.
"""
from __future__ import annotations

import torch

from common import ops


def rope_bands(num_bands: int, theta: float = 10000.0) -> torch.Tensor:
    return theta ** (-torch.arange(num_bands, dtype=torch.float32) / num_bands)  # [nb]


def video_coords(T: int, H: int, W: int) -> torch.Tensor:
    """Latent frames x token grid (H, W = latent h / 2, w / 2), raster order (t, h, w); size = ref = (T, H, W)."""
    t, h, w = torch.meshgrid(torch.arange(T), torch.arange(H), torch.arange(W), indexing="ij")
    grid = torch.stack([t, h, w], -1).reshape(-1, 3).float()  # [T*H*W, 3]
    size = torch.tensor([T, H, W], dtype=torch.float32).expand_as(grid)
    return torch.cat([grid, size, size], -1)  # [N, 9]


def audio_coords(A: int) -> torch.Tensor:
    """t = 0..A-1, h = w = 0, size (A, 1, 1), refT = (A-1)//4 + 1: audio time runs at the latent frame rate."""
    t = torch.arange(A, dtype=torch.float32)
    rows = [t, torch.zeros(A), torch.zeros(A)] + [torch.full((A,), float(v)) for v in (A, 1, 1, (A - 1) // 4 + 1, 1, 1)]
    return torch.stack(rows, -1)  # [A, 9]


def text_coords(L: int, version: str) -> torch.Tensor:
    """v2 (base, distill): t = -L..-1 with refT 1 (scale 0: unrotated); v1 (SR): t = 0..L-1 with refT 2."""
    t = torch.arange(L, dtype=torch.float32) - (L if version == "v2" else 0)
    ref_t = 1 if version == "v2" else 2
    rows = [t, torch.zeros(L), torch.zeros(L)] + [torch.full((L,), float(v)) for v in (L, 1, 1, ref_t, 1, 1)]
    return torch.stack(rows, -1)  # [L, 9]


def rope_angles(coords: torch.Tensor, bands: torch.Tensor) -> torch.Tensor:
    """coords [N, 9] -> theta [N, 3 nb] (axis-major: t bands, h bands, w bands)."""
    pos, size, ref = coords[:, 0:3], coords[:, 3:6], coords[:, 6:9]  # [N, 3] each
    scale = torch.where(size > 1, (ref - 1) / (size - 1).clamp(min=1), torch.ones_like(size))  # [N, 3]
    centre = torch.stack([torch.zeros_like(size[:, 0]), (size[:, 1] - 1) / 2, (size[:, 2] - 1) / 2], -1)
    p = (pos - centre) * scale  # [N, 3]
    return (p[:, :, None] * bands.float()).flatten(1)  # [N, 3 nb]


def rope_cos_sin(coords: torch.Tensor, bands: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos / sin [N, 6 nb] expanded for half mode ([c, c]), fp32."""
    theta = rope_angles(coords, bands)  # [N, 3 nb]
    theta = torch.cat([theta, theta], -1)  # [N, 6 nb]
    return theta.cos(), theta.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [N, heads, D] fp32; rotate the first cos.shape[-1] dims in half mode, pass the rest through."""
    r = cos.shape[-1]
    return torch.cat([ops.rotary_emb(x[..., :r], cos, sin, interleaved=False), x[..., r:]], -1)
