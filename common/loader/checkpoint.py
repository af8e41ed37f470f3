"""An HF-layout checkpoint folder, read lazily tensor by tensor.

config.json plus model.safetensors, or shards listed in model.safetensors.index.json. Each file's header is checked
on first use; each read opens the file (safe_open, memory-mapped) for that tensor alone, so the pages a read touches
are let go with the tensor: loading holds the model plus one tensor, not the model plus every mapped page read.
Quantized weights come with a scale companion (`X.weight_scale_inv`, or the publisher's `X.scale`) that names()
hides and get(name, dtype) applies. get(name, dtype, shard=(dim, index, count)) reads one rank's part of a tensor
(safetensors slices: the part's data, plus the scale blocks that cover it); `reads` / `bytes_read` count what was read.
"""
import difflib
import json
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from .errors import CheckpointError
from .header import DTYPES, read_header
from .quant import FP8_BLOCK, MX_GROUP, QUANTIZED_DTYPES, dequant_fp8_block, dequant_mxfp4, dequantize

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
INDEX = "model.safetensors.index.json"


def read_json(file: Path) -> dict:
    if not file.is_file():
        raise CheckpointError(f"{file}: missing")
    try:
        data = json.loads(file.read_text())
    except ValueError as e:
        raise CheckpointError(f"{file}: not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{file}: not a JSON object")
    return data


class Checkpoint:
    def __init__(self, path):
        self.path = Path(path)
        if not self.path.is_dir():
            raise CheckpointError(f"{self.path}: no such checkpoint folder")
        self.config = read_json(self.path / "config.json")
        self._headers: dict[Path, dict] = {}
        self.reads: dict[str, int] = {}  # stored tensor name (scales too) -> bytes of data read so far
        if (self.path / INDEX).exists():
            weight_map = read_json(self.path / INDEX).get("weight_map")
            if not isinstance(weight_map, dict):
                raise CheckpointError(f"{self.path / INDEX}: no weight_map")
            self._files = {name: self.path / file for name, file in weight_map.items()}
            for file in sorted(set(self._files.values())):
                if not file.is_file():
                    name = next(n for n, f in self._files.items() if f == file)
                    raise CheckpointError(f"{self.path / INDEX}: shard {file.name} (holding tensor {name!r}) is missing")
        elif (self.path / "model.safetensors").is_file():
            single = self.path / "model.safetensors"
            self._files = dict.fromkeys(self._header(single), single)
        else:
            raise CheckpointError(f"{self.path}: no model.safetensors or {INDEX}")

    def names(self) -> list[str]:
        """Logical tensor names, shard by shard; scale companions are left out."""
        hidden = {self._scale_name(name) for name in self._files}
        return sorted((n for n in self._files if n not in hidden), key=lambda n: (self._files[n], n))

    def __contains__(self, name: str) -> bool:
        return name in self._files

    def file(self, name: str) -> Path:
        if name not in self._files:
            near = difflib.get_close_matches(name, self._files, n=3)
            raise CheckpointError(f"{self.path}: no tensor named {name!r}" + (f" (close: {near})" if near else ""))
        return self._files[name]

    def shape(self, name: str) -> torch.Size:
        """As stored in the file (a packed MXFP4 weight is [N, K/2])."""
        return torch.Size(self._entry(name)["shape"])

    def dtype(self, name: str) -> torch.dtype:
        """As stored in the file."""
        dtype = self._entry(name)["dtype"]
        if dtype not in DTYPES:
            raise CheckpointError(f"{self.file(name)}: tensor {name!r} has dtype {dtype}, which torch cannot hold")
        return DTYPES[dtype]

    @property
    def bytes_read(self) -> int:
        """Bytes of tensor data (data + scales) read from the files so far."""
        return sum(self.reads.values())

    def get(self, name: str, dtype: torch.dtype | None = None,
            shard: tuple[int, int, int] | None = None) -> torch.Tensor:
        """The stored tensor; with a float dtype, a quantized weight is dequantized through its scale companion.

        shard = (dim, index, count): part `index` of `count` equal parts along `dim` of that same result (the logical,
        dequantized tensor when dequantizing), equal to get(name, dtype) sliced so; only that part is read.
        """
        scale_name = self._scale_name(name)
        if not (dtype in FLOAT_DTYPES and scale_name and self.dtype(name) in QUANTIZED_DTYPES):
            part = None if shard is None else self._part(name, self.shape(name), shard)
            tensor = self._read(name, part)
            return tensor if dtype is None else tensor.to(dtype)
        if shard is not None:
            return self._get_quantized_part(name, scale_name, dtype, shard)
        try:
            return dequantize(self._read(name), self._read(scale_name), dtype)
        except ValueError as e:
            raise CheckpointError(f"{self.file(name)}: tensor {name!r}: {e}") from None

    def close(self):
        """Nothing stays open between reads (kept for callers that close a checkpoint)."""

    def _scale_name(self, name: str) -> str | None:
        if name.endswith(".weight"):
            for scale_name in (name + "_scale_inv", name.removesuffix("weight") + "scale"):
                if scale_name in self._files:
                    return scale_name
        return None

    def _header(self, file: Path) -> dict:
        if file not in self._headers:
            self._headers[file] = read_header(file)
        return self._headers[file]

    def _entry(self, name: str) -> dict:
        file = self.file(name)
        try:
            header = self._header(file)
        except CheckpointError as e:
            raise CheckpointError(f"{e} (reading tensor {name!r})") from None
        if name not in header:
            raise CheckpointError(f"{file}: tensor {name!r} is listed in {INDEX} but absent from the file")
        return header[name]

    def _part(self, name: str, shape: torch.Size, shard) -> tuple[int, int, int]:
        """shard (dim, index, count) of a tensor of (logical) `shape` -> (dim, begin, end) along that dim."""
        dim, index, count = shard
        if not (-len(shape) <= dim < len(shape) and 0 <= index < count):
            raise CheckpointError(f"{self.file(name)}: tensor {name!r} {list(shape)}: no shard {tuple(shard)} "
                                  f"(dim, index, count)")
        dim %= len(shape)
        if shape[dim] % count:
            raise CheckpointError(f"{self.file(name)}: tensor {name!r} {list(shape)}: dim {dim} of size {shape[dim]} "
                                  f"does not split into {count} equal parts")
        size = shape[dim] // count
        return dim, index * size, (index + 1) * size

    def _get_quantized_part(self, name: str, scale_name: str, dtype: torch.dtype, shard) -> torch.Tensor:
        """A part of a dequantized weight: the stored data of the part itself, the scale blocks that cover it."""
        shape, scale_shape, where = self.shape(name), self.shape(scale_name), f"{self.file(name)}: tensor {name!r}"
        if self.dtype(name) == torch.float8_e4m3fn:                                 # [N, K], scale [N/128, K/128]
            need = [-(-n // FP8_BLOCK) for n in shape]
            if len(shape) != 2 or list(scale_shape) != need:
                raise CheckpointError(f"{where}: fp8 weight {list(shape)} needs a {need} block scale, "
                                      f"got {list(scale_shape)}")
            logical, blocks, packed = shape, (FP8_BLOCK, FP8_BLOCK), None
        elif scale_shape[:-1] == shape[:-1] and scale_shape[-1] * MX_GROUP == shape[-1] * 2:  # [..., K/2], [..., K/32]
            logical, packed = torch.Size([*shape[:-1], shape[-1] * 2]), len(shape) - 1
            blocks = (1,) * packed + (MX_GROUP,)
        else:
            raise CheckpointError(f"{where}: no dequantization for a {self.dtype(name)} {list(shape)} weight "
                                  f"with a {list(scale_shape)} scale")
        dim, begin, end = self._part(name, logical, shard)
        step, block = (2 if dim == packed else 1), blocks[dim]
        if begin % step or end % step:
            raise CheckpointError(f"{where} {list(logical)}: shard {tuple(shard)} splits dim {dim} at odd columns "
                                  f"[{begin}, {end}); MXFP4 packs two values per byte")
        w = self._read(name, (dim, begin // step, end // step))
        scale = self._read(scale_name, (dim, begin // block, -(-end // block)))     # covering blocks
        offset = begin % block                                                      # of the part in its first block
        try:
            if packed is None:
                return dequant_fp8_block(w, scale, dtype, offset=(offset, 0) if dim == 0 else (0, offset))
            return dequant_mxfp4(w, scale, dtype, offset=offset)
        except ValueError as e:
            raise CheckpointError(f"{where}: {e}") from None

    def _read(self, name: str, part: tuple[int, int, int] | None = None) -> torch.Tensor:
        """The whole stored tensor, or part = (dim, begin, end) of it, read as a safetensors slice."""
        self._entry(name)
        file = self._files[name]
        try:
            with safe_open(file, framework="pt") as handle:
                if part is None:
                    tensor = handle.get_tensor(name)
                else:
                    dim, begin, end = part
                    tensor = handle.get_slice(name)[(slice(None),) * dim + (slice(begin, end),)]
        except SafetensorError as e:
            raise CheckpointError(f"{file}: cannot read tensor {name!r}: {e}") from None
        self.reads[name] = self.reads.get(name, 0) + tensor.numel() * tensor.element_size()
        return tensor
