r"""DeepSeek-V4 chat format: messages -> prompt text, and completion text -> assistant message with DSML tool calls.

The publisher ships the format as Python (`encoding/encoding_dsv4.py` in the DeepSeek-V4-Flash / -Pro repos, no
Jinja chat template); this module follows those rules.

Prompt (`encode_messages`, `encode_chat`):

    BOS [REASONING_EFFORT_MAX] system-content["\n\n" TOOLS]["\n\n" RESPONSE FORMAT]
    <｜User｜>user text<｜Assistant｜></think>answer<｜end▁of▁sentence｜>   (chat, or earlier turns in thinking)
    <｜User｜>question<｜Assistant｜><think>reasoning</think>answer
    \n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name="f">\n
    <｜DSML｜parameter name="k" string="true">v</｜DSML｜parameter>\n
    </｜DSML｜invoke>\n</｜DSML｜tool_calls><｜end▁of▁sentence｜>
    <｜User｜><tool_result>...</tool_result>\n\n<tool_result>...</tool_result><｜Assistant｜><think>
    <｜User｜>What is this?\n\n<｜deepseek_image｜><｜Assistant｜></think>   (Vision-Exp: an image part, one placeholder)

Images (DeepSeek-V4-Flash-Vision-Exp's `encoding_dsv4.py`): a content part {"type": "image_url", "image_url": {"url":
...}} (or Anthropic's {"type": "image", "source": ...}) becomes a text part holding one `<｜deepseek_image｜>`, joined
with the message's other parts by a blank line; text holding the placeholder itself is refused. The image parts come
back in prompt order (`images=`), for the image processor to expand each placeholder.

Output (`parse_completion`, `StreamingParser`): the generated text decoded with special tokens kept. In thinking
mode it starts inside the reasoning (the prompt ends with `<think>`), which ends at `</think>` or at the first DSML
tag (V4-Flash sometimes skips `</think>`); the content ends at the first DSML tag or at EOS.

Rules for text the publisher's parser rejects (here nothing raises and no DSML markup reaches `content`):
- `<think>` anywhere and `</think>` after the reasoning are dropped from the text.
- The first `<｜DSML｜` or `</｜DSML｜` tag (with one blank line "\n\n" right before it) ends the text and opens the
  tool-call block, whether or not it is `<｜DSML｜tool_calls>`. Inside the block only well-formed `invoke` and
  `parameter` tags count: other text and unknown or broken tags are skipped; a parameter outside an invoke and a
  repeated parameter name (the first one wins) are skipped. `</｜DSML｜tool_calls>` ends the message: what follows it
  is dropped. A new `invoke` closes an unclosed previous one.
- EOS ends the message anywhere, also inside a block: complete calls stay, an open call keeps its complete
  parameters and is closed, an unfinished parameter or tag is dropped. Text that ends inside a call without EOS (cut
  by max_tokens or a stop string) leaves that call's arguments as far as they were generated: "{" and its complete
  parameters, never closed (not valid JSON: the call is unfinished), the unfinished parameter or tag dropped; vLLM's
  DSML parser (`deepseekv32_tool_parser.py`) likewise streams no "}" before `</｜DSML｜invoke>`. A truncated tag at
  the very end of the text (a prefix of `<｜DSML｜` or EOS) is dropped with the blank line before it.
- A call to a tool not in `tools` is returned as written (the client answers it with an error); its parameters
  follow only their string flags.

Parameter values -> JSON: `string="true"` -> the raw text as a JSON string. `string="false"` (or no flag) -> the text
parsed as JSON (NaN, Infinity and overflowing numbers refused). When that fails, the property's type in the tool's
JSON schema (`type`, or the types in `anyOf` / `oneOf`) decides: boolean reads true/false in any case, integer /
number read what Python int() / float() read (finite), null reads None; in every other case the raw text becomes a
JSON string. So `arguments` is a valid JSON object (but for a call the text ended in, above), parameters in emitted
order, each value re-serialized with `json.dumps(..., ensure_ascii=False)`.
"""
from __future__ import annotations

import json
import math
import re
import secrets
from dataclasses import dataclass, field

from common.serving.chat_format import Delta, ParsedMessage, ToolCall, ToolCallDelta  # the server's currency

__all__ = ["encode_messages", "encode_chat", "parse_completion", "StreamingParser", "new_tool_call_id", "Delta",
           "ParsedMessage", "ToolCall", "ToolCallDelta", "BOS", "EOS", "THINK_START", "THINK_END",
           "REASONING_EFFORTS", "REASONING_EFFORT_MAX", "TOOLS_TEMPLATE"]

BOS, EOS = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"
USER, ASSISTANT = "<｜User｜>", "<｜Assistant｜>"
THINK_START, THINK_END = "<think>", "</think>"
DSML = "｜DSML｜"
TOOL_CALLS_START, TOOL_CALLS_END = f"<{DSML}tool_calls>", f"</{DSML}tool_calls>"
INVOKE_END, PARAMETER_END = f"</{DSML}invoke>", f"</{DSML}parameter>"
ROLES = ("system", "developer", "user", "assistant", "tool")
IMAGE_PLACEHOLDER = "<｜deepseek_image｜>"
IMAGE_PARTS = ("image_url", "image")
REASONING_EFFORTS = (None, "high", "max")  # only "max" changes the prompt

REASONING_EFFORT_MAX = (
    "Reasoning Effort: Absolute maximum with no shortcuts permitted.\n"
    "You MUST be very thorough in your thinking and comprehensively decompose the problem to resolve the root cause,"
    " rigorously stress-testing your logic against all potential paths, edge cases, and adversarial scenarios.\n"
    "Explicitly write out your entire deliberation process, documenting every intermediate step, considered"
    " alternative, and rejected hypothesis to ensure absolutely no assumption is left unchecked.\n\n"
)
TOOLS_TEMPLATE = f"""## Tools

You have access to a set of tools to help answer the user's question. You can invoke tools by writing a "{TOOL_CALLS_START}" block like the following:

{TOOL_CALLS_START}
<{DSML}invoke name="$TOOL_NAME">
<{DSML}parameter name="$PARAMETER_NAME" string="true|false">$PARAMETER_VALUE{PARAMETER_END}
...
{INVOKE_END}
<{DSML}invoke name="$TOOL_NAME2">
...
{INVOKE_END}
{TOOL_CALLS_END}

String parameters should be specified as is and set `string="true"`. For all other types (numbers, booleans, arrays, objects), pass the value in JSON format and set `string="false"`.

If thinking_mode is enabled (triggered by {THINK_START}), you MUST output your complete reasoning inside {THINK_START}...{THINK_END} BEFORE any tool calls or final response.

Otherwise, output directly after {THINK_END} with tool calls or final response.

### Available Tool Schemas

{{tool_schemas}}

You MUST strictly follow the above defined tool name and parameter schemas to invoke tool calls.
"""
RESPONSE_FORMAT_TEMPLATE = "## Response Format:\n\nYou MUST strictly adhere to the following schema to reply:\n{schema}"


def _to_json(value, where: str) -> str:
    try:
        return json.dumps(value, ensure_ascii=False)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{where}: not JSON-serializable ({e})") from None


# ---------------------------------------------------------------- encoding


@dataclass
class _Turn:
    """One rendered turn: consecutive user and tool messages merge into one user turn of blocks."""
    role: str
    text: str = ""
    reasoning: str | None = None
    calls: list[tuple[str, dict]] = field(default_factory=list)  # (name, arguments)
    tools: list[dict] = field(default_factory=list)  # function definitions
    response_format: dict | None = None
    blocks: list[tuple[str, int, list]] = field(default_factory=list)  # (rendered block, tool-call position or -1,
    #   its image parts)
    images: list[dict] = field(default_factory=list)  # image parts of a system / developer turn


def _text(content, where: str, images: list | None = None) -> str:
    """Message content as text: None, a string, or a list of text and image parts (joined by a blank line). Image
    parts become the image placeholder and are appended to `images` (None: refused, with the placeholder in text)."""
    if content is None:
        return ""
    if isinstance(content, str):
        _no_placeholder(content, f"{where}.content")
        return content
    if not isinstance(content, list):
        raise ValueError(f"{where}.content must be a string or a list of text parts, got {type(content).__name__}")
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in IMAGE_PARTS and images is not None:
            texts.append(IMAGE_PLACEHOLDER)
            images.append(part)
            continue
        if kind != "text" or not isinstance(part.get("text"), str):
            allowed = "text and image parts are" if images is not None else "only text parts are"
            raise ValueError(f"{where}.content[{j}]: {allowed} supported, got type {kind!r}")
        _no_placeholder(part["text"], f"{where}.content[{j}]")
        texts.append(part["text"])
    return "\n\n".join(texts)


def _no_placeholder(text: str, where: str) -> None:
    if IMAGE_PLACEHOLDER in text:
        raise ValueError(f"{where} holds the image placeholder {IMAGE_PLACEHOLDER}: send images as image_url parts")


def _functions(tools, where: str) -> list[dict]:
    """OpenAI tool definitions [{"type": "function", "function": {...}}] -> their function dicts."""
    if not isinstance(tools, list):
        raise ValueError(f"{where}: tools must be a list")
    out = []
    for j, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) else None
        ok = isinstance(fn, dict) and tool.get("type", "function") == "function" and isinstance(fn.get("name"), str)
        if not ok:
            raise ValueError(f'{where}: tools[{j}] must be {{"type": "function", "function": {{"name": ..., ...}}}}')
        out.append(fn)
    return out


def _tool_calls(calls, where: str) -> tuple[list[tuple[str, dict]], list[str]]:
    """OpenAI assistant tool_calls -> [(name, arguments dict)] and their ids."""
    if not isinstance(calls, list):
        raise ValueError(f"{where}.tool_calls must be a list")
    out, ids = [], []
    for j, call in enumerate(calls):
        at = f"{where}.tool_calls[{j}]"
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise ValueError(f'{at} must be {{"id": ..., "type": "function", "function": {{"name", "arguments"}}}}')
        args = fn.get("arguments")
        if args is None or (isinstance(args, str) and not args.strip()):
            args = {}
        elif isinstance(args, str):
            try:
                args = json.loads(args)
            except ValueError as e:
                raise ValueError(f"{at}.function.arguments is not valid JSON ({e})") from None
        if not isinstance(args, dict):
            raise ValueError(f"{at}.function.arguments must be a JSON object")
        if call.get("id") is not None:
            if call["id"] in ids:
                raise ValueError(f"{at}: duplicate tool call id {call['id']!r}")
            ids.append(call["id"])
        out.append((fn["name"], args))
    return out, ids


def _merge(messages, images: bool = False) -> list[_Turn]:
    """Validate OpenAI-style messages; merge tool results (and adjacent user text) into user turns, tool results
    ordered by the preceding assistant's tool_calls. images: image parts are taken (else refused), kept with their
    block or turn."""
    if not isinstance(messages, list) or not messages:
        raise ValueError("messages must be a non-empty list")
    turns: list[_Turn] = []
    call_position: dict[str, int] = {}  # id -> index in the latest assistant message's tool_calls
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        role = m.get("role") if isinstance(m, dict) else None
        if role not in ROLES:
            raise ValueError(f"{where}: unknown role {role!r} (supported: {', '.join(ROLES)})")
        if role in ("user", "tool"):
            if role == "tool":
                cid = m.get("tool_call_id")
                if not cid:
                    raise ValueError(f"{where}: tool message without tool_call_id")
                if cid not in call_position:
                    raise ValueError(f"{where}: tool_call_id {cid!r} matches no tool call of the preceding "
                                     "assistant message")
                parts = [] if images else None
                block = (f"<tool_result>{_text(m.get('content'), where, parts)}</tool_result>", call_position[cid],
                         parts or [])
            else:
                parts = [] if images else None
                block = (_text(m.get("content"), where, parts), -1, parts or [])
            if not (turns and turns[-1].role == "user"):
                turns.append(_Turn("user"))
            turns[-1].blocks.append(block)
        elif role == "assistant":
            reasoning = m.get("reasoning_content", m.get("reasoning"))
            if reasoning is not None and not isinstance(reasoning, str):
                raise ValueError(f"{where}.reasoning_content must be a string")
            calls, ids = _tool_calls(m.get("tool_calls") or [], where)
            call_position = {cid: j for j, cid in enumerate(ids)}
            turns.append(_Turn("assistant", _text(m.get("content"), where), reasoning, calls))
        else:
            parts = [] if images else None
            text = _text(m.get("content"), where, parts)
            if role == "developer" and not text:
                raise ValueError(f"{where}: developer message with empty content")
            fmt = m.get("response_format")
            if fmt is not None and not isinstance(fmt, dict):
                raise ValueError(f"{where}.response_format must be an object")
            tools = _functions(m["tools"], where) if m.get("tools") else []
            turns.append(_Turn(role, text, tools=tools, response_format=fmt or None, images=parts or []))
    for t in turns:  # tool results in call order; text blocks keep their places
        results = iter(sorted((b for b in t.blocks if b[1] >= 0), key=lambda b: b[1]))
        t.blocks = [next(results) if b[1] >= 0 else b for b in t.blocks]
    return turns


def _render_tools(functions: list[dict]) -> str:
    schemas = "\n".join(_to_json(fn, "tools") for fn in functions)
    return TOOLS_TEMPLATE.format(tool_schemas=schemas)


def _render_arguments(arguments: dict, where: str) -> str:
    return "\n".join(
        f'<{DSML}parameter name="{k}" string="{"true" if isinstance(v, str) else "false"}">'
        f'{v if isinstance(v, str) else _to_json(v, where)}{PARAMETER_END}' for k, v in arguments.items())


def _render(t: _Turn, keep_reasoning: bool) -> str:
    if t.role == "assistant":
        out = (t.reasoning or "") + THINK_END if keep_reasoning else ""
        out += t.text
        if t.calls:
            invokes = "\n".join(f'<{DSML}invoke name="{name}">\n{_render_arguments(args, name)}\n{INVOKE_END}'
                                for name, args in t.calls)
            out += f"\n\n{TOOL_CALLS_START}\n{invokes}\n{TOOL_CALLS_END}"
        return out + EOS
    if t.role == "user":
        return USER + "\n\n".join(text for text, _, _ in t.blocks)
    out = (USER if t.role == "developer" else "") + t.text
    if t.tools:
        out += "\n\n" + _render_tools(t.tools)
    if t.response_format:
        out += "\n\n" + RESPONSE_FORMAT_TEMPLATE.format(schema=_to_json(t.response_format, "response_format"))
    return out


def _last_user(turns: list[_Turn]) -> int:
    return max((i for i, t in enumerate(turns) if t.role in ("user", "developer")), default=-1)


def encode_messages(messages: list[dict], thinking: bool = False, reasoning_effort: str | None = None,
                    drop_thinking: bool = True, add_bos: bool = True, images: list | None = None) -> str:
    """The DeepSeek-V4 prompt for `messages` (OpenAI-style dicts).

    Roles: system (raw content; may carry `tools` in OpenAI format and `response_format`), developer (a user turn
    that may carry them too), user, assistant (`reasoning_content` or `reasoning`, `content`, `tool_calls` with
    JSON-string or object arguments), tool (`tool_call_id` naming a call of the preceding assistant message).
    Content is a string or a list of text parts (joined by "\\n\\n"). After the last user / developer turn (and
    after any one followed by an assistant turn) comes `<｜Assistant｜><think>` in thinking mode, `</think>` else.
    drop_thinking (thinking mode): assistant reasoning and developer turns before the last user turn are dropped;
    forced off when any message carries tools. reasoning_effort: None, "high" (same prompt) or "max" (prepends
    REASONING_EFFORT_MAX in thinking mode). images: a list that receives the image parts of user, tool, system and
    developer messages in prompt order, each rendered as one image placeholder (None: image parts are refused).
    Raises ValueError naming the bad message or field.
    """
    if reasoning_effort not in REASONING_EFFORTS:
        raise ValueError(f"reasoning_effort must be one of None, 'high', 'max', got {reasoning_effort!r}")
    turns = _merge(messages, images is not None)
    drop = drop_thinking and not any(t.tools for t in turns)
    if thinking and drop:
        last = _last_user(turns)
        turns = [t if i >= last or t.role != "assistant" else _Turn("assistant", t.text, None, t.calls)
                 for i, t in enumerate(turns) if i >= last or t.role != "developer"]
    last = _last_user(turns)
    out = [BOS] if add_bos else []
    for i, t in enumerate(turns):
        if i == 0 and thinking and reasoning_effort == "max":
            out.append(REASONING_EFFORT_MAX)
        out.append(_render(t, thinking and (not drop or i > last)))
        if images is not None:
            images += t.images + [part for block in t.blocks for part in block[2]]
        following = turns[i + 1].role if i + 1 < len(turns) else None
        if t.role in ("user", "developer") and following in (None, "assistant"):
            out.append(ASSISTANT + (THINK_START if thinking and (not drop or i >= last) else THINK_END))
    return "".join(out)


def encode_chat(messages: list[dict], tools: list[dict] | None = None, response_format: dict | None = None,
                thinking: bool = False, reasoning_effort: str | None = None, images: list | None = None) -> str:
    """The prompt for an OpenAI chat-completions request.

    tools (OpenAI `{"type": "function", "function": {...}}` list) and response_format (`{"type": "text"}` = none,
    `{"type": "json_object"}`, `{"type": "json_schema", "json_schema": {name, schema, strict}}`, rendered as given)
    go on the first system message when there is one, else on a new empty system message at index 0. `tools=[]` is
    no tools. The conversation must end with a user, developer or tool message (the prompt ends in the generation
    prompt). Reasoning of earlier turns is dropped unless tools are given. images: as encode_messages.
    """
    if not isinstance(messages, list) or not messages:
        raise ValueError("messages must be a non-empty list")
    if response_format is not None:
        kind = response_format.get("type") if isinstance(response_format, dict) else None
        if kind not in ("text", "json_object", "json_schema"):
            raise ValueError(f"response_format.type must be 'text', 'json_object' or 'json_schema', got {kind!r}")
        if kind == "json_schema" and not isinstance(response_format.get("json_schema"), dict):
            raise ValueError("response_format of type 'json_schema' needs a 'json_schema' object")
        if kind == "text":
            response_format = None
    if tools is not None:
        _functions(tools, "tools")
    last = messages[-1].get("role") if isinstance(messages[-1], dict) else None
    if last not in ("user", "developer", "tool"):
        raise ValueError(f"the last message must be from user, developer or tool, got role {last!r}")
    messages = list(messages)
    if tools or response_format:
        extra = {"tools": tools or None, "response_format": response_format}
        first = next((i for i, m in enumerate(messages) if isinstance(m, dict) and m.get("role") == "system"), None)
        if first is None:
            _merge(messages, images is not None)  # errors name the request's own message indices
            messages.insert(0, {"role": "system", "content": "", **extra})
        elif messages[first].get("tools") or messages[first].get("response_format"):
            raise ValueError(f"messages[{first}] already carries tools or response_format")
        else:
            messages[first] = {**messages[first], **extra}
    return encode_messages(messages, thinking=thinking, reasoning_effort=reasoning_effort, images=images)


# ---------------------------------------------------------------- parsing


def new_tool_call_id() -> str:
    """An OpenAI-style call id: "call_" + 24 hex digits."""
    return "call_" + secrets.token_hex(12)


def _types(schema) -> set[str]:
    """The JSON-schema types a property allows (its `type`, and those of its `anyOf` / `oneOf` branches)."""
    if not isinstance(schema, dict):
        return set()
    t = schema.get("type")
    found = {t} if isinstance(t, str) else {x for x in t if isinstance(x, str)} if isinstance(t, list) else set()
    for key in ("anyOf", "oneOf"):
        branches = schema.get(key)
        for branch in branches if isinstance(branches, list) else []:
            found |= _types(branch)
    return found


def _schema_types(tools) -> dict[str, dict[str, set[str]]]:
    """tool name -> parameter name -> allowed JSON-schema types; tools in OpenAI or flat form."""
    out = {}
    for tool in tools or []:
        fn = tool.get("function", tool) if isinstance(tool, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            continue
        params = fn.get("parameters")
        props = params.get("properties") if isinstance(params, dict) else None
        out[fn["name"]] = {k: _types(v) for k, v in props.items()} if isinstance(props, dict) else {}
    return out


def _refuse_constant(name):
    raise ValueError(f"{name} is not JSON")


def _value_json(value: str, string: str | None, types: set[str]) -> str:
    """One DSML parameter value as JSON text (rules in the module docstring)."""
    if string == "true":
        return json.dumps(value, ensure_ascii=False)
    try:
        return json.dumps(json.loads(value, parse_constant=_refuse_constant), ensure_ascii=False, allow_nan=False)
    except (ValueError, RecursionError):
        pass
    s = value.strip()
    if "boolean" in types and s.lower() in ("true", "false"):
        return s.lower()
    if "null" in types and s == "None":
        return "null"
    for kind, read in (("integer", int), ("number", float)):
        if kind in types:
            try:
                x = read(s)
            except ValueError:
                continue
            if kind == "integer" or math.isfinite(x):
                return json.dumps(x)
    return json.dumps(value, ensure_ascii=False)


_REASONING, _CONTENT, _BLOCK, _PARAMETER, _DONE = range(5)
_DSML_OPEN, _DSML_CLOSE = f"<{DSML}", f"</{DSML}"
_TEXT_STOPS = (EOS, THINK_START, THINK_END, _DSML_OPEN, _DSML_CLOSE)
_TEXT_HOLDS = _TEXT_STOPS + ("\n\n" + _DSML_OPEN, "\n\n" + _DSML_CLOSE)
_BLOCK_STOPS = (EOS, _DSML_OPEN, _DSML_CLOSE)
_PARAMETER_STOPS = (EOS, PARAMETER_END)
_INVOKE_RE = re.compile(rf'<{DSML}invoke\s+name="([^"]+)"\s*>')
_PARAMETER_RE = re.compile(rf'<{DSML}parameter\s+name="([^"]+)"(?:\s+string="(true|false)")?\s*>')
_TAG_EDGE = re.compile(r"[<>]")


def _first(text: str, stops: tuple[str, ...]) -> tuple[int, str | None]:
    """Position and value of the earliest of `stops` in `text` (len(text), None if none)."""
    best, hit = len(text), None
    for s in stops:
        p = text.find(s, 0, best + len(s))
        if p != -1 and p < best:
            best, hit = p, s
    return best, hit


def _held(text: str, stops: tuple[str, ...]) -> int:
    """Length of the longest end of `text` that is a proper prefix of one of `stops`."""
    for k in range(min(len(text), max(map(len, stops)) - 1), 0, -1):
        tail = text[-k:]
        if any(len(s) > k and s.startswith(tail) for s in stops):
            return k
    return 0


class StreamingParser:
    """Incremental parse of generated text into reasoning / content / tool-call deltas.

    feed(delta_text) -> deltas decided so far; finish() -> the rest. Text that may start markup (a trailing `<`,
    a partial `<｜DSML｜`, `</think>` or EOS, or the blank line before a DSML tag) is held back until it proves
    otherwise. A call streams as: (index, id, name, "") once `invoke name="X">` is complete, then "{", then each
    complete parameter `"k": <json>` (", " before all but the first), then "}" at `</｜DSML｜invoke>` (or at the next
    invoke, the block's end or EOS); finish() on text that ended inside a call adds nothing to it. The deltas add up
    to `parse_completion` of the whole text, however it is split.
    """

    def __init__(self, thinking: bool, tools: list[dict] | None = None):
        self.thinking = thinking
        self._types = _schema_types(tools)
        self._state = _REASONING if thinking else _CONTENT
        self._buf = ""
        self._value: list[str] = []  # the parameter value read so far
        self._calls = 0
        self._call: tuple[int, str] | None = None  # (index, tool name) of the open call
        self._seen: set[str] = set()  # its parameter names so far
        self._parameter: tuple[str, str | None] | None = None  # (name, string flag)
        self._finished = False

    @property
    def has_tool_calls(self) -> bool:
        """Whether any tool call has been produced (finish_reason "tool_calls")."""
        return self._calls > 0 or self._call is not None

    @property
    def reasoning_done(self) -> bool:
        """Whether the reasoning has ended (always, in chat mode): where a grammar may start constraining."""
        return self._state != _REASONING

    def feed(self, delta_text: str) -> list[Delta]:
        if self._finished:
            raise ValueError("feed() after finish()")
        self._buf += delta_text
        out: list[Delta] = []
        while self._step(out):
            pass
        return _join_text(out)

    def finish(self) -> list[Delta]:
        if self._finished:
            return []
        self._finished = True
        out: list[Delta] = []
        if self._state in (_REASONING, _CONTENT) and self._buf:
            tail = self._buf
            if "｜" in tail:  # a truncated special token or DSML tag
                tail = tail[:tail.index("<")].removesuffix("\n\n")
            self._emit_text(out, tail)
        # text ending inside a call (max_tokens, a stop string): its arguments stay unclosed, as generated
        self._state, self._buf = _DONE, ""
        return _join_text(out)

    # one decision on the buffer; True when another may follow
    def _step(self, out: list[Delta]) -> bool:
        if self._state in (_REASONING, _CONTENT):
            return self._step_text(out)
        if self._state == _BLOCK:
            return self._step_block(out)
        if self._state == _PARAMETER:
            return self._step_parameter(out)
        self._buf = ""
        return False

    def _emit_text(self, out: list[Delta], text: str):
        if text:
            out.append(Delta(reasoning_content=text) if self._state == _REASONING else Delta(content=text))

    def _step_text(self, out: list[Delta]) -> bool:
        buf = self._buf
        p, stop = _first(buf, _TEXT_STOPS)
        if stop is None:
            keep = _held(buf, _TEXT_HOLDS)
            self._emit_text(out, buf[:len(buf) - keep])
            self._buf = buf[len(buf) - keep:]
            return False
        if stop in (_DSML_OPEN, _DSML_CLOSE):
            self._emit_text(out, buf[:p].removesuffix("\n\n"))
            self._state, self._buf = _BLOCK, buf[p:]
            return True
        self._emit_text(out, buf[:p])
        self._buf = buf[p + len(stop):]
        if stop == EOS:
            self._state = _DONE
        elif stop == THINK_END and self._state == _REASONING:
            self._state = _CONTENT
        return True

    def _step_block(self, out: list[Delta]) -> bool:
        buf = self._buf
        p, stop = _first(buf, _BLOCK_STOPS)
        if stop is None:
            self._buf = buf[len(buf) - _held(buf, _BLOCK_STOPS):]
            return False
        if stop == EOS:
            self._close_call(out)
            self._state = _DONE
            return True
        edge = _TAG_EDGE.search(buf, p + 1)
        if edge is None:  # the tag is not complete yet
            self._buf = buf[p:]
            return False
        if edge.group() == "<":  # broken tag: skip to the next one
            self._buf = buf[edge.start():]
            return True
        tag, self._buf = buf[p:edge.end()], buf[edge.end():]
        if tag == TOOL_CALLS_END:
            self._close_call(out)
            self._state = _DONE
        elif tag == INVOKE_END:
            self._close_call(out)
        elif m := _INVOKE_RE.fullmatch(tag):
            self._close_call(out)
            self._call, self._seen = (self._calls, m.group(1)), set()
            out.append(Delta(tool_call=ToolCallDelta(self._calls, new_tool_call_id(), m.group(1), "")))
            out.append(Delta(tool_call=ToolCallDelta(self._calls, arguments="{")))
        elif m := _PARAMETER_RE.fullmatch(tag):
            self._parameter = (m.group(1), m.group(2))
            self._state = _PARAMETER
        return True  # <｜DSML｜tool_calls> and unknown tags: skipped

    def _step_parameter(self, out: list[Delta]) -> bool:
        buf = self._buf
        p, stop = _first(buf, _PARAMETER_STOPS)
        if stop is None:  # keep only what may start a stop in the buffer
            keep = _held(buf, _PARAMETER_STOPS)
            self._value.append(buf[:len(buf) - keep])
            self._buf = buf[len(buf) - keep:]
            return False
        name, string = self._parameter
        raw, self._parameter, self._value = "".join(self._value) + buf[:p], None, []
        if stop == EOS:
            self._close_call(out)
            self._state = _DONE
            return True
        self._buf, self._state = buf[p + len(stop):], _BLOCK
        if self._call is not None and name not in self._seen:
            index, tool = self._call
            value = _value_json(raw, string, self._types.get(tool, {}).get(name, set()))
            sep = ", " if self._seen else ""
            self._seen.add(name)
            key = json.dumps(name, ensure_ascii=False)
            out.append(Delta(tool_call=ToolCallDelta(index, arguments=f"{sep}{key}: {value}")))
        return True

    def _close_call(self, out: list[Delta]):
        if self._call is not None:
            out.append(Delta(tool_call=ToolCallDelta(self._call[0], arguments="}")))
            self._call = None
            self._calls += 1


def _join_text(deltas: list[Delta]) -> list[Delta]:
    """Merge neighbouring text deltas of the same kind."""
    out: list[Delta] = []
    for d in deltas:
        if out and d.tool_call is None and out[-1].tool_call is None and \
                (d.content is None) == (out[-1].content is None):
            prev = out[-1]
            out[-1] = Delta(content=prev.content + d.content) if d.content is not None else \
                Delta(reasoning_content=prev.reasoning_content + d.reasoning_content)
        else:
            out.append(d)
    return out


def parse_completion(text: str, thinking: bool, tools: list[dict] | None = None) -> ParsedMessage:
    """The assistant message in generated `text` (decoded with special tokens kept; a trailing EOS is dropped).
    thinking: the prompt ended with `<think>`. tools: the request's tool definitions (schema types for coercion).
    Tool call ids are fresh `call_` + 24 hex digits."""
    parser = StreamingParser(thinking, tools)
    return ParsedMessage.from_deltas(parser.feed(text) + parser.finish(), thinking)
