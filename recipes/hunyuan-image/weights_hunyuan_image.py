"""Load a HunyuanImage-3.0 checkpoint in the publisher's tensor names into HunyuanImage3.

Routed experts are stored one tensor per expert (`mlp.experts.{e}.gate_and_up_proj.weight` / `down_proj.weight`):
each goes into this rank's stacked w13 / w2 slot (experts of other EP ranks are skipped); qkv_proj and o_proj take
this rank's kv groups (attention TP). The vision-understanding tensors (`vision_model.*`, `vision_aligner.*`) are
accepted and not loaded: text-to-image does not use them.
"""
from __future__ import annotations

import re
from pathlib import Path

import torch

from common.loader import Checkpoint, CheckpointError, load_weights
from config_hunyuan_image import SPECIAL_TOKENS, HunyuanImageConfig
from modeling_hunyuan_image import HunyuanImage3

UNUSED_FOR_T2I = re.compile(r"^(vision_model|vision_aligner)\.")
EXPERT = re.compile(r"^(model\.layers\.(\d+)\.mlp\.experts)\.(\d+)\.(gate_and_up_proj|down_proj)\.weight$")


def special_token_ids(tokenizer) -> dict[str, int]:
    """Role -> id, read from the tokenizer (the publisher's tokenizer holds all of them)."""
    ids = {}
    for role, token in SPECIAL_TOKENS.items():
        tid = tokenizer.convert_tokens_to_ids(token)
        if tid is None or tid == tokenizer.unk_token_id:
            raise CheckpointError(f"tokenizer has no special token {token!r} ({role})")
        ids[role] = tid
    return ids


def make_rename(model: HunyuanImage3, with_vae: bool):
    def rename(name: str):
        if UNUSED_FOR_T2I.match(name) or (not with_vae and name.startswith("vae.")):
            return None
        m = EXPERT.match(name)
        if m:
            prefix, layer, expert, kind = m.group(1), int(m.group(2)), int(m.group(3)), m.group(4)
            if not model.model.layers[layer].mlp.experts.owns(expert):
                return None  # another EP rank's expert
            return f"{prefix}.{'w13_weight' if kind == 'gate_and_up_proj' else 'w2_weight'}", expert
        return name
    return rename


def load_model(path, dtype: torch.dtype = torch.float32, tp_group=None, ep_group=None, with_vae: bool = True,
               device: torch.device | str = "cpu") -> HunyuanImage3:
    """HunyuanImage3 from a checkpoint folder onto `device`; the router stays fp32 and the VAE fp32 (it is small)."""
    ckpt = Checkpoint(Path(path))
    try:
        cfg = HunyuanImageConfig.from_config(ckpt.config)
    except (AssertionError, TypeError) as e:
        raise CheckpointError(f"{ckpt.path / 'config.json'}: {e}") from None
    with torch.device("meta"):  # no host memory until the tensors arrive
        model = HunyuanImage3(cfg, tp_group, ep_group, with_vae=with_vae)
    model = model.to_empty(device=device).to(dtype)
    for layer in model.model.layers:
        layer.mlp.gate.float()  # the router is fp32, as published
    if model.vae is not None:
        model.vae.float()
    for module in model.modules():  # to_empty made new parameters: give them their loaders again
        if hasattr(module, "attach_weight_loaders"):
            module.attach_weight_loaders()
    load_weights(model, ckpt, make_rename(model, with_vae))
    for i, layer in enumerate(model.model.layers):
        experts = layer.mlp.experts
        missing = [f"model.layers.{i}.mlp.experts.{e}.{kind}.weight" for e in range(experts.first, experts.first +
                   experts.num_local) for kind in ("gate_and_up_proj", "down_proj") if (kind, e) not in experts.loaded]
        if missing:
            raise CheckpointError(f"{ckpt.path}: {len(missing)} expert tensors missing (w13_weight / w2_weight "
                                  f"slots of this rank): " + ", ".join(missing[:8]))
    return model.eval().requires_grad_(False)
