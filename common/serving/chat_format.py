"""What a model tells the server about its chat (the contract chat.py and responses.py serve through): how a request's
conversation becomes the prompt, how the generated text splits back into reasoning, content and tool calls, and the
grammar that forces its tool calls. A recipe passes its own (DeepSeek-V4: recipes/deepseek/chat_format_deepseek_v4.py);
`TemplateChatFormat` serves a tokenizer's Jinja chat template (chat and thinking, no tools).

The parsed pieces (`Delta`, `ToolCall`, `ParsedMessage`) are the endpoints' common currency: a parser turns the text
of one choice, decoded with its special tokens kept, into deltas that add up to the parsed message."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol


class ChatFormatError(ValueError):
    """What a chat format cannot render, naming the request field at fault (the server's 400 `param`)."""

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class ToolCall:
    """One parsed call: arguments is a JSON object string, or its unclosed start when the text ended inside the call
    (max_tokens): what was generated, never a "}" or a value that was not."""
    id: str
    name: str
    arguments: str


@dataclass(frozen=True)
class ToolCallDelta:
    """A streamed piece of call `index`: the first carries id and name (arguments ""), later ones argument text."""
    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""


@dataclass(frozen=True)
class Delta:
    """One streamed piece: exactly one of reasoning_content, content, tool_call."""
    reasoning_content: str | None = None
    content: str | None = None
    tool_call: ToolCallDelta | None = None

    def __post_init__(self):
        if sum(x is not None for x in (self.reasoning_content, self.content, self.tool_call)) != 1:
            raise ValueError("a Delta carries exactly one of reasoning_content, content, tool_call")


@dataclass(frozen=True)
class ParsedMessage:
    """An assistant message: reasoning_content is None when the prompt opened no thinking span."""
    reasoning_content: str | None
    content: str
    tool_calls: list[ToolCall] = field(default_factory=list)

    @classmethod
    def from_deltas(cls, deltas: list[Delta], thinking: bool) -> ParsedMessage:
        """The message a stream of deltas adds up to."""
        reasoning, content, calls = [], [], {}
        for d in deltas:
            if d.reasoning_content is not None:
                reasoning.append(d.reasoning_content)
            elif d.content is not None:
                content.append(d.content)
            elif d.tool_call.id is not None:
                calls[d.tool_call.index] = [d.tool_call.id, d.tool_call.name, d.tool_call.arguments]
            else:
                calls[d.tool_call.index][2] += d.tool_call.arguments
        return cls("".join(reasoning) if thinking else None, "".join(content),
                   [ToolCall(*calls[i]) for i in sorted(calls)])

    def to_message(self) -> dict:
        """The OpenAI assistant message (what a client sends back in the next request)."""
        m = {"role": "assistant", "content": self.content}
        if self.reasoning_content is not None:
            m["reasoning_content"] = self.reasoning_content
        if self.tool_calls:
            m["tool_calls"] = [{"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                               for c in self.tool_calls]
        return m


@dataclass(frozen=True)
class Conversation:
    """A chat request's input, as the endpoint parsed it: OpenAI messages (dicts; assistant messages may carry
    `reasoning_content` and `tool_calls`, tool messages `tool_call_id`), OpenAI function tools (None: no tools in
    the prompt), the response_format to state in the prompt (None or {"type": "text"}: none), the reasoning
    effort, and the request's chat_template_kwargs (thinking mode and whatever else the format takes)."""
    messages: list[dict]
    tools: list[dict] | None = None
    response_format: dict | None = None
    reasoning_effort: str | None = None
    template_kwargs: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class ChatPrompt:
    text: str
    thinking: bool  # the prompt opened a thinking span: the model reasons first
    images: tuple[dict, ...] = ()  # the image content parts, in prompt order: one image placeholder each in text


class OutputParser(Protocol):
    """Incremental parse of one choice's generated text (special tokens kept) into deltas."""

    @property
    def has_tool_calls(self) -> bool: ...

    def feed(self, delta_text: str) -> list[Delta]: ...

    def finish(self) -> list[Delta]: ...


class ChatFormat(Protocol):
    reasoning_end: str | None  # the token that ends the reasoning ("</think>"), None: the model does not reason

    def encode(self, conversation: Conversation) -> ChatPrompt:
        """The prompt; ValueError (ChatFormatError: with the field) for what it cannot render (the server's 400)."""

    def parser(self, prompt: ChatPrompt, tools: list[dict] | None) -> OutputParser: ...

    def tool_call_grammar(self, tools: list[dict], tool_choice: str | dict, parallel_tool_calls: bool) -> dict:
        """An xgrammar structural tag for the model's tool-call markup: `tool_choice` "required" or a named
        function forces a call; "auto" leaves text free and constrains a call once one starts. ValueError if the
        format has no tool calling."""


class ThinkParser:
    """Reasoning up to the reasoning-end text, content after it (or all content when no thinking span was opened);
    no tool calls. Text that may be the start of the end tag is held back."""

    def __init__(self, thinking: bool, reasoning_end: str | None, eos: str | None):
        self.reasoning, self.end, self.eos = thinking and reasoning_end is not None, reasoning_end, eos
        self.buf = ""

    @property
    def has_tool_calls(self) -> bool:
        return False

    def feed(self, delta_text: str) -> list[Delta]:
        self.buf += delta_text
        out = []
        if self.reasoning:
            at = self.buf.find(self.end)
            if at < 0:
                keep = _partial_suffix(self.buf, self.end)
                out += self._emit(self.buf[: len(self.buf) - keep], reasoning=True)
                self.buf = self.buf[len(self.buf) - keep:]
                return out
            out += self._emit(self.buf[:at], reasoning=True)
            self.buf, self.reasoning = self.buf[at + len(self.end):], False
        keep = _partial_suffix(self.buf, self.eos) if self.eos else 0
        out += self._emit(self.buf[: len(self.buf) - keep], reasoning=False)
        self.buf = self.buf[len(self.buf) - keep:]
        return out

    def finish(self) -> list[Delta]:
        rest, self.buf = self.buf, ""
        if self.eos and rest.endswith(self.eos):
            rest = rest[: -len(self.eos)]
        return self._emit(rest, reasoning=self.reasoning)

    @staticmethod
    def _emit(text: str, reasoning: bool) -> list[Delta]:
        if not text:
            return []
        return [Delta(reasoning_content=text) if reasoning else Delta(content=text)]


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest suffix of text that is a proper prefix of tag (or the whole tag at the end)."""
    for n in range(min(len(tag), len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


class TemplateChatFormat:
    """A tokenizer's Jinja chat template: thinking is whatever the rendered prompt opened (it ends in `<think>`);
    tools, response formats and reasoning efforts have no place in such a template and are refused."""
    THINK_OPEN, THINK_CLOSE = "<think>", "</think>"

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.reasoning_end = self.THINK_CLOSE if self.THINK_CLOSE in tokenizer.get_vocab() else None
        self.eos = tokenizer.eos_token

    def encode(self, conversation: Conversation) -> ChatPrompt:
        if conversation.tools:
            raise ChatFormatError("tools", "tool calling is not supported by this model's chat template")
        if conversation.reasoning_effort is not None:
            raise ChatFormatError("reasoning_effort", "this model's chat template has no reasoning effort (its "
                                  'thinking mode is set with chat_template_kwargs, e.g. {"thinking": true})')
        if conversation.response_format is not None and conversation.response_format.get("type") != "text":
            raise ChatFormatError("response_format", "this model's chat template cannot state a response format "
                                  "(structured_outputs constrains the output without one)")
        messages = []
        for i, m in enumerate(conversation.messages):
            if m["role"] not in ("system", "user", "assistant") or m.get("tool_calls") or m.get("reasoning_content"):
                raise ChatFormatError(f"messages.{i}", f"a {m['role']!r} message with tool calls or reasoning has "
                                      "no place in this model's chat template")
            content = m.get("content") or ""
            if isinstance(content, list):  # [{"type": "text", "text": ...}, ...]: the text parts, joined
                if any(part.get("type") != "text" for part in content):
                    raise ChatFormatError(f"messages.{i}.content", "this model's chat template takes text parts "
                                          "only (no images)")
                content = "".join(part["text"] for part in content)
            messages.append({"role": m["role"], "content": content})
        try:
            text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False,
                                                      **conversation.template_kwargs)
        except Exception as e:  # noqa: BLE001 - a template error is the request's fault (jinja raises its own)
            raise ValueError(f"the chat template failed on these messages: {e}") from None
        thinking = self.reasoning_end is not None and text.rstrip().endswith(self.THINK_OPEN)
        return ChatPrompt(text, thinking)

    def parser(self, prompt: ChatPrompt, tools: list[dict] | None) -> OutputParser:
        return ThinkParser(prompt.thinking, self.reasoning_end, self.eos)

    def tool_call_grammar(self, tools, tool_choice, parallel_tool_calls) -> dict:
        raise ChatFormatError("tool_choice", "tool calling is not supported by this model's chat template")
