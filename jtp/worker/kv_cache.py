"""The KV cache and recurrent-state slots as named arrays: gather pages out of it, scatter them
back in, and write / read them with Orbax, each process its own shards.

Used by the runner for snapshots (`jtp.engine.snapshot_store`); the layout on disk:
    arrays/  {"kv": {"layer_NN": {"k": [U, block_size, kv_heads, head_dim], "v": ...}},
              "state": {"layer_NN": {"conv_q": [S, ...], "conv_k", "conv_v", "recurrent"}}}
"""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import jax
import numpy as np

from jtp.core.snapshot_digests import seal
from jtp.errors import ConfigError
from jtp.models.attention import LayerKV

METADATA_FILE = "snapshots.json"
ARRAYS_DIR = "arrays"


def layer_name(i: int) -> str:
    return f"layer_{i:03d}"


def shardings_of(tree):
    return jax.tree.map(lambda a: a.sharding, tree)


def cache_views(cache, first: int = 0) -> tuple[dict[str, dict[str, jax.Array]], dict[str, dict[str, jax.Array]]]:
    """The engine cache as {"layer_NN": {field: array}}: paged K/V layers, and state-slot layers
    (`cache` may be a pipeline stage's, whose first layer is `first`)."""
    kv, state = {}, {}
    for i, layer in enumerate(cache, first):
        (kv if isinstance(layer, LayerKV) else state)[layer_name(i)] = dict(layer._asdict())
    return kv, state


def gather_pages(kv, state, block_ids: np.ndarray, slot_ids: np.ndarray) -> dict:
    """Rows `block_ids` of every K/V layer and `slot_ids` of every state layer, as new arrays sharded
    like the cache (each process then holds, and writes, only its own shards)."""
    tree = {}
    if len(block_ids):
        tree["kv"] = kv
    if len(slot_ids) and state:
        tree["state"] = state
    if not tree:
        return {}
    fn = jax.jit(
        lambda t, b, s: {
            name: jax.tree.map(lambda a, name=name: a[b if name == "kv" else s], sub) for name, sub in t.items()
        },
        out_shardings=shardings_of(tree),
    )
    return fn(tree, block_ids, slot_ids)


def scatter_pages(cache, block_ids, block_rows, pages, slot_ids, slot_rows, states, first: int = 0):
    """The cache with pages[block_rows] written to blocks block_ids and states[slot_rows] to slots
    slot_ids (pages / states: {"layer_NN": {field: array}}; `cache` may be a pipeline stage's, whose
    first layer is `first`); the old cache is donated."""

    def fn(cache, block_ids, block_rows, pages, slot_ids, slot_rows, states):
        out = []
        for i, layer in enumerate(cache, first):
            name = layer_name(i)
            if name in pages:
                src, ids, rows = pages[name], block_ids, block_rows
            elif name in states:
                src, ids, rows = states[name], slot_ids, slot_rows
            else:
                out.append(layer)
                continue
            out.append(type(layer)(**{f: getattr(layer, f).at[ids].set(src[f][rows]) for f in layer._fields}))
        return out

    jitted = jax.jit(fn, donate_argnums=0, out_shardings=shardings_of(cache))
    return jitted(cache, block_ids, block_rows, pages, slot_ids, slot_rows, states)


def sync_processes(tag: str) -> None:
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices(tag)


def write_pages(path: Path, arrays: dict, metadata: dict, overwrite: bool) -> None:
    """Everything into a staging directory beside `path`, then one rename (process 0). The metadata
    written carries the digest of every array file and its own (jtp.core.snapshot_digests)."""
    # The same name on every process: Orbax needs one path for all of them.
    staging = path.parent / f".{path.name}.saving"
    primary = jax.process_index() == 0
    if primary:
        path.parent.mkdir(parents=True, exist_ok=True)
        if staging.exists():
            shutil.rmtree(staging)  # a crashed save's leftovers
        staging.mkdir()
    sync_processes("jtp-snapshots-staging")
    try:
        if arrays:
            import orbax.checkpoint as ocp

            with ocp.StandardCheckpointer() as ckptr:
                ckptr.save(staging / ARRAYS_DIR, arrays)
        sync_processes("jtp-snapshots-arrays")
        if primary:
            tmp = staging / (METADATA_FILE + ".tmp")
            tmp.write_text(json.dumps(seal(metadata, staging, ARRAYS_DIR), indent=1))
            with open(tmp, "rb") as f:
                os.fsync(f.fileno())
            tmp.rename(staging / METADATA_FILE)
            old = path.parent / f".{path.name}.old"
            if path.exists():
                if not overwrite:
                    raise FileExistsError(f"{path} appeared while saving")
                if old.exists():
                    shutil.rmtree(old)
                path.rename(old)
            staging.rename(path)
            shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        if primary:
            shutil.rmtree(staging, ignore_errors=True)
        raise
    sync_processes("jtp-snapshots-done")


def read_pages(cache, path: Path, meta: dict) -> dict:
    """The saved pages and states, each process reading its own shards (sharded like the cache)."""
    if not meta["blocks"] and not meta["states"]:
        return {}
    import orbax.checkpoint as ocp

    kv, state = cache_views(cache)
    if sorted(kv) != meta["layers"]["kv"] or sorted(state) != meta["layers"]["state"]:
        raise ConfigError(f"{path}: its cache layers do not match this engine's")
    counts = {"kv": len(meta["blocks"]), "state": len(meta["states"])}
    abstract = {}
    for name, layers in (("kv", kv), ("state", state)):
        if counts[name] and layers:
            abstract[name] = jax.tree.map(
                lambda a, n=counts[name]: jax.ShapeDtypeStruct((n, *a.shape[1:]), a.dtype, sharding=a.sharding), layers
            )
    with ocp.StandardCheckpointer() as ckptr:
        try:
            return ckptr.restore(path / ARRAYS_DIR, abstract)
        except Exception as e:  # noqa: BLE001 - Orbax's errors name no snapshot file: say which
            raise ConfigError(f"{path / ARRAYS_DIR}: cannot read the saved pages ({type(e).__name__}: {e})") from e
