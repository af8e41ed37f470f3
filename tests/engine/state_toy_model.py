"""A hybrid causal LM on the model contract with a per-request state cache group, importing no recipe: the paged
attention toy (contract_toy_model.py) plus one recurrent layer, h_t = a * h_(t-1) + tanh(W x_t) with a learned
decay a in (0, 1) per channel, whose state h [D] (fp32) lives in a slot of a state group (CacheGroupSpec kind
"state"), read and written through the ForwardBatch's (read slot, write slot) table. `full_logits` recomputes the
whole sequence with no cache, so engine outputs (chunked prefill, prefix-cache hits on saved states, preemption)
can be held against it. Imported by tests/engine/test_state_cache.py."""
from __future__ import annotations

import torch
from torch import nn

from common.engine.forward_batch import ForwardBatch
from common.kv_cache import CacheGroupSpec, CacheTensorSpec, check_cache_tensors
from contract_toy_model import GROUP, K, V, ToyCausalLM

STATE = "state"
H = "layers.1.recurrent.state"  # the state tensor: [slots, 1, 1, D] fp32


class ToyStateLM(ToyCausalLM):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        D = self.embed.embedding_dim
        g = torch.Generator().manual_seed(1)
        self.w_in = nn.Linear(D, D, bias=False)
        self.w_in.weight.data = torch.randn(D, D, generator=g) * 0.5
        self.decay_logit = nn.Parameter(torch.randn(D, generator=g))
        self.state = None  # [slots, 1, 1, D] fp32, bound by whoever owns it

    def cache_specs(self, block_size: int) -> list[CacheGroupSpec]:
        return [CacheGroupSpec(GROUP, block_size), CacheGroupSpec(STATE, block_size, kind="state")]

    def cache_tensor_specs(self) -> list[CacheTensorSpec]:
        D = self.embed.embedding_dim
        return [*super().cache_tensor_specs(), CacheTensorSpec(H, STATE, D, rows=1, dtype=torch.float32)]

    def bind_caches(self, tensors: dict[str, torch.Tensor], tables: dict[str, str] | None = None) -> None:
        check_cache_tensors(self.cache_tensor_specs(), tensors)
        if (tables or {}).get(H, STATE) != STATE:
            raise ValueError("the state is read through its own group's slots")
        if len({(tables or {}).get(name, GROUP) for name in (K, V)}) != 1:
            raise ValueError("k_cache and v_cache are read through one block table")
        self.k_cache, self.v_cache, self.state = tensors[K], tensors[V], tensors[H]
        self.table = (tables or {}).get(K, GROUP)

    def _recurrent(self, x: torch.Tensor, h0: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [n, D], h0 [D] fp32 -> (h_t for every t [n, D], h_n [D])."""
        a, u = torch.sigmoid(self.decay_logit.float()), torch.tanh(self.w_in(x).float())  # [D], [n, D]
        out = []
        for t in range(x.shape[0]):
            h0 = a * h0 + u[t]
            out.append(h0)
        return torch.stack(out) if out else u, h0

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        x = super().forward(batch)  # [T, D]
        read, write = batch.block_tables[STATE].long().unbind(1)  # [B] each
        state = self.state.view(self.state.shape[0], -1)  # [slots, D]
        cu = batch.cu_seqlens_q.tolist()
        hs = []
        for b in range(batch.num_seqs):
            h0 = state[read[b]] if read[b] != 0 else torch.zeros_like(state[0])  # slot 0: a fresh sequence
            h, state[write[b]] = self._recurrent(x[cu[b]:cu[b + 1]], h0)
            hs.append(h)
        return x + torch.cat(hs).to(x.dtype) if hs else x  # [T, D]

    @torch.no_grad()
    def full_logits(self, ids: list[int]) -> torch.Tensor:
        """The logits of every position [n, V], everything recomputed, no cache."""
        hidden = super().full_hidden(ids)  # [n, D]
        h, _ = self._recurrent(hidden, torch.zeros(hidden.shape[1]))
        return self.compute_logits(hidden + h.to(hidden.dtype))
