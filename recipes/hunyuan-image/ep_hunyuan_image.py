"""MoE expert parallel, the "double routing" of the upstream Ascend recipe, on torch.distributed.

Each of the P ranks of the ep group holds E/P experts and every token's hidden state (attention is replicated or
tensor parallel). The tokens are split into P runs; each rank routes its run (router, init routing sorted by
expert), sends every rank the rows for its experts (all-to-all of counts, then of rows), re-sorts what arrives by
local expert, runs the grouped matmuls, undoes the sort, sends the rows back (all-to-all), combines with the router
weights and the shared MLP (finalize routing), and the runs are all-gathered into the full sequence again.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from common import ops
from common.parallel import all_gather_v, all_to_all_v, group_rank, group_size


def ep_moe(moe, x: torch.Tensor, group) -> torch.Tensor:
    """HunyuanMoE forward with experts spread over `group`. x [T, H], the same on every rank -> [T, H]."""
    P, r = group_size(group), group_rank(group)
    E, E_local = moe.experts.num_experts, moe.experts.num_local
    runs = x.tensor_split(P)  # this rank routes runs[r]
    x_r = runs[r]  # [T_r, H]
    weights, indices = moe.gate(x_r, moe.top_k)  # [T_r, k]
    expanded, row_idx, counts = ops.moe_init_routing(x_r, indices, E)  # [T_r*k, H] sorted by global expert
    send_counts = counts.view(P, E_local)  # rows for (destination rank, its local expert)
    recv_counts = torch.empty_like(send_counts)  # [P source ranks, E_local]
    dist.all_to_all_single(recv_counts, send_counts, group=group)
    send, recv = send_counts.sum(1).tolist(), recv_counts.sum(1).tolist()
    received = all_to_all_v(expanded, send, recv, group)  # [M, H] by source rank, then local expert
    local_expert = torch.repeat_interleave(torch.arange(E_local, device=x.device).repeat(P), recv_counts.flatten())
    order = torch.sort(local_expert, stable=True).indices  # re-routing: group the rows by local expert
    y_sorted = moe.experts(received[order], recv_counts.sum(0))  # [M, H]
    y = torch.empty_like(y_sorted)
    y[order] = y_sorted  # back to arrival order
    returned = all_to_all_v(y, recv, send, group)  # [T_r*k, H] in this rank's expanded order
    out_r = ops.moe_finalize_routing(returned, weights, row_idx, moe.shared_mlp(x_r))  # [T_r, H]
    return all_gather_v(out_r, [len(run) for run in runs], group)
