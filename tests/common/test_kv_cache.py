"""Paged KV cache bookkeeping: block pool, chained hashes, and the manager (windows, all-or-nothing, prefix hits)."""
import random
from collections import defaultdict

import pytest

from common.kv_cache import NULL_BLOCK, BlockPool, CacheGroupSpec, KVCacheManager, hash_block, hash_blocks


def evict(pool: BlockPool, block_id: int):
    """Reuse one free block for something else, as a later allocation would."""
    pool.free_queue.move_to_end(block_id, last=False)
    assert pool.allocate(1) == [block_id]
    pool.free([block_id])


def check_consistent(kv: KVCacheManager, tokens: dict[str, list[int]]):
    """Ref counts equal table occurrences; free queue = unreferenced blocks; a block two requests hold is a shared,
    cached prefix block at the same index."""
    for g, pool in kv.pools.items():
        holders = defaultdict(list)
        for rid in tokens:
            for i, b in enumerate(kv.block_table(rid)[g]):
                if b != NULL_BLOCK:
                    holders[b].append((rid, i))
        assert pool.blocks[NULL_BLOCK].ref_cnt == 0 and NULL_BLOCK not in pool.free_queue
        for block in pool.blocks[1:]:
            assert block.ref_cnt == len(holders[block.block_id]) >= 0
            assert (block.block_id in pool.free_queue) == (block.ref_cnt == 0)
        for b, held in holders.items():
            if len(held) > 1:
                (i,) = {i for _, i in held}
                assert pool.blocks[b].block_hash is not None
                assert len({tuple(tokens[rid][: (i + 1) * kv.block_size]) for rid, _ in held}) == 1
        assert all(block.block_hash == h for h, block in pool.cached.items())


# ---- block pool


def test_pool_never_hands_out_the_null_block():
    pool = BlockPool(4)
    assert pool.num_free_blocks == 3
    assert sorted(pool.allocate(3)) == [1, 2, 3]
    with pytest.raises(RuntimeError):
        pool.allocate(1)
    pool.free([NULL_BLOCK, 1])
    assert pool.num_free_blocks == 1 and pool.blocks[NULL_BLOCK].ref_cnt == 0


def test_pool_ref_counts():
    pool = BlockPool(4)
    (b,) = pool.allocate(1)
    pool.touch([b])
    assert pool.blocks[b].ref_cnt == 2
    pool.free([b])
    assert pool.blocks[b].ref_cnt == 1 and pool.num_free_blocks == 2
    pool.free([b])
    assert pool.blocks[b].ref_cnt == 0 and pool.num_free_blocks == 3
    with pytest.raises(AssertionError):
        pool.free([b])


def test_pool_reuses_least_recently_freed_first():
    pool = BlockPool(5)
    assert pool.allocate(4) == [1, 2, 3, 4]
    pool.free([3])
    pool.free([1, 4])
    pool.free([2])
    assert pool.allocate(4) == [3, 1, 4, 2]


def test_pool_cached_free_block_is_findable_until_evicted():
    pool = BlockPool(3)
    (b,) = pool.allocate(1)
    pool.cache(b, 1234)
    pool.free([b])
    assert pool.lookup(1234) == b and pool.num_free_blocks == 2
    assert b in pool.allocate(2)
    assert pool.lookup(1234) is None and pool.blocks[b].block_hash is None


def test_pool_touch_revives_a_cached_free_block():
    pool = BlockPool(3)
    (b,) = pool.allocate(1)
    pool.cache(b, 7)
    pool.free([b])
    pool.touch([pool.lookup(7)])
    assert pool.blocks[b].ref_cnt == 1 and b not in pool.free_queue and pool.lookup(7) == b
    assert pool.allocate(1) != [b]


def test_pool_without_prefix_caching_caches_nothing():
    pool = BlockPool(3, enable_prefix_caching=False)
    (b,) = pool.allocate(1)
    pool.cache(b, 7)
    assert pool.lookup(7) is None


# ---- hashing


def test_block_hashes_are_chained():
    a = hash_blocks([1, 2, 3, 4, 5, 6, 7, 8], 4)
    b = hash_blocks([9, 9, 9, 9, 5, 6, 7, 8], 4)
    assert a[1] != b[1]
    assert a == hash_blocks([1, 2, 3, 4, 5, 6, 7, 8, 9], 4)
    assert a[1] == hash_block(hash_block(0, (1, 2, 3, 4)), [5, 6, 7, 8])


def test_partial_blocks_are_not_hashed():
    assert len(hash_blocks(list(range(7)), 4)) == 1
    assert len(hash_blocks(list(range(8)), 4)) == 2
    assert len(hash_blocks(list(range(8)), 4, num_tokens=7)) == 1
    known = hash_blocks(list(range(8)), 4, num_tokens=4)
    assert hash_blocks(list(range(12)), 4, known) is known and len(known) == 3


# ---- manager


def test_spec_checks_its_invariants():
    with pytest.raises(AssertionError):
        CacheGroupSpec("kv", 0)
    with pytest.raises(AssertionError):
        CacheGroupSpec("kv", 16, sliding_window=0)
    with pytest.raises(AssertionError):
        KVCacheManager([CacheGroupSpec("a", 4), CacheGroupSpec("b", 8)], {"a": 8, "b": 8})


def test_tables_grow_block_by_block():
    kv = KVCacheManager([CacheGroupSpec("kv", 4)], {"kv": 16})
    tokens = list(range(5))
    assert kv.allocate("r", tokens, 0, 5)
    assert len(kv.block_table("r")["kv"]) == 2
    for computed in range(5, 13):
        tokens.append(computed)
        assert kv.allocate("r", tokens, computed, 1)
        assert len(kv.block_table("r")["kv"]) == computed // 4 + 1
    assert kv.num_free_blocks() == 15 - 4 and kv.usage() == pytest.approx(4 / 15) and kv.num_requests == 1
    kv.free("r")
    assert kv.all_blocks_free() and kv.num_requests == 0


@pytest.mark.parametrize("window", [1, 4, 7, 8, 9])
def test_window_group_frees_blocks_behind_the_window(window):
    bs = 4
    kv = KVCacheManager([CacheGroupSpec("full", bs), CacheGroupSpec("win", bs, window)], {"full": 40, "win": 6})
    spec = kv.specs["win"]
    tokens = list(range(6))
    assert kv.allocate("r", tokens, 0, 6)
    for computed in range(6, 120):
        tokens.append(computed)
        assert kv.allocate("r", tokens, computed, 1)
        table = kv.block_table("r")
        first = spec.first_needed_block(computed)
        assert table["win"][:first] == [NULL_BLOCK] * first and NULL_BLOCK not in table["win"][first:]
        assert len(table["win"]) - first <= -(-window // bs) + 1
        assert NULL_BLOCK not in table["full"] and len(table["full"]) == computed // bs + 1
    kv.free("r")
    assert kv.all_blocks_free()


def test_failed_allocation_changes_nothing():
    kv = KVCacheManager([CacheGroupSpec("big", 4), CacheGroupSpec("small", 4)], {"big": 20, "small": 5})
    prompt = list(range(12))
    assert kv.allocate("a", prompt, 0, 12)
    kv.cache_blocks("a", prompt, 12)
    kv.free("a")
    p = kv.get_computed_tokens("b", prompt + [99] * 10)
    assert p == 12
    queries = kv.stats.prefix_cache_queries
    before = {g: ([b.ref_cnt for b in pool.blocks], list(pool.free_queue)) for g, pool in kv.pools.items()}
    assert not kv.allocate("b", prompt + [99] * 10, p, 10, p)  # small: 3 hit blocks + 3 new > 4
    assert {g: ([b.ref_cnt for b in pool.blocks], list(pool.free_queue)) for g, pool in kv.pools.items()} == before
    assert kv.num_requests == 0 and kv.stats.prefix_cache_queries == queries
    assert kv.allocate("b", prompt + [99] * 10, p, 1, p)
    assert kv.block_table("b")["small"][:3] == [kv.pools["small"].lookup(h) for h in hash_blocks(prompt, 4)]


def test_prefix_hit_shares_full_blocks():
    kv = KVCacheManager([CacheGroupSpec("kv", 4)], {"kv": 16})
    prompt = list(range(10))
    assert kv.get_computed_tokens("a", prompt) == 0
    assert kv.allocate("a", prompt, 0, 10)
    kv.cache_blocks("a", prompt, 10)
    kv.cache_blocks("a", prompt, 10)
    assert kv.get_computed_tokens("b", prompt[:8]) == 4  # at least one token left to compute
    other = prompt[:8] + [50, 51, 52]
    p = kv.get_computed_tokens("b", other)
    assert p == 8
    assert kv.allocate("b", other, p, len(other) - p, p)
    a, b = kv.block_table("a")["kv"], kv.block_table("b")["kv"]
    assert b[:2] == a[:2] and b[2] != a[2]
    assert [kv.pools["kv"].blocks[i].ref_cnt for i in a[:2]] == [2, 2]
    assert (kv.stats.prefix_cache_queries, kv.stats.prefix_cache_hits) == (10 + 11, 8)
    check_consistent(kv, {"a": prompt, "b": other})
    kv.free("a")
    kv.free("b")
    assert kv.all_blocks_free()
    assert list(kv.pools["kv"].free_queue)[-2:] == [a[1], a[0]]  # the prefix's first block is evicted last
    assert kv.get_computed_tokens("c", other) == 8


def test_no_hit_without_prefix_caching():
    kv = KVCacheManager([CacheGroupSpec("kv", 4)], {"kv": 16}, enable_prefix_caching=False)
    prompt = list(range(10))
    assert kv.allocate("a", prompt, 0, 10)
    kv.cache_blocks("a", prompt, 10)
    kv.free("a")
    assert kv.get_computed_tokens("b", prompt) == 0 and not kv.pools["kv"].cached


def computed_and_freed(specs, num_blocks, prompt):
    kv = KVCacheManager(specs, num_blocks)
    assert kv.allocate("a", prompt, 0, len(prompt))
    kv.cache_blocks("a", prompt, len(prompt))
    kv.free("a")
    return kv, hash_blocks(prompt, specs[0].block_size)


def test_window_hit_needs_only_the_blocks_in_the_window():
    prompt = list(range(16))  # blocks 0..3; a query at 16 with window 6 reads positions 11..15: blocks 2, 3
    kv, hashes = computed_and_freed([CacheGroupSpec("win", 4, 6)], {"win": 8}, prompt)
    pool = kv.pools["win"]
    evict(pool, pool.lookup(hashes[0]))
    assert kv.get_computed_tokens("b", prompt + [7]) == 16
    assert kv.allocate("b", prompt + [7], 16, 1, 16)
    assert kv.block_table("b")["win"][:4] == [0, 0, pool.lookup(hashes[2]), pool.lookup(hashes[3])]
    kv.free("b")
    evict(pool, pool.lookup(hashes[3]))
    assert kv.get_computed_tokens("b", prompt + [7]) == 12  # a query at 12 reads 7..11: blocks 1, 2
    evict(pool, pool.lookup(hashes[1]))
    assert kv.get_computed_tokens("b", prompt + [7]) == 0
    assert kv.all_blocks_free()


def test_hit_agrees_across_full_and_window_groups():
    prompt = list(range(16))
    specs = [CacheGroupSpec("full", 4), CacheGroupSpec("win", 4, 6)]
    kv, hashes = computed_and_freed(specs, {"full": 8, "win": 8}, prompt)
    full, win = kv.pools["full"], kv.pools["win"]
    evict(win, win.lookup(hashes[0]))
    assert kv.get_computed_tokens("b", prompt + [7]) == 16
    evict(full, full.lookup(hashes[3]))
    assert kv.get_computed_tokens("b", prompt + [7]) == 12
    evict(win, win.lookup(hashes[1]))  # full allows 3 blocks; at 3 and below the window misses
    assert kv.get_computed_tokens("b", prompt + [7]) == 0
    kv, hashes = computed_and_freed(specs, {"full": 8, "win": 8}, prompt)
    evict(kv.pools["full"], kv.pools["full"].lookup(hashes[3]))
    evict(kv.pools["win"], kv.pools["win"].lookup(hashes[1]))  # window alone would hit 16, full alone 12
    assert kv.get_computed_tokens("b", prompt + [7]) == 4
    assert kv.allocate("b", prompt + [7], 4, 13, 4)
    check_consistent(kv, {"b": prompt + [7]})


def test_window_blocks_are_cached_before_they_are_freed():
    kv = KVCacheManager([CacheGroupSpec("win", 4, 4)], {"win": 8})
    tokens = list(range(20))
    assert kv.allocate("a", tokens, 0, 8)
    assert kv.allocate("a", tokens, 8, 8)  # cache_blocks not called: allocate registers blocks 0, 1 itself
    assert kv.block_table("a")["win"][:2] == [0, kv.pools["win"].lookup(hash_blocks(tokens, 4)[1])]
    assert all(kv.pools["win"].lookup(h) is not None for h in hash_blocks(tokens[:8], 4))
    kv.cache_blocks("a", tokens, 16)
    assert kv.get_computed_tokens("b", tokens[:17]) == 16
    kv.free("a")
    assert kv.all_blocks_free()


# ---- randomized: requests arrive, grow by chunks and decodes, get preempted and freed; the simulated cache
# contents (each slot remembers which token prefix wrote it) must be what every query reads.


def simulate(seed: int):
    rng = random.Random(seed)
    bs = rng.choice([1, 2, 4])
    specs = [CacheGroupSpec(f"win{i}", bs, rng.randint(1, 10)) for i in range(rng.randint(0, 2))]
    if not specs or rng.random() < 0.7:
        specs.append(CacheGroupSpec("full", bs))
    kv = KVCacheManager(specs, {s.name: rng.randint(2, 24) for s in specs}, enable_prefix_caching=rng.random() < 0.85)
    prefixes = [[rng.randrange(3) for _ in range(12)] for _ in range(3)]
    tokens, computed, waiting, content = {}, {}, [], {}

    def compute(rid, start, n):
        seq, tables = tokens[rid], kv.block_table(rid)
        for spec in specs:
            table = tables[spec.name]
            for p in range(start, start + n):
                content[spec.name, table[p // bs], p % bs] = tuple(seq[: p + 1])
            for q in range(start, start + n):
                first = 0 if spec.sliding_window is None else max(0, q - spec.sliding_window + 1)
                for p in range(first, q + 1):
                    assert table[p // bs] != NULL_BLOCK
                    assert content[spec.name, table[p // bs], p % bs] == tuple(seq[: p + 1]), (spec, q, p)
        computed[rid] = start + n
        kv.cache_blocks(rid, seq, start + n)

    for step in range(rng.randint(1, 80)):
        op = rng.random()
        if op < 0.3 or not tokens:
            rid = f"r{step}"
            if waiting and rng.random() < 0.5:
                seq = waiting.pop(rng.randrange(len(waiting)))
            else:
                seq = rng.choice(prefixes)[: rng.randint(0, 12)] + [rng.randrange(3) for _ in range(rng.randint(1, 8))]
            hit = kv.get_computed_tokens(rid, seq)
            assert hit % bs == 0 and hit < len(seq) and (hit == 0 or kv.enable_prefix_caching)
            n = rng.randint(1, len(seq) - hit)
            if kv.allocate(rid, seq, hit, n, hit):
                tokens[rid] = seq
                compute(rid, hit, n)
            else:
                waiting.append(seq)
        elif op < 0.85:
            rid = rng.choice(sorted(tokens))
            seq, start = tokens[rid], computed[rid]
            if start == len(seq):
                seq.append(rng.randrange(3))
            n = rng.randint(1, len(seq) - start)
            if kv.allocate(rid, seq, start, n):
                compute(rid, start, n)
                for spec in specs:
                    table, first = kv.block_table(rid)[spec.name], spec.first_needed_block(start)
                    assert table[:first] == [NULL_BLOCK] * first and NULL_BLOCK not in table[first:]
            else:  # preempt by recompute
                kv.free(rid)
                waiting.append(tokens.pop(rid))
        else:
            rid = rng.choice(sorted(tokens))
            kv.free(rid)
            del tokens[rid]
        check_consistent(kv, tokens)
        assert kv.num_requests == len(tokens)
    for rid in list(tokens):
        kv.free(rid)
    assert kv.all_blocks_free() and kv.num_requests == 0


@pytest.mark.parametrize("chunk", range(8))
def test_random_requests_keep_the_books(chunk):
    for seed in range(chunk * 100, (chunk + 1) * 100):
        simulate(seed)


def test_external_allocation_holds_what_later_queries_read():
    """PD decode side: a prompt computed elsewhere gets every full-group block, and of a window group only the
    blocks from the one the next query needs; all or nothing; the request then runs on as any other."""
    specs = [CacheGroupSpec("full", 4), CacheGroupSpec("window", 4, sliding_window=6)]
    m = KVCacheManager(specs, {"full": 12, "window": 5}, enable_prefix_caching=True)
    assert m.allocate_external("a", 18)  # 5 blocks; the window group needs blocks from (18 - 6 + 1) // 4 = 3 on
    table = m.block_table("a")
    assert len(table["full"]) == 5 and NULL_BLOCK not in table["full"]
    assert table["window"][:3] == [NULL_BLOCK] * 3 and NULL_BLOCK not in table["window"][3:]
    free = {g: m.num_free_blocks(g) for g in ("full", "window")}
    assert not m.allocate_external("b", 40)  # 10 full blocks: only 6 left, and nothing changed
    assert {g: m.num_free_blocks(g) for g in ("full", "window")} == free
    tokens = list(range(19))
    assert m.allocate("a", tokens, 18, 1)  # the first decode step: position 18, still block 4
    assert m.block_table("a")["window"][:3] == [NULL_BLOCK] * 3
    m.free("a")
    assert m.all_blocks_free()
