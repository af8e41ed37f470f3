"""The denoising loop with text-prefix KV reuse against recomputing the full sequence every step, and the MoE
layer's grouped dispatch against a per-expert loop, side by side on one machine.

    python recipes/hunyuan-image/bench.py [--threads 2] [--steps 4] [--reps 3]

Weights: a small-but-not-trivial random checkpoint (BENCH_CONFIG below, written once to
weights/hunyuan-image-bench/), fp32, CFG (batch of 2). A 128-token prompt (bos + 127 prompt tokens) and
- 256x256 images: 16x16 latents, 256 image tokens (the issue's size);
- 128x128 images: 8x8 latents, 64 image tokens (a prompt long against the image).
Measured: the whole loop of --steps steps, median of --reps after a warm-up, the two taking turns; the two loops
must give the same
latents. Then one MoE layer on the sequence's tokens: ours (router top-k, init routing, two grouped matmuls,
finalize routing) against a per-expert loop as transformers' HunYuanMoEV1 runs it. One final line of ratios.
"""
from __future__ import annotations

import argparse
import platform
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from transformers import PreTrainedTokenizerFast

from pipeline_hunyuan_image import HunyuanImage3Pipeline
from tiny_hunyuan_image import write_tiny_checkpoint
from weights_hunyuan_image import load_model, special_token_ids

BENCH = Path(__file__).resolve().parents[2] / "weights" / "hunyuan-image-bench"
BENCH_CONFIG = dict(vocab_size=1024, hidden_size=256, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2,
                    head_dim=32, attention_head_dim=32, intermediate_size=256, moe_intermediate_size=[256] * 4,
                    num_experts=16, moe_topk=[4] * 4, num_shared_expert=[1] * 4, patch_embed_hidden_dim=64,
                    image_base_size=256,
                    vae=dict(in_channels=3, out_channels=3, latent_channels=32, block_out_channels=[64] * 5,
                             layers_per_block=1, ffactor_spatial=16, ffactor_temporal=4,
                             scaling_factor=0.562679178327931))
PROMPT_TOKENS = 128
WORDS = ("a quiet harbor at dawn with fishing boats painted red and blue, gulls over the water, mist on the hills, "
         "warm light on old stone houses, a lighthouse on the cliff, ropes and nets on the pier, ").split()


def prompt_of(tokenizer, n: int) -> str:
    """Words until the prompt is n - 1 tokens (bos makes n); stops at the first word that would overshoot."""
    words, i = [], 0
    while len(tokenizer.encode(" ".join(words + [WORDS[i % len(WORDS)]]), add_special_tokens=False)) <= n - 1:
        words.append(WORDS[i % len(WORDS)])
        i += 1
    return " ".join(words)


def median_seconds(fns, reps: int) -> list[float]:
    """Median wall time of each function, after a warm-up; the functions take turns within each repetition, so a
    burst of load from other processes on a shared machine hits them alike."""
    times = [[] for _ in fns]
    for rep in range(reps + 1):
        for fn, out in zip(fns, times):
            t0 = time.perf_counter()
            fn()
            if rep:  # repetition 0 is the warm-up
                out.append(time.perf_counter() - t0)
    return [statistics.median(t) for t in times]


def moe_loop(moe, x: torch.Tensor) -> torch.Tensor:
    """Per-expert loop (transformers HunYuanMoEV1Experts): every expert gathers its tokens, runs, index_adds."""
    weights, indices = moe.gate(x, moe.top_k)  # [T, k]
    out = torch.zeros_like(x)
    E1 = moe.experts.w13_weight.shape[1] // 2
    for e in range(moe.experts.num_experts):
        token, slot = torch.where(indices == e)
        if len(token) == 0:
            continue
        gate_up = F.linear(x[token], moe.experts.w13_weight[e])  # [n, 2I] = [activated | linear]
        h = F.silu(gate_up[:, :E1]) * gate_up[:, E1:]
        out.index_add_(0, token, F.linear(h, moe.experts.w2_weight[e]) * weights[token, slot, None].to(x.dtype))
    return out + moe.shared_mlp(x)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--reps", type=int, default=3)
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    torch.set_flush_denormal(True)  # softmax / SiLU tails otherwise reach denormals, which cost x86 CPUs dearly
    if not (BENCH / "config.json").exists():
        write_tiny_checkpoint(BENCH, seed=0, max_shard_bytes=None, **BENCH_CONFIG)
    model = load_model(BENCH, torch.float32, with_vae=False)
    tokenizer = PreTrainedTokenizerFast.from_pretrained(BENCH)
    pipe = HunyuanImage3Pipeline(model, tokenizer, special_token_ids(tokenizer))
    prompt = prompt_of(tokenizer, PROMPT_TOKENS)
    n_prompt = 1 + len(tokenizer.encode(prompt, add_special_tokens=False))
    n_params = sum(p.numel() for p in model.parameters())
    c = model.config
    print(f"HunyuanImage-3.0 bench config: hidden {c.hidden_size}, {c.num_hidden_layers} layers, "
          f"{c.num_attention_heads} q / {c.num_key_value_heads} kv heads x {c.head_dim}, {c.num_experts} experts "
          f"top-{c.moe_topk} + shared (I={c.moe_intermediate_size}), {n_params / 1e6:.1f}M parameters (no VAE), fp32, "
          f"random weights (seed 0); {a.threads} threads; {platform.processor() or platform.machine()}")
    print(f"prompt {n_prompt} tokens (with bos), CFG batch of 2, {a.steps} steps, median of {a.reps} after a warm-up")
    print(f"{'image':<10}{'latents':>8}{'seq L':>7}{'fed/step':>9}{'reuse ms':>10}{'full ms':>10}{'speedup':>9}"
          f"{'bound L/(1+hw)':>16}{'max |dlat|':>12}")
    speedups = {}
    for size in (256, 128):
        run = lambda reuse: pipe(prompt, (size, size), a.steps, 5.0, seed=0, kv_reuse=reuse,  # noqa: E731
                                 progress=False, decode=False).latents
        err = (run(True) - run(False)).abs().max().item()
        assert err < 1e-4, f"KV reuse and full recompute differ by {err}"
        t_reuse, t_full = median_seconds([lambda: run(True), lambda: run(False)], a.reps)
        hw = (size // 16) ** 2
        L = n_prompt + 4 + hw + 1
        speedups[size] = t_full / t_reuse
        print(f"{size}x{size:<6}{size // 16:>5}x{size // 16:<2}{L:>7}{1 + hw:>9}{t_reuse / a.steps * 1e3:>10.1f}"
              f"{t_full / a.steps * 1e3:>10.1f}{speedups[size]:>8.2f}x{L / (1 + hw):>15.2f}x{err:>12.1e}")
    moe = model.model.layers[0].mlp
    x = torch.randn(2 * (n_prompt + 4 + 256 + 1), c.hidden_size, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        err = (moe(x) - moe_loop(moe, x)).abs().max().item()
        assert err < 1e-4, f"grouped and loop MoE differ by {err}"
        t_grouped, t_loop = median_seconds([lambda: moe(x), lambda: moe_loop(moe, x)], 5 * a.reps)
    print(f"MoE layer, {x.shape[0]} tokens, {c.num_experts} experts top-{c.moe_topk}: grouped dispatch "
          f"{t_grouped * 1e3:.2f} ms, per-expert loop {t_loop * 1e3:.2f} ms (max |diff| {err:.1e})")
    print(f"ratios: KV reuse vs full recompute {speedups[256]:.2f}x at 16x16 latents / {n_prompt}-token prompt "
          f"(target 2x), {speedups[128]:.2f}x at 8x8; MoE grouped vs per-expert loop {t_loop / t_grouped:.2f}x")


if __name__ == "__main__":
    main()
