"""POST /v1/responses through the official client and raw HTTP, on the tiny random model: the text output equals
chat's for the same conversation (greedy), reasoning efforts map onto thinking mode, forced function calls parse with
arguments valid against the tool's schema, a conversation of function_call / function_call_output / reasoning items
is the publisher's prompt, json_schema text validates, streamed events (typed, numbered, in the SDK's order) add up
to the final response, a failing generation ends the stream with response.failed, and what the server cannot honour
is a 400 naming the field."""
import json
import re

import jsonschema
import pytest
from openai import OpenAI

from common.serving.protocol_responses import ResponsesRequest
from encoding_deepseek_v4 import encode_chat

from serving_harness import API_KEY, MODEL, RaisesOnToken, http, running_server, wait_until

AUTH = {"Authorization": f"Bearer {API_KEY}"}
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8},
                                           "days": {"type": "integer", "minimum": 1, "maximum": 14}},
           "required": ["city", "days"], "additionalProperties": False}
TIME = {"type": "object", "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}}, "required": ["zone"],
        "additionalProperties": False}
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
TOOLS = [{"type": "function", "name": "get_weather", "description": "Weather", "parameters": WEATHER, "strict": None},
         {"type": "function", "name": "get_time", "parameters": TIME, "strict": True}]
CHAT_TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather",
                                                "parameters": WEATHER}},
              {"type": "function", "function": {"name": "get_time", "parameters": TIME, "strict": True}}]
ASK = "Weather in Paris for 3 days?"
ANSWER = {"type": "object", "properties": {"answer": {"enum": ["yes", "no", "maybe"]}, "sure": {"type": "boolean"},
                                          "score": {"type": "integer", "minimum": 0, "maximum": 99}},
          "required": ["answer", "sure", "score"], "additionalProperties": False}


@pytest.fixture(scope="module")
def client(server):
    return OpenAI(base_url=server[0] + "/v1", api_key=API_KEY, max_retries=0, timeout=120)


def prompt_tokens(tokenizer, text: str) -> int:
    return len(tokenizer(text, add_special_tokens=False).input_ids)


def check_calls(calls, names=None):
    assert calls, "no function call"
    for call in calls:
        assert call.type == "function_call" and call.status == "completed" and call.id.startswith("fc_")
        assert re.fullmatch(r"call_[0-9a-f]{24}", call.call_id) and call.name in (names or SCHEMAS)
        jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])


def test_items_become_chat_messages_one_assistant_message_a_turn():
    call = {"type": "function_call", "call_id": "c1", "name": "get_time", "arguments": '{"zone": "UTC"}'}
    body = ResponsesRequest(instructions="Be brief.", input=[
        {"role": "user", "content": [{"type": "input_text", "text": "a"}, {"type": "input_text", "text": "b"}]},
        {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text", "text": "r1"}]},
        {"type": "message", "role": "assistant", "id": "msg_1", "status": "completed",
         "content": [{"type": "output_text", "text": "calling", "annotations": [], "logprobs": []}]},
        call, {"type": "function_call_output", "call_id": "c1", "output": [{"type": "input_text", "text": "12:00"}]},
        {"type": "reasoning", "id": "rs_2", "summary": [], "content": [{"type": "reasoning_text", "text": "r2"}]},
        {"role": "assistant", "content": "It is noon."}, {"role": "developer", "content": "Next."}])
    tool_call = {"id": "c1", "type": "function", "function": {"name": "get_time", "arguments": '{"zone": "UTC"}'}}
    assert body.messages() == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        {"role": "assistant", "content": "calling", "reasoning_content": "r1", "tool_calls": [tool_call]},
        {"role": "tool", "tool_call_id": "c1", "content": [{"type": "text", "text": "12:00"}]},
        {"role": "assistant", "content": "It is noon.", "reasoning_content": "r2"},
        {"role": "developer", "content": "Next."}]
    # reasoning after a call starts the next assistant message
    later = ResponsesRequest(input=[{"role": "user", "content": "q"}, call,
                                    {"type": "reasoning", "summary": [], "content": []}]).messages()
    assert [m["role"] for m in later] == ["user", "assistant", "assistant"] and later[1]["tool_calls"]
    assert ResponsesRequest(input="hi").messages() == [{"role": "user", "content": "hi"}]


# effort -> the chat request's thinking and reasoning_effort (DeepSeek's mapping)
EFFORTS = [(None, {}), ("none", {}), ("high", {"extra_body": {"chat_template_kwargs": {"thinking": True}}}),
           ("xhigh", {"reasoning_effort": "max", "extra_body": {"chat_template_kwargs": {"thinking": True}}})]


@pytest.mark.parametrize("effort, chat_kw", EFFORTS, ids=[str(e) for e, _ in EFFORTS])
def test_output_equals_chat_for_the_same_conversation(client, effort, chat_kw):
    extra = {} if effort is None else {"reasoning": {"effort": effort}}
    r = client.responses.create(model=MODEL, instructions="Be brief.", input="Hello, who are you?",
                                max_output_tokens=12, temperature=0, **extra)
    chat = client.chat.completions.create(model=MODEL, max_tokens=12, temperature=0, **chat_kw, messages=[
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello, who are you?"}])
    message, choice = [o for o in r.output if o.type == "message"], chat.choices[0]
    assert r.object == "response" and r.id.startswith("resp_") and r.model == MODEL
    assert len(message) == 1 and message[0].role == "assistant" and message[0].id.startswith("msg_")
    assert r.output_text == (choice.message.content or "")
    assert message[0].content[0].annotations == [] and message[0].content[0].logprobs == []
    reasoning = [o for o in r.output if o.type == "reasoning"]
    chat_reasoning = getattr(choice.message, "reasoning_content", None)
    assert [o.content[0].text for o in reasoning] == ([chat_reasoning] if chat_reasoning else [])
    assert all(o.summary == [] and o.content[0].type == "reasoning_text" for o in reasoning)
    assert (r.usage.input_tokens, r.usage.output_tokens) == (chat.usage.prompt_tokens, chat.usage.completion_tokens)
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    assert (r.usage.output_tokens_details.reasoning_tokens > 0) == bool(chat_reasoning)
    if choice.finish_reason == "length":
        assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
        assert r.output[-1].status == "incomplete"
    else:
        assert r.status == "completed" and r.incomplete_details is None
    assert r.reasoning.effort == effort and r.temperature == 0 and r.tool_choice == "auto" and r.tools == []


def test_required_tool_choice_forces_valid_calls(client):
    # sampled, one call (a sample may go on calling: at ~100 tokens a call, some would not end in 300 tokens)
    r = client.responses.create(model=MODEL, input=ASK, tools=TOOLS, tool_choice="required", max_output_tokens=300,
                                temperature=1.0, parallel_tool_calls=False)
    assert r.status == "completed" and r.output_text == ""
    calls = [o for o in r.output if o.type == "function_call"]
    check_calls(calls)
    assert len(calls) == 1 and [t.name for t in r.tools] == ["get_weather", "get_time"] and r.tool_choice == "required"


def test_named_tool_choice_and_one_call_only(client):
    r = client.responses.create(model=MODEL, input=ASK, tools=TOOLS, max_output_tokens=300, temperature=0,
                                tool_choice={"type": "function", "name": "get_time"}, parallel_tool_calls=False)
    calls = [o for o in r.output if o.type == "function_call"]
    check_calls(calls, ["get_time"])
    assert len(calls) == 1 and r.parallel_tool_calls is False
    assert r.tool_choice.type == "function" and r.tool_choice.name == "get_time"


def test_calls_and_outputs_are_the_publishers_prompt(client, model_and_tokenizer):
    tokenizer = model_and_tokenizer[1]
    first = client.responses.create(model=MODEL, input=ASK, tools=TOOLS, tool_choice="required",
                                    max_output_tokens=300, temperature=0)
    calls = [o for o in first.output if o.type == "function_call"]
    outputs = [{"type": "function_call_output", "call_id": c.call_id, "output": f"result {i}"}
               for i, c in enumerate(reversed(calls))]  # any order: the format sorts them by call order
    second = client.responses.create(model=MODEL, input=[{"role": "user", "content": ASK}] + first.output + outputs,
                                     tools=TOOLS, max_output_tokens=4, temperature=0)
    messages = [{"role": "user", "content": ASK},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": c.call_id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                    for c in calls]}] + [{"role": "tool", "tool_call_id": o["call_id"], "content": o["output"]}
                                         for o in outputs]
    prompt = encode_chat(messages, tools=CHAT_TOOLS)
    assert "<tool_result>result 0</tool_result>" in prompt and '<｜DSML｜invoke name="' in prompt
    assert second.usage.input_tokens == prompt_tokens(tokenizer, prompt)


def test_reasoning_sent_back_encrypted_is_the_assistants_reasoning(client, model_and_tokenizer):
    tokenizer = model_and_tokenizer[1]
    first = client.responses.create(model=MODEL, input="Think.", reasoning={"effort": "high", "summary": "auto"},
                                    include=["reasoning.encrypted_content"], max_output_tokens=6, temperature=0)
    item = first.output[0]
    assert item.type == "reasoning" and item.encrypted_content
    sent = {"type": "reasoning", "id": item.id, "summary": [], "encrypted_content": item.encrypted_content}
    history = [{"role": "user", "content": "Think."}, sent,
               {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Done."}]},
               {"role": "user", "content": "Again."}]
    second = client.responses.create(model=MODEL, input=history, tools=TOOLS, reasoning={"effort": "high"},
                                     max_output_tokens=2, temperature=0)
    prompt = encode_chat([{"role": "user", "content": "Think."},
                          {"role": "assistant", "content": "Done.", "reasoning_content": item.content[0].text},
                          {"role": "user", "content": "Again."}], tools=CHAT_TOOLS, thinking=True)
    assert item.content[0].text in prompt  # tools keep earlier reasoning in the prompt
    assert second.usage.input_tokens == prompt_tokens(tokenizer, prompt)


def test_json_schema_text_format(client):
    fmt = {"type": "json_schema", "name": "answer", "schema": ANSWER, "strict": True}
    r = client.responses.create(model=MODEL, input="Answer in JSON.", text={"format": fmt}, max_output_tokens=200,
                                temperature=0)
    assert r.status == "completed"
    jsonschema.validate(json.loads(r.output_text), ANSWER)
    assert r.text.format.type == "json_schema" and r.text.format.name == "answer"


def test_stream_events_add_up_to_the_final_response(client):
    kw = dict(model=MODEL, input=ASK, tools=TOOLS, tool_choice="required", max_output_tokens=300, temperature=0)
    whole = client.responses.create(**kw)
    events = list(client.responses.create(stream=True, **kw))
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert [e.type for e in events[:2]] == ["response.created", "response.in_progress"]
    assert events[-1].type == "response.completed" and events[0].response.id == events[-1].response.id
    final = events[-1].response
    added = {e.output_index: e.item for e in events if e.type == "response.output_item.added"}
    done = {e.output_index: e.item for e in events if e.type == "response.output_item.done"}
    assert sorted(added) == sorted(done) == list(range(len(final.output)))
    args = {}
    for e in events:
        if e.type == "response.function_call_arguments.delta":
            args[e.output_index] = args.get(e.output_index, "") + e.delta
    for i, item in enumerate(final.output):
        assert added[i].id == done[i].id == item.id and done[i] == item
        assert item.type == "function_call" and args[i] == item.arguments
    assert [(c.name, c.arguments) for c in final.output] == [(c.name, c.arguments) for c in whole.output]
    assert sum(e.type == "response.function_call_arguments.delta" for e in events) > len(final.output)


def test_streamed_text_and_reasoning_through_the_stream_helper(client, server):
    kw = dict(model=MODEL, input="Hello, who are you?", reasoning={"effort": "high"}, max_output_tokens=40,
              temperature=0)
    whole = client.responses.create(**kw)
    with client.responses.stream(**kw) as stream:
        events = list(stream)
        final = stream.get_final_response() if events[-1].type == "response.completed" else events[-1].response
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    reasoning = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    assert text == final.output_text == whole.output_text
    assert reasoning == "".join(o.content[0].text for o in final.output if o.type == "reasoning") != ""
    assert all(e.logprobs == [] for e in events if e.type in ("response.output_text.delta",
                                                              "response.output_text.done"))
    assert final.status == whole.status and final.usage.output_tokens == whole.usage.output_tokens
    # raw frames: `event: <type>` then its data, every one typed and numbered, no [DONE]
    status, headers, body = http("POST", server[0] + "/v1/responses", {**kw, "stream": True}, AUTH)
    frames = body.decode().strip().split("\n\n")
    assert status == 200 and headers["content-type"].startswith("text/event-stream")
    numbers = []
    for f in frames:
        event, data = f.split("\n")
        payload = json.loads(data.removeprefix("data: "))
        assert event == f"event: {payload['type']}"
        numbers.append(payload["sequence_number"])
    assert numbers == list(range(len(frames))) and "[DONE]" not in body.decode()
    last = json.loads(frames[-1].split("\n")[1].removeprefix("data: "))
    assert last["type"] == f"response.{whole.status}" and last["response"]["status"] == whole.status
    texts = [part["text"] for item in last["response"]["output"] if item["type"] == "message"
             for part in item["content"]]
    assert "".join(texts) == whole.output_text


# (body, the error's param, a word its message holds)
REFUSED = [
    ({"input": "hi", "foo": 1}, "foo", "unrecognized request argument"),
    ({"input": "hi", "conversation": "conv_1"}, "conversation", "previous_response_id"),
    ({"input": "hi", "store": "yes"}, "store", "valid boolean"),
    ({"input": "hi", "previous_response_id": ""}, "previous_response_id", "at least 1 character"),
    ({"input": "hi", "background": True}, "background", "not supported"),
    ({"input": "hi", "truncation": "auto"}, "truncation", "not supported"),
    ({"input": "hi", "include": ["message.output_text.logprobs"]}, "include.0", "not supported"),
    ({"input": "hi", "prompt": {"id": "pmpt_1"}}, "prompt", "not supported"),
    ({"input": "hi", "reasoning": {"effort": "minimal"}}, "reasoning.effort", "no counterpart"),
    ({"input": "hi", "reasoning": {"summary": "detailed"}}, "reasoning.summary", "not supported"),
    ({"input": "hi", "text": {"verbosity": "low"}}, "text.verbosity", "not supported"),
    ({"input": "hi", "text": {"format": {"type": "json_schema", "schema": {}}}}, "text.format.name", "required"),
    ({"input": "hi", "text": {"format": {"type": "yaml"}}}, "text.format.type", "json_object"),
    ({"input": "hi", "max_output_tokens": 0}, "max_output_tokens", "greater than or equal to 1"),
    ({"input": "hi", "tools": [{"type": "web_search"}]}, "tools.0.type", "function"),
    ({"input": "hi", "tool_choice": "required"}, "tool_choice", "needs tools"),
    ({"input": "hi", "tools": TOOLS, "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice",
     "not in tools"),
    ({"input": "hi", "tools": TOOLS, "tool_choice": "required", "text": {"format": {"type": "json_object"}}},
     "text.format", "forced tool call"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input.0.type", "send the item itself"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "data:,"}]}]},
     "input.0.content.0", "'input_image' content parts are not supported"),
    ({"input": [{"role": "assistant", "content": [{"type": "input_text", "text": "x"}]}]}, "input.0.content.0",
     "output_text"),
    ({"input": [{"role": "user", "content": "hi"}, {"type": "function_call_output", "call_id": "c9", "output": "x"}]},
     "input.1.call_id", "answers no function_call"),
    ({"input": [{"role": "user", "content": "hi"}, {"type": "function_call", "call_id": "c1", "name": "get_time",
                                                    "arguments": "[1]"}]}, "input.1.arguments", "JSON object"),
    ({"input": [{"type": "reasoning", "summary": [], "encrypted_content": "gAAAA"}]}, "input.0.encrypted_content",
     "not written by this server"),
    ({"input": [{"type": "reasoning", "summary": [{"type": "summary_text", "text": "s"}]}]}, "input.0.summary",
     "not the model's reasoning"),
    ({"input": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "x"}]}, "input", "last message"),
]


@pytest.mark.parametrize("body, param, needle", REFUSED, ids=[r[1] for r in REFUSED])
def test_refused_field_is_a_400_naming_it(server, body, param, needle):
    status, _, raw = http("POST", server[0] + "/v1/responses", body, AUTH)
    error = json.loads(raw)["error"]
    assert status == 400 and error["type"] == "invalid_request_error", error
    assert error["param"] == param and error["message"].startswith(param + ": ") and needle in error["message"]


def test_the_no_op_values_clients_send_are_accepted(server):
    status, _, raw = http("POST", server[0] + "/v1/responses", {
        "model": MODEL, "input": [{"type": "message", "role": "developer", "content": [{"type": "input_text",
                                                                                      "text": "Be brief."}]},
                                  {"role": "user", "content": "hi"}],
        "store": False, "stream": False, "include": [], "tools": [], "tool_choice": "auto",
        "parallel_tool_calls": True, "reasoning": {"effort": None, "summary": "auto"},
        "text": {"format": {"type": "text"}, "verbosity": "medium"}, "truncation": "disabled", "background": None,
        "metadata": {"a": "b"}, "prompt_cache_key": "k", "safety_identifier": "u", "user": "u",
        "service_tier": "auto", "top_logprobs": 0, "max_output_tokens": 2, "previous_response_id": None}, AUTH)
    body = json.loads(raw)
    assert status == 200 and body["usage"]["output_tokens"] <= 2 and body["metadata"] == {"a": "b"}, body


def aborted(url) -> float:
    metrics = http("GET", url + "/metrics")[2].decode()
    return float(metrics.split('requests_total{outcome="aborted"} ')[1].split()[0])


def test_streams_closed_midway_are_aborted_and_free_their_kv_blocks(client, server):
    url, engine = server
    before = aborted(url)
    for i in range(4):
        stream = client.responses.create(model=MODEL, input=f"talk {i}", reasoning={"effort": "high"},
                                         max_output_tokens=400, temperature=0, stream=True)
        for n, _ in enumerate(stream):
            if n == 2:  # response.output_item.added: generation has begun
                break
        stream.close()
    assert wait_until(lambda: engine.kv_cache.all_blocks_free() and not engine.has_unfinished(), timeout=20)
    assert wait_until(lambda: aborted(url) > before)


def test_a_failing_generation_ends_the_stream_with_response_failed(model_and_tokenizer):
    model, tokenizer = model_and_tokenizer
    poison = tokenizer.convert_tokens_to_ids("<｜User｜>")  # in every chat prompt
    with running_server(RaisesOnToken(model, poison), tokenizer, max_num_seqs=2) as (url, _):
        status, _, raw = http("POST", url + "/v1/responses", {"input": "hi", "max_output_tokens": 4}, AUTH)
        assert status == 500 and f"token {poison}" in json.loads(raw)["error"]["message"]
        client = OpenAI(base_url=url + "/v1", api_key=API_KEY, max_retries=0, timeout=60)
        events = list(client.responses.create(model=MODEL, input="hi", max_output_tokens=4, stream=True))
        assert [e.type for e in events] == ["response.created", "response.in_progress", "response.failed"]
        failed = events[-1].response
        assert failed.status == "failed" and failed.error.code == "server_error"
        assert f"token {poison}" in failed.error.message
