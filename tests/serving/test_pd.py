"""PD disaggregation on 127.0.0.1: a prefill and a decode server (real uvicorn, real Mooncake transfer engines over
TCP) behind the router, against a colocated server over the same weights, through the official openai client."""
import json
import random
import time
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest
import torch
from openai import OpenAI
from transformers import AutoTokenizer

from common.kv_transfer import DecodeConnector, MooncakeTransport, PrefillConnector
from common.serving.router import build_router
from weights_deepseek_v4 import load_model

from serving_harness import (API_KEY, MODEL, abandon_requests, free_port, http, own_model, running_server, serve_app,
                             wait_until)

ENGINE = dict(max_num_seqs=8, max_num_batched_tokens=24, block_size=16)
P_ENGINE = {**ENGINE, "max_num_batched_tokens": 8}  # P prefills in chunks of 8 (and slowly enough to be interrupted)
AUTH = {"Authorization": f"Bearer {API_KEY}"}


@pytest.fixture(scope="module")
def tokenizer(checkpoint):
    return AutoTokenizer.from_pretrained(checkpoint)


@pytest.fixture(scope="module")
def pd(checkpoint, tokenizer):
    prefill = PrefillConnector(MooncakeTransport())
    p_model = load_model(checkpoint, torch.float32)
    with running_server(p_model, tokenizer, kv_connector=prefill, **P_ENGINE) as (p_url, p):
        decode = DecodeConnector(MooncakeTransport(), [p_url], transfer_timeout=60, api_key=API_KEY)
        with running_server(load_model(checkpoint, torch.float32), tokenizer, kv_connector=decode,
                            **ENGINE) as (d_url, d):
            with serve_app(build_router([d_url], 0.2, prefill_urls=[p_url])) as (url, _):
                yield {"url": url, "p": p, "d": d, "p_url": p_url, "d_url": d_url, "prefill": prefill}


@pytest.fixture(scope="module")
def colocated_server(loaded_model):
    with running_server(*own_model(loaded_model), **ENGINE) as served:
        yield served


@pytest.fixture(scope="module")
def colocated(colocated_server):
    return OpenAI(base_url=colocated_server[0] + "/v1", api_key=API_KEY, max_retries=0, timeout=60)


def client(pd, timeout=60) -> OpenAI:
    return OpenAI(base_url=pd["url"] + "/v1", api_key=API_KEY, max_retries=0, timeout=timeout)


def pools_full(*engines) -> bool:
    return all(e.kv_cache.all_blocks_free() and not e.scheduler.requests and not e.scheduler.sending for e in engines)


def prompts(lengths):
    return [[(7 * i + 3 * n) % 500 + 2 for i in range(n)] for n in lengths]


def test_greedy_equals_colocated(pd, colocated):
    c = client(pd)
    p_prefill, d_prefill = pd["p"].stats.prefill_tokens, pd["d"].stats.prefill_tokens
    transfers = pd["prefill"].stats.num_transfers
    lengths = [1, 5, 16, 17, 40, 75]
    for ids in prompts(lengths):
        kw = dict(model=MODEL, prompt=ids, max_tokens=12, temperature=0, logprobs=2, extra_body={"ignore_eos": True})
        ref, got = colocated.completions.create(**kw).choices[0], c.completions.create(**kw).choices[0]
        assert got.text == ref.text and got.finish_reason == ref.finish_reason
        assert got.logprobs.tokens == ref.logprobs.tokens
        assert got.logprobs.token_logprobs == pytest.approx(ref.logprobs.token_logprobs, abs=1e-4)
    assert pd["prefill"].stats.num_transfers - transfers == len(lengths)
    assert pd["p"].stats.prefill_tokens - p_prefill == sum(lengths)  # P prefilled every prompt ...
    assert pd["d"].stats.prefill_tokens == d_prefill  # ... and D none
    assert wait_until(lambda: pools_full(pd["p"], pd["d"]))


def test_streamed_chat_n_echo_and_seeded_equal_colocated(pd, colocated):
    c = client(pd)
    ids = prompts([30])[0]
    for kw in [dict(prompt=ids, max_tokens=10, temperature=0, n=2),
               dict(prompt=ids, max_tokens=6, temperature=0, echo=True, logprobs=1),
               dict(prompt=ids, max_tokens=0, echo=True, logprobs=2),  # score the prompt: P's log-probs, no token
               dict(prompt=ids, max_tokens=10, temperature=0.9, top_p=0.9, seed=11),
               dict(prompt="stop here", max_tokens=10, temperature=0, stop=["e"])]:
        ref = colocated.completions.create(model=MODEL, extra_body={"ignore_eos": True}, **kw)
        got = c.completions.create(model=MODEL, extra_body={"ignore_eos": True}, **kw)
        assert [x.text for x in got.choices] == [x.text for x in ref.choices], kw
        assert [x.finish_reason for x in got.choices] == [x.finish_reason for x in ref.choices]
        if kw.get("logprobs") is not None:
            assert got.choices[0].logprobs.token_logprobs[1:] == pytest.approx(
                ref.choices[0].logprobs.token_logprobs[1:], abs=1e-4)  # the prompt's, from P
        streamed = "".join(ch.choices[0].text for ch in c.completions.create(
            model=MODEL, stream=True, extra_body={"ignore_eos": True}, **{**kw, "n": 1}) if ch.choices)
        assert streamed == got.choices[0].text
    messages = [{"role": "user", "content": "tell me about blocks"}]
    ref = colocated.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, temperature=0)
    got = c.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, temperature=0)
    assert got.choices[0].message.content == ref.choices[0].message.content
    assert got.usage.prompt_tokens == ref.usage.prompt_tokens
    assert wait_until(lambda: pools_full(pd["p"], pd["d"]))


def test_prefix_cache_on_the_prefill_instance(pd, colocated):
    ids = prompts([70])[0]
    hits = pd["p"].kv_cache.stats.prefix_cache_hits
    outs = [client(pd).completions.create(model=MODEL, prompt=ids + [k], max_tokens=5, temperature=0).choices[0].text
            for k in (3, 4)]
    assert pd["p"].kv_cache.stats.prefix_cache_hits - hits == 64  # the second request: 4 full blocks from P's cache
    assert outs == [colocated.completions.create(model=MODEL, prompt=ids + [k], max_tokens=5, temperature=0)
                    .choices[0].text for k in (3, 4)]


def test_cached_tokens_are_the_prefill_instances_hits(pd):
    """usage.prompt_tokens_details.cached_tokens of D's answer: what P found in its prefix cache (whole blocks)."""
    c = client(pd)
    hits = pd["p"].kv_cache.stats.prefix_cache_hits
    ids = prompts([53])[0]
    got = [c.completions.create(model=MODEL, prompt=ids, max_tokens=2, temperature=0).usage
           .prompt_tokens_details.cached_tokens for _ in range(2)]
    assert got == [0, 48] and pd["p"].kv_cache.stats.prefix_cache_hits - hits == 48  # 3 whole blocks of 53 tokens
    messages = [{"role": "user", "content": "cached on the prefill instance, then streamed from decode"}]
    usages = [list(c.chat.completions.create(model=MODEL, messages=messages, max_tokens=2, temperature=0, stream=True,
                                             stream_options={"include_usage": True}))[-1].usage for _ in range(2)]
    assert [u.prompt_tokens_details.cached_tokens for u in usages] == [0, (usages[1].prompt_tokens - 1) // 16 * 16]
    assert usages[1].prompt_tokens > 16


def error_of(response):
    status, _, body = response
    assert "Traceback" not in body.decode()
    return status, json.loads(body)


@pytest.mark.parametrize("path, body", [
    ("/v1/completions", b"{not json"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 0}),
    ("/v1/completions", {"prompt": "hi", "temperature": -1}),
    ("/v1/completions", {"prompt": "hi", "model": "gpt-4"}),
    ("/v1/completions", {"prompt": [7] * 2000, "max_tokens": 1}),
    ("/v1/completions", {"prompt": []}),
    ("/v1/chat/completions", {"messages": "hi"}),
])
def test_bad_input_through_the_router_is_answered_as_colocated(pd, colocated_server, path, body):
    ref, got = error_of(http("POST", colocated_server[0] + path, body, AUTH)), error_of(http("POST", pd["url"] + path,
                                                                                               body, AUTH))
    assert got == ref and 400 <= got[0] < 500
    assert error_of(http("POST", pd["url"] + path, body)) == error_of(http("POST", colocated_server[0] + path, body))


def test_the_pd_routes_are_behind_the_api_key(pd):
    body = {"room": "x", "prompt_token_ids": [5], "sampling_params": {}, "targets": []}
    for path, data in (("/pd/prefill", body), ("/pd/abort", {"room": "x"})):
        status, err = error_of(http("POST", pd["p_url"] + path, data))
        assert status == 401 and err["error"]["type"] == "authentication_error"
    assert http("GET", pd["p_url"] + "/pd/info")[0] == 401 and http("GET", pd["p_url"] + "/pd/info", headers=AUTH)[0] == 200


def test_the_prefill_header_is_checked(pd, colocated_server):
    body = {"prompt": "hi", "max_tokens": 2}
    status, err = error_of(http("POST", pd["d_url"] + "/v1/completions", body, {**AUTH, "X-PD-Prefill": "http://evil"}))
    assert status == 400 and err["error"]["param"] == "x-pd-prefill" and "--pd-bootstrap" in err["error"]["message"]
    status, err = error_of(http("POST", colocated_server[0] + "/v1/completions", body,
                                {**AUTH, "X-PD-Prefill": pd["p_url"]}))
    assert status == 400 and "not a PD decode instance" in err["error"]["message"]
    assert http("POST", pd["d_url"] + "/v1/completions", body, AUTH)[0] == 200  # no header: served on D alone


def test_disconnects_mid_stream_and_mid_prefill_free_both_sides(pd):
    c = client(pd)
    stream = c.completions.create(model=MODEL, prompt=prompts([20])[0], max_tokens=400, stream=True,
                                  extra_body={"ignore_eos": True})
    for n, _ in enumerate(stream):
        if n == 2:
            break
    stream.close()
    assert wait_until(lambda: pools_full(pd["p"], pd["d"]), timeout=30)
    before = pd["p"].stats.prefill_tokens
    with pytest.raises(openai.APITimeoutError):  # gone while P prefills 1,000 tokens in chunks of 8 (~0.8 s)
        client(pd, timeout=0.3).completions.create(model=MODEL, prompt=prompts([1000])[0], max_tokens=4)
    assert wait_until(lambda: pools_full(pd["p"], pd["d"]), timeout=30), (pd["p"].kv_cache.usage(),
                                                                          pd["d"].kv_cache.usage())
    assert pd["p"].stats.prefill_tokens - before < 1000  # P stopped prefilling the abandoned prompt


def test_50_requests_aborted_at_random_points_leave_every_pool_full(pd, colocated):
    rng = random.Random(0)
    abandon_requests(pd["url"], prompts([rng.choice([3, 30, 90, 200]) for _ in range(50)]))
    assert wait_until(lambda: pools_full(pd["p"], pd["d"]), timeout=60), (pd["p"].kv_cache.usage(),
                                                                          pd["d"].kv_cache.usage())
    ids = prompts([45])[0]
    kw = dict(model=MODEL, prompt=ids, max_tokens=8, temperature=0)
    assert client(pd).completions.create(**kw).choices[0].text == colocated.completions.create(**kw).choices[0].text


def test_requests_that_do_not_fit_decode_wait_there(checkpoint, tokenizer, pd, colocated):
    """A decode instance with blocks for about two of these requests at once: the rest wait at D, none is dropped."""
    decode = DecodeConnector(MooncakeTransport(), [pd["p_url"]], transfer_timeout=60, api_key=API_KEY)
    with running_server(load_model(checkpoint, torch.float32), tokenizer, kv_connector=decode,
                        **{**ENGINE, "num_blocks": 14}) as (d_url, d):
        with serve_app(build_router([d_url], 0.2, prefill_urls=[pd["p_url"]])) as (url, _):
            c = OpenAI(base_url=url + "/v1", api_key=API_KEY, max_retries=0, timeout=120)
            ids = prompts([60, 61, 62, 63, 64, 65])
            with ThreadPoolExecutor(6) as pool:
                got = list(pool.map(lambda p: c.completions.create(model=MODEL, prompt=p, max_tokens=20, temperature=0,
                                                                   extra_body={"ignore_eos": True}), ids))
            ref = [colocated.completions.create(model=MODEL, prompt=p, max_tokens=20, temperature=0,
                                                extra_body={"ignore_eos": True}) for p in ids]
            assert [g.choices[0].text for g in got] == [r.choices[0].text for r in ref]
            assert wait_until(lambda: pools_full(d, pd["p"]))


def test_an_unreachable_prefill_instance_fails_the_request_in_bounded_time(checkpoint, tokenizer):
    dead = f"http://127.0.0.1:{free_port()}"
    decode = DecodeConnector(MooncakeTransport(), [dead], transfer_timeout=60)
    with running_server(load_model(checkpoint, torch.float32), tokenizer, kv_connector=decode, **ENGINE) as (d_url, d):
        t0 = time.monotonic()
        status, err = error_of(http("POST", d_url + "/v1/completions", {"prompt": "hi", "max_tokens": 4},
                                    {**AUTH, "X-PD-Prefill": dead}))
        assert status == 500 and "prefill instance" in err["error"]["message"] and time.monotonic() - t0 < 15
        assert wait_until(lambda: pools_full(d))
        with serve_app(build_router([d_url], 0.2, prefill_urls=[dead])) as (url, _):
            status, err = error_of(http("POST", url + "/v1/completions", {"prompt": "hi"}, AUTH))
            assert status == 503 and "prefill" in err["error"]["message"]
