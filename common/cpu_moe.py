"""Routed experts on oneDNN-packed CPU weights (common.cpu_gemm), every expert on this rank, in one op: the routing
read on the host, one GEMM pair per expert that has rows.

ops.moe_init_routing / grouped_matmul / moe_finalize_routing, the reference composition (and the NPU's kernels),
route on the device: a sort, scatters and gathers, ~30 small ATen calls a layer around the expert GEMMs, whose
cost at decode sizes is the calls, not the bytes. On CPU the routing is on the host already: `fused_experts` reads
the (token, expert) pairs as a list, sorts them in Python, gathers the rows once, runs each expert with rows, and
sums the weighted rows into their tokens with one index_add_ (~15 calls); one token (batch-1 decode) goes through
its k experts on its own row, no gather and no scatter. `bench/bench_moe.py` of the deepseek recipe (Xeon with AMX,
bf16, 2 threads, 2026-12-05), one layer's experts, reference ops / fused_experts: V3's bench experts 0.42 / 0.24 ms
at one token, 1.11 / 0.91 at 4, 2.77 / 2.71 at 16; V4's 0.48 / 0.29, 1.48 / 1.33, 2.72 / 2.66. Eager only: a
compiled step traces the reference composition (see fused_experts).

Tried and not kept: a dense pass over every expert (all experts' gate_up packed as one [E * 2I, D] weight, the
down projections side by side as one [D, E * I], the unrouted pairs weighted 0: two oneDNN calls a layer). With
AMX it beat the per-expert GEMMs on one layer from T * k >= E to 16 rows (V3's bench experts at T = 16: 2.90 ->
2.18 ms), but a batch-16 engine step only 1.02x (within this VM's noise), for twice the experts' memory; without
AMX it was slower at every batch size (T = 16: 3.26 -> 4.27 ms).
"""
from __future__ import annotations

import torch

from common import cpu_gemm
from common.ops.reference import moe
from common.ops.reference.moe import swiglu


def takes(w13, w2) -> bool:
    """Whether `fused_experts` takes these weights: both stacks PackedExperts (common.cpu_gemm.pack_model's)."""
    return isinstance(w13, cpu_gemm.PackedExperts) and isinstance(w2, cpu_gemm.PackedExperts)


def fused_experts(x: torch.Tensor, w13: cpu_gemm.PackedExperts, w2: cpu_gemm.PackedExperts,
                  topk_weights: torch.Tensor, topk_ids: torch.Tensor, limit: float | None = None) -> torch.Tensor:
    """sum_j topk_weights[t, j] * down_e(swiglu(gate_up_e(x[t]), limit)), e = topk_ids[t, j]: x [T, D] bf16,
    w13 [E, 2I, D] and w2 [E, D, I] packed, topk_weights [T, k] fp32, topk_ids [T, k] -> [T, D] (vLLM's
    `fused_experts`). Compiled, the reference ops' composition is traced instead (inductor fuses its routing; the
    expert GEMMs stay ops.grouped_matmul's opaque op), which needs no host read; `per_expert` as one opaque op ran
    no faster there (bench_graph.py, V3 batch 1 / 16 at 128 tokens, Xeon, bf16: 17.6-18.3 / 36.3-39.7 ms both
    ways, with the engine's step on a frame-stack chunk of its own, common/frame_stack.py)."""
    if torch.compiler.is_compiling():
        xs, row_idx, counts = moe.moe_init_routing(x, topk_ids, w13.shape[0])  # [T*k, D] by expert
        h = moe.swiglu(moe.grouped_matmul(xs, w13, counts), limit)  # [T*k, I]
        return moe.moe_finalize_routing(moe.grouped_matmul(h, w2, counts), topk_weights, row_idx)  # [T, D]
    return per_expert(x, w13.experts, w2.experts, topk_weights, topk_ids, limit)


def per_expert(x: torch.Tensor, w13: list[torch.Tensor], w2: list[torch.Tensor], topk_weights: torch.Tensor,
               topk_ids: torch.Tensor, limit: float | None = None) -> torch.Tensor:
    """fused_experts on the packed weights of each expert (w13 / w2: E of them each): the pairs sorted by expert on
    the host, their rows gathered in one index_select, one GEMM pair per expert with rows, the weighted rows summed
    into their tokens by one index_add_ in fp32. -> [T, D]"""
    T, k = topk_ids.shape
    if T == 0:  # no token here (an attention-TP share of none)
        return x.new_empty(0, w2[0].shape[0])
    ids = topk_ids.flatten().tolist()  # [T*k] expert of each pair, token-major
    if T == 1:  # one token (batch-1 decode): its k experts on its row itself, no gather, no scatter
        ys = torch.cat([cpu_gemm.linear(swiglu(cpu_gemm.linear(x, w13[e]), limit), w2[e]) for e in ids])  # [k, D]
        return (ys.float() * topk_weights.reshape(k, 1)).sum(0, keepdim=True).to(x.dtype)  # [1, D]
    order = sorted(range(T * k), key=ids.__getitem__)  # pairs by expert (stable)
    counts = [0] * len(w13)
    for e in ids:
        counts[e] += 1
    pairs = torch.tensor(order)  # [T*k]
    tokens = pairs // k  # [T*k] token of each sorted pair
    used = [e for e, c in enumerate(counts) if c]
    sizes = [counts[e] for e in used]
    rows = x.index_select(0, tokens).split(sizes)  # [T*k, D] by expert
    h = swiglu(torch.cat([cpu_gemm.linear(r, w13[e]) for e, r in zip(used, rows)]), limit)  # [T*k, I]
    y = torch.cat([cpu_gemm.linear(r, w2[e]) for e, r in zip(used, h.split(sizes))])  # [T*k, D]
    weighted = y.float() * topk_weights.flatten().index_select(0, pairs)[:, None]  # [T*k, D] fp32
    return weighted.new_zeros(T, y.shape[1]).index_add_(0, tokens, weighted).to(x.dtype)  # [T, D]
