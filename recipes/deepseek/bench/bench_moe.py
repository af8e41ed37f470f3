"""The routed experts of one MoE layer on CPU, at each batch size: the reference ops' composition (routing on the
device: ops.moe_init_routing, ops.grouped_matmul's loop, ops.moe_finalize_routing) against common.cpu_moe's
`fused_experts` (routing on the host), and the bandwidth bound of the experts they read.

    python bench/bench_moe.py [--threads 2] [--models deepseek-v3 deepseek-v4] [--batches 1 2 4 8 16 32 64]
                              [--repeats 5] [--kt]

The bench checkpoint's expert shapes (its config; random bf16 weights packed for oneDNN as the engine packs them),
as many layers as it has MoE layers, called in turn so each call reads its weights from DRAM; ms a layer, the best
of --repeats passes over the layers; the bound: the bytes of the experts the batch routes to at the measured read
bandwidth. Needs oneDNN's bf16 GEMMs (AVX512-BF16 or AMX): where there are none nothing is packed and the engine
runs neither. Prints the CPU, a progress bar per model, a table per model and the wall time.

--kt adds kt-kernel's bf16 MoE kernel (AMXBF16_MOE, else AVX2BF16_MOE) on the same weights (kt copies them into its
own buffers), timed after the others, on one worker thread: its pool counts the thread that runs its task queue as
a worker and the caller spins in sync(), so on two cores a second worker makes three busy threads. Its output is
checked against fused_experts' (relative L2 difference, layer 0): bf16 rounding gives ~5e-3, a wrong result ~1.
"""
from __future__ import annotations

import argparse
import time

import torch
from tqdm import tqdm

from bench_utils import BENCH_CONFIG, read_bandwidth
from common import backend, cpu_gemm, cpu_malloc, cpu_moe
from common.ops.reference import moe


def expert_shapes(name: str) -> tuple[int, int, int, int, int]:
    """(MoE layers, E, k, hidden, expert intermediate) of a bench checkpoint's config."""
    if name == "deepseek-v3":
        from tiny_deepseek_v3 import BENCH_SIZES as c
        layers = c["num_hidden_layers"] - c["first_k_dense_replace"]
    else:
        c = BENCH_CONFIG
        layers = c["num_hidden_layers"]
    return layers, c["n_routed_experts"], c["num_experts_per_tok"], c["hidden_size"], c["moe_intermediate_size"]


def reference_ops(x, w13, w2, weights, ids):
    xs, row_idx, counts = moe.moe_init_routing(x, ids, w13.shape[0])  # [T*k, D] by expert
    h = moe.swiglu(moe.grouped_matmul(xs, w13, counts))
    return moe.moe_finalize_routing(moe.grouped_matmul(h, w2, counts), weights, row_idx)


def best_ms(fn, layers, repeats: int) -> float:
    """The best of `repeats` passes of fn(layer) over the layers, ms a layer (one warm-up pass)."""
    for layer in layers:
        fn(layer)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for layer in layers:
            fn(layer)
        best = min(best, (time.perf_counter() - start) / len(layers))
    return best * 1e3


class KtBf16Layers:
    """kt-kernel's bf16 MoE objects for the layers' [E, 2I, D] / [E, D, I] weights, on one worker thread (see the
    module docstring); `(i, x, weights, ids)` runs layer i -> [T, D]. Holds what the kernels read at every call:
    their residency mask (all False: every expert on the host), read through the pointer their config took."""

    def __init__(self, raw: list, k: int):
        from common.offload.kt_backend import cpu_infer, load_kt_kernel
        ext = load_kt_kernel()[0]
        cls = getattr(ext.moe, "AMXBF16_MOE", None) or ext.moe.AVX2BF16_MOE
        self.cpu, self.k = cpu_infer(1), k
        self.resident = torch.zeros(raw[0][0].shape[0], dtype=torch.bool)  # [E], alive as long as the kernels
        self.kernels = []
        for i, (w13, w2) in enumerate(raw):
            E, two_i, D = w13.shape
            cfg = ext.moe.MOEConfig(E, k, D, two_i // 2, self.resident.data_ptr())
            cfg.layer_idx, cfg.pool, cfg.max_len = i, self.cpu.backend_, 64
            parts = [w13[:, :two_i // 2].contiguous(), w13[:, two_i // 2:].contiguous(), w2.contiguous()]
            cfg.gate_projs, cfg.up_projs, cfg.down_projs = ([[p[e].data_ptr() for e in range(E)]] for p in parts)
            cfg.gate_scales = cfg.up_scales = cfg.down_scales = [[0] * E]  # bf16: no scales
            self.kernels.append(cls(cfg))
            physical_to_logical = torch.arange(E)  # [E] int64, alive until the sync
            self.cpu.submit(self.kernels[-1].load_weights_task(physical_to_logical.data_ptr()))
            self.cpu.sync()  # the kernel holds its own copy of the weights from here

    def __call__(self, i: int, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        ids, weights, out = ids.long().contiguous(), weights.float().contiguous(), torch.empty_like(x)
        n = torch.tensor([x.shape[0]], dtype=torch.int32)
        self.cpu.submit(self.kernels[i].forward_task(n.data_ptr(), self.k, ids.data_ptr(), weights.data_ptr(),
                                                     x.data_ptr(), out.data_ptr(), False))
        self.cpu.sync()
        return out


def layer_rows(name: str, batches: list[int], repeats: int, bandwidth: float, kt: bool) -> list[tuple]:
    """(T, reference ms, fused_experts ms, bound ms, kt ms or None, kt's relative L2 difference from fused_experts on
    layer 0 or None) per batch size, per layer."""
    L, E, k, D, I = expert_shapes(name)
    g = torch.Generator().manual_seed(0)
    raw = [((torch.randn(E, 2 * I, D, generator=g) * 0.02).bfloat16(),
            (torch.randn(E, D, I, generator=g) * 0.02).bfloat16()) for _ in range(L)]
    layers = [(cpu_gemm.PackedExperts(w13), cpu_gemm.PackedExperts(w2)) for w13, w2 in raw]
    expert_bytes = (2 * I * D + D * I) * 2
    inputs = []
    for T in batches:
        weights, ids = torch.randn(T, E, generator=g).softmax(-1).topk(k)  # [T, k]
        inputs.append((torch.randn(T, D, generator=g).bfloat16(), weights, ids.int()))
    rows = []
    for x, weights, ids in tqdm(inputs, desc=f"{name} experts", unit="batch"):
        ref, fused = (best_ms(lambda w: fn(x, *w, weights, ids), layers, repeats)  # noqa: B023
                      for fn in (reference_ops, cpu_moe.fused_experts))
        touched = len(set(ids.flatten().tolist()))
        rows.append([x.shape[0], ref, fused, touched * expert_bytes / bandwidth * 1e3, None, None])
    if kt:
        call = KtBf16Layers(raw, k)
        for row, (x, weights, ids) in zip(rows, inputs):
            row[4] = best_ms(lambda i: call(i, x, weights, ids), range(L), repeats)  # noqa: B023
            want = cpu_moe.fused_experts(x, *layers[0], weights, ids).float()  # [T, D]
            row[5] = ((call(0, x, weights, ids).float() - want).norm() / want.norm()).item()
    return [tuple(row) for row in rows]


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--models", nargs="+", choices=("deepseek-v3", "deepseek-v4"), default=["deepseek-v3",
                                                                                            "deepseek-v4"])
    p.add_argument("--batches", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64], help="tokens a layer call")
    p.add_argument("--repeats", type=int, default=5, help="timed passes over the layers, the best kept")
    p.add_argument("--kt", action="store_true", help="add kt-kernel's bf16 MoE kernel, on one worker thread")
    a = p.parse_args()
    if min(a.batches) < 1 or a.repeats < 1:
        p.error("--batches and --repeats >= 1")
    if not cpu_gemm.supported():
        p.error("oneDNN has no bf16 GEMMs on this CPU (AVX2-only x86): nothing is packed, fused_experts never runs")
    start = time.perf_counter()
    torch.set_num_threads(a.threads)
    bandwidth = read_bandwidth(torch.bfloat16)
    print(f"bf16; {a.threads} threads; {backend.cpu_model_name()}, {backend.cpu_description()}; read bandwidth "
          f"{bandwidth / 1e9:.1f} GB/s", flush=True)
    if a.kt:
        from common.offload import kt_kernel_unavailable
        if (reason := kt_kernel_unavailable()) is not None:
            p.error(f"--kt: {reason}")
    tables = {name: layer_rows(name, sorted(set(a.batches)), a.repeats, bandwidth, a.kt) for name in a.models}
    for name, rows in tables.items():
        L, E, k, D, I = expert_shapes(name)
        print(f"\n{name}: one MoE layer's routed experts ({E} of [{2 * I}, {D}] and [{D}, {I}], top-{k}), ms a "
              "layer; bound: the experts routed to, read at the measured bandwidth")
        print(f"{'T':>4}{'reference ops':>15}{'fused_experts':>15}{'ratio':>8}{'bound':>8}{'fused / bound':>15}"
              + (f"{'kt bf16 (1 worker)':>20}{'fused / kt':>12}{'kt vs fused':>13}" if a.kt else ""))
        for T, ref, fused, bound, kt, diff in rows:
            print(f"{T:>4}{ref:>15.2f}{fused:>15.2f}{ref / fused:>7.2f}x{bound:>8.2f}{fused / bound:>14.2f}x"
                  + (f"{kt:>20.2f}{fused / kt:>11.2f}x{diff:>13.1e}" if a.kt else ""))
    print(f"wall time {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    cpu_malloc.reexec_with_tcmalloc()  # before any timing: glibc's malloc makes step times a lottery
    main()
