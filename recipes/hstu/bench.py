"""Cached incremental HSTU scoring against full recompute and a dense padded reference, on one machine.

    python recipes/hstu/bench.py [--threads 2] [--users 4] [--reps 5] [--quick]

A request per user: its history (5 contextual + 2048 (item, action) events = 4101 tokens) is already in the paged
cache; the request brings 32 new events (64 history tokens) and 128 candidates to score. Random weights, fixed seed,
the bench config below, fp32. Measured, median of --reps after one warm-up:
- cached: cache.begin (pages for the 64 new tokens) + the model on the 192 new tokens per user, attending over
  the cached K / V;
- full recompute: the same model on the whole 4293-token sequence of each user (jagged, `--mode eval`);
- dense reference: written here, as upstream's pure-PyTorch path: sequences padded to [B, L, hidden], a
  [B, L, L] mask, plain torch ops, same weights.
All three must give the same scores. Then the memory one user's history takes: device pages across layers, and
the host tier after eviction (complete 1024-token chunks). Prints a table, then one line of ratios.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from common import backend
from kv_cache_hstu import HistoryKVCache
from modeling_hstu import HSTUConfig, HSTUModel, make_batch, user_tokens

BENCH_CONFIG = HSTUConfig(num_items=20000, hidden_size=256, num_heads=4, attention_dim=64, linear_dim=64,
                          num_layers=4, max_seq_len=8192)
PAGE_SIZE, HOST_CHUNK = 64, 1024
HISTORY_EVENTS, NEW_EVENTS, CANDIDATES = 2048, 32, 128


def requests(c: HSTUConfig, users: int, seed: int = 0):
    """Per user: (all tokens: contextual + old + new history, number of cached tokens, candidate items)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(users):
        contextual = torch.randint(0, 7, (c.num_contextual,), generator=g).tolist()
        events = list(zip(torch.randint(0, c.num_items, (HISTORY_EVENTS + NEW_EVENTS,), generator=g).tolist(),
                          torch.randint(0, c.num_actions, (HISTORY_EVENTS + NEW_EVENTS,), generator=g).tolist()))
        tokens = user_tokens(c, contextual, events)
        out.append((tokens, len(tokens) - 2 * NEW_EVENTS, torch.randint(0, c.num_items, (CANDIDATES,), generator=g)
                    .tolist()))
    return out


def prefill(model: HSTUModel, cache: HistoryKVCache, reqs) -> None:
    """Put each user's old history (not the new events) into the cache."""
    rows = [(tokens[:cached], 0, []) for tokens, cached, _ in reqs]
    batch = make_batch(model.config, rows)
    model(batch, cache.begin(list(range(len(reqs))), [r[1] for r in reqs], batch.lengths))


def rollback(cache: HistoryKVCache, reqs) -> None:
    """Forget the new events a cached run appended, so that the next repetition sees the same cache."""
    for user, (_, cached, _) in enumerate(reqs):
        keep = -(-cached // cache.page_size)
        cache.pool.free(cache.pages[user][keep:])
        del cache.pages[user][keep:]
        cache.lengths[user] = cached


def cached_scores(model: HSTUModel, cache: HistoryKVCache, reqs) -> torch.Tensor:
    batch = make_batch(model.config, [(tokens[cached:], cached, cands) for tokens, cached, cands in reqs])
    kv = cache.begin(list(range(len(reqs))), [len(t) - c for t, c, _ in reqs], batch.lengths)
    return model(batch, kv)


def full_scores(model: HSTUModel, reqs) -> torch.Tensor:
    return model(make_batch(model.config, [(tokens, 0, cands) for tokens, _, cands in reqs]))


def dense_scores(model: HSTUModel, reqs) -> torch.Tensor:
    """Upstream-style dense path: pad to [B, L], one [B, L, L] mask, plain torch; the model's weights."""
    c, B = model.config, len(reqs)
    n_hist = torch.tensor([len(t) for t, _, _ in reqs])
    L = int(n_hist.max()) + CANDIDATES
    kinds = torch.full((B, L), c.item_kind)
    ids = torch.zeros(B, L, dtype=torch.long)
    for b, (tokens, _, cands) in enumerate(reqs):
        kinds[b, :len(tokens)] = torch.tensor([k for k, _ in tokens])
        ids[b, :len(tokens)] = torch.tensor([i for _, i in tokens])
        ids[b, len(tokens):len(tokens) + CANDIDATES] = torch.tensor(cands)
    ar = torch.arange(L)
    positions = torch.minimum(ar[None, :], n_hist[:, None])  # candidates share the position after the history
    x = model.position(positions)  # [B, L, hidden]
    for kind, table in enumerate([*model.contextual, model.item, model.action]):
        x = x + table(ids.clamp(max=table.num_embeddings - 1)) * (kinds == kind)[..., None]

    row, col = ar[None, :, None], ar[None, None, :]  # [1, L, 1], [1, 1, L]
    hist_end, seq_end = n_hist[:, None, None], n_hist[:, None, None] + CANDIDATES
    mask = torch.where(row < hist_end, col <= row, (col < hist_end) | (col == row))  # [B, L, L]
    mask = (mask & (row < seq_end) & (col < seq_end)).to(x.dtype)[:, None]  # [B, 1, L, L]
    H, Dq, Dv = c.num_heads, c.attention_dim, c.linear_dim
    for layer in model.layers:
        uvqk = F.silu(F.linear(F.layer_norm(x, (c.hidden_size,), layer.norm_in.weight, layer.norm_in.bias,
                                            c.layer_norm_eps), layer.uvqk.weight, layer.uvqk.bias))
        u, v, q, k = uvqk.split([H * Dv, H * Dv, H * Dq, H * Dq], dim=-1)
        q, k, v = q.view(B, L, H, Dq), k.view(B, L, H, Dq), v.view(B, L, H, Dv)  # [B, L, H, D]
        attn = F.silu(torch.einsum("bqhd,bkhd->bhqk", q, k) * c.alpha) / c.max_seq_len * mask  # [B, H, L, L]
        o = torch.einsum("bhqk,bkhd->bqhd", attn, v).reshape(B, L, H * Dv)
        o = F.layer_norm(o, (H * Dv,), layer.norm_attn.weight, layer.norm_attn.bias, c.layer_norm_eps)
        x = x + F.linear(u * o, layer.out.weight, layer.out.bias)
    cand = torch.cat([x[b, n:n + CANDIDATES] for b, n in enumerate(n_hist.tolist())])
    return model.head(model.norm(cand))


def median_seconds(fn, reps: int, after=None) -> float:
    fn()  # warm-up
    if after:
        after()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
        if after:
            after()
    return statistics.median(times)


@torch.inference_mode()
def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--users", type=int, default=4, help="users per batch")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--quick", action="store_true", help="2 users, 1 repetition (a smoke run, not the numbers)")
    a = p.parse_args()
    users, reps = (2, 1) if a.quick else (a.users, a.reps)
    torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    c = BENCH_CONFIG
    model = HSTUModel(c).eval()
    reqs = requests(c, users)
    pages_per_user = -(-len(reqs[0][0]) // PAGE_SIZE)
    cache = HistoryKVCache(c.num_layers, users * pages_per_user + 1, PAGE_SIZE, c.num_heads, c.attention_dim,
                           c.linear_dim, host_chunk_size=HOST_CHUNK)
    prefill(model, cache, reqs)

    ours = cached_scores(model, cache, reqs)
    rollback(cache, reqs)
    full, dense = full_scores(model, reqs), dense_scores(model, reqs)
    err_full, err_dense = (ours - full).abs().max().item(), (ours - dense).abs().max().item()
    assert err_full < 1e-3 and err_dense < 1e-3, f"scores differ: {err_full} (full), {err_dense} (dense)"

    t_cached = median_seconds(lambda: cached_scores(model, cache, reqs), reps, after=lambda: rollback(cache, reqs))
    t_full = median_seconds(lambda: full_scores(model, reqs), max(reps // 2, 1))
    t_dense = median_seconds(lambda: dense_scores(model, reqs), max(reps // 2, 1))

    cached_tokens = reqs[0][1]
    elem = cache.k.element_size()
    per_token = c.num_layers * c.num_heads * (c.attention_dim + c.linear_dim) * elem  # K + V, all layers
    n_pages = len(cache.pages[0])
    device_bytes = n_pages * PAGE_SIZE * per_token  # whole pages of user 0
    cache.evict(0)
    host_bytes = sum(t.nbytes for t in cache.host[0])

    n_params = sum(p.numel() for p in model.parameters())
    n_cand = users * CANDIDATES
    L = len(reqs[0][0]) + CANDIDATES
    print(f"\nHSTU bench config: hidden {c.hidden_size}, {c.num_layers} layers, {c.num_heads} heads x "
          f"(q/k {c.attention_dim}, u/v {c.linear_dim}), {n_params / 1e6:.1f}M parameters, fp32, random weights "
          f"(seed 0); {a.threads} threads; {backend.cpu_model_name()}")
    print(f"request per user: {cached_tokens} cached history tokens + {2 * NEW_EVENTS} new + {CANDIDATES} candidates "
          f"(full sequence {L}); batch of {users} users; page size {PAGE_SIZE}; median of {reps} (cached), "
          f"{max(reps // 2, 1)} (others) after a warm-up")
    print(f"max |score difference| vs cached: full recompute {err_full:.1e}, dense reference {err_dense:.1e}")
    print(f"{'path':<34}{'ms / batch':>12}{'candidates/s':>14}{'cached is':>11}")
    for name, t in (("cached incremental (paged)", t_cached), ("full recompute (jagged)", t_full),
                    ("dense padded reference [B,L,L]", t_dense)):
        print(f"{name:<34}{t * 1e3:>12.1f}{n_cand / t:>14.1f}{t / t_cached:>10.1f}x")
    print(f"{'memory per cached user':<34}{'bytes':>12}{'MiB':>14}")
    print(f"{f'device pages, {cached_tokens} tokens':<34}{device_bytes:>12d}{device_bytes / 2**20:>14.2f}"
          f"   ({n_pages} x {PAGE_SIZE}-token pages x {c.num_layers} layers"
          f", K+V)")
    print(f"{'per 4096 tokens (K+V, all layers)':<34}{4096 * per_token:>12d}{4096 * per_token / 2**20:>14.2f}")
    print(f"{'host tier after eviction':<34}{host_bytes:>12d}{host_bytes / 2**20:>14.2f}"
          f"   ({cache.host[0][0].shape[1]} tokens in {HOST_CHUNK}-token chunks)")
    print(f"ratios: cached vs full recompute {t_full / t_cached:.1f}x (target 5x), cached vs dense reference "
          f"{t_dense / t_cached:.1f}x (target 3x); device {device_bytes / 2**20:.1f} MiB, host "
          f"{host_bytes / 2**20:.1f} MiB per cached user")


if __name__ == "__main__":
    main()
