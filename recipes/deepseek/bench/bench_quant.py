"""Decode speed of the float, W8A8 and W4A8 bench checkpoints through the engine, against transformers, in one run.

    python bench/bench_quant.py [--threads 2] [--repeats 2] [--dtype auto|bf16|fp32] [--group-size 32] [--quick]

The bench checkpoint of bench.py (written if absent) and its W8A8 / W4A8 conversions beside it (converted by
convert_checkpoint.py if absent); every model computes in --dtype (auto: the CPU's default; the quantized ones
quantize their activations from it). Per model, at batch 1 and 16 (128-token prompts, 128 new tokens, decode =
generate(128) - generate(1) as bench.py): decode tok/s, best of --repeats alternating runs; weight bytes a step
reads (all weights but the embedding table; of the routed experts, the expected number a step touches under uniform
routing, E * (1 - (1 - k/E)^b) per layer, so batch 16 reads nearly all); the roofline, b tokens per (those bytes /
the read bandwidth measured here); the step time (b / tok/s) and, from the torch profiler over 8 real engine
steps, the part of it inside weight-GEMM kernels; the rest. The last lines put W8A8 against the float engine at batch 16 and say what bounds the ratio: the rest of
the step (the same ops in every model) does not shrink with the weights.
"""
from __future__ import annotations

import argparse
import time

import torch
from tqdm import tqdm
from transformers import AutoTokenizer, DeepseekV4ForCausalLM

from bench_utils import (BENCH, BENCH_CONFIG, decode_tok_s, ensure_bench, gemm_seconds_per_step, hf_generate, ours_generate, prompts,
                         read_bandwidth, weight_bytes_per_step)
from common import backend, cpu_malloc
from common.engine import LLM
from config_deepseek_v4 import ModelArgs
from convert_checkpoint import convert
from weights_deepseek_v4 import load_model

FORMATS = ("w8a8", "w4a8")
BATCHES = (1, 16)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=2, help="each row's best of this many alternating runs")
    p.add_argument("--dtype", choices=[backend.AUTO, *sorted(backend.DTYPES)], default=backend.AUTO)
    p.add_argument("--group-size", type=int, default=32, help="W4A8 group size when converting here")
    p.add_argument("--quick", action="store_true", help="16 new tokens, one repeat (a smoke run)")
    a = p.parse_args()
    start = time.perf_counter()
    torch.set_num_threads(a.threads)
    dtype, line = backend.resolve_dtype(a.dtype, None)
    name = backend.dtype_name(dtype)
    print(f"{line}; {backend.cpu_description()}; {a.threads} threads", flush=True)
    ensure_bench()
    paths = {name: BENCH}
    for fmt in FORMATS:
        paths[fmt] = BENCH.with_name(f"{BENCH.name}-{fmt}")
        if not (paths[fmt] / "config.json").exists():
            convert(BENCH, paths[fmt], fmt, a.group_size if fmt == "w4a8" else None)
    vocab = ModelArgs.from_config({**BENCH_CONFIG}).vocab_size
    tok = AutoTokenizer.from_pretrained(BENCH)
    engines, step_bytes = {}, {}
    for model_name, path in paths.items():
        model = load_model(path, dtype)
        step_bytes[model_name] = {b: weight_bytes_per_step(model, b) for b in BATCHES}
        engines[model_name] = LLM(model, tok, block_size=128, max_num_seqs=16, max_num_batched_tokens=2048,
                                  enable_prefix_caching=False, kv_cache_memory_bytes=2**29)
    hf = DeepseekV4ForCausalLM.from_pretrained(BENCH, dtype=dtype).eval()
    gens = {m: (lambda b, n, llm=llm: ours_generate(llm, b, n)) for m, llm in engines.items()}
    gens[f"transformers {name}"] = lambda b, n: hf_generate(hf, b, n, pad=0)
    for gen in gens.values():  # warm-up
        gen(prompts(2, 16, vocab, 99), 4)

    new, repeats = (16, 1) if a.quick else (128, a.repeats)
    tok_s = {m: {} for m in gens}
    with tqdm(total=len(BATCHES) * repeats * len(gens) + len(BATCHES) * len(engines) + 1, desc="bench_quant",
              unit="run") as bar:
        for bs in BATCHES:
            for _ in range(repeats):  # alternating: this VM's bandwidth drifts
                for m, gen in gens.items():
                    v = decode_tok_s(gen, bs, vocab, seed=bs, new=new)
                    tok_s[m][bs] = max(tok_s[m].get(bs, 0.0), v)
                    bar.update()
        gemm = {}
        for m, llm in engines.items():
            for bs in BATCHES:
                gemm[m, bs] = gemm_seconds_per_step(llm, bs, vocab)
                bar.update()
        bw = read_bandwidth(dtype)
        bar.update()

    print(f"\nDeepSeek-V4 bench checkpoint, decode (128-token prompts); read bandwidth {bw / 1e9:.1f} GB/s; "
          f"{backend.cpu_description()}; {a.threads} threads; W4A8 groups of {a.group_size}")
    head = f"{'model':<20}{'batch':>6}{'tok/s':>9}{'vs ' + name:>9}{'vs HF':>7}{'MiB/step':>10}{'roofline':>10}"
    print(head + f"{'step ms':>9}{'GEMM ms':>9}{'rest ms':>9}")
    hf_name = f"transformers {name}"
    for bs in BATCHES:
        for m in gens:
            v = tok_s[m][bs]
            row = f"{m:<20}{bs:>6}{v:>9.1f}{v / tok_s[name][bs]:>8.2f}x{v / tok_s[hf_name][bs]:>6.2f}x"
            if m in engines:
                mib, roof = step_bytes[m][bs] / 2**20, bs * bw / step_bytes[m][bs]
                step, g = bs / v, gemm[m, bs]
                row += f"{mib:>10.0f}{roof:>10.0f}{step * 1e3:>9.1f}{g * 1e3:>9.1f}{(step - g) * 1e3:>9.1f}"
            print(row)
    (step_f, gemm_f), (step_q, gemm_q) = ((16 / tok_s[m][16], gemm[m, 16]) for m in (name, "w8a8"))
    ratio = step_bytes["w8a8"][16] / step_bytes[name][16]
    scaled = step_f / (step_f - gemm_f + gemm_f * ratio)
    print(f"\nW8A8 at batch 16: {tok_s['w8a8'][16] / tok_s[name][16]:.2f}x the {name} engine (target 1.5x). Its weight"
          f" GEMMs take {gemm_q * 1e3:.1f} ms a step against {gemm_f * 1e3:.1f} ms in {name}; the rest of the step "
          f"({(step_f - gemm_f) * 1e3:.1f} ms in {name}, {(step_q - gemm_q) * 1e3:.1f} ms in W8A8, which quantizes "
          f"activations there) does not shrink with the weights. If W8A8's GEMMs took the {name} GEMM time times its "
          f"bytes ({ratio:.2f}x theirs) the step would be at most {scaled:.2f}x faster; if they took no time, "
          f"{step_f / (step_f - gemm_f):.2f}x.")
    print(f"wall time {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    cpu_malloc.reexec_with_tcmalloc()  # before any timing: glibc's malloc makes step times a lottery
    main()
