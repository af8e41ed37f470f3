"""Text-to-image with HunyuanImage-3.0: sequence, denoising loop with text-prefix KV reuse, CFG, VAE decode.

Step 0 runs the whole sequence and fills the paged KV cache; every later step feeds only `<timestep>` and the image
tokens (1 + h*w), overwrites their K/V and attends to the cached prefix. With the mask of the model (text causal,
the image block bidirectional, nothing before it sees it) the prefix K/V never change, so this equals recomputing
the full sequence every step. CFG: the batch is [cond ; uncond] (guidance > 1); with a `cfg` group of two ranks
each rank runs one of them and the predictions are all-gathered before the guidance combine.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import torch
from tqdm import tqdm

from common.kv_cache import BlockPool
from common.parallel import all_gather, group_rank, group_size
from modeling_hunyuan_image import AttentionGroup, ForwardMetadata, HunyuanImage3
from scheduler_hunyuan_image import make_scheduler
from sequence_hunyuan_image import (
    ImageSequence,
    build_sequence,
    full_metadata,
    ratio_prompt,
    resolution_buckets,
    reuse_metadata,
    reuse_positions,
    rope_cos_sin,
    rope_positions,
    snap_resolution,
    text_metadata,
)

DEFAULT_RATIO = 16  # 1:1, used when `auto` predicts something that is not a ratio token


class PagedKVCache:
    """Per-layer K / V pages [num_blocks, block_size, Hkv_local, D] and one block table per sequence (blocks from
    common.kv_cache.BlockPool; block 0 is its null block)."""

    def __init__(self, model: HunyuanImage3, num_seqs: int, seq_len: int, block_size: int = 16):
        attn = model.model.layers[0].self_attn
        per_seq = math.ceil(seq_len / block_size)
        pool = BlockPool(num_seqs * per_seq + 1, enable_prefix_caching=False)
        self.block_size = block_size
        self.block_tables = torch.tensor([pool.allocate(per_seq) for _ in range(num_seqs)], dtype=torch.int32)
        weight = model.model.wte.weight
        self.block_tables = self.block_tables.to(weight.device)
        shape = (pool.num_blocks, block_size, attn.kv_heads, attn.head_dim)
        self.layers = [(weight.new_zeros(shape), weight.new_zeros(shape)) for _ in model.model.layers]


class ImageDenoiser:
    """One generation's sequence, cache and per-step metadata; velocity() is one transformer step."""

    def __init__(self, model: HunyuanImage3, seq: ImageSequence, block_size: int = 16):
        self.model, self.seq = model, seq
        B, L, hw = seq.input_ids.shape[0], seq.length, seq.h * seq.w
        self.cache = PagedKVCache(model, B, L, block_size)
        pos = rope_positions(L, seq.image_start, seq.h, seq.w)
        cos, sin = rope_cos_sin(pos, model.config.head_dim, model.config.rope_theta)  # [L, D]
        bt, dev = self.cache.block_tables.cpu(), model.model.wte.weight.device
        self.full = to_device(full_metadata(seq, bt, block_size, cos, sin), dev)
        self.reuse = to_device(reuse_metadata(seq, bt, block_size, cos, sin), dev)
        offsets = torch.arange(B)[:, None]
        self.full_ids = seq.input_ids.flatten().to(dev)  # [B*L]
        self.full_image_rows = (offsets * L + torch.arange(seq.image_start, seq.image_end)).to(dev)  # [B, hw]
        self.full_timestep_rows = (offsets[:, 0] * L + seq.timestep_pos).to(dev)  # [B]
        self.reuse_ids = seq.input_ids[:, reuse_positions(seq)].flatten().to(dev)  # [B*(1+hw)]
        self.reuse_image_rows = (offsets * (1 + hw) + torch.arange(1, 1 + hw)).to(dev)
        self.reuse_timestep_rows = (offsets[:, 0] * (1 + hw)).to(dev)
        self.filled = False

    @torch.no_grad()
    def velocity(self, latents: torch.Tensor, t: torch.Tensor, reuse: bool = True) -> torch.Tensor:
        """latents [B, C, h, w], t [B] (sigma * 1000) -> velocity [B, C, h, w]. reuse: only <timestep> + image
        tokens against the cached prefix (after one full step has filled it)."""
        if reuse and self.filled:
            ids, meta = self.reuse_ids, self.reuse
            image_rows, timestep_rows = self.reuse_image_rows, self.reuse_timestep_rows
        else:
            ids, meta = self.full_ids, self.full
            image_rows, timestep_rows = self.full_image_rows, self.full_timestep_rows
        m = self.model
        embeds = m.image_embeds(ids, latents, t, image_rows, timestep_rows)  # [T, H]
        hidden = m.model(embeds, meta, self.cache.layers)  # [T, H], no ln_f in image mode
        self.filled = True
        return m.velocity(hidden[image_rows], t, self.seq.h, self.seq.w).float()  # [B, C, h, w]


def to_device(meta: ForwardMetadata, device) -> ForwardMetadata:
    """The step's metadata on the model's device (built on the host)."""
    groups = [AttentionGroup(*(getattr(g, f).to(device) for f in ("rows", "block_tables", "seq_lens", "cu_seqlens_q")),
                             g.causal) for g in meta.groups]
    return ForwardMetadata(meta.cos.to(device), meta.sin.to(device), meta.slot_mapping.to(device), groups)


@dataclass
class GenerationResult:
    image: torch.Tensor  # [3, H, W] in [-1, 1]
    latents: torch.Tensor  # [1, C, h, w]
    ratio_index: int
    timings: dict[str, float] = field(default_factory=dict)


def parse_image_size(text: str) -> str | tuple[int, int]:
    """'auto', 'HxW' / 'H*W' or 'N' (square) -> 'auto' or (H, W); ValueError on anything else."""
    if text == "auto":
        return "auto"
    parts = text.lower().replace("*", "x").split("x")
    if len(parts) not in (1, 2) or not all(p.strip().isdigit() for p in parts):
        raise ValueError(f"image size {text!r}: expected 'auto', 'HxW' or 'N'")
    h, w = int(parts[0]), int(parts[-1])
    if h < 32 or w < 32 or h % 16 or w % 16:  # a 1x1 latent leaves GroupNorm one value per group
        raise ValueError(f"image size {text!r}: height and width must be multiples of 16, at least 32")
    return h, w


class HunyuanImage3Pipeline:
    def __init__(self, model: HunyuanImage3, tokenizer, special: dict[str, int], cfg_group=None, block_size: int = 16):
        self.model, self.tokenizer, self.special = model, tokenizer, special
        self.cfg_group, self.block_size = cfg_group, block_size
        self.ratio_ids = [special[f"ratio_{k}"] for k in range(33)]

    @torch.no_grad()
    def predict_ratio(self, prompt: str, system_prompt: str = "") -> int:
        """`image_size="auto"`: one autoregressive step (ln_f + lm_head) on <bos> prompt <boi> <img_size>, greedy;
        a token that is not `<img_ratio_k>` falls back to 16 (1:1)."""
        ids = ratio_prompt(self.tokenizer, self.special, prompt, system_prompt)  # [n]
        cache = PagedKVCache(self.model, 1, len(ids), self.block_size)
        cos, sin = rope_cos_sin(rope_positions(len(ids)), self.model.config.head_dim, self.model.config.rope_theta)
        dev = cache.block_tables.device
        meta = to_device(text_metadata(len(ids), cache.block_tables.cpu(), self.block_size, cos, sin), dev)
        hidden = self.model.model(self.model.model.wte(ids.to(dev)), meta, cache.layers)
        token = int(self.model.text_logits(hidden[-1:]).argmax(-1))
        return self.ratio_ids.index(token) if token in self.ratio_ids else DEFAULT_RATIO

    def resolve_size(self, prompt: str, image_size) -> tuple[int, tuple[int, int]]:
        """(ratio index, (H, W)). Explicit sizes are kept and name their nearest ratio bucket; `auto` takes the
        predicted bucket (rounded to the VAE's 16-pixel grid)."""
        base = self.model.config.image_base_size
        if image_size == "auto":
            k = self.predict_ratio(prompt)
            h, w = resolution_buckets(base)[k]
            return k, (max(16, round(h / 16) * 16), max(16, round(w / 16) * 16))
        k, _ = snap_resolution(*image_size, base)
        return k, tuple(image_size)

    @torch.no_grad()
    def __call__(self, prompt: str, image_size=(64, 64), num_inference_steps: int = 50, guidance_scale: float = 5.0,
                 seed: int = 0, kv_reuse: bool = True, progress: bool = True, system_prompt: str = "",
                 decode: bool = True) -> GenerationResult:
        timings, t0 = {}, time.perf_counter()
        ratio_index, (H, W) = self.resolve_size(prompt, image_size)
        f = self.model.config.vae_downsample_factor
        h, w = H // f[0], W // f[1]
        cfg = guidance_scale > 1.0
        seq = build_sequence(self.tokenizer, self.special, prompt, ratio_index, h, w, cfg=cfg,
                             system_prompt=system_prompt)
        cfg_ranks = group_size(self.cfg_group)
        if cfg and cfg_ranks == 2:  # this rank runs its half of the CFG batch
            r = group_rank(self.cfg_group)
            seq = ImageSequence(seq.input_ids[r:r + 1], seq.image_start, h, w)
        elif cfg_ranks != 1:
            raise ValueError("CFG parallel needs guidance_scale > 1 and a cfg group of 2 ranks")
        B = seq.input_ids.shape[0]
        denoiser = ImageDenoiser(self.model, seq, self.block_size)
        C = self.model.config.vae.latent_channels
        latents = torch.randn(1, C, h, w, generator=torch.Generator().manual_seed(seed))  # same on every rank
        latents = latents.to(self.model.model.wte.weight.device)
        scheduler = make_scheduler(num_inference_steps)
        timings["prepare_s"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        for t in tqdm(scheduler.timesteps, desc="denoise", disable=not progress, leave=False):
            t_model = t.to(latents.device).expand(B)  # sigma * 1000 per row
            v = denoiser.velocity(latents.expand(B, -1, -1, -1), t_model, reuse=kv_reuse)  # [B, C, h, w]
            if cfg:
                cond, uncond = all_gather(v, self.cfg_group).chunk(2)  # [1, C, h, w] each
                v = uncond + guidance_scale * (cond - uncond)
            latents = scheduler.step(v, t, latents).prev_sample
        timings["denoise_s"] = time.perf_counter() - t0
        image = None
        if decode:
            t0 = time.perf_counter()
            image = self.model.vae.decode(latents)[0].cpu()
            timings["decode_s"] = time.perf_counter() - t0
        return GenerationResult(image, latents, ratio_index, timings)
