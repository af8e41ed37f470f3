"""MagiHuman pipeline per-stage timings, resident vs offload, and the DiT step's achieved GFLOP/s.

    python recipes/magihuman/bench.py [--seconds 1] [--size 128x128] [--reps 2] [--threads 2] [--dtype auto|bf16|fp32]

Bench model set: the tiny text encoder and VAEs (weights/magihuman-tiny) with a larger random distilled DiT
(hidden 512, 8 layers, head_dim 64, 8 q / 2 kv heads, sandwich layers 0 and 7, gelu7 in layer 0; 33M parameters)
written once to weights/magihuman-bench; its linears run in --dtype (auto: common.backend.default_dtype(), bf16
where the CPU's oneDNN runs bf16, fp32 on AVX2-only CPUs). Distilled mode (8 steps). Measured in one run, the fastest of
--reps (resident and offload runs alternate, so both see the same load on a shared machine) after a warm-up:
- the whole pipeline per stage (text, denoise, vae_decode, audio_decode), models resident (loaded once), against
  the same pipeline with --offload (only the running stage's model kept; on the CPU that frees and reloads it);
- one DiT forward at the clip's token count, its FLOPs counted from the config (linears, attention scores and
  values; the linears' count equals torch's FlopCounterMode), as achieved GFLOP/s against a matmul peak measured
  here in the DiT's dtype and thread count: the best n^3 GEMM, n = 512, 1024, 2048, in the nn.Linear layout, or
  fused attention (common.backend.gemm_peak_gflops / attention_peak_gflops; fastest of 5 steps, fastest of 10
  GEMMs, before and after the pipeline runs).
Prints two tables and one final line.
"""
from __future__ import annotations

import argparse
import os
import platform
import sys
import time
from pathlib import Path

import torch

from common import backend
from common.loader import save_checkpoint
from config_magihuman import MagiHumanConfig
from generate_magihuman import cpu_settings, ensure_tiny, parse_size, quiet_libraries
from modeling_magihuman import build_inputs
from pipeline_magihuman import MagiHumanPipeline, latent_shape
from tiny_magihuman import TEXT_HIDDEN, random_dit_tensors

HERE = Path(__file__).resolve().parent
BENCH = HERE.parents[1] / "weights" / "magihuman-bench"
BENCH_CONFIG = dict(num_layers=8, hidden_size=512, head_dim=64, num_heads_q=8, num_heads_kv=2,
                    text_in_channels=TEXT_HIDDEN, mm_layers=[0, 7], gelu7_layers=[0])
PROMPT = "A man in a blue shirt turns to the camera and says: the bench is running."


def ensure_bench() -> Path:
    tiny = ensure_tiny()
    if not (BENCH / "distill" / "model.safetensors").is_file():
        config = MagiHumanConfig.for_variant("distill", **BENCH_CONFIG)
        save_checkpoint(BENCH / "distill", random_dit_tensors(config, seed=7), config.to_dict())
    for part in ("text_encoder", "vae", "audio_vae"):
        if not (BENCH / part).exists():
            (BENCH / part).symlink_to(tiny / part)
    return BENCH


def linear_flops(c: MagiHumanConfig, tokens: int, video: int, audio: int) -> float:
    """2 x multiply-adds of every linear of one forward over `tokens` tokens (embedders, layers, heads)."""
    per_token = 0
    for i in range(c.num_layers):
        inter = c.gelu7_intermediate if i in c.gelu7_layers else c.swiglu_intermediate
        up = inter if i in c.gelu7_layers else 2 * inter
        per_token += c.hidden_size * (c.qkv_size + c.hidden_size + up) + inter * c.hidden_size
    embed = c.hidden_size * (video * c.video_in_channels + audio * c.audio_in_channels
                             + (tokens - video - audio) * c.text_in_channels)
    heads = c.hidden_size * (video * c.video_in_channels + audio * c.audio_in_channels)
    return 2.0 * (per_token * tokens + embed + heads)


def attention_flops(c: MagiHumanConfig, tokens: int) -> float:
    """q k^T and p v of full attention in every layer (local windows counted as full)."""
    return 2.0 * c.num_layers * 2 * tokens * tokens * c.num_heads_q * c.head_dim


def dit_flops(c: MagiHumanConfig, tokens: int, video: int, audio: int) -> float:
    return linear_flops(c, tokens, video, audio) + attention_flops(c, tokens)


def dit_peak(dtype) -> float:
    """The DiT's dtype, at the run's thread count: the best GEMM, or torch's fused attention (which outruns bf16
    GEMMs where oneDNN has no bf16 kernels)."""
    return max(backend.gemm_peak_gflops(dtype, reps=10), backend.attention_peak_gflops(dtype, head_dim=64))


def time_pipelines(weights, device, args):
    """Resident and offload pipelines, warmed up, then run alternately (both see the same machine load); the
    fastest of --reps runs per stage. Returns (resident pipeline, {mode: timings}, {mode: first run s}, outputs)."""
    pipes = {"resident": MagiHumanPipeline(weights, device, dtype=args.dtype),
             "offload": MagiHumanPipeline(weights, device, offload=True, dtype=args.dtype)}
    run = lambda pipe: pipe(PROMPT, mode="distill", seconds=args.seconds, size=args.size, seed=0)  # noqa: E731
    first, outputs, runs = {}, {}, {name: [] for name in pipes}
    for name, pipe in pipes.items():
        start = time.perf_counter()
        outputs[name] = run(pipe)  # warm-up (resident: also the one-time loads)
        first[name] = time.perf_counter() - start
    for _ in range(args.reps):
        for name, pipe in pipes.items():
            start = time.perf_counter()
            gen = run(pipe)
            runs[name].append(dict(gen.timings, total=time.perf_counter() - start))
    best = {name: {k: min(r[k] for r in rs) for k in rs[0]} for name, rs in runs.items()}
    return pipes["resident"], best, first, outputs


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seconds", type=float, default=1.0)
    p.add_argument("--size", type=parse_size, default=(128, 128))
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--threads", type=int, default=min(2, os.cpu_count() or 1))
    p.add_argument("--dtype", choices=[backend.AUTO, *sorted(backend.DTYPES)], default=backend.AUTO,
                   help="the DiT's and text encoder's dtype (auto: backend.default_dtype(), which follows the CPU)")
    args = p.parse_args(argv)
    args.dtype, dtype_line = backend.resolve_dtype(args.dtype, None)
    print(dtype_line, flush=True)
    torch.set_num_threads(args.threads)
    quiet_libraries()
    cpu_settings()
    device = backend.device()
    weights = ensure_bench()
    peak_before = dit_peak(args.dtype)

    pipe, best, first, outputs = time_pipelines(weights, device, args)
    resident, offload = best["resident"], best["offload"]
    assert torch.equal(outputs["resident"].video_latent, outputs["offload"].video_latent), "offload changed the result"

    dit = pipe.models.models["distill"]
    c = dit.config
    A, T, h, w = latent_shape(args.seconds, *args.size)
    text_len = pipe.encode_text([PROMPT])[0].shape[0]
    inp = build_inputs(c, (T, h // 2, w // 2), A, text_len, device)
    video, audio = torch.randn(48, T, h, w, device=device), torch.randn(A, 64, device=device)
    text = torch.randn(text_len, c.text_in_channels, device=device)
    with torch.no_grad():
        dit.velocity(video, audio, text, inp)
        steps = []
        for _ in range(5):
            backend.synchronize()
            start = time.perf_counter()
            dit.velocity(video, audio, text, inp)
            backend.synchronize()
            steps.append(time.perf_counter() - start)
    step = min(steps)
    tokens = inp.video_tokens + A + text_len
    gflops = dit_flops(c, tokens, inp.video_tokens, A) / step / 1e9
    params = sum(t.numel() for t in dit.state_dict().values())
    peak = max(peak_before, dit_peak(args.dtype))  # before and after the runs: the less disturbed of the two
    name = backend.dtype_name(args.dtype)

    print(f"# {platform.processor() or platform.machine()}, {backend.device_type()}, torch {torch.__version__}, "
          f"{args.threads} threads; distilled mode, {args.seconds:g} s at {args.size[0]}x{args.size[1]} "
          f"({T} latent frames, {tokens} DiT tokens), DiT {params / 1e6:.1f}M params, best of {args.reps}")
    print(f"{'stage':<14}{'resident s':>12}{'offload s':>12}{'offload/resident':>18}")
    for k in [*[k for k in resident if k not in ("load", "total")], "load", "total"]:
        ratio = f"{offload[k] / resident[k]:.2f}x" if resident[k] > 1e-3 else "-"
        print(f"{k:<14}{resident[k]:>12.3f}{offload[k]:>12.3f}{ratio:>18}")
    print(f"{'first run':<14}{first['resident']:>12.3f}{first['offload']:>12.3f}")
    print(f"{'DiT step':<14}{step * 1e3:>10.1f}ms  {gflops:>8.2f} GFLOP/s  {name} matmul peak {peak:.1f} GFLOP/s")
    print(f"magihuman bench: offload/resident total {offload['total'] / resident['total']:.2f}x "
          f"(load {offload['load']:.2f}s vs {resident['load']:.2f}s), DiT step {gflops:.1f} GFLOP/s = "
          f"{100 * gflops / peak:.1f}% of the {name} matmul peak {peak:.1f} GFLOP/s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
