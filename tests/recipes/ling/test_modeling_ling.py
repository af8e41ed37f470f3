"""Ling-3.0-Flash's model (recipes/ling/modeling_ling.py) against transformers 5.24's BailingHybridForCausalLM.

The tiny checkpoint (tiny_ling.py: 4 KDA + 2 MLA layers, 2 dense + 4 MoE layers, one MTP layer) is written in the
publisher's layout, which transformers loads directly (it renames, concatenates the conv kernels and stacks the
experts itself). Both run in fp32: the full-sequence logits of several prompts packed into one step (one prompt
longer than KDA's 64-token chunk) match within 1e-4, with MLA absorbed and expanded; transformers' own layout loads
the same model. transformers ignores the SwiGLU limit lists, so the clamp is checked against the formula written
here, per layer. Also: the MTP layer's weights load (and only with mtp=True), bad config values are refused naming
their key, and the published config's sizes match the spec's arithmetic.
"""
import pytest
import torch
import torch.nn.functional as F
from transformers import BailingHybridForCausalLM

from common.engine.forward_batch import ForwardBatch
from common.engine.model_runner import bind_new_caches, prefill_logits
from common.loader import Checkpoint, save_checkpoint
from config_ling import PUBLISHED, ModelArgs, cache_bytes
from modeling_ling import KDA_GROUP, MLA_GROUP, KimiDeltaAttention, LingForCausalLM, MLAttention
from tiny_ling import tiny_config, write_tiny_checkpoint
from weights_ling import load_model, torch_default_dtype

PROMPT_LENGTHS = (5, 13, 70)  # 70: past KDA's 64-token chunk
pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py: the tiny model runs faster on one thread


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = write_tiny_checkpoint(tmp_path_factory.mktemp("ling") / "tiny", seed=3)
    reference, info = BailingHybridForCausalLM.from_pretrained(path, dtype=torch.float32, output_loading_info=True)
    return path, reference.eval(), info


def _prompts(n_vocab, lengths=PROMPT_LENGTHS, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(2, n_vocab, (n,), generator=g).tolist() for n in lengths]


def test_transformers_loads_the_publisher_layout(tiny):
    path, reference, info = tiny
    assert not info["missing_keys"] and not info["mismatched_keys"]
    assert not [k for k in info["unexpected_keys"] if not k.startswith("model.layers.6.")]  # only the MTP layer
    assert reference.config.layer_types == ["linear_attention"] * 2 + ["full_attention"] \
        + ["linear_attention"] * 2 + ["full_attention"]
    names = Checkpoint(path).names()
    assert "model.word_embeddings.weight" in names and "model.layers.0.attention.q_conv1d.weight" in names
    assert "model.layers.2.attention.dense.weight" in names and "model.layers.6.eh_proj.weight" in names


@pytest.mark.parametrize("mode", ["absorbed", "expanded"])
def test_full_sequence_logits_match_transformers(tiny, mode):
    path, reference, _ = tiny
    model = load_model(path, dtype=torch.float32)
    model.set_attention_mode(mode)
    prompts = _prompts(model.args.vocab_size)
    with torch.no_grad():
        expected = torch.cat([reference(torch.tensor([ids])).logits[0] for ids in prompts])  # [T, V]
        got = prefill_logits(model, prompts)  # all prompts packed in one step
    err = (got - expected).abs().max().item()
    assert err < 1e-4, f"{mode}: max |diff| {err}"
    assert expected.std().item() > 1  # logits far from flat: the comparison means something


def test_transformers_layout_loads_the_same_model(tiny, tmp_path):
    path, reference, _ = tiny
    save_checkpoint(tmp_path, dict(reference.state_dict()), Checkpoint(path).config)
    names = Checkpoint(tmp_path).names()
    assert "model.layers.0.self_attn.conv1d.weight" in names and "model.layers.2.mlp.experts.gate_up_proj" in names
    ours, theirs = load_model(path, dtype=torch.float32), load_model(tmp_path, dtype=torch.float32)
    for (name, a), (_, b) in zip(ours.state_dict().items(), theirs.state_dict().items()):
        assert torch.equal(a, b), name


def test_cache_tensors_and_bindings(tiny):
    path, _, _ = tiny
    model = load_model(path, dtype=torch.bfloat16, mtp=True)
    specs = {s.name: s for s in model.cache_tensor_specs()}
    assert list(specs) == ["layers.0.attention.conv_state", "layers.0.attention.recurrent_state",
                           "layers.1.attention.conv_state", "layers.1.attention.recurrent_state",
                           "layers.2.attention.kv_cache",
                           "layers.3.attention.conv_state", "layers.3.attention.recurrent_state",
                           "layers.4.attention.conv_state", "layers.4.attention.recurrent_state",
                           "layers.5.attention.kv_cache", "mtp.attention.kv_cache"]
    conv, state, latent = (specs[f"layers.{i}.attention.{n}"] for i, n in
                           ((0, "conv_state"), (0, "recurrent_state"), (2, "kv_cache")))
    assert (conv.group, conv.rows, conv.width, conv.dtype) == (KDA_GROUP, 3, 3 * 4 * 32, None)
    assert (state.group, state.rows, state.width, state.dtype) == (KDA_GROUP, 4, 32 * 32, torch.float32)
    assert (latent.group, latent.rows, latent.width) == (MLA_GROUP, None, 32 + 16)
    groups = bind_new_caches(model, {MLA_GROUP: 4, KDA_GROUP: 3}, 16)
    assert model.layers[0].attention.recurrent_state.dtype == torch.float32
    assert model.layers[0].attention.conv_state.dtype == torch.bfloat16
    assert [t.shape for t in groups[MLA_GROUP]] == [(4, 16, 1, 48)] * 3
    tensors = {n: getattr(model.get_submodule(n.rsplit(".", 1)[0]), n.rsplit(".", 1)[1]) for n in specs}
    with pytest.raises(ValueError, match="layers.0.attention.*share one table"):  # one layer's two states apart
        model.bind_caches(tensors, {"layers.0.attention.conv_state": "other"})
    with pytest.raises(ValueError, match="layers.9.attention.kv_cache"):
        model.bind_caches(tensors, {"layers.9.attention.kv_cache": MLA_GROUP})
    model.bind_caches(tensors, {"layers.2.attention.kv_cache": MLA_GROUP})  # its own group: fine
    assert model.engine_contract().mtp is model and model.engine_contract().eos_token_ids == (1,)  # MTP loaded


def test_each_layer_reads_the_table_it_is_bound_to(tiny):
    """bind_caches(tables=...): a KDA layer and an MLA layer read through tables of their own (vLLM's hybrid
    allocator gives groups of layers their own block tables), holding their rows in other slots and blocks than the
    rest: the logits equal those of the default binding."""
    path, _, _ = tiny
    model = load_model(path, dtype=torch.float32)
    prompts = _prompts(model.args.vocab_size, (5, 21))
    want = prefill_logits(model, prompts)
    specs = model.cache_tensor_specs()
    tensors = {s.name: torch.zeros(8, 16 if s.rows is None else s.rows, 1, s.width, dtype=s.dtype or torch.float32)
               for s in specs}
    own = {"layers.0.attention.conv_state": "kda_0", "layers.0.attention.recurrent_state": "kda_0",
           "layers.2.attention.kv_cache": "mla_2"}
    model.bind_caches(tensors, own)
    tables = [{MLA_GROUP: [1], KDA_GROUP: [0, 1], "kda_0": [0, 5], "mla_2": [6]},
              {MLA_GROUP: [2, 3], KDA_GROUP: [0, 2], "kda_0": [0, 4], "mla_2": [3, 7]}]
    batch = ForwardBatch.build(prompts, [0, 0], tables, 16, state_groups=(KDA_GROUP, "kda_0"))
    with torch.no_grad():
        got = model.compute_logits(model(batch))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert tensors["layers.0.attention.recurrent_state"][5].abs().sum() > 0  # written where its own table says
    assert tensors["layers.0.attention.recurrent_state"][1].abs().sum() == 0
    assert tensors["layers.2.attention.kv_cache"][[6, 3, 7]].abs().sum() > 0


def _clamped(gate, up, limit):
    """The per-layer clamp as vLLM's SwigluStepAndMul computes it; limit 0: none."""
    return F.silu(gate).clamp(max=limit) * up.clamp(-limit, limit) if limit else F.silu(gate) * up


def test_swiglu_clamps_follow_the_per_layer_lists(tiny, tmp_path):
    """Routed limits on layers 3 and 4, shared ones on 4 and 5: each MoE layer of our model equals the formula over
    the checkpoint's tensors, routed by transformers' router (exactly transformers' MoE where both limits are 0),
    and the limits bind."""
    _, reference, _ = tiny
    routed, shared = [0, 0, 0, 0.5, 0.5, 0], [0, 0, 0, 0, 0.7, 0.7]
    path = write_tiny_checkpoint(tmp_path, seed=3, expert_swiglu_limit_list=routed,
                                 share_expert_swiglu_limit_list=shared)
    model, ckpt = load_model(path, dtype=torch.float32, mtp=True), Checkpoint(path)
    assert model.mtp.mlp.limit is None and model.mtp.mlp.shared_experts.limit is None  # past the lists
    x = torch.randn(40, 64, generator=torch.Generator().manual_seed(5))

    def w(name):
        return ckpt.get(name, torch.float32)

    with torch.no_grad():
        for i in range(2, 6):
            p = f"model.layers.{i}.mlp"
            _, weights, idx = reference.model.layers[i].mlp.gate(x)  # [T, k] each, transformers' router
            expected = torch.zeros_like(x)
            for t in range(x.shape[0]):
                for j in range(idx.shape[1]):
                    e = f"{p}.experts.{int(idx[t, j])}"
                    h = _clamped(w(f"{e}.gate_proj.weight") @ x[t], w(f"{e}.up_proj.weight") @ x[t], routed[i])
                    expected[t] += weights[t, j] * (w(f"{e}.down_proj.weight") @ h)
            s = f"{p}.shared_experts"
            expected += _clamped(x @ w(f"{s}.gate_proj.weight").T, x @ w(f"{s}.up_proj.weight").T,
                                 shared[i]) @ w(f"{s}.down_proj.weight").T
            got = model.layers[i].mlp(x)
            torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
            unclamped = reference.model.layers[i].mlp(x.unsqueeze(0))[0]
            if routed[i] or shared[i]:
                assert (got - unclamped).abs().max() > 1e-2, f"layer {i}: the limits do not bind"
            else:
                torch.testing.assert_close(got, unclamped, atol=1e-5, rtol=1e-5)


def test_mtp_layer_loads_only_when_asked(tiny):
    path, _, _ = tiny
    ckpt = Checkpoint(path)
    plain = load_model(path, dtype=torch.float32)
    assert plain.mtp is None and not [n for n in plain.checkpoint_reads if n.startswith("model.layers.6.")]
    model = load_model(path, dtype=torch.float32, mtp=True)
    mtp_names = [n for n in ckpt.names() if n.startswith("model.layers.6.")]
    assert mtp_names and set(mtp_names) <= set(model.checkpoint_reads)
    for ours, theirs in (("eh_proj.weight", "eh_proj.weight"), ("enorm.weight", "enorm.weight"),
                         ("final_layernorm.weight", "final_layernorm.weight"),
                         ("attention.g_proj.weight", "attention.g_proj.weight"),
                         ("attention.dense.weight", "attention.dense.weight"),
                         ("mlp.gate.expert_bias", "mlp.gate.expert_bias")):
        assert torch.equal(model.mtp.get_parameter(ours) if "bias" not in ours else model.mtp.get_buffer(ours),
                           ckpt.get(f"model.layers.6.{theirs}", torch.float32)), ours
    torch.testing.assert_close(model.mtp.mlp.experts.gate_up_proj[3, :32],
                               ckpt.get("model.layers.6.mlp.experts.3.gate_proj.weight", torch.float32))
    # the main model is the same with or without it, and the draft runs causally over a prefill
    prompts = _prompts(model.args.vocab_size, (9, 20), seed=1)
    specs = model.cache_specs(16)
    batch, n = ForwardBatch.prefill(prompts, [s.name for s in specs], 16, state_groups=(KDA_GROUP,))
    with torch.no_grad():
        bind_new_caches(model, dict.fromkeys([s.name for s in specs], n), 16)
        hidden = model(batch)
        torch.testing.assert_close(model.compute_logits(hidden), prefill_logits(plain, prompts))
        next_ids = torch.cat([torch.tensor(p[1:] + [2]) for p in prompts])
        draft = model.mtp_logits(hidden, next_ids, batch)  # [T, V]
        assert draft.shape == (29, model.args.vocab_size) and draft.isfinite().all()
        short = ForwardBatch.prefill([prompts[1][:12]], [s.name for s in specs], 16, state_groups=(KDA_GROUP,))[0]
        bind_new_caches(model, dict.fromkeys([s.name for s in specs], n), 16)
        draft_short = model.mtp_logits(model(short), next_ids[9:21], short)  # [12, V]
        torch.testing.assert_close(draft_short, draft[9:21], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("key, value", [
    ("model_type", "bailing_moe"), ("kda_safe_gate", False), ("no_kda_lora", False), ("q_lora_rank", 64),
    ("layer_group_size", 4), ("layer_types", ["linear_attention"] * 6), ("rope_interleave", False),
    ("rope_parameters", {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4}),
    ("gated_attention_proj_granularity_type", "element_wise"), ("num_key_value_heads", 2), ("n_group", 3),
    ("score_function", "softmax"), ("hidden_act", "gelu"), ("kda_lower_bound", 1.0),
    ("expert_swiglu_limit_list", [0.0] * 5), ("share_expert_swiglu_limit_list", [1.0] + [0.0] * 5),
    ("tie_word_embeddings", True), ("quantization_config", {"quant_method": "fp8"}),
])
def test_bad_config_values_are_refused_naming_the_key(key, value):
    with pytest.raises(ValueError, match=key):
        ModelArgs.from_config(tiny_config(**{key: value}))


def test_transformers_names_and_the_layer_pattern():
    theirs = ("num_experts", "n_group", "num_experts_per_tok", "norm_topk_prob", "max_position_embeddings",
              "num_nextn_predict_layers")
    args = ModelArgs.from_config({**{k: v for k, v in tiny_config().items() if k not in theirs},
                                  "num_local_experts": 16, "num_expert_group": 4, "num_experts_per_token": 4,
                                  "moe_renormalize": False, "model_max_length": 256, "num_mtp_layers": 0})
    assert (args.n_routed_experts, args.n_group, args.num_experts_per_tok) == (16, 4, 4)
    assert (args.norm_topk_prob, args.max_position_embeddings, args.num_nextn_predict_layers) == (False, 256, 0)
    assert args.mla_layers == [2, 5] and args.kda_layers == [0, 1, 3, 4]
    saved = {**tiny_config(), "head_dim": 16, "linear_head_dim": 32}  # save_pretrained's: head_dim is the rope width
    assert ModelArgs.from_config(saved).head_dim == 32


def test_published_config_sizes_match_the_spec():
    """The spec's arithmetic ("Parameter count", "State per request"), from the model built on the meta device."""
    args = ModelArgs.from_config(PUBLISHED)
    assert args.mla_layers == [5, 11, 17, 23, 29, 35, 41] and len(args.kda_layers) == 35
    assert cache_bytes(args) == {"mla_per_token": 8064, "kda_conv_per_request": 35 * 73728,
                                 "kda_recurrent_per_request": 35 * 2097152, "kda_per_request": 75980800}
    assert cache_bytes(args, mtp=True)["mla_per_token"] == 9216
    with torch_default_dtype(torch.bfloat16), torch.device("meta"):
        model = LingForCausalLM(args, mtp=True)

    def count(module):
        return sum(t.numel() for t in module.state_dict().values())

    kda, mla = model.layers[0].attention, model.layers[5].attention
    assert isinstance(kda, KimiDeltaAttention) and isinstance(mla, MLAttention)
    assert (count(kda), count(mla)) == (63_049_888, 31_965_696)
    assert (count(model.layers[2].mlp), count(model.layers[0].mlp)) == (3_027_108_352, 47_185_920)
    main = count(model) - count(model.mtp)
    norms = 2 * 42 * 2560 + 2560
    assert main == 35 * 63_049_888 + 7 * 31_965_696 + 40 * 3_027_108_352 + 2 * 47_185_920 + 2 * 157184 * 2560 + norms
    assert round(main / 1e9, 2) == 124.41 and round(count(model.mtp) / 1e9, 2) == 3.07
