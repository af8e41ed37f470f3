"""Offline batch inference: `LLM(model, tokenizer, **engine_kwargs).generate(prompts, sampling_params)`."""
from __future__ import annotations

from tqdm.auto import tqdm

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

    def generate(self, prompts: list[str] | list[list[int]], sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """Generate for every prompt (text or token ids); outputs in prompt order."""
        params = sampling_params or SamplingParams()
        params = params if isinstance(params, list) else [params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(params)} sampling params")
        ids = [self.engine.add_request(p, sp) for p, sp in zip(prompts, params)]
        done: dict[str, RequestOutput] = {}
        with tqdm(total=len(ids), desc="generate", unit="req", disable=not use_tqdm) as bar:
            while self.engine.has_unfinished():
                for out in self.engine.step():
                    if out.finished:
                        done[out.request_id] = out
                        bar.update(1)
        return [done[i] for i in ids]

    def apply_chat_template(self, messages: list[dict], **kwargs) -> str:
        return self.engine.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False, **kwargs)
