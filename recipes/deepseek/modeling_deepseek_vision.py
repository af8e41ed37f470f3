"""The DeepSeek-V4 vision tower and aligner on common.ops (DeepSeek-V4-Flash-Vision-Exp and V4.1-Flash).

ViT: a linear patch embedding over flattened 14 x 14 RGB patches (no learned position embedding), pre-norm blocks
(RMSNorm, fused qkv with bias, 2D RoPE on q / k, SwiGLU), a final RMSNorm. Several images of different sizes run in
one packed call: token-major, one attention sequence per image (bidirectional inside it, nothing across images).
Aligner: the patch grid zero-padded bottom / right to multiples of r = downsample_ratio, each r x r group unfolded
channel-major (C, kh, kw), then Linear -> exact GELU -> Linear to the LLM width. The LLM sees each image as
[image_start] + ([aligner row] * n_llm_w + [image_newline]) * n_llm_h + [image_end], the three learned vectors.

Parameter names are the publisher's: `vision.patch_embed.proj`, `vision.blocks.{i}.{norm1,attn.wqkv,attn.wo,norm2,
mlp.w1,mlp.w2}`, `vision.norm`, `aligner.w1/w2`, `image_start`, `image_end`, `image_newline`.
P = patches of all images, h x w = one image's patch grid, C = ViT width, D = LLM width, Dh = head_dim.
"""
from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from common import ops
from common.engine.multimodal import EncoderInput, content_hash
from common.loader import Checkpoint, load_weights

VISION_PREFIXES = ("vision.", "aligner.")
SPAN_VECTORS = ("image_start", "image_end", "image_newline")


@dataclass
class VisionArgs:
    """The vision tower's sizes (publisher's `vision_config`) and the LLM width its aligner projects to."""

    num_hidden_layers: int = 32
    hidden_size: int = 1024
    num_attention_heads: int = 16
    intermediate_size: int = 2816
    patch_size: int = 14
    rope_theta: float = 10000.0
    downsample_ratio: int = 3
    out_hidden_size: int = 5120  # the LLM's hidden_size (V4.1-Flash 5120, V4-Flash-Vision-Exp 4096)
    norm_eps: float = 1e-6

    def __post_init__(self):
        for name in ("num_hidden_layers", "hidden_size", "num_attention_heads", "intermediate_size", "patch_size",
                     "downsample_ratio", "out_hidden_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"vision {name} must be >= 1, got {getattr(self, name)}")
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(f"vision hidden_size {self.hidden_size} is not a multiple of num_attention_heads "
                             f"{self.num_attention_heads}")
        if self.head_dim % 4:
            raise ValueError(f"vision head_dim {self.head_dim} must be a multiple of 4 (2D RoPE: two axes, "
                             "half-split rotation)")
        if self.rope_theta <= 0 or self.norm_eps <= 0:
            raise ValueError("vision rope_theta and norm_eps must be > 0")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def patch_dim(self) -> int:
        return 3 * self.patch_size**2

    @classmethod
    def from_config(cls, cfg: dict) -> "VisionArgs":
        """From a checkpoint's config.json: `vision_config` (the publisher's names) and the text hidden size."""
        vision = dict(cfg.get("vision_config") or {})
        if not vision:
            raise ValueError("config.json has no vision_config: the checkpoint has no vision tower")
        text = cfg.get("text_config") or cfg
        vision.setdefault("out_hidden_size", text.get("hidden_size", cls.out_hidden_size))
        if "rms_norm_eps" in vision:
            vision.setdefault("norm_eps", vision["rms_norm_eps"])
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in vision.items() if k in names})


def vision_enabled(cfg: dict) -> bool:
    """Whether a checkpoint's config.json has a vision tower (upstream: vision_config with num_hidden_layers > 0)."""
    return int((cfg.get("vision_config") or {}).get("num_hidden_layers", 0)) > 0


class RMSNorm(nn.Module):
    """RMSNorm with an fp32 weight, fp32 math."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim, dtype=torch.float32))
        self.eps = eps

    def forward(self, x):
        return ops.rms_norm(x, self.weight, self.eps)


def vision_rope(grids: Sequence[tuple[int, int]], head_dim: int, theta: float, device=None):
    """2D RoPE tables for the packed patches of `grids`: (cos, sin) [P, head_dim] fp32 for half-split rotation.

    Per patch at (row, col): angles = [row * inv_freq, col * inv_freq] (head_dim / 2), inv_freq over
    rope_dim = head_dim / 2; the half-split layout repeats them over both halves.
    """
    rope_dim = head_dim // 2
    inv_freq = 1.0 / theta ** (torch.arange(0, rope_dim, 2, dtype=torch.float32, device=device) / rope_dim)
    angles = []
    for h, w in grids:
        rows = torch.arange(h, device=device, dtype=torch.float32).repeat_interleave(w)  # [h*w]
        cols = torch.arange(w, device=device, dtype=torch.float32).repeat(h)  # [h*w]
        angles.append(torch.cat([rows[:, None] * inv_freq, cols[:, None] * inv_freq], dim=-1))  # [h*w, Dh/2]
    angles = torch.cat(angles).repeat(1, 2)  # [P, Dh]
    return angles.cos(), angles.sin()


def cu_seqlens(grids: Sequence[tuple[int, int]], device=None) -> torch.Tensor:
    """[N+1] int32 bounds of each image's patches in the packed rows."""
    lengths = torch.tensor([h * w for h, w in grids], dtype=torch.int32, device=device)
    return F.pad(lengths.cumsum(0, dtype=torch.int32), (1, 0))


class PatchEmbed(nn.Module):
    def __init__(self, args: VisionArgs):
        super().__init__()
        self.proj = nn.Linear(args.patch_dim, args.hidden_size)

    def forward(self, patches: torch.Tensor) -> torch.Tensor:
        return self.proj(patches.flatten(1))  # [P, 3, p, p] -> [P, C], (C, kh, kw) flattened


class Attention(nn.Module):
    """Bidirectional attention inside each image of the packed rows, 2D RoPE on q and k."""

    def __init__(self, args: VisionArgs):
        super().__init__()
        self.n_heads, self.head_dim = args.num_attention_heads, args.head_dim
        self.scale = self.head_dim**-0.5
        self.wqkv = nn.Linear(args.hidden_size, 3 * args.hidden_size)
        self.wo = nn.Linear(args.hidden_size, args.hidden_size)

    def forward(self, x, cos, sin, cu):
        P = x.shape[0]
        q, k, v = self.wqkv(x).view(P, 3, self.n_heads, self.head_dim).unbind(1)  # [P, H, Dh] each
        q = ops.rotary_emb(q, cos, sin, interleaved=False)
        k = ops.rotary_emb(k, cos, sin, interleaved=False)
        out = ops.attention(q, k, v.contiguous(), cu, cu, self.scale, causal=False)  # [P, H, Dh]
        return self.wo(out.reshape(P, -1))


class MLP(nn.Module):
    """SwiGLU: w1 -> [gate | up], silu(gate) * up, w2; no biases."""

    def __init__(self, args: VisionArgs):
        super().__init__()
        self.w1 = nn.Linear(args.hidden_size, 2 * args.intermediate_size, bias=False)
        self.w2 = nn.Linear(args.intermediate_size, args.hidden_size, bias=False)

    def forward(self, x):
        return self.w2(ops.swiglu(self.w1(x)))


class Block(nn.Module):
    def __init__(self, args: VisionArgs):
        super().__init__()
        self.norm1 = RMSNorm(args.hidden_size, args.norm_eps)
        self.attn = Attention(args)
        self.norm2 = RMSNorm(args.hidden_size, args.norm_eps)
        self.mlp = MLP(args)

    def forward(self, x, cos, sin, cu):
        x = x + self.attn(self.norm1(x), cos, sin, cu)
        return x + self.mlp(self.norm2(x))


class ViT(nn.Module):
    """Patches of several images, packed -> final-normed patch features [P, C]."""

    def __init__(self, args: VisionArgs):
        super().__init__()
        self.args = args
        self.patch_embed = PatchEmbed(args)
        self.blocks = nn.ModuleList(Block(args) for _ in range(args.num_hidden_layers))
        self.norm = RMSNorm(args.hidden_size, args.norm_eps)

    def forward(self, patches: torch.Tensor, grids: Sequence[tuple[int, int]]) -> torch.Tensor:
        x = self.patch_embed(patches)  # [P, C]
        cos, sin = vision_rope(grids, self.args.head_dim, self.args.rope_theta, x.device)  # [P, Dh]
        cu = cu_seqlens(grids, x.device)  # [N+1]
        for block in self.blocks:
            x = block(x, cos, sin, cu)
        return self.norm(x)


class Aligner(nn.Module):
    """r x r channel-major merge of the patch grid, then Linear -> GELU -> Linear to the LLM width."""

    def __init__(self, args: VisionArgs):
        super().__init__()
        self.r = args.downsample_ratio
        self.w1 = nn.Linear(args.hidden_size * self.r**2, args.out_hidden_size)
        self.w2 = nn.Linear(args.out_hidden_size, args.out_hidden_size)

    def merge(self, x: torch.Tensor, h: int, w: int) -> torch.Tensor:
        """One image's features [h*w, C] -> [ceil(h/r) * ceil(w/r), C*r*r], groups in reading order."""
        r, C = self.r, x.shape[-1]
        grid = F.pad(x.view(h, w, C).permute(2, 0, 1), (0, -w % r, 0, -h % r))  # [C, H', W'] zero-padded
        h3, w3 = grid.shape[1] // r, grid.shape[2] // r
        groups = grid.view(C, h3, r, w3, r).permute(1, 3, 0, 2, 4)  # [h3, w3, C, r, r]
        return groups.reshape(h3 * w3, C * r * r)

    def forward(self, merged: torch.Tensor) -> torch.Tensor:
        return self.w2(F.gelu(self.w1(merged)))  # [M, C*r*r] -> [M, D]


def llm_grid(grid: tuple[int, int], downsample_ratio: int) -> tuple[int, int]:
    """Patch grid (h, w) -> the aligner's token grid (ceil(h/r), ceil(w/r))."""
    return math.ceil(grid[0] / downsample_ratio), math.ceil(grid[1] / downsample_ratio)


class DeepseekVisionModel(nn.Module):
    """ViT + aligner + the three span vectors; `encode` gives each image's placeholder-span embeddings."""

    def __init__(self, args: VisionArgs):
        super().__init__()
        self.args = args
        self.vision = ViT(args)
        self.aligner = Aligner(args)
        for name in SPAN_VECTORS:
            setattr(self, name, nn.Parameter(torch.zeros(args.out_hidden_size)))

    def _check(self, pixel_values: Sequence[torch.Tensor], grids: Sequence[tuple[int, int]]):
        p = self.args.patch_size
        if len(pixel_values) != len(grids):
            raise ValueError(f"{len(pixel_values)} pixel tensors but {len(grids)} grids")
        for i, (x, (h, w)) in enumerate(zip(pixel_values, grids)):
            if h < 1 or w < 1 or tuple(x.shape) != (h * w, 3, p, p):
                raise ValueError(f"image {i}: pixel_values {tuple(x.shape)} do not match grid {h}x{w} "
                                 f"(expected [{h * w}, 3, {p}, {p}])")

    def image_features(self, pixel_values: Sequence[torch.Tensor], grids: Sequence[tuple[int, int]]) -> list[torch.Tensor]:
        """Aligner outputs per image [ceil(h/r) * ceil(w/r), D], in reading order; all images in one packed call.

        pixel_values[i] [h_i * w_i, 3, p, p]: image i's normalised patches, row-major over its grid (h_i, w_i).
        """
        self._check(pixel_values, grids)
        if not grids:
            return []
        like = self.image_start  # the model's device and dtype (a packed CPU linear has no dense weight to ask)
        patches = torch.cat(list(pixel_values)).to(like.device, like.dtype)  # [P, 3, p, p]
        feats = self.vision(patches, grids).split([h * w for h, w in grids])  # [h*w, C] each
        merged = [self.aligner.merge(f, h, w) for f, (h, w) in zip(feats, grids)]
        tokens = self.aligner(torch.cat(merged))  # [M, D]
        return list(tokens.split([m.shape[0] for m in merged]))

    def encode(self, pixel_values: Sequence[torch.Tensor], grids: Sequence[tuple[int, int]]) -> list[torch.Tensor]:
        """Per image, the embeddings of its whole placeholder span [n_llm_h * (n_llm_w + 1) + 2, D]:
        image_start, each row of aligner outputs followed by image_newline, image_end (the processor's order)."""
        spans = []
        for tokens, grid in zip(self.image_features(pixel_values, grids), grids):
            h3, w3 = llm_grid(grid, self.args.downsample_ratio)
            newline = self.image_newline.to(tokens.dtype).expand(h3, 1, -1)  # [h3, 1, D]
            rows = torch.cat([tokens.view(h3, w3, -1), newline], dim=1).flatten(0, 1)  # [h3*(w3+1), D]
            spans.append(torch.cat([self.image_start.to(tokens.dtype)[None], rows,
                                    self.image_end.to(tokens.dtype)[None]]))
        return spans


class VisionEncoder:
    """The encoder stage the LLM states in its contract (common/engine/model_contract.py EncoderModel): an image ->
    its canvas' patches and span length (the image processor), a batch of them -> their spans' embeddings (one packed
    call of the tower and aligner). An image's identifier hashes its patches and grid."""

    modality = "image"

    def __init__(self, model: DeepseekVisionModel, processor):
        self.model, self.processor = model, processor
        self.placeholder_token_id = processor.image_token_id

    def process(self, item) -> EncoderInput:
        image = self.processor(item)  # ValueError naming what is wrong with it
        return EncoderInput((image.pixel_values, image.grid), image.num_tokens,
                            content_hash(image.pixel_values, *image.grid))

    @torch.inference_mode()
    def encode(self, data: list) -> list[torch.Tensor]:
        pixel_values, grids = zip(*data) if data else ((), ())
        return self.model.encode(list(pixel_values), list(grids))  # [num_tokens_i, D] each


def vision_rename(name: str) -> str | None:
    """Checkpoint name -> parameter name; None for every tensor that is not the vision tower's (the LLM's)."""
    return name if name.startswith(VISION_PREFIXES) or name in SPAN_VECTORS else None


def load_vision_model(path, dtype: torch.dtype = torch.bfloat16, device="cpu") -> DeepseekVisionModel:
    """The vision tower, aligner and span vectors of a publisher-format checkpoint folder; the LLM's tensors are
    never read."""
    ckpt = Checkpoint(path)
    args = VisionArgs.from_config(ckpt.config)
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = DeepseekVisionModel(args)
    finally:
        torch.set_default_dtype(old)
    load_weights(model, ckpt, vision_rename, dtype=dtype)
    model.checkpoint_reads = dict(ckpt.reads)  # what was read of the checkpoint: {stored name: bytes}
    return model.eval()


def random_vision_tensors(args: VisionArgs, seed: int = 0, dtype: torch.dtype = torch.bfloat16) -> dict[str, torch.Tensor]:
    """Random vision tensors under the publisher's names (fixed seed), scaled so attention and the aligner see
    non-trivial activations; for tiny checkpoints."""
    g = torch.Generator().manual_seed(seed)
    with torch.device("meta"):
        shapes = {n: t.shape for n, t in DeepseekVisionModel(args).state_dict().items()}
    tensors = {}
    for name, shape in shapes.items():
        if name.endswith("norm1.weight") or name.endswith("norm2.weight") or name == "vision.norm.weight":
            t = 1 + 0.1 * torch.randn(shape, generator=g)
        elif name.endswith(".weight"):
            t = torch.randn(shape, generator=g) / shape[1] ** 0.5
        else:  # biases and the span vectors
            t = 0.1 * torch.randn(shape, generator=g)
        tensors[name] = t.to(torch.float32 if "norm" in name else dtype)
    return tensors
