"""daVinci-MagiHuman DiT: one stream of [video | audio | text] tokens, jointly denoising video and audio latents.

No timestep input: the model reads the noise level off the latents and predicts a flow velocity v
(x0 = x_t - sigma v). Layers are pre-norm (h += Attn(h); h += MLP(h), residual stream fp32); the first and last
"sandwich" layers (`mm_layers`) have one expert per modality in every linear and norm, the rest are shared.
Attention: GQA with per-modality QK-norm, 9-axis RoPE, non-causal, a per-head sigmoid gate on the output; in the
1080p SR model some layers restrict video queries to a window of latent frames (segments merged by log-sum-exp).
Module and parameter names are the publisher's (`block.layers.{i}.attention.linear_qkv.weight`, ...).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from einops import rearrange
from torch import nn

from common import ops
from config_magihuman import AUDIO, TEXT, VIDEO, MagiHumanConfig
from layers_magihuman import ExpertLinear, ModalityDispatcher, MultiModalityRMSNorm, gelu7, swiglu7
from rope_magihuman import apply_rope, audio_coords, rope_bands, rope_cos_sin, text_coords, video_coords


def patchify(latent: torch.Tensor) -> torch.Tensor:
    """[C, T, h, w] -> tokens [T * h/2 * w/2, C * 4], raster (t, h', w'), feature c*4 + ph*2 + pw (channel-major)."""
    return rearrange(latent, "c t (h ph) (w pw) -> (t h w) (c ph pw)", ph=2, pw=2)


def unpatchify(tokens: torch.Tensor, T: int, H: int, W: int) -> torch.Tensor:
    """tokens [T*H*W, 4 * C] read as (ph pw c), feature (ph*2 + pw)*C + c (channel-minor) -> [C, T, 2H, 2W]."""
    return rearrange(tokens, "(t h w) (ph pw c) -> c t (h ph) (w pw)", t=T, h=H, w=W, ph=2, pw=2)


@dataclass
class LocalWindows:
    """Video queries of latent frame i see video frames [i - n, i + n] (+ all audio and text, merged by LSE)."""
    video_tokens: int
    cu_q: torch.Tensor  # [T + 1] int32, frame boundaries of the video queries
    key_rows: torch.Tensor  # [sum of window lengths] long, video key rows of each frame's window, concatenated
    cu_k: torch.Tensor  # [T + 1] int32, window boundaries in key_rows


@dataclass
class DiTInputs:
    """Everything about a sample's token layout that stays fixed across denoising steps (built once per stage)."""
    grid: tuple[int, int, int]  # video token grid (T, H, W) = (latent frames, h / 2, w / 2)
    audio_len: int
    text_len: int
    dispatcher: ModalityDispatcher
    cos: torch.Tensor  # [N, 6 nb] fp32, original token order
    sin: torch.Tensor
    cu_seqlens: torch.Tensor  # [2] int32: one sample, full attention
    local: LocalWindows | None

    @property
    def video_tokens(self) -> int:
        T, H, W = self.grid
        return T * H * W


def build_inputs(config: MagiHumanConfig, grid: tuple[int, int, int], audio_len: int, text_len: int,
                 device=None) -> DiTInputs:
    T, H, W = grid
    nv = T * H * W
    n = nv + audio_len + text_len
    modality = torch.cat([torch.full((nv,), VIDEO), torch.full((audio_len,), AUDIO), torch.full((text_len,), TEXT)])
    coords = torch.cat([video_coords(T, H, W), audio_coords(audio_len), text_coords(text_len, config.text_rope)])
    cos, sin = rope_cos_sin(coords, rope_bands(config.rope_bands, config.rope_theta))  # [N, 6 nb]
    local = None
    if config.local_attn_layers:
        frames, win = torch.arange(T), config.local_attn_frames
        lo, hi = (frames - win).clamp(min=0), (frames + win + 1).clamp(max=T)  # [T] window [lo, hi) in frames
        key_rows = torch.cat([torch.arange(a * H * W, b * H * W) for a, b in zip(lo.tolist(), hi.tolist())])
        cu_k = F.pad(((hi - lo) * H * W).cumsum(0), (1, 0)).int()
        cu_q = (torch.arange(T + 1) * H * W).int()
        local = LocalWindows(nv, cu_q.to(device), key_rows.to(device), cu_k.to(device))
    return DiTInputs(grid, audio_len, text_len, ModalityDispatcher(modality.to(device)), cos.to(device),
                     sin.to(device), torch.tensor([0, n], dtype=torch.int32, device=device), local)


def local_attention(q, k, v, inp: DiTInputs, scale: float) -> torch.Tensor:
    """Video queries: frame window over video keys, merged by LSE with all audio + text keys; others see all.

    q [N, Hq, D], k / v [N, Hkv, D] in original order -> [N, Hq, D]."""
    lw, n = inp.local, q.shape[0]
    nv = lw.video_tokens
    cu = lambda *b: torch.tensor(b, dtype=torch.int32, device=q.device)  # noqa: E731
    o_win, lse_win = ops.attention(q[:nv], k[lw.key_rows], v[lw.key_rows], lw.cu_q, lw.cu_k, scale, causal=False,
                                   return_lse=True)  # [Nv, Hq, D], [Nv, Hq]
    o_rest, lse_rest = ops.attention(q[:nv], k[nv:], v[nv:], cu(0, nv), cu(0, n - nv), scale, causal=False,
                                     return_lse=True)  # audio + text keys
    o_video, _ = ops.merge_attention_states(o_win, lse_win, o_rest, lse_rest)  # [Nv, Hq, D]
    o_other = ops.attention(q[nv:], k, v, cu(0, n - nv), cu(0, n), scale, causal=False)  # [N - Nv, Hq, D]
    return torch.cat([o_video, o_other])


class Attention(nn.Module):
    def __init__(self, config: MagiHumanConfig, layer: int, dtype=torch.bfloat16):
        super().__init__()
        n = config.num_experts(layer)
        self.config, self.local = config, layer in config.local_attn_layers
        self.hq, self.hkv, self.d = config.num_heads_q, config.num_heads_kv, config.head_dim
        self.gating = int(config.attention_gating)
        self.pre_norm = MultiModalityRMSNorm(config.hidden_size, n, config.eps)
        self.linear_qkv = ExpertLinear(config.hidden_size, config.qkv_size, n, dtype)
        self.q_norm = MultiModalityRMSNorm(config.head_dim, n, config.eps)
        self.k_norm = MultiModalityRMSNorm(config.head_dim, n, config.eps)
        self.linear_proj = ExpertLinear(config.hidden_size, config.hidden_size, n, dtype)

    def forward(self, h: torch.Tensor, inp: DiTInputs) -> torch.Tensor:
        """h [N, hidden] fp32 in modality groups -> attention output [N, hidden] fp32, same order."""
        disp, sizes = inp.dispatcher, inp.dispatcher.group_sizes
        N, dtype = h.shape[0], self.linear_qkv.weight.dtype
        x = self.pre_norm(h, sizes).to(dtype)
        qkv = self.linear_qkv(x, sizes).float()  # [N, qkv_size]
        q, k, v, g = qkv.split([self.hq * self.d, self.hkv * self.d, self.hkv * self.d, self.hq * self.gating], -1)
        q = self.q_norm(q.view(N, self.hq, self.d), sizes)  # [N, Hq, D] fp32
        k = self.k_norm(k.view(N, self.hkv, self.d), sizes)  # [N, Hkv, D]
        v = v.view(N, self.hkv, self.d)
        q, k, v = disp.undispatch(q), disp.undispatch(k), disp.undispatch(v)  # original order for RoPE / attention
        q, k = apply_rope(q, inp.cos, inp.sin), apply_rope(k, inp.cos, inp.sin)
        q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
        scale = self.d ** -0.5
        if self.local:
            o = local_attention(q, k, v, inp, scale)
        else:
            o = ops.attention(q, k, v, inp.cu_seqlens, inp.cu_seqlens, scale, causal=False)  # [N, Hq, D]
        o = disp.dispatch(o).float()  # [N, Hq, D], modality groups
        if self.gating:
            o = o * torch.sigmoid(g)[..., None]  # per-head gate g [N, Hq]
        return self.linear_proj(o.flatten(1).to(dtype), sizes).float()  # [N, hidden]


class MLP(nn.Module):
    def __init__(self, config: MagiHumanConfig, layer: int, dtype=torch.bfloat16):
        super().__init__()
        n = config.num_experts(layer)
        self.gelu = layer in config.gelu7_layers
        inter = config.gelu7_intermediate if self.gelu else config.swiglu_intermediate
        self.pre_norm = MultiModalityRMSNorm(config.hidden_size, n, config.eps)
        self.up_gate_proj = ExpertLinear(config.hidden_size, inter if self.gelu else 2 * inter, n, dtype)
        self.down_proj = ExpertLinear(inter, config.hidden_size, n, dtype)

    def forward(self, h: torch.Tensor, inp: DiTInputs) -> torch.Tensor:
        sizes, dtype = inp.dispatcher.group_sizes, self.up_gate_proj.weight.dtype
        u = self.up_gate_proj(self.pre_norm(h, sizes).to(dtype), sizes).float()  # [N, I or 2I]
        a = gelu7(u) if self.gelu else swiglu7(u)  # [N, I]
        return self.down_proj(a.to(dtype), sizes).float()  # [N, hidden]


class TransformerLayer(nn.Module):
    def __init__(self, config: MagiHumanConfig, layer: int, dtype=torch.bfloat16):
        super().__init__()
        self.attention = Attention(config, layer, dtype)
        self.mlp = MLP(config, layer, dtype)

    def forward(self, h: torch.Tensor, inp: DiTInputs) -> torch.Tensor:
        h = h + self.attention(h, inp)
        return h + self.mlp(h, inp)


class Block(nn.Module):
    def __init__(self, config: MagiHumanConfig, dtype=torch.bfloat16):
        super().__init__()
        self.layers = nn.ModuleList(TransformerLayer(config, i, dtype) for i in range(config.num_layers))


class Rope(nn.Module):
    def __init__(self, config: MagiHumanConfig):
        super().__init__()
        self.register_buffer("bands", rope_bands(config.rope_bands, config.rope_theta))  # [nb]
        self.bands.optional = True  # the publisher's checkpoints may leave it out


class Adapter(nn.Module):
    """fp32 embedders with bias, one per modality; the RoPE bands buffer."""

    def __init__(self, config: MagiHumanConfig):
        super().__init__()
        hidden = config.hidden_size
        self.video_embedder = nn.Linear(config.video_in_channels, hidden)
        self.text_embedder = nn.Linear(config.text_in_channels, hidden)
        self.audio_embedder = nn.Linear(config.audio_in_channels, hidden)
        self.rope = Rope(config)


class MagiHumanDiT(nn.Module):
    def __init__(self, config: MagiHumanConfig, dtype=torch.bfloat16):
        super().__init__()
        self.config = config
        self.adapter = Adapter(config)
        self.block = Block(config, dtype)
        self.final_norm_video = MultiModalityRMSNorm(config.hidden_size, 1, config.eps)
        self.final_norm_audio = MultiModalityRMSNorm(config.hidden_size, 1, config.eps)
        # the heads stay fp32, as the embedders (the publisher's module tree)
        self.final_linear_video = nn.Linear(config.hidden_size, config.video_in_channels, bias=False)
        self.final_linear_audio = nn.Linear(config.hidden_size, config.audio_in_channels, bias=False)
        self.requires_grad_(False)

    def forward(self, video: torch.Tensor, audio: torch.Tensor, text: torch.Tensor, inp: DiTInputs):
        """video tokens [Nv, 192], audio [A, 64], text [L, text_in] (fp32) -> velocities (video [Nv, 192], audio
        [A, 64]) fp32."""
        a = self.adapter
        x = torch.cat([a.video_embedder(video.float()), a.audio_embedder(audio.float()),
                       a.text_embedder(text.float())])  # [N, hidden] fp32, original order
        x = inp.dispatcher.dispatch(x)
        for layer in self.block.layers:
            x = layer(x, inp)
        x = inp.dispatcher.undispatch(x)
        nv, na = inp.video_tokens, inp.audio_len
        one = torch.tensor([x.shape[0]], device=x.device)  # single expert: one group
        v = self.final_linear_video(self.final_norm_video(x[:nv], one))  # [Nv, 192] fp32
        au = self.final_linear_audio(self.final_norm_audio(x[nv:nv + na], one))  # [A, 64] fp32
        return v, au

    def velocity(self, video_latent: torch.Tensor, audio_latent: torch.Tensor, text: torch.Tensor,
                 inp: DiTInputs) -> tuple[torch.Tensor, torch.Tensor]:
        """Latent layout in and out: video [48, T, h, w], audio [A, 64], text [L, text_in]."""
        T, H, W = inp.grid
        v, a = self(patchify(video_latent), audio_latent, text, inp)
        return unpatchify(v, T, H, W), a
