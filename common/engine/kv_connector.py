"""The KV connector: what the engine asks of PD disaggregation, and what it promises about a request's KV blocks.

The engine calls three methods, always on its own thread, each returning at once (the transfer itself runs
elsewhere); the connector answers later through the engine's methods below, on the engine's thread between two steps
(never from inside one of its own three methods, and never from another thread: the server's AsyncLLMEngine
carries the call over, `send_kv_command` / `run_in_engine`). An instance holds one connector or none; the Mooncake
implementations are common/kv_transfer's PrefillConnector and DecodeConnector.

In vLLM's KV connector vocabulary (vllm/distributed/kv_transfer/kv_connector/v1/base.py): `start_load` is the
scheduler's `update_state_after_alloc` and the worker's `start_load_kv` of a request whose KV is remote, done
once per request; `start_send` is `request_finished` answering True (the connector frees the blocks
asynchronously); the engine methods a connector calls back are what `get_finished` reports (the ids done receiving
or sending), with a failed load reported per request rather than per block (`get_block_ids_with_load_errors`).
"""
from __future__ import annotations

from typing import Protocol, runtime_checkable

from .request import Request

BlockTable = dict[str, list[int]]  # cache group name -> block ids by block index (0: the null block)


@runtime_checkable
class KVConnector(Protocol):
    """A request's blocks belong either to the engine or to the connector, never to both, and the hand-over points
    are exactly these:

    Decode side (a request with do_remote_prefill; its prompt's KV is written here by another instance):
    - `start_load(request, block_table)`: the scheduler has just allocated the prompt's blocks (`block_table`) and
      put the request in `receiving`, outside the batch. From this call the blocks are the connector's: a remote
      writer may fill them, and the engine neither reads, writes, preempts nor frees them, until the connector calls,
      exactly once, `LLMEngine.finish_remote_prefill(request_id, token_ids, ...)` (every byte of the prompt's KV has
      landed: the request joins the running batch and the blocks are the engine's again) or
      `LLMEngine.fail_remote_prefill(request_id, error)` (`error` says why; None: the load was cancelled; the engine
      frees the blocks at once and ends the request with "error" or "abort"). The connector makes either call only
      once no write into these blocks can still land, whatever happened to the transfer or its peer.
    - `cancel_load(request_id)`: the request was aborted while its KV was on the way (`LLMEngine.abort` of a request
      in `receiving`, which frees nothing itself). It does not wait: when it returns the blocks are still the
      connector's and a write may still land in them. It ends the load in bounded time (its abort timeout): with
      `fail_remote_prefill(request_id, None)` once its peer can no longer write (with the load's own error where
      that came first), or, where the KV had landed and `finish_remote_prefill` was on its way, by aborting the
      then running request as any other. It may be called more than once for a request, and for ids it no longer
      loads (ignored).

    Prefill side (a request with do_remote_decode; its KV is written into another instance):
    - `start_send(request, block_table)`: the request finished normally (stop or length; one that is aborted or
      fails is freed by the engine and never sent) and the scheduler keeps its blocks in `sending`. From this call
      the connector may read the blocks until it calls `LLMEngine.release_sent(request_id)`, exactly once, after its
      last read of them returned; only then does the engine free them. It calls it whether the send succeeded,
      failed or was aborted: a failed transfer is the connector's to report to its peer (its control plane), not
      the engine's, and the engine learns nothing else of it.

    Both: `block_table`'s lists are the cache manager's own; a connector copies what it keeps past the call. Over
    several ranks every rank that holds the request (its DP rank's attention-TP peers, each with its own blocks) gets
    the same call and answers for its own blocks. A connector handed the other role's call keeps the same promises
    (the Mooncake ones answer it at once: a failed load, an immediate release)."""

    def start_load(self, request: Request, block_table: BlockTable) -> None: ...

    def cancel_load(self, request_id: str) -> None: ...

    def start_send(self, request: Request, block_table: BlockTable) -> None: ...
