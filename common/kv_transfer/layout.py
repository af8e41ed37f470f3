"""Which bytes a request's KV blocks are: the model's cache tensors by group, and the writes that copy a block table.

Every cache tensor is [num_blocks, ...] and contiguous, so block b of a tensor is the `block_bytes` bytes at
`address + b * block_bytes` (a state group's "block" is a request's state slot: its table's first entry, the state
after the prompt, is copied like a block; the write columns beside it are null once the request has finished). A request's blocks in a group are sent as runs: consecutive block ids on both sides
become one write per tensor (upstream and vLLM-Ascend merge the same way). The prefill and decode instances must
hold the same tensors (same model, preset, dtype, MTP layers): `signature` says what must match.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Region:
    address: int  # of block 0
    block_bytes: int
    nbytes: int


def block_runs(src: list[int], dst: list[int]) -> list[tuple[int, int, int]]:
    """(first src block, first dst block, count) for the table entries both sides hold (null block 0 is a freed or
    never-held block: a window left it, nothing reads it again), consecutive on both sides merged."""
    runs: list[list[int]] = []
    for s, d in zip(src, dst):
        if s == 0 or d == 0:
            continue
        if runs and s == runs[-1][0] + runs[-1][2] and d == runs[-1][1] + runs[-1][2]:
            runs[-1][2] += 1
        else:
            runs.append([s, d, 1])
    return [tuple(r) for r in runs]


class CacheLayout:
    def __init__(self, groups: dict[str, list[Region]]):
        self.groups = groups

    @classmethod
    def from_tensors(cls, tensors: dict[str, list[torch.Tensor]]) -> "CacheLayout":
        groups = {}
        for g, ts in tensors.items():
            for t in ts:
                assert t.is_contiguous(), f"cache group {g}: a tensor is not contiguous"
            groups[g] = [Region(t.data_ptr(), t.nbytes // t.shape[0], t.nbytes) for t in ts]
        return cls(groups)

    def regions(self) -> list[tuple[int, int]]:
        """(address, nbytes) of every tensor, for KVTransport.register."""
        return [(r.address, r.nbytes) for rs in self.groups.values() for r in rs]

    def describe(self) -> dict:
        """JSON: {group: [[address, block_bytes], ...]} (what a peer needs to write here)."""
        return {g: [[r.address, r.block_bytes] for r in rs] for g, rs in self.groups.items()}

    @classmethod
    def from_description(cls, desc: dict) -> "CacheLayout":
        return cls({g: [Region(int(a), int(b), 0) for a, b in rs] for g, rs in desc.items()})

    def signature(self) -> dict[str, list[int]]:
        return {g: [r.block_bytes for r in rs] for g, rs in self.groups.items()}

    def mismatch(self, other: "CacheLayout") -> str | None:
        """Why blocks cannot be copied between the two layouts, or None."""
        mine, theirs = self.signature(), other.signature()
        if mine == theirs:
            return None
        if set(mine) != set(theirs):
            return f"cache groups differ: {sorted(mine)} here, {sorted(theirs)} there"
        g = next(g for g in mine if mine[g] != theirs[g])
        return (f"cache group {g}: {len(mine[g])} tensors of {sorted(set(mine[g]))} bytes per block here, "
                f"{len(theirs[g])} of {sorted(set(theirs[g]))} there")

    def writes(self, dst: "CacheLayout", src_tables: dict[str, list[int]], dst_tables: dict[str, list[int]]
               ) -> tuple[list[int], list[int], list[int]]:
        """(src addresses, dst addresses, lengths) copying the blocks of src_tables here into dst_tables there."""
        srcs, dsts, lengths = [], [], []
        for g, regions in self.groups.items():
            for s, d, n in block_runs(src_tables.get(g, []), dst_tables.get(g, [])):
                for here, there in zip(regions, dst.groups[g]):
                    srcs.append(here.address + s * here.block_bytes)
                    dsts.append(there.address + d * there.block_bytes)
                    lengths.append(n * here.block_bytes)
        return srcs, dsts, lengths
