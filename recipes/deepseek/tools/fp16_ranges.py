"""Per-layer activation maxima of an MLA checkpoint (DeepSeek-V3 / R1, V3.2, Kimi-K2) against fp16's range.

    python recipes/deepseek/tools/fp16_ranges.py [--weights DIR] [--prompt-len 64] [--prompts 4]

Runs the model in fp32 (nothing clips) over random prompts and prints, per decoder layer, the largest magnitude
of what an fp16 engine would hold in fp16, as a fraction of fp16's max 65504:
- residual: the residual stream after the layer (the running sum of every sublayer's output);
- norm_sumsq: the sum of squares over the hidden size that RMSNorm divides by (input_layernorm's input), which
  overflows fp16 once |x| reaches ~65504^0.5 / D^0.5 even when x itself fits;
- scores: the MLA attention logits softmax_scale * q . k (before the softmax), per head, causal;
- mlp_hidden: the SwiGLU output fed to down_proj (dense MLP or shared experts);
- mlp_out: the MLP / MoE output added to the residual (routed experts times routed_scaling_factor, plus shared).
Without --weights it measures the tiny random checkpoint (tiny_deepseek_v3.py, weights ~ N(0, 1/fan_in)), whose
maxima say nothing about a trained model's: run it on the real weights before trusting fp16 anywhere.
"""
from __future__ import annotations

import argparse
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the recipe's modules (a tool runs from tools/)
from common import ops
from common.engine.forward_batch import ForwardBatch
from common.engine.model_runner import bind_new_caches
from modeling_deepseek_v3 import LATENT, MoE, DeepseekV3
from tiny_deepseek_v3 import write_tiny_checkpoint
from weights_deepseek_v3 import load_model

FP16_MAX = torch.finfo(torch.float16).max  # 65504
QUANTITIES = ("residual", "norm_sumsq", "scores", "mlp_hidden", "mlp_out")


def mla_scores(attn, x: torch.Tensor, rope) -> torch.Tensor:
    """One sequence's causal attention logits [H, T, T] (masked positions 0) of an MLAttention on its input x [T, D]."""
    T, H = x.shape[0], attn.heads
    q = attn.q_proj(x) if hasattr(attn, "q_proj") else attn.q_b_proj(attn.q_a_layernorm(attn.q_a_proj(x)))
    q = q.view(T, H, attn.nope + attn.rope_dim)
    cos, sin = rope["interleaved"]
    q_nope, q_pe = q[..., : attn.nope], ops.rotary_emb(q[..., attn.nope :], cos, sin, interleaved=True)
    latent, k_pe = attn.kv_a_proj_with_mqa(x).split([attn.rank, attn.rope_dim], dim=-1)  # [T, R], [T, Dr]
    k_pe = ops.rotary_emb(k_pe.unsqueeze(1), cos, sin, interleaved=True)  # [T, 1, Dr]
    k_nope, _ = attn.kv_b_proj.expand(attn.kv_a_layernorm(latent))  # [T, H, nope]
    s = torch.einsum("thn,shn->hts", q_nope, k_nope) + torch.einsum("thr,sr->hts", q_pe, k_pe[:, 0])  # [H, T, T]
    return (s * attn.scale).tril()


@torch.no_grad()
def measure(model: DeepseekV3, prompts: list[list[int]]) -> dict[int, dict[str, float]]:
    """{layer: {quantity: max |value|}} over the prompts, each prompt its own forward (fresh caches)."""
    out: dict[int, dict[str, float]] = defaultdict(lambda: dict.fromkeys(QUANTITIES, 0.0))

    def keep(layer, name, t):
        out[layer][name] = max(out[layer][name], t.abs().max().item())

    hooks = []
    for i, layer in enumerate(model.model.layers):
        hooks.append(layer.register_forward_hook(lambda m, a, y, i=i: keep(i, "residual", y)))
        hooks.append(layer.input_layernorm.register_forward_pre_hook(
            lambda m, a, i=i: keep(i, "norm_sumsq", a[0].float().square().sum(-1))))
        hooks.append(layer.self_attn.register_forward_pre_hook(
            lambda m, a, i=i: keep(i, "scores", mla_scores(m, a[0], a[1]))))
        mlp = layer.mlp.shared_experts if isinstance(layer.mlp, MoE) else layer.mlp
        if mlp is not None:
            hooks.append(mlp.down_proj.register_forward_pre_hook(lambda m, a, i=i: keep(i, "mlp_hidden", a[0])))
        hooks.append(layer.mlp.register_forward_hook(lambda m, a, y, i=i: keep(i, "mlp_out", y)))
    try:
        for p in prompts:
            batch, n = ForwardBatch.prefill([p], [LATENT], 16, model.embed.weight.device)
            bind_new_caches(model, {LATENT: n}, 16)
            model(batch)
    finally:
        for h in hooks:
            h.remove()
    return dict(out)


def report(maxima: dict[int, dict[str, float]]) -> str:
    """A table: one row per layer, each quantity's max and its fraction of fp16's max (!! where it overflows)."""
    lines = ["layer  " + "  ".join(f"{q:>22}" for q in QUANTITIES)]
    for i, row in sorted(maxima.items()):
        cells = [f"{v:11.4g} {v / FP16_MAX:8.2%}{'!!' if v > FP16_MAX else '  '}" for v in row.values()]
        lines.append(f"{i:5d}  " + "  ".join(cells))
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--weights", type=Path, help="checkpoint folder (default: the tiny random one, written to a temp dir)")
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    if a.prompts < 1 or a.prompt_len < 1:
        p.error("--prompts and --prompt-len must be >= 1")
    with tempfile.TemporaryDirectory() as tmp:
        path = a.weights or write_tiny_checkpoint(Path(tmp) / "tiny", quantized=False)
        model = load_model(path, torch.float32)
        g = torch.Generator().manual_seed(a.seed)
        V = model.args.vocab_size
        prompts = [torch.randint(2, V, (a.prompt_len,), generator=g).tolist() for _ in range(a.prompts)]
        maxima = measure(model, prompts)
    print(report(maxima))
    worst = {q: max(row[q] for row in maxima.values()) for q in QUANTITIES}
    print("max over layers: " + ", ".join(f"{q} {v:.4g} ({v / FP16_MAX:.2%} of fp16 max)" for q, v in worst.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
