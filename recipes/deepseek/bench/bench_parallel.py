"""What the distributed executor costs per rank on this machine: memory and communication, not speed.

    python bench/bench_parallel.py [--ranks 1 2 4] [--batch 8] [--new-tokens 16]

For each world size, torchrun starts that many gloo ranks on the bench checkpoint (weights/deepseek-v4-bench,
written by bench.py; bf16), laid out as upstream's V4 layouts are: attention DP over all ranks, the experts over
all ranks (DP = EP = world).
Each rank loads its slice and reports: the weight bytes it holds, the checkpoint bytes it read, its peak resident
memory after loading (ru_maxrss) and at the end; then a batch of `--batch` requests (prompts of 64 tokens, spread
over the DP ranks) runs its prompts again and decodes `--new-tokens` tokens, and the bytes the ranks sent to each
other meanwhile (common.parallel.TRAFFIC) are divided by the tokens run, next to the count computed from the
layout: each MoE layer dispatches and combines top-k rows of hidden size per token, (P-1)/P of them to other
ranks (uniform routing), a token the same in prefill and decode.
On this 2-core VM the ranks share two cores, so no speed-up is claimed; the ranks run with one thread each.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
from pathlib import Path

import torch
from tqdm.auto import tqdm

HERE = Path(__file__).resolve().parent


def worker(a) -> None:
    from transformers import AutoTokenizer

    from bench_utils import BENCH
    from common import parallel as par
    from common.engine import LLM, SamplingParams
    from weights_deepseek_v4 import load_model

    world = int(os.environ["WORLD_SIZE"])
    parallel = par.init_parallel(par.LLMParallelLayout(world_size=world))
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # torch, transformers, the process group
    model = load_model(BENCH, torch.bfloat16, parallel=parallel)
    held = sum(t.nbytes for t in model.state_dict().values())
    read = sum(model.checkpoint_reads.values())
    peak_load = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    llm = LLM(model, AutoTokenizer.from_pretrained(BENCH), block_size=128, max_num_seqs=a.batch,
              kv_cache_memory_bytes=256 * 2**20, enable_prefix_caching=False)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 16000, (64,), generator=g).tolist() for _ in range(a.batch)]
    first = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    llm.generate(prompts, first, use_tqdm=False)  # warm: every prompt's prefill once (prefix cache is off)
    par.TRAFFIC.clear()
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=1 + a.new_tokens, ignore_eos=True),
                        use_tqdm=False)
    traffic = dict(par.TRAFFIC)  # the prompts again, then the decode steps
    decoded = sum(len(o.token_ids) for o in outs)
    largest = max(model.checkpoint_reads.values())
    report = dict(rank=parallel.rank, held=held, read=read, before=before, largest=largest, peak_after_load=peak_load,
                  peak_end=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
                  traffic=traffic, tokens=decoded, prompt_tokens=sum(len(p) for p in prompts))
    reports = par.gather_to_rank0(report)
    if parallel.rank == 0:
        print("REPORT " + json.dumps(reports), flush=True)
    par.destroy_parallel()


def computed_bytes_per_token(world: int) -> float:
    """Expert dispatch + combine per token over all MoE layers, bf16, with the bench model's shape: each token's
    k rows of D go to their experts' ranks and come back; (P-1)/P of the experts live elsewhere."""
    from bench_utils import BENCH_CONFIG
    D, k, L = BENCH_CONFIG["hidden_size"], BENCH_CONFIG["num_experts_per_tok"], BENCH_CONFIG["num_hidden_layers"]
    return L * 2 * k * D * 2 * (world - 1) / world


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--new-tokens", type=int, default=16)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.worker:
        return worker(a)
    from bench_utils import ensure_bench
    ensure_bench()
    rows = []
    for world in tqdm(a.ranks, desc="world sizes", unit="run"):
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}",
                   __file__, "--worker", "--batch", str(a.batch), "--new-tokens", str(a.new_tokens)]
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        run = subprocess.run(command, capture_output=True, text=True, env=env, cwd=HERE)
        line = next((x for x in run.stdout.splitlines() if x.startswith("REPORT ")), None)
        if run.returncode or line is None:
            sys.exit(f"world {world}: exit {run.returncode}\n{run.stderr[-3000:]}")
        rows.append((world, json.loads(line.removeprefix("REPORT "))))
    mib = 2**20
    print("\n| ranks | weights held / rank MiB | checkpoint read / rank MiB | largest tensor read MiB | peak RSS "
          "before loading / after / at the end MiB | loading's peak over its start MiB | expert bytes sent per "
          "token, measured / computed |")
    print("|---|---|---|---|---|---|---|")
    for world, reports in rows:
        held = max(r["held"] for r in reports) / mib
        read = max(r["read"] for r in reports) / mib
        peak = max(r["peak_after_load"] for r in reports) / mib
        end = max(r["peak_end"] for r in reports) / mib
        before = max(r["before"] for r in reports) / mib
        largest = max(r["largest"] for r in reports) / mib
        grown = max(r["peak_after_load"] - r["before"] for r in reports) / mib
        sent = sum(sum(r["traffic"].values()) for r in reports)  # every rank's bytes to the others
        # every rank returns every output: the tokens forwarded are the prompts and all but each last token
        tokens = reports[0]["prompt_tokens"] + reports[0]["tokens"] - a.batch
        per_token = sent / tokens
        print(f"| {world} | {held:.0f} | {read:.0f} | {largest:.0f} | {before:.0f} / {peak:.0f} / {end:.0f} | "
              f"{grown:.0f} | {per_token:.0f} / {computed_bytes_per_token(world):.0f} |")


if __name__ == "__main__":
    from common import cpu_malloc
    cpu_malloc.reexec_with_tcmalloc()  # before any timing: glibc's malloc makes step times a lottery
    main()
