"""Sampler.verify, the speculative-sampling rule with deterministic (one-hot) drafts: every committed token is
distributed as the plain sampler's p (temperature, top-k applied). Chi-square goodness of fit over 10,000 draws;
the bound is the 1e-4 upper quantile for the degrees of freedom (support size - 1), so a correct rule fails it once
in 10,000 seeds, and a fixed seed makes the test deterministic."""
import pytest
import torch

from common.engine import SamplingParams
from common.engine.sampler import Sampler, target_probs

N = 10_000
CHI2_1E4 = {3: 21.1, 4: 23.5, 5: 25.7}  # scipy.stats.chi2.ppf(1 - 1e-4, dof)


def chi2(counts: torch.Tensor, probs: torch.Tensor) -> tuple[float, int]:
    support = probs > 0
    assert counts[~support].sum() == 0  # nothing outside the top-k
    expected = probs[support] * counts.sum()
    return float(((counts[support] - expected) ** 2 / expected).sum()), int(support.sum()) - 1


@pytest.mark.parametrize("drafts", [[2, 0], [5, 5], [4, 1]], ids=["likely", "outside-top-k", "unlikely"])
def test_committed_tokens_follow_the_target_distribution(drafts):
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 6, generator=g) * 1.5  # rows for draft 1, draft 2, the bonus
    params = SamplingParams(temperature=0.9, top_k=5)
    p = target_probs(logits, [params] * 3)  # [3, 6]
    sampler, gen = Sampler(), torch.Generator().manual_seed(1)
    first, second, lengths = torch.zeros(6), torch.zeros(6), torch.zeros(3)
    for _ in range(N):
        tokens = sampler.verify(logits, params, gen, drafts)
        assert 1 <= len(tokens) <= 3 and tokens[:-1] == drafts[: len(tokens) - 1]
        first[tokens[0]] += 1
        lengths[len(tokens) - 1] += 1
        if len(tokens) > 1:  # the first draft was accepted: the next token ~ p_1
            second[tokens[1]] += 1
    stat, dof = chi2(first, p[0])
    assert stat < CHI2_1E4[dof], (stat, dof)
    accepted = p[0, drafts[0]].item()  # P(draft 1 accepted) = p_0(d_1)
    assert abs(lengths[1:].sum().item() / N - accepted) < 4 * (accepted * (1 - accepted) / N) ** 0.5 + 1e-9
    if second.sum() > 500:
        stat, dof = chi2(second, p[1])
        assert stat < CHI2_1E4[dof], (stat, dof)
