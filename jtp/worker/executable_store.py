"""Compiled step programs kept on disk between starts, so a warm start neither traces nor lowers.

JAX's persistent compilation cache is keyed by the lowered program, so every start still traces and
lowers each of the warm-up's programs before the cache can answer (under the GIL, one program at a
time). This store keys each serialized executable by what determines the program instead: the
engine's code (every source file of the package), the JAX and XLA build, the devices, the
environment variables the kernels read, the runner's static configuration, the abstract values of
the arrays the programs take (shapes, dtypes, shardings), and the program's own key (kind and step
layout). A changed input of any of these is another key, never a stale program. It lives beside
JAX's cache, in its `jtp-executables` folder, and is off where that cache is.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import os
import pickle
from pathlib import Path
from typing import Callable

import jax
import jaxlib
from jax.experimental import serialize_executable

log = logging.getLogger(__name__)

FOLDER = "jtp-executables"
# Variables that change where or how fast the process compiles, not the programs it compiles.
_NOT_PROGRAM_ENV = frozenset({"JTP_COMPILATION_CACHE", "JTP_COMPILE_WORKERS", "JTP_LAUNCH_SECRET", "JTP_DEBUG",
                              "XLA_PYTHON_CLIENT_MEM_FRACTION", "XLA_PYTHON_CLIENT_PREALLOCATE"})
_source_digest: bytes | None = None


def source_digest() -> bytes:
    """The digest of every Python file of the jtp package (read once a process)."""
    global _source_digest
    if _source_digest is None:
        root = Path(__file__).resolve().parents[1]
        h = hashlib.sha256()
        for path in sorted(root.rglob("*.py")):
            h.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes() + b"\0")
        _source_digest = h.digest()
    return _source_digest


def build_context(devices, static: object, arrays: object) -> bytes:
    """The digest of everything but the program's key that decides the executables: `static` (a
    repr-able description of the runner's configuration) and `arrays` (the state the programs
    take, of which only the abstract values count)."""
    client = next(iter(devices)).client
    parts = [
        source_digest().hex(), jax.__version__, jaxlib.__version__, client.platform, client.platform_version,
        repr([(d.id, d.process_index, d.device_kind) for d in devices]),
        repr(sorted((k, v) for k, v in os.environ.items()
                    if k.startswith(("JTP_", "XLA_")) and k not in _NOT_PROGRAM_ENV)),
        repr(sorted((k, repr(v)) for k, v in jax.config.values.items() if "cache" not in k and "log" not in k)),
        repr(static),
        repr(jax.tree.structure(arrays)),
        repr([(x.shape, str(x.dtype), str(getattr(x, "sharding", None))) for x in jax.tree.leaves(arrays)]),
    ]
    return hashlib.sha256("\n".join(parts).encode()).digest()


class ExecutableStore:
    """Serialized executables in `directory`, one file a program key, under one context digest;
    loaded onto `devices` (the runner's mesh, in its order)."""

    def __init__(self, directory: Path, context: bytes, devices: tuple):
        self.directory = Path(directory)
        self.context = context
        self.devices = devices

    @classmethod
    def beside_compilation_cache(cls, devices, static: object, arrays: object) -> ExecutableStore | None:
        """The store in JAX's persistent compilation cache directory (None where that cache is off)
        for programs on `devices` of `build_context(devices, static, arrays)`."""
        cache = jax.config.jax_compilation_cache_dir
        devices = tuple(devices)
        return cls(Path(cache) / FOLDER, build_context(devices, static, arrays), devices) if cache else None

    def _path(self, key) -> Path:
        return self.directory / (hashlib.sha256(self.context + repr(key).encode()).hexdigest() + ".exe")

    def has(self, key) -> bool:
        return self._path(key).is_file()

    def load(self, key) -> jax.stages.Compiled | None:
        """The stored executable of `key` loaded onto its devices; None when it cannot be read (the
        caller compiles it again, and `save` replaces the file)."""
        try:
            blob = self._path(key).read_bytes()
            return serialize_executable.deserialize_and_load(*pickle.loads(blob), execution_devices=self.devices)
        except Exception as e:  # noqa: BLE001 - a truncated or foreign file is a miss, not a failure
            log.warning("stored executable for %s unreadable (%s): compiling it", key[0], e)
            return None

    def save(self, key, compiled: jax.stages.Compiled) -> None:
        """Write `compiled` for `key` (atomically: a reader sees the whole file or none); a store that
        cannot be written is logged and skipped (the next start compiles again)."""
        path = self._path(key)
        try:
            blob = pickle.dumps(serialize_executable.serialize(compiled))
            self.directory.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_bytes(blob)
            os.replace(tmp, path)
        except Exception as e:  # noqa: BLE001 - a full disk or an executable XLA cannot serialize
            log.warning("could not store the executable for %s: %s", key[0], e)


@dataclasses.dataclass(frozen=True)
class StoredProgram:
    """A program `lower` found in the store: `compile()` loads it (any thread), or, where the file
    cannot be read, lowers and compiles it after all."""

    store: ExecutableStore
    key: object
    lower: Callable[[], jax.stages.Lowered]

    @property
    def digest(self) -> bytes:
        """The program's identity, for warm-up's sharing of one executable between keys."""
        return self.store._path(self.key).name.encode()

    def compile(self) -> jax.stages.Compiled:
        compiled = self.store.load(self.key)
        if compiled is None:
            compiled = self.lower().compile()
            self.store.save(self.key, compiled)
        return compiled
