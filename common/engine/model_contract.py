"""The model contract: all that the engine, graph capture, PD's KV transfer and the vLLM plugin use of a model. A new
LLM recipe implements this and needs nothing else of the engine; tests/engine/contract_toy_model.py is a complete
one (embedding, one paged attention layer, LM head) in about fifty lines.

The model is an `nn.Module` (on CPU the engine packs its bf16 nn.Linear weights for oneDNN) and a `CausalLM`:

- `engine_contract()` -> `ModelContract`: its limits (max_position_embeddings, vocab_size, eos_token_ids), its shape
  (hidden_size D; the dtype and device of its hidden states, which its cache tensors are allocated in) and its
  optional capabilities, each the object that provides it or None: `parallel` (its rank groups; None: one
  process), `mtp` (MTPDraftModel; None: speculative decoding refused), `encoder` (EncoderModel; None: text only,
  image inputs refused), `finish_prefill` (a hook after each step's forward; None: not called). The engine refuses
  a feature whose capability is None, naming it, and probes the model for nothing else.
- Its caches, declared, never allocated by the model. `cache_specs(block_size)`: its cache groups
  (common.kv_cache.CacheGroupSpec: a block table per request per group, blocks of block_size token positions,
  optionally a sliding window behind which the engine frees blocks). `cache_tensor_specs()`: every cache tensor, in
  a fixed order (CacheTensorSpec: its name, the group whose blocks it is paged by, rows of `width` elements, one
  row per `tokens_per_row` tokens); with blocks of b tokens a tensor is [num_blocks of its group,
  b // tokens_per_row, 1, width]. Name a tensor by its module path and attribute, layer index included
  ("layers.3.attn.k_cache"): vLLM reads the layer index from it. Whoever runs the model allocates the tensors from
  these specs (common/kv_cache/cache_tensors.py: zeros, in the contract's dtype and device, bytes per block counted
  without allocating), owns them (the engine's ModelRunner, as `runner.cache_tensors`: by group, in spec order,
  what PD's KV transfer registers; under vLLM, vLLM's block manager) and hands them to the model with
  `bind_caches` before the first forward, and again whenever it replaces them.
- `bind_caches(tensors, tables=None)`: ValueError unless `tensors` holds exactly one tensor per CacheTensorSpec
  name, shaped as above (common.kv_cache.check_cache_tensors). The model keeps those tensors (no copy) and from
  then on writes and reads its cache there only. `tables` maps a tensor name to the ForwardBatch block table /
  slot mapping key it is read through (default: its group); tensors read through different tables may have
  different rows per block (each its own shape[1]). A model that cannot honour a mapping other than each tensor's
  group raises ValueError for it (DeepSeek-V3 and the toy model do; DeepSeek-V4 and Ling honour any).
- `__call__(batch)`: one packed step (common.engine.ForwardBatch: the new tokens of B sequences, token-major, T in
  all) -> final hidden states [T, D]. Through common.ops, write each new token's row at `batch.slot_mapping[key]`
  [T] (of a one-row-per-token tensor viewed as [num_blocks * block_size, 1, width]) and read the past through
  `batch.block_tables[key]` [B, max_blocks] up to `batch.seq_lens` [B]. Block 0 is the null block: padding writes
  there and no real sequence reads it. To run in graph mode (exe_mode "graph"), read no tensor on the host: the
  sizes are batch.max_seqlen_q / max_seqlen_k.
- `embed_tokens(input_ids, uniform=False)`: [T] -> [T, D] (vLLM's embedding hook; the MTP drafts' next tokens).
- `compute_logits(hidden, uniform=False)`: [N, D] -> [N, V] fp32, for the rows the engine samples or scores. In
  both, `uniform` marks a graph-mode step, every rank with N rows (a vocabulary-parallel model then exchanges no
  sizes); a one-process model ignores it.

`common.engine.model_runner.prefill_logits(model, prompts)` runs whole prompts in one step over fresh caches, through
this contract alone (tests, benches).
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import torch

from .multimodal import EncoderInput

if TYPE_CHECKING:
    from common.kv_cache import CacheGroupSpec, CacheTensorSpec
    from common.parallel import Parallel

    from .forward_batch import ForwardBatch


class CausalLM(Protocol):
    """A model the engine runs (see the module docstring)."""

    def engine_contract(self) -> ModelContract: ...

    def cache_specs(self, block_size: int) -> list[CacheGroupSpec]:
        """Its cache groups for blocks of block_size tokens (ValueError for a block size it cannot use)."""

    def cache_tensor_specs(self) -> list[CacheTensorSpec]:
        """Every cache tensor, in a fixed order; each in a group cache_specs names."""

    def bind_caches(self, tensors: dict[str, torch.Tensor], tables: dict[str, str] | None = None) -> None:
        """Use these tensors (by CacheTensorSpec name, [blocks, rows a block, 1, width]) as its caches, each read
        through the ForwardBatch table `tables` names for it (default: its group); ValueError if it cannot."""

    def embed_tokens(self, input_ids: torch.Tensor, uniform: bool = False) -> torch.Tensor:
        """[T] -> [T, D]."""

    def __call__(self, batch: ForwardBatch) -> torch.Tensor:
        """-> final hidden states [T, D]."""

    def compute_logits(self, hidden: torch.Tensor, uniform: bool = False) -> torch.Tensor:
        """[N, D] -> [N, V] fp32; uniform: every rank scores N rows (a graph-mode step)."""


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
    """A model's limits, shape and optional capabilities (None: absent, the feature that needs it refused)."""

    max_position_embeddings: int
    vocab_size: int
    eos_token_ids: tuple[int, ...]
    hidden_size: int  # D: what __call__ returns per token, embed_tokens gives and compute_logits takes
    dtype: torch.dtype  # of its activations (hidden states) and of the cache tensors allocated for it
    device: torch.device  # where its weights, activations and cache tensors live
    parallel: Parallel | None = None  # the model's rank groups (attn_dp, attn_tp, ...); None: one process
    mtp: MTPDraftModel | None = None  # None: no MTP layers loaded (speculative decoding refused)
    encoder: EncoderModel | None = None  # None: text only (multimodal inputs refused)
    finish_prefill: Callable[[list[int]], None] | None = None  # after a step's forward: the rows of its batch whose
    #   prompt prefill ended in it (MoE offload's dynamic expert placement)

    def __post_init__(self):
        object.__setattr__(self, "device", torch.device(self.device))  # "cpu" or a torch.device alike
        if self.max_position_embeddings < 1 or self.vocab_size < 1 or self.hidden_size < 1:
            raise ValueError(f"max_position_embeddings, vocab_size and hidden_size must be positive, got "
                             f"{self.max_position_embeddings}, {self.vocab_size} and {self.hidden_size}")
        if not all(0 <= t < self.vocab_size for t in self.eos_token_ids):
            raise ValueError(f"eos_token_ids {self.eos_token_ids} must lie in [0, {self.vocab_size})")
        if self.mtp is not None and self.mtp.num_draft_layers < 1:
            raise ValueError("mtp must have at least one draft layer (None: no MTP)")
