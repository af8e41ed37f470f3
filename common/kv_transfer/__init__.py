"""KV transfer between a prefill and a decode instance (PD disaggregation): the transport (register memory, write
blocks) and the cache layout (which bytes a request's blocks are)."""
from .layout import CacheLayout, block_runs
from .transport import KVTransport, MooncakeTransport, TransferError, make_transport

__all__ = ["CacheLayout", "KVTransport", "MooncakeTransport", "TransferError", "block_runs", "make_transport"]
