"""What a model declares about its cache: named groups, each a token-block table ("paged") or a per-request state
slot ("state"), and the tensors each group pages."""
from __future__ import annotations

from dataclasses import dataclass

import torch

CACHE_KINDS = ("paged", "state")


@dataclass(frozen=True, slots=True)
class CacheGroupSpec:
    """One cache group.

    kind "paged": a block covers `block_size` consecutive token positions of a request; what the model stores per
    block (KV rows, compressed entries, ...) is its own business. With `sliding_window=W` a query at position p
    reads only positions > p - W (keys k with p - k < W), so older blocks are freed while the request runs.

    kind "state" (vLLM's MambaSpec): a fixed-size state per request that each step reads and rewrites (a linear
    attention's recurrent state and conv history), whatever the sequence length. A request holds one slot of the
    group's pool; a step reads the state at the slot its table names first and writes the state after the step at
    the next (ForwardBatch: the group's table is [B, 1 + W] = (read, writes); W > 1 under speculative decoding, a
    state per candidate end; read slot 0, the null slot: start from a zero state). With prefix caching the state after a step that ends on a multiple of block_size is kept as that
    prefix's checkpoint (see common/kv_cache/kv_cache_manager.py)."""

    name: str
    block_size: int
    sliding_window: int | None = None
    kind: str = "paged"

    def __post_init__(self):
        assert self.name, "a cache group needs a name"
        assert self.block_size > 0, f"{self.name}: block_size {self.block_size} must be positive"
        assert self.sliding_window is None or self.sliding_window > 0, \
            f"{self.name}: sliding_window {self.sliding_window} must be positive or None"
        assert self.kind in CACHE_KINDS, f"{self.name}: kind {self.kind!r} must be one of {CACHE_KINDS}"
        assert self.kind == "paged" or self.sliding_window is None, f"{self.name}: a state group has no window"

    @property
    def is_state(self) -> bool:
        return self.kind == "state"

    def first_needed_block(self, position: int) -> int:
        """The first block that a query at `position`, or at any later position, reads."""
        if self.sliding_window is None:
            return 0
        return max(0, position - self.sliding_window + 1) // self.block_size


@dataclass(frozen=True, slots=True)
class CacheTensorSpec:
    """One cache tensor of a model, in cache group `group`: rows of `width` elements, one row per `tokens_per_row`
    token positions (1: a row per token; r: one compressed entry per r tokens), which readers look back at over
    the last `window` positions (a query at p reads the rows of positions > p - window; None: every row). With
    blocks of b tokens the tensor is [num_blocks, b // tokens_per_row, 1, width]. `name` is where the model keeps
    it (its module path and attribute, e.g. "layers.1.attn.compressor.state").

    A tensor of a state group sets `rows` instead: [num_slots, rows, 1, width] whatever the block size (a
    recurrent state [H, K * V] has rows H). `dtype`: its own element type (a recurrent state kept in fp32 beside
    bf16 activations); None: the model's (ModelContract.dtype)."""

    name: str
    group: str
    width: int
    tokens_per_row: int = 1
    window: int | None = None
    rows: int | None = None
    dtype: torch.dtype | None = None

    def __post_init__(self):
        assert self.name and self.group, "a cache tensor needs a name and a group"
        assert self.width > 0 and self.tokens_per_row > 0, f"{self.name}: width and tokens_per_row must be positive"
        assert self.window is None or self.window > 0, f"{self.name}: window {self.window} must be positive or None"
        assert self.rows is None or (self.rows > 0 and self.tokens_per_row == 1 and self.window is None), \
            f"{self.name}: a state tensor has positive rows and no tokens_per_row or window"

    def rows_per_block(self, block_size: int) -> int:
        """Rows of one block (a state tensor: of one slot)."""
        if self.rows is not None:
            return self.rows
        if block_size % self.tokens_per_row:
            raise ValueError(f"{self.name}: a block of {block_size} tokens does not hold whole rows of "
                             f"{self.tokens_per_row} tokens")
        return block_size // self.tokens_per_row


def check_cache_specs(groups: list[CacheGroupSpec], tensors: list[CacheTensorSpec]) -> None:
    """ValueError unless every tensor lies in a declared group and sets `rows` exactly when its group is a state
    group."""
    kinds = {g.name: g.kind for g in groups}
    for t in tensors:
        if t.group not in kinds:
            raise ValueError(f"cache tensor {t.name} is in group {t.group!r}, which the model does not declare")
        if (t.rows is not None) != (kinds[t.group] == "state"):
            raise ValueError(f"cache tensor {t.name}: a tensor of a state group sets rows, one of a paged group not")


def check_cache_tensors(specs: list[CacheTensorSpec], tensors: dict) -> None:
    """ValueError unless `tensors` holds exactly one tensor per spec, by name, each [blocks, rows, 1, width]."""
    if bad := tensors.keys() ^ {s.name for s in specs}:
        raise ValueError(f"cache tensors missing or unknown: {sorted(bad)}")
    for s in specs:
        t = tensors[s.name]
        if t.dim() != 4 or t.shape[2] != 1 or t.shape[3] != s.width:
            raise ValueError(f"cache tensor {s.name} is {tuple(t.shape)}, expected [blocks, rows, 1, {s.width}]")
