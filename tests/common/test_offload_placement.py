"""Resident-slot bookkeeping for MoE offload: the policies, the device / host split of a router's output, and one
MoE layer split between device slots and host experts against the same layer computed whole."""
import json

import pytest
import torch

from common import ops
from common.loader import dequant_mxfp4
from common.offload import (
    DynamicPlacement,
    FrequencyPlacement,
    PrefixPlacement,
    ResidentExperts,
    RoutingCounter,
    TorchHostExperts,
    load_routing_counts,
)
from test_offload_host_experts import LIMIT, random_layer


def test_split_worked_example():
    # E = 8, slots hold experts 0, 1, 2 (prefix); token 0 routes to (0, .5) and (5, .25), token 1 to (7, 1), (2, .75)
    res = ResidentExperts(PrefixPlacement(3), layers=[4], num_experts=8)
    ids, w = torch.tensor([[0, 5], [7, 2]], dtype=torch.int32), torch.tensor([[0.5, 0.25], [1.0, 0.75]])
    s = res.split(4, ids, w)
    assert s.device_ids.tolist() == [[0, 0], [0, 2]] and s.device_ids.dtype == torch.int32
    assert s.device_weights.tolist() == [[0.5, 0.0], [0.0, 0.75]]
    assert s.host_ids.tolist() == [[-1, 5], [7, -1]] and s.host_weights.tolist() == [[0.0, 0.25], [1.0, 0.0]]
    assert int(s.device_ids.min()) >= 0  # never -1 on the device side


def test_policies_check_their_invariants(tmp_path):
    with pytest.raises(ValueError, match="num_slots"):
        PrefixPlacement(-1)
    with pytest.raises(ValueError, match="4 resident slots for 3 experts"):
        ResidentExperts(PrefixPlacement(4), [0], num_experts=3)
    with pytest.raises(ValueError, match="one \\[E\\] vector per layer"):
        FrequencyPlacement(2, {0: torch.zeros(4), 1: torch.zeros(5)})
    with pytest.raises(ValueError, match=">= 0"):
        FrequencyPlacement(2, {0: torch.tensor([1, -1, 0])})
    with pytest.raises(ValueError, match="start placement has 2 slots"):
        DynamicPlacement(3, start=PrefixPlacement(2))
    with pytest.raises(ValueError, match="no layer 7"):
        ResidentExperts(FrequencyPlacement(1, {0: torch.ones(4, dtype=torch.long)}), [7], num_experts=4)
    res = ResidentExperts(PrefixPlacement(2), [0], num_experts=4)
    with pytest.raises(ValueError, match="distinct"):
        res.set_resident(0, [1, 1])


def test_frequency_placement_from_a_routing_count_file(tmp_path):
    counter = RoutingCounter(num_experts=6)
    counter.add(3, torch.tensor([[4, 1], [4, 5], [1, -1]]))  # layer 3: expert 4 twice, 1 twice, 5 once
    counter.add(3, torch.tensor([[5, 0]]))
    counter.add(9, torch.tensor([[2, 3]]))
    path = tmp_path / "counts.json"
    counter.save(path)
    data = json.loads(path.read_text())
    assert data["counts"]["3"] == [1, 2, 0, 0, 2, 2] and data["tokens"] == {"3": 4, "9": 1}
    counts = load_routing_counts(path)
    assert set(counts) == {3, 9} and counts[9].tolist() == [0, 0, 1, 1, 0, 0]
    res = ResidentExperts(FrequencyPlacement.from_file(2, path), [3, 9], num_experts=6)
    assert res.experts[3].tolist() == [1, 4]  # ties among 1, 4, 5 go to the lower ids
    assert res.experts[9].tolist() == [2, 3]
    head = {"format": "expert-routing-counts", "num_experts": 3}
    for bad, match in (({"format": "x"}, "not a routing-count file"),
                       ({**head, "counts": {"a": [0, 0, 0]}}, "layer key"),
                       ({**head, "counts": {"1": [0, 0]}}, "needs 3 counts"),
                       ({**head, "counts": {"1": [0, -1, 2]}}, "needs 3 counts")):
        path.write_text(json.dumps(bad))
        with pytest.raises(ValueError, match=match):
            load_routing_counts(path)
    path.write_text("{")
    with pytest.raises(ValueError, match="not a readable"):
        load_routing_counts(path)


def test_dynamic_placement_swaps_in_place():
    res = ResidentExperts(DynamicPlacement(3), [0, 1], num_experts=8)
    experts, slot_of = res.experts[0], res.slot_of[0]
    prompt = RoutingCounter(8)
    prompt.add(0, torch.tensor([[6, 2], [6, 7], [2, 6], [7, 0]]))  # top 3: 6 (3), 2 (2), 7 (2)
    moves = res.after_prefill(prompt.counts)
    assert res.experts[0] is experts and res.slot_of[0] is slot_of  # same tensors: a captured graph sees the change
    assert moves == {0: [(0, 6), (1, 7)]}  # expert 2 stays in slot 2; 0 and 1 leave
    assert experts.tolist() == [6, 7, 2]
    assert slot_of.tolist() == [-1, -1, 2, -1, -1, -1, 0, 1]
    assert res.experts[1].tolist() == [0, 1, 2]  # a layer without counts keeps its set
    prefix = ResidentExperts(PrefixPlacement(3), [0], num_experts=8)
    assert prefix.after_prefill(prompt.counts) == {} and prefix.experts[0].tolist() == [0, 1, 2]


def assert_same_sums(got, want):
    """Equal up to fp32 sums taken in another order."""
    assert (got - want).abs().max() <= 1e-5 * want.abs().max()


def dense(x, slots=None):
    """Float weights of a layer's experts (all, or those of `slots` in slot order): w13 [S, 2I, D], w2 [S, D, I]."""
    w13, w2 = dequant_mxfp4(x.w13, x.w13_scale), dequant_mxfp4(x.w2, x.w2_scale)
    return (w13, w2) if slots is None else (w13[slots], w2[slots])


def device_moe(hidden, ids, weights, w13, w2, shared=None):
    """The device's routed experts as the V4 model runs them (common.ops): dispatch, grouped SwiGLU, combine."""
    xs, row_idx, counts = ops.moe_init_routing(hidden, ids, w13.shape[0])
    h = ops.swiglu(ops.grouped_matmul(xs, w13, counts), LIMIT)
    return ops.moe_finalize_routing(ops.grouped_matmul(h, w2, counts), weights, row_idx, shared)


def router(hidden, E, k, seed):
    gen = torch.Generator().manual_seed(seed)
    logits = hidden @ torch.randn(E, hidden.shape[1], generator=gen).T
    return ops.moe_gating_topk(logits, k, bias=torch.randn(E, generator=gen) * 0.1, score_func="sqrtsoftplus",
                               renorm=True, routed_scaling_factor=1.5)  # V4's router


def split_moe(res, layer, x, host, hidden, ids, weights, shared):
    """Resident slots on the "device" + host experts (+ the shared expert's output)."""
    s = res.split(layer, ids, weights)
    if res.num_slots:
        device = device_moe(hidden, s.device_ids, s.device_weights, *dense(x, res.experts[layer]), shared)
    else:
        device = shared
    return device + host.forward(layer, hidden, s.host_ids, s.host_weights)


@pytest.mark.parametrize("placement", [PrefixPlacement(0), PrefixPlacement(3), PrefixPlacement(8),
                                       FrequencyPlacement(3, {2: torch.arange(8).flip(0)}), DynamicPlacement(3)])
def test_resident_plus_host_plus_shared_is_the_whole_layer(placement):
    E, D, I, T, k = 8, 64, 32, 9, 3
    x = random_layer(E, D, I, seed=11)
    hidden = torch.randn(T, D, generator=torch.Generator().manual_seed(12)) * 0.1
    shared = torch.randn(T, D, generator=torch.Generator().manual_seed(13))
    weights, ids = router(hidden, E, k, seed=14)
    full = device_moe(hidden, ids, weights, *dense(x), shared)  # every expert resident, no offload
    res, host = ResidentExperts(placement, [2], E), TorchHostExperts({2: x}, LIMIT)
    assert_same_sums(split_moe(res, 2, x, host, hidden, ids, weights, shared), full)
    if isinstance(placement, DynamicPlacement):  # a residency change never changes the output
        counts = RoutingCounter(E)
        counts.add(2, ids)
        assert res.after_prefill(counts.counts)[2]
        assert_same_sums(split_moe(res, 2, x, host, hidden, ids, weights, shared), full)


def test_a_huge_expert_in_slot_0_never_leaks_into_offloaded_rows():
    E, D, I, T, k = 8, 64, 32, 6, 2
    x = random_layer(E, D, I, seed=15)
    x.w2_scale[0] = torch.full_like(x.w2_scale[0].view(torch.uint8), 127 + 40).view(x.w2_scale.dtype)  # expert 0 x 2^40
    hidden = torch.randn(T, D, generator=torch.Generator().manual_seed(16))
    ids = torch.tensor([[5, 6], [7, 4], [3, 5], [6, 7], [4, 3], [5, 7]])  # all offloaded: slots hold 0, 1, 2
    weights = torch.rand(T, k, generator=torch.Generator().manual_seed(17))
    res, host = ResidentExperts(PrefixPlacement(3), [0], E), TorchHostExperts({0: x}, LIMIT)
    s = res.split(0, ids, weights)
    assert (s.device_ids == 0).all() and (s.device_weights == 0).all()
    w13, w2 = dense(x, res.experts[0])
    slot0 = device_moe(hidden, torch.zeros_like(ids), torch.ones_like(weights), w13, w2)
    assert slot0.abs().min() > 1e6 and slot0.isfinite().all()  # what slot 0 computes on those rows: huge, finite
    device = device_moe(hidden, s.device_ids, s.device_weights, w13, w2)
    assert torch.equal(device, torch.zeros_like(device))
    assert_same_sums(device + host.forward(0, hidden, s.host_ids, s.host_weights),
                     device_moe(hidden, ids, weights, *dense(x)))
