"""MoE offload in DeepSeek-V4 (N resident experts per layer, the rest on the host): offloaded == all-resident for
every placement (fp32: logits within 1e-4, greedy tokens identical through the engine), per layer resident +
host + shared == the full MoE, dynamic placement swapping experts in place between and during requests, the
refusals (layouts, values, memory), and kt-kernel within its bf16 rounding (skipped where it cannot run)."""
import json

import pytest
import torch
from transformers import AutoTokenizer

import generate
from common import ops
from common.engine import LLM, SamplingParams
from common.engine.model_runner import prefill_logits
from common.offload import MoEOffloadConfig, RoutingCounter, TorchHostExperts, kt_kernel_unavailable
from common.parallel import LLMParallelLayout, Parallel
from config_deepseek_v4 import ModelArgs
from modeling_deepseek_v4 import DeepseekV4
from tiny_deepseek_v4 import TINY_CONFIG, write_tiny_checkpoint
from weights_deepseek_v4 import check_fits, load_model, model_bytes, shard_placement

KT_REASON = kt_kernel_unavailable()
PROMPTS = [[5, 9, 17, 33, 2, 7, 100, 200, 300, 11, 12], [3, 4, 5, 6], [40, 41, 42, 43, 44, 45, 46, 47, 48]]
GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    """The publisher's format (FP8 linears, MXFP4 experts), loaded in fp32: resident and host weights are the
    same dequantized values."""
    return write_tiny_checkpoint(tmp_path_factory.mktemp("offload") / "ckpt", seed=3)


@pytest.fixture(scope="module")
def graph_ckpt(tmp_path_factory):
    """`ckpt` with 3 Sinkhorn iterations instead of 20, for the graph-mode test: the compiled graph unrolls every
    one (compile time); graph == eager holds for any count, and the 20-iteration path is checked eager against
    transformers (test_parity_transformers.py)."""
    return write_tiny_checkpoint(tmp_path_factory.mktemp("offload-graph") / "ckpt", seed=3, hc_sinkhorn_iters=3)


@pytest.fixture(scope="module")
def full(ckpt):
    return load_model(ckpt, torch.float32, mtp=True)


@pytest.fixture(scope="module")
def reference_logits(full):
    return prefill_logits(full, PROMPTS)


@pytest.fixture(scope="module")
def counts_file(full, ckpt, tmp_path_factory):
    """A routing-count file recorded on the all-resident model (as generate.py --record-routing writes it)."""
    counter = RoutingCounter(full.args.n_routed_experts)
    full.record_routing(counter)
    prefill_logits(full, PROMPTS)
    full.record_routing(None)
    path = tmp_path_factory.mktemp("counts") / "counts.json"
    counter.save(path)
    return path


def offloaded(ckpt, n, **kw):
    return load_model(ckpt, torch.float32, offload=MoEOffloadConfig(n, **kw), mtp=True)


@pytest.mark.parametrize("n", [0, 1, 3, 8])
def test_prefix_placement_equals_all_resident(ckpt, reference_logits, n):
    model = offloaded(ckpt, n)
    assert model.layers[0].ffn.experts.w13.shape[0] == n  # N fixed slots, the hash-routed layer 0 too
    assert model.offload.resident.experts[0].tolist() == list(range(n))
    assert torch.allclose(prefill_logits(model, PROMPTS), reference_logits, atol=1e-4, rtol=0)
    assert (model.offload.hit_rate() == 0) == (n == 0) and (model.offload.hit_rate() == 1) == (n == 8)


def test_frequency_placement_takes_the_most_routed_and_equals_all_resident(ckpt, counts_file, reference_logits):
    data = json.loads(counts_file.read_text())
    model = offloaded(ckpt, 2, placement="frequency", frequency_file=str(counts_file))
    for layer in range(4):
        counts = data["counts"][str(layer)]
        chosen = model.offload.resident.experts[layer].tolist()
        assert sorted(counts[e] for e in chosen) == sorted(counts)[-2:]  # the two most routed experts
    assert torch.allclose(prefill_logits(model, PROMPTS), reference_logits, atol=1e-4, rtol=0)


def test_only_resident_experts_are_dequantized_on_load(ckpt):
    model = offloaded(ckpt, 2)
    reads = model.checkpoint_reads  # {stored name: bytes read}
    for e in range(1, 8):  # slot expert 1 read twice (dequantized into its slot, and for the host), the others
        name = f"layers.2.ffn.experts.{e}.w1.weight"  # once, as stored, for the host only (expert 0, read
        assert reads[name] == (2 if e == 1 else 1) * 64 * 32 // 2, e  # for the shapes too, is left out)
    host = model.offload.host
    assert isinstance(host, TorchHostExperts) and set(host.layers) == {0, 1, 2, 3, 4}  # the MTP block's too
    held = sum(x.nbytes for x in host.experts.values())
    assert held == model_bytes(model.args, torch.float32, True, 2)["host"]  # one MXFP4 copy of every expert


def test_resident_plus_host_plus_shared_equals_the_full_moe_per_layer(ckpt, full):
    model = offloaded(ckpt, 3)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(10, model.args.hidden_size, generator=g)  # [T, D]
    ids = torch.randint(2, 500, (10,), generator=g)
    for layer in range(4):
        moe_full, moe = full.layers[layer].ffn, model.layers[layer].ffn
        a = moe.args
        logits = torch.nn.functional.linear(x, moe.gate.weight)
        weights, idx = ops.moe_gating_topk(logits, a.num_experts_per_tok, bias=None if moe.hash else moe.gate.bias,
                                           score_func=a.scoring_func, renorm=a.norm_topk_prob,
                                           routed_scaling_factor=a.routed_scaling_factor,
                                           tid2eid=moe.gate.tid2eid if moe.hash else None,
                                           input_ids=ids if moe.hash else None)
        split = model.offload.resident.split(layer, idx, weights)
        host = model.offload.host.forward(layer, x, split.host_ids, split.host_weights)  # [T, D]
        xs, row_idx, counts = ops.moe_init_routing(x, split.device_ids, 3)
        y = moe.experts.matmul(ops.swiglu(moe.experts.matmul(xs, "w13", counts), a.swiglu_limit), "w2", counts)
        resident = ops.moe_finalize_routing(y, split.device_weights, row_idx)  # [T, D]
        shared = moe.shared_experts(x)
        whole = moe_full(x, ids)
        assert torch.allclose(resident + host + shared, whole, atol=1e-5, rtol=0), layer
        assert torch.allclose(moe(x, ids), whole, atol=1e-5, rtol=0), layer
        assert host.abs().sum() > 0 and resident.abs().sum() > 0  # both halves did work


@pytest.mark.parametrize("backend", ["torch", pytest.param("kt", marks=pytest.mark.skipif(
    KT_REASON is not None, reason=f"kt-kernel: {KT_REASON}"))])
def test_host_work_of_a_step_that_failed_before_its_sync_is_waited_for_and_dropped(ckpt, full, backend):
    model = offloaded(ckpt, 2, host_backend=backend)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(5, model.args.hidden_size, generator=g)  # [T, D]
    ids = torch.randint(2, 500, (5,), generator=g)
    model.offload.route(1, 3 * x, torch.full((5, 2), 7), torch.ones(5, 2))  # submitted; its step never syncs
    want = full.layers[1].ffn(x, ids)
    tol = 1e-5 if backend == "torch" else 2e-2 * float(want.abs().max())  # kt: bf16 activations
    assert torch.allclose(model.layers[1].ffn(x, ids), want, atol=tol, rtol=0)
    assert not model.offload.pending


def test_a_placement_change_between_requests_keeps_the_results(ckpt, full, reference_logits):
    model = offloaded(ckpt, 2, placement="dynamic")
    first = prefill_logits(model, PROMPTS[:1])
    before = {layer: t.tolist() for layer, t in model.offload.resident.experts.items()}
    model.engine_contract().finish_prefill([0])  # the prompt's prefill ended: its top 2 per layer become resident
    after = {layer: t.tolist() for layer, t in model.offload.resident.experts.items()}
    assert after != before and after[4] == before[4]  # the MTP block keeps its start placement
    for layer in range(4):  # the slots hold the new experts' weights
        w13 = model.layers[layer].ffn.experts.w13
        for slot, e in enumerate(after[layer]):
            assert torch.equal(w13[slot], full.layers[layer].ffn.experts.w13[e])
    again = prefill_logits(model, PROMPTS)
    n = len(PROMPTS[0])
    assert torch.allclose(first, reference_logits[:n], atol=1e-4, rtol=0)
    assert torch.allclose(again, reference_logits, atol=1e-4, rtol=0)


def test_engine_dynamic_placement_equals_all_resident(ckpt, full):
    """Chunked prefill (8 tokens a step), a prefix-cache hit, preemption by recompute: the resident set changes
    whenever a prompt's prefill ends (the requests ending it in one step pool their routed ids), while the other
    requests decode; every output equals the all-resident model's."""
    tok = AutoTokenizer.from_pretrained(ckpt)
    prompts = PROMPTS + [PROMPTS[0] + [60, 61, 62, 63, 64, 65]]  # shares a prefix-cached block with prompt 0
    engine_kwargs = dict(block_size=16, max_num_batched_tokens=8, num_blocks=5)
    expected = LLM(full, tok, **engine_kwargs).generate(prompts, GREEDY, use_tqdm=False)
    model = offloaded(ckpt, 2, placement="dynamic")
    llm = LLM(model, tok, **engine_kwargs)
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.token_ids for o in outs] == [o.token_ids for o in expected]
    assert model.offload.swaps > 0
    assert llm.engine.scheduler.num_preemptions > 0 and max(llm.engine.stats.recent_step_tokens) <= 8


def test_engine_with_mtp_offloads_the_mtp_block_too(ckpt, full):
    tok = AutoTokenizer.from_pretrained(ckpt)
    expected = LLM(full, tok, block_size=16).generate(PROMPTS[:2], GREEDY, use_tqdm=False)
    model = offloaded(ckpt, 2, placement="dynamic")
    llm = LLM(model, tok, block_size=16, num_speculative_tokens=1)
    outs = llm.generate(PROMPTS[:2], GREEDY, use_tqdm=False)
    assert [o.token_ids for o in outs] == [o.token_ids for o in expected]
    assert model.mtp[0].ffn.experts.w13.shape[0] == 2 and llm.engine.stats.num_draft_tokens > 0


def test_graph_decode_with_offload_equals_all_resident_eager(graph_ckpt):
    """exe_mode graph (one bucket of 2, so steps of one sequence are padded) with dynamic placement: the host
    experts run as opaque ops inside the compiled decode graph; the placement changes between requests (and within
    a run: a prompt's prefill ends while others decode), rewriting in place the tables and slots the graph reads,
    without a recompile (the engine fails on one); every token and log-prob equals the all-resident eager model's."""
    ckpt, full = graph_ckpt, load_model(graph_ckpt, torch.float32, mtp=True)  # `full`, on the graph checkpoint
    tok = AutoTokenizer.from_pretrained(ckpt)
    engine_kwargs = dict(block_size=16, max_num_batched_tokens=8)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=2)
    eager = LLM(full, tok, **engine_kwargs)
    model = offloaded(ckpt, 2, placement="dynamic")
    graph = LLM(model, tok, exe_mode="graph", graph_capture_sizes=(2,), **engine_kwargs)
    for prompts in (PROMPTS, PROMPTS[::-1]):  # the second run starts from the first's resident sets
        before = {layer: t.tolist() for layer, t in model.offload.resident.experts.items()}
        replays = graph.engine.runner.graphs.replays[2]
        want = eager.generate(prompts, params, use_tqdm=False)
        got = graph.generate(prompts, params, use_tqdm=False)
        for e, g in zip(want, got):
            assert g.token_ids == e.token_ids
            for le, lg in zip(e.logprobs, g.logprobs, strict=True):
                assert lg.token_id == le.token_id and abs(lg.logprob - le.logprob) < 1e-4
        assert graph.engine.runner.graphs.replays[2] > replays  # decode steps ran as the graph
        assert {layer: t.tolist() for layer, t in model.offload.resident.experts.items()} != before
    assert 0 < model.offload.hit_rate() < 1


@pytest.mark.skipif(KT_REASON is not None, reason=f"kt-kernel: {KT_REASON}")
def test_kt_backend_within_its_bf16_rounding(ckpt, reference_logits):
    model = offloaded(ckpt, 2, host_backend="kt")
    out = prefill_logits(model, PROMPTS)
    rel = (out - reference_logits).abs().mean() / reference_logits.abs().mean()
    cos = torch.nn.functional.cosine_similarity(out.flatten(), reference_logits.flatten(), dim=0)
    assert rel < 1e-2 and cos > 0.9999, (rel, cos)  # bf16 activations in and out of the kernel
    assert (out.argmax(-1) == reference_logits.argmax(-1)).float().mean() > 0.9


def rank_generate_offloaded(path, counts_file, out_dir):
    """One rank of DP2 + EP2: its 4 experts of every layer, 2 resident (the frequency file's top 2 of its shard)
    and 2 on its host; chunked prefill; every output's tokens saved."""
    from common.parallel import destroy_parallel, init_parallel
    parallel = init_parallel(LLMParallelLayout(world_size=2, lmhead_tp=2))
    try:
        model = load_model(path, torch.float32, parallel=parallel, offload=MoEOffloadConfig(
            2, placement="frequency", frequency_file=str(counts_file)), mtp=True)
        llm = LLM(model, AutoTokenizer.from_pretrained(path), block_size=16, max_num_batched_tokens=8)
        outs = llm.generate(PROMPTS + [PROMPTS[0][::-1]], GREEDY, use_tqdm=False)
        held = {layer: t.tolist() for layer, t in model.offload.resident.experts.items()}
        torch.save(([o.token_ids for o in outs], held, model.offload.host.layers, model.offload.hit_rate(),
                    sorted(model.checkpoint_reads)), out_dir / f"rank{parallel.rank}.pt")
    finally:
        destroy_parallel()


@pytest.mark.slow
def test_dp2_ep2_offloaded_equals_one_process_all_resident(ckpt, full, counts_file, tmp_path):
    """Attention DP2 + EP2 (gloo): each rank holds 2 resident slots of its own 4 experts a layer and computes the
    other 2 on its host, for the rows dispatched to it from both ranks; greedy tokens equal one all-resident
    process's."""
    from dist_helpers import run_ranks
    run_ranks(rank_generate_offloaded, 2, ckpt, counts_file, tmp_path)
    prompts = PROMPTS + [PROMPTS[0][::-1]]
    want = [o.token_ids for o in LLM(full, AutoTokenizer.from_pretrained(ckpt), block_size=16).generate(
        prompts, GREEDY, use_tqdm=False)]
    counts = json.loads(counts_file.read_text())["counts"]
    for rank in range(2):
        tokens, held, host_layers, hit_rate, reads = torch.load(tmp_path / f"rank{rank}.pt")
        assert tokens == want
        assert 0 < hit_rate < 1 and host_layers == (0, 1, 2, 3, 4)
        for layer in range(4):  # its shard's two most routed experts, numbered in the shard
            shard = counts[str(layer)][4 * rank: 4 * rank + 4]
            assert sorted(shard[e] for e in held[layer]) == sorted(shard)[-2:]
        experts = {int(n.split(".")[4]) for n in reads if n.startswith("layers.") and ".ffn.experts." in n}
        assert experts == set(range(4 * rank, 4 * rank + 4))  # its shard only


def test_offload_refuses_bad_sizes_dynamic_over_ranks_and_quantized_experts(ckpt):
    args = ModelArgs.from_config(TINY_CONFIG)
    with pytest.raises(ValueError, match=r"must be in 0\.\.4 \(the model's routed experts over moe_ep 2"):
        DeepseekV4(args, Parallel(LLMParallelLayout(world_size=2)), offload_slots=5)
    with pytest.raises(ValueError, match="dynamic placement runs on one process"):
        shard_placement(MoEOffloadConfig(2, placement="dynamic").make_placement(), 4, 4)
    for n in (-1, 9):
        with pytest.raises(ValueError, match="resident experts per layer must be in 0..8"):
            DeepseekV4(args, offload_slots=n)
    with pytest.raises(ValueError, match="frequency_file"):
        MoEOffloadConfig(2, placement="frequency")
    with pytest.raises(ValueError, match="placement"):
        MoEOffloadConfig(2, placement="hot")
    with pytest.raises(ValueError, match="unknown moe_offload settings"):
        MoEOffloadConfig.from_dict({"resident_experts": 2, "slots": 3})


def test_an_all_resident_load_that_cannot_fit_is_refused_with_the_arithmetic():
    args = ModelArgs.from_config(TINY_CONFIG)
    need = model_bytes(args, torch.bfloat16)["device"]
    with pytest.raises(ValueError, match=r"the weights need 0\.\d\d GiB in bf16 \(all routed experts resident\).*"
                                         r"--offload-experts N"):
        check_fits(args, torch.bfloat16, "cpu", available=(need - 1, need - 1))
    check_fits(args, torch.bfloat16, "cpu", available=(need, need))  # fits exactly
    off = model_bytes(args, torch.bfloat16, offload_slots=2)
    assert off["device"] < need and off["host"] == 4 * 8 * (3 * 64 * 32 // 2 + 3 * 64 * 32 // 32)


@pytest.mark.parametrize("argv, needle", [
    (["--offload-experts", "-1"], "resident_experts must be an int >= 0"),
    (["--placement", "dynamic"], "--placement needs --offload-experts N"),
    (["--offload-experts", "2", "--placement", "frequency"], "needs a frequency_file"),
    (["--offload-experts", "2", "--frequency-file", "/nonexistent.json", "--placement", "dynamic"], "no such file"),
    (["--offload-experts", "2", "--placement", "dynamic", "--config", "configs/tiny-cpu-dp2-ep2.yaml"],
     "placement dynamic runs on one process"),
    (["--offload-experts", "2", "--host-backend", "gpu"], "invalid choice"),
])
def test_bad_offload_flags_give_one_line_and_exit_2(argv, needle, capsys, monkeypatch):
    monkeypatch.chdir(generate.HERE)
    with pytest.raises(SystemExit) as e:
        generate.parse_args(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2 and needle in err and len(err.strip().splitlines()) == 1, err


def test_record_routing_in_graph_mode_is_refused_in_one_line(capsys, monkeypatch):
    monkeypatch.chdir(generate.HERE)
    with pytest.raises(SystemExit) as e:
        generate.parse_args(["--record-routing", "counts.json", "--exe-mode", "graph"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "--record-routing counts on the host in eager steps" in err, err


def test_generate_records_routing_then_runs_offloaded_from_it(ckpt, tmp_path, capsys):
    counts, prompts = tmp_path / "counts.json", tmp_path / "prompts.txt"
    prompts.write_text("Explain what a mixture-of-experts model is.\nList three prime numbers.\n")
    common = ["--weights", str(ckpt), "--exe-mode", "eager", "--dtype", "fp32", "--max-tokens", "3", "--prompts",
              str(prompts)]
    assert generate.main([*common, "--record-routing", str(counts)]) == 0
    plain = capsys.readouterr().out
    assert json.loads(counts.read_text())["format"] == "expert-routing-counts"
    assert generate.main([*common, "--offload-experts", "2", "--placement", "frequency",
                          "--frequency-file", str(counts)]) == 0
    out = capsys.readouterr().out
    assert "offload=2/8 placement=frequency host=torch" in out
    texts = lambda s: [line for line in s.splitlines() if line.startswith("'")]  # noqa: E731
    assert texts(out) == texts(plain)


def bf16_slot_swap_error(path) -> float:
    """Load the offloaded model in bf16 and pack it as the engine does (oneDNN-packed experts where this CPU runs
    bf16 GEMMs, dense elsewhere), put new weights into slot 0 of a MoE layer, and return the largest relative error
    of that slot's grouped matmul against the plain product with the new weights."""
    from common import cpu_gemm
    model = load_model(path, torch.bfloat16, offload=MoEOffloadConfig(2, placement="dynamic"))
    cpu_gemm.pack_model(model)
    experts = next(iter(model.moe_layers().values())).experts
    assert isinstance(experts.w13, cpu_gemm.PackedExperts) == cpu_gemm.supported()  # the path this CPU takes
    g = torch.Generator().manual_seed(0)
    w13, w2 = (torch.randn(t.shape[1:], generator=g).to(torch.bfloat16) for t in (experts.w13, experts.w2))
    experts.set_slot(0, w13, w2)
    x = torch.randn(5, w13.shape[1], generator=g).to(torch.bfloat16)  # [M, D], every row to slot 0
    counts = torch.zeros(experts.w13.shape[0], dtype=torch.int64)
    counts[0] = x.shape[0]
    got = experts.matmul(x, "w13", counts).float()  # [M, 2I]
    want = x.float() @ w13.float().T
    return float((got - want).abs().max() / want.abs().max())


def test_bf16_slots_take_new_experts_packed_and_dense(ckpt):
    """Dynamic placement writes slots into oneDNN's packed stack on CPUs with bf16 GEMMs and into the dense one on
    AVX2-only CPUs: both, here and in an AVX2-only process (the other CPU kind)."""
    import os
    import subprocess
    import sys
    assert bf16_slot_swap_error(ckpt) < 2e-2
    code = ("import sys; from test_offload_model import bf16_slot_swap_error; "
            f"e = bf16_slot_swap_error({str(ckpt)!r}); print(e); sys.exit(0 if e < 2e-2 else 1)")
    here = os.path.dirname(__file__)
    root = os.path.dirname(os.path.dirname(os.path.dirname(here)))
    path = os.pathsep.join([here, os.path.join(root, "recipes", "deepseek"), root])
    run = subprocess.run([sys.executable, "-c", code], env={**os.environ, "ONEDNN_MAX_CPU_ISA": "AVX2",
                                                             "ATEN_CPU_CAPABILITY": "avx2", "PYTHONPATH": path},
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-3000:]
