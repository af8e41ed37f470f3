"""Engine settings, one checked dataclass (nano-vllm style): the user-facing API passes keyword arguments."""
from __future__ import annotations

from dataclasses import dataclass, fields


@dataclass
class EngineConfig:
    max_num_seqs: int = 32  # running requests at once
    max_num_batched_tokens: int = 1024  # tokens (prefill chunks + decodes) per step
    max_model_len: int | None = None  # prompt + output; None = the model's max_position_embeddings
    block_size: int = 16  # tokens per KV cache block
    num_blocks: int | None = None  # blocks per cache group; None = from kv_cache_memory_bytes
    kv_cache_memory_bytes: int = 256 * 2**20
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True

    def __post_init__(self):
        for name in ("max_num_seqs", "max_num_batched_tokens", "block_size", "kv_cache_memory_bytes"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"{name} must be a positive int, got {getattr(self, name)!r}")
        if self.num_blocks is not None and self.num_blocks < 2:
            raise ValueError(f"num_blocks must be >= 2 (block 0 is the null block), got {self.num_blocks}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {self.max_model_len}")

    @classmethod
    def from_kwargs(cls, **kwargs) -> tuple["EngineConfig", dict]:
        """Split keyword arguments into this config and the rest."""
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in kwargs.items() if k in names}), {k: v for k, v in kwargs.items() if k not in names}
