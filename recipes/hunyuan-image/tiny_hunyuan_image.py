"""Write a tiny random HunyuanImage-3.0 checkpoint in the publisher's layout (fixed seed).

Section 6 of the spec: hidden 64, 2 layers, 4 q / 2 kv heads of 16, 4 experts top-2 + a shared MLP, intermediate
32, patch_embed_hidden_dim 32, VAE latent 16 with block_out [32]*5 (16x spatial, 4x temporal), 1 block per level.
Publisher tensor names, experts one tensor per expert ([linear | activated] gate_and_up_proj), a stand-in for the
vision encoder tensors (unused for text-to-image, present in the real checkpoint), and a tokenizer that holds the
special tokens.

    python recipes/hunyuan-image/tiny_hunyuan_image.py weights/hunyuan-image-tiny
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from common.loader import save_checkpoint, write_tokenizer
from config_hunyuan_image import SPECIAL_TOKENS, HunyuanImageConfig
from modeling_hunyuan_image import HunyuanImage3

TINY_CONFIG = dict(
    architectures=["HunyuanImage3ForCausalMM"], model_type="hunyuan_image_3_moe", vocab_size=512, hidden_size=64,
    num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16, attention_head_dim=16,
    intermediate_size=32, moe_intermediate_size=[32, 32], num_experts=4, moe_topk=[2, 2], num_shared_expert=[1, 1],
    use_mixed_mlp_moe=True, use_qk_norm=True, attention_bias=False, mlp_bias=False, hidden_act="silu",
    rms_norm_eps=1e-5, rope_theta=10000.0, rope_scaling={"type": "custom"}, max_position_embeddings=4096,
    img_proj_type="unet", patch_size=1, patch_embed_hidden_dim=32, vae_downsample_factor=[16, 16],
    image_base_size=64, tie_word_embeddings=False, torch_dtype="float32",
    vae=dict(in_channels=3, out_channels=3, latent_channels=16, block_out_channels=[32] * 5, layers_per_block=1,
             ffactor_spatial=16, ffactor_temporal=4, sample_size=64, sample_tsize=4, scaling_factor=0.562679178327931),
)
CHAT_TEMPLATE = "{{ bos_token }}{% for m in messages %}{{ m['content'] }}{% endfor %}"


def _unswap(w: torch.Tensor) -> torch.Tensor:
    """Model layout [activated | linear] -> the publisher's gate_and_up_proj rows [linear | activated]."""
    gate, up = w.chunk(2, dim=0)
    return torch.cat([up, gate], dim=0)


def publisher_state(model: HunyuanImage3) -> dict[str, torch.Tensor]:
    """The model's tensors under the publisher's names (experts unstacked, gate/up halves in their order)."""
    out = {}
    for name, t in model.state_dict().items():
        if name.endswith("mlp.experts.w13_weight") or name.endswith("mlp.experts.w2_weight"):
            prefix, kind = name.rsplit(".", 1)
            for e, w in enumerate(t):
                key = "gate_and_up_proj" if kind == "w13_weight" else "down_proj"
                out[f"{prefix}.{e}.{key}.weight"] = _unswap(w) if kind == "w13_weight" else w.clone()
        elif name.endswith("shared_mlp.gate_and_up_proj.weight"):
            out[name] = _unswap(t)
        else:
            out[name] = t.clone()
    return out


def random_model(cfg: HunyuanImageConfig, seed: int) -> HunyuanImage3:
    torch.manual_seed(seed)
    model = HunyuanImage3(cfg)
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("layernorm.weight") or name.endswith("ln_f.weight"):
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=g))
            elif name.endswith(("w13_weight", "w2_weight")):
                p.copy_(torch.randn(p.shape, generator=g) / p.shape[-1] ** 0.5)
    return model


def write_tiny_checkpoint(path, seed: int = 0, max_shard_bytes: int | None = 512 * 1024, **overrides) -> Path:
    path = Path(path)
    config = {**TINY_CONFIG, **overrides}
    cfg = HunyuanImageConfig.from_config(config)
    state = publisher_state(random_model(cfg, seed))
    g = torch.Generator().manual_seed(seed + 2)  # the vision encoder's names, to show the loader accepts them
    state["vision_model.embeddings.patch_embedding.weight"] = torch.randn(32, 3 * 16 * 16, generator=g)
    state["vision_aligner.layers.0.weight"] = torch.randn(64, 32, generator=g)
    state["vision_aligner.layers.2.weight"] = torch.randn(64, 64, generator=g)
    save_checkpoint(path, state, config, max_shard_bytes=max_shard_bytes)
    write_tokenizer(path, vocab_size=cfg.vocab_size, special_tokens=SPECIAL_TOKENS, chat_template=CHAT_TEMPLATE)
    return path


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out", type=Path)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args()
    write_tiny_checkpoint(a.out, seed=a.seed)
    print(f"wrote {a.out}", file=sys.stderr)
