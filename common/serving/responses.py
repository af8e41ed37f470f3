"""POST /v1/responses (OpenAI's Responses API): input items -> the chat conversation -> the model's chat prompt (the
same prompt and constraint as chat.py makes of the same conversation) -> a response whose output items are the parsed
assistant message: a reasoning item (the reasoning as reasoning_text content, no summary), a message item
(output_text) and function_call items; whole, or as server-sent events `event: <type>\\ndata: <json>` with a
strictly increasing sequence_number and no [DONE].

Events: response.created, response.in_progress; per item response.output_item.added, then for reasoning and message
response.content_part.added, response.reasoning_text.delta / response.output_text.delta (logprobs []), their .done,
response.content_part.done, for a call response.function_call_arguments.delta (per complete argument) and .done;
response.output_item.done; last response.completed, or response.incomplete (max_output_tokens reached), with the
whole response (its output holds every item, with the ids the events used). A generation that fails ends the stream
with response.failed (status "failed", error {code: "server_error", message}).

Stored (response_store.py) unless `store` is false -- OpenAI's default is true -- once it ends (completed, incomplete
or failed; before its last event is sent, so the client can continue it at once); a server started with a store size
of 0 stores nothing (store true: 400). `previous_response_id` continues a stored response: its conversation and output
items, then this request's input (its own instructions and tools); an id not in the store (never stored, deleted or
evicted) is a 404 naming previous_response_id. GET /v1/responses/{id} returns a stored response, DELETE removes it
(404 when it is not in the store)."""
from __future__ import annotations

import itertools
import logging
import time
import uuid
from collections.abc import AsyncIterator

from fastapi import Request
from fastapi.responses import Response
from pydantic import ValidationError

from common.engine.sampling_params import StructuredOutputsParams

from .chat import OpenAIServingChat
from .chat_format import ChatFormatError, ChatPrompt, Conversation, Delta
from .http_utils import APIError
from .openai_serving import FAILED, OpenAIServing, sse
from .protocol_responses import ContinuationError, ResponsesRequest, encode_reasoning, output_items
from .response_store import ResponseStore

logger = logging.getLogger("npu_cookbook.serving")
# the chat request's field -> the Responses request's, for the chat format's refusals
CHAT_FIELDS = {"messages": "input", "response_format": "text.format", "reasoning_effort": "reasoning.effort",
               "chat_template_kwargs": "reasoning"}


def responses_field(chat_field: str) -> str:
    head = chat_field.split(".")[0]
    return CHAT_FIELDS.get(head, chat_field)


class OutputItems:
    """The output items a response's parsed deltas add up to, and the stream events that build them (without
    sequence numbers). An item opens at its first delta and closes when another kind starts or at finish; a reply
    with neither text nor calls still gets its (empty) message item."""

    def __init__(self, encrypted_reasoning: bool):
        self.items: list[dict] = []
        self.open: dict | None = None
        self.encrypted_reasoning = encrypted_reasoning

    def feed(self, deltas: list[Delta]) -> list[dict]:
        events = []
        for d in deltas:
            if d.reasoning_content is not None:
                if self.open is None or self.open["type"] != "reasoning":
                    events += self._start({"id": f"rs_{uuid.uuid4().hex}", "type": "reasoning", "summary": [],
                                           "content": [], "status": "in_progress"})
                events += self._text(d.reasoning_content, "response.reasoning_text.delta")
            elif d.content is not None:
                if self.open is None or self.open["type"] != "message":
                    events += self._start({"id": f"msg_{uuid.uuid4().hex}", "type": "message", "role": "assistant",
                                           "status": "in_progress", "content": []})
                events += self._text(d.content, "response.output_text.delta", logprobs=[])
            elif d.tool_call.id is not None:
                events += self._start({"id": f"fc_{uuid.uuid4().hex}", "type": "function_call",
                                       "call_id": d.tool_call.id, "name": d.tool_call.name, "arguments": "",
                                       "status": "in_progress"})
            else:
                self.open["arguments"] += d.tool_call.arguments
                events.append({"type": "response.function_call_arguments.delta", **self._where(),
                               "delta": d.tool_call.arguments})
        return events

    def finish(self, incomplete: bool) -> list[dict]:
        """Close the open item ("incomplete" when the response is); add the empty message a bare reply has."""
        events = self._close("incomplete" if incomplete else "completed")
        if not any(item["type"] in ("message", "function_call") for item in self.items):
            events += self._start({"id": f"msg_{uuid.uuid4().hex}", "type": "message", "role": "assistant",
                                   "status": "in_progress", "content": []})
            events += self._text("", None, logprobs=[]) + self._close("incomplete" if incomplete else "completed")
        return events

    def snapshot(self) -> list[dict]:
        """The items so far, the open one as it stands."""
        return [dict(item) for item in self.items]

    def _where(self) -> dict:
        """The open item's place (it is always the last one)."""
        return {"item_id": self.items[-1]["id"], "output_index": len(self.items) - 1}

    def _start(self, item: dict) -> list[dict]:
        events = self._close("completed")
        self.items.append(item)
        self.open = item
        events.append({"type": "response.output_item.added", "output_index": len(self.items) - 1,
                       "item": dict(item, content=[]) if "content" in item else dict(item)})
        if item["type"] in ("reasoning", "message"):
            part = ({"type": "reasoning_text", "text": ""} if item["type"] == "reasoning" else
                    {"type": "output_text", "text": "", "annotations": [], "logprobs": []})
            item["content"].append(part)
            events.append({"type": "response.content_part.added", **self._where(), "content_index": 0,
                           "part": dict(part)})
        return events

    def _text(self, text: str, event: str | None, **extra) -> list[dict]:
        self.open["content"][0]["text"] += text
        if event is None or not text:
            return []
        return [{"type": event, **self._where(), "content_index": 0, "delta": text, **extra}]

    def _close(self, status: str) -> list[dict]:
        item, self.open = self.open, None
        if item is None:
            return []
        where = self._where()
        item["status"] = status
        events = []
        if item["type"] == "function_call":
            events.append({"type": "response.function_call_arguments.done", **where,
                           "arguments": item["arguments"]})
        else:
            part = item["content"][0]
            kind = "response.reasoning_text.done" if item["type"] == "reasoning" else "response.output_text.done"
            extra = {} if item["type"] == "reasoning" else {"logprobs": []}
            events.append({"type": kind, **where, "content_index": 0, "text": part["text"], **extra})
            events.append({"type": "response.content_part.done", **where, "content_index": 0, "part": dict(part)})
            if item["type"] == "reasoning" and self.encrypted_reasoning:
                item["encrypted_content"] = encode_reasoning(part["text"])
        events.append({"type": "response.output_item.done", "output_index": where["output_index"],
                       "item": dict(item)})
        return events


class OpenAIServingResponses:
    def __init__(self, serving: OpenAIServing, chat: OpenAIServingChat, store: ResponseStore | None = None):
        self.serving, self.chat = serving, chat
        self.store = store if store is not None else ResponseStore()

    def stores(self, body: ResponsesRequest) -> bool:
        """Whether this response is stored: store true or null (OpenAI's default), when the server keeps a store."""
        if body.store and not self.store.enabled:
            raise APIError(400, "store: this server stores no responses (its store size is 0); send store: false",
                           param="store")
        return body.store is not False and self.store.enabled

    def continued(self, body: ResponsesRequest) -> ResponsesRequest:
        """The request after the stored conversation its previous_response_id names; 404 when that is not stored."""
        previous = body.previous_response_id
        if previous is None:
            return body
        entry = self.store.get(previous)
        if entry is None:
            raise APIError(404, f"previous_response_id: previous response with id {previous!r} not found (it was not "
                                f"stored, was deleted, or was evicted: this server keeps the last "
                                f"{self.store.max_entries} stored responses)", param="previous_response_id")
        try:
            history = list(entry.conversation) + output_items(entry.response["output"])
        except ValidationError:
            raise APIError(400, f"previous_response_id: response {previous!r} ends in a function call cut off before "
                                "its arguments were complete; it cannot be continued", param="previous_response_id")
        try:
            return body.continuing(history)
        except ContinuationError as e:
            raise APIError(400, f"{e.param}: {e}", param=e.param) from None

    def stored(self, response_id: str) -> dict:
        entry = self.store.get(response_id)
        if entry is None:
            raise APIError(404, f"response_id: response with id {response_id!r} not found (not stored, deleted or "
                                "evicted)", param="response_id")
        return entry.response

    async def retrieve(self, response_id: str, raw: Request):
        """GET /v1/responses/{response_id}: the stored response, whole (no query parameter but stream=false: there
        are no background responses whose events could be streamed again)."""
        for key, value in raw.query_params.multi_items():
            if not (key == "stream" and value.lower() == "false"):
                raise APIError(400, f"{key}: not supported by this server when retrieving a response (it is returned "
                                    "whole, as stored)", param=key)
        return self.stored(response_id)

    async def delete(self, response_id: str):
        """DELETE /v1/responses/{response_id}: removed from the store."""
        self.stored(response_id)
        self.store.pop(response_id)
        return {"id": response_id, "object": "response", "deleted": True}

    def render(self, body: ResponsesRequest) -> tuple[ChatPrompt, StructuredOutputsParams | None]:
        """The prompt and the constraint (chat.py's, for the conversation the input items are)."""
        fmt = body.response_format
        kwargs = {} if body.thinking is None else {"thinking": body.thinking}
        conversation = Conversation(body.messages(), body.active_tools,
                                    fmt.model_dump(by_alias=True, exclude_none=True) if fmt is not None else None,
                                    body.reasoning_effort, kwargs)
        try:
            return self.chat.prepare(conversation, body.chat_tool_choice, body.parallel_tool_calls,
                                     body.forces_tool_calls, fmt.constraint() if fmt is not None else None)
        except ChatFormatError as e:
            param = responses_field(e.param)
            raise APIError(400, f"{param}: {e}", param=param) from None

    async def create(self, body: ResponsesRequest, raw: Request):
        s = self.serving
        arrival, created = time.perf_counter(), int(time.time())
        s.check_model(body.model)
        response_id = f"resp_{uuid.uuid4().hex}"
        store, body = self.stores(body), self.continued(body)
        prompt, constraint = self.render(body)
        await s.check_constraint(constraint, "tool_choice" if body.forces_tool_calls else "text.format")
        prompts = [s.tokenize(prompt.text, add_special_tokens=False)]  # the chat format writes its BOS
        tools = body.active_tools
        decoder = self.chat.decoder(prompt, tools, [])
        items = OutputItems(body.include_encrypted_reasoning)
        end_id = self.chat.reasoning_end_id

        def params(ids: list[int], index: int):
            return body.sampling_params(len(ids), s.max_model_len, constraint)

        def usage(out) -> dict:
            ids = out.token_ids
            reasoning = (ids.index(end_id) if end_id in ids else len(ids)) if prompt.thinking else 0
            return {"input_tokens": len(prompts[0]),
                    "input_tokens_details": {"cached_tokens": out.num_cached_tokens, "cache_write_tokens": 0},
                    "output_tokens": len(ids), "output_tokens_details": {"reasoning_tokens": reasoning},
                    "total_tokens": len(prompts[0]) + len(ids)}

        def response(status: str, out=None, error: str | None = None) -> dict:
            r = {"id": response_id, "object": "response", "created_at": created, "status": status,
                 "background": False, "error": None, "incomplete_details": None, "instructions": body.instructions,
                 "max_output_tokens": body.max_output_tokens, "max_tool_calls": None,
                 "metadata": body.metadata or {}, "model": s.model_name, "output": items.snapshot(),
                 "parallel_tool_calls": body.parallel_tool_calls is not False,
                 "previous_response_id": body.previous_response_id,
                 "reasoning": {"effort": body.reasoning.effort if body.reasoning else None, "summary": None},
                 "service_tier": "default", "store": store,
                 "temperature": 1.0 if body.temperature is None else body.temperature,
                 "text": {"format": (body.text.format if body.text is not None and body.text.format is not None
                                     else {"type": "text"})},
                 "tool_choice": body.tool_choice or "auto", "tools": [t.echo() for t in body.tools or []],
                 "top_p": 1.0 if body.top_p is None else body.top_p, "truncation": "disabled",
                 "usage": usage(out) if out is not None else None, "user": body.user}
            for key in ("safety_identifier", "prompt_cache_key"):
                if getattr(body, key) is not None:
                    r[key] = getattr(body, key)
            if status == "completed":
                r["completed_at"] = int(time.time())
            elif status == "incomplete":
                r["incomplete_details"] = {"reason": "max_output_tokens"}
            elif status == "failed":
                r["error"] = {"code": "server_error", "message": f"generation failed: {error}"}
            return r

        def keep(r: dict) -> dict:
            """The final response, stored first when it is to be."""
            if store:
                self.store.put(r, body.input_items)
            return r

        def status_of(out) -> str:
            return "incomplete" if out.finish_reason == "length" else "completed"

        if body.stream:
            started = await s.unless_disconnected(raw, s.submit(prompts, params, 1, request_id=response_id, raw=raw))
            if started is None:
                return Response(status_code=499)  # gone before its first token (PD: while P prefilled)

            async def events(outputs: AsyncIterator) -> AsyncIterator[str]:
                numbers = itertools.count()

                def frame(event: dict) -> str:
                    return sse({**event, "sequence_number": next(numbers)}, event=event["type"])

                yield frame({"type": "response.created", "response": response("in_progress")})
                yield frame({"type": "response.in_progress", "response": response("in_progress")})
                final, failure = None, None
                try:
                    async for _, out in outputs:
                        if out.finish_reason == "error":
                            failure = out.error
                            break
                        for event in items.feed(decoder.deltas(out)):
                            yield frame(event)
                        if out.finished:
                            final = out
                except Exception as e:  # noqa: BLE001 - the headers are sent: report in-band
                    logger.exception("generation failed mid-stream")
                    failure = str(e)
                if failure is not None:
                    yield frame({"type": "response.failed", "response": keep(response("failed", error=failure))})
                    yield FAILED
                    return
                status = status_of(final)
                for event in items.finish(status == "incomplete"):
                    yield frame(event)
                yield frame({"type": f"response.{status}", "response": keep(response(status, final))})
            return s.stream(started, arrival, events)

        finals = await s.generate_whole(prompts, params, 1, response_id, arrival, raw)
        if finals is None:
            return Response(status_code=499)  # nobody is listening
        out = finals[0]
        items.feed(decoder.deltas(out))
        items.finish(status_of(out) == "incomplete")
        return keep(response(status_of(out), out))
