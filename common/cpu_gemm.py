"""oneDNN-packed bf16 weights for the CPU path, as vLLM's CPU backend prepares its linears after loading.

oneDNN reads a weight it reordered once into its own blocked layout faster than a plain row-major [N, K]
bf16 tensor: 1.3-1.6x for decode-sized inputs (M = 1..16) on the 2-core AVX512-BF16 VM of the README, with
bit-identical results (the same kernel, minus its per-call reorder). `pack_linears(model)`:
- swaps every bf16 `nn.Linear` for a `PackedLinear` that keeps the same `weight` Parameter, so parameter
  names, `state_dict` and code reading `.weight` are unchanged;
- packs every stacked bf16 expert weight [E, N, K] expert by expert, for `ops.grouped_matmul`.
A packed weight is repacked when its Parameter changed: in place (the tensor version counter) or by a new
`.data` (its storage); a Parameter that is no longer bf16 on CPU (`model.float()`) takes the plain GEMM.
The packed copies sit beside the originals: the CPU path holds its bf16 weights twice.
NPU and CUDA keep their own GEMMs; this module is a no-op there, and where torch has no oneDNN.
"""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

PACKED_ATTR = "_onednn_packed"  # on a stacked [E, N, K] Parameter: (stamp, [packed expert weights])


@functools.cache
def _onednn() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")


def available(weight: torch.Tensor) -> bool:
    return weight.device.type == "cpu" and weight.dtype == torch.bfloat16 and _onednn()


def pack(weight: torch.Tensor) -> torch.Tensor:
    """[N, K] bf16 -> oneDNN's blocked layout (an opaque mkldnn tensor)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), 16)  # 16: a decode-sized batch hint


def stamp(weight: torch.Tensor) -> tuple[int, int]:
    """What a packed copy was made from: in-place writes bump the version, a new `.data` moves the storage."""
    return weight._version, weight.data_ptr()


def linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] @ W.T (+ bias) with W packed by `pack` -> [..., N]."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


class PackedLinear(nn.Module):
    """nn.Linear with its weight also held packed; same parameters, same outputs."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight, self.bias = linear.weight, linear.bias
        self._packed, self._stamp = pack(self.weight), stamp(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype != self.weight.dtype or not available(self.weight):
            return F.linear(x, self.weight, self.bias)
        if self._stamp != stamp(self.weight):
            self._packed, self._stamp = pack(self.weight), stamp(self.weight)
        return linear(x, self._packed, self.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, packed"


def packed_experts(weight: torch.Tensor) -> list[torch.Tensor] | None:
    """The packed experts of a stacked weight [E, N, K] that `pack_linears` prepared, kept current; else None."""
    entry = getattr(weight, PACKED_ATTR, None)
    if entry is None or not available(weight):
        return None
    if entry[0] != stamp(weight):
        entry = stamp(weight), [pack(w) for w in weight]
        setattr(weight, PACKED_ATTR, entry)
    return entry[1]


def pack_linears(model: nn.Module) -> int:
    """Pack every bf16 CPU linear and stacked expert weight of `model` in place; returns how many weights."""
    count = 0
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if type(child) is nn.Linear and available(child.weight):
                setattr(module, name, PackedLinear(child))
                count += 1
    for module in model.modules():
        if isinstance(module, nn.modules.conv._ConvNd):
            continue
        for p in module.parameters(recurse=False):
            if p.dim() == 3 and available(p) and not hasattr(p, PACKED_ATTR):
                setattr(p, PACKED_ATTR, (stamp(p), [pack(w) for w in p]))
                count += 1
    return count
