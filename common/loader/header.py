"""The safetensors file header, parsed and checked against the file size before any tensor is read.

Layout: 8 bytes little-endian header length n, n bytes of JSON {name: {dtype, shape, data_offsets}}, then the data;
data_offsets are relative to byte 8 + n and the last tensor ends exactly at the end of the file.
"""
import json
import math
import struct
from pathlib import Path

import torch

from .errors import CheckpointError

DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
    "U64": torch.uint64, "U32": torch.uint32, "U16": torch.uint16, "U8": torch.uint8, "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}
if hasattr(torch, "float8_e8m0fnu"):
    DTYPES["F8_E8M0"] = torch.float8_e8m0fnu


def read_header(file: Path) -> dict[str, dict]:
    """{tensor name: {"dtype", "shape", "data_offsets"}} of one safetensors file, or CheckpointError."""
    size = file.stat().st_size
    with open(file, "rb") as f:
        head = f.read(8)
        n = struct.unpack("<Q", head)[0] if len(head) == 8 else None
        if n is None or n > size - 8:
            raise CheckpointError(f"{file}: truncated or corrupt safetensors file: header does not fit in {size} bytes")
        try:
            header = json.loads(f.read(n))
        except ValueError as e:  # JSONDecodeError and UnicodeDecodeError
            raise CheckpointError(f"{file}: corrupt safetensors header: {e}") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{file}: corrupt safetensors header: not a JSON object")
    header.pop("__metadata__", None)
    last, end = None, 0
    for name, entry in header.items():
        try:
            dtype, shape, (begin, stop) = entry["dtype"], entry["shape"], entry["data_offsets"]
            nbytes = math.prod(shape) * DTYPES[dtype].itemsize if dtype in DTYPES else stop - begin
            ok = all(isinstance(d, int) and d >= 0 for d in shape) and 0 <= begin <= stop and stop - begin == nbytes
        except (TypeError, KeyError, ValueError):
            ok = False
        if not ok:
            raise CheckpointError(f"{file}: corrupt safetensors header: tensor {name!r} has entry {entry!r}")
        if stop >= end:
            last, end = name, stop
    if 8 + n + end != size:
        raise CheckpointError(f"{file}: truncated or corrupt safetensors file: tensor {last!r} ends at byte "
                              f"{8 + n + end} but the file has {size} bytes")
    return header
