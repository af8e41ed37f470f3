"""The server with MTP speculative decoding: streamed greedy output equals the plain engine's, several tokens may
arrive per step, and /metrics reports the drafts."""
import torch
from openai import OpenAI

from common.engine import LLM, SamplingParams
from serving_harness import API_KEY, MODEL, http, running_server
from weights_deepseek_v4 import load_model

PROMPTS = ["Hello, my name is", "The capital of France is"]


def test_streamed_greedy_output_with_mtp_equals_plain(checkpoint, model_and_tokenizer):
    _, tokenizer = model_and_tokenizer
    model = load_model(checkpoint, torch.float32, mtp=True)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    expected = LLM(model, tokenizer).generate(PROMPTS, params, use_tqdm=False)
    with running_server(model, tokenizer, max_num_seqs=8, num_speculative_tokens=2) as (url, engine):
        client = OpenAI(base_url=url + "/v1", api_key=API_KEY, max_retries=0, timeout=60)
        for prompt, want in zip(PROMPTS, expected):
            stream = client.completions.create(model=MODEL, prompt=prompt, max_tokens=24, temperature=0, stream=True,
                                               extra_body={"ignore_eos": True})
            assert "".join(c.choices[0].text for c in stream if c.choices) == want.text
        status, _, body = http("GET", url + "/metrics")
        assert status == 200
        metrics = dict(line.rsplit(" ", 1) for line in body.decode().splitlines() if line and not line.startswith("#"))
        assert float(metrics["spec_decode_num_draft_tokens_total"]) == engine.stats.num_draft_tokens > 0
        assert "spec_decode_draft_acceptance_rate" in metrics
        assert engine.kv_cache.all_blocks_free()
