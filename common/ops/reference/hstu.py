"""HSTU attention (generative recommenders) over jagged, packed sequences: SiLU attention, no softmax.

Layout as in attention.py: token-major and packed, q [Tq, H, D], k [Tk, H, D], v [Tk, H, Dv]; cu_seqlens_q /
cu_seqlens_k [B+1] bound each sequence, and the queries of sequence b are the LAST q_len positions of its kv
(query i sits at position kv_len - q_len + i). Equal q and k lengths is the full sequence; a longer kv is the
cached variant (keys = cached prefix + new tokens, queries = new tokens).

Per sequence: A = SiLU(alpha * q k^T) / max_seq_len, masked to 0, out = A v. The mask (upstream
`_get_valid_attn_mask` of meta-recsys/generative-recommenders):
- the last num_candidates[b] positions of the kv are candidates (all of them must be queries): a candidate sees
  every non-candidate position and itself, not the other candidates;
- any other position p sees positions <= p (causal);
- with num_contextual = C > 0, positions < C (the contextual tokens) see every non-candidate position (upstream:
  they all share id 0). That makes their outputs depend on later history, so a history cache is only exact with
  num_contextual = 0 (contextual tokens as a causal prefix).
max_seq_len is a constant (upstream passes the batch's padded length): pass the model's, so that the result does
not depend on how the batch was cut.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def hstu_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, num_candidates, alpha, max_seq_len, num_contextual=0):
    """-> out [Tq, H, Dv] in q's dtype (computed in fp32). num_candidates: [B] int tensor (0 = no candidates)."""
    dev = q.device
    q_lens = (cu_seqlens_q[1:] - cu_seqlens_q[:-1]).long()  # [B]
    k_lens = (cu_seqlens_k[1:] - cu_seqlens_k[:-1]).long()
    n_cand = num_candidates.to(dev).long()
    assert bool((q_lens <= k_lens).all()) and bool((n_cand <= q_lens).all()), \
        "need q_len <= kv_len and every candidate among the queries"
    qa, ka = torch.arange(int(q_lens.max()), device=dev), torch.arange(int(k_lens.max()), device=dev)
    q_valid, k_valid = qa < q_lens[:, None], ka < k_lens[:, None]  # [B, Qm], [B, Km]
    q_rows = (cu_seqlens_q[:-1, None].long() + qa).clamp(max=q.shape[0] - 1)  # [B, Qm]
    k_rows = (cu_seqlens_k[:-1, None].long() + ka).clamp(max=k.shape[0] - 1)  # [B, Km]
    qp, kp, vp = q[q_rows].float(), k[k_rows].float(), v[k_rows].float()  # [B, Qm, H, D], [B, Km, H, D(v)]

    pos = (k_lens - q_lens)[:, None] + qa  # [B, Qm] position of each query in its kv
    hist_end = (k_lens - n_cand)[:, None, None]  # [B, 1, 1] first candidate position
    row, col = pos[:, :, None], ka[None, None, :]  # [B, Qm, 1], [1, 1, Km]
    visible = torch.where(row < hist_end, col <= row, (col < hist_end) | (col == row))  # [B, Qm, Km]
    if num_contextual > 0:
        visible = visible | ((row < num_contextual) & (col < hist_end))
    visible = visible & q_valid[:, :, None] & k_valid[:, None, :]

    scores = torch.einsum("bqhd,bkhd->bhqk", qp, kp) * alpha  # [B, H, Qm, Km]
    attn = F.silu(scores) / max_seq_len * visible[:, None]
    out = torch.einsum("bhqk,bkhd->bqhd", attn, vp)  # [B, Qm, H, Dv]
    return out[q_valid].to(q.dtype)  # packed [Tq, H, Dv]
