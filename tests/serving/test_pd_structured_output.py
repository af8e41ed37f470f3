"""Structured output under PD disaggregation and n > 1, through the router and the official client: a constrained
chat request prefilled on P (which samples its first token under the grammar) and decoded on D equals the
colocated server's answer token for token, greedy and seeded; n seeded choices each satisfy the grammar and come
back the same when asked again."""
import json
import re

import jsonschema
import pytest
import torch
from openai import OpenAI

from common.engine import LLM, SamplingParams, StructuredOutputsParams
from encoding_deepseek_v4 import encode_chat
from weights_deepseek_v4 import load_model

from serving_harness import API_KEY, MODEL, http, wait_until
from test_pd import colocated, colocated_server, pd, pools_full, tokenizer  # noqa: F401 - the PD fixtures

ASK = [{"role": "user", "content": "Pick a colour."}]
CHOICES = ["red", "green", "blue"]
ANSWER = {"type": "object", "properties": {"answer": {"enum": ["yes", "no"]},
                                          "score": {"type": "integer", "minimum": 0, "maximum": 9}},
          "required": ["answer", "score"], "additionalProperties": False}
RESPONSE_FORMAT = {"type": "json_schema", "json_schema": {"name": "answer", "schema": ANSWER, "strict": True}}


@pytest.fixture(scope="module")
def offline(checkpoint, tokenizer):  # noqa: F811
    return LLM(load_model(checkpoint, torch.float32), tokenizer, block_size=16)


def via_router(pd) -> OpenAI:  # noqa: F811
    return OpenAI(base_url=pd["url"] + "/v1", api_key=API_KEY, max_retries=0, timeout=120)


def tokens(choice) -> list[tuple[str, float]]:
    return [(t.token, t.logprob) for t in choice.logprobs.content]


def assert_same(got, ref):
    assert [c.message.content for c in got.choices] == [c.message.content for c in ref.choices]
    assert [c.finish_reason for c in got.choices] == [c.finish_reason for c in ref.choices]
    for g, r in zip(got.choices, ref.choices, strict=True):
        assert [t for t, _ in tokens(g)] == [t for t, _ in tokens(r)]  # token for token
        assert [v for _, v in tokens(g)] == pytest.approx([v for _, v in tokens(r)], abs=1e-4)


def test_first_token_from_prefill_obeys_the_grammar_and_pd_equals_colocated(pd, colocated, offline,  # noqa: F811
                                                                            tokenizer):  # noqa: F811
    ids = tokenizer(encode_chat(ASK), add_special_tokens=False).input_ids
    so = StructuredOutputsParams(choice=CHOICES)
    free = offline.generate([ids], SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)[0].token_ids[0]
    manager = offline.engine.structured_output
    assert not manager.accept(manager.start(so, ids), free)  # unconstrained, P's first token would break the grammar
    want = offline.generate([ids], SamplingParams(temperature=0, max_tokens=8, structured_outputs=so),
                            use_tqdm=False)[0]
    assert want.token_ids[0] != free and want.text in CHOICES

    p_before, d_before = pd["p"].stats.prefill_tokens, pd["d"].stats.prefill_tokens
    kw = dict(model=MODEL, messages=ASK, max_tokens=8, temperature=0, logprobs=True,
              extra_body={"structured_outputs": {"choice": CHOICES}})
    ref, got = colocated.chat.completions.create(**kw), via_router(pd).chat.completions.create(**kw)
    assert got.usage.prompt_tokens == len(ids) == ref.usage.prompt_tokens
    assert_same(got, ref)
    assert got.choices[0].message.content == want.text and got.choices[0].finish_reason == "stop"
    assert [t for t, _ in tokens(got.choices[0])] == [tokenizer.decode([t]) for t in want.token_ids]
    assert pd["p"].stats.prefill_tokens - p_before == len(ids)  # P prefilled and sampled the first token ...
    assert pd["d"].stats.prefill_tokens == d_before  # ... D none
    assert wait_until(lambda: pools_full(pd["p"], pd["d"]))


@pytest.mark.parametrize("kw", [
    dict(temperature=0, response_format=RESPONSE_FORMAT),
    dict(temperature=1.0, seed=11, extra_body={"structured_outputs": {"json": ANSWER, "disable_any_whitespace": True}}),
    dict(temperature=1.0, seed=3, extra_body={"structured_outputs": {"regex": r"[a-z]{2}-[0-9]{3}"}}),
    dict(temperature=0, max_tokens=200, response_format=RESPONSE_FORMAT,  # P's first token: free reasoning
         messages=[{"role": "user", "content": "Answer in JSON."}],
         extra_body={"chat_template_kwargs": {"thinking": True}}),
], ids=["json-schema-greedy", "json-schema-seeded", "regex-seeded", "json-schema-after-reasoning"])
def test_constrained_chat_over_pd_equals_colocated(pd, colocated, kw):  # noqa: F811
    extra = kw.get("extra_body", {})
    thinking, regex = "chat_template_kwargs" in extra, extra.get("structured_outputs", {}).get("regex")
    kw = dict(model=MODEL, logprobs=True, **{"messages": ASK, "max_tokens": 60, **kw})
    ref, got = colocated.chat.completions.create(**kw), via_router(pd).chat.completions.create(**kw)
    assert_same(got, ref)
    reasoning = [getattr(c.message, "reasoning_content", None) for c in got.choices]
    assert reasoning == [getattr(c.message, "reasoning_content", None) for c in ref.choices]
    assert (reasoning[0] is not None) == thinking
    content = got.choices[0].message.content
    assert got.choices[0].finish_reason == "stop"
    if regex:
        assert re.fullmatch(regex, content)
    else:
        jsonschema.validate(json.loads(content), ANSWER)
    assert wait_until(lambda: pools_full(pd["p"], pd["d"]))


@pytest.mark.parametrize("where", ["colocated", "pd"])
def test_n_seeded_choices_each_obey_the_grammar_and_repeat(pd, colocated, where):  # noqa: F811
    c = colocated if where == "colocated" else via_router(pd)
    kw = dict(model=MODEL, messages=ASK, max_tokens=20, temperature=1.0, n=4, seed=5,
              extra_body={"structured_outputs": {"regex": r"[a-z]{3}[0-9]{2}"}})
    first, again = c.chat.completions.create(**kw), c.chat.completions.create(**kw)
    texts = [x.message.content for x in first.choices]
    assert all(re.fullmatch(r"[a-z]{3}[0-9]{2}", t) for t in texts), texts
    assert all(x.finish_reason == "stop" for x in first.choices)
    assert len(set(texts)) > 1  # the choices are sampled each with its own seed (seed + index) ...
    assert [x.message.content for x in again.choices] == texts  # ... and so are the same again
    if where == "pd":
        assert texts == [x.message.content for x in colocated.chat.completions.create(**kw).choices]
        assert wait_until(lambda: pools_full(pd["p"], pd["d"]))


def strict_json(raw: bytes):
    """JSON as the standard has it: NaN and +-Infinity are not numbers there (JavaScript clients refuse them)."""
    def refuse(name):
        raise ValueError(f"{name} is not JSON")
    return json.loads(raw, parse_constant=refuse)


@pytest.mark.parametrize("where", ["colocated", "pd"])
def test_top_logprobs_beyond_what_the_grammar_allows_are_json(pd, colocated_server, where):  # noqa: F811
    """A constrained row allows 2 tokens here and 5 top log-probs are asked: the other 3 are masked out, yet the
    answer (and, over PD, P's answer to D) is strict JSON with finite numbers."""
    url = colocated_server[0] if where == "colocated" else pd["url"]
    so = {"structured_outputs": {"choice": ["red", "green"]}}
    auth = {"Authorization": f"Bearer {API_KEY}"}
    status, _, raw = http("POST", url + "/v1/chat/completions", {"model": MODEL, "messages": ASK, "max_tokens": 8,
                                                                 "temperature": 0, "logprobs": True,
                                                                 "top_logprobs": 5, **so}, auth)
    assert status == 200, raw[:300]
    content = strict_json(raw)["choices"][0]["logprobs"]["content"]
    assert "".join(t["token"] for t in content).startswith(("red", "green"))
    for t in content:
        assert len(t["top_logprobs"]) <= 5 and t["top_logprobs"][0]["logprob"] == t["logprob"]
    status, _, raw = http("POST", url + "/v1/completions", {"model": MODEL, "prompt": "Pick:", "max_tokens": 8,
                                                            "temperature": 0, "logprobs": 5, "stream": True, **so},
                          auth)
    assert status == 200
    events = [line[len(b"data: "):] for line in raw.split(b"\n") if line.startswith(b"data: {")]
    assert events and all(strict_json(e) for e in events)


WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8},
                                           "days": {"type": "integer", "minimum": 1, "maximum": 14}},
           "required": ["city", "days"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}}]


def test_a_forced_tool_call_through_the_pd_router_equals_colocated_streamed_or_not(pd, colocated):  # noqa: F811
    kw = dict(model=MODEL, messages=[{"role": "user", "content": "Weather in Paris for 3 days?"}], tools=TOOLS,
              tool_choice="required", max_tokens=300, temperature=0)
    ref, got = colocated.chat.completions.create(**kw), via_router(pd).chat.completions.create(**kw)
    assert got.choices[0].finish_reason == ref.choices[0].finish_reason == "tool_calls"
    call, want = got.choices[0].message.tool_calls[0], ref.choices[0].message.tool_calls[0]
    assert (call.function.name, call.function.arguments) == (want.function.name, want.function.arguments)
    jsonschema.validate(json.loads(call.function.arguments), WEATHER)
    pieces = {}
    for chunk in via_router(pd).chat.completions.create(stream=True, **kw):
        for piece in chunk.choices[0].delta.tool_calls or [] if chunk.choices else []:
            name, args = pieces.get(piece.index, ("", ""))
            pieces[piece.index] = (name + (piece.function.name or ""), args + (piece.function.arguments or ""))
    assert pieces[0] == (call.function.name, call.function.arguments)  # streamed == whole
    assert wait_until(lambda: pools_full(pd["p"], pd["d"]))
