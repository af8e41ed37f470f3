"""The routed experts of one MoE layer on CPU, at each batch size: the reference ops' composition (routing on the
device: ops.moe_init_routing, ops.grouped_matmul's loop, ops.moe_finalize_routing) against common.cpu_moe's
`fused_experts` (routing on the host), and the bandwidth bound of the experts they read.

    python bench/bench_moe.py [--threads 2] [--models deepseek-v3 deepseek-v4] [--batches 1 2 4 8 16 32 64]
                              [--repeats 5]

The bench checkpoint's expert shapes (its config; random bf16 weights packed for oneDNN as the engine packs them),
as many layers as it has MoE layers, called in turn so each call reads its weights from DRAM; ms a layer, the best
of --repeats passes over the layers; the bound: the bytes of the experts the batch routes to at the measured read
bandwidth. Needs oneDNN's bf16 GEMMs (AVX512-BF16 or AMX): where there are none nothing is packed and the engine
runs neither. Prints the CPU, a progress bar per model, a table per model and the wall time.
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


def layer_rows(name: str, batches: list[int], repeats: int, bandwidth: float) -> list[tuple]:
    """(T, reference ms, fused_experts ms, bound ms) per batch size, per layer."""
    L, E, k, D, I = expert_shapes(name)
    g = torch.Generator().manual_seed(0)
    layers = [(cpu_gemm.PackedExperts((torch.randn(E, 2 * I, D, generator=g) * 0.02).bfloat16()),
               cpu_gemm.PackedExperts((torch.randn(E, D, I, generator=g) * 0.02).bfloat16())) for _ in range(L)]
    expert_bytes = (2 * I * D + D * I) * 2
    rows = []
    for T in tqdm(batches, desc=f"{name} experts", unit="batch"):
        x = torch.randn(T, D, generator=g).bfloat16()
        weights, ids = torch.randn(T, E, generator=g).softmax(-1).topk(k)  # [T, k]
        ids = ids.int()
        times = {}
        for fn in (reference_ops, cpu_moe.fused_experts):
            for w13, w2 in layers:
                fn(x, w13, w2, weights, ids)
            best = float("inf")
            for _ in range(repeats):
                start = time.perf_counter()
                for w13, w2 in layers:
                    fn(x, w13, w2, weights, ids)
                best = min(best, (time.perf_counter() - start) / L)
            times[fn] = best * 1e3
        touched = len(set(ids.flatten().tolist()))
        rows.append((T, times[reference_ops], times[cpu_moe.fused_experts], touched * expert_bytes / bandwidth * 1e3))
    return rows


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--models", nargs="+", choices=("deepseek-v3", "deepseek-v4"), default=["deepseek-v3",
                                                                                            "deepseek-v4"])
    p.add_argument("--batches", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64], help="tokens a layer call")
    p.add_argument("--repeats", type=int, default=5, help="timed passes over the layers, the best kept")
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
    tables = {name: layer_rows(name, sorted(set(a.batches)), a.repeats, bandwidth) for name in a.models}
    for name, rows in tables.items():
        L, E, k, D, I = expert_shapes(name)
        print(f"\n{name}: one MoE layer's routed experts ({E} of [{2 * I}, {D}] and [{D}, {I}], top-{k}), ms a "
              "layer; bound: the experts routed to, read at the measured bandwidth")
        print(f"{'T':>4}{'reference ops':>15}{'fused_experts':>15}{'ratio':>8}{'bound':>8}{'fused / bound':>15}")
        for T, ref, fused, bound in rows:
            print(f"{T:>4}{ref:>15.2f}{fused:>15.2f}{ref / fused:>7.2f}x{bound:>8.2f}{fused / bound:>14.2f}x")
    print(f"wall time {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    cpu_malloc.reexec_with_tcmalloc()  # before any timing: glibc's malloc makes step times a lottery
    main()
