"""A checkpoint convert_checkpoint.py wrote runs without flags: the config says W8A8 / W4A8, the model builds int8
projections and experts, loads them as stored, and its logits stay close to the float model's; through the engine
and over ranks (each loading its slice of the int8 weights and scales) too."""
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer

from common.engine import LLM, SamplingParams
from common.engine.model_runner import prefill_logits
from common.parallel import LLMParallelLayout, destroy_parallel, init_parallel
from dist_helpers import run_ranks
from modeling_deepseek_v4 import QuantLinear
from quant_accuracy import OpErrors, common_prefix
from graph_helpers import greedy_eager_and_graph
from tiny_deepseek_v4 import write_tiny_checkpoint
from weights_deepseek_v4 import load_model

CONVERT = Path(__file__).resolve().parents[3] / "recipes" / "deepseek" / "tools" / "convert_checkpoint.py"
PROMPTS = [[5, 9, 30, 41, 7, 300, 12, 12, 99, 3, 4], [17, 18, 19, 20], [200, 201, 3, 4, 5, 6, 7, 8, 9, 10, 11, 40]]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("quantized")
    src = write_tiny_checkpoint(root / "float", seed=6, quantized=False)
    out = {"float": src}
    for fmt, extra in (("w8a8", []), ("w4a8", ["--group-size", "16"])):
        r = subprocess.run([sys.executable, str(CONVERT), "--quant", fmt, str(src), str(root / fmt), *extra],
                           capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stderr
        out[fmt] = root / fmt
    return out


def logprobs(path, parallel=None):
    model = load_model(path, torch.float32, parallel=parallel)
    return model, torch.log_softmax(prefill_logits(model, PROMPTS), -1)  # [T, V]


@pytest.mark.parametrize("fmt", ["w8a8", "w4a8"])
def test_a_converted_checkpoint_loads_as_stored_and_stays_close(checkpoints, fmt):
    _, want = logprobs(checkpoints["float"])
    model, got = logprobs(checkpoints[fmt])
    quant = [m for m in model.modules() if isinstance(m, QuantLinear)]
    assert quant and all(m.weight.dtype == torch.int8 for m in quant)
    assert model.layers[0].ffn.experts.w13.dtype == torch.int8
    kl = torch.nn.functional.kl_div(got, want, log_target=True, reduction="none").sum(-1)  # [T]: KL(float || quant)
    top1 = (got.argmax(-1) == want.argmax(-1)).float().mean().item()
    # Measured on these prompts (fifth session): W8A8 KL mean 0.019, max 0.126, top-1 1.0; W4A8 (int4 experts,
    # groups of 16) KL mean 1.27, top-1 0.63. The tiny random model is very sensitive (logits up to 32; weight-only
    # int8 alone gives KL up to 3.5 on 64-token prompts), so the bounds are these numbers with a 2x margin, not
    # an accuracy claim for a real model.
    if fmt == "w8a8":
        assert kl.mean().item() < 0.05 and kl.max().item() < 0.3 and top1 >= 0.9
    else:
        assert kl.mean().item() < 2.5 and top1 >= 0.5


def test_the_engine_runs_a_w8a8_checkpoint(checkpoints):
    path = checkpoints["w8a8"]
    llm = LLM(load_model(path, torch.float32), AutoTokenizer.from_pretrained(path), block_size=16,
              max_num_batched_tokens=8)
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True), use_tqdm=False)
    _, full = logprobs(path)
    ends = torch.tensor([len(p) for p in PROMPTS]).cumsum(0) - 1
    assert [o.token_ids[0] for o in outs] == full[ends].argmax(-1).tolist()  # paged, chunked == whole prompt
    assert all(len(o.token_ids) == 10 for o in outs) and llm.engine.kv_cache.all_blocks_free()


def test_per_op_errors_within_the_rounding_of_both_operands(checkpoints):
    """quant_accuracy.OpErrors on the tiny checkpoint. Rounding x to a step s = amax / 127 leaves an error of RMS
    s / sqrt(12), relative (amax / sigma) / (127 sqrt 12) = 0.2-0.8 % for amax / sigma in 1..3.5 (K from 32 to
    1024 Gaussian-like values); the weight's rounding adds as much, so W8A8 outputs are off by ~0.5-1.2 %, up to
    ~2 % for swiglu's heavy-tailed outputs (the w2 inputs; the bench checkpoint measures 1.1-1.9 %). int4 in
    groups of G: amax / sigma ~2 for G = 16-32 and 7 steps a side: 2 / (7 sqrt 12) = 8 %. Bounds with a margin:
    W8A8 3 %, W4A8 routed experts 15 %; the float (fp32 here) ops against fp32 arithmetic: 1e-5."""
    model = load_model(checkpoints["float"], torch.float32)
    quantized = {fmt: load_model(checkpoints[fmt], torch.float32) for fmt in ("w8a8", "w4a8")}
    hooks = OpErrors(model, quantized)
    prefill_logits(model, PROMPTS)
    hooks.remove()
    ops_seen = {op for op, _ in hooks.errors}
    assert {"attn.wq_b", "attn.wo_b", "experts.w13", "experts.w2", "ffn.shared_experts.w13"} <= ops_seen
    for (op, layer), kinds in hooks.errors.items():
        assert max(kinds["float"]) < 1e-5, (op, layer)
        assert 1e-4 < max(kinds["w8a8"]) < 0.03, (op, layer, kinds["w8a8"])
        bound = 0.15 if op.startswith("experts.") else 0.03  # W4A8: int4 routed experts, the rest as W8A8
        assert 1e-4 < max(kinds["w4a8"]) < bound, (op, layer, kinds["w4a8"])
    assert "experts.w13" in hooks.table(("w8a8", "w4a8"))


def test_w8a8_greedy_agreement_through_the_engine(checkpoints):
    """Greedy tokens of the W8A8 engine against the float engine's on the tiny checkpoint. Measured (sixth
    session): 10 / 10, 10 / 10 and 10 / 10 tokens agree; bound: at least half on average and the first token of
    each (the W8A8 logits are within KL 0.13 of the float ones on these prompts, test above)."""
    tokens = {}
    for fmt in ("float", "w8a8"):
        path = checkpoints[fmt]
        llm = LLM(load_model(path, torch.float32), AutoTokenizer.from_pretrained(path), block_size=16)
        outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True), use_tqdm=False)
        tokens[fmt] = [o.token_ids for o in outs]
    lengths = [common_prefix(q, f) for q, f in zip(tokens["w8a8"], tokens["float"])]
    print("W8A8 greedy agreement", lengths)
    assert min(lengths) >= 1 and sum(lengths) / len(lengths) >= 5


def rank_logits(path, world, layout, out_dir):
    parallel = init_parallel(LLMParallelLayout(world_size=world, **layout))
    try:
        _, got = logprobs(path, parallel)
        torch.save(got, out_dir / f"rank{parallel.rank}.pt")
    finally:
        destroy_parallel()


@pytest.mark.slow
@pytest.mark.parametrize("layout", [{"lmhead_tp": 2}, {"attn_tp": 2}], ids=["dp2-ep2", "tp2"])
def test_w8a8_over_ranks(checkpoints, tmp_path, layout):
    """DP2 + EP2: every token's rows are quantized whole, so the ranks equal one process. TP2: each rank reads its
    rows of the int8 wq_b and their scales and its columns of wo_b, and quantizes its part of wo_b's input on its
    own (per token over its columns, as upstream's TP does), so it is compared with the float model."""
    run_ranks(rank_logits, 2, checkpoints["w8a8"], 2, layout, tmp_path)
    _, want = logprobs(checkpoints["w8a8"])
    _, float_lp = logprobs(checkpoints["float"])
    for rank in range(2):
        got = torch.load(tmp_path / f"rank{rank}.pt")
        if "attn_tp" not in layout:
            torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
        else:
            kl = torch.nn.functional.kl_div(got, float_lp, log_target=True, reduction="none").sum(-1)
            top1 = (got.argmax(-1) == float_lp.argmax(-1)).float().mean().item()
            # measured: KL mean 0.376, top-1 0.815 -- exactly what one process gives when it quantizes wo_b's input
            # in the same two halves (checked by hand, fifth session): the granularity, not the TP path; this tiny
            # random model turns any rounding difference into large logit changes (see the test above)
            assert kl.mean().item() < 0.75 and top1 >= 0.7


def test_w8a8_graph_decode_equals_eager(checkpoints):
    """Graph mode (the default where a checkpoint is given: auto) compiles the int8 projections and experts: the
    experts' split runs as one opaque op, the MoE traced inline (torch's region reuse fails on the int8 experts).
    fp32 greedy tokens of the compiled steps == eager's (W4A8 runs the same graph with the int4 op)."""
    outs = greedy_eager_and_graph(load_model, checkpoints["w8a8"], PROMPTS, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    assert outs["graph"] == outs["eager"]
