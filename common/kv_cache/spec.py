"""What a model declares about its cache: named groups, each a token-block table."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class CacheGroupSpec:
    """One cache group: a block covers `block_size` consecutive token positions of a request; what the model stores
    per block (KV rows, compressed entries, ...) is its own business. With `sliding_window=W` a query at position p
    reads only positions > p - W (keys k with p - k < W), so older blocks are freed while the request runs."""

    name: str
    block_size: int
    sliding_window: int | None = None

    def __post_init__(self):
        assert self.name, "a cache group needs a name"
        assert self.block_size > 0, f"{self.name}: block_size {self.block_size} must be positive"
        assert self.sliding_window is None or self.sliding_window > 0, \
            f"{self.name}: sliding_window {self.sliding_window} must be positive or None"

    def first_needed_block(self, position: int) -> int:
        """The first block that a query at `position`, or at any later position, reads."""
        if self.sliding_window is None:
            return 0
        return max(0, position - self.sliding_window + 1) // self.block_size
