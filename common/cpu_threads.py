"""OpenMP teams on CPU: the model's parallel ops keep the cores to one team of threads.

torch's CPU ops (and oneDNN's, and inductor's generated kernels) run their parallel regions in libgomp's OpenMP
teams: each host thread that starts parallel work gets a team of its own (itself and `torch.get_num_threads() - 1`
workers), kept while that thread lives. Between regions a team's workers spin (300,000 iterations) before they
sleep; but while libgomp manages more threads than the process has CPUs, every team spins only 100 iterations
(libgomp/env.c: `gomp_throttled_spin_count_var`, used by do_spin in config/linux/wait.h), so its workers sleep
between regions and each region pays a futex wake-up. A decode step is thousands of small regions: on the Xeon (2
cores, DeepSeek-V3 bench checkpoint, eager) batch 1 runs 22.4 ms a step with one team and 39.9 ms when a second
thread holds one, e.g. an engine stepped on a thread of its own after the main thread loaded the model, which
is how the OpenAI server runs it; any pool thread that ran one torch op on a large tensor does the same.

Hence:
- `release_team()`: the thread that built an engine and hands it to another ends its own team (its workers exit;
  it gets a new team if it runs parallel work again).
- `serial_thread()`: a helper thread (the server's executor threads, a KV sender) runs its torch ops on itself
  alone, so it never starts a team.

Both act on the libgomp that torch loaded (Linux, torch's CPU wheels); elsewhere (another OpenMP runtime, no
OpenMP) they do nothing and say so by returning False.
"""
from __future__ import annotations

import ctypes
import functools

import torch

OMP_PAUSE_HARD = 2  # omp_pause_resource_t (OpenMP 5.0): free the runtime's threads


@functools.cache
def _libgomp() -> ctypes.CDLL | None:
    """The libgomp this process has loaded (torch's), or None."""
    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if "libgomp" in line and line.rstrip().endswith(".so.1")}
    except OSError:
        return None
    for path in sorted(paths):
        lib = ctypes.CDLL(path)  # the loaded library itself: dlopen of a loaded path returns it
        if hasattr(lib, "omp_pause_resource_all") and hasattr(lib, "omp_set_num_threads"):
            return lib
    return None


def release_team() -> bool:
    """End the calling thread's OpenMP team: its worker threads exit. Call it on the thread that built an engine,
    before another thread steps it. False where torch's OpenMP is not libgomp (nothing done)."""
    lib = _libgomp()
    return lib is not None and lib.omp_pause_resource_all(OMP_PAUSE_HARD) == 0


def serial_thread() -> bool:
    """From now on the calling thread runs its torch CPU ops on itself alone, starting no OpenMP team (a helper
    thread's, beside the engine's). Another thread's count (torch.set_num_threads) is unchanged. False where
    torch's OpenMP is not libgomp (nothing done)."""
    lib = _libgomp()
    if lib is None:
        return False
    torch.get_num_threads()  # torch sets this thread's OpenMP count on its first use here: let it happen first
    lib.omp_set_num_threads(1)  # this thread's count (an OpenMP ICV of the calling thread)
    return True
