"""Checkpoint names, shapes and dtypes == section 5 of the spec (the publisher's module tree), for the real
15B config (built on the meta device) and for the tiny checkpoint on disk; loading errors."""
import pytest
import torch
from safetensors.torch import load_file, save_file

from common.loader import Checkpoint, CheckpointError
from config_magihuman import MagiHumanConfig, tiny_config
from modeling_magihuman import MagiHumanDiT
from weights_magihuman import load_dit


def section5(hidden, head_dim, qkv, text_in, mm, gelu, i_gelu, i_swiglu, layers):
    """The spec's table, written out: name -> shape."""
    names = {
        "adapter.video_embedder.weight": [hidden, 192], "adapter.video_embedder.bias": [hidden],
        "adapter.text_embedder.weight": [hidden, text_in], "adapter.text_embedder.bias": [hidden],
        "adapter.audio_embedder.weight": [hidden, 64], "adapter.audio_embedder.bias": [hidden],
        "adapter.rope.bands": [head_dim // 8],
        "final_norm_video.weight": [hidden], "final_norm_audio.weight": [hidden],
        "final_linear_video.weight": [192, hidden], "final_linear_audio.weight": [64, hidden],
    }
    for i in range(layers):
        n, p = (3 if i in mm else 1), f"block.layers.{i}."
        names |= {p + "attention.pre_norm.weight": [hidden * n], p + "attention.linear_qkv.weight": [qkv * n, hidden],
                  p + "attention.linear_proj.weight": [hidden * n, hidden],
                  p + "attention.q_norm.weight": [head_dim * n], p + "attention.k_norm.weight": [head_dim * n],
                  p + "mlp.pre_norm.weight": [hidden * n]}
        if i in gelu:
            names |= {p + "mlp.up_gate_proj.weight": [i_gelu * n, hidden], p + "mlp.down_proj.weight": [hidden * n, i_gelu]}
        else:
            names |= {p + "mlp.up_gate_proj.weight": [2 * i_swiglu * n, hidden],
                      p + "mlp.down_proj.weight": [hidden * n, i_swiglu]}
    return names


def test_real_config_module_tree_is_section_5():
    with torch.device("meta"):
        model = MagiHumanDiT(MagiHumanConfig())
    shapes = {k: list(v.shape) for k, v in model.state_dict().items()}
    expected = section5(5120, 128, 7208, 3584, [0, 1, 2, 3, 36, 37, 38, 39], [0, 1, 2, 3], 20480, 13652, 40)
    assert shapes == expected
    assert shapes["block.layers.0.mlp.up_gate_proj.weight"] == [61440, 5120]
    assert shapes["block.layers.0.mlp.down_proj.weight"] == [15360, 20480]
    assert shapes["block.layers.10.mlp.up_gate_proj.weight"] == [27304, 5120]
    params = sum(v.numel() for v in model.state_dict().values())
    assert 15.0e9 < params < 15.6e9  # "about 15.3B"


def test_tiny_checkpoint_names_shapes_and_dtypes(tiny_weights):
    cfg = tiny_config()
    expected = section5(64, 16, (4 + 2 + 2) * 16 + 4, 32, [0, 3], [0], 256, 168, 4)
    for variant in ("base", "distill", "540p_sr", "1080p_sr"):
        ckpt = Checkpoint(tiny_weights / variant)
        assert {n: list(ckpt.shape(n)) for n in ckpt.names()} == expected
        for name in ckpt.names():
            block_linear = name.startswith("block.") and len(ckpt.shape(name)) == 2  # embedders, heads, norms: fp32
            assert ckpt.dtype(name) == (torch.bfloat16 if block_linear else torch.float32), name
    assert cfg.swiglu_intermediate == 168 and cfg.qkv_size == 132
    assert MagiHumanConfig.from_folder(tiny_weights / "1080p_sr").local_attn_layers == [1, 2]
    assert MagiHumanConfig.from_folder(tiny_weights / "540p_sr").text_rope == "v1"


def test_loading_without_rope_bands_and_with_a_missing_tensor(tiny_weights, tmp_path):
    ref = load_dit(tiny_weights / "base", dtype=torch.float32)
    tensors = load_file(tiny_weights / "base" / "model.safetensors")
    (tmp_path / "base").mkdir()
    (tmp_path / "base" / "config.json").write_text((tiny_weights / "base" / "config.json").read_text())
    save_file({k: v for k, v in tensors.items() if k != "adapter.rope.bands"}, tmp_path / "base" / "model.safetensors")
    model = load_dit(tmp_path / "base", dtype=torch.float32)  # bands recomputed
    for (name, a), (_, b) in zip(ref.state_dict().items(), model.state_dict().items()):
        torch.testing.assert_close(a, b, msg=name)
    save_file({k: v for k, v in tensors.items() if "layers.2.mlp.down_proj" not in k},
              tmp_path / "base" / "model.safetensors")
    with pytest.raises(CheckpointError, match="layers.2.mlp.down_proj"):
        load_dit(tmp_path / "base")
