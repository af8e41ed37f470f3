"""Deployment plan for DeepSeek-V4 and DeepSeek-V3 (MLA), without weights: what one rank holds and how much KV
cache fits beside it.

    python tools/plan.py --config configs/atlas-a3-flash.yaml [--model flash|pro|tiny|v3|v3-tiny] [--weights DIR]
                   [--dtype bf16|fp16|fp32|auto] [--world-size N] [--device a3|910b|950dt|h200|300i-duo|none]
                   [--device-memory-gib G] [--reserve-fraction F]
    python tools/plan.py --config configs/single-device-flash-offload.yaml [--offload-experts N] [--device ...]
                   [--graph-headroom-gib G]
    python tools/plan.py --config configs/atlas-300i-duo-v3-tp8-ep32.yaml   # DeepSeek-V3 671B, 20 x Atlas 300I Duo
    python tools/plan.py --config configs/atlas-a3-v3.yaml                   # DeepSeek-V3 671B, 16 Atlas A3 dies

The model is built on the meta device (nothing is allocated) for the real config and the preset's parallel layout,
as rank 0 of that layout (a Parallel without process groups; every rank holds the same amount). Printed, per rank:
- weight bytes by part (attention, routed experts, shared expert + router, embedding, LM head, mHC / norms) in the
  preset's dtype, and as upstream's converter stores them for W8A8 (int8 weights + one fp32 scale per output
  channel on the attention `wq_b` / `wo_b`, the indexer's `wq_b` and every expert, routed and shared) and W4A8
  (the same, with the routed experts int4: two per byte, a uint64 scale and an fp32 bias per output channel);
- KV-cache bytes per token of each cache group (common.kv_cache's `cache_bytes_per_block` of the model's cache
  tensor specs, over block_size, in the model's dtype). Attention DP does not split the cache (each rank holds its
  own requests' whole cache) and under attention TP the single KV head is replicated, so this is also what every
  rank holds per token of its requests;
- the tokens of KV that fit in one die after the weights, leaving `--reserve-fraction` of the die for activations
  and workspace, as the engine sizes its cache (common/engine/model_runner.blocks_that_fit: the window group
  holds what max_num_seqs requests use at once, the compressed groups the rest); whether the preset's
  kv_cache_memory_bytes (or num_blocks) fits beside the weights; the smallest
  power-of-two world size (the preset's layout, experts over all ranks) at which the weights fit at all.
The MLA family (a config whose model_type is deepseek_v3, deepseek_v32 or kimi_k2; `--model v3` is the published
DeepSeek-V3 / R1 671B): parts attention, routed experts, shared expert + router, dense MLP (the first
first_k_dense_replace layers), embedding, LM head, norms; the quantized column is W8A8 as convert_checkpoint.py
writes it and the recipe loads it (int8 + an fp32 scale per output channel on every linear but kv_b_proj, routed
and shared experts included; the router fp32), counted on that model built on the meta device; the cache is one
"latent" group (kv_lora_rank + qk_rope_head_dim values a layer a token, replicated over attention TP).
With MoE offload (--offload-experts N, or the preset's moe_offload; one device, moe_ep 1): the device holds N
resident experts per MoE layer, the host every layer's routed experts once in MXFP4 (0.53125 bytes a weight);
a table per single device (one A3 die, one 910B, one Ascend 950DT, one H200; or --device's) gives the device
bytes (attention with embedding / head / mHC, shared expert + router, resident experts, the preset's KV
budget, graph headroom), what is left, the largest N that fits, and the host bytes.
Not counted: the MTP layer (`mtp.0`, a whole decoder layer; the model here does not build it), upstream's int8
indexer cache (A8C8 on A3) and FP8 KV cache (C8 on 950), and o_proj TP (upstream splits wo_a for Pro on A3).
Bad options: one line on stderr, exit code 2.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the recipe's modules (a tool runs from tools/)
from common import backend
from common import parallel as par
from common.engine import EngineConfig
from common.engine.model_runner import blocks_that_fit
from common.kv_cache import cache_bytes_per_block
import config_deepseek_v3
import tiny_deepseek_v3
from cli_deepseek import DTYPES, HERE, ArgumentParser, parallel_layout, read_preset
from config_deepseek_v4 import ModelArgs
from modeling_deepseek_v3 import LATENT, DeepseekV3
from modeling_deepseek_v4 import WINDOW, DeepseekV4
from weights_deepseek_v4 import torch_default_dtype
from tiny_deepseek_v4 import TINY_CONFIG

GiB = 2**30

# DeepSeek-V4-Flash: huggingface.co/deepseek-ai/DeepSeek-V4-Flash config.json (2026), the fields ModelArgs reads,
# as reproduced verbatim in public copies of that file (a GitHub port's audit log quoting the resolve/main URL, and
# several config fixtures). transformers.DeepseekV4Config() defaults agree on every dimension here but not on the
# layer kinds: they give HCA to layers 0-2, the published compress_ratios make layers 0-1 sliding-window only.
# compress_ratios has 44 entries: the 43 layers, then the MTP layer (0), which ModelArgs.from_config drops.
FLASH_CONFIG = dict(
    vocab_size=129280, hidden_size=4096, moe_intermediate_size=2048, num_hidden_layers=43, num_attention_heads=64,
    num_key_value_heads=1, head_dim=512, q_lora_rank=1024, qk_rope_head_dim=64, num_experts_per_tok=6,
    n_routed_experts=256, n_shared_experts=1, scoring_func="sqrtsoftplus", norm_topk_prob=True,
    routed_scaling_factor=1.5, max_position_embeddings=1048576, rope_theta=10000, compress_rope_theta=160000,
    rope_scaling={"beta_fast": 32, "beta_slow": 1, "factor": 16, "original_max_position_embeddings": 65536,
                  "type": "yarn"},
    compress_ratios=[0, 0] + [4, 128] * 20 + [4, 0], num_hash_layers=3, hc_mult=4, hc_sinkhorn_iters=20,
    hc_eps=1e-6, swiglu_limit=10.0, sliding_window=128, o_groups=8, o_lora_rank=1024, index_n_heads=64,
    index_head_dim=128, index_topk=512, num_nextn_predict_layers=1, rms_norm_eps=1e-6, bos_token_id=0,
    eos_token_id=1, tie_word_embeddings=False,
)
# DeepSeek-V4-Pro: huggingface.co/deepseek-ai/DeepSeek-V4-Pro config.json, as reproduced in public copies (the
# mirror huggingface.co/SinterForge/DeepSeek-V4-Pro/blob/main/config.json, and config dicts in GitHub code that
# embed the whole file); 61 layers + the MTP layer in compress_ratios (62 entries).
PRO_CONFIG = dict(
    FLASH_CONFIG, hidden_size=7168, moe_intermediate_size=3072, num_hidden_layers=61, num_attention_heads=128,
    q_lora_rank=1536, n_routed_experts=384, routed_scaling_factor=2.5, o_groups=16, index_topk=1024,
    compress_ratios=[128, 128] + [4, 128] * 29 + [4, 0],
)
# DeepSeek-V3 / R1 (671B): huggingface.co/deepseek-ai/DeepSeek-V3 config.json, the fields ModelArgs reads; every
# dimension equals transformers.DeepseekV3Config()'s default (which describes this model), and R1 and V3-0324 (the
# 310P deployment's model) share them. Its FP8 quantization_config is left out: the plan counts the weights in the
# preset's dtype and as convert_checkpoint.py's W8A8 stores them.
V3_CONFIG = dict(
    model_type="deepseek_v3", vocab_size=129280, hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048,
    num_hidden_layers=61, num_attention_heads=128, num_key_value_heads=128, q_lora_rank=1536, kv_lora_rank=512,
    qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, n_routed_experts=256, n_shared_experts=1,
    num_experts_per_tok=8, n_group=8, topk_group=4, first_k_dense_replace=3, scoring_func="sigmoid",
    topk_method="noaux_tc", norm_topk_prob=True, routed_scaling_factor=2.5, max_position_embeddings=163840,
    rope_theta=10000, rope_scaling={"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096,
                                    "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0},
    num_nextn_predict_layers=1, rms_norm_eps=1e-6, bos_token_id=0, eos_token_id=1, tie_word_embeddings=False,
)
MODELS = {  # --model -> (label, config.json fields, where they come from)
    "flash": ("DeepSeek-V4-Flash", FLASH_CONFIG, "HF deepseek-ai/DeepSeek-V4-Flash config.json"),
    "pro": ("DeepSeek-V4-Pro", PRO_CONFIG, "HF deepseek-ai/DeepSeek-V4-Pro config.json"),
    "tiny": ("tiny DeepSeek-V4", TINY_CONFIG, "tiny_deepseek_v4.TINY_CONFIG"),
    "v3": ("DeepSeek-V3 671B", V3_CONFIG, "HF deepseek-ai/DeepSeek-V3 config.json"),
    "v3-tiny": ("tiny DeepSeek-V3", tiny_deepseek_v3.TINY_CONFIG, "tiny_deepseek_v3.TINY_CONFIG"),
}


@dataclass(frozen=True)
class Device:
    name: str
    memory_gib: float
    source: str


# HBM per device (one rank each), read as GiB (2^30 bytes); if the vendors' "GB" means 10^9 bytes the usable
# memory is 6.9% less (pass --device-memory-gib 59.6 / 134.1).
# - Atlas A3: 2 dies per NPU, each die one device and one rank (Huawei's HCCL guide, rank table for Atlas A3:
#   hiascend.com/document/detail/zh/canncommercial/850/commlib/hcclug/hcclug_000066.html), 64 GB HBM per die
#   (SGLang's Ascend NPU reference, docs.sglang.io/docs/hardware-platforms/ascend-npus/ascend_npu_reference:
#   "Atlas 800I A3 (A3) | Ascend 910C | 16 | 2 | 8(cards) x 2(dies/card) x 64(GB/die)").
# - Ascend 950DT: 144 GB (HiZQ 2.0 HBM, 4 TB/s), from Huawei's Ascend roadmap at Huawei Connect 2025 (Eric Xu's
#   keynote, 2025-09-18) as the press reported it: The Register (mirrored at news.najib.digital/huawei-s-ai-
#   accelerator-roadmap-claims-it-to-makes-the-mightiest-clusters-94625.html: "the 950DT ... 144GB of 4 TB/s
#   memory"), el.whatpsu.com/articles/2274-Huawei-Ascend-950-AI-Accelerator-Revealed-in-New-Image. No Huawei
#   datasheet with the number was found.
# - Ascend 910B: 64 GB HBM per device (the Atlas 800I A2's 8 x 64 GB; hicann/cann-recipes-infer's single-NPU
#   MoE-offload recipe: "A3 or 910B, 64 GB HBM").
# - H200: 141 GB HBM3e (NVIDIA's H200 datasheet).
# - Atlas 300I Duo: two Ascend 310P chips a card, 96 GB LPDDR4X a card (408 GB/s), 48 GB a chip, each chip a rank
#   (upstream's 310P deployment: 20 cards, `mpiexec --np 32`). The chip split from the card's teardown as reported
#   by elektronikpraxis.de ("Huawei zeigt mit der Atlas 300i Duo ...": "zwei Ascend-GPUs, je 48 GB LPDDR4X") and
#   from openEuler's DeepSeek-R1 deployment guide for this card ("Atlas 300I Duo 四卡八芯（8*48G）": four cards,
#   eight chips, 8 x 48 GB). No Huawei datasheet with the number was found here.
DEVICES = {
    "a3": Device("Atlas A3 die", 64, "SGLang Ascend NPU reference: 64 GB per die"),
    "910b": Device("Ascend 910B", 64, "Atlas 800I A2: 8 x 64 GB HBM"),
    "950dt": Device("Ascend 950DT", 144, "Huawei Connect 2025 roadmap: 144 GB HiZQ 2.0"),
    "h200": Device("NVIDIA H200", 141, "NVIDIA H200 datasheet: 141 GB HBM3e"),
    "300i-duo": Device("Atlas 300I Duo chip", 48, "96 GB LPDDR4X a card, two 310P chips of 48 GB"),
}
SINGLE_DEVICES = ("a3", "910b", "950dt", "h200")  # the MoE-offload table's devices when --device gives none
GRAPH_HEADROOM_GIB = 0.27  # upstream's measured graph memory on one A3 die (single-NPU offload recipe, K=32)
MXFP4_BYTES_PER_WEIGHT = 17 / 32  # 32 e2m1 nibbles (16 bytes) + one e8m0 scale byte

# A tensor's part: the first rule whose pattern its state_dict name matches.
PART_RULES = (("vision tower + aligner", r"^vision_model\."),  # Vision-Exp: the ViT, aligner, image span vectors
              ("embedding", r"^embed\."), ("LM head", r"^head\."), ("routed experts", r"\.ffn\.experts\."),
              ("shared expert + router", r"\.ffn\.(shared_experts|gate)\."), ("attention", r"\.attn\."),
              ("mHC / norms", ""))  # hc_* (per layer and head), attn_norm / ffn_norm, the final norm
PARTS = ("attention", "routed experts", "shared expert + router", "embedding", "LM head", "mHC / norms",
         "vision tower + aligner")
VISION_PART = PARTS[-1]  # zero for a text-only checkpoint (V4-Flash): the report leaves the row out
SCHEMES = ("W8A8", "W4A8")  # after the preset's dtype
# What upstream's converter quantizes (hicann/cann-recipes-infer models/deepseek_v4/utils/convert_model.py,
# generate_quant_layers and int_weight_quant, --quant_type w8a8-int / w4a8-int): 8-bit per-channel weights on the
# attention wq_b / wo_b, the CSA indexer's wq_b and the shared expert, routed experts 8-bit (W8A8) or 4-bit (W4A8);
# wq_a, wkv, wo_a, the compressors, the indexer's weights_proj, the router, embedding and head stay 16-bit.
_INT8 = re.compile(r"(\.attn\.(wq_b|wo_b)\.weight|\.attn\.indexer\.wq_b\.weight|\.ffn\.shared_experts\.w(13|2)\.weight"
                   r"|\.ffn\.experts\.w(13|2))$")
_ROUTED = re.compile(r"\.ffn\.experts\.w(13|2)$")


def part_of(name: str, rules=PART_RULES) -> str:
    return next(part for part, pattern in rules if re.search(pattern, name))


def quantized_bytes(name: str, t: torch.Tensor, scheme: str) -> int:
    """Bytes of one tensor as upstream's converter stores it: per output channel (a row of the last dim), int8 +
    an fp32 scale; W4A8 routed experts: int4 packed two a byte + a uint64 scale + an fp32 bias."""
    if not _INT8.search(name):
        return t.nbytes
    rows = t.numel() // t.shape[-1]
    if scheme == "W4A8" and _ROUTED.search(name):
        return t.numel() // 2 + rows * (8 + 4)
    return t.numel() + rows * 4


def weight_bytes(model: torch.nn.Module) -> dict[str, dict[str, int]]:
    """{part: {"dtype" | scheme: bytes}} over the model's state_dict (parameters and persistent buffers)."""
    out = {p: dict.fromkeys(("dtype",) + SCHEMES, 0) for p in PARTS}
    for name, t in model.state_dict().items():
        row = out[part_of(name)]
        row["dtype"] += t.nbytes
        for s in SCHEMES:
            row[s] += quantized_bytes(name, t, s)
    return out


def build_rank0(args: ModelArgs, layout: par.LLMParallelLayout, dtype: torch.dtype, device="meta",
                offload_slots: int | None = None) -> DeepseekV4:
    """Rank 0's slice of the model for `layout` (no process groups: sizes from the layout, rank 0 in each);
    offload_slots N: MoE offload, N resident experts per layer (one device)."""
    with torch_default_dtype(dtype), torch.device(device):
        return DeepseekV4(args, par.Parallel(layout), offload_slots=offload_slots)


# The MLA family (DeepSeek-V3 / R1, V3.2, Kimi-K2): its parts, and W8A8 as convert_checkpoint.py stores it and
# weights_deepseek_v3 loads it (every linear of a layer but kv_b_proj and V3.2's indexer int8 with an fp32 scale per
# output channel, routed experts too; router fp32; embedding, head, norms and kv_b_proj in the dtype): counted on
# the W8A8 model itself, built on the meta device like the float one.
MLA_PART_RULES = (("embedding", r"^model\.embed_tokens\."), ("LM head", r"^lm_head\."),
                  ("routed experts", r"\.mlp\.experts\."),
                  ("shared expert + router", r"\.mlp\.(shared_experts|gate)\."),
                  ("dense MLP", r"\.mlp\."),  # the first first_k_dense_replace layers
                  ("attention", r"\.self_attn\."),  # its projections and latent norms (q_a_ / kv_a_layernorm)
                  ("norms", ""))  # input / post-attention norms, the final norm
MLA_PARTS = ("attention", "routed experts", "shared expert + router", "dense MLP", "embedding", "LM head", "norms")
MLA_SCHEMES = ("W8A8",)


def build_rank0_mla(args, layout: par.LLMParallelLayout, dtype: torch.dtype, device="meta",
                    offload_slots: int | None = None) -> DeepseekV3:
    if offload_slots is not None:
        raise ValueError("MoE offload plans DeepSeek-V4 only")
    with torch_default_dtype(dtype), torch.device(device):
        return DeepseekV3(args, par.Parallel(layout))


def mla_weight_bytes(args, layout: par.LLMParallelLayout, dtype: torch.dtype, model) -> dict[str, dict[str, int]]:
    """{part: {"dtype" | "W8A8": bytes}}: `model`'s state_dict, and the W8A8 model's for the same layout."""
    int8 = build_rank0_mla(dataclasses.replace(args, quant_format="w8a8"), layout, dtype)
    out = {p: dict.fromkeys(("dtype",) + MLA_SCHEMES, 0) for p in MLA_PARTS}
    for column, m in (("dtype", model), ("W8A8", int8)):
        for name, t in m.state_dict().items():
            out[part_of(name, MLA_PART_RULES)][column] += t.nbytes
    return out


@dataclass(frozen=True)
class Architecture:
    """What the plan needs of a model family: its config, rank 0's slice, its parts and its quantized columns."""
    name: str
    model_args: Callable  # config.json fields -> ModelArgs
    build: Callable  # (args, layout, dtype, device, offload_slots) -> rank 0's model
    parts: tuple[str, ...]
    schemes: tuple[str, ...]  # the columns after the preset's dtype
    weight_bytes: Callable  # (args, layout, dtype, rank 0's model) -> {part: {"dtype" | scheme: bytes}}


V4_ARCH = Architecture("DeepSeek-V4", ModelArgs.from_config, build_rank0, PARTS, SCHEMES,
                       lambda args, layout, dtype, model: weight_bytes(model))
MLA_ARCH = Architecture("MLA", config_deepseek_v3.ModelArgs.from_config, build_rank0_mla, MLA_PARTS, MLA_SCHEMES,
                        mla_weight_bytes)


def architecture(cfg: dict) -> Architecture:
    """The MLA family by config.json's model_type, else DeepSeek-V4 (whose published configs name none)."""
    return MLA_ARCH if cfg.get("model_type") in config_deepseek_v3.MODEL_TYPES else V4_ARCH


def host_expert_bytes(args: ModelArgs) -> int:
    """MoE offload's host copy: every MoE layer's routed experts (the MTP layer not counted), once, in MXFP4."""
    weights = args.num_hidden_layers * args.n_routed_experts * 3 * args.hidden_size * args.moe_intermediate_size
    return int(weights * MXFP4_BYTES_PER_WEIGHT)


def scaled_layout(layout: par.LLMParallelLayout, world: int) -> par.LLMParallelLayout:
    """The layout on `world` ranks: experts over all of them, each TP size capped to what `world` allows."""
    return par.LLMParallelLayout(world_size=world, **{k: math.gcd(getattr(layout, k), world)
                                                      for k in ("attn_tp", "moe_tp", "embed_tp", "lmhead_tp")})


def min_world_size(arch: Architecture, args, layout: par.LLMParallelLayout, dtype, budget: int,
                   upto: int = 256) -> dict:
    """{"dtype" | scheme: the smallest power-of-two world size whose per-rank weights fit in `budget`, or None}."""
    found = {}
    world = 1
    columns = ("dtype",) + arch.schemes
    while world <= upto and len(found) < len(columns):
        try:
            scaled = scaled_layout(layout, world)
            rows = arch.weight_bytes(args, scaled, dtype, arch.build(args, scaled, dtype))
        except ValueError:  # the model does not split that way (e.g. more ranks than experts)
            break
        totals = {c: sum(row[c] for row in rows.values()) for c in columns}
        for c, n in totals.items():
            if c not in found and n <= budget:
                found[c] = world
        world *= 2
    return {c: found.get(c) for c in columns}


@dataclass
class Plan:
    label: str
    source: str
    layout: par.LLMParallelLayout
    dtype: torch.dtype
    block_size: int
    weights: dict[str, dict[str, int]]
    kv_per_token: dict[str, float]
    kv_per_block: dict[str, int]
    model: object  # rank 0's slice, on the meta device
    engine_limits: tuple[int, int, int]  # max_num_seqs, max_num_batched_tokens, max_model_len
    arch: Architecture = V4_ARCH
    offload_slots: int | None = None  # MoE offload: resident experts per layer
    host_bytes: int = 0  # MoE offload: the host's MXFP4 experts

    def total(self, column: str) -> int:
        return sum(row[column] for row in self.weights.values())

    @property
    def columns(self) -> tuple[str, ...]:
        return ("dtype",) + self.arch.schemes

    def preset_cache_bytes(self, engine: dict) -> int:
        """The preset's cache on one rank: num_blocks blocks when it fixes them, else kv_cache_memory_bytes (256 MiB
        when it names neither, the engine's default)."""
        if engine.get("num_blocks"):
            return int(engine["num_blocks"]) * sum(self.kv_per_block.values())
        return int(engine.get("kv_cache_memory_bytes", 256 * 2**20))

    def tokens_engine(self, budget: int) -> int:
        """Tokens of one rank's requests that the engine's cache holds in `budget` bytes (blocks_that_fit)."""
        if budget <= 0:
            return 0
        config = EngineConfig(block_size=self.block_size, max_num_seqs=self.engine_limits[0],
                              max_num_batched_tokens=self.engine_limits[1], kv_cache_memory_bytes=budget,
                              max_model_len=self.engine_limits[2])
        blocks = blocks_that_fit(self.model, config)
        full = [blocks[s.name] for s in self.model.cache_specs(self.block_size) if s.sliding_window is None]
        return (min(full) - 1) * self.block_size


def plan(cfg: dict, label: str, source: str, layout: par.LLMParallelLayout, dtype: torch.dtype, engine: dict,
         device="meta", offload_slots: int | None = None) -> tuple[Plan, ModelArgs]:
    """Rank 0 of `layout` for the config.json fields `cfg`: its weights, and its caches per block of the preset's
    block_size (arithmetic from the model's cache tensor specs: nothing is allocated)."""
    arch = architecture(cfg)
    args = arch.model_args(cfg)
    model = arch.build(args, layout, dtype, device, offload_slots)
    bs = int(engine.get("block_size", 16))
    sizes = cache_bytes_per_block(model.cache_tensor_specs(), bs, model.engine_contract().dtype)
    per_block = {g.name: sizes[g.name] for g in model.cache_specs(bs)}  # {group: bytes of one block, all layers}
    limits = (int(engine.get("max_num_seqs", 32)), int(engine.get("max_num_batched_tokens", 1024)),
              int(engine.get("max_model_len") or args.max_position_embeddings))
    return Plan(label, source, layout, dtype, bs, arch.weight_bytes(args, layout, dtype, model),
                {g: n / bs for g, n in per_block.items()}, per_block, model, limits, arch, offload_slots,
                host_expert_bytes(args) if offload_slots else 0), args


def single_device_rows(p: Plan, args: ModelArgs, device: Device, reserve: float, kv_bytes: int,
                       graph_headroom: int) -> dict[str, dict[str, int | str]]:
    """MoE offload on one device: {row: {column: bytes (or text)}} for the dtype and the quantized columns."""
    cols = ("dtype",) + SCHEMES
    rows = {"attention, embedding, head, mHC": {}, "shared expert + router": {},
            f"resident experts ({p.offload_slots} x {args.num_hidden_layers} layers)": {},
            "KV cache (preset budget)": {}, "graph headroom": {}, "device total": {},
            f"left of {device.memory_gib:g} GiB less {reserve:.0%}": {}, "largest N that fits": {}}
    usable = int(device.memory_gib * GiB * (1 - reserve))
    names = list(rows)
    for c in cols:
        resident = p.weights["routed experts"][c]
        shared = p.weights["shared expert + router"][c]
        rest = p.total(c) - resident - shared
        total = p.total(c) + kv_bytes + graph_headroom
        per_slot = resident // p.offload_slots
        room = usable - (total - resident)
        values = [rest, shared, resident, kv_bytes, graph_headroom, total, usable - total,
                  str(min(max(room // per_slot, 0), args.n_routed_experts)) if room > 0 else "no fit"]
        for name, v in zip(names, values):
            rows[name][c] = v
    return rows


def single_device_report(p: Plan, args: ModelArgs, devices: list[Device], reserve: float, kv_bytes: int,
                         graph_headroom: int) -> str:
    dtype_name = {v: k for k, v in DTYPES.items() if v is not None}[p.dtype]
    heads = (dtype_name,) + SCHEMES
    lines = ["", f"MoE offload: one device + host, {p.offload_slots} resident experts per MoE layer of "
                 f"{args.n_routed_experts} (moe_ep 1)",
             f"host: every layer's {args.n_routed_experts} routed experts once in MXFP4 "
             f"({args.num_hidden_layers} layers x {args.n_routed_experts} x "
             f"{gib(p.host_bytes // (args.num_hidden_layers * args.n_routed_experts)).strip()}): "
             f"{gib(p.host_bytes).strip()} of host memory"]
    for device in devices:
        lines += ["", f"one {device.name}: {device.memory_gib:g} GiB ({device.source})",
                  f"{'':<40}" + "".join(f"{h:>14}" for h in heads)]
        for name, row in single_device_rows(p, args, device, reserve, kv_bytes, graph_headroom).items():
            cells = [v if isinstance(v, str) else gib(v) for v in row.values()]
            lines.append(f"  {name:<38}" + "".join(f"{c:>14}" for c in cells))
    return "\n".join(lines)


def gib(n: float) -> str:
    return f"{n / GiB:8.2f} GiB" if abs(n) >= 2**24 else f"{n:,} B"  # small (the tiny model): exact bytes


def describe_layout(layout: par.LLMParallelLayout) -> str:
    return (f"world {layout.world_size}: attention TP {layout.attn_tp} x DP {layout.attn_dp}, MoE EP {layout.moe_ep}, "
            f"embedding TP {layout.embed_tp}, LM head TP {layout.lmhead_tp}")


def report(p: Plan, preset_name: str, engine: dict, device: Device | None, reserve: float,
           min_worlds: dict | None) -> str:
    dtype_name = {v: k for k, v in DTYPES.items() if v is not None}[p.dtype]
    cols = p.columns
    heads = (dtype_name,) + p.arch.schemes
    lines = [f"{p.label} ({p.source}), preset {preset_name}",
             f"layout {describe_layout(p.layout)}",
             "per rank: rank 0's slice (every rank holds the same)",
             "", f"{'weights per rank':<24}" + "".join(f"{h:>14}" for h in heads)]
    for part in p.arch.parts:
        if part == VISION_PART and not p.weights[part]["dtype"]:
            continue
        lines.append(f"  {part:<22}" + "".join(f"{gib(p.weights[part][c]):>14}" for c in cols))
    lines.append(f"  {'total':<22}" + "".join(f"{gib(p.total(c)):>14}" for c in cols))
    lines += ["", f"KV cache per token, per rank (block_size {p.block_size}, {dtype_name}): not split by attention DP "
                  "(each rank", "  holds its own requests' whole cache), the one KV head replicated under attention TP"]
    kinds = {WINDOW: "sliding window + compressor state (freed as it slides)",
             LATENT: "MLA: the latent + the rope key of every layer (kv_b_proj absorbed, no per-head K / V)"}
    for g, n in p.kv_per_token.items():
        lines.append(f"  {g:<22}{n:>14,.1f} B   {kinds.get(g, 'compressed entries')}")
    lines.append(f"  {'total':<22}{sum(p.kv_per_token.values()):>14,.1f} B")
    budget_preset = p.preset_cache_bytes(engine)
    cache = f"num_blocks {engine['num_blocks']}" if engine.get("num_blocks") else "kv_cache_memory_bytes"
    lines += ["", f"preset {cache} {gib(budget_preset).strip()}: {p.tokens_engine(budget_preset):,} tokens as the "
                  "engine sizes it" + (" (the window group bounded to what max_num_seqs requests hold)"
                                if WINDOW in p.kv_per_token else "")]
    if device is None:
        lines.append("device memory: none given (--device / --device-memory-gib): no per-die fit")
        return "\n".join(lines)
    usable = int(device.memory_gib * GiB * (1 - reserve))
    lines += ["", f"one {device.name}: {device.memory_gib:g} GiB ({device.source});",
              f"  {reserve:.0%} reserved for activations / workspace: {gib(usable).strip()} for weights + KV",
              f"{'':<38}" + "".join(f"{h:>14}" for h in heads)]
    left = {c: usable - p.total(c) for c in cols}
    lines.append(f"  {'left for KV after weights':<36}" + "".join(f"{gib(left[c]):>14}" for c in cols))
    lines.append(f"  {'tokens of KV that fit':<36}" + "".join(
        f"{p.tokens_engine(left[c]):>14,}" if left[c] > 0 else f"{'no fit':>14}" for c in cols))
    def fits(c):  # the preset's cache beside the weights, in the usable part of the die
        over = budget_preset - left[c]
        return "yes" if over <= 0 else f"no, +{over / GiB:.1f} GiB" if over >= 2**24 else f"no, +{over:,} B"

    lines.append(f"  {f'preset {cache} fits':<36}" + "".join(f"{fits(c):>14}" for c in cols))
    if min_worlds:
        lines.append(f"  {'smallest world size, weights fit':<36}" + "".join(
            f"{(str(min_worlds[c]) if min_worlds[c] else '-'):>14}" for c in cols))
    return "\n".join(lines)


def default_model(config: Path, preset: dict) -> str | None:
    """The preset's model: its `model:` (the MLA family's presets name deepseek-v3), else V4 by the preset's name."""
    name = config.name
    if preset.get("model") == "deepseek-v3":
        return "v3-tiny" if name.startswith("tiny") else "v3"
    return "flash" if "flash" in name else "pro" if "pro" in name else "tiny" if name.startswith("tiny") else None


def default_device(config: Path) -> str | None:
    name = config.name
    return ("a3" if "atlas-a3" in name else "950dt" if "ascend-950" in name else "300i-duo" if "300i-duo" in name
            else None)


def parse_args(argv=None) -> argparse.Namespace:
    p = ArgumentParser(prog="plan.py", description=__doc__.splitlines()[0])
    p.add_argument("--config", type=Path, required=True, help="deployment preset (configs/*.yaml)")
    p.add_argument("--model", choices=sorted(MODELS), help="default: the preset's `model:` (deepseek-v3: v3, or "
                   "v3-tiny for a tiny preset), else from its name (flash, pro, tiny)")
    p.add_argument("--weights", type=Path, help="read the model's config.json from this checkpoint folder instead")
    p.add_argument("--dtype", choices=sorted(DTYPES), help="overrides the preset's dtype")
    p.add_argument("--world-size", type=int, help="the preset's layout on this many ranks (experts over all)")
    p.add_argument("--device", choices=sorted(DEVICES) + ["none"], help="default: from the preset's name")
    p.add_argument("--device-memory-gib", type=float, help="memory of one device (overrides --device's)")
    p.add_argument("--reserve-fraction", type=float, default=0.1, help="of the device, for activations / workspace")
    p.add_argument("--offload-experts", type=int, metavar="N", help="MoE offload on one device: N resident experts "
                   "per layer (default: the preset's moe_offload.resident_experts)")
    p.add_argument("--graph-headroom-gib", type=float, default=GRAPH_HEADROOM_GIB,
                   help="device memory for the decode graphs (MoE offload table)")
    a = p.parse_args(argv)
    read_preset(p, a)
    a.layout = parallel_layout(p, a)
    spec = a.preset.get("moe_offload")
    if a.offload_experts is None and isinstance(spec, dict):
        a.offload_experts = spec.get("resident_experts")
    if a.offload_experts is not None:
        if not isinstance(a.offload_experts, int) or a.offload_experts < 1:
            p.error(f"--offload-experts {a.offload_experts}: expected an int >= 1")
        if a.layout.world_size != 1 or (a.world_size or 1) != 1:
            p.error("MoE offload plans one device (world size 1)")
    if a.graph_headroom_gib < 0:
        p.error(f"--graph-headroom-gib {a.graph_headroom_gib}: expected a number >= 0")
    if a.world_size is not None:
        if a.world_size < 1:
            p.error(f"--world-size {a.world_size}: expected an int >= 1")
        a.layout = scaled_layout(a.layout, a.world_size)
    if not 0 <= a.reserve_fraction < 1:
        p.error(f"--reserve-fraction {a.reserve_fraction}: expected a number in [0, 1)")
    if a.device_memory_gib is not None and not a.device_memory_gib > 0:
        p.error(f"--device-memory-gib {a.device_memory_gib}: expected a positive number")
    if a.weights is not None:
        if a.model is not None:
            p.error("--weights and --model: give one")
        try:
            a.model_config = json.loads((a.weights / "config.json").read_text())
        except (OSError, ValueError) as e:
            p.error(f"--weights {a.weights}: no readable config.json ({e})")
        a.label, a.source = a.weights.name, f"{a.weights}/config.json"
    else:
        a.model = a.model or default_model(a.config, a.preset)
        if a.model is None:
            p.error(f"--config {a.config.name}: no default model for this preset; give --model or --weights")
        a.label, a.model_config, a.source = MODELS[a.model]
    name = a.dtype if a.dtype is not None else a.preset.get("dtype", backend.AUTO)
    if name not in DTYPES:
        p.error(f"--config {a.config.name}: dtype {name!r}, expected one of {sorted(DTYPES)}")
    a.dtype_t, _ = backend.resolve_dtype(name, None)  # auto: this machine's choice (the CPU presets)
    device = a.device or default_device(a.config)
    if a.device_memory_gib is not None:
        base = DEVICES.get(device) if device not in (None, "none") else None
        a.device_info = Device(base.name if base else "device", a.device_memory_gib, "--device-memory-gib")
    else:
        a.device_info = DEVICES[device] if device not in (None, "none") else None
    return a


def main(argv=None) -> None:
    a = parse_args(argv)
    engine = a.preset.get("engine") or {}
    try:
        p, args = plan(a.model_config, a.label, a.source, a.layout, a.dtype_t, engine,
                       offload_slots=a.offload_experts)
        min_worlds = None
        if a.device_info is not None and a.offload_experts is None:
            budget = int(a.device_info.memory_gib * GiB * (1 - a.reserve_fraction))
            min_worlds = min_world_size(p.arch, args, a.layout, a.dtype_t, budget)
    except (ValueError, TypeError, KeyError) as e:  # a config / layout the model cannot take
        print(f"plan.py: error: {'; '.join(str(e).splitlines())}", file=sys.stderr)
        sys.exit(2)
    preset = f"configs/{a.config.name}" if a.config.resolve().parent == HERE / "configs" else str(a.config)
    print(report(p, preset, engine, a.device_info, a.reserve_fraction, min_worlds))
    if a.offload_experts is not None:
        devices = [a.device_info] if a.device_info is not None else [DEVICES[d] for d in SINGLE_DEVICES]
        kv = int(engine.get("kv_cache_memory_bytes", 256 * 2**20))
        print(single_device_report(p, args, devices, a.reserve_fraction, kv, int(a.graph_headroom_gib * GiB)))


if __name__ == "__main__":
    main()
