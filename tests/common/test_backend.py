"""Device choice: npu > cuda > cpu, with NPU_COOKBOOK_DEVICE to force one; matching dist backend."""
import subprocess
import sys

import pytest

from common import backend


def _ask(env_value, expr):
    code = f"from common import backend; print({expr})"
    env = {"PATH": "/usr/bin:/bin", backend.DEVICE_ENV: env_value}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)


def test_this_machine_runs_the_cpu_path_with_gloo():
    if backend.torch_npu() is not None:
        pytest.skip("torch_npu is installed here")
    expected = "cuda" if backend.torch.cuda.is_available() else "cpu"
    assert backend.device_type() == expected
    assert backend.dist_backend() == {"cpu": "gloo", "cuda": "nccl"}[expected]


def test_override_forces_cpu():
    r = _ask("cpu", "backend.device_type(), backend.dist_backend(), backend.device()")
    assert r.stdout.split() == ["cpu", "gloo", "cpu"]


@pytest.mark.parametrize("value, needle", [("tpu", "expected one of"), ("npu", "torch_npu does not import")])
def test_bad_or_impossible_override_names_the_problem(value, needle):
    if value == "npu" and backend.torch_npu() is not None:
        pytest.skip("torch_npu is installed here")
    r = _ask(value, "backend.device_type()")
    assert r.returncode != 0 and needle in r.stderr


def test_memory_helpers_report_sane_numbers():
    free, total = backend.memory_info()
    assert 0 < free <= total
    assert backend.peak_memory_bytes() > 0
