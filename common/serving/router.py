"""Data-parallel router: one OpenAI-compatible endpoint in front of N server instances.

    python -m common.serving.router --upstream http://127.0.0.1:8001 --upstream http://127.0.0.1:8002 \
        [--host 127.0.0.1] [--port 8000] [--health-interval 1.0]

Every request under /v1 (GET, POST, DELETE: `/v1/completions`, `/v1/chat/completions`, `/v1/responses`,
`/v1/responses/{id}`, `/v1/models`, whatever the instances serve there) goes, method, path, query, body and
Authorization header as they are, to the live instance with the fewest outstanding requests (ties: round robin).
Streaming answers (SSE) are relayed chunk by chunk as they arrive; other answers pass through with their status code
and body (400, 401, 404, 503 from an instance included). An instance that refuses the connection or times out is
marked down and the request is tried once more on another one; a background task polls every instance's `/health`
each health_interval seconds and marks it down (no answer, 5xx) or up (answers). A client that goes away mid-stream
closes the upstream stream, so the instance aborts the request and frees its KV blocks; one that goes away before the
answer starts (a whole response, or a stream before its first byte) cancels the upstream request the same way.

Stored responses live on the instance that made them, so a request that names one -- `previous_response_id` in a
`POST /v1/responses`, or `GET` / `DELETE /v1/responses/{id}` -- goes to that instance whatever its load: the router
remembers the instance of each stored response it relayed (read from the answer, or from a stream's
response.created event; the last max_response_owners ids), and asks every live instance (`GET /v1/responses/{id}`)
for an id it does not know (one relayed before a router restart). An id no instance holds goes to any instance, which
answers its 404; an id whose instance is down gets 503 (the store is in that instance's memory).

`GET /health` is 200 while one instance is up, and `GET /router/stats` lists url, up, outstanding and served per
instance (the router's own routes; an instance's /metrics is read from the instance). With no instance up, requests
get 503 with an OpenAI-style error body and Retry-After.

PD disaggregation (`--prefill URL`, repeated; the --upstream instances are then the decode instances): each
generation request (completions, chat, responses) is paired with the live prefill instance with the fewest
outstanding requests and the live decode instance likewise (for a continuation, the one that stores
previous_response_id), and goes to the decode instance with the prefill instance's URL in `X-PD-Prefill`; the decode
instance has it prefilled there and streams its answer, relayed as above. Other requests go to a decode instance
alone. With no live prefill or no live decode instance requests get 503.
`python -m common.serving.router --prefill http://P:8001 --upstream http://D:8002`.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import math
from collections import OrderedDict
from dataclasses import asdict, dataclass
from urllib.parse import quote

import anyio
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from .pd_protocol import PREFILL_HEADER
from .http_utils import run_unless_disconnected

try:
    import httpx2 as httpx  # what openai 3.x installs
except ImportError:  # pragma: no cover
    import httpx

log = logging.getLogger("router")

FORWARD_REQUEST_HEADERS = ("authorization", "content-type", "accept", "x-request-id")
FORWARD_RESPONSE_HEADERS = ("content-type", "retry-after", "x-request-id", "cache-control")
UNREACHABLE = (httpx.ConnectError, httpx.ConnectTimeout, httpx.PoolTimeout)
GENERATION_PATHS = ("/v1/completions", "/v1/chat/completions", "/v1/responses")  # PD pairs these with a prefill
RESPONSES, STORED_RESPONSE = "/v1/responses", "/v1/responses/"


@dataclass(eq=False)  # identity: the same URL twice is two instances
class Upstream:
    url: str
    up: bool = True
    outstanding: int = 0
    served: int = 0


def error_body(message: str, type_: str = "service_unavailable", code: int | str | None = 503) -> dict:
    return {"error": {"message": message, "type": type_, "param": None, "code": code}}


def referenced_response(method: str, path: str, body: bytes) -> str | None:
    """The id of the stored response a request needs: /v1/responses/{id}[/...], or a new response's
    previous_response_id (a body the router cannot read names none: the instance answers its 400)."""
    if path.startswith(STORED_RESPONSE):
        return path[len(STORED_RESPONSE):].split("/")[0] or None
    if method != "POST" or path != RESPONSES or b"previous_response_id" not in body:
        return None
    try:
        previous = json.loads(body).get("previous_response_id")
    except (ValueError, AttributeError):
        return None
    return previous if isinstance(previous, str) and previous else None


class Router:
    """The instances, their state, and the choice of one for the next request."""

    def __init__(self, urls: list[str], health_interval: float = 1.0, health_timeout: float = 2.0,
                 connect_timeout: float = 5.0, prefill_urls: list[str] = (), max_response_owners: int = 1 << 16):
        assert urls, "at least one upstream"
        self.upstreams = [Upstream(u.rstrip("/")) for u in urls]
        self.prefills = [Upstream(u.rstrip("/")) for u in prefill_urls]  # PD: the upstreams decode
        self.owners: OrderedDict[str, Upstream] = OrderedDict()  # stored response id -> its instance
        self.max_response_owners = max_response_owners
        self.health_interval, self.health_timeout = health_interval, health_timeout
        self.retry_after = str(max(1, math.ceil(health_interval)))
        self._rr = 0
        self.client = httpx.AsyncClient(
            timeout=httpx.Timeout(connect=connect_timeout, read=None, write=60.0, pool=connect_timeout),
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=256))

    def pick(self, exclude: tuple[Upstream, ...] = (), pool: list[Upstream] | None = None) -> Upstream | None:
        pool = self.upstreams if pool is None else pool
        live = [u for u in pool if u.up and u not in exclude]
        if not live:
            return None
        fewest = min(u.outstanding for u in live)
        n = len(pool)
        for k in range(n):
            i = (self._rr + k) % n
            u = pool[i]
            if u in live and u.outstanding == fewest:
                self._rr = (i + 1) % n
                return u

    def mark(self, u: Upstream, up: bool, why: str = "") -> None:
        if u.up != up:
            log.warning("upstream %s is %s%s", u.url, "up" if up else "down", f" ({why})" if why else "")
        u.up = up

    async def check(self, u: Upstream) -> None:
        try:
            r = await self.client.get(u.url + "/health", timeout=self.health_timeout)
            self.mark(u, r.status_code < 500, f"/health {r.status_code}")
        except httpx.HTTPError as e:
            self.mark(u, False, type(e).__name__)

    async def poll_health(self) -> None:
        while True:
            await asyncio.gather(*(self.check(u) for u in self.upstreams + self.prefills))
            await asyncio.sleep(self.health_interval)

    @property
    def available(self) -> bool:
        return any(u.up for u in self.upstreams) and (not self.prefills or any(u.up for u in self.prefills))

    def unavailable(self, what: str = "upstream", message: str | None = None) -> JSONResponse:
        return JSONResponse(error_body(message or f"no {what} instance is available; retry later"), status_code=503,
                            headers={"Retry-After": self.retry_after})

    def remember(self, response: object, u: Upstream) -> None:
        """A relayed response object that was stored: its id is u's (the oldest id forgotten past
        max_response_owners: owner() finds it again)."""
        if isinstance(response, dict) and response.get("store") is True and isinstance(response.get("id"), str):
            self.own(response["id"], u)

    def own(self, response_id: str, u: Upstream) -> None:
        self.owners[response_id] = u
        self.owners.move_to_end(response_id)
        while len(self.owners) > self.max_response_owners:
            self.owners.popitem(last=False)

    async def owner(self, response_id: str, headers: dict) -> Upstream | None:
        """The instance that stores response_id: remembered, else the live instance that answers its
        GET /v1/responses/{id} with 200; None when no instance does."""
        if (u := self.owners.get(response_id)) is not None:
            self.owners.move_to_end(response_id)
            return u
        auth = {k: v for k, v in headers.items() if k == "authorization"}

        async def holds(u: Upstream) -> bool:
            try:
                r = await self.client.get(f"{u.url}{STORED_RESPONSE}{quote(response_id, safe='')}", headers=auth,
                                          timeout=self.health_timeout)
            except httpx.HTTPError:
                return False
            return r.status_code == 200

        live = [u for u in self.upstreams if u.up]
        for u, found in zip(live, await asyncio.gather(*(holds(u) for u in live))):
            if found:
                self.own(response_id, u)
                return u
        return None

    async def forward(self, request: Request) -> Response:
        """A /v1 request to an instance: the one that stores the response it names, else the least loaded (PD: with a
        prefill instance for a generation request)."""
        method, path = request.method, request.url.path
        target = request.scope.get("raw_path", path.encode()).decode("latin-1")  # the path as the client encoded it
        if request.url.query:
            target += "?" + request.url.query
        body = await request.body()
        headers = {k: v for k, v in request.headers.items() if k in FORWARD_REQUEST_HEADERS}
        headers["accept-encoding"] = "identity"  # relay raw bytes as they are
        owner = None
        if (response_id := referenced_response(method, path, body)) is not None:
            owner = await self.owner(response_id, headers)
            if owner is not None and not owner.up:
                return self.unavailable(message=f"the instance that stores response {response_id!r} ({owner.url}) "
                                                "is down; retry later")
        prefill = None
        if self.prefills and method == "POST" and path in GENERATION_PATHS:  # PD: the decode instance has it prefilled
            prefill = self.pick(pool=self.prefills)
            if prefill is None:
                return self.unavailable("prefill")
            headers[PREFILL_HEADER] = prefill.url
            prefill.outstanding += 1
        learn = method == "POST" and path == RESPONSES
        try:  # a client gone before the answer starts cancels the upstream request (the instance then aborts it)
            finished, response = await run_unless_disconnected(
                request, self._forward(method, target, body, headers, prefill, owner, learn))
        except BaseException:
            if prefill is not None:
                prefill.outstanding -= 1
            raise
        if not finished:
            if prefill is not None:
                prefill.outstanding -= 1
            return Response(status_code=499)  # nobody is listening
        if method == "DELETE" and response_id is not None and response.status_code == 200:
            self.owners.pop(response_id, None)
        return response

    async def _forward(self, method: str, target: str, body: bytes, headers: dict, prefill: Upstream | None,
                       owner: Upstream | None, learn: bool) -> Response:
        """To `owner` (once), else to the least loaded instance, then once more elsewhere if it cannot be reached.
        learn: remember the instance of the response this answer stores."""
        tried: tuple[Upstream, ...] = ()
        for _ in range(1 if owner is not None else 2):
            u = owner if owner is not None else self.pick(tried)
            if u is None:
                break
            tried += (u,)
            u.outstanding += 1
            try:
                upstream = await self.client.send(self.client.build_request(method, u.url + target, content=body,
                                                                            headers=headers), stream=True)
            except (*UNREACHABLE, httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError) as e:
                u.outstanding -= 1
                self.mark(u, False, type(e).__name__)
                continue
            except BaseException:
                u.outstanding -= 1
                raise
            return await self.relay(u, upstream, prefill, learn)
        if prefill is not None:
            prefill.outstanding -= 1
        if owner is not None:
            return self.unavailable(message=f"the instance that stores the response ({owner.url}) cannot be reached; "
                                            "retry later")
        return self.unavailable("decode" if prefill is not None else "upstream")

    async def relay(self, u: Upstream, upstream: httpx.Response, prefill: Upstream | None = None,
                    learn: bool = False) -> Response:
        def release():
            for x in (u, prefill) if prefill is not None else (u,):
                x.outstanding -= 1
                x.served += 1

        headers = {k: v for k, v in upstream.headers.items() if k in FORWARD_RESPONSE_HEADERS}
        if not upstream.headers.get("content-type", "").startswith("text/event-stream"):
            try:
                content = await upstream.aread()
            except httpx.TransportError as e:
                self.mark(u, False, type(e).__name__)
                return JSONResponse(error_body(f"upstream {u.url} failed: {type(e).__name__}", "upstream_error", 502),
                                    status_code=502)
            finally:
                await upstream.aclose()
                release()
            if learn and upstream.status_code == 200:
                with contextlib.suppress(ValueError):
                    self.remember(json.loads(content), u)
            return Response(content, status_code=upstream.status_code, headers=headers)
        watch = FirstEvent(lambda event: self.remember(event.get("response"), u)) if learn else None
        return Relay(upstream, headers, release, watch)


class FirstEvent:
    """The first event of a relayed SSE stream (a response stream's response.created, which holds the response's id
    and store), handed to on_event as it passes; looked for in the first LIMIT bytes only."""
    LIMIT = 1 << 20

    def __init__(self, on_event):
        self.on_event, self.head, self.done = on_event, b"", False

    def feed(self, chunk: bytes) -> None:
        if self.done:
            return
        self.head += chunk
        end = self.head.find(b"\n\n")
        if end < 0:
            self.done = len(self.head) > self.LIMIT
            return
        self.done = True
        for line in self.head[:end].split(b"\n"):
            if line.startswith(b"data:"):
                with contextlib.suppress(ValueError):
                    event = json.loads(line[5:])
                    if isinstance(event, dict):
                        self.on_event(event)
        self.head = b""


class Relay(Response):
    """Relays an upstream SSE stream chunk by chunk; closes it when the client goes away. watch: sees each chunk
    before the client does."""

    def __init__(self, upstream: httpx.Response, headers: dict, on_close, watch: FirstEvent | None = None):
        self.status_code, self.background = upstream.status_code, None
        self.init_headers(headers)  # no body, so no Content-Length: chunked transfer
        self.upstream, self.on_close, self.watch = upstream, on_close, watch

    async def __call__(self, scope, receive, send) -> None:
        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(self._stream, send, tg.cancel_scope)
                while (await receive())["type"] != "http.disconnect":
                    pass
                tg.cancel_scope.cancel()
        finally:
            with anyio.CancelScope(shield=True):
                await self.upstream.aclose()  # closes the connection, the instance sees the disconnect
            self.on_close()

    async def _stream(self, send, scope: anyio.CancelScope) -> None:
        try:
            await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
            try:
                async for chunk in self.upstream.aiter_raw():
                    if self.watch is not None:
                        self.watch.feed(chunk)
                    await send({"type": "http.response.body", "body": chunk, "more_body": True})
            except httpx.TransportError as e:  # the instance died mid-stream: end the client's stream too
                log.warning("upstream stream broke: %s", type(e).__name__)
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        except OSError:  # client gone
            pass
        scope.cancel()


def build_router(upstreams: list[str], health_interval: float = 1.0, **kwargs) -> FastAPI:
    router = Router(upstreams, health_interval, **kwargs)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        await asyncio.gather(*(router.check(u) for u in router.upstreams + router.prefills))
        task = asyncio.create_task(router.poll_health())
        yield
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        await router.client.aclose()

    app = FastAPI(title="npu-cookbook router", lifespan=lifespan)
    app.state.router = router

    @app.api_route("/v1/{rest:path}", methods=["GET", "POST", "DELETE"])
    async def forward(request: Request):
        return await router.forward(request)

    @app.get("/health")
    async def health():
        if router.available:
            return {"status": "ok", "upstreams_up": sum(u.up for u in router.upstreams),
                    "prefills_up": sum(u.up for u in router.prefills)}
        return router.unavailable()

    @app.get("/router/stats")
    async def stats():
        return {"upstreams": [asdict(u) for u in router.upstreams], "prefills": [asdict(u) for u in router.prefills]}

    return app


def main(argv=None) -> None:
    import uvicorn

    p = argparse.ArgumentParser(prog="python -m common.serving.router", description=__doc__.splitlines()[0])
    p.add_argument("--upstream", action="append", required=True, help="an instance's base URL (repeat per instance)")
    p.add_argument("--prefill", action="append", default=[],
                   help="PD: a prefill instance's base URL (repeat); the --upstream instances are then decode instances")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--health-interval", type=float, default=1.0, help="seconds between /health polls")
    p.add_argument("--log-level", default="info")
    a = p.parse_args(argv)
    logging.basicConfig(level=a.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    logging.getLogger(httpx.__name__).setLevel(logging.WARNING)  # not a line per health poll
    uvicorn.run(build_router(a.upstream, a.health_interval, prefill_urls=a.prefill), host=a.host, port=a.port,
                log_level=a.log_level)


if __name__ == "__main__":
    main()
