"""DeepSeek-V4 on common.ops, over packed (token-major, unpadded) inputs.

Per layer: mHC -> attention -> mHC -> MoE. Parameter names follow the publisher's checkpoints
(`embed`, `layers.N.attn.wq_a`, `layers.N.ffn.experts`, `hc_head_fn`, ...); routed experts are stacked
into `[E, ...]` tensors for grouped matmuls. T = tokens of all sequences in the batch, D = hidden size,
n = hc_mult residual streams, H = attention heads, Dh = head_dim, C = compressed entries.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from common import ops
from config_deepseek_v4 import CSA, HCA, SLIDING, ModelArgs


@dataclass
class Batch:
    """What one forward needs about its packed sequences (prefill from scratch: q == kv)."""

    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64, position of each token in its sequence
    cu_seqlens: torch.Tensor  # [B+1] int32

    @classmethod
    def from_prompts(cls, prompts: list[list[int]], device=None) -> "Batch":
        lens = torch.tensor([len(p) for p in prompts])
        cu = F.pad(lens.cumsum(0), (1, 0)).to(torch.int32)
        ids = torch.tensor([t for p in prompts for t in p], dtype=torch.long)
        pos = torch.cat([torch.arange(n) for n in lens.tolist()])
        return cls(ids.to(device), pos.to(device), cu.to(device))

    @property
    def seq_lens(self) -> list[int]:
        return (self.cu_seqlens[1:] - self.cu_seqlens[:-1]).tolist()


def rope_inv_freq(dim: int, theta: float, yarn: dict | None) -> torch.Tensor:
    """Inverse frequencies [dim/2]; YaRN-blended when `yarn` is given (no attention scaling, as upstream)."""
    inv = 1.0 / theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    if not yarn:
        return inv
    factor, orig = yarn["factor"], yarn["original_max_position_embeddings"]
    fast, slow = yarn.get("beta_fast") or 32, yarn.get("beta_slow") or 1

    def corr_dim(rot):
        return dim * math.log(orig / (rot * 2 * math.pi)) / (2 * math.log(theta))

    low, high = max(math.floor(corr_dim(fast)), 0), min(math.ceil(corr_dim(slow)), dim - 1)
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / max(high - low, 1e-3)).clamp(0, 1)
    return inv / factor * ramp + inv * (1 - ramp)


class Rope(nn.Module):
    """Interleaved RoPE on the trailing `dim` channels of each head."""

    def __init__(self, dim: int, theta: float, yarn: dict | None):
        super().__init__()
        self.dim = dim
        self.scale = float(yarn.get("attention_factor", 1.0)) if yarn else 1.0
        self.register_buffer("inv_freq", rope_inv_freq(dim, theta, yarn), persistent=False)

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.float()[:, None] * self.inv_freq  # [T, dim/2]
        freqs = freqs.repeat_interleave(2, dim=-1)  # [T, dim] interleaved pairs
        return freqs.cos() * self.scale, freqs.sin() * self.scale

    def __call__(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x [T, H, Dh] -> x with its last `dim` channels rotated."""
        nope, pe = x[..., : -self.dim], x[..., -self.dim :]
        return torch.cat([nope, ops.rotary_emb(pe, cos, sin, interleaved=True)], dim=-1)


class RMSNorm(nn.Module):
    """RMSNorm with an fp32 weight (cast once at the end, as upstream)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim, dtype=torch.float32))
        self.eps = eps

    def forward(self, x):
        return ops.rms_norm(x, self.weight, self.eps)


class Compressor(nn.Module):
    """Softmax-gated pooling of every `ratio` tokens into one KV entry (then RMSNorm + RoPE at ratio*w).

    With `overlap` (CSA) each token projects two series [Ca | Cb]; entry w pools window w-1's Ca with
    window w's Cb over 2*ratio slots. Without it (HCA) entry w pools window w alone.
    """

    def __init__(self, args: ModelArgs, ratio: int, head_dim: int, overlap: bool, rope: Rope):
        super().__init__()
        self.ratio, self.head_dim, self.overlap, self.rope = ratio, head_dim, overlap, rope
        width = head_dim * (2 if overlap else 1)
        self.wkv = nn.Linear(args.hidden_size, width, bias=False)
        self.wgate = nn.Linear(args.hidden_size, width, bias=False)
        self.ape = nn.Parameter(torch.zeros(ratio, width, dtype=torch.float32))
        self.norm = RMSNorm(head_dim, args.rms_norm_eps)

    def forward(self, x: torch.Tensor, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, D] -> (entries [C, head_dim] of all sequences, cu_entries [B+1])."""
        kv, gate = self.wkv(x), self.wgate(x)  # [T, width]
        r, d, out, counts = self.ratio, self.head_dim, [], []
        for start, n in zip(batch.cu_seqlens[:-1].tolist(), batch.seq_lens):
            w = n // r
            ckv = kv[start : start + w * r].view(w, r, kv.shape[-1])  # [W, r, width]
            cg = gate[start : start + w * r].view(w, r, kv.shape[-1]) + self.ape  # [W, r, width]
            if self.overlap:
                prev_kv = F.pad(ckv[:-1, :, :d], (0, 0, 0, 0, 1, 0))  # [W, r, d], zeros before window 0
                prev_g = F.pad(cg[:-1, :, :d], (0, 0, 0, 0, 1, 0), value=float("-inf"))
                ckv = torch.cat([prev_kv, ckv[:, :, d:]], dim=1)  # [W, 2r, d]
                cg = torch.cat([prev_g, cg[:, :, d:]], dim=1)
            pooled = (ckv * cg.softmax(dim=1, dtype=torch.float32).to(ckv.dtype)).sum(dim=1)  # [W, d]
            pooled = self.norm(pooled)
            cos, sin = self.rope.cos_sin(torch.arange(w, device=x.device) * r)
            out.append(self.rope(pooled[:, None], cos, sin)[:, 0])
            counts.append(w)
        cu = F.pad(torch.tensor(counts, device=x.device).cumsum(0), (1, 0)).to(torch.int32)
        return torch.cat(out), cu


class Indexer(nn.Module):
    """Lightning indexer: picks the top-k compressed entries per query by sum_h w_h * relu(q_h . k)."""

    def __init__(self, args: ModelArgs, ratio: int, rope: Rope):
        super().__init__()
        self.n_heads, self.head_dim, self.topk, self.ratio = args.index_n_heads, args.index_head_dim, args.index_topk, ratio
        self.wq_b = nn.Linear(args.q_lora_rank, self.n_heads * self.head_dim, bias=False)
        self.weights_proj = nn.Linear(args.hidden_size, self.n_heads, bias=False)
        self.compressor = Compressor(args, ratio, self.head_dim, overlap=True, rope=rope)
        self.rope = rope
        self.scale = (self.head_dim * self.n_heads) ** -0.5

    def forward(self, x, q_lora, cos, sin, batch: Batch) -> torch.Tensor:
        """-> indices [T, topk] into the layer's compressed entries of all sequences, -1 where empty."""
        keys, cu_keys = self.compressor(x, batch)  # [C, Di]
        q = self.wq_b(q_lora).view(-1, self.n_heads, self.head_dim)  # [T, Hi, Di]
        q = self.rope(q, cos, sin)
        weights = self.weights_proj(x).float() * self.scale  # [T, Hi]
        visible = (batch.positions + 1) // self.ratio  # [T]
        return ops.lightning_indexer(q, keys, weights, batch.cu_seqlens, cu_keys, visible, self.topk)


class Attention(nn.Module):
    """Shared-KV MQA with attention sinks over a sliding window, plus compressed entries (CSA / HCA)."""

    def __init__(self, args: ModelArgs, layer: int, ropes: dict[str, Rope]):
        super().__init__()
        self.kind = args.layer_types[layer]
        self.n_heads, self.head_dim, self.window = args.num_attention_heads, args.head_dim, args.sliding_window
        self.groups, self.eps = args.o_groups, args.rms_norm_eps
        self.rope = ropes["main" if self.kind == SLIDING else "compress"]
        self.wq_a = nn.Linear(args.hidden_size, args.q_lora_rank, bias=False)
        self.q_norm = RMSNorm(args.q_lora_rank, args.rms_norm_eps)
        self.wq_b = nn.Linear(args.q_lora_rank, self.n_heads * self.head_dim, bias=False)
        self.wkv = nn.Linear(args.hidden_size, self.head_dim, bias=False)
        self.kv_norm = RMSNorm(self.head_dim, args.rms_norm_eps)
        self.wo_a = nn.Linear(self.n_heads * self.head_dim // self.groups, self.groups * args.o_lora_rank, bias=False)
        self.wo_b = nn.Linear(self.groups * args.o_lora_rank, args.hidden_size, bias=False)
        self.attn_sink = nn.Parameter(torch.zeros(self.n_heads, dtype=torch.float32))
        self.ratio = args.compress_rates.get(self.kind, 0)
        self.compressor = None if self.kind == SLIDING else Compressor(args, self.ratio, self.head_dim, self.kind == CSA, self.rope)
        self.indexer = Indexer(args, self.ratio, self.rope) if self.kind == CSA else None
        self.scale = self.head_dim**-0.5

    def forward(self, x: torch.Tensor, batch: Batch) -> torch.Tensor:
        T = x.shape[0]
        cos, sin = self.rope.cos_sin(batch.positions)  # [T, rope_dim]
        q_lora = self.q_norm(self.wq_a(x))  # [T, q_lora_rank]
        q = self.wq_b(q_lora).view(T, self.n_heads, self.head_dim)  # [T, H, Dh]
        q = self.rope(ops.rms_norm(q, None, self.eps), cos, sin)
        kv = self.kv_norm(self.wkv(x)).view(T, 1, self.head_dim)  # [T, 1, Dh], K = V
        kv = self.rope(kv, cos, sin)
        cu = batch.cu_seqlens
        o, lse = ops.attention(q, kv, kv, cu, cu, self.scale, causal=True, sliding_window=self.window, return_lse=True)
        entries, cu_entries = self.compressor(x, batch) if self.compressor is not None else (x[:0], None)  # [C, Dh]
        if entries.shape[0]:
            if self.indexer is not None:
                idx = self.indexer(x, q_lora, cos, sin, batch)  # [T, k]
            else:
                idx = visible_entries(batch, cu_entries, self.ratio)  # [T, max visible]
            oc, lsec = ops.sparse_attention(q, entries[:, None], entries[:, None], idx, self.scale, return_lse=True)
            o, lse = ops.merge_attention_states(o, lse, oc, lsec)
        o = ops.apply_attention_sinks(o, lse, self.attn_sink)  # [T, H, Dh]
        o = self.rope(o, cos, -sin)  # undo the keys' rotation carried into the values
        o = o.reshape(T, self.groups, -1)  # [T, G, H*Dh/G]
        wo_a = self.wo_a.weight.view(self.groups, -1, o.shape[-1])  # [G, R, H*Dh/G]
        o = torch.einsum("tgi,gri->tgr", o, wo_a).flatten(1)  # [T, G*R]
        return self.wo_b(o)


def visible_entries(batch: Batch, cu_entries: torch.Tensor, ratio: int) -> torch.Tensor:
    """HCA: every causally visible entry of the query's own sequence, as global rows; -1 pads. -> [T, max]"""
    visible = (batch.positions + 1) // ratio  # [T]
    width = max(int(visible.max()), 1) if visible.numel() else 1
    seq = torch.repeat_interleave(torch.arange(len(batch.seq_lens), device=visible.device), torch.tensor(batch.seq_lens, device=visible.device))
    ar = torch.arange(width, device=visible.device)
    idx = cu_entries[:-1][seq, None].long() + ar  # [T, width]
    return torch.where(ar < visible[:, None], idx, -1)


class Gate(nn.Module):
    """Router weights: logits = x @ weight.T; `bias` (selection only) or a frozen token -> experts table."""

    def __init__(self, args: ModelArgs, hash_routing: bool):
        super().__init__()
        E = args.n_routed_experts
        self.weight = nn.Parameter(torch.empty(E, args.hidden_size))
        if hash_routing:
            self.register_buffer("tid2eid", torch.zeros(args.vocab_size, args.num_experts_per_tok, dtype=torch.int32))
        else:
            self.bias = nn.Parameter(torch.zeros(E, dtype=torch.float32))


class MoE(nn.Module):
    """Routed experts (top-k by scores + bias, or hash routing by token id) plus one shared expert."""

    def __init__(self, args: ModelArgs, layer: int):
        super().__init__()
        E, I, D = args.n_routed_experts, args.moe_intermediate_size, args.hidden_size
        self.hash = args.mlp_layer_types[layer] == "hash_moe"
        self.args = args
        self.gate = Gate(args, self.hash)
        self.experts = nn.Module()
        self.experts.w13 = nn.Parameter(torch.empty(E, 2 * I, D))  # [E, gate|up, D]
        self.experts.w2 = nn.Parameter(torch.empty(E, D, I))
        self.shared_experts = SharedExpert(args) if args.n_shared_experts else None

    def forward(self, x: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        a = self.args
        logits = F.linear(x, self.gate.weight)  # [T, E]
        weights, idx = ops.moe_gating_topk(
            logits, a.num_experts_per_tok, bias=None if self.hash else self.gate.bias, score_func=a.scoring_func,
            renorm=a.norm_topk_prob, routed_scaling_factor=a.routed_scaling_factor,
            tid2eid=self.gate.tid2eid if self.hash else None, input_ids=input_ids if self.hash else None,
        )  # [T, k], [T, k]
        xs, row_idx, counts = ops.moe_init_routing(x, idx, a.n_routed_experts)  # [T*k, D]
        h = ops.swiglu(ops.grouped_matmul(xs, self.experts.w13, counts), a.swiglu_limit)  # [T*k, I]
        y = ops.grouped_matmul(h, self.experts.w2, counts)  # [T*k, D]
        shared = self.shared_experts(x) if self.shared_experts is not None else None
        return ops.moe_finalize_routing(y, weights, row_idx, shared)


class SharedExpert(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        I, D = args.moe_intermediate_size, args.hidden_size
        self.w13 = nn.Linear(D, 2 * I, bias=False)  # packs checkpoint w1 (gate) and w3 (up)
        self.w2 = nn.Linear(I, D, bias=False)
        self.limit = args.swiglu_limit

    def forward(self, x):
        return self.w2(ops.swiglu(self.w13(x), self.limit))


def hc_pre(x, fn, base, scale, n: int, iters: int, eps: float, norm_eps: float):
    """mHC weights from the n streams. x [T, n, D] -> (collapsed [T, D], post [T, n], comb [T, n, n])."""
    flat = ops.rms_norm(x.flatten(1).float(), None, norm_eps)  # [T, n*D]
    pre, post, comb = F.linear(flat, fn.float()).split([n, n, n * n], -1)
    pre_b, post_b, comb_b = base.split([n, n, n * n])
    pre = torch.sigmoid(pre * scale[0] + pre_b) + eps  # [T, n]
    post = 2 * torch.sigmoid(post * scale[1] + post_b)  # [T, n]
    comb = torch.softmax((comb * scale[2] + comb_b).view(-1, n, n), dim=-1) + eps  # [T, n, n]
    comb = comb / (comb.sum(-2, keepdim=True) + eps)
    for _ in range(iters - 1):  # Sinkhorn-Knopp: towards a doubly-stochastic matrix
        comb = comb / (comb.sum(-1, keepdim=True) + eps)
        comb = comb / (comb.sum(-2, keepdim=True) + eps)
    collapsed = (pre.unsqueeze(-1) * x).sum(1).to(x.dtype)  # [T, D]
    return collapsed, post, comb


def hc_post(out: torch.Tensor, x: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """Expand the block output into n streams and mix in the residual streams: [T, D] -> [T, n, D]."""
    return post.to(x.dtype).unsqueeze(-1) * out.unsqueeze(1) + comb.to(x.dtype).transpose(1, 2) @ x


class Block(nn.Module):
    def __init__(self, args: ModelArgs, layer: int, ropes: dict[str, Rope]):
        super().__init__()
        n = args.hc_mult
        self.args = args
        self.attn = Attention(args, layer, ropes)
        self.ffn = MoE(args, layer)
        self.attn_norm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.ffn_norm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        for site in ("attn", "ffn"):
            self.register_parameter(f"hc_{site}_fn", nn.Parameter(torch.zeros((2 + n) * n, n * args.hidden_size, dtype=torch.float32)))
            self.register_parameter(f"hc_{site}_base", nn.Parameter(torch.zeros((2 + n) * n, dtype=torch.float32)))
            self.register_parameter(f"hc_{site}_scale", nn.Parameter(torch.ones(3, dtype=torch.float32)))

    def _hc(self, site: str, x):
        a = self.args
        p = lambda k: getattr(self, f"hc_{site}_{k}")  # noqa: E731
        return hc_pre(x, p("fn"), p("base"), p("scale"), a.hc_mult, a.hc_sinkhorn_iters, a.hc_eps, a.rms_norm_eps)

    def forward(self, x: torch.Tensor, batch: Batch) -> torch.Tensor:
        """x [T, n, D] -> [T, n, D]"""
        h, post, comb = self._hc("attn", x)
        x = hc_post(self.attn(self.attn_norm(h), batch), x, post, comb)
        h, post, comb = self._hc("ffn", x)
        return hc_post(self.ffn(self.ffn_norm(h), batch.input_ids), x, post, comb)


class DeepseekV4(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        n, D = args.hc_mult, args.hidden_size
        ropes = {
            "main": Rope(args.qk_rope_head_dim, args.rope_theta, None),
            "compress": Rope(args.qk_rope_head_dim, args.compress_rope_theta, args.compress_rope_scaling),
        }
        self.embed = nn.Embedding(args.vocab_size, D)
        self.layers = nn.ModuleList(Block(args, i, ropes) for i in range(args.num_hidden_layers))
        self.norm = RMSNorm(D, args.rms_norm_eps)
        self.hc_head_fn = nn.Parameter(torch.zeros(n, n * D, dtype=torch.float32))
        self.hc_head_base = nn.Parameter(torch.zeros(n, dtype=torch.float32))
        self.hc_head_scale = nn.Parameter(torch.ones(1, dtype=torch.float32))
        self.head = nn.Linear(D, args.vocab_size, bias=False)

    def forward(self, batch: Batch) -> torch.Tensor:
        """-> final hidden states [T, D] (feed the rows you need to `compute_logits`)."""
        a = self.args
        x = self.embed(batch.input_ids).unsqueeze(1).expand(-1, a.hc_mult, -1).contiguous()  # [T, n, D]
        for layer in self.layers:
            x = layer(x, batch)
        flat = ops.rms_norm(x.flatten(1).float(), None, a.rms_norm_eps)  # [T, n*D]
        pre = torch.sigmoid(F.linear(flat, self.hc_head_fn) * self.hc_head_scale + self.hc_head_base) + a.hc_eps
        h = (pre.unsqueeze(-1) * x).sum(1).to(x.dtype)  # [T, D]
        return self.norm(h)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.head(hidden).float()  # [N, V]
