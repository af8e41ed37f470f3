"""tcmalloc for CPU runs: the allocator vLLM's CPU backend and IPEX recommend (LD_PRELOAD) in place of glibc's.

With glibc's malloc the engine's CPU step time depends on where the step's buffers land: on the Xeon, the same
decode graph of the DeepSeek-V3 bench checkpoint ran batch 4 at 27.5 or 38.5 ms a step from one process to the
next, depending only on what the driving script had allocated before (one more line of Python moved it), and the
time went into the host side of the expert GEMMs and the paged-attention gathers. Under tcmalloc the same scripts
ran 24.8-25.7 ms, and eager steps 5-10% faster too. (Some of that script-to-script swing was CPython's frame stack,
which common/frame_stack.py now keeps off the step's path; with it, tcmalloc still gave bench_graph.py's V3 graph
steps 15-30%: batch 1 / 4 / 16 at 17.0 / 25.7 / 35.9 ms against glibc's 20.8-21.9 / 29.6-30.0 / 44.3-46.5, same
hour, Xeon, bf16.)

`reexec_with_tcmalloc()` restarts the calling program (the same command line) with tcmalloc preloaded, when
Debian's `libtcmalloc-minimal4` (or another tcmalloc at a known path) is installed and not loaded yet; the benches
call it first. Set NPU_COOKBOOK_MALLOC=glibc to keep glibc's. Nothing else needs it: without tcmalloc every
result is the same, only some steps slower.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

ENV = "NPU_COOKBOOK_MALLOC"  # "glibc": no re-exec
REEXEC = "NPU_COOKBOOK_MALLOC_REEXEC"  # set in the restarted program: never restart twice
CANDIDATES = ("/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4",  # Debian / Ubuntu: libtcmalloc-minimal4
              "/usr/lib/aarch64-linux-gnu/libtcmalloc_minimal.so.4", "/usr/lib64/libtcmalloc_minimal.so.4")


def tcmalloc_path() -> str | None:
    """The first tcmalloc installed at a known path, or None."""
    return next((p for p in CANDIDATES if Path(p).exists()), None)


def tcmalloc_loaded() -> bool:
    """Whether this process runs on tcmalloc (preloaded or linked)."""
    try:
        with open("/proc/self/maps") as maps:
            return any("tcmalloc" in line for line in maps)
    except OSError:
        return False


def reexec_with_tcmalloc() -> None:
    """Restart this program with tcmalloc preloaded (see the module docstring); returns where it does not: already
    loaded, none installed, or NPU_COOKBOOK_MALLOC=glibc."""
    path = tcmalloc_path()
    if os.environ.get(ENV, "").lower() == "glibc" or REEXEC in os.environ or path is None or tcmalloc_loaded():
        return
    preload = " ".join(p for p in (path, os.environ.get("LD_PRELOAD", "")) if p)
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, sys.orig_argv, {**os.environ, "LD_PRELOAD": preload, REEXEC: "1"})
