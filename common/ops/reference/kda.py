"""Kimi Delta Attention (KDA, Ling-3.0-Flash's linear attention) and its short causal conv, with per-request state.

Layout as in attention.py: token-major and packed; x [T, ...] holds the new tokens of B sequences, cu_seqlens [B+1]
bounds them. The decode forms (`causal_conv1d_update`, `recurrent_kda`) take one token per sequence, [B, ...].

State lives in a pool of S slots (dim 0), one slot per request, indexed by read_slots [B] and write_slots [B] or
[B, W] (int32 or long). Each op reads sequence b's initial state from read_slots[b] and writes its final state to
write_slots[b], in place; read and write slot may be the same (all reads happen before any write). With W write
columns (speculative decoding: a state per draft position, as vLLM's spec_state_indices), column i receives the state
after the sequence's token L_b - W + i (L_b its new tokens; the last column: the final state), so the step that
verifies drafts leaves the state after every candidate end. Slot 0 is the null slot: reading it gives a zero state
(a sequence starting fresh; its contents are never read, so a stale slot cannot leak in), and writing it is a no-op
(a padding entry, or a state nobody keeps), so slot 0 is never modified.

- Conv state [S, K-1, C]: the last K-1 pre-conv inputs of a sequence, oldest first, in the pool's own dtype.
- KDA state [S, H, K, V] fp32 (transformers / fla naive layout; vLLM's Triton kernels and the PyPTO ABI use
  [..., V, K]): S maps keys to values, o = S^T q.

KDA per head, token t, with g_t <= 0 the log-space decay per key channel and beta_t in (0, 1):
    S' = diag(exp(g_t)) S_(t-1);  u_t = beta_t (v_t - S'^T k_t);  S_t = S' + k_t u_t^T;  o_t = S_t^T (scale q_t).
`chunk_kda` computes the same in chunks of C tokens (the WY / UT-transform form); only rounding differs.
Internal math is fp32 throughout; outputs come back in the input's dtype.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def _read(pool: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """pool[slots] in fp32, zeros where slots == 0 (the null slot): [B, *pool.shape[1:]]."""
    slots = slots.long()
    fresh = (slots == 0).view(-1, *[1] * (pool.dim() - 1))
    return torch.where(fresh, 0.0, pool[slots].float())


def _write(pool: torch.Tensor, slots: torch.Tensor, values: torch.Tensor) -> None:
    """pool[slots] = values, in pool's dtype, in place; entries with slots == 0 are dropped (slot 0 stays as is).
    slots [N] or [B, W] with values [B, W, ...] (flattened alike).

    No host sync: a slot-0 entry writes slot 0's own contents back, so duplicate slot-0 writes agree."""
    slots = slots.long().reshape(-1)
    values = values.reshape(slots.shape[0], *pool.shape[1:])
    drop = (slots == 0).view(-1, *[1] * (pool.dim() - 1))
    pool[slots] = torch.where(drop, pool[slots], values.to(pool.dtype))


def _columns(write_slots: torch.Tensor) -> torch.Tensor:
    """write_slots as [B, W] (a [B] tensor: one column, the final state)."""
    return write_slots.view(-1, 1) if write_slots.dim() == 1 else write_slots


def _activate(y: torch.Tensor, activation: str | None) -> torch.Tensor:
    if activation is None:
        return y
    if activation in ("silu", "swish"):
        return F.silu(y)
    raise ValueError(f"unknown activation {activation!r}: expected 'silu' or None")


# ---------------------------------------------------------------- short causal conv


def causal_conv1d(x, weight, cu_seqlens, conv_state, read_slots, write_slots, activation="silu"):
    """Depthwise causal conv over packed sequences, continuing each from its conv state. -> y [T, C] in x.dtype.

    x [T, C] new pre-conv inputs; weight [C, K] (no bias; a conv1d weight [C, 1, K] is weight[:, 0]);
    conv_state [S, K-1, C]. With u = [history | new inputs] of sequence b (history = conv_state[read_slots[b]], zeros
    for slot 0): y_t = act(sum_j weight[:, j] * u_(t-K+1+j)). Then the last K-1 rows of u up to each written token
    (part history when fewer than K-1 new tokens) go to its write slot (see the module docstring). fp32 math.
    """
    C, K = weight.shape
    lens = (cu_seqlens[1:] - cu_seqlens[:-1]).long()  # [B]
    L = int(lens.max()) if lens.numel() else 0
    t = torch.arange(L, device=x.device)
    valid = t < lens[:, None]  # [B, L]
    rows = (cu_seqlens[:-1, None].long() + t).clamp(max=max(x.shape[0] - 1, 0))  # [B, L]
    new = torch.where(valid[..., None], x[rows].float(), 0.0)  # [B, L, C] the new inputs, zero-padded
    u = torch.cat((_read(conv_state, read_slots), new), dim=1)  # [B, K-1+L, C]: history, new, padding
    w = weight.float().t()  # [K, C]
    y = sum(w[j] * u[:, j:j + L] for j in range(K))  # [B, L, C]: y_t = sum_j w_j u_(t-K+1+j), u_t at row K-1+t
    _write_conv_tails(conv_state, _columns(write_slots), u, lens)
    return _activate(y[valid], activation).to(x.dtype)  # packed [T, C]


def causal_conv1d_update(x, weight, conv_state, read_slots, write_slots, activation="silu"):
    """causal_conv1d for sequences of L new tokens each (decode: L = 1; an MTP verify step: 1 + drafts), no host
    read: x [B, C] (one token) or [B, L, C] -> y alike, in x.dtype."""
    one = x.dim() == 2
    xs = x.float()[:, None] if one else x.float()  # [B, L, C]
    B, L, _ = xs.shape
    K = weight.shape[1]
    u = torch.cat((_read(conv_state, read_slots), xs), dim=1)  # [B, K-1+L, C]: history, then x
    w = weight.float().t()  # [K, C]
    y = sum(w[j] * u[:, j:j + L] for j in range(K))  # [B, L, C]
    _write_conv_tails(conv_state, _columns(write_slots), u, torch.full((B,), L, device=x.device))
    y = _activate(y, activation).to(x.dtype)
    return y[:, 0] if one else y


def _write_conv_tails(conv_state, columns, u, lens) -> None:
    """Write column i of `columns` [B, W] the K-1 rows of u [B, K-1+L, C] that end at new token lens - W + i (row
    K-2 + lens - W + i + 1 of u; the history's rows for a token before the first new one)."""
    W, K1 = columns.shape[1], conv_state.shape[1]
    ends = lens[:, None] - W + torch.arange(1, W + 1, device=u.device)  # [B, W] rows of u before the tail's end
    idx = (ends[..., None] + torch.arange(K1, device=u.device)).clamp(min=0)  # [B, W, K-1]
    tails = u[torch.arange(u.shape[0], device=u.device)[:, None, None], idx]  # [B, W, K-1, C]
    _write(conv_state, columns, tails)


# ---------------------------------------------------------------- KDA


def _kda_step(q, k, v, g, beta, S, scale):
    """One token of KDA from state S [..., H, K, V] fp32: q, k [..., H, K], v [..., H, V], g [..., H, K],
    beta [..., H], all fp32 -> (o [..., H, V], S after the token)."""
    S = S * g.exp()[..., None]  # S' = diag(e^g) S
    u = beta[..., None] * (v - torch.einsum("...hk,...hkv->...hv", k, S))  # [..., H, V]
    S = S + k[..., None] * u[..., None, :]  # S' + k u^T
    return torch.einsum("...hk,...hkv->...hv", q * scale, S), S  # S^T (scale q)


def recurrent_kda(q, k, v, g, beta, state, read_slots, write_slots, scale):
    """KDA token by token for sequences of L new tokens each (decode: L = 1; an MTP verify step: 1 + drafts), no
    host read. -> o [B, H, V] or [B, L, H, V] (as q) in v.dtype.

    q, k [B, H, K] or [B, L, H, K] (L2-normalised by the caller), v [B, (L,) H, V], g [B, (L,) H, K] (log-space
    decay, <= 0), beta [B, (L,) H]; state [S, H, K, V] fp32, read from read_slots (slot 0: zeros) and written to
    write_slots [B] or [B, W] (column i: the state after token L - W + i).
    """
    dtype, one = v.dtype, q.dim() == 3
    q, k, v, g, beta = (t.float()[:, None] if one else t.float() for t in (q, k, v, g, beta))  # [B, L, ...]
    columns = _columns(write_slots)  # [B, W]
    L, W = q.shape[1], columns.shape[1]
    S = _read(state, read_slots)  # [B, H, K, V]
    outs, kept = [], [S] * max(W - L, 0)  # states before the first token: columns no candidate uses
    for t in range(L):
        o, S = _kda_step(q[:, t], k[:, t], v[:, t], g[:, t], beta[:, t], S, scale)  # [B, H, V], [B, H, K, V]
        outs.append(o)
        if t >= L - W:
            kept.append(S)
    _write(state, columns, kept[0].unsqueeze(1) if W == 1 else torch.stack(kept, dim=1))  # [B, W, H, K, V]
    o = torch.stack(outs, dim=1).to(dtype)  # [B, L, H, V]
    return o[:, 0] if one else o


def chunk_kda(q, k, v, g, beta, cu_seqlens, state, read_slots, write_slots, scale, chunk_size=64):
    """KDA over packed sequences of any length (prefill), in chunks of chunk_size tokens. -> o [T, H, V] in v.dtype.

    q, k [T, H, K] (L2-normalised by the caller), v [T, H, V], g [T, H, K] fp32 (log-space decay, <= 0),
    beta [T, H] fp32; cu_seqlens [B+1]; state [S, H, K, V] fp32: sequence b starts from state[read_slots[b]]
    (zeros for slot 0) and its final state goes to state[write_slots[b]] (write_slots [B, W]: the states after its
    last W tokens, the last W - 1 of them computed token by token). A length-0 sequence copies its state.
    Sequences loop in Python, then their chunks (the last one may be short); heads and tokens of a chunk are batched.
    """
    S_init = _read(state, read_slots)  # [B, H, K, V], read before any write
    columns = _columns(write_slots)  # [B, W]
    W = columns.shape[1]
    o = v.new_empty(v.shape)  # [T, H, V]
    bounds = cu_seqlens.tolist()
    kept = []  # per sequence: the states after its last W tokens [W, H, K, V]
    for b in range(len(bounds) - 1):
        S, first, last = S_init[b], bounds[b], bounds[b + 1]
        split = max(first, last - W + 1)  # chunks up to here, then token by token
        for start in range(first, split, chunk_size):
            end = min(start + chunk_size, split)
            o[start:end], S = _kda_chunk(q[start:end], k[start:end], v[start:end], g[start:end], beta[start:end],
                                         S, scale)
        states = [S] * (W - (last - split))  # the state after token split - 1 (or before the sequence)
        for t in range(split, last):
            out, S = _kda_step(q[t].float(), k[t].float(), v[t].float(), g[t].float(), beta[t].float(), S, scale)
            o[t] = out.to(o.dtype)
            states.append(S)
        kept.append(torch.stack(states))
    _write(state, columns, torch.stack(kept) if kept else S_init[:, None].expand(-1, W, -1, -1, -1))
    return o


def _kda_chunk(q, k, v, g, beta, S, scale):
    """One chunk of n tokens from state S [H, K, V] fp32: -> (o [n, H, V] fp32, S after the chunk [H, K, V]).

    With G the in-chunk cumulative sum of g (G_i = g_1 + ... + g_i) and D_ijc = e^(G_ic - G_jc) for i >= j:
      A_ij = beta_i sum_c k_ic k_jc D_ijc (i > j),  T = (I + A)^-1 diag(beta),  W = T (k e^G),  U = T v;
      V' = U - W S (the chunk's u_t),  O = (scale q e^G) S + M V' with M_ij = sum_c scale q_ic k_jc D_ijc (i >= j),
      S_next = diag(e^(G_n)) S + (k e^(G_n - G))^T V'.
    Every exponent is <= 0: no e^(-G) factorisation, which overflows fp32 for long chunks. G_i - G_j is summed as
    g_(j+1) + ... + g_i (a segment sum), not as a difference of two prefix sums, whose fp32 rounding (eps * |G|,
    with |G| in the hundreds over a chunk) would be an error of that size in e^(G_i - G_j). The price is the
    [H, n, n, K] decay tensor.
    """
    q, k, v, g = (t.float().transpose(0, 1) for t in (q, k, v, g))  # [H, n, K] (v: [H, n, V])
    beta = beta.float().t()  # [H, n]
    n, Kd = k.shape[1], k.shape[2]
    G = g.cumsum(1)  # [H, n, K]
    later = torch.ones(n, n, dtype=torch.bool, device=k.device).tril(-1)[..., None]  # [n, n, 1] i > j
    seg = torch.where(later, g[:, :, None], 0.0).cumsum(1)  # [H, n, n, K] seg_ij = g_(j+1) + ... + g_i, 0 for i <= j
    D = seg.masked_fill(later.transpose(0, 1), float("-inf")).exp()  # [H, n, n, K] e^(G_i - G_j), 0 for i < j
    A = (beta[..., None] * torch.einsum("hic,hjc,hijc->hij", k, k, D)).tril(-1)  # [H, n, n] strictly lower
    M = torch.einsum("hic,hjc,hijc->hij", q * scale, k, D)  # [H, n, n] lower incl. the diagonal
    # [W | U] = (I + A)^-1 diag(beta) [k e^G | v], by forward substitution (I + A is unit lower triangular)
    rhs = beta[..., None] * torch.cat((k * G.exp(), v), dim=-1)  # [H, n, K+V]
    eye = torch.eye(n, device=k.device)
    W, U = torch.linalg.solve_triangular(eye + A, rhs, upper=False, unitriangular=True).split([Kd, v.shape[-1]], -1)
    u = U - W @ S  # [H, n, V]  V'
    o = (q * scale * G.exp()) @ S + M @ u  # [H, n, V]
    to_end = D[:, -1]  # [H, n, K] e^(G_n - G_j)
    S = G[:, -1, :, None].exp() * S + (k * to_end).transpose(1, 2) @ u  # [H, K, V]
    return o.transpose(0, 1), S
