"""Text-to-image from the command line; `bash run.sh` runs this. No arguments: the tiny random checkpoint (written
once into weights/hunyuan-image-tiny/), a 64x64 image in a few steps, a PNG under outputs/hunyuan-image/.

Presets (configs/*.yaml: dtype, image size, steps, guidance, cfg_parallel, tp, ep) set the defaults; flags win.
--cfg-parallel / --tp N / --ep N ask for several ranks: outside torchrun the script relaunches itself under
torchrun (`python -m torch.distributed.run`) with that many local processes (gloo on CPU, hccl on NPUs).
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

import torch
import yaml
from transformers import PreTrainedTokenizerFast

from common import backend, parallel
from common.cli_paths import input_path, output_path
from common.loader import CheckpointError
from common.diffusion.media import write_png
from pipeline_hunyuan_image import HunyuanImage3Pipeline, parse_image_size
from tiny_hunyuan_image import write_tiny_checkpoint
from weights_hunyuan_image import load_model, special_token_ids

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
TINY = ROOT / "weights" / "hunyuan-image-tiny"
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


class ArgumentParser(argparse.ArgumentParser):
    def error(self, message):  # one line and exit code 2, no usage dump
        self.exit(2, f"{self.prog}: error: {message}\n")


PRESET = {"dtype": str, "image_size": str, "infer_steps": int, "guidance": float, "cfg_parallel": bool, "tp": int,
          "ep": int}  # what a configs/*.yaml preset may set; a flag on the command line wins over the preset


def parse_args(argv=None) -> argparse.Namespace:
    p = ArgumentParser(prog="run.sh", description="HunyuanImage-3.0 text-to-image")
    p.add_argument("--config", type=input_path(HERE), default=HERE / "configs" / "tiny-cpu.yaml",
                   help="deployment preset")
    p.add_argument("--weights", type=input_path(HERE), help="checkpoint folder (default: the tiny random checkpoint)")
    p.add_argument("--prompt", default="A brown and white dog is running on the grass")
    p.add_argument("--image-size", help="'HxW' (multiples of 16, >= 32), 'N' or 'auto' (the model picks the ratio)")
    p.add_argument("--infer-steps", type=int, help="denoising steps (the publisher's default is 50)")
    p.add_argument("--guidance", type=float, help="CFG scale (<= 1: no CFG)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", choices=[backend.AUTO, *sorted(DTYPES)],
                   help="overrides the preset's (auto: bf16 on NPU and where the CPU's oneDNN runs bf16, else fp32)")
    p.add_argument("--cfg-parallel", action="store_true", default=None, help="cond and uncond on two rank halves")
    p.add_argument("--tp", type=int, help="attention tensor parallel size (divides the kv heads)")
    p.add_argument("--ep", type=int, help="MoE expert parallel size (divides the experts)")
    p.add_argument("--no-kv-reuse", action="store_true", help="recompute the full sequence every step")
    p.add_argument("--output", type=output_path, default=ROOT / "outputs" / "hunyuan-image" / "image.png")
    a = p.parse_args(argv)
    if not a.config.is_file():
        p.error(f"--config {a.config}: no such file")
    try:
        preset = yaml.safe_load(a.config.read_text()) or {}
    except yaml.YAMLError as e:
        p.error(f"--config {a.config}: not valid YAML ({str(e).splitlines()[0]})")
    if not isinstance(preset, dict) or set(preset) - set(PRESET):
        p.error(f"--config {a.config}: expected a mapping of {sorted(PRESET)}")
    flag_dtype = a.dtype
    for key, kind in PRESET.items():
        if getattr(a, key) is None:
            if key not in preset or not isinstance(preset[key], kind if kind is not float else (int, float)):
                p.error(f"--config {a.config}: {key} missing or not a {kind.__name__}")
            setattr(a, key, preset[key])
    if a.dtype not in (backend.AUTO, *DTYPES):
        p.error(f"--config {a.config}: dtype {a.dtype!r} is not one of {sorted([backend.AUTO, *DTYPES])}")
    # --dtype > the preset's dtype > auto (backend.default_dtype()); a.dtype keeps the name, e.g. "fp32"
    source = f"configs/{a.config.name}" if a.config.resolve().parent == HERE / "configs" else str(a.config)
    dtype, a.dtype_line = backend.resolve_dtype(flag_dtype, preset.get("dtype"), source)
    a.dtype = backend.dtype_name(dtype)
    try:
        a.size = parse_image_size(a.image_size)
    except ValueError as e:
        p.error(f"--image-size: {e}")
    if a.infer_steps < 1:
        p.error(f"--infer-steps {a.infer_steps}: must be >= 1")
    if a.tp < 1 or a.ep < 1:
        p.error("--tp / --ep: must be >= 1")
    if a.cfg_parallel and a.guidance <= 1:
        p.error("--cfg-parallel needs --guidance > 1 (there is no uncond branch otherwise)")
    if a.weights is not None and not (a.weights / "config.json").is_file():
        p.error(f"--weights {a.weights}: no config.json there")
    a.cfg_axis = "cfg"
    try:
        if a.cfg_parallel and a.ep > 1:  # upstream's layout: each CFG half runs TP N + EP N on its own N ranks
            if a.ep != a.tp:
                p.error(f"--cfg-parallel with --ep {a.ep} needs --tp {a.ep} (each CFG half on its own ranks)")
            # common.parallel keeps ep groups to cfg = 1 layouts: the two halves are its dp axis instead
            a.layout, a.cfg_axis = parallel.ParallelLayout(dp=2, tp=a.tp, ep=a.ep), "dp"
        else:
            a.layout = parallel.ParallelLayout(dp=max(a.ep // a.tp, 1) if a.ep > 1 else 1,
                                               cfg=2 if a.cfg_parallel else 1, tp=a.tp, ep=a.ep)
    except ValueError as e:
        p.error(f"--cfg-parallel / --tp / --ep: {e}")
    return a


def relaunch_under_torchrun(world: int, argv: list[str]) -> int:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}",
           str(Path(__file__).resolve()), *argv]
    return subprocess.run(cmd, env={**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}).returncode


def fail(message: str) -> None:
    print("error: " + "; ".join(line.strip() for line in message.splitlines() if line.strip()), file=sys.stderr)
    sys.exit(2)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    a = parse_args(argv)
    world = a.layout.world_size
    if world > 1 and "WORLD_SIZE" not in os.environ:
        return relaunch_under_torchrun(world, argv)
    t0 = time.perf_counter()
    path = a.weights or TINY
    if a.weights is None and not (TINY / "config.json").exists():
        write_tiny_checkpoint(TINY)
    par = parallel.init_parallel(a.layout)
    if par.rank == 0:
        print(a.dtype_line, flush=True)
    try:
        try:
            model = load_model(path, DTYPES[a.dtype], par.group("tp"), par.group("ep"),
                               device=backend.device(par.local_rank))
            tokenizer = PreTrainedTokenizerFast.from_pretrained(path)
            special = special_token_ids(tokenizer)
        except (CheckpointError, ValueError, OSError) as e:
            fail(str(e))
        backend.synchronize()
        load_s = time.perf_counter() - t0
        pipe = HunyuanImage3Pipeline(model, tokenizer, special, cfg_group=par.group(a.cfg_axis))
        result = pipe(a.prompt, a.size, a.infer_steps, a.guidance, a.seed, kv_reuse=not a.no_kv_reuse,
                      progress=par.rank == 0, decode=par.rank == 0)
        if par.rank == 0:
            out = write_png(a.output, result.image)
            H, W = result.image.shape[-2:]
            t = result.timings
            print(f"wrote {out}")
            print(f"size={H}x{W} ratio_index={result.ratio_index} steps={a.infer_steps} ranks={world} "
                  f"load_s={load_s:.2f} denoise_s={t['denoise_s']:.2f} s_per_step={t['denoise_s'] / a.infer_steps:.3f} "
                  f"decode_s={t['decode_s']:.2f}")
    finally:
        parallel.destroy_parallel()
    return 0


if __name__ == "__main__":
    sys.exit(main())
