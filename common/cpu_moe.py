"""Routed experts on oneDNN-packed CPU weights (common.cpu_gemm) with every expert on this rank: one GEMM per
expert that has rows, or one dense pass over all experts when the batch touches them all.

The per-expert path (the pairs sorted by expert on the host, one GEMM pair per expert with rows, a weighted
index_add_) makes two oneDNN calls per routed expert, and at decode sizes the calls cost beyond their bytes (~15-20
us each on the 2-core Xeon of BENCHMARKS.md).
The dense pass makes two calls in all, on the experts packed as one weight each (PackedExperts.stacked):

    h = x @ [gate_up of every expert].T               [T, E * 2I]
    a = swiglu(h per expert) * g                      [T, E, I]   g[t, e]: t's routing weight for e, else 0
    out = a @ [down of every expert, side by side].T  [T, D]      the GEMM sums over the experts (the combine)

It computes E / k times the routed FLOPs, so it pays only where the matrix unit makes FLOPs cheap (AMX) and the
batch reads most experts anyway (T * k >= E), up to the batch where the extra FLOPs catch up with the calls saved.
`bench/bench_moe.py` of the deepseek recipe (Xeon with AMX, bf16, 2 threads, 2026-12-05), one layer's experts,
ms per expert / dense: DeepSeek-V3's bench experts (16 of [768, 1024] and [1024, 384], top-2) T = 1 0.42 / 1.99,
T = 4 1.07 / 2.00, T = 8 2.12 / 2.00, T = 16 2.89 / 2.07, T = 32 2.71 / 2.78, T = 64 3.17 / 3.53; V4's (12 of
[1024, 1024] and [1024, 512]) alike (T = 16 2.86 / 2.12). Hence DENSE_MAX_ROWS. Without AMX (oneDNN capped at
AVX512_CORE_BF16, as on Zen 4 / 5) the dense pass was slower at every T (V3's experts, T = 16: 3.26 / 4.27 ms),
hence only where common.cpu_gemm.amx() holds. DeepSeek-V3's engine opts in (a batch-16 decode step 1.06x faster,
eager and in graph mode; batch 1 unchanged); DeepSeek-V4's does not: its whole MoE layers at T = 16 ran no faster
(8 layers 24.3 ms per expert, 25.1 dense), nor its eager engine at batch 16.

A model calls `fused_experts` where `takes` says its expert stacks are packed, and opts in to the dense pass by
naming their axes (`dense_pass_axes` on the module that holds them: "n" for the first projection, "k" for the
second), which common.cpu_gemm.pack_model then also packs whole where it is asked to (on AMX, by the ModelRunner).
Compiled, `fused_experts` is one opaque op that chooses per call: as a guard on the batch size, the choice made a
V3 graph engine's 7 buckets 6 graphs instead of 2 (cold compile 123 s against 43 s).
"""
from __future__ import annotations

import torch

from common import cpu_gemm
from common.custom_op import direct_register_custom_op
from common.ops.reference.moe import swiglu

DENSE_MAX_ROWS = 16  # past this the dense pass's E / k times the FLOPs cost more than the calls it saves


def takes(w13, w2) -> bool:
    """Whether `fused_experts` takes these weights: both PackedExperts, both packed whole (along "n" for w13, "k"
    for w2: the dense pass too) or neither (per expert only)."""
    if not (isinstance(w13, cpu_gemm.PackedExperts) and isinstance(w2, cpu_gemm.PackedExperts)):
        return False
    return (w13.stacked_axis, w2.stacked_axis) in ((None, None), ("n", "k"))


def fused_experts(x: torch.Tensor, w13: cpu_gemm.PackedExperts, w2: cpu_gemm.PackedExperts,
                  topk_weights: torch.Tensor, topk_ids: torch.Tensor, limit: float | None = None) -> torch.Tensor:
    """sum_j topk_weights[t, j] * down_e(swiglu(gate_up_e(x[t]), limit)), e = topk_ids[t, j]: x [T, D] bf16,
    w13 [E, 2I, D] and w2 [E, D, I] as `takes` wants them, topk_weights [T, k] fp32, topk_ids [T, k] -> [T, D];
    through `dense_experts` where the stacks are packed whole and `dense_pass` says, else `per_expert`. Compiled,
    one opaque op that chooses per call (no guard on the batch size: a shape-generic graph stays one graph)."""
    args = (x, w13.experts, w2.experts, w13.stacked, w2.stacked, topk_weights, topk_ids, limit)
    if torch.compiler.is_compiling():
        return torch.ops.npu_cookbook.fused_experts(*args)
    return _fused_experts(*args)


def dense_pass(T: int, k: int, E: int) -> bool:
    """Whether T tokens, k experts each, go through the dense pass over E experts."""
    return E <= T * k and T <= DENSE_MAX_ROWS


def per_expert(x, w13: list[torch.Tensor], w2: list[torch.Tensor], topk_weights, topk_ids, limit=None):
    """fused_experts' per-expert path, its routing read on the host (CPU tensors: no sync): the (token, expert)
    pairs sorted by expert, their rows gathered in one index_select, one GEMM pair per expert with rows (w13 / w2:
    E packed weights each), the weighted rows summed into their tokens by one index_add_. -> [T, D]"""
    T, k = topk_ids.shape
    if T == 0:  # no token here (an attention-TP share of none)
        return x.new_empty(0, w2[0].shape[0])
    ids = topk_ids.flatten().tolist()  # [T*k] expert of each pair, token-major
    if T == 1:  # one token (batch-1 decode): its k experts on its row itself, no gather, no scatter
        ys = torch.cat([cpu_gemm.linear(swiglu(cpu_gemm.linear(x, w13[e]), limit), w2[e]) for e in ids])  # [k, D]
        return (ys.float() * topk_weights.view(k, 1)).sum(0, keepdim=True).to(x.dtype)  # [1, D]
    order = sorted(range(T * k), key=ids.__getitem__)  # pairs by expert (stable)
    counts = [0] * len(w13)
    for e in ids:
        counts[e] += 1
    pairs = torch.tensor(order)  # [T*k]
    tokens = pairs // k  # [T*k] token of each sorted pair
    xs = x.index_select(0, tokens)  # [T*k, D]
    used = [e for e, c in enumerate(counts) if c]
    rows = xs.split([counts[e] for e in used])
    h = swiglu(torch.cat([cpu_gemm.linear(r, w13[e]) for e, r in zip(used, rows)]), limit)  # [T*k, I]
    y = torch.cat([cpu_gemm.linear(r, w2[e]) for e, r in zip(used, h.split([counts[e] for e in used]))])  # [T*k, D]
    weighted = y.float() * topk_weights.flatten().index_select(0, pairs)[:, None]  # [T*k, D] fp32
    return weighted.new_zeros(T, y.shape[1]).index_add_(0, tokens, weighted).to(x.dtype)  # [T, D]


def dense_experts(x, w13_stacked: torch.Tensor, w2_stacked: torch.Tensor, topk_weights, topk_ids, num_experts: int,
                  limit=None):
    """fused_experts' dense pass: every token through every expert (w13_stacked / w2_stacked: PackedExperts.stacked
    of the two stacks), the unrouted ones weighted 0. -> [T, D]"""
    T, E = x.shape[0], num_experts
    h = cpu_gemm.linear(x, w13_stacked).view(T, E, -1)  # [T, E, 2I]
    gates = topk_weights.new_zeros(T, E).scatter_add_(1, topk_ids.long(), topk_weights.float())  # [T, E]
    a = (swiglu(h, limit).float() * gates[..., None]).to(x.dtype)  # [T, E, I]
    return cpu_gemm.linear(a.flatten(1), w2_stacked)  # [T, D]


def _fused_experts(x, w13: list[torch.Tensor], w2: list[torch.Tensor], w13_stacked: torch.Tensor | None,
                   w2_stacked: torch.Tensor | None, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                   limit: float | None) -> torch.Tensor:
    T, k = topk_ids.shape
    if w13_stacked is not None and dense_pass(T, k, len(w13)):
        return dense_experts(x, w13_stacked, w2_stacked, topk_weights, topk_ids, len(w13), limit)
    return per_expert(x, w13, w2, topk_weights, topk_ids, limit)


def _fused_experts_op(x: torch.Tensor, w13: list[torch.Tensor], w2: list[torch.Tensor],
                      w13_stacked: torch.Tensor | None, w2_stacked: torch.Tensor | None,
                      topk_weights: torch.Tensor, topk_ids: torch.Tensor, limit: float | None) -> torch.Tensor:
    return _fused_experts(x, w13, w2, w13_stacked, w2_stacked, topk_weights, topk_ids, limit)


direct_register_custom_op("fused_experts", _fused_experts_op,
                          lambda x, w13, w2, *_: x.new_empty(x.shape[0], w2[0].shape[0]))
