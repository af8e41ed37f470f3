"""Write common/ops/npu_schemas.txt: the torch_npu schemas of exactly the ops this repository calls.

    python scripts/npu_schemas.py                  # pip-downloads torch-npu==2.14.0 (no deps) to a temp folder
    python scripts/npu_schemas.py --wheel PATH     # a torch_npu .whl, or a folder holding one

Called ops are found by scanning the repository's .py files for `torch_npu.<op>(` (common.ops.schema). Their
schemas come from `torch_npu/csrc/aten/npu_native_functions_by_codegen.yaml` inside the wheel: the `func:` lines
torch_npu generates its Python bindings from (op-plugin ops included), all overloads of each called op. ATB ops
(`_npu_reshape_and_cache`, `_npu_paged_attention`, ...) are not in it; their schemas only exist inside
lib/libop_plugin_atb.so, so the repository does not call them. The wheel is only read, never installed.
"""
from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from common.ops.schema import SCHEMA_FILE, find_torch_npu_calls  # noqa: E402

VERSION = "2.14.0"
YAML = "torch_npu/csrc/aten/npu_native_functions_by_codegen.yaml"


def find_wheel(path: Path | None, tmp: str) -> Path:
    if path is None:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", f"torch-npu=={VERSION}", "-d", tmp]
        subprocess.run(cmd, check=True)
        path = Path(tmp)
    wheels = sorted(path.glob("torch_npu-*.whl")) if path.is_dir() else [path]
    if not wheels:
        sys.exit(f"no torch_npu wheel in {path}")
    return wheels[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--wheel", type=Path, help="torch_npu wheel or a folder with one (default: pip download)")
    parser.add_argument("--out", type=Path, default=SCHEMA_FILE)
    args = parser.parse_args()

    called = sorted({call.op for call in find_torch_npu_calls(ROOT)})
    with tempfile.TemporaryDirectory() as tmp:
        wheel = find_wheel(args.wheel, tmp)
        text = zipfile.ZipFile(wheel).read(YAML).decode()

    schemas: dict[str, list[str]] = {}
    for func in re.findall(r"^\s*(?:- )?func:\s*(.+?)\s*$", text, flags=re.M):
        name = func.split("(")[0].split(".")[0]
        if name in called and func not in schemas.setdefault(name, []):  # the yaml repeats some ops verbatim
            torch._C.parse_schema(func)  # every line must parse as is
            schemas[name].append(func)
    missing = [name for name in called if not schemas.get(name)]
    if missing:
        sys.exit(f"not in {wheel.name}:{YAML}: {', '.join(missing)}")

    header = [
        f"# torch_npu {wheel.name.split('-')[1]} schemas of the ops this repository calls (all overloads).",
        f"# Source: {wheel.name}:{YAML}",
        "# Regenerate: python scripts/npu_schemas.py [--wheel PATH]. Read by common/ops/schema.py.",
    ]
    lines = [func for name in called for func in schemas[name]]
    args.out.write_text("\n".join(header + lines) + "\n")
    print(f"wrote {len(lines)} schemas of {len(called)} ops to {args.out.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
