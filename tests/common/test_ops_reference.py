"""common.ops references against naive formulas written here (Python loops, dense masks, float64)."""
import math

import pytest
import torch
import torch.nn.functional as F

from common.ops import reference as ref

torch.manual_seed(0)


def close(a, b, tol=1e-5):
    torch.testing.assert_close(a.double(), b.double(), rtol=tol, atol=tol)


def cu(lengths):
    return torch.tensor([0] + list(torch.tensor(lengths).cumsum(0)), dtype=torch.int32)


# ---------------------------------------------------------------- norms


def naive_rms_norm(x, w, eps):
    out = torch.empty(x.shape, dtype=torch.float64)
    for i, row in enumerate(x.double().reshape(-1, x.shape[-1])):
        r = row / math.sqrt(sum(v * v for v in row.tolist()) / len(row) + eps)
        out.view(-1, x.shape[-1])[i] = r if w is None else r * w.double()
    return out


@pytest.mark.parametrize("weighted", [True, False])
def test_rms_norm(weighted):
    x, w = torch.randn(3, 5, 16), torch.randn(16) if weighted else None
    close(ref.rms_norm(x, w, 1e-6), naive_rms_norm(x, w, 1e-6))


def test_rms_norm_bf16_with_fp32_weight():
    x, w = torch.randn(4, 32).bfloat16(), torch.randn(32)
    y = ref.rms_norm(x, w, 1e-5)
    assert y.dtype == torch.bfloat16
    close(y, naive_rms_norm(x.float(), w, 1e-5).bfloat16(), tol=1e-2)


def test_add_rms_norm():
    x, r, w = torch.randn(6, 16), torch.randn(6, 16), torch.randn(16)
    normed, summed = ref.add_rms_norm(x, r, w, 1e-6)
    assert torch.equal(summed, x + r)
    close(normed, naive_rms_norm(x + r, w, 1e-6))


# ---------------------------------------------------------------- rope


@pytest.mark.parametrize("interleaved", [False, True])
def test_rotary_emb(interleaved):
    T, H, R = 5, 3, 8
    x, theta = torch.randn(T, H, R), torch.rand(T, R // 2) * 6
    if interleaved:
        cos, sin = theta.cos().repeat_interleave(2, -1), theta.sin().repeat_interleave(2, -1)
        pairs = [(2 * i, 2 * i + 1) for i in range(R // 2)]
    else:
        cos, sin = theta.cos().repeat(1, 2), theta.sin().repeat(1, 2)
        pairs = [(i, i + R // 2) for i in range(R // 2)]
    want = torch.empty(T, H, R, dtype=torch.float64)
    for t in range(T):
        for h in range(H):
            for i, (a, b) in enumerate(pairs):  # rotate the pair (x_a, x_b) by theta[t, i]
                c, s = math.cos(theta[t, i]), math.sin(theta[t, i])
                want[t, h, a] = x[t, h, a] * c - x[t, h, b] * s
                want[t, h, b] = x[t, h, b] * c + x[t, h, a] * s
    close(ref.rotary_emb(x, cos, sin, interleaved), want)
    assert ref.rotary_emb(x.bfloat16(), cos, sin, interleaved).dtype == torch.bfloat16


# ---------------------------------------------------------------- attention


def naive_attention(q, k, v, q_lens, kv_lens, scale, causal=True, window=None, sinks=None):
    """Per token and head: explicit positions, exp / sum in float64. Returns out, lse."""
    T, Hq, _ = q.shape
    groups = Hq // k.shape[1]
    out, lse = torch.zeros(T, Hq, v.shape[-1], dtype=torch.float64), torch.full((T, Hq), -math.inf, dtype=torch.float64)
    t, k0 = 0, 0
    for q_len, kv_len in zip(q_lens, kv_lens):
        for i in range(q_len):
            pos = kv_len - q_len + i
            keys = [j for j in range(kv_len) if (not causal or j <= pos) and (window is None or pos - j < window)]
            for h in range(Hq):
                scores = [float(q[t, h].double() @ k[k0 + j, h // groups].double()) * scale for j in keys]
                if keys:
                    lse[t, h] = math.log(sum(math.exp(s) for s in scores))
                denom = sum(math.exp(s) for s in scores) + (math.exp(sinks[h]) if sinks is not None else 0.0)
                for j, s in zip(keys, scores):
                    out[t, h] += math.exp(s) / denom * v[k0 + j, h // groups].double()
            t += 1
        k0 += kv_len
    return out, lse


CASES = {
    "causal": dict(heads=(4, 4), q_lens=[6], kv_lens=[6]),
    "gqa": dict(heads=(4, 2), q_lens=[5], kv_lens=[5]),
    "mqa": dict(heads=(4, 1), q_lens=[5], kv_lens=[5]),
    "sliding": dict(heads=(4, 2), q_lens=[7], kv_lens=[7], window=3),
    "sliding_noncausal": dict(heads=(2, 2), q_lens=[5], kv_lens=[5], window=2, causal=False),
    "noncausal": dict(heads=(2, 1), q_lens=[3, 4], kv_lens=[5, 4], causal=False),
    "sinks": dict(heads=(4, 2), q_lens=[5], kv_lens=[5], sinks=True),
    "packed_q_shorter": dict(heads=(4, 2), q_lens=[3, 1, 4], kv_lens=[5, 6, 4]),
    "packed_sliding_sinks": dict(heads=(4, 2), q_lens=[2, 3], kv_lens=[6, 3], window=4, sinks=True),
}


@pytest.mark.parametrize("name", CASES)
def test_attention(name):
    c = CASES[name]
    (hq, hkv), q_lens, kv_lens = c["heads"], c["q_lens"], c["kv_lens"]
    q, k, v = torch.randn(sum(q_lens), hq, 8), torch.randn(sum(kv_lens), hkv, 8), torch.randn(sum(kv_lens), hkv, 6)
    sinks = torch.randn(hq) if c.get("sinks") else None
    causal, window = c.get("causal", True), c.get("window")
    out, lse = ref.attention(q, k, v, cu(q_lens), cu(kv_lens), 0.4, causal, window, sinks, return_lse=True)
    want_out, want_lse = naive_attention(q, k, v, q_lens, kv_lens, 0.4, causal, window, sinks)
    close(out, want_out)
    close(lse, want_lse)
    assert out.shape == (sum(q_lens), hq, 6) and lse.dtype == torch.float32


def test_attention_bf16_keeps_dtype():
    q, k, v = torch.randn(4, 2, 8).bfloat16(), torch.randn(4, 2, 8).bfloat16(), torch.randn(4, 2, 8).bfloat16()
    out = ref.attention(q, k, v, cu([4]), cu([4]), 0.3)
    assert out.dtype == torch.bfloat16
    close(out, naive_attention(q.float(), k.float(), v.float(), [4], [4], 0.3)[0], tol=2e-2)


def test_attention_row_without_keys_is_zero_not_nan():
    q, k, v = torch.randn(3, 2, 4), torch.randn(3, 2, 4), torch.randn(3, 2, 4)
    out, lse = ref.attention(q, k, v, cu([3]), cu([3]), 1.0, sliding_window=0, sinks=torch.zeros(2), return_lse=True)
    assert torch.equal(out, torch.zeros_like(out)) and bool(torch.isneginf(lse).all())


def paged_setup(kv_lens, hkv=2, d=8, dv=6, block_size=4, num_blocks=12):
    """Random k / v for each sequence, written into a cache through a shuffled block table."""
    k, v = torch.randn(sum(kv_lens), hkv, d), torch.randn(sum(kv_lens), hkv, dv)
    blocks = [math.ceil(n / block_size) for n in kv_lens]
    perm = torch.randperm(num_blocks)[: sum(blocks)].int()
    table = torch.zeros(len(kv_lens), max(blocks), dtype=torch.int32)
    slots = []
    for b, (n, ids) in enumerate(zip(kv_lens, perm.split(blocks))):
        table[b, : len(ids)] = ids
        slots += [int(ids[p // block_size]) * block_size + p % block_size for p in range(n)]
    k_cache, v_cache = torch.zeros(num_blocks, block_size, hkv, d), torch.zeros(num_blocks, block_size, hkv, dv)
    ref.reshape_and_cache(k, v, k_cache, v_cache, torch.tensor(slots))
    return k, v, k_cache, v_cache, table


@pytest.mark.parametrize("kw", [dict(), dict(sliding_window=3), dict(sinks=torch.randn(4))])
def test_paged_attention_equals_attention(kw):
    q_lens, kv_lens = [2, 1, 5], [7, 3, 5]
    k, v, k_cache, v_cache, table = paged_setup(kv_lens)
    q = torch.randn(sum(q_lens), 4, 8)
    seq_lens = torch.tensor(kv_lens, dtype=torch.int32)
    got = ref.paged_attention(q, k_cache, v_cache, table, seq_lens, cu(q_lens), 0.3, return_lse=True, **kw)
    want = ref.attention(q, k, v, cu(q_lens), cu(kv_lens), 0.3, return_lse=True, **kw)
    close(got[0], want[0])
    close(got[1], want[1])


def test_paged_attention_k_equals_v():
    k, _, k_cache, _, table = paged_setup([5, 3], dv=8)
    q = torch.randn(3, 4, 8)
    got = ref.paged_attention(q, k_cache, None, table, torch.tensor([5, 3]), cu([2, 1]), 0.3)
    close(got, ref.attention(q, k, k, cu([2, 1]), cu([5, 3]), 0.3))


@pytest.mark.parametrize("kw", [dict(), dict(sliding_window=3), dict(sliding_window=9), dict(sinks=torch.randn(4))])
@pytest.mark.parametrize("shared_kv", [False, True])
@pytest.mark.parametrize("kv_lens", [[7, 1, 5, 12], [6, 6, 6]])  # ragged (and a short row alone); equal: no mask
def test_paged_attention_decode_batch_equals_attention(kw, shared_kv, kv_lens):
    """One new token per sequence takes the gathered-pages decode path; it must match dense attention."""
    k, v, k_cache, v_cache, table = paged_setup(kv_lens, dv=8 if shared_kv else 6)
    v, v_cache = (k, None) if shared_kv else (v, v_cache)
    q = torch.randn(len(kv_lens), 4, 8)
    ones = cu([1] * len(kv_lens))
    got = ref.paged_attention(q, k_cache, v_cache, table, torch.tensor(kv_lens, dtype=torch.int32), ones, 0.3,
                              return_lse=True, **kw)
    want = ref.attention(q, k, v, ones, cu(kv_lens), 0.3, return_lse=True, **kw)
    close(got[0], want[0])
    close(got[1], want[1])


@pytest.mark.parametrize("kw", [dict(), dict(sliding_window=3), dict(sinks=torch.randn(4))])
def test_paged_attention_uniform_queries_equal_attention(kw):
    """Every sequence the same 3 new tokens (a decode step verifying 2 MTP drafts) with the host bounds given: the
    static per-query path (each query its own kv end), padded to max_seqlen_k keys, equals dense causal attention."""
    kv_lens = [7, 3, 12]
    k, v, k_cache, v_cache, table = paged_setup(kv_lens)
    q = torch.randn(9, 4, 8)
    three = cu([3] * 3)
    got = ref.paged_attention(q, k_cache, v_cache, table, torch.tensor(kv_lens, dtype=torch.int32), three, 0.3,
                              return_lse=True, max_seqlen_q=3, max_seqlen_k=16, **kw)
    want = ref.attention(q, k, v, three, cu(kv_lens), 0.3, return_lse=True, **kw)
    close(got[0], want[0])
    close(got[1], want[1])


def test_bf16_decode_batch_through_the_fused_kernel_equals_fp32_attention():
    """bf16 decode rows, MQA with K = V (MLA's latent, V4's shared KV): torch's fused CPU kernel, fp32 accumulation,
    within bf16 rounding of fp32 dense attention; a sliding window and sinks on top."""
    kv_lens = [7, 1, 5, 12]
    k, _, k_cache, _, table = paged_setup(kv_lens, hkv=1, d=16, dv=16)
    q = torch.randn(len(kv_lens), 4, 16)
    ones, lens = cu([1] * len(kv_lens)), torch.tensor(kv_lens, dtype=torch.int32)
    for kw in (dict(), dict(sliding_window=3, sinks=torch.randn(4))):
        got = ref.paged_attention(q.bfloat16(), k_cache.bfloat16(), None, table, lens, ones, 0.3, return_lse=True,
                                  **kw)
        want = ref.attention(q, k, k, ones, cu(kv_lens), 0.3, return_lse=True, **kw)
        assert got[0].dtype == torch.bfloat16
        close(got[0], want[0], tol=3e-2)
        close(got[1], want[1], tol=3e-2)


def test_compiled_decode_reads_the_keys_held_not_the_padded_width():
    """In a compiled CPU graph (graph mode) the decode rows run as one opaque op that reads the kv lengths on the
    host: max_seqlen_k 64 (the graph's bound) gathers only the pages the sequences hold, with the eager result: the
    two of 7 and 12 keys at 12 (3 pages each), the one of 3 (a quarter of the longest or less, like a bucket's
    padding sequences) in a batch of its own at 3 (1 page)."""
    kv_lens = [7, 3, 12]
    k, v, k_cache, v_cache, table = paged_setup(kv_lens)
    q, ones, lens = torch.randn(3, 4, 8), cu([1] * 3), torch.tensor(kv_lens, dtype=torch.int32)

    def step(q, k_cache, v_cache, table, lens):
        return ref.paged_attention(q, k_cache, v_cache, table, lens, ones, 0.3, return_lse=True, max_seqlen_q=1,
                                   max_seqlen_k=64)

    want = step(q, k_cache, v_cache, table, lens)
    compiled = torch.compile(step, fullgraph=True, dynamic=False)
    compiled(q, k_cache, v_cache, table, lens)
    with torch.profiler.profile(record_shapes=True) as prof:
        got = compiled(q, k_cache, v_cache, table, lens)
    gathers = [e.input_shapes[2] for e in prof.events() if e.name == "aten::index_select"]  # (rows, dim, index)
    assert any(e.name == "npu_cookbook::paged_decode" for e in prof.events())
    pages = [-(-n // 4) for n in (3, 12)]  # paged_setup's 4-token blocks: the pages of the longest row of a batch
    assert sorted(gathers) == [[1 * pages[0]]] * 2 + [[2 * pages[1]]] * 2  # B of them a batch, K and V; not 64's
    close(got[0], want[0])
    close(got[1], want[1])
    close(got[0], ref.attention(q, k, v, ones, cu(kv_lens), 0.3))


@pytest.mark.parametrize("with_v", [True, False])
def test_reshape_and_cache(with_v):
    """Every slot is written; padding rows share row 0 (the null block's), one of them wins there."""
    k, v = torch.randn(5, 2, 4), torch.randn(5, 2, 3)
    k_cache, v_cache = torch.zeros(3, 4, 2, 4), torch.zeros(3, 4, 2, 3)
    slots = torch.tensor([9, 0, 2, 5, 0])  # rows 1 and 4: padding
    ref.reshape_and_cache(k, v if with_v else None, k_cache, v_cache if with_v else None, slots)
    want_k, want_v = torch.zeros(12, 2, 4), torch.zeros(12, 2, 3)
    for t, s in ((0, 9), (2, 2), (3, 5)):
        want_k[s], want_v[s] = k[t], v[t]
    got_k, got_v = k_cache.view(12, 2, 4), v_cache.view(12, 2, 3)
    assert torch.equal(got_k[1:], want_k[1:]) and any(torch.equal(got_k[0], k[t]) for t in (1, 4))
    if with_v:
        assert torch.equal(got_v[1:], want_v[1:]) and any(torch.equal(got_v[0], v[t]) for t in (1, 4))
    else:
        assert not v_cache.any()


# ---------------------------------------------------------------- sparse attention, LSE merges, sinks


def naive_sparse(q, k, v, indices, scale):
    groups = q.shape[1] // k.shape[1]
    out = torch.zeros(*q.shape[:2], v.shape[-1], dtype=torch.float64)
    lse = torch.full(q.shape[:2], -math.inf, dtype=torch.float64)
    for t in range(q.shape[0]):
        rows = [r for r in indices[t].tolist() if r >= 0]
        for h in range(q.shape[1]):
            scores = [float(q[t, h].double() @ k[r, h // groups].double()) * scale for r in rows]
            if rows:
                lse[t, h] = math.log(sum(math.exp(s) for s in scores))
            for r, s in zip(rows, scores):
                out[t, h] += math.exp(s - lse[t, h]) * v[r, h // groups].double()
    return out, lse


@pytest.mark.parametrize("hkv", [4, 1])
def test_sparse_attention(hkv):
    q, k, v = torch.randn(4, 4, 8), torch.randn(10, hkv, 8), torch.randn(10, hkv, 5)
    indices = torch.tensor([[3, -1, 7, 0], [-1, -1, -1, -1], [9, 8, 1, 2], [5, -1, -1, 6]])
    out, lse = ref.sparse_attention(q, k, v, indices, 0.5, return_lse=True)
    want_out, want_lse = naive_sparse(q, k, v, indices, 0.5)
    close(out, want_out)
    close(lse, want_lse)
    assert not out.isnan().any()


def test_sparse_attention_shared_kv_equals_a_separate_copy():
    """K = V models pass one tensor as k and v (gathered once): the same result as two equal tensors."""
    q, kv = torch.randn(5, 4, 8), torch.randn(12, 1, 8)
    indices = torch.tensor([[3, -1, 7, 0], [-1, -1, -1, -1], [9, 8, 1, 2], [5, -1, -1, 6], [11, 10, 4, -1]])
    out, lse = ref.sparse_attention(q, kv, kv, indices, 0.5, return_lse=True)
    want_out, want_lse = naive_sparse(q, kv, kv.clone(), indices, 0.5)
    close(out, want_out)
    close(lse, want_lse)


def test_merge_of_split_keys_equals_union():
    q, k, v = torch.randn(3, 2, 8), torch.randn(8, 2, 8), torch.randn(8, 2, 4)
    part_a = torch.tensor([[0, 2, 5, -1], [-1, -1, -1, -1], [7, 6, -1, -1]])  # row 1 sees nothing in part a
    part_b = torch.tensor([[1, 3, -1, -1], [0, 4, 5, -1], [-1, -1, -1, -1]])
    union = torch.cat([part_a, part_b], dim=1)
    out_a, lse_a = ref.sparse_attention(q, k, v, part_a, 0.3, return_lse=True)
    out_b, lse_b = ref.sparse_attention(q, k, v, part_b, 0.3, return_lse=True)
    out, lse = ref.merge_attention_states(out_a, lse_a, out_b, lse_b)
    want_out, want_lse = ref.sparse_attention(q, k, v, union, 0.3, return_lse=True)
    close(out, want_out)
    close(lse, want_lse)
    empty = torch.full((1, 2), -math.inf)
    merged = ref.merge_attention_states(torch.zeros(1, 2, 4), empty, torch.zeros(1, 2, 4), empty)
    assert torch.equal(merged[0], torch.zeros(1, 2, 4)) and bool(torch.isneginf(merged[1]).all())


def test_apply_attention_sinks_equals_sinks_in_attention():
    q, k, v, sinks = torch.randn(6, 4, 8), torch.randn(6, 2, 8), torch.randn(6, 2, 8), torch.randn(4)
    out, lse = ref.attention(q, k, v, cu([6]), cu([6]), 0.3, return_lse=True)
    close(ref.apply_attention_sinks(out, lse, sinks), ref.attention(q, k, v, cu([6]), cu([6]), 0.3, sinks=sinks))


# ---------------------------------------------------------------- lightning indexer


def naive_indexer(q, k, w, q_lens, kv_lens, visible, topk):
    out = torch.full((q.shape[0], topk), -1, dtype=torch.int32)
    t, k0 = 0, 0
    for q_len, kv_len in zip(q_lens, kv_lens):
        for _ in range(q_len):
            rows = range(k0, k0 + int(visible[t]))
            relu_dot = lambda h, n: max(0.0, float(q[t, h].double() @ k[n].double()))  # noqa: E731
            score = {n: sum(float(w[t, h]) * relu_dot(h, n) for h in range(q.shape[1])) for n in rows}
            best = sorted(rows, key=lambda n: (-score[n], n))[:topk]  # score desc, then lower index
            out[t, : len(best)] = torch.tensor(best, dtype=torch.int32)
            t += 1
        k0 += kv_len
    return out


def test_lightning_indexer():
    q_lens, kv_lens = [3, 2], [6, 4]
    q, k, w = torch.randn(5, 4, 8), torch.randn(10, 8), torch.rand(5, 4)
    visible = torch.tensor([2, 4, 6, 1, 4])
    got = ref.lightning_indexer(q, k, w, cu(q_lens), cu(kv_lens), visible, topk=3)
    assert torch.equal(got, naive_indexer(q, k, w, q_lens, kv_lens, visible, topk=3))


@pytest.mark.parametrize("q_lens, kv_lens", [([1, 1, 1], [5, 9, 2]), ([4, 0, 2], [7, 3, 5])])
def test_lightning_indexer_decode_batches_and_empty_sequences(q_lens, kv_lens):
    """All-decode batches (one query per sequence: the batched path) and a sequence without queries (per-sequence path)."""
    T = sum(q_lens)
    q, k, w = torch.randn(T, 3, 8), torch.randn(sum(kv_lens), 8), torch.rand(T, 3)
    visible = torch.tensor([min(kv_lens[b], 1 + t) for b, n in enumerate(q_lens) for t in range(n)])
    got = ref.lightning_indexer(q, k, w, cu(q_lens), cu(kv_lens), visible, topk=4)
    assert torch.equal(got, naive_indexer(q, k, w, q_lens, kv_lens, visible, topk=4))


def test_lightning_indexer_uniform_queries_with_host_bounds():
    """Every sequence 3 queries (a decode step verifying 2 drafts), bounds given: the static per-query path, keys
    padded to max_seqlen_k, picks what the naive per-sequence top-k picks."""
    q_lens, kv_lens = [3, 3], [5, 9]
    q, k, w = torch.randn(6, 3, 8), torch.randn(14, 8), torch.rand(6, 3)
    visible = torch.tensor([3, 4, 5, 7, 8, 9])
    got = ref.lightning_indexer(q, k, w, cu(q_lens), cu(kv_lens), visible, topk=4, max_seqlen_q=3, max_seqlen_k=12)
    assert torch.equal(got, naive_indexer(q, k, w, q_lens, kv_lens, visible, topk=4))


def test_lightning_indexer_ties_are_deterministic():
    """relu zeroes most scores: ties go to the lower index, and a row alone equals the row in its batch."""
    q_lens, kv_lens = [2, 3], [40, 33]
    q = -torch.rand(5, 2, 8)  # q . k <= 0 for k >= 0 except the few rows made positive below
    k = torch.rand(73, 8)
    k[[5, 17, 50, 60]] *= -1  # these score > 0
    w = torch.rand(5, 2)
    visible = torch.tensor([12, 40, 3, 30, 33])
    cu_q, cu_k = cu(q_lens), cu(kv_lens)
    batched = ref.lightning_indexer(q, k, w, cu_q, cu_k, visible, topk=8)
    assert torch.equal(batched, naive_indexer(q, k, w, q_lens, kv_lens, visible, topk=8))
    for t, b in enumerate([0, 0, 1, 1, 1]):
        row = slice(t, t + 1)
        alone = ref.lightning_indexer(q[row], k, w[row], cu([1]), cu_k[b : b + 2], visible[row], topk=8)
        assert torch.equal(alone, batched[t : t + 1])
    assert batched[2].tolist() == [40, 41, 42, -1, -1, -1, -1, -1]  # all-zero ties, visible 3 < topk
    decodes = ref.lightning_indexer(q[[1, 4]], k, w[[1, 4]], cu([1, 1]), cu_k, visible[[1, 4]], topk=8)
    assert torch.equal(decodes, batched[[1, 4]])  # a decode batch (one query per sequence) picks the same rows


# ---------------------------------------------------------------- MoE


def naive_gating(logits, k, bias, score_func, groups, k_group, renorm, rsf, eps=1e-20):
    funcs = {
        "softmax": lambda row: [math.exp(x) / sum(math.exp(y) for y in row) for x in row],
        "sigmoid": lambda row: [1 / (1 + math.exp(-x)) for x in row],
        "sqrtsoftplus": lambda row: [math.sqrt(math.log1p(math.exp(x))) for x in row],
    }
    weights, indices = [], []
    for row in logits.double().tolist():
        scores = funcs[score_func](row)
        biased = [s + (float(bias[e]) if bias is not None else 0.0) for e, s in enumerate(scores)]
        size = len(row) // groups
        group_score = [sum(sorted(biased[g * size : (g + 1) * size])[-2:]) for g in range(groups)]
        kept = sorted(range(groups), key=lambda g: -group_score[g])[:k_group] if groups > 1 else [0]
        allowed = [e for e in range(len(row)) if e // size in kept]
        chosen = sorted(allowed, key=lambda e: -biased[e])[:k]
        w = [scores[e] for e in chosen]
        total = sum(w) + eps if renorm else 1.0
        weights.append([x / total * rsf for x in w])
        indices.append(chosen)
    return torch.tensor(weights), torch.tensor(indices)


def same_routing(got, want):
    (w, idx), (want_w, want_idx) = got, want
    assert w.dtype == torch.float32 and idx.dtype == torch.int32
    assert torch.equal(idx.sort(-1).values, want_idx.int().sort(-1).values)
    close(w.gather(1, idx.long().argsort(-1)), want_w.gather(1, want_idx.argsort(-1)))


@pytest.mark.parametrize(
    "score_func, use_bias, groups, k_group, renorm, rsf",
    [
        ("softmax", False, 1, 1, True, 1.0),
        ("softmax", False, 1, 1, False, 1.0),
        ("sigmoid", True, 1, 1, True, 2.5),
        ("sigmoid", True, 4, 2, True, 2.5),
        ("sqrtsoftplus", True, 1, 1, True, 1.5),
    ],
)
def test_moe_gating_topk(score_func, use_bias, groups, k_group, renorm, rsf):
    logits, bias = torch.randn(6, 16), torch.randn(16) if use_bias else None
    got = ref.moe_gating_topk(logits, 4, bias, score_func, groups, k_group, renorm, rsf)
    same_routing(got, naive_gating(logits, 4, bias, score_func, groups, k_group, renorm, rsf))


def test_moe_gating_bias_selects_but_does_not_weigh():
    logits, bias = torch.zeros(1, 8), torch.tensor([0, 0, 0, 5.0, 0, 0, 0, 0])
    weights, indices = ref.moe_gating_topk(logits, 1, bias, "sigmoid", renorm=False)
    assert indices.tolist() == [[3]] and weights.tolist() == [[0.5]]


def test_moe_gating_hash_routing():
    logits, tid2eid = torch.randn(4, 8), torch.randint(0, 8, (20, 2))
    input_ids = torch.tensor([3, 19, 0, 3])
    weights, indices = ref.moe_gating_topk(
        logits, 2, score_func="sqrtsoftplus", routed_scaling_factor=1.5, tid2eid=tid2eid, input_ids=input_ids
    )
    assert torch.equal(indices, tid2eid[input_ids].int())
    scores = F.softplus(logits).sqrt().gather(1, indices.long())
    close(weights, scores / scores.sum(-1, keepdim=True) * 1.5)


def naive_swiglu(x, limit=None):
    gate, up = x.double().chunk(2, dim=-1)
    out = torch.empty_like(gate)
    for i, (g, u) in enumerate(zip(gate.flatten().tolist(), up.flatten().tolist())):
        if limit is not None:
            g, u = min(g, limit), max(-limit, min(u, limit))
        out.view(-1)[i] = g / (1 + math.exp(-g)) * u
    return out


@pytest.mark.parametrize("limit", [None, 0.7])
def test_swiglu(limit):
    x = torch.randn(3, 5, 8) * 2
    close(ref.swiglu(x, limit), naive_swiglu(x, limit))


def test_routing_and_grouped_matmul_equal_a_dense_loop():
    T, H, inter, E, k = 7, 8, 6, 5, 2
    x, shared = torch.randn(T, H), torch.randn(T, H)
    w1, w2 = torch.randn(E, 2 * inter, H) / 3, torch.randn(E, H, inter) / 3
    weights, indices = ref.moe_gating_topk(torch.randn(T, E), k)
    expanded_x, row_idx, counts = ref.moe_init_routing(x, indices, E)
    assert counts.dtype == torch.int64
    assert counts.tolist() == torch.bincount(indices.flatten().long(), minlength=E).tolist()
    for t in range(T):
        for j in range(k):
            assert torch.equal(expanded_x[row_idx[t * k + j]], x[t])
    experts_of_rows = indices.flatten()[row_idx.argsort()]
    assert bool((experts_of_rows.diff() >= 0).all())  # rows sorted by expert
    hidden = ref.swiglu(ref.grouped_matmul(expanded_x, w1, counts), limit=3.0)
    out = ref.moe_finalize_routing(ref.grouped_matmul(hidden, w2, counts), weights, row_idx, shared)
    want = shared.double().clone()
    for t in range(T):
        for j in range(k):
            e = int(indices[t, j])
            want[t] += float(weights[t, j]) * (naive_swiglu(x[t] @ w1[e].T, 3.0) @ w2[e].T.double())
    close(out, want)


def test_grouped_matmul_handles_empty_groups():
    x, w = torch.randn(5, 4), torch.randn(3, 6, 4)
    counts = torch.tensor([2, 0, 3])
    want = torch.cat([x[:2] @ w[0].T, x[2:] @ w[2].T])
    close(ref.grouped_matmul(x, w, counts), want)


@pytest.mark.parametrize("counts", [[2, 0, 1], [3, 0, 1, 2, 0, 1]], ids=["gathered-M<E", "all-experts-M>=E"])
def test_static_grouped_matmul_equals_the_expert_loop_compiled_too(counts):
    """The accelerator's graph-mode expert matmul (no group size read on the host) gives the loop's rows, eager
    and compiled fullgraph (traced as it is, no custom op); rows past the counts (dispatch padding) are free."""
    from common.ops.reference.moe import static_grouped_matmul
    counts = torch.tensor(counts)
    E, M = 5 if len(counts) == 3 else 6, int(counts.sum()) + 1  # one padding row
    counts = torch.cat([counts, counts.new_zeros(E - len(counts))])
    x, w = torch.randn(M, 8), torch.randn(E, 6, 8)
    n = M - 1
    want = ref.grouped_matmul(x[:n], w, counts)
    close(static_grouped_matmul(x, w, counts)[:n], want)
    compiled = torch.compile(static_grouped_matmul, fullgraph=True, dynamic=False)
    close(compiled(x, w, counts)[:n], want)
