"""HunyuanVideo text-to-video from the command line: one prompt -> one MP4 (H.264), stage timings printed.

    python generate_hunyuan_video.py [--weights DIR] [--config configs/X.yaml] [--prompt TEXT] [--video-size H W]
        [--video-length N] [--infer-steps N] [--seed N] [--cache none|teacache|fbcache|taylorseer]
        [--true-cfg-scale S --negative-prompt TEXT] [--vae-tiling] [--output FILE.mp4]
        [--sp N | --ulysses-degree U --ring-degree R] [--cfg-parallel]
Multi-rank (sequence parallel, CFG parallel) runs go through run.sh, which launches torchrun.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch
import yaml

from common.cli_paths import input_path, output_path
from common.diffusion.step_cache import POLICIES
from sampling_hunyuan_video import SamplingConfig

HERE = Path(__file__).resolve().parent
TINY = HERE.parents[1] / "weights" / "hunyuan-video-tiny"
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
AUTO = "auto"  # --dtype / a preset's dtype (also a preset without one): common.backend.default_dtype()
DEFAULT_PROMPT = "A cat walks on the grass, realistic style."


class ArgumentParser(argparse.ArgumentParser):
    def error(self, message):  # one line and exit code 2, no usage dump
        self.exit(2, f"{self.prog}: error: {message}\n")


def parse_args(argv=None) -> argparse.Namespace:
    p = ArgumentParser(prog="hunyuan-video", description=__doc__.splitlines()[0])
    p.add_argument("--weights", type=input_path(HERE),
                   help="checkpoint root (the publisher's ckpts/ layout; default: tiny)")
    p.add_argument("--config", type=input_path(HERE), default=HERE / "configs" / "tiny-cpu.yaml", help="preset")
    p.add_argument("--prompt", default=DEFAULT_PROMPT)
    p.add_argument("--video-size", type=int, nargs=2, metavar=("H", "W"))
    p.add_argument("--video-length", type=int)
    p.add_argument("--infer-steps", type=int)
    p.add_argument("--seed", type=int)
    p.add_argument("--cache", choices=POLICIES)
    p.add_argument("--embedded-guidance", type=float)
    p.add_argument("--flow-shift", type=float)
    p.add_argument("--true-cfg-scale", type=float, help="> 1 with --negative-prompt: real CFG (two branches)")
    p.add_argument("--negative-prompt")
    p.add_argument("--sp", type=int, help="sequence-parallel ranks, Ulysses unless the degrees say otherwise")
    p.add_argument("--ulysses-degree", type=int, help="Ulysses (all-to-all) ranks inside each ring step")
    p.add_argument("--ring-degree", type=int, help="ring-attention ranks; sp = ulysses degree x ring degree")
    p.add_argument("--cfg-parallel", action="store_true", help="cond / uncond branches on two ranks")
    p.add_argument("--vae-tiling", action="store_true", help="tiled (patch-parallel under sp) VAE decode")
    p.add_argument("--dtype", choices=[AUTO, *sorted(DTYPES)], help="overrides the preset's dtype (auto: follow the "
                   "device: bf16 on NPU and where the CPU's oneDNN runs bf16, fp32 on AVX2-only CPUs)")
    p.add_argument("--world-size", action="store_true", help=argparse.SUPPRESS)  # run.sh: how many ranks to launch
    p.add_argument("--output", type=output_path, default=HERE.parents[1] / "outputs" / "hunyuan-video" / "video.mp4")
    a = p.parse_args(argv)
    if a.weights is not None and not a.weights.is_dir():
        p.error(f"--weights {a.weights}: no such directory")
    if not a.config.is_file():
        p.error(f"--config {a.config}: no such file")
    try:
        preset = yaml.safe_load(a.config.read_text()) or {}
    except yaml.YAMLError as e:
        p.error(f"--config {a.config}: not valid YAML ({str(e).splitlines()[0]})")
    sampling = dict(preset.get("sampling") or {})
    given = {"height": a.video_size and a.video_size[0], "width": a.video_size and a.video_size[1],
             "video_length": a.video_length, "infer_steps": a.infer_steps, "seed": a.seed, "cache": a.cache,
             "embedded_guidance": a.embedded_guidance, "flow_shift": a.flow_shift,
             "true_cfg_scale": a.true_cfg_scale, "negative_prompt": a.negative_prompt}
    sampling.update({k: v for k, v in given.items() if v is not None})
    try:
        a.sampling = SamplingConfig(**sampling)
    except (TypeError, ValueError) as e:
        p.error(str(e))
    par = preset.get("parallel") or {}
    given = a.ulysses_degree is not None or a.ring_degree is not None
    for name in ("ulysses_degree", "ring_degree"):  # a degree given on the command line overrides both of the preset's
        if getattr(a, name) is None:
            setattr(a, name, 1 if given else int(par.get(name, 1)))
    if min(a.ulysses_degree, a.ring_degree) < 1:
        p.error(f"--ulysses-degree {a.ulysses_degree} / --ring-degree {a.ring_degree}: must be >= 1")
    if a.sp is not None:
        if a.sp < 1:
            p.error(f"--sp {a.sp}: must be >= 1")
        if not given:  # --sp N alone: Ulysses over N ranks
            a.ulysses_degree, a.ring_degree = a.sp, 1
        elif a.sp != a.ulysses_degree * a.ring_degree:
            p.error(f"--sp {a.sp} != --ulysses-degree {a.ulysses_degree} x --ring-degree {a.ring_degree}")
    a.sp = a.ulysses_degree * a.ring_degree
    a.cfg = 2 if a.cfg_parallel or int(par.get("cfg", 1)) == 2 else 1
    if a.cfg == 2 and not a.sampling.true_cfg:
        p.error("--cfg-parallel needs true CFG: --true-cfg-scale > 1 (and usually --negative-prompt)")
    if a.world_size:
        sys.stdout.write(f"{a.sp * a.cfg}\n")  # one write: under torchrun both ranks print to one pipe
        sys.exit(0)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if a.sp * a.cfg != world:
        p.error(f"sp={a.sp} x cfg={a.cfg} needs {a.sp * a.cfg} ranks, this run has {world}: launch through run.sh")
    a.text_encoder = preset.get("text_encoder") or {}
    a.vae_tiling = a.vae_tiling or bool(preset.get("vae_tiling", False))
    for name, default, allowed in (("dtype", AUTO, [AUTO, *DTYPES]), ("vae_dtype", "fp32", list(DTYPES))):
        if preset.get(name, default) not in allowed:
            p.error(f"--config {a.config.name}: {name} {preset[name]!r}, expected one of {sorted(allowed)}")
    from common import backend  # only torch: the start-up check stays light

    source = f"configs/{a.config.name}" if a.config.resolve().parent == HERE / "configs" else str(a.config)
    a.dtype, a.dtype_line = backend.resolve_dtype(a.dtype, preset.get("dtype", AUTO), source)
    a.vae_dtype = DTYPES[preset.get("vae_dtype", "fp32")]
    return a


def main(argv=None) -> int:
    a = parse_args(argv)
    # the heavy imports (transformers, diffusers) after the arguments are known to be good
    from common import backend
    from common.diffusion.media import write_mp4
    from common.loader import CheckpointError
    from common.parallel import ParallelLayout, destroy_parallel, init_parallel
    from config_hunyuan_video import MODEL_DIR
    from pipeline_hunyuan_video import HunyuanVideoPipeline
    from text_encoder_hunyuan_video import TextEncoderConfig
    from tiny_hunyuan_video import write_tiny_checkpoint
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # per-tensor "Loading weights" bars; the denoising loop keeps its own
    parallel = init_parallel(ParallelLayout(cfg=a.cfg, sp=a.sp))
    if parallel.rank == 0:
        print(a.dtype_line, flush=True)
    try:
        root = a.weights or TINY
        if a.weights is None and not TINY.exists() and parallel.rank == 0:
            write_tiny_checkpoint(TINY)
        if parallel.distributed:
            torch.distributed.barrier()
        if not (root / MODEL_DIR / "transformers").is_dir():
            raise CheckpointError(f"{root}: no {MODEL_DIR}/transformers folder (expected the publisher's ckpts/ layout)")
        start = time.perf_counter()
        pipe = HunyuanVideoPipeline.from_pretrained(root, a.dtype, backend.device(), parallel,
                                                    vae_dtype=a.vae_dtype,
                                                    text_config=TextEncoderConfig(**a.text_encoder),
                                                    ulysses_degree=a.ulysses_degree, ring_degree=a.ring_degree,
                                                    vae_tiling=a.vae_tiling)
        load_s = time.perf_counter() - start
        out = pipe(a.prompt, a.sampling)
    except (CheckpointError, ValueError, TypeError, OSError) as e:
        print("error: " + "; ".join(line.strip() for line in str(e).splitlines()), file=sys.stderr)
        return 2
    finally:
        destroy_parallel()
    if parallel.rank == 0:
        path = write_mp4(a.output, out.video, fps=24)
        cfg = a.sampling
        skipped = out.computed_steps.count(False)
        print(f"wrote {path} ({cfg.video_length} frames, {cfg.height}x{cfg.width}, 24 fps)")
        print(f"load {load_s:.2f} s | text encoders {out.timings['text_encoders']:.2f} s | denoise "
              f"{out.timings['denoise']:.2f} s ({cfg.infer_steps} steps, {skipped} skipped by cache={cfg.cache}) | "
              f"vae decode {out.timings['vae_decode']:.2f} s | ranks sp={a.sp} (ulysses {a.ulysses_degree} x ring "
              f"{a.ring_degree}) cfg={a.cfg}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
