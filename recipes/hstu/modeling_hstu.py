"""HSTU ranking model (generative recommenders) over jagged, packed sequences, written against common.ops.

Per user the sequence is [contextual features | (item, action) history, interleaved | candidate items]; every
token gets an absolute position, all candidates sharing the one after the history. An HSTU layer:
    x' = LayerNorm(x); u, v, q, k = split(SiLU(x' W + b)); o = hstu_attention(q, k, v)
    y = x + (u * LayerNorm(o)) W_o
and a multi-task head reads the candidates' final states (one logit per task). With a history cache the batch
holds only the new tokens of each user (new history + candidates) and each layer's attention reads the cached
K / V of the user's older history through `kv(layer, k, v)` (kv_cache_hstu.BatchKV).
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from common import ops
from common.loader import Checkpoint, CheckpointError, load_weights, save_checkpoint


@dataclass(slots=True)
class HSTUConfig:
    num_items: int = 400  # item (video) vocabulary; ids are taken modulo it
    num_actions: int = 256  # action token = bitmask of the task flags
    contextual_vocab_sizes: tuple[int, ...] = (8, 8, 8, 8, 8)  # one embedding table per contextual feature
    hidden_size: int = 32
    num_heads: int = 2
    attention_dim: int = 16  # per head, q / k
    linear_dim: int = 16  # per head, u / v
    num_layers: int = 2
    max_seq_len: int = 128  # position table size and the attention's 1 / max_seq_len scale
    num_tasks: int = 8
    alpha: float = 0.25  # SiLU(alpha q k^T); upstream uses 1 / sqrt(attention_dim)
    layer_norm_eps: float = 1e-6
    causal_contextual: bool = True  # False: upstream's contextual rows that see the whole history (no history cache)

    def __post_init__(self):
        self.contextual_vocab_sizes = tuple(self.contextual_vocab_sizes)
        for name in ("num_items", "num_actions", "hidden_size", "num_heads", "attention_dim", "linear_dim",
                     "num_layers", "num_tasks"):
            assert getattr(self, name) > 0, f"{name} {getattr(self, name)} must be positive"
        assert all(v > 0 for v in self.contextual_vocab_sizes), "contextual vocabularies must be non-empty"
        assert self.max_seq_len > self.num_contextual + 2, \
            f"max_seq_len {self.max_seq_len} leaves no room after {self.num_contextual} contextual tokens"
        assert self.alpha > 0 and self.layer_norm_eps > 0

    @property
    def num_contextual(self) -> int:
        return len(self.contextual_vocab_sizes)

    @property
    def item_kind(self) -> int:  # token kinds: 0..C-1 contextual feature i, C item, C+1 action
        return self.num_contextual

    @property
    def action_kind(self) -> int:
        return self.num_contextual + 1


@dataclass(slots=True)
class HSTUBatch:
    """New tokens of B users, packed: kinds / ids / positions [T]; cu_seqlens [B+1]; the last num_candidates[b]
    tokens of user b are its candidates."""

    kinds: torch.Tensor
    ids: torch.Tensor
    positions: torch.Tensor
    cu_seqlens: torch.Tensor
    num_candidates: torch.Tensor
    lengths: list[int] = field(default_factory=list)  # host copies, for the cache bookkeeping
    candidates: list[int] = field(default_factory=list)

    def to(self, device) -> HSTUBatch:
        return HSTUBatch(*(t.to(device) for t in (self.kinds, self.ids, self.positions, self.cu_seqlens,
                                                  self.num_candidates)), self.lengths, self.candidates)


def user_tokens(config: HSTUConfig, contextual: list[int], history: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """(kind, id) of the contextual features, then (item, action) per history event, interleaved."""
    tokens = [(i, value) for i, value in enumerate(contextual)]
    for item, action in history:
        tokens += [(config.item_kind, item % config.num_items), (config.action_kind, action)]
    return tokens


def make_batch(config: HSTUConfig, rows: list[tuple[list[tuple[int, int]], int, list[int]]]) -> HSTUBatch:
    """rows: (tokens from position `start`, start, candidate items) per user -> the packed batch. Token j sits at
    position start + j; the candidates all at start + len(tokens). Raises ValueError past max_seq_len."""
    kinds, ids, positions, lengths, cands = [], [], [], [], []
    for tokens, start, candidates in rows:
        end = start + len(tokens)
        if end >= config.max_seq_len:
            raise ValueError(f"sequence of {end} tokens + candidates exceeds max_seq_len {config.max_seq_len}")
        kinds += [k for k, _ in tokens] + [config.item_kind] * len(candidates)
        ids += [i for _, i in tokens] + [c % config.num_items for c in candidates]
        positions += list(range(start, end)) + [end] * len(candidates)
        lengths.append(len(tokens) + len(candidates))
        cands.append(len(candidates))
    return HSTUBatch(torch.tensor(kinds), torch.tensor(ids), torch.tensor(positions),
                     torch.tensor([0, *lengths]).cumsum(0).int(), torch.tensor(cands), lengths, cands)


class HSTULayer(nn.Module):
    def __init__(self, c: HSTUConfig):
        super().__init__()
        self.c = c
        self.norm_in = nn.LayerNorm(c.hidden_size, eps=c.layer_norm_eps)
        self.uvqk = nn.Linear(c.hidden_size, c.num_heads * (2 * c.linear_dim + 2 * c.attention_dim))
        self.norm_attn = nn.LayerNorm(c.num_heads * c.linear_dim, eps=c.layer_norm_eps)
        self.out = nn.Linear(c.num_heads * c.linear_dim, c.hidden_size)

    def forward(self, x, batch: HSTUBatch, kv=None):
        c, T = self.c, x.shape[0]
        uvqk = F.silu(self.uvqk(self.norm_in(x)))
        u, v, q, k = uvqk.split([c.num_heads * c.linear_dim] * 2 + [c.num_heads * c.attention_dim] * 2, dim=-1)
        q, k = q.view(T, c.num_heads, c.attention_dim), k.view(T, c.num_heads, c.attention_dim)  # [T, H, Dqk]
        v = v.view(T, c.num_heads, c.linear_dim)  # [T, H, Dv]
        k_all, v_all, cu_k = (k, v, batch.cu_seqlens) if kv is None else kv(k, v)
        o = ops.hstu_attention(q, k_all, v_all, batch.cu_seqlens, cu_k, batch.num_candidates, c.alpha,
                               c.max_seq_len, num_contextual=0 if c.causal_contextual else c.num_contextual)
        return x + self.out(u * self.norm_attn(o.flatten(1)))


class HSTUModel(nn.Module):
    """Embeddings + positions -> HSTU layers -> LayerNorm -> multi-task MLP on the candidates."""

    def __init__(self, c: HSTUConfig):
        super().__init__()
        self.config = c
        self.contextual = nn.ModuleList(nn.Embedding(n, c.hidden_size) for n in c.contextual_vocab_sizes)
        self.item = nn.Embedding(c.num_items, c.hidden_size)
        self.action = nn.Embedding(c.num_actions, c.hidden_size)
        self.position = nn.Embedding(c.max_seq_len, c.hidden_size)
        self.layers = nn.ModuleList(HSTULayer(c) for _ in range(c.num_layers))
        self.norm = nn.LayerNorm(c.hidden_size, eps=c.layer_norm_eps)
        self.head = nn.Sequential(nn.Linear(c.hidden_size, c.hidden_size), nn.SiLU(),
                                  nn.Linear(c.hidden_size, c.num_tasks))

    def embed(self, batch: HSTUBatch) -> torch.Tensor:
        x = self.position(batch.positions)  # [T, hidden]
        tables = [*self.contextual, self.item, self.action]
        for kind, table in enumerate(tables):
            rows = (batch.kinds == kind).nonzero().squeeze(1)
            x = x.index_add(0, rows, table(batch.ids[rows].clamp(max=table.num_embeddings - 1)))
        return x

    def forward(self, batch: HSTUBatch, kv=None) -> torch.Tensor:
        """-> logits [sum of candidates, num_tasks], users in batch order. kv: None (full sequences) or a
        BatchKV of the history cache."""
        x = self.embed(batch)
        for i, layer in enumerate(self.layers):
            x = layer(x, batch, None if kv is None else lambda k, v, i=i: kv(i, k, v))
        ends = batch.cu_seqlens[1:].long()
        rows = torch.cat([torch.arange(int(e) - n, int(e)) for e, n in zip(ends.tolist(), batch.candidates)])
        return self.head(self.norm(x[rows.to(x.device)]))


def write_tiny_checkpoint(path, config: HSTUConfig | None = None, seed: int = 0) -> Path:
    """A random checkpoint in HF layout (config.json + model.safetensors); same seed, same bytes."""
    config = config or HSTUConfig()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = HSTUModel(config)
    cfg = asdict(config) | {"model_type": "hstu", "contextual_vocab_sizes": list(config.contextual_vocab_sizes)}
    return save_checkpoint(path, model.state_dict(), cfg)


def load_model(path, device="cpu", dtype=torch.float32) -> HSTUModel:
    """Build the model from config.json and fill it from the safetensors (CheckpointError on any mismatch)."""
    ckpt = Checkpoint(path)
    fields = {k: v for k, v in ckpt.config.items() if k != "model_type"}
    try:
        config = HSTUConfig(**fields)
    except (TypeError, AssertionError) as e:
        raise CheckpointError(f"{Path(path) / 'config.json'}: {e}") from None
    model = HSTUModel(config)
    load_weights(model, ckpt)
    return model.to(device=device, dtype=dtype).eval()


if __name__ == "__main__":  # smoke test on random weights
    cfg = HSTUConfig()
    m = HSTUModel(cfg)
    b = make_batch(cfg, [(user_tokens(cfg, [1, 2, 3, 4, 5], [(7, 3), (9, 1)]), 0, [11, 12])])
    print(json.dumps({"logits": list(m(b).shape)}))
