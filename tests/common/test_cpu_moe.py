"""common.cpu_moe.fused_experts on oneDNN-packed experts against the MoE's math written out in fp32 and against the
reference ops' composition, eager and compiled (a shape-generic graph serves every batch size);
DeepSeek-V3's and V4's MoE layers through it against their fp32 reference path."""
import pytest
import torch
import torch.nn.functional as F

from common import cpu_gemm, cpu_moe
from common import parallel as par
from common.ops.reference import moe

pytestmark = pytest.mark.skipif(not cpu_gemm.supported(), reason="oneDNN has no bf16 GEMMs on this CPU")

E, K, D, I = 16, 2, 64, 32  # experts, experts a token, hidden, expert intermediate


def experts(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    w13 = (torch.randn(E, 2 * I, D, generator=g) / D**0.5).bfloat16()  # [E, gate | up, D]
    w2 = (torch.randn(E, D, I, generator=g) / I**0.5).bfloat16()  # [E, D, I]
    return w13, w2


def routing(T: int, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, D, generator=g).bfloat16()
    weights, ids = torch.randn(T, E, generator=g).softmax(-1).topk(K)  # [T, k] fp32, [T, k]
    return x, weights, ids.int()


def math(x, w13, w2, weights, ids, limit=None):
    """The MoE written out, fp32, token by token."""
    out = torch.zeros(x.shape[0], D)
    for t in range(x.shape[0]):
        for j in range(K):
            e = int(ids[t, j])
            gate, up = (w13[e].float() @ x[t].float()).chunk(2)
            if limit is not None:
                gate, up = gate.clamp(max=limit), up.clamp(-limit, limit)
            out[t] += weights[t, j] * (w2[e].float() @ (F.silu(gate) * up))
    return out


def packed(w13, w2):
    return cpu_gemm.PackedExperts(w13), cpu_gemm.PackedExperts(w2)


@pytest.mark.parametrize("T", [1, 3, 16, 40])
@pytest.mark.parametrize("limit", [None, 0.5])
def test_fused_experts_equal_the_math(T, limit):
    w13, w2 = experts()
    x, weights, ids = routing(T)
    p13, p2 = packed(w13, w2)
    assert cpu_moe.takes(p13, p2) and not cpu_moe.takes(w13, w2)
    out = cpu_moe.fused_experts(x, p13, p2, weights, ids, limit)
    want = math(x, w13, w2, weights, ids, limit)
    assert out.dtype == torch.bfloat16 and out.shape == (T, D)
    torch.testing.assert_close(out.float(), want, atol=2e-2 * float(want.abs().max()), rtol=0)


@pytest.mark.parametrize("T", [1, 12])
def test_fused_experts_equal_the_reference_ops(T):
    """The same routing through ops.moe_init_routing / grouped_matmul / moe_finalize_routing."""
    w13, w2 = experts()
    x, weights, ids = routing(T)
    p13, p2 = packed(w13, w2)
    xs, row_idx, counts = moe.moe_init_routing(x, ids, E)
    h = moe.swiglu(moe.grouped_matmul(xs, p13, counts))
    want = moe.moe_finalize_routing(moe.grouped_matmul(h, p2, counts), weights, row_idx)
    torch.testing.assert_close(cpu_moe.fused_experts(x, p13, p2, weights, ids).float(), want.float(),
                               atol=1e-2 * float(want.abs().max()), rtol=0)


def test_compiled_shape_generic_graph_serves_every_batch_size():
    """Compiled (inductor) with the batch dimension dynamic: one graph for 2, 4 and 16 tokens (the reference ops'
    routing traced), each within bf16 rounding of eager's host-routed output."""
    from torch._dynamo.testing import CompileCounterWithBackend
    p13, p2 = packed(*experts())
    torch._dynamo.reset()
    counter = CompileCounterWithBackend("inductor")
    fn = torch.compile(lambda x, w, i: cpu_moe.fused_experts(x, p13, p2, w, i), backend=counter, fullgraph=True)
    for T in (2, 4, 16):
        x, weights, ids = routing(T)
        for t in (x, weights, ids):
            torch._dynamo.mark_dynamic(t, 0)
        want = cpu_moe.fused_experts(x, p13, p2, weights, ids)
        torch.testing.assert_close(fn(x, weights, ids).float(), want.float(), atol=1e-2 * float(want.abs().max()),
                                   rtol=0)
    assert counter.frame_count == 1
    torch._dynamo.reset()


def test_a_replaced_expert_is_used():
    w13, w2 = experts()
    other13, other2 = experts(seed=5)
    p13, p2 = packed(w13, w2)
    p13.set_expert(3, other13[3].float())
    p2.set_expert(3, other2[3])
    w13[3], w2[3] = other13[3], other2[3]
    assert torch.equal(p13.to_dense(), w13) and torch.equal(p2.to_dense(), w2)
    x, weights, ids = routing(6)
    ids[:, 0] = 3  # every token routes to the replaced expert
    assert torch.equal(cpu_moe.fused_experts(x, p13, p2, weights, ids),
                       cpu_moe.fused_experts(x, *packed(w13, w2), weights, ids))


def test_no_tokens_give_no_rows():
    x, weights, ids = routing(3)
    out = cpu_moe.fused_experts(x[:0], *packed(*experts()), weights[:0], ids[:0])
    assert out.shape == (0, D) and out.dtype == torch.bfloat16


def random_init(module):
    torch.manual_seed(0)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape) / p.shape[-1] ** 0.5)
    return module


def test_deepseek_v3_moe_layer_packed_equals_its_fp32_reference():
    """The recipe's MoE (16 experts, top-2 of group-limited routing, one shared expert), packed, against the same
    layer unpacked in fp32 (the reference ops path)."""
    from config_deepseek_v3 import ModelArgs
    from modeling_deepseek_v3 import MoE
    from tiny_deepseek_v3 import tiny_config
    args = ModelArgs.from_config(tiny_config("v3"))
    reference = random_init(MoE(args, par.Parallel(par.LLMParallelLayout())))
    layer = MoE(args, par.Parallel(par.LLMParallelLayout())).bfloat16()
    layer.load_state_dict(reference.state_dict())
    cpu_gemm.pack_model(layer)
    assert cpu_moe.takes(layer.experts.gate_up_proj, layer.experts.down_proj)
    for T in (1, 16):
        x = torch.randn(T, args.hidden_size)
        with torch.no_grad():
            want, out = reference(x), layer(x.bfloat16())
        torch.testing.assert_close(out.float(), want, atol=3e-2 * float(want.abs().max()), rtol=0)


def test_deepseek_v4_moe_layer_packed_equals_its_fp32_reference():
    """DeepSeek-V4's MoE (hash routing on its first layer, score routing after, the SwiGLU clamp), packed, against
    the same layer unpacked in fp32."""
    from config_deepseek_v4 import ModelArgs
    from modeling_deepseek_v4 import MoE
    from tiny_deepseek_v4 import TINY_CONFIG
    args = ModelArgs.from_config(TINY_CONFIG)
    for layer_index in (0, len(args.mlp_layer_types) - 1):
        reference = random_init(MoE(args, layer_index, par.Parallel(par.LLMParallelLayout())))
        layer = MoE(args, layer_index, par.Parallel(par.LLMParallelLayout())).bfloat16()
        layer.load_state_dict(reference.state_dict())
        cpu_gemm.pack_model(layer)
        assert cpu_moe.takes(layer.experts.w13, layer.experts.w2)
        for T in (1, 9):
            x = torch.randn(T, args.hidden_size)
            ids = torch.randint(0, args.vocab_size, (T,))
            with torch.no_grad():
                want, out = reference(x, ids), layer(x.bfloat16(), ids)
            torch.testing.assert_close(out.float(), want, atol=3e-2 * float(want.abs().max()), rtol=0)
