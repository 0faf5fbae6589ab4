"""What two engines compare to know they run the same weights: a cheap fingerprint of the files.

Snapshots on disk record it (a load into an engine with other weights is refused) and a launch
group compares it across processes at start-up.
"""
from __future__ import annotations

import hashlib
import json
import struct
from pathlib import Path

from jtp.errors import ConfigError
from jtp.loading.weights import ORBAX_SUBDIR

_SAMPLE_BYTES = 4096  # bytes hashed from the middle of every tensor
_FILE_SAMPLE_BYTES = 1 << 16  # bytes hashed at the head, middle and tail of non-safetensors weight files


def weights_fingerprint(model_dir: str | Path) -> str:
    """A cheap fingerprint of a model directory's weights: every safetensors file's name, size and
    header (tensor names, dtypes, shapes, offsets), plus 4 KiB from the middle of every tensor, so
    a fine-tune of the same architecture differs. An Orbax model directory (`jtp convert`) is
    fingerprinted by its files' names, sizes and head/middle/tail bytes. Reads a few KiB per tensor."""
    model_dir = Path(model_dir)
    h = hashlib.blake2b(digest_size=16)
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        files = sorted({model_dir / f for f in json.loads(index.read_text())["weight_map"].values()})
    else:
        files = sorted(model_dir.glob("*.safetensors"))
    if files:
        for file in files:
            with open(file, "rb") as f:
                (n,) = struct.unpack("<Q", f.read(8))
                header = f.read(n)
                h.update(file.name.encode() + b"\0" + str(file.stat().st_size).encode() + b"\0" + header)
                tensors = json.loads(header)
                spans = sorted(v["data_offsets"] for k, v in tensors.items() if k != "__metadata__")
                for begin, end in spans:
                    size = min(_SAMPLE_BYTES, end - begin)
                    f.seek(8 + n + begin + (end - begin - size) // 2)
                    h.update(f.read(size))
        return h.hexdigest()
    orbax = model_dir / ORBAX_SUBDIR
    if orbax.is_dir():
        for file in sorted(p for p in orbax.rglob("*") if p.is_file()):
            size = file.stat().st_size
            h.update(str(file.relative_to(orbax)).encode() + b"\0" + str(size).encode() + b"\0")
            with open(file, "rb") as f:
                for at in sorted({0, max(0, size // 2 - _FILE_SAMPLE_BYTES // 2), max(0, size - _FILE_SAMPLE_BYTES)}):
                    f.seek(at)
                    h.update(f.read(_FILE_SAMPLE_BYTES))
        return h.hexdigest()
    raise ConfigError(f"{model_dir}: no safetensors or Orbax weights to fingerprint")


def weights_identity(model_dir: str | Path, load_format: str) -> str:
    """What a snapshot or a group compares to know two engines run the same weights: the files'
    fingerprint, or "dummy" (--load-format dummy draws them from the config alone: no files)."""
    return "dummy" if load_format == "dummy" else weights_fingerprint(model_dir)
