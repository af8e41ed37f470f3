"""Ulysses and ring attention on 2 real gloo ranks equal single-rank full attention (fp32, 1e-5)."""
import pytest
import torch
from dist_helpers import run_ranks

from common import parallel
from common.diffusion.sequence_parallel import _attention, ring_attention, ulysses_attention

S, D = 12, 8


def _inputs(heads, kv_heads, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(2, S, heads, D, generator=g)  # [B, S, Hq, D]
    k, v = (torch.randn(2, S, kv_heads, D, generator=g) for _ in range(2))  # [B, S, Hkv, D]
    return q, k, v


def _check_ranks(kind: str, heads: int, kv_heads: int) -> None:
    par = parallel.init_parallel(parallel.ParallelLayout(sp=2), timeout_s=30)
    try:
        q, k, v = _inputs(heads, kv_heads)
        want = _attention(q, k, v, scale=D**-0.5)  # [B, S, Hq, D] on one rank
        r, n = par.rank_in("sp"), S // par.size("sp")
        shard = [t[:, r * n:(r + 1) * n] for t in (q, k, v)]  # [B, S/P, H, D]
        fn = ulysses_attention if kind == "ulysses" else ring_attention
        got = fn(*shard, par.group("sp"), scale=D**-0.5)
        torch.testing.assert_close(got, want[:, r * n:(r + 1) * n], rtol=1e-5, atol=1e-5)
    finally:
        parallel.destroy_parallel()


def test_single_rank_is_plain_attention():
    q, k, v = _inputs(4, 4)
    want = _attention(q, k, v, scale=0.3)
    torch.testing.assert_close(ulysses_attention(q, k, v, None, scale=0.3), want)
    torch.testing.assert_close(ring_attention(q, k, v, None, scale=0.3), want)


def test_attention_matches_sdpa():
    q, k, v = _inputs(4, 2)
    kr, vr = (t.repeat_interleave(2, dim=2) for t in (k, v))
    want = torch.nn.functional.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (q, kr, vr))).transpose(1, 2)
    torch.testing.assert_close(_attention(q, k, v, scale=D**-0.5), want, rtol=1e-5, atol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize(
    "kind, heads, kv_heads",
    [("ulysses", 4, 4), ("ulysses", 3, 3), ("ulysses", 4, 2), ("ulysses", 6, 3), ("ring", 4, 4), ("ring", 4, 2)],
)
def test_two_ranks_equal_one(kind, heads, kv_heads):
    run_ranks(_check_ranks, 2, kind, heads, kv_heads)
