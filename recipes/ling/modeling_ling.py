"""Ling-3.0-Flash (inclusionAI; transformers `BailingHybridForCausalLM`) on common.ops, over packed inputs.

Per layer: RMSNorm -> attention -> residual -> RMSNorm -> MLP -> residual; a final RMSNorm and an untied LM head.
Attention is KDA (Kimi Delta Attention, linear, a per-request state) in most layers and MLA (DeepSeek-V3's latent
attention plus a head-wise sigmoid output gate) in the last layer of every group of layer_group_size. MLP: dense
SwiGLU in the first first_k_dense_replace layers, then a MoE (sigmoid router with an expert bias for selection,
group-limited top-k, renormalised, x routed_scaling_factor; one unscaled shared expert), with the per-layer SwiGLU
clamps of expert_swiglu_limit_list / share_expert_swiglu_limit_list. T = tokens of the batch, D = hidden size,
H = heads, d = KDA head dim, C = H * d, R = kv_lora_rank, Dr = qk_rope_head_dim.

Module paths follow the publisher's checkpoint without its `model.` prefix (`layers.N.attention.q_proj`,
`word_embeddings`, `norm`, `lm_head`), except what is packed on load: the three q / k / v short-conv kernels into
one `conv_weight` [3C, K], dense and shared MLPs' gate / up into `gate_up_proj`, routed experts stacked into
`gate_up_proj` [E, 2I, D] / `down_proj` [E, D, I] (weights_ling.py).

Caches (the model contract, common/engine/model_contract.py), two groups:
- "mla" (paged, a row per token): per MLA layer `layers.N.attention.kv_cache` [blocks, block_size, 1, R + Dr], the
  normalised latent and the rotated shared rope key (interleaved pairs, vLLM's layout), as DeepSeek-V3 caches them.
  Prefill attends expanded (kv_b_proj applied to the gathered latents), decode absorbed (one-KV-head MQA over the
  rows), as modeling_deepseek_v3 does.
- "kda" (state, a slot per request, the batch's table [B, 1 + W] = (read slot, write slots: the state after each of
  the sequence's last W tokens, W = 1 + the MTP drafts a step verifies); slot 0: zero state, written nowhere): per
  KDA layer `layers.N.attention.conv_state` [slots, K-1, 1, 3C] (the last K-1 pre-conv q / k / v inputs, model
  dtype) and `layers.N.attention.recurrent_state` [slots, H, 1, d * d] (S [H, dk, dv] fp32, o = S^T q).

KDA per token (spec "KDA exactly"): q, k, v = short causal conv (kernel K, SiLU) of their projections; q, k L2
normalised per head in fp32 (eps inside the sqrt); gate g = kda_lower_bound * sigmoid(exp(A_log) * (f_proj(x) +
dt_bias)) in fp32; beta = sigmoid(b_proj(x)); the delta rule with scale d^-0.5 (ops.chunk_kda for prefill chunks,
ops.recurrent_kda token by token when every sequence has the same few tokens: decode, MTP verify steps, graph
mode); then per head RMSNorm(o_norm) * sigmoid(g_proj(x)) and o_proj.

Parallel (common.parallel.LLMParallelLayout), as modeling_deepseek_v3: attention TP splits the KDA and the MLA heads
over `attn_tp` (projections by rows, o_proj / dense by columns, their outputs summed over the group), so each rank's
"kda" tensors hold its own heads (H / attn_tp heads, 3C / attn_tp conv channels) while the MLA latent rows are
replicated; routed experts sharded over `moe_ep` (under attention TP each TP rank routes its share of the tokens);
router, shared experts and dense MLPs replicated; embedding and LM head vocabulary parallel over `embed_tp` /
`lmhead_tp`. A sliced parameter carries `.shard`, which the loader reads. TP2 and DP2 + EP2 equal one process
(tests/recipes/ling/test_parallel_ling.py).

Verified against transformers 5.24 (fp32, tests/recipes/ling/test_modeling_ling.py: full-sequence logits, both MLA
paths) and through the engine against transformers' generate (test_engine_ling.py). The MTP layer (`mtp=True`,
`self.mtp`: MLA + MoE, its own latent rows in "mla", no KDA state) drafts for the engine's speculative decoding:
this model is its contract's MTPDraftModel (test_speculative_ling.py).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from common import ops
from common import parallel as par
from common.engine.forward_batch import ForwardBatch
from common.engine.model_contract import ModelContract
from common.kv_cache import CacheGroupSpec, CacheTensorSpec, check_cache_tensors
from config_ling import MLA, ModelArgs

MLA_GROUP = "mla"  # paged: every MLA layer's latent rows
KDA_GROUP = "kda"  # state: every KDA layer's conv history and recurrent state
LATENT_NORM_EPS = 1e-6  # kv_a_layernorm: transformers' RMSNorm default, not rms_norm_eps
L2_NORM_EPS = 1e-6  # KDA's q / k L2 norm, inside the sqrt (fla's l2norm)
ABSORB_MAX_QUERIES = 8  # MLA steps whose sequences have at most this many new tokens attend absorbed (decode)
RECURRENT_MAX_QUERIES = 8  # KDA steps of this many tokens per sequence, all alike, run token by token (decode, MTP)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        return ops.rms_norm(x, self.weight, self.eps)


class Rope(nn.Module):
    """Default RoPE (no YaRN, no partial_rotary_factor) over the qk_rope_head_dim channels, interleaved pairs:
    inv_freq_i = theta^(-2i / Dr); pair (x_2i, x_2i+1) rotated by position x inv_freq_i."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        dim = args.qk_rope_head_dim
        inv = 1.0 / args.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)  # [Dr/2]
        self.register_buffer("inv_freq", inv, persistent=False)

    def tables(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [T] -> (cos, sin) [T, Dr] each, expanded for ops.rotary_emb(interleaved=True)."""
        freqs = (positions.float()[:, None] * self.inv_freq.float()).repeat_interleave(2, -1)  # [T, Dr]
        return freqs.cos(), freqs.sin()


def swiglu(x: torch.Tensor, limit: float | None) -> torch.Tensor:
    """x [..., 2I] = [gate | up] -> silu(gate) * up; with limit L (Ling's per-layer clamp, vLLM's
    SwigluStepAndMul): silu(gate).clamp(max=L) * up.clamp(-L, L). Not ops.swiglu's limit, which clamps the gate
    before the SiLU."""
    if not limit:
        return ops.swiglu(x)
    gate, up = x.chunk(2, dim=-1)  # [..., I] each
    return F.silu(gate).clamp(max=limit) * up.clamp(-limit, limit)


class MLP(nn.Module):
    """SwiGLU MLP down(swiglu(gate_up(x))), gate and up packed into one gate_up_proj [2I, D]; optional clamp."""

    def __init__(self, hidden: int, intermediate: int, limit: float | None = None):
        super().__init__()
        self.gate_up_proj = nn.Linear(hidden, 2 * intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)
        self.limit = limit

    def forward(self, x):
        return self.down_proj(swiglu(self.gate_up_proj(x), self.limit))


class Router(nn.Module):
    """`mlp.gate`: weight [E, D] and expert_bias [E], both fp32 (the bias enters the selection only)."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        E = args.n_routed_experts
        self.weight = nn.Parameter(torch.empty(E, args.hidden_size, dtype=torch.float32))
        self.register_buffer("expert_bias", torch.zeros(E, dtype=torch.float32))


class Experts(nn.Module):
    """This rank's E routed experts, stacked: gate_up_proj [E, gate | up, D], down_proj [E, D, I]."""

    def __init__(self, args: ModelArgs, E: int):
        super().__init__()
        I, D = args.moe_intermediate_size, args.hidden_size
        self.gate_up_proj = nn.Parameter(torch.empty(E, 2 * I, D))
        self.down_proj = nn.Parameter(torch.empty(E, D, I))


class MoE(nn.Module):
    """Routed experts (sigmoid scores in fp32; the top num_experts_per_tok of the topk_group best of n_group groups
    by scores + expert_bias, a group scored by its top-2; the unbiased scores of those renormalised if
    norm_topk_prob, x routed_scaling_factor) plus the shared expert, unscaled. limits: the layer's (routed, shared)
    SwiGLU clamps. The routed experts are sharded over moe_ep (rank r holds experts [r * E/P, (r + 1) * E/P));
    router and shared expert replicated."""

    def __init__(self, args: ModelArgs, parallel: par.Parallel,
                 limits: tuple[float | None, float | None] = (None, None)):
        super().__init__()
        self.args = args
        self.ep_group, self.tp_group = parallel.group("moe_ep"), parallel.group("attn_tp")
        self.ep_size, self.ep_rank = parallel.size("moe_ep"), parallel.rank_in("moe_ep")
        self.tp_size, self.tp_rank = parallel.size("attn_tp"), parallel.rank_in("attn_tp")
        self.gate = Router(args)
        self.experts = Experts(args, args.n_routed_experts // self.ep_size)
        self.limit = limits[0]
        shared = args.moe_shared_expert_intermediate_size
        self.shared_experts = MLP(args.hidden_size, shared, limits[1]) if args.n_shared_experts else None

    def forward(self, x: torch.Tensor, uniform: bool = False) -> torch.Tensor:
        """x [T, D] (the same on every attention-TP rank) -> [T, D]. Each attention-TP rank routes its share of the
        tokens; rows go to the ranks owning their experts and come back (common.parallel.dispatch_to_experts).
        uniform: every rank runs T tokens (a graph-mode step), so the dispatch exchanges fixed-capacity buffers (no
        split read on the host)."""
        a = self.args
        runs = x.tensor_split(self.tp_size)  # this attention-TP rank's share of the tokens
        x_r = runs[self.tp_rank]  # [T_r, D]
        logits = F.linear(x_r.float(), self.gate.weight.float())  # [T_r, E] fp32
        if x_r.shape[0]:
            weights, idx = ops.moe_gating_topk(logits, a.num_experts_per_tok, bias=self.gate.expert_bias,
                                               score_func="sigmoid", group_count=a.n_group, k_group=a.topk_group,
                                               renorm=a.norm_topk_prob, routed_scaling_factor=a.routed_scaling_factor)
        else:  # nothing to route here (an idle DP rank, a TP share of none): the dispatch still meets the others
            weights = logits.new_zeros(0, a.num_experts_per_tok)  # [0, k]
            idx = torch.zeros(0, a.num_experts_per_tok, dtype=torch.int32, device=x.device)
        xs, row_idx, counts = ops.moe_init_routing(x_r, idx, a.n_routed_experts)  # [T_r*k, D] by global expert
        capacity = runs[0].shape[0] * a.num_experts_per_tok if uniform else None  # the largest share's rows
        xe, local_counts, handle = par.dispatch_to_experts(xs, counts, self.ep_group, capacity)  # [M, D]
        h = swiglu(ops.grouped_matmul(xe, self.experts.gate_up_proj, local_counts), self.limit)  # [M, I]
        y = par.combine_from_experts(ops.grouped_matmul(h, self.experts.down_proj, local_counts), handle,
                                     self.ep_group)  # [T_r*k, D]
        shared = self.shared_experts(x_r) if self.shared_experts is not None else None
        out = ops.moe_finalize_routing(y, weights, row_idx, shared)  # [T_r, D]
        return par.all_gather_v(out, [len(run) for run in runs], self.tp_group)  # [T, D]


class KVBProj(nn.Module):
    """kv_b_proj's weight [H * (nope + v), R] (H: this rank's heads), read whole for the expansion and as W_UK
    [H, nope, R] / W_UV [H, v, R] for the absorbed path (a plain parameter: never repacked)."""

    def __init__(self, args: ModelArgs, heads: int):
        super().__init__()
        self.heads, self.nope, self.v = heads, args.qk_nope_head_dim, args.v_head_dim
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
    return cache.flatten(0, 1).index_select(0, slots), cu.int()


class MLAttention(nn.Module):
    """Ling's MLA (`BailingHybridAttention`): direct q_proj ([nope | rope] per head), kv_a_proj_with_mqa ([latent |
    k_rope]), kv_a_layernorm, kv_b_proj ([k_nope | v] per head), interleaved RoPE, softmax scale qk_head_dim^-0.5,
    then each head's output x sigmoid(g_proj(x))[head] (fp32 sigmoid) before `dense`. `mode`: "auto" (absorbed for
    decode steps, expanded otherwise), "absorbed" or "expanded" (equal in exact arithmetic; tests compare both).
    Attention TP: this rank's heads (q_proj, kv_b_proj, g_proj by rows, dense by columns, summed over attn_tp);
    kv_a_proj_with_mqa, kv_a_layernorm and the latent cache replicated."""

    def __init__(self, args: ModelArgs, parallel: par.Parallel):
        super().__init__()
        a = args
        self.tp_group = parallel.group("attn_tp")
        H = self.heads = a.num_attention_heads // parallel.size("attn_tp")
        self.rank, self.rope_dim, self.nope, self.v_dim = a.kv_lora_rank, a.qk_rope_head_dim, a.qk_nope_head_dim, \
            a.v_head_dim
        self.scale = a.softmax_scale
        self.q_proj = nn.Linear(a.hidden_size, H * a.qk_head_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(a.hidden_size, a.kv_lora_rank + a.qk_rope_head_dim, bias=False)
        self.kv_a_layernorm = RMSNorm(a.kv_lora_rank, LATENT_NORM_EPS)
        self.kv_b_proj = KVBProj(a, H)
        self.g_proj = nn.Linear(a.hidden_size, H, bias=False)
        self.dense = nn.Linear(H * a.v_head_dim, a.hidden_size, bias=False)
        for rows in (self.q_proj, self.kv_b_proj, self.g_proj):
            par.shard(rows.weight, 0, parallel, "attn_tp")  # this rank's heads
        par.shard(self.dense.weight, 1, parallel, "attn_tp")
        self.kv_cache = None  # [num_blocks, block_size, 1, R + Dr], bound by bind_caches
        self.table = MLA_GROUP  # the ForwardBatch table (and slot mapping) it is read through, set by bind_caches
        self.mode = "auto"

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], batch: ForwardBatch) -> torch.Tensor:
        """x [T, D] (normed) -> [T, D]."""
        T, H = x.shape[0], self.heads
        if T == 0:
            return x
        cos, sin = rope
        q = self.q_proj(x).view(T, H, self.nope + self.rope_dim)  # [T, H, nope + Dr]
        q_nope, q_pe = q[..., : self.nope], ops.rotary_emb(q[..., self.nope :], cos, sin, interleaved=True)
        latent, k_pe = self.kv_a_proj_with_mqa(x).split([self.rank, self.rope_dim], dim=-1)  # [T, R], [T, Dr]
        k_pe = ops.rotary_emb(k_pe.unsqueeze(1), cos, sin, interleaved=True)  # [T, 1, Dr]
        row = torch.cat([self.kv_a_layernorm(latent).unsqueeze(1), k_pe], dim=-1)  # [T, 1, R + Dr]
        ops.reshape_and_cache(row, None, self.kv_cache, None, batch.slot_mapping[self.table])
        absorbed = self.mode == "absorbed" or (self.mode == "auto" and batch.max_seqlen_q <= ABSORB_MAX_QUERIES)
        if absorbed:
            w_uk, w_uv = self.kv_b_proj.halves()  # [H, nope, R], [H, v, R]
            q_lat = torch.bmm(q_nope.transpose(0, 1), w_uk).transpose(0, 1)  # [T, H, R]
            qa = torch.cat([q_lat, q_pe], dim=-1)  # [T, H, R + Dr]: one KV head, the cached row
            o = ops.paged_attention(qa, self.kv_cache, None, batch.block_tables[self.table], batch.seq_lens,
                                    batch.cu_seqlens_q, self.scale, max_seqlen_q=batch.max_seqlen_q,
                                    max_seqlen_k=batch.max_seqlen_k)  # [T, H, R + Dr]
            # W_UV [H, v, R] @ o^T [H, R, T]: the weight as it lies (its transpose would be copied each step)
            o = torch.bmm(w_uv, o[..., : self.rank].permute(1, 2, 0)).permute(2, 0, 1)  # [H, v, T] -> [T, H, v]
        else:
            rows, cu_k = gather_rows(self.kv_cache, batch.block_tables[self.table], batch.seq_lens)  # [S, 1, R+Dr]
            k_nope, v = self.kv_b_proj.expand(rows[:, 0, : self.rank])  # [S, H, nope], [S, H, v]
            k = torch.cat([k_nope, rows[:, :, self.rank :].expand(-1, H, -1)], dim=-1)  # [S, H, nope + Dr]
            qf = torch.cat([q_nope, q_pe], dim=-1)  # [T, H, nope + Dr]
            o = ops.attention(qf, k, v, batch.cu_seqlens_q, cu_k, self.scale, causal=True)  # [T, H, v]
        gate = torch.sigmoid(self.g_proj(x).float()).to(o.dtype)  # [T, H]
        out = self.dense((o * gate[..., None]).reshape(T, H * self.v_dim))  # [T, D]: this rank's heads
        return par.all_reduce(out, self.tp_group)  # [T, D]


def l2_normalize(x: torch.Tensor) -> torch.Tensor:
    """x / sqrt(sum x^2 + eps) over the last dim, in fp32 (fla's l2norm: eps inside the sqrt)."""
    x = x.float()
    return x / torch.sqrt(x.square().sum(-1, keepdim=True) + L2_NORM_EPS)


class KimiDeltaAttention(nn.Module):
    """Ling's KDA (`BailingHybridDeltaAttention`): see the module docstring. conv_weight [3C, K] = the publisher's
    q_conv1d, k_conv1d, v_conv1d kernels ([C, 1, K] each) stacked; conv_weight, A_log [H] and dt_bias [C] are fp32.
    The caches are read and written at the batch's "kda" read and write slots. Attention TP: this rank's H heads
    (C = H * d channels; vLLM's split): the q / k / v / f / g / b projections, conv kernels, A_log and dt_bias by
    rows, o_proj by columns (summed over attn_tp), and so its conv history and recurrent state."""

    def __init__(self, args: ModelArgs, parallel: par.Parallel):
        super().__init__()
        a = args
        self.tp_group = parallel.group("attn_tp")
        H = a.num_attention_heads // parallel.size("attn_tp")
        D, d = a.hidden_size, a.head_dim
        C = H * d
        self.heads, self.head_dim, self.lower_bound = H, d, a.kda_lower_bound
        self.q_proj, self.k_proj, self.v_proj = (nn.Linear(D, C, bias=False) for _ in range(3))
        self.f_proj = nn.Linear(D, C, bias=False)  # the forget gate's input
        self.g_proj = nn.Linear(D, C, bias=False)  # the output gate
        self.b_proj = nn.Linear(D, H, bias=False)  # beta
        self.o_proj = nn.Linear(C, D, bias=False)
        self.conv_weight = nn.Parameter(torch.empty(3 * C, a.short_conv_kernel_size, dtype=torch.float32))
        self.A_log = nn.Parameter(torch.empty(H, dtype=torch.float32))
        self.dt_bias = nn.Parameter(torch.empty(C, dtype=torch.float32))
        self.o_norm = RMSNorm(d, a.rms_norm_eps)
        for rows in (self.q_proj.weight, self.k_proj.weight, self.v_proj.weight, self.f_proj.weight,
                     self.g_proj.weight, self.b_proj.weight, self.conv_weight, self.A_log, self.dt_bias):
            par.shard(rows, 0, parallel, "attn_tp")  # this rank's heads (each conv kernel: weights_ling)
        par.shard(self.o_proj.weight, 1, parallel, "attn_tp")
        self.conv_state = None  # [slots, K-1, 1, 3C], bound by bind_caches
        self.recurrent_state = None  # [slots, H, 1, d * d] fp32
        self.table = KDA_GROUP  # the ForwardBatch state table both are read through, set by bind_caches

    def gate(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, D] -> g [T, H, d] fp32, the log-space decay lower_bound * sigmoid(exp(A_log) * (f + dt_bias))."""
        T, H, d = x.shape[0], self.heads, self.head_dim
        f = self.f_proj(x).float().view(T, H, d) + self.dt_bias.float().view(H, d)  # [T, H, d]
        return self.lower_bound * torch.sigmoid(self.A_log.float().exp()[:, None] * f)

    def forward(self, x: torch.Tensor, rope, batch: ForwardBatch) -> torch.Tensor:
        """x [T, D] (normed) -> [T, D]; rope unused (KDA has no positions)."""
        T, H, d = x.shape[0], self.heads, self.head_dim
        if T == 0:
            return x
        table = batch.block_tables[self.table]  # [B, 1 + W]
        read, write = table[:, 0], table[:, 1:]  # [B], [B, W]: the state after each of the last W tokens
        conv_state = self.conv_state.squeeze(2)  # [slots, K-1, 3C], a view: the op writes through it
        state = self.recurrent_state.view(-1, H, d, d)  # [slots, H, dk, dv] fp32
        qkv = torch.cat([self.q_proj(x), self.k_proj(x), self.v_proj(x)], dim=-1)  # [T, 3C] pre-conv
        B, L = batch.num_seqs, batch.max_seqlen_q
        # every sequence L tokens, few (a decode or MTP verify step): token by token, no host read (graph mode)
        uniform = T == B * L and L <= RECURRENT_MAX_QUERIES
        if uniform:
            qkv = ops.causal_conv1d_update(qkv.view(B, L, -1), self.conv_weight, conv_state, read, write)
            qkv = qkv.view(T, -1)  # [T, 3C]
        else:
            qkv = ops.causal_conv1d(qkv, self.conv_weight, batch.cu_seqlens_q, conv_state, read, write)  # [T, 3C]
        q, k, v = qkv.view(T, 3, H, d).unbind(1)  # [T, H, d] each
        q, k = l2_normalize(q), l2_normalize(k)  # fp32
        g = self.gate(x)  # [T, H, d] fp32
        beta = torch.sigmoid(self.b_proj(x).float())  # [T, H] fp32
        if uniform:
            o = ops.recurrent_kda(*(t.view(B, L, *t.shape[1:]) for t in (q, k, v, g, beta)), state, read, write,
                                  d ** -0.5).view(T, H, d)  # [T, H, d]
        else:
            o = ops.chunk_kda(q, k, v, g, beta, batch.cu_seqlens_q, state, read, write, d ** -0.5)  # [T, H, d]
        o = ops.rms_norm(o.float(), self.o_norm.weight, self.o_norm.eps)  # [T, H, d] fp32
        o = o * torch.sigmoid(self.g_proj(x).float().view(T, H, d))
        out = self.o_proj(o.to(x.dtype).reshape(T, H * d))  # [T, D]: this rank's heads
        return par.all_reduce(out, self.tp_group)  # [T, D]


class DecoderLayer(nn.Module):
    def __init__(self, args: ModelArgs, layer: int, mla: bool, sparse: bool, parallel: par.Parallel):
        super().__init__()
        self.attention = MLAttention(args, parallel) if mla else KimiDeltaAttention(args, parallel)
        limits = args.swiglu_limits(layer)
        self.mlp = MoE(args, parallel, limits) if sparse else MLP(args.hidden_size, args.intermediate_size)
        self.input_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)

    def forward(self, x: torch.Tensor, rope, batch: ForwardBatch) -> torch.Tensor:
        """x [T, D], the residual stream -> [T, D]."""
        x = x + self.attention(self.input_layernorm(x), rope, batch)
        h = self.post_attention_layernorm(x)
        return x + (self.mlp(h, batch.uniform_across_ranks) if isinstance(self.mlp, MoE) else self.mlp(h))


class MTPLayer(DecoderLayer):
    """The publisher's multi-token-prediction layer `model.layers.{num_hidden_layers}` (vLLM
    BailingMoeV3MultiTokenPredictorLayer): eh_proj([enorm(embedding of token t+1); hnorm(final normed hidden at
    t)]) -> an MLA + MoE decoder layer (its own latent rows in the "mla" group) -> final_layernorm; the main LM head
    then gives the logits of token t+2. No SwiGLU clamp (past the per-layer lists, unless they name it)."""

    def __init__(self, args: ModelArgs, parallel: par.Parallel):
        super().__init__(args, args.num_hidden_layers, mla=True, sparse=True, parallel=parallel)
        D = args.hidden_size
        self.enorm, self.hnorm = RMSNorm(D, args.rms_norm_eps), RMSNorm(D, args.rms_norm_eps)
        self.eh_proj = nn.Linear(2 * D, D, bias=False)
        self.final_layernorm = RMSNorm(D, args.rms_norm_eps)

    def forward(self, hidden: torch.Tensor, embeds: torch.Tensor, rope, batch: ForwardBatch) -> torch.Tensor:
        """hidden [T, D] (the main model's final normed hidden states at positions t), embeds [T, D] (token t+1's)
        -> [T, D] after final_layernorm, for the LM head."""
        x = self.eh_proj(torch.cat([self.enorm(embeds), self.hnorm(hidden)], dim=-1))  # [T, D]
        return self.final_layernorm(super().forward(x, rope, batch))


def check_layout(args: ModelArgs, layout: par.LLMParallelLayout) -> None:
    """ValueError unless the layout splits this model evenly (checked before any rank starts, and by the model)."""
    for size, name, n, what in ((layout.attn_tp, "attn_tp", args.num_attention_heads, "attention heads (KDA and MLA)"),
                                (layout.moe_ep, "moe_ep", args.n_routed_experts, "routed experts"),
                                (layout.embed_tp, "embed_tp", args.vocab_size, "vocabulary rows"),
                                (layout.lmhead_tp, "lmhead_tp", args.vocab_size, "vocabulary rows")):
        if n % size:
            raise ValueError(f"{name}={size} does not divide the model's {n} {what}")


class LingForCausalLM(nn.Module):
    """The causal LM over packed ForwardBatch inputs, a paged latent cache and a per-request KDA state (the engine's
    model contract); with `mtp`, also its MTP layer (`self.mtp`), sharing the embedding and the LM head. parallel
    (common.parallel.Parallel over an LLMParallelLayout; None: one process): attention heads over attn_tp, routed
    experts over moe_ep, the embedding's and the LM head's vocabulary over embed_tp / lmhead_tp."""

    def __init__(self, args: ModelArgs, mtp: bool = False, parallel: par.Parallel | None = None):
        super().__init__()
        self.args = args
        self.parallel = parallel = parallel or par.Parallel(par.LLMParallelLayout())
        check_layout(args, parallel.layout)
        self.embed_group, self.head_group = parallel.group("embed_tp"), parallel.group("lmhead_tp")
        self.word_embeddings = nn.Embedding(args.vocab_size // parallel.size("embed_tp"), args.hidden_size)
        par.shard(self.word_embeddings.weight, 0, parallel, "embed_tp")
        self.vocab_start = parallel.rank_in("embed_tp") * self.word_embeddings.num_embeddings
        self.layers = nn.ModuleList(DecoderLayer(args, i, args.layer_types[i] == MLA,
                                                 args.mlp_layer_types[i] == "sparse", parallel)
                                    for i in range(args.num_hidden_layers))
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.lm_head = nn.Linear(args.hidden_size, args.vocab_size // parallel.size("lmhead_tp"), bias=False)
        par.shard(self.lm_head.weight, 0, parallel, "lmhead_tp")
        self.rope = Rope(args)
        self.mtp = MTPLayer(args, parallel) if mtp and args.num_nextn_predict_layers else None

    def attention_layers(self) -> list[MLAttention]:
        """Every MLA attention (the MTP layer's too)."""
        layers = [*self.layers, *([self.mtp] if self.mtp is not None else [])]
        return [layer.attention for layer in layers if isinstance(layer.attention, MLAttention)]

    def set_attention_mode(self, mode: str) -> None:
        """MLA's "auto", "absorbed" or "expanded" for every MLA layer (equal paths; tests compare them)."""
        if mode not in ("auto", "absorbed", "expanded"):
            raise ValueError(f"attention mode {mode!r}: expected auto, absorbed or expanded")
        for attn in self.attention_layers():
            attn.mode = mode

    # the model contract (common/engine/model_contract.py)
    def engine_contract(self) -> ModelContract:
        a, w = self.args, self.word_embeddings.weight
        return ModelContract(a.max_position_embeddings, a.vocab_size, tuple(a.eos_token_ids), a.hidden_size,
                             w.dtype, w.device, self.parallel,
                             mtp=self if self.mtp is not None else None)  # this model is its MTPDraftModel

    def cache_specs(self, block_size: int) -> list[CacheGroupSpec]:
        """The MLA layers' latent rows (paged) and the KDA layers' per-request state (a slot per request)."""
        return [CacheGroupSpec(MLA_GROUP, block_size), CacheGroupSpec(KDA_GROUP, block_size, kind="state")]

    def cache_tensor_specs(self) -> list[CacheTensorSpec]:
        """Per layer in order: an MLA layer's latent rows [R + Dr] a token; a KDA layer's conv history (K-1 rows of
        3C, model dtype) and recurrent state (H rows of d * d, fp32) a slot; the MTP layer's latent rows last. Under
        attention TP, H and C are this rank's (its heads' states); the latent rows are every rank's, replicated."""
        a, specs = self.args, []
        H = a.num_attention_heads // self.parallel.size("attn_tp")
        d = a.head_dim
        C = H * d
        layers = [(f"layers.{i}", layer) for i, layer in enumerate(self.layers)]
        for name, layer in layers + ([("mtp", self.mtp)] if self.mtp is not None else []):
            if isinstance(layer.attention, MLAttention):
                specs.append(CacheTensorSpec(f"{name}.attention.kv_cache", MLA_GROUP,
                                             a.kv_lora_rank + a.qk_rope_head_dim))
            else:
                specs.append(CacheTensorSpec(f"{name}.attention.conv_state", KDA_GROUP, 3 * C,
                                             rows=a.short_conv_kernel_size - 1))
                specs.append(CacheTensorSpec(f"{name}.attention.recurrent_state", KDA_GROUP, d * d, rows=H,
                                             dtype=torch.float32))
        return specs

    def bind_caches(self, tensors: dict[str, torch.Tensor], tables: dict[str, str] | None = None) -> None:
        """Use these cache tensors (by CacheTensorSpec name, no copy), each read through the ForwardBatch table
        `tables` names for it (default: its group), so that each layer may have a block table of its own (vLLM's
        hybrid allocator gives groups of layers their own tables). A KDA layer's conv history and recurrent state
        share one (state) table: ValueError for a layer whose two tensors name different ones, or for a name that
        is no cache tensor."""
        specs = self.cache_tensor_specs()
        check_cache_tensors(specs, tensors)
        tables = tables or {}
        if unknown := sorted(tables.keys() - {s.name for s in specs}):
            raise ValueError(f"tables for tensors the model does not have: {unknown}")
        keys: dict[str, str] = {}  # module path -> its table
        for s in specs:
            path = s.name.rsplit(".", 1)[0]
            key = tables.get(s.name, s.group)
            if keys.setdefault(path, key) != key:
                raise ValueError(f"{s.name} is read through {key!r}, the other state tensor of {path} through "
                                 f"{keys[path]!r}: a KDA layer's conv history and recurrent state share one table")
        for s in specs:
            path, attr = s.name.rsplit(".", 1)
            module = self.get_submodule(path)
            setattr(module, attr, tensors[s.name])
            module.table = keys[path]

    def embed_tokens(self, input_ids: torch.Tensor, uniform: bool = False) -> torch.Tensor:
        """[T] -> [T, D] (the vocabulary split over embed_tp)."""
        return par.vocab_parallel_embedding(input_ids, self.word_embeddings, self.vocab_start, self.embed_group,
                                            uniform)  # [T, D]

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """-> the final normed hidden states [T, D] (feed the rows you need to compute_logits)."""
        return self.final_hidden(self.residual_streams(batch))

    def residual_streams(self, batch: ForwardBatch) -> torch.Tensor:
        """The final normed hidden states as one stream [T, 1, D]: what the MTP layer reads (the speculative-
        decoding contract's [T, n, D], n = 1)."""
        x = self.embed_tokens(batch.input_ids, batch.uniform_across_ranks)  # [T, D]
        rope = self.rope.tables(batch.positions)
        for layer in self.layers:
            x = layer(x, rope, batch)
        return self.norm(x).unsqueeze(1)  # [T, 1, D]

    def final_hidden(self, streams: torch.Tensor) -> torch.Tensor:
        """[T, 1, D] -> [T, D] for the LM head."""
        return streams[:, 0]

    def compute_logits(self, hidden: torch.Tensor, uniform: bool = False) -> torch.Tensor:
        """[N, D] -> [N, V] fp32 (the vocabulary split over lmhead_tp)."""
        return par.vocab_parallel_logits(hidden, self.lm_head, self.head_group, uniform).float()  # [N, V]

    # MTPDraftModel (common/engine/model_contract.py): the one MTP layer, fed the main model's final normed hidden
    # states, then (k > 1) its own output, as vLLM chains BailingMoeV3's layer 42
    num_draft_layers = 1

    def empty_streams(self) -> torch.Tensor:
        return self.word_embeddings.weight.new_zeros(0, 1, self.args.hidden_size)  # [0, 1, D]

    def draft_streams(self, layer: int, streams: torch.Tensor, input_ids: torch.Tensor,
                      batch: ForwardBatch) -> torch.Tensor:
        """streams [T, 1, D], input_ids [T] (token t+1) -> the MTP layer's output [T, 1, D] (after its final norm)."""
        embeds = self.embed_tokens(input_ids, batch.uniform_across_ranks)  # [T, D]
        return self.mtp(streams[:, 0], embeds, self.rope.tables(batch.positions), batch).unsqueeze(1)

    def draft_logits(self, layer: int, streams: torch.Tensor) -> torch.Tensor:
        """[B, 1, D] -> [B, V] fp32."""
        return self.compute_logits(streams[:, 0])

    def mtp_logits(self, hidden: torch.Tensor, next_ids: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """The MTP layer over the batch's positions: hidden [T, D] (this model's forward at those positions),
        next_ids [T] (the token after each) -> logits [T, V] fp32 of the token after that. Writes the MTP layer's
        latent rows at the batch's "mla" slots."""
        if self.mtp is None:
            raise ValueError("the MTP layer is not loaded (load_model(..., mtp=True))")
        out = self.mtp(hidden, self.embed_tokens(next_ids), self.rope.tables(batch.positions), batch)  # [T, D]
        return self.compute_logits(out)
