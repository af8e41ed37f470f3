"""An HF-layout checkpoint folder, read lazily tensor by tensor.

config.json plus model.safetensors, or shards listed in model.safetensors.index.json. Each file's header is checked
on first use, then the file is opened once (safe_open, memory-mapped) and tensors are copied out one at a time.
Quantized weights come with a scale companion (`X.weight_scale_inv`, or the publisher's `X.scale`) that names()
hides and get(name, dtype) applies.
"""
import difflib
import json
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from .errors import CheckpointError
from .header import DTYPES, read_header
from .quant import dequantize, is_quantized

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
        self._handles: dict[Path, object] = {}
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

    def get(self, name: str, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The stored tensor; with a float dtype, a quantized weight is dequantized through its scale companion."""
        tensor = self._read(name)
        scale_name = self._scale_name(name)
        if dtype in FLOAT_DTYPES and scale_name and is_quantized(tensor):
            try:
                return dequantize(tensor, self._read(scale_name), dtype)
            except ValueError as e:
                raise CheckpointError(f"{self.file(name)}: tensor {name!r}: {e}") from None
        return tensor if dtype is None else tensor.to(dtype)

    def close(self):
        self._handles.clear()

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

    def _read(self, name: str) -> torch.Tensor:
        self._entry(name)
        file = self._files[name]
        try:
            if file not in self._handles:
                self._handles[file] = safe_open(file, framework="pt")
            return self._handles[file].get_tensor(name)
        except SafetensorError as e:
            raise CheckpointError(f"{file}: cannot read tensor {name!r}: {e}") from None
