#!/usr/bin/env bash
# DeepSeek-V4 recipe. No arguments: write the tiny random checkpoint (once) and run offline inference
# over prompts.txt with configs/tiny-cpu.yaml. See README.md for the options.
#   bash recipes/deepseek/run.sh [--weights DIR] [--config configs/X.yaml] [--prompts FILE] [--max-tokens N] ...
set -euo pipefail
cd "$(dirname "$0")"
exec python generate.py "$@"
