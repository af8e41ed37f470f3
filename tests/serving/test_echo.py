"""`echo` on /v1/completions as the legacy API and vLLM give it: the prompt's text, tokens, log-probs and offsets
before the completion's, checked against a full-sequence transformers forward of the same prompt; max_tokens 0
scores the prompt only (how evaluation harnesses score multiple-choice answers). Non-streaming requests whose
client goes away are aborted."""
import json
import socket
import time

import pytest
import torch
from openai import OpenAI
from transformers import DeepseekV4ForCausalLM

from serving_harness import API_KEY, MODEL, http, wait_until


@pytest.fixture(scope="module")
def reference(checkpoint):
    hf = DeepseekV4ForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()

    @torch.no_grad()
    def logprobs(ids):  # [P, V]: log_softmax of the logits at each prompt position
        return torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), -1)
    return logprobs


def client_for(url):
    return OpenAI(base_url=url + "/v1", api_key=API_KEY, max_retries=0, timeout=60)


def check_prompt_part(lp, tokenizer, ids, want, k):
    assert lp.tokens[: len(ids)] == [tokenizer.decode([t]) for t in ids]
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    for i in range(1, len(ids)):
        assert abs(lp.token_logprobs[i] - want[i - 1, ids[i]].item()) < 1e-4
        top = want[i - 1].topk(k)
        assert list(lp.top_logprobs[i]) == [tokenizer.decode([t]) for t in top.indices.tolist()] or \
            len(set(tokenizer.decode([t]) for t in top.indices.tolist())) < k  # two ids may decode alike
    offsets = [0]
    for token in lp.tokens[:-1]:
        offsets.append(offsets[-1] + len(token))
    assert lp.text_offset == offsets


def test_echo_with_max_tokens_0_scores_the_prompt(server, model_and_tokenizer, reference):
    url, engine = server
    tokenizer = model_and_tokenizer[1]
    prompt = "The capital of France is Paris"
    ids = tokenizer(prompt).input_ids  # as the server tokenizes a text prompt: the tokenizer's BOS first
    assert ids[0] == tokenizer.bos_token_id
    r = client_for(url).completions.create(model=MODEL, prompt=prompt, echo=True, logprobs=2, max_tokens=0)
    choice = r.choices[0]
    assert choice.text == prompt and choice.finish_reason == "length"  # the text as sent (vLLM's echo)
    assert len(choice.logprobs.tokens) == len(ids) == r.usage.prompt_tokens and r.usage.completion_tokens == 0
    check_prompt_part(choice.logprobs, tokenizer, ids, reference(ids), 2)
    assert wait_until(lambda: engine.kv_cache.all_blocks_free())


def test_echo_then_completion_with_token_id_prompts_and_n(server, model_and_tokenizer, reference):
    url, _ = server
    tokenizer = model_and_tokenizer[1]
    ids = [40, 41, 300, 12, 99, 7, 250]
    r = client_for(url).completions.create(model=MODEL, prompt=ids, echo=True, logprobs=1, max_tokens=4, n=2,
                                           temperature=0, extra_body={"ignore_eos": True})
    want = reference(ids)
    for choice in r.choices:
        prompt_text = tokenizer.decode(ids)
        assert choice.text.startswith(prompt_text)
        lp = choice.logprobs
        assert len(lp.tokens) == len(ids) + 4
        check_prompt_part(lp, tokenizer, ids, want, 1)
        assert choice.text == prompt_text + "".join(lp.tokens[len(ids):])
        first = want[-1].argmax().item()  # greedy: the first completion token is the last position's argmax
        assert lp.tokens[len(ids)] == tokenizer.decode([first])
        assert abs(lp.token_logprobs[len(ids)] - want[-1, first].item()) < 1e-4


def test_streamed_echo_sends_the_prompt_first(server, model_and_tokenizer):
    url, _ = server
    tokenizer = model_and_tokenizer[1]
    prompt = "Hello there"
    chunks = list(client_for(url).completions.create(model=MODEL, prompt=prompt, echo=True, max_tokens=3,
                                                     stream=True, extra_body={"ignore_eos": True}))
    assert chunks[0].choices[0].text.startswith(prompt)
    whole = "".join(c.choices[0].text for c in chunks)
    plain = client_for(url).completions.create(model=MODEL, prompt=prompt, echo=True, max_tokens=3, temperature=0,
                                               extra_body={"ignore_eos": True}).choices[0].text
    assert whole.startswith(prompt) and plain.startswith(prompt) and len(tokenizer(whole).input_ids) >= 3


def test_non_streaming_request_of_a_client_that_disconnects_is_aborted(server):
    url, engine = server
    host, port = url.removeprefix("http://").split(":")
    body = json.dumps({"model": MODEL, "prompt": "a long one", "max_tokens": 1000, "ignore_eos": True}).encode()
    aborted_before = _aborted(url)
    with socket.create_connection((host, int(port))) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     + f"Authorization: Bearer {API_KEY}\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body)
        assert wait_until(lambda: engine.has_unfinished(), timeout=10)
        time.sleep(0.2)
    assert wait_until(lambda: not engine.has_unfinished() and engine.kv_cache.all_blocks_free(), timeout=10)
    assert _aborted(url) == aborted_before + 1


def _aborted(url) -> float:
    body = http("GET", url + "/metrics")[2].decode()
    return float(body.split('requests_total{outcome="aborted"} ')[1].split()[0])
