"""Sampler and SamplingParams against the definitions, written here: argmax, softmax(logits / T), the k largest
logits, the nucleus. Every random draw is seeded, so a statistical check gives the same numbers on every run; the
tolerances are still many standard deviations wide."""
import pytest
import torch

from common.engine.sampler import Sampler, make_generator
from common.engine.sampling_params import SamplingParams

sampler = Sampler()


def draw(logits: torch.Tensor, params: SamplingParams, n: int, seed: int = 0) -> torch.Tensor:
    """n draws from one row, batched as n identical rows on the global RNG."""
    torch.manual_seed(seed)
    return torch.tensor(sampler(logits.expand(n, -1), [params] * n).token_ids)  # [n]


def frequencies(tokens: torch.Tensor, V: int) -> torch.Tensor:
    return tokens.bincount(minlength=V).double() / len(tokens)  # [V]


def allowed(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> tuple[set[int], torch.Tensor]:
    """From the definitions, in float64: the tokens that may be sampled and the distribution over them."""
    logits = logits.double() / temperature
    order = logits.argsort(descending=True, stable=True).tolist()
    kept = order[:top_k] if top_k > 0 else order
    probs = logits[kept].softmax(-1)  # renormalised over the top k, sorted descending
    cum = probs.cumsum(-1)
    size = next(i + 1 for i in range(len(kept)) if cum[i] >= top_p or i == len(kept) - 1)  # smallest nucleus
    dist = torch.zeros_like(logits)
    dist[kept[:size]] = probs[:size] / probs[:size].sum()
    return set(kept[:size]), dist


def test_greedy_is_argmax_lowest_id_on_ties():
    torch.manual_seed(0)
    logits = torch.randn(6, 100)
    logits[1, [7, 42]] = 10.0  # a tie: argmax takes 7
    params = [SamplingParams(temperature=0), SamplingParams(temperature=0), SamplingParams(top_k=1, temperature=5),
              SamplingParams(temperature=1e-6), SamplingParams(temperature=0, top_p=0.1), SamplingParams(top_k=1)]
    assert all(p.greedy for p in params)
    assert sampler(logits, params).token_ids == logits.argmax(-1).tolist()
    assert sampler(logits, params).token_ids[1] == 7
    mixed = params[:2] + [SamplingParams(temperature=1.0)] * 4  # greedy rows beside sampled ones
    assert sampler(logits, mixed).token_ids[:2] == logits[:2].argmax(-1).tolist()
    assert not SamplingParams().greedy


@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
def test_temperature_matches_softmax(temperature):
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0])
    freq = frequencies(draw(logits, SamplingParams(temperature=temperature), 200_000), 5)
    expected = (logits.double() / temperature).softmax(-1)
    assert (freq - expected).abs().max() < 0.01  # std <= 0.0012 at n = 200k
    assert (expected - logits.double().softmax(-1)).abs().max() > 0.05 or temperature == 1.0  # T visibly matters


def test_seeded_rows_reproducible_across_steps_positions_and_companions():
    torch.manual_seed(0)
    steps = torch.randn(8, 1000)  # the logits of one request over 8 steps

    def run(position: int, companions: list[SamplingParams], global_seed: int, seed: int = 1234) -> list[int]:
        params = SamplingParams(temperature=1.5, top_p=0.95, top_k=200, seed=seed)
        torch.manual_seed(global_seed)  # must not matter to the seeded row
        rows = companions[:position] + [params] + companions[position:]
        generators = [make_generator(p.seed) for p in rows]
        tokens = []
        for logits in steps:
            batch = torch.randn(len(rows), 1000)
            batch[position] = logits
            tokens.append(sampler(batch, rows, generators).token_ids[position])
        return tokens

    alone = run(0, [], 0)
    others = [SamplingParams(), SamplingParams(temperature=0), SamplingParams(seed=7, top_k=5),
              SamplingParams(temperature=0.3, top_p=0.5), SamplingParams(seed=1234, temperature=0.1)]
    assert run(2, others, 1) == alone
    assert run(5, others, 2) == alone
    assert run(0, [SamplingParams(temperature=1.5, top_p=0.95, top_k=200, seed=1234)] * 3, 3) == alone  # same seed
    other_seeds = [run(0, [], 0, seed) for seed in (1, 2, 3)]
    assert all(tokens != alone for tokens in other_seeds) and len(set(map(tuple, other_seeds))) == 3
    assert make_generator(None) is None
    assert make_generator(-1).initial_seed() == 2**64 - 1


def test_unseeded_rows_follow_the_global_rng():
    logits = torch.zeros(4, 1000)
    params = [SamplingParams()] * 4
    torch.manual_seed(5)
    first = sampler(logits, params).token_ids
    torch.manual_seed(5)
    assert sampler(logits, params).token_ids == first
    assert sampler(logits, params).token_ids != first


def test_top_k_stays_in_the_k_largest():
    torch.manual_seed(0)
    V, n = 50, 4000
    logits = torch.randn(V)
    top_ks = [1, 2, 5, 17, 50, 100, -1, 0]
    params = [SamplingParams(temperature=10.0, top_k=k) for k in top_ks]  # hot: would leave the top k if unmasked
    torch.manual_seed(1)
    tokens = torch.tensor(sampler(logits.expand(n * len(params), -1), params * n).token_ids).view(n, len(params))
    for j, k in enumerate(top_ks):
        k_largest = set(logits.topk(k if 0 < k <= V else V).indices.tolist())
        assert set(tokens[:, j].tolist()) == k_largest  # inside, and each of the k is reached at T = 10


@pytest.mark.parametrize("top_p", [0.05, 0.3, 0.6, 0.9, 0.99])
def test_top_p_stays_in_the_nucleus(top_p):
    torch.manual_seed(0)
    logits = torch.randn(64) * 2
    tokens = draw(logits, SamplingParams(temperature=0.8, top_p=top_p), 20_000, seed=1)
    nucleus, dist = allowed(logits, 0.8, -1, top_p)
    assert set(tokens.tolist()) <= nucleus
    assert (frequencies(tokens, 64) - dist).abs().max() < 0.02  # std <= 0.0036 at n = 20k


def test_top_p_per_row_thresholds_in_one_batch():
    torch.manual_seed(0)
    V, n = 64, 2000
    logits = torch.randn(V) * 2
    top_ps = [0.05, 0.5, 0.9, 1.0]
    params = [SamplingParams(temperature=0.8, top_p=p) for p in top_ps]
    torch.manual_seed(1)
    tokens = torch.tensor(sampler(logits.expand(n * len(params), -1), params * n).token_ids).view(n, len(params))
    for j, p in enumerate(top_ps):
        assert set(tokens[:, j].tolist()) <= allowed(logits, 0.8, -1, p)[0]


@pytest.mark.parametrize("top_k, top_p", [(10, 0.8), (3, 0.99), (30, 0.5), (1000, 0.7)])
def test_top_k_then_top_p(top_k, top_p):
    torch.manual_seed(0)
    logits = torch.randn(128) * 1.5
    tokens = draw(logits, SamplingParams(temperature=1.3, top_k=top_k, top_p=top_p), 20_000, seed=2)
    nucleus, dist = allowed(logits, 1.3, top_k, top_p)
    assert set(tokens.tolist()) <= nucleus
    assert (frequencies(tokens, 128) - dist).abs().max() < 0.02


def test_logprobs_of_raw_logits():
    torch.manual_seed(0)
    logits = torch.randn(5, 300) * 3
    params = [SamplingParams(temperature=0.7, logprobs=5), SamplingParams(temperature=0, logprobs=0),
              SamplingParams(), SamplingParams(top_k=3, top_p=0.5, logprobs=20, seed=3), SamplingParams(logprobs=1)]
    out = sampler(logits, params, [make_generator(p.seed) for p in params])
    reference = logits.double().log_softmax(-1)  # [B, V], before temperature / top-k / top-p
    assert out.logprobs[2] is None
    for i, p in enumerate(params):
        if p.logprobs is None:
            continue
        row = out.logprobs[i]
        assert row.token_id == out.token_ids[i]
        assert row.logprob == pytest.approx(reference[i, row.token_id].item(), abs=1e-5)
        assert len(row.top) == p.logprobs
        assert [t for t, _ in row.top] == reference[i].topk(p.logprobs).indices.tolist()
        assert [v for _, v in row.top] == sorted((v for _, v in row.top), reverse=True)
        assert all(v == pytest.approx(reference[i, t].item(), abs=1e-5) for t, v in row.top)
    assert sampler(logits, [SamplingParams()] * 5).logprobs is None


@pytest.mark.parametrize("field, value", [
    ("temperature", -0.1), ("temperature", float("nan")), ("temperature", "1"), ("top_p", 0.0), ("top_p", 1.5),
    ("top_k", -2), ("top_k", 2.5), ("max_tokens", -1), ("prompt_logprobs", 21), ("logprobs", -1), ("logprobs", 21), ("seed", 1.5),
    ("stop", ""), ("stop", ["ok", ""]), ("stop", 3), ("stop_token_ids", [1, "2"]), ("stop_token_ids", [-1]),
    ("ignore_eos", 1),
])
def test_sampling_params_errors_name_the_field(field, value):
    with pytest.raises(ValueError, match=rf"SamplingParams\.{field} "):
        SamplingParams(**{field: value})


def test_sampling_params_normalised():
    p = SamplingParams(stop="###", top_k=0, temperature=1)
    assert p.stop == ["###"] and p.stop_token_ids == [] and p.top_k == -1
    assert SamplingParams(stop=("a", "b"), stop_token_ids=(2,)).stop == ["a", "b"]
    assert SamplingParams().stop == [] and SamplingParams(logprobs=20).logprobs == 20
