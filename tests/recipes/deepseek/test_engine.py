"""DeepSeek-V4 through the engine (paged caches, continuous batching) against transformers.

Reference: greedy decoding by full-sequence recompute with transformers.DeepseekV4ForCausalLM (argmax of the
whole-sequence forward at each step). index_topk (64) is at least the number of compressed entries any
sequence here reaches (85 tokens / ratio 4 = 21), so the indexer keeps every visible entry and exact score
ties cannot change the selection between the two implementations.
"""
import pytest
import torch
from transformers import AutoTokenizer, DeepseekV4ForCausalLM

from common.engine import LLM, SamplingParams
from tiny_deepseek_v4 import write_tiny_checkpoint
from weights_deepseek_v4 import load_model

PROMPT_LENGTHS = (5, 13, 37, 22)
NEW_TOKENS = 48


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    path = write_tiny_checkpoint(tmp_path_factory.mktemp("engine") / "ckpt", seed=11, quantized=False, index_topk=64)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(2, 500, (n,), generator=g).tolist() for n in PROMPT_LENGTHS]
    hf = DeepseekV4ForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    expected = []  # per prompt: (greedy tokens, log_softmax of each step's logits)
    with torch.no_grad():
        for ids in prompts:
            seq, logprobs = list(ids), []
            for _ in range(NEW_TOKENS):
                logits = hf(torch.tensor([seq])).logits[0, -1]
                logprobs.append(torch.log_softmax(logits.float(), -1))
                seq.append(int(logits.argmax()))
            expected.append((seq[len(ids):], torch.stack(logprobs)))
    return load_model(path, torch.float32), AutoTokenizer.from_pretrained(path), prompts, expected


GREEDY = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=3)


@pytest.mark.parametrize("engine_kwargs", [
    {},  # whole prompts, every request batched at once
    {"max_num_batched_tokens": 8},  # chunked prefill: prompts split over several steps beside decodes
    {"num_blocks": 12},  # too few blocks for all four: preemption by recompute
], ids=["default", "chunked-prefill", "preemption"])
def test_greedy_engine_equals_transformers_full_recompute(setup, engine_kwargs):
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
        # the recomputes hit their own freed blocks, but num_cached_tokens is the first scheduling's (vLLM's): none
        assert engine.kv_cache.stats.prefix_cache_hits > 0 and all(o.num_cached_tokens == 0 for o in outs)
    if "max_num_batched_tokens" in engine_kwargs:
        assert max(engine.stats.recent_step_tokens) <= 8
    assert engine.kv_cache.all_blocks_free()


def test_prefix_cache_hit_equals_miss_and_skips_shared_blocks(setup):
    model, tok, prompts, _ = setup
    shared = prompts[2][:32]  # two full blocks of 16
    first, second = shared + [7, 8, 9], shared + [11, 12]
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    cold = LLM(model, tok, block_size=16, enable_prefix_caching=False).generate([second], params, use_tqdm=False)[0]
    llm = LLM(model, tok, block_size=16)
    llm.generate([first], params, use_tqdm=False)
    prefill_before = llm.engine.stats.prefill_tokens
    warm = llm.generate([second], params, use_tqdm=False)[0]
    assert warm.num_cached_tokens == 32 and cold.num_cached_tokens == 0
    assert llm.engine.stats.prefill_tokens - prefill_before == len(second) - 32
    assert warm.token_ids == cold.token_ids
    assert llm.engine.kv_cache.all_blocks_free()


def test_seeded_sampling_is_reproducible_across_batches(setup):
    model, tok, prompts, _ = setup
    seeded = SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=12, ignore_eos=True)
    llm = LLM(model, tok, block_size=16)
    alone = llm.generate([prompts[1]], seeded, use_tqdm=False)[0].token_ids
    others = SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True)
    batched = llm.generate([prompts[0], prompts[1], prompts[3]], [others, seeded, others], use_tqdm=False)[1].token_ids
    assert alone == batched
    other_seed = llm.generate([prompts[1]], SamplingParams(temperature=1.0, top_p=0.9, seed=99, max_tokens=12,
                                                          ignore_eos=True), use_tqdm=False)[0].token_ids
    assert other_seed != alone
    assert llm.engine.kv_cache.all_blocks_free()


def test_stop_conditions(setup):
    model, tok, prompts, expected = setup
    tokens = expected[0][0]
    llm = LLM(model, tok, block_size=16)
    out = llm.generate([prompts[0]], SamplingParams(temperature=0, max_tokens=40, stop_token_ids=[tokens[5]]),
                       use_tqdm=False)[0]
    assert out.finish_reason == "stop" and out.token_ids == tokens[: tokens.index(tokens[5]) + 1]
    text = tok.decode(tokens[:10], skip_special_tokens=True)
    stop = text[len(text) // 2:][:3]
    if stop:
        out = llm.generate([prompts[0]], SamplingParams(temperature=0, max_tokens=40, stop=[stop], ignore_eos=True),
                           use_tqdm=False)[0]
        assert out.finish_reason == "stop" and stop not in out.text
    assert llm.engine.kv_cache.all_blocks_free()


def test_bad_requests_are_refused_up_front(setup):
    model, tok, prompts, _ = setup
    llm = LLM(model, tok, block_size=16, max_model_len=64, num_blocks=4)  # 3 usable blocks: 48 tokens
    assert llm.engine.config.max_model_len == 48  # lowered so that one request always fits the whole cache
    with pytest.raises(ValueError, match="at most 47"):
        llm.generate([list(range(2, 80))], use_tqdm=False)
    out = llm.generate([prompts[2]], SamplingParams(max_tokens=20, ignore_eos=True), use_tqdm=False)[0]
    assert out.finish_reason == "length" and len(prompts[2]) + len(out.token_ids) == 48
    with pytest.raises(ValueError, match="max_tokens"):
        SamplingParams(max_tokens=-1)
    assert llm.engine.kv_cache.all_blocks_free()


def test_engine_config_is_resolved_once_and_never_changed(setup):
    import dataclasses

    from common.engine import EngineConfig, LLMEngine
    model, tok, _, _ = setup
    asked = EngineConfig(block_size=16, max_model_len=64, num_blocks=4)
    engine = LLMEngine(model, tok, asked)
    assert asked.max_model_len == 64  # the caller's config is untouched
    assert engine.config is engine.runner.config is engine.scheduler.config and engine.config.max_model_len == 48
    with pytest.raises(dataclasses.FrozenInstanceError):
        engine.config.max_model_len = 1000


def test_prompts_that_can_never_run_without_chunked_prefill_are_refused_up_front(setup):
    from common.engine import EngineConfig, LLMEngine
    model, tok, prompts, _ = setup
    with pytest.raises(ValueError, match="max_num_batched_tokens .* must be >= max_model_len"):
        EngineConfig(enable_chunked_prefill=False, max_num_batched_tokens=32, max_model_len=64)
    with pytest.raises(ValueError, match="enable_chunked_prefill"):  # max_model_len from the model (> 32)
        LLMEngine(model, tok, EngineConfig(enable_chunked_prefill=False, max_num_batched_tokens=32))
    llm = LLM(model, tok, block_size=16, enable_chunked_prefill=False, max_num_batched_tokens=48, max_model_len=48)
    with pytest.raises(ValueError, match="at most 47"):  # refused when made, not inside step()
        llm.generate([list(range(2, 60))], use_tqdm=False)
    out = llm.generate([prompts[1]], SamplingParams(max_tokens=40, ignore_eos=True), use_tqdm=False)[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 48 - len(prompts[1])  # max_model_len
    assert llm.engine.kv_cache.all_blocks_free()


def test_the_window_group_gets_only_what_the_running_requests_span(setup):
    """blocks_that_fit: the sliding-window group is sized by max_num_seqs (its blocks are freed as the window
    slides), the full groups take the rest of the budget; 16 requests of 85 tokens run without a preemption."""
    from common.engine import EngineConfig, LLMEngine
    model, tok, prompts, expected = setup
    engine = LLMEngine(model, tok, EngineConfig(block_size=16, max_num_seqs=16, max_num_batched_tokens=64,
                                                kv_cache_memory_bytes=2 * 2**20))
    blocks = engine.runner.num_blocks
    window = next(s for s in engine.runner.specs if s.sliding_window is not None)
    assert blocks[window.name] == 16 * (-(-(window.sliding_window - 1) // 16) + 1) + 64 // 16 + 1
    assert all(blocks[s.name] > blocks[window.name] for s in engine.runner.specs if s.sliding_window is None)
    llm = LLM(model, tok, block_size=16, max_num_seqs=16, max_num_batched_tokens=64, kv_cache_memory_bytes=2 * 2**20)
    outs = llm.generate(prompts * 4, GREEDY, use_tqdm=False)
    assert [o.token_ids for o in outs[:4]] == [t for t, _ in expected]
    assert llm.engine.scheduler.num_preemptions == 0 and llm.engine.kv_cache.all_blocks_free()


def test_an_engine_whose_caches_another_engine_reallocated_fails_its_requests_not_the_model(setup):
    """Two engines on one model: the second reallocates the model's caches. The first engine's next step fails its
    requests with the reason (its block tables point into caches it no longer owns) and frees their blocks; the
    second engine serves."""
    model, tok, prompts, _ = setup
    first = LLM(model, tok, block_size=16, num_blocks=20)
    second = LLM(model, tok, block_size=16, num_blocks=24)
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    out = first.generate([prompts[0]], params, use_tqdm=False)[0]
    assert out.finish_reason == "error" and "reallocated by another engine" in out.error
    assert first.engine.kv_cache.all_blocks_free()
    assert second.generate([prompts[0]], params, use_tqdm=False)[0].finish_reason == "length"
