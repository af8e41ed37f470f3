"""The model contract: what the engine needs from a model, stated by the model in one place, never probed.

Every model the engine runs is a `CausalLM`: it owns its paged caches (the groups it declares, tensors allocated
at the block counts the engine picks) and turns a packed ForwardBatch into hidden states and logits. Everything
else the engine may use, the model states in `engine_contract()` -> `ModelContract`: its limits, its rank groups,
its MTP layers (`MTPDraftModel`, what speculative decoding drives), its encoder stage (`EncoderModel`, what image
inputs go through) and a hook at the end of a prompt's prefill. A capability the model lacks is None there, and the
engine refuses the feature that needs it by name.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import torch

from .multimodal import EncoderInput

if TYPE_CHECKING:
    from common.kv_cache import CacheGroupSpec
    from common.parallel import Parallel

    from .forward_batch import ForwardBatch


class CausalLM(Protocol):
    """A model the engine runs."""

    def engine_contract(self) -> ModelContract: ...

    def cache_specs(self, block_size: int) -> list[CacheGroupSpec]: ...

    def cache_bytes_per_block(self, block_size: int) -> dict[str, int]: ...

    def allocate_caches(self, num_blocks: dict[str, int], block_size: int) -> None: ...

    def cache_tensors(self) -> dict[str, list[torch.Tensor]]:
        """Every cache tensor by group, [num_blocks, ...] each (PD's KV transfer, graph capture)."""

    def __call__(self, batch: ForwardBatch) -> torch.Tensor:
        """-> final hidden states [T, D]."""

    def compute_logits(self, hidden: torch.Tensor, uniform: bool = False) -> torch.Tensor:
        """[N, D] -> [N, V]; uniform: every rank scores N rows (a graph-mode step)."""


class MTPDraftModel(Protocol):
    """The main model split in two halves around its residual streams, and its multi-token-prediction layers fed
    those streams (common/engine/spec_decode.py). Streams are [T, n, D] (n: the model's residual streams, 1 for a
    model without hyper-connections)."""

    num_draft_layers: int

    def residual_streams(self, batch: ForwardBatch) -> torch.Tensor:
        """The main model up to its last layer: [T, n, D]."""

    def final_hidden(self, streams: torch.Tensor) -> torch.Tensor:
        """[T, n, D] -> the normed hidden state [T, D] for compute_logits."""

    def empty_streams(self) -> torch.Tensor:
        """[0, n, D] on the model's device and dtype (a data-parallel rank with nothing to draft)."""

    def draft_streams(self, layer: int, streams: torch.Tensor, input_ids: torch.Tensor,
                      batch: ForwardBatch) -> torch.Tensor:
        """MTP layer `layer` over streams [T, n, D] and the next tokens input_ids [T] -> its streams [T, n, D]."""

    def draft_logits(self, layer: int, streams: torch.Tensor) -> torch.Tensor:
        """MTP layer `layer`'s streams [B, n, D] -> logits [B, V]."""


class EncoderModel(Protocol):
    """The model's encoder stage (a vision tower): a request's items (images) in, the embeddings of their placeholder
    spans out (common/engine/multimodal.py, common/engine/encoder_cache.py).

    What a request's multimodal inputs are: `process` turns each item the user sent into an EncoderInput (its data,
    its span's length, its content hash); the prompt holds one `placeholder_token_id` per item, expanded to a span of
    that many placeholder ids (multimodal.expand_placeholders). The engine's encoder stage calls `encode` once a step
    with every item that step's prefill chunks need, across requests. How the embeddings reach the forward: the
    ForwardBatch carries `mm_embeds` [M, D] and `mm_rows` [M] (rows of the packed batch), and the model writes those
    embeddings over its token embeddings at those rows; a batch without them is a text-only forward, unchanged."""

    placeholder_token_id: int
    modality: str  # what an item is ("image"): the name a request's inputs go by

    def process(self, item: Any) -> EncoderInput:
        """One item as the user sent it (encoded bytes, a PIL image, a path) -> EncoderInput; ValueError naming what
        is wrong with it (not decodable, too large, an unsupported mode, ...)."""

    def encode(self, data: list[Any]) -> list[torch.Tensor]:
        """The EncoderInput.data of several items -> per item its span's embeddings [num_tokens, D], in one call."""


@dataclass(frozen=True)
class ModelContract:
    max_position_embeddings: int
    vocab_size: int
    eos_token_ids: tuple[int, ...]
    parallel: Parallel | None = None  # the model's rank groups (attn_dp, attn_tp, ...); None: one process
    mtp: MTPDraftModel | None = None  # None: no MTP layers loaded (speculative decoding refused)
    encoder: EncoderModel | None = None  # None: text only (multimodal inputs refused)
    finish_prefill: Callable[[list[int]], None] | None = None  # after a step's forward: the rows of its batch whose
    #   prompt prefill ended in it (MoE offload's dynamic expert placement)

    def __post_init__(self):
        if self.max_position_embeddings < 1 or self.vocab_size < 1:
            raise ValueError(f"max_position_embeddings and vocab_size must be positive, got "
                             f"{self.max_position_embeddings} and {self.vocab_size}")
        if not all(0 <= t < self.vocab_size for t in self.eos_token_ids):
            raise ValueError(f"eos_token_ids {self.eos_token_ids} must lie in [0, {self.vocab_size})")
        if self.mtp is not None and self.mtp.num_draft_layers < 1:
            raise ValueError("mtp must have at least one draft layer (None: no MTP)")
