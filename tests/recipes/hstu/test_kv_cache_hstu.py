"""The paged history cache: incremental scores == full recompute, through appends and LRU evictions."""
import pytest
import torch

from data_hstu import read_dataset, write_synthetic
from kv_cache_hstu import HistoryKVCache
from modeling_hstu import HSTUConfig, HSTUModel
from simulate_hstu import make_cache, score_day, simulate


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    users, dates = read_dataset(write_synthetic(tmp_path_factory.mktemp("data"), num_users=10, num_days=5))
    torch.manual_seed(0)
    return HSTUModel(HSTUConfig()).eval(), users, len(dates)


def test_incremental_equals_full_recompute_through_appends_and_evictions(setup):
    m, users, days = setup
    full, labels = simulate(m, users, days, batch_users=3)
    cache = make_cache(m, num_pages=40, page_size=4)  # too small for 10 users: evictions
    inc, labels_inc = simulate(m, users, days, batch_users=3, cache=cache)
    assert torch.equal(labels, labels_inc)
    assert cache.stats.evicted_users > 0 and cache.stats.reused_tokens > 0
    torch.testing.assert_close(inc, full, rtol=1e-5, atol=1e-5)


def test_only_history_is_appended_and_batch_users_are_never_evicted(setup):
    m, users, days = setup
    cache = make_cache(m, num_pages=200, page_size=4)
    group = users[:3]
    score_day(m, group, 1, cache)
    for u in group:  # contextual + 2 tokens per day-0 event; the day-1 candidates are not stored
        assert cache.cached_length(u.user_id) == 5 + 2 * sum(e.day < 1 for e in u.events)
        assert len(cache.pages[u.user_id]) == -(-cache.cached_length(u.user_id) // 4)
    assert 0 not in {p for pages in cache.pages.values() for p in pages}  # the null page is never used

    small = make_cache(m, num_pages=20, page_size=4)
    score_day(m, users[:2], 2, small)
    score_day(m, users[2:4], 2, small)  # evicts users 0 and 1 (least recently used) as needed, never 2 or 3
    assert {users[2].user_id, users[3].user_id} <= set(small.pages)
    with pytest.raises(RuntimeError, match="cannot hold"):
        score_day(m, users[:6], 4, small)


def test_cache_write_and_read_round_trip():
    cache = HistoryKVCache(num_layers=1, num_pages=6, page_size=2, num_heads=1, k_dim=3, v_dim=2)
    k1, v1 = torch.randn(5, 1, 3), torch.randn(5, 1, 2)  # 3 history + 2 candidates
    view = cache.begin([7], [3], [5])
    k, v, cu = view(0, k1, v1)
    assert torch.equal(k, k1) and torch.equal(v, v1) and cu.tolist() == [0, 5]
    k2, v2 = torch.randn(3, 1, 3), torch.randn(3, 1, 2)  # 2 new history + 1 candidate
    k, v, cu = cache.begin([7], [2], [3])(0, k2, v2)
    assert cu.tolist() == [0, 6]
    assert torch.equal(k, torch.cat([k1[:3], k2])) and torch.equal(v, torch.cat([v1[:3], v2]))
    assert cache.cached_length(7) == 5 and len(cache.pages[7]) == 3


def test_host_tier_round_trip_equals_full_recompute(setup):
    m, users, days = setup
    full, _ = simulate(m, users, days, batch_users=3)
    cache = make_cache(m, num_pages=40, page_size=4, host_chunk_size=8)
    inc, _ = simulate(m, users, days, batch_users=3, cache=cache)
    assert cache.stats.onloaded_tokens > 0 and cache.stats.evicted_users > 0
    torch.testing.assert_close(inc, full, rtol=1e-5, atol=1e-5)


def test_offload_keeps_complete_chunks_and_onload_restores_them():
    cache = HistoryKVCache(num_layers=2, num_pages=4, page_size=2, num_heads=1, k_dim=3, v_dim=2, host_chunk_size=4)
    k1, v1 = torch.randn(5, 1, 3), torch.randn(5, 1, 2)
    cache.begin([1], [5], [5])(1, k1, v1)  # layer 1 written (layer 0 stays zeros)
    cache.begin([2], [1], [1])(1, k1[:1], v1[:1])  # needs a page: user 1 (3 pages) is evicted, 4 tokens offloaded
    assert 1 not in cache.pages and cache.cached_length(1) == 4 and cache.host[1][0].shape == (2, 4, 1, 3)
    assert torch.equal(cache.host[1][0][1], k1[:4]) and torch.equal(cache.host[1][1][1], v1[:4])
    k2, v2 = torch.randn(2, 1, 3), torch.randn(2, 1, 2)  # token 4 again (recomputed tail) + 1 candidate
    k, v, cu = cache.begin([1], [1], [2])(1, k2, v2)  # evicts user 2 (1 token: nothing offloaded), onloads user 1
    assert cache.stats.onloaded_tokens == 4 and 2 not in cache.host and cu.tolist() == [0, 6]
    assert torch.equal(k, torch.cat([k1[:4], k2])) and torch.equal(v, torch.cat([v1[:4], v2]))


def test_onload_is_layer_by_layer_just_before_the_layer_runs():
    cache = HistoryKVCache(num_layers=2, num_pages=4, page_size=2, num_heads=1, k_dim=3, v_dim=2, host_chunk_size=4)
    k1, v1 = torch.randn(2, 5, 1, 3), torch.randn(2, 5, 1, 2)  # [layer, 5 history tokens, H, D]
    view = cache.begin([1], [5], [5])
    for layer in range(2):
        view(layer, k1[layer], v1[layer])
    cache.evict(1)  # 4 tokens (one chunk) of both layers to the host
    cache.k.zero_(), cache.v.zero_()
    view = cache.begin([1], [1], [2])  # token 4 recomputed + 1 candidate
    assert not cache.k.any() and not cache.v.any()  # nothing onloaded before the first layer runs
    k2, v2 = torch.randn(2, 2, 1, 3), torch.randn(2, 2, 1, 2)
    k, v, cu = view(0, k2[0], v2[0])
    assert not cache.k[1].any() and not cache.v[1].any()  # layer 1 still on the host only
    assert torch.equal(k, torch.cat([k1[0, :4], k2[0]])) and torch.equal(v, torch.cat([v1[0, :4], v2[0]]))
    k, v, cu = view(1, k2[1], v2[1])
    assert torch.equal(k, torch.cat([k1[1, :4], k2[1]])) and torch.equal(v, torch.cat([v1[1, :4], v2[1]]))
    assert cu.tolist() == [0, 6] and cache.stats.onloaded_tokens == 4
