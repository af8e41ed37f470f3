"""What the PD router and the decode instance's server share: the header that names a request's prefill instance.
(The /pd/prefill body and answer are the KV connectors': common/kv_transfer/connector_base.py.)"""
from __future__ import annotations

PREFILL_HEADER = "x-pd-prefill"  # router -> decode instance: the base URL of the prefill instance to use
