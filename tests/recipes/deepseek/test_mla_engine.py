"""The MLA models (DeepSeek-V3 and V3.2, tiny fp32 checkpoints with their MTP layer) on the engine's other paths.

- MTP speculative decoding equals plain greedy decoding (token for token, log-prob for log-prob), with drafts the
  random MTP layer gets wrong (rejections) and drafts right for a while (`Oracle`: the real proposer runs, its KV
  writes included, then its drafts are replaced by the plain run's tokens, one of every third step corrupted);
  the MTP layer loads the publisher's `model.layers.{num_hidden_layers}` tensors.
- Gloo ranks (slow): TP2 and DP2 + EP2 with the vocabulary split equal one process, each rank reading its slice,
  eager with MTP and in graph mode (the decode steps as graphs on every rank).
- Graph-mode decode equals eager, and with MTP (K = 1: verify steps of 2-token sequences as graphs) equals plain
  greedy decoding; PD disaggregation (Mooncake over TCP) equals one engine; the latent cache's bytes per token for
  the published V3.
"""
import pytest
import torch
from transformers import AutoTokenizer

from common.engine import LLM, SamplingParams
from common.loader import Checkpoint, CheckpointError
from config_deepseek_v3 import ModelArgs, cache_bytes_per_token
from tiny_deepseek_v3 import tiny_config, write_tiny_checkpoint
from weights_deepseek_v3 import load_model
from mtp_oracle import OracleProposer, check_equal, check_graph_verify_steps

NEW = 24
GREEDY = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True, logprobs=2)


def prompts_of(lengths, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(2, 500, (n,), generator=g).tolist() for n in lengths]


PROMPTS = prompts_of((5, 13, 30, 22))


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("mla-engine")
    return {v: write_tiny_checkpoint(root / v, variant=v, seed=3, quantized=False) for v in ("v3", "v32")}


@pytest.fixture(scope="module")
def setup(checkpoints):
    """variant -> (model with its MTP layer, tokenizer, plain greedy outputs of PROMPTS)."""
    out = {}
    for variant, path in checkpoints.items():
        model, tok = load_model(path, torch.float32, mtp=True), AutoTokenizer.from_pretrained(path)
        out[variant] = model, tok, LLM(model, tok, block_size=16).generate(PROMPTS, GREEDY, use_tqdm=False)
    return out


@pytest.mark.parametrize("variant, k, engine_kwargs", [
    ("v3", 1, {}), ("v3", 3, {}),
    ("v3", 3, {"max_num_batched_tokens": 8}),  # prompt chunks beside verify steps
    ("v32", 3, {"num_blocks": 9}),  # the indexer's top-k binds; too few blocks: preemption by recompute
], ids=["v3-k1", "v3-k3", "v3-k3-chunked", "v32-k3-preempted"])
def test_greedy_with_mtp_equals_without(setup, variant, k, engine_kwargs):
    model, tok, plain = setup[variant]
    llm = LLM(model, tok, block_size=16, num_speculative_tokens=k, **engine_kwargs)
    check_equal(llm.generate(PROMPTS, GREEDY, use_tqdm=False), plain)
    engine = llm.engine
    assert engine.stats.num_draft_tokens > 0 and engine.kv_cache.all_blocks_free()
    if "num_blocks" in engine_kwargs:
        assert engine.scheduler.num_preemptions > 0


@pytest.mark.parametrize("variant, k", [("v3", 1), ("v3", 3), ("v32", 3)])
def test_accepted_drafts_commit_exactly_the_plain_tokens(setup, variant, k):
    model, tok, plain = setup[variant]
    llm = LLM(model, tok, block_size=16, num_speculative_tokens=k)
    reference = {tuple(p): o.token_ids for p, o in zip(PROMPTS, plain)}
    llm.engine.proposer = OracleProposer(llm.engine.proposer, reference, llm.engine.contract.vocab_size)
    check_equal(llm.generate(PROMPTS, GREEDY, use_tqdm=False), plain)
    stats = llm.engine.stats
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens  # both paths taken
    assert stats.steps < NEW  # verify steps commit several tokens each
    assert llm.engine.kv_cache.all_blocks_free()


def test_the_mtp_layer_loads_the_publishers_layer_and_caches_beside_the_main_ones(checkpoints, tmp_path):
    path = checkpoints["v3"]
    ckpt, L = Checkpoint(path), ModelArgs.from_config(Checkpoint(path).config).num_hidden_layers
    model = load_model(path, torch.float32, mtp=True)
    mtp = model.mtp[0]
    for name, param in (("eh_proj.weight", mtp.eh_proj.weight), ("enorm.weight", mtp.enorm.weight),
                        ("shared_head.norm.weight", mtp.shared_head.norm.weight),
                        ("self_attn.kv_b_proj.weight", mtp.self_attn.kv_b_proj.state_dict()["weight"])):
        torch.testing.assert_close(param, ckpt.get(f"model.layers.{L}.{name}", torch.float32), rtol=0, atol=0)
    assert not any(n.startswith(f"model.layers.{L}.embed_tokens") for n in model.checkpoint_reads)  # shared: unread
    assert sum(s.group == "latent" for s in model.cache_tensor_specs()) == L + 1  # a latent cache per layer, MTP's too
    plain = load_model(path, torch.float32)
    assert not len(plain.mtp) and not any(n.startswith(f"model.layers.{L}.") for n in plain.checkpoint_reads)
    none = write_tiny_checkpoint(tmp_path / "no-mtp", seed=3, quantized=False, num_nextn_predict_layers=0)
    with pytest.raises(CheckpointError, match="no MTP layer"):
        load_model(none, torch.float32, mtp=True)
    with pytest.raises(ValueError, match="MTP layer"):
        LLM(load_model(none, torch.float32), AutoTokenizer.from_pretrained(none), num_speculative_tokens=1)


def test_latent_cache_bytes_of_the_published_v3():
    """DeepSeek-V3 / R1: 61 layers, 512 + 64 cached values per token and layer, against 128 heads x (192 + 128)."""
    args = ModelArgs.from_config(dict(tiny_config("v3"), num_hidden_layers=61, num_attention_heads=128,
                                      num_key_value_heads=128, kv_lora_rank=512, qk_nope_head_dim=128,
                                      qk_rope_head_dim=64, v_head_dim=128, first_k_dense_replace=3))
    sizes = cache_bytes_per_token(args, dtype_bytes=2)
    assert sizes["latent"] == 61 * 576 * 2 == 70272
    assert sizes["expanded"] == 61 * 128 * 320 * 2
    assert sizes["ratio_x100"] == round(100 * 128 * 320 / 576)  # 71.1x


RANK_GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)


def rank_main(path, world, layout, engine_kwargs, out_dir):
    """One rank: its slice of the checkpoint, its DP rank's prompts' prefill logits, then greedy generation of
    every prompt through the engine (each DP rank runs its share)."""
    from common.parallel import LLMParallelLayout, destroy_parallel, init_parallel
    from common.engine.model_runner import prefill_logits
    parallel = init_parallel(LLMParallelLayout(world_size=world, **layout))
    try:
        mtp = engine_kwargs.get("num_speculative_tokens", 0) > 0
        model = load_model(path, torch.float32, parallel=parallel, mtp=mtp)
        held = sum(t.nbytes for t in model.state_dict().values())
        logits = prefill_logits(model, PROMPTS[parallel.rank_in("attn_dp")::2])
        llm = LLM(model, AutoTokenizer.from_pretrained(path), block_size=16, **engine_kwargs)
        outs = llm.generate(PROMPTS[:3], RANK_GREEDY, use_tqdm=False)  # 3 over DP2: one rank idles at the end
        assert llm.engine.kv_cache.all_blocks_free()
        assert not mtp or llm.engine.stats.num_draft_tokens > 0
        if (graphs := llm.engine.runner.graphs) is not None:  # decode steps ran as graphs on every rank
            assert all(graphs.replays.values())
        torch.save((logits, [o.token_ids for o in outs], model.checkpoint_reads, held), out_dir / f"{parallel.rank}.pt")
    finally:
        destroy_parallel()


@pytest.mark.slow
@pytest.mark.parametrize("variant, layout, engine_kwargs", [
    ("v32", {"attn_tp": 2}, {"num_speculative_tokens": 2}),  # TP2 (EP2): heads split, indexer replicated, MTP
    # DP2 + EP2, vocabulary split, chunked prefill; MTP: the DP ranks' MTP forwards in lock-step (the rank with
    # fewer requests on empty batches at the end)
    ("v3", {"embed_tp": 2, "lmhead_tp": 2}, {"max_num_batched_tokens": 8, "num_speculative_tokens": 2}),
    # graph-mode decode over ranks. TP2 (EP2): one request at a time in bucket 1 (the TP peers' graphs all-reduce
    # the heads' outputs; one TP rank routes the step's token, the expert dispatch in fixed-capacity buffers)
    ("v3", {"attn_tp": 2}, {"exe_mode": "graph", "graph_capture_sizes": (1,), "max_num_seqs": 1}),
    # DP2 + EP2, vocabulary split: the DP ranks agree on bucket 2 each step (the rank of 2 requests; the rank of 1
    # padded to it, then padding alone once it is done), chunked prefill beside the decodes
    ("v3", {"embed_tp": 2, "lmhead_tp": 2}, {"exe_mode": "graph", "graph_capture_sizes": (2,),
                                           "max_num_batched_tokens": 8}),
], ids=["v32-tp2-mtp2", "v3-dp2-ep2-vocab2-chunked-mtp2", "v3-tp2-graph", "v3-dp2-ep2-vocab2-graph"])
def test_ranks_equal_one_process(setup, checkpoints, tmp_path, variant, layout, engine_kwargs):
    """Each rank reads exactly its slice (its heads, its experts, its vocabulary rows); its prefill logits equal
    the one-process model's on the same prompts (1e-4) and its greedy tokens equal one process's."""
    from common.parallel import LLMParallelLayout
    from dist_helpers import run_ranks
    from common.engine.model_runner import prefill_logits
    path = checkpoints[variant]
    run_ranks(rank_main, 2, path, 2, layout, engine_kwargs, tmp_path)
    model, _, plain = setup[variant]
    everything = model.checkpoint_reads  # the one-process model with its MTP layer: what a load reads in all
    L = ModelArgs.from_config(Checkpoint(path).config).num_hidden_layers
    parallel_layout = LLMParallelLayout(world_size=2, **layout)
    for rank in range(2):
        logits, tokens, reads, held = torch.load(tmp_path / f"{rank}.pt")
        dp_rank = rank // parallel_layout.attn_tp
        torch.testing.assert_close(logits, prefill_logits(model, PROMPTS[dp_rank::2]), atol=1e-4, rtol=1e-4)
        assert tokens == [o.token_ids[:10] for o in plain[:3]]  # greedy: the plain run's first tokens
        mtp = "num_speculative_tokens" in engine_kwargs
        assert sum(reads.values()) == held < sum(everything.values())  # exactly its slice, read by slice
        experts = {int(n.split(".")[5]) for n in reads if ".mlp.experts." in n}  # model.layers.N.mlp.experts.J.
        assert experts == set(range(rank * 8, rank * 8 + 8))  # 16 experts over EP2: its half only
        assert any(n.startswith(f"model.layers.{L}.") for n in reads) == mtp
        for name in ("model.layers.0.self_attn.q_b_proj.weight", "model.layers.1.self_attn.kv_b_proj.weight",
                     "model.layers.1.self_attn.o_proj.weight"):
            assert (reads[name] < everything[name]) == (parallel_layout.attn_tp > 1)
        for name in ("lm_head.weight", "model.embed_tokens.weight"):
            assert (reads[name] < everything[name]) == (parallel_layout.lmhead_tp > 1)


@pytest.mark.parametrize("layout, message", [({"attn_tp": 8}, "attention heads"), ({"lmhead_tp": 4}, "vocabulary")])
def test_a_layout_that_does_not_split_the_model_is_refused(layout, message):
    from common.parallel import LLMParallelLayout
    from modeling_deepseek_v3 import check_layout
    args = ModelArgs.from_config(tiny_config("v3", vocab_size=510))  # 4 heads, 16 experts, 510 vocabulary rows
    with pytest.raises(ValueError, match=message):
        check_layout(args, LLMParallelLayout(world_size=max(layout.values()), **layout))


def test_graph_decode_equals_eager(checkpoints):
    """exe_mode graph (buckets 2 and 4: one graph over a symbolic batch size; V3.2: the absorbed sparse path, the
    indexer over the keys the sequences hold, one opaque op that reads their width on the host) against eager:
    tokens and log-probs, with prompt chunks of 8 beside the decodes and a batch that shrinks 4 -> 1 (padded to the
    buckets)."""
    path = checkpoints["v32"]
    tok = AutoTokenizer.from_pretrained(path)
    engine = dict(block_size=16, max_num_seqs=4, max_num_batched_tokens=8)
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, logprobs=2) for n in (30, 20, 10, 25)]
    graph = LLM(load_model(path, torch.float32), tok, exe_mode="graph", graph_capture_sizes=(2, 4), **engine)
    want = LLM(load_model(path, torch.float32), tok, **engine).generate(PROMPTS, params, use_tqdm=False)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        check_equal(graph.generate(PROMPTS, params, use_tqdm=False), want)
    graphs = graph.engine.runner.graphs
    assert graphs.num_graphs == 1 and graphs.replays[2] > 0 and graphs.replays[4] > 0
    assert any("deepseek_v32_decode_top_keys" in e.key for e in prof.key_averages())  # the indexer's op ran
    assert graph.engine.kv_cache.all_blocks_free()


def test_graph_mode_with_mtp_equals_plain(setup, checkpoints):
    """exe_mode graph with the V3 MTP layer, k = 1: a verify step (every sequence its token and its draft) runs as
    a graph of 2-token sequences padded to bucket 4; greedy tokens and log-probs equal plain decoding, with the
    random MTP layer's drafts (mostly rejected) and the oracle's (accepted: one request padded to the bucket)."""
    _, tok, plain = setup["v3"]
    model = load_model(checkpoints["v3"], torch.float32, mtp=True)
    llm = LLM(model, tok, block_size=16, num_speculative_tokens=1, exe_mode="graph", graph_capture_sizes=(4,))
    check_graph_verify_steps(llm, PROMPTS, plain, GREEDY, bucket=4)


def test_pd_disaggregation_equals_colocated(checkpoints):
    """A prefill and a decode server (real uvicorn, Mooncake transfer engines over TCP) behind the router, the V3
    tiny model: the latent blocks (every layer's, the engine's cache tensors) move from P to D, and D's greedy
    tokens and log-probs equal one engine's; P prefilled every prompt (in chunks of 8), D none."""
    from openai import OpenAI

    from common.kv_transfer import DecodeConnector, MooncakeTransport, PrefillConnector
    from common.serving.router import build_router
    from serving.serving_harness import API_KEY, MODEL, running_server, serve_app, wait_until

    path = checkpoints["v3"]
    tok = AutoTokenizer.from_pretrained(path)
    prompts = prompts_of((1, 16, 17, 40), seed=4)
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=1)
    want = LLM(load_model(path, torch.float32), tok, block_size=16).generate(prompts, params, use_tqdm=False)
    prefill = PrefillConnector(MooncakeTransport())
    with running_server(load_model(path, torch.float32), tok, kv_connector=prefill, block_size=16,
                        max_num_batched_tokens=8) as (p_url, p):
        decode = DecodeConnector(MooncakeTransport(), [p_url], transfer_timeout=60, api_key=API_KEY)
        with running_server(load_model(path, torch.float32), tok, kv_connector=decode, block_size=16) as (d_url, d):
            with serve_app(build_router([d_url], 0.2, prefill_urls=[p_url])) as (url, _):
                client = OpenAI(base_url=url + "/v1", api_key=API_KEY, max_retries=0, timeout=60)
                for ids, ref in zip(prompts, want):
                    got = client.completions.create(model=MODEL, prompt=ids, max_tokens=10, temperature=0,
                                                    logprobs=1, extra_body={"ignore_eos": True}).choices[0]
                    assert got.text == ref.text
                    assert got.logprobs.token_logprobs == pytest.approx([lp.logprob for lp in ref.logprobs], abs=1e-4)
                assert prefill.stats.num_transfers == len(prompts)
                assert p.stats.prefill_tokens == sum(map(len, prompts)) and d.stats.prefill_tokens == 0
                assert wait_until(lambda: all(e.kv_cache.all_blocks_free() and not e.scheduler.requests
                                              for e in (p, d)))
