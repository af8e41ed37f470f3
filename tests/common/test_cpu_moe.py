"""common.cpu_moe.fused_experts on oneDNN-packed experts: both of its paths (per expert, dense over every expert)
against the MoE's math written out in fp32, against each other, compiled, and after an expert is replaced;
DeepSeek-V3's MoE layer through it against its fp32 reference path.

The dense pass runs only where oneDNN has AMX (common.cpu_gemm.amx()), but its math runs wherever bf16 weights
pack: these tests pack the stacks whole themselves, so they hold on any CPU with oneDNN bf16 GEMMs."""
import pytest
import torch
import torch.nn.functional as F

from common import cpu_gemm, cpu_moe
from common import parallel as par

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
    return cpu_gemm.PackedExperts(w13, "n"), cpu_gemm.PackedExperts(w2, "k")


@pytest.mark.parametrize("T, dense", [(1, False), (3, False), (8, True), (16, True), (40, False)])
@pytest.mark.parametrize("limit", [None, 0.5])
def test_fused_experts_equal_the_math(T, dense, limit):
    """T < E / k or past DENSE_MAX_ROWS: per expert; else the dense pass; either within bf16 rounding of the fp32
    math."""
    w13, w2 = experts()
    x, weights, ids = routing(T)
    p13, p2 = packed(w13, w2)
    assert cpu_moe.takes(p13, p2) and cpu_moe.dense_pass(T, K, E) == dense
    out = cpu_moe.fused_experts(x, p13, p2, weights, ids, limit)
    want = math(x, w13, w2, weights, ids, limit)
    assert out.dtype == torch.bfloat16 and out.shape == (T, D)
    torch.testing.assert_close(out.float(), want, atol=2e-2 * float(want.abs().max()), rtol=0)


def test_dense_pass_equals_the_per_expert_path():
    w13, w2 = experts()
    x, weights, ids = routing(12)
    assert cpu_moe.dense_pass(12, K, E)
    dense = cpu_moe.fused_experts(x, *packed(w13, w2), weights, ids)
    loop = cpu_moe.per_expert(x, cpu_gemm.PackedExperts(w13).experts, cpu_gemm.PackedExperts(w2).experts, weights, ids)
    torch.testing.assert_close(dense.float(), loop.float(), atol=1e-2 * float(loop.abs().max()), rtol=0)


def test_unstacked_experts_go_per_expert_at_every_batch():
    w13, w2 = experts()
    p13, p2 = cpu_gemm.PackedExperts(w13), cpu_gemm.PackedExperts(w2)
    assert cpu_moe.takes(p13, p2) and p13.stacked is None
    x, weights, ids = routing(12)  # a dense-pass batch
    out = cpu_moe.fused_experts(x, p13, p2, weights, ids)
    assert torch.equal(out, cpu_moe.per_expert(x, p13.experts, p2.experts, weights, ids))
    assert not cpu_moe.takes(cpu_gemm.PackedExperts(w13, "k"), cpu_gemm.PackedExperts(w2, "n"))  # axes swapped
    assert not cpu_moe.takes(cpu_gemm.PackedExperts(w13, "n"), p2)  # one stacked, one not
    assert not cpu_moe.takes(w13, w2)  # not packed
    with pytest.raises(ValueError, match="stacked must be"):
        cpu_gemm.PackedExperts(w13, "rows")


@pytest.mark.parametrize("T", [2, 16])
def test_compiled_equals_eager(T):
    """Compiled (inductor), a per-expert batch (2) and a dense one (16) give eager's output."""
    w13, w2 = experts()
    p13, p2 = packed(w13, w2)
    torch._dynamo.reset()
    fn = torch.compile(lambda x, w, i: cpu_moe.fused_experts(x, p13, p2, w, i), fullgraph=True, dynamic=False)
    x, weights, ids = routing(T)
    want = cpu_moe.fused_experts(x, p13, p2, weights, ids)
    torch.testing.assert_close(fn(x, weights, ids).float(), want.float(), atol=1e-2 * float(want.abs().max()),
                               rtol=0)
    torch._dynamo.reset()


def test_a_replaced_expert_repacks_the_stacked_copy():
    w13, w2 = experts()
    other13, other2 = experts(seed=5)
    p13, p2 = packed(w13, w2)
    p13.set_expert(3, other13[3].float())
    p2.set_expert(3, other2[3])
    w13[3], w2[3] = other13[3], other2[3]
    x, weights, ids = routing(16)
    ids[:, 0] = 3  # every token routes to the replaced expert
    fresh13, fresh2 = packed(w13, w2)
    assert torch.equal(cpu_moe.fused_experts(x, p13, p2, weights, ids),
                       cpu_moe.fused_experts(x, fresh13, fresh2, weights, ids))
    assert torch.equal(p13.to_dense(), w13) and torch.equal(p2.to_dense(), w2)


def test_pack_model_stacks_only_what_a_module_names_and_only_when_asked():
    class Experts(torch.nn.Module):
        dense_pass_axes = {"w13": "n", "w2": "k"}

        def __init__(self):
            super().__init__()
            w13, w2 = experts()
            self.w13, self.w2, self.other = (torch.nn.Parameter(w) for w in (w13, w2, w13.clone()))

    for ask in (False, True):
        module = Experts()
        state = {k: v.clone() for k, v in module.state_dict().items()}
        assert cpu_gemm.pack_model(module, stack_experts=ask) == 3
        assert [w.stacked_axis for w in (module.w13, module.w2, module.other)] == (["n", "k", None] if ask
                                                                                   else [None, None, None])
        assert all(torch.equal(v, state[k]) for k, v in module.state_dict().items())


def test_deepseek_v3_moe_layer_through_the_dense_pass_equals_its_fp32_reference():
    """The recipe's MoE (16 experts, top-2, one shared expert) packed with its stacks whole, at a batch that takes
    the dense pass and one that does not, against the same layer unpacked in fp32."""
    from config_deepseek_v3 import ModelArgs
    from modeling_deepseek_v3 import MoE
    from tiny_deepseek_v3 import tiny_config
    args = ModelArgs.from_config(tiny_config("v3"))
    torch.manual_seed(0)
    reference = MoE(args, par.Parallel(par.LLMParallelLayout()))
    with torch.no_grad():
        for p in reference.parameters():
            p.copy_(torch.randn(p.shape) / p.shape[-1] ** 0.5)
    layer = MoE(args, par.Parallel(par.LLMParallelLayout())).bfloat16()
    layer.load_state_dict(reference.state_dict())
    cpu_gemm.pack_model(layer, stack_experts=True)
    assert cpu_moe.takes(layer.experts.gate_up_proj, layer.experts.down_proj)
    for T in (2, 16):
        x = torch.randn(T, args.hidden_size)
        with torch.no_grad():
            want, out = reference(x), layer(x.bfloat16())
        torch.testing.assert_close(out.float(), want, atol=3e-2 * float(want.abs().max()), rtol=0)


def test_no_tokens_give_no_rows():
    w13, w2 = experts()
    x, weights, ids = routing(3)
    out = cpu_moe.fused_experts(x[:0], *packed(w13, w2), weights[:0], ids[:0])
    assert out.shape == (0, D) and out.dtype == torch.bfloat16
