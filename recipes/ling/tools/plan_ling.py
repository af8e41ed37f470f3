"""Deployment plan for Ling-3.0-Flash (hybrid KDA + MLA attention, 512-expert MoE) on Atlas A2 / A3, from the
config alone (no model is built, no weights are read): what one rank holds and how many requests fit beside it.

    python tools/plan_ling.py [--config configs/atlas-a3-tp8.yaml] [--weights DIR] [--device a3|910b|none]
                              [--device-memory-gib G] [--reserve-fraction F] [--max-model-len N]
    python tools/plan_ling.py --config configs/atlas-a2-tp8.yaml   # 8 x Ascend 910B (Atlas 800I A2)

Without --weights it plans the published model (PUBLISHED_CONFIG, keyed as config.json names its fields); --weights
DIR reads DIR/config.json. Per rank of the preset's `parallel:` layout, sharded as vLLM's BailingMoeV3ForCausalLM
(vllm 0.32 model_executor/models/bailing_moe_v3.py) shards it under --tensor-parallel-size T --enable-expert-parallel:
- KDA: q/k/v/b_proj (one merged column-parallel linear), f_proj and g_proj split by heads; the q/k/v convs and
  dt_bias split by channel and A_log by head (the three fp32); o_proj row-parallel (its input split, every output
  channel on every rank); o_norm (one 128-vector shared by the heads) replicated.
- MLA: q_proj, kv_b_proj and g_proj split by heads, `dense` row-parallel; kv_a_proj_with_mqa and kv_a_layernorm
  replicated.
- MoE: routed experts whole, over the EP ranks (world / moe_tp); the shared expert and the dense MLP of the first
  first_k_dense_replace layers column- / row-parallel over attention TP; the router (weight and expert bias, fp32)
  replicated. Embedding and LM head split by vocabulary (embed_tp, lmhead_tp); the layer norms replicated.
Printed:
- weight bytes by part in the preset's dtype and as W8A8: int8 + one fp32 scale per output channel on every
  attention and MLP linear (b_proj, both g_projs, kv_a / kv_b_proj, routed and shared experts included); the router
  fp32; embedding, LM head, norms, convs, A_log and dt_bias kept as they are;
- the KDA state of one request against the MLA latent of one token: conv history (the last K-1 pre-conv inputs of
  q, k and v, in the model dtype) + recurrent S (heads x 128 x 128 fp32) per KDA layer, split by heads under
  attention TP; the latent (kv_lora_rank + qk_rope_head_dim values in the model dtype per MLA layer) replicated;
  the length at which one request's state costs as much as its latent;
- for one die (64 GiB: an Atlas A3 die or an Ascend 910B), --reserve-fraction of it (0.15: upstream's
  --gpu-memory-utilization 0.85) kept for activations and workspace: what is left after the weights, how many
  max_model_len-token requests fit (each: the latent of max_model_len tokens in whole blocks + its state), whether
  the preset's kv_cache_memory_bytes fits; and the same as upstream runs it (the MTP layer's weights and latent
  cache, conv state fp32 by --mamba_cache_dtype float32 with one more column for the draft token);
- the whole model's parameters: main model, MTP layer, active per token.
Not counted: vLLM's hybrid allocator pads each KDA state page up to one MLA block page (at TP8 the block grows to 256
tokens, a layer's state page to 256 x 1,152 = 294,912 B) and keeps 2 + num_spec state blocks per request under
prefix caching: about 21 MB more per request at TP8, some 2% of a 128K-token request.
Bad options: one line on stderr, exit code 2.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from common.cli_paths import input_path
from common.parallel import LLMParallelLayout

HERE = Path(__file__).resolve().parents[1]  # the recipe folder
DEFAULT_PRESET = HERE / "configs" / "atlas-a3-tp8.yaml"
GiB, MiB = 2**30, 2**20

# Ling-3.0-Flash, huggingface.co/inclusionAI/Ling-3.0-Flash config.json (not readable here): the values are
# transformers 5.24 BailingHybridConfig's defaults, whose docstring checkpoint is this model, and vLLM's loader agrees
# with them; the keys that only vLLM reads (no_kda_lora, moe_shared_expert_intermediate_size,
# gated_attention_proj_granularity_type) come from third-party copies of the published file, and every key is named
# as config.json names it (as vLLM bailing_moe_v3.py reads it: num_experts, num_shared_experts, ...).
PUBLISHED_CONFIG = dict(
    model_type="bailing_hybrid", vocab_size=157184, hidden_size=2560, intermediate_size=6144, num_hidden_layers=42,
    num_attention_heads=32, num_key_value_heads=32, head_dim=128, layer_group_size=6, short_conv_kernel_size=4,
    kda_safe_gate=True, kda_lower_bound=-5.0, no_kda_lora=True, q_lora_rank=None, kv_lora_rank=512,
    qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, gated_attention_proj_granularity_type="head_wise",
    first_k_dense_replace=2, num_experts=512, num_experts_per_tok=8, moe_intermediate_size=768, num_shared_experts=1,
    moe_shared_expert_intermediate_size=768, n_group=8, topk_group=4, norm_topk_prob=True, routed_scaling_factor=2.5,
    num_nextn_predict_layers=1, max_position_embeddings=262144, rope_theta=6000000.0, rms_norm_eps=1e-6,
    tie_word_embeddings=False, pad_token_id=156892, eos_token_id=156895,
)


@dataclass(frozen=True)
class Device:
    name: str
    memory_gib: float
    source: str


# HBM per device (one rank each), read as GiB; the same sources as recipes/deepseek/tools/plan.py:
# - Atlas A3: 2 dies per NPU, each die one device and one rank (Huawei's HCCL guide, rank table for Atlas A3:
#   hiascend.com/document/detail/zh/canncommercial/850/commlib/hcclug/hcclug_000066.html), 64 GB HBM per die
#   (SGLang's Ascend NPU reference, docs.sglang.io/docs/hardware-platforms/ascend-npus/ascend_npu_reference:
#   "Atlas 800I A3 (A3) | Ascend 910C | 16 | 2 | 8(cards) x 2(dies/card) x 64(GB/die)").
# - Ascend 910B: 64 GB HBM per device (the Atlas 800I A2's 8 x 64 GB; hicann/cann-recipes-infer's single-NPU
#   MoE-offload recipe: "A3 or 910B, 64 GB HBM").
DEVICES = {
    "a3": Device("Atlas A3 die", 64, "SGLang Ascend NPU reference: 64 GB per die"),
    "910b": Device("Ascend 910B", 64, "Atlas 800I A2: 8 x 64 GB HBM"),
}
DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4, "auto": 2}  # auto: bf16, the NPU's choice (backend.default_dtype)
RESERVE = 0.15  # upstream's --gpu-memory-utilization 0.85
UPSTREAM_SPEC_TOKENS = 1  # upstream's speculative {"method": "mtp", "num_speculative_tokens": 1}
FP32 = 4

# A tensor's kind: LINEAR is int8 + an fp32 scale per output channel under W8A8; KEEP stays in the model dtype;
# F32 stays fp32 (vLLM loads the convs, dt_bias, A_log and the router in fp32).
LINEAR, KEEP, F32 = "linear", "keep", "fp32"
PARTS = ("KDA attention", "MLA attention", "routed experts", "shared expert + router", "dense MLP", "embedding",
         "LM head", "norms")


def split(n: int, ranks: int, what: str) -> int:
    if n % ranks:
        raise ValueError(f"{what} {n} does not split over {ranks} ranks")
    return n // ranks


def layer_counts(cfg: dict) -> tuple[int, int]:
    """(KDA layers, MLA layers): layer i is MLA iff (i+1) % layer_group_size == 0, and so are the layers past the
    last whole group (vLLM bailing_moe_v3._is_kda_layer)."""
    n, g = cfg["num_hidden_layers"], cfg["layer_group_size"]
    kda = sum(1 for i in range(n) if (i + 1) % g and i < n // g * g)
    return kda, n - kda


def mla_tensors(cfg: dict, tp: int, copies: int) -> list[tuple]:
    H, heads = cfg["hidden_size"], cfg["num_attention_heads"]
    lh = split(heads, tp, "num_attention_heads")
    qk = cfg["qk_nope_head_dim"] + cfg["qk_rope_head_dim"]
    r, q_lora = cfg["kv_lora_rank"], cfg.get("q_lora_rank")
    gate = {"head_wise": heads, "element_wise": heads * cfg["v_head_dim"]}.get(
        cfg.get("gated_attention_proj_granularity_type"), 0)
    q = ([("MLA attention", "q_proj", copies, lh * qk, H, LINEAR)] if not q_lora else
         [("MLA attention", "q_a_proj", copies, q_lora, H, LINEAR), ("MLA attention", "q_a_layernorm", copies,
          q_lora, 1, KEEP), ("MLA attention", "q_b_proj", copies, lh * qk, q_lora, LINEAR)])
    return q + [
        ("MLA attention", "kv_a_proj_with_mqa", copies, r + cfg["qk_rope_head_dim"], H, LINEAR),  # replicated
        ("MLA attention", "kv_a_layernorm", copies, r, 1, KEEP),
        ("MLA attention", "kv_b_proj", copies, lh * (cfg["qk_nope_head_dim"] + cfg["v_head_dim"]), r, LINEAR),
        ("MLA attention", "g_proj", copies, gate // tp, H, LINEAR),
        ("MLA attention", "dense", copies, H, lh * cfg["v_head_dim"], LINEAR),  # row-parallel
    ]


def moe_tensors(cfg: dict, tp: int, ep: int, copies: int) -> list[tuple]:
    H, E, inter = cfg["hidden_size"], cfg["num_experts"], cfg["moe_intermediate_size"]
    local = split(E, ep, "num_experts")
    shared = split(cfg["moe_shared_expert_intermediate_size"] * cfg["num_shared_experts"], tp,
                   "the shared expert's intermediate size")
    return [
        ("routed experts", "experts.gate/up_proj", 2 * local * copies, inter, H, LINEAR),
        ("routed experts", "experts.down_proj", local * copies, H, inter, LINEAR),
        ("shared expert + router", "shared_experts.gate/up_proj", 2 * copies, shared, H, LINEAR),
        ("shared expert + router", "shared_experts.down_proj", copies, H, shared, LINEAR),
        ("shared expert + router", "gate.weight", copies, E, H, F32),
        ("shared expert + router", "gate.expert_bias", copies, E, 1, F32),
    ]


def rank_tensors(cfg: dict, layout: LLMParallelLayout) -> list[tuple]:
    """(part, name, copies, rows, cols, kind) of every tensor one rank of `layout` holds; rows are its output
    channels on that rank. The main model only (the MTP layer: mtp_tensors)."""
    H, heads, hd = cfg["hidden_size"], cfg["num_attention_heads"], cfg["head_dim"]
    tp = layout.attn_tp
    lh = split(heads, tp, "num_attention_heads")
    kda, mla = layer_counts(cfg)
    dense = cfg["first_k_dense_replace"]
    inter = split(cfg["intermediate_size"], tp, "intermediate_size")
    vocab = cfg["vocab_size"]
    tensors = [
        ("KDA attention", "q/k/v/f/g_proj", 5 * kda, lh * hd, H, LINEAR),
        ("KDA attention", "b_proj", kda, lh, H, LINEAR),
        ("KDA attention", "o_proj", kda, H, lh * hd, LINEAR),  # row-parallel
        ("KDA attention", "q/k/v_conv1d", 3 * kda, lh * hd, cfg["short_conv_kernel_size"], F32),
        ("KDA attention", "dt_bias", kda, lh * hd, 1, F32),
        ("KDA attention", "A_log", kda, lh, 1, F32),
        ("KDA attention", "o_norm", kda, hd, 1, KEEP),  # replicated
        *mla_tensors(cfg, tp, mla),
        *moe_tensors(cfg, tp, layout.moe_ep, cfg["num_hidden_layers"] - dense),
        ("dense MLP", "mlp.gate/up_proj", 2 * dense, inter, H, LINEAR),
        ("dense MLP", "mlp.down_proj", dense, H, inter, LINEAR),
        ("embedding", "word_embeddings", 1, split(vocab, layout.embed_tp, "vocab_size"), H, KEEP),
        ("norms", "input / post_attention_layernorm, norm", 2 * cfg["num_hidden_layers"] + 1, H, 1, KEEP),
    ]
    if not cfg.get("tie_word_embeddings"):
        tensors.append(("LM head", "lm_head", 1, split(vocab, layout.lmhead_tp, "vocab_size"), H, KEEP))
    return tensors


def mtp_tensors(cfg: dict, layout: LLMParallelLayout) -> list[tuple]:
    """The MTP layer (layer num_hidden_layers: eh_proj, MLA, MoE, its norms) on one rank; it shares the embedding and
    the LM head. eh_proj replicated (a plain linear in vLLM's MTP models)."""
    n, H = cfg.get("num_nextn_predict_layers", 0), cfg["hidden_size"]
    if not n:
        return []
    return [("MTP eh_proj", "eh_proj", n, H, 2 * H, LINEAR), *mla_tensors(cfg, layout.attn_tp, n),
            *moe_tensors(cfg, layout.attn_tp, layout.moe_ep, n),
            ("norms", "enorm, hnorm, input / post_attention_layernorm, final_layernorm", 5 * n, H, 1, KEEP)]


@dataclass
class RankWeights:
    """One rank's weights by part: parameters, bytes in the model dtype, bytes as W8A8."""
    params: dict[str, int] = field(default_factory=dict)
    dtype: dict[str, int] = field(default_factory=dict)
    w8a8: dict[str, int] = field(default_factory=dict)

    def total(self, column: str) -> int:
        return sum(getattr(self, column).values())


def weight_bytes(tensors: list[tuple], nbytes: int) -> RankWeights:
    w = RankWeights()
    for part, _, copies, rows, cols, kind in tensors:
        n = copies * rows * cols
        size = FP32 if kind == F32 else nbytes
        quantized = n + FP32 * copies * rows if kind == LINEAR else size * n
        for column, value in ((w.params, n), (w.dtype, size * n), (w.w8a8, quantized)):
            column[part] = column.get(part, 0) + value
    return w


def state_bytes(cfg: dict, tp: int, conv_bytes: int, num_spec: int = 0) -> tuple[int, int]:
    """(conv history, recurrent S) of one request in one KDA layer on one rank of attention TP `tp`: conv
    (K-1+num_spec) x 3 x (heads/tp x head_dim) in conv_bytes, S heads/tp x head_dim x head_dim fp32."""
    lh, hd = split(cfg["num_attention_heads"], tp, "num_attention_heads"), cfg["head_dim"]
    return (cfg["short_conv_kernel_size"] - 1 + num_spec) * 3 * lh * hd * conv_bytes, lh * hd * hd * FP32


def latent_bytes_per_token(cfg: dict, nbytes: int, mla_layers: int) -> int:
    return (cfg["kv_lora_rank"] + cfg["qk_rope_head_dim"]) * nbytes * mla_layers


def request_bytes(cfg: dict, tp: int, nbytes: int, tokens: int, block: int,
                  upstream: bool = False) -> tuple[int, int]:
    """(latent, KDA state) bytes of one `tokens`-token request on one rank: the latent of whole blocks; upstream:
    with the MTP layer's latent, conv state fp32 and one more conv column per draft token."""
    kda, mla = layer_counts(cfg)
    spec = UPSTREAM_SPEC_TOKENS if upstream else 0
    conv, s = state_bytes(cfg, tp, FP32 if upstream else nbytes, spec)
    mla += cfg.get("num_nextn_predict_layers", 0) if upstream else 0
    return latent_bytes_per_token(cfg, nbytes, mla) * math.ceil(tokens / block) * block, kda * (conv + s)


def parameter_counts(cfg: dict) -> dict[str, int]:
    """The whole model's parameters: by part, main, MTP, and active per token (the routed experts' top-k share)."""
    one = LLMParallelLayout()
    main, mtp = weight_bytes(rank_tensors(cfg, one), 1).params, weight_bytes(mtp_tensors(cfg, one), 1).params
    share = cfg["num_experts_per_tok"] / cfg["num_experts"]
    inactive = round(main["routed experts"] * (1 - share))
    counts = {**main, "main": sum(main.values()), "MTP": sum(mtp.values())}
    counts["active"] = counts["main"] - inactive - main["embedding"] - main.get("LM head", 0)
    counts["active + LM head"] = counts["active"] + main.get("LM head", 0)
    counts["active MTP step"] = counts["MTP"] - round(mtp.get("routed experts", 0) * (1 - share))
    return counts


def gib(n: float) -> str:
    return f"{n / GiB:8.2f} GiB"


def describe_layout(layout: LLMParallelLayout) -> str:
    return (f"world {layout.world_size}: attention TP {layout.attn_tp} x DP {layout.attn_dp}, MoE EP {layout.moe_ep}, "
            f"embedding TP {layout.embed_tp}, LM head TP {layout.lmhead_tp}")


def report(a: argparse.Namespace) -> str:
    cfg, layout, nbytes, dtype = a.model_config, a.layout, DTYPE_BYTES[a.dtype], a.dtype_name
    tp, tokens, block = layout.attn_tp, a.max_model_len, a.block_size
    kda, mla = layer_counts(cfg)
    w = weight_bytes(rank_tensors(cfg, layout), nbytes)
    mtp = weight_bytes(mtp_tensors(cfg, layout), nbytes)
    heads = (dtype, "W8A8")
    lines = [f"{a.label} ({a.source}), preset {a.preset_name}", f"layout {describe_layout(layout)}",
             f"layers: {kda} KDA + {mla} MLA, {cfg['first_k_dense_replace']} dense MLP + "
             f"{cfg['num_hidden_layers'] - cfg['first_k_dense_replace']} MoE ({cfg['num_experts']} experts, "
             f"{cfg['num_experts'] // layout.moe_ep} a rank); MTP layers {cfg.get('num_nextn_predict_layers', 0)}",
             "", f"{'weights per rank':<28}" + "".join(f"{h:>14}" for h in heads)]
    for part in PARTS:
        if part in w.dtype:
            lines.append(f"  {part:<26}{gib(w.dtype[part]):>14}{gib(w.w8a8[part]):>14}")
    lines.append(f"  {'total':<26}{gib(w.total('dtype')):>14}{gib(w.total('w8a8')):>14}")
    lines.append(f"  {'MTP layer (not in total)':<26}{gib(mtp.total('dtype')):>14}{gib(mtp.total('w8a8')):>14}")

    conv1, s1 = state_bytes(cfg, 1, nbytes)
    conv, s = state_bytes(cfg, tp, nbytes)
    latent = latent_bytes_per_token(cfg, nbytes, mla)
    state1, state = kda * (conv1 + s1), kda * (conv + s)
    rows = [("conv history, one layer", conv1, conv), ("recurrent S (fp32), one layer", s1, s),
            ("state, one layer", conv1 + s1, conv + s), (f"state, {kda} KDA layers", state1, state)]
    lines += ["", f"KDA state of one request vs MLA latent ({dtype} conv history and latent; the latent is "
                  "replicated under TP)", f"{'':<38}{'whole model':>16}{f'per rank (TP {tp})':>20}"]
    lines += [f"  {name:<36}{one:>14,} B{rank:>18,} B" for name, one, rank in rows]
    lines += [f"  {'':<36}{state1 / MiB:>12.2f} MiB{state / MiB:>16.2f} MiB",
              f"  {f'MLA latent, one token ({mla} layers)':<36}{latent:>14,} B{latent:>18,} B",
              f"  {'state = the latent of':<36}{state1 / latent:>9,.1f} tokens{state / latent:>13,.1f} tokens"]

    counts = parameter_counts(cfg)
    attention = counts["KDA attention"] + counts["MLA attention"]
    lines += ["", "parameters (whole model)",
              f"  {'main model':<20}{counts['main'] / 1e9:8.2f} B   (attention {attention / 1e9:.2f} B: KDA "
              f"{counts['KDA attention'] / 1e9:.2f} + MLA {counts['MLA attention'] / 1e9:.2f}; routed experts "
              f"{counts['routed experts'] / 1e9:.2f} B; embedding {counts['embedding'] / 1e9:.2f} B; LM head "
              f"{counts.get('LM head', 0) / 1e9:.2f} B)",
              f"  {'MTP layer':<20}{counts['MTP'] / 1e9:8.2f} B   (shares the embedding and the LM head)",
              f"  {'stored':<20}{(counts['main'] + counts['MTP']) / 1e9:8.2f} B   ({counts['main'] * 2 / 1e9:.1f} GB "
              f"in bf16, {(counts['main'] + counts['MTP']) * 2 / 1e9:.1f} GB with MTP)",
              f"  {'active per token':<20}{counts['active'] / 1e9:8.2f} B   (without embedding and LM head; "
              f"{counts['active + LM head'] / 1e9:.2f} B with the LM head; a draft step "
              f"+{counts['active MTP step'] / 1e9:.2f} B)"]

    if a.device_info is None:
        lines += ["", "device memory: none given (--device / --device-memory-gib): no per-die fit"]
        return "\n".join(lines)
    d, reserve = a.device_info, a.reserve_fraction
    usable = usable_bytes(d, reserve)
    latent_req, state_req = request_bytes(cfg, tp, nbytes, tokens, block)
    per_request = latent_req + state_req
    up_latent, up_state = request_bytes(cfg, tp, nbytes, tokens, block, upstream=True)
    cols = ("dtype", "w8a8")
    left = {c: usable - w.total(c) for c in cols}
    lines += ["", f"one {d.name}: {d.memory_gib:g} GiB ({d.source});",
              f"  {reserve:.0%} reserved for activations / workspace: {gib(usable).strip()} for weights + cache;",
              f"  one {tokens:,}-token request a rank: {per_request:,} B (latent {latent_req:,} B + state "
              f"{state_req:,} B)", f"{'':<42}" + "".join(f"{h:>16}" for h in heads),
              f"  {'left after the weights':<40}" + "".join(f"{gib(left[c]):>16}" for c in cols),
              f"  {f'{tokens:,}-token requests that fit':<40}" + "".join(
                  f"{requests_that_fit(usable, w.total(c), per_request):>16,}" for c in cols)]
    if (budget := a.kv_cache_memory_bytes) is not None:
        fits = {c: "yes" if budget <= left[c] else f"no, +{(budget - left[c]) / GiB:.1f} GiB" for c in cols}
        lines.append(f"  {f'preset kv_cache_memory_bytes fits':<40}" + "".join(f"{fits[c]:>16}" for c in cols))
        lines.append(f"    ({gib(budget).strip()}: {budget // per_request:,} such requests)")
    up = {c: requests_that_fit(usable, w.total(c) + mtp.total(c), up_latent + up_state) for c in cols}
    lines += [f"  {'as upstream runs it (MTP 1, conv fp32)':<40}" + "".join(f"{up[c]:>16,}" for c in cols),
              f"    (+ the MTP layer's weights; each request {up_latent + up_state:,} B: the latent of "
              f"{mla + cfg.get('num_nextn_predict_layers', 0)} MLA layers {up_latent:,} B + state {up_state:,} B)",
              f"  the preset's max_num_seqs: {a.max_num_seqs}"]
    return "\n".join(lines)


def usable_bytes(device: Device, reserve: float) -> int:
    """The die's memory for weights + cache, `reserve` of it kept for activations and workspace."""
    return int(device.memory_gib * GiB * (1 - reserve))


def requests_that_fit(usable: int, weights: int, per_request: int) -> int:
    return max((usable - weights) // per_request, 0)


class ArgumentParser(argparse.ArgumentParser):
    def error(self, message):  # one line and exit code 2, no usage dump
        self.exit(2, f"{self.prog}: error: {message}\n")


def default_device(config: Path) -> str | None:
    return "a3" if "atlas-a3" in config.name else "910b" if "atlas-a2" in config.name else None


def parse_args(argv=None) -> argparse.Namespace:
    p = ArgumentParser(prog="plan_ling.py", description=__doc__.splitlines()[0])
    p.add_argument("--config", type=input_path(HERE), default=DEFAULT_PRESET, help="deployment preset")
    p.add_argument("--weights", type=input_path(HERE), help="read config.json from this checkpoint folder instead")
    p.add_argument("--device", choices=sorted(DEVICES) + ["none"], help="default: from the preset's name")
    p.add_argument("--device-memory-gib", type=float, help="memory of one device (overrides --device's)")
    p.add_argument("--reserve-fraction", type=float, default=RESERVE, help="of the device, for activations")
    p.add_argument("--max-model-len", type=int, help="tokens a request (default: the preset's max_model_len)")
    a = p.parse_args(argv)
    if not a.config.is_file():
        p.error(f"--config {a.config}: no such file")
    try:
        preset = yaml.safe_load(a.config.read_text()) or {}
    except yaml.YAMLError as e:
        p.error(f"--config {a.config}: not valid YAML ({str(e).splitlines()[0]})")
    if not isinstance(preset, dict):
        p.error(f"--config {a.config}: expected a mapping")
    a.preset_name = f"configs/{a.config.name}" if a.config.resolve().parent == HERE / "configs" else str(a.config)
    try:
        a.layout = LLMParallelLayout(**(preset.get("parallel") or {}))
    except (ValueError, TypeError) as e:
        p.error(f"--config {a.config.name}: parallel: {e}")
    a.dtype = preset.get("dtype", "auto")
    if a.dtype not in DTYPE_BYTES:
        p.error(f"--config {a.config.name}: dtype {a.dtype!r}, expected one of {sorted(DTYPE_BYTES)}")
    a.dtype_name = "bf16" if a.dtype == "auto" else a.dtype
    engine = preset.get("engine") or {}
    a.block_size, a.max_num_seqs = engine.get("block_size", 16), engine.get("max_num_seqs", "-")
    a.kv_cache_memory_bytes = engine.get("kv_cache_memory_bytes")
    for key, value in (("block_size", a.block_size), ("kv_cache_memory_bytes", a.kv_cache_memory_bytes)):
        if value is not None and (not isinstance(value, int) or value < 1):
            p.error(f"--config {a.config.name}: engine.{key} {value!r}: expected an int >= 1")
    if a.weights is not None:
        try:
            a.model_config = json.loads((a.weights / "config.json").read_text())
        except (OSError, ValueError) as e:
            p.error(f"--weights {a.weights}: no readable config.json ({'; '.join(str(e).splitlines())})")
        a.label, a.source = a.weights.name, f"{a.weights}/config.json"
    else:
        a.model_config, a.label, a.source = PUBLISHED_CONFIG, "Ling-3.0-Flash", "published config.json"
    if a.max_model_len is None:
        a.max_model_len = engine.get("max_model_len") or a.model_config.get("max_position_embeddings")
    if not isinstance(a.max_model_len, int) or a.max_model_len < 1:
        p.error(f"--max-model-len {a.max_model_len}: expected an int >= 1")
    if not 0 <= a.reserve_fraction < 1:
        p.error(f"--reserve-fraction {a.reserve_fraction}: expected a number in [0, 1)")
    if a.device_memory_gib is not None and not a.device_memory_gib > 0:
        p.error(f"--device-memory-gib {a.device_memory_gib}: expected a positive number")
    device = a.device or default_device(a.config)
    if a.device_memory_gib is not None:
        base = DEVICES.get(device)
        a.device_info = Device(base.name if base else "device", a.device_memory_gib, "--device-memory-gib")
    else:
        a.device_info = DEVICES.get(device)
    return a


def main(argv=None) -> None:
    a = parse_args(argv)
    try:
        text = report(a)
    except (ValueError, KeyError, TypeError) as e:  # a config / layout the arithmetic cannot take
        missing = f"config.json has no {e}" if isinstance(e, KeyError) else "; ".join(str(e).splitlines())
        print(f"plan_ling.py: error: {missing}", file=sys.stderr)
        sys.exit(2)
    print(text)


if __name__ == "__main__":
    main()
