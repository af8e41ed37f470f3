"""The data-parallel router under real uvicorn, in front of two small stand-in OpenAI servers (also real uvicorn).

The stand-ins speak just enough of /v1/completions and /v1/chat/completions (JSON and SSE) to show where a
request went, how its stream arrived, and whether its generator was cancelled when the client went away.
"""
from __future__ import annotations

import asyncio
import json
import socket
import threading
import time

import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from common.serving.router import build_router

try:
    import httpx2 as httpx
except ImportError:  # pragma: no cover
    import httpx

KEY = "Bearer sk-test"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """uvicorn on 127.0.0.1 in a thread; stop() is a kill as far as clients can tell (the port closes)."""

    def __init__(self, app, port: int | None = None):
        self.app, self.port = app, port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"

    def start(self) -> "Server":
        config = uvicorn.Config(self.app, host="127.0.0.1", port=self.port, log_level="warning",
                                timeout_graceful_shutdown=0.5, lifespan="on")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 10
        while not self.server.started:
            assert self.thread.is_alive() and time.monotonic() < deadline, f"{self.url} did not start"
            time.sleep(0.01)
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=5)


def stand_in(name: str) -> FastAPI:
    """A minimal OpenAI server: answers carry `name`; body extras `delay` (s per chunk) and `fail` (status)."""
    app = FastAPI()
    app.state.name, app.state.finished, app.state.cancelled = name, [], []

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": "stand-in", "object": "model", "owned_by": name}]}

    async def complete(request: Request, chat: bool):
        if request.headers.get("authorization") != KEY:
            return JSONResponse({"error": {"message": "bad key", "type": "invalid_request_error", "param": None,
                                           "code": "invalid_api_key"}}, status_code=401)
        body = await request.json()
        if body.get("fail"):
            return JSONResponse({"error": {"message": "bad request", "type": "invalid_request_error",
                                           "param": "fail", "code": None}}, status_code=body["fail"])
        n, delay, rid = body.get("max_tokens", 4), body.get("delay", 0.0), body.get("user", "r")
        text = lambda i: {"delta": {"content": f"t{i}"}} if chat else {"text": f"t{i}"}  # noqa: E731
        if not body.get("stream"):
            await asyncio.sleep(delay)
            return {"id": rid, "object": "chat.completion" if chat else "text_completion", "model": name,
                    "choices": [{"index": 0, "finish_reason": "length",
                                 **({"message": {"role": "assistant", "content": "x" * n}} if chat else {"text": "x" * n})}],
                    "usage": {"prompt_tokens": 1, "completion_tokens": n, "total_tokens": n + 1}}

        async def events():
            done = False
            try:
                for i in range(n):
                    chunk = {"id": rid, "model": name, "choices": [{"index": 0, **text(i), "finish_reason": None}]}
                    yield f"data: {json.dumps(chunk)}\n\n"
                    await asyncio.sleep(delay)
                yield "data: [DONE]\n\n"
                done = True
            finally:
                (app.state.finished if done else app.state.cancelled).append(rid)

        return StreamingResponse(events(), media_type="text/event-stream")

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await complete(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await complete(request, chat=True)

    return app


@pytest.fixture
def cluster():
    a, b = Server(stand_in("a")).start(), Server(stand_in("b")).start()
    router = Server(build_router([a.url, b.url], health_interval=0.2, health_timeout=0.5)).start()
    client = httpx.Client(base_url=router.url, headers={"authorization": KEY}, timeout=10)
    yield a, b, router, client
    client.close()
    for s in (router, a, b):
        if s.thread.is_alive():
            s.stop()


def stats(client) -> dict:
    return {u["url"]: u for u in client.get("/router/stats").json()["upstreams"]}


def wait_for(cond, timeout=5.0):
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out waiting"
        time.sleep(0.02)


def served_by(r) -> str:
    return r.json()["model"]


def test_ties_round_robin_and_least_outstanding(cluster):
    a, b, router, client = cluster
    body = {"model": "m", "prompt": [1, 2, 3], "max_tokens": 2}
    assert sorted(served_by(client.post("/v1/completions", json=body)) for _ in range(4)) == ["a", "a", "b", "b"]

    with client.stream("POST", "/v1/completions", json={**body, "stream": True, "max_tokens": 50, "delay": 0.05}) as slow:
        lines = slow.iter_lines()  # keep it: a dropped iterator closes the response
        busy = json.loads(next(lines).removeprefix("data: "))["model"]
        other = {"a": "b", "b": "a"}[busy]
        busy_url = (a if busy == "a" else b).url
        assert stats(client)[busy_url]["outstanding"] == 1
        for _ in range(3):  # the other instance is idle, so it takes every request
            assert served_by(client.post("/v1/chat/completions", json={**body, "messages": []})) == other
    wait_for(lambda: stats(client)[busy_url]["outstanding"] == 0)
    assert sum(u["served"] for u in stats(client).values()) == 4 + 3 + 1


def test_stream_passes_through_chunk_by_chunk(cluster):
    a, b, router, client = cluster
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True, "max_tokens": 5,
            "delay": 0.1}
    arrivals, lines = [], []
    with client.stream("POST", "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if line:
                arrivals.append(time.monotonic())
                lines.append(line)
    assert lines[-1] == "data: [DONE]"
    assert [json.loads(x[6:])["choices"][0]["delta"]["content"] for x in lines[:-1]] == [f"t{i}" for i in range(5)]
    gaps = [t1 - t0 for t0, t1 in zip(arrivals, arrivals[1:])]
    assert min(gaps) > 0.05, f"chunks were buffered: {gaps}"  # each arrives as the instance sends it


def test_errors_pass_through(cluster):
    a, b, router, client = cluster
    r = client.post("/v1/completions", json={"model": "m", "prompt": "x", "fail": 400})
    assert r.status_code == 400 and r.json()["error"]["param"] == "fail"
    r = client.post("/v1/completions", json={"model": "m", "prompt": "x"}, headers={"authorization": "Bearer no"})
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    r = client.post("/v1/completions", json={"model": "m", "prompt": "x", "fail": 503})
    assert r.status_code == 503 and r.json()["error"]["message"] == "bad request"
    assert client.get("/v1/models").json()["data"][0]["id"] == "stand-in"


def test_instance_down_then_back(cluster):
    a, b, router, client = cluster
    a.stop()
    body = {"model": "m", "prompt": [5], "max_tokens": 1}
    # before any health poll notices, a refused connection is retried on the other instance
    assert all(served_by(client.post("/v1/completions", json=body)) == "b" for _ in range(4))
    assert not stats(client)[a.url]["up"] and stats(client)[b.url]["up"]
    assert client.get("/health").status_code == 200

    a = Server(stand_in("a"), port=a.port).start()
    wait_for(lambda: stats(client)[a.url]["up"])
    assert {served_by(client.post("/v1/completions", json=body)) for _ in range(4)} == {"a", "b"}
    a.stop()


def test_all_down_503(cluster):
    a, b, router, client = cluster
    a.stop(), b.stop()
    r = client.post("/v1/completions", json={"model": "m", "prompt": "x"})
    assert r.status_code == 503 and "Retry-After" in r.headers
    assert set(r.json()["error"]) == {"message", "type", "param", "code"}
    wait_for(lambda: client.get("/health").status_code == 503)
    assert client.get("/health").json()["error"]["code"] == 503
    assert client.get("/v1/models").status_code == 503
    assert not any(u["up"] for u in stats(client).values())


def test_client_disconnect_closes_upstream_stream(cluster):
    a, b, router, client = cluster
    body = {"model": "m", "prompt": [1], "stream": True, "max_tokens": 100, "delay": 0.05, "user": "gone"}
    with client.stream("POST", "/v1/completions", json=body) as r:
        lines = r.iter_lines()
        busy = json.loads(next(lines)[6:])["model"]
    upstream = (a if busy == "a" else b).app.state
    wait_for(lambda: "gone" in upstream.cancelled, timeout=3)
    assert "gone" not in upstream.finished
    wait_for(lambda: all(u["outstanding"] == 0 for u in stats(client).values()))


def test_client_gone_before_the_answer_cancels_the_upstream_request(cluster):
    """A whole response the client stops waiting for: the router drops its upstream request at once (the instance
    sees the disconnect and aborts), it does not wait out the answer."""
    a, b, router, client = cluster
    with pytest.raises(httpx.ReadTimeout):
        client.post("/v1/completions", json={"model": "m", "prompt": [1], "delay": 5.0}, timeout=0.3)
    wait_for(lambda: all(u["outstanding"] == 0 for u in stats(client).values()), timeout=3)  # before its 5 s
