"""The backbone against transformers HunYuanMoEV1, 2D RoPE, ln_f in image mode, the checkpoint's names and shapes."""
import json

import pytest
import torch
from transformers import HunYuanMoEV1Config
from transformers.models.hunyuan_v1_moe.modeling_hunyuan_v1_moe import (
    HunYuanMoEV1DecoderLayer,
    HunYuanMoEV1RotaryEmbedding,
)

from common.loader import Checkpoint, CheckpointError, save_checkpoint
from pipeline_hunyuan_image import ImageDenoiser, PagedKVCache
from sequence_hunyuan_image import (
    ImageSequence,
    attention_mask,
    full_metadata,
    rope_cos_sin,
    rope_positions,
)
from weights_hunyuan_image import load_model


def _hf_layer(ckpt: Checkpoint, cfg: dict, layer: int) -> HunYuanMoEV1DecoderLayer:
    """transformers' layer filled from the publisher's tensors with the spec's remap."""
    H, Hq, Hkv, D, E = (cfg[k] for k in ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim",
                                         "num_experts"))
    I, G = cfg["intermediate_size"], Hq // Hkv
    hf_cfg = HunYuanMoEV1Config(hidden_size=H, intermediate_size=I, num_experts=E, moe_topk=cfg["moe_topk"][0],
                                num_attention_heads=Hq, num_key_value_heads=Hkv, head_dim=D, num_hidden_layers=1,
                                rms_norm_eps=cfg["rms_norm_eps"], vocab_size=cfg["vocab_size"])
    hf_cfg._attn_implementation = "eager"
    hf = HunYuanMoEV1DecoderLayer(hf_cfg, 0).eval()
    p = f"model.layers.{layer}."
    get = lambda n: ckpt.get(p + n, torch.float32)  # noqa: E731
    qkv = get("self_attn.qkv_proj.weight").view(Hkv, G + 2, D, H)
    sd = {
        "self_attn.q_proj.weight": qkv[:, :G].reshape(Hq * D, H),
        "self_attn.k_proj.weight": qkv[:, G].reshape(Hkv * D, H),
        "self_attn.v_proj.weight": qkv[:, G + 1].reshape(Hkv * D, H),
        "self_attn.o_proj.weight": get("self_attn.o_proj.weight"),
        "self_attn.query_layernorm.weight": get("self_attn.query_layernorm.weight"),
        "self_attn.key_layernorm.weight": get("self_attn.key_layernorm.weight"),
        "input_layernorm.weight": get("input_layernorm.weight"),
        "post_attention_layernorm.weight": get("post_attention_layernorm.weight"),
        "mlp.gate.wg.weight": get("mlp.gate.wg.weight"),
        "mlp.shared_mlp.gate_proj.weight": get("mlp.shared_mlp.gate_and_up_proj.weight")[I:],
        "mlp.shared_mlp.up_proj.weight": get("mlp.shared_mlp.gate_and_up_proj.weight")[:I],
        "mlp.shared_mlp.down_proj.weight": get("mlp.shared_mlp.down_proj.weight"),
        "mlp.experts.gate_up_proj": torch.stack([torch.cat([w[I:], w[:I]]) for w in
                                                 (get(f"mlp.experts.{e}.gate_and_up_proj.weight") for e in range(E))]),
        "mlp.experts.down_proj": torch.stack([get(f"mlp.experts.{e}.down_proj.weight") for e in range(E)]),
    }
    hf.load_state_dict(sd)
    return hf


def test_decoder_layer_matches_transformers(tiny_path, model):
    ckpt = Checkpoint(tiny_path)
    seq = ImageSequence(torch.zeros(1, 13, dtype=torch.long), image_start=5, h=2, w=3)  # text 5, image 6, text 2
    L, D = seq.length, ckpt.config["head_dim"]
    cos, sin = rope_cos_sin(rope_positions(L, seq.image_start, seq.h, seq.w), D)
    x = torch.randn(L, ckpt.config["hidden_size"], generator=torch.Generator().manual_seed(0))
    mask = torch.zeros(L, L).masked_fill(~attention_mask(L, seq.image_start, seq.image_end), float("-inf"))
    for i, layer in enumerate(model.model.layers):
        cache = PagedKVCache(model, 1, L, block_size=4)  # several pages per sequence
        meta = full_metadata(seq, cache.block_tables, 4, cos, sin)
        ours = layer(x, meta, *cache.layers[i])
        want = _hf_layer(ckpt, ckpt.config, i)(x[None], attention_mask=mask[None, None],
                                               position_embeddings=(cos[None], sin[None]))
        torch.testing.assert_close(ours, want[0], rtol=1e-5, atol=1e-5)


def test_text_only_2d_rope_is_1d_rope():
    cfg = HunYuanMoEV1Config(hidden_size=64, num_attention_heads=4, head_dim=16, rope_theta=10000.0)
    pos = torch.arange(40)
    want_cos, want_sin = HunYuanMoEV1RotaryEmbedding(cfg)(torch.zeros(1, 40, 16), pos[None])
    cos, sin = rope_cos_sin(rope_positions(40), 16)
    torch.testing.assert_close(cos, want_cos[0], rtol=0, atol=1e-6)
    torch.testing.assert_close(sin, want_sin[0], rtol=0, atol=1e-6)


@pytest.mark.parametrize("L0, h, w", [(7, 2, 3), (5, 4, 4), (9, 3, 2), (4, 1, 5)])
def test_image_positions_follow_the_formula(L0, h, w):
    L = L0 + h * w + 3
    pos = rope_positions(L, L0, h, w)
    for p in range(L):
        if L0 <= p < L0 + h * w:
            i, j = divmod(p - L0, w)
            want = (int(L0 + (h * w - h) / 2 + i), int(L0 + (h * w - w) / 2 + j))  # float, then int64
        else:
            want = (p, p)  # text before and after (resuming at L0 + hw) is 1D
        assert tuple(pos[p].tolist()) == want, p
    cos, sin = rope_cos_sin(pos, 16)
    i = torch.arange(8)
    coord = torch.where(i % 2 == 0, pos[:, :1], pos[:, 1:]).float()  # even frequencies by y, odd by x
    angle = coord * 10000.0 ** (-2 * i / 16)
    torch.testing.assert_close(cos, torch.cat([angle.cos()] * 2, 1))
    torch.testing.assert_close(sin, torch.cat([angle.sin()] * 2, 1))


def test_ln_f_does_not_affect_the_image_prediction(model):
    seq = ImageSequence(torch.randint(50, 500, (2, 14)), image_start=6, h=2, w=3)
    latents = torch.randn(2, 16, 2, 3, generator=torch.Generator().manual_seed(1))
    t = torch.tensor([700.0, 700.0])
    before = ImageDenoiser(model, seq).velocity(latents, t)
    hidden = torch.randn(3, 64)
    logits_before = model.text_logits(hidden)
    with torch.no_grad():
        model.model.ln_f.weight.mul_(3.0).add_(0.5)
    torch.testing.assert_close(ImageDenoiser(model, seq).velocity(latents, t), before, rtol=0, atol=0)
    assert not torch.allclose(model.text_logits(hidden), logits_before)  # ln_f is live in text mode


def _spec_names_and_shapes(cfg: dict) -> dict[str, tuple]:
    """Section 4 of the spec, at the tiny config's sizes (backbone, embedders, patch_embed, final_layer)."""
    H, V, Hq, Hkv, D, E = (cfg[k] for k in ("hidden_size", "vocab_size", "num_attention_heads", "num_key_value_heads",
                                            "head_dim", "num_experts"))
    I, P, C = cfg["intermediate_size"], cfg["patch_embed_hidden_dim"], cfg["vae"]["latent_channels"]
    out = {"model.wte.weight": (V, H), "model.ln_f.weight": (H,), "lm_head.weight": (V, H)}
    for emb in ("timestep_emb", "time_embed", "time_embed_2"):
        out |= {f"{emb}.mlp.0.weight": (H, 256), f"{emb}.mlp.0.bias": (H,), f"{emb}.mlp.2.weight": (H, H),
                f"{emb}.mlp.2.bias": (H,)}
    def resblock(p, cin, cout):
        return {f"{p}.in_layers.0.weight": (cin,), f"{p}.in_layers.0.bias": (cin,),
                f"{p}.in_layers.2.weight": (cout, cin, 3, 3), f"{p}.in_layers.2.bias": (cout,),
                f"{p}.emb_layers.1.weight": (2 * cout, H), f"{p}.emb_layers.1.bias": (2 * cout,),
                f"{p}.out_layers.0.weight": (cout,), f"{p}.out_layers.0.bias": (cout,),
                f"{p}.out_layers.3.weight": (cout, cout, 3, 3), f"{p}.out_layers.3.bias": (cout,),
                f"{p}.skip_connection.weight": (cout, cin, 1, 1), f"{p}.skip_connection.bias": (cout,)}
    out |= {"patch_embed.model.0.weight": (P, C, 3, 3), "patch_embed.model.0.bias": (P,)}
    out |= resblock("patch_embed.model.1", P, H) | resblock("final_layer.model.0", H, P)
    out |= {"final_layer.model.1.0.weight": (P,), "final_layer.model.1.0.bias": (P,),
            "final_layer.model.1.2.weight": (C, P, 3, 3), "final_layer.model.1.2.bias": (C,)}
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        out |= {p + "self_attn.qkv_proj.weight": ((Hq + 2 * Hkv) * D, H), p + "self_attn.o_proj.weight": (H, Hq * D),
                p + "self_attn.query_layernorm.weight": (D,), p + "self_attn.key_layernorm.weight": (D,),
                p + "mlp.gate.wg.weight": (E, H), p + "mlp.shared_mlp.gate_and_up_proj.weight": (2 * I, H),
                p + "mlp.shared_mlp.down_proj.weight": (H, I), p + "input_layernorm.weight": (H,),
                p + "post_attention_layernorm.weight": (H,)}
        for e in range(E):
            out |= {p + f"mlp.experts.{e}.gate_and_up_proj.weight": (2 * I, H),
                    p + f"mlp.experts.{e}.down_proj.weight": (H, I)}
    return out


def test_tiny_checkpoint_keys_follow_section_4(tiny_path):
    ckpt = Checkpoint(tiny_path)
    names = set(ckpt.names())
    assert (tiny_path / "model.safetensors.index.json").is_file()  # sharded, like the real one
    assert ckpt.dtype("model.layers.0.mlp.gate.wg.weight") == torch.float32
    want = _spec_names_and_shapes(ckpt.config)
    non_vae = {n for n in names if not n.startswith(("vae.", "vision_model.", "vision_aligner."))}
    assert non_vae == set(want)
    assert {n: tuple(ckpt.shape(n)) for n in want} == want
    assert {n.split(".")[0] for n in names} == {"vae", "vision_model", "vision_aligner", "timestep_emb", "patch_embed",
                                                 "time_embed", "final_layer", "time_embed_2", "model", "lm_head"}
    vae = {n for n in names if n.startswith("vae.")}
    for prefix in ("vae.encoder.conv_in.", "vae.encoder.down.0.block.0.norm1.", "vae.encoder.down.0.downsample.conv.",
                   "vae.encoder.mid.attn_1.q.", "vae.encoder.mid.attn_1.proj_out.", "vae.encoder.norm_out.",
                   "vae.decoder.up.0.block.1.conv2.", "vae.decoder.up.3.upsample.conv.", "vae.decoder.conv_out."):
        assert prefix + "weight" in vae and prefix + "bias" in vae, prefix
    assert not any(".down.4.downsample" in n or ".up.4.upsample" in n for n in vae)  # 4 levels = 16x
    assert tuple(ckpt.shape("vae.encoder.conv_out.weight"))[:2] == (2 * 16, 32)  # mean + logvar
    assert tuple(ckpt.shape("vae.encoder.down.2.downsample.conv.weight"))[0] == 32 // 8  # spatial + temporal


def test_loader_names_what_is_missing(tiny_path, tmp_path):
    ckpt = Checkpoint(tiny_path)
    state = {n: ckpt.get(n) for n in ckpt.names() if n != "model.layers.1.mlp.experts.3.down_proj.weight"}
    save_checkpoint(tmp_path, state, json.loads((tiny_path / "config.json").read_text()))
    with pytest.raises(CheckpointError, match="w2_weight"):
        load_model(tmp_path)


def test_full_size_config_builds_the_80b_model():
    """The publisher's config fields (per-layer lists, attention_head_dim, nested vae) at full size, built on the
    meta device: the parameter counts the README's memory table uses."""
    from config_hunyuan_image import HunyuanImageConfig
    from modeling_hunyuan_image import HunyuanImage3

    cfg = HunyuanImageConfig.from_config(dict(
        vocab_size=133120, hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
        attention_head_dim=128, intermediate_size=3072, moe_intermediate_size=[3072] * 32, num_experts=64,
        moe_topk=[8] * 32, num_shared_expert=[1] * 32, rms_norm_eps=1e-5, rope_theta=10000.0, patch_size=1,
        patch_embed_hidden_dim=1024, vae_downsample_factor=[16, 16], image_base_size=1024,
        vae={"_class_name": "AutoencoderKLConv3D", "latent_channels": 32,
             "block_out_channels": [128, 256, 512, 1024, 1024],
             "layers_per_block": 2, "ffactor_spatial": 16, "ffactor_temporal": 4, "scaling_factor": 0.562679178327931}))
    assert (cfg.head_dim, cfg.moe_topk, cfg.num_experts, cfg.num_groups) == (128, 8, 64, 4)
    with torch.device("meta"):
        model = HunyuanImage3(cfg)
    count = lambda m: sum(p.numel() for p in m.parameters())  # noqa: E731
    layers = count(model.model.layers)
    assert model.model.layers[0].self_attn.qkv_proj.weight.shape == (6144, 4096)
    assert abs(layers / 1e9 - 79.9) < 0.1  # 32 x (64 experts + shared MLP + attention + router)
    assert abs(count(model.vae) / 1e9 - 1.26) < 0.02  # the spec's "about 1.26B"
    image_parts = sum(count(getattr(model, n)) for n in ("timestep_emb", "time_embed", "time_embed_2", "patch_embed",
                                                           "final_layer"))
    assert abs(image_parts / 1e9 - 0.34) < 0.01
