"""Sequence-parallel attention for DiTs: Ulysses (all-to-all) and ring (K/V passed around, LSE merge).

Every rank holds a contiguous shard of the sequence: q [B, S/P, Hq, D], k / v [B, S/P, Hkv, D(v)], rank r owning
positions [r * S/P, (r + 1) * S/P). Attention is full (non-causal), as in a DiT; the local attention is
common.ops.attention, so the NPU path is the fused op. Both functions return out [B, S/P, Hq, Dv] on each rank,
equal to full attention over the whole sequence sliced to this rank's rows. group None (or one rank) = plain
attention. S must be divisible by P: pad the sequence in the model (and mask the padding) when it is not.

Ulysses with heads not divisible by P: heads are padded with zeros up to the next multiple of P (a zero q and k
give uniform weights over zero v, so a padded head's output is 0, then dropped). The cost is ceil(H/P)*P - H extra
heads of attention and all-to-all volume (24 heads on 16 ranks: 32 heads' work). GQA K/V is repeated to Hq heads
first when either head count is not a multiple of P.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from common import ops
from common.parallel import all_to_all, group_rank, group_size


def _attention(q, k, v, scale: float, return_lse: bool = False):
    """Full attention per batch row via common.ops.attention (packed TND). q [B, Sq, Hq, D], k / v [B, Sk, Hkv, D]."""
    (B, Sq, Hq, _), Sk = q.shape, k.shape[1]
    cu_q = torch.arange(B + 1, device=q.device, dtype=torch.int32) * Sq  # [B+1]
    cu_k = torch.arange(B + 1, device=q.device, dtype=torch.int32) * Sk
    res = ops.attention(q.flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1), cu_q, cu_k, scale,
                        causal=False, return_lse=return_lse)  # out [B*Sq, Hq, Dv] (, lse [B*Sq, Hq])
    if not return_lse:
        return res.view(B, Sq, Hq, -1)
    out, lse = res
    return out.view(B, Sq, Hq, -1), lse.view(B, Sq, Hq)


def ulysses_attention(q, k, v, group: dist.ProcessGroup | None, scale: float) -> torch.Tensor:
    """All-to-all sequence shards -> head shards [B, S, H/P, D], attend over the whole sequence, all-to-all back."""
    P, Hq, Hkv = group_size(group), q.shape[2], k.shape[2]
    if P == 1:
        return _attention(q, k, v, scale)
    if Hq % P or Hkv % P:
        if Hkv != Hq:  # expand GQA so q and k / v pad the same way
            k, v = (t.repeat_interleave(Hq // Hkv, dim=2) for t in (k, v))
        pad = -Hq % P
        q, k, v = (F.pad(t, (0, 0, 0, pad)) for t in (q, k, v))  # [B, S/P, Hp, D], zero heads at the end
    q, k, v = (all_to_all(t, group, scatter_dim=2, gather_dim=1) for t in (q, k, v))  # [B, S, Hp/P, D]
    out = _attention(q, k, v, scale)  # [B, S, Hp/P, Dv]
    out = all_to_all(out, group, scatter_dim=1, gather_dim=2)  # [B, S/P, Hp, Dv]
    return out[:, :, :Hq]


def _ring_exchange(k, v, group):
    """Start sending (k, v) to the next rank and receiving the previous rank's; returns (requests, k', v')."""
    P, r = group_size(group), group_rank(group)
    nxt, prv = (dist.get_global_rank(group, (r + d) % P) for d in (1, -1))
    k_in, v_in = torch.empty_like(k), torch.empty_like(v)
    ops_ = [dist.P2POp(dist.isend, k, nxt, group), dist.P2POp(dist.isend, v, nxt, group),
            dist.P2POp(dist.irecv, k_in, prv, group), dist.P2POp(dist.irecv, v_in, prv, group)]
    return dist.batch_isend_irecv(ops_), k_in, v_in


def ring_attention(q, k, v, group: dist.ProcessGroup | None, scale: float) -> torch.Tensor:
    """Attend to each rank's K/V block in turn as it travels around the ring; merge partials by log-sum-exp.

    P - 1 exchanges of a K/V shard each; the exchange of the next block overlaps the attention on the current one.
    Partials are merged in fp32 (common.ops.merge_attention_states) and cast to q.dtype at the end.
    """
    P = group_size(group)
    if P == 1:
        return _attention(q, k, v, scale)
    k, v = k.contiguous(), v.contiguous()
    out = lse = None
    for step in range(P):
        reqs = None
        if step < P - 1:
            reqs, k_next, v_next = _ring_exchange(k, v, group)
        o, l = _attention(q, k, v, scale, return_lse=True)  # [B, S/P, Hq, Dv], [B, S/P, Hq]
        o = o.float()
        out, lse = (o, l) if out is None else ops.merge_attention_states(out, lse, o, l)
        if reqs is not None:
            for req in reqs:
                req.wait()
            k, v = k_next, v_next
    return out.to(q.dtype)
