#!/usr/bin/env bash
# Ling-3.0-Flash recipe. No arguments: write the tiny random checkpoint (once) and run offline inference over
# prompts.txt with configs/tiny-cpu.yaml. `--serve`: the OpenAI-compatible server instead (serve_ling.py).
# See README.md for the options.
#   bash recipes/ling/run.sh [--weights DIR] [--config configs/X.yaml] [--prompts FILE] [--max-tokens N] ...
#   bash recipes/ling/run.sh --serve [--host 127.0.0.1] [--port 8000] [--api-key K] [--weights DIR] ...
set -euo pipefail
# relative path arguments resolve from here first (common/cli_paths.py)
export NPU_COOKBOOK_CALLER_DIR="${NPU_COOKBOOK_CALLER_DIR:-$PWD}"
cd "$(dirname "$0")"
if [[ "${1:-}" == "--serve" ]]; then
  shift
  exec python serve_ling.py "$@"
fi
exec python generate_ling.py "$@"
