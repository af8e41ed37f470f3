"""Tiled VAE decode: exact for a pointwise decoder; close to untiled for a tiny random AutoencoderKLHunyuanVideo."""
import pytest
import torch

from common.diffusion.vae_tiling import tiled_decode


def _pointwise_decoder(scale, seed=0):
    w = torch.randn(3, 4, generator=torch.Generator().manual_seed(seed))

    def decode(z):  # [B, 4, T, h, w] -> [B, 3, T, h*scale, w*scale]; each pixel depends on its latent only
        x = torch.einsum("oc,bcthw->bothw", w, z).tanh()
        return x.repeat_interleave(scale, dim=-2).repeat_interleave(scale, dim=-1)

    return decode


@pytest.mark.parametrize("h, w, tile, overlap", [(20, 13, 8, 2), (16, 16, 8, 4), (9, 30, 6, 1), (8, 8, 8, 2)])
def test_pointwise_decoder_exact(h, w, tile, overlap):
    decode = _pointwise_decoder(scale=4)
    z = torch.randn(1, 4, 2, h, w)
    want = decode(z)
    got = tiled_decode(decode, z, tile=tile, overlap=overlap, scale=4)
    assert got.shape == want.shape
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


def test_bad_overlap():
    with pytest.raises(ValueError, match="overlap"):
        tiled_decode(lambda z: z, torch.zeros(1, 1, 4, 4), tile=4, overlap=4)


def test_hunyuan_video_vae_tiled_vs_untiled():
    """Random-weight tiny VAE, latent 24x24 in 16-tiles with overlap 8. Measured (seed 0): mean |tiled - untiled|
    is 19% of mean |untiled| for ours and 21% for diffusers' own tiled_decode at the same tiles. Random weights make
    GroupNorm / attention statistics per tile differ a lot from the whole frame; this is the tiling error of the
    scheme, not of this implementation, so the test holds ours to diffusers' tiling, not to the untiled decode."""
    from diffusers import AutoencoderKLHunyuanVideo

    torch.manual_seed(0)
    vae = AutoencoderKLHunyuanVideo(
        in_channels=3, out_channels=3, latent_channels=4, block_out_channels=(8, 16), layers_per_block=1,
        down_block_types=("HunyuanVideoDownBlock3D",) * 2, up_block_types=("HunyuanVideoUpBlock3D",) * 2,
        norm_num_groups=4, spatial_compression_ratio=4, temporal_compression_ratio=4,
    ).eval()
    decode = lambda t: vae.decoder(vae.post_quant_conv(t))  # noqa: E731  [B, 4, T, h, w] -> [B, 3, 4T-3, 4h, 4w]
    z = torch.randn(1, 4, 2, 24, 24)  # [B, C, T, h, w] latents
    with torch.no_grad():
        want = decode(z)  # [1, 3, 5, 96, 96]
        got = tiled_decode(decode, z, tile=16, overlap=8, scale=4)
        vae.enable_tiling(tile_sample_min_height=64, tile_sample_min_width=64, tile_sample_stride_height=32,
                          tile_sample_stride_width=32, tile_sample_min_num_frames=1000)
        theirs = vae.tiled_decode(z).sample
    assert got.shape == want.shape == theirs.shape

    def rel(x):
        return ((x - want).abs().mean() / want.abs().mean()).item()

    assert rel(got) <= rel(theirs) * 1.05 and rel(got) < 0.25, (rel(got), rel(theirs))
