"""The HunyuanVideo DiT against diffusers' HunyuanVideoTransformer3DModel on the same weights, in one run.

    python recipes/hunyuan-video/bench.py [--reps 3] [--steps 20] [--threads 1] [--dtype auto|bf16|fp32] [--quick]

Random weights (fixed seed) in --dtype (auto: common.backend.default_dtype(), bf16 where the CPU's oneDNN runs
bf16, fp32 on AVX2-only CPUs), the bench config below (hidden 512 = 4 heads x 128, RoPE [16, 56, 56],
4 double + 4 single blocks, text dims 4096 / 768 as the publisher's), converted to diffusers' names for the
reference. One sample: latent [1, 16, 4, 16, 16] (256 video tokens) and a prompt padded to 256 tokens of which 40
are real, as the pipeline passes it. Measured, median of --reps after one warm-up:
- one DiT step (a forward) for ours and diffusers, taking turns, and the ratio (target <= 0.8x diffusers); also
  with the prompt passed unpadded (40 tokens, no mask), which takes away what dropping the padding saves us;
- achieved GFLOP/s of our forward: the useful FLOPs counted analytically (video + real text tokens; every
  linear, conv, attention score and value product, 2 FLOPs per multiply-add; within 0.3% of what
  torch.utils.flop_counter.FlopCounterMode counts for this forward) over the measured time, against a
  matmul peak measured in the same run in the run's dtype, threads and clock (the best of n^3 GEMMs, n = 512, 1024,
  2048, in the nn.Linear layout, and of torch's fused attention: common.backend.gemm_peak_gflops,
  attention_peak_gflops; target >= 50%);
- a denoising loop of --steps steps (FlowMatchEulerDiscreteScheduler, shift 7) with each step cache (none,
  teacache 0.15, fbcache 0.05, taylorseer interval 5 order 1): wall time, speed-up over no cache, steps computed,
  and the PSNR of the final latent against the uncached loop's.
Prints a table, then one line of ratios. With one thread (the default) every time is the thread's CPU time
(time.thread_time): all the work runs on the calling thread, and other processes on a shared machine do not
inflate it; with --threads N > 1, wall time.
"""
from __future__ import annotations

import argparse
import math
import platform
import statistics
import time

import numpy as np
import torch
from diffusers import FlowMatchEulerDiscreteScheduler, HunyuanVideoTransformer3DModel

from common import backend
from common.diffusion.step_cache import StepCache
from config_hunyuan_video import REFINER_DEPTH, REFINER_MLP_RATIO, HunyuanVideoConfig
from modeling_hunyuan_video import HunyuanVideoTransformer3D
from weights_hunyuan_video import diffusers_config, publisher_to_diffusers, random_state_dict

BENCH_CONFIG = HunyuanVideoConfig(hidden_size=512, heads_num=4, rope_dim_list=(16, 56, 56), mm_double_blocks_depth=4,
                                  mm_single_blocks_depth=4)
LATENT = (1, 16, 4, 16, 16)
TEXT_LEN, TEXT_REAL = 256, 40
CACHES = (("none", {}), ("teacache", {"threshold": 0.15}), ("fbcache", {"threshold": 0.05}),
          ("taylorseer", {"interval": 5, "order": 1}))
DTYPE = torch.bfloat16  # main() sets the run's dtype (--dtype)


def forward_flops(cfg: HunyuanVideoConfig, latent: tuple, text_tokens: int) -> float:
    """Useful FLOPs of one forward: N video tokens, L real text tokens (padding is no useful work)."""
    _, cin, T, H, W = latent
    N = math.prod(n // p for n, p in zip((T, H, W), cfg.patch_size))
    L, C, M, S = text_tokens, cfg.hidden_size, cfg.mlp_hidden_dim, N + text_tokens
    patch = 2 * N * C * cin * math.prod(cfg.patch_size)
    refiner_mlp = int(C * REFINER_MLP_RATIO)
    refiner = 2 * L * cfg.text_states_dim * C + REFINER_DEPTH * (2 * L * C * 4 * C + 4 * L * C * refiner_mlp
                                                                  + 4 * L * L * C)
    double = 2 * S * C * 4 * C + 4 * S * C * M + 4 * S * S * C  # qkv + proj, MLP, scores + values (both streams)
    single = 2 * S * C * (3 * C + M) + 2 * S * (C + M) * C + 4 * S * S * C
    final = 2 * N * C * math.prod(cfg.patch_size) * cfg.out_channels
    return float(patch + refiner + cfg.mm_double_blocks_depth * double + cfg.mm_single_blocks_depth * single + final)


CLOCK = time.perf_counter  # main() switches to time.thread_time with one thread


def _timed(fn) -> float:
    start = CLOCK()
    fn()
    return CLOCK() - start


def paired_times(fns, reps: int) -> list[float]:
    """Median time of each fn, the fns taking turns within every rep (a busy machine slows both alike)."""
    for fn in fns:
        fn()  # warm-up
    times = [[] for _ in fns]
    for _ in range(reps):
        for fn, ts in zip(fns, times):
            ts.append(_timed(fn))
    return [statistics.median(ts) for ts in times]


def inputs(cfg: HunyuanVideoConfig, seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    mask = (torch.arange(TEXT_LEN) < TEXT_REAL).long()[None]  # [1, L]
    return dict(hidden_states=torch.randn(LATENT, generator=g).to(DTYPE), timestep=torch.tensor([900.0]),
                encoder_hidden_states=torch.randn(1, TEXT_LEN, cfg.text_states_dim, generator=g).to(DTYPE),
                encoder_attention_mask=mask,
                pooled_projections=torch.randn(1, cfg.text_states_dim_2, generator=g).to(DTYPE),
                guidance=torch.tensor([6000.0], dtype=DTYPE))


def denoise(model, x: dict, steps: int, cache: StepCache) -> torch.Tensor:
    """The pipeline's flow-matching loop (shift 7) on the DiT alone; returns the final latent (fp32)."""
    scheduler = FlowMatchEulerDiscreteScheduler(shift=7.0)
    scheduler.set_timesteps(sigmas=np.linspace(1.0, 0.0, steps + 1)[:-1])
    latents = x["hidden_states"].float()
    for i, t in enumerate(scheduler.timesteps):
        velocity = model(**dict(x, hidden_states=latents.to(DTYPE), timestep=t.expand(1)), step=i, step_cache=cache)
        latents = scheduler.step(velocity.float(), t, latents, return_dict=False)[0]
    return latents


def psnr(x: torch.Tensor, ref: torch.Tensor) -> float:
    mse = (x.float() - ref.float()).square().mean().item()
    peak = (ref.max() - ref.min()).item()
    return float("inf") if mse == 0 else 10 * math.log10(peak**2 / mse)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1: the machine is shared, "
                        "and two threads that are descheduled in turn wait on each other)")
    parser.add_argument("--dtype", choices=[backend.AUTO, *sorted(backend.DTYPES)], default=backend.AUTO,
                        help="weights and activations (auto: backend.default_dtype(), which follows the CPU)")
    parser.add_argument("--quick", action="store_true", help="1 rep, 8 steps (a smoke run)")
    args = parser.parse_args()
    if args.quick:
        args.reps, args.steps = 1, 8
    global DTYPE
    DTYPE, dtype_line = backend.resolve_dtype(args.dtype, None)
    print(dtype_line, flush=True)
    torch.set_num_threads(args.threads)
    heap = backend.keep_freed_host_memory()  # what the pipeline's CPU path does; both sides benefit
    global CLOCK
    CLOCK = time.thread_time if args.threads == 1 else time.perf_counter
    cfg = BENCH_CONFIG
    weights = {k: v.to(DTYPE) for k, v in random_state_dict(cfg, seed=0).items()}
    ours = HunyuanVideoTransformer3D(cfg).to(DTYPE).eval()
    ours.load_state_dict(weights)
    reference = HunyuanVideoTransformer3DModel(**diffusers_config(cfg)).to(DTYPE).eval()
    reference.load_state_dict(publisher_to_diffusers(weights), strict=True)
    x = inputs(cfg)

    with torch.inference_mode():
        got, want = ours(**x), reference(**x, return_dict=False)[0]
        diff = ((got.float() - want.float()).abs().max() / want.float().abs().max()).item()
        t_ours, t_ref = paired_times([lambda: ours(**x), lambda: reference(**x, return_dict=False)], args.reps)
        short = dict(x, encoder_hidden_states=x["encoder_hidden_states"][:, :TEXT_REAL],
                     encoder_attention_mask=x["encoder_attention_mask"][:, :TEXT_REAL])  # the prompt unpadded
        t_ours_short, t_ref_short = paired_times([lambda: ours(**short), lambda: reference(**short, return_dict=False)],
                                                 args.reps)
        # the run's dtype, threads and clock; the fused attention too, which outruns bf16 GEMMs without oneDNN bf16
        peak = max(backend.gemm_peak_gflops(DTYPE, clock=CLOCK), backend.attention_peak_gflops(DTYPE, clock=CLOCK))
        flops = forward_flops(cfg, LATENT, TEXT_REAL)
        achieved = flops / t_ours / 1e9
        loops = {}
        for name, options in CACHES:
            cache = StepCache.from_config(name, args.steps, **options)
            start = CLOCK()
            latent = denoise(ours, x, args.steps, cache)
            loops[name] = (CLOCK() - start, latent, sum(cache.computed))

    clock = "thread CPU time" if CLOCK is time.thread_time else "wall time"
    dname = backend.dtype_name(DTYPE)
    print(f"HunyuanVideo DiT bench: {platform.processor() or platform.machine()}, {torch.get_num_threads()} threads "
          f"({clock}), "
          f"torch {torch.__version__}; random {dname} weights (seed 0), hidden {cfg.hidden_size} = {cfg.heads_num} x "
          f"{cfg.head_dim}, {cfg.mm_double_blocks_depth} double + {cfg.mm_single_blocks_depth} single blocks, "
          f"latent {list(LATENT)}, text {TEXT_REAL} real of {TEXT_LEN}; freed host memory kept in the heap: {heap}")
    print(f"output vs diffusers ({dname}): max |diff| / max |ref| = {diff:.2e}")
    print(f"{'':28}{'ours':>12}{'diffusers':>12}{'ratio':>10}")
    print(f"{'DiT step (ms)':28}{t_ours * 1e3:12.1f}{t_ref * 1e3:12.1f}{t_ours / t_ref:9.2f}x")
    print(f"{'  prompt unpadded (ms)':28}{t_ours_short * 1e3:12.1f}{t_ref_short * 1e3:12.1f}"
          f"{t_ours_short / t_ref_short:9.2f}x")
    print(f"{'GFLOP/s (useful)':28}{achieved:12.1f}{flops / t_ref / 1e9:12.1f}")
    print(f"{dname + ' matmul peak GFLOP/s':28}{peak:12.1f}{'':12}{achieved / peak:9.0%} of peak")
    print(f"\n{args.steps}-step loop (shift 7){'time (s)':>12}{'speed-up':>10}{'computed':>10}{'PSNR (dB)':>11}")
    base_time, base_latent, _ = loops["none"]
    for name, (seconds, latent, computed) in loops.items():
        print(f"{name:28}{seconds:12.2f}{base_time / seconds:9.2f}x{computed:>7}/{args.steps}"
              f"{psnr(latent, base_latent):11.1f}")
    speedups = " ".join(f"{name} {base_time / loops[name][0]:.2f}x (PSNR {psnr(loops[name][1], base_latent):.1f} dB)"
                        for name, _ in CACHES[1:])
    print(f"\nratios: step {t_ours / t_ref:.2f}x diffusers (target <= 0.8; {t_ours_short / t_ref_short:.2f}x "
          f"unpadded); {achieved / peak:.0%} of the {dname} matmul peak "
          f"(target >= 50%); {speedups}")


if __name__ == "__main__":
    main()
