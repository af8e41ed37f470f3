#!/usr/bin/env bash
# HunyuanImage-3.0 text-to-image. No arguments: write the tiny random checkpoint (once, weights/hunyuan-image-tiny/),
# generate a 64x64 image in 4 steps, write outputs/hunyuan-image/image.png and print the path and timings.
#   bash recipes/hunyuan-image/run.sh [--config configs/X.yaml] [--weights DIR] [--prompt TEXT] [--image-size HxW|auto] [--infer-steps N]
#                                     [--guidance G] [--seed S] [--dtype bf16|fp32] [--output FILE]
#                                     [--cfg-parallel] [--tp N] [--ep N]     (several ranks: runs under torchrun)
set -euo pipefail
# relative path arguments resolve from here first (common/cli_paths.py); kept when a recipe starts another run.sh
export NPU_COOKBOOK_CALLER_DIR="${NPU_COOKBOOK_CALLER_DIR:-$PWD}"
cd "$(dirname "$0")"
exec python generate_hunyuan_image.py "$@"
