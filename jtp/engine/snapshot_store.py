"""Snapshots on disk: save an engine's pinned prefixes, load them into a fresh engine after a restart.

    ids = engine.snapshot(request_id)                      # pinned in the device cache
    save_snapshots(engine, "/ckpt/snaps")                  # every snapshot (or snapshot_ids=[...])
    ...restart...
    new_ids = load_snapshots(engine, "/ckpt/snaps")        # pinned again, same tokens
    engine.restore(new_ids[0], more_prompt, params)        # prefills only the tail

    save_snapshots(engine, "/ckpt/warm", include_prefix_cache=True)   # + the warm prefix cache
    loaded = load_snapshots(engine, "/ckpt/warm")          # snapshot ids; loaded.cache_blocks_loaded

What is saved is what a snapshot pins: the KV pages of its cached prefix and, on hybrid models,
the recurrent-state checkpoint at that prefix's end; blocks (and states) shared by several
snapshots are saved once. With `include_prefix_cache` every other cached block and state
checkpoint is saved too, with its key (a chain hash that cannot be recomputed without the
tokens, which the cache does not keep); a load registers those as ordinary unpinned cache
entries, as many as fit (they are optional), never displacing a snapshot or a running request.
Pages and states stay sharded jax Arrays all the way to Orbax, so in a multi-process deployment
each process writes (and later reads) only its own shards.

On disk (a directory; written under a temporary name and renamed, so a failed save leaves no
half checkpoint and a path that exists is complete):

    PATH/snapshots.json   format and version, the engine identity, per snapshot its id,
                          tokens, cached-token count, block indices and state index; the
                          digest of every file under arrays/ ("files") and of itself ("digest")
    PATH/arrays/          Orbax (StandardCheckpointer) pytree, absent when nothing is cached:
                          {"kv":    {"layer_NN": {"k": [U, block_size, kv_heads, head_dim], "v": ...}},
                           "state": {"layer_NN": {"conv_q": [S, ...], "conv_k", "conv_v", "recurrent"}}}
                          row i of "kv" is the block keyed blocks[i] in the JSON, row j of
                          "state" the state keyed states[j]. Rows no snapshot refers to are
                          prefix-cache entries ("prefix_cache": true), least recently used first.

A load is refused (ConfigError, nothing changed) unless the engine matches what saved: model
config, dtype, block size, mesh (axis names and sizes, process count) and the weights
(a fingerprint of the safetensors headers plus a sample of every tensor's bytes). The saved
prefix-cache keys are recomputed from the tokens and must agree too, which catches whatever the
identity string adds. Before any page is read, the metadata's own digest and every array file's
must match (jtp/core/snapshot_digests.py): arrays copied from another save or an edited
snapshots.json are refused naming the file; saves of format version 1 (no digests) are refused
with a message to save them again. A load that cannot fit (blocks, state slots, the snapshot cap or budget)
raises RequestError, also changing nothing (cache entries that do not fit are left out instead).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import jax
import numpy as np

from jtp.core.block_hash import block_keys
from jtp.core.snapshot_digests import check_files, check_seal
from jtp.engine.snapshot_manager import LoadedSnapshots
from jtp.errors import ConfigError, RequestError
from jtp.loading.fingerprint import weights_fingerprint, weights_identity  # noqa: F401 - part of this module's API
from jtp.worker.kv_cache import (
    ARRAYS_DIR,
    METADATA_FILE,
    cache_views,
)

if TYPE_CHECKING:
    from jtp.engine.engine import Engine

log = logging.getLogger(__name__)

__all__ = ["save_snapshots", "load_snapshots", "LoadedSnapshots", "read_metadata", "weights_fingerprint", "FORMAT", "FORMAT_VERSION"]

FORMAT = "jtp-snapshots"
FORMAT_VERSION = 2  # 2: digests of the array files and of the metadata


def _refuse_pipeline(engine: "Engine") -> None:
    """Before anything reaches a group's followers: a pipeline across processes writes no snapshots yet
    (each process would hold only its stages' pages)."""
    if engine.runner.pipeline_depth > 1 and engine.group is not None:
        raise RequestError("snapshots on disk are not supported yet for a pipeline across processes "
                           "(--pipeline-parallel-size with --num-processes)")


def _model_dir(engine: "Engine", model_dir: str | Path | None) -> Path:
    """The directory whose weights are fingerprinted: the engine's own unless given."""
    return Path(model_dir or engine.config.model)


def _mesh_info(engine: "Engine") -> dict[str, Any]:
    mesh = engine.runner.mesh
    return {
        "axis_names": list(mesh.axis_names),
        "shape": [int(mesh.shape[a]) for a in mesh.axis_names],
        "process_count": jax.process_count(),
    }


def _identity(engine: "Engine", model_dir: Path) -> dict[str, Any]:
    runner = engine.runner
    return {
        "cache_identity": engine.cache_identity,
        "model_config": json.loads(json.dumps(dataclasses.asdict(engine.cfg))),
        "dtype": np.dtype(runner.dtype).name,
        "block_size": engine.pool.block_size,
        "mesh": _mesh_info(engine),
        "weights": weights_identity(model_dir, runner.load_format),
        # The MTP head's own paged K/V (speculative method "mtp") is one more cache layer.
        "mtp_kv_layers": 1 if runner.mtp_drafts else 0,
    }


def _mesh_text(mesh: dict[str, Any]) -> str:
    axes = " x ".join(f"{a}={n}" for a, n in zip(mesh["axis_names"], mesh["shape"]))
    procs = mesh["process_count"]
    return f"{axes} ({procs} process{'es' if procs != 1 else ''})"


def _identity_mismatches(saved: dict[str, Any], mine: dict[str, Any]) -> list[str]:
    """What differs, one phrase each, saying what was saved and what this engine has."""
    out = []
    if saved["model_config"] != mine["model_config"]:
        a, b = saved["model_config"], mine["model_config"]
        fields = [k for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)]
        details = ", ".join(f"{k}: saved {a.get(k)!r}, this engine {b.get(k)!r}" for k in fields[:4])
        more = f" and {len(fields) - 4} more" if len(fields) > 4 else ""
        out.append(f"saved from a different model config ({details}{more})")
    if saved["dtype"] != mine["dtype"]:
        out.append(f"saved with dtype {saved['dtype']}, this engine runs {mine['dtype']}")
    if saved["block_size"] != mine["block_size"]:
        out.append(f"saved with block_size {saved['block_size']}, this engine uses {mine['block_size']}")
    if saved["mesh"] != mine["mesh"]:
        out.append(f"saved on a mesh of {_mesh_text(saved['mesh'])}, this engine runs on {_mesh_text(mine['mesh'])}")
    if saved["weights"] != mine["weights"]:
        out.append(
            f"saved from different weights (fingerprint {saved['weights'][:12]}, this engine's {mine['weights'][:12]})"
        )
    saved_mtp = saved.get("mtp_kv_layers", 0)  # files from before this field held none
    if saved_mtp != mine["mtp_kv_layers"]:
        with_, without = "with the MTP head's K/V (--speculative-config method mtp)", "without it"
        out.append(f"saved {with_ if saved_mtp else without}, this engine runs {with_ if mine['mtp_kv_layers'] else without}")
    if not out and saved["cache_identity"] != mine["cache_identity"]:
        out.append(f"saved by an engine of identity {saved['cache_identity']!r}, this one is {mine['cache_identity']!r}")
    return out


# ----------------------------------------------------------------------------- save


def save_snapshots(
    engine: "Engine",
    path: str | Path,
    snapshot_ids=None,
    *,
    model_dir: str | Path | None = None,
    overwrite: bool = False,
    include_prefix_cache: bool = False,
) -> Path:
    """Write snapshots (all of them, or `snapshot_ids`) to the directory `path`; returns it.

    `include_prefix_cache`: also write the warm prefix cache, every cached KV block and state
    checkpoint that no saved snapshot holds (in use or not), with its key; `load_snapshots`
    registers them as ordinary evictable cache entries. The pages are copied on device first (as
    a snapshot's are): the save needs free device memory for as many pages as it writes.

    The pages and states are copied on device with the engine paused (after the in-flight step is
    processed); the write to disk happens outside it, so serving goes on meanwhile. The directory
    appears only once complete. `model_dir`: the engine's model directory, for the weights
    fingerprint (default: `engine.model_dir`). An existing `path` raises FileExistsError unless
    `overwrite`. In a multi-process group the leader's runner sends each device step to the
    followers (jtp/distributed/group.py), the whole save runs under the step lock, and each process writes its
    own shards (a shared filesystem), process 0 the metadata.
    """
    path = Path(path).absolute()
    if path.exists() and not overwrite:
        raise FileExistsError(f"{path} exists (pass overwrite=True to replace it)")
    _refuse_pipeline(engine)
    identity = _identity(engine, _model_dir(engine, model_dir))
    # One process writes while serving goes on; in a group every process must meet the write's
    # collectives in the same order as the steps', so the write happens paused too.
    in_group = engine.group is not None
    with engine.paused():
        if engine.runner.cache is None:
            raise RequestError("the engine is closed: its cache is gone")
        arrays, metadata = _gather(engine, identity, snapshot_ids, include_prefix_cache)
        if in_group:
            engine.runner.write_pages(path, arrays, metadata, overwrite)
    if not in_group:
        engine.runner.write_pages(path, arrays, metadata, overwrite)
    return path


def _gather(engine: "Engine", identity, snapshot_ids, include_prefix_cache):
    """The saved rows' pages copied on the device, and the metadata naming them (engine paused)."""
    snaps = list(engine.snapshots)
    if snapshot_ids is not None:
        by_id = {s.id: s for s in snaps}
        missing = [i for i in snapshot_ids if i not in by_id]
        if missing:
            raise KeyError(f"unknown snapshot {missing[0]!r} (never made, dropped, or evicted)")
        snaps = [by_id[i] for i in dict.fromkeys(snapshot_ids)]
    root, bs = engine.scheduler.cache_root, engine.pool.block_size
    block_rows: dict[int, int] = {}  # engine block -> row in the saved arrays
    block_keys_hex: list[str] = []
    slot_rows: dict[int, int] = {}
    slot_keys_hex: list[str] = []
    entries = []
    for snap in snaps:
        n = len(snap.blocks)
        keys = block_keys(root, snap.tokens, bs)[:n] if n else []
        rows = []
        for block, key in zip(snap.blocks, keys):
            if block not in block_rows:
                block_rows[block] = len(block_keys_hex)
                block_keys_hex.append(key.hex())
            elif block_keys_hex[block_rows[block]] != key.hex():  # the pool keys a block once
                raise AssertionError(f"block {block} is pinned under two keys")
            rows.append(block_rows[block])
        state = -1
        if snap.state_slot >= 0:
            if snap.state_slot not in slot_rows:
                slot_rows[snap.state_slot] = len(slot_keys_hex)
                slot_keys_hex.append(keys[-1].hex())
            state = slot_rows[snap.state_slot]
        entries.append({
            "id": snap.id,
            "tokens": list(snap.tokens),
            "num_cached_tokens": snap.num_cached_tokens,
            "blocks": rows,
            "state": state,
            "created": snap.created,
        })
    if include_prefix_cache:  # the rest of the cache, least recently used first
        for block, key in engine.pool.cached_blocks().items():
            if block not in block_rows:
                block_rows[block] = len(block_keys_hex)
                block_keys_hex.append(key.hex())
        if engine.states is not None:
            for slot, key in engine.states.cached_slots().items():
                if slot not in slot_rows:
                    slot_rows[slot] = len(slot_keys_hex)
                    slot_keys_hex.append(key.hex())
    kv, state_layers = cache_views(engine.runner.cache)
    arrays = engine.runner.gather_pages(np.asarray(list(block_rows), np.int32), np.asarray(list(slot_rows), np.int32))
    metadata = _metadata(engine, identity, kv, state_layers, block_keys_hex, slot_keys_hex, entries,
                         include_prefix_cache)
    return arrays, metadata


def _metadata(engine, identity, kv, state_layers, block_keys_hex, slot_keys_hex, entries, include_prefix_cache):
    return {
        "format": FORMAT,
        "version": FORMAT_VERSION,
        "saved_at": time.time(),
        "identity": identity,
        "platform": engine.runner.mesh.devices.flat[0].platform,
        "device_kind": engine.runner.mesh.devices.flat[0].device_kind,
        "layers": {"kv": sorted(kv), "state": sorted(state_layers)},
        "blocks": block_keys_hex,
        "states": slot_keys_hex,
        "snapshots": entries,
        "prefix_cache": include_prefix_cache,
    }


# ----------------------------------------------------------------------------- load


def read_metadata(path: str | Path) -> dict[str, Any]:
    """The JSON side of a saved directory (format, seal and field types checked): identity,
    blocks, snapshots. ConfigError naming the file otherwise."""
    path = Path(path)
    file = path / METADATA_FILE
    if not file.is_file():
        raise ConfigError(f"{path}: not a saved snapshot directory (no {METADATA_FILE})")
    try:
        meta = json.loads(file.read_text(encoding="utf-8"))
    except ValueError as e:
        raise ConfigError(f"{file}: unreadable ({e})") from e
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise ConfigError(f"{file}: not a jtp snapshot file (format {meta.get('format') if isinstance(meta, dict) else None!r})")
    if meta.get("version") == 1:
        raise ConfigError(f"{file}: format version 1, saved before snapshots carried digests; this jtp reads "
                          f"version {FORMAT_VERSION} only (save the snapshots again)")
    if meta.get("version") != FORMAT_VERSION:
        raise ConfigError(f"{file}: format version {meta.get('version')}, this jtp reads version {FORMAT_VERSION}")
    check_seal(meta, file)
    _check_fields(meta, file)
    return meta


def _is_ints(value) -> bool:
    return isinstance(value, list) and all(isinstance(v, int) and not isinstance(v, bool) for v in value)


def _is_hex_keys(value) -> bool:
    def is_hex(k):
        try:
            return isinstance(k, str) and len(bytes.fromhex(k)) > 0
        except ValueError:
            return False

    return isinstance(value, list) and all(map(is_hex, value))


_IDENTITY_KEYS = {"cache_identity", "model_config", "dtype", "block_size", "mesh", "weights"}
_MESH_KEYS = {"axis_names", "shape", "process_count"}


def _check_fields(meta: dict[str, Any], file: Path) -> None:
    """The types a load relies on, so a malformed file is one ConfigError rather than a KeyError."""
    snaps = meta.get("snapshots")
    problems = [
        name for name, ok in (
            ("identity", isinstance(meta.get("identity"), dict) and _IDENTITY_KEYS <= meta["identity"].keys()
             and isinstance(meta["identity"]["mesh"], dict) and _MESH_KEYS <= meta["identity"]["mesh"].keys()),
            ("layers", isinstance(meta.get("layers"), dict) and all(
                isinstance(meta["layers"].get(k), list) for k in ("kv", "state"))),
            ("blocks", _is_hex_keys(meta.get("blocks"))),
            ("states", _is_hex_keys(meta.get("states"))),
            ("files", isinstance(meta.get("files"), dict)),
            ("snapshots", isinstance(snaps, list) and all(isinstance(e, dict) for e in snaps)),
        ) if not ok
    ]
    for i, e in enumerate(snaps if "snapshots" not in problems else []):
        if not (isinstance(e.get("id"), str) and _is_ints(e.get("tokens")) and _is_ints(e.get("blocks"))
                and isinstance(e.get("num_cached_tokens"), int) and isinstance(e.get("state"), int)):
            problems.append(f"snapshots[{i}]")
    if problems:
        raise ConfigError(f"{file}: malformed field(s) {', '.join(problems)} (a corrupt file)")


def load_snapshots(
    engine: "Engine", path: str | Path, *, model_dir: str | Path | None = None, include_prefix_cache: bool = True
) -> LoadedSnapshots:
    """Pin the snapshots saved in `path` in this engine; returns their ids, in saved order (the
    saved id where this engine has no snapshot of that name, else a new one).

    A save made with `include_prefix_cache` also holds cache entries: KV blocks and state
    checkpoints, with their keys, that no snapshot pins. Unless `include_prefix_cache=False` they
    are registered as ordinary unpinned cache entries (evicted least recently used like any), in
    the order they had, as many as fit after the snapshots: they take only blocks and slots nobody
    holds or was promised (an allocation evicts this engine's least recently used unheld cache
    entries, as any does), never a snapshot's or a running request's. The result's
    `cache_blocks_loaded` / `cache_states_loaded` say how many made it (also logged). The saved
    keys stay valid because they are rooted at the engine identity, checked first.

    Refuses (ConfigError, nothing changed) an engine that differs from the one that saved: model
    config, dtype, block size, mesh or weights. RequestError (nothing changed) when the pool,
    the state slots or the snapshot cap and budget cannot take them. Blocks and state checkpoints
    the engine's prefix cache already holds are shared, not loaded again. In a multi-process group
    every process reads its own shards, in step order (see `save_snapshots`).
    """
    _refuse_pipeline(engine)
    path = Path(path).absolute()
    meta = read_metadata(path)
    if engine.scheduler.cache_root is None:
        raise RequestError("snapshots need prefix caching (the engine runs with enable_prefix_caching=False)")
    mismatches = _identity_mismatches(meta["identity"], _identity(engine, _model_dir(engine, model_dir)))
    if mismatches:
        raise ConfigError(f"cannot load the snapshots in {path} into this engine: " + "; ".join(mismatches))
    check_files(meta, path / METADATA_FILE, ARRAYS_DIR)  # before any page is read: nothing changed on a mismatch

    root, bs = engine.scheduler.cache_root, engine.pool.block_size
    block_keys_saved = [bytes.fromhex(k) for k in meta["blocks"]]
    state_keys_saved = [bytes.fromhex(k) for k in meta["states"]]
    hybrid = engine.states is not None
    entries = meta["snapshots"]
    if len(set(block_keys_saved)) != len(block_keys_saved) or len(set(state_keys_saved)) != len(state_keys_saved):
        raise ConfigError(f"{path}: a block or state is saved twice (a corrupt file)")
    if state_keys_saved and not hybrid:
        raise ConfigError(f"{path}: holds recurrent states but this engine's model has none (a corrupt file)")
    for e in entries:
        if not all(0 <= r < len(block_keys_saved) for r in e["blocks"]) or e["state"] >= len(state_keys_saved):
            raise ConfigError(f"{path}: snapshot {e['id']!r} refers to a block or state that is not saved (a corrupt file)")
        n = len(e["blocks"])
        keys = block_keys(root, e["tokens"], bs)[:n] if n else []
        if (
            e["num_cached_tokens"] != n * bs
            or len(keys) != n
            or [block_keys_saved[r] for r in e["blocks"]] != keys
            or (e["state"] >= 0) != (hybrid and n > 0)
            or (e["state"] >= 0 and state_keys_saved[e["state"]] != keys[-1])
        ):
            raise ConfigError(
                f"{path}: snapshot {e['id']!r} does not match its tokens under this engine's prefix-cache keys "
                "(a corrupt file, or one saved by an engine of another identity)"
            )

    # What the registry can take (checked up front: evicting older snapshots is the only change it makes).
    per_block, per_slot = engine.runner.bytes_per_block(), engine.runner.bytes_per_state_slot()
    sizes = [len(e["blocks"]) * per_block + (per_slot if e["state"] >= 0 else 0) for e in entries]
    registry = engine.snapshots
    if len(entries) > registry.max_entries or sum(sizes) > registry.budget_bytes:
        raise RequestError(
            f"{len(entries)} snapshots of {sum(sizes)} bytes exceed the engine's snapshot limits "
            f"({registry.max_entries} entries, {registry.budget_bytes} bytes)"
        )

    # Rows no snapshot refers to are prefix-cache entries (saved least recently used first).
    snap_rows = {r for e in entries for r in e["blocks"]}
    snap_state_rows = {e["state"] for e in entries if e["state"] >= 0}
    cache_rows = [r for r in range(len(block_keys_saved)) if r not in snap_rows]
    cache_state_rows = [j for j in range(len(state_keys_saved)) if j not in snap_state_rows]
    if not include_prefix_cache:
        cache_rows, cache_state_rows = [], []

    def read():
        return engine.runner.read_pages(path, meta) if (snap_rows or cache_rows or cache_state_rows) else {}

    # One process reads while serving goes on; a group reads in step order, paused below.
    in_group = engine.group is not None
    arrays = None if in_group else read()
    with engine.paused():
        if engine.runner.cache is None:
            raise RequestError("the engine is closed: its cache is gone")
        if arrays is None:
            arrays = read()
        loaded = engine.snapshots.install(
            entries, sizes, block_keys_saved, state_keys_saved, arrays, cache_rows, cache_state_rows,
            engine.runner.scatter_pages,
        )
    if cache_rows or cache_state_rows:
        log.info(
            "prefix cache from %s: %d of %d KV blocks and %d of %d state checkpoints now cached%s",
            path, loaded.cache_blocks_loaded, loaded.cache_blocks_saved, loaded.cache_states_loaded,
            loaded.cache_states_saved,
            "" if (loaded.cache_blocks_loaded, loaded.cache_states_loaded) == (len(cache_rows), len(cache_state_rows))
            else " (the rest did not fit)",
        )
    return loaded
