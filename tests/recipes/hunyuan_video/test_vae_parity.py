"""The recipe's HunyuanVideo VAE decoder against diffusers' AutoencoderKLHunyuanVideo.decode on the same tiny
random checkpoint (publisher names, encoder tensors included), fp32; loading and config checks."""
import json

import pytest
import torch
from diffusers import AutoencoderKLHunyuanVideo
from safetensors.torch import load_file, save_file
from vae_hunyuan_video import TINY_CONFIG, VAEConfig, diffusers_config, load_vae, write_tiny_vae

from common import ops
from common.loader import CheckpointError
from common.ops.emulator import TorchNpuEmulator


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = write_tiny_vae(tmp_path_factory.mktemp("vae") / "vae", seed=0)
    ref = AutoencoderKLHunyuanVideo(**diffusers_config(TINY_CONFIG)).eval()
    ref.load_state_dict(load_file(path / "model.safetensors"), strict=True)  # every tensor, encoder too
    ref.use_framewise_decoding = False  # diffusers' frame-chunked decode blends chunks; compare the plain decode
    return path, load_vae(path), ref


@pytest.mark.parametrize("shape", [(2, 16, 3, 5, 7), (1, 16, 1, 4, 4)])  # batch 2, odd sizes; one frame (image)
def test_decode_matches_diffusers(tiny, shape):
    _, ours, ref = tiny
    z = torch.randn(*shape, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        got, want = ours.decode(z), ref.decode(z).sample
    B, _, t, h, w = shape
    assert got.shape == want.shape == (B, 3, 4 * (t - 1) + 1, 8 * h, 8 * w)
    assert want.abs().mean() > 0.05  # not a degenerate (near-zero) output
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_released_layout_matches_diffusers(tmp_path):
    """The released VAE's block layout (4 up blocks: spatial-only first, then two 2x2x2, then none) at tiny widths."""
    cfg = VAEConfig(block_out_channels=(8, 8, 16, 16), layers_per_block=1, norm_num_groups=4)
    assert cfg.upsample_factors() == VAEConfig().upsample_factors() == [(1, 2, 2), (2, 2, 2), (2, 2, 2), None]
    path = write_tiny_vae(tmp_path / "vae", seed=3, cfg=cfg)
    ref = AutoencoderKLHunyuanVideo(**diffusers_config(cfg)).eval()
    ref.load_state_dict(load_file(path / "model.safetensors"), strict=True)
    ref.use_framewise_decoding = False
    z = torch.randn(1, 16, 2, 3, 2, generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        got, want = load_vae(path).decode(z), ref.decode(z).sample
    assert got.shape == (1, 3, 5, 24, 16)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_released_config_parses_to_the_defaults():
    """hunyuan-video-t2v-720p/vae/config.json as the publisher ships it."""
    released = {
        "_class_name": "AutoencoderKLCausal3D", "_diffusers_version": "0.4.2", "act_fn": "silu",
        "block_out_channels": [128, 256, 512, 512], "down_block_types": ["DownEncoderBlockCausal3D"] * 4,
        "in_channels": 3, "latent_channels": 16, "layers_per_block": 2, "norm_num_groups": 32, "out_channels": 3,
        "sample_size": 256, "sample_tsize": 64, "up_block_types": ["UpDecoderBlockCausal3D"] * 4,
        "scaling_factor": 0.476986, "time_compression_ratio": 4, "mid_block_add_attention": True,
    }
    assert VAEConfig.from_dict(released) == VAEConfig()


def test_publisher_prefix_and_encoder_tensors_are_skipped(tiny, tmp_path):
    """A state dict saved from the publisher's wrapper carries a `vae.` prefix; the encoder halves load nowhere."""
    path, ours, _ = tiny
    tensors = {f"vae.{k}": v for k, v in load_file(path / "model.safetensors").items()}
    assert any(k.startswith("vae.encoder.") for k in tensors) and "vae.quant_conv.weight" in tensors
    save_file(tensors, tmp_path / "model.safetensors")
    (tmp_path / "config.json").write_text((path / "config.json").read_text())
    z = torch.randn(1, 16, 2, 3, 4)
    with torch.no_grad():
        torch.testing.assert_close(load_vae(tmp_path).decode(z), ours.decode(z), rtol=0, atol=0)


def test_missing_decoder_tensor_is_named(tiny, tmp_path):
    path, _, _ = tiny
    tensors = load_file(path / "model.safetensors")
    del tensors["decoder.mid_block.attentions.0.to_q.weight"]
    save_file(tensors, tmp_path / "model.safetensors")
    (tmp_path / "config.json").write_text((path / "config.json").read_text())
    with pytest.raises(CheckpointError, match="to_q.weight"):
        load_vae(tmp_path)


def test_config_is_the_publishers(tiny):
    path, ours, _ = tiny
    saved = json.loads((path / "config.json").read_text())
    assert saved["_class_name"] == "AutoencoderKLCausal3D" and saved["time_compression_ratio"] == 4
    assert VAEConfig.from_dict(saved) == TINY_CONFIG == ours.config
    assert TINY_CONFIG.upsample_factors() == [(2, 2, 2), (2, 2, 2), (1, 2, 2)]  # 4x in time, 8x in space


@pytest.mark.parametrize("fields, message", [
    ({"norm_num_groups": 5}, "multiples of norm_num_groups"),
    ({"time_compression_ratio": 8}, "only 4"),
    ({"spatial_compression_ratio": 6}, "power of 2"),
    ({"act_fn": "gelu"}, "only 'silu'"),
    ({"flux_capacitor": 1}, "unknown fields"),
])
def test_bad_config(fields, message):
    with pytest.raises(ValueError, match=message):
        VAEConfig.from_dict({**json.loads(json.dumps(VAEConfig().to_dict())), **fields})


def test_decode_rejects_wrong_latents(tiny):
    _, ours, _ = tiny
    with pytest.raises(ValueError, match=r"expected latents \[B, 16"):
        ours.decode(torch.zeros(1, 4, 2, 3, 3))


def test_npu_path_emulated(tiny):
    """The decode through common.ops' NPU implementations on CPU (the torch_npu emulator binds each call to the op's
    real schema, then computes the reference). Emulation, not hardware."""
    _, ours, _ = tiny
    z = torch.randn(2, 16, 3, 3, 4, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        want = ours.decode(z)
        emulator = TorchNpuEmulator()
        previous = ops.use_backend("npu", emulator)
        try:
            got = ours.decode(z)
        finally:
            ops.use_backend(previous)
    assert "npu_fused_infer_attention_score" in emulator.calls
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_attention_region_is_a_crop_of_the_whole(tiny):
    """Patch-parallel decode asks the mid-block attention for one patch's queries only."""
    _, ours, _ = tiny
    attn = ours.decoder.mid_block.attentions[0]
    x = torch.randn(2, attn.to_q.in_features, 3, 5, 6)  # [B, C, T, H, W]
    with torch.no_grad():
        whole, region = attn(x), attn.forward_region(x, slice(1, 4), slice(2, 6))
    torch.testing.assert_close(region, whole[..., 1:4, 2:6], rtol=1e-5, atol=1e-6)
