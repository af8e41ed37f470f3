"""torch.distributed from the torchrun environment, named process groups, thin collective helpers.

Ranks are laid out on a mesh [dp, cfg, sp, tp] (tp fastest, so a tp group is neighbouring ranks, the ones that
share a node's fast links); each named group holds the ranks that differ only along that axis. `ep` is not a
mesh axis: an ep group is a block of `ep` neighbouring ranks (an LLM's experts spread over its tp x dp ranks), so
`ep` must be a multiple of `tp` and divide the world size, and is only allowed with sp = cfg = 1.

Not launched by torchrun (no WORLD_SIZE in the environment): a single-process mode with every size 1 and every
group None; the helpers below then return their input, so modeling code needs no `if distributed` branches.
"""
from __future__ import annotations

import datetime
import os
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from common import backend

MESH_AXES = ("dp", "cfg", "sp", "tp")
GROUP_NAMES = MESH_AXES + ("ep",)
TORCHRUN_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
DEFAULT_TIMEOUT_S = 300.0


@dataclass(slots=True, frozen=True)
class ParallelLayout:
    """Sizes of the named groups; dp * cfg * sp * tp == world size."""

    dp: int = 1
    cfg: int = 1
    sp: int = 1
    tp: int = 1
    ep: int = 1

    def __post_init__(self):
        for name in GROUP_NAMES:
            size = getattr(self, name)
            if not isinstance(size, int) or size < 1:
                raise ValueError(f"parallel size {name}={size!r}: expected an int >= 1")
        if self.cfg > 2:
            raise ValueError(f"cfg={self.cfg}: classifier-free guidance has 2 branches, so cfg is 1 or 2")
        if self.ep > 1:
            if self.sp * self.cfg > 1:
                raise ValueError(f"ep={self.ep} with sp={self.sp}, cfg={self.cfg}: ep groups are for sp = cfg = 1")
            if self.ep % self.tp or self.world_size % self.ep:
                raise ValueError(f"ep={self.ep}: must be a multiple of tp={self.tp} and divide {self.world_size}")

    @property
    def world_size(self) -> int:
        return self.dp * self.cfg * self.sp * self.tp

    def check_world(self, world_size: int) -> None:
        if self.world_size != world_size:
            sizes = " * ".join(f"{a}={getattr(self, a)}" for a in MESH_AXES)
            raise ValueError(f"parallel layout {sizes} = {self.world_size}, but the world has {world_size} ranks")

    def group_ranks(self, name: str) -> list[list[int]]:
        """Every group of axis `name` as lists of global ranks (all ranks must create all groups, in order)."""
        mesh = torch.arange(self.world_size).view(self.dp, self.cfg, self.sp, self.tp)  # rank at each coordinate
        if name == "ep":
            return mesh.view(-1, self.ep).tolist()
        if name not in MESH_AXES:
            raise KeyError(f"unknown group {name!r}: expected one of {GROUP_NAMES}")
        axis = MESH_AXES.index(name)
        return mesh.movedim(axis, -1).reshape(-1, mesh.shape[axis]).tolist()  # [groups, size]


@dataclass(slots=True)
class Parallel:
    """This process's place in the layout: global rank, local rank (device index) and the named groups.

    groups[name] is None when the group has one rank (nothing to communicate); see size() / rank().
    """

    layout: ParallelLayout
    rank: int = 0
    local_rank: int = 0
    groups: dict[str, dist.ProcessGroup | None] = field(default_factory=dict)

    @property
    def world_size(self) -> int:
        return self.layout.world_size

    @property
    def distributed(self) -> bool:
        return dist.is_initialized()

    def group(self, name: str) -> dist.ProcessGroup | None:
        if name not in GROUP_NAMES:
            raise KeyError(f"unknown group {name!r}: expected one of {GROUP_NAMES}")
        return self.groups.get(name)

    def size(self, name: str) -> int:
        return getattr(self.layout, name)

    def rank_in(self, name: str) -> int:
        return group_rank(self.group(name))


def torchrun_env() -> dict[str, str] | None:
    """The torchrun variables, or None when none is set (single process). Some but not all set: a clear error."""
    present = {k: os.environ[k] for k in TORCHRUN_ENV if k in os.environ}
    if not present:
        return None
    missing = [k for k in TORCHRUN_ENV if k not in present]
    if missing:
        raise RuntimeError(
            f"torch.distributed environment incomplete: {', '.join(missing)} not set (have {', '.join(present)}); "
            "launch with torchrun, or unset all of " + ", ".join(TORCHRUN_ENV) + " to run as one process"
        )
    return present


def init_parallel(layout: ParallelLayout | None = None, timeout_s: float = DEFAULT_TIMEOUT_S) -> Parallel:
    """Join the torchrun world (backend from common.backend.dist_backend()) and build the named groups.

    layout None: all ranks in dp. timeout_s bounds the rendezvous and every collective, so a missing rank or a
    mismatched collective raises instead of hanging. Without torchrun variables: single-process mode.
    """
    env = torchrun_env()
    if env is None:
        layout = layout or ParallelLayout()
        layout.check_world(1)
        return Parallel(layout)
    rank, world, local_rank = int(env["RANK"]), int(env["WORLD_SIZE"]), int(env["LOCAL_RANK"])
    layout = layout or ParallelLayout(dp=world)
    layout.check_world(world)
    name = backend.dist_backend()
    if name != "gloo":
        getattr(torch, backend.device_type()).set_device(local_rank)
    timeout = datetime.timedelta(seconds=timeout_s)
    if not dist.is_initialized():
        try:
            dist.init_process_group(name, init_method="env://", rank=rank, world_size=world, timeout=timeout)
        except (RuntimeError, TimeoutError) as e:  # DistStoreError / DistNetworkError are RuntimeErrors
            where = f"{env['MASTER_ADDR']}:{env['MASTER_PORT']}"
            raise RuntimeError(
                f"rank {rank} of {world}: {name} process group at {where} not formed within {timeout_s:g} s "
                "(a rank failed to start, or MASTER_ADDR / MASTER_PORT differ between ranks)"
            ) from e
    groups = {}
    for group_name in GROUP_NAMES:
        for ranks in layout.group_ranks(group_name):
            if len(ranks) == 1:
                continue  # one rank: nothing to communicate; skip the group (every rank skips the same ones)
            group = dist.new_group(ranks, timeout=timeout)
            if rank in ranks:
                groups[group_name] = group
    return Parallel(layout, rank, local_rank, groups)


def destroy_parallel() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def group_size(group: dist.ProcessGroup | None) -> int:
    return 1 if group is None else dist.get_world_size(group)


def group_rank(group: dist.ProcessGroup | None) -> int:
    return 0 if group is None else dist.get_rank(group)


def all_gather(x: torch.Tensor, group: dist.ProcessGroup | None, dim: int = 0) -> torch.Tensor:
    """Concatenate every rank's x along dim (same shapes on all ranks)."""
    size = group_size(group)
    if size == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(size)]  # list form: gloo has no all_gather_into_tensor
    dist.all_gather(parts, x.contiguous(), group=group)
    return torch.cat(parts, dim=dim)


def all_to_all(x: torch.Tensor, group: dist.ProcessGroup | None, scatter_dim: int, gather_dim: int) -> torch.Tensor:
    """Split x into P chunks along scatter_dim, send chunk i to rank i, concatenate what arrives along gather_dim.

    E.g. Ulysses: [B, S/P, H, D] with scatter_dim=2, gather_dim=1 -> [B, S, H/P, D]. x.shape[scatter_dim] must be
    a multiple of P.
    """
    size = group_size(group)
    if size == 1:
        return x
    if x.shape[scatter_dim] % size:
        raise ValueError(f"all_to_all: dim {scatter_dim} of {tuple(x.shape)} is not a multiple of {size} ranks")
    send = torch.stack(x.chunk(size, dim=scatter_dim))  # [P, ...chunk], contiguous
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)
    return torch.cat(recv.unbind(0), dim=gather_dim)


def all_reduce(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """Sum over the group, in place; returns x."""
    if group_size(group) > 1:
        dist.all_reduce(x, group=group)
    return x
