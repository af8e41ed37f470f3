"""The engine step loop on its own thread, beside the server's event loop.

Callers on the event loop submit requests and iterate their outputs; the engine thread owns the engine: it
takes queued adds and aborts between steps, runs `step()`, and hands each output to the request's asyncio
queue. A caller that stops iterating (client gone) aborts its request, which frees its KV blocks.

A failed step fails only its own requests (the engine finishes them with finish_reason "error"); the thread
keeps serving. It gives up, and the server turns unhealthy, only when `max_consecutive_step_errors` steps fail
in a row (the engine cannot continue: a broken device, say) or the engine's own bookkeeping raises.

Over several ranks (torchrun) the server and this thread live on rank 0; every other rank runs `run_worker()`, the
same loop without a server. Each iteration rank 0 broadcasts the new commands (adds, each with the DP rank that
takes it: the least loaded, by prompt + output tokens outstanding; aborts), every rank applies its own, all step
in lock-step, and the DP ranks' outputs are gathered to rank 0, which hands them to the streams. While idle, rank 0
still broadcasts every `IDLE_TICK_S`, so the other ranks' collectives never time out. Any rank's failure ends the
job (torchrun then stops the others); rank 0's /health answers 503 from then on.

PD disaggregation: every rank's KV connector gets the same commands (`send_kv_command` on rank 0, broadcast with
the others: its `on_command`), and its messages (`take_messages`, after each step) are gathered to rank 0's
(`on_messages`), which talks to the other instance over HTTP; `run_in_engine(fn)` runs a closure on this rank's
engine thread (a sender thread's release). An iteration in which no rank ran a step (every request waits for
remote KV, or for blocks held by transfers) waits for a command.
"""
from __future__ import annotations

import asyncio
import collections
import threading
from collections.abc import AsyncIterator, Sequence

from common import cpu_threads, parallel as par
from common.engine import LLMEngine, RequestOutput, SamplingParams
from common.engine.llm import LeastLoaded, request_cost
from common.engine.multimodal import MultiModalInput
from common.engine.request import Request

IDLE_TICK_S = 0.05  # how long an idle engine waits for a command before looking again


class EngineOverloaded(RuntimeError):
    """Too many requests are waiting; the server answers 503 with Retry-After."""


class AsyncLLMEngine:
    def __init__(self, engine: LLMEngine, max_waiting: int = 256, max_consecutive_step_errors: int = 3):
        if max_consecutive_step_errors < 1:
            raise ValueError(f"max_consecutive_step_errors must be >= 1, got {max_consecutive_step_errors}")
        self.engine, self.max_waiting = engine, max_waiting
        self.max_consecutive_step_errors = max_consecutive_step_errors
        self._commands: collections.deque = collections.deque()  # rank 0: ("add", request) | ("abort", id) | ("kv", x)
        self._local: collections.deque = collections.deque()  # this rank's run_in_engine closures
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._wake = threading.Event()
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="engine", daemon=True)
        self.error: BaseException | None = None
        self.parallel = engine.parallel
        self._balance = LeastLoaded(par.group_size(engine.dp_group))  # rank 0: which DP rank takes each request

    def start(self) -> "AsyncLLMEngine":
        """Step the engine on its own thread from now on. The calling thread (the one that built the engine) ends
        its OpenMP team first: two teams on the cores slow every step (common/cpu_threads.py)."""
        cpu_threads.release_team()
        self._thread.start()
        return self

    def shutdown(self, drain_timeout: float = 0.0) -> None:
        """Stop taking requests; let running ones finish for up to drain_timeout seconds, abort the rest."""
        self._stopping = True
        self._wake.set()
        self._thread.join(timeout=drain_timeout)
        for request_id in list(self._streams):
            self.abort(request_id)
        self._wake.set()
        self._thread.join(timeout=5)

    @property
    def started(self) -> bool:
        return self._thread.ident is not None

    @property
    def alive(self) -> bool:
        """The engine thread runs and has not failed."""
        return self._thread.is_alive() and self.error is None

    @property
    def num_pending(self) -> int:
        """Requests submitted and not finished (the bound for overload)."""
        return len(self._streams)

    async def generate(self, prompt: str | list[int], params: SamplingParams, request_id: str | None = None,
                       kv_transfer_params: dict | None = None, mm_inputs: Sequence[MultiModalInput] = ()
                       ) -> AsyncIterator[RequestOutput]:
        """Yield the request's outputs as tokens arrive; the last has `finished`. ValueError for a prompt that
        can never run, EngineOverloaded when too many are pending. kv_transfer_params (PD): the KV connector's
        parameters, with do_remote_prefill or do_remote_decode set (common/engine/request.py). mm_inputs: the
        images placed in a prompt of ids (LLMEngine.place_images)."""
        if self._stopping or self.error is not None:
            raise EngineOverloaded("the server is shutting down" if self._stopping else f"engine failed: {self.error}")
        if self.num_pending >= self.max_waiting:
            raise EngineOverloaded(f"{self.num_pending} requests pending, the limit is {self.max_waiting}")
        req = self.engine.make_request(prompt, params, request_id, mm_inputs=mm_inputs)
        req.kv_transfer_params = kv_transfer_params
        queue: asyncio.Queue = asyncio.Queue()
        self._streams[req.request_id] = (asyncio.get_running_loop(), queue)
        self._commands.append(("add", req))
        self._wake.set()
        finished = False
        try:
            while not finished:
                out = await queue.get()
                if isinstance(out, BaseException):
                    raise out
                finished = out.finished
                yield out
        finally:
            if not finished:
                self.abort(req.request_id)

    def abort(self, request_id: str) -> None:
        self._commands.append(("abort", request_id))
        self._wake.set()

    def send_kv_command(self, payload) -> None:
        """Rank 0: a KV connector command (picklable data) for every rank's connector (`on_command`), applied between
        steps; the outputs it makes go to their streams."""
        self._commands.append(("kv", payload))
        self._wake.set()

    def run_in_engine(self, fn) -> None:
        """Run fn() on this rank's engine thread between steps (thread-safe, not broadcast); it returns a
        RequestOutput, a list of them or None."""
        self._local.append(fn)
        self._wake.set()

    def _deliver(self, request_id: str, item) -> None:
        stream = self._streams.get(request_id)
        if stream is not None:
            loop, queue = stream
            if getattr(item, "finished", True):
                self._streams.pop(request_id, None)
            loop.call_soon_threadsafe(queue.put_nowait, item)

    def run_worker(self) -> None:
        """A rank other than 0: the engine loop in this thread, until rank 0 stops; raises what ended it."""
        self._run()
        if self.error is not None:
            raise self.error

    def _run(self) -> None:
        connector, multi = self.engine.kv_connector, self.parallel.world_size > 1
        try:
            while True:
                commands, stopping = list(self._take_commands()), self._stopping
                if multi:  # rank 0's commands, to every rank (and a tick while idle)
                    commands, stopping = par.broadcast_from_rank0((commands, stopping))
                outputs = []
                for kind, arg in commands:
                    if kind == "add":
                        self._add(*arg)
                    elif kind == "kv":
                        outputs += _as_list(connector.on_command(arg))
                    else:
                        self.engine.abort(arg)
                        self._streams.pop(arg, None)
                        self._balance.done(arg)
                while self._local:
                    outputs += _as_list(self._local.popleft()())
                busy = self.engine.has_unfinished_anywhere()
                if stopping and not busy and not commands:
                    return
                ran = False
                if busy:
                    before = self.engine.stats.steps + self.engine.stats.step_errors
                    outputs += self.engine.step()
                    ran = self.engine.stats.steps + self.engine.stats.step_errors != before
                messages = connector.take_messages() if connector is not None else []
                if multi:  # each DP rank's outputs (once: its first TP rank's) and connector messages, to rank 0
                    mine = outputs if par.group_rank(self.parallel.group("attn_tp")) == 0 else []
                    parts = par.gather_to_rank0((mine, messages, ran)) or []
                    outputs = [o for part in parts for o in part[0]]
                    messages = [m for part in parts for m in part[1]]
                    ran = any(part[2] for part in parts)
                if messages and self.parallel.rank == 0:
                    connector.on_messages(messages)
                for out in outputs:
                    if out.finished:
                        self._balance.done(out.request_id)
                    self._deliver(out.request_id, out)
                errors = self.engine.stats.consecutive_step_errors
                if errors >= self.max_consecutive_step_errors:
                    raise RuntimeError(f"{errors} engine steps failed in a row; the engine cannot continue")
                if not ran and self.parallel.rank == 0:  # nothing ran anywhere (idle, or KV on its way): wait
                    self._wake.wait(timeout=IDLE_TICK_S)
                    self._wake.clear()
        except BaseException as e:  # noqa: BLE001 - every waiting caller must hear about it
            self.error = e
            for request_id in list(self._streams):
                self.engine.abort(request_id)
                self._deliver(request_id, e)

    def _take_commands(self):
        """Rank 0: the queued commands, adds as (request fields, kv_transfer_params, the DP rank that takes it)."""
        while self._commands:
            kind, arg = self._commands.popleft()
            if kind == "add" and self.parallel.world_size > 1:
                owner = self._balance.assign(arg.request_id, request_cost(arg))
                fields = arg.request_id, arg.prompt_token_ids, arg.sampling_params, arg.prompt, arg.mm_inputs
                arg = fields, arg.kv_transfer_params, owner
            elif kind == "add":
                arg = arg, None, 0
            yield kind, arg

    def _add(self, req, kv_transfer_params: dict | None, owner: int) -> None:
        if owner != par.group_rank(self.engine.dp_group):
            return  # another DP rank's
        if not isinstance(req, Request):
            request_id, ids, params, prompt, mm_inputs = req
            req = Request(request_id, ids, params, prompt, kv_transfer_params=kv_transfer_params, mm_inputs=mm_inputs)
        try:
            self.engine.add(req)
        except ValueError as e:  # an id in use: this request's fault, not the engine's
            self._deliver(req.request_id, e)


def _as_list(out) -> list:
    return out if isinstance(out, list) else [] if out is None else [out]
