"""HF checkpoints of the MLA family -> DeepseekV3 parameters.

Reads the publisher's layout (per-expert `mlp.experts.N.{gate,up,down}_proj`, FP8 e4m3 weights with a
`weight_scale_inv` per 128 x 128 block, dequantized on load) and plain bf16 / fp32 HF layouts, including
transformers' stacked `mlp.experts.gate_up_proj` / `down_proj`. Dense and shared MLP gate / up projections pack
into `gate_up_proj`. The multi-token-prediction layers (`model.layers.{num_hidden_layers + i}`) load into
`mtp.{i}` with `mtp=True` (their `embed_tokens` / `shared_head.head` copies of the main embedding and head are not
read) and are not read otherwise. With a common.parallel.Parallel, each rank reads only its slice: its heads, its
experts, its vocabulary rows.
"""
from __future__ import annotations

import contextlib
import re

import torch

from common import backend
from common.loader import Checkpoint, CheckpointError, load_weights
from config_deepseek_v3 import ModelArgs
from modeling_deepseek_v3 import DeepseekV3

_EXPERT = re.compile(r"^((?:model\.layers|mtp)\.\d+\.mlp\.experts)\.(\d+)\.(gate|up|down)_proj\.weight(_scale)?$")
_GATE_UP = re.compile(r"^((?:model\.layers|mtp)\.\d+\.mlp(?:\.shared_experts)?)\.(gate|up)_proj\.weight(_scale)?$")
_LAYER = re.compile(r"^model\.layers\.(\d+)\.")
_MTP_SHARED = ("embed_tokens.", "shared_head.head.")  # an MTP layer's copies of the main embedding / LM head
STACKED = (".experts.gate_up_proj", ".experts.down_proj", ".experts.gate_up_proj_scale", ".experts.down_proj_scale")
PACKED = STACKED + ("gate_up_proj.weight", "gate_up_proj.weight_scale")  # filled slice by slice


def rename(name: str, num_layers: int, num_mtp: int = 0, experts: tuple[int, int, int] | None = None):
    """Checkpoint tensor name -> (parameter name, shard id[, the part of the tensor to read]); None: not read.
    num_mtp: MTP layers loaded (`model.layers.{num_layers + i}` -> `mtp.{i}`); experts = (this rank's index in
    the expert-parallel group, the group's size, experts per rank), None: all experts."""
    if (m := _LAYER.match(name)) and int(m[1]) >= num_layers:
        i, rest = int(m[1]) - num_layers, name[m.end():]
        if i >= num_mtp or rest.startswith(_MTP_SHARED):
            return None
        name = f"mtp.{i}.{rest}"
    if m := _EXPERT.match(name):
        local = int(m[2]) - (0 if experts is None else experts[0] * experts[2])
        if experts is not None and not 0 <= local < experts[2]:
            return None  # another rank's expert: never read
        suffix = "_scale" if m[4] else ""  # a w8a8 checkpoint's per-channel scale goes where its weight goes
        if m[3] == "down":
            return f"{m[1]}.down_proj{suffix}", (local, None)
        return f"{m[1]}.gate_up_proj{suffix}", (local, 0 if m[3] == "gate" else 1)
    if experts is not None and experts[1] > 1 and name.endswith(STACKED):
        return name, None, (0, experts[0], experts[1])  # transformers' stacked [E, ...]: this rank's experts
    if m := _GATE_UP.match(name):
        return f"{m[1]}.gate_up_proj.weight{m[3] or ''}", 0 if m[2] == "gate" else 1
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


def load_into(model: DeepseekV3, ckpt: Checkpoint) -> None:
    """Fill a built DeepseekV3 from a checkpoint (FP8 dequantized, w8a8 as stored, only the slices this rank
    holds read, the MTP layers' tensors only if the model has them): what load_model does once it has built the
    model, and what a model another framework builds (vLLM's) reads."""
    for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
        if name.endswith(PACKED):
            tensor.weight_loader = _packed_loader
    moe = next((layer.mlp for layer in model.model.layers if hasattr(layer.mlp, "experts")), None)
    experts = None if moe is None else (moe.ep_rank, moe.ep_size, moe.experts.gate_up_proj.shape[0])
    load_weights(model, ckpt, lambda n: rename(n, model.args.num_hidden_layers, len(model.mtp), experts))


def load_model(path, dtype: torch.dtype = torch.bfloat16, device="cpu", parallel=None, mtp: bool = False) -> DeepseekV3:
    """DeepseekV3 from a checkpoint folder (model_type deepseek_v3, deepseek_v32 or kimi_k2), FP8 dequantized;
    float tensors in `dtype` except the router and its bias, kept fp32 as upstream. A w8a8 checkpoint
    (convert_checkpoint.py) loads its int8 weights and fp32 per-channel scales as stored. dtype float16 (Atlas
    300I / 310P, no bf16): fp16 weights and GEMMs, the residual stream in fp32 (modeling_deepseek_v3.residual_dtype). With a
    common.parallel.Parallel, this rank's slice, reading only the parts of the tensors it holds. mtp: also the
    MTP layers (CheckpointError if config.json has none). `model.checkpoint_reads`: {stored name: bytes read}."""
    ckpt = Checkpoint(path)
    args = ModelArgs.from_config(ckpt.config)
    if mtp and not args.num_nextn_predict_layers:
        raise CheckpointError(f"{path}: num_nextn_predict_layers is 0 in config.json: the checkpoint has no MTP layer")
    with torch_default_dtype(dtype), torch.device(device):
        model = DeepseekV3(args, parallel, mtp=mtp)
    load_into(model, ckpt)
    model.checkpoint_reads = dict(ckpt.reads)
    return model.eval()


def model_bytes(args: ModelArgs, dtype: torch.dtype, mtp: bool = False) -> int:
    """The model's parameter and buffer bytes in `dtype` on one process (built on the meta device: exact)."""
    with torch_default_dtype(dtype), torch.device("meta"):
        model = DeepseekV3(args, mtp=mtp)
    return sum(t.nbytes for t in model.state_dict().values())


def check_fits(args: ModelArgs, dtype: torch.dtype, device="cpu", mtp: bool = False,
               available: int | None = None) -> None:
    """ValueError, with the arithmetic, when the weights cannot fit one process's memory (host memory on a CPU
    device, else the device's free memory) before anything is loaded. available: free bytes (default: measured)."""
    need = model_bytes(args, dtype, mtp)
    on_cpu = torch.device(device).type == "cpu"
    if available is None:
        available = backend.host_memory_available() if on_cpu else backend.memory_info()[0]
    if need > available:
        where = "host" if on_cpu else "device"
        raise ValueError(f"the weights need {need / 2**30:.2f} GiB in {backend.dtype_name(dtype)}, and "
                         f"{available / 2**30:.2f} GiB of {where} memory is free: use a multi-rank preset")
