"""Convert a DeepSeek-V4 checkpoint to integer weights, W8A8 or W4A8, or a DeepSeek-V3 / R1 / V3.2 / Kimi-K2
(MLA) one to W8A8, tensor by tensor.

    python recipes/deepseek/tools/convert_checkpoint.py --quant w8a8 /data/DeepSeek-V4-Flash /data/DeepSeek-V4-Flash-w8a8
    python recipes/deepseek/tools/convert_checkpoint.py --quant w4a8 --group-size 32 SRC DST
    python recipes/deepseek/tools/convert_checkpoint.py --quant w8a8 /data/DeepSeek-V3-0324 /data/DeepSeek-V3-0324-w8a8

The MLA family (config.json model_type deepseek_v3, deepseek_v32, kimi_k2; the Atlas 300I Duo / 310P deployment):
w8a8 only. Every linear of a decoder layer (MTP layers too) is int8 per output channel: q_a_proj / q_b_proj (or
q_proj), kv_a_proj_with_mqa, o_proj, the dense and shared MLPs' gate / up / down, the routed experts (per expert
`mlp.experts.N.*`, or transformers' stacked tensors). The publisher's FP8 (128 x 128 `weight_scale_inv`) is
dequantized to fp32, then rounded per channel (scale = amax / 127). kv_b_proj stays float, written as one bf16
tensor (not split per head): the absorbed attention reads its W_UK / W_UV halves as views of it, and an int8
scale per output channel would sit on W_UK's contracted dimension. The router, norms, embedding, head, MTP eh_proj
and V3.2's indexer are copied (FP8 ones dequantized to bf16).

SRC: the published checkpoint (FP8 linears with 128x128 block `.scale`, MXFP4 routed experts) or a bf16 / fp32 one,
in the publisher's naming or the transformers one (`model.`-prefixed, stacked `experts.gate_up_proj`); DST keeps
SRC's naming. Upstream's layer selection (hicann/cann-recipes-infer `utils/convert_model.py --quant_type`):
- w8a8: int8 weights, symmetric, one fp32 scale per output channel (amax over K / 127), on the attention `wq_b`
  (q_b_proj) and `wo_b` (o_b_proj), the indexer's `wq_b`, the routed experts and the shared expert;
- w4a8: the routed experts int4 (symmetric, amax of each group of `--group-size` inputs / 7), two values per int8
  byte along K, low nibble first; the shared expert and the attention / indexer projections int8 as in w8a8.
A quantized tensor `X` is stored as int8 `X` ([..., N, K] int8, [..., N, K/2] packed int4) plus fp32 `X_scale`
([..., N], or [..., N, K/G]): `X.weight` -> `X.weight_scale`, transformers' stacked `experts.gate_up_proj` ->
`experts.gate_up_proj_scale`. Every other tensor (norms, mHC, router, embedding, head, wq_a, wkv, wo_a,
compressors, the indexer's weights_proj, tid2eid) is copied as stored; the FP8 ones among them are written
dequantized, in bf16. The MTP layer (`mtp.0.*`) is a whole decoder block: its layers of those kinds are quantized
the same way. Activations are quantized at run time (int8, per token, dynamic); config.json says which names are
int8 / int4 (`quantization_config`). common.loader.quant has the helpers (quantize_int8_per_channel,
quantize_int4_per_group, dequantize_int).

Streaming: each tensor is read (and dequantized) alone, quantized and added to the shard being filled; a shard is
written once it reaches --max-shard-gib, so memory holds about one tensor plus one shard. Errors: one line on
stderr, exit code 2.
"""
from __future__ import annotations

import argparse
import json
import re
import shutil
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file
from tqdm import tqdm

from common.loader import Checkpoint, CheckpointError
from common.loader.checkpoint import FLOAT_DTYPES, INDEX
from common.loader.quant import quantize_int4_per_group, quantize_int8_per_channel

SHARD_GIB = 5.0
QUANT_METHOD = "npu-cookbook"
FORMATS = ("w8a8", "w4a8")
DEFAULT_GROUP_SIZE = 32
# each pattern names one kind of linear in one naming (publisher's, transformers'); re.search on a tensor name
ATTENTION = (r"\.attn\.wq_b\.weight$", r"\.attn\.wo_b\.weight$", r"\.attn\.indexer\.wq_b\.weight$",
             r"\.self_attn\.q_b_proj\.weight$", r"\.self_attn\.o_b_proj\.weight$",
             r"\.self_attn\.compressor\.indexer\.q_b_proj\.weight$")
SHARED = (r"\.ffn\.shared_experts\.w[123]\.weight$", r"\.mlp\.shared_experts\.(gate|up|down)_proj\.weight$")
ROUTED = (r"\.ffn\.experts\.\d+\.w[123]\.weight$", r"\.mlp\.experts\.(gate_up_proj|down_proj)$")
SCALE_SUFFIX = "_scale"
# the MLA family (DeepSeek-V3 / R1, V3.2, Kimi-K2): w8a8 on every linear of the layers except kv_b_proj
MLA_MODEL_TYPES = ("deepseek_v3", "deepseek_v32", "kimi_k2")
MLA_INT8 = (r"\.self_attn\.(q_proj|q_a_proj|q_b_proj|kv_a_proj_with_mqa|o_proj)\.weight$",
            r"\.mlp\.(shared_experts\.)?(gate|up|down)_proj\.weight$",
            r"\.mlp\.experts\.\d+\.(gate|up|down)_proj\.weight$", r"\.mlp\.experts\.(gate_up_proj|down_proj)$")
# weights files of the source, not copied; every other top-level file (tokenizer, generation config, ...) is
COPY_SKIP = re.compile(r"(\.safetensors|\.safetensors\.index\.json|\.bin|\.pt|\.pth)$|^config\.json$|^\.")


def selection(quant: str, model_type: str | None = None) -> dict[str, tuple[str, ...]]:
    """{"int8": patterns, "int4": patterns} of a format for a config.json model_type (DeepSeek-V4 by default)."""
    if model_type in MLA_MODEL_TYPES:
        if quant != "w8a8":
            raise ValueError(f"--quant {quant!r}: {model_type} (MLA) converts to w8a8 only")
        return {"int8": MLA_INT8, "int4": ()}
    if quant == "w8a8":
        return {"int8": ATTENTION + SHARED + ROUTED, "int4": ()}
    if quant == "w4a8":
        return {"int8": ATTENTION + SHARED, "int4": ROUTED}
    raise ValueError(f"--quant {quant!r}: expected one of {', '.join(FORMATS)}")


def plan(names, quant: str, model_type: str | None = None) -> dict[str, str | None]:
    """Tensor name -> "int8", "int4" or None (copied as stored)."""
    kinds = selection(quant, model_type)
    return {name: next((kind for kind, patterns in kinds.items() if any(re.search(p, name) for p in patterns)), None)
            for name in names}


def quantization_config(names, quant: str, group_size: int | None, model_type: str | None = None) -> dict:
    """config.json's entry; lists the patterns that name at least one tensor of this checkpoint."""
    used = {kind: [p for p in patterns if any(re.search(p, n) for n in names)]
            for kind, patterns in selection(quant, model_type).items()}
    weights = {"int8": used["int8"]} | ({"int4": used["int4"]} if quant == "w4a8" else {})
    return {"quant_method": QUANT_METHOD, "format": quant, "weights": weights,
            "group_size": group_size if quant == "w4a8" else None,
            "activations": "int8, per token, dynamic",
            "other_weights": "as stored; FP8 / MXFP4 ones dequantized to bf16",
            "scale_name": f"X -> X{SCALE_SUFFIX} (fp32)"}


def _has_scale(ckpt: Checkpoint, name: str) -> bool:
    """A scale companion Checkpoint.get dequantizes with (transformers' `_scale_inv`, the publisher's `.scale`)."""
    return name.endswith(".weight") and (f"{name}_scale_inv" in ckpt or name.removesuffix("weight") + "scale" in ckpt)


def convert_tensor(ckpt: Checkpoint, name: str, kind: str | None, group_size: int | None) -> dict[str, torch.Tensor]:
    """One source tensor -> its output tensors ({name: int8, name_scale: fp32} or {name: as stored})."""
    stored, scaled = ckpt.dtype(name), _has_scale(ckpt, name)
    where = f"{ckpt.file(name)}: tensor {name!r}"
    if kind is None:
        if scaled:
            return {name: ckpt.get(name, torch.float32).to(torch.bfloat16)}
        if stored.is_floating_point and stored not in FLOAT_DTYPES:
            raise CheckpointError(f"{where}: stored {stored} without a scale companion to dequantize it with")
        return {name: ckpt.get(name)}
    if not (scaled or stored in FLOAT_DTYPES):
        raise CheckpointError(f"{where}: stored {stored} without a scale companion to dequantize it with "
                              f"(an already converted checkpoint?)")
    w = ckpt.get(name, torch.float32)                                       # [..., N, K]
    try:
        q, scale = quantize_int8_per_channel(w) if kind == "int8" else quantize_int4_per_group(w, group_size)
    except ValueError as e:
        raise CheckpointError(f"{where} {list(w.shape)}: {e}") from None
    return {name: q, name + SCALE_SUFFIX: scale}


class ShardWriter:
    """Fills one shard at a time and writes it once the next group of tensors would take it over max_bytes (a group
    larger than that gets a shard of its own); close() names the shards model-0000i-of-0000n (or model.safetensors
    alone) and writes the index."""

    def __init__(self, path: Path, max_bytes: int):
        self.path, self.max_bytes = path, max_bytes
        self.pending: dict[str, torch.Tensor] = {}
        self.pending_bytes = self.total_bytes = 0
        self.files: list[Path] = []                 # written so far (partial names until close)
        self.weight_map: dict[str, int] = {}        # tensor name -> shard number

    def add(self, tensors: dict[str, torch.Tensor]) -> None:
        nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
        if self.pending and self.pending_bytes + nbytes > self.max_bytes:
            self.flush()
        for name, t in tensors.items():
            self.pending[name] = t.contiguous()
            self.weight_map[name] = len(self.files)
        self.pending_bytes += nbytes
        self.total_bytes += nbytes

    def flush(self) -> None:
        if not self.pending:
            return
        file = self.path / f"model-{len(self.files) + 1:05d}.safetensors.partial"
        save_file(self.pending, file, metadata={"format": "pt"})
        self.files.append(file)
        self.pending, self.pending_bytes = {}, 0

    def close(self) -> list[Path]:
        self.flush()
        n = len(self.files)
        final = [self.path / ("model.safetensors" if n == 1 else f"model-{i:05d}-of-{n:05d}.safetensors")
                 for i in range(1, n + 1)]
        for partial, file in zip(self.files, final):
            partial.rename(file)
        self.files = final
        if n > 1:
            index = {"metadata": {"total_size": self.total_bytes},
                     "weight_map": {name: final[i].name for name, i in self.weight_map.items()}}
            (self.path / INDEX).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
            self.files.append(self.path / INDEX)
        return self.files


def check_group_size(config: dict, quant: str, group_size: int | None) -> int | None:
    """The group size to use (w4a8: default 32; w8a8: None); ValueError if it does not split the routed experts' K."""
    if quant != "w4a8":
        if group_size is not None:
            raise ValueError(f"--group-size applies to w4a8 (int4 routed experts), not {quant}")
        return None
    group_size = DEFAULT_GROUP_SIZE if group_size is None else group_size
    ks = {"hidden_size": config.get("hidden_size"), "moe_intermediate_size": config.get("moe_intermediate_size")}
    if group_size < 1:
        raise ValueError(f"--group-size {group_size}: must be a positive divisor of the routed experts' K ({ks})")
    for key, k in ks.items():
        if isinstance(k, int) and (k % group_size or k % 2):
            raise ValueError(f"--group-size {group_size} does not divide {key} = {k}, the K of routed expert "
                             f"{'w1 / w3' if key == 'hidden_size' else 'w2'}")
    return group_size


def convert(src, dst, quant: str, group_size: int | None = None, max_shard_bytes: int = int(SHARD_GIB * 1024**3),
            progress: bool = True) -> Path:
    """Write the `quant` ("w8a8" | "w4a8") checkpoint of `src` into `dst` (new or empty). ValueError / CheckpointError
    (a ValueError) before anything is written for bad arguments; on a failure midway, what was written is removed."""
    src, dst = Path(src), Path(dst)
    selection(quant)
    ckpt = Checkpoint(src)
    model_type = ckpt.config.get("model_type")
    selection(quant, model_type)
    if dst.exists() and (not dst.is_dir() or any(dst.iterdir())):
        raise ValueError(f"{dst}: exists and is not an empty folder")
    old = ckpt.config.get("quantization_config") or {}
    if isinstance(old, dict) and old.get("quant_method") == QUANT_METHOD:
        raise ValueError(f"{src}: already a {old.get('format')} checkpoint of this converter")
    group_size = check_group_size(ckpt.config, quant, group_size)
    names = ckpt.names()
    kinds = plan(names, quant, model_type)
    config = {k: v for k, v in ckpt.config.items() if k != "quantization_config"}
    config["quantization_config"] = quantization_config(names, quant, group_size, model_type)
    copies = sorted(f for f in src.iterdir() if f.is_file() and not COPY_SKIP.search(f.name))

    created = not dst.exists()
    dst.mkdir(parents=True, exist_ok=True)
    writer, written = ShardWriter(dst, max_shard_bytes), []
    bar = tqdm(total=len(names), desc=f"{quant} {src.name}", unit="tensor", disable=not progress)
    try:
        for name in names:
            writer.add(convert_tensor(ckpt, name, kinds[name], group_size))   # the only tensors held: this one's
            bar.update()
        bar.close()
        written += writer.close()
        for f in copies:
            written.append(Path(shutil.copy2(f, dst / f.name)))
        (dst / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")  # last: DST is complete
    except BaseException:
        bar.leave = False  # cleared: the error is the one line left
        bar.close()
        for f in writer.files + written:
            f.unlink(missing_ok=True)
        if created and not any(dst.iterdir()):
            dst.rmdir()
        raise
    return dst


class ArgumentParser(argparse.ArgumentParser):
    def error(self, message):  # one line and exit code 2, no usage dump
        self.exit(2, f"{self.prog}: error: {message}\n")


def main(argv=None) -> int:
    p = ArgumentParser(prog="convert_checkpoint.py", description=__doc__.splitlines()[0])
    p.add_argument("--quant", required=True, choices=FORMATS, help="w8a8 or w4a8 (upstream's layer selection)")
    p.add_argument("src", type=Path, help="DeepSeek-V4 checkpoint folder (FP8 + MXFP4 as published, or bf16), or a "
                   "DeepSeek-V3 / R1 / V3.2 / Kimi-K2 one (FP8 as published, or bf16; w8a8)")
    p.add_argument("dst", type=Path, help="output folder (new, or empty)")
    p.add_argument("--group-size", type=int, help=f"w4a8: inputs per int4 scale (default {DEFAULT_GROUP_SIZE})")
    p.add_argument("--max-shard-gib", type=float, default=SHARD_GIB, help="output shard size cap")
    a = p.parse_args(argv)
    if not a.max_shard_gib > 0:
        p.error(f"--max-shard-gib {a.max_shard_gib}: must be positive")
    try:
        convert(a.src, a.dst, a.quant, a.group_size, max_shard_bytes=int(a.max_shard_gib * 1024**3))
    except (ValueError, OSError) as e:  # CheckpointError is a ValueError
        p.exit(2, f"{p.prog}: error: {' '.join(str(e).split())}\n")
    print(f"wrote {a.dst} ({a.quant})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
