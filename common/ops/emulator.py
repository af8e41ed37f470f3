"""An emulator of the torch_npu ops that common/ops/npu.py calls, to run the NPU implementations on CPU in tests.

This is emulation against the real schemas, not a run on hardware. Each call is bound to the op's real schema
(npu_schemas.txt, generated from the torch_npu 2.14.0 wheel) with the binding rules of schema.bind (TypeError on
a mismatch), checked against the documented constraints the NPU implementations rely on (ValueError), and then
computed with the pure-PyTorch references, reading the layouts the call asked for (TND, paged block_table,
sparse_mode with pre/next tokens, rotary_mode, group_list_type, ...). Features outside what the repository uses
raise NotImplementedError. Usage:

    emulator = TorchNpuEmulator()
    previous = ops.use_backend("npu", emulator)   # ... ops.* now run npu.py against the emulator
    ops.use_backend(previous)
"""
from __future__ import annotations

from types import SimpleNamespace

import torch

from . import reference as ref
from .reference.moe import SCORE_FUNCS
from .schema import SCHEMA_FILE, bind, load_schemas

INT_MAX = 2147483647
_EMULATED = {}


def emulates(name):
    def register(fn):
        _EMULATED[name] = fn
        return fn

    return register


class TorchNpuEmulator:
    """Stands in for the torch_npu module; `calls` lists the ops run, in order."""

    def __init__(self, schema_file=SCHEMA_FILE):
        self.schemas = load_schemas(schema_file)
        self.calls: list[str] = []

    def __getattr__(self, name):
        if name.startswith("_") or "schemas" not in self.__dict__:
            raise AttributeError(name)
        if name not in self.schemas:
            raise AttributeError(f"torch_npu.{name} is not in npu_schemas.txt (run scripts/npu_schemas.py)")
        if name not in _EMULATED:
            raise AttributeError(f"torch_npu.{name} has a schema but no emulation")

        def op(*args, **kwargs):
            a = SimpleNamespace(**bind(self.schemas[name], args, kwargs))
            self.calls.append(name)
            return _EMULATED[name](a)

        return op


def _check(ok, message):
    """A documented constraint of the op."""
    if not ok:
        raise ValueError(message)


def _covers(ok, what):
    """A feature the emulation leaves out."""
    if not ok:
        raise NotImplementedError(f"the emulation does not cover {what}")


def _rstd(x, eps):
    x32 = x.float()
    return torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)


@emulates("npu_rms_norm")
def _rms_norm(a):
    _check(a.gamma.dtype == a.self.dtype, "npu_rms_norm: gamma must have the input's dtype")
    return ref.rms_norm(a.self, a.gamma, a.epsilon), _rstd(a.self, a.epsilon)


@emulates("npu_add_rms_norm")
def _add_rms_norm(a):
    _check(a.gamma.dtype == a.x1.dtype, "npu_add_rms_norm: gamma must have x1's dtype")
    y, summed = ref.add_rms_norm(a.x1, a.x2, a.gamma, a.epsilon)
    return y, _rstd(summed, a.epsilon), summed


@emulates("npu_rotary_mul")
def _rotary_mul(a):
    x = a.self
    _check(x.dim() == 4 and a.r1.dim() == 4 and a.r1.shape == a.r2.shape, "npu_rotary_mul: 4-D input, cos and sin")
    _check(a.r1.dtype == a.r2.dtype == x.dtype, "npu_rotary_mul: cos / sin must have the input's dtype")
    _check(a.rotary_mode in ("half", "interleave"), f"npu_rotary_mul: rotary_mode {a.rotary_mode!r}")
    _covers(a.rotate is None, "a rotate matrix")
    cos, sin = (r.expand_as(x).reshape(-1, x.shape[-1]) for r in (a.r1, a.r2))  # broadcast, then [rows, D]
    out = ref.rotary_emb(x.reshape(-1, 1, x.shape[-1]), cos, sin, interleaved=a.rotary_mode == "interleave")
    return out.view_as(x)


@emulates("npu_fused_infer_attention_score")
def _fused_infer_attention_score(a):
    _covers(a.input_layout == "TND", f"input_layout {a.input_layout!r}")
    q, kv_heads = a.query, a.num_key_value_heads or a.num_heads
    _check(q.dim() == 3 and q.shape[1] == a.num_heads, "TND query is [T, num_heads, D]")
    _check(a.num_heads % kv_heads == 0, "num_heads must be a multiple of num_key_value_heads")
    _check(a.actual_seq_lengths is not None and a.actual_seq_lengths_kv is not None,
           "TND needs actual_seq_lengths and actual_seq_lengths_kv")
    _check(len(a.actual_seq_lengths) == len(a.actual_seq_lengths_kv), "one kv length per batch")
    ends_q = list(a.actual_seq_lengths)
    _check(ends_q == sorted(ends_q) and ends_q[-1] == q.shape[0], "TND actual_seq_lengths: cumulative, ending at T")
    cu_q = torch.tensor([0] + ends_q, dtype=torch.int32)
    causal, window = _mask(a)
    extras = ("pse_shift", "dequant_scale1", "quant_scale2", "antiquant_scale", "key_antiquant_scale",
              "query_padding_size", "kv_padding_size", "key_shared_prefix", "query_rope")
    _covers(all(getattr(a, name) is None for name in extras), "pse / quantisation / padding / prefix / rope inputs")
    if a.block_table is not None:  # paged: caches (blocknum, blocksize, H) or (blocknum, KV_N, blocksize, D)
        k_cache, v_cache = (_blocks(c, kv_heads) for c in (a.key, a.value))  # [nb, bs, Hkv, D]
        _check(a.block_size == k_cache.shape[1], "block_size must match the caches' block size")
        _check(a.block_table.dim() == 2 and a.block_table.shape[0] == len(ends_q), "block_table is [B, max_blocks]")
        seq_lens = torch.tensor(list(a.actual_seq_lengths_kv), dtype=torch.int32)  # paged: per-sequence lengths
        out, lse = ref.paged_attention(q, k_cache, v_cache, a.block_table, seq_lens, cu_q, a.scale, causal, window,
                                       return_lse=True)
    else:
        ends_k = list(a.actual_seq_lengths_kv)
        _check(a.key.dim() == 3 and a.key.shape[1] == kv_heads, "TND key is [S, num_key_value_heads, D]")
        _check(ends_k == sorted(ends_k) and ends_k[-1] == a.key.shape[0], "TND actual_seq_lengths_kv: cumulative")
        cu_k = torch.tensor([0] + ends_k, dtype=torch.int32)
        out, lse = ref.attention(q, a.key, a.value, cu_q, cu_k, a.scale, causal, window, return_lse=True)
    return out, lse[..., None] if a.softmax_lse_flag else torch.zeros(1)  # TND lse: [T, N, 1]


def _mask(a):
    """(causal, sliding_window) for sparse_mode: 0 no mask, 3 rightDownCausal, 4 band (origin bottom-right)."""
    if a.sparse_mode == 0:
        _covers(a.atten_mask is None, "a full user mask")
        return False, None
    _covers(a.sparse_mode in (3, 4), f"sparse_mode {a.sparse_mode}")
    mask = a.atten_mask
    causal_mask = torch.ones(2048, 2048, dtype=torch.bool).triu(1)
    ok = mask is not None and mask.shape[-2:] == (2048, 2048)
    _check(ok and torch.equal(mask.reshape(2048, 2048).bool().cpu(), causal_mask),
           "sparse_mode 2/3/4 need the compressed 2048 x 2048 mask, True above the diagonal")
    if a.sparse_mode == 3:
        return True, None
    _covers(a.next_tokens in (0, INT_MAX), "band next_tokens other than 0 / unbounded")
    _check(a.pre_tokens >= 0, "band pre_tokens must be >= 0 with next_tokens 0")
    return a.next_tokens == 0, None if a.pre_tokens >= INT_MAX else a.pre_tokens + 1


def _blocks(cache, kv_heads):
    return cache.unflatten(2, (kv_heads, -1)) if cache.dim() == 3 else cache.transpose(1, 2)


@emulates("npu_scatter_nd_update_")
def _scatter_nd_update_(a):
    x, index, updates = a.self, a.indices, a.updates
    depth = index.shape[-1]
    _check(index.dim() >= 2 and depth <= x.dim() and index.dtype in (torch.int32, torch.int64), "indices [..., a], int")
    _check(updates.dtype == x.dtype and updates.shape == index.shape[:-1] + x.shape[depth:], "updates shape / dtype")
    _check(bool(((index >= 0) & (index < torch.tensor(x.shape[:depth]))).all()), "indices must be in range")
    x[tuple(index.long().unbind(-1))] = updates
    return x


@emulates("npu_moe_gating_top_k")
def _moe_gating_top_k(a):
    x, experts = a.x, a.x.shape[-1]
    _check(x.dim() == 2 and (a.bias is None or (a.bias.shape == (experts,) and a.bias.dtype == x.dtype)),
           "x [T, E]; bias [E] in x's dtype")
    _check(a.renorm == 0, "renorm: only 0 (norm, then top-k) is supported")
    _check(a.norm_type in (0, 1), "norm_type: 0 softmax, 1 sigmoid")
    _check((a.input_ids is None) == (a.tid2eid is None), "input_ids and tid2eid come together")
    hashed = a.tid2eid is not None
    _check(not hashed or (a.tid2eid.dim() == 2 and a.tid2eid.shape[1] == a.k and a.input_ids.shape == x.shape[:1]),
           "hash routing: tid2eid [V, k], input_ids [T]")
    _check(experts % a.group_count == 0 and experts // a.group_count > 2, "E divisible into groups of more than 2")
    _check(1 <= a.k_group <= a.group_count and 1 <= a.k <= experts // a.group_count * a.k_group, "k / k_group range")
    _covers(a.group_count == 1 or a.group_select_mode == 1, "group_select_mode 0 (group max)")
    score_func = ("softmax", "sigmoid")[a.norm_type]
    weights, indices = ref.moe_gating_topk(x, a.k, a.bias, score_func, a.group_count, a.k_group, True,
                                           a.routed_scaling_factor, a.eps, a.tid2eid, a.input_ids)
    return weights.to(x.dtype), indices, SCORE_FUNCS[score_func](x.float())


@emulates("npu_moe_init_routing_v2")
def _moe_init_routing_v2(a):
    x, expert_idx = a.x, a.expert_idx
    _check(x.dim() == 2 and expert_idx.dim() == 2 and x.shape[0] == expert_idx.shape[0], "x [T, H], expert_idx [T, K]")
    _check(expert_idx.dtype == torch.int32, "expert_idx must be int32")
    _covers(a.drop_pad_mode == 0 and a.quant_mode == -1 and a.scale is None, "drop / pad or quantised routing")
    _covers(a.expert_tokens_num_type == 1 and a.expert_tokens_num_flag, "token counts other than per expert")
    _covers(list(a.active_expert_range) in ([], [0, a.expert_num]), "a partial active_expert_range")
    _covers(a.row_idx_type == 0 and a.active_num in (-1, 0, expert_idx.numel()), "scatter row_idx / active_num")
    expanded_x, expanded_row_idx, counts = ref.moe_init_routing(x, expert_idx, a.expert_num)
    return expanded_x, expanded_row_idx, counts, torch.zeros(expert_idx.numel())  # expanded_scale: undefined here


@emulates("npu_moe_finalize_routing")
def _moe_finalize_routing(a):
    rows, scales = a.expanded_permuted_rows, a.scales
    _covers(scales is not None and a.bias is None, "scales=None or an expert bias")
    tokens, k = scales.shape
    _check(scales.dtype == rows.dtype, "scales must have expanded_permuted_rows' dtype")
    # The doc's "skip2 None => skip1 None" reads as: skip2 only together with skip1 (aclnn x1 / x2Optional).
    _check(a.skip2 is None or a.skip1 is not None, "skip2 needs skip1")
    skips = [s for s in (a.skip1, a.skip2) if s is not None]
    _check(all(s.dtype == rows.dtype and s.shape == (tokens, rows.shape[1]) for s in skips), "skip shape / dtype")
    _covers(a.drop_pad_mode in (0, 2), "drop / pad modes 1 and 3")
    index = a.expanded_src_to_dst_row  # mode 2: row-major [t*K + j]; mode 0: column-major [j*T + t]
    if a.drop_pad_mode == 0:
        index = index.view(k, tokens).T.reshape(-1)
    return ref.moe_finalize_routing(rows, scales, index, sum(skips) if skips else None)


@emulates("npu_grouped_matmul")
def _grouped_matmul(a):
    _covers(len(a.x) == 1 and len(a.weight) == 1, "lists of several x / weight tensors")
    x, weight, group_list = a.x[0], a.weight[0], a.group_list
    _check(x.dim() == 2 and weight.dim() == 3 and weight.shape[1] == x.shape[1], "x [M, K], weight [E, K, N]")
    _check(a.split_item in (2, 3) and a.group_type == 0, "one output grouped on M: split_item 2 / 3, group_type 0")
    _check(isinstance(group_list, torch.Tensor) and group_list.dtype == torch.int64 and len(group_list) == len(weight),
           "group_list: int64 tensor, one entry per weight")
    _check(a.group_list_type in (0, 1), "group_list_type: 0 cumsum, 1 counts")
    counts = group_list if a.group_list_type == 1 else torch.diff(group_list, prepend=group_list.new_zeros(1))
    _check(int(counts.sum()) == x.shape[0] and bool((counts >= 0).all()), "group_list must cover the rows of x")
    quant = ("bias", "scale", "offset", "antiquant_scale", "per_token_scale", "activation_input")
    _covers(all(getattr(a, n) is None for n in quant) and not a.act_type, "bias, quantisation or a fused activation")
    return [ref.grouped_matmul(x, weight.transpose(1, 2), counts)]


@emulates("npu_swiglu")
def _swiglu(a):
    _check(a.self.shape[a.dim] % 2 == 0, "npu_swiglu: the split dim must be even")
    return ref.swiglu(a.self.movedim(a.dim, -1)).movedim(-1, a.dim)


# ---------------------------------------------------------------- quantized (W8A8)

_HALF = (torch.float16, torch.bfloat16)


@emulates("npu_dynamic_quant")
def _dynamic_quant(a):
    x = a.input
    _check(x.dtype in _HALF and x.dim() > 1, "npu_dynamic_quant: x fp16 / bf16 with more than one dim")
    _covers(a.smooth_scales is None and a.group_index is None, "smooth_scales / group_index (MoE smoothing)")
    _covers(a.dst_type in (None, torch.int8, 1) and a.quant_mode == "pertoken" and a.dst_type_max == 0.0,
            "dst_type other than int8, quant_mode other than pertoken, dst_type_max")
    return ref.dynamic_quant(x)  # scale = rowMax(|x|) / 127, y = round(x / scale): the reference's formula


# npu_quant_matmul (A2 / A3 table): with pertoken_scale, x1 / x2 int8, scale fp32 or bf16 -> bf16 output, scale
# fp32 -> fp16 output; bias int32 / bf16 / fp32 (bf16 out) or int32 / fp16 / fp32 (fp16 out).
_QMM_BIAS = {torch.bfloat16: (torch.bfloat16, torch.float32), torch.float16: (torch.float16, torch.float32)}


@emulates("npu_quant_matmul")
def _quant_matmul(a):
    x1, x2, scale, pertoken, bias = a.x1, a.x2, a.scale, a.pertoken_scale, a.bias
    _check(x1.dtype == torch.int8 and x2.dtype == torch.int8, "npu_quant_matmul: x1 and x2 int8 (int32 = int4)")
    _check(2 <= x1.dim() <= 6 and 2 <= x2.dim() <= 6, "x1 / x2: 2 to 6 dims")
    _covers(x1.dim() == 2 and x2.dim() == 2, "batched x1 / x2")
    m, k = x1.shape
    _check(x2.shape[0] == k, "x2 is (k, n): pass the [n, k] weight transposed")
    n = x2.shape[1]
    _check(x1.numel() > 0 and x2.numel() > 0 and scale.numel() > 0, "x1, x2 and scale must not be empty")
    _check(k <= 65535 and n <= 65535, "the last dims of x1 and x2 must not exceed 65535")
    _check(scale.dim() == 1 and scale.shape[0] in (1, n), "scale is 1-D (1,) or (n,)")
    _covers(scale.dtype in (torch.float32, torch.bfloat16), "an int64 scale (npu_trans_quant_param)")
    _covers(pertoken is not None, "outputs without pertoken_scale (int8, or an int64 scale)")
    _covers(a.offset is None and a.y_scale is None and a.group_sizes is None, "offset, y_scale, group_sizes")
    _covers(all(getattr(a, f) is None for f in ("x1_dtype", "x2_dtype", "pertoken_scale_dtype", "scale_dtype")),
            "the *_dtype overrides")
    _check(pertoken.dtype == torch.float32 and pertoken.shape == (m,), "pertoken_scale: fp32 (m,)")
    _check(a.output_dtype in _QMM_BIAS, "with pertoken_scale the output is bf16 or fp16")
    _check(a.output_dtype == torch.bfloat16 or scale.dtype == torch.float32, "fp16 output takes an fp32 scale")
    if bias is not None:
        _check(bias.shape in ((n,), (1, n)), "bias (n,) or (1, n) for a 2-D output")
        _covers(bias.dtype != torch.int32, "an int32 bias (added to the int32 sums)")
        _check(bias.dtype in _QMM_BIAS[a.output_dtype], f"bias dtype {bias.dtype} with output {a.output_dtype}")
        bias = bias.reshape(n)
    acc = ref.quant.int8_matmul(x1, x2.T)  # y = (x1 @ x2) * scale * pertoken_scale + bias
    return ref.quant.dequant(acc, scale.float().expand(n), pertoken, bias, a.output_dtype)


_grouped_matmul_float = _EMULATED["npu_grouped_matmul"]


@emulates("npu_grouped_matmul")
def _grouped_matmul_quant(a):
    """npu_grouped_matmul with per-token quantisation (formula 3); everything else goes to _grouped_matmul."""
    if a.scale is None and a.per_token_scale is None:
        return _grouped_matmul_float(a)
    _covers(len(a.x) == 1 and len(a.weight) == 1, "lists of several x / weight tensors")
    x, weight, group_list = a.x[0], a.weight[0], a.group_list
    _check(x.dtype == torch.int8 and weight.dtype == torch.int8, "per-token quantisation: int8 x and weight")
    _check(x.dim() == 2 and weight.dim() == 3 and weight.shape[1] == x.shape[1], "x [M, K], weight [E, K, N]")
    experts, k, n = weight.shape
    _check(k < 65536 and n < 65536, "inner dims below InnerLimit 65536")
    _check(a.split_item in (2, 3) and a.group_type == 0, "one output grouped on M: split_item 2 / 3, group_type 0")
    _check(isinstance(group_list, torch.Tensor) and group_list.dtype == torch.int64 and len(group_list) == experts
           and experts <= 1024, "group_list: int64 tensor, one entry per expert, at most 1024")
    _check(a.group_list_type in (0, 1), "group_list_type: 0 cumsum, 1 counts")
    _check(a.group_list_type == 0 or experts != 1, "counts (group_list_type 1) may not have length 1")
    counts = group_list if a.group_list_type == 1 else torch.diff(group_list, prepend=group_list.new_zeros(1))
    _check(int(counts.sum()) == x.shape[0] and bool((counts >= 0).all()), "group_list must cover the rows of x")
    _check(a.scale is not None and a.per_token_scale is not None and len(a.scale) == len(a.per_token_scale) == 1,
           "per-token quantisation: one scale and one per_token_scale tensor")
    scale, pertoken = a.scale[0], a.per_token_scale[0]
    _check(scale.shape == (experts, n), "scale [E, N] for one 3-D weight")
    _check(pertoken.dtype == torch.float32 and pertoken.shape == (x.shape[0],), "per_token_scale: fp32 [M]")
    pairs = {torch.bfloat16: torch.bfloat16, torch.float32: torch.float16}  # per-token table: scale -> output
    _check(pairs.get(scale.dtype) == a.output_dtype, "per-token: scale bf16 -> bf16 output, scale fp32 -> fp16")
    others = ("bias", "offset", "antiquant_scale", "antiquant_offset", "activation_input", "activation_quant_scale",
              "activation_quant_offset", "x_dtype", "weight_dtype", "scale_dtype", "per_token_scale_dtype")
    unused = all(getattr(a, f, None) is None for f in others) and not a.act_type  # (the List overload lacks *_dtype)
    _covers(unused, "bias, offsets, dtype overrides, activation")
    return [ref.quant.grouped_w8a8(x, pertoken, weight.transpose(1, 2), scale.float(), counts, a.output_dtype)]
