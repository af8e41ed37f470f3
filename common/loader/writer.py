"""Write an HF-layout checkpoint: config.json plus model.safetensors, or shards and model.safetensors.index.json.
Same inputs, same bytes."""
import json
from collections.abc import Callable, Mapping
from pathlib import Path

import torch
from safetensors.torch import save_file

INDEX = "model.safetensors.index.json"


def save_checkpoint(path, tensors: dict[str, torch.Tensor], config: dict, max_shard_bytes: int | None = None) -> Path:
    return save_checkpoint_lazily(path, {n: t.numel() * t.element_size() for n, t in tensors.items()},
                                  tensors.__getitem__, config, max_shard_bytes)


def save_checkpoint_lazily(path, sizes: Mapping[str, int], make: Callable[[str], torch.Tensor], config: dict,
                           max_shard_bytes: int | None = None) -> Path:
    """save_checkpoint for tensors made one at a time: sizes {name: bytes} plans the shards, make(name) gives each
    tensor when its shard is written (names in sorted order), so memory holds one shard, not the checkpoint."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    for old in [*path.glob("model*.safetensors"), *path.glob(INDEX)]:
        old.unlink()
    (path / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    shards, size = [[]], 0
    for name in sorted(sizes):
        if max_shard_bytes is not None and shards[-1] and size + sizes[name] > max_shard_bytes:
            shards, size = shards + [[]], 0
        shards[-1].append(name)
        size += sizes[name]
    files = ["model.safetensors"] if len(shards) == 1 else \
        [f"model-{i:05d}-of-{len(shards):05d}.safetensors" for i in range(1, len(shards) + 1)]
    for file, names in zip(files, shards):
        shard = {}
        for n in names:
            shard[n] = make(n).detach().cpu().clone(memory_format=torch.contiguous_format)
            if shard[n].numel() * shard[n].element_size() != sizes[n]:
                raise ValueError(f"{n}: {shard[n].numel() * shard[n].element_size()} bytes made, {sizes[n]} planned")
        save_file(shard, path / file, metadata={"format": "pt"})
    if len(shards) > 1:
        weight_map = {name: file for file, names in zip(files, shards) for name in names}
        index = {"metadata": {"total_size": sum(sizes.values())}, "weight_map": weight_map}
        (path / INDEX).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    return path
