#!/usr/bin/env bash
# Ling-3.0-Flash recipe. No arguments: write the tiny random checkpoint (once) and run offline inference over
# prompts.txt with configs/tiny-cpu.yaml. `--serve`: the OpenAI-compatible server instead (serve_ling.py).
# See README.md for the options.
#   bash recipes/ling/run.sh [--weights DIR] [--config configs/X.yaml] [--prompts FILE] [--max-tokens N] ...
#   bash recipes/ling/run.sh --serve [--host 127.0.0.1] [--port 8000] [--api-key K] [--weights DIR] ...
#   bash recipes/ling/run.sh --serve --dp N [--port 8000] ...   (N instances on ports 8001.., router on 8000)
#   bash recipes/ling/run.sh --serve --pd P:D [--port 8000] ... (P prefill + D decode instances, router on 8000)
set -euo pipefail
# relative path arguments resolve from here first (common/cli_paths.py)
export NPU_COOKBOOK_CALLER_DIR="${NPU_COOKBOOK_CALLER_DIR:-$PWD}"
cd "$(dirname "$0")"
if [[ "${1:-}" == "--serve" ]]; then
  shift
  for arg in "$@"; do  # --dp N / --pd P:D: several server instances behind the router (common/serving/serve_dp.py)
    [[ "$arg" == --dp || "$arg" == --dp=* || "$arg" == --pd || "$arg" == --pd=* ]] \
      && exec python -m common.serving.serve_dp --command "bash $(printf %q "$PWD/run.sh") --serve" "$@"
  done
  exec python serve_ling.py "$@"
fi
exec python generate_ling.py "$@"
