"""NPU implementations: each op calls the real torch_npu op with its real signature (see npu_schemas.txt).

`torch_npu` below is the torch_npu module on an Ascend host, or whatever common.ops.use_backend("npu", module)
was given (tests give emulator.TorchNpuEmulator, which checks each call against the schemas and computes the
documented semantics on CPU). Where an op lacks a feature the implementation composes it (sinks from the
softmax LSE) or falls back to the reference, with a comment saying why.
"""
from __future__ import annotations

import functools

import torch

from common import backend

from . import reference
from .reference import apply_attention_sinks, merge_attention_states  # noqa: F401 - re-exported: elementwise LSE math, no fused op needed

torch_npu = backend.torch_npu()
INT_MAX = 2147483647


def rms_norm(x, weight, eps):
    return torch_npu.npu_rms_norm(x, _gamma(x, weight), epsilon=eps)[0]


def add_rms_norm(x, residual, weight, eps):
    normed, _, summed = torch_npu.npu_add_rms_norm(x, residual, _gamma(x, weight), epsilon=eps)
    return normed, summed


def _gamma(x, weight):
    # The ops take gamma in x's dtype (torch_npu 2.14 docs): an fp32 weight is rounded to x.dtype first.
    return x.new_ones(x.shape[-1]) if weight is None else weight.to(x.dtype)


def rotary_emb(x, cos, sin, interleaved):
    # x [T, H, R] read as BSND [1, T, H, R]; cos / sin as 1S1D [1, T, 1, R], the layout both modes accept.
    cos, sin = cos.to(x.dtype)[None, :, None], sin.to(x.dtype)[None, :, None]
    mode = "interleave" if interleaved else "half"
    return torch_npu.npu_rotary_mul(x[None], cos, sin, rotary_mode=mode)[0]


@functools.cache
def _causal_mask(device) -> torch.Tensor:
    """The compressed 2048 x 2048 mask (True = masked) the op wants for sparse_mode 2 / 3 / 4."""
    return torch.ones(2048, 2048, dtype=torch.bool, device=device).triu(1)


def _mask(causal, sliding_window, device):
    """(atten_mask, sparse_mode, pre_tokens, next_tokens) for npu_fused_infer_attention_score.

    sparse_mode 3 (rightDownCausal) and 4 (band) align the diagonal bottom-right, as our queries are the last q_len
    positions of their kv. Band keeps keys with -pre_tokens <= j - pos <= next_tokens: a window of W keys that
    includes the query itself is pre_tokens = W - 1.
    """
    if sliding_window is not None:
        return _causal_mask(device), 4, sliding_window - 1, 0 if causal else INT_MAX
    if causal:
        return _causal_mask(device), 3, INT_MAX, INT_MAX
    return None, 0, INT_MAX, INT_MAX


def _fused_attention(q, k, v, kv_lengths, num_kv_heads, cu_seqlens_q, scale, causal, sliding_window, sinks,
                     return_lse, block_table=None, block_size=0):
    atten_mask, sparse_mode, pre_tokens, next_tokens = _mask(causal, sliding_window, q.device)
    out, lse = torch_npu.npu_fused_infer_attention_score(
        q, k, v,
        atten_mask=atten_mask,
        actual_seq_lengths=cu_seqlens_q[1:].tolist(),  # TND: cumulative query ends (host list)
        actual_seq_lengths_kv=kv_lengths,
        block_table=block_table,
        num_heads=q.shape[1],
        scale=scale,
        pre_tokens=pre_tokens,
        next_tokens=next_tokens,
        input_layout="TND",
        num_key_value_heads=num_kv_heads,
        sparse_mode=sparse_mode,
        block_size=block_size,
        softmax_lse_flag=return_lse or sinks is not None,
    )
    # The op has no sinks: it returns the LSE (TND: [T, Hq, 1]) and the sink joins the denominator afterwards.
    lse = lse.squeeze(-1)  # [T, Hq]
    if sinks is not None:
        out = apply_attention_sinks(out, lse, sinks)
    return (out, lse) if return_lse else out


def attention(
    q, k, v, cu_seqlens_q, cu_seqlens_k, scale, causal=True, sliding_window=None, sinks=None, return_lse=False
):
    # q [T, Hq, D], k [S, Hkv, D], v [S, Hkv, Dv] as TND; kv lengths: cumulative ends, like the queries'.
    kv_ends = cu_seqlens_k[1:].tolist()
    return _fused_attention(
        q, k, v, kv_ends, k.shape[1], cu_seqlens_q, scale, causal, sliding_window, sinks, return_lse
    )


def paged_attention(
    q, k_cache, v_cache, block_tables, seq_lens, cu_seqlens_q, scale,
    causal=True, sliding_window=None, sinks=None, return_lse=False, max_seqlen_q=None, max_seqlen_k=None,
):
    # Caches read as (blocknum, blocksize, Hkv * D), a view; paged kv lengths are per sequence, not cumulative.
    # The fused kernel takes the lengths themselves (host lists): the padded widths max_seqlen_* fix are not needed.
    v_cache = k_cache if v_cache is None else v_cache
    num_blocks, block_size, num_kv_heads, _ = k_cache.shape
    return _fused_attention(
        q, k_cache.flatten(2), v_cache.flatten(2), seq_lens.tolist(), num_kv_heads, cu_seqlens_q, scale, causal,
        sliding_window, sinks, return_lse, block_table=block_tables, block_size=block_size,
    )


def reshape_and_cache(k, v, k_cache, v_cache, slot_mapping):
    # every slot is a cache row (padding writes to the null block), so no host sync drops any first
    slots = slot_mapping.long().view(-1, 1)  # [T, 1] rows of cache.view(-1, Hkv, D)
    torch_npu.npu_scatter_nd_update_(k_cache.view(-1, *k_cache.shape[2:]), slots, k)
    if v is not None:
        torch_npu.npu_scatter_nd_update_(v_cache.view(-1, *v_cache.shape[2:]), slots, v)


# npu_sparse_flash_attention: its 2.14 docs cover the MLA use only (query_rope / key_rope, attention_mode) and
# document neither its shape constraints nor the softmax_max / softmax_sum outputs return_lse would need, so
# sparse attention runs the reference (plain torch ops, which run on NPU too).
sparse_attention = reference.sparse_attention

# npu_lightning_indexer masks keys with sparse_mode 0 (none) / 3 (causal over key positions), which cannot say
# "the first visible[t] compressed entries" per query, and its docs give neither the meaning of the returned
# indices (per sequence or global) nor a tie-break: the deterministic reference (lower index wins) runs instead.
lightning_indexer = reference.lightning_indexer

# HSTU attention (SiLU(alpha q k^T) / max_seq_len, no softmax, candidate mask over jagged sequences): torch_npu
# 2.14.0 has no such op (its npu_native_functions_by_codegen.yaml names no hstu / jagged op) and
# npu_fused_infer_attention_score always applies a softmax, so the reference (plain torch ops) runs on NPU too.
hstu_attention = reference.hstu_attention

# Kimi Delta Attention (Ling-3.0-Flash) and its short causal conv: torch_npu 2.14.0's gated-delta-rule and causal
# conv ops do not fit as documented (npu_recurrent_gated_delta_rule: gk, KDA's per-channel decay, "not supported in
# the current version", state bf16 only; npu_chunk_gated_delta_rule: one decay per head; npu_fused_causal_conv1d:
# Ascend 950 only, kernel width 3, Ling's is 4; see ops/README.md). Upstream Ascend runs PyPTO kernels
# (`chunk_kda_wrapper`, `fused_recurrent_kda`), which are not torch_npu ops (and take the state as [..., V, K]), so
# the references (plain torch ops, state [S, H, K, V] fp32) run on NPU too.
causal_conv1d = reference.causal_conv1d
causal_conv1d_update = reference.causal_conv1d_update
chunk_kda = reference.chunk_kda
recurrent_kda = reference.recurrent_kda

_NORM_TYPE = {"softmax": 0, "sigmoid": 1}  # npu_moe_gating_top_k norm_type


def moe_gating_topk(
    logits, k, bias=None, score_func="softmax", group_count=1, k_group=1, renorm=True,
    routed_scaling_factor=1.0, eps=1e-20, tid2eid=None, input_ids=None,
):
    if score_func not in _NORM_TYPE or not renorm:
        # The op knows softmax / sigmoid only (no sqrtsoftplus in the 2.14 docs) and always renormalises the
        # picked weights; anything else (DeepSeek-V4 sqrtsoftplus, its hash layers included) runs the reference.
        return reference.moe_gating_topk(
            logits, k, bias, score_func, group_count, k_group, renorm, routed_scaling_factor, eps, tid2eid, input_ids
        )
    weights, indices, _ = torch_npu.npu_moe_gating_top_k(
        logits.float(),  # fp32 in, fp32 weights out
        k,
        bias=None if bias is None else bias.float(),  # selection only
        input_ids=input_ids,  # hash routing when both are given
        tid2eid=tid2eid,
        k_group=k_group,
        group_count=group_count,
        group_select_mode=1,  # group score = sum of its top-2 (DeepSeek-V3)
        renorm=0,  # 0 = norm, then top-k: the only documented value
        norm_type=_NORM_TYPE[score_func],
        routed_scaling_factor=routed_scaling_factor,
        eps=eps,
    )
    return weights, indices


def moe_init_routing(x, indices, num_experts):
    expanded_x, expanded_row_idx, tokens_per_expert, _ = torch_npu.npu_moe_init_routing_v2(
        x,
        indices.int(),
        expert_num=num_experts,
        expert_tokens_num_type=1,  # per-expert counts
        expert_tokens_num_flag=True,
        active_expert_range=[0, num_experts],
        quant_mode=-1,  # no quantisation
        row_idx_type=0,  # expanded_row_idx[t*k + j] = destination row (the reference's convention)
    )
    return expanded_x, expanded_row_idx, tokens_per_expert


def moe_finalize_routing(expert_out, weights, expanded_row_idx, shared=None):
    out = torch_npu.npu_moe_finalize_routing(
        expert_out.float(),  # summed in fp32 like the reference: the op wants scales in the rows' dtype
        skip1=None if shared is None else shared.float(),
        skip2=None,
        bias=None,
        scales=weights.float(),
        expanded_src_to_dst_row=expanded_row_idx,
        export_for_source_row=None,
        drop_pad_mode=2,  # dropless, index read row-major [t*k + j] as init_routing_v2 writes it (as vllm-ascend)
    )
    return out.to(expert_out.dtype)


def grouped_matmul(x, weight, tokens_per_expert):
    return torch_npu.npu_grouped_matmul(
        [x],  # [M, K]
        [weight.transpose(1, 2)],  # the op computes x_e @ w_e with w_e [K, N]: a transposed view of [E, N, K]
        group_list=tokens_per_expert.long(),
        split_item=2,  # one output tensor [M, N]
        group_type=0,  # groups split M
        group_list_type=1,  # group_list holds counts, not cumsums
    )[0]


def swiglu(x, limit=None):
    if limit is not None:
        # npu_clipped_swiglu is the gpt-oss variant (alpha 1.702, up + 1), not this clamp: clamp, then the plain op.
        gate, up = x.chunk(2, dim=-1)
        x = torch.cat((gate.clamp(max=limit), up.clamp(-limit, limit)), dim=-1)
    return torch_npu.npu_swiglu(x, dim=-1)


# ---------------------------------------------------------------- quantized (W8A8 / W4A8)

_NPU_QUANT_DTYPES = (torch.float16, torch.bfloat16)  # what npu_dynamic_quant takes and npu_quant_matmul can output


def dynamic_quant(x):
    if x.dtype not in _NPU_QUANT_DTYPES or x.numel() == 0:
        # npu_dynamic_quant takes fp16 / bf16 only; empty inputs need no kernel. The reference is plain torch ops.
        return reference.dynamic_quant(x)
    if x.dim() == 1:  # the op wants more than one dim
        x_q, scale = torch_npu.npu_dynamic_quant(x[None])
        return x_q[0], scale[0]
    # scale = rowMax(|x|) / 127, y = round(x / scale) (2.14 docs); input passed positionally: the schema names it
    # `input`, which torch_npu's bindings (and schema.bind) read as `self`.
    return torch_npu.npu_dynamic_quant(x)


def quant_linear(x, weight, weight_scale, bias=None):
    if x.dtype not in _NPU_QUANT_DTYPES or x.numel() == 0:
        # npu_quant_matmul outputs int8 / fp16 / bf16 / int32 only and takes no empty x1: fp32 or empty x runs the
        # reference (its int32 sums are exact fp32 sums off CPU).
        return reference.quant_linear(x, weight, weight_scale, bias)
    x_q, x_scale = torch_npu.npu_dynamic_quant(x.reshape(-1, x.shape[-1]))  # [M, K] int8, [M] fp32
    out = torch_npu.npu_quant_matmul(
        x_q,
        weight.t(),  # x2 is (k, n): the transposed view of the [N, K] weight, as the docs' bf16 example passes
        weight_scale.float(),  # (n,) fp32: allowed with pertoken_scale for bf16 and fp16 outputs
        pertoken_scale=x_scale,  # (m,) fp32
        bias=None if bias is None else bias.float(),  # fp32 bias: allowed for both output dtypes
        output_dtype=x.dtype,
    )
    return out.view(*x.shape[:-1], weight.shape[0])


def grouped_quant_matmul(x, weight, weight_scale, tokens_per_expert, group_size=None):
    if group_size or x.dtype not in _NPU_QUANT_DTYPES or x.shape[0] == 0:
        # W4A8 per group: the 2.14 docs give npu_grouped_matmul int4 weights only for weight-only (antiquant)
        # quantisation, with fp16 / bf16 x and antiquant_scale [g, G, n]; per-token int8 x (per_token_scale) is
        # documented for int8 weights only, and npu_convert_weight_to_int4pack is documented with
        # npu_weight_quant_batchmatmul (weight-only) alone. Int8 activations times per-group int4 weights do not
        # fit the documented op, so the reference runs (plain torch ops: exact fp32 group sums on NPU too).
        # fp32 x has no per-token output dtype; empty x needs no kernel.
        return reference.grouped_quant_matmul(x, weight, weight_scale, tokens_per_expert, group_size)
    x_q, x_scale = torch_npu.npu_dynamic_quant(x)  # [M, K] int8, [M] fp32
    # The per-token table pairs scale bf16 with bf16 output and scale fp32 with fp16 output: a bf16 model's scales
    # are rounded to bf16 here (relative 2^-9), as vllm-ascend passes them.
    scale = weight_scale.to(torch.bfloat16 if x.dtype == torch.bfloat16 else torch.float32)
    return torch_npu.npu_grouped_matmul(
        [x_q],
        [weight.transpose(1, 2)],  # [E, K, N] view of [E, N, K]
        scale=[scale],  # [E, N] for the one 3-D weight (the per-group layout antiquant_scale documents as [g, n])
        per_token_scale=[x_scale],  # [M] fp32
        group_list=tokens_per_expert.long().cumsum(0),  # cumsums: counts may not have length 1 (one expert)
        split_item=2,  # one output tensor [M, N]
        group_type=0,  # groups split M
        group_list_type=0,  # cumsum
        output_dtype=x.dtype,
    )[0]
