"""Tool calls and structured output through the server and the official client, on the tiny random model: forced
calls (tool_choice required / named, parallel_tool_calls false) parse into `tool_calls` whose arguments validate
against the tool's schema, streamed pieces add up to the whole answer, multi-turn conversations with calls and
results re-encode as the publisher's format; response_format and structured_outputs outputs match their schema /
regex / choice, also after free reasoning; a schema the grammar library refuses is a 400 naming the field."""
import json
import re

import jsonschema
import pytest
from openai import OpenAI

from encoding_deepseek_v4 import encode_chat

from serving_harness import API_KEY, MODEL, http

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8},
                                           "days": {"type": "integer", "minimum": 1, "maximum": 14}},
           "required": ["city", "days"], "additionalProperties": False}
TIME = {"type": "object", "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}}, "required": ["zone"],
        "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "parameters": TIME}}]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
ASK = [{"role": "user", "content": "Weather in Paris for 3 days?"}]
ANSWER = {"type": "object", "properties": {"answer": {"enum": ["yes", "no", "maybe"]}, "sure": {"type": "boolean"},
                                          "score": {"type": "integer", "minimum": 0, "maximum": 99}},
          "required": ["answer", "sure", "score"], "additionalProperties": False}


@pytest.fixture(scope="module")
def client(server):
    return OpenAI(base_url=server[0] + "/v1", api_key=API_KEY, max_retries=0, timeout=120)


def check_calls(calls, names=None):
    assert calls, "no tool call"
    for call in calls:
        assert call.type == "function" and re.fullmatch(r"call_[0-9a-f]{24}", call.id)
        assert call.function.name in (names or SCHEMAS)
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


@pytest.mark.parametrize("seed", [0, 1])
def test_required_tool_choice_forces_valid_calls(client, seed):
    r = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required",
                                       max_tokens=300, temperature=1.0, seed=seed)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    check_calls(choice.message.tool_calls)


def test_named_tool_choice_and_one_call_only(client):
    r = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, max_tokens=300, temperature=0,
                                       tool_choice={"type": "function", "function": {"name": "get_time"}},
                                       parallel_tool_calls=False)
    calls = r.choices[0].message.tool_calls
    check_calls(calls, ["get_time"])
    assert len(calls) == 1


def test_streamed_tool_calls_add_up_to_the_whole_answer(client):
    kw = dict(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required", max_tokens=300, temperature=0)
    whole = client.chat.completions.create(**kw).choices[0]
    chunks = list(client.chat.completions.create(stream=True, **kw))
    calls, content = {}, ""
    for c in chunks:
        delta = c.choices[0].delta
        content += delta.content or ""
        for piece in delta.tool_calls or []:
            if piece.id is not None:  # a call's first piece: id, type, name
                assert piece.index not in calls and piece.type == "function" and piece.function.name
                calls[piece.index] = [piece.id, piece.function.name, piece.function.arguments or ""]
            else:
                calls[piece.index][2] += piece.function.arguments or ""
    assert content == "" and chunks[-1].choices[0].finish_reason == "tool_calls"
    assert [(n, a) for _, n, a in calls.values()] == [(t.function.name, t.function.arguments)
                                                       for t in whole.message.tool_calls]
    assert len(chunks) > len(calls) + 2  # the arguments came in pieces, not in one chunk at the end


def streamed(chunks) -> tuple[str, list[tuple[str, str]], str]:
    """A chat stream's (content, [(name, arguments)] of its calls, finish_reason), its pieces added up."""
    calls, content = {}, ""
    for c in chunks:
        for piece in c.choices[0].delta.tool_calls or []:
            if piece.id is not None:
                calls[piece.index] = [piece.function.name, piece.function.arguments or ""]
            else:
                calls[piece.index][1] += piece.function.arguments or ""
        content += c.choices[0].delta.content or ""
    return content, [tuple(calls[i]) for i in sorted(calls)], chunks[-1].choices[0].finish_reason


def is_json(text: str) -> bool:
    try:
        json.loads(text)
        return True
    except ValueError:
        return False


def test_calls_cut_by_max_tokens_keep_what_was_generated(client):
    """Greedy forced calls cut by max_tokens just before and at each token that completed a piece of a call (its
    name, a parameter, its end): finish_reason "length", each call a prefix of the uncut one's, the call being
    written "{" and its complete parameters, unclosed (no "}" or value that was not generated); the stream adds up
    to the whole answer, and /v1/responses returns the same arguments (status incomplete)."""
    kw = dict(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required", temperature=0)
    cuts, seen = set(), 0  # tokens generated up to each chunk (with logprobs, one chunk per engine output)
    for c in client.chat.completions.create(max_tokens=300, stream=True, logprobs=True, **kw):
        seen += len(c.choices[0].logprobs.content) if c.choices[0].logprobs else 0
        if c.choices[0].delta.tool_calls:
            cuts |= {seen - 1, seen}
    full = client.chat.completions.create(max_tokens=300, **kw)
    whole_calls = [(c.function.name, c.function.arguments) for c in full.choices[0].message.tool_calls]
    assert full.choices[0].finish_reason == "tool_calls" and full.usage.completion_tokens == seen
    open_with_parameters = 0
    for k in sorted(cuts - {0, seen}):
        r = client.chat.completions.create(max_tokens=k, **kw)
        choice = r.choices[0]
        assert choice.finish_reason == "length" and r.usage.completion_tokens == k
        calls = [(c.function.name, c.function.arguments) for c in choice.message.tool_calls or []]
        assert len(calls) <= len(whole_calls) and choice.message.content in (None, "")
        for (name, args), (whole_name, whole_args) in zip(calls, whole_calls):
            assert name == whole_name and whole_args.startswith(args), (k, args, whole_args)
            if args != whole_args:  # the call the cut came in: "{" + complete parameters, unclosed
                assert not is_json(args) and isinstance(json.loads(args + "}"), dict), (k, args)
        assert streamed(list(client.chat.completions.create(max_tokens=k, stream=True, **kw))) == \
            (choice.message.content or "", calls, "length")
        if calls and calls[-1][1] not in ("{", whole_calls[len(calls) - 1][1]):
            open_with_parameters += 1
            resp = client.responses.create(model=MODEL, input=ASK[0]["content"], max_output_tokens=k, temperature=0,
                                           tools=[{"type": "function", **t["function"]} for t in TOOLS],
                                           tool_choice="required")
            assert resp.status == "incomplete" and resp.incomplete_details.reason == "max_output_tokens"
            assert [(o.name, o.arguments) for o in resp.output if o.type == "function_call"] == calls
    assert open_with_parameters, f"no cut fell between a call's parameters: {sorted(cuts)}"


def test_a_conversation_with_calls_and_results_is_the_publishers_prompt(client, model_and_tokenizer):
    tokenizer = model_and_tokenizer[1]
    first = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required",
                                           max_tokens=300, temperature=0).choices[0].message
    turn = {"role": "assistant", "content": None,
            "tool_calls": [{"id": c.id, "type": "function", "function": {"name": c.function.name,
                                                                         "arguments": c.function.arguments}}
                           for c in first.tool_calls]}
    results = [{"role": "tool", "tool_call_id": c.id, "content": f"result {i}"} for i, c in
               enumerate(reversed(first.tool_calls))]  # any order: the format sorts them by call order
    messages = ASK + [turn] + results
    r = client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, max_tokens=4, temperature=0)
    prompt = encode_chat(messages, tools=TOOLS)
    assert "<tool_result>result 0</tool_result>" in prompt and "<｜DSML｜invoke name=" in prompt
    assert r.usage.prompt_tokens == len(tokenizer(prompt, add_special_tokens=False).input_ids)


@pytest.mark.parametrize("thinking", [False, True])
def test_json_schema_response_format(client, thinking):
    r = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Answer in JSON."}], max_tokens=200, temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "answer", "schema": ANSWER, "strict": True}},
        extra_body={"chat_template_kwargs": {"thinking": thinking}})
    message = r.choices[0].message
    assert r.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(message.content), ANSWER)
    assert (getattr(message, "reasoning_content", None) is not None) == thinking


def test_json_object_and_the_structured_outputs_extension(client, server):
    r = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=200, temperature=1.0, seed=3,
                                       response_format={"type": "json_object"})
    assert isinstance(json.loads(r.choices[0].message.content), dict)
    r = client.completions.create(model=MODEL, prompt="Pick:", max_tokens=20, temperature=1.0, seed=5, n=2,
                                  extra_body={"structured_outputs": {"choice": ["red", "green", "blue"]}})
    assert all(c.text in ("red", "green", "blue") for c in r.choices)
    r = client.completions.create(model=MODEL, prompt="Date:", max_tokens=20, temperature=1.0, seed=5,
                                  extra_body={"structured_outputs": {"regex": r"20[0-9]{2}-[01][0-9]"}})
    assert re.fullmatch(r"20[0-9]{2}-[01][0-9]", r.choices[0].text)


def test_a_schema_the_grammar_refuses_is_a_400(server):
    status, _, raw = http("POST", server[0] + "/v1/chat/completions", {
        "messages": ASK, "response_format": {"type": "json_schema", "json_schema": {
            "name": "x", "schema": {"type": "object", "properties": {"a": {"type": "string", "format": "idn-email"}}}}}},
        {"Authorization": f"Bearer {API_KEY}"})
    error = json.loads(raw)["error"]
    assert status == 400 and error["param"] == "response_format" and "idn-email" in error["message"]
