"""Graph-mode decode (exe_mode graph) against eager decode, and the padded decode batch it runs.

fp32, the tiny checkpoint with index_topk 4: the CSA indexer's top-k binds (the sequences here end with 13-18
compressed entries, (prompt + output) / 4), so the graph's fixed-width top-k must select exactly what eager does.
One graph engine (buckets 1, 2 and 4, compiled once for the module: the CPU compile is the slow part; the three
share one graph over a symbolic batch size) serves every scenario, with chunked prefill (8 tokens a step) and a
cache small enough to preempt. The checkpoint has 3 Sinkhorn iterations (hc_sinkhorn_iters, 20 in the tiny
config) because the compiled graph unrolls every one: graph == eager holds for any count, and the 20-iteration
path is checked eager against transformers (test_parity_transformers.py).
"""
import importlib

import pytest
import torch
from transformers import AutoTokenizer

from common.engine import LLM, EngineConfig, SamplingParams
from common.engine.forward_batch import ForwardBatch
from common.engine.model_runner import bind_new_caches
import modeling_deepseek_v4
from tiny_deepseek_v4 import write_tiny_checkpoint
from weights_deepseek_v4 import load_model

paged = importlib.import_module("common.ops.reference.attention")  # the module (the package exports its function)
PROMPT_LENGTHS = (5, 13, 37, 22)
MAX_TOKENS = (60, 40, 20, 50)  # unequal: the batch shrinks 4 -> 3 -> 2 -> 1 (buckets 4, 4, 2, 1)
ENGINE = dict(block_size=16, max_num_seqs=4, max_num_batched_tokens=8, num_blocks=12)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    path = write_tiny_checkpoint(tmp_path_factory.mktemp("graph") / "ckpt", seed=5, quantized=False, index_topk=4,
                                 hc_sinkhorn_iters=3)  # compile time: see the module docstring
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(2, 500, (n,), generator=g).tolist() for n in PROMPT_LENGTHS]
    tok = AutoTokenizer.from_pretrained(path)
    eager = LLM(load_model(path, torch.float32), tok, **ENGINE)
    graph = LLM(load_model(path, torch.float32), tok, exe_mode="graph", graph_capture_sizes=(1, 2, 4), **ENGINE)
    return eager, graph, prompts, path


LOGPROB_ATOL = 5e-4  # fp32: the graph's fused kernels (and a padded batch's rows) sum in another order


def assert_same(eager_outs, graph_outs):
    for e, g in zip(eager_outs, graph_outs):
        assert g.token_ids == e.token_ids
        assert g.finish_reason == e.finish_reason
        for le, lg in zip(e.logprobs, g.logprobs, strict=True):
            assert lg.token_id == le.token_id and abs(lg.logprob - le.logprob) < LOGPROB_ATOL
            for (te, ve), (tg, vg) in zip(le.top, lg.top, strict=True):
                assert tg == te and abs(vg - ve) < LOGPROB_ATOL


def test_graph_decode_equals_eager_with_chunked_prefill_and_preemption(setup):
    eager, graph, prompts, _ = setup
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, logprobs=3) for n in MAX_TOKENS]
    before = dict(graph.engine.runner.graphs.replays)
    want = eager.generate(prompts, params, use_tqdm=False)
    got = graph.generate(prompts, params, use_tqdm=False)
    assert_same(want, got)
    runs = {n: graph.engine.runner.graphs.replays[n] - before[n] for n in before}
    assert runs[1] > 0 and runs[2] > 0 and runs[4] > 0  # every bucket ran decode steps
    assert graph.engine.runner.graphs.num_graphs == 1  # one over the batch size, buckets 1, 2 and 4
    graphs = graph.engine.runner.graphs  # which a step runs at its own size: 3 sequences in bucket 4, unpadded
    tables = [dict.fromkeys(graphs.groups, [])] * 3
    assert graphs.shape_generic and graphs.build([[5]] * 3, [0] * 3, tables, 4).num_seqs == 3
    assert graphs.build([[5]], [0], tables[:1], 2).num_seqs == 2  # one sequence: only bucket 1 takes a batch of 1
    assert graph.engine.scheduler.num_preemptions > 0 and eager.engine.scheduler.num_preemptions > 0
    assert max(graph.engine.stats.recent_step_tokens) <= 8  # prompts went in chunks beside the decodes
    assert graph.engine.kv_cache.all_blocks_free() and eager.engine.kv_cache.all_blocks_free()


def test_graph_decode_reading_only_the_entries_the_sequences_hold_equals_eager(setup, monkeypatch):
    """Past PADDED_ENTRIES_MAX entries a sequence (max_seqlen_k / ratio: long max_model_len), a compiled CPU step
    reads the compressed entries through one opaque op that takes the width its sequences hold on the host, and
    past TRACED_WINDOW_MAX keys its window attention through the paged_decode op; both forced here at the tiny
    size, one bucket of 2 (steps of one sequence padded to it)."""
    eager, _, prompts, path = setup
    monkeypatch.setattr(modeling_deepseek_v4, "PADDED_ENTRIES_MAX", 0)  # read when the graph is traced
    monkeypatch.setattr(paged, "TRACED_WINDOW_MAX", 0)
    graph = LLM(load_model(path, torch.float32), AutoTokenizer.from_pretrained(path), exe_mode="graph",
                graph_capture_sizes=(2,), **ENGINE)
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, logprobs=3) for n in MAX_TOKENS]
    want = eager.generate(prompts, params, use_tqdm=False)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        got = graph.generate(prompts, params, use_tqdm=False)
    assert_same(want, got)
    assert graph.engine.runner.graphs.replays[2] > 0
    ran = {e.key for e in prof.key_averages()}
    assert any("deepseek_v4_compressed_attention" in k for k in ran) and "npu_cookbook::paged_decode" in ran


def test_graph_decode_equals_eager_on_a_prefix_cache_hit(setup):
    eager, graph, prompts, _ = setup
    shared = prompts[2][:32]  # two full blocks
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, logprobs=2)
    for llm in (eager, graph):
        llm.generate([shared + [7, 8, 9]], params, use_tqdm=False)
    want = eager.generate([shared + [11, 12]], params, use_tqdm=False)
    got = graph.generate([shared + [11, 12]], params, use_tqdm=False)
    assert got[0].num_cached_tokens == 32 == want[0].num_cached_tokens
    assert_same(want, got)
    assert graph.engine.kv_cache.all_blocks_free()


def test_seeded_sampling_in_graph_mode_equals_eager(setup):
    eager, graph, prompts, _ = setup
    params = SamplingParams(temperature=0.8, top_p=0.9, seed=7, max_tokens=16, ignore_eos=True)
    want = eager.generate(prompts[:2], params, use_tqdm=False)
    got = graph.generate(prompts[:2], params, use_tqdm=False)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]


def test_auto_mode_runs_the_buckets_whose_graph_won_its_trial_and_equals_eager(setup):
    """exe_mode auto on one rank times each bucket's first real decode steps in both modes, alternating, and keeps
    its graph only if the graph's best step beat eager's: before the trials nothing is decided; after them the
    buckets that run as graphs are exactly the winners, the others' steps run eager, and every output is eager's.
    (The buckets are the graph engine's, so inductor's disk cache holds their code.)"""
    from common.engine.graph_runner import TRIAL_STEPS
    eager, _, prompts, path = setup
    auto = LLM(load_model(path, torch.float32), AutoTokenizer.from_pretrained(path), exe_mode="auto",
               graph_capture_sizes=(1, 2, 4), **ENGINE)
    graphs = auto.engine.runner.graphs
    assert not graphs.calibration and set(graphs.trials) == {1, 2, 4}
    assert graphs.trial_mode(4) == "graph"  # a trial starts with the graph
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, logprobs=3) for n in MAX_TOKENS]
    assert_same(eager.generate(prompts, params, use_tqdm=False), auto.generate(prompts, params, use_tqdm=False))
    assert graphs.calibration and all(g > 0 and e > 0 for g, e in graphs.calibration.values())
    assert all(len(graphs.trials[n]["graph"]) + len(graphs.trials[n]["eager"]) < 2 * TRIAL_STEPS for n in graphs.trials)
    decided = set(graphs.calibration)
    assert decided.isdisjoint(graphs.trials) and decided | set(graphs.trials) == {1, 2, 4}
    assert set(graphs.buckets) == {n for n, (g, e) in graphs.calibration.items() if g < e} | set(graphs.trials)
    assert all(graphs.replays[n] >= TRIAL_STEPS for n in decided)  # every decided bucket ran its graph steps
    assert auto.engine.kv_cache.all_blocks_free()


def test_padding_rows_never_change_real_rows(setup):
    """The model on a decode batch padded to a bucket (fixed table width, max_seqlen_k the bound) gives the real
    rows what the unpadded batch gives, and its padding writes only to the null block."""
    *_, path = setup
    model = load_model(path, torch.float32)
    groups = [s.name for s in model.cache_specs(16)]
    prompts = [list(range(3, 3 + n)) for n in (30, 9, 17)]
    prefill, num_blocks = ForwardBatch.prefill(prompts, groups, 16)
    caches = bind_new_caches(model, dict.fromkeys(groups, num_blocks + 8), 16)
    with torch.inference_mode():
        model(prefill)
        tables = [{g: prefill.block_tables[g][b, : -(-(n + 1) // 16)].tolist() for g in groups}
                  for b, n in enumerate(map(len, prompts))]
        step = ([[5], [6], [7]], [len(p) for p in prompts], tables)
        plain = model.compute_logits(model(ForwardBatch.build(*step, block_size=16)))
        kept = [t.clone() for ts in caches.values() for t in ts]
        padded = ForwardBatch.build(*step, block_size=16, pad_to=8, table_width=64, max_seqlen_k=1024)
        assert padded.num_seqs == 8 and padded.max_seqlen_q == 1 and padded.max_seqlen_k == 1024
        assert all(t.shape == (8, 64) for t in padded.block_tables.values())
        assert all((s[3:] == 0).all() for s in padded.slot_mapping.values())  # padding: the null block's row 0
        logits = model.compute_logits(model(padded))
        after = [t for ts in caches.values() for t in ts]
    # fp32; the padded widths (1,024 keys, 256 / 128 entries) only change the order of the sums
    torch.testing.assert_close(logits[:3], plain, atol=1e-4, rtol=1e-4)
    for before, now in zip(kept, after):  # the real rows' writes again; padding only in the null block 0
        torch.testing.assert_close(now[1:], before[1:], atol=1e-4, rtol=1e-4)


def test_forward_batch_refuses_a_sequence_past_its_bucket():
    with pytest.raises(ValueError, match="table_width"):
        ForwardBatch.build([[1]], [40], [{"g": [1, 2, 3]}], block_size=16, table_width=2)
    with pytest.raises(ValueError, match="max_seqlen_k"):
        ForwardBatch.build([[1]], [40], [{"g": [1, 2, 3]}], block_size=16, max_seqlen_k=32)


def test_forward_batch_copy_fills_a_bucket_and_refuses_another():
    """Graph replay reads fixed buffers: copy_ fills them from the step's batch of the same bucket, every field."""
    tables = [{"g": [1, 2]}, {"g": [3]}]
    static = ForwardBatch.build([[0]] * 2, [0, 0], [{"g": []}] * 2, 16, pad_to=4, table_width=4, max_seqlen_k=64)
    step = ForwardBatch.build([[5], [6]], [20, 7], tables, 16, pad_to=4, table_width=4, max_seqlen_k=64)
    static.copy_(step)
    for name in ("input_ids", "positions", "seq_ids", "cu_seqlens_q", "seq_lens"):
        assert torch.equal(getattr(static, name), getattr(step, name))
    assert torch.equal(static.block_tables["g"], step.block_tables["g"])
    assert torch.equal(static.slot_mapping["g"], step.slot_mapping["g"])
    for other in (ForwardBatch.build([[5]], [20], tables[:1], 16, pad_to=2, table_width=4, max_seqlen_k=64),
                  ForwardBatch.build([[5]], [20], tables[:1], 16, pad_to=4, table_width=4, max_seqlen_k=128)):
        with pytest.raises(ValueError, match="copy_"):
            static.copy_(other)


def test_graph_mode_refuses_a_device_it_cannot_capture_on(setup):
    from common.engine.graph_runner import GraphRunner
    *_, path = setup
    config = EngineConfig(exe_mode="graph", max_num_seqs=2).resolve(1024)
    with pytest.raises(ValueError, match="not on meta.*exe_mode eager"):
        model = load_model(path, torch.float32)
        GraphRunner(model, model.engine_contract(), config, ["g"], torch.device("meta"), keep_streams=False)


def test_buckets_share_a_graph_only_where_a_step_is_one_token_a_sequence(setup):
    """The compile order: the largest bucket (traced over a symbolic batch size), then the rest, which reuse its
    graph; with MTP (1 + k tokens a sequence) or a single bucket, a graph per bucket."""
    from common.engine.graph_runner import GraphRunner
    *_, path = setup
    model = load_model(path, torch.float32)

    def runner(**config):
        resolved = EngineConfig(exe_mode="graph", max_num_seqs=8, **config).resolve(1024)
        return GraphRunner(model, model.engine_contract(), resolved, ["g"], torch.device("cpu"), keep_streams=False)

    generic = runner(graph_capture_sizes=(1, 2, 4, 8))
    assert generic.shape_generic and generic.compile_order() == [8, 1, 2, 4]
    assert runner(graph_capture_sizes=(1, 8)).compile_order() == [8, 1]
    for per_bucket in (runner(graph_capture_sizes=(1, 2, 4, 8), num_speculative_tokens=1),
                       runner(graph_capture_sizes=(8,))):
        assert not per_bucket.shape_generic and per_bucket.compile_order() == sorted(per_bucket.sizes)


def test_capture_sizes_default_to_powers_of_two_and_max_num_seqs():
    assert EngineConfig(max_num_seqs=16, exe_mode="graph").resolve(1024).graph_capture_sizes == (1, 2, 4, 8, 16)
    assert EngineConfig(max_num_seqs=6, exe_mode="graph").resolve(1024).graph_capture_sizes == (1, 2, 4, 6)
    assert EngineConfig(max_num_seqs=6, exe_mode="auto").resolve(1024).graph_capture_sizes == (1, 2, 4, 6)
    assert EngineConfig(max_num_seqs=6).resolve(1024).graph_capture_sizes is None  # eager: no buckets
    for bad in ((2, 1), (0,), (1, 1), ()):
        with pytest.raises(ValueError, match="graph_capture_sizes"):
            EngineConfig(graph_capture_sizes=bad)
    with pytest.raises(ValueError, match="exe_mode"):
        EngineConfig(exe_mode="npugraph")


COMPILE_ONCE = """
import torch
from torch._dynamo.utils import counters
from common.engine.graph_runner import inductor_options
x = torch.arange(64, dtype=torch.int64)
f = torch.compile(lambda x: torch.where(x % 3 == 0, x // 3, -1).cumsum(0), fullgraph=True, dynamic=False,
                  options=inductor_options())
assert torch.equal(f(x), torch.where(x % 3 == 0, x // 3, -1).cumsum(0))
print(counters["inductor"]["fxgraph_cache_hit"], counters["inductor"]["fxgraph_cache_miss"])
"""


def test_the_compile_cache_is_reused_on_this_cpu_kind_and_not_across_kinds(tmp_path):
    """A second process reuses the on-disk graphs; a process vectorizing for another width (AVX2 here, when this
    CPU has AVX-512) compiles its own instead of rebuilding AVX-512 code for AVX2 (which, without the pinned
    `cpp.simdlen`, gave this function wrong values and the decode graphs an out-of-bounds index)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[3]

    def hits_misses(**env):
        run = subprocess.run([sys.executable, "-c", COMPILE_ONCE], cwd=root, capture_output=True, text=True,
                             env={**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path), **env}, timeout=300)
        assert run.returncode == 0, run.stderr[-3000:]
        return tuple(map(int, run.stdout.split()[-2:]))

    assert hits_misses() == (0, 1)
    assert hits_misses() == (1, 0)  # the second start: from the disk cache
    if torch.backends.cpu.get_cpu_capability() != "AVX2":
        assert hits_misses(ONEDNN_MAX_CPU_ISA="AVX2", ATEN_CPU_CAPABILITY="avx2") == (0, 1)


def test_a_graph_engine_refuses_to_run_over_caches_another_engine_reallocated(setup):
    """A second engine on the graph engine's model allocates its own caches over the ones the graphs were built
    on: the graph engine's next decode step fails its request with the reason (the engine goes on) instead of
    running over caches it no longer owns. (Last in the module: it leaves the graph engine's caches replaced.)"""
    _, graph, prompts, path = setup
    LLM(graph.engine.model, AutoTokenizer.from_pretrained(path), **ENGINE)
    out = graph.generate([prompts[0]], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True),
                         use_tqdm=False)[0]
    assert out.finish_reason == "error" and "reallocated" in out.error
    assert graph.engine.kv_cache.all_blocks_free()
