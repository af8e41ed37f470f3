"""Cached prompt tokens in usage (vLLM's RequestOutput.num_cached_tokens): prompt_tokens_details.cached_tokens in
chat and completions (whole, and the stream's include_usage chunk), input_tokens_details.cached_tokens in
/v1/responses, also through the data-parallel router: a prompt's first request reports 0, the same prompt again the
whole blocks the prefix cache held (all but the last prompt token is the most a hit covers). PD: test_pd.py."""
import uuid

import pytest
from openai import OpenAI

from common.serving.router import build_router

from serving_harness import API_KEY, MODEL, serve_app

BLOCK = 16  # the server fixture's EngineConfig.block_size


@pytest.fixture(scope="module")
def client(server):
    return OpenAI(base_url=server[0] + "/v1", api_key=API_KEY, max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def routed(server):
    """The same server behind the data-parallel router."""
    with serve_app(build_router([server[0]], 0.2)) as (url, _):
        yield OpenAI(base_url=url + "/v1", api_key=API_KEY, max_retries=0, timeout=60)


def fresh_text() -> str:
    """A prompt no earlier request began with (its first block is new to the prefix cache)."""
    return f"{uuid.uuid4().hex} tell me about the prefix cache and its blocks"


def hit(prompt_tokens: int) -> int:
    """The prefix-cache hit of a prompt that is all in the cache: its whole blocks before the last token."""
    return (prompt_tokens - 1) // BLOCK * BLOCK


def chat_usage(c: OpenAI, messages, stream: bool):
    kw = dict(model=MODEL, messages=messages, max_tokens=2, temperature=0)
    if not stream:
        return c.chat.completions.create(**kw).usage
    chunks = list(c.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    assert chunks[-1].choices == []
    return chunks[-1].usage


def completion_usage(c: OpenAI, prompt, stream: bool, n: int = 1):
    kw = dict(model=MODEL, prompt=prompt, max_tokens=2, temperature=0, n=n)
    if not stream:
        return c.completions.create(**kw).usage
    return list(c.completions.create(stream=True, stream_options={"include_usage": True}, **kw))[-1].usage


@pytest.mark.parametrize("stream", [False, True])
def test_chat_reports_the_prompt_tokens_the_cache_held(client, stream):
    messages = [{"role": "user", "content": fresh_text()}]
    first, second = (chat_usage(client, messages, stream) for _ in range(2))
    assert first.prompt_tokens == second.prompt_tokens > BLOCK
    assert first.prompt_tokens_details.cached_tokens == 0
    assert second.prompt_tokens_details.cached_tokens == hit(second.prompt_tokens) >= BLOCK


@pytest.mark.parametrize("stream", [False, True])
def test_completions_count_each_prompt_once(client, loaded_model, stream):
    """Two prompts, n=2 the second time: each prompt's hit counts once (its first choice's), like its tokens."""
    prompts = [fresh_text(), fresh_text() + " and again"]
    first = completion_usage(client, prompts, stream)
    second = completion_usage(client, prompts, stream, n=2)
    assert first.prompt_tokens == second.prompt_tokens and first.prompt_tokens_details.cached_tokens == 0
    lengths = [len(loaded_model[1](p).input_ids) for p in prompts]  # completions add the BOS
    assert sum(lengths) == second.prompt_tokens
    assert second.prompt_tokens_details.cached_tokens == sum(hit(n) for n in lengths) >= 2 * BLOCK


@pytest.mark.parametrize("stream", [False, True])
def test_responses_report_input_tokens_details(client, stream):
    text = fresh_text()

    def usage():
        kw = dict(model=MODEL, input=text, max_output_tokens=2, temperature=0)
        if not stream:
            return client.responses.create(**kw).usage
        events = list(client.responses.create(stream=True, **kw))
        assert events[-1].type == "response.incomplete"
        return events[-1].response.usage
    first, second = usage(), usage()
    assert first.input_tokens_details.cached_tokens == 0
    assert second.input_tokens_details.cached_tokens == hit(second.input_tokens) >= BLOCK


def test_the_router_relays_cached_tokens(routed):
    messages = [{"role": "user", "content": fresh_text()}]
    first, second = chat_usage(routed, messages, False), chat_usage(routed, messages, True)
    assert first.prompt_tokens_details.cached_tokens == 0
    assert second.prompt_tokens_details.cached_tokens == hit(second.prompt_tokens) >= BLOCK
    text = fresh_text()
    first, second = completion_usage(routed, text, True), completion_usage(routed, text, False)
    assert (first.prompt_tokens_details.cached_tokens, second.prompt_tokens_details.cached_tokens) == \
        (0, hit(second.prompt_tokens))
