"""Text prompts as the model was trained to see them (vLLM's rule and field): /v1/completions and the offline
LLM.generate add the tokenizer's special tokens (the tiny DeepSeek-V4 tokenizer's post-processor prepends its BOS, as
the publisher's does) unless told `add_special_tokens: false`; chat does not by default (its format writes the BOS);
token-id prompts are used as given. Usage, echo and the generated text follow the ids the model saw."""
import pytest
from openai import BadRequestError, OpenAI

from common.engine import LLM, SamplingParams
from encoding_deepseek_v4 import encode_chat

from serving_harness import API_KEY, MODEL

PROMPT = "The capital of France is"
GREEDY = dict(max_tokens=6, temperature=0, extra_body={"ignore_eos": True})


@pytest.fixture(scope="module")
def client(server):
    return OpenAI(base_url=server[0] + "/v1", api_key=API_KEY, max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def tokenizer(loaded_model):
    return loaded_model[1]


@pytest.fixture(scope="module")
def plain_ids(tokenizer):
    ids = tokenizer(PROMPT, add_special_tokens=False).input_ids
    assert tokenizer(PROMPT).input_ids == [tokenizer.bos_token_id] + ids  # this tokenizer adds a BOS
    return ids


def completion(client, prompt, **kw):
    extra = {**GREEDY["extra_body"], **kw.pop("extra_body", {})}
    return client.completions.create(model=MODEL, prompt=prompt, **{**GREEDY, **kw, "extra_body": extra})


def test_completions_add_the_bos_unless_told_not_to(client, tokenizer, plain_ids):
    bos = tokenizer.bos_token_id
    default = completion(client, PROMPT)
    assert default.usage.prompt_tokens == len(plain_ids) + 1
    assert default.choices[0].text == completion(client, [bos] + plain_ids).choices[0].text  # the model saw the BOS
    without = completion(client, PROMPT, extra_body={"add_special_tokens": False})
    assert without.usage.prompt_tokens == len(plain_ids)
    assert without.choices[0].text == completion(client, plain_ids).choices[0].text
    explicit = completion(client, PROMPT, extra_body={"add_special_tokens": True})
    assert explicit.choices[0].text == default.choices[0].text
    for flag in (True, False):  # token ids are never changed
        assert completion(client, plain_ids, extra_body={"add_special_tokens": flag}).usage.prompt_tokens == \
            len(plain_ids)


def test_echo_shows_the_bos_among_the_prompt_tokens_not_in_the_text(client, tokenizer, plain_ids):
    r = completion(client, PROMPT, echo=True, logprobs=1, max_tokens=2)
    lp = r.choices[0].logprobs
    assert r.choices[0].text.startswith(PROMPT) and not r.choices[0].text.startswith(tokenizer.bos_token)
    assert lp.tokens[: len(plain_ids) + 1] == [tokenizer.decode([t]) for t in [tokenizer.bos_token_id] + plain_ids]
    assert lp.token_logprobs[0] is None and len(lp.tokens) == r.usage.prompt_tokens + 2
    off = completion(client, PROMPT, echo=True, logprobs=1, max_tokens=2, extra_body={"add_special_tokens": False})
    assert off.choices[0].logprobs.tokens[0] == tokenizer.decode([plain_ids[0]])
    assert off.choices[0].text.startswith(PROMPT)


def test_chat_keeps_the_formats_bos_alone_by_default(client, tokenizer):
    messages = [{"role": "user", "content": "hi"}]
    text = encode_chat(messages)
    assert text.startswith(tokenizer.bos_token)  # the chat format writes the BOS itself
    once = tokenizer(text, add_special_tokens=False).input_ids
    r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2)
    assert r.usage.prompt_tokens == len(once)
    twice = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2,
                                           extra_body={"add_special_tokens": True})
    assert twice.usage.prompt_tokens == len(once) + 1  # on top of the format's, as vLLM's field says


def test_add_special_tokens_must_be_a_bool(client):
    with pytest.raises(BadRequestError, match="add_special_tokens"):
        completion(client, PROMPT, extra_body={"add_special_tokens": "no"})


def test_offline_generate_adds_the_bos_to_text_prompts(model_and_tokenizer, plain_ids):
    model, tokenizer = model_and_tokenizer
    llm = LLM(model, tokenizer)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    bos = tokenizer.bos_token_id
    text, ids = llm.generate([PROMPT, plain_ids], params, use_tqdm=False)  # default: special tokens
    assert text.prompt_token_ids == [bos] + plain_ids and ids.prompt_token_ids == plain_ids
    without = llm.generate([PROMPT, plain_ids], params, use_tqdm=False, add_special_tokens=False)
    assert [o.prompt_token_ids for o in without] == [plain_ids, plain_ids]  # ids never change
    assert without[0].token_ids == ids.token_ids
    assert llm.generate([[bos] + plain_ids], params, use_tqdm=False)[0].token_ids == text.token_ids
