#!/usr/bin/env bash
# HSTU ranking recipe. No arguments: write the synthetic KuaiRand-shaped data (outputs/hstu/) and the tiny random
# checkpoint (weights/hstu-tiny/) once, then score day by day through the paged history cache (simulate) and print
# per-task AUC, candidates/s and the cache hit ratio. See README.md.
#   bash recipes/hstu/run.sh [--data DIR] [--weights DIR] [--config configs/X.yaml] [--mode simulate|eval]
#                            [--batch-users N] [--num-pages N]
set -euo pipefail
# relative path arguments resolve from here first (common/cli_paths.py); kept when a recipe starts another run.sh
export NPU_COOKBOOK_CALLER_DIR="${NPU_COOKBOOK_CALLER_DIR:-$PWD}"
cd "$(dirname "$0")"
exec python simulate_hstu.py "$@"
