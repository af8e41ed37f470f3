"""The text-to-image sequence of HunyuanImage-3.0: resolution buckets, token layout, CFG sequence, 2D RoPE, mask.

    <bos> [system] prompt <boi> <img_size_1024> <img_ratio_k> <timestep> <img> x (h*w) <eoi>

Text is causal; the image block is bidirectional inside itself and sees everything before it; `<timestep>` does not
see the image and the image does not see `<eoi>`. Text token at p rotates by (y, x) = (p, p) (1D RoPE); image
token (i, j) of a block starting at L0 by y = L0 + (hw - h)/2 + i, x = L0 + (hw - w)/2 + j.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from modeling_hunyuan_image import AttentionGroup, ForwardMetadata


def resolution_buckets(base: int = 1024, step: int | None = None) -> list[tuple[int, int]]:
    """The 33 (height, width) buckets at `base`: from base x base, step h up / w down (and the reverse) by `step`
    (default base / 16) within [base/2, 2 base], sorted by h / w (index 0 = widest)."""
    lo, hi, step = base // 2, base * 2, step or base // 16
    out = [(base, base)]
    for sign in (1, -1):
        h = w = base
        while not (sign > 0 and h >= hi and w <= lo) and not (sign < 0 and h <= lo and w >= hi):
            h, w = (min(h + step, hi), max(w - step, lo)) if sign > 0 else (max(h - step, lo), min(w + step, hi))
            out.append((h, w))
    return sorted(out, key=lambda hw: hw[0] / hw[1])


def snap_resolution(height: int, width: int, base: int = 1024) -> tuple[int, tuple[int, int]]:
    """(ratio index k, (H, W) of that bucket) nearest to height / width."""
    buckets = resolution_buckets(base)
    ratios = torch.tensor([h / w for h, w in buckets])
    k = int((ratios - height / width).abs().argmin())
    return k, buckets[k]


@dataclass(slots=True)
class ImageSequence:
    """Token ids [B, L] of B sequences of the same layout (cond first, then uncond with CFG)."""

    input_ids: torch.Tensor  # [B, L] int64
    image_start: int  # L0: index of the first image token
    h: int  # latent / token grid
    w: int

    @property
    def length(self) -> int:
        return self.input_ids.shape[1]

    @property
    def timestep_pos(self) -> int:
        return self.image_start - 1

    @property
    def image_end(self) -> int:
        return self.image_start + self.h * self.w


def prompt_ids(tokenizer, special: dict[str, int], prompt: str, system_prompt: str = "") -> tuple[list[int], int, int]:
    """<bos> [system] prompt -> (ids, start, end of the user-prompt span)."""
    system = tokenizer.encode(system_prompt, add_special_tokens=False) if system_prompt else []
    user = tokenizer.encode(prompt, add_special_tokens=False)
    ids = [special["bos"], *system, *user]
    return ids, 1 + len(system), len(ids)


def build_sequence(tokenizer, special: dict[str, int], prompt: str, ratio_index: int, h: int, w: int,
                   cfg: bool = True, system_prompt: str = "") -> ImageSequence:
    """The text-to-image sequence; with cfg a second, unconditional row: every user-prompt token -> <cfg>
    one for one (same length, same image positions; system prompt and special tokens unchanged)."""
    ids, p0, p1 = prompt_ids(tokenizer, special, prompt, system_prompt)
    image = [special["img"]] * (h * w)
    tail = [special["boi"], special["size"], special[f"ratio_{ratio_index}"], special["timestep"], *image,
            special["eoi"]]
    cond = ids + tail
    rows = [cond]
    if cfg:
        rows.append(cond[:p0] + [special["cfg"]] * (p1 - p0) + cond[p1:])
    image_start = len(ids) + 4
    return ImageSequence(torch.tensor(rows, dtype=torch.long), image_start, h, w)


def ratio_prompt(tokenizer, special: dict[str, int], prompt: str, system_prompt: str = "") -> torch.Tensor:
    """`image_size="auto"`: <bos> [system] prompt <boi> <img_size_1024>, whose next token is the ratio token."""
    ids, _, _ = prompt_ids(tokenizer, special, prompt, system_prompt)
    return torch.tensor(ids + [special["boi"], special["size"]], dtype=torch.long)


def rope_positions(length: int, image_start: int | None = None, h: int = 0, w: int = 0) -> torch.Tensor:
    """(y, x) rotary positions [L, 2] int64; text at p is (p, p); one image block of h x w at image_start."""
    pos = torch.arange(length)[:, None].repeat(1, 2)  # [L, 2]
    if image_start is not None:
        hw = h * w
        i, j = torch.meshgrid(torch.arange(h), torch.arange(w), indexing="ij")
        pos[image_start:image_start + hw, 0] = (2 * image_start + hw - h + 2 * i.flatten()) // 2  # floor
        pos[image_start:image_start + hw, 1] = (2 * image_start + hw - w + 2 * j.flatten()) // 2
    return pos


def rope_cos_sin(pos: torch.Tensor, head_dim: int, theta: float = 10000.0) -> tuple[torch.Tensor, torch.Tensor]:
    """2D RoPE tables [L, D] for positions [L, 2]: frequency i = theta^(-2i/D) turns by y (even i) or x (odd i);
    rows are cat(f, f) for the rotate-half layout."""
    inv_freq = theta ** (-torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)  # [D/2]
    coord = pos[:, torch.arange(head_dim // 2) % 2].float()  # [L, D/2]: y, x, y, x, ...
    angles = torch.cat([coord * inv_freq] * 2, dim=-1)  # [L, D]
    return angles.cos(), angles.sin()


def attention_mask(length: int, image_start: int, image_end: int) -> torch.Tensor:
    """Dense boolean mask [L, L] (query, key): causal plus the image block visible to itself."""
    mask = torch.ones(length, length, dtype=torch.bool).tril()
    mask[image_start:image_end, image_start:image_end] = True
    return mask


def _group(runs: list[tuple[int, int, int, torch.Tensor]], causal: bool) -> AttentionGroup:
    """runs: (first row, end row, kv length, block-table row) -> one paged-attention call."""
    rows = torch.cat([torch.arange(r0, r1) for r0, r1, _, _ in runs])
    q_lens = torch.tensor([r1 - r0 for r0, r1, _, _ in runs])
    block_tables = torch.stack([bt for *_, bt in runs]).int()
    return AttentionGroup(rows, block_tables, torch.tensor([n for _, _, n, _ in runs]).int(),
                          torch.nn.functional.pad(q_lens.cumsum(0), (1, 0)).int(), causal)


def slots(block_table: torch.Tensor, positions: torch.Tensor, block_size: int) -> torch.Tensor:
    """Cache slot of each position of one sequence."""
    return block_table[positions // block_size].long() * block_size + positions % block_size


def full_metadata(seq: ImageSequence, block_tables: torch.Tensor, block_size: int, cos, sin) -> ForwardMetadata:
    """All L tokens of every sequence (step 0 / full recompute). Packed rows b*L + p."""
    L, i0, i1 = seq.length, seq.image_start, seq.image_end
    B, pos = seq.input_ids.shape[0], torch.arange(L)
    causal, bidir = [], []
    for b, bt in enumerate(block_tables):
        causal += [(b * L, b * L + i0, i0, bt), (b * L + i1, (b + 1) * L, L, bt)]
        bidir.append((b * L + i0, b * L + i1, i1, bt))
    slot_mapping = torch.cat([slots(bt, pos, block_size) for bt in block_tables])
    groups = [_group(causal, True), _group(bidir, False)]
    return ForwardMetadata(cos.repeat(B, 1), sin.repeat(B, 1), slot_mapping, groups)


def reuse_positions(seq: ImageSequence) -> torch.Tensor:
    """Indices of the tokens a KV-reuse step feeds: <timestep> and the image block (1 + hw)."""
    return torch.arange(seq.timestep_pos, seq.image_end)


def reuse_metadata(seq: ImageSequence, block_tables: torch.Tensor, block_size: int, cos, sin) -> ForwardMetadata:
    """Steps after the first: only <timestep> + image rows, packed b*(1+hw) + i; their K/V overwrite the cache and
    they attend to the cached prefix: <timestep> to [0, L0), the image to [0, L0 + hw)."""
    idx, n = reuse_positions(seq), seq.h * seq.w + 1
    runs = []
    for b, bt in enumerate(block_tables):
        runs += [(b * n, b * n + 1, seq.image_start, bt), (b * n + 1, (b + 1) * n, seq.image_end, bt)]
    slot_mapping = torch.cat([slots(bt, idx, block_size) for bt in block_tables])
    B = len(block_tables)
    return ForwardMetadata(cos[idx].repeat(B, 1), sin[idx].repeat(B, 1), slot_mapping, [_group(runs, False)])


def text_metadata(length: int, block_tables: torch.Tensor, block_size: int, cos, sin) -> ForwardMetadata:
    """Plain causal prefill of B text sequences of `length` tokens."""
    pos, B = torch.arange(length), len(block_tables)
    runs = [(b * length, (b + 1) * length, length, bt) for b, bt in enumerate(block_tables)]
    slot_mapping = torch.cat([slots(bt, pos, block_size) for bt in block_tables])
    return ForwardMetadata(cos.repeat(B, 1), sin.repeat(B, 1), slot_mapping, [_group(runs, True)])
