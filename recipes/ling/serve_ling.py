"""Ling-3.0-Flash behind an OpenAI-compatible HTTP server: completions, chat completions (the tokenizer's chat
template; tools refused with 400 where the template defines none), /v1/responses, streaming.

    bash run.sh --serve [--host 127.0.0.1] [--port 8000] [--api-key K] [--weights DIR] [--config configs/X.yaml]
                        [--max-waiting N] [--drain-timeout S] [--max-consecutive-step-errors N]
                        [--responses-store-size N] [--speculative-tokens K] [--exe-mode graph]
                        [--pd-role prefill|decode [--pd-bootstrap URL ...] [--pd-host H] [--pd-protocol P]]

With no --weights, the tiny random checkpoint (written once, as generate_ling.py does) is served. SIGTERM /
Ctrl-C: stop accepting, let running requests finish for --drain-timeout seconds, abort the rest, exit 0. A
multi-rank preset starts torchrun: rank 0 serves, every rank runs the engine in lock-step
(common/serving/async_engine.py).

PD disaggregation as the deepseek recipe's server: `--pd-role prefill` serves /pd/prefill, `--pd-role decode
--pd-bootstrap http://P:PORT` has a prefill instance prefill each request the router pairs with it and write its
MLA latent blocks and its KDA state slot here over the Mooncake transfer engine (common/kv_transfer).
"""
from __future__ import annotations

import signal
import sys
from pathlib import Path

import uvicorn

from common import parallel as par
from common.engine import LLMEngine
from common.kv_transfer.cli import add_pd_args, check_pd_args, pd_connector
from common.serving import AsyncLLMEngine
from common.serving.api_server import build_app
from common.serving.response_store import DEFAULT_MAX_ENTRIES
from cli_ling import TINY, ArgumentParser, add_model_args, check_model_args, fail, load


def parse_args(argv=None):
    p = ArgumentParser(prog="run.sh --serve", description="Ling-3.0-Flash OpenAI-compatible server")
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
    app = build_app(async_engine, tokenizer, a.served_model_name or Path(a.weights or TINY).resolve().name,
                    api_key=a.api_key, max_images=0, responses_store_size=a.responses_store_size)
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
