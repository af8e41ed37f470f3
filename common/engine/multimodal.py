"""A request's multimodal inputs (images): what the model's encoder stage made of each, and where it sits in the prompt.

The user's prompt holds one placeholder token per item; `expand_placeholders` replaces each by the item's span of
placeholder ids (as many as its embeddings have rows). The engine then runs the item through the model's encoder
stage before the prefill that reads it (common/engine/encoder_cache.py), and the forward writes the embeddings over
the span's rows (ModelContract.encoder). An item's identifier is a hash of its content: equal items share encoder
outputs and prefix-cache blocks, different items under the same placeholder ids never do.
"""
from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class EncoderInput:
    """One item as the model's encoder stage prepared it (`EncoderModel.process`)."""
    data: Any  # what `EncoderModel.encode` reads (an image's pixel values and grid, ...)
    num_tokens: int  # rows of its embeddings: the placeholder span's length
    identifier: str  # content hash of data (content_hash)
    source: bytes | None = None  # the encoded item it came from (what a PD prefill instance processes again)

    def __post_init__(self):
        if self.num_tokens < 1:
            raise ValueError(f"an encoder input needs at least one token, got {self.num_tokens}")


@dataclass(frozen=True)
class MultiModalInput:
    """An item placed in a request's prompt: its embeddings replace the rows of positions [offset, offset + length);
    data is what the model's encoder reads, source the encoded bytes it came from (None: not kept)."""
    identifier: str
    offset: int
    length: int
    data: Any = None
    source: bytes | None = None

    @property
    def end(self) -> int:
        return self.offset + self.length


def multimodal_prompt(prompt: dict) -> tuple[str | list[int], list]:
    """vLLM's multimodal prompt {"prompt": text | "prompt_token_ids": ids, "multi_modal_data": {"image": one image or
    a list}} -> (the prompt, its images); ValueError for another shape."""
    unknown = sorted(set(prompt) - {"prompt", "prompt_token_ids", "multi_modal_data"})
    if unknown or ("prompt" in prompt) == ("prompt_token_ids" in prompt):
        raise ValueError('a prompt dict is {"prompt": text or "prompt_token_ids": ids, "multi_modal_data": '
                         f'{{"image": ...}}}}, got keys {sorted(prompt)}')
    data = prompt.get("multi_modal_data") or {}
    if not isinstance(data, dict) or set(data) - {"image"}:
        raise ValueError(f'multi_modal_data takes "image" (one image or a list), got {data!r:.80}')
    images = data.get("image", [])
    return prompt.get("prompt", prompt.get("prompt_token_ids")), images if isinstance(images, list) else [images]


def content_hash(*parts: torch.Tensor | bytes | str | int) -> str:
    """sha256 over tensors' bytes (with shape and dtype), bytes, strings and ints: equal content, equal hash, on every
    process and machine."""
    digest = hashlib.sha256()
    for part in parts:
        if isinstance(part, torch.Tensor):
            t = part.detach().cpu().contiguous()
            digest.update(f"{t.dtype}{tuple(t.shape)}".encode())
            digest.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
        elif isinstance(part, bytes):
            digest.update(part)
        else:
            digest.update(repr(part).encode())
    return digest.hexdigest()


def expand_placeholders(token_ids: Sequence[int], items: Sequence[EncoderInput], placeholder_token_id: int
                        ) -> tuple[list[int], list[MultiModalInput]]:
    """Each placeholder token of `token_ids` (one per item, in order) -> the item's span of num_tokens placeholder
    ids. Returns the expanded ids and the placed items. ValueError when the counts differ."""
    count = sum(t == placeholder_token_id for t in token_ids)
    if count != len(items):
        raise ValueError(f"the prompt has {count} image placeholders but {len(items)} images were given")
    ids, placed, next_item = [], [], iter(items)
    for token in token_ids:
        if token != placeholder_token_id:
            ids.append(token)
            continue
        item = next(next_item)
        placed.append(MultiModalInput(item.identifier, len(ids), item.num_tokens, item.data, item.source))
        ids.extend([placeholder_token_id] * item.num_tokens)
    return ids, placed


def check_placements(token_ids: Sequence[int], inputs: Sequence[MultiModalInput], placeholder_token_id: int) -> None:
    """ValueError unless the inputs lie in order, apart, inside the prompt, each over placeholder ids only. (A
    placeholder id outside them, as a prompt of ids may carry, is a text token like any other: it takes the token's
    embedding, routes as text and hashes as text; chat formats refuse the placeholder in message text.)"""
    end = 0
    for i, mm in enumerate(inputs):
        if mm.length < 1 or mm.offset < end or mm.end > len(token_ids):
            raise ValueError(f"image {i} at prompt positions [{mm.offset}, {mm.end}) overlaps another or lies "
                             f"outside the {len(token_ids)}-token prompt")
        if any(t != placeholder_token_id for t in token_ids[mm.offset: mm.end]):
            raise ValueError(f"image {i}'s prompt positions [{mm.offset}, {mm.end}) are not all image placeholders")
        end = mm.end
