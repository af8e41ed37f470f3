"""Graph mode against eager, step by step: the decode step at each batch bucket and at a short and a long context,
on the DeepSeek-V3 (MLA) and DeepSeek-V4 bench checkpoints, in one run; and the buckets exe_mode auto keeps.

    python bench/bench_graph.py [--threads 2] [--models deepseek-v3 deepseek-v4] [--batches 1 4 16 64]
                                [--contexts 128 896] [--steps 8] [--repeats 3] [--dtype auto|bf16|fp32]
                                [--max-model-len N]

Per model: an eager engine and a graph engine (graph_capture_sizes = --batches; its start-up compile timed, warm or
cold as inductor's disk cache finds it) on copies of the bench checkpoint (bench.py's: V4 at its own max_model_len,
4,096; V3 at bench_deepseek_v3's, 1,024; --max-model-len N: both at N, from a copy of the checkpoint whose config
allows N positions, its weights linked), each fed the same requests: --batches x --contexts cells, B prompts of C
tokens, prefilled, two decode steps to warm up, then --repeats windows of --steps decode steps timed (the engine's
whole step: schedule, forward, sample), ms a step, the best window. Then `GraphRunner.calibrate` on the graph
engine: exe_mode auto's start-up timing of each bucket (padding steps, graph against eager) and the buckets it
keeps. Prints the CPU, a progress bar, a table per model (eager ms, graph ms, eager / graph), the buckets auto
keeps, and the wall time.
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from tqdm import tqdm
from transformers import AutoTokenizer

from bench_utils import ENGINE, ensure_bench, prompts
from common import backend, cpu_malloc
from common.engine import LLM, SamplingParams


def bench_checkpoint(name: str) -> tuple[Path, dict]:
    """A model's bench checkpoint (written when missing) and the engine's keyword arguments for it."""
    import bench_deepseek_v3
    if name == "deepseek-v3":
        return bench_deepseek_v3.ensure_checkpoint(), bench_deepseek_v3.OURS_ENGINE
    return ensure_bench(), ENGINE


def load_model(name: str, path: Path, dtype):
    """A fresh copy of the model at path."""
    import weights_deepseek_v3
    import weights_deepseek_v4
    return (weights_deepseek_v3 if name == "deepseek-v3" else weights_deepseek_v4).load_model(path, dtype)


def at_max_model_len(path: Path, n: int) -> Path:
    """A checkpoint of path's weights (linked, not copied) whose config.json allows n positions: beside path, named
    for n, written when missing or out of date."""
    config = json.loads((path / "config.json").read_text())
    if config["max_position_embeddings"] >= n:
        return path
    copy = path.with_name(f"{path.name}-len{n}")
    copy.mkdir(exist_ok=True)
    for f in path.iterdir():
        if f.name != "config.json" and f.is_file():
            link = copy / f.name
            if link.is_symlink() or link.exists():
                link.unlink()
            link.symlink_to(f.resolve())
    (copy / "config.json").write_text(json.dumps({**config, "max_position_embeddings": n}, indent=2))
    return copy


def decode_ms(llm: LLM, batch: int, context: int, steps: int, repeats: int, vocab: int) -> float:
    """ms per engine step of `batch` sequences decoding at `context` tokens (the prompts prefilled first): the best
    of `repeats` windows of `steps` steps (this VM's speed drifts)."""
    engine, scheduler = llm.engine, llm.engine.scheduler
    for p in prompts(batch, context, vocab, seed=batch * 7919 + context):
        engine.add_request(p, SamplingParams(temperature=0, max_tokens=steps * repeats + 3, ignore_eos=True))
    while scheduler.waiting or any(r.num_computed_tokens < r.num_prompt_tokens for r in scheduler.running):
        engine.step()  # the prefill (and its first token)
    engine.step()
    engine.step()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(steps):
            engine.step()
        best = min(best, (time.perf_counter() - start) / steps)
    while engine.has_unfinished():
        engine.step()
    return best * 1e3


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--models", nargs="+", choices=("deepseek-v3", "deepseek-v4"), default=["deepseek-v3",
                                                                                            "deepseek-v4"])
    p.add_argument("--batches", type=int, nargs="+", default=[1, 4, 16, 64], help="decode batch sizes: the graph "
                   "engine's buckets")
    p.add_argument("--contexts", type=int, nargs="+", default=[128, 896], help="prompt lengths")
    p.add_argument("--steps", type=int, default=8, help="decode steps a timed window")
    p.add_argument("--repeats", type=int, default=3, help="timed windows per cell, the best kept")
    p.add_argument("--dtype", choices=[backend.AUTO, *sorted(backend.DTYPES)], default=backend.AUTO)
    p.add_argument("--max-model-len", type=int, metavar="N", help="both engines at max_model_len N (default: each "
                   "model's bench setting); past the checkpoint's max_position_embeddings, from a copy that allows N")
    a = p.parse_args()
    a.batches = sorted(set(a.batches))
    if a.batches[0] < 1 or a.batches[-1] > ENGINE["max_num_seqs"] or min(a.contexts) < 1 or min(a.steps, a.repeats) < 1:
        p.error(f"--batches in [1, {ENGINE['max_num_seqs']}], --contexts, --steps and --repeats >= 1")
    if a.max_model_len is not None and a.max_model_len < 2:
        p.error(f"--max-model-len must be >= 2, got {a.max_model_len}")
    start = time.perf_counter()
    dtype, dtype_line = backend.resolve_dtype(a.dtype, None)
    torch.set_num_threads(a.threads)
    print(f"{dtype_line}; {a.threads} threads; {backend.cpu_model_name()}, {backend.cpu_description()}", flush=True)
    tables = {}
    for name in a.models:
        path, engine_kw = bench_checkpoint(name)
        if a.max_model_len is not None:
            path, engine_kw = at_max_model_len(path, a.max_model_len), {**engine_kw, "max_model_len": a.max_model_len}
        tok = AutoTokenizer.from_pretrained(path)
        eager = LLM(load_model(name, path, dtype), tok, **engine_kw)
        graph = LLM(load_model(name, path, dtype), tok, exe_mode="graph", graph_capture_sizes=tuple(a.batches),
                    **engine_kw)
        max_len = graph.engine.config.max_model_len
        graphs = graph.engine.runner.graphs
        too_long = [c for c in a.contexts if c + a.steps * a.repeats + 3 > graph.engine.config.max_model_len]
        if too_long:
            p.error(f"--contexts {too_long}: past {name}'s max_model_len {graph.engine.config.max_model_len}")
        rows = {}
        cells = [(b, c) for c in a.contexts for b in a.batches]
        for b, c in tqdm(cells, desc=f"{name} decode steps", unit="cell"):
            rows[b, c] = tuple(decode_ms(llm, b, c, a.steps, a.repeats, tok.vocab_size) for llm in (eager, graph))
        kept = graphs.calibrate()
        tables[name] = rows, graphs.capture_seconds, graphs.num_graphs, dict(graphs.calibration), kept, max_len
        del eager, graph, graphs
    for name, (rows, compile_s, num_graphs, calibration, kept, max_len) in tables.items():
        print(f"\n{name}: max_model_len {max_len}, graph buckets {a.batches} compiled as {num_graphs} graphs in "
              f"{compile_s:.0f} s; decode step ms (eager / graph)")
        print(f"{'batch':>6}" + "".join(f"{f'ctx {c} eager':>16}{'graph':>8}{'ratio':>8}" for c in a.contexts))
        for b in a.batches:
            print(f"{b:>6}" + "".join(f"{rows[b, c][0]:>16.1f}{rows[b, c][1]:>8.1f}"
                                      f"{rows[b, c][0] / rows[b, c][1]:>7.2f}x" for c in a.contexts))
        print("exe_mode auto's start-up timing, padding steps (graph / eager ms): "
              + ", ".join(f"{n}: {g * 1e3:.1f} / {e * 1e3:.1f}" for n, (g, e) in calibration.items())
              + f"; keeps {list(kept)}")
    print(f"wall time {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    cpu_malloc.reexec_with_tcmalloc()  # before any timing: glibc's malloc makes step times a lottery
    main()
