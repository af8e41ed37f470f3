"""Ling-3.0-Flash bench: the recipe's engine against transformers' `BailingHybridForCausalLM` on one bench-sized
checkpoint (Ling's layout at a CPU size, written on first use to weights/ling-bench), in one run, with progress.

    python recipes/ling/bench/bench_ling.py [--threads 2] [--quick] [--repeats 2] [--dtype auto|bf16|fp32]
                                            [--contexts 1024,8192,32768]

Rows, each side's best of --repeats (engine and transformers alternating):
- decode tok/s at batch 1 and 16 (128-token prompts; the decode rate is (all tokens - the first) / (time - the
  time of a 1-token run)); transformers' `generate` (greedy, its own DynamicCache, left-padded batches);
- prefill tok/s: one 2048-token prompt (the engine in its max_num_batched_tokens chunks, transformers in one forward);
- the point of the architecture, per context length L: one request holding L tokens, the time of its decode step
  (the best of 8) and the cache bytes it holds: the engine (its KDA state slot, fixed, + the MLA latent blocks, growing with L),
  transformers (the tensors of its cache after the same L tokens, built in 1024-token forwards), and the same
  model with every layer MLA (layer_group_size 1: an all-MLA model of the same width, its own random weights)
  through the engine. Bytes are the caches' own (the engine: its cache specs' bytes per slot and per token, as it
  sizes them; transformers: the nbytes of its cache's tensors).
"""
from __future__ import annotations

import argparse
import gc
import sys
import time
from pathlib import Path

import torch
from tqdm.auto import tqdm

RECIPE = Path(__file__).resolve().parents[1]
sys.path[:0] = [p for p in (str(RECIPE),) if p not in sys.path]
WEIGHTS = RECIPE.parents[1] / "weights"

from transformers import AutoTokenizer, BailingHybridForCausalLM, DynamicCache  # noqa: E402

from common import backend  # noqa: E402
from common.engine import LLM, SamplingParams  # noqa: E402
from common.kv_cache import cache_bytes_per_block  # noqa: E402
from tiny_ling import is_current, write_tiny_checkpoint  # noqa: E402
from weights_ling import load_model  # noqa: E402

BENCH = WEIGHTS / "ling-bench"
ALL_MLA = WEIGHTS / "ling-bench-all-mla"
LAYERS = 12
BENCH_CONFIG = dict(  # Ling's layout (5 KDA layers, then MLA, twice; 2 dense first) at ~100M parameters
    vocab_size=8192, hidden_size=512, intermediate_size=1536, moe_intermediate_size=256,
    moe_shared_expert_intermediate_size=256, num_hidden_layers=LAYERS, layer_group_size=6, num_attention_heads=8,
    num_key_value_heads=8, head_dim=64, kv_lora_rank=128, qk_nope_head_dim=64, qk_rope_head_dim=32, v_head_dim=64,
    num_experts=32, num_experts_per_tok=4, n_group=4, topk_group=2, max_position_embeddings=65536,
    expert_swiglu_limit_list=[0.0] * LAYERS, share_expert_swiglu_limit_list=[0.0] * LAYERS,
)
ENGINE = dict(block_size=128, max_num_seqs=16, max_num_batched_tokens=2048, enable_prefix_caching=False,
              kv_cache_memory_bytes=1 << 30)


def ensure(path: Path, **overrides) -> Path:
    if not is_current(path):
        write_tiny_checkpoint(path, seed=0, max_shard_bytes=1 << 30, **{**BENCH_CONFIG, **overrides})
    return path


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(10, vocab, (length,), generator=g).tolist() for _ in range(n)]


def ours_generate(llm: LLM, batch: list[list[int]], new: int):
    return llm.generate(batch, SamplingParams(temperature=0, max_tokens=new, ignore_eos=True), use_tqdm=False)


@torch.inference_mode()
def hf_generate(hf, batch: list[list[int]], new: int):
    width = max(map(len, batch))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in batch])  # left padding (pad id 0)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
    return hf.generate(ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new, do_sample=False,
                       pad_token_id=0)


def decode_tok_s(gen, batch: int, vocab: int, new: int) -> float:
    full = timed(lambda: gen(prompts(batch, 128, vocab, seed=batch), new))
    first = timed(lambda: gen(prompts(batch, 128, vocab, seed=batch + 1), 1))
    return batch * (new - 1) / (full - first)


def best_of(repeats: int, *sides) -> list[float]:
    runs = [[side() for side in sides] for _ in range(max(repeats, 1))]
    return [max(r[i] for r in runs) for i in range(len(sides))]


def engine_cache_bytes(llm: LLM, context: int) -> int:
    """Bytes the engine's caches hold for one request of `context` tokens: each state group's slot, and the paged
    groups' bytes per token times the tokens (as the engine sizes its pools: cache_bytes_per_block)."""
    model, bs = llm.engine.model, llm.engine.config.block_size
    per_block = cache_bytes_per_block(model.cache_tensor_specs(), bs, model.engine_contract().dtype)
    groups = {g.name: g for g in model.cache_specs(bs)}
    return sum(n if groups[g].is_state else n * context // bs for g, n in per_block.items())


def engine_decode_step(llm: LLM, context: int, vocab: int, steps: int) -> float:
    """Seconds of one decode step of one request holding `context` tokens (its prompt prefilled first): the best
    of `steps` steps."""
    engine = llm.engine
    rid = engine.add_request(prompts(1, context, vocab, seed=context)[0],
                             SamplingParams(temperature=0, max_tokens=steps + 2, ignore_eos=True))
    req = engine.requests[rid]
    while req.num_computed_tokens < context:  # the prompt's chunks
        engine.step()
    engine.step()  # the first decode step (warm)
    times = [timed(engine.step) for _ in range(steps)]
    while engine.has_unfinished():
        engine.step()
    return min(times)


@torch.inference_mode()
def hf_decode_step(hf, context: int, vocab: int, steps: int) -> tuple[float, int]:
    """(seconds of one decode step, the best of `steps`; bytes of transformers' cache) for one sequence of
    `context` tokens, the cache built by 1024-token forwards."""
    ids = torch.tensor([prompts(1, context, vocab, seed=context)[0]])
    cache = DynamicCache(config=hf.config)
    for start in range(0, context, 1024):
        out = hf(input_ids=ids[:, start:start + 1024], past_key_values=cache, use_cache=True)
    token = out.logits[:, -1:].argmax(-1)
    hf(input_ids=token, past_key_values=cache, use_cache=True)  # warm
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        token = hf(input_ids=token, past_key_values=cache, use_cache=True).logits[:, -1:].argmax(-1)
        times.append(time.perf_counter() - t0)
    return min(times), sum(t.nbytes for t in _tensors(cache))


def _tensors(obj, seen=None):
    """Every tensor a cache object holds (its layers' keys / values, conv and recurrent states)."""
    seen = set() if seen is None else seen
    if id(obj) in seen:
        return
    seen.add(id(obj))
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for x in obj:
            yield from _tensors(x, seen)
    elif isinstance(obj, dict):
        for x in obj.values():
            yield from _tensors(x, seen)
    elif hasattr(obj, "__dict__") and type(obj).__module__.startswith("transformers"):
        for x in vars(obj).values():
            yield from _tensors(x, seen)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--quick", action="store_true", help="small workloads (a smoke run, not the reported numbers)")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--dtype", choices=[backend.AUTO, *sorted(backend.DTYPES)], default=backend.AUTO,
                   help="both sides' weights (auto: backend.default_dtype(), which follows the CPU)")
    p.add_argument("--contexts", default=None, help="context lengths of the decode-step rows (default "
                   "1024,8192,32768; --quick: 256,1024)")
    a = p.parse_args()
    try:
        contexts = [int(c) for c in (a.contexts or ("256,1024" if a.quick else "1024,8192,32768")).split(",")]
    except ValueError:
        p.error(f"--contexts {a.contexts}: expected comma-separated token counts")
    if not contexts or min(contexts) < 16 or max(contexts) > BENCH_CONFIG["max_position_embeddings"] - 64:
        p.error(f"--contexts must lie in [16, {BENCH_CONFIG['max_position_embeddings'] - 64}]")
    dtype, dtype_line = backend.resolve_dtype(a.dtype, None)
    print(f"{dtype_line}; {backend.cpu_model_name()}, {backend.cpu_description()}", flush=True)
    torch.set_num_threads(a.threads)
    path, mla_path = ensure(BENCH), ensure(ALL_MLA, layer_group_size=1)
    vocab = BENCH_CONFIG["vocab_size"]
    tok = AutoTokenizer.from_pretrained(path)
    model = load_model(path, dtype)
    n_params = sum(p.numel() for p in model.parameters())
    llm = LLM(model, tok, **ENGINE, max_model_len=max(contexts) + 64)
    hf = BailingHybridForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation="sdpa").eval()
    ours = lambda b, n: ours_generate(llm, b, n)  # noqa: E731
    theirs = lambda b, n: hf_generate(hf, b, n)  # noqa: E731
    for gen in (ours, theirs):  # warm-up
        gen(prompts(2, 16, vocab, 99), 4)
    new = 16 if a.quick else 64
    bar = tqdm(total=3 + len(contexts), desc="bench", unit="row")
    rows = []
    for bs in (1, 16):
        rows.append((f"decode tok/s, batch {bs}", *best_of(
            a.repeats, *(lambda gen=gen: decode_tok_s(gen, bs, vocab, new) for gen in (ours, theirs)))))
        bar.update()
    long = prompts(1, 512 if a.quick else 2048, vocab, seed=3)
    rows.append((f"prefill tok/s, one {len(long[0])}-token prompt", *best_of(
        a.repeats, *(lambda gen=gen: len(long[0]) / timed(lambda: gen(long, 1)) for gen in (ours, theirs)))))
    bar.update()

    mla = LLM(load_model(mla_path, dtype), tok, **ENGINE, max_model_len=max(contexts) + 64)
    steps = 4 if a.quick else 8
    context_rows = []
    for L in contexts:
        ours_s, mla_s = engine_decode_step(llm, L, vocab, steps), engine_decode_step(mla, L, vocab, steps)
        hf_s, hf_bytes = hf_decode_step(hf, L, vocab, steps)
        gc.collect()
        context_rows.append((L, ours_s, engine_cache_bytes(llm, L), hf_s, hf_bytes, mla_s,
                             engine_cache_bytes(mla, L)))
        bar.update()
    bar.close()

    print(f"\nLing bench checkpoint: {n_params / 1e6:.0f}M parameters ({backend.dtype_name(dtype)}), {LAYERS} layers "
          f"(KDA {LAYERS - LAYERS // 6}, MLA {LAYERS // 6}); {a.threads} threads; {backend.cpu_model_name()}, "
          f"{backend.cpu_description()}")
    print("\n| workload | engine | transformers | engine / transformers |\n|---|---:|---:|---:|")
    for name, mine, theirs_v in rows:
        print(f"| {name} | {mine:.1f} | {theirs_v:.1f} | {mine / theirs_v:.2f}x |")
    print("\n| context | engine step ms | engine cache MiB | transformers step ms | transformers cache MiB | "
          "all-MLA engine step ms | all-MLA cache MiB |\n|---:|---:|---:|---:|---:|---:|---:|")
    for L, o, ob, h, hb, m, mb in context_rows:
        print(f"| {L} | {o * 1e3:.1f} | {ob / 2**20:.2f} | {h * 1e3:.1f} | {hb / 2**20:.2f} | {m * 1e3:.1f} | "
              f"{mb / 2**20:.2f} |")


if __name__ == "__main__":
    main()
