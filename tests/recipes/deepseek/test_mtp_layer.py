"""The publisher's MTP layer (`mtp.0.*`): the tiny writer writes it, load_model(mtp=True) loads it (FP8 / MXFP4
dequantized like the layers), a plain load skips it without reading it, and the main model does not change."""
import pytest
import torch

from common.engine.forward_batch import ForwardBatch
from common.engine.model_runner import bind_new_caches, prefill_logits
from common.loader import CheckpointError
from config_deepseek_v4 import SLIDING, ModelArgs
from modeling_deepseek_v4 import MTPBlock
from tiny_deepseek_v4 import TINY_CONFIG, random_state, write_tiny_checkpoint
from weights_deepseek_v4 import load_model

PROMPTS = [[5, 9, 30, 41, 7, 300, 12, 12, 99, 3, 4], [17, 18, 19, 20]]


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("mtp")
    return {
        "mtp": write_tiny_checkpoint(root / "mtp", seed=3, quantized=False, num_nextn_predict_layers=1),
        "mtp-fp8": write_tiny_checkpoint(root / "mtp-fp8", seed=3, num_nextn_predict_layers=1),
        "none": write_tiny_checkpoint(root / "none", seed=3, quantized=False, num_nextn_predict_layers=0),
    }


def test_the_mtp_block_loads_as_written(ckpts):
    model = load_model(ckpts["mtp"], torch.float32, mtp=True)
    (block,) = model.mtp
    assert isinstance(block, MTPBlock) and block.attn.kind == SLIDING and block.attn.compressor is None
    assert not block.ffn.hash  # score-routed MoE
    want = random_state(ModelArgs.from_config({**TINY_CONFIG, "num_nextn_predict_layers": 1}), seed=3)
    for name in ("e_proj.weight", "h_proj.weight", "enorm.weight", "hnorm.weight", "norm.weight", "hc_head_fn",
                 "hc_attn_fn", "attn.wq_a.weight", "attn.attn_sink", "ffn.gate.weight"):
        assert torch.equal(block.get_parameter(name), want[f"mtp.0.{name}"]), name
    w13 = block.ffn.experts.w13  # [E, 2I, D]: the checkpoint's per-expert w1 / w3, stacked
    assert torch.equal(w13[5], torch.cat([want["mtp.0.ffn.experts.5.w1.weight"], want["mtp.0.ffn.experts.5.w3.weight"]]))
    assert any(n.startswith("mtp.") for n in model.checkpoint_reads)


def test_fp8_mxfp4_mtp_dequantizes_like_the_layers(ckpts):
    exact, fp8 = (load_model(ckpts[k], torch.float32, mtp=True).mtp[0] for k in ("mtp", "mtp-fp8"))
    for name in ("attn.wq_a.weight", "ffn.experts.w13", "ffn.shared_experts.w13.weight"):
        a, b = exact.get_parameter(name), fp8.get_parameter(name)
        assert not torch.equal(a, b)  # stored FP8 / MXFP4
        assert (a - b).norm() / a.norm() < 0.2, name  # MXFP4 (e2m1) is coarse; FP8 ~3 %


def test_without_mtp_nothing_of_it_is_read_and_the_main_model_is_the_same(ckpts):
    plain = load_model(ckpts["mtp"], torch.float32)
    assert len(plain.mtp) == 0 and not any(n.startswith("mtp.") for n in plain.checkpoint_reads)
    none = load_model(ckpts["none"], torch.float32)  # num_nextn_predict_layers 0, same seed
    torch.testing.assert_close(prefill_logits(plain, PROMPTS), prefill_logits(none, PROMPTS), rtol=0, atol=0)
    with pytest.raises(CheckpointError, match="num_nextn_predict_layers is 0"):
        load_model(ckpts["none"], torch.float32, mtp=True)


@torch.no_grad()
def test_mtp_forward_reads_the_streams_and_the_next_token(ckpts):
    """One draft step over whole prompts: streams of position t and the embedding of token t+1 -> logits [T, V]
    from the shared head. The position-0 embedding is masked (upstream); every other row depends on both inputs."""
    model = load_model(ckpts["mtp"], torch.float32, mtp=True)
    groups = [g.name for g in model.cache_specs(16)]

    def draft(prompts, shift_ids):
        batch, blocks = ForwardBatch.prefill(prompts, groups, 16, torch.device("cpu"))
        bind_new_caches(model, dict.fromkeys(groups, blocks), 16)
        streams = model.residual_streams(batch)  # [T, n, D]
        assert streams.shape == (batch.input_ids.shape[0], model.args.hc_mult, model.args.hidden_size)
        nxt = torch.tensor([t for p in shift_ids for t in p])
        out = model.mtp[0](streams, model.embed_tokens(nxt), batch)  # [T, n, D]
        return model.compute_logits(model.mtp[0].final_hidden(out))  # [T, V]

    p = PROMPTS[0]
    base = draft([p], [p[1:] + [0]])
    assert base.shape == (len(p), model.args.vocab_size) and torch.isfinite(base).all()
    masked = draft([p], [[7] + p[2:] + [0]])  # position 0's next token changed: its embedding is masked
    torch.testing.assert_close(masked, base, rtol=0, atol=0)
    nxt = p[1:] + [0]
    nxt[3] = 123  # position 3's next token: rows 0-2 (causal) stay, rows from 3 change
    later = draft([p], [nxt])
    torch.testing.assert_close(later[:3], base[:3], rtol=0, atol=0)
    assert not torch.allclose(later[3], base[3]) and not torch.allclose(later[-1], base[-1])
    other_prefix = draft([[8] + p[1:]], [p[1:] + [0]])  # token 0 changed: the main model's streams change
    assert not torch.allclose(other_prefix[0], base[0])


def test_a_w8a8_conversion_quantizes_the_mtp_block_like_a_layer(ckpts, tmp_path):
    from convert_checkpoint import convert
    from modeling_deepseek_v4 import QuantLinear

    convert(ckpts["mtp"], tmp_path / "w8a8", "w8a8", progress=False)
    block = load_model(tmp_path / "w8a8", torch.float32, mtp=True).mtp[0]
    assert isinstance(block.attn.wq_b, QuantLinear) and block.ffn.experts.w13.dtype == torch.int8
    assert block.e_proj.weight.dtype == torch.float32  # e_proj / h_proj are not in upstream's selection


def test_train_mtp_writes_a_checkpoint_the_engine_speculates_with(ckpts, tmp_path):
    """train_mtp.py on a checkpoint without an MTP layer (a few seconds of training): the output loads with
    mtp=True, its MTP block is the trained one (not the last layer's copy it starts from), and speculative greedy
    decoding over it equals plain decoding."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    from transformers import AutoTokenizer

    from common.engine import LLM, SamplingParams

    script = Path(__file__).resolve().parents[3] / "recipes" / "deepseek" / "bench" / "train_mtp.py"
    out = tmp_path / "with-mtp"
    r = subprocess.run([sys.executable, str(script), "--weights", str(ckpts["none"]), "--out", str(out),
                        "--sequences", "8", "--length", "48", "--minutes", "0.05"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    report = json.loads((out / "mtp_training.json").read_text())
    assert report["steps"] >= 1 and 0 <= report["held_out_acceptance"] <= 1
    model = load_model(out, torch.float32, mtp=True)
    last = model.layers[-1].attn.wq_a.weight
    assert not torch.equal(model.mtp[0].attn.wq_a.weight, last)  # trained from the last layer's copy
    tok = AutoTokenizer.from_pretrained(out)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    plain = LLM(model, tok, block_size=16).generate(PROMPTS, params, use_tqdm=False)
    spec = LLM(model, tok, block_size=16, num_speculative_tokens=2).generate(PROMPTS, params, use_tqdm=False)
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]
