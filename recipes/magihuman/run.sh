#!/usr/bin/env bash
# daVinci-MagiHuman recipe: text(+image) to video with audio. No arguments: write the tiny random model set
# (weights/magihuman-tiny/) once, generate 0.4 s at 64x64 with the distilled mode, write an MP4 (25 fps, AAC audio)
# to outputs/magihuman/ and print its path and the stage timings. See README.md.
#   bash recipes/magihuman/run.sh [--weights DIR] [--mode base|distill|sr540|sr1080] [--prompt TEXT] [--image FILE]
#                                 [--seconds S] [--size WxH] [--sr-size WxH] [--seed N] [--offload] [--out FILE]
#                                 [--dtype auto|bf16|fp16|fp32]
set -euo pipefail
# relative path arguments resolve from here first (common/cli_paths.py); kept when a recipe starts another run.sh
export NPU_COOKBOOK_CALLER_DIR="${NPU_COOKBOOK_CALLER_DIR:-$PWD}"
cd "$(dirname "$0")"
exec python generate_magihuman.py "$@"
