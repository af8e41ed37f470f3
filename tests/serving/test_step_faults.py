"""A step that raises fails its own requests, not the engine or the server: a real forward of the tiny model that
raises whenever a marked token id is among its inputs, a real uvicorn, the official client and raw HTTP."""
import json

import openai
import pytest
from openai import OpenAI

from common.engine import LLM, EngineConfig, LLMEngine, SamplingParams
from serving_harness import API_KEY, MODEL, RaisesOnToken, http, own_model, running_server, wait_until

POISON = 7  # a token id the test model refuses


@pytest.fixture(scope="module")
def faulty(loaded_model):
    model, tokenizer = own_model(loaded_model)
    return RaisesOnToken(model, POISON), tokenizer


GOOD = [20, 21, 22, 23, 24]
BAD = [20, POISON, 22]
PARAMS = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


def test_offline_step_fault_fails_that_steps_requests_only(faulty, model_and_tokenizer):
    model, tokenizer = faulty
    want = LLM(model_and_tokenizer[0], tokenizer).generate([GOOD], PARAMS, use_tqdm=False)[0].token_ids
    llm = LLM(model, tokenizer, max_num_batched_tokens=64)
    engine = llm.engine
    engine.add_request(BAD, PARAMS, "bad")
    outs = engine.step()  # the first step holds only the bad prompt
    assert [(o.request_id, o.finish_reason, o.finished) for o in outs] == [("bad", "error", True)]
    assert "token 7" in outs[0].error and engine.stats.step_errors == 1
    assert engine.kv_cache.all_blocks_free() and not engine.has_unfinished()
    assert llm.generate([GOOD], PARAMS, use_tqdm=False)[0].token_ids == want  # then serves as before
    assert engine.stats.consecutive_step_errors == 0
    # both in one step: both fail; a later request is fine, nothing leaked
    outs = llm.generate([GOOD, BAD], PARAMS, use_tqdm=False)
    assert [o.finish_reason for o in outs] == ["error", "error"]
    assert llm.generate([GOOD], PARAMS, use_tqdm=False)[0].token_ids == want
    assert engine.kv_cache.all_blocks_free() and engine.stats.step_errors == 2


def test_fault_in_a_later_decode_step_frees_the_prefix_cached_blocks(faulty):
    model, tokenizer = faulty
    engine = LLMEngine(model, tokenizer, EngineConfig(block_size=16))
    engine.add_request(list(range(30, 66)), SamplingParams(temperature=0, max_tokens=50, ignore_eos=True,
                                                           stop_token_ids=[]), "r")
    finals = []
    while engine.has_unfinished():
        finals += [o for o in engine.step() if o.finished]
    assert len(finals) == 1  # the model's greedy output may or may not reach the poison token
    if finals[0].finish_reason == "error":
        assert POISON in finals[0].token_ids
    assert engine.kv_cache.all_blocks_free()


def sse_events(body: bytes) -> list:
    return [line[len("data: "):] for line in body.decode().splitlines() if line.startswith("data: ")]


def test_server_answers_500_then_keeps_serving(faulty):
    model, tokenizer = faulty
    with running_server(model, tokenizer, max_num_seqs=4) as (url, engine):
        auth = {"Authorization": f"Bearer {API_KEY}"}
        status, _, body = http("POST", url + "/v1/completions", {"model": MODEL, "prompt": BAD, "max_tokens": 4},
                               auth)
        error = json.loads(body)["error"]
        assert status == 500 and error["type"] == "internal_server_error" and "token 7" in error["message"]
        # a stream: a choice with finish_reason "error", an error event, then [DONE]
        status, _, body = http("POST", url + "/v1/completions", {"model": MODEL, "prompt": BAD, "max_tokens": 4,
                                                                 "stream": True}, auth)
        events = sse_events(body)
        assert status == 200 and events[-1] == "[DONE]"
        assert json.loads(events[-3])["choices"][0]["finish_reason"] == "error"
        assert "token 7" in json.loads(events[-2])["error"]["message"]
        client = OpenAI(base_url=url + "/v1", api_key=API_KEY, max_retries=0, timeout=60)
        for _ in range(2):  # a step that succeeds resets the count of failed steps in a row
            r = client.completions.create(model=MODEL, prompt=GOOD, max_tokens=3, extra_body={"ignore_eos": True})
            assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 3
            assert engine.stats.consecutive_step_errors == 0
            with pytest.raises(openai.APIError, match="token 7"):  # the official client raises on the event
                list(client.completions.create(model=MODEL, prompt=BAD, max_tokens=3, stream=True))
        r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=3)
        assert r.choices[0].finish_reason in ("length", "stop")
        assert http("GET", url + "/health")[0] == 200
        metrics = http("GET", url + "/metrics")[2].decode()
        assert "\nengine_step_errors_total 4.0\n" in metrics
        assert wait_until(lambda: engine.kv_cache.all_blocks_free() and not engine.has_unfinished())


def test_consecutive_failed_steps_make_the_server_unhealthy(faulty):
    model, tokenizer = faulty
    with running_server(model, tokenizer, max_num_seqs=4) as (url, engine):
        auth = {"Authorization": f"Bearer {API_KEY}"}
        for _ in range(3):  # the default limit: 3 failed steps in a row
            status, _, _ = http("POST", url + "/v1/completions", {"model": MODEL, "prompt": BAD, "max_tokens": 2},
                                auth)
            assert status == 500
        assert wait_until(lambda: http("GET", url + "/health")[0] == 503)
        status, _, body = http("POST", url + "/v1/completions", {"model": MODEL, "prompt": GOOD, "max_tokens": 2},
                               auth)
        assert status == 503 and "engine" in json.loads(body)["error"]["message"]
        assert engine.kv_cache.all_blocks_free()
