"""The KV transfer's pieces: merged block runs, the writes a layout makes, and the Mooncake transport moving real
cache blocks between two transfer engines (TCP on 127.0.0.1)."""
import pytest
import torch

from common.kv_transfer import CacheLayout, MooncakeTransport, TransferError, block_runs


def test_block_runs_merge_what_is_consecutive_on_both_sides():
    assert block_runs([4, 5, 6, 9], [1, 2, 3, 4]) == [(4, 1, 3), (9, 4, 1)]
    assert block_runs([4, 5, 6], [1, 3, 4]) == [(4, 1, 1), (5, 3, 2)]  # dst breaks the run
    assert block_runs([0, 0, 7, 8], [0, 2, 3, 4]) == [(7, 3, 2)]  # null blocks are skipped (window freed them)
    assert block_runs([3, 4, 5], [6, 7]) == [(3, 6, 2)]  # past the shorter table: nothing
    assert block_runs([], []) == []


def caches(num_blocks: int, seed: int) -> dict[str, list[torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return {"window": [torch.randn(num_blocks, 4, 1, 8, generator=g), torch.randn(num_blocks, 4, 1, 16, generator=g)],
            "compressed4": [torch.randn(num_blocks, 1, 1, 8, generator=g).to(torch.bfloat16)]}


def test_layout_writes_and_mismatch():
    src, dst = CacheLayout.from_tensors(caches(6, 0)), CacheLayout.from_tensors(caches(9, 1))
    assert src.mismatch(dst) is None
    srcs, dsts, lengths = src.writes(dst, {"window": [1, 2, 3], "compressed4": [5]},
                                     {"window": [0, 7, 8], "compressed4": [2]})
    w0, w1, c = src.groups["window"][0], src.groups["window"][1], src.groups["compressed4"][0]
    assert lengths == [2 * w0.block_bytes, 2 * w1.block_bytes, c.block_bytes]  # one run, one write per tensor
    assert srcs[0] == w0.address + 2 * w0.block_bytes and dsts[0] == dst.groups["window"][0].address + 7 * w0.block_bytes
    other = caches(6, 0)
    other["window"][1] = torch.zeros(6, 4, 1, 32)
    assert "cache group window" in src.mismatch(CacheLayout.from_tensors(other))
    assert "groups differ" in src.mismatch(CacheLayout.from_tensors({"window": other["window"]}))
    assert CacheLayout.from_description(dst.describe()).signature() == dst.signature()


def test_mooncake_moves_blocks_between_two_engines():
    p_caches, d_caches = caches(6, 0), caches(9, 1)
    p, d = MooncakeTransport(), MooncakeTransport()
    p_layout, d_layout = CacheLayout.from_tensors(p_caches), CacheLayout.from_tensors(d_caches)
    p.register(p_layout.regions())
    d.register(d_layout.regions())
    before = {g: [t.clone() for t in ts] for g, ts in d_caches.items()}
    src_tables, dst_tables = {"window": [0, 2, 3, 4], "compressed4": [1, 5]}, {"window": [0, 6, 7, 1],
                                                                               "compressed4": [8, 3]}
    p.write(d.address, *p_layout.writes(d_layout, src_tables, dst_tables))
    for g, ts in d_caches.items():
        moved = {dd: s for s, dd in zip(src_tables[g], dst_tables[g]) if s}
        for t, pt, old in zip(ts, p_caches[g], before[g]):
            for b in range(t.shape[0]):
                assert torch.equal(t[b], pt[moved[b]] if b in moved else old[b]), (g, b)
    with pytest.raises(TransferError):  # the peer's memory must be registered there
        p.write(d.address, [p_layout.regions()[0][0]], [torch.zeros(64).data_ptr()], [64])
    with pytest.raises(TransferError):  # nobody listens there
        p.write("127.0.0.1:1", [p_layout.regions()[0][0]], [d_layout.regions()[0][0]], [64])
