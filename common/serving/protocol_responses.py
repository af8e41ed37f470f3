"""The OpenAI Responses request body (POST /v1/responses), checked as strictly as protocol.py checks the chat one: a
field is honoured or refused with a 400 naming it, an unknown field is refused.

Honoured: input (a string, or a list of items: messages of role user / system / developer / assistant with string or
input_text / output_text content, function_call, function_call_output, and reasoning items, whose reasoning_text
content or this server's encrypted_content becomes the assistant's reasoning_content), instructions (a system message
first), tools (flat function tools; strict null is strict false), tool_choice ("auto" also without tools),
parallel_tool_calls, text.format (text / json_object / json_schema), max_output_tokens, reasoning.effort,
temperature, top_p, stream, model, metadata, user, safety_identifier, prompt_cache_key (opaque ids: prefix caching
needs no key), service_tier "auto" / "default", include ["reasoning.encrypted_content"], truncation "disabled",
store and previous_response_id (response_store.py: store defaults to true, as OpenAI's; the continuation's input
follows the stored conversation and the previous response's output, with this request's own instructions and tools --
those of the previous request are not carried over, as OpenAI documents; a function_call_output may answer a call of
the previous response).

reasoning.effort -> the chat format's thinking mode and reasoning effort, as DeepSeek's API maps OpenAI's efforts:
absent or null: the format's default (DeepSeek-V4: chat, no thinking); "none": thinking off; "low", "medium", "high":
thinking at the default effort (DeepSeek-V4: "high", the plain thinking prompt); "xhigh", "max": thinking at "max"
(a format without a max effort refuses it). "minimal" has no counterpart and is refused.

Refused: conversation (conversation objects: use previous_response_id), background true, prompt (stored prompt
templates), truncation "auto", other include values, top_logprobs, stream_options.include_obfuscation true,
max_tool_calls, text.verbosity other than "medium", reasoning summaries other than "auto" (none is written; the
reasoning itself is returned as reasoning_text), built-in and custom tools, non-text content parts, item_reference
items (send the item itself), reasoning items with a summary or with encrypted_content from elsewhere.

The items become OpenAI chat messages (what chat.py's Conversation holds): a run of reasoning, assistant message and
function_call items is one assistant message (reasoning_content, content, tool_calls) -- a reasoning or message item
after a call, or reasoning after a message, starts the next one; each function_call_output is a tool message, which
must answer a call of the assistant message before it."""
from __future__ import annotations

import base64
import binascii
import json
from collections.abc import Iterator
from typing import Annotated, Any, Literal, Union

from pydantic import Field, StrictBool, StrictInt, StrictStr, ValidationError, field_validator

from common.engine import SamplingParams
from common.engine.sampling_params import StructuredOutputsParams

from .protocol import (UNRECOGNIZED, Number, Refusal, ResponseFormat, _error, _is_empty, _is_none, _is_zero, _Strict,
                       _unsupported)

ItemStatus = Literal["in_progress", "completed", "incomplete"]
TOOL_CHOICES = ("none", "auto", "required")
# OpenAI's reasoning efforts -> (thinking, the chat format's reasoning_effort)
EFFORTS: dict[str, tuple[bool, str | None]] = {"none": (False, None), "low": (True, None), "medium": (True, None),
                                               "high": (True, None), "xhigh": (True, "max"), "max": (True, "max")}
INCLUDABLE = ("reasoning.encrypted_content",)
ENCRYPTED_PREFIX = "npu-cookbook.reasoning.v1:"  # reasoning text, base64: opaque to clients, not a secret


def encode_reasoning(text: str) -> str:
    """A reasoning item's encrypted_content: its text, to be sent back (clients that keep no reasoning_text)."""
    return ENCRYPTED_PREFIX + base64.urlsafe_b64encode(text.encode()).decode()


def decode_reasoning(blob: str) -> str:
    """The reasoning text of an encrypted_content this server wrote; ValueError for any other."""
    if not blob.startswith(ENCRYPTED_PREFIX):
        raise ValueError("this encrypted_content was not written by this server; send the reasoning as content "
                         '[{"type": "reasoning_text", "text": ...}]')
    try:
        return base64.urlsafe_b64decode(blob[len(ENCRYPTED_PREFIX):].encode()).decode()
    except (binascii.Error, UnicodeDecodeError, ValueError):
        raise ValueError("this encrypted_content is damaged") from None


def _text_parts(content, kinds: tuple[str, ...]) -> Iterator[Refusal]:
    """Refusals for list content whose parts are not {"type": one of kinds, "text": str} (extras allowed:
    annotations and logprobs on output_text, which a client sends back as it got them)."""
    for j, part in enumerate(content if isinstance(content, list) else []):
        kind = part.get("type")
        if kind not in kinds:
            yield ("content", j), _unsupported(f"{kind!r} content parts are" if isinstance(kind, str) else
                                               "a content part without a type is",
                                               " or ".join(f'{{"type": "{k}", ...}}' for k in kinds))
        elif not isinstance(part.get("text"), str):
            yield ("content", j, "text"), f'a content part is {{"type": "{kind}", "text": <a string>}}'
        else:
            extra = {"annotations", "logprobs"} if kind == "output_text" else set()
            for key in sorted(part.keys() - {"type", "text"} - extra):
                yield ("content", j, key), UNRECOGNIZED


def _chat_content(content: str | list[dict]) -> str | list[dict]:
    """Message content as a chat message holds it: a string, or text parts (the chat format joins them)."""
    if isinstance(content, str):
        return content
    return [{"type": "text", "text": part["text"]} for part in content]


class MessageItem(_Strict):
    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: Union[StrictStr, list[dict[str, Any]]]
    id: StrictStr | None = None  # an output message sent back
    status: ItemStatus | None = None
    phase: StrictStr | None = None

    UNSUPPORTED = (("phase", _is_none, _unsupported("message phases are", "null")),)

    def _refusals(self) -> Iterator[Refusal]:
        yield from _text_parts(self.content, ("output_text",) if self.role == "assistant" else ("input_text",))
        yield from super()._refusals()


class FunctionCallItem(_Strict):
    type: Literal["function_call"]
    call_id: Annotated[StrictStr, Field(min_length=1)]
    name: Annotated[StrictStr, Field(min_length=1)]
    arguments: StrictStr  # a JSON object, as text
    id: StrictStr | None = None
    status: ItemStatus | None = None

    def _refusals(self) -> Iterator[Refusal]:
        try:
            args = json.loads(self.arguments) if self.arguments.strip() else {}
        except ValueError as e:
            args = e
        if not isinstance(args, dict):
            yield ("arguments",), f"must be a JSON object as text, got {self.arguments[:80]!r}"
        yield from super()._refusals()


class FunctionCallOutputItem(_Strict):
    type: Literal["function_call_output"]
    call_id: Annotated[StrictStr, Field(min_length=1)]
    output: Union[StrictStr, list[dict[str, Any]]]
    id: StrictStr | None = None
    status: ItemStatus | None = None

    def _refusals(self) -> Iterator[Refusal]:
        for loc, message in _text_parts(self.output, ("input_text",)):
            yield ("output",) + loc[1:], message
        yield from super()._refusals()


class ReasoningText(_Strict):
    type: Literal["reasoning_text"]
    text: StrictStr


class ReasoningItem(_Strict):
    type: Literal["reasoning"]
    id: StrictStr | None = None
    summary: list[dict[str, Any]] = []
    content: list[ReasoningText] | None = None
    encrypted_content: StrictStr | None = None
    status: ItemStatus | None = None

    UNSUPPORTED = (("summary", _is_empty, _unsupported("reasoning summaries are", "[]") +
                    " (a summary is not the model's reasoning: send content or encrypted_content)"),)

    def _refusals(self) -> Iterator[Refusal]:
        if not self.content and self.encrypted_content is not None:
            try:
                decode_reasoning(self.encrypted_content)
            except ValueError as e:
                yield ("encrypted_content",), str(e)
        yield from super()._refusals()

    @property
    def text(self) -> str:
        if self.content:
            return "".join(part.text for part in self.content)
        return decode_reasoning(self.encrypted_content) if self.encrypted_content is not None else ""


ITEMS: dict[str, type[_Strict]] = {"message": MessageItem, "function_call": FunctionCallItem,
                                   "function_call_output": FunctionCallOutputItem, "reasoning": ReasoningItem}


class FunctionTool(_Strict):
    type: Literal["function"]
    name: Annotated[StrictStr, Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")]
    description: StrictStr | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema of the arguments object
    strict: StrictBool | None = None  # true: the call's arguments are forced by grammar to match `parameters`
    # refused unless no-op
    defer_loading: StrictBool | None = None
    output_schema: dict[str, Any] | None = None

    UNSUPPORTED = (("defer_loading", lambda v, _: not v, _unsupported("deferred tool loading is", "false or null")),
                   ("output_schema", _is_none, _unsupported("tool output schemas are", "null")))

    def as_chat(self) -> dict:
        """The chat-completions shape the chat format renders."""
        fn = {k: v for k, v in (("name", self.name), ("description", self.description),
                                ("parameters", self.parameters), ("strict", self.strict)) if v is not None}
        return {"type": "function", "function": fn}

    def echo(self) -> dict:
        return {"type": "function", "name": self.name, "description": self.description,
                "parameters": self.parameters, "strict": self.strict}


class TextConfig(_Strict):
    format: dict[str, Any] | None = None  # {"type": "text"} / {"type": "json_object"} / {"type": "json_schema", ...}
    verbosity: StrictStr | None = None

    UNSUPPORTED = (("verbosity", lambda v, _: v in (None, "medium"),
                    _unsupported("choosing a verbosity is", '"medium" or null')),)

    def _refusals(self) -> Iterator[Refusal]:
        try:
            self.response_format()
        except ValidationError as e:
            for err in e.errors(include_url=False):
                loc = tuple(x for x in err["loc"] if x != "json_schema")
                yield ("format",) + loc, err["msg"]
        yield from super()._refusals()

    def response_format(self) -> ResponseFormat | None:
        """The chat request's response_format this format is (its flat json_schema fields nested)."""
        fmt = self.format
        if fmt is None:
            return None
        if fmt.get("type") == "json_schema":
            fmt = {"type": "json_schema", "json_schema": {k: v for k, v in fmt.items() if k != "type"}}
        return ResponseFormat.model_validate(fmt)


class ReasoningConfig(_Strict):
    effort: StrictStr | None = None
    summary: StrictStr | None = None
    generate_summary: StrictStr | None = None
    context: StrictStr | None = None
    mode: StrictStr | None = None

    UNSUPPORTED = (
        ("summary", lambda v, _: v in (None, "auto"), _unsupported("reasoning summaries are", '"auto" or null') +
         " (no summary is written; the reasoning itself comes as reasoning_text)"),
        ("generate_summary", lambda v, _: v in (None, "auto"), _unsupported("reasoning summaries are",
                                                                            '"auto" or null')),
        ("context", _is_none, _unsupported("choosing the reasoning context is", "null")),
        ("mode", _is_none, _unsupported("reasoning modes are", "null")),
    )

    def _refusals(self) -> Iterator[Refusal]:
        if self.effort == "minimal":
            yield ("effort",), ('"minimal" has no counterpart in the model\'s thinking (it thinks at its default or '
                                'its max effort): send "none" (no thinking) or low / medium / high')
        elif self.effort is not None and self.effort not in EFFORTS:
            yield ("effort",), (f"{self.effort!r} is not supported by this server; the efforts are "
                                f"{', '.join(EFFORTS)} (or null)")
        yield from super()._refusals()


class StreamOptions(_Strict):
    include_obfuscation: StrictBool | None = None

    UNSUPPORTED = (("include_obfuscation", lambda v, _: not v, _unsupported("stream obfuscation is",
                                                                            "false or null")),)


class ResponsesRequest(_Strict):
    input: Union[StrictStr, list[Any]]  # a list: items (ITEMS' models) once validated
    model: StrictStr | None = None
    instructions: StrictStr | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Union[StrictStr, dict[str, Any], None] = None  # with tools: "auto"
    parallel_tool_calls: StrictBool | None = None  # false: at most one call (forced by grammar)
    text: TextConfig | None = None
    max_output_tokens: Annotated[StrictInt, Field(ge=1)] | None = None
    reasoning: ReasoningConfig | None = None
    temperature: Annotated[Number, Field(ge=0)] | None = None
    top_p: Annotated[Number, Field(gt=0, le=1)] | None = None
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    metadata: dict[StrictStr, StrictStr] | None = None  # echoed (and stored with the response)
    user: StrictStr | None = None
    safety_identifier: StrictStr | None = None
    prompt_cache_key: StrictStr | None = None
    service_tier: StrictStr | None = None
    include: list[StrictStr] | None = None
    truncation: StrictStr | None = None
    store: StrictBool | None = None  # null: true (OpenAI's default)
    previous_response_id: Annotated[StrictStr, Field(min_length=1)] | None = None
    # refused unless no-op
    conversation: Any = None
    background: StrictBool | None = None
    prompt: Any = None
    top_logprobs: StrictInt | None = None
    max_tool_calls: StrictInt | None = None

    UNSUPPORTED = (
        ("conversation", _is_none, _unsupported("conversations are", "null") +
         " (continue a stored response with previous_response_id, or send the whole conversation in input)"),
        ("background", lambda v, _: not v, _unsupported("background responses are", "false or null")),
        ("prompt", _is_none, _unsupported("stored prompt templates are", "null")),
        ("top_logprobs", _is_zero, _unsupported("log-probs are", "0 or null")),
        ("max_tool_calls", _is_none, _unsupported("", "null") + " (it limits built-in tools, which this server has "
                                                                "none of)"),
        ("truncation", lambda v, _: v in (None, "disabled"), _unsupported("truncating the input is",
                                                                          '"disabled" or null')),
        ("service_tier", lambda v, _: v in (None, "auto", "default"),
         _unsupported("choosing a service tier is", '"auto", "default" or null')),
    )

    @field_validator("input", mode="before")
    @classmethod
    def _items(cls, value):
        if not isinstance(value, list):
            return value
        items, errors = [], []
        for i, item in enumerate(value):
            kind = item.get("type", "message") if isinstance(item, dict) else None
            model = ITEMS.get(kind)
            if model is None:
                errors.append(("unsupported", (i, "type"), _unsupported(
                    f"{kind!r} items are" if isinstance(kind, str) else "an item that is not an object is",
                    "message, function_call, function_call_output or reasoning") +
                    (" (send the item itself, or previous_response_id to continue a stored response)"
                     if kind == "item_reference" else ""), item))
                continue
            try:
                items.append(model.model_validate(item))
            except ValidationError as e:
                errors += [(err["type"], (i,) + tuple(err["loc"]), err["msg"], err.get("input"))
                           for err in e.errors(include_url=False)]
        if errors:
            raise _error("input", errors)
        return items

    def _refusals(self) -> Iterator[Refusal]:
        if isinstance(self.input, list) and not self.input:
            yield ("input",), "must hold at least one item"
        names = [t.name for t in self.tools or []]
        if len(set(names)) < len(names):
            yield ("tools",), "tool names must be unique"
        choice = self.tool_choice
        if isinstance(choice, str) and choice not in TOOL_CHOICES:
            yield ("tool_choice",), (f"{choice!r} is not supported by this server; it takes none, auto, required "
                                     'or {"type": "function", "name": ...}')
        elif isinstance(choice, dict) and (choice.get("type") != "function" or set(choice) != {"type", "name"}
                                           or not isinstance(choice.get("name"), str)):
            yield ("tool_choice",), ('a named tool choice is {"type": "function", "name": ...}; other kinds '
                                     "(allowed_tools, built-in tools) are not supported by this server")
        elif isinstance(choice, dict) and choice["name"] not in names:
            yield ("tool_choice",), f"tool_choice names {choice['name']!r}, which is not in tools"
        elif choice not in (None, "none", "auto") and not self.tools:  # auto without tools: nothing to choose
            yield ("tool_choice",), "tool_choice needs tools"
        for j, name in enumerate(self.include or []):
            if name not in INCLUDABLE:
                yield ("include", j), _unsupported(f"including {name!r} is", " or ".join(INCLUDABLE))
        fmt = self.text.response_format() if self.text is not None and self.text.format is not None else None
        if fmt is not None and fmt.type != "text" and self.forces_tool_calls:
            yield ("text", "format"), ("a JSON text format cannot be combined with a forced tool call "
                                       "(tool_choice required or named, strict tools or parallel_tool_calls: false)")
        if self.previous_response_id is None:  # else checked with the stored conversation first (continuing)
            yield from self._pairing()
        yield from super()._refusals()

    def _pairing(self) -> Iterator[Refusal]:
        """Each function_call_output answers a call of the assistant turn before it; call ids unique per turn."""
        turn_calls: list[str] | None = None
        in_turn = False
        for i, item in enumerate(self.input if isinstance(self.input, list) else []):
            if isinstance(item, FunctionCallItem):
                if not in_turn:
                    turn_calls, in_turn = [], True
                if item.call_id in turn_calls:
                    yield ("input", i, "call_id"), f"duplicate call_id {item.call_id!r} in one assistant turn"
                turn_calls.append(item.call_id)
            elif isinstance(item, FunctionCallOutputItem):
                in_turn = False
                if item.call_id not in (turn_calls or []):
                    yield ("input", i, "call_id"), (f"{item.call_id!r} answers no function_call of the assistant "
                                                    "turn before it")
            elif isinstance(item, (ReasoningItem, MessageItem)) and (
                    not isinstance(item, MessageItem) or item.role == "assistant"):
                if not in_turn:
                    turn_calls, in_turn = [], True
            else:
                in_turn = False

    # ------------------------------------------------------------ a stored conversation continued

    @property
    def input_items(self) -> list:
        """The input as items (a string is one user message)."""
        if isinstance(self.input, str):
            return [MessageItem(role="user", content=self.input)]
        return list(self.input)

    def continuing(self, history: list) -> "ResponsesRequest":
        """This request as the next turn of a stored conversation: its input after `history` (the items the previous
        response answered, then its output as items: output_items), its own instructions, tools and settings.
        ContinuationError when one of its items does not fit there (a function_call_output that answers no call)."""
        combined = self.model_copy(update={"input": list(history) + self.input_items})
        for loc, message in combined._pairing():
            if loc[1] >= len(history):  # the history was checked when it was sent
                param = ".".join(str(x) for x in ("input", loc[1] - len(history)) + loc[2:])
                raise ContinuationError(param, message)
        return combined

    # ------------------------------------------------------------ what the chat path takes

    def messages(self) -> list[dict]:
        """The conversation as OpenAI chat messages: instructions first (a system message), then the input."""
        out = [{"role": "system", "content": self.instructions}] if self.instructions else []
        if isinstance(self.input, str):
            return out + [{"role": "user", "content": self.input}]
        turn: dict | None = None  # the assistant message being built: its parts so far
        for item in self.input:
            if isinstance(item, ReasoningItem):
                if turn is None or turn["content"] or turn["tool_calls"]:
                    turn = _new_turn(out)
                turn["reasoning"].append(item.text)
            elif isinstance(item, MessageItem) and item.role == "assistant":
                if turn is None or turn["tool_calls"]:
                    turn = _new_turn(out)
                turn["content"] += [{"type": "text", "text": item.content}] if isinstance(item.content, str) \
                    else _chat_content(item.content)
            elif isinstance(item, FunctionCallItem):
                if turn is None:
                    turn = _new_turn(out)
                turn["tool_calls"].append({"id": item.call_id, "type": "function",
                                           "function": {"name": item.name, "arguments": item.arguments}})
            else:
                turn = None
                if isinstance(item, MessageItem):
                    out.append({"role": item.role, "content": _chat_content(item.content)})
                else:
                    out.append({"role": "tool", "tool_call_id": item.call_id, "content": _chat_content(item.output)})
        return [_assistant(m) if m.get("role") is None else m for m in out]

    @property
    def active_tools(self) -> list[dict] | None:
        """The tools the model is told of, in the chat shape; tool_choice "none" leaves them out of the prompt."""
        if not self.tools or self.tool_choice == "none":
            return None
        return [t.as_chat() for t in self.tools]

    @property
    def chat_tool_choice(self) -> str | dict | None:
        """tool_choice in the chat shape ({"type": "function", "function": {"name": ...}} when named)."""
        if isinstance(self.tool_choice, dict):
            return {"type": "function", "function": {"name": self.tool_choice["name"]}}
        return self.tool_choice

    @property
    def forces_tool_calls(self) -> bool:
        """Whether a grammar shapes the tool calls: tool_choice required or named, a strict tool, or
        parallel_tool_calls false (at most one call)."""
        if self.active_tools is None:
            return False
        return (self.tool_choice == "required" or isinstance(self.tool_choice, dict)
                or any(t.strict for t in self.tools) or self.parallel_tool_calls is False)

    @property
    def response_format(self) -> ResponseFormat | None:
        return self.text.response_format() if self.text is not None else None

    @property
    def thinking(self) -> bool | None:
        """Thinking mode from reasoning.effort; None: the chat format's default."""
        effort = self.reasoning.effort if self.reasoning is not None else None
        return None if effort is None else EFFORTS[effort][0]

    @property
    def reasoning_effort(self) -> str | None:
        effort = self.reasoning.effort if self.reasoning is not None else None
        return None if effort is None else EFFORTS[effort][1]

    @property
    def include_encrypted_reasoning(self) -> bool:
        return "reasoning.encrypted_content" in (self.include or [])

    def sampling_params(self, prompt_len: int, max_model_len: int,
                        structured_outputs: StructuredOutputsParams | None) -> SamplingParams:
        """Generated text keeps its special tokens: the chat format's parser reads the markup."""
        return SamplingParams(temperature=1.0 if self.temperature is None else self.temperature,
                              top_p=1.0 if self.top_p is None else self.top_p,
                              max_tokens=self.max_output_tokens or max(1, max_model_len - prompt_len),
                              structured_outputs=structured_outputs, skip_special_tokens=False)


class ContinuationError(ValueError):
    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param


def output_items(output: list[dict]) -> list:
    """A response's output items as the input items a client would send back (ValidationError: one that cannot
    be, a function call cut off before its arguments were a JSON object)."""
    return [ITEMS[item["type"]].model_validate(item) for item in output]


def _new_turn(out: list) -> dict:
    turn = {"reasoning": [], "content": [], "tool_calls": []}
    out.append(turn)
    return turn


def _assistant(turn: dict) -> dict:
    """An assistant turn's parts as one chat message (a single text part as a plain string)."""
    content = turn["content"]
    m = {"role": "assistant", "content": content[0]["text"] if len(content) == 1 else content or None}
    if turn["reasoning"]:
        m["reasoning_content"] = "".join(turn["reasoning"])
    if turn["tool_calls"]:
        m["tool_calls"] = turn["tool_calls"]
    return m
