"""MTP speculative decoding through the engine: greedy outputs with k drafts a step equal those without, token for
token and log-prob for log-prob, with chunked prefill, preemption, a prefix-cache hit and the CSA top-k binding
(index_topk 4 against up to 20 compressed entries); no block leaks.

The tiny random MTP layer almost never predicts the model (acceptance ~0), which checks the rejection path. The
acceptance path is checked with drafts that are right for a while and then wrong: `Oracle` runs the real MTP
proposer (its KV writes included) and then replaces its drafts with the plain run's tokens, the last one of every
third step corrupted, so verification accepts 0..k drafts and rolls the rest back."""
import pytest
import torch
from transformers import AutoTokenizer

from common.engine import LLM, SamplingParams
from tiny_deepseek_v4 import write_tiny_checkpoint
from weights_deepseek_v4 import load_model
from mtp_oracle import OracleProposer, check_equal, check_graph_verify_steps

NEW = 30
GREEDY = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True, logprobs=2)


def make_setup(path, **overrides):
    path = write_tiny_checkpoint(path, seed=3, quantized=False, num_nextn_predict_layers=1, **overrides)
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(2, 500, (n,), generator=g).tolist() for n in (5, 13, 37, 22)]
    tok = AutoTokenizer.from_pretrained(path)
    model = load_model(path, torch.float32, mtp=True)
    plain = LLM(model, tok, block_size=16).generate(prompts, GREEDY, use_tqdm=False)
    return model, tok, prompts, plain


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    return make_setup(tmp_path_factory.mktemp("spec") / "ckpt")


@pytest.fixture(scope="module")
def graph_setup(tmp_path_factory):
    """`setup` with 3 Sinkhorn iterations instead of 20, for the graph-mode test: the compiled graphs unroll every
    one (compile time); graph == eager holds for any count, and the 20-iteration path is checked eager against
    transformers (test_parity_transformers.py)."""
    return make_setup(tmp_path_factory.mktemp("spec-graph") / "ckpt", hc_sinkhorn_iters=3)


DRAFTS = pytest.mark.parametrize("k", [1, 3])
SETTINGS = pytest.mark.parametrize("engine_kwargs", [{}, {"max_num_batched_tokens": 8}, {"num_blocks": 12}],
                                   ids=["default", "chunked-prefill", "preemption"])


@DRAFTS
@SETTINGS
def test_greedy_with_mtp_equals_without(setup, k, engine_kwargs):
    model, tok, prompts, plain = setup
    llm = LLM(model, tok, block_size=16, num_speculative_tokens=k, **engine_kwargs)
    check_equal(llm.generate(prompts, GREEDY, use_tqdm=False), plain)
    engine = llm.engine
    assert engine.stats.num_draft_tokens > 0 and engine.kv_cache.all_blocks_free()
    if "num_blocks" in engine_kwargs:
        assert engine.scheduler.num_preemptions > 0


@DRAFTS
@SETTINGS
def test_accepted_and_rejected_drafts_commit_exactly_the_plain_tokens(setup, k, engine_kwargs):
    model, tok, prompts, plain = setup
    llm = LLM(model, tok, block_size=16, num_speculative_tokens=k, **engine_kwargs)
    reference = {tuple(p): o.token_ids for p, o in zip(prompts, plain)}
    llm.engine.proposer = OracleProposer(llm.engine.proposer, reference, llm.engine.contract.vocab_size)
    check_equal(llm.generate(prompts, GREEDY, use_tqdm=False), plain)
    stats = llm.engine.stats
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens  # both paths taken
    assert stats.mean_accepted_length > 1.3
    if not engine_kwargs:  # each verifying step commits up to k + 1 tokens: fewer steps than tokens
        assert stats.steps < NEW
    assert llm.engine.kv_cache.all_blocks_free()


def test_graph_mode_verifies_the_drafts_in_its_graphs(graph_setup):
    """exe_mode graph with k = 2: a verify step (every sequence its token and 2 drafts) runs as a graph of 3-token
    sequences padded to its bucket; greedy tokens and log-probs equal plain decoding, with rejected drafts (the
    random MTP layer, 4 requests) and accepted ones (the oracle's, 1 request padded to the bucket of 4)."""
    model, tok, prompts, plain = graph_setup
    llm = LLM(model, tok, block_size=16, num_speculative_tokens=2, exe_mode="graph", graph_capture_sizes=(4,))
    check_graph_verify_steps(llm, prompts, plain, GREEDY, bucket=4)


def test_a_prefix_cache_hit_with_mtp_equals_a_miss(setup):
    model, tok, prompts, _ = setup
    shared = prompts[2][:32]
    first, second = shared + [7, 8, 9], shared + [11, 12]
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    cold = LLM(model, tok, block_size=16, enable_prefix_caching=False).generate([second], params, use_tqdm=False)[0]
    llm = LLM(model, tok, block_size=16, num_speculative_tokens=2)
    llm.generate([first], params, use_tqdm=False)
    warm = llm.generate([second], params, use_tqdm=False)[0]
    assert warm.num_cached_tokens == 32 and warm.token_ids == cold.token_ids
    assert llm.engine.kv_cache.all_blocks_free()


def test_sampled_requests_speculate_by_the_sampling_rule_beside_greedy_ones(setup):
    """Sampled requests verify their drafts by Sampler.verify (its distribution: tests/common/
    test_speculative_sampling.py): a seeded one is reproducible and stays in its top-k; the greedy companion's
    tokens are unchanged; drafts of both are verified."""
    model, tok, prompts, plain = setup
    sampled = SamplingParams(temperature=0.8, top_k=3, seed=5, max_tokens=NEW, ignore_eos=True, logprobs=3)
    runs = []
    for _ in range(2):
        llm = LLM(model, tok, block_size=16, num_speculative_tokens=2)
        outs = llm.generate([prompts[0], prompts[1]], [GREEDY, sampled], use_tqdm=False)
        runs.append(outs[1].token_ids)
        check_equal(outs[:1], plain[:1])
        assert llm.engine.stats.num_draft_tokens > 2 * NEW and llm.engine.kv_cache.all_blocks_free()
        for lp in outs[1].logprobs:  # each sampled token is one of its step's 3 most likely
            assert lp.token_id in [t for t, _ in lp.top]
    assert runs[0] == runs[1] and len(runs[0]) == NEW


def test_speculation_needs_the_mtp_layer(setup, tmp_path):
    _, tok, _, _ = setup
    path = write_tiny_checkpoint(tmp_path / "no-mtp", seed=3, quantized=False)
    with pytest.raises(ValueError, match="MTP layer"):
        LLM(load_model(path, torch.float32), tok, block_size=16, num_speculative_tokens=1)
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        LLM(load_model(path, torch.float32), tok, block_size=16, num_speculative_tokens=-1)
