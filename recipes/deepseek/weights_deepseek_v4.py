"""Checkpoint names -> DeepseekV4 parameters, for the publisher's layout and the transformers layout.

The model uses the publisher's names, so that layout maps almost one to one; per-expert w1/w3/w2 tensors
stack into `experts.w13` [E, 2I, D] and `experts.w2` [E, D, I], and shared-expert w1/w3 pack into `w13`.
"""
from __future__ import annotations

import contextlib
import re

import torch

from common.loader import Checkpoint, CheckpointError, load_weights
from config_deepseek_v4 import ModelArgs
from modeling_deepseek_v4 import DeepseekV4

MTP = r"^(model\.)?mtp\."  # the MTP blocks: loaded with load_model(mtp=True), for speculative decoding

# transformers name (without "model.") -> publisher name; applied in order, each at most once
_FROM_TRANSFORMERS = [
    (r"^embed_tokens\.", "embed."),
    (r"^lm_head\.", "head."),
    (r"^hc_head\.hc_(fn|base|scale)$", r"hc_head_\1"),
    (r"\.self_attn\.compressor\.indexer\.scorer\.weights_proj\.", ".attn.indexer.weights_proj."),
    (r"\.self_attn\.compressor\.indexer\.q_b_proj\.", ".attn.indexer.wq_b."),
    (r"\.self_attn\.compressor\.indexer\.", ".attn.indexer.compressor."),
    (r"\.self_attn\.", ".attn."),
    (r"\.mlp\.", ".ffn."),
    (r"\.input_layernorm\.", ".attn_norm."),
    (r"\.post_attention_layernorm\.", ".ffn_norm."),
    (r"\.(attn|ffn)_hc\.(fn|base|scale)$", r".hc_\1_\2"),
    (r"\.attn\.sinks$", ".attn.attn_sink"),
    (r"(compressor)\.kv_norm\.", r"\1.norm."),
    (r"\.attn\.norm\.", ".attn.kv_norm."),  # what transformers' save_pretrained writes back for kv_norm
    (r"\.position_bias$", ".ape"),
    (r"\.q_a_proj\.", ".wq_a."),
    (r"\.q_b_proj\.", ".wq_b."),
    (r"\.q_a_norm\.", ".q_norm."),
    (r"\.kv_proj\.", ".wkv."),
    (r"compressor\.gate_proj\.", "compressor.wgate."),
    (r"\.o_a_proj\.", ".wo_a."),
    (r"\.o_b_proj\.", ".wo_b."),
    (r"\.gate\.e_score_correction_bias$", ".gate.bias"),
    (r"\.shared_experts\.gate_proj\.", ".shared_experts.w1."),
    (r"\.shared_experts\.up_proj\.", ".shared_experts.w3."),
    (r"\.shared_experts\.down_proj\.", ".shared_experts.w2."),
    (r"\.experts\.gate_up_proj(_scale)?$", r".experts.w13\1"),
    (r"\.experts\.down_proj(_scale)?$", r".experts.w2\1"),
]
_EXPERT = re.compile(r"^((?:layers|mtp)\.\d+\.ffn\.experts)\.(\d+)\.(w[123])\.weight(_scale)?$")
_SHARED = re.compile(r"^((?:layers|mtp)\.\d+\.ffn\.shared_experts)\.(w[13])\.weight(_scale)?$")


STACKED = (".experts.w13", ".experts.w2", ".experts.w13_scale", ".experts.w2_scale")
PACKED = STACKED + ("shared_experts.w13.weight", "shared_experts.w13.weight_scale")  # filled slice by slice


def transformers_to_publisher(name: str) -> str:
    name = name.removeprefix("model.")
    for pattern, repl in _FROM_TRANSFORMERS:
        name = re.sub(pattern, repl, name, count=1)
    return name


def rename(name: str, transformers_layout: bool, experts: tuple[int, int, int] | None = None):
    """Checkpoint tensor name -> (parameter name, shard id[, the part of the tensor to read]); None: another rank's.
    experts = (this rank's index, the number of ranks, experts per rank) of the expert-parallel group; None: all."""
    if transformers_layout:
        name = transformers_to_publisher(name)
    if m := _EXPERT.match(name):
        stacked, part = ("w2", None) if m[3] == "w2" else ("w13", 0 if m[3] == "w1" else 1)
        local = int(m[2]) - (0 if experts is None else experts[0] * experts[2])
        if experts is not None and not 0 <= local < experts[2]:
            return None  # another rank's expert: never read
        return f"{m[1]}.{stacked}{m[4] or ''}", (local, part)  # its int8 scale (a quantized checkpoint) alike
    if experts is not None and experts[1] > 1 and name.endswith(STACKED):
        return name, None, (0, experts[0], experts[1])  # transformers' stacked [E, ...]: this rank's experts
    if m := _SHARED.match(name):
        return f"{m[1]}.w13.weight{m[3] or ''}", 0 if m[2] == "w1" else 1
    return name, None


def _packed_loader(param: torch.Tensor, tensor: torch.Tensor, shard) -> None:
    """Fill one slice of a stacked / packed parameter. shard: None (whole), part, or (expert, part)."""
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
    """torch's default dtype set to `dtype` inside the block (the model's float tensors are created in it)."""
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


def load_model(path, dtype: torch.dtype = torch.bfloat16, device="cpu", parallel=None, mtp: bool = False) -> DeepseekV4:
    """Build DeepseekV4 from a checkpoint folder (either layout, FP8 / MXFP4 dequantized on load). With a
    common.parallel.Parallel, this rank's slice of the model, reading only the parts of the tensors it holds.
    mtp: also its MTP blocks (`mtp.<i>.*`, num_nextn_predict_layers of them; CheckpointError if the checkpoint
    has none); without it the `mtp.*` tensors are not read."""
    ckpt = Checkpoint(path)
    args = ModelArgs.from_config(ckpt.config)
    if mtp and not args.num_nextn_predict_layers:
        raise CheckpointError(f"{path}: num_nextn_predict_layers is 0 in config.json: the checkpoint has no MTP layer")
    with torch_default_dtype(dtype), torch.device(device):
        model = DeepseekV4(args, parallel, mtp=mtp)
    for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
        if name.endswith(PACKED):
            tensor.weight_loader = _packed_loader
    layout = any(n.startswith("model.") for n in ckpt.names())
    moe = model.layers[0].ffn
    experts = (moe.ep_rank, moe.ep_size, moe.experts.w13.shape[0])
    load_weights(model, ckpt, lambda n: rename(n, layout, experts), dtype=dtype, ignore=() if mtp else (MTP,))
    model.checkpoint_reads = dict(ckpt.reads)  # what this rank read of the checkpoint: {stored name: bytes}
    return model.eval()
