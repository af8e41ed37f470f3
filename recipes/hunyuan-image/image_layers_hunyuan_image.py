"""The diffusion-side layers of HunyuanImage-3.0: timestep embedders, UNetDown (`patch_embed`), UNetUp
(`final_layer`)."""
from __future__ import annotations

import math

import torch
from torch import nn


def timestep_sinusoid(t: torch.Tensor, dim: int = 256, max_period: float = 10000.0) -> torch.Tensor:
    """t [B] float (sigma * 1000) -> [B, dim] = [cos(t f), sin(t f)], f_i = exp(-ln(max_period) i / (dim/2))."""
    half = dim // 2
    freqs = torch.exp(-math.log(max_period) * torch.arange(half, dtype=torch.float32, device=t.device) / half)
    args = t.float()[:, None] * freqs  # [B, half]
    return torch.cat([torch.cos(args), torch.sin(args)], dim=-1)  # [B, dim]


class TimestepEmbedder(nn.Module):
    """sinusoid(256) -> Linear -> exact GELU -> Linear. Keys `mlp.0`, `mlp.2`."""

    def __init__(self, hidden_size: int, frequency_size: int = 256):
        super().__init__()
        self.frequency_size = frequency_size
        self.mlp = nn.Sequential(nn.Linear(frequency_size, hidden_size), nn.GELU(), nn.Linear(hidden_size, hidden_size))

    def forward(self, t: torch.Tensor) -> torch.Tensor:  # t [B] -> [B, hidden]
        return self.mlp(timestep_sinusoid(t, self.frequency_size).to(self.mlp[0].weight.dtype))


class ResBlock(nn.Module):
    """GN -> SiLU -> conv3x3; adaptive GN from the time embedding (scale, shift); SiLU -> conv3x3; + skip."""

    def __init__(self, in_channels: int, emb_channels: int, out_channels: int):
        super().__init__()
        self.in_layers = nn.Sequential(nn.GroupNorm(32, in_channels), nn.SiLU(),
                                       nn.Conv2d(in_channels, out_channels, 3, padding=1))
        self.emb_layers = nn.Sequential(nn.SiLU(), nn.Linear(emb_channels, 2 * out_channels))
        self.out_layers = nn.Sequential(nn.GroupNorm(32, out_channels), nn.SiLU(), nn.Dropout(0.0),
                                        nn.Conv2d(out_channels, out_channels, 3, padding=1))
        self.skip_connection = nn.Identity() if in_channels == out_channels else nn.Conv2d(in_channels, out_channels, 1)

    def forward(self, x: torch.Tensor, emb: torch.Tensor) -> torch.Tensor:  # x [B, Cin, h, w], emb [B, E]
        h = self.in_layers(x)  # [B, Cout, h, w]
        scale, shift = self.emb_layers(emb)[..., None, None].chunk(2, dim=1)  # [B, Cout, 1, 1] each
        h = self.out_layers[0](h) * (1 + scale) + shift
        return self.skip_connection(x) + self.out_layers[1:](h)


class UNetDown(nn.Module):
    """`patch_embed` (patch 1): conv3x3 latent -> hidden_channels, ResBlock -> model dim; flatten to tokens."""

    def __init__(self, in_channels: int, emb_channels: int, hidden_channels: int, out_channels: int):
        super().__init__()
        self.model = nn.ModuleList([nn.Conv2d(in_channels, hidden_channels, 3, padding=1),
                                    ResBlock(hidden_channels, emb_channels, out_channels)])

    def forward(self, latents: torch.Tensor, emb: torch.Tensor) -> torch.Tensor:  # [B, C, h, w] -> [B, h*w, D]
        x = self.model[1](self.model[0](latents), emb)  # [B, D, h, w]
        return x.flatten(2).transpose(1, 2)


class UNetUp(nn.Module):
    """`final_layer` (patch 1): tokens back to a map, ResBlock -> hidden_channels, GN -> SiLU -> conv3x3 -> latent."""

    def __init__(self, in_channels: int, emb_channels: int, hidden_channels: int, out_channels: int):
        super().__init__()
        self.model = nn.ModuleList([
            ResBlock(in_channels, emb_channels, hidden_channels),
            nn.Sequential(nn.GroupNorm(32, hidden_channels), nn.SiLU(),
                          nn.Conv2d(hidden_channels, out_channels, 3, padding=1)),
        ])

    def forward(self, tokens: torch.Tensor, emb: torch.Tensor, h: int, w: int) -> torch.Tensor:
        x = tokens.transpose(1, 2).unflatten(2, (h, w))  # [B, D, h, w]
        return self.model[1](self.model[0](x, emb))  # [B, C, h, w]

