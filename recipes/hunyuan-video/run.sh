#!/usr/bin/env bash
# HunyuanVideo text-to-video. No arguments: write the tiny random checkpoint (once, weights/hunyuan-video-tiny) and
# generate a 5-frame 64x64 clip in 4 steps to outputs/hunyuan-video/video.mp4, printing its path and stage timings.
# `--sp N` / `--ulysses-degree U --ring-degree R` (and/or `--cfg-parallel`, or a preset asking for them) launches
# the ranks with torchrun. See README.md.
#   bash recipes/hunyuan-video/run.sh [--weights DIR] [--config configs/X.yaml] [--prompt TEXT] [--video-size H W]
#        [--video-length N] [--infer-steps N] [--seed N] [--cache none|teacache|fbcache|taylorseer]
#        [--sp N | --ulysses-degree U --ring-degree R] [--cfg-parallel --true-cfg-scale S --negative-prompt TEXT]
#        [--vae-tiling]
set -euo pipefail
# relative path arguments resolve from here first (common/cli_paths.py); kept when a recipe starts another run.sh
export NPU_COOKBOOK_CALLER_DIR="${NPU_COOKBOOK_CALLER_DIR:-$PWD}"
cd "$(dirname "$0")"
ranks=$(python generate_hunyuan_video.py --world-size "$@")  # checks the arguments; exits 2 on a bad one
if ((ranks > 1)); then
  exec torchrun --standalone --nproc-per-node "$ranks" generate_hunyuan_video.py "$@"
fi
exec python generate_hunyuan_video.py "$@"
