"""OpenAI request bodies for /v1/completions and /v1/chat/completions (vLLM's field names), checked strictly:
ints are ints, numbers are numbers, ranges as OpenAI documents them. Unknown fields are ignored, as OpenAI clients
send some. Each request turns into the engine's SamplingParams."""
from __future__ import annotations

from typing import Annotated, Any, Union

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr

from common.engine import SamplingParams
from common.engine.sampling_params import MAX_LOGPROBS

Number = Annotated[float, Field(strict=True, allow_inf_nan=False)]
MaxTokens = Annotated[StrictInt, Field(ge=1)]
Stop = Union[StrictStr, list[StrictStr], None]


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    include_usage: StrictBool = False


class _Sampling(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: StrictStr | None = None
    max_tokens: MaxTokens | None = None
    temperature: Annotated[Number, Field(ge=0)] | None = None
    top_p: Annotated[Number, Field(gt=0, le=1)] | None = None
    top_k: Annotated[StrictInt, Field(ge=-1)] | None = None  # extension
    n: Annotated[StrictInt, Field(ge=1, le=8)] = 1
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    stop: Stop = None
    seed: StrictInt | None = None
    ignore_eos: StrictBool = False  # extension

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def _params(self, max_tokens: int, logprobs: int | None, seed: int | None) -> SamplingParams:
        return SamplingParams(temperature=1.0 if self.temperature is None else self.temperature,
                              top_p=1.0 if self.top_p is None else self.top_p,
                              top_k=-1 if self.top_k is None else self.top_k, seed=seed, max_tokens=max_tokens,
                              stop=self.stop, ignore_eos=self.ignore_eos, logprobs=logprobs)


class CompletionRequest(_Sampling):
    prompt: Union[StrictStr, list[StrictInt], list[StrictStr], list[list[StrictInt]]]
    logprobs: Annotated[StrictInt, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    echo: StrictBool = False

    @property
    def prompts(self) -> list[str | list[int]]:
        p = self.prompt
        return [p] if isinstance(p, str) or (p and isinstance(p[0], int)) or not p else list(p)

    def sampling_params(self, prompt_len: int, max_model_len: int, index: int = 0) -> SamplingParams:
        del prompt_len, max_model_len  # OpenAI's completions default: 16 tokens
        seed = None if self.seed is None else self.seed + index
        return self._params(self.max_tokens or 16, self.logprobs, seed)


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: StrictStr
    content: Union[StrictStr, list[dict[str, Any]], None] = None

    def as_template_input(self) -> dict[str, str]:
        content = self.content
        if isinstance(content, list):  # [{"type": "text", "text": ...}, ...]: the text parts, joined
            content = "".join(str(part.get("text", "")) for part in content if part.get("type") == "text")
        return {"role": self.role, "content": content or ""}


class ChatCompletionRequest(_Sampling):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: MaxTokens | None = None
    logprobs: StrictBool = False
    top_logprobs: Annotated[StrictInt, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    chat_template_kwargs: dict[str, Any] | None = None  # extension (vLLM): e.g. {"thinking": true}

    def sampling_params(self, prompt_len: int, max_model_len: int, index: int = 0) -> SamplingParams:
        max_tokens = self.max_completion_tokens or self.max_tokens or max(1, max_model_len - prompt_len)
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        seed = None if self.seed is None else self.seed + index
        return self._params(max_tokens, logprobs, seed)

