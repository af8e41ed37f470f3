"""Every request field is honoured or refused with a 400 naming it, never accepted and ignored: unknown fields,
the OpenAI fields this server does not honour (unless they carry their no-op value), content parts other than text
and image_url, inconsistent tool-calling fields, what the chat format cannot render; max_tokens 0 only with echo."""
import json

import openai
import pytest
from openai import OpenAI

from common.serving.protocol import ChatCompletionRequest, CompletionRequest

from serving_harness import API_KEY, MODEL, http

AUTH = {"Authorization": f"Bearer {API_KEY}"}
CMPL, CHAT = "/v1/completions", "/v1/chat/completions"
MSGS = [{"role": "user", "content": "hi"}]
TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {}}}}


def post(server, path, body):
    status, _, raw = http("POST", server[0] + path, body, AUTH)
    return status, json.loads(raw)


def msg(content, **kw):
    return {"messages": [{"role": "user", "content": content, **kw}]}


# (path, body, the error's param, a word its message holds)
REFUSED = [
    (CMPL, {"prompt": "hi", "foo": 1}, "foo", "unrecognized request argument"),
    (CHAT, {"messages": MSGS, "foo": 1}, "foo", "unrecognized request argument"),
    (CMPL, {"prompt": "hi", "stream": True, "stream_options": {"include_usage": True, "x": 1}},
     "stream_options.x", "unrecognized"),
    (CMPL, {"prompt": "hi", "max_tokens": 0}, "max_tokens", "echo"),
    (CMPL, {"prompt": "hi", "best_of": 2}, "best_of", "not supported by this server"),
    (CMPL, {"prompt": "hi", "suffix": " end"}, "suffix", "not supported by this server"),
    (CMPL, {"prompt": "hi", "frequency_penalty": 0.5}, "frequency_penalty", "not supported by this server"),
    (CMPL, {"prompt": "hi", "presence_penalty": -1}, "presence_penalty", "not supported by this server"),
    (CMPL, {"prompt": "hi", "logit_bias": {"50256": -100}}, "logit_bias", "not supported by this server"),
    (CMPL, {"prompt": "hi", "user": 7}, "user", "string"),
    (CHAT, {"messages": MSGS, "echo": True}, "echo", "unrecognized"),  # completions only
    (CHAT, {"messages": MSGS, "max_tokens": 0}, "max_tokens", "greater than or equal to 1"),
    (CHAT, {"messages": MSGS, "max_completion_tokens": 0}, "max_completion_tokens", "greater than or equal to 1"),
    (CHAT, {"messages": MSGS, "functions": [TOOL["function"]]}, "functions", "not supported by this server"),
    (CHAT, {"messages": MSGS, "function_call": {"name": "f"}}, "function_call", "not supported by this server"),
    (CHAT, {"messages": MSGS, "frequency_penalty": 1.0}, "frequency_penalty", "not supported by this server"),
    (CHAT, {"messages": MSGS, "presence_penalty": 0.1}, "presence_penalty", "not supported by this server"),
    (CHAT, {"messages": MSGS, "logit_bias": {"1": 5}}, "logit_bias", "not supported by this server"),
    (CHAT, {"messages": MSGS, "modalities": ["text", "audio"]}, "modalities", "not supported by this server"),
    (CHAT, {"messages": MSGS, "audio": {"voice": "alloy", "format": "wav"}}, "audio", "not supported"),
    (CHAT, {"messages": MSGS, "prediction": {"type": "content", "content": "x"}}, "prediction", "not supported"),
    (CHAT, {"messages": MSGS, "web_search_options": {}}, "web_search_options", "not supported"),
    (CHAT, {"messages": MSGS, "store": True}, "store", "not supported by this server"),
    (CHAT, {"messages": MSGS, "service_tier": "flex"}, "service_tier", "not supported by this server"),
    (CHAT, {"messages": MSGS, "metadata": {"k": 1}}, "metadata.k", "string"),
    (CHAT, {"messages": MSGS, "top_logprobs": 2}, "top_logprobs", "logprobs: true"),
    (CHAT, msg([{"type": "text", "text": "look:"}, {"type": "image_url", "image_url": {"url": "data:,",
                                                                            "detail": "low"}}]),
     "messages.0.content.1.image_url.detail", 'only "auto" is accepted'),
    (CHAT, msg([{"type": "image_url", "image_url": {"url": "data:,", "size": 2}}]),
     "messages.0.content.0.image_url.size", "unrecognized"),
    (CHAT, msg([{"type": "input_audio", "input_audio": {"data": "", "format": "wav"}}]), "messages.0.content.0",
     "not supported by this server"),
    (CHAT, msg([{"type": "file", "file": {"file_id": "f"}}]), "messages.0.content.0", "not supported"),
    (CHAT, msg([{"text": "no type"}]), "messages.0.content.0", "without a type"),
    (CHAT, msg([{"type": "text", "text": 5}]), "messages.0.content.0.text", "a string"),
    (CHAT, msg([{"type": "text", "text": "x", "cache_control": {}}]), "messages.0.content.0.cache_control",
     "unrecognized"),
    (CHAT, msg("hi", name="bob"), "messages.0.name", "not supported by this server"),
    (CHAT, msg("hi", foo=1), "messages.0.foo", "unrecognized"),
    (CHAT, {"messages": MSGS + [{"role": "function", "content": "sunny", "name": "f"}]}, "messages.1.role",
     "use tool messages"),
    (CHAT, {"messages": MSGS, "tool_choice": "auto"}, "tool_choice", "needs tools"),
    (CHAT, {"messages": MSGS, "tools": [TOOL], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice", "not in tools"),
    (CHAT, {"messages": MSGS, "tools": [TOOL, TOOL]}, "tools", "unique"),
    (CHAT, {"messages": MSGS, "tools": [{"type": "function", "function": {"name": "bad name"}}]},
     "tools.0.function.name", "pattern"),
    (CHAT, {"messages": MSGS, "tools": [TOOL], "tool_choice": "required", "response_format": {"type": "json_object"}},
     "response_format", "forced tool call"),
    (CHAT, {"messages": MSGS, "response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}},
     "structured_outputs", "not both"),
    (CHAT, {"messages": MSGS, "response_format": {"type": "json_schema"}}, "response_format.json_schema",
     "needs a json_schema"),
    (CHAT, {"messages": MSGS, "response_format": {"type": "yaml"}}, "response_format.type", "json_object"),
    (CMPL, {"prompt": "hi", "structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs",
     "exactly one"),
    (CMPL, {"prompt": "hi", "structured_outputs": {"json": {"type": "object", "properties": {"a": {
        "type": "string", "format": "idn-email"}}}}}, "structured_outputs", "idn-email"),
    (CHAT, {"messages": MSGS, "reasoning_effort": "low"}, "reasoning_effort", "not a DeepSeek-V4 reasoning effort"),
    (CHAT, {"messages": MSGS, "reasoning_effort": "max"}, "reasoning_effort", "thinking"),
    (CHAT, {"messages": MSGS, "chat_template_kwargs": {"foo": 1}}, "chat_template_kwargs.foo", "not understood"),
    (CHAT, {"messages": MSGS + [{"role": "tool", "content": "sunny"}]}, "messages.1.tool_call_id",
     "needs the tool_call_id"),
    (CHAT, {"messages": MSGS + [{"role": "user", "content": "x", "reasoning_content": "y"}]},
     "messages.1.reasoning_content", "only assistant"),
    (CHAT, {"messages": MSGS + [{"role": "assistant", "content": "x", "function_call": {"name": "f"}}]},
     "messages.1.function_call", "use tool_calls"),
]


@pytest.mark.parametrize("path, body, param, needle", REFUSED, ids=[r[2] for r in REFUSED])
def test_refused_field_is_a_400_naming_it(server, path, body, param, needle):
    status, body = post(server, path, body)
    error = body["error"]
    assert status == 400 and set(error) == {"message", "type", "param", "code"}, body
    assert error["code"] == 400 and error["type"] == "invalid_request_error"
    assert error["param"] == param and error["message"].startswith(param + ": ") and needle in error["message"]


def test_the_no_op_values_clients_send_are_accepted(server):
    status, body = post(server, CMPL, {
        "prompt": "hi", "max_tokens": 2, "best_of": 1, "frequency_penalty": 0, "presence_penalty": 0.0,
        "logit_bias": {}, "suffix": None, "user": "user-1234", "echo": False, "stream_options": None})
    assert status == 200, body
    status, body = post(server, CMPL, {"prompt": "hi", "max_tokens": 1, "n": 2, "best_of": 2, "suffix": "",
                                       "logit_bias": None, "frequency_penalty": None, "user": None})
    assert status == 200 and len(body["choices"]) == 2, body
    parts = [{"type": "text", "text": "What is "}, {"type": "text", "text": "2 + 2?"}]
    status, body = post(server, CHAT, {
        "messages": [{"role": "system", "content": "Be brief.", "name": None},
                     {"role": "user", "content": parts},
                     {"role": "assistant", "content": "4", "tool_calls": [], "refusal": None},
                     {"role": "user", "content": "And 3 + 3?", "tool_calls": None, "function_call": None}],
        "max_completion_tokens": 2, "tools": [], "functions": None, "tool_choice": "none", "function_call": "none",
        "parallel_tool_calls": None, "response_format": {"type": "text"}, "frequency_penalty": 0,
        "presence_penalty": 0, "logit_bias": {}, "modalities": ["text"], "audio": None, "prediction": None,
        "web_search_options": None, "reasoning_effort": None, "user": "u", "metadata": {"team": "a"},
        "store": False, "service_tier": "auto", "stream_options": {"include_usage": True}, "top_k": 5,
        "ignore_eos": True, "chat_template_kwargs": {"thinking": False}, "logprobs": False, "top_logprobs": None})
    assert status == 200 and body["usage"]["completion_tokens"] == 2, body
    status, body = post(server, CHAT, {"messages": MSGS, "max_tokens": 1, "store": None, "service_tier": "default",
                                       "tools": None, "tool_choice": None, "response_format": None})
    assert status == 200, body


def test_official_client_gets_bad_request_naming_the_field(server):
    client = OpenAI(base_url=server[0] + "/v1", api_key=API_KEY, max_retries=0, timeout=60)
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=MSGS, max_tokens=2, tool_choice="required")
    assert e.value.status_code == 400 and e.value.param == "tool_choice" and "needs tools" in e.value.message
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt="hi", max_tokens=2, extra_body={"repetition_penalty": 1.2})
    assert e.value.param == "repetition_penalty" and "unrecognized request argument" in e.value.message


def test_max_tokens_zero_only_with_echo_and_echo_scores_the_prompt():
    with pytest.raises(ValueError, match="echo"):
        CompletionRequest(prompt="hi", max_tokens=0)
    echo = CompletionRequest(prompt="hi", max_tokens=0, echo=True, logprobs=3)
    params = echo.sampling_params(prompt_len=2, max_model_len=64)
    assert (params.max_tokens, params.logprobs, params.prompt_logprobs) == (0, 3, 3)
    assert CompletionRequest(prompt="hi", max_tokens=0, echo=True).sampling_params(2, 64).prompt_logprobs is None
    assert CompletionRequest(prompt="hi", echo=True, logprobs=0).sampling_params(2, 64).prompt_logprobs == 0
    plain = CompletionRequest(prompt="hi", logprobs=2).sampling_params(2, 64)  # logprobs without echo: generated only
    assert (plain.max_tokens, plain.logprobs, plain.prompt_logprobs) == (16, 2, None)
    chat = ChatCompletionRequest(messages=MSGS, logprobs=True, top_logprobs=2).sampling_params(2, 64)
    assert chat.prompt_logprobs is None and chat.logprobs == 2 and chat.max_tokens == 62
