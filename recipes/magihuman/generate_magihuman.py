"""Generate a video with audio (MP4, 25 fps, AAC) with daVinci-MagiHuman; what run.sh executes.

No --weights: the tiny random model set (written to weights/magihuman-tiny once), distilled mode, 0.4 s at 64x64.
With --weights DIR (base/, distill/, 540p_sr/, 1080p_sr/, text_encoder/, vae/, audio_vae/; see README.md) the
defaults become the upstream ones: 5 s at 448x256. Prints the output path and per-stage timings.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from common.cli_paths import input_path, output_path

MODES = ("base", "distill", "sr540", "sr1080")  # pipeline_magihuman.MODES; the heavy imports wait for valid args
DTYPES = ("auto", "bf16", "fp16", "fp32")  # auto: common.backend.default_dtype(), which follows the device

HERE = Path(__file__).resolve().parent
TINY = HERE.parents[1] / "weights" / "magihuman-tiny"
OUTPUTS = HERE.parents[1] / "outputs" / "magihuman"
PARTS = ("base", "distill", "540p_sr", "1080p_sr", "text_encoder", "vae", "audio_vae")
DEFAULT_PROMPT = "A woman in a sunlit kitchen looks into the camera and says: good morning, everyone!"


class ArgumentParser(argparse.ArgumentParser):
    def error(self, message):  # one line and exit code 2, no usage dump
        self.exit(2, f"{self.prog}: error: {message}\n")


def ensure_tiny() -> Path:
    from tiny_magihuman import STAMP, TINY_FORMAT, write_tiny_models

    stamp = TINY / STAMP
    if not (stamp.is_file() and stamp.read_text().strip() == str(TINY_FORMAT)
            and all((TINY / part / "config.json").is_file() for part in PARTS)):
        write_tiny_models(TINY)
    return TINY


def parse_size(text: str) -> tuple[int, int]:
    try:
        w, h = (int(v) for v in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not WIDTHxHEIGHT") from None
    if w < 32 or h < 32:
        raise argparse.ArgumentTypeError(f"{text!r}: width and height must be at least 32")
    return w, h


def positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not 0 < value <= 60:
        raise argparse.ArgumentTypeError(f"{text} is outside (0, 60]")
    return value


def parser() -> ArgumentParser:
    p = ArgumentParser(prog="run.sh", description=__doc__.splitlines()[0])
    p.add_argument("--weights", type=input_path(HERE), help="model folder (default: the tiny random model set)")
    p.add_argument("--mode", choices=MODES, default="distill",
                   help="base: 32 steps with CFG; distill: 8 steps; sr540 / sr1080: distill + latent super-resolution")
    p.add_argument("--prompt", default=DEFAULT_PROMPT)
    p.add_argument("--negative-prompt", help="CFG negative prompt of the base and SR stages (default: ours, short)")
    p.add_argument("--image", type=input_path(HERE), help="first frame (text+image-to-video)")
    p.add_argument("--seconds", type=positive_float, help="clip length (default 0.4 tiny, 5 real)")
    p.add_argument("--size", type=parse_size, help="WIDTHxHEIGHT of the base stage (default 64x64 tiny, 448x256 real)")
    p.add_argument("--sr-size", type=parse_size, help="WIDTHxHEIGHT of the SR stage (default 2x / 4x the base size)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--offload", action="store_true", help="keep only the running stage's model on the device")
    p.add_argument("--dtype", choices=DTYPES, default="auto", help="the DiTs' and text encoder's dtype (auto: bf16 "
                   "on NPU and where the CPU's oneDNN runs bf16, fp32 on AVX2-only CPUs; the VAEs stay fp32 on CPU)")
    p.add_argument("--out", type=output_path, help="output MP4 (default outputs/magihuman/<mode>-<seed>.mp4)")
    return p


def main(argv=None) -> int:
    p = parser()
    a = p.parse_args(argv)
    if a.weights is not None and not a.weights.is_dir():
        p.error(f"--weights {a.weights}: no such directory")
    if a.weights is not None:
        missing = [part for part in PARTS if not (a.weights / part).is_dir()]
        if missing:
            p.error(f"--weights {a.weights}: missing {', '.join(missing)}")
    if a.image is not None and not a.image.is_file():
        p.error(f"--image {a.image}: no such file")
    image = None
    if a.image is not None:
        from PIL import Image, UnidentifiedImageError
        try:
            image = Image.open(a.image)
            image.load()
        except (UnidentifiedImageError, OSError) as e:
            p.error(f"--image {a.image}: not a readable image ({e})")
    tiny = a.weights is None
    seconds = a.seconds or (0.4 if tiny else 5.0)
    size = a.size or ((64, 64) if tiny else (448, 256))
    out = a.out or OUTPUTS / f"{a.mode}-{a.seed}.mp4"
    quiet_libraries()
    from common import backend
    from common.diffusion.media import write_mp4
    from common.loader import CheckpointError
    from pipeline_magihuman import NEGATIVE_PROMPT, MagiHumanPipeline

    dtype, line = backend.resolve_dtype(a.dtype, None)
    print(line, flush=True)
    start = time.perf_counter()
    try:
        pipe = MagiHumanPipeline(ensure_tiny() if tiny else a.weights, backend.device(), offload=a.offload,
                                 dtype=dtype)
        gen = pipe(a.prompt, mode=a.mode, seconds=seconds, size=size, seed=a.seed, image=image, sr_size=a.sr_size,
                   negative_prompt=a.negative_prompt or NEGATIVE_PROMPT)
    except (CheckpointError, OSError, ValueError) as e:
        print("error: " + "; ".join(line.strip() for line in str(e).splitlines() if line.strip()), file=sys.stderr)
        return 2
    write_mp4(out, gen.video, fps=gen.fps, audio=gen.audio, sample_rate=gen.sample_rate)
    _, frames, height, width = gen.video.shape
    print(f"wrote {out} ({frames} frames {width}x{height} at {gen.fps} fps, "
          f"{gen.audio.shape[1] / gen.sample_rate:.2f} s audio at {gen.sample_rate} Hz)")
    print("stages: " + " ".join(f"{k}={v:.2f}s" for k, v in gen.timings.items()))
    print(f"mode={a.mode} device={backend.device_type()} offload={int(a.offload)} "
          f"total={time.perf_counter() - start:.2f}s")
    return 0


def quiet_libraries() -> None:
    """No per-file progress bars or deprecation notes from the libraries on the recipe's output."""
    import warnings

    from diffusers.utils import logging as diffusers_logging
    from transformers.utils import logging as hf_logging

    warnings.filterwarnings("ignore", message=".*weight_norm.*", category=FutureWarning)  # diffusers' Oobleck
    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()  # e.g. the load report listing the T5Gemma decoder weights left unread
    diffusers_logging.disable_progress_bar()


def cpu_settings() -> None:
    """CPU path: flush denormal floats to zero (random-weight DiT steps measured 2x faster with it here). A process
    setting, so it is made where the script starts, not in main(), which tests call in their own process."""
    import torch

    torch.set_flush_denormal(True)


if __name__ == "__main__":
    cpu_settings()
    sys.exit(main())
