"""DeepSeek-V4 behind an OpenAI-compatible HTTP server (completions, chat completions, streaming).

    bash run.sh --serve [--host 127.0.0.1] [--port 8000] [--api-key K] [--weights DIR] [--config configs/X.yaml]
                        [--max-waiting N] [--drain-timeout S] [--max-consecutive-step-errors N]
                        [--max-images N] [--max-image-bytes B] [--max-image-pixels P] [--image-fetch-timeout S]
                        [--allowed-image-domain HOST ...]

Images (a vision checkpoint, as the tiny one is): chat messages take OpenAI's {"type": "image_url", "image_url":
{"url": data: or http(s) URL}} parts; the flags bound what a request may carry (answered 400 beyond them).

PD disaggregation: `--pd-role prefill` serves /pd/prefill for decode instances (and /v1 as usual); `--pd-role
decode --pd-bootstrap http://P:PORT [...]` has each request the router pairs with one of those prefill instances
prefilled there, its KV written into this instance's blocks over the Mooncake transfer engine, and decodes it here
(common/kv_transfer/connector_prefill.py, connector_decode.py; the /pd routes: common/serving/pd_routes.py).
`run.sh --serve --pd 1:1` starts P, D and the router (serve_dp.py).

With no --weights, the tiny random checkpoint (written once, as generate.py does) is served. SIGTERM / Ctrl-C:
stop accepting, let running requests finish for --drain-timeout seconds, abort the rest, exit 0. A multi-rank
preset starts torchrun: rank 0 serves, every rank runs the engine in lock-step (common/serving/async_engine.py).
"""
from __future__ import annotations

import signal
import sys
from pathlib import Path

import uvicorn

from common import parallel as par
from common.engine import LLMEngine
from common.serving import AsyncLLMEngine
from common.kv_transfer.cli import add_pd_args, check_pd_args, pd_connector
from common.serving.api_server import build_app
from common.serving.media_connector import MediaConnector
from common.serving.response_store import DEFAULT_MAX_ENTRIES
from cli_deepseek import ArgumentParser, add_model_args, check_model_args, fail, load


def parse_args(argv=None):
    p = ArgumentParser(prog="run.sh --serve", description="DeepSeek-V4 OpenAI-compatible server")
    add_model_args(p)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", help="require `Authorization: Bearer <key>` on /v1")
    p.add_argument("--served-model-name", help="the model name clients send (default: the checkpoint folder's)")
    p.add_argument("--max-waiting", type=int, default=256, help="pending requests before answering 503")
    p.add_argument("--drain-timeout", type=float, default=5.0, help="seconds running requests get at shutdown")
    p.add_argument("--responses-store-size", type=int, default=DEFAULT_MAX_ENTRIES,
                   help="/v1/responses kept in memory for previous_response_id and GET /v1/responses/{id} (least "
                        "recently used evicted first; 0: none is stored)")
    p.add_argument("--max-consecutive-step-errors", type=int, default=3,
                   help="failed engine steps in a row after which the engine stops and /health answers 503 (a failed "
                        "step fails only its own requests)")
    g = p.add_argument_group("images in chat requests (a vision checkpoint)")
    g.add_argument("--max-images", type=int, default=8, help="images one request may carry")
    g.add_argument("--max-image-bytes", type=int, default=20 << 20, help="largest encoded image")
    g.add_argument("--max-image-pixels", type=int, default=50_000_000, help="largest width x height")
    g.add_argument("--image-fetch-timeout", type=float, default=10.0, help="seconds an http(s) image may take")
    g.add_argument("--allowed-image-domain", action="append", metavar="HOST",
                   help="a host http(s) image URLs may name (repeat; default: any; data: URLs always)")
    add_pd_args(p)
    a = p.parse_args(argv)
    check_pd_args(p, a)
    if not 0 <= a.port < 65536:
        p.error(f"--port {a.port}: not a port number")
    if a.max_waiting < 1:
        p.error(f"--max-waiting must be >= 1, got {a.max_waiting}")
    if a.max_consecutive_step_errors < 1:
        p.error(f"--max-consecutive-step-errors must be >= 1, got {a.max_consecutive_step_errors}")
    if a.responses_store_size < 0:
        p.error(f"--responses-store-size must be >= 0, got {a.responses_store_size}")
    if a.max_images < 0:
        p.error(f"--max-images must be >= 0, got {a.max_images}")
    try:
        a.media = MediaConnector(a.max_image_bytes, a.image_fetch_timeout,
                                 tuple(a.allowed_image_domain) if a.allowed_image_domain else None, a.max_image_pixels)
    except ValueError as e:
        p.error(str(e))
    check_model_args(p, a)
    return a


def main(argv=None) -> int:
    a = parse_args(argv)
    model, tokenizer, config = load(a)
    try:
        connector = pd_connector(a)
    except RuntimeError as e:  # the transfer engine did not start
        fail(e)
    try:
        engine = LLMEngine(model, tokenizer, config, kv_connector=connector)
    except ValueError as e:  # settings that can never run (checked when the engine is built)
        fail(e)
    path = a.weights or a.family.tiny
    async_engine = AsyncLLMEngine(engine, max_waiting=a.max_waiting,
                                  max_consecutive_step_errors=a.max_consecutive_step_errors)
    if engine.parallel.rank != 0:  # a multi-rank preset: rank 0 serves, the others follow its engine loop
        for sig in (signal.SIGINT, signal.SIGTERM):  # and stop when rank 0 stops (it drains first)
            signal.signal(sig, lambda *_: None)
        if connector is not None:
            connector.bind(engine, async_engine, None)
        async_engine.run_worker()
        par.destroy_parallel()
        return 0
    app = build_app(async_engine, tokenizer, a.served_model_name or Path(path).resolve().name, api_key=a.api_key,
                    chat_format=a.family.chat_format() if a.family.chat_format else None, media=a.media,
                    max_images=a.max_images, responses_store_size=a.responses_store_size)
    server = uvicorn.Server(uvicorn.Config(app, host=a.host, port=a.port, log_level="info",
                                           timeout_graceful_shutdown=a.drain_timeout))
    # uvicorn re-raises the signal it shut down on; a no-op handler then makes a clean exit 0
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: None)
    server.run()
    par.destroy_parallel()
    return 0 if server.started else 1


if __name__ == "__main__":
    sys.exit(main())
