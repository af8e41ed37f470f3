"""Load a checkpoint into a model, nano-vllm style: a rename maps checkpoint names to parameters, and a parameter
that knows how to take its shard (a fused qkv, experts stacked into one [E, ...] tensor, a TP slice) carries a
`weight_loader(param, tensor, shard_id)`. Under TP / EP a rank loads only its part: a parameter carrying
`param.shard = (dim, index, count)` (or a rename giving one) is read as that part of each tensor (Checkpoint.get's
shard), and a rename that returns None skips the experts the rank does not own, so their bytes are never read."""
import re
from collections.abc import Callable

import torch
from torch import nn

from .checkpoint import FLOAT_DTYPES, Checkpoint
from .errors import CheckpointError

Rename = Callable[[str], "str | tuple[str, object] | tuple[str, object, tuple[int, int, int]] | None"]


def load_weights(model: nn.Module, checkpoint, rename: Rename | None = None, dtype: torch.dtype | None = None,
                 ignore=()) -> list[str]:
    """Fill every parameter and persistent buffer of `model` from `checkpoint` (a Checkpoint or a folder).

    rename(name) -> None (skip the tensor: it is never read), param_name, (param_name, shard_id), or (param_name,
    shard_id, part). Float targets get tensors dequantized / cast to `dtype` (default: the target's dtype). Only a
    part = (dim, index, count) of the tensor is read where the rename gives one, or else the target carries one as
    `param.shard` (its shape check and weight_loader see the part). Raises CheckpointError listing the targets never
    filled (unless `param.optional`) and the tensors whose target is not in the model (unless a regex in `ignore`
    matches the checkpoint name). Returns the checkpoint names loaded.
    """
    ckpt = checkpoint if isinstance(checkpoint, Checkpoint) else Checkpoint(checkpoint)
    targets = dict(model.named_parameters(remove_duplicate=False)) | dict(model.named_buffers(remove_duplicate=False))
    filled, loaded, unexpected = set(), [], []
    for name in ckpt.names():
        target = rename(name) if rename else name
        if target is None:
            continue
        param_name, shard_id, part = (target, None, None) if isinstance(target, str) else (*target, None)[:3]
        param = targets.get(param_name)
        if param is None:
            if not any(re.search(pattern, name) for pattern in ignore):
                unexpected.append(f"{ckpt.file(name)}: {name} -> {param_name}")
            continue
        tensor = ckpt.get(name, (dtype or param.dtype) if param.dtype in FLOAT_DTYPES else None,
                          shard=part if part is not None else getattr(param, "shard", None))
        with torch.no_grad():
            _load_one(param, tensor, shard_id, f"{ckpt.file(name)}: tensor {name!r} -> {param_name}")
        filled.add(id(param))
        loaded.append(name)
    required = model.state_dict(keep_vars=True)  # parameters and persistent buffers
    missing = [n for n, t in required.items() if id(t) not in filled and not getattr(t, "optional", False)]
    if missing or unexpected:
        raise CheckpointError(f"{ckpt.path}: checkpoint does not match the model" + _listing("missing", missing)
                              + _listing("unexpected (not in the model)", unexpected))
    return loaded


def _load_one(param: torch.Tensor, tensor: torch.Tensor, shard_id, where: str):
    weight_loader = getattr(param, "weight_loader", None)
    if weight_loader is None:
        if tensor.shape != param.shape:
            raise CheckpointError(f"{where}: shape {list(tensor.shape)} does not match {list(param.shape)}")
        param.copy_(tensor)
        return
    try:
        weight_loader(param, tensor, shard_id)
    except CheckpointError:
        raise
    except Exception as e:
        raise CheckpointError(f"{where} (shard {shard_id!r}): {type(e).__name__}: {e}") from e


def _listing(title: str, items: list[str], limit: int = 20) -> str:
    if not items:
        return ""
    more = f"\n  ... and {len(items) - limit} more" if len(items) > limit else ""
    return f"\n{len(items)} {title}:\n  " + "\n  ".join(items[:limit]) + more
