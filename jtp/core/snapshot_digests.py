"""Digests that tie a saved snapshot directory together: one per array file, one over the metadata.

A save records the BLAKE2b digest of every file Orbax wrote under `arrays/` in snapshots.json,
then seals snapshots.json with a digest of its own contents. A load checks both before it reads
a page, so arrays copied from another save (even one of the same block count, whose shapes match)
and a hand-edited or truncated metadata file are refused, naming the file, instead of registering
another prefix's K/V under these tokens' keys and poisoning the prefix cache.

They catch corruption and mix-ups, not forgery: whoever can write the directory can recompute
them. Keep snapshot directories writable by the serving user alone (docs/security.md).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from jtp.errors import ConfigError

ALGORITHM = "blake2b"
SEAL_KEY = "digest"  # snapshots.json's digest of everything else in it
FILES_KEY = "files"  # relative path under the snapshot directory -> digest of its bytes


def file_digest(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, ALGORITHM).hexdigest()


def tree_digests(root: Path, under: str) -> dict[str, str]:
    """The digest of every file below root/under, keyed by its path relative to root."""
    base = root / under
    if not base.is_dir():
        return {}
    return {p.relative_to(root).as_posix(): file_digest(p) for p in sorted(base.rglob("*")) if p.is_file()}


def metadata_digest(metadata: dict[str, Any]) -> str:
    """Over the metadata's canonical JSON, its own seal left out."""
    body = {k: v for k, v in metadata.items() if k != SEAL_KEY}
    text = json.dumps(body, sort_keys=True, separators=(",", ":"), allow_nan=False)
    return hashlib.new(ALGORITHM, text.encode()).hexdigest()


def seal(metadata: dict[str, Any], root: Path, under: str) -> dict[str, Any]:
    """The metadata with the digests of the files below root/under and its own seal added."""
    sealed = {**metadata, FILES_KEY: tree_digests(root, under)}
    sealed[SEAL_KEY] = metadata_digest(sealed)
    return sealed


def check_seal(metadata: dict[str, Any], file: Path) -> None:
    if metadata.get(SEAL_KEY) != metadata_digest(metadata):
        raise ConfigError(f"{file}: its contents do not match its digest (edited or corrupt since it was saved)")


def check_files(metadata: dict[str, Any], metadata_file: Path, under: str) -> None:
    """Every file below under/ (beside metadata_file) is one the save wrote, byte for byte, and none is missing."""
    root = metadata_file.parent
    expected = metadata[FILES_KEY]
    base = root / under
    present = sorted(p for p in base.rglob("*") if p.is_file()) if base.is_dir() else []
    for path in present:
        name = path.relative_to(root).as_posix()
        if name not in expected:
            raise ConfigError(f"{path}: not written by the save that wrote {metadata_file} "
                              "(copied from another save?)")
        if file_digest(path) != expected[name]:
            raise ConfigError(f"{path}: its bytes do not match the digest in {metadata_file} "
                              "(corrupt, or copied from another save)")
    names = {p.relative_to(root).as_posix() for p in present}
    missing = sorted(set(expected) - names)
    if missing:
        raise ConfigError(f"{root / missing[0]}: listed in {metadata_file} but missing"
                          + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""))
