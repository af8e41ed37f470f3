"""Structured output in the executor's modes, on the tiny random DeepSeek-V4 (fp32): attention-TP and attention-DP
(+ EP) ranks under gloo and graph-mode decode give one eager process's constrained greedy tokens; MTP under seeded
sampling with the reasoning end inside a draft window stays valid; a preempted request keeps its grammar, an
aborted one drops it, and a grammar that ends stops the request."""
import dataclasses
import gc
import json
import re
import weakref

import pytest
import torch
from transformers import AutoTokenizer

from common.engine import LLM, SamplingParams, StructuredOutputsParams
from common.parallel import LLMParallelLayout, destroy_parallel, init_parallel
from dist_helpers import run_ranks
from mtp_oracle import OracleProposer
from test_structured_output_engine import Recording
from tiny_deepseek_v4 import write_tiny_checkpoint
from weights_deepseek_v4 import load_model

REGEX = r"[a-z]{2}[0-9]{3}"
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "pattern": "^[a-z]{1,4}$"},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 99}},
          "required": ["name", "age"], "additionalProperties": False}
CHOICES = ["alpha", "beta", "gamma"]
PROMPTS = [[5, 9, 30, 41, 7, 300, 12, 12, 99, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15], [17, 18, 19],
           [200, 201, 3, 4, 5, 6, 7, 8, 9, 10, 11, 40, 60], [44, 45, 46, 47, 48]]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("so-modes") / "ckpt", seed=4, quantized=False,
                                 num_nextn_predict_layers=1)


@pytest.fixture(scope="module")
def tok(checkpoint):
    return AutoTokenizer.from_pretrained(checkpoint)


@pytest.fixture(scope="module")
def eager(checkpoint, tok):
    return LLM(load_model(checkpoint, torch.float32), tok, block_size=16)


def constrained(**kw) -> SamplingParams:
    return SamplingParams(**{"temperature": 0, "max_tokens": 40, **kw})


def reasoning_params(llm, prompt: list[int], **kw) -> SamplingParams:
    """A regex after free reasoning: the end token is one the unconstrained run (same sampling) first shows at
    index m >= 2, so the constrained run reasons m + 1 tokens, then answers (greedy and plain seeded decoding)."""
    p = constrained(skip_special_tokens=False, **kw)
    free = llm.generate([prompt], dataclasses.replace(p, max_tokens=12, ignore_eos=True), use_tqdm=False)[0].token_ids
    m = next(i for i in range(2, 12) if free[i] not in free[:i])
    return dataclasses.replace(p, structured_outputs=StructuredOutputsParams(regex="[0-9]{4}",
                                                                             reasoning_end_token_id=free[m]))


def mixed_batch(llm, tok) -> tuple[list[list[int]], list[SamplingParams]]:
    """Greedy regex (past EOS), JSON schema, choice, the regex after reasoning, and a seeded regex."""
    think = tok.convert_tokens_to_ids("<think>")
    reasoning = reasoning_params(llm, PROMPTS[3] + [think])
    params = [constrained(structured_outputs=StructuredOutputsParams(regex=REGEX), ignore_eos=True),
              constrained(structured_outputs=StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True)),
              constrained(structured_outputs=StructuredOutputsParams(choice=CHOICES)),
              reasoning,
              constrained(structured_outputs=StructuredOutputsParams(regex=REGEX), temperature=1.0, seed=7)]
    return PROMPTS[:3] + [PROMPTS[3] + [think], PROMPTS[0]], params


def answer_after(token_ids: list[int], end: int, tok) -> str:
    """The text between the reasoning end token and the final EOS."""
    assert end in token_ids, token_ids
    return tok.decode(token_ids[token_ids.index(end) + 1: -1])


def check_valid(outs, params, tok):
    regex, obj, choice, reasoning, seeded = outs
    assert re.fullmatch(REGEX, regex.text) and re.fullmatch(REGEX, seeded.text)
    parsed = json.loads(obj.text)
    assert set(parsed) == {"name", "age"} and re.fullmatch("[a-z]{1,4}", parsed["name"])
    assert choice.text in CHOICES
    assert re.fullmatch("[0-9]{4}", answer_after(reasoning.token_ids,
                                                 params[3].structured_outputs.reasoning_end_token_id, tok))
    for o in outs:
        assert o.finish_reason == "stop", (o.text, o.finish_reason)


def rank_generate(path, world, layout, engine_kwargs, prompts, params, out_dir):
    parallel = init_parallel(LLMParallelLayout(world_size=world, **layout))
    try:
        llm = LLM(load_model(path, torch.float32, parallel=parallel), AutoTokenizer.from_pretrained(path),
                  block_size=16, **engine_kwargs)
        outs = llm.generate(prompts, params, use_tqdm=False)
        assert llm.engine.kv_cache.all_blocks_free()
        torch.save(([(o.token_ids, o.finish_reason) for o in outs], llm.engine.scheduler.num_preemptions),
                   out_dir / f"gen{parallel.rank}.pt")
    finally:
        destroy_parallel()


@pytest.mark.slow
@pytest.mark.parametrize("layout, engine_kwargs", [
    ({"attn_tp": 2}, {}),  # TP2 (EP2): both ranks mask the same rows alike
    ({"lmhead_tp": 2}, {"max_num_batched_tokens": 8, "num_blocks": 4}),  # DP2 + EP2, vocabulary split, preempted
], ids=["tp2", "dp2-ep2-chunked-preempted"])
def test_constrained_generation_over_ranks_equals_one_process(checkpoint, tok, eager, tmp_path, layout,
                                                             engine_kwargs):
    prompts, params = mixed_batch(eager, tok)
    want = eager.generate(prompts, params, use_tqdm=False)
    check_valid(want, params, tok)
    run_ranks(rank_generate, 2, checkpoint, 2, layout, engine_kwargs, prompts, params, tmp_path)
    results = [torch.load(tmp_path / f"gen{rank}.pt") for rank in range(2)]
    for outs, _ in results:
        assert outs[:4] == [(o.token_ids, o.finish_reason) for o in want[:4]]  # greedy: token for token
        assert outs == results[0][0]  # the seeded one: TP peers drew alike; DP ranks returned every output
        assert re.fullmatch(REGEX, tok.decode(outs[4][0], skip_special_tokens=True)) and outs[4][1] == "stop"
    if "num_blocks" in engine_kwargs:  # a preempted request recomputed its tokens, its grammar untouched
        assert any(preemptions > 0 for _, preemptions in results)


@pytest.mark.slow
def test_graph_decode_equals_eager_under_grammars(tmp_path_factory, tok):
    """test_graph_decode's checkpoint, engine and buckets (1, 4) (its compiled graphs are inductor's cache hits):
    batches of 4 and fewer (padded) constrained requests, chunked prefill, preemption."""
    path = write_tiny_checkpoint(tmp_path_factory.mktemp("so-graph") / "ckpt", seed=5, quantized=False, index_topk=4)
    engine = dict(block_size=16, max_num_seqs=4, max_num_batched_tokens=8, num_blocks=12)
    eager = LLM(load_model(path, torch.float32), tok, **engine)
    graph = LLM(load_model(path, torch.float32), tok, exe_mode="graph", graph_capture_sizes=(1, 4), **engine)
    print(f"graph compile (buckets 1, 4): {graph.engine.runner.graphs.capture_seconds:.1f} s")
    prompts, params = mixed_batch(eager, tok)
    want = eager.generate(prompts, params, use_tqdm=False)
    replays = dict(graph.engine.runner.graphs.replays)
    got = graph.generate(prompts, params, use_tqdm=False)
    assert [(o.token_ids, o.finish_reason) for o in got] == [(o.token_ids, o.finish_reason) for o in want]
    assert all(graph.engine.runner.graphs.replays[n] > replays[n] for n in replays)  # constrained decodes as graphs
    check_valid(got, params, tok)
    assert graph.engine.kv_cache.all_blocks_free()


def test_seeded_mtp_with_the_reasoning_end_inside_a_draft_window(checkpoint, tok, eager):
    """K = 2, seeded sampling: drafts from a plain run of the same request (right for a while, every third call's
    last one corrupted), so the reasoning end token is drafted and verified inside a window; where the sampled
    reasoning ends, the answer after it matches the regex and the request stops at the grammar's end."""
    think = tok.convert_tokens_to_ids("<think>")
    model = load_model(checkpoint, torch.float32, mtp=True)  # a model holds its engine's cache: one each
    plain = LLM(load_model(checkpoint, torch.float32), tok, block_size=16)
    spec = LLM(model, tok, block_size=16, num_speculative_tokens=2)
    engine = spec.engine
    prompts = [PROMPTS[1] + [think], PROMPTS[2] + [think]]
    params = [reasoning_params(plain, p, temperature=0.7, seed=s) for p, s in zip(prompts, (3, 4))]
    reference = {tuple(p): o.token_ids for p, o in zip(prompts, plain.generate(prompts, params, use_tqdm=False))}
    engine.proposer = OracleProposer(engine.proposer, reference, engine.contract.vocab_size)
    engine.structured_output = Recording(tok, model)
    outs = spec.generate(prompts, params, use_tqdm=False)
    answered = 0
    for out, p in zip(outs, params):
        end = p.structured_outputs.reasoning_end_token_id
        if end not in out.token_ids:  # sampled reasoning went elsewhere: still free, up to max_tokens
            assert out.finish_reason == "length"
            continue
        answered += 1
        assert out.finish_reason == "stop" and out.token_ids[-1] in model.args.eos_token_ids
        assert re.fullmatch("[0-9]{4}", answer_after(out.token_ids, end, tok))
    assert answered > 0
    assert engine.structured_output.boundaries > 0  # the end token sat among a window's drafts
    assert 0 < engine.stats.num_accepted_tokens < engine.stats.num_draft_tokens
    assert engine.kv_cache.all_blocks_free()


def test_a_preempted_request_keeps_its_grammar(checkpoint, tok, eager):
    """Four constrained requests in a cache that cannot hold them all: preemption by recompute keeps the committed
    tokens and so the grammar state; the outputs are those of a cache that never preempts."""
    small = LLM(load_model(checkpoint, torch.float32), tok, block_size=16, max_num_batched_tokens=8, num_blocks=4)
    prompts, params = mixed_batch(eager, tok)
    want = eager.generate(prompts, params, use_tqdm=False)
    got = small.generate(prompts, params, use_tqdm=False)
    assert small.engine.scheduler.num_preemptions > 0 and eager.engine.scheduler.num_preemptions == 0
    assert [(o.token_ids, o.finish_reason) for o in got] == [(o.token_ids, o.finish_reason) for o in want]
    assert small.engine.kv_cache.all_blocks_free()


def test_an_aborted_request_drops_its_grammar_and_blocks(tok, eager):
    engine = eager.engine
    so = StructuredOutputsParams(json=SCHEMA)
    running = [engine.add_request(p, constrained(structured_outputs=so, max_tokens=30)) for p in PROMPTS[:2]]
    engine.step()
    engine.step()
    queued = engine.add_request(PROMPTS[2], constrained(structured_outputs=so, max_tokens=30))  # not yet scheduled
    ids = running + [queued]
    assert all(engine.requests[r].output_token_ids for r in running)
    states = [weakref.ref(engine.requests[r].grammar) for r in ids]
    for r in ids:
        engine.abort(r)
    gc.collect()
    assert all(s() is None for s in states)  # no one holds the matchers any more
    assert not engine.has_unfinished() and engine.kv_cache.all_blocks_free()


def test_a_grammar_that_ends_stops_the_request(tok, eager):
    """Under ignore_eos and with max_tokens to spare, a choice ends at its EOS ("stop"); one cut by max_tokens
    first ends "length" with a prefix of a choice."""
    so = StructuredOutputsParams(choice=CHOICES)
    ended, cut = eager.generate([PROMPTS[2]] * 2, [constrained(structured_outputs=so, ignore_eos=True),
                                                  constrained(structured_outputs=so, max_tokens=1)], use_tqdm=False)
    assert ended.finish_reason == "stop" and ended.text in CHOICES and len(ended.token_ids) < 40
    assert ended.token_ids[-1] in eager.engine.model.args.eos_token_ids
    assert cut.finish_reason == "length" and len(cut.token_ids) == 1
    assert any(c.startswith(cut.text) and c != cut.text for c in CHOICES)
