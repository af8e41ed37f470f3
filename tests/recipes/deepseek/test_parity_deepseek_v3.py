"""The recipe's MLA models against transformers on the same tiny checkpoints, fp32.

DeepseekV3 == transformers.DeepseekV3ForCausalLM (DeepSeek-V3 config: q LoRA, 4 expert groups, YaRN with mscale;
Kimi-K2-style config: n_group 1, one dense layer, no q LoRA) and == DeepseekV32ForCausalLM (V3.2 config:
lightning indexer with index_topk 8, below the longest prompt here, so the sparse selection binds). Both MLA
paths (absorbed into the query / output, and K / V expanded) are compared, over the publisher's layout (FP8
included), transformers' stacked layout and what save_pretrained writes. Then greedy decoding through the engine
(paged latent cache, continuous batching, chunked prefill) against transformers' full-recompute greedy decoding.
The tiny indexer's LayerNorm bias is small, so exact zero-score ties (relu) do not fall on the top-k boundary.
"""
import json

import pytest
import torch
from transformers import AutoTokenizer, DeepseekV3Config, DeepseekV3ForCausalLM, DeepseekV32ForCausalLM
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3Attention, DeepseekV3RotaryEmbedding

from common import ops
from common.engine import LLM, SamplingParams
from common.engine.model_runner import bind_new_caches, prefill_logits
from common.kv_cache import cache_bytes_per_block
from common.loader import Checkpoint, save_checkpoint
from common.ops.emulator import TorchNpuEmulator
from config_deepseek_v3 import ModelArgs
from modeling_deepseek_v3 import LATENT, split_decodes, yarn_inv_freq
from tiny_deepseek_v3 import tiny_config, write_tiny_checkpoint
from weights_deepseek_v3 import load_model

PROMPT_LENGTHS = (5, 13, 40)
VARIANTS = ("v3", "v32", "kimi")


def reference_model(path):
    """transformers' model for a checkpoint folder; a kimi_k2 config is read as the DeepseekV3Config it is."""
    cfg = json.loads((path / "config.json").read_text())
    if cfg["model_type"] == "deepseek_v32":
        return DeepseekV32ForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()
    config = DeepseekV3Config(**{k: v for k, v in cfg.items() if k != "model_type"})
    return DeepseekV3ForCausalLM.from_pretrained(path, config=config, dtype=torch.float32,
                                                 attn_implementation="eager").eval()


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("mla")
    out = {}
    for variant in VARIANTS:
        path = write_tiny_checkpoint(root / variant, variant=variant, seed=3, quantized=False)
        out[variant] = (path, reference_model(path))
    return root, out


def _prompts(n_vocab, lengths=PROMPT_LENGTHS, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(2, n_vocab, (n,), generator=g).tolist() for n in lengths]


def _assert_matches(model, reference, what):
    with torch.no_grad():
        for ids in _prompts(model.args.vocab_size):
            expected = reference(torch.tensor([ids])).logits[0]  # [L, V]
            got = prefill_logits(model, [ids])
            err = (got - expected).abs().max().item()
            assert err < 1e-4, f"{what}, prompt length {len(ids)}: max |diff| {err}"


@pytest.mark.parametrize("mode", ["absorbed", "expanded"])
@pytest.mark.parametrize("variant", VARIANTS)
def test_full_sequence_logits_match_transformers(checkpoints, variant, mode):
    _, paths = checkpoints
    path, reference = paths[variant]
    model = load_model(path, dtype=torch.float32)
    model.set_attention_mode(mode)
    if variant == "v32":
        assert model.args.index_topk < max(PROMPT_LENGTHS)
    _assert_matches(model, reference, f"{variant} {mode}")


@pytest.mark.parametrize("layout", ["transformers", "save_pretrained"])
def test_other_layouts_load_the_same_model(checkpoints, layout):
    root, paths = checkpoints
    path, reference = paths["v3"]
    if layout == "transformers":  # stacked experts, as in transformers' state_dict; plus an MTP layer, not read
        config = dict(Checkpoint(path).config, num_nextn_predict_layers=1)
        mtp = {"model.layers.4.eh_proj.weight": torch.zeros(64, 128), "model.layers.4.enorm.weight": torch.ones(64)}
        save_checkpoint(root / layout, {**reference.state_dict(), **mtp}, config)
        assert any(n.endswith("mlp.experts.gate_up_proj") for n in Checkpoint(root / layout).names())
    else:
        reference.save_pretrained(root / layout)
    _assert_matches(load_model(root / layout, dtype=torch.float32), reference, layout)


def test_sparse_selection_binds(checkpoints):
    """V3.2 with the indexer's top-k raised past every prompt is plain MLA: the logits then change."""
    _, paths = checkpoints
    model = load_model(paths["v32"][0], dtype=torch.float32)
    ids = _prompts(model.args.vocab_size)[-1]
    sparse = prefill_logits(model, [ids])
    for layer in model.model.layers:
        layer.self_attn.indexer.topk = len(ids)
    dense = prefill_logits(model, [ids])
    topk = model.args.index_topk
    torch.testing.assert_close(sparse[:topk], dense[:topk], atol=1e-4, rtol=0)  # at most topk keys: all kept
    assert (sparse[topk:] - dense[topk:]).abs().max() > 1e-2


def test_fp8_checkpoint_loads_dequantized(tmp_path):
    path = write_tiny_checkpoint(tmp_path / "fp8", variant="v32", seed=5, quantized=True)
    ckpt = Checkpoint(path)
    assert ckpt.config["quantization_config"]["weight_block_size"] == [128, 128]
    kv_b = "model.layers.1.self_attn.kv_b_proj.weight"
    assert ckpt.dtype(kv_b) == torch.float8_e4m3fn and kv_b + "_scale_inv" in ckpt
    assert "model.layers.1.mlp.experts.7.down_proj.weight_scale_inv" in ckpt
    assert ckpt.dtype("model.layers.1.mlp.gate.weight") == torch.float32
    # the same weights for transformers: dequantized, stored in fp32
    config = {k: v for k, v in ckpt.config.items() if k != "quantization_config"}
    save_checkpoint(tmp_path / "dequantized", {n: ckpt.get(n, torch.float32) for n in ckpt.names()}, config)
    model = load_model(path, dtype=torch.float32)
    assert model.args.fp8_block == [128, 128]
    _assert_matches(model, reference_model(tmp_path / "dequantized"), "fp8")


def test_packed_batch_equals_one_sequence_at_a_time(checkpoints):
    _, paths = checkpoints
    model = load_model(paths["v32"][0], dtype=torch.float32)
    prompts = _prompts(model.args.vocab_size)
    packed = prefill_logits(model, prompts)
    alone = torch.cat([prefill_logits(model, [p]) for p in prompts])
    torch.testing.assert_close(packed, alone, atol=1e-4, rtol=1e-5)


def test_split_decodes_parts_a_step_by_its_query_lengths():
    assert split_decodes([0, 1, 13, 14, 54]) == ([0, 2], [1, 3])  # a decode, a chunk of 12, a decode, one of 40
    assert split_decodes([0, 8, 17]) == ([0], [1])  # 8 new tokens short, 9 long
    assert split_decodes([0, 1, 2]) is None  # decodes only: absorbed whole
    assert split_decodes([0, 12, 52]) is None  # chunks only: expanded whole


@pytest.mark.parametrize("variant", VARIANTS)
def test_step_of_short_and_long_prompts_equals_transformers(checkpoints, variant):
    """One step of prompts of 5, 13 and 40 tokens: auto attends the 5 absorbed (as it would a decode beside
    prompt chunks; V3.2 over its indexer's selection) and the others expanded; every position's logits are
    transformers' own."""
    _, paths = checkpoints
    path, reference = paths[variant]
    model = load_model(path, dtype=torch.float32)
    prompts = _prompts(model.args.vocab_size)
    assert split_decodes([0, *torch.tensor(PROMPT_LENGTHS).cumsum(0).tolist()]) == ([0], [1, 2])
    got = prefill_logits(model, prompts)  # [sum L, V]
    with torch.no_grad():
        expected = torch.cat([reference(torch.tensor([ids])).logits[0] for ids in prompts])
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("variant", ["v32", "kimi"])  # q LoRA + indexer + groups; q_proj + no groups
def test_npu_path_emulated_matches_reference_path(checkpoints, variant):
    """Both MLA paths through the NPU implementations of common.ops, on CPU via the torch_npu emulator (each call
    bound to the op's real schema). Emulation, not hardware."""
    _, paths = checkpoints
    model = load_model(paths[variant][0], dtype=torch.float32)
    prompts = [list(range(2, 23)), list(range(40, 51))]
    for mode in ("absorbed", "expanded"):
        model.set_attention_mode(mode)
        expected = prefill_logits(model, prompts)
        emulator = TorchNpuEmulator()
        previous = ops.use_backend("npu", emulator)
        try:
            got = prefill_logits(model, prompts)
        finally:
            ops.use_backend(previous)
        assert {"npu_rms_norm", "npu_rotary_mul", "npu_scatter_nd_update_", "npu_moe_gating_top_k",
                "npu_grouped_matmul", "npu_moe_finalize_routing"} <= set(emulator.calls)
        torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-5)


def test_latent_cache_holds_one_row_per_token(checkpoints):
    _, paths = checkpoints
    for variant, per_token in (("v3", 32 + 16), ("v32", 32 + 16 + 32)):  # latent + rope key (+ indexer key)
        model = load_model(paths[variant][0], dtype=torch.float32)
        assert [s.name for s in model.cache_specs(16)] == [LATENT]
        bytes_per_block = cache_bytes_per_block(model.cache_tensor_specs(), 16, model.engine_contract().dtype)
        assert bytes_per_block == {LATENT: 16 * per_token * 4 * model.args.num_hidden_layers}


def test_rope_and_softmax_scale_match_transformers():
    """YaRN inverse frequencies, the cos / sin factor and the attention scale, on the published V3 values."""
    published = dict(tiny_config("v3"), hidden_size=7168, num_attention_heads=128, num_key_value_heads=128,
                     q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
                     v_head_dim=128, max_position_embeddings=163840,
                     rope_scaling={"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096,
                                   "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0})
    for cfg in (published, tiny_config("v3"), tiny_config("kimi")):
        args = ModelArgs.from_config(cfg)
        hf = DeepseekV3Config(**{k: v for k, v in cfg.items() if k not in ("model_type", "quantization_config")})
        rope = DeepseekV3RotaryEmbedding(hf)
        torch.testing.assert_close(yarn_inv_freq(args), rope.inv_freq, rtol=1e-6, atol=0)
        assert args.rope_attention_factor == pytest.approx(rope.attention_scaling)
        assert args.softmax_scale == pytest.approx(DeepseekV3Attention(hf, 0).scaling)
    assert ModelArgs.from_config(published).softmax_scale == pytest.approx(192 ** -0.5 * (0.1 * 3.6888794541 + 1) ** 2)


@pytest.mark.parametrize("bad, message", [
    ({"model_type": "llama"}, "model_type"),
    ({"n_group": 3}, "n_group"),
    ({"num_experts_per_tok": 9}, "num_experts_per_tok"),  # 2 groups of 4 hold 8
    ({"num_key_value_heads": 1}, "num_key_value_heads"),
    ({"first_k_dense_replace": 1, "mlp_layer_types": ["dense", "sparse"]}, "mlp_layer_types"),
    ({"quantization_config": {"quant_method": "fp8", "weight_block_size": [64, 64]}}, "block"),
    ({"quantization_config": {"quant_method": "awq"}}, "quantization_config"),
    ({"model_type": "deepseek_v32", "q_lora_rank": None}, "q_lora_rank"),
    ({"qk_rope_head_dim": 15}, "qk_rope_head_dim"),
    ({"rope_scaling": {"type": "linear", "factor": 2.0}}, "rope type"),
])
def test_model_args_refuse_bad_configs(bad, message):
    with pytest.raises(ValueError, match=message):
        ModelArgs.from_config({**tiny_config("v3"), **bad})


def test_model_args_read_each_model_type():
    v3, v32, kimi = (ModelArgs.from_config(tiny_config(v)) for v in VARIANTS)
    assert v3.mlp_layer_types == ["dense", "sparse", "sparse", "sparse"] and not v3.sparse
    assert v32.sparse and v32.index_topk == 8
    assert kimi.model_type == "kimi_k2" and kimi.n_group == 1 and kimi.q_lora_rank is None
    hf_style = dict(tiny_config("v3"), rope_parameters={"rope_type": "yarn", "rope_theta": 5e4, "factor": 4.0,
                                                        "original_max_position_embeddings": 128})
    hf_style.pop("rope_scaling"), hf_style.pop("rope_theta")
    args = ModelArgs.from_config(hf_style)
    assert args.rope_theta == 5e4 and args.rope_scaling["factor"] == 4.0


NEW_TOKENS = 24
ENGINE_PROMPTS = (5, 13, 30, 22)


@pytest.mark.parametrize("variant, engine_kwargs", [
    ("v3", {}), ("v32", {}),  # whole prompts at once (K / V expanded), then decodes (absorbed)
    ("v3", {"max_num_batched_tokens": 12}),  # chunks of up to 12 tokens beside decodes: both paths over cached
    ("v32", {"max_num_batched_tokens": 12}),  # prefixes
    ("v32", {"num_blocks": 7}),  # too few blocks for all four: preemption by recompute
], ids=["v3", "v32", "v3-chunked-prefill", "v32-chunked-prefill", "v32-preemption"])
def test_greedy_engine_equals_transformers_full_recompute(checkpoints, variant, engine_kwargs):
    """Each engine token is transformers' argmax over the same prefix, recomputed in full: so, by induction,
    the engine's greedy output is transformers' greedy full-recompute output (one reference forward per prompt
    scores every step at once, the causal mask keeping each step's logits those of its own prefix)."""
    _, paths = checkpoints
    path, reference = paths[variant]
    prompts = _prompts(500, ENGINE_PROMPTS, seed=1)
    llm = LLM(load_model(path, torch.float32), AutoTokenizer.from_pretrained(path), block_size=16, **engine_kwargs)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True), use_tqdm=False)
    with torch.no_grad():
        for ids, out in zip(prompts, outs):
            assert len(out.token_ids) == NEW_TOKENS
            logits = reference(torch.tensor([ids + out.token_ids[:-1]])).logits[0, len(ids) - 1 :]  # [N, V]
            assert out.token_ids == logits.argmax(-1).tolist()
    engine = llm.engine
    if "max_num_batched_tokens" in engine_kwargs:
        assert max(engine.stats.recent_step_tokens) <= 12
    if "num_blocks" in engine_kwargs:
        assert engine.scheduler.num_preemptions > 0
    assert engine.kv_cache.all_blocks_free()


def test_prefix_cache_hit_equals_miss(checkpoints):
    _, paths = checkpoints
    path = paths["v32"][0]
    model, tok = load_model(path, torch.float32), AutoTokenizer.from_pretrained(path)
    shared = _prompts(500, (32,), seed=2)[0]  # two full blocks of 16
    first, second = shared + [7, 8, 9], shared + [11, 12]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    cold = LLM(model, tok, block_size=16, enable_prefix_caching=False).generate([second], params, use_tqdm=False)[0]
    llm = LLM(model, tok, block_size=16)
    llm.generate([first], params, use_tqdm=False)
    warm = llm.generate([second], params, use_tqdm=False)[0]
    assert warm.num_cached_tokens == 32 and cold.num_cached_tokens == 0
    assert warm.token_ids == cold.token_ids


def _rms(x, w, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def test_mtp_layer_equals_a_transformers_decoder_layer_on_its_inputs(checkpoints):
    """The MTP layer (`model.layers.4`) over a prompt: its input eh_proj([enorm(embedding of t+1); hnorm(the main
    model's final normed hidden at t)]) (embedding zeroed at position 0), written out here from the published
    rule, then a one-layer transformers DeepseekV3Model (a MoE layer) holding the layer's tensors, with
    shared_head.norm as its final norm, then the main LM head: the recipe's draft logits equal that, fp32 1e-4."""
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3Model

    from common.engine.forward_batch import ForwardBatch
    _, paths = checkpoints
    path, reference = paths["v3"]
    ckpt, cfg = Checkpoint(path), json.loads((path / "config.json").read_text())
    L, eps = cfg["num_hidden_layers"], cfg["rms_norm_eps"]
    get = lambda name: ckpt.get(f"model.layers.{L}.{name}", torch.float32)  # noqa: E731
    layer_cfg = DeepseekV3Config(**{k: v for k, v in cfg.items() if k != "model_type"} | dict(
        num_hidden_layers=1, first_k_dense_replace=0))
    one = DeepseekV3Model(layer_cfg).eval()
    state = {"embed_tokens.weight": ckpt.get("model.embed_tokens.weight", torch.float32), "norm.weight":
             get("shared_head.norm.weight")}
    for name in one.state_dict():
        if name.startswith("layers.0.") and ".experts." not in name:
            state[name] = get(name.removeprefix("layers.0."))
    E = cfg["n_routed_experts"]
    state["layers.0.mlp.experts.gate_up_proj"] = torch.stack(  # [E, gate | up, D]
        [torch.cat([get(f"mlp.experts.{e}.{w}_proj.weight") for w in ("gate", "up")]) for e in range(E)])
    state["layers.0.mlp.experts.down_proj"] = torch.stack([get(f"mlp.experts.{e}.down_proj.weight") for e in range(E)])
    one.load_state_dict(state)

    ids = _prompts(cfg["vocab_size"], (21,), seed=7)[0]
    with torch.no_grad():
        hidden = reference.model(torch.tensor([ids[:-1]])).last_hidden_state[0]  # [n, D] normed, positions 0..n-1
        embeds = reference.model.embed_tokens(torch.tensor(ids[1:]))  # [n, D] the next tokens'
        embeds[0] = 0
        x = torch.cat([_rms(embeds, get("enorm.weight"), eps), _rms(hidden, get("hnorm.weight"), eps)], -1)
        x = x @ get("eh_proj.weight").T  # [n, D]
        expected = one(inputs_embeds=x[None]).last_hidden_state[0] @ reference.lm_head.weight.T  # [n, V]

        model = load_model(path, dtype=torch.float32, mtp=True)
        groups = [g.name for g in model.cache_specs(16)]
        main, num_blocks = ForwardBatch.prefill([ids[:-1]], groups, 16)
        draft, _ = ForwardBatch.prefill([ids[1:]], groups, 16)  # the same positions and blocks
        bind_new_caches(model, dict.fromkeys(groups, num_blocks), 16)
        streams = model.residual_streams(main)  # [n, 1, D]
        mtp = model.mtp[0]
        got = model.compute_logits(mtp.final_hidden(mtp(streams, model.embed_tokens(draft.input_ids), draft)))
    assert (got - expected).abs().max().item() < 1e-4
