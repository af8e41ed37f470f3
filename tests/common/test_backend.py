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


# -- the CPU compute dtype: the CPU kinds simulated with the variables oneDNN and ATen read at start-up --
SIMULATED = {  # kind -> (the environment that simulates it, cpu_bf16_kind(), default_dtype())
    "emulated": ({"ONEDNN_MAX_CPU_ISA": "AVX512_CORE"}, "emulated", "torch.bfloat16"),  # AVX-512 without bf16
    "none": ({"ONEDNN_MAX_CPU_ISA": "AVX2", "ATEN_CPU_CAPABILITY": "avx2"}, "none", "torch.float32"),  # AVX2 only
}


def _ask_cpu(env_vars, expr):  # a fresh process: oneDNN and ATen read the variables once, at start-up
    code = f"from common import backend; print({expr})"
    env = {"PATH": "/usr/bin:/bin", backend.DEVICE_ENV: "cpu", **env_vars}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=20)


def _here_kind():
    return backend.cpu_bf16_kind() if backend.device_type() == "cpu" else None


@pytest.mark.parametrize("kind", ["emulated", "none"])
def test_simulated_cpu_kinds_are_classified_with_their_default_dtype(kind):
    env, want_kind, want_dtype = SIMULATED[kind]
    if kind == "emulated" and _here_kind() != "native":
        pytest.skip("simulating AVX-512 without bf16 needs a CPU with bf16 instructions")  # e.g. AVX2 here already
    if kind == "none" and not backend.torch.cpu._is_avx2_supported():
        pytest.skip("not an x86 CPU with AVX2")
    r = _ask_cpu(env, "backend.cpu_bf16_kind(), backend.default_dtype(), "
                      "backend.torch.ops.mkldnn._is_mkldnn_bf16_supported()")
    assert r.returncode == 0, r.stderr
    got_kind, got_dtype, onednn = r.stdout.split()
    assert (got_kind, got_dtype) == (want_kind, want_dtype)
    assert onednn == str(kind == "emulated")  # oneDNN itself honours ONEDNN_MAX_CPU_ISA
    line = _ask_cpu(env, "backend.resolve_dtype(None, 'auto', 'configs/tiny-cpu.yaml')[1]").stdout.strip()
    name = {"torch.bfloat16": "bf16", "torch.float32": "fp32"}[want_dtype]
    assert line.startswith(f"dtype: {name} (auto: ") and "simulated by ONEDNN_MAX_CPU_ISA=" in line


def test_this_cpu_kind_and_default_dtype_agree():
    kind = backend.cpu_bf16_kind()
    assert kind in ("native", "emulated", "none")
    if backend.device_type() == "cpu":
        assert backend.default_dtype() == (backend.torch.float32 if kind == "none" else backend.torch.bfloat16)
    else:
        assert backend.default_dtype() == backend.torch.bfloat16
    if kind == "native":  # what oneDNN says must back it
        assert backend.torch.ops.mkldnn._is_mkldnn_bf16_supported()


def test_an_explicit_dtype_wins_and_says_where_it_came_from():
    bf16, fp32 = backend.torch.bfloat16, backend.torch.float32
    assert backend.resolve_dtype("fp32", "bf16", "configs/x.yaml") == (fp32, "dtype: fp32 (from --dtype)")
    assert backend.resolve_dtype(None, "bf16", "configs/x.yaml") == (bf16, "dtype: bf16 (from configs/x.yaml)")
    for flag, preset in (("auto", "fp32"), (None, "auto"), (None, None)):  # --dtype auto wins over the preset too
        dtype, line = backend.resolve_dtype(flag, preset, "configs/x.yaml")
        assert dtype == backend.default_dtype() and line.startswith(f"dtype: {backend.dtype_name(dtype)} (auto: ")
