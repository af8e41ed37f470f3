"""Sequence-parallel attention for DiTs: Ulysses (all-to-all) and ring (K/V passed around, LSE merge).

Every rank holds a contiguous shard of the sequence: q [B, S/P, Hq, D], k / v [B, S/P, Hkv, D(v)], rank r owning
positions [r * S/P, (r + 1) * S/P). Attention is full (non-causal), as in a DiT; the local attention is
common.ops.attention, so the NPU path is the fused op. Both functions return out [B, S/P, Hq, Dv] on each rank,
equal to full attention over the whole sequence sliced to this rank's rows. group None (or one rank) = plain
attention. S must be divisible by P: pad the sequence in the model and pass `seq_len` (the number of real
positions; the padding sits at the end of the whole sequence): padded keys are then left out of every softmax and
padded rows come back as 0.

Joint (MM-DiT) attention: text tokens are not sharded but replicated on every rank. Pass them as joint_q / joint_k /
joint_v [B, L, H, D] (and joint_mask [B, L] bool, True = real token, for right-padded prompts of different
lengths); every query then attends over [whole video sequence; the row's real text tokens], the text queries too,
and the functions return (out, joint_out [B, L, Hq, Dv]), joint_out replicated (the same on every rank; padded text
rows are 0). Ulysses head-slices the text locally, appends it after the all-to-all and all-gathers the text output's
heads; ring attends the text K/V once and merges by LSE, text rows in a fixed block order so that every rank
computes the same bits.

Hybrid (USP, `UlyssesRing`): the sp group as U x R ranks, Ulysses all-to-all inside each block of U neighbouring
sp ranks (which together hold a contiguous 1/R of the sequence), ring attention across the R blocks (ranks U
apart): ulysses_attention(..., group=ulysses, ring_group=ring). Ulysses moves more data per step but needs H >= U;
ring moves only K/V but serialises P steps; the mix keeps all-to-all inside a node and the ring across nodes.

Ulysses with heads not divisible by P: heads are padded with zeros up to the next multiple of P (a zero q and k
give uniform weights over zero v, so a padded head's output is 0, then dropped). The cost is ceil(H/P)*P - H extra
heads of attention and all-to-all volume (24 heads on 16 ranks: 32 heads' work). GQA K/V is repeated to Hq heads
first when either head count is not a multiple of P.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

from common import ops
from common.parallel import all_gather, all_to_all, group_rank, group_size


def masked_attention(q, k, v, scale: float, return_lse: bool = False, q_mask=None, k_mask=None):
    """Full attention per batch row via common.ops.attention (packed TND). q [B, Sq, Hq, D], k / v [B, Sk, Hkv, D].

    q_mask [B, Sq] / k_mask [B, Sk] bool (None = all real): only real rows attend, only real keys are attended
    (packed varlen, no padding computed); rows left out come back as out 0, lse -inf.
    """
    (B, Sq, Hq, _), Sk = q.shape, k.shape[1]
    if q_mask is None and k_mask is None:
        cu_q = torch.arange(B + 1, device=q.device, dtype=torch.int32) * Sq  # [B+1]
        cu_k = torch.arange(B + 1, device=q.device, dtype=torch.int32) * Sk
        res = ops.attention(q.flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1), cu_q, cu_k, scale,
                            causal=False, return_lse=return_lse)  # out [B*Sq, Hq, Dv] (, lse [B*Sq, Hq])
        if not return_lse:
            return res.view(B, Sq, Hq, -1)
        out, lse = res
        return out.view(B, Sq, Hq, -1), lse.view(B, Sq, Hq)
    q_mask = q.new_ones(B, Sq, dtype=torch.bool) if q_mask is None else q_mask.bool()
    k_mask = k.new_ones(B, Sk, dtype=torch.bool) if k_mask is None else k_mask.bool()
    q_lens, k_lens = q_mask.sum(1), k_mask.sum(1)  # [B]
    q_lens, k_lens = q_lens * (k_lens > 0), k_lens * (q_lens > 0)  # a row with no keys (or no queries) sits out
    q_mask, k_mask = q_mask & (k_lens > 0)[:, None], k_mask & (q_lens > 0)[:, None]
    out = q.new_zeros(B, Sq, Hq, v.shape[-1])  # [B, Sq, Hq, Dv]
    lse = q.new_full((B, Sq, Hq), float("-inf"), dtype=torch.float32)
    if int(q_lens.sum()) > 0:
        cu_q = F.pad(q_lens.cumsum(0), (1, 0)).int()  # [B+1]
        cu_k = F.pad(k_lens.cumsum(0), (1, 0)).int()
        o, l = ops.attention(q[q_mask], k[k_mask], v[k_mask], cu_q, cu_k, scale, causal=False,
                             return_lse=True)  # [Tq, Hq, Dv], [Tq, Hq]; rows of each batch row contiguous
        out[q_mask], lse[q_mask] = o, l
    return (out, lse) if return_lse else out


def _valid_rows(seq_len: int | None, start: int, n: int, B: int, device) -> torch.Tensor | None:
    """[B, n] bool: which of positions [start, start + n) are < seq_len (None: all real)."""
    if seq_len is None:
        return None
    return (torch.arange(start, start + n, device=device) < seq_len).expand(B, n)


def _cat_masks(a, b, shape_a, shape_b, device):
    """cat([a, b], dim=1) of two [B, *] masks, None standing for all True; None when both are None."""
    if a is None and b is None:
        return None
    a = torch.ones(shape_a, dtype=torch.bool, device=device) if a is None else a.bool()
    b = torch.ones(shape_b, dtype=torch.bool, device=device) if b is None else b.bool()
    return torch.cat([a, b], dim=1)


@dataclass(frozen=True)
class UlyssesRing:
    """Hybrid sequence parallel: `ulysses` = this rank's block of U neighbouring sp ranks, `ring` = the R ranks
    U apart that hold the same head slice of the other blocks (None where a degree is 1)."""

    ulysses: dist.ProcessGroup | None
    ring: dist.ProcessGroup | None


def ulysses_ring_groups(sp_groups: list[list[int]], ulysses_degree: int, rank: int) -> UlyssesRing:
    """Split every sp group (lists of global ranks, e.g. ParallelLayout.group_ranks("sp")) into Ulysses blocks of
    `ulysses_degree` neighbouring ranks and ring groups across them. Collective: every rank of the world calls it
    with the same arguments (torch.distributed creates groups in the same order everywhere)."""
    mine = {}
    for ranks in sp_groups:
        U = ulysses_degree
        if U < 1 or len(ranks) % U:
            raise ValueError(f"ulysses degree {U} must divide the sp size {len(ranks)}")
        blocks = [("ulysses", ranks[i:i + U]) for i in range(0, len(ranks), U)]
        rings = [("ring", ranks[j::U]) for j in range(U)]
        for name, sub in blocks + rings:
            group = dist.new_group(sub) if len(sub) > 1 else None  # the same calls on every rank
            if rank in sub:
                mine[name] = group
    return UlyssesRing(mine.get("ulysses"), mine.get("ring"))


def ulysses_attention(q, k, v, group: dist.ProcessGroup | None, scale: float, joint_q=None, joint_k=None,
                      joint_v=None, joint_mask=None, seq_len: int | None = None,
                      ring_group: dist.ProcessGroup | None = None):
    """All-to-all sequence shards -> head shards [B, S, H/P, D], attend over the whole sequence, all-to-all back.
    With ring_group (hybrid USP): the all-to-all gathers this block's 1/R of the sequence, and ring attention over
    ring_group covers the other blocks.

    Returns out [B, S/P, Hq, Dv], or (out, joint_out [B, L, Hq, Dv]) with joint_q / joint_k / joint_v.
    """
    P, B, Hq, Hkv = group_size(group), q.shape[0], q.shape[2], k.shape[2]
    joint = joint_q is not None
    if P > 1 and (Hq % P or Hkv % P):
        if Hkv != Hq:  # expand GQA so q and k / v pad the same way
            k, v = (t.repeat_interleave(Hq // Hkv, dim=2) for t in (k, v))
            if joint:
                joint_k, joint_v = (t.repeat_interleave(Hq // Hkv, dim=2) for t in (joint_k, joint_v))
        pad = -Hq % P
        q, k, v = (F.pad(t, (0, 0, 0, pad)) for t in (q, k, v))  # [B, S/P, Hp, D], zero heads at the end
        if joint:
            joint_q, joint_k, joint_v = (F.pad(t, (0, 0, 0, pad)) for t in (joint_q, joint_k, joint_v))
    q, k, v = (all_to_all(t, group, scatter_dim=2, gather_dim=1) for t in (q, k, v))  # [B, S(/R), Hp/P, D]
    S = q.shape[1]
    jq = jk = jv = None
    if joint:  # this rank's heads of the replicated text [B, L, Hp/P, D]
        jq, jk, jv = (t.chunk(P, dim=2)[group_rank(group)] for t in (joint_q, joint_k, joint_v))
    if group_size(ring_group) > 1:
        res = ring_attention(q, k, v, ring_group, scale, jq, jk, jv, joint_mask, seq_len)
        out, joint_out = res if joint else (res, None)  # [B, S/R, Hp/P, Dv], [B, L, Hp/P, Dv]
    else:
        mask = _valid_rows(seq_len, 0, S, B, q.device)  # [B, S] or None
        if joint:
            L = jq.shape[1]
            q, k, v = torch.cat([q, jq], 1), torch.cat([k, jk], 1), torch.cat([v, jv], 1)  # [B, S + L, Hp/P, D]
            mask = _cat_masks(mask, joint_mask, (B, S), (B, L), q.device)
        out = masked_attention(q, k, v, scale, q_mask=mask, k_mask=mask)  # [B, S (+ L), Hp/P, Dv]
        out, joint_out = out[:, :S], (out[:, S:] if joint else None)
    if joint:
        joint_out = all_gather(joint_out.contiguous(), group, dim=2)[:, :, :Hq]  # [B, L, Hq, Dv]
    out = all_to_all(out.contiguous(), group, scatter_dim=1, gather_dim=2)[:, :, :Hq]  # [B, S/P, Hq, Dv]
    return (out, joint_out) if joint else out


def _ring_exchange(k, v, group):
    """Start sending (k, v) to the next rank and receiving the previous rank's; returns (requests, k', v')."""
    P, r = group_size(group), group_rank(group)
    nxt, prv = (dist.get_global_rank(group, (r + d) % P) for d in (1, -1))
    k_in, v_in = torch.empty_like(k), torch.empty_like(v)
    ops_ = [dist.P2POp(dist.isend, k, nxt, group), dist.P2POp(dist.isend, v, nxt, group),
            dist.P2POp(dist.irecv, k_in, prv, group), dist.P2POp(dist.irecv, v_in, prv, group)]
    return dist.batch_isend_irecv(ops_), k_in, v_in


def _merge(acc, part):
    """LSE-merge a partial (out fp32, lse) into the accumulator (None = nothing yet)."""
    return part if acc is None else ops.merge_attention_states(*acc, *part)


def ring_attention(q, k, v, group: dist.ProcessGroup | None, scale: float, joint_q=None, joint_k=None,
                   joint_v=None, joint_mask=None, seq_len: int | None = None):
    """Attend to each rank's K/V block in turn as it travels around the ring; merge partials by log-sum-exp.

    P - 1 exchanges of a K/V shard each; the exchange of the next block overlaps the attention on the current one.
    Partials are merged in fp32 (common.ops.merge_attention_states) and cast to q.dtype at the end. Joint text:
    the text K/V is attended once by every query; the text queries attend each block separately from the video
    queries and their partials are merged in the order (text, block 0, .., block P-1), so joint_out is the same
    bits on every rank.
    Returns out [B, S/P, Hq, Dv], or (out, joint_out [B, L, Hq, Dv]) with joint_q / joint_k / joint_v.
    """
    P, r, (B, n) = group_size(group), group_rank(group), q.shape[:2]
    q_mask = _valid_rows(seq_len, r * n, n, B, q.device)  # [B, n] or None
    k, v = k.contiguous(), v.contiguous()
    video_acc, text_parts = None, [None] * P  # video rows merged as blocks arrive; text rows by block index
    for step in range(P):
        reqs = None
        if step < P - 1:
            reqs, k_next, v_next = _ring_exchange(k, v, group)
        src = (r - step) % P  # the rank this K/V block came from
        k_mask = _valid_rows(seq_len, src * n, n, B, q.device)
        if k_mask is None or bool(k_mask.any()):  # a block of padding only adds nothing
            o, l = masked_attention(q, k, v, scale, return_lse=True, q_mask=q_mask, k_mask=k_mask)
            video_acc = _merge(video_acc, (o.float(), l))  # [B, n, Hq, Dv], [B, n, Hq]
            if joint_q is not None:  # text queries on their own: the same shapes and bits on every rank
                o, l = masked_attention(joint_q, k, v, scale, return_lse=True, q_mask=joint_mask, k_mask=k_mask)
                text_parts[src] = (o.float(), l)  # [B, L, Hq, Dv], [B, L, Hq]
        if reqs is not None:
            for req in reqs:
                req.wait()
            k, v = k_next, v_next
    if joint_q is None:
        return video_acc[0].to(q.dtype)
    o, l = masked_attention(q, joint_k, joint_v, scale, return_lse=True, q_mask=q_mask, k_mask=joint_mask)
    video_acc = _merge(video_acc, (o.float(), l))
    text_acc = masked_attention(joint_q, joint_k, joint_v, scale, return_lse=True, q_mask=joint_mask,
                                k_mask=joint_mask)
    text_acc = (text_acc[0].float(), text_acc[1])
    for part in text_parts:
        if part is not None:
            text_acc = _merge(text_acc, part)
    return video_acc[0].to(q.dtype), text_acc[0].to(q.dtype)
