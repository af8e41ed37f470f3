"""DeepSeek-V3 / R1, DeepSeek-V3.2 and Kimi-K2 (multi-head latent attention) on common.ops, over packed inputs.

Per layer: RMSNorm -> MLA -> residual -> RMSNorm -> dense SwiGLU MLP (the first first_k_dense_replace layers) or
MoE (sigmoid router, group-limited top-k, shared experts) -> residual. Parameter names are the HF checkpoint's
(`model.layers.N.self_attn.kv_a_proj_with_mqa`, `model.layers.N.mlp.experts`, `lm_head`); routed experts are
stacked into `gate_up_proj` [E, 2I, D] / `down_proj` [E, D, I] (transformers' layout) and each dense or shared
MLP's gate / up projections pack into one `gate_up_proj`. T = tokens of all sequences in the batch, D = hidden
size, H = heads, R = kv_lora_rank, Dr = qk_rope_head_dim, S = cached tokens of the batch's sequences.

MLA cache (one "latent" group, one row per token): the normalised latent c_kv [R] and the rotated shared rope key
[Dr], R + Dr values per token per layer (V3.2 adds its indexer key, index_head_dim values, in the same group).
Two ways to attend over it, equal in exact arithmetic:
- absorbed (decode steps): kv_b_proj's key half W_UK folds into the query (q_nope W_UK . c_kv + q_rope . k_rope),
  attention runs as one-KV-head MQA straight over the cached rows, and its value half W_UV maps the latent
  output back per head: no per-head K / V is materialised;
- expanded (prefill): the cached latents are expanded by kv_b_proj into per-head k_nope / v once, and ordinary
  attention runs over them (cheaper when many queries share the keys).
V3.2: a lightning indexer picks each query's top index_topk keys of its own sequence (sum_h w_h relu(q_h . k),
ops.lightning_indexer), and attention reads only those (ops.sparse_attention).
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from common import ops
from common.engine.forward_batch import ForwardBatch
from common.kv_cache import CacheGroupSpec
from config_deepseek_v3 import ModelArgs

LATENT = "latent"  # the one cache group: per token the latent, the rope key (and V3.2's indexer key)
LATENT_NORM_EPS = 1e-6  # q_a_layernorm / kv_a_layernorm: the publisher's RMSNorm default, not rms_norm_eps
INDEX_NORM_EPS = 1e-6
ABSORB_MAX_QUERIES = 8  # steps whose sequences have at most this many new tokens attend absorbed (decode, drafts)


def yarn_inv_freq(args: ModelArgs) -> torch.Tensor:
    """Inverse frequencies [Dr/2] of the rope channels; YaRN-blended (truncated correction range) when configured."""
    dim, theta = args.qk_rope_head_dim, args.rope_theta
    inv = 1.0 / theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)  # [Dr/2]
    y = args.rope_scaling
    if not y:
        return inv
    factor, orig = args.yarn_factor, y["original_max_position_embeddings"]
    fast, slow = y.get("beta_fast") or 32, y.get("beta_slow") or 1

    def corr_dim(rotations):
        return dim * math.log(orig / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = corr_dim(fast), corr_dim(slow)
    if y.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)  # 1: interpolate
    return inv / factor * ramp + inv * (1 - ramp)


class Rope(nn.Module):
    """RoPE tables of the rope channels, scaled by YaRN's attention factor (as cos / sin are, upstream)."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.scale = args.rope_attention_factor
        self.register_buffer("inv_freq", yarn_inv_freq(args), persistent=False)

    def tables(self, positions: torch.Tensor) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """positions [T] -> {"interleaved": (cos, sin), "half": (cos, sin)}, each [T, Dr]."""
        freqs = positions.float()[:, None] * self.inv_freq  # [T, Dr/2]
        out = {}
        for mode, full in (("interleaved", freqs.repeat_interleave(2, -1)), ("half", torch.cat([freqs, freqs], -1))):
            out[mode] = (full.cos() * self.scale, full.sin() * self.scale)  # [T, Dr] each
        return out


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        return ops.rms_norm(x, self.weight, self.eps)


class KVBProj(nn.Module):
    """kv_b_proj's weight [H * (nope + v), R] as the checkpoint stores it; a plain parameter (never repacked),
    read whole for the expansion and as its halves W_UK [H, nope, R] / W_UV [H, v, R] for the absorbed path."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.heads, self.nope, self.v = args.num_attention_heads, args.qk_nope_head_dim, args.v_head_dim
        self.weight = nn.Parameter(torch.empty(self.heads * (self.nope + self.v), args.kv_lora_rank))

    def expand(self, latent: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """latent [S, R] -> (k_nope [S, H, nope], v [S, H, v])."""
        kv = F.linear(latent, self.weight).view(latent.shape[0], self.heads, self.nope + self.v)  # [S, H, nope+v]
        return kv[..., : self.nope], kv[..., self.nope :]

    def halves(self) -> tuple[torch.Tensor, torch.Tensor]:
        w = self.weight.view(self.heads, self.nope + self.v, -1)  # [H, nope+v, R]
        return w[:, : self.nope], w[:, self.nope :]  # W_UK [H, nope, R], W_UV [H, v, R]


def gather_rows(cache: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor):
    """Each sequence's cached rows [0, seq_len), packed in order: ([S, ...], cu_seqlens_k [B+1] int32)."""
    block_size = cache.shape[1]
    cu = F.pad(seq_lens.long().cumsum(0), (1, 0))  # [B+1]
    token = torch.arange(int(cu[-1]), device=cache.device)  # [S]
    seq = torch.searchsorted(cu[1:], token, right=True)  # [S]
    pos = token - cu[seq]
    slots = block_tables[seq, pos // block_size].long() * block_size + pos % block_size  # [S]
    return cache.flatten(0, 1)[slots], cu.int()


class Indexer(nn.Module):
    """V3.2's lightning indexer: per query, the top index_topk keys of its sequence by sum_h w_h relu(q_h . k).

    q_h = wq_b(the normed low-rank query), k = LayerNorm(wk(x)), both with half-split RoPE on their first Dr
    channels; w = weights_proj(x) / sqrt(heads); scores carry index_head_dim^-0.5 (folded into w: relu is
    positively homogeneous). The keys are cached per token in the latent group."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.heads, self.dim, self.rope_dim, self.topk = (args.index_n_heads, args.index_head_dim,
                                                          args.qk_rope_head_dim, args.index_topk)
        self.wq_b = nn.Linear(args.q_lora_rank, self.heads * self.dim, bias=False)
        self.wk = nn.Linear(args.hidden_size, self.dim, bias=False)
        self.k_norm = nn.LayerNorm(self.dim, eps=INDEX_NORM_EPS)
        self.weights_proj = nn.Linear(args.hidden_size, self.heads, bias=False)
        self.k_cache = None  # [num_blocks, block_size, 1, index_head_dim]

    def _rope(self, x: torch.Tensor, cos, sin) -> torch.Tensor:
        """x [T, h, Di] -> its first Dr channels rotated (half-split pairs)."""
        pe, rest = x[..., : self.rope_dim], x[..., self.rope_dim :]
        return torch.cat([ops.rotary_emb(pe, cos, sin, interleaved=False), rest], dim=-1)

    def forward(self, x, q_lora, rope, batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (indices [T, index_topk] into the gathered rows of the batch's sequences, -1 = empty; cu_seqlens_k)."""
        T = x.shape[0]
        cos, sin = rope["half"]
        q = self._rope(self.wq_b(q_lora).view(T, self.heads, self.dim), cos, sin)  # [T, Hi, Di]
        k = self._rope(self.k_norm(self.wk(x)).view(T, 1, self.dim), cos, sin)  # [T, 1, Di]
        ops.reshape_and_cache(k, None, self.k_cache, None, batch.slot_mapping[LATENT])
        keys, cu_k = gather_rows(self.k_cache, batch.block_tables[LATENT], batch.seq_lens)  # [S, 1, Di]
        w = self.weights_proj(x).float() * (self.heads ** -0.5 * self.dim ** -0.5)  # [T, Hi]
        idx = ops.lightning_indexer(q, keys[:, 0], w, batch.cu_seqlens_q, cu_k, batch.positions + 1, self.topk,
                                    max_seqlen_q=batch.max_seqlen_q, max_seqlen_k=batch.max_seqlen_k)  # [T, k]
        return idx, cu_k


class MLAttention(nn.Module):
    """Multi-head latent attention; `mode` "auto" (absorbed for decode steps, expanded otherwise), "absorbed" or
    "expanded"."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        a = args
        H = self.heads = a.num_attention_heads
        self.rank, self.rope_dim = a.kv_lora_rank, a.qk_rope_head_dim
        self.nope, self.v_dim = a.qk_nope_head_dim, a.v_head_dim
        self.scale = a.softmax_scale
        if a.q_lora_rank is None:
            self.q_proj = nn.Linear(a.hidden_size, H * a.qk_head_dim, bias=False)
        else:
            self.q_a_proj = nn.Linear(a.hidden_size, a.q_lora_rank, bias=False)
            self.q_a_layernorm = RMSNorm(a.q_lora_rank, LATENT_NORM_EPS)
            self.q_b_proj = nn.Linear(a.q_lora_rank, H * a.qk_head_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(a.hidden_size, a.kv_lora_rank + a.qk_rope_head_dim, bias=False)
        self.kv_a_layernorm = RMSNorm(a.kv_lora_rank, LATENT_NORM_EPS)
        self.kv_b_proj = KVBProj(a)
        self.o_proj = nn.Linear(H * a.v_head_dim, a.hidden_size, bias=False)
        self.indexer = Indexer(a) if a.sparse else None
        self.kv_cache = None  # [num_blocks, block_size, 1, R + Dr]
        self.mode = "auto"

    def forward(self, x: torch.Tensor, rope, batch: ForwardBatch) -> torch.Tensor:
        """x [T, D] -> [T, D]"""
        T, H = x.shape[0], self.heads
        q_lora = None
        if hasattr(self, "q_proj"):
            q = self.q_proj(x)
        else:
            q_lora = self.q_a_layernorm(self.q_a_proj(x))  # [T, q_lora_rank]
            q = self.q_b_proj(q_lora)
        q = q.view(T, H, self.nope + self.rope_dim)
        cos, sin = rope["interleaved"]
        q_nope, q_pe = q[..., : self.nope], ops.rotary_emb(q[..., self.nope :], cos, sin, interleaved=True)
        latent, k_pe = self.kv_a_proj_with_mqa(x).split([self.rank, self.rope_dim], dim=-1)  # [T, R], [T, Dr]
        k_pe = ops.rotary_emb(k_pe.unsqueeze(1), cos, sin, interleaved=True)  # [T, 1, Dr]
        row = torch.cat([self.kv_a_layernorm(latent).unsqueeze(1), k_pe], dim=-1)  # [T, 1, R + Dr]
        ops.reshape_and_cache(row, None, self.kv_cache, None, batch.slot_mapping[LATENT])
        absorbed = self.mode == "absorbed" or (self.mode == "auto" and batch.max_seqlen_q <= ABSORB_MAX_QUERIES)
        idx = rows = cu_k = None
        if self.indexer is not None:
            idx, cu_k = self.indexer(x, q_lora, rope, batch)  # [T, k]
        if self.indexer is not None or not absorbed:
            rows, cu_k = gather_rows(self.kv_cache, batch.block_tables[LATENT], batch.seq_lens)  # [S, 1, R + Dr]
        if absorbed:
            w_uk, w_uv = self.kv_b_proj.halves()  # [H, nope, R], [H, v, R]
            q_lat = torch.einsum("thn,hnr->thr", q_nope, w_uk)  # [T, H, R]
            qa = torch.cat([q_lat, q_pe], dim=-1)  # [T, H, R + Dr], one KV head: the cached row
            if idx is not None:
                o = ops.sparse_attention(qa, rows, rows, idx, self.scale)  # [T, H, R + Dr]
            else:
                o = ops.paged_attention(qa, self.kv_cache, None, batch.block_tables[LATENT], batch.seq_lens,
                                        batch.cu_seqlens_q, self.scale, max_seqlen_q=batch.max_seqlen_q,
                                        max_seqlen_k=batch.max_seqlen_k)  # [T, H, R + Dr]
            o = torch.einsum("thr,hvr->thv", o[..., : self.rank], w_uv)  # [T, H, v]
        else:
            k_nope, v = self.kv_b_proj.expand(rows[:, 0, : self.rank])  # [S, H, nope], [S, H, v]
            k = torch.cat([k_nope, rows[:, :, self.rank :].expand(-1, H, -1)], dim=-1)  # [S, H, nope + Dr]
            qf = torch.cat([q_nope, q_pe], dim=-1)  # [T, H, nope + Dr]
            if idx is not None:
                o = ops.sparse_attention(qf, k, v, idx, self.scale)  # [T, H, v]
            else:
                o = ops.attention(qf, k, v, batch.cu_seqlens_q, cu_k, self.scale, causal=True)  # [T, H, v]
        return self.o_proj(o.reshape(T, H * self.v_dim))  # [T, D]


class MLP(nn.Module):
    """SwiGLU MLP: down(silu(gate(x)) * up(x)), gate and up packed into one gate_up_proj [2I, D]."""

    def __init__(self, hidden: int, intermediate: int):
        super().__init__()
        self.gate_up_proj = nn.Linear(hidden, 2 * intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x):
        return self.down_proj(ops.swiglu(self.gate_up_proj(x)))


class Router(nn.Module):
    """`mlp.gate`: fp32 logits x @ weight.T; e_score_correction_bias enters the selection only."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        E = args.n_routed_experts
        self.weight = nn.Parameter(torch.empty(E, args.hidden_size, dtype=torch.float32))
        self.register_buffer("e_score_correction_bias", torch.zeros(E, dtype=torch.float32))


class Experts(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        E, I, D = args.n_routed_experts, args.moe_intermediate_size, args.hidden_size
        self.gate_up_proj = nn.Parameter(torch.empty(E, 2 * I, D))  # [E, gate | up, D]
        self.down_proj = nn.Parameter(torch.empty(E, D, I))


class MoE(nn.Module):
    """Routed experts (sigmoid scores; top num_experts_per_tok of the topk_group best of n_group groups, by
    scores + bias; weights renormalised if norm_topk_prob, times routed_scaling_factor) plus the shared experts."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.gate = Router(args)
        self.experts = Experts(args)
        shared = args.moe_intermediate_size * args.n_shared_experts
        self.shared_experts = MLP(args.hidden_size, shared) if shared else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, D] -> [T, D]"""
        a = self.args
        logits = F.linear(x.float(), self.gate.weight.float())  # [T, E]
        weights, idx = ops.moe_gating_topk(logits, a.num_experts_per_tok, bias=self.gate.e_score_correction_bias,
                                           score_func="sigmoid", group_count=a.n_group, k_group=a.topk_group,
                                           renorm=a.norm_topk_prob, routed_scaling_factor=a.routed_scaling_factor)
        xs, row_idx, counts = ops.moe_init_routing(x, idx, a.n_routed_experts)  # [T*k, D] sorted by expert
        h = ops.swiglu(ops.grouped_matmul(xs, self.experts.gate_up_proj, counts))  # [T*k, I]
        y = ops.grouped_matmul(h, self.experts.down_proj, counts)  # [T*k, D]
        shared = self.shared_experts(x) if self.shared_experts is not None else None
        return ops.moe_finalize_routing(y, weights, row_idx, shared)  # [T, D]


class DecoderLayer(nn.Module):
    def __init__(self, args: ModelArgs, layer: int):
        super().__init__()
        self.self_attn = MLAttention(args)
        sparse = args.mlp_layer_types[layer] == "sparse"
        self.mlp = MoE(args) if sparse else MLP(args.hidden_size, args.intermediate_size)
        self.input_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)

    def forward(self, x: torch.Tensor, rope, batch: ForwardBatch) -> torch.Tensor:
        """x [T, D] -> [T, D]"""
        x = x + self.self_attn(self.input_layernorm(x), rope, batch)
        return x + self.mlp(self.post_attention_layernorm(x))


class Backbone(nn.Module):
    """`model.*`: embedding, decoder layers, final norm."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(args, i) for i in range(args.num_hidden_layers))
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps)


class DeepseekV3(nn.Module):
    """The causal LM over packed ForwardBatch inputs and the latent paged cache (common.engine's model contract)."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.model = Backbone(args)
        self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)
        if args.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.rope = Rope(args)

    def set_attention_mode(self, mode: str) -> None:
        """"auto", "absorbed" or "expanded" for every layer (the paths are equal; tests compare them)."""
        if mode not in ("auto", "absorbed", "expanded"):
            raise ValueError(f"attention mode {mode!r}: expected auto, absorbed or expanded")
        for layer in self.model.layers:
            layer.self_attn.mode = mode

    def cache_specs(self, block_size: int) -> list[CacheGroupSpec]:
        """One full-attention token group: every layer's latent rows (and V3.2's indexer keys)."""
        return [CacheGroupSpec(LATENT, block_size)]

    def allocate_caches(self, num_blocks: dict[str, int], block_size: int, dtype=None):
        a, n = self.args, num_blocks[LATENT]
        like = dict(dtype=dtype or self.model.embed_tokens.weight.dtype, device=self.model.embed_tokens.weight.device)
        for layer in self.model.layers:
            attn = layer.self_attn
            attn.kv_cache = torch.zeros(n, block_size, 1, a.kv_lora_rank + a.qk_rope_head_dim, **like)
            if attn.indexer is not None:
                attn.indexer.k_cache = torch.zeros(n, block_size, 1, a.index_head_dim, **like)

    def cache_tensors(self) -> dict[str, list[torch.Tensor]]:
        """Every allocated cache tensor, [num_blocks, ...] each, in a fixed order."""
        tensors = []
        for layer in self.model.layers:
            attn = layer.self_attn
            tensors += [attn.kv_cache] + ([attn.indexer.k_cache] if attn.indexer is not None else [])
        return {LATENT: tensors}

    def cache_bytes_per_block(self, block_size: int) -> dict[str, int]:
        """Bytes one block takes over all layers (from a one-block allocation)."""
        self.allocate_caches({LATENT: 1}, block_size)
        return {LATENT: sum(t.nbytes for t in self.cache_tensors()[LATENT])}

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """-> final hidden states [T, D] (feed the rows you need to `compute_logits`)."""
        x = self.model.embed_tokens(batch.input_ids)  # [T, D]
        if x.shape[0] == 0:
            return x
        rope = self.rope.tables(batch.positions)
        for layer in self.model.layers:
            x = layer(x, rope, batch)  # [T, D]
        return self.model.norm(x)

    def compute_logits(self, hidden: torch.Tensor, uniform: bool = False) -> torch.Tensor:
        """[N, D] -> [N, V] fp32."""
        return self.lm_head(hidden).float()


@torch.no_grad()
def prefill_logits(model: DeepseekV3, prompts: list[list[int]], block_size: int = 16) -> torch.Tensor:
    """Logits of every prompt position [T, V]: the whole prompts in one step over fresh contiguous caches."""
    groups = [g.name for g in model.cache_specs(block_size)]
    batch, num_blocks = ForwardBatch.prefill(prompts, groups, block_size, model.model.embed_tokens.weight.device)
    model.allocate_caches(dict.fromkeys(groups, num_blocks), block_size)
    return model.compute_logits(model(batch))
