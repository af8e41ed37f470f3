"""plan.py (deployment planning on the meta device) against models actually built and loaded on the CPU: per-rank
weight bytes equal rank 0's slice's state_dict, KV bytes per token equal a block of caches allocated on the CPU over
block_size, the A3 preset prints its table, and bad options give one line and exit code 2."""
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import plan
from common.engine.model_runner import bind_new_caches
from common.parallel import LLMParallelLayout, Parallel
from config_deepseek_v4 import ModelArgs
from modeling_deepseek_v4 import DeepseekV4
from tiny_deepseek_v4 import TINY_CONFIG, write_tiny_checkpoint
from weights_deepseek_v4 import load_model

RECIPE = Path(__file__).resolve().parents[3] / "recipes" / "deepseek"
A3 = RECIPE / "configs" / "atlas-a3-flash.yaml"
ENGINE = {"block_size": 16, "max_num_seqs": 16, "max_num_batched_tokens": 512}  # configs/tiny-cpu-dp2-ep2.yaml's

LAYOUTS = [
    LLMParallelLayout(world_size=2, lmhead_tp=2),  # configs/tiny-cpu-dp2-ep2.yaml: DP2 + EP2, LM head over both
    LLMParallelLayout(world_size=2, attn_tp=2),  # TP2: heads and output groups split, EP2
    LLMParallelLayout(world_size=4, attn_tp=2, embed_tp=2, lmhead_tp=4),
]


def allocated_bytes_per_block(model, block_size):
    """Bytes one block of each cache group takes, summed over the model's cache tensors as the engine allocates them."""
    groups = [g.name for g in model.cache_specs(block_size)]
    caches = bind_new_caches(model, dict.fromkeys(groups, 1), block_size)
    return {g: sum(t.nbytes for t in ts) for g, ts in caches.items()}


def tiny_plan(layout, dtype=torch.float32):
    return plan.plan(TINY_CONFIG, "tiny", "test", layout, dtype, ENGINE)[0]


def built_on_cpu(layout, dtype=torch.float32):
    with plan.torch_default_dtype(dtype):
        return DeepseekV4(ModelArgs.from_config(TINY_CONFIG), Parallel(layout))


@pytest.mark.parametrize("layout", LAYOUTS, ids=["dp2-ep2-head2", "tp2-ep2", "dp2xtp2-ep4-vocab"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_weight_bytes_equal_rank0_slice_built_on_cpu(layout, dtype):
    p, model = tiny_plan(layout, dtype), built_on_cpu(layout, dtype)
    state = model.state_dict()
    assert p.total("dtype") == sum(t.nbytes for t in state.values())
    for part in plan.PARTS:  # and part by part
        assert p.weights[part]["dtype"] == sum(t.nbytes for n, t in state.items() if plan.part_of(n) == part), part
    assert all(p.weights[part]["dtype"] > 0 for part in plan.PARTS if part != plan.VISION_PART)
    assert p.weights[plan.VISION_PART]["dtype"] == 0  # TINY_CONFIG is text only


def test_weight_bytes_equal_a_real_load_single_process(tmp_path):
    path = write_tiny_checkpoint(tmp_path / "ckpt", seed=1)  # the publisher's format (FP8 + MXFP4), dequantized
    cfg = json.loads((path / "config.json").read_text())  # Vision-Exp: the vision tower and aligner are counted
    for dtype in (torch.bfloat16, torch.float32):
        model = load_model(path, dtype)
        state = model.state_dict()
        p = plan.plan(cfg, "tiny", "test", LLMParallelLayout(), dtype, ENGINE)[0]
        assert p.total("dtype") == sum(t.nbytes for t in state.values())
        vision = sum(t.nbytes for n, t in state.items() if n.startswith("vision_model."))
        assert p.weights[plan.VISION_PART]["dtype"] == vision > 0


def test_quantized_columns_follow_upstreams_converter():
    p, model = tiny_plan(LAYOUTS[0], torch.bfloat16), built_on_cpu(LAYOUTS[0], torch.bfloat16)
    state = model.state_dict()
    experts = [t for n, t in state.items() if n.endswith((".ffn.experts.w13", ".ffn.experts.w2"))]
    numel, rows = sum(t.numel() for t in experts), sum(t.numel() // t.shape[-1] for t in experts)
    assert p.weights["routed experts"]["W8A8"] == numel + 4 * rows  # int8 + an fp32 scale per output channel
    assert p.weights["routed experts"]["W4A8"] == numel // 2 + 12 * rows  # int4 + uint64 scale + fp32 bias
    for part in ("embedding", "LM head", "mHC / norms"):  # not quantized upstream
        assert p.weights[part]["W8A8"] == p.weights[part]["W4A8"] == p.weights[part]["dtype"]
    attn = {n: t for n, t in state.items() if plan.part_of(n) == "attention"}
    int8 = [t for n, t in attn.items() if n.endswith((".attn.wq_b.weight", ".attn.wo_b.weight", "indexer.wq_b.weight"))]
    assert len(int8) == 4 * 2 + 2  # wq_b and wo_b in every layer, the indexer's wq_b in the two CSA layers
    expected = sum(t.nbytes for t in attn.values()) - sum(t.nbytes - t.numel() - 4 * t.shape[0] for t in int8)
    assert p.weights["attention"]["W8A8"] == expected


@pytest.mark.parametrize("layout", [LLMParallelLayout()] + LAYOUTS, ids=["one", "dp2-ep2-head2", "tp2-ep2",
                                                                          "dp2xtp2-ep4-vocab"])
def test_kv_bytes_per_token_equal_the_cpu_models_cache(layout):
    model = built_on_cpu(layout)
    for bs in (8, 16, 32):
        got = plan.plan(TINY_CONFIG, "tiny", "test", layout, torch.float32, {**ENGINE, "block_size": bs})[0]
        expected = {g: n / bs for g, n in allocated_bytes_per_block(model, bs).items()}
        assert got.kv_per_token == expected
        # attention DP does not split the cache, and under attention TP the one KV head is replicated
        one = plan.plan(TINY_CONFIG, "tiny", "test", LLMParallelLayout(), torch.float32, {**ENGINE, "block_size": bs})
        assert got.kv_per_token == one[0].kv_per_token


def test_tokens_that_fit_size_the_cache_as_the_engine_does():
    from common.engine import EngineConfig
    from common.engine.model_runner import blocks_that_fit

    p, model = tiny_plan(LAYOUTS[0]), built_on_cpu(LAYOUTS[0])
    budget = 4 * 2**20
    config = EngineConfig(**ENGINE, kv_cache_memory_bytes=budget, max_model_len=p.engine_limits[2])
    blocks = blocks_that_fit(model, config)
    assert p.tokens_engine(budget) == (blocks["compressed4"] - 1) * ENGINE["block_size"]
    more = blocks_that_fit(model, EngineConfig(**ENGINE, kv_cache_memory_bytes=2 * budget,
                                               max_model_len=p.engine_limits[2]))
    # the window group holds what the requests use at once, whatever the budget; the full groups take the rest
    assert more["window"] == blocks["window"] and more["compressed4"] > blocks["compressed4"]


def test_real_flash_config_on_the_a3_layout():
    """The published V4-Flash dimensions (transformers' defaults but for the layer kinds), rank 0 of DP16 + EP16."""
    from transformers import DeepseekV4Config

    ref = DeepseekV4Config()
    for key in ("vocab_size", "hidden_size", "moe_intermediate_size", "num_hidden_layers", "num_attention_heads",
                "head_dim", "q_lora_rank", "n_routed_experts", "num_experts_per_tok", "o_groups", "o_lora_rank",
                "index_n_heads", "index_head_dim", "index_topk", "sliding_window", "qk_rope_head_dim"):
        assert plan.FLASH_CONFIG[key] == getattr(ref, key), key
    args = ModelArgs.from_config(plan.FLASH_CONFIG)
    assert args.layer_types[:4] == ["sliding_attention", "sliding_attention", "compressed_sparse_attention",
                                    "heavily_compressed_attention"]
    p = plan.plan(plan.FLASH_CONFIG, "flash", "test", LLMParallelLayout(world_size=16, lmhead_tp=4), torch.bfloat16,
                  {"block_size": 128})[0]
    assert p.weights["routed experts"]["dtype"] == 43 * (256 // 16) * 3 * 2048 * 4096 * 2
    assert p.weights["LM head"]["dtype"] == 129280 // 4 * 4096 * 2
    # per token, bf16: 43 K=V rows of 512, the compressors' [kv | gate] state (CSA 2x512 wide, HCA 512, the CSA
    # indexers' 2x128), and one compressed entry per 4 / 128 tokens (CSA: main + indexer, HCA: main)
    assert p.kv_per_token == {"window": 2 * (43 * 512 + 21 * 2 * 2 * 512 + 20 * 2 * 512 + 21 * 2 * 2 * 128),
                              "compressed4": 2 * 21 * (512 + 128) / 4, "compressed128": 2 * 20 * 512 / 128}


def run_plan(*args):
    return subprocess.run([sys.executable, "tools/plan.py", *map(str, args)], cwd=RECIPE, capture_output=True, text=True,
                          timeout=300)


def test_a3_preset_prints_the_table():
    r = run_plan("--config", "configs/atlas-a3-flash.yaml")
    assert r.returncode == 0, r.stderr
    out = r.stdout
    for needle in ("DeepSeek-V4-Flash", "weights per rank", "bf16", "W8A8", "routed experts", "LM head",
                   "compressed4", "compressed128", "Atlas A3 die: 64 GiB", "tokens of KV that fit",
                   "preset kv_cache_memory_bytes fits", "smallest world size, weights fit"):
        assert needle in out, needle
    assert "MoE EP 16" in out and "LM head TP 4" in out


@pytest.mark.parametrize("argv, needle", [
    (["--config", "configs/nope.yaml"], "no such file"),
    (["--config", "configs/atlas-a3-flash.yaml", "--model", "huge"], "--model"),
    (["--config", "configs/atlas-a3-flash.yaml", "--reserve-fraction", "1.5"], "--reserve-fraction"),
    (["--config", "configs/atlas-a3-flash.yaml", "--device-memory-gib", "0"], "--device-memory-gib"),
    (["--config", "configs/atlas-a3-flash.yaml", "--world-size", "0"], "--world-size"),
    (["--config", "configs/atlas-a3-flash.yaml", "--world-size", "3"], "does not divide the model's 256"),
    (["--config", "configs/bench-cpu.yaml"], "no default model"),
    (["--config", "configs/tiny-cpu-dp2-ep2.yaml", "--weights", "/no/such/dir"], "/no/such/dir"),
    (["--config", "configs/tiny-cpu-dp2-ep2.yaml", "--dtype", "fp64"], "--dtype"),
])
def test_bad_options_give_one_line_and_exit_2(argv, needle, capsys, monkeypatch):
    monkeypatch.chdir(RECIPE)
    with pytest.raises(SystemExit) as e:
        plan.main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and needle in err, err


def test_bad_option_from_the_command_line():
    r = run_plan("--config", "configs/atlas-a3-flash.yaml", "--reserve-fraction", "-1")
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1 and "--reserve-fraction" in r.stderr


def test_offload_plan_equals_an_offloaded_load(tmp_path):
    """MoE offload on one device: the device bytes are what an offloaded load holds (N slots a layer), the host
    bytes its host experts' MXFP4 tensors."""
    from common.offload import MoEOffloadConfig

    path = write_tiny_checkpoint(tmp_path / "ckpt", seed=1, vision=False)
    model = load_model(path, torch.float32, offload=MoEOffloadConfig(3))
    p = plan.plan(TINY_CONFIG, "tiny", "test", LLMParallelLayout(), torch.float32, ENGINE, offload_slots=3)[0]
    assert p.total("dtype") == sum(t.nbytes for t in model.state_dict().values())
    assert p.weights["routed experts"]["dtype"] == 4 * 3 * 3 * 64 * 32 * 4  # 4 layers x 3 slots, fp32
    assert p.host_bytes == sum(x.nbytes for x in model.offload.host.experts.values())


def test_flash_on_one_device_plus_host():
    args = ModelArgs.from_config(plan.FLASH_CONFIG)
    p = plan.plan(plan.FLASH_CONFIG, "flash", "test", LLMParallelLayout(), torch.bfloat16, {"block_size": 128},
                  offload_slots=32)[0]
    assert p.weights["routed experts"]["dtype"] == 43 * 32 * 3 * 2048 * 4096 * 2  # bf16 slots
    assert p.host_bytes == 43 * 256 * (3 * 4096 * 2048 // 2 + 3 * 4096 * 2048 // 32)  # 13,369,344 B an expert
    rows = plan.single_device_rows(p, args, plan.DEVICES["a3"], 0.1, 2**30, 0)
    fit = int(rows["largest N that fits"]["W8A8"])
    per_slot = p.weights["routed experts"]["W8A8"] // 32  # int8 + fp32 scales of one expert in 43 layers
    left = int(64 * 2**30 * 0.9) - (p.total("W8A8") - p.weights["routed experts"]["W8A8"]) - 2**30
    assert fit == left // per_slot and 30 < fit < 50  # about 1 GiB per +1 (upstream: K=32 on one A3 die)


def test_single_device_preset_prints_every_device():
    r = run_plan("--config", "configs/single-device-flash-offload.yaml")
    assert r.returncode == 0, r.stderr
    for needle in ("MoE offload: one device + host, 8 resident experts", "137.06 GiB of host memory",
                   "one Atlas A3 die", "one Ascend 910B", "one Ascend 950DT", "one NVIDIA H200",
                   "resident experts (8 x 43 layers)", "KV cache (preset budget)", "graph headroom",
                   "largest N that fits"):
        assert needle in r.stdout, needle


@pytest.mark.parametrize("argv, needle", [
    (["--config", "configs/single-device-flash-offload.yaml", "--offload-experts", "0"], "--offload-experts 0"),
    (["--config", "configs/atlas-a3-flash.yaml", "--offload-experts", "4"], "one device"),
    (["--config", "configs/single-device-flash-offload.yaml", "--graph-headroom-gib", "-1"], "--graph-headroom-gib"),
])
def test_bad_offload_options_give_one_line_and_exit_2(argv, needle, capsys, monkeypatch):
    monkeypatch.chdir(RECIPE)
    with pytest.raises(SystemExit) as e:
        plan.main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and needle in err, err


# --- the MLA family (DeepSeek-V3 671B): the 310P deployment and Atlas A3 ---------------------------------------

def v3_rank_bytes_by_hand(heads: int, experts: int, vocab_rows: int, w8a8: bool, dtype_bytes: int = 2) -> dict:
    """One rank of DeepSeek-V3 671B written out from the published dimensions, by part: 61 layers (3 dense, 58 MoE),
    hidden 7168, `heads` of the 128 attention heads (q_lora 1536, nope 128 + rope 64, v 128, kv_lora 512),
    `experts` of the 256 routed experts a MoE layer (2048 wide) + 1 shared, dense MLP 18432, `vocab_rows` of the
    129,280 rows of the embedding and of the head. W8A8 (convert_checkpoint.py): every linear but kv_b_proj int8
    with one fp32 scale per output row; the router fp32 (weight and correction bias) in both."""
    D, f = 7168, dtype_bytes

    def linear(n, k):  # an [n, k] projection
        return n * k + 4 * n if w8a8 else n * k * f

    attention = (linear(1536, D) + 1536 * f  # q_a_proj, q_a_layernorm
                 + linear(heads * 192, 1536)  # q_b_proj: this rank's heads
                 + linear(512 + 64, D) + 512 * f  # kv_a_proj_with_mqa, kv_a_layernorm
                 + heads * (128 + 128) * 512 * f  # kv_b_proj, never quantized
                 + linear(D, heads * 128))  # o_proj: its heads' columns, every output row (and its scale)
    swiglu = lambda inner: linear(2 * inner, D) + linear(D, inner)  # noqa: E731 gate_up + down
    return {"attention": 61 * attention, "routed experts": 58 * experts * swiglu(2048),
            "shared expert + router": 58 * (swiglu(2048) + 256 * D * 4 + 256 * 4), "dense MLP": 3 * swiglu(18432),
            "embedding": vocab_rows * D * f, "LM head": vocab_rows * D * f, "norms": (2 * 61 + 1) * D * f}


def test_v3_config_is_the_published_one():
    from transformers import DeepseekV3Config
    ref = DeepseekV3Config()  # its defaults are DeepSeek-V3's
    for key in ("vocab_size", "hidden_size", "intermediate_size", "moe_intermediate_size", "num_hidden_layers",
                "num_attention_heads", "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
                "v_head_dim", "n_routed_experts", "n_shared_experts", "num_experts_per_tok", "n_group", "topk_group",
                "first_k_dense_replace", "routed_scaling_factor"):
        assert plan.V3_CONFIG[key] == getattr(ref, key), key


@pytest.mark.parametrize("preset, dtype, heads, experts, vocab_rows, cache", [
    # 20 Atlas 300I Duo = 32 chips: attention TP8 (16 heads a rank), EP32 (8 experts), vocabulary whole, fp16;
    # upstream's 256 blocks of 256 tokens
    ("atlas-300i-duo-v3-tp8-ep32.yaml", torch.float16, 16, 8, 129280, 256 * 256),
    # 16 Atlas A3 dies: attention DP16 (all 128 heads), EP16 (16 experts), vocabulary over 16, bf16; 3 GiB of cache
    ("atlas-a3-v3.yaml", torch.bfloat16, 128, 16, 129280 // 16, None),
], ids=["300i-duo-tp8-ep32", "a3-dp16-ep16"])
def test_v3_671b_per_rank_equals_the_hand_computation(preset, dtype, heads, experts, vocab_rows, cache):
    import yaml
    spec = yaml.safe_load((RECIPE / "configs" / preset).read_text())
    p = plan.plan(plan.V3_CONFIG, "v3", "test", LLMParallelLayout(**spec["parallel"]), dtype, spec["engine"])[0]
    assert p.arch is plan.MLA_ARCH and p.columns == ("dtype", "W8A8")
    for column, w8a8 in (("dtype", False), ("W8A8", True)):
        want = v3_rank_bytes_by_hand(heads, experts, vocab_rows, w8a8)
        assert {part: p.weights[part][column] for part in plan.MLA_PARTS} == want, column
    # the latent cache: 61 layers x (512 + 64) values in 2 bytes, the same on every rank (replicated over TP)
    assert p.kv_per_token == {"latent": 61 * 576 * 2}
    if cache:  # the preset fixes num_blocks: the cache is num_blocks x block_size tokens of rows
        assert p.preset_cache_bytes(spec["engine"]) == cache * 61 * 576 * 2
    else:
        assert p.preset_cache_bytes(spec["engine"]) == spec["engine"]["kv_cache_memory_bytes"]


def test_v3_on_300i_duo_fits_only_in_w8a8():
    """The numbers the README quotes: W8A8 28.59 GiB a chip + the preset's 4.29 GiB of latent cache fit in 48 GB
    with 10% kept for activations; fp16 (53.05 GiB) does not."""
    import yaml
    spec = yaml.safe_load((RECIPE / "configs" / "atlas-300i-duo-v3-tp8-ep32.yaml").read_text())
    p = plan.plan(plan.V3_CONFIG, "v3", "test", LLMParallelLayout(**spec["parallel"]), torch.float16,
                  spec["engine"])[0]
    usable = int(48 * 2**30 * 0.9)
    assert round(p.total("W8A8") / 2**30, 2) == 28.59 and round(p.total("dtype") / 2**30, 2) == 53.05
    assert p.total("W8A8") + p.preset_cache_bytes(spec["engine"]) < usable < p.total("dtype")


@pytest.mark.parametrize("layout", [LLMParallelLayout(), LLMParallelLayout(world_size=2, attn_tp=2),
                                    LLMParallelLayout(world_size=2, lmhead_tp=2, embed_tp=2)],
                         ids=["one", "tp2-ep2", "dp2-ep2-vocab2"])
def test_mla_plan_equals_the_tiny_model_built_on_cpu(layout):
    """The planner's V3 numbers are what the model holds: float and W8A8 (the model convert_checkpoint.py's
    output loads into), part by part, and the cache's bytes per token."""
    import dataclasses

    import tiny_deepseek_v3
    from config_deepseek_v3 import ModelArgs as V3Args
    from modeling_deepseek_v3 import DeepseekV3
    cfg = tiny_deepseek_v3.TINY_CONFIG
    p = plan.plan(cfg, "tiny", "test", layout, torch.float32, ENGINE)[0]
    args = V3Args.from_config(cfg)
    for column, a in (("dtype", args), ("W8A8", dataclasses.replace(args, quant_format="w8a8"))):
        state = DeepseekV3(a, Parallel(layout)).state_dict()
        for part in plan.MLA_PARTS:
            held = sum(t.nbytes for n, t in state.items() if plan.part_of(n, plan.MLA_PART_RULES) == part)
            assert p.weights[part][column] == held > 0, (column, part)
    model = DeepseekV3(args, Parallel(layout))
    assert p.kv_per_token == {g: n / 16 for g, n in allocated_bytes_per_block(model, 16).items()}


def test_the_310p_preset_prints_its_plan():
    r = run_plan("--config", "configs/atlas-300i-duo-v3-tp8-ep32.yaml")
    assert r.returncode == 0, r.stderr
    for needle in ("DeepSeek-V3 671B", "attention TP 8 x DP 4, MoE EP 32", "fp16", "W8A8", "dense MLP",
                   "latent", "70,272.0 B", "Atlas 300I Duo chip: 48 GiB", "preset num_blocks 256 fits",
                   "28.59 GiB"):
        assert needle in r.stdout, needle
