"""oneDNN-packed bf16 and fp32 weights on the CPU path: the same outputs as the plain weights (fp32: within
rounding), held once, inference only.

Tests that need bf16 packing skip where oneDNN has no bf16 GEMMs on this CPU (AVX2-only x86); fp32 packing, where
torch has no oneDNN or the CPU is no x86. The bf16 fallback is tested on every CPU: in a subprocess that caps
oneDNN and ATen at AVX2, which makes torch answer and fail as on such a CPU (and packs fp32 there).
"""
import copy
import gc
import os
import subprocess
import sys
import weakref
from pathlib import Path

import pytest
import torch
from torch import nn

from common import cpu_gemm
from common.ops import reference as ref

HERE = Path(__file__).resolve().parent
AVX2_ONLY = {"ONEDNN_MAX_CPU_ISA": "AVX2", "ATEN_CPU_CAPABILITY": "avx2"}
needs_packing = pytest.mark.skipif(not cpu_gemm.supported(), reason="oneDNN has no bf16 GEMMs on this CPU "
                                   "(torch.ops.mkldnn._is_mkldnn_bf16_supported() is False: no AVX512-BW/VL/DQ "
                                   "nor AVX-NE-CONVERT)")


class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(64, 96, bias=False)
        self.out = nn.Sequential(nn.Linear(96, 32, bias=True))
        self.experts = nn.Parameter(torch.randn(3, 48, 64))  # stacked [E, N, K]
        self.conv = nn.Conv1d(4, 4, 3)  # a 3-D weight that is not a stack of linears

    def forward(self, x):
        return self.out(self.proj(x))


def bf16_model():
    torch.manual_seed(0)
    return Tiny().to(torch.bfloat16)


def load_like_the_recipe(proj: torch.Tensor, experts: torch.Tensor, weight: torch.Tensor, expert: torch.Tensor):
    """The write of weights_deepseek_v4._packed_loader: `param.data[...].copy_(tensor)` (no version bump)."""
    proj.data.copy_(weight)
    experts.data[1].copy_(expert)


def fallback_run():
    """What a CPU without oneDNN bf16 GEMMs gives: torch says so, packing packs nothing, outputs are the plain ones.
    Called in a subprocess by test_fallback_on_a_cpu_without_onednn_bf16 (and directly on such a CPU)."""
    assert not torch.ops.mkldnn._is_mkldnn_bf16_supported() and not cpu_gemm.supported()
    with pytest.raises(RuntimeError, match="bf16 path needs the cpu support"):  # what packing would hit
        cpu_gemm.pack(torch.zeros(8, 8, dtype=torch.bfloat16))
    model, plain = bf16_model(), bf16_model()
    assert cpu_gemm.pack_model(model) == 0
    assert type(model.proj) is nn.Linear and isinstance(model.experts, nn.Parameter)
    assert cpu_gemm.pack_model(Tiny()) == 3 * cpu_gemm.supported(torch.float32)  # AVX2's fp32 GEMMs: packed
    x, counts = torch.randn(5, 64, dtype=torch.bfloat16), torch.tensor([2, 0, 3])
    assert torch.equal(model(x), plain(x))
    assert torch.equal(ref.grouped_matmul(x, model.experts, counts), ref.grouped_matmul(x, plain.experts, counts))


def test_fallback_on_a_cpu_without_onednn_bf16():
    code = f"import sys; sys.path.insert(0, {str(HERE)!r}); import test_cpu_gemm; test_cpu_gemm.fallback_run()"
    run = subprocess.run([sys.executable, "-c", code], cwd=HERE.parents[1], env={**os.environ, **AVX2_ONLY},
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-4000:]


def test_packing_follows_torchs_answer():
    torch_says = torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()
    assert cpu_gemm.supported() == torch_says
    assert cpu_gemm.available(torch.zeros(1, dtype=torch.bfloat16)) == torch_says
    if not torch_says:
        fallback_run()
    else:
        assert cpu_gemm.pack_model(bf16_model()) == 3


@needs_packing
@pytest.mark.parametrize("shape", [(1, 64), (16, 64), (2, 5, 64), (0, 64)])
def test_packed_linears_equal_plain_ones(shape):
    model, plain, x = bf16_model(), bf16_model(), torch.randn(*shape, dtype=torch.bfloat16)
    assert cpu_gemm.pack_model(model) == 3  # two linears, one expert stack; not the conv
    assert isinstance(model.proj, cpu_gemm.PackedLinear) and isinstance(model.out[0], cpu_gemm.PackedLinear)
    assert isinstance(model.experts, cpu_gemm.PackedExperts) and type(model.conv) is nn.Conv1d
    assert torch.equal(model(x), plain(x))


@needs_packing
def test_dense_weights_are_dropped_and_state_dict_stays_exact():
    model, plain = bf16_model(), bf16_model()
    dense = [weakref.ref(model.proj.weight), weakref.ref(model.out[0].weight), weakref.ref(model.experts)]
    cpu_gemm.pack_model(model)
    gc.collect()
    assert all(w() is None for w in dense)  # nothing holds the dense copies any more
    assert sorted(n for n, _ in model.named_parameters()) == ["conv.bias", "conv.weight", "out.0.bias"]
    state, want = model.state_dict(), plain.state_dict()
    assert sorted(state) == sorted(want) and all(torch.equal(state[k], want[k]) for k in want)
    for strict in (True, False):
        with pytest.raises(RuntimeError, match="load weights before packing"):
            model.load_state_dict(want, strict=strict)
    assert model.experts.shape == (3, 48, 64) and model.experts.dtype == torch.bfloat16
    with pytest.raises((TypeError, AttributeError)):
        model.experts.data.copy_(want["experts"])


@needs_packing
def test_writes_before_packing_are_followed_and_none_can_go_stale_after():
    model, plain, fresh = bf16_model(), bf16_model(), bf16_model()
    weight, expert = torch.randn(96, 64, dtype=torch.bfloat16), torch.randn(48, 64, dtype=torch.bfloat16)
    with torch.no_grad():
        load_like_the_recipe(model.proj.weight, model.experts, weight, expert)
        load_like_the_recipe(plain.proj.weight, plain.experts, weight, expert)
    old = model.proj.weight, model.experts
    cpu_gemm.pack_model(model)
    x, counts = torch.randn(7, 64, dtype=torch.bfloat16), torch.tensor([2, 3, 2])
    assert not torch.equal(plain(x), fresh(x))  # the write changed the outputs ...
    assert torch.equal(model(x), plain(x))  # ... and the packed model follows it
    assert torch.equal(ref.grouped_matmul(x, model.experts, counts), ref.grouped_matmul(x, plain.experts, counts))
    assert not any(p is o for p in model.parameters() for o in old)  # the old Parameters are out of the model
    with torch.no_grad():
        load_like_the_recipe(*old, -weight, -expert)  # the Parameters taken before packing: the model dropped them
    assert torch.equal(model(x), plain(x))
    assert torch.equal(ref.grouped_matmul(x, model.experts, counts), ref.grouped_matmul(x, plain.experts, counts))


@needs_packing
def test_a_packed_linear_has_no_weight_to_read_or_write():
    """The one copy is the packed one: `.weight` of a PackedLinear is an error, not a dense copy made on the side."""
    model = bf16_model()
    cpu_gemm.pack_model(model)
    with pytest.raises(AttributeError, match="load weights before packing"):
        model.proj.weight
    assert not hasattr(model.out[0], "weight") and "proj.weight" not in dict(model.named_parameters())


@needs_packing
def test_conversions_after_packing_fail_loudly():
    model = bf16_model()
    cpu_gemm.pack_model(model)
    model.float()  # the packed weights stay bf16
    x = torch.randn(3, 64)
    with pytest.raises(TypeError, match="bf16 inputs"):
        model(x)
    with pytest.raises(TypeError, match="bf16 inputs"):
        ref.grouped_matmul(x, model.experts, torch.tensor([1, 1, 1]))


@needs_packing
def test_grouped_matmul_with_packed_experts_equals_plain():
    model, plain = bf16_model(), bf16_model()
    cpu_gemm.pack_model(model)
    x, counts = torch.randn(7, 64, dtype=torch.bfloat16), torch.tensor([3, 0, 4])
    got = ref.grouped_matmul(x, model.experts, counts)
    assert torch.equal(got, ref.grouped_matmul(x, plain.experts, counts))
    assert torch.equal(got[:3], x[:3] @ plain.experts[0].T)


@needs_packing
def test_tied_weights_stay_dense():
    embed, head = nn.Embedding(96, 64).to(torch.bfloat16), nn.Linear(64, 96, bias=False).to(torch.bfloat16)
    head.weight = embed.weight  # one weight, read by two modules
    assert cpu_gemm.pack_model(nn.ModuleList([embed, head])) == 0 and type(head) is nn.Linear


needs_fp32_packing = pytest.mark.skipif(not cpu_gemm.supported(torch.float32),
                                        reason="fp32 packing needs torch's oneDNN on an x86 CPU")


@needs_fp32_packing
def test_fp32_models_are_packed_and_give_the_plain_outputs_within_rounding():
    torch.manual_seed(0)
    model, plain = Tiny(), Tiny()
    plain.load_state_dict(model.state_dict())
    assert cpu_gemm.pack_model(model) == 3
    assert isinstance(model.proj, cpu_gemm.PackedLinear) and isinstance(model.experts, cpu_gemm.PackedExperts)
    x, counts = torch.randn(16, 64), torch.tensor([5, 0, 11])
    torch.testing.assert_close(model(x), plain(x), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ref.grouped_matmul(x, model.experts, counts),
                               ref.grouped_matmul(x, plain.experts, counts), rtol=1e-5, atol=1e-5)
    state = model.state_dict()
    assert all(torch.equal(state[k], v) for k, v in plain.state_dict().items())  # packing is exact
    with pytest.raises(TypeError, match="fp32 weights take fp32 inputs, got bf16"):
        model(x.bfloat16())


@needs_fp32_packing
def test_a_packed_model_deep_copies_with_weights_of_its_own():
    torch.manual_seed(0)
    model = Tiny()
    cpu_gemm.pack_model(model)
    twin = copy.deepcopy(model)
    assert twin.proj._packed is not model.proj._packed and twin.experts is not model.experts
    assert twin.out[0].bias is not model.out[0].bias
    x = torch.randn(4, 64)
    assert torch.equal(twin(x), model(x))
    assert all(torch.equal(a, b) for a, b in zip(twin.state_dict().values(), model.state_dict().values()))


@pytest.mark.parametrize("packed", [pytest.param(True, marks=needs_packing), False])
def test_compiled_fullgraph_calls_the_same_gemms(packed):
    """Graph mode's path: under torch.compile(fullgraph) the packed linears and the expert loop are opaque custom
    ops (inductor cannot lower a weight packed before it); the compiled function gives eager's outputs."""
    model = bf16_model()
    if packed:
        assert cpu_gemm.pack_model(model) == 3
    counts = torch.tensor([2, 0, 3])

    def f(x):  # x [5, 64]
        return model(x), ref.grouped_matmul(x, model.experts, counts)

    x = torch.randn(5, 64, dtype=torch.bfloat16)
    with torch.inference_mode():
        want = f(x)
        got = torch.compile(f, fullgraph=True, dynamic=False)(x)
    if packed:  # the same oneDNN kernels on the same inputs
        assert all(torch.equal(g, w) for g, w in zip(got, want))
    else:  # inductor's own GEMMs
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w, atol=2e-2, rtol=2e-2)
