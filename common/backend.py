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
    pages, avail = os.sysconf("SC_PHYS_PAGES"), os.sysconf("SC_AVPHYS_PAGES")
    size = os.sysconf("SC_PAGE_SIZE")
    return avail * size, pages * size


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
