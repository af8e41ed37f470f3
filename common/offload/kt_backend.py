"""Host experts on kt-kernel's CPU MXFP4 MoE kernels (KTransformers), optional.

kt-kernel ships one extension per x86 ISA level and picks one from /proc/cpuinfo at import
(`KT_KERNEL_CPU_VARIANT` overrides). Its MXFP4 kernels read the publisher's layout as is (low nibble = input 2i, one
scale per 32 inputs; tests/common/test_offload_host_experts.py decodes every weight back through the kernel), with
the scales as bf16 (e8m0 -> bf16 is exact: the exponent byte shifted into place). `AMXFP4_KGroup_MOE` needs
AVX512-BF16 (it runs without AMX), `AVX2MXFP4_MOE` AVX2 + FMA. Only the raw extension API is used: kt-kernel's
Python wrapper needs pinned memory (an accelerator build of torch) and the `gguf` package.

Activations go in as bf16 and come out as bf16: the kernel's rounding (bf16 input, bf16 intermediate and output) is
what separates it from TorchHostExperts.
"""
from __future__ import annotations

import functools
import importlib.util
import os
import sys
from collections.abc import Iterable

import torch

from .host_experts import HostExperts, HostMoEHandle, MXFP4Experts

KERNELS = {"avx512": "AMXFP4_KGroup_MOE", "avx2": "AVX2MXFP4_MOE"}


@functools.cache
def kt_cpu_detect():
    """kt-kernel's own ISA detection and extension loader (`_cpu_detect.py`), without its Python wrapper's imports;
    None where kt-kernel is not installed."""
    spec = importlib.util.find_spec("kt_kernel")
    if spec is None or not spec.submodule_search_locations:
        return None
    detect_spec = importlib.util.spec_from_file_location(
        "kt_kernel_cpu_detect", os.path.join(spec.submodule_search_locations[0], "_cpu_detect.py"))
    detect = importlib.util.module_from_spec(detect_spec)
    detect_spec.loader.exec_module(detect)
    return detect


def denormals_flushed() -> bool:
    """Whether this thread's floating-point unit flushes subnormal numbers to zero."""
    return bool(torch.tensor([1e-40], dtype=torch.float32).mul(1).eq(0).item())  # 1e-40 is subnormal in fp32


@functools.cache
def load_kt_kernel():
    """(kt_kernel_ext, cpu variant, None) or (None, None, the one-line reason it cannot run here)."""
    try:
        detect = kt_cpu_detect()
        if detect is None:
            return None, None, "kt-kernel is not installed (pip install --no-deps kt-kernel==0.7.2)"
        if "kt_kernel_ext" in sys.modules:  # `import kt_kernel` loaded it already: an extension loads once
            ext = sys.modules["kt_kernel_ext"]
            variant = str(getattr(ext, "__cpu_variant__", "unknown"))
        else:
            flushed = denormals_flushed()
            ext, variant = detect.initialize()
            if not flushed and denormals_flushed():  # its library, built with -ffast-math, set FTZ / DAZ on load:
                torch.set_flush_denormal(False)  # for the whole thread, every later computation included
    except (ImportError, OSError, RuntimeError) as e:
        return None, None, f"kt-kernel's extension does not load here: {str(e).splitlines()[0]}"
    if not any(hasattr(ext.moe, cls) for cls in KERNELS.values()):
        return None, variant, f"kt-kernel's {variant} build has no MXFP4 MoE kernel"
    return ext, variant, None


def kt_kernel_unavailable() -> str | None:
    """None where kt-kernel's MXFP4 kernels run here, else the reason they do not."""
    return load_kt_kernel()[2]


def pick_kernel(ext, kernel: str | None) -> str:
    """The MXFP4 MoE class: `kernel` ("avx512" | "avx2"), else KT_MXFP4_BACKEND, else the best one built."""
    kernel = kernel or os.environ.get("KT_MXFP4_BACKEND", "").strip().lower() or None
    if kernel is not None and kernel not in KERNELS:
        raise ValueError(f"unknown kt-kernel MXFP4 kernel {kernel!r}: expected one of {sorted(KERNELS)}")
    for name in [kernel] if kernel else list(KERNELS):
        if hasattr(ext.moe, KERNELS[name]):
            return name
    raise ValueError(f"kt-kernel's loaded build has no {KERNELS[kernel]} (MXFP4 kernel {kernel!r})")


@functools.cache
def cpu_infer(threads: int):
    """The process's kt-kernel thread pool of `threads` workers, shared by every layer and backend object."""
    return load_kt_kernel()[0].CPUInfer(threads)


def e8m0_to_bf16(scale: torch.Tensor) -> torch.Tensor:
    """e8m0 scales -> the same powers of two in bf16 (exact; code 0 = 2^-127 is the bf16 subnormal 0x0040)."""
    code = scale.view(torch.uint8).to(torch.int32)
    bits = torch.where(code == 0, 0x0040, code << 7)
    return bits.to(torch.int16).view(torch.bfloat16).contiguous()


class KTKernelHostExperts(HostExperts):
    """kt-kernel host experts: one MoE kernel object per layer, on the process's kt-kernel thread pool.

    Loading copies each layer into kt-kernel's own buffers (repacked there, once); the MXFP4Experts given are not
    kept, so a caller that drops its own references (or passes a generator that reads one layer at a time) holds
    the experts once. max_tokens: the most tokens one kernel call takes (its buffers' size); longer batches are
    split into calls of at most that many. threads: the pool's size (default: the CPUs this process may use)."""

    def __init__(self, layers: Iterable[tuple[int, MXFP4Experts]], num_experts_per_tok: int,
                 swiglu_limit: float | None, max_tokens: int = 256, threads: int | None = None,
                 kernel: str | None = None):
        ext, self.variant, reason = load_kt_kernel()
        if reason:
            raise RuntimeError(reason)
        if num_experts_per_tok < 1 or max_tokens < 1:
            raise ValueError(f"num_experts_per_tok ({num_experts_per_tok}) and max_tokens ({max_tokens}) must be >= 1")
        self.kernel = pick_kernel(ext, kernel)
        self.k, self.max_tokens, self.swiglu_limit = num_experts_per_tok, max_tokens, swiglu_limit
        self.threads = threads or len(os.sched_getaffinity(0))
        self.cpu = cpu_infer(self.threads)
        self._ext, self.moe, shapes = ext, {}, set()
        self._no_resident = None  # the kernels' own residency mask, read live by them: all False (ids < 0 skip)
        for layer, experts in layers:
            shapes.add((experts.num_experts, experts.hidden_size, experts.intermediate_size))
            if len(shapes) > 1:
                raise ValueError(f"every layer must have the same (experts, hidden, intermediate), "
                                 f"got {sorted(shapes)}")
            if layer in self.moe:
                raise ValueError(f"layer {layer} given twice")
            self.moe[layer] = self._load(layer, experts)
        if not self.moe:
            raise ValueError("no layers given")
        self.num_experts, self.hidden_size, self.intermediate_size = shapes.pop()
        self.layers = tuple(sorted(self.moe))

    def _load(self, layer: int, x: MXFP4Experts):
        E, I, D = x.num_experts, x.intermediate_size, x.hidden_size
        w13_scale, w2_scale = e8m0_to_bf16(x.w13_scale), e8m0_to_bf16(x.w2_scale)  # [E, 2I, D/32], [E, D, I/32]
        if self._no_resident is None:
            self._no_resident = torch.zeros(E, dtype=torch.bool)  # [E], shared by every layer's kernel
        cfg = self._ext.moe.MOEConfig(E, self.k, D, I, self._no_resident.data_ptr())
        cfg.layer_idx, cfg.pool, cfg.max_len = layer, self.cpu.backend_, self.max_tokens
        cfg.swiglu_limit = 0.0 if self.swiglu_limit is None else float(self.swiglu_limit)  # 0: no clamp
        cfg.quant_config.bits, cfg.quant_config.group_size, cfg.quant_config.zero_point = 4, 32, False
        rows = lambda t, part: [[t[e, part].data_ptr() for e in range(E)]]  # noqa: E731  per-expert views
        gate, up = slice(0, I), slice(I, 2 * I)
        cfg.gate_projs, cfg.up_projs, cfg.down_projs = rows(x.w13, gate), rows(x.w13, up), rows(x.w2, slice(None))
        cfg.gate_scales, cfg.up_scales = rows(w13_scale, gate), rows(w13_scale, up)
        cfg.down_scales = rows(w2_scale, slice(None))
        moe = getattr(self._ext.moe, KERNELS[self.kernel])(cfg)
        physical_to_logical = torch.arange(E, dtype=torch.int64)
        self.cpu.submit(moe.load_weights_task(physical_to_logical.data_ptr()))
        self.cpu.sync()  # every pointer above stays alive until here; the kernel now holds its own copy
        return moe

    def submit(self, layer, hidden, topk_ids, topk_weights) -> HostMoEHandle:
        self._check(layer, hidden, topk_ids, topk_weights)
        if topk_ids.shape[1] != self.k:
            raise ValueError(f"topk_ids has {topk_ids.shape[1]} experts per token, the kernels were built for {self.k}")
        # copies the kernel owns until sync (a compiled graph may reuse the callers' buffers before it syncs)
        x = hidden.to("cpu", torch.bfloat16, copy=True).contiguous()                  # [T, D]
        ids = topk_ids.to("cpu", torch.int64, copy=True).contiguous()                 # [T, k]
        weights = topk_weights.to("cpu", torch.float32, copy=True).contiguous()       # [T, k]
        out = torch.empty_like(x)                                                     # [T, D]
        keep = [x, ids, weights, out]
        for start in range(0, x.shape[0], self.max_tokens):
            n = min(self.max_tokens, x.shape[0] - start)
            qlen = torch.tensor([n], dtype=torch.int32)
            keep.append(qlen)
            self.cpu.submit(self.moe[layer].forward_task(
                qlen.data_ptr(), self.k, ids[start].data_ptr(), weights[start].data_ptr(), x[start].data_ptr(),
                out[start].data_ptr(), False))
        return HostMoEHandle(layer, out, hidden.dtype, hidden.device, keep=tuple(keep))

    def sync(self, handle: HostMoEHandle) -> torch.Tensor:
        if not handle.done:
            self.cpu.sync()
            handle.done = True
        return handle.out.to(handle.device, handle.dtype)
