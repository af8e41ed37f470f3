"""HunyuanImage-3.0 on common.ops: the Hunyuan MoE backbone, the image path around it, and the forward metadata.

Tokens are packed token-major ([T, H], all sequences of the batch back to back). K / V go through a paged cache
(ops.reshape_and_cache at each token's slot) and attention reads it (ops.paged_attention); one call per mask kind:
text rows are causal, the rows of an image block see the whole block and everything before it.

Parallel (common.parallel groups): attention tensor parallel by whole kv groups (`tp`: each rank holds Hkv/tp
groups of the fused qkv_proj and the matching input columns of o_proj, partial outputs all-reduced); MoE expert
parallel (`ep`: E/ep experts per rank, tokens dispatched with all-to-all, see ep_hunyuan_image.py).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from common import ops
from common.parallel import all_reduce, group_rank, group_size
from config_hunyuan_image import HunyuanImageConfig
from ep_hunyuan_image import ep_moe
from image_layers_hunyuan_image import TimestepEmbedder, UNetDown, UNetUp
from vae_hunyuan_image import AutoencoderKLConv3D


@dataclass(slots=True)
class AttentionGroup:
    """One ops.paged_attention call: rows of the packed queries, their sequences' block tables and kv lengths."""

    rows: torch.Tensor  # [Tq] int64 rows of q
    block_tables: torch.Tensor  # [n, max_blocks] int32
    seq_lens: torch.Tensor  # [n] int32, kv length of each (query run = last positions of it)
    cu_seqlens_q: torch.Tensor  # [n+1] int32
    causal: bool


@dataclass(slots=True)
class ForwardMetadata:
    cos: torch.Tensor  # [T, D] 2D-RoPE tables of the packed tokens
    sin: torch.Tensor  # [T, D]
    slot_mapping: torch.Tensor  # [T] int64 cache slot of each token
    groups: list[AttentionGroup]


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ops.rms_norm(x, self.weight, self.eps)


def _swap_halves(w: torch.Tensor) -> torch.Tensor:
    """Publisher gate_and_up_proj rows [linear | activated] -> [activated | linear] (ops.swiglu's [gate | up])."""
    up, gate = w.chunk(2, dim=0)
    return torch.cat([gate, up], dim=0)


class HunyuanAttention(nn.Module):
    """Fused per-kv-group QKV, RoPE then per-head QK RMSNorm, GQA attention through the paged cache, o_proj."""

    def __init__(self, cfg: HunyuanImageConfig, tp_group=None):
        super().__init__()
        self.tp_group, tp, r = tp_group, group_size(tp_group), group_rank(tp_group)
        if cfg.num_key_value_heads % tp:
            raise ValueError(f"attention tp={tp} must divide num_key_value_heads={cfg.num_key_value_heads}")
        self.kv_heads, self.groups, self.head_dim = cfg.num_key_value_heads // tp, cfg.num_groups, cfg.head_dim
        self.eps, self.scale = cfg.rms_norm_eps, cfg.head_dim ** -0.5
        kv0, kv1, D, G = r * self.kv_heads, (r + 1) * self.kv_heads, cfg.head_dim, cfg.num_groups
        self.kv_range = (kv0, kv1)
        self.qkv_proj = nn.Linear(cfg.hidden_size, self.kv_heads * (G + 2) * D, bias=False)
        self.o_proj = nn.Linear(self.kv_heads * G * D, cfg.hidden_size, bias=False)
        self.query_layernorm = RMSNorm(D, cfg.rms_norm_eps)
        self.key_layernorm = RMSNorm(D, cfg.rms_norm_eps)
        self.attach_weight_loaders()

    def attach_weight_loaders(self):
        """qkv_proj rows [kv, G+2, D] and o_proj input columns [kv, G, D]: this rank's kv groups."""
        (kv0, kv1), GD2, GD = self.kv_range, (self.groups + 2) * self.head_dim, self.groups * self.head_dim
        self.qkv_proj.weight.weight_loader = \
            lambda p, w, _: p.copy_(w.view(-1, GD2, w.shape[-1])[kv0:kv1].flatten(0, 1))
        self.o_proj.weight.weight_loader = lambda p, w, _: p.copy_(w[:, kv0 * GD:kv1 * GD])

    def forward(self, x: torch.Tensor, meta: ForwardMetadata, k_cache: torch.Tensor, v_cache: torch.Tensor):
        T, G = x.shape[0], self.groups
        qkv = self.qkv_proj(x).view(T, self.kv_heads, G + 2, self.head_dim)  # [T, Hkv, G+2, D]
        q = qkv[:, :, :G].reshape(T, self.kv_heads * G, self.head_dim)  # [T, Hq, D], head = kv*G + g
        k, v = qkv[:, :, G].contiguous(), qkv[:, :, G + 1].contiguous()  # [T, Hkv, D]
        q = self.query_layernorm(ops.rotary_emb(q, meta.cos, meta.sin, interleaved=False))
        k = self.key_layernorm(ops.rotary_emb(k, meta.cos, meta.sin, interleaved=False))
        ops.reshape_and_cache(k, v, k_cache, v_cache, meta.slot_mapping)
        out = torch.empty_like(q)  # [T, Hq, D]
        for g in meta.groups:
            out[g.rows] = ops.paged_attention(q[g.rows], k_cache, v_cache, g.block_tables, g.seq_lens,
                                              g.cu_seqlens_q, self.scale, causal=g.causal)
        return all_reduce(self.o_proj(out.flatten(1)), self.tp_group)  # [T, H]


class HunyuanMLP(nn.Module):
    """The shared MLP: `gate_and_up_proj` [2I, H] (stored [activated | linear] here), SwiGLU, `down_proj`."""

    def __init__(self, hidden: int, intermediate: int):
        super().__init__()
        self.gate_and_up_proj = nn.Linear(hidden, 2 * intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)
        self.attach_weight_loaders()

    def attach_weight_loaders(self):
        self.gate_and_up_proj.weight.weight_loader = lambda p, w, _: p.copy_(_swap_halves(w))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(ops.swiglu(self.gate_and_up_proj(x)))


class HunyuanRouter(nn.Module):
    def __init__(self, hidden: int, num_experts: int):
        super().__init__()
        self.wg = nn.Linear(hidden, num_experts, bias=False, dtype=torch.float32)  # fp32, as published

    def forward(self, x: torch.Tensor, k: int):  # -> weights [T, k] fp32, indices [T, k] int32
        logits = F.linear(x.float(), self.wg.weight.float())  # [T, E]
        return ops.moe_gating_topk(logits, k, score_func="softmax", renorm=True)


class HunyuanExperts(nn.Module):
    """This rank's experts stacked: w13_weight [E_local, 2I, H] ([activated | linear]), w2_weight [E_local, H, I].
    Checkpoint tensors arrive one per expert with shard_id = global expert index."""

    def __init__(self, hidden: int, intermediate: int, num_experts: int, ep_group=None):
        super().__init__()
        ep = group_size(ep_group)
        if num_experts % ep:
            raise ValueError(f"ep={ep} must divide num_experts={num_experts}")
        self.num_experts, self.num_local = num_experts, num_experts // ep
        self.first = group_rank(ep_group) * self.num_local
        self.w13_weight = nn.Parameter(torch.empty(self.num_local, 2 * intermediate, hidden))
        self.w2_weight = nn.Parameter(torch.empty(self.num_local, hidden, intermediate))
        self.attach_weight_loaders()

    def attach_weight_loaders(self):
        self.loaded: set[tuple[str, int]] = set()  # (kind, expert) filled so far: load_model checks all arrived

        def w13(p, w, e):
            p[e - self.first].copy_(_swap_halves(w))
            self.loaded.add(("gate_and_up_proj", e))

        def w2(p, w, e):
            p[e - self.first].copy_(w)
            self.loaded.add(("down_proj", e))
        self.w13_weight.weight_loader, self.w2_weight.weight_loader = w13, w2

    def owns(self, expert: int) -> bool:
        return self.first <= expert < self.first + self.num_local

    def forward(self, x_sorted: torch.Tensor, tokens_per_expert: torch.Tensor) -> torch.Tensor:
        """x_sorted [M, H] rows grouped by local expert, counts [E_local] -> [M, H]."""
        h = ops.swiglu(ops.grouped_matmul(x_sorted, self.w13_weight, tokens_per_expert))  # [M, I]
        return ops.grouped_matmul(h, self.w2_weight, tokens_per_expert)


class HunyuanMoE(nn.Module):
    """out = shared_mlp(x) + sum_k w_k expert_k(x); softmax top-k router renormalised, no capacity dropping."""

    def __init__(self, cfg: HunyuanImageConfig, ep_group=None):
        super().__init__()
        self.top_k, self.ep_group = cfg.moe_topk, ep_group
        self.gate = HunyuanRouter(cfg.hidden_size, cfg.num_experts)
        self.shared_mlp = HunyuanMLP(cfg.hidden_size, cfg.intermediate_size)
        self.experts = HunyuanExperts(cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts, ep_group)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, H]
        if group_size(self.ep_group) > 1:
            return ep_moe(self, x, self.ep_group)
        weights, indices = self.gate(x, self.top_k)  # [T, k]
        expanded, row_idx, counts = ops.moe_init_routing(x, indices, self.experts.num_experts)  # [T*k, H]
        return ops.moe_finalize_routing(self.experts(expanded, counts), weights, row_idx, self.shared_mlp(x))


class HunyuanDecoderLayer(nn.Module):
    def __init__(self, cfg: HunyuanImageConfig, tp_group=None, ep_group=None):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = HunyuanAttention(cfg, tp_group)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = HunyuanMoE(cfg, ep_group)

    def forward(self, x, meta: ForwardMetadata, k_cache, v_cache):  # x [T, H]
        h = x + self.self_attn(self.input_layernorm(x), meta, k_cache, v_cache)
        return h + self.mlp(self.post_attention_layernorm(h))


class HunyuanModel(nn.Module):
    """`model.*`: wte, the decoder layers, ln_f (text mode only)."""

    def __init__(self, cfg: HunyuanImageConfig, tp_group=None, ep_group=None):
        super().__init__()
        self.wte = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(HunyuanDecoderLayer(cfg, tp_group, ep_group) for _ in range(cfg.num_hidden_layers))
        self.ln_f = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, embeds: torch.Tensor, meta: ForwardMetadata, kv_caches) -> torch.Tensor:
        h = embeds  # [T, H]
        for layer, (k_cache, v_cache) in zip(self.layers, kv_caches):
            h = layer(h, meta, k_cache, v_cache)
        return h  # last hidden states, before ln_f


class HunyuanImage3(nn.Module):
    """The publisher's top level (`HunyuanImage3ForCausalMM` minus the vision encoder): backbone, lm_head, the
    three timestep embedders, patch_embed, final_layer and the VAE."""

    def __init__(self, cfg: HunyuanImageConfig, tp_group=None, ep_group=None, with_vae: bool = True):
        super().__init__()
        self.config = cfg
        H, C = cfg.hidden_size, cfg.vae.latent_channels
        self.model = HunyuanModel(cfg, tp_group, ep_group)
        self.lm_head = nn.Linear(H, cfg.vocab_size, bias=False)
        self.timestep_emb = TimestepEmbedder(H)  # the <timestep> token
        self.time_embed = TimestepEmbedder(H)  # conditions patch_embed
        self.time_embed_2 = TimestepEmbedder(H)  # conditions final_layer
        self.patch_embed = UNetDown(C, H, cfg.patch_embed_hidden_dim, H)
        self.final_layer = UNetUp(H, H, cfg.patch_embed_hidden_dim, C)
        self.vae = AutoencoderKLConv3D(cfg.vae) if with_vae else None

    def text_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Text mode: ln_f then lm_head. [T, H] -> [T, V]"""
        return self.lm_head(self.model.ln_f(hidden))

    def image_embeds(self, input_ids: torch.Tensor, latents: torch.Tensor, t: torch.Tensor, image_rows: torch.Tensor,
                     timestep_rows: torch.Tensor) -> torch.Tensor:
        """wte(ids) with the image slots (raster order) overwritten by patch_embed(latents, time_embed(t)) and the
        <timestep> slots by timestep_emb(t). input_ids [T] packed, latents [B, C, h, w], t [B],
        image_rows [B, h*w], timestep_rows [B] rows of the packed sequence. -> [T, H]"""
        embeds = self.model.wte(input_ids)  # [T, H]
        dtype = embeds.dtype
        embeds[image_rows.flatten()] = self.patch_embed(latents.to(dtype), self.time_embed(t)).flatten(0, 1).to(dtype)
        embeds[timestep_rows] = self.timestep_emb(t).to(dtype)
        return embeds

    def velocity(self, hidden_image: torch.Tensor, t: torch.Tensor, h: int, w: int) -> torch.Tensor:
        """Last hidden states at the image slots [B, h*w, H] (no ln_f) -> flow velocity [B, C, h, w]."""
        return self.final_layer(hidden_image, self.time_embed_2(t).to(hidden_image.dtype), h, w)
