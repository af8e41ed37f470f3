"""The cache tensors of a model's CacheTensorSpecs: allocated, sized and listed here, for every block manager that
holds them (the engine's model runner, the vLLM plugin's sizing), never by the model itself."""
from __future__ import annotations

import torch

from .spec import CacheTensorSpec


def allocate_cache_tensors(specs: list[CacheTensorSpec], num_blocks: dict[str, int], block_size: int,
                           dtype: torch.dtype, device: torch.device | str) -> dict[str, torch.Tensor]:
    """One zeroed tensor per spec, by name: [num_blocks of its group, rows a block, 1, width] (what bind_caches
    takes), in the spec's dtype or else `dtype`. ValueError for a tensor whose group has no block count."""
    if missing := sorted({s.group for s in specs} - num_blocks.keys()):
        raise ValueError(f"cache tensors in groups without a block count: {missing}")
    return {s.name: torch.zeros(num_blocks[s.group], s.rows_per_block(block_size), 1, s.width,
                                dtype=s.dtype or dtype, device=device) for s in specs}


def cache_bytes_per_block(specs: list[CacheTensorSpec], block_size: int, dtype: torch.dtype) -> dict[str, int]:
    """Bytes one block (a state group: one slot) of each group takes over all its tensors, groups in spec order
    (arithmetic: nothing is allocated, so a model on the meta device is sized alike)."""
    sizes: dict[str, int] = {}
    for s in specs:
        sizes[s.group] = sizes.get(s.group, 0) + s.rows_per_block(block_size) * s.width * (s.dtype or dtype).itemsize
    return sizes


def tensors_by_group(specs: list[CacheTensorSpec], tensors: dict[str, torch.Tensor]) -> dict[str, list[torch.Tensor]]:
    """The tensors of each group in spec order, groups in spec order: what PD's KV transfer registers and copies
    block by block (block i of a tensor at i * its block bytes), and what graph capture reads."""
    groups: dict[str, list[torch.Tensor]] = {}
    for s in specs:
        groups.setdefault(s.group, []).append(tensors[s.name])
    return groups
