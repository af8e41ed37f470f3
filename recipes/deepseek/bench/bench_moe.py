"""The routed experts on CPU, per expert against common.cpu_moe's dense pass over every expert: one MoE layer's
experts at each batch size, and the engine's decode step with the expert stacks packed whole or not, in one run.

    python bench/bench_moe.py [--threads 2] [--models deepseek-v3 deepseek-v4] [--batches 1 2 4 8 16 32 64]
                              [--engine-batches 1 16] [--steps 8] [--repeats 3]

Layer rows: the bench checkpoint's expert shapes (config only, random bf16 weights), as many layers as it has, used
in turn so each call reads its weights from DRAM; per layer ms of the per-expert path (routing, one oneDNN GEMM per
expert with rows, combine) and of the dense pass (two GEMMs over the stacked experts), the best of --repeats, and
the bandwidth bound of the experts each path reads (the per-expert path: the experts routed to; the dense pass:
all) at the measured read bandwidth. Engine rows (DeepSeek-V3 only, whose experts opt in): two engines on copies
of its bench checkpoint, one packed with its stacks whole, eager and in graph mode, timed like bench_graph.py (ms
an engine step of B sequences decoding at 128 tokens, the best of --repeats windows of --steps steps, the two
engines one after the other per window, which first alternating). The dense pass needs bf16 weights packed for
oneDNN (AVX512-BF16 or AMX); the engine takes it only where common.cpu_gemm.amx() holds, the layer rows and the
engine rows run it anyway (to show what it costs elsewhere). Prints the CPU, progress bars, the tables and the wall
time.
"""
from __future__ import annotations

import argparse
import time

import torch
from tqdm import tqdm
from transformers import AutoTokenizer

from bench_utils import BENCH_CONFIG, ENGINE, read_bandwidth
from common import backend, cpu_gemm, cpu_malloc, cpu_moe

ENGINE_CONTEXT = 128


def expert_shapes(name: str) -> tuple[int, int, int, int, int]:
    """(layers with routed experts, E, k, hidden, expert intermediate) of a bench checkpoint's config."""
    if name == "deepseek-v3":
        from tiny_deepseek_v3 import BENCH_SIZES as c
        layers = c["num_hidden_layers"] - c["first_k_dense_replace"]
    else:
        c = BENCH_CONFIG
        layers = c["num_hidden_layers"]
    return layers, c["n_routed_experts"], c["num_experts_per_tok"], c["hidden_size"], c["moe_intermediate_size"]


def layer_rows(name: str, batches: list[int], repeats: int, bandwidth: float) -> list[tuple]:
    """(T, per-expert ms, dense ms, per-expert bound ms, dense bound ms) per batch size, per layer."""
    L, E, k, D, I = expert_shapes(name)
    g = torch.Generator().manual_seed(0)
    layers = [(cpu_gemm.PackedExperts((torch.randn(E, 2 * I, D, generator=g) * 0.02).bfloat16(), "n"),
               cpu_gemm.PackedExperts((torch.randn(E, D, I, generator=g) * 0.02).bfloat16(), "k"))
              for _ in range(L)]
    expert_bytes = (2 * I * D + D * I) * 2
    rows = []
    for T in tqdm(batches, desc=f"{name} experts", unit="batch"):
        x = torch.randn(T, D, generator=g).bfloat16()
        weights, ids = torch.randn(T, E, generator=g).softmax(-1).topk(k)  # [T, k]
        ids = ids.int()
        paths = {"per expert": lambda w13, w2: cpu_moe.per_expert(x, w13.experts, w2.experts, weights, ids),
                 "dense": lambda w13, w2: cpu_moe.dense_experts(x, w13.stacked, w2.stacked, weights, ids, E)}
        times = {}
        for label, fn in paths.items():
            for w13, w2 in layers:
                fn(w13, w2)
            best = float("inf")
            for _ in range(repeats):
                start = time.perf_counter()
                for w13, w2 in layers:
                    fn(w13, w2)
                best = min(best, (time.perf_counter() - start) / L)
            times[label] = best * 1e3
        touched = len(set(ids.flatten().tolist()))
        rows.append((T, times["per expert"], times["dense"],
                     touched * expert_bytes / bandwidth * 1e3, E * expert_bytes / bandwidth * 1e3))
    return rows


def engine_rows(batches: list[int], steps: int, repeats: int) -> dict[str, list[tuple]]:
    """mode -> [(B, per-expert engine ms, dense-pass engine ms)]: DeepSeek-V3's bench checkpoint, eager and graph."""
    import bench_deepseek_v3
    import weights_deepseek_v3
    from bench_graph import decode_ms
    from common.engine import LLM
    path = bench_deepseek_v3.ensure_checkpoint()
    tok = AutoTokenizer.from_pretrained(path)
    out = {}
    for mode in ("eager", "graph"):
        llms = {}
        for stacked in (False, True):
            model = weights_deepseek_v3.load_model(path, torch.bfloat16)
            cpu_gemm.pack_model(model, stack_experts=stacked)  # packed here: the engine's own packing finds nothing
            kw = dict(exe_mode="graph", graph_capture_sizes=tuple(batches)) if mode == "graph" else {}
            llms[stacked] = LLM(model, tok, **kw, **bench_deepseek_v3.OURS_ENGINE)
        rows = []
        for b in tqdm(batches, desc=f"deepseek-v3 engine, {mode}", unit="batch"):
            best = {False: float("inf"), True: float("inf")}
            for r in range(repeats):  # the two engines in turn, window by window (this VM's speed drifts), the one
                #   first each time alternating (the second of two such windows tends to run a few % faster)
                for stacked in (False, True) if r % 2 == 0 else (True, False):
                    best[stacked] = min(best[stacked], decode_ms(llms[stacked], b, ENGINE_CONTEXT, steps, 1,
                                                                 tok.vocab_size))
            rows.append((b, best[False], best[True]))
        out[mode] = rows
        del llms
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--models", nargs="+", choices=("deepseek-v3", "deepseek-v4"), default=["deepseek-v3",
                                                                                            "deepseek-v4"])
    p.add_argument("--batches", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64], help="tokens a layer call")
    p.add_argument("--engine-batches", type=int, nargs="+", default=[1, 16], help="decode batch sizes of the "
                   "engine rows (none: skip them)")
    p.add_argument("--steps", type=int, default=8, help="decode steps a timed window")
    p.add_argument("--repeats", type=int, default=3, help="timed repeats, the best kept")
    a = p.parse_args()
    if min(a.batches) < 1 or min(a.steps, a.repeats) < 1 or any(not 1 <= b <= ENGINE["max_num_seqs"]
                                                               for b in a.engine_batches):
        p.error(f"--batches >= 1, --engine-batches in [1, {ENGINE['max_num_seqs']}], --steps and --repeats >= 1")
    if not cpu_gemm.supported():
        p.error("oneDNN has no bf16 GEMMs on this CPU (AVX2-only x86): nothing is packed, there is no dense pass")
    start = time.perf_counter()
    torch.set_num_threads(a.threads)
    bandwidth = read_bandwidth(torch.bfloat16)
    print(f"bf16; {a.threads} threads; {backend.cpu_model_name()}, {backend.cpu_description()}; AMX for oneDNN: "
          f"{cpu_gemm.amx()}; read bandwidth {bandwidth / 1e9:.1f} GB/s", flush=True)
    layers = {name: layer_rows(name, sorted(set(a.batches)), a.repeats, bandwidth) for name in a.models}
    engines = engine_rows(sorted(set(a.engine_batches)), a.steps, a.repeats) if a.engine_batches else {}
    for name, rows in layers.items():
        L, E, k, D, I = expert_shapes(name)
        print(f"\n{name}: one MoE layer's routed experts ({E} of [{2 * I}, {D}] and [{D}, {I}], top-{k}), ms a "
              "layer; bound: the experts read at the measured bandwidth")
        print(f"{'T':>4}{'per expert':>12}{'bound':>8}{'dense':>8}{'bound':>8}{'per expert / dense':>20}")
        for T, loop, dense, loop_bound, dense_bound in rows:
            print(f"{T:>4}{loop:>12.2f}{loop_bound:>8.2f}{dense:>8.2f}{dense_bound:>8.2f}{loop / dense:>19.2f}x")
    for mode, rows in engines.items():
        print(f"\ndeepseek-v3 engine, {mode}: ms a decode step at {ENGINE_CONTEXT} tokens (the engine takes the "
              f"dense pass from T * k >= E)")
        print(f"{'batch':>6}{'per expert':>12}{'stacks whole':>14}{'ratio':>8}")
        for b, loop, dense in rows:
            print(f"{b:>6}{loop:>12.1f}{dense:>14.1f}{loop / dense:>7.2f}x")
    print(f"wall time {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    cpu_malloc.reexec_with_tcmalloc()  # before any timing: glibc's malloc makes step times a lottery
    main()
