"""oneDNN-packed bf16 weights on the CPU path: the same outputs as the plain weights, the same parameters."""
import pytest
import torch
from torch import nn

from common import cpu_gemm
from common.ops import reference as ref

pytestmark = pytest.mark.skipif(not cpu_gemm.available(torch.zeros(1, dtype=torch.bfloat16)),
                                reason="torch built without oneDNN")


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


@pytest.mark.parametrize("shape", [(1, 64), (16, 64), (2, 5, 64), (0, 64)])
def test_packed_linears_equal_plain_ones(shape):
    model, x = bf16_model(), torch.randn(*shape, dtype=torch.bfloat16)
    want = model(x)
    names = sorted(model.state_dict())
    assert cpu_gemm.pack_linears(model) == 3  # two linears, one expert stack; not the conv
    assert isinstance(model.proj, cpu_gemm.PackedLinear) and isinstance(model.out[0], cpu_gemm.PackedLinear)
    assert sorted(model.state_dict()) == names
    assert torch.equal(model(x), want)


def test_in_place_weight_update_repacks():
    model = bf16_model()
    cpu_gemm.pack_linears(model)
    x = torch.randn(4, 64, dtype=torch.bfloat16)
    with torch.no_grad():
        model.proj.weight.mul_(-2)
        model.experts.mul_(3)
    plain = bf16_model()
    with torch.no_grad():
        plain.proj.weight.mul_(-2)
        plain.experts.mul_(3)
    assert torch.equal(model(x), plain(x))
    counts = torch.tensor([1, 0, 3])
    assert torch.equal(ref.grouped_matmul(x, model.experts, counts), ref.grouped_matmul(x, plain.experts, counts))


def test_new_data_and_dtype_changes_are_followed():
    model, plain = bf16_model(), bf16_model()
    cpu_gemm.pack_linears(model)
    x = torch.randn(3, 64, dtype=torch.bfloat16)
    new = torch.randn(96, 64, dtype=torch.bfloat16)
    model.proj.weight.data, plain.proj.weight.data = new, new.clone()  # same version counter, new storage
    assert torch.equal(model(x), plain(x))
    model.float(), plain.float()  # no longer bf16: the plain GEMM
    assert torch.equal(model(x.float()), plain(x.float()))
    assert cpu_gemm.packed_experts(model.experts) is None


def test_grouped_matmul_with_packed_experts_equals_plain():
    model, plain = bf16_model(), bf16_model()
    cpu_gemm.pack_linears(model)
    assert cpu_gemm.packed_experts(model.experts) is not None and cpu_gemm.packed_experts(plain.experts) is None
    x, counts = torch.randn(7, 64, dtype=torch.bfloat16), torch.tensor([3, 0, 4])
    got = ref.grouped_matmul(x, model.experts, counts)
    assert torch.equal(got, ref.grouped_matmul(x, plain.experts, counts))
    assert torch.equal(got[:3], x[:3] @ plain.experts[0].T)


def test_fp32_models_are_left_alone():
    model = Tiny()
    assert cpu_gemm.pack_linears(model) == 0
    assert type(model.proj) is nn.Linear and cpu_gemm.packed_experts(model.experts) is None
