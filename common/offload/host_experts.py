"""Routed experts computed on the host CPU, in the publisher's MXFP4, for MoE offload.

The device keeps N resident experts per MoE layer; the rest of the routed (expert, weight) pairs come here. A host
backend holds the experts of every offloaded layer once, in MXFP4 as the checkpoint stores them (never a float copy
of all experts), and computes, per routed pair, V4's clamped SwiGLU expert

    y = w2 @ (silu(min(w1 @ x, limit)) * clamp(w3 @ x, -limit, limit))

summing weight * y over a token's pairs. `submit` starts a layer's work (its inputs copied to the host) and returns
a handle; `sync` waits and returns the [T, D] partial sum on the inputs' device, which the caller adds to the
device's. Pairs with an id < 0 (the ones the caller keeps on the device) are skipped.

MXFP4 as published (common.loader.quant): int8 [..., N, K/2], two e2m1 codes a byte, input 2i in the low nibble and
2i+1 in the high one; one e8m0 scale per 32 consecutive inputs [..., N, K/32].
"""
from __future__ import annotations

import abc
import dataclasses
from collections.abc import Iterable, Mapping

import torch
import torch.nn.functional as F

from common.loader.quant import E2M1, MX_GROUP, MX_SCALE_DTYPE

# byte -> its two e2m1 values (low nibble first): one gather decodes a packed row
_BYTE_TO_E2M1 = torch.stack([E2M1[torch.arange(256) & 0xF], E2M1[torch.arange(256) >> 4]], dim=-1)  # [256, 2]


@dataclasses.dataclass
class MXFP4Experts:
    """One MoE layer's routed experts as the checkpoint stores them, stacked over experts:
    w13 int8 [E, 2I, D/2] (rows 0..I-1 the gate w1, I..2I-1 the up w3), w13_scale e8m0 [E, 2I, D/32],
    w2 int8 [E, D, I/2], w2_scale e8m0 [E, D, I/32]."""

    w13: torch.Tensor
    w13_scale: torch.Tensor
    w2: torch.Tensor
    w2_scale: torch.Tensor

    def __post_init__(self):
        for name in ("w13", "w2"):
            w, s = getattr(self, name), getattr(self, f"{name}_scale")
            if w.dtype not in (torch.int8, torch.uint8) or w.dim() != 3:
                raise ValueError(f"mxfp4 {name} must be int8 [E, N, K/2], got {w.dtype} {list(w.shape)}")
            need = [*w.shape[:2], w.shape[2] * 2 // MX_GROUP]
            if s.dtype not in (MX_SCALE_DTYPE, torch.uint8) or list(s.shape) != need:
                raise ValueError(f"mxfp4 {name}_scale must be e8m0 {need} "
                                 f"for {name} {list(w.shape)}, got {s.dtype} {list(s.shape)}")
            if not (w.is_contiguous() and s.is_contiguous()):
                raise ValueError(f"mxfp4 {name} and its scale must be contiguous")
        E, two_i, half_d = self.w13.shape
        if two_i % 2 or list(self.w2.shape) != [E, half_d * 2, two_i // 4]:
            raise ValueError(f"w2 {list(self.w2.shape)} does not fit w13 {list(self.w13.shape)}: "
                             f"expected [{E}, {half_d * 2}, {two_i // 4}]")
        if (half_d * 2) % MX_GROUP or (two_i // 2) % MX_GROUP:
            raise ValueError(f"hidden and intermediate sizes must be multiples of {MX_GROUP}")

    @property
    def num_experts(self) -> int:
        return self.w13.shape[0]

    @property
    def hidden_size(self) -> int:
        return self.w13.shape[2] * 2

    @property
    def intermediate_size(self) -> int:
        return self.w13.shape[1] // 2

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in (self.w13, self.w13_scale, self.w2, self.w2_scale))

    @classmethod
    def from_checkpoint(cls, ckpt, prefix: str, num_experts: int, first: int = 0) -> "MXFP4Experts":
        """Read experts first..first+num_experts-1 (an expert-parallel rank's shard; stacked from 0) as stored:
        `{prefix}.{e}.w1|w3|w2.weight` and `.scale` (the publisher's names, e.g. prefix "layers.3.ffn.experts")
        from a common.loader.Checkpoint, into the stacked tensors."""
        def stored(e: int, w: str):
            name = f"{prefix}.{first + e}.{w}"
            return ckpt.get(f"{name}.weight"), ckpt.get(f"{name}.scale")

        w1, s1 = stored(0, "w1")
        w2, s2 = stored(0, "w2")
        I = w1.shape[0]
        out = cls(torch.empty(num_experts, 2 * I, w1.shape[1], dtype=torch.int8),
                  torch.empty(num_experts, 2 * I, s1.shape[1], dtype=s1.dtype),
                  torch.empty(num_experts, *w2.shape, dtype=torch.int8),
                  torch.empty(num_experts, *s2.shape, dtype=s2.dtype))
        for e in range(num_experts):
            for w, rows in (("w1", slice(0, I)), ("w3", slice(I, 2 * I))):
                q, s = stored(e, w)
                out.w13[e, rows].copy_(q.view(torch.int8))
                out.w13_scale[e, rows].copy_(s)
            q, s = stored(e, "w2")
            out.w2[e].copy_(q.view(torch.int8))
            out.w2_scale[e].copy_(s)
        return out


def dequant_expert(packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """One expert's MXFP4 matrix int8 [N, K/2] + e8m0 [N, K/32] -> fp32 [N, K] (equal to
    common.loader.dequant_mxfp4, decoded a byte at a time)."""
    n = packed.shape[0]
    w = F.embedding(packed.view(torch.uint8).int(), _BYTE_TO_E2M1)                    # [N, K/2, 2]
    w = w.view(n, -1, MX_GROUP).mul_(scale.view(MX_SCALE_DTYPE).float().unsqueeze(-1))  # [N, K/32, 32]
    return w.view(n, -1)                                                              # [N, K]


def check_routing(hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                  num_experts: int, hidden_size: int) -> None:
    """ValueError unless hidden [T, D], topk_ids [T, k] (ids < num_experts; < 0 skips) and topk_weights [T, k]."""
    if hidden.dim() != 2 or hidden.shape[1] != hidden_size:
        raise ValueError(f"hidden must be [T, {hidden_size}], got {list(hidden.shape)}")
    if topk_ids.dim() != 2 or topk_ids.shape[0] != hidden.shape[0] or topk_weights.shape != topk_ids.shape:
        raise ValueError(f"topk_ids and topk_weights must be [T, k] with T = {hidden.shape[0]}, "
                         f"got {list(topk_ids.shape)} and {list(topk_weights.shape)}")
    if topk_ids.dtype.is_floating_point:
        raise ValueError(f"topk_ids must be integers, got {topk_ids.dtype}")
    if topk_ids.numel() and int(topk_ids.max()) >= num_experts:
        raise ValueError(f"expert id {int(topk_ids.max())} out of range: the layer has {num_experts} experts")


@dataclasses.dataclass
class HostMoEHandle:
    """A submitted layer: `sync` returns its output. `keep` holds every tensor the host work reads or writes."""

    layer: int
    out: torch.Tensor
    dtype: torch.dtype
    device: torch.device
    keep: tuple = ()
    done: bool = False


class HostExperts(abc.ABC):
    """The host-backend contract: the MXFP4 experts of every offloaded layer, by the model's layer index."""

    num_experts: int
    hidden_size: int
    intermediate_size: int
    swiglu_limit: float | None
    layers: tuple[int, ...]

    @abc.abstractmethod
    def submit(self, layer: int, hidden: torch.Tensor, topk_ids: torch.Tensor,
               topk_weights: torch.Tensor) -> HostMoEHandle:
        """Start hidden [T, D] through `layer`'s experts topk_ids [T, k] (< 0: not here) with topk_weights [T, k].
        The handle holds what the work reads and writes: `sync` it (a dropped, unsynced handle frees them early)."""

    @abc.abstractmethod
    def sync(self, handle: HostMoEHandle) -> torch.Tensor:
        """Wait for a submitted layer -> [T, D] in hidden's dtype, on its device: sum over pairs of weight * expert(x).
        """

    def forward(self, layer: int, hidden: torch.Tensor, topk_ids: torch.Tensor,
                topk_weights: torch.Tensor) -> torch.Tensor:
        return self.sync(self.submit(layer, hidden, topk_ids, topk_weights))

    def _check(self, layer: int, hidden, topk_ids, topk_weights) -> None:
        if layer not in self.layers:
            raise ValueError(f"layer {layer} has no host experts (host layers: {list(self.layers)})")
        check_routing(hidden, topk_ids, topk_weights, self.num_experts, self.hidden_size)


def _layers_shape(layers: Mapping[int, MXFP4Experts]) -> tuple[int, int, int]:
    if not layers:
        raise ValueError("no layers given")
    shapes = {(x.num_experts, x.hidden_size, x.intermediate_size) for x in layers.values()}
    if len(shapes) != 1:
        raise ValueError(f"every layer must have the same (experts, hidden, intermediate), got {sorted(shapes)}")
    return shapes.pop()


class TorchHostExperts(HostExperts):
    """Pure-PyTorch host experts: each call dequantizes the MXFP4 blocks of the experts it routes to and computes in
    fp32 (the reference the other backends are compared with). `submit` computes at once."""

    def __init__(self, layers: Mapping[int, MXFP4Experts] | Iterable[tuple[int, MXFP4Experts]],
                 swiglu_limit: float | None):
        self.experts = dict(layers)
        self.num_experts, self.hidden_size, self.intermediate_size = _layers_shape(self.experts)
        self.swiglu_limit = swiglu_limit
        self.layers = tuple(sorted(self.experts))

    def submit(self, layer, hidden, topk_ids, topk_weights) -> HostMoEHandle:
        self._check(layer, hidden, topk_ids, topk_weights)
        x = self.experts[layer]
        I, limit = self.intermediate_size, self.swiglu_limit
        h32 = hidden.to("cpu", torch.float32)                                        # [T, D]
        out = torch.zeros_like(h32)                                                  # [T, D] fp32
        topk_ids, topk_weights = topk_ids.cpu(), topk_weights.cpu()
        flat = topk_ids.flatten().long()                                             # [T*k]
        keep = (flat >= 0).nonzero().squeeze(1)                                      # [P] routed here
        order = keep[torch.sort(flat[keep], stable=True).indices]                    # [P] by expert
        experts, counts = torch.unique_consecutive(flat[order], return_counts=True)
        weights = topk_weights.flatten().float()                                     # [T*k]
        for e, rows in zip(experts.tolist(), order.split(counts.tolist())):
            tokens = rows // topk_ids.shape[1]                                       # [M]
            gate_up = h32[tokens] @ dequant_expert(x.w13[e], x.w13_scale[e]).T       # [M, 2I]
            gate, up = gate_up[:, :I], gate_up[:, I:]
            if limit is not None:
                gate, up = gate.clamp(max=limit), up.clamp(-limit, limit)
            y = (F.silu(gate) * up) @ dequant_expert(x.w2[e], x.w2_scale[e]).T      # [M, D]
            out.index_add_(0, tokens, y * weights[rows, None])
        return HostMoEHandle(layer, out, hidden.dtype, hidden.device)

    def sync(self, handle: HostMoEHandle) -> torch.Tensor:
        return handle.out.to(handle.device, handle.dtype)
