"""A safetensors file's header, checked against its bytes before anything reads a tensor.

The format (https://github.com/huggingface/safetensors): 8 bytes of little-endian header length,
that many bytes of JSON {name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {...}},
then the data. Each tensor's bytes must be exactly prod(shape) * itemsize(dtype) and lie inside
the file, so a header that lies about a dtype or a shape is refused here, naming the file and the
tensor, instead of being read as other numbers.
"""

from __future__ import annotations

import dataclasses
import json
import math
import struct
from pathlib import Path

from jtp.errors import CheckpointError

# Bytes per element of every dtype the format defines.
ITEMSIZE = {
    "BOOL": 1, "U8": 1, "I8": 1, "F8_E5M2": 1, "F8_E4M3": 1,
    "I16": 2, "U16": 2, "F16": 2, "BF16": 2,
    "I32": 4, "U32": 4, "F32": 4,
    "I64": 8, "U64": 8, "F64": 8,
}
FLOAT_DTYPES = frozenset({"F16", "BF16", "F32", "F64"})  # what model weights can be
MAX_HEADER_BYTES = 100 << 20  # the safetensors library's own limit


@dataclasses.dataclass(frozen=True)
class TensorInfo:
    dtype: str
    shape: tuple[int, ...]
    begin: int  # byte offsets into the data section
    end: int


def read_header(path: str | Path) -> dict[str, TensorInfo]:
    """The tensors of one safetensors file, each one's dtype, shape and byte range checked."""
    path = Path(path)
    size = path.stat().st_size
    with open(path, "rb") as f:
        prefix = f.read(8)
        if len(prefix) < 8:
            raise CheckpointError(f"{path}: not a safetensors file (only {len(prefix)} bytes)")
        (header_len,) = struct.unpack("<Q", prefix)
        if header_len > min(MAX_HEADER_BYTES, size - 8):
            raise CheckpointError(f"{path}: header length {header_len} does not fit in the file ({size} bytes)")
        raw = f.read(header_len)
    try:
        header = json.loads(raw)
    except ValueError as e:
        raise CheckpointError(f"{path}: the safetensors header is not valid JSON ({e})") from e
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: the safetensors header is not a JSON object")
    data_bytes = size - 8 - header_len
    return {name: _tensor_info(path, name, entry, data_bytes)
            for name, entry in header.items() if name != "__metadata__"}


def _tensor_info(path: Path, name: str, entry, data_bytes: int) -> TensorInfo:
    where = f"{path}: tensor {name!r}"
    if not isinstance(entry, dict):
        raise CheckpointError(f"{where}: its header entry is not an object")
    dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
    if dtype not in ITEMSIZE:
        raise CheckpointError(f"{where}: unknown dtype {dtype!r}")
    if not _int_list(shape) or any(n < 0 for n in shape):
        raise CheckpointError(f"{where}: shape {shape!r} is not a list of non-negative integers")
    if not _int_list(offsets) or len(offsets) != 2 or not 0 <= offsets[0] <= offsets[1]:
        raise CheckpointError(f"{where}: data_offsets {offsets!r} are not [begin, end]")
    begin, end = offsets
    if end > data_bytes:
        raise CheckpointError(f"{where}: bytes [{begin}, {end}) lie past the end of the data ({data_bytes} bytes; "
                              "a truncated file?)")
    want = math.prod(shape) * ITEMSIZE[dtype]
    if end - begin != want:
        raise CheckpointError(f"{where}: {end - begin} bytes stored, but {dtype} of shape {list(shape)} "
                              f"needs {want}")
    return TensorInfo(dtype, tuple(shape), begin, end)


def _int_list(value) -> bool:
    return isinstance(value, list) and all(isinstance(v, int) and not isinstance(v, bool) for v in value)
