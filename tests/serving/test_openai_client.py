"""The official openai client against the server: outputs equal the offline engine's, streamed or not."""
import pytest
from openai import OpenAI

from common.engine import LLM, SamplingParams
from encoding_deepseek_v4 import encode_chat, parse_completion

from serving_harness import API_KEY, MODEL, http, own_model

PROMPTS = ["Hello, my name is", "The capital of France is", "1 2 3 4"]
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def client(server):
    return OpenAI(base_url=server[0] + "/v1", api_key=API_KEY, max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def offline(loaded_model):
    return LLM(*own_model(loaded_model))


def greedy(max_tokens=MAX_TOKENS, **kw):
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, **kw)


def test_completions_equal_offline(client, offline):
    expected = offline.generate(PROMPTS, greedy(), use_tqdm=False)
    r = client.completions.create(model=MODEL, prompt=PROMPTS, max_tokens=MAX_TOKENS, temperature=0,
                                  extra_body={"ignore_eos": True})
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert [c.text for c in r.choices] == [o.text for o in expected]
    assert all(c.finish_reason == "length" for c in r.choices)
    assert r.usage.completion_tokens == 3 * MAX_TOKENS
    assert r.usage.prompt_tokens == sum(len(o.prompt_token_ids) for o in expected)
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    tokens = client.completions.create(model=MODEL, prompt=expected[0].prompt_token_ids, max_tokens=MAX_TOKENS,
                                       temperature=0, extra_body={"ignore_eos": True})
    assert tokens.choices[0].text == expected[0].text


def test_streamed_completions_equal_offline(client, offline):
    expected = offline.generate(PROMPTS[:1], greedy(stop=["xyz"]), use_tqdm=False)[0]
    chunks = list(client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=MAX_TOKENS, temperature=0,
                                            stream=True, stop="xyz", stream_options={"include_usage": True},
                                            extra_body={"ignore_eos": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == expected.text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == MAX_TOKENS
    assert all(c.object == "text_completion" for c in chunks)


def test_stop_string_never_leaks(client, offline):
    full = offline.generate(PROMPTS[:1], greedy(max_tokens=16), use_tqdm=False)[0].text
    stop = full[5:8]
    expected = offline.generate(PROMPTS[:1], greedy(max_tokens=16, stop=[stop]), use_tqdm=False)[0]
    assert expected.finish_reason == "stop"
    chunks = list(client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=16, temperature=0,
                                            stream=True, stop=[stop], extra_body={"ignore_eos": True}))
    texts = [c.choices[0].text for c in chunks]
    assert "".join(texts) == expected.text and stop not in "".join(texts)
    assert chunks[-1].choices[0].finish_reason == "stop"


@pytest.mark.parametrize("stream", [False, True])
def test_chat_equals_offline(client, offline, stream):
    """The server's chat = the offline engine on the publisher's prompt, its text (special tokens kept) parsed."""
    messages = [{"role": "user", "content": "What is 2 + 2?"}]
    expected = offline.generate([encode_chat(messages)], greedy(skip_special_tokens=False), use_tqdm=False,
                                add_special_tokens=False)[0]  # the chat format writes its own BOS
    want = parse_completion(expected.text, thinking=False)
    kw = dict(model=MODEL, messages=messages, max_tokens=MAX_TOKENS, temperature=0, extra_body={"ignore_eos": True})
    if not stream:
        r = client.chat.completions.create(**kw)
        assert r.object == "chat.completion" and r.choices[0].message.role == "assistant"
        assert r.choices[0].message.content == want.content and r.choices[0].finish_reason == "length"
        assert r.usage.prompt_tokens == len(expected.prompt_token_ids)
        return
    chunks = list(client.chat.completions.create(stream=True, **kw))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == want.content
    assert chunks[-1].choices[0].finish_reason == "length"
    assert all(c.object == "chat.completion.chunk" for c in chunks)


@pytest.mark.parametrize("stream", [False, True])
def test_chat_reasoning_split(client, offline, stream):
    messages = [{"role": "user", "content": "Think first."}]
    prompt = encode_chat(messages, thinking=True)
    assert prompt.endswith("<think>")
    kw = dict(model=MODEL, messages=messages, max_tokens=MAX_TOKENS, temperature=0,
              extra_body={"ignore_eos": True, "chat_template_kwargs": {"thinking": True}})
    expected = offline.generate([prompt], greedy(skip_special_tokens=False), use_tqdm=False,
                                add_special_tokens=False)[0]
    want = parse_completion(expected.text, thinking=True)
    if stream:
        chunks = list(client.chat.completions.create(stream=True, **kw))
        reasoning = "".join(getattr(c.choices[0].delta, "reasoning_content", None) or "" for c in chunks)
        content = "".join(c.choices[0].delta.content or "" for c in chunks)
    else:
        message = client.chat.completions.create(**kw).choices[0].message
        reasoning, content = message.reasoning_content, message.content
    assert (reasoning, content) == (want.reasoning_content, want.content)


def test_n2_seeded_and_logprobs(client):
    r = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=4, n=2, seed=7, temperature=1.0,
                                  logprobs=3, extra_body={"ignore_eos": True})
    assert [c.index for c in r.choices] == [0, 1] and r.usage.completion_tokens == 8
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 4
    assert all(len(top) <= 3 and v <= 0 for top, v in zip(lp.top_logprobs, lp.token_logprobs))
    again = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=4, n=2, seed=7, temperature=1.0,
                                      extra_body={"ignore_eos": True})
    assert [c.text for c in again.choices] == [c.text for c in r.choices]

    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=3,
                                          n=2, logprobs=True, top_logprobs=2, extra_body={"ignore_eos": True})
    assert [c.index for c in chat.choices] == [0, 1]
    content = chat.choices[0].logprobs.content
    assert len(content) == 3 and all(len(t.top_logprobs) == 2 and t.logprob <= 0 for t in content)
    assert all(isinstance(t.token, str) and isinstance(t.bytes, list) for t in content)


def test_models_health_metrics(client, server):
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert http("GET", server[0] + "/health")[0] == 200
    status, headers, body = http("GET", server[0] + "/metrics")
    assert status == 200 and headers["content-type"].startswith("text/plain")
    text = body.decode()
    for name in ('requests_total{outcome="success"}', "time_to_first_token_seconds_count",
                 "inter_token_latency_seconds_count", "num_requests_running", "num_requests_waiting",
                 "kv_cache_usage"):
        assert name in text
    success = float(text.split('requests_total{outcome="success"} ')[1].split()[0])
    assert success >= 1
