"""DeepSeek-V4 vision inputs: one variable-size canvas per image (no tiles), its patches, and its placeholder span.

Plan (upstream's `plan_image_grid`), for an image of width x height pixels:
1. with `max_wh_ratio`, a width above height * max_wh_ratio counts as height * max_wh_ratio;
2. an area below `min_pixels` is scaled up to it (both sides times sqrt(min_pixels / area), truncated);
3. each side is rounded up to a multiple of the patch size: the canvas, an (n_vit_h x n_vit_w) patch grid;
4. the LLM grid is (ceil(n_vit_h / r), ceil(n_vit_w / r)), r = downsample_ratio, costing n_llm_h * (n_llm_w + 1) + 2
   tokens; above `max_num_tokens` the canvas becomes the largest aspect-preserving one that fits (a very tall image
   collapses to one column of cells, a very wide one to one row).
Pixels: images wider than max_wh_ratio are resized to the canvas; all others are letterboxed onto it (aspect kept,
centred, gray 127 around), bicubic. Values (x / 255 - 0.5) / 0.5, patches row-major [n_vit_h * n_vit_w, 3, p, p].

In the prompt each image placeholder becomes
    [IMAGE_START] + ([IMAGE] * n_llm_w + [IMAGE_NEW_LINE]) * n_llm_h + [IMAGE_END],
every position carrying the image token id; the per-token types tell them apart (TEXT for the prompt's own tokens).
"""
from __future__ import annotations

import dataclasses
import io
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from PIL import Image, ImageOps, UnidentifiedImageError

from encoding_deepseek_v4 import IMAGE_PLACEHOLDER

IMAGE_TOKEN = IMAGE_PLACEHOLDER  # the prompt's placeholder, one per image (V4's encoding writes it)
IMAGE_TOKEN_ID = 129264  # its id in the publisher's tokenizer (config.json `image_token_id`)
TEXT, IMAGE_START, IMAGE, IMAGE_NEW_LINE, IMAGE_END = -1, 0, 1, 2, 3  # per-token types
PAD_COLOR = (127, 127, 127)
RESAMPLE = Image.Resampling.BICUBIC
# modes whose RGB conversion keeps what the image shows: 8-bit color, grayscale, palette, CMYK (with or without
# alpha, dropped). Pillow would clip 16 / 32-bit integer ("I", "I;16") and float ("F") images to 8 bits, and read
# LAB / HSV values as RGB: those are refused.
RGB_MODES = ("1", "L", "LA", "La", "P", "PA", "RGB", "RGBA", "RGBa", "RGBX", "CMYK", "YCbCr")


@dataclass
class ImageProcessorConfig:
    """The publisher's `vision_config` preprocessing fields, plus a limit on the input's own size."""

    patch_size: int = 14
    downsample_ratio: int = 3
    max_num_tokens: int = 1024  # transformers calls it max_image_tokens
    min_pixels: int = 295936  # 544 * 544 (V4.1-Flash); V4-Flash-Vision-Exp 384 * 384
    max_wh_ratio: float | None = None
    max_input_pixels: int = Image.MAX_IMAGE_PIXELS  # larger inputs are refused before decoding

    def __post_init__(self):
        if self.patch_size < 1 or self.downsample_ratio < 1:
            raise ValueError("patch_size and downsample_ratio must be >= 1")
        if self.max_num_tokens < 4:
            raise ValueError(f"max_num_tokens {self.max_num_tokens} < 4: not even one cell (start, cell, newline, "
                             "end) fits")
        if self.min_pixels < 0 or self.max_input_pixels < 1:
            raise ValueError("min_pixels must be >= 0 and max_input_pixels >= 1")
        if self.max_wh_ratio is not None and self.max_wh_ratio <= 0:
            raise ValueError(f"max_wh_ratio must be > 0 or None, got {self.max_wh_ratio}")

    @classmethod
    def from_config(cls, cfg: dict) -> "ImageProcessorConfig":
        """From a checkpoint's config.json (`vision_config`)."""
        vision = dict(cfg.get("vision_config") or {})
        if not vision:
            raise ValueError("config.json has no vision_config: the checkpoint takes no images")
        if "max_image_tokens" in vision:
            vision.setdefault("max_num_tokens", vision["max_image_tokens"])
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in vision.items() if k in names})


@dataclass(frozen=True)
class ImagePlan:
    """Where an image goes: its canvas (pixels), patch grid, LLM grid, token count, and how it is resized."""

    height: int
    width: int
    grid: tuple[int, int]  # (n_vit_h, n_vit_w) patches
    llm_grid: tuple[int, int]  # (n_llm_h, n_llm_w) aligner tokens
    letterbox: bool  # False: plain resize (an image wider than max_wh_ratio)

    @property
    def num_tokens(self) -> int:
        return num_image_tokens(*self.llm_grid)


def num_image_tokens(n_llm_h: int, n_llm_w: int) -> int:
    return n_llm_h * (n_llm_w + 1) + 2


def image_token_types(n_llm_h: int, n_llm_w: int) -> list[int]:
    """The placeholder span's types: start, each row of IMAGE ended by IMAGE_NEW_LINE, end."""
    return [IMAGE_START] + ([IMAGE] * n_llm_w + [IMAGE_NEW_LINE]) * n_llm_h + [IMAGE_END]


def _llm_grid(height: int, width: int, p: int, r: int) -> tuple[int, int]:
    return math.ceil((height // p) / r), math.ceil((width // p) / r)


def _fit_budget(height, width, p: int, r: int, max_tokens: int) -> tuple[int, int]:
    """The largest aspect-preserving canvas (height, width) whose LLM grid costs at most max_tokens."""
    aspect = height / width
    max_w = math.sqrt((max_tokens - 2) / aspect + 0.25) - 0.5  # n_h * (n_w + 1) + 2 = max_tokens, n_h = aspect * n_w
    max_h = max_w * aspect
    cell = p * r
    if max_w < 1.0:  # very tall: one column of cells
        return (max_tokens - 2) // 2 * cell, cell
    if max_h < 1.0:  # very wide: one row of cells
        return cell, (max_tokens - 3) * cell
    beta = min(math.floor(max_w) * cell / width, math.floor(max_h) * cell / height)
    return math.floor(height * beta / p) * p, math.floor(width * beta / p) * p


def plan_image(width: int, height: int, cfg: ImageProcessorConfig) -> ImagePlan:
    """The canvas and grids of an image of width x height pixels (a pure function of its arguments)."""
    if width < 1 or height < 1:
        raise ValueError(f"image has zero size ({width}x{height})")
    p, r = cfg.patch_size, cfg.downsample_ratio
    w, h = width, height
    if cfg.max_wh_ratio is not None and w > h * cfg.max_wh_ratio:
        w = h * cfg.max_wh_ratio
    if w * h < cfg.min_pixels:
        scale = (cfg.min_pixels / (w * h)) ** 0.5
        w, h = int(w * scale), int(h * scale)
    best_h, best_w = math.ceil(h / p) * p, math.ceil(w / p) * p
    if num_image_tokens(*_llm_grid(best_h, best_w, p, r)) > cfg.max_num_tokens:
        best_h, best_w = _fit_budget(h, w, p, r, cfg.max_num_tokens)
    letterbox = cfg.max_wh_ratio is None or width < cfg.max_wh_ratio * height
    return ImagePlan(best_h, best_w, (best_h // p, best_w // p), _llm_grid(best_h, best_w, p, r), letterbox)


@dataclass
class ProcessedImage:
    """One image ready for the vision model and the prompt."""

    pixel_values: torch.Tensor  # [n_vit_h * n_vit_w, 3, p, p], row-major over the grid
    plan: ImagePlan
    token_types: torch.Tensor  # [num_tokens] int64: IMAGE_START, IMAGE, IMAGE_NEW_LINE, IMAGE_END

    @property
    def grid(self) -> tuple[int, int]:
        return self.plan.grid

    @property
    def num_tokens(self) -> int:
        return self.plan.num_tokens


class DeepseekImageProcessor:
    """Images (PIL images, encoded bytes or file paths) -> ProcessedImage; prompts -> expanded ids and types.

    Bad input raises ValueError naming the problem: undecodable data, zero size, more than max_input_pixels, a mode
    that has no faithful RGB conversion, an aspect ratio too extreme for its canvas."""

    def __init__(self, config: ImageProcessorConfig | None = None, image_token_id: int = IMAGE_TOKEN_ID,
                 dtype: torch.dtype = torch.bfloat16):
        self.config = config or ImageProcessorConfig()
        self.image_token_id = image_token_id
        self.dtype = dtype

    @classmethod
    def from_config(cls, cfg: dict, dtype: torch.dtype = torch.bfloat16) -> "DeepseekImageProcessor":
        """From a checkpoint's config.json (`vision_config`, `image_token_id`)."""
        return cls(ImageProcessorConfig.from_config(cfg), int(cfg.get("image_token_id", IMAGE_TOKEN_ID)), dtype)

    def load(self, image) -> Image.Image:
        """An RGB PIL image, its size checked before any pixel is decoded."""
        if isinstance(image, (bytes, bytearray, str, os.PathLike)):
            source = io.BytesIO(image) if isinstance(image, (bytes, bytearray)) else image
            try:
                image = Image.open(source)  # reads the header only
            except FileNotFoundError:
                raise ValueError(f"no such image file: {source}") from None
            except (UnidentifiedImageError, OSError, Image.DecompressionBombError) as e:
                raise ValueError(f"cannot decode image: {e}") from None
        elif not isinstance(image, Image.Image):
            raise ValueError(f"expected a PIL image, encoded image bytes or a path, got {type(image).__name__}")
        width, height = image.size
        if width < 1 or height < 1:
            raise ValueError(f"image has zero size ({width}x{height})")
        if width * height > self.config.max_input_pixels:
            raise ValueError(f"image has {width}x{height} = {width * height} pixels, more than the "
                             f"{self.config.max_input_pixels} allowed")
        if image.mode not in RGB_MODES:
            raise ValueError(f"image mode {image.mode!r} is not supported (8-bit RGB, grayscale, palette or CMYK "
                             "images are; 16-bit, 32-bit and float images would lose their values)")
        try:
            image.load()
        except (OSError, ValueError, SyntaxError) as e:  # truncated or corrupt data
            raise ValueError(f"cannot decode image: {e}") from None
        try:
            return image.convert("RGB")
        except (ValueError, OSError) as e:
            raise ValueError(f"image mode {image.mode!r} cannot be converted to RGB: {e}") from None

    def plan(self, width: int, height: int) -> ImagePlan:
        return plan_image(width, height, self.config)

    def __call__(self, image) -> ProcessedImage:
        image = self.load(image)
        plan = self.plan(*image.size)
        canvas = (plan.width, plan.height)
        if plan.letterbox:
            content = _contained_size(image.size, canvas)
            if min(content) < 1:
                raise ValueError(f"image aspect ratio {image.width}:{image.height} is too extreme: it would be "
                                 f"{content[0]}x{content[1]} pixels on its {canvas[0]}x{canvas[1]} canvas")
            image = ImageOps.pad(image, canvas, method=RESAMPLE, color=PAD_COLOR)
        else:
            image = image.resize(canvas, resample=RESAMPLE)
        p, (h, w) = self.config.patch_size, plan.grid
        x = torch.from_numpy(np.asarray(image, dtype=np.float32)).permute(2, 0, 1)  # [3, H, W]
        x = (x / 255 - 0.5) / 0.5
        patches = x.reshape(3, h, p, w, p).permute(1, 3, 0, 2, 4).reshape(h * w, 3, p, p)  # [h*w, 3, p, p]
        types = torch.tensor(image_token_types(*plan.llm_grid), dtype=torch.int64)
        return ProcessedImage(patches.to(self.dtype), plan, types)

    def expand_placeholders(self, input_ids: Sequence[int], images: Sequence[ProcessedImage]) -> tuple[list[int], list[int]]:
        """Each image token of `input_ids` (one per image, in order) -> its image's span of image token ids.
        Returns (ids, types), types TEXT for the prompt's own tokens."""
        count = sum(1 for t in input_ids if t == self.image_token_id)
        if count != len(images):
            raise ValueError(f"the prompt has {count} image placeholders but {len(images)} images were given")
        ids, types, next_image = [], [], iter(images)
        for token in input_ids:
            if token != self.image_token_id:
                ids.append(token)
                types.append(TEXT)
                continue
            span = next(next_image).token_types.tolist()
            ids.extend([self.image_token_id] * len(span))
            types.extend(span)
        return ids, types


def _contained_size(size: tuple[int, int], canvas: tuple[int, int]) -> tuple[int, int]:
    """The size ImageOps.pad gives the image inside the canvas (aspect kept, the long side filling it)."""
    (w, h), (cw, ch) = size, canvas
    if w / h > cw / ch:
        return cw, round(h / w * cw)
    if w / h < cw / ch:
        return round(w / h * ch), ch
    return cw, ch
