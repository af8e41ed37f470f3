"""What the recipe's benches share: the DeepSeek-V4 bench checkpoint (written on first use), the workloads'
prompts, both sides' greedy generate, best-of timing, the read bandwidth, the decode step's GEMM profile and the
pipe to a vLLM driver in vLLM's own environment (VllmProcess).
The bench scripts and the recipe's modules are imported from the recipe folder and its tools/ (RECIPE on sys.path)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

RECIPE = Path(__file__).resolve().parents[1]  # recipes/deepseek: the recipe's modules and tools/ are imported from there
sys.path[:0] = [p for p in (str(RECIPE), str(RECIPE / "tools")) if p not in sys.path]
ROOT = RECIPE.parents[1]  # the repository
WEIGHTS = ROOT / "weights"

from common.engine import LLM, SamplingParams  # noqa: E402
from tiny_deepseek_v4 import is_current, write_tiny_checkpoint  # noqa: E402
from config_deepseek_v4 import CSA, HCA  # noqa: E402

BENCH = WEIGHTS / "deepseek-v4-bench"
BENCH_CONFIG = dict(  # ~200M parameters, ~75M active per token
    vocab_size=16384, hidden_size=1024, moe_intermediate_size=512, num_hidden_layers=8, num_attention_heads=8,
    head_dim=128, q_lora_rank=384, qk_rope_head_dim=64, partial_rotary_factor=0.5, n_routed_experts=12,
    num_experts_per_tok=2, layer_types=[HCA, HCA, CSA, HCA, CSA, HCA, CSA, HCA], compress_rates={CSA: 4, HCA: 128},
    mlp_layer_types=["hash_moe"] * 3 + ["moe"] * 5, sliding_window=128, o_groups=4, o_lora_rank=256,
    index_n_heads=16, index_head_dim=64, index_topk=512, max_position_embeddings=4096,
    rope_scaling={"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024},
    num_nextn_predict_layers=0,  # no MTP layer (the tiny writer's default has one)
)


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def read_bandwidth(dtype: torch.dtype, gib: float = 1.0) -> float:
    """Bytes/s of a streaming read (sum over a buffer of `dtype` larger than the caches), best of 5; at the
    current thread count, so measure it with the run's threads and dtype."""
    x = torch.ones(int(gib * 2**30) // torch.empty((), dtype=dtype).element_size(), dtype=dtype)
    x.sum()
    return x.nbytes / min(timed(lambda: x.sum()) for _ in range(5))


def weight_bytes_per_step(model, batch: int = 1) -> int:
    """Bytes of weights one decode step of `batch` tokens reads: parameters and buffers as loaded (int8 / packed
    int4 and their scales for a quantized model), before the engine packs or allocates; of the embedding table one
    row per token, of the routed experts the expected share a step touches under
    uniform routing, E * (1 - (1 - k/E)^batch) of E (k/E at batch 1: the active weights per token)."""
    a, total = model.args, 0
    E, k = a.n_routed_experts, a.num_experts_per_tok
    touched = (1 - (1 - k / E) ** batch)  # expected fraction of the routed experts a step reads
    for name, t in (dict(model.named_parameters()) | dict(model.named_buffers())).items():
        if t is model.embed.weight:
            total += t[0].nbytes * batch
        elif ".experts." in name:
            total += int(t.nbytes * touched)
        else:
            total += t.nbytes
    return total


# the weight GEMMs of a CPU decode step: oneDNN bf16 (packed), plain fp32 / bf16, the int8 one (W8A8, W4A8)
GEMM_OPS = ("mkldnn::_linear_pointwise", "aten::mm", "aten::addmm", "aten::_int_mm")


def decode_step_profile(llm: LLM, batch: int, vocab: int, steps: int = 8) -> dict[str, float]:
    """{op: self seconds per step} of `steps` real engine decode steps (real routing) of `batch` sequences
    (128-token prompts), by the torch profiler."""
    engine = llm.engine
    for p in prompts(batch, 128, vocab, seed=5):
        engine.add_request(p, SamplingParams(temperature=0, max_tokens=steps + 3, ignore_eos=True))
    engine.step()  # the prefill
    engine.step()
    with torch.profiler.profile() as prof:
        for _ in range(steps):
            engine.step()
    while engine.has_unfinished():
        engine.step()
    return {e.key: e.self_cpu_time_total / steps / 1e6 for e in prof.key_averages()}


def gemm_seconds(profile: dict[str, float]) -> float:
    """Of a step's profile, the seconds inside weight-GEMM kernels."""
    return sum(seconds for op, seconds in profile.items() if op in GEMM_OPS)


def gemm_seconds_per_step(llm: LLM, batch: int, vocab: int, steps: int = 8) -> float:
    """Seconds a decode step of `batch` sequences (128-token prompts) spends inside weight-GEMM kernels: the
    torch profiler's self time of those ops over `steps` real engine steps (real routing), per step."""
    return gemm_seconds(decode_step_profile(llm, batch, vocab, steps))


def prompts(n: int, length: int | list[int], vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = length if isinstance(length, list) else [length] * n
    return [torch.randint(10, vocab, (k,), generator=g).tolist() for k in lengths]


def ours_generate(llm: LLM, batch: list[list[int]], new: int | list[int]):
    news = new if isinstance(new, list) else [new] * len(batch)
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in news]
    return llm.generate(batch, params, use_tqdm=False)


@torch.inference_mode()
def hf_generate(hf, batch: list[list[int]], new: int, pad: int):
    width = max(map(len, batch))
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in batch])  # left padding
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
    return hf.generate(ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new, do_sample=False,
                       pad_token_id=pad)


def best_of(repeats: int, *sides) -> list[float]:
    """Each side's best throughput over `repeats` alternating runs (eager, graph, theirs, eager, ...)."""
    runs = [[side() for side in sides] for _ in range(max(repeats, 1))]
    return [max(r[i] for r in runs) for i in range(len(sides))]


ENGINE = dict(block_size=128, max_num_seqs=64, max_num_batched_tokens=2048, enable_prefix_caching=False,
              kv_cache_memory_bytes=2 * 2**30)


def decode_tok_s(gen, batch_size: int, vocab: int, seed: int, new: int = 128, prompt_len: int = 128) -> float:
    full = timed(lambda: gen(prompts(batch_size, prompt_len, vocab, seed), new))
    first = timed(lambda: gen(prompts(batch_size, prompt_len, vocab, seed + 1), 1))
    return batch_size * (new - 1) / (full - first)


def ensure_bench() -> Path:
    """The bench checkpoint, written when missing, half-written or written by an older revision of the writer;
    V4-Flash's text layout (the LLM's tensors are the Vision-Exp layout's, without the vision tower)."""
    if not is_current(BENCH):
        write_tiny_checkpoint(BENCH, seed=0, quantized="bf16", max_shard_bytes=2**30, vision=False, **BENCH_CONFIG)
    return BENCH


VLLM_MARK = "BENCH_VLLM "  # a vLLM driver's answers on its stdout (vLLM logs there too)


# vllm_plugin's platform plugin: where torch is capped to AVX2 on an AVX-512 CPU (ATEN_CPU_CAPABILITY=avx2, the
# benches' AVX2 stand-in), vLLM loads its AVX2 kernel build as torch runs AVX2 code; inactive elsewhere, and absent
# from a vLLM environment without the plugin (the V3 bench prints the build vLLM loaded).
CPU_PLATFORM_PLUGIN = "npu_cookbook_cpu"


def vllm_env(threads: int, executor: str, plugins: str) -> dict[str, str]:
    """The environment of a vLLM subprocess: this one's, less its virtual environment and VLLM_CPU_KVCACHE_SPACE (which
    would override kv_cache_memory_bytes), with vLLM's OpenMP threads = `threads`, unbound, the plugins named (""
    none) and the recipe's platform plugin (CPU_PLATFORM_PLUGIN), no usage reporting, no hub downloads; executor
    "uni": the engine core in the driver's process too (VLLM_ENABLE_V1_MULTIPROCESSING=0), vLLM's fastest on a few
    cores; "mp": its default, a process of its own."""
    plugins = ",".join(filter(None, (plugins, CPU_PLATFORM_PLUGIN)))
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), VLLM_CPU_OMP_THREADS_BIND="nobind", VLLM_PLUGINS=plugins,
               VLLM_USE_USAGE_LIB="0", VLLM_NO_USAGE_STATS="1", HF_HUB_OFFLINE="1")
    if executor == "uni":
        env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    for name in ("VIRTUAL_ENV", "VLLM_CPU_KVCACHE_SPACE"):
        env.pop(name, None)
    return env


class VllmProcess:
    """A vLLM driver in vLLM's own environment (vllm-cpu pins its own torch), started once and answering one JSON
    line per request over a pipe, so that the bench's sides take turns on the cores (a side run after the others
    meets another hour of a shared machine). The driver prints VLLM_MARK + JSON when ready, then one answer per
    request line on its stdin, until stdin closes; its stderr goes to `log`."""

    def __init__(self, argv: list[str], env: dict[str, str], log: Path):
        self.log = log
        with open(log, "w") as err:  # the driver holds its own copy of the file
            self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err, text=True,
                                         env=env)
        self.ready = self._answer()  # what the driver says once started (its start-up seconds, or its error)

    def _answer(self) -> dict:
        for line in self.proc.stdout:
            if line.startswith(VLLM_MARK):
                return json.loads(line[len(VLLM_MARK):])
        raise RuntimeError(f"the vLLM side exited ({self.proc.wait()}); its log: {self.log}")

    def ask(self, request: dict) -> dict:
        self.proc.stdin.write(json.dumps(request) + "\n")
        self.proc.stdin.flush()
        return self._answer()

    def close(self) -> None:
        """Ends the driver (stdin closed: its loop ends), killed if it has not exited within a minute."""
        if self.proc.stdin and not self.proc.stdin.closed:
            try:
                self.proc.stdin.close()
            except BrokenPipeError:  # it exited already
                pass
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
