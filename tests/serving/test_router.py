"""The data-parallel router under real uvicorn, in front of two small stand-in OpenAI servers (also real uvicorn).

The stand-ins speak just enough of /v1/completions, /v1/chat/completions and /v1/responses (JSON and SSE, a store
of responses behind GET / DELETE /v1/responses/{id}) to show where a request went, how its stream arrived, and
whether its generator was cancelled when the client went away. The real server behind the router:
test_responses_store.py, test_pd.py.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import threading
import time

import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from common.serving.router import build_router
from ports import free_port

try:
    import httpx2 as httpx
except ImportError:  # pragma: no cover
    import httpx

KEY = "Bearer sk-test"



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

    app.state.responses, app.state.seen = {}, []

    @app.post("/v1/responses")
    async def responses(request: Request):
        body = await request.json()
        previous = body.get("previous_response_id")
        if previous is not None and previous not in app.state.responses:
            return JSONResponse({"error": {"message": f"{previous} not found", "type": "invalid_request_error",
                                           "param": "previous_response_id", "code": 404}}, status_code=404)
        r = {"id": f"resp_{name}_{len(app.state.seen)}", "object": "response", "model": name,
             "store": body.get("store", True), "previous_response_id": previous, "output": []}
        app.state.seen.append(r["id"])
        if r["store"]:
            app.state.responses[r["id"]] = r
        if not body.get("stream"):
            await asyncio.sleep(body.get("delay", 0.0))
            return r

        async def events():
            yield f"event: response.created\ndata: {json.dumps({'type': 'response.created', 'response': r})}\n\n"
            for i in range(body.get("n", 2)):
                await asyncio.sleep(body.get("delay", 0.0))
                yield f"event: response.output_text.delta\ndata: {json.dumps({'delta': f't{i}'})}\n\n"
            yield f"event: response.completed\ndata: {json.dumps({'type': 'response.completed', 'response': r})}\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    @app.get("/v1/responses/{response_id}")
    async def retrieve(response_id: str, request: Request):
        if response_id not in app.state.responses:
            return JSONResponse({"error": {"message": "not found", "type": "invalid_request_error",
                                           "param": "response_id", "code": 404}}, status_code=404)
        return {**app.state.responses[response_id], "query": str(request.url.query)}

    @app.delete("/v1/responses/{response_id}")
    async def delete(response_id: str):
        app.state.responses.pop(response_id)
        return {"id": response_id, "object": "response", "deleted": True}

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


def created_response(stream) -> dict:
    """The response of a relayed stream's first event (response.created)."""
    first = stream.read().decode().split("\n\n")[0]
    return json.loads(first.split("\n")[1].removeprefix("data: "))["response"]


def test_responses_pass_through_whole_and_streamed(cluster):
    a, b, router, client = cluster
    r = client.post("/v1/responses", json={"input": "hi", "store": False})
    assert r.status_code == 200 and r.json()["object"] == "response" and r.json()["store"] is False
    with client.stream("POST", "/v1/responses", json={"input": "hi", "stream": True, "n": 3}) as s:
        frames = [f for f in s.read().decode().split("\n\n") if f]
    assert s.headers["content-type"].startswith("text/event-stream")
    assert [f.split("\n")[0] for f in frames] == ["event: response.created"] + \
        ["event: response.output_text.delta"] * 3 + ["event: response.completed"]
    created = json.loads(frames[0].split("\n")[1].removeprefix("data: "))["response"]
    assert created["id"] in router.app.state.router.owners  # remembered: store defaults to true
    home = a if created["model"] == "a" else b
    r = client.get(f"/v1/responses/{created['id']}?include=x&stream=false")  # method, path and query as sent
    assert r.status_code == 200 and r.json()["query"] == "include=x&stream=false"
    assert r.json()["model"] == home.app.state.name
    assert client.get("/v1/nothing-here").status_code == 404  # the instance's own answer


def test_a_continuation_goes_to_the_instance_that_stores_its_id(cluster):
    a, b, router, client = cluster
    by_model = {"a": a, "b": b}
    first = client.post("/v1/responses", json={"input": "hi"}).json()  # whole: the id read from the body
    with client.stream("POST", "/v1/responses", json={"input": "hi", "stream": True}) as s:
        streamed = created_response(s)  # streamed: the id read from response.created
    for r in (first, streamed):  # however the round robin stands (one busy stream on each instance: a tie)
        home, other = by_model[r["model"]], by_model[{"a": "b", "b": "a"}[r["model"]]]
        with contextlib.ExitStack() as busy:
            lines = []  # kept: a dropped iterator closes its stream
            for _ in range(2):
                lines.append(busy.enter_context(client.stream("POST", "/v1/responses", json={
                    "input": "x", "stream": True, "n": 50, "delay": 0.05, "store": False})).iter_lines())
                next(lines[-1])
            assert {u["outstanding"] for u in stats(client).values()} == {1}
            for _ in range(3):
                got = client.post("/v1/responses", json={"input": "more", "previous_response_id": r["id"]})
                assert got.status_code == 200 and got.json()["model"] == r["model"], got.json()
            assert client.get(f"/v1/responses/{r['id']}").json()["model"] == r["model"]
        assert r["id"] in home.app.state.responses and r["id"] not in other.app.state.responses

    # a router that never saw the id (a restart) asks every instance
    fresh = Server(build_router([a.url, b.url], health_interval=0.2, health_timeout=0.5)).start()
    try:
        with httpx.Client(base_url=fresh.url, headers={"authorization": KEY}, timeout=10) as c2:
            for _ in range(2):
                got = c2.post("/v1/responses", json={"input": "more", "previous_response_id": first["id"]})
                assert got.json()["model"] == first["model"]
            r = c2.post("/v1/responses", json={"input": "more", "previous_response_id": "resp_nowhere"})
            assert r.status_code == 404 and r.json()["error"]["param"] == "previous_response_id"
            assert c2.delete(f"/v1/responses/{first['id']}").json()["deleted"] is True
            assert first["id"] not in fresh.app.state.router.owners
            assert c2.get(f"/v1/responses/{first['id']}").status_code == 404
    finally:
        fresh.stop()

    # its instance down: 503 (its store went with it), not another instance's 404
    home = by_model[streamed["model"]]
    home.stop()
    r = client.post("/v1/responses", json={"input": "more", "previous_response_id": streamed["id"]})
    assert r.status_code == 503 and "Retry-After" in r.headers and home.url in r.json()["error"]["message"]
    assert client.post("/v1/responses", json={"input": "new"}).status_code == 200  # the other one serves the rest
