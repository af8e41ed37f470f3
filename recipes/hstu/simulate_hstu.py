"""Score a KuaiRand-shaped log day by day with the HSTU ranking model and print per-task AUC.

For day d = 1 .. D-1, every user active on day d is scored: history = its events before day d, candidates = its
events of day d (labels: their action flags). Modes:
- simulate: the paged history cache holds each user's history K / V; a batch computes only the history tokens
  not yet cached plus the candidates, and appends those history tokens (evicted users are recomputed).
  With cache.host_chunk_size > 0 an evicted user's complete chunks go to host memory and are onloaded on return.
- eval: every batch recomputes each user's full sequence (the reference the cache must match).

    python simulate_hstu.py [--data DIR] [--weights DIR] [--config configs/X.yaml] [--mode simulate|eval]
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
import yaml

from common import backend
from common.cli_paths import input_path
from common.loader import CheckpointError
from data_hstu import TASKS, User, read_dataset, write_synthetic
from kv_cache_hstu import HistoryKVCache
from metrics_hstu import auc
from modeling_hstu import HSTUModel, load_model, make_batch, user_tokens, write_tiny_checkpoint

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
TINY = ROOT / "weights" / "hstu-tiny"
DATA = ROOT / "outputs" / "hstu" / "kuairand-synthetic"
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def make_cache(model: HSTUModel, num_pages: int, page_size: int, host_chunk_size: int = 0) -> HistoryKVCache:
    c, p = model.config, next(model.parameters())
    assert c.causal_contextual, "the history cache needs causal contextual tokens (HSTUConfig.causal_contextual)"
    return HistoryKVCache(c.num_layers, num_pages, page_size, c.num_heads, c.attention_dim, c.linear_dim,
                          p.dtype, p.device, host_chunk_size)


@torch.inference_mode()
def score_day(model: HSTUModel, users: list[User], day: int, cache: HistoryKVCache | None = None):
    """Score users' day-`day` events against their earlier history -> (logits [N, tasks], labels [N, tasks])."""
    c, device = model.config, next(model.parameters()).device
    rows, new_history, labels = [], [], []
    for user in users:
        history = [(e.video_id, e.action) for e in user.events if e.day < day]
        candidates = [e for e in user.events if e.day == day]
        tokens = user_tokens(c, user.contextual, history)
        start = 0 if cache is None else cache.cached_length(user.user_id)
        rows.append((tokens[start:], start, [e.video_id for e in candidates]))
        new_history.append(len(tokens) - start)
        labels += [[(e.action >> t) & 1 for t in range(c.num_tasks)] for e in candidates]
    batch = make_batch(c, rows)
    kv = None if cache is None else cache.begin([u.user_id for u in users], new_history, batch.lengths)
    logits = model(batch.to(device), kv)
    return logits.float().cpu(), torch.tensor(labels)


def simulate(model, users: list[User], num_days: int, batch_users: int, cache: HistoryKVCache | None = None):
    """All days, users in batches of `batch_users` -> (logits [N, tasks], labels [N, tasks])."""
    logits, labels = [], []
    for day in range(1, num_days):
        active = [u for u in users if any(e.day == day for e in u.events)]
        for i in range(0, len(active), batch_users):
            out, lab = score_day(model, active[i:i + batch_users], day, cache)
            logits.append(out)
            labels.append(lab)
    return torch.cat(logits), torch.cat(labels)


class ArgumentParser(argparse.ArgumentParser):
    def error(self, message):  # one line and exit code 2, no usage dump
        self.exit(2, f"{self.prog}: error: {message}\n")


def parse_args(argv=None) -> argparse.Namespace:
    p = ArgumentParser(prog="run.sh", description=__doc__.splitlines()[0])
    p.add_argument("--data", type=input_path(HERE), help="folder with user_features_1k.csv + log_standard_1k.csv "
                   "(default: synthetic data, written on first use)")
    p.add_argument("--weights", type=input_path(HERE), help="checkpoint folder (default: the tiny random checkpoint)")
    p.add_argument("--config", type=input_path(HERE), default=HERE / "configs" / "tiny-cpu.yaml", help="preset")
    p.add_argument("--mode", choices=("simulate", "eval"), default="simulate")
    p.add_argument("--batch-users", type=int, help="overrides the preset's batch_users")
    p.add_argument("--num-pages", type=int, help="overrides the preset's cache.num_pages")
    a = p.parse_args(argv)
    if a.data is not None and not a.data.is_dir():
        p.error(f"--data {a.data}: no such directory")
    if a.weights is not None and not a.weights.is_dir():
        p.error(f"--weights {a.weights}: no such directory")
    if not a.config.is_file():
        p.error(f"--config {a.config}: no such file")
    try:
        preset = yaml.safe_load(a.config.read_text()) or {}
    except yaml.YAMLError as e:
        p.error(f"--config {a.config}: not valid YAML ({str(e).splitlines()[0]})")
    a.dtype = preset.get("dtype", backend.AUTO)  # a name, or auto (also no dtype): backend.default_dtype()
    if a.dtype not in (backend.AUTO, *DTYPES):
        p.error(f"--config {a.config.name}: dtype {a.dtype!r} is not one of {sorted([backend.AUTO, *DTYPES])}")
    source = f"configs/{a.config.name}" if a.config.resolve().parent == HERE / "configs" else str(a.config)
    a.torch_dtype, a.dtype_line = backend.resolve_dtype(None, a.dtype, source)
    a.batch_users = a.batch_users if a.batch_users is not None else int(preset.get("batch_users", 8))
    cache = preset.get("cache") or {}
    a.num_pages = a.num_pages if a.num_pages is not None else int(cache.get("num_pages", 96))
    a.page_size = int(cache.get("page_size", 8))
    a.host_chunk_size = int(cache.get("host_chunk_size", 0))
    if a.batch_users < 1:
        p.error(f"--batch-users {a.batch_users}: must be at least 1")
    if a.num_pages < 2 or a.page_size < 1:
        p.error(f"--num-pages {a.num_pages} / page_size {a.page_size}: need at least 2 pages of at least 1 token")
    if a.host_chunk_size < 0:
        p.error(f"--config {a.config.name}: cache.host_chunk_size {a.host_chunk_size} must be >= 0 (0 = no host tier)")
    return a


def main(argv=None) -> None:
    a = parse_args(argv)
    if a.weights is None and not (TINY / "config.json").exists():
        write_tiny_checkpoint(TINY)
    if a.data is None and not (DATA / "log_standard_1k.csv").exists():
        write_synthetic(DATA)
    try:
        model = load_model(a.weights or TINY, backend.device(), a.torch_dtype)
        users, dates = read_dataset(a.data or DATA)
        cache = make_cache(model, a.num_pages, a.page_size, a.host_chunk_size) if a.mode == "simulate" else None
        start = time.perf_counter()
        logits, labels = simulate(model, users, len(dates), a.batch_users, cache)
        backend.synchronize()
        seconds = time.perf_counter() - start
    except (CheckpointError, ValueError, RuntimeError, OSError) as e:
        print("error: " + "; ".join(line.strip() for line in str(e).splitlines()), file=sys.stderr)
        sys.exit(2)
    for t, task in enumerate(TASKS):
        print(f"auc {task:<17} {auc(logits[:, t], labels[:, t]):.4f}  positives={int(labels[:, t].sum())}")
    print(a.dtype_line)  # here, not first: the first lines are the scores and the last the stats (what tests read)
    hit = f"{cache.stats.hit_ratio:.3f}" if cache else "n/a"
    evicted, onloaded = (cache.stats.evicted_users, cache.stats.onloaded_tokens) if cache else (0, 0)
    print(f"mode={a.mode} users={len(users)} days={len(dates)} candidates={len(labels)} "
          f"candidates/s={len(labels) / seconds:.1f} cache_hit_ratio={hit} evicted_users={evicted} "
          f"host_onloaded_tokens={onloaded}")


if __name__ == "__main__":
    main()
