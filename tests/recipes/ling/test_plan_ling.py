"""tools/plan_ling.py against a hand computation from the spec's numbers (/work/shared/specs/ling-3.0-flash.md):
parameters (124.41 B main, 3.07 B MTP, 4.70 B active), the KDA state (75,980,800 B a request over 35 layers,
271,360 B a layer a rank at TP8) against the MLA latent (8,064 B a token), the bf16 and W8A8 weight bytes one rank
holds at TP8 / EP8, and the 131,072-token requests one A3 die holds; the A3 preset's report, and bad options (one
line, exit code 2)."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

import plan_ling
from common.parallel import LLMParallelLayout

RECIPE = Path(__file__).resolve().parents[3] / "recipes" / "ling"
CFG = plan_ling.PUBLISHED_CONFIG
TP8 = LLMParallelLayout(world_size=8, attn_tp=8, moe_tp=1, embed_tp=8, lmhead_tp=8)

# The spec's per-layer counts, split into what W8A8 quantizes (linears) and what it keeps.
KDA_LINEAR = 5 * 2560 * 4096 + 2560 * 32 + 4096 * 2560  # q/k/v/f/g, b_proj, o_proj
KDA_FP32 = 3 * 4096 * 4 + 4096 + 32  # the convs, dt_bias, A_log
KDA_NORM = 128  # o_norm
MLA_SPLIT = 2560 * 6144 + 512 * 8192 + 2560 * 32 + 4096 * 2560  # q_proj, kv_b_proj, g_proj, dense: by heads
MLA_REPLICATED = 2560 * 576  # kv_a_proj_with_mqa
MLA_NORM = 512  # kv_a_layernorm
EXPERT = 3 * 2560 * 768  # gate, up, down: 5,898,240
ROUTER = 512 * 2560 + 512  # weight + expert bias, fp32
DENSE = 3 * 2560 * 6144
EMBED = 157184 * 2560
NORMS = (2 * 42 + 1) * 2560  # input / post-attention norms, the final norm


def test_spec_counts():
    assert KDA_LINEAR + KDA_FP32 + KDA_NORM == 63_049_888
    assert MLA_SPLIT + MLA_REPLICATED + MLA_NORM == 31_965_696
    assert 512 * EXPERT + EXPERT + ROUTER == 3_027_108_352
    assert DENSE == 47_185_920


def test_whole_model_parameters():
    c = plan_ling.parameter_counts(CFG)
    assert plan_ling.layer_counts(CFG) == (35, 7)
    main = 35 * 63_049_888 + 7 * 31_965_696 + 40 * 3_027_108_352 + 2 * DENSE + 2 * EMBED + NORMS
    assert c["main"] == main == 124_414_211_552  # 124.41 B
    assert c["routed experts"] == 40 * 512 * EXPERT == 120_795_955_200  # 120.80 B
    assert round((c["KDA attention"] + c["MLA attention"]) / 1e9, 2) == 2.43
    mtp = 5120 * 2560 + 31_965_696 + 3_027_108_352 + 5 * 2560  # eh_proj, MLA, MoE, 5 norms
    assert c["MTP"] == mtp == 3_072_194_048  # 3.07 B
    assert round((c["main"] + c["MTP"]) / 1e9, 2) == 127.49
    active = main - 2 * EMBED - 40 * 504 * EXPERT  # 8 of 512 experts a token
    assert c["active"] == active and round(active / 1e9, 2) == 4.70
    assert round(c["active + LM head"] / 1e9, 2) == 5.10
    assert round(c["active MTP step"] / 1e9, 2) == 0.10


def test_state_against_latent():
    conv, s = plan_ling.state_bytes(CFG, 1, 2)
    assert (conv, s) == (3 * 3 * 4096 * 2, 32 * 128 * 128 * 4) == (73_728, 2_097_152)
    assert 35 * (conv + s) == 75_980_800
    assert 35 * (conv + s) / 2**20 == pytest.approx(72.5, abs=0.05)
    latent = plan_ling.latent_bytes_per_token(CFG, 2, 7)
    assert latent == 576 * 2 * 7 == 8_064
    assert round(75_980_800 / latent / 1000, 1) == 9.4  # one request's state = ~9.4K tokens of latent
    conv8, s8 = plan_ling.state_bytes(CFG, 8, 2)  # TP8: 4 heads a rank; the latent is replicated
    assert conv8 + s8 == 3 * 3 * 512 * 2 + 4 * 128 * 128 * 4 == 271_360
    assert plan_ling.state_bytes(CFG, 1, 2, num_spec=1)[0] * 35 + 35 * s == 76_840_960  # the spec's 1 spec token
    assert plan_ling.request_bytes(CFG, 8, 2, 131072, 128) == (8_064 * 131072, 35 * 271_360)


# One rank at TP8 / EP8, by hand: attention and the shared / dense MLPs split 8 ways by heads / channels (but the
# replicated kv_a_proj and norms), 64 of the 512 experts, the vocabulary split 8 ways.
BF16_PER_RANK = (35 * (KDA_LINEAR // 8 * 2 + KDA_FP32 // 8 * 4 + KDA_NORM * 2)
                 + 7 * (MLA_SPLIT // 8 * 2 + (MLA_REPLICATED + MLA_NORM) * 2)
                 + 40 * 64 * EXPERT * 2
                 + 40 * (EXPERT // 8 * 2 + ROUTER * 4)
                 + 2 * DENSE // 8 * 2
                 + 2 * EMBED // 8 * 2 + NORMS * 2)
# W8A8: every linear int8 + 4 B per output channel on the rank (column-parallel: its share; row-parallel o_proj /
# dense / down_proj: all 2560); the router fp32, the rest as in bf16.
KDA_ROWS = 5 * 512 + 4 + 2560  # q/k/v/f/g, b_proj, o_proj
MLA_ROWS = 768 + 576 + 1024 + 4 + 2560  # q_proj, kv_a_proj_with_mqa, kv_b_proj, g_proj, dense
W8A8_PER_RANK = (35 * (KDA_LINEAR // 8 + 4 * KDA_ROWS + KDA_FP32 // 8 * 4 + KDA_NORM * 2)
                 + 7 * (MLA_SPLIT // 8 + MLA_REPLICATED + 4 * MLA_ROWS + MLA_NORM * 2)
                 + 40 * 64 * (EXPERT + 4 * (768 + 768 + 2560))
                 + 40 * (EXPERT // 8 + 4 * (96 + 96 + 2560) + ROUTER * 4)
                 + 2 * (DENSE // 8 + 4 * (768 + 768 + 2560))
                 + 2 * EMBED // 8 * 2 + NORMS * 2)


def test_weights_per_rank_tp8_ep8():
    w = plan_ling.weight_bytes(plan_ling.rank_tensors(CFG, TP8), 2)
    assert w.total("dtype") == BF16_PER_RANK == 31_319_162_160  # 29.17 GiB
    assert w.total("w8a8") == W8A8_PER_RANK == 15_909_040_848  # 14.82 GiB
    assert w.dtype["routed experts"] == 40 * 64 * EXPERT * 2
    assert w.dtype["embedding"] == w.dtype["LM head"] == w.w8a8["LM head"] == 19648 * 2560 * 2


def test_requests_one_a3_die_holds():
    usable = int(64 * 2**30 * 0.85)
    per_request = 8_064 * 131072 + 35 * 271_360  # 1,066,462,208 B
    assert per_request == 1_066_462_208
    bf16, w8a8 = (usable - BF16_PER_RANK) // per_request, (usable - W8A8_PER_RANK) // per_request
    assert (bf16, w8a8) == (25, 39)
    device = plan_ling.DEVICES["a3"]
    assert plan_ling.usable_bytes(device, plan_ling.RESERVE) == usable
    assert plan_ling.requests_that_fit(usable, BF16_PER_RANK, per_request) == bf16
    assert plan_ling.requests_that_fit(usable, W8A8_PER_RANK, per_request) == w8a8
    # the presets' 25 GiB: beside the bf16 weights, and 25 such requests
    budget = 25 * 2**30
    assert budget <= usable - BF16_PER_RANK and budget // per_request == 25


@pytest.mark.parametrize("preset", ["atlas-a3-tp8.yaml", "atlas-a2-tp8.yaml"])
def test_presets_parse_to_the_plan(preset):
    a = plan_ling.parse_args(["--config", str(RECIPE / "configs" / preset)])
    assert a.layout == TP8 and a.dtype == "bf16" and a.max_model_len == 131072 and a.block_size == 128
    assert a.kv_cache_memory_bytes == 25 * 2**30 and a.device_info.memory_gib == 64
    assert a.device_info.name == ("Atlas A3 die" if "a3" in preset else "Ascend 910B")


def test_weights_dir_reads_its_config(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({**CFG, "num_experts": 256}))
    a = plan_ling.parse_args(["--weights", str(tmp_path), "--device", "none"])
    assert a.model_config["num_experts"] == 256
    text = plan_ling.report(a)
    assert "256 experts, 32 a rank" in text and "no per-die fit" in text


def test_a3_preset_report():
    r = subprocess.run([sys.executable, "tools/plan_ling.py"], cwd=RECIPE, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    out = r.stdout
    for needle in ("Ling-3.0-Flash", "preset configs/atlas-a3-tp8.yaml", "attention TP 8 x DP 1, MoE EP 8",
                   "35 KDA + 7 MLA", "Atlas A3 die: 64 GiB", "75,980,800 B", "9,497,600 B", "8,064 B",
                   "1,066,462,208 B", "124.41 B", "3.07 B", "4.70 B"):
        assert needle in out, needle
    lines = out.splitlines()
    total = next(line for line in lines if line.strip().startswith("total"))
    assert total.split()[1:] == ["29.17", "GiB", "14.82", "GiB"]
    fit = next(line for line in lines if "131,072-token requests that fit" in line)
    assert fit.split()[-2:] == ["25", "39"]
    assert next(line for line in lines if "kv_cache_memory_bytes fits" in line).split()[-2:] == ["yes", "yes"]


@pytest.mark.parametrize("argv, message", [
    (["--reserve-fraction", "1.5"], "--reserve-fraction 1.5"),
    (["--device", "h100"], "--device"),
    (["--max-model-len", "0"], "--max-model-len 0"),
    (["--config", "no-such.yaml"], "no such file"),
])
def test_bad_options_one_line_exit_2(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        plan_ling.parse_args(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("plan_ling.py: error:") and message in err


def test_a_layout_the_model_cannot_split_exits_2(tmp_path, capsys):
    preset = tmp_path / "tp64.yaml"
    preset.write_text("dtype: bf16\nparallel: {world_size: 64, attn_tp: 64}\n")
    with pytest.raises(SystemExit) as e:
        plan_ling.main(["--config", str(preset)])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1 and "num_attention_heads 32" in err
