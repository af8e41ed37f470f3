"""PD disaggregation of Ling-3.0-Flash (tiny checkpoint, fp32) on 127.0.0.1: the prefill instance sends each
request's KDA states (its slot of the "kda" state group: conv history and recurrent state of every KDA layer) with its
MLA latent blocks, over real Mooncake transfer engines (TCP), behind the router; against a colocated server over the
same weights, through the official openai client. Aborts on either side leave every block and state slot free on
both."""
import random

import pytest
import torch
from openai import OpenAI
from transformers import AutoTokenizer

from common.kv_transfer import DecodeConnector, MooncakeTransport, PrefillConnector
from common.serving.router import build_router
from tiny_ling import write_tiny_checkpoint
from weights_ling import load_model

from serving_harness import API_KEY, MODEL, abandon_requests, running_server, serve_app, wait_until

ENGINE = dict(max_num_seqs=8, max_num_batched_tokens=32, block_size=16)
P_ENGINE = {**ENGINE, "max_num_batched_tokens": 8}  # P prefills in chunks of 8 (and slowly enough to be interrupted)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("pd-ling") / "ckpt", seed=4)


@pytest.fixture(scope="module")
def pd(checkpoint):
    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    prefill = PrefillConnector(MooncakeTransport())
    with running_server(load_model(checkpoint, torch.float32), tokenizer, kv_connector=prefill,
                        **P_ENGINE) as (p_url, p):
        decode = DecodeConnector(MooncakeTransport(), [p_url], transfer_timeout=60, api_key=API_KEY)
        with running_server(load_model(checkpoint, torch.float32), tokenizer, kv_connector=decode,
                            **ENGINE) as (d_url, d):
            with running_server(load_model(checkpoint, torch.float32), tokenizer, **ENGINE) as (c_url, _):
                with serve_app(build_router([d_url], 0.2, prefill_urls=[p_url])) as (url, _):
                    yield {"url": url, "p": p, "d": d, "prefill": prefill, "colocated": c_url}


def client(url, timeout=60) -> OpenAI:
    return OpenAI(base_url=url + "/v1", api_key=API_KEY, max_retries=0, timeout=timeout)


def pools_full(*engines) -> bool:
    return all(e.kv_cache.all_blocks_free() and not e.scheduler.requests and not e.scheduler.sending for e in engines)


def prompts(lengths):
    return [[(7 * i + 3 * n) % 500 + 2 for i in range(n)] for n in lengths]


def test_decode_equals_colocated_token_for_token(pd):
    """Prompts within one block, on a block boundary, past it, and past KDA's 64-token chunk: D decodes from the
    states P sent, and P prefilled every prompt while D prefilled none."""
    p_prefill, d_prefill = pd["p"].stats.prefill_tokens, pd["d"].stats.prefill_tokens
    transfers = pd["prefill"].stats.num_transfers
    lengths = [1, 5, 16, 17, 40, 75]
    for ids in prompts(lengths):
        kw = dict(model=MODEL, prompt=ids, max_tokens=12, temperature=0, logprobs=2, extra_body={"ignore_eos": True})
        ref = client(pd["colocated"]).completions.create(**kw).choices[0]
        got = client(pd["url"]).completions.create(**kw).choices[0]
        assert got.logprobs.tokens == ref.logprobs.tokens and got.text == ref.text
        assert got.logprobs.token_logprobs == pytest.approx(ref.logprobs.token_logprobs, abs=1e-4)
    assert pd["prefill"].stats.num_transfers - transfers == len(lengths)
    assert pd["p"].stats.prefill_tokens - p_prefill == sum(lengths)  # P prefilled every prompt ...
    assert pd["d"].stats.prefill_tokens == d_prefill  # ... and D none
    assert wait_until(lambda: pools_full(pd["p"], pd["d"]))


def test_aborts_on_either_side_free_states_and_blocks_on_both(pd):
    """Streams dropped after a few tokens (D aborts), requests given up while P still prefills (P aborts), at random
    points over 16 requests: every block and state slot comes back on both instances, which serve on as before."""
    rng = random.Random(0)
    abandon_requests(pd["url"], prompts([rng.choice([3, 30, 90, 200]) for _ in range(16)]), max_timeout=1.0)
    assert wait_until(lambda: pools_full(pd["p"], pd["d"]), timeout=60), (pd["p"].kv_cache.usage(),
                                                                          pd["d"].kv_cache.usage())
    kw = dict(model=MODEL, prompt=prompts([45])[0], max_tokens=8, temperature=0)
    assert client(pd["url"]).completions.create(**kw).choices[0].text == \
        client(pd["colocated"]).completions.create(**kw).choices[0].text
