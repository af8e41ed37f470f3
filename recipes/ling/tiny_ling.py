"""Write a tiny random Ling-3.0-Flash checkpoint in the publisher's format (fixed seed).

config.json with model_type bailing_hybrid, the keys transformers 5.24's BailingHybridConfig reads and the ones only
vLLM reads (no_kda_lora, gated_attention_proj_granularity_type, rope_interleave, partial_rotary_factor, the SwiGLU
limit lists, ...); safetensors in the publisher's names (`model.word_embeddings`, `model.layers.N.attention.*` with
separate `{q,k,v}_conv1d` kernels [C, 1, K], `dense`, `mlp.gate.expert_bias`, per-expert `mlp.experts.E.*`), bf16
except what upstream keeps fp32 (A_log, dt_bias, conv kernels, router weight and bias); a byte-level BPE tokenizer
with Ling's turn tokens and a chat template in its turn format. Sizes: hidden 64, 6 layers in groups of 3 (KDA
layers 0, 1, 3, 4; MLA layers 2, 5), the first 2 dense, then MoE with 16 experts in 4 groups (top-4 within the 2
best groups) + 1 shared; 4 heads (KDA head dim 32; MLA nope 16 + rope 16, v 16, kv_lora_rank 32), vocab 512, and
the MTP layer `model.layers.6`. The SwiGLU limit lists are all 0 (off: transformers ignores them); tests write
others through `overrides`.

    python recipes/ling/tiny_ling.py weights/ling-tiny
"""
from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import torch

from common.loader import save_checkpoint, write_tokenizer
from config_ling import ModelArgs
from modeling_ling import LingForCausalLM

# Ling's special tokens, ids 0, 1, ... in this order (config pad / eos ids): the end-of-text (pad), the end-of-turn
# (eos), the turn markers, and the thinking markers.
SPECIAL_TOKENS = {"pad": "<|endoftext|>", "eos": "<|role_end|>", "role": "<role>", "end_role": "</role>",
                  "think": "<think>", "end_think": "</think>"}
# The turn format (spec "Tokenizer and chat template"): <role>SYSTEM</role>..<|role_end|><role>HUMAN</role>..
# <|role_end|><role>ASSISTANT</role>; enable_thinking, when given, ends the prompt in "\n<think>" (true) or
# "\n<think></think>" (false). The published checkpoint ships its own chat_template.jinja.
CHAT_TEMPLATE = (
    "{% set names = {'system': 'SYSTEM', 'user': 'HUMAN', 'assistant': 'ASSISTANT'} %}"
    "{% for m in messages %}<role>{{ names[m['role']] }}</role>{{ m['content'] }}<|role_end|>{% endfor %}"
    "{% if add_generation_prompt %}<role>ASSISTANT</role>"
    "{% if enable_thinking is defined %}{{ '\\n<think>' if enable_thinking else '\\n<think></think>' }}{% endif %}"
    "{% endif %}")

TINY_CONFIG = dict(
    architectures=["BailingHybridForCausalLM"], model_type="bailing_hybrid", vocab_size=512, hidden_size=64,
    intermediate_size=96, moe_intermediate_size=32, moe_shared_expert_intermediate_size=32, num_hidden_layers=6,
    num_attention_heads=4, num_key_value_heads=4, head_dim=32, q_lora_rank=None, kv_lora_rank=32,
    qk_nope_head_dim=16, qk_rope_head_dim=16, v_head_dim=16, num_experts=16, num_shared_experts=1,
    num_experts_per_tok=4, n_group=4, topk_group=2, first_k_dense_replace=2, norm_topk_prob=True,
    routed_scaling_factor=2.5, score_function="sigmoid", moe_router_enable_expert_bias=True, hidden_act="silu",
    max_position_embeddings=512, rms_norm_eps=1e-6, rope_theta=10000.0, rope_interleave=True,
    partial_rotary_factor=0.5, layer_group_size=3, short_conv_kernel_size=4, kda_safe_gate=True,
    kda_lower_bound=-5.0, no_kda_lora=True, gated_attention_proj_granularity_type="head_wise",
    expert_swiglu_limit_list=[0.0] * 6, share_expert_swiglu_limit_list=[0.0] * 6, num_nextn_predict_layers=1,
    pad_token_id=0, eos_token_id=1, bos_token_id=None, tie_word_embeddings=False, torch_dtype="bfloat16",
)
_FP32 = (".A_log", ".dt_bias", "_conv1d.weight", ".mlp.gate.weight", ".mlp.gate.expert_bias")


def tiny_config(**overrides) -> dict:
    return {**TINY_CONFIG, **overrides}


def random_state(args: ModelArgs, seed: int, head_scale: float = 4.0) -> dict[str, torch.Tensor]:
    """The model's fp32 tensors in the publisher's names and layout. Linears N(0, 1 / fan_in); norms 1 + N(0, 0.1^2);
    A_log = log U(1, 16) and dt_bias as transformers initialises them (decays e^g spread over (e^-5, 1)); conv
    kernels N(0, 1 / K); the LM head scaled up so greedy choices are clear (not near-ties)."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, t in LingForCausalLM(args, mtp=True).state_dict().items():  # the MTP layer last: the main weights
        #   do not depend on num_nextn_predict_layers
        if name.endswith(".A_log"):
            v = (1 + 15 * torch.rand(t.shape, generator=g)).log()
        elif name.endswith(".dt_bias"):
            dt = torch.exp(math.log(1e-3) + (math.log(1e-1) - math.log(1e-3)) * torch.rand(t.shape, generator=g))
            v = dt + torch.log(-torch.expm1(-dt))  # softplus^-1(dt)
        elif t.dim() == 1 and "norm" in name:
            v = 1 + 0.1 * torch.randn(t.shape, generator=g)
        elif t.dim() == 1:
            v = 0.1 * torch.randn(t.shape, generator=g)  # router bias
        else:
            v = torch.randn(t.shape, generator=g) / t.shape[-1] ** 0.5
        out[name] = v.float()
    out["lm_head.weight"] *= head_scale
    return to_publisher(out, args)


def to_publisher(state: dict[str, torch.Tensor], args: ModelArgs) -> dict[str, torch.Tensor]:
    """Our parameter names and packing -> the publisher's (the inverse of weights_ling.rename)."""
    out = {}
    L = args.num_hidden_layers
    for name, t in state.items():
        if name.startswith("mtp."):
            name = f"model.layers.{L}.{name.removeprefix('mtp.')}"
        elif name != "lm_head.weight":
            name = f"model.{name}"
        if name.endswith(".attention.conv_weight"):  # [3C, K] -> q / k / v kernels [C, 1, K]
            base = name.removesuffix("conv_weight")
            for part, w in zip("qkv", t.chunk(3)):
                out[f"{base}{part}_conv1d.weight"] = w.unsqueeze(1).contiguous()
        elif name.endswith(".experts.gate_up_proj"):
            for e, w in enumerate(t):
                out[f"{name[:-13]}.{e}.gate_proj.weight"], out[f"{name[:-13]}.{e}.up_proj.weight"] = w.chunk(2)
        elif name.endswith(".experts.down_proj"):
            for e, w in enumerate(t):
                out[f"{name[:-10]}.{e}.down_proj.weight"] = w
        elif name.endswith(".gate_up_proj.weight"):  # dense and shared MLPs
            base = name.removesuffix(".gate_up_proj.weight")
            out[f"{base}.gate_proj.weight"], out[f"{base}.up_proj.weight"] = t.chunk(2)
        else:
            out[name] = t
    return {n: t.contiguous() if n.endswith(_FP32) else t.to(torch.bfloat16).contiguous() for n, t in out.items()}


TINY_REVISION = 1  # bumped when the writer changes what it writes
REVISION_FILE = "tiny_revision.txt"


def is_current(path) -> bool:
    """Whether `path` holds a tiny checkpoint written by this revision of the writer."""
    marker = Path(path) / REVISION_FILE
    current = marker.exists() and marker.read_text().strip() == str(TINY_REVISION)
    return (Path(path) / "config.json").exists() and current


def write_tiny_checkpoint(path, seed: int = 0, max_shard_bytes: int | None = 256 * 1024, **overrides) -> Path:
    """Write config.json, safetensors shards (+ index) and the tokenizer into `path`; returns the path. overrides:
    config.json keys to change (other sizes, SwiGLU limits)."""
    path = Path(path)
    config = tiny_config(**overrides)
    args = ModelArgs.from_config(config)
    save_checkpoint(path, random_state(args, seed), config, max_shard_bytes=max_shard_bytes)
    write_tokenizer(path, vocab_size=args.vocab_size, special_tokens=SPECIAL_TOKENS, chat_template=CHAT_TEMPLATE,
                    add_bos=False, extra_corpus=("SYSTEM HUMAN ASSISTANT",) * 4)
    (path / REVISION_FILE).write_text(f"{TINY_REVISION}\n")
    return path


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out", type=Path)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args()
    write_tiny_checkpoint(a.out, seed=a.seed)
    print(f"wrote {a.out}", file=sys.stderr)
