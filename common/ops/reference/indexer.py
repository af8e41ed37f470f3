"""Lightning indexer: per query, the top-k compressed keys by sum_h w_h * relu(q_h . k)."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .attention import uniform_queries


def lightning_indexer(
    q: torch.Tensor,
    k: torch.Tensor,
    weights: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    visible: torch.Tensor,
    topk: int,
    max_seqlen_q: int | None = None,
    max_seqlen_k: int | None = None,
) -> torch.Tensor:
    """Global row indices into k of each query's top min(topk, visible[t]) entries; other slots -1.

    q [T, H, D], k [N, D] (compressed keys of all sequences; sequence b owns rows cu_seqlens_k[b]:cu_seqlens_k[b+1]),
    weights [T, H] fp32, visible [T] = how many of its own sequence's first entries query t may see.
    Scores in fp32; ties go to the lower index (stable sort), so a row's result does not depend on its batch.
    max_seqlen_q / max_seqlen_k: host bounds of the queries / keys per sequence; given, a decode batch (every
    sequence the same Q <= MAX_DECODE_QUERIES queries: 1, or 1 + its MTP drafts) scores a fixed max_seqlen_k keys
    per query and reads no tensor on the host.
    Returns [T, topk] int32.
    """
    T, B = q.shape[0], cu_seqlens_q.numel() - 1
    Q = uniform_queries(T, B, max_seqlen_q)
    if Q:  # a decode batch: every query scored alone against its sequence's keys (b = t // Q)
        seq = torch.arange(T, device=q.device) // Q  # [T]
        cu = cu_seqlens_k.long()
        return _decode_topk(q, k, weights, cu[:-1][seq], (cu[1:] - cu[:-1])[seq], visible, topk, max_seqlen_k)
    if T > B:  # prefill chunks in the batch: score each sequence's queries against its own keys only
        out = torch.full((T, topk), -1, dtype=torch.int32, device=q.device)
        bounds = zip(cu_seqlens_q.tolist(), cu_seqlens_q[1:].tolist(), cu_seqlens_k.tolist(), cu_seqlens_k[1:].tolist())
        for qs, qe, ks, ke in bounds:
            if qe > qs and ke > ks:
                rows = _topk_rows(q[qs:qe], k[ks:ke], weights[qs:qe], 0, visible[qs:qe], topk)  # local rows
                out[qs:qe] = torch.where(rows >= 0, rows + ks, -1)
        return out
    if T == B and max_seqlen_q is None and bool((cu_seqlens_q[1:] - cu_seqlens_q[:-1] == 1).all()):
        cu = cu_seqlens_k.long()  # one query per sequence, no host bound given
        return _decode_topk(q, k, weights, cu[:-1], cu[1:] - cu[:-1], visible, topk)
    token = torch.arange(T, device=q.device)
    seq = torch.searchsorted(cu_seqlens_q[1:].long(), token, right=True)  # [T] sequence of each query
    return _topk_rows(q, k, weights, cu_seqlens_k.long()[seq][:, None], visible, topk)


def _decode_topk(q, k, weights, starts, lengths, visible, topk: int, width: int | None = None) -> torch.Tensor:
    """Each query scored against its own sequence's keys only (rows starts[t] .. + lengths[t] of k), padded to
    `width` keys (None: to the most any query sees, read on the host). [T, topk]"""
    counts = torch.minimum(lengths, visible.long())  # [T] keys each query may see
    if width is None:
        width = int(counts.max()) if counts.numel() else 0
    if not k.shape[0] or not width:
        return torch.full((q.shape[0], topk), -1, dtype=torch.int32, device=q.device)
    ka = torch.arange(width, device=q.device)  # [W]
    allowed = ka < counts[:, None]  # [T, W]
    rows = torch.where(allowed, starts[:, None] + ka, 0)  # [T, W] global rows (row 0 pads, masked below)
    scores = torch.einsum("thd,twd->thw", q.float(), k[rows].float()).relu()  # [T, H, W]
    scores = torch.einsum("thw,th->tw", scores, weights.float()).masked_fill(~allowed, float("-inf"))  # [T, W]
    order = torch.sort(scores, dim=-1, descending=True, stable=True).indices[:, :topk]  # [T, min(topk, W)]
    picked = torch.where(allowed.gather(1, order), rows.gather(1, order), -1)
    return F.pad(picked, (0, topk - picked.shape[1]), value=-1).int()  # [T, topk]


def _topk_rows(q, k, weights, start, visible, topk: int) -> torch.Tensor:
    """Top-k global rows of k for each query row, among rows [start, start + visible); -1 fills. [t, topk] int32."""
    scores = torch.einsum("thd,nd->thn", q.float(), k.float()).relu()  # [t, H, n]
    scores = torch.einsum("thn,th->tn", scores, weights.float())  # [t, n]
    row = torch.arange(k.shape[0], device=k.device)[None, :]  # [1, n]
    allowed = (row >= start) & (row < start + visible.long()[:, None])  # [t, n]
    scores = scores.masked_fill(~allowed, float("-inf"))
    order = torch.sort(scores, dim=-1, descending=True, stable=True).indices[:, :topk]  # [t, min(topk, n)]
    picked = torch.where(allowed.gather(1, order), order, -1)
    return F.pad(picked, (0, topk - picked.shape[1]), value=-1).int()  # [t, topk]
