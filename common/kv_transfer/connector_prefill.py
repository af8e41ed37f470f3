"""The prefill (P) role of PD disaggregation: prefill a decode instance's request, write its KV into the blocks the
decode instance allocated, answer with the first token.

The serving layer's /pd routes (its pd_routes.py) drive it: /pd/prefill opens a room (`open_room`), runs
the request with do_remote_decode and the decode instance's targets (its ranks' transport addresses, cache layouts
and block ids), waits for the room's writes (`Room.done`) and closes it (`close_room`); /pd/abort calls `abort`.
The engine calls `start_send` on its own thread when a do_remote_decode request finishes; the writes (every cache
group's blocks, runs of consecutive blocks one write per cache tensor, through the KVTransport into each target's
registered memory) run on one sender thread, so the engine keeps stepping meanwhile, and the blocks go back to the
engine (`release_sent`) once the writes returned, failed or stopped. An abort (the room's /pd/abort, or its
decode instance going away) stops a room's writes between batches, so P's blocks come back whether D finished,
failed or died. Over several ranks the DP rank that prefilled the request writes it (PrefillConnector).
"""
from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import logging
import threading
import time
from dataclasses import dataclass, field

from common import cpu_threads, parallel as par
from common.engine import LLMEngine
from common.engine.kv_connector import BlockTable
from common.engine.request import Request

from .connector_base import EngineHost, PDConnector
from .layout import CacheLayout
from .transport import KVTransport

logger = logging.getLogger("npu_cookbook.pd")
WRITES_PER_BATCH = 256  # ranges per transport.write: an abort stops the room between batches
TOMBSTONES = 4096  # aborted rooms remembered (a /pd/prefill arriving after its /pd/abort is refused)


@dataclass(eq=False)
class Room:
    """Rank 0: one request prefilled for a decode instance, from /pd/prefill until no write for it can happen (its
    writes ended, or an abort found no rank writing it), and its /pd/prefill is over."""
    done: concurrent.futures.Future = field(default_factory=concurrent.futures.Future)  # the writes: error or None
    ack: concurrent.futures.Future = field(default_factory=concurrent.futures.Future)  # aborted, no rank writes it
    acked: set[int] = field(default_factory=set)  # the DP ranks that have said they do not write it
    closed: bool = False  # its /pd/prefill is over

    @property
    def settled(self) -> bool:
        return self.done.done() or self.ack.done()


@dataclass
class TransferStats:
    num_transfers: int = 0
    num_writes: int = 0  # byte ranges written
    bytes: int = 0
    seconds: float = 0.0  # in transport.write
    num_failed: int = 0
    num_aborted: int = 0


def remember(keys: collections.OrderedDict, key: str) -> None:
    """Add key to a bounded record (the oldest of more than TOMBSTONES keys are forgotten)."""
    keys[key] = None
    while len(keys) > TOMBSTONES:
        keys.popitem(last=False)


class PrefillConnector(PDConnector):
    """The engine's KV connector on a prefill instance (common/engine/kv_connector.py). Every rank has one; rank
    0's backs the /pd routes. The request's targets (one per rank of the decode instance that holds it) travel
    with it to the DP rank that prefills it, whose first attention-TP rank writes them (its TP peers hold the same
    cache); "sent" and "ack" messages come back to rank 0; aborts reach every rank as commands.

    A room's abort is one command, applied by every rank between two steps: a request still prefilling is aborted
    there (it never sends), a send not started yet never writes, and one under way stops after its current batch of
    writes. Each DP rank's writer answers at once ("ack": it does not write the room) or when its send ends ("sent");
    rank 0 keeps the room until one of them settles it, so a later /pd/abort still waits for a send in flight."""

    def __init__(self, transport: KVTransport, abort_timeout: float = 30.0, writes_per_batch: int = WRITES_PER_BATCH):
        super().__init__(transport)
        self.abort_timeout, self.writes_per_batch = abort_timeout, writes_per_batch
        self.rooms: dict[str, Room] = {}  # rank 0
        self.tombstones: collections.OrderedDict[str, None] = collections.OrderedDict()  # rank 0: aborted rooms
        self.aborted: collections.OrderedDict[str, None] = collections.OrderedDict()  # every rank: rooms not to send
        self.sending: set[str] = set()  # this rank's rooms being written
        self.lock = threading.Lock()
        self.sender = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="kv-send",
                                                            initializer=cpu_threads.serial_thread)
        self.stats = TransferStats()

    def bind(self, engine: LLMEngine, async_engine: EngineHost, loop: asyncio.AbstractEventLoop | None) -> None:
        super().bind(engine, async_engine, loop)
        dp = engine.dp_group
        self.num_dp, self.dp_rank = par.group_size(dp), par.group_rank(dp)

    # the engine's thread, on the ranks that own the request
    def start_send(self, request: Request, block_table: BlockTable) -> None:
        rid = request.request_id
        if self.tp_rank != 0:  # a TP peer: rank 0 of its group writes
            self._release(rid)
            return
        with self.lock:
            self.sending.add(rid)
        self.sender.submit(self._send, rid, request.kv_transfer_params["targets"],
                           {g: list(t) for g, t in block_table.items()})

    def on_command(self, payload) -> None:
        """Every rank: ("abort", room): the room's request stops here if it is still prefilling, and no write for it
        starts after this; this DP rank's writer tells rank 0 "ack" unless a send of the room is under way (its
        "sent" comes when the send ends)."""
        _, rid = payload
        remember(self.aborted, rid)
        self.engine.abort(rid)  # unknown or finished ids are ignored
        if self.tp_rank == 0:
            with self.lock:
                if rid not in self.sending:
                    self.outbox.append(("ack", rid, self.dp_rank))

    def _release(self, rid: str) -> None:
        self.async_engine.run_in_engine(lambda: self.engine.release_sent(rid))

    # the sender thread
    def _send(self, rid: str, targets: list[dict], tables: dict[str, list[int]]) -> None:
        error = None
        try:
            writes = [(t["peer"], *self.layout.writes(CacheLayout.from_description(t["layout"]), tables,
                                                      t["block_tables"])) for t in targets]
            t0 = time.perf_counter()
            for peer, srcs, dsts, lengths in writes:
                for i in range(0, len(srcs), self.writes_per_batch):
                    if rid in self.aborted:
                        raise InterruptedError("aborted")
                    j = slice(i, i + self.writes_per_batch)
                    self.transport.write(peer, srcs[j], dsts[j], lengths[j])
            self.stats.seconds += time.perf_counter() - t0
            self.stats.num_transfers += 1
            self.stats.num_writes += sum(len(w[1]) for w in writes)
            self.stats.bytes += sum(sum(w[3]) for w in writes)
        except InterruptedError:
            error = "aborted"
            self.stats.num_aborted += 1
        except Exception as e:  # noqa: BLE001 - the room fails, the instance goes on
            error = f"{type(e).__name__}: {e}"
            self.stats.num_failed += 1
            logger.warning("KV transfer of %s failed: %s", rid, error)
        finally:
            self._release(rid)
            with self.lock:
                self.sending.discard(rid)
                self.outbox.append(("sent", rid, error))

    # rank 0: the engine's thread
    def on_messages(self, messages: list) -> None:
        with self.lock:
            for kind, rid, arg in messages:
                room = self.rooms.get(rid)
                if room is None:
                    continue
                if kind == "sent" and not room.done.done():
                    room.done.set_result(arg)
                elif kind == "ack":
                    room.acked.add(arg)
                    if len(room.acked) == self.num_dp and not room.ack.done():
                        room.ack.set_result(None)
                if room.closed and room.settled:
                    del self.rooms[rid]

    # rank 0: the event loop
    def open_room(self, rid: str) -> tuple[Room | None, str | None]:
        """(a new room, None), or (None, why not: aborted before it came, or in use)."""
        if rid in self.tombstones:
            return None, f"room {rid} was aborted"
        with self.lock:
            if rid in self.rooms:
                return None, f"room {rid} is in use"
            self.rooms[rid] = room = Room()
        return room, None

    def close_room(self, rid: str, room: Room) -> None:
        """/pd/prefill is over (answered, failed or its decode instance gone): a write not started yet never starts,
        one under way stops; the room stays until no write for it can happen."""
        if not room.done.done():
            self.async_engine.send_kv_command(("abort", rid))
        with self.lock:
            room.closed = True
            if room.settled and self.rooms.get(rid) is room:
                del self.rooms[rid]

    async def abort(self, rid: str) -> bool:
        """No write for the room after this returns True (False: the writes did not stop within abort_timeout)."""
        remember(self.tombstones, rid)
        room = self.rooms.get(rid)
        self.async_engine.send_kv_command(("abort", rid))
        self.async_engine.abort(rid)  # its stream and DP balance (the command aborted the engine's request)
        if room is None or room.done.done():
            return True
        # the wrappers are left pending, never cancelled: cancelling one would cancel the room's future it wraps
        waits = {asyncio.wrap_future(room.done), asyncio.wrap_future(room.ack)}
        done, _ = await asyncio.wait(waits, timeout=self.abort_timeout, return_when=asyncio.FIRST_COMPLETED)
        return bool(done)

    async def aclose(self) -> None:
        self.sender.shutdown(wait=False)
