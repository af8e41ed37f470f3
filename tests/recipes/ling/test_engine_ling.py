"""Ling-3.0-Flash through the engine (paged MLA latent cache + per-request KDA state slots, continuous batching)
against transformers' BailingHybridForCausalLM.generate (greedy, its own cache: KDA decode through its recurrent
path and conv-state update), fp32, on the tiny checkpoint (tiny_ling.py).

Checked: the greedy tokens and their log-probabilities for prompts of several lengths (one past KDA's 64-token
chunk) batched together; the same with chunked prefill (8 tokens a step, so every prompt's state crosses chunks
and block-aligned checkpoints), and with too few blocks (preemption drops the state and recomputes); prefix
caching hit == miss, with the hit counted; no block or state slot held afterwards.
"""
import pytest
import torch
from transformers import AutoTokenizer, BailingHybridForCausalLM

from common.engine import LLM, SamplingParams
from tiny_ling import write_tiny_checkpoint
from weights_ling import load_model

PROMPT_LENGTHS = (5, 13, 37, 70)
NEW_TOKENS = 20
pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py: the tiny model runs faster on one thread


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    path = write_tiny_checkpoint(tmp_path_factory.mktemp("engine") / "ckpt", seed=11)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(2, 500, (n,), generator=g).tolist() for n in PROMPT_LENGTHS]
    hf = BailingHybridForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    hf.generation_config.eos_token_id = None  # run the full length, as ignore_eos does
    expected = []  # per prompt: (greedy tokens, log_softmax of each step's logits [NEW_TOKENS, V])
    with torch.no_grad():
        for ids in prompts:
            out = hf.generate(torch.tensor([ids]), max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0,
                              output_scores=True, return_dict_in_generate=True)
            logprobs = torch.log_softmax(torch.cat(out.scores).float(), -1)
            expected.append((out.sequences[0, len(ids):].tolist(), logprobs))
    return load_model(path, torch.float32), AutoTokenizer.from_pretrained(path), prompts, expected


GREEDY = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=3)


@pytest.mark.parametrize("engine_kwargs", [
    {},  # whole prompts, every request batched at once
    {"max_num_batched_tokens": 8},  # chunked prefill: prompts split over several steps beside decodes
    {"num_blocks": 8},  # too few blocks for all four: preemption by recompute
], ids=["default", "chunked-prefill", "preemption"])
def test_greedy_engine_equals_transformers_generate(setup, engine_kwargs):
    model, tok, prompts, expected = setup
    llm = LLM(model, tok, block_size=16, **engine_kwargs)
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    for out, (tokens, logprobs) in zip(outs, expected):
        assert out.token_ids == tokens
        assert out.finish_reason == "length"
        for step, lp in enumerate(out.logprobs):
            assert abs(lp.logprob - logprobs[step, lp.token_id].item()) < 1e-3
            for token_id, value in lp.top:
                assert abs(value - logprobs[step, token_id].item()) < 1e-3
    engine = llm.engine
    if "num_blocks" in engine_kwargs:
        assert engine.scheduler.num_preemptions > 0
    if "max_num_batched_tokens" in engine_kwargs:
        assert max(engine.stats.recent_step_tokens) <= 8
    assert engine.kv_cache.all_blocks_free()


def test_prefix_cache_hit_equals_miss(setup):
    """A second request extending the first one's sequence (prompt + output + 2 tokens) starts from the KDA state
    checkpoint and the MLA blocks at the last block boundary the first one computed."""
    model, tok, prompts, _ = setup
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    first = prompts[2]  # 37 tokens
    llm = LLM(model, tok, block_size=16)
    out = llm.generate([first], params, use_tqdm=False)[0]
    second = first + out.token_ids + [7, 8]
    warm = llm.generate([second], params, use_tqdm=False)[0]
    cold = LLM(model, tok, block_size=16, enable_prefix_caching=False).generate([second], params,
                                                                             use_tqdm=False)[0]
    assert warm.num_cached_tokens == (len(first) + 12 - 1) // 16 * 16 > 0 and cold.num_cached_tokens == 0
    assert warm.token_ids == cold.token_ids
    assert llm.engine.kv_cache.all_blocks_free()
