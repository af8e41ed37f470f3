"""OpenAI request bodies for /v1/completions and /v1/chat/completions (vLLM's field names), checked strictly:
ints are ints, numbers are numbers, ranges as OpenAI documents them. Each request turns into the engine's
SamplingParams.

A field is honoured or refused, never accepted and ignored. An unknown field is refused ("foo: unrecognized request
argument", as OpenAI does). The documented OpenAI fields this server does not honour (tool calling, structured
output, penalties, logit_bias, suffix, best_of, audio, ...) are declared and refused whenever they carry anything
but their no-op value (the defaults clients commonly send: null, 0, [], {}, "none", {"type": "text"}, ...). Each
refusal is a pydantic error at the field's location, so the server's validation handler answers 400 with
`param` = that path and a message naming it. Extensions honoured (vLLM's names): top_k, ignore_eos,
chat_template_kwargs, stream_options.include_usage."""
from __future__ import annotations

from collections.abc import Iterator
from typing import Annotated, Any, Callable, ClassVar, Union

from pydantic import (BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr, ValidationError,
                      model_validator)
from pydantic_core import InitErrorDetails, PydanticCustomError

from common.engine import SamplingParams
from common.engine.sampling_params import MAX_LOGPROBS

Number = Annotated[float, Field(strict=True, allow_inf_nan=False)]
MaxTokens = Annotated[StrictInt, Field(ge=1)]
Stop = Union[StrictStr, list[StrictStr], None]
UNRECOGNIZED = "unrecognized request argument"
CHAT_ROLES = ("system", "user", "assistant")  # what the chat templates served here render
Refusal = tuple[tuple, str]  # (location inside the model, message)


def _error(title: str, errors: list[tuple[str, tuple, str, Any]]) -> ValidationError:
    """A ValidationError of (type, loc, message, input) entries; raised inside a validator, it keeps each loc
    (nested models get their parents' locations prefixed)."""
    return ValidationError.from_exception_data(title, [
        InitErrorDetails(type=PydanticCustomError(kind, "{message}", {"message": message}), loc=loc, input=value)
        for kind, loc, message, value in errors])


def _unsupported(what: str, accepted: str) -> str:
    """what: the subject and its verb ("tool calling is"), or "" (the field's name, which the message follows)."""
    return f"{what + ' ' if what else ''}not supported by this server; only {accepted} is accepted"


class _Strict(BaseModel):
    """Unknown fields refused; `_refusals` yields the declared fields whose values this server does not honour."""
    model_config = ConfigDict(extra="forbid")
    # (field, is its value a no-op? (value, model), the message otherwise): checked once the fields parse
    UNSUPPORTED: ClassVar[tuple[tuple[str, Callable[[Any, Any], bool], str], ...]] = ()

    def _refusals(self) -> Iterator[Refusal]:
        for name, ok, message in self.UNSUPPORTED:
            if not ok(getattr(self, name), self):
                yield (name,), message

    @model_validator(mode="wrap")
    @classmethod
    def _honoured_or_refused(cls, data, handler):
        try:
            model = handler(data)
        except ValidationError as e:
            errors = e.errors(include_url=False)
            if not any(err["type"] == "extra_forbidden" for err in errors):
                raise
            raise _error(e.title, [(err["type"], err["loc"], UNRECOGNIZED if err["type"] == "extra_forbidden"
                                    else err["msg"], err.get("input")) for err in errors]) from None
        refusals = list(model._refusals())
        if refusals:
            raise _error(cls.__name__, [("unsupported", loc, message, getattr(model, loc[0]))
                                        for loc, message in refusals])
        return model


def _is_zero(v, _) -> bool:
    return v is None or v == 0


def _is_none(v, _) -> bool:
    return v is None


def _is_empty(v, _) -> bool:
    return not v  # null, [] or {}


def _is_none_choice(v, _) -> bool:
    return v is None or v == "none"


class StreamOptions(_Strict):
    include_usage: StrictBool = False


class _Sampling(_Strict):
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
    user: StrictStr | None = None  # an opaque end-user id (OpenAI uses it for abuse monitoring): nothing to do
    # refused unless no-op
    frequency_penalty: Number | None = None
    presence_penalty: Number | None = None
    logit_bias: dict[StrictStr, Number] | None = None

    UNSUPPORTED = (
        ("frequency_penalty", _is_zero, _unsupported("", "0 or null")),
        ("presence_penalty", _is_zero, _unsupported("", "0 or null")),
        ("logit_bias", _is_empty, _unsupported("", "null or {}")),
    )

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    @property
    def stop_strings(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    def _params(self, max_tokens: int, logprobs: int | None, seed: int | None,
                prompt_logprobs: int | None = None) -> SamplingParams:
        return SamplingParams(temperature=1.0 if self.temperature is None else self.temperature,
                              top_p=1.0 if self.top_p is None else self.top_p,
                              top_k=-1 if self.top_k is None else self.top_k, seed=seed, max_tokens=max_tokens,
                              stop=self.stop, ignore_eos=self.ignore_eos, logprobs=logprobs,
                              prompt_logprobs=prompt_logprobs)


class CompletionRequest(_Sampling):
    prompt: Union[StrictStr, list[StrictInt], list[StrictStr], list[list[StrictInt]]]
    max_tokens: Annotated[StrictInt, Field(ge=0)] | None = None  # 0: only with echo (score the prompt)
    logprobs: Annotated[StrictInt, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    echo: StrictBool = False
    # refused unless no-op
    best_of: Annotated[StrictInt, Field(ge=1)] | None = None
    suffix: StrictStr | None = None

    UNSUPPORTED = _Sampling.UNSUPPORTED + (
        ("best_of", lambda v, r: v is None or v == r.n, _unsupported("", "null or best_of == n")),
        ("suffix", _is_empty, _unsupported("insertion (suffix) is", 'null or ""')),
    )

    def _refusals(self) -> Iterator[Refusal]:
        if self.max_tokens == 0 and not self.echo:
            yield ("max_tokens",), ("0 (generate nothing) is allowed only with echo: true, to score the prompt; "
                                    "otherwise max_tokens must be >= 1")
        yield from super()._refusals()

    @property
    def prompts(self) -> list[str | list[int]]:
        p = self.prompt
        return [p] if isinstance(p, str) or (p and isinstance(p[0], int)) or not p else list(p)

    def sampling_params(self, prompt_len: int, max_model_len: int, index: int = 0) -> SamplingParams:
        del prompt_len, max_model_len  # OpenAI's completions default: 16 tokens
        seed = None if self.seed is None else self.seed + index
        prompt_logprobs = self.logprobs if self.echo and self.logprobs is not None else None
        return self._params(16 if self.max_tokens is None else self.max_tokens, self.logprobs, seed,
                            prompt_logprobs)


class ChatMessage(_Strict):
    role: StrictStr
    content: Union[StrictStr, list[dict[str, Any]], None] = None
    # refused unless no-op
    name: StrictStr | None = None
    tool_calls: list[Any] | None = None
    tool_call_id: StrictStr | None = None
    function_call: Any = None
    refusal: StrictStr | None = None

    UNSUPPORTED = (
        ("name", _is_none, _unsupported("message names are", "null") + " (the chat template has no place for them)"),
        ("tool_calls", _is_empty, _unsupported("tool calling is", "null or []")),
        ("tool_call_id", _is_none, _unsupported("tool calling is", "null")),
        ("function_call", _is_none, _unsupported("function calling is", "null")),
        ("refusal", _is_none, _unsupported("refusal messages are", "null")),
    )

    def _refusals(self) -> Iterator[Refusal]:
        if self.role not in CHAT_ROLES:
            yield ("role",), (f"{self.role!r} messages are not supported by this server"
                              f"{' (no tool calling)' if self.role in ('tool', 'function') else ''}; "
                              "the roles are system, user and assistant")
        for m, part in enumerate(self.content if isinstance(self.content, list) else []):
            kind = part.get("type")
            if kind != "text":
                yield ("content", m), _unsupported(f"{kind!r} content parts are" if isinstance(kind, str) else
                                                   "a content part without a type is", '{"type": "text", ...}')
            elif not isinstance(part.get("text"), str):
                yield ("content", m, "text"), 'a text content part is {"type": "text", "text": <a string>}'
            else:
                for key in sorted(part.keys() - {"type", "text"}):
                    yield ("content", m, key), UNRECOGNIZED
        yield from super()._refusals()

    def as_template_input(self) -> dict[str, str]:
        content = self.content
        if isinstance(content, list):  # [{"type": "text", "text": ...}, ...]: the text parts (all there is), joined
            content = "".join(part["text"] for part in content)
        return {"role": self.role, "content": content or ""}


class ChatCompletionRequest(_Sampling):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: MaxTokens | None = None
    logprobs: StrictBool = False
    top_logprobs: Annotated[StrictInt, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    chat_template_kwargs: dict[str, Any] | None = None  # extension (vLLM): e.g. {"thinking": true}
    metadata: dict[StrictStr, StrictStr] | None = None  # tags for stored completions; nothing is stored
    store: StrictBool | None = None  # refused if true
    service_tier: StrictStr | None = None  # "auto" / "default" accepted: there is one tier
    # refused unless no-op
    tools: list[Any] | None = None
    functions: list[Any] | None = None
    tool_choice: Union[StrictStr, dict[str, Any], None] = None
    function_call: Union[StrictStr, dict[str, Any], None] = None
    parallel_tool_calls: StrictBool | None = None
    response_format: dict[str, Any] | None = None
    modalities: list[StrictStr] | None = None
    audio: Any = None
    prediction: Any = None
    web_search_options: Any = None
    reasoning_effort: Any = None

    UNSUPPORTED = _Sampling.UNSUPPORTED + (
        ("tools", _is_empty, _unsupported("tool calling is", "null or []")),
        ("functions", _is_empty, _unsupported("function calling is", "null or []")),
        ("tool_choice", _is_none_choice, _unsupported("tool calling is", 'null or "none"')),
        ("function_call", _is_none_choice, _unsupported("function calling is", 'null or "none"')),
        ("parallel_tool_calls", _is_none, _unsupported("tool calling is", "null")),
        ("response_format", lambda v, _: v is None or v == {"type": "text"},
         _unsupported("structured output is", '{"type": "text"} or null')),
        ("modalities", lambda v, _: v is None or v == ["text"], _unsupported("output other than text is",
                                                                             '["text"] or null')),
        ("audio", _is_none, _unsupported("audio output is", "null")),
        ("prediction", _is_none, _unsupported("predicted output is", "null")),
        ("web_search_options", _is_none, _unsupported("web search is", "null")),
        ("reasoning_effort", _is_none, _unsupported("", "null") + " (a chat template's thinking mode is set with "
                                                                  'chat_template_kwargs, e.g. {"thinking": true})'),
        ("store", lambda v, _: not v, _unsupported("storing completions is", "false or null")),
        ("service_tier", lambda v, _: v in (None, "auto", "default"),
         _unsupported("choosing a service tier is", '"auto", "default" or null')),
    )

    def _refusals(self) -> Iterator[Refusal]:
        if self.top_logprobs is not None and not self.logprobs:
            yield ("top_logprobs",), "top_logprobs needs logprobs: true"
        yield from super()._refusals()

    def sampling_params(self, prompt_len: int, max_model_len: int, index: int = 0) -> SamplingParams:
        max_tokens = self.max_completion_tokens or self.max_tokens or max(1, max_model_len - prompt_len)
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        seed = None if self.seed is None else self.seed + index
        return self._params(max_tokens, logprobs, seed)
