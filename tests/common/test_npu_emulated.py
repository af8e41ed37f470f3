"""The NPU implementations (common/ops/npu.py) run against the torch_npu emulator and match the references.

Emulation against the real schemas on CPU, not a run on hardware: it checks argument conventions, layouts and
shapes of the NPU path, not the kernels.
"""
import inspect

import pytest
import torch

from common import backend, ops
from common.ops import reference as ref

torch.manual_seed(0)


def close(a, b, tol=1e-5):
    torch.testing.assert_close(a.double(), b.double(), rtol=tol, atol=tol)


def cu(lengths):
    return torch.tensor([0] + list(torch.tensor(lengths).cumsum(0)), dtype=torch.int32)


def test_use_backend_switches_every_op_and_back(emu):
    assert ops.backend_name() == "npu" and ops.rms_norm is not ref.rms_norm
    ops.use_backend("reference")
    assert all(getattr(ops, name) is getattr(ref, name) for name in ops.OPS)
    ops.use_backend("npu", emu)
    with pytest.raises(ValueError):
        ops.use_backend("cuda")


@pytest.mark.parametrize("name", ops.OPS)
def test_npu_and_reference_share_signatures(name):
    params = [(p.name, p.default) for p in inspect.signature(getattr(ref, name)).parameters.values()]
    assert params == [(p.name, p.default) for p in inspect.signature(getattr(ops.npu, name)).parameters.values()]


@pytest.mark.parametrize("weighted", [True, False])
def test_norms(emu, weighted):
    x, r, w = torch.randn(4, 3, 16), torch.randn(4, 3, 16), torch.randn(16) if weighted else None
    close(ops.rms_norm(x, w, 1e-6), ref.rms_norm(x, w, 1e-6))
    for got, want in zip(ops.add_rms_norm(x, r, w, 1e-6), ref.add_rms_norm(x, r, w, 1e-6)):
        close(got, want)
    assert emu.calls == ["npu_rms_norm", "npu_add_rms_norm"]


def test_rms_norm_bf16_rounds_an_fp32_weight(emu):
    x, w = torch.randn(8, 32).bfloat16(), torch.randn(32)
    close(ops.rms_norm(x, w, 1e-6), ref.rms_norm(x, w, 1e-6), tol=3e-2)


@pytest.mark.parametrize("interleaved", [False, True])
def test_rotary_emb(emu, interleaved):
    x, theta = torch.randn(6, 4, 8), torch.rand(6, 4)
    expand = (lambda t: t.repeat_interleave(2, -1)) if interleaved else (lambda t: t.repeat(1, 2))
    cos, sin = expand(theta.cos()), expand(theta.sin())
    close(ops.rotary_emb(x, cos, sin, interleaved), ref.rotary_emb(x, cos, sin, interleaved))
    assert emu.calls == ["npu_rotary_mul"]


ATTENTION = [
    dict(),
    dict(causal=False),
    dict(sliding_window=3),
    dict(sliding_window=2, causal=False),
    dict(sinks=True),
    dict(sliding_window=4, sinks=True),
]


@pytest.mark.parametrize("kw", ATTENTION)
def test_attention(emu, kw):
    q_lens, kv_lens = [3, 1, 4], [5, 6, 4]
    q, k, v = torch.randn(8, 4, 8), torch.randn(15, 2, 8), torch.randn(15, 2, 6)
    kw = dict(kw, sinks=torch.randn(4) if kw.get("sinks") else None)
    got = ops.attention(q, k, v, cu(q_lens), cu(kv_lens), 0.3, return_lse=True, **kw)
    want = ref.attention(q, k, v, cu(q_lens), cu(kv_lens), 0.3, return_lse=True, **kw)
    close(got[0], want[0])
    close(got[1], want[1])
    assert emu.calls == ["npu_fused_infer_attention_score"]


@pytest.mark.parametrize("kw", ATTENTION)
def test_paged_attention_and_cache_write(emu, kw):
    q_lens, kv_lens, block_size = [2, 1, 5], [7, 3, 5], 4
    k, v = torch.randn(15, 2, 8), torch.randn(15, 2, 6)
    table = torch.tensor([[5, 1], [7, 0], [2, 4]], dtype=torch.int32)  # shuffled blocks
    slots = torch.tensor([int(table[b, p // block_size]) * block_size + p % block_size
                          for b, n in enumerate(kv_lens) for p in range(n)])
    k_cache, v_cache = torch.zeros(8, block_size, 2, 8), torch.zeros(8, block_size, 2, 6)
    ops.reshape_and_cache(k, v, k_cache, v_cache, slots)
    q, seq_lens = torch.randn(8, 4, 8), torch.tensor(kv_lens, dtype=torch.int32)
    kw = dict(kw, sinks=torch.randn(4) if kw.get("sinks") else None)
    got = ops.paged_attention(q, k_cache, v_cache, table, seq_lens, cu(q_lens), 0.3, return_lse=True, **kw)
    want = ref.attention(q, k, v, cu(q_lens), cu(kv_lens), 0.3, return_lse=True, **kw)
    close(got[0], want[0])
    close(got[1], want[1])
    assert emu.calls == ["npu_scatter_nd_update_"] * 2 + ["npu_fused_infer_attention_score"]


@pytest.mark.parametrize("with_v", [True, False])
def test_reshape_and_cache_writes_every_slot(emu, with_v):
    k, v = torch.randn(5, 2, 4), torch.randn(5, 2, 3) if with_v else None
    slots = torch.tensor([9, 1, 0, 5, 11])
    caches = [torch.randn(3, 4, 2, 4), torch.randn(3, 4, 2, 3) if with_v else None]
    want = [c.clone() if c is not None else None for c in caches]
    ops.reshape_and_cache(k, v, *caches, slots)
    ref.reshape_and_cache(k, v, *want, slots)
    assert torch.equal(caches[0], want[0]) and (not with_v or torch.equal(caches[1], want[1]))


def test_ops_without_a_fitting_npu_op_run_the_reference(emu):
    for name in ("sparse_attention", "lightning_indexer", "merge_attention_states", "apply_attention_sinks"):
        assert getattr(ops, name) is getattr(ref, name)


GATING = [
    dict(score_func="softmax"),
    dict(score_func="sigmoid", bias=True, routed_scaling_factor=2.5),
    dict(score_func="sigmoid", bias=True, group_count=4, k_group=2),
    dict(score_func="softmax", hash=True),
]


@pytest.mark.parametrize("kw", GATING)
def test_moe_gating_topk(emu, kw):
    logits = torch.randn(6, 16)
    kw = dict(kw, bias=torch.randn(16) if kw.get("bias") else None)
    if kw.pop("hash", False):
        kw.update(tid2eid=torch.randint(0, 16, (30, 4)), input_ids=torch.randint(0, 30, (6,)))
    weights, indices = ops.moe_gating_topk(logits, 4, **kw)
    want_weights, want_indices = ref.moe_gating_topk(logits, 4, **kw)
    assert weights.dtype == torch.float32 and torch.equal(indices, want_indices)
    close(weights, want_weights)
    assert emu.calls == ["npu_moe_gating_top_k"]


@pytest.mark.parametrize("kw", [dict(score_func="sqrtsoftplus"), dict(renorm=False)])
def test_moe_gating_topk_falls_back_where_the_op_cannot(emu, kw):
    logits = torch.randn(6, 16)
    for got, want in zip(ops.moe_gating_topk(logits, 4, **kw), ref.moe_gating_topk(logits, 4, **kw)):
        close(got, want)
    assert emu.calls == []


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_moe_pipeline(emu, dtype):
    T, H, inter, E, k = 9, 8, 6, 5, 2
    x, shared = torch.randn(T, H).to(dtype), torch.randn(T, H).to(dtype)
    w1, w2 = (torch.randn(E, 2 * inter, H) / 3).to(dtype), (torch.randn(E, H, inter) / 3).to(dtype)
    weights, indices = ref.moe_gating_topk(torch.randn(T, E), k, score_func="sigmoid")

    def pipeline():
        expanded_x, row_idx, counts = ops.moe_init_routing(x, indices, E)
        hidden = ops.swiglu(ops.grouped_matmul(expanded_x, w1, counts), limit=2.0)
        return ops.moe_finalize_routing(ops.grouped_matmul(hidden, w2, counts), weights, row_idx, shared), counts

    got, counts = pipeline()
    ops.use_backend("reference")
    want, want_counts = pipeline()
    assert got.dtype == dtype and counts.dtype == torch.int64 and torch.equal(counts, want_counts)
    close(got, want, tol=1e-5 if dtype == torch.float32 else 2e-2)
    assert emu.calls == ["npu_moe_init_routing_v2", "npu_grouped_matmul", "npu_swiglu", "npu_grouped_matmul",
                         "npu_moe_finalize_routing"]


def test_emulator_rejects_what_torch_npu_would(emu):
    x, w = torch.randn(2, 4), torch.randn(4)
    with pytest.raises(TypeError, match="positional"):
        emu.npu_rms_norm(x, w, 1e-6, 1)
    with pytest.raises(TypeError, match="positional"):
        emu.npu_fused_infer_attention_score(x, x, x, 4)  # num_heads is keyword-only
    with pytest.raises(TypeError, match="dims"):
        emu.npu_swiglu(x, dims=-1)
    with pytest.raises(ValueError, match="dtype"):
        emu.npu_rms_norm(x.bfloat16(), w, 1e-6)  # gamma must have x's dtype
    with pytest.raises(AttributeError, match="npu_schemas"):
        emu.npu_fast_gelu(x)
    with pytest.raises(ValueError, match="actual_seq_lengths"):
        emu.npu_fused_infer_attention_score(x[:, None], x[:, None], x[:, None], input_layout="TND")
    with pytest.raises(ValueError, match="range"):
        emu.npu_scatter_nd_update_(torch.zeros(3, 2), torch.tensor([[3]]), torch.ones(1, 2))


@pytest.mark.skipif(backend.torch_npu() is not None, reason="torch_npu imports here")
def test_npu_backend_needs_torch_npu():
    previous = ops.backend_name()
    with pytest.raises(RuntimeError):
        ops.use_backend("npu")
    assert ops.backend_name() == previous
