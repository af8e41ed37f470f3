"""Write the tiny random MagiHuman model set (fixed seed) in the layout the pipeline reads:

    <dir>/base, distill, 540p_sr, 1080p_sr   DiT folders: config.json + model.safetensors, publisher names and dtypes
    <dir>/text_encoder                       transformers T5GemmaEncoderModel (save_pretrained) + tokenizer
    <dir>/vae                                diffusers AutoencoderKLWan, Wan2.2 layout (z 48, patch 2, 16x spatial)
    <dir>/audio_vae                          diffusers AutoencoderOobleck (64 latent channels, 2048x, stereo)

    python recipes/magihuman/tiny_magihuman.py weights/magihuman-tiny
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from common.loader import save_checkpoint, write_tokenizer
from config_magihuman import VARIANTS, tiny_config
from modeling_magihuman import MagiHumanDiT

TEXT_HIDDEN = 32
TINY_FORMAT = 2  # bump when the writer changes: run.sh rewrites a model set whose stamp differs
STAMP = "tiny_format.txt"


def random_dit_tensors(config, seed: int) -> dict[str, torch.Tensor]:
    """Every tensor of the module tree, random, in the publisher's dtypes (norm weights small, not zero)."""
    gen = torch.Generator().manual_seed(seed)
    model = MagiHumanDiT(config, torch.bfloat16)
    tensors = {}
    for name, t in model.state_dict().items():
        if name.endswith("rope.bands"):
            tensors[name] = t.clone()
        elif t.ndim == 1:  # norm weights (w = gamma - 1) and embedder biases
            tensors[name] = (0.1 * torch.randn(t.shape, generator=gen)).to(t.dtype)
        else:
            std = t.shape[1] ** -0.5
            tensors[name] = (std * torch.randn(t.shape, generator=gen)).to(t.dtype)
    return tensors


def write_text_encoder(path: Path) -> None:
    from transformers import T5GemmaConfig, T5GemmaEncoderModel

    module = dict(vocab_size=320, hidden_size=TEXT_HIDDEN, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=2, num_key_value_heads=1, head_dim=16, query_pre_attn_scalar=16,
                  sliding_window=16, pad_token_id=0, eos_token_id=1, bos_token_id=2)
    torch.manual_seed(1)
    config = T5GemmaConfig(encoder=module, decoder=module, vocab_size=320, is_encoder_decoder=False,
                           pad_token_id=0, eos_token_id=1, bos_token_id=2)
    T5GemmaEncoderModel(config).eval().save_pretrained(path)
    write_tokenizer(path, vocab_size=320, special_tokens={"pad": "<pad>", "eos": "<eos>", "bos": "<bos>"},
                    chat_template="", model_max_length=640)


def write_vaes(path: Path) -> None:
    from diffusers import AutoencoderKLWan, AutoencoderOobleck

    torch.manual_seed(2)
    gen = torch.Generator().manual_seed(3)
    mean, std = (0.1 * torch.randn(48, generator=gen)).tolist(), (1 + 0.2 * torch.rand(48, generator=gen)).tolist()
    AutoencoderKLWan(base_dim=8, decoder_base_dim=8, z_dim=48, dim_mult=[1, 2, 2, 2], num_res_blocks=1,
                     temperal_downsample=[False, True, True], is_residual=True, in_channels=12, out_channels=12,
                     patch_size=2, scale_factor_temporal=4, scale_factor_spatial=16, latents_mean=mean,
                     latents_std=std).eval().save_pretrained(path / "vae")
    AutoencoderOobleck(encoder_hidden_size=8, downsampling_ratios=[2, 4, 4, 8, 8], channel_multiples=[1, 2, 2, 2, 2],
                       decoder_channels=8, decoder_input_channels=64, audio_channels=2,
                       sampling_rate=44100).eval().save_pretrained(path / "audio_vae")


def write_tiny_models(path) -> Path:
    path = Path(path)
    for seed, variant in enumerate(VARIANTS):
        config = tiny_config(variant)
        save_checkpoint(path / variant, random_dit_tensors(config, seed=10 + seed), config.to_dict())
    write_text_encoder(path / "text_encoder")
    write_vaes(path)
    (path / STAMP).write_text(f"{TINY_FORMAT}\n")
    return path


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("path", type=Path)
    write_tiny_models(p.parse_args(argv).path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
