"""Ling-3.0-Flash over gloo ranks equals one process (tiny fp32 checkpoint).

- Attention TP2 (KDA and MLA heads split, the experts over both: EP2) and attention DP2 + EP2 with the vocabulary
  split (embedding and LM head over both DP ranks): each rank reads exactly its slice (its heads, its experts, its
  vocabulary rows); its KDA state tensors hold its own heads and its MLA latent rows are whole; its prefill logits
  equal one process's (1e-4); greedy generation through the engine (chunked prefill across KDA's 64-token chunk,
  one DP rank idle at the end, a prefix hit on a saved state) gives one process's tokens.
- `run.sh --config configs/tiny-cpu-tp2.yaml` / `tiny-cpu-dp2-ep2.yaml` start torchrun themselves and print one
  process's completions (fp32).
"""
import os
import subprocess
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer, BailingHybridForCausalLM

from common.engine import LLM, SamplingParams
from common.engine.model_runner import prefill_logits
from common.loader import Checkpoint, save_checkpoint
from common.parallel import LLMParallelLayout, destroy_parallel, init_parallel
from config_ling import ModelArgs
from modeling_ling import check_layout
from tiny_ling import tiny_config, write_tiny_checkpoint
from weights_ling import load_model

RUN_SH = Path(__file__).resolve().parents[3] / "recipes" / "ling" / "run.sh"
GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
LAYOUTS = {"tp2": {"attn_tp": 2}, "dp2-ep2-vocab2": {"embed_tp": 2, "lmhead_tp": 2}}
ENGINE = dict(block_size=16, max_num_batched_tokens=24)  # chunked: the 70-token prompt over several steps


def prompts_of(lengths, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(2, 500, (n,), generator=g).tolist() for n in lengths]


PROMPTS = prompts_of((70, 13, 5))  # 3 over DP2: one rank idles at the end


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """The publisher's layout; beside it (`hf/`) the same weights in transformers' layout (one concatenated conv
    kernel [3C, 1, K], stacked experts), with vLLM's [1, 1, H, 1] A_log."""
    root = tmp_path_factory.mktemp("parallel")
    path = write_tiny_checkpoint(root / "ckpt", seed=5)
    state = BailingHybridForCausalLM.from_pretrained(path, dtype=torch.float32).state_dict()
    state = {n: t.view(1, 1, -1, 1) if n.endswith(".A_log") else t for n, t in state.items()}
    save_checkpoint(path / "hf", state, Checkpoint(path).config)
    return path


def hit_prompt(prompt, tokens):
    """The first prompt's sequence + 2 tokens: a prefix hit on its saved KDA state and MLA blocks."""
    return prompt + tokens + [7, 8]


def rank_main(path, world, layout, out_dir):
    """One rank: its slice of the checkpoint, its DP rank's prefill logits, then greedy generation of every
    prompt (each DP rank its share) and of a prompt that hits the first one's prefix."""
    torch.set_num_threads(1)
    parallel = init_parallel(LLMParallelLayout(world_size=world, **layout))
    try:
        model = load_model(path, torch.float32, parallel=parallel)
        held = sum(t.numel() for t in model.state_dict().values())
        hf_layout = load_model(path / "hf", torch.float32, parallel=parallel)  # the same slice, from other names
        for (n, a), b in zip(model.state_dict().items(), hf_layout.state_dict().values()):
            assert torch.equal(a, b), n
        dp, dp_rank = parallel.size("attn_dp"), parallel.rank_in("attn_dp")
        logits = prefill_logits(model, PROMPTS[dp_rank::dp])
        llm = LLM(model, AutoTokenizer.from_pretrained(path), **ENGINE)
        outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        hit = llm.generate([hit_prompt(PROMPTS[0], outs[0].token_ids)], GREEDY, use_tqdm=False)[0]
        assert llm.engine.kv_cache.all_blocks_free()
        kda, mla = model.layers[0].attention, model.layers[2].attention
        shapes = {"recurrent_state": tuple(kda.recurrent_state.shape), "conv_state": tuple(kda.conv_state.shape),
                  "kv_cache": tuple(mla.kv_cache.shape)}
        torch.save((logits, [o.token_ids for o in outs], (hit.token_ids, hit.num_cached_tokens),
                    model.checkpoint_reads, held, shapes), out_dir / f"{parallel.rank}.pt")
    finally:
        destroy_parallel()


@pytest.fixture(scope="module")
def one_process(checkpoint):
    """The one-process model, its greedy outputs and the prefix-hit run's output (cold: no prefix caching)."""
    model, tok = load_model(checkpoint, torch.float32), AutoTokenizer.from_pretrained(checkpoint)
    plain = [o.token_ids for o in LLM(model, tok, **ENGINE).generate(PROMPTS, GREEDY, use_tqdm=False)]
    cold = LLM(model, tok, enable_prefix_caching=False, **ENGINE).generate(
        [hit_prompt(PROMPTS[0], plain[0])], GREEDY, use_tqdm=False)[0]
    return model, plain, cold.token_ids


@pytest.mark.slow
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_ranks_equal_one_process(checkpoint, one_process, tmp_path, name):
    from dist_helpers import run_ranks
    layout = LLMParallelLayout(world_size=2, **LAYOUTS[name])
    run_ranks(rank_main, 2, checkpoint, 2, LAYOUTS[name], tmp_path)
    model, plain, cold = one_process
    everything, ckpt = model.checkpoint_reads, Checkpoint(checkpoint)
    elements = lambda reads: sum(b // ckpt.dtype(n).itemsize for n, b in reads.items())  # noqa: E731 (bf16 / fp32)
    assert elements(everything) == sum(t.numel() for t in model.state_dict().values())  # one process: all
    args = ModelArgs.from_config(ckpt.config)
    H, d, tp = args.num_attention_heads, args.head_dim, layout.attn_tp
    for rank in range(2):
        logits, tokens, (hit, cached), reads, held, shapes = torch.load(tmp_path / f"{rank}.pt")
        dp_rank = rank // tp
        torch.testing.assert_close(logits, prefill_logits(model, PROMPTS[dp_rank::layout.attn_dp]), atol=1e-4,
                                   rtol=1e-4)
        assert tokens == plain  # greedy: token for token, every rank returns every output
        assert hit == cold and cached == (len(PROMPTS[0]) + GREEDY.max_tokens - 1) // 16 * 16 > 0
        assert elements(reads) == held < elements(everything)  # exactly its slice, read by slice
        experts = {int(n.split(".")[5]) for n in reads if ".mlp.experts." in n}  # model.layers.N.mlp.experts.J.
        assert experts == set(range(rank * 8, rank * 8 + 8))  # 16 experts over EP2: its half only
        for n in ("model.layers.0.attention.q_proj.weight", "model.layers.0.attention.q_conv1d.weight",
                  "model.layers.0.attention.A_log", "model.layers.0.attention.o_proj.weight",
                  "model.layers.2.attention.q_proj.weight", "model.layers.2.attention.dense.weight"):
            assert (reads[n] < everything[n]) == (tp > 1), n
        assert reads["model.layers.2.attention.kv_a_proj_with_mqa.weight"] == \
            everything["model.layers.2.attention.kv_a_proj_with_mqa.weight"]  # the latent: replicated
        for n in ("lm_head.weight", "model.word_embeddings.weight"):
            assert (reads[n] < everything[n]) == (layout.lmhead_tp > 1), n
        # this rank's heads' KDA state (vLLM's split), the whole MLA latent row
        assert shapes["recurrent_state"][1:] == (H // tp, 1, d * d)
        assert shapes["conv_state"][1:] == (args.short_conv_kernel_size - 1, 1, 3 * H * d // tp)
        assert shapes["kv_cache"][1:] == (16, 1, args.kv_lora_rank + args.qk_rope_head_dim)


@pytest.mark.parametrize("world, layout, message", [(8, {"attn_tp": 8}, "attention heads"),
                                                    (4, {"lmhead_tp": 4}, "vocabulary"),
                                                    (32, {}, "routed experts")])  # moe_ep = 32
def test_a_layout_that_does_not_split_the_model_is_refused(world, layout, message):
    args = ModelArgs.from_config(tiny_config(vocab_size=510))  # 4 heads, 16 experts, 510 vocabulary rows
    with pytest.raises(ValueError, match=message):
        check_layout(args, LLMParallelLayout(world_size=world, **layout))


def run(*args):
    return subprocess.run(["bash", str(RUN_SH), *map(str, args)], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})


def completions(stdout: str) -> list[str]:
    return [line for line in stdout.splitlines() if not line.startswith(("requests=", "dtype:"))]


@pytest.mark.slow
def test_run_sh_multi_rank_presets_start_torchrun_and_equal_one_process():
    """fp32: the same completions as one process, for TP2 and DP2 + EP2."""
    one = run("--max-tokens", 6, "--dtype", "fp32")
    assert one.returncode == 0, one.stderr
    for preset in ("tiny-cpu-tp2.yaml", "tiny-cpu-dp2-ep2.yaml"):
        ranks = run("--max-tokens", 6, "--dtype", "fp32", "--config", f"configs/{preset}")
        assert ranks.returncode == 0, ranks.stderr
        prompts = [line for line in (RUN_SH.parent / "prompts.txt").read_text().splitlines() if line.strip()]
        assert completions(ranks.stdout) == completions(one.stdout) and len(completions(one.stdout)) == 2 * len(prompts)
        assert "ranks=2" in ranks.stdout.splitlines()[-1] and ranks.stdout.count("dtype: fp32") == 1
