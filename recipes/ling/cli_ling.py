"""What the recipe's command lines share: one-line argument errors, the preset, the default tiny checkpoint,
loading the model, its tokenizer and the engine settings, and the launch of a multi-rank preset: checked here, then
the same command again under torchrun, one process a rank (common.parallel.launch_ranks)."""
from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from pathlib import Path

import yaml
from transformers import AutoTokenizer

import config_ling
import modeling_ling
import tiny_ling
import weights_ling
from common import backend
from common import parallel as par
from common.cli_paths import input_path
from common.engine import EngineConfig
from common.engine.config import EXE_MODES
from common.loader import Checkpoint, CheckpointError

HERE = Path(__file__).resolve().parent
TINY = HERE.parents[1] / "weights" / "ling-tiny"
DEFAULT_PRESET = HERE / "configs" / "tiny-cpu.yaml"
DTYPES = {backend.AUTO: None, **backend.DTYPES}
# preset keys of the deepseek recipe that this one does not run yet, and why
NOT_YET = {"moe_offload": "MoE offload", "quantization": "quantized weights"}


class ArgumentParser(argparse.ArgumentParser):
    def error(self, message):  # one line and exit code 2, no usage dump
        self.exit(2, f"{self.prog}: error: {message}\n")


def add_model_args(p: ArgumentParser) -> None:
    p.add_argument("--weights", type=input_path(HERE), help="checkpoint folder (default: the tiny random checkpoint)")
    p.add_argument("--config", type=input_path(HERE), default=DEFAULT_PRESET, help="deployment preset")
    p.add_argument("--dtype", choices=sorted(DTYPES), help="overrides the preset's dtype")
    p.add_argument("--speculative-tokens", type=int, metavar="K", help="MTP speculative decoding with K drafts a "
                   "step from the checkpoint's MTP layer (overrides the preset's speculative.num_speculative_tokens; "
                   "0: off)")
    p.add_argument("--exe-mode", choices=EXE_MODES, help="graph: decode steps as graphs compiled at start-up; auto: "
                   "graph where a bucket's graph beats eager, timed on its first decode steps (over ranks: at "
                   "start-up) (overrides the preset's exe_mode; default: auto with --weights, eager on the tiny "
                   "checkpoint)")


def check_model_args(p: ArgumentParser, a: argparse.Namespace) -> None:
    """Validate --weights / --config, load the preset into a.preset, resolve a.dtype and a.layout; a preset of
    several ranks, run without torchrun: check that its layout splits the model, then run again under torchrun."""
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
    if unknown := sorted(set(a.preset) - {"dtype", "engine", "parallel", "speculative", "exe_mode", *NOT_YET}):
        p.error(f"--config {a.config.name}: unknown keys {unknown}")
    for key, what in NOT_YET.items():
        if a.preset.get(key) not in (None, "none", "eager", {}):
            p.error(f"--config {a.config.name}: {key}: {what} is not supported for Ling in this recipe yet")
    a.layout = parallel_layout(p, a)
    preset_dtype = a.preset.get("dtype", backend.AUTO)
    if preset_dtype not in DTYPES:
        p.error(f"--config {a.config.name}: dtype {preset_dtype!r}, expected one of {sorted(DTYPES)}")
    source = f"configs/{a.config.name}" if a.config.resolve().parent == HERE / "configs" else str(a.config)
    a.dtype, line = backend.resolve_dtype(a.dtype, preset_dtype, source)
    engine = a.preset.get("engine") or {}
    if "num_speculative_tokens" in engine or "exe_mode" in engine:
        p.error(f"--config {a.config.name}: set speculative: {{method: mtp, num_speculative_tokens: K}} and exe_mode "
                "at the top level of the preset (as upstream), not in engine")
    a.speculative_tokens = speculative_tokens(p, a)
    # --exe-mode > the preset's > auto (graph where a bucket's graph beats eager, as vLLM compiles unless told
    # --enforce-eager), but eager on the tiny random checkpoint: a demo of seconds, less than a cold compile
    a.exe_mode = a.exe_mode or a.preset.get("exe_mode") or ("eager" if a.weights is None else "auto")
    if a.exe_mode not in EXE_MODES:
        p.error(f"--config {a.config.name}: exe_mode {a.exe_mode!r}, expected one of {list(EXE_MODES)}")
    try:
        config, rest = EngineConfig.from_kwargs(**engine, num_speculative_tokens=a.speculative_tokens,
                                                exe_mode=a.exe_mode)
        if rest:
            raise ValueError(f"unknown engine settings {sorted(rest)}")
    except (ValueError, TypeError) as e:
        p.error(f"--config {a.config.name}: {e}")
    a.engine_config = config
    if a.layout.world_size > 1 and "WORLD_SIZE" not in os.environ:  # checked once, before the ranks start
        path = a.weights or ensure_tiny()
        try:
            modeling_ling.check_layout(config_ling.ModelArgs.from_config(Checkpoint(path).config), a.layout)
        except (CheckpointError, ValueError) as e:
            p.error(f"--config {a.config.name}: world_size {a.layout.world_size}: {e}")
        par.launch_ranks(a.layout.world_size)
    if os.environ.get("RANK", "0") == "0":
        print(line, flush=True)  # stdout, beside the run's other lines; stderr stays for errors
    if a.layout.world_size > 1 and int(os.environ["WORLD_SIZE"]) != a.layout.world_size:
        p.error(f"--config {a.config.name} is for {a.layout.world_size} ranks, but torchrun started "
                f"{os.environ['WORLD_SIZE']}")


def speculative_tokens(p: ArgumentParser, a: argparse.Namespace) -> int:
    """--speculative-tokens, else the preset's `speculative: {method: mtp, num_speculative_tokens: K}`, else 0."""
    spec = a.preset.get("speculative") or {}
    if not isinstance(spec, dict) or spec.get("method", "mtp") != "mtp" or set(spec) - {"method", "num_speculative_tokens"}:
        p.error(f"--config {a.config.name}: speculative must be {{method: mtp, num_speculative_tokens: K}}, got {spec!r}")
    k = a.speculative_tokens if a.speculative_tokens is not None else spec.get("num_speculative_tokens", 0)
    if not isinstance(k, int) or isinstance(k, bool) or not 0 <= k <= 7:
        p.error(f"speculative tokens must be an int in [0, 7], got {k!r}")
    return k


def parallel_layout(p: ArgumentParser, a: argparse.Namespace) -> par.LLMParallelLayout:
    """The preset's `parallel:` (upstream's names: world_size, attn_tp, moe_tp, embed_tp, lmhead_tp)."""
    spec = a.preset.get("parallel") or {}
    keys = [f.name for f in dataclasses.fields(par.LLMParallelLayout)]
    if not isinstance(spec, dict) or set(spec) - set(keys):
        p.error(f"--config {a.config.name}: parallel must map sizes {keys}, got {spec!r}")
    try:
        return par.LLMParallelLayout(**spec)
    except (ValueError, TypeError) as e:
        p.error(f"--config {a.config.name}: {e}")


def ensure_tiny() -> Path:
    """The tiny checkpoint, written (again) when missing or written by an older revision of tiny_ling."""
    if not tiny_ling.is_current(TINY):
        tiny_ling.write_tiny_checkpoint(TINY)
    return TINY


def load(a: argparse.Namespace):
    """(model, tokenizer, EngineConfig) for the parsed arguments; writes the tiny checkpoint on first use; joins
    the ranks of a multi-rank preset (this rank's slice of the model). Exits with a one-line message and code 2 for
    a missing / corrupt checkpoint or one that does not fit."""
    path = a.weights or ensure_tiny()
    try:
        args = config_ling.ModelArgs.from_config(Checkpoint(path).config)
        parallel = par.init_parallel(a.layout) if a.layout.world_size > 1 else None
        if parallel is None:  # refused here, with the arithmetic, rather than killed for memory later
            weights_ling.check_fits(args, a.dtype, backend.device())
        model = weights_ling.load_model(path, a.dtype, backend.device(), mtp=a.speculative_tokens > 0,
                                        parallel=parallel)  # the MTP layer only when it drafts
        return model, AutoTokenizer.from_pretrained(path), a.engine_config
    except (CheckpointError, ValueError, TypeError, OSError) as e:
        fail(e)


def fail(e: Exception | str) -> None:
    """Exit with code 2 and the reason on one line (no traceback)."""
    print("error: " + "; ".join(line.strip() for line in str(e).splitlines()), file=sys.stderr)
    sys.exit(2)
