"""Ulysses and ring attention on 2 real gloo ranks, and the Ulysses x ring hybrid on 4, equal single-rank full
attention (fp32, 1e-5)."""
import functools

import pytest
import torch
from dist_helpers import run_ranks

from common import parallel
from common.diffusion.sequence_parallel import (
    masked_attention,
    ring_attention,
    ulysses_attention,
    ulysses_ring_groups,
)

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
        want = masked_attention(q, k, v, scale=D**-0.5)  # [B, S, Hq, D] on one rank
        r, n = par.rank_in("sp"), S // par.size("sp")
        shard = [t[:, r * n:(r + 1) * n] for t in (q, k, v)]  # [B, S/P, H, D]
        fn = ulysses_attention if kind == "ulysses" else ring_attention
        got = fn(*shard, par.group("sp"), scale=D**-0.5)
        torch.testing.assert_close(got, want[:, r * n:(r + 1) * n], rtol=1e-5, atol=1e-5)
    finally:
        parallel.destroy_parallel()


def test_single_rank_is_plain_attention():
    q, k, v = _inputs(4, 4)
    want = masked_attention(q, k, v, scale=0.3)
    torch.testing.assert_close(ulysses_attention(q, k, v, None, scale=0.3), want)
    torch.testing.assert_close(ring_attention(q, k, v, None, scale=0.3), want)


def test_attention_matches_sdpa():
    q, k, v = _inputs(4, 2)
    kr, vr = (t.repeat_interleave(2, dim=2) for t in (k, v))
    want = torch.nn.functional.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (q, kr, vr))).transpose(1, 2)
    torch.testing.assert_close(masked_attention(q, k, v, scale=D**-0.5), want, rtol=1e-5, atol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize(
    "kind, heads, kv_heads",
    [("ulysses", 4, 4), ("ulysses", 3, 3), ("ulysses", 4, 2), ("ulysses", 6, 3), ("ring", 4, 4), ("ring", 4, 2)],
)
def test_two_ranks_equal_one(kind, heads, kv_heads):
    run_ranks(_check_ranks, 2, kind, heads, kv_heads)


# Joint (MM-DiT) attention: replicated text tokens beside the sharded video, right-padded per row.
L, TEXT_LENS = 5, (5, 3)


def _joint_inputs(heads, seed=1):
    g = torch.Generator().manual_seed(seed)
    jq, jk, jv = (torch.randn(2, L, heads, D, generator=g) for _ in range(3))  # [B, L, H, D]
    mask = torch.arange(L)[None] < torch.tensor(TEXT_LENS)[:, None]  # [B, L]
    return jq, jk, jv, mask


def _joint_reference(q, k, v, jq, jk, jv, mask, seq_len):
    """Per row: SDPA over [video[:seq_len]; real text] -> (video out [B, seq_len, H, D], text out [B, L, H, D])."""
    video, text = [], []
    for b in range(q.shape[0]):
        n = int(mask[b].sum())
        qs, ks, vs = (torch.cat([x[b, :seq_len], j[b, :n]]).transpose(0, 1) for x, j in ((q, jq), (k, jk), (v, jv)))
        o = torch.nn.functional.scaled_dot_product_attention(qs, ks, vs).transpose(0, 1)  # [seq_len + n, H, D]
        video.append(o[:seq_len])
        text.append(torch.nn.functional.pad(o[seq_len:], (0, 0, 0, 0, 0, L - n)))  # padded text rows are 0
    return torch.stack(video), torch.stack(text)


JOINT_CASES = ((4, S), (3, S - 3), (3, S - 7))  # (heads, real positions): 3 heads over 2 ranks; padding


def _check_joint(kind: str, world: int = 2) -> None:
    """S = 12 positions sharded over the ranks, the last S - seq_len of them padding. kind "usp": 4 ranks as
    Ulysses 2 x ring 2."""
    par = parallel.init_parallel(parallel.ParallelLayout(sp=world), timeout_s=30)
    try:
        if kind == "usp":
            groups = ulysses_ring_groups(par.layout.group_ranks("sp"), 2, par.rank)
            assert parallel.group_size(groups.ulysses) == parallel.group_size(groups.ring) == 2
            fn = functools.partial(ulysses_attention, ring_group=groups.ring)
            group = groups.ulysses
        else:
            fn = ulysses_attention if kind == "ulysses" else ring_attention
            group = par.group("sp")
        for heads, seq_len in JOINT_CASES:
            _check_joint_case(par, fn, group, heads, seq_len)
        q, k, v = _inputs(3, 3)  # no text
        r, n = par.rank_in("sp"), S // world
        got = fn(*(t[:, r * n:(r + 1) * n] for t in (q, k, v)), group, D**-0.5)
        torch.testing.assert_close(got, masked_attention(q, k, v, D**-0.5)[:, r * n:(r + 1) * n], rtol=1e-5, atol=1e-5)
    finally:
        parallel.destroy_parallel()


def _check_joint_case(par, fn, group, heads: int, seq_len: int) -> None:
    q, k, v = _inputs(heads, heads)
    jq, jk, jv, mask = _joint_inputs(heads)
    want_video, want_text = _joint_reference(q, k, v, jq, jk, jv, mask, seq_len)
    r, n = par.rank_in("sp"), S // par.size("sp")
    shard = [t[:, r * n:(r + 1) * n] for t in (q, k, v)]
    got_video, got_text = fn(*shard, group, D**-0.5, joint_q=jq, joint_k=jk, joint_v=jv,
                             joint_mask=mask, seq_len=None if seq_len == S else seq_len)
    real = min(n, max(0, seq_len - r * n))  # this rank's real rows
    torch.testing.assert_close(got_video[:, :real], want_video[:, r * n:r * n + real], rtol=1e-5, atol=1e-5)
    assert not got_video[:, real:].any()  # padded rows come back as 0
    torch.testing.assert_close(got_text, want_text, rtol=1e-5, atol=1e-5)
    texts = [torch.empty_like(got_text) for _ in range(par.size("sp"))]
    torch.distributed.all_gather(texts, got_text, group=par.group("sp"))
    assert all(torch.equal(texts[0], t) for t in texts)  # the replicated text output: the same bits on every rank


@pytest.mark.parametrize("fn", [ulysses_attention, ring_attention])
@pytest.mark.parametrize("seq_len", [S, S - 3])
def test_joint_single_rank(fn, seq_len):
    q, k, v = _inputs(3, 3)
    jq, jk, jv, mask = _joint_inputs(3)
    want_video, want_text = _joint_reference(q, k, v, jq, jk, jv, mask, seq_len)
    got_video, got_text = fn(q, k, v, None, D**-0.5, joint_q=jq, joint_k=jk, joint_v=jv, joint_mask=mask,
                             seq_len=seq_len)
    torch.testing.assert_close(got_video[:, :seq_len], want_video, rtol=1e-5, atol=1e-5)
    assert not got_video[:, seq_len:].any()
    torch.testing.assert_close(got_text, want_text, rtol=1e-5, atol=1e-5)


def test_masked_attention_leaves_out_padding():
    q, k, v = _inputs(2, 2)
    q_mask = torch.tensor([[True] * S, [True] * 5 + [False] * (S - 5)])
    k_mask = torch.tensor([[True] * 7 + [False] * (S - 7), [True] * S])
    got = masked_attention(q, k, v, D**-0.5, q_mask=q_mask, k_mask=k_mask)
    torch.testing.assert_close(got[0], masked_attention(q[:1], k[:1, :7], v[:1, :7], D**-0.5)[0])
    torch.testing.assert_close(got[1, :5], masked_attention(q[1:, :5], k[1:], v[1:], D**-0.5)[0])
    assert not got[1, 5:].any()


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["ulysses", "ring"])
def test_joint_two_ranks_equal_one(kind):
    run_ranks(_check_joint, 2, kind)


@pytest.mark.slow
def test_ulysses_x_ring_on_four_ranks_equals_one():
    """USP: Ulysses inside blocks of 2 neighbouring ranks, ring across the 2 blocks; 3 heads pad to 4 in Ulysses."""
    run_ranks(_check_joint, 4, "usp", 4)
