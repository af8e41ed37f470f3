"""Spatially tiled VAE decode: decode overlapping latent tiles one at a time, blend the overlaps, crop.

Peak memory follows the tile, not the frame. Tiles cover the latent's last two dims (h, w) with stride
tile - overlap; each decoded tile is blended linearly into the tiles above and to its left over overlap * scale
output pixels (the same scheme as diffusers' tiled_decode), then cropped to the stride. Time is not tiled.

Tiled != untiled in general: a decoder's GroupNorm statistics and mid-block attention span the whole frame, and
its convolutions see zero padding at tile edges. The blend hides the seams; the error is measured in
tests/diffusion/test_vae_tiling.py. A decoder whose output pixel depends only on nearby latents (within the
overlap) gives the untiled result exactly in the interior of the blends, and exactly everywhere when pointwise.
"""
from __future__ import annotations

from collections.abc import Callable

import torch


def _ramp(n: int, like: torch.Tensor) -> torch.Tensor:
    return torch.arange(n, device=like.device, dtype=like.dtype) / n  # [n]: 0, 1/n, ..., (n-1)/n


def _blend(prev: torch.Tensor, cur: torch.Tensor, extent: int, dim: int) -> torch.Tensor:
    """cur's first `extent` rows along dim fade in over prev's last `extent` rows (a new tensor)."""
    extent = min(extent, prev.shape[dim], cur.shape[dim])
    if extent == 0:
        return cur
    shape = [1] * cur.ndim
    shape[dim] = extent
    w = _ramp(extent, cur).view(shape)  # weight of cur
    head = prev.narrow(dim, prev.shape[dim] - extent, extent) * (1 - w) + cur.narrow(dim, 0, extent) * w
    return torch.cat([head, cur.narrow(dim, extent, cur.shape[dim] - extent)], dim=dim)


def tiled_decode(decode: Callable[[torch.Tensor], torch.Tensor], z: torch.Tensor, tile: int = 32,
                 overlap: int = 8, scale: int = 8) -> torch.Tensor:
    """decode(z) computed tile by tile. z [..., h, w] latents (e.g. [B, C, T, h, w]); decode maps a latent tile
    [..., th, tw] to pixels [..., th * scale, tw * scale] (other dims as decode makes them). tile, overlap: latent
    sizes, 0 <= overlap < tile. A latent no larger than one tile is decoded whole.
    """
    if not 0 <= overlap < tile:
        raise ValueError(f"tiled_decode: need 0 <= overlap ({overlap}) < tile ({tile})")
    h, w = z.shape[-2:]
    if h <= tile and w <= tile:
        return decode(z)
    stride, blend, out_stride = tile - overlap, overlap * scale, (tile - overlap) * scale
    starts_h = range(0, max(h - overlap, 1), stride)  # a last tile that would be all overlap is not decoded
    starts_w = range(0, max(w - overlap, 1), stride)
    rows = [[decode(z[..., i:i + tile, j:j + tile]) for j in starts_w] for i in starts_h]  # [..., th*s, tw*s]
    out_rows = []
    for r, row in enumerate(rows):
        pieces = []
        for c, piece in enumerate(row):
            if r > 0:
                piece = _blend(rows[r - 1][c], piece, blend, dim=-2)
            if c > 0:
                piece = _blend(row[c - 1], piece, blend, dim=-1)
            keep_h = None if r == len(rows) - 1 else out_stride  # the last row / column keeps its whole tile
            keep_w = None if c == len(row) - 1 else out_stride
            pieces.append(piece[..., :keep_h, :keep_w])
        out_rows.append(torch.cat(pieces, dim=-1))
    return torch.cat(out_rows, dim=-2)[..., :h * scale, :w * scale]
