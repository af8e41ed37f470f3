"""bench_offload.py's offline hit rates, on a routing trace written by hand (what each placement would have kept on
the device for every request's decode)."""
import pytest
import torch

from bench_offload import file_hit_rates, offline_hit_rates
from common.offload import RoutingCounter


def test_offline_hit_rates_score_each_placement_on_the_decode_pairs():
    # two requests, one layer, 4 experts: {request: {layer: [prefill counts, decode counts]}}
    trace = {"0": {"1": [[0, 0, 5, 1], [1, 1, 6, 2]]},
             "1": {"1": [[4, 0, 0, 0], [3, 1, 0, 0]]}}
    got = offline_hit_rates(trace, 1)
    # prefix keeps expert 0: 1 + 3 of the 10 + 4 decode pairs; frequency keeps the other request's most routed
    # (request 0: expert 0, 7 pairs; request 1: expert 2, 11): 1 + 0; dynamic its own prefill's (2, then 0): 6 + 3
    assert got == pytest.approx({"prefix": 4 / 14, "frequency": 1 / 14, "dynamic": 9 / 14})


def test_file_hit_rates_read_a_routing_count_file(tmp_path):
    counter = RoutingCounter(4)
    counter.add(0, torch.tensor([[3, 2], [3, 1]]))
    counter.add(5, torch.tensor([[0, 3]]))
    counter.save(tmp_path / "counts.json")
    got = file_hit_rates(tmp_path / "counts.json", 1)
    assert got == pytest.approx({"prefix": 1 / 6, "frequency (in-sample)": 3 / 6})  # layer 0: 3 twice; layer 5: 1
