"""The DiT's checkpoint: load (publisher names, safetensors), a tiny random writer, and the diffusers naming.

The folder is `<root>/hunyuan-video-t2v-720p/transformers/`: config.json (HunyuanVideoConfig fields, the
publisher's names) + model.safetensors (or shards + index), tensors named as the publisher's
HYVideoDiffusionTransformer state dict, which is also this model's parameter names, so loading is by name.

publisher_to_diffusers follows diffusers' scripts/convert_hunyuan_video_to_diffusers.py: fused qkv / linear1 are
split into to_q / to_k / to_v (+ proj_mlp), the final adaLN's (shift, scale) halves swap to (scale, shift), the
rest is a rename. It feeds diffusers' HunyuanVideoTransformer3DModel(**diffusers_config(cfg)) for parity tests and
the bench.
"""
from __future__ import annotations

import re
from pathlib import Path

import torch
from config_hunyuan_video import HunyuanVideoConfig
from modeling_hunyuan_video import HunyuanVideoTransformer3D

from common.loader import Checkpoint, load_weights, save_checkpoint

__all__ = [
    "HunyuanVideoConfig",
    "diffusers_config",
    "load_transformer",
    "publisher_to_diffusers",
    "random_state_dict",
    "tiny_config",
    "write_tiny_transformer",
]

TINY = dict(hidden_size=64, heads_num=2, rope_dim_list=(8, 12, 12), mm_double_blocks_depth=2,
            mm_single_blocks_depth=2, text_states_dim=32, text_states_dim_2=16)


def load_transformer(path, dtype: torch.dtype = torch.bfloat16, device="cpu") -> HunyuanVideoTransformer3D:
    """The DiT from a checkpoint folder; CheckpointError on a missing or unexpected tensor, a wrong shape."""
    ckpt = Checkpoint(path)
    cfg = HunyuanVideoConfig.from_dict(ckpt.config)
    with torch.device("meta"):
        model = HunyuanVideoTransformer3D(cfg)
    model = model.to(dtype).to_empty(device=device)  # no random init of billions of parameters
    load_weights(model, ckpt, dtype=dtype)
    return model.eval()


def tiny_config(**overrides) -> HunyuanVideoConfig:
    """hidden 64 = 2 heads x 32 (RoPE 8 + 12 + 12), 2 double + 2 single blocks, text dims 32 / 16."""
    return HunyuanVideoConfig(**{**TINY, **overrides})


def random_state_dict(cfg: HunyuanVideoConfig, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random fp32 weights in the publisher's names. Unlike the publisher's init, nothing is zero (modulation,
    final layer) and norm weights are not all one, so every parameter shows up in the output."""
    torch.manual_seed(seed)
    model = HunyuanVideoTransformer3D(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1 and ("norm" in name and name.endswith("weight")):
                p.copy_(1 + 0.1 * torch.randn_like(p))
            elif p.dim() == 1:
                p.copy_(0.05 * torch.randn_like(p))
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def write_tiny_transformer(path, seed: int = 0, dtype: torch.dtype = torch.float32, **overrides) -> Path:
    """A random DiT checkpoint (tiny_config(**overrides)) in the publisher's names; returns the folder."""
    cfg = tiny_config(**overrides)
    tensors = {k: v.to(dtype) for k, v in random_state_dict(cfg, seed).items()}
    return save_checkpoint(path, tensors, cfg.to_dict())


def diffusers_config(cfg: HunyuanVideoConfig) -> dict:
    """Keyword arguments of diffusers' HunyuanVideoTransformer3DModel for the same architecture."""
    pt, ph, pw = cfg.patch_size
    if ph != pw:
        raise ValueError(f"diffusers needs square spatial patches, got {cfg.patch_size}")
    return dict(in_channels=cfg.in_channels, out_channels=cfg.out_channels, num_attention_heads=cfg.heads_num,
                attention_head_dim=cfg.head_dim, num_layers=cfg.mm_double_blocks_depth,
                num_single_layers=cfg.mm_single_blocks_depth, num_refiner_layers=2, mlp_ratio=cfg.mlp_width_ratio,
                patch_size=ph, patch_size_t=pt, qk_norm="rms_norm", guidance_embeds=cfg.guidance_embed,
                text_embed_dim=cfg.text_states_dim, pooled_projection_dim=cfg.text_states_dim_2,
                rope_theta=cfg.rope_theta, rope_axes_dim=tuple(cfg.rope_dim_list))


_MLP = {"fc1": "net.0.proj", "fc2": "net.2"}
_TOP = {  # whole-prefix renames outside the blocks
    "img_in.proj": "x_embedder.proj",
    "time_in.mlp.0": "time_text_embed.timestep_embedder.linear_1",
    "time_in.mlp.2": "time_text_embed.timestep_embedder.linear_2",
    "guidance_in.mlp.0": "time_text_embed.guidance_embedder.linear_1",
    "guidance_in.mlp.2": "time_text_embed.guidance_embedder.linear_2",
    "vector_in.in_layer": "time_text_embed.text_embedder.linear_1",
    "vector_in.out_layer": "time_text_embed.text_embedder.linear_2",
    "txt_in.input_embedder": "context_embedder.proj_in",
    "txt_in.t_embedder.mlp.0": "context_embedder.time_text_embed.timestep_embedder.linear_1",
    "txt_in.t_embedder.mlp.2": "context_embedder.time_text_embed.timestep_embedder.linear_2",
    "txt_in.c_embedder.linear_1": "context_embedder.time_text_embed.text_embedder.linear_1",
    "txt_in.c_embedder.linear_2": "context_embedder.time_text_embed.text_embedder.linear_2",
    "final_layer.linear": "proj_out",
}
_REFINER = {"norm1": "norm1", "norm2": "norm2", "self_attn_proj": "attn.to_out.0", "mlp.fc1": "ff.net.0.proj",
            "mlp.fc2": "ff.net.2", "adaLN_modulation.1": "norm_out.linear"}
_DOUBLE = {"img_mod.linear": "norm1.linear", "txt_mod.linear": "norm1_context.linear",
           "img_attn_q_norm": "attn.norm_q", "img_attn_k_norm": "attn.norm_k",
           "txt_attn_q_norm": "attn.norm_added_q", "txt_attn_k_norm": "attn.norm_added_k",
           "img_attn_proj": "attn.to_out.0", "txt_attn_proj": "attn.to_add_out",
           **{f"img_mlp.{k}": f"ff.{v}" for k, v in _MLP.items()},
           **{f"txt_mlp.{k}": f"ff_context.{v}" for k, v in _MLP.items()}}
_SINGLE = {"linear2": "proj_out", "q_norm": "attn.norm_q", "k_norm": "attn.norm_k", "modulation.linear": "norm.linear"}
_QKV = {"self_attn_qkv": ("attn.to_q", "attn.to_k", "attn.to_v"),
        "img_attn_qkv": ("attn.to_q", "attn.to_k", "attn.to_v"),
        "txt_attn_qkv": ("attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj")}
_BLOCK = re.compile(
    r"^(txt_in\.individual_token_refiner\.blocks|double_blocks|single_blocks)\.(\d+)\.(.+)\.(weight|bias)$")
_BLOCK_PREFIX = {"txt_in.individual_token_refiner.blocks": ("context_embedder.token_refiner.refiner_blocks", _REFINER),
                 "double_blocks": ("transformer_blocks", _DOUBLE),
                 "single_blocks": ("single_transformer_blocks", _SINGLE)}


def publisher_to_diffusers(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The publisher's DiT state dict -> diffusers' HunyuanVideoTransformer3DModel state dict (tensors shared or
    sliced, not copied). Raises KeyError on a name it does not know."""
    hidden = state_dict["img_in.proj.weight"].shape[0]
    out = {}
    for name, tensor in state_dict.items():
        if m := _BLOCK.match(name):
            prefix, index, sub, kind = m.groups()
            new_prefix, table = _BLOCK_PREFIX[prefix]
            base = f"{new_prefix}.{index}"
            if sub in _QKV:
                for part, t in zip(_QKV[sub], tensor.chunk(3, dim=0)):
                    out[f"{base}.{part}.{kind}"] = t
            elif prefix == "single_blocks" and sub == "linear1":
                parts = tensor.split([hidden, hidden, hidden, tensor.shape[0] - 3 * hidden], dim=0)
                for part, t in zip(("attn.to_q", "attn.to_k", "attn.to_v", "proj_mlp"), parts):
                    out[f"{base}.{part}.{kind}"] = t
            else:
                out[f"{base}.{table[sub]}.{kind}"] = tensor
        elif name.startswith("final_layer.adaLN_modulation.1."):
            shift, scale = tensor.chunk(2, dim=0)
            out[name.replace("final_layer.adaLN_modulation.1", "norm_out.linear")] = torch.cat([scale, shift])
        else:
            prefix, kind = name.rsplit(".", 1)
            out[f"{_TOP[prefix]}.{kind}"] = tensor
    return out
