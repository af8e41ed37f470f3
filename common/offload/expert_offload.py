"""One model's MoE offload at run time: the resident tables, the host experts, and the in-place residency change.

Per MoE layer (`route`): the router's top-k is split (ResidentExperts.split), the host part is submitted to the
host backend before the device runs its resident and shared experts, and the caller adds `sync(layer, ticket)`
once those are done. On a CPU-only machine the two halves run one after the other on the same cores (the torch
backend computes inside submit; kt-kernel's pool runs while the caller's thread does the device half, but both
share the cores). With an accelerator, the router and the resident experts run there; submit copies the
hidden states and the host part of the routing to the host, and sync copies the partial sum back.

Graph mode (exe_mode graph, CPU): inside a compiled decode graph the host call is two opaque custom ops,
`npu_cookbook::host_experts_submit` and `npu_cookbook::host_experts_sync` (vLLM's way for its attention op: the op
takes the name of a live object and looks it up here). The graph holds the split and the resident slots' GEMMs;
the ops run this object's `submit` / `sync` on every replay, so the host's routing is read at run time, and the
sync op takes the submit op's ticket, so it comes after. The resident tables and the slots' weights are graph
inputs that dynamic placement rewrites in place, so the compiled graphs stay valid across placement changes.
A padded graph step's padding rows are routed too: their pairs go to the host (computed, then dropped) and count
in `hit_rate`. A CUDA graph would replay its kernels without the host call: the ops refuse to be captured.

Dynamic placement (`finish_prefill`): after a step, the requests whose prompt prefill ended in it pool the routed
ids of their tokens in that step (the prompt's last prefill chunk: the whole prompt when it fitted in one step),
per main-model MoE layer; each layer's N most routed experts become its resident set, their weights dequantized
from the host's compact copy into the freed slots. Outputs never depend on the resident set: an expert that is
not resident is computed on the host.
"""
from __future__ import annotations

import itertools
import time
import weakref
from collections.abc import Callable, Iterable, Mapping

import torch

from .host_experts import HostExperts, HostMoEHandle
from .placement import DynamicPlacement, ResidentExperts

CUDA_GRAPH = ("MoE offload in graph mode runs on CPU (torch.compile): a CUDA graph replays its kernels without the "
              "host experts' call; run exe_mode eager")
# (layer, expert) -> that expert's float weights (w13 [2I, D] gate rows then up rows, w2 [D, I])
FetchExpert = Callable[[int, int], tuple[torch.Tensor, torch.Tensor]]
_LIVE: weakref.WeakValueDictionary[str, "ExpertOffload"] = weakref.WeakValueDictionary()  # name -> the object
_NAMES = itertools.count()


class ExpertOffload:
    """resident: the slot tables of every offloaded layer; host: the host backend holding every offloaded layer's
    experts (all E, compact); slots: {layer: the module holding its N device slots, with set_slot(slot, w13, w2)};
    fetch: where a newly resident expert's weights come from; dynamic_layers: the layers dynamic placement
    updates (the main model's; the MTP blocks keep their start placement)."""

    def __init__(self, resident: ResidentExperts, host: HostExperts, slots: Mapping[int, object],
                 fetch: FetchExpert, dynamic_layers: Iterable[int]):
        if set(resident.experts) != set(host.layers) or set(slots) != set(host.layers):
            raise ValueError(f"resident layers {sorted(resident.experts)}, host layers {list(host.layers)} and "
                             f"slot layers {sorted(slots)} must be the same")
        self.resident, self.host, self.slots, self.fetch = resident, host, dict(slots), fetch
        self.dynamic = isinstance(resident.placement, DynamicPlacement)
        self.dynamic_layers = set(dynamic_layers) & set(host.layers)
        self.step_ids: dict[int, torch.Tensor] = {}  # this step's router ids [T, k] by layer (dynamic only)
        self.step_seq_ids: torch.Tensor | None = None  # [T] their sequence in the step's batch
        self.pairs = self.resident_pairs = None  # routed pairs seen / of them on the device (device tensors)
        self.swaps = 0  # experts copied into slots by dynamic placement
        self.pending: dict[int, tuple] = {}  # layer -> (its submitted host work, submit's seconds, hits, pairs)
        self.host_log: list[tuple[int, int, float, int, int]] | None = None  # a list: every call's (layer, rows,
        #   seconds the caller spent in the host's submit and sync, resident pairs, pairs) (bench_offload.py)
        self.name = f"offload{next(_NAMES)}"  # what the graph's host ops look this object up by
        _LIVE[self.name] = self

    @property
    def num_slots(self) -> int:
        return self.resident.num_slots

    def route(self, layer: int, hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
              seq_ids: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """hidden [T, D], the router's topk_ids / topk_weights [T, k] -> (device slot ids [T, k], their weights
        [T, k] (0 for host pairs), the submitted host half's ticket for `sync`). seq_ids [T]: the tokens'
        sequences, which dynamic placement counts by."""
        split = self.resident.split(layer, topk_ids, topk_weights)
        if torch.compiler.is_compiling():
            ticket = torch.ops.npu_cookbook.host_experts_submit(hidden, split.host_ids, split.host_weights, topk_ids,
                                                                seq_ids, self.name, layer)
        else:
            ticket = self.submit(layer, hidden, split.host_ids, split.host_weights, topk_ids, seq_ids)
        return split.device_ids, split.device_weights, ticket

    def sync(self, layer: int, ticket: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """Wait for `layer`'s host half (route's ticket) -> its partial sum [T, D] in hidden's dtype and device."""
        if torch.compiler.is_compiling():
            return torch.ops.npu_cookbook.host_experts_sync(ticket, hidden, self.name, layer)
        start = time.perf_counter()
        handle, submit_seconds, hits, pairs = self.pending.pop(layer)
        out = self.host.sync(handle)
        if self.host_log is not None:
            self.host_log.append((layer, hidden.shape[0], submit_seconds + time.perf_counter() - start, hits, pairs))
        return out

    def submit(self, layer: int, hidden: torch.Tensor, host_ids: torch.Tensor, host_weights: torch.Tensor,
               topk_ids: torch.Tensor, seq_ids: torch.Tensor | None) -> torch.Tensor:
        """The host half of `route` (eager, or the graph's submit op at run time): start the host pairs (host_ids
        [T, k], -1 where resident), count the hits, keep the routing for dynamic placement -> a ticket (empty)."""
        if hidden.is_cuda and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(CUDA_GRAPH)
        if (stale := self.pending.pop(layer, None)) is not None:  # a step that failed between submit and sync:
            self.host.sync(stale[0])  # its work finishes before its buffers go (kt-kernel still writes them)
        start = time.perf_counter()
        handle = self.host.submit(layer, hidden, host_ids, host_weights)
        seconds = time.perf_counter() - start
        logged = self.host_log is not None  # (counting reads the device; logging is a bench's)
        self.pending[layer] = (handle, seconds, int((host_ids < 0).sum()) if logged else 0, topk_ids.numel())
        if self.dynamic and layer in self.dynamic_layers and seq_ids is not None:
            # copies: a compiled graph may reuse its buffers (and its input buffers are refilled next step)
            self.step_ids[layer], self.step_seq_ids = topk_ids.clone(), seq_ids.clone()
        resident = (host_ids < 0).sum()
        if self.pairs is None:
            self.pairs, self.resident_pairs = torch.zeros_like(resident), torch.zeros_like(resident)
        self.pairs += topk_ids.numel()
        self.resident_pairs += resident
        return hidden.new_empty(0)

    def hit_rate(self) -> float:
        """The share of routed pairs computed on the device so far (H)."""
        return float(self.resident_pairs) / max(int(self.pairs), 1) if self.pairs is not None else 0.0

    def finish_prefill(self, rows: list[int]) -> dict[int, list[tuple[int, int]]]:
        """The step's sequences `rows` finished their prompt's prefill: under dynamic placement each layer's
        resident set becomes their pooled top N, weights copied in. Returns the (slot, expert) moves by layer."""
        if not (self.dynamic and rows and self.step_ids):
            return {}
        seq = self.step_seq_ids
        mine = torch.isin(seq, torch.tensor(rows, dtype=seq.dtype, device=seq.device))  # [T]
        E = self.resident.num_experts
        counts = {layer: torch.bincount(ids[mine].flatten().long(), minlength=E).cpu()
                  for layer, ids in self.step_ids.items()}
        self.step_ids.clear()
        moves = self.resident.after_prefill(counts)
        for layer, pairs in moves.items():
            for slot, expert in pairs:
                w13, w2 = self.fetch(layer, expert)
                self.slots[layer].set_slot(slot, w13, w2)
            self.swaps += len(pairs)
        return moves


@torch.library.custom_op("npu_cookbook::host_experts_submit", mutates_args=())
def _host_experts_submit(hidden: torch.Tensor, host_ids: torch.Tensor, host_weights: torch.Tensor,
                         topk_ids: torch.Tensor, seq_ids: torch.Tensor | None, offload: str, layer: int) -> torch.Tensor:
    return _LIVE[offload].submit(layer, hidden, host_ids, host_weights, topk_ids, seq_ids)


@_host_experts_submit.register_fake
def _(hidden, host_ids, host_weights, topk_ids, seq_ids, offload, layer):
    return hidden.new_empty(0)


@torch.library.custom_op("npu_cookbook::host_experts_sync", mutates_args=())
def _host_experts_sync(ticket: torch.Tensor, hidden: torch.Tensor, offload: str, layer: int) -> torch.Tensor:
    return _LIVE[offload].sync(layer, ticket, hidden)


@_host_experts_sync.register_fake
def _(ticket, hidden, offload, layer):
    return torch.empty_like(hidden)
