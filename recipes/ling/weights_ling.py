"""Ling-3.0-Flash checkpoints -> LingForCausalLM parameters.

Reads the publisher's safetensors names (spec "Checkpoint tensor names": `model.word_embeddings`,
`model.layers.N.attention.{q,k,v,f,g,b,o}_proj`, `{q,k,v}_conv1d.weight` [C, 1, K], `dt_bias`, `A_log` ([H], or
vLLM's [1, 1, H, 1]), `o_norm`, the MLA names with `dense`, `mlp.gate.weight` + `mlp.gate.expert_bias`, per-expert
`mlp.experts.E.{gate,up,down}_proj`, `mlp.shared_experts.*`, `model.norm`, `lm_head`), and transformers' own layout
as its state_dict / save_pretrained writes it (`model.embed_tokens`, `self_attn.`, `forget_gate.`, one `conv1d`
[3C, 1, K], MLA `o_proj`, `e_score_correction_bias`, stacked `mlp.experts.gate_up_proj` / `down_proj`). The MTP
layer (`model.layers.{num_hidden_layers}`) loads into `mtp` with `mtp=True` and is never read otherwise. Float
tensors load in the model's dtype except A_log, dt_bias, the conv kernels and the router (weight and bias), which
stay fp32 as upstream keeps them. With a common.parallel.Parallel, each rank reads only its slice: its heads (KDA
and MLA), its experts, its vocabulary rows (transformers' concatenated conv kernel is read whole and sliced).
"""
from __future__ import annotations

import contextlib
import re

import torch

from common import backend
from common.loader import Checkpoint, CheckpointError, load_weights
from config_ling import MLA, ModelArgs
from modeling_ling import LingForCausalLM

_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.*)$")
_EXPERT = re.compile(r"^(.*\.mlp\.experts)\.(\d+)\.(gate|up|down)_proj\.weight$")
_GATE_UP = re.compile(r"^(.*\.mlp(?:\.shared_experts)?)\.(gate|up)_proj\.weight$")
_CONV = re.compile(r"^(.*\.attention)\.(q|k|v)_conv1d\.weight$")
_MTP_SHARED = ("word_embeddings.", "embed_tokens.", "shared_head.")  # an MTP layer's copies of the embedding / head
STACKED = (".experts.gate_up_proj", ".experts.down_proj")
PACKED = ("gate_up_proj.weight",) + STACKED  # filled slice by slice


def _publisher_name(layer_kind: str | None, rest: str) -> str:
    """A layer's tensor name (after `model.layers.N.`) in transformers' layout -> the publisher's."""
    rest = rest.replace("self_attn.", "attention.", 1).replace("attention.forget_gate.", "attention.", 1)
    if layer_kind == MLA:
        rest = rest.replace("attention.o_proj.", "attention.dense.", 1)
    return rest.replace("mlp.gate.e_score_correction_bias", "mlp.gate.expert_bias")


def rename(name: str, args: ModelArgs, mtp: bool, tp: tuple[int, int] = (0, 1),
           experts: tuple[int, int, int] | None = None, ndim=None):
    """Checkpoint tensor name -> (parameter name, shard id[, the part of the tensor to read]); None: not read.
    tp = (this rank's index in attn_tp, its size); experts = (this rank's index in moe_ep, its size, experts per
    rank), None: all experts; ndim(name): a stored tensor's number of dims (for vLLM's 4-D A_log under TP)."""
    stored = name
    if name == "model.embed_tokens.weight" or name == "model.word_embeddings.weight":
        return "word_embeddings.weight", None
    if name.startswith("model.norm.") or name.startswith("lm_head."):
        return name.removeprefix("model."), None
    m = _LAYER.match(name)
    if m is None:
        return name, None  # unexpected: load_weights lists it
    i, rest = int(m[1]), m[2]
    L = args.num_hidden_layers
    if i >= L:  # the MTP layer(s)
        if not mtp or i > L or rest.startswith(_MTP_SHARED):  # one MTP layer is what the model has
            return None
        prefix, kind = "mtp.", MLA
    else:
        prefix, kind = f"layers.{i}.", args.layer_types[i]
    name = prefix + _publisher_name(kind, rest)
    if m := _EXPERT.match(name):
        local = int(m[2]) - (0 if experts is None else experts[0] * experts[2])
        if experts is not None and not 0 <= local < experts[2]:
            return None  # another rank's expert: never read
        return (f"{m[1]}.down_proj", (local, None)) if m[3] == "down" else \
            (f"{m[1]}.gate_up_proj", (local, 0 if m[3] == "gate" else 1))
    if experts is not None and experts[1] > 1 and name.endswith(STACKED):
        return name, None, (0, experts[0], experts[1])  # transformers' stacked [E, ...]: this rank's experts
    if m := _GATE_UP.match(name):
        return f"{m[1]}.gate_up_proj.weight", 0 if m[2] == "gate" else 1
    if m := _CONV.match(name):
        return f"{m[1]}.conv_weight", "qkv".index(m[2])
    if name.endswith(".attention.conv1d.weight"):  # transformers' concatenated kernels [3C, 1, K]: read whole
        return name.removesuffix("conv1d.weight") + "conv_weight", tp, (0, 0, 1)
    if name.endswith(".attention.A_log") and tp[1] > 1 and ndim is not None and ndim(stored) == 4:
        return name, None, (2, *tp)  # vLLM's [1, 1, H, 1]: this rank's heads
    return name, None


def _packed_loader(param: torch.Tensor, tensor: torch.Tensor, shard) -> None:
    """Fill one slice of a packed / stacked parameter. shard: None (whole), half, or (expert, half or None)."""
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


def _conv_loader(param: torch.Tensor, tensor: torch.Tensor, part) -> None:
    """conv_weight [3C, K] (C: this rank's channels) from the publisher's q / k / v kernel (part 0 / 1 / 2, [C, 1, K]
    each, this rank's rows) or transformers' concatenated [3 * P * C, 1, K], read whole (part = (attention-TP rank,
    P)): this rank's rows of each third."""
    target = param.data
    if isinstance(part, int):
        C = target.shape[0] // 3
        target = target[part * C : (part + 1) * C]
    else:
        rank, size = part
        if tensor.shape[0] != 3 * size * (target.shape[0] // 3):
            raise ValueError(f"conv kernel {tuple(tensor.shape)} does not fit {size} x [{target.shape[0]}, 1, "
                             f"{target.shape[1]}]")
        tensor = tensor.view(3, size, target.shape[0] // 3, *tensor.shape[1:])[:, rank].flatten(0, 1)  # [3C, 1, K]
    if tensor.dim() != 3 or tensor.shape[1] != 1 or tensor.shape[::2] != target.shape:
        raise ValueError(f"conv kernel {tuple(tensor.shape)} does not fit [{target.shape[0]}, 1, {target.shape[1]}]")
    target.copy_(tensor[:, 0])


def _a_log_loader(param: torch.Tensor, tensor: torch.Tensor, _) -> None:
    """A_log [H] from [H] or vLLM's accepted [1, 1, H, 1]."""
    if tensor.numel() != param.numel() or tensor.squeeze().dim() > 1:
        raise ValueError(f"A_log {tuple(tensor.shape)} does not fit {tuple(param.shape)}")
    param.data.copy_(tensor.reshape(param.shape))


@contextlib.contextmanager
def torch_default_dtype(dtype: torch.dtype):
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


def load_into(model: LingForCausalLM, ckpt: Checkpoint) -> None:
    """Fill a built LingForCausalLM from a checkpoint (the MTP layer's tensors only if the model has it)."""
    for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
        if name.endswith(PACKED):
            tensor.weight_loader = _packed_loader
        elif name.endswith(".attention.conv_weight"):
            tensor.weight_loader = _conv_loader
        elif name.endswith(".attention.A_log"):
            tensor.weight_loader = _a_log_loader
    parallel = model.parallel
    tp = (parallel.rank_in("attn_tp"), parallel.size("attn_tp"))
    moe = next((layer.mlp for layer in model.layers if hasattr(layer.mlp, "experts")), None)
    experts = None if moe is None else (moe.ep_rank, moe.ep_size, moe.experts.gate_up_proj.shape[0])
    load_weights(model, ckpt, lambda n: rename(n, model.args, model.mtp is not None, tp, experts,
                                                lambda name: len(ckpt.shape(name))))


def load_model(path, dtype: torch.dtype = torch.bfloat16, device="cpu", mtp: bool = False,
               parallel=None) -> LingForCausalLM:
    """LingForCausalLM from a checkpoint folder (model_type bailing_hybrid), float tensors in `dtype` except the
    fp32 ones (A_log, dt_bias, conv kernels, router weight and bias). mtp: also the MTP layer (CheckpointError if
    config.json has none). With a common.parallel.Parallel, this rank's slice, reading only the parts of the
    tensors it holds. `model.checkpoint_reads`: {stored name: bytes read}."""
    ckpt = Checkpoint(path)
    args = ModelArgs.from_config(ckpt.config)
    if mtp and not args.num_nextn_predict_layers:
        raise CheckpointError(f"{path}: num_nextn_predict_layers is 0 in config.json: the checkpoint has no MTP layer")
    with torch_default_dtype(dtype), torch.device(device):
        model = LingForCausalLM(args, mtp=mtp, parallel=parallel)
    load_into(model, ckpt)
    model.checkpoint_reads = dict(ckpt.reads)
    return model.eval()


def model_bytes(args: ModelArgs, dtype: torch.dtype, mtp: bool = False) -> int:
    """The model's parameter and buffer bytes in `dtype` (built on the meta device: exact, nothing allocated)."""
    with torch_default_dtype(dtype), torch.device("meta"):
        model = LingForCausalLM(args, mtp=mtp)
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
                         f"{available / 2**30:.2f} GiB of {where} memory is free: use a multi-rank preset "
                         "(attention TP, expert parallel)")
