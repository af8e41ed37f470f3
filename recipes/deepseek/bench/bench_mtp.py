"""Decode speed with MTP speculative decoding, k = 0, 1, 3 drafts a step, side by side in one run.

    python bench/bench_mtp.py [--weights DIR] [--threads 2] [--repeats 2] [--dtype auto|bf16|fp32] [--quick]

DIR: a checkpoint with a trained MTP layer, default the bench checkpoint's (weights/deepseek-v4-bench-mtp, which
train_mtp.py writes: a random MTP layer accepts almost nothing). Per k and batch (1, 16): greedy decode tok/s
(128-token random prompts, 128 new tokens; decode = generate(128) - generate(1), best of --repeats alternating
runs), the measured acceptance (accepted / verified drafts) and mean accepted length (tokens committed per
verifying request-step), and the step times: the whole decode step, of which the MTP proposer. The speed-up
against k = 0 is set beside its ideal at the measured acceptance, (mean accepted length) / (cost of a verify
step / a plain step), the verify step's cost being its time without the proposer: what speculation would give
if drafting were free.
"""
from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
from tqdm import tqdm
from transformers import AutoTokenizer

from bench_utils import BENCH, decode_tok_s, ours_generate
from common import backend, cpu_malloc
from common.engine import LLM
from weights_deepseek_v4 import load_model

KS = (0, 1, 3)
BATCHES = (1, 16)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--weights", type=Path, default=BENCH.with_name(BENCH.name + "-mtp"))
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--dtype", choices=[backend.AUTO, *sorted(backend.DTYPES)], default=backend.AUTO)
    p.add_argument("--quick", action="store_true", help="16 new tokens, one repeat (a smoke run)")
    a = p.parse_args()
    if not (a.weights / "config.json").exists():
        p.error(f"--weights {a.weights}: no checkpoint there (python bench/train_mtp.py writes the bench one)")
    start = time.perf_counter()
    torch.set_num_threads(a.threads)
    dtype, line = backend.resolve_dtype(a.dtype, None)
    print(f"{line}; {backend.cpu_description()}; {a.threads} threads", flush=True)
    tok = AutoTokenizer.from_pretrained(a.weights)
    engines = {k: LLM(load_model(a.weights, dtype, mtp=True), tok, block_size=128, max_num_seqs=16,
                      max_num_batched_tokens=2048, enable_prefix_caching=False, kv_cache_memory_bytes=2**29,
                      num_speculative_tokens=k) for k in KS}  # a model each: the caches belong to the model
    vocab = engines[0].engine.model.args.vocab_size
    for llm in engines.values():
        ours_generate(llm, [[5] * 16] * 2, 4)  # warm-up
    new, repeats = (16, 1) if a.quick else (128, a.repeats)
    rows = {}
    with tqdm(total=len(BATCHES) * repeats * len(KS), desc="bench_mtp", unit="run") as bar:
        for bs in BATCHES:
            for _ in range(repeats):
                for k, llm in engines.items():
                    s = llm.engine.stats
                    before = (s.num_draft_tokens, s.num_accepted_tokens, s.num_verify_steps, s.decode_time,
                              s.propose_time, s.steps)
                    v = decode_tok_s(lambda b, n, llm=llm: ours_generate(llm, b, n), bs, vocab, seed=bs, new=new)
                    drafts, accepted, verify, decode_t, propose_t, steps = (
                        x - y for x, y in zip((s.num_draft_tokens, s.num_accepted_tokens, s.num_verify_steps,
                                               s.decode_time, s.propose_time, s.steps), before))
                    if v > rows.get((k, bs), {}).get("tok_s", 0):
                        rows[k, bs] = dict(tok_s=v, acc=accepted / drafts if drafts else 0.0,
                                           length=1 + accepted / verify if verify else 1.0,
                                           propose_share=propose_t / decode_t if decode_t else 0.0)
                    bar.update()

    print(f"\nMTP speculative decoding, {a.weights.name}; {backend.cpu_description()}; {a.threads} threads")
    print(f"{'k':>2}{'batch':>6}{'tok/s':>9}{'vs k=0':>8}{'acceptance':>12}{'mean len':>10}{'step ms':>9}"
          f"{'propose':>9}{'ideal':>8}")
    for bs in BATCHES:
        base = rows[0, bs]
        plain_step = bs / base["tok_s"]
        for k in KS:
            r = rows[k, bs]
            step = bs * r["length"] / r["tok_s"]  # one decode step: each sequence commits `length` tokens
            verify = step * (1 - r["propose_share"])
            ideal = r["length"] / (verify / plain_step)
            print(f"{k:>2}{bs:>6}{r['tok_s']:>9.1f}{r['tok_s'] / base['tok_s']:>7.2f}x{r['acc']:>12.3f}"
                  f"{r['length']:>10.2f}{step * 1e3:>9.1f}{r['propose_share'] * 100:>8.0f}%{ideal:>7.2f}x")
    print("(step ms: a decode step; propose: its share in the MTP proposer; ideal: mean len / (verify step "
          "without the proposer / a k = 0 step))")
    print(f"wall time {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    cpu_malloc.reexec_with_tcmalloc()  # before any timing: glibc's malloc makes step times a lottery
    main()
