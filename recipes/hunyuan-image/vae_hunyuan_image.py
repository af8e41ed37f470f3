"""AutoencoderKLConv3D, the HunyuanImage-3.0 VAE (16x spatial, 4x temporal, 32 latent channels).

DC-AE style: down / up sampling by pixel (un)shuffle around a 3x3x3 conv, with a parameter-free shortcut
(channel-group mean down, repeat-interleave up); the encoder output adds a channel-group-mean shortcut and the
decoder input a repeat-interleaved z. GroupNorm(32, eps 1e-6), swish, zero-padded Conv3d, a single-head attention
in the middle. An image is a 4-frame clip to this VAE: encode repeats it (latent T = 1), decode keeps the last frame.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from einops import rearrange
from torch import nn

from config_hunyuan_image import VAEConfig


def _norm(channels: int) -> nn.GroupNorm:
    return nn.GroupNorm(32, channels, eps=1e-6)


class ResnetBlock(nn.Module):
    def __init__(self, in_channels: int, out_channels: int):
        super().__init__()
        self.norm1, self.conv1 = _norm(in_channels), nn.Conv3d(in_channels, out_channels, 3, padding=1)
        self.norm2, self.conv2 = _norm(out_channels), nn.Conv3d(out_channels, out_channels, 3, padding=1)
        if in_channels != out_channels:
            self.nin_shortcut = nn.Conv3d(in_channels, out_channels, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [B, C, T, H, W]
        h = self.conv1(F.silu(self.norm1(x)))
        h = self.conv2(F.silu(self.norm2(h)))
        return (self.nin_shortcut(x) if hasattr(self, "nin_shortcut") else x) + h


class AttnBlock(nn.Module):
    def __init__(self, channels: int):
        super().__init__()
        self.norm = _norm(channels)
        self.q, self.k, self.v, self.proj_out = (nn.Conv3d(channels, channels, 1) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(x)
        B, C, T, H, W = x.shape
        q, k, v = (rearrange(m(h), "b c f h w -> b 1 (f h w) c") for m in (self.q, self.k, self.v))
        out = F.scaled_dot_product_attention(q, k, v)  # [B, 1, THW, C]
        return x + self.proj_out(rearrange(out, "b 1 (f h w) c -> b c f h w", f=T, h=H, w=W))


class DownsampleDCAE(nn.Module):
    def __init__(self, in_channels: int, out_channels: int, temporal: bool):
        super().__init__()
        factor = 8 if temporal else 4
        self.r1, self.group_size = (2 if temporal else 1), factor * in_channels // out_channels
        self.conv = nn.Conv3d(in_channels, out_channels // factor, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        unshuffle = "b c (f r1) (h r2) (w r3) -> b (r1 r2 r3 c) f h w"
        h = rearrange(self.conv(x), unshuffle, r1=self.r1, r2=2, r3=2)  # [B, Cout, T/r1, H/2, W/2]
        shortcut = rearrange(x, unshuffle, r1=self.r1, r2=2, r3=2)  # [B, Cin*factor, ...]
        return h + shortcut.unflatten(1, (h.shape[1], self.group_size)).mean(2)


class UpsampleDCAE(nn.Module):
    def __init__(self, in_channels: int, out_channels: int, temporal: bool):
        super().__init__()
        factor = 8 if temporal else 4
        self.r1, self.repeats = (2 if temporal else 1), factor * out_channels // in_channels
        self.conv = nn.Conv3d(in_channels, out_channels * factor, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shuffle = "b (r1 r2 r3 c) f h w -> b c (f r1) (h r2) (w r3)"
        h = rearrange(self.conv(x), shuffle, r1=self.r1, r2=2, r3=2)
        return h + rearrange(x.repeat_interleave(self.repeats, dim=1), shuffle, r1=self.r1, r2=2, r3=2)


def _mid(channels: int) -> nn.Module:
    mid = nn.Module()
    mid.block_1, mid.attn_1 = ResnetBlock(channels, channels), AttnBlock(channels)
    mid.block_2 = ResnetBlock(channels, channels)
    return mid


class Encoder(nn.Module):
    def __init__(self, cfg: VAEConfig):
        super().__init__()
        chans, spatial = cfg.block_out_channels, cfg.ffactor_spatial.bit_length() - 1
        temporal_from = spatial - (cfg.ffactor_temporal.bit_length() - 1)
        self.conv_in = nn.Conv3d(cfg.in_channels, chans[0], 3, padding=1)
        self.down, block_in = nn.ModuleList(), chans[0]
        for level, ch in enumerate(chans):
            down = nn.Module()
            down.block = nn.ModuleList()
            for _ in range(cfg.layers_per_block):
                down.block.append(ResnetBlock(block_in, ch))
                block_in = ch
            if level < spatial:
                down.downsample = DownsampleDCAE(block_in, chans[level + 1], temporal=level >= temporal_from)
                block_in = chans[level + 1]
            self.down.append(down)
        self.mid = _mid(block_in)
        self.norm_out = _norm(block_in)
        self.conv_out = nn.Conv3d(block_in, 2 * cfg.latent_channels, 3, padding=1)
        self.group_size = block_in // (2 * cfg.latent_channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [B, 3, T, H, W] -> moments [B, 2C, T/4, H/16, W/16]
        h = self.conv_in(x)
        for down in self.down:
            for block in down.block:
                h = block(h)
            if hasattr(down, "downsample"):
                h = down.downsample(h)
        h = self.mid.block_2(self.mid.attn_1(self.mid.block_1(h)))
        shortcut = h.unflatten(1, (-1, self.group_size)).mean(2)  # [B, 2C, ...]
        return self.conv_out(F.silu(self.norm_out(h))) + shortcut


class Decoder(nn.Module):
    def __init__(self, cfg: VAEConfig):
        super().__init__()
        chans = tuple(reversed(cfg.block_out_channels))
        spatial, temporal = cfg.ffactor_spatial.bit_length() - 1, cfg.ffactor_temporal.bit_length() - 1
        block_in = chans[0]
        self.repeats = block_in // cfg.latent_channels
        self.conv_in = nn.Conv3d(cfg.latent_channels, block_in, 3, padding=1)
        self.mid = _mid(block_in)
        self.up = nn.ModuleList()
        for level, ch in enumerate(chans):
            up = nn.Module()
            up.block = nn.ModuleList()
            for _ in range(cfg.layers_per_block + 1):
                up.block.append(ResnetBlock(block_in, ch))
                block_in = ch
            if level < spatial:
                up.upsample = UpsampleDCAE(block_in, chans[level + 1], temporal=level < temporal)
                block_in = chans[level + 1]
            self.up.append(up)
        self.norm_out = _norm(block_in)
        self.conv_out = nn.Conv3d(block_in, cfg.out_channels, 3, padding=1)

    def forward(self, z: torch.Tensor) -> torch.Tensor:  # [B, C, T, h, w] -> [B, 3, 4T, 16h, 16w]
        h = self.conv_in(z) + z.repeat_interleave(self.repeats, dim=1)
        h = self.mid.block_2(self.mid.attn_1(self.mid.block_1(h)))
        for up in self.up:
            for block in up.block:
                h = block(h)
            if hasattr(up, "upsample"):
                h = up.upsample(h)
        return self.conv_out(F.silu(self.norm_out(h)))


class AutoencoderKLConv3D(nn.Module):
    def __init__(self, cfg: VAEConfig):
        super().__init__()
        self.config = cfg
        self.encoder, self.decoder = Encoder(cfg), Decoder(cfg)

    @torch.no_grad()
    def encode(self, image: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
        """image [B, 3, H, W] in [-1, 1] -> scaled latents [B, C, H/16, W/16] (posterior mean if no generator)."""
        x = image[:, :, None].expand(-1, -1, self.config.ffactor_temporal, -1, -1)  # 4 frames -> latent T = 1
        mean, logvar = self.encoder(x).chunk(2, dim=1)  # [B, C, 1, h, w] each
        z = mean
        if generator is not None:
            std = torch.exp(0.5 * logvar.clamp(-30.0, 20.0))
            z = mean + std * torch.randn(mean.shape, generator=generator, dtype=mean.dtype)
        return z[:, :, 0] * self.config.scaling_factor

    @torch.no_grad()
    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """scaled latents [B, C, h, w] -> image [B, 3, 16h, 16w] in [-1, 1] (the last of the 4 decoded frames)."""
        z = (latents / self.config.scaling_factor)[:, :, None]  # [B, C, 1, h, w]
        return self.decoder(z)[:, :, -1].clamp(-1, 1)
