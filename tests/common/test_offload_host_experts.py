"""Host experts for MoE offload: the pure-PyTorch backend against the written-out V4 expert formula, and
kt-kernel's MXFP4 kernels against it (skipped, with the reason, where kt-kernel cannot run)."""
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from common.loader import Checkpoint, dequant_mxfp4, save_checkpoint
from common.loader.quant import E2M1, MX_SCALE_DTYPE
from common.offload import KTKernelHostExperts, MXFP4Experts, TorchHostExperts, dequant_expert, kt_kernel_unavailable

LIMIT = 10.0  # DeepSeek-V4's swiglu_limit
KT_REASON = kt_kernel_unavailable()
needs_kt = pytest.mark.skipif(KT_REASON is not None, reason=f"kt-kernel: {KT_REASON}")


def pack(codes: torch.Tensor) -> torch.Tensor:
    """e2m1 codes [..., K] -> int8 [..., K/2], input 2i in the low nibble (the published layout)."""
    c = codes.to(torch.uint8)
    return (c[..., 0::2] | c[..., 1::2] << 4).view(torch.int8)


def e8m0(exponents: torch.Tensor) -> torch.Tensor:
    """Powers of two 2^x as e8m0 codes (x + 127)."""
    return (exponents + 127).to(torch.uint8).view(MX_SCALE_DTYPE)


def random_mxfp4(shape, gen, exponents=(-3, 3)) -> tuple[torch.Tensor, torch.Tensor]:
    """Every e2m1 code at random, one random power-of-two scale per 32 inputs."""
    *lead, n, k = shape
    codes = torch.randint(0, 16, shape, generator=gen)
    scale = torch.randint(exponents[0], exponents[1] + 1, (*lead, n, k // 32), generator=gen)
    return pack(codes), e8m0(scale)


def const_mxfp4(values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A matrix of e2m1 values (scale 1) in MXFP4."""
    codes = (E2M1[:8][None, :] == values.abs().unsqueeze(-1)).float().argmax(-1) | (values < 0).long() << 3
    return pack(codes), e8m0(torch.zeros(*values.shape[:-1], values.shape[-1] // 32, dtype=torch.long))


def random_layer(E, D, I, seed) -> MXFP4Experts:
    gen = torch.Generator().manual_seed(seed)
    w13, s13 = random_mxfp4((E, 2 * I, D), gen)
    w2, s2 = random_mxfp4((E, D, I), gen)
    return MXFP4Experts(w13, s13, w2, s2)


def naive_moe(x: MXFP4Experts, hidden, ids, weights, limit):
    """The V4 routed-expert formula, token by token: sum_j w_j * w2 (silu(min(g, L)) * clamp(u, -L, L))."""
    w13, w2 = dequant_mxfp4(x.w13, x.w13_scale), dequant_mxfp4(x.w2, x.w2_scale)  # [E, 2I, D], [E, D, I]
    I = x.intermediate_size
    out = torch.zeros(hidden.shape, dtype=torch.float64)
    for t in range(hidden.shape[0]):
        for e, w in zip(ids[t].tolist(), weights[t].tolist()):
            if e < 0:
                continue
            gu = w13[e].double() @ hidden[t].double()
            g, u = gu[:I], gu[I:]
            if limit is not None:
                g, u = g.clamp(max=limit), u.clamp(-limit, limit)
            out[t] += w * (w2[e].double() @ (F.silu(g) * u))
    return out


def routing(T, k, E, seed, skip=0.3):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(E, generator=gen)[:k] for _ in range(T)])  # [T, k] distinct per token
    ids[torch.rand(T, k, generator=gen) < skip] = -1  # pairs kept on the device
    return ids, torch.rand(T, k, generator=gen)


def test_dequant_worked_example_and_loader_equality():
    # byte 0x2F: low nibble 0xF = -6 (input 0), high nibble 0x2 = 1.0 (input 1); e8m0 code 128 = 2.0
    packed = torch.full((1, 16), 0x2F, dtype=torch.uint8).view(torch.int8)
    scale = torch.full((1, 1), 128, dtype=torch.uint8).view(MX_SCALE_DTYPE)
    assert dequant_expert(packed, scale)[0, :2].tolist() == [-12.0, 2.0]
    x = random_layer(3, 64, 32, seed=0)
    for e in range(3):
        assert torch.equal(dequant_expert(x.w13[e], x.w13_scale[e]), dequant_mxfp4(x.w13[e], x.w13_scale[e]))
        assert torch.equal(dequant_expert(x.w2[e], x.w2_scale[e]), dequant_mxfp4(x.w2[e], x.w2_scale[e]))


@pytest.mark.parametrize("limit", [LIMIT, None])
def test_torch_backend_is_the_v4_expert_formula(limit):
    x = random_layer(6, 64, 32, seed=1)
    hidden = torch.randn(7, 64, generator=torch.Generator().manual_seed(2)) * 0.2
    ids, w = routing(7, 3, 6, seed=3)
    host = TorchHostExperts({5: x}, swiglu_limit=limit)
    out = host.forward(5, hidden, ids, w)
    ref = naive_moe(x, hidden, ids, w, limit)
    assert (out.double() - ref).abs().max() <= 1e-5 * ref.abs().max()  # fp32 vs fp64 sums
    clamped, free = naive_moe(x, hidden, ids, w, LIMIT), naive_moe(x, hidden, ids, w, None)
    assert (clamped - free).abs().max() > 1.0  # these weights do reach the clamp
    assert out.dtype == hidden.dtype
    assert torch.equal(host.forward(5, hidden, torch.full_like(ids, -1), w), torch.zeros_like(hidden))


def test_bad_input_is_a_value_error():
    host = TorchHostExperts({0: random_layer(4, 32, 32, seed=4)}, swiglu_limit=LIMIT)
    h, ids, w = torch.zeros(2, 32), torch.zeros(2, 2, dtype=torch.long), torch.ones(2, 2)
    with pytest.raises(ValueError, match="layer 1 has no host experts"):
        host.submit(1, h, ids, w)
    with pytest.raises(ValueError, match="out of range"):
        host.submit(0, h, ids + 4, w)
    with pytest.raises(ValueError, match=r"hidden must be \[T, 32\]"):
        host.submit(0, torch.zeros(2, 16), ids, w)
    with pytest.raises(ValueError, match="topk_ids and topk_weights"):
        host.submit(0, h, ids, w[:, :1])
    with pytest.raises(ValueError, match="w2 .* does not fit"):
        x, y = random_layer(4, 32, 32, seed=4), random_layer(4, 32, 64, seed=4)
        MXFP4Experts(x.w13, x.w13_scale, y.w2, y.w2_scale)


@pytest.fixture(scope="module")
def published(tmp_path_factory):
    """A layer's routed experts written under the publisher's names (`layers.3.ffn.experts.{e}.w1|w3|w2.weight` and
    `.scale`), read back as stored; the V4 model's `Experts` filled through the loader's dequantization of the same
    tensors; and a routed batch through the model's own expert path (common.ops, as MoE.forward runs it)."""
    from common import ops
    from config_deepseek_v4 import ModelArgs
    from modeling_deepseek_v4 import Experts
    E, D, I, k = 8, 64, 32, 2
    x, tensors = random_layer(E, D, I, seed=5), {}
    for e in range(E):
        for name, w, s in (("w1", x.w13[e, :I], x.w13_scale[e, :I]), ("w3", x.w13[e, I:], x.w13_scale[e, I:]),
                           ("w2", x.w2[e], x.w2_scale[e])):
            tensors[f"layers.3.ffn.experts.{e}.{name}.weight"], tensors[f"layers.3.ffn.experts.{e}.{name}.scale"] = w, s
    ckpt = Checkpoint(save_checkpoint(tmp_path_factory.mktemp("published"), tensors, {}))
    stored = MXFP4Experts.from_checkpoint(ckpt, "layers.3.ffn.experts", E)
    args = ModelArgs(hidden_size=D, moe_intermediate_size=I, num_hidden_layers=1, num_experts_per_tok=k,
                     n_routed_experts=E)
    model_experts = Experts(args, E).requires_grad_(False)
    for e in range(E):
        get = lambda w: ckpt.get(f"layers.3.ffn.experts.{e}.{w}.weight", torch.float32)  # noqa: E731
        model_experts.w13[e].copy_(torch.cat([get("w1"), get("w3")]))
        model_experts.w2[e].copy_(get("w2"))
    hidden = torch.randn(5, D, generator=torch.Generator().manual_seed(18)) * 0.5
    ids, w = routing(5, k, E, seed=19, skip=0)
    xs, row_idx, counts = ops.moe_init_routing(hidden, ids, E)
    h = ops.swiglu(model_experts.matmul(xs, "w13", counts), args.swiglu_limit)
    device = ops.moe_finalize_routing(model_experts.matmul(h, "w2", counts), w, row_idx)  # [T, D]
    return x, stored, args, (hidden, ids, w), device


def test_from_checkpoint_reads_the_published_names(published):
    x, stored, *_ = published
    for name in ("w13", "w13_scale", "w2", "w2_scale"):
        assert torch.equal(getattr(stored, name).view(torch.uint8), getattr(x, name).view(torch.uint8))


def test_torch_backend_equals_the_v4_models_experts(published):
    _, stored, args, batch, device = published
    assert args.swiglu_limit == LIMIT  # V4's default
    out = TorchHostExperts({3: stored}, args.swiglu_limit).forward(3, *batch)
    assert (out - device).abs().max() <= 1e-5 * device.abs().max()


# kt-kernel

def test_e8m0_scales_become_the_same_bf16_powers_of_two():
    from common.offload.kt_backend import e8m0_to_bf16
    codes = torch.arange(255, dtype=torch.uint8)  # 255 is e8m0's NaN, which no checkpoint stores
    bf16 = e8m0_to_bf16(codes.view(MX_SCALE_DTYPE))
    assert torch.equal(bf16.float(), torch.exp2(codes.double() - 127).float())  # 2^-127 (code 0) included


def kt(layers, k, **kw):
    return KTKernelHostExperts(layers.items(), num_experts_per_tok=k, swiglu_limit=LIMIT, threads=2, **kw)


def probe_layer(probed: str, D: int, gen) -> tuple[MXFP4Experts, torch.Tensor]:
    """One expert (I = D) whose output on input e_t is column t of the probed matrix: the other two are all-ones
    (gate or up) and the identity (up or down). Returns the layer and the probed matrix as published."""
    ones, eye = const_mxfp4(torch.ones(D, D)), const_mxfp4(torch.eye(D))
    rand = random_mxfp4((D, D), gen)
    w1, w3, w2 = {"gate": (rand, ones, eye), "up": (ones, rand, eye), "down": (ones, eye, rand)}[probed]
    layer = MXFP4Experts(torch.cat([w1[0], w3[0]])[None], torch.cat([w1[1], w3[1]])[None], w2[0][None], w2[1][None])
    return layer, dequant_mxfp4(*rand)


def expected_probe(probed: str, w: torch.Tensor) -> torch.Tensor:
    """What a probe's [T = D, D] output is, for probed matrix w [D, D] (out[t, d] is w[d, t] through the expert)."""
    silu1 = F.silu(torch.tensor(1.0))
    return {"gate": F.silu(w.clamp(max=LIMIT)), "up": silu1 * w.clamp(-LIMIT, LIMIT), "down": silu1 * w}[probed].T


def reorder_gguf(w: torch.Tensor) -> torch.Tensor:
    """Weights as they would read if byte i of a 32-group held inputs i and i+16 (GGUF block_mxfp4)."""
    g = w.view(w.shape[0], -1, 2, 16)  # [N, K/32, (j, j+16), 16]
    return g.transpose(-1, -2).reshape(w.shape)


@needs_kt
@pytest.mark.parametrize("kernel", ["avx512", "avx2"])
@pytest.mark.parametrize("probed", ["gate", "up", "down"])
def test_kt_reads_every_weight_in_the_published_layout(probed, kernel):
    """One-hot inputs read back every weight of the probed matrix through the kernel: each one must be the value
    common.loader's published-layout decoding gives (up to bf16 rounding of the kernel's activations, far below the
    >= 1/3 gap between distinct e2m1 values), and the other candidate layouts must not fit."""
    from common.offload.kt_backend import KERNELS, load_kt_kernel
    if not hasattr(load_kt_kernel()[0].moe, KERNELS[kernel]):
        pytest.skip(f"kt-kernel's {load_kt_kernel()[1]} build has no {KERNELS[kernel]}")
    D = 256
    layer, w = probe_layer(probed, D, torch.Generator().manual_seed(6))
    host = kt({0: layer}, k=1, kernel=kernel, max_tokens=D)
    out = host.forward(0, torch.eye(D, dtype=torch.bfloat16), torch.zeros(D, 1, dtype=torch.long),
                       torch.ones(D, 1)).float()                                                  # [D, D]

    def fits(candidate):
        exp = expected_probe(probed, candidate)
        return bool(((out - exp).abs() <= exp.abs() * 2**-7 + 1e-6).all())

    swapped = w.view(D, -1, 2).flip(-1).reshape(D, D)  # high nibble first
    assert fits(w)
    assert not fits(swapped) and not fits(reorder_gguf(w)) and not fits(w.T)


@needs_kt
def test_kt_matches_torch_backend_within_bf16_rounding():
    layers = {3: random_layer(8, 256, 128, seed=7), 4: random_layer(8, 256, 128, seed=8)}
    host, ref = kt(layers, k=3, max_tokens=32), TorchHostExperts(layers, swiglu_limit=LIMIT)
    cases = [(layer, T) for layer in (3, 4) for T in (1, 5, 70)]  # T = 70 > max_tokens: three kernel calls
    inputs = {(layer, T): (torch.randn(T, 256, generator=torch.Generator().manual_seed(T)).bfloat16() * 0.1,
                           *routing(T, 3, 8, seed=T + layer)) for layer, T in cases}
    got = {c: host.forward(c[0], *inputs[c]).float() for c in cases}  # the kernels' calls first, then torch's
    for layer, T in cases:
        hidden, ids, w = inputs[layer, T]
        want = ref.forward(layer, hidden.float(), ids, w)
        rel = (got[layer, T] - want).norm() / want.norm()
        assert rel < 2**-7, f"layer {layer} T={T}: rel-L2 {rel:.2e}"  # measured about 2e-3: bf16 rounding
        assert F.cosine_similarity(got[layer, T].flatten(), want.flatten(), 0) > 0.9999
        skipped = (ids < 0).all(1)
        assert torch.equal(got[layer, T][skipped], torch.zeros_like(want[skipped]))


@needs_kt
def test_kt_backend_on_the_v4_models_experts(published):
    _, stored, args, (hidden, ids, w), device = published
    out = KTKernelHostExperts([(3, stored)], args.num_experts_per_tok, args.swiglu_limit, threads=2).forward(
        3, hidden.bfloat16(), ids, w)
    assert (out.float() - device).norm() / device.norm() < 2**-6  # bf16 input here too: about 5e-3 measured


@needs_kt
def test_kt_holds_its_own_copy():
    x = random_layer(4, 256, 128, seed=9)
    hidden, (ids, w) = torch.randn(4, 256).bfloat16(), routing(4, 2, 4, seed=9, skip=0)
    host = kt({0: x}, k=2)
    before = host.forward(0, hidden, ids, w)
    for t in (x.w13, x.w13_scale, x.w2, x.w2_scale):
        t.view(torch.uint8).zero_()
    assert torch.equal(host.forward(0, hidden, ids, w), before)
    with pytest.raises(ValueError, match="built for 2"):
        host.submit(0, hidden, ids[:, :1], w[:, :1])


@needs_kt
def test_kt_on_an_avx2_only_cpu(monkeypatch):
    """What kt-kernel picks where only AVX2 is there: oneDNN's and ATen's ISA caps leave its /proc/cpuinfo choice;
    its own override loads the avx2 build, whose MXFP4 kernel (run in a process of its own) matches the reference."""
    from common.offload.kt_backend import kt_cpu_detect, load_kt_kernel
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")
    monkeypatch.setenv("ATEN_CPU_CAPABILITY", "avx2")
    assert kt_cpu_detect().detect_cpu_features() == load_kt_kernel()[1]
    code = ("import torch; from common.offload import kt_backend as k\n"
            "from tests.common.test_offload_host_experts import random_layer, routing, kt, TorchHostExperts, LIMIT\n"
            "x = {0: random_layer(4, 256, 128, seed=10)}; h = torch.randn(3, 256).bfloat16()\n"
            "ids, w = routing(3, 2, 4, 10)\n"
            "host = kt(x, k=2)\n"
            "got, want = host.forward(0, h, ids, w).float(), TorchHostExperts(x, LIMIT).forward(0, h.float(), ids, w)\n"
            "print('RESULT', host.variant, host.kernel, float((got - want).norm() / want.norm()))")
    run = subprocess.run([sys.executable, "-c", code], env=dict(os.environ, KT_KERNEL_CPU_VARIANT="avx2"),
                         capture_output=True, text=True, timeout=120,
                         cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    variant, kernel, rel = run.stdout.split("RESULT")[-1].split()[:3]
    assert (variant, kernel) == ("avx2", "avx2") and float(rel) < 2**-7, run.stdout[-500:] + run.stderr[-500:]
