"""HunyuanVideo's 3D causal VAE, decode path: latents [B, 16, t, h, w] -> video [B, 3, 4(t-1)+1, 8h, 8w].

Module and tensor names are the publisher's (Tencent/HunyuanVideo hyvideo/vae: AutoencoderKLCausal3D,
DecoderCausal3D, UNetMidBlockCausal3D, UpDecoderBlockCausal3D, ResnetBlockCausal3D, UpsampleCausal3D,
CausalConv3d); diffusers' AutoencoderKLHunyuanVideo uses the same tensor names, so one file loads into both.
The config is the publisher's vae/config.json (AutoencoderKLCausal3D fields, `time_compression_ratio`).

- CausalConv3d: replicate padding, k // 2 on each spatial side and k - 1 frames before the first frame, none after.
- Up blocks: layers_per_block + 1 ResNet blocks (GroupNorm, SiLU, causal conv, twice; 1x1x1 shortcut when the
  channels change), then an upsampler: nearest 2x in space for block i < log2(spatial ratio), and 2x in time for
  the blocks before the last with i >= n - 1 - log2(time ratio); the first frame is only upsampled in space, so
  t latent frames become 2(t - 1) + 1.
- Mid block: ResNet, attention, ResNet. The attention is one head over all t*h*w positions with a frame-causal
  mask (a position sees every position of its own and earlier frames), as in the publisher's and diffusers' code;
  here it is computed frame by frame with common.ops.attention, so no [N, N] mask is built.

The encoder is not built: its tensors (and quant_conv) are in the publisher's file and are skipped at load.
decode() is the whole-frame decode; tiled_decode() gives the same result in spatial patches, one thread per
patch locally or one rank per patch (common.diffusion.vae_tiling / vae_parallel, exact: see there).

    python recipes/hunyuan-video/vae_hunyuan_video.py weights/hunyuan-video-vae-tiny   # writes a tiny VAE
"""
from __future__ import annotations

import dataclasses
import math
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from common import ops
from common.diffusion.vae_parallel import patch_parallel_decode
from common.diffusion.vae_tiling import exact_tiled_decode
from common.loader import Checkpoint, load_weights, save_checkpoint

UP_BLOCK, DOWN_BLOCK = "UpDecoderBlockCausal3D", "DownEncoderBlockCausal3D"


@dataclass(frozen=True)
class VAEConfig:
    """The publisher's vae/config.json fields (AutoencoderKLCausal3D); defaults are the released 884-16c-hy VAE."""

    in_channels: int = 3
    out_channels: int = 3
    latent_channels: int = 16
    block_out_channels: tuple[int, ...] = (128, 256, 512, 512)
    layers_per_block: int = 2
    norm_num_groups: int = 32
    act_fn: str = "silu"
    down_block_types: tuple[str, ...] = (DOWN_BLOCK,) * 4
    up_block_types: tuple[str, ...] = (UP_BLOCK,) * 4
    scaling_factor: float = 0.476986
    time_compression_ratio: int = 4
    spatial_compression_ratio: int = 8
    mid_block_add_attention: bool = True
    sample_size: int = 256  # the publisher's tiling sizes (pixels, frames); unused here
    sample_tsize: int = 64

    def __post_init__(self):
        object.__setattr__(self, "block_out_channels", tuple(int(c) for c in self.block_out_channels))
        object.__setattr__(self, "down_block_types", tuple(self.down_block_types))
        object.__setattr__(self, "up_block_types", tuple(self.up_block_types))
        n, s = len(self.block_out_channels), self.spatial_compression_ratio
        checks = [
            (n >= 2, f"block_out_channels {self.block_out_channels}: at least 2 blocks"),
            (all(c > 0 and c % self.norm_num_groups == 0 for c in self.block_out_channels),
             f"block_out_channels {self.block_out_channels}: multiples of norm_num_groups {self.norm_num_groups}"),
            (self.up_block_types == (UP_BLOCK,) * n, f"up_block_types must be {n} x {UP_BLOCK!r}"),
            (self.act_fn == "silu", f"act_fn {self.act_fn!r}: only 'silu'"),
            (self.time_compression_ratio == 4, f"time_compression_ratio {self.time_compression_ratio}: only 4"),
            (s >= 2 and s & (s - 1) == 0 and int(math.log2(s)) <= n,
             f"spatial_compression_ratio {s}: a power of 2 with log2 <= {n} (one 2x per up block)"),
            (self.layers_per_block >= 1, "layers_per_block must be >= 1"),
            (min(self.in_channels, self.out_channels, self.latent_channels) >= 1, "channel counts must be >= 1"),
            (self.scaling_factor > 0, "scaling_factor must be > 0"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(f"VAEConfig: {message}")

    @classmethod
    def from_dict(cls, d: dict) -> VAEConfig:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(k for k in d if k not in known and not k.startswith("_"))
        if unknown:
            raise ValueError(f"VAEConfig: unknown fields {unknown}")
        return cls(**{k: v for k, v in d.items() if k in known})

    def to_dict(self) -> dict:
        return {"_class_name": "AutoencoderKLCausal3D", **dataclasses.asdict(self)}

    def upsample_factors(self) -> list[tuple[int, int, int] | None]:
        """Per up block: (t, h, w) nearest-upsampling factors, or None (no upsampler)."""
        n = len(self.block_out_channels)
        spatial, temporal = int(math.log2(self.spatial_compression_ratio)), int(math.log2(self.time_compression_ratio))
        out = []
        for i in range(n):
            up_hw = i < spatial
            up_t = i >= n - 1 - temporal and i != n - 1
            out.append((2 if up_t else 1, 2 if up_hw else 1, 2 if up_hw else 1) if up_hw or up_t else None)
        return out


class CausalConv3d(nn.Module):
    """Conv3d after replicate padding: k // 2 on each side of h and w, k - 1 frames before the first frame."""

    def __init__(self, chan_in: int, chan_out: int, kernel_size: int, stride: int | tuple = 1,
                 pad_mode: str = "replicate"):
        super().__init__()
        self.pad_mode = pad_mode
        self.time_causal_padding = (kernel_size // 2,) * 4 + (kernel_size - 1, 0)  # (w, w, h, h, t, t) for F.pad
        self.conv = nn.Conv3d(chan_in, chan_out, kernel_size, stride=stride)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [B, Ci, T, H, W] -> [B, Co, T, H, W] (stride 1)
        return self.conv(F.pad(x, self.time_causal_padding, mode=self.pad_mode))


class ResnetBlockCausal3D(nn.Module):
    def __init__(self, in_channels: int, out_channels: int, groups: int, eps: float = 1e-6):
        super().__init__()
        self.norm1 = nn.GroupNorm(groups, in_channels, eps=eps)
        self.conv1 = CausalConv3d(in_channels, out_channels, 3)
        self.norm2 = nn.GroupNorm(groups, out_channels, eps=eps)
        self.conv2 = CausalConv3d(out_channels, out_channels, 3)
        self.conv_shortcut = CausalConv3d(in_channels, out_channels, 1) if in_channels != out_channels else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [B, Ci, T, H, W] -> [B, Co, T, H, W]
        h = self.conv1(F.silu(self.norm1(x), inplace=True))  # SiLU in place on the fresh norm output
        h = self.norm2(h)  # rebinding h frees each intermediate as soon as the next exists
        h = self.conv2(F.silu(h, inplace=True))
        return h.add_(x if self.conv_shortcut is None else self.conv_shortcut(x))


class Attention(nn.Module):
    """Mid-block self-attention over all positions, frame-causal; GroupNorm in front, residual added."""

    def __init__(self, channels: int, head_dim: int, groups: int, eps: float = 1e-6):
        super().__init__()
        self.heads, self.head_dim = channels // head_dim, head_dim
        self.group_norm = nn.GroupNorm(groups, channels, eps=eps)
        self.to_q, self.to_k, self.to_v = (nn.Linear(channels, channels) for _ in range(3))
        self.to_out = nn.ModuleList([nn.Linear(channels, channels), nn.Dropout(0.0)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [B, C, T, H, W]
        return self.forward_region(x, slice(None), slice(None))

    def forward_region(self, x: torch.Tensor, rows: slice, cols: slice) -> torch.Tensor:
        """forward(x)[..., rows, cols], computing only those queries (keys: every position of x).
        x [B, C, T, H, W] -> [B, C, T, h, w] for the h x w region."""
        B, C, T, H, W = x.shape
        normed = self.group_norm(x)
        tokens = normed.flatten(2).transpose(1, 2)  # [B, T*H*W, C], frame-major
        k, v = (p(tokens).view(B, T * H * W, self.heads, self.head_dim) for p in (self.to_k, self.to_v))
        x = x[..., rows, cols]
        h, w = x.shape[-2:]
        hw = h * w
        q = self.to_q(normed[..., rows, cols].flatten(2).transpose(1, 2)).view(B, T * hw, self.heads, self.head_dim)
        out = torch.empty_like(q)  # [B, T*h*w, heads, D]
        cu_q = torch.arange(B + 1, dtype=torch.int32, device=x.device) * hw
        for t in range(T):  # frame t's queries see frames 0..t: one packed call per frame, batches as sequences
            n = (t + 1) * H * W
            qt = q[:, t * hw:(t + 1) * hw].reshape(B * hw, self.heads, self.head_dim)  # [B*h*w, heads, D]
            kt, vt = (a[:, :n].reshape(B * n, self.heads, self.head_dim) for a in (k, v))  # [B*n, heads, D]
            cu_k = torch.arange(B + 1, dtype=torch.int32, device=x.device) * n
            out[:, t * hw:(t + 1) * hw] = ops.attention(qt, kt, vt, cu_q, cu_k, self.head_dim ** -0.5,
                                                        causal=False).view(B, hw, self.heads, self.head_dim)
        out = self.to_out[0](out.flatten(2))  # [B, T*h*w, C]
        return x + out.transpose(1, 2).reshape(B, C, T, h, w)


class UNetMidBlockCausal3D(nn.Module):
    def __init__(self, channels: int, groups: int, add_attention: bool):
        super().__init__()
        self.resnets = nn.ModuleList([ResnetBlockCausal3D(channels, channels, groups) for _ in range(2)])
        self.attentions = nn.ModuleList([Attention(channels, channels, groups)] if add_attention else [])

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [B, C, T, H, W]
        x = self.resnets[0](x)
        for attn in self.attentions:
            x = attn(x)
        return self.resnets[1](x)


class UpsampleCausal3D(nn.Module):
    """Nearest upsampling by (t, h, w) factors, the first frame in space only; then a causal 3x3x3 conv."""

    def __init__(self, channels: int, upsample_factor: tuple[int, int, int]):
        super().__init__()
        self.upsample_factor = upsample_factor
        self.conv = CausalConv3d(channels, channels, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [B, C, T, H, W] -> [B, C, ft(T-1)+1, fh H, fw W]
        first = F.interpolate(x[:, :, 0], scale_factor=self.upsample_factor[1:], mode="nearest")  # [B, C, fh H, fw W]
        if x.shape[2] > 1:  # the upsampled rest is a temporary: only the concatenation stays alive for the conv
            x = torch.cat([first[:, :, None], F.interpolate(x[:, :, 1:].contiguous(), scale_factor=self.upsample_factor,
                                                            mode="nearest")], dim=2)
        else:
            x = first[:, :, None]
        return self.conv(x)


class UpDecoderBlockCausal3D(nn.Module):
    def __init__(self, in_channels: int, out_channels: int, num_layers: int, groups: int,
                 upsample_factor: tuple[int, int, int] | None):
        super().__init__()
        self.resnets = nn.ModuleList([ResnetBlockCausal3D(in_channels if i == 0 else out_channels, out_channels, groups)
                                      for i in range(num_layers)])
        self.upsamplers = nn.ModuleList([UpsampleCausal3D(out_channels, upsample_factor)]) if upsample_factor else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for resnet in self.resnets:
            x = resnet(x)
        for upsampler in self.upsamplers or ():
            x = upsampler(x)
        return x


class DecoderCausal3D(nn.Module):
    def __init__(self, cfg: VAEConfig):
        super().__init__()
        channels, groups = list(reversed(cfg.block_out_channels)), cfg.norm_num_groups
        self.conv_in = CausalConv3d(cfg.latent_channels, channels[0], 3)
        self.mid_block = UNetMidBlockCausal3D(channels[0], groups, cfg.mid_block_add_attention)
        self.up_blocks = nn.ModuleList([
            UpDecoderBlockCausal3D(channels[max(i - 1, 0)], channels[i], cfg.layers_per_block + 1, groups, factor)
            for i, factor in enumerate(cfg.upsample_factors())])
        self.conv_norm_out = nn.GroupNorm(groups, channels[-1], eps=1e-6)
        self.conv_out = CausalConv3d(channels[-1], cfg.out_channels, 3)

    def forward(self, z: torch.Tensor) -> torch.Tensor:  # [B, Cz, t, h, w] -> [B, 3, T, H, W]
        x = self.mid_block(self.conv_in(z))
        for block in self.up_blocks:
            x = block(x)
        return self.conv_out(F.silu(self.conv_norm_out(x)))


class AutoencoderKLCausal3D(nn.Module):
    """The decode half of the publisher's AutoencoderKLCausal3D: post_quant_conv, then the causal decoder."""

    def __init__(self, cfg: VAEConfig):
        super().__init__()
        self.config = cfg
        self.decoder = DecoderCausal3D(cfg)
        self.post_quant_conv = nn.Conv3d(cfg.latent_channels, cfg.latent_channels, 1)

    def _decode(self, z: torch.Tensor) -> torch.Tensor:
        return self.decoder(self.post_quant_conv(z))

    def decode(self, z: torch.Tensor) -> torch.Tensor:
        """z [B, latent_channels, t, h, w] (already divided by scaling_factor) -> [B, 3, 4(t-1)+1, s*h, s*w]."""
        if z.ndim != 5 or z.shape[1] != self.config.latent_channels:
            raise ValueError(f"decode: expected latents [B, {self.config.latent_channels}, t, h, w], "
                             f"got {list(z.shape)}")
        return self._decode(z)

    def tiled_decode(self, z: torch.Tensor, group=None, tile: int = 32) -> torch.Tensor:
        """decode(z), computed in spatial patches with the same result (exact halos and GroupNorm statistics).
        group None: patches of at most tile x tile latents, one at a time on this device; a process group: one
        patch per rank of the group, every rank returns the whole video."""
        if z.ndim != 5 or z.shape[1] != self.config.latent_channels:
            raise ValueError(f"tiled_decode: expected latents [B, {self.config.latent_channels}, t, h, w], "
                             f"got {list(z.shape)}")
        if group is None:
            return exact_tiled_decode(self, self._decode, z, (Attention,), tile=tile)
        return patch_parallel_decode(self, self._decode, z, group, (Attention,))


def _publisher_name(name: str) -> str | None:
    """Checkpoint name -> our parameter name; the encoder's tensors and quant_conv are skipped."""
    name = name.removeprefix("vae.")
    return None if name.startswith(("encoder.", "quant_conv.")) else name


def diffusers_config(cfg: VAEConfig) -> dict:
    """AutoencoderKLHunyuanVideo(**kwargs) for the same VAE; its tensor names are the publisher's (no renames)."""
    n = len(cfg.block_out_channels)
    return dict(in_channels=cfg.in_channels, out_channels=cfg.out_channels, latent_channels=cfg.latent_channels,
                down_block_types=("HunyuanVideoDownBlock3D",) * n, up_block_types=("HunyuanVideoUpBlock3D",) * n,
                block_out_channels=cfg.block_out_channels, layers_per_block=cfg.layers_per_block, act_fn=cfg.act_fn,
                norm_num_groups=cfg.norm_num_groups, scaling_factor=cfg.scaling_factor,
                spatial_compression_ratio=cfg.spatial_compression_ratio,
                temporal_compression_ratio=cfg.time_compression_ratio,
                mid_block_add_attention=cfg.mid_block_add_attention)


def load_vae(path: str | Path, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"
             ) -> AutoencoderKLCausal3D:
    """The decoder from a publisher-named VAE folder (config.json + safetensors), built without an init pass
    straight on `device` (load_weights fills every tensor or raises)."""
    ckpt = Checkpoint(path)
    cfg = VAEConfig.from_dict(ckpt.config)
    with torch.device("meta"):
        model = AutoencoderKLCausal3D(cfg)
    model = model.to_empty(device=device).to(dtype)
    load_weights(model, ckpt, rename=_publisher_name)
    ckpt.close()
    return model.eval()


TINY_CONFIG = VAEConfig(block_out_channels=(8, 16, 16), layers_per_block=1, norm_num_groups=4, sample_size=64,
                        sample_tsize=8, down_block_types=(DOWN_BLOCK,) * 3, up_block_types=(UP_BLOCK,) * 3)


def _encoder_shapes(cfg: VAEConfig) -> dict[str, torch.Size]:
    """The publisher's EncoderCausal3D tensor names and shapes (the tiny file carries them like the real one)."""
    ch, groups, n = cfg.block_out_channels, cfg.norm_num_groups, len(cfg.block_out_channels)
    spatial, temporal = int(math.log2(cfg.spatial_compression_ratio)), int(math.log2(cfg.time_compression_ratio))
    with torch.device("meta"):
        enc = nn.Module()
        enc.conv_in = CausalConv3d(cfg.in_channels, ch[0], 3)
        enc.down_blocks = nn.ModuleList()
        for i in range(n):
            block = nn.Module()
            block.resnets = nn.ModuleList([ResnetBlockCausal3D(ch[max(i - 1, 0)] if j == 0 else ch[i], ch[i], groups)
                                           for j in range(cfg.layers_per_block)])
            down_hw, down_t = i < spatial, i >= n - 1 - temporal and i != n - 1
            if down_hw or down_t:
                block.downsamplers = nn.ModuleList([nn.Module()])
                stride = (2 if down_t else 1, 2 if down_hw else 1, 2 if down_hw else 1)
                block.downsamplers[0].conv = CausalConv3d(ch[i], ch[i], 3, stride=stride)
            enc.down_blocks.append(block)
        enc.mid_block = UNetMidBlockCausal3D(ch[-1], groups, cfg.mid_block_add_attention)
        enc.conv_norm_out = nn.GroupNorm(groups, ch[-1])
        enc.conv_out = CausalConv3d(ch[-1], 2 * cfg.latent_channels, 3)
        quant_conv = nn.Conv3d(2 * cfg.latent_channels, 2 * cfg.latent_channels, 1)
    shapes = {f"encoder.{k}": v.shape for k, v in enc.state_dict().items()}
    return shapes | {f"quant_conv.{k}": v.shape for k, v in quant_conv.state_dict().items()}


def write_tiny_vae(path: str | Path, seed: int = 0, cfg: VAEConfig = TINY_CONFIG) -> Path:
    """A random VAE in the publisher's format: config.json + model.safetensors with encoder and decoder tensors.
    Default PyTorch init for convs / linears, GroupNorm affine drawn around (1, 0) so it matters."""
    g = torch.Generator().manual_seed(seed)
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = AutoencoderKLCausal3D(cfg)
    tensors = model.state_dict()
    for prefix, m in model.named_modules():
        if isinstance(m, nn.GroupNorm):
            tensors[f"{prefix}.weight"] = 1.0 + 0.1 * torch.randn(m.weight.shape, generator=g)
            tensors[f"{prefix}.bias"] = 0.1 * torch.randn(m.bias.shape, generator=g)
    for name, shape in _encoder_shapes(cfg).items():
        tensors[name] = 0.05 * torch.randn(shape, generator=g)
    return save_checkpoint(path, tensors, cfg.to_dict())


if __name__ == "__main__":
    print(write_tiny_vae(sys.argv[1] if len(sys.argv) > 1 else "weights/hunyuan-video-vae-tiny"))
