"""DeepSeek-V4's chat format for the server (the ChatFormat contract of common/serving/chat_format.py): prompts from
encoding_deepseek_v4 (the publisher's rules), outputs parsed by its StreamingParser, tool calls forced by xgrammar's
builtin `deepseek_v4` structural tag (the DSML markup with typed parameters).

Thinking mode is chat_template_kwargs' `thinking` (or `enable_thinking`, vLLM's other name), default off (chat);
`drop_thinking` may be given too. The tool-call grammar is built without a reasoning part: the engine applies it only
once `</think>` has been generated (StructuredOutputsParams.reasoning_end_token_id)."""
from __future__ import annotations

import xgrammar as xgr

from common.serving.chat_format import ChatFormatError, ChatPrompt, Conversation
from encoding_deepseek_v4 import REASONING_EFFORTS, THINK_END, StreamingParser, encode_chat

TEMPLATE_KWARGS = ("thinking", "enable_thinking")
# whitespace the tool-call grammar allows between its tags and JSON tokens: the publisher's markup has one newline,
# and an unbounded run is where a weak or unlucky sample wanders off until max_tokens
MAX_WHITESPACE = 2


class DeepseekV4ChatFormat:
    reasoning_end = THINK_END

    def encode(self, conversation: Conversation) -> ChatPrompt:
        kwargs = conversation.template_kwargs
        unknown = sorted(set(kwargs) - set(TEMPLATE_KWARGS))
        if unknown:
            raise ChatFormatError(f"chat_template_kwargs.{unknown[0]}", f"{', '.join(unknown)}: not understood by "
                                  f"DeepSeek-V4's chat format (it takes {', '.join(TEMPLATE_KWARGS)})")
        thinking = kwargs.get("thinking", kwargs.get("enable_thinking", False))
        if not isinstance(thinking, bool):
            raise ChatFormatError("chat_template_kwargs.thinking", f"must be true or false, got {thinking!r}")
        effort = conversation.reasoning_effort
        if effort not in REASONING_EFFORTS:
            raise ChatFormatError("reasoning_effort", f"{effort!r} is not a DeepSeek-V4 reasoning effort; it takes "
                                  f"{' or '.join(repr(e) for e in REASONING_EFFORTS if e)} (or null)")
        if effort is not None and not thinking:
            raise ChatFormatError("reasoning_effort", "reasoning_effort applies to thinking mode: send "
                                  'chat_template_kwargs {"thinking": true} with it')
        response_format = conversation.response_format
        if response_format is not None and response_format.get("type") == "text":
            response_format = None
        images = []
        text = encode_chat(conversation.messages, tools=conversation.tools, response_format=response_format,
                           thinking=thinking, reasoning_effort=conversation.reasoning_effort, images=images)
        return ChatPrompt(text, thinking, tuple(images))

    def parser(self, prompt: ChatPrompt, tools: list[dict] | None) -> StreamingParser:
        return StreamingParser(prompt.thinking, tools)

    def tool_call_grammar(self, tools: list[dict], tool_choice: str | dict, parallel_tool_calls: bool) -> dict:
        """Every tool's arguments are forced to its `parameters` schema once the grammar applies (xgrammar lets a
        non-strict tool's call carry any JSON: a forced call would then be free to be `{}`)."""
        tools = [{**t, "function": {**t["function"], "strict": True}} for t in tools]
        tag = xgr.get_model_structural_tag("deepseek_v4", tools=tools, tool_choice=tool_choice, reasoning=False,
                                           parallel_tool_calls=parallel_tool_calls, max_whitespace_cnt=MAX_WHITESPACE)
        return tag.model_dump(mode="json")
