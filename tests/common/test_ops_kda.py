"""common.ops KDA ops (reference/kda.py): Kimi Delta Attention and its short causal conv, state in pool slots.

Against the formulas written here (the per-token recurrence and the conv as an explicit sum, float64), against
fla-core's naive KDA (loaded by file path: `fla.ops` imports Triton), chunked prefill == one shot == token-by-token
decode with the state carried through slots, and the slot convention (slot 0 reads as zeros and is never written).
"""
import importlib.util
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from common import ops
from common.ops import reference as ref

H, DK, DV, SLOTS = 2, 16, 8, 8
SCALE = DK ** -0.5
KDA_OPS = ("causal_conv1d", "causal_conv1d_update", "chunk_kda", "recurrent_kda")
# fp32, chunked vs recurrent: both are within ~4e-7 of the float64 formula here. (Decays taken as differences of
# in-chunk prefix sums, e^(G_i - G_j), would be off by eps * |G|: up to 1.5e-5 in S with these inputs.)
CARRY_TOL = 1e-6


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Tiny tensors, thousands of ops: intra-op threads only add wake-ups (20x slower on a loaded 2-core host)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def close(a, b, tol=1e-5):
    torch.testing.assert_close(a.double(), b.double(), rtol=tol, atol=tol)


def cu(lengths):
    return torch.tensor([0] + list(torch.tensor(lengths, dtype=torch.long).cumsum(0)), dtype=torch.int32)


def slots(values):
    return torch.tensor(values, dtype=torch.int32)


def kda_inputs(T, seed=0, strong_decay=False):
    """q, k [T, H, DK] (L2-normalised), v [T, H, DV], g [T, H, DK] in (-5, 0) (Ling's gate range), beta [T, H]."""
    gen = torch.Generator().manual_seed(seed)
    q, k = (F.normalize(torch.randn(T, H, DK, generator=gen), dim=-1) for _ in range(2))
    v = torch.randn(T, H, DV, generator=gen)
    shift = 3.0 if strong_decay else -3.0  # mostly mild decays (long memory), or mostly near -5
    g = -5 * torch.sigmoid(3 * torch.randn(T, H, DK, generator=gen) + shift)
    beta = torch.rand(T, H, generator=gen)
    return q, k, v, g, beta


def state_pool(seed=1):
    """[SLOTS, H, DK, DV] fp32; slot 0 holds garbage, which a fresh sequence must not read."""
    return torch.randn(SLOTS, H, DK, DV, generator=torch.Generator().manual_seed(seed)) * 0.5


def naive_kda(q, k, v, g, beta, S):
    """Step 5 of the spec token by token in float64, one sequence: [n, H, .] and S [H, DK, DV] -> (o [n, H, DV], S)."""
    S, o = S.double(), []
    for t in range(q.shape[0]):
        qt, kt, vt, gt, bt = (x[t].double() for x in (q, k, v, g, beta))
        S = gt.exp()[:, :, None] * S  # S' = diag(e^g) S
        u = bt[:, None] * (vt - torch.einsum("hkv,hk->hv", S, kt))  # u = beta (v - S'^T k)
        S = S + kt[:, :, None] * u[:, None, :]  # S = S' + k u^T
        o.append(torch.einsum("hkv,hk->hv", S, SCALE * qt))  # o = S^T (scale q)
    return (torch.stack(o) if o else torch.zeros(0, H, DV, dtype=torch.float64)), S


def initial(pool, read_slot):
    return torch.zeros(pool.shape[1:]) if read_slot == 0 else pool[read_slot]


def assert_only_written(before, after, write_slots):
    """Every slot outside write_slots (slot 0 included) is bit for bit as before."""
    kept = [s for s in range(before.shape[0]) if s == 0 or s not in write_slots]
    assert torch.equal(before[kept], after[kept])


# ---------------------------------------------------------------- KDA against the formula


@pytest.mark.parametrize("chunk_size", [64, 16, 5])
def test_chunk_kda_matches_the_recurrence(chunk_size):
    # fresh, continued, empty (copies its state), one token, several chunks; sequence 2 reads slot 3 before
    # sequence 3 writes it, and sequence 1 updates slot 2 in place
    lens, reads, writes = [37, 1, 0, 130, 64], [0, 2, 3, 0, 5], [1, 2, 4, 3, 5]
    q, k, v, g, beta = kda_inputs(sum(lens))
    pool = state_pool()
    before = pool.clone()
    o = ops.chunk_kda(q, k, v, g, beta, cu(lens), pool, slots(reads), slots(writes), SCALE, chunk_size=chunk_size)
    assert o.dtype == v.dtype and o.shape == v.shape
    bounds = cu(lens).tolist()
    for b, (r, w) in enumerate(zip(reads, writes)):
        rows = slice(bounds[b], bounds[b + 1])
        want_o, want_S = naive_kda(q[rows], k[rows], v[rows], g[rows], beta[rows], initial(before, r))
        close(o[rows], want_o, CARRY_TOL)
        close(pool[w], want_S, CARRY_TOL)
    assert_only_written(before, pool, writes)


def test_recurrent_kda_matches_the_recurrence():
    reads, writes = [0, 3, 3, 6], [1, 3, 2, 7]  # fresh, in place, two sequences reading the same slot
    q, k, v, g, beta = kda_inputs(len(reads), seed=2)
    pool = state_pool()
    before = pool.clone()
    o = ops.recurrent_kda(q, k, v, g, beta, pool, slots(reads), slots(writes), SCALE)
    for b, (r, w) in enumerate(zip(reads, writes)):
        want_o, want_S = naive_kda(q[b:b + 1], k[b:b + 1], v[b:b + 1], g[b:b + 1], beta[b:b + 1], initial(before, r))
        close(o[b], want_o[0])
        close(pool[w], want_S)
    assert_only_written(before, pool, writes)


def test_write_columns_keep_the_state_after_each_of_the_last_tokens():
    """Speculative decoding: write slots [B, W] take the state after each of a sequence's last W tokens (column i:
    after token L - W + i; null columns nothing), in both forms: chunk_kda (chunks, then token by token) over packed
    sequences of several lengths, and recurrent_kda over [B, L] tokens (an MTP verify step, no host read)."""
    W, lens, reads = 3, [4, 2, 70], [0, 6, 0]
    writes = [[1, 2, 3], [0, 4, 5], [0, 7, 6]]  # seq 1: a null column before its first token; seq 2 writes 6 in place
    q, k, v, g, beta = kda_inputs(sum(lens), seed=5)
    pool = state_pool()
    before = pool.clone()
    o = ops.chunk_kda(q, k, v, g, beta, cu(lens), pool, slots(reads), slots(writes), SCALE, chunk_size=16)
    bounds = cu(lens).tolist()
    for b, (r, ws) in enumerate(zip(reads, writes)):
        rows = slice(bounds[b], bounds[b + 1])
        want_o, _ = naive_kda(q[rows], k[rows], v[rows], g[rows], beta[rows], initial(before, r))
        close(o[rows], want_o, CARRY_TOL)
        for i, w in enumerate(ws):
            n = lens[b] - W + i + 1  # tokens the state in column i has seen
            if w:
                close(pool[w], naive_kda(q[rows][:n], k[rows][:n], v[rows][:n], g[rows][:n], beta[rows][:n],
                                         initial(before, r))[1], CARRY_TOL)
    assert_only_written(before, pool, [w for ws in writes for w in ws])
    # the recurrent form over two sequences of L = 3 tokens each equals the chunked one
    q3, k3, v3, g3, beta3 = (x[:6].reshape(2, 3, *x.shape[1:]) for x in (q, k, v, g, beta))
    pool2, pool3 = state_pool(), state_pool()
    o2 = ops.chunk_kda(q[:6], k[:6], v[:6], g[:6], beta[:6], cu([3, 3]), pool2, slots([0, 6]),
                       slots([[1, 2, 3], [4, 5, 6]]), SCALE)
    o3 = ops.recurrent_kda(q3, k3, v3, g3, beta3, pool3, slots([0, 6]), slots([[1, 2, 3], [4, 5, 6]]), SCALE)
    assert o3.shape == (2, 3, H, DV)
    close(o3.reshape(6, H, DV), o2, CARRY_TOL)
    close(pool3, pool2, CARRY_TOL)


def test_write_slot_zero_is_dropped():
    q, k, v, g, beta = kda_inputs(5, seed=3)
    pool = state_pool()
    before = pool.clone()
    ops.chunk_kda(q, k, v, g, beta, cu([3, 2]), pool, slots([0, 4]), slots([0, 0]), SCALE)
    ops.recurrent_kda(q[:2], k[:2], v[:2], g[:2], beta[:2], pool, slots([4, 0]), slots([0, 0]), SCALE)
    assert torch.equal(pool, before)


def test_strong_decay_over_a_long_chunk_stays_finite():
    # g near -5 over 64 tokens: G reaches about -300, where e^(-G) overflows fp32; every exponent must stay <= 0
    q, k, v, g, beta = kda_inputs(128, seed=4, strong_decay=True)
    assert float(g.sum(0).min()) < -200
    pool = state_pool()
    before = pool.clone()
    o = ops.chunk_kda(q, k, v, g, beta, cu([128]), pool, slots([1]), slots([2]), SCALE, chunk_size=64)
    want_o, want_S = naive_kda(q, k, v, g, beta, before[1])
    assert torch.isfinite(o).all() and torch.isfinite(pool[2]).all()
    close(o, want_o)
    close(pool[2], want_S)


# ---------------------------------------------------------------- against fla-core's naive KDA


@pytest.fixture(scope="module")
def fla_naive():
    """fla/ops/kda/naive.py of the installed fla-core, loaded by file path (`fla.ops` imports Triton)."""
    spec = importlib.util.find_spec("fla")  # a top-level find_spec does not run the package
    if spec is None:
        pytest.skip("fla-core is not installed (requirements-nodeps.txt installs it)")
    path = Path(next(iter(spec.submodule_search_locations))) / "ops" / "kda" / "naive.py"
    module_spec = importlib.util.spec_from_file_location("fla_kda_naive", path)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    return module


def batched(x, B):
    return x.reshape(B, -1, *x.shape[1:])  # packed [B*T, ...] -> [B, T, ...]


@pytest.mark.parametrize("chunk_size", [64, 32])
def test_chunk_kda_matches_fla_naive_chunk(fla_naive, chunk_size):
    B, T = 2, 128  # naive_chunk_kda wants T % 64 == 0 and equal lengths
    q, k, v, g, beta = kda_inputs(B * T, seed=5)
    pool = state_pool()
    S0 = pool[[1, 2]].clone()
    want_o, want_S = fla_naive.naive_chunk_kda(*(batched(x, B) for x in (q, k, v, g, beta)), scale=SCALE,
                                               initial_state=S0, output_final_state=True)
    o = ops.chunk_kda(q, k, v, g, beta, cu([T] * B), pool, slots([1, 2]), slots([3, 4]), SCALE,
                      chunk_size=chunk_size)
    close(batched(o, B), want_o)
    close(pool[[3, 4]], want_S)


def test_both_forms_match_fla_naive_recurrent(fla_naive):
    B, T = 2, 37
    q, k, v, g, beta = kda_inputs(B * T, seed=6)
    pool = state_pool()
    S0 = torch.stack((torch.zeros(H, DK, DV), pool[3]))  # one fresh sequence, one continued
    want_o, want_S = fla_naive.naive_recurrent_kda(*(batched(x, B) for x in (q, k, v, g, beta)), scale=SCALE,
                                                   initial_state=S0, output_final_state=True)
    o = ops.chunk_kda(q, k, v, g, beta, cu([T] * B), pool, slots([0, 3]), slots([1, 2]), SCALE, chunk_size=16)
    close(batched(o, B), want_o)
    close(pool[[1, 2]], want_S)
    steps = [ops.recurrent_kda(*(batched(x, B)[:, t] for x in (q, k, v, g, beta)), pool,
                               slots([0, 3] if t == 0 else [4, 5]), slots([4, 5]), SCALE) for t in range(T)]
    close(torch.stack(steps, 1), want_o)
    close(pool[[4, 5]], want_S)


# ---------------------------------------------------------------- chunked == recurrent, state carried in slots

@settings(max_examples=50, deadline=None)
@given(n=st.integers(1, 150), data=st.data(), chunk_size=st.sampled_from([1, 3, 16, 64]), fresh=st.booleans(),
       seed=st.integers(0, 2**16))
def test_prefill_in_two_parts_equals_one_shot_equals_decode(n, data, chunk_size, fresh, seed):
    split = data.draw(st.integers(0, n), label="split")
    q, k, v, g, beta = kda_inputs(n, seed)
    pool = state_pool(seed)
    start = slots([0 if fresh else 1])
    one_shot = ops.chunk_kda(q, k, v, g, beta, cu([n]), pool, start, slots([2]), SCALE, chunk_size=chunk_size)

    first = ops.chunk_kda(q[:split], k[:split], v[:split], g[:split], beta[:split], cu([split]), pool, start,
                          slots([3]), SCALE, chunk_size=chunk_size)
    rest = ops.chunk_kda(q[split:], k[split:], v[split:], g[split:], beta[split:], cu([n - split]), pool,
                         slots([3]), slots([3]), SCALE, chunk_size=chunk_size)
    close(torch.cat((first, rest)), one_shot, CARRY_TOL)
    close(pool[3], pool[2], CARRY_TOL)

    decoded = [ops.recurrent_kda(q[t:t + 1], k[t:t + 1], v[t:t + 1], g[t:t + 1], beta[t:t + 1], pool,
                                 start if t == 0 else slots([4]), slots([4]), SCALE) for t in range(n)]
    close(torch.cat(decoded), one_shot, CARRY_TOL)
    close(pool[4], pool[2], CARRY_TOL)


@settings(max_examples=30, deadline=None)
@given(lens=st.lists(st.integers(0, 90), min_size=1, max_size=4), chunk_size=st.sampled_from([1, 7, 64]),
       seed=st.integers(0, 2**16))
def test_packed_sequences_equal_each_alone(lens, chunk_size, seed):
    q, k, v, g, beta = kda_inputs(sum(lens), seed)
    reads = [(0, 2, 0, 3)[b] for b in range(len(lens))]  # fresh and continued, none of them a write slot
    writes = [4 + b for b in range(len(lens))]
    pool = state_pool(seed)
    alone_pool = pool.clone()
    o = ops.chunk_kda(q, k, v, g, beta, cu(lens), pool, slots(reads), slots(writes), SCALE, chunk_size=chunk_size)
    bounds = cu(lens).tolist()
    for b, (r, w) in enumerate(zip(reads, writes)):
        rows = slice(bounds[b], bounds[b + 1])
        alone = ops.chunk_kda(q[rows], k[rows], v[rows], g[rows], beta[rows], cu([lens[b]]), alone_pool,
                              slots([r]), slots([w]), SCALE, chunk_size=chunk_size)
        close(o[rows], alone, 1e-6)
    close(pool, alone_pool, 1e-6)


def test_length_one_sequences_in_chunk_kda_equal_recurrent_kda():
    # vLLM runs the decode tokens of a mixed batch through the prefill kernel as length-1 sequences
    B = 5
    q, k, v, g, beta = kda_inputs(B, seed=7)
    pool = state_pool()
    reads, writes = slots([0, 1, 2, 3, 0]), slots([1, 2, 3, 4, 5])  # in place and shifted
    chunked_pool = pool.clone()
    chunked = ops.chunk_kda(q, k, v, g, beta, cu([1] * B), chunked_pool, reads, writes, SCALE)
    decoded = ops.recurrent_kda(q, k, v, g, beta, pool, reads, writes, SCALE)
    close(chunked, decoded, 1e-6)
    close(chunked_pool, pool, 1e-6)


def test_state_stays_fp32_with_bf16_inputs():
    q, k, v, g, beta = kda_inputs(40, seed=8)
    q16, k16, v16 = q.bfloat16(), k.bfloat16(), v.bfloat16()
    pool, pool32 = state_pool(), state_pool()
    o = ops.chunk_kda(q16, k16, v16, g, beta, cu([40]), pool, slots([1]), slots([2]), SCALE)
    o32 = ops.chunk_kda(q16.float(), k16.float(), v16.float(), g, beta, cu([40]), pool32, slots([1]), slots([2]),
                        SCALE)
    assert o.dtype == torch.bfloat16 and pool.dtype == torch.float32
    assert torch.equal(o, o32.bfloat16()) and torch.equal(pool, pool32)  # fp32 math from the rounded inputs
    step = ops.recurrent_kda(q16[:1], k16[:1], v16[:1], g[:1], beta[:1], pool, slots([2]), slots([2]), SCALE)
    step32 = ops.recurrent_kda(q16[:1].float(), k16[:1].float(), v16[:1].float(), g[:1], beta[:1], pool32,
                               slots([2]), slots([2]), SCALE)
    assert step.dtype == torch.bfloat16 and torch.equal(step, step32.bfloat16()) and torch.equal(pool, pool32)


# ---------------------------------------------------------------- short causal conv

C, KW = 6, 4  # channels, kernel width: the conv state holds KW - 1 = 3 inputs


def naive_conv(history, x, w, activation):
    """Explicit sum in float64: history [KW-1, C], x [n, C], w [C, KW] -> (y [n, C], the last KW-1 inputs)."""
    u = torch.cat((history.double(), x.double()))  # u[KW-1+t] is x_t
    y = [sum(w[:, j].double() * u[t + j] for j in range(KW)) for t in range(x.shape[0])]  # sum_j w_j u_(t-KW+1+j)
    y = torch.stack(y) if y else torch.zeros(0, C, dtype=torch.float64)
    return (y * torch.sigmoid(y) if activation else y), u[-(KW - 1):]


def conv_inputs(T, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x, w = torch.randn(T, C, generator=gen), torch.randn(C, KW, generator=gen)
    conv_state = torch.randn(SLOTS, KW - 1, C, generator=gen)  # slot 0: garbage, never read
    return x, w, conv_state


@pytest.mark.parametrize("activation", ["silu", None])
def test_causal_conv1d_matches_the_explicit_sum(activation):
    # fresh, continued shorter than KW-1 (keeps part of its history), in place, empty (copies), long
    lens, reads, writes = [5, 1, 2, 0, 9], [0, 1, 2, 3, 0], [4, 5, 2, 6, 7]
    x, w, conv_state = conv_inputs(sum(lens))
    before = conv_state.clone()
    y = ops.causal_conv1d(x, w, cu(lens), conv_state, slots(reads), slots(writes), activation=activation)
    bounds = cu(lens).tolist()
    for b, (r, wr) in enumerate(zip(reads, writes)):
        rows = slice(bounds[b], bounds[b + 1])
        want_y, want_tail = naive_conv(initial(before, r), x[rows], w, activation)
        close(y[rows], want_y)
        assert torch.equal(conv_state[wr], want_tail.float())  # copies of inputs: exact
    assert_only_written(before, conv_state, writes)


@pytest.mark.parametrize("activation", ["silu", None])
def test_causal_conv1d_update_matches_the_explicit_sum(activation):
    reads, writes = [0, 2, 3, 3], [1, 2, 6, 7]
    x, w, conv_state = conv_inputs(len(reads), seed=1)
    before = conv_state.clone()
    y = ops.causal_conv1d_update(x, w, conv_state, slots(reads), slots(writes), activation=activation)
    for b, (r, wr) in enumerate(zip(reads, writes)):
        want_y, want_tail = naive_conv(initial(before, r), x[b:b + 1], w, activation)
        close(y[b], want_y[0])
        assert torch.equal(conv_state[wr], want_tail.float())
    assert_only_written(before, conv_state, writes)


@pytest.mark.parametrize("fresh", [True, False])
def test_causal_conv1d_split_anywhere_equals_one_shot(fresh):
    n = 9
    x, w, conv_state = conv_inputs(n, seed=2)
    start = slots([0 if fresh else 1])
    want = ops.causal_conv1d(x, w, cu([n]), conv_state, start, slots([2]))
    for split in range(n + 1):  # includes first parts shorter than KW-1
        pool = conv_state.clone()
        first = ops.causal_conv1d(x[:split], w, cu([split]), pool, start, slots([3]))
        after_first = pool.clone()
        rest = ops.causal_conv1d(x[split:], w, cu([n - split]), pool, slots([3]), slots([3]))
        close(torch.cat((first, rest)), want, 1e-6)
        assert torch.equal(pool[3], conv_state[2])
        pool[3] = after_first[3]  # the rest again, decoded token by token in place
        decoded = [ops.causal_conv1d_update(x[t:t + 1], w, pool, slots([3]), slots([3])) for t in range(split, n)]
        close(torch.cat([first, *decoded]), want, 1e-6)
        assert torch.equal(pool[3], conv_state[2])


def test_causal_conv1d_write_columns_keep_the_history_after_each_of_the_last_tokens():
    """Write slots [B, W]: column i gets the last KW-1 inputs up to token L - W + i (history rows before the first
    new token), packed (causal_conv1d) and over [B, L] tokens (causal_conv1d_update), equal to the explicit sum."""
    W, L = 4, 3
    x, w, conv_state = conv_inputs(2 * L, seed=4)
    reads, writes = [0, 1], [[2, 3, 4, 5], [6, 7, 0, 1]]  # seq 1 rewrites its own slot 1 last
    before = conv_state.clone()
    y = ops.causal_conv1d(x, w, cu([L, L]), conv_state, slots(reads), slots(writes))
    packed = conv_state.clone()
    conv_state.copy_(before)
    y2 = ops.causal_conv1d_update(x.view(2, L, C), w, conv_state, slots(reads), slots(writes))
    assert torch.equal(conv_state, packed)
    close(y2.reshape(2 * L, C), y)
    for b, (r, ws) in enumerate(zip(reads, writes)):
        rows = x[b * L:(b + 1) * L]
        for i, slot in enumerate(ws):
            n = L - W + i + 1  # new tokens the history in column i has seen (0: none, -1: not one of the history's)
            if slot and n >= 0:
                want = naive_conv(initial(before, r), rows[:n], w, "silu")[1]
                assert torch.equal(conv_state[slot], want.float())
    close(y, torch.cat([naive_conv(initial(before, r), x[b * L:(b + 1) * L], w, "silu")[0]
                        for b, r in enumerate(reads)]))


def test_causal_conv1d_write_slot_zero_is_dropped():
    x, w, conv_state = conv_inputs(4, seed=3)
    before = conv_state.clone()
    ops.causal_conv1d(x, w, cu([3, 1]), conv_state, slots([1, 0]), slots([0, 0]))
    ops.causal_conv1d_update(x[:2], w, conv_state, slots([0, 2]), slots([0, 0]))
    assert torch.equal(conv_state, before)


@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
def test_causal_conv1d_bf16_keeps_the_state_dtype(state_dtype):
    x, w, conv_state = conv_inputs(7, seed=4)
    x16, conv_state = x.bfloat16(), conv_state.to(state_dtype)
    pool32 = conv_state.float()
    y = ops.causal_conv1d(x16, w, cu([7]), conv_state, slots([1]), slots([2]))
    y32 = ops.causal_conv1d(x16.float(), w, cu([7]), pool32, slots([1]), slots([2]))
    assert y.dtype == torch.bfloat16 and conv_state.dtype == state_dtype
    assert torch.equal(y, y32.bfloat16()) and torch.equal(conv_state[2].float(), pool32[2])


# ---------------------------------------------------------------- NPU backend


def test_npu_backend_runs_the_references(emu):
    assert set(KDA_OPS) <= set(ops.OPS)
    for name in KDA_OPS:
        assert getattr(ops, name) is getattr(ref, name)
    x, w, conv_state = conv_inputs(3)
    ops.causal_conv1d(x, w, cu([3]), conv_state, slots([0]), slots([1]))
    assert emu.calls == []
