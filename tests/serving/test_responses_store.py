"""The responses store (store, previous_response_id, GET / DELETE /v1/responses/{id}) on the tiny random model, through
the official client: a continuation is the whole conversation sent by hand (greedy, token for token: instructions not
carried over, a function_call_output answering the previous response's call), unknown, deleted and evicted ids are
404s naming the field; and /v1/responses whole and streamed through the data-parallel router over two instances (a
continuation reaches the instance that stores its id, whichever the router would otherwise pick) and the PD router."""
import contextlib
import json

import openai
import pytest
from openai import OpenAI

from chat_format_deepseek_v4 import DeepseekV4ChatFormat
from common.engine import EngineConfig, LLMEngine
from common.serving import AsyncLLMEngine
from common.serving.api_server import build_app
from common.serving.http_utils import APIError
from common.serving.protocol_responses import ResponsesRequest
from common.serving.response_store import ResponseStore
from common.serving.responses import OpenAIServingResponses
from common.serving.router import build_router

from serving_harness import API_KEY, MODEL, http, own_model, running_server, serve_app
from test_pd import pd, tokenizer  # noqa: F401 - the PD fixture (prefill + decode instances behind the router)
from test_responses import ASK, TOOLS

AUTH = {"Authorization": f"Bearer {API_KEY}"}
GREEDY = dict(model=MODEL, max_output_tokens=6, temperature=0)


def connect(url: str) -> OpenAI:
    return OpenAI(base_url=url + "/v1", api_key=API_KEY, max_retries=0, timeout=120)


@contextlib.contextmanager
def instance(loaded_model, responses_store_size: int):
    model, tok = own_model(loaded_model)
    engine = LLMEngine(model, tok, EngineConfig(max_num_seqs=4))
    app = build_app(AsyncLLMEngine(engine), tok, MODEL, api_key=API_KEY, chat_format=DeepseekV4ChatFormat(),
                    responses_store_size=responses_store_size)
    with serve_app(app, engine) as served:
        yield served


@pytest.fixture(scope="module")
def client(server):
    return connect(server[0])


@pytest.fixture(scope="module")
def other_server(loaded_model):
    with running_server(*own_model(loaded_model), max_num_seqs=16) as served:  # as the server fixture's
        yield served


@pytest.fixture(scope="module")
def dp(server, other_server):
    """The router over the server fixture's instance and a second one: (its URL, the Router, the instance URLs)."""
    app = build_router([server[0], other_server[0]], 0.2)
    with serve_app(app) as (url, _):
        yield url, app.state.router, (server[0], other_server[0])


def by_hand(c: OpenAI, first_input: str, first, turn: list, **kw):
    """The continuation of `first` sent whole: its input (a user text), its output, then `turn`."""
    return c.responses.create(input=[{"role": "user", "content": first_input}] + first.output + turn, store=False,
                              **kw)


def continue_and_check(c: OpenAI):
    """first (with instructions), then a continuation by previous_response_id, whole and streamed: the same tokens as
    the conversation sent by hand without the first request's instructions (OpenAI does not carry them over)."""
    first = c.responses.create(instructions="Be brief.", input="Hello, who are you?", **GREEDY)
    assert first.store is True and first.previous_response_id is None
    turn = [{"role": "user", "content": "And what can you do?"}]
    second = c.responses.create(previous_response_id=first.id, input=turn, **GREEDY)
    events = list(c.responses.create(previous_response_id=first.id, input=turn, stream=True, **GREEDY))
    ref = by_hand(c, "Hello, who are you?", first, turn, **GREEDY)
    with_instructions = by_hand(c, "Hello, who are you?", first, turn, instructions="Be brief.", **GREEDY)
    assert second.previous_response_id == first.id and second.instructions is None and second.store is True
    assert (second.usage.input_tokens, second.usage.output_tokens) == (ref.usage.input_tokens,
                                                                        ref.usage.output_tokens)
    assert with_instructions.usage.input_tokens > ref.usage.input_tokens  # so instructions would have shown
    assert second.output_text == ref.output_text
    final = events[-1].response
    assert events[0].type == "response.created" and final.previous_response_id == first.id
    assert final.output_text == ref.output_text and final.usage.input_tokens == ref.usage.input_tokens
    assert ref.store is False
    return first, second


def error_of(status_headers_body) -> tuple[int, dict]:
    status, _, body = status_headers_body
    assert b"Traceback" not in body
    return status, json.loads(body)["error"]


def test_a_continuation_is_the_conversation_sent_by_hand(client):
    continue_and_check(client)


def test_a_function_call_output_answers_the_previous_responses_call(client, server):
    first = client.responses.create(input=ASK, tools=TOOLS, tool_choice="required", max_output_tokens=300,
                                    temperature=0)
    calls = [o for o in first.output if o.type == "function_call"]
    assert calls
    outputs = [{"type": "function_call_output", "call_id": c.call_id, "output": f"result {i}"}
               for i, c in enumerate(calls)]
    kw = dict(tools=TOOLS, max_output_tokens=4, temperature=0)
    second = client.responses.create(previous_response_id=first.id, input=outputs, **kw)
    ref = client.responses.create(input=[{"role": "user", "content": ASK}] + first.output + outputs, store=False, **kw)
    assert second.usage.input_tokens == ref.usage.input_tokens and second.output_text == ref.output_text
    # a call id the previous response did not make is refused, naming the item of this request's input
    status, error = error_of(http("POST", server[0] + "/v1/responses", {
        "previous_response_id": first.id, "input": [{"type": "function_call_output", "call_id": "call_x",
                                                     "output": "?"}]}, AUTH))
    assert status == 400 and error["param"] == "input.0.call_id" and "answers no function_call" in error["message"]


def test_retrieve_delete_and_unknown_ids(client, server):
    url = server[0]
    first = client.responses.create(input="Remember me.", metadata={"k": "v"}, **GREEDY)
    got = client.responses.retrieve(first.id)
    assert got.model_dump() == first.model_dump()
    unstored = client.responses.create(input="Forget me.", store=False, **GREEDY)
    assert unstored.store is False
    for missing in ("resp_unknown", unstored.id):
        status, error = error_of(http("POST", url + "/v1/responses", {"input": "hi", "previous_response_id": missing},
                                      AUTH))
        assert status == 404 and error["type"] == "invalid_request_error" and error["code"] == 404
        assert error["param"] == "previous_response_id" and f"{missing!r} not found" in error["message"]
        status, error = error_of(http("GET", f"{url}/v1/responses/{missing}", headers=AUTH))
        assert status == 404 and error["param"] == "response_id"
    with pytest.raises(openai.NotFoundError):
        client.responses.create(input="hi", previous_response_id="resp_unknown", **GREEDY)
    status, error = error_of(http("GET", f"{url}/v1/responses/{first.id}?stream=true", headers=AUTH))
    assert status == 400 and error["param"] == "stream"
    assert http("GET", f"{url}/v1/responses/{first.id}")[0] == 401  # behind the API key
    client.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(first.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.create(input="hi", previous_response_id=first.id, **GREEDY)
    assert error_of(http("DELETE", f"{url}/v1/responses/{first.id}", headers=AUTH))[0] == 404


def test_an_evicted_id_is_404(loaded_model):
    with instance(loaded_model, responses_store_size=1) as (url, _):
        c = connect(url)
        old = c.responses.create(input="one", **GREEDY)
        new = c.responses.create(input="two", **GREEDY)  # the store holds one: `old` goes
        status, error = error_of(http("POST", url + "/v1/responses", {"input": "hi", "previous_response_id": old.id},
                                      AUTH))
        assert status == 404 and error["param"] == "previous_response_id" and "evicted" in error["message"]
        with pytest.raises(openai.NotFoundError):
            c.responses.retrieve(old.id)
        assert c.responses.retrieve(new.id).id == new.id
        assert c.responses.create(input="three", previous_response_id=new.id, **GREEDY).previous_response_id == new.id


def test_a_server_without_a_store_refuses_store_true():
    responses = OpenAIServingResponses(None, None, ResponseStore(0))
    with pytest.raises(APIError) as e:
        responses.stores(ResponsesRequest(input="hi", store=True))
    assert e.value.status == 400 and e.value.param == "store"
    assert not responses.stores(ResponsesRequest(input="hi"))  # the default: stored when the server keeps a store
    assert OpenAIServingResponses(None, None, ResponseStore(1)).stores(ResponsesRequest(input="hi"))


def test_the_store_is_bounded_least_recently_used_first():
    store = ResponseStore(2)
    for i in range(3):
        store.put({"id": f"r{i}"}, [])
        store.get("r0")  # used: kept
    assert len(store) == 2 and store.get("r0") is not None and store.get("r1") is None


def test_responses_whole_and_streamed_through_the_dp_router(dp, client):
    url, router, _ = dp
    c = connect(url)
    kw = dict(input="Hello, who are you?", reasoning={"effort": "high"}, max_output_tokens=10, temperature=0)
    direct = client.responses.create(store=False, model=MODEL, **kw)
    whole = c.responses.create(model=MODEL, **kw)
    with c.responses.stream(model=MODEL, **kw) as stream:
        events = list(stream)
    final = events[-1].response
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert whole.output_text == final.output_text == direct.output_text
    assert [o.type for o in whole.output] == [o.type for o in final.output] == [o.type for o in direct.output]
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == direct.output_text
    assert whole.id in router.owners and final.id in router.owners  # read from the answer and the created event
    assert [m.id for m in c.models.list()] == [MODEL]  # the other /v1 endpoints pass too


def test_a_continuation_reaches_the_instance_that_stores_it(dp):
    url, router, instances = dp
    c = connect(url)
    first, second = continue_and_check(c)
    owner = router.owners[first.id].url
    holds = {u: http("GET", f"{u}/v1/responses/{first.id}", headers=AUTH)[0] == 200 for u in instances}
    assert holds == {u: u == owner for u in instances}
    assert router.owners[second.id].url == owner
    served = {u.url: u.served for u in router.upstreams}
    chain = second
    for _ in range(3):  # least outstanding, ties round robin: plain requests would alternate between the two
        chain = c.responses.create(previous_response_id=chain.id, input="Go on.", **GREEDY)
        assert router.owners[chain.id].url == owner
    assert {u.url: u.served - served[u.url] for u in router.upstreams} == {u: 3 * (u == owner) for u in instances}
    router.owners.clear()  # a router that never saw the id (restarted) asks the instances
    assert c.responses.retrieve(chain.id).id == chain.id and router.owners[chain.id].url == owner
    c.responses.delete(chain.id)
    assert chain.id not in router.owners
    with pytest.raises(openai.NotFoundError) as e:  # no instance has it: one answers its 404
        c.responses.create(previous_response_id=chain.id, input="Go on.", **GREEDY)
    assert e.value.body["param"] == "previous_response_id"


def test_responses_through_the_pd_router(pd):  # noqa: F811
    c = connect(pd["url"])
    prefilled = pd["p"].stats.prefill_tokens
    first, second = continue_and_check(c)
    assert pd["p"].stats.prefill_tokens > prefilled  # P prefilled them, D decoded and stores them
    assert c.responses.retrieve(second.id).output_text == second.output_text
    assert http("GET", f"{pd['d_url']}/v1/responses/{second.id}", headers=AUTH)[0] == 200
