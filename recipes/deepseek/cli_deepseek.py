"""What the recipe's command lines share: one-line argument errors, presets, the default tiny checkpoint, and the
launch of a multi-rank preset: checked here, then the same command again under torchrun, one process a rank."""
from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from pathlib import Path

import yaml
from common.cli_paths import input_path
from common import backend
from common import parallel as par
from common.engine import EngineConfig
from common.engine.config import EXE_MODES
from common.loader import Checkpoint, CheckpointError
from common.offload import HOST_BACKENDS, PLACEMENTS, MoEOffloadConfig
from model_family import DEFAULT_FAMILY, FAMILIES, family_of_config, load_tokenizer

HERE = Path(__file__).resolve().parent
DEFAULT_PRESET = HERE / "configs" / "tiny-cpu.yaml"
# --dtype / a preset's dtype; auto (also a preset without one): backend.default_dtype(), which follows the device
DTYPES = {backend.AUTO: None, **backend.DTYPES}


class ArgumentParser(argparse.ArgumentParser):
    def error(self, message):  # one line and exit code 2, no usage dump
        self.exit(2, f"{self.prog}: error: {message}\n")


def add_model_args(p: ArgumentParser) -> None:
    p.add_argument("--weights", type=input_path(HERE), help="checkpoint folder (default: the tiny random checkpoint)")
    p.add_argument("--model", choices=sorted(FAMILIES), help="which model's tiny checkpoint runs without --weights "
                   f"(default: the preset's model, else {DEFAULT_FAMILY}); with --weights, config.json's model_type "
                   "decides")
    p.add_argument("--config", type=input_path(HERE), default=DEFAULT_PRESET, help="deployment preset")
    p.add_argument("--dtype", choices=sorted(DTYPES), help="overrides the preset's dtype")
    p.add_argument("--speculative-tokens", type=int, metavar="K", help="MTP speculative decoding with K drafts a "
                   "step (overrides the preset's speculative.num_speculative_tokens; 0: off)")
    p.add_argument("--exe-mode", choices=EXE_MODES, help="graph: decode steps as graphs compiled at start-up; auto: "
                   "graph where a bucket's graph beats eager, timed on its first decode steps (over ranks: at "
                   "start-up) (overrides the preset's exe_mode; default: auto with --weights, eager on the tiny "
                   "checkpoint)")
    g = p.add_argument_group("MoE offload (overrides the preset's moe_offload)")
    g.add_argument("--offload-experts", type=int, metavar="N", help="N resident experts per MoE layer on the "
                   "device, the others computed on the host CPU in MXFP4 (one process)")
    g.add_argument("--placement", choices=PLACEMENTS, help="which experts are resident (default prefix)")
    g.add_argument("--frequency-file", type=input_path(HERE), metavar="PATH", help="routing counts (generate.py "
                   "--record-routing) for placement frequency, or dynamic's start")
    g.add_argument("--host-backend", choices=HOST_BACKENDS, help="torch (exact, default) or kt (kt-kernel)")


def check_model_args(p: ArgumentParser, a: argparse.Namespace) -> None:
    """Validate --weights / --config, load the preset into a.preset and resolve a.dtype."""
    if a.weights is not None and not a.weights.is_dir():
        p.error(f"--weights {a.weights}: no such directory")
    read_preset(p, a)
    a.family = model_family(p, a)
    if a.preset.get("quantization", "none") not in ("none", "w8a8", "w4a8"):
        p.error(f"--config {a.config.name}: quantization {a.preset['quantization']!r}, expected none, w8a8 or w4a8")
    a.layout = parallel_layout(p, a)
    preset_dtype = a.preset.get("dtype", backend.AUTO)  # --dtype > the preset's dtype > auto (follows the device)
    if preset_dtype not in DTYPES:
        p.error(f"--config {a.config.name}: dtype {preset_dtype!r}, expected one of {sorted(DTYPES)}")
    source = f"configs/{a.config.name}" if a.config.resolve().parent == HERE / "configs" else str(a.config)
    a.dtype, line = backend.resolve_dtype(a.dtype, preset_dtype, source)
    a.speculative_tokens = speculative_tokens(p, a)
    if "num_speculative_tokens" in (a.preset.get("engine") or {}):
        p.error(f"--config {a.config.name}: set speculative decoding as speculative: {{method: mtp, "
                "num_speculative_tokens: K}, not in engine")
    if "exe_mode" in (a.preset.get("engine") or {}):
        p.error(f"--config {a.config.name}: set exe_mode at the top level of the preset (as upstream), not in engine")
    a.offload = moe_offload(p, a)
    a.exe_mode = a.exe_mode or a.preset.get("exe_mode") or default_exe_mode(a)  # --exe-mode > the preset's
    if a.exe_mode not in EXE_MODES:
        p.error(f"--config {a.config.name}: exe_mode {a.exe_mode!r}, expected one of {list(EXE_MODES)}")
    if a.offload is not None and not a.family.supports_offload:
        p.error(f"MoE offload serves DeepSeek-V4's MXFP4 experts; {a.family.name} has none")
    if a.offload is not None and a.exe_mode != "eager" and backend.device_type() != "cpu":
        p.error(f"MoE offload in graph (or auto) mode runs on CPU (torch.compile); on {backend.device_type()} a captured "
                "graph would replay without the host experts' call: use --exe-mode eager")
    if a.offload is not None and a.offload.placement == "dynamic" and a.layout.moe_ep > 1:
        p.error(f"MoE offload placement dynamic runs on one process (moe_ep 1); --config {a.config.name} has moe_ep "
                f"{a.layout.moe_ep}: use placement prefix or frequency (each rank places its own experts)")
    try:
        EngineConfig.from_kwargs(**(a.preset.get("engine") or {}))  # checked before any rank starts
    except (ValueError, TypeError) as e:
        p.error(f"--config {a.config.name}: {e}")
    if a.layout.world_size > 1 and "WORLD_SIZE" not in os.environ:
        path = a.weights or a.family.ensure_tiny()  # once, before the ranks start
        try:
            args = a.family.model_args(Checkpoint(path).config)
            a.family.check_layout(args, a.layout)
            if a.offload is not None:  # (a family that offloads: checked before)
                a.family.check_offload(args, a.layout, a.offload.resident_experts)
            check_quantization(a, args, path)
        except (CheckpointError, ValueError) as e:
            p.error(f"--config {a.config.name}: {e}")
        par.launch_ranks(a.layout.world_size)
    if os.environ.get("RANK", "0") == "0":
        print(line, flush=True)  # stdout, beside the run's other lines; stderr stays for errors
    if a.layout.world_size > 1 and int(os.environ["WORLD_SIZE"]) != a.layout.world_size:
        p.error(f"--config {a.config.name} is for {a.layout.world_size} ranks, but torchrun started "
                f"{os.environ['WORLD_SIZE']}")


def default_exe_mode(a: argparse.Namespace) -> str:
    """The mode where neither --exe-mode nor the preset names one: auto, graph where a bucket's graph beats eager
    (as vLLM compiles unless told --enforce-eager); eager where compiling costs more than a run or no graph runs:
    the tiny random checkpoint (a demo of seconds: 5 s eager against 104 s with a cold compile, Xeon), MoE offload
    off the CPU (a captured graph would replay without the host experts' call) and generate.py --record-routing
    (counts in eager steps)."""
    if a.weights is None or getattr(a, "record_routing", None) is not None:  # (serve.py has no --record-routing)
        return "eager"
    return "eager" if a.offload is not None and backend.device_type() != "cpu" else "auto"


def model_family(p: ArgumentParser, a: argparse.Namespace):
    """--weights' config.json model_type, else --model, else the preset's `model:`, else DEFAULT_FAMILY."""
    named = a.model or a.preset.get("model")
    if named is not None and named not in FAMILIES:
        p.error(f"--config {a.config.name}: model {named!r}, expected one of {sorted(FAMILIES)}")
    if a.weights is None:
        return FAMILIES[named or DEFAULT_FAMILY]
    try:
        family = family_of_config(Checkpoint(a.weights).config)
    except (CheckpointError, ValueError) as e:
        p.error(f"--weights {a.weights}: {e}")
    if a.model is not None and a.model != family.name:
        p.error(f"--model {a.model}, but --weights {a.weights} holds {family.name}")
    return family


def speculative_tokens(p: ArgumentParser, a: argparse.Namespace) -> int:
    """--speculative-tokens, else the preset's `speculative: {method: mtp, num_speculative_tokens: K}`, else 0."""
    spec = a.preset.get("speculative") or {}
    if not isinstance(spec, dict) or spec.get("method", "mtp") != "mtp" or set(spec) - {"method", "num_speculative_tokens"}:
        p.error(f"--config {a.config.name}: speculative must be {{method: mtp, num_speculative_tokens: K}}, got {spec!r}")
    k = a.speculative_tokens if a.speculative_tokens is not None else spec.get("num_speculative_tokens", 0)
    if not isinstance(k, int) or isinstance(k, bool) or not 0 <= k <= 7:
        p.error(f"speculative tokens must be an int in [0, 7], got {k!r}")
    return k


def moe_offload(p: ArgumentParser, a: argparse.Namespace) -> MoEOffloadConfig | None:
    """The preset's `moe_offload: {resident_experts: N, placement, frequency_file, host_backend}` with the flags
    over it (--offload-experts N alone turns it on); None: every expert resident."""
    spec = a.preset.get("moe_offload")
    if spec is not None and not isinstance(spec, dict):
        p.error(f"--config {a.config.name}: moe_offload must be a mapping, got {spec!r}")
    spec = dict(spec or {})
    flags = {"resident_experts": a.offload_experts, "placement": a.placement, "host_backend": a.host_backend,
             "frequency_file": None if a.frequency_file is None else str(a.frequency_file)}
    given = {k: v for k, v in flags.items() if v is not None}
    if not spec and not given:
        return None
    if not spec and "resident_experts" not in given:
        p.error(f"--{next(iter(given)).replace('_', '-')} needs --offload-experts N (or a preset's moe_offload)")
    spec.update(given)
    try:
        return MoEOffloadConfig.from_dict(spec)
    except (ValueError, TypeError) as e:
        p.error(str(e))


def read_preset(p: ArgumentParser, a: argparse.Namespace) -> None:
    """a.config -> a.preset (a mapping), or one line and exit code 2."""
    if not a.config.is_file():
        p.error(f"--config {a.config}: no such file")
    try:
        a.preset = yaml.safe_load(a.config.read_text()) or {}
    except yaml.YAMLError as e:
        p.error(f"--config {a.config}: not valid YAML ({str(e).splitlines()[0]})")
    if not isinstance(a.preset, dict):
        p.error(f"--config {a.config}: expected a mapping")


PARALLEL_KEYS = ("world_size", "attn_tp", "moe_tp", "embed_tp", "lmhead_tp")


def parallel_layout(p: ArgumentParser, a: argparse.Namespace) -> par.LLMParallelLayout:
    """The preset's `parallel:` (upstream's names: world_size, attn_tp, moe_tp, embed_tp, lmhead_tp)."""
    spec = a.preset.get("parallel") or {}
    unknown = sorted(set(spec) - set(PARALLEL_KEYS))
    if unknown:
        p.error(f"--config {a.config.name}: unknown parallel sizes {unknown}; expected {list(PARALLEL_KEYS)}")
    try:
        return par.LLMParallelLayout(**spec)
    except (ValueError, TypeError) as e:
        p.error(f"--config {a.config.name}: {e}")


def load(a: argparse.Namespace):
    """(model, tokenizer, EngineConfig) for the parsed arguments; writes the tiny checkpoint on first use; joins
    the ranks of a multi-rank preset (this rank's slice of the model). Exits with a one-line message and code 2
    for a missing / corrupt checkpoint or a bad preset."""
    family = a.family
    path = a.weights or family.ensure_tiny()  # the tiny one: (re)written when missing or out of date
    try:
        config, rest = EngineConfig.from_kwargs(**(a.preset.get("engine") or {}))
        if rest:
            raise ValueError(f"unknown engine settings in {a.config.name}: {sorted(rest)}")
        config = dataclasses.replace(config, num_speculative_tokens=a.speculative_tokens, exe_mode=a.exe_mode)
        parallel = par.init_parallel(a.layout) if a.layout.world_size > 1 else None
        mtp = a.speculative_tokens > 0
        args = family.model_args(Checkpoint(path).config)
        try:
            check_quantization(a, args, path)
        except ValueError as e:
            raise ValueError(f"--config {a.config.name}: {e}") from None
        offload = {} if a.offload is None else {"offload": a.offload, "max_tokens": config.max_num_batched_tokens}
        if a.layout.world_size == 1:  # refused here, with the arithmetic, rather than killed for memory later
            family.check_fits(args, a.dtype, backend.device(), mtp,
                              **({"offload_slots": a.offload.resident_experts} if a.offload else {}))
        model = family.load_model(path, a.dtype, backend.device(), parallel=parallel, mtp=mtp, **offload)
        return model, load_tokenizer(path), config
    except (CheckpointError, ValueError, TypeError, OSError) as e:
        fail(e)


def check_quantization(a: argparse.Namespace, args, path) -> None:
    """The preset's `quantization:` (none | w8a8 | w4a8) names the weights format it was sized for: ValueError
    when the checkpoint holds another (convert_checkpoint.py writes the quantized ones)."""
    expected = a.preset.get("quantization")
    held = args.quant_format or "none"
    if expected is not None and expected != held:
        name = {"none": "float"}
        raise ValueError(f"the preset runs {name.get(expected, expected)} weights, but {path} holds "
                         f"{name.get(held, held)} weights" + (f" (convert it: python tools/convert_checkpoint.py --quant "
                                                               f"{expected} SRC DST)" if expected != "none" else ""))


def fail(e: Exception | str) -> None:
    """Exit with code 2 and the reason on one line (no traceback)."""
    print("error: " + "; ".join(line.strip() for line in str(e).splitlines()), file=sys.stderr)
    sys.exit(2)
