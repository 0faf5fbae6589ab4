"""Checkpoint loading: Hugging Face safetensors (single file or sharded) -> sharded jax.Arrays.

Each parameter is described by a `Source` (jtp/loading/sources.py) that knows its global shape and how
to read any rectangular slice of it from the checkpoint. `jax.make_array_from_callback` asks for exactly
the slice each local device owns, and safetensors reads only those bytes, so no process
materialises a whole tensor-parallel weight matrix on the host.

The same parameter tree can be saved to / restored from Orbax (`jtp convert`), restoring
straight into the target sharding.
"""

from __future__ import annotations

import json
import logging
import re
import shutil
from pathlib import Path
from typing import Callable, Mapping

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from safetensors import safe_open

from jtp.config.engine_args import LOAD_FORMATS
from jtp.config.model_config import ModelConfig
from jtp.config.quantization import INT4_METHODS
from jtp.errors import CheckpointError, ConfigError
from jtp.loading.dummy_weights import random_params
from jtp.loading.int4 import Int4Reader, check_g_idx, check_split, int4_weights, weight_names
from jtp.loading.param_tree import flatten, repeat_kv_heads, unflatten
from jtp.loading.quantized import block_scales, quantize_params, random_int4_params
from jtp.loading.safetensors_header import FLOAT_DTYPES, TensorInfo, read_header
from jtp.loading.sources import FirstPresent, RepeatedHeads, Source
from jtp.models import family_of
from jtp.models.layers import BlockFp8, Int4Groups
from jtp.parallel.rules import logical_sharding
from jtp.parallel.sharding import (
    kv_head_replicas,
    replicated,
    tp_size,
    validate_tp,
)

log = logging.getLogger(__name__)

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}
RAW_DTYPES = {"F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn)}  # read by memory map (safetensors' numpy has none)
ORBAX_SUBDIR = "orbax"


# ----------------------------------------------------------------------------- safetensors


class SafetensorsCheckpoint:
    """All tensors of a model directory, by name, whichever file holds them."""

    def __init__(self, model_dir: str | Path):
        model_dir = Path(model_dir)
        index = model_dir / "model.safetensors.index.json"
        if index.is_file():
            files = _indexed_files(index)
        elif (model_dir / "model.safetensors").is_file():
            files = ["model.safetensors"]
        else:
            raise CheckpointError(
                f"{model_dir}: no model.safetensors or model.safetensors.index.json (random weights from "
                "config.json alone, for benchmarks: --load-format dummy)"
            )
        self.model_dir = model_dir
        self._handles = {}
        self._file_of: dict[str, str] = {}
        self._info: dict[str, TensorInfo] = {}
        for file in files:
            path = model_dir / file
            if not path.is_file():
                raise CheckpointError(f"{index}: lists {file}, which does not exist")
            self._info.update(read_header(path))  # our checks first: they name the tensor
            try:
                handle = safe_open(str(path), framework="numpy")
            except Exception as e:  # safetensors' own error type names no file: name it here
                raise CheckpointError(f"{path}: not a readable safetensors file ({e})") from e
            self._handles[file] = handle
            for name in handle.keys():
                self._file_of[name] = file

    @property
    def names(self) -> set[str]:
        return set(self._file_of)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._slice(name).get_shape())

    def dtype(self, name: str) -> str:
        """The dtype the header declares ("F32", "BF16", ...)."""
        return self._info[name].dtype

    def file_of(self, name: str) -> Path:
        return self.model_dir / self._file_of[name]

    def read(self, name: str, index: tuple[slice, ...] = ()) -> np.ndarray:
        """Only the bytes of `index` are read from disk."""
        if self._info.get(name) is not None and self._info[name].dtype in RAW_DTYPES:
            return np.asarray(self._mapped(name)[index])
        sl = self._slice(name)
        return np.asarray(sl[index] if index else sl[:])

    def _mapped(self, name: str) -> np.ndarray:
        """A tensor the safetensors library cannot hand to numpy (float8), mapped from its file."""
        info, path = self._info[name], self.file_of(name)
        with open(path, "rb") as f:
            data_start = 8 + int.from_bytes(f.read(8), "little")
        return np.memmap(path, RAW_DTYPES[info.dtype], "r", data_start + info.begin, info.shape)

    def _slice(self, name: str):
        if name not in self._file_of:
            raise CheckpointError(f"checkpoint has no tensor {name!r}")
        return self._handles[self._file_of[name]].get_slice(name)


def _indexed_files(index: Path) -> list[str]:
    """The shard files model.safetensors.index.json names, each a plain name inside the directory."""
    try:
        weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        files = sorted(set(weight_map.values()))
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise CheckpointError(f"{index}: not a safetensors index (a JSON object with a 'weight_map'): {e!r}") from e
    for file in files:
        if not isinstance(file, str) or Path(file).name != file:
            raise CheckpointError(f"{index}: shard {file!r} is not a file name inside the model directory")
    return files


# ----------------------------------------------------------------------------- checking a layout

# Checkpoint tensors that carry no parameter of ours.
IGNORED_TENSORS = [r"\.rotary_emb\.inv_freq$"]
# Whole parts of a checkpoint that jtp does not run (multi-token-prediction head, vision tower):
# skipped with one log line, never an error.
SKIPPED_TENSORS = [r"^mtp\.", r"^model\.visual\."]


def resolve_layout(layout: dict[str, Source], ckpt: SafetensorsCheckpoint) -> dict[str, Source]:
    names = weight_names(ckpt.names)  # an int4 module X (X.qweight, ...) stands for its X.weight
    return {k: (s.resolve(names) if isinstance(s, FirstPresent) else s) for k, s in layout.items()}


EXAMPLES_SHOWN = 3  # per kind of mismatch: a wrong config can miss every tensor of 100k layers


def _some(kind: str, items: list[str]) -> str:
    """'N <kind>, e.g. a, b, c (and M more)': a few examples and a count, never the whole list."""
    shown = ", ".join(items[:EXAMPLES_SHOWN])
    more = f" (and {len(items) - EXAMPLES_SHOWN} more)" if len(items) > EXAMPLES_SHOWN else ""
    return f"{len(items)} {kind}, e.g. {shown}{more}"


def check_checkpoint(ckpt: SafetensorsCheckpoint, layout: dict[str, Source], cfg: ModelConfig,
                     quantized: Mapping[str, tuple[tuple[int, ...], frozenset[str], str]] = {}) -> None:
    """Every expected tensor present with its shape and a float dtype, nothing unexplained left over.
    `quantized`: the tensors of quantized weights, name -> (shape, the dtypes they may have, what
    they must be), e.g. an FP8 weight's float8 values, an int4 weight's int32 words."""
    expected: dict[str, tuple[int, ...]] = {}
    for source in layout.values():
        expected.update(source.expected())
    expected.update({name: shape for name, (shape, _, _) in quantized.items()})
    missing, misshaped, not_float, wrong_dtype = [], [], [], []
    for name, shape in expected.items():
        if name not in ckpt.names:
            missing.append(f"{name!r} (shape {list(shape)})")
        elif ckpt.shape(name) != shape:
            misshaped.append(f"{name!r} has shape {list(ckpt.shape(name))} in the checkpoint, "
                             f"but the config implies {list(shape)}")
        elif name in quantized and ckpt.dtype(name) not in quantized[name][1]:
            wrong_dtype.append(f"{name!r} in {ckpt.file_of(name)} is {ckpt.dtype(name)} ({quantized[name][2]})")
        elif name not in quantized and ckpt.dtype(name) not in FLOAT_DTYPES:
            not_float.append(f"{name!r} in {ckpt.file_of(name)} is {ckpt.dtype(name)}")
    problems = []
    if missing:
        problems.append(_some("expected tensor(s) are missing", missing))
    if misshaped:
        problems.append(_some("tensor(s) have the wrong shape", misshaped))
    if not_float:
        problems.append(_some("weight(s) are not floating point", not_float))
    if wrong_dtype:
        problems.append(_some("quantized tensor(s) have the wrong dtype", wrong_dtype))
    ignored = list(IGNORED_TENSORS)
    if cfg.tie_word_embeddings:
        ignored.append(r"^lm_head\.weight$")  # tied: HF ignores a stored copy too
    leftover = ckpt.names - expected.keys()
    skipped = {n for n in leftover if any(re.search(p, n) for p in SKIPPED_TENSORS)}
    if skipped:
        log.info("skipping %d checkpoint tensor(s) jtp does not use (mtp.*, model.visual.*)", len(skipped))
    unexpected = sorted(n for n in leftover - skipped if not any(re.search(p, n) for p in ignored))
    if unexpected:
        problems.append(_some(f"unexpected tensor(s) for {cfg.model_type}", [repr(n) for n in unexpected]))
    if problems:
        raise CheckpointError(f"{ckpt.model_dir}: checkpoint does not match config.json: " + "; ".join(problems))


def resolve_dtype(cfg: ModelConfig, dtype: str | None):
    name = cfg.dtype if dtype in (None, "auto") else dtype
    if name not in DTYPES:
        raise ConfigError(f"dtype {name!r} is not supported; choose one of {', '.join(DTYPES)}")
    return DTYPES[name]


def load_params(
    model_dir: str | Path, cfg: ModelConfig, mesh, dtype=jnp.float32, expert_parallel: bool = False, mtp: bool = False,
    load_format: str = "auto", quantization: str | None = None, keep: Callable[[str], bool] | None = None,
) -> dict:
    """See `read_params`; then, with quantization "fp8" (or random weights of an FP8 checkpoint's
    config), the linear weights quantized to FP8 on the devices (`quantize_params`); random weights of an AWQ /
    GPTQ config as random int4 groups. (An AWQ / GPTQ checkpoint's int4 weights are read as they are
    stored: jtp/loading/int4.py.)"""
    params = read_params(model_dir, cfg, mesh, dtype, expert_parallel, mtp, load_format, keep)
    if load_format == "dummy" and cfg.quantization is not None and cfg.quantization.method in INT4_METHODS:
        return random_int4_params(params, cfg.quantization.group_size)
    if quantization == "fp8" or (load_format == "dummy" and cfg.quantization is not None):
        params = quantize_params(params, cfg.quantization.block if cfg.quantization else None)
    return params


def read_params(
    model_dir: str | Path, cfg: ModelConfig, mesh, dtype=jnp.float32, expert_parallel: bool = False, mtp: bool = False,
    load_format: str = "auto", keep: Callable[[str], bool] | None = None,
) -> dict:
    """Load a model directory (safetensors, or an Orbax checkpoint written by `jtp convert`).

    expert_parallel: split the routed experts over the devices whole instead of inside each expert.
    mtp: also load the multi-token-prediction head (params["mtp"]), for MTP speculative decoding.
    load_format: "auto" reads the weights; "dummy" draws random ones from config.json alone
    (jtp/loading/dummy_weights.py: for benchmarks).
    """
    if load_format not in LOAD_FORMATS:
        raise CheckpointError(f"load format {load_format!r}: expected one of {', '.join(LOAD_FORMATS)}")
    model_dir = Path(model_dir)
    tp = tp_size(mesh)
    validate_tp(cfg, tp, expert_parallel)
    if mtp and not cfg.mtp_layers:
        raise CheckpointError(
            f"speculative method 'mtp' needs a checkpoint with an MTP head; this {cfg.model_type} config declares "
            "none (mtp_num_hidden_layers / num_nextn_predict_layers)"
        )
    if load_format == "dummy":
        return random_params(cfg, mesh, dtype, expert_parallel, mtp, keep=keep)
    if is_orbax_dir(model_dir):
        if mtp:
            raise CheckpointError("the MTP head is not kept in Orbax checkpoints (`jtp convert`); serve the safetensors")
        return restore_orbax(model_dir / ORBAX_SUBDIR, cfg, mesh, dtype, expert_parallel, keep)
    ckpt = SafetensorsCheckpoint(model_dir)
    layout = resolve_layout(family_of(cfg).param_layout(cfg, tp, mtp), ckpt)
    q = cfg.quantization
    scales = block_scales(layout, ckpt.names, q) if q and q.method == "fp8" else {}
    int4 = int4_weights(layout, ckpt.names, q) if q and q.method in INT4_METHODS else {}
    quantized = {name: (shape, frozenset({"F8_E4M3"}), "an FP8 checkpoint's quantized weights are F8_E4M3")
                 for path in scales for name, shape in layout[path].expected().items()}
    for weight in int4.values():
        quantized.update(weight.tensors)
    check_checkpoint(ckpt, {**{p: s for p, s in layout.items() if p not in int4},
                            **{f"{p}.scale": s for p, s in scales.items()}}, cfg, quantized)
    if q and q.method == "gptq":
        check_g_idx(ckpt, int4, q.group_size)
    for path, weight in int4.items():  # each device must get whole groups and words: checked before any read
        check_split(weight, logical_sharding(mesh, path, weight.shape, weight.values.axes,
                                             expert_parallel).shard_shape(weight.shape))
    int4_reader = Int4Reader(ckpt, q.method) if int4 else None
    host_dtype = np.dtype(ml_dtypes.bfloat16) if dtype == jnp.bfloat16 else np.dtype(dtype)

    def load(name: str, source: Source, as_dtype, reader=ckpt) -> jax.Array:
        read: Callable = lambda index: source.read(reader, index).astype(as_dtype, copy=False)
        sharding = logical_sharding(mesh, name, source.shape, source.axes, expert_parallel)
        return jax.make_array_from_callback(source.shape, sharding, read)

    flat = {}
    for path, source in layout.items():
        if keep is not None and not keep(path):
            continue
        if path in scales:  # the float8 values and their block scales, each device its own blocks
            flat[path] = BlockFp8(load(path, source, RAW_DTYPES["F8_E4M3"]),
                                  load(f"{path} (FP8 block scales)", scales[path], np.float32))
        elif path in int4:  # packed words, zeros and scales, each device its own groups
            weight = int4[path]
            flat[path] = Int4Groups(load(f"{path} (int4 words)", weight.words, np.int32, int4_reader),
                                    load(f"{path} (int4 zeros)", weight.zeros, np.int8, int4_reader),
                                    load(f"{path} (int4 scales)", weight.scales, np.float16, int4_reader))
        else:
            flat[path] = load(path, source, host_dtype)
    return unflatten(flat, cfg.num_layers)


# ----------------------------------------------------------------------------- orbax


def is_orbax_dir(model_dir: str | Path) -> bool:
    """A `jtp convert` output: the Orbax tree of the language model, no safetensors."""
    model_dir = Path(model_dir)
    return not any(model_dir.glob("*.safetensors")) and (model_dir / ORBAX_SUBDIR).is_dir()


def _canonical(flat: dict[str, jax.Array], cfg: ModelConfig, tp: int) -> dict[str, jax.Array]:
    """Undo KV-head replication, so an Orbax checkpoint does not depend on the tp it was saved with."""
    replicas = kv_head_replicas(cfg, tp)
    if replicas == 1:
        return flat
    layout = family_of(cfg).param_layout(cfg, tp)
    out = dict(flat)
    for path, value in flat.items():
        if isinstance(layout[path], RepeatedHeads):
            heads = value.reshape(cfg.num_kv_heads, replicas, cfg.head_dim, *value.shape[1:])
            out[path] = heads[:, 0].reshape(cfg.kv_size, *value.shape[1:])
    return out


def save_orbax(params: dict, cfg: ModelConfig, tp: int, path: str | Path) -> None:
    import orbax.checkpoint as ocp

    path = Path(path).absolute()
    if path.exists():
        shutil.rmtree(path)
    with ocp.StandardCheckpointer() as ckptr:
        ckptr.save(path, _canonical(flatten(params), cfg, tp))


def restore_orbax(path: str | Path, cfg: ModelConfig, mesh, dtype=jnp.float32, expert_parallel: bool = False,
                  keep: Callable[[str], bool] | None = None) -> dict:
    """Restore into the mesh's sharding: each device reads its own slice from the Orbax files."""
    import orbax.checkpoint as ocp

    tp = tp_size(mesh)
    family = family_of(cfg)
    canonical = {p: s for p, s in family.param_layout(cfg, 1).items() if keep is None or keep(p)}
    target = {p: s for p, s in family.param_layout(cfg, tp).items() if keep is None or keep(p)}
    abstract = {}
    for path_, source in canonical.items():
        if target[path_].shape != source.shape:  # replicated KV heads: restored whole (they are small), repeated below
            sharding = replicated(mesh)
        else:
            sharding = logical_sharding(mesh, path_, source.shape, source.axes, expert_parallel)
        abstract[path_] = jax.ShapeDtypeStruct(source.shape, dtype, sharding=sharding)
    with ocp.StandardCheckpointer() as ckptr:
        flat = ckptr.restore(Path(path).absolute(), abstract)
    for path_, source in target.items():
        if source.shape != canonical[path_].shape:
            sharding = logical_sharding(mesh, path_, source.shape, source.axes, expert_parallel)
            flat[path_] = jax.device_put(repeat_kv_heads(flat[path_], cfg, tp), sharding)
    return unflatten(dict(flat), cfg.num_layers)


def convert_to_orbax(model_dir: str | Path, out_dir: str | Path, dtype: str | None = None) -> Path:
    """`jtp convert`: HF safetensors directory -> model directory with an Orbax checkpoint."""
    from jtp.parallel.sharding import make_mesh

    model_dir, out_dir = Path(model_dir), Path(out_dir)
    cfg = ModelConfig.from_dir(model_dir)
    if cfg.quantization is not None:
        raise CheckpointError(f"{model_dir}: a {cfg.quantization.method} checkpoint; `jtp convert` writes "
                              "full-precision Orbax checkpoints only (serve the quantized safetensors directly)")
    mesh = make_mesh(1)
    params = load_params(model_dir, cfg, mesh, resolve_dtype(cfg, dtype))
    out_dir.mkdir(parents=True, exist_ok=True)
    save_orbax(params, cfg, 1, out_dir / ORBAX_SUBDIR)
    # Everything but the weights travels along, so the result is a complete model directory.
    for f in model_dir.iterdir():
        if f.is_file() and not f.name.endswith(".safetensors") and f.name != "model.safetensors.index.json":
            shutil.copy2(f, out_dir / f.name)
    return out_dir
