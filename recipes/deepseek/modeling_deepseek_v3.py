"""DeepSeek-V3 / R1, DeepSeek-V3.2 and Kimi-K2 (multi-head latent attention) on common.ops, over packed inputs.

Per layer: RMSNorm -> MLA -> residual -> RMSNorm -> dense SwiGLU MLP (the first first_k_dense_replace layers) or
MoE (sigmoid router, group-limited top-k, shared experts) -> residual. Parameter names are the HF checkpoint's
(`model.layers.N.self_attn.kv_a_proj_with_mqa`, `model.layers.N.mlp.experts`, `lm_head`); routed experts are
stacked into `gate_up_proj` [E, 2I, D] / `down_proj` [E, D, I] (transformers' layout) and each dense or shared
MLP's gate / up projections pack into one `gate_up_proj`. T = tokens of all sequences in the batch, D = hidden
size, H = heads, R = kv_lora_rank, Dr = qk_rope_head_dim, S = cached tokens of the batch's sequences.

MLA cache (one "latent" group, one row per token): the normalised latent c_kv [R] and the rotated shared rope key
[Dr], R + Dr values per token per layer (V3.2 adds its indexer key, index_head_dim values, in the same group).
Two ways to attend over it, equal in exact arithmetic:
- absorbed (decode steps): kv_b_proj's key half W_UK folds into the query (q_nope W_UK . c_kv + q_rope . k_rope),
  attention runs as one-KV-head MQA straight over the cached rows, and its value half W_UV maps the latent
  output back per head: no per-head K / V is materialised;
- expanded (prefill): the cached latents are expanded by kv_b_proj into per-head k_nope / v once, and ordinary
  attention runs over them (cheaper when many queries share the keys).
V3.2: a lightning indexer picks each query's top index_topk keys of its own sequence (sum_h w_h relu(q_h . k),
ops.lightning_indexer), and attention reads only those (ops.sparse_attention): absorbed, straight from the cache
rows by slot; expanded, from the gathered rows.

Parallel (common.parallel.LLMParallelLayout): attention TP splits the query heads over `attn_tp` (q_b_proj /
q_proj and kv_b_proj by rows, o_proj by columns, its output summed over the group); the low-rank projections, the
latent cache and V3.2's indexer are replicated (every TP rank holds every token's latent); routed experts are
sharded over `moe_ep` (tokens dispatched to the ranks owning their experts and combined back; under attention TP
each TP rank routes its share of the tokens); router, shared experts and dense MLPs replicated; embedding and LM
head vocabulary parallel over `embed_tp` / `lmhead_tp`. A sliced parameter carries `.shard`, which the loader reads.

Multi-token prediction (`mtp=True`): the publisher's `model.layers.{num_hidden_layers + i}` (`self.mtp[i]`), fed
eh_proj([enorm(embedding of the next token); hnorm(hidden)]) where hidden is the main model's final normed hidden
state (or the previous draft's output), then a full decoder layer; shared_head.norm and the main LM head give its
logits. Its latent rows live in the same cache group as the main layers'.

fp16 (Atlas 300I Duo / 310P: no bf16): weights, GEMMs, the latent cache and the collectives in fp16; kept in fp32:
the residual stream (residual_dtype), RMSNorm's statistics, the router's logits / sigmoid / top-k and the MoE
combine (ops.moe_finalize_routing), the attention softmax (the ops' references and NPU kernels), the logits.
W8A8 (a checkpoint convert_checkpoint.py wrote): every linear but kv_b_proj (and V3.2's indexer) is a QuantLinear
(int8 [N, K] + fp32 scale [N], ops.quant_linear) and the routed experts int8 (ops.grouped_quant_matmul);
activations quantized per token at run time.

Graph mode: a decode step (every sequence the same few new tokens) reads no tensor on the host: the absorbed
paged attention and the indexer pad their keys to the batch's `max_seqlen_k`.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from common import cpu_moe, ops
from common import parallel as par
from common.custom_op import direct_register_custom_op
from common.engine.forward_batch import ForwardBatch
from common.engine.model_contract import ModelContract
from common.kv_cache import CacheGroupSpec, CacheTensorSpec, check_cache_tensors
from config_deepseek_v3 import ModelArgs

LATENT = "latent"  # the one cache group: per token the latent, the rope key (and V3.2's indexer key)
LATENT_NORM_EPS = 1e-6  # q_a_layernorm / kv_a_layernorm: the publisher's RMSNorm default, not rms_norm_eps
INDEX_NORM_EPS = 1e-6
ABSORB_MAX_QUERIES = 8  # steps whose sequences have at most this many new tokens attend absorbed (decode, drafts)


def yarn_inv_freq(args: ModelArgs) -> torch.Tensor:
    """Inverse frequencies [Dr/2] of the rope channels; YaRN-blended (truncated correction range) when configured."""
    dim, theta = args.qk_rope_head_dim, args.rope_theta
    inv = 1.0 / theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)  # [Dr/2]
    y = args.rope_scaling
    if not y:
        return inv
    factor, orig = args.yarn_factor, y["original_max_position_embeddings"]
    fast, slow = y.get("beta_fast") or 32, y.get("beta_slow") or 1

    def corr_dim(rotations):
        return dim * math.log(orig / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = corr_dim(fast), corr_dim(slow)
    if y.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)  # 1: interpolate
    return inv / factor * ramp + inv * (1 - ramp)


class Rope(nn.Module):
    """RoPE tables of the rope channels, scaled by YaRN's attention factor (as cos / sin are, upstream)."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.scale = args.rope_attention_factor
        self.register_buffer("inv_freq", yarn_inv_freq(args), persistent=False)

    def tables(self, positions: torch.Tensor) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """positions [T] -> {"interleaved": (cos, sin), "half": (cos, sin)}, each [T, Dr]."""
        freqs = positions.float()[:, None] * self.inv_freq  # [T, Dr/2]
        out = {}
        for mode, full in (("interleaved", freqs.repeat_interleave(2, -1)), ("half", torch.cat([freqs, freqs], -1))):
            out[mode] = (full.cos() * self.scale, full.sin() * self.scale)  # [T, Dr] each
        return out


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        return ops.rms_norm(x, self.weight, self.eps)


def residual_dtype(dtype: torch.dtype) -> torch.dtype:
    """The residual stream's dtype for a compute dtype: fp32 under fp16 (the sum of every layer's output outgrows
    fp16's 65504 on real checkpoints, see fp16_ranges.py), else the compute dtype itself."""
    return torch.float32 if dtype == torch.float16 else dtype


class QuantLinear(nn.Module):
    """W8A8 linear: int8 weight [N, K] with an fp32 scale per output channel, as convert_checkpoint.py stores them;
    activations quantized per token at run time (ops.quant_linear). Output in the input's dtype."""

    def __init__(self, in_features: int, out_features: int):
        super().__init__()
        self.register_buffer("weight", torch.zeros(out_features, in_features, dtype=torch.int8))
        self.register_buffer("weight_scale", torch.ones(out_features, dtype=torch.float32))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ops.quant_linear(x, self.weight, self.weight_scale)  # [..., N]


def linear(args: ModelArgs, in_features: int, out_features: int) -> nn.Module:
    """A projection convert_checkpoint.py stores in int8 (every linear of a layer but kv_b_proj and V3.2's
    indexer): QuantLinear for a w8a8 checkpoint, else a plain linear."""
    if args.quant_format == "w8a8":
        return QuantLinear(in_features, out_features)
    return nn.Linear(in_features, out_features, bias=False)


def shard_linear(layer: nn.Module, dim: int, parallel: par.Parallel, group: str) -> None:
    """Mark a linear's weight (and an int8 one's per-output-channel scale, when split by rows) as this rank's part."""
    par.shard(layer.weight, dim, parallel, group)
    if isinstance(layer, QuantLinear) and dim == 0:
        par.shard(layer.weight_scale, 0, parallel, group)


class KVBProj(nn.Module):
    """kv_b_proj: the checkpoint's weight [H * (nope + v), R] (per head its nope key rows, then its v value rows),
    held with its rows regrouped at load, every head's key rows first, then every head's value rows:
    [H * nope + H * v, R]. So the absorbed path's halves W_UK [H, nope, R] / W_UV [H, v, R] are contiguous views
    (a strided view is copied by every bmm: 146 against 61 us a call for V3's bench layer, Xeon, bf16), and the
    expansion is still one GEMM. state_dict() gives and load_state_dict() takes the checkpoint's layout
    (state_dict(keep_vars=True): the parameter itself, which loaders match by identity). Never repacked."""

    def __init__(self, args: ModelArgs, heads: int):
        super().__init__()
        self.heads, self.nope, self.v = heads, args.qk_nope_head_dim, args.v_head_dim
        self.weight = nn.Parameter(torch.empty(self.heads * (self.nope + self.v), args.kv_lora_rank))
        self.weight.weight_loader = self._load_regrouped

    def regrouped(self, per_head: torch.Tensor) -> torch.Tensor:
        """The checkpoint's [H * (nope + v), R] -> [H * nope + H * v, R]."""
        keys, values = per_head.view(self.heads, self.nope + self.v, -1).split([self.nope, self.v], dim=1)
        return torch.cat([keys.flatten(0, 1), values.flatten(0, 1)])

    def _load_regrouped(self, param: torch.Tensor, tensor: torch.Tensor, shard_id) -> None:
        """The loader's weight_loader (common.loader): the checkpoint's rows (this rank's heads), regrouped."""
        if tensor.shape != param.shape:
            raise ValueError(f"shape {list(tensor.shape)} does not match {list(param.shape)}")
        param.copy_(self.regrouped(tensor))

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        if keep_vars:
            return super()._save_to_state_dict(destination, prefix, keep_vars)
        keys, values = self.halves()
        destination[prefix + "weight"] = torch.cat([keys, values], dim=1).flatten(0, 1).detach()  # per head again

    def _load_from_state_dict(self, state_dict, prefix, *args):
        if prefix + "weight" in state_dict:
            state_dict = {**state_dict, prefix + "weight": self.regrouped(state_dict[prefix + "weight"])}
        super()._load_from_state_dict(state_dict, prefix, *args)

    def expand(self, latent: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """latent [S, R] -> (k_nope [S, H, nope], v [S, H, v])."""
        S, H = latent.shape[0], self.heads
        k, v = F.linear(latent, self.weight).split([H * self.nope, H * self.v], dim=-1)  # [S, H * nope], [S, H * v]
        return k.view(S, H, self.nope), v.view(S, H, self.v)

    def halves(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(W_UK [H, nope, R], W_UV [H, v, R]), contiguous views of the weight."""
        H, R = self.heads, self.weight.shape[1]
        return self.weight[: H * self.nope].view(H, self.nope, R), self.weight[H * self.nope:].view(H, self.v, R)


def gather_rows(cache: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor):
    """Each sequence's cached rows [0, seq_len), packed in order: ([S, ...], cu_seqlens_k [B+1] int32).
    Reads the total length on the host (prefill steps)."""
    block_size = cache.shape[1]
    cu = F.pad(seq_lens.long().cumsum(0), (1, 0))  # [B+1]
    token = torch.arange(int(cu[-1]), device=cache.device)  # [S]
    seq = torch.searchsorted(cu[1:], token, right=True)  # [S]
    pos = token - cu[seq]
    slots = block_tables[seq, pos // block_size].long() * block_size + pos % block_size  # [S]
    return cache.flatten(0, 1).index_select(0, slots), cu.int()  # index_select: ~3x advanced indexing on CPU


def padded_rows(cache: torch.Tensor, block_tables: torch.Tensor, width: int):
    """Positions [0, width) of every sequence through its block table, sequence b at rows b * width..: ([B * width,
    ...], cu [B+1] int32). No host read (decode steps); rows past a sequence's length are whatever its table
    points at, for the reader to mask."""
    B, block_size = block_tables.shape[0], cache.shape[1]
    pos = torch.arange(width, device=cache.device)  # [W]
    slots = block_tables[:, pos // block_size].long() * block_size + pos % block_size  # [B, W]
    cu = torch.arange(B + 1, dtype=torch.int32, device=cache.device) * width  # [B+1]
    return cache.flatten(0, 1).index_select(0, slots.flatten()), cu


def position_slots(batch: ForwardBatch, pos: torch.Tensor) -> torch.Tensor:
    """pos [T, k] positions in each token's own sequence (-1 = empty) -> the latent cache rows holding them, -1 kept."""
    table = batch.block_tables[LATENT][batch.seq_ids]  # [T, max_blocks]
    p = pos.clamp(min=0).long()
    bs = batch.block_size
    slots = table.gather(1, p // bs).long() * bs + p % bs  # [T, k]
    return torch.where(pos >= 0, slots, -1)


def is_decode_step(batch: ForwardBatch, num_tokens: int) -> bool:
    """Every sequence computes the same few (<= ABSORB_MAX_QUERIES) new tokens: a decode step (or MTP verify); host
    ints only, so a graph-mode step always takes the same path."""
    q = batch.max_seqlen_q
    return 0 < q <= ABSORB_MAX_QUERIES and num_tokens == batch.num_seqs * q


def split_decodes(cu: list[int]) -> tuple[list[int], list[int]] | None:
    """Of a step's sequences (cu: cu_seqlens_q on the host), those with at most ABSORB_MAX_QUERIES new tokens
    (decodes, drafts, short chunks) and the others (prompt chunks), where it has both; else None."""
    q_lens = [end - start for start, end in zip(cu, cu[1:])]
    short = [b for b, n in enumerate(q_lens) if 0 < n <= ABSORB_MAX_QUERIES]
    long = [b for b, n in enumerate(q_lens) if n > ABSORB_MAX_QUERIES]
    return (short, long) if short and long else None


class Indexer(nn.Module):
    """V3.2's lightning indexer: per query, the top index_topk keys of its sequence by sum_h w_h relu(q_h . k).

    q_h = wq_b(the normed low-rank query), k = LayerNorm(wk(x)), both with half-split RoPE on their first Dr
    channels; w = weights_proj(x) / sqrt(heads); scores carry index_head_dim^-0.5 (folded into w: relu is
    positively homogeneous). The keys are cached per token in the latent group. Replicated over attention TP."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.heads, self.dim, self.rope_dim, self.topk = (args.index_n_heads, args.index_head_dim,
                                                          args.qk_rope_head_dim, args.index_topk)
        self.wq_b = nn.Linear(args.q_lora_rank, self.heads * self.dim, bias=False)
        self.wk = nn.Linear(args.hidden_size, self.dim, bias=False)
        self.k_norm = nn.LayerNorm(self.dim, eps=INDEX_NORM_EPS)
        self.weights_proj = nn.Linear(args.hidden_size, self.heads, bias=False)
        self.k_cache = None  # [num_blocks, block_size, 1, index_head_dim]

    def _rope(self, x: torch.Tensor, cos, sin) -> torch.Tensor:
        """x [T, h, Di] -> its first Dr channels rotated (half-split pairs)."""
        pe, rest = x[..., : self.rope_dim], x[..., self.rope_dim :]
        return torch.cat([ops.rotary_emb(pe, cos, sin, interleaved=False), rest], dim=-1)

    def forward(self, x, q_lora, rope, batch: ForwardBatch) -> torch.Tensor:
        """-> positions [T, index_topk] in each query's own sequence of the keys it keeps, -1 = empty. A decode step
        scores max_seqlen_k padded keys per sequence (no host read; a compiled CPU step: the keys the sequences
        hold, through an opaque op that reads the width on the host); others gather the sequences' keys."""
        T = x.shape[0]
        cos, sin = rope["half"]
        q = self._rope(self.wq_b(q_lora).view(T, self.heads, self.dim), cos, sin)  # [T, Hi, Di]
        k = self._rope(self.k_norm(self.wk(x)).view(T, 1, self.dim), cos, sin)  # [T, 1, Di]
        ops.reshape_and_cache(k, None, self.k_cache, None, batch.slot_mapping[LATENT])
        w = self.weights_proj(x).float() * (self.heads ** -0.5 * self.dim ** -0.5)  # [T, Hi]
        if is_decode_step(batch, T):
            args = (q, w, self.k_cache, batch.block_tables[LATENT], batch.cu_seqlens_q, batch.positions,
                    batch.seq_ids, self.topk, batch.max_seqlen_q)
            if q.device.type == "cpu" and torch.compiler.is_compiling():  # not max_model_len padded keys
                return torch.ops.npu_cookbook.deepseek_v32_decode_top_keys(*args, batch.seq_lens)
            return decode_top_keys(*args, batch.max_seqlen_k)
        keys, cu_k = gather_rows(self.k_cache, batch.block_tables[LATENT], batch.seq_lens)  # [S, 1, Di]
        return top_key_positions(q, w, keys, cu_k, batch.cu_seqlens_q, batch.positions, batch.seq_ids, self.topk,
                                 batch.max_seqlen_q, batch.max_seqlen_k)


def top_key_positions(q: torch.Tensor, w: torch.Tensor, keys: torch.Tensor, cu_k: torch.Tensor,
                      cu_seqlens_q: torch.Tensor, positions: torch.Tensor, seq_ids: torch.Tensor, topk: int,
                      max_seqlen_q: int, max_seqlen_k: int) -> torch.Tensor:
    """The lightning indexer's top-k over the sequences' index keys [S, 1, Di] (sequence b's at rows cu_k[b]..), as
    positions [T, topk] in each query's own sequence, -1 = empty."""
    idx = ops.lightning_indexer(q, keys[:, 0], w, cu_seqlens_q, cu_k, positions + 1, topk, max_seqlen_q=max_seqlen_q,
                                max_seqlen_k=max_seqlen_k)  # [T, k]
    start = cu_k[:-1].long()[seq_ids]  # [T] first row of each query's sequence
    return torch.where(idx >= 0, idx - start[:, None], -1)  # [T, k]


def decode_top_keys(q: torch.Tensor, w: torch.Tensor, k_cache: torch.Tensor, table: torch.Tensor,
                    cu_seqlens_q: torch.Tensor, positions: torch.Tensor, seq_ids: torch.Tensor, topk: int,
                    max_seqlen_q: int, width: int) -> torch.Tensor:
    """V3.2's indexer on a decode step: every sequence's index keys at positions [0, width) scored by its queries
    q [T, Hi, Di] with head weights w [T, Hi] -> positions [T, topk] in each query's own sequence, -1 = empty."""
    keys, cu_k = padded_rows(k_cache, table, width)  # [B * W, 1, Di]
    return top_key_positions(q, w, keys, cu_k, cu_seqlens_q, positions, seq_ids, topk, max_seqlen_q, width)


def _decode_top_keys_op(q: torch.Tensor, w: torch.Tensor, k_cache: torch.Tensor, table: torch.Tensor,
                        cu_seqlens_q: torch.Tensor, positions: torch.Tensor, seq_ids: torch.Tensor, topk: int,
                        max_seqlen_q: int, seq_lens: torch.Tensor) -> torch.Tensor:
    """decode_top_keys as one opaque op of a compiled CPU graph: inside it the width is the step's longest sequence,
    read on the host (no device sync on CPU), not the bucket's max_model_len (as paged decode attention)."""
    return decode_top_keys(q, w, k_cache, table, cu_seqlens_q, positions, seq_ids, topk, max_seqlen_q,
                           int(seq_lens.max()))


def _decode_top_keys_fake(q, w, k_cache, table, cu_seqlens_q, positions, seq_ids, topk, *_):
    return q.new_empty(q.shape[0], topk, dtype=torch.int64)


if not hasattr(torch.ops.npu_cookbook, "deepseek_v32_decode_top_keys"):  # (this file imported under two names)
    direct_register_custom_op("deepseek_v32_decode_top_keys", _decode_top_keys_op, _decode_top_keys_fake)


class MLAttention(nn.Module):
    """Multi-head latent attention over this rank's heads; `mode` "auto" (absorbed for decode steps; in a step with
    prompt chunks, the chunks expanded and its decodes absorbed), "absorbed" or "expanded"."""

    def __init__(self, args: ModelArgs, parallel: par.Parallel):
        super().__init__()
        a = args
        self.tp_group = parallel.group("attn_tp")
        H = self.heads = a.num_attention_heads // parallel.size("attn_tp")
        self.rank, self.rope_dim = a.kv_lora_rank, a.qk_rope_head_dim
        self.nope, self.v_dim = a.qk_nope_head_dim, a.v_head_dim
        self.scale = a.softmax_scale
        if a.q_lora_rank is None:
            self.q_proj = linear(a, a.hidden_size, H * a.qk_head_dim)
            q_out = self.q_proj
        else:
            self.q_a_proj = linear(a, a.hidden_size, a.q_lora_rank)
            self.q_a_layernorm = RMSNorm(a.q_lora_rank, LATENT_NORM_EPS)
            self.q_b_proj = linear(a, a.q_lora_rank, H * a.qk_head_dim)
            q_out = self.q_b_proj
        self.kv_a_proj_with_mqa = linear(a, a.hidden_size, a.kv_lora_rank + a.qk_rope_head_dim)
        self.kv_a_layernorm = RMSNorm(a.kv_lora_rank, LATENT_NORM_EPS)
        self.kv_b_proj = KVBProj(a, H)
        self.o_proj = linear(a, H * a.v_head_dim, a.hidden_size)
        shard_linear(q_out, 0, parallel, "attn_tp")  # this rank's heads
        shard_linear(self.kv_b_proj, 0, parallel, "attn_tp")
        shard_linear(self.o_proj, 1, parallel, "attn_tp")
        self.indexer = Indexer(a) if a.sparse else None
        self.kv_cache = None  # [num_blocks, block_size, 1, R + Dr]
        self.mode = "auto"

    def forward(self, x: torch.Tensor, rope, batch: ForwardBatch) -> torch.Tensor:
        """x [T, D] -> [T, D] (summed over the heads of every attention-TP rank)"""
        T, H = x.shape[0], self.heads
        if T == 0:  # an idle data-parallel rank (its TP peers idle too): nothing to attend, nothing to reduce
            return x
        q_lora = None
        if hasattr(self, "q_proj"):
            q = self.q_proj(x)
        else:
            q_lora = self.q_a_layernorm(self.q_a_proj(x))  # [T, q_lora_rank]
            q = self.q_b_proj(q_lora)
        q = q.view(T, H, self.nope + self.rope_dim)
        cos, sin = rope["interleaved"]
        q_nope, q_pe = q[..., : self.nope], ops.rotary_emb(q[..., self.nope :], cos, sin, interleaved=True)
        latent, k_pe = self.kv_a_proj_with_mqa(x).split([self.rank, self.rope_dim], dim=-1)  # [T, R], [T, Dr]
        k_pe = ops.rotary_emb(k_pe.unsqueeze(1), cos, sin, interleaved=True)  # [T, 1, Dr]
        row = torch.cat([self.kv_a_layernorm(latent).unsqueeze(1), k_pe], dim=-1)  # [T, 1, R + Dr]
        ops.reshape_and_cache(row, None, self.kv_cache, None, batch.slot_mapping[LATENT])
        absorbed = self.mode == "absorbed" or (self.mode == "auto" and batch.max_seqlen_q <= ABSORB_MAX_QUERIES)
        kept = self.indexer(x, q_lora, rope, batch) if self.indexer is not None else None  # [T, k] positions
        table = batch.block_tables[LATENT]
        if absorbed:
            o = self.attend_absorbed(q_nope, q_pe, table, batch.seq_lens, batch.cu_seqlens_q, batch.max_seqlen_q,
                                     batch.max_seqlen_k, None if kept is None else position_slots(batch, kept))
        # a step with prompt chunks reads its lengths on the host (its gather_rows does anyway)
        elif self.mode == "auto" and (split := split_decodes(cu := batch.cu_seqlens_q.tolist())) is not None:
            o = self.attend_split(q_nope, q_pe, table, batch, kept, cu, *split)
        else:
            o = self.attend_expanded(q_nope, q_pe, table, batch.seq_lens, batch.cu_seqlens_q, batch.seq_ids, kept)
        return par.all_reduce(self.o_proj(o.reshape(T, H * self.v_dim)), self.tp_group)  # [T, D]

    def attend_absorbed(self, q_nope, q_pe, table, seq_lens, cu_seqlens_q, max_seqlen_q, max_seqlen_k,
                        kept_slots=None):
        """Attention over the latent rows themselves, W_UK folded into the query and W_UV into the output (MQA over
        one 576-wide KV head): q_nope [t, H, nope], q_pe [t, H, Dr] of the sequences of `table` [b, max_blocks]
        -> [t, H, v]. kept_slots [t, k]: V3.2's selected cache rows (-1: none), else every row a sequence holds."""
        w_uk, w_uv = self.kv_b_proj.halves()  # [H, nope, R], [H, v, R]: contiguous views of kv_b_proj
        q_lat = torch.bmm(q_nope.transpose(0, 1), w_uk).transpose(0, 1)  # [H, t, nope] @ [H, nope, R] -> [t, H, R]
        qa = torch.cat([q_lat, q_pe], dim=-1)  # [t, H, R + Dr], one KV head: the cached row
        if kept_slots is not None:
            rows = self.kv_cache.flatten(0, 1)  # [N * block_size, 1, R + Dr], read by slot
            o = ops.sparse_attention(qa, rows, rows, kept_slots, self.scale)  # [t, H, R + Dr]
        else:
            o = ops.paged_attention(qa, self.kv_cache, None, table, seq_lens, cu_seqlens_q, self.scale,
                                    max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k)  # [t, H, R + Dr]
        # W_UV [H, v, R] @ o^T [H, R, t]: the weight as it lies (its transpose would be copied each step)
        return torch.bmm(w_uv, o[..., : self.rank].permute(1, 2, 0)).permute(2, 0, 1)  # [H, v, t] -> [t, H, v]

    def attend_expanded(self, q_nope, q_pe, table, seq_lens, cu_seqlens_q, seq_ids, kept=None):
        """Attention over K / V expanded from every cached latent row of the sequences of `table` [b, max_blocks]
        (kv_b_proj over S rows: prompt chunks, whose queries outnumber what absorbing saves) -> [t, H, v].
        seq_ids [t]: each query's row of `table`; kept [t, k]: V3.2's selected positions (-1: none)."""
        H = self.heads
        rows, cu_k = gather_rows(self.kv_cache, table, seq_lens)  # [S, 1, R + Dr]
        k_nope, v = self.kv_b_proj.expand(rows[:, 0, : self.rank])  # [S, H, nope], [S, H, v]
        k = torch.cat([k_nope, rows[:, :, self.rank :].expand(-1, H, -1)], dim=-1)  # [S, H, nope + Dr]
        qf = torch.cat([q_nope, q_pe], dim=-1)  # [t, H, nope + Dr]
        if kept is not None:
            start = cu_k[:-1].long()[seq_ids]  # [t]
            idx = torch.where(kept >= 0, kept + start[:, None], -1)  # [t, k] rows of the gathered keys
            return ops.sparse_attention(qf, k, v, idx, self.scale)  # [t, H, v]
        return ops.attention(qf, k, v, cu_seqlens_q, cu_k, self.scale, causal=True)  # [t, H, v]

    def attend_split(self, q_nope, q_pe, table, batch: ForwardBatch, kept, cu: list[int], short: list[int],
                     long: list[int]) -> torch.Tensor:
        """A step of decodes (or short chunks) beside prompt chunks: the `short` sequences absorbed, the `long`
        ones expanded, as vLLM's MLA splits a step, so that the decodes' whole cached prefixes are not expanded
        through kv_b_proj for the chunks' sake. kept [T, k]: V3.2's selected positions, or None; cu: the step's
        cu_seqlens_q on the host. -> [T, H, v]"""
        slots = None if kept is None else position_slots(batch, kept)  # [T, k] cache rows of the kept positions
        o = q_nope.new_empty(q_nope.shape[0], self.heads, self.v_dim)  # [T, H, v]
        for seqs, absorb in ((short, True), (long, False)):
            lens = [cu[b + 1] - cu[b] for b in seqs]
            rows = torch.tensor([r for b in seqs for r in range(cu[b], cu[b + 1])], device=o.device)  # [t]
            cu_q = F.pad(torch.tensor(lens, device=o.device).cumsum(0), (1, 0)).int()  # [b+1]
            pick = torch.tensor(seqs, device=o.device)  # [b]
            args = (q_nope[rows], q_pe[rows], table[pick], batch.seq_lens[pick], cu_q)
            if absorb:
                o[rows] = self.attend_absorbed(*args, max(lens), None, None if slots is None else slots[rows])
            else:
                seq_ids = torch.repeat_interleave(torch.arange(len(seqs), device=o.device),
                                                  torch.tensor(lens, device=o.device))  # [t] rows of table[pick]
                o[rows] = self.attend_expanded(*args, seq_ids, None if kept is None else kept[rows])
        return o


class MLP(nn.Module):
    """SwiGLU MLP: down(silu(gate(x)) * up(x)), gate and up packed into one gate_up_proj [2I, D]. Replicated."""

    def __init__(self, args: ModelArgs, hidden: int, intermediate: int):
        super().__init__()
        self.gate_up_proj = linear(args, hidden, 2 * intermediate)
        self.down_proj = linear(args, intermediate, hidden)

    def forward(self, x):
        return self.down_proj(ops.swiglu(self.gate_up_proj(x)))


class Router(nn.Module):
    """`mlp.gate`: fp32 logits x @ weight.T; e_score_correction_bias enters the selection only."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        E = args.n_routed_experts
        self.weight = nn.Parameter(torch.empty(E, args.hidden_size, dtype=torch.float32))
        self.register_buffer("e_score_correction_bias", torch.zeros(E, dtype=torch.float32))


class Experts(nn.Module):
    """This rank's E routed experts, stacked: gate_up_proj [E, gate | up, D], down_proj [E, D, I]; float, or int8
    with an fp32 scale per output channel (`gate_up_proj_scale` [E, 2I], `down_proj_scale` [E, D]) for w8a8."""

    def __init__(self, args: ModelArgs, E: int):
        super().__init__()
        I, D = args.moe_intermediate_size, args.hidden_size
        if args.quant_format is None:
            self.gate_up_proj = nn.Parameter(torch.empty(E, 2 * I, D))
            self.down_proj = nn.Parameter(torch.empty(E, D, I))
            self.gate_up_proj_scale = self.down_proj_scale = None
            return
        for name, (n, k) in (("gate_up_proj", (2 * I, D)), ("down_proj", (D, I))):
            self.register_buffer(name, torch.zeros(E, n, k, dtype=torch.int8))
            self.register_buffer(f"{name}_scale", torch.ones(E, n, dtype=torch.float32))

    def matmul(self, x: torch.Tensor, which: str, tokens_per_expert: torch.Tensor) -> torch.Tensor:
        """x [M, K] sorted by expert -> [M, N] through gate_up_proj or down_proj."""
        weight, scale = getattr(self, which), getattr(self, f"{which}_scale")
        if scale is None:
            return ops.grouped_matmul(x, weight, tokens_per_expert)
        return ops.grouped_quant_matmul(x, weight, scale, tokens_per_expert)


class MoE(nn.Module):
    """Routed experts (sigmoid scores; top num_experts_per_tok of the topk_group best of n_group groups, by
    scores + bias; weights renormalised if norm_topk_prob, times routed_scaling_factor) plus the shared experts;
    the routed experts sharded over moe_ep (rank r holds experts [r * E/P, (r + 1) * E/P))."""

    def __init__(self, args: ModelArgs, parallel: par.Parallel):
        super().__init__()
        self.args = args
        self.ep_group, self.tp_group = parallel.group("moe_ep"), parallel.group("attn_tp")
        self.ep_size, self.ep_rank = parallel.size("moe_ep"), parallel.rank_in("moe_ep")
        self.tp_size, self.tp_rank = parallel.size("attn_tp"), parallel.rank_in("attn_tp")
        self.gate = Router(args)
        self.experts = Experts(args, args.n_routed_experts // self.ep_size)
        shared = args.moe_intermediate_size * args.n_shared_experts
        self.shared_experts = MLP(args, args.hidden_size, shared) if shared else None

    def forward(self, x: torch.Tensor, uniform: bool = False) -> torch.Tensor:
        """x [T, D] (the same on every attention-TP rank) -> [T, D]. uniform: every rank runs T tokens (a
        graph-mode step), so the expert dispatch exchanges fixed-capacity buffers (no split read on the host)."""
        a = self.args
        runs = x.tensor_split(self.tp_size)  # each attention-TP rank routes its share of the tokens
        x_r = runs[self.tp_rank]  # [T_r, D]
        logits = F.linear(x_r.float(), self.gate.weight.float())  # [T_r, E]
        if x_r.shape[0]:
            weights, idx = ops.moe_gating_topk(logits, a.num_experts_per_tok, bias=self.gate.e_score_correction_bias,
                                               score_func="sigmoid", group_count=a.n_group, k_group=a.topk_group,
                                               renorm=a.norm_topk_prob, routed_scaling_factor=a.routed_scaling_factor)
        else:  # no token to route here (an idle DP rank, a TP share of none); the dispatch below still meets the others
            weights = logits.new_zeros(0, a.num_experts_per_tok)  # [0, k]
            idx = torch.zeros(0, a.num_experts_per_tok, dtype=torch.int32, device=x.device)
        shared = self.shared_experts(x_r) if self.shared_experts is not None else None
        if self.ep_size == 1 and cpu_moe.takes(self.experts.gate_up_proj, self.experts.down_proj):  # CPU
            out = cpu_moe.fused_experts(x_r, self.experts.gate_up_proj, self.experts.down_proj, weights, idx)
            if shared is not None:
                out = (out.float() + shared.float()).to(out.dtype)  # [T_r, D]
            return par.all_gather_v(out, [len(run) for run in runs], self.tp_group)  # [T, D]
        xs, row_idx, counts = ops.moe_init_routing(x_r, idx, a.n_routed_experts)  # [T_r*k, D] by global expert
        capacity = runs[0].shape[0] * a.num_experts_per_tok if uniform else None  # the largest share's rows
        xe, local_counts, handle = par.dispatch_to_experts(xs, counts, self.ep_group, capacity)  # [M, D]
        h = ops.swiglu(self.experts.matmul(xe, "gate_up_proj", local_counts))  # [M, I]
        y = par.combine_from_experts(self.experts.matmul(h, "down_proj", local_counts), handle,
                                     self.ep_group)  # [T_r*k, D]
        out = ops.moe_finalize_routing(y, weights, row_idx, shared)  # [T_r, D]
        return par.all_gather_v(out, [len(run) for run in runs], self.tp_group)  # [T, D]


class DecoderLayer(nn.Module):
    def __init__(self, args: ModelArgs, sparse_mlp: bool, parallel: par.Parallel):
        super().__init__()
        self.self_attn = MLAttention(args, parallel)
        self.mlp = MoE(args, parallel) if sparse_mlp else MLP(args, args.hidden_size, args.intermediate_size)
        self.input_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)

    def forward(self, x: torch.Tensor, rope, batch: ForwardBatch) -> torch.Tensor:
        """x [T, D] the residual stream (fp32 under fp16 compute: residual_dtype) -> [T, D] in x's dtype; the
        sublayers compute in the weights' dtype, their outputs added to x in x's dtype."""
        dt = self.input_layernorm.weight.dtype
        x = x + self.self_attn(self.input_layernorm(x).to(dt), rope, batch)
        h = self.post_attention_layernorm(x).to(dt)
        return x + (self.mlp(h, batch.uniform_across_ranks) if isinstance(self.mlp, MoE) else self.mlp(h))


class Backbone(nn.Module):
    """`model.*`: embedding (this rank's vocabulary rows), decoder layers, final norm."""

    def __init__(self, args: ModelArgs, parallel: par.Parallel):
        super().__init__()
        self.embed_tokens = nn.Embedding(args.vocab_size // parallel.size("embed_tp"), args.hidden_size)
        par.shard(self.embed_tokens.weight, 0, parallel, "embed_tp")
        self.layers = nn.ModuleList(DecoderLayer(args, args.mlp_layer_types[i] == "sparse", parallel)
                                    for i in range(args.num_hidden_layers))
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps)


class SharedHead(nn.Module):
    """`shared_head.*` of an MTP layer: its norm (its `head` is the main LM head, shared, and not read)."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps)


class MTPLayer(DecoderLayer):
    """The publisher's multi-token-prediction layer (`model.layers.{num_hidden_layers + i}.*`): a decoder layer
    (MoE MLP) fed eh_proj([enorm(embedding of token t+1); hnorm(hidden at t)]); shared_head.norm, then the main LM
    head, give the logits of token t+2. Its `embed_tokens` / `shared_head.head` are the main model's (shared)."""

    def __init__(self, args: ModelArgs, rope: Rope, parallel: par.Parallel):
        super().__init__(args, True, parallel)
        D = args.hidden_size
        self.enorm, self.hnorm = RMSNorm(D, args.rms_norm_eps), RMSNorm(D, args.rms_norm_eps)
        self.eh_proj = nn.Linear(2 * D, D, bias=False)
        self.shared_head = SharedHead(args)
        self.rope = rope

    def forward(self, streams: torch.Tensor, embeds: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """streams [T, 1, D] (the main model's final hidden states at positions t, or the previous draft's output),
        embeds [T, D] (token t+1's) -> this layer's output [T, 1, D], before shared_head.norm. The embedding at
        position 0 is zeroed (nothing precedes it to predict from), as upstream does."""
        embeds = torch.where(batch.positions.unsqueeze(-1) == 0, 0, embeds)
        dt = embeds.dtype  # the model's (eh_proj may be packed: no weight to read)
        x = self.eh_proj(torch.cat([self.enorm(embeds), self.hnorm(streams[:, 0]).to(dt)], dim=-1))  # [T, D]
        x = super().forward(x.to(residual_dtype(dt)), self.rope.tables(batch.positions), batch)  # [T, D]
        return x.to(dt).unsqueeze(1)  # [T, 1, D]

    def final_hidden(self, streams: torch.Tensor) -> torch.Tensor:
        """[T, 1, D] -> the normed hidden state [T, D] for the shared head."""
        return self.shared_head.norm(streams[:, 0])


def check_layout(args: ModelArgs, layout: par.LLMParallelLayout) -> None:
    """ValueError unless the layout splits this model evenly (checked before any rank starts, and by the model)."""
    for size, name, what in ((layout.attn_tp, "attn_tp", {"attention heads": args.num_attention_heads}),
                             (layout.moe_ep, "moe_ep", {"routed experts": args.n_routed_experts}),
                             (layout.embed_tp, "embed_tp", {"vocabulary rows": args.vocab_size}),
                             (layout.lmhead_tp, "lmhead_tp", {"vocabulary rows": args.vocab_size})):
        for thing, n in what.items():
            if n % size:
                raise ValueError(f"{name}={size} does not divide the model's {n} {thing}")
    if args.tie_word_embeddings and layout.embed_tp != layout.lmhead_tp:
        raise ValueError(f"tie_word_embeddings: embed_tp={layout.embed_tp} and lmhead_tp={layout.lmhead_tp} must be "
                         "equal (one tensor, one split)")


class DeepseekV3(nn.Module):
    """The causal LM over packed ForwardBatch inputs and the latent paged cache (common.engine's model contract);
    with `mtp`, also its num_nextn_predict_layers MTP layers (`self.mtp`, for speculative decoding), which share the
    embedding and the LM head."""

    def __init__(self, args: ModelArgs, parallel: par.Parallel | None = None, mtp: bool = False):
        super().__init__()
        self.args = args
        self.parallel = parallel = parallel or par.Parallel(par.LLMParallelLayout())
        check_layout(args, parallel.layout)
        self.embed_group, self.head_group = parallel.group("embed_tp"), parallel.group("lmhead_tp")
        self.model = Backbone(args, parallel)
        self.vocab_start = parallel.rank_in("embed_tp") * self.model.embed_tokens.num_embeddings
        self.lm_head = nn.Linear(args.hidden_size, args.vocab_size // parallel.size("lmhead_tp"), bias=False)
        par.shard(self.lm_head.weight, 0, parallel, "lmhead_tp")
        if args.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.rope = Rope(args)
        k = args.num_nextn_predict_layers if mtp else 0
        self.mtp = nn.ModuleList(MTPLayer(args, self.rope, parallel) for _ in range(k))

    @property
    def embed(self) -> nn.Embedding:
        """The (vocabulary-parallel) token embedding."""
        return self.model.embed_tokens

    def attention_layers(self) -> list[MLAttention]:
        return [layer.self_attn for layer in [*self.model.layers, *self.mtp]]

    def set_attention_mode(self, mode: str) -> None:
        """"auto", "absorbed" or "expanded" for every layer (the paths are equal; tests compare them)."""
        if mode not in ("auto", "absorbed", "expanded"):
            raise ValueError(f"attention mode {mode!r}: expected auto, absorbed or expanded")
        for attn in self.attention_layers():
            attn.mode = mode

    def cache_specs(self, block_size: int) -> list[CacheGroupSpec]:
        """One full-attention token group: every layer's latent rows (and V3.2's indexer keys), MTP layers too."""
        return [CacheGroupSpec(LATENT, block_size)]

    def cache_tensor_specs(self) -> list[CacheTensorSpec]:
        """Every cache tensor, in a fixed order: per attention layer (the MTP layers' too) its latent rows [R + Dr],
        then V3.2's indexer keys [Di]; one row per token, all in the latent group (one block table)."""
        a, specs = self.args, []
        layers = [(f"model.layers.{i}", l) for i, l in enumerate(self.model.layers)]
        for name, layer in layers + [(f"mtp.{i}", l) for i, l in enumerate(self.mtp)]:
            specs.append(CacheTensorSpec(f"{name}.self_attn.kv_cache", LATENT, a.kv_lora_rank + a.qk_rope_head_dim))
            if layer.self_attn.indexer is not None:
                specs.append(CacheTensorSpec(f"{name}.self_attn.indexer.k_cache", LATENT, a.index_head_dim))
        return specs

    def bind_caches(self, tensors: dict[str, torch.Tensor], tables: dict[str, str] | None = None) -> None:
        """Give the model its cache tensors by CacheTensorSpec name, each [num_blocks, block_size, 1, width] (the
        engine's, or vLLM's through the plugin). Every tensor is read through the latent block table: `tables` may
        only name that (ValueError for any other)."""
        specs = self.cache_tensor_specs()
        check_cache_tensors(specs, tensors)
        if other := sorted(name for name, table in (tables or {}).items() if table != LATENT):
            raise ValueError(f"DeepSeek-V3 reads every cache tensor through the {LATENT!r} block table, not the "
                             f"tables asked for {other}")
        for s in specs:
            path, attr = s.name.rsplit(".", 1)
            setattr(self.get_submodule(path), attr, tensors[s.name])

    def embed_tokens(self, input_ids: torch.Tensor, uniform: bool = False) -> torch.Tensor:
        """[T] -> [T, D]; uniform: every rank embeds T tokens (a graph-mode step: no sizes exchanged)."""
        return par.vocab_parallel_embedding(input_ids, self.model.embed_tokens, self.vocab_start, self.embed_group,
                                            uniform)  # [T, D]

    def residual_streams(self, batch: ForwardBatch) -> torch.Tensor:
        """The final normed hidden states as one stream [T, 1, D]: what the MTP layer reads (the speculative-
        decoding contract's [T, n, D], n = 1: no hyper-connections)."""
        x = self.embed_tokens(batch.input_ids, batch.uniform_across_ranks)  # [T, D]
        dt = x.dtype
        x = x.to(residual_dtype(dt))
        rope = self.rope.tables(batch.positions)
        for layer in self.model.layers:
            x = layer(x, rope, batch)  # [T, D]
        return self.model.norm(x).to(dt).unsqueeze(1)  # [T, 1, D]

    def final_hidden(self, streams: torch.Tensor) -> torch.Tensor:
        """[T, 1, D] -> [T, D] for the LM head."""
        return streams[:, 0]

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """-> final hidden states [T, D] (feed the rows you need to `compute_logits`)."""
        return self.final_hidden(self.residual_streams(batch))

    def compute_logits(self, hidden: torch.Tensor, uniform: bool = False) -> torch.Tensor:
        """[N, D] -> [N, V] fp32; uniform: every rank scores N rows (a graph-mode step)."""
        return par.vocab_parallel_logits(hidden, self.lm_head, self.head_group, uniform).float()  # [N, V]

    def engine_contract(self) -> ModelContract:
        """What the engine may use of this model: its MTP layers when loaded (this model is their MTPDraftModel)."""
        a = self.args
        w = self.embed.weight
        return ModelContract(a.max_position_embeddings, a.vocab_size, tuple(a.eos_token_ids), a.hidden_size, w.dtype,
                             w.device, self.parallel, mtp=self if len(self.mtp) else None)

    # MTPDraftModel (common/engine/model_contract.py): the MTP layers, fed the main model's final hidden states
    @property
    def num_draft_layers(self) -> int:
        return len(self.mtp)

    def empty_streams(self) -> torch.Tensor:
        return self.embed.weight.new_zeros(0, 1, self.args.hidden_size)  # [0, 1, D]

    def draft_streams(self, layer: int, streams: torch.Tensor, input_ids: torch.Tensor,
                      batch: ForwardBatch) -> torch.Tensor:
        return self.mtp[layer](streams, self.embed_tokens(input_ids), batch)  # [T, 1, D]

    def draft_logits(self, layer: int, streams: torch.Tensor) -> torch.Tensor:
        return self.compute_logits(self.mtp[layer].final_hidden(streams))  # [B, V]
