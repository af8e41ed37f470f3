"""The data plane of PD disaggregation: register memory once, write byte ranges into a peer's registered memory.

`KVTransport` is the interface the PD roles use: `address` (what a peer writes to), `register(regions)` (once, at
start-up: the cache tensors), `write(peer, src, dst, lengths)` (a batch of one-sided writes, returned when the
bytes are in the peer's memory; TransferError otherwise). The notification that a request's KV has arrived goes
over the PD control plane (the prefill instance's answer to the decode instance's /pd/prefill, sent after its
writes returned), so an engine only has to move bytes. `MooncakeTransport` is the Mooncake Transfer Engine
(vLLM-Ascend's, SGLang's and the upstream recipe's): P2PHANDSHAKE metadata (no metadata server), the TCP protocol
(`mooncake-transfer-engine-non-cuda`, which needs Debian's libibverbs1; any machine) and "ascend" on Ascend NPUs
(`mooncake-transfer-engine-npu`, device-to-device). memfabric or another engine fits behind the same three members.
"""
from __future__ import annotations

import os
from abc import ABC, abstractmethod


class TransferError(RuntimeError):
    """A write did not complete (peer gone, memory not registered there, engine failure)."""


class KVTransport(ABC):
    @property
    @abstractmethod
    def address(self) -> str:
        """This side's address ("host:port") as peers pass it to write()."""

    @abstractmethod
    def register(self, regions: list[tuple[int, int]]) -> None:
        """Register (address, nbytes) regions once: writes may only read from or land in registered memory."""

    @abstractmethod
    def write(self, peer: str, src: list[int], dst: list[int], lengths: list[int]) -> None:
        """Copy lengths[i] bytes from local address src[i] to the peer's address dst[i], for every i; returns once
        all bytes are in the peer's memory, raises TransferError otherwise."""


class MooncakeTransport(KVTransport):
    def __init__(self, hostname: str = "127.0.0.1", protocol: str = "tcp", device_name: str = ""):
        os.environ.setdefault("MC_LOG_LEVEL", "ERROR")  # it logs every handshake at INFO / WARNING otherwise
        try:
            from mooncake.engine import TransferEngine
        except ImportError as e:  # the wheel is missing, or its libibverbs.so.1 (Debian: libibverbs1)
            raise RuntimeError(f"the Mooncake transfer engine does not import ({e}); install "
                               "mooncake-transfer-engine-non-cuda (CPU) or -npu (Ascend), and on Debian / Ubuntu "
                               "`apt-get install libibverbs1`") from None
        self.engine = TransferEngine()
        rc = self.engine.initialize(hostname, "P2PHANDSHAKE", protocol, device_name)
        if rc != 0:
            raise RuntimeError(f"Mooncake TransferEngine.initialize({hostname!r}, P2PHANDSHAKE, {protocol!r}) "
                               f"returned {rc}")
        self.hostname, self.protocol = hostname, protocol
        self._address = f"{hostname}:{self.engine.get_rpc_port()}"

    @property
    def address(self) -> str:
        return self._address

    def register(self, regions: list[tuple[int, int]]) -> None:
        if regions:
            rc = self.engine.batch_register_memory([a for a, _ in regions], [n for _, n in regions])
            if rc != 0:
                raise RuntimeError(f"Mooncake batch_register_memory of {len(regions)} regions returned {rc}")

    def write(self, peer: str, src: list[int], dst: list[int], lengths: list[int]) -> None:
        if not src:
            return
        rc = self.engine.batch_transfer_sync_write(peer, src, dst, lengths)
        if rc != 0:
            raise TransferError(f"Mooncake write of {len(src)} ranges ({sum(lengths)} bytes) to {peer} failed "
                                f"(rc {rc})")


def make_transport(hostname: str = "127.0.0.1", protocol: str = "tcp") -> KVTransport:
    """The Mooncake transport: "tcp" (any machine, the CPU wheel), "ascend" on Ascend with
    mooncake-transfer-engine-npu, "rdma" where RDMA NICs are."""
    return MooncakeTransport(hostname, protocol)
