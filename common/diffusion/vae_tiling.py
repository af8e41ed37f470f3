"""Tiled VAE decode, two ways.

exact_tiled_decode: the decode of the whole frame, computed patch by patch on one device and equal to it within
fp32 rounding. It is the patch executor of vae_parallel.py (halo'd convs, whole-frame GroupNorm statistics, the
global modules run once on the gathered frame) with the patches held locally: one thread per patch, and a turn
token so that only one patch computes at a time (the others wait at the next exchange). GroupNorm statistics are
combined over the local patches (count, mean, M2 per patch, Chan's formula in fp64), exactly as the ranks combine
them in patch-parallel decode.

Memory: the patches advance layer by layer together (GroupNorm needs every patch's statistics before any patch
goes on), so between exchanges the live activations add up to the whole frame's, as untiled. What tiling bounds
is each op's transient working set: the conv's padded input copy (built after the halo exchange, for one patch at
a time), the conv workspace and the output being written, GroupNorm's fp32 temporaries. At the largest conv the
peak drops from input + padded copy + output of the whole frame to input + output of the whole frame plus one
patch's padded copy. Measured (live tensor bytes, a (32, 64, 128, 128)-channel decoder, latent 2 x 16 x 16 ->
5 x 128 x 128, fp32): untiled 82 MB, 2 x 2 patches 55 MB, 4 x 4 patches 47 MB. It does not make a whole 720p
129-frame video fit one device (two whole-frame 256-channel activations at 720p are about 120 GB in bf16): that
needs patch-parallel decode over several devices (vae_parallel.py: each rank holds 1/P), or the blended scheme.

tiled_decode: the diffusers-style scheme for a decoder seen as a black box: overlapping latent tiles decoded
independently, blended linearly, cropped. Peak memory follows the tile, but it is not exact: each tile's
GroupNorm statistics and attention see only the tile, and its convs see padding at tile edges; the blend hides
the seams (error measured in tests/diffusion/test_vae_tiling.py). Use it for decoders whose modules
exact_tiled_decode cannot patch, or when only a tile's working set fits the device and exactness can go.
"""
from __future__ import annotations

import threading
from collections.abc import Callable

import torch
from torch import nn

from .vae_parallel import PatchComm, PatchGrid, patch_ops, run_patch


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


class _LocalHub:
    """What the patch threads share: a barrier, a mailbox and the turn token (who may compute now)."""

    def __init__(self, n: int):
        self.barrier = threading.Barrier(n)
        self.turn = threading.Lock()
        self.lock = threading.Lock()
        self.mailbox: dict[tuple, object] = {}

    def wait(self) -> None:
        """Give up the turn, wait for every patch, take a turn again."""
        self.turn.release()
        try:
            self.barrier.wait()
        finally:
            self.turn.acquire()


class LocalPatchComm(PatchComm):
    """Patch `index` of a grid whose patches are threads of this process (see exact_tiled_decode)."""

    def __init__(self, hub: _LocalHub, grid: PatchGrid, index: int):
        self.hub, self.grid, self.index, self.seq = hub, grid, index, 0

    def _round(self, posts: dict, reads: list) -> dict:
        """Post, wait for all, read, wait for all (so nothing is read after it is dropped), drop own posts."""
        key = self.seq
        self.seq += 1
        with self.hub.lock:
            self.hub.mailbox.update({(key, *k): v for k, v in posts.items()})
        self.hub.wait()
        with self.hub.lock:
            got = {k: self.hub.mailbox[(key, *k)] for k in reads}
        self.hub.wait()
        with self.hub.lock:
            for k in posts:
                del self.hub.mailbox[(key, *k)]
        return got

    def exchange(self, sends, recvs, like):
        got = self._round({(self.index, j): t for j, t in sends.items()}, [(j, self.index) for j in recvs])
        return {j: got[(j, self.index)] for j in recvs}

    def all_gather(self, x, shapes):
        got = self._round({(self.index,): x}, [(j,) for j in range(self.grid.size)])
        return [got[(j,)] for j in range(self.grid.size)]

    def gather_apply(self, x, whole, part):
        parts = self.all_gather(x, [])
        out = whole(self.grid.assemble(parts)) if self.index == 0 else None  # once for all patches
        rows, cols = self.grid.region_like(x, self.index)
        return self.all_gather(out, [])[0][..., rows, cols]


def exact_tiled_decode(model: nn.Module, fn: Callable[[torch.Tensor], torch.Tensor], z: torch.Tensor,
                       global_modules: tuple[type, ...], tile: int = 32) -> torch.Tensor:
    """fn(z), computed in spatial patches of at most tile x tile latents with the same result. z [.., h, w];
    model: the module tree fn runs (its padded convs, GroupNorms and global_modules are swapped, see
    vae_parallel.patch_ops)."""
    grid = PatchGrid.for_tile(z.shape[-2], z.shape[-1], tile)
    if grid.size == 1:
        with torch.no_grad():
            return fn(z)
    hub, patches = _LocalHub(grid.size), grid.split(z)
    outputs: list[torch.Tensor | None] = [None] * grid.size
    errors: list[BaseException] = []

    def work(i: int) -> None:
        hub.turn.acquire()
        try:
            if z.device.type != "cpu":  # a new thread starts on device 0: bind it to the latents' device
                getattr(torch, z.device.type).set_device(z.device)
            outputs[i] = run_patch(fn, patches[i].contiguous(), LocalPatchComm(hub, grid, i))
        except BaseException as e:  # wake the others: their next wait raises BrokenBarrierError
            errors.append(e)
            hub.barrier.abort()
        finally:
            hub.turn.release()

    with patch_ops(model, global_modules):
        threads = [threading.Thread(target=work, args=(i,), name=f"vae-patch-{i}") for i in range(grid.size)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    if errors:
        raise next((e for e in errors if not isinstance(e, threading.BrokenBarrierError)), errors[0])
    return grid.assemble(outputs)
