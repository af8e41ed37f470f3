"""Which device this process computes on, chosen once: npu (torch_npu imports) > cuda > cpu.

Override with NPU_COOKBOOK_DEVICE=npu|cuda|cpu (e.g. force the CPU reference path on an NPU host).
Everything device-specific that is not a fused op (dist backend name, sync, memory) lives here.
"""
from __future__ import annotations

import ctypes
import functools
import importlib
import os
import sys

import torch

DEVICE_ENV = "NPU_COOKBOOK_DEVICE"
_DIST_BACKENDS = {"npu": "hccl", "cuda": "nccl", "cpu": "gloo"}


@functools.cache
def torch_npu():
    """The torch_npu module, or None where it does not import (CPU / CUDA machines)."""
    try:
        return importlib.import_module("torch_npu")
    except Exception:  # ImportError, or a CANN toolkit that is missing / not sourced
        return None


@functools.cache
def device_type() -> str:
    forced = os.environ.get(DEVICE_ENV, "").strip().lower()
    if forced:
        if forced not in _DIST_BACKENDS:
            raise ValueError(f"{DEVICE_ENV}={forced!r}: expected one of {sorted(_DIST_BACKENDS)}")
        if forced == "npu" and torch_npu() is None:
            raise RuntimeError(f"{DEVICE_ENV}=npu but torch_npu does not import (is the CANN toolkit sourced?)")
        if forced == "cuda" and not torch.cuda.is_available():
            raise RuntimeError(f"{DEVICE_ENV}=cuda but no CUDA device is visible")
        return forced
    if torch_npu() is not None and torch.npu.is_available():
        return "npu"
    if torch.cuda.is_available():
        return "cuda"
    return "cpu"


def is_npu() -> bool:
    return device_type() == "npu"


def device(index: int | None = None) -> torch.device:
    kind = device_type()
    if kind == "cpu":
        return torch.device("cpu")
    if index is None:
        index = int(os.environ.get("LOCAL_RANK", 0))
    return torch.device(kind, index)


def dist_backend() -> str:
    """torch.distributed backend for this device: hccl on NPU, nccl on CUDA, gloo on CPU."""
    return _DIST_BACKENDS[device_type()]


def _module():
    return getattr(torch, device_type(), None)


def synchronize() -> None:
    if device_type() != "cpu":
        _module().synchronize()


def empty_cache() -> None:
    if device_type() != "cpu":
        _module().empty_cache()


def reset_peak_memory() -> None:
    if device_type() != "cpu":
        _module().reset_peak_memory_stats()


def peak_memory_bytes() -> int:
    """Peak device memory since the last reset; on CPU the process's peak resident set size."""
    if device_type() != "cpu":
        return int(_module().max_memory_allocated())
    import resource

    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024  # Linux reports KiB


def memory_info() -> tuple[int, int]:
    """(free, total) bytes on the current device; on CPU, available and total host memory."""
    if device_type() != "cpu":
        return tuple(int(v) for v in _module().mem_get_info())
    return host_memory_available(), os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def host_memory_available() -> int:
    """Host memory a new allocation can get without swapping: free pages plus the page cache the kernel would
    reclaim (Linux's MemAvailable), not the free pages alone (a machine that read files has few)."""
    import psutil

    return int(psutil.virtual_memory().available)


@functools.cache
def keep_freed_host_memory() -> bool:
    """glibc on Linux: keep freed memory in the heap instead of handing it back to the OS after every big tensor.

    CPU inference allocates and frees tensors of tens of MB every op; by default glibc returns them (munmap /
    trim) and the next op page-faults them in again, which measured 45% of a prefill step here. glibc serves
    anything at or above its mmap threshold (32 MiB at most) with a fresh mmap whatever the settings, so mmap is
    switched off too: a 2,048-token step's [T, 4 * 1024] fp32 temporaries are exactly 32 MiB (2.2-2.8 s a step
    with mmap, 2.0 s without).
    Returns whether the setting took. Called once by the engine on the CPU path."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return False
    M_TRIM_THRESHOLD, M_TOP_PAD, M_MMAP_THRESHOLD, M_MMAP_MAX = -1, -2, -3, -4
    return all(libc.mallopt(opt, value) == 1 for opt, value in
               ((M_MMAP_THRESHOLD, 32 * 2**20), (M_TRIM_THRESHOLD, 2**31 - 1), (M_TOP_PAD, 256 * 2**20),
                (M_MMAP_MAX, 0)))


# -- compute dtype ------------------------------------------------------------------------------------------------
# bf16 halves the bytes a GEMM reads; whether a CPU computes it fast depends on its kernels. torch 2.13's CPU build
# runs bf16 GEMMs in oneDNN where `torch.ops.mkldnn._is_mkldnn_bf16_supported()` (x86 from AVX-512 on, emulated with
# fp32 FMAs below AVX512-BF16) and in ATen's own loops elsewhere (an AVX2-only x86): x @ W.T there at ~30-55 GFLOP/s
# on 2 cores, [M, K] @ [K, N] at ~1.3, against fp32's ~230 (scripts/cpu_dtype_probe.py, README "CPU dtype").
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
AUTO = "auto"  # a preset's or a flag's dtype: follow default_dtype()
# oneDNN ISA caps (ONEDNN_MAX_CPU_ISA, legacy DNNL_MAX_CPU_ISA) below the first ISA with bf16 dot products
_ONEDNN_ISAS_WITHOUT_BF16 = ("SSE41", "AVX", "AVX2", "AVX2_VNNI", "AVX2_VNNI_2", "AVX512_CORE", "AVX512_CORE_VNNI")


def _onednn_isa_cap() -> str:
    """The ISA cap oneDNN reads from the environment ('' when unset); torch does not expose oneDNN's effective ISA."""
    return (os.environ.get("ONEDNN_MAX_CPU_ISA") or os.environ.get("DNNL_MAX_CPU_ISA") or "").strip().upper()


@functools.cache
def cpu_bf16_kind() -> str:
    """How this process's CPU runs bf16 GEMMs: 'native' (bf16 instructions: AVX512-BF16 / AMX on x86, oneDNN's bf16
    kernels on ARM), 'emulated' (oneDNN bf16 kernels on AVX-512 without bf16 instructions, converting to fp32) or
    'none' (no oneDNN bf16 kernels: an AVX2-only x86, or torch without oneDNN).

    `_is_mkldnn_bf16_supported()` asks oneDNN, which honours ONEDNN_MAX_CPU_ISA; the instruction flags
    (`torch.cpu._is_avx512_bf16_supported()` / `_is_amx_tile_supported()`) read cpuid, which no variable limits, so
    native also needs oneDNN's ISA cap and ATen's kernel level (ATEN_CPU_CAPABILITY) to allow AVX-512: that way
    `ONEDNN_MAX_CPU_ISA=AVX512_CORE` (emulated) and `ONEDNN_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2` (none)
    classify a simulated CPU as the real one would be."""
    try:
        onednn_bf16 = torch.backends.mkldnn.is_available() and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):  # a torch build without the op
        onednn_bf16 = False
    if not onednn_bf16:
        return "none"
    import platform

    if platform.machine().lower() not in ("x86_64", "amd64", "i386", "i686"):
        return "native"  # oneDNN (ideep) reports bf16 on ARM only where the CPU has the bf16 extension
    instructions = torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()
    capped = _onednn_isa_cap() in _ONEDNN_ISAS_WITHOUT_BF16
    aten_avx512 = torch.backends.cpu.get_cpu_capability() == "AVX512"
    return "native" if instructions and not capped and aten_avx512 else "emulated"


@functools.cache
def onednn_amx() -> bool:
    """Whether oneDNN runs its bf16 GEMMs on AMX here: native bf16 (cpu_bf16_kind), AMX tiles on the CPU, and
    oneDNN's ISA cap, where one is set, an AMX one."""
    cap = _onednn_isa_cap()
    allowed = cap in ("", "ALL", "DEFAULT") or "AMX" in cap
    return cpu_bf16_kind() == "native" and torch.cpu._is_amx_tile_supported() and allowed


def cpu_model_name() -> str:
    """The CPU's model name as the OS reports it (for benches' headers)."""
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform

    return platform.processor() or platform.machine()


def cpu_description() -> str:
    """The CPU kind in a few words, naming a simulation by environment variable when one is set."""
    kind = cpu_bf16_kind()
    isa = torch.backends.cpu.get_cpu_capability()
    if kind == "native":
        text = "AMX" if torch.cpu._is_amx_tile_supported() else ("AVX512-BF16" if isa == "AVX512" else isa)
    elif kind == "emulated":
        text = f"{isa} without bf16 instructions"
    else:
        text = isa if isa != "DEFAULT" else "no vector ISA torch uses"
    simulated = [f"{name}={os.environ[name]}" for name in ("ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA",
                                                          "ATEN_CPU_CAPABILITY") if os.environ.get(name)]
    return text + (f", simulated by {' '.join(simulated)}" if simulated else "")


def default_dtype() -> torch.dtype:
    """The compute dtype a recipe uses when nothing asks for one: bf16 on NPU / CUDA and on CPUs whose oneDNN runs
    bf16 GEMMs ('native' and 'emulated'), fp32 on the others ('none': AVX2-only x86, no oneDNN). Measured on the
    recipes' GEMM shapes, 1 and 2 threads (scripts/cpu_dtype_probe.py, README "CPU dtype"), bf16 time / fp32 time:
    - native: 0.13-0.30 with oneDNN-packed weights, 0.22-0.63 without;
    - emulated (AVX-512 without bf16 instructions): decode 0.27-0.43 at batch 1 and 0.41-0.72 at batch 16 (half
      the weight bytes), 1.0-1.22 at prefill-chunk and DiT sizes: the decode gain outweighs the compute loss;
    - none: decode 0.22-0.40 at batch 1 but 0.7-1.2 at batch 16 and 3.6-4.0 at prefill and DiT sizes, and any bf16
      GEMM outside the nn.Linear layout ([M, K] @ [K, N]) runs at ~1 GFLOP/s (90-170x fp32's time): fp32.
    Keeping weights bf16 and upcasting them per GEMM (fp32 compute) took 1.6-2.3x fp32's time at batch-1 decode,
    0.84-1.5x at batch 16 and 0.94-1.16x at prefill and DiT sizes: it saves memory, not time, so no default uses it."""
    if device_type() != "cpu":
        return torch.bfloat16
    return torch.float32 if cpu_bf16_kind() == "none" else torch.bfloat16


def gemm_peak_gflops(dtype: torch.dtype, sizes=(512, 1024, 2048), reps: int = 5, clock=None) -> float:
    """Best GFLOP/s of an n^3 GEMM (n in `sizes`) in `dtype` on this process's device and its current torch thread
    count, in the layout every nn.Linear runs (x [n, n] @ W[n, n].T): the peak a bench's achieved rate is a share
    of, so measured in the run's own dtype, threads and clock (`clock`: e.g. time.thread_time; default wall time).
    Several sizes, because without oneDNN bf16 the mid-sized GEMMs a model runs beat a 2048^3 one. A bf16 peak under
    an fp32 run, or bf16 [M, K] @ [K, N] (~1 GFLOP/s in torch's CPU build without oneDNN bf16, against ~30-50 for
    the linear layout), made benches print shares above 100%."""
    rates = []
    for n in sizes:
        x, w = (torch.randn(n, n, device=device()).to(dtype) for _ in range(2))
        rates.append(2 * n**3 / _best_seconds(lambda: torch.nn.functional.linear(x, w), reps, clock) / 1e9)
    return max(rates)


def attention_peak_gflops(dtype: torch.dtype, seqs=(512, 1024), heads: int = 8, head_dim: int = 128, reps: int = 3,
                          clock=None) -> float:
    """Best GFLOP/s (4 n^2 d per head: scores and values) of torch's fused attention (scaled_dot_product_attention)
    in `dtype` on this device, at the current thread count. A DiT's peak reference is the larger of this and
    gemm_peak_gflops: without oneDNN bf16 the fused attention computes bf16 inputs in fp32 at ~3x the bf16 GEMM rate,
    so a GEMM-only peak would not bound a bf16 forward's achieved rate."""
    rates = []
    for n in seqs:
        q, k, v = (torch.randn(1, heads, n, head_dim, device=device()).to(dtype) for _ in range(3))
        seconds = _best_seconds(lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v), reps, clock)
        rates.append(4 * heads * n * n * head_dim / seconds / 1e9)
    return max(rates)


def _best_seconds(fn, reps: int, clock=None) -> float:
    """The fastest of `reps` timed calls of fn, after one warm-up (oneDNN primitive creation), device synced."""
    import time

    clock = clock or time.perf_counter
    fn()
    best = float("inf")
    for _ in range(reps):
        synchronize()
        start = clock()
        fn()
        synchronize()
        best = min(best, clock() - start)
    return best


def dtype_name(dtype: torch.dtype) -> str:
    return next((name for name, d in DTYPES.items() if d == dtype), str(dtype).removeprefix("torch."))


def describe_dtype_choice(dtype: torch.dtype, source: str | None = None) -> str:
    """The one start-up line saying which compute dtype a run uses and why: `source` is where an explicit dtype
    came from ('--dtype', 'configs/x.yaml'); None means chosen by default_dtype()."""
    if source is not None:
        return f"dtype: {dtype_name(dtype)} (from {source})"
    if device_type() != "cpu":
        return f"dtype: {dtype_name(dtype)} (auto: {device_type()})"
    why = {"native": "this CPU has bf16 GEMM instructions",
           "emulated": "oneDNN emulates bf16 GEMMs on this CPU",
           "none": "this CPU runs bf16 GEMMs without native support"}[cpu_bf16_kind()]
    return f"dtype: {dtype_name(dtype)} (auto: {why}, {cpu_description()})"


def resolve_dtype(flag: str | None, preset: str | None, preset_source: str | None = None) -> tuple[torch.dtype, str]:
    """--dtype flag > a preset's dtype > default_dtype(): a flag given (even 'auto') decides; without one the
    preset's dtype does, 'auto' or none meaning default_dtype(). -> (dtype, the start-up line). Names are DTYPES'
    keys or 'auto'; a recipe checks them before calling."""
    name, source = (flag, "--dtype") if flag is not None else (preset, preset_source or "the preset")
    if name is not None and name != AUTO:
        return DTYPES[name], describe_dtype_choice(DTYPES[name], source)
    dtype = default_dtype()
    return dtype, describe_dtype_choice(dtype)
