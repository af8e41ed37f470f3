"""The KV connector contract: the engine depends on nothing of the serving layer (nor does common/kv_transfer), and
both Mooncake connectors are KVConnectors, with the Protocol's parameter names."""
import inspect
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from common.engine.kv_connector import KVConnector
from common.kv_transfer import DecodeConnector, PrefillConnector

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("package", ["common.engine", "common.kv_transfer"])
def test_imports_nothing_of_serving(package):
    code = (f"import sys, {package}\n"
            "print(sorted(m for m in sys.modules if m == 'common.serving' or m.startswith('common.serving.')))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120,
                         check=True).stdout
    assert out.strip() == "[]", f"{package} imports {out.strip()}"


@pytest.mark.parametrize("connector", [PrefillConnector, DecodeConnector])
def test_connector_is_a_kv_connector(connector):
    assert issubclass(connector, KVConnector)
    for name in ("start_load", "cancel_load", "start_send"):
        want = list(inspect.signature(getattr(KVConnector, name)).parameters)
        assert list(inspect.signature(getattr(connector, name)).parameters) == want, name


class Engine:
    def __init__(self):
        self.calls = []

    def fail_remote_prefill(self, request_id, error):
        self.calls.append(("fail_remote_prefill", request_id, error))

    def release_sent(self, request_id):
        self.calls.append(("release_sent", request_id))


class Host:
    def __init__(self):
        self.closures = []

    def run_in_engine(self, fn):
        self.closures.append(fn)


def test_the_other_roles_calls_give_the_blocks_back():
    """A call meant for the other role (no request of the instance asks for it) still hands the blocks back, on the
    engine's thread (through the host), never from inside the call."""
    prefill, decode = PrefillConnector(transport=None), DecodeConnector(transport=None, bootstrap_urls=[])
    for connector in (prefill, decode):
        connector.engine, connector.async_engine = Engine(), Host()
    prefill.start_load(SimpleNamespace(request_id="a"), {"g": [1, 2]})
    prefill.cancel_load("a")
    decode.start_send(SimpleNamespace(request_id="b"), {"g": [3]})
    assert prefill.engine.calls == decode.engine.calls == []
    for connector in (prefill, decode):
        for fn in connector.async_engine.closures:
            fn()
    assert prefill.engine.calls == [("fail_remote_prefill", "a", "a PrefillConnector loads no KV")]
    assert decode.engine.calls == [("release_sent", "b")]
    prefill.sender.shutdown()
