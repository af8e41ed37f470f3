"""Attention over packed sequences: dense, paged, sparse (gathered rows), LSE merges and sinks.

Layout is token-major and packed: T = all query tokens of all sequences, cu_seqlens_* [B+1] int32 bound each
sequence. The queries of sequence b are the LAST q_len positions of its kv: query i sits at absolute position
kv_len - q_len + i. A query row with no visible key gives out 0 and lse -inf, never NaN.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from common.custom_op import direct_register_custom_op


MAX_DECODE_QUERIES = 8  # a decode step's queries per sequence: the new token and up to 7 MTP drafts verified


def uniform_queries(num_tokens: int, num_seqs: int, max_seqlen_q: int | None) -> int:
    """Q when each of the sequences has the same few new tokens (T = B * Q, Q <= MAX_DECODE_QUERIES: a decode
    step, one token and its drafts), else 0; host ints only, so a static-shape step takes the same path always."""
    if max_seqlen_q is None or not num_seqs or max_seqlen_q > MAX_DECODE_QUERIES:
        return 0
    return max_seqlen_q if num_tokens == num_seqs * max_seqlen_q else 0


def _masked_softmax(scores: torch.Tensor, visible: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax over the last dim of `scores` where `visible`; returns (probs, lse). Empty rows: probs 0, lse -inf."""
    scores = scores.masked_fill(~visible, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)  # [..., Q]
    probs = torch.exp(scores - lse[..., None]).nan_to_num(0.0)  # -inf - -inf = NaN on empty rows -> 0
    return probs, lse


def _attend(q, k, v, seqs, causal: bool, sliding_window: int | None, scale: float):
    """Some sequences, padded into one batch. seqs: [((q_start, q_end), (k_start, k_end))] rows of q and k / v.
    -> fp32 out [sum Q, Hq, Dv], lse [sum Q, Hq] in packed order. The G = Hq / Hkv query heads of a KV head
    share one GEMM (no K / V repeat)."""
    dev = q.device
    (q0, q1), (k0, k1) = (torch.tensor(b, device=dev).T for b in zip(*seqs))  # [B] each
    q_lens, k_lens = q1 - q0, k1 - k0
    qa, ka = torch.arange(int(q_lens.max()), device=dev), torch.arange(int(k_lens.max()), device=dev)
    q_valid, k_valid = qa < q_lens[:, None], ka < k_lens[:, None]  # [B, Qm], [B, Km]
    qp = q[(q0[:, None] + qa).clamp(max=q.shape[0] - 1)].float()  # [B, Qm, Hq, D]
    kp = k[(k0[:, None] + ka).clamp(max=k.shape[0] - 1)].float()  # [B, Km, Hkv, D]
    vp = v[(k0[:, None] + ka).clamp(max=v.shape[0] - 1)].float()  # [B, Km, Hkv, Dv]
    pos = (k_lens - q_lens)[:, None] + qa  # [B, Qm] absolute position of each query
    visible = q_valid[:, :, None] & k_valid[:, None, :]  # [B, Qm, Km]
    if causal:
        visible &= ka <= pos[..., None]
    if sliding_window is not None:
        visible &= pos[..., None] - ka < sliding_window
    (B, Qm, Hq, _), Hkv, Km = qp.shape, kp.shape[2], ka.shape[0]
    G = Hq // Hkv
    qg = qp.view(B, Qm, Hkv, G, -1).permute(0, 2, 1, 3, 4).reshape(B, Hkv, Qm * G, -1)  # [B, Hkv, Qm*G, D]
    scores = (qg @ kp.permute(0, 2, 3, 1)) * scale  # [B, Hkv, Qm*G, Km]
    probs, lse = _masked_softmax(scores.view(B, Hkv, Qm, G, Km), visible[:, None, :, None, :])
    out = probs.view(B, Hkv, Qm * G, Km) @ vp.permute(0, 2, 1, 3)  # [B, Hkv, Qm*G, Dv]
    out = out.view(B, Hkv, Qm, G, -1).permute(0, 2, 1, 3, 4).reshape(B, Qm, Hq, -1)[q_valid]  # [sum Q, Hq, Dv]
    return out, lse.permute(0, 2, 1, 3).reshape(B, Qm, Hq)[q_valid]


def _attend_fused(q, k, v, seq, causal: bool, sliding_window: int | None, scale: float):
    """One sequence through torch's fused CPU attention (flash-style, fp32 accumulation, returns the LSE).
    Its causal mask is top-left aligned, ours bottom-right: chunks of a longer sequence and sliding windows
    pass an additive mask instead. -> out [Q, Hq, Dv] (q.dtype), lse [Q, Hq] fp32."""
    (qs, qe), (ks, ke) = seq
    qh, kh, vh = (t.transpose(0, 1)[None] for t in (q[qs:qe], k[ks:ke], v[ks:ke]))  # [1, H, L, D]
    if kh.shape[1] != qh.shape[1]:
        kh, vh = (t.repeat_interleave(qh.shape[1] // kh.shape[1], dim=1) for t in (kh, vh))
    Dv, width = v.shape[-1], max(q.shape[-1], v.shape[-1])  # the kernel takes one head size: zeros pad the other
    qh, kh, vh = (F.pad(t, (0, width - t.shape[-1])) if t.shape[-1] < width else t for t in (qh, kh, vh))
    mask = None
    if causal and (sliding_window is not None or qe - qs != ke - ks):
        pos = torch.arange(ke - ks - (qe - qs), ke - ks, device=q.device)[:, None]  # [Q, 1] query positions
        ka = torch.arange(ke - ks, device=q.device)  # [K]
        visible = ka <= pos if sliding_window is None else (ka <= pos) & (pos - ka < sliding_window)  # [Q, K]
        mask = torch.zeros(visible.shape, dtype=q.dtype, device=q.device).masked_fill_(~visible, float("-inf"))
        causal = False  # the mask says it all
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        qh, kh, vh, 0.0, causal, attn_mask=mask, scale=scale)[:2]
    return out[0, ..., :Dv].transpose(0, 1), lse[0].transpose(0, 1)  # [Q, Hq, Dv], [Q, Hq]


def _fused_ok(q, k, v, seq, causal: bool, sliding_window: int | None) -> bool:
    """The fused CPU kernel applies: every query row sees a key (a causal window of at least 1 keeps the query's
    own position; other windows could leave a row empty). Q / K and V head sizes may differ (MLA's 192 / 128):
    zeros pad the smaller to the larger, which changes no score and no output column kept."""
    window_ok = sliding_window is None or (causal and sliding_window >= 1)
    return window_ok and _fused_kernel_takes(q, k, v)


def _fused_kernel_takes(q, k, v) -> bool:
    """torch's fused CPU attention kernel takes these: on CPU, one float dtype for all three."""
    return q.device.type == "cpu" and q.dtype in (torch.float32, torch.bfloat16, torch.float16) \
        and k.dtype == v.dtype == q.dtype


def apply_attention_sinks(out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor) -> torch.Tensor:
    """Add a per-head sink logit to the softmax denominator after the fact: out * sigmoid(lse - sink).

    out [T, H, Dv], lse [T, H] fp32, sinks [H] fp32.
    """
    keep = torch.sigmoid(lse - sinks.float())  # [T, H]; lse -inf -> 0
    return (out.float() * keep[..., None]).to(out.dtype)


def merge_attention_states(out_a, lse_a, out_b, lse_b) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact merge of two partial attentions over disjoint key sets. out_* [T, H, Dv], lse_* [T, H] fp32."""
    lse = torch.logaddexp(lse_a, lse_b)  # [T, H]; -inf when both are empty
    w_a = torch.exp(lse_a - lse).nan_to_num(0.0)[..., None]  # [T, H, 1]
    w_b = torch.exp(lse_b - lse).nan_to_num(0.0)[..., None]
    return (out_a.float() * w_a + out_b.float() * w_b).to(out_a.dtype), lse


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    scale: float,
    causal: bool = True,
    sliding_window: int | None = None,
    sinks: torch.Tensor | None = None,
    return_lse: bool = False,
):
    """softmax(scale * q k^T + mask) v per sequence; GQA / MQA when Hq is a multiple of Hkv.

    q [T, Hq, D], k [S, Hkv, D], v [S, Hkv, Dv]. causal: key j visible iff j <= pos; sliding_window W: also
    pos - j < W. sinks [Hq]: a per-head logit in the denominator only. Returns out [T, Hq, Dv] (q.dtype) and,
    with return_lse, lse [T, Hq] fp32 of the scaled, masked scores (sink not included).
    """
    out = q.new_zeros(q.shape[0], q.shape[1], v.shape[-1], dtype=torch.float32)  # [T, Hq, Dv]
    lse = q.new_full(q.shape[:2], float("-inf"), dtype=torch.float32)  # [T, Hq]
    bq, bk = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    seqs = [s for s in zip(zip(bq, bq[1:]), zip(bk, bk[1:])) if s[0][1] > s[0][0]]
    decodes = [s for s in seqs if s[0][1] - s[0][0] == 1]
    prefills = [s for s in seqs if s[0][1] - s[0][0] > 1]
    fused = [s for s in prefills if _fused_ok(q, k, v, s, causal, sliding_window)]
    for seq in fused:  # one sequence at a time, torch's fused kernel
        (qs, qe), _ = seq
        o, lse[qs:qe] = _attend_fused(q, k, v, seq, causal, sliding_window, scale)
        out[qs:qe] = o.float()
    batches = ([decodes] if decodes else []) + [[s] for s in prefills if s not in fused]  # no padding blow-up
    for batch in batches:
        rows = torch.cat([torch.arange(qs, qe, device=q.device) for (qs, qe), _ in batch])
        out[rows], lse[rows] = _attend(q, k, v, batch, causal, sliding_window, scale)
    if sinks is not None:
        out = apply_attention_sinks(out, lse, sinks)
    out = out.to(q.dtype)
    return (out, lse) if return_lse else out


def _gather_pages(cache: torch.Tensor, block_tables: torch.Tensor, starts: list[int], ends: list[int]) -> torch.Tensor:
    """Rows [start, end) of each sequence, in order, out of a paged cache [num_blocks, block_size, ...]."""
    block_size = cache.shape[1]
    slots = []
    for b, (start, end) in enumerate(zip(starts, ends)):
        pos = torch.arange(start, end, device=cache.device)
        slots.append(block_tables[b, pos // block_size].long() * block_size + pos % block_size)
    return rows_at(cache, torch.cat(slots))


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor | None,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    scale: float,
    causal: bool = True,
    sliding_window: int | None = None,
    sinks: torch.Tensor | None = None,
    return_lse: bool = False,
    max_seqlen_q: int | None = None,
    max_seqlen_k: int | None = None,
):
    """attention() with K/V read through a paged cache.

    k_cache [num_blocks, block_size, Hkv, D], v_cache [num_blocks, block_size, Hkv, Dv] (None: V = K),
    block_tables [B, max_blocks] int32, seq_lens [B] int32 = kv length of each sequence, new tokens included.
    max_seqlen_q / max_seqlen_k: host bounds of the new tokens / kv length per sequence (ForwardBatch's); given,
    a decode batch (every sequence the same Q <= MAX_DECODE_QUERIES new tokens: 1, or 1 + its MTP drafts) reads
    no tensor on the host and pads its keys to a width they fix (the window, or max_seqlen_k): the static-shape
    decode step of graph mode. Each of its queries reads the pages up to its own position (the step's tokens are
    in the cache already: a draft sees the ones before it, not the ones after).
    """
    T, B = q.shape[0], seq_lens.shape[0]
    if T == 0:  # no tokens: an idle data-parallel rank's step
        out = q.new_empty(0, q.shape[1], (k_cache if v_cache is None else v_cache).shape[-1])
        return (out, q.new_empty(0, q.shape[1], dtype=torch.float32)) if return_lse else out
    Q = uniform_queries(T, B, max_seqlen_q) if max_seqlen_q is not None else int(
        T == B and bool((cu_seqlens_q[1:] - cu_seqlens_q[:-1] == 1).all()))
    if Q:
        if Q > 1:  # query i of its sequence's Q sits at kv length - (Q - 1 - i): one row per query
            behind = Q - 1 - torch.arange(T, device=q.device) % Q  # [T]
            seq_lens = seq_lens.repeat_interleave(Q) - behind  # [T] keys each query sees
            block_tables = block_tables.repeat_interleave(Q, 0)  # [T, max_blocks]
        width = None
        if max_seqlen_k is not None:
            width = max_seqlen_k if sliding_window is None else min(max_seqlen_k, sliding_window)
        window_bound = sliding_window is not None and width is not None and width <= TRACED_WINDOW_MAX
        if q.device.type == "cpu" and torch.compiler.is_compiling() and not window_bound:
            # a CPU graph: the keys each sequence holds, not max_model_len's
            out, lse = torch.ops.npu_cookbook.paged_decode(q, k_cache, v_cache, block_tables, seq_lens, scale,
                                                           sliding_window)
        else:
            out, lse = _paged_decode(q, k_cache, v_cache, block_tables, seq_lens, scale, sliding_window, width)
        if sinks is not None:
            out = apply_attention_sinks(out, lse, sinks)
        out = out.to(q.dtype)
        return (out, lse) if return_lse else out
    ends, q_lens = seq_lens.tolist(), (cu_seqlens_q[1:] - cu_seqlens_q[:-1]).tolist()
    starts = [0] * len(ends)
    if sliding_window is not None:  # keys older than every query's window are never read
        starts = [max(0, e - q - sliding_window + 1) for e, q in zip(ends, q_lens)]
    k = _gather_pages(k_cache, block_tables, starts, ends)  # [S, Hkv, D]
    v = k if v_cache is None else _gather_pages(v_cache, block_tables, starts, ends)  # [S, Hkv, Dv]
    kv_lens = torch.tensor([e - s for s, e in zip(starts, ends)], device=seq_lens.device)
    cu_seqlens_k = F.pad(kv_lens.cumsum(0), (1, 0)).int()  # [B+1]
    return attention(q, k, v, cu_seqlens_q, cu_seqlens_k, scale, causal, sliding_window, sinks, return_lse)


def rows_at(cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """cache [num_blocks, block_size, ...] at the rows `slots` (any shape) -> [*slots.shape, ...]. index_select on
    the flat rows: a third of advanced indexing's time on CPU for decode-sized gathers (2,240 rows of 576: 0.7 against
    2.0 ms), the same values."""
    flat = cache.flatten(0, 1)  # [N * block_size, ...]
    return flat.index_select(0, slots.reshape(-1)).view(*slots.shape, *flat.shape[1:])


# A compiled CPU decode step pads a sliding window of at most this many keys (traced: inductor fuses the slot
# arithmetic and the gather; the window bounds the padding); longer windows and full attention go through the
# opaque paged_decode op, which reads the width the step's sequences hold on the host.
TRACED_WINDOW_MAX = 512
SHORT_ROWS = 4  # paged decode attends the rows of a quarter of the longest visible length or less on their own


def _paged_decode(q, k_cache, v_cache, block_tables, seq_lens, scale: float, sliding_window: int | None,
                  width: int | None = None):
    """One query per row (B = T: a decode token, or a draft with its own block-table row and kv end): its visible keys
    gathered straight from the pages into one batch padded to `width` keys (None: the widest row's, read on the host;
    then full attention gathers whole pages, _decode_pages) and attended by _decode_attend. With width None, rows
    that see at most a quarter of the widest row's keys (SHORT_ROWS; a graph bucket's padding sequences see one) are
    attended in a batch of their own, so they are not gathered and scored at the widest row's length.
    -> fp32 out [B, Hq, Dv], lse [B, Hq]."""
    B, Hq, _ = q.shape
    block_size = k_cache.shape[1]
    ends = seq_lens.long()  # [B] the new token sits at position end - 1 and sees keys [start, end)
    starts = (ends - sliding_window).clamp(min=0) if sliding_window is not None else None  # None: from 0
    if width is None:  # the widths read on the host, in one read
        lens = (ends if starts is None else ends - starts).tolist()  # keys each row sees
        width = max(lens)
        short = [n * SHORT_ROWS <= width for n in lens]
        if any(short) and not all(short):
            Dv = (k_cache if v_cache is None else v_cache).shape[-1]
            out, lse = q.new_empty(B, Hq, Dv, dtype=torch.float32), q.new_empty(B, Hq, dtype=torch.float32)
            for want in (True, False):
                rows = torch.tensor([i for i, s in enumerate(short) if s == want], device=q.device)  # [B_s], [B_l]
                out[rows], lse[rows] = _paged_decode(q[rows], k_cache, v_cache, block_tables[rows], seq_lens[rows],
                                                     scale, sliding_window)
            return out, lse
        if starts is None:  # full attention: whole pages
            return _decode_pages(q, k_cache, v_cache, block_tables, ends, width, min(lens) < width, scale)
    ka = torch.arange(width, device=q.device)  # [Km]
    if starts is None:
        valid = ka < ends[:, None]  # [B, Km]
        pos = torch.where(valid, ka, 0)  # [B, Km] padding reads a real slot, masked below
    else:
        pos = starts[:, None] + ka  # [B, Km]
        valid = pos < ends[:, None]  # [B, Km]
        pos = torch.where(valid, pos, starts[:, None])  # padding reads a real slot, masked below
    slots = block_tables.gather(1, pos // block_size).long() * block_size + pos % block_size  # [B, Km]
    kp = rows_at(k_cache, slots)  # [B, Km, Hkv, D]
    vp = kp if v_cache is None else rows_at(v_cache, slots)  # [B, Km, Hkv, Dv]
    return _decode_attend(q, kp, vp, valid, scale)


def _decode_pages(q, k_cache, v_cache, block_tables, ends, width: int, ragged: bool, scale: float):
    """_paged_decode for full attention with the width read on the host: each row's first ceil(width / block_size)
    pages gathered whole (one index_select of pages: no slot arithmetic, no gather of rows; 249 -> 137-166 us a
    batch-1 layer of V3's bench, bf16), cut to `width` keys. Rows shorter than the widest (`ragged`) have their
    keys past the end masked; otherwise no mask at all (batch-1 decode, a batch of equal lengths). The pages past
    a row's own are read as they are (the null block 0 in the engine's tables: any valid block index) and masked.
    -> fp32 out [B, Hq, Dv], lse [B, Hq]."""
    B, block_size = q.shape[0], k_cache.shape[1]
    pages = block_tables[:, : -(-width // block_size)].reshape(-1)  # [B * n] the pages the widest row spans

    def gather(cache):  # [num_blocks, block_size, Hkv, D] -> [B, width, Hkv, D]
        return cache.index_select(0, pages).view(B, -1, *cache.shape[2:])[:, :width]

    kp = gather(k_cache)
    vp = kp if v_cache is None else gather(v_cache)
    valid = torch.arange(width, device=q.device) < ends[:, None] if ragged else None  # [B, Km]
    return _decode_attend(q, kp, vp, valid, scale)


def _decode_attend(q, kp, vp, valid, scale: float):
    """One query row per sequence over its gathered keys: q [B, Hq, D], kp / vp [B, Km, Hkv, D / Dv], valid [B, Km]
    (None: every key visible) -> fp32 out [B, Hq, Dv], lse [B, Hq]."""
    B, Hq, _ = q.shape
    Hkv = kp.shape[2]
    if _fused_kernel_takes(q, kp, vp) and q.shape[-1] == vp.shape[-1]:  # (K = V in every decode caller)
        return _decode_fused(q, kp, vp, valid, scale)
    kp, vp = kp.float(), vp.float()
    qg = q.float().view(B, Hkv, Hq // Hkv, -1)  # [B, Hkv, G, D]
    scores = (qg @ kp.permute(0, 2, 3, 1)) * scale  # [B, Hkv, G, Km]
    if valid is None:
        lse = torch.logsumexp(scores, dim=-1)  # [B, Hkv, G]
        probs = torch.exp(scores - lse[..., None])
    else:
        probs, lse = _masked_softmax(scores, valid[:, None, None, :])
    out = probs @ vp.permute(0, 2, 1, 3)  # [B, Hkv, G, Dv]
    return out.reshape(B, Hq, -1), lse.reshape(B, Hq)


def _paged_decode_op(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor | None, block_tables: torch.Tensor,
                     seq_lens: torch.Tensor, scale: float, sliding_window: int | None
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """_paged_decode as one opaque op of a compiled CPU graph: its output shapes are the step's alone, and inside it
    reads the longest kv length of the step on the host (no device sync on CPU), so a graph step gathers and scores
    the keys its sequences hold, not keys padded to max_model_len (a CUDA graph cannot read the host: it pads)."""
    return _paged_decode(q, k_cache, v_cache, block_tables, seq_lens, scale, sliding_window)


def _paged_decode_fake(q, k_cache, v_cache, block_tables, seq_lens, scale, sliding_window):
    B, Hq = q.shape[:2]
    Dv = (k_cache if v_cache is None else v_cache).shape[-1]
    return q.new_empty(B, Hq, Dv, dtype=torch.float32), q.new_empty(B, Hq, dtype=torch.float32)


direct_register_custom_op("paged_decode", _paged_decode_op, _paged_decode_fake)


def _decode_fused(q, kp, vp, valid, scale: float):
    """_paged_decode's attention through torch's fused CPU kernel (flash-style, fp32 accumulation, no fp32 copy of
    the keys): a KV head's G query heads are its G query rows, which see the same keys (no mask between them), so
    MQA / GQA need no repeat. q [B, Hq, D], kp / vp [B, Km, Hkv, D / Dv], valid [B, Km] (None: no mask) -> fp32
    out [B, Hq, Dv], lse [B, Hq]."""
    B, Hq, _ = q.shape
    Hkv = kp.shape[2]
    qh = q.reshape(B, Hkv, Hq // Hkv, -1)  # [B, Hkv, G, D]
    # additive mask [B, 1, 1, Km]: log 1 = 0 where visible, log 0 = -inf where not
    mask = None if valid is None else valid.to(q.dtype).log()[:, None, None]
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        qh, kp.transpose(1, 2), vp.transpose(1, 2), 0.0, False, attn_mask=mask, scale=scale)[:2]
    return out.reshape(B, Hq, -1).float(), lse.reshape(B, Hq)  # [B, Hkv, G, Dv] -> [B, Hq, Dv]


def reshape_and_cache(k, v, k_cache, v_cache, slot_mapping: torch.Tensor) -> None:
    """In place: cache.view(-1, Hkv, D)[slot] = k row by row (same for v).

    k [T, Hkv, D], v [T, Hkv, Dv] or None (K = V models, then v_cache is None too), slot_mapping [T] int64, every
    slot a cache row: padding tokens write to the null block 0 (which no sequence reads), so the write has no
    data-dependent shape (a padded decode step captures it as it is). Two rows on one slot: one of them wins.
    """
    slots = slot_mapping.long()  # [T]
    # index_copy_, not `[slots] = k`: the same write, and no broadcast of k to guard on (a graph traced over a
    # symbolic batch size then serves a batch of one too)
    k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, slots, k)
    if v is not None:
        v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, slots, v)


def sparse_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, indices: torch.Tensor, scale: float, return_lse: bool = False
):
    """Each query attends only to its listed rows of k / v.

    q [T, H, D], k [N, Hkv, D], v [N, Hkv, Dv] (the same tensor as k for K = V models: its rows are gathered once),
    indices [T, K] global rows (-1 = empty slot).
    Returns out [T, H, Dv] (q.dtype) and, with return_lse, lse [T, H] fp32.
    """
    T, H, _ = q.shape
    Hkv = k.shape[1]
    valid = indices >= 0  # [T, K]
    rows = indices.clamp(min=0).long()  # [T, K]
    k_sel = k[rows].float().transpose(1, 2)  # [T, Hkv, K, D]
    v_sel = k_sel if v is k else v[rows].float().transpose(1, 2)  # [T, Hkv, K, Dv]; K = V models gather once
    qg = q.float().view(T, Hkv, H // Hkv, -1)  # [T, Hkv, G, D]
    scores = (qg @ k_sel.transpose(-1, -2)) * scale  # [T, Hkv, G, K]
    probs, lse = _masked_softmax(scores, valid[:, None, None, :])
    out = (probs @ v_sel).reshape(T, H, -1).to(q.dtype)  # [T, H, Dv]
    return (out, lse.reshape(T, H)) if return_lse else out
