"""Prompt log-probs (what `echo` + `logprobs` scores) through the engine equal a full-sequence forward of the same
prompt with transformers.DeepseekV4ForCausalLM: whole, chunked, preempted, beside a prefix-cache hit, max_tokens 0."""
import pytest
import torch
from transformers import AutoTokenizer, DeepseekV4ForCausalLM

from common.engine import LLM, SamplingParams
from tiny_deepseek_v4 import write_tiny_checkpoint
from weights_deepseek_v4 import load_model

PROMPT_LENGTHS = (9, 40, 23)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    path = write_tiny_checkpoint(tmp_path_factory.mktemp("prompt-lp") / "ckpt", seed=5, quantized=False,
                                 index_topk=64)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(2, 500, (n,), generator=g).tolist() for n in PROMPT_LENGTHS]
    hf = DeepseekV4ForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():  # log_softmax of the logits at every prompt position
        full = [torch.log_softmax(hf(torch.tensor([p])).logits[0].float(), -1) for p in prompts]
    return load_model(path, torch.float32), AutoTokenizer.from_pretrained(path), prompts, full


def check(out, prompt, logprobs, k):
    assert len(out.prompt_logprobs) == len(prompt) - 1  # tokens 1.. (the first has nothing before it)
    for i, lp in enumerate(out.prompt_logprobs):
        assert lp.token_id == prompt[i + 1]
        assert abs(lp.logprob - logprobs[i, prompt[i + 1]].item()) < 1e-4
        assert len(lp.top) == k
        want = logprobs[i].topk(k)
        assert [t for t, _ in lp.top] == want.indices.tolist()
        assert all(abs(v - w) < 1e-4 for (_, v), w in zip(lp.top, want.values.tolist()))


@pytest.mark.parametrize("engine_kwargs", [
    {},  # whole prompts in one step
    {"max_num_batched_tokens": 8},  # chunked: positions scored over several steps
    {"num_blocks": 6},  # preemption by recompute: each prompt token is scored once
], ids=["whole", "chunked", "preemption"])
def test_prompt_logprobs_equal_a_full_sequence_forward(setup, engine_kwargs):
    model, tok, prompts, full = setup
    llm = LLM(model, tok, block_size=16, **engine_kwargs)
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, prompt_logprobs=3)
    outs = llm.generate(prompts, params, use_tqdm=False)
    for out, prompt, logprobs in zip(outs, prompts, full):
        check(out, prompt, logprobs, 3)
        assert len(out.token_ids) == 20
    if "num_blocks" in engine_kwargs:
        assert llm.engine.scheduler.num_preemptions > 0
    assert llm.engine.kv_cache.all_blocks_free()


def test_max_tokens_0_scores_the_prompt_and_generates_nothing(setup):
    model, tok, prompts, full = setup
    llm = LLM(model, tok, block_size=16)
    out = llm.generate([prompts[1]], SamplingParams(max_tokens=0, prompt_logprobs=0), use_tqdm=False)[0]
    assert out.token_ids == [] and out.finish_reason == "length" and out.text == ""
    check(out, prompts[1], full[1], 0)
    assert llm.engine.kv_cache.all_blocks_free()


def test_a_cached_prefix_is_recomputed_for_prompt_logprobs(setup):
    model, tok, prompts, full = setup
    llm = LLM(model, tok, block_size=16)
    llm.generate([prompts[1]], SamplingParams(max_tokens=1), use_tqdm=False)  # its blocks enter the prefix cache
    before = llm.engine.stats.prefill_tokens
    out = llm.generate([prompts[1]], SamplingParams(max_tokens=1, prompt_logprobs=1), use_tqdm=False)[0]
    assert out.num_cached_tokens == 0 and llm.engine.stats.prefill_tokens - before == len(prompts[1])
    check(out, prompts[1], full[1], 1)
    again = llm.generate([prompts[1]], SamplingParams(max_tokens=1), use_tqdm=False)[0]
    assert again.num_cached_tokens == 32 and again.prompt_logprobs is None  # others still hit
