"""The PD flags of a recipe's server (`--pd-role`, `--pd-bootstrap`, ...): added to its parser, checked, and turned into
the engine's KV connector; the same for every recipe (the deepseek and Ling servers)."""
from __future__ import annotations

import argparse

from .connector_decode import DecodeConnector
from .connector_prefill import PrefillConnector
from .transport import make_transport


def add_pd_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--pd-role", choices=("prefill", "decode"), help="PD disaggregation: this instance's role")
    p.add_argument("--pd-bootstrap", action="append", default=[], metavar="URL",
                   help="decode role: a prefill instance's base URL (repeat per prefill instance)")
    p.add_argument("--pd-host", default="127.0.0.1",
                   help="the address the KV transfer engine listens on (peers write to / are written from it)")
    p.add_argument("--pd-protocol", default="tcp", choices=("tcp", "rdma", "ascend"),
                   help="the Mooncake transfer protocol: tcp (any machine), rdma, ascend (NPU, needs "
                        "mooncake-transfer-engine-npu)")
    p.add_argument("--pd-transfer-timeout", type=float, default=600.0,
                   help="decode role: seconds a prefill instance has to prefill and write a request's KV")


def check_pd_args(p: argparse.ArgumentParser, a: argparse.Namespace) -> None:
    """p.error (one line, exit 2) for PD flags that do not go together."""
    if a.pd_role == "decode" and not a.pd_bootstrap:
        p.error("--pd-role decode needs --pd-bootstrap URL (a prefill instance)")
    if a.pd_bootstrap and a.pd_role != "decode":
        p.error("--pd-bootstrap is for --pd-role decode")
    if a.pd_transfer_timeout <= 0:
        p.error(f"--pd-transfer-timeout must be > 0, got {a.pd_transfer_timeout}")


def pd_connector(a: argparse.Namespace) -> PrefillConnector | DecodeConnector | None:
    """The KV connector of --pd-role (None: no PD). RuntimeError when the transfer engine cannot start."""
    if a.pd_role is None:
        return None
    transport = make_transport(a.pd_host, a.pd_protocol)
    return (PrefillConnector(transport) if a.pd_role == "prefill" else
            DecodeConnector(transport, a.pd_bootstrap, a.pd_transfer_timeout, api_key=a.api_key))
