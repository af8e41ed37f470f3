"""Write an HF-layout checkpoint: config.json plus model.safetensors, or shards and model.safetensors.index.json.
Same inputs, same bytes."""
import json
from pathlib import Path

import torch
from safetensors.torch import save_file

INDEX = "model.safetensors.index.json"


def save_checkpoint(path, tensors: dict[str, torch.Tensor], config: dict, max_shard_bytes: int | None = None) -> Path:
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    for old in [*path.glob("model*.safetensors"), *path.glob(INDEX)]:
        old.unlink()
    (path / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    shards, size = [[]], 0
    for name in sorted(tensors):
        nbytes = tensors[name].numel() * tensors[name].element_size()
        if max_shard_bytes is not None and shards[-1] and size + nbytes > max_shard_bytes:
            shards, size = shards + [[]], 0
        shards[-1].append(name)
        size += nbytes
    files = ["model.safetensors"] if len(shards) == 1 else \
        [f"model-{i:05d}-of-{len(shards):05d}.safetensors" for i in range(1, len(shards) + 1)]
    for file, names in zip(files, shards):
        shard = {n: tensors[n].detach().cpu().clone(memory_format=torch.contiguous_format) for n in names}
        save_file(shard, path / file, metadata={"format": "pt"})
    if len(shards) > 1:
        total = sum(t.numel() * t.element_size() for t in tensors.values())
        weight_map = {name: file for file, names in zip(files, shards) for name in names}
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (path / INDEX).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    return path
