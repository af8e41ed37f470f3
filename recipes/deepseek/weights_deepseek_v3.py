"""HF checkpoints of the MLA family -> DeepseekV3 parameters.

Reads the publisher's layout (per-expert `mlp.experts.N.{gate,up,down}_proj`, FP8 e4m3 weights with a
`weight_scale_inv` per 128 x 128 block, dequantized on load) and plain bf16 / fp32 HF layouts, including
transformers' stacked `mlp.experts.gate_up_proj` / `down_proj`. Dense and shared MLP gate / up projections pack
into `gate_up_proj`; the multi-token-prediction layers (`model.layers.{num_hidden_layers}+`) are not read.
"""
from __future__ import annotations

import contextlib
import re

import torch

from common.loader import Checkpoint, load_weights
from config_deepseek_v3 import ModelArgs
from modeling_deepseek_v3 import DeepseekV3

_EXPERT = re.compile(r"^(model\.layers\.\d+\.mlp\.experts)\.(\d+)\.(gate|up|down)_proj\.weight$")
_GATE_UP = re.compile(r"^(model\.layers\.\d+\.mlp(?:\.shared_experts)?)\.(gate|up)_proj\.weight$")
_LAYER = re.compile(r"^model\.layers\.(\d+)\.")
PACKED = (".experts.gate_up_proj", ".experts.down_proj", "gate_up_proj.weight")  # filled slice by slice


def rename(name: str, num_layers: int):
    """Checkpoint tensor name -> (parameter name, shard id); None: not read (an MTP layer)."""
    if (m := _LAYER.match(name)) and int(m[1]) >= num_layers:
        return None
    if m := _EXPERT.match(name):
        if m[3] == "down":
            return f"{m[1]}.down_proj", (int(m[2]), None)
        return f"{m[1]}.gate_up_proj", (int(m[2]), 0 if m[3] == "gate" else 1)
    if m := _GATE_UP.match(name):
        return f"{m[1]}.gate_up_proj.weight", 0 if m[2] == "gate" else 1
    return name, None


def _packed_loader(param: torch.Tensor, tensor: torch.Tensor, shard) -> None:
    """Fill one slice of a stacked / packed parameter. shard: None (whole), half, or (expert, half or None)."""
    target = param.data
    if isinstance(shard, tuple):
        expert, shard = shard
        target = target[expert]
    if shard is not None:
        half = target.shape[0] // 2
        target = target[shard * half : (shard + 1) * half]
    if target.shape != tensor.shape:
        raise ValueError(f"shape {tuple(tensor.shape)} does not fit slice {shard} of shape {tuple(target.shape)}")
    target.copy_(tensor)


@contextlib.contextmanager
def torch_default_dtype(dtype: torch.dtype):
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


def load_model(path, dtype: torch.dtype = torch.bfloat16, device="cpu") -> DeepseekV3:
    """DeepseekV3 from a checkpoint folder (model_type deepseek_v3, deepseek_v32 or kimi_k2), FP8 dequantized;
    float tensors in `dtype` except the router and its bias, kept fp32 as upstream."""
    ckpt = Checkpoint(path)
    args = ModelArgs.from_config(ckpt.config)
    with torch_default_dtype(dtype), torch.device(device):
        model = DeepseekV3(args)
    for name, tensor in model.named_parameters():
        if name.endswith(PACKED):
            tensor.weight_loader = _packed_loader
    load_weights(model, ckpt, lambda n: rename(n, args.num_hidden_layers))
    return model.eval()
