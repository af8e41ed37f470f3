"""Mixture-of-experts pieces: router top-k, dispatch (init routing), expert matmuls, combine (finalize routing)."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from common import cpu_gemm
from common.custom_op import direct_register_custom_op

SCORE_FUNCS = {
    "softmax": lambda x: x.softmax(dim=-1),
    "sigmoid": torch.sigmoid,
    "sqrtsoftplus": lambda x: F.softplus(x).sqrt(),
}


def moe_gating_topk(
    logits: torch.Tensor,
    k: int,
    bias: torch.Tensor | None = None,
    score_func: str = "softmax",
    group_count: int = 1,
    k_group: int = 1,
    renorm: bool = True,
    routed_scaling_factor: float = 1.0,
    eps: float = 1e-20,
    tid2eid: torch.Tensor | None = None,
    input_ids: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Router: (weights [T, k] fp32, indices [T, k] int32) from logits [T, E].

    Scores = score_func(logits) in fp32. Selection ranks scores + bias (bias is for selection only), limited to the
    k_group best of group_count groups when group_count > 1 (group score = sum of its top-2 biased scores,
    DeepSeek-V3). Hash routing: with tid2eid [V, k], indices = tid2eid[input_ids], no selection.
    weights = scores at indices, / (sum + eps) if renorm, then * routed_scaling_factor.
    """
    scores = SCORE_FUNCS[score_func](logits.float())  # [T, E]
    if tid2eid is not None:
        indices = tid2eid[input_ids].long()  # [T, k]
    else:
        biased = scores if bias is None else scores + bias.float()  # [T, E]
        if group_count > 1:
            grouped = biased.view(biased.shape[0], group_count, biased.shape[1] // group_count)  # [T, G, E/G]
            group_scores = grouped.topk(2, dim=-1).values.sum(-1)  # [T, G]
            keep = torch.zeros_like(group_scores, dtype=torch.bool)
            keep.scatter_(1, group_scores.topk(k_group, dim=-1).indices, True)  # [T, G]
            biased = grouped.masked_fill(~keep[..., None], float("-inf")).flatten(1)  # [T, E]
        indices = biased.topk(k, dim=-1).indices  # [T, k]
    weights = scores.gather(1, indices)  # [T, k]
    if renorm:
        weights = weights / (weights.sum(-1, keepdim=True) + eps)
    return weights * routed_scaling_factor, indices.int()


def moe_init_routing(
    x: torch.Tensor, indices: torch.Tensor, num_experts: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Dispatch: copies of token rows sorted by expert.

    x [T, H], indices [T, k]. Returns expanded_x [T*k, H] (stable sort by expert of the token-major (t, j) pairs),
    expanded_row_idx [T*k] int32 and tokens_per_expert [E] int64. expanded_row_idx follows torch_npu
    npu_moe_init_routing_v2 with row_idx_type=0: expanded_row_idx[t*k + j] = the row of expanded_x holding token
    t's copy for its j-th expert (what npu_moe_finalize_routing with drop_pad_mode=2 reads).
    """
    flat = indices.flatten().long()  # [T*k] expert of each (token, slot), token-major
    order = torch.sort(flat, stable=True).indices  # [T*k] (t*k + j) of each expanded row
    expanded_x = x[order // indices.shape[1]]  # [T*k, H]
    expanded_row_idx = torch.empty_like(order).scatter_(0, order, torch.arange(len(order), device=order.device))
    counts = torch.zeros(num_experts, dtype=torch.long, device=flat.device).index_add_(0, flat, torch.ones_like(flat))
    return expanded_x, expanded_row_idx.int(), counts  # counts [E]: bincount, with a static shape


def moe_finalize_routing(
    expert_out: torch.Tensor, weights: torch.Tensor, expanded_row_idx: torch.Tensor, shared: torch.Tensor | None = None
) -> torch.Tensor:
    """Combine: out[t] = sum_j weights[t, j] * expert_out[expanded_row_idx[t*k + j]] (+ shared[t]), in fp32.

    expert_out [T*k, H], weights [T, k], shared [T, H] or None. Returns [T, H] in expert_out.dtype.
    """
    rows = expert_out[expanded_row_idx.long()].view(*weights.shape, expert_out.shape[-1]).float()  # [T, k, H]
    out = (rows * weights.float()[..., None]).sum(1)  # [T, H]
    if shared is not None:
        out = out + shared.float()
    return out.to(expert_out.dtype)


def grouped_matmul(
    x: torch.Tensor, weight: torch.Tensor | cpu_gemm.PackedExperts, tokens_per_expert: torch.Tensor
) -> torch.Tensor:
    """Per expert e: y_e = x_e @ weight[e].T; x [M, K] sorted by expert, weight [E, N, K] (nn.Linear) -> [M, N].
    weight: a dense tensor, or the cpu_gemm.PackedExperts that cpu_gemm.pack_model made of one (same results).

    One GEMM per expert over its rows, split on the host (`tolist` of the group sizes). On CPU that is no device
    sync; under torch.compile the split runs inside one custom op, opaque to it, so a compiled decode step keeps
    it whole (fullgraph) with static shapes around it ([M, K] in, [M, N] out). On an accelerator a split read on
    the host is a device sync, which a captured graph cannot hold: compiled there, the matmul is `static_grouped_
    matmul`'s. Eager (and autograd, and the FLOP counter) see the loop itself."""
    weights = weight.experts if isinstance(weight, cpu_gemm.PackedExperts) else [weight]
    if torch.compiler.is_compiling():
        if x.device.type == "cpu":
            return torch.ops.npu_cookbook.grouped_matmul(x, weights, tokens_per_expert)
        return static_grouped_matmul(x, weight, tokens_per_expert)
    return _expert_loop(x, weights, tokens_per_expert)


def static_grouped_matmul(x: torch.Tensor, weight: torch.Tensor, tokens_per_expert: torch.Tensor) -> torch.Tensor:
    """grouped_matmul without reading the group sizes on the host (no device sync, shapes fixed by x and weight):
    fewer rows than experts (M < E), each row's expert weight gathered and one batched GEMM (reads M of the E
    [N, K] matrices); else every expert over every row (reads each matrix once: with M >= E rows a decode batch
    touches most experts anyway) and each row's own result picked. Rows past sum(tokens_per_expert) get the last
    expert's product (callers ignore them). x [M, K], weight [E, N, K] dense -> [M, N]."""
    M, E = x.shape[0], weight.shape[0]
    rows = torch.arange(M, device=x.device)
    expert = torch.searchsorted(tokens_per_expert.cumsum(0), rows, right=True).clamp(max=E - 1)  # [M]
    if M < E:
        return torch.bmm(x.unsqueeze(1), weight[expert].transpose(1, 2)).squeeze(1)  # [M, 1, K] @ [M, K, N]
    return torch.einsum("mk,enk->emn", x, weight)[expert, rows]  # [E, M, N] -> [M, N]


def _grouped_matmul(x: torch.Tensor, weights: list[torch.Tensor], tokens_per_expert: torch.Tensor) -> torch.Tensor:
    return _expert_loop(x, weights, tokens_per_expert)


def _expert_loop(x: torch.Tensor, weights: list[torch.Tensor], tokens_per_expert: torch.Tensor) -> torch.Tensor:
    """weights: [the dense stack [E, N, K]] or E oneDNN-packed [N, K] weights. One GEMM per expert with rows, the
    results concatenated (one copy, not one per expert)."""
    packed = len(weights) > 1 or weights[0].is_mkldnn
    counts = tokens_per_expert.tolist()
    N, outs, routed = weights[0].shape[-2], [], 0
    for e, n in enumerate(counts):
        if n:  # a slice per expert with rows, not a split into E views (a decode step's few experts of many)
            rows = x[routed : routed + n]  # [M_e, K]
            outs.append(cpu_gemm.linear(rows, weights[e]) if packed else rows @ weights[0][e].T)  # [M_e, N]
            routed += n
    if routed < x.shape[0]:  # rows past the routed ones (a fixed-capacity dispatch buffer): left unset
        outs.append(x.new_empty(x.shape[0] - routed, N))
    return torch.cat(outs) if outs else x.new_empty(0, N)  # [M, N]


direct_register_custom_op("grouped_matmul", _grouped_matmul,
                          lambda x, weights, tokens_per_expert: x.new_empty(x.shape[0], weights[0].shape[-2]))


def swiglu(x: torch.Tensor, limit: float | None = None) -> torch.Tensor:
    """silu(gate) * up for x [..., 2I] = [gate | up]; with limit: gate <= limit, -limit <= up <= limit."""
    gate, up = x.chunk(2, dim=-1)  # [..., I] each
    if limit is not None:
        gate, up = gate.clamp(max=limit), up.clamp(-limit, limit)
    return F.silu(gate) * up
