"""The whole HunyuanVideo DiT forward through the NPU implementations of common.ops, on CPU via the torch_npu
emulator (each call bound to the op's real schema, computed with the references). Emulation, not hardware."""
import torch
from modeling_hunyuan_video import HunyuanVideoTransformer3D
from weights_hunyuan_video import random_state_dict, tiny_config

from common import ops
from common.ops.emulator import TorchNpuEmulator


def test_npu_path_matches_reference_path():
    cfg = tiny_config()
    model = HunyuanVideoTransformer3D(cfg).eval()
    model.load_state_dict(random_state_dict(cfg, seed=3))
    g = torch.Generator().manual_seed(0)
    x = dict(hidden_states=torch.randn(2, cfg.in_channels, 2, 4, 6, generator=g), timestep=torch.tensor([500.0, 20.0]),
             encoder_hidden_states=torch.randn(2, 6, cfg.text_states_dim, generator=g),
             encoder_attention_mask=torch.tensor([[1, 1, 1, 1, 1, 1], [1, 1, 1, 0, 0, 0]]),
             pooled_projections=torch.randn(2, cfg.text_states_dim_2, generator=g), guidance=torch.tensor([6e3, 6e3]))
    with torch.no_grad():
        expected = model(**x)
        emulator = TorchNpuEmulator()
        previous = ops.use_backend("npu", emulator)
        try:
            got = model(**x)
        finally:
            ops.use_backend(previous)
    assert {"npu_rms_norm", "npu_rotary_mul", "npu_fused_infer_attention_score"} <= set(emulator.calls)
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-5)
