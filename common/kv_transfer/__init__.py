"""KV transfer between a prefill and a decode instance (PD disaggregation): the transport (register memory, write
blocks), the cache layout (which bytes a request's blocks are), and the engine's KV connectors over them (the
Protocol is common/engine/kv_connector.py): PrefillConnector sends a finished prefill's blocks, DecodeConnector has
a prefill instance fill the blocks it allocated."""
from .connector_decode import DecodeConnector
from .connector_prefill import PrefillConnector
from .layout import CacheLayout, block_runs
from .transport import KVTransport, MooncakeTransport, TransferError, make_transport

__all__ = ["CacheLayout", "DecodeConnector", "KVTransport", "MooncakeTransport", "PrefillConnector", "TransferError",
           "block_runs", "make_transport"]
