"""Exact patch decode of a convolutional VAE: the latent frame is cut into a grid of spatial patches, each patch
runs the unmodified decoder, and the result equals the whole-frame decode (to fp32 rounding).

One executor serves two cases: patch-parallel decode (one patch per rank of a process group, this module) and
tiled decode on one device (patches held locally, one thread each, run one at a time: vae_tiling.py). Inside
`patch_ops(model, global_modules)` the forwards of three kinds of module are swapped; everything else in the
decoder (SiLU, residual adds, nearest upsampling, 1x1 convs, linears over channels) is local to a position, so
it runs on the patch as is.

- Padded convs (the CausalConv3d convention of HunyuanVideo's publisher and diffusers: a module with `conv`, a
  Conv3d of stride 1 without padding, `time_causal_padding` (w, w, h, h, t, t) and `pad_mode`): the patch gets a
  halo of the neighbouring patches' edge rows / cols (kernel // 2 of them), exchanged first along w, then along h
  with the w halos attached, so the corners come from the diagonal neighbours. At the frame's border the patch is
  padded as the whole frame would be (replicate or zeros); time is padded locally (patches span all frames). Only
  the edges travel; the padded input is built once, after the exchanges, and the conv runs on this patch only.
  It sees exactly the input the whole-frame conv sees there.
- GroupNorm: the statistics are the whole frame's. Each patch computes, per (batch, group), its element count,
  mean and sum of squared deviations from that mean (torch.var_mean, fp32); the patches' triples are gathered
  (all_gather across ranks, or a list of the local patches) and combined in fp64 with Chan's parallel formula
  (mean = sum n_i m_i / n; M2 = sum M2_i + n_i (m_i - mean)^2), then each patch normalises itself. No
  sum-of-squares cancellation, so the result matches torch's GroupNorm over the whole frame to rounding.
- Global modules (the types given, e.g. the mid-block attention, which mixes all positions): the patches are
  gathered into the whole frame and each patch takes its own region of the module's output. Tiled, the module runs
  once on the frame; parallel, each rank computes only its region's outputs when the module has
  `forward_region(frame, rows, cols)` (attention: only those queries, keys from the whole frame), else runs it
  whole. This happens at the decoder's lowest resolution, where the frame is smallest; inside, the other swaps
  are off.

A conv with a spatial kernel > 1 that is not such a padded conv (inside a global module excepted) raises at
entry rather than run wrong. Not covered: spatially strided convs, non-nearest interpolation, reflect padding.

Exactness: the swapped ops compute the whole frame's values, so patches differ from the untiled decode only by
summation order (max |diff| about 5e-6 on outputs of magnitude 1 in fp32, tests hold 1e-4; bf16 within one ulp).
Memory: patch-parallel holds 1/P of every activation per rank, plus the gathered frame at the mid block (the
lowest resolution); every rank ends with the whole (3-channel) output.
"""
from __future__ import annotations

import abc
import functools
import math
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from common import parallel

PAD_MODES = {"replicate": "replicate", "constant": "zeros", "zeros": "zeros"}


@dataclass(frozen=True)
class PatchGrid:
    """A latent frame [.., h, w] cut into rows x cols patches of near-equal size; patch i is row i // cols."""

    h: int
    w: int
    rows: int
    cols: int

    def __post_init__(self):
        if not (1 <= self.rows <= self.h and 1 <= self.cols <= self.w):
            raise ValueError(f"PatchGrid: {self.rows} x {self.cols} patches do not fit a {self.h} x {self.w} latent")

    @classmethod
    def for_tile(cls, h: int, w: int, tile: int) -> PatchGrid:
        """Patches of at most tile x tile latents."""
        if tile < 1:
            raise ValueError(f"tile {tile}: must be >= 1")
        return cls(h, w, math.ceil(h / tile), math.ceil(w / tile))

    @classmethod
    def for_ranks(cls, h: int, w: int, n: int) -> PatchGrid:
        """n patches, the factorisation rows x cols = n whose patches are closest to square."""
        shapes = [(r, n // r) for r in range(1, n + 1) if n % r == 0 and r <= h and n // r <= w]
        if not shapes:
            raise ValueError(f"PatchGrid: a {h} x {w} latent cannot be cut into {n} patches")
        return cls(h, w, *min(shapes, key=lambda rc: abs(math.log((h / rc[0]) / (w / rc[1])))))

    @property
    def size(self) -> int:
        return self.rows * self.cols

    def _bounds(self, n: int, parts: int, i: int) -> tuple[int, int]:
        return i * n // parts, (i + 1) * n // parts

    def region(self, index: int) -> tuple[slice, slice]:
        """Patch `index`'s latent rows and cols."""
        r, c = divmod(index, self.cols)
        return slice(*self._bounds(self.h, self.rows, r)), slice(*self._bounds(self.w, self.cols, c))

    def extent(self, index: int) -> tuple[int, int]:
        rows, cols = self.region(index)
        return rows.stop - rows.start, cols.stop - cols.start

    def neighbour(self, index: int, dim: int, step: int) -> int | None:
        """The patch `step` (+-1) away along dim (-2: h, -1: w), or None past the frame's border."""
        r, c = divmod(index, self.cols)
        r, c = (r + step, c) if dim == -2 else (r, c + step)
        return r * self.cols + c if 0 <= r < self.rows and 0 <= c < self.cols else None

    def split(self, x: torch.Tensor) -> list[torch.Tensor]:
        """[.., h, w] -> every patch [.., h_i, w_i] (views)."""
        return [x[..., rows, cols] for rows, cols in map(self.region, range(self.size))]

    def assemble(self, patches: list[torch.Tensor]) -> torch.Tensor:
        """Patches [.., h_i * s, w_i * s] (any common scale s) in index order -> the frame [.., h * s, w * s]."""
        rows = [torch.cat(patches[r * self.cols:(r + 1) * self.cols], dim=-1) for r in range(self.rows)]
        return torch.cat(rows, dim=-2)

    def scale(self, x: torch.Tensor, index: int) -> int:
        """How many times x, patch `index` at some layer, is upsampled from its latents."""
        h, w = self.extent(index)
        s = x.shape[-2] // h
        if s * h != x.shape[-2] or s * w != x.shape[-1]:
            raise ValueError(f"patch {index} of {h} x {w} latents has spatial size {tuple(x.shape[-2:])}: "
                             "not an integer upsampling")
        return s

    def shapes_like(self, x: torch.Tensor, index: int) -> list[torch.Size]:
        """Every patch's shape at x's resolution, x being patch `index`."""
        s = self.scale(x, index)
        return [torch.Size((*x.shape[:-2], eh * s, ew * s)) for eh, ew in map(self.extent, range(self.size))]

    def region_like(self, x: torch.Tensor, index: int) -> tuple[slice, slice]:
        """Patch `index`'s rows and cols in the whole frame at x's resolution, x being that patch."""
        s, (rows, cols) = self.scale(x, index), self.region(index)
        return slice(rows.start * s, rows.stop * s), slice(cols.start * s, cols.stop * s)


class PatchComm(abc.ABC):
    """What one patch needs from the others. Every patch calls the same methods in the same order."""

    grid: PatchGrid
    index: int

    @abc.abstractmethod
    def exchange(self, sends: dict[int, torch.Tensor], recvs: dict[int, torch.Size],
                 like: torch.Tensor) -> dict[int, torch.Tensor]:
        """Send sends[j] to patch j; receive a tensor of shape recvs[j] (like's dtype and device) from patch j."""

    @abc.abstractmethod
    def all_gather(self, x: torch.Tensor, shapes: list[torch.Size]) -> list[torch.Tensor]:
        """Every patch's x (patch j's has shape shapes[j]), in index order."""

    def gather_apply(self, x: torch.Tensor, whole: Callable[[torch.Tensor], torch.Tensor],
                     part: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """This patch's output of a module that needs the whole frame (assembled from every patch's x):
        part(frame) computes only this patch's output. (Local patches instead run whole(frame) once and crop.)"""
        return part(self.grid.assemble(self.all_gather(x, self.grid.shapes_like(x, self.index))))


class DistPatchComm(PatchComm):
    """One patch per rank of `group` (patch index = rank in the group): P2P halos, all_gather for the rest."""

    def __init__(self, group: dist.ProcessGroup | None, grid: PatchGrid):
        self.group, self.grid, self.index = group, grid, parallel.group_rank(group)
        if grid.size != parallel.group_size(group):
            raise ValueError(f"{grid.size} patches for {parallel.group_size(group)} ranks")

    def _peer(self, j: int) -> int:
        return j if self.group is None else dist.get_global_rank(self.group, j)

    def exchange(self, sends, recvs, like):
        out = {j: like.new_empty(shape) for j, shape in recvs.items()}
        ops = [dist.P2POp(dist.isend, t.contiguous(), self._peer(j), self.group) for j, t in sends.items()]
        ops += [dist.P2POp(dist.irecv, out[j], self._peer(j), self.group) for j in recvs]
        if ops:
            for req in dist.batch_isend_irecv(ops):
                req.wait()
        return out

    def all_gather(self, x, shapes):
        if self.grid.size == 1:
            return [x]
        longest = max(math.prod(s) for s in shapes)
        flat = F.pad(x.reshape(-1), (0, longest - x.numel()))  # [longest]: equal sizes for the collective
        parts = parallel.all_gather(flat[None], self.group, dim=0)  # [P, longest]
        return [parts[j, :math.prod(s)].view(s) for j, s in enumerate(shapes)]


class _PatchState(threading.local):
    comm: PatchComm | None = None
    suspended: bool = False


_state = _PatchState()


def _active() -> PatchComm | None:
    return None if _state.suspended else _state.comm


def run_patch(fn: Callable[[torch.Tensor], torch.Tensor], z: torch.Tensor, comm: PatchComm) -> torch.Tensor:
    """fn(z) for this patch's latents z, the swapped modules talking through comm (call inside patch_ops)."""
    _state.comm, _state.suspended = comm, False
    try:
        with torch.no_grad():
            return fn(z)
    finally:
        _state.comm = None


def _border(edge: torch.Tensor, dim: int, n: int, mode: str) -> torch.Tensor:
    """n rows of padding along dim beyond the frame's border, next to `edge` (the frame's outermost row)."""
    if mode == "zeros":
        shape = list(edge.shape)
        shape[dim] = n
        return edge.new_zeros(shape)
    return edge.expand(*[n if d == dim % edge.ndim else -1 for d in range(edge.ndim)])


def _edges(comm: PatchComm, dim: int, first: torch.Tensor, last: torch.Tensor, before: int, after: int,
           mode: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The `before` rows that precede this patch along dim and the `after` rows that follow it: the neighbouring
    patches' edge rows, or the frame's padding at its border. first / last: this patch's first and last
    max(before, after) rows (the previous patch's halo after its end is my first `after` rows; the next patch's
    halo before its start is my last `before` rows). Only these small edge tensors are exchanged."""
    n = first.shape[dim]
    prev, nxt = comm.grid.neighbour(comm.index, dim, -1), comm.grid.neighbour(comm.index, dim, +1)
    if (comm.grid.rows if dim == -2 else comm.grid.cols) > 1:  # neighbours along dim somewhere: all exchange
        sends, recvs = {}, {}
        for j, send, size in ((prev, first.narrow(dim, 0, after), before),
                              (nxt, last.narrow(dim, n - before, before), after)):
            if j is not None and send.shape[dim]:
                sends[j] = send
            if j is not None and size:
                shape = list(first.shape)
                shape[dim] = size
                recvs[j] = torch.Size(shape)
        got = comm.exchange(sends, recvs, like=first)
    else:
        got = {}
    head = got[prev] if prev is not None and before else _border(first.narrow(dim, 0, 1), dim, before, mode)
    tail = got[nxt] if nxt is not None and after else _border(last.narrow(dim, n - 1, 1), dim, after, mode)
    return head.to(first.dtype), tail.to(first.dtype)


def _padded_conv_forward(module: nn.Module, original: Callable, x: torch.Tensor) -> torch.Tensor:
    comm = _active()
    if comm is None:
        return original(x)
    w0, w1, h0, h1, t0, t1 = module.time_causal_padding
    mode = PAD_MODES[module.pad_mode]
    B, C, T, H, W = x.shape
    n_w, n_h = max(w0, w1, 1), max(h0, h1, 1)
    if min(H, W) < max(n_w, n_h):
        raise ValueError(f"patch {comm.index}: {H} x {W} positions, smaller than the conv's halo")
    left, right = _edges(comm, -1, x[..., :n_w], x[..., W - n_w:], w0, w1, mode)  # [B, C, T, H, w0 / w1]
    rows = lambda r: torch.cat([left[..., r, :], x[..., r, :], right[..., r, :]], dim=-1)  # noqa: E731
    top, bottom = _edges(comm, -2, rows(slice(0, n_h)), rows(slice(H - n_h, H)), h0, h1, mode)  # corners included
    # the whole padded input is built once, after the exchanges: [B, C, t0 + T + t1, h0 + H + h1, w0 + W + w1]
    padded = x.new_empty(B, C, t0 + T + t1, h0 + H + h1, w0 + W + w1)
    mid = padded[:, :, t0:t0 + T]
    mid[..., :h0, :], mid[..., h0 + H:, :] = top, bottom
    mid[..., h0:h0 + H, :w0], mid[..., h0:h0 + H, w0:w0 + W], mid[..., h0:h0 + H, w0 + W:] = left, x, right
    for frames, edge in ((slice(0, t0), t0), (slice(t0 + T, t0 + T + t1), t0 + T - 1)):  # time is not split
        padded[:, :, frames] = padded[:, :, edge:edge + 1] if mode == "replicate" else 0
    return module.conv(padded)


def _group_norm_forward(module: nn.GroupNorm, original: Callable, x: torch.Tensor) -> torch.Tensor:
    comm = _active()
    if comm is None:
        return original(x)
    B, C, G = x.shape[0], x.shape[1], module.num_groups
    xs = x.reshape(B, G, -1)  # [B, G, C/G * positions of this patch]
    var, mean = torch.var_mean(xs.float(), dim=-1, correction=0)  # [B, G] each
    n = torch.full_like(mean, xs.shape[-1])
    local = torch.stack([n, mean, var * n], dim=-1)  # [B, G, 3]: count, mean, M2 (fp32: every backend gathers it)
    stats = torch.stack(comm.all_gather(local, [local.shape] * comm.grid.size)).double()  # [P, B, G, 3]
    counts, means, m2 = stats.unbind(-1)  # [P, B, G] each
    total = counts.sum(0)  # [B, G]
    mean = (counts * means).sum(0) / total
    var = (m2 + counts * (means - mean) ** 2).sum(0) / total
    rstd = (var + module.eps).rsqrt().float()  # [B, G]
    weight = module.weight.float().view(G, -1) if module.affine else x.new_ones(G, C // G, dtype=torch.float32)
    bias = module.bias.float().view(G, -1) if module.affine else x.new_zeros(G, C // G, dtype=torch.float32)
    scale = rstd[..., None] * weight  # [B, G, C/G]
    shift = bias - mean.float()[..., None] * scale
    y = torch.addcmul(shift[..., None], x.reshape(B, G, C // G, -1).float(), scale[..., None])  # [B, G, C/G, N]
    return y.to(x.dtype).view(x.shape)


def _global_forward(module: nn.Module, original: Callable, x: torch.Tensor) -> torch.Tensor:
    comm = _active()
    if comm is None:
        return original(x)
    rows, cols = comm.grid.region_like(x, comm.index)  # this patch in the whole frame at x's resolution

    def unpatched(fn: Callable, *args) -> torch.Tensor:
        _state.suspended = True
        try:
            return fn(*args)
        finally:
            _state.suspended = False

    def whole(frame: torch.Tensor) -> torch.Tensor:  # [.., H * s, W * s] -> the whole frame's output
        out = unpatched(original, frame)
        if out.shape[-2:] != frame.shape[-2:]:
            raise ValueError(f"global module {type(module).__name__} changed the spatial size "
                             f"{tuple(frame.shape[-2:])} -> {tuple(out.shape[-2:])}")
        return out

    def part(frame: torch.Tensor) -> torch.Tensor:  # only this patch's region, when the module can do that
        if hasattr(module, "forward_region"):
            return unpatched(module.forward_region, frame, rows, cols)
        return whole(frame)[..., rows, cols]

    return comm.gather_apply(x, whole, part)


def _is_padded_conv(m: nn.Module) -> bool:
    return isinstance(getattr(m, "conv", None), nn.Conv3d) and hasattr(m, "time_causal_padding") \
        and hasattr(m, "pad_mode")


def _check(model: nn.Module, global_modules: tuple[type, ...]) -> None:
    handled: set[int] = set()
    for m in model.modules():
        if isinstance(m, global_modules):
            handled.update(id(sub) for sub in m.modules())
        elif _is_padded_conv(m):
            conv = m.conv
            if conv.stride != (1, 1, 1) or conv.dilation != (1, 1, 1) or conv.padding != (0, 0, 0):
                raise ValueError(f"{type(m).__name__}: patch decode needs stride 1, dilation 1 and no inner padding")
            if m.pad_mode not in PAD_MODES:
                raise ValueError(f"{type(m).__name__}: pad_mode {m.pad_mode!r} not supported by patch decode")
            handled.add(id(conv))
    for name, m in model.named_modules():
        if isinstance(m, (nn.Conv2d, nn.Conv3d)) and id(m) not in handled and max(m.kernel_size[-2:]) > 1:
            raise ValueError(f"{name}: a spatial conv that patch decode does not know how to give a halo")


@contextmanager
def patch_ops(model: nn.Module, global_modules: tuple[type, ...]) -> Iterator[None]:
    """Swap the forwards of model's padded convs, GroupNorms and global modules for their patch versions (they
    act only while run_patch() is active in the calling thread); restored on exit."""
    _check(model, global_modules)
    if any("forward" in vars(m) for m in model.modules()):
        raise RuntimeError("patch_ops: the model's forwards are already swapped (nested patch_ops on one model)")
    swapped = []
    for m in model.modules():
        if isinstance(m, global_modules):
            handler = _global_forward
        elif _is_padded_conv(m):
            handler = _padded_conv_forward
        elif isinstance(m, nn.GroupNorm):
            handler = _group_norm_forward
        else:
            continue
        m.forward = functools.partial(handler, m, m.forward)
        swapped.append(m)
    try:
        yield
    finally:
        for m in swapped:
            del m.forward


def patch_parallel_decode(model: nn.Module, fn: Callable[[torch.Tensor], torch.Tensor], z: torch.Tensor,
                          group: dist.ProcessGroup | None, global_modules: tuple[type, ...]) -> torch.Tensor:
    """fn(z) with z [.., h, w] cut into one spatial patch per rank of group; every rank returns the whole output
    (fn's output patches gathered). model: the module tree fn runs (its convs / norms are swapped)."""
    grid = PatchGrid.for_ranks(z.shape[-2], z.shape[-1], parallel.group_size(group))
    if grid.size == 1:
        with torch.no_grad():
            return fn(z)
    comm = DistPatchComm(group, grid)
    with patch_ops(model, global_modules):
        out = run_patch(fn, grid.split(z)[comm.index].contiguous(), comm)  # [.., h_i * s, w_i * s]
    return grid.assemble(comm.all_gather(out, grid.shapes_like(out, comm.index)))
