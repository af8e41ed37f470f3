"""DeepSeek-V4 over several gloo ranks (attention TP, attention DP, MoE EP, vocabulary-parallel embedding and head)
equals one process: each rank loads its slice of the tiny fp32 checkpoint, runs its DP rank's prompts through a
whole-prompt prefill, and its logits equal the single-process model's on the same prompts."""
import pytest
import torch

from common.engine.model_runner import prefill_logits
from common.parallel import LLMParallelLayout, destroy_parallel, init_parallel
from dist_helpers import run_ranks
from tiny_deepseek_v4 import write_tiny_checkpoint
from weights_deepseek_v4 import load_model

PROMPTS = [[[5, 9, 30, 41, 7, 300, 12, 12, 99], [17, 18, 19]], [[200, 201, 3, 4, 5, 6, 7, 8, 9, 10, 11, 40, 60]]]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("parallel") / "ckpt", seed=4, quantized=False)


@pytest.fixture(scope="module")
def graph_checkpoint(tmp_path_factory):
    """The graph cases' checkpoint: 3 Sinkhorn iterations instead of 20, as every one is unrolled in the compiled
    graphs (compile time); graph == eager holds for any count, and the 20-iteration path is checked eager against
    transformers (test_parity_transformers.py)."""
    return write_tiny_checkpoint(tmp_path_factory.mktemp("parallel-graph") / "ckpt", seed=4, quantized=False,
                                 hc_sinkhorn_iters=3)


def rank_logits(path, world, layout, out_dir):
    parallel = init_parallel(LLMParallelLayout(world_size=world, **layout))
    try:
        model = load_model(path, torch.float32, parallel=parallel)
        held = sum(t.nbytes for t in model.state_dict().values())  # this rank's slice (the checkpoint is fp32)
        prompts = PROMPTS[parallel.rank_in("attn_dp") % len(PROMPTS)]
        torch.save((prefill_logits(model, prompts), model.checkpoint_reads, held), out_dir / f"rank{parallel.rank}.pt")
    finally:
        destroy_parallel()


@pytest.mark.slow
@pytest.mark.parametrize("world, layout", [
    (2, {"attn_tp": 2}),  # TP2 (EP2): the same prompts on both ranks, heads and experts split
    (2, {"embed_tp": 2, "lmhead_tp": 2}),  # DP2 + EP2, vocabulary split across the DP ranks' different tokens
    (4, {"attn_tp": 2, "lmhead_tp": 2}),  # DP2 x TP2, EP4
], ids=["tp2", "dp2-ep2-vocab2", "dp2xtp2-ep4"])
def test_ranks_equal_one_process(checkpoint, tmp_path, world, layout):
    run_ranks(rank_logits, world, checkpoint, world, layout, tmp_path)
    model = load_model(checkpoint, torch.float32)
    want = [prefill_logits(model, prompts) for prompts in PROMPTS]
    everything = model.checkpoint_reads
    assert sum(everything.values()) == sum(t.nbytes for t in model.state_dict().values())  # one process: all
    parallel_layout = LLMParallelLayout(world_size=world, **layout)
    for rank in range(world):
        dp_rank = next(i for i, g in enumerate(parallel_layout.group_ranks("attn_tp")) if rank in g)
        got, reads, held = torch.load(tmp_path / f"rank{rank}.pt")
        torch.testing.assert_close(got, want[dp_rank % len(PROMPTS)], atol=1e-4, rtol=1e-4)
        assert sum(reads.values()) == held < sum(everything.values())  # exactly its slice, read by slice
        ep = parallel_layout.moe_ep
        experts = {int(n.split(".")[4]) for n in reads if ".ffn.experts." in n}  # layers.L.ffn.experts.J.wK
        per_rank = 8 // ep
        assert experts == set(range(rank % ep * per_rank, rank % ep * per_rank + per_rank))  # its experts only
        for name in ("layers.0.attn.wq_b.weight", "layers.0.attn.wo_b.weight", "head.weight"):
            sliced = "head" not in name or parallel_layout.lmhead_tp > 1
            assert (reads[name] < everything[name]) == (sliced and (parallel_layout.attn_tp > 1 or "head" in name))


GEN_PROMPTS = [[5, 9, 30, 41, 7, 300, 12, 12, 99, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15], [17, 18, 19],
               [200, 201, 3, 4, 5, 6, 7, 8, 9, 10, 11, 40, 60], [44, 45, 46, 47, 48]]
GREEDY = dict(temperature=0, max_tokens=12, ignore_eos=True)


def rank_generate(path, world, layout, engine_kwargs, num_prompts, sampled, out_dir):
    from common.engine import LLM, SamplingParams
    from transformers import AutoTokenizer
    parallel = init_parallel(LLMParallelLayout(world_size=world, **layout))
    try:
        mtp = engine_kwargs.get("num_speculative_tokens", 0) > 0
        llm = LLM(load_model(path, torch.float32, parallel=parallel, mtp=mtp), AutoTokenizer.from_pretrained(path),
                  block_size=16, **engine_kwargs)
        params = [SamplingParams(**GREEDY)] * num_prompts
        prompts = GEN_PROMPTS[:num_prompts]
        if sampled:  # one more, sampled: TP peers must draw the same tokens
            params, prompts = params + [SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True)], \
                prompts + [GEN_PROMPTS[0]]
        outs = llm.generate(prompts, params, use_tqdm=False)
        assert llm.engine.kv_cache.all_blocks_free()
        assert not mtp or llm.engine.stats.num_draft_tokens > 0  # the drafts were verified on every rank
        if (graphs := llm.engine.runner.graphs) is not None:  # decode steps ran as graphs on every rank
            assert all(graphs.replays.values())
        torch.save(([o.token_ids for o in outs], llm.engine.scheduler.num_preemptions), out_dir / f"gen{parallel.rank}.pt")
    finally:
        destroy_parallel()


@pytest.mark.slow
@pytest.mark.parametrize("world, layout, engine_kwargs, num_prompts, sampled", [
    (2, {"attn_tp": 2}, {"max_num_batched_tokens": 8, "num_blocks": 8}, 4, True),  # chunked prefill, preemption
    (2, {"lmhead_tp": 2}, {"max_num_batched_tokens": 8, "num_blocks": 4}, 4, False),  # DP2 + EP2, chunked, preempted
    (4, {"attn_tp": 2}, {}, 1, True),  # DP2 x TP2, EP4: one request for two DP ranks: the other one idles
    # MTP speculative decoding over ranks: TP peers draft alike; DP ranks run their MTP forwards in lock-step (the
    # MTP MoE dispatches over EP), the one with fewer requests (3 prompts over 2 ranks) on empty batches at the end
    (2, {"attn_tp": 2}, {"num_speculative_tokens": 2}, 4, True),
    (2, {"lmhead_tp": 2}, {"num_speculative_tokens": 3, "max_num_batched_tokens": 8}, 3, False),
    # graph-mode decode over ranks: DP ranks agree on the bucket each step (2: the rank of 2 requests, and the rank
    # of 1 padded to it, then padding alone once it is done), experts dispatched in fixed-capacity buffers,
    # vocabulary split
    (2, {"embed_tp": 2, "lmhead_tp": 2}, {"exe_mode": "graph", "graph_capture_sizes": (2,),
                                          "max_num_batched_tokens": 8}, 3, False),
    # TP2 (EP2): a greedy and a sampled request (drawn alike by the TP peers) one after the other in bucket 1, the
    # token of a step routed by one TP rank (the expert dispatch's capacity is still the same on both)
    (2, {"attn_tp": 2}, {"exe_mode": "graph", "graph_capture_sizes": (1,), "max_num_seqs": 1}, 1, True),
], ids=["tp2-chunked-preempted", "dp2-ep2-chunked-preempted", "dp2xtp2-ep4-idle", "tp2-mtp2", "dp2-ep2-mtp3-chunked",
        "dp2-ep2-vocab2-graph", "tp2-graph"])
def test_greedy_generation_over_ranks_equals_one_process(request, tmp_path, world, layout, engine_kwargs,
                                                        num_prompts, sampled):
    from common.engine import LLM, SamplingParams
    from transformers import AutoTokenizer
    checkpoint = request.getfixturevalue("graph_checkpoint" if "exe_mode" in engine_kwargs else "checkpoint")
    run_ranks(rank_generate, world, checkpoint, world, layout, engine_kwargs, num_prompts, sampled, tmp_path)
    llm = LLM(load_model(checkpoint, torch.float32), AutoTokenizer.from_pretrained(checkpoint), block_size=16)
    want = [o.token_ids for o in llm.generate(GEN_PROMPTS[:num_prompts], SamplingParams(**GREEDY), use_tqdm=False)]
    results = [torch.load(tmp_path / f"gen{rank}.pt") for rank in range(world)]
    for tokens, _ in results:
        assert tokens[:num_prompts] == want  # greedy: token for token
        assert tokens == results[0][0]  # every rank returns every output; the sampled one agrees across TP peers
    if "num_blocks" in engine_kwargs:
        assert any(preemptions > 0 for _, preemptions in results)
