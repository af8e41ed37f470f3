"""Offline batch inference: `LLM(model, tokenizer, **engine_kwargs).generate(prompts, sampling_params)`.

Over several attention-DP ranks every rank is handed the same prompts; each prompt goes to the least-loaded DP
rank (prompt + output tokens assigned so far, the same decision on every rank, so no rank needs to ask), the
ranks step in lock-step until all are done, and every rank returns every output.
"""
from __future__ import annotations

from tqdm.auto import tqdm

from common import parallel as par

from .config import EngineConfig
from .llm_engine import LLMEngine, RequestOutput
from .sampling_params import SamplingParams


class LLM:
    def __init__(self, model, tokenizer, config: EngineConfig | None = None, **engine_kwargs):
        if config is None:
            config, rest = EngineConfig.from_kwargs(**engine_kwargs)
            if rest:
                raise TypeError(f"unknown engine arguments: {sorted(rest)}")
        elif engine_kwargs:
            raise TypeError("pass either an EngineConfig or engine keyword arguments, not both")
        self.engine = LLMEngine(model, tokenizer, config)

    def generate(self, prompts: list[str] | list[list[int]] | list[dict],
                 sampling_params: SamplingParams | list[SamplingParams] | None = None, use_tqdm: bool = True,
                 add_special_tokens: bool = True) -> list[RequestOutput]:
        """Generate for every prompt (text, token ids, or a multimodal prompt dict: LLMEngine.make_request); outputs
        in prompt order. Text prompts get the tokenizer's special tokens (its BOS) unless add_special_tokens is False
        (vLLM: tokenization_kwargs={"add_special_tokens": False}), for text that already carries them, such as a
        rendered chat prompt."""
        params = sampling_params or SamplingParams()
        params = params if isinstance(params, list) else [params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(params)} sampling params")
        engine = self.engine
        requests = [engine.make_request(p, sp, add_special_tokens=add_special_tokens)  # checked alike on every rank
                    for p, sp in zip(prompts, params)]
        balance = LeastLoaded(par.group_size(engine.dp_group))
        mine = {r.request_id: i for i, r in enumerate(requests)
                if balance.assign(r.request_id, request_cost(r)) == par.group_rank(engine.dp_group)}
        for r in requests:
            if r.request_id in mine:
                engine.add(r)
        done: dict[int, RequestOutput] = {}
        show = use_tqdm and engine.parallel.rank == 0
        with tqdm(total=len(mine), desc="generate", unit="req", disable=not show) as bar:
            while engine.has_unfinished_anywhere():
                for out in engine.step():
                    if out.finished:
                        done[mine[out.request_id]] = out
                        bar.update(1)
        for part in par.all_gather_object(done, engine.dp_group):
            done.update(part)
        return [done[i] for i in range(len(requests))]


class LeastLoaded:
    """The DP coordinator's rule: each new request goes to the rank with the least outstanding cost (prompt +
    output tokens; ties: the lowest rank); `done` takes a request's cost back."""

    def __init__(self, num_ranks: int):
        self.load = [0] * num_ranks
        self.owners: dict[str, tuple[int, int]] = {}  # request id -> (rank, cost)

    def assign(self, request_id: str, cost: int) -> int:
        rank = min(range(len(self.load)), key=self.load.__getitem__)
        self.load[rank] += cost
        self.owners[request_id] = rank, cost
        return rank

    def done(self, request_id: str) -> None:
        if (entry := self.owners.pop(request_id, None)) is not None:
            self.load[entry[0]] -= entry[1]


def request_cost(req) -> int:
    """What a request weighs for the DP balance: the tokens it can hold at most."""
    return req.num_prompt_tokens + req.sampling_params.max_tokens
