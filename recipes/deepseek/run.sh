#!/usr/bin/env bash
# DeepSeek-V4 recipe. No arguments: write the tiny random checkpoint (once) and generate on CPU/NPU.
#   bash recipes/deepseek/run.sh [--weights DIR] [--prompts FILE] [--max-tokens N] [--dtype bf16|fp32]
set -euo pipefail
cd "$(dirname "$0")"
exec python generate.py "$@"
