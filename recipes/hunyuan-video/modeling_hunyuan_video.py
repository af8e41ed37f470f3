"""The HunyuanVideo DiT (HYVideo-T/2) on common.ops, with the publisher's parameter names.

Video latents [B, C, T, H, W] -> Conv3d patches [B, N, hidden] (N = T/pt * H/ph * W/pw); text states [B, L, 4096]
-> token refiner (2 blocks of masked self attention with adaLN gates) -> [B, L, hidden]. The conditioning vector
vec [B, hidden] = timestep embedding + pooled CLIP projection + guidance embedding (cfg-distilled checkpoints).
Then dual-stream blocks (separate img / txt weights, joint attention), single-stream blocks (one fused linear for
qkv + MLP-in over [img; txt]), the final adaLN layer and unpatchify -> velocity [B, C, T, H, W].

Attention is joint over [video tokens; the row's real text tokens] (common.diffusion.sequence_parallel, which is
common.ops.attention on one rank): right-padded text tokens are never attended, so padding does not change the
video output. 3D RoPE (t, h, w dims rope_dim_list, theta 256, interleaved pairs) on video q / k only; RMS QK-norm.

Sequence parallel (sp_group): the video tokens are sharded over the ranks (zero-padded to a multiple of P, the
padding left out of attention), the text is replicated; the output is gathered, so every rank returns the whole
velocity. sp_mode: "ulysses", "ring", or a UlyssesRing (the sp group factored as Ulysses x ring sub-groups).
Step caches (common.diffusion.step_cache) wrap the block stack: head = double block 0, tail = the rest,
TeaCache's judge = the modulated input of double block 0.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from config_hunyuan_video import REFINER_DEPTH, REFINER_MLP_RATIO, HunyuanVideoConfig
from torch import nn

from common import ops
from common.diffusion.sequence_parallel import (
    UlyssesRing,
    masked_attention,
    ring_attention,
    ulysses_attention,
)
from common.diffusion.step_cache import StepCache
from common.parallel import all_gather, group_rank, group_size

SP_MODES = ("ulysses", "ring")
NORM_EPS = 1e-6


def timestep_embedding(t: torch.Tensor, dim: int = 256, max_period: float = 10000.0) -> torch.Tensor:
    """Sinusoidal embedding [B, dim] (cos half first) of t [B], in fp32."""
    half = dim // 2
    freqs = torch.exp(-math.log(max_period) * torch.arange(half, dtype=torch.float32, device=t.device) / half)
    args = t.float()[:, None] * freqs[None]  # [B, half]
    return torch.cat([torch.cos(args), torch.sin(args)], dim=-1)


def rope_3d(cfg: HunyuanVideoConfig, grid: tuple[int, int, int], device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [N, head_dim] for the t-major token grid (t, h, w), each axis i on rope_dim_list[i] channels,
    frequencies theta^(-2j/d), pairs interleaved ([c0, c0, c1, c1, ..]) as the publisher's use_real tables."""
    axes = torch.meshgrid(*(torch.arange(n, dtype=torch.float32, device=device) for n in grid), indexing="ij")
    cos, sin = [], []
    for pos, dim in zip(axes, cfg.rope_dim_list):
        freqs = 1.0 / cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float32, device=device) / dim)
        angles = torch.outer(pos.reshape(-1), freqs)  # [N, dim / 2]
        cos.append(angles.cos().repeat_interleave(2, dim=1))
        sin.append(angles.sin().repeat_interleave(2, dim=1))
    return torch.cat(cos, dim=1), torch.cat(sin, dim=1)  # [N, head_dim] each


def modulate(x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x [B, S, C] * (1 + scale) + shift, shift / scale [B, C]."""
    return torch.addcmul(shift[:, None], x, 1 + scale[:, None])


def layer_norm(x: torch.Tensor) -> torch.Tensor:
    """LayerNorm without affine parameters (eps 1e-6), as every modulated norm here."""
    return F.layer_norm(x, x.shape[-1:], eps=NORM_EPS)


@dataclass
class AttentionContext:
    """What every block's joint attention needs, computed once per forward.

    cos / sin [B * n, head_dim]: RoPE of this rank's video rows, batch-major; txt_mask [B, L] bool (True = real
    token, None = all real); seq_len: the real video token count when the sharded sequence was padded, else None.
    """
    cos: torch.Tensor
    sin: torch.Tensor
    txt_mask: torch.Tensor | None
    scale: float
    sp_group: dist.ProcessGroup | None = None
    sp_mode: str | UlyssesRing = "ulysses"
    seq_len: int | None = None

    def rope(self, x: torch.Tensor) -> torch.Tensor:
        """x [B, n, H, D] -> RoPE'd, same shape."""
        return ops.rotary_emb(x.flatten(0, 1), self.cos, self.sin, interleaved=True).view_as(x)

    def attend(self, q, k, v, n: int) -> torch.Tensor:
        """Joint attention over [video; text]: q / k / v [B, n + L, H, D], the first n rows this rank's video
        tokens (RoPE applied here) -> [B, n + L, H*D]."""
        if self.sp_group is None or group_size(self.sp_group) == 1:
            q, k = q.clone(), k.clone()  # [B, n + L, H, D]; RoPE in place on the video rows, text rows as they are
            q[:, :n], k[:, :n] = self.rope(q[:, :n]), self.rope(k[:, :n])
            mask = None  # one rank: no video padding
            if self.txt_mask is not None:
                mask = torch.cat([self.txt_mask.new_ones(q.shape[0], n), self.txt_mask], dim=1)  # [B, n + L]
            return masked_attention(q, k, v, self.scale, q_mask=mask, k_mask=mask).flatten(2)
        fn, group, extra = ulysses_attention, self.sp_group, {}
        if isinstance(self.sp_mode, UlyssesRing):  # Ulysses inside the block, ring across the blocks
            group, extra = self.sp_mode.ulysses, {"ring_group": self.sp_mode.ring}
        elif self.sp_mode == "ring":
            fn = ring_attention
        img, txt = fn(self.rope(q[:, :n]), self.rope(k[:, :n]), v[:, :n], group, self.scale,
                      joint_q=q[:, n:], joint_k=k[:, n:], joint_v=v[:, n:], joint_mask=self.txt_mask,
                      seq_len=self.seq_len, **extra)  # [B, n, H, D], [B, L, H, D]
        return torch.cat([img, txt], dim=1).flatten(2)


class RMSNorm(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ops.rms_norm(x, self.weight, NORM_EPS)


def qk_norm(cfg: HunyuanVideoConfig) -> nn.Module:
    return RMSNorm(cfg.head_dim) if cfg.qk_norm else nn.Identity()


class MLP(nn.Module):
    """fc1 -> act -> fc2 (the publisher's MLP)."""

    def __init__(self, dim: int, hidden: int, act: str):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(dim, hidden), nn.Linear(hidden, dim)
        self.act = act

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc1(x)
        h = F.gelu(h, approximate="tanh") if self.act == "gelu_tanh" else F.silu(h)
        return self.fc2(h)


class TimestepEmbedder(nn.Module):
    """Sinusoid (256) -> Linear -> SiLU -> Linear; `mlp.0` / `mlp.2` as the publisher's nn.Sequential."""

    def __init__(self, hidden: int, frequency_dim: int = 256):
        super().__init__()
        self.frequency_dim = frequency_dim
        self.mlp = nn.Sequential(nn.Linear(frequency_dim, hidden), nn.SiLU(), nn.Linear(hidden, hidden))

    def forward(self, t: torch.Tensor) -> torch.Tensor:
        return self.mlp(timestep_embedding(t, self.frequency_dim).to(self.mlp[0].weight.dtype))  # [B, hidden]


class MLPEmbedder(nn.Module):
    """Pooled CLIP text [B, 768] -> [B, hidden]: in_layer -> SiLU -> out_layer."""

    def __init__(self, in_dim: int, hidden: int):
        super().__init__()
        self.in_layer, self.out_layer = nn.Linear(in_dim, hidden), nn.Linear(hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out_layer(F.silu(self.in_layer(x)))


class TextProjection(nn.Module):
    def __init__(self, in_dim: int, hidden: int):
        super().__init__()
        self.linear_1, self.linear_2 = nn.Linear(in_dim, hidden), nn.Linear(hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_2(F.silu(self.linear_1(x)))


class ModulateDiT(nn.Module):
    """vec [B, C] -> SiLU -> linear -> `factor` chunks [B, C] (shift, scale, gate, ...)."""

    def __init__(self, hidden: int, factor: int):
        super().__init__()
        self.factor = factor
        self.linear = nn.Linear(hidden, factor * hidden)

    def forward(self, vec: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return self.linear(F.silu(vec)).chunk(self.factor, dim=-1)


class IndividualTokenRefinerBlock(nn.Module):
    """Pre-LN self attention over the real text tokens + SiLU MLP, each gated by adaLN from c."""

    def __init__(self, hidden: int, heads: int):
        super().__init__()
        self.heads = heads
        self.norm1 = nn.LayerNorm(hidden, eps=NORM_EPS)
        self.self_attn_qkv = nn.Linear(hidden, 3 * hidden)
        self.self_attn_proj = nn.Linear(hidden, hidden)
        self.norm2 = nn.LayerNorm(hidden, eps=NORM_EPS)
        self.mlp = MLP(hidden, int(hidden * REFINER_MLP_RATIO), "silu")
        self.adaLN_modulation = nn.Sequential(nn.SiLU(), nn.Linear(hidden, 2 * hidden))

    def forward(self, x: torch.Tensor, c: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        gate_msa, gate_mlp = self.adaLN_modulation(c).chunk(2, dim=-1)  # [B, C] each
        qkv = self.self_attn_qkv(self.norm1(x)).unflatten(-1, (3, self.heads, -1))  # [B, L, 3, H, D]
        q, k, v = qkv.unbind(2)
        attn = masked_attention(q, k, v, q.shape[-1] ** -0.5, q_mask=mask, k_mask=mask)  # [B, L, H, D], pads 0
        x = x + self.self_attn_proj(attn.flatten(2)) * gate_msa[:, None]
        return x + self.mlp(self.norm2(x)) * gate_mlp[:, None]


class IndividualTokenRefiner(nn.Module):
    def __init__(self, hidden: int, heads: int, depth: int):
        super().__init__()
        self.blocks = nn.ModuleList(IndividualTokenRefinerBlock(hidden, heads) for _ in range(depth))

    def forward(self, x, c, mask):
        for block in self.blocks:
            x = block(x, c, mask)
        return x


class SingleTokenRefiner(nn.Module):
    """txt_in: text states [B, L, text_states_dim] + timestep -> refined text tokens [B, L, hidden]."""

    def __init__(self, cfg: HunyuanVideoConfig):
        super().__init__()
        self.input_embedder = nn.Linear(cfg.text_states_dim, cfg.hidden_size)
        self.t_embedder = TimestepEmbedder(cfg.hidden_size)
        self.c_embedder = TextProjection(cfg.text_states_dim, cfg.hidden_size)
        self.individual_token_refiner = IndividualTokenRefiner(cfg.hidden_size, cfg.heads_num, REFINER_DEPTH)

    def forward(self, x: torch.Tensor, t: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        if mask is None:
            pooled = x.mean(dim=1)
        else:
            m = mask.float()[..., None]  # [B, L, 1]
            pooled = ((x.float() * m).sum(dim=1) / m.sum(dim=1)).to(x.dtype)  # mean of the real tokens [B, Ct]
        c = self.t_embedder(t) + self.c_embedder(pooled)  # [B, hidden]
        return self.individual_token_refiner(self.input_embedder(x), c, mask)


class MMDoubleStreamBlock(nn.Module):
    """img and txt keep their own modulation, qkv, QK-norm, projection and MLP; attention is joint."""

    def __init__(self, cfg: HunyuanVideoConfig):
        super().__init__()
        C, self.heads = cfg.hidden_size, cfg.heads_num
        for side in ("img", "txt"):
            self.add_module(f"{side}_mod", ModulateDiT(C, 6))
            self.add_module(f"{side}_attn_qkv", nn.Linear(C, 3 * C, bias=cfg.qkv_bias))
            self.add_module(f"{side}_attn_q_norm", qk_norm(cfg))
            self.add_module(f"{side}_attn_k_norm", qk_norm(cfg))
            self.add_module(f"{side}_attn_proj", nn.Linear(C, C, bias=cfg.qkv_bias))
            self.add_module(f"{side}_mlp", MLP(C, cfg.mlp_hidden_dim, cfg.mlp_act_type))

    def modulated_img(self, img: torch.Tensor, vec: torch.Tensor) -> torch.Tensor:
        """The attention input of the img stream [B, n, C] (TeaCache's judge for block 0)."""
        shift, scale = self.img_mod(vec)[:2]
        return modulate(layer_norm(img), shift, scale)

    def _qkv(self, side: str, x: torch.Tensor, shift, scale):
        qkv = getattr(self, f"{side}_attn_qkv")(modulate(layer_norm(x), shift, scale))
        q, k, v = qkv.unflatten(-1, (3, self.heads, -1)).unbind(2)  # [B, S, H, D] each
        return getattr(self, f"{side}_attn_q_norm")(q), getattr(self, f"{side}_attn_k_norm")(k), v

    def forward(self, img, txt, vec, ctx: AttentionContext):
        img_mod, txt_mod = self.img_mod(vec), self.txt_mod(vec)  # 6 x [B, C]: shift, scale, gate (attn, mlp)
        n = img.shape[1]
        q, k, v = (torch.cat(pair, dim=1) for pair in zip(self._qkv("img", img, *img_mod[:2]),
                                                          self._qkv("txt", txt, *txt_mod[:2])))  # [B, n + L, H, D]
        attn = ctx.attend(q, k, v, n)  # [B, n + L, C]
        img_attn, txt_attn = attn[:, :n], attn[:, n:]
        img = torch.addcmul(img, self.img_attn_proj(img_attn), img_mod[2][:, None])
        img = torch.addcmul(img, self.img_mlp(modulate(layer_norm(img), *img_mod[3:5])), img_mod[5][:, None])
        txt = torch.addcmul(txt, self.txt_attn_proj(txt_attn), txt_mod[2][:, None])
        txt = torch.addcmul(txt, self.txt_mlp(modulate(layer_norm(txt), *txt_mod[3:5])), txt_mod[5][:, None])
        return img, txt


class MMSingleStreamBlock(nn.Module):
    """One stream over [img; txt]: linear1 = fused qkv + MLP-in, linear2 = fused out-proj + MLP-out."""

    def __init__(self, cfg: HunyuanVideoConfig):
        super().__init__()
        C, self.heads, self.mlp_dim = cfg.hidden_size, cfg.heads_num, cfg.mlp_hidden_dim
        self.linear1 = nn.Linear(C, 3 * C + self.mlp_dim)
        self.linear2 = nn.Linear(C + self.mlp_dim, C)
        self.q_norm, self.k_norm = qk_norm(cfg), qk_norm(cfg)
        self.modulation = ModulateDiT(C, 3)

    def forward(self, x, n: int, vec, ctx: AttentionContext):
        """x [B, n + L, C] = [video rows; text rows] -> the same."""
        shift, scale, gate = self.modulation(vec)
        qkv, mlp = self.linear1(modulate(layer_norm(x), shift, scale)).split([3 * x.shape[-1], self.mlp_dim], -1)
        q, k, v = qkv.unflatten(-1, (3, self.heads, -1)).unbind(2)  # [B, n + L, H, D]
        attn = ctx.attend(self.q_norm(q), self.k_norm(k), v, n)  # [B, n + L, C]
        return torch.addcmul(x, self.linear2(torch.cat([attn, F.gelu(mlp, approximate="tanh")], dim=-1)),
                             gate[:, None])


class FinalLayer(nn.Module):
    def __init__(self, cfg: HunyuanVideoConfig):
        super().__init__()
        C = cfg.hidden_size
        self.linear = nn.Linear(C, math.prod(cfg.patch_size) * cfg.out_channels)
        self.adaLN_modulation = nn.Sequential(nn.SiLU(), nn.Linear(C, 2 * C))

    def forward(self, x: torch.Tensor, vec: torch.Tensor) -> torch.Tensor:
        shift, scale = self.adaLN_modulation(vec).chunk(2, dim=-1)
        return self.linear(modulate(layer_norm(x), shift, scale))  # [B, n, pt*ph*pw*C_out]


class PatchEmbed(nn.Module):
    def __init__(self, cfg: HunyuanVideoConfig):
        super().__init__()
        self.proj = nn.Conv3d(cfg.in_channels, cfg.hidden_size, kernel_size=cfg.patch_size, stride=cfg.patch_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """[B, Cin, T, H, W] -> [B, t*h*w, C]: the strided Conv3d as one GEMM over the patches (CPU convolution
        kernels are slow on this shape; same math)."""
        (B, Cin, T, H, W), (pt, ph, pw) = x.shape, self.proj.kernel_size
        patches = x.view(B, Cin, T // pt, pt, H // ph, ph, W // pw, pw).permute(0, 2, 4, 6, 1, 3, 5, 7)
        patches = patches.reshape(B, -1, Cin * pt * ph * pw)  # [B, N, Cin*pt*ph*pw], the weight's flatten order
        return F.linear(patches, self.proj.weight.flatten(1), self.proj.bias)


class HunyuanVideoTransformer3D(nn.Module):
    """HYVideoDiffusionTransformer; forward mirrors diffusers' HunyuanVideoTransformer3DModel."""

    def __init__(self, cfg: HunyuanVideoConfig):
        super().__init__()
        self.config = cfg
        C = cfg.hidden_size
        self.img_in = PatchEmbed(cfg)
        self.txt_in = SingleTokenRefiner(cfg)
        self.time_in = TimestepEmbedder(C)
        self.vector_in = MLPEmbedder(cfg.text_states_dim_2, C)
        self.guidance_in = TimestepEmbedder(C) if cfg.guidance_embed else None
        self.double_blocks = nn.ModuleList(MMDoubleStreamBlock(cfg) for _ in range(cfg.mm_double_blocks_depth))
        self.single_blocks = nn.ModuleList(MMSingleStreamBlock(cfg) for _ in range(cfg.mm_single_blocks_depth))
        self.final_layer = FinalLayer(cfg)

    def _check(self, hidden_states, encoder_hidden_states, encoder_attention_mask, pooled_projections, guidance,
               sp_mode):
        cfg, (B, C, T, H, W) = self.config, hidden_states.shape
        if C != cfg.in_channels or any(n % p for n, p in zip((T, H, W), cfg.patch_size)):
            raise ValueError(f"hidden_states {tuple(hidden_states.shape)}: expected [B, {cfg.in_channels}, T, H, W] "
                             f"with T, H, W multiples of patch_size {cfg.patch_size}")
        if encoder_hidden_states.shape[::2] != (B, cfg.text_states_dim):
            raise ValueError(f"encoder_hidden_states {tuple(encoder_hidden_states.shape)}: expected "
                             f"[{B}, L, {cfg.text_states_dim}]")
        if encoder_attention_mask is not None and not bool((encoder_attention_mask.sum(1) > 0).all()):
            raise ValueError("encoder_attention_mask: every row needs at least one real text token")
        if tuple(pooled_projections.shape) != (B, cfg.text_states_dim_2):
            raise ValueError(f"pooled_projections {tuple(pooled_projections.shape)}: expected "
                             f"[{B}, {cfg.text_states_dim_2}]")
        if cfg.guidance_embed and guidance is None:
            raise ValueError("this checkpoint is guidance-distilled: pass guidance (embedded scale x 1000)")
        if not isinstance(sp_mode, UlyssesRing) and sp_mode not in SP_MODES:
            raise ValueError(f"sp_mode {sp_mode!r}: expected one of {SP_MODES} or a UlyssesRing")

    def forward(self, hidden_states: torch.Tensor, timestep: torch.Tensor, encoder_hidden_states: torch.Tensor,
                encoder_attention_mask: torch.Tensor | None, pooled_projections: torch.Tensor,
                guidance: torch.Tensor | None = None, *, step: int = 0, step_cache: StepCache | None = None,
                sp_group: dist.ProcessGroup | None = None, sp_mode: str | UlyssesRing = "ulysses") -> torch.Tensor:
        """hidden_states [B, C, T, H, W], timestep [B] (0..1000), encoder_hidden_states [B, L, Ct],
        encoder_attention_mask [B, L] (1 = real token; any pattern, usually right padding), pooled_projections [B, Cp],
        guidance [B] (embedded guidance scale x 1000) -> velocity [B, C_out, T, H, W]."""
        self._check(hidden_states, encoder_hidden_states, encoder_attention_mask, pooled_projections, guidance,
                    sp_mode)
        cfg, (B, _, T, H, W) = self.config, hidden_states.shape
        grid = tuple(n // p for n, p in zip((T, H, W), cfg.patch_size))
        dtype = self.img_in.proj.weight.dtype
        timestep = timestep.expand(B) if timestep.numel() == 1 else timestep

        vec = self.time_in(timestep) + self.vector_in(pooled_projections.to(dtype))  # [B, C]
        if self.guidance_in is not None:
            vec = vec + self.guidance_in(guidance.expand(B) if guidance.numel() == 1 else guidance)
        mask = None
        if encoder_attention_mask is not None:  # drop the padding after every row's last real token: never attended
            mask = encoder_attention_mask.bool()
            positions = torch.arange(1, mask.shape[1] + 1, device=mask.device)
            keep = int((mask * positions).max())
            encoder_hidden_states, mask = encoder_hidden_states[:, :keep], mask[:, :keep]  # [B, L', Ct], [B, L']
            mask = None if bool(mask.all()) else mask
        txt = self.txt_in(encoder_hidden_states.to(dtype), timestep, mask)  # [B, L', C]
        img = self.img_in(hidden_states.to(dtype))  # [B, N, C]

        N, P, r = img.shape[1], group_size(sp_group), group_rank(sp_group)
        n = -(-N // P)  # video rows per rank
        cos, sin = rope_3d(cfg, grid, img.device)  # [N, D]
        if n * P != N:  # pad the video tokens to a multiple of P; padding is left out of attention
            img, cos, sin = (F.pad(t, (0, 0, 0, n * P - N)) for t in (img, cos, sin))
        img, cos, sin = img[:, r * n:(r + 1) * n], cos[r * n:(r + 1) * n], sin[r * n:(r + 1) * n]  # this rank's rows
        ctx = AttentionContext(cos.repeat(B, 1), sin.repeat(B, 1), mask, cfg.head_dim ** -0.5, sp_group, sp_mode,
                               seq_len=N if n * P != N else None)
        pad_rows = None if n * P == N else (torch.arange(r * n, (r + 1) * n, device=img.device) >= N)[:, None]

        first, rest = self.double_blocks[0], list(self.double_blocks[1:])

        def head(state):
            img_, txt_ = first(*state, vec, ctx)
            if pad_rows is not None:  # keep padded rows at 0, so they add nothing to a cache's judge
                img_ = img_.masked_fill(pad_rows, 0.0)
            return img_, txt_

        def tail(state):
            for block in rest:
                state = block(*state, vec, ctx)
            if not self.single_blocks:
                return state
            n, x = state[0].shape[1], torch.cat(state, dim=1)  # [B, n + L, C]: one stream
            for block in self.single_blocks:
                x = block(x, n, vec, ctx)
            return x[:, :n], x[:, n:]

        if step_cache is None:
            img, txt = tail(head((img, txt)))
        else:
            judge = None
            if not step_cache.policy.needs_head:
                judge = first.modulated_img(img, vec)  # [B, n, C]
                judge = judge if pad_rows is None else judge.masked_fill(pad_rows, 0.0)
            img, txt = step_cache.run(step, (img, txt), head=head, tail=tail, judge=judge)

        out = self.final_layer(img, vec)  # [B, n, pt*ph*pw*C_out]
        out = all_gather(out, sp_group, dim=1)[:, :N]  # [B, N, pt*ph*pw*C_out]
        return self.unpatchify(out, grid)

    def unpatchify(self, x: torch.Tensor, grid: tuple[int, int, int]) -> torch.Tensor:
        """[B, t*h*w, pt*ph*pw*C] -> [B, C, t*pt, h*ph, w*pw] (channel-major inside a patch, as the publisher's)."""
        (t, h, w), (pt, ph, pw), C = grid, self.config.patch_size, self.config.out_channels
        x = x.reshape(x.shape[0], t, h, w, C, pt, ph, pw)
        return x.permute(0, 4, 1, 5, 2, 6, 3, 7).reshape(x.shape[0], C, t * pt, h * ph, w * pw)
