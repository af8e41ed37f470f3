"""Lightning indexer: per query, the top-k compressed keys by sum_h w_h * relu(q_h . k)."""
from __future__ import annotations

import torch
import torch.nn.functional as F


def lightning_indexer(
    q: torch.Tensor,
    k: torch.Tensor,
    weights: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    visible: torch.Tensor,
    topk: int,
) -> torch.Tensor:
    """Global row indices into k of each query's top min(topk, visible[t]) entries; other slots -1.

    q [T, H, D], k [N, D] (compressed keys of all sequences; sequence b owns rows cu_seqlens_k[b]:cu_seqlens_k[b+1]),
    weights [T, H] fp32, visible [T] = how many of its own sequence's first entries query t may see.
    Scores in fp32; ties go to the lower index (stable sort), so a row's result does not depend on its batch.
    Returns [T, topk] int32.
    """
    scores = torch.einsum("thd,nd->thn", q.float(), k.float()).relu()  # [T, H, N]
    scores = torch.einsum("thn,th->tn", scores, weights.float())  # [T, N]
    token = torch.arange(q.shape[0], device=q.device)
    seq = torch.searchsorted(cu_seqlens_q[1:].long(), token, right=True)  # [T] sequence of each query
    start = cu_seqlens_k.long()[seq][:, None]  # [T, 1]
    row = torch.arange(k.shape[0], device=k.device)[None, :]  # [1, N]
    allowed = (row >= start) & (row < start + visible.long()[:, None])  # [T, N]
    scores = scores.masked_fill(~allowed, float("-inf"))
    order = torch.sort(scores, dim=-1, descending=True, stable=True).indices[:, :topk]  # [T, min(topk, N)]
    picked = torch.where(allowed.gather(1, order), order, -1)
    return F.pad(picked, (0, topk - picked.shape[1]), value=-1).int()  # [T, topk]
