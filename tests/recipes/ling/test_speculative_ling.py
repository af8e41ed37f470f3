"""Ling-3.0-Flash with MTP speculative decoding and in graph mode, on the tiny checkpoint (fp32): greedy tokens and
log-probs equal plain eager decoding, token for token.

The KDA state after every draft position is kept in its own state slot (the verify step's write columns) and the
slot of the end the step commits becomes the request's state, so a rejected draft costs no recompute. The random MTP
layer almost never predicts the model (the rejection path); `OracleProposer` (tests/mtp_oracle.py) replaces its
drafts with the plain run's tokens, the last of every third call corrupted, so verification accepts 0..k drafts and
every write column is the one kept at some step. Graph mode captures the KDA recurrent step and conv update with
the MLA layers per bucket (decode, and verify steps of 1 + k tokens per sequence)."""
import pytest
import torch
from transformers import AutoTokenizer

from common.engine import LLM, SamplingParams
from mtp_oracle import OracleProposer, check_equal, check_graph_verify_steps
from tiny_ling import write_tiny_checkpoint
from weights_ling import load_model

NEW = 24
GREEDY = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True, logprobs=2)
pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py: the tiny model runs faster on one thread


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    path = write_tiny_checkpoint(tmp_path_factory.mktemp("spec") / "ckpt", seed=5)
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(2, 500, (n,), generator=g).tolist() for n in (5, 13, 37, 70)]
    tok = AutoTokenizer.from_pretrained(path)
    model = load_model(path, torch.float32, mtp=True)
    plain = LLM(model, tok, block_size=16).generate(prompts, GREEDY, use_tqdm=False)
    return model, tok, prompts, plain


DRAFTS = pytest.mark.parametrize("k", [1, 3])
SETTINGS = pytest.mark.parametrize("engine_kwargs", [{}, {"max_num_batched_tokens": 8}, {"num_blocks": 10}],
                                   ids=["default", "chunked-prefill", "preemption"])


@DRAFTS
@SETTINGS
def test_accepted_and_rejected_drafts_commit_exactly_the_plain_tokens(setup, k, engine_kwargs):
    model, tok, prompts, plain = setup
    llm = LLM(model, tok, block_size=16, num_speculative_tokens=k, **engine_kwargs)
    check_equal(llm.generate(prompts[:2], GREEDY, use_tqdm=False), plain[:2])  # the MTP layer's own drafts
    reference = {tuple(p): o.token_ids for p, o in zip(prompts, plain)}
    llm.engine.proposer = OracleProposer(llm.engine.proposer, reference, llm.engine.contract.vocab_size)
    check_equal(llm.generate(prompts, GREEDY, use_tqdm=False), plain)
    engine = llm.engine
    assert 0 < engine.stats.num_accepted_tokens < engine.stats.num_draft_tokens  # both paths taken
    if "num_blocks" in engine_kwargs:
        assert engine.scheduler.num_preemptions > 0
    if "max_num_batched_tokens" in engine_kwargs:
        assert max(engine.stats.recent_step_tokens) <= 8
    assert engine.kv_cache.all_blocks_free()


def test_graph_mode_decode_equals_eager(setup):
    """exe_mode graph, one bucket of 4: every decode step of the four requests replays the compiled graph (the
    padding sequences read and write only the null slot); the tokens and log-probs are eager's."""
    model, tok, prompts, plain = setup
    llm = LLM(model, tok, block_size=16, exe_mode="graph", graph_capture_sizes=(4,))
    check_equal(llm.generate(prompts, GREEDY, use_tqdm=False), plain)
    graphs = llm.engine.runner.graphs
    assert graphs.replays[4] >= NEW - 1
    assert llm.engine.kv_cache.all_blocks_free()


def test_graph_mode_verifies_the_drafts_in_its_graphs(setup):
    """exe_mode graph with k = 2: a verify step (every sequence its token and 2 drafts, a KDA state written for each)
    runs as a graph of 3-token sequences padded to its bucket; == plain decoding with rejected drafts (the random
    MTP layer) and accepted ones (the oracle's, one request padded to the bucket)."""
    model, tok, prompts, plain = setup
    llm = LLM(model, tok, block_size=16, num_speculative_tokens=2, exe_mode="graph", graph_capture_sizes=(4,))
    check_graph_verify_steps(llm, prompts, plain, GREEDY, bucket=4)
