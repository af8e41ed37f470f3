"""OpenAI request bodies for /v1/completions and /v1/chat/completions (vLLM's field names), checked strictly:
ints are ints, numbers are numbers, ranges as OpenAI documents them. Each request turns into the engine's
SamplingParams.

A field is honoured or refused, never accepted and ignored. An unknown field is refused ("foo: unrecognized request
argument", as OpenAI does). The documented OpenAI fields this server does not honour (tool calling, structured
output other than text, penalties, logit_bias, suffix, best_of, audio, ...) are declared and refused whenever they
carry anything but their no-op value (the defaults clients commonly send: null, 0, [], {}, "none", ...). Each
refusal is a pydantic error at the field's location, so the server's validation handler answers 400 with
`param` = that path and a message naming it. Tool calling (tools, tool_choice, parallel_tool_calls, tool and
assistant tool-call messages), response_format and reasoning_effort are honoured through the model's chat format
(common/serving/chat_format.py), which refuses what it cannot render. Extensions honoured (vLLM's names): top_k,
ignore_eos, structured_outputs, chat_template_kwargs, stream_options.include_usage, reasoning_content on assistant
messages, add_special_tokens (vLLM's defaults: completions add the tokenizer's special tokens, its BOS, to text
prompts; chat does not, its format writes them; token-id prompts are never changed)."""
from __future__ import annotations

from collections.abc import Iterator
from typing import Annotated, Any, Callable, ClassVar, Literal, Union

from pydantic import (BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr, ValidationError,
                      model_validator)
from pydantic_core import InitErrorDetails, PydanticCustomError

from common.engine import SamplingParams
from common.engine.sampling_params import MAX_LOGPROBS, StructuredOutputsParams

Number = Annotated[float, Field(strict=True, allow_inf_nan=False)]
MaxTokens = Annotated[StrictInt, Field(ge=1)]
Stop = Union[StrictStr, list[StrictStr], None]
UNRECOGNIZED = "unrecognized request argument"
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")  # a chat format may refuse some (400)
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
            raise _error(cls.__name__, [("unsupported", loc, message, getattr(model, loc[0]) if loc else None)
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


class FunctionCall(_Strict):
    name: StrictStr
    arguments: StrictStr  # a JSON object, as text (as OpenAI sends it)


class ToolCallParam(_Strict):
    id: StrictStr
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Strict):
    role: StrictStr
    content: Union[StrictStr, list[dict[str, Any]], None] = None
    tool_calls: list[ToolCallParam] | None = None  # assistant
    tool_call_id: StrictStr | None = None  # tool
    reasoning_content: StrictStr | None = None  # assistant (extension, DeepSeek's name): its reasoning, sent back
    # refused unless no-op
    name: StrictStr | None = None
    function_call: Any = None
    refusal: StrictStr | None = None

    UNSUPPORTED = (
        ("name", _is_none, _unsupported("message names are", "null") + " (the chat format has no place for them)"),
        ("function_call", _is_none, _unsupported("function calling is", "null") + " (use tool_calls)"),
        ("refusal", _is_none, _unsupported("refusal messages are", "null")),
    )

    def _refusals(self) -> Iterator[Refusal]:
        if self.role not in CHAT_ROLES:
            yield ("role",), (f"{self.role!r} messages are not supported by this server"
                              f"{' (use tool messages)' if self.role == 'function' else ''}; "
                              f"the roles are {', '.join(CHAT_ROLES)}")
        if self.tool_calls and self.role != "assistant":
            yield ("tool_calls",), "only assistant messages carry tool_calls"
        if self.reasoning_content is not None and self.role != "assistant":
            yield ("reasoning_content",), "only assistant messages carry reasoning_content"
        if (self.role == "tool") != (self.tool_call_id is not None):
            yield ("tool_call_id",), ("a tool message needs the tool_call_id it answers" if self.role == "tool"
                                      else "only tool messages carry a tool_call_id")
        for m, part in enumerate(self.content if isinstance(self.content, list) else []):
            kind = part.get("type")
            if kind == "image_url":
                yield from _image_part_refusals(self.role, m, part)
            elif kind != "text":
                yield ("content", m), _unsupported(f"{kind!r} content parts are" if isinstance(kind, str) else
                                                   "a content part without a type is",
                                                   '{"type": "text", ...} (or "image_url" in user messages)')
            elif not isinstance(part.get("text"), str):
                yield ("content", m, "text"), 'a text content part is {"type": "text", "text": <a string>}'
            else:
                for key in sorted(part.keys() - {"type", "text"}):
                    yield ("content", m, key), UNRECOGNIZED
        yield from super()._refusals()

    def as_input(self) -> dict:
        """The message as a chat format reads it (OpenAI's dict shape; absent fields left out)."""
        m = {"role": self.role, "content": self.content}
        if self.tool_calls:
            m["tool_calls"] = [c.model_dump() for c in self.tool_calls]
        for key in ("tool_call_id", "reasoning_content"):
            if getattr(self, key) is not None:
                m[key] = getattr(self, key)
        return m


def _image_part_refusals(role: str, m: int, part: dict) -> Iterator[Refusal]:
    """OpenAI's image part {"type": "image_url", "image_url": {"url": data: or http(s) URL, "detail": "auto"}}, in a
    user message."""
    if role != "user":
        yield ("content", m), f"image content parts go in user messages, not {role} messages"
    for key in sorted(part.keys() - {"type", "image_url"}):
        yield ("content", m, key), UNRECOGNIZED
    image = part.get("image_url")
    if not isinstance(image, dict) or not isinstance(image.get("url"), str):
        yield ("content", m, "image_url"), 'an image part is {"type": "image_url", "image_url": {"url": <a data: ' \
                                           'or http(s) URL>}}'
        return
    for key in sorted(image.keys() - {"url", "detail"}):
        yield ("content", m, "image_url", key), UNRECOGNIZED
    if image.get("detail", "auto") != "auto":
        yield ("content", m, "image_url", "detail"), _unsupported("", '"auto"') + \
            " (the image processor picks one canvas per image)"


class FunctionDefinition(_Strict):
    name: Annotated[StrictStr, Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")]
    description: StrictStr | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema of the arguments object
    strict: StrictBool | None = None  # true: the call's arguments are forced by grammar to match `parameters`


class ChatTool(_Strict):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(_Strict):
    name: StrictStr


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: NamedFunction


class JSONSchemaFormat(_Strict):
    name: Annotated[StrictStr, Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")]
    description: StrictStr | None = None
    schema_: Annotated[dict[str, Any] | None, Field(alias="schema")] = None
    strict: StrictBool | None = None

    model_config = ConfigDict(extra="forbid", populate_by_name=True)


class ResponseFormat(_Strict):
    """{"type": "text"} (no constraint), {"type": "json_object"} (any JSON object) or {"type": "json_schema",
    "json_schema": {name, schema, strict}}: the output is forced by grammar to match (strict or not: the grammar
    always holds), and the schema is stated in the prompt where the chat format does that."""
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None

    def _refusals(self) -> Iterator[Refusal]:
        if (self.type == "json_schema") != (self.json_schema is not None):
            yield ("json_schema",), ('type "json_schema" needs a json_schema {name, schema}' if self.json_schema is None
                                     else f'json_schema goes with type "json_schema", not {self.type!r}')
        yield from super()._refusals()

    def constraint(self) -> StructuredOutputsParams | None:
        if self.type == "json_object":
            return StructuredOutputsParams(json_object=True)
        if self.type == "json_schema":
            return StructuredOutputsParams(json=self.json_schema.schema_ or {"type": "object"})
        return None


class StructuredOutputs(_Strict):
    """Extension (vLLM's `structured_outputs`): exactly one of json (a JSON schema), json_object, regex, choice,
    grammar (EBNF, rule `root`); disable_any_whitespace for the JSON kinds."""
    json_: Annotated[Union[dict[str, Any], StrictStr, None], Field(alias="json")] = None
    json_object: StrictBool | None = None
    regex: StrictStr | None = None
    choice: Annotated[list[StrictStr], Field(min_length=1)] | None = None
    grammar: StrictStr | None = None
    disable_any_whitespace: StrictBool = False

    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    def _refusals(self) -> Iterator[Refusal]:
        kinds = [k for k in ("json_", "json_object", "regex", "choice", "grammar") if getattr(self, k) not in
                 (None, False)]
        if len(kinds) != 1:
            yield (), ("structured_outputs takes exactly one of json, json_object, regex, choice, grammar; got "
                       f"{', '.join(k.rstrip('_') for k in kinds) or 'none'}")
        yield from super()._refusals()

    def constraint(self) -> StructuredOutputsParams:
        return StructuredOutputsParams(json=self.json_, json_object=self.json_object or None, regex=self.regex,
                                       choice=self.choice, grammar=self.grammar,
                                       disable_any_whitespace=self.disable_any_whitespace)


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
    structured_outputs: StructuredOutputs | None = None  # extension (vLLM's): grammar-constrained output
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

    def _params(self, max_tokens: int, logprobs: int | None, seed: int | None, prompt_logprobs: int | None = None,
                **kwargs) -> SamplingParams:
        return SamplingParams(temperature=1.0 if self.temperature is None else self.temperature,
                              top_p=1.0 if self.top_p is None else self.top_p,
                              top_k=-1 if self.top_k is None else self.top_k, seed=seed, max_tokens=max_tokens,
                              stop=self.stop, ignore_eos=self.ignore_eos, logprobs=logprobs,
                              prompt_logprobs=prompt_logprobs, **kwargs)


class CompletionRequest(_Sampling):
    prompt: Union[StrictStr, list[StrictInt], list[StrictStr], list[list[StrictInt]]]
    max_tokens: Annotated[StrictInt, Field(ge=0)] | None = None  # 0: only with echo (score the prompt)
    logprobs: Annotated[StrictInt, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    echo: StrictBool = False
    add_special_tokens: StrictBool = True  # extension (vLLM's): the tokenizer's special tokens (BOS) on text prompts
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
        constraint = self.structured_outputs.constraint() if self.structured_outputs is not None else None
        return self._params(16 if self.max_tokens is None else self.max_tokens, self.logprobs, seed,
                            prompt_logprobs, structured_outputs=constraint)


class ChatCompletionRequest(_Sampling):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: MaxTokens | None = None
    logprobs: StrictBool = False
    top_logprobs: Annotated[StrictInt, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    tools: list[ChatTool] | None = None  # [] = none
    tool_choice: Union[Literal["none", "auto", "required"], NamedToolChoice, None] = None  # with tools: "auto"
    parallel_tool_calls: StrictBool | None = None  # false: at most one call (forced by grammar)
    response_format: ResponseFormat | None = None
    reasoning_effort: StrictStr | None = None  # the chat format's (DeepSeek-V4: "high" or "max", thinking mode)
    chat_template_kwargs: dict[str, Any] | None = None  # extension (vLLM): e.g. {"thinking": true}
    add_special_tokens: StrictBool = False  # extension (vLLM's): the tokenizer's special tokens on top of the format's
    metadata: dict[StrictStr, StrictStr] | None = None  # tags for stored completions; nothing is stored
    store: StrictBool | None = None  # refused if true
    service_tier: StrictStr | None = None  # "auto" / "default" accepted: there is one tier
    # refused unless no-op
    functions: list[Any] | None = None
    function_call: Union[StrictStr, dict[str, Any], None] = None
    modalities: list[StrictStr] | None = None
    audio: Any = None
    prediction: Any = None
    web_search_options: Any = None

    UNSUPPORTED = _Sampling.UNSUPPORTED + (
        ("functions", _is_empty, _unsupported("the legacy functions field is", "null or []") + " (use tools)"),
        ("function_call", _is_none_choice, _unsupported("the legacy function_call field is", 'null or "none"')
         + " (use tool_choice)"),
        ("modalities", lambda v, _: v is None or v == ["text"], _unsupported("output other than text is",
                                                                             '["text"] or null')),
        ("audio", _is_none, _unsupported("audio output is", "null")),
        ("prediction", _is_none, _unsupported("predicted output is", "null")),
        ("web_search_options", _is_none, _unsupported("web search is", "null")),
        ("store", lambda v, _: not v, _unsupported("storing completions is", "false or null")),
        ("service_tier", lambda v, _: v in (None, "auto", "default"),
         _unsupported("choosing a service tier is", '"auto", "default" or null')),
    )

    def _refusals(self) -> Iterator[Refusal]:
        if self.top_logprobs is not None and not self.logprobs:
            yield ("top_logprobs",), "top_logprobs needs logprobs: true"
        names = [t.function.name for t in self.tools or []]
        if len(set(names)) < len(names):
            yield ("tools",), "tool names must be unique"
        if self.tool_choice is not None and self.tool_choice != "none" and not self.tools:
            yield ("tool_choice",), "tool_choice needs tools"
        if isinstance(self.tool_choice, NamedToolChoice) and self.tool_choice.function.name not in names:
            yield ("tool_choice",), f"tool_choice names {self.tool_choice.function.name!r}, which is not in tools"
        constrained = [k for k, on in (("response_format", self.response_format is not None and
                                        self.response_format.type != "text"),
                                       ("structured_outputs", self.structured_outputs is not None)) if on]
        if len(constrained) > 1:
            yield ("structured_outputs",), "give either response_format or structured_outputs, not both"
        if constrained and self.forces_tool_calls:
            yield (constrained[0],), (f"{constrained[0]} cannot be combined with a forced tool call "
                                      "(tool_choice required or named, strict tools or parallel_tool_calls: false)")
        yield from super()._refusals()

    @property
    def active_tools(self) -> list[dict] | None:
        """The tools the model is told of (OpenAI's dicts); tool_choice "none" leaves them out of the prompt."""
        if not self.tools or self.tool_choice == "none":
            return None
        return [t.model_dump(exclude_none=True) for t in self.tools]

    @property
    def forces_tool_calls(self) -> bool:
        """Whether a grammar shapes the tool calls: tool_choice required or named, a strict tool, or
        parallel_tool_calls false (at most one call)."""
        if self.active_tools is None:
            return False
        return (self.tool_choice in ("required",) or isinstance(self.tool_choice, NamedToolChoice)
                or any(t.function.strict for t in self.tools) or self.parallel_tool_calls is False)

    @property
    def thinking(self) -> bool | None:
        """chat_template_kwargs' thinking (or enable_thinking), None if neither is given."""
        kwargs = self.chat_template_kwargs or {}
        return kwargs.get("thinking", kwargs.get("enable_thinking"))

    def sampling_params(self, prompt_len: int, max_model_len: int, index: int = 0,
                        structured_outputs: StructuredOutputsParams | None = None,
                        skip_special_tokens: bool = True) -> SamplingParams:
        max_tokens = self.max_completion_tokens or self.max_tokens or max(1, max_model_len - prompt_len)
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        seed = None if self.seed is None else self.seed + index
        return self._params(max_tokens, logprobs, seed, structured_outputs=structured_outputs,
                            skip_special_tokens=skip_special_tokens)
