"""A real uvicorn on 127.0.0.1 (a thread of this process) serving an engine; helpers the serving tests share."""
import contextlib
import copy
import email.message
import json
import random
import threading
import time
import urllib.error
import urllib.request

import openai
import uvicorn
from concurrent.futures import ThreadPoolExecutor
from torch import nn

from common.engine import EngineConfig, LLMEngine
from common.serving import AsyncLLMEngine
from common.serving.api_server import build_app
from chat_format_deepseek_v4 import DeepseekV4ChatFormat
from ports import free_port

MODEL = "tiny-deepseek-v4"
API_KEY = "test-key"


def own_model(loaded_model):
    """(a copy of a loaded model for one engine, the tokenizer): an engine owns its model's caches, so engines
    never share a model."""
    return copy.deepcopy(loaded_model[0]), loaded_model[1]



@contextlib.contextmanager
def running_server(model, tokenizer, api_key=API_KEY, max_waiting=256, kv_connector=None, chat_format=None,
                   media=None, max_images=8, **engine_kwargs):
    """Yields (base_url, engine); the server and its engine thread stop on exit. chat_format: DeepSeek-V4's unless
    given (the tiny model is a DeepSeek-V4); media, max_images: build_app's image limits."""
    engine = LLMEngine(model, tokenizer, EngineConfig(**engine_kwargs), kv_connector=kv_connector)
    app = build_app(AsyncLLMEngine(engine, max_waiting=max_waiting), tokenizer, MODEL, api_key=api_key,
                    chat_format=chat_format or DeepseekV4ChatFormat(), media=media, max_images=max_images)
    with serve_app(app, engine) as served:
        yield served


@contextlib.contextmanager
def serve_app(app, engine=None):
    """uvicorn on a free 127.0.0.1 port in a thread: yields (base_url, engine) until the caller is done."""
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning",
                                           timeout_graceful_shutdown=2))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}", engine
    finally:
        server.should_exit = True
        thread.join(timeout=15)


def wait_until(condition, timeout=10.0) -> bool:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def abandon_requests(url: str, prompts: list[list[int]], seed: int = 0, max_timeout: float = 1.5) -> None:
    """Send each prompt (max_tokens 300, 8 at a time) and give it up at a random point: half of them streamed and
    closed after 0..5 chunks, the other half abandoned by a client timeout of 0.05..max_timeout s (mid-prefill or
    mid-decode)."""
    rng = random.Random(seed)
    plans = [(ids, rng.random() < 0.5, rng.uniform(0.05, max_timeout), rng.randrange(6)) for ids in prompts]

    def one(plan):
        ids, stream, timeout, cut = plan
        c = openai.OpenAI(base_url=url + "/v1", api_key=API_KEY, max_retries=0, timeout=timeout)
        try:
            if stream:
                s = c.completions.create(model=MODEL, prompt=ids, max_tokens=300, stream=True,
                                         extra_body={"ignore_eos": True})
                for n, _ in enumerate(s):
                    if n == cut:
                        break
                s.close()
            else:
                c.completions.create(model=MODEL, prompt=ids, max_tokens=300, extra_body={"ignore_eos": True})
        except (openai.APITimeoutError, openai.APIConnectionError):
            pass

    with ThreadPoolExecutor(8) as pool:
        list(pool.map(one, plans))


def http(method: str, url: str, body=None, headers=None, timeout=30) -> tuple[int, "email.message.Message", bytes]:
    """Raw HTTP: body is bytes (sent as is) or JSON-able; returns (status, headers, body bytes)."""
    data = body if isinstance(body, bytes) or body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method,
                                 headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.headers, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.headers, e.read()


class RaisesOnToken(nn.Module):
    """The tiny DeepSeek-V4, except that a forward whose inputs hold `token` raises (a fault inside the step)."""

    def __init__(self, model, token: int):
        super().__init__()
        self.model, self.token, self.args = model, token, model.args

    def engine_contract(self):
        return self.model.engine_contract()

    def forward(self, batch):
        if bool((batch.input_ids == self.token).any()):
            raise RuntimeError(f"the forward met token {self.token}")
        return self.model(batch)

    def cache_specs(self, block_size):
        return self.model.cache_specs(block_size)

    def cache_tensor_specs(self):
        return self.model.cache_tensor_specs()

    def bind_caches(self, tensors, tables=None):
        self.model.bind_caches(tensors, tables)

    def embed_tokens(self, input_ids, uniform=False):
        return self.model.embed_tokens(input_ids, uniform)

    def compute_logits(self, hidden, uniform=False):
        return self.model.compute_logits(hidden, uniform)
