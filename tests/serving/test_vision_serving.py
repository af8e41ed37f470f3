"""Images in chat requests (the tiny Vision-Exp-layout checkpoint): OpenAI's image_url parts with data: and http(s)
URLs (a local HTTP server on 127.0.0.1), several images a message, in the publisher's chat encoding; the answer equals
the engine's offline one and usage counts the image tokens; limits and bad images answered 400 naming the problem;
through the PD router (P encodes, D never runs its encoder) == colocated; `run.sh --serve` and `run.sh --serve --pd
1:1` answer the official openai client's vision example."""
import base64
import http.server as http_server
import io
import json
import threading

import numpy as np
import pytest
import torch
from openai import OpenAI
from PIL import Image

from chat_format_deepseek_v4 import DeepseekV4ChatFormat
from common.engine import LLM, SamplingParams
from common.kv_transfer import DecodeConnector, MooncakeTransport, PrefillConnector
from common.serving.chat_format import Conversation
from common.serving.media_connector import MediaConnector
from common.serving.router import build_router
from weights_deepseek_v4 import load_model

from serving_harness import API_KEY, MODEL, http, own_model, running_server, serve_app, wait_until

ENGINE = dict(max_num_seqs=8, max_num_batched_tokens=32, max_num_encoder_input_tokens=128, block_size=16)
AUTH = {"Authorization": f"Bearer {API_KEY}"}


def png(size, seed, mode="RGB") -> bytes:
    rng = np.random.default_rng(seed)
    pixels = rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
    image = Image.fromarray(pixels)
    if mode != "RGB":
        image = Image.fromarray(pixels[..., 0].astype(np.uint16) * 257) if mode == "I;16" else image.convert(mode)
    buf = io.BytesIO()
    image.save(buf, "PNG")
    return buf.getvalue()


def data_url(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


def solid(size) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", size, (30, 60, 90)).save(buf, "PNG")
    return buf.getvalue()


IMAGES = {"/cat.png": png((200, 140), 1), "/dog.png": png((90, 160), 2), "/wide.png": solid((3000, 2000))}


class ImageHandler(http_server.BaseHTTPRequestHandler):
    def do_GET(self):  # noqa: N802 - http.server's name
        body = IMAGES.get(self.path)
        self.send_response(200 if body else 404)
        self.send_header("Content-Length", str(len(body or b"")))
        self.end_headers()
        self.wfile.write(body or b"")

    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def image_server():
    server = http_server.ThreadingHTTPServer(("127.0.0.1", 0), ImageHandler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


MEDIA = MediaConnector(max_bytes=200_000, timeout_s=5, max_pixels=1_000_000)


@pytest.fixture(scope="module")
def server(loaded_model):
    with running_server(*own_model(loaded_model), media=MEDIA, max_images=3, **ENGINE) as served:
        yield served


@pytest.fixture(scope="module")
def offline_model(loaded_model):
    """A model of its own for the offline engine (the servers' engines keep theirs)."""
    return own_model(loaded_model)


def openai_client(url) -> OpenAI:
    return OpenAI(base_url=url + "/v1", api_key=API_KEY, max_retries=0, timeout=120)


def vision_example(client, model, url, question="What's in this image?", **kw):
    """OpenAI's documented vision example (chat.completions with a text part and an image_url part)."""
    return client.chat.completions.create(model=model, messages=[{"role": "user", "content": [
        {"type": "text", "text": question}, {"type": "image_url", "image_url": {"url": url}}]}],
        max_tokens=8, temperature=0, **kw)


def offline(model_and_tokenizer, content, max_tokens=8):
    """The engine's greedy answer for one user message, offline: the publisher's encoding, the images' bytes."""
    model, tokenizer = model_and_tokenizer
    prompt = DeepseekV4ChatFormat().encode(Conversation([{"role": "user", "content": content}]))
    images = [source(p["image_url"]["url"]) for p in prompt.images]
    out = LLM(model, tokenizer, **ENGINE).generate([{"prompt": prompt.text, "multi_modal_data": {"image": images}}],
                                                   SamplingParams(temperature=0, max_tokens=max_tokens),
                                                   use_tqdm=False, add_special_tokens=False)[0]  # BOS: in the text
    return out


def source(url: str) -> bytes:
    """The bytes an image URL of these tests names (the local server's path, or a data: URL's payload)."""
    if url.startswith("http"):
        return IMAGES["/" + url.rsplit("/", 1)[1]]
    return base64.b64decode(url.split(",", 1)[1])


def pools_full(*engines) -> bool:
    return all(e.kv_cache.all_blocks_free() and not e.scheduler.requests and not e.scheduler.sending
               and len(e.scheduler.encoder_cache) == 0 for e in engines)


def test_openai_vision_example_equals_offline(server, image_server, offline_model):
    url, engine = server
    client = openai_client(url)
    by_http = vision_example(client, MODEL, image_server + "/cat.png")
    by_data = vision_example(client, MODEL, data_url(IMAGES["/cat.png"]))
    want = offline(offline_model, [{"type": "text", "text": "What's in this image?"},
                                         {"type": "image_url", "image_url": {"url": image_server + "/cat.png"}}])
    assert by_http.choices[0].message.content == by_data.choices[0].message.content == want.text
    assert by_http.usage.prompt_tokens == len(want.prompt_token_ids)  # the image's tokens counted
    model = offline_model[0]
    span = model.engine_contract().encoder.process(IMAGES["/cat.png"]).num_tokens  # 200x140: 10 x 15 patches
    assert span == 4 * (5 + 1) + 2 and want.prompt_token_ids.count(model.args.image_token_id) == span
    assert wait_until(lambda: pools_full(engine))


def test_several_images_a_message_streamed_equals_whole(server, image_server, offline_model):
    url, engine = server
    content = [{"type": "image_url", "image_url": {"url": image_server + "/dog.png"}},
               {"type": "text", "text": "and"},
               {"type": "image_url", "image_url": {"url": data_url(IMAGES["/cat.png"])}},
               {"type": "text", "text": "Which one is bigger?"}]
    client = openai_client(url)
    whole = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": content}],
                                           max_tokens=8, temperature=0)
    streamed = "".join(ch.choices[0].delta.content or "" for ch in client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": content}], max_tokens=8, temperature=0, stream=True)
        if ch.choices)
    want = offline(offline_model, content)
    assert whole.choices[0].message.content == streamed == want.text
    assert whole.usage.prompt_tokens == len(want.prompt_token_ids)
    assert engine.stats.encoder_images >= 2
    assert wait_until(lambda: pools_full(engine))


@pytest.mark.parametrize("parts, status, needle", [
    ([{"type": "image_url", "image_url": {"url": data_url(png((40, 40), 4))}}] * 4, 400, "4 images in one request"),
    ([{"type": "image_url", "image_url": {"url": "/wide.png"}}], 400, "more than the 1000000 allowed"),
    ([{"type": "image_url", "image_url": {"url": data_url(png((400, 400), 5))}}], 400, "larger than 200000 bytes"),
    ([{"type": "image_url", "image_url": {"url": data_url(png((60, 60), 6)[:200])}}], 400, "cannot decode image"),
    ([{"type": "image_url", "image_url": {"url": data_url(b"GIF89a not really")}}], 400, "cannot decode image"),
    ([{"type": "image_url", "image_url": {"url": data_url(png((30, 30), 7, "I;16"))}}], 400, "mode 'I;16' is not"),
    ([{"type": "image_url", "image_url": {"url": "/missing.png"}}], 400, "answered HTTP 404"),
    ([{"type": "image_url", "image_url": {"url": "ftp://example.com/a.png"}}], 400, "data: or http(s)"),
    ([{"type": "image_url", "image_url": {"url": data_url(png((30, 30), 8)), "detail": "high"}}], 400, '"auto"'),
    ([{"type": "image_url"}], 400, "an image part is"),
    ([{"type": "text", "text": "sneaky <｜deepseek_image｜>"}], 400, "image placeholder"),
    ([{"type": "input_audio", "input_audio": {}}], 400, "'input_audio' content parts are not supported"),
], ids=["too-many", "pixels", "bytes", "truncated", "not-an-image", "mode", "http-404", "scheme", "detail",
        "no-url", "placeholder-text", "audio"])
def test_limits_and_bad_images_are_400s_naming_the_problem(server, image_server, parts, status, needle):
    url, engine = server
    parts = [{**p, "image_url": {**p["image_url"], "url": image_server + p["image_url"]["url"]}}
             if p.get("image_url", {}).get("url", "").startswith("/") else p for p in parts]
    code, _, body = http("POST", url + "/v1/chat/completions", {"model": MODEL, "max_tokens": 4, "messages": [
        {"role": "user", "content": [{"type": "text", "text": "look"}, *parts]}]}, AUTH)
    assert code == status, body
    error = json.loads(body)["error"]
    assert needle in error["message"] and error["type"] == "invalid_request_error"
    assert wait_until(lambda: pools_full(engine))


def test_images_outside_user_messages_are_refused(server):
    url, _ = server
    image = {"type": "image_url", "image_url": {"url": data_url(png((30, 30), 9))}}
    code, _, body = http("POST", url + "/v1/chat/completions", {"model": MODEL, "messages": [
        {"role": "system", "content": [image]}, {"role": "user", "content": "hi"}]}, AUTH)
    assert code == 400 and b"image content parts go in user messages" in body


def test_a_text_only_model_refuses_images(tmp_path, image_server):
    from transformers import AutoTokenizer
    from tiny_deepseek_v4 import write_tiny_checkpoint
    path = write_tiny_checkpoint(tmp_path / "text", quantized="bf16", vision=False)
    with running_server(load_model(path), AutoTokenizer.from_pretrained(path)) as (url, _):
        code, _, body = http("POST", url + "/v1/chat/completions", {"model": MODEL, "messages": [
            {"role": "user", "content": [{"type": "image_url", "image_url": {"url": image_server + "/cat.png"}}]}]},
            AUTH)
    assert code == 400 and b"takes no images" in body


@pytest.fixture(scope="module")
def pd(checkpoint, loaded_model):
    _, tokenizer = loaded_model
    prefill = PrefillConnector(MooncakeTransport())
    with running_server(load_model(checkpoint, torch.float32), tokenizer, kv_connector=prefill,
                        **{**ENGINE, "max_num_batched_tokens": 8}) as (p_url, p):
        decode = DecodeConnector(MooncakeTransport(), [p_url], transfer_timeout=60, api_key=API_KEY)
        with running_server(load_model(checkpoint, torch.float32), tokenizer, kv_connector=decode, media=MEDIA,
                            **ENGINE) as (d_url, d):
            with serve_app(build_router([d_url], 0.2, prefill_urls=[p_url])) as (url, _):
                yield {"url": url, "p": p, "d": d}


def test_pd_router_vision_example_equals_colocated(pd, server, image_server):
    """The prefill instance encodes (the images go to it as the decode instance received them, chunked prefill
    splitting them), the decode instance runs no encoder and prefills nothing; the answers are the colocated ones."""
    d_prefill = pd["d"].stats.prefill_tokens
    for url in (image_server + "/cat.png", data_url(IMAGES["/dog.png"])):
        ref = vision_example(openai_client(server[0]), MODEL, url, extra_body={"ignore_eos": True}, logprobs=True)
        got = vision_example(openai_client(pd["url"]), MODEL, url, extra_body={"ignore_eos": True}, logprobs=True)
        assert got.choices[0].message.content == ref.choices[0].message.content
        assert got.usage.prompt_tokens == ref.usage.prompt_tokens
        assert [t.logprob for t in got.choices[0].logprobs.content] == pytest.approx(
            [t.logprob for t in ref.choices[0].logprobs.content], abs=1e-4)
    assert pd["p"].stats.encoder_images >= 2 and pd["d"].stats.encoder_images == 0
    assert pd["d"].stats.prefill_tokens == d_prefill
    assert wait_until(lambda: pools_full(pd["p"], pd["d"]))


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["serve", "pd-router"])
def test_run_sh_serve_answers_the_openai_vision_example(checkpoint, image_server, offline_model, mode):
    """The official openai client's vision example against `run.sh --serve` and `run.sh --serve --pd 1:1` (P, D and
    the router, processes of their own): the offline engine's answer, with its default preset."""
    from test_serve_subprocess import several_instances
    content = [{"type": "text", "text": "What's in this image?"},
               {"type": "image_url", "image_url": {"url": image_server + "/cat.png"}}]
    model, tokenizer = offline_model
    prompt = DeepseekV4ChatFormat().encode(Conversation([{"role": "user", "content": content}]))
    want = LLM(model, tokenizer, block_size=16).generate(
        [{"prompt": prompt.text, "multi_modal_data": {"image": [IMAGES["/cat.png"]]}}],
        SamplingParams(temperature=0, max_tokens=8), use_tqdm=False, add_special_tokens=False)[0]
    with several_instances(checkpoint, *(() if mode == "serve" else ("--pd", "1:1"))) as (_, client):
        got = vision_example(client, "tiny", image_server + "/cat.png")
    assert got.choices[0].message.content == want.text
    assert got.usage.prompt_tokens == len(want.prompt_token_ids)
