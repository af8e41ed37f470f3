"""oneDNN-packed bf16 and fp32 weights for the CPU path, as vLLM's CPU backend prepares its linears after loading.

oneDNN reads a weight it reordered once into its own blocked layout faster than a plain row-major [N, K] tensor:
in bf16 1.3-1.6x for decode-sized inputs (M = 1..16) on the 2-core AVX512-BF16 VM of the README, with bit-identical
results (the same kernel, minus its per-call reorder); in fp32 2-3x (the plain fp32 GEMM is MKL's, which on AMD
CPUs takes a slow path: a [4096, 1024] weight at M = 16, 1.9 -> 0.8 ms on Zen 4 as AVX2; the sums in another order, so
within fp32 rounding of the plain outputs, not equal to them). `pack_model(model)` is the last step
before inference: the ModelRunner calls it once, after loading. It converts in place
- every bf16 / fp32 `nn.Linear` into a `PackedLinear` that holds its weight packed only (its bias stays a Parameter);
- every stacked bf16 / fp32 expert Parameter [E, N, K] into a `PackedExperts` (one packed weight per expert), which
  `ops.grouped_matmul` takes in place of the dense stack,
and drops the dense weights: each weight is held once, so no copy can go stale.
After it the model is for inference only. The packed weights are no longer parameters (`named_parameters`,
`load_weights` and optimizers do not see them, and a Parameter object kept from before is no longer read);
`state_dict()` still gives them dense (the round trip is exact), `load_state_dict` raises; a conversion
(`model.float()`) leaves them in their dtype and the next forward raises; a PackedLinear has no `.weight` to read
(a model that reads a linear's weight directly should hold it in a module of its own, not an nn.Linear);
`copy.deepcopy` packs the copy's weights anew.
bf16 packing needs oneDNN's bf16 kernels: where torch says this CPU has none (`_is_mkldnn_bf16_supported()`: no
AVX512-BW/VL/DQ nor AVX-NE-CONVERT, e.g. AVX2-only x86) bf16 weights stay dense; fp32 packing needs oneDNN on an
x86 CPU (on ARM torch's fp32 GEMMs stay). Where torch has no oneDNN, and on NPU and CUDA, `pack_model` packs nothing
and the plain GEMMs run.
"""
from __future__ import annotations

import copy
import functools
import platform
from collections import Counter

import torch
from torch import nn

from common import backend
from common.custom_op import direct_register_custom_op

INFERENCE_ONLY = "packed for inference by common.cpu_gemm.pack_model: load weights before packing"


X86 = ("x86_64", "amd64", "i386", "i686")


@functools.cache
def supported(dtype: torch.dtype = torch.bfloat16) -> bool:
    """Whether oneDNN runs GEMMs of this dtype on packed weights here: bf16 where torch says its bf16 kernels run,
    fp32 on an x86 CPU (asked once per dtype)."""
    mkldnn = torch.ops.mkldnn
    if not (torch.backends.mkldnn.is_available() and hasattr(mkldnn, "_reorder_linear_weight")):
        return False
    if dtype == torch.float32:
        return platform.machine().lower() in X86
    return dtype == torch.bfloat16 and hasattr(mkldnn, "_is_mkldnn_bf16_supported") \
        and bool(mkldnn._is_mkldnn_bf16_supported())


def available(weight: torch.Tensor) -> bool:
    """Whether `weight` can be packed: bf16 or fp32 on CPU, and oneDNN runs that dtype here."""
    return weight.device.type == "cpu" and weight.dtype in (torch.bfloat16, torch.float32) and supported(weight.dtype)


WIDE_ROWS = 8192  # a weight of this many rows (N) or more is packed for one-row batches on AMX


def pack(weight: torch.Tensor) -> torch.Tensor:
    """[N, K] bf16 / fp32 -> oneDNN's blocked layout (an opaque mkldnn tensor; `.to_dense()` gives the weight back).

    The layout follows a batch-size hint: 16 (decode-sized), but 1 for a wide weight on AMX, which oneDNN then
    reads faster at 1-16 rows alike (2 threads, Xeon, weights from DRAM: LM head [16384, 1024] 1.40 -> 1.12 ms at
    16 rows, [12288, 1024] 1.18 -> 0.99 ms; no change below 8,192 rows; without AMX hint 1 is slower: 1.32 -> 1.71
    ms for the LM head at one row).

    Always a normal tensor, also when packed under inference mode (MoE offload repacks an expert in an engine
    step): a compiled graph guards on its weights' dispatch keys, and an inference tensor's differ (a recompile)."""
    hint = 1 if weight.shape[0] >= WIDE_ROWS and backend.onednn_amx() else 16
    with torch.inference_mode(False):
        return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), hint)


def linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] @ W.T (+ bias) with W packed by `pack` -> [..., N]."""
    if x.dtype != packed.dtype:
        want, got = backend.dtype_name(packed.dtype), backend.dtype_name(x.dtype)
        raise TypeError(f"oneDNN-packed {want} weights take {want} inputs, got {got}: the model was packed for "
                        "inference by common.cpu_gemm.pack_model (convert it before packing)")
    if torch.compiler.is_compiling():  # one custom op, which torch.compile keeps as it is
        return torch.ops.npu_cookbook.packed_linear(x, packed, bias)
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def _packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """oneDNN's linear on a packed weight (inductor's own oneDNN lowering expects a weight it froze itself, not one
    packed before, so a compiled graph calls this instead)."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


direct_register_custom_op("packed_linear", _packed_linear,
                          lambda x, packed, bias: x.new_empty(*x.shape[:-1], packed.shape[0]))


class PackedLinear(nn.Module):
    """An inference-only bf16 / fp32 nn.Linear whose weight is held packed only; the same outputs (fp32: within
    rounding)."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.bias = linear.bias
        self._packed = pack(linear.weight)  # [N, K] packed; not a parameter

    def __getattr__(self, name: str):
        if name == "weight":
            raise AttributeError(f"{type(self).__name__} has no dense weight: {INFERENCE_ONLY}")
        return super().__getattr__(name)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self._packed, self.bias)

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        destination[prefix + "weight"] = self._packed.to_dense()  # [N, K], exact
        super()._save_to_state_dict(destination, prefix, keep_vars)

    def _load_from_state_dict(self, *args, **kwargs):
        raise RuntimeError(f"{type(self).__name__}: {INFERENCE_ONLY}")

    def __deepcopy__(self, memo):
        """A copy with its own packed weight (an opaque oneDNN tensor has no storage to copy)."""
        new = type(self).__new__(type(self))
        memo[id(self)] = new
        new.__dict__.update({k: pack(v.to_dense()) if k == "_packed" else copy.deepcopy(v, memo)
                             for k, v in self.__dict__.items()})
        return new

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, packed"


class PackedExperts:
    """A stacked expert weight [E, N, K] held as E oneDNN-packed [N, K] weights only, for `ops.grouped_matmul` and
    common.cpu_moe. Not a tensor: it has `.shape`, `.dtype`, `.device` and `to_dense()`; anything else (indexing,
    `.data`) fails."""

    def __init__(self, weight: torch.Tensor):
        self.shape, self.dtype, self.device = weight.shape, weight.dtype, weight.device
        self.experts = [pack(w) for w in weight]  # E x [N, K] packed

    def set_expert(self, e: int, weight: torch.Tensor) -> None:
        """Replace expert e's [N, K] weight (MoE offload's resident slots), packed."""
        self.experts[e] = pack(weight.to(self.dtype))

    def to_dense(self) -> torch.Tensor:
        return torch.stack([w.to_dense() for w in self.experts])  # [E, N, K], exact

    def __deepcopy__(self, memo):
        return PackedExperts(self.to_dense())

    def __repr__(self) -> str:
        return f"PackedExperts(shape={tuple(self.shape)}, dtype={self.dtype})"


def _save_experts(module: nn.Module, state_dict, prefix: str, local_metadata) -> None:
    for name, value in vars(module).items():
        if isinstance(value, PackedExperts):
            state_dict[prefix + name] = value.to_dense()


def _refuse_load(module: nn.Module, *args) -> None:
    raise RuntimeError(f"{type(module).__name__} holds PackedExperts: {INFERENCE_ONLY}")


def pack_model(model: nn.Module) -> int:
    """Pack every bf16 / fp32 CPU linear and stacked expert weight of `model` in place, dropping the dense copies
    (see the module docstring); returns how many weights. A weight held in two places (tied) stays dense, and so
    does one of a dtype oneDNN does not run here (`supported`)."""
    uses = Counter(id(p) for _, p in model.named_parameters(remove_duplicate=False))  # a tied weight stays dense
    count = 0
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if type(child) is nn.Linear and available(child.weight) and uses[id(child.weight)] == 1:
                setattr(module, name, PackedLinear(child))
                count += 1
    for module in model.modules():
        if isinstance(module, nn.modules.conv._ConvNd):
            continue
        stacks = [n for n, p in module.named_parameters(recurse=False)
                  if p.dim() == 3 and available(p) and uses[id(p)] == 1]
        for name in stacks:
            packed = PackedExperts(module._parameters[name])
            delattr(module, name)  # the dense stack goes
            setattr(module, name, packed)
        if stacks:
            module.register_state_dict_post_hook(_save_experts)
            module.register_load_state_dict_pre_hook(_refuse_load)
        count += len(stacks)
    return count
