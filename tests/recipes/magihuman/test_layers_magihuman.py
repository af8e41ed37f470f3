"""MagiHuman building blocks against formulas written here: activations, gating, dispatch, expert linears, norms."""
import math

import pytest
import torch

from config_magihuman import AUDIO, TEXT, VIDEO, tiny_config
from layers_magihuman import ExpertLinear, ModalityDispatcher, MultiModalityRMSNorm, gelu7, swiglu7
from modeling_magihuman import Attention, build_inputs


def test_swiglu7_clamps_and_interleaves():
    u = torch.tensor([[10.0, -10.0]])  # gate = u[0::2] = 10, lin = u[1::2] = -10
    expected = 7 * (1 / (1 + math.exp(-1.702 * 7))) * (-7 + 1)  # 7 sigmoid(11.914) (-6)
    assert swiglu7(u).item() == pytest.approx(expected, rel=1e-6)
    g, lin = torch.randn(5, 8) * 3, torch.randn(5, 8) * 3
    u = torch.stack([g, lin], -1).flatten(1)  # interleaved [g0, l0, g1, l1, ...]
    ref = g.clamp(max=7) * torch.sigmoid(1.702 * g.clamp(max=7)) * (lin.clamp(-7, 7) + 1)
    torch.testing.assert_close(swiglu7(u), ref)
    assert not torch.allclose(swiglu7(torch.cat([g, lin], 1)), ref)  # [gate | lin] halves would be wrong


def test_gelu7_limits():
    big = torch.tensor([7.0, 50.0, 1e4])
    torch.testing.assert_close(gelu7(big), torch.full((3,), 7 / (1 + math.exp(-11.914))))  # clamped at 7
    x = torch.tensor([-3.0, -20.0])  # no lower clamp: the plain formula
    torch.testing.assert_close(gelu7(x), x * torch.sigmoid(1.702 * x))
    assert gelu7(torch.tensor(-200.0)).abs() < 1e-30  # tends to 0 from below
    mid = torch.linspace(-4, 4, 81)
    assert (gelu7(mid) - torch.nn.functional.gelu(mid)).abs().max() < 0.03  # the sigmoid approximation of GELU


def test_dispatcher_round_trip_and_groups():
    torch.manual_seed(0)
    modality = torch.randint(0, 3, (37,))
    d = ModalityDispatcher(modality)
    x = torch.randn(37, 5)
    torch.testing.assert_close(d.undispatch(d.dispatch(x)), x)
    assert d.group_sizes.tolist() == [int((modality == m).sum()) for m in range(3)]
    assert d.sorted_modality.tolist() == sorted(modality.tolist()) and not d.identity
    ordered = ModalityDispatcher(torch.tensor([VIDEO] * 4 + [AUDIO] * 2 + [TEXT] * 3))
    assert ordered.identity  # one sample [video | audio | text] is already grouped


def test_expert_linear_is_a_per_token_weight_gather():
    torch.manual_seed(0)
    lin = ExpertLinear(6, 4, 3, dtype=torch.float32)
    lin.weight.normal_()
    modality = torch.randint(0, 3, (20,))
    d = ModalityDispatcher(modality)
    x = torch.randn(20, 6)
    y = d.undispatch(lin(d.dispatch(x), d.group_sizes))  # [20, 4]
    w = lin.weight.view(3, 4, 6)[modality]  # [20, 4, 6]: expert i = rows [4i, 4i + 4)
    torch.testing.assert_close(y, torch.einsum("tij,tj->ti", w, x))


def test_rmsnorm_zero_weight_is_identity_scale_and_groups_scale_separately():
    torch.manual_seed(0)
    norm = MultiModalityRMSNorm(8, 3)
    sizes = torch.tensor([3, 2, 4])
    x = torch.randn(9, 8) * 5
    unit = x / x.pow(2).mean(-1, keepdim=True).add(1e-6).sqrt()
    torch.testing.assert_close(norm(x, sizes), unit)  # w = 0 -> gamma 1
    norm.weight.copy_(torch.randn(24))
    gamma = 1 + norm.weight.view(3, 8)[torch.repeat_interleave(torch.arange(3), sizes)]  # [9, 8]
    torch.testing.assert_close(norm(x, sizes), unit * gamma)


def test_zero_gate_rows_halve_the_attention_output():
    torch.manual_seed(0)
    gated, plain = tiny_config(), tiny_config()
    plain.attention_gating = False
    a_gated, a_plain = Attention(gated, 0, torch.float32), Attention(plain, 0, torch.float32)  # 3-expert layer
    for p in a_gated.parameters():
        p.normal_(0, 0.3)
    q = gated.qkv_size
    w = a_gated.linear_qkv.weight.view(3, q, -1)  # [E, q|k|v|g, hidden]
    w[:, q - gated.num_heads_q:] = 0  # gate rows of every expert
    state = a_gated.state_dict()
    state["linear_qkv.weight"] = w[:, :q - gated.num_heads_q].reshape(-1, gated.hidden_size)
    a_plain.load_state_dict(state)
    inp = build_inputs(gated, (2, 2, 2), 5, 3)
    h = torch.randn(8 + 5 + 3, gated.hidden_size)
    out_gated, out_plain = a_gated(h, inp), a_plain(h, inp)
    torch.testing.assert_close(out_gated, 0.5 * out_plain)
    assert out_plain.abs().mean() > 0.1
