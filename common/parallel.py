"""torch.distributed from the torchrun environment, named process groups, thin collective helpers; `launch_ranks`
starts a script again under torchrun (a recipe's multi-rank preset).

Ranks are laid out on a mesh [dp, cfg, sp, tp] (tp fastest, so a tp group is neighbouring ranks, the ones that
share a node's fast links); each named group holds the ranks that differ only along that axis. `ep` is not a
mesh axis: an ep group is a block of `ep` neighbouring ranks (an LLM's experts spread over its tp x dp ranks), so
`ep` must be a multiple of `tp` and divide the world size, and is only allowed with sp = cfg = 1.

`LLMParallelLayout` is the LLM executor's layout, in upstream's names (cann-recipes-infer `parallel_config`):
attention tensor parallel (`attn_tp`, blocks of neighbouring ranks) inside attention data parallel (`attn_dp`,
derived), experts over `moe_ep` (derived: world / moe_tp), vocab-parallel embedding and LM head over blocks of
`embed_tp` / `lmhead_tp` ranks.

Not launched by torchrun (no WORLD_SIZE in the environment): a single-process mode with every size 1 and every
group None; the helpers below then return their input, so modeling code needs no `if distributed` branches.
"""
from __future__ import annotations

import collections
import datetime
import os
from dataclasses import dataclass, field
from typing import ClassVar

import torch
import torch.distributed as dist

from common import backend

MESH_AXES = ("dp", "cfg", "sp", "tp")
GROUP_NAMES = MESH_AXES + ("ep",)
LLM_GROUP_NAMES = ("attn_tp", "attn_dp", "moe_tp", "moe_ep", "embed_tp", "lmhead_tp")
TORCHRUN_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
# Bytes this process sent to other ranks, by collective (the payload: what a ring / pairwise exchange moves).
# Instrumentation only: recipes' parallel benches read and reset it; nothing decides on it. Eager steps only (a
# compiled graph-mode step does not count).
TRAFFIC: collections.Counter = collections.Counter()
DEFAULT_TIMEOUT_S = 300.0


def _count(collective: str, nbytes: int) -> None:
    if not torch.compiler.is_compiling():
        TRAFFIC[collective] += nbytes


@dataclass(slots=True, frozen=True)
class ParallelLayout:
    """Sizes of the named groups; dp * cfg * sp * tp == world size."""

    dp: int = 1
    cfg: int = 1
    sp: int = 1
    tp: int = 1
    ep: int = 1
    group_names: ClassVar[tuple[str, ...]] = GROUP_NAMES

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


@dataclass(slots=True, frozen=True)
class LLMParallelLayout:
    """An LLM's parallel sizes over world_size ranks, named as upstream does.

    attn_tp: query heads split over blocks of attn_tp neighbouring ranks, which run the same requests;
    attn_dp = world / attn_tp: each attention-DP rank (block) its own requests, scheduler and KV cache.
    moe_ep = world / moe_tp: routed experts sharded over all the ranks of a moe_ep group (moe_tp = 1: every rank).
    embed_tp / lmhead_tp: vocabulary split over blocks of that many neighbouring ranks (the tokens of their DP
    ranks gathered for it). Blocks are neighbouring ranks; attn_dp and moe_ep groups are strided across them."""

    world_size: int = 1
    attn_tp: int = 1
    moe_tp: int = 1
    embed_tp: int = 1
    lmhead_tp: int = 1
    group_names: ClassVar[tuple[str, ...]] = LLM_GROUP_NAMES

    def __post_init__(self):
        for name in ("world_size", "attn_tp", "moe_tp", "embed_tp", "lmhead_tp"):
            size = getattr(self, name)
            if not isinstance(size, int) or isinstance(size, bool) or size < 1:
                raise ValueError(f"parallel size {name}={size!r}: expected an int >= 1")
            if self.world_size % size:
                raise ValueError(f"parallel size {name}={size} does not divide the world size {self.world_size}")
        if self.moe_tp != 1:
            raise ValueError(f"moe_tp={self.moe_tp}: expert tensor parallel is not built; use moe_tp 1 (every "
                             "shipped DeepSeek-V4 layout does: experts over all ranks)")

    @property
    def attn_dp(self) -> int:
        return self.world_size // self.attn_tp

    @property
    def moe_ep(self) -> int:
        return self.world_size // self.moe_tp

    def check_world(self, world_size: int) -> None:
        if self.world_size != world_size:
            raise ValueError(f"the parallel layout is for {self.world_size} ranks, but the world has {world_size}")

    def group_ranks(self, name: str) -> list[list[int]]:
        """Every group named `name` as lists of global ranks (all ranks create all groups, in this order)."""
        blocks = {"attn_tp": self.attn_tp, "moe_tp": self.moe_tp, "embed_tp": self.embed_tp,
                  "lmhead_tp": self.lmhead_tp}
        strided = {"attn_dp": self.attn_tp, "moe_ep": self.moe_tp}  # across the blocks of that size
        ranks = torch.arange(self.world_size)
        if name in blocks:
            return ranks.view(-1, blocks[name]).tolist()
        if name in strided:
            return ranks.view(-1, strided[name]).T.tolist()
        raise KeyError(f"unknown group {name!r}: expected one of {LLM_GROUP_NAMES}")


@dataclass(slots=True)
class Parallel:
    """This process's place in the layout: global rank, local rank (device index) and the named groups.

    groups[name] is None when the group has one rank (nothing to communicate); see size() / rank().
    """

    layout: ParallelLayout | LLMParallelLayout
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
        if name not in self.layout.group_names:
            raise KeyError(f"unknown group {name!r}: expected one of {self.layout.group_names}")
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


def init_parallel(layout: ParallelLayout | LLMParallelLayout | None = None,
                  timeout_s: float = DEFAULT_TIMEOUT_S) -> Parallel:
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
    for group_name in layout.group_names:
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
    P = group_size(group)
    if P > 1:
        _count("all_reduce", 2 * (P - 1) * x.nbytes // P)  # ring: reduce-scatter + all-gather
        dist.all_reduce(x, group=group)
    return x


def all_gather_sizes(n: int, group: dist.ProcessGroup | None) -> list[int]:
    """Every rank's n, in group-rank order (a CPU int tensor goes through the collective)."""
    if group_size(group) == 1:
        return [n]
    parts = [torch.zeros(1, dtype=torch.long) for _ in range(group_size(group))]
    dist.all_gather(parts, torch.tensor([n]), group=group)
    return [int(p) for p in parts]


def all_gather_v(x: torch.Tensor, sizes: list[int], group: dist.ProcessGroup | None) -> torch.Tensor:
    """Concatenate every rank's x [sizes[rank], ...] along dim 0 (sizes may differ: padded to the largest)."""
    if group_size(group) == 1:
        return x
    pad = max(sizes)
    padded = torch.cat([x, x.new_zeros(pad - x.shape[0], *x.shape[1:])])
    parts = [torch.empty_like(padded) for _ in sizes]
    _count("all_gather", (len(sizes) - 1) * padded.nbytes)
    dist.all_gather(parts, padded, group=group)
    return torch.cat([p[:n] for p, n in zip(parts, sizes)])


def all_to_all_v(x: torch.Tensor, send_splits: list[int], recv_splits: list[int],
                 group: dist.ProcessGroup | None) -> torch.Tensor:
    """Rows x[sum(send_splits[:i]) : +send_splits[i]] go to group rank i; what arrives is concatenated by source."""
    if group_size(group) == 1:
        return x
    out = x.new_empty(sum(recv_splits), *x.shape[1:])
    row = x[0].nbytes if x.shape[0] else 0
    _count("all_to_all", (sum(send_splits) - send_splits[group_rank(group)]) * row)
    dist.all_to_all_single(out, x.contiguous(), recv_splits, send_splits, group=group)
    return out


def shard(param: torch.Tensor, dim: int, parallel: "Parallel", group: str) -> torch.Tensor:
    """Mark a parameter as this rank's part of a checkpoint tensor split evenly along dim over the named group
    (what common.loader.load_weights reads for it); returns it."""
    param.shard = (dim, parallel.rank_in(group), parallel.size(group))
    return param


def vocab_parallel_embedding(ids: torch.Tensor, embedding: torch.nn.Embedding, vocab_start: int,
                             group: dist.ProcessGroup | None, uniform: bool = False) -> torch.Tensor:
    """ids [T] -> [T, D] with the vocabulary split over the group (this rank holds rows [vocab_start, + n)): the
    group's ids are gathered (their DP ranks hold different tokens), each rank looks up what it holds, the sum
    over the group completes every row, and each rank keeps its own. uniform: every rank of the group has T ids
    (a graph-mode step: all ranks padded to one bucket), so no sizes are exchanged."""
    sizes = [ids.shape[0]] * group_size(group) if uniform else all_gather_sizes(ids.shape[0], group)
    every = all_gather_v(ids, sizes, group) - vocab_start  # [sum T]
    n = embedding.num_embeddings
    inside = (every >= 0) & (every < n)
    out = embedding(every.clamp(0, n - 1)) * inside[:, None].to(embedding.weight.dtype)  # [sum T, D]
    start = sum(sizes[: group_rank(group)])
    return all_reduce(out, group)[start: start + ids.shape[0]]


def vocab_parallel_logits(hidden: torch.Tensor, head, group: dist.ProcessGroup | None,
                          uniform: bool = False) -> torch.Tensor:
    """hidden [N, D] -> logits [N, V] with the head's vocabulary split over the group (head: [N, D] -> [N, V/P]):
    the group's rows are gathered, each rank scores them on its slice, and an all-to-all returns each rank its own
    rows over the whole vocabulary. uniform: every rank of the group has N rows (no sizes exchanged)."""
    P = group_size(group)
    sizes = [hidden.shape[0]] * P if uniform else all_gather_sizes(hidden.shape[0], group)
    local = head(all_gather_v(hidden, sizes, group))  # [sum N, V/P]
    mine = all_to_all_v(local, sizes, [hidden.shape[0]] * P, group)  # [P * N, V/P]: slice by slice
    N, V_local = hidden.shape[0], local.shape[-1]
    return mine.view(P, N, V_local).transpose(0, 1).reshape(N, P * V_local)  # [N, V]


@dataclass(slots=True)
class ExpertDispatch:
    """How rows went to the ranks owning their experts, to send the results back (combine_from_experts)."""
    order: torch.Tensor | None  # arrival row -> position when grouped by local expert (None: one rank)
    send: list[int]
    recv: list[int]
    slot: torch.Tensor | None = None  # fixed capacity: each sent row's place in the [P * capacity] exchange


def dispatch_to_experts(rows: torch.Tensor, counts: torch.Tensor, group: dist.ProcessGroup | None,
                        capacity: int | None = None) -> tuple[torch.Tensor, torch.Tensor, ExpertDispatch]:
    """Expert parallel, upstream's prefill "double routing": rows [M, D] sorted by global expert, counts [E] rows
    per expert, experts in contiguous blocks of E/P per group rank. Exchanges the counts, then the rows, and groups
    what arrived by local expert: (rows [M', D], rows per local expert [E/P], the handle for the way back).
    On NPU too this is all_to_all: npu_moe_distribute_dispatch_v2 / combine_v2 need an MC2 communication domain
    sized for a fixed token count, which the variable-length prefill batches here do not give.

    capacity (graph mode: a step of static shapes; the same on every rank, >= M as all rows could go to one
    rank): every rank sends every rank `capacity` rows, its rows for that rank first and zeros after, so no
    split is read on the host; what arrives is [P * capacity, D], grouped by local expert with the padding rows
    last (past the sum of the counts, which the grouped matmul does not compute)."""
    P = group_size(group)
    if capacity is not None and capacity < rows.shape[0]:
        raise ValueError(f"dispatch capacity {capacity} below the {rows.shape[0]} rows to send")
    if P == 1:
        return rows, counts, ExpertDispatch(None, [rows.shape[0]], [rows.shape[0]])
    send_counts = counts.view(P, -1)  # [P destination ranks, E/P]
    recv_counts = all_to_all_v(send_counts, [1] * P, [1] * P, group)  # [P source ranks, E/P]
    E_local = send_counts.shape[1]
    if capacity is None:
        send, recv = send_counts.sum(1).tolist(), recv_counts.sum(1).tolist()
        arrived = all_to_all_v(rows, send, recv, group)  # [M', D]: by source rank, then local expert
        local_expert = torch.repeat_interleave(torch.arange(E_local, device=rows.device).repeat(P),
                                               recv_counts.flatten())
        order = torch.sort(local_expert, stable=True).indices  # [M']
        return arrived[order], recv_counts.sum(0), ExpertDispatch(order, send, recv)
    M = rows.shape[0]
    i = torch.arange(M, device=rows.device)
    per_rank = send_counts.sum(1)  # [P]
    ends = per_rank.cumsum(0)  # [P]
    dest = torch.searchsorted(ends, i, right=True)  # [M]: rows sorted by expert are sorted by destination
    slot = dest * capacity + i - (ends - per_rank)[dest]  # [M]: its place in the destination's block
    send_buf = rows.new_zeros(P * capacity, *rows.shape[1:]).index_copy(0, slot, rows)  # [P * C, D]
    equal = [capacity] * P
    arrived = all_to_all_v(send_buf, equal, equal, group)  # [P * C, D]: block by source rank
    j = torch.arange(capacity, device=rows.device)
    local_expert = torch.searchsorted(recv_counts.cumsum(1), j.expand(P, -1).contiguous(), right=True)  # [P, C]
    order = torch.sort(local_expert.flatten(), stable=True).indices  # [P * C]: E_local (padding) sorts last
    return arrived[order], recv_counts.sum(0), ExpertDispatch(order, equal, equal, slot)


def combine_from_experts(y: torch.Tensor, handle: ExpertDispatch, group: dist.ProcessGroup | None) -> torch.Tensor:
    """The expert outputs y [M', D] (grouped by local expert) back to the ranks and rows they came from: [M, D]."""
    if handle.order is None:
        return y
    back = torch.empty_like(y)
    back[handle.order] = y  # arrival order
    returned = all_to_all_v(back, handle.recv, handle.send, group)
    return returned if handle.slot is None else returned[handle.slot]


def all_reduce_max(values: list[int], group: dist.ProcessGroup | None) -> list[int]:
    """The element-wise maximum of every rank's values (every rank learns the same answer)."""
    if group_size(group) == 1:
        return values
    x = torch.tensor(values, dtype=torch.long)
    dist.all_reduce(x, op=dist.ReduceOp.MAX, group=group)
    return x.tolist()


def any_rank(flag: bool, group: dist.ProcessGroup | None) -> bool:
    """Whether flag is true on some rank of the group (every rank learns the same answer)."""
    return bool(all_reduce_max([int(flag)], group)[0])


def broadcast_int(value: int, group: dist.ProcessGroup | None) -> int:
    """The value of the group's first rank, on every rank of the group."""
    if group_size(group) == 1:
        return value
    x = torch.tensor([value], dtype=torch.long)
    dist.broadcast(x, src=dist.get_global_rank(group, 0), group=group)
    return int(x)


def all_gather_object(obj, group: dist.ProcessGroup | None) -> list:
    """Every rank's picklable obj, in group-rank order (control data: requests, outputs)."""
    if group_size(group) == 1:
        return [obj]
    out = [None] * group_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out


def broadcast_from_rank0(obj):
    """Global rank 0's picklable obj, on every rank of the world (one process: obj itself)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def gather_to_rank0(obj) -> list | None:
    """Every rank's picklable obj, in rank order, on global rank 0 (None elsewhere; one process: [obj])."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return [obj]
    out = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(obj, out, dst=0)
    return out


def launch_ranks(world_size: int) -> None:
    """Run this very command (sys.argv) again under torchrun on world_size local processes (hccl on NPU, gloo on
    CPU) and exit with their exit code: how a recipe's script starts a multi-rank preset itself. SIGTERM / SIGINT go
    to rank 0 alone, which (serving) drains and tells the other ranks to stop, so the job ends cleanly. When a rank
    fails, torchrun stops the others and names the first failure in its report; this ends with one line saying
    which rank it was. Several machines: start torchrun on each yourself (--nnodes, --node-rank, --rdzv-endpoint):
    the script sees WORLD_SIZE and does not launch again."""
    import contextlib
    import re
    import signal
    import subprocess
    import sys
    import threading

    import psutil

    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world_size}",
               sys.argv[0], *sys.argv[1:]]
    sys.stdout.flush()
    job = subprocess.Popen(command, stderr=subprocess.PIPE, text=True, errors="replace")

    def to_rank0(sig, _frame):
        for child in psutil.Process(job.pid).children(recursive=True):
            with contextlib.suppress(psutil.Error):
                if child.environ().get("RANK") == "0":
                    child.send_signal(sig)

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, to_rank0)
    root_cause: list[str] = []

    def relay():  # the ranks' and torchrun's stderr, as it comes; torchrun's "Root Cause" block names the rank
        seen_root = False
        for line in job.stderr:
            sys.stderr.write(line)
            seen_root = seen_root or "Root Cause" in line
            if seen_root and not root_cause and (m := re.search(r"\brank\s*:\s*(\d+)", line)):
                root_cause.append(m[1])
            if seen_root and root_cause and (m := re.search(r"exitcode\s*:\s*(-?\d+)", line)):
                root_cause.append(m[1])

    reader = threading.Thread(target=relay, daemon=True)
    reader.start()
    job.wait()
    reader.join(timeout=5)
    if job.returncode and root_cause:
        code = int(root_cause[1]) if len(root_cause) > 1 else None
        how = f"killed by signal {-code}" if code is not None and code < 0 else f"exit code {code}"
        print(f"error: rank {root_cause[0]} of {world_size} failed first ({how}); torchrun stopped the others",
              file=sys.stderr)
    sys.exit(job.returncode)
