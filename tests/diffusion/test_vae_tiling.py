"""Tiled VAE decode. exact_tiled_decode equals the untiled decode (1e-4, fp32) on the HunyuanVideo recipe's tiny
decoder and on diffusers' own AutoencoderKLHunyuanVideo decoder, odd sizes and 2-D grids included; the blended
tiled_decode is exact for a pointwise decoder and measured against diffusers' tiling on a real one."""
import threading
import weakref

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from vae_hunyuan_video import Attention, load_vae, write_tiny_vae

from common.diffusion.vae_parallel import PatchGrid
from common.diffusion.vae_tiling import exact_tiled_decode, tiled_decode


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


@pytest.fixture(scope="module")
def tiny_vae(tmp_path_factory):
    return load_vae(write_tiny_vae(tmp_path_factory.mktemp("vae") / "vae", seed=0))


@pytest.mark.parametrize("h, w, tile, grid", [
    (5, 7, 3, (2, 3)),  # odd latent, uneven patches, corners from diagonal neighbours
    (6, 6, 2, (3, 3)),  # a middle patch with neighbours on all four sides
    (4, 9, 4, (1, 3)),  # one row of patches: only w halos
])
def test_exact_tiled_equals_untiled(tiny_vae, h, w, tile, grid):
    z = torch.randn(1, 16, 2, h, w, generator=torch.Generator().manual_seed(h * w))  # [B, C, t, h, w]
    assert (PatchGrid.for_tile(h, w, tile).rows, PatchGrid.for_tile(h, w, tile).cols) == grid
    with torch.no_grad():
        want = tiny_vae.decode(z)  # [1, 3, 5, 8h, 8w]
    got = tiny_vae.tiled_decode(z, tile=tile)
    assert got.shape == want.shape == (1, 3, 5, 8 * h, 8 * w)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-4)


def test_exact_tiled_on_diffusers_decoder():
    """The executor knows no recipe: diffusers' decoder, its mid block (attention with a mask built from the
    input's shape) as the global module."""
    from diffusers import AutoencoderKLHunyuanVideo
    from diffusers.models.autoencoders.autoencoder_kl_hunyuan_video import HunyuanVideoMidBlock3D

    torch.manual_seed(0)
    vae = AutoencoderKLHunyuanVideo(
        in_channels=3, out_channels=3, latent_channels=4, block_out_channels=(8, 16), layers_per_block=1,
        down_block_types=("HunyuanVideoDownBlock3D",) * 2, up_block_types=("HunyuanVideoUpBlock3D",) * 2,
        norm_num_groups=4, spatial_compression_ratio=4, temporal_compression_ratio=4,
    ).eval()
    decode = lambda t: vae.decoder(vae.post_quant_conv(t))  # noqa: E731  [B, 4, t, h, w] -> [B, 3, ., 4h, 4w]
    z = torch.randn(1, 4, 2, 7, 6)
    with torch.no_grad():
        want = decode(z)
    got = exact_tiled_decode(vae.decoder, decode, z, (HunyuanVideoMidBlock3D,), tile=3)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-4)


def test_conv_without_halo_rule_is_refused():
    model = nn.Sequential(nn.Conv2d(3, 3, 3, padding=1))
    with pytest.raises(ValueError, match="halo"):
        exact_tiled_decode(model, model, torch.zeros(1, 3, 4, 4), (), tile=2)


def test_failing_patch_raises_instead_of_hanging(tiny_vae):
    def decode(z):  # the patch in the last column fails before its first exchange; the others are waiting
        if z.shape[-1] == 1:
            raise RuntimeError("patch failed")
        return tiny_vae.decode(z)

    caught = []
    runner = threading.Thread(target=lambda: caught.append(pytest.raises(RuntimeError, exact_tiled_decode, tiny_vae,
                                                                           decode, torch.zeros(1, 16, 1, 2, 5),
                                                                           (Attention,), tile=2)))
    runner.start()
    runner.join(60)
    assert not runner.is_alive() and caught and "patch failed" in str(caught[0].value)


def test_patch_grid():
    grid = PatchGrid.for_ranks(90, 160, 8)  # a 720p latent on 8 ranks: 2 x 4 patches of 45 x 40
    assert (grid.rows, grid.cols, grid.extent(5)) == (2, 4, (45, 40))
    assert (PatchGrid.for_ranks(7, 5, 2).rows, PatchGrid.for_ranks(5, 7, 2).cols) == (2, 2)
    x = torch.arange(5 * 7.0).view(1, 5, 7)
    grid = PatchGrid(5, 7, 2, 3)
    assert torch.equal(grid.assemble(grid.split(x)), x)
    assert grid.neighbour(0, -1, -1) is None and grid.neighbour(0, -2, 1) == 3 and grid.neighbour(5, -1, 1) is None
    with pytest.raises(ValueError, match="cannot be cut into 7"):
        PatchGrid.for_ranks(2, 3, 7)


class _LiveBytes(TorchDispatchMode):
    """Counts the bytes of live CPU tensor storages created under it (any thread that enters it), and the peak."""

    def __init__(self, shared=None):
        super().__init__()
        self.shared = shared or {"lock": threading.Lock(), "live": {}, "now": 0, "peak": 0}

    def _drop(self, key):
        s = self.shared
        with s["lock"]:
            s["live"][key][1] -= 1
            if s["live"][key][1] == 0:
                s["now"] -= s["live"].pop(key)[0]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        s = self.shared
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                key = t.untyped_storage().data_ptr()
                with s["lock"]:
                    if key not in s["live"]:
                        s["live"][key] = [t.untyped_storage().nbytes(), 0]
                        s["now"] += s["live"][key][0]
                        s["peak"] = max(s["peak"], s["now"])
                    s["live"][key][1] += 1
                weakref.finalize(t, self._drop, key)
        return out


def test_tiled_peak_memory_is_lower(tiny_vae):
    """Peak live tensor bytes: the padded conv inputs exist for one patch at a time (vae_tiling's docstring)."""
    z = torch.randn(1, 16, 2, 8, 8)
    peaks = {}
    for tile in (8, 4):  # 8: one patch (the untiled decode), 4: 2 x 2 patches
        shared = _LiveBytes().shared

        def decode(t, shared=shared):
            with _LiveBytes(shared):
                return tiny_vae.decode(t)

        exact_tiled_decode(tiny_vae, decode, z, (Attention,), tile=tile)
        peaks[tile] = shared["peak"]
    assert peaks[4] < 0.75 * peaks[8], peaks


class _OneSidedConv(nn.Module):
    """A padded conv in the CausalConv3d convention with uneven halos: (w, w, h, h, t, t) = (1, 0, 2, 0, 1, 0)."""

    def __init__(self, channels, pad_mode):
        super().__init__()
        self.pad_mode, self.time_causal_padding = pad_mode, (1, 0, 2, 0, 1, 0)
        self.conv = nn.Conv3d(channels, channels, (2, 3, 2))

    def forward(self, x):
        return self.conv(nn.functional.pad(x, self.time_causal_padding, mode=self.pad_mode))


@pytest.mark.parametrize("pad_mode", ["replicate", "constant"])
def test_uneven_halos_and_zero_padding(pad_mode):
    torch.manual_seed(0)
    model = nn.Sequential(_OneSidedConv(4, pad_mode), nn.GroupNorm(2, 4), nn.SiLU(), _OneSidedConv(4, pad_mode))
    z = torch.randn(1, 4, 3, 5, 7)
    with torch.no_grad():
        want = model(z)
    torch.testing.assert_close(exact_tiled_decode(model, model, z, (), tile=3), want, rtol=0, atol=1e-5)
