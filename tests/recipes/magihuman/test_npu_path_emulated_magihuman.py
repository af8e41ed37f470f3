"""The MagiHuman DiT forward through the NPU implementations of common.ops, on CPU via the torch_npu emulator
(each call bound to the op's real schema). Emulation, not hardware."""
import torch

from common import ops
from common.ops.emulator import TorchNpuEmulator
from modeling_magihuman import build_inputs
from weights_magihuman import load_dit


def test_npu_path_matches_reference_path(tiny_weights):
    model = load_dit(tiny_weights / "1080p_sr", dtype=torch.float32)  # experts, both activations, local windows
    inp = build_inputs(model.config, (4, 2, 2), 9, 5)
    g = torch.Generator().manual_seed(0)
    video, audio, text = torch.randn(48, 4, 4, 4, generator=g), torch.randn(9, 64, generator=g), \
        torch.randn(5, 32, generator=g)
    with torch.no_grad():
        expected = model.velocity(video, audio, text, inp)
        emulator = TorchNpuEmulator()
        previous = ops.use_backend("npu", emulator)
        try:
            got = model.velocity(video, audio, text, inp)
        finally:
            ops.use_backend(previous)
    assert {"npu_rms_norm", "npu_rotary_mul", "npu_fused_infer_attention_score", "npu_grouped_matmul"} \
        <= set(emulator.calls), sorted(emulator.calls)
    for a, b in zip(got, expected):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
