"""Engine settings, one checked, frozen dataclass (nano-vllm style): the user-facing API passes keyword arguments.

The engine resolves a config against its model and cache once, before anything is sized from it
(`resolve`, `fit_cache`), and never changes it afterwards: every later reader sees the numbers the cache has.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, fields


@dataclass(frozen=True)
class EngineConfig:
    max_num_seqs: int = 32  # running requests at once
    max_num_batched_tokens: int = 1024  # tokens (prefill chunks + decodes) per step
    max_model_len: int | None = None  # prompt + output; None = the model's max_position_embeddings
    block_size: int = 16  # tokens per KV cache block
    num_blocks: int | None = None  # blocks per cache group; None = from kv_cache_memory_bytes
    kv_cache_memory_bytes: int = 256 * 2**20
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    num_speculative_tokens: int = 0  # MTP drafts per decode step (the model's `mtp` blocks); 0: off
    exe_mode: str = "eager"  # "graph": decode steps run as graphs compiled per batch bucket (graph_runner.py);
    #   "auto": graph mode's buckets where a graph beats the eager step, timed on its first steps (over ranks: at
    #   start-up); eager where no graph runs
    graph_capture_sizes: tuple[int, ...] | None = None  # decode batch buckets; None: 1, 2, 4, .. and max_num_seqs
    # the encoder stage (images): rows a step may encode, and rows the encoder cache holds (vLLM's names; None: both
    # max_num_batched_tokens). An image must fit both: a longer one is refused when it is submitted.
    max_num_encoder_input_tokens: int | None = None
    encoder_cache_size: int | None = None

    def __post_init__(self):
        for name in ("max_num_seqs", "max_num_batched_tokens", "block_size", "kv_cache_memory_bytes"):
            if not _is_int(getattr(self, name)) or getattr(self, name) < 1:
                raise ValueError(f"{name} must be a positive int, got {getattr(self, name)!r}")
        for name in ("max_num_encoder_input_tokens", "encoder_cache_size"):
            if getattr(self, name) is not None and (not _is_int(getattr(self, name)) or getattr(self, name) < 1):
                raise ValueError(f"{name} must be a positive int or None, got {getattr(self, name)!r}")
        if self.num_blocks is not None and (not _is_int(self.num_blocks) or self.num_blocks < 2):
            raise ValueError(f"num_blocks must be an int >= 2 (block 0 is the null block), got {self.num_blocks!r}")
        if self.max_model_len is not None and (not _is_int(self.max_model_len) or self.max_model_len < 2):
            raise ValueError(f"max_model_len must be an int >= 2, got {self.max_model_len!r}")
        if not _is_int(self.num_speculative_tokens) or not 0 <= self.num_speculative_tokens <= 7:
            raise ValueError(f"num_speculative_tokens must be an int in [0, 7], got {self.num_speculative_tokens!r}")
        if self.exe_mode not in EXE_MODES:
            raise ValueError(f"exe_mode must be one of {', '.join(EXE_MODES)}, got {self.exe_mode!r}")
        if self.graph_capture_sizes is not None:
            sizes = self.graph_capture_sizes
            if (not isinstance(sizes, (tuple, list)) or not sizes or not all(_is_int(n) and n >= 1 for n in sizes)
                    or list(sizes) != sorted(set(sizes))):
                raise ValueError(f"graph_capture_sizes must be increasing positive ints, got {sizes!r}")
            if sizes[-1] > self.max_num_seqs:
                raise ValueError(f"graph_capture_sizes go up to {sizes[-1]}, past max_num_seqs ({self.max_num_seqs})")
            object.__setattr__(self, "graph_capture_sizes", tuple(sizes))
        for name in ("enable_prefix_caching", "enable_chunked_prefill"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be true or false, got {getattr(self, name)!r}")
        if not self.enable_chunked_prefill and self.max_model_len is not None \
                and self.max_num_batched_tokens < self.max_model_len:
            # a prompt (or a preempted request's recompute) must fit one step: it could never run otherwise
            raise ValueError(f"with enable_chunked_prefill off, max_num_batched_tokens ({self.max_num_batched_tokens})"
                             f" must be >= max_model_len ({self.max_model_len}): raise max_num_batched_tokens, lower "
                             "max_model_len, or enable chunked prefill")

    def resolve(self, model_max_len: int) -> "EngineConfig":
        """This config with max_model_len set (the configured value capped at the model's) and, in graph or auto
        mode, the capture sizes (checked again)."""
        sizes = self.graph_capture_sizes
        if self.exe_mode in ("graph", "auto") and sizes is None:
            sizes = tuple(n for n in (1 << i for i in range(self.max_num_seqs.bit_length())) if n < self.max_num_seqs)
            sizes += (self.max_num_seqs,)
        encoder_tokens = self.max_num_encoder_input_tokens or self.max_num_batched_tokens
        return dataclasses.replace(self, max_model_len=min(self.max_model_len or model_max_len, model_max_len),
                                   graph_capture_sizes=sizes, max_num_encoder_input_tokens=encoder_tokens,
                                   encoder_cache_size=self.encoder_cache_size or encoder_tokens)

    @classmethod
    def from_kwargs(cls, **kwargs) -> tuple["EngineConfig", dict]:
        """Split keyword arguments into this config and the rest."""
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in kwargs.items() if k in names}), {k: v for k, v in kwargs.items() if k not in names}


EXE_MODES = ("eager", "graph", "auto")


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)
