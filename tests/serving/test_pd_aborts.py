"""PD aborts at points random aborts only sometimes reach, made deterministic. A gate on the prefill instance's
transport (the real Mooncake engine; while the gate is shut a write waits at it before moving its bytes) holds a room
aborted after P prefilled it but before its send started (it waits behind another room's send), and a send
interrupted by an abort (its first write blocked until P has taken the abort); D must keep the blocks until P says no
write can land in them. A decode instance whose event loop is held meets an abort queued right behind its
/pd/prefill call. Both pools end full and the other requests answer as a colocated server does."""
from http.client import HTTPConnection
import json
import threading
import time
import urllib.parse
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from openai import OpenAI
from transformers import AutoTokenizer

from common.kv_transfer import DecodeConnector, MooncakeTransport, PrefillConnector
from common.serving.router import build_router
from weights_deepseek_v4 import load_model

from serving_harness import API_KEY, MODEL, http, own_model, running_server, serve_app, wait_until

ENGINE = dict(max_num_seqs=8, max_num_batched_tokens=64, block_size=16)
HELD_S = 1.0  # how long D is watched for releasing blocks P could still write


class GatedTransport(MooncakeTransport):
    """Mooncake's TCP transport whose writes wait while the gate is shut (`entered` says one is waiting)."""

    def __init__(self):
        super().__init__()
        self.gate, self.entered = threading.Event(), threading.Event()
        self.gate.set()

    def write(self, peer, src, dst, lengths):
        if not self.gate.is_set():
            self.entered.set()
            assert self.gate.wait(timeout=60), "the test never opened the gate"
        super().write(peer, src, dst, lengths)


@pytest.fixture(scope="module")
def pd(checkpoint):
    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    transport = GatedTransport()
    prefill = PrefillConnector(transport, writes_per_batch=1)  # an abort can stop a send after any write
    with running_server(load_model(checkpoint, torch.float32), tokenizer, kv_connector=prefill, **ENGINE) as (p_url, p):
        decode = DecodeConnector(MooncakeTransport(), [p_url], transfer_timeout=60, api_key=API_KEY)
        with running_server(load_model(checkpoint, torch.float32), tokenizer, kv_connector=decode,
                            **ENGINE) as (d_url, d):
            with serve_app(build_router([d_url], 0.2, prefill_urls=[p_url])) as (url, _):
                yield {"url": url, "p": p, "d": d, "p_url": p_url, "prefill": prefill, "transport": transport,
                       "tokenizer": tokenizer}


@pytest.fixture(scope="module")
def colocated(loaded_model):
    with running_server(*own_model(loaded_model), **ENGINE) as (url, _):
        yield OpenAI(base_url=url + "/v1", api_key=API_KEY, max_retries=0, timeout=60)


@pytest.fixture
def gate(pd):
    """Shut for the test; open again after it, whatever happened."""
    transport = pd["transport"]
    transport.gate.clear()
    transport.entered.clear()
    yield transport
    transport.gate.set()


def pools_full(*engines) -> bool:
    return all(e.kv_cache.all_blocks_free() and not e.scheduler.requests and not e.scheduler.sending for e in engines)


def ids(n: int, k: int = 0) -> list[int]:
    return [(7 * i + 3 * n + k) % 500 + 2 for i in range(n)]


def open_request(url: str, prompt: list[int], headers=None) -> HTTPConnection:
    """A streamed completion sent (through the router) and not read: closing the connection is the client leaving."""
    u = urllib.parse.urlsplit(url)
    conn = HTTPConnection(u.hostname, u.port, timeout=60)
    conn.request("POST", "/v1/completions", json.dumps({"model": MODEL, "prompt": prompt, "max_tokens": 50,
                                                        "stream": True, "ignore_eos": True}),
                 {"Content-Type": "application/json", "Authorization": f"Bearer {API_KEY}", **(headers or {})})
    return conn


def aborted_at_p(prefill: PrefillConnector, room: str) -> bool:
    """P has the room's /pd/abort and has applied the abort on its engine thread."""
    return room in prefill.tombstones and room in prefill.aborted


def d_holds(d, room: str) -> bool:
    return room in d.scheduler.receiving and d.kv_cache.block_table(room)


def complete(pd, client, prompt):
    kw = dict(model=MODEL, prompt=prompt, max_tokens=8, temperature=0, extra_body={"ignore_eos": True})
    got = OpenAI(base_url=pd["url"] + "/v1", api_key=API_KEY, max_retries=0, timeout=60).completions.create(**kw)
    return got.choices[0].text, client.completions.create(**kw).choices[0].text


def test_a_room_aborted_before_its_send_starts(pd, colocated, gate):
    """Room A's first write waits at the gate; room B is prefilled meanwhile and its send queues behind A's; B's
    client leaves. D keeps B's blocks until P answers B's abort, which it can only do once B's send has passed the
    point where it would start; B then writes nothing, A answers as colocated, and both pools end full."""
    p, d, prefill = pd["p"], pd["d"], pd["prefill"]
    stats = dict(vars(prefill.stats))
    pool = ThreadPoolExecutor(1)
    try:
        a_answer = pool.submit(complete, pd, colocated, ids(40))
        assert gate.entered.wait(30)
        (a,) = prefill.sending
        b_client = open_request(pd["url"], ids(50, 1))
        assert wait_until(lambda: len(prefill.sending) == 2, timeout=30)  # B prefilled, its send queued behind A's
        (b,) = prefill.sending - {a}
        assert d_holds(d, b)
        b_client.close()
        assert wait_until(lambda: aborted_at_p(prefill, b), timeout=30)
        assert not wait_until(lambda: not d_holds(d, b), timeout=HELD_S), "D released blocks P could still write"
    finally:
        gate.gate.set()
        pool.shutdown()
    got, ref = a_answer.result(timeout=60)
    assert got == ref
    assert wait_until(lambda: pools_full(p, d), timeout=30), (p.kv_cache.usage(), d.kv_cache.usage())
    assert prefill.stats.num_transfers == stats["num_transfers"] + 1  # A's
    assert prefill.stats.num_aborted == stats["num_aborted"] + 1  # B's, before any of its writes
    got, ref = complete(pd, colocated, ids(33, 2))
    assert got == ref


def test_a_send_interrupted_by_an_abort(pd, colocated, gate):
    """A room's first write waits at the gate; its client leaves; once P has taken the abort the gate opens. D keeps
    the blocks until P's write returned and P stopped the send before its next write; both pools end full."""
    p, d, prefill = pd["p"], pd["d"], pd["prefill"]
    stats = dict(vars(prefill.stats))
    client = open_request(pd["url"], ids(60, 3))
    assert gate.entered.wait(30)
    (room,) = prefill.sending
    assert d_holds(d, room)
    client.close()
    assert wait_until(lambda: aborted_at_p(prefill, room), timeout=30)
    assert not wait_until(lambda: not d_holds(d, room), timeout=HELD_S), "D released blocks P is writing"
    gate.gate.set()
    assert wait_until(lambda: pools_full(p, d), timeout=30), (p.kv_cache.usage(), d.kv_cache.usage())
    assert prefill.stats.num_aborted == stats["num_aborted"] + 1
    assert prefill.stats.num_transfers == stats["num_transfers"]
    got, ref = complete(pd, colocated, ids(45, 4))
    assert got == ref


def test_an_abort_queued_right_behind_the_prefill_call(checkpoint, pd):
    """D admits a request (its blocks allocated, its /pd/prefill call queued on the event loop) and the request is
    aborted before the loop made that call, both while D's event loop is held: the loop then starts the call and
    cancels it in one go. The request still ends, P is told, and D's blocks come back."""
    decode = DecodeConnector(MooncakeTransport(), [pd["p_url"]], transfer_timeout=60, api_key=API_KEY)
    auth = {"Authorization": f"Bearer {API_KEY}"}
    with running_server(load_model(checkpoint, torch.float32), pd["tokenizer"], kv_connector=decode,
                        **{**ENGINE, "max_num_seqs": 1}) as (d_url, d), ThreadPoolExecutor(1) as pool:
        filler = pool.submit(http, "POST", d_url + "/v1/completions",  # served on D alone, holding its one seat
                             {"prompt": ids(5), "max_tokens": 60, "ignore_eos": True}, auth)
        assert wait_until(lambda: d.scheduler.running, timeout=30)
        client = open_request(d_url, ids(30, 5), {"X-PD-Prefill": pd["p_url"]})
        assert wait_until(lambda: len(d.scheduler.waiting) == 1, timeout=30)
        room = d.scheduler.waiting[0].request_id
        held = threading.Event()
        decode.loop.call_soon_threadsafe(held.wait, 60)
        try:
            assert wait_until(lambda: room in d.scheduler.receiving, timeout=60)  # the filler is done, the call queued
            decode.async_engine.abort(room)  # what the server does when the client leaves
            time.sleep(0.5)  # the engine thread takes the abort and queues the cancel on the held loop
        finally:
            held.set()
        assert wait_until(lambda: pools_full(d, pd["p"]), timeout=30), d.kv_cache.usage()
        assert room in pd["prefill"].tombstones  # P was told to stop, though it never saw the room
        client.close()
        assert filler.result(timeout=60)[0] == 200
