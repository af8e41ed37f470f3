"""A fresh chunk of CPython's frame stack for a hot loop's body (the engine's step), so its calls never cross a chunk
boundary over and over.

CPython (3.11 on) keeps its frames on a per-thread stack of chunks (16 KiB by default). A call that does not fit the
current chunk gets a new one (mmap), and the chunk is freed (munmap) as soon as that call returns: a loop that calls
at exactly the depth of a boundary maps and unmaps a chunk on every call (cpython gh-142183, fixed in 3.13 / 3.14
by caching one chunk; 3.11 and 3.12 have no fix). With an OpenMP worker on the other core, each munmap also sends
it a TLB-shootdown interrupt, which on a VM is a hypervisor exit. Where the boundaries fall depends on how deep the
caller is (the lines of the driving script move it), which is why the same compiled decode graph of the DeepSeek-V3
bench checkpoint ran 22.2 / 45.8 ms a step at batch 1 / 16 from one script and 14.9 / 35.7 from another (Xeon, bf16,
2 threads, 2026-12-05: 12,180 context switches in the slow run against 4,295; the munmaps of 16 KiB chunks from
`_PyThreadState_PopFrame`, 8 % of the samples in the kernel's IPI path); run under `call_on_fresh_chunk` the slow
one ran 16.7 / 37.3 ms.

`call_on_fresh_chunk(fn)` calls fn from a frame that takes just over half of a 128 KiB chunk: it never fits a
chunk that is in use (a default one is 16 KiB, and one of these has less than half of itself left), so it always
starts a chunk of its own, and fn's calls have the other ~64 KiB of it before any of them could cross a boundary: a
chunk mapped and unmapped once a call, instead of once per crossing. The reserved slots are never touched: only the
pages fn's frames use are.
"""
from __future__ import annotations

import sys
import types
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")

CHUNK_BYTES = 128 * 1024  # the chunk the reserving frame opens (CPython sizes a chunk as a power of 2 >= the frame)
RESERVED_SLOTS = CHUNK_BYTES // 2 // 8 + 16  # the reserving frame's extra stack slots: just over half the chunk


def _call(fn, args, kwargs):
    return fn(*args, **kwargs)


if sys.implementation.name == "cpython":  # its frames' sizes come from their code objects
    _call_reserved = types.FunctionType(_call.__code__.replace(co_stacksize=_call.__code__.co_stacksize
                                                               + RESERVED_SLOTS), _call.__globals__, "_call_reserved")
else:
    _call_reserved = _call


def call_on_fresh_chunk(fn: Callable[..., T], *args, **kwargs) -> T:
    """fn(*args, **kwargs), its frames on a chunk of the frame stack of their own (see the module's text)."""
    return _call_reserved(fn, args, kwargs)
