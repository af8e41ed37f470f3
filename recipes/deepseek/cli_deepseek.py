"""What the recipe's command lines share: one-line argument errors, presets, the default tiny checkpoint."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import yaml
from transformers import AutoTokenizer

from common import backend
from common.engine import EngineConfig
from common.loader import CheckpointError
from tiny_deepseek_v4 import write_tiny_checkpoint
from weights_deepseek_v4 import load_model

HERE = Path(__file__).resolve().parent
TINY = HERE.parents[1] / "weights" / "deepseek-v4-tiny"
DEFAULT_PRESET = HERE / "configs" / "tiny-cpu.yaml"
# --dtype / a preset's dtype; auto (also a preset without one): backend.default_dtype(), which follows the device
DTYPES = {"auto": None, "bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


class ArgumentParser(argparse.ArgumentParser):
    def error(self, message):  # one line and exit code 2, no usage dump
        self.exit(2, f"{self.prog}: error: {message}\n")


def add_model_args(p: ArgumentParser) -> None:
    p.add_argument("--weights", type=Path, help="checkpoint folder (default: the tiny random checkpoint)")
    p.add_argument("--config", type=Path, default=DEFAULT_PRESET, help="deployment preset")
    p.add_argument("--dtype", choices=sorted(DTYPES), help="overrides the preset's dtype")


def check_model_args(p: ArgumentParser, a: argparse.Namespace) -> None:
    """Validate --weights / --config, load the preset into a.preset and resolve a.dtype."""
    if a.weights is not None and not a.weights.is_dir():
        p.error(f"--weights {a.weights}: no such directory")
    if not a.config.is_file():
        p.error(f"--config {a.config}: no such file")
    try:
        a.preset = yaml.safe_load(a.config.read_text()) or {}
    except yaml.YAMLError as e:
        p.error(f"--config {a.config}: not valid YAML ({str(e).splitlines()[0]})")
    world = max([1, *(int(size) for size in (a.preset.get("parallel") or {}).values())])
    if world > 1:
        p.error(f"--config {a.config.name} needs {world} ranks; multi-rank runs arrive with the distributed executor")
    preset_dtype = a.preset.get("dtype", backend.AUTO)  # --dtype > the preset's dtype > auto (follows the device)
    if preset_dtype not in DTYPES:
        p.error(f"--config {a.config.name}: dtype {preset_dtype!r}, expected one of {sorted(DTYPES)}")
    source = f"configs/{a.config.name}" if a.config.resolve().parent == HERE / "configs" else str(a.config)
    a.dtype, line = backend.resolve_dtype(a.dtype, preset_dtype, source)
    print(line, flush=True)  # stdout, beside the run's other lines; stderr stays for errors


def load(a: argparse.Namespace):
    """(model, tokenizer, EngineConfig) for the parsed arguments; writes the tiny checkpoint on first use.
    Exits with a one-line message and code 2 for a missing / corrupt checkpoint or a bad preset."""
    path = a.weights or TINY
    if a.weights is None and not (TINY / "config.json").exists():
        write_tiny_checkpoint(TINY)
    try:
        config, rest = EngineConfig.from_kwargs(**(a.preset.get("engine") or {}))
        if rest:
            raise ValueError(f"unknown engine settings in {a.config.name}: {sorted(rest)}")
        return load_model(path, a.dtype, backend.device()), AutoTokenizer.from_pretrained(path), config
    except (CheckpointError, ValueError, TypeError, OSError) as e:
        fail(e)


def fail(e: Exception | str) -> None:
    """Exit with code 2 and the reason on one line (no traceback)."""
    print("error: " + "; ".join(line.strip() for line in str(e).splitlines()), file=sys.stderr)
    sys.exit(2)
