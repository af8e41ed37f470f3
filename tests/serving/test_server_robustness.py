"""Load, client disconnects, overload, bad input: statuses, OpenAI error bodies, and a KV pool that comes back."""
import json
from concurrent.futures import ThreadPoolExecutor

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from openai import OpenAI

from serving_harness import API_KEY, MODEL, http, running_server, wait_until

AUTH = {"Authorization": f"Bearer {API_KEY}"}


def client_for(url):
    return OpenAI(base_url=url + "/v1", api_key=API_KEY, max_retries=0, timeout=60)


def idle(engine) -> bool:
    return engine.kv_cache.all_blocks_free() and not engine.has_unfinished() and not engine.requests


def test_32_concurrent_streams_all_finish(server):
    url, engine = server
    client = client_for(url)

    def one(i):
        chunks = list(client.completions.create(model=MODEL, prompt=f"request {i}:", max_tokens=6, temperature=0.8,
                                                seed=i, stream=True, extra_body={"ignore_eos": True}))
        return chunks[-1].choices[0].finish_reason

    with ThreadPoolExecutor(32) as pool:
        assert list(pool.map(one, range(32))) == ["length"] * 32
    assert wait_until(lambda: idle(engine))


def test_50_streams_closed_midway_free_their_kv_blocks(server):
    url, engine = server
    client = client_for(url)

    def one(i):
        kind = client.chat.completions if i % 2 else client.completions
        kw = {"messages": [{"role": "user", "content": f"talk {i}"}]} if i % 2 else {"prompt": f"talk {i}"}
        stream = kind.create(model=MODEL, max_tokens=400, stream=True, extra_body={"ignore_eos": True}, **kw)
        for n, _ in enumerate(stream):
            if n == 2:
                break
        stream.close()

    with ThreadPoolExecutor(10) as pool:
        list(pool.map(one, range(50)))
    assert wait_until(lambda: idle(engine), timeout=20), (engine.kv_cache.usage(), len(engine.requests))
    status, _, body = http("GET", url + "/metrics")
    aborted = float(body.decode().split('requests_total{outcome="aborted"} ')[1].split()[0])
    assert aborted >= 50


def error_of(status_headers_body):
    status, headers, body = status_headers_body
    error = json.loads(body)["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert "Traceback" not in body.decode()
    return status, error


@pytest.mark.parametrize("path, body, status, needle", [
    ("/v1/completions", b"{not json", 400, "JSON"),
    ("/v1/completions", {"prompt": 5}, 400, "prompt"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": "3"}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 0}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "n": 9}, 400, "n"),
    ("/v1/completions", {"prompt": "hi", "temperature": -1}, 400, "temperature"),
    ("/v1/completions", {"prompt": "hi", "top_p": 0}, 400, "top_p"),
    ("/v1/completions", {"prompt": "hi", "model": "gpt-4"}, 404, "gpt-4"),
    ("/v1/completions", {"prompt": [7] * 2000, "max_tokens": 1}, 400, "prompt"),
    ("/v1/completions", {"prompt": []}, 400, "empty"),
    ("/v1/chat/completions", {"messages": "hi"}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 21}, 400,
     "top_logprobs"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "model": "nope"}, 404, "nope"),
])
def test_bad_input_gets_its_status_and_an_error_body(server, path, body, status, needle):
    got, error = error_of(http("POST", server[0] + path, body, AUTH))
    assert got == status and error["code"] == status
    assert needle in error["message"] or needle == error["param"]


def test_missing_or_wrong_api_key_is_401(server):
    for headers in ({}, {"Authorization": "Bearer wrong"}):
        status, error = error_of(http("POST", server[0] + "/v1/completions", {"prompt": "hi"}, headers))
        assert status == 401 and error["type"] == "authentication_error"
    assert http("GET", server[0] + "/health")[0] == 200  # not behind the key


def test_overload_is_503_with_retry_after(model_and_tokenizer):
    model, tokenizer = model_and_tokenizer
    with running_server(model, tokenizer, max_waiting=2) as (url, engine):
        client = client_for(url)
        held = [client.completions.create(model=MODEL, prompt="hold", max_tokens=500, stream=True,
                                          extra_body={"ignore_eos": True}) for _ in range(2)]
        for stream in held:
            next(iter(stream))
        status, headers, body = http("POST", url + "/v1/completions", {"prompt": "one more"}, AUTH)
        assert status == 503 and headers.get("Retry-After") == "1"
        assert json.loads(body)["error"]["code"] == 503
        status, _, body = http("POST", url + "/v1/chat/completions",
                               {"messages": [{"role": "user", "content": "x"}], "n": 3}, AUTH)
        assert status == 503
        for stream in held:
            stream.close()
        assert wait_until(lambda: idle(engine), timeout=20)
        metrics = http("GET", url + "/metrics")[2].decode()
        assert 'requests_total{outcome="rejected"} 2.0' in metrics


json_values = st.recursive(st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats(allow_nan=False)
                           | st.text(max_size=8), lambda inner: st.lists(inner, max_size=3)
                           | st.dictionaries(st.text(max_size=6), inner, max_size=3), max_leaves=6)
FIELDS = ["model", "prompt", "messages", "temperature", "top_p", "top_k",
          "n", "stream", "stream_options", "stop", "seed", "logprobs", "top_logprobs", "ignore_eos", "echo",
          "chat_template_kwargs"]
small_ints = st.integers(-2, 4)
body_strategy = st.fixed_dictionaries(
    {"max_tokens": st.integers(-1, 3)},
    optional={**{f: json_values for f in FIELDS},
              "prompt": st.one_of(st.text(max_size=12), st.lists(st.integers(-3, 600), max_size=5), json_values),
              "messages": st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant", "x"]),
                                                          "content": st.one_of(st.text(max_size=10), json_values)}),
                                   max_size=3),
              "max_completion_tokens": st.integers(-1, 3), "n": small_ints,
              "logprobs": st.one_of(st.booleans(), small_ints), "stream": st.booleans(),
              "temperature": st.floats(-1, 3), "top_p": st.floats(-0.5, 1.5)})


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(path=st.sampled_from(["/v1/completions", "/v1/chat/completions"]), body=body_strategy)
def test_generated_bodies_never_get_a_5xx(server, path, body):
    status, _, raw = http("POST", server[0] + path, body, AUTH)
    assert status < 500, raw
    if status >= 400:
        assert set(json.loads(raw)["error"]) == {"message", "type", "param", "code"}
