"""The recipe's HunyuanVideo DiT against diffusers' HunyuanVideoTransformer3DModel on the same random tiny
weights (publisher names, converted by publisher_to_diffusers), fp32; checkpoint loading and config checks."""
import json

import pytest
import torch
from config_hunyuan_video import HunyuanVideoConfig
from diffusers import HunyuanVideoTransformer3DModel
from modeling_hunyuan_video import HunyuanVideoTransformer3D
from safetensors.torch import load_file, save_file
from weights_hunyuan_video import (
    diffusers_config,
    load_transformer,
    publisher_to_diffusers,
    random_state_dict,
    tiny_config,
    write_tiny_transformer,
)

from common.loader import CheckpointError

TEXT_LENGTHS = (7, 4)  # row 1 is right-padded from 4 to 7 tokens


def inputs(cfg, frames=3, height=8, width=6, seed=1):
    g = torch.Generator().manual_seed(seed)
    B, L = len(TEXT_LENGTHS), max(TEXT_LENGTHS)
    mask = (torch.arange(L)[None] < torch.tensor(TEXT_LENGTHS)[:, None]).long()  # [B, L]
    return dict(hidden_states=torch.randn(B, cfg.in_channels, frames, height, width, generator=g),
                timestep=torch.tensor([937.0, 214.0]),
                encoder_hidden_states=torch.randn(B, L, cfg.text_states_dim, generator=g),
                encoder_attention_mask=mask,
                pooled_projections=torch.randn(B, cfg.text_states_dim_2, generator=g),
                guidance=torch.tensor([6000.0, 3500.0]))


@pytest.fixture(scope="module")
def models():
    cfg = tiny_config()
    weights = random_state_dict(cfg, seed=0)
    ours = HunyuanVideoTransformer3D(cfg).eval()
    ours.load_state_dict(weights)
    reference = HunyuanVideoTransformer3DModel(**diffusers_config(cfg)).eval()
    reference.load_state_dict(publisher_to_diffusers(weights), strict=True)
    return cfg, ours, reference


@pytest.mark.parametrize("frames, height, width", [(3, 8, 6), (1, 4, 4)])
@torch.no_grad()
def test_matches_diffusers(models, frames, height, width):
    cfg, ours, reference = models
    x = inputs(cfg, frames, height, width)
    got = ours(**x)
    want = reference(**x, return_dict=False)[0]
    assert got.shape == want.shape == x["hidden_states"].shape
    assert want.abs().max() > 0.1  # the output is not trivially small
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


@torch.no_grad()
def test_text_padding_does_not_change_the_output(models):
    cfg, ours, _ = models
    x = inputs(cfg)
    want = ours(**x)
    junk = dict(x, encoder_hidden_states=x["encoder_hidden_states"].clone())
    junk["encoder_hidden_states"][1, TEXT_LENGTHS[1]:] = 1e3  # different values in the padded slots
    torch.testing.assert_close(ours(**junk), want, rtol=0, atol=0)
    longer = {k: v for k, v in x.items()}  # three more padded slots in every row
    longer["encoder_hidden_states"] = torch.cat([x["encoder_hidden_states"], torch.randn(2, 3, cfg.text_states_dim)], 1)
    longer["encoder_attention_mask"] = torch.cat([x["encoder_attention_mask"], torch.zeros(2, 3, dtype=torch.long)], 1)
    torch.testing.assert_close(ours(**longer), want, rtol=1e-5, atol=1e-5)
    alone = {k: v[1:] for k, v in x.items()}  # row 1 without the batch and without padding
    alone["encoder_hidden_states"] = alone["encoder_hidden_states"][:, :TEXT_LENGTHS[1]]
    alone["encoder_attention_mask"] = alone["encoder_attention_mask"][:, :TEXT_LENGTHS[1]]
    torch.testing.assert_close(ours(**alone), want[1:], rtol=1e-5, atol=1e-5)


@torch.no_grad()
def test_a_masked_token_in_the_middle_is_left_out(models):
    """Varlen attention takes any mask, not only right padding: a hole equals the prompt without that token."""
    cfg, ours, _ = models
    x = {k: v[:1] for k, v in inputs(cfg).items()}
    holed = dict(x, encoder_attention_mask=x["encoder_attention_mask"].clone())
    holed["encoder_attention_mask"][0, 2] = 0
    keep = [i for i in range(x["encoder_hidden_states"].shape[1]) if i != 2]
    without = dict(x, encoder_hidden_states=x["encoder_hidden_states"][:, keep],
                   encoder_attention_mask=x["encoder_attention_mask"][:, keep])
    torch.testing.assert_close(ours(**holed), ours(**without), rtol=1e-5, atol=1e-5)


@torch.no_grad()
def test_guidance_and_timestep_change_the_output(models):
    cfg, ours, _ = models
    x = inputs(cfg)
    base = ours(**x)
    assert not torch.allclose(ours(**dict(x, guidance=x["guidance"] * 0.5)), base, atol=1e-3)
    assert not torch.allclose(ours(**dict(x, timestep=x["timestep"] * 0.5)), base, atol=1e-3)


def test_checkpoint_round_trip(tmp_path):
    path = write_tiny_transformer(tmp_path / "transformers", seed=4, text_states_dim=24)
    cfg = HunyuanVideoConfig.from_json(path / "config.json")
    assert cfg.text_states_dim == 24 and cfg == tiny_config(text_states_dim=24)
    model = load_transformer(path, dtype=torch.float32)
    want = random_state_dict(cfg, seed=4)
    got = model.state_dict()
    assert got.keys() == want.keys()
    assert all(torch.equal(got[k], want[k]) for k in want)
    assert load_transformer(path, dtype=torch.bfloat16).img_in.proj.weight.dtype == torch.bfloat16


def test_publisher_names():
    names = set(random_state_dict(tiny_config()))
    for name in ["img_in.proj.weight", "time_in.mlp.0.weight", "time_in.mlp.2.bias", "vector_in.in_layer.weight",
                 "guidance_in.mlp.0.weight", "txt_in.input_embedder.weight", "txt_in.t_embedder.mlp.0.weight",
                 "txt_in.c_embedder.linear_1.weight", "txt_in.individual_token_refiner.blocks.1.self_attn_qkv.weight",
                 "txt_in.individual_token_refiner.blocks.0.adaLN_modulation.1.weight",
                 "txt_in.individual_token_refiner.blocks.0.norm1.bias",
                 "txt_in.individual_token_refiner.blocks.0.mlp.fc2.bias",
                 "double_blocks.1.img_mod.linear.weight", "double_blocks.0.img_attn_qkv.bias",
                 "double_blocks.0.img_attn_q_norm.weight", "double_blocks.0.txt_attn_k_norm.weight",
                 "double_blocks.0.img_attn_proj.weight", "double_blocks.0.txt_mlp.fc1.weight",
                 "single_blocks.1.linear1.weight", "single_blocks.0.linear2.bias", "single_blocks.0.q_norm.weight",
                 "single_blocks.0.modulation.linear.weight", "final_layer.adaLN_modulation.1.weight",
                 "final_layer.linear.weight"]:
        assert name in names, name


def test_full_size_names_and_shapes_match_diffusers():
    """HYVideo-T/2-cfgdistill on the meta device: 12.8B parameters, and the conversion gives exactly diffusers'
    state dict names and shapes (the single blocks' linear1 split at hidden 3072)."""
    cfg = HunyuanVideoConfig()
    with torch.device("meta"):
        ours = HunyuanVideoTransformer3D(cfg)
        reference = HunyuanVideoTransformer3DModel(**diffusers_config(cfg))
    assert 12.7e9 < sum(p.numel() for p in ours.parameters()) < 12.9e9
    converted, want = publisher_to_diffusers(ours.state_dict()), reference.state_dict()
    assert converted.keys() == want.keys()
    assert all(converted[k].shape == want[k].shape for k in want)


def _edit_checkpoint(path, edit):
    tensors = load_file(path / "model.safetensors")
    edit(tensors)
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})


@pytest.mark.parametrize("edit, message", [
    (lambda t: t.pop("double_blocks.1.txt_attn_qkv.weight"), "missing"),
    (lambda t: t.__setitem__("double_blocks.9.img_mod.linear.weight", torch.zeros(3)), "unexpected"),
    (lambda t: t.__setitem__("final_layer.linear.bias", torch.zeros(5)), "shape"),
])
def test_checkpoint_mismatch_is_an_error(tmp_path, edit, message):
    path = write_tiny_transformer(tmp_path / "transformers")
    _edit_checkpoint(path, edit)
    with pytest.raises(CheckpointError, match=message):
        load_transformer(path, dtype=torch.float32)


@pytest.mark.parametrize("bad", [dict(heads_num=3), dict(rope_dim_list=(8, 12, 10)), dict(rope_dim_list=(7, 13, 12)),
                                 dict(patch_size=(1, 2)), dict(mm_double_blocks_depth=0), dict(qk_norm_type="layer"),
                                 dict(text_projection="linear"), dict(mlp_act_type="relu")])
def test_config_invariants(bad):
    with pytest.raises(ValueError, match="HunyuanVideoConfig"):
        tiny_config(**bad)


def test_publisher_config_fields(tmp_path):
    """The publisher's HYVideo-T/2-cfgdistill fields; unknown keys (the model name) are ignored."""
    data = dict(HunyuanVideoConfig().to_dict(), model="HYVideo-T/2-cfgdistill")
    (tmp_path / "config.json").write_text(json.dumps(data))
    cfg = HunyuanVideoConfig.from_json(tmp_path / "config.json")
    assert (cfg.hidden_size, cfg.heads_num, cfg.head_dim, cfg.mm_double_blocks_depth, cfg.mm_single_blocks_depth,
            cfg.rope_dim_list, cfg.patch_size, cfg.guidance_embed) == (3072, 24, 128, 20, 40, (16, 56, 56), (1, 2, 2),
                                                                       True)


@torch.no_grad()
def test_bad_inputs_are_clear_errors(models):
    cfg, ours, _ = models
    x = inputs(cfg)
    with pytest.raises(ValueError, match="multiples of patch_size"):
        ours(**dict(x, hidden_states=x["hidden_states"][..., :5]))
    with pytest.raises(ValueError, match="guidance"):
        ours(**dict(x, guidance=None))
    with pytest.raises(ValueError, match="at least one real text token"):
        ours(**dict(x, encoder_attention_mask=torch.zeros_like(x["encoder_attention_mask"])))
    with pytest.raises(ValueError, match="sp_mode"):
        ours(**x, sp_mode="tree")
