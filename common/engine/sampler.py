"""Next-token sampling for a batch of requests with their own SamplingParams.

Greedy rows take the argmax (ties: the lowest id). The others divide by their temperature, keep their top-k logits,
then their nucleus (the smallest set of the most likely tokens whose probability sums to >= top_p, computed on the
top-k renormalised distribution, as vLLM does), and sample by the exponential race: argmax(probs / E) with
E ~ Exponential(1) is a draw from probs, with no torch.multinomial and no host sync. A row with a seed draws its E
from its own torch.Generator (make_generator, kept by the caller across steps), so its tokens depend on its seed
alone, not on its batch position or companions; the other rows draw from the sampler's generator (default: the
global RNG).

Logprobs are the log_softmax of the raw logits, before temperature / top-k / top-p (vLLM's default "raw_logprobs"):
they describe the model, not the sampling settings, and a greedy row gets the same numbers as a sampled one.
"""
from dataclasses import dataclass

import torch

from .sampling_params import SamplingParams

LOGPROB_FLOOR = -9999.0  # a log-prob of a token the request's grammar forbids (-inf is not JSON), vLLM's floor


def make_generator(seed: int | None, device: torch.device | str = "cpu") -> torch.Generator | None:
    """The per-request RNG for a seeded request (None without a seed: the row uses the global RNG)."""
    if seed is None:
        return None
    return torch.Generator(device=device).manual_seed(seed % 2**64)  # any int, as torch maps negative seeds


@dataclass
class TokenLogprobs:
    token_id: int  # the sampled token
    logprob: float  # its log_softmax(raw logits)
    top: list[tuple[int, float]]  # the request's `logprobs` largest (token_id, logprob), best first


@dataclass
class SamplerOutput:
    token_ids: list[int]  # [B]
    logprobs: list[TokenLogprobs | None] | None = None  # [B], None for rows that did not ask; None if none asked


class Sampler:
    """generator: what rows without a seed draw from (None: torch's global RNG). Ranks that must sample alike
    (attention-TP peers, which hold the same logits) pass generators seeded alike."""

    def __init__(self, generator: torch.Generator | None = None):
        self.generator = generator

    def __call__(self, logits: torch.Tensor, params: list[SamplingParams],
                 generators: list[torch.Generator | None] | None = None) -> SamplerOutput:
        logits = logits.float()  # [B, V]
        generators = generators or [None] * len(params)
        assert logits.size(0) == len(params) == len(generators)
        token_ids = self.sample(logits, params, generators)  # [B]
        if all(p.logprobs is None for p in params):
            return SamplerOutput(token_ids.tolist())
        return SamplerOutput(*self.logprobs(logits, token_ids, params))

    def sample(self, logits, params, generators) -> torch.Tensor:
        greedy = [p.greedy for p in params]
        if all(greedy):
            return logits.argmax(dim=-1)
        probs = target_probs(logits, params)  # [B, V]
        noise = torch.empty_like(probs)  # [B, V] ~ Exponential(1)
        seeded = [i for i, (g, gen) in enumerate(zip(greedy, generators)) if not g and gen is not None]
        if len(seeded) < len(params):
            noise.exponential_(generator=self.generator)
        for i in seeded:
            noise[i].exponential_(generator=generators[i])
        sampled = probs.div_(noise.clamp_min_(1e-10)).argmax(dim=-1)  # [B]
        if not any(greedy):
            return sampled
        return torch.where(torch.tensor(greedy, device=logits.device), logits.argmax(dim=-1), sampled)

    def skip(self, params: SamplingParams, generator: torch.Generator | None, vocab_size: int) -> None:
        """Advance a row's own generator as `sample` does for one of its tokens drawn elsewhere (PD: the prefill
        instance sampled the first token), so a seeded request's later tokens are those of a colocated run."""
        if generator is not None and not params.greedy:
            torch.empty(vocab_size, dtype=torch.float32, device=generator.device).exponential_(generator=generator)

    def verify(self, logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None,
               drafts: list[int]) -> list[int]:
        """Speculative sampling of one sampled request: logits [k + 1, V] of its verify rows, drafts [k] proposed
        deterministically (the MTP's argmax: q is one-hot) -> the committed tokens, the accepted drafts then one.
        Draft i is accepted with probability min(1, p_i(d) / q(d)) = p_i(d), p_i the row's distribution after
        temperature / top-k / top-p; at the first rejection the token is drawn from the residual norm(max(p_i - q,
        0)), p_i without d renormalised; all accepted: one more from p_k. Each committed token is then distributed
        as p (P(d) = p(d), P(x != d) = (1 - p(d)) p(x) / (1 - p(d))): the plain sampler's distribution."""
        generator = generator if generator is not None else self.generator
        probs = target_probs(logits.float(), [params] * logits.shape[0])  # [k + 1, V]
        u = torch.rand(len(drafts), generator=generator, device=logits.device).tolist()
        out = []
        for i, d in enumerate(drafts):
            if u[i] < probs[i, d].item():
                out.append(d)
                continue
            residual = probs[i].clone()
            residual[d] = 0
            return out + [_race(residual, generator)]
        return out + [_race(probs[len(drafts)], generator)]

    def logprobs(self, logits, token_ids, params) -> tuple[list[int], list[TokenLogprobs | None]]:
        asked = [p.logprobs for p in params]
        return token_ids.tolist(), token_logprobs(logits, token_ids, asked)


def target_probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Each row's sampling distribution [B, V]: softmax(logits / temperature) over its top-k / top-p (greedy rows:
    temperature 1, no cut; they take the argmax)."""
    B, V = logits.shape
    device = logits.device
    greedy = [p.greedy for p in params]
    temperature = torch.tensor([1.0 if g else p.temperature for p, g in zip(params, greedy)], device=device)
    scaled = logits / temperature[:, None]  # [B, V]
    top_k = [V if g or p.top_k < 0 else min(p.top_k, V) for p, g in zip(params, greedy)]
    top_p = [1.0 if g else p.top_p for p, g in zip(params, greedy)]
    if any(k < V for k in top_k) or any(p < 1 for p in top_p):
        scaled = apply_top_k_top_p(scaled, torch.tensor(top_k, device=device), torch.tensor(top_p, device=device))
    return scaled.softmax(dim=-1)


def _race(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    """One draw from probs [V] (unnormalised is fine): the exponential race, as Sampler.sample."""
    noise = torch.empty_like(probs).exponential_(generator=generator)
    return int((probs / noise.clamp_min_(1e-10)).argmax())


def token_logprobs(logits: torch.Tensor, token_ids: torch.Tensor, num_top: list[int | None]) -> list[TokenLogprobs | None]:
    """Row i: token_ids[i]'s log_softmax(logits[i]) and the num_top[i] largest, best first (None: row not asked).
    logits [B, V], token_ids [B]. Prompt log-probs use it with token_ids = the next prompt tokens."""
    logprobs = logits.float().log_softmax(dim=-1).clamp_(min=LOGPROB_FLOOR)  # [B, V], raw logits (module docstring)
    chosen = logprobs.gather(1, token_ids[:, None]).squeeze(1)  # [B]
    n = max((k or 0 for k in num_top), default=0)
    top_values, top_ids = logprobs.topk(n, dim=-1)  # [B, n], sorted descending
    ids, chosen, top_ids, top_values = token_ids.tolist(), chosen.tolist(), top_ids.tolist(), top_values.tolist()
    return [None if k is None else TokenLogprobs(ids[i], chosen[i], list(zip(top_ids[i][:k], top_values[i][:k])))
            for i, k in enumerate(num_top)]


def apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Set to -inf the logits outside each row's top_k (exactly k tokens, ties to the lower id), then outside the
    nucleus of what is left: a token stays if the tokens ranked above it sum to < top_p (so the top one always does;
    top_p = 1 keeps all, whatever the rounding of the sum).
    logits [B, V], top_k [B] in [1, V], top_p [B] in (0, 1]."""
    sorted_logits, order = logits.sort(dim=-1, descending=True, stable=True)  # [B, V]
    ranks = torch.arange(logits.size(-1), device=logits.device)  # [V]
    sorted_logits.masked_fill_(ranks[None, :] >= top_k[:, None], float("-inf"))
    probs = sorted_logits.softmax(dim=-1)  # [B, V]
    mass_above = probs.cumsum(dim=-1) - probs  # [B, V]
    sorted_logits.masked_fill_((mass_above >= top_p[:, None]) & (top_p[:, None] < 1), float("-inf"))  # 1: off
    return torch.empty_like(logits).scatter_(-1, order, sorted_logits)
