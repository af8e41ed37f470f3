"""What the recipe's command lines share: one-line argument errors, the preset, the default tiny checkpoint, and
loading the model, its tokenizer and the engine settings."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import yaml
from transformers import AutoTokenizer

import config_ling
import tiny_ling
import weights_ling
from common import backend
from common.cli_paths import input_path
from common.engine import EngineConfig
from common.loader import Checkpoint, CheckpointError

HERE = Path(__file__).resolve().parent
TINY = HERE.parents[1] / "weights" / "ling-tiny"
DEFAULT_PRESET = HERE / "configs" / "tiny-cpu.yaml"
DTYPES = {backend.AUTO: None, **backend.DTYPES}
# preset keys of the deepseek recipe that this one does not run yet, and why
NOT_YET = {"speculative": "MTP speculative decoding", "exe_mode": "graph mode", "moe_offload": "MoE offload",
           "quantization": "quantized weights"}


class ArgumentParser(argparse.ArgumentParser):
    def error(self, message):  # one line and exit code 2, no usage dump
        self.exit(2, f"{self.prog}: error: {message}\n")


def add_model_args(p: ArgumentParser) -> None:
    p.add_argument("--weights", type=input_path(HERE), help="checkpoint folder (default: the tiny random checkpoint)")
    p.add_argument("--config", type=input_path(HERE), default=DEFAULT_PRESET, help="deployment preset")
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
    if not isinstance(a.preset, dict):
        p.error(f"--config {a.config}: expected a mapping")
    if unknown := sorted(set(a.preset) - {"dtype", "engine", "parallel", *NOT_YET}):
        p.error(f"--config {a.config.name}: unknown keys {unknown}")
    for key, what in NOT_YET.items():
        if a.preset.get(key) not in (None, "none", "eager", {}):
            p.error(f"--config {a.config.name}: {key}: {what} is not supported for Ling in this recipe yet")
    world = (a.preset.get("parallel") or {}).get("world_size", 1)
    if world != 1:
        p.error(f"--config {a.config.name}: world_size {world}: Ling runs on one process in this recipe (TP / EP "
                "are not supported for it yet; tools/plan_ling.py sizes the multi-die layouts)")
    preset_dtype = a.preset.get("dtype", backend.AUTO)
    if preset_dtype not in DTYPES:
        p.error(f"--config {a.config.name}: dtype {preset_dtype!r}, expected one of {sorted(DTYPES)}")
    source = f"configs/{a.config.name}" if a.config.resolve().parent == HERE / "configs" else str(a.config)
    a.dtype, line = backend.resolve_dtype(a.dtype, preset_dtype, source)
    try:
        config, rest = EngineConfig.from_kwargs(**(a.preset.get("engine") or {}))
        if rest:
            raise ValueError(f"unknown engine settings {sorted(rest)}")
    except (ValueError, TypeError) as e:
        p.error(f"--config {a.config.name}: {e}")
    a.engine_config = config
    print(line, flush=True)  # stdout, beside the run's other lines; stderr stays for errors


def ensure_tiny() -> Path:
    """The tiny checkpoint, written (again) when missing or written by an older revision of tiny_ling."""
    if not tiny_ling.is_current(TINY):
        tiny_ling.write_tiny_checkpoint(TINY)
    return TINY


def load(a: argparse.Namespace):
    """(model, tokenizer, EngineConfig) for the parsed arguments; writes the tiny checkpoint on first use. Exits
    with a one-line message and code 2 for a missing / corrupt checkpoint or one that does not fit."""
    path = a.weights or ensure_tiny()
    try:
        args = config_ling.ModelArgs.from_config(Checkpoint(path).config)
        weights_ling.check_fits(args, a.dtype, backend.device())
        model = weights_ling.load_model(path, a.dtype, backend.device())
        return model, AutoTokenizer.from_pretrained(path), a.engine_config
    except (CheckpointError, ValueError, TypeError, OSError) as e:
        fail(e)


def fail(e: Exception | str) -> None:
    """Exit with code 2 and the reason on one line (no traceback)."""
    print("error: " + "; ".join(line.strip() for line in str(e).splitlines()), file=sys.stderr)
    sys.exit(2)
