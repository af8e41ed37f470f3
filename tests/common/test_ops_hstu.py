"""common.ops.hstu_attention against a dense, padded formula written here (float64), full and cached variants."""
import pytest
import torch
import torch.nn.functional as F

from common import ops
from common.ops import reference as ref


def dense_mask(n, n_cand, n_ctx):
    """[n, n] bool, by the published id rule: contextual tokens share id 0, candidates share the id after the last
    history token; visible = (row id > col id) or diagonal; contextual rows also see every non-candidate column."""
    ids = torch.arange(n)
    if n_ctx > 0:
        ids = (ids - n_ctx + 1).clamp(min=0)
    max_id = (n - n_ctx + 1 if n_ctx > 0 else n) - n_cand
    ids = ids.clamp(max=max_id)
    row, col = ids[:, None], ids[None, :]
    visible = (row > col) | torch.eye(n, dtype=torch.bool)
    if n_ctx > 0:
        visible |= (row == 0) & (col < max_id)
    return visible


def dense_hstu(q, k, v, n_cand, n_ctx, alpha, max_seq_len):
    """One sequence, q k v [n, H, D]: out [n, H, Dv] = (SiLU(alpha q k^T) / max_seq_len * mask) v, padded to N."""
    n = q.shape[0]
    pad = max_seq_len - n  # pad to max_seq_len like upstream's dense path; padded rows / columns are masked
    qp, kp, vp = (F.pad(t.double(), (0, 0, 0, 0, 0, pad)) for t in (q, k, v))
    mask = torch.zeros(max_seq_len, max_seq_len, dtype=torch.bool)
    mask[:n, :n] = dense_mask(n, n_cand, n_ctx)
    attn = F.silu(alpha * torch.einsum("qhd,khd->hqk", qp, kp)) / max_seq_len * mask
    return torch.einsum("hqk,khd->qhd", attn, vp)[:n]


def test_dense_mask_matches_the_description():
    m = dense_mask(7, n_cand=2, n_ctx=0)  # 5 history + 2 candidates
    assert torch.equal(m[:5, :5], torch.ones(5, 5, dtype=torch.bool).tril())
    assert m[5, :5].all() and m[5, 5] and not m[5, 6] and not m[6, 5] and m[6, 6] and not m[:5, 5:].any()
    c = dense_mask(7, n_cand=2, n_ctx=2)
    assert c[0, :5].all() and c[1, :5].all() and not c[0, 5:].any() and not c[2, 3]


LENS = [(9, 3), (1, 1), (14, 0), (6, 6), (11, 2)]  # (length, candidates)


def packed(lens, H=2, D=8, Dv=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    T = sum(n for n, _ in lens)
    q, k = (torch.randn(T, H, D, generator=g) for _ in range(2))
    v = torch.randn(T, H, Dv, generator=g)
    cu = torch.tensor([0] + [n for n, _ in lens]).cumsum(0).int()
    return q, k, v, cu, torch.tensor([c for _, c in lens])


@pytest.mark.parametrize("n_ctx", [0, 2])
def test_full_sequences_match_the_dense_formula(n_ctx):
    q, k, v, cu, n_cand = packed(LENS)
    alpha, max_len = 0.3, 16
    out = ops.hstu_attention(q, k, v, cu, cu, n_cand, alpha, max_len, num_contextual=n_ctx)
    for b, (n, c) in enumerate(LENS):
        s = slice(int(cu[b]), int(cu[b + 1]))
        want = dense_hstu(q[s], k[s], v[s], c, n_ctx if n > n_ctx + c else 0, alpha, max_len)
        torch.testing.assert_close(out[s].double(), want, rtol=1e-5, atol=1e-6)


def test_cached_variant_equals_the_last_rows_of_the_full_sequence():
    q, k, v, cu, n_cand = packed(LENS, seed=1)
    alpha, max_len = 0.5, 16
    full = ops.hstu_attention(q, k, v, cu, cu, n_cand, alpha, max_len)
    new = [max(c, min(n, c + 2)) for n, c in LENS]  # 2 new history tokens + the candidates (fewer if short)
    rows = torch.cat([torch.arange(int(cu[b + 1]) - m, int(cu[b + 1])) for b, m in enumerate(new)])
    cu_q = torch.tensor([0] + new).cumsum(0).int()
    out = ops.hstu_attention(q[rows], k, v, cu_q, cu, n_cand, alpha, max_len)
    torch.testing.assert_close(out, full[rows], rtol=1e-5, atol=1e-6)


def test_dtype_and_shape_and_npu_path_is_the_reference():
    q, k, v, cu, n_cand = packed(LENS)
    out = ops.hstu_attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), cu, cu, n_cand, 0.2, 16)
    assert out.dtype == torch.bfloat16 and out.shape == (q.shape[0], 2, 6)
    assert ops.npu.hstu_attention is ref.hstu_attention  # torch_npu 2.14 has no HSTU op


def test_candidates_must_be_queries():
    q, k, v, cu, _ = packed([(5, 0)])
    with pytest.raises(AssertionError):
        ops.hstu_attention(q[3:], k, v, torch.tensor([0, 2]).int(), cu, torch.tensor([3]), 0.2, 16)
