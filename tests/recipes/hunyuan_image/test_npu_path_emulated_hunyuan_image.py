"""A HunyuanImage-3.0 denoising step through the NPU implementations of common.ops, on CPU via the torch_npu
emulator (each call bound to the op's real schema, computed with the references). Emulation, not hardware."""
import torch

from common import ops
from common.ops.emulator import TorchNpuEmulator
from pipeline_hunyuan_image import ImageDenoiser
from sequence_hunyuan_image import build_sequence


def test_npu_path_matches_reference_path(model, tokenizer, special):
    seq = build_sequence(tokenizer, special, "a blue bird on a branch", 16, 2, 3, cfg=True)
    g = torch.Generator().manual_seed(0)
    x0, x1 = torch.randn(2, 16, 2, 3, generator=g), torch.randn(2, 16, 2, 3, generator=g)
    t0, t1 = torch.full((2,), 1000.0), torch.full((2,), 500.0)

    def two_steps():  # the full step (causal text + bidirectional image calls) and a KV-reuse step
        d = ImageDenoiser(model, seq, block_size=8)
        return torch.cat([d.velocity(x0, t0), d.velocity(x1, t1)])

    expected = two_steps()
    emulator = TorchNpuEmulator()
    previous = ops.use_backend("npu", emulator)
    try:
        got = two_steps()
    finally:
        ops.use_backend(previous)
    assert {"npu_rms_norm", "npu_rotary_mul", "npu_fused_infer_attention_score", "npu_scatter_nd_update_",
            "npu_moe_gating_top_k", "npu_moe_init_routing_v2", "npu_grouped_matmul", "npu_moe_finalize_routing",
            "npu_swiglu"} <= set(emulator.calls)
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-5)
