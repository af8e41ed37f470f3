"""A causal LM that implements the model contract (common/engine/model_contract.py) and nothing else, importing no
recipe: token and position embeddings, one multi-query attention layer over a paged K / V cache (two cache tensors
in one group, read through one block table), an LM head. `full_logits` is the same model with no cache at all.

Imported by tests/engine/test_contract_model.py, and by its vLLM driver in the vLLM environment (no pytest there)."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from common import ops
from common.engine.forward_batch import ForwardBatch
from common.engine.model_contract import ModelContract
from common.kv_cache import CacheGroupSpec, CacheTensorSpec, check_cache_tensors

GROUP = "kv"
K, V = "layers.0.k_cache", "layers.0.v_cache"  # cache tensor names: module path with its layer index (vLLM's too)


class ToyCausalLM(nn.Module):
    def __init__(self, vocab_size: int = 96, hidden_size: int = 32, num_heads: int = 4, max_positions: int = 256,
                 seed: int = 0):
        super().__init__()
        self.heads, self.head_dim = num_heads, hidden_size // num_heads
        self.embed = nn.Embedding(vocab_size, hidden_size)
        self.pos = nn.Embedding(max_positions, hidden_size)
        self.wq = nn.Linear(hidden_size, hidden_size, bias=False)
        self.wkv = nn.Linear(hidden_size, 2 * self.head_dim, bias=False)  # one K / V head
        self.wo = nn.Linear(hidden_size, hidden_size, bias=False)
        self.head = nn.Linear(hidden_size, vocab_size, bias=False)
        g = torch.Generator().manual_seed(seed)
        for p in self.parameters():
            p.data = torch.randn(p.shape, generator=g) * 0.5
        self.k_cache = self.v_cache = None  # [blocks, block_size, 1, Dh], bound by whoever owns them
        self.table = GROUP  # the ForwardBatch block table / slot mapping both are read through

    def engine_contract(self) -> ModelContract:
        w = self.embed.weight
        return ModelContract(self.pos.num_embeddings, self.embed.num_embeddings, (0,), w.shape[1], w.dtype, w.device)

    def cache_specs(self, block_size: int) -> list[CacheGroupSpec]:
        return [CacheGroupSpec(GROUP, block_size)]

    def cache_tensor_specs(self) -> list[CacheTensorSpec]:
        return [CacheTensorSpec(K, GROUP, self.head_dim), CacheTensorSpec(V, GROUP, self.head_dim)]

    def bind_caches(self, tensors: dict[str, torch.Tensor], tables: dict[str, str] | None = None) -> None:
        """Both tensors must be read through one table (the paged attention reads K and V through one)."""
        check_cache_tensors(self.cache_tensor_specs(), tensors)
        read = {(tables or {}).get(name, GROUP) for name in tensors}
        if len(read) != 1:
            raise ValueError(f"k_cache and v_cache are read through one block table, not {sorted(read)}")
        self.k_cache, self.v_cache, self.table = tensors[K], tensors[V], read.pop()

    def embed_tokens(self, input_ids: torch.Tensor, uniform: bool = False) -> torch.Tensor:
        return self.embed(input_ids)  # [T, D]

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        T = batch.input_ids.shape[0]
        x = self.embed_tokens(batch.input_ids) + self.pos(batch.positions)  # [T, D]
        q = self.wq(x).view(T, self.heads, self.head_dim)  # [T, H, Dh]
        k, v = self.wkv(x).view(T, 2, 1, self.head_dim).unbind(1)  # [T, 1, Dh] each
        ops.reshape_and_cache(k, v, self.k_cache, self.v_cache, batch.slot_mapping[self.table])
        o = ops.paged_attention(q, self.k_cache, self.v_cache, batch.block_tables[self.table], batch.seq_lens,
                                batch.cu_seqlens_q, self.head_dim**-0.5, max_seqlen_q=batch.max_seqlen_q,
                                max_seqlen_k=batch.max_seqlen_k)  # [T, H, Dh]
        return x + self.wo(o.reshape(T, -1))  # [T, D]

    def compute_logits(self, hidden: torch.Tensor, uniform: bool = False) -> torch.Tensor:
        return self.head(hidden).float()  # [N, V]

    @torch.no_grad()
    def full_logits(self, ids: list[int]) -> torch.Tensor:
        """The logits of every position [n, V], everything recomputed, no cache."""
        return self.compute_logits(self.full_hidden(ids))

    @torch.no_grad()
    def full_hidden(self, ids: list[int]) -> torch.Tensor:
        """The final hidden state of every position [n, D], everything recomputed, no cache."""
        n, device = len(ids), self.embed.weight.device
        x = self.embed(torch.tensor(ids, device=device)) + self.pos(torch.arange(n, device=device))  # [n, D]
        q = self.wq(x).view(n, self.heads, self.head_dim).transpose(0, 1)  # [H, n, Dh]
        k, v = self.wkv(x).view(n, 2, 1, self.head_dim).expand(n, 2, self.heads, self.head_dim).unbind(1)
        o = F.scaled_dot_product_attention(q, k.transpose(0, 1), v.transpose(0, 1), is_causal=True)  # [H, n, Dh]
        return x + self.wo(o.transpose(0, 1).reshape(n, -1))


def greedy_full_recompute(model: ToyCausalLM, prompt: list[int], max_tokens: int) -> list[int]:
    """Greedy decoding by recomputing the whole sequence at every step."""
    seq = list(prompt)
    for _ in range(max_tokens):
        seq.append(int(model.full_logits(seq)[-1].argmax()))
    return seq[len(prompt):]
