"""The whole DeepSeek-V4 forward through the NPU implementations of common.ops, on CPU via the torch_npu
emulator (each call bound to the op's real schema, computed with the references). Emulation, not hardware."""
import torch

from common import ops
from common.engine.model_runner import prefill_logits
from common.ops.emulator import TorchNpuEmulator
from tiny_deepseek_v4 import write_tiny_checkpoint
from weights_deepseek_v4 import load_model


def test_npu_path_matches_reference_path(tmp_path):
    model = load_model(write_tiny_checkpoint(tmp_path / "ckpt", seed=7), torch.float32)
    prompts = [list(range(2, 31)), list(range(40, 51))]
    with torch.no_grad():
        expected = prefill_logits(model, prompts)
        emulator = TorchNpuEmulator()
        previous = ops.use_backend("npu", emulator)
        try:
            got = prefill_logits(model, prompts)
        finally:
            ops.use_backend(previous)
    assert {"npu_rms_norm", "npu_rotary_mul", "npu_fused_infer_attention_score", "npu_scatter_nd_update_", "npu_moe_init_routing_v2",
            "npu_grouped_matmul", "npu_moe_finalize_routing", "npu_swiglu"} <= set(emulator.calls)
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-5)
