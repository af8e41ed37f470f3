"""POST /v1/chat/completions: messages -> the model's chat prompt (its ChatFormat) -> choices of assistant messages
(reasoning_content, content, tool_calls), streamed as deltas or whole.

Tool calls: the tools ride in the prompt as the chat format renders them (tool_choice "none" leaves them out); the
generated markup is parsed into `tool_calls` (streamed per complete argument, finish_reason "tool_calls"), never
into content. A call cut by max_tokens keeps what was generated (finish_reason "length"): its arguments are "{" and
the complete parameters, unclosed, in the whole answer as in the stream. tool_choice "required" or a named function,
strict tools and parallel_tool_calls false are forced by the format's tool-call grammar; response_format json_object
/ json_schema and the structured_outputs extension by theirs. In thinking mode no constraint applies until the
reasoning has ended."""
from __future__ import annotations

import time
import uuid

from fastapi import Request
from fastapi.responses import Response

from common.engine.sampling_params import StructuredOutputsParams

from .chat_format import ChatFormat, ChatFormatError, ChatPrompt, Conversation, Delta, OutputParser, ParsedMessage
from .http_utils import APIError
from .openai_serving import OpenAIServing
from .protocol import ChatCompletionRequest, NamedToolChoice
from .streams import TextStream, chat_logprobs


class OpenAIServingChat:
    def __init__(self, serving: OpenAIServing, chat_format: ChatFormat):
        self.serving, self.chat_format = serving, chat_format
        end = chat_format.reasoning_end
        vocab = serving.tokenizer.get_vocab()
        self.reasoning_end_id = vocab.get(end) if end is not None else None

    def prepare(self, conversation: Conversation, tool_choice: str | dict | None, parallel_tool_calls: bool | None,
                forces_tool_calls: bool, constraint: StructuredOutputsParams | None
                ) -> tuple[ChatPrompt, StructuredOutputsParams | None]:
        """A conversation's prompt and constraint: the format's tool-call grammar when forces_tool_calls (tool_choice
        None: "auto"), else `constraint` (a response format's or structured outputs'); in thinking mode it starts
        after the reasoning. ChatFormatError naming the chat request field at fault (messages, tools, tool_choice,
        response_format, reasoning_effort, chat_template_kwargs); each endpoint names its own."""
        try:
            prompt = self.chat_format.encode(conversation)
        except ValueError as e:
            raise ChatFormatError(getattr(e, "param", "messages"), str(e)) from None
        if forces_tool_calls:
            try:
                tag = self.chat_format.tool_call_grammar(conversation.tools, tool_choice or "auto",
                                                         parallel_tool_calls is not False)
            except ValueError as e:
                raise ChatFormatError(getattr(e, "param", "tool_choice"), str(e)) from None
            constraint = StructuredOutputsParams(structural_tag=tag)
        if constraint is not None and prompt.thinking:  # free reasoning first; the constraint starts after its end
            if self.reasoning_end_id is None:
                raise ChatFormatError("chat_template_kwargs", "structured output in thinking mode needs the "
                                      "reasoning-end token, which this tokenizer lacks")
            constraint.reasoning_end_token_id = self.reasoning_end_id
        return prompt, constraint

    def render(self, body: ChatCompletionRequest) -> tuple[ChatPrompt, StructuredOutputsParams | None]:
        """The prompt and the constraint of a request (400 for what the format or the grammar refuses)."""
        conversation = Conversation([m.as_input() for m in body.messages], body.active_tools,
                                    body.response_format.model_dump(by_alias=True, exclude_none=True)
                                    if body.response_format is not None else None,
                                    body.reasoning_effort, dict(body.chat_template_kwargs or {}))
        choice = body.tool_choice.model_dump() if isinstance(body.tool_choice, NamedToolChoice) else body.tool_choice
        constraint = (body.structured_outputs.constraint() if body.structured_outputs is not None
                      else body.response_format.constraint() if body.response_format is not None else None)
        try:
            return self.prepare(conversation, choice, body.parallel_tool_calls, body.forces_tool_calls, constraint)
        except ChatFormatError as e:
            raise APIError(400, f"{e.param}: {e}", param=e.param) from None

    def decoder(self, prompt: ChatPrompt, tools: list[dict] | None, stop: list[str]) -> ChoiceDecoder:
        return ChoiceDecoder(self.serving.tokenizer, self.chat_format.parser(prompt, tools), stop)

    async def create(self, body: ChatCompletionRequest, raw: Request):
        s, tokenizer = self.serving, self.serving.tokenizer
        arrival, created = time.perf_counter(), int(time.time())
        s.check_model(body.model)
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        prompt, constraint = self.render(body)
        await s.check_constraint(constraint, "tool_choice" if body.forces_tool_calls else
                                 "structured_outputs" if body.structured_outputs is not None else "response_format")
        ids, mm_inputs = await s.place_images(s.tokenize(prompt.text, body.add_special_tokens), prompt.images)
        prompts = [ids]  # images expanded: usage's prompt_tokens counts their tokens
        tools = body.active_tools
        decoders = [self.decoder(prompt, tools, body.stop_strings) for _ in range(body.n)]
        head = {"id": request_id, "object": "chat.completion.chunk" if body.stream else "chat.completion",
                "created": created, "model": s.model_name}

        def params(ids: list[int], index: int):
            return body.sampling_params(len(ids), s.max_model_len, index=index, structured_outputs=constraint,
                                        skip_special_tokens=False)  # the parser reads the markup

        def logprobs(i, out):
            return chat_logprobs(tokenizer, decoders[i].stream.new_logprobs(out)) if body.logprobs else None

        def deltas(i, out) -> list[Delta]:
            return decoders[i].deltas(out)

        def finish_reason(i, out) -> str | None:
            return decoders[i].finish_reason(out)

        if body.stream:
            started = await s.unless_disconnected(raw, s.submit(prompts, params, body.n, request_id, raw, mm_inputs))
            if started is None:
                return Response(status_code=499)  # gone before its first token (PD: while P prefilled)
            role_sent = set()

            def make_chunk(i, out):
                delta = delta_message(deltas(i, out))
                if i not in role_sent:
                    role_sent.add(i)
                    delta = {"role": "assistant", **delta}
                elif not delta and not out.finished and not body.logprobs:
                    return None
                if not delta or delta.keys() == {"role"}:
                    delta["content"] = ""
                return {**head, "choices": [{"index": i, "delta": delta, "logprobs": logprobs(i, out),
                                             "finish_reason": finish_reason(i, out)}]}

            return s.chunk_stream(started, arrival, make_chunk, head, prompts if body.include_usage else None)

        finals = await s.generate_whole(prompts, params, body.n, request_id, arrival, raw, mm_inputs)
        if finals is None:
            return Response(status_code=499)  # nobody is listening
        choices = []
        for i in range(len(finals)):
            message = ParsedMessage.from_deltas(deltas(i, finals[i]), prompt.thinking).to_message()
            if message.get("tool_calls") and not message["content"]:
                message["content"] = None  # OpenAI's shape for a reply that is only calls
            choices.append({"index": i, "message": message, "logprobs": logprobs(i, finals[i]),
                            "finish_reason": finish_reason(i, finals[i])})
        return {**head, "choices": choices, "usage": s.usage(prompts, finals)}


class ChoiceDecoder:
    """One choice's generated text (special tokens kept, held back at a possible stop string) through the chat
    format's parser: each engine output's deltas, and the finish reason ("tool_calls" for a stop after calls)."""

    def __init__(self, tokenizer, parser: OutputParser, stop: list[str]):
        self.stream, self.parser = TextStream(tokenizer, stop), parser

    def deltas(self, out) -> list[Delta]:
        text = self.stream.update(out)
        return self.parser.feed(text) + (self.parser.finish() if out.finished else [])

    def finish_reason(self, out) -> str | None:
        if not out.finished:
            return None
        return "tool_calls" if out.finish_reason == "stop" and self.parser.has_tool_calls else out.finish_reason


def delta_message(deltas: list[Delta]) -> dict:
    """One chunk's delta from a step's parsed pieces: reasoning and content joined, tool-call pieces merged by call
    (OpenAI's streamed shape: the first piece of a call has id, type and name, later ones argument text)."""
    out, calls = {}, []
    for d in deltas:
        if d.reasoning_content is not None:
            out["reasoning_content"] = out.get("reasoning_content", "") + d.reasoning_content
        elif d.content is not None:
            out["content"] = out.get("content", "") + d.content
        else:
            c = d.tool_call
            if calls and calls[-1]["index"] == c.index and c.id is None:
                calls[-1]["function"]["arguments"] += c.arguments
                continue
            entry = {"index": c.index, "function": {"arguments": c.arguments}}
            if c.id is not None:
                entry = {"index": c.index, "id": c.id, "type": "function",
                         "function": {"name": c.name, "arguments": c.arguments}}
            calls.append(entry)
    if calls:
        out["tool_calls"] = calls
    return out
