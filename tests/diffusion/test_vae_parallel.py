"""Patch-parallel VAE decode on 2 real gloo ranks equals the untiled decode (1e-4, fp32), HunyuanVideo tiny decoder."""
import pytest
import torch
from dist_helpers import run_ranks
from vae_hunyuan_video import Attention, load_vae, write_tiny_vae

from common import parallel
from common.diffusion.vae_parallel import PatchGrid, patch_parallel_decode


def _latents(h, w):
    return torch.randn(1, 16, 2, h, w, generator=torch.Generator().manual_seed(h * 10 + w))  # [B, C, t, h, w]


def _check_ranks(path, h, w):
    par = parallel.init_parallel(parallel.ParallelLayout(sp=2), timeout_s=60)
    try:
        vae, z = load_vae(path), _latents(h, w)
        with torch.no_grad():
            want = vae.decode(z)  # [1, 3, 5, 8h, 8w], the whole frame on this rank
        got = vae.tiled_decode(z, group=par.group("sp"))  # one patch per rank, gathered
        assert got.shape == want.shape
        torch.testing.assert_close(got, want, rtol=0, atol=1e-4)
    finally:
        parallel.destroy_parallel()


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    return write_tiny_vae(tmp_path_factory.mktemp("vae") / "vae", seed=0)


def test_one_rank_is_the_plain_decode(tiny_path):
    """No process group (one rank): one patch, no communication."""
    vae, z = load_vae(tiny_path), _latents(3, 5)
    with torch.no_grad():
        want = vae.decode(z)
    torch.testing.assert_close(patch_parallel_decode(vae, vae.decode, z, None, (Attention,)), want, rtol=0, atol=0)


@pytest.mark.slow
@pytest.mark.parametrize("h, w", [(5, 7), (7, 3)])  # odd latents; 1 x 2 patches, then 2 x 1
def test_two_ranks_equal_untiled(tiny_path, h, w):
    grid = PatchGrid.for_ranks(h, w, 2)
    assert (grid.rows, grid.cols) == ((1, 2) if w > h else (2, 1))
    run_ranks(_check_ranks, 2, str(tiny_path), h, w)
