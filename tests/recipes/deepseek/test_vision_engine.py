"""Image requests through the engine (the tiny Vision-Exp-layout checkpoint, fp32): the encoder stage before prefill,
batched across requests under its budget; chunked prefill that splits images, preemption and data-parallel ranks give
the single-process, unchunked outputs; the prefix cache keys image blocks by content; encoder outputs are freed once
consumed, finished, aborted or preempted; text-only requests are unchanged."""
import io

import pytest
import torch
from PIL import Image
from transformers import AutoTokenizer

from common.engine import LLM, SamplingParams
from common.parallel import LLMParallelLayout, destroy_parallel, init_parallel
from dist_helpers import run_ranks
from image_processor_deepseek import IMAGE_TOKEN
from tiny_deepseek_v4 import write_tiny_checkpoint
from weights_deepseek_v4 import load_model

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=2)


def image(size, seed) -> bytes:
    g = torch.Generator().manual_seed(seed)
    pixels = (torch.rand(size[1], size[0], 3, generator=g) * 255).to(torch.uint8).numpy()
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, "PNG")
    return buf.getvalue()


A, B, C = image((300, 200), 1), image((90, 160), 2), image((300, 200), 3)  # 47, 20 and 47 tokens
PROMPTS = [  # text, images; several images a prompt, images shared across prompts
    (f"Describe {IMAGE_TOKEN} please.", [A]),
    (f"Compare {IMAGE_TOKEN} with {IMAGE_TOKEN}", [B, C]),
    (f"{IMAGE_TOKEN} again", [A]),
    (f"Only text here, nothing else at all {IMAGE_TOKEN}.", [B]),
]


def mm(text, images):
    return {"prompt": text, "multi_modal_data": {"image": images}}


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    path = write_tiny_checkpoint(tmp_path_factory.mktemp("vision-engine") / "ckpt", seed=7, quantized=False)
    model, tok = load_model(path, torch.float32), AutoTokenizer.from_pretrained(path)
    reference = []  # each prompt alone, unchunked, no prefix cache
    for text, images in PROMPTS:
        llm = LLM(model, tok, block_size=16, enable_prefix_caching=False, max_num_batched_tokens=512)
        reference.append(llm.generate([mm(text, images)], GREEDY, use_tqdm=False)[0])
    return path, model, tok, reference


def assert_same(outs, reference):
    for out, want in zip(outs, reference):
        assert out.prompt_token_ids == want.prompt_token_ids
        assert out.token_ids == want.token_ids
        for got, ref in zip(out.logprobs, want.logprobs):
            assert abs(got.logprob - ref.logprob) < 1e-4


def assert_released(llm):
    engine = llm.engine
    assert engine.kv_cache.all_blocks_free()
    assert len(engine.scheduler.encoder_cache) == 0 and engine.scheduler.encoder_cache.num_tokens == 0


@pytest.mark.parametrize("engine_kwargs", [
    {},  # all at once: one encoder call for the step's images
    {"max_num_batched_tokens": 8, "max_num_encoder_input_tokens": 64},  # chunks of 8 split every image
    {"num_blocks": 9, "max_num_batched_tokens": 64},  # too few blocks for all: preemption by recompute
    {"max_num_encoder_input_tokens": 47, "encoder_cache_size": 50},  # one image at a time through the encoder
], ids=["batched", "chunked-split-images", "preemption", "encoder-budget"])
def test_image_requests_equal_each_alone_unchunked(setup, engine_kwargs):
    _, model, tok, reference = setup
    llm = LLM(model, tok, block_size=16, **engine_kwargs)
    outs = llm.generate([mm(*p) for p in PROMPTS], GREEDY, use_tqdm=False)
    assert_same(outs, reference)
    stats = llm.engine.stats
    if not engine_kwargs:  # batched across requests; A, B, C once each: equal images share one encode
        assert stats.encoder_calls == 1 and stats.encoder_images == 3
    if "max_num_batched_tokens" in engine_kwargs and engine_kwargs["max_num_batched_tokens"] == 8:
        assert max(stats.recent_step_tokens) <= 8 < min(len(o.prompt_token_ids) for o in outs)
    if "num_blocks" in engine_kwargs:
        assert llm.engine.scheduler.num_preemptions > 0
    if "encoder_cache_size" in engine_kwargs:
        assert stats.encoder_calls == stats.encoder_images  # never two images in the cache at once
    assert_released(llm)


def test_prefix_cache_keys_image_blocks_by_content(setup):
    _, model, tok, _ = setup
    prompt = (f"A long enough question, about this image: {IMAGE_TOKEN} and then a long tail of text after it, so "
              "that the image lies in full blocks")
    cold = {name: LLM(model, tok, block_size=16, enable_prefix_caching=False).generate(
        [mm(prompt, [im])], GREEDY, use_tqdm=False)[0] for name, im in (("a", A), ("c", C))}
    llm = LLM(model, tok, block_size=16)
    first = llm.generate([mm(prompt, [A])], GREEDY, use_tqdm=False)[0]
    text_blocks = first.prompt_token_ids.index(model.args.image_token_id) // 16 * 16
    encoded = llm.engine.stats.encoder_images
    image_end = len(first.prompt_token_ids) - first.prompt_token_ids[::-1].index(model.args.image_token_id)
    again = llm.generate([mm(prompt, [A])], GREEDY, use_tqdm=False)[0]  # the same image: its blocks reused
    assert again.num_cached_tokens == (len(again.prompt_token_ids) - 1) // 16 * 16 >= image_end
    assert llm.engine.stats.encoder_images == encoded  # and not encoded again
    other = llm.generate([mm(prompt, [C])], GREEDY, use_tqdm=False)[0]  # same placeholder ids, another image
    assert other.prompt_token_ids == first.prompt_token_ids
    assert other.num_cached_tokens == text_blocks  # only the text before it
    twin = llm.generate([first.prompt_token_ids], GREEDY, use_tqdm=False)[0]  # the same ids as text, no image
    assert twin.num_cached_tokens == text_blocks
    assert first.token_ids == again.token_ids == cold["a"].token_ids
    assert other.token_ids == cold["c"].token_ids != cold["a"].token_ids
    assert_released(llm)


def test_abort_mid_image_frees_the_encoder_output(setup):
    _, model, tok, _ = setup
    llm = LLM(model, tok, block_size=16, max_num_batched_tokens=8, max_num_encoder_input_tokens=64)
    engine = llm.engine
    rid = engine.add_request(mm(*PROMPTS[0]), GREEDY)
    for _ in range(3):  # the image starts in the first chunk; a few chunks in, its output is held
        engine.step()
    assert len(engine.scheduler.encoder_cache) == 1 and engine.requests[rid].num_computed_tokens < 40
    engine.abort(rid)
    assert_released(llm)


def test_text_only_requests_are_unchanged_by_the_vision_part(setup, tmp_path):
    path, model, tok, _ = setup
    text_path = write_tiny_checkpoint(tmp_path / "text", seed=7, quantized=False, vision=False)
    prompts = ["Hello there, how are you today?", "Tell me a story"]
    got = LLM(model, tok, block_size=16).generate(prompts, GREEDY, use_tqdm=False)
    want = LLM(load_model(text_path, torch.float32), tok, block_size=16).generate(prompts, GREEDY, use_tqdm=False)
    for a, b in zip(got, want):
        assert a.token_ids == b.token_ids
        assert [lp.logprob for lp in a.logprobs] == [lp.logprob for lp in b.logprobs]  # bit for bit


def test_bad_image_requests_are_refused_up_front(setup, tmp_path):
    _, model, tok, _ = setup
    engine = LLM(model, tok, block_size=16, max_num_encoder_input_tokens=32).engine
    with pytest.raises(ValueError, match="image 0 takes 47 tokens, more than the encoder takes at once"):
        engine.make_request(mm(*PROMPTS[0]), GREEDY)
    with pytest.raises(ValueError, match="1 image placeholders but 2 images"):
        engine.make_request(mm(f"x {IMAGE_TOKEN}", [B, B]), GREEDY)
    with pytest.raises(ValueError, match="image 0: cannot decode image"):
        engine.make_request(mm(f"x {IMAGE_TOKEN}", [b"not an image"]), GREEDY)
    text = write_tiny_checkpoint(tmp_path / "text", seed=7, quantized="bf16", vision=False)
    with pytest.raises(ValueError, match="takes no images"):
        LLM(load_model(text), tok).engine.make_request(mm(f"x {IMAGE_TOKEN}", [B]), GREEDY)


def rank_generate(path, world, layout, engine_kwargs, out_dir):
    parallel = init_parallel(LLMParallelLayout(world_size=world, **layout))
    try:
        llm = LLM(load_model(path, torch.float32, parallel=parallel), AutoTokenizer.from_pretrained(path),
                  block_size=16, **engine_kwargs)
        outs = llm.generate([mm(*p) for p in PROMPTS], GREEDY, use_tqdm=False)
        assert_released(llm)
        torch.save([(o.token_ids, [lp.logprob for lp in o.logprobs]) for o in outs], out_dir / f"r{parallel.rank}.pt")
    finally:
        destroy_parallel()


@pytest.mark.slow
@pytest.mark.parametrize("world, layout", [(2, {"lmhead_tp": 2}), (2, {"attn_tp": 2})], ids=["dp2-ep2", "tp2"])
def test_image_requests_over_ranks_equal_one_process(setup, tmp_path, world, layout):
    """DP2 (each rank encodes its own requests' images) and TP2 (both peers encode the same ones), chunked prefill
    splitting the images, against the single-process unchunked outputs."""
    path, _, _, reference = setup
    run_ranks(rank_generate, world, path, world, layout, {"max_num_batched_tokens": 16,
                                                          "max_num_encoder_input_tokens": 64}, tmp_path)
    for rank in range(world):
        for (tokens, logprobs), want in zip(torch.load(tmp_path / f"r{rank}.pt"), reference):
            assert tokens == want.token_ids
            assert max(abs(a - b.logprob) for a, b in zip(logprobs, want.logprobs)) < 1e-4


def test_run_sh_image_prompt(tmp_path):
    """`run.sh --image FILE --prompt TEXT` as a user runs it (the default tiny checkpoint, no download); a missing
    image or one that is not an image: one line, exit code 2."""
    import subprocess
    from pathlib import Path
    run_sh = Path(__file__).resolve().parents[3] / "recipes" / "deepseek" / "run.sh"
    (tmp_path / "a.png").write_bytes(A)
    (tmp_path / "b.png").write_bytes(B)
    (tmp_path / "bad.png").write_bytes(b"not an image")

    def run(*args):
        return subprocess.run(["bash", str(run_sh), *map(str, args)], capture_output=True, text=True, timeout=600)

    r = run("--image", tmp_path / "a.png", "--image", tmp_path / "b.png", "--prompt", "Compare them.",
            "--max-tokens", 3)
    assert r.returncode == 0, r.stderr
    assert "> Compare them." in r.stdout and "[3 tokens, length]" in r.stdout
    stats = dict(kv.split("=") for kv in r.stdout.strip().splitlines()[-1].split())
    assert int(stats["prompt_tokens"]) > 47 + 20  # both images' tokens
    for args, needle in (((tmp_path / "none.png",), "no such file"), ((tmp_path / "bad.png",), "cannot decode image")):
        r = run("--image", *args, "--prompt", "x")
        assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1 and needle in r.stderr, r.stderr
