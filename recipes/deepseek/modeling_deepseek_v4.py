"""DeepSeek-V4 on common.ops, over packed (token-major, unpadded) inputs.

Per layer: mHC -> attention -> mHC -> MoE. Parameter names follow the publisher's checkpoints
(`embed`, `layers.N.attn.wq_a`, `layers.N.ffn.experts`, `hc_head_fn`, ...); routed experts are stacked
into `[E, ...]` tensors for grouped matmuls. T = tokens of all sequences in the batch, D = hidden size,
n = hc_mult residual streams, H = attention heads, Dh = head_dim, C = compressed entries.

Parallel (common.parallel.LLMParallelLayout, upstream's names): attention TP splits the query heads (and the
grouped output projection's groups) over `attn_tp`, the one shared KV head, the compressors and the indexer
replicated, the output projection reduced; routed experts are sharded over `moe_ep` (tokens dispatched to the
ranks owning their experts and combined back; under attention TP each TP rank routes its share of the tokens);
the shared expert, router and mHC are replicated; embedding and LM head are vocabulary parallel over `embed_tp` /
`lmhead_tp`. Each parameter that is a slice carries `.shard`, which the loader reads. One process: every group
is None and every collective returns its input.

MoE offload (`offload_slots` N): every MoE layer (hash-routed and MTP ones too) holds N resident expert slots, so
shapes stay fixed whatever is resident; the routed pairs of the other experts are computed on the host
(common.offload), submitted before the resident and shared experts run and added after them. One process splits
each token's top-k pairs (the host sums its pairs per token); over moe_ep ranks each rank holds N slots of its own
E/P experts and its host the rest of that shard, and splits the rows dispatched to it (one expert each).
"""
from __future__ import annotations

import dataclasses
import math

import torch
import torch.nn.functional as F
from torch import nn

from common import cpu_gemm, cpu_moe, ops
from common import parallel as par
from common.custom_op import direct_register_custom_op
from common.engine.compile_region import compile_region
from common.engine.forward_batch import ForwardBatch
from common.engine.model_contract import ModelContract
from common.kv_cache import CacheGroupSpec, CacheTensorSpec, check_cache_tensors
from config_deepseek_v4 import CSA, SLIDING, ModelArgs

# A compiled CPU step reads a layer's compressed entries padded to max_seqlen_k / ratio (the bucket's max_model_len)
# while that is at most this many a sequence (inductor fuses the gathers, the indexer and the attention); past it,
# through one opaque op that reads the width the step's sequences hold on the host (compressed_attention). Xeon,
# bf16, the bench checkpoint, batch-16 graph ms a step, contexts 128 / 896 (bench_graph.py --max-model-len; CSA
# entries in brackets): 4,096 (1,024) padded 48.3 / 48.3, the op 49.2-53.2; 8,192 (2,048) padded 61.4 / 64.4, the op
# 61.7 / 71.5; 16,384 (4,096) padded 68.2 / 66.4 (eager 72.8 / 88.9), the op 57.2 / 65.8; 32,768 (8,192) padded 79.7
# / 79.1 (eager 71.9 / 91.4: graph behind), the op 54.8 / 59.5. At batch 1 padded is as fast or faster throughout.
PADDED_ENTRIES_MAX = 2048
WINDOW = "window"  # token-level group: sliding-window KV + the compressors' per-token state


def compressed_group(ratio: int) -> str:
    return f"compressed{ratio}"


def rope_inv_freq(dim: int, theta: float, yarn: dict | None) -> torch.Tensor:
    """Inverse frequencies [dim/2]; YaRN-blended when `yarn` is given (no attention scaling, as upstream)."""
    inv = 1.0 / theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    if not yarn:
        return inv
    factor, orig = yarn["factor"], yarn["original_max_position_embeddings"]
    fast, slow = yarn.get("beta_fast") or 32, yarn.get("beta_slow") or 1

    def corr_dim(rot):
        return dim * math.log(orig / (rot * 2 * math.pi)) / (2 * math.log(theta))

    low, high = max(math.floor(corr_dim(fast)), 0), min(math.ceil(corr_dim(slow)), dim - 1)
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / max(high - low, 1e-3)).clamp(0, 1)
    return inv / factor * ramp + inv * (1 - ramp)


class Rope(nn.Module):
    """Interleaved RoPE on the trailing `dim` channels of each head."""

    def __init__(self, dim: int, theta: float, yarn: dict | None):
        super().__init__()
        self.dim = dim
        self.scale = float(yarn.get("attention_factor", 1.0)) if yarn else 1.0
        self.register_buffer("inv_freq", rope_inv_freq(dim, theta, yarn), persistent=False)

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [T] -> (cos, sin) [T, dim], the interleaved pairs' angles scaled."""
        freqs = positions.float()[:, None] * self.inv_freq  # [T, dim/2]
        freqs = freqs.repeat_interleave(2, dim=-1)  # [T, dim] interleaved pairs
        return freqs.cos() * self.scale, freqs.sin() * self.scale

    def __call__(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x [T, H, Dh] -> x with its last `dim` channels rotated."""
        nope, pe = x[..., : -self.dim], x[..., -self.dim :]
        return torch.cat([nope, ops.rotary_emb(pe, cos, sin, interleaved=True)], dim=-1)


def make_ropes(args: ModelArgs) -> dict[str, Rope]:
    """The two RoPEs a layer picks from: "main" (sliding-window attention, the MTP blocks) and "compress"."""
    return {"main": Rope(args.qk_rope_head_dim, args.rope_theta, None),
            "compress": Rope(args.qk_rope_head_dim, args.compress_rope_theta, args.compress_rope_scaling)}


class RMSNorm(nn.Module):
    """RMSNorm with an fp32 weight (cast once at the end, as upstream)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim, dtype=torch.float32))
        self.eps = eps

    def forward(self, x):
        return ops.rms_norm(x, self.weight, self.eps)


class QuantLinear(nn.Module):
    """W8A8 linear (upstream's `w8a8-int`): int8 weight [N, K] with an fp32 scale per output channel, as
    convert_checkpoint.py stores them; the activations are quantized per token on the fly (ops.quant_linear)."""

    def __init__(self, in_features: int, out_features: int):
        super().__init__()
        self.register_buffer("weight", torch.zeros(out_features, in_features, dtype=torch.int8))
        self.register_buffer("weight_scale", torch.ones(out_features, dtype=torch.float32))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ops.quant_linear(x, self.weight, self.weight_scale)  # [..., N] in x's dtype


def linear(args: ModelArgs, in_features: int, out_features: int, quantized: bool) -> nn.Module:
    """One of the projections a quantized checkpoint stores in int8 (upstream's selection), else a plain linear."""
    if quantized and args.quant_format is not None:
        return QuantLinear(in_features, out_features)
    return nn.Linear(in_features, out_features, bias=False)


class Experts(nn.Module):
    """The routed experts of this rank, stacked for grouped matmuls: w13 [E, gate|up, D] and w2 [E, D, I]; float,
    or as a quantized checkpoint stores them: int8 per output channel (w8a8: `_scale` [E, N]) or int4 packed two a
    byte along the input with a scale per `group_size` inputs (w4a8: [E, N, K/2], `_scale` [E, N, K/group])."""

    def __init__(self, args: ModelArgs, E: int):
        super().__init__()
        I, D = args.moe_intermediate_size, args.hidden_size
        self.group_size = args.quant_group_size
        if args.quant_format is None:
            self.w13 = nn.Parameter(torch.empty(E, 2 * I, D))
            self.w2 = nn.Parameter(torch.empty(E, D, I))
            self.w13_scale = self.w2_scale = None
            self.w13.optional = self.w2.optional = E == 0  # no slot (MoE offload, all on the host): nothing to load
            return
        packed = 2 if self.group_size else 1  # int4: two values a byte
        for name, (n, k) in (("w13", (2 * I, D)), ("w2", (D, I))):
            self.register_buffer(name, torch.zeros(E, n, k // packed, dtype=torch.int8))
            scale = (E, n, k // self.group_size) if self.group_size else (E, n)
            self.register_buffer(f"{name}_scale", torch.ones(*scale, dtype=torch.float32))

    @torch.no_grad()
    def set_slot(self, slot: int, w13: torch.Tensor, w2: torch.Tensor) -> None:
        """Put one expert's float weights w13 [2I, D] and w2 [D, I] into `slot` (MoE offload's resident set
        changing), in place: dense, or repacked where common.cpu_gemm packed the stack."""
        if self.w13_scale is not None:
            raise ValueError("resident slots take float experts, not a quantized checkpoint's")
        for name, w in (("w13", w13), ("w2", w2)):
            target = getattr(self, name)
            if list(w.shape) != list(target.shape[1:]):
                raise ValueError(f"{name} {list(w.shape)} does not fit a slot of {list(target.shape)}")
            if isinstance(target, cpu_gemm.PackedExperts):
                target.set_expert(slot, w)
            else:
                target[slot].copy_(w)

    def matmul(self, x: torch.Tensor, which: str, tokens_per_expert: torch.Tensor) -> torch.Tensor:
        """x [M, K] sorted by expert -> [M, N] through w13 or w2."""
        weight, scale = getattr(self, which), getattr(self, f"{which}_scale")
        if scale is None:
            return ops.grouped_matmul(x, weight, tokens_per_expert)
        return ops.grouped_quant_matmul(x, weight, scale, tokens_per_expert, self.group_size)


class Compressor(nn.Module):
    """Softmax-gated pooling of every `ratio` tokens into one KV entry (then RMSNorm + RoPE at ratio*w).

    With `overlap` (CSA) each token projects two series [Ca | Cb]; entry w pools window w-1's Ca with
    window w's Cb over 2*ratio slots. Without it (HCA) entry w pools window w alone.
    Caches: `state` keeps each token's [kv | gate] projection in the window group (the unfinished group and,
    for CSA, the previous window); `entries` holds the compressed entries, block_size/ratio per block. Each is
    read through the block table `cache_table` names for it, with the block size of its own tensor
    (DeepseekV4.bind_caches).
    """

    def __init__(self, args: ModelArgs, ratio: int, head_dim: int, overlap: bool, rope: Rope):
        super().__init__()
        self.ratio, self.head_dim, self.overlap, self.rope = ratio, head_dim, overlap, rope
        self.width = head_dim * (2 if overlap else 1)
        self.wkv = nn.Linear(args.hidden_size, self.width, bias=False)
        self.wgate = nn.Linear(args.hidden_size, self.width, bias=False)
        self.ape = nn.Parameter(torch.zeros(ratio, self.width, dtype=torch.float32))
        self.norm = RMSNorm(head_dim, args.rms_norm_eps)
        self.span = 2 * ratio if overlap else ratio  # tokens pooled into one entry
        self.state = self.entries = None  # [blocks, tokens a block, 1, 2*width], [blocks, entries a block, 1, d]
        self.cache_group = {"state": WINDOW, "entries": compressed_group(ratio)}  # each cache tensor's group
        self.cache_table = dict(self.cache_group)  # the ForwardBatch block table each reads

    def cache_tensor_specs(self, prefix: str) -> list[CacheTensorSpec]:
        return [CacheTensorSpec(f"{prefix}.state", WINDOW, 2 * self.width, window=self.span),
                CacheTensorSpec(f"{prefix}.entries", compressed_group(self.ratio), self.head_dim,
                                tokens_per_row=self.ratio)]

    def forward(self, x: torch.Tensor, batch: ForwardBatch) -> None:
        """Store this step's projections and write the entries completed by its tokens into `entries` (the readers
        gather them: gather_entries).

        No shape depends on the tokens' values: the tokens that complete an entry are the first M of the step's
        tokens sorted done-first, M = T // ratio + B (at most that many complete one); rows past the done ones
        pool too and write to row 0 of the null block 0, which no sequence reads."""
        r, d, bs = self.ratio, self.head_dim, self.state.shape[1]
        T, B, state_group = x.shape[0], batch.num_seqs, self.cache_table["state"]
        proj = torch.cat([self.wkv(x), self.wgate(x)], dim=-1)  # [T, 2*width]
        ops.reshape_and_cache(proj[:, None], None, self.state, None, batch.slot_mapping[state_group])
        M = min(T, T // r + B)
        if M:
            is_done = (batch.positions + 1) % r == 0  # [T] tokens that complete an entry
            rows = torch.sort(is_done.to(torch.uint8), descending=True, stable=True).indices[:M]  # [M] done first
            done = is_done[rows]  # [M]
            w = torch.where(done, batch.positions[rows] // r, 0)  # [M] entry index in its sequence
            pos = w[:, None] * r + r - self.span + torch.arange(self.span, device=x.device)  # [M, span]
            table = batch.block_tables[state_group][batch.seq_ids[rows]]  # [M, max_blocks]
            slots = table.gather(1, pos.clamp(min=0) // bs).long() * bs + pos.clamp(min=0) % bs
            kv, gate = self.state.view(-1, 2 * self.width)[slots].split(self.width, dim=-1)  # [M, span, width]
            gate = gate.float() + self.ape.repeat(self.span // r, 1)  # ape by offset in the window
            if self.overlap:  # first r slots: previous window's Ca; last r: this window's Cb
                kv = torch.cat([kv[:, :r, :d], kv[:, r:, d:]], dim=1)  # [M, 2r, d]
                gate = torch.cat([gate[:, :r, :d], gate[:, r:, d:]], dim=1)
            gate = gate.masked_fill((pos < 0)[..., None], float("-inf"))
            pooled = self.norm((kv * gate.softmax(dim=1).to(kv.dtype)).sum(dim=1))  # [M, d]
            cos, sin = self.rope.cos_sin(w * r)
            pooled = self.rope(pooled[:, None], cos, sin)  # [M, 1, d]
            table = batch.block_tables[self.cache_table["entries"]]
            slots = torch.where(done, entry_slots(table, self.entries.shape[1], batch.seq_ids[rows], w), 0)  # [M]
            ops.reshape_and_cache(pooled, None, self.entries, None, slots)  # rows not done: scratch row 0

    def entries_width(self, batch: ForwardBatch) -> int:
        """Wc: entries per sequence the step's readers pad to, from the batch's host bound max_seqlen_k."""
        return batch.max_seqlen_k // self.ratio


def entry_slots(table: torch.Tensor, per_block: int, seqs: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Cache rows of entry w of sequence seqs (a compressed group's block table [B, max_blocks]) -> like w."""
    return table[seqs, w // per_block].long() * per_block + w % per_block


def gather_entries(entries: torch.Tensor, table: torch.Tensor, seq_lens: torch.Tensor, ratio: int, width: int
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """Every entry of the batch's sequences from a compressor's cache `entries` [blocks, per block, 1, d]: (rows
    [B * width, d], cu [B+1]), sequence b's entries at rows b * width.. (the rows past its count, seq_lens[b] //
    ratio, are padding: they read the sequence's or the null block, and every reader masks them)."""
    B, per_block, d = seq_lens.shape[0], entries.shape[1], entries.shape[-1]
    w = torch.arange(width, device=seq_lens.device)  # [Wc]
    counts = seq_lens.long() // ratio  # [B] entries of each sequence
    w = torch.where(w < counts[:, None], w, 0)  # [B, Wc]
    seqs = torch.arange(B, device=w.device)[:, None].expand(B, width)  # [B, Wc]
    rows = entry_slots(table, per_block, seqs.reshape(-1), w.reshape(-1))  # [B * Wc]
    cu = torch.arange(B + 1, device=w.device, dtype=torch.int32) * width  # [B+1]
    return entries.view(-1, d)[rows], cu


class Indexer(nn.Module):
    """Lightning indexer: picks the top-k compressed entries per query by sum_h w_h * relu(q_h . k)."""

    def __init__(self, args: ModelArgs, ratio: int, rope: Rope):
        super().__init__()
        self.n_heads, self.head_dim, self.topk, self.ratio = args.index_n_heads, args.index_head_dim, args.index_topk, ratio
        self.wq_b = linear(args, args.q_lora_rank, self.n_heads * self.head_dim, quantized=True)
        self.weights_proj = nn.Linear(args.hidden_size, self.n_heads, bias=False)
        self.compressor = Compressor(args, ratio, self.head_dim, overlap=True, rope=rope)
        self.rope = rope
        self.scale = (self.head_dim * self.n_heads) ** -0.5

    def forward(self, x, q_lora, cos, sin, batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """This step's index keys into the cache; -> the index queries [T, Hi, Di] and their head weights [T, Hi]
        fp32, which pick each query's top-k entries (compressed_attention)."""
        self.compressor(x, batch)
        q = self.wq_b(q_lora).view(-1, self.n_heads, self.head_dim)  # [T, Hi, Di]
        q = self.rope(q, cos, sin)
        return q, self.weights_proj(x).float() * self.scale  # [T, Hi, Di], [T, Hi]


class Attention(nn.Module):
    """Shared-KV MQA with attention sinks over a sliding window, plus compressed entries (CSA / HCA)."""

    def __init__(self, args: ModelArgs, layer: int, ropes: dict[str, Rope], parallel: par.Parallel):
        super().__init__()
        self.kind = args.layer_types[layer]
        self.tp_group = parallel.group("attn_tp")
        tp = parallel.size("attn_tp")
        self.n_heads, self.head_dim, self.window = args.num_attention_heads // tp, args.head_dim, args.sliding_window
        self.groups, self.eps = args.o_groups // tp, args.rms_norm_eps  # this rank's heads and output groups
        self.rope = ropes["main" if self.kind == SLIDING else "compress"]
        self.wq_a = nn.Linear(args.hidden_size, args.q_lora_rank, bias=False)
        self.q_norm = RMSNorm(args.q_lora_rank, args.rms_norm_eps)
        self.wq_b = linear(args, args.q_lora_rank, self.n_heads * self.head_dim, quantized=True)
        self.wkv = nn.Linear(args.hidden_size, self.head_dim, bias=False)
        self.kv_norm = RMSNorm(self.head_dim, args.rms_norm_eps)
        self.wo_a = GroupedLinear(self.n_heads * self.head_dim // self.groups, args.o_lora_rank, self.groups)
        self.wo_b = linear(args, self.groups * args.o_lora_rank, args.hidden_size, quantized=True)
        self.attn_sink = nn.Parameter(torch.zeros(self.n_heads, dtype=torch.float32))
        sliced = [(self.wq_b.weight, 0), (self.wo_a.weight, 0), (self.wo_b.weight, 1), (self.attn_sink, 0)]
        if isinstance(self.wq_b, QuantLinear):
            sliced.append((self.wq_b.weight_scale, 0))  # wo_b's scale is per output channel: whole on every rank
        for param, dim in sliced:
            par.shard(param, dim, parallel, "attn_tp")  # heads / groups of this rank
        self.ratio = args.compress_rates.get(self.kind, 0)
        self.compressor = None if self.kind == SLIDING else Compressor(args, self.ratio, self.head_dim, self.kind == CSA, self.rope)
        self.indexer = Indexer(args, self.ratio, self.rope) if self.kind == CSA else None
        self.scale = self.head_dim**-0.5
        self.kv_cache = None  # [blocks, block_size, 1, Dh] in the window group (DeepseekV4.bind_caches)
        self.cache_group = {"kv_cache": WINDOW}
        self.cache_table = dict(self.cache_group)  # the ForwardBatch block table it reads

    def cache_tensor_specs(self, prefix: str) -> list[CacheTensorSpec]:
        return [CacheTensorSpec(f"{prefix}.kv_cache", WINDOW, self.head_dim, window=self.window)]

    def cache_owners(self, prefix: str) -> list[tuple[str, nn.Module]]:
        """(name, module) of the layer's cache owners: itself, its compressor, its indexer's compressor."""
        owners = [(prefix, self)]
        if self.compressor is not None:
            owners.append((f"{prefix}.compressor", self.compressor))
        if self.indexer is not None:
            owners.append((f"{prefix}.indexer.compressor", self.indexer.compressor))
        return owners

    @compile_region  # one per kind of layer (sliding, CSA, HCA)
    def forward(self, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        T = x.shape[0]
        cos, sin = self.rope.cos_sin(batch.positions)  # [T, rope_dim]
        q_lora = self.q_norm(self.wq_a(x))  # [T, q_lora_rank]
        q = self.wq_b(q_lora).view(T, self.n_heads, self.head_dim)  # [T, H, Dh]
        q = self.rope(ops.rms_norm(q, None, self.eps), cos, sin)
        kv = self.rope(self.kv_norm(self.wkv(x)).view(T, 1, self.head_dim), cos, sin)  # [T, 1, Dh], K = V
        group = self.cache_table["kv_cache"]
        ops.reshape_and_cache(kv, None, self.kv_cache, None, batch.slot_mapping[group])
        o, lse = ops.paged_attention(q, self.kv_cache, None, batch.block_tables[group], batch.seq_lens,
                                     batch.cu_seqlens_q, self.scale, sliding_window=self.window, return_lse=True,
                                     max_seqlen_q=batch.max_seqlen_q, max_seqlen_k=batch.max_seqlen_k)
        if self.compressor is not None:
            self.compressor(x, batch)  # this step's completed entries into the cache
            iq = iw = ikeys = None
            if self.indexer is not None:
                iq, iw = self.indexer(x, q_lora, cos, sin, batch)  # [T, Hi, Di], [T, Hi]
                ikeys = self.indexer.compressor
            args = (q, self.compressor.entries, batch.block_tables[self.compressor.cache_table["entries"]], iq, iw,
                    None if ikeys is None else ikeys.entries,
                    None if ikeys is None else batch.block_tables[ikeys.cache_table["entries"]],
                    batch.seq_lens, batch.positions, batch.seq_ids, batch.cu_seqlens_q, self.ratio,
                    self.indexer.topk if self.indexer is not None else 0, self.scale, batch.max_seqlen_q)
            if (q.device.type == "cpu" and torch.compiler.is_compiling()
                    and self.compressor.entries_width(batch) > PADDED_ENTRIES_MAX):  # the entries the sequences hold
                oc, lsec = torch.ops.npu_cookbook.deepseek_v4_compressed_attention(*args)
                o, lse = ops.merge_attention_states(o, lse, oc, lsec)
            elif width := self.compressor.entries_width(batch):  # eager: the longest's; a graph: max_model_len's
                oc, lsec = compressed_attention(*args, width)
                o, lse = ops.merge_attention_states(o, lse, oc, lsec)
        o = ops.apply_attention_sinks(o, lse, self.attn_sink)  # [T, H, Dh]
        o = self.rope(o, cos, -sin)  # undo the keys' rotation carried into the values
        o = self.wo_a(o.reshape(T, self.groups, self.n_heads * self.head_dim // self.groups)).flatten(1)  # [T, G*R]
        return par.all_reduce(self.wo_b(o), self.tp_group)  # [T, D], summed over the heads of every TP rank


class GroupedLinear(nn.Module):
    """The grouped low-rank output projection o_a: G independent linears, each over its slice of the heads.
    weight [G*R, I] as the checkpoint stores it; x [T, G, I] -> [T, G, R]."""

    def __init__(self, in_per_group: int, out_per_group: int, groups: int):
        super().__init__()
        self.groups = groups
        self.weight = nn.Parameter(torch.empty(groups * out_per_group, in_per_group))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight.view(self.groups, -1, x.shape[-1])  # [G, R, I]
        o = torch.bmm(x.transpose(0, 1), w.transpose(1, 2))  # [G, T, R]
        # laid out [T, G, R] here (bmm and clone, not einsum, which guards a graph on T != 1)
        return o.transpose(0, 1).clone(memory_format=torch.contiguous_format)


def visible_entries(positions: torch.Tensor, seq_ids: torch.Tensor, cu_entries: torch.Tensor, ratio: int,
                    width: int) -> torch.Tensor:
    """HCA: every causally visible entry of the query's own sequence, as global rows; -1 pads. -> [T, width]"""
    visible = (positions + 1) // ratio  # [T]
    ar = torch.arange(width, device=visible.device)
    idx = cu_entries[:-1].long()[seq_ids, None] + ar  # [T, width]
    return torch.where(ar < visible[:, None], idx, -1)


def compressed_attention(q: torch.Tensor, entries: torch.Tensor, table: torch.Tensor, iq: torch.Tensor | None,
                         iweights: torch.Tensor | None, ikeys: torch.Tensor | None, itable: torch.Tensor | None,
                         seq_lens: torch.Tensor, positions: torch.Tensor, seq_ids: torch.Tensor,
                         cu_seqlens_q: torch.Tensor, ratio: int, topk: int, scale: float, max_seqlen_q: int,
                         width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The queries q [T, H, Dh] over their sequences' compressed entries (a compressor's cache `entries`, read
    through `table`), `width` >= 1 a sequence: CSA (iq given) attends the top-k entries the lightning indexer picks
    with iq [T, Hi, Di], iweights [T, Hi] over the index keys `ikeys` (through `itable`); HCA every visible entry.
    -> out [T, H, Dh] (q.dtype), lse [T, H] fp32."""
    kv, cu = gather_entries(entries, table, seq_lens, ratio, width)  # [B * Wc, Dh]
    if iq is not None:
        keys, cu_keys = gather_entries(ikeys, itable, seq_lens, ratio, width)  # [B * Wc, Di]
        idx = ops.lightning_indexer(iq, keys, iweights, cu_seqlens_q, cu_keys, (positions + 1) // ratio, topk,
                                    max_seqlen_q, width)  # [T, k], valid entries first
        idx = idx[:, :width]  # no query sees more
    else:
        idx = visible_entries(positions, seq_ids, cu, ratio, width)  # [T, Wc]
    kv = kv[:, None]  # [B * Wc, 1, Dh], K = V: one object, gathered once
    return ops.sparse_attention(q, kv, kv, idx, scale, return_lse=True)


def _compressed_attention_op(q: torch.Tensor, entries: torch.Tensor, table: torch.Tensor, iq: torch.Tensor | None,
                             iweights: torch.Tensor | None, ikeys: torch.Tensor | None, itable: torch.Tensor | None,
                             seq_lens: torch.Tensor, positions: torch.Tensor, seq_ids: torch.Tensor,
                             cu_seqlens_q: torch.Tensor, ratio: int, topk: int, scale: float, max_seqlen_q: int
                             ) -> tuple[torch.Tensor, torch.Tensor]:
    """compressed_attention as one opaque op of a compiled CPU graph: its outputs' shapes are the step's alone, and
    inside it the width is read on the host, the entries the step's longest sequence holds (no device sync on
    CPU), not max_seqlen_k / ratio (the bucket's max_model_len). No entry yet: an empty attention (lse -inf)."""
    width = int(seq_lens.max()) // ratio
    if not width:
        return torch.zeros_like(q), q.new_full(q.shape[:2], float("-inf"), dtype=torch.float32)
    return compressed_attention(q, entries, table, iq, iweights, ikeys, itable, seq_lens, positions, seq_ids,
                                cu_seqlens_q, ratio, topk, scale, max_seqlen_q, width)


def _compressed_attention_fake(q, *args):
    return torch.empty_like(q), q.new_empty(q.shape[:2], dtype=torch.float32)


if not hasattr(torch.ops.npu_cookbook, "deepseek_v4_compressed_attention"):  # (this file imported under two names)
    direct_register_custom_op("deepseek_v4_compressed_attention", _compressed_attention_op,
                              _compressed_attention_fake)


class Gate(nn.Module):
    """Router weights: logits = x @ weight.T; `bias` (selection only) or a frozen token -> experts table. A vision
    checkpoint adds `bias_vl` (selection only) on every layer: image tokens pick their experts by scores + bias_vl,
    on hash layers too (an image token's id says nothing about it)."""

    def __init__(self, args: ModelArgs, hash_routing: bool):
        super().__init__()
        E = args.n_routed_experts
        self.weight = nn.Parameter(torch.empty(E, args.hidden_size))
        if hash_routing:
            self.register_buffer("tid2eid", torch.zeros(args.vocab_size, args.num_experts_per_tok, dtype=torch.int32))
        else:
            self.bias = nn.Parameter(torch.zeros(E, dtype=torch.float32))
        self.bias_vl = nn.Parameter(torch.zeros(E, dtype=torch.float32)) if args.has_vision else None


class MoE(nn.Module):
    """Routed experts (top-k by scores + bias, or hash routing by token id) plus one shared expert; the routed
    experts sharded over moe_ep (this rank, ep_rank, holds experts [ep_rank * E/P, + E/P)).

    MoE offload (num_slots N): `experts` holds N resident slots (of this rank's E/P experts); `offload` (a
    common.offload ExpertOffload, set by the loader, in this rank's expert numbering) maps each routed pair (over
    ranks: each dispatched row) to its slot or to the host, which computes the others. `routing_counter` (a
    common.offload RoutingCounter, optional) counts the router's choices."""

    def __init__(self, args: ModelArgs, layer: int, parallel: par.Parallel, num_slots: int | None = None):
        super().__init__()
        self.ep_group, self.tp_group = parallel.group("moe_ep"), parallel.group("attn_tp")
        self.ep_size, self.ep_rank = parallel.size("moe_ep"), parallel.rank_in("moe_ep")
        self.tp_size, self.tp_rank = parallel.size("attn_tp"), parallel.rank_in("attn_tp")
        E = num_slots if num_slots is not None else args.n_routed_experts // self.ep_size
        self.layer = layer
        self.hash = args.mlp_layer_types[layer] == "hash_moe"
        self.args = args
        self.gate = Gate(args, self.hash)
        self.experts = Experts(args, E)  # this rank's E/P, or the N resident slots
        self.shared_experts = SharedExpert(args) if args.n_shared_experts else None
        self.offload = None  # common.offload.ExpertOffload, with num_slots
        self.routing_counter = None  # common.offload.RoutingCounter, to write a routing-count file

    def forward(self, x: torch.Tensor, input_ids: torch.Tensor, uniform: bool = False,
                seq_ids: torch.Tensor | None = None, image_mask: torch.Tensor | None = None) -> torch.Tensor:
        """x [T, D] (the same on every attention-TP rank) -> [T, D]. uniform: every rank runs T tokens (a
        graph-mode step), so the expert dispatch exchanges fixed-capacity buffers (no split read on the host).
        seq_ids [T]: each token's sequence in the batch (what dynamic expert placement counts by). image_mask [T]
        bool: the image tokens, routed by bias_vl (None: a text-only batch)."""
        if self.experts.w13_scale is not None:  # int8 experts: torch 2.13's region reuse fails on them (dynamo's
            return self._route(x, input_ids, uniform, seq_ids, image_mask)  # "Freevar has no source"): traced inline
        return self._route_region(x, input_ids, uniform, seq_ids, image_mask)

    def _route(self, x: torch.Tensor, input_ids: torch.Tensor, uniform: bool, seq_ids: torch.Tensor | None,
               image_mask: torch.Tensor | None) -> torch.Tensor:
        a = self.args
        runs = x.tensor_split(self.tp_size)  # each attention-TP rank routes its share of the tokens
        x_r, ids_r = runs[self.tp_rank], input_ids.tensor_split(self.tp_size)[self.tp_rank]  # [T_r, D], [T_r]
        logits = F.linear(x_r, self.gate.weight)  # [T_r, E]
        weights, idx = ops.moe_gating_topk(
            logits, a.num_experts_per_tok, bias=None if self.hash else self.gate.bias, score_func=a.scoring_func,
            renorm=a.norm_topk_prob, routed_scaling_factor=a.routed_scaling_factor,
            tid2eid=self.gate.tid2eid if self.hash else None, input_ids=ids_r if self.hash else None,
        )  # [T_r, k], [T_r, k]
        if image_mask is not None and self.gate.bias_vl is not None:
            weights, idx = self._route_images(logits, weights, idx, image_mask.tensor_split(self.tp_size)[self.tp_rank])
        if self.routing_counter is not None:
            self.routing_counter.add(self.layer, idx)
        if self.offload is not None and self.ep_group is None:
            return self._forward_offloaded(x_r, weights, idx, seq_ids)
        if self.offload is None and self.ep_size == 1 and cpu_moe.takes(self.experts.w13, self.experts.w2):  # CPU
            out = cpu_moe.fused_experts(x_r, self.experts.w13, self.experts.w2, weights, idx, a.swiglu_limit)
            if self.shared_experts is not None:
                out = (out.float() + self.shared_experts(x_r).float()).to(out.dtype)  # [T_r, D]
            return par.all_gather_v(out, [len(run) for run in runs], self.tp_group)  # [T, D]
        xs, row_idx, counts = ops.moe_init_routing(x_r, idx, a.n_routed_experts)  # [T_r*k, D] by global expert
        capacity = runs[0].shape[0] * a.num_experts_per_tok if uniform else None  # the largest share's rows: every
        #   rank's (tensor_split gives the first ranks one more token when T is not a multiple of attn_tp)
        xe, local_counts, handle = par.dispatch_to_experts(xs, counts, self.ep_group, capacity)  # [M, D] by expert
        if self.offload is not None:
            ye = self._offloaded_rows(xe, local_counts)  # [M, D]
        else:
            ye = self.experts.matmul(ops.swiglu(self.experts.matmul(xe, "w13", local_counts), a.swiglu_limit),
                                     "w2", local_counts)  # [M, D]
        y = par.combine_from_experts(ye, handle, self.ep_group)
        shared = self.shared_experts(x_r) if self.shared_experts is not None else None
        out = ops.moe_finalize_routing(y, weights, row_idx, shared)  # [T_r, D]
        return par.all_gather_v(out, [len(run) for run in runs], self.tp_group)  # [T, D]

    _route_region = compile_region(_route)  # one per kind of routing (hash, score)

    def _route_images(self, logits: torch.Tensor, weights: torch.Tensor, idx: torch.Tensor, image_mask: torch.Tensor):
        """Image tokens' experts re-picked by top-k of scores + bias_vl, their weights the unbiased scores renormalised
        and scaled (as upstream); text tokens' kept. logits [T, E], weights / idx [T, k], image_mask [T]."""
        a = self.args
        weights_vl, idx_vl = ops.moe_gating_topk(logits, a.num_experts_per_tok, bias=self.gate.bias_vl,
                                                 score_func=a.scoring_func, renorm=a.norm_topk_prob,
                                                 routed_scaling_factor=a.routed_scaling_factor)  # [T, k] x2
        mask = image_mask[:, None]
        return torch.where(mask, weights_vl, weights), torch.where(mask, idx_vl, idx)

    def _forward_offloaded(self, x: torch.Tensor, weights: torch.Tensor, idx: torch.Tensor,
                           seq_ids: torch.Tensor | None) -> torch.Tensor:
        """x [T, D], the router's weights / idx [T, k] -> [T, D]: the host experts submitted first, then the
        resident slots and the shared expert here, then the host's partial sum added."""
        a = self.args
        slots, slot_weights, ticket = self.offload.route(self.layer, x, idx, weights, seq_ids)  # [T, k] x2
        shared = self.shared_experts(x) if self.shared_experts is not None else torch.zeros_like(x)  # [T, D]
        if not self.offload.num_slots:  # every routed expert on the host
            return shared + self.offload.sync(self.layer, ticket, x)
        xs, row_idx, counts = ops.moe_init_routing(x, slots, self.offload.num_slots)  # [T*k, D] by slot
        h = ops.swiglu(self.experts.matmul(xs, "w13", counts), a.swiglu_limit)  # [T*k, I]
        y = self.experts.matmul(h, "w2", counts)  # [T*k, D]; host pairs: slot 0 times weight 0
        out = ops.moe_finalize_routing(y, slot_weights, row_idx, shared)  # [T, D]
        return out + self.offload.sync(self.layer, ticket, x)  # [T, D]

    def _offloaded_rows(self, xe: torch.Tensor, local_counts: torch.Tensor) -> torch.Tensor:
        """Expert parallel with offload: the rows dispatched here xe [M, D], grouped by this rank's expert
        (local_counts [E/P]; a graph step's padding rows last, past their sum) -> each row through its expert [M, D]
        (weight 1; the router's weights are applied after the combine): the host's rows submitted first, then the
        resident slots' here, then the host's added."""
        a, E_local = self.args, local_counts.shape[0]
        rows = torch.arange(xe.shape[0], device=xe.device)
        expert = torch.searchsorted(local_counts.cumsum(0), rows, right=True)  # [M]; E_local: padding
        ids = expert.clamp(max=E_local - 1).unsqueeze(1)  # [M, 1] this rank's expert (padding: its last, weight 0)
        ones = (expert < E_local).float().unsqueeze(1)  # [M, 1]
        slots, slot_weights, ticket = self.offload.route(self.layer, xe, ids, ones)  # [M, 1] x2
        if not self.offload.num_slots:  # every routed expert on the host
            return self.offload.sync(self.layer, ticket, xe)
        xs, row_idx, counts = ops.moe_init_routing(xe, slots, self.offload.num_slots)  # [M, D] by slot
        h = ops.swiglu(self.experts.matmul(xs, "w13", counts), a.swiglu_limit)  # [M, I]
        y = ops.moe_finalize_routing(self.experts.matmul(h, "w2", counts), slot_weights, row_idx)  # [M, D]
        return y + self.offload.sync(self.layer, ticket, xe)  # [M, D]


class SharedExpert(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        I, D = args.moe_intermediate_size, args.hidden_size
        self.w13 = linear(args, D, 2 * I, quantized=True)  # packs checkpoint w1 (gate) and w3 (up)
        self.w2 = linear(args, I, D, quantized=True)
        self.limit = args.swiglu_limit

    def forward(self, x):
        return self.w2(ops.swiglu(self.w13(x), self.limit))


@compile_region  # one compiled subgraph for every layer and site (its Sinkhorn steps unrolled once)
def hc_pre(x, fn, base, scale, n: int, iters: int, eps: float, norm_eps: float):
    """mHC weights from the n streams. x [T, n, D] -> (collapsed [T, D], post [T, n], comb [T, n, n])."""
    x32 = x.flatten(1).float()  # [T, n*D]; read again for the collapse (a bf16 * fp32 product converts per element)
    flat = ops.rms_norm(x32, None, norm_eps)  # [T, n*D]
    pre, post, comb = F.linear(flat, fn.float()).split([n, n, n * n], -1)
    pre_b, post_b, comb_b = base.split([n, n, n * n])
    pre = torch.sigmoid(pre * scale[0] + pre_b) + eps  # [T, n]
    post = 2 * torch.sigmoid(post * scale[1] + post_b)  # [T, n]
    comb = torch.softmax((comb * scale[2] + comb_b).view(-1, n, n), dim=-1) + eps  # [T, n, n]
    eps_t = comb.new_tensor(eps)  # same value; a 0-dim tensor operand dispatches ~2 us faster than a Python float
    comb = comb / (comb.sum(-2, keepdim=True) + eps_t)
    for _ in range(iters - 1):  # Sinkhorn-Knopp: towards a doubly-stochastic matrix
        comb = comb / (comb.sum(-1, keepdim=True) + eps_t)
        comb = comb / (comb.sum(-2, keepdim=True) + eps_t)
    collapsed = (pre.unsqueeze(-1) * x32.view(x.shape)).sum(1).to(x.dtype)  # [T, D]
    return collapsed, post, comb


def hc_post(out: torch.Tensor, x: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """Expand the block output into n streams and mix in the residual streams: [T, D] -> [T, n, D]."""
    mix = comb.to(x.dtype)  # [T, n, n]: mixed[i] = sum_j comb[j, i] x[j]
    # compiled: the bmm's math (fp32 products and sum, one rounding) as one fused loop; an extern bmm of n x n
    # matrices took 3.6x its time in a graph (T = 16, Xeon: 70 against 19 us). Summed over comb's rows as they lie
    # (a transposed view's unsqueeze would guard a graph over a symbolic T on T != 1)
    if torch.compiler.is_compiling():
        mixed = (mix.float().unsqueeze(-1) * x.float().unsqueeze(2)).sum(1).to(x.dtype)  # [T, n, D]
    else:
        mixed = mix.transpose(1, 2) @ x  # [T, n, D]
    return post.to(x.dtype).unsqueeze(-1) * out.unsqueeze(1) + mixed


class Block(nn.Module):
    def __init__(self, args: ModelArgs, layer: int, ropes: dict[str, Rope], parallel: par.Parallel,
                 num_slots: int | None = None):
        super().__init__()
        n = args.hc_mult
        self.args = args
        self.attn = Attention(args, layer, ropes, parallel)
        self.ffn = MoE(args, layer, parallel, num_slots)
        self.attn_norm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.ffn_norm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        for site in ("attn", "ffn"):
            self.register_parameter(f"hc_{site}_fn", nn.Parameter(torch.zeros((2 + n) * n, n * args.hidden_size, dtype=torch.float32)))
            self.register_parameter(f"hc_{site}_base", nn.Parameter(torch.zeros((2 + n) * n, dtype=torch.float32)))
            self.register_parameter(f"hc_{site}_scale", nn.Parameter(torch.ones(3, dtype=torch.float32)))

    def _hc(self, site: str, x):
        a = self.args
        p = lambda k: getattr(self, f"hc_{site}_{k}")  # noqa: E731
        return hc_pre(x, p("fn"), p("base"), p("scale"), a.hc_mult, a.hc_sinkhorn_iters, a.hc_eps, a.rms_norm_eps)

    def forward(self, x: torch.Tensor, batch: ForwardBatch, image_mask: torch.Tensor | None = None) -> torch.Tensor:
        """x [T, n, D] -> [T, n, D]; image_mask [T] bool: the image tokens (None: none)"""
        h, post, comb = self._hc("attn", x)
        x = hc_post(self.attn(self.attn_norm(h), batch), x, post, comb)
        h, post, comb = self._hc("ffn", x)
        out = self.ffn(self.ffn_norm(h), batch.input_ids, batch.uniform_across_ranks, batch.seq_ids, image_mask)
        return hc_post(out, x, post, comb)


def hc_head(x: torch.Tensor, fn, base, scale, hc_eps: float, norm_eps: float) -> torch.Tensor:
    """Collapse the n streams into one: x [T, n, D] -> [T, D], weights sigmoid(fn(rms(x)) * scale + base) + eps."""
    flat = ops.rms_norm(x.flatten(1).float(), None, norm_eps)  # [T, n*D]
    pre = torch.sigmoid(F.linear(flat, fn) * scale + base) + hc_eps  # [T, n]
    return (pre.unsqueeze(-1) * x).sum(1).to(x.dtype)  # [T, D]


def mtp_args(args: ModelArgs) -> ModelArgs:
    """The main model's args with the MTP blocks appended as layers L.. L+k-1: sliding-window attention only (as
    upstream runs them) and score-routed MoE, without bias_vl (the drafts route image tokens as text)."""
    k = args.num_nextn_predict_layers
    return dataclasses.replace(args, num_hidden_layers=args.num_hidden_layers + k,
                               layer_types=[*args.layer_types, *[SLIDING] * k],
                               mlp_layer_types=[*args.mlp_layer_types, *["moe"] * k], vision_config=None)


class MTPBlock(Block):
    """The publisher's multi-token-prediction layer (`mtp.<i>.*`): a decoder block (its `attn`, `ffn`, norms and
    mHC under the same names as a layer's) fed h_proj(hnorm(streams)) + e_proj(enorm(embedding of the next
    token)), where `streams` [T, n, D] are the main model's (or the previous draft's) last residual streams,
    before their hc_head; its own hc_head and `norm` then give the hidden state for the shared LM head."""

    def __init__(self, args: ModelArgs, index: int, ropes: dict[str, Rope], parallel: par.Parallel,
                 num_slots: int | None = None):
        margs = mtp_args(args)
        super().__init__(margs, args.num_hidden_layers + index, ropes, parallel, num_slots)
        n, D = args.hc_mult, args.hidden_size
        self.e_proj = nn.Linear(D, D, bias=False)
        self.h_proj = nn.Linear(D, D, bias=False)
        self.enorm, self.hnorm, self.norm = (RMSNorm(D, args.rms_norm_eps) for _ in range(3))
        self.hc_head_fn = nn.Parameter(torch.zeros(n, n * D, dtype=torch.float32))
        self.hc_head_base = nn.Parameter(torch.zeros(n, dtype=torch.float32))
        self.hc_head_scale = nn.Parameter(torch.ones(1, dtype=torch.float32))

    def forward(self, streams: torch.Tensor, embeds: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """streams [T, n, D] (position t's), embeds [T, D] (token t+1's) -> this block's streams [T, n, D]. The
        embedding at position 0 is zeroed, as upstream does (no token precedes it to predict from)."""
        embeds = torch.where(batch.positions.unsqueeze(-1) == 0, 0, embeds)
        x = self.h_proj(self.hnorm(streams)) + self.e_proj(self.enorm(embeds)).unsqueeze(1)  # [T, n, D]
        return super().forward(x, batch)

    def final_hidden(self, streams: torch.Tensor) -> torch.Tensor:
        """[T, n, D] -> the normed hidden state [T, D] for the shared head."""
        a = self.args
        h = hc_head(streams, self.hc_head_fn, self.hc_head_base, self.hc_head_scale, a.hc_eps, a.rms_norm_eps)
        return self.norm(h)


def check_layout(args: ModelArgs, layout: par.LLMParallelLayout) -> None:
    """ValueError unless the layout splits this model evenly (checked before any rank starts, and by the model)."""
    for size, name, what in ((layout.attn_tp, "attn_tp", {"attention heads": args.num_attention_heads,
                                                          "output groups": args.o_groups}),
                             (layout.moe_ep, "moe_ep", {"routed experts": args.n_routed_experts}),
                             (layout.embed_tp, "embed_tp", {"vocabulary rows": args.vocab_size}),
                             (layout.lmhead_tp, "lmhead_tp", {"vocabulary rows": args.vocab_size})):
        for thing, n in what.items():
            if n % size:
                raise ValueError(f"{name}={size} does not divide the model's {n} {thing}")


def check_offload(args: ModelArgs, layout: par.LLMParallelLayout, num_slots: int) -> None:
    """ValueError unless MoE offload with num_slots resident experts per layer can run this model and layout."""
    shard = args.n_routed_experts // layout.moe_ep
    if not 0 <= num_slots <= shard:
        raise ValueError(f"resident experts per layer must be in 0..{shard} (the model's routed experts"
                         + (f" over moe_ep {layout.moe_ep}: each rank's shard" if layout.moe_ep > 1 else "")
                         + f"), got {num_slots}")
    if args.quant_format is not None:
        raise ValueError(f"MoE offload reads the publisher's MXFP4 experts; this checkpoint is {args.quant_format}")


class DeepseekV4(nn.Module):
    """The main model; with `mtp`, also its num_nextn_predict_layers MTP blocks (`self.mtp`, for speculative
    decoding), which share the embedding and the LM head. offload_slots N: MoE offload, N resident experts per
    MoE layer (the MTP blocks' too), the rest on the host (`self.offload`, set by the loader). A vision checkpoint
    (Vision-Exp layout) adds the vision tower, aligner and span vectors (`self.vision_model`, replicated on every
    rank): image embeddings replace their placeholder rows before the residual streams split, and image tokens route
    by `bias_vl`."""

    def __init__(self, args: ModelArgs, parallel: par.Parallel | None = None, mtp: bool = False,
                 offload_slots: int | None = None):
        super().__init__()
        self.args = args
        self.parallel = parallel = parallel or par.Parallel(par.LLMParallelLayout())
        check_layout(args, parallel.layout)
        if offload_slots is not None:
            check_offload(args, parallel.layout, offload_slots)
        self.offload = None  # common.offload.ExpertOffload
        self.embed_group, self.head_group = parallel.group("embed_tp"), parallel.group("lmhead_tp")
        n, D = args.hc_mult, args.hidden_size
        ropes = make_ropes(args)
        self.embed = nn.Embedding(args.vocab_size // parallel.size("embed_tp"), D)  # this rank's rows
        self.vocab_start = parallel.rank_in("embed_tp") * self.embed.num_embeddings
        par.shard(self.embed.weight, 0, parallel, "embed_tp")
        self.layers = nn.ModuleList(Block(args, i, ropes, parallel, offload_slots)
                                    for i in range(args.num_hidden_layers))
        self.norm = RMSNorm(D, args.rms_norm_eps)
        self.hc_head_fn = nn.Parameter(torch.zeros(n, n * D, dtype=torch.float32))
        self.hc_head_base = nn.Parameter(torch.zeros(n, dtype=torch.float32))
        self.hc_head_scale = nn.Parameter(torch.ones(1, dtype=torch.float32))
        self.head = nn.Linear(D, args.vocab_size // parallel.size("lmhead_tp"), bias=False)  # this rank's rows
        par.shard(self.head.weight, 0, parallel, "lmhead_tp")
        k = args.num_nextn_predict_layers if mtp else 0
        self.mtp = nn.ModuleList(MTPBlock(args, i, ropes, parallel, offload_slots) for i in range(k))
        self.vision_model = None
        if args.has_vision:  # the vision files are read for a vision checkpoint only (a text-only copy drops them)
            from modeling_deepseek_vision import DeepseekVisionModel, VisionArgs

            self.vision_model = DeepseekVisionModel(VisionArgs.from_config({"vision_config": args.vision_config,
                                                                            "hidden_size": D}))

    def moe_layers(self) -> dict[int, MoE]:
        """Every MoE by its layer index: the main layers 0..L-1, then the MTP blocks' L.. ."""
        return {block.ffn.layer: block.ffn for block in [*self.layers, *self.mtp]}

    def record_routing(self, counter) -> None:
        """Count every MoE layer's routed (token, expert) pairs into `counter` (a common.offload.RoutingCounter,
        whose file FrequencyPlacement reads); None stops counting."""
        for moe in self.moe_layers().values():
            moe.routing_counter = counter

    def engine_contract(self) -> ModelContract:
        """What the engine may use of this model: its MTP blocks when loaded (this model is their MTPDraftModel),
        its vision encoder stage (a vision checkpoint), and with MoE offload the end-of-prefill hook (dynamic expert
        placement takes the experts of the sequences whose prompt prefill ended as the resident set)."""
        a = self.args
        encoder = None
        if self.vision_model is not None:
            from image_processor_deepseek import DeepseekImageProcessor, ImageProcessorConfig
            from modeling_deepseek_vision import VisionEncoder

            processor = DeepseekImageProcessor(ImageProcessorConfig.from_config({"vision_config": a.vision_config}),
                                               a.image_token_id, self.embed.weight.dtype)
            encoder = VisionEncoder(self.vision_model, processor)
        w = self.embed.weight
        return ModelContract(a.max_position_embeddings, a.vocab_size, tuple(a.eos_token_ids), a.hidden_size, w.dtype,
                             w.device, self.parallel, mtp=self if len(self.mtp) else None, encoder=encoder,
                             finish_prefill=self.offload.finish_prefill if self.offload is not None else None)

    def cache_owners(self) -> list[tuple[str, nn.Module]]:
        """(name, module) of every module holding caches, in a fixed order: per layer (the MTP blocks' too) its
        attention, compressor and indexer's compressor."""
        return [owner for prefix, blocks in (("layers", self.layers), ("mtp", self.mtp))
                for i, block in enumerate(blocks) for owner in block.attn.cache_owners(f"{prefix}.{i}.attn")]

    def cache_tensor_specs(self) -> list[CacheTensorSpec]:
        """Every cache tensor, in a fixed order: per layer (the MTP blocks' too) the sliding-window KV, then each
        compressor's per-token state (window group) and compressed entries (the group of its ratio)."""
        return [spec for name, module in self.cache_owners() for spec in module.cache_tensor_specs(name)]

    def cache_specs(self, block_size: int) -> list[CacheGroupSpec]:
        """One token-level window group (KV + compressor state) and one compressed group per compress ratio."""
        tensors = self.cache_tensor_specs()
        ratios = sorted({s.tokens_per_row for s in tensors} - {1})
        if any(block_size % r for r in ratios):
            raise ValueError(f"block_size {block_size} must be a multiple of every compress ratio {ratios}")
        keep = max(s.window for s in tensors if s.group == WINDOW)
        return [CacheGroupSpec(WINDOW, block_size, keep)] + [CacheGroupSpec(compressed_group(r), block_size) for r in ratios]

    def bind_caches(self, tensors: dict[str, torch.Tensor], tables: dict[str, str] | None = None) -> None:
        """Give the model its cache tensors by CacheTensorSpec name, each [num_blocks, rows a block, 1, width]
        (the engine's, or vLLM's through the plugin). tables: the ForwardBatch block table (and slot mapping) each
        tensor reads, by name; by default its spec's group. Any mapping is honoured: the blocks of each tensor hold
        its own shape[1] rows, so tensors that read different tables may have different block sizes."""
        specs = self.cache_tensor_specs()
        check_cache_tensors(specs, tensors)
        for s in specs:
            path, attr = s.name.rsplit(".", 1)
            module = self.get_submodule(path)
            setattr(module, attr, tensors[s.name])
            module.cache_table[attr] = (tables or {}).get(s.name, s.group)

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """-> final hidden states [T, D] (feed the rows you need to `compute_logits`)."""
        return self.final_hidden(self.residual_streams(batch))

    def embed_tokens(self, input_ids: torch.Tensor, uniform: bool = False) -> torch.Tensor:
        """[T] -> [T, D]; uniform: every rank embeds T tokens (a graph-mode step: no sizes exchanged)."""
        return par.vocab_parallel_embedding(input_ids, self.embed, self.vocab_start, self.embed_group,
                                            uniform)  # [T, D]

    def residual_streams(self, batch: ForwardBatch) -> torch.Tensor:
        """The last layer's n residual streams [T, n, D], before hc_head (what the MTP blocks read). Image rows
        (batch.mm_rows) take their encoder embeddings before the streams split."""
        x = self.embed_tokens(batch.input_ids, batch.uniform_across_ranks)  # [T, D]
        image_mask = None
        if batch.mm_rows is not None:
            x = x.index_copy(0, batch.mm_rows, batch.mm_embeds.to(x.dtype))  # [T, D]
            image_mask = torch.zeros(x.shape[0], dtype=torch.bool, device=x.device).index_fill_(0, batch.mm_rows, True)
        x = x.unsqueeze(1).expand(-1, self.args.hc_mult, -1).contiguous()  # [T, n, D]
        for layer in self.layers:
            x = layer(x, batch, image_mask)  # [T, n, D]
        return x

    def final_hidden(self, streams: torch.Tensor) -> torch.Tensor:
        """[T, n, D] -> the normed hidden state [T, D] for the LM head."""
        a = self.args
        h = hc_head(streams, self.hc_head_fn, self.hc_head_base, self.hc_head_scale, a.hc_eps, a.rms_norm_eps)
        return self.norm(h)

    def compute_logits(self, hidden: torch.Tensor, uniform: bool = False) -> torch.Tensor:
        """[N, D] -> [N, V] fp32; uniform: every rank scores N rows (a graph-mode step)."""
        return par.vocab_parallel_logits(hidden, self.head, self.head_group, uniform).float()  # [N, V]

    # MTPDraftModel (common/engine/model_contract.py): the MTP blocks, fed the main model's residual streams
    @property
    def num_draft_layers(self) -> int:
        return len(self.mtp)

    def empty_streams(self) -> torch.Tensor:
        w = self.embed.weight
        return w.new_zeros(0, self.args.hc_mult, self.args.hidden_size)  # [0, n, D]

    def draft_streams(self, layer: int, streams: torch.Tensor, input_ids: torch.Tensor,
                      batch: ForwardBatch) -> torch.Tensor:
        return self.mtp[layer](streams, self.embed_tokens(input_ids), batch)  # [T, n, D]

    def draft_logits(self, layer: int, streams: torch.Tensor) -> torch.Tensor:
        return self.compute_logits(self.mtp[layer].final_hidden(streams))  # [B, V]
